"""Generation with a key/value cache: equal to re-running the whole forward, on one device and on the
cpu8 mesh; prefill equal to the training forward; seeded sampling; the command line end to end."""

import dataclasses
import functools
import json
import re
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from conftest import REPO, run_cli, small_config, with_
from jaxtrain import compile_cache
from jaxtrain.config import SamplingConfig
from jaxtrain.generate import Loaded, _knobs, _sample_at, generate, nucleus, sample
from jaxtrain.partitioning import model_tracing
from jaxtrain.state import init_state, model_spec
from jaxtrain.layout import make_layout
from jaxtrain.models.config import LoraConfig, MoEConfig, RopeScaling
from jaxtrain.models.llama import KVCache

NEW_TOKENS = 32
# init_std 0.3: decisive logits, so the greedy continuation is far from ties and varied
MODEL = {"init_std": 0.3, "vocab_size": 64}


@functools.lru_cache
def _loaded(rules, mesh, devices: int, experts: int = 0, dispatch: str = "dropless") -> Loaded:
    """A random model placed with the rule set's shardings (built once per module); ``experts``: a mixture of that
    many experts (top-2, routed by ``dispatch``; capacity: as many slots as the fair share) in place of each MLP."""
    moe = {"moe": MoEConfig(num_experts=experts, top_k=2, dispatch=dispatch, capacity_factor=1.0), "mlp_dim": 16} if experts else {}
    cfg = small_config(rules, mesh, **MODEL, **moe)
    layout = make_layout(cfg, jax.devices()[:devices])
    params = init_state(cfg.model, layout.tx, 0, layout.shardings).params
    return Loaded(cfg.model, params, layout.mesh, cfg.mesh, layout.rules, cfg.rules, encode=None, decode=None)


def _prompts(batch, length=5) -> np.ndarray:
    return np.random.default_rng(1).integers(0, MODEL["vocab_size"], (batch, length)).astype(np.int32)


def _argmax(logits: np.ndarray, index: int) -> np.ndarray:
    return np.argmax(logits, axis=-1)


def _without_cache(loaded: Loaded, prompts: np.ndarray, pick=_argmax) -> np.ndarray:
    """The whole forward re-run on the growing sequence, new token number ``index`` picked from the last position's
    logits by ``pick(logits, index)`` each time (greedy by default; one compiled shape: the sequence padded to its
    final length; causal attention ignores the padding)."""
    graphdef = model_spec(loaded.model_cfg).graphdef
    forward = jax.jit(lambda params, tokens: nnx.merge(graphdef, params)(tokens))
    params = jax.device_get(loaded.params)  # one device, no sharding rules: the plain model
    batch, length = prompts.shape
    sequence = np.zeros((batch, length + NEW_TOKENS), np.int32)
    sequence[:, :length] = prompts
    for position in range(length, length + NEW_TOKENS):
        sequence[:, position] = pick(np.asarray(forward(params, sequence))[:, position - 1], position - length)
    return sequence[:, length:]


# the mixture of experts: 4 prompts fill the batch's fsdp x expert shards, so prefill and each decoding step take
# dropless dispatch's per-device path (jaxtrain/models/moe.py)
@pytest.mark.parametrize("rules, mesh, devices, batch, experts", [
    ("dp", (1, 1, 1), 1, 2, 0), ("fsdp_tp", (2, 2, 2), 8, 4, 0), ("fsdp_tp_ep", (1, 2, 2, 1, 2), 8, 4, 4)])
def test_greedy_with_cache_equals_full_forward(rules, mesh, devices, batch, experts):
    loaded = _loaded(rules, mesh, devices, experts)
    prompts = _prompts(batch)
    out = generate(loaded, prompts, SamplingConfig(max_new_tokens=NEW_TOKENS))
    assert out.tokens.shape == (batch, NEW_TOKENS)
    assert len(np.unique(out.tokens)) > 8  # a varied continuation, not one token repeated
    np.testing.assert_array_equal(out.tokens, _without_cache(loaded, prompts))
    assert out.prefill_tokens_per_s > 0 and out.decode_tokens_per_s > 0


def test_a_capacity_routed_model_generates_routing_every_token():
    """Capacity dispatch drops an assignment by its whole sequence's routing, later tokens included, which decoding
    has not made yet: the prefill dropped some of the prompt's assignments, each decoding step none, and the greedy
    tokens were neither the capacity-routed forward's (they parted after 1 or 2 tokens) nor the dropless one's (52 of
    64 differed). Every token is routed: the same weights' tokens routed dropless, with the cache or without."""
    capacity, dropless = (_loaded("dp", (1, 1, 1), 1, 4, dispatch) for dispatch in ("capacity", "dropless"))
    prompts = _prompts(2, 12)
    out = generate(capacity, prompts, SamplingConfig(max_new_tokens=NEW_TOKENS))
    np.testing.assert_array_equal(out.tokens, _without_cache(dropless, prompts))


