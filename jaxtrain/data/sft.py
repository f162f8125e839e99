"""Instruction data (``data.format=sft``): a JSONL file whose lines are ``{"prompt": ..., "completion": ...}``
or ``{"messages": [{"role": ..., "content": ...}, ...]}``, rendered with the chat template of ``data.tokenizer``
(transformers' own renderer) and tokenized with its tokenizer.json. Only the answers count in the loss: the
completion, or every assistant message, with the template's end-of-turn text after it.

An answer's characters are found by rendering prefixes of the conversation: the text before assistant message
``i`` is the conversation up to it with the generation prompt, the text through it the conversation up to and
including it; both must begin the whole rendering (true of the usual templates). A token counts when its
characters overlap an answer (transformers' rule for ``return_assistant_tokens_mask``).

Examples are packed several to a sequence by grain's best-fit packer, which gives each its segment id (attention
stays inside it) and positions restarting at 0; ``data.pack=false`` puts one example in each sequence. Every
process packs the same global batches and keeps its own rows, so a batch does not depend on the process count, and
the grain iterator's state is the exact data position for checkpoints.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import json
from pathlib import Path
from typing import Iterator

import grain
import numpy as np
from jax.sharding import NamedSharding

from jaxtrain.config import DataConfig
from jaxtrain.data.documents import JSONL_SUFFIX, check_split, check_utf8, is_validation_file, open_readable, utf8_of
from jaxtrain.data.pipeline import SEED_SCHEME, SEED_SCHEMES, SPREAD_SEEDS, GlobalBatches, HostBatches, grain_seed, process_rows
from jaxtrain.data.tokenizer import TextTokenizer, encode_marking_spans, load_tokenizer
from jaxtrain.errors import UserError

ASSISTANT = "assistant"
# what a batch of instruction data holds, (batch, seq_len) each: targets count in the loss where weights is 1
BATCH_FIELDS = {"inputs": np.int32, "targets": np.int32, "weights": np.float32, "segment_ids": np.int32, "positions": np.int32}


@dataclasses.dataclass(frozen=True)
class Example:
    tokens: np.ndarray  # int32, the rendered conversation
    counted: np.ndarray  # bool, per token: part of an answer (a loss target)


@dataclasses.dataclass(frozen=True)
class SftCorpus:
    """The instruction data a run trains on (the counterpart of ``Corpus`` for data.format=sft)."""

    train: list[Example]
    validation: list[Example]
    vocab_size: int
    description: str


class ChatTemplate:
    """The chat template of a tokenizer directory (``chat_template.jinja``, or ``chat_template`` in
    tokenizer_config.json), rendered by transformers exactly as ``apply_chat_template`` does."""

    def __init__(self, tokenizer: TextTokenizer):
        directory = tokenizer.path.parent
        if importlib.util.find_spec("transformers") is None:
            raise UserError("chat templates are rendered with the transformers package (no model code, no torch); "
                            "pip install 'transformers>=4.50' jinja2")
        import transformers

        transformers.logging.set_verbosity_error()  # its notes about tokenizer classes are not the user's concern
        self.hf = transformers.PreTrainedTokenizerFast.from_pretrained(str(directory))
        if self.hf.chat_template is None:
            raise UserError(f"tokenizer {directory} has no chat template (neither chat_template.jinja nor 'chat_template' in "
                            "tokenizer_config.json); use the tokenizer directory of a chat model, or add a template there")
        self.tokenizer = tokenizer

    def render(self, messages: list[dict], where: str, add_generation_prompt: bool = False) -> str:
        import jinja2

        try:
            return self.hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
        except Exception as e:  # noqa: BLE001 - the template's code: its raise_exception (roles it refuses: Mistral's, Gemma's),
            # its syntax, or a Python error it makes (a TypeError from + on a string and a number was a traceback)
            error = e if isinstance(e, jinja2.TemplateError) else f"{type(e).__name__}: {e}"
            raise UserError(f"{where}: the chat template of {self.tokenizer.path.parent} stops with an error: {error}; fix the template, "
                            "or leave out the conversations it refuses") from None

    def prompt_tokens(self, text: str) -> list[int]:
        """A one-turn user prompt ready for the model's answer (``jaxtrain generate --chat``)."""
        rendered = self.render([{"role": "user", "content": text}], "--chat prompt", add_generation_prompt=True)
        return self.tokenizer.tokenizer.encode(rendered, add_special_tokens=False).ids

    def end_of_turn(self) -> int | None:
        """The tokenizer's eos token, where a chat model's answer ends."""
        return self.hf.eos_token_id


