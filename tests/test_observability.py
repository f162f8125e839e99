"""Observability: TensorBoard and jsonl records, start-up summary, MFU and FLOPs counts, profiles,
`jaxtrain plot`, the progress line and the non-finite guard. One compiled trainer serves every run."""

import asyncio
import dataclasses
import gc
import io
import json
import math
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import jax
import numpy as np
import pytest
from jax.experimental import io_callback
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from conftest import REPO, fill_disk, run_cli, small_config, subprocess_env, with_
from jaxtrain.observe import exporters
from jaxtrain.observe import metrics as metrics_lib
from jaxtrain.observe import step_profile
from jaxtrain import train as train_lib
from jaxtrain.checkpoint import Preempted
from jaxtrain import config as config_lib
from jaxtrain.config import Config, OptimConfig
from jaxtrain.errors import UserError
from jaxtrain.observe.exporters import check_port_free
from jaxtrain.observe.flops import flops_per_token, model_flops_per_token, peak_flops
from jaxtrain.layout import lower_train_step, make_layout
from jaxtrain.observe.metrics import NonFiniteError, Progress, format_summary
from jaxtrain.observe.records import is_skip_record
from jaxtrain.optim import describe_schedule, learning_rate_schedule
from jaxtrain.step import schedule_count
from jaxtrain.models.config import LoraConfig, MoEConfig

STEPS = 6
PEAK_TFLOPS = 0.5  # an override, so MFU is checked against a known denominator


@pytest.fixture(scope="module")
def trainer(corpus):
    cfg = with_(small_config(), train={"steps": STEPS}, log={"every": 2, "layer_every": 3, "peak_tflops": PEAK_TFLOPS},
                checkpoint={"every": 2, "async_save": False})
    return train_lib.build(cfg, corpus)


def test_the_start_up_summary_names_the_precision_remat_and_what_lies_in_host_memory():
    """bfloat16 compute with int8 matmuls, remat on the first layer, optim.offload: each named in the first lines, the
    float32 master weights and the optimizer state said to be in host memory (a QA report: the summary named none)."""
    from jaxtrain.layout import make_layout

    cfg = with_(small_config(), model={"dtype": "bfloat16", "quant": "int8", "remat": "full", "remat_layers": 1}, optim={"offload": True})
    summary = metrics_lib.startup_summary(make_layout(cfg), 0.0, None, "test", None, "none")
    assert summary["precision"] == "bfloat16 compute, float32 parameters, int8 matmuls"
    assert summary["remat"] == "full on the first 1 of 2 layers"
    assert summary["host_memory"] == {"parameters": True, "optimizer_state": True}
    text = metrics_lib.format_summary(summary)
    assert "; bfloat16 compute, float32 parameters, int8 matmuls; remat full on the first 1 of 2 layers\n" in text
    assert text.count(" GiB in host memory (optim.offload)") == 2
    half = metrics_lib.startup_summary(make_layout(with_(small_config(), model={"dtype": "float16"})), 0.0, None, "test", None, "none")
    assert half["precision"] == "float16 compute, float32 parameters, dynamic loss scale" and not any(half["host_memory"].values())
    adapted = with_(small_config(), model={"dtype": "bfloat16", "param_dtype": "bfloat16", "lora": LoraConfig(rank=4, alpha=8.0)})
    assert metrics_lib.startup_summary(make_layout(adapted), 0.0, None, "test", None, "none")["precision"] == \
        "bfloat16 compute, bfloat16 base, float32 adapters"


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


def test_tensorboard_writer_loads_without_torch_and_torch_still_imports_after(tmp_path):
    """torch is installed here (the test extra), so a plain tensorboardX import would load it."""
    script = (f"import sys; from jaxtrain.observe.metrics import tensorboard_writer_class; "
              f"w = tensorboard_writer_class()({str(tmp_path)!r}); w.add_scalar('train/loss', 2.5, 1); w.close(); "
              "print('torch' in sys.modules); import torch; print(torch.ones(1).item())")
    result = subprocess.run([sys.executable, "-c", script], cwd=REPO, env=subprocess_env(), capture_output=True, text=True)
    assert result.stdout.split() == ["False", "1.0"], result.stderr[-2000:]
    events = EventAccumulator(str(tmp_path))
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("train/loss")] == [(1, 2.5)]


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
        assert r["memory_source"] == "host_rss" and r["memory_process"] == 0 and r["data_wait_s"] >= 0 and r["checkpoint_s"] > 0
    layers = [r for r in records if "grad_norm_per_layer" in r]
    assert [r["step"] for r in layers] == [3, 6] and all(len(r["param_norm_per_layer"]) == 2 for r in layers)
    # the per-layer norms make up the layers' share of the total parameter norm
    assert np.linalg.norm(layers[1]["param_norm_per_layer"]) < steps[-1]["param_norm"]

    events = EventAccumulator(str(run_dir))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert {"train/loss", "eval/loss", "train/learning_rate", "train/grad_norm", "train/param_norm", "perf/tokens_per_s",
            "perf/tokens_per_s_per_device", "perf/step_time_s", "perf/mfu", "perf/data_wait_s", "perf/checkpoint_s",
            "memory/in_use_gib", "memory/peak_gib", "grad_norm_per_layer/layer_000", "param_norm_per_layer/layer_001",
            "train/epoch"} <= tags
    assert [(e.step, e.value) for e in events.Scalars("train/loss")] == \
        [(r["step"], pytest.approx(r["loss"], rel=1e-6)) for r in steps]

    summary = json.loads((run_dir / "summary.json").read_text())
    num_params = trainer.layout.spec.num_params
    assert summary["params"] == num_params and summary["devices"] == 8 and summary["processes"] == 1
    assert summary["mesh"] == {"data": 2, "fsdp": 2, "tensor": 2, "stage": 1, "expert": 1} and summary["rules"] == "fsdp_tp"
    assert summary["attention"] == "chunked"  # model.attention=auto on CPUs
    assert summary["grouped_matmul"] is None  # a dense model (mixture of experts: model.moe.grouped_matmul as resolved)
    assert "; experts' grouped matmul tokamax" in format_summary(summary | {"grouped_matmul": "tokamax"})
    assert "grouped matmul" not in format_summary(summary)
    assert f"\n  optimizer {describe_schedule(trainer.cfg)}\n" in format_summary(summary)  # the schedule in words
    # model.scan_layers=auto on CPUs: the compiled step has no loop (no micro-batches either here) but those of the
    # embedding gradient's scatter, where XLA:CPU's older code generator (the tests' conftest) compiles it to one
    loops = [op for op in trainer.train_step.as_text().splitlines() if " while(" in op and "scatter" not in op]
    assert summary["layers"] == "unrolled" and not loops
    assert summary["global_batch_tokens"] == 128 and summary["flops_per_token"] == hand_flops
    assert summary["grad_sync"] == "microbatch"  # one micro-batch: GSPMD's sums, overlapped with the backward
    synced = lambda sync: format_summary(summary | {"microbatches": 4, "grad_sync": sync})  # noqa: E731
    assert "4 micro-batch(es), gradients summed across the batch shards once per step;" in synced("step")
    assert "in every micro-batch" in synced("microbatch") and "gradients summed" not in format_summary(summary)
    assert "4 micro-batch(es), no replica axis to sum the gradients over (optim.grad_sync has no effect);" in synced(None)
    assert summary["peak_flops_per_device"] == PEAK_TFLOPS * 1e12 and summary["compile_s"] > 0
    assert summary["idle_axes"] == {} and "note: mesh axis" not in format_summary(summary)
    # a warmup longer than the run (a QA report: shortened without a word)
    assert summary["warmup_steps"] == summary["configured_warmup_steps"] == 0 and "note: optim.warmup_steps" not in format_summary(summary)
    assert "\n  note: optim.warmup_steps=20 is more than train.steps=12: the learning rate warms up over the 12 steps, reaching " \
        "optim.lr at the last, and never decays; raise train.steps or lower optim.warmup_steps" in \
        format_summary(summary | {"configured_warmup_steps": 20, "warmup_steps": 12})
    assert "the learning rate is optim.lr at the run's one step and never decays;" in \
        format_summary(summary | {"configured_warmup_steps": 20, "warmup_steps": 1})
    assert "\n  note: mesh axis tensor 2 splits neither the batch nor any parameter under rule set fsdp_tp: the same work runs 2 " \
        "times over;" in format_summary(summary | {"idle_axes": {"tensor": 2}})
    # precision and the memory techniques, as the config resolved them (a QA report: the summary named none of them)
    assert summary["precision"] == "float32 compute, float32 parameters" and summary["remat"] == trainer.cfg.model.remat == "none"
    assert summary["host_memory"] == {"parameters": False, "optimizer_state": False}
    assert "; float32 compute, float32 parameters; remat none\n" in format_summary(summary)
    assert "host memory" not in format_summary(summary)
    # fsdp_tp shards every matrix 4 ways (fsdp x tensor); float32, and AdamW keeps two moments per parameter
    assert num_params / 4 <= summary["params_per_device"] < num_params / 2 and summary["trained_params"] is None
    assert summary["param_bytes_per_device"] == 4 * summary["params_per_device"]
    assert summary["opt_state_bytes_per_device"] >= 2 * summary["param_bytes_per_device"]
    assert summary["cpu_devices_per_core"] == 8 / len(os.sched_getaffinity(0))
    crowded = lambda per_core: "simulated CPU devices per core" in format_summary(summary | {"cpu_devices_per_core": per_core})  # noqa: E731
    assert crowded(4.0) and not crowded(1.0) and not crowded(None)  # None: an accelerator
    # conftest configures malloc as `jaxtrain train` does on a CPU
    assert summary["host_malloc"] == "glibc" and summary["host_malloc_kept"] is True
    returned = lambda kept, malloc="glibc": format_summary(summary | {"host_malloc": malloc, "host_malloc_kept": kept})  # noqa: E731
    assert "maps and zeroes them again" in returned(False) and "JAXTRAIN_HOST_MALLOC=keep" in returned(False)
    assert "MALLOC_CONF=dirty_decay_ms:-1" in returned(False, "jemalloc")  # preloaded by the user with its defaults
    assert "maps and zeroes" not in returned(True) + returned(None, None)


