"""Text generation with a key/value cache through the model's own layers (``Llama.extend``), jitted and
sharded with the run's rules.

``load(path)`` gives a ``Loaded`` model (config, parameters on the mesh, encode, decode) from a run
directory or a Hugging Face model directory; ``generate`` runs a prefill of the prompts, which fills a
fixed-size cache (prompt + max_new_tokens), then a ``lax.while_loop`` of one-token decoding steps over it, until
every sequence has made one of the stop tokens:
greedy at temperature 0, else temperature and top-p (nucleus) sampling from a seed.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import time
from pathlib import Path
from typing import Callable, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import psutil
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxtrain import checkpoint as checkpoint_lib
from jaxtrain import config as config_lib
from jaxtrain.adapt import lora as lora_lib
from jaxtrain.config import Config, MeshConfig, SamplingConfig
from jaxtrain.data.sft import ChatTemplate
from jaxtrain.data import token_file
from jaxtrain.data.documents import is_byte_level
from jaxtrain.data.tokenizer import TOKENIZER_FILE, RawBytes, TextTokenizer, load_tokenizer
from jaxtrain.errors import UserError
from jaxtrain.interop import hf_config, hf_import, hf_weights
from jaxtrain.layout import make_layout
from jaxtrain.mesh import build_mesh
from jaxtrain.partitioning import (Rules, batch_sharding, check_rules_against_mesh, load_rules, logical_to_spec, logical_ways,
                                  model_tracing)
from jaxtrain.state import model_spec
from jaxtrain.models.config import LlamaConfig
from jaxtrain.models.llama import KVCache

Encode = Callable[[str], list[int]]
# (new token ids, prompt=the prompt's token ids) -> the text the new tokens add after the prompt
Decode = Callable[..., str]


class Codec(NamedTuple):
    """How a model reads a prompt and writes its output."""

    encode: Encode  # prompt text -> token ids
    decode: Decode  # (new token ids, prompt=its token ids) -> text to print after the prompt, up to the first of ``stops``
    # the tokens that end a text (the end of text or a Hugging Face model's eos_token_id, as transformers' generate
    # stops; the chat turn's end): (): none, generate them all
    stops: tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class Loaded:
    """A model ready to generate: what every source (``load_run``, ``load_hf``) gives."""

    model_cfg: LlamaConfig
    params: dict  # placed on ``mesh`` with the rule set's shardings
    mesh: Mesh
    mesh_config: MeshConfig  # what ``mesh`` was built from: adapters added later are restored onto the same one
    rules: Rules
    rules_name: str
    encode: Encode  # prompt text -> token ids
    decode: Decode  # (new token ids, prompt=its token ids) -> text to print after the prompt
    stops: tuple[int, ...] = ()  # Codec.stops: generation ends once every sequence has made one


@dataclasses.dataclass(frozen=True)
class Generation:
    tokens: np.ndarray  # (batch, max_new_tokens) int32: the new tokens only; after a sequence's stop token, that token again
    prompt_tokens: int  # across the batch
    prefill_s: float  # prompt through the layers and the first new token (compiled, timed apart from compiling)
    decode_s: float  # the decoding steps after it
    compile_s: float
    decode_steps: int  # at most max_new_tokens - 1: fewer where every sequence made a stop token sooner

    @property
    def prefill_tokens_per_s(self) -> float:
        return self.prompt_tokens / self.prefill_s

    @property
    def decode_tokens_per_s(self) -> float | None:
        steps = self.tokens.shape[0] * self.decode_steps
        return steps / self.decode_s if steps else None


# ---------------------------------------------------------------------------------------------
# loading


def load(path: Path, mesh: str | None = None, rules: str | None = None, chat: bool = False,
         codec: Codec | None = None) -> Loaded:
    """The model of ``path``: a training run directory (config.yaml, checkpoints/) or a Hugging Face model
    directory (config.json, safetensors). ``mesh`` / ``rules`` replace the run's own (e.g. generating on one
    GPU from a run trained on many); a Hugging Face model defaults to every device on fsdp, rules fsdp_tp.
    ``codec``: ``load_codec(path, chat)``'s, when the caller already has it."""
    codec = codec or load_codec(path, chat)
    return load_hf(path, mesh, rules, codec) if hf_config.is_hf_dir(path) else load_run(path, mesh, rules, codec)


