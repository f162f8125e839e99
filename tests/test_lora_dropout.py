"""LoRA dropout (model.lora.dropout, PEFT's lora_dropout): it changes the training step's gradients, never the
logits of evaluation or generation, resumes exactly (masks drawn from the run's seed and the step), and the PEFT
export carries the value."""

import contextlib
import dataclasses
import json
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from flax.core import spmd

from conftest import with_
from jaxtrain import cli
from jaxtrain import data as data_lib
from jaxtrain.adapt import lora as lora_lib
from jaxtrain.layout import lower_train_step, make_layout
from jaxtrain.partitioning import flax_rules, model_tracing
from jaxtrain.train import build, train
from jaxtrain.models.config import LoraConfig, PipelineConfig
from jaxtrain.models.llama import KVCache, Llama
from jaxtrain.models.lora import LoRA, dropout_key, layer_inputs, layer_scope
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


def test_each_micro_batch_of_a_pipeline_draws_its_own_masks():
    """8 layers as 4 stages x 2 repeats over data 2, 4 micro-batches in flight; every row of the batch is one sequence,
    and micro-batch j takes rows j and j + 4, so rows 0 to 3 are each micro-batch's first. Each layer's key alone drew
    the same masks for every micro-batch (rows 0 to 3 had equal logits); without stages every row has its own."""
    cfg = dataclasses.replace(lora_config(init_std=0.3, mesh=(2, 1, 1, 4), num_layers=8,
                                          pipeline=PipelineConfig(microbatches=4, repeats=2)), rules="pp_dp")
    layout = make_layout(with_dropout(cfg))
    params = _randomise_adapters(lora_lib.load_base(layout, None).start_state(layout).model_params)

    def dropped(params, tokens):
        with dropout_key(jax.random.key(7)):
            return nnx.merge(layout.spec.graphdef, params)(tokens)

    with jax.set_mesh(layout.mesh), spmd.logical_axis_rules(flax_rules(layout.rules)):
        logits = np.asarray(jax.jit(dropped)(params, np.tile(TOKENS[:1], (8, 1))))
    assert not any(np.allclose(logits[i], logits[j]) for i in range(4) for j in range(i))


def test_each_step_draws_new_masks(corpus):
    """PEFT draws new masks every step; here the step's number picks them (folded into the run's key). One key for
    every step trains one fixed thinned network, and the resume test cannot tell: it redraws the same ones."""
    cfg = with_dropout(lora_config(init_std=0.3))
    trainer = build(cfg, corpus)
    batch = next(data_lib.train_batches(corpus, cfg.data, cfg.train.global_batch, trainer.batch_sharding))
    state, _ = trainer.train_step(lora_lib.load_base(trainer.layout, None).start_state(trainer.layout), batch)  # B != 0

    def loss_as_step(step):  # the same parameters and batch, numbered as another step (a copy: the step donates it)
        copy = jax.tree.map(jnp.copy, state)
        return float(trainer.train_step(copy.replace(step=copy.step - 1 + step), batch)[1]["loss"])

    first, second, first_again = loss_as_step(1), loss_as_step(2), loss_as_step(1)
    assert first == first_again and abs(first - second) > 1e-4 * first, (first, second)


def _decoded(model, tokens):
    hidden, cache = model.extend(tokens[:, :-1], KVCache.zeros(model.cfg, tokens.shape[0], tokens.shape[1]))
    return model.logits(model.extend(tokens[:, -1:], cache)[0])


def _train_beside_undropped_losses(cfg, corpus, run_dir):
    """Train, evaluating before each step the same parameters on the same batch with the eval step, which never
    drops: (the trainer, final state, the losses the train step reported, the undropped losses)."""
    trainer = build(cfg, corpus)
    undropped = []

    def step(state, batch):
        nll, count = trainer.eval_step(state.model_params, batch)
        undropped.append(float(nll) / float(count))  # read before the train step donates the parameters
        return trainer.train_step(state, batch)

    final = train(cfg, run_dir, dataclasses.replace(trainer, train_step=step))
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return trainer, final, [r["loss"] for r in records if "loss" in r], undropped