def test_a_lora_runs_mfu_counts_the_work_its_step_needs(corpus, tmp_path):
    """A frozen base takes no weight gradients: 4 FLOPs per base parameter a token (the forward, the gradient of its
    input), the adapters 6 per parameter. MFU had counted the base's 6N, about 1.5x the work done."""
    cfg = with_(small_config(), model={"lora": LoraConfig(rank=4, alpha=8.0)}, train={"steps": 2},
                log={"every": 2, "peak_tflops": PEAK_TFLOPS}, checkpoint={"every": 2, "async_save": False})
    trainer = train_lib.build(cfg, corpus)
    train_lib.train(cfg, tmp_path, trainer)
    base = 2 * (32 * 4 * 8 + 2 * 32 * 2 * 8 + 4 * 8 * 32 + 3 * 32 * 64) + 32 * 64  # the matmuls' weights, as above
    adapters = 2 * 4 * ((32 + 32) + 2 * (32 + 16) + (32 + 32) + 2 * (32 + 64) + (64 + 32))  # rank 4 on q, k, v, o, gate, up, down
    hand_flops = 4 * base + 6 * adapters + 6 * 2 * 16 * 4 * 8
    assert json.loads((tmp_path / "summary.json").read_text())["flops_per_token"] == hand_flops == 112640
    [record] = [r for r in _records(tmp_path) if "loss" in r]
    assert record["mfu"] == pytest.approx(hand_flops * record["tokens_per_s"] / (8 * PEAK_TFLOPS * 1e12), rel=1e-9)


def test_a_lora_on_experts_counts_the_adapters_of_the_top_k_experts_a_token_passes():
    """The adapters on a mixture of experts' experts work for the top_k experts a token is routed to, not for all of them;
    the frozen base's experts likewise (and the router) at 4 FLOPs per parameter."""
    lora = LoraConfig(rank=2, alpha=3.0, targets="q,gate,up,down")
    cfg = with_(small_config(), model={"moe": MoEConfig(num_experts=4, top_k=2), "lora": lora})
    base = 2 * (32 * 4 * 8 + 2 * 32 * 2 * 8 + 4 * 8 * 32 + 3 * 32 * 64 * 2 + 32 * 4) + 32 * 64  # 2 of 4 experts' SwiGLU, the router
    # rank 2 on q; on each of the 2 experts, one A for gate and up with a B each, and down
    adapters = 2 * ((32 * 2 + 2 * 4 * 8) + 2 * ((32 * 2 + 2 * 2 * 64) + (64 * 2 + 2 * 32)))
    assert model_flops_per_token(make_layout(cfg)) == 4 * base + 6 * adapters + 6 * 2 * 16 * 4 * 8 == 152064
    # a shared expert: one SwiGLU more for every token
    shared = with_(cfg, model={"moe": MoEConfig(num_experts=4, top_k=2, num_shared_experts=1), "lora": LoraConfig()}).model
    assert flops_per_token(shared, 16) == flops_per_token(cfg.model, 16) + 6 * 2 * 3 * 32 * 64


def test_an_explicit_head_dim_sizes_the_projections_and_attention():
    """model.head_dim set apart from d_model / num_heads (Gemma-like shapes): q, k, v, o and the scores use it."""
    model = small_config(head_dim=16).model  # d_model 32, 4 heads, 2 KV heads: 8 without it
    per_layer = 32 * 4 * 16 + 2 * 32 * 2 * 16 + 4 * 16 * 32 + 3 * 32 * 64  # q, k and v (2 KV heads), o, SwiGLU
    assert flops_per_token(model, 16) == 6 * (2 * per_layer + 32 * 64) + 6 * 2 * 16 * 4 * 16 == 172032


@pytest.mark.parametrize("device_kind,dtype,tflops", [
    ("NVIDIA H100 80GB HBM3", "bfloat16", 989.4),  # SXM
    ("NVIDIA H100 80GB HBM3", "float16", 989.4),
    ("NVIDIA H100 80GB HBM3", "float32", 494.7),  # TF32 tensor cores
    ("NVIDIA H100 PCIe", "bfloat16", 756.0),
    ("NVIDIA H100 NVL", "bfloat16", 835.5),
    ("NVIDIA H200", "bfloat16", 989.4),
    ("NVIDIA H200 NVL", "float32", 417.5),
    ("NVIDIA GH200 480GB", "bfloat16", 989.4),
    ("NVIDIA A100-SXM4-80GB", "bfloat16", 312.0),
    ("NVIDIA L4", "float32", 60.0),
    ("NVIDIA L40S", "bfloat16", None),  # another chip, not an L4
    ("cpu", "bfloat16", None),
])
def test_the_peak_is_the_datasheets_dense_figure_for_the_device_and_dtype(device_kind, dtype, tflops):
    assert peak_flops(device_kind, dtype) == (None if tflops is None else tflops * 1e12)


def test_the_mfu_peak_is_the_override_else_the_datasheets_for_the_model_dtype_else_unknown():
    h100 = [type("Device", (), {"device_kind": "NVIDIA H100 80GB HBM3", "platform": "gpu"})()]
    assert metrics_lib.resolve_peak(small_config(dtype="float32"), h100) == (494.7e12, "datasheet, NVIDIA H100 80GB HBM3, float32")
    assert metrics_lib.resolve_peak(small_config(dtype="bfloat16"), h100) == (989.4e12, "datasheet, NVIDIA H100 80GB HBM3, bfloat16")
    assert metrics_lib.resolve_peak(with_(small_config(), log={"peak_tflops": 100.0}), h100) == (100e12, "log.peak_tflops")
    mi300 = [type("Device", (), {"device_kind": "AMD Instinct MI300X", "platform": "rocm"})()]
    assert metrics_lib.resolve_peak(small_config(), mi300) == (None, "unknown for AMD Instinct MI300X; set log.peak_tflops")


def test_a_cpus_peak_is_one_devices_share_of_the_devices_measured_together(monkeypatch):
    """The matmul benchmark times the devices multiplying at once; MFU's denominator multiplies the peak by the devices."""
    monkeypatch.setattr(metrics_lib, "measure_matmul_peak", lambda devices, size, dtype: 3e9 * len(devices))
    metrics_lib._measured_cpu_peak.cache_clear()  # a measurement another test made
    try:
        assert metrics_lib.resolve_peak(small_config(), jax.devices()[:4]) == (3e9, "measured float32 matmul on 4 CPU devices")
    finally:
        metrics_lib._measured_cpu_peak.cache_clear()


def test_mfu_counts_the_whole_batch_over_the_meshs_devices_with_micro_batches(tmp_path, monkeypatch):
    """A mesh of 4 of this process's 8 devices, 2 micro-batches: a step's tokens are the global batch's (8 x 16), not a
    micro-batch's, and MFU divides by the mesh's devices (the job's, on several hosts), not the process's."""
    now = [0.0]
    monkeypatch.setattr(metrics_lib, "time", type("Clock", (), {"perf_counter": staticmethod(lambda: now[0])}))
    cfg = with_(small_config(mesh=(1, 2, 2)), train={"microbatches": 2, "steps": 1}, log={"peak_tflops": PEAK_TFLOPS, "tensorboard": False})
    log = metrics_lib.MetricsLog(make_layout(cfg, jax.devices()[:4]), tmp_path, 0, compile_s=1.0, compile_cache=None, data="test",
                                 enabled=True)
    try:
        now[0] += 2.0
        log.after_step(1, {"loss": np.float32(3.0), "learning_rate": np.float32(1e-3), "grad_norm": np.float32(1.0),
                           "param_norm": np.float32(4.0)})
    finally:
        log.close()
    [record] = _records(tmp_path)
    assert record["tokens_per_s"] == 8 * 16 / 2.0 and record["tokens_per_s_per_device"] == 64 / 4
    assert record["mfu"] == pytest.approx(129024 * 64 / (4 * PEAK_TFLOPS * 1e12), rel=1e-12)


def _check_cpu_profile(profile: dict, steps: int) -> None:
    """A summary of XLA:CPU's ops of whole steps: every op the compiled program's, each run a whole number of times
    per step, matmuls and the fsdp_tp mesh's collectives among them (jaxtrain.observe.step_profile; its GPU trace:
    tests/test_step_profile.py)."""
    assert profile["steps"] == steps and profile["device"] == "/host:CPU" and profile["unattributed_ms_per_step"] == 0
    by_kind = profile["ms_per_step_by_kind"]
    assert by_kind["matmul"] > 0 and by_kind["other"] > 0 and by_kind["collective"] > 0 and by_kind["attention"] == 0
    assert profile["span_ms_per_step"] >= profile["busy_ms_per_step"] > 0 and profile["matmul_tflops"] > 0
    ops = profile["largest_ops"]
    assert len(ops) == step_profile.LARGEST_OPS and all(r["runs_per_step"] == int(r["runs_per_step"]) >= 1 for r in ops)
    assert min(r["runs_per_step"] for r in ops) == 1  # layers unrolled on CPUs: most ops run once a step
    assert [r["ms_per_step"] for r in ops] == sorted((r["ms_per_step"] for r in ops), reverse=True)


def test_a_resumed_run_hides_the_earlier_attempts_tensorboard_events_past_its_checkpoint(two_runs, trainer, tmp_path):
    """As metrics.jsonl drops its records past the resumed step: TensorBoard showed both attempts' values at those
    steps (a QA report), now one value a step, the metrics file's."""
    run_dir = tmp_path / "run"
    shutil.copytree(two_runs[0], run_dir)
    shutil.rmtree(run_dir / "checkpoints" / str(STEPS))  # the last save lost: the run resumes from step STEPS - 2
    train_lib.train(trainer.cfg, run_dir, trainer)
    events = EventAccumulator(str(run_dir))
    events.Reload()
    steps = [r for r in _records(run_dir) if "loss" in r]
    assert [(e.step, e.value) for e in events.Scalars("train/loss")] == [(r["step"], pytest.approx(r["loss"], rel=1e-6)) for r in steps]
    assert len(list(run_dir.glob("events.out.tfevents.*"))) == 2


def test_profile_trace_written_and_summarized(two_runs):
    traces = list((two_runs[1] / "plugins" / "profile").glob("*/*.xplane.pb"))
    assert len(traces) == 1 and traces[0].stat().st_size > 0
    _check_cpu_profile(json.loads((traces[0].parent / step_profile.SUMMARY_FILE).read_text()), steps=2)


def test_a_profile_that_cannot_be_summarized_is_one_line_and_the_run_goes_on(trainer, tmp_path, monkeypatch, capsys):
    def no_device_events(*args):
        raise ValueError("the trace has no events of a gpu device")
    monkeypatch.setattr(step_profile, "summarize", no_device_events)
    profiled = _loop_config(trainer, log={"profile_steps": "2:2"})
    train_lib.train(profiled.cfg, tmp_path, profiled)
    assert "jaxtrain: no summary of the profile (ValueError: the trace has no events of a gpu device); the trace is " \
           "complete" in capsys.readouterr().err
    assert _records(tmp_path)[-1]["step"] == STEPS and list(tmp_path.glob("plugins/profile/*/*.xplane.pb"))
    assert not list(tmp_path.glob(f"plugins/profile/*/{step_profile.SUMMARY_FILE}"))


