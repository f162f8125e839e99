"""The persistent compilation cache (``train.compile_cache``): a program XLA compiled once is read back from disk
by the next process that compiles the same program, so a resume after preemption, a re-run of the same command or
another run of the same model, batch and mesh starts without compiling again.

This is jax's own cache (``jax.experimental.compilation_cache``); this module picks and checks its folder, turns it
on for the span of a command, and counts the programs it read back. The cache key covers the program, the
devices, jax / jaxlib and the XLA flags, so a changed model or mesh compiles afresh and never reads a stale entry.
Only process 0 writes entries; every process reads them.
"""

from __future__ import annotations

import contextlib
import os
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import jax
try:  # jax's private cache module: where a later jax moves it, entries are written as jax writes them
    from jax._src import lru_cache
except ImportError:
    lru_cache = None
from jax.experimental.compilation_cache import compilation_cache as jax_cache

from jaxtrain.errors import UserError

# jax's monitoring events: a compile that consults the cache, and one that found its program there
_LOOKUP, _HIT = "/jax/compilation_cache/compile_requests_use_cache", "/jax/compilation_cache/cache_hits"


def default_directory() -> Path:
    """``$XDG_CACHE_HOME/jaxtrain/xla`` (``~/.cache/jaxtrain/xla`` when unset): the user's cache folder, as pip
    and Hugging Face use it."""
    root = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(root) / "jaxtrain" / "xla"


def directory(setting: bool | str) -> Path | None:
    """The folder ``train.compile_cache`` names: ``auto`` or true the default one, false none, else that path."""
    if setting is False:
        return None
    if setting is True or setting == "auto":
        return default_directory()
    return Path(setting).expanduser()


def _writable(folder: Path) -> str | None:
    """None if ``folder`` exists (created here if need be) and takes files; else why not."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=folder):
            return None
    except OSError as e:
        return f"{type(e).__name__}: {e.strerror or e}"


@contextlib.contextmanager
def using(setting: bool | str) -> Iterator[Path | None]:
    """jax's persistent cache in the folder ``setting`` names while the block runs (the setting jax had is back
    afterwards); yields the folder, or None when off. A folder that cannot be written is one line: a UserError
    when the user named it, a warning (and no cache) for the default, so a read-only home never stops a run."""
    folder = directory(setting)
    problem = None if folder is None else _writable(folder)
    if problem and folder != default_directory():
        raise UserError(f"train.compile_cache: cannot write to {folder} ({problem}); give a writable folder, "
                        "or train.compile_cache=false to compile without a cache")
    if problem:
        print(f"jaxtrain: warning: compiling without a cache: cannot write to {folder} ({problem}); set "
              "train.compile_cache=PATH to a writable folder, or false", file=sys.stderr, flush=True)
        folder = None
    previous = jax.config.jax_compilation_cache_dir, jax.config.jax_enable_compilation_cache
    # off also skips computing each program's cache key (a hash of the whole program), not only the reads
    _configure(None if folder is None else str(folder), folder is not None)
    try:
        yield folder
    finally:
        _configure(*previous)


_put_in_place = getattr(getattr(lru_cache, "LRUCache", None), "put", None)


def _put_whole(cache: lru_cache.LRUCache, key: str, value: bytes) -> None:
    """jax's ``LRUCache.put``, the entry written under a temporary key and renamed when complete. jax writes it in place:
    a process killed while writing one (preempted during its first compile's write) or a disk filling up left it cut
    short, and every later run warned that it could not read it, compiled again and kept it, as jax never writes over
    an entry. An entry is put only after a compile that did not read it back, so a damaged one is replaced too."""
    temporary = f"{key}.{os.getpid()}.tmp"
    # the entry, and its access time where jax evicts
    written = [(cache.path / f"{temporary}{suffix}", cache.path / f"{key}{suffix}")
               for suffix in (lru_cache._CACHE_SUFFIX, lru_cache._ATIME_SUFFIX)]
    try:
        _put_in_place(cache, temporary, value)
    except BaseException:  # a full disk (jax warns): no cut-short temporary left either
        for path, _ in written:
            path.unlink(missing_ok=True)
        raise
    for path, final in written:
        if path.exists():
            path.replace(final)


# jax's private module, as of 0.10 and 0.11 alike: where a later jax changes it, its own put stays (entries written in
# place, as before), rather than jaxtrain failing to import
if all(hasattr(lru_cache, name) for name in ("LRUCache", "_CACHE_SUFFIX", "_ATIME_SUFFIX")):
    lru_cache.LRUCache.put = _put_whole


def _configure(folder: str | None, enabled: bool) -> None:
    jax.config.update("jax_compilation_cache_dir", folder)
    jax.config.update("jax_enable_compilation_cache", enabled)
    jax_cache.reset_cache()  # jax decides once per process whether a cache is in use; decide again now


@dataclass
class CacheCount:
    """Compiles that consulted the cache while counting, and how many found their program there. A program that
    compiles in under jax's ``jax_persistent_cache_min_compile_time_secs`` (1 s unless set) is not written, so it
    is compiled again each time."""

    lookups: int = 0
    hits: int = 0

    def record(self, folder: Path | None) -> dict | None:
        """For the start-up summary: the folder, the programs looked up and those read back; None when off."""
        return None if folder is None else {"folder": str(folder), "programs": self.lookups, "read_back": self.hits}


def describe(record: dict | None) -> str:
    """A ``CacheCount.record`` in words, for the start-up summary and ``jaxtrain generate``."""
    if record is None:
        return "no compilation cache"
    return f"{record['read_back']} of {record['programs']} programs read back from the compilation cache {record['folder']}"


@contextlib.contextmanager
def counting() -> Iterator[CacheCount]:
    """Count the cache lookups and hits of the compiles inside the block (none at all when the cache is off)."""
    count = CacheCount()

    def listen(event: str, **_) -> None:
        if event == _LOOKUP:
            count.lookups += 1
        elif event == _HIT:
            count.hits += 1

    jax.monitoring.register_event_listener(listen)
    try:
        yield count
    finally:
        jax.monitoring.unregister_event_listener(listen)