def _messages(record, where: str) -> list[dict]:
    """A JSONL record as chat messages: prompt/completion becomes a user and an assistant message."""
    if isinstance(record, dict) and "messages" in record and ("prompt" in record or "completion" in record):
        raise UserError(f"{where} has both 'messages' and 'prompt'/'completion'; which one trains is ambiguous: keep one form per line")
    if isinstance(record, dict) and isinstance(record.get("prompt"), str) and isinstance(record.get("completion"), str):
        return [{"role": "user", "content": record["prompt"]}, {"role": ASSISTANT, "content": record["completion"]}]
    messages = record.get("messages") if isinstance(record, dict) else None
    if messages is None:
        found = f"keys {', '.join(record) or 'none'}" if isinstance(record, dict) else f"a JSON {type(record).__name__}"
        raise UserError(f"{where} has neither 'prompt' and 'completion' strings nor a 'messages' list ({found}); each line of "
                        'data.format=sft data is {"prompt": "...", "completion": "..."} or {"messages": [{"role": "user", "content": "..."}, ...]}')
    if not (isinstance(messages, list) and messages):
        raise UserError(f"{where}: 'messages' must be a non-empty list of objects with string 'role' and 'content', "
                        f"got {json.dumps(messages)}")
    for number, m in enumerate(messages, 1):
        if not (isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)):
            # an OpenAI tool call's message has content null, its call in tool_calls, which templates render in their own ways
            raise UserError(f"{where}: message {number} is not an object with string 'role' and 'content' ({json.dumps(m)[:100]}); "
                            "give every message its text as 'content' (tool calls written into it)")
    roles = [m["role"] for m in messages]
    if ASSISTANT not in roles or roles[0] == ASSISTANT:
        raise UserError(f"{where}: the messages (roles {', '.join(roles)}) need a first message that is not the assistant's "
                        "and at least one assistant message (the answers the loss counts)")
    return messages


def _conversations(path: Path) -> Iterator[tuple[str, list[dict]]]:
    """(key, messages) of every non-empty line; the key ("FILE#LINE") decides the train/validation split."""
    with open_readable(path) as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            where = f"{path}:{number}"
            check_utf8(line, where)
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise UserError(f"{where} is not valid JSON ({e.msg}); each line of a {JSONL_SUFFIX} file must be a JSON object") from None
            messages = _messages(record, where)
            for message in messages:
                utf8_of(message["content"], where)
            yield f"{path.name}#{number}", messages


def _rendered(template: ChatTemplate, messages: list[dict], where: str) -> tuple[str, list[tuple[int, int]]]:
    """The whole conversation's text and the character span of each assistant message."""
    text, spans = template.render(messages, where), []
    for i, message in enumerate(messages):
        if message["role"] != ASSISTANT:
            continue
        before = template.render(messages[:i], where, add_generation_prompt=True)
        through = text if i == len(messages) - 1 else template.render(messages[:i + 1], where)
        if not (text.startswith(before) and text.startswith(through) and len(before) <= len(through)):
            raise UserError(f"{where}: the chat template does not render the conversation up to message {i + 1} as the start of "
                            "the whole conversation, so its answer cannot be located; use a template that renders earlier "
                            "turns unchanged, or split the conversation into one example per answer")
        spans.append((len(before), len(through)))
    return text, spans


def _encode(tokenizer: TextTokenizer, texts: list[str], spans: list[list[tuple[int, int]]]) -> list[Example]:
    return [Example(ids, counted) for ids, counted in encode_marking_spans(tokenizer, texts, spans)]


