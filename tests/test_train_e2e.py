"""The real command line, end to end, on 8 simulated devices."""

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml

from conftest import REPO, run_cli, subprocess_env
from jaxtrain import distributed
from jaxtrain.cli import DEFAULT_CPU_DEVICES, default_cpu_devices, simulate_cpu_devices
from jaxtrain.config import AxisSizes, MeshConfig, from_dict, load_mesh_file

SHORT = ["train.steps=4", "log.every=2", "train.eval_batches=1", "train.global_batch=8", "data.seq_len=32", "model.num_layers=2"]
KEYS = {"step", "loss", "learning_rate", "grad_norm", "step_time_s", "tokens_per_s", "mfu"}


def _records(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def short_run(tmp_path_factory):
    """A finished `jaxtrain train tiny` run of SHORT (4 steps of 2 layers) at optim.lr=1e-3; tests that start it again
    work on a copy (_copy)."""
    cwd = tmp_path_factory.mktemp("short")
    run_dir = cwd / "run"
    result = run_cli("train", "tiny", "--run-dir", str(run_dir), *SHORT, "optim.lr=1e-3", cwd=cwd)
    assert result.returncode == 0, result.stderr[-3000:]
    (cwd / "stderr.txt").write_text(result.stderr)
    return run_dir


def _copy(run_dir, tmp_path):
    copy = tmp_path / "run"
    shutil.copytree(run_dir, copy)
    return copy


def _files(run_dir):
    return {path.relative_to(run_dir): path.read_bytes() for path in sorted(run_dir.rglob("*")) if path.is_file()}


def test_train_command_writes_config_and_metrics(short_run):
    run_dir = short_run
    records = _records(run_dir)
    steps = [r for r in records if "loss" in r]
    assert [r["step"] for r in steps] == [2, 4] and all(KEYS <= set(r) for r in steps)
    assert steps[0]["mfu"] > 0  # CPU: against the matmul peak measured at start-up
    assert all(r["tokens_per_s"] > 0 and r["loss"] > 0 for r in steps)
    evals = [r for r in records if "eval_loss" in r]
    assert [r["step"] for r in evals] == [4] and 0 < evals[0]["eval_loss"] < 6
    printed = (run_dir.parent / "stderr.txt").read_text()  # the evaluation on the console too
    assert f"step 4/4 eval loss {evals[0]['eval_loss']:.4g} over {evals[0]['eval_tokens']:,} tokens\n" in printed
    saved = yaml.safe_load((run_dir / "config.yaml").read_text())
    resolved = saved.pop("resolved")
    assert resolved["mesh"] == {"data": 2, "fsdp": 2, "tensor": 2, "stage": 1, "expert": 1} and resolved["devices"] == 8
    cfg = from_dict(saved)
    assert cfg.train.steps == 4 and cfg.optim.lr == 1e-3 and cfg.rules == "fsdp_tp"


def test_the_summary_says_how_many_steps_an_epoch_is_and_each_record_which_epoch_it_is_in(short_run):
    """The training split's sequences of data.seq_len=32 are an epoch, global_batch=8 of them a step: the summary says
    how many, and each step record the epochs read through its batch (a QA report: no figure said how many steps an
    epoch is, nor which epoch a step is in)."""
    from jaxtrain.data import load_corpus
    from jaxtrain.config import DataConfig

    train = load_corpus(DataConfig(seq_len=32)).train
    sequences = (len(train) - 1) // 32
    summary = json.loads((short_run / "summary.json").read_text())
    assert summary["epoch"] == {"size": sequences, "unit": "sequences", "left_out_tokens": len(train) - 1 - 32 * sequences,
                                "steps": sequences / 8, "at_start": 0.0, "at_end": 32 / sequences, "train_epochs": None,
                                "train_steps": None}
    assert [r["epoch"] for r in _records(short_run) if "loss" in r] == [16 / sequences, 32 / sequences]
    printed = (short_run.parent / "stderr.txt").read_text()
    line = re.search(r"\n  epoch: ([0-9,]+) training sequences = ([0-9,.]+) steps of train.global_batch=8, each sequence read once "
                     r"an epoch, in an order of its own", printed)
    assert int(line[1].replace(",", "")) == sequences and float(line[2].replace(",", "")) == round(sequences / 8, 2)


def test_a_resume_refused_for_another_model_shape_leaves_the_run_directory_as_it_was(short_run, tmp_path):
    run_dir = _copy(short_run, tmp_path)
    before = _files(run_dir)
    result = run_cli("train", "tiny", "--run-dir", str(run_dir), *SHORT, "train.steps=8", "model.num_layers=1", cwd=tmp_path)
    assert result.returncode == 2 and result.stderr.count("\n") == 1, result.stderr[-3000:]
    assert "checkpoint step 4 in" in result.stderr and "does not match the model: params/layers/" in result.stderr
    assert _files(run_dir) == before  # config.yaml above all: generate and export-hf read the model from it


def test_a_resume_for_another_model_shape_is_refused_before_the_compile(short_run, tmp_path, monkeypatch):
    """By the newest checkpoint's metadata: a large model's compile takes minutes (llama3_70b: several)."""
    from jaxtrain import train as train_lib
    from jaxtrain.cli import resolve_config
    from jaxtrain.errors import UserError

    run_dir = _copy(short_run, tmp_path)
    monkeypatch.setattr(train_lib, "compile_steps", lambda *a, **k: pytest.fail("compiled before the checkpoint's shapes were checked"))
    with pytest.raises(UserError, match=r"checkpoint step 4 in .* does not match the model: params/embed has shape \(256, 128\) in the checkpoint but \(256, 64\)"):
        train_lib.train(resolve_config("tiny", None, None, [*SHORT, "model.d_model=64"]), run_dir)


def test_a_finished_run_started_again_is_not_compiled(short_run, tmp_path, monkeypatch, capsys):
    """The run's checkpoint is read before the steps compile: a large model's compile takes minutes."""
    from jaxtrain import train as train_lib
    from jaxtrain.cli import resolve_config

    run_dir = _copy(short_run, tmp_path)
    monkeypatch.setattr(train_lib, "compile_steps", lambda *a, **k: pytest.fail("compiled a run with nothing to do"))
    assert int(train_lib.train(resolve_config("tiny", None, None, SHORT), run_dir).step) == 4
    assert "is already at step 4 of train.steps=4, nothing to do" in capsys.readouterr().err


def test_a_run_stopped_before_its_final_evaluation_evaluates_it_when_started_again(short_run, tmp_path, capsys):
    """Stopped after its last checkpoint, before the final evaluation's record (killed, a second Ctrl-C, an error in
    the evaluation), the run started again said "nothing to do" and never had that evaluation (a QA report)."""
    from jaxtrain import train as train_lib
    from jaxtrain.cli import resolve_config

    run_dir = _copy(short_run, tmp_path)
    records = _records(run_dir)
    scores = lambda records: [{k: v for k, v in r.items() if k != "eval_s"} for r in records if "eval_loss" in r]  # noqa: E731
    evaluations = scores(records)
    assert [r["step"] for r in evaluations] == [4]
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records if "eval_loss" not in r))
    assert int(train_lib.train(resolve_config("tiny", None, None, SHORT), run_dir).step) == 4
    assert "the evaluation of step 4, the last, has no record" in capsys.readouterr().err
    assert scores(_records(run_dir)) == evaluations  # the same parameters and batches (the time aside)


