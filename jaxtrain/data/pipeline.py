"""The grain pipeline: a corpus's token stream -> fixed-length windows -> shuffled, per-process batches
-> global jax.Arrays."""

from __future__ import annotations

from typing import Iterator

import grain
import jax
import numpy as np
from jax.sharding import NamedSharding

from jaxtrain.config import DataConfig
from jaxtrain.data.corpus import Corpus
from jaxtrain.errors import UserError


class Windows:
    """Random-access source of non-overlapping (seq_len + 1)-token windows: inputs and shifted targets."""

    def __init__(self, tokens: np.ndarray, seq_len: int):
        self.tokens, self.seq_len = tokens, seq_len

    def __len__(self) -> int:
        return max(0, (len(self.tokens) - 1) // self.seq_len)

    def __getitem__(self, index: int) -> np.ndarray:
        start = index * self.seq_len
        return np.asarray(self.tokens[start:start + self.seq_len + 1], dtype=np.int32)


def process_rows(sharding: NamedSharding, global_shape: tuple[int, int]) -> tuple[int, int]:
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
        block, blocks = process_rows(sharding, self.global_shape)
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


def batch_fields(cfg: DataConfig) -> dict[str, type]:
    """What a batch holds, name -> dtype, each (global_batch, seq_len)."""
    if cfg.format == "sft":
        from jaxtrain.data import sft

        return sft.BATCH_FIELDS
    return {"inputs": np.int32, "targets": np.int32}


def train_batches(corpus: Corpus, cfg: DataConfig, global_batch: int, sharding: NamedSharding) -> GlobalBatches:
    if cfg.format == "sft":
        from jaxtrain.data import sft

        return sft.train_batches(corpus, cfg, global_batch, sharding)
    return GlobalBatches(corpus.train, cfg.seq_len, global_batch, sharding, shuffle_seed=cfg.seed, repeat=True)


def eval_batches(corpus: Corpus, cfg: DataConfig, global_batch: int, sharding: NamedSharding, count: int) -> list[dict[str, jax.Array]]:
    """The first ``count`` batches of the validation split, in file order: the same every evaluation."""
    if cfg.format == "sft":
        from jaxtrain.data import sft

        return sft.eval_batches(corpus, cfg, global_batch, sharding, count)
    batches = GlobalBatches(corpus.validation, cfg.seq_len, global_batch, sharding, shuffle_seed=None, repeat=False)
    return [b for _, b in zip(range(count), batches)]


def check_sizes(corpus: Corpus, cfg: DataConfig, global_batch: int, vocab_size: int) -> None:
    if corpus.vocab_size > vocab_size:
        raise UserError(f"the data ({corpus.description}) has a vocabulary of {corpus.vocab_size} (its tokenizer's, or its largest "
                        f"token id + 1) but model.vocab_size={vocab_size}; set model.vocab_size>={corpus.vocab_size}")
    if cfg.format == "sft":  # examples, not windows of a stream: the last batch of a split is padded
        return
    for split, tokens in (("train", corpus.train), ("validation", corpus.validation)):
        n = len(Windows(tokens, cfg.seq_len))
        if n < global_batch:
            raise UserError(
                f"the {split} split has {n} sequences of data.seq_len={cfg.seq_len}, fewer than one batch "
                f"(train.global_batch={global_batch}); use more data, a shorter seq_len or a smaller batch"
                + (f", or a larger data.val_fraction (now {cfg.val_fraction})" if split == "validation" else ""))
