"""Token files: ``jaxtrain tokenize`` writes TOKENS.bin (the ids, uint16 or uint32 by vocabulary size) and
TOKENS.bin.json, a sidecar naming the tokenizer, dtype and token count, which training checks against
``data.tokenizer`` and ``model.vocab_size``. A ``.bin`` without a sidecar is raw uint16; a ``.npy`` is any
integer array.

No jax here: the tokenizer commands start without it.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path
from typing import Iterable, Iterator

import numpy as np
from tqdm import tqdm

from jaxtrain.atomic import atomic_file, made_parents, removed_on_failure, sigterm_cleans_up
from jaxtrain.data.documents import TOKEN_FILE_SUFFIXES, batches, input_documents
from jaxtrain.data.tokenizer import TextTokenizer, load_tokenizer, token_dtype
from jaxtrain.errors import UserError

RAW_BIN_DTYPE = np.dtype("<u2")  # a .bin without a sidecar (nanoGPT's convention)
SIDECAR_FORMAT = "jaxtrain-tokens-1"
NPY_MAGIC = b"\x93NUMPY"  # how every .npy file starts (numpy.lib.format)


def sidecar_path(path: Path) -> Path:
    return path.with_name(path.name + ".json")


@dataclasses.dataclass(frozen=True)
class TokenFile:
    tokens: np.ndarray  # memory-mapped
    vocab_size: int  # every id is below it
    tokenizer: str | None  # the tokenizer it was made with, when a sidecar says


def write_token_file(inputs: Iterable[str], tokenizer_path: str, out: str | Path) -> dict:
    """Tokenize every document of ``inputs`` (end-of-text after each) into ``out`` and its sidecar, both
    written atomically; returns the sidecar's contents."""
    out = Path(out)
    if out.suffix != ".bin":
        raise UserError(f"--out {out} must end in .bin (the raw token ids; a .bin.json sidecar goes beside it)")
    if out.exists() or sidecar_path(out).exists():
        raise UserError(f"--out {out} already exists (or its sidecar does); give a new path, or remove them first: "
                        "tokenize never overwrites a token file, which a run may be training on")
    tokenizer = load_tokenizer(tokenizer_path)
    files, source = input_documents(inputs, streamed=True)  # a text file read block by block as it is encoded
    dtype = token_dtype(tokenizer.vocab_size)
    count = docs = 0
    # missing directories are made, as plot --out does, and removed again if a later input fails; the sidecar, renamed
    # first, goes too where the token file's own rename fails after it
    with sigterm_cleans_up(), made_parents(out, "token file"), removed_on_failure(sidecar_path(out)), \
            atomic_file(out, "token file") as f, \
            tqdm(total=sum(path.stat().st_size for _, path in files), unit="B", unit_scale=True, desc="tokenize",
                 disable=None, file=sys.stderr) as progress:  # shown only on a terminal
        def advancing(blocks: Iterable[bytes]) -> Iterator[bytes]:  # a text file's progress as it is read
            for block in blocks:
                progress.update(len(block))
                yield block

        for batch in batches(source, size_of=lambda doc: doc.size):
            texts = [doc.text if isinstance(doc.text, bytes) else advancing(doc.text) for doc in batch]
            for tokens in tokenizer.encode_in_parts(texts):  # a large file's too, part by part
                f.write(tokens.data)  # already of the file's dtype
                count += len(tokens)
            docs += len(batch)
            progress.update(sum(doc.size for doc in batch if isinstance(doc.text, bytes)))  # JSONL lines
        sidecar = {"format": SIDECAR_FORMAT, "dtype": dtype.name, "tokens": count, "documents": docs,
                   "vocab_size": tokenizer.vocab_size, "end_of_text": tokenizer.end_of_text,
                   "tokenizer": str(tokenizer.path.resolve()), "tokenizer_sha256": tokenizer.sha256}
        # the sidecar lands first: a stale one beside an older TOKENS.bin fails the size check below
        with atomic_file(sidecar_path(out), "token file sidecar") as s:
            s.write((json.dumps(sidecar, indent=2) + "\n").encode())
    return sidecar


