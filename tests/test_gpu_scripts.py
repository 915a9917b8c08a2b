"""The GPU checks' own code, where there is no GPU: ``bench/gpu_throughput.py`` end to end in its CPU smoke mode,
and what ``bench/gpu_check.sh`` imports. A GPU machine without a package index may hold torch, transformers,
peft, accelerate and their usual company (pandas, pyarrow, tqdm, pytest) and nothing of ZenML, Ray or Great
Expectations; the script brings only the wheels of ``make gpu-wheels`` (omegaconf, hydra-core, antlr4)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
#: the project's dependencies that such a machine lacks and that the GPU checks must not import
ABSENT_THERE = {"ray", "zenml", "great_expectations", "apscheduler", "gguf", "vllm", "trl", "wandb", "mlflow",
                "sqlalchemy", "alembic", "playwright"}


def gpu_test_files() -> list[Path]:
    """The files ``bench/gpu_check.sh`` hands to pytest: those marking tests or the module gpu (a line that begins
    ``@pytest.mark.gpu`` or ``pytestmark = pytest.mark.gpu``), vLLM's left out."""
    marked = re.compile(r"^(@|pytestmark = )pytest\.mark\.gpu", re.MULTILINE)
    return sorted(path for path in (REPO / "tests").glob("test_*.py")
                  if marked.search(path.read_text()) and path.name != "test_vllm.py")


def test_the_gpu_checks_import_nothing_that_a_bare_gpu_machine_lacks():
    files = gpu_test_files()
    assert {"test_checkpoint.py", "test_shared_prefix.py", "test_fsdp_one_rank.py"} <= {path.name for path in files}
    files.append(REPO / "tests" / "test_distributed.py")  # test_fsdp_one_rank.py's child process imports it
    probe = (
        "import importlib.util, json, sys\n"
        # the tests' folder as pytest puts it first on the path (test files import their neighbours)
        f"sys.path[:0] = [{str(REPO)!r}, {str(REPO / 'bench')!r}, {str(REPO / 'tests')!r}]\n"
        f"for path in {[str(path) for path in files] + [str(REPO / 'bench' / 'gpu_throughput.py')]!r}:\n"
        "    spec = importlib.util.spec_from_file_location(path.rsplit('/', 1)[-1][:-3], path)\n"
        "    spec.loader.exec_module(importlib.util.module_from_spec(spec))\n"
        "print(json.dumps(sorted({name.split('.')[0] for name in sys.modules})))\n")
    out = subprocess.run([sys.executable, "-c", probe], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    loaded = set(json.loads(out.stdout.splitlines()[-1]))
    assert {"torch", "transformers", "omegaconf", "rlhf_core"} <= loaded  # the probe did import the modules
    assert loaded & ABSENT_THERE == set()


def test_gpu_throughput_runs_its_whole_path_on_the_cpu(tmp_path, monkeypatch, capsys):
    monkeypatch.syspath_prepend(str(REPO / "bench"))
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    import gpu_throughput

    results = gpu_throughput.main(["--smoke"])  # the hf engine alone: vLLM needs a GPU
    hf = results["hf"]
    assert 0 < hf["timing_s/gen"] < hf["timing_s/step"]
    # one timed step of 4 prompts x 2 samples, responses of 1 to 8 tokens (random weights may end a row early;
    # test_monitoring pins the count itself on a scripted rollout)
    response_tokens = hf["perf/rollout_tokens_per_s"] * hf["timing_s/gen"]
    assert 8 - 1e-6 <= response_tokens <= 64 + 1e-6
    # verl's throughput counts the prompts too
    assert hf["perf/throughput"] * hf["timing_s/step"] > response_tokens
    printed = capsys.readouterr().out
    assert "CPU smoke run" in printed and "[hf] step 1:" in printed and "x the 1.3k quoted for verl" in printed
