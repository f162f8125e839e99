"""Llama-family decoder in Flax NNX.

Every parameter carries logical axis names (``out_sharding`` metadata) and activations are
constrained with logical names; which mesh axes those map to is decided by the caller's rule set.
Layers are stacked on a leading ``layers`` axis and applied with ``jax.lax.scan`` so the compiled
program does not grow with depth (``scan_layers=False`` unrolls that loop; the parameters stay stacked).
``Llama.extend`` runs the same parameters and scan over new tokens with a key/value cache (prefill, then one
token per decoding step).
"""

from __future__ import annotations

import functools
import math
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from jaxtrain.models import pipeline
from jaxtrain.models.attention import chunked_causal_attention
from jaxtrain.models.config import LlamaConfig, RopeScaling
from jaxtrain.models.layers import BATCH, EMBED_ACT, LENGTH, MLP, RMSNorm, adapters_first, param, plus_delta
from jaxtrain.models.lora import adapt_block, adapter_delta, layer_inputs, layer_scope
from jaxtrain.models.moe import EXPERT_SAVED, MoE
from jaxtrain.models.quant import gathering_weights, weight
from jaxtrain.models.sharding import (constrain, constrain_mesh_axes, gathered, gathered_for_use, mesh_axes_of, split_axes,
                             split_over_batch_too)

EMBEDDING_AXES = ("vocab", "embed")  # the token embedding table's (the planner prices its lookup's gradient apart)
# one layer's cached keys or values: (batch, cache length, kv_heads, head_dim)
LAYER_CACHE = (BATCH, "cache_length", "activation_kv_heads", "activation_head_dim")

QKV_OUT = ("query_proj", "key_proj", "value_proj", "attn_out")
# cuDNN's fused (flash) attention forward, as jax 0.10 and 0.11 name its primitive in a jaxpr
FUSED_ATTENTION_FORWARD = "dot_product_attention_fwd_wrapper"


def _keeping_fused_attention(policy):
    """``policy``, and also keep what cuDNN's fused attention forward returns: its output and softmax statistics,
    (batch, length, heads) sized, which its backward kernel reads. Left to a policy of dots or names, the backward
    pass ran the whole attention forward again (llama3_1b at seq 4096, compiled for an H200: 3 cuDNN calls a layer,
    8.8e12 FLOPs a step more) to keep 2.1 GiB (16 layers x 132 MiB) off the device."""
    return lambda prim, *avals, **params: prim.name == FUSED_ATTENTION_FORWARD or policy(prim, *avals, **params)


def _offloading_either(policy_1, policy_2):
    """What ``policy_1`` offloads, else what ``policy_2`` says (jax's save_from_both_policies takes booleans only)."""
    def policy(prim, *avals, **params):
        decision = policy_1(prim, *avals, **params)
        return decision if isinstance(decision, tuple) else policy_2(prim, *avals, **params)  # tuple: an Offloadable
    return policy


REMAT_POLICY_FNS = {
    "none": None,
    "full": jax.checkpoint_policies.nothing_saveable,
    # weight matmul outputs are kept, the experts' too; attention score matmuls (batched dots: XLA attention) are
    # recomputed
    "save_dots": _keeping_fused_attention(jax.checkpoint_policies.save_from_both_policies(
        jax.checkpoint_policies.dots_with_no_batch_dims_saveable, jax.checkpoint_policies.save_only_these_names(*EXPERT_SAVED))),
    "save_qkv_out": _keeping_fused_attention(jax.checkpoint_policies.save_only_these_names(*QKV_OUT)),
    # the same activations kept in host memory instead of the device's, copied back for the backward pass
    "offload_dots": _offloading_either(
        jax.checkpoint_policies.offload_dot_with_no_batch_dims("device", "pinned_host"),
        jax.checkpoint_policies.save_and_offload_only_these_names(
            names_which_can_be_saved=(), names_which_can_be_offloaded=EXPERT_SAVED, offload_src="device", offload_dst="pinned_host")),
    "offload_qkv_out": jax.checkpoint_policies.save_and_offload_only_these_names(
        names_which_can_be_saved=(), names_which_can_be_offloaded=QKV_OUT, offload_src="device", offload_dst="pinned_host"),
}


