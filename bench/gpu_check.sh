#!/usr/bin/env bash
# The GPU checks, in one run of under 8 minutes on one GPU, with nothing beyond torch, transformers,
# peft and accelerate (no vLLM, no package index): the gpu-marked tests that do not need vLLM, then
# bench/gpu_throughput.py with the HF rollout in bf16 on Qwen2.5-0.5B shapes.
#
#   bash bench/gpu_check.sh [OUT_DIR]      # logs go to OUT_DIR (default: outputs/gpu_check)
#
# Python comes from $PYTHON, else .venv/bin/python, else python3.
set -uo pipefail
cd "$(dirname "$0")/.."
out="${1:-outputs/gpu_check}"
mkdir -p "$out"
py="${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
status=0
"$py" - <<'PY' 2>&1 | tee "$out/env.txt"
import torch, transformers
print("torch", torch.__version__, "transformers", transformers.__version__,
      "cuda", torch.cuda.is_available(), torch.cuda.get_device_name(0) if torch.cuda.is_available() else "-")
PY
# the gpu-marked tests, vLLM's left out (they skip with a reason where vllm is not installed)
timeout 240 "$py" -m pytest -q -m gpu -p no:cacheprovider tests --ignore=tests/test_vllm.py 2>&1 \
  | tee "$out/gpu_tests.txt" || status=1
timeout 240 "$py" bench/gpu_throughput.py --engines hf --steps 2 2>&1 | tee "$out/gpu_throughput.txt" || status=1
exit $status
