"""The train state (parameters, optimizer state, step), its shardings, and its sharded creation."""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Callable

import flax.struct
import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxtrain import spikes as spikes_lib
from jaxtrain.memory import loss_scale as loss_scale_lib
from jaxtrain.adapt.adapters import join_frozen, split_frozen
from jaxtrain.memory.quant import quantized
from jaxtrain.partitioning import Rules, param_shardings, spec_axes
from jaxtrain.models.config import LlamaConfig
from jaxtrain.models.llama import Llama


@flax.struct.dataclass
class TrainState:
    step: jax.Array  # int32 scalar: optimizer updates applied so far
    params: dict  # nested dict of arrays, keyed like the NNX module tree: the trained ones (a LoRA run: the adapters)
    opt_state: Any
    loss_scale: Any = None  # float16 compute: {"scale", "counter"} of the dynamic loss scale (jaxtrain/memory/loss_scale.py)
    frozen: dict | None = None  # a LoRA run's base weights (never updated, not checkpointed); None: every parameter trains
    spikes: dict | None = None  # train.skip_spikes: the window of recent steps' loss and gradient norm (jaxtrain/spikes.py)

    @property
    def model_params(self) -> dict:
        """Every parameter of the model: the trained ones and the frozen base."""
        return join_frozen(self.frozen, self.params)


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """What the trainer knows of the model: its NNX graph, parameter shapes and logical axes."""

    graphdef: Any
    shapes: dict  # ShapeDtypeStruct per parameter
    logical_axes: dict  # PartitionSpec of logical axis names per parameter

    @property
    def num_params(self) -> int:
        return sum(x.size for x in jax.tree.leaves(self.shapes))


@functools.lru_cache(maxsize=16)
def model_spec(model_cfg: LlamaConfig) -> ModelSpec:
    """Built from an abstract model: nothing is allocated. Kept per model config (a frozen dataclass; the spec is
    read-only): tracing the model's construction was a sixth of tests/test_plan.py's time, whose plans make a layout
    of the same model for each configuration they weigh. A test that patches what the model's construction reads
    (a module's constant) clears it (``model_spec.cache_clear()``)."""
    abstract = nnx.eval_shape(lambda: quantized(Llama(model_cfg, rngs=nnx.Rngs(0)), model_cfg.quant))
    graphdef, state = nnx.split(abstract)
    return ModelSpec(graphdef, nnx.to_pure_dict(state), nnx.to_pure_dict(nnx.get_partition_spec(state)))


def elements_per_device(tree) -> int:
    """Elements one device holds of a tree of arrays or ShapeDtypeStructs carrying shardings."""
    return sum(math.prod(x.sharding.shard_shape(x.shape)) for x in jax.tree.leaves(tree))


def gathered_elements(x, axes) -> int:
    """Elements one device holds of ``x`` (an array or ShapeDtypeStruct carrying a NamedSharding) once it is
    all-gathered over those of the mesh ``axes`` it is split on (FSDP: the batch axes)."""
    sharding = x.sharding
    split = math.prod(sharding.mesh.shape[a] for a in spec_axes(sharding.spec) if a in axes)
    return math.prod(sharding.shard_shape(x.shape)) * split


def bytes_per_device(tree) -> int:
    """Bytes one device holds of a tree of arrays or ShapeDtypeStructs carrying shardings (exact)."""
    return sum(math.prod(x.sharding.shard_shape(x.shape)) * x.dtype.itemsize for x in jax.tree.leaves(tree))


@dataclasses.dataclass(frozen=True)
class Placement:
    """Where the state lives beyond the parameters' rules: the optimizer state's own rules (ZeRO-1/2: a rule
    set's ``optimizer_state:`` section), its memory kind (optim.offload: ``pinned_host``), and whether a
    float16 loss scale and a spike window (train.skip_spikes) are carried."""

    optimizer_rules: Rules
    optimizer_memory: str | None = None  # None: the device's default memory
    params_memory: str | None = None  # the trained parameters' memory kind (optim.offload of master weights); None: device
    loss_scale: bool = False
    spikes: bool = False


