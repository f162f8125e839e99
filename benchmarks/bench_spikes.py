"""train.skip_spikes side by side: the spike guard's cost (jaxtrain/spikes.py: a window of the last steps' loss and
gradient norm, its mean and deviation, the update kept or not, all inside the step) against the same step without it.
fsdp on the 8 devices, the window OLMo 2 trained with (6 standard deviations over 128 steps). Per row: XLA's compiled
peak and the step time, timed interleaved (one step of each in turn) so the ratio shares the machine's load.
"""

from __future__ import annotations

import jax

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
    return {"spikes": {"window": trainers["guarded"].cfg.train.spike_window,
                       "rows": {k: {m: round(v, 4) for m, v in r.items()} for k, r in rows.items()},
                       "step_time_guarded_over_plain": round(guarded["step_s"] / plain["step_s"], 3),
                       "compiled_peak_guarded_minus_plain_mib": round(guarded["compiled_peak_mib"] - plain["compiled_peak_mib"], 4)}}