def test_decoding_ends_once_every_sequence_has_made_its_stop_token():
    """A model's end of text (``Loaded.stops``): decoding ran on to --max-new-tokens after it (a QA report). A sequence
    holds the stop token after its own; the steps end when the last sequence has made it."""
    loaded = _loaded("dp", (1, 1, 1), 1)
    for batch in (1, 2):
        prompts = _prompts(batch)
        greedy = generate(loaded, prompts, SamplingConfig(max_new_tokens=NEW_TOKENS)).tokens
        stop = int(greedy[0, 1])  # early in the first sequence; in a second (the seeded model's), not at all
        ends = [list(row).index(stop) if stop in row else NEW_TOKENS - 1 for row in greedy]
        out = generate(loaded, prompts, SamplingConfig(max_new_tokens=NEW_TOKENS), stops=(stop,))
        expected = [np.concatenate([row[:end + 1], np.full(NEW_TOKENS - end - 1, stop)])
                    for row, end in zip(greedy, ends, strict=True)]
        np.testing.assert_array_equal(out.tokens, np.stack(expected))
        assert out.decode_steps == max(ends) and (batch > 1 or out.decode_steps <= 1)
        assert out.decode_tokens_per_s == pytest.approx(batch * out.decode_steps / out.decode_s)
    # several stop tokens (an instruct model's end of text and end of turn): each sequence ends at the first it makes
    # and holds that one
    stops = (int(greedy[1, 2]), int(greedy[0, 1]))
    ends = [min(list(row).index(s) for s in stops if s in row) for row in greedy]
    out = generate(loaded, prompts, SamplingConfig(max_new_tokens=NEW_TOKENS), stops=stops)
    held = [row[end] for row, end in zip(greedy, ends, strict=True)]
    assert held[0] != held[1]
    np.testing.assert_array_equal(out.tokens, np.stack([np.concatenate([row[:end + 1], np.full(NEW_TOKENS - end - 1, row[end])])
                                                        for row, end in zip(greedy, ends, strict=True)]))
    assert out.decode_steps == max(ends)


def test_a_first_new_token_that_is_the_stop_token_ends_generation_without_decoding():
    """The prefill makes each sequence's first token: where that is the stop token, no decoding step runs and the
    sequence holds it throughout (a stop looked for only in the decoding steps' own tokens decoded on past it)."""
    loaded = _loaded("dp", (1, 1, 1), 1)
    prompts = _prompts(1)
    stop = int(generate(loaded, prompts, SamplingConfig(max_new_tokens=NEW_TOKENS)).tokens[0, 0])
    out = generate(loaded, prompts, SamplingConfig(max_new_tokens=NEW_TOKENS), stops=(stop,))
    assert out.decode_steps == 0
    np.testing.assert_array_equal(out.tokens, np.full((1, NEW_TOKENS), stop))


def test_prefill_logits_equal_training_forward():
    loaded = _loaded("fsdp_tp", (2, 2, 2), 8)
    cfg, prompts = loaded.model_cfg, _prompts(4, 12)
    graphdef = model_spec(cfg).graphdef

    def prefill_logits(params, tokens):
        model = nnx.merge(graphdef, params)
        hidden, cache = model.extend(tokens, KVCache.zeros(cfg, tokens.shape[0], tokens.shape[1] + 7))
        return model.logits(hidden), cache.length

    with model_tracing(loaded.mesh, loaded.rules, "fsdp_tp"):
        logits, length = jax.jit(prefill_logits)(loaded.params, prompts)
        reference = jax.jit(lambda params, tokens: nnx.merge(graphdef, params)(tokens))(loaded.params, prompts)
    assert int(length) == 12
    np.testing.assert_allclose(logits, reference, rtol=1e-5, atol=1e-5)


def test_nucleus_keeps_the_smallest_set_reaching_top_p():
    logits = jnp.log(jnp.array([[0.05, 0.5, 0.15, 0.3]]))
    kept = lambda top_p: np.isfinite(np.asarray(nucleus(logits, top_p)))[0].tolist()  # noqa: E731
    assert kept(0.5) == [False, True, False, False]  # the most likely token alone reaches 0.5
    assert kept(0.7) == [False, True, False, True]
    assert kept(0.96) == [True, True, True, True]
    assert kept(1e-9) == [False, True, False, False]
    assert kept(1e-40) == [False, True, False, False]  # below float32's normal numbers, which XLA:CPU reads as 0 (kept none)
    # sampled frequencies follow the renormalised nucleus: 0.5 / 0.8 and 0.3 / 0.8
    draws = sample(jnp.tile(logits, (20000, 1)), jax.random.key(0), jnp.float32(1.0), jnp.float32(0.7))
    np.testing.assert_allclose(np.bincount(np.asarray(draws), minlength=4) / 20000, [0, 0.625, 0, 0.375], atol=0.015)


def test_temperature_scales_the_logits_before_top_p_chooses_the_nucleus():
    """At temperature 2 the probabilities flatten to sqrt(p) renormalised, so top-p 0.7 keeps three tokens, not the two it
    keeps at temperature 1; the draws follow that nucleus renormalised (numpy by hand). At temperature 1 (the other
    sampling tests) a temperature dropped, or applied after the nucleus, goes unseen."""
    p = np.array([0.05, 0.5, 0.15, 0.3])
    flat = np.sqrt(p) / np.sqrt(p).sum()  # softmax(log p / 2)
    expected = np.where(np.arange(4) == 0, 0, flat) / flat[1:].sum()  # 0.379 + 0.294 < 0.7: the 0.208 token is kept too
    draws = sample(jnp.tile(jnp.log(jnp.asarray(p)), (20000, 1)), jax.random.key(0), jnp.float32(2.0), jnp.float32(0.7))
    np.testing.assert_allclose(np.bincount(np.asarray(draws), minlength=4) / 20000, expected, atol=0.015)


def test_each_new_token_is_drawn_with_its_own_key():
    """One key for every step would draw the same noise each time: from equal logits, the same token at every position."""
    logits = jnp.zeros((2000, 64))
    knobs = _knobs(SamplingConfig(temperature=1.0, seed=7))
    first, second = (np.asarray(_sample_at(logits, knobs, index)) for index in (0, 1))
    assert np.mean(first == second) < 0.05  # independent draws agree 1 time in 64


def test_seeded_sampling_is_reproducible_and_tiny_top_p_is_greedy():
    loaded = _loaded("dp", (1, 1, 1), 1)
    prompts = _prompts(2)
    run = lambda **kw: generate(loaded, prompts, SamplingConfig(max_new_tokens=16, **kw)).tokens  # noqa: E731
    first = run(temperature=1.0, seed=3)
    np.testing.assert_array_equal(run(temperature=1.0, seed=3), first)
    assert not np.array_equal(run(temperature=1.0, seed=4), first)
    greedy = run()
    assert not np.array_equal(first, greedy)
    np.testing.assert_array_equal(run(temperature=1.0, top_p=1e-6, seed=5), greedy)


