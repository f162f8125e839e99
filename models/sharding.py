"""Activation sharding by logical axis name.

The caller (the trainer) binds logical names to mesh axes with flax's ``logical_axis_rules``
context and sets the mesh; the model only ever names logical axes.
"""

from __future__ import annotations

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
    table = dict(rules) | {None: None}
    for axis in logical_axes:
        if axis not in table:
            raise MissingLogicalRule(axis)
    return jax.lax.with_sharding_constraint(x, PartitionSpec(*(table[a] for a in logical_axes)))
