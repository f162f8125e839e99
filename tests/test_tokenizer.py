"""Tokenizers and text data: train-tokenizer -> tokenize -> train, JSONL sources, transformers loading the
trained tokenizer, token-file sidecars, and every bad input as one line with exit status 2."""

import errno
import io
import json
import os
import resource
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import psutil
import pytest

from conftest import REPO, fill_disk, subprocess_env
from jaxtrain import atomic, cli
from jaxtrain.config import DataConfig
from jaxtrain.data import child_process, hf_tokenizer_files, load_corpus, load_tokenizer, stdlib_files, text_files
from jaxtrain.data import corpus as corpus_lib
from jaxtrain.data.token_file import sidecar_path, tokenizer_of
from jaxtrain.data.tokenizer import END_OF_TEXT, MAX_PRE_TOKEN, MAX_VOCAB_SIZE, TextTokenizer, special_token_ids, token_dtype
from jaxtrain.errors import UserError

VOCAB = 384
TINY_MODEL = [f"model.vocab_size={VOCAB}", "model.d_model=32", "model.num_layers=2", "model.mlp_dim=64", "data.seq_len=32",
              "train.global_batch=8", "train.eval_batches=1", "log.progress=false", "log.peak_tflops=1", "log.tensorboard=false", "log.layer_every=0"]


def jaxtrain(capsys, *args: str) -> tuple[int, list[str]]:
    """Run the command line in this process: (exit status, stderr lines)."""
    status = cli.main([*args])
    return status, capsys.readouterr().err.strip().splitlines()


@pytest.fixture(scope="module")
def texts(tmp_path_factory) -> Path:
    """Real text: 24 small files of the standard library's top level (about 200 kB), copied so the test owns them."""
    docs = tmp_path_factory.mktemp("texts") / "docs"
    docs.mkdir()
    root, files = stdlib_files()
    for f in [f for f in files if f.parent == root and f.stat().st_size < 20_000][:24]:
        shutil.copy(f, docs / f"{f.stem}.txt")
    return docs


@pytest.fixture(scope="module")
def trained(texts) -> Path:
    out = texts.parent / "tokenizer"
    assert cli.main(["train-tokenizer", str(texts), "--vocab-size", str(VOCAB), "--out", str(out)]) == 0
    return out


def _encode_each(tokenizer, texts: list[str]) -> list[int]:
    return [i for t in texts for i in (*tokenizer.tokenizer.encode(t, add_special_tokens=False).ids, tokenizer.end_of_text)]


def test_trained_tokenizer_loads_in_transformers_and_encodes_identically(trained, texts):
    from transformers import AutoTokenizer

    ours = load_tokenizer(trained)
    assert ours.vocab_size == VOCAB and ours.tokenizer.id_to_token(ours.end_of_text) == END_OF_TEXT
    theirs = AutoTokenizer.from_pretrained(trained)
    assert theirs.eos_token == theirs.bos_token == END_OF_TEXT and theirs.eos_token_id == ours.end_of_text
    samples = [sorted(texts.iterdir())[0].read_text()[:2000], "naïve café — 数据 🚀\n\tdef f(x): return x", ""]
    for text in samples:
        ids = ours.tokenizer.encode(text).ids
        assert theirs.encode(text) == ids and theirs.decode(ids) == text
    assert theirs.encode(END_OF_TEXT) == [ours.end_of_text]
    files = hf_tokenizer_files(trained)
    assert files == {"tokenizer.json": (trained / "tokenizer.json").read_bytes(),
                     "tokenizer_config.json": (trained / "tokenizer_config.json").read_bytes()}


def test_hf_files_for_a_bare_tokenizer_json_name_its_end_of_text_for_transformers(trained, tmp_path):
    from transformers import AutoTokenizer

    bare = tmp_path / "bare"
    bare.mkdir()
    shutil.copy(trained / "tokenizer.json", bare / "tokenizer.json")
    export = tmp_path / "export"
    export.mkdir()
    for name, contents in hf_tokenizer_files(bare / "tokenizer.json").items():
        (export / name).write_bytes(contents)
    assert sorted(p.name for p in export.iterdir()) == ["tokenizer.json", "tokenizer_config.json"]
    assert AutoTokenizer.from_pretrained(export).eos_token == END_OF_TEXT


def _word_level(directory: Path, vocab: dict, config: dict | None = None) -> Path:
    """A tokenizer directory whose special tokens are the vocabulary's <...> entries."""
    from tokenizers import Tokenizer, models

    directory.mkdir()
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="a"))
    tokenizer.add_special_tokens([t for t in vocab if t.startswith("<")])
    tokenizer.save(str(directory / "tokenizer.json"))
    if config:
        (directory / "tokenizer_config.json").write_text(json.dumps(config))
    return directory


def test_end_of_text_is_found_by_family_spelling_or_eos_token(tmp_path):
    llama3 = _word_level(tmp_path / "llama3", {"a": 0, "<|begin_of_text|>": 1, "<|end_of_text|>": 2})
    assert load_tokenizer(llama3).end_of_text == 2
    custom = _word_level(tmp_path / "custom", {"a": 0, "<stop>": 1}, {"eos_token": {"content": "<stop>"}})
    assert load_tokenizer(custom).end_of_text == 1
    with pytest.raises(UserError, match=r"has no end-of-text token to put between documents \(looked for <\|endoftext\|>"):
        load_tokenizer(_word_level(tmp_path / "none", {"a": 0, "<pad>": 1}))


def test_special_token_ids_are_those_the_tokenizer_config_names(tmp_path):
    vocab = {"a": 0, "<|begin_of_text|>": 1, "<|end_of_text|>": 2, "<|eot_id|>": 3}
    llama3 = _word_level(tmp_path / "llama3", vocab, {"bos_token": "<|begin_of_text|>", "eos_token": {"content": "<|eot_id|>"}})
    assert special_token_ids(hf_tokenizer_files(llama3)) == {"bos_token_id": 1, "eos_token_id": 3}
    # older directories name them in special_tokens_map.json; an explicit null (Qwen2's bos) stays unknown
    older = _word_level(tmp_path / "older", vocab, {"bos_token": None})
    (older / "special_tokens_map.json").write_text(json.dumps({"bos_token": "<|begin_of_text|>", "eos_token": "<|end_of_text|>"}))
    assert special_token_ids(hf_tokenizer_files(older)) == {"bos_token_id": None, "eos_token_id": 2}
    with pytest.raises(UserError, match=r"^the tokenizer.json to export could not be read for its bos/eos ids: "):
        special_token_ids({"tokenizer.json": b'{"not": "a tokenizer"}'})


