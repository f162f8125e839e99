"""Does LoRA learn? ``make finetune-demo``: a tiny random Hugging Face Llama (written by transformers) is
LoRA-fine-tuned by ``jaxtrain train ... --init-from BASE model.lora.rank=R data.format=sft`` to reverse short
words, and scored by exact match of greedy answers to held-out words (never in the training data), before
(the base alone) and after (``jaxtrain generate BASE --adapter RUN_DIR``'s path: the run's adapters merged
into the base). Nothing is downloaded; everything is written under a temporary (or given) directory.

    python benchmarks/finetune_demo.py [--seeds 0,1] [--work-dir DIR]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ALPHABET = "abcdefgh"
WORD_LENGTH = 4
# ChatML: the answer's end-of-turn token is the tokenizer's eos token, where a greedy answer stops
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHATML = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}{% endfor %}"
          "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
CHARACTERS = sorted(set(ALPHABET + "userassistant\n"))  # everything the template and the tasks write


@dataclasses.dataclass(frozen=True)
class Setting:
    """The demo's sizes and recipe; the defaults reach >= 90% exact match (README, "LoRA / QLoRA fine-tuning")."""

    steps: int = 300
    train_examples: int = 2000
    held_out: int = 128
    rank: int = 16
    alpha: float = 32.0
    lr: float = 1e-2
    global_batch: int = 16
    seq_len: int = 128
    d_model: int = 64
    num_layers: int = 2
    mlp_dim: int = 128
    init_std: float = 0.125


def task(word: str) -> tuple[str, str]:
    """One instruction and its exact answer: the word reversed."""
    return word, word[::-1]