def test_each_sampled_token_is_its_own_keys_draw_from_the_models_logits():
    """New token number i is ``_sample_at(logits, knobs, i)`` of the whole forward's logits at its position: the prefill
    draws token 0, the decoding steps 1, 2, ... (with the first step's key in the prefill as well, the first two tokens
    shared their noise, and every other test still passed). Temperature 3 flattens the decisive logits, so the draws vary."""
    loaded = _loaded("dp", (1, 1, 1), 1)
    prompts = _prompts(2)
    sampling = SamplingConfig(max_new_tokens=NEW_TOKENS, temperature=3.0, top_p=0.9, seed=11)
    knobs = _knobs(sampling)
    out = generate(loaded, prompts, sampling)
    expected = _without_cache(loaded, prompts, lambda logits, index: np.asarray(_sample_at(jnp.asarray(logits), knobs, index)))
    assert not np.array_equal(expected, _without_cache(loaded, prompts))  # not greedy
    np.testing.assert_array_equal(out.tokens, expected)


@pytest.mark.parametrize("top_p", [1.0, 0.9])
def test_a_tiny_temperature_samples_the_most_likely_token(top_p):
    """Any positive temperature is allowed: divided by 2e-38 logits above 6.8 overflowed to inf and tied, and the draw
    was the first of them (with top-p, nan probabilities), where a temperature near 0 means the most likely token.
    (Below float32's smallest normal number, 1.2e-38, XLA:CPU reads a temperature as 0: greedy.)"""
    logits = jnp.array([[29.0, 30.0, 1.0, 2.0], [1.0, 2.0, 30.0, 29.0]])
    draws = sample(logits, jax.random.key(0), jnp.float32(2e-38), jnp.float32(top_p))
    np.testing.assert_array_equal(draws, [1, 2])


@pytest.fixture(scope="module")
def byte_run(tmp_path_factory):
    """A byte-level run (vocab 256, 32 positions, cpu8 mesh, fsdp_tp) trained for 3 steps on a repeated sentence."""
    from jaxtrain.data import Corpus
    from jaxtrain.train import build, train

    text = np.frombuffer(b"the quick brown fox jumps over the lazy dog. " * 60, np.uint8)
    cfg = with_(small_config(vocab_size=256), data={"seq_len": 32}, train={"steps": 3},
                log={"peak_tflops": 1.0, "tensorboard": False, "layer_every": 0})
    run_dir = tmp_path_factory.mktemp("generate") / "run"
    train(cfg, run_dir, build(cfg, Corpus(text, text[:400], 256, "a sentence")))
    return run_dir


@pytest.mark.parametrize("rank", [0, 4])
def test_a_run_generates_and_exports_onto_a_mesh_with_more_batch_shards_than_its_batch(rank, tmp_path):
    """A run trained with 2 sequences a step on one device, read onto cpu8 (data 2 x fsdp 2: 4 batch shards) by generate
    and export-hf, which read no training batch: both were refused with the training batch's error, which neither command
    can change (a QA report; so was generate BASE --adapter RUN onto the base's mesh). The greedy tokens are those of
    rule set tp there, whose 2 batch shards split the batch. rank 4: a LoRA run (export-hf's adapters)."""
    from jaxtrain.adapt import lora
    from jaxtrain.config import load_mesh_file, load_run_config
    from jaxtrain.data import Corpus
    from jaxtrain.generate import load
    from jaxtrain.interop import hf_export
    from jaxtrain.train import build, train

    text = np.frombuffer(b"the quick brown fox jumps over the lazy dog. " * 20, np.uint8)
    cfg = with_(small_config(mesh=(1, 1, 1), vocab_size=256, lora=LoraConfig(rank=rank)), train={"steps": 1, "global_batch": 2},
                log={"tensorboard": False, "layer_every": 0})
    run_dir = tmp_path / "run"
    train(cfg, run_dir, build(cfg, Corpus(text, text[:200], 256, "a sentence"), jax.devices()[:1]))
    prompt, sampling = np.array([list(b"the")]), SamplingConfig(max_new_tokens=8)
    wide = load(run_dir, mesh="cpu8")
    assert wide.mesh.size == 8
    expected = generate(load(run_dir, mesh="cpu8", rules="tp"), prompt, sampling).tokens
    np.testing.assert_array_equal(generate(wide, prompt, sampling).tokens, expected)
    cpu8 = dataclasses.replace(load_run_config(run_dir), mesh=load_mesh_file("cpu8"))
    if rank:
        lora.export(cpu8, run_dir, tmp_path / "export", step=None, dtype="float32", adapter_only=True)
        assert (tmp_path / "export" / "adapter_model.safetensors").is_file()
    else:
        hf_export.export(cpu8, run_dir, tmp_path / "export", step=None, dtype="float32")
        assert (tmp_path / "export" / "model.safetensors").is_file()