def _fit(example: Example, where: str, cfg: DataConfig) -> Example:
    """An example of at most seq_len + 1 tokens (inputs and targets are seq_len each): as it is, cut, or an error."""
    limit = cfg.seq_len + 1
    if len(example.tokens) <= limit:
        return example
    if not cfg.truncate:
        raise UserError(f"{where}: the example is {len(example.tokens)} tokens, longer than data.seq_len + 1 = {limit}; "
                        "raise data.seq_len, shorten the example, or set data.truncate=true to cut such examples")
    return Example(example.tokens[:limit], example.counted[:limit])


def load_sft(cfg: DataConfig) -> SftCorpus:
    """Render, tokenize and split the examples of ``data.path``; every check here, before anything is written."""
    if cfg.path is None or Path(cfg.path).suffix != JSONL_SUFFIX or not Path(cfg.path).is_file():
        raise UserError(f"data.format=sft needs data.path=FILE{JSONL_SUFFIX} (an existing JSONL file of prompt/completion or "
                        f"messages), got data.path={cfg.path}")
    if not cfg.tokenizer:
        raise UserError("data.format=sft needs data.tokenizer=DIR: a tokenizer directory with a chat template "
                        "(a Hugging Face chat model's directory holds one)")
    path, tokenizer = Path(cfg.path), load_tokenizer(cfg.tokenizer)
    template = ChatTemplate(tokenizer)
    keys, texts, spans = [], [], []
    for key, messages in _conversations(path):
        text, answer_spans = _rendered(template, messages, f"{path}:{key.rsplit('#', 1)[1]}")
        keys.append(key)
        texts.append(text)
        spans.append(answer_spans)
    splits = {False: [], True: []}
    for key, example in zip(keys, _encode(tokenizer, texts, spans)):
        splits[is_validation_file(key, cfg.val_fraction)].append(_fit(example, f"{path}:{key.rsplit('#', 1)[1]}", cfg))
    check_split(keys, cfg.val_fraction, str(path), "examples")
    train, val = splits[False], splits[True]
    for side, examples in (("train", train), ("validation", val)):
        if not any(e.counted.any() for e in examples):  # a loss over no token: nothing to learn or to measure
            cut = f" once data.truncate=true cut each to data.seq_len + 1 = {cfg.seq_len + 1} tokens" if cfg.truncate else ""
            fix = "raise data.seq_len so the answers fit" if cfg.truncate else "give examples whose answers are not empty"
            raise UserError(f"data: {path}: the {len(examples)} {side} examples keep no answer token{cut}; {fix}")
    counted = sum(int(e.counted.sum()) for e in train)
    total = sum(len(e.tokens) for e in train)
    return SftCorpus(train, val, tokenizer.vocab_size,
                     f"instruction data {path} (chat template of {tokenizer.path.parent}): {len(train)} train / {len(val)} "
                     f"validation examples, {total} train tokens of which {counted} in answers")


# ---------------------------------------------------------------------------------------------
# packing into batches


def _features(example: Example) -> dict[str, np.ndarray]:
    """Inputs and the targets they predict; a target counts when it is an answer token."""
    return {"inputs": example.tokens[:-1], "targets": example.tokens[1:], "weights": example.counted[1:].astype(np.float32)}


