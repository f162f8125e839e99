"""What keeping freed host memory buys on CPUs (``JAXTRAIN_HOST_MALLOC``, jaxtrain/memory/host_malloc.py): the torch
peer's train step (bench_torch_peer's shapes, one simulated device) in fresh processes, as malloc must be set before
jax starts, alternating ``system``, ``keep`` and, where the library is installed, ``jemalloc``, so machine noise
falls on all alike.

- ``host_malloc_speedup``: step time with the system's malloc ÷ with freed memory kept (median over the processes).
- ``host_malloc_jemalloc_speedup``: the system's ÷ jemalloc's (null where jemalloc is not installed).
- ``host_malloc``: per setting, the step time, the minor page faults and the kernel (system) CPU time per step, and
  the process's resident memory after the timed steps (kept memory stays the process's: its cost).

    python benchmarks/bench_host_malloc.py             # the rounds, one JSON line (gpu_h200.py's host_malloc_cpu row)
    python benchmarks/bench_host_malloc.py --child     # one process's record (JAXTRAIN_HOST_MALLOC decides)

Always on the CPU (the processes get ``JAX_PLATFORMS=cpu``), also on a GPU machine, whose cores it then measures;
the arguments the GPU runner passes every row (experiment, mesh, overrides) are ignored.
"""

from __future__ import annotations

import json
import os
import re
import resource
import statistics
import subprocess
import sys
import time

ROUNDS_OF_PROCESSES = 2  # each a process per setting
WARMUP_STEPS, ROUNDS, STEPS_PER_ROUND = 3, 4, 5


def child() -> dict:
    """This process's record: malloc set from the environment before jax starts, then the peer's step timed."""
    from jaxtrain.memory import host_malloc

    host_malloc.reexec_with_jemalloc()  # JAXTRAIN_HOST_MALLOC=jemalloc: this process again, jemalloc preloaded
    kept = host_malloc.configure()
    # one simulated device, as bench_torch_peer: XLA:CPU's pool then has a thread per core
    os.environ["XLA_FLAGS"] = re.sub(r"--xla_force_host_platform_device_count=\d+", "", os.environ.get("XLA_FLAGS", "")) + \
        " --xla_force_host_platform_device_count=1"
    import dataclasses

    import jax
    import psutil
    from bench_perf import ONE_DEVICE, config, fixed_batch, random_corpus
    from bench_torch_peer import BATCH, PEER_MODEL, SEQ_LEN

    from jaxtrain.train import build

    cfg = config(PEER_MODEL, mesh=ONE_DEVICE, rules="dp", seq_len=SEQ_LEN, global_batch=BATCH)
    cfg = dataclasses.replace(cfg, log=dataclasses.replace(cfg.log, layer_every=0))
    trainer = build(cfg, random_corpus(PEER_MODEL.vocab_size), jax.devices()[:1])
    batch, state = fixed_batch(trainer), trainer.init_state()

    def steps(n):
        nonlocal state
        for _ in range(n):
            state = trainer.train_step(state, batch)[0]
        jax.block_until_ready(state)

    steps(WARMUP_STEPS)
    times, faults, kernel = [], 0, 0.0
    for _ in range(ROUNDS):
        before, start = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
        steps(STEPS_PER_ROUND)
        times.append((time.perf_counter() - start) / STEPS_PER_ROUND)
        after = resource.getrusage(resource.RUSAGE_SELF)
        faults, kernel = faults + after.ru_minflt - before.ru_minflt, kernel + after.ru_stime - before.ru_stime
    counted = ROUNDS * STEPS_PER_ROUND
    return {"malloc": host_malloc.allocator(), "kept": kept, "step_s": statistics.median(times), "page_faults_per_step": faults / counted,
            "kernel_s_per_step": kernel / counted, "rss_mib": psutil.Process().memory_info().rss / 2**20}


def run() -> dict:
    from jaxtrain.memory import host_malloc

    records = {"system": [], "keep": [], **({"jemalloc": []} if host_malloc.find_jemalloc() else {})}
    for _ in range(ROUNDS_OF_PROCESSES):
        for choice in records:
            env = os.environ | {"JAXTRAIN_HOST_MALLOC": choice, "JAX_PLATFORMS": "cpu"}
            done = subprocess.run([sys.executable, __file__, "--child"], env=env, capture_output=True, text=True)
            if done.returncode:
                raise RuntimeError(f"the {choice} process failed: {done.stderr[-2000:]}")
            records[choice].append(json.loads(done.stdout.splitlines()[-1]))
    expected = {"system": ("glibc", False), "keep": ("glibc", True), "jemalloc": ("jemalloc", True)}
    if any((r["malloc"], r["kept"]) != expected[choice] for choice, rs in records.items() for r in rs):
        raise AssertionError(f"malloc was not set as asked (not glibc?): {records}")
    median = {choice: {key: statistics.median(r[key] for r in rs) for key in rs[0] if key not in ("malloc", "kept")}
              for choice, rs in records.items()}
    return {"host_malloc_speedup": median["system"]["step_s"] / median["keep"]["step_s"],
            "host_malloc_jemalloc_speedup": median["system"]["step_s"] / median["jemalloc"]["step_s"] if "jemalloc" in median else None,
            "host_malloc": {key: {choice: median[choice][key] for choice in median} for key in median["keep"]}
            | {"processes_each": ROUNDS_OF_PROCESSES}}


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    print(json.dumps(child() if "--child" in sys.argv[1:] else run()))
