"""PEFT adapter directories (``adapter_config.json``, ``adapter_model.safetensors``), as
``peft.PeftModel.from_pretrained(base, DIR)`` loads them, to and from our stacked adapters.

PEFT names one layer's adapter of a projection ``base_model.model.<module>.lora_A.weight`` (rank, in) and
``lora_B.weight`` (out, rank), where <module> is the projection's Hugging Face name without ``.weight`` (from
hf_weights' tensor maps); ours are A (layers, inputs..., rank) and B (layers, rank, outputs...), the heads
and head dimension in Hugging Face's order, so each converts by a reshape and a transpose.

A mixture of experts' adapters (jaxtrain/models/lora.py ExpertLoRA) are PEFT's on Hugging Face's fused expert parameters
(transformers >= 5: ``mlp.experts.gate_up_proj`` (experts, 2 x hidden, d_model), ``mlp.experts.down_proj``), named
in ``target_parameters``: lora_A (experts x rank, in) with the experts outermost, lora_B (out, rank x experts)
with the experts innermost (PEFT's ParamWrapper). PEFT wraps a module's targeted parameters one inside the other
in the module's order, so the first of two is ``experts.base_layer.lora_A``, the last ``experts.lora_A``.
No jax import: the arrays are numpy.
"""

from __future__ import annotations

import json
import math
import re
import shutil
from pathlib import Path

import numpy as np
from safetensors import SafetensorError
from safetensors.numpy import load_file, save

from jaxtrain import atomic
from jaxtrain.errors import UserError
from jaxtrain.interop.hf_config import read_json
from jaxtrain.interop.hf_weights import tensor_maps
from jaxtrain.models.config import EXPERT_LORA, LORA_TARGETS, LlamaConfig, adapter_name

CONFIG_FILE = "adapter_config.json"
# adapter_config.json keys whose non-empty values PEFT computes with and jaxtrain's adapters do not
# (alora_invocation_tokens: activated LoRA applies the adapter only from the invocation tokens on, not to the prompt before)
UNSUPPORTED_OPTIONS = ("use_dora", "alpha_pattern", "rank_pattern", "layers_to_transform", "layers_pattern", "modules_to_save",
                       "fan_in_fan_out", "lora_bias", "alora_invocation_tokens")
# init_lora_weights that also rewrite the base's weights (PiSSA, OLoRA, CorDA, LoRA-GA subtract the adapter's start from
# them, LoftQ quantizes them): saved unconverted, the adapter is a difference from that rewritten base, not from the model's
# own (PEFT's conversion on save, path_initial_model_for_weight_conversion, writes init_lora_weights=True)
BASE_REWRITING_INITS = ("pissa", "olora", "corda", "loftq", "lora_ga")
# the adapter_config.json keys jaxtrain reads or that leave what a plain adapter computes as it is (bookkeeping, the
# initialisation's settings, runtime options); any other key set to a value is an option jaxtrain does not compute:
# refused, as PEFT adds LoRA variants often (QALoRA, layer replication, VeLoRA, KaSA, MonteCLoRA, Arrow, BD-LoRA in 0.21)
PLAIN_KEYS = {"task_type", "peft_type", "auto_mapping", "peft_version", "base_model_name_or_path", "revision", "inference_mode",
              "r", "lora_alpha", "lora_dropout", "target_modules", "exclude_modules", "target_parameters", "bias", "use_rslora",
              "init_lora_weights", "loftq_config", "eva_config", "corda_config", "lora_ga_config", "qalora_group_size",
              "megatron_config", "megatron_core", "runtime_config", "ensure_weight_tying"}
WEIGHTS_FILE = "adapter_model.safetensors"
# what peft.LoraConfig takes for keys an adapter_config.json leaves out (a hand-written one: PEFT's own write them all)
PEFT_DEFAULTS = {"r": 8, "lora_alpha": 8}
JAXTRAIN_FILE = "jaxtrain_adapter.json"  # our record beside PEFT's files: the base's content hash, steps, eval loss
EXPERTS_MODULE = "model.layers.{layer}.mlp.experts"  # Mixtral's and Qwen2-MoE's, transformers >= 5
# our expert adapter -> the fused parameter it adapts, in the module's order (which decides PEFT's nesting)
EXPERT_PARAMETERS = {"gate_up": "gate_up_proj", "down": "down_proj"}
# a causal LM's modules besides the layers' projections that PEFT's target_modules can name (and jaxtrain takes no adapters on)
OTHER_MODULES = ("lm_head", "model.embed_tokens")


