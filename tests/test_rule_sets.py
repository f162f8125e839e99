"""Each shipped rule set places parameters, optimizer moments, gradients and the batch as README's "Sharding rule sets
and meshes" table says, and the mesh arranges hosts' devices as the mesh files intend. The expected placements are the
README's, written out here, not read from jaxtrain/sharding_rules/: a rule file's mistake shows as a difference."""

import jax
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

from conftest import small_config
from jaxtrain.config import AxisSizes, MeshConfig
from jaxtrain.errors import UserError
from jaxtrain.layout import make_layout
from jaxtrain.mesh import device_array, resolve_shape
from jaxtrain.partitioning import load_rules, load_state_rules, nested_under
from jaxtrain.models.config import MoEConfig

BATCH = ("data", "fsdp")

# The small dense model's parameters and their logical axes (jaxtrain/models/llama.py)
DENSE = {
    "embed": ("vocab", "embed"),
    "final_norm/scale": ("norm",),
    "layers/attn/wq": ("layers", "embed", "heads", "head_dim"),
    "layers/attn/wk": ("layers", "embed", "kv_heads", "head_dim"),
    "layers/attn/wv": ("layers", "embed", "kv_heads", "head_dim"),
    "layers/attn/wo": ("layers", "heads", "head_dim", "embed"),
    "layers/attn_norm/scale": ("layers", "norm"),
    "layers/mlp/w_gate": ("layers", "embed", "mlp"),
    "layers/mlp/w_up": ("layers", "embed", "mlp"),
    "layers/mlp/w_down": ("layers", "mlp", "embed"),
    "layers/mlp_norm/scale": ("layers", "norm"),
    "lm_head": ("embed", "vocab"),
}
MOE_MLP = {
    "layers/mlp/router": ("layers", "embed", None),
    "layers/mlp/w_gate": ("layers", "experts", "embed", "mlp"),
    "layers/mlp/w_up": ("layers", "experts", "embed", "mlp"),
    "layers/mlp/w_down": ("layers", "experts", "mlp", "embed"),
}

# README's table: the logical axes each rule set splits, and over which mesh axes; every other axis is whole
FSDP = {"embed": "fsdp"}
TP = {"heads": "tensor", "kv_heads": "tensor", "mlp": "tensor", "vocab": "tensor"}
EXPERTS = {"experts": "expert"}
ZERO = {"embed": BATCH, "norm": BATCH}  # zero1.yaml / zero2.yaml's sections: the weight's embed dimension, norm scales
PIPELINE = {"layers": "stage"}
MESH = (2, 2, 2)  # data, fsdp, tensor: every axis of more than one device, so a rule over any of them shows
MOE_MESH = (2, 1, 2, 1, 2)  # data, fsdp, tensor, stage, expert
PP_MESH = (1, 2, 2, 2)  # data, fsdp, tensor, stage
# rule set: (mesh, params, optimizer moments, gradients, batch axes)
README = {
    "dp": (MESH, {}, {}, {}, BATCH),
    "fsdp": (MESH, FSDP, FSDP, FSDP, BATCH),
    "tp": (MESH, TP, TP, TP, BATCH),
    "fsdp_tp": (MESH, FSDP | TP, FSDP | TP, FSDP | TP, BATCH),
    "zero1": (MESH, {}, ZERO, {}, BATCH),
    "zero2": (MESH, {}, ZERO, ZERO, BATCH),
    "dp_ep": (MOE_MESH, EXPERTS, EXPERTS, EXPERTS, BATCH + ("expert",)),
    "fsdp_ep": (MOE_MESH, FSDP | EXPERTS, FSDP | EXPERTS, FSDP | EXPERTS, BATCH + ("expert",)),
    "fsdp_tp_ep": (MOE_MESH, FSDP | TP | EXPERTS, FSDP | TP | EXPERTS, FSDP | TP | EXPERTS, BATCH + ("expert",)),
    "pp_dp": (PP_MESH, PIPELINE, PIPELINE, PIPELINE, BATCH),
    "pp_fsdp": (PP_MESH, FSDP | PIPELINE, FSDP | PIPELINE, FSDP | PIPELINE, BATCH),
    "pp_fsdp_tp": (PP_MESH, FSDP | TP | PIPELINE, FSDP | TP | PIPELINE, FSDP | TP | PIPELINE, BATCH),
}


