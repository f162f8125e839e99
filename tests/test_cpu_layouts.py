"""XLA:CPU program shape of the SwiGLU block's backward (issue 16, README "Benchmarks and performance"): its weight
gradients must not be formed through a transposing copy of the (batch x length, mlp) cotangent, which made that
backward about a quarter of the CPU train step."""

import re

import jax
import jax.numpy as jnp
from flax import nnx

from jaxtrain.models.config import LlamaConfig
from jaxtrain.models.layers import MLP

BATCH, LENGTH, D_MODEL, MLP_DIM = 2, 8, 32, 64


def test_swiglu_weight_gradients_need_no_transposed_copy_of_the_cotangent():
    mlp = MLP(LlamaConfig(vocab_size=64, d_model=D_MODEL, num_layers=2, num_heads=2, num_kv_heads=2, mlp_dim=MLP_DIM,
                          dtype="float32"), nnx.Rngs(0))
    graphdef, params = nnx.split(mlp)
    x = jax.random.normal(jax.random.key(1), (BATCH, LENGTH, D_MODEL))
    grads = jax.jit(jax.grad(lambda p, x: jnp.sum(nnx.merge(graphdef, p)(x) ** 2)))
    hlo = grads.lower(params, x).compile().as_text()
    # the (mlp, batch x length) transpose of a (batch, length, mlp) array, materialised
    transposed = re.findall(rf"= f32\[{MLP_DIM},{BATCH * LENGTH}\]\{{1,0\}} (?:fusion|copy|transpose)\(", hlo)
    assert not transposed, transposed
    # and the gradients are those of the plain 3-D products
    def plain(p, x):
        h = jax.nn.silu(x @ p["w_gate"]) * (x @ p["w_up"])
        return jnp.sum((h @ p["w_down"]) ** 2)
    weights = {k: params[k][...] for k in ("w_gate", "w_up", "w_down")}
    expected = jax.grad(plain)(weights, x)
    got = grads(params, x)
    for k in weights:
        assert jnp.allclose(got[k][...], expected[k], rtol=1e-5, atol=1e-6), k