def test_generate_command_prints_the_runs_greedy_text(byte_run):
    """One prompt: a batch of 1, left whole by the fsdp_tp rules' batch split; 9 + 23 tokens fill the run's 32
    positions. On a CPU the command computes on one device, every core its thread pool's, not on the 8 simulated devices
    of the run's cpu8 mesh (each gathered the weights it computes with: a 1 GB model decoded 10x slower in 3x the
    memory), unless --devices (or --mesh) says otherwise; the greedy text is the run's on its own mesh."""
    from jaxtrain.generate import load

    result = run_cli("generate", str(byte_run), "--prompt", "the quick", "--max-new-tokens", "23", cwd=REPO)
    assert result.returncode == 0, result.stderr[-3000:]
    loaded = load(byte_run)  # the run's own mesh and rules, its latest checkpoint
    assert loaded.mesh.size == 8
    expected = generate(loaded, np.array([loaded.encode("the quick")]), SamplingConfig(max_new_tokens=23)).tokens[0]
    assert result.stdout == "the quick" + loaded.decode(expected) + "\n"
    assert re.search(r"23 new tokens; prefill 9 tokens in [\d.]+ s \([\d,]+ tokens/s\); decode [\d,.]+ tokens/s", result.stderr)
    assert result.stderr.rstrip().endswith("; on 1 x cpu, mesh data 1 x fsdp 1 x tensor 1"), result.stderr[-500:]
    on_its_mesh = run_cli("generate", str(byte_run), "--prompt", "the quick", "--max-new-tokens", "1", "--devices", "8", cwd=REPO)
    assert on_its_mesh.returncode == 0, on_its_mesh.stderr[-3000:]
    assert on_its_mesh.stdout == "the quick" + loaded.decode(expected[:1]) + "\n"
    assert on_its_mesh.stderr.rstrip().endswith("; on 8 x cpu, mesh data 2 x fsdp 2 x tensor 2"), on_its_mesh.stderr[-500:]
    # the same command again reads every program it compiles back from the run's compilation cache (train.compile_cache)
    again = run_cli("generate", str(byte_run), "--prompt", "the quick", "--max-new-tokens", "23", cwd=REPO)
    assert again.returncode == 0 and again.stdout == result.stdout, again.stderr[-3000:]
    folder = compile_cache.directory("auto")  # the run's setting, in the tests' XDG_CACHE_HOME (conftest.py)
    read_back = re.search(rf"\((\d+) of (\d+) programs read back from the compilation cache {re.escape(str(folder))}\)", again.stderr)
    assert read_back and read_back[1] == read_back[2] != "0", again.stderr[-2000:]


def test_the_generate_command_hands_decoding_the_runs_stop_token(byte_run, monkeypatch, capsys):
    """Decoding ends at the codec's stop token (a byte-level run's document separator, 0) only if the command passes it
    on; this small model never makes it, so its output alone could not show a command that dropped it (a QA audit)."""
    from jaxtrain import cli
    from jaxtrain import generate as generate_lib

    stops, decoding = [], generate_lib.generate
    monkeypatch.setattr(generate_lib, "generate", lambda loaded, prompts, sampling, given=(): (
        stops.append(given), decoding(loaded, prompts, sampling, given))[1])
    assert cli.main(["generate", str(byte_run), "--prompt", "the", "--max-new-tokens", "4"]) == 0
    assert stops == [(0,)]


@pytest.mark.parametrize("args, message", [
    (["--max-new-tokens", "0", "--temperature", "-1", "--top-p", "1.5"],
     "--max-new-tokens 0 must be at least 1; --temperature -1 must be 0 (greedy) or positive; --top-p 1.5 must be in (0, 1]"),
    (["--top-p", "0"], "--top-p 0 must be in (0, 1]"),
    # QA: inf sampled noise; seeds past int32 and int64 overflowed after the weights were read; -1 was taken
    (["--temperature", "inf", "--top-p", "nan"],
     "--temperature inf must be finite (at most 3.4e+38, float32's largest); give 0 (greedy) or a positive number, e.g. 1; "
     "--top-p nan must be in (0, 1]"),
    # QA: inf once in float32, taken with numpy's two-line overflow warning
    (["--temperature", "1e300"], "--temperature 1e+300 must be finite (at most 3.4e+38, float32's largest)"),
    (["--seed", "4294967296"], "--seed 4294967296 must be in [0, 4294967295]"),
    (["--seed", "-1"], "--seed -1 must be in [0, 4294967295]"),
    (["--seed", str(2**64)], f"--seed {2**64} must be in [0, 4294967295]"),
    # QA: a jit OverflowError traceback (int32 positions)
    (["--max-new-tokens", "100000000000"], "--max-new-tokens 100000000000 must be at most 2147483646 (positions are int32)"),
    ("no checkpoints", "jaxtrain generate {run}: no checkpoints there"),
    ("no run", "{run} is neither a run directory (config.yaml) nor a Hugging Face model directory (config.json)"),
    # QA: the line above, which did not say that an adapter goes with --adapter
    ("a PEFT adapter", "{run} is a PEFT adapter (adapter_config.json), not a model: give its base model and the adapter, "
                       "jaxtrain generate BASE_DIR --adapter {run}"),
    # before any weight is read (a QA report: the base's read came first, a second stderr line)
    (["--adapter", "/no/such/adapter"],
     "--adapter /no/such/adapter is neither a LoRA run directory (config.yaml) nor a PEFT adapter directory"),
])
def test_generate_command_bad_input(args, message, byte_run, tmp_path):
    run = byte_run
    if args == "no checkpoints":
        run = tmp_path / "fresh"
        run.mkdir()
        (run / "config.yaml").write_bytes((byte_run / "config.yaml").read_bytes())
    elif args == "no run":
        run = tmp_path
    elif args == "a PEFT adapter":
        run = tmp_path / "adapter"
        run.mkdir()
        (run / "adapter_config.json").write_text("{}")
    # 8 new tokens fit the run's context; a case's own --max-new-tokens comes after, so argparse takes it
    result = run_cli("generate", str(run), "--prompt", "a", "--max-new-tokens", "8", *(args if isinstance(args, list) else []),
                     cwd=tmp_path)
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and len(lines) == 1, result.stderr
    assert lines[0].startswith("jaxtrain: error: ") and message.format(run=run) in lines[0], lines[0]


