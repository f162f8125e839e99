"""The ``jaxtrain`` command (also ``python -m jaxtrain``): ``cli.main`` in a process with the malloc
``JAXTRAIN_HOST_MALLOC`` asks for. For jemalloc the command starts itself again with it preloaded, before the CLI's
imports (about 1 s of them), so that happens once; ``cli.main`` alone never replaces the process that calls it."""

import contextlib
import os
import signal
import sys
import threading

from jaxtrain.atomic import Terminated
from jaxtrain.errors import UserError
from jaxtrain.memory import host_malloc

SIGNAL_OF = {KeyboardInterrupt: signal.SIGINT, Terminated: signal.SIGTERM}  # the exception a signal's handler raises


def redeliver_dropped_interrupts() -> None:
    """A Ctrl-C that lands while a garbage-collection callback runs (jax's, during the imports) is raised inside it,
    and Python drops it as unraisable: the command went on to train to the end (a QA report, 2 of 17 tries in the
    first 3 s); so did a SIGTERM under atomic.sigterm_cleans_up (tokenize ran to the end, exit status 0, a traceback
    printed). Such a signal is sent again, from another thread and a moment later: raised here, it would be dropped
    again."""
    previous = sys.unraisablehook

    def hook(unraisable, previous=previous):
        signum = next((signum for kind, signum in SIGNAL_OF.items() if isinstance(unraisable.exc_value, kind)), None)
        if signum is not None:
            resend = threading.Timer(0.1, os.kill, (os.getpid(), signum))  # once this hook has returned
            resend.daemon = True
            resend.start()
        else:
            previous(unraisable)

    sys.unraisablehook = hook


@contextlib.contextmanager
def interrupts_held():
    """A Ctrl-C during the block raised at its end, not inside it: raised inside jax's imports it could land in a C++
    extension's initialization (nanobind: "terminate called after throwing", exit status 134; once a segmentation
    fault; 2 of 26 tries at 1 to 2 s). Where this process ignores SIGINT, it still does."""
    held = []
    holding = signal.getsignal(signal.SIGINT) is signal.default_int_handler
    if holding:
        signal.signal(signal.SIGINT, lambda signum, frame: held.append(signum))
    try:
        yield
    finally:
        if holding:
            signal.signal(signal.SIGINT, signal.default_int_handler)
    if held:
        raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> int:
    """The command with ``argv`` (default: this process's arguments); `python jaxtrain/experiments/NAME.py` passes its own."""
    redeliver_dropped_interrupts()
    try:
        host_malloc.reexec_with_jemalloc()
    except UserError as e:
        print(f"jaxtrain: error: {e}", file=sys.stderr)
        return 2
    try:
        with interrupts_held():
            from jaxtrain import cli  # about 1 s of imports
    except KeyboardInterrupt:
        print("jaxtrain: interrupted", file=sys.stderr)
        return 130
    return cli.main(argv)


if __name__ == "__main__":
    sys.exit(main())
