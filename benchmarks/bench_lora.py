"""LoRA vs full fine-tuning of the same model on the same data, one run, steps interleaved:

- ``lora_step_time_ratio``: median LoRA step time / median full step time (rank 16 on every projection).
- ``lora_optimizer_bytes_ratio``: optimizer state bytes per device, LoRA / full.
- ``lora_peak_memory_ratio``: the compiled train step's peak bytes per device, LoRA / full.
- ``qlora_nf4_vs_bf16_peak_memory_ratio``: the LoRA step's compiled peak with the frozen base stored nf4 / bfloat16.

Absolute numbers beside each ratio under ``lora_detail``. A model where the projection weights dominate
(bench_perf's step model: d_model 256, 2 layers, vocabulary 256) on 8 simulated CPU devices (fsdp_tp).
"""

from __future__ import annotations

import dataclasses
import statistics
import time

import jax

from bench_perf import config, fixed_batch, random_corpus
from jaxtrain.adapt import lora as lora_lib
from jaxtrain.layout import peak_bytes
from jaxtrain.state import bytes_per_device
from jaxtrain.train import build
from jaxtrain.models.config import LlamaConfig, LoraConfig

MODEL = LlamaConfig(vocab_size=256, d_model=256, num_layers=2, num_heads=8, num_kv_heads=4, mlp_dim=1024, dtype="float32")
LORA = LoraConfig(rank=16, alpha=32.0)
REPEATS = 5
STEPS = 3


def _with_model(**changes):
    cfg = config(MODEL)
    return dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, **changes))


def _start(trainer):
    if trainer.cfg.model.lora.rank:
        return lora_lib.load_base(trainer.layout, None).start_state(trainer.layout)
    return trainer.init_state()


def run() -> dict:
    corpus = random_corpus(MODEL.vocab_size)
    trainers = {"full": build(_with_model(), corpus), "lora": build(_with_model(lora=LORA), corpus)}
    batch = fixed_batch(trainers["full"])
    states = {name: _start(t) for name, t in trainers.items()}
    times = {name: [] for name in trainers}
    for _ in range(REPEATS):  # interleaved: both see the same machine load
        for name, trainer in trainers.items():
            state = jax.block_until_ready(trainer.train_step(states[name], batch)[0])
            start = time.perf_counter()
            for _ in range(STEPS):
                state, _ = trainer.train_step(state, batch)
            states[name] = jax.block_until_ready(state)
            times[name].append((time.perf_counter() - start) / STEPS)
    step_s = {name: statistics.median(t) for name, t in times.items()}
    optimizer = {name: bytes_per_device(t.layout.abstract_state().opt_state) for name, t in trainers.items()}
    peak = {name: peak_bytes(t.train_step.memory_analysis()) for name, t in trainers.items()}
    for name, base in (("qlora_nf4", dict(base_quant="nf4", param_dtype="bfloat16")), ("lora_bf16", dict(param_dtype="bfloat16"))):
        peak[name] = peak_bytes(build(_with_model(lora=LORA, **base), corpus).train_step.memory_analysis())
    return {
        "lora_step_time_ratio": step_s["lora"] / step_s["full"],
        "lora_optimizer_bytes_ratio": optimizer["lora"] / optimizer["full"],
        "lora_peak_memory_ratio": peak["lora"] / peak["full"],
        "qlora_nf4_vs_bf16_peak_memory_ratio": peak["qlora_nf4"] / peak["lora_bf16"],
        "lora_detail": {"step_s": step_s, "optimizer_bytes_per_device": optimizer, "peak_bytes_per_device": peak,
                        "model": dataclasses.asdict(MODEL), "lora": dataclasses.asdict(LORA)},
    }
