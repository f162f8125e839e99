"""Model hyper-parameters. Kept free of jax imports so configs load before jax starts."""

from __future__ import annotations

import dataclasses

# Names of the per-layer rematerialisation policies; models/llama.py maps each to a jax policy.
# offload_*: what save_* keeps is moved to host memory (pinned_host) and brought back for the backward pass.
REMAT_POLICIES = ("none", "full", "save_dots", "save_qkv_out", "offload_dots", "offload_qkv_out")
COMPUTE_DTYPES = ("float32", "bfloat16", "float16")
# auto: the trainer picks cudnn on NVIDIA GPUs and xla elsewhere; a model built directly lets jax choose
ATTENTION_IMPLEMENTATIONS = ("auto", "xla", "cudnn")
ROPE_SCALING_TYPES = ("none", "llama3")
# quantized training of the layers' matmuls (jaxtrain/quant.py, qwix): int8, or fp8 (e4m3 forward, e5m2 gradients)
QUANT_TYPES = ("none", "int8", "fp8")


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """Rotary frequency scaling for a context longer than pretraining's. ``llama3`` (Llama 3.1 / 3.2):
    frequencies whose wavelength exceeds original_max_len / low_freq_factor are divided by ``factor``,
    those below original_max_len / high_freq_factor are kept, and those between are interpolated."""

    type: str = "none"
    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_len: int = 8192

    def problems(self) -> list[str]:
        out = []
        if self.type not in ROPE_SCALING_TYPES:
            out.append(f"model.rope_scaling.type={self.type!r} is unknown; choose one of {', '.join(ROPE_SCALING_TYPES)}")
        elif self.type == "llama3":
            if self.factor <= 0 or self.original_max_len <= 0:
                out.append(f"model.rope_scaling.factor={self.factor} and original_max_len={self.original_max_len} must be positive")
            if not 0 < self.low_freq_factor < self.high_freq_factor:
                out.append(f"model.rope_scaling needs 0 < low_freq_factor ({self.low_freq_factor}) < high_freq_factor ({self.high_freq_factor})")
        return out


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
    vocab_size: int = 256
    d_model: int = 256
    num_layers: int = 4
    num_heads: int = 8
    num_kv_heads: int = 4
    head_dim: int | None = None  # None: d_model // num_heads
    mlp_dim: int = 1024
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling = RopeScaling()
    norm_eps: float = 1e-5
    tie_embeddings: bool = False
    qkv_bias: bool = False  # biases on the query, key and value projections (Qwen2)
    init_std: float = 0.02
    dtype: str = "bfloat16"  # compute dtype; softmax, logits and loss are always float32
    param_dtype: str = "float32"
    remat: str = "none"
    attention: str = "auto"  # jax.nn.dot_product_attention implementation
    quant: str = "none"  # quantized training of the layers' matmuls: none, int8, fp8

    @property
    def resolved_head_dim(self) -> int:
        return self.head_dim or self.d_model // self.num_heads

    def problems(self) -> list[str]:
        """Every inconsistency in this config, each as one sentence that says how to fix it."""
        out = list(self.rope_scaling.problems())
        if self.remat not in REMAT_POLICIES:
            out.append(f"model.remat={self.remat!r} is not a remat policy; choose one of {', '.join(REMAT_POLICIES)}")
        for key in ("dtype", "param_dtype"):
            if getattr(self, key) not in COMPUTE_DTYPES:
                out.append(f"model.{key}={getattr(self, key)!r} is not supported; choose one of {', '.join(COMPUTE_DTYPES)}")
        if self.quant not in QUANT_TYPES:
            out.append(f"model.quant={self.quant!r} is unknown; choose one of {', '.join(QUANT_TYPES)}")
        if self.attention not in ATTENTION_IMPLEMENTATIONS:
            out.append(f"model.attention={self.attention!r} is unknown; choose one of {', '.join(ATTENTION_IMPLEMENTATIONS)}")
        for key in ("vocab_size", "d_model", "num_layers", "num_heads", "num_kv_heads", "mlp_dim"):
            if getattr(self, key) <= 0:
                out.append(f"model.{key}={getattr(self, key)} must be positive")
        for key in ("rope_theta", "norm_eps", "init_std"):
            if not getattr(self, key) > 0:  # NaN too
                out.append(f"model.{key}={getattr(self, key)} must be positive")
        if self.num_kv_heads > 0 and self.num_heads % self.num_kv_heads:
            out.append(
                f"model.num_heads={self.num_heads} is not a multiple of model.num_kv_heads={self.num_kv_heads}; "
                "grouped-query attention needs num_heads = k * num_kv_heads"
            )
        if self.head_dim is None and self.num_heads > 0 and self.d_model % self.num_heads:
            out.append(f"model.d_model={self.d_model} is not divisible by model.num_heads={self.num_heads}; set model.head_dim")
        if self.num_heads > 0 and self.resolved_head_dim % 2:
            out.append(f"head dimension {self.resolved_head_dim} must be even for rotary embeddings")
        return out
