"""The step-time model that ranks the planner's suggestions: compute, and each collective's bytes over the
right link."""

import dataclasses

import pytest
from conftest import with_
from test_plan import medium_config

from jaxtrain.plan import step_cost
from jaxtrain.config import AxisSizes, MeshConfig
from jaxtrain.observe.flops import flops_per_token
from jaxtrain.plan.gpu_targets import LINK_BYTES_PER_S
from jaxtrain.layout import make_layout
from models.config import LoraConfig

H100_BF16 = 989.4e12


@pytest.mark.parametrize("microbatches", [1, 2])
def test_fsdp_traffic_compute_and_data_traffic_are_counted_exactly(microbatches):
    cfg = medium_config("fsdp", "full", mesh=(1, 8, 1), microbatches=microbatches)
    layout = make_layout(cfg)
    timed = step_cost.step_time(layout, "h100")
    norms = (2 * 4 + 1) * 256  # replicated over fsdp: their gradients are all-reduced, not reduce-scattered
    table = 4096 * 256  # the embedding's and the output layer's each
    layers = layout.spec.num_params - norms - 2 * table
    nvlink, _ = LINK_BYTES_PER_S["h100"]
    # per micro-batch, in bfloat16: a layer's weights gathered for the forward and the backward, its gradient
    # reduce-scattered; the output layer's gathered once (kept for the backward), its gradient reduce-scattered;
    # the embedding's gathered once, its lookup's gradient rows (the micro-batch's residual stream on this
    # device) sent to the devices holding their columns, with the token ids gathered
    tokens = 16 * 512 / 8 / microbatches
    per_microbatch = (layers * (2 * 2 + 2) + table * (2 + 2) + table * 2) * 7 / 8 + tokens * (256 * 2 * 7 / 8 + 4 * 7)
    assert timed.communication_s["fsdp"] == pytest.approx(microbatches * per_microbatch / nvlink)
    # float32 norm-scale gradients, all-reduced per micro-batch
    assert timed.communication_s["data"] == pytest.approx(microbatches * 2 * norms * 4 * 7 / 8 / nvlink)
    assert timed.communication_s["tensor"] == 0  # no tensor axis in use
    tokens_per_device = 16 * 512 / 8
    assert timed.compute_s == pytest.approx(flops_per_token(cfg.model, 512) * step_cost.recompute_factor(cfg) * tokens_per_device
                                            / (H100_BF16 * step_cost.ASSUMED_MFU))
    # weight traffic overlaps the compute: only what exceeds it adds to the step
    hidden = timed.communication_s["fsdp"] + timed.communication_s["data"]
    assert timed.total_s == pytest.approx(max(timed.compute_s, hidden))


def test_hybrid_fsdp_sends_the_lookups_gradient_within_a_replica_and_sums_its_float32_columns_over_data():
    """data 2 x fsdp 4: the lookup's gradient rows go to the columns' devices over fsdp only (models/llama.py), and
    each device's float32 columns of the table's gradient are all-reduced over data, the other weights' in bfloat16."""
    layout = make_layout(medium_config("fsdp", "full", mesh=(2, 4, 1)))
    timed = step_cost.step_time(layout, "h100")
    norms, table = (2 * 4 + 1) * 256, 4096 * 256
    layers = layout.spec.num_params - norms - 2 * table
    tokens = 16 * 512 / 8
    fsdp = (layers * (2 * 2 + 2) + table * (2 + 2) + table * 2) * 3 / 4 + tokens * (256 * 2 * 3 / 4 + 4 * 3)
    # all-reduced: a device's bfloat16 shards of the layers and the output layer and float32 ones of the embedding
    # over data, the norm scales (replicated) over all 8
    data = 2 * ((layers + table) / 4 * 2 + table / 4 * 4) * 1 / 2 + 2 * norms * 4 * 7 / 8
    assert (timed.traffic_bytes["fsdp"], timed.traffic_bytes["data"]) == (pytest.approx(fsdp), pytest.approx(data))


def test_tensor_all_reduces_follow_the_remat_policy_and_sit_on_the_critical_path():
    times = {remat: step_cost.step_time(make_layout(medium_config("fsdp_tp", remat, mesh=(1, 4, 2))), "h100")
             for remat in ("save_dots", "save_qkv_out", "full")}
    tensor = {remat: t.communication_s["tensor"] for remat, t in times.items()}
    nvlink, _ = LINK_BYTES_PER_S["h100"]
    one = 16 * 512 / 4 * 256 * 2 * 2 * 1 / 2 / nvlink  # the device's residual stream (bfloat16) all-reduced over 2
    # 4 all-reduces per layer, plus the recomputed forward ones (remat full: the attention's; save_qkv_out saves
    # its output after the all-reduce), and the vocabulary's 2 (the looked-up rows, the output layer's input gradient)
    assert tensor == {"save_dots": pytest.approx((4 * 4 + 2) * one), "save_qkv_out": pytest.approx((4 * 4 + 2) * one),
                      "full": pytest.approx((4 * 5 + 2) * one)}
    assert all(t.total_s >= t.compute_s + t.communication_s["tensor"] for t in times.values())


