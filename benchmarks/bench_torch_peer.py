"""jaxtrain's train step against the PyTorch peer on the same CPU (issue 16): Hugging Face transformers'
``LlamaForCausalLM`` on torch, same Llama shapes, float32, one device, AdamW with global-norm clipping, both
on every core with the same thread count: torch.set_num_threads(os.cpu_count()), and a process of its own with one
simulated CPU device (``SIMULATED_CPU_DEVICES``), whose XLA:CPU thread pool has os.cpu_count() threads. In
``make bench``'s 8-device process the pool has one thread per device, 8 on 2 cores, and the same step ran 1.2x
slower (README, "Benchmarks"). Repetitions interleaved as in bench_perf.

- ``torch_peer_ratio``: jaxtrain tokens/s ÷ transformers tokens/s (goal >= 1.0), and both absolute.
- ``unrolled_layers_speedup``: the default on CPUs (``model.scan_layers=auto``: unrolled) ÷ the same with
  ``model.scan_layers=true`` (the layer scan, as on GPUs), tokens/s, in the same interleaved run, beside both train
  steps' compile times (what unrolling costs).
- ``chunked_attention_speedup``: jaxtrain with ``model.attention=chunked`` (what ``auto`` picks on CPUs:
  jaxtrain/models/attention.py) ÷ the same with ``model.attention=xla``, tokens/s, in the same interleaved run; and
  ``chunked_attention_speedup_seq_1024``: the same pair at sequence length 1024 (batch 2, the same tokens per
  step), where the scores weigh more.
- ``remat_speedup``: jaxtrain with ``model.remat=full``, ``save_dots`` and ``save_qkv_out`` each ÷ the default
  (none), and ``torch_peer.remat_ratio``: each setting's tokens/s ÷ transformers': on XLA:CPU, recomputing part of
  a layer can cost less than zero-filling, writing and reading back the stacks the layer scan saves.
- ``torch_peer_phases``: where the time goes, phase by phase, each timed side by side like the whole step:
  the forward pass alone (loss, no gradient), forward + backward (loss and gradients), and the whole step
  (+ clipping and AdamW); the differences give backward and optimizer times.
- ``torch_peer.load_average``: the machine's 1-minute load average before and after. torch's OpenMP threads wait
  for each other at every parallel region, so on a machine busier than its cores torch slows several times more
  than XLA:CPU's pool does, and the ratio flatters jaxtrain: read it only where the load stayed under the cores.
"""

from __future__ import annotations

import dataclasses
import math
import os

import jax
from bench_perf import ONE_DEVICE, config, fixed_batch, interleaved_medians, jaxtrain_contender, random_corpus

from jaxtrain.step import token_nll
from jaxtrain.train import build
from jaxtrain.models.config import LlamaConfig

# the shapes: 4 layers, d_model 256, 4 heads / 2 KV heads, SwiGLU 768, vocab 256, batch 8 x 256 tokens
PEER_MODEL = LlamaConfig(vocab_size=256, d_model=256, num_layers=4, num_heads=4, num_kv_heads=2, mlp_dim=768, dtype="float32")
SEQ_LEN, BATCH = 256, 8
SIMULATED_CPU_DEVICES = 1  # benchmarks/run.py runs this module in a process with one CPU device
REMATS = ("full", "save_dots", "save_qkv_out")  # timed against the default, none


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

    def loss():
        logits = model(input_ids=inputs).logits
        return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))

    def forward(_, __):
        with torch.no_grad():
            return loss()

    def forward_backward(_, __):
        optimizer.zero_grad(set_to_none=True)
        value = loss()
        value.backward()
        return value.detach()

    def step(_, __):
        value = forward_backward(None, None)
        torch.nn.utils.clip_grad_norm_(model.parameters(), o.clip_norm)
        optimizer.step()
        return value

    first = step(None, None)
    return {"step": (step, first), "forward": (forward, first), "forward_backward": (forward_backward, first)}


def jaxtrain_phases(trainer) -> dict:
    """The forward pass and forward + backward of jaxtrain's own loss (token_nll), jitted with the trainer's
    shardings, on a fresh state's parameters; the whole step is the trainer's."""
    params = trainer.init_state().params
    loss = lambda p, b: token_nll(trainer.layout.spec.graphdef, p, b).mean()  # noqa: E731
    forward, forward_backward = jax.jit(loss), jax.jit(jax.value_and_grad(loss))
    return {"step": jaxtrain_contender(trainer), "forward": (lambda _, b: forward(params, b), None),
            "forward_backward": (lambda _, b: forward_backward(params, b)[0], None)}