def _expected(logical: dict, split: dict) -> dict:
    return {name: P(*(split.get(axis) for axis in axes)) for name, axes in logical.items()}


def _specs(shardings: dict) -> dict:
    flat = jax.tree_util.tree_flatten_with_path(shardings)[0]
    return {jax.tree_util.keystr(path, simple=True, separator="/"): sharding.spec for path, sharding in flat}


def _specs_logical(logical_axes) -> dict:
    flat = jax.tree_util.tree_flatten_with_path(logical_axes, is_leaf=lambda x: isinstance(x, P))[0]
    return {jax.tree_util.keystr(path, simple=True, separator="/"): axes for path, axes in flat}


def _adam_moments(opt_state) -> list:
    return [leaf for leaf in jax.tree.leaves(opt_state, is_leaf=lambda s: isinstance(s, optax.ScaleByAdamState))
            if isinstance(leaf, optax.ScaleByAdamState)]


@pytest.mark.parametrize("rules", README)
def test_each_rule_set_places_parameters_moments_gradients_and_batch_as_the_readme_says(rules):
    mesh, params, moments, grads, batch = README[rules]
    moe = rules.endswith("_ep")
    model = {"mlp_dim": 16, "moe": MoEConfig(num_experts=4, top_k=2)} if moe else {"num_layers": 4}
    layout = make_layout(small_config(rules, mesh, **model))
    logical = DENSE | MOE_MLP if moe else DENSE
    assert {name: tuple(axes) for name, axes in _specs_logical(layout.spec.logical_axes).items()} == logical
    assert _specs(layout.shardings.params) == _expected(logical, params)
    [adam] = _adam_moments(layout.shardings.opt_state)
    assert _specs(adam.mu) == _specs(adam.nu) == _expected(logical, moments)
    assert _specs(layout.gradient_shardings()) == _expected(logical, grads)
    assert layout.batch_sharding.spec == P(batch, None)


def test_a_few_placements_written_out():
    """The table above, spelt out for the weights README names: FSDP's embed dimension, Megatron's column-parallel
    query and row-parallel output, ZeRO's moments split on embed while the weight stays whole."""
    fsdp_tp = _specs(make_layout(small_config("fsdp_tp", MESH)).shardings.params)
    assert fsdp_tp["layers/attn/wq"] == P(None, "fsdp", "tensor", None)
    assert fsdp_tp["layers/attn/wo"] == P(None, "tensor", None, "fsdp")
    assert fsdp_tp["embed"] == P("tensor", "fsdp") and fsdp_tp["lm_head"] == P("fsdp", "tensor")
    zero2 = make_layout(small_config("zero2", MESH))
    assert _specs(zero2.shardings.params)["layers/mlp/w_up"] == P(None, None, None)
    assert _specs(zero2.grad_shardings)["layers/mlp/w_up"] == P(None, ("data", "fsdp"), None)
    assert _specs(_adam_moments(zero2.shardings.opt_state)[0].mu)["layers/mlp/w_up"] == P(None, ("data", "fsdp"), None)


class _Device:
    """What mesh_utils reads of a GPU: a process's devices are its host's."""

    def __init__(self, device_id: int, process_index: int):
        self.id, self.process_index = device_id, process_index
        self.platform, self.device_kind = "gpu", "NVIDIA H100 80GB HBM3"

    def __repr__(self):
        return f"gpu{self.id}@process{self.process_index}"


def _hosts(processes: int, per_process: int) -> list[_Device]:
    """Listed round-robin over the hosts, so that an arrangement that reshaped the list in order would mix hosts."""
    return [_Device(i, i % processes) for i in range(processes * per_process)]