def test_a_resumed_run_profiles_the_rest_of_its_range_and_says_so(trainer, tmp_path, capsys):
    """log.profile_steps=3:5 on a run resumed after step 4 profiles step 5 (it profiled nothing, silently); a range
    that ends before the resume profiles nothing, with a note."""
    assert metrics_lib.resumed_profile("3:5", 2) == ((3, 5), None) and metrics_lib.resumed_profile(None, 4) == (None, None)
    assert metrics_lib.resumed_profile("3:5", 3) == ((4, 5), "jaxtrain: note: the run resumes at step 4, inside "
                                                             "log.profile_steps=3:5: steps 4-5 are profiled")
    assert metrics_lib.resumed_profile("1:4", 4) == (None, "jaxtrain: note: log.profile_steps=1:4 ends before the run resumes "
                                                           "at step 5: nothing is profiled; give steps after 4")
    short = _loop_config(trainer, train={"steps": 4})
    train_lib.train(short.cfg, tmp_path, short)
    profiled = _loop_config(trainer, log={"profile_steps": "3:5"})
    train_lib.train(profiled.cfg, tmp_path, profiled)
    err = capsys.readouterr().err
    assert "jaxtrain: note: the run resumes at step 5, inside log.profile_steps=3:5: steps 5-5 are profiled" in err
    assert "jaxtrain: profile of steps 5-5 in " in err and list(tmp_path.glob("plugins/profile/*/*.xplane.pb"))


def test_throughput_benchmark_profiles_more_steps(trainer, monkeypatch):
    """benchmarks/throughput.py --profile-steps (the GPU runner's mfu rows): steps after the timed ones, summarized."""
    monkeypatch.syspath_prepend(str(REPO / "benchmarks"))
    from bench_perf import fixed_batch
    from throughput import profile_steps

    _check_cpu_profile(profile_steps(trainer, trainer.init_state(), fixed_batch(trainer), 3), steps=3)


def test_plot_two_runs(two_runs, tmp_path, monkeypatch):
    out = tmp_path / "both.png"
    (tmp_path / "a_file").touch()  # matplotlib's config folder unusable, as a home on a cluster node can be: no warnings
    monkeypatch.setenv("MPLCONFIGDIR", str(tmp_path / "a_file" / "matplotlib"))
    result = run_cli("plot", *map(str, two_runs), "--out", str(out), cwd=tmp_path, timeout=120)
    assert result.returncode == 0 and result.stderr == f"jaxtrain: wrote {out}\n", result.stderr[-2000:]
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 20_000
    missing = run_cli("plot", str(tmp_path / "nothing"), cwd=tmp_path, timeout=120)
    assert missing.returncode == 2 and missing.stderr.count("\n") == 1 and "metrics.jsonl does not exist" in missing.stderr
    (tmp_path / "started").mkdir()
    (tmp_path / "started" / "metrics.jsonl").write_text("")  # a run before its first logged step: no empty image
    empty = run_cli("plot", str(tmp_path / "started"), cwd=tmp_path, timeout=120)
    assert empty.returncode == 2 and empty.stderr.count("\n") == 1 and "metrics.jsonl holds no records yet" in empty.stderr
    assert not (tmp_path / "started" / "metrics.png").exists()
    inside_a_file = run_cli("plot", *map(str, two_runs), "--out", str(out / "again.png"), cwd=tmp_path, timeout=120)
    assert inside_a_file.returncode == 2 and inside_a_file.stderr.count("\n") == 1, inside_a_file.stderr
    assert "both.png is a file, not a directory" in inside_a_file.stderr


def test_plot_draws_every_panel_its_runs_have_records_for(tmp_path, monkeypatch):
    """The figure itself (an image's size says little): each panel's lines, a key a run has no values of (a null MFU:
    no device peak known) left out, the mixture-of-experts panel beside the four others."""
    from jaxtrain.observe import plot as plot_lib

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    records = [{"step": 2, "loss": 3.0, "tokens_per_s": 100.0, "mfu": None, "memory_in_use_gib": 1.0, "memory_peak_gib": 1.5,
                "moe_aux_loss": 0.5, "moe_z_loss": 0.25, "moe_dropped_fraction": 0.125},
               {"step": 2, "eval_loss": 3.5, "eval_tokens": 64},
               {"step": 3, "skipped_spike": ["loss"], "loss": 9.0, "grad_norm": 1.0, "loss_deviations": 7.0,
                "grad_norm_deviations": 0.5},  # drawn by its step record's values alone, as in TensorBoard
               {"step": 4, "loss": 2.5, "tokens_per_s": 200.0, "mfu": None, "memory_in_use_gib": 1.0, "memory_peak_gib": 2.0,
                "moe_aux_loss": 0.75, "moe_z_loss": 0.5, "moe_dropped_fraction": 0.0}]
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    drawn = {}

    def keep(fig, out, **savefig_args):
        drawn.update({ax.get_title(): {line.get_label().removeprefix(f"{run_dir} "): (list(line.get_xdata()), list(line.get_ydata()))
                                       for line in ax.get_lines()} for ax in fig.axes})
        plot_lib.plt.close(fig)

    monkeypatch.setattr(plot_lib, "save_figure", keep)
    plot_lib.plot_runs([run_dir], tmp_path / "plot.png")
    assert drawn == {"loss": {"loss": ([2, 4], [3.0, 2.5]), "eval_loss": ([2], [3.5])},
                     "throughput": {"tokens_per_s": ([2, 4], [100.0, 200.0])}, "MFU": {},
                     "memory": {"memory_in_use_gib": ([2, 4], [1.0, 1.0]), "memory_peak_gib": ([2, 4], [1.5, 2.0])},
                     "mixture of experts": {"moe_aux_loss": ([2, 4], [0.5, 0.75]), "moe_z_loss": ([2, 4], [0.25, 0.5]),
                                            "moe_dropped_fraction": ([2, 4], [0.125, 0.0])}}


def test_flops_per_token_is_xlas_count_less_the_masked_half_of_the_scores():
    """One device, float32, remat none, the layers unrolled (cost analysis counts a scanned body once) and XLA's
    attention, which scores and differentiates the whole (length x length) square where the count takes the causal
    half: 6 L T H hd a token of the 12. What else XLA counts (norms, softmax, AdamW) is 1% here, attention's terms 11%:
    at 10% off one layer at sequence 32, the test had passed without them."""
    cfg = with_(small_config(mesh=(1, 1, 1), vocab_size=256, d_model=256, num_layers=2, num_heads=4, num_kv_heads=2,
                             mlp_dim=1024, attention="xla", scan_layers=False),
                data={"seq_len": 256})
    train_lowered = lower_train_step(make_layout(cfg, jax.devices()[:1]))
    xla_flops = train_lowered.compile().cost_analysis()["flops"]
    masked_half = 6 * 2 * 256 * 4 * 64
    assert (flops_per_token(cfg.model, 256) + masked_half) * 8 * 256 == pytest.approx(xla_flops, rel=0.02)


class _Terminal(io.StringIO):
    def isatty(self):
        return True


@pytest.mark.parametrize("stream", [io.StringIO(), _Terminal()], ids=["log", "terminal"])
def test_progress_is_one_line_on_a_terminal_and_log_lines_otherwise(stream):
    progress = Progress(total=20, initial=0, stream=stream)
    for step in (10, 20):
        epoch = {"epoch": 1.5} if step == 20 else {}  # a record of the run's batches says its epoch; one of a test's may not
        progress.update(step, {"loss": 2.5, "tokens_per_s": 1234.0, "mfu": 0.125} | epoch, eta_s=90.0 if step == 10 else 0.0)
    progress.evaluated(20, 2.25, 4096)
    progress.close()
    text = stream.getvalue()
    if stream.isatty():  # the evaluation a line of its own above the bar
        assert text.count("\n") == 2 and "\r" in text and "20/20" in text and "mfu=12.5%, epoch=1.50" in text
        assert "step 20/20 eval loss 2.25 over 4,096 tokens\n" in text
    else:
        assert text.splitlines() == ["step 10/20 loss 2.5 tok/s 1,234 mfu 12.5% eta 1m30s",
                                     "step 20/20 loss 2.5 tok/s 1,234 mfu 12.5% epoch 1.50 eta 0m00s",
                                     "step 20/20 eval loss 2.25 over 4,096 tokens"]
    assert metrics_lib._duration(5430.0) == "1h30m"  # the ETA of a long run


class _Poisoned:
    """The run's batches with out-of-range token ids (NaN embeddings) at the given steps; ``on_step`` {step: fn}
    runs fn as that step's batch is read (a SIGTERM to this process, a scrape)."""

    def __init__(self, batches, bad_steps, vocab_size, on_step):
        self.batches, self.bad, self.vocab, self.on_step = batches, bad_steps, vocab_size, on_step
        # what the run reads of its batches besides the batches: the data position, to save, restore and tell
        self.iterator, self.position, self.unit, self.global_shape = batches.iterator, batches.position, batches.unit, batches.global_shape

    def __next__(self):
        batch = next(self.batches)
        step = self.position() // self.global_shape[0]  # batches read, this one included: a resumed run counts on
        self.on_step.get(step, lambda: None)()
        return {**batch, "inputs": batch["inputs"] + self.vocab} if step in self.bad else batch


def _poison(monkeypatch, bad_steps, vocab_size, on_step=None):
    real = train_lib.data_lib.train_batches
    monkeypatch.setattr(train_lib.data_lib, "train_batches",
                        lambda *a, **k: _Poisoned(real(*a, **k), bad_steps, vocab_size, on_step or {}))


def _sigterm():
    os.kill(os.getpid(), signal.SIGTERM)  # the run's preemption watch owns SIGTERM while it trains


@pytest.mark.parametrize("written", ["metrics.jsonl", "events.out.tfevents"])
def test_a_disk_full_under_the_records_stops_the_run_in_one_line_and_it_resumes(written, trainer, tmp_path, monkeypatch):
    """A QA report: the disk filling up under metrics.jsonl or the TensorBoard events was a traceback, then tensorboardX's
    retries of its flush at close and at exit (98 lines, status 1). Now one line naming the file, the checkpoints kept,
    and the same command, with room again, resumes: each step's record once."""
    run_dir = tmp_path / "run"
    _poison(monkeypatch, set(), trainer.cfg.model.vocab_size, on_step={5: lambda: fill_disk(run_dir / written)})
    with pytest.raises(UserError) as stopped:
        train_lib.train(trainer.cfg, run_dir, trainer)
    where = run_dir / "metrics.jsonl" if written == "metrics.jsonl" else run_dir
    assert str(stopped.value).startswith(f"could not write {'a metrics record' if written == 'metrics.jsonl' else 'TensorBoard events'} "
                                         f"to {where}: the disk is full (No space left on device); the run stops, its committed "
                                         "checkpoints intact")
    assert sorted(int(p.name) for p in (run_dir / "checkpoints").iterdir()) == [2, 4]
    # no TensorBoard writer left open, whose flush tensorboardX's exit handler would try again: a traceback at exit
    from tensorboardX.event_file_writer import EventFileWriter  # here: the run imported tensorboardX without torch

    assert not [w for w in gc.get_objects() if isinstance(w, EventFileWriter) and w.get_logdir() == str(run_dir) and not w._closed]
    monkeypatch.undo()
    train_lib.train(trainer.cfg, run_dir, trainer)
    assert [r["step"] for r in _records(run_dir) if "loss" in r] == [2, 4, 6]