def test_train_tokenize_train_loss_falls(trained, texts, tmp_path, capsys):
    tokens = tmp_path / "tokens.bin"
    status, err = jaxtrain(capsys, "tokenize", str(texts), "--tokenizer", str(trained), "--out", str(tokens))
    assert status == 0 and f"wrote {tokens}" in err[-1]
    tokenizer = load_tokenizer(trained)
    files = sorted(texts.iterdir())
    expected = _encode_each(tokenizer, [f.read_text() for f in files])  # end-of-text after every document
    np.testing.assert_array_equal(np.fromfile(tokens, np.uint16), expected)
    sidecar = json.loads(sidecar_path(tokens).read_text())
    assert sidecar | {"format": None} == {
        "format": None, "dtype": "uint16", "tokens": len(expected), "documents": len(files), "vocab_size": VOCAB,
        "end_of_text": tokenizer.end_of_text, "tokenizer": str((trained / "tokenizer.json").resolve()), "tokenizer_sha256": tokenizer.sha256}

    run = tmp_path / "run"
    status, err = jaxtrain(capsys, "train", "tiny", "--run-dir", str(run), f"data.path={tokens}", f"data.tokenizer={trained}",
                           *TINY_MODEL, "train.steps=20", "log.every=1", "optim.lr=1e-2", "optim.warmup_steps=0")
    assert status == 0, err
    losses = [r["loss"] for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if "loss" in r]
    assert len(losses) == 20 and abs(losses[0] - np.log(VOCAB)) < 0.3 and losses[-1] < losses[0] - 0.8, losses

    # the run generates text through its data.tokenizer, and its export carries that tokenizer (AutoTokenizer: at the end)
    from jaxtrain import generate as generate_lib

    status = cli.main(["generate", str(run), "--prompt", "def ", "--max-new-tokens", "8"])
    assert status == 0 and capsys.readouterr().out.startswith("def ")
    loaded = generate_lib.load(run)
    assert loaded.decode is not None and loaded.encode("def f(x):") == tokenizer.tokenizer.encode("def f(x):").ids
    export = tmp_path / "export"
    assert cli.main(["export-hf", str(run), "--out", str(export), "--dtype", "float32"]) == 0

    # the same run without data.tokenizer: the token file's sidecar names it, for generate and export-hf
    import dataclasses

    from jaxtrain import config as config_lib
    from jaxtrain.interop import hf_export

    saved = config_lib.load_run_config(run)
    sidecar_only = dataclasses.replace(saved, data=dataclasses.replace(saved.data, tokenizer=None))
    (tmp_path / "sidecar_only").mkdir()
    config_lib.save_yaml(sidecar_only, tmp_path / "sidecar_only" / "config.yaml")
    encode = generate_lib.load_codec(tmp_path / "sidecar_only").encode
    assert encode("def f(x):") == tokenizer.tokenizer.encode("def f(x):").ids
    assert hf_export.tokenizer_files(sidecar_only, None) == hf_export.tokenizer_files(saved, None)

    # a tokenizer moved away: one line before any checkpoint is read (it came after restoring and writing the weights)
    moved = dataclasses.replace(saved, data=dataclasses.replace(saved.data, tokenizer=str(tmp_path / "moved")))
    config_lib.save_yaml(moved, run / "config.yaml")
    capsys.readouterr()
    status, err = jaxtrain(capsys, "export-hf", str(run), "--out", str(tmp_path / "export2"))
    assert status == 2 and err == [f"jaxtrain: error: the run's data.tokenizer {tmp_path / 'moved'} is gone, and the export "
                                   "carries it beside the weights; put it back, or set data.tokenizer in the run's config.yaml "
                                   "to where it is now"], err
    assert not list(tmp_path.glob("export2*"))

    # last, so that `make test-jax-next` (jax 0.11, no transformers) checks all of the above
    transformers = pytest.importorskip("transformers")
    text = files[0].read_text()[:300]
    assert transformers.AutoTokenizer.from_pretrained(export)(text, add_special_tokens=False)["input_ids"] == \
        tokenizer.tokenizer.encode(text, add_special_tokens=False).ids
    generation = transformers.GenerationConfig.from_pretrained(export)  # stops at the document separator trained on
    assert generation.bos_token_id == generation.eos_token_id == tokenizer.end_of_text != 2


def test_jsonl_source_matches_the_same_texts_as_files(trained, texts, tmp_path, capsys):
    docs = [f.read_text() for f in sorted(texts.iterdir())]
    jsonl = tmp_path / "docs.jsonl"
    jsonl.write_text("".join(json.dumps({"id": i, "text": t}) + "\n" + ("\n" if i == 3 else "") for i, t in enumerate(docs)))
    tokens = tmp_path / "tokens.bin"
    assert jaxtrain(capsys, "tokenize", str(jsonl), "--tokenizer", str(trained), "--out", str(tokens))[0] == 0
    tokenizer = load_tokenizer(trained)
    np.testing.assert_array_equal(np.fromfile(tokens, np.uint16), _encode_each(tokenizer, docs))

    # as data.path: split by line, each line's document tokenized with end-of-text after it
    corpus = load_corpus(DataConfig(path=str(jsonl), tokenizer=str(trained), val_fraction=0.25))
    assert corpus.vocab_size == VOCAB and corpus.train.dtype == np.uint16
    both = np.concatenate([corpus.train, corpus.validation])
    assert np.sort(both).tolist() == sorted(_encode_each(tokenizer, docs))
    assert 0 < (corpus.validation == tokenizer.end_of_text).sum() < len(docs)
    raw = load_corpus(DataConfig(path=str(jsonl), val_fraction=0.25))  # no tokenizer: the text's UTF-8 bytes
    assert raw.vocab_size == 256 and len(raw.train) + len(raw.validation) == sum(len(t.encode()) + 1 for t in docs)


# a fresh process under the CPU's malloc setting (one arena for every thread) loads a corpus and encodes instruction
# data with a tokenizer; prints the threads each added to it, the corpus and the marked spans
IN_A_CHILD = """
import json, sys
import numpy as np, psutil
from jaxtrain.memory import host_malloc
assert host_malloc.configure()
from jaxtrain.config import DataConfig
from jaxtrain.data import load_corpus, load_tokenizer
from jaxtrain.data.tokenizer import encode_marking_spans
threads = psutil.Process().num_threads
before = threads()
corpus = load_corpus(DataConfig(path=sys.argv[1], tokenizer=sys.argv[2], val_fraction=0.25))
after_corpus = threads()
marked = encode_marking_spans(load_tokenizer(sys.argv[2]), ["say hello world", "", "again"], [[(4, 9)], [], [(0, 5)]])
print(json.dumps({"corpus_threads": after_corpus - before, "spans_threads": threads() - after_corpus,
                  "train": corpus.train.tolist(), "validation": corpus.validation.tolist(), "description": corpus.description,
                  "marked": [[ids.tolist(), mask.tolist()] for ids, mask in marked]}))
"""


def test_a_runs_text_and_instruction_data_are_encoded_outside_its_process_as_they_would_be_inside(trained, texts):
    """On a CPU the run's process keeps one malloc arena for every thread (memory/host_malloc.py), in which the
    tokenizers library's threads encoded 3.5x slower: a corpus or instruction data encoded at a run's start is encoded
    in a child process, whose malloc is the system's. None of the library's threads is then started in the run's
    process (it keeps them for good: RAYON_NUM_THREADS of them), and the tokens are those of an encoding in it."""
    done = subprocess.run([sys.executable, "-c", IN_A_CHILD, str(texts), str(trained)], capture_output=True, text=True,
                          env=subprocess_env() | {"JAXTRAIN_HOST_MALLOC": "keep", "RAYON_NUM_THREADS": "3"}, timeout=120)
    assert done.returncode == 0, done.stderr
    child = json.loads(done.stdout)
    assert child["corpus_threads"] == child["spans_threads"] == 0
    here = corpus_lib._encoded_text(texts, text_files(texts), f"text files under {texts}", 0.25, load_tokenizer(trained))
    assert (child["train"], child["validation"]) == (here.train.tolist(), here.validation.tolist())
    assert len(here.train) > 1000 and len(here.validation) > 100 and child["description"] == here.description
    tokenizer = load_tokenizer(trained).tokenizer
    (hello, hello_marks), (empty, empty_marks), (again, again_marks) = child["marked"]
    assert hello == tokenizer.encode("say hello world", add_special_tokens=False).ids and (empty, empty_marks) == ([], [])
    assert tokenizer.decode([i for i, marked in zip(hello, hello_marks, strict=True) if marked]).strip() == "hello"
    assert again_marks == [True] * len(again) and tokenizer.decode(again) == "again"


@pytest.mark.parametrize("source", ["latin1", "notext"])
def test_bad_text_read_by_the_encoding_process_is_the_one_line_it_is_here(source, bad_inputs):
    """Text for data.tokenizer is read in the process that encodes it: its UserError (text not UTF-8, a JSONL line
    without text) is this process's, word for word."""
    path = Path(bad_inputs[source])
    root, files = (path, text_files(path)) if path.is_dir() else (path.parent, [path])
    with pytest.raises(UserError) as here:
        corpus_lib._encoded_text(root, files, "", 0.5, load_tokenizer(bad_inputs["tokenizer"]))
    with pytest.raises(UserError) as there:
        load_corpus(DataConfig(path=str(path), tokenizer=str(bad_inputs["tokenizer"]), val_fraction=0.5))
    assert {"latin1": "is not UTF-8 text", "notext": "has no string 'text' field"}[source] in str(here.value)
    assert str(there.value) == str(here.value)


@pytest.mark.skipif(sys.platform != "linux", reason="the kernel's parent-death signal (prctl) is Linux's")
def test_the_encoding_process_dies_with_the_run(trained):
    """A run killed while its child encodes the corpus (SIGKILL here; a SIGTERM before the run's own handler is in place
    ends it the same way) takes the child with it: the child ignores SIGTERM and, busy encoding, reads nothing that would
    tell it, so it went on alone until it had encoded everything (the standard library: seconds)."""
    run = subprocess.Popen([sys.executable, "-c", "import sys; from jaxtrain.config import DataConfig; from jaxtrain.data import "
                            "load_corpus; load_corpus(DataConfig(tokenizer=sys.argv[1]))", str(trained)], env=subprocess_env())
    try:
        deadline = time.monotonic() + 60
        while not (children := psutil.Process(run.pid).children()) and run.poll() is None and time.monotonic() < deadline:
            time.sleep(0.01)
        assert children, "the run started no encoding process"
        time.sleep(0.5)  # into its encoding
    finally:
        run.kill()
        run.wait()
    _, alive = psutil.wait_procs(children, timeout=2)
    assert not alive