SETUPS = {
    # GSPMD's sums in the one pass; the PEFT export
    "one_pass": lambda: lora_config(init_std=0.3),
    # a vmap over the data groups (jaxtrain/memory/grad_comm.py), each carrying its rows' numbers; micro-batches
    "grad_sync_step": lambda: with_(lora_config(init_std=0.3), optim={"grad_sync": "step"},
                                    train={"microbatches": 2, "global_batch": 16}),
    # the passes under shard_map, each batch shard carrying its rows' numbers
    "grad_bfloat16": lambda: with_(lora_config(init_std=0.3, mesh=(8, 1, 1)), optim={"grad_dtype": "bfloat16"},
                                   train={"microbatches": 2, "global_batch": 16}),
    # 4 stages x 2 repeats x 1 layer, 4 micro-batches in flight, over data 2: each layer's key sliced with its weights
    # (jaxtrain/models/pipeline.py)
    "pipeline": lambda: dataclasses.replace(lora_config(init_std=0.3, mesh=(2, 1, 1, 4), num_layers=8,
                                                        pipeline=PipelineConfig(microbatches=4, repeats=2)), rules="pp_dp"),
}


@pytest.mark.parametrize("setup", SETUPS)
def test_dropout_changes_the_training_losses_and_resumes_exactly(setup, corpus, tmp_path):
    """However the passes are split, the dropout key reaches the layers: from the second step (the first update
    makes B non-zero) the train step's loss differs from the undropped loss of the same parameters and batch; at
    the first (B = 0: dropout cannot act) the two agree, which checks the comparison. A resumed run redraws the
    same masks (keys from the run's seed and the step)."""
    cfg = with_dropout(SETUPS[setup]())
    run_dir = tmp_path / "run"
    trainer, final, reported, undropped = _train_beside_undropped_losses(cfg, corpus, run_dir)
    assert len(reported) == len(undropped) == 4
    np.testing.assert_allclose(reported[0], undropped[0], rtol=1e-5)
    assert all(abs(r - u) > 1e-3 * u for r, u in zip(reported[1:], undropped[1:])), (reported, undropped)

    shutil.rmtree(run_dir / "checkpoints" / "4")
    # steps 3 and 4 again, after a restart: the masks come from the step number in the state, which a key counted
    # anywhere else (the trainer's, the process's) would not redraw, whether or not the step is compiled again
    resumed = train(cfg, run_dir, trainer)
    assert _tree_equal(resumed.params, final.params) and _tree_equal(resumed.opt_state, final.opt_state)
    if setup == "one_pass":
        out = tmp_path / "adapter"
        assert cli.main(["export-hf", str(run_dir), "--out", str(out), "--adapter-only", "--mesh", "cpu8"]) == 0
        assert json.loads((out / "adapter_config.json").read_text())["lora_dropout"] == DROPOUT


def test_a_pipelined_pass_draws_the_masks_of_the_unpipelined_one():
    """The masks of a batch row come from its row's number in the pass, whatever the schedule: 8 layers as 4 stages x 2
    repeats, 6 micro-batches (rows j, j + 6, ... each) over data 2, give the loss and the adapters' gradients of the
    plain layer scan under the same dropout key. Keys per micro-batch index drew other masks than the plain pass's."""
    cfg = with_dropout(dataclasses.replace(lora_config(init_std=0.3, mesh=(2, 1, 1, 4), num_layers=8,
                                                       pipeline=PipelineConfig(microbatches=6, repeats=2)), rules="pp_dp"))
    graphdef, params = nnx.split(Llama(cfg.model, rngs=nnx.Rngs(0)))
    params = _randomise_adapters(nnx.to_pure_dict(params))
    tokens = jax.random.randint(jax.random.key(1), (12, 16), 0, cfg.model.vocab_size)
    probe = jax.random.normal(jax.random.key(2), (12, 16, cfg.model.d_model))  # hidden states are normed: weigh them

    def loss(params, key=None):
        with contextlib.nullcontext() if key is None else dropout_key(key):
            return jnp.mean(probe * nnx.merge(graphdef, params).hidden(tokens))

    def loss_and_grads(params, key):
        return jax.value_and_grad(loss)(params, key)

    plain = jax.jit(loss_and_grads)(params, jax.random.key(7))
    undropped = jax.jit(loss)(params)
    layout = make_layout(with_(cfg, train={"global_batch": 12}))
    with model_tracing(layout.mesh, layout.rules, cfg.rules):
        piped = jax.jit(loss_and_grads)(params, jax.random.key(7))
    assert abs(float(plain[0]) - float(undropped)) > 1e-3 * abs(float(undropped))  # the masks act
    np.testing.assert_allclose(piped[0], plain[0], rtol=1e-5)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6), piped[1], plain[1])


