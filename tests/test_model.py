import dataclasses
import re
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxtrain.models.config import REMAT_POLICIES, LlamaConfig
from jaxtrain.models.layers import RMSNorm
from jaxtrain.models.llama import REMAT_POLICY_FNS, Llama

CFG = LlamaConfig(vocab_size=64, d_model=32, num_layers=3, num_heads=4, num_kv_heads=2, mlp_dim=64, dtype="float32")
TOKENS = jax.random.randint(jax.random.key(1), (2, 16), 0, 64)


def _loss_and_grads(cfg: LlamaConfig):
    model = Llama(cfg, rngs=nnx.Rngs(0))
    graphdef, params = nnx.split(model)

    def loss(params):
        logits = nnx.merge(graphdef, params)(TOKENS[:, :-1])
        return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), TOKENS[:, 1:, None], axis=-1))

    return jax.jit(jax.value_and_grad(loss))(params)


def test_remat_policy_names_match_implementations():
    assert set(REMAT_POLICIES) == set(REMAT_POLICY_FNS)


@pytest.mark.parametrize("policy", [p for p in REMAT_POLICIES if p != "none"])
def test_remat_gives_same_loss_and_gradients(policy):
    ref_loss, ref_grads = _loss_and_grads(CFG)
    loss, grads = _loss_and_grads(LlamaConfig(**{**CFG.__dict__, "remat": policy}))
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-6)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7), grads, ref_grads)


@pytest.mark.parametrize("policy,remat_layers,scan_layers", [("full", 1, True), ("save_dots", 2, True), ("full", 2, False)])
def test_remat_on_the_first_layers_gives_same_loss_and_gradients(policy, remat_layers, scan_layers):
    ref_loss, ref_grads = _loss_and_grads(CFG)
    cfg = LlamaConfig(**{**CFG.__dict__, "remat": policy, "remat_layers": remat_layers, "scan_layers": scan_layers})
    loss, grads = _loss_and_grads(cfg)
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-6)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7), grads, ref_grads)


def test_remat_layers_rematerialises_the_first_layers_only():
    """model.remat_layers=2 of 3: a scan of the first 2 layers under the policy, then one of the last layer as
    autodiff keeps it."""
    cfg = LlamaConfig(**{**CFG.__dict__, "remat": "full", "remat_layers": 2})
    graphdef, params = nnx.split(Llama(cfg, rngs=nnx.Rngs(0)))
    jaxpr = jax.make_jaxpr(lambda p: nnx.merge(graphdef, p).hidden(TOKENS))(params).jaxpr
    scans = [eqn for eqn in jaxpr.eqns if eqn.primitive.name == "scan"]
    assert [scan.params["length"] for scan in scans] == [2, 1]
    # the first scan's body is the whole layer under jax.checkpoint; the second's the layer's own operations
    bodies = [{eqn.primitive.name for eqn in scan.params["jaxpr"].jaxpr.eqns} for scan in scans]
    assert bodies[0] == {"remat2"} and "dot_general" in bodies[1]


def test_remat_on_more_layers_compiles_to_less_memory():
    """Saved activations dominate (6 scanned layers, 4 x 256 tokens): the compiled step's temporaries shrink as
    model.remat_layers grows, from remat none's to remat on every layer's (XLA:CPU, float32: 138, 88 and 40 MiB for
    none, 3 and 5 of 6 layers, 35 for all). Not for 1 layer here: XLA inlines a scan of one layer, and XLA:CPU keeps
    an inlined (unrolled) layer's activations under any remat policy (README, "Partial remat")."""
    cfg = LlamaConfig(vocab_size=64, d_model=128, num_layers=6, num_heads=4, num_kv_heads=2, mlp_dim=512, dtype="float32", scan_layers=True)
    tokens = jax.random.randint(jax.random.key(1), (4, 257), 0, 64)

    def temporaries(**changes) -> int:
        graphdef, params = nnx.split(Llama(dataclasses.replace(cfg, **changes), rngs=nnx.Rngs(0)))

        def loss(params):
            logits = nnx.merge(graphdef, params)(tokens[:, :-1])
            return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), tokens[:, 1:, None], axis=-1))

        return jax.jit(jax.grad(loss)).lower(params).compile().memory_analysis().temp_size_in_bytes

    none, half, most, every = (temporaries(), temporaries(remat="full", remat_layers=3), temporaries(remat="full", remat_layers=5),
                               temporaries(remat="full"))
    assert none > half > most > every
    assert abs((none - half) / (none - every) - 0.5) < 0.1  # half the layers save about half of what all of them do


