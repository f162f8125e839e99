"""`jaxtrain plan --hlo-report`: the compiled program's collectives, fusions, attention kernel and XLA warnings,
checked against the rule set on the CPU compile (the GPU compile: tests/test_plan_gpu.py)."""

import json
import os
import time
from types import SimpleNamespace

import jax
import numpy as np
import pytest
from conftest import REPO, run_cli, small_config, with_

from jaxtrain.plan import hlo_report
from jaxtrain.plan import estimate as plan_lib
from jaxtrain.layout import make_layout
from jaxtrain.state import bytes_per_device
from jaxtrain.models.config import MoEConfig, PipelineConfig


def _bytes(tree) -> int:
    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree))


def check_fsdp_collectives(plan, layout):
    """The rule set's collectives in the compiled step of ``small_config(rules="fsdp", mesh=(1, 8, 1))``: every
    weight gathered once per pass, every gradient reduced once, byte for byte, all over fsdp. Also used on the
    GPU compile (test_plan_gpu.py)."""
    cfg, hlo = layout.cfg, plan.compiled.hlo
    params = layout.spec.shapes
    layers = params["layers"]
    per_layer_weights = _bytes({k: v for k, v in layers.items() if "norm" not in k}) // cfg.model.num_layers
    tables = _bytes(params["embed"]) + _bytes(params["lm_head"])
    gathers = [c for c in hlo.collectives if c.kind == "all-gather"]
    tokens = cfg.train.global_batch * cfg.data.seq_len
    # every weight split on fsdp (norm scales are replicated) gathered once in the forward and once in the
    # backward layer loop; the two vocabulary tables once, their gathered copies kept for the backward; the
    # token ids, for the embedding lookup's gradient
    assert {c.axes for c in hlo.collectives} == {("fsdp",)}
    assert sum(c.bytes * c.executions for c in gathers) == 2 * cfg.model.num_layers * per_layer_weights + tables + 4 * tokens
    # wq wk wv wo, gate up down (XLA may combine several into one collective)
    assert sum(c.tensors * c.executions for c in gathers) == 2 * cfg.model.num_layers * 7 + 2 + 1
    # each gradient reduced once over fsdp (XLA:CPU reduces with all-reduces, a GPU with reduce-scatters); the
    # rest are the step's scalar metrics. But the embedding's: no device holds its whole gradient, the rows'
    # gradient (this device's tokens' residual stream) goes to the devices holding their columns (jaxtrain/models/llama.py)
    reductions = [c for c in hlo.collectives if c.kind in ("all-reduce", "reduce-scatter")]
    extra = sum(c.bytes * c.executions for c in reductions) - (_bytes(params) - _bytes(params["embed"]))
    assert 0 <= extra < 1024
    (rows,) = [c for c in hlo.collectives if c.kind == "all-to-all"]
    assert rows.bytes * rows.executions == tokens // 8 * cfg.model.d_model * np.dtype(cfg.model.dtype).itemsize
    assert hlo.attention == "xla" and hlo.attention_calls == 0 and hlo.fusions > 0
    assert plan.compiled_traffic["fsdp"] == sum(c.traffic for c in hlo.collectives if c.kind in ("all-gather", "reduce-scatter", "all-to-all"))
    return hlo


def test_fsdp_gathers_each_weight_once_per_pass_and_reduces_each_gradient_once():
    cfg = small_config(rules="fsdp", mesh=(1, 8, 1))
    plan = plan_lib.make_plan(cfg, hlo_report=True)
    hlo = check_fsdp_collectives(plan, make_layout(cfg))
    assert not any(c.is_async for c in hlo.collectives)  # XLA:CPU runs collectives synchronously
    text = plan_lib.render(plan)
    assert "all-gather over fsdp" in text and "step_cost's prediction / compiled" in text


def test_replica_group_notations_map_to_mesh_axes():
    mesh = {"data": 2, "fsdp": 2, "tensor": 2}
    explicit = hlo_report.device_groups("replica_groups={{0,2},{1,3},{4,6},{5,7}}, dimensions={0}", 8)
    iota = hlo_report.device_groups("replica_groups=[4,2]<=[2,2,2]T(0,2,1), dimensions={0}", 8)
    named = hlo_report.device_groups("replica_groups=mesh['axis_0'=2,'axis_1'=2,'axis_2'=2] {'axis_1'}, dimensions={0}", 8)
    # the devices in another order: [2,2,2]T(1,0,2) lists 0 1 4 5 2 3 6 7, laid out as 2 x 1 x 4
    ordered = hlo_report.device_groups("replica_groups=mesh['axis_0'=2,'axis_1'=1,'axis_2'=4], device_ids=([2,2,2]T(1,0,2)) "
                                       "{'axis_0'}, use_global_device_ids=true", 8)
    assert explicit == iota == named == sorted(ordered) == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert hlo_report.mesh_axes(explicit, mesh) == ("fsdp",)
    swaps = hlo_report.device_groups("source_target_pairs={{0,0},{1,2},{2,1},{3,3}}", 8)  # the first pair moves nothing
    assert hlo_report.mesh_axes(swaps, mesh) == ("fsdp", "tensor")
    assert hlo_report.mesh_axes(hlo_report.device_groups("replica_groups={}, to_apply=%add", 8), mesh) == ("data", "fsdp", "tensor")
    assert hlo_report.device_groups("replica_groups=<something new>", 8) is None  # unknown, not guessed


