"""Memory techniques side by side, one model on the 8-device mesh: per-device compiled memory and step time for
dp, ZeRO-1, ZeRO-2, FSDP (ZeRO-3), optim.offload, float16 (with loss scaling), int8 and fp8 training, and
optim.grad_dtype=bfloat16 (gradients summed across the devices in bfloat16, with the bytes the sums carry).

Beside each compiled figure, the ZeRO paper's per-device formula for the parameter, gradient and optimizer-state
bytes: the paper's mixed-precision Adam counts 2 + 2 + 12 bytes per parameter (float16 weights and gradients;
float32 master weights, momentum and variance); jaxtrain keeps float32 weights (they are the master copy),
float32 gradients and two float32 moments, 4 + 4 + 8 bytes, split over the N batch shards as each stage says:
dp nothing, ZeRO-1 the optimizer state, ZeRO-2 also the gradients, ZeRO-3 (fsdp) everything. The state a step
takes as arguments (weights and optimizer state; gradients live in its temporaries) is compared with that
formula's weight and optimizer terms. Step times are measured interleaved (one step of each variant in turn),
so the ratios to dp share the machine's load. On CPUs offload moves nothing (one memory): its row shows the
placement works, not the saving.
"""

from __future__ import annotations

import dataclasses
import statistics
import time

import jax

from jaxtrain.config import AxisSizes, Config, DataConfig, LogConfig, MeshConfig, OptimConfig, TrainConfig
from jaxtrain.plan import hlo_report
from jaxtrain.layout import lower_train_step, peak_bytes
from jaxtrain.state import bytes_per_device
from jaxtrain.train import build
from jaxtrain.models.config import LlamaConfig

MODEL = LlamaConfig(vocab_size=2048, d_model=256, num_layers=4, num_heads=8, num_kv_heads=4, mlp_dim=768, dtype="float32")
DEVICES = 8
STEPS = 3  # timed steps per variant, after one warm-up step
MIB = 2**20
# variant -> (rule set, mesh data x fsdp x tensor, model overrides, optimizer overrides, ZeRO stage for the formula)
VARIANTS = {
    "dp": ("dp", (8, 1, 1), {}, {}, 0),
    "zero1": ("zero1", (8, 1, 1), {}, {}, 1),
    "zero2": ("zero2", (8, 1, 1), {}, {}, 2),
    "fsdp": ("fsdp", (1, 8, 1), {}, {}, 3),
    "offload": ("dp", (8, 1, 1), {}, {"offload": True}, 0),
    "float16": ("dp", (8, 1, 1), {"dtype": "float16"}, {}, 0),
    "bfloat16": ("dp", (8, 1, 1), {"dtype": "bfloat16"}, {}, 0),
    "int8": ("dp", (8, 1, 1), {"dtype": "bfloat16", "quant": "int8"}, {}, 0),
    "fp8": ("dp", (8, 1, 1), {"dtype": "bfloat16", "quant": "fp8"}, {}, 0),
    "grad_bf16": ("dp", (8, 1, 1), {}, {"grad_dtype": "bfloat16"}, 0),
}
# the gradient sums each of these carries per step, in bytes per device (the dp all-reduce halved in bfloat16)
GRADIENT_BYTES = ("dp", "zero2", "grad_bf16")


def zero_formula(params: int, stage: int, shards: int, weights: float, grads: float, optimizer: float) -> dict:
    """Per-device bytes of weights, gradients and optimizer state under ZeRO stage ``stage`` (0: plain dp)."""
    split = lambda b, from_stage: params * b / (shards if stage >= from_stage else 1)  # noqa: E731
    return {"weights": split(weights, 3), "gradients": split(grads, 2), "optimizer": split(optimizer, 1)}


def gradient_reduction_bytes(trainer) -> dict[str, int]:
    """Bytes per element type the step's gradient all-reduces and reduce-scatters carry per step (scalars left out).
    Read from the compiled program (loop trip counts known), except where optim.grad_dtype takes the sums out of the
    layer loop: there from the program right after partitioning, before XLA:CPU promotes bfloat16 all-reduces to
    float32 (a GPU keeps them bfloat16)."""
    mesh = dict(trainer.mesh.shape)
    narrow = trainer.cfg.optim.grad_dtype != "float32"
    text = hlo_report.partitioned_hlo(lower_train_step(trainer.layout)) if narrow else trainer.train_step.as_text()
    out: dict[str, int] = {}
    for c in hlo_report.report(text, mesh).collectives:
        if c.kind in ("all-reduce", "reduce-scatter") and c.bytes > 4 * c.tensors:
            for dtype in set(c.dtypes):
                out[dtype] = out.get(dtype, 0) + c.bytes * c.executions
    return out