def test_a_corpus_encoding_process_killed_from_outside_is_one_line(trained, texts):
    def kill_the_child():
        while not (children := psutil.Process().children()):
            time.sleep(0.005)
        for child in children:
            child.kill()  # as the kernel's out-of-memory killer does

    killer = threading.Thread(target=kill_the_child, daemon=True)
    killer.start()
    with pytest.raises(UserError) as died:
        load_corpus(DataConfig(path=str(texts), tokenizer=str(trained), val_fraction=0.25))
    killer.join()
    assert str(died.value) == (f"the process tokenizing text files under {texts} died (exit status -{int(signal.SIGKILL)}); if it ran "
                               "out of memory, tokenize the text into a token file first (jaxtrain tokenize) and give that as data.path")
    assert not psutil.Process().children()


def test_large_vocabulary_writes_uint32(trained, tmp_path, capsys):
    big = load_tokenizer(trained).tokenizer
    big.add_tokens([f"<extra{i}>" for i in range(70_000)])
    big_dir = tmp_path / "big"
    big_dir.mkdir()
    big.save(str(big_dir / "tokenizer.json"))
    (tmp_path / "doc.txt").write_text("a <extra69999> b")
    tokens = tmp_path / "tokens.bin"
    assert jaxtrain(capsys, "tokenize", str(tmp_path / "doc.txt"), "--tokenizer", str(big_dir), "--out", str(tokens))[0] == 0
    expected = [*big.encode("a <extra69999> b").ids, 0]
    assert max(expected) == VOCAB + 69_999 and token_dtype(VOCAB + 70_000) == np.uint32
    np.testing.assert_array_equal(np.fromfile(tokens, np.uint32), expected)
    corpus = load_corpus(DataConfig(path=str(tokens), tokenizer=str(big_dir), val_fraction=0.5))
    assert corpus.vocab_size == VOCAB + 70_000
    np.testing.assert_array_equal(np.concatenate([corpus.train, corpus.validation]), expected)
    # copied without its sidecar, it would read as uint16 halves of the ids (a QA report: it trained on those)
    (tmp_path / "copied.bin").write_bytes(tokens.read_bytes())
    with pytest.raises(UserError, match=rf"^token file {tmp_path / 'copied.bin'} has no sidecar .*copied.bin.json, so it reads as "
                                        rf"raw uint16, but data.tokenizer={big_dir / 'tokenizer.json'} has {VOCAB + 70_000} ids"):
        load_corpus(DataConfig(path=str(tmp_path / "copied.bin"), tokenizer=str(big_dir), val_fraction=0.5))


def test_token_file_without_sidecar_is_raw_uint16_and_a_truncated_one_is_refused(trained, texts, tmp_path, capsys):
    tokens = tmp_path / "data" / "tokens.bin"  # its folder made, as README's example expects on a fresh checkout
    assert jaxtrain(capsys, "tokenize", str(texts), "--tokenizer", str(trained), "--out", str(tokens))[0] == 0
    with_sidecar = load_corpus(DataConfig(path=str(tokens), val_fraction=0.1))
    assert with_sidecar.vocab_size == VOCAB and "tokenizer" in with_sidecar.description
    raw = tmp_path / "raw.bin"
    raw.write_bytes(tokens.read_bytes())
    without = load_corpus(DataConfig(path=str(raw), val_fraction=0.1))
    np.testing.assert_array_equal(without.train, with_sidecar.train)
    assert without.vocab_size == int(np.fromfile(raw, np.uint16).max()) + 1
    whole = tokens.read_bytes()
    for cut in (2, 1):  # a whole token short, and an odd byte count (which no uint16 file has): the sidecar's count says which
        tokens.write_bytes(whole[:-cut])
        with pytest.raises(UserError, match=rf"holds {len(whole) - cut} bytes but its sidecar .* says {len(whole) // 2} tokens "
                                            rf"\({len(whole)} bytes of uint16\); it is truncated"):
            load_corpus(DataConfig(path=str(tokens)))


@pytest.fixture(scope="module")
def bad_inputs(trained, texts):
    """Files the bad-input cases point at: a token file, a second tokenizer, a JSONL line without text."""
    where = texts.parent
    (where / "notext.jsonl").write_text('{"text": "fine"}\n{"body": "no text here"}\n')
    (where / "latin1").mkdir()
    (where / "latin1" / "a.txt").write_bytes("déjà vu\n".encode("latin-1"))  # not UTF-8: replaced silently, it would train on U+FFFD
    (where / "latin1.jsonl").write_bytes('{"text": "fine"}\n'.encode() + '{"text": "déjà vu"}\n'.encode("latin-1"))
    # few distinct tokens: the vocabulary checks must count the tokenizer's ids, not the ones the text happens to use
    (where / "few.jsonl").write_text("".join(json.dumps({"text": f"a b {i}"}) + "\n" for i in range(40)))
    (where / "blank.jsonl").write_text("\n \n")  # no documents
    (where / "surrogate.jsonl").write_text('{"text": "fine"}\n{"text": "half a pair: \\ud800"}\n')  # valid JSON, not text
    (where / "number.jsonl").write_text('{"text": 5}\n')
    (where / "loop1").symlink_to("loop2")
    (where / "loop2").symlink_to("loop1")
    (where / "broken").symlink_to("nowhere")
    (where / "long_run.txt").write_text("a few words, then " + "x" * (MAX_PRE_TOKEN + 1) + "\n")
    tokens = where / "tokens.bin"
    assert cli.main(["tokenize", str(where / "few.jsonl"), "--tokenizer", str(trained), "--out", str(tokens)]) == 0
    # its sidecar's vocab_size edited down to the largest id: the model would be sized below the ids it trains on
    (where / "vocab_below_ids.bin").write_bytes(tokens.read_bytes())
    sidecar = json.loads(sidecar_path(tokens).read_text())
    largest = int(np.fromfile(tokens, np.uint16).max())
    sidecar_path(where / "vocab_below_ids.bin").write_text(json.dumps(sidecar | {"vocab_size": largest}))
    other = where / "other_tokenizer"
    assert cli.main(["train-tokenizer", str(sorted(texts.iterdir())[0]), "--vocab-size", "300", "--out", str(other)]) == 0
    return {"tokens": tokens, "tokenizer": trained, "other": other, "texts": texts, "notext": where / "notext.jsonl", "few": where / "few.jsonl",
            "latin1": where / "latin1", "latin1_jsonl": where / "latin1.jsonl", "blank": where / "blank.jsonl",
            "surrogate": where / "surrogate.jsonl", "number": where / "number.jsonl", "loop": where / "loop1", "broken": where / "broken",
            "long_run": where / "long_run.txt", "vocab_below_ids": where / "vocab_below_ids.bin", "largest": largest}


TRAIN_ERRORS = {
    "tokenizer vocabulary larger than model.vocab_size": (
        lambda p: [f"data.path={p['few']}", f"data.tokenizer={p['tokenizer']}", "model.vocab_size=256", "data.val_fraction=0.25"],
        f"has a vocabulary of {VOCAB} (its tokenizer's, or its largest token id + 1) but model.vocab_size=256; set model.vocab_size>={VOCAB}"),
    "token file vocabulary larger than model.vocab_size": (
        lambda p: [f"data.path={p['tokens']}", "model.vocab_size=256"], f"set model.vocab_size>={VOCAB}"),
    "token file made with another tokenizer": (
        lambda p: [f"data.path={p['tokens']}", f"data.tokenizer={p['other']}"], "was made with tokenizer"),
    "missing tokenizer path": (lambda p: ["data.tokenizer=/no/such/tokenizer"], "tokenizer /no/such/tokenizer not found"),
    "JSONL without text": (lambda p: [f"data.path={p['notext']}"], "notext.jsonl:2 has no string 'text' field (keys body)"),
    "text that is not UTF-8": (lambda p: [f"data.path={p['latin1']}"], "latin1/a.txt is not UTF-8 text (byte 0xe9 at offset 1); convert it"),
    "JSONL of blank lines": (lambda p: [f"data.path={p['blank']}"], "blank.jsonl: no documents; a train/validation split needs at least 2"),
    # it trained on ids past the model's vocabulary and stopped on a NaN loss, advising a lower learning rate
    "token file holding ids past its sidecar's vocab_size": (
        lambda p: [f"data.path={p['vocab_below_ids']}"],
        "holds token ids up to {largest}, not below its sidecar"),
}


