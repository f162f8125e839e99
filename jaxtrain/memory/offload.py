"""Host offload (ZeRO-Offload's trade): with ``optim.offload=true`` the optimizer state lives in host memory
(the ``pinned_host`` memory kind), and so do the float32 master weights when the compute dtype is narrower
(model.dtype bfloat16 or float16 with model.param_dtype float32): the device then needs only what the step
computes with. The train step moves the master weights into device memory at its start, the optimizer state
for the update (after the backward pass has freed the activations), and both back out (its output
shardings); the eval step brings the weights in likewise. With float32 compute the weights stay on the device:
the forward reads them as they are, so there is nothing narrower to keep there instead.

The CPU backend accepts the memory kinds but has only one memory, so nothing moves there: placement and
numerics can be tested on CPU, the saving and the transfer time only measured on a GPU.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax.sharding import Mesh

from jaxtrain.errors import UserError

HOST = "pinned_host"


def offloads_master_weights(model_cfg) -> bool:
    """optim.offload moves the parameters too: they are master weights, wider than the compute dtype."""
    return jnp.dtype(model_cfg.dtype).itemsize < jnp.dtype(model_cfg.param_dtype).itemsize


def check_supported(mesh: Mesh) -> None:
    device = mesh.devices.flat[0]
    kinds = sorted(m.kind for m in device.addressable_memories())
    if HOST not in kinds:
        raise UserError(f"optim.offload=true needs the '{HOST}' memory kind, which {device.platform} devices lack "
                        f"(they have: {', '.join(kinds)}); drop optim.offload")

