"""Generation with a key/value cache: equal to re-running the whole forward, on one device and on the
cpu8 mesh; prefill equal to the training forward; seeded sampling; the command line end to end."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from conftest import REPO, run_cli, small_config, with_
from jaxtrain.config import SamplingConfig
from jaxtrain.generate import Loaded, generate
from jaxtrain.partitioning import model_tracing
from jaxtrain.train import make_layout
from models.llama import KVCache

NEW_TOKENS = 32
# init_std 0.3: decisive logits, so the greedy continuation is far from ties and varied
MODEL = {"init_std": 0.3, "vocab_size": 64}


def _loaded(rules, mesh, devices) -> Loaded:
    cfg = small_config(rules, mesh, **MODEL)
    layout = make_layout(cfg, devices)
    params = jax.jit(lambda: nnx.to_pure_dict(nnx.state(_model(cfg.model))), out_shardings=layout.shardings.params)()
    return Loaded(cfg.model, params, layout.mesh, layout.rules, cfg.rules, encode=None, decode=None)


def _model(model_cfg):
    from models.llama import Llama

    return Llama(model_cfg, rngs=nnx.Rngs(0))


def _prompts(batch, length=5) -> np.ndarray:
    return np.random.default_rng(1).integers(0, MODEL["vocab_size"], (batch, length)).astype(np.int32)


def _greedy_without_cache(loaded: Loaded, prompts: np.ndarray) -> np.ndarray:
    """The whole forward re-run on the growing sequence, argmax of the last position each time (one
    compiled shape: the sequence padded to its final length; causal attention ignores the padding)."""
    params = jax.device_get(loaded.params)
    graphdef = nnx.split(_model(loaded.model_cfg))[0]
    forward = jax.jit(lambda tokens: nnx.merge(graphdef, params)(tokens))
    batch, length = prompts.shape
    sequence = np.zeros((batch, length + NEW_TOKENS), np.int32)
    sequence[:, :length] = prompts
    for position in range(length, length + NEW_TOKENS):
        sequence[:, position] = np.argmax(np.asarray(forward(sequence))[:, position - 1], axis=-1)
    return sequence[:, length:]


@pytest.mark.parametrize("rules, mesh, devices, batch", [("dp", (1, 1, 1), 1, 2), ("fsdp_tp", (2, 2, 2), 8, 4),
                                                         ("fsdp_tp", (2, 2, 2), 8, 1)])
def test_greedy_with_cache_equals_full_forward(rules, mesh, devices, batch):
    loaded = _loaded(rules, mesh, jax.devices()[:devices])
    prompts = _prompts(batch)
    out = generate(loaded, prompts, SamplingConfig(max_new_tokens=NEW_TOKENS))
    assert out.tokens.shape == (batch, NEW_TOKENS)
    assert len(np.unique(out.tokens)) > 8  # a varied continuation, not one token repeated
    np.testing.assert_array_equal(out.tokens, _greedy_without_cache(loaded, prompts))
    assert out.prefill_tokens_per_s > 0 and out.decode_tokens_per_s > 0


def test_prefill_logits_equal_training_forward():
    loaded = _loaded("fsdp_tp", (2, 2, 2), jax.devices())
    cfg, prompts = loaded.model_cfg, _prompts(4, 12)
    graphdef = nnx.split(_model(cfg))[0]

    def prefill_logits(params, tokens):
        model = nnx.merge(graphdef, params)
        hidden, cache = model.extend(tokens, KVCache.zeros(cfg, tokens.shape[0], tokens.shape[1] + 7))
        return model.logits(hidden), cache.length

    with model_tracing(loaded.mesh, loaded.rules, "fsdp_tp"):
        logits, length = jax.jit(prefill_logits)(loaded.params, prompts)
        reference = jax.jit(lambda params, tokens: nnx.merge(graphdef, params)(tokens))(loaded.params, prompts)
    assert int(length) == 12
    np.testing.assert_allclose(logits, reference, rtol=1e-5, atol=1e-5)