def _batch_fields(packed: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    return {"inputs": packed["inputs"], "targets": packed["targets"], "weights": packed["weights"],
            "segment_ids": packed["inputs_segment_ids"], "positions": packed["inputs_positions"]}


def _padded(rows: int, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The last, partial batch of a split filled up with empty sequences (segment 0, nothing counted)."""
    return {name: np.pad(value, ((0, rows - len(value)), (0, 0))) for name, value in batch.items()}


def packed_batches(examples: list[Example], cfg: DataConfig, global_batch: int, *, shuffle_seed: int | None,
                   repeat: bool, seed_scheme: int = SPREAD_SEEDS) -> grain.IterDataset:
    """Global batches (numpy, ``BATCH_FIELDS``) of packed examples: each batch is one round of grain's best-fit
    packer over ``global_batch`` sequences, which the next example no longer fits; without ``repeat``, the last
    round is padded with empty sequences, so every example is in a batch. ``shuffle_seed`` (data.seed) shuffles the
    examples and the packer's rows as ``seed_scheme`` makes it grain's seed."""
    seed = None if shuffle_seed is None else grain_seed(shuffle_seed, seed_scheme)
    ds = grain.MapDataset.source(examples)
    if seed is not None:
        ds = ds.shuffle(seed=seed)
    if repeat:
        ds = ds.repeat()
    lengths = {name: cfg.seq_len for name in ("inputs", "targets", "weights")}
    packed = grain.experimental.BestFitPackIterDataset(
        ds.map(_features).to_iter_dataset(grain.ReadOptions(num_threads=1, prefetch_buffer_size=2)),
        length_struct=lengths, num_packing_bins=global_batch, seed=seed or 0, shuffle_bins=seed is not None,
        meta_features=("targets", "weights"), max_sequences_per_bin=None if cfg.pack else 1)
    return packed.batch(global_batch).map(_batch_fields).map(functools.partial(_padded, global_batch))


def _rows(start: int, stop: int, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    return {name: value[start:stop] for name, value in batch.items()}


class PackedIterator:
    """The grain iterator of one of ``streams`` (the batches under each seed scheme), whose state is grain's with the
    stream's seed scheme beside it (``SEED_SCHEME``, as ``seed_scheme``): set to another scheme's, it reads on in that
    stream."""

    def __init__(self, streams: dict[int, grain.IterDataset]):
        self.streams = streams
        self._read(SPREAD_SEEDS)

    def _read(self, scheme: int) -> None:
        self.seed_scheme = scheme
        # packing runs in a background thread while the devices compute; its state is that of the batches taken
        self.batches = grain.experimental.ThreadPrefetchIterDataset(self.streams[scheme], prefetch_buffer_size=2).__iter__()

    def get_state(self) -> dict:
        return self.batches.get_state() | {SEED_SCHEME: self.seed_scheme}

    def set_state(self, state: dict) -> None:
        state = dict(state)
        scheme = state.pop(SEED_SCHEME)
        if scheme != self.seed_scheme:
            self.batches.close()
            self._read(scheme)
        self.batches.set_state(state)

    def start_prefetch(self) -> None:
        self.batches.start_prefetch()

    def __next__(self) -> dict[str, np.ndarray]:
        return next(self.batches)

    def close(self) -> None:
        """Stop the packing thread."""
        self.batches.close()


class PackedBatches(GlobalBatches):
    """Global batches of packed instruction data; each process packs every batch and keeps its own rows. The grain
    iterator's state between batches is the count of examples read (its source's ``next_index``: a global batch is one
    round of the packer), whatever the batch size that packed them, and the seed scheme that shuffled them."""

    unit = "examples"

    def __init__(self, examples: list[Example], cfg: DataConfig, global_batch: int, sharding: NamedSharding,
                 *, shuffle_seed: int | None, repeat: bool):
        self.global_shape = (global_batch, cfg.seq_len)
        self.sharding = sharding
        block, blocks = process_rows(sharding, self.global_shape)
        per_process = global_batch // blocks

        def rows(scheme: int) -> grain.IterDataset:
            ds = packed_batches(examples, cfg, global_batch, shuffle_seed=shuffle_seed, repeat=repeat, seed_scheme=scheme)
            return ds.map(functools.partial(_rows, block * per_process, (block + 1) * per_process))

        self.iterator = PackedIterator({scheme: rows(scheme) for scheme in SEED_SCHEMES})

    def position(self) -> int:
        return self.iterator.get_state()["parent"]["next_index"]


def train_batches(corpus: SftCorpus, cfg: DataConfig, global_batch: int, sharding: NamedSharding) -> PackedBatches:
    return PackedBatches(corpus.train, cfg, global_batch, sharding, shuffle_seed=cfg.seed, repeat=True)


def eval_batches(corpus: SftCorpus, cfg: DataConfig, global_batch: int, sharding: NamedSharding, count: int) -> HostBatches:
    """The first ``count`` batches of the validation examples in file order: the same every evaluation (in host memory)."""
    batches = PackedBatches(corpus.validation, cfg, global_batch, sharding, shuffle_seed=None, repeat=False)
    return batches.take_to_host(count)
