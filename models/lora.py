"""Low-rank adapters (LoRA, Hu et al. 2021) on the projection weights: ``x @ W + (alpha / rank) * (x @ A) @ B``
with A (the weight's input dimensions..., rank) and B (rank, its output dimensions...), both ``nnx.LoRAParam``
carrying the weight's logical axes (the rank dimension is never split). B starts at zero, so a fresh adapter
leaves the model's output exactly unchanged.

``adapt_block`` runs at the end of a block's construction: adapters are drawn after every base weight of the
layer, so a base initialised from a seed is the same with or without adapters; with ``base_quant`` the
projection weights are then replaced by their quantized storage.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from models.config import LORA_TARGETS, LlamaConfig
from models.quant import QuantizedWeight


class LoRA(nnx.Module):
    def __init__(self, base: nnx.Param, inputs: int, rank: int, alpha: float, rngs: nnx.Rngs):
        shape, axes = base.shape, base.get_metadata()["out_sharding"]
        fan_in = 1
        for size in shape[:inputs]:
            fan_in *= size
        bound = fan_in ** -0.5  # PEFT's kaiming_uniform(a=sqrt(5)) on lora_A
        self.a = nnx.LoRAParam(jax.random.uniform(rngs.params(), (*shape[:inputs], rank), base.dtype, -bound, bound),
                               out_sharding=(*axes[:inputs], None), eager_sharding=False)
        self.b = nnx.LoRAParam(jnp.zeros((rank, *shape[inputs:]), base.dtype), out_sharding=(None, *axes[inputs:]),
                               eager_sharding=False)
        self.inputs = inputs
        self.scale = alpha / rank

    def __call__(self, x: jax.Array) -> jax.Array:
        """The update to add to ``x @ W``: x's last ``inputs`` dimensions are contracted."""
        low = jnp.tensordot(x, self.a[...].astype(x.dtype), axes=self.inputs)
        return jnp.tensordot(low, self.b[...].astype(x.dtype), axes=1) * jnp.asarray(self.scale, x.dtype)


def adapter_name(target: str) -> str:
    return f"lora_{target}"


def adapt_block(block: nnx.Module, cfg: LlamaConfig, rngs: nnx.Rngs) -> None:
    """Add the configured adapters to a freshly built block, then quantize its projection weights."""
    lora = cfg.lora
    if lora.rank:
        for target in lora.target_names():
            module_name, weight_name, inputs = LORA_TARGETS[target]
            module = getattr(block, module_name)
            setattr(module, adapter_name(target), LoRA(getattr(module, weight_name), inputs, lora.rank, lora.alpha, rngs))
    if cfg.base_quant != "none":
        for module_name, weight_name, _ in LORA_TARGETS.values():
            module = getattr(block, module_name)
            setattr(module, weight_name, QuantizedWeight(getattr(module, weight_name), cfg.base_quant))


def adapter_delta(module: nnx.Module, target: str, x: jax.Array) -> jax.Array | None:
    """The adapter update of ``module``'s ``target`` projection for input ``x``, or None without one."""
    adapter = getattr(module, adapter_name(target), None)
    return None if adapter is None else adapter(x)
