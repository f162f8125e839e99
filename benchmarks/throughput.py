"""Train-step throughput of one experiment on the local devices: TFLOP/s per device and MFU.

    python benchmarks/throughput.py llama3_1b --mesh gpu1 --rules fsdp model.remat=save_dots data.seq_len=4096

Prints one JSON line. Random tokens (the step time does not depend on the data); model FLOPs counted
as in jaxtrain.observe.flops (PaLM, causal attention halved); MFU against the peak a training run's summary uses
(jaxtrain.observe.metrics.resolve_peak: --peak-tflops, else the datasheet's for the device and model.dtype, 989.4 for
an H100 SXM or H200 in bf16, else on CPUs the measured matmul peak). Memory per device, side by side: the planner's
estimate for these devices, XLA's compiled peak, and the peak the device measured (``memory_stats()``;
none on CPUs). Used by benchmarks/gpu_h200.sh.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

from jaxtrain.cli import resolve_config
from jaxtrain import xla_env
from jaxtrain.errors import OneLineParser, UserError, positive_int
from jaxtrain.memory import host_malloc


def experiment_parser(description: str) -> argparse.ArgumentParser:
    """EXPERIMENT [key=value ...] [--mesh FILE] [--rules NAME]: what a one-GPU benchmark of an experiment takes."""
    parser = OneLineParser(description=description)
    parser.add_argument("experiment")
    parser.add_argument("overrides", nargs="*", metavar="key=value")
    parser.add_argument("--mesh", default="gpu1")
    parser.add_argument("--rules", default="fsdp")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = experiment_parser(__doc__.splitlines()[0])
    parser.add_argument("--steps", type=positive_int, default=10, help="timed steps (after 2 warm-up steps)")
    parser.add_argument("--peak-tflops", type=float, default=None,
                        help="per-device peak for MFU; default: the datasheet's for the device and model.dtype (log.peak_tflops)")
    parser.add_argument("--profile-steps", type=int, default=0, metavar="N",
                        help="after the timed steps, N more under jax's profiler: the record's 'profile' says where the "
                             "device time went (jaxtrain.observe.step_profile); default none")
    parser.add_argument("--compile-cache", metavar="DIR", default=False,
                        help="compile through the persistent compilation cache in DIR (train.compile_cache); default none")
    args = parser.parse_intermixed_args(argv)
    try:
        host_malloc.reexec_with_jemalloc()  # as the jaxtrain command does, before jax starts
        host_malloc.configure()
        xla_env.set_defaults()  # as the jaxtrain command does
        # --peak-tflops as the config key it stands for, so that a value the key refuses stops here, not after the steps
        peak = [] if args.peak_tflops is None else [f"log.peak_tflops={args.peak_tflops}"]
        cfg = resolve_config(args.experiment, args.mesh, args.rules, [*args.overrides, *peak])
    except UserError as e:
        print(f"throughput: error: {e}", file=sys.stderr)
        return 2

    import jax  # after the config: a bad one fails fast, before any device starts

    from bench_perf import fixed_batch, random_corpus
    from jaxtrain.observe.flops import model_flops_per_token
    from jaxtrain.observe.metrics import resolve_peak
    from jaxtrain.layout import peak_bytes
    from jaxtrain.plan import hlo_report
    from jaxtrain.plan.estimate import estimate, estimate_total
    from jaxtrain import compile_cache
    from jaxtrain.train import build

    with compile_cache.using(args.compile_cache) as cache_dir:
        trainer = build(cfg, random_corpus(cfg.model.vocab_size, tokens=(cfg.train.global_batch + 1) * (cfg.data.seq_len + 1) * 12))
    batch, state = fixed_batch(trainer), trainer.init_state()
    for _ in range(2):
        state, metrics = trainer.train_step(state, batch)
    jax.block_until_ready(state)
    times = []
    for _ in range(args.steps):  # one sync per step: the per-step time, not hidden by queueing
        start = time.perf_counter()
        state, metrics = trainer.train_step(state, batch)
        jax.block_until_ready(state)
        times.append(time.perf_counter() - start)
    step_s = statistics.median(times)
    profile = profile_steps(trainer, state, batch, args.profile_steps) if args.profile_steps else None
    devices = trainer.mesh.size
    # the trainer's MFU denominator: a fixed 989 had read an H200 0.04% high and any other GPU against an H100's peak
    peak, peak_source = resolve_peak(cfg, list(trainer.mesh.devices.flat))
    model_flops = model_flops_per_token(trainer.layout) * trainer.tokens_per_step / step_s / devices
    memory = trainer.train_step.memory_analysis()
    # the program as XLA compiled it for these devices (on a GPU after autotuning: which gemms went to cuBLAS)
    compiled = hlo_report.report(trainer.train_step.as_text(), dict(trainer.mesh.shape))
    measured = (trainer.mesh.devices.flat[0].memory_stats() or {}).get("peak_bytes_in_use")
    print(json.dumps({
        "experiment": args.experiment, "overrides": args.overrides, "mesh": args.mesh, "rules": args.rules,
        "device_kind": trainer.mesh.devices.flat[0].device_kind, "devices": devices,
        "seq_len": cfg.data.seq_len, "global_batch": cfg.train.global_batch, "remat": cfg.model.remat, "dtype": cfg.model.dtype,
        "attention": trainer.cfg.model.attention, "scan_layers": trainer.cfg.model.scan_layers,  # auto resolved
        "compile_s": round(trainer.compile_s, 1), "compile_cache": trainer.compiled.record(cache_dir),
        "step_s": step_s, "tokens_per_s": trainer.tokens_per_step / step_s,
        "tflops_per_device": model_flops / 1e12, "peak_tflops_per_device": None if peak is None else peak / 1e12,
        "peak_source": peak_source, "mfu": None if peak is None else model_flops / peak,
        "estimate_gib_per_device": estimate_total(estimate(trainer.layout)) / 2**30,
        "compiled_gib_per_device": peak_bytes(memory) / 2**30,
        "measured_peak_gib_per_device": None if measured is None else measured / 2**30,
        "loss": float(metrics["loss"]),
        "xla_flags": os.environ.get("XLA_FLAGS", ""),
        "memory_fraction": xla_env.memory_fraction(),  # jax's allocator pool, the share of device memory XLA may take
        "compiled_matmul_flops_per_step": sum(compiled.matmul_flops.values()),
        "library_matmul_flops_per_step": compiled.library_matmul_flops,
        "duplicated_matmul_flops_per_step": compiled.duplicated_matmul_flops,
    } | ({"profile": profile} if profile else {})), flush=True)
    return 0


def profile_steps(trainer, state, batch, steps: int) -> dict:
    """``steps`` more steps under jax's profiler, summarized (their state is not kept: the timed ones came first);
    ``{"error": ...}`` where the profiler or its trace fails, so the record keeps its measurements."""
    import jax

    from jaxtrain.observe import step_profile

    try:
        with tempfile.TemporaryDirectory() as trace_dir:
            with jax.profiler.trace(trace_dir):
                for _ in range(steps):
                    state, _ = trainer.train_step(state, batch)
                jax.block_until_ready(state)
            profile = step_profile.summarize(step_profile.trace_file(trace_dir), trainer.train_step.as_text(), steps,
                                             dict(trainer.mesh.shape), trainer.mesh.devices.flat[0].platform)
    except Exception as e:  # the record's step time and memory stand without it
        print(f"throughput: no profile: {type(e).__name__}: {e}", file=sys.stderr)
        return {"error": f"{type(e).__name__}: {e}"}
    for line in profile.lines():
        print(f"throughput: {line}", file=sys.stderr)
    return profile.to_json()


if __name__ == "__main__":
    sys.exit(main())
