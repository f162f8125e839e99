"""Mixture of experts: both dispatch paths against a per-token reference, dropped tokens, router losses in the
training loss, expert-parallel parity / resume / resharding, bad input, experiment sizes."""

import dataclasses
import json
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from conftest import run_cli, small_config, with_
from jaxtrain import checkpoint as checkpoint_lib
from jaxtrain.adapt.adapters import join_frozen
from jaxtrain.config import AxisSizes, MeshConfig, load_experiment
from jaxtrain.observe.flops import matmul_params
from jaxtrain.layout import make_layout
from jaxtrain.optim import learning_rate_schedule
from jaxtrain.state import init_state, model_spec
from jaxtrain.step import make_train_step, router_metrics, token_nll_and_router_stats, training_objective
from jaxtrain.train import build, train
from jaxtrain.models.config import EXPERT_LORA, LlamaConfig, LoraConfig, MoEConfig, adapter_name, tokamax_problem
from jaxtrain.models.llama import Llama
from jaxtrain.models.lora import ExpertLoRA
from jaxtrain.models.moe import MoE, capacity, dropless_axes

E, K, T = 8, 2, 16
# tokamax's grouped matmul (model.moe.grouped_matmul=tokamax): installed with the test extra; its kernels need jax 0.10
needs_tokamax = pytest.mark.skipif(tokamax_problem() is not None, reason=f"model.moe.grouped_matmul=tokamax: {tokamax_problem()}")


def _block(adapters: bool = False, **moe) -> tuple[MoE, LlamaConfig]:
    """A MoE block; with ``adapters`` also rank-2 adapters on its experts (jaxtrain/models/lora.py ExpertLoRA), their B random."""
    cfg = LlamaConfig(d_model=32, mlp_dim=16, num_layers=2, dtype="float32", moe=MoEConfig(**{"num_experts": E, "top_k": K} | moe),
                      lora=LoraConfig(rank=2, alpha=3.0, targets="gate,up,down") if adapters else LoraConfig())
    block = MoE(cfg, nnx.Rngs(0))
    for name in cfg.expert_adapters():
        adapter = ExpertLoRA([getattr(block, w) for w in EXPERT_LORA[name][1]], 2, 3.0, nnx.Rngs(1))
        adapter.b[...] = jax.random.normal(jax.random.key(2), adapter.b.shape)
        setattr(block, adapter_name(name), adapter)
    return block, cfg


@nnx.jit
def _apply(block: MoE, x):
    return block(x)


def _silu(x):
    return x / (1 + np.exp(-x))


def _reference(block: MoE, x: np.ndarray, slots: int | None = None):
    """Token by token in numpy: router softmax, top-k (renormalised with ``normalize_top_k``), the chosen experts'
    SwiGLU mixed, shared experts added; with ``slots`` an assignment is dropped when its expert already took that
    many of the sequence's assignments, first choices of every position before second choices. (output, dropped
    share)."""
    p = {k: np.asarray(v, np.float64) for k, v in nnx.to_pure_dict(nnx.state(block)).items() if not isinstance(v, dict)}
    for name, (_, weights) in EXPERT_LORA.items():  # an adapter's update added to each of its weights, per expert
        adapter = getattr(block, adapter_name(name), None)
        for i, weight in enumerate(weights if adapter is not None else ()):
            p[weight] = p[weight] + adapter.scale * np.einsum("eir,ero->eio", np.asarray(adapter.a[...], np.float64),
                                                              np.asarray(adapter.b[...][:, :, i], np.float64))
    logits = x @ p["router"]
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    out, dropped = np.zeros_like(x), 0
    for b in range(x.shape[0]):
        taken = np.zeros(E, int)
        chosen = np.argsort(-probs[b], axis=-1, kind="stable")[:, :K]  # (T, K)
        for choice in range(K):
            for t in range(x.shape[1]):
                e = chosen[t, choice]
                taken[e] += 1
                if slots is not None and taken[e] > slots:
                    dropped += 1
                    continue
                weight = probs[b, t, e] / (probs[b, t, chosen[t]].sum() if block.moe.normalize_top_k else 1.0)
                hidden = _silu(x[b, t] @ p["w_gate"][e]) * (x[b, t] @ p["w_up"][e])
                out[b, t] += weight * hidden @ p["w_down"][e]
    if block.moe.num_shared_experts:
        shared = {k: np.asarray(v[...], np.float64) for k, v in nnx.state(block.shared).items()}
        gate = 1 / (1 + np.exp(-(x @ np.asarray(block.shared_gate[...], np.float64))))
        out += gate * ((_silu(x @ shared["w_gate"]) * (x @ shared["w_up"])) @ shared["w_down"])
    return out, dropped / (x.shape[0] * x.shape[1] * K)


# normalize_top_k=false (Qwen2-MoE's norm_topk_prob=false): the chosen experts' raw softmax shares
@pytest.mark.parametrize("adapters, normalize_top_k", [(False, True), (True, True), (False, False)])
@pytest.mark.parametrize("dispatch, grouped_matmul", [("dropless", "xla"), pytest.param("dropless", "tokamax", marks=needs_tokamax),
                                                      ("capacity", "xla")])