def test_a_resume_with_other_model_values_of_the_same_shapes_says_which(short_run, tmp_path, capsys):
    """The shapes fit the checkpoint, the function does not (a QA report: a resume with another model.rope_theta
    and model.norm_eps went on without a word); the same model resumes without a note."""
    from jaxtrain import train as train_lib
    from jaxtrain.cli import resolve_config

    run_dir = _copy(short_run, tmp_path)
    train_lib.train(resolve_config("tiny", None, None, [*SHORT, "train.steps=5", "model.rope_theta=50", "model.norm_eps=0.5",
                                                       "model.moe.normalize_top_k=false", "model.remat=full",
                                                       "model.attention=xla"]), run_dir)
    # the resume notes (model.moe.normalize_top_k on this dense model also has its own: no effect without experts)
    def resume_notes(err):
        return [line for line in err.splitlines() if line.startswith("jaxtrain: note: model.") and "the checkpoints trained with" in line]

    notes = resume_notes(capsys.readouterr().err)
    # values as an override spells them (a QA report: Python's True and False); how it is computed is no note
    assert notes == [f"jaxtrain: note: model.{key}={now} here but {before} in {run_dir / 'config.yaml'}, which the checkpoints "
                     f"trained with: from this step on the run trains with {now}; give model.{key}={before} to continue as before"
                     for key, now, before in (("rope_theta", 50.0, 10000.0), ("norm_eps", 0.5, 1e-05),
                                              ("moe.normalize_top_k", "false", "true"))], notes
    train_lib.train(resolve_config("tiny", None, None, [*SHORT, "train.steps=6", "model.rope_theta=50", "model.norm_eps=0.5",
                                                       "model.moe.normalize_top_k=false"]), run_dir)
    assert resume_notes(capsys.readouterr().err) == []
    # what `auto` chose on other devices (a GPU, or pipeline stages: scanned layers, cuDNN attention) is the same
    # function: no note (a QA report: a pipelined run resumed on a plain mesh was told to give model.scan_layers=True)
    saved = yaml.safe_load((run_dir / "config.yaml").read_text())
    saved["model"] |= {"scan_layers": True, "attention": "cudnn"}
    (run_dir / "config.yaml").write_text(yaml.safe_dump(saved, sort_keys=False))
    train_lib.train(resolve_config("tiny", None, None, [*SHORT, "train.steps=7", "model.rope_theta=50", "model.norm_eps=0.5",
                                                       "model.moe.normalize_top_k=false"]), run_dir)
    assert resume_notes(capsys.readouterr().err) == []


