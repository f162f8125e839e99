"""Hugging Face ``config.json`` <-> the model config.

No jax import: ``jaxtrain train --init-from HF_DIR`` reads the model shape from here before jax starts.
Both config.json dialects are read: transformers 5's ``rope_parameters`` and the older ``rope_theta`` +
``rope_scaling``; export writes the older one, which transformers 4 and 5 (and serving engines) read.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from jaxtrain.errors import UserError
from jaxtrain.models.config import LlamaConfig

CONFIG_FILE = "config.json"
GENERATION_CONFIG_FILE = "generation_config.json"
# architecture -> model_type
ARCHITECTURES = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral", "Qwen2ForCausalLM": "qwen2",
                 "MixtralForCausalLM": "mixtral", "Qwen2MoeForCausalLM": "qwen2_moe"}
WITH_QKV_BIAS = ("Qwen2ForCausalLM", "Qwen2MoeForCausalLM")
# model.KEY -> config.json key, for every model field config.json decides
SHAPE_KEYS = {
    "vocab_size": "vocab_size", "d_model": "hidden_size", "num_layers": "num_hidden_layers",
    "num_heads": "num_attention_heads", "num_kv_heads": "num_key_value_heads", "head_dim": "head_dim",
    "mlp_dim": "intermediate_size", "rope_theta": "rope_theta", "norm_eps": "rms_norm_eps",
    "tie_embeddings": "tie_word_embeddings", "qkv_bias": "architectures (Qwen2: query/key/value biases)",
    "rope_scaling.type": "rope_scaling.rope_type", "rope_scaling.factor": "rope_scaling.factor",
    "rope_scaling.low_freq_factor": "rope_scaling.low_freq_factor",
    "rope_scaling.high_freq_factor": "rope_scaling.high_freq_factor",
    "rope_scaling.original_max_len": "rope_scaling.original_max_position_embeddings",
    "moe.num_experts": "num_local_experts (Mixtral) or num_experts (Qwen2-MoE)", "moe.top_k": "num_experts_per_tok",
    "moe.normalize_top_k": "norm_topk_prob", "moe.num_shared_experts": "shared_expert_intermediate_size / moe_intermediate_size",
    "moe.shared_expert_gate": "architectures (Qwen2-MoE: a gated shared expert)",
}
REQUIRED = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
OPTIONAL_SIZES = ("num_key_value_heads", "head_dim")  # null or missing: from num_attention_heads
ROPE_TYPES = {"default": "none", "llama3": "llama3"}  # config.json rope_type -> model.rope_scaling.type
LLAMA3_ROPE_KEYS = ("factor", "low_freq_factor", "high_freq_factor")  # what transformers' llama3 rope requires
# transformers' defaults for these architectures when config.json leaves a key out; ARCHITECTURE_DEFAULTS: where an
# architecture's config class has its own (read as the common ones, a Mixtral without rms_norm_eps and rope_theta was
# another model, and a Mistral without sliding_window attended past transformers' window)
DEFAULT_NORM_EPS = 1e-6
DEFAULT_ROPE_THETA = 10000.0
# transformers' max_position_embeddings, which a llama3 rope without original_max_position_embeddings scales from; not a
# context limit here (context_length: none where config.json names none)
DEFAULT_MAX_POSITIONS = {"LlamaForCausalLM": 2048, "MistralForCausalLM": 4096 * 32, "Qwen2ForCausalLM": 32768,
                         "MixtralForCausalLM": 4096 * 32, "Qwen2MoeForCausalLM": 32768}
QWEN2_MAX_WINDOW_LAYERS = 28  # Qwen2's and Qwen2-MoE's default: the first layer with a sliding window, if any
ARCHITECTURE_DEFAULTS = {
    "MistralForCausalLM": {"num_key_value_heads": 8, "sliding_window": 4096},
    "Qwen2ForCausalLM": {"num_key_value_heads": 32},
    "MixtralForCausalLM": {"num_key_value_heads": 8, "rms_norm_eps": 1e-5, "rope_theta": 1e6},
    "Qwen2MoeForCausalLM": {"num_key_value_heads": 16, "num_experts": 60, "moe_intermediate_size": 1408,
                            "shared_expert_intermediate_size": 5632},
}


def is_hf_dir(path: Path) -> bool:
    """A Hugging Face model directory (config.json), as opposed to a jaxtrain run or checkpoint directory."""
    return (path / CONFIG_FILE).is_file()


def read_json(path: Path, fix: str = "give a Hugging Face model directory") -> dict:
    """The JSON object in ``path``; one line ending in ``fix`` where it is unreadable or not an object."""
    try:
        body = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise UserError(f"{path} is not readable JSON ({e}); {fix}") from None
    if not isinstance(body, dict):
        raise UserError(f"{path} must hold a JSON object, got {type(body).__name__}; {fix}")
    return body


def architecture(config: dict, where: str) -> str:
    names = config.get("architectures") or []
    by_type = {t: a for a, t in ARCHITECTURES.items()}
    name = names[0] if names else by_type.get(config.get("model_type"), config.get("model_type"))
    if name not in ARCHITECTURES:
        field = f"architectures={names}" if names else f"model_type={config.get('model_type')!r}"
        raise UserError(f"{where}: {field} is not supported; supported: {', '.join(ARCHITECTURES)}")
    return name


def _is_number(value, types=(int, float)) -> bool:
    return isinstance(value, types) and not isinstance(value, bool)  # JSON's true is no size


def _unsupported(where: str, field: str, value, supported: str) -> UserError:
    return UserError(f"{where}: {field}={value!r} is not supported ({supported})")


def _rope(config: dict, arch: str, where: str) -> dict:
    """model.rope_theta and model.rope_scaling.* from either dialect."""
    params = config.get("rope_parameters") or config.get("rope_scaling") or {}
    if not isinstance(params, dict):  # an AttributeError traceback (a QA report)
        key = "rope_parameters" if config.get("rope_parameters") else "rope_scaling"
        raise UserError(f"{where}: {key}={params!r}: expected an object (rope_type and its numbers) or null; download the model again")
    theta = params.get("rope_theta", config.get("rope_theta", DEFAULT_ROPE_THETA))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in ROPE_TYPES:
        raise _unsupported(where, "rope_scaling.rope_type", rope_type, f"supported: {', '.join(ROPE_TYPES)}")
    partial = params.get("partial_rotary_factor", config.get("partial_rotary_factor", 1.0))
    if partial != 1.0:
        raise _unsupported(where, "partial_rotary_factor", partial, "rotary embeddings over the whole head only")
    values = {"rope_theta": float(theta), "rope_scaling.type": ROPE_TYPES[rope_type]}
    if rope_type == "llama3":
        wrong = [f"{key}={params.get(key)!r}" for key in LLAMA3_ROPE_KEYS if not _is_number(params.get(key))]
        if wrong:
            raise UserError(f"{where}: rope_type llama3 needs numbers {', '.join(LLAMA3_ROPE_KEYS)}; it has {', '.join(wrong)}")
        values |= {"rope_scaling.factor": float(params["factor"]), "rope_scaling.low_freq_factor": float(params["low_freq_factor"]),
                   "rope_scaling.high_freq_factor": float(params["high_freq_factor"]),
                   "rope_scaling.original_max_len": int(params.get("original_max_position_embeddings",
                                                                   config.get("max_position_embeddings", DEFAULT_MAX_POSITIONS[arch])))}
    return values


def model_values(config: dict, where: str, seq_len: int) -> dict:
    """The model fields config.json decides, as flat ``model.*`` keys (``rope_scaling.type``); UserError
    naming the field and value for anything this model cannot reproduce exactly."""
    arch = architecture(config, where)
    config = ARCHITECTURE_DEFAULTS.get(arch, {}) | config
    missing = [k for k in REQUIRED if k not in config]
    if missing:
        raise UserError(f"{where}: {', '.join(missing)} missing; a {arch} config.json needs {', '.join(REQUIRED)}")
    # a string or null size was a TypeError traceback in the range checks (a QA report); a null optional size is unset
    sizes = [*REQUIRED, *(key for key in OPTIONAL_SIZES if config.get(key) is not None)]
    wrong = [f"{key}={config[key]!r}" for key in sizes if not _is_number(config[key], int)]
    wrong += [f"{key}={config[key]!r}" for key in ("rms_norm_eps", "rope_theta") if key in config and not _is_number(config[key])]
    if wrong:
        raise UserError(f"{where}: {', '.join(wrong)}: expected a number (a whole one for a size); download the model again")
    tied = config.get("tie_word_embeddings") or False
    if not isinstance(tied, bool):  # bool() read the string "false" as tied
        raise UserError(f"{where}: tie_word_embeddings={tied!r}: expected true or false; download the model again")
    if config.get("hidden_act", "silu") != "silu":
        raise _unsupported(where, "hidden_act", config["hidden_act"], "only silu (SwiGLU)")
    if arch not in WITH_QKV_BIAS and config.get("attention_bias"):
        raise _unsupported(where, "attention_bias", True, f"{arch} without projection biases only")
    if config.get("mlp_bias"):
        raise _unsupported(where, "mlp_bias", True, "MLP without biases only")
    quantization = config.get("quantization_config")
    if quantization:  # its packed tensors were named as missing or misshapen, as if the files did not match config.json
        method = quantization.get("quant_method") if isinstance(quantization, dict) else quantization
        raise _unsupported(where, "quantization_config.quant_method", method, "weights in BF16, F16 or F32 only: give the "
                           "unquantized model; a LoRA run quantizes its frozen base itself, model.base_quant=int8|nf4")
    window = _sliding_window(config, arch)
    if window is not None and window < seq_len:
        raise UserError(f"{where}: sliding_window={window} is shorter than data.seq_len={seq_len}, and this model attends to "
                        f"the whole sequence; set data.seq_len<={window}")
    heads = config["num_attention_heads"]
    return {
        "vocab_size": config["vocab_size"], "d_model": config["hidden_size"], "num_layers": config["num_hidden_layers"],
        "num_heads": heads, "num_kv_heads": config.get("num_key_value_heads") or heads,
        "head_dim": config.get("head_dim") or config["hidden_size"] // heads, "mlp_dim": config["intermediate_size"],
        "norm_eps": float(config.get("rms_norm_eps", DEFAULT_NORM_EPS)),
        "tie_embeddings": tied, "qkv_bias": arch in WITH_QKV_BIAS,
    } | _rope(config, arch, where) | _moe(config, arch, where)


def _moe(config: dict, arch: str, where: str) -> dict:
    """model.moe.* (and the experts' model.mlp_dim) from a Mixtral or Qwen2-MoE config.json; a dense model's 0 experts."""
    if arch == "MixtralForCausalLM":
        return {"moe.num_experts": config.get("num_local_experts", 8), "moe.top_k": config.get("num_experts_per_tok", 2),
                "moe.normalize_top_k": True, "moe.num_shared_experts": 0, "moe.shared_expert_gate": False}
    if arch != "Qwen2MoeForCausalLM":
        return {"moe.num_experts": 0}
    if config.get("decoder_sparse_step", 1) != 1 or config.get("mlp_only_layers"):
        raise _unsupported(where, "decoder_sparse_step / mlp_only_layers", (config.get("decoder_sparse_step"), config.get("mlp_only_layers")),
                           "every layer a mixture of experts: decoder_sparse_step 1, mlp_only_layers []")
    expert_dim, shared_dim = config["moe_intermediate_size"], config["shared_expert_intermediate_size"]
    if shared_dim % expert_dim or not shared_dim:  # without one, it was read as a Mixtral: a tensor "missing" from the files
        raise _unsupported(where, "shared_expert_intermediate_size", shared_dim,
                           f"a shared expert: a positive multiple of moe_intermediate_size={expert_dim}")
    return {"mlp_dim": expert_dim, "moe.num_experts": config["num_experts"], "moe.top_k": config.get("num_experts_per_tok", 4),
            "moe.normalize_top_k": bool(config.get("norm_topk_prob", False)), "moe.num_shared_experts": shared_dim // expert_dim,
            "moe.shared_expert_gate": shared_dim > 0}


def flat_model(model: LlamaConfig) -> dict:
    """``model.*`` keys without the prefix, nested sections dotted: {'d_model': 256, 'rope_scaling.type': 'none', ...}."""
    out = {}
    for key, value in dataclasses.asdict(model).items():
        if isinstance(value, dict):
            out.update({f"{key}.{k}": v for k, v in value.items()})
        else:
            out[key] = value
    return out


RUN_SUBDIR = "hf"  # where a run initialised from a Hugging Face model keeps its config and tokenizer (hf_import.py)


def _sliding_window(config: dict, arch: str) -> int | None:
    """The attention window transformers applies to some layer (Mistral, Mixtral: every layer; Qwen2 with
    use_sliding_window: the layers from max_window_layers on, which may be none); None: none."""
    window = config.get("sliding_window")
    if "layer_types" in config:  # transformers 5 writes each layer's attention
        windowed = "sliding_attention" in config["layer_types"]
    elif arch in ("MistralForCausalLM", "MixtralForCausalLM"):
        windowed = True
    else:  # read as every layer's, a Qwen2 window no layer uses was refused at a longer data.seq_len
        windowed = bool(config.get("use_sliding_window")) and config.get("max_window_layers", QWEN2_MAX_WINDOW_LAYERS) < \
            config.get("num_hidden_layers", 0)
    return window if window is not None and windowed else None


def context_length(directory: Path, trained: tuple[int, str] | None = None) -> tuple[int, str] | None:
    """A Hugging Face model's positions and the config.json key that decides them: max_position_embeddings, or a
    shorter sliding window (this model attends to every position: within the window, as transformers does); None
    where neither says. ``trained``: a run fine-tuned from the model (``trained_context``), whose longer sequences
    count instead of a shorter max_position_embeddings (its export-hf writes them), not instead of the window."""
    path = directory / CONFIG_FILE
    if not path.is_file():
        return None
    config = read_json(path)
    arch = architecture(config, str(path))
    config = ARCHITECTURE_DEFAULTS.get(arch, {}) | config
    limits = [(value, key) for key, value in (("max_position_embeddings", config.get("max_position_embeddings")),
                                              ("sliding_window", _sliding_window(config, arch)))
              if isinstance(value, int) and value > 0]
    if trained and limits and limits[0][1] == "max_position_embeddings" and trained[0] > limits[0][0]:
        limits[0] = trained
    return min(limits, default=None)


def end_of_sequence_ids(directory: Path) -> tuple[int, ...]:
    """The tokens transformers' ``generate`` stops at for the model in ``directory``: generation_config.json's
    ``eos_token_id`` (an id or a list: an instruct model's end of text and end of turn), else config.json's; () where
    neither file names one."""
    for path in (directory / GENERATION_CONFIG_FILE, directory / CONFIG_FILE):
        ids = read_json(path).get("eos_token_id") if path.is_file() else None
        if ids is None:
            continue
        ids = ids if isinstance(ids, list) else [ids]
        if not all(type(i) is int and i >= 0 for i in ids):
            raise UserError(f"{path}: eos_token_id must be a token id or a list of them, got {ids!r}; fix it (transformers "
                            "reads it too)")
        return tuple(ids)
    return ()


def trained_context(model: LlamaConfig, seq_len: int) -> tuple[int, str]:
    """The positions of a run trained from scratch and the key that decides them: what its export-hf writes as
    max_position_embeddings, so generating from the run and from its export is bounded alike."""
    # transformers refuses to call a scaled rope's original context longer than the model's
    if model.rope_scaling.type != "none" and model.rope_scaling.original_max_len > seq_len:
        return model.rope_scaling.original_max_len, "model.rope_scaling.original_max_len"
    return seq_len, "data.seq_len"


def has_placeholder_shape(model: LlamaConfig) -> bool:
    """Whether ``model``'s shape is LlamaConfig's default: a placeholder, what an experiment that sets no shape of
    its own (finetune, which takes one from --init-from HF_DIR) holds."""
    defaults, ours = flat_model(LlamaConfig()), flat_model(model)
    return all(ours[key] == defaults[key] for key in SHAPE_KEYS)


def given_model_keys(experiment_model: LlamaConfig, overrides: list[str]) -> set[str]:
    """The model keys a user gave: those the experiment sets to something other than LlamaConfig's default,
    and every model.* key on the command line (a value equal to the default in an experiment cannot be told
    from an unset one)."""
    defaults, ours = flat_model(LlamaConfig()), flat_model(experiment_model)
    given = {k for k, v in ours.items() if v != defaults[k]}
    keys = (item.partition("=")[0].strip() for item in overrides)
    return given | {k.removeprefix("model.") for k in keys if k.startswith("model.")}


def model_config(hf_dir: Path, model: LlamaConfig, given: set[str], seq_len: int) -> LlamaConfig:
    """``model`` with every field config.json decides taken from there; a given key that disagrees is an error
    naming both values. dtype, param_dtype, remat, attention stay the user's."""
    where = str(hf_dir / CONFIG_FILE)
    values = model_values(read_json(hf_dir / CONFIG_FILE), where, seq_len)
    current = flat_model(model)
    for key, value in values.items():
        if key in given and current[key] != value:
            raise UserError(f"model.{key}={current[key]} (experiment or command line) disagrees with {SHAPE_KEYS[key]}={value} "
                            f"in {where}; the model's shape comes from there: drop model.{key} from the command line, use an "
                            "experiment that sets no model shape (finetune) or this model's, or another model directory")
    sections = {section: dataclasses.replace(getattr(model, section), **{k.removeprefix(f"{section}."): v for k, v in values.items()
                                                                         if k.startswith(f"{section}.")})
                for section in ("rope_scaling", "moe")}
    top = {k: v for k, v in values.items() if "." not in k}
    return dataclasses.replace(model, **top, **sections)


def _architecture_for(model: LlamaConfig, base: dict) -> str:
    """The source model's architecture when this model still is one (Qwen2 has the biases, the others not)."""
    try:
        source = architecture(base, "") if base else None
    except UserError:
        source = None
    if model.moe.num_experts:
        return moe_architecture(model)
    if source and source not in ("MixtralForCausalLM", "Qwen2MoeForCausalLM") and (source == "Qwen2ForCausalLM") == model.qkv_bias:
        return source
    return "Qwen2ForCausalLM" if model.qkv_bias else "LlamaForCausalLM"


def moe_architecture(model: LlamaConfig) -> str:
    """Mixtral (no shared experts, no biases, top-k weights renormalised) or Qwen2-MoE (a gated shared expert,
    query/key/value biases); UserError for a mixture of experts that is neither."""
    moe = model.moe
    if not moe.num_shared_experts and not model.qkv_bias and moe.normalize_top_k:
        return "MixtralForCausalLM"
    if moe.num_shared_experts and moe.shared_expert_gate and model.qkv_bias:
        return "Qwen2MoeForCausalLM"
    raise UserError(f"model.moe (num_shared_experts={moe.num_shared_experts}, shared_expert_gate={moe.shared_expert_gate}, "
                    f"normalize_top_k={moe.normalize_top_k}) with model.qkv_bias={model.qkv_bias} is neither a Mixtral nor a "
                    "Qwen2-MoE model, so no Hugging Face architecture holds it")


def export_config(model: LlamaConfig, dtype: str, seq_len: int, base: dict | None = None) -> dict:
    """config.json for ``model``: the imported model's own config.json (``base``, which keeps its token ids,
    context length, sliding window...) with every field this model decides written over it."""
    base = dict(base or {})
    arch = _architecture_for(model, base)
    for key in ("rope_parameters", "rope_scaling", "rope_theta", "torch_dtype", "dtype", "architectures", "model_type"):
        base.pop(key, None)
    s = model.rope_scaling
    rope_scaling = None if s.type == "none" else {
        "rope_type": s.type, "factor": s.factor, "low_freq_factor": s.low_freq_factor,
        "high_freq_factor": s.high_freq_factor, "original_max_position_embeddings": s.original_max_len}
    positions, _ = trained_context(model, seq_len)
    body = {
        "architectures": [arch], "model_type": ARCHITECTURES[arch], "vocab_size": model.vocab_size,
        "hidden_size": model.d_model, "intermediate_size": model.mlp_dim, "num_hidden_layers": model.num_layers,
        "num_attention_heads": model.num_heads, "num_key_value_heads": model.num_kv_heads, "head_dim": model.resolved_head_dim,
        "hidden_act": "silu", "rms_norm_eps": model.norm_eps, "rope_theta": model.rope_theta, "rope_scaling": rope_scaling,
        "tie_word_embeddings": model.tie_embeddings, "max_position_embeddings": _exported_positions(base, positions),
        "torch_dtype": dtype, "dtype": dtype,  # transformers 4 reads the first, 5 the second
    }
    if arch == "LlamaForCausalLM":
        body |= {"attention_bias": False, "mlp_bias": False}
    moe = model.moe
    # transformers' load-balancing loss is top_k times ours at the same routing (its token shares sum to top_k): its
    # coefficient at our weight / top_k weighs it as the run did
    router = {"num_experts_per_tok": moe.top_k, "router_aux_loss_coef": moe.aux_loss_weight / moe.top_k}
    if arch == "MixtralForCausalLM":
        body |= router | {"num_local_experts": moe.num_experts}
    elif arch == "Qwen2MoeForCausalLM":
        # every layer is sparse, so transformers sizes no MLP by intermediate_size: the imported model's value stays
        body |= router | {"intermediate_size": base.get("intermediate_size", model.mlp_dim),
                          "num_experts": moe.num_experts, "norm_topk_prob": moe.normalize_top_k, "moe_intermediate_size": model.mlp_dim,
                          "shared_expert_intermediate_size": moe.num_shared_experts * model.mlp_dim, "decoder_sparse_step": 1,
                          "mlp_only_layers": []}
    return base | body


def _exported_positions(base: dict, trained: int) -> int:
    """max_position_embeddings of an export: the source's, or the positions the run trained where more (sequences
    longer than the source's context: serving engines and ``jaxtrain generate`` take the number as the model's limit)."""
    source = base.get("max_position_embeddings")
    return max(source, trained) if isinstance(source, int) else trained


def generation_config(config: dict, base: dict | None) -> dict:
    """generation_config.json: the imported model's own, else the token ids its config.json names."""
    if base:
        return base
    return {k: config[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if config.get(k) is not None}