@pytest.mark.parametrize("case", TRAIN_ERRORS)
def test_bad_training_data_is_one_line_and_writes_nothing(case, bad_inputs, tmp_path, capsys):
    make_args, message = TRAIN_ERRORS[case]
    message = message.format(**bad_inputs)
    run = tmp_path / "run"
    status, err = jaxtrain(capsys, "train", "tiny", "--run-dir", str(run), *TINY_MODEL, "train.steps=1",
                           *make_args(bad_inputs))
    assert status == 2 and len(err) == 1 and err[0].startswith("jaxtrain: error: ") and message in err[0], err
    assert not run.exists()


COMMAND_ERRORS = {
    "tokenize a JSONL without text": (lambda p, out: ["tokenize", str(p["notext"]), "--tokenizer", str(p["tokenizer"]), "--out", str(out / "t.bin")],
                                      "notext.jsonl:2 has no string 'text' field"),
    "tokenize with a directory holding no tokenizer": (lambda p, out: ["tokenize", str(p["texts"]), "--tokenizer", str(p["texts"]), "--out",
                                                                    str(out / "t.bin")], "docs holds no tokenizer.json: give a tokenizer.json"),
    "tokenize with a missing tokenizer": (lambda p, out: ["tokenize", str(p["texts"]), "--tokenizer", str(out / "none"), "--out", str(out / "t.bin")],
                                          "none not found: give a tokenizer.json or a directory holding one"),
    "train a tokenizer on a JSONL without text": (
        lambda p, out: ["train-tokenizer", str(p["notext"]), "--vocab-size", "300", "--out", str(out / "tok")],
        "notext.jsonl:2 has no string 'text' field"),
    "tokenize a text file that is not UTF-8": (
        lambda p, out: ["tokenize", str(p["latin1"]), "--tokenizer", str(p["tokenizer"]), "--out", str(out / "t.bin")],
        "latin1/a.txt is not UTF-8 text (byte 0xe9 at offset 1); convert it (iconv -f ITS_ENCODING -t UTF-8) or leave it out"),
    "tokenize a JSONL line that is not UTF-8": (
        lambda p, out: ["tokenize", str(p["latin1_jsonl"]), "--tokenizer", str(p["tokenizer"]), "--out", str(out / "t.bin")],
        "latin1.jsonl:2 is not UTF-8 text (byte 0xe9 at offset 11)"),
    # a UnicodeEncodeError traceback in both commands
    "tokenize a JSONL line with a lone surrogate": (
        lambda p, out: ["tokenize", str(p["surrogate"]), "--tokenizer", str(p["tokenizer"]), "--out", str(out / "t.bin")],
        "surrogate.jsonl:2 holds a lone surrogate (\\ud800, from a JSON escape), which is not text"),
    "train a tokenizer on a JSONL line with a lone surrogate": (
        lambda p, out: ["train-tokenizer", str(p["surrogate"]), "--vocab-size", "300", "--out", str(out / "tok")],
        "surrogate.jsonl:2 holds a lone surrogate"),
    "train a tokenizer on text that is not UTF-8": (
        lambda p, out: ["train-tokenizer", str(p["latin1"]), "--vocab-size", "300", "--out", str(out / "tok")],
        "latin1/a.txt is not UTF-8 text"),
    "tokenize a token file": (lambda p, out: ["tokenize", str(p["tokens"]), "--tokenizer", str(p["tokenizer"]), "--out", str(out / "t.bin")],
                              "tokens.bin is a token file (.bin), not text: train on it with data.path=/"),
    "tokenize an empty directory": (lambda p, out: ["tokenize", str(out), "--tokenizer", str(p["tokenizer"]), "--out", str(out / "t.bin")],
                                    "hold no files (hidden ones are skipped)"),
    "tokenize a JSONL of blank lines": (lambda p, out: ["tokenize", str(p["blank"]), "--tokenizer", str(p["tokenizer"]), "--out", str(out / "new" / "t.bin")],
                                        "blank.jsonl hold no documents (blank .jsonl lines are skipped)"),
    "train a tokenizer on a JSONL of blank lines": (
        lambda p, out: ["train-tokenizer", str(p["blank"]), "--vocab-size", "300", "--out", str(out / "tok")],
        "blank.jsonl hold no documents (blank .jsonl lines are skipped)"),
    "tokenize over an existing token file": (lambda p, out: ["tokenize", str(p["texts"]), "--tokenizer", str(p["tokenizer"]), "--out", str(p["tokens"])],
                                             "already exists (or its sidecar does); give a new path"),
    "tokenize into a path under a file": (lambda p, out: ["tokenize", str(p["texts"]), "--tokenizer", str(p["tokenizer"]), "--out",
                                                          str(p["tokens"] / "sub" / "t.bin")], "tokens.bin is a file, not a directory"),
    "tokenize where no directory can be made": (lambda p, out: ["tokenize", str(p["texts"]), "--tokenizer", str(p["tokenizer"]), "--out",
                                                                "/proc/jaxtrain-test/t.bin"], "cannot make the directory /proc/jaxtrain-test ("),
    "train a tokenizer under a file": (lambda p, out: ["train-tokenizer", str(p["texts"]), "--vocab-size", "300", "--out",
                                                       str(p["tokens"] / "tok")], "tokens.bin is a file, not a directory"),
    "train a tokenizer into a directory in use": (
        lambda p, out: ["train-tokenizer", str(p["texts"]), "--vocab-size", "300", "--out", str(p["texts"])],
        "already exists and is not an empty directory"),
    # the directories tokenize makes for --out are removed again when a later input fails
    "tokenize into new directories, a later input failing": (
        lambda p, out: ["tokenize", str(p["texts"]), str(p["latin1"]), "--tokenizer", str(p["tokenizer"]),
                        "--out", str(out / "new" / "sub" / "t.bin")],
        "latin1/a.txt is not UTF-8 text"),
    # an OverflowError traceback, or a Rust abort allocating hundreds of GB that left its temporary directory
    "train a tokenizer with a vocabulary past the cap": (
        lambda p, out: ["train-tokenizer", str(p["texts"]), "--vocab-size", str(MAX_VOCAB_SIZE + 1), "--out", str(out / "tok")],
        f"--vocab-size {MAX_VOCAB_SIZE + 1} is too large: at most {MAX_VOCAB_SIZE} (2**24)"),
    "train a tokenizer with a vocabulary past int64": (
        lambda p, out: ["train-tokenizer", str(p["texts"]), "--vocab-size", "99999999999999999999", "--out", str(out / "tok")],
        "--vocab-size 99999999999999999999 is too large"),
    # training time grows with the square of a pre-token's length: one 5 MB line never finished, Ctrl-C ignored
    "train a tokenizer on a run too long for BPE": (
        lambda p, out: ["train-tokenizer", str(p["long_run"]), "--vocab-size", "300", "--out", str(out / "tok")],
        f"document long_run.txt holds a run of {MAX_PRE_TOKEN + 1} characters of one kind (letters, digits, symbols or whitespace) "
        f"at character 18; BPE training time grows with the square"),
    "train a tokenizer on a looping symbolic link": (
        lambda p, out: ["train-tokenizer", str(p["loop"]), "--vocab-size", "300", "--out", str(out / "tok")],
        "loop1 is a broken or looping symbolic link (to loop2)"),
    "tokenize a broken symbolic link": (
        lambda p, out: ["tokenize", str(p["broken"]), "--tokenizer", str(p["tokenizer"]), "--out", str(out / "t.bin")],
        "broken is a broken or looping symbolic link (to nowhere)"),
    "train a tokenizer on a JSONL whose text is a number": (
        lambda p, out: ["train-tokenizer", str(p["number"]), "--vocab-size", "300", "--out", str(out / "tok")],
        "number.jsonl:1 has 'text' as a JSON number, not a string"),
}


@pytest.mark.parametrize("case", COMMAND_ERRORS)
def test_bad_tokenizer_command_is_one_line_and_writes_nothing(case, bad_inputs, tmp_path, capsys):
    make_args, message = COMMAND_ERRORS[case]
    before = sorted(bad_inputs["texts"].parent.rglob("*"))
    status, err = jaxtrain(capsys, *make_args(bad_inputs, tmp_path))
    assert status == 2 and len(err) == 1 and err[0].startswith("jaxtrain: error: ") and message in err[0], err
    assert list(tmp_path.iterdir()) == [] and sorted(bad_inputs["texts"].parent.rglob("*")) == before


