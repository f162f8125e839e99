"""Llama-family decoder in Flax NNX.

Every parameter carries logical axis names (``out_sharding`` metadata) and activations are
constrained with logical names; which mesh axes those map to is decided by the caller's rule set.
Layers are stacked on a leading ``layers`` axis and applied with ``jax.lax.scan`` so the compiled
program does not grow with depth.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from models.config import LlamaConfig
from models.sharding import constrain

BATCH, LENGTH = "activation_batch", "activation_length"
EMBED_ACT = (BATCH, LENGTH, "activation_embed")

REMAT_POLICY_FNS = {
    "none": None,
    "full": jax.checkpoint_policies.nothing_saveable,
    # weight matmul outputs are kept; attention score matmuls (batched dots) are recomputed
    "save_dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
    "save_qkv_out": jax.checkpoint_policies.save_only_these_names("query_proj", "key_proj", "value_proj", "attn_out"),
}


def _param(rngs: nnx.Rngs, shape, axes, std: float, dtype) -> nnx.Param:
    value = std * jax.random.truncated_normal(rngs.params(), -2.0, 2.0, shape, dtype)
    # eager_sharding=False: the trainer places parameters with jit out_shardings, never eagerly.
    return nnx.Param(value, out_sharding=axes, eager_sharding=False)


class RMSNorm(nnx.Module):
    def __init__(self, cfg: LlamaConfig):
        self.eps = cfg.norm_eps
        self.dtype = jnp.dtype(cfg.dtype)
        self.scale = nnx.Param(jnp.ones((cfg.d_model,), cfg.param_dtype), out_sharding=("norm",), eager_sharding=False)

    def __call__(self, x):
        x32 = x.astype(jnp.float32)
        x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return (x32 * self.scale[...].astype(jnp.float32)).astype(self.dtype)


def rotary_tables(seq_len: int, head_dim: int, theta: float):
    """sin/cos of shape (seq_len, head_dim // 2), float32."""
    inv_freq = 1.0 / (theta ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim))
    angles = jnp.arange(seq_len, dtype=jnp.float32)[:, None] * inv_freq[None, :]
    return jnp.sin(angles), jnp.cos(angles)


def apply_rotary(x, sin, cos):
    """Rotate (batch, length, heads, head_dim) by position, half-split layout as in Llama."""
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    sin, cos = sin[None, :, None, :], cos[None, :, None, :]
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)


class Attention(nnx.Module):
    def __init__(self, cfg: LlamaConfig, rngs: nnx.Rngs):
        d, h, k, hd = cfg.d_model, cfg.num_heads, cfg.num_kv_heads, cfg.resolved_head_dim
        pd = jnp.dtype(cfg.param_dtype)
        self.dtype = jnp.dtype(cfg.dtype)
        self.implementation = None if cfg.attention == "auto" else cfg.attention  # None: jax chooses
        self.wq = _param(rngs, (d, h, hd), ("embed", "heads", "head_dim"), cfg.init_std, pd)
        self.wk = _param(rngs, (d, k, hd), ("embed", "kv_heads", "head_dim"), cfg.init_std, pd)
        self.wv = _param(rngs, (d, k, hd), ("embed", "kv_heads", "head_dim"), cfg.init_std, pd)
        # residual-branch outputs scaled down with depth (GPT-2 / Megatron init)
        out_std = cfg.init_std / (2 * cfg.num_layers) ** 0.5
        self.wo = _param(rngs, (h, hd, d), ("heads", "head_dim", "embed"), out_std, pd)

    def __call__(self, x, sin, cos):
        heads = (BATCH, LENGTH, "activation_heads", "activation_head_dim")
        kv_heads = (BATCH, LENGTH, "activation_kv_heads", "activation_head_dim")
        q = constrain(jnp.einsum("btd,dhk->bthk", x, self.wq[...].astype(self.dtype)), heads)
        k = constrain(jnp.einsum("btd,dhk->bthk", x, self.wk[...].astype(self.dtype)), kv_heads)
        v = constrain(jnp.einsum("btd,dhk->bthk", x, self.wv[...].astype(self.dtype)), kv_heads)
        q = checkpoint_name(apply_rotary(q, sin, cos), "query_proj")
        k = checkpoint_name(apply_rotary(k, sin, cos), "key_proj")
        v = checkpoint_name(v, "value_proj")
        out = jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation=self.implementation)
        out = constrain(out, heads)
        out = jnp.einsum("bthk,hkd->btd", out, self.wo[...].astype(self.dtype))
        return checkpoint_name(constrain(out, EMBED_ACT), "attn_out")