def test_nonfinite_stops_before_saving_and_last_checkpoint_restores(trainer, tmp_path, monkeypatch):
    run_dir = tmp_path / "run"
    _poison(monkeypatch, {5}, trainer.cfg.model.vocab_size)
    with pytest.raises(NonFiniteError) as stop:
        train_lib.train(trainer.cfg, run_dir, trainer)
    message = str(stop.value)
    assert "\n" not in message
    assert re.match(r"step 5: loss and grad_norm not finite \(loss nan, grad_norm nan, param_norm [0-9.]+\); ", message)
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
    # the step records count them, for the dashboards (TensorBoard train/skipped_nonfinite_steps, Prometheus)
    assert [(r["step"], r["skipped_nonfinite_steps"]) for r in _records(tmp_path / "run") if "loss" in r and
            not is_skip_record(r)] == [(2, 0), (4, 1), (6, 1)]

    # the step itself: a bad batch leaves parameters and optimizer state bit-identical, the counter advances
    batch = next(train_lib.data_lib.train_batches(trainer.corpus, cfg.data, cfg.train.global_batch, trainer.batch_sharding))
    before = jax.device_get(trainer.init_state())
    after, metrics = trainer.train_step(trainer.init_state(), {**batch, "inputs": batch["inputs"] + 64})
    assert not np.isfinite(float(metrics["loss"])) and int(after.step) == 1
    jax.tree.map(np.testing.assert_array_equal, jax.device_get((after.params, after.opt_state)),
                 (before.params, before.opt_state))

    # one more bad step than allowed stops the run; the advice is to allow more, not to set what is set
    _poison(monkeypatch, {3, 5}, trainer.cfg.model.vocab_size)
    with pytest.raises(NonFiniteError, match=r"^step 5: .*more than train.skip_nonfinite=1 updates skipped .*or raise "
                                             r"train.skip_nonfinite above 1 to skip such steps$"):
        train_lib.train(cfg, tmp_path / "twice", skipping)


def _checkpoint_steps(run_dir):
    return sorted(int(p.name) for p in (run_dir / "checkpoints").iterdir() if p.name.isdigit())


def test_checkpoints_only_at_configured_steps_and_the_last(trainer, tmp_path):
    every4 = _loop_config(trainer, checkpoint={"every": 4, "keep": 10})
    train_lib.train(every4.cfg, tmp_path / "run", every4)
    assert _checkpoint_steps(tmp_path / "run") == [4, STEPS]


def test_keep_and_keep_every_choose_the_checkpoints_left(trainer, tmp_path):
    """checkpoint.keep=2 keeps the latest two; checkpoint.keep_every=3 every step divisible by 3 besides, for good."""
    kept = _loop_config(trainer, checkpoint={"every": 1, "keep": 2, "keep_every": 3})
    train_lib.train(kept.cfg, tmp_path / "run", kept)
    assert _checkpoint_steps(tmp_path / "run") == [3, STEPS - 1, STEPS]


def test_steps_kept_for_good_survive_a_resume_under_another_keep_every(trainer, tmp_path):
    """A QA report: a resume without the checkpoint.keep_every override (or with another value) deleted, at its first
    save, every step the earlier attempt had kept for good; each checkpoint's own config keeps its promise."""
    first = _loop_config(trainer, train={"steps": 4}, checkpoint={"every": 1, "keep": 1, "keep_every": 2})
    train_lib.train(first.cfg, tmp_path / "run", first)
    assert _checkpoint_steps(tmp_path / "run") == [2, 4]
    resumed = _loop_config(trainer, checkpoint={"every": 1, "keep": 1, "keep_every": 0})
    train_lib.train(resumed.cfg, tmp_path / "run", resumed)
    assert _checkpoint_steps(tmp_path / "run") == [2, 4, STEPS]


def test_a_checkpoint_step_between_records_checks_the_metrics_before_its_save(trainer, tmp_path, monkeypatch):
    """log.every above checkpoint.every: each checkpoint step still fetches the steps' metrics before its save (README,
    Health guard), so a non-finite step stops the run before a checkpoint holds it and the latest one is the last
    good state (unchecked until the record, checkpoints of the steps after it are written and a re-run resumes past it)."""
    _poison(monkeypatch, {3}, trainer.cfg.model.vocab_size)
    sparse = _loop_config(trainer, log={"every": STEPS})  # a record at the last step only; a checkpoint every 2 steps
    with pytest.raises(NonFiniteError, match="^step 3: loss and grad_norm not finite"):
        train_lib.train(sparse.cfg, tmp_path / "run", sparse)
    assert _checkpoint_steps(tmp_path / "run") == [2]


def test_per_layer_and_skip_records_are_written_once_a_step_in_step_order(trainer, tmp_path, monkeypatch):
    """A QA report: a checkpoint step between records fetched the steps' metrics and dropped their per-layer norms; the
    skip records came before the earlier steps' per-layer records, which W&B drops (a step below the last one logged);
    a skip's loss and grad norm went to the dashboards beside its step record's (two values at a logged step); and a
    non-finite step's per-layer norms were written as NaN, which is not JSON, and warned about by tensorboardX."""
    _poison(monkeypatch, {3}, trainer.cfg.model.vocab_size)
    sparse = _loop_config(trainer, train={"skip_nonfinite": 1}, log={"every": 4, "layer_every": 1})  # checkpoints every 2
    run_dir = tmp_path / "run"
    train_lib.train(sparse.cfg, run_dir, sparse)
    text = (run_dir / "metrics.jsonl").read_text()
    records = [json.loads(line, parse_constant=lambda name: pytest.fail(f"{name} in metrics.jsonl")) for line in text.splitlines()]
    assert [(r["step"], next(k for k in ("grad_norm_per_layer", "skipped_nonfinite", "loss", "eval_loss") if k in r)) for r in records] == [
        (1, "grad_norm_per_layer"), (2, "grad_norm_per_layer"), (3, "grad_norm_per_layer"), (3, "skipped_nonfinite"),
        (4, "grad_norm_per_layer"), (4, "loss"), (5, "grad_norm_per_layer"), (6, "grad_norm_per_layer"), (6, "loss"),
        (6, "eval_loss")]
    assert records[2]["grad_norm_per_layer"] == [None] * trainer.cfg.model.num_layers
    events = EventAccumulator(str(run_dir))
    events.Reload()
    assert [e.step for e in events.Scalars("train/loss")] == [4, 6]
    assert [e.step for e in events.Scalars("grad_norm_per_layer/layer_000")] == [1, 2, 4, 5, 6]
    assert [e.step for e in events.Scalars("param_norm_per_layer/layer_000")] == [1, 2, 3, 4, 5, 6]


def test_a_sigterm_in_the_last_step_finishes_the_run(trainer, tmp_path, monkeypatch):
    """A preemption notice during the last step: the run ends finished (status 0, its final evaluation recorded), not
    preempted: a re-run finds a run at train.steps and does nothing, so the stop would lose that evaluation for good."""
    _poison(monkeypatch, set(), trainer.cfg.model.vocab_size, on_step={STEPS: _sigterm})
    state = train_lib.train(trainer.cfg, tmp_path / "run", trainer)
    assert int(state.step) == STEPS and _checkpoint_steps(tmp_path / "run")[-1] == STEPS
    assert [r["step"] for r in _records(tmp_path / "run") if "eval_loss" in r] == [STEPS]


def test_first_record_times_the_step_not_the_start_up(trainer, tmp_path, monkeypatch):
    real = metrics_lib.resolve_peak

    def slow_peak(*args):  # a start-up benchmark that takes 2 s
        time.sleep(2.0)
        return real(*args)

    monkeypatch.setattr(metrics_lib, "resolve_peak", slow_peak)
    every_step = _loop_config(trainer, log={"every": 1})
    train_lib.train(every_step.cfg, tmp_path / "run", every_step)
    times = [r["step_time_s"] for r in _records(tmp_path / "run") if "step_time_s" in r]
    assert len(times) == STEPS and times[0] < 1.0, times


def test_profiler_time_is_not_step_time(trainer, tmp_path, monkeypatch):
    """A QA report: writing and summarizing the trace (1.3 s for the tiny model on CPU, more for a large GPU trace) was
    counted in the last profiled step's time, so its record's tokens/s and MFU read 10x low."""
    real = step_profile.summarize

    def slow_summary(*args):
        time.sleep(2.0)
        return real(*args)

    monkeypatch.setattr(step_profile, "summarize", slow_summary)
    profiled = _loop_config(trainer, log={"every": 1, "profile_steps": "2:3"})
    train_lib.train(profiled.cfg, tmp_path, profiled)
    times = {r["step"]: r["step_time_s"] for r in _records(tmp_path) if "step_time_s" in r}
    assert len(times) == STEPS and times[3] < 1.0, times
    assert list(tmp_path.glob(f"plugins/profile/*/{step_profile.SUMMARY_FILE}"))  # summarized, slowly


