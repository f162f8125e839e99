"""Outputs that appear whole or not at all: written under a temporary name beside the target, renamed
when complete, removed on any error. A killed command never leaves a file that looks finished, and a completed one
is on disk before its name appears (synced, then renamed, then the rename synced), so a node losing power right
after a command finished does not leave an empty or truncated file under the final name."""

from __future__ import annotations

import contextlib
import errno
import os
import re
import shutil
import signal
import socket
import sys
import tempfile
import threading
from pathlib import Path
from typing import BinaryIO, Callable, Iterator, TypeVar

from jaxtrain.errors import UserError

T = TypeVar("T")


def _check_parent(path: Path, what: str) -> None:
    if not path.parent.is_dir():
        raise UserError(f"{what} {path}: directory {path.parent} does not exist; create it first or choose another path")


def _temporary(path: Path, what: str, make: Callable[..., T]) -> T:
    """``make`` (a tempfile function) beside ``path``, named with this host and process (``.NAME.HOST-PID.XXXX.tmp``),
    once the temporaries a dead process of this host left there are removed (``_remove_abandoned``); a UserError where
    the directory is not writable."""
    _remove_abandoned(path, what)
    try:
        return make(dir=path.parent, prefix=f".{path.name}.{socket.gethostname()}-{os.getpid()}.", suffix=".tmp")
    except OSError as e:
        raise UserError(f"{what} {path}: cannot write in {path.parent} ({e.strerror}); give a path in a writable directory") from None


def _remove_abandoned(path: Path, what: str) -> None:
    """Remove, with a note, the temporaries beside ``path`` of a process of this host that is gone: one killed while it
    wrote (SIGKILL, the out-of-memory killer; a SIGTERM cleans up) left its partial output hidden there, which the
    command run again wrote a second time beside (a token file of a large corpus: tens of GB). A live process's, or
    another host's (on a shared file system, where this host cannot tell whether its writer lives), are left alone,
    as are those named before 2026-12-06, which name no process. Containers that share a file system, a host name
    and not their process ids would take each other's live writers for dead: give them host names of their own
    (Docker's and Kubernetes' defaults are)."""
    owned = re.compile(rf"\.{re.escape(path.name)}\.{re.escape(socket.gethostname())}-(\d+)\.\w+\.tmp")
    with contextlib.suppress(OSError):  # an unreadable directory: the write itself says so
        for entry in path.parent.iterdir():
            if (match := owned.fullmatch(entry.name)) and not _alive(int(match[1])):
                if entry.is_dir() and not entry.is_symlink():
                    shutil.rmtree(entry)
                else:
                    entry.unlink(missing_ok=True)
                print(f"jaxtrain: note: removed {entry}, the partial {what} {path} of process {match[1]} on this host, "
                      "which stopped before it finished (killed)", file=sys.stderr)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)  # signal 0: only whether the process exists
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's
        return True
    return True


# fsync's errors from a file system that does not sync such a file (some FUSE and network file systems, for a
# directory): the output is then as durable as that file system makes it, and the command must not fail for it
UNSYNCABLE = {errno.EINVAL, errno.ENOTSUP, errno.EOPNOTSUPP, errno.ENOSYS}


# a write the machine refused, not a mistake in jaxtrain: what each means, and what to do about it
WRITE_FAILURES = {
    errno.ENOSPC: ("the disk is full", "free space there or write elsewhere"),
    errno.EDQUOT: ("the disk quota is exceeded", "free space there or write elsewhere"),
    errno.EFBIG: ("the file would pass the file size limit (ulimit -f)", "raise the limit or write elsewhere"),
    errno.EROFS: ("it is on a read-only file system", "write elsewhere"),
    errno.EACCES: ("this user may not write there", "write elsewhere"),
    errno.EIO: ("the device failed the write", "check the disk, or write elsewhere"),
}


@contextlib.contextmanager
def failed_writes_reported(path: Path, what: str, left: str = "nothing of it is left behind",
                           fix: str | None = None) -> Iterator[None]:
    """For the block, a write the machine refuses (``WRITE_FAILURES``: a full disk, a quota, a read-only file system)
    is one line naming ``what`` at ``path``, what the failure left on disk (``left``) and what to do (``fix``, else the
    failure's own), instead of a traceback."""
    try:
        yield
    except OSError as e:
        if e.errno not in WRITE_FAILURES:
            raise
        why, usual_fix = WRITE_FAILURES[e.errno]
        raise UserError(f"could not write {what} {path}: {why} ({os.strerror(e.errno)}); {left}; {fix or usual_fix}") from None


