"""LoRA dropout (model.lora.dropout, PEFT's lora_dropout): it changes the training step's gradients, never the
logits of evaluation or generation, resumes exactly (masks drawn from the run's seed and the step), and the PEFT
export carries the value."""

import dataclasses
import json
import shutil

import jax
import numpy as np
import pytest
from flax import nnx
from flax.core import spmd

from conftest import with_
from jaxtrain import cli
from jaxtrain.adapt import lora as lora_lib
from jaxtrain.layout import compile_train_step, make_layout
from jaxtrain.partitioning import flax_rules
from jaxtrain.train import build, train
from models.config import LoraConfig, PipelineConfig
from models.llama import KVCache
from models.lora import dropout_key
from test_lora import TOKENS, _randomise_adapters, _tree_equal, lora_config

DROPOUT = 0.3


def with_dropout(cfg, dropout=DROPOUT):
    return with_(cfg, model={"lora": LoraConfig(rank=cfg.model.lora.rank, alpha=cfg.model.lora.alpha, dropout=dropout)})


def test_dropout_acts_in_training_only():
    plain = lora_config(mesh=(1, 1, 1))
    layouts = [make_layout(c, jax.devices()[:1]) for c in (plain, with_dropout(plain))]
    params = _randomise_adapters(lora_lib.load_base(layouts[0], None).start_state(layouts[0]).model_params)

    def outputs(layout):
        """Logits of the whole sequence (training's and evaluation's pass) and of a prefill then one decoding step
        (generation's): without a dropout key, then with the train step's dropout key in force, for two keys."""
        def run(params, tokens, keys):
            model = nnx.merge(layout.spec.graphdef, params)
            found = [(model(tokens), _decoded(model, tokens))]
            for key in keys:
                with dropout_key(key):
                    found.append((model(tokens), _decoded(model, tokens)))
            return found

        with jax.set_mesh(layout.mesh), spmd.logical_axis_rules(flax_rules(layout.rules)):
            return jax.tree.map(np.asarray, jax.jit(run)(params, TOKENS, jax.random.split(jax.random.key(7), 2)))

    (base_logits, base_decoded), *undropped = outputs(layouts[0])
    (logits, decoded), (dropped, dropped_decoded), (other_key, _) = outputs(layouts[1])
    assert np.array_equal(logits, base_logits) and np.array_equal(decoded, base_decoded)  # evaluation, generation
    assert np.max(np.abs(dropped - base_logits)) > 1e-3  # the key is what turns it on ...
    assert np.max(np.abs(other_key - dropped)) > 1e-3  # ... and the masks come from the key
    assert np.array_equal(dropped_decoded, base_decoded)  # the decoding path never drops, key or not
    assert all(np.array_equal(x, y) for x, y in zip(jax.tree.leaves(undropped), [base_logits, base_decoded] * 2))  # dropout 0 never drops


def _decoded(model, tokens):
    hidden, cache = model.extend(tokens[:, :-1], KVCache.zeros(model.cfg, tokens.shape[0], tokens.shape[1]))
    return model.logits(model.extend(tokens[:, -1:], cache)[0])


def test_dropout_changes_the_training_gradients(corpus):
    cfg = lora_config(init_std=0.3, mesh=(1, 1, 1))
    tokens = corpus.train[:8 * 17].reshape(8, 17)
    metrics = []
    for c in (cfg, with_dropout(cfg)):
        layout = make_layout(c, jax.devices()[:1])
        state = lora_lib.load_base(layout, None).start_state(layout)
        state = state.replace(params=_randomise_adapters(state.params))  # B != 0: gradients reach A through the dropped inputs
        batch = {k: jax.device_put(v, layout.batch_sharding) for k, v in (("inputs", tokens[:, :-1]), ("targets", tokens[:, 1:]))}
        metrics.append(jax.device_get(compile_train_step(layout)[0][0](state, batch)[1]))
    assert abs(metrics[1]["grad_norm"] - metrics[0]["grad_norm"]) > 1e-3 * metrics[0]["grad_norm"], metrics
    assert metrics[1]["loss"] != metrics[0]["loss"]


def test_resume_with_dropout_is_exact_and_the_export_carries_it(corpus, tmp_path):
    cfg = with_(with_dropout(lora_config(init_std=0.3)), train={"microbatches": 2})  # a key per micro-batch too
    trainer = build(cfg, corpus)
    straight = train(cfg, tmp_path / "straight", trainer)
    resumed_dir = tmp_path / "resumed"
    shutil.copytree(tmp_path / "straight", resumed_dir)
    shutil.rmtree(resumed_dir / "checkpoints" / "4")
    resumed = train(cfg, resumed_dir, build(cfg, corpus))  # steps 3 and 4 again, after a restart (a new compiled step)
    assert _tree_equal(resumed.params, straight.params) and _tree_equal(resumed.opt_state, straight.opt_state)

    out = tmp_path / "adapter"
    assert cli.main(["export-hf", str(tmp_path / "straight"), "--out", str(out), "--adapter-only", "--mesh", "cpu8"]) == 0
    assert json.loads((out / "adapter_config.json").read_text())["lora_dropout"] == DROPOUT


@pytest.mark.parametrize("setup", ["grad_bfloat16", "grad_sync_step", "pipeline"])
def test_dropout_acts_under_once_per_step_gradient_sums_and_pipeline_stages_and_resumes_exactly(setup, corpus, tmp_path):
    """optim.grad_dtype=bfloat16 runs the passes under shard_map (jaxtrain/memory/grad_comm.py; each batch shard
    folds in its index), optim.grad_sync=step on fsdp_tp in a vmap over the data groups (each group folds in its
    index); pipeline stages slice each layer's key with its weights (models/pipeline.py). Either way the dropout key
    reaches the layers, so dropout acts, and a resumed run redraws the same masks."""
    if setup == "grad_bfloat16":
        cfg = with_(lora_config(init_std=0.3, mesh=(8, 1, 1)), optim={"grad_dtype": "bfloat16"},
                    train={"microbatches": 2, "global_batch": 16})
    elif setup == "grad_sync_step":
        cfg = with_(lora_config(init_std=0.3), optim={"grad_sync": "step"}, train={"microbatches": 2, "global_batch": 16})
    else:  # 4 stages x 2 repeats x 1 layer, 4 micro-batches in flight, over data 2
        cfg = dataclasses.replace(lora_config(init_std=0.3, mesh=(2, 1, 1, 4), num_layers=8,
                                              pipeline=PipelineConfig(microbatches=4, repeats=2)), rules="pp_dp")
    losses = []
    for c in (cfg, with_dropout(cfg)):
        run_dir = tmp_path / f"dropout-{c.model.lora.dropout}"
        final = train(c, run_dir, build(c, corpus))
        records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
        losses.append([r["loss"] for r in records if "loss" in r])
    assert losses[1] != losses[0]  # the masks reached the layers
    shutil.rmtree(run_dir / "checkpoints" / "4")
    resumed = train(c, run_dir, build(c, corpus))
    assert _tree_equal(resumed.params, final.params) and _tree_equal(resumed.opt_state, final.opt_state)
