"""llama_125m: GPT-3 Small's body (12 layers, d 768, 12 heads, 4 KV heads) as a Llama with the Llama 3
tokenizer and tied embeddings (75.5M in the layers + 98.5M embedding = 174M). Meshes: gpu1, h100x8 (rules fsdp)."""

from jaxtrain.experiments._llama import experiment, llama3, run


def config():
    model = llama3(d_model=768, num_layers=12, num_heads=12, num_kv_heads=4, mlp_dim=2048,  # 8/3 d (SwiGLU)
                   tie_embeddings=True, remat="none")
    return experiment(model, seq_len=4096, batch_tokens=2**19, lr=6e-4, steps=20_000, warmup_steps=700,
                      mesh="h100x8", rules="fsdp")


if __name__ == "__main__":
    run(__file__)
