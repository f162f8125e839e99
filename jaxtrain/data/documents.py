"""Text sources as documents: a text file is one document, each line of a ``.jsonl`` file (a JSON object
with a string ``text``) is one. The default source is the running Python's standard library, which
every machine has. No jax here: the tokenizer commands start without it."""

from __future__ import annotations

import codecs
import itertools
import json
import os
import sysconfig
import zlib
from pathlib import Path
from typing import Callable, Iterable, Iterator, NamedTuple, TypeVar

from jaxtrain.errors import UserError

SKIPPED_STDLIB_DIRS = {"site-packages", "dist-packages", "test", "tests", "idle_test"}
JSONL_SUFFIX = ".jsonl"
TOKEN_FILE_SUFFIXES = (".npy", ".bin")  # token ids (data/token_file.py), never text
BATCH_BYTES = 4 << 20  # text per encoding batch: enough documents to keep every core busy, bounded memory
T = TypeVar("T")
UTF8_CHECK_BYTES = 16 << 20  # text checked for UTF-8 this much at a time (check_utf8)
# a streamed text file read this much at a time (_file_blocks): blocks of 16 MB, each one copied as a piece is cut,
# left glibc's heap 60 MB larger after 200 MB of text
READ_BYTES = 1 << 20


def is_byte_level(tokenizer: str | None, path: str | None) -> bool:
    """Whether a run's text reaches the model as its UTF-8 bytes: no ``data.tokenizer`` and no token file."""
    return not tokenizer and (path is None or Path(path).suffix not in TOKEN_FILE_SUFFIXES)


class Document(NamedTuple):
    key: str  # path relative to its source ("#LINE" for a JSONL line): decides the train/validation split
    text: bytes | Iterator[bytes]  # the text, or a text file's blocks as they are read (documents(streamed=True))
    size: int  # bytes of the source file this document used (progress)


def stdlib_files() -> tuple[Path, list[Path]]:
    """The standard library's ``.py`` files, tests and installed packages left out. A walk that never enters the left-out
    directories: filtering an ``rglob`` listed every file of the interpreter's site-packages first (13,353 entries on a
    machine with its packages there: 0.5-1 s of each `jaxtrain train`'s start); the same files (symbolic links to
    directories not followed, as ``rglob`` does not follow them)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = []
    for folder, subfolders, names in os.walk(root):
        subfolders[:] = [name for name in subfolders if name not in SKIPPED_STDLIB_DIRS]
        files += [Path(folder, name) for name in names if name.endswith(".py")]
    return root, sorted(files)


def unreadable(path: Path | str, error: OSError, what: str = "") -> UserError:
    """The one-line error for a source that exists but cannot be read (permissions, I/O)."""
    return UserError(f"cannot read {what}{path} ({error.strerror or error}); make it readable, or leave it out of the inputs")


def _is_file(path: Path) -> bool:
    try:
        return path.is_file()  # False for broken and looping symbolic links, which are skipped
    except OSError as e:  # a file in a directory that can be listed but not entered
        raise unreadable(path, e) from None


def text_files(root: Path) -> list[Path]:
    """The files under ``root``, hidden ones (and hidden directories) skipped, linked directories followed as linked
    files are (not following them trained on part of the data, without a word); a UserError naming any directory that
    cannot be read, rather than training on part of the data (``Path.rglob`` skips those silently)."""
    def refuse(error: OSError):
        raise unreadable(error.filename, error, "the directory ")

    found, walked = [], set()
    for directory, subdirectories, names in os.walk(root, onerror=refuse, followlinks=True):
        if (real := Path(directory).resolve()) in walked:  # reached again through a link (one back up the tree: a loop)
            subdirectories.clear()
            continue
        walked.add(real)
        # the first path to a directory names its files (keys decide the split): a directory's own before links to it
        subdirectories[:] = sorted((d for d in subdirectories if not d.startswith(".")), key=lambda d: (Path(directory, d).is_symlink(), d))
        found.extend(p for p in (Path(directory, n) for n in names if not n.startswith(".")) if _is_file(p))
    return sorted(found)


SPLIT_BUCKETS = 10_000


def _bucket(relative: str) -> int:
    return zlib.crc32(relative.encode()) % SPLIT_BUCKETS


def is_validation_file(relative: str, val_fraction: float) -> bool:
    """Deterministic split: a document's own key decides, so adding documents moves no others."""
    return _bucket(relative) < val_fraction * SPLIT_BUCKETS


