"""optim.grad_sync side by side: with gradient accumulation (4 micro-batches), the data-parallel gradient sums once per
step against GSPMD's sums in every micro-batch's backward pass (jaxtrain/memory/grad_comm.py). Two layouts of the
8-device mesh: pure data parallelism (dp, data 8) and hybrid sharding (fsdp over 4 devices, data 2 across them: the
sums over data are the ones taken out of the loop). Per row: the bytes per device per step of the collectives over the
data axis, read from the compiled program with its loop trip counts; XLA's compiled peak; the step time, the
variants timed interleaved (one step of each in turn) so the ratios share the machine's load. On simulated CPU devices
a collective is a memory copy, so the step time shows the cost of the restructured passes, not the network time saved.
"""

from __future__ import annotations

import jax

from bench_memory import MIB, MODEL, interleaved_step_times
from jaxtrain.config import AxisSizes, Config, DataConfig, LogConfig, MeshConfig, OptimConfig, TrainConfig
from jaxtrain.layout import peak_bytes
from jaxtrain.plan import hlo_report
from jaxtrain.train import build

STEPS = 4  # timed steps per variant, after one warm-up step
MICROBATCHES = 4
LAYOUTS = {"dp": ("dp", (8, 1, 1)), "hsdp": ("fsdp", (2, 4, 1))}  # rule set, mesh data x fsdp x tensor


def data_sum_bytes(trainer) -> int:
    """Bytes per device per step of the compiled step's all-reduces and reduce-scatters over mesh axis data (scalars left out)."""
    collectives = hlo_report.report(trainer.train_step.as_text(), dict(trainer.mesh.shape)).collectives
    return sum(c.bytes * c.executions for c in collectives
               if c.kind in ("all-reduce", "reduce-scatter") and "data" in c.axes and c.bytes > 4 * c.tensors)


def _config(rules, mesh, grad_sync) -> Config:
    return Config(model=MODEL, data=DataConfig(seq_len=64), train=TrainConfig(steps=100, global_batch=32, microbatches=MICROBATCHES),
                  optim=OptimConfig(grad_sync=grad_sync), log=LogConfig(progress=False), mesh=MeshConfig(ici=AxisSizes(*mesh)), rules=rules)


def run() -> dict:
    from bench_perf import random_corpus

    corpus = random_corpus(MODEL.vocab_size, tokens=200_000)
    trainers, rows = {}, {}
    for layout, (rules, mesh) in LAYOUTS.items():
        for sync in ("microbatch", "step"):
            name = f"{layout}_{sync}"
            trainer = build(_config(rules, mesh, sync), corpus, jax.devices()[:8])
            assert (trainer.layout.grad_reduction is not None) == (sync == "step"), name
            rows[name] = {"data_sums_mib": data_sum_bytes(trainer) / MIB,
                          "compiled_peak_mib": peak_bytes(trainer.train_step.memory_analysis()) / MIB}
            trainers[name] = trainer
    for name, step_s in interleaved_step_times(trainers, STEPS).items():
        rows[name]["step_s"] = step_s
    ratios = {layout: {"data_sums_microbatch_over_step": rows[f"{layout}_microbatch"]["data_sums_mib"] / rows[f"{layout}_step"]["data_sums_mib"],
                       "step_time_step_over_microbatch": rows[f"{layout}_step"]["step_s"] / rows[f"{layout}_microbatch"]["step_s"]}
              for layout in LAYOUTS}
    return {"grad_sync": {"model_params": trainers["dp_step"].layout.spec.num_params, "microbatches": MICROBATCHES,
                          "rows": {k: {m: round(v, 4) for m, v in r.items()} for k, r in rows.items()},
                          "ratios": {k: {m: round(v, 3) for m, v in r.items()} for k, r in ratios.items()}}}