def inverse_frequencies(head_dim: int, theta: float, scaling: RopeScaling = RopeScaling()):
    """Rotary inverse frequencies (head_dim // 2,), float32, rescaled by wavelength for ``llama3`` scaling
    (as Meta's reference code and transformers' ``_compute_llama3_parameters``); a numpy array, computed on the
    host (every input is static)."""
    inv_freq = 1.0 / (theta ** (np.arange(0, head_dim, 2, dtype=np.float32) / head_dim))
    if scaling.type != "llama3":
        return inv_freq
    wavelen = 2 * math.pi / inv_freq
    low_freq_wavelen = scaling.original_max_len / scaling.low_freq_factor
    high_freq_wavelen = scaling.original_max_len / scaling.high_freq_factor
    scaled = np.where(wavelen > low_freq_wavelen, inv_freq / scaling.factor, inv_freq)
    smooth = (scaling.original_max_len / wavelen - scaling.low_freq_factor) / (scaling.high_freq_factor - scaling.low_freq_factor)
    smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return np.where(medium, smoothed, scaled).astype(np.float32)


def rotary_tables(seq_len: int, head_dim: int, theta: float, scaling: RopeScaling = RopeScaling(), start=0, positions=None):
    """sin/cos of positions start .. start + seq_len - 1, shape (seq_len, head_dim // 2), float32;
    ``start`` may be traced (the first position of a decoding step). With ``positions`` (batch, seq_len), each
    token's own position instead, shape (batch, seq_len, head_dim // 2): packed sequences restart per example.

    With a static ``start`` and no ``positions`` the tables are computed on the host and reach the compiler as
    constants. Computed in the program from iota, a table is fused into every rotary multiply that broadcasts it,
    its sine and cosine recomputed for each batch row and head: with unrolled layers on XLA:CPU that was 5-8% of
    the train step (README, "Benchmarks and performance")."""
    inv_freq = inverse_frequencies(head_dim, theta, scaling)
    if positions is None and isinstance(start, int):
        angles = np.arange(start, start + seq_len, dtype=np.float32)[:, None] * inv_freq  # a float32 product, as transformers
        return tuple(f(angles.astype(np.float64)).astype(np.float32) for f in (np.sin, np.cos))
    if positions is None:
        positions = start + jnp.arange(seq_len)
    angles = positions.astype(jnp.float32)[..., None] * inv_freq
    return jnp.sin(angles), jnp.cos(angles)


def apply_rotary(x, sin, cos):
    """Rotate (batch, length, heads, head_dim) by position, half-split layout as in Llama; sin and cos are
    (length, head_dim // 2) or per sequence (batch, length, head_dim // 2)."""
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    sin, cos = sin[..., None, :], cos[..., None, :]
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)


class LayerCache(NamedTuple):
    """One layer's keys and values, (batch, max_length, kv_heads, head_dim), and how many positions hold tokens."""

    keys: jax.Array
    values: jax.Array
    length: jax.Array  # int32 scalar


class KVCache(NamedTuple):
    """Every layer's keys and values, stacked like the layers: (layers, batch, max_length, kv_heads, head_dim)."""

    keys: jax.Array
    values: jax.Array
    length: jax.Array  # int32 scalar: positions filled, the next token's position

    AXES = ("layers",) + LAYER_CACHE  # logical axes of keys and values

    @classmethod
    def zeros(cls, cfg: LlamaConfig, batch: int, max_length: int) -> KVCache:
        shape = (cfg.num_layers, batch, max_length, cfg.num_kv_heads, cfg.resolved_head_dim)
        keys, values = (constrain(jnp.zeros(shape, cfg.dtype), cls.AXES) for _ in range(2))
        return cls(keys, values, jnp.zeros((), jnp.int32))


