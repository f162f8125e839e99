"""Model hyper-parameters. Kept free of jax imports so configs load before jax starts."""

from __future__ import annotations

import dataclasses
import importlib.metadata
import math
import re

# Names of the per-layer rematerialisation policies; jaxtrain/models/llama.py maps each to a jax policy.
# offload_*: what save_* keeps is moved to host memory (pinned_host) and brought back for the backward pass.
REMAT_POLICIES = ("none", "full", "save_dots", "save_qkv_out", "offload_dots", "offload_qkv_out")
COMPUTE_DTYPES = ("float32", "bfloat16", "float16")
# auto: the trainer picks cudnn on NVIDIA GPUs, chunked on CPUs and xla elsewhere; a model built directly lets jax
# choose. chunked: jaxtrain/models/attention.py, causal attention scored per query chunk (no fused kernel needed)
ATTENTION_IMPLEMENTATIONS = ("auto", "xla", "cudnn", "chunked")
ROPE_SCALING_TYPES = ("none", "llama3")
# LoRA target name -> (module in the block, its weight, how many leading weight dimensions are inputs)
LORA_TARGETS = {"q": ("attn", "wq", 1), "k": ("attn", "wk", 1), "v": ("attn", "wv", 1), "o": ("attn", "wo", 2),
                "gate": ("mlp", "w_gate", 1), "up": ("mlp", "w_up", 1), "down": ("mlp", "w_down", 1)}
# Hugging Face's (and so PEFT's) module name of each LoRA target's weight -> the target (jaxtrain/interop/peft.py maps them)
HF_PROJECTIONS = {"q_proj": "q", "k_proj": "k", "v_proj": "v", "o_proj": "o", "gate_proj": "gate", "up_proj": "up", "down_proj": "down"}
# A mixture of experts' adapters (jaxtrain/models/lora.py ExpertLoRA), as PEFT puts them on Hugging Face's fused expert
# parameters: adapter name -> (the MLP targets it serves, the expert weights it updates). gate_up is one adapter on
# the gate and up weights together: one A per expert, its B's columns the gate's then the up's (PEFT's
# experts.gate_up_proj); down is the down weight's (experts.down_proj).
EXPERT_LORA = {"gate_up": (("gate", "up"), ("w_gate", "w_up")), "down": (("down",), ("w_down",))}
BASE_QUANTS = ("none", "int8", "nf4")  # how the frozen base of a LoRA run is stored (nf4: QLoRA)


def adapter_name(target: str) -> str:
    """The attribute, and so the parameter path's part, of a LoRA target's adapter (or an expert adapter's) on its
    module: ``attn.lora_q``. Here, without jax, so the PEFT reader and the CLI name adapters before jax starts."""
    return f"lora_{target}"


