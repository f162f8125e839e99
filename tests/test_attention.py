"""Chunked causal attention (jaxtrain/models/attention.py, model.attention=chunked, what auto picks on CPUs): the same
values and gradients as jax's XLA attention, with grouped-query heads, packed segments and uneven chunks; the
chunks score only the keys up to their end; a Llama built with it equals one built with XLA attention."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxtrain.models import attention
from jaxtrain.models.config import LlamaConfig
from jaxtrain.models.llama import Llama


def _inputs(length: int, heads: int = 4, kv_heads: int = 2, head_dim: int = 8, batch: int = 2):
    keys = jax.random.split(jax.random.key(0), 4)
    q = jax.random.normal(keys[0], (batch, length, heads, head_dim))
    k, v = (jax.random.normal(key, (batch, length, kv_heads, head_dim)) for key in keys[1:3])
    segments = jnp.sort(jax.random.randint(keys[3], (batch, length), 0, 3), axis=1)  # packed examples
    return q, k, v, (segments[:, :, None] == segments[:, None, :])[:, None]


@pytest.mark.parametrize("length,packed", [(512, False), (200, True), (7, False)])  # 8 chunks; 3 uneven ones; 1
def test_equals_xla_attention_values_and_gradients(length, packed):
    q, k, v, segment_mask = _inputs(length)
    mask = segment_mask if packed else None

    @jax.jit
    def xla(q, k, v):
        return jax.nn.dot_product_attention(q, k, v, mask=mask, is_causal=True, implementation="xla")

    @jax.jit
    def chunked(q, k, v):
        return attention.chunked_causal_attention(q, k, v, mask)

    np.testing.assert_allclose(chunked(q, k, v), xla(q, k, v), rtol=1e-6, atol=1e-6)
    grad = lambda f: jax.jit(jax.grad(lambda *a: jnp.sum(jnp.sin(f(*a))), argnums=(0, 1, 2)))(q, k, v)  # noqa: E731
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5), grad(chunked), grad(xla))


def test_chunks_score_only_the_keys_up_to_their_end():
    assert [attention.num_chunks(n) for n in (7, 64, 200, 256, 512, 8192)] == [1, 1, 3, 4, 8, 8]
    assert attention.scored_fraction(512) == (1 + 2 + 3 + 4 + 5 + 6 + 7 + 8) * 64 * 64 / 512**2  # 0.5625
    assert attention.scored_fraction(16) == 1.0
    # the compiled forward multiplies exactly that share of the (length x length) scores, per head
    q, k, v, _ = _inputs(512, heads=2, kv_heads=2, batch=1)
    flops = jax.jit(attention.chunked_causal_attention).lower(q, k, v).compile().cost_analysis()["flops"]
    full = jax.jit(lambda *a: jax.nn.dot_product_attention(*a, is_causal=True)).lower(q, k, v).compile().cost_analysis()["flops"]
    assert flops < 0.6 * full


def test_llama_with_chunked_attention_equals_xla_attention():
    cfg = LlamaConfig(vocab_size=64, d_model=32, num_layers=2, num_heads=4, num_kv_heads=2, mlp_dim=64, dtype="float32",
                      attention="chunked")
    tokens = jax.random.randint(jax.random.key(1), (2, 128), 0, 64)  # 2 chunks of 64
    chunked = Llama(cfg, rngs=nnx.Rngs(0))
    xla = Llama(LlamaConfig(**{**cfg.__dict__, "attention": "xla"}), rngs=nnx.Rngs(0))
    np.testing.assert_allclose(nnx.jit(chunked)(tokens), nnx.jit(xla)(tokens), rtol=1e-5, atol=1e-5)