class Attention(nnx.Module):
    def __init__(self, cfg: LlamaConfig, rngs: nnx.Rngs):
        d, h, k, hd = cfg.d_model, cfg.num_heads, cfg.num_kv_heads, cfg.resolved_head_dim
        pd = jnp.dtype(cfg.param_dtype)
        self.dtype = jnp.dtype(cfg.dtype)
        self.implementation = None if cfg.attention == "auto" else cfg.attention  # None: jax chooses
        self.wq = param(rngs, (d, h, hd), ("embed", "heads", "head_dim"), cfg.init_std, pd)
        self.wk = param(rngs, (d, k, hd), ("embed", "kv_heads", "head_dim"), cfg.init_std, pd)
        self.wv = param(rngs, (d, k, hd), ("embed", "kv_heads", "head_dim"), cfg.init_std, pd)
        # residual-branch outputs scaled down with depth (GPT-2 / Megatron init)
        out_std = cfg.init_std / (2 * cfg.num_layers) ** 0.5
        self.wo = param(rngs, (h, hd, d), ("heads", "head_dim", "embed"), out_std, pd)
        self.qkv_bias = cfg.qkv_bias
        if cfg.qkv_bias:
            self.bq = nnx.Param(jnp.zeros((h, hd), pd), out_sharding=("heads", "head_dim"), eager_sharding=False)
            self.bk = nnx.Param(jnp.zeros((k, hd), pd), out_sharding=("kv_heads", "head_dim"), eager_sharding=False)
            self.bv = nnx.Param(jnp.zeros((k, hd), pd), out_sharding=("kv_heads", "head_dim"), eager_sharding=False)

    def _project(self, x, name: str, axes, delta):
        """x @ w{name} (+ b{name}) + its adapter's ``delta`` for name in q, k, v."""
        out = plus_delta(jnp.einsum("btd,dhk->bthk", x, weight(getattr(self, f"w{name}"), self.dtype)), delta)
        if self.qkv_bias:
            out = out + getattr(self, f"b{name}")[...].astype(self.dtype)
        return constrain(out, axes)

    def __call__(self, x, sin, cos, segment_ids=None):
        """With ``segment_ids`` (batch, length), a token attends only to earlier tokens of its own segment: several
        examples packed in one sequence never see each other."""
        q, k, v = self._float16_widened(*self._qkv(x, sin, cos), cudnn=self.implementation == "cudnn")
        mask = None if segment_ids is None else (segment_ids[:, :, None] == segment_ids[:, None, :])[:, None]
        if self.implementation == "chunked":
            out = chunked_causal_attention(q, k, v, mask)
        else:
            out = jax.nn.dot_product_attention(q, k, v, mask=mask, is_causal=True, implementation=self.implementation)
        return self._output(out.astype(self.dtype))

    def extend(self, x, sin, cos, cache: LayerCache):
        """x (batch, length, d_model) at positions cache.length ...: its keys and values are written into
        the cache there, and each position attends to every cached position up to its own."""
        q, k, v = self._qkv(x, sin, cos)
        keys = constrain(jax.lax.dynamic_update_slice_in_dim(cache.keys, k.astype(cache.keys.dtype), cache.length, 1), LAYER_CACHE)
        values = constrain(jax.lax.dynamic_update_slice_in_dim(cache.values, v.astype(cache.values.dtype), cache.length, 1), LAYER_CACHE)
        query_positions = cache.length + jnp.arange(x.shape[1])
        visible = jnp.arange(keys.shape[1])[None, :] <= query_positions[:, None]  # causal; also hides unwritten slots
        # XLA attention: cuDNN's fused kernel brings nothing to a one-token query
        out = jax.nn.dot_product_attention(*self._float16_widened(q, keys, values, cudnn=False), mask=visible[None, None], implementation="xla")
        return self._output(out.astype(self.dtype)), LayerCache(keys, values, cache.length)

    def _float16_widened(self, *xs, cudnn: bool):
        """XLA's attention asks for float16 products accumulated in float32, which XLA:CPU rejects: in float16
        compute it gets float32 inputs (cuDNN's kernel takes float16)."""
        return tuple(x.astype(jnp.float32) for x in xs) if self.dtype == jnp.float16 and not cudnn else xs

    def _qkv(self, x, sin, cos):
        heads = (BATCH, LENGTH, "activation_heads", "activation_head_dim")
        kv_heads = (BATCH, LENGTH, "activation_kv_heads", "activation_head_dim")
        deltas = adapters_first(self, ("q", "k", "v"), x)
        q = self._project(x, "q", heads, deltas[0])
        k = self._project(x, "k", kv_heads, deltas[1])
        v = self._project(x, "v", kv_heads, deltas[2])
        q = checkpoint_name(apply_rotary(q, sin, cos), "query_proj")
        k = checkpoint_name(apply_rotary(k, sin, cos), "key_proj")
        v = checkpoint_name(v, "value_proj")
        return q, k, v

    def _output(self, out):
        out = constrain(out, (BATCH, LENGTH, "activation_heads", "activation_head_dim"))
        out = plus_delta(jnp.einsum("bthk,hkd->btd", out, weight(self.wo, self.dtype)), adapter_delta(self, "o", out))
        return checkpoint_name(constrain(out, EMBED_ACT), "attn_out")


