"""optim.grad_dtype=bfloat16: gradients summed across the batch shards in bfloat16 (jaxtrain/memory/grad_comm.py)."""

import shutil

import jax
import numpy as np
import pytest

from conftest import small_config, with_
from test_plan import medium_config

from jaxtrain import compile_cache
from jaxtrain.errors import UserError
from jaxtrain.plan.gpu_targets import LINK_BYTES_PER_S
from jaxtrain.plan import hlo_report
from jaxtrain.plan import step_cost
from jaxtrain.layout import lower_train_step, make_layout
from jaxtrain.train import build, train
from test_memory import _run
from jaxtrain.models.config import MoEConfig, PipelineConfig

STEPS = 6


def _cfg(grad_dtype, rules="dp", mesh=(8, 1, 1), microbatches=1):
    return with_(small_config(rules, mesh), optim={"grad_dtype": grad_dtype}, log={"layer_every": 0},
                 train={"steps": STEPS, "global_batch": 16, "microbatches": microbatches},
                 checkpoint={"every": 2, "keep": STEPS, "async_save": False})


def _gradient_reductions(cfg) -> dict[tuple[str, str], int]:
    """Bytes per (kind, element type) that the partitioned step's all-reduces and reduce-scatters carry, scalars left out."""
    layout = make_layout(cfg)
    hlo = hlo_report.report(hlo_report.partitioned_hlo(lower_train_step(layout)), dict(layout.mesh.shape))
    out: dict[str, int] = {}
    for c in hlo.collectives:
        if c.kind in ("all-reduce", "reduce-scatter") and c.bytes > 4 * c.tensors:
            assert len(set(c.dtypes)) == 1, c
            assert c.executions_known or c.dtypes[0] == "f32", c  # the bfloat16 sums run outside every loop: once a step
            out[c.kind, c.dtypes[0]] = out.get((c.kind, c.dtypes[0]), 0) + c.bytes * c.executions
    return out


def test_gradients_are_reduced_in_bfloat16_only_when_asked():
    params = make_layout(_cfg("float32")).spec.num_params
    # GSPMD's own reductions sit in the layer loop (no trip count yet right after partitioning): float32 only
    assert set(_gradient_reductions(_cfg("float32"))) == {("all-reduce", "f32")}
    # each whole gradient summed once a step, in bfloat16, after both micro-batches' passes; ZeRO-2 keeps a slice of
    # each: reduce-scatters, in bfloat16
    assert _gradient_reductions(_cfg("bfloat16", microbatches=2)) == {("all-reduce", "bf16"): params * 2}
    assert _gradient_reductions(_cfg("bfloat16", "zero2")) == {("reduce-scatter", "bf16"): params * 2}
    # the planner's traffic model: every gradient in 2 bytes, not 4; zero2 a reduce-scatter, half an all-reduce
    f32, bf16, zero2 = (step_cost.step_time(make_layout(_cfg(*args)), "h100") for args in (("float32",), ("bfloat16",), ("bfloat16", "zero2")))
    assert bf16.traffic_bytes["data"] == pytest.approx(f32.traffic_bytes["data"] / 2)
    assert "gradients summed in bfloat16" in bf16.describe() and "gradients summed in float32" in f32.describe()
    zero1 = step_cost.step_time(make_layout(_cfg("bfloat16", "zero1")), "h100")
    assert zero2.traffic_bytes["data"] == pytest.approx(zero1.traffic_bytes["data"] - bf16.traffic_bytes["data"] / 2)
    # one device: nothing to sum (the plan had said "gradients summed in float32 in every micro-batch", a QA report)
    alone = step_cost.step_time(make_layout(_cfg("float32", mesh=(1, 1, 1), microbatches=2), jax.devices()[:1]), "h100")
    assert "gradients summed" not in alone.describe()
    # nor in bfloat16: the gradients are not rounded to it (they were, a QA report)
    assert make_layout(_cfg("bfloat16", mesh=(1, 1, 1), microbatches=2), jax.devices()[:1]).grad_reduction is None


@pytest.fixture(scope="module")
def trainers(corpus):
    """float32 in one pass; bfloat16 sums over two micro-batches (each device accumulates both, then one sum)."""
    return {"float32": build(_cfg("float32"), corpus), "bfloat16": build(_cfg("bfloat16", microbatches=2), corpus)}


def test_bfloat16_reduction_trains_like_float32_and_resumes_exactly(trainers, corpus, tmp_path):
    _, reference = _run(trainers["float32"], corpus, STEPS)
    _, reduced = _run(trainers["bfloat16"], corpus, STEPS)
    losses = np.array([[m["loss"] for m in run] for run in (reference, reduced)])
    # bfloat16 keeps 8 bits of mantissa: the sums differ in the third digit, the losses by a few 1e-4 over 6 steps
    np.testing.assert_allclose(losses[1], losses[0], rtol=2e-3)
    assert not np.array_equal(losses[1], losses[0])
    run_dir = tmp_path / "run"
    final = train(trainers["bfloat16"].cfg, run_dir, trainers["bfloat16"])
    shutil.rmtree(run_dir / "checkpoints" / str(STEPS))
    again = train(trainers["bfloat16"].cfg, run_dir, trainers["bfloat16"])
    assert all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(jax.device_get(again)), jax.tree.leaves(jax.device_get(final))))