@dataclasses.dataclass(frozen=True)
class LoraConfig:
    """Low-rank adapters on the projection weights; rank 0: off (every parameter trains)."""

    rank: int = 0
    alpha: float = 16.0  # the update is scaled by alpha / rank
    targets: str = "q,k,v,o,gate,up,down"  # comma-separated target names or regular expressions over them / weight paths
    dropout: float = 0.0  # training only: the share of each adapter's input entries dropped (PEFT's lora_dropout)

    def target_names(self) -> list[str]:
        """The target names the comma-separated items match (each a name, or a regex over names and paths)."""
        items = [t.strip() for t in self.targets.split(",") if t.strip()]
        return [name for name, (module, weight, _) in LORA_TARGETS.items()
                if any(_matches(item, name) or _matches(item, f"{module}.{weight}") for item in items)]

    def problems(self) -> list[str]:
        """The values are checked with the adapters off too (rank 0): a mistyped key is found before it is used."""
        out = []
        if self.rank < 0:
            out.append(f"model.lora.rank={self.rank} must be 0 (off) or positive")
        if not _finite_positive(self.alpha):
            out.append(f"model.lora.alpha={self.alpha} must be a finite positive number")
        if not 0 <= self.dropout < 1:
            out.append(f"model.lora.dropout={self.dropout} must be at least 0 and below 1 (the share of adapter inputs dropped); e.g. 0.05")
        if self.rank <= 0:
            return out
        items = [t.strip() for t in self.targets.split(",")]
        wrong, unmatched = [], []  # the hint on the targets is given once, after every wrong item
        for item in items:
            if not (LoraConfig(targets=item).target_names() if item else []):
                if error := _regex_error(item):
                    wrong.append(f"model.lora.targets item {item!r} is not a regular expression ({error})")
                else:
                    unmatched.append(item)
        if unmatched:
            listed = ", ".join(map(repr, unmatched))
            wrong.append(f"model.lora.targets item {listed} matches no weight" if len(unmatched) == 1 else
                         f"model.lora.targets items {listed} match no weight")
            if all(item in HF_PROJECTIONS for item in unmatched):  # PEFT's target_modules, as adapter_config.json gives them
                ours = ",".join(HF_PROJECTIONS[item] for item in unmatched)
                whole = "model.lora.targets=" if len(unmatched) == len(items) else ""  # the value to give, where all were PEFT's
                wrong[-1] += f" (as PEFT names modules; jaxtrain's: {whole}{ours})"
        value = self.targets.strip()
        listed = ",".join(item.strip().strip("'\"") for item in value[1:-1].split(","))
        if wrong and value[:1] + value[-1:] in ("[]", "()") and not LoraConfig(rank=self.rank, targets=listed).problems():
            # a list as Hydra or YAML writes it: '[q' was "not a regular expression" and 'k]' "matches no weight"
            return out + [f"model.lora.targets={self.targets} is a list in brackets; give its items comma-separated, without "
                          f"them: model.lora.targets={listed}"]
        if wrong:
            choices = ", ".join(f"{n} ({m}.{w})" for n, (m, w, _) in LORA_TARGETS.items())
            out.append(f"{'; '.join(wrong)}; targets are {choices}, or regular expressions over them")
        return out


def _finite_positive(value: float) -> bool:
    return 0 < value < math.inf  # NaN fails both


def _regex_error(pattern: str) -> str | None:
    try:
        re.compile(pattern)
    except re.error as e:
        return str(e)
    return None


def _matches(pattern: str, text: str) -> bool:
    try:
        return re.fullmatch(pattern, text) is not None
    except re.error:
        return False


# dropless: every token reaches its experts (grouped matmul, jax.lax.ragged_dot); capacity: each expert takes at most
# capacity_factor x its fair share of a sequence's tokens, the rest skip the block (fixed shapes: expert parallel everywhere)
MOE_DISPATCH = ("dropless", "capacity")
# the dropless dispatch's grouped matmul: xla: jax.lax.ragged_dot, which XLA's GPU compiler expands into a dense
# matmul over every expert (experts x the FLOPs and memory); tokamax: its ragged dot (its Triton kernel on NVIDIA
# GPUs, XLA's product elsewhere); auto: the trainer picks tokamax on NVIDIA GPUs where it can run (tokamax_problem)
GROUPED_MATMULS = ("auto", "xla", "tokamax")
# quantized training of the layers' matmuls (jaxtrain/memory/quant.py, qwix): int8, or fp8 (e4m3 forward, e5m2 gradients)
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
        """Checked with the scaling off too (type none): a mistyped value is found before it is used."""
        out = []
        if self.type not in ROPE_SCALING_TYPES:
            out.append(f"model.rope_scaling.type={self.type!r} is unknown; choose one of {', '.join(ROPE_SCALING_TYPES)}")
        if not _finite_positive(self.factor) or self.original_max_len <= 0:
            out.append(f"model.rope_scaling.factor={self.factor} and original_max_len={self.original_max_len} must be finite and positive")
        if not 0 < self.low_freq_factor < self.high_freq_factor < math.inf:
            out.append(f"model.rope_scaling needs 0 < low_freq_factor ({self.low_freq_factor}) < high_freq_factor "
                       f"({self.high_freq_factor}), both finite")
        return out


@dataclasses.dataclass(frozen=True)
class PipelineConfig:
    """Schedule of the layer pipeline; it runs when the rule set splits ``layer_stages`` over mesh axes (the
    stage count is their size, the layers per stage num_layers / (stages * repeats)), else these are unused."""

    microbatches: int = 0  # micro-batches in flight per pass through the layers; 0: as many as stages
    repeats: int = 1  # circular schedule: each stage holds this many non-adjacent groups of layers

    def problems(self) -> list[str]:
        out = []
        if self.microbatches < 0:
            out.append(f"model.pipeline.microbatches={self.microbatches} must be 0 (as many as stages) or positive")
        if self.repeats < 1:
            out.append(f"model.pipeline.repeats={self.repeats} must be at least 1")
        return out


