"""Activation sharding by logical axis name.

The caller (the trainer) binds logical names to mesh axes with flax's ``logical_axis_rules``
context and sets the mesh; the model only ever names logical axes.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from flax.core import spmd
from jax.sharding import PartitionSpec


# Every logical axis name the model gives its parameters and activations (README, "Sharding rule sets and meshes"): a
# rule set's rule for any other name would be ignored, so the trainer refuses one (a misspelt `mpl: null`)
LOGICAL_AXES = ("vocab", "embed", "heads", "kv_heads", "head_dim", "mlp", "norm", "layers", "layer_stages", "experts",
                "activation_batch", "activation_length", "activation_embed", "activation_heads", "activation_kv_heads",
                "activation_head_dim", "activation_mlp", "activation_vocab", "activation_expert", "activation_batch_no_expert",
                "cache_length")


class MissingLogicalRule(KeyError):
    """The active rule set has no entry for a logical axis the model uses."""

    def __init__(self, axis: str):
        super().__init__(axis)
        self.axis = axis


class RepeatedMeshAxis(ValueError):
    """The active rule set maps two logical axes of one array to the same mesh axis, which no layout can hold."""

    def __init__(self, logical_axes: tuple[str | None, ...], mesh_axis: str, clashing: tuple[str, ...]):
        super().__init__(mesh_axis)
        self.logical_axes, self.mesh_axis, self.clashing = logical_axes, mesh_axis, clashing


def constrain(x: jax.Array, logical_axes: tuple[str | None, ...]) -> jax.Array:
    """``x`` laid out by ``logical_axes``, one per dimension; None: a dimension never split."""
    rules = spmd.get_logical_axis_rules()
    if not rules:  # no sharding context: plain single-device use
        return x
    table = dict(rules) | {None: None}  # None: a dimension left unsplit
    for axis in logical_axes:
        if axis not in table:
            raise MissingLogicalRule(axis)
    # the rule set's own checks see parameters only: an activation's clash (activation_batch and activation_heads
    # both on tensor) was jax's DuplicateSpecError traceback here
    for mesh_axis in dict.fromkeys(a for axis in logical_axes if axis for a in mesh_axes_of(axis)):
        clashing = tuple(axis for axis in logical_axes if axis and mesh_axis in mesh_axes_of(axis))
        if len(clashing) > 1:
            raise RepeatedMeshAxis(logical_axes, mesh_axis, clashing)
    return jax.lax.with_sharding_constraint(x, PartitionSpec(*(table[a] for a in logical_axes)))


def constrain_mesh_axes(x: jax.Array, axes: tuple[tuple[str, ...], ...]) -> jax.Array:
    """``x`` laid out over mesh axes derived from the active rule set (``mesh_axes_of``), a tuple per dimension (empty:
    never split): a layout no logical name gives, such as a batch split over the axes another dimension is not."""
    if not spmd.get_logical_axis_rules():
        return x
    return jax.lax.with_sharding_constraint(x, PartitionSpec(*(a or None for a in axes)))


def split_over_batch_too(x: jax.Array, logical_axes: tuple[str | None, ...], axis: str, batch_axis: str) -> jax.Array:
    """``x``, a weight's gradient summed over the batch, laid out by ``logical_axes`` with its ``axis`` dimension, where
    the weight is gathered for use (FSDP), also split over the mesh axes of ``batch_axis`` that no dimension of it is:
    one reduce-scatter over every batch axis, where the stored layout takes a reduce-scatter and an all-reduce over
    the rest. Gathering over the added axes (after the stored ones) gives back the stored layout. As stored where
    nothing is added, the dimension does not divide or is not gathered."""
    if not spmd.get_logical_axis_rules():
        return x
    spec = [mesh_axes_of(a) if a else () for a in logical_axes]
    dim = logical_axes.index(axis)
    added = tuple(a for a in mesh_axes_of(batch_axis) if a in split_axes(batch_axis) and not any(a in s for s in spec))
    ways = math.prod(jax.sharding.get_abstract_mesh().shape[a] for a in (*spec[dim], *added))
    if not gathered_for_use(axis) or not added or x.shape[dim] % ways:
        return constrain(x, logical_axes)
    spec[dim] = (*spec[dim], *added)
    return constrain_mesh_axes(x, tuple(spec))


def mesh_axes_of(logical_axis: str) -> tuple[str, ...]:
    """The mesh axes the active rule set maps ``logical_axis`` to (none without a rule or a context), so a
    model can name them to jax (e.g. ``vmap``'s ``spmd_axis_name``) without knowing them."""
    target = dict(spmd.get_logical_axis_rules()).get(logical_axis)
    return () if target is None else (target,) if isinstance(target, str) else tuple(target)


def split_axes(logical_axis: str) -> frozenset[str]:
    """The mesh axes of more than one device the active rule set splits ``logical_axis`` over (none outside a context)."""
    mesh = jax.sharding.get_abstract_mesh()
    return frozenset(a for a in mesh_axes_of(logical_axis) if mesh.axis_names and mesh.shape[a] > 1)


def logical_ways(logical_axis: str) -> int:
    """How many ways the active rule set and mesh split a dimension with ``logical_axis`` (1 outside a context)."""
    mesh = jax.sharding.get_abstract_mesh()
    return math.prod(mesh.shape[a] for a in mesh_axes_of(logical_axis)) if mesh.axis_names else 1


def gathered(x: jax.Array, logical_axes: tuple[str | None, ...]) -> jax.Array:
    """A weight laid out by ``logical_axes`` (a stacked one's ``layers`` left off) with each dimension that the rule
    set splits and the activations' counterpart (``activation_<axis>``) does not, FSDP's embed dimension, gathered
    here rather than where GSPMD would: as a new leading dimension, then moved into place, with a backward that
    reduce-scatters the gradient the same way. XLA's GPU compiler lays an all-gather's operand out with the gathered
    dimension outermost: where GSPMD gathered the embed dimension of a layer's down or output projection (their last)
    in place, it copied every layer's stack of them (and of a trained one's gradients) into that layout before the
    layer loop, and held the copies (llama3_70b on 64 H100s: 66.9 GiB compiled, 63.5 since). Here the dimension split
    is of size one on each device, so the move costs nothing before the gather; after it, a layer's gathered weight is
    transposed once per use. A quantized base's codes come here before they are dequantized: GSPMD had gathered most
    projections' dequantized bfloat16, four times nf4's bytes."""
    if not spmd.get_logical_axis_rules():
        return x
    spec = [mesh_axes_of(axis) if axis else () for axis in logical_axes]
    for dim, axis in enumerate(logical_axes):
        if not axis or not gathered_for_use(axis):
            continue
        x = _gather_as_leading(dim, tuple(spec), x)
        spec[dim] = ()
    return x


def gathered_for_use(axis: str) -> bool:
    """Whether ``gathered`` gathers a dimension with logical ``axis``: split in storage, and its activations'
    counterpart (``activation_<axis>``) over none of the same mesh axes (a partial overlap is left to GSPMD)."""
    use = f"activation_{axis}"
    return use in dict(spmd.get_logical_axis_rules()) and bool(split_axes(axis)) and not split_axes(axis) & split_axes(use)


def _unsplit(spec: tuple[tuple[str, ...], ...], dim: int) -> tuple[tuple[str, ...], ...]:
    return (*spec[:dim], (), *spec[dim + 1:])


def _ways_in_front(x: jax.Array, dim: int, spec) -> jax.Array:
    """``x``'s dimension ``dim``, split over the mesh axes ``spec[dim]``, viewed as (ways, size / ways) with the ways
    moved to the front and split there: each device holds one of them, so on a device the move is free."""
    ways = math.prod(jax.sharding.get_abstract_mesh().shape[a] for a in spec[dim])
    parts = jnp.moveaxis(x.reshape(*x.shape[:dim], ways, x.shape[dim] // ways, *x.shape[dim + 1:]), dim, 0)
    return constrain_mesh_axes(parts, (spec[dim], *_unsplit(spec, dim)))


# The backward written out too: autodiff's, the transpose of the gather's layout constraints, summed the gradient
# whole over the devices (an all-reduce, twice a reduce-scatter's bytes) and then sliced each device's part
@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _gather_as_leading(dim: int, spec, x: jax.Array) -> jax.Array:
    parts = constrain_mesh_axes(_ways_in_front(x, dim, spec), ((), *_unsplit(spec, dim)))
    return constrain_mesh_axes(jnp.moveaxis(parts, 0, dim).reshape(x.shape), _unsplit(spec, dim))


def _gather_as_leading_fwd(dim, spec, x):
    return _gather_as_leading(dim, spec, x), None


def _gather_as_leading_bwd(dim, spec, _, grad):
    """The gradient summed over the devices and split where the gather took it: over the ways in front (a
    reduce-scatter of the outermost dimension), then moved back."""
    return (constrain_mesh_axes(jnp.moveaxis(_ways_in_front(grad, dim, spec), 0, dim).reshape(grad.shape), spec),)


_gather_as_leading.defvjp(_gather_as_leading_fwd, _gather_as_leading_bwd)
