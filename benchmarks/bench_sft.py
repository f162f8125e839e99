"""Instruction data (``data.format=sft``): how full the sequences are with and without packing, and how fast
examples are rendered and packed. One run, same examples:

- ``sft_fill_packed`` / ``sft_fill_unpacked``: share of the batch's token slots holding an example's token (not
  padding), over one epoch of ``EXAMPLES`` generated examples at ``SEQ_LEN`` (grain's best-fit packer with
  ``GLOBAL_BATCH`` bins vs one example per sequence, ``data.pack=false``); ``sft_pack_fill_ratio`` their ratio:
  how many more example tokens a step trains on when packed.
- ``sft_answer_share``: share of the example tokens the loss counts (the answers).
- ``sft_load_examples_per_s``: rendering with the chat template (transformers' renderer, two renders per
  prompt/completion example: the whole, and the text before the answer) and tokenizing;
  ``sft_pack_examples_per_s``: packing into batches (grain), both on this machine's one Python thread.
- ``sft_epoch_count_examples_per_s``: ``train.epochs`` counted into steps at a run's start (``steps_for_epochs``:
  the run's own packed batches, its packing thread and row split included, run over one epoch of the examples),
  which a run given ``train.epochs`` on instruction data waits for at every start.

Examples: prompt and answer lengths drawn from log-normal distributions (median about 60 and 120 words, as
chat data is long-tailed), words from a fixed list; a byte-level BPE of ``VOCAB`` tokens trained on them,
a plain-text chat template. Writes under a temporary directory; deletes what it wrote.
"""

from __future__ import annotations

import dataclasses
import json
import tempfile
import time
from pathlib import Path

import numpy as np

from jaxtrain.config import DataConfig
from jaxtrain.data import sft, steps_for_epochs, train_tokenizer

EXAMPLES = 2000
SEQ_LEN = 1024
GLOBAL_BATCH = 16
VOCAB = 2048
WORDS = ("the of and to in is was for on that with as by at from his an were are which this be or has had not but "
         "one all new first two after who their its also been they more when time into year only other three over most "
         "city may then some state these such would people where school world during team part made through many").split()
TEMPLATE = ("{% for m in messages %}{{ '### ' + m['role'] + ':\\n' + m['content'] + '\\n<|endoftext|>\\n' }}{% endfor %}"
            "{% if add_generation_prompt %}{{ '### assistant:\\n' }}{% endif %}")


def _examples(directory: Path) -> Path:
    rng = np.random.default_rng(0)

    def text(median: float) -> str:
        count = int(min(max(rng.lognormal(np.log(median), 0.8), 1), 380))
        return " ".join(rng.choice(WORDS, count))

    path = directory / "train.jsonl"
    path.write_text("".join(json.dumps({"prompt": text(60), "completion": text(120)}) + "\n" for _ in range(EXAMPLES)))
    return path


def _fill(examples: list[sft.Example], cfg: DataConfig) -> tuple[float, float]:
    """(share of token slots holding example tokens, seconds) over one pass of the examples."""
    start = time.perf_counter()
    segments = np.concatenate([b["segment_ids"] for b in sft.packed_batches(examples, cfg, GLOBAL_BATCH, shuffle_seed=None, repeat=False)])
    return float((segments > 0).mean()), time.perf_counter() - start


def run() -> dict:
    with tempfile.TemporaryDirectory() as temp:
        directory = Path(temp)
        path = _examples(directory)
        (directory / "words.txt").write_text(" ".join(WORDS * 50))
        train_tokenizer([str(directory / "words.txt")], VOCAB, directory / "tok")
        config = json.loads((directory / "tok" / "tokenizer_config.json").read_text())
        (directory / "tok" / "tokenizer_config.json").write_text(json.dumps(config | {"chat_template": TEMPLATE}))
        cfg = DataConfig(path=str(path), tokenizer=str(directory / "tok"), seq_len=SEQ_LEN, val_fraction=0.01, format="sft")
        start = time.perf_counter()
        corpus = sft.load_sft(cfg)
        load_s = time.perf_counter() - start
        examples = corpus.train + corpus.validation
        packed, pack_s = _fill(examples, cfg)
        unpacked, _ = _fill(examples, dataclasses.replace(cfg, pack=False))
        start = time.perf_counter()
        steps_for_epochs(corpus, cfg, GLOBAL_BATCH, _one_device_rows(), 1)
        count_s = time.perf_counter() - start
        tokens = sum(len(e.tokens) for e in examples)
        return {
            "sft_fill_packed": round(packed, 4), "sft_fill_unpacked": round(unpacked, 4),
            "sft_pack_fill_ratio": round(packed / unpacked, 2),
            "sft_answer_share": round(sum(int(e.counted.sum()) for e in examples) / tokens, 3),
            "sft_mean_example_tokens": round(tokens / len(examples), 1),
            "sft_load_examples_per_s": round(len(examples) / load_s), "sft_pack_examples_per_s": round(len(examples) / pack_s),
            "sft_epoch_count_examples_per_s": round(len(corpus.train) / count_s),
        }


def _one_device_rows():
    import jax
    from jax.sharding import NamedSharding, PartitionSpec

    mesh = jax.make_mesh((1,), ("data",), devices=jax.devices()[:1], axis_types=(jax.sharding.AxisType.Auto,))
    return NamedSharding(mesh, PartitionSpec("data", None))


if __name__ == "__main__":
    print(json.dumps(run(), indent=1))
