"""8 simulated CPU devices for every test; must run before jax is imported."""

import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile

# Tests check behaviour, not the speed of XLA:CPU's code: its cheapest optimisation level halves compile times,
# which are most of the suite's time; and one LLVM module per program, not split for parallel code generation
# (the split was a tenth of a compile; about 15% off a small train step's). Subprocesses the tests start get the
# same flags (subprocess_env).
FAST_COMPILE_FLAGS = ("--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true "
                      "--xla_cpu_parallel_codegen_split_count=1")
# XLA:CPU's older fusion code generator, where this jaxlib still has it (0.10 does, 0.11 has only the MLIR one and
# aborts on the flag): it compiles the tests' train steps 2-3x faster. Asked once; xdist workers inherit the answer.
_OLD_EMITTERS = "--xla_cpu_use_fusion_emitters=false"
if "JAXTRAIN_TEST_OLD_EMITTERS" not in os.environ:
    os.environ["JAXTRAIN_TEST_OLD_EMITTERS"] = str(int(subprocess.run(
        [sys.executable, "-c", "import jax; jax.devices()"], capture_output=True,
        env=os.environ | {"XLA_FLAGS": _OLD_EMITTERS, "JAX_PLATFORMS": "cpu"}).returncode == 0))
if os.environ["JAXTRAIN_TEST_OLD_EMITTERS"] == "1":
    FAST_COMPILE_FLAGS += f" {_OLD_EMITTERS}"
os.environ["XLA_FLAGS"] = re.sub(r"--xla_force_host_platform_device_count=\d+", "", os.environ.get("XLA_FLAGS", "")) + \
    f" {FAST_COMPILE_FLAGS} --xla_force_host_platform_device_count=8"
os.environ.setdefault("JAX_PLATFORMS", "cpu")

# One compilation cache for the session, shared by every test and the processes they start (xdist workers inherit
# this environment): the suite compiles the same small programs over and over, and reading them back took a cold
# run from 15.9 to 12.5 min (2026-12-02). A new folder each session, so a local run takes the time CI's cold run
# takes; removed at the end. JAXTRAIN_TEST_CACHE=DIR keeps one across runs: a re-run on it took 6.6 min.
# XDG_CACHE_HOME is where train.compile_cache=auto (the default) puts the cache of `jaxtrain train`.
if "JAXTRAIN_TEST_CACHE" not in os.environ:
    os.environ["JAXTRAIN_TEST_CACHE"] = tempfile.mkdtemp(prefix="jaxtrain-tests-")
    _OWN_CACHE = True
else:
    _OWN_CACHE = False
os.environ["XDG_CACHE_HOME"] = os.environ["JAXTRAIN_TEST_CACHE"]
os.environ["JAX_COMPILATION_CACHE_DIR"] = os.path.join(os.environ["JAXTRAIN_TEST_CACHE"], "jaxtrain", "xla")
os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"  # the small programs too

import dataclasses  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402
import pytest  # noqa: E402

from jaxtrain.memory import host_malloc  # noqa: E402

host_malloc.configure()  # as `jaxtrain train` does on a CPU, before jax starts its threads

from jaxtrain.config import AxisSizes, Config, DataConfig, LogConfig, MeshConfig, OptimConfig, TrainConfig  # noqa: E402
from jaxtrain.models.config import LlamaConfig  # noqa: E402

REPO = Path(__file__).resolve().parent.parent


def small_config(rules: str = "fsdp_tp", mesh=(2, 2, 2), **model) -> Config:
    """A model small enough to compile in seconds whose dimensions divide every 8-device mesh; ``mesh``: ici sizes
    (data, fsdp, tensor[, stage[, expert]])."""
    model_cfg = LlamaConfig(**{"vocab_size": 64, "d_model": 32, "num_layers": 2, "num_heads": 4, "num_kv_heads": 2,
                               "mlp_dim": 64, "dtype": "float32"} | model)
    return Config(
        model=model_cfg,
        data=DataConfig(seq_len=16, val_fraction=0.1),
        train=TrainConfig(steps=5, global_batch=8, eval_batches=1),
        optim=OptimConfig(lr=1e-2, warmup_steps=0),
        log=LogConfig(every=1, progress=False),
        mesh=MeshConfig(ici=AxisSizes(*mesh), dcn=AxisSizes()),
        rules=rules,
    )


def with_(cfg: Config, **sections) -> Config:
    """Replace fields inside sections: with_(cfg, train={'steps': 3})."""
    return dataclasses.replace(cfg, **{k: dataclasses.replace(getattr(cfg, k), **v) for k, v in sections.items()})


@pytest.fixture(scope="session")
def corpus():
    """A fixed token corpus with structure to learn (a repeated random phrase): fast, identical every run."""
    from jaxtrain.data import Corpus

    phrase = np.random.default_rng(0).integers(0, 64, 397).astype(np.int32)
    return Corpus(np.tile(phrase, 50), np.tile(phrase, 5), 64, "repeated random phrase")


@pytest.fixture
def sigterm_outside():
    """The test's own SIGTERM handler while it runs a command in its process (the default one would end pytest where
    the command's handler misses the signal); yields it, to check the command leaves it in place."""
    class Outside(Exception):
        pass

    def outside(*_):
        raise Outside
    previous = signal.signal(signal.SIGTERM, outside)
    yield outside
    signal.signal(signal.SIGTERM, previous)


def subprocess_env() -> dict[str, str]:
    """The environment for a process a test starts: the real device count, the tests' compile flags, and this
    checkout's jaxtrain first on the path (a git worktree's tests ran the main checkout's code, which the editable
    install points to)."""
    path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)
    return os.environ | {"XLA_FLAGS": FAST_COMPILE_FLAGS, "PYTHONPATH": path}


def run_cli(*args: str, cwd: Path, timeout: int = 300) -> subprocess.CompletedProcess:
    env = subprocess_env()
    return subprocess.run([sys.executable, "-m", "jaxtrain.cli", *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=timeout)


def fill_disk(prefix: str | Path) -> list[str]:
    """Point every file this process holds open whose path starts with ``prefix`` at /dev/full, so each later write to
    it fails with ENOSPC, as on a full disk (without mounting a small file system, which needs root). Returns their paths."""
    full = os.open("/dev/full", os.O_WRONLY)
    filled = []
    try:
        for fd in os.listdir("/proc/self/fd"):
            try:
                target = os.readlink(f"/proc/self/fd/{fd}")
            except OSError:  # closed since it was listed
                continue
            if target.startswith(str(prefix)):
                os.dup2(full, int(fd))
                filled.append(target)
    finally:
        os.close(full)
    return filled


def pytest_unconfigure(config):
    if _OWN_CACHE:  # the process that made the session's cache folder (not an xdist worker)
        shutil.rmtree(os.environ["JAXTRAIN_TEST_CACHE"], ignore_errors=True)
