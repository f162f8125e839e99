#!/usr/bin/env python3
"""Run N processes of one jaxtrain command on this node, as one multi-process job.

    python scripts/launch_local.py --num-processes 2 --devices 4 -- jaxtrain train tiny --mesh cpu2x4 --run-dir runs/mp

Each process gets ``--coordinator 127.0.0.1:PORT --num-processes N --process-id I`` (and ``--devices``
simulated CPU devices when given). SIGTERM and SIGINT are forwarded to every process; the exit status
is the worst of theirs (a non-zero one, else 0). A process that dies takes the others down: they are
sent SIGTERM so nobody waits forever on a collective.
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


def worst(statuses: list[int]) -> int:
    """The first non-zero status, as a shell reports it (killed by signal N -> 128 + N), else 0."""
    failed = [128 - s if s < 0 else s for s in statuses if s != 0]
    return failed[0] if failed else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--num-processes", type=int, required=True)
    parser.add_argument("--devices", type=int, help="simulated CPU devices per process")
    parser.add_argument("--port", type=int, help="coordinator port on 127.0.0.1 (default: a free one)")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- jaxtrain train ...")
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("give the command after --, e.g. -- jaxtrain train tiny --mesh cpu2x4")
    if command[0] == "jaxtrain" and not shutil.which("jaxtrain"):
        command = [sys.executable, "-m", "jaxtrain.cli", *command[1:]]
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
        if any(p.poll() not in (None, 0) for p in procs):
            forward(signal.SIGTERM, None)  # one failed: the others would block in collectives
            break
        time.sleep(0.1)
    return worst([p.wait() for p in procs])


if __name__ == "__main__":
    sys.exit(main())
