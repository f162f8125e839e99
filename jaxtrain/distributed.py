"""Several processes, one job: ``jax.distributed.initialize`` from explicit flags or a cluster's
environment. Must run before anything asks jax for devices."""

from __future__ import annotations

import contextlib
import errno
import os
import socket
import sys
import threading
import traceback
import zlib
from typing import Iterator

from jaxtrain.errors import UserError

# Environment variables that give the task count when a cluster manager started us (jax's own
# cluster detection then finds the coordinator): SLURM's srun, Open MPI's mpirun.
CLUSTER_TASK_COUNT_VARS = ("SLURM_STEP_NUM_TASKS", "OMPI_COMM_WORLD_SIZE")


def cluster_tasks() -> int:
    """The tasks a cluster manager started (srun, mpirun), which jax's cluster detection joins; 1 elsewhere."""
    return max((int(os.environ[v]) for v in CLUSTER_TASK_COUNT_VARS if os.environ.get(v, "").isdigit()), default=1)


def initialize(coordinator: str | None, num_processes: int | None, process_id: int | None) -> None:
    """Join a multi-process job: with ``--coordinator HOST:PORT --num-processes N --process-id I``, or by
    jax's cluster auto-detection when a cluster manager started several tasks. Nothing otherwise."""
    flags = {"--coordinator": coordinator, "--num-processes": num_processes, "--process-id": process_id}
    given = [k for k, v in flags.items() if v is not None]
    if given and len(given) < len(flags):
        missing = ", ".join(k for k in flags if k not in given)
        raise UserError(f"{', '.join(given)} given without {missing}; a multi-process run needs all three flags")
    if given and not 0 <= process_id < num_processes:
        raise UserError(f"--process-id {process_id} is outside 0..{num_processes - 1} (--num-processes {num_processes})")
    host, _, port_text = (coordinator or "").rpartition(":")
    # a port past 65535 was an OverflowError traceback from the probe below (isascii: int() reads other scripts' digits)
    if given and not (host and port_text.isascii() and port_text.isdigit() and 1 <= int(port_text) <= 65535):
        raise UserError(f"--coordinator {coordinator!r} must be HOST:PORT with a port in 1..65535, e.g. 127.0.0.1:12355 "
                        "(process 0's address)")
    if not given and cluster_tasks() == 1:
        return
    if given and process_id == 0:  # it serves the coordinator: a busy port was a traceback after a gRPC log line
        port = int(port_text)
        if (why := port_problem(port)) is not None:
            raise UserError(f"--coordinator {coordinator}: process 0 cannot serve the job's coordinator on port {port} ({why}); "
                            "give every process another port")

    import jax

    # CPU devices talk across processes through gloo; GPU and TPU backends ignore this setting.
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    timeout_s = join_timeout_s()
    where = f"the coordinator {coordinator}" if given else "the cluster's coordinator"
    count = num_processes if given else cluster_tasks()
    # jax aborts with a C++ stack trace when the job is not whole by its deadline: this one line comes first
    watchdog = threading.Timer(timeout_s, _give_up_joining, (where, count, timeout_s))
    watchdog.daemon = True
    watchdog.start()
    try:
        if given:
            jax.distributed.initialize(coordinator, num_processes, process_id, initialization_timeout=int(timeout_s) + 60)
        else:
            jax.distributed.initialize(initialization_timeout=int(timeout_s) + 60)
    finally:
        watchdog.cancel()


# not a user's mistake (2, which a k8s Job's podFailurePolicy takes as FailJob) nor a preemption (143): a failure the
# cluster retries, whose restart resumes from the latest committed checkpoint
LOST_PEER_EXIT_STATUS = 1
# how a collective among the processes reads when a peer is gone (gloo on CPUs, NCCL on GPUs, jax's coordination service)
_LOST_PEER_SIGNS = ("gloo", "nccl", "connection", "socket closed", "unavailable", "deadline_exceeded", "heartbeat", "coordination")


class LostPeer(Exception):
    """A collective with the job's other processes failed: one of them stopped or lost its connection."""

    def __init__(self, during: str, error: BaseException):
        first = (str(error).strip().splitlines() or [""])[0]
        super().__init__(f"{during} stopped ({type(error).__name__}: {first}): another process of the job stopped or lost its "
                         "connection (its own output says why); restart the job, which resumes from the latest committed "
                         "checkpoint (`jaxtrain checkpoints` lists them)")


