"""Numerical parity: the same model, seed and batches give the same losses on any mesh / rule set."""

import json
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import small_config, with_
from jaxtrain.layout import lower_train_step, make_layout
from jaxtrain.optim import learning_rate_schedule
from jaxtrain.step import make_train_step
from jaxtrain.train import build, train

# (rule set, mesh data x fsdp x tensor) on 8 devices
LAYOUTS = [("dp", (8, 1, 1)), ("fsdp", (1, 8, 1)), ("tp", (4, 1, 2)), ("fsdp_tp", (2, 2, 2))]


def _losses(cfg, corpus, tmp_path, devices=None) -> list[float]:
    run_dir = tmp_path / f"{cfg.rules}-{len(devices or jax.devices())}-{cfg.model.dtype}"
    train(cfg, run_dir, build(cfg, corpus, devices))
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in records if "loss" in r]


@pytest.mark.parametrize("dtype, rtol, layouts, remat", [("float32", 1e-5, LAYOUTS, "none"), ("bfloat16", 2e-2, LAYOUTS[-1:], "none"),
                                                          ("float32", 1e-5, LAYOUTS[1::2], "full")])
def test_first_five_losses_match_one_device(dtype, rtol, layouts, remat, corpus, tmp_path):
    """Every layout in float32, to its rounding; bfloat16 on the layout with every axis (its casts are the same
    code on each), to bfloat16's. Under a remat policy the layers gather their FSDP-split weights themselves, with
    their own backward (jaxtrain/models/sharding.py ``gathered``): the layouts with fsdp again."""
    reference = _losses(small_config("dp", (1, 1, 1), dtype=dtype, remat=remat), corpus, tmp_path, jax.devices()[:1])
    assert len(reference) == 5 and reference[4] < reference[0]  # it trains
    for rules, mesh in layouts:
        losses = _losses(small_config(rules, mesh, dtype=dtype, remat=remat), corpus, tmp_path)
        np.testing.assert_allclose(losses, reference, rtol=rtol, err_msg=f"{rules} on mesh {mesh}")


def test_gradient_accumulation_matches_one_batch(corpus, tmp_path):
    cfg = with_(small_config(), train={"steps": 3, "global_batch": 32})
    reference = build(cfg, corpus)
    accumulated = build(with_(cfg, train={"microbatches": 4}), corpus)
    from jaxtrain.data import train_batches

    states, metrics = [], []
    for trainer in (reference, accumulated):
        state = trainer.init_state()
        batches = train_batches(corpus, cfg.data, cfg.train.global_batch, trainer.batch_sharding)
        steps = []
        for _ in range(3):
            state, m = trainer.train_step(state, next(batches))
            steps.append(jax.device_get(m))
        states.append(jax.device_get(state.params))
        metrics.append(steps)
    for a, b in zip(*metrics):
        np.testing.assert_allclose(a["loss"], b["loss"], rtol=1e-5)
        np.testing.assert_allclose(a["grad_norm"], b["grad_norm"], rtol=1e-5)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5), *states)


def _activation_rows(jaxpr, length: int) -> set[int]:
    """The leading dimension of every float (rows, length, ...) array the jaxpr makes, nested ones included."""
    rows = set()
    for eqn in jaxpr.eqns:
        rows.update(v.aval.shape[0] for v in eqn.outvars
                    if jnp.issubdtype(v.aval.dtype, jnp.floating) and v.aval.ndim >= 3 and v.aval.shape[1] == length)
        for sub in jax.extend.core.jaxprs_in_params(eqn.params):
            rows |= _activation_rows(sub, length)
    return rows


def test_gradient_accumulation_runs_one_micro_batch_at_a_time():
    """Every activation of the train step holds one micro-batch's rows, the memory accumulation saves: one pass over
    the whole batch gives the numbers of the test above too, so that test cannot tell."""
    for microbatches in (2, 4):
        cfg = with_(small_config("dp", (1, 1, 1)), train={"global_batch": 8, "microbatches": microbatches})
        layout = make_layout(cfg, jax.devices()[:1])
        step = make_train_step(layout.spec.graphdef, layout.tx, learning_rate_schedule(cfg), microbatches)
        jaxpr = jax.make_jaxpr(step)(layout.abstract_state(), layout.abstract_batch()).jaxpr
        assert max(_activation_rows(jaxpr, cfg.data.seq_len)) == 8 // microbatches


def test_micro_batches_are_cut_where_the_devices_hold_the_rows():
    """Micro-batch j takes rows j, j + k, ...: each device's block of the batch holds its share of every micro-batch, so
    the data-parallel step moves no rows between devices (only the gradients' all-reduces). Cut into contiguous halves,
    each micro-batch lay on half the devices, and every pass gathered and permuted its tokens and activations."""
    cfg = with_(small_config("dp", (8, 1, 1)), train={"global_batch": 16, "microbatches": 2}, optim={"grad_sync": "microbatch"})
    text = lower_train_step(make_layout(cfg)).compile().as_text()
    assert "all-reduce(" in text
    assert not re.findall(r"\b(all-gather|all-to-all|collective-permute)(-start)?\(", text)
