"""glibc's malloc set to keep XLA:CPU's per-execution buffer mapped (jaxtrain/memory/host_malloc.py): page faults
counted in fresh processes, the choice of when to apply it, and its one-line error."""

import importlib.metadata
import importlib.util
import json
import subprocess
import sys

import pytest
from conftest import REPO, subprocess_env

from jaxtrain import cli
from jaxtrain.memory import host_malloc

# A fresh process (malloc must be set before jax starts its threads): a program whose temporary buffer is a
# materialised (6144, 6144) float32 outer product, 144 MiB, run repeatedly; minor page faults per run.
FAULTS_PER_RUN = """
import json, resource
from jaxtrain.memory import host_malloc
kept = host_malloc.configure()
import jax, jax.numpy as jnp
run = jax.jit(lambda x, v: (x[:, None] * x[None, :]) @ v)
x, v = jnp.ones(6144), jnp.ones(6144)
for _ in range(WARMUP):
    run(x, v).block_until_ready()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(RUNS):
    run(x, v).block_until_ready()
print(json.dumps({"kept": kept, "faults": (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / RUNS}))
"""
TEMP_PAGES = 6144 * 6144 * 4 // 4096
WARMUP, RUNS = 30, 20


def faults_per_run(choice: str) -> dict:
    env = subprocess_env() | {host_malloc.ENV: choice, "XLA_FLAGS": "--xla_force_host_platform_device_count=1"}
    program = FAULTS_PER_RUN.replace("WARMUP", str(WARMUP)).replace("RUNS", str(RUNS))
    done = subprocess.run([sys.executable, "-c", program], cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.splitlines()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc")
def test_kept_memory_serves_each_run_without_page_faults_where_the_system_setting_maps_it_afresh():
    system, kept = faults_per_run("system"), faults_per_run("auto")  # the tests run on the CPU: auto keeps
    assert system["kept"] is False and kept["kept"] is True
    assert system["faults"] > TEMP_PAGES * 0.9  # every run faults the buffer's pages in again
    # kept: a run takes a freed buffer back, already mapped, except where other allocations have taken part of it
    # since (the heap then grows by one buffer, mostly in the first runs; README, "Host memory on CPUs")
    assert kept["faults"] < TEMP_PAGES / 2


def test_applied_where_jax_computes_on_the_cpu_only(monkeypatch):
    assert host_malloc.computes_on_cpu({"JAX_PLATFORMS": "cpu"})
    assert not host_malloc.computes_on_cpu({"JAX_PLATFORMS": "cuda,cpu"})
    monkeypatch.setattr(importlib.metadata, "entry_points", lambda group: [])
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    assert host_malloc.computes_on_cpu({})  # no accelerator plugin installed
    monkeypatch.setattr(importlib.metadata, "entry_points", lambda group: ["xla_cuda12"] if group == "jax_plugins" else [])
    assert not host_malloc.computes_on_cpu({})  # jax's CUDA plugin
    monkeypatch.setattr(importlib.metadata, "entry_points", lambda group: [])
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: object() if name == "libtpu" else None)
    assert not host_malloc.computes_on_cpu({})  # a TPU host
    assert host_malloc.configure({"JAX_PLATFORMS": "cuda"}) is False
    assert host_malloc.configure({"JAX_PLATFORMS": "cpu", host_malloc.ENV: "system"}) is False


def test_an_unknown_choice_is_one_line_and_exit_status_2(monkeypatch, capsys, tmp_path):
    monkeypatch.setenv(host_malloc.ENV, "sometimes")
    assert cli.main(["checkpoints", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "JAXTRAIN_HOST_MALLOC='sometimes'" in err and "auto, keep, system" in err