def test_save_qkv_out_recomputes_only_the_attention_scores_and_the_mlp():
    """save_qkv_out keeps the q, k, v and output projections (jaxtrain/models/llama.py QKV_OUT): the backward of the scanned
    layer recomputes the attention's two batched products and the MLP's gate and up, 4 products more than without
    remat. A name missing from the policy would have its projection recomputed too."""
    def products(remat):
        cfg = LlamaConfig(**{**CFG.__dict__, "remat": remat, "attention": "xla"})
        graphdef, params = nnx.split(Llama(cfg, rngs=nnx.Rngs(0)))
        grad = jax.grad(lambda p: jnp.mean(nnx.merge(graphdef, p).hidden(TOKENS)))
        return str(jax.make_jaxpr(grad)(params)).count("dot_general")

    assert products("save_qkv_out") == products("none") + 4


def test_rms_norm_of_bfloat16_activations_is_computed_in_float32():
    """The mean square, its root and the products in float32 (transformers' LlamaRMSNorm normalises in float32 too),
    rounded to bfloat16 once: within half a bfloat16 step (2^-8 of the value) of the exact norm. Computed in bfloat16,
    a fifth of the outputs were further off (up to 2.6x)."""
    norm = RMSNorm(LlamaConfig(d_model=32, dtype="bfloat16"))
    norm.scale[...] = jnp.asarray(np.random.default_rng(0).uniform(0.5, 1.5, 32), jnp.float32)
    x = jnp.asarray(np.random.default_rng(1).normal(size=(8, 64, 32)), jnp.bfloat16)
    x64, scale = np.asarray(x, np.float64), np.asarray(norm.scale[...], np.float64)
    expected = x64 / np.sqrt(np.mean(x64**2, axis=-1, keepdims=True) + norm.eps) * scale
    np.testing.assert_allclose(np.asarray(norm(x), np.float64), expected, rtol=2**-8 + 1e-6)  # + float32's rounding


def test_scan_equals_layers_applied_one_by_one():
    model = Llama(CFG, rngs=nnx.Rngs(0))
    layer_def, layer_params = nnx.split(model.layers)
    from jaxtrain.models.llama import rotary_tables

    sin, cos = rotary_tables(TOKENS.shape[1], CFG.resolved_head_dim, CFG.rope_theta)
    x = jnp.take(model.embed[...], TOKENS, axis=0)
    for i in range(CFG.num_layers):
        x = nnx.merge(layer_def, jax.tree.map(lambda p: p[i], layer_params))(x, sin, cos)
    expected = jnp.einsum("btd,dv->btv", model.final_norm(x), model.lm_head[...])
    np.testing.assert_allclose(model(TOKENS), expected, rtol=1e-5, atol=1e-5)


def test_unrolled_layers_equal_the_scan_and_compile_without_a_loop():
    unrolled = LlamaConfig(**{**CFG.__dict__, "scan_layers": False})
    ref_loss, ref_grads = _loss_and_grads(CFG)
    loss, grads = _loss_and_grads(unrolled)
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-6)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7), grads, ref_grads)
    forward = lambda cfg: jax.jit(Llama(cfg, rngs=nnx.Rngs(0))).lower(TOKENS).as_text()  # noqa: E731
    assert "stablehlo.while" in forward(CFG) and "stablehlo.while" not in forward(unrolled)


def test_causal_mask_hides_the_future():
    model = Llama(CFG, rngs=nnx.Rngs(0))
    changed = TOKENS.at[:, 10].set((TOKENS[:, 10] + 1) % 64)
    a, b = model(TOKENS), model(changed)
    np.testing.assert_allclose(a[:, :10], b[:, :10], rtol=1e-6)
    assert not np.allclose(a[:, 10:], b[:, 10:])


def test_shapes_dtypes_and_logical_axes():
    model = Llama(LlamaConfig(**{**CFG.__dict__, "dtype": "bfloat16"}), rngs=nnx.Rngs(0))
    logits = model(TOKENS)
    assert logits.shape == (2, 16, 64) and logits.dtype == jnp.float32  # logits always float32
    state = nnx.state(model)
    params = nnx.to_pure_dict(state)
    assert params["layers"]["attn"]["wq"].shape == (3, 32, 4, 8)  # (layers, embed, heads, head_dim)
    assert params["layers"]["attn"]["wk"].shape == (3, 32, 2, 8)  # grouped-query: fewer KV heads
    assert all(p.dtype == jnp.float32 for p in jax.tree.leaves(params))  # float32 master weights
    axes = nnx.to_pure_dict(nnx.get_partition_spec(state))
    flat_params = jax.tree_util.tree_flatten_with_path(params)[0]
    flat_axes = jax.tree.leaves(axes, is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec))
    for (path, param), spec in zip(flat_params, flat_axes, strict=True):
        assert len(spec) == param.ndim and all(isinstance(a, str) for a in spec), path
    assert tuple(axes["layers"]["mlp"]["w_down"]) == ("layers", "mlp", "embed")


