"""LoRA / QLoRA: adapters on the frozen base (zero adapters give the base's logits exactly, merged equals unmerged),
training updates only the adapters and leaves the base bit-identical, checkpoints hold no base and resume exactly,
QLoRA trains, PEFT adapter files load in peft with the same logits, and bad input is one line, exit 2."""

import dataclasses
import functools
import json
import shutil
import warnings

import jax
import numpy as np
import peft
import pytest
import torch
import transformers
from flax import nnx
from flax.core import spmd
from safetensors import safe_open
from safetensors.numpy import load_file

from conftest import run_cli, small_config, with_
from test_hf import MODELS as HF_MODELS, SHAPE as HF_SHAPE
from test_parity import _losses
from jaxtrain import cli
from jaxtrain import generate as generate_lib
from jaxtrain.adapt import lora as lora_lib
from jaxtrain.config import AxisSizes
from jaxtrain.errors import UserError
from jaxtrain.interop import hf_config
from jaxtrain.interop import peft as peft_io
from jaxtrain.layout import make_layout
from jaxtrain.observe.metrics import format_summary
from jaxtrain.partitioning import flax_rules
from jaxtrain.state import model_spec
from jaxtrain.train import build, train
from models.config import LORA_TARGETS, LoraConfig
from models.llama import Llama

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


def test_the_base_hash_sees_each_value_where_it_is():
    """The hash that refuses a LoRA run's adapters on another base weighs each value by its position: a plain sum of the
    values' bits would take a base with a square weight transposed, or two values swapped, for the one they trained on."""
    w = np.arange(16, dtype=np.float32).reshape(4, 4)
    swapped = w.copy()
    swapped[0, 1], swapped[1, 0] = w[1, 0], w[0, 1]
    hashes = [lora_lib.content_hash({"w": jax.numpy.asarray(x)}) for x in (w, w.T, swapped, w + np.eye(4, dtype=np.float32))]
    assert len(set(hashes)) == 4, hashes
    assert lora_lib.content_hash({"w": jax.numpy.asarray(w.copy())}) == hashes[0]


