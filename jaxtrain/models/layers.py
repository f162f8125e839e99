"""The building blocks of a decoder layer that the dense decoder (llama.py) and the mixture-of-experts block
(moe.py) share: the activations' logical axes, a weight's creation, RMSNorm, the SwiGLU MLP (a MoE's shared
experts are one) and the projection helpers that add LoRA adapters' updates.

Imports inside models/ go one way, with no cycle: layers <- moe <- llama (the decoder builds the expert block);
this module imports neither of them.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jaxtrain.models.config import LlamaConfig
from jaxtrain.models.lora import adapter_delta
from jaxtrain.models.quant import weight
from jaxtrain.models.sharding import constrain

BATCH, LENGTH = "activation_batch", "activation_length"
EMBED_ACT = (BATCH, LENGTH, "activation_embed")


def param(rngs: nnx.Rngs, shape, axes, std: float, dtype) -> nnx.Param:
    """A weight drawn from a truncated normal of ``std``, with its logical ``axes``."""
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


def _matmul(x: jax.Array, w: jax.Array) -> jax.Array:
    """x (..., k) @ w (k, n) as one 2-D product over the flattened leading dimensions. Same numbers; but w's
    gradient then is a single transposed-operand dot, where from the 3-D form XLA:CPU makes a transposing copy of
    the (batch, length, n) cotangent with the activation's backward fused into it, which took about a quarter of
    the train step on CPU (README, "Benchmarks and performance"). ``lax.dot_general``, not ``@``: model.quant's qwix
    intercepts dot_general while the layers are traced, and ``@`` is jnp.matmul, a jitted function whose traces jax
    keeps by shapes: in one process, a quantized model got a plain model's earlier trace back (its MLP unquantized),
    and a plain model traced after a quantized one ran its MLP in int8."""
    dtype = jnp.result_type(x, w)  # as ``@`` promotes and types its product
    product = jax.lax.dot_general(x.reshape(-1, x.shape[-1]).astype(dtype), w.astype(dtype), (((1,), (0,)), ((), ())),
                                  preferred_element_type=dtype)
    return product.reshape(*x.shape[:-1], w.shape[-1])


def adapters_first(module: nnx.Module, targets: tuple[str, ...], x: jax.Array) -> list[jax.Array | None]:
    """The adapter updates of ``module``'s projections of one input ``x``, to be computed before the projections
    themselves. Why first: autodiff sums x's gradient in the reverse order of x's uses, and with the projections split
    over tensor each projection's part of it is summed over tensor (an all-reduce). With the projections used last,
    their parts come first in that sum, and XLA adds them before one all-reduce (AR(a) + AR(b) -> AR(a + b)); between
    adapters' parts (each summed over tensor before its rank-sized product) it cannot, and all-reduced q, k and v's
    parts each (fsdp_tp: 1.6x the tensor bytes of the same model without adapters)."""
    return [adapter_delta(module, target, x) for target in targets]


def plus_delta(out: jax.Array, delta: jax.Array | None) -> jax.Array:
    """A projection's output plus its adapter's update, if it has one."""
    return out if delta is None else out + delta


# recomputed in the backward pass from gate and up, which are kept anyway: the (batch, length, mlp) SiLU and product
# are then not saved per layer (in the layer scan, fewer stacked buffers to fill, copy and slice: 1.08x on CPU)
_swiglu = jax.checkpoint(lambda gate, up: jax.nn.silu(gate) * up)


class MLP(nnx.Module):
    """SwiGLU feed-forward block."""

    def __init__(self, cfg: LlamaConfig, rngs: nnx.Rngs):
        d, m, pd = cfg.d_model, cfg.mlp_dim, jnp.dtype(cfg.param_dtype)
        self.dtype = jnp.dtype(cfg.dtype)
        self.w_gate = param(rngs, (d, m), ("embed", "mlp"), cfg.init_std, pd)
        self.w_up = param(rngs, (d, m), ("embed", "mlp"), cfg.init_std, pd)
        self.w_down = param(rngs, (m, d), ("mlp", "embed"), cfg.init_std / (2 * cfg.num_layers) ** 0.5, pd)

    def __call__(self, x):
        hidden = (BATCH, LENGTH, "activation_mlp")
        gate_delta, up_delta = adapters_first(self, ("gate", "up"), x)
        gate = constrain(plus_delta(_matmul(x, weight(self.w_gate, self.dtype)), gate_delta), hidden)
        up = constrain(plus_delta(_matmul(x, weight(self.w_up, self.dtype)), up_delta), hidden)
        h = _swiglu(gate, up)
        return constrain(plus_delta(_matmul(h, weight(self.w_down, self.dtype)), adapter_delta(self, "down", h)), EMBED_ACT)
