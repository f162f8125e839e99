"""Checkpoint cost for a ~1 GiB sharded state, all measured in one run on the same disk:

- ``disk_write_gbps``: raw sequential write (+ fsync) of the same number of bytes to a file.
- ``checkpoint_sync_save_s`` / ``checkpoint_save_gbps``: a synchronous save through jaxtrain's
  RunCheckpoints (Orbax, committed), and the bytes per second that gives.
- ``checkpoint_async_stall_s``: how long an asynchronous save blocks a loop of jitted "train steps"
  over the state (goal: <= 10% of the synchronous save); ``checkpoint_async_loop_s`` vs
  ``checkpoint_no_save_loop_s``: that loop's wall time with and without the background write (on a
  few CPU cores the write also competes with the steps for cores).
- ``checkpoint_restore_s``: restore onto the state's shardings.
- ``small_replicated_save_s``: saves of a state of small replicated arrays (norm-scale sized, on every device),
  first and second, with jaxtrain's ``REPLICA_SLICE_MIN_BYTES`` and with Orbax's default (every replicated array
  sliced between its replicas), side by side; ``small_replicated_first_save_ratio`` = Orbax's default / ours.

Writes under runs/ (next to real run directories); deletes what it wrote. Run as a script (benchmarks/gpu_h200.py's
``checkpoint_1gib`` row), it prints the results as one JSON line.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
from pathlib import Path

import grain
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxtrain import checkpoint as checkpoint_lib
from jaxtrain.checkpoint import RunCheckpoints
from jaxtrain.config import CheckpointConfig
from jaxtrain.state import TrainState

REPO = Path(__file__).resolve().parent.parent
STATE_BYTES = 1 << 30
ARRAYS = 16
LOOP_STEPS = 20
SMALL_ARRAYS = 64  # of 4 KiB each


def _position():
    """A grain iterator: the data position saved beside the state."""
    return grain.MapDataset.range(8).to_iter_dataset().__iter__()


def _state() -> TrainState:
    """A train state (what RunCheckpoints saves) whose parameters are ARRAYS arrays split over every device."""
    mesh = Mesh(np.array(jax.devices()), ("fsdp",))
    sharding = NamedSharding(mesh, PartitionSpec("fsdp"))
    rows = STATE_BYTES // ARRAYS // 4 // 1024
    # random values: constant arrays would compress and flatter the save throughput
    make = jax.jit(lambda key: jax.random.normal(key, (rows, 1024), jnp.float32), out_shardings=sharding)
    step = jax.device_put(jnp.zeros((), jnp.int32), NamedSharding(mesh, PartitionSpec()))
    return TrainState(step, {f"w{i}": make(jax.random.key(i)) for i in range(ARRAYS)}, opt_state=())


def _disk_write_s(directory: Path) -> float:
    block = np.random.default_rng(0).integers(0, 255, 64 << 20, dtype=np.uint8).tobytes()
    start = time.perf_counter()
    with open(directory / "raw.bin", "wb") as f:
        for _ in range(STATE_BYTES // len(block)):
            f.write(block)
        f.flush()
        os.fsync(f.fileno())
    elapsed = time.perf_counter() - start
    (directory / "raw.bin").unlink()
    return elapsed


def _loop_s(step, state, checkpoints: RunCheckpoints | None) -> tuple[float, float]:
    """(loop wall time, time the save call blocked the loop)."""
    state = jax.block_until_ready(step(state))
    blocked = 0.0
    start = time.perf_counter()
    for i in range(LOOP_STEPS):
        state = jax.block_until_ready(step(state))
        if i == 0 and checkpoints is not None:
            save_start = time.perf_counter()
            checkpoints.save(1, state, _position(), force=True)
            blocked = time.perf_counter() - save_start
    elapsed = time.perf_counter() - start
    if checkpoints is not None:
        checkpoints.close()
    return elapsed, blocked


def _small_replicated_save_s(directory: Path, meta: dict) -> dict:
    """First and second save of SMALL_ARRAYS replicated arrays: jaxtrain's threshold, then Orbax's default (its
    slicing programs compile on its own first save, so the order does not favour ours). Called after a save and a
    restore, whose one-time start-up would otherwise land on the first of them."""
    replicated = NamedSharding(Mesh(np.array(jax.devices()), ("data",)), PartitionSpec())
    step = jax.device_put(jnp.zeros((), jnp.int32), replicated)
    times, ours = {}, checkpoint_lib.REPLICA_SLICE_MIN_BYTES
    for name, min_bytes in (("jaxtrain", ours), ("orbax_default", None)):
        state = TrainState(step, {f"norm{i}": jax.device_put(np.full(1024, i, np.float32), replicated) for i in range(SMALL_ARRAYS)},
                           opt_state=())
        checkpoint_lib.REPLICA_SLICE_MIN_BYTES = min_bytes  # read when a manager is made
        try:
            checkpoints = RunCheckpoints(directory / f"small_{name}", CheckpointConfig(async_save=False), 2, meta)
            saves = []
            for saved_step in (1, 2):
                start = time.perf_counter()
                checkpoints.save(saved_step, state, _position(), force=True)
                saves.append(time.perf_counter() - start)
            checkpoints.close()
        finally:
            checkpoint_lib.REPLICA_SLICE_MIN_BYTES = ours
        times[name] = saves
    return {"small_replicated_save_s": times,
            "small_replicated_first_save_ratio": times["orbax_default"][0] / times["jaxtrain"][0]}


def run() -> dict:
    (REPO / "runs").mkdir(exist_ok=True)
    directory = Path(tempfile.mkdtemp(prefix="bench_checkpoint_", dir=REPO / "runs"))
    try:
        state = _state()
        size = sum(x.nbytes for x in jax.tree.leaves(state))
        disk_s = _disk_write_s(directory)

        meta = {"mesh": {"fsdp": jax.device_count()}, "rules": "benchmark", "processes": 1}
        sync = RunCheckpoints(directory / "sync", CheckpointConfig(async_save=False), 1, meta)
        start = time.perf_counter()
        sync.save(1, state, _position(), force=True)
        sync.close()
        sync_s = time.perf_counter() - start

        abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state)
        restorer = RunCheckpoints(directory / "sync", CheckpointConfig(), 1, meta)
        start = time.perf_counter()
        # the state alone: a grain iterator's own position is not the one a run's data iterator reads back, and its
        # restore failed, the checkpoint set aside and None returned in 0.02 s, read as the restore's time (2026-12-05
        # to 2026-12-07), the check of the values below passing on no values at all
        restored = jax.block_until_ready(restorer.restore_latest(abstract, None))
        restore_s = time.perf_counter() - start
        restorer.close()
        small = _small_replicated_save_s(directory, meta)  # after the first save and restore of the process: warm
        if restored is None:
            raise RuntimeError(f"the checkpoint in {directory / 'sync'} did not restore (the warning above says why)")
        assert all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(restored), jax.tree.leaves(state), strict=True))
        del restored

        # no donation: both loops start from the same state
        step = jax.jit(lambda s: s.replace(params=jax.tree.map(lambda x: x * 1.0001 + 1.0, s.params)))
        base_s, _ = _loop_s(step, state, None)
        async_s, stall_s = _loop_s(step, state, RunCheckpoints(directory / "async", CheckpointConfig(), 1, meta))
        return {
            "checkpoint_state_bytes": size,
            "disk_write_gbps": size / disk_s / 1e9,
            "checkpoint_sync_save_s": sync_s,
            "checkpoint_save_gbps": size / sync_s / 1e9,
            "checkpoint_async_stall_s": stall_s,
            "checkpoint_async_loop_s": async_s,
            "checkpoint_no_save_loop_s": base_s,
            "checkpoint_restore_s": restore_s,
        } | small
    finally:
        shutil.rmtree(directory, ignore_errors=True)


if __name__ == "__main__":  # a row of gpu_h200.py: the experiment and shape it passes do not apply to this state
    print(json.dumps(run()))