def test_greedy_equals_transformers_generate(tmp_path):
    """A tiny random Llama (grouped-query attention, llama3 rope scaling) from transformers, imported onto
    the cpu8 mesh (every device on fsdp, rules fsdp_tp): 32 greedy tokens equal transformers' greedy generate."""
    import torch
    from test_hf import _make_hf_model

    from jaxtrain.generate import load

    model = _make_hf_model(tmp_path, "llama3")
    loaded = load(tmp_path)
    prompts = _prompts(2, 6)
    ours = generate(loaded, prompts, SamplingConfig(max_new_tokens=NEW_TOKENS)).tokens
    with torch.no_grad():  # min_new_tokens: the random model's end-of-text token must not stop it early
        theirs = model.generate(torch.tensor(prompts), max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False)
    assert len(np.unique(ours)) > 8
    np.testing.assert_array_equal(ours, theirs[:, prompts.shape[1]:].numpy())


def test_text_codecs(tmp_path):
    """Byte-level runs: UTF-8 bytes, text cut at the document separator; a token-file run: the tokenizer kept
    in RUN_DIR/hf/ when there is one, else token ids; a run with data.tokenizer: that tokenizer."""
    import tokenizers

    from jaxtrain.generate import _until, codec

    byte_run = small_config(vocab_size=256)
    encode, decode, stops = codec(byte_run, tmp_path)
    assert encode("é!") == [0xC3, 0xA9, 0x21] and decode([0xC3, 0xA9, 0x21, 0, 0x41]) == "é!" and stops == (0,)
    token_run = with_(byte_run, data={"path": "tokens.bin"})
    encode, decode, stops = codec(token_run, tmp_path)
    assert encode("12, 7 99") == [12, 7, 99] and decode([4, 18]) == " 4 18" and stops == ()  # printed after the prompt's ids
    tokenizer = tokenizers.Tokenizer(tokenizers.models.BPE(unk_token="[UNK]"))
    tokenizer.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tokenizer.train_from_iterator(["the quick brown fox", "the lazy dog"] * 10,
                                  tokenizers.trainers.BpeTrainer(vocab_size=60, special_tokens=["<|endoftext|>"]))
    (tmp_path / "hf").mkdir()
    tokenizer.save(str(tmp_path / "hf" / "tokenizer.json"))
    end_of_text = tokenizer.token_to_id("<|endoftext|>")
    for run in (token_run, with_(byte_run, data={"tokenizer": str(tmp_path / "hf")})):
        encode, decode, stops = codec(run, tmp_path)
        assert stops == (end_of_text,)
        assert encode("the lazy fox") == tokenizer.encode("the lazy fox").ids and decode(encode("the lazy fox")) == "the lazy fox"
        # up to the end of text, as the byte-level runs' output (a QA report: what followed it was printed on as continuation)
        assert decode(encode("the lazy") + [end_of_text] + encode("fox")) == "the lazy"
    # the end itself is cut too, not left to skip_special_tokens: a tokenizer need not mark its end token special
    assert _until([5, 9, 2, 9], (9,)) == [5] and _until([5, 2], (9,)) == [5, 2] and _until([5, 2, 9], (9, 2)) == [5]


def test_a_prompt_token_id_past_the_vocabulary_is_one_line():
    """Token ids are 0 .. vocab_size - 1: the id vocab_size would read past the embedding (jax clamps the lookup, no error)."""
    from jaxtrain.errors import UserError
    from jaxtrain.generate import _token_codec

    encode = _token_codec(64, None, ()).encode
    assert encode("0 63") == [0, 63]
    with pytest.raises(UserError, match=r"^a prompt token id is 64, outside the model's vocabulary of 64 \(model.vocab_size\)"):
        encode("63 64")


def _hf_model_or_skip(directory, name):
    """test_hf's random Hugging Face model in ``directory``: transformers makes it with torch, so the test is skipped
    where they are not installed (`make test-jax-next`, jax 0.11's environment)."""
    pytest.importorskip("torch")
    from test_hf import _make_hf_model

    return _make_hf_model(directory, name)


def test_token_id_prompt_is_printed_with_its_continuation(tmp_path, capsys):
    """A model without a tokenizer (a Hugging Face directory with none): the prompt's ids, then the new ones, as a text
    prompt is printed with its continuation."""
    from jaxtrain import cli
    from jaxtrain.generate import load

    _hf_model_or_skip(tmp_path, "llama3")
    assert not (tmp_path / "tokenizer.json").exists()
    capsys.readouterr()
    assert cli.main(["generate", str(tmp_path), "--prompt", "1 2 3", "--max-new-tokens", "5"]) == 0
    printed = capsys.readouterr().out
    new = generate(load(tmp_path), np.array([[1, 2, 3]], np.int32), SamplingConfig(max_new_tokens=5)).tokens[0]
    assert printed == "1 2 3" + "".join(f" {t}" for t in new) + "\n"


def test_a_sentencepiece_style_continuation_keeps_its_leading_space(tmp_path, capsys):
    """Llama 2's and Mistral's tokenizers mark a word's leading space with "▁" and their decoders drop the space of a text's
    first token: decoded alone, the continuation lost it, and "w1 w2" + " w7" printed "w1 w2w7" (a QA run). Printed as the
    prompt and new tokens decode together, as transformers' tokenizer.decode of the whole output reads. Every token here
    is a "▁" word, so whatever the random model makes starts with a space."""
    import tokenizers

    from jaxtrain import cli
    from jaxtrain.generate import _until, load

    _hf_model_or_skip(tmp_path, "llama3")
    vocab = {"</s>": 0, "<unk>": 1, **{f"\u2581w{i}": i for i in range(2, 64)}}
    tokenizer = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = tokenizers.pre_tokenizers.Metaspace(prepend_scheme="first")
    tokenizer.decoder = tokenizers.decoders.Metaspace(prepend_scheme="first")
    tokenizer.add_special_tokens(["</s>"])
    tokenizer.save(str(tmp_path / "tokenizer.json"))
    prompt = tokenizer.encode("w3 w4").ids
    assert tokenizer.decode([prompt[1]]) == "w4" and tokenizer.decode(prompt) == "w3 w4"  # the first token's space dropped
    loaded = load(tmp_path)
    new = generate(loaded, np.array([prompt], np.int32), SamplingConfig(max_new_tokens=4)).tokens[0].tolist()
    capsys.readouterr()
    assert cli.main(["generate", str(tmp_path), "--prompt", "w3 w4", "--max-new-tokens", "4"]) == 0
    printed = capsys.readouterr().out
    assert printed.startswith("w3 w4 w") and printed == tokenizer.decode(prompt + _until(new, loaded.stops)) + "\n"


