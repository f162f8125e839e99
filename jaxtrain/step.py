"""Pure train and eval steps: (state, batch) -> (state, metrics). No I/O, no host syncs."""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from jaxtrain.adapters import join_frozen
from jaxtrain.state import TrainState

# 'inputs', 'targets': (batch, length) int32; packed instruction data (data.format=sft) adds 'segment_ids' and
# 'positions' (int32, for the model) and 'weights' (float32: 1 where the target token counts in the loss)
Batch = dict[str, jax.Array]


def token_nll(graphdef, params: dict, batch: Batch, loss_chunk: int = 0) -> jax.Array:
    """Negative log-likelihood (nats) of every target token, float32, shape (batch, length). With
    ``loss_chunk`` the logits are made that many positions at a time and remade in the backward pass,
    so only one chunk's float32 (batch, chunk, vocab) logits is ever live: for large vocabularies."""
    model = nnx.merge(graphdef, params)
    packing = batch.get("segment_ids"), batch.get("positions")
    if not loss_chunk:
        return optax.softmax_cross_entropy_with_integer_labels(model(batch["inputs"], *packing), batch["targets"])
    x = model.hidden(batch["inputs"], *packing)
    b, t, d = x.shape
    chunks = (jnp.swapaxes(x.reshape(b, t // loss_chunk, loss_chunk, d), 0, 1),
              jnp.swapaxes(batch["targets"].reshape(b, t // loss_chunk, loss_chunk), 0, 1))

    @jax.checkpoint
    def chunk_nll(chunk):
        hidden, targets = chunk
        return optax.softmax_cross_entropy_with_integer_labels(model.logits(hidden), targets)

    return jnp.swapaxes(jax.lax.map(chunk_nll, chunks), 0, 1).reshape(b, t)


def counted_tokens(batch: Batch) -> jax.Array | None:
    """How many target tokens the loss counts (the sum of 'weights'); None when every token counts."""
    return jnp.maximum(batch["weights"].sum(), 1.0) if "weights" in batch else None


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


def make_train_step(graphdef, tx: optax.GradientTransformation, schedule: optax.Schedule, microbatches: int,
                    layer_norms: bool = False, loss_chunk: int = 0) -> Callable[[TrainState, Batch], tuple[TrainState, dict]]:
    """With ``layer_norms`` the metrics also hold per-layer gradient and parameter norms. An update
    whose loss or gradient norm is not finite is not applied (the step counter still advances), so a
    bad batch never poisons the state; the loop decides whether to stop or go on."""
    def loss_fn(params, frozen, batch, counted):
        """Mean nats per token; with weights, this micro-batch's weighted nats over the whole batch's ``counted``.
        Gradients for the trained parameters only (LoRA: the adapters)."""
        nll = token_nll(graphdef, join_frozen(frozen, params), batch, loss_chunk)
        return nll.mean() if counted is None else (nll * batch["weights"]).sum() / counted

    grad_fn = jax.value_and_grad(loss_fn)

    def train_step(state: TrainState, batch: Batch):
        counted = counted_tokens(batch)
        if microbatches == 1:
            loss, grads = grad_fn(state.params, state.frozen, batch, counted)
        else:
            def accumulate(carry, micro):
                loss_sum, grad_sum = carry
                loss, grads = grad_fn(state.params, state.frozen, micro, counted)
                return (loss_sum + loss, jax.tree.map(jnp.add, grad_sum, grads)), None

            zeros = jax.tree.map(jnp.zeros_like, state.params)
            (loss, grads), _ = jax.lax.scan(accumulate, (jnp.zeros((), jnp.float32), zeros),
                                            _split_microbatches(batch, microbatches))
            if counted is None:  # every micro-batch has the same token count, so the mean of means is the batch mean
                loss, grads = loss / microbatches, jax.tree.map(lambda g: g / microbatches, grads)
        grad_norm = optax.tree.norm(grads)
        updates, opt_state = tx.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
        params, opt_state = jax.tree.map(lambda new, old: jnp.where(finite, new, old),
                                         (params, opt_state), (state.params, state.opt_state))
        metrics = {"loss": loss, "grad_norm": grad_norm, "param_norm": optax.tree.norm(params),
                   "learning_rate": schedule(schedule_count(state.opt_state))}
        if layer_norms:
            metrics |= {"grad_norm_per_layer": per_layer_norm(grads["layers"]),
                        "param_norm_per_layer": per_layer_norm(params["layers"])}
        return TrainState(step=state.step + 1, params=params, opt_state=opt_state, frozen=state.frozen), metrics

    return train_step


def make_eval_step(graphdef, loss_chunk: int = 0) -> Callable[[dict, Batch], tuple[jax.Array, jax.Array]]:
    def eval_step(params: dict, batch: Batch) -> tuple[jax.Array, jax.Array]:
        """Summed nats over the batch's counted tokens, and their count; the caller divides the sums."""
        nll = token_nll(graphdef, params, batch, loss_chunk)
        if "weights" not in batch:
            return nll.sum(), jnp.asarray(nll.size, jnp.float32)
        return (nll * batch["weights"]).sum(), batch["weights"].sum()

    return eval_step