def load_codec(path: Path, chat: bool = False) -> Codec:
    """How ``load(path)``'s model reads a prompt and writes its output, known before any weight is read. With
    ``chat`` a prompt is one user message rendered with the tokenizer's chat template."""
    if hf_config.is_hf_dir(path):
        vocab = _hf_model_config(path, Config()).model.vocab_size
        return chat_codec(path, vocab) if chat else _hf_codec(vocab, path)
    cfg = config_lib.load_run_config(path)
    return chat_codec(path, cfg.model.vocab_size) if chat else codec(cfg, path)


def _with_layout(cfg: Config, mesh: str | None, rules: str | None) -> Config:
    if mesh:
        cfg = dataclasses.replace(cfg, mesh=config_lib.load_mesh_file(mesh))
    return dataclasses.replace(cfg, rules=rules) if rules else cfg


def load_run(run_dir: Path, mesh: str | None, rules: str | None, codec: Codec) -> Loaded:
    """A run's parameters from its latest checkpoint (a LoRA run's adapters merged into its base)."""
    cfg = _with_layout(config_lib.weights_on_device(config_lib.load_run_config(run_dir)), mesh, rules)
    layout = make_layout(cfg, train_batch=False)
    if cfg.model.lora.rank:  # a LoRA run: its adapters merged into its base
        params = lora_lib.merged_run_params(layout, run_dir, source="jaxtrain generate")
        return Loaded(lora_lib.plain_config(cfg.model), params, layout.mesh, cfg.mesh, layout.rules, cfg.rules, *codec)
    params = checkpoint_lib.restore_from(run_dir, layout.abstract_state(), None, params_only=True, source="jaxtrain generate")
    return Loaded(cfg.model, params, layout.mesh, cfg.mesh, layout.rules, cfg.rules, *codec)


def _hf_model_config(hf_dir: Path, cfg: Config) -> Config:
    """``cfg`` with the Hugging Face model's shapes, computing in float32 (so greedy output equals transformers')."""
    # seq_len 0: no training sequence to hold within a sliding window; generate's context stops at it (cli.py)
    return dataclasses.replace(cfg, model=hf_config.model_config(hf_dir, LlamaConfig(dtype="float32"), set(), seq_len=0))


def load_hf(hf_dir: Path, mesh: str | None, rules: str | None, codec: Codec) -> Loaded:
    """A Hugging Face model's weights, computing in float32."""
    cfg = _hf_model_config(hf_dir, _with_layout(Config(), mesh, rules))
    hf_weights.check_dir(hf_dir, cfg.model)
    layout = make_layout(cfg, train_batch=False)
    params = hf_import.load_params(hf_dir, cfg.model, layout.abstract_state().params)
    return Loaded(cfg.model, params, layout.mesh, cfg.mesh, layout.rules, cfg.rules, *codec)


def codec(cfg: Config, run_dir: Path) -> Codec:
    """The run's own encoding: its ``data.tokenizer``; else UTF-8 bytes for byte-level text runs (the standard
    library or a text directory); else, for a token file, the tokenizer its sidecar or ``--init-from HF_DIR``
    names (kept in RUN_DIR/hf/), or token ids written as numbers when there is none."""
    vocab = cfg.model.vocab_size
    if is_byte_level(cfg.data.tokenizer, cfg.data.path):
        return Codec(lambda text: _in_vocab(list(text.encode("utf-8")), vocab, "a byte of the prompt's UTF-8"),
                     lambda ids, prompt=(): _bytes_to_text(ids), (RawBytes().end_of_text,))  # bytes decode alike after any prompt
    found = run_tokenizer(cfg, run_dir)
    return _token_codec(vocab, None if found is None else load_tokenizer(found),
                        hf_config.end_of_sequence_ids(run_dir / hf_import.RUN_SUBDIR))


def run_tokenizer(cfg: Config, run_dir: Path) -> Path | None:
    """The tokenizer a run's text goes through: its ``data.tokenizer``; else the one ``--init-from HF_DIR`` brought
    (RUN_DIR/hf/); else the one its token file's sidecar names, where that file is still there; else None."""
    if cfg.data.tokenizer:
        return Path(cfg.data.tokenizer)
    kept = run_dir / hf_import.RUN_SUBDIR / TOKENIZER_FILE
    if kept.is_file():
        return kept
    made_with = token_file.tokenizer_of(cfg.data.path)
    return None if made_with is None else Path(made_with)


