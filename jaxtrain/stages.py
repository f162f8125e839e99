"""How a config's layer pipeline (jaxtrain/models/pipeline.py) maps onto the mesh: its checks and its schedule's numbers."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from jax.sharding import Mesh

from jaxtrain.config import Config
from jaxtrain.errors import UserError
from jaxtrain.mesh import describe_axes
from jaxtrain.partitioning import RULES_DIR, Rules, batch_shards, logical_ways
from jaxtrain.state import bytes_per_device
from jaxtrain.models.config import PipelineConfig
from jaxtrain.models.pipeline import STAGES, microbatches

if TYPE_CHECKING:  # jaxtrain.layout imports this module
    from jaxtrain.layout import Layout


@dataclasses.dataclass(frozen=True)
class Schedule:
    """A pipeline's shape: stages 1 means no pipeline."""

    stages: int
    microbatches: int  # per pass through the layers (per gradient-accumulation micro-batch)
    repeats: int

    @property
    def iterations(self) -> int:
        return self.repeats * self.microbatches + self.stages - 1

    @property
    def bubble(self) -> float:
        """Share of a pass each stage idles: (stages - 1) / (repeats * microbatches + stages - 1)."""
        return (self.stages - 1) / self.iterations

    def describe(self) -> str:
        """How the plan's header and the start-up summary name it."""
        return (f"pipeline {self.stages} stages x {self.repeats} repeat(s), {self.microbatches} micro-batches in flight per pass, "
                f"bubble {100 * self.bubble:.3g}%")


def schedule(cfg: Config, rules: Rules, mesh: Mesh) -> Schedule:
    stages = logical_ways(rules, mesh, STAGES)
    if stages == 1:
        return Schedule(1, 1, 1)
    return Schedule(stages, microbatches(cfg.model.pipeline, stages), cfg.model.pipeline.repeats)


def check_pipeline(cfg: Config, rules: Rules, mesh: Mesh, microbatches_auto: bool = False) -> Schedule:
    """The schedule, after checking it fits the model, the batch and the mesh (UserError otherwise). ``microbatches_auto``:
    the user wrote train.microbatches=auto (``cfg``'s 1 here), which the messages name instead."""
    split_on = rules.get(STAGES) or ()
    if split_on and logical_ways(rules, mesh, STAGES) == 1:
        # generate and export-hf take no key=value overrides: a --mesh file or --rules is what they can change
        unstaged = cfg.rules.removeprefix("pp_")
        instead = (f"rule set {unstaged} (--rules {unstaged}), the same without pp_"
                   if unstaged != cfg.rules and (RULES_DIR / f"{unstaged}.yaml").is_file() else "a rule set without pp_")
        raise UserError(f"rule set {cfg.rules} splits the layers into pipeline stages over mesh axis {', '.join(split_on)}, but the mesh "
                        f"({describe_axes(dict(mesh.shape))}) has size 1 there; give it a stage axis (mesh.ici.stage or mesh.dcn.stage, "
                        f"or a --mesh file with one), or use {instead}")
    s = schedule(cfg, rules, mesh)
    if s.stages == 1:
        return s
    if cfg.model.moe.num_experts:  # the router statistics and losses are not collected through the stages
        raise UserError(f"model.moe.num_experts={cfg.model.moe.num_experts}: mixture-of-experts layers do not run through pipeline "
                        f"stages yet (rule set {cfg.rules}); use an expert-parallel rule set without pp_ (dp_ep, fsdp_ep, fsdp_tp_ep)")
    if cfg.data.format == "sft":  # the layers see packed rows' segment ids and positions whole, not per micro-batch
        raise UserError(f"data.format=sft (packed instruction data) does not run through pipeline stages yet (rule set {cfg.rules}); "
                        "use a rule set without pp_ for fine-tuning")
    layers = cfg.model.num_layers
    if layers % (s.stages * s.repeats):
        raise UserError(f"model.num_layers={layers} does not split into {s.stages} stages x model.pipeline.repeats={s.repeats}; "
                        f"use a number of layers divisible by {s.stages * s.repeats}, or change the stages or repeats")
    rematted = cfg.model.remat_layers
    if rematted is not None and rematted % (s.stages * s.repeats):
        raise UserError(f"model.remat_layers={rematted} does not split over {s.stages} stages x model.pipeline.repeats={s.repeats}: each "
                        f"stage rematerialises the same number of its layers in each repeat; use a multiple of {s.stages * s.repeats}")
    if s.microbatches < s.stages:
        raise UserError(f"model.pipeline.microbatches={s.microbatches} is fewer than the {s.stages} pipeline stages; "
                        f"use at least {s.stages} (more shrink the bubble)")
    per_pass = cfg.train.global_batch // cfg.train.microbatches
    shards = batch_shards(rules, mesh)
    if microbatches_auto and per_pass % (s.microbatches * shards):  # then no count splits it: each pass holds global_batch / count
        raise UserError(f"train.global_batch={cfg.train.global_batch} does not split into model.pipeline.microbatches={s.microbatches} "
                        f"micro-batches over the {shards} batch shards at any micro-batch count train.microbatches=auto may choose; "
                        f"use a multiple of {s.microbatches * shards} (e.g. train.global_batch="
                        f"{-(-cfg.train.global_batch // (s.microbatches * shards)) * s.microbatches * shards})")
    if per_pass % (s.microbatches * shards):
        raise UserError(f"train.global_batch={cfg.train.global_batch} / train.microbatches={cfg.train.microbatches} = {per_pass} sequences "
                        f"do not split into model.pipeline.microbatches={s.microbatches} micro-batches over the {shards} batch shards; "
                        f"use a multiple of {s.microbatches * shards} per pass")
    return s