class Block(nnx.Module):
    def __init__(self, cfg: LlamaConfig, rngs: nnx.Rngs):
        self.attn_norm = RMSNorm(cfg)
        self.attn = Attention(cfg, rngs)
        self.mlp_norm = RMSNorm(cfg)
        self.mlp = MoE(cfg, rngs) if cfg.moe.num_experts else MLP(cfg, rngs)
        adapt_block(self, cfg, rngs)  # LoRA adapters and a quantized base, when configured

    def __call__(self, x, sin, cos, segment_ids=None):
        return self._mlp_residual(constrain(x + self.attn(self.attn_norm(x), sin, cos, segment_ids), EMBED_ACT))

    def extend(self, x, sin, cos, cache: LayerCache):
        attended, cache = self.attn.extend(self.attn_norm(x), sin, cos, cache)
        return self._mlp_residual(constrain(x + attended, EMBED_ACT)), cache

    def _mlp_residual(self, x):
        return constrain(x + self.mlp(self.mlp_norm(x)), EMBED_ACT)


# The output projection: float32 logits from compute-dtype operands, and a backward in the compute dtype. Left to
# autodiff, the float32 cotangent of the logits turns both backward matmuls (the table's gradient and the hidden
# states') into float32 products: on the GPU compile of llama3_1b (batch 8 x 4096, bfloat16) two f32 gemms of
# 1.7e13 FLOPs each, at TF32's rate at best, beside (batch, length, vocab) float32 operands read twice. Casting the
# logits' gradient to the compute dtype first is what bfloat16 training does everywhere else; a float32 model is
# unchanged (the cast is a no-op).
#
# The table comes cast in its stored layout (else XLA moves the cast behind the gather and gathers float32), is laid
# out as the product needs it (FSDP: gathered) once, and is saved so: the backward's two products use that copy. Left
# to GSPMD, the backward's product of the logits' gradient and the table gathered it again wherever XLA did not find
# the two gathers the same (fsdp_tp with data > 1: both in one combined all-gather, twice the table's bytes over fsdp).
@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _project_to_vocab(equation: str, table_axes: tuple[str, str], x: jax.Array, table: jax.Array) -> jax.Array:
    return _project_to_vocab_fwd(equation, table_axes, x, table)[0]


def _laid_out_for_use(table: jax.Array, table_axes: tuple[str, str]) -> jax.Array:
    """The table, stored by logical ``table_axes``, laid out as the activations' counterparts (FSDP: gathered)."""
    return constrain(gathered(table, table_axes), tuple(f"activation_{axis}" for axis in table_axes))


def _project_to_vocab_fwd(equation, table_axes, x, table):
    table = _laid_out_for_use(table, table_axes)
    return jnp.einsum(equation, x, table, preferred_element_type=jnp.float32), (x, table)


def _project_to_vocab_bwd(equation, table_axes, residuals, grad):
    x, table = residuals
    _, vjp = jax.vjp(lambda x, table: jnp.einsum(equation, x, table), x, table)
    return vjp(grad.astype(x.dtype))


_project_to_vocab.defvjp(_project_to_vocab_fwd, _project_to_vocab_bwd)


# A loss over the logits in chunks of positions (train.loss_chunk: one chunk's float32 logits live at a time, remade
# in the backward). The table is laid out as the product needs it (FSDP: gathered) once for the forward's loop over
# the chunks and kept for the backward's: each chunk through _project_to_vocab under jax.checkpoint, XLA gathered it
# in every chunk (llama3_70b_qlora in 8 chunks: 47 GiB a step more than once a pass). Each chunk's gradient of a
# gathered table is reduce-scattered as it is made, over the gather axes and the batch's other axes at once, into a
# sum in the stored dtype split over both, gathered back over the latter after the loop: through autodiff, XLA
# reduce-scattered it over fsdp in each chunk and summed it over data after the loop; summed whole over the loop, it
# would hold a gathered gradient the table's size. A frozen table (a LoRA run's) gets no gradient at all.
@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2, 3))
def _chunked_loss(loss: Callable, equation: str, table_axes: tuple[str, str], dtype, x: jax.Array, targets: jax.Array,
                  table: jax.Array) -> jax.Array:
    return _chunk_losses(loss, equation, x, targets, _lay_out_for_logits(table_axes, dtype, table))