def _recorded_runs(monkeypatch, train_lib) -> list:
    """The training batches of each run started from here on, recorded: ``read``, the input rows of each step, and
    ``uninterrupted(rows)``, the first rows of the same data read 8 sequences a batch."""
    real, runs = train_lib.data_lib.train_batches, []

    class Recording:
        def __init__(self, corpus, cfg, global_batch, sharding):
            self.batches, self.read, self.reference = real(corpus, cfg, global_batch, sharding), [], real(corpus, cfg, 8, sharding)
            self.iterator, self.position, self.unit = self.batches.iterator, self.batches.position, self.batches.unit
            runs.append(self)

        def uninterrupted(self, rows):
            return np.concatenate([np.asarray(next(self.reference)["inputs"]) for _ in range(rows // 8)])

        def __next__(self):
            batch = next(self.batches)
            self.read.append(np.asarray(batch["inputs"]))
            return batch

    monkeypatch.setattr(train_lib.data_lib, "train_batches", Recording)
    return runs


def test_a_runs_config_yaml_as_the_experiment_resumes_that_run_with_its_config(short_run, tmp_path, monkeypatch, capsys):
    """`jaxtrain train RUN_DIR/config.yaml` trains on in RUN_DIR with the config it trained with, without the command's
    overrides given again (SHORT's model and batch here): no note of another model, batch or evaluation, only the
    raised train.steps's schedule note; without --run-dir it went to runs/config, a new run."""
    from jaxtrain import cli

    run_dir = _copy(short_run, tmp_path)
    monkeypatch.chdir(tmp_path)
    assert cli.main(["train", str(run_dir / "config.yaml"), "train.steps=6"]) == 0
    assert [r["step"] for r in _records(run_dir) if "loss" in r] == [2, 4, 6] and not (tmp_path / "runs").exists()
    err = capsys.readouterr().err
    assert f"jaxtrain: resuming from checkpoint step 4 in {run_dir}" in err, err
    notes = [line for line in err.splitlines() if line.startswith("jaxtrain: note:")]
    assert len(notes) == 1 and "learning-rate schedule" in notes[0], notes


def test_a_resume_with_another_global_batch_reads_on_from_the_next_sequence(short_run, tmp_path, monkeypatch, capsys):
    """The checkpoint's data position counts sequences: 4 steps of 8 resumed with 12 a batch (which 32 is no multiple
    of) read sequences 32-43 of the uninterrupted run's stream (a QA report: it counted batches, so 16 a batch read
    64-79, and 32-63 were skipped), and the note says so; another data.seed is another stream, which the position only
    counts into."""
    from jaxtrain import train as train_lib
    from jaxtrain.cli import resolve_config

    run_dir = _copy(short_run, tmp_path)
    runs = _recorded_runs(monkeypatch, train_lib)
    train_lib.train(resolve_config("tiny", None, None, [*SHORT, "train.steps=5", "train.global_batch=12"]), run_dir)
    np.testing.assert_array_equal(runs[0].read[0], runs[0].uninterrupted(48)[32:44])
    epoch = json.loads((run_dir / "summary.json").read_text())["epoch"]  # counted in sequences read, not steps x batch
    last = [r for r in _records(run_dir) if "loss" in r][-1]
    assert (epoch["at_start"], epoch["at_end"], last["step"], last["epoch"]) == (32 / epoch["size"], 44 / epoch["size"], 5,
                                                                                 44 / epoch["size"])
    notes = [line for line in capsys.readouterr().err.splitlines()
             if line.startswith("jaxtrain: note:") and "learning-rate schedule" not in line]  # train.steps raised: its own test
    assert notes == [f"jaxtrain: note: train.global_batch=12 here but 8 in {run_dir / 'config.yaml'}: the data goes on after "
                     "the 32 sequences the checkpoint's position counts, none skipped or read twice",
                     # the evaluation's batches are the run's batch size too: other sequences than the records before
                     "jaxtrain: note: the evaluation scores train.eval_batches x train.global_batch = 1 x 12 validation "
                     f"sequences here, 1 x 8 in {run_dir / 'config.yaml'}: eval_loss from here on is taken over other "
                     "sequences than the earlier records'"], notes
    train_lib.train(resolve_config("tiny", None, None, [*SHORT, "train.steps=6", "train.global_batch=12", "data.seed=1"]), run_dir)
    notes = [line for line in capsys.readouterr().err.splitlines()
             if line.startswith("jaxtrain: note:") and "learning-rate schedule" not in line]
    assert notes == [f"jaxtrain: note: data.seed=1 here but 0 in {run_dir / 'config.yaml'}, whose sequences the checkpoint's "
                     "data position counts (44 read): here it goes on at position 44 of another stream, so sequences are "
                     "skipped or seen twice; give data.seed=0 to continue where the run stopped"], notes
    np.testing.assert_array_equal(runs[1].read[0], runs[1].uninterrupted(56)[44:])  # of data.seed=1's stream


def test_a_resume_with_other_optimizer_settings_notes_each_and_the_next_updates_rate(short_run, tmp_path, capsys):
    """A resume trains on with the optimizer settings it is given: a note per changed key, as for the model's; the
    schedule's keys in one, with the next update's rate under both schedules (raising train.steps to extend a cosine run
    puts its rate back up: nothing was said)."""
    from jaxtrain import train as train_lib
    from jaxtrain.cli import resolve_config
    from jaxtrain.optim import learning_rate_schedule

    run_dir = _copy(short_run, tmp_path)
    before = resolve_config("tiny", None, None, [*SHORT, "optim.lr=1e-3"])
    extended = resolve_config("tiny", None, None, [*SHORT, "optim.lr=1e-3", "train.steps=6", "optim.b2=0.99", "optim.offload=true"])
    train_lib.train(extended, run_dir)
    here, there = (float(learning_rate_schedule(cfg)(4)) for cfg in (extended, before))  # update 5 counts 4 before it
    assert abs(here - there) > 1e-4  # tiny warms up over more steps than these: train.steps stretches its warmup
    notes = [line for line in capsys.readouterr().err.splitlines() if line.startswith("jaxtrain: note:")]
    config = run_dir / "config.yaml"
    assert notes == [f"jaxtrain: note: optim.b2=0.99 here but 0.95 in {config}, which the checkpoints trained with: from this step "
                     "on the run trains with 0.99; give optim.b2=0.95 to continue as before",
                     f"jaxtrain: note: the learning-rate schedule differs from that of {config}, which the checkpoints trained "
                     f"with (train.steps=6 here but 4 there): the next update's rate is {here:.4g}, {there:.4g} under the run's "
                     "schedule"], notes  # optim.offload moves the state, not the update: no note


def test_init_from_a_run_says_it_takes_its_data_position_and_what_it_counts_here(short_run, tmp_path, monkeypatch, capsys):
    """--init-from RUN_DIR takes its step, optimizer state and data position, and one note says so: under another
    global batch it reads on from the next sequence; another stream (data.seed; new data) starts from its beginning,
    where the position would have skipped that many of it (a QA report: nothing was said)."""
    from jaxtrain import train as train_lib
    from jaxtrain.cli import resolve_config

    runs = _recorded_runs(monkeypatch, train_lib)
    train_lib.train(resolve_config("tiny", None, None, [*SHORT, "train.steps=5", "train.global_batch=16"]), tmp_path / "a",
                    init_from=short_run)
    np.testing.assert_array_equal(runs[0].read[0], runs[0].uninterrupted(48)[32:])
    notes = [line for line in capsys.readouterr().err.splitlines() if line.startswith("jaxtrain: note:")]
    assert notes == [f"jaxtrain: note: --init-from {short_run} goes on from its step 4: its optimizer state, the learning-rate "
                     "schedule at step 4 and its data position, 32 sequences read: this run reads on from the next one; add "
                     "--params-only to start at step 0 from its parameters alone"], notes
    train_lib.train(resolve_config("tiny", None, None, [*SHORT, "train.steps=5", "data.seed=1"]), tmp_path / "b",
                    init_from=short_run)
    np.testing.assert_array_equal(runs[1].read[0], runs[1].uninterrupted(8))  # the new stream from its beginning
    notes = [line for line in capsys.readouterr().err.splitlines() if line.startswith("jaxtrain: note:")]
    assert notes == [f"jaxtrain: note: --init-from {short_run} goes on from its step 4: its optimizer state, the learning-rate "
                     "schedule at step 4 and not its data position (32 sequences read), which counts another stream "
                     "(data.seed=1 here but 0 there): this run's data starts from its beginning; add "
                     "--params-only to start at step 0 from its parameters alone"], notes


def test_documents_added_to_the_same_data_path_are_said_on_resume_and_init_from(tmp_path, capsys):
    """A document added to data.path (the same key, another stream: every later sequence moves) is a note on resume
    and makes --init-from start the data from its beginning (a QA report: nothing was said, the position went on into the
    other stream); one that lands in validation leaves the training stream, and the position, as they were: no note."""
    from jaxtrain import train as train_lib
    from jaxtrain.cli import resolve_config
    from jaxtrain.data.documents import is_validation_file

    corpus, run_dir = tmp_path / "corpus", tmp_path / "run"
    corpus.mkdir()
    for i in range(8):
        (corpus / f"doc{i}.txt").write_text(f"document {i}: " + "some text to model. " * 40)
    overrides = [*SHORT, f"data.path={corpus}", "data.val_fraction=0.5"]

    def add(split: str) -> None:  # a document whose key puts it in that split
        name = next(n for n in (f"new{i}.txt" for i in range(100)) if is_validation_file(n, 0.5) == (split == "validation")
                    and not (corpus / n).exists())
        (corpus / name).write_text("added later. " * 30)

    def data_notes(steps: int, **init_from) -> list[str]:
        train_lib.train(resolve_config("tiny", None, None, [*overrides, f"train.steps={steps}"]), init_from.pop("to", run_dir),
                        **init_from)
        return [line for line in capsys.readouterr().err.splitlines() if "data" in line and line.startswith("jaxtrain: note:")]

    assert data_notes(4) == []
    add("validation")
    assert data_notes(5) == []
    add("train")
    tokens_before = json.loads((run_dir / "checkpoints" / "5" / "meta" / "metadata").read_text())["train_split"]
    assert data_notes(6) == [f"jaxtrain: note: the training split of data.path={corpus} holds {tokens_before + 391} tokens here "
                             f"but {tokens_before} in {run_dir / 'checkpoints' / '5'} (documents added, removed or edited), whose "
                             "sequences the checkpoint's data position counts (40 read): here it goes on at position 40 of another "
                             "stream, so sequences are skipped or seen twice; put the files back as they were to continue where the "
                             "run stopped"]
    add("train")
    notes = data_notes(7, to=tmp_path / "continued", init_from=run_dir)
    assert len(notes) == 1 and "and not its data position (48 sequences read), which counts another stream (the training " \
        f"split of data.path={corpus} holds {tokens_before + 2 * 391} tokens here but {tokens_before + 391} in" in notes[0], notes


def test_the_same_files_spelled_otherwise_are_the_same_stream(tmp_path, monkeypatch):
    """data.path and data.tokenizer are compared by the files they name (a QA report: `../here/corpus` for `corpus`, or a
    tokenizer's tokenizer.json for its directory, resumed with a note of another stream, and --init-from started the data
    again from its beginning); another corpus or tokenizer is still another stream."""
    from jaxtrain import train as train_lib
    from jaxtrain.cli import resolve_config

    for name in ("corpus", "other", "tok", "tok2"):
        (tmp_path / name).mkdir()
    for tok in ("tok", "tok2"):
        (tmp_path / tok / "tokenizer.json").write_text("{}")
    (tmp_path / "link").symlink_to(tmp_path / "corpus")
    monkeypatch.chdir(tmp_path / "other")

    def config(path, tokenizer):
        return resolve_config("tiny", None, None, [f"data.path={path}", f"data.tokenizer={tokenizer}"])

    saved = config(tmp_path / "corpus", tmp_path / "tok")
    for path, tokenizer in (("../corpus", "../tok/tokenizer.json"), (tmp_path / "link", f"{tmp_path}/other/../tok/")):
        assert train_lib._data_order_changes(saved, config(path, tokenizer)) == {}, (path, tokenizer)
    changes = train_lib._data_order_changes(saved, config("../other", "../tok2"))
    assert {key: same for key, (*_, same) in changes.items()} == {"data.path": False, "data.tokenizer": False}, changes


def test_init_from_a_run_of_another_data_format_takes_its_state_and_starts_the_data_from_its_beginning(
        short_run, tmp_path, monkeypatch, capsys):
    """--init-from a checkpoint of instruction data (data.format=sft) into a plain-text run: its step and optimizer state,
    the text from its first sequence (it asked for --params-only, which also dropped the optimizer state)."""
    from jaxtrain import train as train_lib
    from jaxtrain.cli import resolve_config

    source = _as_sft_checkpoint(_copy(short_run, tmp_path))
    runs = _recorded_runs(monkeypatch, train_lib)
    final = train_lib.train(resolve_config("tiny", None, None, [*SHORT, "train.steps=5"]), tmp_path / "text", init_from=source)
    assert int(final.step) == 5
    np.testing.assert_array_equal(runs[0].read[0], runs[0].uninterrupted(8))
    notes = [line for line in capsys.readouterr().err.splitlines() if line.startswith("jaxtrain: note:")]
    assert notes == [f"jaxtrain: note: --init-from {source} goes on from its step 4: its optimizer state, the learning-rate "
                     "schedule at step 4 and not its data position, of data.format=sft (here text): this run's data starts "
                     "from its beginning; add --params-only to start at step 0 from its parameters alone"], notes


def test_init_from_a_checkpoint_older_than_data_format_takes_its_data_position(short_run, tmp_path, capsys):
    """A checkpoint whose config predates data.format (text, the only format then) is read as text: --init-from it
    takes its data position (it was taken for unreadable: a KeyError)."""
    from jaxtrain import train as train_lib
    from jaxtrain.cli import resolve_config

    step = _copy(short_run, tmp_path) / "checkpoints" / "4"
    meta = json.loads((step / "meta" / "metadata").read_text())
    del meta["config"]["data"]["format"]
    (step / "meta" / "metadata").write_text(json.dumps(meta))
    train_lib.train(resolve_config("tiny", None, None, [*SHORT, "train.steps=5"]), tmp_path / "new", init_from=step)
    assert "and its data position, 32 sequences read: this run reads on from the next one" in capsys.readouterr().err


def _as_sft_checkpoint(run_dir: Path) -> Path:
    """``run_dir``'s step 4, made a checkpoint of instruction data (the packer's position, data.format=sft)."""
    step = run_dir / "checkpoints" / "4"
    (step / "data" / "process_0-of-1.json").write_text(json.dumps({"parent": {"next_index": 30}, "next_row": 0, "counter": 32}))
    meta = json.loads((step / "meta" / "metadata").read_text())
    meta["config"]["data"]["format"] = "sft"
    (step / "meta" / "metadata").write_text(json.dumps(meta))
    return step


def test_a_resume_with_another_data_format_is_one_line_and_keeps_the_checkpoint(short_run, tmp_path):
    """A checkpoint of instruction data (data.format=sft: the packer's position) resumed as plain text, or the other way:
    one line, status 2, every file as it was (a QA report: the position did not fit, so the checkpoint was taken for
    damaged, moved aside, and the run trained again from step 0)."""
    run_dir = _copy(short_run, tmp_path)
    step = _as_sft_checkpoint(run_dir)
    before = _files(run_dir)
    result = run_cli("train", "tiny", "--run-dir", str(run_dir), *SHORT, "train.steps=5", cwd=tmp_path)
    assert result.returncode == 2, result.stderr[-3000:]
    assert result.stderr == (f"jaxtrain: error: checkpoint {step} holds the data position of data.format=sft, which another "
                             "format cannot take; give data.format=sft to go on with it, or start a new run from it with "
                             f"--init-from {step} (its data from the beginning; add --params-only for its parameters alone)\n")
    assert _files(run_dir) == before


def test_a_finished_run_started_again_says_so_and_writes_nothing(short_run, tmp_path):
    run_dir = _copy(short_run, tmp_path)
    before = _files(run_dir)
    result = run_cli("train", "tiny", "--run-dir", str(run_dir), *SHORT, "optim.lr=1e-3", cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"jaxtrain: {run_dir} is already at step 4 of train.steps=4, nothing to do; raise train.steps to train on\n" in result.stderr
    assert "parameters" not in result.stderr  # no start-up summary
    assert "resuming" not in result.stderr  # a QA report: it said "resuming from checkpoint step 4", then "nothing to do"
    assert _files(run_dir) == before


def test_experiment_file_runs_directly_with_same_arguments(tmp_path):
    run_dir = tmp_path / "run"
    env_python = sys.executable
    # no --devices: a 4-device mesh gets 4 simulated CPU devices (default_cpu_devices), not the 8 it could not use
    result = subprocess.run([env_python, str(REPO / "jaxtrain" / "experiments" / "tiny.py"), "--run-dir", str(run_dir),
                             "--mesh", "gpu1", "mesh.ici.fsdp=4", "--rules", "fsdp", *SHORT],
                            cwd=tmp_path, env=subprocess_env(), capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    saved = yaml.safe_load((run_dir / "config.yaml").read_text())
    assert saved["resolved"]["mesh"] == {"data": 1, "fsdp": 4, "tensor": 1, "stage": 1, "expert": 1} and saved["rules"] == "fsdp"
    assert saved["resolved"]["devices"] == 4
    assert len([r for r in _records(run_dir) if "loss" in r]) == 2
    # generate and export-hf on the run's own 4-device mesh, again without --devices
    generated = run_cli("generate", str(run_dir), "--prompt", "def", "--max-new-tokens", "2", cwd=tmp_path)
    assert generated.returncode == 0 and generated.stdout.startswith("def"), generated.stderr[-3000:]
    exported = run_cli("export-hf", str(run_dir), "--out", str(tmp_path / "hf"), cwd=tmp_path)
    assert exported.returncode == 0, exported.stderr[-3000:]
    # byte-level text: the NUL after each document is its bos and eos (transformers would assume 1 and 2)
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    generation = json.loads((tmp_path / "hf" / "generation_config.json").read_text())
    assert config["bos_token_id"] == config["eos_token_id"] == 0 and generation == {"bos_token_id": 0, "eos_token_id": 0}


def test_the_commands_tests_start_run_this_checkout(tmp_path):
    """run_cli's processes start outside the checkout, where the editable install's jaxtrain (the main checkout's)
    came first: a git worktree's command-line tests ran another checkout's code (a QA finding)."""
    found = subprocess.run([sys.executable, "-c", "import jaxtrain; print(jaxtrain.__file__)"], cwd=tmp_path,
                           env=subprocess_env(), capture_output=True, text=True, check=True).stdout
    assert found == f"{REPO / 'jaxtrain' / '__init__.py'}\n"


def test_train_simulates_as_many_cpu_devices_as_its_mesh_holds_up_to_the_default(monkeypatch):
    for name in distributed.CLUSTER_TASK_COUNT_VARS:
        monkeypatch.delenv(name, raising=False)
    assert default_cpu_devices(load_mesh_file("gpu1"), None) == 1
    assert default_cpu_devices(load_mesh_file("a100x4"), None) == 4
    assert default_cpu_devices(load_mesh_file("cpu2x4"), 2) == 4  # this process's part: ici
    assert default_cpu_devices(load_mesh_file("cpu2x4"), None) == 8  # one process holds ici x dcn
    # srun without the flags (jax's cluster detection joins the tasks): each task held ici x dcn, the one-line error
    # "make ici cover one process and dcn the process count" for a mesh that did
    monkeypatch.setenv("SLURM_STEP_NUM_TASKS", "2")
    assert default_cpu_devices(load_mesh_file("cpu2x4"), None) == 4
    # a cluster's mesh, or an unknown size, gets the default (and training asks for --devices in one line)
    assert default_cpu_devices(load_mesh_file("h100x64"), None) == DEFAULT_CPU_DEVICES
    assert default_cpu_devices(MeshConfig(ici=AxisSizes(data=-1)), None) == DEFAULT_CPU_DEVICES


def test_devices_replaces_a_device_count_the_users_xla_flags_set_and_keeps_their_other_flags(monkeypatch):
    """--devices 4 with an exported XLA_FLAGS that asks for 8 ran on 8, without a word."""
    monkeypatch.setenv("XLA_FLAGS", "--xla_dump_to=/tmp/d --xla_force_host_platform_device_count=8")
    simulate_cpu_devices(None)  # no --devices: the user's count stays
    assert os.environ["XLA_FLAGS"] == "--xla_dump_to=/tmp/d --xla_force_host_platform_device_count=8"
    simulate_cpu_devices(4)
    assert os.environ["XLA_FLAGS"] == "--xla_dump_to=/tmp/d --xla_force_host_platform_device_count=4"
