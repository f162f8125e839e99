"""How a config maps onto the devices, and the train step lowered and compiled for it.

The trainer (train.py) and the planner (plan/estimate.py) both build on this module, so the planner reads the
very layout and step the trainer runs, and neither imports the other.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxtrain import config as config_lib
from jaxtrain.config import Config
from jaxtrain.data.batches import batch_fields
from jaxtrain.errors import UserError
from jaxtrain.mesh import build_mesh
from jaxtrain.optim import learning_rate_schedule, make_optimizer
from jaxtrain.memory import grad_comm
from jaxtrain.memory import offload
from jaxtrain.adapt.adapters import split_frozen
from jaxtrain.partitioning import (Rules, batch_sharding, batch_shards, check_rules_against_mesh, load_rules, load_state_rules,
                                  logical_ways, model_tracing, param_shardings, spec_axes)
from jaxtrain.stages import check_pipeline, schedule
from jaxtrain.state import ModelSpec, Placement, TrainState, abstract_state, in_device_memory, model_spec, state_shardings
from jaxtrain.step import make_eval_step, make_train_step
from jaxtrain.models.config import PipelineConfig
from jaxtrain.models.pipeline import STAGES


@dataclasses.dataclass(frozen=True)
class Layout:
    """How a config maps onto the devices: mesh, rules, model, optimizer, shardings. Checked, not compiled."""

    cfg: Config
    mesh: Mesh
    rules: Rules
    spec: ModelSpec
    tx: optax.GradientTransformation
    shardings: TrainState
    batch_sharding: NamedSharding
    grad_shardings: dict | None = None  # per parameter, where the gradients differ from the parameters (ZeRO-2)
    moment_shardings: dict | None = None  # per parameter, where the optimizer moments differ from them (ZeRO-1/2)

    @property
    def grad_reduction(self) -> grad_comm.GradReduction | None:
        """The gradients' own sum once per step (optim.grad_sync, grad_dtype), or None for GSPMD's: from the config, as
        the micro-batch count decides it and the planner tries several counts on one layout."""
        return grad_comm.grad_reduction(self.cfg, self.rules, self.mesh, self.shardings.params, self.shardings.frozen,
                                        self.grad_shardings)

    @property
    def replica_axes(self) -> tuple[str, ...]:
        """The batch axes whose devices hold whole weights, over which the gradients are summed (``optim.grad_sync``)."""
        return grad_comm.replica_axes(self.rules, self.mesh, self.shardings.params, self.shardings.frozen)

    def gradient_shardings(self) -> dict:
        return self.grad_shardings or self.shardings.params

    def optimizer_shardings(self) -> dict:
        return self.moment_shardings or self.shardings.params

    @property
    def spike_window(self) -> int:
        """The spike window's length (train.skip_spikes); 0: the state carries none."""
        return self.cfg.train.spike_window if self.cfg.train.skip_spikes else 0

    def abstract_state(self) -> TrainState:
        return abstract_state(self.spec, self.tx, self.shardings, self.spike_window)

    def abstract_batch(self) -> dict[str, jax.ShapeDtypeStruct]:
        shape = (self.cfg.train.global_batch, self.cfg.data.seq_len)
        return {k: jax.ShapeDtypeStruct(shape, dtype, sharding=self.batch_sharding) for k, dtype in batch_fields(self.cfg.data).items()}

    @property
    def tokens_per_step(self) -> int:
        return self.cfg.train.global_batch * self.cfg.data.seq_len

    @property
    def idle_axes(self) -> dict[str, int]:
        """Mesh axes of more than one device that split neither the batch nor any parameter nor the pipeline's stages:
        the devices along one repeat each other's work."""
        shardings = [self.batch_sharding, *jax.tree.leaves((self.shardings.params, self.shardings.frozen))]
        # a rule set may split the stages (layer_stages) over an axis that does not hold the stored layers (layers)
        used = {axis for sharding in shardings for axis in spec_axes(sharding.spec)} | set(self.rules.get(STAGES) or ())
        return {axis: size for axis, size in self.mesh.shape.items() if size > 1 and axis not in used}


def idle_axes_note(idle: dict[str, int], rules: str) -> str | None:
    """The start-up summary's and the plan's note on ``Layout.idle_axes``; None when there are none."""
    if not idle:
        return None
    named = ", ".join(f"{axis} {size}" for axis, size in idle.items())
    which = f"mesh axis {named} splits" if len(idle) == 1 else f"mesh axes {named} split"
    return (f"note: {which} neither the batch nor any parameter under rule set {rules}: the same work runs "
            f"{math.prod(idle.values())} times over; give those devices to data or fsdp, or use a rule set that maps them")


