"""Tokenizers through the Hugging Face ``tokenizers`` library: load one (``data.tokenizer``), train a
byte-level BPE (``jaxtrain train-tokenizer``), and the files a Hugging Face model directory carries
for it. Raw bytes (vocabulary 256, NUL between documents) remain the default encoding.

No jax here: the tokenizer commands start without it.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import itertools
import json
import re
import sys
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Iterable, Iterator

import numpy as np
import tokenizers
from tokenizers import decoders, models, pre_tokenizers, processors, trainers

from jaxtrain.atomic import atomic_dir, sigterm_cleans_up
from jaxtrain.data.child_process import answer, answered, received_batches, send_batches, spawned
from jaxtrain.data.documents import BATCH_BYTES, Document, batches, input_documents
from jaxtrain.errors import UserError

TOKENIZER_FILE = "tokenizer.json"
CONFIG_FILE = "tokenizer_config.json"
# files beside tokenizer.json that transformers reads; an exported model directory carries those present
SPECIAL_TOKENS_FILE = "special_tokens_map.json"
HF_SIDE_FILES = (CONFIG_FILE, SPECIAL_TOKENS_FILE, "added_tokens.json", "chat_template.jinja")
END_OF_TEXT = "<|endoftext|>"  # the one special token of a trained tokenizer: document separator, bos and eos
# how tokenizer families spell their document separator (GPT-2 / Qwen2, Llama 3, Llama 2 / Mistral, Gemma)
END_OF_TEXT_NAMES = (END_OF_TEXT, "<|end_of_text|>", "</s>", "<eos>")
# 64 times the largest vocabularies models use (Gemma's 262,144), and ids that uint32 token files hold; the trainer
# allocates for every token asked for up front (2**31 aborted asking for 141 GB)
MAX_VOCAB_SIZE = 1 << 24
# BPE training time grows with the square of a pre-token's length (measured, vocabulary 300: 10k characters
# 0.06 s, 100k 5 s, 200k 36 s, 5M unfinished after 12 minutes); words and code stay far below
MAX_PRE_TOKEN = 10_000
# the runs the byte-level pre-tokenizer (GPT-2's pattern) keeps whole: letters, digits, other symbols, whitespace;
# each must start where its class starts, so that a long run is scanned once, not from each of its characters
_CLASSES = (r"[^\W\d_]", r"\d", r"(?:[^\s\w]|_)", r"\s")
LONG_PRE_TOKEN = re.compile("|".join(f"(?<!{c}){c}{{{MAX_PRE_TOKEN + 1},}}" for c in _CLASSES))
LONG_WHITESPACE = re.compile(rf"\s{{{MAX_PRE_TOKEN + 1}}}")
# a document longer than 2 pieces is encoded in pieces of about this many bytes (TextTokenizer._pieces), each cut
# checked by encoding this much text on either side apart and together, trying at most CUT_TRIES places
PIECE_BYTES = 1 << 18  # 16 pieces to a batch of BATCH_BYTES: the library encodes them in parallel
CUT_CONTEXT = 512
CUT_TRIES = 16
CUT_CANDIDATES = re.compile(rb"(?<=\S)[ \n]")  # at ASCII whitespace: never inside a UTF-8 character
READ_ON = -1  # _cut's answer where the text read so far has too few places to try: the next block may have them


def token_dtype(vocab_size: int) -> np.dtype:
    """The smallest unsigned type that holds every id: token files and corpora stay at 2 bytes a token where they can."""
    return np.dtype(np.uint16 if vocab_size <= 1 << 16 else np.uint32)


@dataclasses.dataclass(frozen=True)
class RawBytes:
    """The default encoding: a document's bytes, NUL (which never occurs in text files) after each."""

    vocab_size: int = 256
    end_of_text: int = 0

    def encode(self, texts: list[bytes]) -> np.ndarray:
        return np.frombuffer(b"\0".join([*texts, b""]), np.uint8)