def test_initial_weights_spread_as_configured_and_the_residual_outputs_shrink_with_depth():
    """A normal truncated at 2 standard deviations (a spread of 0.8796 init_std); the projections writing into the
    residual stream (attention's output, the MLP's down) scaled by 1 / sqrt(2 x layers), as GPT-2 and Megatron do."""
    params = nnx.to_pure_dict(nnx.state(Llama(CFG, rngs=nnx.Rngs(0))))
    spread, layers = 0.8796 * CFG.init_std, params["layers"]
    for w in (params["embed"], params["lm_head"], layers["attn"]["wq"], layers["attn"]["wk"], layers["attn"]["wv"],
              layers["mlp"]["w_gate"], layers["mlp"]["w_up"]):
        assert np.std(w) == pytest.approx(spread, rel=0.05)
    for w in (layers["attn"]["wo"], layers["mlp"]["w_down"]):
        assert np.std(w) == pytest.approx(spread / (2 * CFG.num_layers) ** 0.5, rel=0.05)


def test_tied_embeddings_have_no_output_projection():
    tied = Llama(LlamaConfig(**{**CFG.__dict__, "tie_embeddings": True}), rngs=nnx.Rngs(0))
    assert "lm_head" not in nnx.to_pure_dict(nnx.state(tied))
    assert tied(TOKENS).shape == (2, 16, 64)


def _dot_operand_dtypes(fn, *args) -> list[tuple]:
    """The operand dtypes of every dot_general in ``fn``'s jaxpr, nested ones included, in order."""
    found = []

    def walk(jaxpr):
        for eqn in jaxpr.eqns:
            if eqn.primitive.name == "dot_general":
                found.append(tuple(str(v.aval.dtype) for v in eqn.invars))
            for sub in jax.extend.core.jaxprs_in_params(eqn.params):
                walk(sub)

    walk(jax.make_jaxpr(fn)(*args).jaxpr)
    return found


@pytest.mark.parametrize("tie_embeddings", [False, True])
def test_output_projection_backward_runs_in_the_compute_dtype(tie_embeddings):
    """bfloat16 model: float32 logits, but both backward matmuls of the output projection take bfloat16 operands
    (left to autodiff, the float32 logits' gradient makes them float32 products, as the reference shows:
    jaxtrain/models/llama.py); the gradients equal the float32-cotangent reference's within bfloat16 rounding."""
    model = Llama(LlamaConfig(**{**CFG.__dict__, "dtype": "bfloat16", "tie_embeddings": tie_embeddings}), rngs=nnx.Rngs(0))
    graphdef, params = nnx.split(model)
    name, equation = ("embed", "btd,vd->btv") if tie_embeddings else ("lm_head", "btd,dv->btv")
    x = jax.random.normal(jax.random.key(2), (2, 16, 32), jnp.bfloat16)
    weights = jax.random.normal(jax.random.key(3), (2, 16, 64))  # a loss whose gradient is not uniform

    def ours(x, params):
        return nnx.merge(graphdef, params).logits(x)

    def reference(x, table):
        return jnp.einsum(equation, x, table.astype(jnp.bfloat16), preferred_element_type=jnp.float32)

    table = getattr(model, name)[...]
    assert ours(x, params).dtype == jnp.float32
    np.testing.assert_array_equal(ours(x, params), reference(x, table))  # the forward is unchanged
    grad = lambda logits_fn: jax.grad(lambda x, p: jnp.sum(logits_fn(x, p) * weights), argnums=(0, 1))  # noqa: E731
    dots = _dot_operand_dtypes(grad(ours), x, params)  # the forward, the hidden states' and the table's gradients
    assert len(dots) >= 3 and set(dots) == {("bfloat16", "bfloat16")}
    assert ("float32", "bfloat16") in _dot_operand_dtypes(grad(reference), x, table)  # XLA makes it a float32 product
    (dx, dparams), (dx_want, dtable_want) = grad(ours)(x, params), grad(reference)(x, table)
    for got, want in ((dx, dx_want), (getattr(dparams, name)[...], dtable_want)):
        assert got.dtype == want.dtype
        want = np.asarray(want, np.float32)  # bfloat16 rounding of the logits' gradient: 1% of the largest entry
        np.testing.assert_allclose(np.asarray(got, np.float32), want, rtol=0.02, atol=0.01 * np.abs(want).max())


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_embedding_lookup_adds_its_rows_gradient_in_float32(dtype):
    """jaxtrain/models/llama.py's lookup: the rows in the compute dtype (the table cast before the lookup: the same values
    as a cast after it), and a table gradient that adds every occurrence's row in float32, as autodiff of a
    float32 lookup does: a frequent token's row sums many terms (here 512), which bfloat16 would round away."""
    from jaxtrain.models.llama import _lookup_rows

    compute = jnp.dtype(dtype)
    table = jax.random.normal(jax.random.key(4), (64, 32))
    ids = jnp.concatenate([jnp.full((1, 512), 3), jax.random.randint(jax.random.key(5), (1, 64), 0, 64)], axis=1)
    np.testing.assert_array_equal(_lookup_rows(table, ids, compute), jnp.take(table, ids, axis=0).astype(compute))
    weights = jax.random.normal(jax.random.key(6), (1, ids.shape[1], 32)).astype(compute)

    def loss(table):
        return jnp.sum((_lookup_rows(table, ids, compute) * weights).astype(jnp.float32))

    grad = jax.jit(jax.grad(loss))(table)
    want = np.zeros(table.shape, np.float32)
    np.add.at(want, np.asarray(ids[0]), np.asarray(weights[0], np.float32))
    assert grad.dtype == jnp.float32
    np.testing.assert_allclose(grad, want, rtol=1e-5, atol=1e-5)


