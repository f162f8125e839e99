"""A LoRA run's frozen base: where it comes from (``--init-from`` a Hugging Face model directory or another
run, else the run's seed), its content hash, its storage (quantized with ``model.base_quant``), and the
merged model (adapters folded into the weights).

The base is never checkpointed: RUN_DIR/lora_base.json records its path and content hash, a resumed run
reloads it from there and refuses a base whose content differs.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import math
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
from flax import nnx
from jax.experimental import multihost_utils

from jaxtrain import checkpoint as checkpoint_lib
from jaxtrain import config as config_lib
from jaxtrain.adapt.adapters import BASE_RECORD, join_frozen, read_record, split_frozen, summary
from jaxtrain.atomic import atomic_file
from jaxtrain.config import Config
from jaxtrain.errors import UserError
from jaxtrain.interop import hf_config, hf_export, hf_import, peft
from jaxtrain.layout import Layout, make_layout
from jaxtrain.partitioning import param_shardings
from jaxtrain.state import TrainState, fresh_state, model_spec
from jaxtrain.models.config import EXPERT_LORA, LORA_TARGETS, LlamaConfig, LoraConfig, adapter_name
from jaxtrain.models.llama import Llama
from jaxtrain.models.quant import dequantize, quantize

def plain_config(model_cfg: LlamaConfig) -> LlamaConfig:
    """The base model alone: no adapters, weights in their float dtype."""
    return dataclasses.replace(model_cfg, lora=LoraConfig(), base_quant="none")


def plain_abstract(layout: Layout) -> dict:
    """The base model's parameters as ShapeDtypeStructs carrying the layout's shardings."""
    spec = model_spec(plain_config(layout.cfg.model))
    shardings = param_shardings(spec.logical_axes, spec.shapes, layout.rules, layout.mesh)
    return jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh), spec.shapes, shardings)


def load_plain(layout: Layout, source: Path | None) -> tuple[dict, Path | None]:
    """(the base's float parameters on the mesh, where they were read): a Hugging Face model directory, another
    run's checkpoint (a run directory: its newest, and the step directory read is returned, so a record names the
    weights, not a run that may train on), or (``source`` None) initialised from train.seed."""
    abstract = plain_abstract(layout)
    cfg = plain_config(layout.cfg.model)
    if source is None:
        init = lambda: nnx.to_pure_dict(nnx.state(Llama(cfg, rngs=nnx.Rngs(layout.cfg.train.seed))))  # noqa: E731
        return jax.jit(init, out_shardings=jax.tree.map(lambda a: a.sharding, abstract))(), None
    if hf_config.is_hf_dir(source):
        return hf_import.load_params(source, cfg, abstract), source
    target = TrainState(step=None, params=abstract, opt_state=None)
    read, params = checkpoint_lib.restore_step_from(source, target, None, params_only=True, source="the LoRA base")
    return params, read


@functools.partial(jax.jit, static_argnums=1)
def _leaf_sums(params: dict, dtype) -> dict:
    """Per parameter, cast to ``dtype`` (None: as it is): the sum, wrapping modulo 2**32, of each element's bits times an
    odd weight of its position; any order of summation gives the same value, so the hash does not depend on the sharding."""

    def one(x):
        x = x if dtype is None else x.astype(dtype)
        bits = jax.lax.bitcast_convert_type(x, {4: jnp.uint32, 2: jnp.uint16, 1: jnp.uint8}[x.dtype.itemsize]).astype(jnp.uint32)
        position = jnp.arange(x.size, dtype=jnp.uint32).reshape(x.shape)
        return jnp.sum(bits * (position * jnp.uint32(2654435761) + jnp.uint32(1)), dtype=jnp.uint32)

    return jax.tree.map(one, params)


def content_hash(params: dict, dtype: str | None = None) -> str:
    """A hash of every parameter's name, shape, dtype and values; with ``dtype``, of the parameters cast to it."""
    sums = jax.tree_util.tree_flatten_with_path(_leaf_sums(params, dtype))[0]
    shapes = jax.tree.leaves(jax.tree.map(lambda x: f"{x.shape}{dtype or x.dtype}", params))
    text = json.dumps([(jax.tree_util.keystr(path), shape, int(total)) for (path, total), shape in zip(sums, shapes)])
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def split_quantized(plain: dict, model_cfg: LlamaConfig) -> tuple[dict, dict]:
    """The base's float parameters -> (those kept as they are, the projection weights ``model.base_quant``
    quantizes as {module: {weight: array}}; none without it)."""
    if model_cfg.base_quant == "none":
        return plain, {}
    layers, weights = {name: dict(module) for name, module in plain["layers"].items()}, {}
    for module, weight, _ in LORA_TARGETS.values():
        weights.setdefault(module, {})[weight] = layers[module].pop(weight)
    return plain | {"layers": layers}, weights


