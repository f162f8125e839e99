"""The health guards' costs. train.skip_spikes side by side: the spike guard (jaxtrain/spikes.py: a window of the last
steps' loss and gradient norm, its mean and deviation, the update kept or not, all inside the step) against the same
step without it. fsdp on the 8 devices, the window OLMo 2 trained with (6 standard deviations over 128 steps). Per
row: XLA's compiled peak and the step time, timed interleaved (one step of each in turn) so the ratio shares the
machine's load. The non-finite guard's reduction over the update (step.py's update_norm, which has no switch) timed
on its own beside the plain step.
"""

from __future__ import annotations

import statistics
import time

import jax
import optax

from bench_memory import MIB, MODEL, interleaved_step_times
from jaxtrain.config import AxisSizes, Config, DataConfig, LogConfig, MeshConfig, TrainConfig
from jaxtrain.layout import peak_bytes
from jaxtrain.train import build

STEPS = 6  # timed steps per variant, after one warm-up step
GUARDS = {"plain": 0.0, "guarded": 6.0}  # train.skip_spikes


def run() -> dict:
    from bench_perf import random_corpus

    corpus = random_corpus(MODEL.vocab_size, tokens=100_000)
    configs = {name: Config(model=MODEL, data=DataConfig(seq_len=64), train=TrainConfig(steps=100, global_batch=16, skip_spikes=sigma),
                            log=LogConfig(progress=False), mesh=MeshConfig(ici=AxisSizes(1, 8, 1)), rules="fsdp")
               for name, sigma in GUARDS.items()}
    trainers = {name: build(cfg, corpus, jax.devices()[:8]) for name, cfg in configs.items()}
    rows = {name: {"compiled_peak_mib": peak_bytes(trainer.train_step.memory_analysis()) / MIB} for name, trainer in trainers.items()}
    for name, step_s in interleaved_step_times(trainers, STEPS).items():
        rows[name]["step_s"] = step_s
    guarded, plain = rows["guarded"], rows["plain"]
    norm_s, step_s = _update_norm_and_step_times(trainers["plain"])
    return {"update_norm": {"norm_s": round(norm_s, 5), "step_s": round(step_s, 4), "norm_over_step": round(norm_s / step_s, 4)},
            "spikes": {"window": trainers["guarded"].cfg.train.spike_window,
                       "rows": {k: {m: round(v, 4) for m, v in r.items()} for k, r in rows.items()},
                       "step_time_guarded_over_plain": round(guarded["step_s"] / plain["step_s"], 3),
                       "compiled_peak_guarded_minus_plain_mib": round(guarded["compiled_peak_mib"] - plain["compiled_peak_mib"], 4)}}


def _update_norm_and_step_times(trainer) -> tuple[float, float]:
    """Median times of the update-norm guard's reduction (``optax.tree.norm`` over a tree of the update's shapes and
    shardings, the trained parameters': each read once, the fsdp shards' partial sums added across the devices) run as
    its own program, and of the train step, one of each in turn. An upper bound on what the guard adds to a step: inside
    it XLA fuses the reduction with the update's own arithmetic, which reads the same values."""
    from bench_perf import fixed_batch

    state, batch = trainer.init_state(), fixed_batch(trainer)
    norm = jax.jit(optax.tree.norm)
    jax.block_until_ready(norm(state.params))  # compiled before the timing
    state, _ = trainer.train_step(state, batch)
    times = {"norm": [], "step": []}
    for _ in range(STEPS):
        start = time.perf_counter()
        jax.block_until_ready(norm(state.params))
        times["norm"].append(time.perf_counter() - start)
        start = time.perf_counter()
        state, metrics = trainer.train_step(state, batch)
        jax.block_until_ready(metrics)
        times["step"].append(time.perf_counter() - start)
    return statistics.median(times["norm"]), statistics.median(times["step"])
