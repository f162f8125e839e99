"""LoRA / QLoRA: adapters on the frozen base (zero adapters give the base's logits exactly, merged equals unmerged),
training updates only the adapters and leaves the base bit-identical, checkpoints hold no base and resume exactly,
QLoRA trains, and bad input is one line, exit 2. jax alone: PEFT interop, against peft on torch, is test_peft.py."""

import dataclasses
import functools
import json
import shutil
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from flax.core import spmd
from safetensors.numpy import load_file

from conftest import small_config, with_
from test_parity import _losses
from jaxtrain import cli
from jaxtrain.adapt import lora as lora_lib
from jaxtrain.config import AxisSizes
from jaxtrain.errors import UserError
from jaxtrain.layout import make_layout
from jaxtrain.observe.metrics import format_summary
from jaxtrain.partitioning import flax_rules
from jaxtrain.train import build, train
from jaxtrain.models.config import LORA_TARGETS, LoraConfig, MoEConfig
from jaxtrain.models.llama import Llama

TOKENS = np.random.default_rng(0).integers(0, 64, (2, 16))


def lora_config(rank=4, base_quant="none", mesh=(2, 2, 2), alpha=8.0, **model):
    cfg = small_config(mesh=mesh, **model)
    return with_(cfg, model={"lora": LoraConfig(rank=rank, alpha=alpha), "base_quant": base_quant},
                 train={"steps": 4}, optim={"lr": 0.1}, checkpoint={"every": 2, "async_save": False})


@functools.cache
def _forward(graphdef):
    return jax.jit(lambda p, t: nnx.merge(graphdef, p)(t))


def _logits(layout, params) -> np.ndarray:
    forward = _forward(layout.spec.graphdef)
    with jax.set_mesh(layout.mesh), spmd.logical_axis_rules(flax_rules(layout.rules)):
        return np.asarray(forward(params, TOKENS))


def _randomise_adapters(params: dict) -> dict:
    """Non-zero B matrices, so the adapters change the output."""
    leaves, tree = jax.tree_util.tree_flatten_with_path(params)
    keys = jax.random.split(jax.random.key(1), len(leaves))
    return jax.tree_util.tree_unflatten(tree, [0.05 * jax.random.normal(k, x.shape, x.dtype) if "lora_" in jax.tree_util.keystr(p) else x
                                               for (p, x), k in zip(leaves, keys)])


@pytest.mark.parametrize("base_quant", ["none", "nf4"])
def test_zero_adapters_give_the_base_logits_exactly_and_merged_equals_unmerged(base_quant):
    cfg = lora_config(base_quant=base_quant, mesh=(1, 1, 1))
    layout = make_layout(cfg, jax.devices()[:1])
    with warnings.catch_warnings(record=True) as caught:  # no buffer donated in vain: the quantized weights' are kept
        warnings.simplefilter("always")
        base = lora_lib.load_base(layout, None)
        state = base.start_state(layout)
    assert not [w for w in caught if "donated buffers" in str(w.message)]
    plain_layout = make_layout(dataclasses.replace(cfg, model=lora_lib.plain_config(cfg.model)), jax.devices()[:1])
    params = state.model_params
    base_params = lora_lib.merged(params, cfg.model)  # B = 0: the base as the model computes with it (dequantized)
    assert np.array_equal(_logits(layout, params), _logits(plain_layout, base_params))
    adapted = _randomise_adapters(params)
    unmerged = _logits(layout, adapted)
    assert np.max(np.abs(unmerged - _logits(plain_layout, base_params))) > 1e-3  # the adapters do change the output
    np.testing.assert_allclose(_logits(plain_layout, lora_lib.merged(adapted, cfg.model)), unmerged, atol=1e-5)