def to_storage(kept: dict, weights: dict, base_quant: str) -> dict:
    """``split_quantized``'s parts -> the frozen part of the LoRA model's tree (the weights quantized layer by
    layer, as jaxtrain/models/quant.py stores them)."""
    layers = {name: dict(module) for name, module in kept["layers"].items()}
    for module, weight, inputs in LORA_TARGETS.values():
        if module in weights:
            codes, scale = jax.vmap(functools.partial(quantize, kind=base_quant, inputs=inputs))(weights[module][weight])
            layers[module][weight] = {"codes": codes, "scale": scale}
    return kept | {"layers": layers}


def merged(model_params: dict, model_cfg: LlamaConfig, dtype=None) -> dict:
    """Every parameter of a LoRA model -> the base model's float parameters with each adapter's update
    ``(alpha / rank) * A @ B`` added to its weight (and a quantized weight dequantized first); the weights these
    change in ``dtype`` (default ``model.param_dtype``)."""
    dtype, scale = jnp.dtype(dtype or model_cfg.param_dtype), model_cfg.lora.alpha / model_cfg.lora.rank if model_cfg.lora.rank else 0.0
    layers = {name: dict(module) for name, module in model_params["layers"].items()}
    updates = {}  # (module, weight) -> float32 update, stacked on the layers axis
    for name in model_cfg.expert_adapters():  # per expert a @ b[:, :, i] on the adapter's i-th weight
        adapter = layers["mlp"].pop(adapter_name(name))
        a, b = adapter["a"].astype(jnp.float32), adapter["b"].astype(jnp.float32)
        for i, weight in enumerate(EXPERT_LORA[name][1]):
            updates["mlp", weight] = jnp.einsum("leir,lero->leio", a, b[:, :, :, i])
    for target, (module, weight, _) in LORA_TARGETS.items():
        adapter = layers[module].pop(adapter_name(target), None)  # the experts' were taken above
        if adapter is not None:
            updates[module, weight] = jax.vmap(lambda a, b: jnp.tensordot(a, b, axes=1))(adapter["a"].astype(jnp.float32), adapter["b"].astype(jnp.float32))
    for module, weight, inputs in LORA_TARGETS.values():
        w = layers[module][weight]
        if isinstance(w, dict):
            w = jax.vmap(functools.partial(dequantize, dtype=dtype, inputs=inputs))(w["codes"], w["scale"])
        if (module, weight) in updates:
            w = (w.astype(jnp.float32) + scale * updates[module, weight]).astype(dtype)
        layers[module][weight] = w
    return model_params | {"layers": layers}


@dataclasses.dataclass(frozen=True)
class Base:
    """A loaded base: its frozen parameters in storage form, on the mesh, and the record that names it."""

    frozen: dict
    record: dict  # path (None: initialised from seed), seed, hash

    def start_state(self, layout: Layout) -> TrainState:
        """A fresh train state: new adapters (from train.seed) on this base; takes the frozen arrays over."""
        cfg = layout.cfg

        def start(frozen):
            adapters = split_frozen(nnx.to_pure_dict(nnx.state(Llama(cfg.model, rngs=nnx.Rngs(cfg.train.seed)))))[0]
            return fresh_state(layout.tx, layout.shardings, layout.spike_window)(join_frozen(frozen, adapters))

        return jax.jit(start, out_shardings=layout.shardings, donate_argnums=0)(self.frozen)


def load_base(layout: Layout, source: Path | None, expected: dict | None = None, where: str = "",
              fix: str = "give that base, or a new --run-dir") -> Base:
    """Load the base from ``source`` and hash it; with ``expected`` (a run's record), a base of other content
    is a UserError ending in ``fix``, what the command's user can do about it."""
    plain, read = load_plain(layout, source)
    record = {"path": None if read is None else str(read.absolute()),
              "seed": layout.cfg.train.seed if source is None else None, "hash": content_hash(plain)}
    if expected is not None and expected["hash"] != record["hash"]:
        named = expected["path"] or f"the initialisation from train.seed={expected['seed']}"
        raise UserError(f"the LoRA base {record['path'] or 'initialised from train.seed'} (content hash {record['hash']}) is not the base "
                        f"{where} was trained on ({named}, hash {expected['hash']}); {fix}")
    # only the kept part is donated: 4-bit codes cannot take over a float weight's buffer (jax warns of each one)
    frozen = jax.jit(functools.partial(to_storage, base_quant=layout.cfg.model.base_quant), out_shardings=layout.shardings.frozen,
                     donate_argnums=0)(*split_quantized(plain, layout.cfg.model))
    return Base(frozen, record)


