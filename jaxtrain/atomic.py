"""Outputs that appear whole or not at all: written under a temporary name beside the target, renamed
when complete, removed on any error. A killed command never leaves a file that looks finished."""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from pathlib import Path
from typing import BinaryIO, Iterator

from jaxtrain.errors import UserError


def _check_parent(path: Path, what: str) -> None:
    if not path.parent.is_dir():
        raise UserError(f"{what} {path}: directory {path.parent} does not exist; create it first or choose another path")


@contextlib.contextmanager
def atomic_file(path: Path, what: str = "output file") -> Iterator[BinaryIO]:
    """A binary file object that becomes ``path`` (replacing any file there) when the block ends without error."""
    _check_parent(path, what)
    f = tempfile.NamedTemporaryFile(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp", delete=False)
    try:
        with f:
            yield f
        os.chmod(f.name, 0o644)  # temporary files are created private
        os.replace(f.name, path)
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
    temp = Path(tempfile.mkdtemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp"))
    try:
        yield temp
        temp.chmod(0o755)  # temporary directories are created private
        os.replace(temp, path)  # rename(2) replaces an empty directory
    except BaseException:
        shutil.rmtree(temp, ignore_errors=True)
        raise