def test_fresh_adapters_draw_a_as_peft_does_and_b_zero():
    """A uniform within 1 / sqrt(fan in) (PEFT's kaiming_uniform(a=sqrt(5)) on lora_A; o's fan in is heads x head_dim),
    B zero; 256 to 512 draws per A, so the largest lies within 5% of the bound."""
    cfg = lora_config(mesh=(1, 1, 1))
    layers = nnx.to_pure_dict(nnx.state(Llama(cfg.model, rngs=nnx.Rngs(0))))["layers"]
    for module, target, fan_in in (("attn", "q", 32), ("attn", "o", 4 * 8), ("mlp", "down", 64)):
        adapter = layers[module][f"lora_{target}"]
        assert 0.95 < np.max(np.abs(adapter["a"])) * fan_in**0.5 <= 1, target
        assert not np.any(adapter["b"]), target


@pytest.mark.parametrize("experts", [0, 4])
def test_adapters_are_float32_master_weights_on_a_bfloat16_base(experts):
    """As PEFT keeps them (autocast_adapter_dtype): in bfloat16 (the LoRA experiments' model.param_dtype) an update below
    2^-9 of its weight rounded away, so B, growing from zero by about the learning rate a step, stopped learning. The
    base stays in model.param_dtype; the optimizer's moments follow the adapters (float32)."""
    moe = {"mlp_dim": 16, "moe": MoEConfig(num_experts=experts, top_k=2)} if experts else {}
    cfg = lora_config(mesh=(1, 1, 1), param_dtype="bfloat16", **moe)
    state = make_layout(cfg, jax.devices()[:1]).abstract_state()
    adapters = {jax.tree_util.keystr(path): x.dtype for path, x in jax.tree_util.tree_leaves_with_path(state.params)}
    assert any("lora_down" in path or "lora_experts" in path for path in adapters)
    assert set(adapters.values()) == {np.dtype(np.float32)}, adapters
    assert {x.dtype for x in jax.tree.leaves(state.frozen)} == {jnp.dtype(jnp.bfloat16)}


def test_the_base_hash_sees_each_value_where_it_is():
    """The hash that refuses a LoRA run's adapters on another base weighs each value by its position: a plain sum of the
    values' bits would take a base with a square weight transposed, or two values swapped, for the one they trained on."""
    w = np.arange(16, dtype=np.float32).reshape(4, 4)
    swapped = w.copy()
    swapped[0, 1], swapped[1, 0] = w[1, 0], w[0, 1]
    hashes = [lora_lib.content_hash({"w": jax.numpy.asarray(x)}) for x in (w, w.T, swapped, w + np.eye(4, dtype=np.float32))]
    assert len(set(hashes)) == 4, hashes
    assert lora_lib.content_hash({"w": jax.numpy.asarray(w.copy())}) == hashes[0]


# bitsandbytes' NF4 code (functional.py get_4bit_type("nf4"), the QLoRA paper's), written out, not read from jaxtrain/models/quant.py
BITSANDBYTES_NF4 = (-1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453, -0.28444138169288635,
                    -0.18477343022823334, -0.09105003625154495, 0.0, 0.07958029955625534, 0.16093020141124725,
                    0.24611230194568634, 0.33791524171829224, 0.44070982933044434, 0.5626170039176941,
                    0.7229568362236023, 1.0)


def _bitsandbytes_dequantized(w: np.ndarray, inputs: int, kind: str) -> np.ndarray:
    """bitsandbytes' blockwise quantization by hand: the weight as torch holds it (outputs, inputs) flattened, one
    absmax per 64 consecutive entries (stored as our bfloat16 scale), each entry the nearest code times it."""
    torch_layout = w.reshape(int(np.prod(w.shape[:inputs])), -1).T
    blocks = torch_layout.reshape(-1, 64).astype(np.float32)
    absmax = np.max(np.abs(blocks), axis=1, keepdims=True).astype(jax.numpy.bfloat16).astype(np.float32)
    normed = blocks / absmax
    if kind == "int8":
        values = np.round(normed * 127) / 127
    else:
        levels = np.asarray(BITSANDBYTES_NF4, np.float32)
        values = levels[np.argmin(np.abs(normed[..., None] - levels), axis=-1)]
    return (values * absmax).reshape(torch_layout.shape).T.reshape(w.shape)


