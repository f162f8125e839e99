"""Markdown tables of a results file's keys (default benchmarks/results/latest.json), for README: a section for
each module in its ``runs`` with the machine it ran on, bench_perf's comparisons laid out as tables and the rest of
its keys, like every other module's, as key and value.

    python benchmarks/report.py [RESULTS.json]
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from jaxtrain.errors import OneLineParser
from run import DEFAULT_OUT


def _rounded(value):
    """Floats to 4 significant digits, inside lists and dicts too: a table to read, not to compute from."""
    if isinstance(value, float):
        return float(f"{value:.4g}")
    if isinstance(value, dict):
        return {key: _rounded(v) for key, v in value.items()}
    if isinstance(value, list):
        return [_rounded(v) for v in value]
    return value


# bench_perf's keys that print_perf lays out in its two tables
PERF_TABLE_KEYS = {"overhead_ratio", "overhead_ratio_cpu8_fsdp_tp", "overhead_step_s", "matmul_peak_flops", "matmul_peak_flops_one_device",
                   "model_flops_per_s", "model_flops_per_s_one_device", "mfu_vs_matmul_peak", "compile_ratio_32_vs_2_layers",
                   *(f"{kind}_s_{n}_layers" for kind in ("compile", "lower", "step") for n in (2, 8, 32)),
                   "host_gap_ms_per_step", "loop_step_s", "device_step_s", "step_profile", "remat_precision"}


def describe(m: dict) -> str:
    return f"{m['cpu']}, {m['cores']} cores, {m['memory_gib']} GiB, {m['device_count']} x {m['device_kind']} devices, jax {m['jax']}"


def print_keys(r: dict, name: str, laid_out: set[str] = frozenset()) -> None:
    print("| key | value |\n|---|---|")
    for key in (key for key in r["runs"][name]["keys"] if key not in laid_out):
        value = json.dumps(_rounded(r[key]), ensure_ascii=False).replace("|", "\\|")  # a bare | would end the cell
        print(f"| {key} | {value} |")


def print_perf(r: dict) -> None:
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
    if set(r["runs"]["perf"]["keys"]) - PERF_TABLE_KEYS:  # keys added since the tables were laid out, too
        print()
        print_keys(r, "perf", PERF_TABLE_KEYS)


def main(argv: list[str]) -> int:
    parser = OneLineParser(description=__doc__.splitlines()[0])
    parser.add_argument("results", nargs="?", type=Path, default=DEFAULT_OUT, help=f"a results file of run.py (default {DEFAULT_OUT})")
    path = parser.parse_args(argv).results
    try:
        r = json.loads(path.read_text())
    except OSError as e:
        print(f"error: cannot read {path} ({e.strerror})", file=sys.stderr)
        return 2
    except ValueError as e:  # not UTF-8, or not JSON
        print(f"error: {path} is not a results file: not JSON ({e})", file=sys.stderr)
        return 2
    if not (isinstance(r, dict) and isinstance(r.get("runs"), dict) and isinstance(r.get("machine"), dict)):
        print(f"error: {path} is not a results file of benchmarks/run.py (an object with 'machine' and 'runs')", file=sys.stderr)
        return 2
    print(f"The file's last run's machine: {describe(r['machine'])}.")
    for name, run in sorted(r["runs"].items()):
        print(f"\n### {name}: run finished {run['finished']} in {run['seconds']:.0f}s\n")
        # runs before 2026-12-06 kept no machine of their own; the file's machine is the last run's, maybe another
        print(f"Machine: {describe(run['machine'])}.\n" if "machine" in run else "Machine: not recorded for this run.\n")
        if name == "perf":
            print_perf(r)
        else:
            print_keys(r, name)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
