"""Tokenizing throughput of ``jaxtrain tokenize`` against a plain ``tokenizers`` loop, on the same files in
the same run, interleaved (each round runs both, so a busy machine slows both alike):

- ``tokenize_mb_per_s``: megabytes (10^6 bytes) of input text per second of the whole command, process
  start, file reading, encoding on all cores, writing TOKENS.bin and its sidecar included.
- ``tokenize_baseline_mb_per_s``: a Python process that reads the same files and calls
  ``Tokenizer.encode_batch`` on batches of 256 documents, keeping nothing (the library's own speed).
- ``tokenize_ratio``: the two's ratio, median over rounds (goal >= 0.8).
- ``tokenize_fast_baseline_mb_per_s``, ``tokenize_ratio_vs_fast``: the same loop with ``encode_batch_fast``
  (no character offsets), which jaxtrain itself calls: the ratio is then jaxtrain's own overhead.
- ``tokenize_single_file_peak_rss_mb``: the peak RSS of ``jaxtrain tokenize`` and of ``jaxtrain
  train-tokenizer`` (its own process, not its BPE trainer's) on one file of those inputs and on one of
  ``SINGLE_FILE_COPIES`` of them: both read a text file block by block, so the larger file should add nothing (read
  whole, it added its size, and to train-tokenizer many times it).
- ``train_start_encode_s``, ``train_start_encode_speedup``: the same files as a run's ``data.path`` with
  ``data.tokenizer``, encoded as ``jaxtrain train`` starts on a CPU (its malloc keeps one arena for every thread,
  ``JAXTRAIN_HOST_MALLOC=keep``; jax started): seconds of ``load_corpus``, which encodes them in a child process, and
  of the same encoding in the run's own process (as before 2026-12-07), interleaved; the speedup is their ratio.

Input: the first ``INPUT_BYTES`` of the Python standard library's source (the default corpus), with a
byte-level BPE of ``VOCAB`` tokens trained on part of it by ``jaxtrain train-tokenizer``.
Writes under a temporary directory; deletes what it wrote.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from jaxtrain.data import stdlib_files, train_tokenizer

INPUT_BYTES = 8_000_000
TRAIN_BYTES = 4_000_000
VOCAB = 16_384
ROUNDS = 3
FAILURE_STDERR_LINES = 20
FAILURE_COMMAND_CHARS = 300
SINGLE_FILE_COPIES = 4
SINGLE_FILE_VOCAB = 1024  # train-tokenizer's part: the reading is measured, not the merges
# a child's peak RSS: RUSAGE_CHILDREN is the largest of all of a process's children, so each is run from one of its own
PEAK_RSS = "import resource, subprocess, sys; subprocess.run(sys.argv[1:], check=True); " \
           "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)"

TRAIN_START = """
import json, sys, time
from pathlib import Path
from jaxtrain.memory import host_malloc
assert host_malloc.configure()
import jax
jax.devices()
from jaxtrain.config import DataConfig
from jaxtrain.data import load_corpus, load_tokenizer, text_files
from jaxtrain.data.corpus import _encoded_text
root, tokenizer, rounds = Path(sys.argv[1]), sys.argv[2], int(sys.argv[3])
val_fraction = 0.5  # a split at the test's small size too: the same text is encoded either way
ways = {"child": lambda: load_corpus(DataConfig(path=str(root), tokenizer=tokenizer, val_fraction=val_fraction)).train,
        "in_process": lambda: _encoded_text(root, text_files(root), "", val_fraction, load_tokenizer(tokenizer)).train}
seconds, tokens = {way: [] for way in ways}, {}
for _ in range(rounds):
    for way, encode in ways.items():
        start = time.perf_counter()
        tokens[way] = encode()
        seconds[way].append(time.perf_counter() - start)
assert (tokens["child"] == tokens["in_process"]).all()
print(json.dumps(seconds))
"""

BASELINE = """
import sys
from pathlib import Path
import tokenizers
tokenizer = tokenizers.Tokenizer.from_file(sys.argv[1])
files = Path(sys.argv[2]).read_text().splitlines()
encode = getattr(tokenizer, sys.argv[3])
for start in range(0, len(files), 256):
    encode([Path(f).read_text(errors="replace") for f in files[start:start + 256]], add_special_tokens=False)
"""


def _first_files(files: list[Path], limit: int) -> list[Path]:
    chosen, total = [], 0
    for f in files:
        if total >= limit:
            break
        chosen.append(f)
        total += f.stat().st_size
    return chosen


def _shortened(command: list[str]) -> str:
    """The command as a shell line, its middle cut: it names every input file, thousands of them."""
    line = shlex.join(command)
    if len(line) <= FAILURE_COMMAND_CHARS:
        return line
    half = FAILURE_COMMAND_CHARS // 2
    return f"{line[:half]} ...[{len(line) - 2 * half} characters]... {line[-half:]}"


def _run(command: list[str], env: dict[str, str] | None = None) -> str:
    """The command's output; a failing one raises with the end of its stderr, which says why."""
    done = subprocess.run(command, capture_output=True, text=True, env=env)
    if done.returncode != 0:
        stderr = "\n".join(done.stderr.splitlines()[-FAILURE_STDERR_LINES:])
        raise RuntimeError(f"{_shortened(command)} exited {done.returncode}; its stderr ends:\n{stderr}")
    return done.stdout


