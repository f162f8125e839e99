"""llama3_405b_pp: llama3_405b with pipeline stages across nodes. Mesh h100x512_pp (tensor 8 inside a node,
stage 2 x fsdp 32 across nodes), rules pp_fsdp_tp; circular schedule: 126 layers = 2 stages x 21 repeats x 3,
2 micro-batches in flight per pass of 32 (one sequence per device per micro-batch), bubble
(2 - 1) / (21 x 2 + 2 - 1) = 2.3%. Many repeats keep what a stage saves for the backward near the plain layout's
(iterations x layers per stage = 43 x 3 = 129 layer inputs per sequence, against 126); `jaxtrain plan llama3_405b_pp
--gpu h100` with jax's CUDA plugin: 57.5 GiB compiled of 71.7 usable (README, "Pipeline parallelism", for the other
schedules tried)."""

import dataclasses

from jaxtrain.experiments import llama3_405b
from jaxtrain.experiments._llama import run
from jaxtrain.config import load_mesh_file
from jaxtrain.models.config import PipelineConfig


def config():
    cfg = llama3_405b.config()
    model = dataclasses.replace(cfg.model, pipeline=PipelineConfig(microbatches=2, repeats=21))
    return dataclasses.replace(cfg, model=model, rules="pp_fsdp_tp", mesh=load_mesh_file("h100x512_pp"),
                               train=dataclasses.replace(cfg.train, microbatches=32))


if __name__ == "__main__":
    run(__file__)