def _lay_out_for_logits(table_axes, dtype, table):
    """The stored table cast to the compute dtype where it lies (else XLA moves the cast behind the gather and gathers
    float32), then laid out for the product."""
    return _laid_out_for_use(constrain(table.astype(dtype), table_axes), table_axes)


def _chunk_logits(equation, x, table):
    return constrain(jnp.einsum(equation, x, table, preferred_element_type=jnp.float32), (BATCH, LENGTH, "activation_vocab"))


def _chunk_losses(loss, equation, x, targets, table):
    return jax.lax.map(lambda chunk: loss(_chunk_logits(equation, chunk[0], table), chunk[1]), (x, targets))


def _chunked_loss_fwd(loss, equation, table_axes, dtype, x, targets, table):
    role = "trained" if table.perturbed else "frozen"  # a LoRA run's frozen table gets no gradient at all
    x, targets, table = x.value, targets.value, table.value
    laid = _lay_out_for_logits(table_axes, dtype, table)
    # a gathered table kept for the backward (gathered again, its traffic twice); an ungathered one cast again there
    kept = laid if gathered_for_use("embed") else None
    return _chunk_losses(loss, equation, x, targets, laid), (x, targets, {role: table}, kept)


def _chunked_loss_bwd(loss, equation, table_axes, dtype, residuals, grad):
    x, targets, stored, kept = residuals
    (role, table), = stored.items()
    laid = _lay_out_for_logits(table_axes, dtype, table) if kept is None else kept
    over_batch = functools.partial(split_over_batch_too, logical_axes=table_axes, axis="embed", batch_axis=BATCH)

    def chunk(table_grad, inputs):
        x, targets, grad = inputs
        _, loss_vjp = jax.vjp(lambda logits: loss(logits, targets), _chunk_logits(equation, x, laid))
        _, product_vjp = jax.vjp(lambda x, table: jnp.einsum(equation, x, table), x, laid)
        x_grad, laid_grad = product_vjp(loss_vjp(grad)[0].astype(x.dtype))  # the backward's products in the compute dtype
        return (None if role == "frozen" else table_grad + over_batch(laid_grad).astype(table.dtype)), x_grad

    # a gathered table's sum is kept split over the batch through the loop and laid out as stored after it; an
    # ungathered one's is left to GSPMD, which sums it once after the loop (and splits it as ZeRO-2 keeps it)
    held = over_batch if kept is not None else (lambda g: g)
    table_grad, x_grad = jax.lax.scan(chunk, None if role == "frozen" else held(jnp.zeros_like(table)), (x, targets, grad))
    return x_grad, None, table_grad if role == "frozen" or kept is None else constrain(table_grad, table_axes)


_chunked_loss.defvjp(_chunked_loss_fwd, _chunked_loss_bwd, symbolic_zeros=True)


# The embedding lookup, where the batch is split over (at least) the mesh axes the table's columns are
# (Llama._embed_tokens). The table's embed dimension is laid out as the activations' before the lookup
# (FSDP all-gathers it): rows gathered from a table split on embed come out split on embed, and SPMD can move that to
# the batch split only by replicating the whole activation. Left to autodiff, that gather ran in the table's float32,
# and its transpose kept the gradient's scatter-add replicated: every device built the whole float32 table's gradient
# in every micro-batch and GSPMD summed it over them (llama3_8b on 8 H100s: a 2 GiB reduce-scatter; data x fsdp: an
# all-reduce over both). Here the table is gathered in the compute dtype (the rows were cast after the lookup: the
# same values, half the bytes) and its gradient laid out as the table is: the rows' gradient goes to the devices
# holding their columns (an all-to-all the size of the device's residual stream), each adds its own columns, and
# GSPMD sums those over the batch's other axes (data); with the vocabulary split over tensor (fsdp_tp, tp) each
# device adds the rows its shard holds, and the forward sums the looked-up rows over the shards in the compute dtype
# (autodiff's: float32, twice the bytes). The scatter-add stays float32: a frequent token's row sums thousands of terms.
@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _lookup_rows(table: jax.Array, ids: jax.Array, dtype) -> jax.Array:
    return jnp.take(constrain(gathered(table.astype(dtype), EMBEDDING_AXES), ("vocab", "activation_embed")), ids, axis=0)


