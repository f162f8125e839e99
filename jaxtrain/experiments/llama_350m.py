"""llama_350m: GPT-3 Medium's body (24 layers, d 1024, 16 heads, 8 KV heads) as a Llama with the Llama 3
tokenizer and tied embeddings (283M in the layers + 131M embedding = 414M). Meshes: gpu1, h100x8 (rules fsdp)."""

from jaxtrain.experiments._llama import experiment, llama3, run


def config():
    model = llama3(d_model=1024, num_layers=24, num_heads=16, num_kv_heads=8, mlp_dim=2816,  # 8/3 d rounded to 256
                   tie_embeddings=True, remat="save_dots")
    return experiment(model, seq_len=4096, batch_tokens=2**19, lr=3e-4, steps=40_000, warmup_steps=1000,
                      mesh="h100x8", rules="fsdp")


if __name__ == "__main__":
    run(__file__)