def test_async_collective_with_compute_between_start_and_done_is_overlapped():
    text = """HloModule m, is_scheduled=true

ENTRY %main (p: f32[8]) -> f32[64] {
  %p = f32[8]{0} parameter(0)
  %ag-start = (f32[8]{0}, f32[64]{0}) all-gather-start(%p), replica_groups=[1,8]<=[8], dimensions={0}
  %f = f32[8]{0} fusion(%p), kind=kLoop, calls=%fused
  %ag-done = f32[64]{0} all-gather-done(%ag-start)
  %ar-start = f32[64]{0} all-reduce-start(%ag-done), replica_groups={{0,1,2,3,4,5,6,7}}, to_apply=%add
  ROOT %ar-done = f32[64]{0} all-reduce-done(%ar-start)
}
"""
    report = hlo_report.report(text, {"data": 1, "fsdp": 8, "tensor": 1})
    gather, reduce = report.collectives
    assert (gather.kind, gather.bytes, gather.is_async, gather.overlapped) == ("all-gather", 256, True, True)
    assert (reduce.kind, reduce.bytes, reduce.is_async, reduce.overlapped) == ("all-reduce", 256, True, False)
    assert reduce.traffic == 2 * 256 * 7 / 8 and report.fusions == 1


def test_overlap_is_compute_between_a_start_and_its_own_done():
    """Two collectives in flight at once: each start pairs with the done that names it, and only compute scheduled
    between the two (a fusion, a cuBLAS gemm) overlaps it; compute after the done does not."""
    text = f"""HloModule m, is_scheduled=true

ENTRY %main (p: f32[8], a: bf16[8,16], w: bf16[16,4]) -> f32[64] {{
  %p = f32[8]{{0}} parameter(0)
  %a = bf16[8,16]{{1,0}} parameter(1)
  %w = bf16[16,4]{{1,0}} parameter(2)
  %ag-start = (f32[8]{{0}}, f32[64]{{0}}) all-gather-start(%p), replica_groups=[1,8]<=[8], dimensions={{0}}
  %ar-start = f32[8]{{0}} all-reduce-start(%p), replica_groups={{{{0,1,2,3,4,5,6,7}}}}, to_apply=%add
  %ag-done = f32[64]{{0}} all-gather-done(%ag-start)
  %gemm = (bf16[8,4]{{1,0}}, s8[64]{{0}}) custom-call(%a, %w), custom_call_target="__cublas$lt$matmul", {GEMM_CONFIG}
  %ar-done = f32[8]{{0}} all-reduce-done(%ar-start)
  ROOT %after = f32[64]{{0}} fusion(%ag-done, %ar-done), kind=kLoop, calls=%fused
}}
"""
    gather, reduce = hlo_report.report(text, {"data": 1, "fsdp": 8, "tensor": 1}).collectives
    assert (gather.bytes, gather.dtypes, gather.is_async, gather.overlapped) == (256, ("f32",), True, False)
    assert (reduce.bytes, reduce.dtypes, reduce.is_async, reduce.overlapped) == (32, ("f32",), True, True)


def test_a_collective_wrapped_in_an_async_start_is_asynchronous_and_overlapped_by_compute_before_its_done():
    """XLA's general form of an asynchronous instruction: ``async-start`` calling a computation that holds the
    collective, and ``async-done``."""
    text = """HloModule m, is_scheduled=true

%wrapped_all_to_all (p0: f32[16]) -> f32[16] {
  %p0 = f32[16]{0} parameter(0)
  ROOT %a2a = f32[16]{0} all-to-all(%p0), replica_groups={{0,1},{2,3}}, dimensions={0}
}

ENTRY %main (x: f32[16]) -> f32[16] {
  %x = f32[16]{0} parameter(0)
  %a2a-start = ((f32[16]{0}), f32[16]{0}, s32[]) async-start(%x), calls=%wrapped_all_to_all
  %f = f32[16]{0} fusion(%x), kind=kLoop, calls=%fused
  ROOT %a2a-done = f32[16]{0} async-done(%a2a-start)
}
"""
    (a2a,) = hlo_report.report(text, {"fsdp": 2, "expert": 2}).collectives
    assert (a2a.kind, a2a.axes, a2a.bytes, a2a.executions, a2a.is_async, a2a.overlapped) == \
        ("all-to-all", ("expert",), 64, 1, True, True)


def test_a_permute_counts_the_bytes_of_the_devices_that_send_and_stage_axes_are_the_pipelines():
    text = """HloModule m, is_scheduled=true

ENTRY %main (p: f32[16]) -> f32[16] {
  %p = f32[16]{0} parameter(0)
  %roll = f32[16]{0} collective-permute(%p), source_target_pairs={{0,1},{1,0},{2,3},{3,2}}
  %half = f32[16]{0} collective-permute(%roll), source_target_pairs={{1,0},{3,2}}
  ROOT %ar = f32[16]{0} all-reduce(%half), replica_groups={{0,2},{1,3}}, to_apply=%add
}
"""
    report = hlo_report.report(text, {"fsdp": 2, "stage": 2})
    roll, half, summed = report.collectives
    # every device sends its 64 bytes in the roll; half of them in the other (a transposed roll's halves)
    assert (roll.axes, roll.traffic, half.traffic) == (("stage",), 64, 32)
    assert summed.axes == ("fsdp",)
    assert report.traffic_by_step_cost_kind(("fsdp",), ("stage",)) == {"fsdp": 0.0, "data": 64.0, "tensor": 0.0, "pipeline": 96.0}
    assert report.traffic_by_step_cost_kind(("fsdp",)) == {"fsdp": 0.0, "data": 64.0, "tensor": 96.0}
    # a collective over a batch axis and another is not the batch axes' (the swaps above span fsdp and stage)
    swaps = hlo_report.report(text.replace("{{1,0},{3,2}}", "{{0,3},{3,0}}"), {"fsdp": 2, "stage": 2})
    assert swaps.collectives[1].axes == ("fsdp", "stage")
    assert swaps.traffic_by_step_cost_kind(("fsdp",)) == {"fsdp": 0.0, "data": 64.0, "tensor": 64.0 + 32.0}
    # a device paired with itself sends nothing (XLA's permutes of a layout change list every device; the report had
    # counted twice the bytes of ZeRO-1's permutes over data x fsdp, test_an_optimizer_state_split_...)
    in_place = hlo_report.report(text.replace("{{1,0},{3,2}}", "{{0,0},{1,0},{2,2},{3,2}}"), {"fsdp": 2, "stage": 2})
    assert in_place.collectives[1].traffic == 32