@dataclasses.dataclass(frozen=True)
class TextTokenizer:
    """A loaded ``tokenizer.json``. ``sha256`` (of its canonical JSON) names it in token-file sidecars."""

    path: Path  # the tokenizer.json
    tokenizer: tokenizers.Tokenizer
    sha256: str
    end_of_text: int

    @functools.cached_property
    def vocab_size(self) -> int:
        """Its largest id + 1, which every id is below; the count of its tokens (``get_vocab_size``) is less where ids
        are left unused."""
        return max(self.tokenizer.get_vocab(with_added_tokens=True).values()) + 1

    def encode(self, texts: list[bytes]) -> np.ndarray:
        """The documents' tokens, the end-of-text token after each."""
        return np.concatenate([np.zeros(0, token_dtype(self.vocab_size)), *self.encode_in_parts(texts)])

    def encode_in_parts(self, texts: Iterable[bytes | Iterable[bytes]]) -> Iterator[np.ndarray]:
        """``encode``'s tokens, in consecutive parts of at most BATCH_BYTES of text each: encoded in parallel on all
        cores (``encode_batch_fast``: no character offsets, which training never reads), a long document in pieces
        (``_pieces``). A text may be given as its consecutive blocks (a file as it is read: documents(streamed=True))."""
        dtype = token_dtype(self.vocab_size)
        pieces = (piece for text in texts for piece in self._pieces([text] if isinstance(text, bytes) else text))
        for group in batches(pieces, BATCH_BYTES, lambda piece: len(piece[0])):
            encodings = self.tokenizer.encode_batch_fast([text.decode("utf-8", "replace") for text, _ in group], add_special_tokens=False)
            part = []
            for (_, last), encoding in zip(group, encodings, strict=True):
                part.append(np.asarray(encoding.ids, dtype))
                if last:
                    part.append(np.array([self.end_of_text], dtype))
            yield np.concatenate(part)

    def _pieces(self, blocks: Iterable[bytes]) -> Iterator[tuple[bytes, bool]]:
        """A text, given as its consecutive blocks, in pieces of about PIECE_BYTES, each with whether it ends the text,
        cut only where the tokens do not change: the library holds about 600 bytes per token while it encodes one text
        (a 51 MB file took 7.9 GB), so a large file encoded whole took memory 150 times its size. Cut as it is read, a
        file is never held whole either, unless no cut is found (the rest is then one piece)."""
        blocks = iter(blocks)
        text, start, cutting = b"", 0, True
        for block in itertools.chain(blocks, [None]):
            complete = block is None
            if not complete:
                text, start = text[start:] + block, 0
            # a cut in text still being read is checked only where the CUT_CONTEXT bytes after it have been read
            read_ahead = 0 if complete else CUT_CONTEXT
            while cutting and len(text) - start > 2 * PIECE_BYTES + read_ahead:
                cut = self._cut(text, start + PIECE_BYTES, len(text) - read_ahead, complete)
                if cut == READ_ON:
                    break
                if cut is None:
                    text, start, cutting = b"".join([text[start:], *blocks]), 0, False
                else:
                    yield text[start:cut], False
                    start = cut
        yield text[start:], True

    def _cut(self, text: bytes, after: int, end: int, complete: bool) -> int | None:
        """The first place from ``after`` (and before ``end``) before a space or newline that follows other text
        (where pre-tokenizers split) at which this tokenizer encodes the CUT_CONTEXT bytes on either side, apart, as it
        does together; None where CUT_TRIES such places are not (a tokenizer that marks where a text begins, as
        SentencePiece's prefix space does, changes at every cut: its documents are encoded whole); READ_ON where the
        text is not ``complete`` and fewer places lie before ``end``, none of them one (a long run without spaces)."""
        candidates = [found.start() for found in itertools.islice(CUT_CANDIDATES.finditer(text, after, end), CUT_TRIES)]
        for cut in candidates:
            left, right = (side.decode("utf-8", "replace") for side in (text[cut - CUT_CONTEXT:cut], text[cut:cut + CUT_CONTEXT]))
            together, *apart = self.tokenizer.encode_batch_fast([left + right, left, right], add_special_tokens=False)
            if together.ids == apart[0].ids + apart[1].ids:
                return cut
        return READ_ON if len(candidates) < CUT_TRIES and not complete else None


