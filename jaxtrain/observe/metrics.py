"""What a run reports: the start-up summary, metrics records (``metrics.jsonl``, TensorBoard, optional
Weights & Biases, MLflow and Prometheus), the progress line, MFU, memory, profiler traces, and the
non-finite guard.

The loop hands every step's device metrics to ``MetricsLog.after_step``; they are fetched from the
devices (the only host sync) once per ``log.every`` steps and before every checkpoint step (a
preemption save writes a record first), so a non-finite loss or gradient norm stops the run before a
checkpoint is written. Every process runs
the checks (so all stop together); only process 0 writes.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import math
import os
import resource
import sys
import time
from pathlib import Path
from typing import Any, Callable

import jax
import numpy as np
import psutil
import tqdm
from jax.experimental import multihost_utils

from jaxtrain import config as config_lib
from jaxtrain.atomic import WRITE_FAILURES, atomic_file, failed_writes_reported
from jaxtrain.compile_cache import describe as describe_cache
from jaxtrain.config import Config
from jaxtrain.data.batches import Epoch
from jaxtrain.errors import UserError
from jaxtrain.interop import hf_config
from jaxtrain.observe.exporters import MlflowRun, PrometheusGauges, start_wandb
from jaxtrain.observe import step_profile
from jaxtrain.observe.flops import measure_matmul_peak, model_flops_per_token, parameter_counts, peak_flops
from jaxtrain.observe.records import is_skip_record, read_records
from jaxtrain.optim import describe_schedule, warmup_steps
from jaxtrain.layout import Layout, idle_axes_note, unsplit_experts_note, unused_pipeline_note
from jaxtrain.memory import host_malloc
from jaxtrain.memory.offload import offloads_master_weights
from jaxtrain.mesh import describe_axes
from jaxtrain.stages import schedule
from jaxtrain.state import bytes_per_device, elements_per_device

SUMMARY_FILE = "summary.json"
GIB = 2**30
CPU_PEAK_MATMUL_SIZE = 512  # large enough to reach the CPU's matmul rate, small enough for ~1 s at start-up
GUARDED = ("loss", "grad_norm")  # a non-finite value of either means the step's update was not applied (the spike guard's too)
# the parameters' norm after the step: non-finite where the loss and gradients are finite, the optimizer made a
# non-finite update and the step applied it (jaxtrain/step.py)
APPLIED = "param_norm"
PER_LAYER = ("grad_norm_per_layer", "param_norm_per_layer")
NOT_STEP_TIME = ("checkpoint_s", "eval_s", "profile_s")  # timers left out of step_time_s (and so tokens/s and MFU)

# TensorBoard tag of each record key; keys not listed (e.g. eval_tokens) stay in metrics.jsonl only.
TAGS = {
    "loss": "train/loss", "eval_loss": "eval/loss", "learning_rate": "train/learning_rate",
    "grad_norm": "train/grad_norm", "param_norm": "train/param_norm",
    "tokens_per_s": "perf/tokens_per_s", "tokens_per_s_per_device": "perf/tokens_per_s_per_device",
    "step_time_s": "perf/step_time_s", "mfu": "perf/mfu", "data_wait_s": "perf/data_wait_s",
    "checkpoint_s": "perf/checkpoint_s", "eval_s": "perf/eval_s", "memory_in_use_gib": "memory/in_use_gib",
    "memory_peak_gib": "memory/peak_gib",
    "epoch": "train/epoch",
    # mixture of experts (jaxtrain.step.router_metrics), means over layers
    "moe_aux_loss": "moe/aux_loss", "moe_z_loss": "moe/z_loss", "moe_router_loss": "moe/router_loss",
    "moe_dropped_fraction": "moe/dropped_fraction",
    "loss_scale": "train/loss_scale", "overflow_steps": "train/overflow_steps", "skipped_spikes": "train/skipped_spikes",
    "skipped_nonfinite_steps": "train/skipped_nonfinite_steps",
}
# per-layer lists written to TensorBoard one scalar per layer (moe_expert_load_per_layer stays in metrics.jsonl)
PER_LAYER_TAGS = PER_LAYER + ("moe_load_max_over_mean_per_layer",)


class NonFiniteError(UserError):
    """A non-finite loss or gradient norm; the message is the one-line diagnosis."""


@functools.cache  # the machine does not change within a process; a bfloat16 measurement takes seconds on CPU
def _measured_cpu_peak(devices: tuple, dtype: str) -> float:
    return measure_matmul_peak(list(devices), size=CPU_PEAK_MATMUL_SIZE, dtype=dtype) / len(devices)


def resolve_peak(cfg: Config, devices: list) -> tuple[float | None, str]:
    """Per-device peak FLOP/s for MFU and where it comes from: the override, the datasheet table,
    or (CPU) a matmul benchmark of the local devices working together."""
    if cfg.log.peak_tflops:
        return cfg.log.peak_tflops * 1e12, "log.peak_tflops"
    kind = devices[0].device_kind
    table = peak_flops(kind, cfg.model.dtype)
    if table:
        return table, f"datasheet, {kind}, {cfg.model.dtype}"
    if devices[0].platform == "cpu":
        local = tuple(d for d in devices if d.process_index == jax.process_index())
        return _measured_cpu_peak(local, cfg.model.dtype), f"measured {cfg.model.dtype} matmul on {len(local)} CPU devices"
    return None, f"unknown for {kind}; set log.peak_tflops"


# a record the disk refuses (full) stops the run: its checkpoints stay, and a re-run resumes from the newest
RECORD_LEFT, RECORD_FIX = ("the run stops, its committed checkpoints intact (a record cut short is dropped on resume)",
                           "free space there and run the same command again to resume")


def _abandon_tensorboard(writer) -> None:
    """Let go of a TensorBoard writer whose file the disk refuses: tensorboardX's close, and its exit handler after it,
    flush the events it holds again, each failure one more traceback (at exit, after the run's one line). It offers no
    close without that flush, so this reaches into its EventFileWriter: its thread stopped, then marked closed."""
    for file_writer in writer.all_writers.values():
        events = file_writer.event_writer
        if not events._closed:
            events._worker.stop()
            events._closed = True


def tensorboard_writer_class() -> type:
    """tensorboardX's SummaryWriter, imported without torch: tensorboardX imports torch whenever it is installed (the
    test extra, the GPU image, most Hugging Face users) only to accept torch tensors, and we write Python floats.
    Loading torch took 2.0 of the 2.2 s the import took and raised peak host memory from 29 to 221 MiB (2026-12-03)."""
    if "torch" in sys.modules:  # already paid for
        from tensorboardX import SummaryWriter

        return SummaryWriter
    sys.modules["torch"] = None  # `import torch` raises ImportError, which tensorboardX catches
    try:
        from tensorboardX import SummaryWriter
    finally:
        del sys.modules["torch"]
    return SummaryWriter


def memory_gib() -> tuple[float, float, str]:
    """(in use, peak, source) in GiB: the fullest local device where the backend reports memory,
    else this process's resident host memory (CPU)."""
    stats = [d.memory_stats() for d in jax.local_devices()]
    if all(s and "bytes_in_use" in s for s in stats):
        return (max(s["bytes_in_use"] for s in stats) / GIB, max(s.get("peak_bytes_in_use", 0) for s in stats) / GIB,
                "device")
    rss = psutil.Process().memory_info().rss
    peak = max(rss, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)  # ru_maxrss: KiB on Linux
    return rss / GIB, peak / GIB, "host_rss"


