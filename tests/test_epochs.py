"""train.epochs: passes over the training split instead of a step count, counted once the data is read; the run
stops at the first step that has read them, its learning-rate schedule ending there. (The counts themselves:
test_data.py for text, test_sft.py for packed instruction data.)"""

import json

import jax
import numpy as np
import optax
import pytest
import yaml

from conftest import small_config, with_
from jaxtrain import config as config_lib
from jaxtrain.data import epoch, load_data
from jaxtrain.errors import UserError
from jaxtrain.layout import make_layout, with_train_steps
from jaxtrain.train import check, train


def _token_file(tmp_path, tokens=1000):
    """1000 tokens: 800 train (49 sequences of 16), 200 validation."""
    path = tmp_path / "tokens.npy"
    np.save(path, np.random.default_rng(0).integers(0, 64, tokens, dtype=np.int32))
    return path


def _epochs_config(path, epochs, **log):
    return with_(small_config(), data={"path": str(path), "val_fraction": 0.2},
                 train={"epochs": epochs, "steps": 3, "global_batch": 8, "eval_batches": 1},  # steps: what epochs replace
                 checkpoint={"async_save": False}, log={"tensorboard": False, "peak_tflops": 1.0} | log)


def test_a_run_given_epochs_stops_at_the_first_step_that_has_read_them(tmp_path):
    """0.75 of an epoch of 49 sequences is 36.75 of them, 8 a step: the fifth step's batch reaches them. The records
    say the epochs read at each step, the summary the steps the epochs came to, config.yaml both."""
    cfg = _epochs_config(_token_file(tmp_path), 0.75)
    size = epoch(load_data(cfg.data), cfg.data).size
    assert size == 49
    train(cfg, tmp_path / "run")
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [(r["step"], r["epoch"]) for r in records if "loss" in r] == [(s, 8 * s / size) for s in range(1, 6)]
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())["epoch"]
    assert (summary["train_epochs"], summary["train_steps"], summary["at_end"]) == (0.75, 5, 40 / size)
    saved = yaml.safe_load((tmp_path / "run" / "config.yaml").read_text())["train"]
    assert (saved["epochs"], saved["steps"]) == (0.75, 5)


def test_a_resume_counts_its_epochs_on_from_its_checkpoint(tmp_path, monkeypatch, capsys):
    """49 sequences an epoch; the run read 40 in 5 steps of 8. Resumed with 4 a batch and 1 epoch it counts on from its
    checkpoint's data position: 9 sequences left, 3 steps (from the beginning, 4 a batch came to 13 steps: the run read
    72 sequences, not 49); with 0.75 it has read them. Where nothing changed it takes the checkpoint's count, not
    counting again (instruction data's count packs every example: minutes at each start of a preempted run); on other
    data it counts from the beginning."""
    from jaxtrain import train as train_lib

    cfg, run_dir = _epochs_config(_token_file(tmp_path), 0.75), tmp_path / "run"
    train(cfg, run_dir)
    starts, count = [], train_lib.data_lib.steps_for_epochs
    monkeypatch.setattr(train_lib.data_lib, "steps_for_epochs", lambda *args: starts.append(args[-1]) or count(*args))
    for changed, steps in (({}, 5), ({"epochs": 1.0}, 7), ({"epochs": 1.0, "global_batch": 4}, 8), ({"global_batch": 4}, 5)):
        assert check(with_(cfg, train=changed), run_dir=run_dir).layout.cfg.train.steps == steps, changed
    assert starts[0] == starts[1] == train_lib.checkpoint_lib.saved_data_position(run_dir / "checkpoints" / "5")
    assert len(starts) == 3 and starts[0]["sequences"] == 40  # the unchanged run: the checkpoint's count
    capsys.readouterr()
    train(with_(cfg, train={"global_batch": 4}), run_dir)
    assert (f"jaxtrain: {run_dir} is already at step 5 of the 5 steps train.epochs=0.75 came to, nothing to do; raise "
            "train.epochs to train on") in capsys.readouterr().err
    _token_file(tmp_path, tokens=1200)  # 960 training tokens: 59 sequences, 0.75 of them 44.25, 6 steps from the beginning
    assert check(cfg, run_dir=run_dir).layout.cfg.train.steps == 6 and starts[-1] is None


def test_the_steps_the_epochs_came_to_get_a_schedule_ending_there():
    """The optimizer, whose learning-rate schedule ends at train.steps, is made again for the steps counted: its updates
    are those of a layout made with that train.steps, not with the one it replaced."""
    cfg = with_(small_config("dp", (1, 1, 1)), optim={"warmup_steps": 0})
    counted = with_train_steps(make_layout(with_(cfg, train={"steps": 100}), jax.devices()[:1]), 8)
    assert counted.cfg.train.steps == 8

    def params_after_updates(tx, updates=3):  # the cosines over 8 and 100 steps part from the second update on
        params = jax.tree.map(lambda s: np.ones(s.shape, np.float32), counted.spec.shapes)
        state = tx.init(params)
        for _ in range(updates):
            update, state = tx.update(jax.tree.map(np.ones_like, params), state, params)
            params = optax.apply_updates(params, update)
        return params

    after = params_after_updates(counted.tx)
    jax.tree.map(np.testing.assert_array_equal, after, params_after_updates(make_layout(with_(cfg, train={"steps": 8}),
                                                                                       jax.devices()[:1]).tx))
    uncounted = params_after_updates(make_layout(with_(cfg, train={"steps": 100}), jax.devices()[:1]).tx)
    assert not np.array_equal(after["embed"], uncounted["embed"])


def test_a_profile_past_the_steps_the_epochs_came_to_is_refused_once_they_are_counted(tmp_path):
    """Before the data is read the count is unknown: log.profile_steps is checked against it at the start, before the
    compile, in one line."""
    cfg = _epochs_config(_token_file(tmp_path), 0.75, profile_steps="4:6")
    config_lib.check(cfg)  # the range's form alone
    with pytest.raises(UserError, match=r"^log.profile_steps=4:6 ends after train.epochs=0.75 came to train.steps=5; end the range "
                                        r"by step 5 or raise train.epochs$"):
        check(cfg)
    with pytest.raises(UserError, match="log.profile_steps='6:4' must be START:END"):  # its form: before the data is read
        config_lib.check(with_(cfg, log={"profile_steps": "6:4"}))


@pytest.mark.parametrize("item, message", [
    ("train.epochs=-1", r"train.epochs=-1.0 must be at least 0 \(passes over the training split; 0: train.steps decides\)"),
    ("train.epochs=inf", "train.epochs=inf must be a finite number, at least 0"),
    ("train.epochs=nan", "train.epochs=nan must be a finite number, at least 0"),
    ("train.num_train_epochs=3", "unknown config key 'train.num_train_epochs'; did you mean 'train.epochs'"),  # transformers' name
])
def test_bad_epochs_are_one_line(item, message):
    with pytest.raises(UserError, match=message):
        config_lib.check(config_lib.apply_overrides(config_lib.Config(), [item]))
