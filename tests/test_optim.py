"""AdamW as the train step applies it: what weight decay reaches, and every optimizer setting against PyTorch."""

import jax
import numpy as np
import optax
import pytest

from conftest import small_config, with_
from jaxtrain.config import DECAY_SHAPES, SCHEDULES
from jaxtrain.data import train_batches
from jaxtrain.optim import learning_rate_schedule
from jaxtrain.train import build
from jaxtrain.models.config import LoraConfig, MoEConfig

LR, WEIGHT_DECAY = 1e-2, 0.5


def _one_step(corpus, weight_decay: float, **model):
    cfg = with_(small_config("dp", (1, 1, 1), **({"qkv_bias": True} | model)), optim={"lr": LR, "weight_decay": weight_decay})
    trainer = build(cfg, corpus, jax.devices()[:1])
    state = trainer.init_state()
    # the biases and LoRA's b start at zero, where decay has nothing to take: moved off it, a decayed one shows
    state = state.replace(params=jax.tree.map(lambda x: x + 0.5, state.params))
    before = jax.device_get(state.params)
    state, _ = trainer.train_step(state, next(train_batches(corpus, cfg.data, cfg.train.global_batch, trainer.batch_sharding)))
    return before, jax.device_get(state.params)


def _by_name(params: dict) -> dict:
    return {jax.tree_util.keystr(path): np.asarray(x) for path, x in jax.tree_util.tree_leaves_with_path(params)}


NORMS_AND_BIASES = {"['final_norm']['scale']", "['layers']['attn_norm']['scale']", "['layers']['mlp_norm']['scale']",
                    "['layers']['attn']['bq']", "['layers']['attn']['bk']", "['layers']['attn']['bv']"}


@pytest.mark.parametrize("model, exempt, decayed_names", [
    ({}, NORMS_AND_BIASES, {"['embed']", "['lm_head']", "['layers']['attn']['wq']", "['layers']['mlp']['w_down']"}),
    # a mixture of experts' router (layers, embed, experts unnamed) and experts
    ({"moe": MoEConfig(num_experts=4, top_k=2), "mlp_dim": 16}, NORMS_AND_BIASES,
     {"['layers']['mlp']['router']", "['layers']['mlp']['w_up']"}),
    # a LoRA run trains its adapters alone, a (layers, embed, rank unnamed) and b: all decayed, as PEFT's under Trainer
    ({"lora": LoraConfig(rank=4, alpha=8.0)}, set(), {"['layers']['attn']['lora_q']['a']", "['layers']['mlp']['lora_down']['b']"}),
])
def test_weight_decay_reaches_the_matrices_not_the_norm_scales_or_biases(corpus, model, exempt, decayed_names):
    """The layers' norm scales (layers, d_model) and biases (layers, heads, head_dim) are stacked to two dimensions or
    more: decay is decided by what they are, as Hugging Face's Trainer and PyTorch recipes' ``ndim >= 2`` on unstacked
    weights decide it, not by their stacked ``ndim``."""
    before, decayed = _one_step(corpus, WEIGHT_DECAY, **model)
    _, plain = _one_step(corpus, 0.0, **model)
    before, decayed, plain = (_by_name(tree) for tree in (before, decayed, plain))
    assert exempt | decayed_names <= before.keys() and not exempt & decayed_names
    for name, weight in before.items():
        if name in exempt:
            assert np.array_equal(decayed[name], plain[name]), name
        else:  # AdamW's decoupled decay: lr x weight_decay x the weight, on top of the same Adam update
            np.testing.assert_allclose(decayed[name] - plain[name], -LR * WEIGHT_DECAY * weight, atol=1e-6, err_msg=name)


