"""Byte-level token data with grain: corpus -> deterministic train/validation split -> fixed-length
windows -> shuffled, per-process batches -> global jax.Arrays.

The default corpus is the running Python's standard library source, which every machine has.
"""

from __future__ import annotations

import dataclasses
import sysconfig
import zlib
from pathlib import Path
from typing import Iterator

import grain
import jax
import numpy as np
from jax.sharding import NamedSharding

from jaxtrain.config import DataConfig
from jaxtrain.errors import UserError

DOC_SEPARATOR = 0  # NUL never occurs in text files, so it marks document boundaries
BYTE_VOCAB = 256
TOKEN_FILE_SUFFIXES = (".npy", ".bin")  # .bin: raw little-endian uint16
SKIPPED_STDLIB_DIRS = {"site-packages", "dist-packages", "test", "tests", "idle_test"}


def stdlib_files() -> tuple[Path, list[Path]]:
    root = Path(sysconfig.get_paths()["stdlib"])
    files = [p for p in root.rglob("*.py") if not SKIPPED_STDLIB_DIRS & set(p.relative_to(root).parts[:-1])]
    return root, sorted(files)


def text_files(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*") if p.is_file() and not any(part.startswith(".") for part in p.relative_to(root).parts))


def is_validation_file(relative: str, val_fraction: float) -> bool:
    """Deterministic file-level split: a file's own path decides, so adding files moves no others."""
    return zlib.crc32(relative.encode()) % 10_000 < val_fraction * 10_000


def _join(files: list[Path]) -> np.ndarray:
    parts = []
    for f in files:
        parts.append(np.frombuffer(f.read_bytes(), np.uint8))
        parts.append(np.array([DOC_SEPARATOR], np.uint8))
    return np.concatenate(parts) if parts else np.zeros((0,), np.uint8)


@dataclasses.dataclass(frozen=True)
class Corpus:
    train: np.ndarray
    validation: np.ndarray
    vocab_size: int  # the tokens are all < vocab_size
    description: str


def load_corpus(cfg: DataConfig) -> Corpus:
    if cfg.path is None:
        root, files = stdlib_files()
        what = f"Python standard library at {root}"
    else:
        root = Path(cfg.path)
        if not root.exists():
            raise UserError(f"data.path={cfg.path} does not exist; give a directory of text files or a token file ({', '.join(TOKEN_FILE_SUFFIXES)})")
        if root.is_file():
            return _load_token_file(root, cfg.val_fraction)
        files = text_files(root)
        what = f"text files under {root}"
    val = [f for f in files if is_validation_file(f.relative_to(root).as_posix(), cfg.val_fraction)]
    train = [f for f in files if not is_validation_file(f.relative_to(root).as_posix(), cfg.val_fraction)]
    if not train or not val:
        raise UserError(f"data: {what} has {len(files)} files, too few for a train/validation split at data.val_fraction={cfg.val_fraction}")
    return Corpus(_join(train), _join(val), BYTE_VOCAB, f"{what}: {len(train)} train / {len(val)} validation files")


def _load_token_file(path: Path, val_fraction: float) -> Corpus:
    if path.suffix == ".npy":
        tokens = np.load(path, mmap_mode="r")
    elif path.suffix == ".bin":
        tokens = np.memmap(path, dtype="<u2", mode="r")
    else:
        raise UserError(f"data.path={path}: unknown token file type; use .npy (any integer dtype) or .bin (uint16)")
    if tokens.ndim != 1 or not np.issubdtype(tokens.dtype, np.integer):
        raise UserError(f"data.path={path}: expected a 1-D integer token array, got shape {tokens.shape} dtype {tokens.dtype}")
    split = int(len(tokens) * (1 - val_fraction))
    return Corpus(tokens[:split], tokens[split:], int(tokens.max()) + 1, f"token file {path}: {len(tokens)} tokens")


class Windows:
    """Random-access source of non-overlapping (seq_len + 1)-token windows: inputs and shifted targets."""

    def __init__(self, tokens: np.ndarray, seq_len: int):
        self.tokens, self.seq_len = tokens, seq_len

    def __len__(self) -> int:
        return max(0, (len(self.tokens) - 1) // self.seq_len)

    def __getitem__(self, index: int) -> np.ndarray:
        start = index * self.seq_len
        return np.asarray(self.tokens[start:start + self.seq_len + 1], dtype=np.int32)


def _process_rows(sharding: NamedSharding, global_shape: tuple[int, int]) -> tuple[int, int]:
    """The contiguous block of batch rows this process's devices hold: (block index, block count)."""
    slices = [idx[0] for idx in sharding.addressable_devices_indices_map(global_shape).values()]
    start = min(s.start or 0 for s in slices)
    stop = max(global_shape[0] if s.stop is None else s.stop for s in slices)
    return start // (stop - start), global_shape[0] // (stop - start)


def _to_example(window: np.ndarray) -> dict[str, np.ndarray]:
    return {"inputs": window[..., :-1], "targets": window[..., 1:]}


class GlobalBatches:
    """Iterator of global batches. Each process reads only the rows its devices hold; the grain
    iterator's state (``get_state``/``set_state``) is the pipeline's position for checkpoints."""

    def __init__(self, tokens: np.ndarray, seq_len: int, global_batch: int, sharding: NamedSharding,
                 *, shuffle_seed: int | None, repeat: bool):
        self.global_shape = (global_batch, seq_len)
        self.sharding = sharding
        block, blocks = _process_rows(sharding, self.global_shape)
        ds = grain.MapDataset.source(Windows(tokens, seq_len))
        if shuffle_seed is not None:
            ds = ds.shuffle(seed=shuffle_seed)
        if repeat:
            ds = ds.repeat()
        ds = ds.batch(global_batch // blocks, drop_remainder=True)[block::blocks].map(_to_example)
        self.iterator = ds.to_iter_dataset(grain.ReadOptions(num_threads=1, prefetch_buffer_size=2)).__iter__()

    def __iter__(self) -> Iterator[dict[str, jax.Array]]:
        return self

    def __next__(self) -> dict[str, jax.Array]:
        local = next(self.iterator)
        return {k: jax.make_array_from_process_local_data(self.sharding, v, self.global_shape) for k, v in local.items()}


def train_batches(corpus: Corpus, cfg: DataConfig, global_batch: int, sharding: NamedSharding) -> GlobalBatches:
    return GlobalBatches(corpus.train, cfg.seq_len, global_batch, sharding, shuffle_seed=cfg.seed, repeat=True)


def eval_batches(corpus: Corpus, cfg: DataConfig, global_batch: int, sharding: NamedSharding, count: int) -> list[dict[str, jax.Array]]:
    """The first ``count`` batches of the validation split, in file order: the same every evaluation."""
    batches = GlobalBatches(corpus.validation, cfg.seq_len, global_batch, sharding, shuffle_seed=None, repeat=False)
    return [b for _, b in zip(range(count), batches)]


def check_sizes(corpus: Corpus, cfg: DataConfig, global_batch: int, vocab_size: int) -> None:
    if corpus.vocab_size > vocab_size:
        raise UserError(f"data has token ids up to {corpus.vocab_size - 1} but model.vocab_size={vocab_size}; set model.vocab_size>={corpus.vocab_size}")
    for split, tokens in (("train", corpus.train), ("validation", corpus.validation)):
        n = len(Windows(tokens, cfg.seq_len))
        if n < global_batch:
            raise UserError(
                f"the {split} split has {n} sequences of data.seq_len={cfg.seq_len}, fewer than one batch "
                f"(train.global_batch={global_batch}); use more data, a shorter seq_len or a smaller batch")
