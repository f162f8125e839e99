"""XLA flags jaxtrain sets by default, before jax starts (XLA reads ``XLA_FLAGS`` once, when its first backend
starts). A flag the user's ``XLA_FLAGS`` already names is left as the user set it.

``--xla_gpu_enable_dynamic_slice_fusion=false`` with jaxlib 0.11 or newer: that XLA's dynamic-slice fusion lets a
cuBLAS gemm write its result straight into a slice of the layer scan's stacks (the activations saved for the
backward), but where the result has other users as well it computes the gemm a second time for the stack.
Compiled for an H200 with cuBLAS gemms (``jaxtrain plan ... --hlo-report``: "computed twice"), ``llama3_1b``'s
save_dots step multiplies 287 TFLOPs instead of 243: 18% more matmul work to save a 43 GB copy. Without the fusion
the same program copies the result into the stack (a bandwidth-bound kernel) and multiplies 243. XLA picks cuBLAS
where its autotuner finds it faster than its own gemm kernels, so which gemms it hits is decided on the device.
jaxlib 0.10's XLA does not duplicate them, so there the fusion stays on."""

from __future__ import annotations

import importlib.metadata
import os
import re

# (flag, value, the oldest jaxlib (major, minor) it is set for)
DEFAULTS = (("--xla_gpu_enable_dynamic_slice_fusion", "false", (0, 11)),)


def _version(text: str) -> tuple[int, ...]:
    return tuple(int(part) for part in re.findall(r"\d+", text)[:2])


def set_defaults(jaxlib_version: str | None = None) -> list[str]:
    """Add each default flag that applies to ``jaxlib_version`` (default: the installed jaxlib's) and that
    ``XLA_FLAGS`` does not name; returns the flags added."""
    version = _version(jaxlib_version or importlib.metadata.version("jaxlib"))
    flags = os.environ.get("XLA_FLAGS", "")
    added = [f"{flag}={value}" for flag, value, since in DEFAULTS if version >= since and not re.search(rf"{flag}\b", flags)]
    if added:
        os.environ["XLA_FLAGS"] = " ".join([flags, *added]).strip()
    return added
