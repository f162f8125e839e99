"""AdamW with linear warmup + cosine decay and global-norm clipping (optax)."""

from __future__ import annotations

import jax
import optax

from jaxtrain.config import Config


def warmup_steps(cfg: Config) -> int:
    """The steps the learning rate warms up over: ``optim.warmup_steps``, at most ``train.steps`` (a short run reaches
    ``optim.lr`` at its last step; the start-up summary says so)."""
    return min(cfg.optim.warmup_steps, cfg.train.steps)


def learning_rate_schedule(cfg: Config) -> optax.Schedule:
    o = cfg.optim
    return optax.warmup_cosine_decay_schedule(
        init_value=0.0,
        peak_value=o.lr,
        warmup_steps=warmup_steps(cfg),
        decay_steps=max(cfg.train.steps, o.warmup_steps + 1),
        end_value=o.lr * o.min_lr_ratio,
    )


def make_optimizer(cfg: Config) -> optax.GradientTransformation:
    o = cfg.optim
    # weight decay on matrices only: norms' scales are not decayed
    adamw = optax.adamw(learning_rate_schedule(cfg), b1=o.b1, b2=o.b2, eps=o.eps, weight_decay=o.weight_decay,
                        mask=lambda params: jax.tree.map(lambda p: p.ndim >= 2, params))
    if o.clip_norm > 0:
        return optax.chain(optax.clip_by_global_norm(o.clip_norm), adamw)
    return adamw