def test_an_all_to_all_over_batch_axes_is_fsdps_and_over_an_expert_axis_expert_parallelisms():
    """The embedding lookup's gradient rows go to the table's columns in an all-to-all over fsdp (jaxtrain/models/llama.py);
    a mixture of experts' tokens to their experts in one over the expert axis (capacity dispatch), or gathered over
    it and their outputs reduce-scattered back (dropless); FSDP gathers weights over fsdp; gathers and reduce-scatters
    over tensor are tensor parallelism's."""
    text = """HloModule m, is_scheduled=true

ENTRY %main (p: f32[16]) -> f32[16] {
  %p = f32[16]{0} parameter(0)
  %rows = f32[16]{0} all-to-all(%p), replica_groups={{0,2},{1,3}}, dimensions={0}
  %tokens = f32[16]{0} all-to-all(%rows), replica_groups={{0,1},{2,3}}, dimensions={0}
  %group = f32[32]{0} all-gather(%tokens), replica_groups={{0,1},{2,3}}, dimensions={0}
  %weights = f32[32]{0} all-gather(%tokens), replica_groups={{0,2},{1,3}}, dimensions={0}
  ROOT %back = f32[16]{0} reduce-scatter(%group), replica_groups={{0,1},{2,3}}, dimensions={0}, to_apply=%add
}
"""
    report = hlo_report.report(text, {"fsdp": 2, "expert": 2})
    assert [c.axes for c in report.collectives] == [("fsdp",), ("expert",), ("expert",), ("fsdp",), ("expert",)]
    assert report.traffic_by_step_cost_kind(("fsdp", "expert"), (), ("expert",)) == \
        {"fsdp": 32.0 + 64.0, "data": 0.0, "tensor": 0.0, "expert": 32.0 + 64.0 + 64.0}
    # on fsdp x tensor the all-to-all, gather and reduce-scatter over tensor are tensor parallelism's, not expert
    # parallelism's (the all-to-all was counted as the experts', which a dense model's printed comparison leaves out)
    tensor = hlo_report.report(text, {"fsdp": 2, "tensor": 2})
    assert tensor.traffic_by_step_cost_kind(("fsdp",)) == {"fsdp": 32.0 + 64.0, "data": 0.0, "tensor": 32.0 + 64.0 + 64.0}


def test_no_rule_set_makes_spmd_replicate_a_tensor_whole():
    """GSPMD's "Involuntary full rematerialization" warning: a layout it could reach only by replicating a tensor.
    The embedding lookup's gradient laid out as the table with no layout for the rows' gradient before its scatter-add
    raised it (fsdp_tp on data x fsdp x tensor, as `jaxtrain plan tiny`); jaxtrain/models/llama.py sends those rows split over
    the batch's axes but the columns' and over the columns' axes. Dropless expert dispatch sorted over the whole batch
    raised it on fsdp_ep with data 2 and on fsdp_tp_ep; jaxtrain/models/moe.py sorts per device."""
    experts = {"mlp_dim": 16, "moe": MoEConfig(num_experts=4, top_k=2, dispatch="dropless")}
    for rules, mesh, model in (("fsdp_tp", (2, 2, 2), {}), ("fsdp", (2, 2, 2), {}), ("tp", (2, 2, 2), {}),
                               ("fsdp_ep", (2, 2, 1, 1, 2), experts), ("fsdp_tp_ep", (1, 2, 2, 1, 2), experts)):
        plan = plan_lib.make_plan(small_config(rules, mesh, **model), hlo_report=True)
        assert not [w for w in plan.compiled.hlo.warnings if "Involuntary full rematerialization" in w], rules


@pytest.mark.parametrize("repeats", [1, 2])
def test_a_pipeline_moves_what_step_cost_predicts(repeats):
    """Per iteration one shift of the micro-batches in flight, forward and back; once a pass the output from stage 0 to
    every stage and the input's gradient summed over them; the circular schedule's weights and their gradients over
    the stages (jaxtrain/models/pipeline.py). The micro-batch buffer replicated over the stages cost a broadcast and a sum in
    every iteration. Data parallelism: GSPMD sums a stage's gradients over data in every iteration that runs it
    (optim.grad_sync=microbatch; auto sums them once per step, tests/test_grad_comm.py). jax 0.11.2's partitioner
    replicated the circular weights' gradients whole to lay them back out unless the stored layout is constrained
    (make test-jax-next). Without repeats that constraint split the view's repeats dimension, of size 1, over the
    stages: every weight and its gradient went there and back by all-to-alls (pp_fsdp: 4.7x the predicted pipeline
    bytes here; llama3_1b's 12 layers on 2 stages x fsdp 2, GPU compile: 2.8 GiB a step against 40 MiB)."""
    piped = {"pipeline": PipelineConfig(microbatches=2, repeats=repeats)}
    for rules, mesh in (("pp_fsdp", (1, 4, 1, 2)), ("pp_dp", (4, 1, 1, 2))):
        cfg = with_(small_config(rules, mesh, num_layers=4), model=piped, optim={"grad_sync": "microbatch"})
        plan = plan_lib.make_plan(cfg, hlo_report=True)
        predicted, compiled = plan.step_time.traffic_bytes, plan.compiled_traffic
        assert compiled["pipeline"] == pytest.approx(predicted["pipeline"], rel=0.01), rules  # and metrics' scalars
        assert not [w for w in plan.compiled.hlo.warnings if "Involuntary full rematerialization" in w], rules
    # (FSDP's traffic: tests/test_plan_gpu.py; XLA:CPU all-reduces where a GPU reduce-scatters)
    assert compiled["data"] == pytest.approx(predicted["data"], rel=0.01)


