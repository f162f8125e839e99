"""``jaxtrain train EXPERIMENT --init-from HF_DIR``: a Hugging Face model's weights straight onto the mesh.

Every parameter is made with ``jax.make_array_from_callback`` on its sharding: each process reads, from
the memory-mapped safetensors files, only the slices of each tensor its own devices hold (a block shared
by several local devices is read once), converted to ``model.param_dtype``. No host holds the whole model.
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import jax

from jaxtrain import atomic
from jaxtrain.interop.hf_config import CONFIG_FILE, GENERATION_CONFIG_FILE, RUN_SUBDIR
from jaxtrain.interop.hf_weights import Checkpoint, tensor_maps
from jaxtrain.models.config import LlamaConfig

# Files of the source model a run keeps (in RUN_DIR/hf/, RUN_SUBDIR) for export-hf: its config (token ids, context
# length, ...) and its tokenizer.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                   "vocab.json", "merges.txt", "added_tokens.json", "chat_template.jinja")
KEPT_FILES = (CONFIG_FILE, GENERATION_CONFIG_FILE, *TOKENIZER_FILES)


def load_params(hf_dir: Path, model_cfg: LlamaConfig, abstract_params: dict) -> dict:
    """The parameters of ``model_cfg`` (a tree like ``abstract_params``, whose leaves carry the target
    shardings) from the Hugging Face model in ``hf_dir``."""
    maps = {tm.path: tm for tm in tensor_maps(model_cfg)}
    with Checkpoint(hf_dir) as checkpoint:
        checkpoint.check(list(maps.values()))

        def load(path, target):
            tm, blocks = maps[tuple(k.key for k in path)], {}

            def block(index):
                key = tuple(s.indices(n)[:2] for s, n in zip(index, target.shape))
                if key not in blocks:  # devices holding the same block (replicas) share one read
                    blocks[key] = tm.read_block(checkpoint, index, target.shape, target.dtype)
                return blocks[key]

            return jax.make_array_from_callback(target.shape, target.sharding, block)

        params = jax.tree_util.tree_map_with_path(load, abstract_params)
        total = checkpoint.model_bytes(list(maps.values()))
        print(f"jaxtrain: process {jax.process_index()} read {checkpoint.bytes_read} of the {total} bytes of weights in {hf_dir} "
              f"({checkpoint.bytes_read / max(total, 1):.0%}: the slices its devices hold)", file=sys.stderr, flush=True)
    return params


def keep_source_files(hf_dir: Path, run_dir: Path) -> None:
    """Copy the source model's config and tokenizer files into RUN_DIR/hf/ (written whole, then renamed)."""
    target, partial = run_dir / RUN_SUBDIR, run_dir / f"{RUN_SUBDIR}.partial"
    atomic.fresh_dir(partial, f"--run-dir {run_dir}")
    with atomic.failed_writes_reported(target, "the source model's files", f"{partial} is removed"):
        try:
            for name in KEPT_FILES:
                if (hf_dir / name).is_file():
                    shutil.copy2(hf_dir / name, partial / name)
            shutil.rmtree(target, ignore_errors=True)
            atomic.publish(partial, target)
        except BaseException:
            shutil.rmtree(partial, ignore_errors=True)
            raise