# bitsandbytes' NF4 code (functional.py get_4bit_type("nf4"), the QLoRA paper's), written out, not read from models/quant.py
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
    with its own backward (models/sharding.py ``gathered``): fsdp x tensor trains the adapters as one device does."""
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
    _, base = lora_lib.run_model_params(make_layout(cfg, devices), tmp_path / "lora")  # export-hf's and generate's path
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


@pytest.fixture(scope="module")
def hf_base(tmp_path_factory):
    """A tiny random Llama in float32 (transformers): (directory, model)."""
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=64)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_((1.0 if "norm" in name else 0.0) + 0.2 * torch.randn_like(p))
    directory = tmp_path_factory.mktemp("hf_base")
    model.save_pretrained(directory)
    return directory, model


def _torch_logits(model) -> np.ndarray:
    with torch.no_grad():
        return model(torch.tensor(TOKENS)).logits.float().numpy()


def _adapted_logits(hf_dir, adapter) -> np.ndarray:
    """On TOKENS, the logits of the model `jaxtrain generate HF_DIR --adapter ADAPTER` generates with: the base loaded
    as generate loads it (float32, every device on fsdp), the adapter merged into it by ``with_adapter``; the forward on
    one device (the batch of 2 does not divide fsdp 8)."""
    loaded = lora_lib.with_adapter(generate_lib.load(hf_dir), adapter)
    return np.asarray(_forward(model_spec(loaded.model_cfg).graphdef)(jax.device_get(loaded.params), TOKENS))


def _assert_same_logits(ours, theirs, base=None):
    """Every logit of both prompts within 1e-4 of the largest: float32 sums in another order stayed within 3e-6 of it
    here. With ``base`` (the logits without the adapter), the adapter moved them by over 100 times the tolerance, so an
    adapter scaled 1% off (alpha // r, dropout's 1 / (1 - p) at inference), one target's adapter dropped, or A read
    untransposed moves them beyond it."""
    tolerance = 1e-4 * np.max(np.abs(theirs))
    assert np.max(np.abs(ours - theirs)) <= tolerance, (np.max(np.abs(ours - theirs)), tolerance)
    if base is not None:
        assert np.max(np.abs(theirs - base)) > 100 * tolerance, (np.max(np.abs(theirs - base)), tolerance)


def test_peft_export_loads_in_peft_and_merged_export_in_transformers(hf_base, corpus, tmp_path, capsys):
    """alpha / rank = 1.5: a scale that alpha // rank, alpha or 1 / rank would not give."""
    hf_dir, hf_model = hf_base
    cfg = lora_config(alpha=6.0)
    cfg = dataclasses.replace(cfg, model=hf_config.model_config(hf_dir, cfg.model, set(), cfg.data.seq_len))
    run_dir = tmp_path / "run"
    state = train(cfg, run_dir, build(cfg, corpus), init_from=hf_dir)
    layout = make_layout(cfg)
    ours = _logits(layout, state.model_params)
    assert np.max(np.abs(ours - _torch_logits(hf_model))) > 1e-3  # the adapters trained away from the base

    adapter_dir, merged_dir = tmp_path / "adapter", tmp_path / "merged"
    assert cli.main(["export-hf", str(run_dir), "--out", str(adapter_dir), "--adapter-only"]) == 0
    assert cli.main(["export-hf", str(run_dir), "--out", str(merged_dir), "--dtype", "float32"]) == 0
    with safe_open(adapter_dir / "adapter_model.safetensors", "np") as f:
        assert f.get_tensor("base_model.model.model.layers.1.self_attn.o_proj.lora_A.weight").shape == (4, 32)  # (rank, in)
        assert f.get_tensor("base_model.model.model.layers.0.mlp.gate_proj.lora_B.weight").shape == (64, 4)  # (out, rank)
    adapted = peft.PeftModel.from_pretrained(transformers.LlamaForCausalLM.from_pretrained(hf_dir), adapter_dir).eval()
    tolerance = 1e-4 * np.max(np.abs(ours))
    assert np.max(np.abs(_torch_logits(adapted) - ours)) <= tolerance
    assert np.max(np.abs(_torch_logits(transformers.LlamaForCausalLM.from_pretrained(merged_dir)) - ours)) <= tolerance
    # PEFT's merge_and_unload of the exported adapter is jaxtrain's merged export, weight for weight (float32 rounding apart)
    peft_merged = adapted.merge_and_unload().state_dict()
    our_merged = transformers.LlamaForCausalLM.from_pretrained(merged_dir).state_dict()
    assert sorted(peft_merged) == sorted(our_merged)
    for name, weight in peft_merged.items():
        np.testing.assert_allclose(our_merged[name].numpy(), weight.numpy(), rtol=0, atol=1e-6, err_msg=name)
    assert json.loads((adapter_dir / "jaxtrain_adapter.json").read_text())["steps"] == 4
    # float32 by default, as PEFT saves adapters; --dtype bfloat16 honoured (it was ignored: float32 whatever it said)
    bf16_dir = tmp_path / "adapter_bf16"
    assert cli.main(["export-hf", str(run_dir), "--out", str(bf16_dir), "--adapter-only", "--dtype", "bfloat16"]) == 0
    for directory, dtype in ((adapter_dir, "float32"), (bf16_dir, "bfloat16")):
        with safe_open(directory / "adapter_model.safetensors", "np") as f:
            assert {f.get_tensor(name).dtype.name for name in f.keys()} == {dtype}

    # the run's adapters on another base: one line, exit 2, nothing written
    other = tmp_path / "other_base"
    transformers.LlamaForCausalLM(hf_model.config).save_pretrained(other)
    before = sorted((p, p.stat().st_mtime_ns) for p in run_dir.rglob("*"))
    with pytest.raises(UserError) as error:
        train(cfg, run_dir, build(cfg, corpus), init_from=other)
    assert "is not the base run" in str(error.value) and str(other) in str(error.value) and "\n" not in str(error.value)
    assert sorted((p, p.stat().st_mtime_ns) for p in run_dir.rglob("*")) == before


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


def _generated(capsys, *args) -> str:
    capsys.readouterr()
    assert cli.main(["generate", *args, "--prompt", "1 2 3 4", "--max-new-tokens", "6"]) == 0
    return capsys.readouterr().out.strip()


def test_a_peft_adapter_with_rank_stabilised_scaling_gives_peft_s_logits(hf_base, tmp_path):
    """use_rslora scales by lora_alpha / sqrt(r): read as plain LoRA (alpha / r) it generated other text, exit 0. Targets
    in attention and the MLP, alpha / r = 2, alpha / sqrt(r) = 4; lora_dropout 0.1, which PEFT's eval and jaxtrain's
    generation leave out."""
    hf_dir, hf_model = hf_base
    torch.manual_seed(1)
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "up_proj"], use_rslora=True, lora_dropout=0.1,
                             init_lora_weights=False)
    adapted = peft.get_peft_model(transformers.LlamaForCausalLM.from_pretrained(hf_dir), config).eval()
    adapted.save_pretrained(tmp_path / "rslora")
    _assert_same_logits(_adapted_logits(hf_dir, tmp_path / "rslora"), _torch_logits(adapted), _torch_logits(hf_model))