def chat_codec(path: Path, vocab: int) -> Codec:
    """A prompt as one user turn of the chat template, ready for the answer; the answer decoded up to the end of its turn
    (or the model's eos_token_id, where transformers' generate stops too)."""
    model_dir = path if hf_config.is_hf_dir(path) else path / hf_import.RUN_SUBDIR
    if hf_config.is_hf_dir(path):
        file = path / TOKENIZER_FILE
    else:
        file = run_tokenizer(config_lib.load_run_config(path), path) or model_dir / TOKENIZER_FILE
    if not (file / TOKENIZER_FILE if file.is_dir() else file).is_file():
        raise UserError(f"--chat: {path} has no tokenizer, so no chat template; generate without --chat, or from a model "
                        "with a tokenizer directory holding a chat template")
    template = ChatTemplate(load_tokenizer(file))
    stops = tuple(dict.fromkeys((template.end_of_turn(), *hf_config.end_of_sequence_ids(model_dir))))

    def decode(ids: Sequence[int], prompt: Sequence[int] = ()) -> str:  # the answer is printed alone, not after the prompt
        return template.tokenizer.tokenizer.decode(_until(ids, stops), skip_special_tokens=True)

    return Codec(lambda text: _in_vocab(template.prompt_tokens(text), vocab, "a prompt token id"), decode, stops)


def _until(ids: Sequence[int], ends: tuple[int, ...]) -> list[int]:
    """``ids`` up to the first of the ``ends`` tokens: what the model generates after it belongs to another text."""
    ids = [int(i) for i in ids]
    return next((ids[:at] for at, i in enumerate(ids) if i in ends), ids)


def _hf_codec(vocab: int, hf_dir: Path) -> Codec:
    """A Hugging Face model's tokenizer.json when it has one, else token ids."""
    return _token_codec(vocab, load_tokenizer(hf_dir) if (hf_dir / TOKENIZER_FILE).is_file() else None,
                        hf_config.end_of_sequence_ids(hf_dir))


def _token_codec(vocab: int, tokenizer: TextTokenizer | None, eos_ids: tuple[int, ...]) -> Codec:
    """A ``tokenizers`` tokenizer when there is one, else token ids written as numbers, each after a space (so the
    prompt's ids and the new ones print as one sequence, as text prompts print with their continuation); the output
    up to the first of the model's ``eos_ids`` (a Hugging Face model's, where transformers' generate stops: an instruct
    model's end of turn among them), else of the tokenizer's end-of-text token."""
    if tokenizer is None:
        return Codec(lambda text: _in_vocab(_ids(text), vocab, "a prompt token id"),
                     lambda ids, prompt=(): "".join(f" {i}" for i in _until(ids, eos_ids)), eos_ids)
    # up to the end of text, as byte-level runs' output stops at theirs (it was printed on into the next document)
    stops = eos_ids or (tokenizer.end_of_text,)

    def decode(ids: Sequence[int], prompt: Sequence[int] = ()) -> str:
        """Decoded after the prompt's tokens, less the prompt's text: decoded alone, the first new token lost its leading
        space to a SentencePiece-style decoder (Llama 2's, Mistral's), and "Hello" + " world" printed as "Helloworld"."""
        prompt, new = [int(i) for i in prompt], _until(ids, stops)
        before = tokenizer.tokenizer.decode(prompt, skip_special_tokens=True)
        whole = tokenizer.tokenizer.decode(prompt + new, skip_special_tokens=True)
        # (a decoder that rewrote the prompt's text for what follows: the new tokens alone)
        return whole[len(before):] if whole.startswith(before) else tokenizer.tokenizer.decode(new, skip_special_tokens=True)

    return Codec(lambda text: _in_vocab(tokenizer.tokenizer.encode(text).ids, vocab, "a prompt token id"), decode, stops)


def _bytes_to_text(ids: Sequence[int]) -> str:
    """Up to the first document separator (the model's end of text), invalid UTF-8 shown as U+FFFD."""
    raw = RawBytes()
    data = bytes(int(i) % raw.vocab_size for i in ids)
    return data.split(bytes([raw.end_of_text]))[0].decode("utf-8", errors="replace")


def _ids(text: str) -> list[int]:
    try:
        return [int(t) for t in text.replace(",", " ").split()]
    except ValueError:
        raise UserError(f"--prompt {text!r}: this model has no tokenizer, so the prompt is token ids, e.g. --prompt '12 7 99'") from None


def _in_vocab(ids: list[int], vocab: int, what: str) -> list[int]:
    if not ids:
        raise UserError("--prompt is empty; give at least one token of text")
    bad = [i for i in ids if not 0 <= i < vocab]
    if bad:
        raise UserError(f"{what} is {bad[0]}, outside the model's vocabulary of {vocab} (model.vocab_size); use tokens below {vocab}")
    return ids