def interleaved_step_times(trainers: dict, steps: int) -> dict[str, float]:
    """Median step time of each trainer: a fresh state and a fixed batch each, one warm-up step, then ``steps`` rounds of
    one step of each in turn, so the ratios between them share the machine's load."""
    from bench_perf import fixed_batch

    states = {name: trainer.init_state() for name, trainer in trainers.items()}
    batches = {name: fixed_batch(trainer) for name, trainer in trainers.items()}
    for name, trainer in trainers.items():
        states[name], _ = trainer.train_step(states[name], batches[name])  # warm-up
    jax.block_until_ready(states)
    times = {name: [] for name in trainers}
    for _ in range(steps):
        for name, trainer in trainers.items():
            start = time.perf_counter()
            states[name], metrics = trainer.train_step(states[name], batches[name])
            jax.block_until_ready(metrics)
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) for name, t in times.items()}


def _config(rules, mesh, model, optim) -> Config:
    return Config(model=dataclasses.replace(MODEL, **model), data=DataConfig(seq_len=64), train=TrainConfig(steps=100, global_batch=8),
                  optim=OptimConfig(**optim), log=LogConfig(progress=False), mesh=MeshConfig(ici=AxisSizes(*mesh)), rules=rules)


def run() -> dict:
    from bench_perf import random_corpus

    corpus = random_corpus(MODEL.vocab_size, tokens=200_000)
    trainers, rows = {}, {}
    for name, (rules, mesh, model, optim, stage) in VARIANTS.items():
        trainer = build(_config(rules, mesh, model, optim), corpus, jax.devices()[:DEVICES])
        memory = trainer.train_step.memory_analysis()
        state = trainer.layout.abstract_state()
        n = trainer.layout.spec.num_params
        ours = zero_formula(n, stage, DEVICES, 4, 4, 8)
        paper = zero_formula(n, stage, DEVICES, 2, 2, 12)
        compiled_state = bytes_per_device(state.params) + bytes_per_device(state.opt_state)
        rows[name] = {
            "compiled_peak_mib": peak_bytes(memory) / MIB, "compiled_arguments_mib": memory.argument_size_in_bytes / MIB,
            "compiled_temp_mib": memory.temp_size_in_bytes / MIB,
            "state_mib": compiled_state / MIB,
            "state_in_device_memory_mib": (compiled_state - (bytes_per_device(state.opt_state) if optim.get("offload") else 0)) / MIB,
            "formula_16_bytes_mib": sum(ours.values()) / MIB, "formula_paper_2_2_12_mib": sum(paper.values()) / MIB,
            # the step's state arguments against the formula's weight and optimizer terms (jaxtrain's bytes)
            "state_vs_formula": (memory.argument_size_in_bytes - bytes_per_device(trainer.layout.abstract_batch())) /
                                (ours["weights"] + ours["optimizer"]) - 1,
            "formula_gradients_mib": ours["gradients"] / MIB,
        }
        if name in GRADIENT_BYTES:
            rows[name] |= {f"gradient_sums_{dtype}_mib": n / MIB for dtype, n in gradient_reduction_bytes(trainer).items()}
        trainers[name] = trainer
    times = interleaved_step_times(trainers, STEPS)
    # ZeRO-2's gradients split: the temporaries it saves against ZeRO-1, beside the formula's gradient terms
    saved = rows["zero1"]["compiled_temp_mib"] - rows["zero2"]["compiled_temp_mib"]
    rows["zero2"]["gradient_saving_vs_formula"] = saved / (rows["zero1"]["formula_gradients_mib"] - rows["zero2"]["formula_gradients_mib"]) - 1
    for name in VARIANTS:
        rows[name] |= {"step_s": times[name], "step_vs_dp": times[name] / times["dp"]}
    return {"memory_techniques": {"model_params": trainers["dp"].layout.spec.num_params, "devices": DEVICES,
                                  "rows": {k: {m: round(v, 4) for m, v in r.items()} for k, r in rows.items()}}}

