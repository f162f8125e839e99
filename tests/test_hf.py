"""Hugging Face import and export against transformers (torch on CPU), with tiny random models made here:
logits equal on 1 device and on the 8-device fsdp_tp mesh, exported directories load in transformers,
import -> train -> export -> reload, two processes reading only their own slices, bad input, and the config.json of
each experiment named after a published model reading as that model's."""

import copy
import dataclasses
import errno
import json
import os
import re
import resource
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest
import torch
import transformers
from flax import nnx
from flax.core import spmd
from safetensors import safe_open

from conftest import REPO, small_config, subprocess_env, with_
from jaxtrain import atomic, checkpoint as checkpoint_lib
from jaxtrain import cli
from jaxtrain.config import Config, load_experiment, save_yaml
from jaxtrain.interop import hf_config, hf_export, hf_import
from jaxtrain.interop import peft as peft_io
from jaxtrain.interop.hf_weights import INDEX_FILE, Checkpoint, TensorMap
from jaxtrain.partitioning import flax_rules
from jaxtrain.layout import make_layout

SEQ = 16
TOKENS = np.random.default_rng(0).integers(0, 64, (2, SEQ))
SHAPE = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=1024)
LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 512}  # head_dim 8: all three bands
MODELS = {  # class, config class, config, max shard size, file dtype
    # GQA, untied, Llama 3.1 rope scaling; saved in shards with an index
    "llama3": (transformers.LlamaForCausalLM, transformers.LlamaConfig, dict(rope_parameters=LLAMA3_ROPE), "2KB", torch.float32),
    # tied embeddings (Llama 3.2 1B / 3B), plain rope
    "llama_tied": (transformers.LlamaForCausalLM, transformers.LlamaConfig, dict(tie_word_embeddings=True, rms_norm_eps=1e-5), None,
                   torch.bfloat16),
    # head_dim 16, not hidden_size / heads = 8 (Mistral NeMo's kind): o_proj (32, 64) is not square either; a window as
    # long as the sequence (Mistral 7B v0.1's 4096 at finetune's data.seq_len 4096) attends to all of it
    "mistral": (transformers.MistralForCausalLM, transformers.MistralConfig, dict(sliding_window=SEQ, head_dim=16), None, torch.float32),
    "qwen2": (transformers.Qwen2ForCausalLM, transformers.Qwen2Config, dict(tie_word_embeddings=True), None, torch.float16),  # q/k/v biases
    # a window from layer max_window_layers on: here no layer's, so seq 16 > window 8 is the model (it was refused)
    "qwen2_window_unused": (transformers.Qwen2ForCausalLM, transformers.Qwen2Config,
                            dict(use_sliding_window=True, sliding_window=8, max_window_layers=2), None, torch.float32),
}


def _make_hf_model(directory, name):
    """A random model saved in its file dtype; returned in float32 (the same values: the reference)."""
    model_cls, config_cls, extra, shard_size, dtype = MODELS[name]
    torch.manual_seed(0)
    model = model_cls(config_cls(**SHAPE, **extra)).eval()
    with torch.no_grad():  # random everything (transformers initialises norms to 1 and biases to 0), values the file dtype holds
        for pname, p in model.named_parameters():
            p.copy_(((1.0 if "norm" in pname else 0.0) + 0.2 * torch.randn_like(p)).to(dtype).float())
    reference = copy.deepcopy(model)  # float32 (casting the model would round its rotary frequencies too)
    model.to(dtype).save_pretrained(directory, **({"max_shard_size": shard_size} if shard_size else {}))
    return reference


@pytest.fixture(scope="module")
def hf_models(tmp_path_factory):
    """name -> (directory, transformers model, its logits on TOKENS)."""
    out = {}
    for name in MODELS:
        directory = tmp_path_factory.mktemp(name)
        model = _make_hf_model(directory, name)
        out[name] = (directory, model, _hf_logits(model))
    return out


def _hf_logits(model) -> np.ndarray:
    with torch.no_grad():
        return model(torch.tensor(TOKENS)).logits.float().numpy()


def _config(hf_dir, mesh=(2, 2, 2), **sections):
    cfg = with_(small_config(mesh=mesh), **sections)
    model = hf_config.model_config(hf_dir, cfg.model, set(), SEQ)
    return dataclasses.replace(cfg, model=model)


def _our_logits(layout, params) -> np.ndarray:
    forward = jax.jit(lambda p, t: nnx.merge(layout.spec.graphdef, p)(t))
    with jax.set_mesh(layout.mesh), spmd.logical_axis_rules(flax_rules(layout.rules)):
        return np.asarray(forward(params, TOKENS))


def _assert_close(ours, theirs, rtol=1e-4):
    """Within ``rtol`` of the largest logit: float32 sums in another order."""
    assert np.max(np.abs(ours - theirs)) <= rtol * np.max(np.abs(theirs)), np.max(np.abs(ours - theirs))


