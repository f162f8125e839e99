"""Pure train and eval steps: (state, batch) -> (state, metrics). No I/O, no host syncs."""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from jaxtrain import loss_scale as loss_scale_lib
from jaxtrain.state import TrainState

Batch = dict[str, jax.Array]  # 'inputs', 'targets': (batch, length) int32


def token_nll(graphdef, params: dict, batch: Batch, loss_chunk: int = 0) -> jax.Array:
    """Negative log-likelihood (nats) of every target token, float32, shape (batch, length). With
    ``loss_chunk`` the logits are made that many positions at a time and remade in the backward pass,
    so only one chunk's float32 (batch, chunk, vocab) logits is ever live: for large vocabularies."""
    model = nnx.merge(graphdef, params)
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


def make_train_step(graphdef, tx: optax.GradientTransformation, schedule: optax.Schedule, microbatches: int,
                    layer_norms: bool = False, loss_chunk: int = 0, *, grad_shardings=None, device_opt_state=None,
                    loss_scale_period: int = 0) -> Callable[[TrainState, Batch], tuple[TrainState, dict]]:
    """With ``layer_norms`` the metrics also hold per-layer gradient and parameter norms. An update
    whose loss or gradient norm is not finite is not applied (the step counter still advances), so a
    bad batch never poisons the state; the loop decides whether to stop or go on. ``grad_shardings``
    places the gradients (ZeRO-2: reduce-scattered); ``device_opt_state`` are the optimizer state's shardings
    in device memory, where the step brings it from the host (optim.offload) for the update; with a loss scale in the
    state (float16) the loss is scaled before differentiation and an overflowing update skipped."""
    def loss_fn(params, batch, scale):
        loss = token_nll(graphdef, params, batch, loss_chunk).mean()
        return scale.scale(loss), loss

    value_and_grad = jax.value_and_grad(loss_fn, has_aux=True)

    def placed(grads):
        return grads if grad_shardings is None else jax.lax.with_sharding_constraint(grads, grad_shardings)

    def grad_fn(params, batch, scale):
        (_, loss), grads = value_and_grad(params, batch, scale)
        return loss, placed(grads)

    def train_step(state: TrainState, batch: Batch):
        if device_opt_state is not None:
            state = state.replace(opt_state=jax.device_put(state.opt_state, device_opt_state))
        scale = loss_scale_lib.scaler(state.loss_scale, loss_scale_period)
        if microbatches == 1:
            loss, grads = grad_fn(state.params, batch, scale)
        else:
            def accumulate(carry, micro):
                loss_sum, grad_sum = carry
                loss, grads = grad_fn(state.params, micro, scale)
                return (loss_sum + loss, jax.tree.map(jnp.add, grad_sum, grads)), None

            zeros = placed(jax.tree.map(jnp.zeros_like, state.params))
            (loss, grads), _ = jax.lax.scan(accumulate, (jnp.zeros((), jnp.float32), zeros),
                                            _split_microbatches(batch, microbatches))
            # every micro-batch has the same token count, so the mean of means is the batch mean
            loss, grads = loss / microbatches, jax.tree.map(lambda g: g / microbatches, grads)
        grads = scale.unscale(grads)
        grad_norm = optax.tree.norm(grads)
        updates, opt_state = tx.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
        params, opt_state = jax.tree.map(lambda new, old: jnp.where(finite, new, old),
                                         (params, opt_state), (state.params, state.opt_state))
        metrics = {"loss": loss, "grad_norm": grad_norm, "param_norm": optax.tree.norm(params),
                   "learning_rate": schedule(schedule_count(state.opt_state))}
        if state.loss_scale is not None:  # an overflow of the scaled gradients: skipped, the scale halved
            metrics |= {"loss_scale": scale.loss_scale, "overflow": jnp.isfinite(loss) & ~jnp.isfinite(grad_norm)}
        if layer_norms:
            metrics |= {"grad_norm_per_layer": per_layer_norm(grads["layers"]),
                        "param_norm_per_layer": per_layer_norm(params["layers"])}
        return TrainState(step=state.step + 1, params=params, opt_state=opt_state,
                          loss_scale=loss_scale_lib.to_state(scale.adjust(jnp.isfinite(grad_norm)))), metrics

    return train_step


def make_eval_step(graphdef, loss_chunk: int = 0) -> Callable[[dict, Batch], jax.Array]:
    def eval_step(params: dict, batch: Batch) -> jax.Array:
        """Summed nats over the batch; the caller divides by the token count."""
        return token_nll(graphdef, params, batch, loss_chunk).sum()

    return eval_step