# what readers take from a sidecar, and its JSON type
SIDECAR_KEYS = {"dtype": str, "tokens": int, "vocab_size": int, "tokenizer": str, "tokenizer_sha256": str}


def _sidecar(path: Path) -> dict | None:
    """The sidecar of the token file ``path``, its keys and types checked once here (None where there is none)."""
    side = sidecar_path(path)
    if not side.exists():
        return None

    def refuse(problem: str):
        raise UserError(f"token file sidecar {side} {problem}; remake it with jaxtrain tokenize")

    if not side.is_file():
        refuse("is not a file")  # else the .bin would be read as raw uint16, its sidecar ignored
    try:
        sidecar = json.loads(side.read_bytes())
    except OSError as e:
        refuse(f"cannot be read ({e.strerror})")
    except ValueError as e:  # JSONDecodeError, or bytes that are not UTF-8
        refuse(f"is not valid JSON ({e.msg if isinstance(e, json.JSONDecodeError) else 'not UTF-8'})")
    if not isinstance(sidecar, dict) or sidecar.get("format") != SIDECAR_FORMAT:
        refuse(f"is not a jaxtrain token file sidecar (format {SIDECAR_FORMAT})")
    for key, kind in SIDECAR_KEYS.items():
        if key not in sidecar:
            refuse(f"is missing '{key}'")
        value = sidecar[key]
        if not isinstance(value, kind) or isinstance(value, bool) or (kind is int and value < 0):
            expected = "a JSON string" if kind is str else "a non-negative JSON integer"
            refuse(f"has '{key}': {json.dumps(value)}, not {expected}")
    if sidecar["dtype"] != token_dtype(sidecar["vocab_size"]).name:  # what tokenize writes for that vocabulary
        refuse(f"has dtype {sidecar['dtype']!r} for vocab_size {sidecar['vocab_size']}, where tokenize writes "
               f"{token_dtype(sidecar['vocab_size']).name} (uint16 for up to 65536 tokens, uint32 above)")
    return sidecar


def tokenizer_of(data_path: str | None) -> str | None:
    """The tokenizer file the sidecar of the token file ``data_path`` names, where both are still there; else None."""
    if data_path is None or Path(data_path).suffix not in TOKEN_FILE_SUFFIXES or not Path(data_path).is_file():
        return None
    sidecar = _sidecar(Path(data_path))
    return sidecar["tokenizer"] if sidecar is not None and Path(sidecar["tokenizer"]).is_file() else None


def _refuse_count(path: Path, holds: str, sidecar: dict, size: str = "") -> None:
    raise UserError(f"token file {path} holds {holds} but its sidecar {sidecar_path(path)} says {sidecar['tokens']} tokens{size}; "
                    "it is truncated or the two are from different runs: remake them with jaxtrain tokenize")


