"""Pure train and eval steps: (state, batch) -> (state, metrics). No I/O, no host syncs."""

from __future__ import annotations

import contextlib
from typing import Callable

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from jaxtrain import spikes as spikes_lib
from jaxtrain.memory import loss_scale as loss_scale_lib
from jaxtrain.adapt.adapters import join_frozen
from jaxtrain.state import TrainState
from jaxtrain.models.lora import dropout_key
from jaxtrain.models.moe import pop_router_stats

# 'inputs', 'targets': (batch, length) int32; packed instruction data (data.format=sft) adds 'segment_ids' and
# 'positions' (int32, for the model) and 'weights' (float32: 1 where the target token counts in the loss)
Batch = dict[str, jax.Array]


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


@jax.custom_vjp
def cross_entropy(logits: jax.Array, targets: jax.Array) -> jax.Array:
    """-log softmax(logits)[target] per token: logits (..., vocab) float32, targets (...) int32. The numbers of
    optax.softmax_cross_entropy_with_integer_labels, with a backward written out: softmax minus the target's one-hot,
    times the cotangent, in one elementwise pass. optax's backward scatters into a zeroed float32 array of the
    logits' size (the gradient of take_along_axis) and adds it to the softmax term: compiled for an H200, llama3_1b
    (128K vocabulary, batch 8 x 4096) held one more such array at its peak, 7.8 GiB, and moved 63 GiB more per
    step. On XLA:CPU, which scatters in place, this backward is the slower one (``make bench``: cross_entropy)."""
    return _cross_entropy_fwd(logits, targets)[0]


def _cross_entropy_fwd(logits, targets):
    log_normalizer = jax.nn.logsumexp(logits, axis=-1)
    nll = log_normalizer - jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
    return nll, (logits, targets, log_normalizer)


def _cross_entropy_bwd(residuals, grad):
    logits, targets, log_normalizer = residuals
    one_hot = targets[..., None] == jax.lax.broadcasted_iota(targets.dtype, logits.shape, logits.ndim - 1)
    return (jnp.exp(logits - log_normalizer[..., None]) - one_hot) * grad[..., None], None


cross_entropy.defvjp(_cross_entropy_fwd, _cross_entropy_bwd)


def _token_nll(model, batch: Batch, loss_chunk: int) -> jax.Array:
    packing = batch.get("segment_ids"), batch.get("positions")
    if not loss_chunk:
        return cross_entropy(model(batch["inputs"], *packing), batch["targets"])
    return model.chunked_loss(model.hidden(batch["inputs"], *packing), batch["targets"], loss_chunk, cross_entropy)


# the batch's entry of its rows' numbers in the step's batch, from which LoRA dropout draws each row's masks
DROPOUT_ROWS = "dropout_rows"


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


def training_objective(graphdef, params: dict, batch: Batch, loss_chunk: int = 0, counted: jax.Array | None = None,
                       share: float = 1.0) -> tuple[jax.Array, tuple[jax.Array, dict]]:
    """What the optimizer minimises, as this pass's part of the whole batch's value (``share``: the pass's
    fraction of the batch's sequences): the token loss (mean nats per token; with weights, the weighted nats over
    the whole batch's ``counted`` tokens) plus a MoE model's weighted router losses (mean over layers). The aux:
    the token loss and the router statistics, as parts of the batch's too. Summing the passes gives the batch."""
    nll, stats = token_nll_and_router_stats(graphdef, params, batch, loss_chunk)
    loss = nll.mean() * share if counted is None else (nll * batch["weights"]).sum() / counted
    stats = jax.tree.map(lambda s: s * share, stats)
    return loss + (jnp.mean(stats["router_loss"]) if stats else 0.0), (loss, stats)


