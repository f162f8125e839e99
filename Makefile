# `make train` and `make test` are the whole set-up on a fresh machine: each creates .venv if missing
# and installs the project into it first.
VENV := .venv
PY := $(VENV)/bin/python
INSTALLED := $(VENV)/.installed
PYTHON ?= python3

.PHONY: train test bench test-gpu-plan

$(INSTALLED): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[test]'
	touch $@

train: $(INSTALLED)
	$(VENV)/bin/jaxtrain train tiny --run-dir runs/tiny

test: $(INSTALLED)
	$(PY) -m pytest -n 2 tests

# CPU benchmark suite -> benchmarks/results/latest.json; ONLY=perf,checkpoint runs a subset
bench: $(INSTALLED)
	$(PY) benchmarks/run.py $(if $(ONLY),--only $(ONLY))

# The planner compiling for GPUs this machine lacks needs jax's CUDA plugin (about 1 GB of NVIDIA
# libraries, no GPU needed); it lives in its own environment so the main one stays CPU-only.
GPU_PLAN_VENV := .venv-gpu-plan
$(GPU_PLAN_VENV)/.installed: pyproject.toml
	test -x $(GPU_PLAN_VENV)/bin/python || $(PYTHON) -m venv $(GPU_PLAN_VENV)
	$(GPU_PLAN_VENV)/bin/python -m pip install --quiet --upgrade pip
	$(GPU_PLAN_VENV)/bin/python -m pip install --quiet -e '.[test,gpu-plan]'
	touch $@

test-gpu-plan: $(GPU_PLAN_VENV)/.installed
	JAX_SKIP_CUDA_CONSTRAINTS_CHECK=1 $(GPU_PLAN_VENV)/bin/python -m pytest -n 2 tests/test_plan_gpu.py