def run() -> dict:
    import torch

    torch.set_num_threads(os.cpu_count())
    load_before = os.getloadavg()[0]
    cfg = config(PEER_MODEL, mesh=ONE_DEVICE, rules="dp", seq_len=SEQ_LEN, global_batch=BATCH)
    cfg = dataclasses.replace(cfg, log=dataclasses.replace(cfg.log, layer_every=0))  # the peer computes no per-layer norms
    corpus = random_corpus(PEER_MODEL.vocab_size)
    trainer = build(cfg, corpus, jax.devices()[:1])
    variant = lambda cfg, **model: build(dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, **model)), corpus, jax.devices()[:1])  # noqa: E731
    scanned, xla_attention = variant(cfg, scan_layers=True), variant(cfg, attention="xla")
    remats = {policy: variant(cfg, remat=policy) for policy in REMATS}
    long_cfg = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, seq_len=4 * SEQ_LEN),
                                   train=dataclasses.replace(cfg.train, global_batch=BATCH // 4))
    long_chunked, long_xla = variant(long_cfg), variant(long_cfg, attention="xla")
    batch = fixed_batch(trainer)
    torch_phases = torch_contender(cfg, batch)
    torch_loss = torch_phases["step"][1]
    jax_loss = float(trainer.train_step(trainer.init_state(), batch)[1]["loss"])
    for name, loss in (("jaxtrain", jax_loss), ("transformers", float(torch_loss))):  # same task, fresh models
        if abs(loss - math.log(PEER_MODEL.vocab_size)) > 0.1:
            raise AssertionError(f"{name}'s first loss {loss:.3f} is not ln(vocab) = {math.log(PEER_MODEL.vocab_size):.3f}")
    jax_phases = jaxtrain_phases(trainer)
    long_medians = interleaved_medians({"chunked": jaxtrain_contender(long_chunked), "xla": jaxtrain_contender(long_xla)},
                                       fixed_batch(long_chunked))
    medians = interleaved_medians({"jaxtrain": jax_phases["step"], "jaxtrain_scanned": jaxtrain_contender(scanned),
                                   "jaxtrain_xla_attention": jaxtrain_contender(xla_attention),
                                   "transformers": torch_phases["step"]}
                                  | {f"jaxtrain_remat_{policy}": jaxtrain_contender(t) for policy, t in remats.items()}
                                  | {f"{who}_{phase}": contender for who, phases in (("jaxtrain", jax_phases), ("transformers", torch_phases))
                                     for phase, contender in phases.items() if phase != "step"}, batch)
    phases = {phase: {who: medians[f"{who}_{phase}"] for who in ("jaxtrain", "transformers")} for phase in ("forward", "forward_backward")}
    phases["step"] = {who: medians[who] for who in ("jaxtrain", "transformers")}
    tokens = trainer.tokens_per_step
    return {
        "torch_peer_ratio": medians["transformers"] / medians["jaxtrain"],
        "unrolled_layers_speedup": medians["jaxtrain_scanned"] / medians["jaxtrain"],
        "chunked_attention_speedup": medians["jaxtrain_xla_attention"] / medians["jaxtrain"],
        "chunked_attention_speedup_seq_1024": long_medians["xla"] / long_medians["chunked"],
        "remat_speedup": {policy: medians["jaxtrain"] / medians[f"jaxtrain_remat_{policy}"] for policy in REMATS},
        # seconds per phase and the transformers ÷ jaxtrain time ratio (> 1: jaxtrain faster there)
        "torch_peer_phases": {phase: t | {"ratio": t["transformers"] / t["jaxtrain"]} for phase, t in phases.items()},
        "torch_peer": {"jaxtrain_tokens_per_s": tokens / medians["jaxtrain"], "transformers_tokens_per_s": tokens / medians["transformers"],
                       "jaxtrain_scanned_tokens_per_s": tokens / medians["jaxtrain_scanned"],
                       "scanned_over_transformers": medians["transformers"] / medians["jaxtrain_scanned"],
                       "remat_ratio": {policy: medians["transformers"] / medians[f"jaxtrain_remat_{policy}"] for policy in REMATS},
                       "xla_attention_ratio": medians["transformers"] / medians["jaxtrain_xla_attention"],
                       "seq_1024_step_s": {"chunked": long_medians["chunked"], "xla": long_medians["xla"]},
                       "compile_s": trainer.compile_s, "scanned_compile_s": scanned.compile_s,
                       "xla_attention_compile_s": xla_attention.compile_s,
                       "jaxtrain_step_s": medians["jaxtrain"], "transformers_step_s": medians["transformers"],
                       "torch_threads": torch.get_num_threads(), "torch_version": torch.__version__,
                       "load_average": {"before": load_before, "after": os.getloadavg()[0], "cores": os.cpu_count()}},
    }