def test_a_records_step_time_is_its_steps_mean_less_checkpoint_eval_and_profiler_time(trainer, tmp_path, monkeypatch):
    """On a clock the test moves: step_time_s is the wall time since the previous record (data waits in it; checkpoint,
    evaluation and profiler time out) over the steps since it; tokens/s and MFU follow from it; the timers start again
    at each record; the last step gets a record whatever log.every says. The fields, in the order the file has them."""
    now = [100.0]
    monkeypatch.setattr(metrics_lib, "time", type("Clock", (), {"perf_counter": staticmethod(lambda: now[0])}))
    five = _loop_config(trainer, train={"steps": 5}, log={"tensorboard": False})
    log = metrics_lib.MetricsLog(five.layout, tmp_path, 0, compile_s=1.0, compile_cache=None, data="test", enabled=True)
    timed = {1: {"data_wait_s": 0.5, "checkpoint_s": 1.0}, 2: {"eval_s": 2.0, "profile_s": 0.25}}
    try:
        for step in range(1, 6):
            for name, seconds in timed.get(step, {}).items():
                with log.timer(name):
                    now[0] += seconds
            now[0] += {1: 4.25, 2: 2.0, 3: 1.5, 4: 1.5, 5: 2.5}[step]  # the step's own time
            log.after_step(step, {"loss": np.float32(2.5 + step), "learning_rate": np.float32(1e-3), "grad_norm": np.float32(1.0),
                                  "param_norm": np.float32(4.0)})
    finally:
        log.close()
    records = _records(tmp_path)
    assert list(records[0]) == ["step", "loss", "learning_rate", "grad_norm", "param_norm", "step_time_s", "tokens_per_s",
                                "tokens_per_s_per_device", "mfu", "data_wait_s", "checkpoint_s", "memory_in_use_gib",
                                "memory_peak_gib", "memory_source", "memory_process"]
    # steps 1-2: 0.5 + 4.25 + 2.0 s of data wait and steps (the 3.25 s of checkpoint, eval and profiler out) over 2 steps
    assert [(r["step"], r["loss"], r["step_time_s"], r["data_wait_s"], r["checkpoint_s"]) for r in records] == \
        [(2, 4.5, 3.375, 0.5, 1.0), (4, 6.5, 1.5, 0.0, 0.0), (5, 7.5, 2.5, 0.0, 0.0)]
    for r in records:
        assert r["tokens_per_s"] == 128 / r["step_time_s"] and r["tokens_per_s_per_device"] == r["tokens_per_s"] / 8
        assert r["mfu"] == pytest.approx(129024 * r["tokens_per_s"] / (8 * PEAK_TFLOPS * 1e12), rel=1e-12)


def test_memory_is_the_fullest_devices_or_the_hosts_peak_resident_memory(monkeypatch):
    """Where the devices report memory, the fullest one's in use and peak; on a CPU, this process's resident memory now and
    at its peak (getrusage's ru_maxrss counts KiB on Linux)."""
    class Device:
        def __init__(self, stats):
            self.stats = stats

        def memory_stats(self):
            return self.stats

    gib = metrics_lib.GIB
    monkeypatch.setattr(metrics_lib.jax, "local_devices", lambda: [Device({"bytes_in_use": 2 * gib, "peak_bytes_in_use": 5 * gib}),
                                                                  Device({"bytes_in_use": 3 * gib, "peak_bytes_in_use": 4 * gib})])
    assert metrics_lib.memory_gib() == (3.0, 5.0, "device")
    monkeypatch.setattr(metrics_lib.jax, "local_devices", lambda: [Device(None)])
    monkeypatch.setattr(metrics_lib.psutil, "Process", lambda: type("P", (), {"memory_info": lambda self: type("M", (), {"rss": gib})()})())
    monkeypatch.setattr(metrics_lib.resource, "getrusage", lambda who: type("U", (), {"ru_maxrss": 3 * 2**20})())
    assert metrics_lib.memory_gib() == (1.0, 3.0, "host_rss")


def test_tensorboard_tags_of_the_float16_and_spike_records(trainer, tmp_path):
    """The tags README's dashboards name for the loss scaler's and the spike guard's counters (no other test's run has
    TensorBoard and either); a skipped update's own record is metrics.jsonl's alone (its loss was a second value at a
    logged step, a QA report)."""
    log = metrics_lib.MetricsLog(trainer.layout, tmp_path, 0, compile_s=1.0, compile_cache=None, data="test", enabled=True)
    try:
        log.write({"step": 2, "skipped_spike": ["loss"], "loss": 9.0, "grad_norm": 1.0, "loss_deviations": 7.0,
                   "grad_norm_deviations": 0.5})
        log.write({"step": 2, "loss_scale": 32768.0, "overflow_steps": 1, "skipped_spikes": 3, "skipped_nonfinite_steps": 2})
    finally:
        log.close()
    events = EventAccumulator(str(tmp_path))
    events.Reload()
    assert {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]} == \
        {"train/loss_scale": [(2, 32768.0)], "train/overflow_steps": [(2, 1.0)], "train/skipped_spikes": [(2, 3.0)],
         "train/skipped_nonfinite_steps": [(2, 2.0)]}


def test_the_steps_an_evaluation_waits_for_are_step_time_not_evaluation_time(trainer, tmp_path, monkeypatch):
    """An evaluation between records waited, inside its timer, for the train steps still running on the devices: their
    time left step_time_s (tokens/s and MFU read high). Each step here takes at least 1 s on the devices (a host
    callback), while the host runs ahead; the one record, at step 6, counts all six seconds, not the evaluation's own
    time, and a slow batch's wait as data_wait_s; each evaluation record carries the evaluation's own time."""
    def nap():
        time.sleep(1.0)
        return np.float32(0)

    @jax.jit
    def slowed(tree):  # one nap a step, before any of the step's results is ready
        waited = io_callback(nap, jax.ShapeDtypeStruct((), np.float32))
        return jax.tree.map(lambda x: x + waited.astype(x.dtype), tree)

    def slow_step(state, batch):
        state, metrics = trainer.train_step(state, batch)
        params, metrics = slowed((state.params, metrics))
        return state.replace(params=params), metrics

    real_evaluate = train_lib.evaluate

    def slow_evaluate(*args):
        time.sleep(4.0)
        return real_evaluate(*args)

    monkeypatch.setattr(train_lib, "evaluate", slow_evaluate)
    _poison(monkeypatch, set(), trainer.cfg.model.vocab_size, on_step={2: lambda: time.sleep(0.5)})  # a slow batch
    unaligned = _loop_config(trainer, log={"every": STEPS}, train={"eval_every": 3}, checkpoint={"every": STEPS})
    train_lib.train(unaligned.cfg, tmp_path, dataclasses.replace(unaligned, train_step=slow_step))
    [record] = [r for r in _records(tmp_path) if "loss" in r]
    assert [r["step"] for r in _records(tmp_path) if "eval_loss" in r] == [3, STEPS] and record["data_wait_s"] >= 0.5
    # the six seconds of steps in (the batch's wait overlaps them), step 3's 4 s evaluation out (the host's own work: well
    # under 0.4 s a step)
    assert 1.0 <= record["step_time_s"] < 1.5
    # each evaluation records its own time: the 4 s, not the steps it waited for (step 3's waited about 1 s for naps)
    evaluation_s = [r["eval_s"] for r in _records(tmp_path) if "eval_loss" in r]
    assert all(4.0 <= s < 4.6 for s in evaluation_s), evaluation_s


def test_the_measured_matmul_peak_counts_two_flops_per_multiply_add(monkeypatch):
    """The CPU's MFU denominator: each device's size^3 multiply-adds per timed call, over the median call's seconds (a
    clock that moves 1 s per reading here)."""
    from jaxtrain.observe import flops as flops_lib

    readings = iter(range(100))
    monkeypatch.setattr(flops_lib, "time", type("Clock", (), {"perf_counter": staticmethod(lambda: float(next(readings)))}))
    assert flops_lib.measure_matmul_peak(jax.devices()[:2], size=8, repeats=3) == 2 * 2 * 8**3


def test_prometheus_serves_an_unknown_mfu_as_nan_not_zero():
    """No peak known for the device (log.peak_tflops unset on an unlisted GPU): the record's mfu is null, and a 0 would
    read as a stalled run."""
    port, scraped = _free_port(), {}
    gauges = exporters.PrometheusGauges(port)
    try:
        gauges.record({"step": 7, "loss": 2.5, "tokens_per_s": 1000.0, "mfu": None, "memory_in_use_gib": 1.5, "memory_peak_gib": 2.0})
        _scrape(port, scraped)
    finally:
        gauges.close()
    assert {name: value for name, value in scraped.items() if not math.isnan(value)} == {
        "jaxtrain_step": 7, "jaxtrain_loss": 2.5, "jaxtrain_tokens_per_second": 1000.0, "jaxtrain_memory_in_use_gib": 1.5,
        "jaxtrain_memory_peak_gib": 2.0, "jaxtrain_skipped_updates": 0}
    assert math.isnan(scraped["jaxtrain_mfu"]) and math.isnan(scraped["jaxtrain_last_checkpoint_step"])


def test_prometheus_counts_every_kind_of_skipped_update():
    """One gauge to alert on for updates not applied, whichever guard skipped them (each count is in the step records
    only where its guard is on)."""
    port, scraped = _free_port(), {}
    gauges = exporters.PrometheusGauges(port)
    try:
        _scrape(port, scraped)
        assert math.isnan(scraped["jaxtrain_skipped_updates"])  # unknown before the first record, not 0
        gauges.record({"step": 9, "loss": 2.5, "skipped_nonfinite_steps": 1, "overflow_steps": 2, "skipped_spikes": 4})
        _scrape(port, scraped)
    finally:
        gauges.close()
    assert scraped["jaxtrain_skipped_updates"] == 7


def test_a_run_shorter_than_its_warmup_applies_the_full_learning_rate_at_its_last_step():
    """Step k applies the schedule at update count k - 1 (optax counts from 0): a warmup of 20 over a 4-step run
    gives 0, lr/3, 2lr/3, lr (a QA report: it stopped at 3lr/4); a 1-step run applies lr; a warmup shorter than
    the run is optax's as configured, lr reached at count warmup_steps, then the cosine."""
    cfg = Config(optim=OptimConfig(lr=3e-3, warmup_steps=20))
    rates = lambda steps, warmup=20: [float(learning_rate_schedule(with_(cfg, train={"steps": steps}, optim={"warmup_steps": warmup}))(k))  # noqa: E731
                                      for k in range(steps)]
    np.testing.assert_allclose(rates(4), [0.0, 1e-3, 2e-3, 3e-3], rtol=1e-6)
    np.testing.assert_allclose(rates(1), [3e-3], rtol=1e-6)
    short = rates(12, warmup=4)
    np.testing.assert_allclose(short[:5], [0.0, 0.75e-3, 1.5e-3, 2.25e-3, 3e-3], rtol=1e-6)
    assert short[5] < 3e-3 and short[-1] < short[5]  # then decays


def test_logged_learning_rate_is_the_applied_one_after_a_skip(trainer, tmp_path, monkeypatch):
    _poison(monkeypatch, {3}, trainer.cfg.model.vocab_size)
    skipping = _loop_config(trainer, train={"skip_nonfinite": 1})
    state = train_lib.train(skipping.cfg, tmp_path / "run", skipping)
    schedule = learning_rate_schedule(skipping.cfg)
    logged = {r["step"]: r["learning_rate"] for r in _records(tmp_path / "run") if "learning_rate" in r}
    # step s applies the optimizer's update number (s - 1 - updates skipped before it): step 3 was skipped
    assert logged == {2: pytest.approx(float(schedule(1))), 4: pytest.approx(float(schedule(2))), 6: pytest.approx(float(schedule(4)))}
    assert float(schedule(2)) != float(schedule(3))  # the schedule moves every step, so a wrong count shows
    assert int(schedule_count(state.opt_state)) == STEPS - 1 and int(state.step) == STEPS


