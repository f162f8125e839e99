"""llama3_70b: Llama 3.1 70B (80 layers, d 8192, 64 heads, 8 KV heads, MLP 28672, 70.6B).
Meshes: h100x64 (rules fsdp_tp: tensor 8 inside a node, fsdp across nodes), h100x512."""

from jaxtrain.experiments._llama import LLAMA3_1_ROPE_SCALING, experiment, llama3, run


def config():
    model = llama3(d_model=8192, num_layers=80, num_heads=64, num_kv_heads=8, mlp_dim=28672,
                   rope_scaling=LLAMA3_1_ROPE_SCALING, remat="full")
    return experiment(model, seq_len=8192, batch_tokens=2**22, lr=1.5e-4, steps=100_000, warmup_steps=2000,
                      mesh="h100x64", rules="fsdp_tp")


if __name__ == "__main__":
    run(__file__)
