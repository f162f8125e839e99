"""Pipeline parallelism on the `stage` mesh axis: the same losses as one device, checkpoints that move between
pipelined and plain meshes, and the schedule's arithmetic."""

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from conftest import small_config, with_
from jaxtrain.layout import make_layout
from jaxtrain.partitioning import model_tracing
from jaxtrain.stages import Schedule
from jaxtrain.train import build, train
from models.config import PipelineConfig
from models.llama import Llama
from test_parity import _losses

# mesh sizes (data, fsdp, tensor, stage) on 8 devices
PIPELINED = [
    # stage 2 x fsdp 2 x tensor 2, 2 micro-batches in flight, gradient accumulation over 2 passes around it
    ("pp_fsdp_tp", (1, 2, 2, 2), PipelineConfig(microbatches=2), {"microbatches": 2}, "none"),
    # stage 4 x data 2, circular: each stage holds 2 groups of 1 layer; remat inside the stages
    ("pp_dp", (2, 1, 1, 4), PipelineConfig(microbatches=4, repeats=2), {}, "full"),
]


def _config(rules="dp", mesh=(1, 1, 1, 1), pipeline=PipelineConfig(), remat="none"):
    # a constant learning rate: the checkpoint test's legs raise train.steps, which sets the cosine's length
    return with_(small_config(rules, mesh, num_layers=8, remat=remat, pipeline=pipeline), optim={"min_lr_ratio": 1.0})


@pytest.fixture(scope="module")
def reference(corpus, tmp_path_factory):
    return _losses(_config(), corpus, tmp_path_factory.mktemp("one-device"), jax.devices()[:1])


@pytest.mark.parametrize("rules, mesh, pipeline, train_cfg, remat", PIPELINED, ids=["stage2-fsdp2-tensor2", "stage4-data2-circular"])
def test_five_losses_match_one_device(rules, mesh, pipeline, train_cfg, remat, reference, corpus, tmp_path):
    assert len(reference) == 5 and reference[4] < reference[0]
    cfg = with_(_config(rules, mesh, pipeline, remat), train=train_cfg)
    np.testing.assert_allclose(_losses(cfg, corpus, tmp_path), reference, rtol=1e-5)


def test_circular_schedule_with_more_microbatches_than_stages_matches_plain_layers():
    """Outputs and parameter gradients of the stacked layers: 8 layers as 4 stages x 2 repeats x 1 layer, 6
    micro-batches, so the last stage's outputs wait in the buffer before their next repeat."""
    cfg = _config("pp_fsdp", (1, 2, 1, 4), PipelineConfig(microbatches=6, repeats=2))
    model = Llama(cfg.model, rngs=nnx.Rngs(0))
    graphdef, params = nnx.split(model)
    tokens = jax.random.randint(jax.random.key(1), (24, 16), 0, cfg.model.vocab_size)

    def loss(params):
        hidden = nnx.merge(graphdef, params).hidden(tokens)
        return jnp.mean(jnp.square(hidden)), hidden

    plain, plain_grads = jax.grad(loss, has_aux=True)(params)[::-1]
    layout = make_layout(dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, global_batch=24)))
    with model_tracing(layout.mesh, layout.rules, cfg.rules):
        piped, piped_grads = jax.jit(jax.grad(loss, has_aux=True))(params)[::-1]
    np.testing.assert_allclose(piped, plain, rtol=1e-5, atol=1e-6)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-7), piped_grads, plain_grads)


def test_checkpoint_moves_between_pipelined_and_plain_meshes(reference, corpus, tmp_path):
    """2 steps pipelined, 2 more on a plain fsdp_tp mesh, the last pipelined again: the 5 one-device losses."""
    pipelined = with_(_config("pp_fsdp_tp", (1, 2, 2, 2), PipelineConfig(microbatches=2)), checkpoint={"every": 1})
    plain = with_(_config("fsdp_tp", (2, 2, 2, 1)), checkpoint={"every": 1})
    run_dir = tmp_path / "moved"
    for cfg, steps in ((pipelined, 2), (plain, 4), (pipelined, 5)):
        cfg = with_(cfg, train={"steps": steps})
        train(cfg, run_dir, build(cfg, corpus))
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    np.testing.assert_allclose([r["loss"] for r in records if "loss" in r], reference, rtol=1e-5)


@pytest.mark.parametrize("stages, microbatches, repeats, bubble", [(4, 4, 1, 3 / 7), (4, 8, 2, 3 / 19), (2, 2, 1, 1 / 3)])
def test_bubble_formula(stages, microbatches, repeats, bubble):
    assert Schedule(stages, microbatches, repeats).bubble == pytest.approx(bubble)