def test_preemption_on_a_nonfinite_step_stops_without_saving_it(trainer, tmp_path, monkeypatch):
    _poison(monkeypatch, {3}, trainer.cfg.model.vocab_size, on_step={3: _sigterm})
    with pytest.raises(NonFiniteError, match="^step 3: loss and grad_norm not finite"):
        train_lib.train(trainer.cfg, tmp_path / "run", trainer)
    assert _checkpoint_steps(tmp_path / "run") == [2]  # the last good state; no checkpoint of step 3
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # the watch let go of SIGTERM


def test_preemption_flushes_pending_records_and_logs_the_skip(trainer, tmp_path, monkeypatch):
    _poison(monkeypatch, {3}, trainer.cfg.model.vocab_size, on_step={3: _sigterm})
    sparse = _loop_config(trainer, train={"skip_nonfinite": 1}, log={"every": 4}, checkpoint={"every": 4})
    with pytest.raises(Preempted):
        train_lib.train(sparse.cfg, tmp_path / "run", sparse)
    assert _checkpoint_steps(tmp_path / "run") == [3]
    monkeypatch.undo()
    train_lib.train(sparse.cfg, tmp_path / "run", sparse)  # resumes after step 3
    records = _records(tmp_path / "run")
    assert [r["step"] for r in records if "step_time_s" in r] == [3, 4, 6]  # steps 1-3 recorded before the save
    assert [r["step"] for r in records if "skipped_nonfinite" in r] == [3]


def test_preemption_at_an_evaluation_step_evaluates_it_on_resume_once(trainer, tmp_path, monkeypatch):
    """Stopped at step 4 (evaluated every 2 steps): its checkpoint is committed before its evaluation, which the
    resumed run does first (a QA report: lost for good). Every record is then the uninterrupted run's; a resume
    from step 4 whose evaluation was recorded adds none."""
    evaluating = _loop_config(trainer, train={"eval_every": 2})
    train_lib.train(evaluating.cfg, tmp_path / "whole", evaluating)
    _poison(monkeypatch, set(), trainer.cfg.model.vocab_size, on_step={4: _sigterm})
    with pytest.raises(Preempted):
        train_lib.train(evaluating.cfg, tmp_path / "run", evaluating)
    assert _checkpoint_steps(tmp_path / "run")[-1] == 4
    assert not [r for r in _records(tmp_path / "run") if r["step"] == 4 and "eval_loss" in r]
    monkeypatch.undo()
    train_lib.train(evaluating.cfg, tmp_path / "run", evaluating)
    evals = lambda run: [(r["step"], r["eval_loss"]) for r in _records(tmp_path / run) if "eval_loss" in r]  # noqa: E731
    assert evals("run") == evals("whole") and [step for step, _ in evals("run")] == [2, 4, 6]

    shutil.copytree(tmp_path / "whole", tmp_path / "again")  # step 4 evaluated and recorded before the stop
    shutil.rmtree(tmp_path / "again" / "checkpoints" / "6")
    train_lib.train(evaluating.cfg, tmp_path / "again", evaluating)
    assert evals("again") == evals("whole")


@pytest.fixture
def ctrl_c():
    """A Ctrl-C to this process (SIGINT with Python's handler, even where the test runner ignores SIGINT)."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield lambda: os.kill(os.getpid(), signal.SIGINT)  # the run's watch owns SIGINT while it trains
    signal.signal(signal.SIGINT, previous)


def test_ctrl_c_saves_the_step_and_a_second_one_stops_at_once(trainer, tmp_path, monkeypatch, ctrl_c):
    """The first Ctrl-C: the step finishes, its checkpoint is committed, Preempted with status 130; a second one
    (here as the save starts) stops at once without it; SIGINT is Python's again after each; the same command then
    resumes to the uninterrupted run's state."""
    from jaxtrain import checkpoint as checkpoint_lib

    run_dir = tmp_path / "run"
    _poison(monkeypatch, set(), trainer.cfg.model.vocab_size, on_step={3: ctrl_c})
    try:
        with pytest.raises(Preempted) as stop:
            train_lib.train(trainer.cfg, run_dir, trainer)
    except KeyboardInterrupt:
        pytest.fail("the Ctrl-C left the run as a KeyboardInterrupt, without a checkpoint")
    assert stop.value.status == 130
    assert str(stop.value) == "interrupted: checkpoint of step 3 committed; run the same command again to resume"
    assert _checkpoint_steps(run_dir) == [2, 3]
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler and signal.getsignal(signal.SIGTERM) is signal.SIG_DFL

    monkeypatch.undo()
    _poison(monkeypatch, set(), trainer.cfg.model.vocab_size, on_step={5: ctrl_c})
    save = checkpoint_lib.RunCheckpoints.save

    def second_ctrl_c_as_step_5_saves(self, step, *args, **kwargs):
        if step == 5:
            ctrl_c()
        return save(self, step, *args, **kwargs)

    monkeypatch.setattr(checkpoint_lib.RunCheckpoints, "save", second_ctrl_c_as_step_5_saves)
    with pytest.raises(checkpoint_lib.Interrupted, match=r"^interrupted again; run the same command again to resume from step 4$"):
        train_lib.train(trainer.cfg, run_dir, trainer)
    assert _checkpoint_steps(run_dir) == [2, 3, 4]
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler and signal.getsignal(signal.SIGTERM) is signal.SIG_DFL

    monkeypatch.undo()
    resumed = train_lib.train(trainer.cfg, run_dir, trainer)
    uninterrupted = train_lib.train(trainer.cfg, tmp_path / "uninterrupted", trainer)
    last = [[r for r in _records(d) if r["step"] == STEPS and "loss" in r] for d in (run_dir, tmp_path / "uninterrupted")]
    assert last[0][0]["loss"] == last[1][0]["loss"]  # not every record: the stop flushed one at step 3 (log.every=2)
    jax.tree.map(np.testing.assert_array_equal, jax.device_get((resumed.params, resumed.opt_state)),
                 jax.device_get((uninterrupted.params, uninterrupted.opt_state)))


def test_a_second_ctrl_c_names_the_save_it_left(trainer, tmp_path):
    """Stopped while a save was written: the line names that step (its temporary directory, never resumed from) and
    the newest committed one."""
    from jaxtrain import checkpoint as checkpoint_lib

    checkpoints = checkpoint_lib.RunCheckpoints(tmp_path / "run", trainer.cfg.checkpoint, STEPS)
    try:
        for name in ("2.orbax-checkpoint-tmp-17", "4", "6.orbax-checkpoint-tmp"):
            (checkpoints.directory / name).mkdir()
        checkpoints.preemption.interrupted = True
        assert str(checkpoints.interrupted_error()) == (
            "interrupted again: stopped without waiting for the save of step 6, which may be incomplete (a resume never "
            "picks an incomplete checkpoint); run the same command again to resume from step 4")
    finally:
        checkpoints.close()


def test_infinite_grad_norm_with_finite_loss_is_not_applied_and_stops(trainer, tmp_path):
    batch = next(train_lib.data_lib.train_batches(trainer.corpus, trainer.cfg.data, trainer.cfg.train.global_batch, trainer.batch_sharding))
    state = trainer.init_state()
    # a tiny final-norm scale against a huge output projection: logits stay small (finite loss) while the
    # final-norm gradients, about 1e24, square past float32's range in the global norm
    params = {**state.params, "final_norm": {"scale": state.params["final_norm"]["scale"] * 1e-25},
              "lm_head": state.params["lm_head"] * 1e24}
    before = jax.device_get((params, state.opt_state))
    after, metrics = trainer.train_step(state.replace(params=params), batch)
    assert np.isfinite(float(metrics["loss"])) and np.isinf(float(metrics["grad_norm"]))
    jax.tree.map(np.testing.assert_array_equal, jax.device_get((after.params, after.opt_state)), before)
    log = metrics_lib.MetricsLog(trainer.layout, tmp_path, 1, compile_s=0.0, compile_cache=None, data="", enabled=False)
    with pytest.raises(NonFiniteError, match=r"^step 2: grad_norm not finite \(loss 4\.\d+, grad_norm inf, param_norm inf\)"):
        log.after_step(2, metrics)


def test_errors_before_the_loop_release_the_checkpoints_and_sigterm(trainer, tmp_path, monkeypatch):
    run_dir = tmp_path / "run"
    train_lib.train(trainer.cfg, run_dir, trainer)
    mismatch = UserError("checkpoint does not match the model")
    monkeypatch.setattr(train_lib.checkpoint_lib, "check_same_shapes", lambda *a: (_ for _ in ()).throw(mismatch))
    more = _loop_config(trainer, train={"steps": STEPS + 2})
    with pytest.raises(UserError, match="does not match the model"):
        train_lib.train(more.cfg, run_dir, more)
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
    monkeypatch.undo()
    with pytest.raises(ModuleNotFoundError):  # log.wandb without the package (config.check is what catches it first)
        train_lib.train(more.cfg, run_dir, _loop_config(more, log={"wandb": "project"}))
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL


def test_a_failing_close_does_not_hide_the_stop(trainer, tmp_path, monkeypatch, capsys):
    _poison(monkeypatch, {5}, trainer.cfg.model.vocab_size)
    write_error = UserError("could not write checkpoint step 4")
    monkeypatch.setattr(train_lib.checkpoint_lib.RunCheckpoints, "finish", lambda self: (_ for _ in ()).throw(write_error))
    with pytest.raises(NonFiniteError, match="^step 5: "):
        train_lib.train(trainer.cfg, tmp_path / "run", trainer)
    assert "jaxtrain: warning: could not write checkpoint step 4" in capsys.readouterr().err