def is_adapter_dir(path: Path) -> bool:
    return (path / CONFIG_FILE).is_file()


def check_adapter_source(adapter: Path) -> None:
    """``--adapter PATH`` names a LoRA run directory or a PEFT adapter directory (else a UserError): checked before
    any weight is read."""
    if not (is_adapter_dir(adapter) or (adapter / "config.yaml").is_file()):
        raise UserError(f"--adapter {adapter} is neither a LoRA run directory (config.yaml) nor a PEFT adapter directory "
                        f"({CONFIG_FILE}); give one of them")


def _modules(model_cfg: LlamaConfig) -> dict[str, str]:
    """LoRA target -> its Hugging Face module name with '{layer}' (e.g. model.layers.{layer}.self_attn.q_proj)."""
    by_path = {tm.path: tm.name.removesuffix(".weight") for tm in tensor_maps(model_cfg)}
    return {target: by_path[("layers", module, weight)] for target, (module, weight, _) in LORA_TARGETS.items()}


def _expert_prefixes(model_cfg: LlamaConfig) -> dict[str, str]:
    """Our expert adapter -> the start of its PEFT tensors' names, with '{layer}'."""
    names = [name for name in EXPERT_PARAMETERS if name in model_cfg.expert_adapters()]
    return {name: f"base_model.model.{EXPERTS_MODULE}." + "base_layer." * (len(names) - 1 - i) for i, name in enumerate(names)}


def to_peft(adapters: dict, model_cfg: LlamaConfig) -> dict[str, np.ndarray]:
    """Our adapters (numpy, the params tree's ``layers`` subtree) -> PEFT tensors by name."""
    out = {}
    for name, prefix in _expert_prefixes(model_cfg).items():  # a (experts, in, rank), b (experts, rank, weights, out)
        a, b = adapters["mlp"][adapter_name(name)]["a"], adapters["mlp"][adapter_name(name)]["b"]
        for layer in range(model_cfg.num_layers):
            experts, _, rank = a[layer].shape
            out[f"{prefix.format(layer=layer)}lora_A.weight"] = np.ascontiguousarray(a[layer].transpose(0, 2, 1).reshape(experts * rank, -1))
            out[f"{prefix.format(layer=layer)}lora_B.weight"] = np.ascontiguousarray(
                b[layer].reshape(experts, rank, -1).transpose(2, 1, 0).reshape(-1, rank * experts))
    for target, module in _modules(model_cfg).items():
        if LORA_TARGETS[target][0] == "mlp" and model_cfg.moe.num_experts:  # the experts', above
            continue
        name, (module_name, _, _) = adapter_name(target), LORA_TARGETS[target]
        adapter = adapters.get(module_name, {}).get(name)  # the trained tree has no module without adapters (q,v: no mlp)
        if adapter is None:
            continue
        a, b = adapter["a"], adapter["b"]
        for layer in range(model_cfg.num_layers):
            prefix = f"base_model.model.{module.format(layer=layer)}"
            out[f"{prefix}.lora_A.weight"] = np.ascontiguousarray(a[layer].reshape(-1, a.shape[-1]).T)
            out[f"{prefix}.lora_B.weight"] = np.ascontiguousarray(b[layer].reshape(b.shape[1], -1).T)
    return out


def _check_pair(where: Path, prefix: str, a: np.ndarray | None, b: np.ndarray | None, want_a: tuple, want_b: tuple,
                experts: int = 1) -> None:
    """A UserError unless one layer's lora_A and lora_B have the shapes the base and adapter_config.json's ``r`` ask
    (``experts`` blocks of rank rows each). Tensors of one rank that fit the base otherwise mean a wrong ``r``, not
    another base (a QA report: a hand-edited r was blamed on the base)."""
    if a is not None and b is not None and a.shape == want_a and b.shape == want_b:
        return
    if (a is not None and b is not None and a.ndim == b.ndim == 2 and a.shape[1] == want_a[1] and b.shape[0] == want_b[0]
            and a.shape[0] == b.shape[1] and a.shape[0] % experts == 0):
        raise UserError(f"{where / CONFIG_FILE}: r={want_a[0] // experts}, but the adapter's tensors have rank "
                        f"{a.shape[0] // experts} ({prefix}lora_A is {a.shape}, lora_B {b.shape}); give the r it was saved with")
    raise UserError(f"{where / WEIGHTS_FILE}: {prefix}lora_A/lora_B are {None if a is None else a.shape} / "
                    f"{None if b is None else b.shape}, this base needs {want_a} / {want_b}; the adapter was made for another base")


