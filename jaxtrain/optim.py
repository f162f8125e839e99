"""AdamW with linear warmup + cosine decay and global-norm clipping (optax)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax

from jaxtrain.adapt.adapters import split_frozen
from jaxtrain.config import Config

# logical axes that are not dimensions of the matrix a parameter holds: the stacking of the layers, and the
# split of a projection's outputs into heads (a query bias (heads, head_dim) is one vector in Hugging Face's files)
NOT_MATRIX_AXES = ("layers", "head_dim")


def warmup_steps(cfg: Config) -> int:
    """The steps the learning rate warms up over, as the start-up summary counts them: ``optim.warmup_steps``, at most
    ``train.steps`` (a short run reaches ``optim.lr`` at its last step; the summary says so)."""
    return min(cfg.optim.warmup_steps, cfg.train.steps)


def learning_rate_schedule(cfg: Config) -> optax.Schedule:
    """``optim.schedule`` after a linear warmup from 0: a cosine (transformers' cosine-with-min-lr) or linear decay to
    ``lr * min_lr_ratio`` at ``train.steps``, or warmup-stable-decay (transformers' ``get_wsd_schedule``): ``optim.lr``
    until the last ``optim.decay_fraction`` of the steps, then a decay of ``optim.decay_shape``, so a run extended in
    its stable phase goes on at the same rate, and a decay from any checkpoint of it is a shorter run's end."""
    o, steps = cfg.optim, cfg.train.steps
    warmup, end = _warmup_counts(cfg), o.lr * o.min_lr_ratio
    if o.schedule == "cosine":
        return optax.warmup_cosine_decay_schedule(init_value=0.0, peak_value=o.lr, warmup_steps=warmup,
                                                  decay_steps=max(steps, o.warmup_steps + 1), end_value=end)
    warming = optax.linear_schedule(0.0, o.lr, warmup)
    if o.schedule == "linear":
        return optax.join_schedules([warming, optax.linear_schedule(o.lr, end, max(steps - warmup, 1))], [warmup])
    decay = _wsd_decay_steps(cfg)
    return optax.join_schedules([warming, optax.constant_schedule(o.lr), _decay(o.lr, end, max(decay, 1), o.decay_shape)],
                                [warmup, steps - decay])


def _warmup_counts(cfg: Config) -> int:
    """The update counts the warmup takes. optax counts the updates from 0, so step k gets lr * (k - 1) / warmup: a run
    shorter than its warmup warms up over one count fewer than its steps, so its last step applies optim.lr (a 1-step
    run: at once)."""
    return min(cfg.optim.warmup_steps, cfg.train.steps - 1)


def _wsd_decay_steps(cfg: Config) -> int:
    """The updates a wsd schedule decays over: ``optim.decay_fraction`` of the steps, or what the warmup leaves."""
    return min(round(cfg.optim.decay_fraction * cfg.train.steps), cfg.train.steps - _warmup_counts(cfg))


def describe_schedule(cfg: Config) -> str:
    """The optimizer and its learning-rate schedule in words, for the start-up summary (steps counted from 1: update k
    is step k)."""
    o, steps = cfg.optim, cfg.train.steps
    end = f"{o.lr * o.min_lr_ratio:.3g} after step {steps}"
    # the decay's first count (steps - decay) gives its start, optim.lr, as transformers' does: step steps - decay + 1 applies it
    held_to = min(steps - _wsd_decay_steps(cfg) + 1, steps)
    then = {"cosine": f"a cosine to {end}", "linear": f"linear to {end}",
            "wsd": f"held to step {held_to}, then a {o.decay_shape} decay to {end}"}[o.schedule]
    if o.warmup_steps >= steps:  # the warmup takes every step: nothing decays
        then = f"no decay (the warmup takes all {steps} steps)" if steps > 1 else "no decay (the warmup takes the one step)"
    clipping = f"gradients clipped at global norm {o.clip_norm:g}" if o.clip_norm else "no clipping"
    return (f"AdamW (b1 {o.b1:g}, b2 {o.b2:g}, eps {o.eps:g}, weight decay {o.weight_decay:g}, {clipping}): learning rate "
            f"{o.lr:.3g} after {warmup_steps(cfg)} warmup step{'s' * (warmup_steps(cfg) != 1)}, then {then}")


# optim.decay_shape: the factor at a decay's progress p (torchtitan's and transformers' warmup-stable-decay shapes;
# 1-sqrt: Hägele et al. 2024's best cool-down)
DECAY_FACTORS = {"linear": lambda p: 1.0 - p, "1-sqrt": lambda p: 1.0 - jnp.sqrt(p), "cosine": lambda p: 0.5 * (1.0 + jnp.cos(jnp.pi * p))}


def _decay(start: float, end: float, steps: int, shape: str) -> optax.Schedule:
    """From ``start`` to ``end`` over ``steps`` counts, by ``DECAY_FACTORS[shape]``."""
    factor = DECAY_FACTORS[shape]
    return lambda count: end + (start - end) * factor(jnp.clip(count / steps, 0.0, 1.0))


def decays(axes) -> bool:
    """Whether weight decay applies to a parameter of these logical axes: to matrices (projections, embedding,
    output table, router, LoRA adapters), not to norm scales or biases, as Hugging Face's Trainer decides and PyTorch
    recipes' ``ndim >= 2`` on unstacked weights (nanoGPT, benchmarks/bench_torch_peer.py). Not by ``ndim`` here: the
    layers' stacked norm scales and biases have two dimensions or more."""
    return len([axis for axis in axes if axis not in NOT_MATRIX_AXES]) >= 2


def decay_mask(logical_axes: dict) -> dict:
    """``optax.adamw``'s mask for the trained parameters (a LoRA run: the adapters) of a model's logical axes."""
    return jax.tree.map(decays, split_frozen(logical_axes)[0])


def in_float32(tx: optax.GradientTransformation) -> optax.GradientTransformation:
    """``tx`` on float32 gradients with its state (Adam's moments) in float32, whatever the parameters' dtype (DESIGN:
    optimizer math in float32). optax keeps the moments in the parameters' dtype: with bfloat16 parameters (the LoRA
    experiments') each moment's decay rounded to 8 bits, b2=0.999 to 1, and the second moment stalled (a QA report: 1.08
    times the update at b2=0.99, 1.29 at 0.999). The float32 updates are rounded once, onto the parameters
    (``optax.apply_updates``)."""
    def to_float32(tree):
        return jax.tree.map(lambda x: x.astype(jnp.float32), tree)

    return optax.GradientTransformation(lambda params: tx.init(to_float32(params)),
                                        lambda updates, state, params=None: tx.update(to_float32(updates), state, params))


def make_optimizer(cfg: Config, logical_axes: dict) -> optax.GradientTransformation:
    o = cfg.optim
    adamw = optax.adamw(learning_rate_schedule(cfg), b1=o.b1, b2=o.b2, eps=o.eps, weight_decay=o.weight_decay,
                        mask=decay_mask(logical_axes))
    # clipping or not, one optimizer-state tree (clipping keeps no state), so optim.clip_norm may change on resume
    return in_float32(optax.chain(optax.clip_by_global_norm(o.clip_norm) if o.clip_norm > 0 else optax.identity(), adamw))
