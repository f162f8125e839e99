"""Instruction data (data.format=sft): chat-template rendering and answer masks equal to transformers', packed
sequences equal to the examples run one by one, an exact data position on resume, training and generation end to
end, and bad input as one-line errors that write nothing."""

import dataclasses
import json
import os
import re
import signal

import jax
import numpy as np
import pytest
import transformers
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from conftest import small_config, with_
from jaxtrain import cli
from jaxtrain.config import DataConfig
from jaxtrain.data import sft
from jaxtrain.data.pipeline import PLAIN_SEEDS, SEED_SCHEME, SPREAD_SEEDS, grain_seed
from jaxtrain.data.tokenizer import load_tokenizer
from jaxtrain.errors import UserError
from jaxtrain.layout import make_layout
from jaxtrain.optim import learning_rate_schedule
from jaxtrain.state import init_state
from jaxtrain.step import make_train_step, token_nll
from jaxtrain.train import build, train
from jaxtrain.models.llama import Llama

SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# ChatML; the {% generation %} block marks the answers for transformers' return_assistant_tokens_mask, the
# reference our mask (found by rendering prefixes, which ignores the block) must equal
CHATML = ("{% for m in messages %}{% if m['role'] == 'assistant' %}{{ '<|im_start|>assistant\\n' }}{% generation %}"
          "{{ m['content'] + '<|im_end|>\\n' }}{% endgeneration %}{% else %}{{ '<|im_start|>' + m['role'] + '\\n' + "
          "m['content'] + '<|im_end|>\\n' }}{% endif %}{% endfor %}{% if add_generation_prompt %}"
          "{{ '<|im_start|>assistant\\n' }}{% endif %}")
SEQ = 128  # sequence length: two to five examples of 22 to 78 tokens fit in one
VOCAB = 288  # the 256 bytes, 3 special tokens, merges
WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa".split()