def test_an_optimizer_state_split_over_more_batch_axes_lies_inside_its_weights_shards(tmp_path):
    """A user's ZeRO-1 over fsdp_tp (``optimizer_state: embed: [data, fsdp]``, data 2 x fsdp 2 x tensor 2): the state's
    axes are nested under the weights' (fsdp first, partitioning.nested_under), so each device's slice of the state lies
    in its own shard of the weight and the updated weights are all-gathered over data once, each shard's bytes: the
    gathers step_cost counts. In the rule's order each device's slice lay in another device's shard: XLA moved the
    updates by collective permutes over data x fsdp (the GPU compile of a 760M model: 0.3 GiB a step, none predicted)
    and gathered twice the bytes. Those gathers over data, an axis that splits no weight, are data parallelism's in
    the compiled traffic, as step_cost counts them; they were FSDP's. XLA:CPU all-reduces the gradients where the GPU
    compiler reduce-scatters them (the GPU compile's bytes equal step_cost's: tests/test_plan_gpu.py)."""
    rules = tmp_path / "zero1_tp.yaml"
    rules.write_text("extends: fsdp_tp\noptimizer_state:\n  embed: [data, fsdp]\n")
    cfg = small_config(str(rules))
    plan, plain = (plan_lib.make_plan(c, hlo_report=True) for c in (cfg, small_config("fsdp_tp")))
    collectives = plan.compiled.hlo.collectives
    assert not [c for c in collectives if c.kind == "collective-permute"]
    layout = make_layout(cfg)
    split = [x for x, axes in zip(jax.tree.leaves(layout.abstract_state().params), jax.tree.leaves(
        layout.spec.logical_axes, is_leaf=lambda a: isinstance(a, jax.sharding.PartitionSpec)), strict=True) if "embed" in axes]
    shards = bytes_per_device(split)  # the device's shards of the weights whose optimizer state data splits further
    gathers = [c for c in collectives if c.kind == "all-gather" and c.axes == ("data",)]
    assert sum(c.bytes * c.executions for c in gathers) == shards
    gathered = sum(c.traffic for c in gathers)
    assert gathered == shards * (2 - 1) / 2  # step_cost's ZeRO-1 term: each shard gathered over data's 2 devices
    assert plan.compiled_traffic["fsdp"] == plain.compiled_traffic["fsdp"]
    assert plan.compiled_traffic["data"] == pytest.approx(plain.compiled_traffic["data"] + gathered, abs=1024)  # and scalars


def test_xla_log_lines_are_captured_as_warnings_and_still_printed(capfd):
    with hlo_report.captured_stderr() as log:
        os.write(2, b"W0000 spmd_partitioner.cc:652] [SPMD] Involuntary full rematerialization. The compiler was not able\n")
        os.write(2, b"I0000 something routine\n")
        os.write(2, b"W1130 12:21:14.583601    3561 hlo_rematerialization.cc:3231] Can't reduce memory use below 61.09GiB\n")
        os.write(2, b"E1130 12:21:15.000001    3561 gemm_fusion_autotuner.cc:1000] Autotuning failed for a fusion\n")
    assert "Involuntary full rematerialization" in capfd.readouterr().err  # written on
    report = hlo_report.report("ENTRY %e () -> f32[] {\n}\n", {"data": 8}, log[0])
    assert len(report.warnings) == 3 and "Involuntary" in report.warnings[0] and "Can't reduce" in report.warnings[1]
    assert "Autotuning failed" in report.warnings[2]  # errors XLA logged and went on from count too


def test_known_xla_warnings_are_explained_in_a_line():
    """What a replicated tensor and a step above XLA's scheduling limit mean, in the report and its JSON."""
    replicated = "W0000 spmd_partitioner.cc:652] [SPMD] Involuntary full rematerialization. The compiler was not able"
    above = ("W1203 19:02:10.274645 5571 hlo_rematerialization.cc:3231] Can't reduce memory use below 61.76GiB "
             "(66315479664 bytes) by rematerialization; only reduced to 66.93GiB (71866844824 bytes), down from 67.04GiB")
    assert "replicating a tensor whole on every device" in hlo_report.warning_meaning(replicated)
    meaning = hlo_report.warning_meaning(above)
    assert meaning.startswith("the step needs 66.93 GiB at its peak, above the 61.76 GiB XLA's GPU compiler schedules for")
    other = "W1203 19:02:11.000001 5571 other.cc:1] something else"
    assert hlo_report.warning_meaning(other) is None
    report = hlo_report.report("ENTRY %e () -> f32[] {\n}\n", {"data": 8}, "\n".join((replicated, above, other)))
    assert report.to_json()["xla_warning_meanings"] == [hlo_report.warning_meaning(replicated), meaning, None]


def _plan_of(hlo: hlo_report.HloReport) -> SimpleNamespace:
    """What ``plan_lib.render_hlo`` reads of a plan, around a report of hand-written HLO."""
    return SimpleNamespace(compiled=SimpleNamespace(device_kind="cpu", hlo=hlo), compiled_traffic=hlo.traffic_by_step_cost_kind(("data",)),
                           step_time=SimpleNamespace(traffic_bytes={"fsdp": 0.0, "data": 0.0, "tensor": 0.0}))


def test_runs_multiply_by_known_trip_counts_and_are_lower_bounds_without_one():
    def module(trip: str) -> str:
        return f"""HloModule m, is_scheduled=true

%body (p: f32[8]) -> f32[8] {{
  %p = f32[8]{{0}} parameter(0)
  ROOT %ar = f32[8]{{0}} all-reduce(%p), replica_groups={{}}, to_apply=%add
}}

ENTRY %main (x: f32[8]) -> f32[8] {{
  %x = f32[8]{{0}} parameter(0)
  ROOT %w = f32[8]{{0}} while(%x), condition=%cond, body=%body, backend_config={{{trip}"known_induction_variable":{{}}}}
}}
"""
    known = hlo_report.report(module('"known_trip_count":{"n":"5"},'), {"data": 8}).collectives[0]
    assert (known.executions, known.executions_known, known.bytes) == (5, True, 32)
    peeled = hlo_report.report(module(""), {"data": 8})
    assert (peeled.collectives[0].executions, peeled.collectives[0].executions_known) == (1, False)
    # the printed report marks such runs, bytes and traffic as lower bounds
    text = "\n".join(plan_lib.render_hlo(_plan_of(peeled)))
    assert "  all-reduce over data                    1    >=1" in text and "runs, bytes, traffic are lower bounds" in text