def job_memory_gib() -> dict[str, Any]:
    """The record's memory fields: ``memory_gib`` of the job's fullest process (every process calls this at once),
    and which process that is (the largest peak): process 0 writes the record, and under pipeline stages or uneven
    shards another process's devices may be the fuller ones."""
    in_use, peak, source = memory_gib()
    every = np.array([[in_use, peak]])
    if jax.process_count() > 1:
        every = multihost_utils.process_allgather(every[0])
    fullest = int(np.argmax(every[:, 1]))
    return {"memory_in_use_gib": float(every[:, 0].max()), "memory_peak_gib": float(every[fullest, 1]),
            "memory_source": source, "memory_process": fullest}


def startup_summary(layout: Layout, compile_s: float, compile_cache: dict | None, data: str, peak: float | None,
                    peak_source: str, microbatches_auto: str | None = None, epoch: dict | None = None) -> dict[str, Any]:
    """``microbatches_auto``: how train.microbatches=auto chose the count ("fitted" to the devices' memory, or one pass
    where they report none: "unsized"); None where the config gave a count. ``epoch``: ``data.Epoch.summary``'s."""
    cfg, mesh, state = layout.cfg, layout.mesh, layout.abstract_state()
    pipeline = schedule(cfg, layout.rules, mesh)
    pipelined = pipeline.stages > 1
    return {
        "devices": mesh.size, "device_kind": mesh.devices.flat[0].device_kind, "processes": jax.process_count(),
        "mesh": dict(mesh.shape), "rules": cfg.rules, "attention": cfg.model.attention,
        # what the memory techniques and precision are, as the config resolved them (the summary named none of them)
        # a LoRA run's adapters are float32 on any base (jaxtrain/models/lora.py ADAPTER_DTYPE)
        "precision": f"{cfg.model.dtype} compute, "
                     + (f"{cfg.model.param_dtype} base, float32 adapters" if cfg.model.lora.rank else f"{cfg.model.param_dtype} parameters")
                     + (f", {cfg.model.quant} matmuls" if cfg.model.quant != "none" else "")
                     + (", dynamic loss scale" if cfg.model.dtype == "float16" else ""),
        "remat": cfg.model.remat_description,
        "host_memory": {"parameters": cfg.optim.offload and offloads_master_weights(cfg.model), "optimizer_state": cfg.optim.offload},
        # model.moe.grouped_matmul as resolved (auto), for dropless dispatch; null without it
        "grouped_matmul": cfg.model.moe.grouped_matmul if cfg.model.moe.num_experts and cfg.model.moe.dispatch == "dropless" else None,
        # pipeline stages loop over their layers with a scan whatever model.scan_layers says (jaxtrain/models/pipeline.py);
        # its auto resolves to true there, so false is the user's and the summary says it has no effect
        "layers": "scanned" if cfg.model.scan_layers or pipelined else "unrolled",
        "scan_layers_ignored": pipelined and cfg.model.scan_layers is False,
        # one expert per token renormalised over itself: its weight is 1 whatever the router says
        "router_weight_constant": cfg.model.moe.num_experts > 0 and cfg.model.moe.top_k == 1 and cfg.model.moe.normalize_top_k,
        # capacity is per sequence: an SFT example's drops depend on the examples packed beside it and on the padding
        "capacity_shared_by_examples": cfg.model.moe.num_experts > 0 and cfg.model.moe.dispatch == "capacity" and cfg.data.format == "sft",
        # found out at start-up, not at export-hf after the training: None, or why no Hugging Face architecture holds the model
        "no_hf_architecture": _no_hf_architecture(cfg),
        # a quantized base (QLoRA) counted as the model's parameters, not its packed codes and scales
        "params": parameter_counts(layout)["total"],
        "params_per_device": elements_per_device(state.params),
        "param_bytes_per_device": bytes_per_device(state.params),
        # a LoRA run: the parameters above are the adapters, which train; the frozen base's bytes apart
        "trained_params": sum(x.size for x in jax.tree.leaves(state.params)) if state.frozen is not None else None,
        "lora_targets": cfg.model.lora.target_names() if cfg.model.lora.rank else None,  # as model.lora.targets matched them
        "frozen_bytes_per_device": bytes_per_device(state.frozen),
        "opt_state_bytes_per_device": bytes_per_device(state.opt_state),
        "global_batch_sequences": cfg.train.global_batch, "global_batch_tokens": layout.tokens_per_step,
        "microbatches": cfg.train.microbatches, "microbatches_auto": microbatches_auto,
        # with stages: their schedule and bubble (the share of a pass each stage idles), as the plan names them
        "pipeline": dataclasses.asdict(pipeline) | {"bubble": pipeline.bubble, "described": pipeline.describe()} if pipelined else None,
        "flops_per_token": model_flops_per_token(layout),
        # optim.grad_sync as resolved (auto); null where no replica axis sums the gradients
        "grad_sync": None if not layout.replica_axes else "microbatch" if layout.grad_reduction is None else "step",
        "idle_axes": layout.idle_axes,  # mesh axes that split nothing: their devices repeat each other's work
        "unsplit_experts_note": unsplit_experts_note(layout),
        "unused_pipeline_note": unused_pipeline_note(layout),
        "warmup_steps": warmup_steps(cfg), "configured_warmup_steps": cfg.optim.warmup_steps,  # at most train.steps: the former
        "optimizer": describe_schedule(cfg),
        "peak_flops_per_device": peak, "peak_source": peak_source, "compile_s": round(compile_s, 3),
        "compile_cache": compile_cache, "data": data, "epoch": epoch, "cpu_devices_per_core": cpu_devices_per_core(),
        # on CPUs: the malloc and whether it keeps XLA:CPU's step buffers mapped (memory/host_malloc.py); null on accelerators
        **({"host_malloc": host_malloc.allocator(), "host_malloc_kept": host_malloc.kept()}
           if jax.local_devices()[0].platform == "cpu" else {"host_malloc": None, "host_malloc_kept": None}),
    }


