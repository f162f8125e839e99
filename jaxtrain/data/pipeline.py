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

# how data.seed becomes grain's shuffle seed, which the data position records under SEED_SCHEME so a resumed run keeps
# its order: grain shuffles epoch e with its seed + e, so with data.seed as it is (PLAIN_SEEDS, every position written
# before the record) seed 4's first epoch was seed 3's second; SPREAD_SEEDS puts nearby seeds far apart
SEED_SCHEME = "seed_scheme"
PLAIN_SEEDS, SPREAD_SEEDS = 1, 2
SEED_SCHEMES = (PLAIN_SEEDS, SPREAD_SEEDS)


def grain_seed(seed: int, scheme: int) -> int:
    """grain's shuffle seed for ``data.seed`` under ``scheme``. The spread is a multiplicative hash (by 2**32 over the
    golden ratio): seeds 0..1000 land at least 1.9 million apart, so their epochs' seeds (grain's seed + epoch) do not
    meet in their first 1.9 million epochs."""
    return seed if scheme == PLAIN_SEEDS else seed * 0x9E3779B1 % 2**32


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


class SequenceIterator:
    """A grain iterator of batches of ``sequences`` (a shuffled, repeated stream per seed scheme, one batch row per
    sequence), this process's ``rows`` (block index, block count) of each, from any sequence on: its state, the
    checkpoint's data position, counts the sequences read, whatever the batch size that read them, and names the seed
    scheme of the stream they were read from (``seed_scheme``: ``PLAIN_SEEDS`` only from a position written before the
    spread)."""

    def __init__(self, sequences: dict[int, grain.MapDataset], global_batch: int, rows: tuple[int, int]):
        self.sequences, self.global_batch, self.rows = sequences, global_batch, rows
        self.set_state({"sequences": 0, SEED_SCHEME: SPREAD_SEEDS})

    def get_state(self) -> dict[str, int]:
        return {"sequences": self.first + self.batches.get_state()["next_index"] * self.global_batch, SEED_SCHEME: self.seed_scheme}

    def set_state(self, state: dict[str, int]) -> None:
        block, blocks = self.rows
        self.first, self.seed_scheme = state["sequences"], state[SEED_SCHEME]
        sequences = self.sequences[self.seed_scheme][self.first:]
        # whole global batches only: a finite stream's partial last one gave the first processes rows and the others none,
        # so they read unequal numbers of batches (a multi-process evaluation waited on the processes that had stopped)
        sequences = sequences[:len(sequences) - len(sequences) % self.global_batch]
        ds = sequences.batch(self.global_batch // blocks, drop_remainder=True)[block::blocks]
        self.batches = ds.map(_to_example).to_iter_dataset(grain.ReadOptions(num_threads=1, prefetch_buffer_size=2)).__iter__()

    def start_prefetch(self) -> None:
        self.batches.start_prefetch()

    def __next__(self) -> dict[str, np.ndarray]:
        return next(self.batches)


class GlobalBatches:
    """Iterator of global batches. Each process reads only the rows its devices hold; ``iterator`` (grain's
    ``get_state``/``set_state``) is the pipeline's position for checkpoints: a count of the sequences read, so a run
    resumed with another ``train.global_batch`` reads on from the next sequence, none skipped or read twice, and the
    seed scheme that shuffled them, which the resumed run keeps."""

    unit = "sequences"  # what the position counts, for messages

    def __init__(self, tokens: np.ndarray, seq_len: int, global_batch: int, sharding: NamedSharding,
                 *, shuffle_seed: int | None, repeat: bool):
        self.global_shape = (global_batch, seq_len)
        self.sharding = sharding

        def sequences(scheme: int) -> grain.MapDataset:
            ds = grain.MapDataset.source(Windows(tokens, seq_len))
            if shuffle_seed is not None:
                ds = ds.shuffle(seed=grain_seed(shuffle_seed, scheme))
            return ds.repeat() if repeat else ds

        self.iterator = SequenceIterator({scheme: sequences(scheme) for scheme in SEED_SCHEMES}, global_batch,
                                         process_rows(sharding, self.global_shape))

    def position(self) -> int:
        """The ``unit`` read so far."""
        return self.iterator.get_state()["sequences"]

    def __iter__(self) -> Iterator[dict[str, jax.Array]]:
        return self

    def __next__(self) -> dict[str, jax.Array]:
        return on_devices(next(self.iterator), self.sharding, self.global_shape)

    def take_to_host(self, count: int) -> HostBatches:
        """The next ``count`` batches (fewer where the stream ends), kept in host memory: ``HostBatches``."""
        local = []
        for _ in range(count):
            try:
                local.append(next(self.iterator))
            except StopIteration:
                break
        return HostBatches(local, self.sharding, self.global_shape)


def on_devices(local: dict[str, np.ndarray], sharding: NamedSharding, global_shape: tuple[int, int]) -> dict[str, jax.Array]:
    """A batch of this process's rows as global arrays laid out by ``sharding``."""
    return {k: jax.make_array_from_process_local_data(sharding, v, global_shape) for k, v in local.items()}


class HostBatches:
    """Batches kept in host memory, each process its own rows, and put on the devices one at a time as they are
    iterated: the validation batches, scored every train.eval_every steps, hold no device memory in between (until
    2026-12-06 they stayed on the devices for the whole run beside the train state, which the planner did not count)."""

    def __init__(self, local: list[dict[str, np.ndarray]], sharding: NamedSharding, global_shape: tuple[int, int]):
        self.local, self.sharding, self.global_shape = local, sharding, global_shape

    def __len__(self) -> int:
        return len(self.local)

    def __iter__(self) -> Iterator[dict[str, jax.Array]]:
        return (on_devices(batch, self.sharding, self.global_shape) for batch in self.local)


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
