"""tiny_moe: tiny with a mixture of 8 SwiGLU experts (top-2) in every layer, 2.6M parameters of which 0.86M are
active per token, on 8 simulated CPU devices with expert parallelism (mesh cpu8_ep: fsdp 2 x tensor 2 x expert 2,
rules fsdp_tp_ep, capacity dispatch at 1.25)."""

import dataclasses

from jaxtrain.experiments import tiny
from jaxtrain.experiments._llama import run
from jaxtrain.config import load_mesh_file
from jaxtrain.models.config import MoEConfig


def config():
    cfg = tiny.config()
    # each expert a quarter of tiny's MLP: top-2 routing costs half of tiny's MLP per token
    model = dataclasses.replace(cfg.model, mlp_dim=192, moe=MoEConfig(num_experts=8, top_k=2, dispatch="capacity", capacity_factor=1.25))
    return dataclasses.replace(cfg, model=model, mesh=load_mesh_file("cpu8_ep"), rules="fsdp_tp_ep")


if __name__ == "__main__":
    run(__file__)