@pytest.mark.parametrize("targets", ["all-linear", r".*\.(q_proj|v_proj)", ["self_attn.q_proj", "mlp.down_proj"]])
def test_peft_adapters_whose_targets_peft_matches_by_module_name_give_peft_s_logits(targets, hf_base, tmp_path, capsys):
    """target_modules as PEFT matches them against the base's module names: "all-linear" (saved as every module's full
    name, model.layers.0.self_attn.q_proj ...), a regular expression, names a module's name ends with. A QA report: all
    three were refused ("not all Llama projections"), and `jaxtrain adapters` failed with a traceback on the expression.
    rank 4, alpha 6: a scale of 1.5 that alpha // r, alpha or 1 / r would not give (6 greedy tokens were compared before
    2026-12-05, of adapters with alpha / r = 2); lora_dropout 0.1, left out as in PEFT's eval (with the adapter scaled by
    1 / (1 - 0.1) at generation, the q, v adapter's 6 greedy tokens still agreed)."""
    hf_dir, hf_model = hf_base
    torch.manual_seed(1)
    config = peft.LoraConfig(r=4, lora_alpha=6, target_modules=targets, lora_dropout=0.1, init_lora_weights=False)
    adapted = peft.get_peft_model(transformers.LlamaForCausalLM.from_pretrained(hf_dir), config).eval()
    adapted.save_pretrained(tmp_path / "adapter")
    _assert_same_logits(_adapted_logits(hf_dir, tmp_path / "adapter"), _torch_logits(adapted), _torch_logits(hf_model))
    assert cli.main(["adapters", str(tmp_path / "adapter")]) == 0
    listed = {"all-linear": "down_proj,gate_proj,k_proj,o_proj,q_proj,up_proj,v_proj", r".*\.(q_proj|v_proj)": targets}
    assert f"  targets {listed.get(str(targets), 'down_proj,q_proj')}  steps -" in capsys.readouterr().out


@pytest.mark.parametrize("name", ["qwen2", "mistral"])
def test_peft_adapters_on_qwen2_and_mistral_give_peft_s_logits_both_ways(name, tmp_path):
    """Qwen2 (q, k, v biases, which the adapters leave as they are) and Mistral with head_dim 16, not hidden / heads = 8
    (q, k, v's outputs and o's inputs 64 wide against d_model 32: o's adapter is not square): a PEFT adapter on every
    projection gives PEFT's logits in jaxtrain; written back by export-hf --adapter-only's writer, the tensors are PEFT's
    own, name for name, and PEFT loads them to the same logits."""
    model_cls, config_cls, extra, _, _ = HF_MODELS[name]
    torch.manual_seed(0)
    base = model_cls(config_cls(**HF_SHAPE, **extra)).eval()
    with torch.no_grad():  # random everything, biases too, in float32
        for pname, p in base.named_parameters():
            p.copy_((1.0 if "norm" in pname else 0.0) + 0.2 * torch.randn_like(p))
    hf_dir, adapter_dir, exported = tmp_path / "hf", tmp_path / "adapter", tmp_path / "exported"
    base.save_pretrained(hf_dir)
    base_logits = _torch_logits(base)
    adapted = peft.get_peft_model(base, peft.LoraConfig(r=4, lora_alpha=6, target_modules="all-linear", lora_dropout=0.1,
                                                            init_lora_weights=False)).eval()
    adapted.save_pretrained(adapter_dir)
    expected = _torch_logits(adapted)
    _assert_same_logits(_adapted_logits(hf_dir, adapter_dir), expected, base_logits)

    config, tensors, _ = peft_io.read_adapter(adapter_dir)
    model_cfg = hf_config.model_config(hf_dir, small_config().model, set(), 16)
    targets = peft_io.targets_of(config, adapter_dir, model_cfg)
    model_cfg = dataclasses.replace(model_cfg, lora=LoraConfig(rank=4, alpha=6.0, targets=targets))
    peft_io.write_adapter(peft_io.from_peft(tensors, model_cfg, adapter_dir), model_cfg, exported, str(hf_dir), {})
    written = load_file(str(exported / peft_io.WEIGHTS_FILE))
    assert sorted(written) == sorted(tensors) and all(np.array_equal(written[k], tensors[k]) for k in tensors)
    reloaded = peft.PeftModel.from_pretrained(model_cls.from_pretrained(hf_dir), exported).eval()
    _assert_same_logits(_torch_logits(reloaded), expected)


