"""PEFT adapter directories (``adapter_config.json``, ``adapter_model.safetensors``), as
``peft.PeftModel.from_pretrained(base, DIR)`` loads them, to and from our stacked adapters.

PEFT names one layer's adapter of a projection ``base_model.model.<module>.lora_A.weight`` (rank, in) and
``lora_B.weight`` (out, rank), where <module> is the projection's Hugging Face name without ``.weight`` (from
hf_weights' tensor maps); ours are A (layers, inputs..., rank) and B (layers, rank, outputs...), the heads
and head dimension in Hugging Face's order, so each converts by a reshape and a transpose.
No jax import: the arrays are numpy.
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import numpy as np
from safetensors import SafetensorError
from safetensors.numpy import load_file, save_file

from jaxtrain.errors import UserError
from jaxtrain.interop.hf_weights import tensor_maps
from models.config import LORA_TARGETS, LlamaConfig
from models.lora import adapter_name

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
JAXTRAIN_FILE = "jaxtrain_adapter.json"  # our record beside PEFT's files: the base's content hash, steps, eval loss


def is_adapter_dir(path: Path) -> bool:
    return (path / CONFIG_FILE).is_file()


def _modules(model_cfg: LlamaConfig) -> dict[str, str]:
    """LoRA target -> its Hugging Face module name with '{layer}' (e.g. model.layers.{layer}.self_attn.q_proj)."""
    by_path = {tm.path: tm.name.removesuffix(".weight") for tm in tensor_maps(model_cfg)}
    return {target: by_path[("layers", module, weight)] for target, (module, weight, _) in LORA_TARGETS.items()}


def to_peft(adapters: dict, model_cfg: LlamaConfig) -> dict[str, np.ndarray]:
    """Our adapters (numpy, the params tree's ``layers`` subtree) -> PEFT tensors by name."""
    out = {}
    for target, module in _modules(model_cfg).items():
        name, (module_name, _, _) = adapter_name(target), LORA_TARGETS[target]
        if name not in adapters[module_name]:
            continue
        a, b = adapters[module_name][name]["a"], adapters[module_name][name]["b"]
        for layer in range(model_cfg.num_layers):
            prefix = f"base_model.model.{module.format(layer=layer)}"
            out[f"{prefix}.lora_A.weight"] = np.ascontiguousarray(a[layer].reshape(-1, a.shape[-1]).T)
            out[f"{prefix}.lora_B.weight"] = np.ascontiguousarray(b[layer].reshape(b.shape[1], -1).T)
    return out


def from_peft(tensors: dict[str, np.ndarray], model_cfg: LlamaConfig, where: Path) -> dict:
    """PEFT tensors -> our adapters (the ``layers`` subtree), shaped for ``model_cfg``."""
    shapes = model_cfg.weight_shapes()
    out = {}
    for target in model_cfg.lora.target_names():
        module = _modules(model_cfg)[target]
        module_name, _, inputs = LORA_TARGETS[target]
        rank, shape = model_cfg.lora.rank, shapes[target]
        a_layers, b_layers = [], []
        for layer in range(model_cfg.num_layers):
            prefix = f"base_model.model.{module.format(layer=layer)}"
            a, b = tensors.get(f"{prefix}.lora_A.weight"), tensors.get(f"{prefix}.lora_B.weight")
            want_a, want_b = (rank, math.prod(shape[:inputs])), (math.prod(shape[inputs:]), rank)
            if a is None or b is None or a.shape != want_a or b.shape != want_b:
                raise UserError(f"{where / WEIGHTS_FILE}: {prefix}.lora_A/lora_B are {None if a is None else a.shape} / "
                                f"{None if b is None else b.shape}, this base needs {want_a} / {want_b}; the adapter was made for another base")
            a_layers.append(a.T.reshape(*shape[:inputs], rank))
            b_layers.append(b.T.reshape(rank, *shape[inputs:]))
        out.setdefault(module_name, {})[adapter_name(target)] = {"a": np.stack(a_layers), "b": np.stack(b_layers)}
    return out


def targets_of(config: dict, where: Path) -> str:
    """adapter_config.json's target_modules (e.g. q_proj, v_proj) -> our model.lora.targets (q,v)."""
    ours = {module.rsplit(".", 1)[-1]: target for target, module in _modules(LlamaConfig()).items()}
    modules = config.get("target_modules") or []
    modules = [modules] if isinstance(modules, str) else modules
    unknown = [m for m in modules if m not in ours]
    if unknown or not modules:
        raise UserError(f"{where / CONFIG_FILE}: target_modules {modules} are not all Llama projections ({', '.join(ours)})")
    return ",".join(ours[m] for m in modules)


def adapter_config(model_cfg: LlamaConfig, base_path: str | None) -> dict:
    lora = model_cfg.lora
    modules = sorted({_modules(model_cfg)[t].rsplit(".", 1)[-1] for t in lora.target_names()})
    return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base_path, "r": lora.rank,
            "lora_alpha": lora.alpha, "lora_dropout": lora.dropout, "target_modules": modules, "bias": "none",
            "fan_in_fan_out": False, "inference_mode": True, "init_lora_weights": True, "use_rslora": False,
            "use_dora": False, "modules_to_save": None}


def write_adapter(adapters: dict, model_cfg: LlamaConfig, out: Path, base_path: str | None, record: dict) -> None:
    """Write the adapter directory ``out`` whole (a temporary directory renamed when complete)."""
    partial = out.with_name(f"{out.name}.partial")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    try:
        save_file(to_peft(adapters, model_cfg), str(partial / WEIGHTS_FILE))
        (partial / CONFIG_FILE).write_text(json.dumps(adapter_config(model_cfg, base_path), indent=2) + "\n")
        (partial / JAXTRAIN_FILE).write_text(json.dumps(record, indent=2) + "\n")
        partial.rename(out)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise


def read_adapter(adapter_dir: Path) -> tuple[dict, dict[str, np.ndarray], dict | None]:
    """(adapter_config.json, PEFT tensors, our record or None) of an adapter directory."""
    try:
        config = json.loads((adapter_dir / CONFIG_FILE).read_text())
        tensors = load_file(str(adapter_dir / WEIGHTS_FILE))
    except (OSError, ValueError, SafetensorError) as e:
        raise UserError(f"{adapter_dir} is not a readable PEFT adapter directory ({e}); give a directory with "
                        f"{CONFIG_FILE} and {WEIGHTS_FILE}") from None
    if config.get("peft_type") != "LORA":
        raise UserError(f"{adapter_dir / CONFIG_FILE}: peft_type {config.get('peft_type')!r} is not LORA; only LoRA adapters are supported")
    record_path = adapter_dir / JAXTRAIN_FILE
    return config, tensors, json.loads(record_path.read_text()) if record_path.is_file() else None
