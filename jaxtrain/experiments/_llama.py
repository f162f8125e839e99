"""Shared pieces of the experiment files: the Llama 3 tokenizer shape and a Config built from the
few numbers that differ between sizes. Not an experiment itself (the leading underscore hides it)."""

import dataclasses
import sys

from jaxtrain.errors import UserError
from jaxtrain.config import Config, DataConfig, LogConfig, OptimConfig, TrainConfig, load_mesh_file
from jaxtrain.models.config import LlamaConfig, RopeScaling

LLAMA3_VOCAB = 128256  # Llama 3 tokenizer (tiktoken, 128K)
LLAMA3_ROPE_THETA = 500000.0
# the rope_scaling of Llama 3.1's config.json (8B, 70B, 405B); Llama 3.2 1B / 3B divide by 32. It changes the rotary
# frequencies at every position, so a model trained or exported without it is not the one the experiment is named after
LLAMA3_1_ROPE_SCALING = RopeScaling(type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_len=8192)
LLAMA3_2_ROPE_SCALING = dataclasses.replace(LLAMA3_1_ROPE_SCALING, factor=32.0)


def llama3(**shape) -> LlamaConfig:
    """A Llama 3 shape: bfloat16 compute, float32 master weights, the Llama 3 vocabulary and rotary base."""
    return LlamaConfig(vocab_size=LLAMA3_VOCAB, rope_theta=LLAMA3_ROPE_THETA, dtype="bfloat16", **shape)


def experiment(model: LlamaConfig, *, seq_len: int, batch_tokens: int, lr: float, steps: int, warmup_steps: int,
               mesh: str, rules: str, microbatches: int | str = "auto") -> Config:
    """A pretraining config: ``batch_tokens`` per optimizer step (a multiple of ``seq_len``), AdamW with
    warmup and cosine decay to lr/10, weight decay 0.1, clipping at 1.0 (Llama 2's recipe; the Llama 3 paper
    decays 405B to lr/100, set optim.min_lr_ratio=0.01 for that)."""
    if batch_tokens % seq_len:
        raise UserError(f"batch_tokens={batch_tokens} is not a multiple of seq_len={seq_len}; use a whole number of sequences")
    return Config(
        model=model,
        data=DataConfig(seq_len=seq_len),  # data.path=TOKENS.bin from `jaxtrain tokenize ... --tokenizer LLAMA3_DIR`, data.tokenizer=LLAMA3_DIR
        train=TrainConfig(steps=steps, global_batch=batch_tokens // seq_len, microbatches=microbatches, eval_every=1000),
        optim=OptimConfig(lr=lr, warmup_steps=warmup_steps, min_lr_ratio=0.1, weight_decay=0.1, clip_norm=1.0),
        log=LogConfig(every=10),
        mesh=load_mesh_file(mesh),
        rules=rules,
    )


def run(experiment_file: str) -> None:
    """``python jaxtrain/experiments/NAME.py [jaxtrain train options]`` does ``jaxtrain train NAME ...``, restarting itself
    with jemalloc as the command does (``JAXTRAIN_HOST_MALLOC=jemalloc``)."""
    from jaxtrain.__main__ import main

    sys.exit(main(["train", experiment_file, *sys.argv[1:]]))
