"""Observability: TensorBoard and jsonl records, start-up summary, MFU and FLOPs counts, profiles,
`jaxtrain plot`, the progress line and the non-finite guard. One compiled trainer serves every run."""

import dataclasses
import io
import json

import jax
import numpy as np
import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from conftest import run_cli, small_config, with_
from jaxtrain import train as train_lib
from jaxtrain.flops import flops_per_token
from jaxtrain.metrics import NonFiniteError, Progress

STEPS = 6
PEAK_TFLOPS = 0.5  # an override, so MFU is checked against a known denominator


@pytest.fixture(scope="module")
def trainer(corpus):
    cfg = with_(small_config(), train={"steps": STEPS}, log={"every": 2, "layer_every": 3, "peak_tflops": PEAK_TFLOPS},
                checkpoint={"every": 2, "async_save": False})
    return train_lib.build(cfg, corpus)


def _loop_config(trainer, **sections):
    """The compiled trainer with other loop settings (logging, non-finite policy): no recompilation."""
    cfg = with_(trainer.cfg, **sections)
    return dataclasses.replace(trainer, layout=dataclasses.replace(trainer.layout, cfg=cfg))


def _records(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def two_runs(trainer, tmp_path_factory):
    """Two real short runs (the second profiles steps 3-4)."""
    first, second = tmp_path_factory.mktemp("run_a"), tmp_path_factory.mktemp("run_b")
    train_lib.train(trainer.cfg, first, trainer)
    profiled = _loop_config(trainer, log={"profile_steps": "3:4"})
    train_lib.train(profiled.cfg, second, profiled)
    return first, second


def test_records_tensorboard_and_summary(two_runs, trainer):
    run_dir = two_runs[0]
    records = _records(run_dir)
    steps = [r for r in records if "loss" in r]
    assert [r["step"] for r in steps] == [2, 4, 6]
    hand_flops = 6 * (2 * (32 * 4 * 8 + 2 * 32 * 2 * 8 + 4 * 8 * 32 + 3 * 32 * 64) + 32 * 64) + 6 * 2 * 16 * 4 * 8
    assert flops_per_token(trainer.cfg.model, 16) == hand_flops == 129024
    for r in steps:
        assert r["tokens_per_s"] == pytest.approx(8 * 16 / r["step_time_s"], rel=1e-9)
        assert r["tokens_per_s_per_device"] == pytest.approx(r["tokens_per_s"] / 8, rel=1e-9)
        assert r["mfu"] == pytest.approx(hand_flops * r["tokens_per_s"] / (8 * PEAK_TFLOPS * 1e12), rel=1e-9)
        assert r["param_norm"] > 0 and r["memory_in_use_gib"] > 0 and r["memory_peak_gib"] >= r["memory_in_use_gib"]
        assert r["memory_source"] == "host_rss" and r["data_wait_s"] >= 0 and r["checkpoint_s"] > 0
    layers = [r for r in records if "grad_norm_per_layer" in r]
    assert [r["step"] for r in layers] == [3, 6] and all(len(r["param_norm_per_layer"]) == 2 for r in layers)
    # the per-layer norms make up the layers' share of the total parameter norm
    assert np.linalg.norm(layers[1]["param_norm_per_layer"]) < steps[-1]["param_norm"]

    events = EventAccumulator(str(run_dir))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert {"train/loss", "eval/loss", "train/learning_rate", "train/grad_norm", "train/param_norm", "perf/tokens_per_s",
            "perf/tokens_per_s_per_device", "perf/step_time_s", "perf/mfu", "perf/data_wait_s", "perf/checkpoint_s",
            "memory/in_use_gib", "memory/peak_gib", "grad_norm_per_layer/layer_000", "param_norm_per_layer/layer_001"} <= tags
    assert [(e.step, e.value) for e in events.Scalars("train/loss")] == \
        [(r["step"], pytest.approx(r["loss"], rel=1e-6)) for r in steps]

    summary = json.loads((run_dir / "summary.json").read_text())
    num_params = trainer.layout.spec.num_params
    assert summary["params"] == num_params and summary["devices"] == 8 and summary["processes"] == 1
    assert summary["mesh"] == {"data": 2, "fsdp": 2, "tensor": 2} and summary["rules"] == "fsdp_tp"
    assert summary["attention"] == "xla"  # model.attention=auto on CPUs
    assert summary["global_batch_tokens"] == 128 and summary["flops_per_token"] == hand_flops
    assert summary["peak_flops_per_device"] == PEAK_TFLOPS * 1e12 and summary["compile_s"] > 0
    # fsdp_tp shards every matrix 4 ways (fsdp x tensor); float32, and AdamW keeps two moments per parameter
    assert num_params / 4 <= summary["params_per_device"] < num_params / 2
    assert summary["param_bytes_per_device"] == 4 * summary["params_per_device"]
    assert summary["opt_state_bytes_per_device"] >= 2 * summary["param_bytes_per_device"]


def test_profile_trace_written(two_runs):
    traces = list((two_runs[1] / "plugins" / "profile").glob("*/*.xplane.pb"))
    assert len(traces) == 1 and traces[0].stat().st_size > 0


def test_plot_two_runs(two_runs, tmp_path):
    out = tmp_path / "both.png"
    result = run_cli("plot", *map(str, two_runs), "--out", str(out), cwd=tmp_path, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 20_000
    missing = run_cli("plot", str(tmp_path / "nothing"), cwd=tmp_path, timeout=120)
    assert missing.returncode == 2 and missing.stderr.count("\n") == 1 and "metrics.jsonl does not exist" in missing.stderr


def test_flops_per_token_matches_xla_cost_analysis():
    # one device, float32, matmuls dominating (wide layers, short sequence): XLA counts every FLOP. One
    # layer, because cost analysis counts the body of the scan over layers once, not once per layer.
    cfg = with_(small_config(mesh=(1, 1, 1), vocab_size=256, d_model=256, num_layers=1, num_heads=4, num_kv_heads=4,
                             mlp_dim=1024),
                data={"seq_len": 32})
    layout = train_lib.make_layout(cfg, jax.devices()[:1])
    train_lowered, _ = train_lib.lower_steps(layout)
    xla_flops = train_lowered.compile().cost_analysis()["flops"]
    tokens = cfg.train.global_batch * cfg.data.seq_len
    assert flops_per_token(cfg.model, cfg.data.seq_len) * tokens == pytest.approx(xla_flops, rel=0.10)


class _Terminal(io.StringIO):
    def isatty(self):
        return True


@pytest.mark.parametrize("stream", [io.StringIO(), _Terminal()], ids=["log", "terminal"])
def test_progress_is_one_line_on_a_terminal_and_log_lines_otherwise(stream):
    progress = Progress(total=20, initial=0, stream=stream)
    for step in (10, 20):
        progress.update(step, {"loss": 2.5, "tokens_per_s": 1234.0, "mfu": 0.125}, eta_s=90.0 if step == 10 else 0.0)
    progress.close()
    text = stream.getvalue()
    if stream.isatty():
        assert text.count("\n") == 1 and "\r" in text and "20/20" in text and "mfu=12.5%" in text
    else:
        assert text.splitlines() == ["step 10/20 loss 2.5 tok/s 1,234 mfu 12.5% eta 1m30s",
                                     "step 20/20 loss 2.5 tok/s 1,234 mfu 12.5% eta 0m00s"]


class _Poisoned:
    """The run's batches with out-of-range token ids (NaN embeddings) at the given steps."""

    def __init__(self, batches, bad_steps, vocab_size):
        self.batches, self.iterator, self.bad, self.vocab, self.step = batches, batches.iterator, bad_steps, vocab_size, 0

    def __next__(self):
        batch, self.step = next(self.batches), self.step + 1
        return {**batch, "inputs": batch["inputs"] + self.vocab} if self.step in self.bad else batch


def _poison(monkeypatch, bad_steps, vocab_size):
    real = train_lib.data_lib.train_batches
    monkeypatch.setattr(train_lib.data_lib, "train_batches", lambda *a, **k: _Poisoned(real(*a, **k), bad_steps, vocab_size))


def test_nonfinite_stops_before_saving_and_last_checkpoint_restores(trainer, tmp_path, monkeypatch):
    run_dir = tmp_path / "run"
    _poison(monkeypatch, {5}, trainer.cfg.model.vocab_size)
    with pytest.raises(NonFiniteError) as stop:
        train_lib.train(trainer.cfg, run_dir, trainer)
    message = str(stop.value)
    assert "\n" not in message and message.startswith("step 5: loss and grad_norm not finite (loss nan, grad_norm nan)")
    assert "last finite values at step 4: loss " in message and "train.skip_nonfinite=N" in message
    assert sorted(int(p.name) for p in (run_dir / "checkpoints").iterdir() if p.name.isdigit())[-1] == 4
    assert max(r["step"] for r in _records(run_dir)) == 4

    monkeypatch.undo()  # the same command again, with good data: resumes from step 4
    state = train_lib.train(trainer.cfg, run_dir, trainer)
    assert int(state.step) == STEPS and [r["step"] for r in _records(run_dir) if "loss" in r] == [2, 4, 6]
    assert all(np.isfinite(x).all() for x in jax.tree.leaves(jax.device_get(state.params)))


def test_skip_nonfinite_leaves_state_unchanged_and_logs_each_skip(trainer, tmp_path, monkeypatch):
    _poison(monkeypatch, {3}, trainer.cfg.model.vocab_size)
    skipping = _loop_config(trainer, train={"skip_nonfinite": 1})
    cfg = skipping.cfg
    state = train_lib.train(cfg, tmp_path / "run", skipping)
    assert int(state.step) == STEPS
    skips = [r for r in _records(tmp_path / "run") if "skipped_nonfinite" in r]
    assert skips == [{"step": 3, "skipped_nonfinite": ["loss", "grad_norm"], "loss": None, "grad_norm": None}]

    # the step itself: a bad batch leaves parameters and optimizer state bit-identical, the counter advances
    batch = next(train_lib.data_lib.train_batches(trainer.corpus, cfg.data, cfg.train.global_batch, trainer.batch_sharding))
    before = jax.device_get(trainer.init_state())
    after, metrics = trainer.train_step(trainer.init_state(), {**batch, "inputs": batch["inputs"] + 64})
    assert not np.isfinite(float(metrics["loss"])) and int(after.step) == 1
    jax.tree.map(np.testing.assert_array_equal, jax.device_get((after.params, after.opt_state)),
                 (before.params, before.opt_state))
