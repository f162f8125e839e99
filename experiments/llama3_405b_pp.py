"""llama3_405b_pp: llama3_405b with pipeline stages across nodes. Mesh h100x512_pp (tensor 8 inside a node,
stage 2 x fsdp 32 across nodes), rules pp_fsdp_tp; circular schedule: 126 layers = 2 stages x 3 repeats x 21,
4 micro-batches in flight per pass, bubble (2 - 1) / (3 x 4 + 2 - 1) = 7.7% (8 would halve
it but cap train.microbatches at 8: each micro-batch needs a sequence per device, and 8 passes do not fit)."""

import dataclasses

from experiments import llama3_405b
from experiments._llama import run
from jaxtrain.config import load_mesh_file
from models.config import PipelineConfig


def config():
    cfg = llama3_405b.config()
    model = dataclasses.replace(cfg.model, pipeline=PipelineConfig(microbatches=4, repeats=3))
    return dataclasses.replace(cfg, model=model, rules="pp_fsdp_tp", mesh=load_mesh_file("h100x512_pp"))


if __name__ == "__main__":
    run(__file__)
