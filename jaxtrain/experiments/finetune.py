"""finetune: full fine-tuning of an open model. Run it with ``--init-from HF_DIR`` (a Hugging Face model
directory): the model's shape comes from HF_DIR/config.json and its weights from the safetensors files, so
this file sets no model shape; give the data with ``data.path=TOKENS.bin`` (tokenized with the model's
tokenizer). The recipe: a low learning rate with a short warmup, cosine decay to lr/10, no weight decay.

    jaxtrain train finetune --init-from models/Llama-3.2-1B data.path=tokens.bin --run-dir runs/ft

Instruction tuning on chat data (loss on the answers only, examples packed): add
``data.format=sft data.path=chats.jsonl data.tokenizer=HF_DIR`` (README, "Instruction data (SFT)").
"""

from jaxtrain.experiments._llama import run
from jaxtrain.config import CheckpointConfig, Config, DataConfig, LogConfig, OptimConfig, TrainConfig, load_mesh_file
from jaxtrain.models.config import LlamaConfig


def config() -> Config:
    return Config(
        model=LlamaConfig(remat="save_dots"),  # shape: from --init-from HF_DIR; compute bfloat16, master weights float32
        data=DataConfig(seq_len=4096),
        train=TrainConfig(steps=1000, global_batch=64, microbatches="auto", eval_every=200),
        optim=OptimConfig(lr=2e-5, warmup_steps=30, min_lr_ratio=0.1, weight_decay=0.0, clip_norm=1.0),
        log=LogConfig(every=10),
        checkpoint=CheckpointConfig(every=200),
        mesh=load_mesh_file("h100x8"),
        rules="fsdp",
    )


if __name__ == "__main__":
    run(__file__)
