"""The adapters of LoRA runs: the trained / frozen split of the parameters (every ``lora_*`` subtree trains, the
base stays), the record that names a run's base (RUN_DIR/lora_base.json), and the pool of adapters trained on
each base (``jaxtrain adapters DIR``).

The tree functions work on the nested parameter dicts (arrays, ShapeDtypeStructs or shardings alike) and are
shared by the train state, the step, checkpoints and export. No jax import.
"""

from __future__ import annotations

from pathlib import Path

from jaxtrain.errors import UserError
from jaxtrain.interop import peft
from jaxtrain.interop.hf_config import read_json
from jaxtrain.observe.records import CHECKPOINTS_DIR, committed_steps, read_records

ADAPTER_PREFIX = "lora_"  # jaxtrain/models/lora.py names each adapter lora_<target>
BASE_RECORD = "lora_base.json"


def is_adapter(key) -> bool:
    return isinstance(key, str) and key.startswith(ADAPTER_PREFIX)


def split_frozen(tree: dict) -> tuple[dict, dict | None]:
    """(trained, frozen): the adapters and the rest when the tree has adapters; else (tree, None)."""

    def walk(node: dict) -> tuple[dict, dict]:
        trained, frozen = {}, {}
        for key, value in node.items():
            if is_adapter(key):
                trained[key] = value
            elif isinstance(value, dict):
                inner_trained, inner_frozen = walk(value)
                if inner_trained:
                    trained[key] = inner_trained
                if inner_frozen:
                    frozen[key] = inner_frozen
            else:
                frozen[key] = value
        return trained, frozen

    trained, frozen = walk(tree)
    return (trained, frozen) if trained else (tree, None)


def join_frozen(frozen: dict | None, trained: dict) -> dict:
    """The inverse of ``split_frozen``."""
    if frozen is None:
        return trained
    out = dict(frozen)
    for key, value in trained.items():
        out[key] = join_frozen(out[key], value) if key in out else value
    return out


def read_record(run_dir: Path) -> dict | None:
    path = run_dir / BASE_RECORD
    if not path.is_file():
        return None
    # a user edits it where the base moved (lora.py says how): a typo there was a traceback from every command reading it
    fix = "fix it by hand: a JSON object naming the run's base (\"path\", \"hash\") and its adapters' shape"
    record = read_json(path, fix=fix)
    if not ("path" in record and isinstance(record["path"], str | None) and isinstance(record.get("hash"), str)):
        raise UserError(f"{path} must hold the base's \"path\" (a string, null for a base from train.seed) and its \"hash\" "
                        f"(a string); {fix}")
    return record


def summary(run_dir: Path, step: int | None = None) -> dict:
    """A LoRA run's base record with its adapter shape, and the progress its adapters hold: the step of its newest
    committed checkpoint (0 before the first), the last eval loss up to it; with ``step`` (the checkpoint an export
    read), that checkpoint's."""
    record = read_record(run_dir)
    if record is None:
        raise UserError(f"{run_dir} has no {BASE_RECORD}: it is not a LoRA run (model.lora.rank > 0); train one, or give its --run-dir")
    if step is None:
        step = max(committed_steps(run_dir / CHECKPOINTS_DIR), default=0)
    metrics = run_dir / "metrics.jsonl"
    records = read_records(metrics) if metrics.is_file() else []  # a live run's partial last line left out
    # the records past the step are of adapters no checkpoint holds (a run killed since, or one training on) or of later ones
    evals = [r["eval_loss"] for r in records if "eval_loss" in r and r["step"] <= step]
    return record | {"steps": step, "eval_loss": evals[-1] if evals else None}


def check_adapter(adapter: Path) -> None:
    """``generate --adapter PATH`` before any weight is read: a LoRA run (its base record) or a PEFT adapter that
    jaxtrain applies; such a mistake was one line only once the whole base model had been read."""
    peft.check_adapter_source(adapter)
    if peft.is_adapter_dir(adapter):
        peft.read_adapter_config(adapter)
    else:
        summary(adapter)


def pool(directory: Path) -> list[dict]:
    """One row per adapter in ``directory`` (itself, or its immediate subdirectories): LoRA run directories and
    PEFT adapter directories, with their base's hash and path, rank, targets, steps and last eval loss."""
    if not directory.is_dir():
        raise UserError(f"{directory} is not a directory; give a directory of LoRA runs or PEFT adapters")
    rows = []
    for path in [directory, *sorted(p for p in directory.iterdir() if p.is_dir())]:
        if (path / BASE_RECORD).is_file():
            rows.append({"adapter": str(path), "kind": "run"} | summary(path))
        elif peft.is_adapter_dir(path):
            record, config = peft.read_jaxtrain_record(path), peft.read_config(path)
            unsupported = {"unsupported": peft.not_applied(config)}  # what generate --adapter refuses
            if record is not None:
                rows.append({"adapter": str(path), "kind": "peft"} | record | unsupported)
            else:  # exported elsewhere: PEFT's own fields only
                modules = config.get("target_modules") or []
                # a regular expression as it is; names ("all-linear" saves every module's full name) by their last part
                modules = [modules] if isinstance(modules, str) else sorted({m.rsplit(".", 1)[-1] for m in modules})
                rows.append({"adapter": str(path), "kind": "peft", "hash": None, "path": config.get("base_model_name_or_path"),
                             "rank": config.get("r"), "steps": None, "targets": modules + (config.get("target_parameters") or []),
                             "eval_loss": None} | unsupported)
    return sorted(rows, key=lambda r: (r["hash"] or "", r["adapter"]))


def format_pool(rows: list[dict]) -> str:
    """The pool grouped by base."""
    lines, base = [], object()
    for r in rows:
        if (r["hash"], r["path"]) != base:
            base = (r["hash"], r["path"])
            where = r["path"] or f"(initialised from train.seed={r.get('seed')})"
            lines.append(f"base {r['hash'] or '(hash unknown)'}  {where}")
        loss = "-" if r["eval_loss"] is None else f"{r['eval_loss']:.4f}"
        targets = ",".join(r["targets"]) if isinstance(r["targets"], list) else str(r["targets"])
        lines.append(f"  {r['adapter']}  {r['kind']}  rank {r['rank']}  targets {targets}  steps {r['steps'] if r['steps'] is not None else '-'}  "
                     f"eval loss {loss}" + (f"  (not applied by jaxtrain: {', '.join(r['unsupported'])})" if r.get("unsupported") else ""))
    return "\n".join(lines) if lines else "no adapters found"