def _tokenizer_json(path: str | Path) -> Path:
    """The tokenizer.json that ``path`` (the file, or a directory holding it) names."""
    path = Path(path)
    file = path / TOKENIZER_FILE if path.is_dir() else path
    if not file.is_file():
        what = f"directory {path} holds no {TOKENIZER_FILE}" if path.is_dir() else f"tokenizer {path} not found"
        raise UserError(f"{what}: give a {TOKENIZER_FILE} or a directory holding one (jaxtrain train-tokenizer makes one)")
    return file


def _end_of_text_id(tokenizer: tokenizers.Tokenizer, file: Path) -> int:
    names = list(END_OF_TEXT_NAMES)
    config = file.parent / CONFIG_FILE
    if config.is_file():  # the family's own end-of-sequence token, when none of the usual spellings exists
        try:
            settings = json.loads(config.read_bytes())
        except ValueError as e:  # JSONDecodeError, or bytes that are not UTF-8
            reason = e.msg if isinstance(e, json.JSONDecodeError) else "not UTF-8"
            raise UserError(f"tokenizer config {config} is not valid JSON ({reason}); fix it (transformers reads it too)") from None
        eos = settings.get("eos_token") if isinstance(settings, dict) else None
        names.append(eos.get("content") if isinstance(eos, dict) else eos)
    for name in filter(None, names):
        if (token := tokenizer.token_to_id(name)) is not None:
            return token
    raise UserError(f"tokenizer {file} has no end-of-text token to put between documents (looked for {', '.join(filter(None, names))}); "
                    f"add one as a special token, or set eos_token in {config}")


def load_tokenizer(path: str | Path) -> TextTokenizer:
    """Load ``data.tokenizer`` (a tokenizer.json, or a directory holding one, like a Hugging Face model directory)."""
    file = _tokenizer_json(path)
    try:
        tokenizer = tokenizers.Tokenizer.from_file(str(file))
    except Exception as e:  # the library reports a malformed file as a plain Exception
        raise UserError(f"tokenizer {file} could not be read: {str(e).splitlines()[0]}") from None
    return TextTokenizer(file, tokenizer, hashlib.sha256(tokenizer.to_str().encode()).hexdigest(), _end_of_text_id(tokenizer, file))


def hf_tokenizer_files(path: str | Path) -> dict[str, bytes]:
    """File name -> contents of the tokenizer files a Hugging Face model directory needs so that
    ``AutoTokenizer.from_pretrained`` loads it: tokenizer.json, the side files found beside it, and a
    tokenizer_config.json naming the end-of-text token when there is none."""
    tokenizer = load_tokenizer(path)
    files = {TOKENIZER_FILE: tokenizer.path.read_bytes()}
    files |= {name: (tokenizer.path.parent / name).read_bytes() for name in HF_SIDE_FILES if (tokenizer.path.parent / name).is_file()}
    if CONFIG_FILE not in files:
        files[CONFIG_FILE] = _hf_config(tokenizer.tokenizer.id_to_token(tokenizer.end_of_text))
    return files


def _json_object(files: dict[str, bytes], name: str) -> dict:
    """The JSON object in the tokenizer side file ``name`` ({} where there is none); a damaged one was a traceback."""
    try:
        body = json.loads(files.get(name, b"{}"))
    except ValueError as e:  # JSONDecodeError, or bytes that are not UTF-8
        raise UserError(f"the {name} to export is not valid JSON ({e}); fix it beside {TOKENIZER_FILE} "
                        "(transformers reads it too)") from None
    if not isinstance(body, dict):
        raise UserError(f"the {name} to export must hold a JSON object, got {type(body).__name__}; fix it beside {TOKENIZER_FILE}")
    return body


