"""mixtral_8x7b_lora: LoRA fine-tuning of Mixtral 8x7B on one H100 node (mesh h100x8, rules fsdp). Run it with
``--init-from MIXTRAL_8X7B_HF_DIR`` (the frozen base, kept in bfloat16) and ``data.path=TOKENS.bin``: rank-16
adapters on attention and on every expert (PEFT's target_parameters experts.gate_up_proj / down_proj), dropless
dispatch (no token is dropped, as in Hugging Face's Mixtral), learning rate 2e-4."""

import dataclasses

from jaxtrain.experiments._llama import experiment, run
from jaxtrain.experiments._mixtral import mixtral
from jaxtrain.models.config import LoraConfig, MoEConfig


def config():
    pretraining = mixtral(d_model=4096, num_layers=32, num_heads=32, num_kv_heads=8, mlp_dim=14336, mesh="h100x8")
    model = dataclasses.replace(pretraining.model, param_dtype="bfloat16", lora=LoraConfig(rank=16, alpha=32.0),
                                moe=MoEConfig(num_experts=8, top_k=2))
    cfg = experiment(model, seq_len=4096, batch_tokens=2**18, lr=2e-4, steps=2000, warmup_steps=50, mesh="h100x8", rules="fsdp")
    return dataclasses.replace(cfg, optim=dataclasses.replace(cfg.optim, weight_decay=0.0))


if __name__ == "__main__":
    run(__file__)
