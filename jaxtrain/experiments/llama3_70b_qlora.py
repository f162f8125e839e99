"""llama3_70b_qlora: QLoRA fine-tuning of Llama 3.1 70B on 4 A100 80 GB (mesh a100x4, rules fsdp): the frozen
base stored as nf4 (4-bit NormalFloat, one bfloat16 scale per 64 weights), rank-16 adapters (float32, as every
adapter: jaxtrain/models/lora.py) on every projection, bfloat16 compute, full remat, sequences of 4096, the loss in chunks
of 512 positions. ``jaxtrain plan llama3_70b_qlora --mesh a100x4 --gpu a100`` shows per-device memory.
Run with ``--init-from LLAMA_70B_HF_DIR data.path=TOKENS.bin``."""

import dataclasses

from jaxtrain.experiments._llama import LLAMA3_1_ROPE_SCALING, experiment, llama3, run
from jaxtrain.models.config import LoraConfig


def config():
    model = llama3(d_model=8192, num_layers=80, num_heads=64, num_kv_heads=8, mlp_dim=28672,
                   rope_scaling=LLAMA3_1_ROPE_SCALING, remat="full", param_dtype="bfloat16", base_quant="nf4",
                   lora=LoraConfig(rank=16, alpha=32.0))
    cfg = experiment(model, seq_len=4096, batch_tokens=16 * 4096, lr=2e-4, steps=2000, warmup_steps=50, mesh="a100x4",
                     rules="fsdp", microbatches=4)
    # logits 512 positions at a time: a whole sequence's 128K-vocabulary float32 logits and their gradient take 3.9 GiB more per device
    return dataclasses.replace(cfg, optim=dataclasses.replace(cfg.optim, weight_decay=0.0),
                               train=dataclasses.replace(cfg.train, loss_chunk=512))


if __name__ == "__main__":
    run(__file__)
