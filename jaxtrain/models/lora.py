"""Low-rank adapters (LoRA, Hu et al. 2021) on the projection weights: ``x @ W + (alpha / rank) * (x @ A) @ B``
with A (the weight's input dimensions..., rank) and B (rank, its output dimensions...), both ``nnx.LoRAParam``
carrying the weight's logical axes (the rank dimension is never split). B starts at zero, so a fresh adapter
leaves the model's output exactly unchanged.

Dropout (``model.lora.dropout``, as PEFT's): ``B(A(dropout(x))) * alpha / rank``, on the adapter's input only, and
only inside ``dropout_key(key)``, which the train step sets around its forward pass; evaluation, generation and
merging never do, so they see no dropout. The model gives each layer its own key (``layer_inputs``), each adapter
folds in its target's number and each batch row its row's number in the step's batch: every adapter of every layer
draws its own mask per row, and a row draws the same masks however the step cuts the batch (gradient accumulation's
micro-batches, device groups, a pipeline's micro-batches).

A mixture of experts' expert weights (experts, in, out) take ``ExpertLoRA`` adapters, in PEFT's form for Hugging
Face's fused expert parameters (``target_parameters``): per expert an A and a B, one adapter on the gate and up
weights together (one A, B's outputs the gate's then the up's) and one on the down weight; no dropout (PEFT has
none there). jaxtrain/models/moe.py multiplies the routed rows by them as by the weights (``expert_deltas``).

``adapt_block`` runs at the end of a block's construction: adapters are drawn after every base weight of the
layer, so a base initialised from a seed is the same with or without adapters; with ``base_quant`` the
projection weights are then replaced by their quantized storage.
"""

from __future__ import annotations

import contextlib
import contextvars

import jax
import jax.numpy as jnp
from flax import nnx

from jaxtrain.models.config import EXPERT_LORA, LORA_TARGETS, LlamaConfig, adapter_name
from jaxtrain.models.quant import QuantizedWeight, gathered_param


# the whole model's dropout key and the numbers of the pass's rows in the step's batch (set by the train step), then,
# inside one layer, that layer's key and the numbers of the rows it runs on (None: 0, 1, ...)
_MODEL_KEY = contextvars.ContextVar("lora_dropout_model_key", default=None)
_LAYER_KEY = contextvars.ContextVar("lora_dropout_layer_key", default=None)


@contextlib.contextmanager
def dropout_key(key: jax.Array, rows: jax.Array | None = None):
    """Training: adapters with ``model.lora.dropout`` > 0 drop their inputs, with masks drawn from ``key``; ``rows``:
    the numbers in the step's batch of the pass's rows (None: 0, 1, ...), each row's masks drawn with its number."""
    token = _MODEL_KEY.set((key, rows))
    try:
        yield
    finally:
        _MODEL_KEY.reset(token)


def layer_inputs(layer_state, num_layers: int):
    """What the scan over layers takes: the layers' parameters, and inside ``dropout_key`` also a key per layer
    (raw key data, stacked on the layers axis like the parameters)."""
    model_key = _MODEL_KEY.get()
    if model_key is None:
        return layer_state
    keys = jax.random.key_data(jax.random.split(model_key[0], num_layers))
    return layer_state, nnx.Variable(keys, out_sharding=("layers", None), eager_sharding=False)


@contextlib.contextmanager
def layer_scope(scanned, rows: jax.Array | None = None):
    """Inside one layer: yields its parameters from its slice of ``layer_inputs``, with its dropout key in force;
    ``rows``: which of the pass's rows the layer runs on (a pipeline's micro-batch), None for all of them in order. Each
    row's masks come from its number in the step's batch, so they do not depend on the schedule (a key per micro-batch
    index drew masks the plain layer scan never drew)."""
    if not isinstance(scanned, tuple):
        yield scanned
        return
    params, keys = scanned
    pass_rows = _MODEL_KEY.get()[1]
    if pass_rows is not None:
        rows = pass_rows if rows is None else pass_rows[rows]
    token = _LAYER_KEY.set((jax.random.wrap_key_data(keys[...]), rows))
    try:
        yield params
    finally:
        _LAYER_KEY.reset(token)


# The adapters are float32 master weights whatever model.param_dtype stores the base in, as PEFT keeps them
# (autocast_adapter_dtype): in bfloat16 an update below 2^-9 of its weight rounded away, so B, growing from zero by about
# the learning rate a step, stopped learning after some hundred steps. The forward reads them in the compute dtype.
ADAPTER_DTYPE = jnp.float32


class LoRA(nnx.Module):
    def __init__(self, base: nnx.Param, inputs: int, rank: int, alpha: float, rngs: nnx.Rngs, dropout: float = 0.0, salt: int = 0):
        shape, axes = base.shape, base.get_metadata()["out_sharding"]
        fan_in = 1
        for size in shape[:inputs]:
            fan_in *= size
        bound = fan_in ** -0.5  # PEFT's kaiming_uniform(a=sqrt(5)) on lora_A
        self.a = nnx.LoRAParam(jax.random.uniform(rngs.params(), (*shape[:inputs], rank), ADAPTER_DTYPE, -bound, bound),
                               out_sharding=(*axes[:inputs], None), eager_sharding=False)
        self.b = nnx.LoRAParam(jnp.zeros((rank, *shape[inputs:]), ADAPTER_DTYPE), out_sharding=(None, *axes[inputs:]),
                               eager_sharding=False)
        self.inputs = inputs
        self.scale = alpha / rank
        self.dropout = dropout
        self.salt = salt  # its target's number: adapters sharing an input (q, k, v) draw different masks

    def __call__(self, x: jax.Array) -> jax.Array:
        """The update to add to ``x @ W``: x's last ``inputs`` dimensions are contracted."""
        layer_key = _LAYER_KEY.get()
        if self.dropout and layer_key is not None:
            keep = _row_masks(jax.random.fold_in(layer_key[0], self.salt), layer_key[1], 1.0 - self.dropout, x.shape)
            x = jnp.where(keep, x / jnp.asarray(1.0 - self.dropout, x.dtype), jnp.zeros((), x.dtype))
        low = jnp.tensordot(x, gathered_param(self.a, x.dtype), axes=self.inputs)
        return _unsaved_up_projection(low, gathered_param(self.b, x.dtype)) * jnp.asarray(self.scale, x.dtype)


