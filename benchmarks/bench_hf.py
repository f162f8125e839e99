"""Hugging Face import and export of a random ~1 GB model (float32, 8 simulated CPU devices, rules fsdp_tp),
beside the safetensors library's own whole-tensor read and whole-file save of the same tensors, interleaved
in one run (best of REPEATS each):

- ``hf_export_s`` / ``hf_export_rss_growth_mb``: ``write_model`` of the sharded parameters (already on the
  devices, as after the checkpoint restore of ``jaxtrain export-hf``) as safetensors shards; its peak host
  RSS above what it started with. Goal: at most 3 x ``hf_largest_tensor_mb``.
- ``safetensors_save_s`` / ``safetensors_save_rss_growth_mb``: the library's ``save_file`` of the same
  tensors, which needs them all gathered in host memory first (gathering included).
- ``hf_import_s`` / ``hf_import_rss_growth_mb``: ``load_params`` of that directory onto the mesh; the growth
  includes the imported parameters themselves (on CPU the devices' memory is host memory) and the
  memory-mapped file pages.
- ``safetensors_read_s``: the library reading every tensor whole into host memory.

Peak RSS: Linux's VmHWM, reset before each measurement (/proc/self/clear_refs). Writes under runs/ and
deletes what it wrote.

Standalone, for an experiment's shape on this machine's devices (one JSON line; ``benchmarks/gpu_h200.sh``):

    python benchmarks/bench_hf.py llama3_1b --mesh gpu1 [key=value ...]
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

import jax
import numpy as np
from flax import nnx
from safetensors import safe_open
from safetensors.numpy import save_file

from jaxtrain.config import AxisSizes, Config, MeshConfig
from jaxtrain.errors import OneLineParser, UserError, positive_int
from jaxtrain.interop import hf_export, hf_import
from jaxtrain.interop.hf_weights import tensor_maps
from jaxtrain.layout import make_layout
from jaxtrain.models.config import LlamaConfig
from jaxtrain.models.llama import Llama

REPO = Path(__file__).resolve().parent.parent
MB = 1e6
REPEATS = 2
# 250M parameters, 1.0 GB in float32; the largest tensors are the embedding and the output head (197 MB each)
MODEL = LlamaConfig(vocab_size=32000, d_model=1536, num_layers=6, num_heads=12, num_kv_heads=4, mlp_dim=4096, dtype="float32")


def _peak_growth(fn):
    """(seconds, peak RSS growth in bytes, result) of fn()."""
    Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current RSS
    before = _status_kb("VmRSS")
    start = time.perf_counter()
    result = jax.block_until_ready(fn())
    seconds = time.perf_counter() - start
    return seconds, (_status_kb("VmHWM") - before) * 1024, result


def _status_kb(field: str) -> int:
    line = next(line for line in Path("/proc/self/status").read_text().splitlines() if line.startswith(field))
    return int(line.split()[1])


def _read_whole(directory: Path) -> int:
    total = 0
    for path in sorted(directory.glob("*.safetensors")):
        with safe_open(path, framework="np") as f:
            for name in f.keys():
                total += f.get_tensor(name).nbytes
    return total


def _save_whole(params: dict, model: LlamaConfig, directory: Path) -> None:
    tensors = {}
    for t in hf_export.tensors_in_order(tensor_maps(model), model.num_layers):
        param = params
        for key in t.tm.path:
            param = param[key]
        layer = np.asarray(param[t.index] if t.index else param)  # t.index: its layer (and expert) when stacked
        tensors[t.name] = np.ascontiguousarray(t.tm.to_hf(layer))
    save_file(tensors, directory / "model.safetensors", metadata={"format": "pt"})


def run() -> dict:
    return measure(dataclasses.replace(Config(model=MODEL, mesh=MeshConfig(ici=AxisSizes(2, 2, 2))), rules="fsdp_tp"), REPEATS)


def measure(cfg: Config, repeats: int) -> dict:
    """Export, whole save, import, whole read of a random model of ``cfg.model``'s shape on ``cfg``'s mesh."""
    (REPO / "runs").mkdir(exist_ok=True)
    directory = Path(tempfile.mkdtemp(prefix="bench_hf_", dir=REPO / "runs"))
    model = cfg.model
    try:
        layout = make_layout(cfg)
        abstract = layout.abstract_state().params
        params = jax.block_until_ready(jax.jit(lambda: nnx.to_pure_dict(nnx.state(Llama(model, rngs=nnx.Rngs(0)))),
                                               out_shardings=layout.shardings.params)())  # its temporaries gone before measuring
        size = sum(x.nbytes for x in jax.tree.leaves(params))
        largest = max(int(np.prod(tm.hf_shape)) * 4 for tm in tensor_maps(model))
        times = {k: [] for k in ("export", "save", "import", "read")}
        growth = {k: 0 for k in times}

        def timed(key, fn):
            seconds, grown, result = _peak_growth(fn)
            times[key].append(seconds)
            growth[key] = max(growth[key], grown)
            return result

        for i in range(repeats):
            out, whole = directory / f"export{i}", directory / f"whole{i}"
            whole.mkdir()
            timed("export", lambda: hf_export.write_model(params, cfg, out, "float32"))
            timed("save", lambda: _save_whole(params, model, whole))
            imported = timed("import", lambda: hf_import.load_params(out, model, abstract))
            assert all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(imported), jax.tree.leaves(params)))
            del imported
            timed("read", lambda: _read_whole(whole))
            shutil.rmtree(out)
            shutil.rmtree(whole)
        return {
            "hf_model_mb": size / MB,
            "hf_largest_tensor_mb": largest / MB,
            "hf_export_s": min(times["export"]),
            "hf_export_rss_growth_mb": growth["export"] / MB,
            "hf_export_rss_growth_over_largest_tensor": growth["export"] / largest,
            "safetensors_save_s": min(times["save"]),
            "safetensors_save_rss_growth_mb": growth["save"] / MB,
            "hf_import_s": min(times["import"]),
            "hf_import_rss_growth_mb": growth["import"] / MB,
            "safetensors_read_s": min(times["read"]),
            "hf_export_over_safetensors_save": min(times["export"]) / min(times["save"]),
            "hf_import_over_safetensors_read": min(times["import"]) / min(times["read"]),
        }
    finally:
        shutil.rmtree(directory, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    parser = OneLineParser(description="Hugging Face import / export of an experiment's shape (random weights)")
    parser.add_argument("experiment")
    parser.add_argument("overrides", nargs="*", metavar="key=value")
    parser.add_argument("--mesh")
    parser.add_argument("--rules")
    parser.add_argument("--repeats", type=positive_int, default=1)
    args = parser.parse_intermixed_args(argv)
    from jaxtrain.cli import resolve_config

    try:
        cfg = resolve_config(args.experiment, args.mesh, args.rules, [*args.overrides, "train.microbatches=1"])  # no step is run
    except UserError as e:
        print(f"bench_hf: error: {e}", file=sys.stderr)
        return 2
    print(json.dumps({"benchmark": "hf", "experiment": args.experiment, "device_kind": jax.devices()[0].device_kind,
                      **measure(cfg, args.repeats)}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