@pytest.mark.parametrize("base_quant", ["int8", "nf4"])
def test_the_quantized_base_is_bitsandbytes_blockwise_quantization(base_quant):
    """Every projection, o included (inputs heads x head_dim: blocks along head_dim, not across the heads), dequantizes to
    bitsandbytes' blocks of 64 inputs, and stores one bfloat16 scale per 64 entries (before 2026-12-05 o's blocks ran
    along the heads: with 2 heads one scale per 2 entries, the scales twice the nf4 codes' bytes)."""
    cfg = lora_config(base_quant=base_quant, mesh=(1, 1, 1), d_model=128, num_heads=2, num_kv_heads=2, mlp_dim=128, num_layers=1)
    layout = make_layout(cfg, jax.devices()[:1])
    plain, _ = lora_lib.load_plain(layout, None)
    frozen = lora_lib.load_base(layout, None).frozen
    dequantized = lora_lib.merged(frozen, cfg.model)  # no adapters: the base as the layers compute with it
    for module, weight, inputs in LORA_TARGETS.values():
        stored = frozen["layers"][module][weight]
        assert stored["scale"].dtype == jax.numpy.bfloat16 and stored["scale"].size * 64 == plain["layers"][module][weight].size
        expected = _bitsandbytes_dequantized(np.asarray(plain["layers"][module][weight][0]), inputs, base_quant)
        # the same codes and scales: float32 rounding apart (XLA multiplies by 1 / 127)
        np.testing.assert_allclose(np.asarray(dequantized["layers"][module][weight][0]), expected, rtol=1e-6, atol=0,
                                   err_msg=f"{module}.{weight}")


@pytest.mark.parametrize("base_quant", ["none", "nf4"])
def test_adapters_train_as_on_one_device_where_the_layers_gather_the_base(base_quant, corpus, tmp_path):
    """Under a remat policy the layers gather the FSDP-split base themselves (nf4: its codes), and the adapters' B
    with its own backward (jaxtrain/models/sharding.py ``gathered``): fsdp x tensor trains the adapters as one device does."""
    cfg = lora_config(base_quant=base_quant, init_std=0.3, remat="full")
    reference = _losses(with_(cfg, mesh={"ici": AxisSizes(1, 1, 1)}), corpus, tmp_path, jax.devices()[:1])
    assert reference[-1] < reference[0] - 0.1, reference
    np.testing.assert_allclose(_losses(cfg, corpus, tmp_path), reference, rtol=1e-5)


