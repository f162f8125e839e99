"""A run's data and batches whatever its ``data.format``: the token stream (corpus.py) cut into windows
(pipeline.py), or instruction examples (sft.py, which builds on the pipeline) packed; the choice is made here, so
none of those modules imports another to make it."""

from __future__ import annotations

import numpy as np
from jax.sharding import NamedSharding

from jaxtrain.config import DataConfig
from jaxtrain.data import sft
from jaxtrain.data.corpus import Corpus, load_corpus
from jaxtrain.data.pipeline import GlobalBatches, HostBatches


def load_data(cfg: DataConfig) -> Corpus | sft.SftCorpus:
    """What the run trains on: instruction examples (data.format=sft), else the token stream."""
    return sft.load_sft(cfg) if cfg.format == "sft" else load_corpus(cfg)


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
