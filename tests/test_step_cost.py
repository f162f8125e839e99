"""The step-time model that ranks the planner's suggestions: compute, and each collective's bytes over the
right link."""

import dataclasses

import pytest
from conftest import small_config, with_
from test_plan import medium_config

from jaxtrain.plan import step_cost
from jaxtrain.config import AxisSizes, MeshConfig
from jaxtrain.observe.flops import flops_per_token
from jaxtrain.plan.gpu_targets import LINK_BYTES_PER_S
from jaxtrain.layout import make_layout
from jaxtrain.models.config import LoraConfig, MoEConfig

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
    assert timed.compute_s == pytest.approx(step_cost.step_flops_per_token(layout) * tokens_per_device
                                            / (H100_BF16 * step_cost.ASSUMED_MFU))
    # weight traffic overlaps the compute: only what exceeds it adds to the step
    hidden = timed.communication_s["fsdp"] + timed.communication_s["data"]
    assert timed.total_s == pytest.approx(max(timed.compute_s, hidden))


def test_hybrid_fsdp_sends_the_lookups_gradient_within_a_replica_and_sums_its_float32_columns_over_data():
    """data 2 x fsdp 4: the lookup's gradient rows go to the columns' devices over fsdp only (jaxtrain/models/llama.py), and
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
    from jaxtrain.models.config import PipelineConfig

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
    """The save_ policies keep cuDNN's fused attention output (jaxtrain/models/llama.py): its forward runs once a step; with
    XLA attention, and when offloading, the attention core is recomputed in the backward."""
    flops = {(remat, attention): step_cost.step_flops_per_token(make_layout(with_(medium_config("fsdp", remat),
                                                                                  model={"attention": attention})))
             for remat in ("save_dots", "save_qkv_out", "offload_dots", "full") for attention in ("cudnn", "xla")}
    palm = flops_per_token(medium_config("fsdp", "none").model, 512)
    assert flops["save_dots", "cudnn"] == palm < flops["save_dots", "xla"]
    assert flops["offload_dots", "cudnn"] == flops["offload_dots", "xla"] == flops["save_dots", "xla"]
    assert flops["save_qkv_out", "xla"] - flops["save_qkv_out", "cudnn"] == pytest.approx(flops["save_dots", "xla"] - palm)
    assert flops["full", "cudnn"] == flops["full", "xla"]  # everything recomputed either way


def test_each_remat_policy_adds_the_forward_flops_it_recomputes():
    """Per token, counted by hand for medium_config (4 layers, d_model 256, 8 heads and 4 kv heads of 32, MLP 1024,
    512 tokens; XLA attention): save_dots recomputes the causal attention core, save_qkv_out also the MLP's three
    matmuls, full every matmul of the layer as well; none recomputes nothing."""
    core = 2 * 4 * 512 * 8 * 32
    mlp = 2 * 4 * 3 * 256 * 1024
    projections = 2 * 4 * 256 * 32 * (2 * 8 + 2 * 4)  # q and the output (8 heads), k and v (4 kv heads)
    palm = flops_per_token(medium_config("fsdp", "none").model, 512)
    recomputed = {remat: step_cost.step_flops_per_token(make_layout(with_(medium_config("fsdp", remat), model={"attention": "xla"})))
                  - palm for remat in ("none", "save_dots", "save_qkv_out", "full")}
    assert recomputed == {"none": 0, "save_dots": core, "save_qkv_out": core + mlp, "full": core + mlp + projections}
    # model.remat_layers: only the first layers recompute (1 of 4), and of the tensor all-reduces only theirs (below)
    one_layer = with_(medium_config("fsdp", "full"), model={"attention": "xla", "remat_layers": 1})
    assert step_cost.step_flops_per_token(make_layout(one_layer)) - palm == (core + mlp + projections) / 4


def test_remat_on_the_first_layers_recomputes_their_tensor_all_reduces_only():
    """fsdp_tp under remat full: 4 all-reduces per layer and a recomputed one (the attention's) per rematerialised
    layer; 2 of 4 layers rematerialised: 2 recomputed ones, not 4."""
    def tensor_s(remat_layers):
        cfg = with_(medium_config("fsdp_tp", "full", mesh=(1, 4, 2)), model={"remat_layers": remat_layers})
        return step_cost.step_time(make_layout(cfg), "h100").communication_s["tensor"]

    nvlink, _ = LINK_BYTES_PER_S["h100"]
    one = 16 * 512 / 4 * 256 * 2 * 2 * 1 / 2 / nvlink  # as in the test above: one all-reduce of the residual stream
    assert tensor_s(2) == pytest.approx((4 * 4 + 2 + 2) * one) and tensor_s(None) == pytest.approx((4 * 5 + 2) * one)


def test_devices_along_an_idle_axis_repeat_the_work():
    """Under dp a tensor axis of 8 splits nothing: each device runs the whole batch, 8 times a data axis's share. The
    compute was the same for both, which ranked suggestions that leave axes idle as fastest."""
    spread = step_cost.step_time(make_layout(medium_config("dp", "full", mesh=(8, 1, 1))))
    idle = make_layout(medium_config("dp", "full", mesh=(1, 1, 8)))
    assert idle.idle_axes == {"tensor": 8}
    assert step_cost.step_time(idle).compute_s == pytest.approx(8 * spread.compute_s)


@pytest.mark.parametrize("rules, table_reductions", [("zero1", 2), ("zero2", 1)])
def test_zero1_and_zero2_reduce_scatter_the_gradients_and_gather_the_updated_weights(rules, table_reductions):
    """data 8: each gradient summed over the replicas by a reduce-scatter (half an all-reduce's bytes): under ZeRO-2 as
    its gradients section says, under ZeRO-1 as the GPU compiler does for the optimizer state's slice, but for the
    embedding lookup's, which it all-reduces with one micro-batch (tests/test_plan_gpu.py); then each updated float32
    weight all-gathered. Gradients in bfloat16, but the norm scales' and the embedding lookup's, in float32."""
    layout = make_layout(medium_config(rules, "full", mesh=(8, 1, 1)))
    norms, table = (2 * 4 + 1) * 256, 4096 * 256
    bfloat16_gradients = layout.spec.num_params - norms - table
    gradients = bfloat16_gradients * 2 + norms * 4 + table_reductions * table * 4
    gathers = layout.spec.num_params * 4
    assert step_cost.step_time(layout, "h100").traffic_bytes["data"] == pytest.approx((gradients + gathers) * 7 / 8)


def test_optimizer_offload_copies_the_state_and_master_weights_both_ways_each_step():
    """optim.offload: Adam's two float32 moments and (bfloat16 compute) the float32 master weights, the device's
    fsdp share of them, come in from the host and go back once per step over PCIe."""
    layout = make_layout(with_(medium_config("fsdp", "full", mesh=(1, 8, 1)), optim={"offload": True}))
    norms = (2 * 4 + 1) * 256  # replicated; every other weight split 8 ways
    weights = ((layout.spec.num_params - norms) / 8 + norms) * 4
    moments = 2 * weights + 8  # mu and nu; Adam's and the schedule's int32 step counts
    timed = step_cost.step_time(layout, "h100")
    assert timed.host_s == pytest.approx(2 * (moments + weights) / step_cost.PCIE_BYTES_PER_S["h100"])


@pytest.mark.parametrize("rules, mesh, remat, per_token", [
    # the device's share of a token per layer in bfloat16: the attention's output projection (256), q, k, v (32 each
    # for 8 heads and 2 x 4 kv heads, split over tensor), the MLP's gate and up (1024 each, split over tensor)
    ("fsdp", (1, 8, 1), "offload_dots", 256 + 32 * (8 + 2 * 4) + 2 * 1024),
    ("fsdp_tp", (1, 4, 2), "offload_dots", 256 + 32 * (4 + 2 * 2) + 2 * 512),
    ("fsdp", (1, 8, 1), "offload_qkv_out", 256 + 32 * (8 + 2 * 4)),
])
def test_activation_offload_pays_its_host_transfers(rules, mesh, remat, per_token):
    """An offload_* policy copies what it names to the host in each layer's forward and back in its backward, per
    micro-batch: that round trip over PCIe is step time, as optim.offload's is (it showed as a free x0.79 speed-up)."""
    from jaxtrain.plan import estimate as plan_lib

    layout = make_layout(medium_config(rules, remat, mesh=mesh, microbatches=2))
    tokens = 16 * 512 / (mesh[0] * mesh[1])  # per device and step: the batch is split over data and fsdp
    expected = 2 * tokens * 4 * per_token * 2 / step_cost.PCIE_BYTES_PER_S["h100"]  # both ways, 4 layers, bfloat16
    timed = step_cost.step_time(layout, "h100")
    assert timed.host_s == pytest.approx(expected)
    assert timed.total_s >= timed.compute_s + timed.host_s and "host transfer" in timed.describe()
    # the memory technique the plan lists says so too
    full = make_layout(medium_config(rules, "full", mesh=mesh, microbatches=2))
    offload = {t.change: t for t in plan_lib.technique_effects(full, "h100")}["model.remat=offload_dots"]
    offloading = dataclasses.replace(full, cfg=with_(full.cfg, model={"remat": "offload_dots"}))
    assert offload.host_s == pytest.approx(step_cost.step_time(offloading, "h100").host_s)
    assert offload.host_s > 0 and "of host transfer at PCIe bandwidth" in offload.describe()


def test_under_pipeline_stages_the_dot_saving_policies_recompute_as_full():
    """Vmapped over the stages every dot has a batch dimension: save_dots keeps none (the memory estimate counted it as
    full, the step time as save_dots, so llama3_405b_pp was told save_dots would take x0.78 of the step)."""
    from jaxtrain.models.config import PipelineConfig

    def timed(remat):
        cfg = with_(medium_config("pp_fsdp_tp", remat, mesh=(1, 2, 2, 2)),
                    model={"pipeline": PipelineConfig(microbatches=2), "attention": "xla"})
        layout = make_layout(cfg)
        return step_cost.step_flops_per_token(layout), step_cost.step_time(layout, "h100")

    (full_flops, full), (dots_flops, dots) = timed("full"), timed("save_dots")
    assert dots_flops == full_flops and dots.total_s == pytest.approx(full.total_s)
    assert dots.traffic_bytes["tensor"] == pytest.approx(full.traffic_bytes["tensor"])  # the attention's all-reduce recomputed too
    assert timed("offload_dots")[1].host_s == 0  # nothing saved, nothing offloaded
    # without stages save_dots keeps the dots
    plain = {remat: step_cost.step_flops_per_token(make_layout(medium_config("fsdp_tp", remat))) for remat in ("full", "save_dots")}
    assert plain["save_dots"] < plain["full"]


def test_a_lora_runs_frozen_base_takes_no_weight_gradients_as_compiled():
    """With a frozen base the backward has no weight-gradient matmuls but the adapters' (2N of the 6N): the compiled
    llama3_8b_lora step ran about 25% fewer matmul FLOPs than step_cost counted. Compared as the drop from the plain
    model's step, which XLA's whole (not causally halved) attention scores do not enter."""
    import jax

    from jaxtrain.layout import lower_train_step
    from jaxtrain.plan import hlo_report

    plain = with_(small_config(rules="fsdp", mesh=(1, 1, 1), vocab_size=256, d_model=256, num_layers=2, num_heads=4, num_kv_heads=4,
                               mlp_dim=1024, remat="full", scan_layers=True, attention="xla"), data={"seq_len": 32})
    lora = with_(plain, model={"lora": LoraConfig(rank=8, alpha=16.0)})
    compiled, predicted = {}, {}
    for name, cfg in (("plain", plain), ("lora", lora)):
        layout = make_layout(cfg, jax.devices()[:1])
        program = lower_train_step(layout).compile().as_text()
        compiled[name] = sum(hlo_report.report(program, dict(layout.mesh.shape), "").matmul_flops.values())
        predicted[name] = step_cost.step_flops_per_token(layout) * cfg.train.global_batch * cfg.data.seq_len
    assert compiled["lora"] < 0.8 * compiled["plain"]
    assert predicted["plain"] - predicted["lora"] == pytest.approx(compiled["plain"] - compiled["lora"], rel=0.02)


@pytest.mark.parametrize("remat", ["none", "save_dots", "full"])
def test_capacity_dispatch_multiplies_its_empty_expert_slots_as_compiled(remat):
    """Capacity dispatch runs each expert's matmuls over its whole buffer, filled or not: at capacity_factor 2 over twice
    the rows of factor 1 (top_k per token). step_cost counts them, the work of the step, where MFU's count takes the
    top_k filled ones; compared as the rise from factor 1, which XLA's whole (not causally halved) scores do not enter.
    Until 2026-12-06 it counted top_k only, and a Mixtral plan's compute read 1.25 x fewer expert FLOPs than it ran."""
    import jax

    from jaxtrain.layout import lower_train_step
    from jaxtrain.plan import hlo_report

    compiled, predicted = {}, {}
    for factor in (1.0, 2.0):
        cfg = with_(small_config(rules="fsdp", mesh=(1, 1, 1), remat=remat, scan_layers=True, attention="xla",
                                 moe=MoEConfig(num_experts=8, top_k=2, dispatch="capacity", capacity_factor=factor)),
                    data={"seq_len": 32})
        layout = make_layout(cfg, jax.devices()[:1])
        program = lower_train_step(layout).compile().as_text()
        compiled[factor] = sum(hlo_report.report(program, dict(layout.mesh.shape), "").matmul_flops.values())
        predicted[factor] = step_cost.step_flops_per_token(layout) * cfg.train.global_batch * cfg.data.seq_len
    assert compiled[2.0] > compiled[1.0]
    assert predicted[2.0] - predicted[1.0] == pytest.approx(compiled[2.0] - compiled[1.0], rel=0.02), (predicted, compiled)


@pytest.mark.parametrize("dispatch,remat,rel", [
    ("capacity", "save_dots", 1e-6), ("capacity", "save_qkv_out", 1e-6), ("capacity", "full", 1e-6),
    # XLA:CPU's dropless program moves 1.5% more than counted, under every policy that recomputes (save_dots, full)
    ("dropless", "offload_dots", 0.02)])
def test_expert_dispatch_moves_what_the_compiled_step_moves(dispatch, remat, rel):
    """Expert-parallel traffic compiled on these CPUs. Capacity dispatch: its all-to-alls, forward and backward, and again
    in the backward's recomputed forward wherever the policy keeps none of the routed rows: save_qkv_out keeps only the
    attention's projections and moves what full remat moves (it was counted as keeping the rows). Dropless: offload_dots
    keeps the gathered tokens as save_dots does (in host memory), gathering only a router array again."""
    from jaxtrain.plan import estimate as plan_lib

    cfg = with_(small_config("dp_ep", (2, 1, 1, 1, 4), remat=remat, scan_layers=True,
                             moe=MoEConfig(num_experts=8, top_k=2, dispatch=dispatch, grouped_matmul="xla")), data={"seq_len": 32})
    plan = plan_lib.make_plan(cfg, hlo_report=True)
    assert plan.compiled_traffic["expert"] == pytest.approx(plan.step_time.traffic_bytes["expert"], rel=rel)


@pytest.mark.parametrize("rules,mesh,remat,model,measure", [
    # the residual stream's and a LoRA adapter's x @ A sums over tensor, again in a recomputed forward
    ("fsdp_tp", (1, 4, 2), "full", {"lora": LoraConfig(rank=4, alpha=8.0)}, lambda t: t.traffic_bytes["tensor"]),
    # the recomputed forward's dispatch: capacity all-to-alls; dropless, the tokens and a router array gathered again
    ("fsdp_ep", (1, 4, 1, 1, 2), "full", {"moe": MoEConfig(num_experts=4, dispatch="capacity")}, lambda t: t.traffic_bytes["expert"]),
    ("fsdp_ep", (1, 4, 1, 1, 2), "full", {"moe": MoEConfig(num_experts=4, dispatch="dropless")}, lambda t: t.traffic_bytes["expert"]),
    # what the policy copies to the host and back (none copies nothing)
    ("fsdp", (1, 8, 1), "offload_dots", {}, lambda t: t.host_s),
], ids=["tensor-lora", "expert-capacity", "expert-dropless", "host"])
def test_remat_on_half_the_layers_costs_half_way_between_no_remat_and_remat_on_all(rules, mesh, remat, model, measure):
    """model.remat_layers=2 of 4: what the policy adds to the step (recomputed collectives, host copies) on those 2 only."""
    cfg = with_(medium_config(rules, remat, mesh=mesh), model=model)

    def cost(remat, remat_layers=None):
        return measure(step_cost.step_time(make_layout(with_(cfg, model={"remat": remat, "remat_layers": remat_layers})), "h100"))

    assert cost(remat) > cost("none")
    assert cost(remat, 2) == pytest.approx((cost(remat) + cost("none")) / 2)


@pytest.mark.parametrize("base_quant,bytes_per_weight", [("int8", 1), ("nf4", 0.5)])
def test_a_quantized_frozen_base_is_gathered_as_stored(base_quant, bytes_per_weight):
    """FSDP 8 gathers a LoRA run's frozen layers, for the forward and again for the recomputed backward, in the compute
    dtype (2 bytes a weight); an int8 or nf4 base as stored: its codes and their bfloat16 scales (one per 32 to 64 weights)."""
    cfg = with_(medium_config("fsdp", "full", mesh=(1, 8, 1)), model={"lora": LoraConfig(rank=4, alpha=8.0)})
    fsdp = {quant: step_cost.step_time(make_layout(with_(cfg, model={"base_quant": quant})), "h100").traffic_bytes["fsdp"]
            for quant in ("none", base_quant)}
    weights = 4 * (256 * 32 * (2 * 8 + 2 * 4) + 3 * 256 * 1024)  # the layers' matrices (their norm scales are not split)
    as_bfloat16 = 2 * weights * 2 * 7 / 8
    as_stored = as_bfloat16 - (fsdp["none"] - fsdp[base_quant])
    assert bytes_per_weight / 2 < as_stored / as_bfloat16 < (bytes_per_weight + 1 / 16) / 2


def test_activation_offload_of_a_mixture_of_experts_moves_its_routed_rows():
    """offload_dots also offloads what save_dots keeps of the experts (jaxtrain/models/moe.py EXPERT_SAVED): each routed row's
    gate and up, and the rows in and out. fsdp 4 x expert 2, dropless, top 2 of 4 experts: per device 1024 tokens a step,
    each with 4 routed rows (its 2 choices among the expert group's 2 x 512 tokens, gathered over expert 2)."""
    cfg = with_(medium_config("fsdp_ep", "offload_dots", mesh=(1, 4, 1, 1, 2)), model={"moe": MoEConfig(num_experts=4, top_k=2)})
    rows = 4
    per_token = 256 + 32 * (8 + 2 * 4) + rows * (2 * 1024 + 2 * 256)  # output projection, q, k, v; the rows' gate, up, in, out
    expected = 2 * 1024 * 4 * per_token * 2 / step_cost.PCIE_BYTES_PER_S["h100"]  # both ways, 4 layers, bfloat16
    assert step_cost.step_time(make_layout(cfg), "h100").host_s == pytest.approx(expected)


def test_expert_weights_gradients_are_summed_over_the_data_axis_only():
    """dp_ep on data 2 x expert 4: every dense weight is whole on each of the 8 devices, its gradient all-reduced over all
    of them (bfloat16, but the norm scales' and the embedding lookup's float32); an expert's weights live on the 2
    devices of its expert shard, its gradient all-reduced over data alone."""
    layout = make_layout(with_(medium_config("dp_ep", "full", mesh=(2, 1, 1, 1, 4)), model={"moe": MoEConfig(num_experts=8, top_k=2)}))
    attention, router, norms, table = 4 * 256 * 32 * (2 * 8 + 2 * 4), 4 * 256 * 8, (2 * 4 + 1) * 256, 4096 * 256
    experts = 4 * 8 * 3 * 256 * 1024 // 4  # the device's 2 of 8, in 4 layers
    dense = 2 * ((attention + router + table) * 2 + (norms + table) * 4) * 7 / 8
    assert step_cost.step_time(layout, "h100").traffic_bytes["data"] == pytest.approx(dense + 2 * experts * 2 * 1 / 2)


@pytest.mark.parametrize("dispatch", ["capacity", "dropless"])
def test_expert_traffic_per_step_does_not_depend_on_the_micro_batch_count(dispatch):
    """Each micro-batch dispatches its own tokens: 2 micro-batches move the step's tokens as 1 pass does."""
    cfg = with_(medium_config("fsdp_ep", "full", mesh=(1, 4, 1, 1, 2)), model={"moe": MoEConfig(num_experts=4, dispatch=dispatch)})
    expert = [step_cost.step_time(make_layout(with_(cfg, train={"microbatches": k})), "h100").traffic_bytes["expert"] for k in (1, 2)]
    assert expert[0] > 0 and expert[1] == pytest.approx(expert[0])


def test_optimizer_offload_under_float32_compute_copies_no_master_weights():
    """Compute in float32: the parameters on the device are the master weights; only Adam's moments go to the host."""
    layout = make_layout(with_(medium_config("fsdp", "full", mesh=(1, 8, 1)), model={"dtype": "float32"}, optim={"offload": True}))
    norms = (2 * 4 + 1) * 256
    moments = 2 * ((layout.spec.num_params - norms) / 8 + norms) * 4 + 8
    assert step_cost.step_time(layout, "h100").host_s == pytest.approx(2 * moments / step_cost.PCIE_BYTES_PER_S["h100"])


def test_a_tied_table_is_gathered_for_the_lookup_and_again_for_the_output_layer():
    """fsdp 8, tied embeddings: per pass the one table is gathered twice (bfloat16) and the output layer's gradient of it
    reduce-scattered; the lookup's gradient rows go to the columns' devices, as without tying."""
    layout = make_layout(with_(medium_config("fsdp", "full", mesh=(1, 8, 1)), model={"tie_embeddings": True}))
    norms, table = (2 * 4 + 1) * 256, 4096 * 256
    layers = layout.spec.num_params - norms - table
    tokens = 16 * 512 / 8
    fsdp = (layers * (2 * 2 + 2) + table * (2 * 2 + 2)) * 7 / 8 + tokens * (256 * 2 * 7 / 8 + 4 * 7)
    assert step_cost.step_time(layout, "h100").traffic_bytes["fsdp"] == pytest.approx(fsdp)


def test_a_chunked_loss_reduce_scatters_the_output_tables_gradient_in_each_chunk():
    """train.loss_chunk=128 of 512 tokens, fsdp 8: the output table is gathered once a pass as without chunks, and its
    gradient reduce-scattered in each of the 4 chunks' backward (bfloat16): three reductions more."""
    cfg = medium_config("fsdp", "full", mesh=(1, 8, 1))
    fsdp = {chunk: step_cost.step_time(make_layout(with_(cfg, train={"loss_chunk": chunk})), "h100").traffic_bytes["fsdp"]
            for chunk in (0, 128)}
    assert fsdp[128] - fsdp[0] == pytest.approx(3 * 4096 * 256 * 2 * 7 / 8)


def test_activation_offload_under_pipeline_stages_moves_a_stages_layers():
    """2 stages of 2 layers, fsdp 2 x tensor 2: a device runs its stage's 2 layers on its 8 sequences a step, offloading
    (offload_qkv_out) each layer's attention output projection and q, k, v (256 + 32 x (4 + 2 x 2) a token, bfloat16)."""
    from jaxtrain.models.config import PipelineConfig

    cfg = with_(medium_config("pp_fsdp_tp", "offload_qkv_out", mesh=(1, 2, 2, 2)), model={"pipeline": PipelineConfig(microbatches=2)})
    expected = 2 * 8 * 512 * 2 * (256 + 32 * (4 + 2 * 2)) * 2 / step_cost.PCIE_BYTES_PER_S["h100"]  # both ways
    assert step_cost.step_time(make_layout(cfg), "h100").host_s == pytest.approx(expected)


def test_durations_read_in_the_unit_that_shows_them():
    assert [step_cost.duration(s) for s in (1234.5, 0.5, 0.05, 5e-5)] == ["1,234.50 s", "0.50 s", "50 ms", "50 µs"]