def test_generation_stops_where_transformers_does_at_any_of_the_models_eos_token_ids(tmp_path, capsys):
    """generation_config.json's eos_token_id, an id or a list (an instruct model's end of text and end of turn, as
    Llama 3.1 Instruct's three), else config.json's: transformers' greedy generate stops at the first it makes. Only
    the tokenizer's end of text stopped it here (a QA report: output went on past an instruct model's end of turn)."""
    from jaxtrain import cli
    from jaxtrain.errors import UserError
    from jaxtrain.generate import load
    from jaxtrain.interop import hf_config

    _hf_model_or_skip(tmp_path, "llama3")
    import torch
    import transformers

    free = generate(load(tmp_path), np.array([[1, 2, 3]], np.int32), SamplingConfig(max_new_tokens=12)).tokens[0].tolist()
    earlier, later = free[2], next(t for t in free[3:] if t not in free[:3])  # the list's second id comes first
    generation_config = json.loads((tmp_path / "generation_config.json").read_text())
    (tmp_path / "generation_config.json").write_text(json.dumps(generation_config | {"eos_token_id": [later, earlier]}))
    reference = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    theirs = reference.generate(torch.tensor([[1, 2, 3]]), max_new_tokens=12, do_sample=False)[0, 3:].tolist()
    assert theirs == free[:free.index(earlier) + 1]  # stopped at the list's second id
    capsys.readouterr()
    assert cli.main(["generate", str(tmp_path), "--prompt", "1 2 3", "--max-new-tokens", "12"]) == 0
    out = capsys.readouterr()
    assert out.out == "1 2 3" + "".join(f" {t}" for t in theirs[:-1]) + "\n"  # the ids up to the stop token
    assert f"jaxtrain: {len(theirs)} new tokens;" in out.err
    # without generation_config.json, config.json's id
    (tmp_path / "generation_config.json").unlink()
    from test_hf import _edit_config

    _edit_config(tmp_path, eos_token_id=earlier)
    assert hf_config.end_of_sequence_ids(tmp_path) == (earlier,)
    _edit_config(tmp_path, eos_token_id="</s>")
    with pytest.raises(UserError, match=f"^{tmp_path / 'config.json'}: eos_token_id must be a token id or a list of them, "
                                        "got \\['</s>'\\]"):
        hf_config.end_of_sequence_ids(tmp_path)


def test_generating_past_the_models_context_is_one_line(tmp_path, capsys, monkeypatch):
    """config.json's max_position_embeddings (1024 here): a QA run asked a 256-position model for 100,000 tokens and
    ran for ten minutes. Refused before the weights are read: too many new tokens alone before jax starts, with the
    prompt once it is encoded."""
    from jaxtrain import cli
    from jaxtrain import generate as generate_lib

    _hf_model_or_skip(tmp_path, "llama3")
    capsys.readouterr()
    monkeypatch.setattr(generate_lib, "load", lambda *a, **k: pytest.fail("read the weights first"))
    assert cli.main(["generate", str(tmp_path), "--prompt", "1 2 3", "--max-new-tokens", "1022"]) == 2
    assert capsys.readouterr().err == (
        "jaxtrain: error: --max-new-tokens 1022 with a prompt of 3 tokens runs past the model's "
        "context of 1024 positions (max_position_embeddings); give --max-new-tokens 1021 or less\n")
    assert cli.main(["generate", str(tmp_path), "--prompt", "1 2 3", "--max-new-tokens", "100000"]) == 2
    assert capsys.readouterr().err == ("jaxtrain: error: --max-new-tokens 100000 runs past the model's context of 1024 positions "
                                       "(max_position_embeddings) before any prompt; give fewer than 1024, less the prompt's tokens\n")
    long_prompt = " ".join(["7"] * 1024)
    assert cli.main(["generate", str(tmp_path), "--prompt", long_prompt, "--max-new-tokens", "1"]) == 2
    assert capsys.readouterr().err == ("jaxtrain: error: the prompt is 1024 tokens and fills the model's context of 1024 positions "
                                       "(max_position_embeddings), leaving no room for a new token; shorten the prompt\n")


def test_generating_from_a_run_that_has_not_saved_yet_says_so(byte_run, tmp_path, capsys):
    """A run makes its checkpoints/ when it starts, empty until its first save commits: generating from it then (a QA run)
    said 'no complete checkpoint found (steps: none)', not what to do."""
    from jaxtrain import cli

    run = tmp_path / "run"
    (run / "checkpoints" / "5.orbax-checkpoint-tmp").mkdir(parents=True)  # its first save, not committed yet
    shutil.copy(byte_run / "config.yaml", run)
    capsys.readouterr()
    assert cli.main(["generate", str(run), "--prompt", "the", "--max-new-tokens", "4"]) == 2
    assert capsys.readouterr().err == (f"jaxtrain: error: jaxtrain generate {run}: no checkpoints there yet; train the run until "
                                       "it saves one (every checkpoint.every steps, and at its last step)\n")