def _row_masks(key: jax.Array, rows: jax.Array | None, keep: float, shape: tuple[int, ...]) -> jax.Array:
    """Boolean masks of ``shape`` (batch rows first), each row's drawn from ``key`` with its number in ``rows`` folded in
    (None: 0, 1, ...)."""
    rows = jnp.arange(shape[0]) if rows is None else rows
    return jax.vmap(lambda row: jax.random.bernoulli(jax.random.fold_in(key, row), keep, shape[1:]))(rows)


class ExpertLoRA(nnx.Module):
    """The adapter of ``weights``, expert weights (experts, in, out) sharing their input: a (experts, in, rank) and
    b (experts, rank, len(weights), out), with the weights' logical axes (rank and the weights' index unsplit)."""

    def __init__(self, weights: list[nnx.Param], rank: int, alpha: float, rngs: nnx.Rngs):
        (experts, inputs, outputs), axes = weights[0].shape, weights[0].get_metadata()["out_sharding"]
        bound = inputs ** -0.5  # PEFT's kaiming_uniform(a=sqrt(5)) on lora_A (in features: the expert's input)
        self.a = nnx.LoRAParam(jax.random.uniform(rngs.params(), (experts, inputs, rank), ADAPTER_DTYPE, -bound, bound),
                               out_sharding=(axes[0], axes[1], None), eager_sharding=False)
        self.b = nnx.LoRAParam(jnp.zeros((experts, rank, len(weights), outputs), ADAPTER_DTYPE),
                               out_sharding=(axes[0], None, None, axes[2]), eager_sharding=False)
        self.scale = alpha / rank

    def factors(self, dtype) -> tuple[jax.Array, jax.Array]:
        """(a, b x alpha / rank) in ``dtype``: what ``expert_deltas`` multiplies by (scaled here, a float would not
        pass through jaxtrain/models/moe.py's shard_map)."""
        return self.a[...].astype(dtype), (self.b[...] * self.scale).astype(dtype)


def expert_deltas(x: jax.Array, matmul, a: jax.Array, b: jax.Array) -> list[jax.Array]:
    """The updates of an ``ExpertLoRA``'s weights for routed rows ``x``, ``matmul(rows, w)`` multiplying each row by
    its expert's ``w`` (experts, in, out) as jaxtrain/models/moe.py does by the weights: (x @ A) @ B, one per weight."""
    low = matmul(x, a)
    return [matmul(low, b[:, :, i]) for i in range(b.shape[2])]


def _unsaved_up_projection(low: jax.Array, b: jax.Array) -> jax.Array:
    """``low @ b`` (low (..., rank), b (rank, outputs...)) written with a unit batch dimension, so the dot-saving remat
    policies (``save_dots``, ``offload_dots``: dots *without* batch dimensions) recompute it in the backward instead
    of keeping it: it is as large as the base projection's output, which they keep already, and redoing it from the
    saved rank-sized ``low`` costs rank / d_model of the base matmul. (A nested ``jax.checkpoint`` does not do this:
    the outer policy keeps its output.) Measured on an H200, llama3_1b with rank-16 adapters on every projection at
    save_dots: a 77.9 GiB peak where the plain model's is 68.9 GiB, before this (56.9 GiB compiled after)."""
    return jax.lax.dot_general(low[None], b[None], (((low.ndim,), (1,)), ((0,), (0,))))[0]


def adapt_block(block: nnx.Module, cfg: LlamaConfig, rngs: nnx.Rngs) -> None:
    """Add the configured adapters to a freshly built block, then quantize its projection weights."""
    lora = cfg.lora
    if lora.rank:
        for target in lora.target_names():
            module_name, weight_name, inputs = LORA_TARGETS[target]
            if module_name == "mlp" and cfg.moe.num_experts:  # the experts' adapters, below
                continue
            module = getattr(block, module_name)
            salt = list(LORA_TARGETS).index(target)
            setattr(module, adapter_name(target), LoRA(getattr(module, weight_name), inputs, lora.rank, lora.alpha, rngs, lora.dropout, salt))
        for name in cfg.expert_adapters():
            weights = [getattr(block.mlp, weight) for weight in EXPERT_LORA[name][1]]
            setattr(block.mlp, adapter_name(name), ExpertLoRA(weights, lora.rank, lora.alpha, rngs))
    if cfg.base_quant != "none":
        for module_name, weight_name, inputs in LORA_TARGETS.values():
            module = getattr(block, module_name)
            setattr(module, weight_name, QuantizedWeight(getattr(module, weight_name), cfg.base_quant, inputs))


def adapter_delta(module: nnx.Module, target: str, x: jax.Array) -> jax.Array | None:
    """The adapter update of ``module``'s ``target`` projection for input ``x``, or None without one."""
    adapter = getattr(module, adapter_name(target), None)
    return None if adapter is None else adapter(x)