def test_dispatch_matches_per_token_reference(dispatch, grouped_matmul, adapters, normalize_top_k):
    # capacity factor num_experts / top_k: every expert can take every position, nothing is dropped; the reference
    # adds the adapters' updates to the weights (PEFT's merge). tokamax on CPUs: its XLA implementation
    block, _ = _block(adapters, dispatch=dispatch, grouped_matmul=grouped_matmul, capacity_factor=E / K, num_shared_experts=2,
                      shared_expert_gate=True, normalize_top_k=normalize_top_k)
    x = np.random.default_rng(0).normal(size=(3, T, 32)).astype(np.float32)
    expected, _ = _reference(block, x.astype(np.float64))
    np.testing.assert_allclose(_apply(block, jnp.asarray(x)), expected, rtol=1e-5, atol=1e-5)
    assert float(block.router_stats.get_value()["dropped_fraction"]) == 0.0


# a fair share of 2 slots, and one of 2.4 rounded up (not down: an assignment more dropped per expert and sequence)
@pytest.mark.parametrize("capacity_factor, slots", [(0.5, 2), (0.6, 3)])
def test_capacity_drops_and_counts_assignments_past_an_experts_slots(capacity_factor, slots):
    block, _ = _block(dispatch="capacity", capacity_factor=capacity_factor)
    assert capacity(T, E, K, capacity_factor) == slots
    x = np.random.default_rng(1).normal(size=(3, T, 32)).astype(np.float32)
    expected, dropped = _reference(block, x.astype(np.float64), slots)
    np.testing.assert_allclose(_apply(block, jnp.asarray(x)), expected, rtol=1e-5, atol=1e-5)
    assert dropped > 0.2
    np.testing.assert_allclose(float(block.router_stats.get_value()["dropped_fraction"]), dropped, rtol=1e-6)


@pytest.mark.parametrize("seq_len, experts, top_k, capacity_factor, slots", [
    (16, 8, 2, 0.5, 2), (16, 8, 2, 0.6, 3),
    # 1.1 x 100 x 2 / 4 is 55; in floats 55.00000000000001, which was rounded up to 56
    (100, 4, 2, 1.1, 55), (3000, 4, 1, 1.1, 825),
    (16, 8, 2, 8.0, 16)])  # room for every position twice over: an expert takes a token once, seq_len slots suffice
def test_capacity_is_the_fair_share_times_the_factor_rounded_up(seq_len, experts, top_k, capacity_factor, slots):
    assert capacity(seq_len, experts, top_k, capacity_factor) == slots


# capacity 0.5: the load and the load-balancing loss count the assignments past an expert's slots too (the router's
# choices, not what the experts took)
@pytest.mark.parametrize("dispatch", ["dropless", "capacity"])
def test_router_statistics_and_losses(dispatch):
    block, cfg = _block(aux_loss_weight=0.5, router_z_loss_weight=0.25, dispatch=dispatch, capacity_factor=0.5)
    x = np.random.default_rng(2).normal(size=(2, T, 32)).astype(np.float32)
    _apply(block, jnp.asarray(x))
    stats = block.router_stats.get_value()
    logits = x.astype(np.float64) @ np.asarray(block.router[...], np.float64)
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    chosen = np.argsort(-probs, axis=-1, kind="stable")[..., :K]
    load = np.bincount(chosen.ravel(), minlength=E) / chosen.size
    aux = E * np.sum(load * probs.mean((0, 1)))
    z = np.mean(np.log(np.exp(logits).sum(-1)) ** 2)
    np.testing.assert_allclose(stats["expert_load"], load, rtol=1e-6)
    np.testing.assert_allclose(stats["aux_loss"], aux, rtol=1e-5)
    np.testing.assert_allclose(stats["z_loss"], z, rtol=1e-5)
    np.testing.assert_allclose(stats["router_loss"], 0.5 * aux + 0.25 * z, rtol=1e-5)
    assert (float(stats["dropped_fraction"]) > 0) is (dispatch == "capacity")


def test_a_bfloat16_model_routes_by_float32_router_logits():
    """The router's logits (and so the choice of experts, their weights and the z-loss) are float32 products of the
    bfloat16 activations and the float32 router weights (jaxtrain/models/moe.py), not products rounded to bfloat16 (up to
    2^-8 of each logit off, enough to reorder near ties)."""
    cfg = LlamaConfig(d_model=32, mlp_dim=16, num_layers=2, dtype="bfloat16", moe=MoEConfig(num_experts=E, top_k=K))
    block = MoE(cfg, nnx.Rngs(0))
    x = jnp.asarray(np.random.default_rng(2).normal(size=(2, T, 32)), jnp.bfloat16)
    _apply(block, x)
    logits = np.asarray(x, np.float64) @ np.asarray(block.router[...], np.float64)
    np.testing.assert_allclose(block.router_stats.get_value()["z_loss"], np.mean(np.log(np.exp(logits).sum(-1)) ** 2), rtol=1e-5)