def _tree_equal(a, b) -> bool:
    return jax.tree.structure(a) == jax.tree.structure(b) and all(
        np.array_equal(np.asarray(x), np.asarray(y)) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


def test_qlora_trains_only_the_adapters_and_resumes_exactly(corpus, tmp_path, capsys):
    cfg = lora_config(base_quant="nf4", init_std=0.3)  # a base whose output the adapters can move (0.02 gives near-zero logits)
    trainer = build(cfg, corpus)
    base = lora_lib.load_base(trainer.layout, None)
    expected_frozen = jax.tree.map(np.asarray, base.frozen)
    straight = train(cfg, tmp_path / "straight", trainer)
    assert "jaxtrain: note: no --init-from, so the LoRA adapters train on a base initialised from train.seed=0, not on a " \
        "trained model" in capsys.readouterr().err
    assert _tree_equal(jax.tree.map(np.asarray, straight.frozen), expected_frozen)  # the base, bit for bit
    assert set(jax.tree.leaves(jax.tree_util.tree_map_with_path(lambda p, _: jax.tree_util.keystr(p).split("'")[-2], straight.params)))  \
        == {"a", "b"}  # only adapters are trained and have optimizer state
    assert not _tree_equal(straight.params, base.start_state(trainer.layout).params)
    losses = [r["loss"] for r in map(json.loads, (tmp_path / "straight" / "metrics.jsonl").read_text().splitlines()) if "loss" in r]
    assert len(losses) == 4 and losses[-1] < losses[0] - 0.1, losses  # QLoRA learns: adapters on a 4-bit base
    # the checkpoint holds the adapters, their optimizer state and the data position; no base weight
    saved = {p.name for p in (tmp_path / "straight" / "checkpoints" / "4" / "state").rglob("*")}
    assert not any("wq" in name or "embed" in name for name in saved), saved
    record = json.loads((tmp_path / "straight" / lora_lib.BASE_RECORD).read_text())
    assert record["hash"] == base.record["hash"] and record["path"] is None and record["rank"] == 4
    # the start-up summary counts the adapters as what trains and the 4-bit base's bytes apart
    summary = json.loads((tmp_path / "straight" / "summary.json").read_text())
    adapters = sum(x.size for x in jax.tree.leaves(straight.params))
    assert summary["trained_params"] == adapters < summary["params"]
    plain = make_layout(dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, base_quant="none")))
    assert summary["params"] == plain.spec.num_params  # the model's parameters, not the packed 4-bit codes and scales
    assert summary["frozen_bytes_per_device"] == sum(x.addressable_shards[0].data.nbytes for x in jax.tree.leaves(straight.frozen))
    assert f"of which {adapters:,} train (the LoRA adapters on q, k, v, o, gate, up, down, " in format_summary(summary)
    assert summary["lora_targets"] == ["q", "k", "v", "o", "gate", "up", "down"]  # what model.lora.targets matched

    # resume from the checkpoint of step 2 (its base reloaded and checked): the same adapters and optimizer state, bit for bit
    resumed_dir = tmp_path / "resumed"
    shutil.copytree(tmp_path / "straight", resumed_dir)
    shutil.rmtree(resumed_dir / "checkpoints" / "4")
    resumed = train(cfg, resumed_dir, trainer)
    assert int(resumed.step) == 4
    assert _tree_equal(resumed.params, straight.params) and _tree_equal(resumed.opt_state, straight.opt_state)


def test_a_base_run_that_trains_on_still_gives_the_adapters_their_base(corpus, tmp_path, capsys):
    """--init-from another run: the record names the checkpoint read, not the run, whose newer checkpoints are other
    weights (named the run, the adapters' own resume, also by the same command, and export refused them once the base
    run trained on); a base moved away is one line saying so."""
    cfg = with_(lora_config(mesh=(1, 1, 1)), train={"steps": 2})
    plain = dataclasses.replace(cfg, model=lora_lib.plain_config(cfg.model))
    devices = jax.devices()[:1]
    train(plain, tmp_path / "base", build(plain, corpus, devices))
    train(cfg, tmp_path / "lora", build(cfg, corpus, devices), init_from=tmp_path / "base")
    record = json.loads((tmp_path / "lora" / lora_lib.BASE_RECORD).read_text())
    assert record["path"] == str((tmp_path / "base" / "checkpoints" / "2").absolute())
    train(with_(plain, train={"steps": 4}), tmp_path / "base", build(with_(plain, train={"steps": 4}), corpus, devices))
    longer = with_(cfg, train={"steps": 4})  # the same command, resumed: --init-from the base run, which has trained on
    longer_trainer = build(longer, corpus, devices)
    assert int(train(longer, tmp_path / "lora", longer_trainer, init_from=tmp_path / "base").step) == 4
    _, base, _ = lora_lib.run_model_params(make_layout(cfg, devices), tmp_path / "lora")  # export-hf's and generate's path
    assert base.record["hash"] == record["hash"]
    # resumed in another dtype: its base would hash otherwise; said so (it was "the LoRA base ... is not the base ...")
    in_bfloat16 = with_(longer, train={"steps": 6}, model={"param_dtype": "bfloat16"})
    with pytest.raises(UserError, match=r"^model.param_dtype=bfloat16, but run .*/lora trained its adapters on the base in float32 "
                                        r"\(.*lora_base.json\); give model.param_dtype=float32 to resume it, or a new --run-dir$"):
        train(in_bfloat16, tmp_path / "lora", init_from=tmp_path / "base")
    # a base moved away: said so, with what to do (it was "no checkpoints there; give a run directory, ...")
    (tmp_path / "base").rename(tmp_path / "moved")
    with pytest.raises(UserError, match=r"the LoRA base .*/base/checkpoints/2, which .*lora_base.json records, does not exist; put "
                                        r"it back there, or set \"path\" in .*lora_base.json to where it is now"):
        lora_lib.run_model_params(make_layout(cfg, devices), tmp_path / "lora")
    # the finished run's same command with the base's new path: the record names it from then on (it stayed, unused)
    moved = tmp_path / "moved" / "checkpoints" / "2"
    train(longer, tmp_path / "lora", longer_trainer, init_from=moved)
    assert "lora_base.json now names the LoRA base at " + str(moved.absolute()) in capsys.readouterr().err
    assert lora_lib.run_model_params(make_layout(cfg, devices), tmp_path / "lora")[1].record["hash"] == record["hash"]


