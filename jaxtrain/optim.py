"""AdamW with linear warmup + cosine decay and global-norm clipping (optax)."""

from __future__ import annotations

import jax
import optax

from jaxtrain.config import Config


def warmup_steps(cfg: Config) -> int:
    """The steps the learning rate warms up over, as the start-up summary counts them: ``optim.warmup_steps``, at most
    ``train.steps`` (a short run reaches ``optim.lr`` at its last step; the summary says so)."""
    return min(cfg.optim.warmup_steps, cfg.train.steps)


def learning_rate_schedule(cfg: Config) -> optax.Schedule:
    o = cfg.optim
    return optax.warmup_cosine_decay_schedule(
        init_value=0.0,
        peak_value=o.lr,
        # optax counts the updates from 0, so step k gets lr * (k - 1) / warmup: a run shorter than its warmup
        # warms up over one count fewer than its steps, so its last step applies optim.lr (a 1-step run: at once)
        warmup_steps=min(o.warmup_steps, cfg.train.steps - 1),
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