def check_split(keys: list[str], val_fraction: float, what: str, items: str) -> None:
    """A UserError when ``data.val_fraction`` leaves the train or the validation side of ``keys`` (``what``'s
    ``items``) empty, naming a fraction that splits them."""
    if not keys:
        raise UserError(f"data: {what}: no {items}; a train/validation split needs at least 2, so add {items} or give another data.path")
    validation = sum(is_validation_file(k, val_fraction) for k in keys)
    if 0 < validation < len(keys):
        return
    buckets = sorted(_bucket(k) for k in keys)
    counted = f"1 {items[:-1]}" if len(keys) == 1 else f"{len(keys)} {items}"  # items: a plural noun
    problem = f"data: {what}: {counted}, and data.val_fraction={val_fraction} puts " + \
        ("none of them in validation" if not validation else "all of them in validation")
    if buckets[0] == buckets[-1]:  # one key (or keys that hash alike): no fraction splits them
        raise UserError(f"{problem}; a train/validation split needs at least 2, so add {items}")
    fraction = (buckets[0] + 1) / SPLIT_BUCKETS if not validation else buckets[-1] / SPLIT_BUCKETS
    raise UserError(f"{problem}; data.val_fraction={fraction:g} splits them ({'the least' if not validation else 'the most'} "
                    f"it can be), or add {items}")


def input_files(inputs: Iterable[str]) -> list[tuple[Path, Path]]:
    """(root, file) for every file of the inputs: a file is its own; a directory gives its files (hidden ones skipped)."""
    found, names = [], list(inputs)
    for name in names:
        path = Path(name)
        try:
            is_dir, is_file, is_link = path.is_dir(), path.is_file(), path.is_symlink()
        except OSError as e:  # a directory on the way that cannot be entered
            raise unreadable(name, e) from None
        if is_dir:
            found.extend((path, f) for f in text_files(path))
        elif is_file:
            found.append((path.parent, path))
        elif is_link:
            raise UserError(f"input {name} is a broken or looping symbolic link (to {os.readlink(path)}); give the file it was meant to "
                            "point at, or fix the link")
        else:
            raise UserError(f"input {name} does not exist; give text files, .jsonl files or directories of them")
    if not found:
        raise UserError(f"inputs {' '.join(names)} hold no files (hidden ones are skipped); give text files, .jsonl files or directories of them")
    unique, seen = [], set()
    for root, file in found:  # a file named twice (itself and through its directory) is one source, not two
        if file.resolve() not in seen:
            seen.add(file.resolve())
            unique.append((root, file))
    return unique


def input_documents(inputs: Iterable[str], streamed: bool = False) -> tuple[list[tuple[Path, Path]], Iterator[Document]]:
    """The files of ``inputs`` (input_files) and their documents (``documents``); a UserError, before anything is
    written, where they hold none (.jsonl files of blank lines)."""
    names = list(inputs)
    files = input_files(names)
    docs = documents(files, streamed)
    first = next(docs, None)
    if first is None:
        raise UserError(f"inputs {' '.join(names)} hold no documents (blank .jsonl lines are skipped); give text files, "
                        ".jsonl files with a JSON object a line, or directories of them")
    return files, itertools.chain([first], docs)


def utf8_of(text: str, where: str) -> bytes:
    """``text`` as UTF-8; a UserError where JSON's \\u escapes left a lone surrogate, which no encoding holds."""
    try:
        return text.encode()
    except UnicodeEncodeError as e:
        raise UserError(f"{where} holds a lone surrogate (\\u{ord(text[e.start]):04x}, from a JSON escape), which is not "
                        "text; remove it or write the character it was meant to be half of") from None