def _no_hf_architecture(cfg: Config) -> str | None:
    if not cfg.model.moe.num_experts:
        return None
    try:
        hf_config.moe_architecture(cfg.model)
    except UserError as e:
        return str(e)
    return None


def cpu_devices_per_core() -> float | None:
    """This process's simulated CPU devices per core it may run on (None on accelerators). XLA:CPU runs a thread
    per device, so above 1 the devices crowd the cores: the torch peer's step took 1.4x one device's on 8 devices
    over 2 cores (README, "Benchmarks")."""
    devices = jax.local_devices()
    if devices[0].platform != "cpu":
        return None
    return len(devices) / len(os.sched_getaffinity(0))


AUTO_MICROBATCHES = {"fitted": " (train.microbatches=auto: the fewest whose step fits the device's memory)",
                     "unsized": " (train.microbatches=auto: these devices report no memory size, so one pass)"}


def format_summary(s: dict[str, Any]) -> str:
    mesh = describe_axes(s["mesh"])
    peak = "unknown" if s["peak_flops_per_device"] is None else f"{s['peak_flops_per_device'] / 1e12:.3g} TFLOP/s"

    def on_host(part: str) -> str:
        return " in host memory (optim.offload)" if s["host_memory"][part] else ""

    return "\n".join([
        f"jaxtrain: {s['devices']} x {s['device_kind']} in {s['processes']} process(es); mesh {mesh}; rules {s['rules']}; {s['attention']} attention; "
        f"{s['layers']} layers" + (f"; experts' grouped matmul {s['grouped_matmul']}" if s.get("grouped_matmul") else "")
        + f"; {s['precision']}; remat {s['remat']}",
        (f"  parameters {s['params']:,} ({s['params_per_device']:,} per device); per device: params "
         f"{s['param_bytes_per_device'] / GIB:.3g} GiB{on_host('parameters')}" if s.get("trained_params") is None else
         f"  parameters {s['params']:,}, of which {s['trained_params']:,} train (the LoRA adapters on {', '.join(s['lora_targets'])}, "
         f"{s['params_per_device']:,} per device); per device: adapters {s['param_bytes_per_device'] / GIB:.3g} GiB"
         f"{on_host('parameters')}, frozen base {s['frozen_bytes_per_device'] / GIB:.3g} GiB")
        + f", optimizer state {s['opt_state_bytes_per_device'] / GIB:.3g} GiB{on_host('optimizer_state')}",
        f"  global batch {s['global_batch_sequences']} sequences = {s['global_batch_tokens']:,} tokens in "
        f"{s['microbatches']} micro-batch(es)"
        + AUTO_MICROBATCHES.get(s.get("microbatches_auto"), "")
        + (f", each a {s['pipeline']['described']}" if s.get("pipeline") else "")
        + ("" if s["microbatches"] == 1 else ", no replica axis to sum the gradients over (optim.grad_sync has no effect)"
           if s["grad_sync"] is None else
           f", gradients summed across the batch shards {'once per step' if s['grad_sync'] == 'step' else 'in every micro-batch'}") + f"; {s['flops_per_token']:.4g} FLOPs per token",
        f"  optimizer {s['optimizer']}",
        f"  peak for MFU {peak} per device ({s['peak_source']}); train step compiled in {s['compile_s']:.1f}s "
        f"({describe_cache(s['compile_cache'])})",
        f"  data: {s['data']}",
        *([f"  epoch: {describe_epoch(s['epoch'], s['global_batch_sequences'])}"] if s.get("epoch") else []),
        *([f"  {note}"] if (note := idle_axes_note(s["idle_axes"], s["rules"])) else []),
        *([f"  {s['unsplit_experts_note']}"] if s.get("unsplit_experts_note") else []),
        *([f"  {s['unused_pipeline_note']}"] if s.get("unused_pipeline_note") else []),
        *([f"  note: model.scan_layers=false has no effect with pipeline stages (rules {s['rules']}): each stage's layers run in the "
           "pipeline's scan; drop the key, or use a rule set without pp_ to unroll them"] if s.get("scan_layers_ignored") else []),
        *(["  note: model.moe.top_k=1 with model.moe.normalize_top_k=true weights each token's expert by 1, so the training loss "
           "gives the router no gradient (only the load-balancing and z losses train it); set model.moe.normalize_top_k=false "
           "to weight it by its router probability (Switch Transformer)"] if s.get("router_weight_constant") else []),
        *([f"  note: {s['no_hf_architecture']}: jaxtrain export-hf will refuse to write it (checkpoints, resume and generate "
           "are unaffected)"] if s.get("no_hf_architecture") else []),
        *(["  note: model.moe.dispatch=capacity with data.format=sft: the experts' capacity is shared by a sequence's tokens, the "
           "examples packed into it and its padding included, so an example's loss depends on its neighbours; "
           "model.moe.dispatch=dropless routes each example as if alone"] if s.get("capacity_shared_by_examples") else []),
        *([f"  note: optim.warmup_steps={s['configured_warmup_steps']} is more than train.steps={s['warmup_steps']}: the learning rate "
           + (f"warms up over the {s['warmup_steps']} steps, reaching optim.lr at the last," if s["warmup_steps"] > 1 else
              "is optim.lr at the run's one step")
           + " and never decays; raise train.steps or lower optim.warmup_steps"]
          if s["configured_warmup_steps"] > s["warmup_steps"] else []),
        *([f"  note: {s['cpu_devices_per_core']:.3g} simulated CPU devices per core, each an XLA:CPU thread, crowd the cores: "
           "for speed, a mesh of at most one device per core (--mesh gpu1 runs on one)"] if (s["cpu_devices_per_core"] or 0) > 1 else []),
        *([f"  note: {s['host_malloc']} malloc hands XLA:CPU's step buffers back to the system, so each step maps and zeroes "
           f"them again (1.2-1.3x slower on the torch peer); {keep_hint(s['host_malloc'])} (README, \"Host memory on CPUs\")"]
          if s["host_malloc_kept"] is False else []),
    ])