def special_token_ids(files: dict[str, bytes]) -> dict[str, int | None]:
    """``bos_token_id`` / ``eos_token_id`` of a Hugging Face model directory's tokenizer files (``hf_tokenizer_files``):
    the ids in tokenizer.json of the ``bos_token`` / ``eos_token`` that tokenizer_config.json (else the older
    special_tokens_map.json) names; None where neither names one."""
    try:
        tokenizer = tokenizers.Tokenizer.from_str(files[TOKENIZER_FILE].decode())
    except Exception as e:  # the library reports a malformed file as a plain Exception
        raise UserError(f"the {TOKENIZER_FILE} to export could not be read for its bos/eos ids: {str(e).splitlines()[0]}") from None
    config = _json_object(files, SPECIAL_TOKENS_FILE) | _json_object(files, CONFIG_FILE)
    ids = {}
    for role in ("bos", "eos"):
        token = config.get(f"{role}_token")
        token = token.get("content") if isinstance(token, dict) else token
        ids[f"{role}_token_id"] = None if token is None else tokenizer.token_to_id(token)
    return ids


def _hf_config(end_of_text: str) -> bytes:
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": end_of_text, "eos_token": end_of_text,
              "clean_up_tokenization_spaces": False, "model_max_length": 1 << 30}
    return (json.dumps(config, indent=2) + "\n").encode()


def train_tokenizer(inputs: Iterable[str], vocab_size: int, out: str | Path) -> TextTokenizer:
    """Train a byte-level BPE (GPT-2 style: any text encodes, no unknown token) on the documents of
    ``inputs`` and write it to the directory ``out`` (tokenizer.json + tokenizer_config.json), atomically."""
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    if vocab_size < len(alphabet) + 1:
        raise UserError(f"--vocab-size {vocab_size} is too small: a byte-level BPE needs the {len(alphabet)} bytes "
                        f"and {END_OF_TEXT}, at least {len(alphabet) + 1}")
    if vocab_size > MAX_VOCAB_SIZE:
        raise UserError(f"--vocab-size {vocab_size} is too large: at most {MAX_VOCAB_SIZE} (2**24), 64 times the largest "
                        "vocabularies models use (about 256k); the trainer allocates memory for every token asked for")
    _, docs = input_documents(inputs, streamed=True)  # a text file read block by block, trained on in pieces
    with sigterm_cleans_up(), atomic_dir(Path(out), "tokenizer directory") as temp:
        # written here, not in the trainer's process: a full disk is then this process's OSError, one line (the library's
        # save raised its own error in the child, a traceback)
        (temp / TOKENIZER_FILE).write_text(_train_in_child(_checked_texts(docs), vocab_size), encoding="utf-8")
        (temp / CONFIG_FILE).write_bytes(_hf_config(END_OF_TEXT))
    return load_tokenizer(out)


def _checked_texts(docs: Iterable[Document]) -> Iterator[str]:
    """The documents' texts, a text file's (given as its blocks) in pieces (``_training_pieces``); a UserError where
    one holds a pre-token too long to train on in reasonable time."""
    for doc in docs:
        start = 0  # characters of the document before the piece
        for piece in [doc.text] if isinstance(doc.text, bytes) else _training_pieces(doc.text):
            text = piece.decode("utf-8", "replace")
            # only a stretch without whitespace that long (or such a whitespace run) can hold one; str.split finds those
            # several times faster than LONG_PRE_TOKEN searches (stdlib, 12 MB: 0.3 s against 2.7 s on 2 slow cores)
            could_hold = max(map(len, text.split()), default=0) > MAX_PRE_TOKEN or LONG_WHITESPACE.search(text)
            if could_hold and (match := LONG_PRE_TOKEN.search(text)):
                raise UserError(f"document {doc.key} holds a run of {len(match[0])} characters of one kind (letters, digits, symbols "
                                f"or whitespace) at character {start + match.start()}; BPE training time grows with the square of "
                                f"such a run's length (5 million characters: unfinished after 12 minutes), so at most {MAX_PRE_TOKEN} "
                                "are taken: split it with spaces or leave the document out")
            start += len(text)
            yield text


def _training_pieces(blocks: Iterable[bytes]) -> Iterator[bytes]:
    """A text given as its blocks, in pieces cut before the last space or newline of what has been read that follows
    a printable ASCII character: the byte-level pre-tokenizer always splits there and matches on from it as it does
    in the whole text, so the pieces hold the whole text's pre-tokens (and a run of one kind lies in one piece) and
    train the same BPE (test). Read whole, a large file took its size as bytes, again as text (4 bytes a character
    where one is beyond U+FFFF) and again in the message to the trainer's process."""
    held = b""
    for block in blocks:
        held += block
        end = len(held)
        while (cut := max(held.rfind(b" ", 0, end), held.rfind(b"\n", 0, end))) > 0 and not 0x21 <= held[cut - 1] <= 0x7e:
            end = cut
        if cut > 0:
            yield held[:cut]
            held = held[cut:]
    yield held


