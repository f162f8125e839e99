"""Host offload (ZeRO-Offload's trade): with ``optim.offload=true`` the optimizer state lives in host memory
(the ``pinned_host`` memory kind); the train step moves it into device memory for the update, after the
backward pass has freed the activations, and back out (its output shardings). The float32 parameters stay
on the device: the forward and backward read them whole, so moving them out would need a compute-dtype copy
on the device (not done).

The CPU backend accepts the memory kinds but has only one memory, so nothing moves there: placement and
numerics can be tested on CPU, the saving and the transfer time only measured on a GPU.
"""

from __future__ import annotations

from jax.sharding import Mesh

from jaxtrain.errors import UserError

HOST = "pinned_host"


def check_supported(mesh: Mesh) -> None:
    device = mesh.devices.flat[0]
    kinds = sorted(m.kind for m in device.addressable_memories())
    if HOST not in kinds:
        raise UserError(f"optim.offload=true needs the '{HOST}' memory kind, which {device.platform} devices lack "
                        f"(they have: {', '.join(kinds)}); drop optim.offload")

