"""Where parameters and optimizer state live on the mesh."""

import jax
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

from conftest import small_config, with_
from jaxtrain.layout import lower_train_step, make_layout
from jaxtrain.train import build


def _per_device_bytes(tree) -> dict:
    out = {}
    for leaf in jax.tree.leaves(tree):
        for shard in leaf.addressable_shards:
            out[shard.device] = out.get(shard.device, 0) + shard.data.nbytes
    return out


def test_fsdp_shards_every_weight_matrix(corpus):
    trainer = build(small_config("fsdp", (1, 8, 1), d_model=64, mlp_dim=128), corpus)
    params = trainer.init_state().params
    logical = jax.tree.leaves(trainer.layout.spec.logical_axes, is_leaf=lambda x: isinstance(x, P))
    flat = jax.tree_util.tree_flatten_with_path(params)[0]
    total = sum(p.nbytes for p in jax.tree.leaves(params))
    vectors = 0
    for (path, p), axes in zip(flat, logical, strict=True):
        if len([a for a in axes if a != "layers"]) <= 1:  # norm scales: small, replicated
            vectors += p.nbytes
        else:  # every weight matrix
            assert "fsdp" in p.sharding.spec, f"{jax.tree_util.keystr(path)} {p.sharding.spec}"
    assert vectors < total / 50
    for device, nbytes in _per_device_bytes(params).items():
        assert nbytes <= total / 8 * 1.05 + vectors, (device, nbytes, total)


def test_tp_splits_heads_and_mlp(corpus):
    trainer = build(small_config("tp", (4, 1, 2)), corpus)
    params = trainer.init_state().params
    layers = params["layers"]
    assert layers["attn"]["wq"].sharding.spec == P(None, None, "tensor", None)  # (layers, embed, heads, head_dim)
    assert layers["attn"]["wk"].sharding.spec == P(None, None, "tensor", None)
    assert layers["attn"]["wo"].sharding.spec == P(None, "tensor", None, None)  # row-parallel output
    assert layers["mlp"]["w_up"].sharding.spec == P(None, None, "tensor")
    assert layers["mlp"]["w_down"].sharding.spec == P(None, "tensor", None)
    assert params["lm_head"].sharding.spec == P(None, "tensor")
    shard = layers["attn"]["wq"].addressable_shards[0].data
    assert shard.shape == (2, 32, 2, 8)  # 4 heads split two ways


def test_optimizer_state_follows_its_parameter(corpus):
    trainer = build(small_config("fsdp_tp"), corpus)
    state = trainer.init_state()
    adam = next(s for s in jax.tree.leaves(state.opt_state, is_leaf=lambda s: isinstance(s, optax.ScaleByAdamState))
                if isinstance(s, optax.ScaleByAdamState))
    for moments in (adam.mu, adam.nu):
        jax.tree.map(lambda m, p: np.testing.assert_equal(m.sharding.spec, p.sharding.spec), moments, state.params)
        jax.tree.map(lambda m, p: np.testing.assert_equal(m.sharding.is_equivalent_to(p.sharding, p.ndim), True), moments, state.params)


def test_pipeline_keys_without_pipeline_stages_are_noted_in_the_summary_and_the_plan():
    """model.pipeline set (llama3_405b_pp's repeats) under a rule set or mesh without stages trains unpipelined: a note
    says those keys change nothing (a QA report: they were ignored without a word)."""
    from jaxtrain.layout import unused_pipeline_note
    from jaxtrain.observe.metrics import format_summary, startup_summary
    from jaxtrain.plan import estimate as plan_lib
    from jaxtrain.models.config import PipelineConfig

    set_keys = {"num_layers": 4, "pipeline": PipelineConfig(microbatches=2, repeats=2)}
    note = ("note: model.pipeline.microbatches=2, model.pipeline.repeats=2 set, but rule set fsdp makes no pipeline "
            "stages: the layers run unpipelined and these keys change nothing; use a pp_ rule set on a mesh with a stage "
            "axis, or drop them")
    cfg = small_config("fsdp", **set_keys)
    assert unused_pipeline_note(make_layout(cfg)) == note
    assert unused_pipeline_note(make_layout(small_config("pp_fsdp", (1, 4, 1, 2), **set_keys))) is None  # 2 stages
    assert unused_pipeline_note(make_layout(small_config("fsdp", num_layers=4))) is None  # the defaults
    assert f"\n  {note}" in format_summary(startup_summary(make_layout(cfg), 0.0, None, "test", None, "none"))
    plan = plan_lib.make_plan(cfg)
    assert note in plan_lib.render(plan).splitlines() and plan.to_json()["unused_pipeline_note"] == note


def test_activation_constraints_keep_fsdp_activations_split_like_the_batch():
    """FSDP splits the batch as data parallelism does and shards parameters on top, so its step's temporaries
    (mostly activations) must not exceed the data-parallel step's. Without the model's activation sharding
    constraints XLA splits FSDP activations along the sharded embedding instead, and they grow past it."""
    temp = {}
    for rules in ("dp", "fsdp"):
        layout = make_layout(with_(small_config(rules), log={"layer_every": 0}))
        temp[rules] = lower_train_step(layout).compile().memory_analysis().temp_size_in_bytes
    assert temp["fsdp"] < temp["dp"], temp