def test_the_partitioned_program_is_read_even_when_the_compilation_cache_holds_it(tmp_path):
    # a program the persistent cache gives back runs no compiler passes, so none would be dumped (a warm cache failed here)
    lowered = lower_train_step(make_layout(_cfg("bfloat16")))
    with compile_cache.using(str(tmp_path)):
        lowered.compile()
        assert any(tmp_path.iterdir())  # the cache holds the program now
        assert "all-reduce" in hlo_report.partitioned_hlo(lowered)


# optim.grad_sync: with gradient accumulation, the sums over the batch axes no weight is split over run once per step

def _sync_cfg(grad_sync, rules="fsdp_tp", mesh=(2, 2, 2), microbatches=4, **model):
    return with_(small_config(rules, mesh, **model), optim={"grad_sync": grad_sync}, log={"layer_every": 0},
                 train={"steps": 3, "global_batch": 32, "microbatches": microbatches})


def _data_sums(cfg) -> dict[bool, int]:
    """Bytes per step of the partitioned step's all-reduces over the data axis, by whether they run outside every loop
    (inside one, before XLA's passes, the count of runs is not known yet: one each here); scalars left out."""
    layout = make_layout(cfg)
    hlo = hlo_report.report(hlo_report.partitioned_hlo(lower_train_step(layout)), dict(layout.mesh.shape))
    out: dict[bool, int] = {}
    for c in hlo.collectives:
        if c.kind == "all-reduce" and c.axes == ("data",) and c.bytes > 4 * c.tensors:  # not the loss's
            out[c.executions_known] = out.get(c.executions_known, 0) + c.bytes * c.executions
    return out


def test_grad_sync_step_sums_each_gradient_once_after_the_micro_batches_under_fsdp_and_tensor_parallelism():
    layout = make_layout(_sync_cfg("step"))
    # data is the one batch axis no weight is split over (fsdp splits them, tensor is no batch axis): hybrid sharding
    assert layout.grad_reduction.axes == ("data",) and layout.grad_reduction.rules is not None
    shard_bytes = sum(4 * np.prod(x.sharding.shard_shape(x.shape)) for x in jax.tree.leaves(layout.abstract_state().params))
    # every device's float32 shard of every gradient, summed over data once, outside the micro-batch and layer loops
    assert _data_sums(_sync_cfg("step")) == {True: shard_bytes}
    # GSPMD's sums: inside the loops (the layer loop's gradients, in every micro-batch)
    assert set(_data_sums(_sync_cfg("microbatch"))) == {False}


def test_grad_sync_auto_sums_once_per_step_only_where_that_moves_fewer_bytes():
    def summed(sync, **kw):
        return make_layout(_sync_cfg(sync, **kw)).grad_reduction is not None
    # float32 accumulators against k sums in the compute dtype: float32 from 2 micro-batches, bfloat16 from 3
    assert summed("auto", microbatches=2) and not summed("auto", microbatches=2, dtype="bfloat16")
    assert summed("auto", microbatches=4, dtype="bfloat16") and summed("step", microbatches=2, dtype="bfloat16")
    assert not summed("auto", microbatches=1) and not summed("step", microbatches=1) and not summed("microbatch")
    # pipeline stages: GSPMD sums a stage's gradients in every iteration, (2 repeats x 2 + 2 - 1) / 2 a pass
    piped = {"rules": "pp_fsdp", "mesh": (2, 2, 1, 2), "num_layers": 4, "pipeline": PipelineConfig(microbatches=2, repeats=2)}
    assert summed("auto", microbatches=1, dtype="bfloat16", **piped) and not summed("microbatch", **piped)
    # FSDP over every batch axis: each weight is split over them, nothing to sum once (ZeRO-3 reduce-scatters per pass)
    assert not summed("step", rules="fsdp", mesh=(1, 8, 1))
    assert make_layout(_sync_cfg("step", rules="fsdp", mesh=(1, 8, 1))).replica_axes == ()  # the summary says step has no effect
    assert make_layout(_sync_cfg("step")).replica_axes == ("data",)
    # pure data parallelism: every axis manual (shard_map), the bfloat16 path's
    pure = make_layout(_sync_cfg("auto", rules="dp", mesh=(8, 1, 1))).grad_reduction
    assert pure.rules is None and pure.ways == 8


def test_grad_sync_choices_that_cannot_run_are_one_line_errors():
    moe = {"mlp_dim": 16, "moe": MoEConfig(num_experts=4, top_k=2)}
    assert make_layout(_sync_cfg("auto", **moe)).grad_reduction is None  # jax cannot vmap ragged_dot: GSPMD's sums
    with pytest.raises(UserError, match="optim.grad_sync=step with a mixture-of-experts model .* also splits over fsdp, tensor"):
        make_layout(_sync_cfg("step", **moe))
    with pytest.raises(UserError, match="optim.grad_sync=microbatch with optim.grad_dtype=bfloat16: narrower sums run once per step"):
        make_layout(with_(_sync_cfg("microbatch"), optim={"grad_dtype": "bfloat16"}))