def _lookup_rows_fwd(table, ids, dtype):
    return _lookup_rows(table, ids, dtype), (table, ids)


def _lookup_rows_bwd(dtype, residuals, grad):
    table, ids = residuals
    # the rows' gradient to the devices holding their columns, still split over the batch's other axes (data x fsdp:
    # data), whose partial sums of the table's gradient GSPMD then adds. That move is one all-to-all over the columns'
    # axes where they come last in the batch's order; a batch axis after them (fsdp_ep: data, fsdp, expert) cost a
    # collective permute over both first, so there the batch is viewed as a dimension per run of axes ending with
    # them. Only there: jax 0.11.2's partitioner replicated the gradient whole to reshape it on fsdp_tp
    columns, groups = mesh_axes_of("embed"), [[]]
    for axis in mesh_axes_of(BATCH):
        if axis not in columns and groups[-1] and groups[-1][-1] in columns:
            groups.append([])
        groups[-1].append(axis)
    mesh = jax.sharding.get_abstract_mesh()
    view = tuple(math.prod(mesh.shape[a] for a in group) for group in groups[:-1]) + (-1,)
    kept = tuple(tuple(a for a in group if a not in columns) for group in groups) + ((),)
    grad = constrain_mesh_axes(grad.reshape(*view, *grad.shape[1:]), kept + (columns,))
    ids = constrain_mesh_axes(ids.reshape(*view, ids.shape[1]), kept)
    rows = jnp.zeros(table.shape, jnp.float32).at[ids].add(grad.astype(jnp.float32))
    return constrain(rows.astype(table.dtype), EMBEDDING_AXES), None


_lookup_rows.defvjp(_lookup_rows_fwd, _lookup_rows_bwd)


