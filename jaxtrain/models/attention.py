"""Causal attention in query chunks, for CPUs (``model.attention=chunked``; what ``auto`` picks there).

Each chunk of queries is scored only against the keys at or before its last position, so the computed scores
are (chunks + 1) / (2 chunks) of the full (length x length) square that XLA's implementation of
``jax.nn.dot_product_attention`` scores, masks and differentiates over the whole square. XLA:CPU has no fused
attention kernel, so the scores never built are time saved (README, "Benchmarks and performance"). Each chunk is
jax's own XLA attention, so the numbers (float32 softmax, grouped-query heads) and what quantized training
(model.quant) does to its products are those of ``model.attention=xla``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

# More chunks score less of the square ((chunks + 1) / (2 chunks)) but make more, smaller products, and each
# chunk is compiled on its own: at sequence 256 on CPU, 4 chunks of 64 train as fast as 8 of 32 and compile in
# 8 s rather than 13; 16 chunks were slower than 8
MAX_CHUNKS = 8
MIN_CHUNK = 64  # queries per chunk at least


def num_chunks(length: int) -> int:
    """How many query chunks a sequence of ``length`` tokens is split into."""
    return max(1, min(MAX_CHUNKS, length // MIN_CHUNK))


def scored_fraction(length: int) -> float:
    """The share of the (length x length) score square that chunked attention computes (and, without remat,
    keeps for the backward pass): the planner's memory term."""
    bounds = _chunk_bounds(length)
    return sum((end - start) * end for start, end in bounds) / length**2


def _chunk_bounds(length: int) -> list[tuple[int, int]]:
    chunks = num_chunks(length)
    edges = [round(i * length / chunks) for i in range(chunks + 1)]
    return list(zip(edges[:-1], edges[1:]))


def chunked_causal_attention(query, key, value, mask=None):
    """query (batch, length, heads, head_dim), key and value (batch, length, kv_heads, head_dim) -> like query.
    ``mask`` (batch, 1, length, length) bool, optional: pairs that may attend besides the causal rule (packed
    segments). Each chunk is jax's XLA attention over the keys up to the chunk's end, with the causal rule as a
    mask offset by the chunk's start."""
    outs = []
    for start, end in _chunk_bounds(query.shape[1]):
        visible = (jnp.arange(start, end)[:, None] >= jnp.arange(end)[None, :])[None, None]
        if mask is not None:
            visible = visible & mask[:, :, start:end, :end]
        outs.append(jax.nn.dot_product_attention(query[:, start:end], key[:, :end], value[:, :end], mask=visible, implementation="xla"))
    return jnp.concatenate(outs, axis=1)