def read_token_file(path: Path, tokenizer: TextTokenizer | None) -> TokenFile:
    """Memory-map a token file, checked against its sidecar (if any) and the run's tokenizer (if any)."""
    sidecar = _sidecar(path)
    if path.suffix not in TOKEN_FILE_SUFFIXES:
        # a lone text file is one document, which the validation split (by document) cannot divide; tokenize needs a tokenizer
        named = (f"--tokenizer {tokenizer.path}" if tokenizer
                 else "--tokenizer TOKENIZER (a tokenizer.json: jaxtrain train-tokenizer makes one)")
        raise UserError(f"data.path={path}: unknown file type; use a directory of text files, a .jsonl file, "
                        "or a token file: .npy (any integer dtype) or .bin (uint16, or as its .bin.json sidecar says); "
                        f"for one text file, jaxtrain tokenize {path} {named} --out DATA.bin, then data.path=DATA.bin (split by position)")
    if sidecar is None and path.suffix == ".bin" and tokenizer and token_dtype(tokenizer.vocab_size).itemsize > RAW_BIN_DTYPE.itemsize:
        # tokenize wrote it as uint32: read as uint16 it trained on halves of ids, without a word (a .bin copied without its sidecar)
        raise UserError(f"token file {path} has no sidecar {sidecar_path(path)}, so it reads as raw uint16, but data.tokenizer="
                        f"{tokenizer.path} has {tokenizer.vocab_size} ids, which jaxtrain tokenize writes as uint32: put the "
                        "sidecar beside it, or remake both with jaxtrain tokenize")
    dtype = RAW_BIN_DTYPE if sidecar is None else np.dtype(sidecar["dtype"]).newbyteorder("<")  # checked by _sidecar
    if sidecar is not None and path.suffix == ".bin" and path.is_file() and path.stat().st_size != sidecar["tokens"] * dtype.itemsize:
        _refuse_count(path, f"{path.stat().st_size} bytes", sidecar, f" ({sidecar['tokens'] * dtype.itemsize} bytes of {dtype.name})")
    expected = "a .npy file of a 1-D integer array (numpy.save)" if path.suffix == ".npy" else f"raw little-endian {dtype.name} tokens"
    try:
        if path.suffix == ".npy":
            with open(path, "rb") as f:
                if f.read(len(NPY_MAGIC)) != NPY_MAGIC:  # else np.load would try to unpickle it
                    raise ValueError("no .npy header")
            tokens = np.load(path, mmap_mode="r", allow_pickle=False)
        elif path.stat().st_size == 0:  # which np.memmap cannot map
            tokens = np.zeros(0, dtype)
        else:
            tokens = np.memmap(path, dtype=dtype, mode="r")
    except (ValueError, OSError) as e:  # truncated, odd byte count, empty, object dtype, unreadable
        reason = (e.strerror if isinstance(e, OSError) else None) or str(e).split(". ")[0]
        raise UserError(f"data.path={path} is not {expected}: {reason}") from None
    if tokens.ndim != 1 or not np.issubdtype(tokens.dtype, np.integer):
        raise UserError(f"data.path={path}: expected a 1-D integer token array, got shape {tokens.shape} dtype {tokens.dtype}")
    if len(tokens) == 0:
        raise UserError(f"data.path={path}: the token file holds 0 tokens; give data.path a token file made from text that holds documents")
    if np.issubdtype(tokens.dtype, np.signedinteger) and (least := int(tokens.min())) < 0:  # the lookup would wrap them
        raise UserError(f"data.path={path} holds negative token ids (the least is {least}); token ids run from 0 to the "
                        "vocabulary size - 1: fix the file")
    largest = int(tokens.max())
    if sidecar is None:
        # without a record of its tokenizer, the ids themselves bound the vocabulary
        vocab_size = max(largest + 1, tokenizer.vocab_size if tokenizer else 0)
        return TokenFile(tokens, vocab_size, None)
    if len(tokens) != sidecar["tokens"]:
        _refuse_count(path, f"{len(tokens)} tokens", sidecar)
    if largest >= sidecar["vocab_size"]:  # the model would be sized to the sidecar, and the ids past it train on NaN
        raise UserError(f"token file {path} holds token ids up to {largest}, not below its sidecar {sidecar_path(path)}'s vocab_size "
                        f"{sidecar['vocab_size']}: the two do not belong together; remake them with jaxtrain tokenize")
    if tokenizer is not None and tokenizer.sha256 != sidecar["tokenizer_sha256"]:
        raise UserError(f"token file {path} was made with tokenizer {sidecar['tokenizer']} (sha256 {sidecar['tokenizer_sha256'][:12]}) "
                        f"but data.tokenizer={tokenizer.path} is another (sha256 {tokenizer.sha256[:12]}); retokenize with "
                        f"'jaxtrain tokenize ... --tokenizer {tokenizer.path}' or set data.tokenizer={sidecar['tokenizer']}")
    return TokenFile(tokens, sidecar["vocab_size"], sidecar["tokenizer"])