def from_peft(tensors: dict[str, np.ndarray], model_cfg: LlamaConfig, where: Path) -> dict:
    """PEFT tensors -> our adapters (the ``layers`` subtree), shaped for ``model_cfg``."""
    shapes, rank = model_cfg.weight_shapes(), model_cfg.lora.rank
    out, read = {}, set()

    def pair(prefix: str) -> tuple[np.ndarray | None, np.ndarray | None]:
        names = f"{prefix}lora_A.weight", f"{prefix}lora_B.weight"
        read.update(names)
        return tensors.get(names[0]), tensors.get(names[1])

    for name, prefix in _expert_prefixes(model_cfg).items():
        weights = EXPERT_LORA[name][1]
        inputs, outputs = shapes[EXPERT_LORA[name][0][0]]
        experts = model_cfg.moe.num_experts
        a_layers, b_layers = [], []
        for layer in range(model_cfg.num_layers):
            at = prefix.format(layer=layer)
            a, b = pair(at)
            _check_pair(where, at, a, b, (experts * rank, inputs), (len(weights) * outputs, rank * experts), experts)
            a_layers.append(a.reshape(experts, rank, inputs).transpose(0, 2, 1))
            b_layers.append(b.reshape(-1, rank, experts).transpose(2, 1, 0).reshape(experts, rank, len(weights), outputs))
        out.setdefault("mlp", {})[adapter_name(name)] = {"a": np.stack(a_layers), "b": np.stack(b_layers)}
    for target in model_cfg.lora.target_names():
        if LORA_TARGETS[target][0] == "mlp" and model_cfg.moe.num_experts:  # the experts', above
            continue
        module = _modules(model_cfg)[target]
        module_name, _, inputs = LORA_TARGETS[target]
        shape = shapes[target]
        a_layers, b_layers = [], []
        for layer in range(model_cfg.num_layers):
            prefix = f"base_model.model.{module.format(layer=layer)}"
            a, b = pair(f"{prefix}.")
            _check_pair(where, f"{prefix}.", a, b, (rank, math.prod(shape[:inputs])), (math.prod(shape[inputs:]), rank))
            a_layers.append(a.T.reshape(*shape[:inputs], rank))
            b_layers.append(b.T.reshape(rank, *shape[inputs:]))
        out.setdefault(module_name, {})[adapter_name(target)] = {"a": np.stack(a_layers), "b": np.stack(b_layers)}
    unread = sorted(set(tensors) - read)
    if unread:  # applied without them, the model would not be the adapter's
        raise UserError(f"{where / WEIGHTS_FILE} holds {len(unread)} tensor(s) jaxtrain does not apply ({', '.join(unread[:2])}"
                        f"{', ...' if len(unread) > 2 else ''}): adapters or weights outside its targets "
                        f"{model_cfg.lora.targets}; merge this adapter into its base with peft (merge_and_unload) and give the merged "
                        "model instead")
    return out


def _peft_adapts(config: dict, module: str) -> bool:
    """Whether PEFT puts an adapter on the base's module ``module`` (peft's check_target_module_exists): target_modules
    a regular expression the whole name matches, or names the module's name equals or ends with after a dot
    (``target_modules="all-linear"`` is saved as every module's full name); exclude_modules likewise."""
    def named(patterns) -> bool:
        if isinstance(patterns, str):
            return re.fullmatch(patterns, module) is not None
        return any(module == p or module.endswith(f".{p}") for p in patterns or ())

    return named(config.get("target_modules")) and not named(config.get("exclude_modules"))


