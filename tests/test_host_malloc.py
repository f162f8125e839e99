"""glibc's malloc set to keep XLA:CPU's per-execution buffer mapped, or jemalloc preloaded instead
(jaxtrain/memory/host_malloc.py): page faults counted in fresh processes, the choice of when to apply it, the
process started again with jemalloc, and the one-line errors."""

import importlib.metadata
import importlib.util
import json
import os
import subprocess
import sys

import pytest
from conftest import REPO, run_cli, subprocess_env

from jaxtrain import __main__ as command
from jaxtrain import cli
from jaxtrain.memory import host_malloc

# A fresh process (malloc must be set before jax starts its threads): a program whose temporary buffer is a
# materialised (6144, 6144) float32 outer product, 144 MiB, run repeatedly; minor page faults per run.
FAULTS_PER_RUN = """
import json, resource
from jaxtrain.memory import host_malloc
host_malloc.reexec_with_jemalloc()
kept = host_malloc.configure()
import jax, jax.numpy as jnp
run = jax.jit(lambda x, v: (x[:, None] * x[None, :]) @ v)
x, v = jnp.ones(6144), jnp.ones(6144)
for _ in range(WARMUP):
    run(x, v).block_until_ready()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(RUNS):
    run(x, v).block_until_ready()
print(json.dumps({"malloc": host_malloc.allocator(), "kept": kept, "faults": (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / RUNS}))
"""
TEMP_PAGES = 6144 * 6144 * 4 // 4096
WARMUP, RUNS = 30, 20
JEMALLOC = host_malloc.find_jemalloc()
needs_jemalloc = pytest.mark.skipif(JEMALLOC is None, reason="no jemalloc library (Debian: libjemalloc2; .ci/run installs it)")


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


@needs_jemalloc
def test_jemalloc_chosen_starts_the_process_again_with_it_preloaded_and_keeps_the_buffer():
    record = faults_per_run("jemalloc")  # `python -c PROGRAM` itself, started again by reexec_with_jemalloc
    assert record["malloc"] == "jemalloc" and record["kept"] is True
    assert record["faults"] < TEMP_PAGES / 2


@needs_jemalloc
def test_a_jemalloc_the_user_preloaded_is_reported_with_whether_its_settings_keep_freed_memory():
    program = "from jaxtrain.memory import host_malloc; print(host_malloc.configure(), host_malloc.allocator())"
    env = {k: v for k, v in subprocess_env().items() if k != "MALLOC_CONF"} | {"LD_PRELOAD": JEMALLOC}
    for extra, expected in (({}, "False jemalloc"), ({"MALLOC_CONF": host_malloc.JEMALLOC_CONF}, "True jemalloc")):
        done = subprocess.run([sys.executable, "-c", program], env=env | extra, capture_output=True, text=True, timeout=60)
        assert done.stdout.strip() == expected, done.stderr[-2000:]