def test_models_name_no_mesh_axes():
    for path in (Path(__file__).parent.parent / "jaxtrain" / "models").glob("*.py"):
        text = path.read_text()
        for axis in ("data", "fsdp", "tensor", "stage", "expert"):
            assert not re.search(rf"['\"]{axis}['\"]", text), f"{path.name} names mesh axis {axis}"


def test_models_import_no_trainer():
    """The model never imports the trainer (DESIGN.md), nor the experiments, benchmarks or scripts built on it."""
    for path in (Path(__file__).parent.parent / "jaxtrain" / "models").glob("*.py"):
        for line in path.read_text().splitlines():
            assert not re.match(r"\s*(from|import) (jaxtrain(?!\.models\b)|benchmarks|scripts)\b", line), f"{path.name}: {line.strip()}"


def test_llama3_rope_scaling_equals_transformers():
    import transformers
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from jaxtrain.models.config import RopeScaling
    from jaxtrain.models.llama import inverse_frequencies

    scaling = RopeScaling(type="llama3", factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_len=8192)
    hf = transformers.LlamaConfig(hidden_size=2048, num_attention_heads=32, max_position_embeddings=131072, rope_parameters={
        "rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192})
    expected, _ = ROPE_INIT_FUNCTIONS["llama3"](hf, "cpu")
    ours = inverse_frequencies(64, 500000.0, scaling)
    plain = inverse_frequencies(64, 500000.0)
    # all three bands are present: kept, divided by the factor, interpolated
    assert 0 < int(jnp.sum(ours == plain)) < 32 and int(jnp.sum(jnp.isclose(ours, plain / 32, rtol=1e-6))) > 0
    np.testing.assert_allclose(ours, expected.numpy(), rtol=1e-6)


def test_qkv_bias_is_added_to_the_projections():
    cfg = LlamaConfig(**{**CFG.__dict__, "qkv_bias": True})
    model = Llama(cfg, rngs=nnx.Rngs(0))
    before = model(TOKENS)
    model.layers.attn.bv[...] = jnp.ones_like(model.layers.attn.bv[...])
    after = model(TOKENS)
    assert not np.allclose(before, after)
    # zero-initialised biases: the same function as the model without them
    unbiased = Llama(CFG, rngs=nnx.Rngs(0))
    np.testing.assert_allclose(before, unbiased(TOKENS), rtol=1e-6)


def test_rotary_tables_reach_the_compiler_as_constants():
    """The sine and cosine of the positions 0 .. length - 1 are computed once, on the host: the compiled program of
    unrolled layers holds none, where a table built from iota in the program was fused into every rotary multiply
    and recomputed per element. The same numbers as in the program (packed positions, decoding steps)."""
    from jaxtrain.models.llama import rotary_tables

    model = Llama(LlamaConfig(**{**CFG.__dict__, "scan_layers": False}), rngs=nnx.Rngs(0))
    graphdef, params = nnx.split(model)
    loss = lambda p: nnx.merge(graphdef, p)(TOKENS).sum()  # noqa: E731
    assert not re.findall(r" (?:sine|cosine)\(", jax.jit(jax.grad(loss)).lower(params).compile().as_text())
    host = rotary_tables(16, CFG.resolved_head_dim, CFG.rope_theta)
    in_program = jax.jit(lambda p: rotary_tables(16, CFG.resolved_head_dim, CFG.rope_theta, positions=p))(jnp.arange(16)[None])
    for table, traced in zip(host, in_program):
        assert isinstance(table, np.ndarray)
        np.testing.assert_allclose(table, traced[0], atol=1e-6)