def test_dropout_zeroes_a_share_p_of_each_adapters_input_and_rescales_the_rest():
    """An adapter of A = B = identity and alpha = rank returns its dropped input: each entry 0 or x / (1 - p), 0 in a
    share p of them (PEFT's nn.Dropout); the adapter of another target, each batch row and each layer draw their own
    masks."""
    d = 64
    base = nnx.Param(jnp.zeros((d, d)), out_sharding=("embed", "mlp"), eager_sharding=False)
    adapters = [LoRA(base, 1, d, float(d), nnx.Rngs(0), DROPOUT, salt) for salt in (0, 1)]
    for adapter in adapters:
        adapter.a[...], adapter.b[...] = jnp.eye(d), jnp.eye(d)
    x = jax.random.uniform(jax.random.key(4), (4, 16, d), minval=1.0, maxval=2.0)
    with dropout_key(jax.random.key(0)):
        _, layer_keys = layer_inputs({}, 2)
        dropped = []  # (layer, adapter)
        for layer in range(2):
            with layer_scope(({}, nnx.Variable(layer_keys[...][layer]))):
                dropped.append([np.asarray(adapter(x)) for adapter in adapters])
    for out in dropped[0] + dropped[1]:
        kept = out != 0
        np.testing.assert_allclose(out[kept], np.asarray(x)[kept] / (1 - DROPOUT), rtol=1e-6)
        assert abs(1 - kept.mean() - DROPOUT) < 0.03, kept.mean()  # 4096 entries: a standard deviation of 0.007
        assert not any(np.array_equal(kept[i], kept[j]) for i in range(4) for j in range(i))
    assert not np.array_equal(dropped[0][0] != 0, dropped[0][1] != 0)
    assert not np.array_equal(dropped[0][0] != 0, dropped[1][0] != 0)


def test_a_pipelined_train_step_draws_the_masks_of_the_unpipelined_one(corpus):
    """A train step with dropout through 4 stages x 2 repeats over data 2 (whose gradients optim.grad_sync=auto sums
    once per step, each data group's passes apart), and through the plain layer scan on fsdp 4 x data 2 (GSPMD's sums in
    the one pass), and in 2 accumulated micro-batches on fsdp 2 x tensor 2 x data 2: the same gradient norm and
    adapters (B = 0 before the step: the masks show in the gradients, not the loss). Keys per micro-batch index gave the
    pipeline other masks, keys per data group the grouped passes, keys per accumulated micro-batch the accumulation."""
    piped = with_dropout(SETUPS["pipeline"]())
    assert make_layout(piped).grad_reduction is not None
    # scanned layers, as under the stages (model.scan_layers=auto unrolls on CPUs, and 8 unrolled layers with dropout
    # took XLA:CPU 2.5x as long to compile)
    plain = with_(dataclasses.replace(piped, rules="fsdp", mesh=lora_config(mesh=(2, 4, 1)).mesh),
                  model={"pipeline": PipelineConfig(), "scan_layers": True})
    accumulated = with_(dataclasses.replace(plain, rules="fsdp_tp", mesh=lora_config().mesh), train={"microbatches": 2})

    def one_step(cfg):
        layout = make_layout(cfg)
        state = lora_lib.load_base(layout, None).start_state(layout)
        batch = next(data_lib.train_batches(corpus, cfg.data, cfg.train.global_batch, layout.batch_sharding))
        state, metrics = lower_train_step(layout).compile()(state, batch)
        return float(metrics["grad_norm"]), jax.tree.map(np.asarray, state.params)

    plain_norm, plain_params = one_step(plain)
    for cfg in (piped, accumulated):
        norm, params = one_step(cfg)
        np.testing.assert_allclose(norm, plain_norm, rtol=1e-5)
        # Adam's first step moves an adapter entry of a near-zero gradient by up to 5e-6 for float32 sums in another order
        jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4), params, plain_params)
