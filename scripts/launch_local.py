#!/usr/bin/env python3
"""Run N processes of one jaxtrain command on this node, as one multi-process job.

    python scripts/launch_local.py --num-processes 2 --devices 4 -- jaxtrain train tiny --mesh cpu2x4 --run-dir runs/mp

Each process gets ``--coordinator 127.0.0.1:PORT --num-processes N --process-id I`` (and ``--devices``
simulated CPU devices when given). SIGTERM and SIGINT are forwarded to every process. A process that
fails takes the others down: they are sent SIGTERM so nobody waits forever on a collective, and the exit
status is the failed one's (a configuration error's 2, not the 143 of a process stopped after it);
else the first non-zero status, else 0.
"""

from __future__ import annotations

import argparse
import shutil
import signal
import socket
import subprocess
import sys
import time


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def as_shell_reports(status: int) -> int:
    """A process's status as a shell reports it: killed by signal N -> 128 + N."""
    return 128 - status if status < 0 else status


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
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
    if command[0] == "jaxtrain" and not shutil.which("jaxtrain"):
        command = [sys.executable, "-m", "jaxtrain.cli", *command[1:]]
    elif not shutil.which(command[0]):
        parser.error(f"command {command[0]!r} not found (not on PATH, or not executable)")
    coordinator = f"127.0.0.1:{args.port or free_port()}"
    extra = ["--devices", str(args.devices)] if args.devices else []
    procs = [subprocess.Popen([*command, "--coordinator", coordinator, "--num-processes", str(args.num_processes),
                               "--process-id", str(i), *extra]) for i in range(args.num_processes)]

    def forward(signum, frame):
        for p in procs:
            if p.poll() is None:
                p.send_signal(signum)

    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGINT, forward)
    while any(p.poll() is None for p in procs):
        failed = [p.returncode for p in procs if p.poll() not in (None, 0)]
        if failed:  # the others would block in collectives: stop them, and report the failure, not their 143
            forward(signal.SIGTERM, None)
            for p in procs:
                p.wait()
            return as_shell_reports(failed[0])
        time.sleep(0.1)
    return next((as_shell_reports(s) for s in (p.wait() for p in procs) if s != 0), 0)


if __name__ == "__main__":
    sys.exit(main())