def test_a_vocabulary_the_text_cannot_fill_is_said(tmp_path, capsys):
    (tmp_path / "small.txt").write_text("ab ab ab ba")
    assert cli.main(["train-tokenizer", str(tmp_path / "small.txt"), "--vocab-size", "70000", "--out", str(tmp_path / "tok")]) == 0
    printed = capsys.readouterr().err
    size = load_tokenizer(tmp_path / "tok").vocab_size
    assert size < 70000 and f"vocabulary {size} (of the 70000 asked for: the text has no more pairs to merge)" in printed


def test_a_file_named_twice_is_tokenized_once(trained, texts, tmp_path, capsys):
    first = sorted(texts.iterdir())[0]
    once, twice = tmp_path / "once.bin", tmp_path / "twice.bin"
    assert jaxtrain(capsys, "tokenize", str(texts), "--tokenizer", str(trained), "--out", str(once))[0] == 0
    assert jaxtrain(capsys, "tokenize", str(texts), str(first), "--tokenizer", str(trained), "--out", str(twice))[0] == 0
    assert once.read_bytes() == twice.read_bytes()


def _deny(monkeypatch, *paths: Path) -> None:
    """Refuse to open, list or create anything at or under ``paths`` with EACCES, as chmod 000 does to a user
    that is not root. Tests run as root too, which chmod does not stop, so the OSError is raised where the code
    meets it: os.scandir (os.walk), io.open (Path.open), os.open and os.mkdir (tempfile, Path.mkdir)."""
    denied = [os.fspath(p) for p in paths]

    def guard(function):
        def guarded(*args, **kwargs):
            name = os.fspath(args[0]) if args and isinstance(args[0], (str, os.PathLike)) else ""
            if any(name == d or name.startswith(d + os.sep) for d in denied):
                raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), name)
            return function(*args, **kwargs)
        return guarded

    for module, name in ((os, "scandir"), (os, "open"), (os, "mkdir"), (io, "open")):
        monkeypatch.setattr(module, name, guard(getattr(module, name)))


DENIED = {  # (what is denied, the command, its one line): each was a traceback, or a silent skip of the directory
    "train a tokenizer on an unreadable file": (
        "in/b.txt", lambda t, tok: ["train-tokenizer", str(t / "in"), "--vocab-size", "300", "--out", str(t / "out" / "tok")],
        "cannot read {t}/in/b.txt (Permission denied); make it readable, or leave it out of the inputs"),
    "tokenize an unreadable JSONL": (
        "in/d.jsonl", lambda t, tok: ["tokenize", str(t / "in" / "d.jsonl"), "--tokenizer", str(tok), "--out", str(t / "out" / "t.bin")],
        "cannot read {t}/in/d.jsonl (Permission denied)"),
    "train a tokenizer on a directory holding an unreadable one": (
        "in/sub", lambda t, tok: ["train-tokenizer", str(t / "in"), "--vocab-size", "300", "--out", str(t / "out" / "tok")],
        "cannot read the directory {t}/in/sub (Permission denied)"),
    "tokenize an unreadable directory (which does hold files)": (
        "in", lambda t, tok: ["tokenize", str(t / "in"), "--tokenizer", str(tok), "--out", str(t / "out" / "t.bin")],
        "cannot read the directory {t}/in (Permission denied)"),
    "train on a directory holding an unreadable one": (
        "in/sub", lambda t, tok: ["train", "tiny", "--run-dir", str(t / "out" / "run"), f"data.path={t / 'in'}", *TINY_MODEL],
        "cannot read the directory {t}/in/sub (Permission denied)"),
    "train on a token file with an unreadable sidecar": (
        "in/t.bin.json",
        lambda t, tok: ["train", "tiny", "--run-dir", str(t / "out" / "run"), f"data.path={t / 'in' / 't.bin'}", *TINY_MODEL],
        "token file sidecar {t}/in/t.bin.json cannot be read (Permission denied); remake it with jaxtrain tokenize"),
    "tokenize into an unwritable directory": (
        "out", lambda t, tok: ["tokenize", str(t / "in"), "--tokenizer", str(tok), "--out", str(t / "out" / "t.bin")],
        "token file {t}/out/t.bin: cannot write in {t}/out (Permission denied); give a path in a writable directory"),
    "train a tokenizer into an unwritable directory": (
        "out", lambda t, tok: ["train-tokenizer", str(t / "in"), "--vocab-size", "300", "--out", str(t / "out" / "tok")],
        "tokenizer directory {t}/out/tok: cannot write in {t}/out (Permission denied)"),
}


@pytest.mark.parametrize("case", DENIED)
def test_what_cannot_be_read_or_written_is_one_line(case, bad_inputs, tmp_path, monkeypatch, capsys):
    (tmp_path / "in" / "sub").mkdir(parents=True)
    (tmp_path / "out").mkdir()
    (tmp_path / "in" / "a.txt").write_text("hello\n")
    (tmp_path / "in" / "b.txt").write_text("x\n")
    (tmp_path / "in" / "sub" / "c.txt").write_text("more\n")
    (tmp_path / "in" / "d.jsonl").write_text('{"text": "hello"}\n')
    shutil.copy(bad_inputs["tokens"], tmp_path / "in" / "t.bin")
    shutil.copy(sidecar_path(bad_inputs["tokens"]), tmp_path / "in" / "t.bin.json")
    denied, make_args, message = DENIED[case]
    before = sorted(tmp_path.rglob("*"))
    _deny(monkeypatch, tmp_path / denied)
    status, err = jaxtrain(capsys, *make_args(tmp_path, bad_inputs["tokenizer"]))
    assert status == 2 and len(err) == 1 and err[0].startswith("jaxtrain: error: ") and message.format(t=tmp_path) in err[0], err
    assert not psutil.Process().children()  # train-tokenizer's trainer process stopped with the command
    monkeypatch.undo()
    assert sorted(tmp_path.rglob("*")) == before


def test_unreadable_instruction_data_is_one_line(tmp_path, monkeypatch):
    from jaxtrain.data import sft

    chats = tmp_path / "chats.jsonl"
    chats.write_text('{"prompt": "hi", "completion": "hello"}\n')
    _deny(monkeypatch, chats)
    with pytest.raises(UserError, match=f"^cannot read {chats} \\(Permission denied\\); make it readable"):
        next(sft._conversations(chats))


SIDECAR_EDITS = {  # each was a KeyError or TypeError traceback, or (uint8) a run on the uint16 bytes read as uint8
    "missing dtype": (lambda d: d.pop("dtype"), "is missing 'dtype'"),
    "missing tokens": (lambda d: d.pop("tokens"), "is missing 'tokens'"),
    "missing vocab_size": (lambda d: d.pop("vocab_size"), "is missing 'vocab_size'"),
    "missing tokenizer": (lambda d: d.pop("tokenizer"), "is missing 'tokenizer'"),
    "missing tokenizer_sha256": (lambda d: d.pop("tokenizer_sha256"), "is missing 'tokenizer_sha256'"),
    "tokens as a string": (lambda d: d.update(tokens=str(d["tokens"])), "has 'tokens': \"{tokens}\", not a non-negative JSON integer"),
    "sha256 as a number": (lambda d: d.update(tokenizer_sha256=5), "has 'tokenizer_sha256': 5, not a JSON string"),
    "unknown dtype": (lambda d: d.update(dtype="banana"), f"has dtype 'banana' for vocab_size {VOCAB}, where tokenize writes uint16"),
    "uint8, the count doubled to match the bytes": (lambda d: d.update(dtype="uint8", tokens=2 * d["tokens"]), "has dtype 'uint8'"),
}


@pytest.mark.parametrize("case", [*SIDECAR_EDITS, "a directory"])
def test_a_malformed_sidecar_is_one_line(case, bad_inputs, tmp_path):
    tokens = tmp_path / "t.bin"
    shutil.copy(bad_inputs["tokens"], tokens)
    sidecar = json.loads(sidecar_path(bad_inputs["tokens"]).read_text())
    count = sidecar["tokens"]
    if case == "a directory":  # it was ignored: the .bin read as raw uint16
        sidecar_path(tokens).mkdir()
        message = "is not a file"
    else:
        edit, message = SIDECAR_EDITS[case]
        edit(sidecar)
        sidecar_path(tokens).write_text(json.dumps(sidecar))
    # training reads it, and so do generate and export-hf (for the tokenizer it names)
    corpus = lambda: load_corpus(DataConfig(path=str(tokens), tokenizer=str(bad_inputs["tokenizer"])))  # noqa: E731
    for read in (corpus, lambda: tokenizer_of(str(tokens))):
        with pytest.raises(UserError) as refused:
            read()
        assert str(refused.value).startswith(f"token file sidecar {sidecar_path(tokens)} {message.format(tokens=count)}")
        assert str(refused.value).endswith("; remake it with jaxtrain tokenize") and "\n" not in str(refused.value)


