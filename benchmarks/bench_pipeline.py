"""Pipeline bubble, measured: the train step on a `stage` mesh (rules pp_dp) beside the same model, batch and
devices without a pipeline (rules dp, every device on `data`), steps interleaved in one process. Every device
does the same useful work in both, so 1 - plain / pipelined step time is the share the pipeline adds: the
bubble (stages idle, here computing values never used) plus the shifts, next to the schedule's formula
(stages - 1) / (repeats x micro-batches + stages - 1). The embedding and output layer run on every stage (the
batch is split over `data` only), which adds to the measured share.

    python benchmarks/run.py --only pipeline        # or: ONLY=pipeline make bench (8 simulated CPU devices)
"""

from __future__ import annotations

import dataclasses
import statistics

from bench_perf import compiled_train_step, config, random_corpus, seconds_per_step
from jaxtrain.config import AxisSizes, MeshConfig
from jaxtrain.stages import Schedule
from jaxtrain.models.config import LlamaConfig, PipelineConfig

REPEATS = 3
STEPS_PER_REPEAT = 2
# layers dominate the step (small vocabulary), so the stages' share of the work is what is timed; small enough
# that a step takes about a second on the 2-core VM
MODEL = LlamaConfig(vocab_size=256, d_model=64, num_layers=8, num_heads=4, num_kv_heads=2, mlp_dim=256, dtype="float32")
GLOBAL_BATCH = 32
SEQ_LEN = 64
SETTINGS = [(2, 2, 1), (4, 4, 1), (4, 4, 2)]  # (stages, micro-batches, repeats) on 8 devices


def _config(stages: int, microbatches: int = 0, repeats: int = 1):
    model = dataclasses.replace(MODEL, pipeline=PipelineConfig(microbatches, repeats))
    mesh = MeshConfig(ici=AxisSizes(data=8 // stages, stage=stages))
    return config(model, mesh, "pp_dp" if stages > 1 else "dp", seq_len=SEQ_LEN, global_batch=GLOBAL_BATCH)


def run() -> dict:
    corpus = random_corpus(MODEL.vocab_size)
    contenders = {"plain": _config(1)} | {f"stages{s}_micro{m}_repeats{r}": _config(s, m, r) for s, m, r in SETTINGS}
    compiled = {}
    for name, cfg in contenders.items():
        _, (step, state), batch, _, _ = compiled_train_step(cfg, corpus)
        compiled[name] = [step, step(state, batch), batch]  # one warm-up step
    times = {name: [] for name in compiled}
    for _ in range(REPEATS):  # interleaved: machine noise falls on every contender alike
        for name, entry in compiled.items():
            seconds, entry[1] = seconds_per_step(entry[0], entry[1], entry[2], STEPS_PER_REPEAT)
            times[name].append(seconds)
    medians = {name: statistics.median(t) for name, t in times.items()}
    rows = []
    for (s, m, r), name in zip(SETTINGS, list(medians)[1:]):
        rows.append({"stages": s, "microbatches": m, "repeats": r, "step_s": medians[name], "plain_step_s": medians["plain"],
                     "measured_bubble": 1 - medians["plain"] / medians[name], "formula_bubble": Schedule(s, m, r).bubble})
    return {"pipeline_bubble": rows}