def targets_of(config: dict, where: Path, model_cfg: LlamaConfig) -> str:
    """adapter_config.json's target_modules (e.g. q_proj, v_proj; full module names; a regular expression) and
    target_parameters (a mixture of experts': experts.gate_up_proj, experts.down_proj) -> our model.lora.targets for
    the base ``model_cfg`` (q,v); a UserError for adapters on anything else or on only some layers."""
    modules = config.get("target_modules") or []
    parameters = config.get("target_parameters") or []
    if not modules and not parameters:
        raise UserError(f"{where / CONFIG_FILE}: neither target_modules nor target_parameters: the adapter adapts nothing")
    for key in ("target_modules", "exclude_modules"):
        if isinstance(config.get(key), str):
            try:
                re.compile(config[key])
            except re.error as e:
                raise UserError(f"{where / CONFIG_FILE}: {key} {config[key]!r} is not a regular expression ({e}); PEFT would "
                                "not load this adapter either: give a valid expression or a list of module names") from None
    projections = _modules(LlamaConfig())  # q -> model.layers.{layer}.self_attn.q_proj, as transformers names it
    names = ", ".join(module.rsplit(".", 1)[-1] for module in projections.values())
    adapted = {target: [layer for layer in range(model_cfg.num_layers) if _peft_adapts(config, module.format(layer=layer))]
               for target, module in projections.items()}
    others = [module for module in OTHER_MODULES if _peft_adapts(config, module)]
    if others:
        raise UserError(f"{where / CONFIG_FILE}: target_modules {modules} adapt {', '.join(others)}; jaxtrain takes adapters on the "
                        f"layers' projections only ({names})")
    chosen = [target for target, layers in adapted.items() if layers]
    if modules and not chosen:
        raise UserError(f"{where / CONFIG_FILE}: target_modules {modules} name none of this base's layer projections ({names})")
    mlp = [projections[t].rsplit(".", 1)[-1] for t in chosen if LORA_TARGETS[t][0] == "mlp"]
    if model_cfg.moe.num_experts and mlp:
        raise UserError(f"{where / CONFIG_FILE}: target_modules {', '.join(mlp)} on a mixture of experts name the shared expert's "
                        f"projections, which jaxtrain takes no adapters on; the experts' are target_parameters "
                        f"{', '.join('experts.' + p for p in EXPERT_PARAMETERS.values())}")
    partial = {projections[t].rsplit(".", 1)[-1]: adapted[t] for t in chosen if len(adapted[t]) < model_cfg.num_layers}
    if partial:
        on = "; ".join(f"{name} in layers {layers}" for name, layers in partial.items())
        raise UserError(f"{where / CONFIG_FILE}: the adapters are on {on} only, of the base's {model_cfg.num_layers} layers; jaxtrain "
                        "applies adapters on every layer: merge this adapter into its base with peft (merge_and_unload) and give "
                        "the merged model instead")
    experts = {f"experts.{parameter}": name for name, parameter in EXPERT_PARAMETERS.items()}
    named = [next((name for key, name in experts.items() if p == key or p.endswith(f".{key}")), None) for p in parameters]
    if parameters and (not model_cfg.moe.num_experts or None in named):
        raise UserError(f"{where / CONFIG_FILE}: target_parameters {parameters} are not this base's expert parameters "
                        f"({', '.join(experts) if model_cfg.moe.num_experts else 'a dense model has none'})")
    chosen = set(chosen) | {t for name in named for t in EXPERT_LORA[name][0]}
    return ",".join(t for t in LORA_TARGETS if t in chosen)  # PEFT keeps its lists as sets: their order varies


def adapter_config(model_cfg: LlamaConfig, base_path: str | None) -> dict:
    lora = model_cfg.lora
    modules = sorted({_modules(model_cfg)[t].rsplit(".", 1)[-1] for t in lora.target_names()
                      if not (LORA_TARGETS[t][0] == "mlp" and model_cfg.moe.num_experts)})
    parameters = [f"experts.{EXPERT_PARAMETERS[name]}" for name in _expert_prefixes(model_cfg)]
    return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base_path, "r": lora.rank,
            "lora_alpha": lora.alpha, "lora_dropout": lora.dropout, "target_modules": modules or None,
            "target_parameters": parameters or None, "bias": "none", "fan_in_fan_out": False, "inference_mode": True,
            "init_lora_weights": True, "use_rslora": False, "use_dora": False, "modules_to_save": None}


def write_adapter(adapters: dict, model_cfg: LlamaConfig, out: Path, base_path: str | None, record: dict,
                  dtype: str = "float32") -> None:
    """Write the adapter directory ``out`` whole (a temporary directory renamed when complete), tensors in ``dtype``."""
    partial = out.with_name(f"{out.name}.partial")
    atomic.fresh_dir(partial, f"--out {out}")
    with atomic.failed_writes_reported(out, "adapter directory", f"{partial} is removed"):
        try:
            # serialized here and written by Python, whose OSError names a full disk (the library's save_file raised its own
            # SafetensorError for it, a traceback); adapters are small
            tensors = {name: x.astype(np.dtype(dtype)) for name, x in to_peft(adapters, model_cfg).items()}
            (partial / WEIGHTS_FILE).write_bytes(save(tensors))
            (partial / CONFIG_FILE).write_text(json.dumps(adapter_config(model_cfg, base_path), indent=2) + "\n")
            (partial / JAXTRAIN_FILE).write_text(json.dumps(record, indent=2) + "\n")
            atomic.publish(partial, out)
        except BaseException:
            shutil.rmtree(partial, ignore_errors=True)
            raise


