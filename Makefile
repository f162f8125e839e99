# `make train` and `make test` are the whole set-up on a fresh machine: each creates .venv if missing
# and installs the project into it first.
VENV := .venv
PY := $(VENV)/bin/python
INSTALLED := $(VENV)/.installed
PYTHON ?= python3

.PHONY: train test bench

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
