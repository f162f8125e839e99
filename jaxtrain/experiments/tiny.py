"""tiny: a 0.85M-parameter byte-level Llama trained on the Python standard library, on 8 simulated CPU
devices (mesh cpu8, rules fsdp_tp). `make train` runs it; it takes a few minutes on 2 CPU cores."""

from jaxtrain.experiments._llama import run
from jaxtrain.config import Config, DataConfig, LogConfig, OptimConfig, TrainConfig, load_mesh_file
from jaxtrain.models.config import LlamaConfig


def config() -> Config:
    return Config(
        model=LlamaConfig(vocab_size=256, d_model=128, num_layers=4, num_heads=4, num_kv_heads=2, mlp_dim=384,
                          # float32 compute: bfloat16 is emulated, slowly, on CPUs; keeping q, k, v and the attention
                          # output and recomputing the rest trained 1.15x faster here than remat none with scanned
                          # layers (XLA:CPU's layer scan pays more to stack what it saves than to recompute it: README,
                          # "Benchmarks"); unrolled, the CPU default now, it is about 0.9x none's speed, and XLA:CPU
                          # keeps the activations either way (README, "Partial remat")
                          dtype="float32", remat="save_qkv_out"),
        data=DataConfig(seq_len=256),
        train=TrainConfig(steps=150, global_batch=32, eval_every=50, eval_batches=8),
        optim=OptimConfig(lr=3e-3, warmup_steps=20, weight_decay=0.1),
        log=LogConfig(every=10),
        mesh=load_mesh_file("cpu8"),
        rules="fsdp_tp",
    )


if __name__ == "__main__":
    run(__file__)
