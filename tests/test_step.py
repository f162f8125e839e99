"""The train step's objective and gradients against sums written out here: the weighted loss over micro-batches and
device groups, and the gradient accumulator's precision."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from conftest import small_config, with_
from jaxtrain.layout import lower_train_step, make_layout
from jaxtrain.optim import learning_rate_schedule
from jaxtrain.state import TrainState, state_initializer
from jaxtrain.step import make_train_step, token_nll

ROWS, LENGTH = 16, 16


def _weighted_batch(vocab: int) -> dict[str, np.ndarray]:
    """Random tokens with answer weights whose counts differ between rows, so every micro-batch and every device
    group counts another number of tokens (a mean of their means is not the batch's mean); one row counts none."""
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, vocab, (ROWS, LENGTH + 1), dtype=np.int32)
    counted = [0, 1, 16, 3, 9, 2, 12, 5, 16, 1, 7, 4, 14, 2, 6, 10]
    weights = (np.arange(LENGTH)[None, :] >= LENGTH - np.array(counted)[:, None]).astype(np.float32)
    return {"inputs": tokens[:, :-1], "targets": tokens[:, 1:], "segment_ids": np.ones((ROWS, LENGTH), np.int32),
            "positions": np.broadcast_to(np.arange(LENGTH, dtype=np.int32), (ROWS, LENGTH)).copy(), "weights": weights}


@pytest.mark.parametrize("rules, mesh, microbatches, grad_sync", [
    ("dp", (8, 1, 1), 2, "step"),  # every axis manual: one psum after both micro-batches
    ("fsdp_tp", (2, 2, 2), 2, "step"),  # device groups vmapped on data, FSDP and tensor parallelism GSPMD's
    ("dp", (8, 1, 1), 2, "microbatch"),  # GSPMD's sums in every pass
])
def test_a_weighted_loss_is_the_batchs_nats_per_counted_token_however_the_step_splits_it(rules, mesh, microbatches, grad_sync):
    """Instruction data: the loss is the batch's summed nats over its counted tokens, not a mean of the micro-batches'
    or the device groups' means; its gradient norms (as logged: before clipping, and per layer) are that objective's."""
    cfg = with_(small_config(rules, mesh), data={"format": "sft", "seq_len": LENGTH}, optim={"grad_sync": grad_sync},
                train={"global_batch": ROWS, "microbatches": microbatches}, log={"layer_every": 1})
    layout = make_layout(cfg)
    assert (layout.grad_reduction is None) == (grad_sync == "microbatch")
    step = lower_train_step(layout).compile()
    state = state_initializer(cfg.model, layout.tx, 0, layout.shardings)()
    batch = _weighted_batch(cfg.model.vocab_size)
    params = jax.device_get(state.params)

    def objective(p):  # the whole batch in one pass, weighed here
        return (token_nll(layout.spec.graphdef, p, batch) * batch["weights"]).sum() / batch["weights"].sum()

    loss, grads = jax.jit(jax.value_and_grad(objective))(params)
    grad_norm = np.sqrt(sum(np.sum(np.asarray(g, np.float64) ** 2) for g in jax.tree.leaves(grads)))
    new_state, metrics = step(state, jax.device_put(batch, layout.batch_sharding))
    np.testing.assert_allclose(metrics["loss"], loss, rtol=1e-5)
    np.testing.assert_allclose(metrics["grad_norm"], grad_norm, rtol=1e-4)
    # per layer (log.layer_every): the gradient's norms, and the updated parameters'
    for name, tree in (("grad_norm_per_layer", grads), ("param_norm_per_layer", jax.device_get(new_state.params))):
        per_layer = np.sqrt(sum(np.sum(np.asarray(x, np.float64) ** 2, axis=tuple(range(1, x.ndim)))
                                for x in jax.tree.leaves(tree["layers"])))
        np.testing.assert_allclose(metrics[name], per_layer, rtol=1e-4, err_msg=name)


def _gradient_recorder() -> optax.GradientTransformation:
    """An optimizer that applies nothing and keeps, in float32, the gradients it is given; with optax's schedule
    state, which the step's learning-rate metric reads."""
    keep = optax.GradientTransformation(
        lambda params: jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params),
        lambda updates, state, params=None: (jax.tree.map(jnp.zeros_like, updates), jax.tree.map(lambda g: g.astype(jnp.float32), updates)))
    return optax.chain(keep, optax.scale_by_schedule(lambda count: 1.0))