def _sync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    except OSError as e:
        if e.errno not in UNSYNCABLE:
            raise
    finally:
        os.close(fd)


def publish(temp: Path, path: Path) -> None:
    """Rename the finished ``temp`` (a file, or a directory with everything under it) to ``path`` durably: its
    contents synced first, so the new name never points at data still in the page cache; the directory holding
    the name synced after, so the rename itself survives a power loss."""
    if temp.is_dir():
        for directory, _, files in os.walk(temp, topdown=False):
            for name in files:
                _sync(Path(directory, name))
            _sync(Path(directory))
    else:
        _sync(temp)
    os.replace(temp, path)  # rename(2): replaces a file, or an empty directory
    _sync(path.parent)


def fresh_dir(path: Path, what: str) -> None:
    """An empty directory at ``path`` (an earlier attempt's removed), its parents made; a UserError where mkdir fails though
    the output path passed its access(2) check (a quota or a full disk; /proc, which looks writable to root)."""
    shutil.rmtree(path, ignore_errors=True)
    try:
        path.mkdir(parents=True)
    except OSError as e:
        raise UserError(f"{what}: cannot make the directory {path} ({e.strerror}); give a path in a writable directory") from None


@contextlib.contextmanager
def made_parents(path: Path, what: str) -> Iterator[None]:
    """Make the missing directories above ``path`` for the block; remove them again (where still empty) when it
    fails, so a failed command leaves no empty directories behind."""
    missing = [p for p in reversed(path.parents) if not p.exists()]
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise UserError(f"{what} {path}: cannot make the directory {path.parent} ({e.strerror}); give a path in a writable "
                        "directory") from None
    try:
        yield
    except BaseException:
        for directory in reversed(missing):
            with contextlib.suppress(OSError):  # not empty: something else wrote there meanwhile
                directory.rmdir()
        raise


@contextlib.contextmanager
def removed_on_failure(path: Path) -> Iterator[None]:
    """Remove ``path`` when the block fails: an output the block wrote whole that must not stay without the others."""
    try:
        yield
    except BaseException:
        path.unlink(missing_ok=True)
        raise


@contextlib.contextmanager
def atomic_file(path: Path, what: str = "output file") -> Iterator[BinaryIO]:
    """A binary file object that becomes ``path`` (replacing any file there) when the block ends without error."""
    _check_parent(path, what)
    f = _temporary(path, what, lambda **where: tempfile.NamedTemporaryFile(delete=False, **where))
    kept = "the file there before is kept" if path.exists() else "nothing of it is left behind"
    with failed_writes_reported(path, what, kept):
        try:
            with f:
                yield f
            os.chmod(f.name, 0o644)  # temporary files are created private
            publish(Path(f.name), path)
        except BaseException:
            Path(f.name).unlink(missing_ok=True)
            raise


@contextlib.contextmanager
def atomic_dir(path: Path, what: str = "output directory") -> Iterator[Path]:
    """A fresh directory that becomes ``path`` when the block ends without error. ``path`` must not exist
    or be an empty directory: nothing of the user's is overwritten."""
    if path.exists() and not (path.is_dir() and not any(path.iterdir())):
        raise UserError(f"{what} {path} already exists and is not an empty directory; choose a new path or remove it")
    _check_parent(path, what)
    temp = Path(_temporary(path, what, tempfile.mkdtemp))
    with failed_writes_reported(path, what):
        try:
            yield temp
            temp.chmod(0o755)  # temporary directories are created private
            publish(temp, path)
        except BaseException:
            shutil.rmtree(temp, ignore_errors=True)
            raise


class Terminated(SystemExit):
    """SIGTERM, raised where the command is, so that the temporary outputs are removed on the way out."""


@contextlib.contextmanager
def sigterm_cleans_up() -> Iterator[None]:
    """For the block, SIGTERM (``kill``, a scheduler) exits like Ctrl-C does, through the atomic writers' cleanup
    (status 143) instead of killing the process at once with its temporary files left beside the output. Only in
    the main thread, where Python runs signal handlers; the previous handler is restored after."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    said = False

    def terminate(signum, frame):
        nonlocal said
        if not said:  # once: a SIGTERM dropped in a gc callback comes again (__main__.redeliver_dropped_interrupts)
            print("jaxtrain: terminated", file=sys.stderr)
            said = True
        raise Terminated(128 + signal.SIGTERM)

    previous = signal.signal(signal.SIGTERM, terminate)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
