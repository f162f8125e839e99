"""jaxtrain's train step against the PyTorch peer on the same CPU (issue 16): Hugging Face transformers'
``LlamaForCausalLM`` on torch, same Llama shapes, float32, one device, AdamW with global-norm clipping, both
on every core (torch.set_num_threads(os.cpu_count()); XLA:CPU's thread pool takes every core by default),
repetitions interleaved as in bench_perf.

- ``torch_peer_ratio``: jaxtrain tokens/s ÷ transformers tokens/s (goal >= 1.0), and both absolute.
"""

from __future__ import annotations

import dataclasses
import math
import os

import jax
from bench_perf import ONE_DEVICE, config, fixed_batch, interleaved_medians, jaxtrain_contender, random_corpus

from jaxtrain.train import build
from models.config import LlamaConfig

# the shapes: 4 layers, d_model 256, 4 heads / 2 KV heads, SwiGLU 768, vocab 256, batch 8 x 256 tokens
PEER_MODEL = LlamaConfig(vocab_size=256, d_model=256, num_layers=4, num_heads=4, num_kv_heads=2, mlp_dim=768, dtype="float32")
SEQ_LEN, BATCH = 256, 8


def torch_contender(cfg, batch):
    """(step(loss, batch) -> loss, first loss) for transformers' Llama with the same shapes and optimizer."""
    import numpy as np
    import torch
    from transformers import LlamaConfig as HFLlamaConfig
    from transformers import LlamaForCausalLM

    m, o = cfg.model, cfg.optim
    torch.manual_seed(0)
    model = LlamaForCausalLM(HFLlamaConfig(
        vocab_size=m.vocab_size, hidden_size=m.d_model, intermediate_size=m.mlp_dim, num_hidden_layers=m.num_layers,
        num_attention_heads=m.num_heads, num_key_value_heads=m.num_kv_heads, max_position_embeddings=SEQ_LEN,
        rope_theta=m.rope_theta, rms_norm_eps=m.norm_eps, tie_word_embeddings=False, initializer_range=m.init_std))
    decay = [p for p in model.parameters() if p.ndim >= 2]
    rest = [p for p in model.parameters() if p.ndim < 2]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": o.weight_decay}, {"params": rest, "weight_decay": 0.0}],
                                  lr=o.lr, betas=(o.b1, o.b2), eps=o.eps)
    inputs = torch.from_numpy(np.asarray(batch["inputs"]).astype(np.int64))
    targets = torch.from_numpy(np.asarray(batch["targets"]).astype(np.int64))

    def step(_, __):
        logits = model(input_ids=inputs).logits
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), o.clip_norm)
        optimizer.step()
        return loss.detach()

    return step, step(None, None)


def run() -> dict:
    import torch

    torch.set_num_threads(os.cpu_count())
    cfg = config(PEER_MODEL, mesh=ONE_DEVICE, rules="dp", seq_len=SEQ_LEN, global_batch=BATCH)
    cfg = dataclasses.replace(cfg, log=dataclasses.replace(cfg.log, layer_every=0))  # the peer computes no per-layer norms
    trainer = build(cfg, random_corpus(PEER_MODEL.vocab_size), jax.devices()[:1])
    batch = fixed_batch(trainer)
    torch_step, torch_loss = torch_contender(cfg, batch)
    jax_loss = float(trainer.train_step(trainer.init_state(), batch)[1]["loss"])
    for name, loss in (("jaxtrain", jax_loss), ("transformers", float(torch_loss))):  # same task, fresh models
        if abs(loss - math.log(PEER_MODEL.vocab_size)) > 0.1:
            raise AssertionError(f"{name}'s first loss {loss:.3f} is not ln(vocab) = {math.log(PEER_MODEL.vocab_size):.3f}")
    medians = interleaved_medians({"jaxtrain": jaxtrain_contender(trainer), "transformers": (torch_step, torch_loss)}, batch)
    tokens = trainer.tokens_per_step
    return {
        "torch_peer_ratio": medians["transformers"] / medians["jaxtrain"],
        "torch_peer": {"jaxtrain_tokens_per_s": tokens / medians["jaxtrain"], "transformers_tokens_per_s": tokens / medians["transformers"],
                       "jaxtrain_step_s": medians["jaxtrain"], "transformers_step_s": medians["transformers"],
                       "torch_threads": torch.get_num_threads(), "torch_version": torch.__version__},
    }