@pytest.mark.parametrize("devices", [1, 8])
@pytest.mark.parametrize("name", MODELS)
def test_import_equals_transformers_and_export_loads_back(name, devices, hf_models, tmp_path, capsys, monkeypatch):
    hf_dir, _, expected = hf_models[name]
    cfg = _config(hf_dir, mesh=(1, 1, 1) if devices == 1 else (2, 2, 2))
    layout = make_layout(cfg, jax.devices()[:devices])
    params = hf_import.load_params(hf_dir, cfg.model, layout.abstract_state().params)
    ours = _our_logits(layout, params)
    _assert_close(ours, expected)
    if devices == 1:  # every byte read, the total counted in the file's dtype (bfloat16 and float16: 2 bytes)
        assert "(100%: the slices its devices hold)" in capsys.readouterr().err
        # exported as a run trained from scratch is (no source config.json to keep fields from): config.json alone
        # makes transformers' model ours
        scratch = tmp_path / "scratch"
        hf_export.write_model(params, cfg, scratch, "float32")
        assert not (scratch / INDEX_FILE).exists()  # one file: no index, as transformers saves it
        _assert_close(_hf_logits(transformers.AutoModelForCausalLM.from_pretrained(scratch)), ours)
        return
    # export (float32, small shards) -> transformers loads it unchanged -> the same logits
    out = tmp_path / "export"
    published, publish = [], atomic.publish
    monkeypatch.setattr(atomic, "publish", lambda temp, path: (published.append(path), publish(temp, path)))
    names = hf_export.write_model(params, cfg, out, "float32", source_dir=hf_dir, max_shard_bytes=20_000)
    assert published == [out]  # synced before it is renamed (tests/test_atomic.py)
    assert len(names) > 1 and (out / "model.safetensors.index.json").is_file()
    _assert_shards_as_transformers_names_and_indexes_them(out, len(names))
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(out)
    source = json.loads((hf_dir / "config.json").read_text())
    assert type(reloaded).__name__ == source["architectures"][0]
    exported = json.loads((out / "config.json").read_text())  # the source's token ids, not the byte-level run's 0
    assert [exported[k] for k in ("bos_token_id", "eos_token_id")] == [source[k] for k in ("bos_token_id", "eos_token_id")] != [0, 0]
    # the source's context (not data.seq_len) and generation_config.json travel; the dtype is the export's, not the source's file's
    assert exported["max_position_embeddings"] == source["max_position_embeddings"] == 1024 and exported["dtype"] == "float32"
    assert json.loads((out / "generation_config.json").read_text()) == json.loads((hf_dir / "generation_config.json").read_text())
    _assert_close(_hf_logits(reloaded), ours)
    # read back by the import, which finds each tensor where the index says (transformers reads every listed file whole)
    again = hf_import.load_params(out, cfg.model, layout.abstract_state().params)
    assert jax.tree.all(jax.tree.map(lambda a, b: np.array_equal(np.asarray(a), np.asarray(b)), again, params))
    # bfloat16: the same weights rounded, the index counting 2 bytes a weight
    out16 = tmp_path / "export16"
    names16 = hf_export.write_model(params, cfg, out16, "bfloat16", max_shard_bytes=10_000)
    _assert_shards_as_transformers_names_and_indexes_them(out16, len(names16))
    # transformers 5 loads in config.json's "dtype" (4 in "torch_dtype", given torch_dtype="auto"): bfloat16, not float32
    reloaded16 = transformers.AutoModelForCausalLM.from_pretrained(out16)
    assert reloaded16.dtype == torch.bfloat16 and json.loads((out16 / "config.json").read_text())["torch_dtype"] == "bfloat16"
    with safe_open(out16 / names16[0], "pt") as f, safe_open(out / names[0], "pt") as g:
        embed = f.get_tensor("model.embed_tokens.weight")
        assert embed.dtype == torch.bfloat16 and torch.equal(embed, g.get_tensor("model.embed_tokens.weight").bfloat16())
    _assert_close(_hf_logits(reloaded16.float()), ours, rtol=3e-2)


def _assert_shards_as_transformers_names_and_indexes_them(directory, count):
    """Shards named model-0000I-of-0000N.safetensors, as transformers names them; the index lists each tensor in the file
    that holds it and, as metadata.total_size, the bytes of all the tensors (what the Hub shows as the model's size)."""
    index = json.loads((directory / INDEX_FILE).read_text())
    names = [f"model-{i:05d}-of-{count:05d}.safetensors" for i in range(1, count + 1)]
    assert sorted(p.name for p in directory.glob("*.safetensors")) == names
    held, total = {}, 0
    for name in names:
        with safe_open(directory / name, "np") as f:
            for key in f.keys():
                held[key] = name
                total += f.get_tensor(key).nbytes
    assert index["weight_map"] == held and index["metadata"]["total_size"] == total


def _launch(*args, stderr):
    env = subprocess_env()
    return subprocess.run([sys.executable, str(REPO / "scripts" / "launch_local.py"), "--num-processes", "2", "--devices", "4", "--",
                           sys.executable, "-m", "jaxtrain.cli", *args], cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=stderr,
                          timeout=600)


