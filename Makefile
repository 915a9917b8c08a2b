# The commands README names. `make test` and `make demo` set up the environment when needed.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: setup test lint clean

setup: $(STAMP)

# torch first, pinned: this exact version is the CPU build on the machine's disk; a loose
# requirement would pull a multi-GB CUDA build.
$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e ".[dev]"
	touch $(STAMP)

lint: setup
	$(VENV)/bin/ruff check --output-format concise .

test: lint
	$(VENV)/bin/pytest -q

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
