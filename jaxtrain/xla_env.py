"""jaxtrain's defaults for XLA's environment, set before jax starts (XLA reads ``XLA_FLAGS`` and jax its GPU
allocator's settings once, when the first backend starts). A setting the user's environment already has is left
as the user set it.

``--xla_gpu_enable_dynamic_slice_fusion=false`` in ``XLA_FLAGS``, with jaxlib 0.11 or newer: that XLA's
dynamic-slice fusion lets a cuBLAS gemm write its result straight into a slice of the layer scan's stacks (the
activations saved for the backward), but where the result has other users as well it computes the gemm a second
time for the stack. Compiled for an H200 with cuBLAS gemms (``jaxtrain plan ... --hlo-report``: "computed twice"),
``llama3_1b``'s save_dots step multiplies 287 TFLOPs instead of 243: 18% more matmul work to save a 43 GB copy.
Without the fusion the same program copies the result into the stack (a bandwidth-bound kernel) and multiplies 243.
XLA picks cuBLAS where its autotuner finds it faster than its own gemm kernels, so which gemms it hits is decided on
the device. jaxlib 0.10's XLA does not duplicate them, so there the fusion stays on.

``XLA_CLIENT_MEM_FRACTION=0.92``: the share of each GPU's memory jax's allocator takes for XLA's buffers. jax's own
default, 0.75, would keep 20 GB of an 80 GB H100 out of XLA's reach, and a step ``jaxtrain plan`` says fits in 90% of the
device (its default headroom) would not get it. The 8% left outside the pool is for the CUDA context, cuDNN and
NCCL. ``XLA_PYTHON_CLIENT_MEM_FRACTION`` is the older name jax still reads (setting both is jax's error)."""

from __future__ import annotations

import importlib.metadata
import os
import re

from jaxtrain.errors import UserError

# (flag, value, the oldest jaxlib (major, minor) it is set for)
DEFAULT_FLAGS = (("--xla_gpu_enable_dynamic_slice_fusion", "false", (0, 11)),)
MEMORY_FRACTION_NAMES = ("XLA_CLIENT_MEM_FRACTION", "XLA_PYTHON_CLIENT_MEM_FRACTION")  # jax's name, then its older one
MEMORY_FRACTION = 0.92  # jaxtrain's default
JAX_MEMORY_FRACTION = 0.75  # jax's, where nothing sets one


def _version(text: str) -> tuple[int, ...]:
    return tuple(int(part) for part in re.findall(r"\d+", text)[:2])


def set_defaults(jaxlib_version: str | None = None) -> list[str]:
    """Add each default XLA flag that applies to ``jaxlib_version`` (default: the installed jaxlib's) and that
    ``XLA_FLAGS`` does not name, and the allocator's memory fraction where neither of its names is set; returns the
    settings added; raises UserError for a memory fraction set outside (0, 1]."""
    version = _version(jaxlib_version or importlib.metadata.version("jaxlib"))
    flags = os.environ.get("XLA_FLAGS", "")
    added = [f"{flag}={value}" for flag, value, since in DEFAULT_FLAGS if version >= since and not re.search(rf"{flag}\b", flags)]
    if added:
        os.environ["XLA_FLAGS"] = " ".join([flags, *added]).strip()
    if not any(os.environ.get(name) for name in MEMORY_FRACTION_NAMES):
        os.environ[MEMORY_FRACTION_NAMES[0]] = str(MEMORY_FRACTION)
        added.append(f"{MEMORY_FRACTION_NAMES[0]}={MEMORY_FRACTION}")
    memory_fraction()  # a value set wrong stops here, in one line, rather than in jax's backend start
    return added


def memory_fraction(default: float = JAX_MEMORY_FRACTION) -> float:
    """The share of each GPU's memory jax's allocator takes in this environment: the value set under either name,
    else ``default`` (jax's own where nothing set one; a plan passes jaxtrain's, which ``jaxtrain train`` sets)."""
    if all(os.environ.get(name) for name in MEMORY_FRACTION_NAMES):
        raise UserError(f"both {' and '.join(MEMORY_FRACTION_NAMES)} are set, which jax refuses; "
                        f"unset {MEMORY_FRACTION_NAMES[1]}, the older name")
    for name in MEMORY_FRACTION_NAMES:
        text = os.environ.get(name)
        if text:
            try:
                value = float(text)
            except ValueError:
                value = float("nan")
            if not 0 < value <= 1:
                raise UserError(f"{name}={text!r} is not a share of GPU memory in (0, 1]; set it to e.g. {MEMORY_FRACTION} or unset it")
            return value
    return default