def split_words(count_train: int, count_held_out: int, seed: int) -> tuple[list[str], list[str]]:
    """Distinct random words of WORD_LENGTH letters: the training words and held-out words none of them equals."""
    rng = np.random.default_rng(seed)
    total = len(ALPHABET) ** WORD_LENGTH
    if count_train + count_held_out > total:
        raise ValueError(f"{count_train} + {count_held_out} words asked, only {total} exist")
    chosen = rng.choice(total, count_train + count_held_out, replace=False)
    words = ["".join(ALPHABET[(n // len(ALPHABET) ** i) % len(ALPHABET)] for i in range(WORD_LENGTH)) for n in chosen]
    return words[:count_train], words[count_train:]


def exact_match(answers: list[str], expected: list[str]) -> float:
    """The share of answers equal to the expected ones, character for character."""
    return sum(a == e for a, e in zip(answers, expected, strict=True)) / len(expected)


def write_tokenizer(directory: Path) -> None:
    """A character-level tokenizer (``tokenizers`` BPE with no merges) with ChatML's special tokens and template."""
    from tokenizers import Tokenizer, decoders, models

    vocab = {token: i for i, token in enumerate([*SPECIAL, *CHARACTERS])}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.add_special_tokens(SPECIAL)
    tokenizer.decoder = decoders.Fuse()
    tokenizer.save(str(directory / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": SPECIAL[0], "eos_token": SPECIAL[2], "chat_template": CHATML}
    (directory / "tokenizer_config.json").write_text(json.dumps(config))


def write_base(directory: Path, setting: Setting, seed: int) -> None:
    """A random transformers Llama with the character tokenizer: the base, as a downloaded model directory is."""
    import torch
    import transformers

    torch.manual_seed(seed)
    config = transformers.LlamaConfig(vocab_size=len(SPECIAL) + len(CHARACTERS), hidden_size=setting.d_model,
                                      intermediate_size=setting.mlp_dim, num_hidden_layers=setting.num_layers, num_attention_heads=4,
                                      num_key_value_heads=2, max_position_embeddings=setting.seq_len, tie_word_embeddings=False,
                                      bos_token_id=0, eos_token_id=2, initializer_range=setting.init_std)
    transformers.LlamaForCausalLM(config).save_pretrained(directory)
    write_tokenizer(directory)


def write_data(path: Path, words: list[str]) -> None:
    path.write_text("".join(json.dumps(dict(zip(("prompt", "completion"), task(w)))) + "\n" for w in words))


def answers(loaded, words: list[str], max_new_tokens: int) -> list[str]:
    """Greedy answers of the loaded model (jaxtrain.generate) to the held-out prompts, all at once."""
    from jaxtrain import generate
    from jaxtrain.config import SamplingConfig

    prompts = np.array([loaded.encode(task(w)[0]) for w in words], np.int32)
    out = generate.generate(loaded, prompts, SamplingConfig(max_new_tokens=max_new_tokens, temperature=0.0))
    return [loaded.decode(row) for row in out.tokens]


def run(work_dir: Path, seed: int, setting: Setting = Setting()) -> dict:
    """Base, data, LoRA training through the CLI, and held-out exact match before and after; the measurements."""
    from jaxtrain import cli, generate
    from jaxtrain.adapt import lora

    start = time.perf_counter()
    base, run_dir, data = work_dir / "base", work_dir / "run", work_dir / "train.jsonl"
    base.mkdir(parents=True)
    write_base(base, setting, seed)
    train_words, held_out = split_words(setting.train_examples, setting.held_out, seed)
    write_data(data, train_words)
    expected = [task(w)[1] for w in held_out]
    before = exact_match(answers(generate.load(base, chat=True), held_out, WORD_LENGTH + 1), expected)

    train_start = time.perf_counter()
    status = cli.main(["train", "finetune", "--init-from", str(base), "--mesh", "cpu8", "--rules", "fsdp_tp", "--run-dir", str(run_dir),
                       "data.format=sft", f"data.path={data}", f"data.tokenizer={base}", f"data.seq_len={setting.seq_len}",
                       f"data.seed={seed}", "data.val_fraction=0.05", "model.dtype=float32", "model.remat=none",
                       f"model.lora.rank={setting.rank}", f"model.lora.alpha={setting.alpha}", f"optim.lr={setting.lr}",
                       "optim.warmup_steps=10", "optim.weight_decay=0", f"train.steps={setting.steps}",
                       f"train.global_batch={setting.global_batch}", "train.microbatches=1", "train.eval_every=0",
                       "train.eval_batches=1", f"train.seed={seed}", f"checkpoint.every={setting.steps}", "log.every=50",
                       "log.progress=false", "log.tensorboard=false"])
    if status:
        raise RuntimeError(f"jaxtrain train exited with status {status}")
    train_s = time.perf_counter() - train_start

    tuned = lora.with_adapter(generate.load(base, chat=True), run_dir)  # jaxtrain generate BASE --adapter RUN_DIR
    got = answers(tuned, held_out, WORD_LENGTH + 1)
    after = exact_match(got, expected)
    losses = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    eval_loss = [m["eval_loss"] for m in losses if "eval_loss" in m]
    return {"seed": seed, "accuracy_before": before, "accuracy_after": after, "steps": setting.steps, "held_out": len(held_out),
            "train_examples": len(train_words), "final_eval_loss": eval_loss[-1] if eval_loss else None, "train_s": round(train_s, 1),
            "wall_s": round(time.perf_counter() - start, 1), "examples": list(zip(held_out[:3], got[:3]))}


def report(result: dict) -> dict:
    """Print one seed's outcome for the person watching; returns it unchanged."""
    print(f"finetune-demo seed {result['seed']}: held-out exact match {result['accuracy_before']:.0%} before, "
          f"{result['accuracy_after']:.0%} after {result['steps']} LoRA steps (eval loss {result['final_eval_loss']:.4f}); "
          f"training {result['train_s']:.0f} s, all {result['wall_s']:.0f} s; e.g. {result['examples']}", file=sys.stderr, flush=True)
    return result


def _seeds(text: str) -> list[int]:
    try:
        return [int(seed) for seed in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


def main(argv: list[str] | None = None) -> int:
    from jaxtrain.errors import OneLineParser, positive_int

    parser = OneLineParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=_seeds, default=[0], help="comma-separated seeds, one demo each")
    parser.add_argument("--work-dir", type=Path, help="where the bases, data and runs go (a new directory); default a temporary one")
    parser.add_argument("--steps", type=positive_int, default=Setting.steps)
    args = parser.parse_args(argv)
    from jaxtrain.cli import simulate_cpu_devices

    # the run's cpu8 mesh needs 8 devices from jax's start, which scoring the base comes to first (as benchmarks/run.py does)
    simulate_cpu_devices(None)
    setting = dataclasses.replace(Setting(), steps=args.steps)
    with tempfile.TemporaryDirectory(prefix="finetune_demo_") as tmp:
        root = args.work_dir or Path(tmp)
        for seed in args.seeds:
            print(json.dumps(report(run(root / f"seed{seed}", seed, setting))), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