@pytest.mark.parametrize("key", ["target_modules", "exclude_modules"])
def test_a_peft_adapter_whose_module_expression_is_invalid_is_one_line(key, tmp_path):
    """An invalid expression was an re.error traceback."""
    config = {"target_modules": ["q_proj"]} | {key: "(q_proj"}
    with pytest.raises(UserError, match=rf"adapter_config.json: {key} '\(q_proj' is not a regular expression \(missing \), "
                       r"unterminated subpattern at position 0\); PEFT would not load this adapter either"):
        peft_io.targets_of(config, tmp_path, small_config().model)


def test_peft_adapters_made_on_a_rewritten_base_are_refused():
    """PiSSA, OLoRA, CorDA, LoRA-GA and LoftQ also rewrite the base's weights: an adapter saved unconverted is a difference
    from that base, and applied to the model's own it generated other text with exit 0 (LoRA-GA's until 2026-12-05).
    Converted on save, PEFT writes init_lora_weights=True; the inits that leave the base alone are plain adapters."""
    for init in ("pissa", "pissa_niter_4", "olora", "corda", "loftq", "lora_ga"):
        assert peft_io.unsupported_options({"init_lora_weights": init}) == [f"init_lora_weights={init!r}"]
    for init in (True, False, "gaussian", "eva", "orthogonal", "mica"):
        assert peft_io.unsupported_options({"init_lora_weights": init}) == []


def test_peft_options_jaxtrain_does_not_know_are_refused_and_peft_s_defaults_are_not():
    """PEFT adds LoRA variants often (QALoRA, layer replication, VeLoRA, KaSA, MonteCLoRA, Arrow, BD-LoRA in 0.21): read as
    plain adapters they would compute another model with exit 0. A config as this PEFT writes it is plain; a key set to a
    value that jaxtrain does not know is refused."""
    written = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj"]).to_dict()
    assert peft_io.unsupported_options(json.loads(json.dumps(written, default=str))) == []
    for key, value in (("use_qalora", True), ("layer_replication", [[0, 1], [0, 1]]), ("velora_config", {"rank": 2}),
                       ("kasa_config", {"k": 1}), ("a_future_variant", "on")):
        assert peft_io.unsupported_options({**written, key: value}) == [f"{key}={value!r}"]


def test_an_activated_lora_adapter_is_refused(hf_base, tmp_path):
    """Activated LoRA (alora_invocation_tokens) changes the model only from its invocation tokens on; read as a plain
    adapter, jaxtrain applied it to every position with exit 0 (until 2026-12-05)."""
    hf_dir, _ = hf_base
    config = peft.LoraConfig(task_type="CAUSAL_LM", r=2, target_modules=["q_proj"], alora_invocation_tokens=[5, 6])
    peft.get_peft_model(transformers.LlamaForCausalLM.from_pretrained(hf_dir), config).save_pretrained(tmp_path / "alora")
    refused = r"adapter_config.json: alora_invocation_tokens=\[5, 6\]: jaxtrain applies plain LoRA adapters only"
    with pytest.raises(UserError, match=refused):
        peft_io.read_adapter(tmp_path / "alora")


