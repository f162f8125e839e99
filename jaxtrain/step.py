"""Pure train and eval steps: (state, batch) -> (state, metrics). No I/O, no host syncs."""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from jaxtrain.state import TrainState
from models.moe import pop_router_stats

Batch = dict[str, jax.Array]  # 'inputs', 'targets': (batch, length) int32


def token_nll(graphdef, params: dict, batch: Batch, loss_chunk: int = 0) -> jax.Array:
    """Negative log-likelihood (nats) of every target token, float32, shape (batch, length). With
    ``loss_chunk`` the logits are made that many positions at a time and remade in the backward pass,
    so only one chunk's float32 (batch, chunk, vocab) logits is ever live: for large vocabularies."""
    return token_nll_and_router_stats(graphdef, params, batch, loss_chunk)[0]


def token_nll_and_router_stats(graphdef, params: dict, batch: Batch, loss_chunk: int = 0) -> tuple[jax.Array, dict]:
    """``token_nll`` and the mixture-of-experts router statistics of the pass (models.moe.pop_router_stats)."""
    model = nnx.merge(graphdef, params)
    return _token_nll(model, batch, loss_chunk), pop_router_stats(model)


def router_metrics(stats: dict) -> dict:
    """Router statistics of a MoE model as metrics: each averaged over layers, and per layer the expert load
    (share of assignments per expert) and its max / mean (1: balanced)."""
    if not stats:
        return {}
    load = stats["expert_load"]
    return {f"moe_{k}": jnp.mean(v) for k, v in stats.items() if k != "expert_load"} | {
        "moe_expert_load_per_layer": load, "moe_load_max_over_mean_per_layer": jnp.max(load, -1) / jnp.mean(load, -1)}


def _token_nll(model, batch: Batch, loss_chunk: int) -> jax.Array:
    if not loss_chunk:
        return optax.softmax_cross_entropy_with_integer_labels(model(batch["inputs"]), batch["targets"])
    x = model.hidden(batch["inputs"])
    b, t, d = x.shape
    chunks = (jnp.swapaxes(x.reshape(b, t // loss_chunk, loss_chunk, d), 0, 1),
              jnp.swapaxes(batch["targets"].reshape(b, t // loss_chunk, loss_chunk), 0, 1))

    @jax.checkpoint
    def chunk_nll(chunk):
        hidden, targets = chunk
        return optax.softmax_cross_entropy_with_integer_labels(model.logits(hidden), targets)

    return jnp.swapaxes(jax.lax.map(chunk_nll, chunks), 0, 1).reshape(b, t)


def _split_microbatches(batch: Batch, k: int) -> Batch:
    """(B, T) -> (k, B/k, T), micro-batch j taking rows j, j+k, ...: every device holding a block of
    rows keeps its share of every micro-batch, so no data moves between devices."""
    return {name: jnp.swapaxes(x.reshape(x.shape[0] // k, k, *x.shape[1:]), 0, 1) for name, x in batch.items()}


def per_layer_norm(layers: dict) -> jax.Array:
    """L2 norm of each layer of a tree stacked on a leading ``layers`` axis: shape (num_layers,)."""
    squares = [jnp.sum(jnp.square(x.astype(jnp.float32)), axis=tuple(range(1, x.ndim))) for x in jax.tree.leaves(layers)]
    return jnp.sqrt(sum(squares))


def schedule_count(opt_state) -> jax.Array:
    """The updates the optimizer has applied, as its learning-rate schedule counts them: a skipped update
    rolls this back while the train state's step still advances."""
    return next(s.count for s in jax.tree.leaves(opt_state, is_leaf=lambda s: isinstance(s, optax.ScaleByScheduleState))
                if isinstance(s, optax.ScaleByScheduleState))


def training_objective(graphdef, params: dict, batch: Batch, loss_chunk: int = 0) -> tuple[jax.Array, tuple[jax.Array, dict]]:
    """What the optimizer minimises: the mean token loss plus a MoE model's weighted router losses (mean over
    layers); the mean token loss and the router statistics as aux."""
    nll, stats = token_nll_and_router_stats(graphdef, params, batch, loss_chunk)
    loss = nll.mean()
    return loss + (jnp.mean(stats["router_loss"]) if stats else 0.0), (loss, stats)


def make_train_step(graphdef, tx: optax.GradientTransformation, schedule: optax.Schedule, microbatches: int,
                    layer_norms: bool = False, loss_chunk: int = 0) -> Callable[[TrainState, Batch], tuple[TrainState, dict]]:
    """With ``layer_norms`` the metrics also hold per-layer gradient and parameter norms. An update
    whose loss or gradient norm is not finite is not applied (the step counter still advances), so a
    bad batch never poisons the state; the loop decides whether to stop or go on."""
    def grad_fn(params, batch):
        (_, (loss, stats)), grads = jax.value_and_grad(training_objective, argnums=1, has_aux=True)(graphdef, params, batch, loss_chunk)
        return (loss, stats), grads

    def train_step(state: TrainState, batch: Batch):
        if microbatches == 1:
            (loss, stats), grads = grad_fn(state.params, batch)
        else:
            def accumulate(carry, micro):
                sums, grads = grad_fn(state.params, micro)
                return jax.tree.map(jnp.add, carry, (sums, grads)), None

            micro = _split_microbatches(batch, microbatches)
            # zero sums shaped like (loss, router stats) of one micro-batch; gradients like the parameters
            sums = jax.tree.map(jnp.zeros_like, jax.eval_shape(grad_fn, state.params, jax.tree.map(lambda x: x[0], micro))[0])
            ((loss, stats), grads), _ = jax.lax.scan(accumulate, (sums, jax.tree.map(jnp.zeros_like, state.params)), micro)
            # every micro-batch has the same token count, so the mean of means is the batch mean
            loss, stats, grads = jax.tree.map(lambda x: x / microbatches, (loss, stats, grads))
        grad_norm = optax.tree.norm(grads)
        updates, opt_state = tx.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
        params, opt_state = jax.tree.map(lambda new, old: jnp.where(finite, new, old),
                                         (params, opt_state), (state.params, state.opt_state))
        metrics = {"loss": loss, "grad_norm": grad_norm, "param_norm": optax.tree.norm(params),
                   "learning_rate": schedule(schedule_count(state.opt_state))} | router_metrics(stats)
        if layer_norms:
            metrics |= {"grad_norm_per_layer": per_layer_norm(grads["layers"]),
                        "param_norm_per_layer": per_layer_norm(params["layers"])}
        return TrainState(step=state.step + 1, params=params, opt_state=opt_state), metrics

    return train_step


def make_eval_step(graphdef, loss_chunk: int = 0) -> Callable[[dict, Batch], jax.Array]:
    def eval_step(params: dict, batch: Batch) -> jax.Array:
        """Summed nats over the batch; the caller divides by the token count."""
        return token_nll(graphdef, params, batch, loss_chunk).sum()

    return eval_step
