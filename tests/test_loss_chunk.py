"""The loss: train.loss_chunk's chunked cross-entropy gives the same loss and gradients as the whole-sequence
one, on one device and on meshes (its backward written out: jaxtrain/models/llama.py _chunked_loss), with a smaller compiled
working set, and a chunk that does not divide the sequence is a UserError; jaxtrain.step.cross_entropy equals
optax's with a backward that scatters nothing."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from conftest import small_config, with_
from jaxtrain.adapt.adapters import join_frozen
from jaxtrain.config import check
from jaxtrain.errors import UserError
from jaxtrain.state import init_state
from jaxtrain.step import cross_entropy, token_nll
from jaxtrain.layout import lower_train_step, make_layout
from jaxtrain.partitioning import model_tracing
from jaxtrain.models.config import LoraConfig


def _compiled_and_grads(cfg, batch):
    layout = make_layout(cfg, jax.devices()[:1])
    params = init_state(cfg.model, layout.tx, 0, layout.shardings).params
    loss, grads = jax.value_and_grad(lambda p: token_nll(layout.spec.graphdef, p, batch, cfg.train.loss_chunk).mean())(params)
    return lower_train_step(layout).compile(), loss, grads


def test_chunked_loss_matches_whole_sequence_and_uses_less_memory():
    whole = small_config(rules="dp", mesh=(1, 1, 1), vocab_size=2048, tie_embeddings=True)
    whole = with_(whole, data={"seq_len": 64})
    rng = np.random.default_rng(0)
    batch = {k: rng.integers(0, 2048, (8, 64)).astype(np.int32) for k in ("inputs", "targets")}
    compiled_whole, loss_whole, grads_whole = _compiled_and_grads(whole, batch)
    compiled_chunk, loss_chunk, grads_chunk = _compiled_and_grads(with_(whole, train={"loss_chunk": 8}), batch)
    np.testing.assert_allclose(loss_chunk, loss_whole, rtol=1e-6)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-7), grads_chunk, grads_whole)
    # float32 logits of the whole sequence: 8 x 64 x 2048 x 4 bytes = 4 MiB, and their gradient
    saved = compiled_whole.memory_analysis().temp_size_in_bytes - compiled_chunk.memory_analysis().temp_size_in_bytes
    assert saved > 4 * 2**20


@pytest.mark.parametrize("rules,mesh,model", [
    ("fsdp", (2, 4, 1), {}), ("fsdp", (2, 4, 1), {"tie_embeddings": True}), ("fsdp_tp", (2, 2, 2), {}), ("dp", (8, 1, 1), {}),
    ("zero2", (8, 1, 1), {}), ("fsdp", (2, 4, 1), {"lora": LoraConfig(rank=4, alpha=8.0)}),
])
def test_chunked_loss_matches_whole_sequence_on_a_mesh(rules, mesh, model):
    """The output table gathered once for the chunks (FSDP), each chunk's gradient of it reduce-scattered over the
    batch's axes and summed in float32, a LoRA run's frozen table given none: the whole sequence's loss and gradients."""
    cfg = with_(small_config(rules, mesh, vocab_size=512, **model), data={"seq_len": 64})
    layout = make_layout(cfg)
    state = init_state(cfg.model, layout.tx, 0, layout.shardings)
    rng = np.random.default_rng(0)
    batch = {k: rng.integers(0, 512, (8, 64)).astype(np.int32) for k in ("inputs", "targets")}

    def loss_and_grads(chunk):
        with model_tracing(layout.mesh, layout.rules, cfg.rules):
            mean_nll = lambda p: token_nll(layout.spec.graphdef, join_frozen(state.frozen, p), batch, chunk).mean()  # noqa: E731
            return jax.jit(jax.value_and_grad(mean_nll))(state.params)

    (loss_whole, grads_whole), (loss_chunk, grads_chunk) = (loss_and_grads(c) for c in (0, 8))
    np.testing.assert_allclose(loss_chunk, loss_whole, rtol=1e-6)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-7), grads_chunk, grads_whole)


def test_loss_chunk_must_divide_seq_len():
    with pytest.raises(UserError, match=r"train.loss_chunk=5 must be 0 \(off\) or a positive divisor of data.seq_len=16"):
        check(with_(small_config(), train={"loss_chunk": 5}))


def test_cross_entropy_equals_optax_and_its_backward_scatters_nothing():
    """jaxtrain.step.cross_entropy: optax's values and gradients; its backward is softmax minus the one-hot in one
    elementwise pass, where optax's scatters into a zeroed float32 array of the logits' size."""
    rng = np.random.default_rng(0)
    logits = jnp.asarray(rng.normal(0, 3, (3, 5, 37)), jnp.float32)
    targets = jnp.asarray(rng.integers(0, 37, (3, 5)), jnp.int32)
    weights = jnp.asarray(rng.random((3, 5)), jnp.float32)  # a cotangent other than ones
    ours, theirs = cross_entropy, optax.softmax_cross_entropy_with_integer_labels
    np.testing.assert_allclose(ours(logits, targets), theirs(logits, targets), rtol=1e-6)
    grad = {f: jax.jit(jax.grad(lambda x, f=f: (f(x, targets) * weights).sum())) for f in (ours, theirs)}
    np.testing.assert_allclose(grad[ours](logits), grad[theirs](logits), atol=1e-6)
    # in the program jax hands XLA: XLA:CPU's older code generator (the tests' conftest) compiles a scatter to a loop
    scatters = {f: "stablehlo.scatter" in g.lower(logits).as_text() for f, g in grad.items()}
    assert scatters == {ours: False, theirs: True}
