"""llama3_3b: Llama 3.2 3B (28 layers, d 3072, 24 heads, 8 KV heads, MLP 8192, tied embeddings, 3.2B).
Meshes: h100x8 (rules fsdp), h100x64 (fsdp_tp)."""

from jaxtrain.experiments._llama import LLAMA3_2_ROPE_SCALING, experiment, llama3, run


def config():
    model = llama3(d_model=3072, num_layers=28, num_heads=24, num_kv_heads=8, mlp_dim=8192, tie_embeddings=True,
                   rope_scaling=LLAMA3_2_ROPE_SCALING, remat="full")
    return experiment(model, seq_len=8192, batch_tokens=2**20, lr=3e-4, steps=50_000, warmup_steps=2000,
                      mesh="h100x8", rules="fsdp")


if __name__ == "__main__":
    run(__file__)
