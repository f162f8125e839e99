"""Model FLOPs per token and peak device FLOP/s, for MFU."""

from __future__ import annotations

import dataclasses
import re
import statistics
import time
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxtrain.adapt.adapters import split_frozen
from jaxtrain.state import model_spec
from jaxtrain.models.config import LlamaConfig

if TYPE_CHECKING:
    from jaxtrain.layout import Layout

# Dense peak TFLOP/s per device (vendor datasheets, without sparsity): (chip, variant or None,
# bf16/fp16, fp32). The fp32 column is TF32 tensor cores, which XLA uses for float32 matmuls at
# jax's default precision. Matched on whole words of jax's device_kind, e.g. "NVIDIA H100 PCIe",
# "NVIDIA H100 80GB HBM3" (SXM), "NVIDIA A100-SXM4-80GB"; a row with a variant comes before its chip's
# plain row.
PEAK_TFLOPS = (
    ("H100", "PCIE", 756.0, 378.0),
    ("H100", "NVL", 835.5, 417.5),  # the PCIe cards of NVLink pairs: read as SXM they had MFU 16% low
    ("H100", None, 989.4, 494.7),  # SXM
    ("H200", "NVL", 835.5, 417.5),
    ("H200", None, 989.4, 494.7),
    ("GH200", None, 989.4, 494.7),  # an H100 SXM's tensor cores
    ("A100", None, 312.0, 156.0),
    ("L4", None, 121.0, 60.0),
    ("B200", None, 2250.0, 1125.0),
)


def matmul_params(cfg: LlamaConfig) -> int:
    """Parameters that take part in a matmul per token (the embedding lookup does not): of a mixture of
    experts only the router, the top_k chosen experts and the shared experts (active, not total, parameters)."""
    d, h, k, hd, m = cfg.d_model, cfg.num_heads, cfg.num_kv_heads, cfg.resolved_head_dim, cfg.mlp_dim
    per_layer = d * h * hd + 2 * d * k * hd + h * hd * d + 3 * d * m * active_mlps(cfg) + d * cfg.moe.num_experts
    return cfg.num_layers * per_layer + d * cfg.vocab_size


def active_mlps(cfg: LlamaConfig) -> int:
    """SwiGLU MLPs of model.mlp_dim a token passes through per layer: its top_k experts and the shared ones."""
    moe = cfg.moe
    return moe.top_k + moe.num_shared_experts if moe.num_experts else 1


def flops_per_token(cfg: LlamaConfig, seq_len: int) -> float:
    """Training FLOPs per token, PaLM formula: 6N for the weights plus 12 L T H hd for attention,
    halved for the causal mask as MaxText and Megatron count it."""
    attention = 6 * cfg.num_layers * seq_len * cfg.num_heads * cfg.resolved_head_dim
    return 6 * matmul_params(cfg) + attention


def params_per_token(shapes: dict, logical_axes: dict, cfg: LlamaConfig) -> float:
    """Of the parameters ``shapes``, those each token uses: of an expert's (logical axis ``experts``) its top_k experts'."""
    share = cfg.moe.top_k / cfg.moe.num_experts if cfg.moe.num_experts else 1
    return sum(x.size * (share if "experts" in a else 1)
               for x, a in zip(jax.tree.leaves(shapes), jax.tree.leaves(logical_axes, is_leaf=lambda s: isinstance(s, PartitionSpec)),
                               strict=True))


def adapter_params_per_token(layout: Layout) -> float:
    """A LoRA run's adapter parameters each token multiplies (of experts' adapters, those of its top_k experts)."""
    return params_per_token(split_frozen(layout.spec.shapes)[0], split_frozen(layout.spec.logical_axes)[0], layout.cfg.model)


def parameter_counts(layout: Layout) -> dict:
    """The model's parameters as published models count them: ``total`` (a quantized base, QLoRA, as the weights it
    stores, not its packed codes and scales), ``active_per_token`` (a mixture of experts: top_k experts' of each
    layer; otherwise the total) and ``trained`` (a LoRA run: its adapters; otherwise the total)."""
    m = layout.cfg.model
    spec = layout.spec if m.base_quant == "none" else model_spec(dataclasses.replace(m, base_quant="none"))
    trained, frozen = split_frozen(spec.shapes)
    return {"total": spec.num_params, "active_per_token": round(params_per_token(spec.shapes, spec.logical_axes, m)),
            "trained": spec.num_params if frozen is None else sum(x.size for x in jax.tree.leaves(trained))}


def model_flops_per_token(layout: Layout) -> float:
    """The training FLOPs per token the layout's step needs (MFU's numerator; no recomputation): ``flops_per_token``,
    but for a LoRA run, whose frozen base takes no weight gradients: 4 per base parameter (the forward and the
    gradient of its input), not 6, and the adapters' 6 per parameter added."""
    m, seq = layout.cfg.model, layout.cfg.data.seq_len
    if split_frozen(layout.spec.shapes)[1] is None:
        return flops_per_token(m, seq)
    return flops_per_token(m, seq) - 2 * matmul_params(m) + 6 * adapter_params_per_token(layout)


def peak_flops(device_kind: str, dtype: str = "bfloat16") -> float | None:
    """Datasheet peak FLOP/s of one device computing in ``dtype``, or None when the device is not in
    the table (e.g. CPU)."""
    words = set(re.split(r"[^A-Z0-9]+", device_kind.upper()))
    for chip, variant, half, single in PEAK_TFLOPS:
        if chip in words and (variant is None or variant in words):
            return (single if dtype == "float32" else half) * 1e12
    return None


def measure_matmul_peak(devices: list | None = None, size: int = 1024, dtype: str = "float32", repeats: int = 5) -> float:
    """Measured matmul FLOP/s of ``devices`` working together (default: all local devices), each
    multiplying its own pair of ``size`` x ``size`` matrices at the same time; median of ``repeats``
    timed calls after a warm-up. The MFU denominator where no datasheet peak is known (CPUs)."""
    devices = list(devices or jax.local_devices())
    sharding = NamedSharding(Mesh(np.array(devices), ("devices",)), PartitionSpec("devices"))
    shape = (len(devices), size, size)
    operands = jax.jit(lambda key: tuple(jax.random.normal(k, shape, dtype) / size**0.5 for k in jax.random.split(key)),
                       out_shardings=(sharding, sharding))(jax.random.key(0))
    matmul = jax.jit(lambda a, b: jnp.einsum("nij,njk->nik", a, b), out_shardings=sharding)
    matmul(*operands).block_until_ready()  # compile and warm up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        matmul(*operands).block_until_ready()
        times.append(time.perf_counter() - start)
    return 2 * len(devices) * size**3 / statistics.median(times)