def encode_marking_spans(tokenizer: TextTokenizer, texts: list[str],
                         spans: list[list[tuple[int, int]]]) -> list[tuple[np.ndarray, np.ndarray]]:
    """Each text's token ids (int32) and, per token, whether it overlaps one of the text's character ``spans`` (the
    answers of instruction data), encoded in a child process (child_process.py: on a CPU, this process's malloc
    slowed the library's threads 3x)."""
    def died(status: int | None) -> str:
        return (f"the process tokenizing {len(texts)} texts died (exit status {status}); if it ran out of memory, give "
                "fewer or shorter examples")

    with spawned(_encode_marking_spans, (tokenizer.path,), "tokenize-examples", died) as connection:
        send_batches(connection, zip(texts, spans, strict=True), lambda item: len(item[0]))
        _, (lengths, ids, marked) = answered(connection, 3)
    ends = np.cumsum(lengths)[:-1]
    return list(zip(np.split(ids, ends), np.split(marked, ends), strict=True))


def _encode_marking_spans(connection: Connection, tokenizer: Path) -> None:
    """The child process of ``encode_marking_spans``: answers with each text's token count, the texts' ids and
    their marks, each concatenated (child_process.answer)."""
    def encode() -> tuple[None, list[np.ndarray]]:
        items = list(received_batches(connection))  # all of them before any answer
        encodings = load_tokenizer(tokenizer).tokenizer.encode_batch([text for text, _ in items], add_special_tokens=False)
        ids, marked = [np.zeros(0, np.int32)], [np.zeros(0, bool)]
        for encoding, (_, text_spans) in zip(encodings, items, strict=True):
            offsets = np.asarray(encoding.offsets, np.int64).reshape(-1, 2)
            ids.append(np.asarray(encoding.ids, np.int32))
            marked.append(np.zeros(len(offsets), bool))
            for start, end in text_spans:
                marked[-1] |= (offsets[:, 1] > start) & (offsets[:, 0] < end)
        return None, [np.array([len(i) for i in ids[1:]], np.int64), np.concatenate(ids), np.concatenate(marked)]

    answer(connection, encode, "tokenizing the instruction data failed in its process")


def _train_in_child(texts: Iterator[str], vocab_size: int) -> str:
    """Train on ``texts`` (read and checked here, sent on in batches) in a child process that sends back the tokenizer's
    JSON, and which a signal to this process kills at once: the Rust trainer never looks at signals, so
    Ctrl-C waited for it to finish (minutes to hours on long pre-tokens), and a thread left running it now and then
    aborted the interpreter's exit ("FATAL: exception not rethrown", 1 Ctrl-C in 16)."""
    def died(status: int | None) -> str:
        return (f"the tokenizer trainer's process died (exit status {status}); if it ran out of memory, give fewer or "
                "smaller inputs or a smaller --vocab-size")

    with spawned(_train_bpe, (vocab_size,), "train-tokenizer", died) as connection:
        send_batches(connection, texts, len)
        trained, _ = answered(connection, 0)
    return trained


def _train_bpe(connection: Connection, vocab_size: int) -> None:
    """The child process of ``_train_in_child``: train on the texts it is sent (a None after the last batch) and
    answer with the tokenizer's JSON (child_process.answer)."""

    def train() -> tuple[str, list]:
        bpe = tokenizers.Tokenizer(models.BPE())
        bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        bpe.decoder = decoders.ByteLevel()
        bpe.post_processor = processors.ByteLevel(trim_offsets=False)
        trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[END_OF_TEXT],
                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=sys.stderr.isatty())
        bpe.train_from_iterator(received_batches(connection), trainer)
        return bpe.to_str(pretty=True), []  # as Tokenizer.save writes it

    answer(connection, train, "training the tokenizer failed in its process")