def make_train_step(graphdef, tx: optax.GradientTransformation, schedule: optax.Schedule, microbatches: int,
                    layer_norms: bool = False, loss_chunk: int = 0, *, grad_shardings=None, device_opt_state=None,
                    loss_scale_period: int = 0, grad_reduction=None, device_params=None,
                    dropout_seed: int | None = None, skip_spikes: float = 0.0) -> Callable[[TrainState, Batch], tuple[TrainState, dict]]:
    """With ``layer_norms`` the metrics also hold per-layer gradient and parameter norms. An update
    whose loss or gradient norm is not finite is not applied (the step counter still advances), so a
    bad batch never poisons the state; the loop decides whether to stop or go on (and stops where the update's own
    norm is not finite, which the step applied). ``grad_shardings``
    places the gradients (ZeRO-2: reduce-scattered); ``device_opt_state`` are the optimizer state's shardings
    in device memory, where the step brings it from the host (optim.offload) for the update; with a loss scale in the
    state (float16) the objective is scaled before differentiation and an overflowing update skipped. ``grad_reduction``
    (optim.grad_dtype, jaxtrain/memory/grad_comm.py) sums each pass's gradients over the batch axes in its own dtype;
    ``device_params``: the trained parameters' shardings in device memory, where the step brings offloaded master
    weights for the whole step (optim.offload under narrower compute). ``dropout_seed`` (LoRA dropout): the forward
    passes run inside ``models.lora.dropout_key`` with a key from the seed and the step (each row's masks drawn with
    its number in the batch, however the step cuts it), so a resumed run draws the masks of an uninterrupted one. With a
    spike window in the state (``train.skip_spikes``, jaxtrain/spikes.py) an update whose loss or gradient norm lies more
    than ``skip_spikes`` of the window's standard deviations from its mean is not applied either."""
    def placed(grads):
        return grads if grad_shardings is None else jax.lax.with_sharding_constraint(grads, grad_shardings)

    def pass_grads(params, frozen, batch, counted, share, scale, key=None):
        """Gradients for the trained parameters only (LoRA: the adapters), of the scaled objective."""
        batch = dict(batch)
        rows = batch.pop(DROPOUT_ROWS, None)

        def objective(trained):
            with contextlib.nullcontext() if key is None else dropout_key(key, rows):
                value, aux = training_objective(graphdef, join_frozen(frozen, trained), batch, loss_chunk, counted, share)
            return scale.scale(value), aux

        (_, (loss, stats)), grads = jax.value_and_grad(objective, has_aux=True)(params)
        return (loss, stats), grads

    def batch_grads(params, frozen, batch, counted, scale, key=None, share=1.0, place=lambda grads: grads):
        """The gradient passes over the batch (gradient accumulation: one per micro-batch), summed; ``place``
        lays out each pass's gradients; ``key``: the step's dropout key, the same for every micro-batch (each row draws
        its masks with its number in the step's batch, carried by the batch)."""
        if microbatches == 1:
            parts, grads = pass_grads(params, frozen, batch, counted, share, scale, key)
            return parts, place(grads)

        def accumulate(carry, micro):
            parts, grads = pass_grads(params, frozen, micro, counted, share / microbatches, scale, key)
            return jax.tree.map(jnp.add, carry, (parts, place(jax.tree.map(lambda g: g.astype(jnp.float32), grads)))), None

        micro = _split_microbatches(batch, microbatches)
        # zeros shaped like (loss, router stats) of one micro-batch; gradients like the parameters, in float32 whatever
        # their dtype (bfloat16 parameters' passes make bfloat16 gradients: summed in it, each addition rounded again)
        first = jax.tree.map(lambda x: x[0], micro)
        one_pass = jax.eval_shape(lambda p, f, b: pass_grads(p, f, b, counted, 1.0, scale), params, frozen, first)
        zeros = (jax.tree.map(jnp.zeros_like, one_pass[0]), place(jax.tree.map(lambda p: jnp.zeros_like(p, jnp.float32), params)))
        return jax.lax.scan(accumulate, zeros, micro)[0]

    def train_step(state: TrainState, batch: Batch):
        if device_opt_state is not None:
            state = state.replace(opt_state=jax.device_put(state.opt_state, device_opt_state))
        if device_params is not None:
            state = state.replace(params=jax.device_put(state.params, device_params))
        scale = loss_scale_lib.scaler(state.loss_scale, loss_scale_period)
        counted = counted_tokens(batch)
        key = None if dropout_seed is None else jax.random.fold_in(jax.random.key(dropout_seed), state.step)
        if key is not None:  # each row's number, split with the batch into micro-batches and device groups
            batch = batch | {DROPOUT_ROWS: jnp.arange(batch["inputs"].shape[0])}
        if grad_reduction is None:  # GSPMD sums each pass's gradients where the backward pass makes them
            (loss, stats), grads = batch_grads(state.params, state.frozen, batch, counted, scale, key, place=placed)
        else:  # each device accumulates its own passes; one sum over the devices after the last
            (loss, stats), grads = grad_reduction.wrap(batch_grads)(state.params, state.frozen, batch, counted, scale, key)
            grads = placed(grads)
        # in float32, as the optimizer takes them (jaxtrain.optim.in_float32): the micro-batches' float32 sums unscaled and
        # not rounded to bfloat16 parameters' dtype (their norm was a bfloat16 figure, 0.6% off on tiny)
        grads = jax.tree.map(lambda g: g.astype(jnp.float32), scale.unscale(grads))
        grad_norm = optax.tree.norm(grads)
        updates, opt_state = tx.update(grads, state.opt_state, state.params)
        # finite loss and gradients can still make a non-finite update (a 0 / 0 in the optimizer's float32 arithmetic):
        # the applied parameters' norm (param_norm) is then non-finite, which stops the run before a checkpoint takes it
        # (metrics.MetricsLog). Not the update's own norm: as a gate it kept every parameter's update until the whole
        # norm was known (llama3_3b's H200 compile 52.6 -> 59.8 GiB), as a metric it still cost 0.8 GiB there
        params = optax.apply_updates(state.params, updates)
        finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
        applied, spikes, spike_metrics = finite, state.spikes, {}
        if spikes is not None:
            watched = {"loss": loss, "grad_norm": grad_norm}
            far = spikes_lib.deviations(spikes, watched)
            spike = finite & ((far["loss"] > skip_spikes) | (far["grad_norm"] > skip_spikes))
            applied, spikes = finite & ~spike, spikes_lib.entered(spikes, watched, finite)
            spike_metrics = {"spike": spike, "loss_deviations": far["loss"], "grad_norm_deviations": far["grad_norm"],
                             "spike_window_steps": spikes_lib.held(state.spikes)}  # what the deviations were taken over
        params, opt_state = jax.tree.map(lambda new, old: jnp.where(applied, new, old),
                                         (params, opt_state), (state.params, state.opt_state))
        metrics = {"loss": loss, "grad_norm": grad_norm, "param_norm": optax.tree.norm(params),
                   "learning_rate": schedule(schedule_count(state.opt_state))} | router_metrics(stats) | spike_metrics
        if state.loss_scale is not None:  # an overflow of the scaled gradients: skipped, the scale halved
            metrics |= {"loss_scale": scale.loss_scale,
                        "overflow": jnp.isfinite(loss) & ~jnp.isfinite(grad_norm) & loss_scale_lib.can_lower(scale)}
        if layer_norms:
            metrics |= {"grad_norm_per_layer": per_layer_norm(grads["layers"]),
                        "param_norm_per_layer": per_layer_norm(params["layers"])}
        return TrainState(step=state.step + 1, params=params, opt_state=opt_state, frozen=state.frozen,
                          loss_scale=loss_scale_lib.to_state(scale.adjust(jnp.isfinite(grad_norm))), spikes=spikes), metrics

    return train_step