def test_a_peft_adapter_config_without_alpha_takes_peft_s_default(hf_base, tmp_path):
    """PEFT reads an adapter_config.json without lora_alpha with its default, 8; jaxtrain stopped with a KeyError
    traceback (until 2026-12-05)."""
    hf_dir, hf_model = hf_base
    torch.manual_seed(1)
    config = peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False)  # lora_alpha: PEFT's 8
    adapted = peft.get_peft_model(transformers.LlamaForCausalLM.from_pretrained(hf_dir), config).eval()
    adapted.save_pretrained(tmp_path / "adapter")
    config_file = tmp_path / "adapter" / peft_io.CONFIG_FILE
    config_file.write_text(json.dumps({k: v for k, v in json.loads(config_file.read_text()).items() if k != "lora_alpha"}))
    _assert_same_logits(_adapted_logits(hf_dir, tmp_path / "adapter"), _torch_logits(adapted), _torch_logits(hf_model))


def test_a_peft_adapter_holding_tensors_outside_its_targets_is_one_line(hf_base, tmp_path):
    """Tensors the targets do not name (an edited adapter_config.json, embeddings PEFT saved beside the adapters) would be
    left out of the model without a word."""
    hf_dir, _ = hf_base
    adapted = peft.get_peft_model(transformers.LlamaForCausalLM.from_pretrained(hf_dir), peft.LoraConfig(r=2, target_modules=["q_proj"]))
    tensors = {name: t.detach().numpy() for name, t in peft.get_peft_model_state_dict(adapted).items()}
    model_cfg = dataclasses.replace(hf_config.model_config(hf_dir, small_config().model, set(), 16), lora=LoraConfig(rank=2, targets="q"))
    assert set(peft_io.from_peft(tensors, model_cfg, tmp_path)["attn"]) == {"lora_q"}
    tensors["base_model.model.lm_head.weight"] = np.zeros((64, 32), np.float32)
    with pytest.raises(UserError, match=r"adapter_model.safetensors holds 1 tensor\(s\) jaxtrain does not apply "
                       r"\(base_model.model.lm_head.weight\): adapters or weights outside its targets q; merge this adapter"):
        peft_io.from_peft(tensors, model_cfg, tmp_path)


def test_generate_with_a_qlora_adapter_serves_the_model_it_trained(hf_base, corpus, tmp_path, capsys):
    """Adapters trained on an nf4 base (a run directory, or its PEFT export with our record) are applied to the float
    base quantized the same way: the model the merged export (and `generate RUN_DIR`) gives. Applied to the float base, the
    model differed from the second generated token on (a QA report)."""
    hf_dir, hf_model = hf_base
    cfg = lora_config(rank=2, base_quant="nf4")
    cfg = dataclasses.replace(cfg, model=hf_config.model_config(hf_dir, cfg.model, set(), cfg.data.seq_len))
    run_dir = tmp_path / "run"
    train(with_(cfg, optim={"lr": 0.1}), run_dir, build(cfg, corpus), init_from=hf_dir)
    for args in (["--adapter-only"], ["--dtype", "float32"]):
        assert cli.main(["export-hf", str(run_dir), "--out", str(tmp_path / args[0].strip("-")), *args]) == 0
    # the run's model: its adapters on its nf4 base, merged, in transformers
    merged = _torch_logits(transformers.LlamaForCausalLM.from_pretrained(tmp_path / "dtype"))
    for adapter in (run_dir, tmp_path / "adapter-only"):
        _assert_same_logits(_adapted_logits(hf_dir, adapter), merged, _torch_logits(hf_model))
    capsys.readouterr()
    assert cli.main(["generate", str(hf_dir), "--adapter", str(run_dir), "--prompt", "1 2", "--max-new-tokens", "2"]) == 0
    said = capsys.readouterr().err
    assert f"jaxtrain: --adapter {run_dir} trained on the base quantized to nf4: applied to it quantized the same way" in said