def lost_peer(error: BaseException) -> bool:
    """Whether ``error`` is a collective that failed because another process of the job is gone."""
    import jax

    return (jax.process_count() > 1 and isinstance(error, jax.errors.JaxRuntimeError)
            and any(sign in str(error).lower() for sign in _LOST_PEER_SIGNS))


@contextlib.contextmanager
def failing_fast() -> Iterator[None]:
    """Around a command's work in a job of several processes: an error that ends it on one process ends that process at
    once, after its message (one line for a user's mistake, exit 2; a traceback, exit 1), and so the others' next
    collective, which each reports as a LostPeer. Left to Python's exit, it waited at jax's shutdown barrier for the
    others, still in the job's collectives, until jax aborted every process with C++ logs 5 minutes later."""
    try:
        yield
    except Exception as e:
        import jax

        if jax.process_count() == 1:
            raise
        if isinstance(e, UserError):
            print(f"jaxtrain: error: {e}", file=sys.stderr)
        else:
            traceback.print_exc()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(2 if isinstance(e, UserError) else 1)


def join_timeout_s() -> float:
    """How long a process waits for the whole job to join (``JAXTRAIN_JOIN_TIMEOUT_S``, default jax's 300 s)."""
    text = os.environ.get("JAXTRAIN_JOIN_TIMEOUT_S", "300")
    try:
        seconds = float(text)
    except ValueError:
        seconds = float("nan")
    if not 0 < seconds < float("inf"):
        raise UserError(f"JAXTRAIN_JOIN_TIMEOUT_S={text!r} must be a positive number of seconds, e.g. 600")
    return seconds


def _give_up_joining(where: str, count: int, timeout_s: float) -> None:
    print(f"jaxtrain: error: the job's {count} processes did not all join {where} within {timeout_s:g} s; start every "
          "process with the same --coordinator and --num-processes and its own --process-id (a process that stopped at "
          "start printed why), or raise JAXTRAIN_JOIN_TIMEOUT_S", file=sys.stderr, flush=True)
    os._exit(2)  # the main thread is inside jax's join, which no exception reaches


def port_problem(port: int) -> str | None:
    """Why a server of this process cannot listen on ``port`` (the job's coordinator, the Prometheus gauges), or None."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the servers set it
        try:
            probe.bind(("", port))
        except OSError as e:
            return bind_error_reason(e)
    return None


def bind_error_reason(error: OSError) -> str:
    return "already in use" if error.errno == errno.EADDRINUSE else error.strerror


def check_same_start(settings: dict[str, object]) -> None:
    """Every process of the job started with the same settings, or one line on each before anything is compiled or
    written. A hand-written cluster command that differs between processes (another train.steps, optim.lr, model
    shape or --run-dir) otherwise trained each process's copy of the weights differently without a word, deadlocked
    in a collective, or wrote two half run directories. One all-gather of a CRC per setting."""
    import jax

    if jax.process_count() == 1:
        return
    import numpy as np
    from jax.experimental import multihost_utils

    names = sorted(settings)

    def gathered(values: list) -> np.ndarray:  # (processes, values)
        digests = np.array([zlib.crc32(repr(v).encode()) for v in values], np.uint32)
        return np.asarray(multihost_utils.process_allgather(digests)).reshape(jax.process_count(), len(values))

    # the names first: the second gather needs the same length everywhere, which another jaxtrain version may not have
    names_digest = gathered([names])
    if (names_digest != names_digest[0]).any():
        raise UserError("the job's processes run different versions of jaxtrain (their config keys differ); install the same "
                        "jaxtrain on every node")
    digests = gathered([settings[name] for name in names])
    differ = [name for i, name in enumerate(names) if (digests[:, i] != digests[0, i]).any()]
    if differ:
        here = ", ".join(f"{name}={settings[name]}" for name in differ[:3]) + (f" and {len(differ) - 3} more" if len(differ) > 3 else "")
        raise UserError(f"the job's processes were started with different settings: this one, process {jax.process_index()}, "
                        f"has {here}, another process other values; start every process with the same command line, "
                        "only --process-id differs")