# just under MAX_PRE_TOKEN, runs the Rust trainer takes seconds over (about 3 s on 2 slow cores), never looking at signals
SLOW_DOCUMENTS = [chr(97 + i) * (MAX_PRE_TOKEN - 1) + " " + chr(97 + 7 * i % 26) * (MAX_PRE_TOKEN - 2 - i) for i in range(12)]


@pytest.fixture
def slow_documents(tmp_path) -> Path:
    (tmp_path / "in").mkdir()
    for i, text in enumerate(SLOW_DOCUMENTS):
        (tmp_path / "in" / f"{i}.txt").write_text(text)
    return tmp_path / "in"


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_stops_tokenizer_training_at_once_and_leaves_nothing(signum, slow_documents, tmp_path, capsys, sigterm_outside):
    threads = set(threading.enumerate())
    command = ["train-tokenizer", str(slow_documents), "--vocab-size", "300", "--out", str(tmp_path / "tok")]
    # Python's Ctrl-C handler, whatever this process inherited: a background CI job starts its children with SIGINT ignored
    previous_interrupt = signal.signal(signal.SIGINT, signal.default_int_handler)
    timer = threading.Timer(0.5, os.kill, (os.getpid(), signum))
    try:
        timer.start()
        start = time.perf_counter()
        if signum == signal.SIGINT:  # Ctrl-C: the command's one line and status 130
            assert cli.main(command) == 130 and capsys.readouterr().err.strip() == "jaxtrain: interrupted"
        else:  # SIGTERM: 143, through the same cleanup
            with pytest.raises(SystemExit) as stopped:
                cli.main(command)
            assert stopped.value.code == 143 and capsys.readouterr().err.strip() == "jaxtrain: terminated"
        elapsed = time.perf_counter() - start
        assert signal.getsignal(signal.SIGTERM) is sigterm_outside  # the command's handler is gone with the command
    finally:
        timer.cancel()  # where the command ended first (a machine much faster than this one), no signal lands on pytest
        timer.join()
        signal.signal(signal.SIGINT, previous_interrupt)
    assert elapsed < 1.5, f"stopped {elapsed:.1f}s after it started, the signal sent at 0.5s"
    assert [p.name for p in tmp_path.iterdir()] == ["in"]  # no temporary directory beside --out
    # nothing left training: a thread left running the Rust trainer now and then aborted the interpreter's exit
    assert not psutil.Process().children() and set(threading.enumerate()) <= threads


def test_a_ctrl_c_while_the_trainer_process_starts_stops_it_too(slow_documents, tmp_path, capsys, monkeypatch):
    """A Ctrl-C while the child starts (here as it is sent its work; signals are blocked in the starting thread so that
    the child inherits them blocked, and another thread of this process takes it): before, raised ahead of the part
    that kills the child, it left the child waiting for input and the exit waiting for the child."""
    send = child_process.Connection.send

    def send_then_interrupted(connection, message):
        send(connection, message)
        os.kill(os.getpid(), signal.SIGINT)

    monkeypatch.setattr(child_process.Connection, "send", send_then_interrupted)
    previous_interrupt = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        status, err = jaxtrain(capsys, "train-tokenizer", str(slow_documents), "--vocab-size", "300", "--out", str(tmp_path / "tok"))
    finally:
        signal.signal(signal.SIGINT, previous_interrupt)
    assert status == 130 and err == ["jaxtrain: interrupted"]
    assert not psutil.Process().children() and [p.name for p in tmp_path.iterdir()] == ["in"]


def test_a_tokenizer_trainer_killed_from_outside_is_one_line(slow_documents, tmp_path, capsys):
    def kill_trainer():
        for child in psutil.Process().children():
            child.kill()  # as the kernel's out-of-memory killer does

    timer = threading.Timer(1.0, kill_trainer)
    timer.start()
    try:
        status, err = jaxtrain(capsys, "train-tokenizer", str(slow_documents), "--vocab-size", "300", "--out", str(tmp_path / "tok"))
    finally:
        timer.cancel()
    assert status == 2 and err == [f"jaxtrain: error: the tokenizer trainer's process died (exit status -{int(signal.SIGKILL)}); if it "
                                   "ran out of memory, give fewer or smaller inputs or a smaller --vocab-size"]
    assert [p.name for p in tmp_path.iterdir()] == ["in"]


def test_a_failure_inside_the_tokenizer_trainers_process_is_one_line(tmp_path):
    """The library failing in the trainer's process (here a vocabulary size it cannot take, which the commands check
    before) is one line naming its error; it was a RuntimeError holding the child's whole traceback. (The files are
    written by this process: a full disk is atomic_dir's one line.)"""
    from jaxtrain.data.tokenizer import _train_in_child

    with pytest.raises(UserError) as failed:
        _train_in_child(iter(["some text to train on\n"] * 10), -1)
    message = str(failed.value)
    assert message == "training the tokenizer failed in its process: OverflowError: can't convert negative int to unsigned"
    assert not psutil.Process().children()


def test_sigterm_during_tokenize_exits_143_and_leaves_nothing(trained, texts, tmp_path, monkeypatch, capsys, sigterm_outside):
    encode = TextTokenizer.encode_in_parts  # what tokenize calls, a batch of documents at a time

    def encode_then_terminated(self, documents):
        os.kill(os.getpid(), signal.SIGTERM)
        yield from encode(self, documents)
    monkeypatch.setattr(TextTokenizer, "encode_in_parts", encode_then_terminated)
    with pytest.raises(SystemExit) as stopped:
        cli.main(["tokenize", str(texts), "--tokenizer", str(trained), "--out", str(tmp_path / "new" / "t.bin")])
    assert signal.getsignal(signal.SIGTERM) is sigterm_outside
    assert stopped.value.code == 143 and capsys.readouterr().err.strip() == "jaxtrain: terminated"
    assert list(tmp_path.iterdir()) == []  # neither the temporary file nor the directory made for it


def test_tokenize_onto_a_full_disk_is_one_line_and_leaves_nothing(trained, texts, tmp_path, monkeypatch, capsys):
    """A QA report: a disk filling up under tokenize was a traceback (exit status 1); now one line naming the file and the
    full disk, status 2, and neither the temporary file nor the directory made for it left."""
    encode_in_parts = TextTokenizer.encode_in_parts

    def encode_onto_a_full_disk(self, documents):
        assert fill_disk(f"{tmp_path}/")  # the temporary token file, open: its next write fails with ENOSPC
        yield from encode_in_parts(self, documents)
    monkeypatch.setattr(TextTokenizer, "encode_in_parts", encode_onto_a_full_disk)
    out = tmp_path / "new" / "t.bin"
    status, err = jaxtrain(capsys, "tokenize", str(texts), "--tokenizer", str(trained), "--out", str(out))
    assert status == 2 and err == [f"jaxtrain: error: could not write token file {out}: the disk is full (No space left on "
                                   "device); nothing of it is left behind; free space there or write elsewhere"]
    assert list(tmp_path.iterdir()) == []


def test_train_tokenizer_onto_a_full_disk_is_one_line_and_leaves_nothing(texts, tmp_path):
    """A QA report: the trainer's process saved tokenizer.json with the library's own save, whose full-disk error came
    back as its traceback inside a RuntimeError's. Now this process writes it: one line, nothing left. A file size limit
    stands in for the full disk (Python ignores SIGXFSZ, so the write fails with EFBIG), set in the command's process."""
    limit = 4096  # tokenizer_config.json fits, tokenizer.json does not
    out = tmp_path / "tok"
    done = subprocess.run([sys.executable, "-m", "jaxtrain.cli", "train-tokenizer", str(texts), "--vocab-size", "300", "--out", str(out)],
                          cwd=REPO, env=subprocess_env(), capture_output=True, text=True, timeout=120,
                          preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (limit, resource.RLIM_INFINITY)))
    assert (done.returncode, done.stderr.splitlines()) == (2, [
        f"jaxtrain: error: could not write tokenizer directory {out}: the file would pass the file size limit (ulimit -f) "
        "(File too large); nothing of it is left behind; raise the limit or write elsewhere"])
    assert list(tmp_path.iterdir()) == []


