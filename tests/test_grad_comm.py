"""optim.grad_dtype=bfloat16: gradients summed across the batch shards in bfloat16 (jaxtrain/memory/grad_comm.py)."""

import shutil

import jax
import numpy as np
import pytest

from conftest import small_config, with_
from jaxtrain import compile_cache
from jaxtrain.plan import hlo_report
from jaxtrain.plan import step_cost
from jaxtrain.layout import lower_steps, make_layout
from jaxtrain.train import build, train
from test_memory import _run

STEPS = 6


def _cfg(grad_dtype, rules="dp", mesh=(8, 1, 1), microbatches=1):
    return with_(small_config(rules, mesh), optim={"grad_dtype": grad_dtype}, log={"layer_every": 0},
                 train={"steps": STEPS, "global_batch": 16, "microbatches": microbatches},
                 checkpoint={"every": 2, "keep": STEPS, "async_save": False})


def _gradient_reductions(cfg) -> dict[tuple[str, str], int]:
    """Bytes per (kind, element type) that the partitioned step's all-reduces and reduce-scatters carry, scalars left out."""
    layout = make_layout(cfg)
    hlo = hlo_report.report(hlo_report.partitioned_hlo(lower_steps(layout)[0]), dict(layout.mesh.shape))
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
    lowered = lower_steps(make_layout(_cfg("bfloat16")))[0]
    with compile_cache.using(str(tmp_path)):
        lowered.compile()
        assert any(tmp_path.iterdir())  # the cache holds the program now
        assert "all-reduce" in hlo_report.partitioned_hlo(lowered)