@pytest.mark.parametrize("clip_norm", [1.0, 0.0])
def test_the_optimizer_is_pytorchs_adamw_with_clipping_and_transformers_cosine_schedule(clip_norm):
    """Every setting the optimizer reads, against an independent implementation: torch.optim.AdamW (decay on the
    matrices only), torch's clip_grad_norm_ before it, and transformers' cosine-with-min-lr schedule with warmup.
    The gradients' norms straddle optim.clip_norm, so clipping changes Adam's moments; one leaf's gradients are small
    enough for optim.eps to matter. optim.clip_norm=0: no clipping."""
    import torch
    from jax.sharding import PartitionSpec as P
    from transformers import get_cosine_with_min_lr_schedule_with_warmup

    from jaxtrain.optim import make_optimizer

    steps, warmup = 7, 2
    cfg = with_(small_config(), train={"steps": steps},
                optim={"lr": 1e-2, "warmup_steps": warmup, "min_lr_ratio": 0.2, "weight_decay": 0.3, "b1": 0.8,
                       "b2": 0.9, "eps": 1e-4, "clip_norm": clip_norm})
    axes = {"layers": {"w": P("layers", "embed", "mlp"), "scale": P("layers", "norm")}, "embed": P("vocab", "embed")}
    rng = np.random.default_rng(0)
    params = {"layers": {"w": rng.normal(size=(2, 4, 3)), "scale": 1 + rng.normal(size=(2, 4))}, "embed": rng.normal(size=(5, 4))}
    params = jax.tree.map(lambda x: x.astype(np.float32), params)
    sizes = (3.0, 0.2, 5.0, 0.5, 2.0, 0.3, 4.0)  # the gradients' global norms: clipped and not
    grads = []
    for size in sizes:
        g = jax.tree.map(lambda x: rng.normal(size=x.shape).astype(np.float32), params)
        g["embed"] *= 1e-3  # of eps's order after Adam's normalisation
        norm = np.sqrt(sum(np.sum(x.astype(np.float64) ** 2) for x in jax.tree.leaves(g)))
        grads.append(jax.tree.map(lambda x, scale=size / norm: (x * scale).astype(np.float32), g))

    tx = make_optimizer(cfg, axes)
    ours, opt_state = params, tx.init(params)
    for g in grads:
        updates, opt_state = tx.update(g, opt_state, ours)
        ours = optax.apply_updates(ours, updates)

    theirs = jax.tree.map(lambda x: torch.tensor(x, requires_grad=True), params)
    decayed = [theirs["layers"]["w"], theirs["embed"]]
    o = cfg.optim
    torch_opt = torch.optim.AdamW([{"params": decayed, "weight_decay": o.weight_decay},
                                   {"params": [theirs["layers"]["scale"]], "weight_decay": 0.0}],
                                  lr=o.lr, betas=(o.b1, o.b2), eps=o.eps)
    schedule = get_cosine_with_min_lr_schedule_with_warmup(torch_opt, warmup, steps, min_lr_rate=o.min_lr_ratio)
    for g in grads:
        for p, grad in zip(jax.tree.leaves(theirs), jax.tree.leaves(g), strict=True):
            p.grad = torch.tensor(grad)
        if o.clip_norm:
            torch.nn.utils.clip_grad_norm_(jax.tree.leaves(theirs), o.clip_norm)
        torch_opt.step()
        schedule.step()
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(ours), jax.tree.leaves(theirs), strict=True):
        np.testing.assert_allclose(a, b.detach().numpy(), rtol=1e-5, atol=1e-6, err_msg=jax.tree_util.keystr(path))
    # every leaf moved far beyond the tolerance: the agreement is not the start's
    assert all(np.abs(a - b).max() > 1e-3 for a, b in zip(jax.tree.leaves(ours), jax.tree.leaves(params), strict=True))


@pytest.mark.parametrize("schedule, shape", [(schedule, "linear") for schedule in SCHEDULES]
                         + [("wsd", shape) for shape in DECAY_SHAPES if shape != "linear"])