def test_with_several_processes_data_crosses_hosts_and_tensor_stays_inside_one():
    """cpu2x4 as two real hosts: ici data 1 x fsdp 2 x tensor 2, dcn data 2. Each data index is one host, whose four
    devices hold the fsdp x tensor block in their order."""
    arranged = device_array(MeshConfig(ici=AxisSizes(1, 2, 2), dcn=AxisSizes(data=2)), _hosts(2, 4), num_processes=2)
    assert arranged.shape == (2, 2, 2, 1, 1)
    np.testing.assert_array_equal(np.vectorize(lambda d: d.process_index)(arranged).squeeze(), [[[0, 0], [0, 0]], [[1, 1], [1, 1]]])
    np.testing.assert_array_equal(np.vectorize(lambda d: d.id)(arranged).ravel(), [0, 2, 4, 6, 1, 3, 5, 7])


def test_an_axis_split_both_across_and_inside_hosts_takes_hosts_outermost():
    """h100x64's shape scaled down: ici fsdp 2 x tensor 2 per host, dcn data 2 x fsdp 2 over four hosts. fsdp of 4 is
    2 hosts (outer) x 2 devices (inner); a tensor pair never leaves its host."""
    arranged = device_array(MeshConfig(ici=AxisSizes(1, 2, 2), dcn=AxisSizes(data=2, fsdp=2)), _hosts(4, 4), num_processes=4)
    hosts = np.vectorize(lambda d: d.process_index)(arranged).squeeze()  # (data 2, fsdp 4, tensor 2)
    assert hosts.shape == (2, 4, 2)
    np.testing.assert_array_equal(hosts[:, :, 0], hosts[:, :, 1])  # tensor inside a host
    np.testing.assert_array_equal(hosts[:, :, 0], [[0, 0, 1, 1], [2, 2, 3, 3]])


@pytest.mark.parametrize("ici, dcn, message", [
    ((1, 2, 4), (2, 1, 1), "there are 2 processes with 4 devices each"),  # ici of 8 on a host of 4
    ((1, 2, 2), (4, 1, 1), "there are 2 processes with 4 devices each"),  # dcn of 4 over 2 hosts
    ((1, -1, 3), (2, 1, 1), "cannot fill the -1 axis of ici: 4 is not divisible by 3"),
])
def test_a_multi_process_mesh_that_does_not_cover_the_hosts_is_refused(ici, dcn, message):
    with pytest.raises(UserError, match=message):
        resolve_shape(MeshConfig(ici=AxisSizes(*ici), dcn=AxisSizes(*dcn)), num_devices=8, num_processes=2)


def test_one_process_multiplies_ici_and_dcn_and_refuses_another_device_count():
    mesh = MeshConfig(ici=AxisSizes(1, 2, 2), dcn=AxisSizes(data=2))
    assert resolve_shape(mesh, num_devices=8, num_processes=1) == ((2, 2, 2, 1, 1), (1, 1, 1, 1, 1))
    with pytest.raises(UserError, match=r"the mesh has 8 devices \(data 2 x fsdp 2 x tensor 2\) but 4 device\(s\) are present"):
        resolve_shape(mesh, num_devices=4, num_processes=1)


@pytest.mark.parametrize("rules", README)
def test_tensor_and_expert_parallel_activations_are_split_as_their_weights(rules):
    """Megatron's column-parallel layers leave their outputs split over tensor as the weights (heads, MLP hidden,
    vocabulary logits), and expert parallelism keeps a dispatched expert's tokens on its experts' devices; the model
    constrains its activations by these rules, so one left whole gathers them every layer with nothing numeric to see.
    The embed, head_dim and length dimensions of the activations are never split (FSDP gathers the weight instead)."""
    loaded = load_rules(rules)
    for weight_axis, activation_axis in [("heads", "activation_heads"), ("kv_heads", "activation_kv_heads"),
                                         ("mlp", "activation_mlp"), ("vocab", "activation_vocab"), ("experts", "activation_expert")]:
        assert loaded[activation_axis] == loaded[weight_axis], (activation_axis, weight_axis)
    assert loaded["activation_embed"] is loaded["activation_head_dim"] is loaded["activation_length"] is None
    # dispatched tokens: split by expert over the expert axes, by sequence over the batch's other axes
    experts = loaded["experts"] or ()
    assert loaded["activation_batch_no_expert"] == tuple(a for a in loaded["activation_batch"] if a not in experts)


