"""``jaxtrain export-hf RUN_DIR --out DIR``: a run's checkpoint as a Hugging Face model directory that
``transformers.AutoModelForCausalLM.from_pretrained(DIR)`` loads unchanged.

Streamed: the parameters are restored sharded onto the mesh, then one Hugging Face tensor at a time (one
layer of a stacked parameter) is sliced and cast on the devices, gathered to the host, and appended by
process 0 to its safetensors shard in Hugging Face's layout (transposed a chunk at a time), so host memory
stays near the largest tensor whatever the model's size (measured: benchmarks/bench_hf.py). Shards hold at
most 5 GB; everything is written to a temporary directory renamed when complete.

The safetensors writer is written here: the safetensors library serializes a whole shard from memory at
once, and a shard (up to 5 GB) is far larger than one tensor. The format is an 8-byte little-endian header
length, a JSON header of dtype, shape and byte offsets per tensor, then the tensors' bytes.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import shutil
import struct
import sys
from pathlib import Path

import jax
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding, PartitionSpec

from jaxtrain import atomic, checkpoint as checkpoint_lib
from jaxtrain.config import Config
from jaxtrain.errors import UserError
from jaxtrain.interop import hf_config
from jaxtrain.data import token_file
from jaxtrain.data.documents import is_byte_level
from jaxtrain.data.tokenizer import TOKENIZER_FILE, RawBytes, hf_tokenizer_files, special_token_ids
from jaxtrain.interop.hf_import import KEPT_FILES, RUN_SUBDIR
from jaxtrain.interop.hf_weights import DTYPES, INDEX_FILE, SINGLE_FILE, TensorMap, tensor_maps
from jaxtrain.layout import make_layout

MAX_SHARD_BYTES = 5 * 10**9  # transformers 4's default max_shard_size, "5GB" (5's is "50GB")
WRITE_CHUNK_BYTES = 16 << 20
SAFETENSORS_DTYPE = {np.dtype(v).name: k for k, v in DTYPES.items()}  # 'bfloat16' -> 'BF16'


@dataclasses.dataclass(frozen=True)
class Tensor:
    """One Hugging Face tensor: a TensorMap and, for a stacked parameter, its layer (and expert)."""

    tm: TensorMap
    index: tuple[int, ...] = ()

    @property
    def name(self) -> str:
        return self.tm.tensor_name(self.index)

    def nbytes(self, dtype: np.dtype) -> int:
        return int(np.prod(self.tm.hf_shape)) * dtype.itemsize


def tensors_in_order(maps: list[TensorMap], num_layers: int) -> list[Tensor]:
    """transformers' order: the embedding, each layer's tensors, then the final norm and the output head."""
    stacked = [tm for tm in maps if tm.layers]
    embed = [Tensor(tm) for tm in maps if tm.path == ("embed",)]
    rest = [Tensor(tm) for tm in maps if not tm.layers and tm.path != ("embed",)]
    return embed + [Tensor(tm, (i, *experts)) for i in range(num_layers) for tm in stacked
                    for experts in itertools.product(*map(range, tm.stacked[1:]))] + rest


def plan_shards(tensors: list[Tensor], dtype: np.dtype, max_bytes: int) -> list[list[Tensor]]:
    """Consecutive tensors in shards of at most ``max_bytes`` (a larger tensor gets a shard of its own)."""
    shards, size = [[]], 0
    for t in tensors:
        if shards[-1] and size + t.nbytes(dtype) > max_bytes:
            shards.append([])
            size = 0
        shards[-1].append(t)
        size += t.nbytes(dtype)
    return shards


def shard_names(count: int) -> list[str]:
    return [SINGLE_FILE] if count == 1 else [f"model-{i:05d}-of-{count:05d}.safetensors" for i in range(1, count + 1)]


class ShardWriter:
    """One safetensors file written tensor by tensor: the header (known in advance) first, then each
    tensor's bytes as it arrives, in header order."""

    def __init__(self, path: Path, tensors: list[Tensor], dtype: np.dtype):
        header, offset = {}, 0
        for t in tensors:
            header[t.name] = {"dtype": SAFETENSORS_DTYPE[dtype.name], "shape": list(t.tm.hf_shape),
                              "data_offsets": [offset, offset + t.nbytes(dtype)]}
            offset += t.nbytes(dtype)
        header["__metadata__"] = {"format": "pt"}  # transformers refuses files without it
        blob = json.dumps(header, separators=(",", ":")).encode()
        blob += b" " * (-len(blob) % 8)  # tensor data 8-byte aligned, as the safetensors library writes it
        self.file = open(path, "wb")
        self.file.write(struct.pack("<Q", len(blob)) + blob)

    def write(self, array: np.ndarray) -> None:
        """Append ``array``'s elements in row-major order, a few rows at a time (a strided view, e.g. a
        transposed one, is copied only chunk by chunk)."""
        rows = max(1, WRITE_CHUNK_BYTES // max(array[:1].nbytes, 1))
        for start in range(0, len(array), rows):
            self.file.write(np.ascontiguousarray(array[start:start + rows]).reshape(-1).view(np.uint8))

    def close(self) -> None:
        self.file.close()


class Gatherer:
    """One Hugging Face tensor, in our layout, from the sharded parameters: the layer sliced and cast on the
    devices, keeping the parameter's own split (any other would make XLA replicate the tensor on every
    device first), then gathered to the host."""

    def __init__(self, params: dict, dtype: np.dtype):
        self.params, self.dtype, self.compiled = params, dtype, {}

    def __call__(self, t: Tensor) -> np.ndarray:
        param = self.params
        for key in t.tm.path:
            param = param[key]
        tm, dtype = t.tm, self.dtype
        if tm.layers or param.dtype != dtype:
            if tm.path not in self.compiled:
                lead = len(tm.stacked)
                sharding = NamedSharding(param.sharding.mesh, PartitionSpec(*param.sharding.spec[lead:])) if lead else param.sharding
                self.compiled[tm.path] = jax.jit(lambda p, i: p[tuple(i)].astype(dtype), out_shardings=sharding)
            param = self.compiled[tm.path](param, np.asarray(t.index, np.int32))
        if jax.process_count() > 1:
            return multihost_utils.process_allgather(param, tiled=True)
        return _to_host(param)


def _to_host(array: jax.Array) -> np.ndarray:
    """A fresh host copy, shard by shard. (``np.asarray`` first copies every shard to the host, then keeps
    the assembled copy on the array: on a parameter, for as long as the parameters live.)"""
    out = np.empty(array.shape, array.dtype)
    done = set()
    for shard in array.addressable_shards:
        where = tuple((s.start, s.stop) for s in shard.index)
        if where not in done:  # replicas: copied once
            out[shard.index] = np.asarray(shard.data)
            done.add(where)
    return out


def write_model(params: dict, cfg: Config, out: Path, dtype: str, source_dir: Path | None = None,
                max_shard_bytes: int = MAX_SHARD_BYTES, tokenizer: dict[str, bytes] | None = None) -> list[str]:
    """Write ``params`` (sharded, on the mesh) as a Hugging Face model directory ``out``; every process
    calls this, process 0 writes. ``source_dir`` holds the imported model's config and tokenizer files;
    ``tokenizer``: the tokenizer files already read (``tokenizer_files``), else read here.
    Returns the shard file names."""
    if tokenizer is None:
        tokenizer = tokenizer_files(cfg, source_dir)
    dtype = np.dtype(dtype)
    model = cfg.model
    tensors = tensors_in_order(tensor_maps(model), model.num_layers)
    shards = plan_shards(tensors, dtype, max_shard_bytes)
    names = shard_names(len(shards))
    is_main = jax.process_index() == 0
    partial = out.with_name(f"{out.name}.partial")
    if is_main:
        atomic.fresh_dir(partial, f"--out {out}")
    gather = Gatherer(params, dtype)
    # a full disk is one line, OUT.partial removed
    with atomic.failed_writes_reported(out, "model directory", f"{partial} is removed"):
        try:
            for name, shard in zip(names, shards):
                writer = ShardWriter(partial / name, shard, dtype) if is_main else None
                for t in shard:
                    layer = gather(t)  # every process takes part in the gather
                    if writer:
                        writer.write(t.tm.hf_order(layer))
                    del layer
                if writer:
                    writer.close()
            if is_main:
                _write_metadata(partial, cfg, dtype.name, shards, names, source_dir, tokenizer)
                atomic.publish(partial, out)
        except BaseException:
            if is_main:
                shutil.rmtree(partial, ignore_errors=True)
            raise
    if jax.process_count() > 1:
        multihost_utils.sync_global_devices("jaxtrain export-hf written")
    return names


def _write_metadata(directory: Path, cfg: Config, dtype: str, shards: list[list[Tensor]], names: list[str],
                    source_dir: Path | None, tokenizer: dict[str, bytes]) -> None:
    """config.json, generation_config.json, the shard index (several shards) and the source's tokenizer files."""
    config = hf_config.export_config(cfg.model, dtype, cfg.data.seq_len, _source_json(source_dir, hf_config.CONFIG_FILE))
    if not {"bos_token_id", "eos_token_id"} <= config.keys():  # an imported model's own ids stand
        config = token_ids(cfg, tokenizer) | config
    generation = hf_config.generation_config(config, _source_json(source_dir, hf_config.GENERATION_CONFIG_FILE))
    (directory / hf_config.CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")
    (directory / hf_config.GENERATION_CONFIG_FILE).write_text(json.dumps(generation, indent=2) + "\n")
    if len(shards) > 1:
        index = {"metadata": {"total_size": sum(t.nbytes(np.dtype(dtype)) for shard in shards for t in shard)},
                 "weight_map": {t.name: name for name, shard in zip(names, shards) for t in shard}}
        (directory / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
    for name, content in tokenizer.items():
        (directory / name).write_bytes(content)


def token_ids(cfg: Config, tokenizer: dict[str, bytes]) -> dict[str, int | None]:
    """bos_token_id / eos_token_id for config.json: those the carried tokenizer files name; for a byte-level run
    the NUL after each document; else None, unknown (transformers would assume Llama 2's 1 and 2)."""
    if TOKENIZER_FILE in tokenizer:
        return special_token_ids(tokenizer)
    separator = RawBytes().end_of_text if is_byte_level(cfg.data.tokenizer, cfg.data.path) else None
    return {"bos_token_id": separator, "eos_token_id": separator}


def _source_json(source_dir: Path | None, name: str) -> dict | None:
    return hf_config.read_json(source_dir / name) if source_dir and (source_dir / name).is_file() else None


def tokenizer_files(cfg: Config, source_dir: Path | None) -> dict[str, bytes]:
    """File name -> contents of the tokenizer files a run carries: those of its ``data.tokenizer``, else those
    of the model it was imported from, else those of the tokenizer its token file was made with."""
    if cfg.data.tokenizer:
        if not Path(cfg.data.tokenizer).exists():
            raise UserError(f"the run's data.tokenizer {cfg.data.tokenizer} is gone, and the export carries it beside the weights; "
                            "put it back, or set data.tokenizer in the run's config.yaml to where it is now")
        return hf_tokenizer_files(cfg.data.tokenizer)
    if source_dir is None:
        made_with = token_file.tokenizer_of(cfg.data.path)
        return {} if made_with is None else hf_tokenizer_files(made_with)
    return {n: (source_dir / n).read_bytes() for n in KEPT_FILES
            if n not in (hf_config.CONFIG_FILE, hf_config.GENERATION_CONFIG_FILE) and (source_dir / n).is_file()}


def run_source_dir(run_dir: Path) -> Path | None:
    """Where a run initialised from a Hugging Face model keeps that model's config and tokenizer; None: it was not."""
    source_dir = run_dir / RUN_SUBDIR
    return source_dir if source_dir.is_dir() else None


def export(cfg: Config, run_dir: Path, out: Path, *, step: int | None, dtype: str) -> None:
    """``jaxtrain export-hf``: restore the parameters of ``step`` (default the newest readable checkpoint) onto the run's
    mesh and write them."""
    layout = make_layout(cfg, train_batch=False)
    where = run_dir if step is None else run_dir / checkpoint_lib.CHECKPOINTS_DIR / str(step)
    if step is not None and not where.is_dir():
        raise UserError(f"--step {step}: {run_dir} has no checkpoint of that step; `jaxtrain checkpoints {run_dir}` lists them")
    source_dir = run_source_dir(run_dir)
    tokenizer = tokenizer_files(cfg, source_dir)  # first: a tokenizer moved away is an error before minutes of restoring
    params = checkpoint_lib.restore_from(where, layout.abstract_state(), None, params_only=True, source="jaxtrain export-hf")
    names = write_model(params, cfg, out, dtype, source_dir, tokenizer=tokenizer)
    if jax.process_index() == 0:
        print(f"jaxtrain: wrote {out} ({len(names)} safetensors file(s), {dtype})", file=sys.stderr, flush=True)