def state_shardings(spec: ModelSpec, tx: optax.GradientTransformation, rules: Rules, mesh: Mesh,
                    placement: Placement) -> TrainState:
    """Shardings of every TrainState leaf; optimizer moments follow their parameter's sharding under the optimizer
    state's own rules (the parameters' unless the rule set says otherwise). A LoRA run's base is ``frozen``, with no
    moments."""
    params, frozen = split_frozen(param_shardings(spec.logical_axes, spec.shapes, rules, mesh))
    moments = split_frozen(param_shardings(spec.logical_axes, spec.shapes, placement.optimizer_rules, mesh, "optimizer_state"))[0]
    replicated = NamedSharding(mesh, PartitionSpec())
    opt_state = optax.tree_map_params(
        tx, lambda _, sharding: sharding, jax.eval_shape(tx.init, split_frozen(spec.shapes)[0]), moments,
        transform_non_params=lambda _: replicated)
    if placement.optimizer_memory is not None:
        opt_state = jax.tree.map(lambda sharding: sharding.with_memory_kind(placement.optimizer_memory), opt_state)
    if placement.params_memory is not None:
        params = jax.tree.map(lambda sharding: sharding.with_memory_kind(placement.params_memory), params)
    return TrainState(step=replicated, params=params, opt_state=opt_state, frozen=frozen,
                      loss_scale={"scale": replicated, "counter": replicated} if placement.loss_scale else None,
                      spikes=jax.tree.map(lambda _: replicated, spikes_lib.initial_window(1)) if placement.spikes else None)


def in_device_memory(shardings):
    """The same shardings in the device's default memory (the step computes there on offloaded state)."""
    return jax.tree.map(lambda s: s.with_memory_kind("device"), shardings)


def abstract_state(spec: ModelSpec, tx: optax.GradientTransformation, shardings: TrainState, spike_window: int = 0) -> TrainState:
    """``spike_window``: the spike window's length, where ``shardings`` carry one."""
    params, frozen = split_frozen(spec.shapes)
    shapes = TrainState(step=jax.ShapeDtypeStruct((), jnp.int32), params=params, opt_state=jax.eval_shape(tx.init, params), frozen=frozen,
                        loss_scale=None if shardings.loss_scale is None else jax.eval_shape(loss_scale_lib.initial_state),
                        spikes=None if shardings.spikes is None else jax.eval_shape(lambda: spikes_lib.initial_window(spike_window)))
    return jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh), shapes, shardings)


def state_from_params(params: dict, tx: optax.GradientTransformation, shardings: TrainState, spike_window: int = 0) -> TrainState:
    """A fresh train state (step 0, new optimizer state) around given parameters, which it takes over."""
    return jax.jit(fresh_state(tx, shardings, spike_window), out_shardings=shardings, donate_argnums=0)(params)


def fresh_state(tx: optax.GradientTransformation, shardings: TrainState, spike_window: int = 0) -> Callable[[dict], TrainState]:
    """Every parameter of the model -> a train state at step 0 (to be traced inside jit), with a fresh loss scale
    where ``shardings`` carry one (float16), and an empty spike window of ``spike_window`` steps where they carry one."""

    def start(params: dict) -> TrainState:
        trained, frozen = split_frozen(params)
        return TrainState(step=jnp.zeros((), jnp.int32), params=trained, opt_state=tx.init(trained), frozen=frozen,
                          loss_scale=None if shardings.loss_scale is None else loss_scale_lib.initial_state(),
                          spikes=None if shardings.spikes is None else spikes_lib.initial_window(spike_window))

    return start


def state_initializer(model_cfg: LlamaConfig, tx: optax.GradientTransformation, seed: int,
                      shardings: TrainState, spike_window: int = 0) -> Callable[[], TrainState]:
    """A jitted initialiser with output shardings, so no parameter is ever whole on one device. Keep it to
    make more fresh states: it compiles on its first call only."""

    def init():
        return fresh_state(tx, shardings, spike_window)(nnx.to_pure_dict(nnx.state(Llama(model_cfg, rngs=nnx.Rngs(seed)))))

    return jax.jit(init, out_shardings=shardings)


def init_state(model_cfg: LlamaConfig, tx: optax.GradientTransformation, seed: int, shardings: TrainState) -> TrainState:
    return state_initializer(model_cfg, tx, seed, shardings)()