@pytest.mark.parametrize("remat, forward_sums", [("save_dots", 1), ("save_qkv_out", 2), ("full", 2)])
def test_lora_adds_its_rank_sized_sums_over_tensor(remat, forward_sums):
    """Per layer: o and down (input split over tensor) all-reduce x @ A in the forward, again where the policy
    recomputes it; q, k, v, gate and up (output split) its gradient in the backward. Compiled byte for byte on the GPU
    (test_plan_gpu); the other adapters' dimensions are unsplit, so no sums."""
    plain = medium_config("fsdp_tp", remat, mesh=(1, 4, 2))
    lora = with_(plain, model={"lora": LoraConfig(rank=4, alpha=8.0), "param_dtype": "bfloat16"})
    tensor = {name: step_cost.step_time(make_layout(cfg), "h100").traffic_bytes["tensor"] for name, cfg in (("plain", plain), ("lora", lora))}
    one = 16 * 512 / 4 * 4 * 2 * 2 * 1 / 2  # the device's tokens x rank (bfloat16) all-reduced over 2
    assert tensor["lora"] - tensor["plain"] == pytest.approx(4 * (2 * forward_sums + 5) * one)


def test_traffic_across_nodes_goes_over_the_network():
    layout = make_layout(medium_config("fsdp", "full", mesh=(1, 8, 1)))
    inside = step_cost.step_time(layout, "h100")
    # the same split, with the fsdp axis spanning 2 nodes of 4
    across_cfg = dataclasses.replace(layout.cfg, mesh=MeshConfig(ici=AxisSizes(1, 4, 1), dcn=AxisSizes(1, 2, 1)))
    across = step_cost.step_time(dataclasses.replace(layout, cfg=across_cfg), "h100")
    nvlink, network = LINK_BYTES_PER_S["h100"]
    assert across.communication_s["fsdp"] == pytest.approx(inside.communication_s["fsdp"] * nvlink / network)
    assert across.compute_s == inside.compute_s


def test_float32_compute_is_timed_against_the_float32_peak():
    cfg = medium_config("fsdp", "full", mesh=(1, 8, 1))
    bf16 = step_cost.step_time(make_layout(cfg), "a100")
    fp32 = step_cost.step_time(make_layout(with_(cfg, model={"dtype": "float32"})), "a100")
    assert fp32.compute_s == pytest.approx(bf16.compute_s * 312 / 156)


def test_pipeline_adds_its_bubble_and_activation_shifts():
    from models.config import PipelineConfig

    # the same 8 devices splitting the batch (under dp a stage axis would be idle, its devices repeating the work)
    plain = step_cost.step_time(make_layout(medium_config("dp", "full", mesh=(8, 1, 1, 1))), "h100")
    piped_cfg = medium_config("pp_dp", "full", mesh=(2, 1, 1, 4))
    piped_cfg = with_(piped_cfg, model={"pipeline": PipelineConfig(microbatches=4, repeats=1)})
    piped = step_cost.step_time(make_layout(piped_cfg), "h100")
    iterations = 4 + 4 - 1
    assert piped.compute_s == pytest.approx(plain.compute_s * iterations / 4)  # bubble 3 / 7
    # 16 sequences over 2 data shards in 4 micro-batches: 2 per shift, forward and backward; once a pass the 8
    # sequences' output and input gradient all-reduced over the 4 stages; bfloat16, NVLink
    nvlink, _ = LINK_BYTES_PER_S["h100"]
    sequences = 2 * iterations * 2 + 2 * 2 * 3 / 4 * 8
    assert piped.communication_s["pipeline"] == pytest.approx(sequences * 512 * 256 * 2 / nvlink)
    assert piped.total_s >= piped.compute_s + piped.communication_s["pipeline"] and "pipeline" not in plain.communication_s


def test_policies_that_save_keep_flash_attention_and_recompute_no_attention_forward():
    """The save_ policies keep cuDNN's fused attention output (models/llama.py): its forward runs once a step; with
    XLA attention, and when offloading, the attention core is recomputed in the backward."""
    factor = {(remat, attention): step_cost.recompute_factor(with_(medium_config("fsdp", remat), model={"attention": attention}))
              for remat in ("save_dots", "save_qkv_out", "offload_dots", "full") for attention in ("cudnn", "xla")}
    assert factor["save_dots", "cudnn"] == 1.0 < factor["save_dots", "xla"]
    assert factor["offload_dots", "cudnn"] == factor["offload_dots", "xla"] == factor["save_dots", "xla"]
    assert factor["save_qkv_out", "xla"] - factor["save_qkv_out", "cudnn"] == pytest.approx(factor["save_dots", "xla"] - 1)
    assert factor["full", "cudnn"] == factor["full", "xla"]  # everything recomputed either way


def test_devices_along_an_idle_axis_repeat_the_work():
    """Under dp a tensor axis of 8 splits nothing: each device runs the whole batch, 8 times a data axis's share. The
    compute was the same for both, which ranked suggestions that leave axes idle as fastest."""
    spread = step_cost.step_time(make_layout(medium_config("dp", "full", mesh=(8, 1, 1))))
    idle = make_layout(medium_config("dp", "full", mesh=(1, 1, 8)))
    assert idle.idle_axes == {"tensor": 8}
    assert step_cost.step_time(idle).compute_s == pytest.approx(8 * spread.compute_s)
