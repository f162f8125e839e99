"""llama3_405b: Llama 3.1 405B (126 layers, d 16384, 128 heads, 8 KV heads, MLP 53248, 406B).
Mesh: h100x512 (rules fsdp_tp: tensor 8 inside a node, fsdp 64 across nodes)."""

from jaxtrain.experiments._llama import LLAMA3_1_ROPE_SCALING, experiment, llama3, run


def config():
    model = llama3(d_model=16384, num_layers=126, num_heads=128, num_kv_heads=8, mlp_dim=53248,
                   rope_scaling=LLAMA3_1_ROPE_SCALING, remat="full")
    return experiment(model, seq_len=8192, batch_tokens=2**24, lr=8e-5, steps=100_000, warmup_steps=8000,
                      mesh="h100x512", rules="fsdp_tp")


if __name__ == "__main__":
    run(__file__)