def test_expert_output_weights_start_scaled_as_the_dense_mlps():
    """The experts' w_down is drawn with init_std / sqrt(2 num_layers), as the dense MLP's (jaxtrain/models/llama.py), so the
    residual stream grows alike with either block."""
    block, cfg = _block()
    np.testing.assert_allclose(np.std(block.w_down[...]) / np.std(block.w_gate[...]), 1 / (2 * cfg.num_layers) ** 0.5, rtol=0.05)


def _moe_config(rules="dp", mesh=(1, 1, 1, 1, 1), **moe):
    return small_config(rules, mesh, mlp_dim=16, moe=MoEConfig(**{"num_experts": 4, "top_k": 2} | moe))


@pytest.mark.parametrize("top_k, normalize_top_k, noted", [(1, True, True), (1, False, False), (2, True, False)])
def test_one_expert_renormalised_over_itself_is_noted_at_start_up(top_k, normalize_top_k, noted):
    """top_k=1 with the chosen weights renormalised weights each token's expert by 1, so the training loss gives the
    router no gradient (its norm 2.6e-08 against 0.41 with the probability as the weight, a random 4-expert model),
    which nothing said: a Switch-style run's router then learnt from the load-balancing and z losses alone."""
    from jaxtrain.observe.metrics import format_summary, startup_summary

    cfg = _moe_config(top_k=top_k, normalize_top_k=normalize_top_k)
    summary = startup_summary(make_layout(cfg, jax.devices()[:1]), 0.0, None, "test", None, "none")
    assert summary["router_weight_constant"] is noted
    assert ("note: model.moe.top_k=1 with model.moe.normalize_top_k=true" in format_summary(summary)) is noted


@pytest.mark.parametrize("moe, qkv_bias, noted", [({}, False, False), ({"num_shared_experts": 1, "shared_expert_gate": True}, True, False),
                                                  ({"num_shared_experts": 1}, False, True)])
def test_a_mixture_of_experts_no_hugging_face_architecture_holds_is_noted_at_start_up(moe, qkv_bias, noted):
    """Mixtral and Qwen2-MoE export; a shared expert without Qwen2's gate and biases was refused only by export-hf,
    after the training."""
    from jaxtrain.observe.metrics import format_summary, startup_summary

    cfg = _moe_config(**moe)
    cfg = with_(cfg, model={"qkv_bias": qkv_bias})
    summary = startup_summary(make_layout(cfg, jax.devices()[:1]), 0.0, None, "test", None, "none")
    assert (summary["no_hf_architecture"] is not None) is noted
    assert ("is neither a Mixtral nor a Qwen2-MoE model, so no Hugging Face architecture holds it: jaxtrain export-hf will refuse"
            in format_summary(summary)) is noted


@pytest.mark.parametrize("dispatch, data_format, noted",
                         [("capacity", "sft", True), ("dropless", "sft", False), ("capacity", "text", False)])
def test_capacity_routing_of_sft_data_is_noted_at_start_up(dispatch, data_format, noted):
    """A sequence's capacity is shared by the SFT examples packed into it and its padding: an example's logits differed by
    up to 0.87 packed and alone (a QA report), against the README's promise of the loss it has alone; dropless keeps it."""
    from jaxtrain.observe.metrics import format_summary, startup_summary

    cfg = with_(_moe_config(dispatch=dispatch), data={"format": data_format})
    summary = startup_summary(make_layout(cfg, jax.devices()[:1]), 0.0, None, "test", None, "none")
    assert summary["capacity_shared_by_examples"] is noted
    assert ("note: model.moe.dispatch=capacity with data.format=sft" in format_summary(summary)) is noted


def test_router_losses_are_added_to_the_training_loss():
    """The optimizer's objective is the mean token loss plus the mean over layers of each layer's weighted router
    losses; the reported loss is the token loss alone."""
    cfg = _moe_config(aux_loss_weight=0.5, router_z_loss_weight=0.25)
    spec = model_spec(cfg.model)
    params = nnx.to_pure_dict(nnx.state(Llama(cfg.model, rngs=nnx.Rngs(0))))
    tokens = jnp.asarray(np.random.default_rng(3).integers(0, 64, (2, 16)), jnp.int32)
    batch = {"inputs": tokens, "targets": jnp.roll(tokens, -1, axis=1)}
    both = jax.jit(lambda p, b: (training_objective(spec.graphdef, p, b), token_nll_and_router_stats(spec.graphdef, p, b)[0]))
    (objective, (loss, stats)), nll = both(params, batch)
    assert float(loss) == float(nll.mean()) and stats["aux_loss"].shape == (2,)
    np.testing.assert_allclose(stats["router_loss"], 0.5 * stats["aux_loss"] + 0.25 * stats["z_loss"], rtol=1e-6)
    np.testing.assert_allclose(objective, nll.mean() + np.mean(stats["router_loss"]), rtol=1e-6)
    assert float(objective - loss) > 0.25  # z-loss of at least log(4)^2 / 4
    metrics = router_metrics(stats)
    assert metrics["moe_expert_load_per_layer"].shape == (2, 4) and metrics["moe_load_max_over_mean_per_layer"].shape == (2,)