def test_mlflow_gets_the_config_the_tensorboard_scalars_and_the_artifacts(trainer, tmp_path, monkeypatch):
    import mlflow

    monkeypatch.setenv("MLFLOW_TRACKING_URI", (tmp_path / "mlruns").as_uri())  # a local file store
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3 asks for this opt-in to use one
    monkeypatch.setattr(exporters, "MLFLOW_PARAMS_PER_BATCH", 7)  # the config's params in several batches
    run_dir = tmp_path / "run"
    tracked = _loop_config(trainer, log={"mlflow": "jaxtrain-test"})
    train_lib.train(tracked.cfg, run_dir, tracked)
    longer = _loop_config(tracked, train={"steps": STEPS + 2})
    train_lib.train(longer.cfg, run_dir, longer)  # a resumed run continues the same MLflow run

    client = mlflow.MlflowClient()
    [run] = client.search_runs([client.get_experiment_by_name("jaxtrain-test").experiment_id])
    assert run.info.run_id == (run_dir / "mlflow_run_id").read_text().strip() and run.info.status == "FINISHED"
    assert run.info.run_name == "run" and run.data.params["optim.lr"] == str(trainer.cfg.optim.lr)
    assert run.data.params["train.steps"] == str(STEPS) and run.data.params["rules"] == "fsdp_tp"
    assert run.data.params.keys() == config_lib.flatten(config_lib.to_dict(tracked.cfg)).keys()  # every batch of them
    events = EventAccumulator(str(run_dir))
    events.Reload()
    tags = events.Tags()["scalars"]
    assert set(run.data.metrics) == set(tags) and "perf/mfu" in tags and "eval/loss" in tags
    for tag in tags:
        history = sorted((m.step, m.value) for m in client.get_metric_history(run.info.run_id, tag))
        assert history == [(e.step, pytest.approx(e.value, rel=1e-6)) for e in events.Scalars(tag)], tag
    assert [m.step for m in client.get_metric_history(run.info.run_id, "train/loss")] == [2, 4, 6, 8]
    assert {a.path for a in client.list_artifacts(run.info.run_id)} == {"config.yaml", "metrics.png"}
    artifact = mlflow.artifacts.download_artifacts(run_id=run.info.run_id, artifact_path="config.yaml", dst_path=str(tmp_path / "a"))
    assert open(artifact).read() == (run_dir / "config.yaml").read_text()


# wandb is not a dependency: a stand-in package that records what the trainer asks of it
FAKE_WANDB = """import json, os, types
util = types.SimpleNamespace(generate_id=lambda: "id" + str(len(os.listdir(os.environ["FAKE_WANDB_LOG"]))))
def init(**kwargs):
    calls = os.path.join(os.environ["FAKE_WANDB_LOG"], f"init{len(os.listdir(os.environ['FAKE_WANDB_LOG']))}.json")
    with open(calls, "w") as f:
        json.dump({k: v for k, v in kwargs.items() if k != "config"}, f)
    logged = open(calls + ".steps", "w")
    return types.SimpleNamespace(log=lambda scalars, step: logged.write(f"{step}\\n"), finish=logged.close)
"""


def test_a_resumed_run_continues_its_wandb_run(trainer, tmp_path, monkeypatch):
    """A QA report: every resume started a new W&B run (wandb.init without an id). The first start keeps the id it was
    given in RUN_DIR/wandb_run_id; every later start asks W&B to resume that run."""
    package = tmp_path / "site" / "wandb"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text(FAKE_WANDB)
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    monkeypatch.setenv("FAKE_WANDB_LOG", str(tmp_path / "log"))
    (tmp_path / "log").mkdir()
    run_dir = tmp_path / "run"
    tracked = _loop_config(trainer, log={"wandb": "jaxtrain-test"})
    train_lib.train(tracked.cfg, run_dir, tracked)
    longer = _loop_config(tracked, train={"steps": STEPS + 2})
    train_lib.train(longer.cfg, run_dir, longer)
    first, second = (json.loads((tmp_path / "log" / f"init{i}.json").read_text()) for i in (0, 2))
    assert first["id"] == second["id"] == (run_dir / "wandb_run_id").read_text().strip() == "id0"
    assert first["resume"] == second["resume"] == "allow" and first["project"] == "jaxtrain-test" and first["name"] == "run"
    steps = [[int(step) for step in (tmp_path / "log" / f"init{i}.json.steps").read_text().split()] for i in (0, 2)]
    assert max(steps[0]) == STEPS < min(steps[1]) and max(steps[1]) == STEPS + 2  # each start's own steps
    # in step order, as W&B drops a step below the last one logged (step 3's per-layer norms came after step 4's record)
    assert steps[0] == sorted(steps[0]) and 3 in steps[0] and steps[1] == sorted(steps[1])


def test_an_mlflow_server_that_stops_answering_costs_warnings_never_the_run(trainer, tmp_path, monkeypatch, capsys):
    """The server fails every metric from step 4 on, then hangs at the run's end: training finishes, checkpoints and
    metrics.jsonl complete, one warning per kind of failure, the end waits MLFLOW_CLOSE_TIMEOUT_S at most (a QA
    report: the step loop froze for minutes on MLflow's retries, then crashed with no checkpoint)."""
    import mlflow

    monkeypatch.setenv("MLFLOW_TRACKING_URI", (tmp_path / "mlruns").as_uri())
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    monkeypatch.setattr(exporters, "MLFLOW_CLOSE_TIMEOUT_S", 1)
    hung, real_batch = threading.Event(), mlflow.MlflowClient.log_batch

    def failing_batch(self, run_id, metrics=(), **kwargs):
        if metrics and metrics[0].step >= 4:
            raise mlflow.exceptions.MlflowException("API request failed: Connection refused")
        return real_batch(self, run_id, metrics=metrics, **kwargs)

    monkeypatch.setattr(mlflow.MlflowClient, "log_batch", failing_batch)
    monkeypatch.setattr(mlflow.MlflowClient, "set_terminated", lambda *a, **k: hung.wait(60))
    tracked = _loop_config(trainer, log={"mlflow": "jaxtrain-test"})
    start = time.perf_counter()
    state = train_lib.train(tracked.cfg, tmp_path / "run", tracked)
    hung.set()
    assert int(state.step) == STEPS and [r["step"] for r in _records(tmp_path / "run") if "loss" in r] == [2, 4, 6]
    assert _checkpoint_steps(tmp_path / "run")[-1] == STEPS and time.perf_counter() - start < 30
    warnings = [line for line in capsys.readouterr().err.splitlines() if "MLflow" in line]
    assert warnings[0].startswith(f"jaxtrain: warning: MLflow at {(tmp_path / 'mlruns').as_uri()} did not take step 4's metrics "
                                  "(MlflowException: API request failed: Connection refused); training goes on")
    assert warnings[1].startswith("jaxtrain: warning: MLflow at ") and "did not answer within 1 s at the end" in warnings[1]
    assert len(warnings) == 2
    client = mlflow.MlflowClient()
    [run] = client.search_runs([client.get_experiment_by_name("jaxtrain-test").experiment_id])
    assert [m.step for m in client.get_metric_history(run.info.run_id, "train/loss")] == [2]


