"""Dynamic loss scaling for float16 compute, with jmp's ``DynamicLossScale``.

float16 has five exponent bits: small gradients underflow to zero unless the loss is multiplied by a large
scale before differentiation and the gradients divided by it afterwards. A step whose scaled gradients
overflow is skipped (the train step keeps the state) and the scale is halved, down to 1 (``can_lower``); after
``optim.loss_scale_period`` finite steps in a row it doubles again. The scale and that count live in the
train state (``TrainState.loss_scale``), so checkpoints carry them.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import jmp

INITIAL_SCALE = 2.0**15  # as jmp's and PyTorch's GradScaler's examples; the first overflows settle it


def initial_state() -> dict:
    return {"scale": jnp.full((), INITIAL_SCALE, jnp.float32), "counter": jnp.zeros((), jnp.int32)}


def scaler(state: dict | None, period: int):
    """jmp's scaler for the train state's loss scale; a no-op without one (compute other than float16)."""
    if state is None:
        return jmp.NoOpLossScale()
    return jmp.DynamicLossScale(state["scale"], state["counter"], period=period)


def can_lower(scale: jmp.DynamicLossScale) -> jax.Array:
    """Whether halving the scale can still cure an overflow: above jmp's floor (``min_loss_scale``, 1). At the floor the
    gradients overflow unscaled: not the scale's doing but a non-finite step for the health guard (as DeepSpeed stops
    at its minimum scale), which skipping it again and again, the scale stuck at 1, would hide until the run's end."""
    return scale.loss_scale > scale.min_loss_scale


def to_state(scale) -> dict | None:
    if isinstance(scale, jmp.NoOpLossScale):
        return None
    return {"scale": scale.loss_scale, "counter": scale.counter}
