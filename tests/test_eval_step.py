"""The eval step scores the batch in the train step's micro-batches: it never needs more device memory than the train
step (the planner's peak, which compiles the train step, covers evaluation), and its sums are the whole batch's."""

import json

import jax
import numpy as np
import pytest

from conftest import small_config, with_
from jaxtrain import data as data_lib
from jaxtrain.layout import compile_train_step, lower_eval_step, lower_train_step, make_layout
from jaxtrain.plan.estimate import unfitted_layout
from jaxtrain.state import bytes_per_device, state_initializer
from jaxtrain.train import Checked, build, compile_steps, train
from test_lora import lora_config
from test_step import ROWS, _weighted_batch

# a vocabulary large beside the model, as an LLM's is: the whole batch's float32 logits in one pass (the eval step until
# 2026-12-06) outweighed the train step's micro-batch of them with its gradients and optimizer state
LARGE_VOCAB = {"vocab_size": 2048}
MEMORY_SETUPS = {
    "fsdp_tp": lambda: small_config(**LARGE_VOCAB),
    "loss_chunk": lambda: with_(small_config(**LARGE_VOCAB), train={"loss_chunk": 4}),
    "lora": lambda: lora_config(**LARGE_VOCAB),
    "sft_weights": lambda: with_(small_config(**LARGE_VOCAB), data={"format": "sft"}),
}


@pytest.mark.parametrize("setup", MEMORY_SETUPS)
def test_evaluation_needs_no_more_device_memory_than_the_train_step(setup):
    """During a run the train state and the last train batch stay on the devices while the eval step runs, so the
    evaluation's peak is the train step's arguments plus the eval step's batch, temporaries and outputs: it must stay
    under the train step's peak. At train.microbatches=8 the unsplit eval step (until 2026-12-06) held 8x a train
    pass's logits: here 2.30 MB against the train step's 1.73 (fsdp_tp; 1.22 for LoRA), now 0.58; llama3_8b on h100x8
    at seq 8192: 125 GiB of float32 logits a device at the first evaluation."""
    cfg = with_(MEMORY_SETUPS[setup](), data={"seq_len": 64}, train={"global_batch": 32, "microbatches": 8})
    layout = make_layout(cfg)
    train_memory, eval_memory = (lower(layout).compile().memory_analysis() for lower in (lower_train_step, lower_eval_step))
    batch = bytes_per_device(layout.abstract_batch())
    train_working = train_memory.temp_size_in_bytes + train_memory.output_size_in_bytes - train_memory.alias_size_in_bytes
    eval_working = batch + eval_memory.temp_size_in_bytes + eval_memory.output_size_in_bytes
    assert eval_working <= train_working, (setup, eval_working, train_working)


def test_auto_micro_batches_evaluate_in_the_fitted_count():
    """train.microbatches=auto: the eval step is compiled with the count the train step was fitted to (a memory limit
    under the one-pass train step's peak, as a device's would be), not with one pass."""
    cfg = with_(small_config(**LARGE_VOCAB), data={"seq_len": 32}, train={"global_batch": 32, "microbatches": "auto"})
    layout = unfitted_layout(cfg)
    one_pass_peak = compile_train_step(layout)[1]
    trainer = compile_steps(Checked(layout, None, one_pass_peak - 1, microbatches_auto=True))
    assert trainer.layout.cfg.train.microbatches > 1
    unsplit = lower_eval_step(layout).compile().memory_analysis().temp_size_in_bytes
    assert trainer.eval_step.memory_analysis().temp_size_in_bytes < unsplit


def test_a_split_evaluation_sums_the_nats_and_tokens_of_the_whole_batch():
    """Weighted (instruction data) batches whose micro-batches count different numbers of tokens: the split eval step's
    sums are the one pass's, the count exactly, the nats to float32 rounding (summed in another order)."""
    cfg = with_(small_config(), data={"format": "sft", "seq_len": 16}, train={"global_batch": ROWS})
    batch = _weighted_batch(cfg.model.vocab_size)
    sums = {}
    for microbatches in (1, 4):
        layout = make_layout(with_(cfg, train={"microbatches": microbatches}))
        params = state_initializer(cfg.model, layout.tx, 0, layout.shardings)().model_params
        nats, tokens = lower_eval_step(layout).compile()(params, jax.device_put(batch, layout.batch_sharding))
        sums[microbatches] = float(nats), float(tokens)
    assert sums[4][1] == sums[1][1] == batch["weights"].sum()
    np.testing.assert_allclose(sums[4][0], sums[1][0], rtol=1e-6)


def test_a_runs_eval_loss_is_the_unsplit_evaluations(corpus, tmp_path):
    """A real run at train.microbatches=4: its recorded eval_loss and eval_tokens are those of the whole batches
    scored in one pass each (the eval step before 2026-12-06), on the run's final parameters."""
    cfg = with_(small_config(), train={"steps": 2, "global_batch": 16, "microbatches": 4, "eval_batches": 2})
    trainer = build(cfg, corpus)
    final = train(cfg, tmp_path / "run", trainer)
    record = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()][-1]
    unsplit = lower_eval_step(make_layout(with_(cfg, train={"microbatches": 1}))).compile()
    eval_data = data_lib.eval_batches(corpus, cfg.data, 16, trainer.batch_sharding, 2)
    split_sums = [tuple(map(float, trainer.eval_step(final.model_params, b))) for b in eval_data]
    unsplit_sums = [tuple(map(float, unsplit(final.model_params, b))) for b in eval_data]
    assert [t for _, t in split_sums] == [t for _, t in unsplit_sums] == [16.0 * cfg.data.seq_len] * 2
    np.testing.assert_allclose([n for n, _ in split_sums], [n for n, _ in unsplit_sums], rtol=1e-6)
    assert record["eval_tokens"] == 2 * 16 * cfg.data.seq_len
    np.testing.assert_allclose(record["eval_loss"], sum(n for n, _ in unsplit_sums) / record["eval_tokens"], rtol=1e-6)


def test_validation_batches_stay_in_host_memory_until_scored(corpus):
    """The train.eval_batches validation batches had all been kept on the devices for the whole run, beside the train
    state (uncounted by the planner): they are host arrays now, each put on the devices as the evaluation reaches it."""
    cfg = small_config()
    sharding = make_layout(cfg).batch_sharding
    before = {id(a) for a in jax.live_arrays()}
    batches = data_lib.eval_batches(corpus, cfg.data, 8, sharding, 3)
    assert len(batches) == 3 and not [a for a in jax.live_arrays() if id(a) not in before]
    for batch in batches:
        assert all(isinstance(x, jax.Array) and x.sharding == sharding and x.shape == (8, cfg.data.seq_len)
                   for x in batch.values())