def tokamax_problem() -> str | None:
    """Why tokamax's grouped matmul (model.moe.grouped_matmul=tokamax) cannot run here, or None. Read from the
    installed packages' versions, without importing them."""
    try:
        tokamax, jax = importlib.metadata.version("tokamax"), importlib.metadata.version("jax")
    except importlib.metadata.PackageNotFoundError:
        return "it needs the tokamax package; pip install 'jaxtrain[moe-gpu]'"
    if _release(tokamax) <= (0, 0, 12) and _release(jax) >= (0, 11):  # checked with tokamax 0.0.12 and jax 0.11.2
        return (f"tokamax {tokamax}'s kernels do not run on jax {jax} (they call Pallas APIs that jax 0.11 removed or "
                "changed); use jax 0.10, or a tokamax release for jax 0.11")
    return None


def _release(version: str) -> tuple[int, ...]:
    return tuple(int(part) for part in re.findall(r"\d+", version)[:3])


@dataclasses.dataclass(frozen=True)
class MoEConfig:
    """Sparse mixture-of-experts feed-forward blocks (jaxtrain/models/moe.py) in every layer; num_experts=0 keeps the dense
    SwiGLU MLP. Each expert is a SwiGLU MLP of model.mlp_dim; shared experts (one MLP of num_shared_experts x mlp_dim)
    see every token."""

    num_experts: int = 0
    top_k: int = 2
    normalize_top_k: bool = True  # the chosen k weights renormalised to sum to 1 (Mixtral); false: raw softmax shares
    num_shared_experts: int = 0
    shared_expert_gate: bool = False  # the shared experts' output scaled by sigmoid(x . w) (Qwen2-MoE)
    dispatch: str = "dropless"
    grouped_matmul: str = "auto"  # GROUPED_MATMULS
    capacity_factor: float = 1.25  # capacity dispatch: slots per expert = ceil(capacity_factor * seq_len * top_k / num_experts)
    aux_loss_weight: float = 0.01  # load-balancing loss (Switch Transformer), mean over layers
    router_z_loss_weight: float = 0.001  # mean squared log-sum-exp of the router logits (ST-MoE), mean over layers

    def problems(self) -> list[str]:
        """Checked with a dense model too (num_experts 0): a mistyped value is found before it is used."""
        out = []
        if self.num_experts < 0:
            out.append(f"model.moe.num_experts={self.num_experts} must be 0 (dense MLP) or positive")
        if self.top_k < 1 or self.top_k > self.num_experts > 0:
            out.append(f"model.moe.top_k={self.top_k} must be between 1 and model.moe.num_experts={self.num_experts}"
                       if self.num_experts > 0 else f"model.moe.top_k={self.top_k} must be at least 1")
        if self.num_shared_experts < 0:
            out.append(f"model.moe.num_shared_experts={self.num_shared_experts} must be 0 or positive")
        if self.grouped_matmul not in GROUPED_MATMULS:
            out.append(f"model.moe.grouped_matmul={self.grouped_matmul!r} is unknown; choose one of {', '.join(GROUPED_MATMULS)}")
        elif self.grouped_matmul == "tokamax" and tokamax_problem():
            out.append(f"model.moe.grouped_matmul=tokamax: {tokamax_problem()}; or set model.moe.grouped_matmul=xla")
        if self.dispatch not in MOE_DISPATCH:
            out.append(f"model.moe.dispatch={self.dispatch!r} is unknown; choose one of {', '.join(MOE_DISPATCH)}")
        if not _finite_positive(self.capacity_factor):
            out.append(f"model.moe.capacity_factor={self.capacity_factor} must be a finite positive number "
                       "(1.25 is usual; num_experts / top_k drops nothing)")
        for key in ("aux_loss_weight", "router_z_loss_weight"):
            if not 0 <= getattr(self, key) < math.inf:
                out.append(f"model.moe.{key}={getattr(self, key)} must be 0 (off) or a finite positive number")
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
    # the first this many layers rematerialised under model.remat, the others kept whole (Megatron's
    # --recompute-method block --recompute-num-layers): for when every layer's activations almost fit. None: all
    remat_layers: int | None = None
    attention: str = "auto"  # jax.nn.dot_product_attention implementation, or chunked (jaxtrain/models/attention.py)
    # False: the loop over layers unrolled when compiling (faster steps on CPU, compile time grows with depth);
    # the parameters stay stacked on the layers axis either way, so checkpoints do not change. auto: the trainer
    # unrolls on CPUs and scans elsewhere (jaxtrain/config.py resolve_for_devices); a model built directly, as
    # generation builds it, scans (unrolled decoding was not faster on CPUs)
    scan_layers: bool | str = "auto"
    lora: LoraConfig = LoraConfig()
    base_quant: str = "none"  # the frozen base of a LoRA run stored as int8 or nf4 (QLoRA)
    pipeline: PipelineConfig = PipelineConfig()
    moe: MoEConfig = MoEConfig()
    quant: str = "none"  # quantized training of the layers' matmuls: none, int8, fp8

    @property
    def remat_description(self) -> str:
        """The remat policy and, under model.remat_layers, the layers it applies to: e.g. ``full on the first 8 of 32 layers``."""
        return self.remat if self.remat_layers is None else f"{self.remat} on the first {self.remat_layers} of {self.num_layers} layers"

    @property
    def resolved_head_dim(self) -> int:
        return self.head_dim or self.d_model // self.num_heads

    def expert_adapters(self) -> list[str]:
        """The names (EXPERT_LORA) of the adapters on a mixture of experts' expert weights; [] for a dense model."""
        targets = self.lora.target_names() if self.lora.rank > 0 and self.moe.num_experts else []
        return [name for name, (served, _) in EXPERT_LORA.items() if set(served) & set(targets)]

    def weight_shapes(self) -> dict[str, tuple[int, ...]]:
        """The shape of one layer's weight of each LoRA target."""
        d, h, k, hd, m = self.d_model, self.num_heads, self.num_kv_heads, self.resolved_head_dim, self.mlp_dim
        return {"q": (d, h, hd), "k": (d, k, hd), "v": (d, k, hd), "o": (h, hd, d), "gate": (d, m), "up": (d, m), "down": (m, d)}

    def adapter_problems(self) -> list[str]:
        out = list(self.lora.problems())
        if self.base_quant not in BASE_QUANTS:
            out.append(f"model.base_quant={self.base_quant!r} is unknown; choose one of {', '.join(BASE_QUANTS)}")
        elif self.base_quant != "none" and self.lora.rank <= 0:
            out.append(f"model.base_quant={self.base_quant} stores a frozen base: it needs adapters to train, set model.lora.rank > 0")
        if self.moe.num_experts and self.base_quant != "none":  # jaxtrain/models/moe.py reads its expert weights unquantized
            out.append(f"model.base_quant={self.base_quant} with a mixture of experts (model.moe.num_experts={self.moe.num_experts}): "
                       "expert weights are not stored quantized yet; use model.base_quant=none (adapters over the base in its dtype)")
        expert_targets = [t for t in self.lora.target_names() if LORA_TARGETS[t][0] == "mlp"] if self.moe.num_experts and self.lora.rank > 0 else []
        if ("gate" in expert_targets) != ("up" in expert_targets):
            out.append(f"model.lora.targets names {'gate' if 'gate' in expert_targets else 'up'} without "
                       f"{'up' if 'gate' in expert_targets else 'gate'}: a mixture of experts takes one adapter on its experts' gate and up "
                       "weights together (PEFT's experts.gate_up_proj); name both, or neither")
        if expert_targets and self.lora.dropout:  # PEFT refuses lora_dropout on parameter targets (its ParamWrapper)
            out.append(f"model.lora.dropout={self.lora.dropout} with adapters on the experts ({', '.join(expert_targets)}): PEFT's expert "
                       "adapters take no dropout; set model.lora.dropout=0 or model.lora.targets=q,k,v,o")
        shapes = self.weight_shapes()
        if out or min(min(s) for s in shapes.values()) <= 0:
            return out
        for name in self.lora.target_names() if self.lora.rank > 0 else ():
            inputs = LORA_TARGETS[name][2]
            dims = (math.prod(shapes[name][:inputs]), math.prod(shapes[name][inputs:]))
            if self.lora.rank > min(dims):
                out.append(f"model.lora.rank={self.lora.rank} is larger than the {name} weight's dimensions {dims[0]} x {dims[1]}; "
                           f"use a rank of at most {min(dims)} or drop {name} from model.lora.targets")
                break
        if self.base_quant == "nf4":
            odd = sorted({shape[0] for shape in shapes.values() if shape[0] % 2})
            if odd:
                out.append(f"model.base_quant=nf4 packs two 4-bit codes per byte along each weight's first dimension, which is odd ({odd[0]}); "
                           "use int8")
        return out

    def problems(self) -> list[str]:
        """Every inconsistency in this config, each as one sentence that says how to fix it."""
        out = list(self.rope_scaling.problems()) + self.pipeline.problems() + self.moe.problems()
        if self.remat not in REMAT_POLICIES:
            out.append(f"model.remat={self.remat!r} is not a remat policy; choose one of {', '.join(REMAT_POLICIES)}")
        if self.remat_layers is not None:
            if type(self.remat_layers) is not int or not 0 < self.remat_layers <= self.num_layers:
                out.append(f"model.remat_layers={self.remat_layers!r} must be a number of layers from 1 to "
                           f"model.num_layers={self.num_layers}, or null for every layer")
            elif self.remat == "none":
                out.append(f"model.remat_layers={self.remat_layers} says how many layers model.remat recomputes, but model.remat=none; "
                           "set a policy (model.remat=full, save_dots, ...) or model.remat_layers=null")
        for key in ("dtype", "param_dtype"):
            if getattr(self, key) not in COMPUTE_DTYPES:
                out.append(f"model.{key}={getattr(self, key)!r} is not supported; choose one of {', '.join(COMPUTE_DTYPES)}")
        if self.quant not in QUANT_TYPES:
            out.append(f"model.quant={self.quant!r} is unknown; choose one of {', '.join(QUANT_TYPES)}")
        elif self.quant != "none" and self.dtype == "float16":  # int8 computed other losses, fp8 did not compile
            out.append(f"model.quant={self.quant} with model.dtype=float16: quantized training is not supported from float16 "
                       "operands yet; use model.dtype=bfloat16 (or float32)")
        elif self.quant != "none" and self.moe.num_experts:  # qwix's interception of the layers does not trace them
            out.append(f"model.quant={self.quant} with a mixture of experts (model.moe.num_experts={self.moe.num_experts}): "
                       "quantized training of expert layers is not supported yet; use model.quant=none")
        if self.attention not in ATTENTION_IMPLEMENTATIONS:
            out.append(f"model.attention={self.attention!r} is unknown; choose one of {', '.join(ATTENTION_IMPLEMENTATIONS)}")
        if self.scan_layers not in (True, False, "auto"):
            out.append(f"model.scan_layers={self.scan_layers!r} is unknown; choose true, false or auto")
        for key in ("vocab_size", "d_model", "num_layers", "num_heads", "num_kv_heads", "mlp_dim"):
            if getattr(self, key) <= 0:
                out.append(f"model.{key}={getattr(self, key)} must be positive")
        if self.head_dim is not None and self.head_dim <= 0:
            out.append(f"model.head_dim={self.head_dim} must be positive, or none for model.d_model / model.num_heads")
        for key in ("rope_theta", "norm_eps", "init_std"):
            if not _finite_positive(getattr(self, key)):
                out.append(f"model.{key}={getattr(self, key)} must be a finite positive number")
        if self.num_kv_heads > 0 and self.num_heads % self.num_kv_heads:
            out.append(
                f"model.num_heads={self.num_heads} is not a multiple of model.num_kv_heads={self.num_kv_heads}; "
                "grouped-query attention needs num_heads = k * num_kv_heads"
            )
        if self.head_dim is None and self.num_heads > 0 and self.d_model % self.num_heads:
            out.append(f"model.d_model={self.d_model} is not divisible by model.num_heads={self.num_heads}; set model.head_dim")
        if self.num_heads > 0 and (self.head_dim is None or self.head_dim > 0) and self.resolved_head_dim % 2:
            out.append(f"head dimension {self.resolved_head_dim} must be even for rotary embeddings")
        return out + (self.adapter_problems() if not out else self.lora.problems())