def test_generate_with_an_adapter_and_the_adapter_pool(hf_base, corpus, tmp_path, capsys):
    """alpha / rank = 1.5: a scale that alpha // rank, alpha or 1 / rank would not give."""
    hf_dir, hf_model = hf_base
    cfg = lora_config(rank=2, alpha=3.0)
    cfg = dataclasses.replace(cfg, model=hf_config.model_config(hf_dir, cfg.model, set(), cfg.data.seq_len))
    pool_dir = tmp_path / "pool"
    run_dir = pool_dir / "run"
    train(cfg, run_dir, build(cfg, corpus), init_from=hf_dir)
    for args in (["--adapter-only"], ["--dtype", "float32"]):
        assert cli.main(["export-hf", str(run_dir), "--out", str(pool_dir / args[0].strip("-")), *args]) == 0
    # the exported adapter in PEFT, the run's and the exported adapter in jaxtrain: the merged export's logits
    expected = _torch_logits(transformers.LlamaForCausalLM.from_pretrained(pool_dir / "dtype"))
    in_peft = peft.PeftModel.from_pretrained(transformers.LlamaForCausalLM.from_pretrained(hf_dir), pool_dir / "adapter-only").eval()
    _assert_same_logits(_torch_logits(in_peft), expected, _torch_logits(hf_model))
    for adapter in (pool_dir / "adapter-only", run_dir):
        _assert_same_logits(_adapted_logits(hf_dir, adapter), expected)
    merged = _generated(capsys, str(pool_dir / "dtype"))
    # on fewer devices than the run trained on: its adapters restored onto the base's mesh, not the run's own
    fewer = run_cli("generate", str(hf_dir), "--devices", "2", "--adapter", str(run_dir), "--prompt", "1 2 3 4",
                    "--max-new-tokens", "6", cwd=tmp_path)
    assert fewer.returncode == 0 and fewer.stdout.strip() == merged, fewer.stderr[-2000:]
    # PEFT options jaxtrain's adapters do not compute with: read as plain adapters, they generated other text, exit 0
    options = tmp_path / "options"
    shutil.copytree(pool_dir / "adapter-only", options)
    config = json.loads((options / "adapter_config.json").read_text())
    (options / "adapter_config.json").write_text(json.dumps(config | {"use_dora": True, "alpha_pattern": {"v_proj": 64}}))
    capsys.readouterr()
    assert cli.main(["generate", str(hf_dir), "--adapter", str(options), "--prompt", "1 2", "--max-new-tokens", "4"]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        f"jaxtrain: error: {options / 'adapter_config.json'}: use_dora=True, alpha_pattern={{'v_proj': 64}}: jaxtrain applies "
        "plain LoRA adapters only (scaled lora_alpha / r, or / sqrt(r) with use_rslora, on every layer, no biases or other "
        "trained modules, on the base as it is); merge this adapter into its base with peft (merge_and_unload) and give the "
        "merged model instead")
    assert cli.main(["adapters", str(options)]) == 0  # listed, marked
    assert capsys.readouterr().out.splitlines()[1].endswith("  (not applied by jaxtrain: use_dora=True, alpha_pattern={'v_proj': 64})")

    record = json.loads((run_dir / lora_lib.BASE_RECORD).read_text())
    assert cli.main(["adapters", str(pool_dir)]) == 0
    listing = capsys.readouterr().out.splitlines()
    assert listing[0] == f"base {record['hash']}  {hf_dir.absolute()}"
    assert len(listing) == 3 and f"  {pool_dir / 'adapter-only'}  peft  rank 2  targets q,k,v,o,gate,up,down  steps 4  eval loss" in listing[1]
    assert f"  {run_dir}  run  rank 2  targets q,k,v,o,gate,up,down  steps 4  eval loss" in listing[2]

    other = tmp_path / "other_base"
    transformers.LlamaForCausalLM(hf_model.config).save_pretrained(other)
    capsys.readouterr()
    assert cli.main(["generate", str(other), "--adapter", str(run_dir), "--prompt", "1 2", "--max-new-tokens", "8"]) == 2
    errors = [line for line in capsys.readouterr().err.strip().splitlines() if "error" in line]  # after progress lines
    assert len(errors) == 1 and f"jaxtrain: error: --adapter {run_dir} was trained on base {hf_dir.absolute()}" in errors[0], errors

    # a LoRA run where a model is wanted: as --init-from it holds no model, and generating from it already applies it
    with pytest.raises(UserError, match=rf"^--init-from {run_dir} is a LoRA run, whose checkpoints hold only its adapters; start "
                                        rf"from its base \({hf_dir.absolute()}\) or from its merged model: jaxtrain export-hf"):
        train(dataclasses.replace(cfg, model=lora_lib.plain_config(cfg.model)), tmp_path / "full",
              init_from=run_dir)
    assert not (tmp_path / "full").exists()
    assert cli.main(["generate", str(run_dir), "--adapter", str(run_dir), "--prompt", "1 2"]) == 2
    assert capsys.readouterr().err.startswith(f"jaxtrain: error: {run_dir} is a LoRA run, and `jaxtrain generate {run_dir}` "
                                              "already applies its adapters on its base; drop --adapter")