def test_an_unreachable_mlflow_server_is_reported_in_seconds(tmp_path, monkeypatch):
    """Nothing listens on the discard port: one try, not MLflow's default seven with back-off (255 s in a QA
    report); the user's own settings are left as they were."""
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://127.0.0.1:9")
    for key in ("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "MLFLOW_HTTP_REQUEST_TIMEOUT"):
        monkeypatch.delenv(key, raising=False)
    start = time.perf_counter()
    with pytest.raises(UserError, match="^log.mlflow=exp: cannot use the MLflow tracking URI http://127.0.0.1:9 "):
        exporters.check_mlflow("exp", tmp_path)
    assert time.perf_counter() - start < 30 and "MLFLOW_HTTP_REQUEST_MAX_RETRIES" not in os.environ


def test_an_unusable_mlflow_store_is_one_line_before_the_compile_and_the_run_dir(trainer, tmp_path, monkeypatch):
    import mlflow

    monkeypatch.chdir(tmp_path)  # where MLflow's default store (a sqlite file mlflow-skinny cannot open) would be
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE", raising=False)
    monkeypatch.setattr(train_lib, "check", lambda *a, **k: pytest.fail("built the run before the MLflow store was checked"))
    cfg, run_dir = with_(trainer.cfg, log={"mlflow": "jaxtrain-test"}), tmp_path / "run"
    fix = ("set MLFLOW_TRACKING_URI to an MLflow server (http://HOST:PORT), or for a local store to file:///PATH/mlruns "
           "with MLFLOW_ALLOW_FILE_STORE=true (MLflow 3's opt-in)")
    with pytest.raises(UserError) as default:
        train_lib.train(cfg, run_dir)
    assert str(default.value).startswith(f"log.mlflow=jaxtrain-test: cannot use the MLflow tracking URI sqlite:///{tmp_path}/mlflow.db, "
                                         "MLflow's default without MLFLOW_TRACKING_URI (UnsupportedModelRegistryStoreURIException: ")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", (tmp_path / "mlruns").as_uri())  # a file store without MLflow 3's opt-in
    with pytest.raises(UserError) as file_store:
        train_lib.train(cfg, run_dir)
    assert str(file_store.value).startswith(f"log.mlflow=jaxtrain-test: cannot use the MLflow tracking URI {(tmp_path / 'mlruns').as_uri()} (MlflowException: ")
    for error in (default, file_store):
        assert str(error.value).endswith(fix) and "\n" not in str(error.value)
    assert list(tmp_path.iterdir()) == []  # no run directory, no store

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    client = mlflow.MlflowClient()
    client.delete_experiment(client.create_experiment("deleted"))
    with pytest.raises(UserError, match=f"^log.mlflow=deleted: that experiment is deleted in the MLflow tracking store "
                                        f"{(tmp_path / 'mlruns').as_uri()}; restore it there or choose another name$"):
        train_lib.train(with_(cfg, log={"mlflow": "deleted"}), run_dir)
    assert not run_dir.exists()

    started_elsewhere = tmp_path / "resumed"  # a run whose MLflow run lives in another store
    started_elsewhere.mkdir()
    (started_elsewhere / "mlflow_run_id").write_text("0123456789abcdef\n")
    with pytest.raises(UserError, match=f"^{started_elsewhere}/mlflow_run_id names MLflow run 0123456789abcdef, which the "
                                        f"tracking store {(tmp_path / 'mlruns').as_uri()} does not have; point MLFLOW_TRACKING_URI"):
        train_lib.train(cfg, started_elsewhere)
    assert [p.name for p in started_elsewhere.iterdir()] == ["mlflow_run_id"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _scrape(port: int, into: dict) -> None:
    """The gauges process 0 serves, by sample name, into ``into``."""
    from prometheus_client.parser import text_string_to_metric_families

    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    into.update({s.name: s.value for family in text_string_to_metric_families(text) for s in family.samples})


def test_prometheus_serves_the_latest_record_during_the_run(trainer, tmp_path, monkeypatch):
    port, scraped, first = _free_port(), {}, {}
    # as step 5's batch is read: step 4 is recorded and checkpointed; step 1's: nothing yet
    _poison(monkeypatch, set(), trainer.cfg.model.vocab_size,
            on_step={1: lambda: _scrape(port, first), 5: lambda: _scrape(port, scraped)})
    served = _loop_config(trainer, log={"prometheus_port": port})
    train_lib.train(served.cfg, tmp_path / "run", served)
    record = next(r for r in _records(tmp_path / "run") if r["step"] == 4 and "loss" in r)
    assert scraped["jaxtrain_step"] == 4 and scraped["jaxtrain_loss"] == pytest.approx(record["loss"])
    assert scraped["jaxtrain_epoch"] == pytest.approx(record["epoch"]) and record["epoch"] > 0
    assert scraped["jaxtrain_tokens_per_second"] == pytest.approx(record["tokens_per_s"])
    assert scraped["jaxtrain_mfu"] == pytest.approx(record["mfu"]) and scraped["jaxtrain_memory_in_use_gib"] == pytest.approx(record["memory_in_use_gib"])
    assert scraped["jaxtrain_last_checkpoint_step"] == 4 and 0 <= scraped["jaxtrain_last_checkpoint_age_seconds"] < 60
    check_port_free(port)  # the run let go of its port
    # before the first record every gauge is unknown, not 0 (a loss or step of 0 would read as one)
    assert all(math.isnan(first[f"jaxtrain_{name}"])
               for name in ("step", "loss", "epoch", "tokens_per_second", "mfu", "last_checkpoint_step"))


def test_prometheus_knows_the_checkpoint_a_resumed_run_started_from(trainer, tmp_path, monkeypatch):
    """A QA report: a resumed run served NaN as its last checkpoint's step and age until its next save, so an alert on
    the checkpoint's age saw nothing on a run that stalled after a resume. The age counts from when it was written."""
    short = _loop_config(trainer, train={"steps": 4})
    train_lib.train(short.cfg, tmp_path / "run", short)
    written = time.time()
    port, scraped = _free_port(), {}
    time.sleep(1.0)
    # as the resumed run reads step 5's batch: no record or save of its own yet
    _poison(monkeypatch, set(), trainer.cfg.model.vocab_size, on_step={5: lambda: _scrape(port, scraped)})
    served = _loop_config(trainer, log={"prometheus_port": port})
    train_lib.train(served.cfg, tmp_path / "run", served)
    assert math.isnan(scraped["jaxtrain_step"]) and scraped["jaxtrain_last_checkpoint_step"] == 4
    assert 1.0 <= scraped["jaxtrain_last_checkpoint_age_seconds"] < time.time() - written + 5.0


def _hold_commits(monkeypatch, held: dict[int, threading.Event], failing: int | None = None) -> None:
    """Orbax's commit of a step's asynchronous save (the rename of its temporary directory, in its save thread) waits for
    that step's event in ``held``; ``failing``'s raises, as a full disk would."""
    from orbax.checkpoint._src.path import atomicity

    real = atomicity.AtomicRenameTemporaryPath.finalize

    async def commit(self):
        name = self._final_path.name  # the step's directory, or one of its items'
        if name == str(failing):
            raise OSError(28, "No space left on device")
        if name.isdigit() and int(name) in held:
            await asyncio.to_thread(held[int(name)].wait, 60)
        return await real(self)

    monkeypatch.setattr(atomicity.AtomicRenameTemporaryPath, "finalize", commit)


def test_prometheus_serves_the_newest_committed_checkpoint_not_a_save_in_flight(trainer, tmp_path, monkeypatch):
    """The gauge was set as a save started: an asynchronous save still being written, or failing after, was served as the
    run's last checkpoint, and an alert on its age trusted a checkpoint a restart would not find. Now the newest save
    committed; one committed while a later one is written is served as soon as the loop sees it."""
    port, scraped = _free_port(), {5: {}, 7: {}}
    held = {4: threading.Event(), 6: threading.Event()}
    _hold_commits(monkeypatch, held)

    def scrape_then_commit(step):  # as step 5's (7's) batch is read: step 4's (6's) save is still being written
        _scrape(port, scraped[step])
        held[step - 1].set()

    _poison(monkeypatch, set(), trainer.cfg.model.vocab_size, on_step={5: lambda: scrape_then_commit(5), 7: lambda: scrape_then_commit(7)})
    served = _loop_config(trainer, train={"steps": 8}, log={"prometheus_port": port}, checkpoint={"async_save": True})
    start = time.time()
    train_lib.train(served.cfg, tmp_path / "run", served)
    assert scraped[5]["jaxtrain_last_checkpoint_step"] == 2 and scraped[5]["jaxtrain_step"] == 4
    # step 6's save waited for step 4's commit, and is written in turn
    assert scraped[7]["jaxtrain_last_checkpoint_step"] == 4
    assert 0 <= scraped[7]["jaxtrain_last_checkpoint_age_seconds"] < time.time() - start
    assert _checkpoint_steps(tmp_path / "run") == [4, 6, 8]

    failed, port, scraped = tmp_path / "failed", _free_port(), {5: {}}
    _hold_commits(monkeypatch, {}, failing=4)
    _poison(monkeypatch, set(), trainer.cfg.model.vocab_size, on_step={5: lambda: _scrape(port, scraped[5])})
    served = _loop_config(trainer, log={"prometheus_port": port}, checkpoint={"async_save": True})
    with pytest.raises(UserError, match="^could not write checkpoint step 4 "):
        train_lib.train(served.cfg, failed, served)
    assert scraped[5]["jaxtrain_last_checkpoint_step"] == 2 and _checkpoint_steps(failed) == [2]


def test_prometheus_port_in_use_is_one_line_before_the_run_dir(trainer, tmp_path):
    with socket.socket() as busy:
        busy.bind(("", 0))
        busy.listen()
        port = busy.getsockname()[1]
        served = _loop_config(trainer, log={"prometheus_port": port})
        with pytest.raises(UserError, match=f"^log.prometheus_port={port}: cannot serve metrics there \\(already in use\\)"):
            train_lib.train(served.cfg, tmp_path / "run", served)
    assert not (tmp_path / "run").exists()


def test_plot_names_the_damaged_line_and_skips_a_last_line_being_written(tmp_path):
    """A QA report: a damaged 3rd line was reported as 'line 1' (the JSON error's own line number, within the one
    line parsed). A partial last line with no newline yet is a record the run is still writing: plotted without it."""
    from jaxtrain.observe.plot import read_metrics

    good = [json.dumps({"step": s, "loss": 5.0 - s}) + "\n" for s in (1, 2)]
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(good) + '{"step": 3, "lo\n' + json.dumps({"step": 4, "loss": 1.0}) + "\n")
    with pytest.raises(UserError, match=f"^{path} line 3 is not JSON \\(Unterminated string"):
        read_metrics(tmp_path)
    path.write_text("".join(good) + "\n" + '{"step": 3, "lo\n')  # ended by its newline: written whole, and damaged
    with pytest.raises(UserError, match=f"^{path} line 4 is not JSON"):
        read_metrics(tmp_path)
    path.write_text("".join(good) + '{"step": 3, "lo')  # still being written
    assert [r["step"] for r in read_metrics(tmp_path)] == [1, 2]
    path.write_text('{"step": 1, "lo')  # the first record, half written: no records yet
    with pytest.raises(UserError, match="holds no records yet"):
        read_metrics(tmp_path)
    # JSON but no record (a QA report: KeyError, AttributeError and UnicodeDecodeError tracebacks)
    for line in ('{"loss": 3.0}', "[1, 2]", '{"step": "1"}'):
        path.write_text("".join(good) + line + "\n")
        with pytest.raises(UserError, match=f"^{path} line 3 is not a metrics record \\(a JSON object with an integer 'step'\\)"):
            read_metrics(tmp_path)
    path.write_bytes(b"\xff\xfe\n")
    with pytest.raises(UserError, match=f"^{path} is not UTF-8 text"):
        read_metrics(tmp_path)


def test_a_resume_drops_the_record_a_kill_cut_short(tmp_path):
    """A QA report: a run killed while it wrote a record (SIGKILL, a lost node) left a partial last line, and every
    resume stopped on it with a JSONDecodeError traceback. It goes, as the records past the checkpoint do, and the
    resumed run's records start on a line of their own; a damaged line before the last is one line naming it."""
    path = tmp_path / "metrics.jsonl"
    whole = [{"step": 1, "loss": 5.5, "learning_rate": 0.0}, {"step": 2, "loss": 5.25, "learning_rate": 1.5e-3},
             {"step": 2, "eval_loss": 5.125, "eval_tokens": 1024}]
    lines = "".join(json.dumps(record) + "\n" for record in whole)
    for cut in ('{"step": 3, "loss": 4.9, "learn', '{"step": 2, "eval_loss": 5.1'):  # past the checkpoint, or at it
        path.write_text(lines + cut)
        assert metrics_lib.drop_records_after(path, 2) == whole and path.read_text() == lines
    path.write_text(lines + json.dumps({"step": 3, "loss": 4.75}) + "\n")
    assert metrics_lib.drop_records_after(path, 2) == whole and path.read_text() == lines
    path.write_text(lines.replace('"step": 2, "loss"', '"step": 2, "lo', 1))
    with pytest.raises(UserError, match=f"^{path} line 2 is not JSON"):
        metrics_lib.drop_records_after(path, 2)


def test_an_image_path_that_cannot_be_written_is_one_line_and_leaves_nothing(tmp_path, monkeypatch):
    """A QA report: `--plot` to an existing directory, or where the file system refuses the file, printed a
    traceback (exit 1) after the whole plan had run; a write that fails half-way must not leave a partial image."""
    from matplotlib.figure import Figure

    from jaxtrain.cli import check_output_path
    from jaxtrain.observe.plot import check_image_path, plt, save_figure

    (tmp_path / "taken.png").mkdir()
    with pytest.raises(UserError, match=r"^--plot .*taken\.png is an existing directory; give a file name"):
        check_image_path("--plot", tmp_path / "taken.png")
    monkeypatch.setattr(os, "access", lambda path, mode: Path(path) != tmp_path)  # root writes anywhere: as another user
    with pytest.raises(UserError, match=f"^--plot {tmp_path}/new/x.png: this user cannot write in {tmp_path} "):
        check_output_path("--plot", tmp_path / "new" / "x.png")
    monkeypatch.undo()
    with pytest.raises(UserError, match=r"^cannot write /proc/jaxtrain-test/plan\.png: No such file or directory"):
        save_figure(plt.figure(), Path("/proc/jaxtrain-test/plan.png"))

    def full_disk(self, f, **kwargs):
        f.write(b"\x89PNG half")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(Figure, "savefig", full_disk)
    with pytest.raises(UserError, match=r"^could not write image .*plan\.png: the disk is full \(No space left on device\); "
                       "nothing of it is left behind; free space there or write elsewhere$"):
        save_figure(plt.figure(), tmp_path / "plan.png")
    assert [p.name for p in tmp_path.iterdir()] == ["taken.png"]
