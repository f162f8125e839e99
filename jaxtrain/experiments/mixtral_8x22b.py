"""mixtral_8x22b: Mixtral 8x22B (56 layers, d 6144, 48 heads, 8 KV heads, 8 experts of MLP 16384, top-2, vocabulary
32768): 140.6B parameters, 39.2B active per token. Mesh h100x512_ep (expert 8 inside a node, fsdp 64 across nodes),
rules fsdp_ep."""

from jaxtrain.experiments._llama import run
from jaxtrain.experiments._mixtral import mixtral


def config():
    return mixtral(vocab_size=32768, d_model=6144, num_layers=56, num_heads=48, num_kv_heads=8, mlp_dim=16384,
                   mesh="h100x512_ep")


if __name__ == "__main__":
    run(__file__)
