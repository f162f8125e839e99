"""PEFT interop of LoRA adapters, against peft and transformers on torch: jaxtrain's exports load in peft with the same
logits and its merged export equals peft's merge_and_unload, peft's adapters (rank-stabilised scaling, targets by module
name, Qwen2 and Mistral) give peft's logits in jaxtrain, options jaxtrain does not compute with are refused, and
`generate --adapter` serves the model a (Q)LoRA run trained."""

import dataclasses
import json
import shutil

import jax
import numpy as np
import peft
import pytest
import torch
import transformers
from safetensors import safe_open
from safetensors.numpy import load_file

from conftest import run_cli, small_config, with_
from test_hf import MODELS as HF_MODELS, SHAPE as HF_SHAPE
from test_lora import TOKENS, _forward, _logits, lora_config
from jaxtrain import cli
from jaxtrain import generate as generate_lib
from jaxtrain.adapt import lora as lora_lib
from jaxtrain.adapt.adapters import split_frozen
from jaxtrain.errors import UserError
from jaxtrain.interop import hf_config
from jaxtrain.interop import peft as peft_io
from jaxtrain.layout import make_layout
from jaxtrain.state import model_spec
from jaxtrain.train import build, train
from jaxtrain.models.config import LoraConfig


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
    # --step 2: the record is that checkpoint's (it said the run's 4 steps and step 4's eval loss; a QA report)
    early_dir = tmp_path / "adapter_step2"
    assert cli.main(["export-hf", str(run_dir), "--out", str(early_dir), "--adapter-only", "--step", "2"]) == 0
    early = json.loads((early_dir / "jaxtrain_adapter.json").read_text())
    assert (early["steps"], early["eval_loss"]) == (2, None)
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


def test_adapters_on_attention_only_are_written_as_peft_names_them_and_read_back(tmp_path):
    """model.lora.targets=q,v (PEFT's default targets for Llama): the trained tree has no mlp subtree, and
    `export-hf --adapter-only` stopped with a KeyError traceback (a QA report)."""
    model_cfg = dataclasses.replace(small_config().model, lora=LoraConfig(rank=2, targets="q,v"))
    rng = np.random.default_rng(0)
    adapters = jax.tree.map(lambda s: rng.standard_normal(s.shape).astype(np.float32), split_frozen(model_spec(model_cfg).shapes)[0])
    tensors = peft_io.to_peft(adapters["layers"], model_cfg)
    assert {name.split(".")[-3] for name in tensors} == {"q_proj", "v_proj"}
    jax.tree.map(np.testing.assert_array_equal, peft_io.from_peft(tensors, model_cfg, tmp_path), adapters["layers"])


@pytest.mark.parametrize("key, value", [("r", 0), ("r", -1), ("r", "4"), ("lora_alpha", None), ("lora_alpha", float("nan"))])
def test_a_peft_adapter_config_with_no_usable_rank_or_alpha_is_one_line(key, value, tmp_path):
    """Checked before any weight is read: r 0 was blamed on the base's shape once the base was read ("this base needs
    (0, 32)"), lora_alpha null stopped with a TypeError traceback."""
    written = json.loads(json.dumps(peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj"]).to_dict(), default=str))
    (tmp_path / peft_io.CONFIG_FILE).write_text(json.dumps(written | {key: value}))
    with pytest.raises(UserError, match=rf"adapter_config.json: {key}={value!r} is not a (positive integer|finite number) "):
        peft_io.read_adapter_config(tmp_path)


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


def test_a_peft_adapter_whose_r_is_not_its_tensors_rank_is_blamed_on_its_config_not_the_base(hf_base, tmp_path):
    """A hand-edited r (4 for rank-2 tensors) was called an adapter "made for another base"; another base still is."""
    hf_dir, _ = hf_base
    adapted = peft.get_peft_model(transformers.LlamaForCausalLM.from_pretrained(hf_dir), peft.LoraConfig(r=2, target_modules=["q_proj"]))
    tensors = {name: t.detach().numpy() for name, t in peft.get_peft_model_state_dict(adapted).items()}
    model_cfg = hf_config.model_config(hf_dir, small_config().model, set(), 16)
    with pytest.raises(UserError, match=r"^\S+adapter_config.json: r=4, but the adapter's tensors have rank 2 \(base_model.model."
                                        r"model.layers.0.self_attn.q_proj.lora_A is \(2, 32\), lora_B \(32, 2\)\); give the r it was "
                                        r"saved with$"):
        peft_io.from_peft(tensors, dataclasses.replace(model_cfg, lora=LoraConfig(rank=4, targets="q")), tmp_path)
    narrower = dataclasses.replace(model_cfg, d_model=16, lora=LoraConfig(rank=2, targets="q"))
    with pytest.raises(UserError, match=r"adapter_model.safetensors: \S+lora_A/lora_B are \(2, 32\) / \(32, 2\), this base needs "
                                        r"\(2, 16\) / \(\d+, 2\); the adapter was made for another base$"):
        peft_io.from_peft(tensors, narrower, tmp_path)


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


def test_generate_takes_the_adapters_of_a_run_on_its_base_in_bfloat16(hf_base, corpus, tmp_path):
    """A run with model.param_dtype=bfloat16 (llama3_8b_lora's, llama3_70b_qlora's) hashed its base in bfloat16, and
    `generate HF_DIR` loads the base in float32: the run's adapters and their PEFT export were refused as trained on
    another base (a QA report); another base still is."""
    hf_dir, hf_model = hf_base
    cfg = lora_config(rank=2, param_dtype="bfloat16")
    cfg = dataclasses.replace(cfg, model=hf_config.model_config(hf_dir, cfg.model, set(), cfg.data.seq_len))
    run_dir = tmp_path / "run"
    train(cfg, run_dir, build(cfg, corpus), init_from=hf_dir)
    assert cli.main(["export-hf", str(run_dir), "--out", str(tmp_path / "adapter"), "--adapter-only"]) == 0
    base = generate_lib.load(hf_dir)
    for adapter in (run_dir, tmp_path / "adapter"):
        lora_lib.with_adapter(base, adapter)
    other = tmp_path / "other_base"
    transformers.LlamaForCausalLM(hf_model.config).save_pretrained(other)
    with pytest.raises(UserError, match=f"^--adapter {run_dir} was trained on base {hf_dir.absolute()}"):
        lora_lib.with_adapter(generate_lib.load(other), run_dir)


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
    # an adapter on the output projection (or the embedding), which applying refuses, is marked too
    (options / "adapter_config.json").write_text(json.dumps(config | {"target_modules": [*config["target_modules"], "lm_head"]}))
    assert cli.main(["adapters", str(options)]) == 0
    assert capsys.readouterr().out.splitlines()[1].endswith("  (not applied by jaxtrain: adapters on lm_head)")

    record = json.loads((run_dir / lora_lib.BASE_RECORD).read_text())
    assert cli.main(["adapters", str(pool_dir)]) == 0
    listing = capsys.readouterr().out.splitlines()
    assert listing[0] == f"base {record['hash']}  {hf_dir.absolute()}"
    assert len(listing) == 3
    assert f"  {pool_dir / 'adapter-only'}  peft  rank 2  targets q,k,v,o,gate,up,down  steps 4  eval loss" in listing[1]
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