class MLP(nnx.Module):
    """SwiGLU feed-forward block."""

    def __init__(self, cfg: LlamaConfig, rngs: nnx.Rngs):
        d, m, pd = cfg.d_model, cfg.mlp_dim, jnp.dtype(cfg.param_dtype)
        self.dtype = jnp.dtype(cfg.dtype)
        self.w_gate = _param(rngs, (d, m), ("embed", "mlp"), cfg.init_std, pd)
        self.w_up = _param(rngs, (d, m), ("embed", "mlp"), cfg.init_std, pd)
        self.w_down = _param(rngs, (m, d), ("mlp", "embed"), cfg.init_std / (2 * cfg.num_layers) ** 0.5, pd)

    def __call__(self, x):
        hidden = (BATCH, LENGTH, "activation_mlp")
        gate = constrain(x @ self.w_gate[...].astype(self.dtype), hidden)
        up = constrain(x @ self.w_up[...].astype(self.dtype), hidden)
        return constrain((jax.nn.silu(gate) * up) @ self.w_down[...].astype(self.dtype), EMBED_ACT)


class Block(nnx.Module):
    def __init__(self, cfg: LlamaConfig, rngs: nnx.Rngs):
        self.attn_norm = RMSNorm(cfg)
        self.attn = Attention(cfg, rngs)
        self.mlp_norm = RMSNorm(cfg)
        self.mlp = MLP(cfg, rngs)

    def __call__(self, x, sin, cos):
        x = constrain(x + self.attn(self.attn_norm(x), sin, cos), EMBED_ACT)
        return constrain(x + self.mlp(self.mlp_norm(x)), EMBED_ACT)


class Llama(nnx.Module):
    def __init__(self, cfg: LlamaConfig, *, rngs: nnx.Rngs):
        self.cfg = cfg
        pd = jnp.dtype(cfg.param_dtype)
        self.embed = _param(rngs, (cfg.vocab_size, cfg.d_model), ("vocab", "embed"), cfg.init_std, pd)

        @nnx.split_rngs(splits=cfg.num_layers)
        @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata={nnx.PARTITION_NAME: "layers"})
        def stacked_blocks(layer_rngs):
            return Block(cfg, layer_rngs)

        self.layers = stacked_blocks(rngs)
        self.final_norm = RMSNorm(cfg)
        if not cfg.tie_embeddings:
            self.lm_head = _param(rngs, (cfg.d_model, cfg.vocab_size), ("embed", "vocab"), cfg.init_std, pd)

    def __call__(self, tokens: jax.Array) -> jax.Array:
        """tokens (batch, length) int32 -> logits (batch, length, vocab) float32."""
        return self.logits(self.hidden(tokens))

    def hidden(self, tokens: jax.Array) -> jax.Array:
        """tokens (batch, length) int32 -> final-normed hidden states (batch, length, d_model)."""
        cfg = self.cfg
        dtype = jnp.dtype(cfg.dtype)
        tokens = constrain(tokens, (BATCH, LENGTH))
        # the table's embed dimension laid out as the activations' before the lookup (FSDP all-gathers
        # it): rows gathered from a table split on embed come out split on embed, and SPMD can move
        # that to the batch split only by replicating the whole activation
        table = constrain(self.embed[...], ("vocab", "activation_embed"))
        x = constrain(jnp.take(table, tokens, axis=0).astype(dtype), EMBED_ACT)
        sin, cos = rotary_tables(tokens.shape[1], cfg.resolved_head_dim, cfg.rope_theta)

        layer_def, layer_params = nnx.split(self.layers)

        def layer(x, params):
            return nnx.merge(layer_def, params)(x, sin, cos), None

        policy = REMAT_POLICY_FNS[cfg.remat]
        if cfg.remat != "none":
            layer = jax.checkpoint(layer, policy=policy, prevent_cse=False)
        x, _ = jax.lax.scan(layer, x, layer_params)

        return self.final_norm(x)

    def logits(self, x: jax.Array) -> jax.Array:
        """Hidden states (batch, length, d_model) -> logits (batch, length, vocab) float32; any length,
        so a loss can project a slice of positions at a time."""
        dtype = jnp.dtype(self.cfg.dtype)
        if self.cfg.tie_embeddings:
            logits = jnp.einsum("btd,vd->btv", x, self.embed[...].astype(dtype), preferred_element_type=jnp.float32)
        else:
            logits = jnp.einsum("btd,dv->btv", x, self.lm_head[...].astype(dtype), preferred_element_type=jnp.float32)
        return constrain(logits, (BATCH, LENGTH, "activation_vocab"))
