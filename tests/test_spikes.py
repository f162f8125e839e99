"""The spike guard (train.skip_spikes): the window's statistics against numpy, a spike's update not applied, a run
that skips and logs spikes and resumes them exactly, and the guard switched on, off or resized on resume."""

import json
import re
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import small_config, with_
from jaxtrain import checkpoint as checkpoint_lib
from jaxtrain import spikes
from jaxtrain import train as train_lib
from jaxtrain.config import check
from jaxtrain.data import train_batches
from jaxtrain.errors import UserError

SIGMA, WINDOW = 0.5, 4  # a guard this tight skips steps of a short run on its own


def _config(**train):
    return with_(small_config(), train={"steps": 8, "skip_spikes": SIGMA, "spike_window": WINDOW} | train,
                 checkpoint={"every": 4, "keep": 3, "async_save": False}, log={"peak_tflops": 1.0})


@pytest.fixture(scope="module")
def guarded(corpus):
    return train_lib.build(_config(), corpus)


def _enter(window, loss, grad_norm):
    values = {"loss": jnp.float32(loss), "grad_norm": jnp.float32(grad_norm)}
    return spikes.entered(window, values, jnp.isfinite(values["loss"]) & jnp.isfinite(values["grad_norm"]))


def test_the_windows_mean_and_deviation_are_numpys_over_its_last_finite_steps():
    rng = np.random.default_rng(0)
    losses, norms = rng.normal(3.0, 0.2, 11), rng.normal(1.0, 0.1, 11)
    window = spikes.initial_window(8)
    for i in range(3):
        window = _enter(window, losses[i], norms[i])
    window = _enter(window, np.nan, 1.0)  # a non-finite step does not enter
    far = spikes.deviations(window, {"loss": jnp.float32(9.0), "grad_norm": jnp.float32(9.0)})
    assert int(window["count"]) == 3 and float(far["loss"]) == float(far["grad_norm"]) == 0  # under half the window: no verdict
    for i in range(3, 11):  # 11 entered: the ring holds the last 8
        window = _enter(window, losses[i], norms[i])
    far = spikes.deviations(window, {"loss": jnp.float32(2.0), "grad_norm": jnp.float32(1.5)})
    for name, held, value in (("loss", losses[3:], 2.0), ("grad_norm", norms[3:], 1.5)):
        assert float(far[name]) == pytest.approx(abs(value - held.mean()) / held.std(ddof=1), rel=1e-5)
    constant = spikes.initial_window(2)
    for _ in range(2):
        constant = _enter(constant, 1.0, 1.0)
    far = spikes.deviations(constant, {"loss": jnp.float32(1.0), "grad_norm": jnp.float32(1.5)})
    assert float(far["loss"]) == 0 and float(far["grad_norm"]) == np.inf  # no deviation at all: any other value is a spike


def _window(loss, grad_norm):
    """A full window centred on (loss, grad_norm), one standard deviation wide."""
    window = spikes.initial_window(WINDOW)
    for offset in (-1.0, 1.0, -1.0, 1.0):
        window = _enter(window, loss + offset, grad_norm + offset)
    return window


def test_a_spikes_update_is_not_applied_and_enters_the_window(guarded, corpus):
    batch = next(train_batches(corpus, guarded.cfg.data, guarded.cfg.train.global_batch, guarded.batch_sharding))
    copy = lambda state: jax.tree.map(jnp.copy, state)  # noqa: E731 -- the step takes (donates) its state
    start = guarded.init_state()
    _, first = guarded.train_step(copy(start), batch)  # an empty window: no verdict, the step's own values
    loss, grad_norm = float(first["loss"]), float(first["grad_norm"])
    assert not first["spike"]

    calm, metrics = guarded.train_step(copy(start).replace(spikes=_window(loss, grad_norm)), batch)
    assert not metrics["spike"] and float(metrics["loss_deviations"]) < SIGMA
    assert not np.array_equal(calm.params["embed"], start.params["embed"])

    spiked, metrics = guarded.train_step(copy(start).replace(spikes=_window(loss + 10, grad_norm)), batch)
    assert metrics["spike"] and float(metrics["loss_deviations"]) == pytest.approx(10 / np.sqrt(4 / 3), rel=1e-4)
    assert float(metrics["grad_norm_deviations"]) < SIGMA  # only the loss is far
    for kept, before in ((spiked.params, start.params), (spiked.opt_state, start.opt_state)):
        assert all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(kept), jax.tree.leaves(before), strict=True))
    assert int(spiked.step) == 1 and int(spiked.spikes["count"]) == WINDOW + 1
    assert float(spiked.spikes["loss"][0]) == pytest.approx(loss)  # in place of the oldest