def stage_memory(layout: Layout, items: dict[str, int]) -> dict[str, int]:
    """The planner's per-device estimate ``items`` (plan.estimate) regrouped by what one pipeline stage holds. Every
    stage's devices hold the same: in this SPMD design each runs (and holds its share of) the embedding and the output
    layer, so the stage holding them is every stage. The parameters, optimizer state and gradients split between the
    stacked layers and the rest in the ratio of their parameter bytes on a device: the parameters in that of every
    parameter, the optimizer state and gradients in that of the trained ones (a LoRA run's adapters, all in the layers:
    its frozen base, the embedding and output tables included, has neither)."""
    def share(params) -> float:
        return bytes_per_device(params["layers"]) / bytes_per_device(params)

    state = layout.abstract_state()
    trained = sum(items[key] for key in ("optimizer state", "gradients", "gradient accumulator"))
    layers = share(state.model_params) * items["parameters"] + share(state.params) * trained
    return {
        "transformer layers": int(layers) + items.get("circular re-layout", 0),
        "embedding and output layer": int(items["parameters"] + trained - layers),
        "micro-batch activations in flight": items["activations"],
        "logits working set": items["logits and loss"],
        "layer backward working set": items["layer backward"],
    }


def pipelined_variants(cfg: Config) -> list[Config]:
    """The config with `stage` taking 2, 4 or 8 ways of its fsdp axis across nodes (rules pp_<rules>, 4 micro-batches
    per stage, then 2, then 1: the first the batch allows is kept by the caller), for the planner to weigh where
    FSDP's gathers cross the network: each stage then gathers only its own layers, over fewer nodes."""
    dcn = cfg.mesh.dcn
    if not (RULES_DIR / f"pp_{cfg.rules}.yaml").is_file() or dcn.fsdp < 2:
        return []
    out = []
    for stages in (2, 4, 8):
        if dcn.fsdp % stages == 0 and cfg.model.num_layers % stages == 0:
            mesh = dataclasses.replace(cfg.mesh, dcn=dataclasses.replace(dcn, fsdp=dcn.fsdp // stages, stage=dcn.stage * stages))
            out += [dataclasses.replace(cfg, rules=f"pp_{cfg.rules}", mesh=mesh,
                                        model=dataclasses.replace(cfg.model, pipeline=PipelineConfig(microbatches=per_stage * stages)))
                    for per_stage in (4, 2, 1)]
    return out