def test_runs_in_nested_loops_multiply_the_trip_counts():
    """A collective in the layer scan inside the micro-batch scan runs layers x micro-batches times a step; one in
    the micro-batch scan's body, micro-batches times. Custom calls (a Pallas kernel here) likewise."""
    module = """HloModule m, is_scheduled=true

%layer (p: f32[8]) -> f32[8] {
  %p = f32[8]{0} parameter(0)
  %k = f32[8]{0} custom-call(%p), custom_call_target="__gpu$xla.gpu.triton"
  ROOT %in_layer = f32[8]{0} all-reduce(%k), replica_groups={}, to_apply=%add
}

%microbatch (q: f32[8]) -> f32[8] {
  %q = f32[8]{0} parameter(0)
  %layers = f32[8]{0} while(%q), condition=%cond, body=%layer, backend_config={"known_trip_count":{"n":"5"}}
  ROOT %in_microbatch = f32[8]{0} all-reduce(%layers), replica_groups={}, to_apply=%add
}

ENTRY %main (x: f32[8]) -> f32[8] {
  %x = f32[8]{0} parameter(0)
  ROOT %w = f32[8]{0} while(%x), condition=%cond, body=%microbatch, backend_config={"known_trip_count":{"n":"3"}}
}
"""
    report = hlo_report.report(module, {"data": 8})
    assert sorted(c.executions for c in report.collectives) == [3, 15]
    (row,) = report.groups()
    assert (row["instructions"], row["executions"], row["tensors"], row["bytes"], row["executions_known"]) == (2, 18, 18, 18 * 32, True)
    assert report.custom_calls == {"__gpu$xla.gpu.triton": 15} and report.attention == "xla"


def test_matmul_flops_by_the_element_types_the_dots_multiply():
    """Dots inside fusions (operands converted there, as XLA's GPU gemm fusions do) and at top level, times the
    trip count of the loop around them."""
    module = """HloModule m, is_scheduled=true

%gemm (p0: bf16[4,6], p1: f32[4,3]) -> f32[6,3] {
  %p0 = bf16[4,6]{1,0} parameter(0)
  %c = f32[4,6]{1,0} convert(%p0)
  %p1 = f32[4,3]{1,0} parameter(1)
  ROOT %d = f32[6,3]{1,0} dot(%c, %p1), lhs_contracting_dims={0}, rhs_contracting_dims={0}
}

%body (a: bf16[4,6], b: f32[4,3]) -> f32[6,3] {
  %a = bf16[4,6]{1,0} parameter(0)
  %b = f32[4,3]{1,0} parameter(1)
  ROOT %f = f32[6,3]{1,0} fusion(%a, %b), kind=kCustom, calls=%gemm
}

ENTRY %main (x: bf16[2,5], y: bf16[5,7]) -> bf16[2,7] {
  %x = bf16[2,5]{1,0} parameter(0)
  %y = bf16[5,7]{1,0} parameter(1)
  %w = f32[6,3]{1,0} while(%x), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"10"}}
  ROOT %d = bf16[2,7]{1,0} dot(%x, %y), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}
"""
    flops = hlo_report.report(module, {"data": 1}).matmul_flops
    # 10 runs of a (6 x 3) output over depth 4 in float32; one (2 x 7) output over depth 5 in bfloat16
    assert flops == {"f32 x f32": 10 * 2 * 6 * 3 * 4, "bf16 x bf16": 2 * 2 * 7 * 5}
    assert hlo_report.report(module, {"data": 1}).library_matmul_flops == 0  # XLA's own dots: no cuBLAS gemm