def _tokenizer_dir(directory, template=CHATML):
    """A byte-level BPE (vocabulary VOCAB) with ChatML's special tokens."""
    directory.mkdir()
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.train_from_iterator([" ".join(WORDS)] * 20, trainers.BpeTrainer(
        vocab_size=VOCAB, special_tokens=SPECIAL, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
    bpe.save(str(directory / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|im_end|>", "bos_token": "<|endoftext|>"}
    if template:
        config["chat_template"] = template
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    return directory


def _records(count, seed=0):
    """Prompt/completion lines and two-answer conversations, of varied lengths."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(count):
        words = lambda n: " ".join(rng.choice(WORDS, n))  # noqa: E731
        if i % 3 == 2:
            out.append({"messages": [{"role": "system", "content": words(2)}, {"role": "user", "content": words(3)},
                                     {"role": "assistant", "content": words(2)}, {"role": "user", "content": words(1)},
                                     {"role": "assistant", "content": words(4)}]})
        else:
            out.append({"prompt": words(int(rng.integers(1, 6))), "completion": words(int(rng.integers(1, 4)))})
    return out


def _jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = tmp_path_factory.mktemp("sft")
    return _tokenizer_dir(root / "tok"), _jsonl(root / "train.jsonl", _records(120))


def _messages(record):
    return record.get("messages") or [{"role": "user", "content": record["prompt"]}, {"role": "assistant", "content": record["completion"]}]


def test_rendering_and_answer_mask_equal_transformers(data):
    tok_dir, path = data
    hf = transformers.AutoTokenizer.from_pretrained(str(tok_dir))
    tokenizer = load_tokenizer(tok_dir)
    template = sft.ChatTemplate(tokenizer)
    conversations = [_messages(json.loads(line)) for line in path.read_text().splitlines()][:9]
    rendered = [sft._rendered(template, messages, "test") for messages in conversations]
    examples = sft._encode(tokenizer, [text for text, _ in rendered], [spans for _, spans in rendered])
    for messages, example in zip(conversations, examples, strict=True):
        expected = hf.apply_chat_template(messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
        assert example.tokens.tolist() == expected["input_ids"]
        assert example.counted.astype(int).tolist() == expected["assistant_masks"]
        answers = "".join(m["content"] + "<|im_end|>\n" for m in messages if m["role"] == "assistant")
        assert tokenizer.tokenizer.decode(example.tokens[example.counted].tolist(), skip_special_tokens=False) == answers
    prompt = template.prompt_tokens("alpha beta")
    assert prompt == hf.apply_chat_template([{"role": "user", "content": "alpha beta"}], add_generation_prompt=True,
                                            tokenize=True, return_dict=False)


def test_a_chat_answer_ends_at_the_eos_token_the_tokenizer_config_names(data):
    """generate --chat stops an answer at the end of its turn: ChatML's <|im_end|>, tokenizer_config.json's eos_token
    (not its bos_token, <|endoftext|>)."""
    tok_dir, _ = data
    tokenizer = load_tokenizer(tok_dir)
    assert sft.ChatTemplate(tokenizer).end_of_turn() == tokenizer.tokenizer.token_to_id("<|im_end|>") == 2


def test_a_chat_answer_is_printed_up_to_the_end_of_its_turn_and_decoding_stops_there(data, tmp_path):
    """`generate --chat`'s codec: the answer's text ends where its turn does (what follows, a next turn the model
    went on to write, is not printed), and decoding is told to stop at that token."""
    import shutil

    from jaxtrain import generate

    tok_dir, _ = data
    shutil.copytree(tok_dir, tmp_path / "hf")
    (tmp_path / "hf" / "config.json").write_text("{}")
    codec = generate.chat_codec(tmp_path / "hf", VOCAB)
    tokenizer = load_tokenizer(tok_dir).tokenizer
    answer, after = tokenizer.encode("alpha beta").ids, tokenizer.encode("gamma").ids
    end = tokenizer.token_to_id("<|im_end|>")
    assert codec.stops == (end,)
    assert codec.decode(answer + [end] + after + [end]) == codec.decode(answer) == tokenizer.decode(answer) == "alpha beta"

def test_load_splits_counts_and_truncates(data, tmp_path):
    tok_dir, path = data
    cfg = DataConfig(path=str(path), tokenizer=str(tok_dir), seq_len=SEQ, val_fraction=0.2, format="sft")
    corpus = sft.load_sft(cfg)
    assert len(corpus.train) + len(corpus.validation) == 120 and 10 < len(corpus.validation) < 40
    assert corpus.vocab_size == VOCAB and all(e.counted.any() and not e.counted[0] for e in corpus.train)
    longest = max(len(e.tokens) for e in corpus.train + corpus.validation)
    with pytest.raises(UserError, match=r"train.jsonl:\d+: the example is \d+ tokens, longer than data.seq_len \+ 1 = 41; .*data.truncate=true"):
        sft.load_sft(dataclasses.replace(cfg, seq_len=40))
    cut = sft.load_sft(dataclasses.replace(cfg, seq_len=40, truncate=True))
    assert max(len(e.tokens) for e in cut.train) == 41 < longest
    assert all(np.array_equal(c.tokens, e.tokens[:41]) and np.array_equal(c.counted, e.counted[:41]) for c, e in zip(cut.train, corpus.train))


def test_a_packed_batch_weights_exactly_the_answer_tokens_transformers_masks(data):
    """A target counts where transformers' assistant mask marks that token (the mask shifted with the targets): per
    packed example, the weighted targets are its answers, the template's end of turn after each, and nothing else."""
    tok_dir, path = data
    cfg = DataConfig(path=str(path), tokenizer=str(tok_dir), seq_len=SEQ, val_fraction=0.2, format="sft")
    hf = transformers.AutoTokenizer.from_pretrained(str(tok_dir))
    records = [json.loads(line) for line in path.read_text().splitlines()]
    by_tokens = {}
    for messages in map(_messages, records):
        expected = hf.apply_chat_template(messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
        by_tokens[tuple(expected["input_ids"][:-1])] = (expected["input_ids"][1:], expected["assistant_masks"][1:])
    batch = _packed_batch(sft.load_sft(cfg), cfg)
    checked = 0
    for row in range(len(batch["inputs"])):
        for segment in range(1, batch["segment_ids"][row].max() + 1):
            at = batch["segment_ids"][row] == segment
            targets, mask = by_tokens[tuple(batch["inputs"][row][at].tolist())]
            assert batch["targets"][row][at].tolist() == targets
            assert batch["weights"][row][at].tolist() == mask
            checked += 1
    assert checked >= 8


def _packed_batch(corpus, cfg, batch=4):
    return next(iter(sft.packed_batches(corpus.train, cfg, batch, shuffle_seed=0, repeat=True)))


def test_packed_sequences_give_each_example_its_loss_alone(data):
    tok_dir, path = data
    cfg = DataConfig(path=str(path), tokenizer=str(tok_dir), seq_len=SEQ, val_fraction=0.2, format="sft")
    corpus = sft.load_sft(cfg)
    batch = _packed_batch(corpus, cfg)
    assert batch["segment_ids"].max() >= 3  # several examples share a sequence
    model_cfg = small_config(init_std=0.3, vocab_size=VOCAB).model
    graphdef, params = nnx.split(Llama(model_cfg, rngs=nnx.Rngs(0)))
    nll_of = jax.jit(lambda p, b: token_nll(graphdef, p, b))
    nll = np.asarray(nll_of(params, batch))
    # each example alone at the start of its own sequence, no segment ids (causal attention never sees the zeros after it)
    places = [(row, batch["segment_ids"][row] == segment) for row in range(len(batch["inputs"]))
              for segment in range(1, batch["segment_ids"][row].max() + 1)]
    alone = {k: np.zeros((len(places), SEQ), np.int32) for k in ("inputs", "targets")}
    for i, (row, at) in enumerate(places):
        assert batch["positions"][row][at].tolist() == list(range(at.sum()))  # positions restart per example
        for k in alone:
            alone[k][i, :at.sum()] = batch[k][row][at]
    expected = np.asarray(nll_of(params, alone))
    for i, (row, at) in enumerate(places):
        np.testing.assert_allclose(nll[row][at], expected[i, :at.sum()], rtol=2e-5, atol=2e-6)
    assert len(places) >= 8
    # rotary embeddings see only position differences inside an example, so the packed-vs-alone equality above cannot
    # tell whether the model reads the positions; positions that are not consecutive must change the result
    assert np.abs(np.asarray(nll_of(params, batch | {"positions": batch["positions"] * 2})) - nll).max() > 1e-2
    # the loss counts the answers' tokens only, per counted token
    weights = batch["weights"]
    assert 0 < weights.sum() < (batch["segment_ids"] > 0).sum()


def test_microbatches_give_the_loss_and_update_of_the_whole_batch(data):
    """Micro-batches hold different numbers of answer tokens: each is weighted by the whole batch's count."""
    tok_dir, path = data
    cfg = with_(small_config(rules="dp", mesh=(1, 1, 1), vocab_size=VOCAB),
                data={"path": str(path), "tokenizer": str(tok_dir), "format": "sft", "seq_len": SEQ, "val_fraction": 0.2})
    batch = _packed_batch(sft.load_sft(cfg.data), cfg.data, batch=4)
    layout = make_layout(cfg, jax.devices()[:1])
    state = init_state(cfg.model, layout.tx, 0, layout.shardings)
    results = [jax.jit(make_train_step(layout.spec.graphdef, layout.tx, learning_rate_schedule(cfg), micro))(state, batch)
               for micro in (1, 2)]
    counts = [batch["weights"][i::2].sum() for i in range(2)]
    assert counts[0] != counts[1]  # the micro-batches hold unequal numbers of counted tokens
    (_, whole), (_, split) = results
    for name in ("loss", "grad_norm"):
        np.testing.assert_allclose(split[name], whole[name], rtol=1e-5)


def test_unpacked_is_one_example_per_sequence_and_packing_fills_more(data):
    tok_dir, path = data
    cfg = DataConfig(path=str(path), tokenizer=str(tok_dir), seq_len=SEQ, val_fraction=0.2, format="sft")
    corpus = sft.load_sft(cfg)
    fill = {}
    for pack in (True, False):
        batches = sft.packed_batches(corpus.train, dataclasses.replace(cfg, pack=pack), 4, shuffle_seed=None, repeat=False)
        segments = np.concatenate([b["segment_ids"] for b in batches])
        fill[pack] = (segments > 0).mean()
        if not pack:  # every example in a sequence of its own, the last batch padded with empty ones
            assert segments.max() == 1 and (segments.max(axis=1) == 1).sum() == len(corpus.train) and len(segments) % 4 == 0
    assert fill[True] > 1.5 * fill[False]


def test_data_position_resumes_exactly(data):
    tok_dir, path = data
    cfg = DataConfig(path=str(path), tokenizer=str(tok_dir), seq_len=SEQ, val_fraction=0.2, format="sft")
    corpus = sft.load_sft(cfg)
    mesh = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
    sharding = NamedSharding(mesh, PartitionSpec("data", None))
    first = sft.train_batches(corpus, cfg, 8, sharding)
    for _ in range(5):  # past the first epoch (about 12 sequences of examples) and into the packer's next round
        next(first)
    state = first.iterator.get_state()
    expected = [next(first) for _ in range(3)]
    resumed = sft.train_batches(corpus, cfg, 8, sharding)
    resumed.iterator.set_state(state)
    for want, got in zip(expected, (next(resumed) for _ in range(3))):
        assert want.keys() == got.keys() == sft.BATCH_FIELDS.keys()
        for key in want:
            np.testing.assert_array_equal(np.asarray(want[key]), np.asarray(got[key]))
    one_device = NamedSharding(jax.make_mesh((1,), ("data",), devices=jax.devices()[:1], axis_types=(jax.sharding.AxisType.Auto,)),
                               PartitionSpec("data", None))
    first_again = sft.train_batches(corpus, cfg, 8, sharding)
    beginning = first_again.iterator.get_state()  # --init-from into another stream puts the batches back there
    start = next(first_again)
    next(first_again)
    first_again.iterator.set_state(beginning)
    np.testing.assert_array_equal(np.asarray(next(first_again)["inputs"]), np.asarray(start["inputs"]))
    again = sft.train_batches(corpus, cfg, 8, one_device)  # the global batch does not depend on the sharding
    for _ in range(5):
        next(again)
    np.testing.assert_array_equal(np.asarray(next(again)["inputs"]), np.asarray(expected[0]["inputs"]))


def test_evaluation_reads_the_validation_examples_and_each_process_its_own_rows(data):
    from test_data import _ProcessView

    tok_dir, path = data
    cfg = DataConfig(path=str(path), tokenizer=str(tok_dir), seq_len=SEQ, val_fraction=0.2, format="sft", pack=False)
    corpus = sft.load_sft(cfg)
    mesh = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
    sharding = NamedSharding(mesh, PartitionSpec("data", None))
    # unpacked, a row is one example: evaluation reads every validation example once, in file order, and no training one
    rows = np.concatenate([np.asarray(b["inputs"]) for b in sft.eval_batches(corpus, cfg, 8, sharding, count=100)])
    read = [r[:n].tolist() for r in rows if (n := int((r != 0).sum()))]  # token 0 is the padding's
    assert read == [e.tokens[:-1].tolist() for e in corpus.validation]
    # 4 processes of 2 devices: each packs every batch and keeps its own rows, together the batch one process reads
    whole = sft.train_batches(corpus, cfg, 8, sharding)
    expected = [next(whole.iterator)["inputs"] for _ in range(2)]
    devices = list(mesh.devices.flat)
    per_process = [sft.train_batches(corpus, cfg, 8, _ProcessView(sharding, devices[2 * p:2 * p + 2])) for p in range(4)]
    for batch in expected:
        np.testing.assert_array_equal(np.concatenate([next(b.iterator)["inputs"] for b in per_process]), batch)


def _metrics(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_train_resume_and_generate_chat(data, tmp_path, capsys):
    """Trains on the answers (loss falls), stops on SIGTERM and resumes to the same losses bit for bit, reports eval
    loss per counted token; `generate --chat` renders the prompt with the template."""
    tok_dir, path = data
    cfg = with_(small_config(vocab_size=VOCAB), data={"path": str(path), "tokenizer": str(tok_dir), "format": "sft", "seq_len": SEQ, "val_fraction": 0.2},
                train={"steps": 6, "eval_batches": 2}, checkpoint={"every": 2, "async_save": False},
                log={"tensorboard": False, "peak_tflops": 1.0})  # no event files, no peak measurement: time
    trainer = build(cfg)
    final = jax.device_get(train(cfg, tmp_path / "whole", trainer).params)
    compiled = trainer.train_step

    def stop_after_three(state, batch):
        out = compiled(state, batch)
        if int(out[0].step) == 3:
            os.kill(os.getpid(), signal.SIGTERM)  # the run's own preemption handler: checkpoint, then stop
        return out

    from jaxtrain.checkpoint import Preempted

    with pytest.raises(Preempted):
        train(cfg, tmp_path / "stopped", dataclasses.replace(trainer, train_step=stop_after_three))
    train(cfg, tmp_path / "stopped", trainer)
    whole, stopped = _metrics(tmp_path / "whole"), _metrics(tmp_path / "stopped")
    losses = [(r["step"], r["loss"]) for r in whole if "loss" in r]
    assert [(r["step"], r["loss"]) for r in stopped if "loss" in r] == losses and len(losses) == 6
    assert losses[-1][1] < losses[0][1]
    # an epoch of instruction data is its training examples; each record the examples read through its step over them,
    # the same after the preemption (the data position's count)
    epochs = [(r["step"], r["epoch"]) for r in whole if "loss" in r]
    assert [(r["step"], r["epoch"]) for r in stopped if "loss" in r] == epochs
    reference, read = sft.train_batches(trainer.corpus, trainer.cfg.data, 8, trainer.batch_sharding), []
    for _ in range(6):
        next(reference)
        read.append(reference.position() / len(trainer.corpus.train))
    assert [epoch for _, epoch in epochs] == read and 0 < read[0] < read[-1]
    summary = json.loads((tmp_path / "whole" / "summary.json").read_text())["epoch"]
    assert summary == {"size": len(trainer.corpus.train), "unit": "examples", "left_out_tokens": None, "steps": None,
                       "at_start": 0.0, "at_end": None, "train_epochs": None, "train_steps": None}
    # train and eval loss: nats per counted (answer) token
    nll_of = jax.jit(lambda params, batch: token_nll(trainer.layout.spec.graphdef, params, batch))

    def per_counted_token(params, batches):
        batches = [jax.device_get(b) for b in batches]
        return sum(float((nll_of(params, b) * b["weights"]).sum()) for b in batches) / sum(b["weights"].sum() for b in batches)

    first_batch = next(sft.train_batches(trainer.corpus, trainer.cfg.data, 8, trainer.batch_sharding))
    np.testing.assert_allclose(losses[0][1], per_counted_token(jax.device_get(trainer.init_state().params), [first_batch]), rtol=1e-5)
    evals = [r for r in whole if "eval_loss" in r]
    eval_data = sft.eval_batches(trainer.corpus, trainer.cfg.data, 8, trainer.batch_sharding, 2)
    assert evals[-1]["eval_tokens"] == int(sum(np.asarray(b["weights"]).sum() for b in eval_data))
    np.testing.assert_allclose(evals[-1]["eval_loss"], per_counted_token(final, eval_data), rtol=1e-5)
    capsys.readouterr()
    assert cli.main(["generate", str(tmp_path / "whole"), "--prompt", "alpha beta", "--chat", "--max-new-tokens", "1"]) == 0
    prompt = sft.ChatTemplate(load_tokenizer(tok_dir)).prompt_tokens("alpha beta")  # equal to transformers' (test above)
    assert f"prefill {len(prompt)} tokens" in capsys.readouterr().err


def test_generate_chat_from_a_hugging_face_model_equals_transformers(data, tmp_path, capsys):
    """`generate HF_DIR --chat`: the prompt rendered as transformers renders it, the greedy answer (cut at the eos
    token) equal to transformers' greedy generate on the same model."""
    import shutil

    import torch

    tok_dir, _ = data
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256)).eval()
    with torch.no_grad():  # decisive logits: greedy decoding far from ties
        for name, p in model.named_parameters():
            p.copy_((1.0 if "norm" in name else 0.0) + 0.3 * torch.randn_like(p))
    model.save_pretrained(tmp_path / "hf")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tok_dir / name, tmp_path / "hf" / name)
    hf_tokenizer = transformers.AutoTokenizer.from_pretrained(str(tok_dir))
    prompt = hf_tokenizer.apply_chat_template([{"role": "user", "content": "alpha beta"}], add_generation_prompt=True,
                                              tokenize=True, return_dict=False)
    with torch.no_grad():
        new = model.generate(torch.tensor([prompt]), max_new_tokens=8, min_new_tokens=8, do_sample=False)[0, len(prompt):].tolist()
    end = hf_tokenizer.eos_token_id
    expected = hf_tokenizer.decode(new[:new.index(end)] if end in new else new, skip_special_tokens=True)
    capsys.readouterr()
    assert cli.main(["generate", str(tmp_path / "hf"), "--chat", "--prompt", "alpha beta", "--max-new-tokens", "8"]) == 0
    assert len(expected) > 3 and capsys.readouterr().out == expected + "\n"


@pytest.mark.parametrize("case, message", [
    ("no_template", r"tokenizer .*tok has no chat template \(neither chat_template.jinja nor 'chat_template' in tokenizer_config.json\)"),
    ("bad_line", r"bad.jsonl:2 has neither 'prompt' and 'completion' strings nor a 'messages' list \(keys text\)"),
    ("both_forms", r"both.jsonl:2 has both 'messages' and 'prompt'/'completion'; which one trains is ambiguous"),
    ("too_long", r"long.jsonl:1: the example is \d+ tokens, longer than data.seq_len \+ 1 = 17"),
    ("answers_cut", (r"cut.jsonl: the \d+ train examples keep no answer token once data.truncate=true cut each to data.seq_len \+ 1 = "
                     r"17 tokens; raise data.seq_len so the answers fit$")),
    ("too_few", r"few.jsonl: 2 examples, and data.val_fraction=0.02 puts none of them in validation; data.val_fraction=0.\d+ splits them"),
    ("empty", r"blank.jsonl: no examples; a train/validation split needs at least 2, so add examples or give another data.path$"),
    # tracebacks: a UnicodeDecodeError from json.loads, a TypeError from the tokenizer
    ("not_utf8", r"latin1.jsonl:2 is not UTF-8 text \(byte 0xe9 at offset 13\); convert it"),
    ("surrogate", r"surrogate.jsonl:2 holds a lone surrogate \(\\ud800, from a JSON escape\), which is not text"),
    ("null_content", r"calls.jsonl:2: message 2 is not an object with string 'role' and 'content' "
                     r"\(\{\"role\": \"assistant\", \"content\": null, "),
    # tracebacks: jinja2's TemplateError from a template's raise_exception (Mistral's, Gemma's refuse roles) or its syntax
    ("template_refuses", r"train.jsonl:3: the chat template of .*tok stops with an error: System role not supported; fix the template"),
    ("template_syntax", r"train.jsonl:1: the chat template of .*tok stops with an error: expected token 'end of statement block'"),
    # a traceback: a Python error the template's own code makes
    ("template_type_error", r"train.jsonl:1: the chat template of .*tok stops with an error: TypeError: can only concatenate str"),
])
def test_bad_input_is_one_line_and_writes_nothing(case, message, data, tmp_path, capsys):
    tok_dir, path = data
    if case == "no_template":
        tok_dir = _tokenizer_dir(tmp_path / "tok", template=None)
    elif case == "template_refuses":  # line 3 is the first with a system message
        tok_dir = _tokenizer_dir(tmp_path / "tok", template="{% if messages[0]['role'] == 'system' %}"
                                 "{{ raise_exception('System role not supported') }}{% endif %}" + CHATML)
    elif case == "template_syntax":
        tok_dir = _tokenizer_dir(tmp_path / "tok", template=CHATML.replace("{% endfor %}", "{% endfor"))
    elif case == "template_type_error":
        tok_dir = _tokenizer_dir(tmp_path / "tok", template="{{ messages[0]['content'] + 1 }}" + CHATML)
    elif case == "answers_cut":  # every prompt longer than the sequence: a loss over no token, then a division by zero
        path = _jsonl(tmp_path / "cut.jsonl", [{"prompt": f"{i} " + " ".join(WORDS), "completion": "alpha"} for i in range(200)])
    elif case == "too_few":
        path = _jsonl(tmp_path / "few.jsonl", [{"prompt": "a", "completion": "b"}, {"prompt": "c", "completion": "d"}])
    elif case == "empty":
        path = tmp_path / "blank.jsonl"
        path.write_text("\n\n")
    elif case == "not_utf8":
        path = tmp_path / "latin1.jsonl"
        path.write_bytes(b'{"prompt": "a", "completion": "b"}\n' + '{"prompt": "déjà", "completion": "b"}\n'.encode("latin-1"))
    elif case == "surrogate":
        path = tmp_path / "surrogate.jsonl"
        path.write_text('{"prompt": "a", "completion": "b"}\n{"prompt": "half: \\ud800", "completion": "b"}\n')
    elif case == "both_forms":  # prompt/completion trained and the messages went unread
        path = _jsonl(tmp_path / "both.jsonl", [{"prompt": "a", "completion": "b"},
                                                {"prompt": "c", "completion": "d", "messages": [{"role": "user", "content": "e"}]}])
    elif case == "null_content":  # an OpenAI tool call; which message it was went unsaid
        path = _jsonl(tmp_path / "calls.jsonl", [{"prompt": "a", "completion": "b"}, {"messages": [
            {"role": "user", "content": "c"}, {"role": "assistant", "content": None, "tool_calls": [{"function": {"name": "f"}}]}]}])
    elif case == "bad_line":
        path = _jsonl(tmp_path / "bad.jsonl", [{"prompt": "a", "completion": "b"}, {"text": "c"}])
    else:
        path = _jsonl(tmp_path / "long.jsonl", [{"prompt": " ".join(WORDS * 3), "completion": "alpha"}])
    run_dir = tmp_path / "run"
    status = cli.main(["train", "tiny", "--run-dir", str(run_dir), "data.format=sft", f"data.path={path}", f"data.tokenizer={tok_dir}",
                       "data.seq_len=16", f"model.vocab_size={VOCAB}", "log.progress=false",
                       *(["data.truncate=true"] if case in ("too_few", "answers_cut") else [])])  # the chat template alone is 20 tokens
    err = capsys.readouterr().err.strip()
    assert status == 2 and len(err.splitlines()) == 1, err
    assert re.search(message, err), err
    assert not run_dir.exists()


def _numbered_examples(count=40):
    """Example i is 3 to 12 copies of token i + 1: the examples a batch holds are its tokens."""
    lengths = np.random.default_rng(0).integers(3, 12, size=count)
    return [sft.Example(np.full(n, i + 1, np.int32), np.ones(n, bool)) for i, n in enumerate(lengths)]


def _grain_order(count, seed, scheme=SPREAD_SEEDS):
    """The examples (numbered from 1) in the order grain's shuffle of ``data.seed`` under ``scheme`` reads them."""
    shuffled = sft.grain.MapDataset.source(list(range(count))).shuffle(seed=grain_seed(seed, scheme)).repeat()
    return np.asarray([i + 1 for i in shuffled[:3 * count]])


def _read(batches, count):
    """The examples of the next ``count`` batches of ``_numbered_examples``: the token of each segment of each row."""
    batches = [{k: np.asarray(v) for k, v in next(batches).items()} for _ in range(count)]
    return np.asarray([b["inputs"][row][b["segment_ids"][row] == segment][0] for b in batches
                       for row in range(len(b["inputs"])) for segment in np.unique(b["segment_ids"][row]) if segment])


def _four_devices():
    return NamedSharding(jax.make_mesh((4,), ("data",), devices=jax.devices()[:4], axis_types=(jax.sharding.AxisType.Auto,)),
                         PartitionSpec("data", None))


def test_a_resume_with_another_global_batch_reads_on_from_the_next_example():
    """The packer's position between batches is the count of examples read (a batch is one round of packing), so
    resumed with another global batch, another sequence length or without packing, instruction data goes on at the
    next example, none skipped or read twice; a note says so, and where the stream itself changed, that it did."""
    from jaxtrain.config import Config
    from jaxtrain.train import _data_order_changes

    examples, order, sharding = _numbered_examples(), _grain_order(40, seed=1), _four_devices()  # new runs' order: data.seed spread
    cfg = DataConfig(seq_len=16, format="sft", seed=1)
    first = sft.PackedBatches(examples, cfg, 4, sharding, shuffle_seed=1, repeat=True)
    before = _read(first, 3)
    for changed in (dict(), dict(seq_len=24), dict(pack=False)):
        resumed = sft.PackedBatches(examples, dataclasses.replace(cfg, **changed), 8, sharding, shuffle_seed=1, repeat=True)
        resumed.iterator.set_state(first.iterator.get_state())
        assert resumed.position() == len(before)
        after = _read(resumed, 2)
        np.testing.assert_array_equal(np.sort(np.concatenate([before, after])), np.sort(order[:len(before) + len(after)]))
    was = Config(data=cfg, train=dataclasses.replace(Config().train, global_batch=4))
    here = dataclasses.replace(was, data=dataclasses.replace(cfg, seq_len=24, pack=False, seed=2),
                               train=dataclasses.replace(was.train, global_batch=8))
    assert _data_order_changes(was, here) == {"train.global_batch": ("8", "4", True), "data.seq_len": ("24", "16", True),
                                              "data.seed": ("2", "1", False), "data.pack": ("false", "true", True)}
    text = dataclasses.replace(here, data=dataclasses.replace(here.data, format="text"))  # reads neither pack nor truncate
    assert _data_order_changes(dataclasses.replace(was, data=dataclasses.replace(cfg, format="text")), text) == {
        "train.global_batch": ("8", "4", True), "data.seq_len": ("24", "16", False), "data.seed": ("2", "1", False)}


def _plain_seeds(batches):
    """``batches`` from their beginning shuffled as before data.seed was spread: a run begun before then."""
    batches.iterator.set_state(batches.iterator.get_state() | {SEED_SCHEME: PLAIN_SEEDS})
    return batches


@pytest.mark.parametrize("epochs", [1, 2.5])
def test_train_epochs_of_instruction_data_come_to_the_first_step_whose_packing_has_read_them(data, epochs):
    """As many examples a step as pack into it: train.epochs becomes the steps the run's own batches take to read that
    many epochs of examples, counted at the start (jaxtrain.train.check), and the learning-rate schedule ends there."""
    from jaxtrain.train import check

    tok_dir, path = data
    cfg = with_(small_config(vocab_size=VOCAB), data={"path": str(path), "tokenizer": str(tok_dir), "format": "sft", "seq_len": SEQ,
                                                      "val_fraction": 0.2}, train={"epochs": epochs, "global_batch": 8})
    checked = check(cfg)
    steps = checked.layout.cfg.train.steps
    batches = sft.train_batches(checked.corpus, cfg.data, 8, checked.layout.batch_sharding)
    wanted, read = epochs * len(checked.corpus.train), []
    for _ in range(steps):
        next(batches)
        read.append(batches.position())
    assert read[-2] < wanted <= read[-1] and steps > epochs  # more than one step an epoch: several examples a sequence
    assert learning_rate_schedule(checked.layout.cfg)(steps) == cfg.optim.lr * cfg.optim.min_lr_ratio


def test_epochs_of_instruction_data_counted_from_a_data_position_under_another_batch(data):
    """A resumed run counts its epochs on from its checkpoint's data position (jaxtrain.train._epoch_steps): packed 16
    a batch from the position 3 steps of 8 reached, the steps still to take read past 2.5 epochs, the one before not;
    none where the position has read them."""
    from jaxtrain.data import steps_for_epochs
    from jaxtrain.train import check

    tok_dir, path = data
    cfg = with_(small_config(vocab_size=VOCAB), data={"path": str(path), "tokenizer": str(tok_dir), "format": "sft", "seq_len": SEQ,
                                                      "val_fraction": 0.2}, train={"epochs": 2.5, "global_batch": 8})
    checked = check(cfg)
    sharding, wanted = checked.layout.batch_sharding, 2.5 * len(checked.corpus.train)
    batches = sft.train_batches(checked.corpus, cfg.data, 8, sharding)
    for _ in range(3):
        next(batches)
    start = batches.iterator.get_state()
    steps = steps_for_epochs(checked.corpus, cfg.data, 16, sharding, 2.5, start)
    wider = sft.train_batches(checked.corpus, cfg.data, 16, sharding)
    wider.iterator.set_state(start)
    read = [wider.position()]
    for _ in range(steps):
        next(wider)
        read.append(wider.position())
    assert read[-2] < wanted <= read[-1] and read[0] == batches.position() > 0
    assert steps_for_epochs(checked.corpus, cfg.data, 16, sharding, 2.5, wider.iterator.get_state()) == 0
    batches.iterator.close()
    wider.iterator.close()


def test_nearby_seeds_share_no_epoch_order():
    """grain shuffles epoch e with its seed + e: with data.seed as grain's seed, seed 4's first epoch of instruction
    data was seed 3's second (here one example a sequence, 4 a batch: the same examples in each batch). Spread, the
    epochs of seeds 0..5 are all different."""
    cfg = DataConfig(seq_len=16, format="sft", pack=False)

    def epochs(seed, number=3):
        """The examples of each batch of the first ``number`` epochs (10 batches each), in row order."""
        batches = sft.PackedBatches(_numbered_examples(), cfg, 4, _four_devices(), shuffle_seed=seed, repeat=True)
        read = _read(batches, 10 * number).reshape(number, 40)
        return [tuple(read[e].tolist()) for e in range(number)], [tuple(sorted(batch)) for batch in read.reshape(-1, 4).tolist()]

    seed_3_batches, seed_4_batches = epochs(3)[1], epochs(4)[1]
    assert seed_3_batches[10:20] != seed_4_batches[:10]
    assert len({order for seed in range(6) for order in epochs(seed)[0]}) == 6 * 3


@pytest.mark.parametrize("recorded", [False, True])
def test_a_position_resumes_the_order_of_its_seed_scheme(recorded, tmp_path):
    """A checkpoint written before data.seed was spread records no seed scheme: instruction data resumed from it, in
    its second epoch, reads on in the order it read before (grain's shuffle and packing with data.seed itself), and
    records that scheme in its own checkpoints; a position written since resumes the spread order."""
    from jaxtrain.checkpoint import DataPositionHandler

    cfg = DataConfig(seq_len=16, format="sft", seed=1)
    scheme = SPREAD_SEEDS if recorded else PLAIN_SEEDS

    def stream():
        batches = sft.PackedBatches(_numbered_examples(), cfg, 4, _four_devices(), shuffle_seed=1, repeat=True)
        return batches if recorded else _plain_seeds(batches)

    examples = _read(stream(), 12)  # grain's own order: the plain one is data.seed's
    np.testing.assert_array_equal(np.sort(examples), np.sort(_grain_order(40, seed=1, scheme=scheme)[:len(examples)]))
    whole = stream()
    uninterrupted = [{k: np.asarray(v) for k, v in next(whole).items()} for _ in range(12)]
    first = stream()
    for _ in range(8):  # into the second epoch: more than the 40 examples read
        next(first)
    DataPositionHandler().save(tmp_path, first.iterator)
    (written,) = tmp_path.glob("process_*.json")
    position = json.loads(written.read_text())
    assert position[SEED_SCHEME] == scheme and position["parent"]["next_index"] > 40
    if not recorded:  # as a checkpoint of jaxtrain before the spread wrote it
        written.write_text(json.dumps({key: value for key, value in position.items() if key != SEED_SCHEME}))
    resumed = sft.PackedBatches(_numbered_examples(), cfg, 4, _four_devices(), shuffle_seed=1, repeat=True)
    DataPositionHandler().restore(tmp_path, resumed.iterator)
    assert resumed.iterator.seed_scheme == scheme and resumed.iterator.get_state() == position
    for want in uninterrupted[8:]:
        got = next(resumed)
        for key in want:
            np.testing.assert_array_equal(np.asarray(got[key]), want[key])
