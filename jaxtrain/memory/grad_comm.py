"""When and in what dtype the gradients are summed across the batch shards: ``optim.grad_sync`` (once per step, or in
every micro-batch's backward pass) and ``optim.grad_dtype`` (float32, or bfloat16: the seeds' "gradient compression").

Under GSPMD the data-parallel sum of a weight's gradient is an all-reduce placed right after the backward matmul that
makes it, inside the layer loop and in that matmul's output dtype, so with gradient accumulation every micro-batch pays
a whole gradient sum (XLA's WhileLoopAllReduceCodeMotion does not lift it: the sum sits in the nested layer loop,
written into the stacked gradients, not added to the accumulator). This module takes the sums over the *summed axes*,
the batch axes no parameter is split over (data parallelism; under FSDP the replica axes across nodes: hybrid
sharding), out of GSPMD's hands: each device group differentiates its own share of the batch (all its micro-batches,
accumulated in float32) with no collective over those axes, and the groups' gradients are summed once, after the last
micro-batch, in ``grad_dtype``, then brought back to float32 for the optimizer. Loss and router statistics are summed
in float32. Two ways to keep the groups apart:

- pure data parallelism (every mesh axis of more than one device summed): ``jax.shard_map`` with every axis manual,
  one ``psum`` per gradient (ZeRO-2: ``psum_scatter``, each device keeping its slice). Narrower sums need this way: a
  cast of a GSPMD gradient (even an identity with a custom VJP on the parameters) leaves its all-reduce in float32,
  and an axis left automatic makes XLA:CPU's compiler abort on a bfloat16 all-reduce (its ``AllReducePromotion``
  clones only a bare binary reducer);
- otherwise the groups are a ``vmap`` dimension laid on the summed axes (``spmd_axis_name``), the other axes GSPMD's
  (FSDP gathers and reduce-scatters, tensor parallelism, pipeline stages) under the rule set less the summed axes, and
  the sum over that dimension is the one all-reduce. A ``shard_map`` manual over the summed axes only makes XLA's SPMD
  partitioner abort (jax 0.10.2, CPU and GPU) once two automatic axes of more than one device (fsdp, tensor) carry
  collectives; and jax cannot vmap ``ragged_dot``, so mixture-of-experts models keep GSPMD's sums there.

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

from jaxtrain.config import Config
from jaxtrain.errors import UserError
from jaxtrain.partitioning import Rules, flax_rules, spec_axes
from jaxtrain.stages import schedule


@dataclasses.dataclass(frozen=True)
class GradReduction:
    """Over which mesh axes and in what dtype the gradient passes' partial sums are reduced, once per step."""

    mesh: Mesh
    axes: tuple[str, ...]  # the summed batch axes: the batch axes no parameter is split over
    dtype: jnp.dtype
    grad_specs: Any = None  # every axis manual: PartitionSpec per trained parameter where its gradient is kept split (ZeRO-2)
    rules: Rules | None = None  # the rule set (the vmapped groups: the model's constraints on the other axes); None: all manual

    def _sum(self, g: jax.Array, spec: PartitionSpec) -> jax.Array:
        """The devices' partial ``g`` summed in ``dtype`` over every one of ``axes``: reduce-scattered over the axes the
        spec splits it on (each device keeps its slice, half the bytes), all-reduced over the others (a rule file's
        ``gradients:`` section may split over some batch axes only, or over several dimensions)."""
        narrow = g.astype(self.dtype)
        split = [(dim, (entry,) if isinstance(entry, str) else tuple(entry)) for dim, entry in enumerate(spec) if entry]
        scattered = {axis for _, entry in split for axis in entry}
        whole = tuple(a for a in self.axes if a not in scattered)
        if whole:
            narrow = jax.lax.psum(narrow, whole)
        for dim, entry in split:
            narrow = jax.lax.psum_scatter(narrow, entry, scatter_dimension=dim, tiled=True)
        return narrow.astype(g.dtype)

    def _inner_rules(self) -> tuple:
        """The model's logical rules inside the groups' passes: no constraint names a summed axis (the groups' own)."""
        if self.rules is None:
            return ()
        return flax_rules({logical: tuple(a for a in targets if a not in self.axes) or None if targets else None
                           for logical, targets in self.rules.items()})

    @property
    def ways(self) -> int:
        """How many device groups' gradients are summed."""
        return math.prod(self.mesh.shape[a] for a in self.axes)

    def wrap(self, grad_fn: Callable) -> Callable:
        """``grad_fn(params, frozen, batch, counted, scale, key, share=) -> ((loss, stats), grads)``, the gradient passes
        of a whole batch (``share``: the part of the batch's value they make; ``key``: LoRA dropout's, or None), computed
        per device group on its share of the batch (every micro-batch of it; dropout's masks come from the rows' numbers) and
        summed over ``axes`` in ``dtype`` once. Each group's part is 1/ways of the batch's value, so the sum is the batch's."""
        return self._wrap_manual(grad_fn) if self.rules is None else self._wrap_grouped(grad_fn)

    def _wrap_grouped(self, grad_fn: Callable) -> Callable:
        def grouped(params, frozen, batch, counted, scale, key):
            groups = {name: x.reshape(self.ways, x.shape[0] // self.ways, *x.shape[1:]) for name, x in batch.items()}

            def group_grads(group):
                return grad_fn(params, frozen, group, counted, scale, key, share=1 / self.ways)

            with spmd.logical_axis_rules(self._inner_rules()):
                (loss, stats), grads = jax.vmap(group_grads, spmd_axis_name=self.axes)(groups)
            loss, stats = jax.tree.map(lambda x: x.sum(0), (loss, stats))
            return (loss, stats), jax.tree.map(lambda g: g.astype(self.dtype).sum(0).astype(g.dtype), grads)

        return grouped

    def _wrap_manual(self, grad_fn: Callable) -> Callable:
        whole = PartitionSpec()

        def local(params, frozen, batch, counted, scale, key):
            with spmd.logical_axis_rules(()):  # every axis is manual: the activation constraints have nothing left to split
                (loss, stats), grads = grad_fn(params, frozen, batch, counted, scale, key, share=1 / self.ways)
            loss, stats = jax.lax.psum((loss, stats), self.axes)
            specs = self.grad_specs if self.grad_specs is not None else jax.tree.map(lambda _: whole, grads)
            return (loss, stats), jax.tree.map(self._sum, grads, specs)

        grad_specs = whole if self.grad_specs is None else self.grad_specs
        return jax.shard_map(local, mesh=self.mesh, check_vma=False, out_specs=(whole, grad_specs),
                             in_specs=(whole, whole, PartitionSpec(self.axes), whole, whole, whole))


def summed_once_per_step(grad_sync: str, sums_per_step: float, compute_dtype: str) -> bool:
    """Whether ``optim.grad_sync`` sums the gradients once per step. ``sums_per_step``: how often GSPMD would sum a
    layer's gradient in a step: once per micro-batch, and with pipeline stages in every iteration that runs the layer
    (iterations / repeats per micro-batch). ``auto``: when once moves fewer bytes: the accumulated gradients are
    float32 (4 bytes), GSPMD's sums in the compute dtype, so from 2 sums in float32, 3 in bfloat16. One sum: GSPMD's,
    which overlaps the backward pass."""
    if sums_per_step <= 1 or grad_sync == "microbatch":
        return False
    return grad_sync == "step" or sums_per_step * jnp.dtype(compute_dtype).itemsize > 4


def _split_axes(mesh: Mesh, param_shardings: dict, frozen_shardings: dict | None) -> set[str]:
    return {a for s in jax.tree.leaves((param_shardings, frozen_shardings)) for a in spec_axes(s.spec) if mesh.shape[a] > 1}


def replica_axes(rules: Rules, mesh: Mesh, param_shardings: dict, frozen_shardings: dict | None) -> tuple[str, ...]:
    """The batch axes of more than one device that split no weight: where the gradients are summed over replicas
    (what ``optim.grad_sync`` times); none on one device or, for example, under FSDP alone."""
    split = _split_axes(mesh, param_shardings, frozen_shardings)
    return tuple(a for a in rules.get("activation_batch") or () if mesh.shape[a] > 1 and a not in split)


def grad_reduction(cfg: Config, rules: Rules, mesh: Mesh, param_shardings: dict, frozen_shardings: dict | None,
                   grad_shardings: dict | None) -> GradReduction | None:
    """The reduction ``optim.grad_dtype`` and ``optim.grad_sync`` ask for; None for GSPMD's own (float32 sums in the
    compute dtype, per micro-batch). ``grad_shardings``: where ZeRO-2 keeps the gradients split (None: whole, as the
    parameters); ``frozen_shardings``: a LoRA run's base weights, whose split axes are not summed over either."""
    batch_axes = tuple(rules.get("activation_batch") or ())
    split = _split_axes(mesh, param_shardings, frozen_shardings)
    summed = replica_axes(rules, mesh, param_shardings, frozen_shardings)
    other = sorted(a for a in mesh.axis_names if a not in batch_axes and mesh.shape[a] > 1)
    specs = None if grad_shardings is None else jax.tree.map(lambda sharding: sharding.spec, grad_shardings)
    grad_dtype = cfg.optim.grad_dtype
    # one device has no sum to narrow: its gradients stay float32 (they were rounded to bfloat16 for nothing, a QA report)
    if grad_dtype != "float32" and (split or other or summed):
        if split or other:
            raise UserError(f"optim.grad_dtype={grad_dtype} needs pure data parallelism (parameters whole on every device, every "
                            f"mesh axis a batch axis), but rule set {cfg.rules} on mesh {dict(mesh.shape)} "
                            + " and ".join(filter(None, (split and f"splits parameters over {', '.join(sorted(split))}",
                                                         other and f"has axes that split no batch: {', '.join(other)}")))
                            + "; use rules=dp, zero1 or zero2 with a data-only mesh, or optim.grad_dtype=float32")
        return GradReduction(mesh, batch_axes, jnp.dtype(grad_dtype), specs)
    pipe = schedule(cfg, rules, mesh)
    sums_per_step = cfg.train.microbatches * (pipe.iterations / pipe.repeats if pipe.stages > 1 else 1)
    if not summed or not summed_once_per_step(cfg.optim.grad_sync, sums_per_step, cfg.model.dtype):
        return None
    # every axis of more than one device summed: all manual, as bfloat16 sums need; else the others stay GSPMD's
    pure = not (set(a for a in mesh.axis_names if mesh.shape[a] > 1) - set(summed))
    if not pure and cfg.model.moe.num_experts:  # the groups are a vmap, and jax cannot vmap ragged_dot (dropless dispatch)
        if cfg.optim.grad_sync == "auto":
            return None
        raise UserError(f"optim.grad_sync=step with a mixture-of-experts model (model.moe.num_experts={cfg.model.moe.num_experts}) "
                        f"needs pure data parallelism, but rule set {cfg.rules} on mesh {dict(mesh.shape)} also splits over "
                        f"{', '.join(sorted(split | set(other)))}; use optim.grad_sync=auto or microbatch")
    return GradReduction(mesh, batch_axes if pure else summed, jnp.dtype(grad_dtype), specs, None if pure else rules)
