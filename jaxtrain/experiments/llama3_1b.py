"""llama3_1b: Llama 3.2 1B (16 layers, d 2048, 32 heads, 8 KV heads, MLP 8192, tied embeddings, 1.24B).
Meshes: h100x8 / h200 nodes (rules fsdp), gpu1 for a smoke test."""

from jaxtrain.experiments._llama import LLAMA3_2_ROPE_SCALING, experiment, llama3, run


def config():
    model = llama3(d_model=2048, num_layers=16, num_heads=32, num_kv_heads=8, mlp_dim=8192, tie_embeddings=True,
                   rope_scaling=LLAMA3_2_ROPE_SCALING, remat="save_dots")
    return experiment(model, seq_len=8192, batch_tokens=2**20, lr=3e-4, steps=50_000, warmup_steps=2000,
                      mesh="h100x8", rules="fsdp")


if __name__ == "__main__":
    run(__file__)