def make_eval_step(graphdef, loss_chunk: int = 0, device_params=None,
                   microbatches: int = 1) -> Callable[[dict, Batch], tuple[jax.Array, jax.Array]]:
    """``device_params``: the model parameters' shardings in device memory, where the step brings them from the host.
    ``microbatches``: the train step's count (train.microbatches, or the one ``auto`` fitted): the batch is scored in as
    many forward passes, one after the other, so no pass holds more than a train step's pass does (the whole batch's
    float32 logits at once had been train.microbatches times the train step's: an OOM at the first evaluation)."""
    def batch_sums(params: dict, batch: Batch) -> tuple[jax.Array, jax.Array]:
        nll = token_nll(graphdef, params, batch, loss_chunk)
        if "weights" not in batch:
            return nll.sum(), jnp.asarray(nll.size, jnp.float32)
        return (nll * batch["weights"]).sum(), batch["weights"].sum()

    def eval_step(params: dict, batch: Batch) -> tuple[jax.Array, jax.Array]:
        """Summed nats over the batch's counted tokens, and their count; the caller divides the sums."""
        if device_params is not None:
            params = jax.device_put(params, device_params)
        if microbatches == 1:
            return batch_sums(params, batch)

        def accumulate(carry, micro):
            return jax.tree.map(jnp.add, carry, batch_sums(params, micro)), None

        zeros = (jnp.zeros((), jnp.float32), jnp.zeros((), jnp.float32))
        return jax.lax.scan(accumulate, zeros, _split_microbatches(batch, microbatches))[0]

    return eval_step
