"""AdamW as the train step applies it: what weight decay reaches."""

import jax
import numpy as np

from conftest import small_config, with_
from jaxtrain.data import train_batches
from jaxtrain.train import build

LR, WEIGHT_DECAY = 1e-2, 0.5


def _one_step(corpus, weight_decay: float):
    cfg = with_(small_config("dp", (1, 1, 1), qkv_bias=True), optim={"lr": LR, "weight_decay": weight_decay})
    trainer = build(cfg, corpus, jax.devices()[:1])
    state = trainer.init_state()
    before = jax.device_get(state.params)
    state, _ = trainer.train_step(state, next(train_batches(corpus, cfg.data, cfg.train.global_batch, trainer.batch_sharding)))
    return before, jax.device_get(state.params)


def _by_name(params: dict) -> dict:
    return {jax.tree_util.keystr(path): np.asarray(x) for path, x in jax.tree_util.tree_leaves_with_path(params)}


def test_weight_decay_reaches_the_matrices_not_the_norm_scales_or_biases(corpus):
    """The layers' norm scales (layers, d_model) and biases (layers, heads, head_dim) are stacked to two dimensions or
    more: decay is decided by what they are, as Hugging Face's Trainer and PyTorch recipes' ``ndim >= 2`` on unstacked
    weights decide it, not by their stacked ``ndim``."""
    before, decayed = _one_step(corpus, WEIGHT_DECAY)
    _, plain = _one_step(corpus, 0.0)
    before, decayed, plain = (_by_name(tree) for tree in (before, decayed, plain))
    exempt = {"['final_norm']['scale']", "['layers']['attn_norm']['scale']", "['layers']['mlp_norm']['scale']",
              "['layers']['attn']['bq']", "['layers']['attn']['bk']", "['layers']['attn']['bv']"}
    assert exempt < before.keys()
    for name, weight in before.items():
        if name in exempt:
            assert np.array_equal(decayed[name], plain[name]), name
        else:  # AdamW's decoupled decay: lr x weight_decay x the weight, on top of the same Adam update
            np.testing.assert_allclose(decayed[name] - plain[name], -LR * WEIGHT_DECAY * weight, atol=1e-6, err_msg=name)