class Llama(nnx.Module):
    def __init__(self, cfg: LlamaConfig, *, rngs: nnx.Rngs):
        self.cfg = cfg
        pd = jnp.dtype(cfg.param_dtype)
        self.embed = param(rngs, (cfg.vocab_size, cfg.d_model), EMBEDDING_AXES, cfg.init_std, pd)

        @nnx.split_rngs(splits=cfg.num_layers)
        @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata={nnx.PARTITION_NAME: "layers"})
        def stacked_blocks(layer_rngs):
            return Block(cfg, layer_rngs)

        self.layers = stacked_blocks(rngs)
        self.final_norm = RMSNorm(cfg)
        if not cfg.tie_embeddings:
            self.lm_head = param(rngs, (cfg.d_model, cfg.vocab_size), ("embed", "vocab"), cfg.init_std, pd)

    def __call__(self, tokens: jax.Array, segment_ids: jax.Array | None = None, positions: jax.Array | None = None) -> jax.Array:
        """tokens (batch, length) int32 -> logits (batch, length, vocab) float32."""
        return self.logits(self.hidden(tokens, segment_ids, positions))

    def hidden(self, tokens: jax.Array, segment_ids: jax.Array | None = None, positions: jax.Array | None = None) -> jax.Array:
        """tokens (batch, length) int32 -> final-normed hidden states (batch, length, d_model). Packed sequences
        give ``segment_ids`` (attention stays inside a segment) and ``positions`` (restarting per segment), both
        (batch, length) int32."""
        cfg = self.cfg
        x = self._embed_tokens(tokens)
        sin, cos = rotary_tables(tokens.shape[1], cfg.resolved_head_dim, cfg.rope_theta, cfg.rope_scaling, positions=positions)

        layer_def, layer_state = nnx.split(self.layers)

        def layer(x, scanned, rows=None):
            with layer_scope(scanned, rows) as params:  # a LoRA dropout key per layer when training with one
                block = nnx.merge(layer_def, params)
                return block(x, sin, cos, segment_ids), nnx.to_pure_dict(nnx.pop(block, nnx.Intermediate))  # e.g. MoE router statistics

        x, sown = pipeline.apply_layers(layer, layer_inputs(layer_state, cfg.num_layers), x, cfg.pipeline, EMBED_ACT,
                                        REMAT_POLICY_FNS[cfg.remat], cfg.remat_layers, unroll=self._unroll)
        if sown:  # stacked over layers, for the trainer (models.moe.pop_router_stats)
            self.layer_intermediates = nnx.Intermediate(sown)
        return self.final_norm(x)

    def extend(self, tokens: jax.Array, cache: KVCache) -> tuple[jax.Array, KVCache]:
        """tokens (batch, length) at positions cache.length ... -> (final-normed hidden states, the cache
        holding them too): the prompt at once (prefill), then one token per decoding step."""
        cfg = self.cfg
        x = self._embed_tokens(tokens)
        sin, cos = rotary_tables(tokens.shape[1], cfg.resolved_head_dim, cfg.rope_theta, cfg.rope_scaling, start=cache.length)
        layer_def, layer_params = nnx.split(self.layers)

        def layer(x, per_layer):
            params, keys, values = per_layer
            x, updated = nnx.merge(layer_def, params).extend(x, sin, cos, LayerCache(keys, values, cache.length))
            return x, (updated.keys, updated.values)

        with gathering_weights(True):  # no backward
            x, (keys, values) = jax.lax.scan(layer, x, (layer_params, cache.keys, cache.values), unroll=self._unroll)
        return self.final_norm(x), KVCache(keys, values, cache.length + tokens.shape[1])

    @property
    def _unroll(self) -> bool:
        return self.cfg.scan_layers is False  # "auto" left unresolved (a model built directly) scans

    def _embed_tokens(self, tokens: jax.Array) -> jax.Array:
        tokens = constrain(tokens, (BATCH, LENGTH))
        dtype = jnp.dtype(self.cfg.dtype)
        if not split_axes("embed") <= split_axes(BATCH):
            # the table's columns split over an axis the batch is not (no shipped rule set): the rows' gradient cannot
            # be sent to the devices holding its columns by splitting the batch, so autodiff's lookup
            table = constrain(self.embed[...], ("vocab", "activation_embed"))
            return constrain(jnp.take(table, tokens, axis=0).astype(dtype), EMBED_ACT)
        return constrain(_lookup_rows(self.embed[...], tokens, dtype), EMBED_ACT)

    def logits(self, x: jax.Array) -> jax.Array:
        """Hidden states (batch, length, d_model) -> logits (batch, length, vocab) float32; any length."""
        x, dtype = self._logit_inputs(x)
        equation, table_axes, table = self._output_table()
        logits = _project_to_vocab(equation, table_axes, x, constrain(table.astype(dtype), table_axes))
        return constrain(logits, (BATCH, LENGTH, "activation_vocab"))

    def chunked_loss(self, x: jax.Array, targets: jax.Array, chunk: int, loss: Callable) -> jax.Array:
        """``loss(logits, targets)`` per position of hidden states ``x`` (batch, length, d_model), ``chunk`` positions
        at a time: (batch, length) values with one chunk's float32 logits live at a time. ``loss`` is a hashable
        function of float32 logits (..., vocab) and targets (...)."""
        x, dtype = self._logit_inputs(x)
        equation, table_axes, table = self._output_table()
        b, t, d = x.shape
        chunks = jnp.swapaxes(x.reshape(b, t // chunk, chunk, d), 0, 1), jnp.swapaxes(targets.reshape(b, t // chunk, chunk), 0, 1)
        return jnp.swapaxes(_chunked_loss(loss, equation, table_axes, dtype, *chunks, table), 0, 1).reshape(b, t)

    def _logit_inputs(self, x: jax.Array) -> tuple[jax.Array, jnp.dtype]:
        """The hidden states and the dtype the output projection computes in."""
        dtype = jnp.dtype(self.cfg.dtype)
        if dtype == jnp.float16:  # float16 logits overflow, and XLA:CPU has no float16 product into float32
            return x.astype(jnp.float32), jnp.dtype(jnp.float32)
        return x, dtype

    def _output_table(self) -> tuple[str, tuple[str, str], jax.Array]:
        """The output projection's einsum, its table's logical axes and the stored table (the embedding's, tied)."""
        if self.cfg.tie_embeddings:
            return "btd,vd->btv", EMBEDDING_AXES, self.embed[...]
        return "btd,dv->btv", ("embed", "vocab"), self.lm_head[...]
