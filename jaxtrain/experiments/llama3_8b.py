"""llama3_8b: Llama 3.1 8B (32 layers, d 4096, 32 heads, 8 KV heads, MLP 14336, 8.0B).
Meshes: h100x8 (rules fsdp), h100x64 (rules fsdp_tp)."""

from jaxtrain.experiments._llama import LLAMA3_1_ROPE_SCALING, experiment, llama3, run


def config():
    model = llama3(d_model=4096, num_layers=32, num_heads=32, num_kv_heads=8, mlp_dim=14336,
                   rope_scaling=LLAMA3_1_ROPE_SCALING, remat="full")
    return experiment(model, seq_len=8192, batch_tokens=2**21, lr=3e-4, steps=100_000, warmup_steps=2000,
                      mesh="h100x8", rules="fsdp")


if __name__ == "__main__":
    run(__file__)
