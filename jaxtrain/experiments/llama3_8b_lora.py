"""llama3_8b_lora: LoRA fine-tuning of Llama 3.1 8B on one H100 node (mesh h100x8, rules fsdp). Run it with
``--init-from LLAMA_8B_HF_DIR`` (the frozen base, kept in bfloat16) and ``data.path=TOKENS.bin``: rank-16
adapters on every projection, learning rate 2e-4 (adapters take a higher rate than full fine-tuning)."""

import dataclasses

from jaxtrain.experiments._llama import LLAMA3_1_ROPE_SCALING, experiment, llama3, run
from jaxtrain.models.config import LoraConfig


def config():
    model = llama3(d_model=4096, num_layers=32, num_heads=32, num_kv_heads=8, mlp_dim=14336,
                   rope_scaling=LLAMA3_1_ROPE_SCALING, remat="full", param_dtype="bfloat16", lora=LoraConfig(rank=16, alpha=32.0))
    cfg = experiment(model, seq_len=4096, batch_tokens=2**18, lr=2e-4, steps=2000, warmup_steps=50, mesh="h100x8", rules="fsdp")
    return dataclasses.replace(cfg, optim=dataclasses.replace(cfg.optim, weight_decay=0.0))


if __name__ == "__main__":
    run(__file__)
