"""A corpus: the training data as one token stream per split. From text (the Python standard library by
default, a directory of text files, or a JSONL file), encoded as raw bytes or with ``data.tokenizer``,
split by document; or from a token file, split by position.

No jax here: the tokenizer commands start without it.
"""

from __future__ import annotations

import dataclasses
from multiprocessing.connection import Connection
from pathlib import Path

import numpy as np

from jaxtrain.config import DataConfig
from jaxtrain.data.child_process import answer, answered, spawned
from jaxtrain.data.documents import JSONL_SUFFIX, batches, check_split, documents, is_validation_file, stdlib_files, text_files
from jaxtrain.data.token_file import read_token_file
from jaxtrain.data.tokenizer import RawBytes, TextTokenizer, load_tokenizer
from jaxtrain.errors import UserError


@dataclasses.dataclass(frozen=True)
class Corpus:
    train: np.ndarray
    validation: np.ndarray
    vocab_size: int  # the tokens are all < vocab_size (a tokenizer's whole vocabulary when there is one)
    description: str


def load_corpus(cfg: DataConfig) -> Corpus:
    """The token stream of data.format=text (instruction data, data.format=sft, is sft.load_sft's: batches.load_data
    picks)."""
    tokenizer = load_tokenizer(cfg.tokenizer) if cfg.tokenizer else None
    if cfg.path is None:
        root, files = stdlib_files()
        what = f"Python standard library at {root}"
    else:
        root = Path(cfg.path)
        if not root.exists():
            raise UserError(f"data.path={cfg.path} does not exist; give a directory of text files, a {JSONL_SUFFIX} file "
                            "or a token file (.npy, .bin)")
        if root.is_dir():
            files, what = text_files(root), f"text files under {root}"
        elif root.suffix == JSONL_SUFFIX:
            root, files, what = root.parent, [root], f"JSONL file {root}"
        else:
            return _token_file_corpus(root, cfg.val_fraction, tokenizer)
    return _text_corpus(root, files, what, cfg.val_fraction, tokenizer)


def _text_corpus(root: Path, files: list[Path], what: str, val_fraction: float, tokenizer: TextTokenizer | None) -> Corpus:
    """The documents' stream, read and encoded here as bytes, or with ``tokenizer`` in a child process
    (``_encode_in_child``)."""
    if tokenizer is None:
        return _encoded_text(root, files, what, val_fraction, RawBytes())

    def died(status: int | None) -> str:
        return (f"the process tokenizing {what} died (exit status {status}); if it ran out of memory, tokenize the "
                "text into a token file first (jaxtrain tokenize) and give that as data.path")

    with spawned(_encode_in_child, (root, files, what, val_fraction, tokenizer.path), "tokenize-corpus", died) as connection:
        description, (train, validation) = answered(connection, 2)
    return Corpus(train, validation, tokenizer.vocab_size, description)


def _encoded_text(root: Path, files: list[Path], what: str, val_fraction: float, encoding: TextTokenizer | RawBytes) -> Corpus:
    """The documents of ``files`` split by key and encoded with ``encoding``, in this process."""
    splits = {False: [], True: []}
    for doc in documents((root, f) for f in files):
        splits[is_validation_file(doc.key, val_fraction)].append(doc)
    train, val = splits[False], splits[True]
    check_split([d.key for d in train + val], val_fraction, what, "documents")

    def encode(docs):
        return np.concatenate([encoding.encode([d.text for d in batch]) for batch in batches(docs)])

    encoded_as = f"tokenizer {encoding.path}" if isinstance(encoding, TextTokenizer) else "bytes"
    return Corpus(encode(train), encode(val), encoding.vocab_size,
                  f"{what} ({encoded_as}): {len(train)} train / {len(val)} validation documents")


def _encode_in_child(connection: Connection, root: Path, files: list[Path], what: str, val_fraction: float, tokenizer: Path) -> None:
    """The child process of ``_text_corpus``: answers with the corpus's description and its two splits' tokens
    (child_process.answer)."""
    def encode() -> tuple[str, list[np.ndarray]]:
        corpus = _encoded_text(root, files, what, val_fraction, load_tokenizer(tokenizer))
        return corpus.description, [corpus.train, corpus.validation]

    answer(connection, encode, "tokenizing the corpus failed in its process")


def _token_file_corpus(path: Path, val_fraction: float, tokenizer: TextTokenizer | None) -> Corpus:
    file = read_token_file(path, tokenizer)
    split = int(len(file.tokens) * (1 - val_fraction))
    made_with = f", tokenizer {file.tokenizer}" if file.tokenizer else ""
    return Corpus(file.tokens[:split], file.tokens[split:], file.vocab_size, f"token file {path}: {len(file.tokens)} tokens{made_with}")