def _seconds(command: list[str]) -> float:
    """Wall seconds of the command (``_run``)."""
    start = time.perf_counter()
    _run(command)
    return time.perf_counter() - start


def run() -> dict:
    _, files = stdlib_files()
    inputs = _first_files(files, INPUT_BYTES)
    megabytes = sum(f.stat().st_size for f in inputs) / 1e6
    with tempfile.TemporaryDirectory() as scratch:
        scratch = Path(scratch)
        train_tokenizer(map(str, _first_files(files, TRAIN_BYTES)), VOCAB, scratch / "tokenizer")
        listing = scratch / "files.txt"
        listing.write_text("\n".join(map(str, inputs)))
        ours = [sys.executable, "-m", "jaxtrain.cli", "tokenize", *map(str, inputs), "--tokenizer", str(scratch / "tokenizer")]
        baseline = [sys.executable, "-c", BASELINE, str(scratch / "tokenizer" / "tokenizer.json"), str(listing)]
        # a new --out each round: tokenize never overwrites a token file
        rounds = [(_seconds([*ours, "--out", str(scratch / f"tokens{i}.bin")]), _seconds([*baseline, "encode_batch"]),
                   _seconds([*baseline, "encode_batch_fast"])) for i in range(ROUNDS)]
        tokens = os.path.getsize(scratch / "tokens0.bin") // 2
        peaks = _single_file_peaks(inputs, scratch)
        start_s = _train_start_seconds(inputs, scratch)
    ours_s, baseline_s, fast_s = (statistics.median(r[i] for r in rounds) for i in range(3))
    return {
        "tokenize_single_file_peak_rss_mb": peaks,
        "train_start_encode_s": {way: round(statistics.median(times), 2) for way, times in start_s.items()},
        "train_start_encode_speedup": round(statistics.median(
            here / child for here, child in zip(start_s["in_process"], start_s["child"], strict=True)), 2),
        "tokenize_mb_per_s": round(megabytes / ours_s, 2),
        "tokenize_baseline_mb_per_s": round(megabytes / baseline_s, 2),
        "tokenize_ratio": round(statistics.median(r[1] / r[0] for r in rounds), 3),
        "tokenize_fast_baseline_mb_per_s": round(megabytes / fast_s, 2),
        "tokenize_ratio_vs_fast": round(statistics.median(r[2] / r[0] for r in rounds), 3),
        "tokenize_input_mb": round(megabytes, 1),
        "tokenize_tokens": tokens,
        "tokenize_vocab": VOCAB,
    }


def _single_file_peaks(inputs: list[Path], scratch: Path) -> dict:
    """{command: {file MB: peak RSS MB}} of tokenize and train-tokenizer on one file of ``inputs`` and on one of
    SINGLE_FILE_COPIES of them."""
    text = b"\n".join(f.read_bytes() for f in inputs)
    peaks = {"tokenize": {}, "train_tokenizer": {}}
    for copies in (1, SINGLE_FILE_COPIES):
        single = scratch / f"single{copies}.txt"
        single.write_bytes(text * copies)
        size = f"{single.stat().st_size / 1e6:.3g}"
        for name, args in (("tokenize", ["--tokenizer", str(scratch / "tokenizer"), "--out", str(scratch / f"single{copies}.bin")]),
                           ("train_tokenizer", ["--vocab-size", str(SINGLE_FILE_VOCAB), "--out", str(scratch / f"tokenizer{copies}")])):
            command = [sys.executable, "-c", PEAK_RSS, sys.executable, "-m", "jaxtrain.cli", name.replace("_", "-"), str(single), *args]
            peaks[name][size] = round(int(_run(command)) / 1024, 1)
        single.unlink()
    return peaks


def _train_start_seconds(inputs: list[Path], scratch: Path) -> dict[str, list[float]]:
    """{child, in_process: seconds of each round} of TRAIN_START on a directory of copies of ``inputs``."""
    corpus = scratch / "corpus"
    corpus.mkdir()
    for i, f in enumerate(inputs):  # their names repeat (__init__.py)
        shutil.copy(f, corpus / f"{i}_{f.name}")
    command = [sys.executable, "-c", TRAIN_START, str(corpus), str(scratch / "tokenizer"), str(ROUNDS)]
    return json.loads(_run(command, os.environ | {"JAXTRAIN_HOST_MALLOC": "keep"}))