def unsplit_experts_note(layout: Layout) -> str | None:
    """The start-up summary's and the plan's note where the rule set splits a mixture of experts' experts over mesh axes
    of one device in all (an expert-parallel rule set on a mesh without an expert axis): it trains, every device holding
    every expert. None otherwise."""
    experts, axes = layout.cfg.model.moe.num_experts, tuple(layout.rules.get("experts") or ())
    if not experts or not axes or logical_ways(layout.rules, layout.mesh, "experts") > 1:
        return None
    return (f"note: rule set {layout.cfg.rules} splits the experts over mesh axis {', '.join(axes)}, of 1 device here: every "
            f"device holds all {experts} experts of each layer (no expert parallelism); set mesh.ici.{axes[0]} to a divisor "
            f"of {experts} above 1, or use a rule set without _ep")


def unused_pipeline_note(layout: Layout) -> str | None:
    """The start-up summary's and the plan's note where ``model.pipeline`` is set but the rule set makes no stages (a
    pp_ rule set on a mesh without them is refused): the layers run unpipelined and those keys change nothing. None
    otherwise."""
    pipeline = layout.cfg.model.pipeline
    if pipeline == PipelineConfig() or schedule(layout.cfg, layout.rules, layout.mesh).stages > 1:
        return None
    changed = ", ".join(f"model.pipeline.{field.name}={getattr(pipeline, field.name)}" for field in dataclasses.fields(pipeline)
                        if getattr(pipeline, field.name) != field.default)
    return (f"note: {changed} set, but rule set {layout.cfg.rules} makes no pipeline stages: the layers run unpipelined "
            f"and these keys change nothing; use a pp_ rule set on a mesh with a stage axis, or drop them")


def is_nvidia_gpu(device) -> bool:
    """Whether cuDNN's flash attention runs on ``device``: an NVIDIA GPU (its kind names the vendor; the
    older Tesla V100 and T4, whose kinds do not, lack the fused kernel anyway). Compile-only GPUs count."""
    return device.platform == "gpu" and device.device_kind.startswith("NVIDIA")