def test_each_learning_rate_schedule_is_transformers_own(schedule, shape):
    """optim.schedule at every update count of a run, against transformers' schedules: cosine with a minimum, linear
    (polynomial of power 1) to the same end, and warmup-stable-decay with each optim.decay_shape over
    optim.decay_fraction of the steps (transformers warms that one up from lr * min_lr_ratio, jaxtrain from 0 as its
    others do)."""
    import torch
    from transformers import optimization as hf

    steps, warmup, lr, floor, fraction = 20, 3, 1e-2, 0.2, 0.3
    decay = round(fraction * steps)
    cfg = with_(small_config(), train={"steps": steps},
                optim={"lr": lr, "warmup_steps": warmup, "min_lr_ratio": floor, "schedule": schedule, "decay_fraction": fraction,
                       "decay_shape": shape})
    torch_opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=lr)
    reference = {
        "cosine": lambda: hf.get_cosine_with_min_lr_schedule_with_warmup(torch_opt, warmup, steps, min_lr_rate=floor),
        "linear": lambda: hf.get_polynomial_decay_schedule_with_warmup(torch_opt, warmup, steps, lr_end=lr * floor, power=1.0),
        "wsd": lambda: hf.get_wsd_schedule(torch_opt, warmup, num_decay_steps=decay, num_training_steps=steps,
                                           decay_type=shape, min_lr_ratio=floor),
    }[schedule]()
    theirs = []
    for _ in range(steps):
        theirs.append(reference.get_last_lr()[0])
        torch_opt.step()
        reference.step()
    ours = [float(learning_rate_schedule(cfg)(count)) for count in range(steps)]
    if schedule == "wsd":
        np.testing.assert_allclose(ours[:warmup], [lr * count / warmup for count in range(warmup)], rtol=1e-6)
        ours, theirs = ours[warmup:], theirs[warmup:]
        assert ours[:steps - warmup - decay] == pytest.approx([lr] * (steps - warmup - decay))  # the stable phase
    np.testing.assert_allclose(ours, theirs, rtol=1e-5)
    assert len(set(np.round(ours, 9))) > 5  # the compared stretch moves

    if schedule == "wsd":  # extended in its stable phase, a run goes on at the same rate
        longer = learning_rate_schedule(with_(cfg, train={"steps": 2 * steps}))
        stable = range(warmup, steps - decay)
        assert [float(longer(count)) for count in stable] == [float(learning_rate_schedule(cfg)(count)) for count in stable]


def test_the_start_up_summary_says_the_schedule_as_it_runs():
    """The summary's optimizer line names the steps where the schedule changes, as the schedule applies them (step k is
    update count k - 1): a wsd run's rate is optim.lr through the step it names, and lower from the next. The decay's first
    count gives optim.lr (it had named the step before: 1e-4 + 9e-4 rounds below 1e-3 in float32, which hid it; a floor of
    0 gives optim.lr exactly)."""
    from jaxtrain.optim import describe_schedule

    cfg = with_(small_config(), train={"steps": 100}, optim={"lr": 1e-3, "warmup_steps": 10, "schedule": "wsd", "decay_fraction": 0.25,
                                                              "decay_shape": "1-sqrt", "clip_norm": 0.0, "min_lr_ratio": 0.0})
    assert describe_schedule(cfg) == ("AdamW (b1 0.9, b2 0.95, eps 1e-08, weight decay 0.1, no clipping): learning rate 0.001 "
                                      "after 10 warmup steps, then held to step 76, then a 1-sqrt decay to 0 after step 100")
    rate = learning_rate_schedule(cfg)
    assert float(rate(10)) == float(rate(75)) == pytest.approx(1e-3, rel=1e-7) and float(rate(76)) < 0.9e-3  # steps 11, 76 and 77
    cfg = with_(cfg, optim={"min_lr_ratio": 0.1})
    assert describe_schedule(with_(cfg, optim={"schedule": "cosine", "clip_norm": 1.0})).endswith(
        "gradients clipped at global norm 1): learning rate 0.001 after 10 warmup steps, then a cosine to 0.0001 after step 100")
    for schedule in ("cosine", "linear", "wsd"):  # a warmup as long as the run: no decay to name
        assert describe_schedule(with_(cfg, train={"steps": 10}, optim={"schedule": schedule})).endswith(
            "learning rate 0.001 after 10 warmup steps, then no decay (the warmup takes all 10 steps)")
    assert describe_schedule(with_(cfg, train={"steps": 1})).endswith(  # "after 1 warmup steps ... takes all 1 steps"
        "learning rate 0.001 after 1 warmup step, then no decay (the warmup takes the one step)")
