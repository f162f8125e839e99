"""Markdown tables of bench_perf's keys in a results file (default benchmarks/results/latest.json), for README.

    python benchmarks/report.py [RESULTS.json]
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from run import DEFAULT_OUT


def main(argv: list[str]) -> int:
    r = json.loads(Path(argv[0] if argv else DEFAULT_OUT).read_text())
    m = r["machine"]
    print(f"Machine: {m['cpu']}, {m['cores']} cores, {m['memory_gib']} GiB, {m['device_count']} x {m['device_kind']} "
          f"devices, jax {m['jax']}; run finished {r['runs']['perf']['finished']} in {r['runs']['perf']['seconds']:.0f}s.\n")
    o = r["overhead_step_s"]
    rows = [
        ("overhead_ratio (1 device, dp)", f"{r['overhead_ratio']:.2f}",
         f"hand-written {o['one_device']['hand_s'] * 1e3:.0f} ms / jaxtrain {o['one_device']['jaxtrain_s'] * 1e3:.0f} ms per step"),
        ("overhead_ratio_cpu8_fsdp_tp", f"{r['overhead_ratio_cpu8_fsdp_tp']:.2f}",
         f"hand-written {o['cpu8_fsdp_tp']['hand_s'] * 1e3:.0f} ms / jaxtrain {o['cpu8_fsdp_tp']['jaxtrain_s'] * 1e3:.0f} ms per step"),
        ("matmul_peak_flops (8 devices / 1 device)", f"{r['matmul_peak_flops'] / 1e9:.1f} / {r['matmul_peak_flops_one_device'] / 1e9:.1f} GFLOP/s", "float32 1024^3 matmuls"),
        ("model_flops_per_s (cpu8 / 1 device)", f"{r['model_flops_per_s'] / 1e9:.1f} / {r['model_flops_per_s_one_device'] / 1e9:.1f} GFLOP/s", "same step as the overhead rows"),
        ("mfu_vs_matmul_peak (cpu8)", f"{r['mfu_vs_matmul_peak']:.2f}", "model FLOP/s ÷ measured matmul peak, same run"),
        *[(f"compile_s_{n}_layers", f"{r[f'compile_s_{n}_layers']:.1f} s",
           f"lowering {r[f'lower_s_{n}_layers']:.2f} s, step {r[f'step_s_{n}_layers'] * 1e3:.0f} ms") for n in (2, 8, 32)],
        ("compile_ratio_32_vs_2_layers", f"{r['compile_ratio_32_vs_2_layers']:.2f}", "goal ≤ 1.5"),
        ("host_gap_ms_per_step", f"{r['host_gap_ms_per_step']:.1f} ms",
         f"real loop {r['loop_step_s'] * 1e3:.0f} ms - device-bound {r['device_step_s'] * 1e3:.0f} ms per step"),
        *([("step_profile.overhead (1 device)", f"{p['overhead']:.2f}",
            f"traced {p['traced_step_s'] * 1e3:.0f} ms / untraced {p['step_s'] * 1e3:.0f} ms per step; summary "
            f"{p['summary_s']:.1f} s; span ÷ step {p['span_vs_step']:.2f}")] if (p := r.get("step_profile")) else []),
    ]
    print("| key | value | detail |\n|---|---|---|")
    for row in rows:
        print("| " + " | ".join(row) + " |")
    print("\n| compute dtype | remat | step (ms) | tokens/s | compiled temp memory per device (MiB) |\n|---|---|---|---|---|")
    for row in r["remat_precision"]:
        print(f"| {row['dtype']} | {row['remat']} | {row['step_s'] * 1e3:.0f} | {row['tokens_per_s']:,.0f} | {row['temp_mib_per_device']:.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