def test_kernel_bytes_count_slices_and_in_place_updates_times_trip_counts():
    """Each top-level kernel's bytes read and written, by kind: a fusion that only slices a parameter reads the
    slice, also through a bitcast (the loss's pick of each target's logit); a dynamic-update-slice root writes the
    update in place (the layer scan's stacks); loops multiply."""
    module = """HloModule m, is_scheduled=true

%elementwise (p0: f32[256]) -> f32[256] {
  %p0 = f32[256]{0} parameter(0)
  ROOT %e = f32[256]{0} exponential(%p0)
}

%save (p0: f32[4,64], p1: f32[1,64], i: s32[]) -> f32[4,64] {
  %p0 = f32[4,64]{1,0} parameter(0)
  %p1 = f32[1,64]{1,0} parameter(1)
  %i = s32[] parameter(2)
  %z = s32[] constant(0)
  ROOT %u = f32[4,64]{1,0} dynamic-update-slice(%p0, %p1, %i, %z)
}

%load (p0: f32[4,64], i: s32[]) -> f32[1,64] {
  %p0 = f32[4,64]{1,0} parameter(0)
  %i = s32[] parameter(1)
  %z = s32[] constant(0)
  ROOT %s = f32[1,64]{1,0} dynamic-slice(%p0, %i, %z), dynamic_slice_sizes={1,64}
}

%pick (p0: f32[8,256], t: s32[8,1]) -> f32[8] {
  %p0 = f32[8,256]{1,0} parameter(0)
  %flat = f32[2048]{0} bitcast(%p0)
  %t = s32[8,1]{1,0} parameter(1)
  ROOT %g = f32[8]{0} gather(%flat, %t), offset_dims={}, collapsed_slice_dims={0}, start_index_map={0}, index_vector_dim=1, slice_sizes={1}
}

%gemm (p0: bf16[8,16], p1: bf16[16,4]) -> bf16[8,4] {
  %p0 = bf16[8,16]{1,0} parameter(0)
  %p1 = bf16[16,4]{1,0} parameter(1)
  ROOT %d = bf16[8,4]{1,0} dot(%p0, %p1), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

%body (stack: f32[4,64], row: f32[1,64], i: s32[]) -> f32[4,64] {
  %stack = f32[4,64]{1,0} parameter(0)
  %row = f32[1,64]{1,0} parameter(1)
  %i = s32[] parameter(2)
  %saved = f32[4,64]{1,0} fusion(%stack, %row, %i), kind=kLoop, calls=%save, metadata={op_name="jit(f)/save"}
  ROOT %loaded = f32[1,64]{1,0} fusion(%saved, %i), kind=kLoop, calls=%load, metadata={op_name="jit(f)/load"}
}

ENTRY %main (x: f32[256], a: bf16[8,16], b: bf16[16,4], q: bf16[2,8], l: f32[8,256], t: s32[8,1]) -> bf16[8,4] {
  %x = f32[256]{0} parameter(0)
  %a = bf16[8,16]{1,0} parameter(1)
  %b = bf16[16,4]{1,0} parameter(2)
  %q = bf16[2,8]{1,0} parameter(3)
  %l = f32[8,256]{1,0} parameter(4)
  %t = s32[8,1]{1,0} parameter(5)
  %e = f32[256]{0} fusion(%x), kind=kLoop, calls=%elementwise, metadata={op_name="jit(f)/exp"}
  %picked = f32[8]{0} fusion(%l, %t), kind=kLoop, calls=%pick, metadata={op_name="jit(f)/pick"}
  %w = f32[4,64]{1,0} while(%x), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"4"}}
  %o = bf16[2,8]{1,0} custom-call(%q, %q), custom_call_target="__cudnn$fmhaSoftmax"
  ROOT %g = bf16[8,4]{1,0} fusion(%a, %b), kind=kCustom, calls=%gemm
}
"""
    hlo = hlo_report.report(module, {"data": 1})
    assert (hlo.attention, hlo.attention_calls, hlo.custom_calls) == ("cudnn", 1, {"__cudnn$fmhaSoftmax": 1})
    # exp: 1 KiB in, 1 KiB out; each of 4 iterations: save reads the row (256 B) and index (4 B) and writes the row
    # in place, load reads the row it slices and the index and writes it; pick reads 8 logits and 8 indices, writes 8
    assert hlo.kernel_bytes == {"other": 2048 + 4 * (256 + 4 + 256) * 2 + 3 * 32, "matmul": 2 * (8 * 16 + 16 * 4 + 8 * 4),
                                "attention": 3 * 2 * 2 * 8}
    assert hlo.largest_other_kernels == (("jit(f)/save", 4 * 516), ("jit(f)/load", 4 * 516), ("jit(f)/exp", 2048),
                                        ("jit(f)/pick", 3 * 32))


def test_kernel_bytes_of_jax_0_11s_program_text():
    """What jax 0.11's XLA writes differently: a fusion started asynchronously (``fusion-start``, its body not a
    computation of kernels of its own), a stack bitcast before its in-place update, and ``name#i`` for element i of
    a tuple (where 0.10 had a get-tuple-element). Read as 0.10's, the layer scan's saves counted the whole stack:
    llama3_8b on 8 H100s, 10,155 GiB of elementwise traffic a step where 0.10.2's program has 6,282."""
    module = """HloModule m, is_scheduled=true

%save (stack: f32[4,64], row: f32[64], i: s32[]) -> f32[4,64] {
  %stack = f32[4,64]{1,0} parameter(0)
  %as_rows = f32[4,1,64]{2,1,0} bitcast(%stack)
  %row = f32[64]{0} parameter(1)
  %r = f32[1,1,64]{2,1,0} bitcast(%row)
  %i = s32[] parameter(2)
  %z = s32[] constant(0)
  %u = f32[4,1,64]{2,1,0} dynamic-update-slice(%as_rows, %r, %i, %z, %z)
  ROOT %b = f32[4,64]{1,0} bitcast(%u)
}

ENTRY %main (t: (f32[4,64], f32[64], /*index=2*/s32[])) -> f32[64] {
  %t = (f32[4,64]{1,0}, f32[64]{0}, /*index=2*/s32[]) parameter(0)
  %start = ((f32[4,64]{1,0}, f32[64]{0}, s32[]), f32[4,64]{1,0}, u32[]) fusion-start(%t#0, %t#1, %t#2), kind=kLoop, calls=%save, metadata={op_name="jit(f)/save"}
  %saved = f32[4,64]{1,0} fusion-done(%start)
  ROOT %c = f32[64]{0} copy(%t#1), metadata={op_name="jit(f)/copy"}
}
"""
    hlo = hlo_report.report(module, {"data": 1})
    assert hlo.fusions == 1
    # save: reads the row (256 B) and index (4 B), writes the row in place; copy: 256 B in, 256 B out
    assert hlo.largest_other_kernels == (("jit(f)/save", 256 + 4 + 256), ("jit(f)/copy", 2 * 256))


GEMM_CONFIG = ('backend_config={"gemm_backend_config":{"dot_dimension_numbers":{"lhs_batch_dimensions":[],'
               '"lhs_contracting_dimensions":["1"],"rhs_batch_dimensions":[],"rhs_contracting_dimensions":["0"]}}}')


