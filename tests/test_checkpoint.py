"""Checkpoints with real processes and real files: exact resume after SIGTERM or a Ctrl-C (SIGINT), on one process
and on two (gloo, coordinator on 127.0.0.1), a Ctrl-C before the first step, SIGKILL during an async save, a corrupted checkpoint, a full disk, resharding onto other
meshes, --init-from."""

import dataclasses
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import pytest
import yaml

from conftest import REPO, run_cli, subprocess_env, with_
from jaxtrain import checkpoint as checkpoint_lib
from jaxtrain.config import AxisSizes, MeshConfig, from_dict
from jaxtrain.distributed import LostPeer
from jaxtrain.errors import UserError
from jaxtrain.layout import make_layout
from jaxtrain.train import build, train

STEPS = 16
ARGS = [f"train.steps={STEPS}", "log.every=1", "train.eval_batches=1", "train.global_batch=8", "data.seq_len=32",
        "model.num_layers=2", "model.d_model=64", "model.num_kv_heads=4", "log.progress=false", "checkpoint.every=2", "checkpoint.keep=3",
        "log.peak_tflops=1"]  # no CPU matmul benchmark at each start: MFU is not what these runs test


def _start(run_dir, *extra, limit_file_size=None):
    """`jaxtrain train tiny` as a child process; stderr goes to RUN_DIR.stderr."""
    env = subprocess_env()
    # a "full disk": writes past the size limit fail with EFBIG (Python ignores SIGXFSZ)
    limit = ["prlimit", f"--fsize={limit_file_size}", "--"] if limit_file_size else []
    stderr = open(f"{run_dir}.stderr", "a")
    # SIGINT as a terminal leaves it, even where this test process ignores it (a background job of a script): the
    # child gets the default, and Python its KeyboardInterrupt handler
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        return subprocess.Popen([*limit, sys.executable, "-m", "jaxtrain.cli", "train", "tiny", "--run-dir", str(run_dir), *ARGS, *extra],
                                cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=stderr)
    finally:
        signal.signal(signal.SIGINT, previous)


def _stderr(run_dir) -> str:
    return open(f"{run_dir}.stderr").read()


def _losses(run_dir) -> list[tuple[int, float]]:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    lines = path.read_text().splitlines()
    return [(r["step"], r["loss"]) for r in map(json.loads, lines) if "loss" in r]


def _signal_after_step(proc, run_dir, step: int, signum=signal.SIGTERM) -> tuple[int, str]:
    """Send ``signum`` as soon as metrics.jsonl shows ``step``; the exit status and what the process wrote to stderr
    after the signal."""
    while proc.poll() is None and not any(s >= step for s, _ in _losses(run_dir)):
        time.sleep(0.005)
    before = len(_stderr(run_dir))
    proc.send_signal(signum)
    status = proc.wait(timeout=120)
    return status, _stderr(run_dir)[before:]


def _complete_steps(run_dir) -> list[int]:
    return [r["step"] for r in checkpoint_lib.describe(run_dir) if r["complete"]]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """An uninterrupted run of STEPS steps: (run dir, its config)."""
    run_dir = tmp_path_factory.mktemp("reference") / "run"
    assert _start(run_dir).wait(timeout=300) == 0, _stderr(run_dir)[-3000:]
    saved = yaml.safe_load((run_dir / "config.yaml").read_text())
    saved.pop("resolved")
    return run_dir, from_dict(saved)


@pytest.fixture(scope="module")
def trainer(reference):
    """The reference run's config compiled in this process, for runs that need no signals."""
    return build(reference[1])


def _state(path, cfg, devices=None, params_only=False):
    abstract = make_layout(cfg, devices).abstract_state()
    state = checkpoint_lib.restore_from(path, abstract, None, params_only=params_only)
    return state, abstract


def _assert_identical(a, b):
    leaves_a, leaves_b = jax.tree.leaves(a), jax.tree.leaves(b)
    assert len(leaves_a) == len(leaves_b)
    assert all(np.array_equal(np.asarray(x), np.asarray(y)) for x, y in zip(leaves_a, leaves_b))


def test_signal_at_several_steps_then_resume_is_bit_identical(reference, tmp_path):
    """SIGTERM (preemption) mid-run, then a Ctrl-C (SIGINT) in the resumed run: each time the step finishes, its
    checkpoint is committed, one line says so, and the status is 143 or 130; the same command resumes to the
    uninterrupted run's losses and state."""
    ref_dir, cfg = reference
    run_dir = tmp_path / "run"
    stops = []
    for stop_after, signum, status, word in ((2, signal.SIGTERM, 143, "preempted"), (7, signal.SIGINT, 130, "interrupted")):
        exit_status, said = _signal_after_step(_start(run_dir), run_dir, stop_after, signum)
        assert exit_status == status, _stderr(run_dir)[-3000:]
        stops.append(max(_complete_steps(run_dir)))
        assert said == f"jaxtrain: {word}: checkpoint of step {stops[-1]} committed; run the same command again to resume\n"
    assert stops == sorted(set(stops)) and stops[-1] < STEPS  # really stopped early, at different steps
    assert _start(run_dir).wait(timeout=300) == 0, _stderr(run_dir)[-3000:]
    assert all(f"resuming from checkpoint step {stop}" in _stderr(run_dir) for stop in stops)
    assert " was written on mesh " not in _stderr(run_dir)  # the same layout: no note of another
    assert _losses(run_dir) == _losses(ref_dir)  # every step once, same float32 bits
    _assert_identical(_state(run_dir, cfg)[0], _state(ref_dir, cfg)[0])


def _launch_two_processes(run_dir):
    """The reference run's command on 2 processes x 4 simulated CPU devices: the same 8-device mesh (cpu2x4: data
    across the processes)."""
    return subprocess.Popen([sys.executable, str(REPO / "scripts" / "launch_local.py"), "--num-processes", "2", "--devices", "4",
                             "--", sys.executable, "-m", "jaxtrain.cli", "train", "tiny", "--mesh", "cpu2x4",
                             "--run-dir", str(run_dir), *ARGS],
                            cwd=REPO, env=subprocess_env(), stdout=subprocess.DEVNULL, stderr=open(f"{run_dir}.stderr", "a"))


def test_two_processes_match_one_process_through_preemption(reference, tmp_path):
    """SIGTERM to the launcher reaches both processes, which agree on the step to stop at (jax's preemption sync
    point), save and exit 143; the same command resumes, and the losses are one process's."""
    run_dir = tmp_path / "multi"
    status, _ = _signal_after_step(_launch_two_processes(run_dir), run_dir, 2)
    assert status == checkpoint_lib.PREEMPTED_EXIT_STATUS, _stderr(run_dir)[-3000:]
    stopped = _losses(run_dir)[-1][0]
    assert stopped < STEPS
    assert _launch_two_processes(run_dir).wait(timeout=300) == 0, _stderr(run_dir)[-3000:]
    assert f"resuming from checkpoint step {stopped}" in _stderr(run_dir)
    multi, single = _losses(run_dir), _losses(reference[0])
    assert [s for s, _ in multi] == [s for s, _ in single] == list(range(1, STEPS + 1))
    # gloo sums across processes in another order than one process does: equal to float32 rounding
    assert all(abs(m - s) <= 1e-6 * abs(s) for (_, m), (_, s) in zip(multi, single))


