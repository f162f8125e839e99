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
hosts alone; ``JAXTRAIN_HOST_MALLOC=keep`` or ``system`` decides instead. It has to run before jax starts its CPU
client's threads: a thread keeps the arena it first allocated from, so the CLI, ``make bench`` and the tests apply
it as they start.

``JAXTRAIN_HOST_MALLOC=jemalloc`` swaps glibc's malloc for jemalloc, told never to give freed pages back: as fast,
and it fragments less (the peer's resident memory 1.3 GiB against glibc kept's 1.7-2.0). A C library's malloc is
chosen only when a process starts (``LD_PRELOAD``), so the ``jaxtrain`` command and ``make bench`` start
themselves again with it preloaded (``reexec_with_jemalloc``); a process that did not (a script calling
``cli.main``) gets a one-line error that says how. A jemalloc the user preloaded is detected and reported as such.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import importlib.metadata
import importlib.util
import os
import platform
import sys

from jaxtrain.errors import UserError

ENV = "JAXTRAIN_HOST_MALLOC"
CHOICES = ("auto", "keep", "jemalloc", "system")
# mallopt(3) parameters and the largest trim threshold it takes (an int)
M_TRIM_THRESHOLD, M_MMAP_MAX, M_ARENA_MAX = -1, -4, -8
NEVER_TRIM = 2**31 - 1
# jemalloc told never to give dirty pages back: with its defaults it hands allocations above 8 MiB back at once,
# every step's buffer included (README, "Host memory on CPUs")
JEMALLOC_CONF = "dirty_decay_ms:-1,muzzy_decay_ms:-1"
# set in the environment of the process `reexec_with_jemalloc` starts, so that one failing to preload it stops
REEXECUTED = "JAXTRAIN_HOST_MALLOC_REEXECUTED"

_kept = False


def computes_on_cpu(environ=os.environ) -> bool:
    """Whether jax will compute on the CPU, decided before it starts: the first of ``JAX_PLATFORMS`` where that is
    set, else whether no accelerator plugin (CUDA, ROCm: ``jax_plugins``; TPU: libtpu) is installed."""
    platforms = environ.get("JAX_PLATFORMS", "").strip()
    if platforms:
        return platforms.split(",")[0].strip() == "cpu"
    plugins = importlib.metadata.entry_points(group="jax_plugins")
    return not plugins and importlib.util.find_spec("jax_plugins") is None and importlib.util.find_spec("libtpu") is None


def _jemalloc_option(name: str) -> int | None:
    """A signed integer option of the jemalloc this process runs (``mallctl``, e.g. ``opt.dirty_decay_ms``); None
    where that jemalloc has no such option (before 5.0)."""
    value, size = ctypes.c_ssize_t(), ctypes.c_size_t(ctypes.sizeof(ctypes.c_ssize_t))
    failed = ctypes.CDLL(None).mallctl(name.encode(), ctypes.byref(value), ctypes.byref(size), None, ctypes.c_size_t(0))
    return None if failed else value.value


def allocator() -> str:
    """This process's malloc: ``jemalloc`` where it is loaded (preloaded: its ``mallctl`` is in the global
    namespace), else ``glibc``, else ``other``."""
    if hasattr(ctypes.CDLL(None), "mallctl"):
        return "jemalloc"
    return "glibc" if platform.system() == "Linux" and platform.libc_ver()[0] == "glibc" else "other"


def keep_freed_memory() -> bool:
    """glibc's malloc set to keep what it frees (module docstring); False where the C library is not glibc."""
    if allocator() != "glibc":
        return False
    libc = ctypes.CDLL(None)
    return all(libc.mallopt(param, value) == 1 for param, value in
               ((M_ARENA_MAX, 1), (M_MMAP_MAX, 0), (M_TRIM_THRESHOLD, NEVER_TRIM)))


def find_jemalloc() -> str | None:
    """The jemalloc shared library the dynamic linker knows (``ldconfig``'s cache), or None."""
    return ctypes.util.find_library("jemalloc")


def jemalloc_environ(environ=os.environ) -> dict[str, str]:
    """``environ`` with jemalloc preloaded and, unless the user set ``MALLOC_CONF``, told to keep freed memory."""
    if platform.system() != "Linux":
        raise UserError(f"{ENV}=jemalloc preloads the library with LD_PRELOAD, which Linux's dynamic linker reads and "
                        f"{platform.system()}'s does not; use {ENV}=system here")
    library = find_jemalloc()
    if library is None:
        raise UserError(f"{ENV}=jemalloc: no jemalloc library found by the dynamic linker; install it (Debian, Ubuntu: "
                        f"apt install libjemalloc2), or preload your own with LD_PRELOAD=/path/libjemalloc.so, or use "
                        f"{ENV}=keep")
    preload = " ".join(filter(None, (library, environ.get("LD_PRELOAD", ""))))
    return dict(environ) | {"LD_PRELOAD": preload, "MALLOC_CONF": environ.get("MALLOC_CONF", JEMALLOC_CONF)}


def reexec_with_jemalloc(environ=os.environ) -> None:
    """For a command's entry point, before anything else: where ``JAXTRAIN_HOST_MALLOC=jemalloc`` and jemalloc is
    not this process's malloc, replace the process with the same command line, jemalloc preloaded (the dynamic
    linker reads ``LD_PRELOAD`` only when a program starts). Returns when there is nothing to do."""
    if environ.get(ENV) != "jemalloc" or allocator() == "jemalloc":
        return
    if environ.get(REEXECUTED):
        raise UserError(f"{ENV}=jemalloc: this process was started again with LD_PRELOAD={environ.get('LD_PRELOAD')!r} "
                        "and jemalloc is still not its malloc; check that the library loads (ldd), or use keep")
    os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], jemalloc_environ(environ) | {REEXECUTED: "1"})


def configure(environ=os.environ) -> bool:
    """Apply ``JAXTRAIN_HOST_MALLOC`` (auto: keep when computing on the CPU); True when freed memory is kept."""
    global _kept
    choice = environ.get(ENV, "auto")
    if choice not in CHOICES:
        raise UserError(f"{ENV}={choice!r} is not a choice; use one of {', '.join(CHOICES)} (auto keeps freed memory "
                        "when jax computes on the CPU)")
    if allocator() == "jemalloc":  # preloaded, by `reexec_with_jemalloc` or the user: its own settings decide
        _kept = _jemalloc_option("opt.dirty_decay_ms") == -1
    elif choice == "jemalloc":
        raise UserError(f"{ENV}=jemalloc: jemalloc is not this process's malloc, and only a process's start can preload "
                        f"it: the jaxtrain command and make bench restart themselves with it; for your own script, "
                        f"start python with LD_PRELOAD={find_jemalloc() or 'libjemalloc.so.2'} MALLOC_CONF={JEMALLOC_CONF}")
    elif choice == "keep" or (choice == "auto" and computes_on_cpu(environ)):
        _kept = keep_freed_memory() or _kept  # glibc's settings, once made, stay for the process's life
    return _kept


def kept() -> bool:
    """Whether this process's malloc keeps what it frees (for the start-up summary)."""
    return _kept