def test_library_gemms_count_as_matmuls_and_a_product_computed_twice_is_reported():
    """cuBLAS gemms (custom calls; XLA's choice where its autotuner finds them faster, or with Triton gemms off)
    count in the matmul FLOPs and kernels, without their workspace; XLA's dynamic-slice fusion that writes a gemm's
    result into a stack counts as a matmul kernel. jax 0.11's XLA computes such a gemm twice, for the stack and for
    its other users (llama3_1b on one H200 with cuBLAS gemms: 44 of 287 TFLOPs a step): the report names it."""
    module = f"""HloModule m, is_scheduled=true

%save (p0: bf16[8,16], p1: bf16[16,4], p2: bf16[3,8,4], p3: s32[]) -> (bf16[3,8,4], s8[64]) {{
  %p2 = bf16[3,8,4]{{2,1,0}} parameter(2)
  %p0 = bf16[8,16]{{1,0}} parameter(0)
  %rows = bf16[8,16]{{1,0}} bitcast(%p0)
  %p1 = bf16[16,4]{{1,0}} parameter(1)
  %g = (bf16[8,4]{{1,0}}, s8[64]{{0}}) custom-call(%rows, %p1), custom_call_target="__cublas$lt$matmul", {GEMM_CONFIG}
  %r = bf16[8,4]{{1,0}} get-tuple-element(%g), index=0
  %b = bf16[1,8,4]{{2,1,0}} bitcast(%r)
  %ws = s8[64]{{0}} get-tuple-element(%g), index=1
  %p3 = s32[] parameter(3)
  %z = s32[] constant(0)
  %u = bf16[3,8,4]{{2,1,0}} dynamic-update-slice(%p2, %b, %p3, %z, %z)
  ROOT %t = (bf16[3,8,4]{{2,1,0}}, s8[64]{{0}}) tuple(%u, %ws)
}}

ENTRY %main (a: bf16[8,16], w: bf16[16,4], v: bf16[16,4], stack: bf16[3,8,4], i: s32[]) -> bf16[3,8,4] {{
  %a = bf16[8,16]{{1,0}} parameter(0)
  %w = bf16[16,4]{{1,0}} parameter(1)
  %v = bf16[16,4]{{1,0}} parameter(2)
  %stack = bf16[3,8,4]{{2,1,0}} parameter(3)
  %i = s32[] parameter(4)
  %y = (bf16[8,4]{{1,0}}, s8[64]{{0}}) custom-call(%a, %w), custom_call_target="__cublas$lt$matmul", {GEMM_CONFIG}
  %x = (bf16[8,4]{{1,0}}, s8[64]{{0}}) custom-call(%a, %v), custom_call_target="__cublas$lt$matmul", {GEMM_CONFIG}
  %saved = (bf16[3,8,4]{{2,1,0}}, s8[64]{{0}}) fusion(%a, %w, %stack, %i), kind=kCustom, calls=%save
  ROOT %s = bf16[3,8,4]{{2,1,0}} get-tuple-element(%saved), index=0
}}
"""
    hlo = hlo_report.report(module, {"data": 1})
    one = 2 * 8 * 4 * 16  # a (8 x 4) product over depth 16
    assert hlo.matmul_flops == {"bf16 x bf16": 3 * one} and hlo.library_matmul_flops == 3 * one
    assert hlo.duplicated_matmul_flops == one  # %saved's gemm multiplies %a by %w again; %x multiplies %a by %v
    body = hlo.to_json()
    assert (body["library_matmul_flops"], body["duplicated_matmul_flops"]) == (3 * one, one)
    assert (hlo.attention, hlo.attention_calls) == ("xla", 0)  # cuBLAS calls are no attention kernel
    # printed: cuBLAS's share of the matmul FLOPs, and its calls among the custom calls whose FLOPs are counted there
    text = "\n".join(plan_lib.render_hlo(_plan_of(hlo)))
    assert "bf16 x bf16 100.0%; cuBLAS 100.0%" in text and "computed twice: 1.02e+03 FLOPs (33.3%)" in text
    assert "custom calls per step (library and Pallas kernels; the gemms among them are counted in the matmul FLOPs above, " \
           "the others' FLOPs are not): __cublas$lt$matmul 3" in text  # the fusion's too (it counted 2 until 2026-12-05)
    # the calls read both operands (256 + 128 B) and write the product (64 B), not their 64 B workspaces; the fusion
    # reads them and the index (4 B) and writes the product into the stack in place
    assert hlo.kernel_bytes == {"matmul": 2 * (256 + 128 + 64) + (256 + 128 + 4 + 64), "attention": 0, "other": 0}