def describe_epoch(epoch: dict, global_batch: int) -> str:
    """The summary's epoch line: how much of the data an epoch is, in sequences and steps, where this run is in it, and
    the train.steps that train.epochs came to."""
    epochs = (f" (train.epochs={epoch['train_epochs']:g}: train.steps={epoch['train_steps']:,}, the first step to have read "
              f"{epoch['train_epochs']:g} epoch{'s' * (epoch['train_epochs'] != 1)})" if epoch.get("train_epochs") else "")
    if epoch["steps"] is None:  # instruction data: the examples a step takes are those that pack into it
        return (f"{epoch['size']:,} training {epoch['unit']}, as many a step as pack into its sequences; this run starts at "
                f"epoch {epoch['at_start']:.4g}{epochs}")
    left_out = epoch["left_out_tokens"]
    steps = f"{epoch['steps']:,.2f}".rstrip("0").rstrip(".")  # 7.38, 41,234.5: never in exponent notation
    return (f"{epoch['size']:,} training {epoch['unit']} = {steps} steps of train.global_batch={global_batch}, each "
            "sequence read once an epoch, in an order of its own"
            + (f" (the split's last {left_out:,} token{'s' * (left_out != 1)}, short of a sequence, "
               f"{'is' if left_out == 1 else 'are'} never read)" if left_out else "")
            + f"; this run trains from epoch {epoch['at_start']:.4g} to {epoch['at_end']:.4g}{epochs}")