def test_a_run_resumes_on_another_number_of_processes(reference, tmp_path):
    """A job requeued onto another number of nodes: a one-process checkpoint resumed on two processes, and theirs on
    one, each at its step with the data where it was (the losses are the uninterrupted run's). The data position is a
    file per process index and count; read only by those, the checkpoint was taken for damaged, moved aside, and the
    run trained again from step 0."""
    ref_dir, _ = reference
    run_dir = tmp_path / "run"
    shutil.copytree(ref_dir, run_dir)
    for step in (14, 16):
        shutil.rmtree(run_dir / "checkpoints" / str(step))
    assert _launch_two_processes(run_dir).wait(timeout=300) == 0, _stderr(run_dir)[-3000:]
    shutil.rmtree(run_dir / "checkpoints" / "16")  # 14, which the two processes wrote, is the latest
    assert _start(run_dir).wait(timeout=300) == 0, _stderr(run_dir)[-3000:]
    said = _stderr(run_dir)
    assert "resuming from checkpoint step 12" in said and "resuming from checkpoint step 14" in said
    # the same mesh across the processes: the note names the process counts, whose sums add in another order
    mesh = "mesh data 2 x fsdp 2 x tensor 2, rules fsdp_tp"
    for step, then, now in ((12, 1, 2), (14, 2, 1)):
        assert (f"jaxtrain: note: checkpoint {run_dir / 'checkpoints' / str(step)} was written on {mesh}, {then} process(es); "
                f"here {mesh}, {now} process(es): its state was read onto this layout exactly, but the steps from here sum in "
                "another order") in said, said[-3000:]
    assert "unreadable" not in said and not (run_dir / checkpoint_lib.QUARANTINE_DIR).exists()
    resumed, single = _losses(run_dir), _losses(ref_dir)
    assert [s for s, _ in resumed] == [s for s, _ in single] == list(range(1, STEPS + 1))
    assert all(abs(m - s) <= 1e-6 * abs(s) for (_, m), (_, s) in zip(resumed, single, strict=True))


def test_ctrl_c_before_the_first_step_is_one_line_and_writes_nothing(reference, tmp_path, monkeypatch, capsys):
    """A Ctrl-C while the steps compile (KeyboardInterrupt there, the trainer's first long wait): one line, status 130,
    no traceback; a fresh run's directory is not made, a resumed run's files stay byte-identical; SIGTERM and SIGINT
    are handed back."""
    from jaxtrain import cli
    from jaxtrain import train as train_lib

    def compile_interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(train_lib, "compile_steps", compile_interrupted)
    monkeypatch.setattr(os, "environ", dict(os.environ))  # the command's environment defaults stay in this test
    handlers = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)  # pytest-xdist's workers ignore SIGINT
    resumed = tmp_path / "resumed"
    shutil.copytree(reference[0], resumed)
    before = _files(resumed)
    for run_dir, again in ((tmp_path / "fresh", "start"), (resumed, f"resume from step {STEPS}")):
        capsys.readouterr()
        try:
            status = cli.main(["train", "tiny", "--run-dir", str(run_dir), *ARGS, f"train.steps={STEPS + 4}"])
        except KeyboardInterrupt:
            pytest.fail("the Ctrl-C left jaxtrain as a KeyboardInterrupt (a traceback)")
        assert status == checkpoint_lib.INTERRUPTED_EXIT_STATUS
        said = capsys.readouterr().err.splitlines()
        resuming = [f"jaxtrain: resuming from checkpoint step {STEPS} in {run_dir / 'checkpoints'} "] if run_dir == resumed else []
        assert [line[:len(r)] for line, r in zip(said, resuming)] == resuming  # the restore came before the compile
        assert said[len(resuming):] == [
            f"jaxtrain: interrupted before the first step, no checkpoint written; run the same command again to {again}"]
    assert not (tmp_path / "fresh").exists()
    assert _files(resumed) == before
    assert (signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)) == handlers


def test_sigkill_during_async_save_resumes_from_previous_complete(reference, tmp_path):
    run_dir = tmp_path / "run"
    proc = _start(run_dir, "checkpoint.every=1")
    ckpt_dir = run_dir / "checkpoints"

    def saving_after_a_complete_one():
        names = [p.name for p in ckpt_dir.iterdir()] if ckpt_dir.is_dir() else []
        return any(n.isdigit() for n in names) and any(".orbax-checkpoint-tmp" in n for n in names)

    while proc.poll() is None and not saving_after_a_complete_one():
        time.sleep(0.001)
    proc.kill()  # SIGKILL while a checkpoint directory is still temporary
    assert proc.wait() == -signal.SIGKILL
    partial = [r["step"] for r in checkpoint_lib.describe(run_dir) if not r["complete"]]
    assert partial, "the kill did not land during a save"
    assert _start(run_dir).wait(timeout=300) == 0, _stderr(run_dir)[-3000:]
    resumed = int(_stderr(run_dir).split("resuming from checkpoint step ")[1].split()[0])
    assert resumed < partial[0]
    assert _losses(run_dir) == _losses(reference[0])  # steps logged after the last checkpoint were redone, once


def test_orbax_replacing_a_partial_save_warns_nothing_and_other_absl_warnings_stay():
    """Resumed after a killed save, saving that step again: Orbax's warning that it removes the partial directory (printed
    among the progress lines) is dropped; absl's other warnings are not."""
    import logging

    from absl import logging as absl_logging

    checkpoint_lib._quiet_replaced_partial_saves()  # what each run's RunCheckpoints does
    seen = []
    handler = logging.Handler()
    handler.emit = seen.append
    logging.getLogger("absl").addHandler(handler)
    try:
        absl_logging.warning("Attempted to create temporary directory %s which already exists. Removing existing directory "
                             "since it is not finalized.", "/runs/x/checkpoints/8.orbax-checkpoint-tmp")
        absl_logging.warning("Attempted to create temporary directory %s", "/elsewhere")
    finally:
        logging.getLogger("absl").removeHandler(handler)
    assert [r.getMessage() for r in seen] == ["Attempted to create temporary directory /elsewhere"]


def test_asyncio_reports_of_orbax_work_left_behind_are_dropped_and_others_kept():
    """After a failed read or write, asyncio reports the tasks and futures Orbax left unretrieved (a CI run of the
    full-disk test: a `_GatheringFuture` from Orbax's write); its other reports still print."""
    import logging

    def failure(filename):
        try:
            exec(compile("raise ValueError('OUT_OF_RANGE: Error writing')", filename, "exec"))
        except ValueError:
            return sys.exc_info()

    def kept(message, filename):
        return checkpoint_lib._not_from_abandoned_read(logging.LogRecord("asyncio", logging.ERROR, "x", 1, message, (), failure(filename)))

    orbax = "/venv/site-packages/orbax/checkpoint/_src/serialization/serialization.py"
    assert not kept("_GatheringFuture exception was never retrieved\nfuture: <_GatheringFuture finished>", orbax)
    assert not kept("Task exception was never retrieved", orbax)
    assert not kept("Future exception was never retrieved\nfuture: <Future exception=ValueError('Error opening \"zarr\" driver')>",
                    "app.py")
    assert kept("_GatheringFuture exception was never retrieved", "/home/me/app.py")
    assert kept("Executing <Task> took 0.2 seconds", orbax)