@pytest.mark.parametrize("new_tokens, message", [
    (24, "--max-new-tokens 24 with a prompt of 9 tokens runs past the model's context of 32 positions (data.seq_len); "
         "give --max-new-tokens 23 or less"),
    (100000, "--max-new-tokens 100000 runs past the model's context of 32 positions (data.seq_len) before any prompt; "
             "give fewer than 32, less the prompt's tokens"),
])
def test_generating_past_a_runs_trained_context_is_one_line(new_tokens, message, byte_run, capsys, monkeypatch):
    """A run trained from scratch learnt data.seq_len positions, the max_position_embeddings its export-hf writes, which
    bounds generating from that export: from the run itself --max-new-tokens 100000 was taken and decoded on (a QA
    report). Refused before the weights are read."""
    from jaxtrain import cli
    from jaxtrain import generate as generate_lib

    monkeypatch.setattr(generate_lib, "load", lambda *a, **k: pytest.fail("read the weights first"))
    capsys.readouterr()
    assert cli.main(["generate", str(byte_run), "--prompt", "the quick", "--max-new-tokens", str(new_tokens)]) == 2
    assert capsys.readouterr().err == f"jaxtrain: error: {message}\n"


@pytest.mark.parametrize("scaling, context", [
    (RopeScaling(), (32, "data.seq_len")),
    (RopeScaling(type="llama3", original_max_len=64), (64, "model.rope_scaling.original_max_len")),
    (RopeScaling(type="llama3", original_max_len=16), (32, "data.seq_len")),
])
def test_a_runs_context_is_the_max_position_embeddings_its_export_writes(scaling, context):
    from jaxtrain.interop import hf_config

    model = small_config(rope_scaling=scaling).model
    assert hf_config.trained_context(model, 32) == context
    assert hf_config.export_config(model, "float32", 32)["max_position_embeddings"] == context[0]


@pytest.mark.parametrize("source, context", [
    ({"max_position_embeddings": 16}, (32, "data.seq_len")),
    ({"max_position_embeddings": 64}, (64, "max_position_embeddings")),
    ({"architectures": ["MistralForCausalLM"], "max_position_embeddings": 16, "sliding_window": 24}, (24, "sliding_window")),
])
def test_a_run_fine_tuned_on_longer_sequences_than_its_source_model_generates_and_exports_them(source, context, byte_run,
                                                                                             tmp_path, capsys, monkeypatch):
    """A run initialised from a model of 16 positions (RUN_DIR/hf/config.json) and trained at data.seq_len 32: a QA run
    refused to generate past 16 positions from it, and its export wrote max_position_embeddings 16, though it trained on
    32. Its context is what it trained on, never past the source's sliding window (train refuses longer sequences)."""
    from jaxtrain import cli
    from jaxtrain import generate as generate_lib
    from jaxtrain.interop import hf_config

    run = tmp_path / "run"
    (run / hf_config.RUN_SUBDIR).mkdir(parents=True)
    shutil.copy(byte_run / "config.yaml", run)
    (run / hf_config.RUN_SUBDIR / hf_config.CONFIG_FILE).write_text(json.dumps({"architectures": ["LlamaForCausalLM"]} | source))
    monkeypatch.setattr(generate_lib, "load", lambda *a, **k: pytest.fail("read the weights first"))
    capsys.readouterr()
    assert cli.main(["generate", str(run), "--prompt", "abc", "--max-new-tokens", str(context[0] - 2)]) == 2  # 3 bytes
    assert capsys.readouterr().err == (f"jaxtrain: error: --max-new-tokens {context[0] - 2} with a prompt of 3 tokens runs past the "
                                       f"model's context of {context[0]} positions ({context[1]}); give --max-new-tokens "
                                       f"{context[0] - 3} or less\n")
    exported = hf_config.export_config(small_config().model, "float32", 32, base=source)
    assert exported["max_position_embeddings"] == max(source["max_position_embeddings"], 32)


def test_generating_past_a_sliding_window_is_one_line(tmp_path, capsys, monkeypatch):
    """A Mistral attends within its sliding window, this model to every position. A QA report: generating past the window
    gave other tokens than transformers from there on (from position 266 of a 260-position window), and a window under
    256 positions was refused with train's message, 'set data.seq_len<=16', which generate has no way to set."""
    from jaxtrain import cli
    from jaxtrain import generate as generate_lib

    _hf_model_or_skip(tmp_path, "mistral")
    from test_hf import _edit_config

    _edit_config(tmp_path, sliding_window=16)
    capsys.readouterr()
    assert cli.main(["generate", str(tmp_path), "--prompt", "1 2 3", "--max-new-tokens", "13"]) == 0  # the whole window
    capsys.readouterr()
    monkeypatch.setattr(generate_lib, "load", lambda *a, **k: pytest.fail("read the weights first"))
    assert cli.main(["generate", str(tmp_path), "--prompt", "1 2 3", "--max-new-tokens", "14"]) == 2
    assert capsys.readouterr().err == ("jaxtrain: error: --max-new-tokens 14 with a prompt of 3 tokens runs past the model's context "
                                       "of 16 positions (sliding_window); give --max-new-tokens 13 or less\n")