def test_a_token_file_whose_rename_fails_takes_its_sidecar_with_it(trained, texts, tmp_path, monkeypatch, capsys):
    """The sidecar is renamed into place first; where the token file's own sync and rename then fail (ext4 reports a
    full disk at fsync), the sidecar stayed alone, and every later tokenize to that path was refused for it."""
    publish, out = atomic.publish, tmp_path / "new" / "t.bin"

    def full_at_the_token_file(temp, path):
        if path == out:
            assert sidecar_path(out).is_file()  # the sidecar is in place by now
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        publish(temp, path)
    monkeypatch.setattr(atomic, "publish", full_at_the_token_file)
    status, err = jaxtrain(capsys, "tokenize", str(texts), "--tokenizer", str(trained), "--out", str(out))
    assert status == 2 and err == [f"jaxtrain: error: could not write token file {out}: the disk is full (No space left on "
                                   "device); nothing of it is left behind; free space there or write elsewhere"]
    assert list(tmp_path.iterdir()) == []


def test_a_tokenizer_unlike_a_trained_one_gives_each_document_then_end_of_text(tmp_path, capsys):
    """A Hugging Face tokenizer.json unlike the ones train-tokenizer makes: unused ids (2 to 4), the document
    separator <|endoftext|> not id 0, a chat model's end of turn as tokenizer_config.json's eos_token, a post-processor
    that adds <s>. A document becomes its tokens and the separator, nothing added; the vocabulary is the largest id + 1
    (it was the count of tokens, 5, below the ids 5 to 7: text trained on ids past the model's vocabulary, and the
    token file was refused as not matching its own sidecar)."""
    from tokenizers import Tokenizer, processors

    directory = _word_level(tmp_path / "tok", {"a": 0, "b": 1, "<|im_end|>": 5, END_OF_TEXT: 6, "<s>": 7}, {"eos_token": "<|im_end|>"})
    with_bos = Tokenizer.from_file(str(directory / "tokenizer.json"))
    with_bos.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 7)])
    with_bos.save(str(directory / "tokenizer.json"))
    tokenizer = load_tokenizer(directory)
    assert tokenizer.end_of_text == 6 and tokenizer.vocab_size == 8
    (tmp_path / "docs.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in "abba"))
    tokens = tmp_path / "t.bin"
    assert jaxtrain(capsys, "tokenize", str(tmp_path / "docs.jsonl"), "--tokenizer", str(directory), "--out", str(tokens))[0] == 0
    np.testing.assert_array_equal(np.fromfile(tokens, np.uint16), [0, 6, 1, 6, 1, 6, 0, 6])
    corpus = load_corpus(DataConfig(path=str(tokens), tokenizer=str(directory), val_fraction=0.25))
    assert corpus.vocab_size == 8 and corpus.train.tolist() == [0, 6, 1, 6, 1, 6] and corpus.validation.tolist() == [0, 6]


def test_a_token_file_without_sidecar_takes_the_vocabulary_of_data_tokenizer(trained, tmp_path):
    """A raw .bin keeps no record of its tokenizer: with data.tokenizer, the vocabulary is the tokenizer's (the model
    embeds every id the tokenizer makes), not the largest id the file happens to hold + 1."""
    raw = tmp_path / "raw.bin"
    (np.arange(1000) % 100).astype("<u2").tofile(raw)
    assert load_corpus(DataConfig(path=str(raw), val_fraction=0.1)).vocab_size == 100
    assert load_corpus(DataConfig(path=str(raw), tokenizer=str(trained), val_fraction=0.1)).vocab_size == VOCAB


def test_a_token_file_takes_its_tokenizer_copied_elsewhere(trained, bad_inputs, tmp_path):
    """A sidecar names its tokenizer by content (the sha256 of its JSON), not by path: a copy in another directory is
    the same tokenizer."""
    copy = tmp_path / "copy"
    shutil.copytree(trained, copy)
    corpus = load_corpus(DataConfig(path=str(bad_inputs["tokens"]), tokenizer=str(copy), val_fraction=0.5))
    assert corpus.vocab_size == VOCAB and corpus.description.endswith(f", tokenizer {(trained / 'tokenizer.json').resolve()}")


def test_a_malformed_tokenizer_config_is_one_line(tmp_path, capsys):
    """tokenizer_config.json, where the end-of-text token may be named, is read with every tokenizer (it was a
    JSONDecodeError traceback)."""
    directory = _word_level(tmp_path / "tok", {"a": 0, "<stop>": 1}, {"eos_token": "<stop>"})
    (directory / "tokenizer_config.json").write_text('{"eos_token": "<stop>",}')
    (tmp_path / "doc.txt").write_text("a")
    status, err = jaxtrain(capsys, "tokenize", str(tmp_path / "doc.txt"), "--tokenizer", str(directory), "--out", str(tmp_path / "t.bin"))
    assert status == 2 and err == [f"jaxtrain: error: tokenizer config {directory / 'tokenizer_config.json'} is not valid JSON "
                                   "(Expecting property name enclosed in double quotes); fix it (transformers reads it too)"], err
    (directory / "tokenizer_config.json").write_bytes(b'{"eos_token": "\xe9"}')
    with pytest.raises(UserError, match=r"tokenizer_config.json is not valid JSON \(not UTF-8\)"):
        load_tokenizer(directory)


def test_a_sidecar_whose_tokenizer_is_gone_names_none(bad_inputs, tmp_path):
    """generate and export-hf take the tokenizer a token file's sidecar names while that file is there; once it is gone
    the run is one of token ids, as a raw token file's is."""
    tokens = tmp_path / "t.bin"
    shutil.copy(bad_inputs["tokens"], tokens)
    sidecar = json.loads(sidecar_path(bad_inputs["tokens"]).read_text())
    sidecar_path(tokens).write_text(json.dumps(sidecar | {"tokenizer": str(tmp_path / "gone" / "tokenizer.json")}))
    assert tokenizer_of(str(tokens)) is None and tokenizer_of(str(bad_inputs["tokens"])) == sidecar["tokenizer"]


def _whole(tokenizer: TextTokenizer, text: bytes) -> list[int]:
    return [*tokenizer.tokenizer.encode(text.decode(), add_special_tokens=False).ids, tokenizer.end_of_text]


def test_a_long_document_is_encoded_in_pieces_to_the_tokens_it_has_whole(trained, texts, tmp_path, monkeypatch, capsys):
    """A document longer than two pieces is cut where the tokens stay the same (checked by the tokenizer on the text
    either side): the trained byte-level BPE on real source text gives the whole document's tokens from pieces, and
    tokenize writes them batch by batch, reading a text file block by block (cut as it is read: never held whole); a
    tokenizer that marks where a text begins (a prefix, as Llama 2's SentencePiece normalizer adds) cannot be cut
    anywhere, and its documents are encoded whole, their tokens unchanged too."""
    from tokenizers import Tokenizer, normalizers, pre_tokenizers

    from jaxtrain.data import documents as documents_lib
    from jaxtrain.data import tokenizer as tokenizer_lib

    monkeypatch.setattr(tokenizer_lib, "PIECE_BYTES", 2048)
    monkeypatch.setattr(tokenizer_lib, "BATCH_BYTES", 8192)
    monkeypatch.setattr(documents_lib, "READ_BYTES", 1000)  # tokenize reads the file in 60 blocks
    document = b"\n".join(path.read_bytes() for path in sorted(texts.iterdir()))[:60_000]
    bpe = load_tokenizer(trained)
    assert len(list(bpe._pieces([document]))) > 20 and len(list(bpe.encode_in_parts([document]))) > 5
    assert bpe.encode([document, b"x = 1"]).tolist() == _whole(bpe, document) + _whole(bpe, b"x = 1")
    blocks = [document[start:start + 1000] for start in range(0, len(document), 1000)]
    read = []  # the blocks read when each piece is cut: the piece's end and its check's context, not the rest
    pieces = [(piece, len(read)) for piece, _ in bpe._pieces(block for block in blocks if not read.append(block))]
    assert b"".join(piece for piece, _ in pieces) == document and len(pieces) > 20
    assert all(read_then * 1000 < sum(len(p) for p, _ in pieces[:i + 1]) + tokenizer_lib.CUT_CONTEXT + 2 * 2048 + 1000
               for i, (_, read_then) in enumerate(pieces[:-1]))
    assert np.concatenate(list(bpe.encode_in_parts([iter(blocks)]))).tolist() == _whole(bpe, document)
    # a run of 30,000 bytes without a space, read 1,000 at a time: the pieces after it are cut as before it
    spaceless = document[:20_000] + b"x" * 30_000 + document[20_000:]
    ends = np.cumsum([len(piece) for piece, _ in bpe._pieces(spaceless[i:i + 1000] for i in range(0, len(spaceless), 1000))])
    assert ends[-1] == len(spaceless) and np.sum(ends > 52_000) > 10
    assert np.concatenate(list(bpe.encode_in_parts([iter([spaceless[:25_000], spaceless[25_000:]])]))).tolist() == _whole(bpe, spaceless)
    (tmp_path / "long.txt").write_bytes(document)
    assert jaxtrain(capsys, "tokenize", str(tmp_path / "long.txt"), "--tokenizer", str(trained),
                    "--out", str(tmp_path / "long.bin"))[0] == 0
    assert np.fromfile(tmp_path / "long.bin", np.uint16).tolist() == _whole(bpe, document)

    directory = _word_level(tmp_path / "prefixed", {END_OF_TEXT: 0, "#": 1, "a": 2, "b": 3})
    prefixed = Tokenizer.from_file(str(directory / "tokenizer.json"))
    prefixed.normalizer = normalizers.Prepend("#")
    prefixed.pre_tokenizer = pre_tokenizers.Whitespace()
    prefixed.save(str(directory / "tokenizer.json"))
    marked = load_tokenizer(directory)
    document = b"a b\n" * 5000
    assert len(list(marked._pieces([document]))) == len(list(marked._pieces(iter([document[:9999], document[9999:]])))) == 1
    assert marked.encode([document]).tolist() == _whole(marked, document) == [1, *[2, 3] * 5000, 0]


def test_train_tokenizer_trains_on_a_file_read_in_blocks_as_on_it_whole(texts, tmp_path, monkeypatch, capsys):
    """train-tokenizer reads a text file block by block and sends it to the trainer in pieces cut before whitespace
    that follows a printable character, where the byte-level pre-tokenizer always splits: the pieces of a file read in
    many small blocks are its text, and train the very BPE its whole text trains; a run too long to train on is named
    at its character in the whole document, not in its piece."""
    from jaxtrain.data import documents as documents_lib
    from jaxtrain.data import tokenizer as tokenizer_lib

    monkeypatch.setattr(documents_lib, "READ_BYTES", 1000)
    document = b"\n".join(path.read_bytes() for path in sorted(texts.iterdir()))[:100_000] + "\t \u3000 é\n".encode()
    pieces = list(tokenizer_lib._training_pieces(document[i:i + 1000] for i in range(0, len(document), 1000)))
    assert b"".join(pieces) == document and len(pieces) > 50 and max(map(len, pieces)) < 2000
    (tmp_path / "one.txt").write_bytes(document)
    assert jaxtrain(capsys, "train-tokenizer", str(tmp_path / "one.txt"), "--vocab-size", "400", "--out", str(tmp_path / "tok"))[0] == 0
    whole = json.loads(tokenizer_lib._train_in_child(iter([document.decode()]), 400))
    assert json.loads((tmp_path / "tok" / "tokenizer.json").read_text())["model"] == whole["model"]

    (tmp_path / "run.txt").write_bytes(document[:5000] + b" " + b"x" * (MAX_PRE_TOKEN + 1) + b"\n")
    status, err = jaxtrain(capsys, "train-tokenizer", str(tmp_path / "run.txt"), "--vocab-size", "400", "--out", str(tmp_path / "no"))
    assert status == 2 and f"holds a run of {MAX_PRE_TOKEN + 1} characters of one kind (letters, digits, symbols or whitespace) at " \
        f"character {len(document[:5001].decode())};" in err[-1]


SINGLE_FILE_PEAK = """
import random, resource, sys
from pathlib import Path
from jaxtrain.data import documents, tokenizer
from jaxtrain.data.token_file import write_token_file
from jaxtrain.data.tokenizer import train_tokenizer
tokenizer.PIECE_BYTES, tokenizer.BATCH_BYTES, documents.READ_BYTES = 64 << 10, 256 << 10, 64 << 10  # scaled down 4x, 16x, 16x
random.seed(0)
words = [f"w{i}" for i in range(500)]
folder, tokenizer_dir = Path(sys.argv[1]), sys.argv[2]
peaks = []
for name, n in (("small", 1), ("large", 12)):  # about 2 and 24 MB, written a part at a time
    with open(folder / f"{name}.txt", "wb") as f:
        for _ in range(n):
            f.write(" ".join(random.choices(words, k=500_000)).encode() + b" ")
    if tokenizer_dir:
        write_token_file([str(folder / f"{name}.txt")], tokenizer_dir, folder / f"{name}.bin")
    else:
        train_tokenizer([str(folder / f"{name}.txt")], 300, folder / f"{name}-tokenizer")
    peaks.append(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)  # this process's: the BPE trainer's is its child's
print(peaks[1] - peaks[0])
"""


def _single_file_peak_growth(folder: Path, tokenizer_dir: Path | None = None) -> int:
    """KiB that the peak RSS of tokenize (with ``tokenizer_dir``) or train-tokenizer grows from a 2 MB to a 24 MB file."""
    folder.mkdir()
    done = subprocess.run([sys.executable, "-c", SINGLE_FILE_PEAK, str(folder), str(tokenizer_dir or "")], env=subprocess_env(),
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    return int(done.stdout)


def test_train_tokenizer_reads_a_file_without_holding_it(tmp_path):
    """train-tokenizer's own process (the reading, the checks and the messages to the trainer's) holds a block and a
    piece of a text file, not the file: a file 12 times as long (2 -> 24 MB) does not grow its peak (measured: 0 MB,
    three runs), where the file read whole grew it by 453 MB (its text split into words for the long-run check)."""
    grew_kib = _single_file_peak_growth(tmp_path / "files")
    assert grew_kib < 24 << 10, f"train-tokenizer's peak RSS grew {grew_kib >> 10} MB from a 2 MB to a 24 MB file"


ENCODE_PEAK = """
import random, resource, sys
from jaxtrain.data import load_tokenizer, tokenizer
tokenizer.PIECE_BYTES, tokenizer.BATCH_BYTES = 64 << 10, 256 << 10  # the defaults' sizes scaled down 4x and 16x
encoding = load_tokenizer(sys.argv[1])
random.seed(0)
words = [f"w{i}" for i in range(500)]
small, large = (" ".join(random.choices(words, k=n)).encode() for n in (250_000, 1_000_000))  # about 1 and 4 MB
peaks = []
for text in (small, large):
    encoding.encode([text])
    peaks.append(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)
print(peaks[1] - peaks[0])
"""


def test_encoding_one_long_document_takes_memory_of_a_batch_not_of_the_document(tmp_path):
    """tokenize (and text read at start-up) encodes a long document in pieces, a batch of them at a time: the peak
    resident memory of encoding a document four times as long grows by a few MB (measured 6 and 7). Encoded whole,
    the library held about 600 bytes a token (a 51 MB file took 7.9 GB): here 270 MB more for the 3 MB more text.
    And tokenize reads a text file block by block as it encodes it: a file 12 times as long (2 -> 24 MB) grows its
    peak by 8-11 MB (measured), where the file read whole grew it by 63 MB."""
    vocab = {END_OF_TEXT: 0, "a": 1, **{f"w{i}": i + 2 for i in range(500)}}  # "a": _word_level's unknown token
    directory = _word_level(tmp_path / "words", vocab)
    from tokenizers import Tokenizer, pre_tokenizers

    words = Tokenizer.from_file(str(directory / "tokenizer.json"))
    words.pre_tokenizer = pre_tokenizers.Whitespace()
    words.save(str(directory / "tokenizer.json"))
    done = subprocess.run([sys.executable, "-c", ENCODE_PEAK, str(directory)], env=subprocess_env(), capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    grew_kib = int(done.stdout)
    assert grew_kib < 50 << 10, f"peak RSS grew {grew_kib >> 10} MB from a 1 MB to a 4 MB document"
    grew_kib = _single_file_peak_growth(tmp_path / "files", directory)
    assert grew_kib < 24 << 10, f"tokenize's peak RSS grew {grew_kib >> 10} MB from a 2 MB to a 24 MB file"


def test_utf8_is_checked_in_blocks_and_a_bad_byte_named_at_its_offset(monkeypatch):
    """Text is checked for UTF-8 a block at a time (decoded whole, a large file took its size again in memory): a
    character split between two blocks is still text, and the first bad byte is named at its offset in the file."""
    from jaxtrain.data import documents

    monkeypatch.setattr(documents, "UTF8_CHECK_BYTES", 4)
    documents.check_utf8("aé€😀b".encode() * 3, "f")  # 2, 3 and 4 bytes, across every block boundary
    for data, offset in ((b"abc\xc3\xa9de\xff", 7), (b"ab\xe2\x82", 2), (b"\xe2\x82\xac\xe2\x28\xa1", 3)):
        with pytest.raises(UserError, match=f"^f is not UTF-8 text \\(byte 0x{data[offset]:02x} at offset {offset}\\)"):
            documents.check_utf8(data, "f")