# ---------------------------------------------------------------------------------------------
# what a request needs, before any weight is read

MAX_POSITIONS = 2**31 - 1  # positions (the cache's length, rotary positions) are int32


def _gib(n: float) -> str:
    return f"{n / 2**30:,.1f} GiB" if n >= 2**30 / 10 else f"{n / 2**20:,.1f} MiB"


def check_request(path: Path, mesh: str | None, rules: str | None, batch: int, prompt_len: int, new: int) -> None:
    """Raise UserError when ``batch`` prompts of ``prompt_len`` tokens and ``new`` new tokens need more positions than
    int32 holds, or a key/value cache (``KVCache.zeros``: prompt + new positions in the compute dtype, sharded as
    ``_compiled`` shards it) larger than the memory there is: a device's ``bytes_limit`` where jax reports one, else
    (CPU devices, which all hold their shards in the host's memory) the host's available memory. Reads only the
    configs, so a request that cannot run fails in a line, not in an allocation after the weights are read."""
    length = prompt_len + new
    if length > MAX_POSITIONS:
        raise UserError(f"--max-new-tokens {new} with a prompt of {prompt_len} tokens makes {length} positions, more than the "
                        f"{MAX_POSITIONS} an int32 position holds; give --max-new-tokens {MAX_POSITIONS - prompt_len} or less")
    cfg = _hf_model_config(path, _with_layout(Config(), mesh, rules)) if hf_config.is_hf_dir(path) else \
        _with_layout(config_lib.load_run_config(path), mesh, rules)
    model = lora_lib.plain_config(cfg.model)
    built = build_mesh(cfg.mesh)
    rules = load_rules(cfg.rules)
    check_rules_against_mesh(rules, built, cfg.rules)  # a rule over an axis the mesh lacks: one line, not a KeyError below
    cache_rules = generation_rules(rules, built, batch)
    itemsize = jnp.dtype(model.dtype).itemsize
    # (layers, batch, length, kv heads, head dim); the length is counted apart, to find the most that fits
    sizes = (model.num_layers, batch, 1, model.num_kv_heads, model.resolved_head_dim)
    ways = [logical_ways(cache_rules, built, axis) for axis in KVCache.AXES]
    # bytes of keys and values per position on one device: its shard of every other dimension
    shard_position = 2 * itemsize * math.prod(-(-size // w) for size, w in zip(sizes, ways, strict=True))
    stats = [d.memory_stats() or {} for d in built.devices.flat]
    if all("bytes_limit" in s for s in stats):
        available, copies = min(s["bytes_limit"] for s in stats), 1
        where = f"a device's {_gib(available)} (memory_stats bytes_limit)"
    else:  # CPU devices: each one's shard, and copies of what is replicated, all in the host's memory
        available, copies = psutil.virtual_memory().available, built.devices.size
        where = f"the {_gib(available)} of host memory available"
    per_position = shard_position * copies
    needed = per_position * -(-length // ways[2])
    if needed <= available:
        return
    total = 2 * model.num_layers * batch * length * model.num_kv_heads * model.resolved_head_dim * itemsize
    formula = (f"{model.num_layers} layers x 2 (keys, values) x batch {batch} x {length} positions x {model.num_kv_heads} kv heads "
               f"x {model.resolved_head_dim} head dim x {itemsize} bytes ({model.dtype})")
    if needed == total:
        held = ""
    elif copies == 1:
        held = f", {_gib(needed)} of it on each device"
    else:
        held = f", {_gib(needed)} with the copies its sharding keeps on the {copies} CPU devices"
    fits = min(available // per_position * ways[2], MAX_POSITIONS) - prompt_len
    # the cache alone: the weights and activations need room too, so this is an upper bound
    fix = f"give --max-new-tokens {fits} or less (the weights need room too)" if fits >= 1 else "shorten the prompt"
    raise UserError(f"--max-new-tokens {new} with a prompt of {prompt_len} tokens needs a key/value cache of {_gib(total)} "
                    f"({formula}){held}, more than {where}; {fix}")


# ---------------------------------------------------------------------------------------------
# sampling


def nucleus(logits: jax.Array, top_p: float) -> jax.Array:
    """``logits`` with every token outside the smallest most-likely set whose probability reaches
    ``top_p`` set to -inf (the most likely token always stays)."""
    descending = -jnp.sort(-logits, axis=-1)
    probs = jax.nn.softmax(descending, axis=-1)
    kept = jnp.cumsum(probs, axis=-1) - probs < top_p  # the probability of the more likely tokens
    # the most likely token always: XLA:CPU reads a top_p below float32's smallest normal number (1.2e-38) as 0, and that
    # kept none (every logit -inf, so token 0 was drawn, not the most likely)
    kept = kept.at[..., 0].set(True)
    threshold = jnp.min(jnp.where(kept, descending, jnp.inf), axis=-1, keepdims=True)
    return jnp.where(logits >= threshold, logits, -jnp.inf)


def sample(logits: jax.Array, key: jax.Array, temperature: jax.Array, top_p: jax.Array) -> jax.Array:
    """logits (batch, vocab) float32 -> token ids (batch,) int32. ``temperature`` and ``top_p`` are traced
    scalars, so one compiled program serves every setting."""

    def draw(logits):
        # shifted to a maximum of 0 first (the same distribution): divided by a tiny temperature (2e-38 is allowed) the
        # largest logits overflowed to inf and tied, and the draw was the first of them, not the most likely token
        logits = (logits - jnp.max(logits, axis=-1, keepdims=True)) / temperature
        logits = jax.lax.cond(top_p < 1, nucleus, lambda x, _: x, logits, top_p)
        return jax.random.categorical(key, logits, axis=-1).astype(jnp.int32)

    return jax.lax.cond(temperature > 0, draw, lambda x: jnp.argmax(x, axis=-1).astype(jnp.int32), logits)


# ---------------------------------------------------------------------------------------------
# generation


def generation_rules(rules: Rules, mesh: Mesh, batch: int) -> Rules:
    """The run's rules, with the batch left whole when the prompts do not fill its shards (one prompt)."""
    if batch % logical_ways(rules, mesh, "activation_batch"):
        return rules | {"activation_batch": None}
    return rules


def routing_every_token(cfg: LlamaConfig) -> LlamaConfig:
    """``cfg`` with its experts (if any) taking every token routed to them (dropless dispatch). Capacity dispatch drops
    an assignment by the whole sequence, later tokens included, which a key/value cache never sees: the prefill dropped
    the prompt's assignments at the prompt's length, a decoding step's one token none, so the greedy tokens were not the
    model's on the same text. Routed every token, they are, and they are what the run's export-hf computes."""
    if cfg.moe.num_experts and cfg.moe.dispatch == "capacity":
        return dataclasses.replace(cfg, moe=dataclasses.replace(cfg.moe, dispatch="dropless"))
    return cfg


def generate(loaded: Loaded, prompts: np.ndarray, sampling: SamplingConfig, stops: tuple[int, ...] = ()) -> Generation:
    """``prompts`` (batch, length) int32, all of one length -> ``sampling.max_new_tokens`` new tokens each; with ``stops``
    (e.g. ``loaded.stops``) decoding ends once every sequence has made one of those tokens, and each holds its own from
    there on.
    The compiled prefill and decode are kept for later calls with the same shapes and max_new_tokens."""
    batch, prompt_len = prompts.shape
    rules = generation_rules(loaded.rules, loaded.mesh, batch)
    param_shardings = jax.tree.flatten(jax.tree.map(lambda x: x.sharding, loaded.params))
    start = time.perf_counter()
    prefill, decode = _compiled(routing_every_token(loaded.model_cfg), loaded.mesh, tuple(rules.items()), loaded.rules_name,
                                (param_shardings[1], tuple(param_shardings[0])), batch, prompt_len, sampling.max_new_tokens,
                                _stop_slots(stops))
    compile_s = time.perf_counter() - start
    prompt = jax.device_put(np.asarray(prompts, np.int32), batch_sharding(rules, loaded.mesh))
    knobs = jax.device_put(_knobs(sampling, stops), NamedSharding(loaded.mesh, PartitionSpec()))

    start = time.perf_counter()
    cache, first = jax.block_until_ready(prefill(loaded.params, prompt, knobs))
    prefill_s = time.perf_counter() - start
    start = time.perf_counter()
    rest, steps = jax.block_until_ready(decode(loaded.params, cache, first, knobs)[::2]) if decode else (np.zeros((batch, 0), np.int32), 0)
    decode_s = time.perf_counter() - start
    tokens = np.concatenate([np.asarray(first)[:, None], np.asarray(rest)], axis=1)
    return Generation(tokens, batch * prompt_len, prefill_s, decode_s, compile_s, int(steps))


STOP_SLOTS = 8  # stop tokens a compiled program takes (more: the next multiple): a model's few, and none filled with -1


def _stop_slots(stops: tuple[int, ...]) -> int:
    return max(1, math.ceil(len(stops) / STOP_SLOTS)) * STOP_SLOTS


def _knobs(sampling: SamplingConfig, stops: tuple[int, ...] = ()) -> dict[str, np.ndarray]:
    # uint32: every seed SamplingConfig allows (jax keys keep 32 bits), and the same key as an int32 below 2**31; stops -1: none
    return {"seed": np.uint32(sampling.seed), "temperature": np.float32(sampling.temperature), "top_p": np.float32(sampling.top_p),
            "stops": np.array([*stops, *[-1] * (_stop_slots(stops) - len(stops))], np.int32)}


def _sample_at(logits, knobs, index):
    """The token drawn for new token number ``index``: its own key from the seed."""
    key = jax.random.fold_in(jax.random.key(knobs["seed"]), index)
    return sample(logits, key, knobs["temperature"], knobs["top_p"])


@functools.lru_cache(maxsize=8)
def _compiled(cfg: LlamaConfig, mesh: Mesh, rule_items: tuple, rules_name: str, param_shardings: tuple, batch: int,
              prompt_len: int, new: int, stop_slots: int):
    """(prefill, decode) compiled for these shapes and shardings; decode is None for a single new token.

    prefill(params, prompt, knobs) -> (cache, first token); decode(params, cache (donated), token, knobs) ->
    (the other new - 1 tokens (batch, new - 1), cache, the decoding steps run). knobs: seed, temperature, top_p, stops
    (``_knobs``, ``stop_slots`` of them)."""
    rules = dict(rule_items)
    spec = model_spec(cfg)
    graphdef, params_sharding = spec.graphdef, jax.tree.unflatten(*param_shardings)

    def sharding(*logical) -> NamedSharding:
        return NamedSharding(mesh, logical_to_spec(logical, rules, "generation"))

    replicated = NamedSharding(mesh, PartitionSpec())
    cache_sharding = KVCache(sharding(*KVCache.AXES), sharding(*KVCache.AXES), replicated)
    token_sharding = sharding("activation_batch")

    def prefill(params, prompt, knobs):
        model = nnx.merge(graphdef, params)
        hidden, cache = model.extend(prompt, KVCache.zeros(cfg, batch, prompt_len + new))
        return cache, _sample_at(model.logits(hidden[:, -1:])[:, 0], knobs, 0)

    def decode(params, cache, token, knobs):
        model = nnx.merge(graphdef, params)

        def stopped(token):  # (-1 fills the unused slots: no token is)
            return jnp.any(token[:, None] == knobs["stops"][None, :], axis=1)

        def going(carry):  # a step left, and a sequence that has not made a stop token
            index, _, _, _, done = carry
            return (index < new) & ~jnp.all(done)

        def step(carry):
            index, cache, token, tokens, done = carry
            hidden, cache = model.extend(token[:, None], cache)
            token = jnp.where(done, token, _sample_at(model.logits(hidden)[:, 0], knobs, index))  # a stopped one holds its own
            return index + 1, cache, token, tokens.at[:, index - 1].set(token), done | stopped(token)

        tokens = jnp.zeros((batch, new - 1), jnp.int32)
        index, cache, token, tokens, _ = jax.lax.while_loop(going, step, (jnp.int32(1), cache, token, tokens, stopped(token)))
        # the steps not run (every sequence had stopped): each sequence's stop token
        tokens = jnp.where(jnp.arange(new - 1)[None, :] >= index - 1, token[:, None], tokens)
        return tokens, cache, index - 1  # the cache returned, so the donated cache's buffers can hold it

    params = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), spec.shapes, params_sharding)
    prompt = jax.ShapeDtypeStruct((batch, prompt_len), jnp.int32, sharding=batch_sharding(rules, mesh))
    knobs = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=replicated),
                         _knobs(SamplingConfig(), (-1,) * stop_slots))
    with model_tracing(mesh, rules, rules_name):
        prefill = jax.jit(prefill, out_shardings=(cache_sharding, token_sharding)).lower(params, prompt, knobs).compile()
        if new == 1:
            return prefill, None
        cache, token = prefill.out_info
        decode = jax.jit(decode, out_shardings=(sharding("activation_batch", None), cache_sharding, replicated), donate_argnums=1)
        return prefill, decode.lower(params, cache, token, knobs).compile()