def test_import_train_export_reload_on_two_processes(hf_models, tmp_path):
    """2 processes x 4 devices, FSDP across the processes: finetune from a Hugging Face directory, each process
    reading half of every matrix and all of the (replicated) norms, once; 5 steps; export (process 0 writes);
    transformers' logits of the export equal ours of the final checkpoint; the source's tokenizer travels along."""
    hf_dir = tmp_path / "hf"
    _make_hf_model(hf_dir, "llama3")
    (hf_dir / "tokenizer.json").write_text('{"stand-in": "a real tokenizer is only copied"}')
    tokens = tmp_path / "tokens.npy"
    np.save(tokens, np.random.default_rng(1).integers(0, 64, 4000).astype(np.int32))
    run_dir, out, log = tmp_path / "run", tmp_path / "export", tmp_path / "stderr"
    # each process: data 2 x fsdp 2, so every block it holds sits on two of its devices and is read once
    mesh = ["mesh.dcn.data=1", "mesh.dcn.fsdp=2", "mesh.ici.data=2", "mesh.ici.fsdp=2", "mesh.ici.tensor=1"]
    fast = ["log.progress=false", "log.tensorboard=false", "log.layer_every=0", "log.peak_tflops=1", "train.eval_batches=1"]
    with open(log, "w") as stderr:
        result = _launch("train", "finetune", "--init-from", str(hf_dir), "--run-dir", str(run_dir), "--rules", "fsdp_tp", *mesh, *fast,
                         f"data.path={tokens}", f"data.seq_len={SEQ}", "data.val_fraction=0.1", "train.steps=5", "train.global_batch=8",
                         "train.microbatches=1", "model.dtype=float32", "optim.lr=1e-3", "optim.warmup_steps=0", stderr=stderr)
    assert result.returncode == 0, log.read_text()[-3000:]
    source = hf_models["llama3"][1]
    sizes = {name: source.get_parameter(name).numel() * 4
             for name in json.loads((hf_dir / "model.safetensors.index.json").read_text())["weight_map"]}
    replicated, total = sum(n for name, n in sizes.items() if "norm" in name), sum(sizes.values())
    for process in (0, 1):
        line = next(line for line in log.read_text().splitlines() if line.startswith(f"jaxtrain: process {process} read "))
        assert line.split()[4] == str(replicated + (total - replicated) // 2) and line.split()[7] == str(total), line
    assert (run_dir / "hf" / "config.json").is_file()

    with open(log, "a") as stderr:
        result = _launch("export-hf", str(run_dir), "--out", str(out), "--dtype", "float32", stderr=stderr)
    assert result.returncode == 0, log.read_text()[-3000:]
    assert (out / "tokenizer.json").read_text() == (hf_dir / "tokenizer.json").read_text()
    assert json.loads((out / "generation_config.json").read_text()) == json.loads((hf_dir / "generation_config.json").read_text())
    layout = make_layout(_config(hf_dir))
    params = checkpoint_lib.restore_from(run_dir, layout.abstract_state(), None, params_only=True)
    ours = _our_logits(layout, params)
    _assert_close(_hf_logits(transformers.AutoModelForCausalLM.from_pretrained(out)), ours)
    assert np.max(np.abs(ours - hf_models["llama3"][2])) > 1e-2 * np.max(np.abs(ours))  # it trained


DEFAULTED_KEYS = ("rms_norm_eps", "rope_parameters", "rope_theta", "sliding_window", "num_key_value_heads", "num_local_experts",
                  "num_experts", "num_experts_per_tok", "moe_intermediate_size", "shared_expert_intermediate_size", "norm_topk_prob",
                  "tie_word_embeddings")


@pytest.mark.parametrize("config_cls", [transformers.LlamaConfig, transformers.MistralConfig, transformers.Qwen2Config,
                                        transformers.MixtralConfig, transformers.Qwen2MoeConfig])
def test_keys_config_json_leaves_out_are_what_transformers_makes_them(config_cls, tmp_path):
    """Each architecture's config class has its own defaults. A QA report: a Mixtral config.json without rms_norm_eps and
    rope_theta was read with 1e-6 and 10000 (transformers: 1e-5, 1e6), a Mistral one without sliding_window attended
    past transformers' window of 4096, and a Qwen2-MoE one without moe_intermediate_size was a KeyError traceback."""
    config_cls(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4).save_pretrained(tmp_path)
    body = json.loads((tmp_path / "config.json").read_text())
    body = {k: v for k, v in body.items() if k not in DEFAULTED_KEYS}
    (tmp_path / "config.json").write_text(json.dumps(body))
    theirs = transformers.AutoConfig.from_pretrained(tmp_path)
    ours = hf_config.model_values(body, "config.json", seq_len=4096)
    assert (ours["norm_eps"], ours["rope_theta"], ours["num_kv_heads"], ours["tie_embeddings"]) == \
        (theirs.rms_norm_eps, theirs.rope_parameters["rope_theta"], theirs.num_key_value_heads, theirs.tie_word_embeddings)
    experts = getattr(theirs, "num_local_experts", getattr(theirs, "num_experts", 0))
    assert (ours["moe.num_experts"], ours.get("moe.top_k"), ours["mlp_dim"] * (1 + ours.get("moe.num_shared_experts", 0))) == \
        (experts, getattr(theirs, "num_experts_per_tok", None),
         getattr(theirs, "moe_intermediate_size", theirs.intermediate_size) + getattr(theirs, "shared_expert_intermediate_size", 0))
    if config_cls is transformers.Qwen2MoeConfig:  # top-k weights as the router gives them, unless the file says otherwise
        assert ours["moe.normalize_top_k"] is theirs.norm_topk_prob is False
    if config_cls is transformers.MistralConfig:
        with pytest.raises(hf_config.UserError, match="sliding_window=4096 is shorter than data.seq_len=8192"):
            hf_config.model_values(body, "config.json", seq_len=8192)


@pytest.mark.parametrize("config_cls", [transformers.LlamaConfig, transformers.MistralConfig, transformers.Qwen2Config,
                                        transformers.MixtralConfig, transformers.Qwen2MoeConfig])
def test_a_llama3_rope_without_its_original_context_is_what_transformers_makes_it(config_cls, tmp_path):
    """original_max_position_embeddings (where llama3 scaling starts) left out: transformers takes max_position_embeddings,
    and where that is left out too, the architecture's default (Llama's 2048, Qwen2's 32768...); it was read as 8192."""
    rope = {k: v for k, v in LLAMA3_ROPE.items() if k != "original_max_position_embeddings"}
    config_cls(**SHAPE, rope_parameters=dict(rope)).save_pretrained(tmp_path)  # a copy: transformers fills in the one it is given
    body = json.loads((tmp_path / "config.json").read_text())
    body["rope_parameters"] = rope
    for without in ((), ("max_position_embeddings",)):
        body = {k: v for k, v in body.items() if k not in without}
        (tmp_path / "config.json").write_text(json.dumps(body))
        theirs = transformers.AutoConfig.from_pretrained(tmp_path).rope_parameters["original_max_position_embeddings"]
        assert hf_config.model_values(body, "config.json", SEQ)["rope_scaling.original_max_len"] == theirs


def _edit_config(hf_dir, **changes):
    config = json.loads((hf_dir / "config.json").read_text())
    config.update(changes)
    (hf_dir / "config.json").write_text(json.dumps(config))


def _remove_a_shard(hf_dir):
    name = json.loads((hf_dir / "model.safetensors.index.json").read_text())["weight_map"]["model.layers.1.mlp.up_proj.weight"]
    (hf_dir / name).unlink()
    return {"shard": name}


def _truncate(hf_dir):
    path = hf_dir / "model.safetensors"
    path.write_bytes(path.read_bytes()[:-100])


BAD_INPUT = {
    "missing shard": ("llama3", _remove_a_shard, "{hf_dir}/{shard} is missing (model.safetensors.index.json lists it)"),
    "truncated file": ("llama_tied", _truncate, "model.safetensors is not a complete safetensors file (Error while deserializing header"),
    "tensor of the wrong shape": ("llama_tied", lambda d: _edit_config(d, intermediate_size=96),
                                  "tensor model.layers.0.mlp.gate_proj.weight in {hf_dir}/model.safetensors has shape (64, 32), "
                                  "expected (96, 32) from config.json"),
    "unsupported architecture": ("llama_tied", lambda d: _edit_config(d, architectures=["GPT2LMHeadModel"]),
                                 "architectures=['GPT2LMHeadModel'] is not supported; supported: LlamaForCausalLM"),
    "unsupported rope type": ("llama_tied", lambda d: _edit_config(d, rope_parameters={"rope_type": "yarn", "factor": 4.0}),
                              "rope_scaling.rope_type='yarn' is not supported"),
    "llama3 rope without a factor": ("llama3", lambda d: _edit_config(d, rope_parameters={
        k: v for k, v in LLAMA3_ROPE.items() if k != "low_freq_factor"} | {"factor": "8"}),
        "rope_type llama3 needs numbers factor, low_freq_factor, high_freq_factor; it has factor='8', low_freq_factor=None"),
    "attention bias on a Llama": ("llama_tied", lambda d: _edit_config(d, attention_bias=True), "attention_bias=True is not supported"),
    "activation": ("llama_tied", lambda d: _edit_config(d, hidden_act="gelu"), "hidden_act='gelu' is not supported (only silu"),
    "sliding window shorter than the sequence": ("mistral", lambda d: _edit_config(d, sliding_window=8),
                                                 "sliding_window=8 is shorter than data.seq_len=16"),
    # its second layer attends within the window, which this model does not
    "a Qwen2 layer's window shorter than the sequence": (
        "qwen2_window_unused", lambda d: _edit_config(d, max_window_layers=1, layer_types=["full_attention", "sliding_attention"]),
        "sliding_window=8 is shorter than data.seq_len=16"),
    "model key that disagrees": ("llama_tied", lambda d: None, "model.d_model=64 (experiment or command line) disagrees with hidden_size=32"),
}


@pytest.mark.parametrize("case", BAD_INPUT)
def test_bad_input_is_one_line(case, tmp_path, capsys):
    name, damage, message = BAD_INPUT[case]
    hf_dir = tmp_path / "hf"
    _make_hf_model(hf_dir, name)
    values = damage(hf_dir) or {}
    capsys.readouterr()  # transformers' progress bar
    run_dir = tmp_path / "run"
    extra = ["model.d_model=64"] if case == "model key that disagrees" else []
    assert cli.main(["train", "finetune", "--init-from", str(hf_dir), "--run-dir", str(run_dir), f"data.seq_len={SEQ}", *extra]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("jaxtrain: error: ") and message.format(hf_dir=hf_dir, **values) in lines[0], lines
    assert not run_dir.exists()


def test_a_resume_without_its_init_from_says_to_give_it_again(tmp_path, capsys):
    """The shape of a run started from a Hugging Face model is that model's config.json's: resumed without --init-from,
    finetune's default shape did not match the checkpoint, and the one line only said to "use the model config of that
    run" (a QA report)."""
    hf_dir, run_dir, tokens = tmp_path / "hf", tmp_path / "run", tmp_path / "tokens.npy"
    _make_hf_model(hf_dir, "llama_tied")
    np.save(tokens, np.random.default_rng(1).integers(0, 64, 2000).astype(np.int32))
    args = ["train", "finetune", "--run-dir", str(run_dir), f"data.path={tokens}", f"data.seq_len={SEQ}", "data.val_fraction=0.1",
            "train.global_batch=8", "train.eval_batches=1", "model.dtype=float32", "model.remat=none", "log.progress=false",
            "log.tensorboard=false"]
    assert cli.main([*args, "--init-from", str(hf_dir), "train.steps=1"]) == 0
    before = sorted((p, p.stat().st_mtime_ns) for p in run_dir.rglob("*"))
    capsys.readouterr()
    assert cli.main([*args, "train.steps=2"]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and f"{run_dir} started from a Hugging Face model" in lines[0] and "give --init-from" in lines[0], lines
    assert sorted((p, p.stat().st_mtime_ns) for p in run_dir.rglob("*")) == before




def test_a_resume_from_another_model_directory_says_to_give_the_first_one_again(tmp_path, capsys):
    """Resumed with --init-from another model of the same shape, the run trains on with that config.json's rope_theta, and
    the note's advice to give model.rope_theta=THEN was an error (a key config.json decides disagreed with it; a QA report):
    it says to give the model directory the run started from."""
    hf_dir, other, run_dir, tokens = tmp_path / "hf", tmp_path / "other", tmp_path / "run", tmp_path / "tokens.npy"
    _make_hf_model(hf_dir, "llama_tied")
    _make_hf_model(other, "llama_tied")
    _edit_config(other, rope_parameters={"rope_type": "default", "rope_theta": 500000.0})
    np.save(tokens, np.random.default_rng(1).integers(0, 64, 2000).astype(np.int32))
    args = ["train", "finetune", "--run-dir", str(run_dir), f"data.path={tokens}", f"data.seq_len={SEQ}", "data.val_fraction=0.1",
            "train.global_batch=8", "train.eval_batches=1", "model.dtype=float32", "model.remat=none", "log.progress=false",
            "log.tensorboard=false"]
    assert cli.main([*args, "--init-from", str(hf_dir), "train.steps=1"]) == 0
    capsys.readouterr()
    assert cli.main([*args, "--init-from", str(other), "train.steps=2"]) == 0
    notes = [line for line in capsys.readouterr().err.splitlines() if line.startswith("jaxtrain: note: model.rope_theta=500000.0")]
    assert len(notes) == 1 and notes[0].endswith(f"give --init-from the model directory the run started from (its config.json is "
                                                 f"kept in {run_dir / 'hf'}) to continue as before"), notes

def test_fine_tuning_past_the_source_models_context_says_so(tmp_path, capsys):
    """A model of max_position_embeddings 8 fine-tuned at data.seq_len 16 trains on positions its source never saw: a QA
    report, nothing said so. One note on the first start, none on a resume, none within the source's context."""
    hf_dir, run_dir, tokens = tmp_path / "hf", tmp_path / "run", tmp_path / "tokens.npy"
    _make_hf_model(hf_dir, "llama_tied")
    np.save(tokens, np.random.default_rng(1).integers(0, 64, 2000).astype(np.int32))
    args = ["train", "finetune", "--run-dir", str(run_dir), "--init-from", str(hf_dir), f"data.path={tokens}",
            "data.val_fraction=0.1", "train.global_batch=8", "train.eval_batches=1", "model.dtype=float32", "model.remat=none",
            "log.progress=false", "log.tensorboard=false"]

    def notes(*extra):
        capsys.readouterr()
        assert cli.main([*args, *extra]) == 0
        return [line for line in capsys.readouterr().err.splitlines() if "max_position_embeddings" in line]

    _edit_config(hf_dir, max_position_embeddings=SEQ // 2)
    assert notes(f"data.seq_len={SEQ}", "train.steps=1") == [
        f"jaxtrain: note: data.seq_len={SEQ} is longer than {hf_dir}'s max_position_embeddings={SEQ // 2}: the model trains on "
        f"positions its source was not trained on, with its rope unchanged; generate and export-hf take {SEQ} positions as "
        "this run's context"]
    assert notes(f"data.seq_len={SEQ}", "train.steps=2") == []
    shutil.rmtree(run_dir)
    assert notes(f"data.seq_len={SEQ // 2}", "train.steps=1") == []


REFUSED = {  # config.json values this model would load without reproducing: refused, not read as another model
    "mlp_bias": ({"mlp_bias": True}, "mlp_bias=True is not supported (MLP without biases only)"),
    "partial rotary (transformers 4)": ({"partial_rotary_factor": 0.5}, "partial_rotary_factor=0.5 is not supported"),
    "partial rotary (transformers 5)": ({"rope_parameters": {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5}},
                                        "partial_rotary_factor=0.5 is not supported"),
    # older files name the scaling "type": a linear one read as no scaling was another model
    "linear scaling in the older type key": ({"rope_scaling": {"type": "linear", "factor": 2.0}},
                                             "rope_scaling.rope_type='linear' is not supported"),
    "a Qwen2-MoE with dense layers": ({"architectures": ["Qwen2MoeForCausalLM"], "mlp_only_layers": [0]},
                                      "decoder_sparse_step / mlp_only_layers=(None, [0]) is not supported"),
    "a Qwen2-MoE with every other layer sparse": ({"architectures": ["Qwen2MoeForCausalLM"], "decoder_sparse_step": 2},
                                                  "decoder_sparse_step / mlp_only_layers=(2, None) is not supported"),
    # a quantized checkpoint (AWQ, GPTQ, FP8, bitsandbytes) packs its weights into other tensors: they were named as missing
    # or misshapen, as if the files did not match config.json (a QA report)
    "a quantized checkpoint": ({"quantization_config": {"quant_method": "awq", "bits": 4}},
                               "quantization_config.quant_method='awq' is not supported (weights in BF16, F16 or F32 only"),
}


@pytest.mark.parametrize("case", REFUSED)
def test_config_values_this_model_cannot_reproduce_are_refused(case):
    changes, message = REFUSED[case]
    with pytest.raises(hf_config.UserError, match=re.escape(message)):
        hf_config.model_values({"architectures": ["LlamaForCausalLM"], **SHAPE, **changes}, "config.json", seq_len=SEQ)


def test_older_config_dialects_read_as_transformers_reads_them():
    """The older llama3 scaling key "type"; transformers 4's Qwen2 config.json, which has no layer_types: the layers from
    max_window_layers on attend within sliding_window (with use_sliding_window): max_window_layers = num_hidden_layers
    windows no layer, max_window_layers = 1 the second (refused at a longer sequence)."""
    llama3 = {"type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 512}
    values = hf_config.model_values({"architectures": ["LlamaForCausalLM"], **SHAPE, "rope_scaling": llama3}, "config.json", SEQ)
    assert (values["rope_scaling.type"], values["rope_scaling.factor"], values["rope_scaling.original_max_len"]) == ("llama3", 8.0, 512)
    qwen2 = {"architectures": ["Qwen2ForCausalLM"], **SHAPE, "use_sliding_window": True, "sliding_window": 8}
    assert hf_config.model_values(qwen2 | {"max_window_layers": 2}, "config.json", seq_len=SEQ)["num_layers"] == 2
    assert hf_config.model_values(qwen2 | {"max_window_layers": 1, "use_sliding_window": False}, "config.json", seq_len=SEQ)
    with pytest.raises(hf_config.UserError, match="sliding_window=8 is shorter than data.seq_len=16"):
        hf_config.model_values(qwen2 | {"max_window_layers": 1}, "config.json", seq_len=SEQ)


def test_weight_files_that_do_not_hold_what_the_index_or_config_says_are_one_line(tmp_path):
    """A tensor the index places in a shard that lacks it, or leaves out, and a dtype this model does not read: a
    UserError naming the tensor and the file, not a safetensors traceback, nor a KeyError from the dtype table later."""
    from safetensors.numpy import save_file

    tm = TensorMap(("final_norm", "scale"), "model.norm.weight", (4,), (4,), (0,))
    shard = tmp_path / "model-00001-of-00001.safetensors"
    save_file({"other.weight": np.ones(4, np.float32)}, shard)
    for weight_map, where in (({"model.norm.weight": shard.name}, shard), ({"other.weight": shard.name}, tmp_path / INDEX_FILE)):
        (tmp_path / INDEX_FILE).write_text(json.dumps({"weight_map": weight_map}))
        with Checkpoint(tmp_path) as checkpoint, pytest.raises(hf_config.UserError, match=(
                f"^tensor model.norm.weight is missing from {where}; the model directory does not match its config.json$")):
            checkpoint.check([tm])
    save_file({"model.norm.weight": np.ones(4, np.float64)}, shard)
    (tmp_path / INDEX_FILE).write_text(json.dumps({"weight_map": {"model.norm.weight": shard.name}}))
    with Checkpoint(tmp_path) as checkpoint, pytest.raises(hf_config.UserError, match=(
            f"^tensor model.norm.weight in {shard} has dtype F64; supported: F32, BF16, F16$")):
        checkpoint.check([tm])


def test_weights_saved_as_pytorch_pickles_say_how_to_convert_them(tmp_path):
    """pytorch_model.bin without safetensors (transformers' older format): one line naming the files and how to save them as
    safetensors; it said to give a directory "with its weights", which this one has (a QA report)."""
    (tmp_path / "pytorch_model-00001-of-00002.bin").write_bytes(b"")
    (tmp_path / "pytorch_model-00002-of-00002.bin").write_bytes(b"")
    with pytest.raises(hf_config.UserError, match=re.escape(
            f"{tmp_path} has its weights as PyTorch pickles (pytorch_model-00001-of-00002.bin, pytorch_model-00002-of-00002.bin), "
            "which jaxtrain does not read; save them as safetensors")):
        Checkpoint(tmp_path)


def test_a_single_file_beside_shards_is_read_as_transformers_reads_it(hf_models, tmp_path):
    """model.safetensors beside model.safetensors.index.json and its shards (another save into the same directory):
    transformers loads model.safetensors, and so does the import (it read the shards: another model)."""
    import shutil

    from safetensors.numpy import save_file

    hf_dir = tmp_path / "hf"
    shutil.copytree(hf_models["llama3"][0], hf_dir)
    weights = {}
    for name in set(json.loads((hf_dir / INDEX_FILE).read_text())["weight_map"].values()):
        with safe_open(hf_dir / name, "np") as f:
            weights |= {key: -f.get_tensor(key) for key in f.keys()}
    save_file(weights, hf_dir / "model.safetensors", metadata={"format": "pt"})
    cfg = _config(hf_dir, mesh=(1, 1, 1))
    layout = make_layout(cfg, jax.devices()[:1])
    ours = _our_logits(layout, hf_import.load_params(hf_dir, cfg.model, layout.abstract_state().params))
    _assert_close(ours, _hf_logits(transformers.AutoModelForCausalLM.from_pretrained(hf_dir)))


def test_shards_hold_consecutive_tensors_up_to_the_limit():
    """A tensor that would take a shard past max_bytes starts the next one; one larger than max_bytes has a shard of its own."""
    tensors = [hf_export.Tensor(TensorMap((str(i),), f"t{i}", (n,), (n,), (0,))) for i, n in enumerate((10, 3, 3, 3, 5, 1))]
    shards = hf_export.plan_shards(tensors, np.dtype("float32"), max_bytes=24)  # 24 bytes: 6 float32
    assert [[t.tm.hf_shape[0] for t in shard] for shard in shards] == [[10], [3, 3], [3], [5, 1]]


def test_a_block_split_within_every_dimension_reads_those_rows_and_columns(tmp_path):
    """A device's block of an attention projection split in every dimension (a --rules file may split head_dim, which
    no shipped rule set does): the rows and columns of our layout, as the torch weight reshaped by hand."""
    from safetensors.numpy import save_file

    heads, head_dim, d = 4, 6, 5
    torch_q = np.arange(heads * head_dim * d, dtype=np.float32).reshape(heads * head_dim, d)  # (heads * head_dim, d_model)
    torch_o = torch_q.T.copy()  # (d_model, heads * head_dim)
    save_file({"q": torch_q, "o": torch_o}, tmp_path / "model.safetensors")
    ours_q = torch_q.reshape(heads, head_dim, d).transpose(2, 0, 1)  # (d_model, heads, head_dim)
    ours_o = torch_o.reshape(d, heads, head_dim).transpose(1, 2, 0)  # (heads, head_dim, d_model)
    q = TensorMap(("wq",), "q", (heads * head_dim, d), (heads, head_dim, d), (2, 0, 1))
    o = TensorMap(("wo",), "o", (d, heads * head_dim), (d, heads, head_dim), (1, 2, 0))
    with Checkpoint(tmp_path) as checkpoint:
        block = (slice(1, 4), slice(1, 3), slice(2, 5))
        np.testing.assert_array_equal(q.read_block(checkpoint, block, ours_q.shape, np.float32), ours_q[block])
        block = (slice(2, 4), slice(3, 6), slice(0, 2))
        np.testing.assert_array_equal(o.read_block(checkpoint, block, ours_o.shape, np.float32), ours_o[block])


def test_shard_writer_writes_a_tensor_larger_than_a_chunk_a_few_rows_at_a_time(tmp_path, monkeypatch):
    """A tensor over WRITE_CHUNK_BYTES is written a few rows at a time (the other tests' tensors fit one chunk): with 3-row
    chunks, a transposed (strided) 37-row tensor and the one after it read back exactly; the header is 8-byte aligned and
    carries the format transformers 4 requires."""
    monkeypatch.setattr(hf_export, "WRITE_CHUNK_BYTES", 3 * 5 * 4)  # 3 rows of 5 float32
    ours = np.arange(5 * 37, dtype=np.float32).reshape(5, 37)  # our (in, out) layout of a (37, 5) torch weight
    maps = [TensorMap(("w",), "w.weight", (37, 5), (37, 5), (1, 0)), TensorMap(("b",), "b.weight", (4,), (4,), (0,))]
    path = tmp_path / "model.safetensors"
    writer = hf_export.ShardWriter(path, [hf_export.Tensor(tm) for tm in maps], np.dtype("float32"))
    writer.write(maps[0].hf_order(ours))
    writer.write(np.arange(4, dtype=np.float32))
    writer.close()
    with safe_open(path, "np") as f:
        np.testing.assert_array_equal(f.get_tensor("w.weight"), ours.T)
        np.testing.assert_array_equal(f.get_tensor("b.weight"), np.arange(4, dtype=np.float32))
        assert f.metadata() == {"format": "pt"}
    assert int.from_bytes(path.read_bytes()[:8], "little") % 8 == 0


def test_an_export_that_fails_leaves_no_directory(hf_models, tmp_path, monkeypatch):
    """Stopped after the weights (a full disk writing config.json): neither DIR nor DIR.partial is left."""
    hf_dir = hf_models["llama_tied"][0]
    cfg = _config(hf_dir, mesh=(1, 1, 1))
    layout = make_layout(cfg, jax.devices()[:1])
    params = hf_import.load_params(hf_dir, cfg.model, layout.abstract_state().params)

    def disk_full(directory, *args):
        assert (directory / "model.safetensors").is_file()  # the weights were written
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(hf_export, "_write_metadata", disk_full)
    with pytest.raises(hf_config.UserError) as failed:  # until 2026-12-06 the OSError's traceback
        hf_export.write_model(params, cfg, tmp_path / "out", "float32", source_dir=hf_dir)
    assert str(failed.value) == (f"could not write model directory {tmp_path / 'out'}: the disk is full (No space left on device); "
                                 f"{tmp_path / 'out.partial'} is removed; free space there or write elsewhere")
    assert list(tmp_path.iterdir()) == []



def test_an_export_directory_that_cannot_be_made_is_one_line(tmp_path, monkeypatch):
    """Where access(2) lets --out pass but mkdir fails (a quota or full disk; /proc, to root), the model and the adapter
    export stopped with mkdir's traceback (a QA report), where train's --run-dir is one line."""
    hf_dir, out = tmp_path / "hf", tmp_path / "out"
    _make_hf_model(hf_dir, "llama_tied")
    cfg = _config(hf_dir, mesh=(1, 1, 1))

    def over_quota(self, *args, **kwargs):
        raise OSError(errno.EDQUOT, os.strerror(errno.EDQUOT))

    monkeypatch.setattr(Path, "mkdir", over_quota)
    for export in (lambda: hf_export.write_model({}, cfg, out, "float32"), lambda: peft_io.write_adapter({}, cfg.model, out, None, {})):
        with pytest.raises(hf_config.UserError, match=re.escape(f"--out {out}: cannot make the directory {out}.partial (Disk quota")):
            export()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"]

def test_an_adapter_export_the_disk_refuses_is_one_line_and_leaves_nothing(tmp_path):
    """A QA report: `export-hf --adapter-only` onto a full disk was a traceback of the safetensors library's own
    SafetensorError; now one line, OUT.partial removed. A file size limit of 0 bytes stands in for the full disk (Python
    ignores SIGXFSZ, so the write fails with EFBIG), in this process only while the adapter is written."""
    out = tmp_path / "adapter"
    limits = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (0, limits[1]))
    try:
        with pytest.raises(hf_config.UserError) as failed:
            peft_io.write_adapter({}, small_config().model, out, None, {})
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, limits)
    assert str(failed.value) == (f"could not write adapter directory {out}: the file would pass the file size limit (ulimit -f) "
                                 f"(File too large); {out}.partial is removed; raise the limit or write elsewhere")
    assert list(tmp_path.iterdir()) == []


def test_a_sigterm_during_export_leaves_no_directory(tmp_path, monkeypatch):
    """A SIGTERM (a scheduler's time limit) after the weights are written: status 143 through the export's cleanup, and
    no OUT.partial left with its shards (SIGTERM's default action killed the process and left them)."""
    from jaxtrain.data import Corpus
    from jaxtrain.train import build, train

    text = np.frombuffer(b"the quick brown fox. " * 40, np.uint8)
    cfg = with_(small_config(vocab_size=256), train={"steps": 1}, log={"peak_tflops": 1.0, "tensorboard": False, "layer_every": 0})
    run_dir, out = tmp_path / "run", tmp_path / "out"
    train(cfg, run_dir, build(cfg, Corpus(text, text[:200], 256, "a sentence")))

    def terminated(directory, *args):
        assert (directory / "model.safetensors").is_file()
        os.kill(os.getpid(), signal.SIGTERM)

    monkeypatch.setattr(hf_export, "_write_metadata", terminated)
    ignored = signal.signal(signal.SIGTERM, lambda *_: None)  # where the export does not take SIGTERM, it changes nothing here
    try:
        with pytest.raises(SystemExit) as exited:
            cli.main(["export-hf", str(run_dir), "--out", str(out)])
    finally:
        signal.signal(signal.SIGTERM, ignored)
    assert exited.value.code == 143
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]


def test_the_tokenizer_files_transformers_saves_are_kept_for_the_export(tmp_path):
    """Every file a transformers tokenizer saves is kept in RUN_DIR/hf/, from where export-hf copies them: with its
    tokenizer_config.json (special tokens) and chat template, the run's export chats as the source model did."""
    import tokenizers

    hf_dir, run_dir = tmp_path / "hf", tmp_path / "run"
    words = tokenizers.models.WordLevel({"<s>": 0, "</s>": 1, "hi": 2, "[UNK]": 3}, unk_token="[UNK]")
    source = transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizers.Tokenizer(words), bos_token="<s>", eos_token="</s>",
                                                  chat_template="{{ messages[0]['content'] }}")
    source.save_pretrained(hf_dir)
    hf_import.keep_source_files(hf_dir, run_dir)
    assert sorted(p.name for p in (run_dir / "hf").iterdir()) == sorted(p.name for p in hf_dir.iterdir())
    kept = transformers.AutoTokenizer.from_pretrained(run_dir / "hf")
    assert (kept.chat_template, kept.bos_token, kept.eos_token) == (source.chat_template, "<s>", "</s>")


def test_a_from_scratch_export_without_tokenizer_files_knows_its_token_ids(tmp_path):
    cfg = small_config()
    assert hf_export.token_ids(cfg, {}) == {"bos_token_id": 0, "eos_token_id": 0}  # byte-level text: the NUL separator
    # token ids from no known tokenizer: unknown, rather than transformers' default 1 and 2
    assert hf_export.token_ids(with_(cfg, data={"path": str(tmp_path / "tokens.bin")}), {}) == {"bos_token_id": None, "eos_token_id": None}


def test_export_refuses_an_existing_directory(tmp_path, capsys):
    out = tmp_path / "out"
    out.mkdir()
    (tmp_path / "run").mkdir()
    save_yaml(Config(), tmp_path / "run" / "config.yaml")
    assert cli.main(["export-hf", str(tmp_path / "run"), "--out", str(out)]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines == [f"jaxtrain: error: --out {out} already exists; give a new directory (export-hf never overwrites)"]
    assert list(out.iterdir()) == []


def test_export_of_a_run_without_checkpoints_names_the_run(tmp_path, capsys):
    """The message names what the user gave (the run directory), not --init-from, whose code path export-hf shares."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    save_yaml(Config(), run_dir / "config.yaml")
    assert cli.main(["export-hf", str(run_dir), "--out", str(tmp_path / "out")]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines == [f"jaxtrain: error: jaxtrain export-hf {run_dir}: no checkpoints there yet; train the run until it saves one "
                     "(every checkpoint.every steps, and at its last step)"], lines
    assert not list(tmp_path.glob("out*"))


# the fields of the published config.json files (meta-llama/Llama-3.2-1B, -3B, Llama-3.1-8B, -70B, -405B,
# mistralai/Mixtral-8x7B-v0.1, Mixtral-8x22B-v0.1) that decide the model's function
LLAMA3 = dict(vocab_size=128256, rms_norm_eps=1e-5, tie_word_embeddings=False,
              rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                               "high_freq_factor": 4.0, "original_max_position_embeddings": 8192})
LLAMA3_2 = LLAMA3 | dict(tie_word_embeddings=True, rope_parameters=LLAMA3["rope_parameters"] | {"factor": 32.0})
LLAMA3_1_8B = LLAMA3 | dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                            num_key_value_heads=8, head_dim=128)
LLAMA3_1_70B = LLAMA3 | dict(hidden_size=8192, intermediate_size=28672, num_hidden_layers=80, num_attention_heads=64,
                             num_key_value_heads=8, head_dim=128)
LLAMA3_1_405B = LLAMA3 | dict(hidden_size=16384, intermediate_size=53248, num_hidden_layers=126, num_attention_heads=128,
                              num_key_value_heads=8, head_dim=128)
MIXTRAL = dict(rms_norm_eps=1e-5, tie_word_embeddings=False, rope_parameters={"rope_type": "default", "rope_theta": 1e6},
               sliding_window=None, num_local_experts=8, num_experts_per_tok=2, num_key_value_heads=8, head_dim=128)
MIXTRAL_8X7B = MIXTRAL | dict(vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                              num_attention_heads=32)
PUBLISHED = {
    "llama3_1b": LLAMA3_2 | dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                                 num_key_value_heads=8, head_dim=64),
    "llama3_3b": LLAMA3_2 | dict(hidden_size=3072, intermediate_size=8192, num_hidden_layers=28, num_attention_heads=24,
                                 num_key_value_heads=8, head_dim=128),
    "llama3_8b": LLAMA3_1_8B, "llama3_8b_lora": LLAMA3_1_8B,
    "llama3_70b": LLAMA3_1_70B, "llama3_70b_qlora": LLAMA3_1_70B,
    "llama3_405b": LLAMA3_1_405B, "llama3_405b_pp": LLAMA3_1_405B,
    "mixtral_8x7b": MIXTRAL_8X7B, "mixtral_8x7b_lora": MIXTRAL_8X7B,
    "mixtral_8x22b": MIXTRAL | dict(vocab_size=32768, hidden_size=6144, intermediate_size=16384, num_hidden_layers=56,
                                    num_attention_heads=48),
}


@pytest.mark.parametrize("name", PUBLISHED)
def test_experiments_export_the_config_of_the_model_they_are_named_after(name):
    """What transformers reads from the config.json `jaxtrain export-hf` writes for each experiment is the published
    model's: Llama 3.1's and 3.2's llama3 rope scaling had been left out (trained and exported as Llama 3.0's rope)."""
    cfg = load_experiment(name)
    body = hf_config.export_config(cfg.model, "bfloat16", cfg.data.seq_len)
    read = transformers.AutoConfig.for_model(**body)
    assert {key: getattr(read, key) for key in PUBLISHED[name]} == PUBLISHED[name]
    if read.rope_parameters.get("rope_type") == "llama3":  # transformers warned where data.seq_len < 8192
        assert read.max_position_embeddings == max(cfg.data.seq_len, read.rope_parameters["original_max_position_embeddings"])