def run_base(layout: Layout, run_dir: Path, init_from: Path | None) -> Base:
    """The base of a LoRA training run: ``--init-from`` if given, else the one its record names; checked
    against the record when the run has one. The record's checkpoint wins over ``--init-from`` naming its run: the
    same command resumes after that run trained on."""
    record = read_record(run_dir)
    recorded = None if record is None or record["path"] is None else Path(record["path"])
    if recorded is not None and (init_from is None or recorded.is_relative_to(init_from.absolute())):
        init_from = recorded
    if init_from is not None and not init_from.exists():
        raise UserError(f"the LoRA base {init_from} does not exist; give a Hugging Face model directory or a run directory")
    return load_base(layout, init_from, record, f"run {run_dir}")


def check_resume_dtype(run_dir: Path, model_cfg: LlamaConfig) -> None:
    """A LoRA run resumed with another ``model.param_dtype``: its base would load in another dtype, whose hash is not the
    record's (a message blaming the base, before 2026-12-05); records older than that have no dtype to compare."""
    record = read_record(run_dir)
    recorded = (record or {}).get("param_dtype", model_cfg.param_dtype)
    if recorded != model_cfg.param_dtype:
        raise UserError(f"model.param_dtype={model_cfg.param_dtype}, but run {run_dir} trained its adapters on the base in {recorded} "
                        f"({run_dir / BASE_RECORD}); give model.param_dtype={recorded} to resume it, or a new --run-dir")


def write_record(run_dir: Path, base: Base, model_cfg: LlamaConfig) -> None:
    lora = model_cfg.lora
    _write_record_file(run_dir, {**base.record, "rank": lora.rank, "alpha": lora.alpha, "targets": lora.target_names(),
                                 "base_quant": model_cfg.base_quant, "param_dtype": model_cfg.param_dtype})


def record_moved_base(run_dir: Path, base: Base) -> bool:
    """A finished run started again with its base at a new path (``--init-from NEW_PATH``, its hash checked): the record
    names that path from now on, for export-hf and generate, as a run that trains on rewrites it. Whether it changed."""
    record = read_record(run_dir)
    if record["path"] == base.record["path"]:
        return False
    _write_record_file(run_dir, record | {"path": base.record["path"]})
    return True


def _write_record_file(run_dir: Path, body: dict) -> None:
    with atomic_file(run_dir / BASE_RECORD, "LoRA base record") as f:
        f.write((json.dumps(body, indent=2) + "\n").encode())


def run_model_params(layout: Layout, run_dir: Path, step: int | None = None,
                     source: str = "jaxtrain export-hf") -> tuple[dict, Base, int]:
    """Every parameter of a LoRA run: its adapters restored from the newest readable checkpoint (or ``step``'s), on its
    base reloaded from the path its record names and checked against the recorded hash; and the step read."""
    record = summary(run_dir)
    # the base comes from the run's record, not from the command line: no flag can name another
    base_path = None if record["path"] is None else Path(record["path"])
    if base_path is not None and not base_path.exists():  # else taken for a run directory with no checkpoints
        raise UserError(f"the LoRA base {base_path}, which {run_dir / BASE_RECORD} records, does not exist; put it back there, or "
                        f"set \"path\" in {run_dir / BASE_RECORD} to where it is now (its content hash is checked)")
    where = run_dir if step is None else run_dir / checkpoint_lib.CHECKPOINTS_DIR / str(step)
    read, adapters = checkpoint_lib.restore_step_from(where, layout.abstract_state(), None, params_only=True, source=source)
    base = load_base(layout, base_path, record, f"run {run_dir}",
                     f"restore the base {run_dir / BASE_RECORD} records (the run's adapters are reloaded onto it)")
    return join_frozen(base.frozen, adapters), base, int(read.name)


def export(cfg: Config, run_dir: Path, out: Path, *, step: int | None, dtype: str, adapter_only: bool) -> None:
    """``jaxtrain export-hf`` of a LoRA run: its adapters as a PEFT adapter directory, or the merged model."""
    layout = make_layout(cfg, train_batch=False)
    if step is not None and not (run_dir / checkpoint_lib.CHECKPOINTS_DIR / str(step)).is_dir():
        raise UserError(f"--step {step}: {run_dir} has no checkpoint of that step; `jaxtrain checkpoints {run_dir}` lists them")
    source_dir = hf_export.run_source_dir(run_dir)
    # first: a tokenizer moved away is an error before minutes of restoring and merging
    tokenizer = None if adapter_only else hf_export.tokenizer_files(cfg, source_dir)
    model_params, base, read = run_model_params(layout, run_dir, step)
    if adapter_only:
        adapters = multihost_utils.process_allgather(split_frozen(model_params)[0], tiled=True)
        if jax.process_index() == 0:
            peft.write_adapter(adapters["layers"], cfg.model, out, base.record["path"], summary(run_dir, read), dtype)
        what = f"PEFT adapter ({dtype})"
    else:
        plain_cfg = dataclasses.replace(cfg, model=plain_config(cfg.model))
        # merged in the wider of the base's dtype and the export's: a bfloat16 base's weights rounded to bfloat16 with
        # their updates lost the updates' low bits before a float32 export (1% of the logits of a tiny Llama)
        plain = merge_on_devices(model_params, cfg.model, jax.tree.map(lambda a: a.sharding, plain_abstract(layout)),
                                 jnp.promote_types(cfg.model.param_dtype, dtype))
        hf_export.write_model(plain, plain_cfg, out, dtype, source_dir, tokenizer=tokenizer)
        what = f"merged model ({dtype})"
    if jax.process_index() == 0:
        print(f"jaxtrain: wrote {out}: {what}", file=sys.stderr, flush=True)