def test_micro_batch_gradients_of_bfloat16_parameters_are_summed_in_float32():
    """With bfloat16 parameters (the LoRA experiments') each pass's gradient is bfloat16; the accumulator sums them in
    float32 and the optimizer gets that float32 sum (jaxtrain.optim.in_float32; until 2026-12-06 rounded once to
    bfloat16). Summed in bfloat16 each of the 8 additions rounded again."""
    microbatches = 8
    cfg = with_(small_config("dp", (1, 1, 1), dtype="bfloat16", param_dtype="bfloat16", init_std=0.3),
                data={"seq_len": LENGTH}, train={"global_batch": ROWS, "microbatches": microbatches})
    layout = make_layout(cfg, jax.devices()[:1])
    tx = _gradient_recorder()
    params = jax.device_get(state_initializer(cfg.model, layout.tx, 0, layout.shardings)().params)
    state = TrainState(step=jnp.zeros((), jnp.int32), params=params, opt_state=tx.init(params))
    batch = {k: v for k, v in _weighted_batch(cfg.model.vocab_size).items() if k in ("inputs", "targets")}
    step = jax.jit(make_train_step(layout.spec.graphdef, tx, learning_rate_schedule(cfg), microbatches))
    received = jax.device_get(step(state, batch)[0].opt_state[0])

    pass_grads = jax.jit(jax.grad(lambda p, micro: token_nll(layout.spec.graphdef, p, micro).mean() / microbatches))
    # micro-batch j: rows j, j + 8, ...; each pass's gradient of its share of the batch's mean nats, bfloat16 as the parameters
    passes = [jax.device_get(pass_grads(params, {k: v[j::microbatches] for k, v in batch.items()})) for j in range(microbatches)]
    assert {x.dtype for x in jax.tree.leaves(passes)} == {jnp.dtype(jnp.bfloat16)}
    exact = jax.tree.map(lambda *gs: sum(np.asarray(g, np.float64) for g in gs), *passes)
    assert {x.dtype for x in jax.tree.leaves(received)} == {jnp.dtype(jnp.float32)}
    for (path, got), want in zip(jax.tree_util.tree_leaves_with_path(received), jax.tree.leaves(exact), strict=True):
        # the passes' own bfloat16 rounding inside the step's program (fused otherwise than the passes here): within
        # about a unit in the last place of bfloat16, 2^-8 of the value
        np.testing.assert_allclose(got, want, rtol=2 ** -8, atol=1e-7, err_msg=jax.tree_util.keystr(path))


def test_evaluation_fetches_each_batch_before_dispatching_the_next():
    """XLA:CPU runs independent dispatched steps at once: 100 evaluation steps in flight on 8 simulated devices
    deadlocked in their collectives' rendezvous, and the run aborted (status 134) after 40 s (a QA report). The mean
    is still the batches' summed nats over their summed counts."""
    from types import SimpleNamespace

    from jaxtrain.train import evaluate

    unfetched = []

    class Sum(float):  # an eval step's output: a device value until fetched
        def __float__(self):
            unfetched[:] = [s for s in unfetched if s is not self]
            return super().__float__()

    def eval_step(params, batch):
        assert not unfetched, "an evaluation step was dispatched before the previous one's sums were fetched"
        sums = Sum(batch["nll"]), Sum(batch["tokens"])
        unfetched.extend(sums)
        return sums

    batches = [{"nll": 6.0, "tokens": 4.0}, {"nll": 3.0, "tokens": 1.0}, {"nll": 1.5, "tokens": 1.0}]
    assert evaluate(SimpleNamespace(eval_step=eval_step), {}, batches) == (10.5 / 6, 6)


def test_a_non_finite_update_of_finite_gradients_stops_the_run_naming_it_whatever_skip_nonfinite_allows(tmp_path):
    """An optimizer whose arithmetic makes a non-finite update of a finite loss and gradients (a 0 / 0): the step
    applies it (holding every update back for its norm took 7.3 GiB on llama3_3b's H200 compile), the parameters' norm
    is non-finite, and the non-finite policy names it and stops the run before any checkpoint takes it, even where
    train.skip_nonfinite would skip a non-finite loss: no skip undoes an applied update. Until 2026-12-06 the guard saw
    only the next step's NaN loss."""
    from jaxtrain.observe import metrics as metrics_lib

    cfg = with_(small_config("dp", (1, 1, 1)), train={"skip_nonfinite": 3})
    layout = make_layout(cfg, jax.devices()[:1])
    broken = optax.chain(optax.scale(float("nan")), optax.scale_by_schedule(lambda count: 1.0))
    params = jax.device_get(state_initializer(cfg.model, layout.tx, 0, layout.shardings)().params)
    state = TrainState(step=jnp.zeros((), jnp.int32), params=params, opt_state=broken.init(params))
    batch = {k: v for k, v in _weighted_batch(cfg.model.vocab_size).items() if k in ("inputs", "targets")}
    after, metrics = jax.jit(make_train_step(layout.spec.graphdef, broken, learning_rate_schedule(cfg), 1))(state, batch)
    assert np.isfinite(float(metrics["loss"])) and np.isfinite(float(metrics["grad_norm"]))
    assert np.isnan(float(metrics["param_norm"]))  # applied
    log = metrics_lib.MetricsLog(layout, tmp_path, 0, compile_s=0.0, compile_cache=None, data="", enabled=False)
    with pytest.raises(metrics_lib.NonFiniteError, match=r"^step 1: param_norm not finite \(loss [0-9.]+, grad_norm [0-9.]+, "
                                                         r"param_norm nan\); .*; the optimizer made a non-finite update of finite "
                                                         r"gradients and the step applied it, so no train.skip_nonfinite skips it, "
                                                         r"and no checkpoint "
                                                         r"was written after it; check the optimizer's settings \(optim.eps, b1, b2, "
                                                         r"weight_decay\) or lower optim.lr; the last checkpoint holds the state "
                                                         r"before it$"):
        log.after_step(1, metrics)