def test_micro_batches_give_the_router_statistics_of_the_whole_batch():
    """Gradient accumulation over 2 micro-batches: each pass's router statistics count as its share of the batch's,
    so the token loss, the z-loss and the experts' load are the whole batch's. The load-balancing loss is each
    pass's own (a product of two means over its tokens, as a transformers model computes it per forward pass): 0.1%
    off the whole batch's here, and the gradient norm with it."""
    cfg = _moe_config(aux_loss_weight=0.5, router_z_loss_weight=0.25)
    layout = make_layout(cfg, jax.devices()[:1])
    state = init_state(cfg.model, layout.tx, 0, layout.shardings)
    tokens = jnp.asarray(np.random.default_rng(3).integers(0, 64, (4, 16)), jnp.int32)
    batch = {"inputs": tokens, "targets": jnp.roll(tokens, -1, axis=1)}
    whole, split = (jax.jit(make_train_step(layout.spec.graphdef, layout.tx, learning_rate_schedule(cfg), micro))(state, batch)[1]
                    for micro in (1, 2))
    for name in ("loss", "moe_z_loss", "moe_expert_load_per_layer", "moe_load_max_over_mean_per_layer"):
        np.testing.assert_allclose(split[name], whole[name], rtol=1e-5, err_msg=name)
    for name in ("moe_aux_loss", "grad_norm"):
        np.testing.assert_allclose(split[name], whole[name], rtol=3e-3, err_msg=name)


def _run(cfg, corpus, run_dir, devices=None, trainer=None):
    final = train(cfg, run_dir, trainer or build(cfg, corpus, devices))
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return final, [r for r in records if "loss" in r]


@pytest.fixture(scope="module")
def expert_parallel(corpus, tmp_path_factory):
    """5 steps on cpu8 with expert 2 x fsdp 2 x tensor 2, capacity dispatch with room for every token, checkpoints
    every 2 steps: (config, trainer, run dir, final state, records)."""
    cfg = with_(_moe_config("fsdp_tp_ep", (1, 2, 2, 1, 2), dispatch="capacity", capacity_factor=2.0),
                checkpoint={"every": 2, "async_save": False})
    trainer = build(cfg, corpus)
    run_dir = tmp_path_factory.mktemp("ep") / "run"
    final, records = _run(cfg, corpus, run_dir, trainer=trainer)
    return cfg, trainer, run_dir, final, records


def test_expert_parallel_losses_match_one_device(expert_parallel, corpus, tmp_path):
    cfg, trainer, _, _, records = expert_parallel
    # the reference routes dropless: the capacity path with no drops on 8 devices must equal it
    _, reference = _run(_moe_config(), corpus, tmp_path / "one", jax.devices()[:1])
    losses = [r["loss"] for r in records]
    assert len(losses) == 5 and losses[4] < losses[0]
    np.testing.assert_allclose(losses, [r["loss"] for r in reference], rtol=1e-5)
    assert all(r["moe_dropped_fraction"] == 0 for r in records)
    np.testing.assert_allclose([r["moe_aux_loss"] for r in records], [r["moe_aux_loss"] for r in reference], rtol=1e-5)
    # tokens reach the experts' devices by all-to-all; the expert weights are split over the expert axis
    assert "all-to-all" in trainer.train_step.as_text()
    assert trainer.layout.shardings.params["layers"]["mlp"]["w_gate"].spec[1] == "expert"