def merge_on_devices(model_params: dict, model_cfg: LlamaConfig, shardings: dict, dtype=None) -> dict:
    """``merged`` jitted, its output placed with ``shardings`` (the base model's)."""
    return jax.jit(lambda p: merged(p, model_cfg, dtype), out_shardings=shardings)(model_params)


def merged_run_params(layout: Layout, run_dir: Path, source: str) -> dict:
    """A LoRA run's adapters merged into its base, placed as the base model's parameters."""
    model_params, _, _ = run_model_params(layout, run_dir, None, source)
    return merge_on_devices(model_params, layout.cfg.model, jax.tree.map(lambda a: a.sharding, plain_abstract(layout)))


def with_adapter(loaded, adapter: Path):
    """``jaxtrain generate BASE --adapter PATH``: a loaded base model (generate.Loaded) with the adapters of a LoRA
    run directory or a PEFT adapter directory merged into its weights; an adapter trained on another base is a UserError."""
    peft.check_adapter_source(adapter)
    if peft.is_adapter_dir(adapter):
        config, tensors, record = peft.read_adapter(adapter)
        rank = int(config["r"])
        # rank-stabilised LoRA scales by lora_alpha / sqrt(r), ours by alpha / r: the same product with alpha x sqrt(r)
        alpha = float(config["lora_alpha"]) * (math.sqrt(rank) if config.get("use_rslora") else 1.0)
        lora = LoraConfig(rank=rank, alpha=alpha, targets=peft.targets_of(config, adapter, loaded.model_cfg))
        # our record says what base the adapters trained on; another tool's adapters apply to the float base, as PEFT does
        model_cfg = dataclasses.replace(loaded.model_cfg, lora=lora, base_quant=(record or {}).get("base_quant", "none"))
        adapters = {"layers": peft.from_peft(tensors, model_cfg, adapter)}
    else:  # a LoRA run directory
        record = summary(adapter)
        # restored onto the mesh and rules the base generates with, whatever the run trained on
        cfg = dataclasses.replace(config_lib.load_run_config(adapter), mesh=loaded.mesh_config, rules=loaded.rules_name)
        model_cfg = dataclasses.replace(loaded.model_cfg, lora=cfg.model.lora, base_quant=cfg.model.base_quant)
        layout = make_layout(cfg, train_batch=False)
        restored = checkpoint_lib.restore_from(adapter, layout.abstract_state(), None, params_only=True, source="--adapter")
        adapters = multihost_utils.process_allgather(restored, tiled=True)
    if record is not None:
        # the run hashed its base as it loaded it, in its model.param_dtype (bfloat16 in llama3_8b_lora), and generate
        # loads a Hugging Face model in float32: hashed as loaded, the very base was refused as another
        found = content_hash(loaded.params, record.get("param_dtype"))
        if found != record["hash"]:
            raise UserError(f"--adapter {adapter} was trained on base {record['path'] or 'initialised from a seed'} (content hash "
                            f"{record['hash']}), not on this base (hash {found}); give the base it was trained on")
    shardings = jax.tree.map(lambda a: a.sharding, loaded.params)
    base = loaded.params
    if model_cfg.base_quant != "none":  # the model the adapters trained with: on the base quantized, as the run stored it
        base = jax.jit(lambda p: to_storage(*split_quantized(p, model_cfg), model_cfg.base_quant))(base)
        if jax.process_index() == 0:
            print(f"jaxtrain: --adapter {adapter} trained on the base quantized to {model_cfg.base_quant}: applied to it quantized "
                  "the same way, as `generate RUN_DIR` and the merged export-hf do (PEFT applies it to the float base)",
                  file=sys.stderr, flush=True)
    return dataclasses.replace(loaded, params=merge_on_devices(join_frozen(base, adapters), model_cfg, shardings))
