#!/usr/bin/env bash
# The GPU checks, in one run of under 8 minutes on one GPU, with nothing installed beyond torch,
# transformers, peft and accelerate (and what they bring: pandas, pyarrow, pyyaml, tqdm, pytest), no
# vLLM and no package index: the gpu-marked tests that do not need vLLM, then bench/gpu_throughput.py with
# the HF rollout in bf16 on Qwen2.5-0.5B shapes.
#
#   make gpu-wheels                        # here, once: the few pure-Python wheels such a machine lacks,
#                                          # into .whl/ (omegaconf, hydra-core, antlr4); copy .whl/ along
#   bash bench/gpu_check.sh [OUT_DIR]      # there: logs go to OUT_DIR (default: outputs/gpu_check)
#
# Python comes from $PYTHON, else .venv/bin/python, else python3. Wheels in $GPU_WHEELS (default .whl/)
# are installed into a private folder for this run only.
set -uo pipefail
cd "$(dirname "$0")/.."
out="${1:-outputs/gpu_check}"
mkdir -p "$out"
py="${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
wheels="${GPU_WHEELS:-.whl}"
if compgen -G "$wheels/*.whl" > /dev/null; then
  site="$(mktemp -d)/site"
  "$py" -m pip install --quiet --no-index --no-deps --no-compile --target "$site" "$wheels"/*.whl \
    || { echo "could not install the wheels in $wheels" >&2; exit 1; }
  export PYTHONPATH="$site:$PYTHONPATH"
fi
status=0
"$py" - <<'PY' 2>&1 | tee "$out/env.txt"
import torch, transformers
print("torch", torch.__version__, "transformers", transformers.__version__,
      "cuda", torch.cuda.is_available(), torch.cuda.get_device_name(0) if torch.cuda.is_available() else "-")
PY
# what the checks import, before anything runs: a missing package fails here, named, not in the middle
"$py" -c "import rlhf_core.main_ppo, rlhf_core.config" 2>&1 | tee "$out/imports.txt" | tail -1 \
  || { echo "the checks' imports fail on this Python (see above); on a machine with no package index, run" \
            "'make gpu-wheels' where there is one and copy .whl/ here" >&2; exit 1; }
# only the files that hold gpu-marked tests are collected (collecting the others would import ZenML,
# Great Expectations and Ray); vLLM's are left out
tests=$(grep -lE "^(@|pytestmark = )pytest\.mark\.gpu" tests/test_*.py | grep -v "tests/test_vllm")
# shellcheck disable=SC2086
timeout 200 "$py" -m pytest -q -rs -m gpu -p no:cacheprovider $tests 2>&1 | tee "$out/gpu_tests.txt" || status=1
timeout 250 "$py" bench/gpu_throughput.py --engines hf --steps 2 2>&1 | tee "$out/gpu_throughput.txt" || status=1
exit $status
