"""Shared piece of the Mixtral experiment files (not an experiment itself)."""

from jaxtrain.experiments._llama import experiment
from jaxtrain.models.config import LlamaConfig, MoEConfig

MISTRAL_VOCAB = 32000  # Mixtral 8x7B's tokenizer; 8x22B's v3 tokenizer has 32768
MIXTRAL_ROPE_THETA = 1e6


def mixtral(*, vocab_size: int = MISTRAL_VOCAB, mesh: str, **shape):
    """A Mixtral shape (8 experts, top-2, no shared experts) pretrained on ``mesh`` with rules fsdp_ep: capacity
    dispatch at 1.25, so tokens reach their experts by the fixed-shape all-to-all on every backend."""
    model = LlamaConfig(vocab_size=vocab_size, rope_theta=MIXTRAL_ROPE_THETA, dtype="bfloat16", remat="full",
                        moe=MoEConfig(num_experts=8, top_k=2, dispatch="capacity", capacity_factor=1.25), **shape)
    return experiment(model, seq_len=4096, batch_tokens=2**22, lr=3e-4, steps=100_000, warmup_steps=2000,
                      mesh=mesh, rules="fsdp_ep")