def test_router_metrics_reach_tensorboard_and_the_plot(expert_parallel, tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from jaxtrain.observe.plot import MOE_PANEL, panels_for, plot_runs, read_metrics

    _, _, run_dir, _, records = expert_parallel
    events = EventAccumulator(str(run_dir))
    events.Reload()
    assert [e.value for e in events.Scalars("moe/aux_loss")] == pytest.approx([r["moe_aux_loss"] for r in records])
    assert [e.value for e in events.Scalars("moe_load_max_over_mean_per_layer/layer_001")] == \
        pytest.approx([r["moe_load_max_over_mean_per_layer"][1] for r in records])
    np.testing.assert_allclose([sum(load) for r in records for load in r["moe_expert_load_per_layer"]], 1.0, rtol=1e-6)
    assert [p[0] for p in panels_for([read_metrics(run_dir)])][-1] == MOE_PANEL
    assert MOE_PANEL not in [p[0] for p in panels_for([[{"step": 1, "loss": 1.0}]])]
    plot_runs([run_dir], tmp_path / "plot.png")
    assert (tmp_path / "plot.png").stat().st_size > 10_000


def test_expert_parallel_resume_is_exact(expert_parallel):
    cfg, trainer, run_dir, final, records = expert_parallel
    resumed_dir = run_dir.parent / "resumed"
    shutil.copytree(run_dir, resumed_dir)
    for step in (4, 5):
        shutil.rmtree(resumed_dir / checkpoint_lib.CHECKPOINTS_DIR / str(step))
    again, resumed = _run(cfg, None, resumed_dir, trainer=trainer)  # from step 2
    assert [(r["step"], r["loss"], r["moe_z_loss"]) for r in resumed] == [(r["step"], r["loss"], r["moe_z_loss"]) for r in records]
    for a, b in zip(jax.tree.leaves(jax.device_get(again.params)), jax.tree.leaves(jax.device_get(final.params))):
        assert np.array_equal(a, b)


@pytest.mark.parametrize("rules, ici, devices", [("dp_ep", (1, 1, 1, 1, 4), 4), ("dp", (1, 1, 1, 1, 1), 1)])
def test_expert_parallel_checkpoint_restores_onto_other_expert_degrees(expert_parallel, rules, ici, devices):
    cfg, _, run_dir, final, _ = expert_parallel
    target = dataclasses.replace(cfg, rules=rules, mesh=MeshConfig(ici=AxisSizes(*ici)))
    abstract = make_layout(target, jax.devices()[:devices]).abstract_state()
    restored = checkpoint_lib.restore_from(run_dir, abstract, None, params_only=True)
    assert restored["layers"]["mlp"]["w_up"].sharding.spec[1] == ("expert" if ici[4] > 1 else None)
    for a, b in zip(jax.tree.leaves(jax.device_get(restored)), jax.tree.leaves(jax.device_get(final.params))):
        assert np.array_equal(a, b)


BAD_INPUT = {
    "top_k above num_experts": (["model.moe.num_experts=4", "model.moe.top_k=5"],
                                "model.moe.top_k=5 must be between 1 and model.moe.num_experts=4"),
    "experts not divisible by the expert axis": (["model.moe.num_experts=5"],
                                                 "model.moe.num_experts=5 is not divisible by the 2 ways rule set fsdp_tp_ep splits the experts over"),
    "capacity factor not positive": (["model.moe.capacity_factor=0"],
                                     "model.moe.capacity_factor=0.0 must be a finite positive number"),
    # without these checks an unknown dispatch would route by capacity (MoE.__call__), a negative count fail in jax
    "unknown dispatch": (["model.moe.dispatch=gshard"], "model.moe.dispatch='gshard' is unknown; choose one of "),
    "negative experts": (["model.moe.num_experts=-4"], "model.moe.num_experts=-4 must be 0 (dense MLP) or positive"),
    "negative shared experts": (["model.moe.num_shared_experts=-1"], "model.moe.num_shared_experts=-1 must be 0 or positive"),
    "negative z-loss weight": (["model.moe.router_z_loss_weight=-0.001"],
                               "model.moe.router_z_loss_weight=-0.001 must be 0 (off) or a finite positive number"),
    # PEFT's experts.gate_up_proj: one adapter on both; and PEFT has no dropout on parameter targets
    "the experts' gate without up": (["model.lora.rank=4", "model.lora.targets=q,gate,down"],
                                     "model.lora.targets names gate without up: a mixture of experts takes one adapter on its experts' gate and up"),
    "dropout on the experts' adapters": (["model.lora.rank=4", "model.lora.dropout=0.1"],
                                         "model.lora.dropout=0.1 with adapters on the experts (gate, up, down): PEFT's expert adapters take no dropout"),
    "unknown grouped matmul": (["model.moe.grouped_matmul=cutlass"],
                               "model.moe.grouped_matmul='cutlass' is unknown; choose one of auto, xla, tokamax"),
    # a quantized base failed with a traceback
    "quantized experts": (["model.lora.rank=4", "model.lora.targets=q,k,v,o", "model.base_quant=nf4"],
                          "model.base_quant=nf4 with a mixture of experts (model.moe.num_experts=8): expert weights are not stored quantized yet"),
    # a traceback in the layout's shardings (qwix's traced layers)
    "quantized training": (["model.quant=int8"],
                           "model.quant=int8 with a mixture of experts (model.moe.num_experts=8): "
                           "quantized training of expert layers is not supported yet"),
}


@pytest.mark.parametrize("case", BAD_INPUT)
def test_bad_moe_input_is_one_line_exit_2(case, tmp_path):
    args, message = BAD_INPUT[case]
    result = run_cli("train", "tiny_moe", "--run-dir", str(tmp_path / "run"), "train.steps=1", *args, cwd=tmp_path)
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and len(lines) == 1 and message in lines[0], result.stderr
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("name, total, active", [
    ("mixtral_8x7b", 46_702_792_704, 12_879_659_008), ("mixtral_8x22b", 140_630_071_296, 39_160_774_656)])
def test_mixtral_sizes_are_the_published_ones(name, total, active):
    """Total parameters as Hugging Face counts them; active per token as Mistral counts them: the matmul parameters
    of attention, router and two experts, plus the embedding table."""
    model = load_experiment(name).model
    assert model_spec(model).num_params == total
    assert matmul_params(model) + model.vocab_size * model.d_model == active


def test_expert_weights_are_split_by_expert_and_like_the_dense_mlp_within_each():
    """fsdp_tp_ep: each expert array over expert, then as the dense MLP's (embed over fsdp, hidden over tensor); the
    router over embed like every weight. A weight laid out otherwise computes the same (the dropless shard_map
    takes it in the layout it needs), only replicated over expert or gathered every layer, which no numeric test sees."""
    specs = make_layout(load_experiment("tiny_moe")).shardings.params["layers"]["mlp"]
    assert {name: tuple(specs[name].spec) for name in ("router", "w_gate", "w_up", "w_down")} == {
        "router": (None, "fsdp", None), "w_gate": (None, "expert", "fsdp", "tensor"), "w_up": (None, "expert", "fsdp", "tensor"),
        "w_down": (None, "expert", "tensor", "fsdp")}


@pytest.mark.parametrize("rules, batch_size, axes", [
    ({}, 16, (("fsdp", "expert"), ("expert",), ("fsdp",), ("tensor",))),
    ({}, 6, None),  # a batch the 4 batch shards do not divide (as generation's one prompt): GSPMD's global sort
    ({"experts": ("tensor",)}, 16, None),  # experts over an axis the batch is not split over
    ({"mlp": ("fsdp",)}, 16, None),  # the experts' hidden dimension over a batch axis
    ({"embed": ("expert",), "experts": ("expert",)}, 16, None)])  # the embed dimension and the experts over one axis
def test_dropless_sorts_per_device_only_where_its_shard_map_applies(rules, batch_size, axes):
    """dropless_axes: the per-device dispatch's mesh axes (batch, experts, embed, hidden) on fsdp_tp_ep's mesh, or None
    where its all-gather over the experts' axes would not gather the expert group's tokens (or the weights' layout
    does not fit it), so the block takes GSPMD's global sort instead."""
    from jaxtrain.partitioning import model_tracing

    layout = make_layout(with_(_moe_config("fsdp_tp_ep", (1, 2, 2, 1, 2)), train={"global_batch": 16}))
    with model_tracing(layout.mesh, layout.rules | rules, "fsdp_tp_ep"):
        assert dropless_axes(batch_size) == axes


def test_planner_counts_expert_weights_by_the_expert_axis_and_all_to_all_traffic():
    from jaxtrain.plan.estimate import estimate
    from jaxtrain.state import bytes_per_device
    from jaxtrain.plan.step_cost import step_time

    layout = make_layout(load_experiment("tiny_moe"))  # fsdp 2 x tensor 2 x expert 2, capacity 1.25, float32, save_qkv_out
    m = layout.cfg.model
    w_gate = layout.abstract_state().params["layers"]["mlp"]["w_gate"]
    assert bytes_per_device(w_gate) == m.num_layers * 8 * m.d_model * m.mlp_dim * 4 // 8  # split 8 ways, experts 2 of them
    timed = step_time(layout)
    # 4 layers x (dispatch + combine) x (forward + backward, and the forward again: save_qkv_out keeps no routed row), 8
    # sequences per device (the batch split over fsdp and expert) of 256 tokens, 2 x 1.25 slots each, half of it leaving
    # the device
    assert timed.traffic_bytes["expert"] == pytest.approx(4 * 6 * 8 * 256 * 2.5 * m.d_model * 4 / 2)
    # dropless: per layer and token, forward the token (and its 2 float32 router weights and int32 choices) gathered
    # from the other expert shard and its output sent back; backward the output's gradient in and the token's and
    # weights' out; the recomputed forward (save_qkv_out recomputes the MLP block) the token and one router array
    # again; each moves 1 of 2 shards
    dropless = with_(layout.cfg, model={"moe": dataclasses.replace(m.moe, dispatch="dropless")})
    per_token = (m.d_model * 4 + 2 * 8) + m.d_model * 4 + (2 * m.d_model * 4 + 2 * 4) + (m.d_model * 4 + 2 * 4)
    assert step_time(make_layout(dropless)).traffic_bytes["expert"] == pytest.approx(4 * 8 * 256 * per_token)
    assert timed.total_s >= timed.compute_s + timed.communication_s["expert"] > timed.compute_s
    # the routed rows in and out each layer keeps: save_dots names them (jaxtrain/models/moe.py EXPERT_SAVED), save_qkv_out not
    assert "dispatch buffers" not in estimate(layout)
    saving_dots = make_layout(with_(layout.cfg, model={"remat": "save_dots"}))
    assert estimate(saving_dots)["dispatch buffers"] == 4 * 4 * 2 * (8 * 256 * m.d_model) * 2.5
    # FLOPs per token count the 2 chosen experts, not all 8
    dense_mlp = dataclasses.replace(m, moe=MoEConfig(), mlp_dim=2 * m.mlp_dim)
    assert matmul_params(m) == matmul_params(dense_mlp) + m.num_layers * m.d_model * 8


def _unspecified_past_the_groups(ragged_dot):
    """``ragged_dot`` whose rows past its groups are NaN, in its output and in its input's gradient: jax leaves them
    unspecified, and a GPU kernel leaves there what the memory held (XLA:CPU writes zeros, where a dispatch
    reading them would pass). NaN, not any finite value: the adapters' dense products took those rows times zero (a
    one-hot of their experts), and 0 x NaN made the adapters' gradients NaN."""
    def past_the_groups_garbage(rows, group_sizes):
        return jnp.where((jnp.arange(rows.shape[0]) < jnp.sum(group_sizes))[:, None], rows, jnp.nan)

    @jax.custom_vjp
    def unspecified(lhs, rhs, group_sizes):
        return past_the_groups_garbage(ragged_dot(lhs, rhs, group_sizes), group_sizes)

    def backward(residuals, g):
        lhs, rhs, group_sizes = residuals
        d_lhs, d_rhs = jax.vjp(lambda lhs, rhs: ragged_dot(lhs, rhs, group_sizes), lhs, rhs)[1](g)
        return past_the_groups_garbage(d_lhs, group_sizes), d_rhs, None

    unspecified.defvjp(lambda lhs, rhs, group_sizes: (unspecified(lhs, rhs, group_sizes), (lhs, rhs, group_sizes)), backward)
    return unspecified


@pytest.mark.parametrize("rules, ici, grouped_matmul", [
    ("fsdp_ep", (2, 2, 1, 1, 2), "xla"), ("fsdp_tp_ep", (1, 2, 2, 1, 2), "xla"), ("dp_ep", (2, 1, 1, 1, 4), "xla"),
    ("fsdp", (2, 4, 1, 1, 1), "xla"), pytest.param("fsdp_tp_ep", (1, 2, 2, 1, 2), "tokamax", marks=needs_tokamax)])
def test_dropless_sorts_per_device_and_matches_one_device(rules, ici, grouped_matmul, monkeypatch):
    """Dropless dispatch on a mesh: each device sorts its own tokens (those of its expert group, gathered over the
    expert axis) for its own experts, summed back to the tokens' devices; the objective and every gradient equal
    one device's. A global sort made GSPMD gather every token to every device (and replicate dispatch tensors whole
    on fsdp_ep with data 2 and on fsdp_tp_ep). With adapters on the experts (B random), theirs too: A's embed
    dimension gathered with the weights', the down adapter's partial sums over tensor summed with the output's.
    tokamax's grouped matmul (its XLA implementation on CPUs) inside the shard_map, which has no vma checks for it:
    the tensor sum's gradient is scaled back by hand there (jaxtrain/models/moe.py _sum_over). A device's rows of other experts'
    assignments lie past its groups, where jax's grouped matmul's output and gradient are unspecified: NaN here, so
    any of them read back reaches the objective or a gradient."""
    from jaxtrain.partitioning import model_tracing

    cfg = with_(_moe_config(rules, ici, grouped_matmul=grouped_matmul), train={"global_batch": 16},
                model={"lora": LoraConfig(rank=2, alpha=3.0, targets="q,gate,up,down")})
    layout = make_layout(cfg)
    graphdef = model_spec(cfg.model).graphdef
    params = nnx.to_pure_dict(nnx.state(Llama(cfg.model, rngs=nnx.Rngs(0))))
    for adapter in params["layers"]["mlp"].values():
        if isinstance(adapter, dict):
            adapter["b"] = jax.random.normal(jax.random.key(5), adapter["b"].shape)
    tokens = jnp.asarray(np.random.default_rng(4).integers(0, 64, (16, 16)), jnp.int32)
    batch = {"inputs": tokens, "targets": jnp.roll(tokens, -1, axis=1)}
    objective = jax.value_and_grad(lambda p: training_objective(graphdef, p, batch)[0])
    expected, expected_grads = jax.jit(objective)(params)
    monkeypatch.setattr(jax.lax, "ragged_dot", _unspecified_past_the_groups(jax.lax.ragged_dot))
    with model_tracing(layout.mesh, layout.rules, cfg.rules):
        assert dropless_axes(16) is not None  # the per-device path, not GSPMD's global sort
        value, grads = jax.jit(objective)(jax.device_put(params, join_frozen(layout.shardings.frozen, layout.shardings.params)))
    np.testing.assert_allclose(value, expected, rtol=1e-6)
    for (path, g), want in zip(jax.tree_util.tree_leaves_with_path(grads), jax.tree.leaves(expected_grads)):
        np.testing.assert_allclose(g, want, rtol=1e-4, atol=1e-7, err_msg=jax.tree_util.keystr(path))


def _expert_work(fn, *args) -> dict[str, int]:
    """How many times ``fn``'s jaxpr (nested ones included: the layer scan, remat, shard_map) multiplies by the experts'
    weights (grouped matmuls, or dots batched over the experts: operands of ranks 3 and 4) and all-gathers."""
    found = {"expert products": 0, "all-gathers": 0}

    def walk(jaxpr):
        for eqn in jaxpr.eqns:
            batched = eqn.primitive.name == "dot_general" and eqn.params["dimension_numbers"][1][0]
            found["expert products"] += eqn.primitive.name == "ragged_dot_general" or \
                bool(batched) and sorted(v.aval.ndim for v in eqn.invars) == [3, 4]
            found["all-gathers"] += eqn.primitive.name == "all_gather"
            for sub in jax.extend.core.jaxprs_in_params(eqn.params):
                walk(sub)

    walk(jax.make_jaxpr(fn)(*args).jaxpr)
    return found


@pytest.mark.parametrize("dispatch", ["dropless", "capacity"])
def test_save_dots_keeps_the_experts_products_for_the_backward(dispatch):
    """The experts' products are grouped matmuls (dropless) or dots batched over the experts (capacity), which jax's
    policy of dots without batch dimensions does not keep: under save_dots the backward multiplied by the experts
    again (and gathered the expert group's tokens again), as under full remat, where the planner counted them kept.
    The rows, gate, up and output are named (jaxtrain/models/moe.py EXPERT_SAVED) and kept by save_dots, and moved to host
    memory by offload_dots: the gradient multiplies by the experts as often as with no remat."""
    from jaxtrain.partitioning import model_tracing

    cfg = with_(_moe_config("fsdp_ep", (2, 2, 1, 1, 2), dispatch=dispatch), train={"global_batch": 16})
    tokens = jnp.zeros((16, 16), jnp.int32)
    batch = {"inputs": tokens, "targets": tokens}

    def work(remat):
        model = dataclasses.replace(cfg.model, remat=remat)
        graphdef, params = model_spec(model).graphdef, nnx.to_pure_dict(nnx.state(Llama(model, rngs=nnx.Rngs(0))))
        layout = make_layout(with_(cfg, model={"remat": remat}))
        with model_tracing(layout.mesh, layout.rules, cfg.rules):
            return _expert_work(jax.grad(lambda p: training_objective(graphdef, p, batch)[0]), params)

    kept = work("none")
    assert work("save_dots") == work("offload_dots")
    assert work("save_dots")["expert products"] == kept["expert products"]
    # full remat multiplies the forward's 3 again (one scanned layer body)
    assert work("full")["expert products"] == kept["expert products"] + 3
    if dispatch == "dropless":  # the expert group's tokens gathered once, not again in the backward
        assert work("save_dots")["all-gathers"] == work("full")["all-gathers"] - 1


@needs_tokamax
def test_grouped_matmul_auto_is_tokamax_on_nvidia_gpus_where_it_runs_and_xla_elsewhere(monkeypatch):
    import importlib.metadata

    from jaxtrain.config import resolve_for_devices

    cfg = _moe_config()
    assert cfg.model.moe.grouped_matmul == "auto"
    resolved = lambda gpu: resolve_for_devices(cfg, nvidia_gpu=gpu, cpu=not gpu).model.moe.grouped_matmul  # noqa: E731
    assert (resolved(True), resolved(False)) == ("tokamax", "xla")
    assert resolve_for_devices(with_(cfg, model={"moe": dataclasses.replace(cfg.model.moe, grouped_matmul="xla")}),
                               nvidia_gpu=True).model.moe.grouped_matmul == "xla"  # explicit values stay
    tokamax = dataclasses.replace(cfg.model.moe, grouped_matmul="tokamax")
    version = importlib.metadata.version
    # tokamax 0.0.12 on jax 0.11 (the GPU image's): its Triton kernel calls pl.dot, which jax 0.11 removed
    monkeypatch.setattr(importlib.metadata, "version", lambda name: {"jax": "0.11.2", "tokamax": "0.0.12"}.get(name) or version(name))
    assert resolved(True) == "xla"
    assert tokamax.problems() == ["model.moe.grouped_matmul=tokamax: tokamax 0.0.12's kernels do not run on jax 0.11.2 (they "
                                  "call Pallas APIs that jax 0.11 removed or changed); use jax 0.10, or a tokamax release for jax "
                                  "0.11; or set model.moe.grouped_matmul=xla"]
    monkeypatch.setattr(importlib.metadata, "version", lambda name: {"jax": "0.11.2", "tokamax": "0.0.13"}.get(name) or version(name))
    assert resolved(True) == "tokamax"  # a later release is taken as fixed

    def missing(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "version", missing)
    assert resolved(True) == "xla"
    assert tokamax.problems() == ["model.moe.grouped_matmul=tokamax: it needs the tokamax package; pip install "
                                  "'jaxtrain[moe-gpu]'; or set model.moe.grouped_matmul=xla"]


def test_export_of_a_capacity_routed_run_says_transformers_routes_every_token(expert_parallel, tmp_path, capsys):
    """transformers' Mixtral and Qwen2-MoE are dropless: a capacity-routed run's export computes other logits wherever
    the run dropped tokens (0.69 on a tiny_moe run), which the export said nothing about."""
    from jaxtrain import cli

    _, _, run_dir, _, _ = expert_parallel
    assert cli.main(["export-hf", str(run_dir), "--out", str(tmp_path / "hf")]) == 0
    notes = [line for line in capsys.readouterr().err.splitlines() if "note:" in line]
    assert len(notes) == 1 and f"{run_dir} routed with model.moe.dispatch=capacity" in notes[0]
    assert notes[0].endswith("exports exactly")


def test_generation_of_a_capacity_routed_run_says_it_routes_every_token(expert_parallel, capsys):
    """jaxtrain generate routes every token (tests/test_generate.py), which a capacity-routed run did not train with."""
    from jaxtrain import cli

    _, _, run_dir, _, _ = expert_parallel
    assert cli.main(["generate", str(run_dir), "--prompt", "1 2 3", "--max-new-tokens", "2"]) == 0
    notes = [line for line in capsys.readouterr().err.splitlines() if "note:" in line]
    assert len(notes) == 1 and f"{run_dir} routed with model.moe.dispatch=capacity; generation routes every token" in notes[0]