def make_layout(cfg: Config, devices: list | None = None, *, microbatches_auto: bool = False, train_batch: bool = True) -> Layout:
    """Check the config against the devices, mesh, rules and model parameters; no compilation. ``microbatches_auto``:
    the user wrote train.microbatches=auto, here at one pass (``cfg``'s 1), which the messages name instead.
    ``train_batch``: check that train.global_batch splits over the mesh's batch shards; False for the commands that only
    read a run's parameters (generate, export-hf), whose --mesh may have more batch shards than the run's batch had."""
    config_lib.check(cfg)
    mesh = build_mesh(cfg.mesh, devices)
    device = mesh.devices.flat[0]
    rules = load_rules(cfg.rules)
    check_rules_against_mesh(rules, mesh, cfg.rules)
    cfg = config_lib.resolve_for_devices(cfg, is_nvidia_gpu(device), cpu=device.platform == "cpu",  # before the model is built
                                         pipelined=schedule(cfg, rules, mesh).stages > 1)
    check_pipeline(cfg, rules, mesh, microbatches_auto)
    experts, expert_ways = cfg.model.moe.num_experts, logical_ways(rules, mesh, "experts")
    if experts % expert_ways:
        raise UserError(f"model.moe.num_experts={experts} is not divisible by the {expert_ways} ways rule set {cfg.rules} splits the "
                        f"experts over (mesh axes {', '.join(rules['experts'])}); use a multiple of {expert_ways} experts or a smaller expert axis")
    spec = model_spec(cfg.model)
    tx = make_optimizer(cfg, spec.logical_axes)
    state_rules = load_state_rules(cfg.rules)
    for section, section_rules in state_rules.items():
        check_rules_against_mesh(section_rules, mesh, f"{cfg.rules} ({section})")
    if cfg.optim.offload:
        offload.check_supported(mesh)
    placement = Placement(state_rules["optimizer_state"], offload.HOST if cfg.optim.offload else None, loss_scale=cfg.model.dtype == "float16",
                          params_memory=offload.HOST if cfg.optim.offload and offload.offloads_master_weights(cfg.model) else None,
                          spikes=cfg.train.skip_spikes > 0)
    shardings = state_shardings(spec, tx, rules, mesh, placement)
    differing = lambda section: None if state_rules[section] == rules else \
        split_frozen(param_shardings(spec.logical_axes, spec.shapes, state_rules[section], mesh, section))[0]  # noqa: E731
    t = cfg.train
    shards = batch_shards(rules, mesh)
    if train_batch and microbatches_auto and t.global_batch % shards:  # no count splits it then: each pass holds global_batch / count rows
        raise UserError(
            f"train.global_batch={t.global_batch} does not split over the {shards} batch shards of the mesh, at any micro-batch "
            f"count train.microbatches=auto may choose; use a multiple of {shards} (e.g. train.global_batch="
            f"{-(-t.global_batch // shards) * shards})")
    if train_batch and (t.global_batch // t.microbatches) % shards:
        raise UserError(
            f"train.global_batch={t.global_batch} / train.microbatches={t.microbatches} = {t.global_batch // t.microbatches} "
            f"sequences per micro-batch do not split over the {shards} batch shards of the mesh; use a multiple of {shards * t.microbatches}")
    layout = Layout(cfg, mesh, rules, spec, tx, shardings, batch_sharding(rules, mesh), differing("gradients"),
                    differing("optimizer_state"))
    layout.grad_reduction  # noqa: B018 -- optim.grad_dtype's problems with the rule set surface here, before any compile
    return layout


def with_train_steps(layout: Layout, steps: int) -> Layout:
    """``layout`` training for ``steps`` (train.epochs, counted once the data is read): the learning-rate schedule,
    which ends at train.steps, made again; the optimizer state it keeps, and so every sharding, is the same."""
    cfg = dataclasses.replace(layout.cfg, train=dataclasses.replace(layout.cfg.train, steps=steps))
    return dataclasses.replace(layout, cfg=cfg, tx=make_optimizer(cfg, layout.spec.logical_axes))


def lower_train_step(layout: Layout) -> jax.stages.Lowered:
    """Trace and lower the train step (no XLA compilation yet). Activation axes without a rule surface here, as a
    UserError."""
    cfg, shardings = layout.cfg, layout.shardings
    device_opt_state = in_device_memory(shardings.opt_state) if cfg.optim.offload else None
    train_fn = jax.jit(make_train_step(layout.spec.graphdef, layout.tx, learning_rate_schedule(cfg), cfg.train.microbatches,
                                       layer_norms=cfg.log.layer_every > 0, loss_chunk=cfg.train.loss_chunk,
                                       grad_shardings=layout.grad_shardings, device_opt_state=device_opt_state,
                                       loss_scale_period=cfg.optim.loss_scale_period, grad_reduction=layout.grad_reduction,
                                       device_params=_device_params(layout, shardings.params),
                                       dropout_seed=cfg.train.seed if cfg.model.lora.rank and cfg.model.lora.dropout else None,
                                       skip_spikes=cfg.train.skip_spikes),
                       in_shardings=(shardings, layout.batch_sharding), out_shardings=(shardings, _replicated(layout)),
                       donate_argnums=0)
    with model_tracing(layout.mesh, layout.rules, cfg.rules):
        return train_fn.lower(layout.abstract_state(), layout.abstract_batch())


def lower_eval_step(layout: Layout) -> jax.stages.Lowered:
    """Trace and lower the eval step (no XLA compilation yet): apart from the train step, which the planner and
    ``train.microbatches=auto`` compile alone."""
    cfg, shardings = layout.cfg, layout.shardings
    eval_fn = jax.jit(make_eval_step(layout.spec.graphdef, cfg.train.loss_chunk, _device_params(layout, shardings.model_params),
                                     cfg.train.microbatches),
                      in_shardings=(shardings.model_params, layout.batch_sharding), out_shardings=_replicated(layout))
    with model_tracing(layout.mesh, layout.rules, cfg.rules):
        return eval_fn.lower(layout.abstract_state().model_params, layout.abstract_batch())


def _device_params(layout: Layout, params_shardings):
    """``params_shardings`` in device memory where optim.offload keeps the master weights in host memory; else None."""
    cfg = layout.cfg
    return in_device_memory(params_shardings) if cfg.optim.offload and offload.offloads_master_weights(cfg.model) else None


def _replicated(layout: Layout) -> NamedSharding:
    return NamedSharding(layout.mesh, PartitionSpec())


def peak_bytes(memory) -> int:
    """Peak bytes per device from a compiled step's ``memory_analysis()``: inputs, outputs not written in place
    of a donated input, temporaries."""
    return memory.argument_size_in_bytes + memory.output_size_in_bytes - memory.alias_size_in_bytes + memory.temp_size_in_bytes


def compile_train_step(layout: Layout) -> tuple[jax.stages.Compiled, int]:
    """The compiled train step and its peak bytes per device."""
    train_step = lower_train_step(layout).compile()
    return train_step, peak_bytes(train_step.memory_analysis())