@needs_jemalloc
def test_the_jaxtrain_command_starts_again_with_jemalloc_where_main_in_process_cannot(monkeypatch, capsys, tmp_path):
    (tmp_path / "checkpoints").mkdir()  # a run directory with none saved yet: the command lists nothing, status 0
    # main() in this (pytest) process: jemalloc cannot be preloaded any more, so one line says how
    monkeypatch.setenv(host_malloc.ENV, "jemalloc")
    assert cli.main(["checkpoints", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "LD_PRELOAD=" in err and host_malloc.JEMALLOC_CONF in err
    # the command (jaxtrain/__main__.py) starts itself again with it, so main's check passes
    done = run_cli("checkpoints", str(tmp_path), cwd=REPO, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]


@needs_jemalloc
def test_an_experiment_file_run_with_python_starts_again_with_jemalloc_as_the_command_does():
    """`python jaxtrain/experiments/tiny.py` is `jaxtrain train tiny` (README): it gets past the malloc check (a QA report:
    refused, 'for your own script ...') to the config's own one-line error."""
    env = subprocess_env() | {host_malloc.ENV: "jemalloc"}
    done = subprocess.run([sys.executable, str(REPO / "jaxtrain" / "experiments" / "tiny.py"), "train.steps=abc"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=120)
    assert (done.returncode, done.stderr) == (2, "jaxtrain: error: train.steps expects int, got 'abc'\n")


def test_jemalloc_chosen_but_missing_or_not_loading_is_one_line_and_exit_status_2(monkeypatch, capsys):
    def no_exec(*args):
        raise AssertionError("must not replace the test's process")

    monkeypatch.setattr(os, "execve", no_exec)
    monkeypatch.setattr(host_malloc, "find_jemalloc", lambda: None)
    monkeypatch.setenv(host_malloc.ENV, "jemalloc")
    monkeypatch.setattr(sys, "argv", ["jaxtrain", "checkpoints", "runs/none"])
    assert command.main() == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no jemalloc library found" in err and "apt install libjemalloc2" in err
    monkeypatch.setattr(host_malloc.platform, "system", lambda: "Darwin")
    with pytest.raises(host_malloc.UserError, match="Darwin's does not"):
        host_malloc.reexec_with_jemalloc({host_malloc.ENV: "jemalloc"})
    # started again with it preloaded and still not loaded (a broken library): stops instead of starting again
    with pytest.raises(host_malloc.UserError, match="still not its malloc"):
        host_malloc.reexec_with_jemalloc({host_malloc.ENV: "jemalloc", host_malloc.REEXECUTED: "1", "LD_PRELOAD": "libx.so"})


def test_jemalloc_is_preloaded_before_the_users_own_and_a_malloc_conf_the_user_set_is_kept(monkeypatch):
    """README, "Host memory on CPUs": MALLOC_CONF=dirty_decay_ms:-1,... unless you set MALLOC_CONF yourself; LD_PRELOAD
    and MALLOC_CONF are added to the environment, what else the user preloads stays preloaded."""
    monkeypatch.setattr(host_malloc, "find_jemalloc", lambda: "libjemalloc.so.2")
    monkeypatch.setattr(host_malloc.platform, "system", lambda: "Linux")
    users = host_malloc.jemalloc_environ({"LD_PRELOAD": "libmine.so", "MALLOC_CONF": "narenas:4", "HOME": "/home/u"})
    assert users == {"LD_PRELOAD": "libjemalloc.so.2 libmine.so", "MALLOC_CONF": "narenas:4", "HOME": "/home/u"}
    assert host_malloc.jemalloc_environ({}) == {"LD_PRELOAD": "libjemalloc.so.2", "MALLOC_CONF": host_malloc.JEMALLOC_CONF}


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
    applied = []
    monkeypatch.setattr(host_malloc, "keep_freed_memory", lambda: applied.append(True) or True)
    monkeypatch.setattr(host_malloc, "_kept", False)  # this process's own setting (conftest) aside
    assert host_malloc.configure({"JAX_PLATFORMS": "cuda"}) is False
    assert host_malloc.configure({"JAX_PLATFORMS": "cpu", host_malloc.ENV: "system"}) is False and not applied
    assert host_malloc.configure({"JAX_PLATFORMS": "cuda", host_malloc.ENV: "keep"}) is True and applied


# the heaps (arenas) of this process's malloc after a jaxtrain command run in it (malloc_info's XML, one <heap> each)
HEAPS_AFTER = """
import ctypes, sys, tempfile
from jaxtrain import cli
assert cli.main(sys.argv[1:]) == 0
libc = ctypes.CDLL(None)
libc.fopen.restype = ctypes.c_void_p
libc.malloc_info.argtypes, libc.fclose.argtypes = [ctypes.c_int, ctypes.c_void_p], [ctypes.c_void_p]
with tempfile.NamedTemporaryFile("r") as info:
    stream = libc.fopen(info.name.encode(), b"w")
    libc.malloc_info(0, stream)
    libc.fclose(stream)
    print(info.read().count("<heap nr="))
"""


@pytest.mark.skipif(host_malloc.allocator() != "glibc", reason="glibc's malloc_info counts the arenas")
def test_tokenize_leaves_malloc_to_the_tokenizers_threads(tmp_path):
    """tokenize (and train-tokenizer) never start jax, so they do not take XLA:CPU's malloc setting, even where keep is
    chosen: with one arena for every thread the tokenizers library's threads encoded 3.5x slower (8 MB of stdlib
    source: 7.5-8.6 s against 2.5 s). Each of its threads then allocates from an arena of its own."""
    from jaxtrain.data import stdlib_files, train_tokenizer

    text = tmp_path / "text"
    text.mkdir()
    for index, path in enumerate(stdlib_files()[1][:40]):
        (text / f"{index}.txt").write_bytes(path.read_bytes())
    train_tokenizer([str(text)], 300, tmp_path / "tok")
    args = ["tokenize", str(text), "--tokenizer", str(tmp_path / "tok"), "--out", str(tmp_path / "t.bin")]
    done = subprocess.run([sys.executable, "-c", HEAPS_AFTER, *args], env=subprocess_env() | {host_malloc.ENV: "keep"},
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert int(done.stdout) > 1, "tokenize ran with one malloc arena"


def test_an_unknown_choice_is_one_line_and_exit_status_2(monkeypatch, capsys, tmp_path):
    monkeypatch.setenv(host_malloc.ENV, "sometimes")
    assert cli.main(["checkpoints", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "JAXTRAIN_HOST_MALLOC='sometimes'" in err and "auto, keep, jemalloc, system" in err
