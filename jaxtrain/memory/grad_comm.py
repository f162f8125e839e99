"""Gradient communication in a narrower dtype (``optim.grad_dtype=bfloat16``, the seeds' "gradient compression").

Under GSPMD the data-parallel sum of a weight's gradient is an all-reduce placed right after the backward matmul
that makes it, in that matmul's output dtype: the dtype the weight enters the compute in. Casting the gradient
afterwards (an identity with a custom VJP on the parameters: checked in the partitioned HLO) leaves the all-reduce
in float32, and a cast of the cotangent where the weight enters the compute would also follow that matmul. This
module takes the reduction out of GSPMD's hands instead: the gradient passes run under ``jax.shard_map`` with every
mesh axis manual, so each device computes the gradient of its own share of the batch (all its micro-batches), with
no collective; those partial gradients are cast to ``grad_dtype`` and summed over the batch axes with one ``psum``
each (ZeRO-2: ``psum_scatter``, each device keeping its slice), then brought back to float32 for the optimizer.
Loss and router statistics are summed in float32. Every axis manual means pure data parallelism (dp, zero1, zero2 on
a mesh whose other axes are 1): FSDP splits the weights, and a tensor axis left automatic makes XLA:CPU's compiler
abort on the bfloat16 all-reduce (its ``AllReducePromotion`` clones only a bare binary reducer).

XLA:CPU has no bfloat16 reduction: after partitioning it promotes every bfloat16 all-reduce to float32
(``AllReducePromotion``), so the compiled CPU program carries float32 bytes; the program right after partitioning
(``hlo_report.partitioned_hlo``) shows what a GPU runs.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from flax.core import spmd
from jax.sharding import Mesh, PartitionSpec

from jaxtrain.errors import UserError
from jaxtrain.partitioning import Rules, spec_axes


@dataclasses.dataclass(frozen=True)
class GradReduction:
    """Over which mesh axes and in what dtype the gradient pass's partial sums are reduced."""

    mesh: Mesh
    batch_axes: tuple[str, ...]  # the rule set's batch axes: every mesh axis of more than one device is one of them
    dtype: jnp.dtype
    grad_specs: Any = None  # PartitionSpec per trained parameter where its gradient is kept split (ZeRO-2); None: whole

    def _sum(self, g: jax.Array, spec: PartitionSpec) -> jax.Array:
        """The devices' partial ``g`` summed in ``dtype``: whole (all-reduce), or each device's slice of the dimension the
        spec splits (reduce-scatter, half the bytes)."""
        narrow = g.astype(self.dtype)
        split = [(dim, entry) for dim, entry in enumerate(spec) if entry]
        if not split:
            return jax.lax.psum(narrow, self.batch_axes).astype(g.dtype)
        (dim, entry), = split
        return jax.lax.psum_scatter(narrow, entry, scatter_dimension=dim, tiled=True).astype(g.dtype)

    def wrap(self, grad_fn: Callable) -> Callable:
        """``grad_fn(params, frozen, batch, counted, scale, key, share=) -> ((loss, stats), grads)``, the gradient passes
        of a whole batch (``share``: the part of the batch's value they make; ``key``: LoRA dropout's, or None), computed
        per device on its share of the batch (every micro-batch of it) and summed over the batch axes in ``dtype`` once."""
        ways = math.prod(self.mesh.shape[a] for a in self.batch_axes)
        whole = PartitionSpec()

        def local(params, frozen, batch, counted, scale, key):
            # every axis is manual here: the model's activation constraints have nothing left to split; each device's
            # part is 1/ways of the batch's value, so summing the devices' parts gives the batch's
            if key is not None:  # each device's rows draw their own dropout masks
                key = jax.random.fold_in(key, jax.lax.axis_index(self.batch_axes))
            with spmd.logical_axis_rules(()):
                (loss, stats), grads = grad_fn(params, frozen, batch, counted, scale, key, share=1 / ways)
            loss, stats = jax.lax.psum((loss, stats), self.batch_axes)
            specs = self.grad_specs if self.grad_specs is not None else jax.tree.map(lambda _: whole, grads)
            return (loss, stats), jax.tree.map(self._sum, grads, specs)

        # every mesh axis manual: with axes left automatic the reducer carries their sharding annotations (see above)
        grad_specs = whole if self.grad_specs is None else self.grad_specs
        return jax.shard_map(local, mesh=self.mesh, check_vma=False, out_specs=(whole, grad_specs),
                             in_specs=(whole, whole, PartitionSpec(self.batch_axes), whole, whole, whole))


def grad_reduction(grad_dtype: str, rules_name: str, rules: Rules, mesh: Mesh, param_shardings: dict,
                   grad_shardings: dict | None) -> GradReduction | None:
    """The reduction ``optim.grad_dtype`` asks for; None for float32 (GSPMD's own, in the compute dtype).
    ``grad_shardings``: where ZeRO-2 keeps the gradients split (None: whole, as the parameters)."""
    if grad_dtype == "float32":
        return None
    batch_axes = tuple(rules.get("activation_batch") or ())
    split = sorted({a for s in jax.tree.leaves(param_shardings) for a in spec_axes(s.spec) if mesh.shape[a] > 1})
    other = sorted(a for a in mesh.axis_names if a not in batch_axes and mesh.shape[a] > 1)
    if split or other:
        raise UserError(f"optim.grad_dtype={grad_dtype} needs pure data parallelism (parameters whole on every device, every "
                        f"mesh axis a batch axis), but rule set {rules_name} on mesh {dict(mesh.shape)} splits parameters "
                        f"over {', '.join(split) or 'no axis'} and has other axes {', '.join(other) or 'none'}; use rules=dp, zero1 "
                        f"or zero2 with a data-only mesh, or optim.grad_dtype=float32")
    specs = None if grad_shardings is None else jax.tree.map(lambda sharding: sharding.spec, grad_shardings)
    return GradReduction(mesh, batch_axes, jnp.dtype(grad_dtype), specs)