def test_lora_run_whose_base_changed_asks_for_that_base_back(corpus, tmp_path, capsys):
    """generate and export-hf reload a LoRA run's base from the path its record names, so the way out is that base back
    there, not the --run-dir (or --init-from) that train's message offers and these commands do not take."""
    from jaxtrain import cli
    from jaxtrain.interop import hf_config
    from jaxtrain.train import build, train

    hf_dir, run_dir = tmp_path / "base", tmp_path / "run"
    model = _hf_model_or_skip(hf_dir, "llama3")
    import transformers

    cfg = with_(small_config(), model={"lora": LoraConfig(rank=2, alpha=4.0)}, train={"steps": 2},
                checkpoint={"every": 2, "async_save": False}, log={"peak_tflops": 1.0, "tensorboard": False, "layer_every": 0})
    cfg = dataclasses.replace(cfg, model=hf_config.model_config(hf_dir, cfg.model, set(), cfg.data.seq_len))
    train(cfg, run_dir, build(cfg, corpus), init_from=hf_dir)
    shutil.rmtree(hf_dir)
    transformers.LlamaForCausalLM(model.config).save_pretrained(hf_dir)  # other weights where the base was
    for args in (["generate", str(run_dir), "--prompt", "1 2"], ["export-hf", str(run_dir), "--out", str(tmp_path / "out")]):
        capsys.readouterr()
        assert cli.main(args) == 2
        errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("jaxtrain: error: ")]
        assert len(errors) == 1 and f"is not the base run {run_dir} was trained on ({hf_dir.absolute()}, hash " in errors[0], errors
        assert errors[0].endswith(f"; restore the base {run_dir / 'lora_base.json'} records (the run's adapters are reloaded onto it)")
    assert not list(tmp_path.glob("out*"))


def test_seeds_up_to_32_bits_sample_and_train_and_data_seeds_share_the_bound():
    """A QA report: --seed 2147483648 overflowed the int32 the seed reached the sampler as. jax keys keep a seed's low
    32 bits (2**32 would sample as seed 0) and grain's shuffle takes no more, so every seed is in [0, 2**32 - 1]."""
    from jaxtrain import config as config_lib

    loaded = _loaded("dp", (1, 1, 1), 1)
    run = lambda seed: generate(loaded, _prompts(2), SamplingConfig(max_new_tokens=8, temperature=1.0, seed=seed)).tokens  # noqa: E731
    assert not np.array_equal(run(SamplingConfig.SEED_MAX), run(0))
    np.testing.assert_array_equal(run(2**31 + 5), run(2**31 + 5))
    for section in ("train", "data"):
        config_lib.check(with_(small_config(), **{section: {"seed": 2**32 - 1}}))
        with pytest.raises(config_lib.UserError, match=f"^{section}.seed=4294967296 must be in \\[0, 4294967295\\]$"):
            config_lib.check(with_(small_config(), **{section: {"seed": 2**32}}))


def test_a_cache_larger_than_memory_is_one_line_before_the_weights(byte_run, tmp_path, capsys, monkeypatch):
    """A QA report: --max-new-tokens 1000000000 failed in an allocation (RESOURCE_EXHAUSTED) after the weights were read.
    The byte run's cache: 2 layers x 2 x 1 x positions x 2 kv heads x 8 x 4 bytes, kv heads split 2 ways over tensor and
    the rest copied on the 8 CPU devices: 1 KiB of host memory per position, so 1 GiB holds 2**20 positions. The run's
    config with data.seq_len as long as positions go, so its context holds the request and the cache is what refuses it."""
    from types import SimpleNamespace

    import yaml

    from jaxtrain import cli
    from jaxtrain import generate as generate_lib

    config = yaml.safe_load((byte_run / "config.yaml").read_text())
    config["data"]["seq_len"] = generate_lib.MAX_POSITIONS
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(config))
    monkeypatch.setattr(generate_lib.psutil, "virtual_memory", lambda: SimpleNamespace(available=2**30))
    monkeypatch.setattr(generate_lib, "load", lambda *a, **k: pytest.fail("read the weights first"))
    capsys.readouterr()
    assert cli.main(["generate", str(tmp_path), "--prompt", "the quick", "--max-new-tokens", "1000000000"]) == 2
    assert capsys.readouterr().err == (
        "jaxtrain: error: --max-new-tokens 1000000000 with a prompt of 9 tokens needs a key/value cache of 238.4 GiB (2 layers x 2 "
        "(keys, values) x batch 1 x 1000000009 positions x 2 kv heads x 8 head dim x 4 bytes (float32)), 953.7 GiB with the copies "
        "its sharding keeps on the 8 CPU devices, more than the 1.0 GiB of host memory available; give --max-new-tokens 1048567 "
        "or less (the weights need room too)\n")
    generate_lib.check_request(byte_run, None, None, 1, 9, 2**20 - 9)  # the most that fits
    with pytest.raises(generate_lib.UserError, match="give --max-new-tokens 1048567 or less"):
        generate_lib.check_request(byte_run, None, None, 1, 9, 2**20 - 8)
    with pytest.raises(generate_lib.UserError, match="^--max-new-tokens 2147483640 with a prompt of 9 tokens makes 2147483649 "
                       "positions, more than the 2147483647 an int32 position holds; give --max-new-tokens 2147483638 or less$"):
        generate_lib.check_request(byte_run, None, None, 1, 9, 2**31 - 8)


def test_a_rule_set_whose_batch_names_a_mesh_axis_the_mesh_lacks_is_one_line(tmp_path):
    """generate sized the key/value cache by the rules before checking them against the mesh: a batch rule over a mesh
    axis the mesh lacks stopped with a KeyError traceback (a QA report), where train says it in one line."""
    import yaml

    from jaxtrain import config as config_lib
    from jaxtrain import generate as generate_lib

    rules = yaml.safe_load((REPO / "jaxtrain" / "sharding_rules" / "fsdp_tp.yaml").read_text()) | {"activation_batch": ["data", "pipeline"]}
    (tmp_path / "rules.yaml").write_text(yaml.safe_dump(rules))
    config_lib.save_yaml(small_config(), tmp_path / "config.yaml")
    with pytest.raises(generate_lib.UserError, match=r"^rule set \S+rules.yaml: 'activation_batch' maps to mesh axis 'pipeline', "
                                                     r"which the mesh does not have \(mesh axes: data, fsdp, tensor, stage, expert\)$"):
        generate_lib.check_request(tmp_path, None, str(tmp_path / "rules.yaml"), 1, 4, 4)