def _truncate(run_dir, step, *, arrays_only=True):
    """A disk fault: the array chunk files of checkpoint ``step`` cut to 10 bytes (its index of names still reads); or,
    not ``arrays_only``, every data file cut in half, that index too."""
    state = run_dir / "checkpoints" / str(step) / "state"
    files = [p for p in state.glob("ocdbt.process_*/d/*")] if arrays_only else [p for p in state.rglob("*") if p.is_file() and "/d/" in str(p)]
    assert files
    for p in files:
        p.write_bytes(p.read_bytes()[:10 if arrays_only else p.stat().st_size // 2])


def _clean_reason(line: str) -> bool:
    """The reason a warning gives is TensorStore's own error, not Orbax's wrapper of it (a cut-off repr of the store)."""
    return "(ValueError: OUT_OF_RANGE: " in line and "TensorStore" not in line and "bound method" not in line


def test_corrupted_checkpoint_falls_back_with_one_warning(reference, trainer, tmp_path, capsys):
    run_dir = tmp_path / "run"
    shutil.copytree(reference[0], run_dir)
    _truncate(run_dir, STEPS)
    final = train(reference[1], run_dir, trainer)
    err = capsys.readouterr().err
    warnings = [line for line in err.splitlines() if "warning" in line]
    assert len(warnings) == 1 and f"checkpoint step {STEPS} is unreadable" in warnings[0] and _clean_reason(warnings[0]), warnings
    assert warnings[0].endswith(", falling back to the previous one")
    assert f"resuming from checkpoint step {STEPS - 2} " in err
    assert _losses(run_dir)[-2:] == _losses(reference[0])[-2:]  # steps 15, 16 recomputed, same bits
    _assert_identical(final.params, _state(reference[0], reference[1], params_only=True)[0])
    assert (run_dir / checkpoint_lib.QUARANTINE_DIR).is_dir()


def test_a_checkpoint_without_its_state_metadata_falls_back_with_one_warning_naming_it(reference, trainer, tmp_path, capsys, caplog):
    """A QA report: with the state item's _METADATA file gone, Orbax warned twice that the item "could not be restored"
    (provide a CheckpointHandlerRegistry) and the warning's reason was `AttributeError: 'NoneType' object has no
    attribute 'items'`."""
    run_dir = tmp_path / "run"
    shutil.copytree(reference[0], run_dir)
    (run_dir / "checkpoints" / str(STEPS) / "state" / "_METADATA").unlink()
    train(reference[1], run_dir, trainer)
    [warning] = [line for line in capsys.readouterr().err.splitlines() if "warning" in line]
    assert f"checkpoint step {STEPS} is unreadable (FileNotFoundError: the metadata of its state item (" in warning
    assert "/state/_METADATA) is missing or unreadable); moved to " in warning
    assert not [r for r in caplog.records if "could not be restored" in r.getMessage()]
    assert _losses(run_dir)[-2:] == _losses(reference[0])[-2:]


def test_a_checkpoint_read_that_runs_out_of_memory_is_one_line_and_moves_nothing(reference, trainer, tmp_path, monkeypatch):
    """A run resumed on devices too small for its state: the read's out-of-memory error (here raised, wrapped as Orbax
    wraps what a read raises) was taken for a damaged file, so every checkpoint of the run was moved aside in turn and
    training started again from step 0."""
    run_dir = tmp_path / "run"
    shutil.copytree(reference[0], run_dir)
    before = sorted(p.name for p in (run_dir / checkpoint_lib.CHECKPOINTS_DIR).iterdir())

    def out_of_memory(*args, **kwargs):
        try:
            raise RuntimeError("RESOURCE_EXHAUSTED: Out of memory while trying to allocate 4.00GiB.")
        except RuntimeError as e:
            raise ValueError("Failed to restore the checkpoint's items") from e

    monkeypatch.setattr(checkpoint_lib, "_read", out_of_memory)
    with pytest.raises(UserError, match=re.escape(f"checkpoint step {STEPS} did not fit in memory as it was read (RuntimeError: "
                                                  "RESOURCE_EXHAUSTED: Out of memory while trying to allocate 4.00GiB.); it is left "
                                                  "in place: resume on more devices")):
        train(reference[1], run_dir, trainer)
    assert sorted(p.name for p in (run_dir / checkpoint_lib.CHECKPOINTS_DIR).iterdir()) == before
    assert not (run_dir / checkpoint_lib.QUARANTINE_DIR).exists()


def test_the_command_resuming_past_a_damaged_checkpoint_prints_one_warning_and_no_tracebacks(reference, tmp_path):
    """`jaxtrain train` (a process of its own: pytest's hooks would catch what it prints): Orbax's abandoned reads,
    at the shape check before the compile and at the restore, printed about 40 tracebacks (`Event loop is closed`,
    `Future exception was never retrieved`) around the warning (a QA report)."""
    run_dir = tmp_path / "run"
    shutil.copytree(reference[0], run_dir)
    _truncate(run_dir, STEPS, arrays_only=False)  # the index too: the shape check's read of the metadata fails
    assert _start(run_dir).wait(timeout=300) == 0, _stderr(run_dir)[-3000:]
    err = _stderr(run_dir)
    assert "Traceback" not in err and "ERROR:asyncio" not in err and "never retrieved" not in err, err[:3000]
    [warning] = [line for line in err.splitlines() if "warning" in line]
    assert warning.startswith(f"jaxtrain: warning: checkpoint step {STEPS} is unreadable (ValueError: OUT_OF_RANGE: ")
    assert _losses(run_dir)[-2:] == _losses(reference[0])[-2:]


def test_when_no_checkpoint_is_readable_the_last_warning_says_training_starts_again(reference, tmp_path, capsys):
    """Each unreadable checkpoint is moved aside with a warning that the run falls back to the previous one; the last
    one's said so too, when there was none to fall back to and the run started again from step 0."""
    run_dir = tmp_path / "run"
    shutil.copytree(reference[0], run_dir)
    steps = checkpoint_lib.committed_steps(run_dir / checkpoint_lib.CHECKPOINTS_DIR)
    for step in steps:
        _truncate(run_dir, step)
    checkpoints = checkpoint_lib.RunCheckpoints(run_dir, reference[1].checkpoint, STEPS)
    try:
        assert checkpoints.restore_latest(make_layout(reference[1]).abstract_state(), None) is None
    finally:
        checkpoints.close()
    warnings = [line for line in capsys.readouterr().err.splitlines() if "warning" in line]
    assert len(warnings) == len(steps) > 1
    assert all(w.endswith(", falling back to the previous one") for w in warnings[:-1])
    assert warnings[-1].endswith(", no earlier checkpoint is readable: training starts from step 0")


def test_data_positions_the_saving_processes_disagree_on_are_unreadable(tmp_path):
    """Read on another process count, a checkpoint's data position is the one its processes agree on; where they
    disagree there is none to take (not an arbitrary one of them): the checkpoint is unreadable, and a resume falls back."""
    for index, read in enumerate((16, 24)):
        (tmp_path / f"process_{index}-of-2.json").write_text(json.dumps({"sequences": read}))
    with pytest.raises(ValueError, match="holds 2 different data positions and none for process 0 of 1$"):
        checkpoint_lib.DataPositionHandler().restore(tmp_path, item=object())


def _with_steps(trainer, steps: int):
    """The compiled trainer running fewer steps: the same programs (its schedule still that of STEPS)."""
    return dataclasses.replace(trainer, layout=dataclasses.replace(trainer.layout, cfg=with_(trainer.cfg, train={"steps": steps})))


def test_a_run_whose_checkpoints_are_all_unreadable_starts_again_at_the_first_sequence(reference, trainer, tmp_path):
    """Orbax restores a checkpoint's items in the order of their names, the data position before the state: each damaged
    checkpoint moved the data on to its position before its arrays failed to read, so a run left with none trained
    from step 0 on sequences from the middle of the stream, not the ones a new run reads."""
    run_dir = tmp_path / "run"
    shutil.copytree(reference[0] / checkpoint_lib.CHECKPOINTS_DIR, run_dir / checkpoint_lib.CHECKPOINTS_DIR)
    for step in checkpoint_lib.committed_steps(run_dir / checkpoint_lib.CHECKPOINTS_DIR):
        _truncate(run_dir, step)
    two = _with_steps(trainer, 2)
    train(two.cfg, run_dir, two)
    assert _losses(run_dir) == _losses(reference[0])[:2]


def test_a_run_whose_checkpoints_are_all_unreadable_starts_again_from_its_init_from(reference, trainer, tmp_path):
    """--init-from starts a run only while it has no checkpoint of its own; with every one of them unreadable, the
    same command starts again from what it names (here the reference run's parameters), not from train.seed."""
    run_dir, direct = tmp_path / "run", tmp_path / "direct"
    shutil.copytree(reference[0] / checkpoint_lib.CHECKPOINTS_DIR, run_dir / checkpoint_lib.CHECKPOINTS_DIR)
    for step in checkpoint_lib.committed_steps(run_dir / checkpoint_lib.CHECKPOINTS_DIR):
        _truncate(run_dir, step)
    two = _with_steps(trainer, 2)
    for each in (run_dir, direct):
        train(two.cfg, each, two, init_from=reference[0], params_only=True)
    assert _losses(run_dir) == _losses(direct) and _losses(run_dir)[0] != _losses(reference[0])[0]


def test_a_run_resumes_with_its_init_from_gone(reference, trainer, tmp_path, capsys):
    """--init-from is ignored once the run has checkpoints of its own, so the same command resumes after what it named
    is gone (a step directory of a run that trained on, removed by its checkpoint.keep); it was refused, naming it."""
    run_dir = tmp_path / "run"
    shutil.copytree(reference[0], run_dir)
    gone = tmp_path / "base" / checkpoint_lib.CHECKPOINTS_DIR / "4"
    train(reference[1], run_dir, trainer, init_from=gone)
    assert f"jaxtrain: note: --init-from {gone} is not used: the run resumes from its own checkpoint" in capsys.readouterr().err


def _files(run_dir) -> list:
    return sorted((p.relative_to(run_dir), p.stat().st_size) for p in run_dir.rglob("*"))


def test_readers_use_the_newest_readable_checkpoint_and_move_nothing(reference, tmp_path, capsys):
    """generate and export-hf on a run whose latest checkpoint is damaged: one warning line, the previous checkpoint, the
    run's files left as they are (only train moves its own unreadable checkpoints aside); export-hf --step of the
    damaged one, or no readable checkpoint at all: one line, exit 2, nothing written."""
    from jaxtrain import cli

    run_dir = tmp_path / "run"
    shutil.copytree(reference[0], run_dir)
    _truncate(run_dir, STEPS)
    before = _files(run_dir)

    def command(*args) -> tuple[int, list[str], str]:
        capsys.readouterr()
        status = cli.main([args[0], str(run_dir), *args[1:]])
        out, err = capsys.readouterr()
        return status, [line for line in err.splitlines() if line.startswith(("jaxtrain: warning", "jaxtrain: error"))], out

    status, lines, out = command("generate", "--prompt", "def ", "--max-new-tokens", "3")
    assert status == 0 and out.startswith("def ") and len(lines) == 1, lines
    assert lines[0].startswith(f"jaxtrain: warning: checkpoint step {STEPS} in {run_dir / 'checkpoints'} is unreadable (")
    assert lines[0].endswith(f"using step {STEPS - 2}, the newest readable one (left in place)") and _clean_reason(lines[0]), lines
    status, lines, _ = command("export-hf", "--out", str(tmp_path / "latest"))
    assert status == 0 and len(lines) == 1 and f"step {STEPS} in" in lines[0] and f"using step {STEPS - 2}" in lines[0], lines
    assert command("export-hf", "--out", str(tmp_path / "previous"), "--step", str(STEPS - 2))[:2] == (0, [])
    assert (tmp_path / "latest" / "model.safetensors").read_bytes() == (tmp_path / "previous" / "model.safetensors").read_bytes()

    status, lines, _ = command("export-hf", "--out", str(tmp_path / "damaged"), "--step", str(STEPS))
    assert status == 2 and len(lines) == 1, lines
    assert lines[0].startswith(f"jaxtrain: error: jaxtrain export-hf {run_dir / 'checkpoints' / str(STEPS)}: checkpoint step {STEPS} "
                               "is unreadable (ValueError: OUT_OF_RANGE: ") and f"`jaxtrain checkpoints {run_dir}` lists them" in lines[0]
    assert not list(tmp_path.glob("damaged*"))
    assert _files(run_dir) == before  # nothing moved aside, nothing written

    for step in (STEPS - 4, STEPS - 2):
        _truncate(run_dir, step, arrays_only=False)
    status, lines, out = command("generate", "--prompt", "def ", "--max-new-tokens", "3")  # within its 32 positions
    assert status == 2 and out == "" and len(lines) == 1, lines
    assert lines[0].startswith(f"jaxtrain: error: jaxtrain generate {run_dir}: no checkpoint there is readable (steps {STEPS}, "
                               f"{STEPS - 2}, {STEPS - 4}; step {STEPS}: ValueError: OUT_OF_RANGE: "), lines
    assert not (run_dir / checkpoint_lib.QUARANTINE_DIR).exists()


def test_a_save_that_a_stopped_process_broke_is_not_blamed_on_the_disk(tmp_path, monkeypatch):
    """Several processes: a save's collectives fail when another process dies (a QA run killed one of two: the other
    said to free disk space). One process: a failed save is the disk's, as above."""
    checkpoints = checkpoint_lib.RunCheckpoints(tmp_path, checkpoint_lib.CheckpointConfig(), 10, {})
    peer = jax.errors.JaxRuntimeError("UNKNOWN: Gloo AllGather failed: [external/gloo/transport/tcp/pair.cc:538] Connection closed by peer")
    assert "free disk space" in str(checkpoints._write_error(4, peer))
    monkeypatch.setattr(jax, "process_count", lambda: 2)
    lost = checkpoints._write_error(4, peer)
    assert isinstance(lost, LostPeer)  # not a UserError: its exit status 2 is a k8s Job's FailJob, where a restart resumes
    message = str(lost)
    try:  # a barrier of Orbax's background save that failed as the peer went: its TimeoutError from jax's error
        raise TimeoutError("Timed out while waiting for async_write_complete barrier.") from peer
    except TimeoutError as barrier:
        assert str(checkpoints._write_error(4, barrier)) == message
    assert message.startswith(f"the save of checkpoint step 4 under {tmp_path / 'checkpoints'} stopped (JaxRuntimeError: UNKNOWN: Gloo")
    assert message.endswith("another process of the job stopped or lost its connection (its own output says why); restart the "
                            "job, which resumes from the latest committed checkpoint (`jaxtrain checkpoints` lists them)")
    assert "free disk space" in str(checkpoints._write_error(4, OSError(28, "No space left on device")))
    checkpoints.close()


def test_the_newest_committed_save_is_reported_once_and_a_failed_or_unfinished_one_never(tmp_path, monkeypatch):
    """RunCheckpoints.newly_committed, which Prometheus's last checkpoint follows: of the saves finished since the last
    call, the newest one on disk; the one still in flight (only the newest can be: each save waits for the one before)
    waits for a later call; one that failed (no step directory) is never reported."""
    checkpoints = checkpoint_lib.RunCheckpoints(tmp_path, checkpoint_lib.CheckpointConfig(), 10, {})
    saving = [True]
    monkeypatch.setattr(checkpoints.manager, "is_saving_in_progress", lambda: saving[0])
    try:
        for step in (2, 4, 6):
            (tmp_path / "checkpoints" / str(step)).mkdir()
        checkpoints.uncommitted = [(2, 20.0), (4, 40.0), (6, 60.0)]
        assert checkpoints.newly_committed() == (4, 40.0) and checkpoints.uncommitted == [(6, 60.0)]
        assert checkpoints.newly_committed() is None  # step 6 still being written
        saving[0] = False
        assert checkpoints.newly_committed() == (6, 60.0) and checkpoints.newly_committed() is None
        checkpoints.uncommitted = [(6, 60.0), (8, 80.0)]  # step 8's save failed: no directory
        assert checkpoints.newly_committed() == (6, 60.0)
        checkpoints.uncommitted = [(8, 80.0)]
        assert checkpoints.newly_committed() is None and checkpoints.uncommitted == []
    finally:
        checkpoints.close()


def test_a_second_ctrl_c_blames_no_save_older_than_the_newest_checkpoint(tmp_path):
    """A temporary directory older than the newest committed checkpoint (a killed save of a step the run, resumed under
    another checkpoint.every, never saved again) is not the save a second Ctrl-C left: it says only where to resume."""
    checkpoints = checkpoint_lib.RunCheckpoints(tmp_path, checkpoint_lib.CheckpointConfig(), 10, {})
    try:
        for name in ("3.orbax-checkpoint-tmp", "4"):
            (checkpoints.directory / name).mkdir()
        checkpoints.preemption.interrupted = True
        assert str(checkpoints.interrupted_error()) == "interrupted again; run the same command again to resume from step 4"
    finally:
        checkpoints.close()


def test_a_failed_save_names_the_newest_checkpoint_left_or_that_there_is_none(tmp_path):
    """A QA report: the first save's failure said "earlier checkpoints are intact" where there were none."""
    checkpoints = checkpoint_lib.RunCheckpoints(tmp_path, checkpoint_lib.CheckpointConfig(), 10, {})
    try:
        full = OSError(28, "No space left on device")
        assert str(checkpoints._write_error(2, full)).endswith("fix permissions there; no earlier checkpoint")
        for name in ("2", "4", "6.orbax-checkpoint-tmp", "8"):  # 6 never committed; 8 is newer than the failed save
            (checkpoints.directory / name).mkdir()
        assert str(checkpoints._write_error(6, full)) == (
            f"could not write checkpoint step 6 under {checkpoints.directory} (OSError: [Errno 28] No space left on "
            "device); free disk space or fix permissions there; earlier checkpoints are intact (the newest: step 4)")
    finally:
        checkpoints.close()


@pytest.mark.parametrize("steps, failed", [(STEPS + 4, STEPS + 2), (STEPS + 1, STEPS + 1)], ids=["periodic", "final"])
def test_full_disk_is_one_line_error_and_earlier_checkpoints_stay(reference, tmp_path, steps, failed):
    """A periodic save's failure is seen by the next save, which waits for it; the final save's only by the wait at
    the end, where the run must not end as if its last step were saved."""
    run_dir = tmp_path / "run"
    shutil.copytree(reference[0], run_dir)
    before = _complete_steps(run_dir)
    status = _start(run_dir, f"train.steps={steps}", limit_file_size=200_000).wait(timeout=300)
    errors = [line for line in _stderr(run_dir).splitlines() if "jaxtrain: error:" in line]
    assert status == 2 and len(errors) == 1 and f"could not write checkpoint step {failed} " in errors[0], errors
    # no traceback, ours or Orbax's threads' (a QA run: 487 lines of them before the one line)
    assert "Traceback" not in _stderr(run_dir) and "ERROR:absl" not in _stderr(run_dir), _stderr(run_dir)[:3000]
    assert _complete_steps(run_dir) == before
    _assert_identical(_state(run_dir, reference[1])[0], _state(reference[0], reference[1])[0])


@pytest.mark.parametrize("rules, ici, devices", [("tp", (1, 1, 4), 4), ("dp", (2, 1, 1), 2), ("dp", (1, 1, 1), 1)])
def test_reshard_fsdp_tp_checkpoint_onto_other_meshes(reference, rules, ici, devices):
    ref_dir, cfg = reference
    saved, _ = _state(ref_dir, cfg)
    target = dataclasses.replace(cfg, rules=rules, mesh=MeshConfig(ici=AxisSizes(*ici)))
    restored, abstract = _state(ref_dir, target, jax.devices()[:devices])
    assert all(x.sharding == a.sharding for x, a in zip(jax.tree.leaves(restored), jax.tree.leaves(abstract)))
    _assert_identical(restored, saved)


def test_resharded_run_continues_training(reference, tmp_path):
    run_dir = tmp_path / "run"
    shutil.copytree(reference[0], run_dir)
    result = run_cli("train", "tiny", "--run-dir", str(run_dir), *ARGS, f"train.steps={STEPS + 2}", "--devices", "2",
                     "--rules", "dp", "mesh.ici.data=2", "mesh.ici.fsdp=1", "mesh.ici.tensor=1", cwd=REPO)
    assert result.returncode == 0, result.stderr[-3000:]
    assert (f"jaxtrain: note: checkpoint {run_dir / 'checkpoints' / str(STEPS)} was written on mesh data 2 x fsdp 2 x tensor 2, "
            "rules fsdp_tp, 1 process(es); here mesh data 2 x fsdp 1 x tensor 1, rules dp, 1 process(es): its state was read "
            "onto this layout exactly, but the steps from here sum in another order, so the losses follow the old layout's to "
            "rounding, not bit for bit; resume on the old mesh, rules and process count to continue bit for bit\n") in result.stderr
    assert [s for s, _ in _losses(run_dir)][-3:] == [STEPS, STEPS + 1, STEPS + 2]
    rows = checkpoint_lib.describe(run_dir)
    assert rows[-1]["mesh"] == {"data": 2, "fsdp": 1, "tensor": 1, "stage": 1, "expert": 1} and rows[-1]["rules"] == "dp"
    assert rows[0]["mesh"] == {"data": 2, "fsdp": 2, "tensor": 2, "stage": 1, "expert": 1} and rows[0]["rules"] == "fsdp_tp"


def test_jaxtrain_checkpoints_says_the_epoch_each_checkpoint_reached(reference, capsys):
    """Each checkpoint records the epochs of training data read by its step (8 sequences a step, over the split's
    sequences of data.seq_len=32), which `jaxtrain checkpoints` lists: the one to start again from at an epoch's end is
    found without arithmetic (a QA report: nothing said where in the data a checkpoint was)."""
    from jaxtrain import cli

    ref_dir, _ = reference
    size = json.loads((ref_dir / "summary.json").read_text())["epoch"]["size"]
    rows = checkpoint_lib.describe(ref_dir)
    assert [(r["step"], r["epoch"]) for r in rows] == [(step, step * 8 / size) for step in (STEPS - 4, STEPS - 2, STEPS)]
    assert cli.main(["checkpoints", str(ref_dir)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split()[:3] == ["step", "epoch", "size"]
    assert lines[-1].split()[:2] == [str(STEPS), f"{STEPS * 8 / size:.4f}"]


def test_init_from_full_state_continues_the_same_run(reference, trainer, tmp_path, capsys):
    ref_dir, cfg = reference
    run_dir = tmp_path / "new"
    source = ref_dir / "checkpoints" / str(STEPS - 4)
    train(cfg, run_dir, trainer, init_from=source)
    assert _losses(run_dir) == _losses(ref_dir)[STEPS - 4:]
    # what it took, in one line (a QA report: nothing said the step, optimizer state and data position came along)
    assert f"jaxtrain: note: --init-from {source} goes on from its step {STEPS - 4}: its optimizer state, the learning-rate " \
        f"schedule at step {STEPS - 4} and its data position, {(STEPS - 4) * 8} sequences read: this run reads on from the next " \
        "one; add --params-only to start at step 0 from its parameters alone\n" in capsys.readouterr().err
    train(cfg, run_dir, trainer, init_from=ref_dir / "checkpoints" / str(STEPS - 4))  # the same command again: its own checkpoint
    assert f"jaxtrain: note: --init-from {ref_dir / 'checkpoints' / str(STEPS - 4)} is not used: the run resumes from its own " \
        "checkpoint" in capsys.readouterr().err
    finished = tmp_path / "finished"  # a source already at train.steps: nothing would train, nothing is written
    with pytest.raises(UserError, match=rf"^--init-from {ref_dir} is at step {STEPS}, at or past train.steps={STEPS}, so nothing would "
                                        rf"train; raise train.steps above {STEPS}, or add --params-only"):
        train(cfg, finished, trainer, init_from=ref_dir)
    assert not finished.exists()


def test_init_from_params_only_starts_at_step_zero_with_those_weights(reference, trainer, tmp_path):
    ref_dir, cfg = reference
    frozen = with_(cfg, optim={"lr": 0.0}, train={"steps": 1})  # lr 0: the parameters cannot move
    final = train(frozen, tmp_path / "new", build(frozen), init_from=ref_dir, params_only=True)
    assert int(final.step) == 1  # a new run: its own step count, not the source's
    _assert_identical(final.params, _state(ref_dir, cfg, params_only=True)[0])


def _seed_scheme(step_dir):
    """The seed scheme a checkpoint's data position records (None: written before the record)."""
    (position,) = (step_dir / "data").glob("process_*.json")
    return json.loads(position.read_text()).get("seed_scheme")


def _from_before_spread_seeds(run_dir, step):
    """``run_dir``'s checkpoint ``step`` as jaxtrain wrote it before data.seed was spread (its position records no seed
    scheme), and the newest; a copy of that run directory, as it was, beside it."""
    for later in range(step + 2, STEPS + 1, 2):
        shutil.rmtree(run_dir / "checkpoints" / str(later))
    (position,) = (run_dir / "checkpoints" / str(step) / "data").glob("process_*.json")
    position.write_text(json.dumps({"sequences": json.loads(position.read_text())["sequences"]}))
    shutil.copytree(run_dir, run_dir.parent / f"{run_dir.name}-as-written")
    return run_dir.parent / f"{run_dir.name}-as-written"


def test_a_checkpoint_from_before_spread_seeds_goes_on_in_its_order(reference, trainer, tmp_path, capsys):
    """A checkpoint whose data position records no seed scheme (jaxtrain's before data.seed was spread): the run resumed
    from it says so in one line and reads the stream it began (other batches than a spread run's, so other losses), its
    own checkpoints record that scheme, and a resume from one of them reads the same batches again; --init-from it
    continues its stream in that order too, while a new run from it with another data.seed is spread. data.seed=0 is
    grain's seed 0 either way: its run resumes as before, and no note."""
    from jaxtrain.data.pipeline import PLAIN_SEEDS, SPREAD_SEEDS

    note = "predates spread shuffle seeds"
    ref_dir, cfg = reference
    assert cfg.data.seed == 0 and _seed_scheme(ref_dir / "checkpoints" / str(STEPS)) == SPREAD_SEEDS
    seed_0 = tmp_path / "seed-0"
    shutil.copytree(ref_dir, seed_0)
    _from_before_spread_seeds(seed_0, STEPS - 4)
    train(cfg, seed_0, trainer)
    assert note not in capsys.readouterr().err
    assert _losses(seed_0)[-4:] == _losses(ref_dir)[-4:] and _seed_scheme(seed_0 / "checkpoints" / str(STEPS)) == PLAIN_SEEDS

    seeded = with_(cfg, data={"seed": 1})
    seeded_trainer = build(seeded)
    spread = tmp_path / "spread"
    train(seeded, spread, seeded_trainer)
    old = tmp_path / "old"
    shutil.copytree(spread, old)
    as_written = _from_before_spread_seeds(old, STEPS - 4)
    capsys.readouterr()
    train(seeded, old, seeded_trainer)
    assert [line for line in capsys.readouterr().err.splitlines() if note in line] == [
        "jaxtrain: note: the checkpoint's data position predates spread shuffle seeds, so the run keeps its order (grain's seed is "
        "data.seed=1 itself, whose epoch e + 1 is seed 2's epoch e); new runs spread data.seed"]
    resumed = _losses(old)[-4:]
    assert [s for s, _ in resumed] == list(range(STEPS - 3, STEPS + 1)) and resumed[0] != _losses(spread)[STEPS - 4]
    assert _seed_scheme(old / "checkpoints" / str(STEPS)) == PLAIN_SEEDS
    again = tmp_path / "again"
    shutil.copytree(old, again)
    shutil.rmtree(again / "checkpoints" / str(STEPS))
    train(seeded, again, seeded_trainer)
    assert _losses(again)[-2:] == resumed[-2:]
    source = as_written / "checkpoints" / str(STEPS - 4)
    train(seeded, tmp_path / "continued", seeded_trainer, init_from=source)
    assert "this run reads on from the next one in its order from before data.seed was spread over grain's shuffle seeds; " \
        in capsys.readouterr().err
    assert _losses(tmp_path / "continued") == resumed
    assert _seed_scheme(tmp_path / "continued" / "checkpoints" / str(STEPS)) == PLAIN_SEEDS
    train(cfg, tmp_path / "reseeded", trainer, init_from=source)  # data.seed=0 here: another stream, a new one
    assert "(data.seed=0 here but 1 there): this run's data starts from its beginning" in capsys.readouterr().err
    assert _seed_scheme(tmp_path / "reseeded" / "checkpoints" / str(STEPS)) == SPREAD_SEEDS


def test_a_checkpoint_that_does_not_fit_the_state_is_refused_and_left_in_place(reference, tmp_path):
    """What the parameters' shape check before the compile cannot see: a resume switching to float16 (its loss scale
    is state the checkpoint lacks), --init-from a run of another model. One error naming what differs, every file
    left as it was: left to Orbax's read, each checkpoint is taken for damaged and moved aside in turn, and the run
    trains again from step 0."""
    ref_dir, cfg = reference
    run_dir = tmp_path / "run"
    shutil.copytree(ref_dir, run_dir)
    before = _files(run_dir)
    checkpoints = checkpoint_lib.RunCheckpoints(run_dir, cfg.checkpoint, STEPS)
    try:
        with pytest.raises(UserError, match=rf"^checkpoint step {STEPS} in .* was trained with another model.dtype than this "
                                            "config's float16 "):
            checkpoints.restore_latest(make_layout(with_(cfg, model={"dtype": "float16"})).abstract_state(), None)
    finally:
        checkpoints.close()
    assert _files(run_dir) == before
    for params_only in (False, True):  # --params-only too: its read of another shape was taken for a damaged checkpoint
        with pytest.raises(UserError, match=r"does not match the model: params/embed has shape \(\d+, 64\) in the checkpoint "
                                            r"but \(\d+, 128\) in this config"):
            _state(ref_dir, with_(cfg, model={"d_model": 128}), params_only=params_only)


def test_clipping_switched_on_resume_and_an_unclipped_runs_older_checkpoint_restore(reference, tmp_path):
    """optim.clip_norm=0 kept AdamW's state alone, clipping chained an empty state before it: a resume switching clipping
    on or off was refused as "does not match the model". Now one tree; a checkpoint of an unclipped run written before
    2026-12-05 (AdamW's state alone) restores too."""
    ref_dir, cfg = reference
    clipped, abstract = _state(ref_dir, cfg)
    _assert_identical(_state(ref_dir, with_(cfg, optim={"clip_norm": 0.0}))[0], clipped)
    import orbax.checkpoint as ocp

    older = ocp.CheckpointManager(tmp_path / "older" / "checkpoints",
                                  item_handlers={"state": ocp.PyTreeCheckpointHandler(), "meta": ocp.JsonCheckpointHandler()})
    older.save(STEPS, args=ocp.args.Composite(state=ocp.args.PyTreeSave(checkpoint_lib.saved_part(clipped).replace(
        opt_state=clipped.opt_state[1])), meta=ocp.args.JsonSave({"step": STEPS})))
    older.wait_until_finished()
    older.close()
    restored = checkpoint_lib.restore_from(tmp_path / "older", abstract, None, params_only=False)
    _assert_identical(restored, clipped)
    assert jax.tree.structure(restored) == jax.tree.structure(clipped)


def test_a_train_state_saved_before_its_spike_window_field_resumes_bit_for_bit(reference, trainer, tmp_path, capsys):
    """A checkpoint of a jaxtrain from before the spike guard (2026-12-05), whose train state had no ``spikes`` field, so
    its saved tree no such node: Orbax refused the tree, and the upgraded jaxtrain took each checkpoint for damaged, moved
    them all aside and trained again from step 0 (a QA report). It resumes, and --init-from takes it, bit for bit."""
    import flax.struct
    import orbax.checkpoint as ocp

    @flax.struct.dataclass
    class TrainStateBeforeTheSpikeGuard:
        step: jax.Array
        params: dict
        opt_state: object
        loss_scale: object = None
        frozen: object = None

    ref_dir, cfg = reference
    run_dir, step = tmp_path / "run", STEPS - 2
    shutil.copytree(ref_dir, run_dir)
    shutil.rmtree(run_dir / "checkpoints" / str(STEPS))
    state = _state(ref_dir / "checkpoints" / str(step), cfg)[0]
    older = ocp.CheckpointManager(tmp_path / "older", item_handlers={"state": ocp.PyTreeCheckpointHandler()})
    older.save(step, args=ocp.args.Composite(state=ocp.args.PyTreeSave(
        TrainStateBeforeTheSpikeGuard(step=state.step, params=state.params, opt_state=state.opt_state))))
    older.wait_until_finished()
    older.close()
    shutil.rmtree(run_dir / "checkpoints" / str(step) / "state")
    shutil.copytree(tmp_path / "older" / str(step) / "state", run_dir / "checkpoints" / str(step) / "state")
    shutil.copytree(run_dir, tmp_path / "as-written")
    manager = checkpoint_lib._manager(run_dir / "checkpoints", None)
    assert "spikes" not in manager.item_metadata(step)["state"] and "frozen" in manager.item_metadata(step)["state"]
    manager.close()

    capsys.readouterr()
    train(cfg, run_dir, trainer)
    assert f"jaxtrain: resuming from checkpoint step {step} " in capsys.readouterr().err
    assert not (run_dir / checkpoint_lib.QUARANTINE_DIR).exists()
    assert _losses(run_dir)[-2:] == _losses(ref_dir)[-2:]
    train(cfg, tmp_path / "continued", trainer, init_from=tmp_path / "as-written")
    assert _losses(tmp_path / "continued") == _losses(ref_dir)[-2:]


def test_a_checkpoint_of_a_later_jaxtrain_is_refused_in_one_line_and_left_in_place(reference, trainer, tmp_path, capsys):
    """Every checkpoint records its layout's format. One a later jaxtrain wrote in a layout this one does not read is one
    line for the run's resume, --init-from, generate and export-hf, every file as it was (a QA report: a jaxtrain without
    the record, given a later one's run, took each checkpoint for damaged, moved them all aside and stopped at config.yaml,
    the run's work gone from where a resume looks)."""
    from jaxtrain import cli

    ref_dir, cfg = reference
    assert checkpoint_lib.saved_meta(ref_dir / "checkpoints" / str(STEPS))[checkpoint_lib.FORMAT_KEY] == checkpoint_lib.CHECKPOINT_FORMAT
    run_dir = tmp_path / "run"
    shutil.copytree(ref_dir, run_dir)
    meta = run_dir / "checkpoints" / str(STEPS) / "meta" / "metadata"
    later = checkpoint_lib.CHECKPOINT_FORMAT + 1
    meta.write_text(json.dumps(json.loads(meta.read_text()) | {checkpoint_lib.FORMAT_KEY: later}))
    before = _files(run_dir)
    refusal = (f"checkpoint step {STEPS} in {run_dir / 'checkpoints'} was written by a later jaxtrain (checkpoint format {later}; "
               f"this one reads format {checkpoint_lib.CHECKPOINT_FORMAT} and earlier): use that jaxtrain, or a later one, for it; "
               "every checkpoint is left as it was")
    with pytest.raises(UserError) as refused:
        train(with_(cfg, train={"steps": STEPS + 2}), run_dir, trainer)
    assert str(refused.value) == refusal
    with pytest.raises(UserError, match=rf"^--init-from {run_dir / 'checkpoints' / str(STEPS)} was written by a later jaxtrain "):
        train(with_(cfg, train={"steps": STEPS + 2}), tmp_path / "new", trainer, init_from=run_dir)
    for command in (["generate", str(run_dir), "--prompt", "def ", "--max-new-tokens", "2"],
                    ["export-hf", str(run_dir), "--out", str(tmp_path / "exported")]):
        capsys.readouterr()
        assert cli.main(command) == 2
        errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("jaxtrain: error")]
        assert len(errors) == 1 and "was written by a later jaxtrain (checkpoint format" in errors[0], errors
    assert _files(run_dir) == before and not (tmp_path / "new").exists() and not list(tmp_path.glob("exported*"))


def test_checkpoints_command_lists_steps(reference):
    result = run_cli("checkpoints", str(reference[0]), cwd=REPO)
    assert result.returncode == 0, result.stderr
    rows = result.stdout.splitlines()[1:]
    assert [int(r.split()[0]) for r in rows] == [STEPS - 4, STEPS - 2, STEPS]
    assert all(" yes " in r and "data 2 x fsdp 2 x tensor 2 / fsdp_tp (1 process(es))" in r and "MiB" in r for r in rows)


def test_checkpoints_command_without_checkpoints_says_so_in_one_line(tmp_path, capsys):
    from jaxtrain import cli

    (tmp_path / "run" / checkpoint_lib.CHECKPOINTS_DIR).mkdir(parents=True)
    assert cli.main(["checkpoints", str(tmp_path / "run")]) == 0
    printed = capsys.readouterr()
    assert printed.out == "" and printed.err == f"jaxtrain: {tmp_path / 'run' / 'checkpoints'} holds no checkpoint yet\n"
    assert cli.main(["checkpoints", str(tmp_path / "nothing")]) == 2
    assert capsys.readouterr().err == f"jaxtrain: error: {tmp_path / 'nothing'} does not exist; give the --run-dir of a training run\n"


def test_unwritable_checkpoint_directory_is_one_line_error(tmp_path):
    # root ignores permission bits, so the directory is made impossible to create instead
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / checkpoint_lib.CHECKPOINTS_DIR).write_text("not a directory")
    status = _start(run_dir).wait(timeout=300)
    lines = _stderr(run_dir).strip().splitlines()
    assert status == 2 and len(lines) == 1, lines
    assert lines[0].startswith("jaxtrain: error: checkpoint directory") and "is not writable" in lines[0]
    assert not (run_dir / "metrics.jsonl").exists()


def test_replicas_share_the_writing_of_large_arrays_only(tmp_path):
    """Orbax splits a replicated array's writing between its replicas by slicing it on each device, compiling a
    program per shape and device; below REPLICA_SLICE_MIN_BYTES a part, one replica writes the array whole."""
    import orbax.checkpoint as ocp
    from jax.sharding import NamedSharding, PartitionSpec

    replicated = NamedSharding(jax.make_mesh((8,), ("data",)), PartitionSpec())
    parts = {"small": 8 * checkpoint_lib.REPLICA_SLICE_MIN_BYTES // 4 - 8, "large": 8 * checkpoint_lib.REPLICA_SLICE_MIN_BYTES // 4}
    compiles = []

    def listen(event, _, **__):
        if event.endswith("backend_compile_duration"):
            compiles.append(event)

    jax.monitoring.register_event_duration_secs_listener(listen)
    for name, elements in parts.items():  # float32 elements: 8 parts of just under / exactly the threshold
        tree = {name: jax.device_put(np.arange(elements, dtype=np.float32), replicated)}
        before = len(compiles)
        manager = checkpoint_lib._manager(tmp_path / name, dataclasses.replace(checkpoint_lib.CheckpointConfig(), async_save=False))
        manager.save(1, args=ocp.args.Composite(state=ocp.args.PyTreeSave(tree)), force=True)
        manager.wait_until_finished()
        parts[name] = len(compiles) - before
        restored = manager.restore(1, args=ocp.args.Composite(state=checkpoint_lib._state_restore(tree))).state
        assert np.array_equal(np.asarray(restored[name]), np.asarray(tree[name]))
        manager.close()
    jax.monitoring.unregister_event_duration_listener(listen)
    assert parts["small"] == 0 and parts["large"] >= 8, parts  # the large one: a slice per device


def test_switching_to_or_from_float16_on_resume_names_model_dtype():
    """float16 keeps a loss scale in the train state: resuming across that switch said only "loss_scale/counter has shape
    absent in the checkpoint", nothing about model.dtype."""
    scalar = jax.ShapeDtypeStruct((), np.float32)
    plain = {"params": {"w": jax.ShapeDtypeStruct((4, 4), np.float32)}, "step": scalar}
    float16 = plain | {"loss_scale": {"counter": scalar, "scale": scalar}}
    for saved, wanted, said in (
            (plain, float16, "was trained with another model.dtype than this config's float16 (it holds no loss scale)"),
            (float16, plain, "was trained with model.dtype=float16 (it holds a loss scale) and this config has another dtype")):
        with pytest.raises(UserError) as e:
            checkpoint_lib.check_same_shapes(saved, wanted, "checkpoint step 2")
        assert str(e.value).startswith(f"checkpoint step 2 {said}: a run cannot switch to or from float16 on resume")


def test_a_second_train_of_a_run_directory_still_training_is_one_line_and_changes_nothing(reference, tmp_path, capsys):
    """A job requeued while its first attempt still runs, or a command started twice: the second `jaxtrain train` of the
    run directory is refused before it writes anything (both trained on, each removing the other's saves in progress:
    Orbax replaces a step's temporary directory it finds, and the loser's error blamed the disk). The first one's
    lock goes with it, and the same command then resumes."""
    from jaxtrain import cli

    run_dir = tmp_path / "run"
    shutil.copytree(reference[0], run_dir)
    before = _files(run_dir)
    command = ["train", "tiny", "--run-dir", str(run_dir), *ARGS]
    still_training = checkpoint_lib.RunCheckpoints(run_dir, reference[1].checkpoint, STEPS)
    try:
        capsys.readouterr()
        assert cli.main(command) == 2
        assert capsys.readouterr().err.splitlines() == [
            f"jaxtrain: error: --run-dir {run_dir} is in use by another jaxtrain train command, still running; wait for it to "
            "stop (or stop it), or give another --run-dir"]
    finally:
        still_training.close()
    assert _files(run_dir) == before
    assert cli.main(command) == 0 and "nothing to do" in capsys.readouterr().err
