"""small: a 6.4M-parameter byte-level Llama on the Python standard library, on 8 simulated CPU devices
(mesh cpu8, rules fsdp_tp): a step up from tiny for CPU experiments (its training time is not measured yet)."""

from jaxtrain.experiments._llama import run
from jaxtrain.config import Config, DataConfig, LogConfig, OptimConfig, TrainConfig, load_mesh_file
from jaxtrain.models.config import LlamaConfig


def config() -> Config:
    return Config(
        model=LlamaConfig(vocab_size=256, d_model=256, num_layers=8, num_heads=8, num_kv_heads=4, mlp_dim=768,
                          dtype="float32", remat="none"),  # float32 compute: bfloat16 is emulated, slowly, on CPUs
        data=DataConfig(seq_len=512),
        train=TrainConfig(steps=300, global_batch=16, eval_every=100, eval_batches=4),
        optim=OptimConfig(lr=1e-3, warmup_steps=30, weight_decay=0.1),
        log=LogConfig(every=10),
        mesh=load_mesh_file("cpu8"),
        rules="fsdp_tp",
    )


if __name__ == "__main__":
    run(__file__)