def keep_hint(allocator: str) -> str:
    """How to keep freed step buffers with this malloc (the summary's note)."""
    if allocator == "jemalloc":  # preloaded by the user with its default settings
        return f"MALLOC_CONF={host_malloc.JEMALLOC_CONF} keeps them"
    if allocator == "glibc":
        return f"{host_malloc.ENV}=keep or jemalloc keeps them (auto does only where no accelerator plugin is installed)"
    return f"this C library's malloc has no setting for it; on Linux, {host_malloc.ENV}=jemalloc keeps them"


class Progress:
    """One self-updating line (tqdm) when ``stream`` is a terminal; one plain line per record otherwise
    (CI and SLURM logs)."""

    def __init__(self, total: int, initial: int, stream=None):
        self.stream, self.total = stream or sys.stderr, total
        self.bar = tqdm.tqdm(total=total, initial=initial, unit="step", dynamic_ncols=True, file=self.stream) \
            if self.stream.isatty() else None

    def update(self, step: int, record: dict, eta_s: float) -> None:
        shown = {"loss": f"{record['loss']:.4g}", "tok/s": f"{record['tokens_per_s']:,.0f}"}
        if record.get("mfu") is not None:
            shown["mfu"] = f"{record['mfu']:.1%}"
        if record.get("epoch") is not None:
            shown["epoch"] = f"{record['epoch']:.2f}"
        if self.bar is not None:
            self.bar.set_postfix(shown, refresh=False)
            self.bar.update(step - self.bar.n)
        else:
            fields = " ".join(f"{k} {v}" for k, v in shown.items())
            self.say(f"step {step}/{self.total} {fields} eta {_duration(eta_s)}")

    def evaluated(self, step: int, loss: float, tokens: int) -> None:
        self.say(f"step {step}/{self.total} eval loss {loss:.4g} over {tokens:,} tokens")

    def say(self, line: str) -> None:
        if self.bar is not None:
            self.bar.write(line, file=self.stream)
        else:
            print(line, file=self.stream, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def _duration(seconds: float) -> str:
    seconds = int(seconds)
    return f"{seconds // 3600}h{seconds // 60 % 60:02d}m" if seconds >= 3600 else f"{seconds // 60}m{seconds % 60:02d}s"


def _finite_or_none(value):
    """JSON has no NaN or infinity (Python's json writes them, stricter readers refuse the file): null, in lists too
    (a non-finite step's per-layer norms)."""
    if isinstance(value, list):
        return [_finite_or_none(v) for v in value]
    return None if isinstance(value, float) and not math.isfinite(value) else value


def drop_records_after(path: Path, step: int) -> list[dict]:
    """Forget records of steps after ``step``: a run killed after its last checkpoint logged steps it
    will now redo, and each step must appear once; a record the kill cut short goes too (it was a traceback, and
    the resumed run's next record would have been appended to it). Returns the records kept."""
    if not path.exists():
        return []
    kept = [record for record in read_records(path) if record["step"] <= step]
    text = "".join(json.dumps(record) + "\n" for record in kept)  # as ``MetricsLog.write`` wrote them
    if text != path.read_text(encoding="utf-8"):
        with atomic_file(path, "metrics file") as f:
            f.write(text.encode())
    return kept


def resumed_profile(spec: str | None, initial_step: int) -> tuple[tuple[int, int] | None, str | None]:
    """The steps ``log.profile_steps`` profiles in a run that starts after ``initial_step``, and a note where a resume
    cut the range short or past its end (a QA report: no trace, and not a word)."""
    if spec is None:
        return None, None
    start, end = config_lib.profile_range(spec)
    if initial_step < start:
        return (start, end), None
    if initial_step < end:
        return (initial_step + 1, end), (f"jaxtrain: note: the run resumes at step {initial_step + 1}, inside "
                                         f"log.profile_steps={spec}: steps {initial_step + 1}-{end} are profiled")
    return None, (f"jaxtrain: note: log.profile_steps={spec} ends before the run resumes at step {initial_step + 1}: "
                  f"nothing is profiled; give steps after {initial_step}")


class MetricsLog:
    """Created by the loop once the state is ready; see the module docstring."""

    def __init__(self, layout: Layout, run_dir: Path, initial_step: int, *, compile_s: float,
                 compile_cache: dict | None, data: str, enabled: bool, step_program: Callable[[], str] | None = None,
                 microbatches_auto: str | None = None, epoch: Epoch | None = None, data_position: int = 0):
        """``step_program``: the compiled train step's HLO text, read when a profile is summarized; ``microbatches_auto``:
        ``startup_summary``'s; ``epoch``: the training split's (``data.epoch``), with which ``data_position`` (the
        data read before ``initial_step``'s step) and each step's give the epochs read."""
        cfg = layout.cfg
        self.cfg, self.run_dir, self.enabled = cfg, run_dir, enabled
        self.step_program, self.mesh_shape = step_program, dict(layout.mesh.shape)
        self.platform = layout.mesh.devices.flat[0].platform
        self.tokens_per_step = layout.tokens_per_step
        self.devices = layout.mesh.size
        self.flops_per_token = model_flops_per_token(layout)
        self.profile, profile_note = resumed_profile(cfg.log.profile_steps, initial_step)
        self.profiling = False
        self.pending: list[tuple[int, dict]] = []  # (step, metrics) not yet fetched from the devices
        self.timers = {"data_wait_s": 0.0, "checkpoint_s": 0.0, "eval_s": 0.0, "profile_s": 0.0}  # since the last record
        self.last_step = initial_step
        self.last_finite: tuple[int, dict] | None = None
        self.skipped = 0
        self.overflows = 0  # float16: steps the loss scaler skipped since the run (re)started
        self.spikes = 0  # train.skip_spikes: updates skipped as spikes since the run (re)started
        self.epoch, self.data_position = epoch, data_position
        self.file = self.tensorboard = self.wandb = self.mlflow = self.prometheus = self.progress = None
        self.write_failed = False  # a record the disk refused, reported: closing drops what it could not write
        self.peak, peak_source = resolve_peak(cfg, list(layout.mesh.devices.flat)) if enabled else (None, "")
        if enabled:
            try:
                epoch_summary = epoch and epoch.summary(data_position, initial_step, cfg.train.steps, cfg.train.global_batch,
                                                        cfg.train.epochs)
                self._open(startup_summary(layout, compile_s, compile_cache, data, self.peak, peak_source, microbatches_auto,
                                           epoch_summary), initial_step)
            except BaseException:
                self.close()
                raise
        if profile_note:
            self._say(profile_note)
        # the first record's step time starts here, after the start-up work (peak benchmark, summary, loggers)
        self.last_time = time.perf_counter()

    def _open(self, summary: dict[str, Any], initial_step: int) -> None:
        cfg, run_dir = self.cfg, self.run_dir
        with atomic_file(run_dir / SUMMARY_FILE, "start-up summary") as f:
            f.write((json.dumps(summary, indent=1) + "\n").encode())
        kept = drop_records_after(run_dir / "metrics.jsonl", initial_step)
        self.evaluated = {record["step"] for record in kept if "eval_loss" in record}
        self.file = open(run_dir / "metrics.jsonl", "a")
        if cfg.log.tensorboard:
            # an earlier attempt's events past the resumed step hidden, as its metrics.jsonl records are dropped (a
            # restart event TensorBoard purges them at)
            self.tensorboard = tensorboard_writer_class()(str(run_dir), purge_step=initial_step + 1)
            self.tensorboard.add_text("summary", "    " + format_summary(summary).replace("\n", "\n    "), initial_step)
        if cfg.log.wandb:
            self.wandb = start_wandb(cfg, run_dir)
        if cfg.log.mlflow:
            self.mlflow = MlflowRun(cfg, run_dir)
        if cfg.log.prometheus_port:
            self.prometheus = PrometheusGauges(cfg.log.prometheus_port)
        print(format_summary(summary), file=sys.stderr)
        if cfg.log.progress:
            self.progress = Progress(cfg.train.steps, initial_step)

    @contextlib.contextmanager
    def timer(self, name: str):
        """Adds the block's wall time to ``name`` (data_wait_s, checkpoint_s, eval_s, profile_s) for the next
        record; checkpoint, eval and profiler time are not counted as step time."""
        start = time.perf_counter()
        try:
            yield
        finally:
            self.timers[name] += time.perf_counter() - start

    def before_step(self, step: int) -> None:
        if self.profile and step == self.profile[0]:
            if self.pending:  # steps still running on the devices would be counted in the profile's first step
                jax.block_until_ready(self.pending[-1][1])
            with self.timer("profile_s"):
                jax.profiler.start_trace(str(self.run_dir))
            self.profiling = True

    def after_step(self, step: int, metrics: dict, *, flush: bool = False, data_position: int | None = None) -> None:
        """Queue the step's device metrics; fetch, check and write them when a record or checkpoint is due, or
        ``flush`` (a preemption save follows). ``data_position``: the data read through this step's batch."""
        if data_position is not None:
            self.data_position = data_position
        layer_every = self.cfg.log.layer_every
        if not (layer_every and step % layer_every == 0):
            metrics = {k: v for k, v in metrics.items() if k not in PER_LAYER}
        self.pending.append((step, metrics))
        if self.profiling and step == self.profile[1]:
            self._stop_trace(metrics)
        last = step == self.cfg.train.steps
        if step % self.cfg.log.every == 0 or last or flush:
            self._record(step)
        elif step % self.cfg.checkpoint.every == 0:
            self._check_pending()

    def _check_pending(self) -> list[tuple[int, dict]]:
        """Fetch queued metrics, apply the non-finite policy and write the per-layer and skip records, in step order
        (W&B drops a step below the last one logged); also at a checkpoint step between records, whose fetch would
        otherwise leave its steps' per-layer norms unwritten."""
        fetched = jax.device_get(self.pending)
        self.pending = []
        for step, metrics in fetched:
            if PER_LAYER[0] in metrics:
                self.write({"step": step} | {k: np.asarray(metrics[k]).tolist() for k in PER_LAYER})
            bad = [name for name in GUARDED if not np.isfinite(metrics[name])]
            if not bad and not np.isfinite(metrics[APPLIED]):  # a non-finite loss makes the update so too: not its cause
                # the step applied the update (its gate is the loss and the gradients): no skip undoes it, the run stops
                raise NonFiniteError(self._diagnosis(step, metrics, [APPLIED]))
            if metrics.get("overflow"):  # float16 gradients overflowed: the loss scaler skipped it and halved the scale
                self.overflows += 1
                continue
            if not bad:
                self.last_finite = (step, metrics)
                if metrics.get("spike"):
                    self._skipped_spike(step, metrics)
                continue
            self.skipped += 1
            if self.skipped > self.cfg.train.skip_nonfinite:
                raise NonFiniteError(self._diagnosis(step, metrics, bad))
            self.write({"step": step, "skipped_nonfinite": bad} | {k: float(metrics[k]) for k in GUARDED})
            self._say(f"jaxtrain: step {step}: {' and '.join(bad)} not finite, update skipped "
                      f"({self.skipped} of train.skip_nonfinite={self.cfg.train.skip_nonfinite})")
        return fetched

    def _skipped_spike(self, step: int, metrics: dict) -> None:
        """train.skip_spikes: the step's update was not applied (jaxtrain/spikes.py); the run goes on."""
        self.spikes += 1
        sigma, window = self.cfg.train.skip_spikes, int(metrics["spike_window_steps"])  # under spike_window while it fills
        far = {name: float(metrics[f"{name}_deviations"]) for name in GUARDED if metrics[f"{name}_deviations"] > sigma}
        self.write({"step": step, "skipped_spike": list(far)} | {k: float(metrics[k]) for k in GUARDED}
                   | {f"{k}_deviations": float(metrics[f"{k}_deviations"]) for k in GUARDED})
        found = [f"{name} {float(metrics[name]):.6g} ({deviations:.3g}" for name, deviations in far.items()]
        found[0] += f" standard deviations from the mean of the last {window} steps"
        self._say(f"jaxtrain: step {step}: a spike, update skipped: {'), '.join(found)}) (train.skip_spikes={sigma:g}; "
                  f"{self.spikes} skipped since the run (re)started)")

    def _diagnosis(self, step: int, metrics: dict, bad: list[str]) -> str:
        values = ", ".join(f"{k} {float(metrics[k])}" for k in (*GUARDED, APPLIED))
        if self.last_finite:
            good_step, good = self.last_finite
            last = f"last finite values at step {good_step}: " + ", ".join(f"{k} {float(good[k]):.6g}" for k in GUARDED)
        else:
            last = "no finite values before it in this run"
        if bad == [APPLIED]:
            return (f"step {step}: {APPLIED} not finite ({values}); {last}; the optimizer made a non-finite update of "
                    "finite gradients and the step applied it, so no train.skip_nonfinite skips it, and no checkpoint was "
                    "written after it; check the optimizer's settings (optim.eps, b1, b2, weight_decay) or lower optim.lr; "
                    "the last checkpoint holds the state before it")
        allowed = self.cfg.train.skip_nonfinite
        policy = f"more than train.skip_nonfinite={allowed} updates skipped" if allowed else "the update was not applied"
        skip = f"raise train.skip_nonfinite above {allowed}" if allowed else "set train.skip_nonfinite=N"
        return (f"step {step}: {' and '.join(bad)} not finite ({values}); {last}; {policy} and no checkpoint was "
                f"written after it; check the data, lower optim.lr, or {skip} to skip such steps")

    def _record(self, step: int) -> None:
        fetched = self._check_pending()
        now = time.perf_counter()
        steps = step - self.last_step
        step_time = (now - self.last_time - sum(self.timers[name] for name in NOT_STEP_TIME)) / steps
        tokens_per_s = self.tokens_per_step / step_time
        metrics = fetched[-1][1]
        record = {
            "step": step, "loss": float(metrics["loss"]), "learning_rate": float(metrics["learning_rate"]),
            "grad_norm": float(metrics["grad_norm"]), "param_norm": float(metrics["param_norm"]),
            "step_time_s": step_time, "tokens_per_s": tokens_per_s, "tokens_per_s_per_device": tokens_per_s / self.devices,
            "mfu": None if self.peak is None else self.flops_per_token * tokens_per_s / (self.devices * self.peak),
            "data_wait_s": self.timers["data_wait_s"], "checkpoint_s": self.timers["checkpoint_s"],
        } | job_memory_gib() | {k: np.asarray(v).tolist() for k, v in metrics.items() if k.startswith("moe_")}
        if self.epoch:
            record |= {"epoch": self.epoch.of(self.data_position)}
        if "loss_scale" in metrics:
            record |= {"loss_scale": float(metrics["loss_scale"]), "overflow_steps": self.overflows}
        if "spike" in metrics:
            record |= {"skipped_spikes": self.spikes}
        if self.cfg.train.skip_nonfinite:
            record |= {"skipped_nonfinite_steps": self.skipped}
        self.write(record)
        if self.progress:
            self.progress.update(step, record, eta_s=(self.cfg.train.steps - step) * step_time)
        self.timers = dict.fromkeys(self.timers, 0.0)
        self.last_time, self.last_step = now, step

    def write(self, record: dict) -> None:
        """Append one record (must have ``step``) to metrics.jsonl, TensorBoard and W&B (process 0)."""
        if not self.enabled:
            return
        if "eval_loss" in record and record["step"] in self.evaluated:  # a resume's evaluation of a step already recorded
            return
        record = {k: _finite_or_none(v) for k, v in record.items()}
        step = record["step"]
        scalars = {} if is_skip_record(record) else {TAGS[k]: v for k, v in record.items() if k in TAGS and v is not None}
        for key in PER_LAYER_TAGS:
            scalars |= {f"{key}/layer_{i:03d}": v for i, v in enumerate(record.get(key, ())) if v is not None}
        try:
            with failed_writes_reported(self.run_dir / "metrics.jsonl", "a metrics record to", RECORD_LEFT, RECORD_FIX):
                self.file.write(json.dumps(record) + "\n")
                self.file.flush()
            if self.tensorboard:
                with failed_writes_reported(self.run_dir, "TensorBoard events to", RECORD_LEFT, RECORD_FIX):
                    for tag, value in scalars.items():
                        self.tensorboard.add_scalar(tag, value, step)
                    self.tensorboard.flush()
        except UserError:
            self.write_failed = True
            raise
        if self.wandb:
            self.wandb.log(scalars, step=step)
        if self.mlflow:
            self.mlflow.log(scalars, step)
        if self.prometheus and "loss" in record and "tokens_per_s" in record:
            self.prometheus.record(record)
        if self.progress and record.get("eval_loss") is not None:
            self.progress.evaluated(step, record["eval_loss"], record["eval_tokens"])

    def checkpoint_saved(self, step: int, written: float) -> None:
        """A checkpoint committed (or resumed from); ``written``: when its save started."""
        if self.prometheus:
            self.prometheus.checkpoint(step, written)

    def _stop_trace(self, metrics: dict) -> None:
        jax.block_until_ready(metrics)  # the traced steps must have run
        # writing and summarizing the trace took 10x the tiny model's step on CPU (a QA report: in its record's step time)
        with self.timer("profile_s"):
            jax.profiler.stop_trace()
            self.profiling = False
            traces = sorted((self.run_dir / "plugins" / "profile").iterdir())
            self._say(f"jaxtrain: profile of steps {self.profile[0]}-{self.profile[1]} in {traces[-1]} "
                      f"(tensorboard --logdir {self.run_dir}, or open the .xplane.pb / .trace.json.gz in Perfetto)")
            if self.enabled and self.step_program is not None:
                self._summarize_profile(traces[-1])

    def _summarize_profile(self, trace_dir: Path) -> None:
        """The device time per step by kind into ``step_profile.json`` beside the trace, and two lines."""
        try:
            summary = step_profile.summarize(step_profile.trace_file(trace_dir), self.step_program(),
                                             self.profile[1] - self.profile[0] + 1, self.mesh_shape, self.platform)
        except Exception as e:  # a reading aid: the trace is written and the run goes on without it
            self._say(f"jaxtrain: no summary of the profile ({type(e).__name__}: {e}); the trace is complete")
            return
        with atomic_file(trace_dir / step_profile.SUMMARY_FILE, "profile summary") as f:
            f.write((json.dumps(summary.to_json(), indent=1) + "\n").encode())
        for line in summary.lines():
            self._say(f"jaxtrain: {line}")

    def _say(self, line: str) -> None:
        if not self.enabled:
            return
        if self.progress:
            self.progress.say(line)
        else:
            print(line, file=sys.stderr, flush=True)

    def _close_file(self, close: Callable[[], None], abandon: Callable[[], None] = lambda: None) -> None:
        """``close()`` flushes what the disk refused once more: after the failure was reported (``write_failed``) that is
        dropped, without a second error in place of the first."""
        try:
            close()
        except OSError as e:
            abandon()
            if not (self.write_failed and e.errno in WRITE_FAILURES):
                raise

    def close(self, mlflow_status: str = "FINISHED") -> None:
        if self.profiling:
            jax.profiler.stop_trace()
        if self.progress:
            self.progress.close()
        if self.tensorboard:
            self._close_file(self.tensorboard.close, lambda: _abandon_tensorboard(self.tensorboard))
        if self.wandb:
            self.wandb.finish()
        if self.file:
            self._close_file(self.file.close)
        if self.prometheus:
            self.prometheus.close()
        if self.mlflow:
            self.mlflow.close(mlflow_status)
