"""Starting a job of several processes: the mistakes of a hand-written cluster command are one line on each
process, before anything is compiled or written (a QA report: they deadlocked, trained silently with mixed settings,
or aborted with C++ stack traces)."""

import json
import os
import socket
import subprocess
import sys
import time

import numpy as np
import pytest

from conftest import REPO, subprocess_env
from jaxtrain import distributed
from jaxtrain.errors import UserError

FAST = ["train.steps=2", "model.num_layers=2", "data.seq_len=32", "train.global_batch=8", "train.eval_batches=1"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start_process(index: int, port: int, run_dir, *overrides: str, env: dict | None = None,
                   program: tuple[str, ...] = ("-m", "jaxtrain.cli")) -> subprocess.Popen:
    """One process of a 2-process job on the cpu2x4 mesh, started by hand as a cluster command would start it."""
    return subprocess.Popen([sys.executable, *program, "train", "tiny", "--mesh", "cpu2x4", "--devices", "4",
                             "--coordinator", f"127.0.0.1:{port}", "--num-processes", "2", "--process-id", str(index),
                             "--run-dir", str(run_dir), *FAST, *overrides],
                            cwd=REPO, env=subprocess_env() | (env or {}), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def _one_line_error(process: subprocess.Popen) -> str:
    _, stderr = process.communicate(timeout=240)
    assert process.returncode == 2, stderr[-3000:]
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("jaxtrain: error: "), stderr[-3000:]
    return lines[0]


def test_processes_started_with_different_settings_stop_at_once_with_one_line_each(tmp_path):
    port = _free_port()
    first = _start_process(0, port, tmp_path / "run", "optim.lr=0.003")
    second = _start_process(1, port, tmp_path / "run", "optim.lr=0.03")
    said = [_one_line_error(first), _one_line_error(second)]
    assert said == [f"jaxtrain: error: the job's processes were started with different settings: this one, process {i}, has "
                    f"optim.lr={lr}, another process other values; start every process with the same command line, only "
                    "--process-id differs" for i, lr in ((0, 0.003), (1, 0.03))]
    assert not (tmp_path / "run").exists()
    port = _free_port()  # a run directory each: they wrote two half run directories and hung
    first, second = _start_process(0, port, tmp_path / "a"), _start_process(1, port, tmp_path / "b")
    assert f"has --run-dir={tmp_path / 'a'}, another" in _one_line_error(first)
    assert f"has --run-dir={tmp_path / 'b'}, another" in _one_line_error(second)
    assert list(tmp_path.iterdir()) == []
    port = _free_port()  # what each process starts from: one took another run's parameters alone, one its whole state
    first = _start_process(0, port, tmp_path / "run", "--init-from", str(tmp_path / "a"), "--params-only")
    second = _start_process(1, port, tmp_path / "run", "--init-from", str(tmp_path / "b"))
    assert f"has --init-from={tmp_path / 'a'}, --params-only=True, another" in _one_line_error(first)
    assert f"has --init-from={tmp_path / 'b'}, --params-only=False, another" in _one_line_error(second)
    assert list(tmp_path.iterdir()) == []


def test_a_job_that_never_becomes_whole_is_one_line_at_the_join_timeout(tmp_path):
    """Process 1 never starts (it failed, or was given another --num-processes): jax waited 5 minutes, then aborted
    with a C++ stack trace."""
    started, port = time.monotonic(), _free_port()
    alone = _start_process(0, port, tmp_path / "run", env={"JAXTRAIN_JOIN_TIMEOUT_S": "3"})
    assert _one_line_error(alone) == (
        f"jaxtrain: error: the job's 2 processes did not all join the coordinator 127.0.0.1:{port} "
        "within 3 s; start every process with the same --coordinator and --num-processes and its own --process-id (a process "
        "that stopped at start printed why), or raise JAXTRAIN_JOIN_TIMEOUT_S")
    assert time.monotonic() - started < 60 and not (tmp_path / "run").exists()


def test_a_busy_coordinator_port_is_one_line_before_jax_starts_the_job():
    with socket.socket() as busy:
        busy.bind(("", 0))
        busy.listen()
        port = busy.getsockname()[1]
        with pytest.raises(UserError, match=f"^--coordinator 127.0.0.1:{port}: process 0 cannot serve the job's coordinator on "
                                            f"port {port} \\(already in use\\); give every process another port$"):
            distributed.initialize(f"127.0.0.1:{port}", 2, 0)


@pytest.mark.parametrize("coordinator", ["host:99999", "host:0", ":12355", "host", "host:\u0663"])
def test_a_coordinator_that_is_not_host_and_port_is_one_line(coordinator):
    """A QA report: port 99999 was an OverflowError traceback."""
    with pytest.raises(UserError, match=f"^--coordinator '{coordinator}' must be HOST:PORT with a port in 1..65535"):
        distributed.initialize(coordinator, 2, 0)


@pytest.mark.parametrize("flags, message", [
    (("127.0.0.1:12355", 2, None), "--coordinator, --num-processes given without --process-id; a multi-process run needs all three flags"),
    ((None, None, 1), "--process-id given without --coordinator, --num-processes; a multi-process run needs all three flags"),
    (("127.0.0.1:12355", 2, 2), r"--process-id 2 is outside 0..1 \(--num-processes 2\)"),  # counted from 0
    (("127.0.0.1:12355", 2, -1), r"--process-id -1 is outside 0..1 \(--num-processes 2\)"),
])
def test_the_process_flags_come_all_three_with_an_index_below_the_count(flags, message):
    """Before jax waits for a job it can never make whole (or a TypeError on the missing flag's None)."""
    with pytest.raises(UserError, match=f"^{message}$"):
        distributed.initialize(*flags)


@pytest.mark.parametrize("value", ["0", "-5", "soon", "inf", "nan"])
def test_the_join_timeout_must_be_a_positive_number_of_seconds(value, monkeypatch):
    monkeypatch.setenv("JAXTRAIN_JOIN_TIMEOUT_S", value)
    with pytest.raises(UserError, match=f"^JAXTRAIN_JOIN_TIMEOUT_S='{value}' must be a positive number of seconds"):
        distributed.join_timeout_s()


def test_the_survivor_of_a_killed_process_says_so_in_one_line_and_exits_for_a_restart(tmp_path):
    """A process killed mid-run (its node lost): the other printed a Python traceback, then jax's C++ logs and a
    stack trace from its shutdown barrier, 50 s later. Now one line and status 1 (a failure the cluster retries, not
    a user's mistake), at once, and the same command resumes from the latest committed checkpoint.
    No save while the process is killed: one that dies while the other waits at a save's commit barrier (jax's
    coordination service, no collective) ends the other by jax's own abort after its heartbeat timeout (README,
    "What still ends in jax's own abort"; a CI run under heavy load once killed it there)."""
    port, run_dir = _free_port(), tmp_path / "run"
    survivor = _start_process(0, port, run_dir, "train.steps=500", "log.every=1", "checkpoint.every=1000")
    killed = _start_process(1, port, run_dir, "train.steps=500", "log.every=1", "checkpoint.every=1000")
    metrics = run_dir / "metrics.jsonl"
    while survivor.poll() is None and (not metrics.exists() or metrics.read_text().count('"loss"') < 3):
        time.sleep(0.1)
    killed.kill()
    killed.wait()
    started = time.monotonic()
    _, stderr = survivor.communicate(timeout=240)
    assert survivor.returncode == distributed.LOST_PEER_EXIT_STATUS, stderr[-3000:]
    assert time.monotonic() - started < 30, stderr[-3000:]
    errors = [line for line in stderr.splitlines() if line.startswith("jaxtrain: error: ")]
    assert len(errors) == 1 and "another process of the job stopped or lost its connection" in errors[0], stderr[-3000:]
    assert errors[0].endswith("restart the job, which resumes from the latest committed checkpoint (`jaxtrain checkpoints` lists them)")
    assert "Traceback" not in stderr and "Check failure" not in stderr, stderr[-3000:]


# process 1 of the job fails at its third step, as a bug or its host's disk would (a UserError: a mistake it alone sees)
FAILING_AT_STEP_3 = """
import os
import sys
import jax
from jaxtrain import cli
from jaxtrain.errors import UserError
from jaxtrain.observe import metrics

after_step = metrics.MetricsLog.after_step

def failing(self, step, *args, **kwargs):
    if jax.process_index() == 1 and step == 3:
        raise (UserError if os.environ["FAILURE"] == "mistake" else RuntimeError)("disk on fire")
    return after_step(self, step, *args, **kwargs)

metrics.MetricsLog.after_step = failing
sys.exit(cli.main(sys.argv[1:]))
"""


@pytest.mark.parametrize("failure", ["bug", "mistake"])
def test_an_error_on_one_process_ends_the_job_at_once_each_process_saying_why(failure, tmp_path):
    """An error on one process only (a bug, its disk): that process printed its error, then waited at jax's shutdown
    barrier for the others, still in the job's collectives, until jax aborted every process with C++ logs and stack
    traces 5 minutes later. Now it exits at once (a traceback and 1; a user's mistake one line and 2), and the others'
    next collective says so in one line."""
    port, started = _free_port(), time.monotonic()
    processes = [_start_process(i, port, tmp_path / "run", "train.steps=50", "log.every=1", env={"FAILURE": failure},
                                program=("-c", FAILING_AT_STEP_3)) for i in (0, 1)]
    survivor, failed = (p.communicate(timeout=240)[1] for p in processes)
    assert time.monotonic() - started < 120, (survivor[-3000:], failed[-3000:])
    if failure == "bug":
        assert processes[1].returncode == 1 and failed.rstrip().endswith("RuntimeError: disk on fire"), failed[-3000:]
    else:
        assert processes[1].returncode == 2 and failed.strip().splitlines()[-1] == "jaxtrain: error: disk on fire", failed[-3000:]
        assert "Traceback" not in failed
    assert processes[0].returncode == distributed.LOST_PEER_EXIT_STATUS, survivor[-3000:]
    errors = [line for line in survivor.splitlines() if line.startswith("jaxtrain: error: ")]
    assert len(errors) == 1 and "another process of the job stopped or lost its connection" in errors[0], survivor[-3000:]
    assert "Check failure" not in failed + survivor and "Terminating process" not in failed + survivor


# process 1 of the job: the background write of step 4's checkpoint fails, as its host's full disk would make it fail
# (Orbax's commit of the save raises before the barrier where the other processes wait for it)
FAILING_SAVE_OF_STEP_4 = """
import errno
import os
import sys
import jax
from orbax.checkpoint._src.checkpointers import async_checkpointer
from jaxtrain import cli

committing = async_checkpointer._background_wait_for_commit_futures

def failing(directory, *args, **kwargs):
    if jax.process_index() == 1 and directory.name.split(".")[0] == "4":
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    return committing(directory, *args, **kwargs)

async_checkpointer._background_wait_for_commit_futures = failing
sys.exit(cli.main(sys.argv[1:]))
"""


def test_a_checkpoint_write_failing_on_one_process_ends_the_job_at_once_saying_why(tmp_path):
    """A save whose write fails on one process only (its host's disk full): Orbax's failing thread waited at another
    barrier than the other processes' (the cleanup of its finalization), so the job stalled at its next save for
    Orbax's barrier timeout (20 minutes), then every process reported a lost peer with jax's abort logs, and never the
    disk. Now that process says so in the single-process line (status 2) at its next step, and the other's next
    collective says it stopped (status 1); the earlier checkpoint stays, the partial one is never committed."""
    port, started, run_dir = _free_port(), time.monotonic(), tmp_path / "run"
    processes = [_start_process(i, port, run_dir, "train.steps=40", "log.every=1", "checkpoint.every=2",
                                program=("-c", FAILING_SAVE_OF_STEP_4)) for i in (0, 1)]
    survivor, failed = (p.communicate(timeout=240)[1] for p in processes)
    assert time.monotonic() - started < 120, (survivor[-3000:], failed[-3000:])
    checkpoints = run_dir / "checkpoints"
    assert (processes[1].returncode, failed.strip().splitlines()) == (2, [
        f"jaxtrain: error: could not write checkpoint step 4 under {checkpoints} (OSError: [Errno 28] No space left on device); "
        "free disk space or fix permissions there; earlier checkpoints are intact (the newest: step 2)"]), failed[-3000:]
    assert processes[0].returncode == distributed.LOST_PEER_EXIT_STATUS, survivor[-3000:]
    errors = [line for line in survivor.splitlines() if line.startswith("jaxtrain: error: ")]
    assert len(errors) == 1 and "another process of the job stopped or lost its connection" in errors[0], survivor[-3000:]
    assert "Traceback" not in survivor and "Check failure" not in failed + survivor and "ERROR:absl" not in survivor
    # the failure surfaced at the next step, not at a later save: process 1 went no further than step 5 (or step 6's
    # save, which waits for step 4's), so process 0 logged no step past 6
    logged = [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines() if '"loss"' in line]
    assert 4 <= max(logged) <= 6, logged
    assert sorted(p.name for p in checkpoints.iterdir()) == ["2", "4.orbax-checkpoint-tmp"]  # a resume reads step 2


def test_a_mistake_only_process_0_sees_ends_the_job_at_once(tmp_path):
    """Process 0's Prometheus port in use (only process 0 serves one): it said so, then waited 5 minutes at jax's
    shutdown barrier for process 1, compiling and then in the first step's collectives, before jax aborted both. Now
    it exits at once; process 0 also serves the job's coordinator, so process 1 ends by jax's own abort, in seconds
    (README, "What still ends in jax's own abort")."""
    port, started = _free_port(), time.monotonic()
    with socket.socket() as busy:
        busy.bind(("", 0))
        busy.listen()
        serving = f"log.prometheus_port={busy.getsockname()[1]}"
        processes = [_start_process(i, port, tmp_path / "run", serving) for i in (0, 1)]
        failed, aborted = (p.communicate(timeout=240)[1] for p in processes)
    assert time.monotonic() - started < 60, (failed[-3000:], aborted[-3000:])
    assert processes[0].returncode == 2 and len(failed.strip().splitlines()) == 1, failed[-3000:]
    assert failed.startswith(f"jaxtrain: error: {serving}"), failed
    assert processes[1].returncode != 0


# process 1 of the job comes to its first step seconds after process 0, as when process 0 read the train step back from
# the compilation cache and process 1 compiled it (its cache key is its own: only process 0 writes entries) in a resumed
# run, which has no collective between compiling and the first step; here the delay is the start's last work
SLOW_START_ON_PROCESS_1 = """
import sys
import time
import jax
from jaxtrain import cli
from jaxtrain import data

eval_batches = data.eval_batches

def late(*args, **kwargs):
    if jax.process_index() == 1:
        time.sleep(6)
    return eval_batches(*args, **kwargs)

data.eval_batches = late
sys.exit(cli.main(sys.argv[1:]))
"""


def test_another_processs_longer_start_is_not_the_first_records_step_time(tmp_path):
    """A QA report: a resumed 2-process job recorded its first step at 52 tokens/s (8 s), not about 1,500: process 0 had
    read the train step back from the compilation cache and waited in that step's collectives for process 1, compiling
    it. The processes now start the steps' clock together."""
    port = _free_port()
    processes = [_start_process(i, port, tmp_path / "run", "log.every=1", program=("-c", SLOW_START_ON_PROCESS_1))
                 for i in (0, 1)]
    for process in processes:
        _, stderr = process.communicate(timeout=240)
        assert process.returncode == 0, stderr[-3000:]
    first = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[0])
    assert first["step"] == 1 and first["step_time_s"] < 4, first


def test_an_evaluation_of_a_split_ending_in_a_partial_batch_finishes_on_every_process(tmp_path):
    """A validation split of 12 sequences and train.global_batch=8: one whole batch and 4 rows. The first process's
    devices held those rows, the second's none, so the first evaluated a batch more and waited for the second at its
    collective for ever. Both processes now evaluate the whole batch alone.
    The records, which the first process writes, carry the fuller process's memory: the second's, which holds 3 GiB
    more (the first's own was recorded, so a job's fullest devices were not seen)."""
    tokens = np.random.default_rng(0).integers(0, 256, 3850, dtype=np.int32)  # 10%: 385 tokens, 12 windows of 32 + 1
    np.save(tmp_path / "tokens.npy", tokens)
    ballast = tmp_path / "ballast"  # imported by the second process at start-up, as Python imports any sitecustomize
    ballast.mkdir()
    (ballast / "sitecustomize.py").write_text("import numpy\nBALLAST = numpy.ones(3 * 2**30 // 8)\n")
    port, run_dir = _free_port(), tmp_path / "run"
    overrides = (f"data.path={tmp_path / 'tokens.npy'}", "data.val_fraction=0.1", "train.eval_batches=4")
    processes = [_start_process(0, port, run_dir, *overrides),
                 _start_process(1, port, run_dir, *overrides, env={"PYTHONPATH": f"{ballast}{os.pathsep}{subprocess_env()['PYTHONPATH']}"})]
    try:
        for process in processes:
            _, stderr = process.communicate(timeout=120)  # about 20 s
            assert process.returncode == 0, stderr[-3000:]
    finally:
        for process in processes:
            process.kill()
    evaluations = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if "eval_loss" in line]
    assert [(e["step"], e["eval_tokens"]) for e in evaluations] == [(2, 8 * 32)]
    (record,) = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if '"loss"' in line]
    assert record["memory_process"] == 1 and record["memory_in_use_gib"] > 3 and record["memory_source"] == "host_rss"