def test_grad_sync_step_trains_like_per_micro_batch_sums(corpus):
    runs = {sync: _run(build(_sync_cfg(sync), corpus), corpus, 3)[1] for sync in ("step", "microbatch")}
    for key in ("loss", "grad_norm"):
        values = np.array([[m[key] for m in runs[sync]] for sync in runs])
        np.testing.assert_allclose(values[0], values[1], rtol=1e-5)


def test_zero2_micro_batches_summed_once_per_step_update_as_one_pass(corpus):
    """ZeRO-2 with 4 micro-batches (optim.grad_sync=auto: float32 accumulators, summed once per step, each device
    reduce-scattering its slice) against one pass over the batch: the same losses, gradient norms and parameters,
    to float32 rounding (the sums run in another order)."""
    runs = {}
    for microbatches in (1, 4):
        trainer = build(_sync_cfg("auto", "zero2", (8, 1, 1), microbatches=microbatches), corpus)
        reduction = trainer.layout.grad_reduction  # k=1: GSPMD's sums in the one pass
        assert (microbatches == 1 and reduction is None) or (reduction.rules is None and reduction.grad_specs is not None)
        state, metrics = _run(trainer, corpus, 3)
        runs[microbatches] = jax.device_get(state.params), metrics
    for key in ("loss", "grad_norm"):
        np.testing.assert_allclose([m[key] for m in runs[4][1]], [m[key] for m in runs[1][1]], rtol=1e-5)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5), runs[4][0], runs[1][0])


@pytest.mark.parametrize("sections", [
    "embed: fsdp\n  norm: fsdp",  # ZeRO-2 inside a node, data across nodes: split over some of the batch axes
    "embed: data\n  mlp: fsdp",  # the MLP weights' gradients split on two dimensions
])
def test_grad_sync_step_sums_over_every_batch_axis_whatever_the_gradients_section_splits(corpus, tmp_path, sections):
    """The once-per-step sum of a pure data-parallel mesh reduce-scatters over the axes a rule file's ``gradients:``
    section splits on and all-reduces over the others. It had summed over the split axes only: with gradients split
    over fsdp and not data, each data group kept its own gradients, and the run trained on without a word."""
    rules = tmp_path / "zero2_custom.yaml"
    rules.write_text(f"extends: dp\noptimizer_state:\n  {sections}\ngradients:\n  {sections}\n")
    runs = {}
    for sync in ("step", "microbatch"):  # microbatch: GSPMD's sums, the reference
        trainer = build(_sync_cfg(sync, str(rules), (2, 4, 1), microbatches=2), corpus)
        assert (trainer.layout.grad_reduction is None) == (sync == "microbatch")
        runs[sync] = _run(trainer, corpus, 3)[1]
    for key in ("loss", "grad_norm"):
        values = np.array([[m[key] for m in runs[sync]] for sync in runs])
        np.testing.assert_allclose(values[0], values[1], rtol=1e-5)


def test_the_planner_counts_the_once_per_step_sums_and_does_not_hide_them():
    cfg = with_(medium_config("fsdp", "full", mesh=(2, 4, 1), microbatches=4), train={"global_batch": 32})  # bfloat16 compute
    once, every = (step_cost.step_time(make_layout(with_(cfg, optim={"grad_sync": sync})), "h100") for sync in ("auto", "microbatch"))
    layout = make_layout(cfg)
    norms = (2 * 4 + 1) * 256  # replicated over fsdp too: their float32 gradients still summed over fsdp in every pass
    local = sum(np.prod(x.sharding.shard_shape(x.shape)) for x in jax.tree.leaves(layout.abstract_state().params))
    nvlink, _ = LINK_BYTES_PER_S["h100"]
    after = 2 * local * 4 * 1 / 2  # float32, all-reduced over data (2 ways) once
    assert once.traffic_bytes["data"] == pytest.approx(4 * 2 * norms * 4 * 3 / 4 + after)
    assert once.after_backward_s == pytest.approx(after / nvlink)
    # per micro-batch: every weight's bfloat16 gradient over data but the embedding's (the float32 of its lookup's
    # scatter-add, jaxtrain/models/llama.py), the norm scales' float32 ones over data and fsdp
    embedding = 4096 * 256 / 4
    assert every.traffic_bytes["data"] == pytest.approx(
        4 * 2 * ((local - norms - embedding) * 2 * 1 / 2 + embedding * 4 * 1 / 2 + norms * 4 * 7 / 8))
    assert every.after_backward_s == 0
    # the once-a-step sums follow the backward pass: added to the step, only the rest overlaps the compute
    overlapped = once.communication_s["fsdp"] + once.communication_s["data"] - once.after_backward_s
    assert once.total_s == pytest.approx(once.compute_s + once.after_backward_s + max(0, overlapped - once.compute_s))
    assert "gradients summed in float32 once per step over data" in once.describe()
    assert "in every micro-batch" in every.describe()
