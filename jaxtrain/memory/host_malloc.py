"""XLA:CPU's per-step buffer kept by the process instead of mapped afresh every step (glibc's malloc).

XLA:CPU allocates the whole temporary buffer of each execution (every intermediate of a train step: 255 MiB for
the torch peer's) with ``posix_memalign``, from a thread of its pool, and frees it when the step ends. glibc serves
an allocation that large from a thread's own arena with a fresh ``mmap`` and returns it with ``munmap``, so every
step faults in and zeroes every page again: 67,000 page faults and 15-30% of the step's CPU time in the
kernel (README, "Host memory on CPUs"). With one arena (every thread allocates from the main heap), no ``mmap``'d
chunks and no trimming of the heap's top, the buffer a step frees is the next step's, already mapped.

The cost: memory the process freed stays its own until it exits, every thread allocates from one arena, and the
heap fragments: other allocations take parts of freed buffers, so it grows by a few more buffers before it settles
(the torch peer's resident memory 0.9 -> 1.8 GiB, ``make train``'s 1.6 -> 3.6 GB). Worth it where the device
memory is the host's, so ``auto`` (the default) applies it when jax computes on the CPU and leaves accelerator
hosts alone; ``JAXTRAIN_HOST_MALLOC=keep`` or ``system`` decides instead. It has to run before jax starts its CPU client's threads: a thread keeps the arena it first
allocated from, so the CLI, ``make bench`` and the tests apply it as they start.
"""

from __future__ import annotations

import ctypes
import importlib.metadata
import importlib.util
import os
import platform

from jaxtrain.errors import UserError

ENV = "JAXTRAIN_HOST_MALLOC"
CHOICES = ("auto", "keep", "system")
# mallopt(3) parameters and the largest trim threshold it takes (an int)
M_TRIM_THRESHOLD, M_MMAP_MAX, M_ARENA_MAX = -1, -4, -8
NEVER_TRIM = 2**31 - 1

_kept = False


def computes_on_cpu(environ=os.environ) -> bool:
    """Whether jax will compute on the CPU, decided before it starts: the first of ``JAX_PLATFORMS`` where that is
    set, else whether no accelerator plugin (CUDA, ROCm: ``jax_plugins``; TPU: libtpu) is installed."""
    platforms = environ.get("JAX_PLATFORMS", "").strip()
    if platforms:
        return platforms.split(",")[0].strip() == "cpu"
    plugins = importlib.metadata.entry_points(group="jax_plugins")
    return not plugins and importlib.util.find_spec("jax_plugins") is None and importlib.util.find_spec("libtpu") is None


def keep_freed_memory() -> bool:
    """glibc's malloc set to keep what it frees (module docstring); False where the C library is not glibc."""
    global _kept
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    libc = ctypes.CDLL(None)
    _kept = all(libc.mallopt(param, value) == 1 for param, value in
                ((M_ARENA_MAX, 1), (M_MMAP_MAX, 0), (M_TRIM_THRESHOLD, NEVER_TRIM)))
    return _kept


def configure(environ=os.environ) -> bool:
    """Apply ``JAXTRAIN_HOST_MALLOC`` (auto: keep when computing on the CPU); True when the memory is kept."""
    choice = environ.get(ENV, "auto")
    if choice not in CHOICES:
        raise UserError(f"{ENV}={choice!r} is not a choice; use one of {', '.join(CHOICES)} (auto keeps freed memory "
                        "when jax computes on the CPU)")
    if choice == "system" or (choice == "auto" and not computes_on_cpu(environ)):
        return False
    return keep_freed_memory()


def kept() -> bool:
    """Whether this process's malloc keeps what it frees (for the start-up summary)."""
    return _kept