def test_a_float32_merged_export_of_a_bfloat16_base_keeps_the_updates_low_bits(corpus, tmp_path):
    """export-hf --dtype float32 of a run whose base is bfloat16 (llama3_8b_lora's, llama3_70b_qlora's): each merged
    weight is the base's plus (alpha / rank) A @ B in float32; it was rounded to bfloat16 first, off by up to half a
    bfloat16 step of the weight, 4e-2 in the logits of a tiny Llama whose float32 PEFT adapter was within 5e-6."""
    cfg = with_(lora_config(init_std=0.3, param_dtype="bfloat16"), train={"steps": 2})
    train(cfg, tmp_path / "run", build(cfg, corpus))
    assert cli.main(["export-hf", str(tmp_path / "run"), "--out", str(tmp_path / "merged"), "--dtype", "float32"]) == 0
    params = jax.tree.map(np.asarray, lora_lib.run_model_params(make_layout(cfg, train_batch=False), tmp_path / "run")[0])
    attn = params["layers"]["attn"]
    a, b = (attn["lora_q"][x][0].astype(np.float32) for x in "ab")
    expected = attn["wq"][0].astype(np.float32) + cfg.model.lora.alpha / cfg.model.lora.rank * np.tensordot(a, b, axes=1)
    exported = load_file(str(tmp_path / "merged" / "model.safetensors"))["model.layers.0.self_attn.q_proj.weight"]
    np.testing.assert_allclose(exported, expected.reshape(expected.shape[0], -1).T, rtol=0, atol=1e-6)


