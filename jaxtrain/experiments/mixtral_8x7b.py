"""mixtral_8x7b: Mixtral 8x7B (32 layers, d 4096, 32 heads, 8 KV heads, 8 experts of MLP 14336, top-2): 46.7B
parameters, 12.9B active per token. Mesh h100x64_ep (expert 8 inside a node, fsdp 8 across nodes), rules fsdp_ep."""

from jaxtrain.experiments._llama import run
from jaxtrain.experiments._mixtral import mixtral


def config():
    return mixtral(d_model=4096, num_layers=32, num_heads=32, num_kv_heads=8, mlp_dim=14336, mesh="h100x64_ep")


if __name__ == "__main__":
    run(__file__)