def unsupported_options(config: dict) -> list[str]:
    """adapter_config.json's options that change what the adapter computes and jaxtrain's plain LoRA (alpha / r, or
    alpha / sqrt(r) with use_rslora, on every layer) does not do, as key=value."""
    init = config.get("init_lora_weights")
    unknown = [key for key in config if key not in PLAIN_KEYS and key not in UNSUPPORTED_OPTIONS]
    return [f"{key}={config[key]!r}" for key in (*UNSUPPORTED_OPTIONS, *unknown) if config.get(key)] + \
        ([f"bias={config['bias']!r}"] if config.get("bias", "none") != "none" else []) + \
        ([f"init_lora_weights={init!r}"] if isinstance(init, str) and init.startswith(BASE_REWRITING_INITS) else [])


def not_applied(config: dict) -> list[str]:
    """What of adapter_config.json jaxtrain does not apply, for `jaxtrain adapters`' mark: the options
    ``unsupported_options`` names and adapters on modules besides the layers' projections (``OTHER_MODULES``), which
    applying refuses (``targets_of``)."""
    others = [module for module in OTHER_MODULES if _peft_adapts(config, module)]
    return unsupported_options(config) + ([f"adapters on {', '.join(others)}"] if others else [])


def read_config(adapter_dir: Path) -> dict:
    """adapter_config.json, a UserError where it is not a JSON object (``jaxtrain adapters`` printed a traceback)."""
    return read_json(adapter_dir / CONFIG_FILE, fix="save the adapter again (PEFT's save_pretrained writes it)")


def read_adapter_config(adapter_dir: Path) -> dict:
    """adapter_config.json with PEFT's defaults, a UserError unless it is a LoRA adapter jaxtrain applies as it is
    (read before any weight, the base's or the adapter's)."""
    config = PEFT_DEFAULTS | read_config(adapter_dir)
    if config.get("peft_type") != "LORA":
        raise UserError(f"{adapter_dir / CONFIG_FILE}: peft_type {config.get('peft_type')!r} is not LORA; only LoRA adapters are supported")
    # read as plain adapters, they generated other text with exit 0
    if options := unsupported_options(config):
        raise UserError(f"{adapter_dir / CONFIG_FILE}: {', '.join(options)}: jaxtrain applies plain LoRA adapters only (scaled "
                        "lora_alpha / r, or / sqrt(r) with use_rslora, on every layer, no biases or other trained modules, on the base "
                        "as it is); "
                        "merge this adapter into its base with peft (merge_and_unload) and give the merged model instead")
    # PEFT writes r as an integer and lora_alpha as a number; a hand-edited r of 0 was blamed on the base's shape, and
    # lora_alpha null stopped with a traceback
    rank, alpha = config["r"], config["lora_alpha"]
    if type(rank) is not int or rank < 1:
        raise UserError(f"{adapter_dir / CONFIG_FILE}: r={rank!r} is not a positive integer (the adapters' rank, the rows of "
                        "each lora_A.weight); give the rank the adapter was saved with")
    if type(alpha) not in (int, float) or not math.isfinite(alpha):
        raise UserError(f"{adapter_dir / CONFIG_FILE}: lora_alpha={alpha!r} is not a finite number (each update is scaled by "
                        "lora_alpha / r); give the lora_alpha the adapter was trained with")
    return config


def read_adapter(adapter_dir: Path) -> tuple[dict, dict[str, np.ndarray], dict | None]:
    """(adapter_config.json, PEFT tensors, our record or None) of an adapter directory."""
    config = read_adapter_config(adapter_dir)
    try:
        tensors = load_file(str(adapter_dir / WEIGHTS_FILE))
    except (OSError, ValueError, SafetensorError) as e:
        raise UserError(f"{adapter_dir} is not a readable PEFT adapter directory ({e}); give a directory with "
                        f"{CONFIG_FILE} and {WEIGHTS_FILE}") from None
    return config, tensors, read_jaxtrain_record(adapter_dir)


def read_jaxtrain_record(adapter_dir: Path) -> dict | None:
    """Our record beside an adapter's PEFT files, None where it has none (exported elsewhere)."""
    path = adapter_dir / JAXTRAIN_FILE
    return read_json(path, fix="fix it, or export the adapter again (jaxtrain export-hf writes it)") if path.is_file() else None
