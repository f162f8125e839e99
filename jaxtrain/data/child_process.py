"""Tokenizer work done in a child process, started fresh (spawned) rather than in the process that asks for it:
training a BPE (``train-tokenizer``: the Rust trainer never looks at signals, so a Ctrl-C waited for it) and encoding
the corpus a run trains on (``jaxtrain train``'s start on a CPU, where the process's malloc keeps one arena for every
thread, memory/host_malloc.py, and the tokenizers library's threads encoded 3.5x slower in it; its memory, freed,
would stay the run's too).

No jax here: the tokenizer commands start without it.
"""

from __future__ import annotations

import contextlib
import io
import os
import signal
import socket
import subprocess
import sys
from multiprocessing.connection import Connection
from typing import Callable, Iterable, Iterator, TypeVar

import numpy as np

from jaxtrain.data.documents import batches
from jaxtrain.errors import UserError

MESSAGE_SIZE = 1 << 20  # characters of text (or bytes) a message to a child holds
T = TypeVar("T")


# what the child runs: this process's sys.path, then the target and its arguments, from the pipe (pickled: the target
# by its module's name); not multiprocessing's spawn, which first runs the parent's main script again: a user's script
# calling the trainer without `if __name__ == "__main__":` trained all over again in the child
_CHILD_CODE = """import ctypes, os, signal, sys
from multiprocessing.connection import Connection
if sys.platform == "linux":  # killed with its parent: a SIGTERM's default action left it encoding on alone
    ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    if os.getppid() != int(sys.argv[2]):  # the parent died before that
        sys.exit()
connection = Connection(int(sys.argv[1]))
try:
    sys.path[:] = connection.recv()
    target, args = connection.recv()
except EOFError:  # the parent stopped before it sent the work
    sys.exit()
target(connection, *args)
"""


@contextlib.contextmanager
def spawned(target: Callable[..., None], args: tuple, name: str, died: Callable[[int | None], str]) -> Iterator[Connection]:
    """A child process (a fresh interpreter, ``name`` in its command line) running ``target(its end of a pipe,
    *args)``; yields this process's end. The child ignores SIGINT and SIGTERM: a Ctrl-C reaches the whole process
    group, and this process, not the child, answers it (one line, its cleanup), killing the child on its way out, as on
    any exception; on Linux the kernel kills it when this process dies (a signal's default action, SIGKILL). The pipe
    closing under this process (the child killed by the kernel, out of memory, or by another process) is a UserError,
    ``died(exit status)``."""
    ours, theirs = socket.socketpair()
    connection = Connection(ours.detach())
    child = None
    try:
        # blocked in the child for good (a signal mask is inherited through exec)
        mask = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})
        try:
            child = subprocess.Popen([sys.executable, "-c", _CHILD_CODE, str(theirs.fileno()), str(os.getpid()), name],
                                     pass_fds=[theirs.fileno()])
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, mask)
        theirs.close()
        connection.send(sys.path)
        connection.send((target, args))
        yield connection
    except (EOFError, BrokenPipeError, ConnectionResetError):
        raise UserError(died(child.wait())) from None
    except BaseException:  # a UserError, a signal (during the start too: other threads take it)
        if child is not None:
            child.kill()
        raise
    finally:
        # closed, a child that has not read all its input reads the end of it and exits: so does one this process lost
        # track of (a Ctrl-C inside Popen), which Popen reaps later
        connection.close()
        theirs.close()
        if child is not None:
            child.wait()


def answer(connection: Connection, work: Callable[[], tuple[object, list[np.ndarray]]], failed: str) -> None:
    """In the child: run ``work`` and send (None, its value) then its arrays (``send_array``), or (the failure that
    stopped it as one line, None): a UserError's own line, else ``failed``, the error's type and message (a library's,
    which may span lines). ``answered`` reads it."""
    try:
        value, arrays = work()
    except BaseException as e:  # the signals are blocked here: a UserError, an error of the library's
        line = str(e) if isinstance(e, UserError) else f"{failed}: " + " ".join(f"{type(e).__name__}: {e}".split())
        connection.send((line, None))
        return
    connection.send((None, value))
    for array in arrays:
        send_array(connection, array)


def answered(connection: Connection, arrays: int) -> tuple[object, list[np.ndarray]]:
    """The value and ``arrays`` arrays the child's ``answer`` sent; its failure raised as a UserError."""
    failure, value = connection.recv()
    if failure is not None:
        raise UserError(failure)
    return value, [receive_array(connection) for _ in range(arrays)]


def send_batches(connection: Connection, items: Iterable[T], size_of: Callable[[T], int]) -> None:
    """``items`` in lists of about MESSAGE_SIZE (``size_of`` each), then None: few messages, little held in them
    (``received_batches`` reads them)."""
    for batch in batches(items, MESSAGE_SIZE, size_of):
        connection.send(batch)
    connection.send(None)


def received_batches(connection: Connection) -> Iterator:
    """The items ``send_batches`` sent, as they arrive."""
    while (batch := connection.recv()) is not None:
        yield from batch


def send_array(connection: Connection, array: np.ndarray) -> None:
    """``array``'s type and length, then its bytes as they are in memory (``receive_array``)."""
    array = np.ascontiguousarray(array)
    connection.send((array.dtype.str, len(array)))
    with io.FileIO(connection.fileno(), "wb", closefd=False) as pipe:
        view = memoryview(array).cast("B")
        while view:
            view = view[pipe.write(view):]


def receive_array(connection: Connection) -> np.ndarray:
    """A 1-D array ``send_array`` sent, read straight into its own memory: a message (``Connection.recv``) is read
    whole into a buffer of its own first, which this process's malloc, keeping what it frees on a CPU, would then
    keep for the whole run."""
    dtype, length = connection.recv()
    array = np.empty(length, dtype)
    with io.FileIO(connection.fileno(), "rb", closefd=False) as pipe:
        view = memoryview(array).cast("B")
        while view:
            read = pipe.readinto(view)
            if not read:
                raise EOFError("the pipe closed inside an array")
            view = view[read:]
    return array