def test_mesh_axes_that_split_nothing_are_named_with_the_work_they_repeat():
    from jaxtrain.layout import idle_axes_note

    assert make_layout(small_config("fsdp_tp")).idle_axes == {}
    assert make_layout(small_config("tp", (4, 1, 2))).idle_axes == {}  # fsdp 1: no device idles
    assert make_layout(small_config("dp", (2, 2, 2))).idle_axes == {"tensor": 2}  # dp splits the batch over data x fsdp
    pipelined = (1, 2, 2, 2)  # data, fsdp, tensor, stage
    assert make_layout(small_config("fsdp", pipelined)).idle_axes == {"tensor": 2, "stage": 2}
    assert make_layout(small_config("pp_fsdp_tp", pipelined, num_layers=4)).idle_axes == {}
    assert make_layout(small_config("pp_fsdp", pipelined, num_layers=4)).idle_axes == {"tensor": 2}
    assert make_layout(small_config("dp_ep", (2, 1, 1, 1, 4))).idle_axes == {}  # a dense model's batch: over the expert axis too
    assert idle_axes_note({}, "fsdp") is None
    assert idle_axes_note({"tensor": 2, "stage": 2}, "fsdp") == (
        "note: mesh axes tensor 2, stage 2 split neither the batch nor any parameter under rule set fsdp: the same work runs "
        "4 times over; give those devices to data or fsdp, or use a rule set that maps them")


def test_an_expert_parallel_rule_set_on_a_mesh_without_an_expert_axis_is_noted_in_the_summary_and_the_plan():
    """fsdp_ep with mesh.ici.expert left at 1 trains, every device holding every expert: a note says so (a QA report:
    no word of it before)."""
    from jaxtrain.layout import unsplit_experts_note
    from jaxtrain.observe.metrics import format_summary, startup_summary
    from jaxtrain.plan import estimate as plan_lib
    from jaxtrain.models.config import MoEConfig

    experts = {"mlp_dim": 16, "moe": MoEConfig(num_experts=4, top_k=2)}
    note = ("note: rule set fsdp_ep splits the experts over mesh axis expert, of 1 device here: every device holds all 4 "
            "experts of each layer (no expert parallelism); set mesh.ici.expert to a divisor of 4 above 1, or use a rule set "
            "without _ep")
    cfg = small_config("fsdp_ep", (2, 4, 1, 1, 1), **experts)
    assert unsplit_experts_note(make_layout(cfg)) == note
    assert unsplit_experts_note(make_layout(small_config("fsdp_ep", (2, 2, 1, 1, 2), **experts))) is None  # split in 2
    assert unsplit_experts_note(make_layout(small_config("fsdp_ep", (2, 4, 1, 1, 1)))) is None  # a dense model
    assert unsplit_experts_note(make_layout(small_config("fsdp", (2, 4, 1), **experts))) is None  # a rule set without experts
    assert f"\n  {note}" in format_summary(startup_summary(make_layout(cfg), 0.0, None, "test", None, "none"))
    plan = plan_lib.make_plan(cfg)
    assert note in plan_lib.render(plan).splitlines() and plan.to_json()["unsplit_experts_note"] == note


def test_the_mesh_holds_the_devices_in_order_with_its_last_axes_the_nearest():
    """Axes (data, fsdp, tensor, stage, expert), the last varying fastest: on GPUs tensor parallelism's every-layer
    sums stay among neighbouring devices (one node) and data parallelism spans the farthest. One process multiplies
    each axis's ici and dcn sizes."""
    from jaxtrain.config import MESH_AXES, AxisSizes, MeshConfig
    from jaxtrain.mesh import build_mesh

    mesh = build_mesh(MeshConfig(ici=AxisSizes(1, 2, 2), dcn=AxisSizes(data=2)))
    assert mesh.axis_names == MESH_AXES and dict(mesh.shape) == {"data": 2, "fsdp": 2, "tensor": 2, "stage": 1, "expert": 1}
    ids = np.vectorize(lambda device: device.id)(mesh.devices)
    np.testing.assert_array_equal(ids, np.arange(8).reshape(2, 2, 2, 1, 1))


def test_a_mesh_of_more_cpu_devices_than_xla_cpu_compiles_for_is_one_line():
    """XLA:CPU compiles a program for at most 2048 devices: a plan of a 4096-GPU mesh file on a CPU simulated them all
    (minutes and gigabytes past a few thousand) and stopped at its compile with a traceback ("Multiprocess computations
    aren't implemented on the CPU backend"). --devices past it is refused as the command line is read (test_cli_errors)."""
    from jaxtrain.config import CPU_MAX_DEVICES, AxisSizes, MeshConfig
    from jaxtrain.errors import UserError
    from jaxtrain.mesh import build_mesh

    many = jax.devices()[:1] * (CPU_MAX_DEVICES + 1)  # refused before any is placed: one device stands for them all
    with pytest.raises(UserError, match=r"^a mesh of 2049 CPU devices: XLA:CPU compiles programs for at most 2048 devices; use a "
                                        r"mesh of at most 2048 \(fewer nodes across: a smaller mesh.dcn axis\)$"):
        build_mesh(MeshConfig(ici=AxisSizes(1, 1, 1), dcn=AxisSizes(fsdp=CPU_MAX_DEVICES + 1)), many)