def _records(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _state(run_dir, layout):
    return checkpoint_lib.restore_from(run_dir, layout.abstract_state(), None, params_only=False)


def _identical(a, b):
    leaves_a, leaves_b = jax.tree.leaves(a), jax.tree.leaves(b)
    return len(leaves_a) == len(leaves_b) and all(np.array_equal(x, y) for x, y in zip(leaves_a, leaves_b, strict=True))


def test_a_run_skips_spikes_logs_them_and_resumes_them_exactly(guarded, tmp_path, capsys):
    run = tmp_path / "run"
    train_lib.train(guarded.cfg, run, guarded)
    records = _records(run)
    skipped = {r["step"]: r for r in records if "skipped_spike" in r}
    steps = {r["step"]: r for r in records if "param_norm" in r}
    assert skipped and set(skipped) <= set(range(3, 9))  # a window of 4 gives a verdict from its 2nd entry on
    for step in range(2, 9):  # a skipped update leaves the parameters as they were
        assert (steps[step]["param_norm"] == steps[step - 1]["param_norm"]) == (step in skipped)
    first = min(skipped)
    assert skipped[first]["skipped_spike"] and all(skipped[first][f"{k}_deviations"] >= 0 for k in ("loss", "grad_norm"))
    assert steps[8]["skipped_spikes"] == len(skipped)
    line = next(line for line in capsys.readouterr().err.splitlines() if line.startswith(f"jaxtrain: step {first}: a spike"))
    assert first - 1 < WINDOW and f"standard deviations from the mean of the last {first - 1} steps" in line  # not yet full

    resumed = tmp_path / "resumed"  # preempted after step 4's checkpoint: the same command goes on from it
    shutil.copytree(run, resumed)
    shutil.rmtree(resumed / "checkpoints" / "8")
    train_lib.train(guarded.cfg, resumed, guarded)
    assert _identical(_state(resumed, guarded.layout), _state(run, guarded.layout))
    assert [r for r in _records(resumed) if "skipped_spike" in r] == list(skipped.values())

    source = tmp_path / "source"  # a new run going on from step 4: its schedule is at the updates applied by then
    shutil.copytree(run, source)
    shutil.rmtree(source / "checkpoints" / "8")
    capsys.readouterr()
    train_lib.train(guarded.cfg, tmp_path / "from_source", guarded, init_from=source)
    skipped_by_4 = sum(step <= 4 for step in skipped)
    assert skipped_by_4 and (f"the learning-rate schedule at update {4 - skipped_by_4} (its run skipped {skipped_by_4} of 4 "
                             "updates)") in capsys.readouterr().err


def _preempted_after_step_4(trainer, run_dir):
    """A run of ``trainer`` whose last checkpoint is step 4's, as a preemption after it leaves it."""
    train_lib.train(trainer.cfg, run_dir, trainer)
    shutil.rmtree(run_dir / "checkpoints" / "8")
    return run_dir


def test_the_guard_switched_on_off_or_resized_on_resume_starts_an_empty_window_or_drops_it(guarded, corpus, tmp_path, capsys):
    plain = train_lib.build(_config(skip_spikes=0.0), corpus)
    unguarded = _preempted_after_step_4(plain, tmp_path / "unguarded")
    capsys.readouterr()
    train_lib.train(guarded.cfg, unguarded, guarded)  # switched on: the window fills from step 5
    err = capsys.readouterr().err
    assert f"checkpoint step 4 in {unguarded / 'checkpoints'} holds no spike window of {WINDOW} steps (its run had " \
           "train.skip_spikes off or another train.spike_window): the guard skips nothing until 2 steps have entered an empty one" in err
    assert int(_state(unguarded, guarded.layout).spikes["count"]) == 4  # steps 5 to 8
    assert not any(r["step"] < 7 for r in _records(unguarded) if "skipped_spike" in r)

    for other, length in ((plain, None), (train_lib.build(_config(spike_window=2 * WINDOW), corpus), 2 * WINDOW)):
        guarded_run = _preempted_after_step_4(guarded, tmp_path / f"guarded_then_{length}")
        capsys.readouterr()
        final = train_lib.train(other.cfg, guarded_run, other)  # switched off or resized: the window left in the checkpoint
        # read, not quarantined as unreadable (a fresh start from step 0 would end at step 8 too)
        assert f"resuming from checkpoint step 4 in {guarded_run / 'checkpoints'}" in capsys.readouterr().err
        assert not (guarded_run / checkpoint_lib.QUARANTINE_DIR).exists()
        assert int(final.step) == 8 and (final.spikes is None if length is None else int(final.spikes["count"]) == 4)
    assert not any(r["step"] > 4 and "skipped_spike" in r for r in _records(tmp_path / "guarded_then_None"))


@pytest.mark.parametrize("key,value,message", [
    ("skip_spikes", -1.0, "train.skip_spikes=-1.0 must be at least 0 (standard deviations; 0: off)"),
    ("spike_window", 1,
     "train.spike_window=1 must be in [2, 2147483647] (the steps the mean and deviation of train.skip_spikes are taken over)"),
])
def test_bad_guard_settings_are_one_line(key, value, message):
    with pytest.raises(UserError, match=re.escape(message)):
        check(with_(small_config(), train={key: value}))
