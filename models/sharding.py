"""Activation sharding by logical axis name.

The caller (the trainer) binds logical names to mesh axes with flax's ``logical_axis_rules``
context and sets the mesh; the model only ever names logical axes.
"""

from __future__ import annotations

import math

import jax
from flax.core import spmd
from jax.sharding import PartitionSpec


class MissingLogicalRule(KeyError):
    """The active rule set has no entry for a logical axis the model uses."""

    def __init__(self, axis: str):
        super().__init__(axis)
        self.axis = axis


def constrain(x: jax.Array, logical_axes: tuple[str | None, ...]) -> jax.Array:
    """``x`` laid out by ``logical_axes``, one per dimension; None: a dimension never split."""
    rules = spmd.get_logical_axis_rules()
    if not rules:  # no sharding context: plain single-device use
        return x
    table = dict(rules) | {None: None}  # None: a dimension left unsplit
    for axis in logical_axes:
        if axis not in table:
            raise MissingLogicalRule(axis)
    return jax.lax.with_sharding_constraint(x, PartitionSpec(*(table[a] for a in logical_axes)))


def constrain_mesh_axes(x: jax.Array, axes: tuple[tuple[str, ...], ...]) -> jax.Array:
    """``x`` laid out over mesh axes derived from the active rule set (``mesh_axes_of``), a tuple per dimension (empty:
    never split): a layout no logical name gives, such as a batch split over the axes another dimension is not."""
    if not spmd.get_logical_axis_rules():
        return x
    return jax.lax.with_sharding_constraint(x, PartitionSpec(*(a or None for a in axes)))


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