def test_rule_files_that_extend_each_other_are_refused(tmp_path):
    """Without the check the two files load each other until Python's recursion limit: a traceback, not a line."""
    first, second = tmp_path / "first.yaml", tmp_path / "second.yaml"
    first.write_text(f"extends: {second}\n")
    second.write_text(f"extends: {first}\n")
    with pytest.raises(UserError, match=f"rule set {second}: 'extends' must name another rule set without a cycle, got '{first}'"):
        load_rules(str(first))


def test_a_relative_extends_is_read_beside_the_rule_file_not_in_the_working_directory(tmp_path, monkeypatch):
    """A user's rule file extending their own base beside it (``extends: base.yaml``) was looked up in the working
    directory: 'not found' unless run from the rules' directory, and a resume, ``generate`` or cluster job started
    elsewhere read another directory's base.yaml, or none (config.yaml records the rule file by absolute path)."""
    (tmp_path / "rules").mkdir()
    (tmp_path / "rules" / "base.yaml").write_text("extends: fsdp_tp\noptimizer_state:\n  embed: [data, fsdp]\n")
    (tmp_path / "rules" / "mine.yaml").write_text("extends: base.yaml\nmlp: null\n")
    (tmp_path / "rules" / "loop.yaml").write_text("extends: ../rules/loop.yaml\n")
    (tmp_path / "base.yaml").write_text("extends: dp\n")  # another base.yaml where the job is started
    monkeypatch.chdir(tmp_path)
    assert load_rules("rules/mine.yaml") == load_rules("fsdp_tp") | {"mlp": None}
    assert load_state_rules("rules/mine.yaml")["optimizer_state"]["embed"] == ("fsdp", "data")  # the weights' fsdp first
    with pytest.raises(UserError, match="rule set rules/loop.yaml: 'extends' must name another rule set without a cycle, "
                                        "got '../rules/loop.yaml'"):
        load_rules("rules/loop.yaml")


def test_a_sections_mesh_axes_are_nested_under_the_parameters():
    """The state's slice of a weight within the device's own shard of it (the compiled step: tests/test_hlo_report.py):
    the parameters' axes first, in their order; a section over other axes, or none, as written."""
    assert nested_under(("fsdp",), ("data", "fsdp")) == ("fsdp", "data")
    assert nested_under(("fsdp", "expert"), ("data", "expert", "fsdp")) == ("fsdp", "expert", "data")
    assert nested_under(("data", "fsdp"), ("fsdp", "data")) == ("data", "fsdp")  # the parameters' layout itself
    assert nested_under(("fsdp",), ("data",)) == ("data",)
    assert nested_under(None, ("data", "fsdp")) == ("data", "fsdp") and nested_under(("fsdp",), None) is None


def test_a_section_overriding_a_logical_axis_its_rule_set_does_not_map_is_refused(tmp_path):
    """README: a section naming a logical axis the rule set does not map is one line. dp maps no ``layer_stages`` (only
    the pp_ sets do), so ZeRO moments split over it would be a rule for nothing."""
    rules = tmp_path / "zero_stages.yaml"
    rules.write_text("extends: dp\noptimizer_state:\n  layer_stages: data\n")
    with pytest.raises(UserError, match=r"'optimizer_state' overrides layer_stages, which the rule set does not map"):
        load_state_rules(str(rules))
