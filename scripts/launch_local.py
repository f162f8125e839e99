#!/usr/bin/env python3
"""Run N processes of one jaxtrain command on this node, as one multi-process job.

    python scripts/launch_local.py --num-processes 2 --devices 4 -- jaxtrain train tiny --mesh cpu2x4 --run-dir runs/mp

Each process gets ``--coordinator 127.0.0.1:PORT --num-processes N --process-id I`` (and ``--devices``
simulated CPU devices when given). SIGTERM, SIGINT and SIGHUP are forwarded to every process, each once: the
processes run in a session of their own, so a Ctrl-C in the terminal reaches them only through this launcher (a
second SIGINT of the same Ctrl-C would abort the checkpoint the first asks for). A process that fails takes the
others down: they are sent SIGTERM so nobody waits forever on a collective, and the exit status is the failed
one's (a configuration error's 2, not the 143 of a process stopped after it; 130 after a Ctrl-C); else the first
non-zero status, else 0.
"""

from __future__ import annotations

import argparse
import shutil
import signal
import socket
import subprocess
import sys
import time


INTERRUPTED = 130  # 128 + SIGINT: a jaxtrain process stopped by Ctrl-C (with a checkpoint, or a second one without)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def as_shell_reports(status: int) -> int:
    """A process's status as a shell reports it: killed by signal N -> 128 + N."""
    return 128 - status if status < 0 else status


class OneLineErrors(argparse.ArgumentParser):
    """Errors in one line, exit status 2, as jaxtrain's own (argparse prints its usage first)."""

    def error(self, message):
        print(f"{self.prog}: error: {message} (see '{self.prog} --help')", file=sys.stderr)
        sys.exit(2)


def main(argv: list[str] | None = None) -> int:
    parser = OneLineErrors(description=__doc__.split("\n\n")[0])
    parser.add_argument("--num-processes", type=int, required=True, help="processes to start, at least 1")
    parser.add_argument("--devices", type=int, help="simulated CPU devices per process")
    parser.add_argument("--port", type=int, help="coordinator port on 127.0.0.1 (default: a free one)")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- jaxtrain train ...")
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("give the command after --, e.g. -- jaxtrain train tiny --mesh cpu2x4")
    if args.num_processes < 1:
        parser.error(f"--num-processes {args.num_processes}: give at least 1")
    # checked here, once: passed on, every process failed with its own copy of the error (and 0 was dropped unsaid)
    if args.devices is not None and args.devices < 1:
        parser.error(f"--devices {args.devices}: give at least 1")
    if args.port is not None and not 1 <= args.port <= 65535:
        parser.error(f"--port {args.port}: give a TCP port in 1..65535")
    if command[0] == "jaxtrain" and not shutil.which("jaxtrain"):
        command = [sys.executable, "-m", "jaxtrain.cli", *command[1:]]
    elif not shutil.which(command[0]):
        parser.error(f"command {command[0]!r} not found (not on PATH, or not executable)")
    coordinator = f"127.0.0.1:{args.port or free_port()}"
    extra = [] if args.devices is None else ["--devices", str(args.devices)]
    procs, received = [], []

    def forward(signum, frame):
        received.append(signum)
        for p in procs:
            if p.poll() is None:
                p.send_signal(signum)

    # before the processes start: a Ctrl-C meanwhile reaches the ones started (no traceback of this launcher's own)
    for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        if signal.getsignal(signum) is not signal.SIG_IGN:  # one ignored (nohup, a background job) stays ignored
            signal.signal(signum, forward)
    for i in range(args.num_processes):
        procs.append(subprocess.Popen([*command, "--coordinator", coordinator, "--num-processes", str(args.num_processes),
                                       "--process-id", str(i), *extra], start_new_session=True))
        for signum in received:  # came while the processes were starting: this one gets it too
            procs[-1].send_signal(signum)

    def status(first: int) -> int:
        # after a Ctrl-C, its 130, not the error of a process that lost the others (a second Ctrl-C stops them at once)
        statuses = [as_shell_reports(p.wait()) for p in procs]
        return INTERRUPTED if signal.SIGINT in received and INTERRUPTED in statuses else as_shell_reports(first)

    while any(p.poll() is None for p in procs):
        failed = [p.returncode for p in procs if p.poll() not in (None, 0)]
        if failed:  # the others would block in collectives: stop them, and report the failure, not their 143
            forward(signal.SIGTERM, None)
            return status(failed[0])
        time.sleep(0.1)
    return status(next((s for s in (p.wait() for p in procs) if s != 0), 0))


if __name__ == "__main__":
    sys.exit(main())