def utf8_blocks(blocks: Iterable[bytes], where: str) -> Iterator[bytes]:
    """``blocks``, consecutive parts of one text, each checked as it passes: a UserError naming the first byte that
    is not UTF-8 at its offset in the text (a character may span two blocks); the tokenizer would replace it silently."""
    decoder = codecs.getincrementaldecoder("utf-8")()
    read = 0  # bytes given to the decoder

    def decode(block: bytes, final: bool = False) -> None:
        try:
            decoder.decode(block, final)
        except UnicodeDecodeError as e:  # e.object: the text's last bytes read (the decoder holds back an unfinished character)
            raise UserError(f"{where} is not UTF-8 text (byte 0x{e.object[e.start]:02x} at offset {read - len(e.object) + e.start}); "
                            "convert it (iconv -f ITS_ENCODING -t UTF-8) or leave it out") from None

    for block in blocks:
        read += len(block)
        decode(block)
        yield block
    decode(b"", final=True)


def check_utf8(data: bytes, where: str) -> None:
    """utf8_blocks on ``data`` UTF8_CHECK_BYTES at a time: decoded whole, a large file's text took its size again
    in memory."""
    for _ in utf8_blocks((data[start:start + UTF8_CHECK_BYTES] for start in range(0, len(data), UTF8_CHECK_BYTES)), where):
        pass


def open_readable(path: Path):  # a UserError, not a traceback, where it cannot be read (text, JSONL, instruction data)
    try:
        return path.open("rb")
    except OSError as e:
        raise unreadable(path, e) from None


JSON_TYPES = {  # what JSON calls each type json.loads returns
    dict: "object", list: "array", str: "string", bool: "boolean", int: "number", float: "number", type(None): "null"}


def _jsonl_documents(path: Path, key: str) -> Iterator[Document]:
    with open_readable(path) as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            check_utf8(line, f"{path}:{number}")
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise UserError(f"{path}:{number} is not valid JSON ({e.msg}); each line of a {JSONL_SUFFIX} file must be a JSON object") from None
            text = record.get("text") if isinstance(record, dict) else None
            if not isinstance(text, str):
                if isinstance(record, dict) and "text" in record:
                    problem = f"has 'text' as a JSON {JSON_TYPES[type(text)]}, not a string"
                else:
                    found = f"keys {', '.join(record)}" if isinstance(record, dict) else f"a JSON {JSON_TYPES[type(record)]}"
                    problem = f"has no string 'text' field ({found})"
                raise UserError(f"{path}:{number} {problem}; each line of a {JSONL_SUFFIX} file must be a JSON object with the "
                                "document in 'text'")
            yield Document(f"{key}#{number}", utf8_of(text, f"{path}:{number}"), len(line))


def _file_blocks(path: Path) -> Iterator[bytes]:
    """A text file's bytes, READ_BYTES at a time, each checked as UTF-8 (utf8_blocks); opened when first read."""
    with open_readable(path) as f:
        yield from utf8_blocks(iter(lambda: f.read(READ_BYTES), b""), str(path))


def documents(files: Iterable[tuple[Path, Path]], streamed: bool = False) -> Iterator[Document]:
    """The documents of (root, file) pairs, in order. ``streamed``: a text file's text is its blocks as they are read
    (``_file_blocks``), for a reader that never needs it whole (tokenize: a single file of many GB is common)."""
    for root, path in files:
        key = path.relative_to(root).as_posix()
        if path.suffix == JSONL_SUFFIX:
            yield from _jsonl_documents(path, key)
        elif path.suffix in TOKEN_FILE_SUFFIXES:
            raise UserError(f"{path} is a token file ({path.suffix}), not text: train on it with data.path={path}, "
                            "or leave it out of the text inputs")
        elif streamed:
            yield Document(key, _file_blocks(path), path.stat().st_size)
        else:
            with open_readable(path) as f:
                text = f.read()
            check_utf8(text, str(path))
            yield Document(key, text, len(text))


def batches(docs: Iterable[T], max_bytes: int = BATCH_BYTES, size_of: Callable[[T], int] = lambda doc: len(doc.text)) -> Iterator[list[T]]:
    """Consecutive documents (or other pieces of text, ``size_of`` bytes each) in groups of about ``max_bytes`` of text."""
    batch, size = [], 0
    for doc in docs:
        batch.append(doc)
        size += size_of(doc)
        if size >= max_bytes:
            yield batch
            batch, size = [], 0
    if batch:
        yield batch