@pytest.mark.parametrize("override, message", [
    ("model.lora.targets=q,qq", "model.lora.targets item 'qq' matches no weight"),
    ("model.lora.targets=q,(v", "model.lora.targets item '(v' is not a regular expression (missing ), unterminated subpattern"),
    ("model.lora.rank=200", "model.lora.rank=200 is larger than the q weight's dimensions 128 x 128"),
    ("model.base_quant=nf3", "model.base_quant='nf3' is unknown"),
    ("model.lora.dropout=1", "model.lora.dropout=1.0 must be at least 0 and below 1"),
    ("model.lora.dropout=-0.1", "model.lora.dropout=-0.1 must be at least 0 and below 1"),
])
def test_bad_lora_config_is_one_line(override, message, tmp_path, capsys):
    run_dir = tmp_path / "run"
    assert cli.main(["train", "tiny", "--run-dir", str(run_dir), "model.lora.rank=4", override]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("jaxtrain: error: ") and message in lines[0], lines
    assert not run_dir.exists()


def test_wrong_lora_targets_get_one_hint(tmp_path, capsys):
    # PEFT's module names: one message, the targets listed once (it was the whole hint after each item) and jaxtrain's names
    run_dir = tmp_path / "run"
    assert cli.main(["train", "tiny", "--run-dir", str(run_dir), "model.lora.rank=4", "model.lora.targets=q_proj,v_proj"]) == 2
    assert capsys.readouterr().err == (
        "jaxtrain: error: model.lora.targets items 'q_proj', 'v_proj' match no weight (as PEFT names modules; jaxtrain's: "
        "model.lora.targets=q,v); targets are q (attn.wq), k (attn.wk), v (attn.wv), o (attn.wo), gate (mlp.w_gate), "
        "up (mlp.w_up), down (mlp.w_down), or regular expressions over them\n")
    assert not run_dir.exists()
    # PEFT's names among jaxtrain's: the names of those items alone, not a whole value that would drop the others
    problems = LoraConfig(rank=4, targets="q,v_proj,(k").problems()
    assert problems == ["model.lora.targets item '(k' is not a regular expression (missing ), unterminated subpattern at position 0); "
                        "model.lora.targets item 'v_proj' matches no weight (as PEFT names modules; jaxtrain's: v); targets are "
                        "q (attn.wq), k (attn.wk), v (attn.wv), o (attn.wo), gate (mlp.w_gate), up (mlp.w_up), down (mlp.w_down), "
                        "or regular expressions over them"]


@pytest.mark.parametrize("targets", ["[q,v]", "(q, v)", "['q', 'v']"])
def test_lora_targets_in_brackets_are_told_the_list_syntax(targets):
    """Hydra's and YAML's list syntax: '[q' was "not a regular expression" and 'v]' "matches no weight"."""
    assert LoraConfig(rank=4, targets=targets).problems() == [
        f"model.lora.targets={targets} is a list in brackets; give its items comma-separated, without them: model.lora.targets=q,v"]
    assert LoraConfig(rank=4, targets="[qv]").problems() == []  # a regular expression in brackets is one
    assert "is a list in brackets" not in LoraConfig(rank=4, targets="[q,nosuch]").problems()[0]


def test_adapters_lists_what_the_newest_committed_checkpoint_holds(tmp_path, capsys):
    """A run killed (SIGKILL) after step 6's metrics, with step 4 its newest committed checkpoint and step 6's save left
    temporary: `jaxtrain adapters` listed steps 6 and step 6's eval loss, progress no checkpoint holds (a QA report)."""
    run_dir = tmp_path / "run"
    (run_dir / "checkpoints" / "2").mkdir(parents=True)
    (run_dir / "checkpoints" / "4").mkdir()
    (run_dir / "checkpoints" / "6.orbax-checkpoint-tmp-1765000000").mkdir()
    (run_dir / lora_lib.BASE_RECORD).write_text(json.dumps(
        {"hash": "abc123", "path": "/models/base", "rank": 4, "targets": ["q", "v"], "seed": 0}))
    records = [{"step": s, "loss": 5.0 - s / 10} | ({"eval_loss": 4.0 - s / 10} if s % 2 == 0 else {}) for s in range(1, 7)]
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    assert cli.main(["adapters", str(run_dir)]) == 0
    assert capsys.readouterr().out == f"base abc123  /models/base\n  {run_dir}  run  rank 4  targets q,v  steps 4  eval loss 3.6000\n"
    shutil.rmtree(run_dir / "checkpoints")  # killed before its first save: its adapters are nowhere
    assert cli.main(["adapters", str(run_dir)]) == 0
    assert capsys.readouterr().out == f"base abc123  /models/base\n  {run_dir}  run  rank 4  targets q,v  steps 0  eval loss -\n"
