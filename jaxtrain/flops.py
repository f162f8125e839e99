"""Model FLOPs per token and peak device FLOP/s, for MFU."""

from __future__ import annotations

import statistics
import time

from models.config import LlamaConfig

# Dense bf16 peak FLOP/s per device (vendor datasheets, without sparsity), matched on device_kind.
PEAK_BF16_FLOPS = {
    "H200": 989e12,
    "H100": 989e12,  # SXM
    "A100": 312e12,
    "B200": 2250e12,
    "L4": 121e12,
}


def matmul_params(cfg: LlamaConfig) -> int:
    """Parameters that take part in a matmul per token (the embedding lookup does not)."""
    d, h, k, hd, m = cfg.d_model, cfg.num_heads, cfg.num_kv_heads, cfg.resolved_head_dim, cfg.mlp_dim
    per_layer = d * h * hd + 2 * d * k * hd + h * hd * d + 3 * d * m
    return cfg.num_layers * per_layer + d * cfg.vocab_size


def flops_per_token(cfg: LlamaConfig, seq_len: int) -> float:
    """Training FLOPs per token, PaLM formula: 6N for the weights plus 12 L T H hd for attention,
    halved for the causal mask as MaxText and Megatron count it."""
    attention = 6 * cfg.num_layers * seq_len * cfg.num_heads * cfg.resolved_head_dim
    return 6 * matmul_params(cfg) + attention


def peak_flops(device_kind: str) -> float | None:
    """Peak bf16 FLOP/s of one device, or None when the device is not in the table (e.g. CPU)."""
    for name, peak in PEAK_BF16_FLOPS.items():
        if name.lower() in device_kind.lower():
            return peak
    return None


def measure_matmul_peak(devices: list | None = None, size: int = 1024, dtype: str = "float32", repeats: int = 5) -> float:
    """Measured matmul FLOP/s of ``devices`` working together (default: all local devices), each
    multiplying its own pair of ``size`` x ``size`` matrices at the same time; median of ``repeats``
    timed calls after a warm-up. The MFU denominator where no datasheet peak is known (CPUs)."""
    # jax is imported here, not at the top: this module stays importable before jax starts
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

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
