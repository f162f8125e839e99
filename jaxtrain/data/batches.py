"""A run's batches whatever its ``data.format``: windows of the token stream (pipeline.py) or packed instruction
examples (sft.py, which builds on the pipeline), so neither of those modules imports the other to choose."""

from __future__ import annotations

import numpy as np
from jax.sharding import NamedSharding

from jaxtrain.config import DataConfig
from jaxtrain.data import sft
from jaxtrain.data.corpus import Corpus
from jaxtrain.data.pipeline import GlobalBatches, HostBatches


def batch_fields(cfg: DataConfig) -> dict[str, type]:
    """What a batch holds, name -> dtype, each (global_batch, seq_len)."""
    if cfg.format == "sft":
        return sft.BATCH_FIELDS
    return {"inputs": np.int32, "targets": np.int32}


def train_batches(corpus: Corpus, cfg: DataConfig, global_batch: int, sharding: NamedSharding) -> GlobalBatches:
    if cfg.format == "sft":
        return sft.train_batches(corpus, cfg, global_batch, sharding)
    return GlobalBatches(corpus.train, cfg.seq_len, global_batch, sharding, shuffle_seed=cfg.seed, repeat=True)


def eval_batches(corpus: Corpus, cfg: DataConfig, global_batch: int, sharding: NamedSharding, count: int) -> HostBatches:
    """The first ``count`` batches of the validation split, in file order: the same every evaluation. Kept in host
    memory, each put on the devices as it is scored."""
    if cfg.format == "sft":
        return sft.eval_batches(corpus, cfg, global_batch, sharding, count)
    batches = GlobalBatches(corpus.validation, cfg.seq_len, global_batch, sharding, shuffle_seed=None, repeat=False)
    return batches.take_to_host(count)
