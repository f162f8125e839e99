# `make train` and `make test` are the whole set-up on a fresh machine: each creates .venv if missing
# and installs the project into it first.
VENV := .venv
PY := $(VENV)/bin/python
INSTALLED := $(VENV)/.installed
PYTHON ?= python3

.PHONY: train test bench finetune-demo test-gpu-plan test-gpu-plan-next gpu-wheels gpu-dry-run test-jax-next

$(INSTALLED): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[test]'
	touch $@

train: $(INSTALLED)
	$(VENV)/bin/jaxtrain train tiny --run-dir runs/tiny

test: $(INSTALLED)
	$(PY) -m pytest -n 2 tests

# The code on the next jax (the GPU image's 0.11, which needs Python 3.12) beside our 0.10: the tests that need
# no torch, on the CPU. Not part of `make test`: it needs a python3.12 and about 1 GB of downloads. Every test file
# but those importing torch (test_hf, test_peft, test_moe_hf, test_finetune_demo) and test_plan_gpu (needs the CUDA
# plugin: make test-gpu-plan-next); the sft extra's transformers (no torch) renders test_sft's chat templates. Less the planner's
# estimate-vs-CPU-compile bounds (marker estimate_vs_cpu_compile): the CPU estimate is fitted to the pinned jax's
# XLA:CPU, and 0.11's compiles the planner's test configurations 10-65% smaller (README, "GPU: one command for a lent
# H200").
JAX_NEXT ?= 0.11.2
JAX_NEXT_PYTHON ?= python3.12
JAX_NEXT_VENV := .venv-jax-next
JAX_NEXT_TESTS ?= tests/test_model.py tests/test_attention.py tests/test_parity.py tests/test_config.py tests/test_data.py tests/test_checkpoint.py \
	tests/test_train_e2e.py tests/test_generate.py tests/test_grad_comm.py tests/test_pipeline.py tests/test_cpu_layouts.py \
	tests/test_compile_cache.py tests/test_host_malloc.py tests/test_step_profile.py tests/test_moe.py tests/test_hlo_report.py \
	tests/test_loss_chunk.py tests/test_memory.py tests/test_step_cost.py tests/test_placement.py tests/test_optim.py \
	tests/test_plan.py tests/test_spikes.py tests/test_observability.py tests/test_tokenizer.py tests/test_cli_errors.py \
	tests/test_distributed.py tests/test_xla_env.py tests/test_atomic.py tests/test_bench_runner.py tests/test_gpu_runner.py \
	tests/test_cluster_scripts.py tests/test_lora.py tests/test_lora_dropout.py tests/test_sft.py tests/test_step.py \
	tests/test_rule_sets.py
$(JAX_NEXT_VENV)/.installed: pyproject.toml Makefile
	test -x $(JAX_NEXT_VENV)/bin/python || $(JAX_NEXT_PYTHON) -m venv $(JAX_NEXT_VENV)
	$(JAX_NEXT_VENV)/bin/python -m pip install --quiet --upgrade pip
	$(JAX_NEXT_VENV)/bin/python -m pip install --quiet -e '.[mlflow,prometheus,sft]' "jax==$(JAX_NEXT)" "jaxlib==$(JAX_NEXT)" \
		pytest pytest-xdist tensorboard
	touch $@

test-jax-next: $(JAX_NEXT_VENV)/.installed
	$(JAX_NEXT_VENV)/bin/python -m pytest -n 2 $(JAX_NEXT_TESTS) -m "not estimate_vs_cpu_compile" -k "not transformers and not torch"

# CPU benchmark suite -> benchmarks/results/latest.json; ONLY=perf,checkpoint runs a subset
bench: $(INSTALLED)
	$(PY) benchmarks/run.py $(if $(ONLY),--only $(ONLY))

# Does LoRA learn? A tiny random Hugging Face Llama LoRA-fine-tuned to reverse words through `jaxtrain train`, two
# seeds, held-out exact match of greedy answers before and after (benchmarks/finetune_demo.py; README, "LoRA / QLoRA
# fine-tuning"); its keys, finetune_demo_*, merged into benchmarks/results/latest.json
finetune-demo: $(INSTALLED)
	$(PY) benchmarks/run.py --only finetune_demo

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

# The same with the GPU image's compiler: the next jax (JAX_NEXT, Python 3.12) and its CUDA 13 plugin (about 4.7 GB).
GPU_PLAN_NEXT_VENV := .venv-gpu-plan-next
$(GPU_PLAN_NEXT_VENV)/.installed: pyproject.toml
	test -x $(GPU_PLAN_NEXT_VENV)/bin/python || $(JAX_NEXT_PYTHON) -m venv $(GPU_PLAN_NEXT_VENV)
	$(GPU_PLAN_NEXT_VENV)/bin/python -m pip install --quiet --upgrade pip
	$(GPU_PLAN_NEXT_VENV)/bin/python -m pip install --quiet -e . "jax[cuda13]==$(JAX_NEXT)" pytest pytest-xdist
	touch $@

test-gpu-plan-next: $(GPU_PLAN_NEXT_VENV)/.installed
	JAX_SKIP_CUDA_CONSTRAINTS_CHECK=1 $(GPU_PLAN_NEXT_VENV)/bin/python -m pytest -n 2 tests/test_plan_gpu.py

# A lent GPU machine starts bare from its own image (Python 3.12, jax with its CUDA plugin, most of our
# dependencies) with no network: what it lacks (benchmarks/gpu_wheels.txt) travels as wheels in .whl/
# (git-ignored), and `benchmarks/gpu_h200.sh` there installs them and runs the GPU benchmark rows.
GPU_PYTHON_VERSION ?= 3.12
WHEELS ?= .whl
MANYLINUX := $(foreach tag,manylinux_2_28 manylinux_2_27 manylinux_2_24 manylinux_2_17 manylinux2014 manylinux1,--platform $(tag)_x86_64)
gpu-wheels:
	rm -rf $(WHEELS)
	$(PYTHON) -m pip download --quiet --no-deps --only-binary=:all: --implementation cp --python-version $(GPU_PYTHON_VERSION) \
		$(MANYLINUX) -d $(WHEELS) -r benchmarks/gpu_wheels.txt

# the same install and every row with tiny shapes, here on the CPU, in an environment like the image's (.venv-image)
gpu-dry-run:
	PYTHON=$(PYTHON) benchmarks/gpu_dry_run.sh
