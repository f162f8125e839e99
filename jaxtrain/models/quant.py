"""Frozen weights stored quantized (QLoRA's base): int8 or 4-bit NormalFloat codes with one scale per block of
``BLOCK`` entries along the weight's innermost input dimension (bitsandbytes' blocks: consecutive entries of a torch
weight's row, so for o, whose inputs are (heads, head_dim), along head_dim), dequantized layer by layer inside the scan.

nf4 is the 16-level code of QLoRA (Dettmers et al. 2023, bitsandbytes' table), two codes per byte packed
along the first dimension; int8 is symmetric absmax. A scale's blocked dimension is never split across
devices (it carries no logical axis), its other dimensions are split as the weight's.
"""

from __future__ import annotations

import contextlib
import contextvars
import math

import jax
import jax.numpy as jnp
from flax import nnx

from jaxtrain.models.sharding import gathered

BLOCK = 64  # entries sharing one scale (QLoRA's block size); smaller dimensions use their gcd with it
NF4_LEVELS = (-1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453, -0.28444138169288635,
              -0.18477343022823334, -0.09105003625154495, 0.0, 0.07958029955625534, 0.16093020141124725,
              0.24611230194568634, 0.33791524171829224, 0.44070982933044434, 0.5626170039176941,
              0.7229568362236023, 1.0)
SCALE_DTYPE = jnp.bfloat16


def block_size(dim: int) -> int:
    return math.gcd(dim, BLOCK)


def _blocks(x: jax.Array, inputs: int) -> jax.Array:
    """A weight whose first ``inputs`` dimensions are its inputs -> the innermost input dimension d split into
    (d / block, block), the block at index ``inputs``."""
    axis = inputs - 1
    block = block_size(x.shape[axis])
    return x.reshape(*x.shape[:axis], x.shape[axis] // block, block, *x.shape[axis + 1:])


def quantize(value: jax.Array, kind: str, inputs: int) -> tuple[jax.Array, jax.Array]:
    """A float weight whose first ``inputs`` dimensions are its inputs -> (codes, scales): int8 codes of its shape,
    or nf4 codes packed two per uint8 along dim 0; the scales' shape is the weight's with its innermost input
    dimension divided by the block."""
    blocks = _blocks(value.astype(jnp.float32), inputs)
    absmax = jnp.max(jnp.abs(blocks), axis=inputs)
    scale = jnp.where(absmax > 0, absmax, 1.0).astype(SCALE_DTYPE)
    normed = blocks / jnp.expand_dims(scale.astype(jnp.float32), inputs)
    if kind == "int8":
        return jnp.round(normed * 127).astype(jnp.int8).reshape(value.shape), scale
    levels = jnp.asarray(NF4_LEVELS, jnp.float32)
    codes = jnp.searchsorted((levels[1:] + levels[:-1]) / 2, normed).astype(jnp.uint8).reshape(value.shape)
    pairs = codes.reshape(value.shape[0] // 2, 2, *value.shape[1:])
    return pairs[:, 0] | (pairs[:, 1] << 4), scale


def dequantize(codes: jax.Array, scale: jax.Array, dtype, inputs: int) -> jax.Array:
    if codes.dtype == jnp.int8:
        values = codes.astype(jnp.float32) / 127
    else:
        unpacked = jnp.stack([codes & 0xF, codes >> 4], axis=1).reshape(codes.shape[0] * 2, *codes.shape[1:])
        values = jnp.asarray(NF4_LEVELS, jnp.float32)[unpacked]
    return (_blocks(values, inputs) * jnp.expand_dims(scale.astype(jnp.float32), inputs)).reshape(values.shape).astype(dtype)


class QuantizedWeight(nnx.Module):
    """Stands where an ``nnx.Param`` weight stood (its first ``inputs`` dimensions its inputs); ``weight(w, dtype)``
    reads either."""

    def __init__(self, param: nnx.Param, kind: str, inputs: int):
        axes = param.get_metadata()["out_sharding"]
        codes, scale = quantize(param[...], kind, inputs)
        self.inputs = inputs
        self.codes = nnx.Param(codes, out_sharding=axes, eager_sharding=False)
        self.scale = nnx.Param(scale, out_sharding=(*axes[:inputs - 1], None, *axes[inputs:]), eager_sharding=False)


def weight(w: nnx.Param | QuantizedWeight, dtype) -> jax.Array:
    """A projection weight in the compute dtype, dequantized if stored quantized."""
    if isinstance(w, QuantizedWeight):  # the codes gathered, then dequantized
        return dequantize(gathered_param(w.codes), gathered_param(w.scale), dtype, w.inputs)
    return gathered_param(w, dtype)


# set while the layers are traced (jaxtrain/models/llama.py): whether their weights are read through ``gathered``
_GATHERING = contextvars.ContextVar("gathering_weights", default=False)


@contextlib.contextmanager
def gathering_weights(on: bool):
    """Inside: ``weight`` and the adapters lay their weights out for their products themselves
    (``models.sharding.gathered``). Only for layers whose weights autodiff does not keep for the backward: layers it
    recomputes (a remat policy) or that have no backward (generation). Otherwise it would keep every layer's gathered
    weights, which FSDP is there not to hold; the gathers GSPMD inserts it does not see, so it keeps them split."""
    token = _GATHERING.set(on)
    try:
        yield
    finally:
        _GATHERING.reset(token)


def gathered_param(w: nnx.Param, dtype=None) -> jax.Array:
    """A parameter's value, cast to ``dtype`` first (the gather moves the compute dtype), inside ``gathering_weights``
    laid out for its product."""
    value = w[...] if dtype is None else w[...].astype(dtype)
    return gathered(value, w.get_metadata()["out_sharding"][-value.ndim:]) if _GATHERING.get() else value