def test_a_product_is_the_same_when_read_through_slices_and_asynchronous_kernels():
    """The same layer's weight sliced from the stack in a kernel of its own (jax 0.11 runs it asynchronously) or
    inside the fusion that multiplies it (bf16 weights, e.g. a LoRA's frozen base: 44 of 209 TFLOPs a step computed
    twice for llama3_1b); another layer's slice is another product, and so is a product of what two fusions sharing
    one body compute from different operands."""
    module = f"""HloModule m, is_scheduled=true

%slice (p0: bf16[2,16,4], p1: s32[]) -> bf16[1,16,4] {{
  %p0 = bf16[2,16,4]{{2,1,0}} parameter(0)
  %p1 = s32[] parameter(1)
  %z = s32[] constant(0)
  ROOT %ds = bf16[1,16,4]{{2,1,0}} dynamic-slice(%p0, %p1, %z, %z), dynamic_slice_sizes={{1,16,4}}
}}

%async_slice (p0: bf16[2,16,4], p1: s32[]) -> bf16[1,16,4] {{
  %p0 = bf16[2,16,4]{{2,1,0}} parameter(0)
  %p1 = s32[] parameter(1)
  ROOT %f = bf16[1,16,4]{{2,1,0}} fusion(%p0, %p1), kind=kLoop, calls=%slice
}}

%sliced_gemm (p0: bf16[2,16,4], p1: s32[], p2: bf16[8,16]) -> (bf16[8,4], s8[64]) {{
  %p0 = bf16[2,16,4]{{2,1,0}} parameter(0)
  %p1 = s32[] parameter(1)
  %zero = s32[] constant(0)
  %ds = bf16[1,16,4]{{2,1,0}} dynamic-slice(%p0, %p1, %zero, %zero), dynamic_slice_sizes={{1,16,4}}
  %w = bf16[16,4]{{1,0}} bitcast(%ds)
  %p2 = bf16[8,16]{{1,0}} parameter(2)
  ROOT %g = (bf16[8,4]{{1,0}}, s8[64]{{0}}) custom-call(%p2, %w), custom_call_target="__cublas$lt$matmul", {GEMM_CONFIG}
}}

%converted_gemm (p0: f32[8,16], p1: bf16[16,4]) -> (bf16[8,4], s8[64]) {{
  %p0 = f32[8,16]{{1,0}} parameter(0)
  %c = bf16[8,16]{{1,0}} convert(%p0)
  %p1 = bf16[16,4]{{1,0}} parameter(1)
  ROOT %g = (bf16[8,4]{{1,0}}, s8[64]{{0}}) custom-call(%c, %p1), custom_call_target="__cublas$lt$matmul", {GEMM_CONFIG}
}}

ENTRY %main (a: bf16[8,16], stack: bf16[2,16,4], i: s32[], j: s32[], x: f32[8,16], y: f32[8,16]) -> (bf16[8,4], s8[64]) {{
  %a = bf16[8,16]{{1,0}} parameter(0)
  %stack = bf16[2,16,4]{{2,1,0}} parameter(1)
  %i = s32[] parameter(2)
  %j = s32[] parameter(3)
  %start = ((bf16[2,16,4]{{2,1,0}}, s32[]), bf16[1,16,4]{{2,1,0}}, u32[]) async-start(%stack, %i), calls=%async_slice
  %done = bf16[1,16,4]{{2,1,0}} async-done(%start)
  %w = bf16[16,4]{{1,0}} bitcast(%done)
  %y = (bf16[8,4]{{1,0}}, s8[64]{{0}}) custom-call(%a, %w), custom_call_target="__cublas$lt$matmul", {GEMM_CONFIG}
  %again = (bf16[8,4]{{1,0}}, s8[64]{{0}}) fusion(%stack, %i, %a), kind=kCustom, calls=%sliced_gemm
  %other_layer = (bf16[8,4]{{1,0}}, s8[64]{{0}}) fusion(%stack, %j, %a), kind=kCustom, calls=%sliced_gemm
  %x = f32[8,16]{{1,0}} parameter(4)
  %y = f32[8,16]{{1,0}} parameter(5)
  %from_x = (bf16[8,4]{{1,0}}, s8[64]{{0}}) fusion(%x, %w), kind=kCustom, calls=%converted_gemm
  ROOT %from_y = (bf16[8,4]{{1,0}}, s8[64]{{0}}) fusion(%y, %w), kind=kCustom, calls=%converted_gemm
}}
"""
    hlo = hlo_report.report(module, {"data": 1})
    one = 2 * 8 * 4 * 16
    assert hlo.matmul_flops == {"bf16 x bf16": 5 * one} and hlo.duplicated_matmul_flops == one


def test_a_deep_graph_of_fusions_is_read_in_linear_time():
    """Each fusion here reads the one before twice: resolving every operand's form eagerly takes 2^depth steps (a
    tiny train step's program hung the benchmark runner so); read as far as a form needs, it is immediate."""
    depth = 24
    chain = "\n".join(f"  %f{k} = f32[4,4]{{1,0}} fusion(%f{k - 1}, %f{k - 1}), kind=kLoop, calls=%add" for k in range(1, depth))
    module = f"""HloModule m, is_scheduled=true

%add (p0: f32[4,4], p1: f32[4,4]) -> f32[4,4] {{
  %p0 = f32[4,4]{{1,0}} parameter(0)
  %p1 = f32[4,4]{{1,0}} parameter(1)
  ROOT %s = f32[4,4]{{1,0}} add(%p0, %p1)
}}

ENTRY %main (x: f32[4,4]) -> f32[4,4] {{
  %x = f32[4,4]{{1,0}} parameter(0)
  %f0 = f32[4,4]{{1,0}} fusion(%x, %x), kind=kLoop, calls=%add
{chain}
  ROOT %d = f32[4,4]{{1,0}} dot(%f{depth - 1}, %x), lhs_contracting_dims={{1}}, rhs_contracting_dims={{0}}
}}
"""
    start = time.perf_counter()
    hlo = hlo_report.report(module, {"data": 1})
    assert time.perf_counter() - start < 2.0
    assert hlo.matmul_flops == {"f32 x f32": 2 * 4 * 4 * 4} and hlo.duplicated_matmul_flops == 0


def test_cli_plan_json_has_the_hlo_report():
    result = run_cli("plan", "tiny", "--rules", "fsdp", "--json", "--hlo-report", "train.global_batch=8", cwd=REPO)
    assert result.returncode == 0, result.stderr
    plan = json.loads(result.stdout)
    body = plan["hlo_report"]
    assert body["attention"] == "xla" and body["fusions"] > 0
    assert {g["kind"] for g in body["collectives"]} >= {"all-gather"}
    assert set(body["traffic_bytes"]["predicted"]) == set(body["traffic_bytes"]["compiled"]) == {"fsdp", "data", "tensor"}
    assert np.isclose(sum(g["traffic_bytes"] for g in body["collectives"]), sum(body["traffic_bytes"]["compiled"].values()))
    # a float32 model: float32 products only; at least the model's own FLOPs on each device's share of the batch
    # (fsdp on the tiny experiment's mesh: 4 batch shards, the tensor axis repeats their work)
    matmuls = body["matmul_flops_by_operand_types"]
    assert set(matmuls) == {"f32 x f32"}
    assert matmuls["f32 x f32"] >= plan["flops_per_token"] * 8 * plan["experiment"]["seq_len"] / 4
    # the kernels' traffic: matmul and elementwise kernels both move bytes, and the largest of the latter are named
    assert all(body["kernel_bytes_per_step"][kind] > 0 for kind in ("other", "matmul"))
    assert len(body["largest_other_kernels"]) == hlo_report.LARGEST_KERNELS
