"""The spike guard (``train.skip_spikes``): an update whose loss or gradient norm is far from the recent steps' is
skipped, as OLMo 2 trained (OLMo-core's ``SkipStepOptimizer``).

The train state carries a window of the last ``train.spike_window`` steps' loss and gradient norm
(``TrainState.spikes``), so checkpoints carry it and a resumed run skips what an uninterrupted one would. A step is a
spike when its loss or its gradient norm lies more than ``train.skip_spikes`` standard deviations (the window's, with
Bessel's correction) from the window's mean, either way, once the window holds at least half its length. Every
finite step enters the window, skipped or not: after a lasting change of level (new data, another learning rate) the
window takes in the new values and the guard stops skipping within a few steps, where a window of applied steps only
would skip for ever. All of it runs inside the step, on two scalars: no host sync, no collective.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

WATCHED = ("loss", "grad_norm")


def initial_window(length: int) -> dict:
    """An empty window of ``length`` steps: each watched value's ring of the last steps, and how many steps entered."""
    return {**{name: jnp.zeros((length,), jnp.float32) for name in WATCHED}, "count": jnp.zeros((), jnp.int32)}


def verdict_after(length: int) -> int:
    """The steps a window of ``length`` holds before it judges one: half its length (OLMo-core: at least 20), and 2 at
    the least, for a standard deviation."""
    return max(2, length // 2)


def held(window: dict) -> jax.Array:
    """How many steps the window holds: its length once full."""
    return jnp.minimum(window["count"], window["loss"].shape[0])


def deviations(window: dict, values: dict) -> dict:
    """Per watched value, how many of the window's standard deviations ``values`` lies from its mean (absolute); 0
    while the window holds fewer than half its length."""
    length = window["loss"].shape[0]
    held_steps = held(window)
    filled = jnp.arange(length) < held_steps
    ready = held_steps >= verdict_after(length)
    out = {}
    for name in WATCHED:
        mean = jnp.sum(jnp.where(filled, window[name], 0.0)) / jnp.maximum(held_steps, 1)
        variance = jnp.sum(jnp.where(filled, (window[name] - mean) ** 2, 0.0)) / jnp.maximum(held_steps - 1, 1)
        # a constant window (std 0) makes any other value infinitely far: a spike; its own value none
        distance = jnp.abs(values[name].astype(jnp.float32) - mean)
        out[name] = jnp.where(ready & (distance > 0), distance / jnp.sqrt(variance), 0.0)
    return out


def entered(window: dict, values: dict, finite: jax.Array) -> dict:
    """The window with this step's values in place of its oldest, if they are finite (a non-finite step would make the
    mean and deviation NaN for the window's length)."""
    slot = window["count"] % window["loss"].shape[0]
    new = {name: jnp.where(finite, window[name].at[slot].set(values[name].astype(jnp.float32)), window[name]) for name in WATCHED}
    return new | {"count": window["count"] + finite.astype(jnp.int32)}
