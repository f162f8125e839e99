"""Mixture-of-experts train-step time against a dense model with the same active parameters per token (one CPU
device, d_model 64, float32, interleaved repetitions in one run, so a noisy shared machine slows every contender alike):

- ``moe_vs_dense_ratio``: step time of 8 and 64 experts (top-2, each expert half the dense MLP, so a token's two
  experts hold as many weights as the dense MLP), dropless and capacity 1.25, over the dense model's;
- ``moe_dropless_over_capacity``: the dropless path's step time over the capacity path's, per expert count;
- ``moe_expert_parallel``: on the 8 CPU devices, 8 experts over expert 4 x data 2 (``dp_ep``): dropless (each device
  gathers its expert group's tokens and reduce-scatters its experts' outputs back) against capacity (all-to-alls),
  step times, their ratio and step_cost's expert-parallel bytes per device and step for each;
- ``moe_lora``: 8 experts, dropless, one device: LoRA (rank 8) on attention and every expert (PEFT's
  target_parameters) and on attention alone, beside training every weight: step times and the expert adapters'
  cost over attention-only adapters;
- ``moe_remat``: 8 experts, dropless and capacity, one device: ``model.remat=save_dots`` (which keeps the experts'
  rows, gate, up and output: jaxtrain/models/moe.py EXPERT_SAVED) against ``full``, step times and their ratio.

On CPUs ``jax.lax.ragged_dot`` runs as a dense product masked per group (every expert's weights against every
row), so the dropless path's cost grows with the expert count here; GPUs have grouped-matmul kernels.
"""

from __future__ import annotations

import dataclasses

import jax

from bench_perf import ONE_DEVICE, STEP_MODEL, _timed, config, fixed_batch, interleaved_medians, random_corpus
from jaxtrain.config import AxisSizes, MeshConfig
from jaxtrain.plan.step_cost import step_time
from jaxtrain.train import build
from jaxtrain.models.config import LoraConfig, MoEConfig

# a quarter of bench_perf's model width: 64 experts through CPU ragged_dot (every expert against every row) stay
# within seconds a step
MODEL = dataclasses.replace(STEP_MODEL, d_model=64, num_heads=4, num_kv_heads=2, mlp_dim=256)
TOP_K = 2
EXPERT_MLP = MODEL.mlp_dim // TOP_K
REPEATS = 3
CONTENDERS = {"dense": None} | {
    f"{experts}_{dispatch}": MoEConfig(num_experts=experts, top_k=TOP_K, dispatch=dispatch, capacity_factor=1.25)
    for experts in (8, 64) for dispatch in ("dropless", "capacity")}


EXPERT_PARALLEL = MeshConfig(ici=AxisSizes(data=2, expert=4))


def _contender(cfg, corpus, devices):
    trainer = build(cfg, corpus, devices)
    return trainer, (lambda state, b, step=trainer.train_step: step(state, b)[0], trainer.init_state())


def step_times() -> dict[str, float]:
    corpus = random_corpus(MODEL.vocab_size)
    contenders, batch = {}, None
    for name, moe in CONTENDERS.items():
        model = MODEL if moe is None else dataclasses.replace(MODEL, mlp_dim=EXPERT_MLP, moe=moe)
        trainer, contenders[name] = _contender(config(model, mesh=ONE_DEVICE, rules="dp"), corpus, jax.devices()[:1])
        batch = batch or fixed_batch(trainer)
    return interleaved_medians(contenders, batch, REPEATS)


def expert_parallel() -> dict:
    corpus = random_corpus(MODEL.vocab_size)
    contenders, traffic, batch = {}, {}, None
    for dispatch in ("dropless", "capacity"):
        moe = MoEConfig(num_experts=8, top_k=TOP_K, dispatch=dispatch, capacity_factor=1.25)
        cfg = config(dataclasses.replace(MODEL, mlp_dim=EXPERT_MLP, moe=moe), mesh=EXPERT_PARALLEL, rules="dp_ep")
        trainer, contenders[dispatch] = _contender(cfg, corpus, None)
        traffic[dispatch] = step_time(trainer.layout).traffic_bytes["expert"]
        batch = batch or fixed_batch(trainer)
    times = interleaved_medians(contenders, batch, REPEATS)
    return {"step_s": times, "dropless_over_capacity": times["dropless"] / times["capacity"],
            "predicted_expert_bytes_per_step": traffic}


def expert_adapters() -> dict:
    corpus = random_corpus(MODEL.vocab_size)
    contenders, batch = {}, None
    moe_model = dataclasses.replace(MODEL, mlp_dim=EXPERT_MLP, moe=MoEConfig(num_experts=8, top_k=TOP_K))
    for name, lora in (("full", LoraConfig()), ("lora_attention", LoraConfig(rank=8, targets="q,k,v,o")),
                       ("lora_attention_and_experts", LoraConfig(rank=8))):
        cfg = config(dataclasses.replace(moe_model, lora=lora), mesh=ONE_DEVICE, rules="dp")
        trainer, contenders[name] = _contender(cfg, corpus, jax.devices()[:1])
        batch = batch or fixed_batch(trainer)
    times = interleaved_medians(contenders, batch, REPEATS)
    return {"step_s": times, "experts_over_attention_only": times["lora_attention_and_experts"] / times["lora_attention"]}


def remat_policies() -> dict:
    corpus = random_corpus(MODEL.vocab_size)
    contenders, batch = {}, None
    for dispatch in ("dropless", "capacity"):
        moe = MoEConfig(num_experts=8, top_k=TOP_K, dispatch=dispatch, capacity_factor=1.25)
        for remat in ("full", "save_dots"):
            cfg = config(dataclasses.replace(MODEL, mlp_dim=EXPERT_MLP, moe=moe, remat=remat), mesh=ONE_DEVICE, rules="dp")
            trainer, contenders[f"{dispatch}_{remat}"] = _contender(cfg, corpus, jax.devices()[:1])
            batch = batch or fixed_batch(trainer)
    times = interleaved_medians(contenders, batch, REPEATS)
    return {"step_s": times, "save_dots_over_full": {d: times[f"{d}_save_dots"] / times[f"{d}_full"] for d in ("dropless", "capacity")}}


def run() -> dict:
    times = _timed("moe_step_times", step_times)
    return {
        "moe_step_s": times,
        "moe_vs_dense_ratio": {name: t / times["dense"] for name, t in times.items() if name != "dense"},
        "moe_dropless_over_capacity": {str(e): times[f"{e}_dropless"] / times[f"{e}_capacity"] for e in (8, 64)},
        "moe_expert_parallel": _timed("moe_expert_parallel", expert_parallel),
        "moe_lora": _timed("moe_lora", expert_adapters),
        "moe_remat": _timed("moe_remat", remat_policies),
    }
