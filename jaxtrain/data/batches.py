"""A run's data and batches whatever its ``data.format``: the token stream (corpus.py) cut into windows
(pipeline.py), or instruction examples (sft.py, which builds on the pipeline) packed; the choice is made here, so
none of those modules imports another to make it."""

from __future__ import annotations

import dataclasses
import fractions
import math

import numpy as np
from jax.sharding import NamedSharding

from jaxtrain.config import DataConfig
from jaxtrain.data import sft
from jaxtrain.data.corpus import Corpus, load_corpus
from jaxtrain.data.pipeline import GlobalBatches, HostBatches, Windows


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


@dataclasses.dataclass(frozen=True)
class Epoch:
    """One pass over the training split, which the data position counts in: ``size`` of ``unit`` (text: the sequences
    of data.seq_len, each read once an epoch; instruction data: the examples, packed several to a sequence)."""

    size: int
    unit: str
    left_out_tokens: int | None  # text: the split's last tokens, short of a sequence, which no epoch reads

    def of(self, position: int) -> float:
        """The epochs read at data position ``position`` (``unit`` read): 1.5 is half-way through the second."""
        return position / self.size

    def summary(self, position: int, step: int, steps: int, global_batch: int, train_epochs: float = 0) -> dict:
        """The start-up summary's ``epoch``: its size, its steps (text: whole sequences, so global_batch of them a step;
        instruction data: as many examples a step as pack into it, so null), the epochs read at this start and at
        train.steps (null for instruction data), and train.epochs with the train.steps it came to (null without)."""
        whole_sequences = self.unit == "sequences"
        return {"size": self.size, "unit": self.unit, "left_out_tokens": self.left_out_tokens,
                "steps": self.size / global_batch if whole_sequences else None, "at_start": self.of(position),
                "at_end": self.of(position + (steps - step) * global_batch) if whole_sequences else None,
                "train_epochs": train_epochs or None, "train_steps": steps if train_epochs else None}


def epoch(corpus: Corpus, cfg: DataConfig) -> Epoch:
    if cfg.format == "sft":
        return Epoch(len(corpus.train), "examples", None)
    sequences = len(Windows(corpus.train, cfg.seq_len))
    # a window is seq_len inputs and the target after them: the tokens past the last window's target are never read
    return Epoch(sequences, "sequences", len(corpus.train) - 1 - sequences * cfg.seq_len)


def steps_for_epochs(corpus: Corpus | sft.SftCorpus, cfg: DataConfig, global_batch: int, sharding: NamedSharding,
                     epochs: float, start: dict | None = None) -> int:
    """train.epochs as steps: the first step whose batch reads ``epochs`` passes over the training split from its start
    (the last one reads on into the next pass where they end inside a batch). ``start``: a data position to count from
    instead (a resumed run's, its checkpoint's iterator state): the steps still to take, 0 where it has read them.
    Text: ``global_batch`` sequences a step, so a division. Instruction data: as many examples a step as pack into it, so
    the run's own packer is run here over those passes and its steps counted (at the packer's speed: about 3,500
    examples a second on a 2-core VM, README)."""
    # the decimal given, not its binary neighbour: 1.12 epochs of 50 sequences are 56 of them, not 56.00000000000001
    wanted = fractions.Fraction(repr(float(epochs))) * epoch(corpus, cfg).size
    least = 1 if start is None else 0  # a run takes a step; a resumed one may have read its epochs already
    batches = train_batches(corpus, cfg, global_batch, sharding)
    if start is not None:
        batches.iterator.set_state(start)
    if cfg.format != "sft":
        return max(least, math.ceil((wanted - batches.position()) / global_batch))
    steps = 0
    try:
        while steps < least or batches.position() < wanted:
            next(batches.iterator)
            steps += 1
    finally:
        batches.iterator.close()
    return steps
