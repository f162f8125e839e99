"""What the persistent compilation cache (``train.compile_cache``) saves a restart, measured side by side in one run:
the ``small`` experiment (8 layers, cpu8 mesh) trained for 2 steps by three ``jaxtrain train`` processes in turn, in
a fresh cache folder: the first with the cache off, the second filling it (cold), the third reading it back (warm),
as a resume after preemption or a re-run of the same command does.

- ``compile_cache_{off,cold,warm}_compile_s``: the steps' compile time each process reported (summary.json).
- ``compile_cache_{off,cold,warm}_process_s``: each process's wall time, start-up and 2 steps included.
- ``compile_cache_compile_speedup``: cold ÷ warm compile time; ``compile_cache_restart_speedup`` the same of the
  process wall times.
- ``compile_cache_cold_overhead``: cold ÷ off compile time, what writing the entries costs the first run.
- ``compile_cache_folder_mib``: the folder's size after the cold run.

Writes under a temporary folder; deletes what it wrote.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
ARGS = ["train.steps=2", "log.every=1", "train.eval_batches=1", "log.progress=false", "checkpoint.every=1000"]


def _train(folder: Path, run: str, cache: str) -> tuple[float, dict]:
    """(process wall seconds, summary.json) of one 2-step `jaxtrain train small` process."""
    env = os.environ | {"XLA_FLAGS": ""}  # the CLI sets the simulated device count itself
    start = time.perf_counter()
    result = subprocess.run([sys.executable, "-m", "jaxtrain.cli", "train", "small", "--mesh", "cpu8", "--run-dir",
                             str(folder / run), *ARGS, f"train.compile_cache={cache}"],
                            cwd=REPO, env=env, capture_output=True, text=True, timeout=1200)
    seconds = time.perf_counter() - start
    if result.returncode != 0:
        raise RuntimeError(f"jaxtrain train small failed: {result.stderr[-2000:]}")
    return seconds, json.loads((folder / run / "summary.json").read_text())


def run() -> dict:
    with tempfile.TemporaryDirectory(dir=REPO / "runs" if (REPO / "runs").is_dir() else None) as tmp:
        folder = Path(tmp)
        cache = folder / "xla"
        off = _train(folder, "off", "false")
        cold = _train(folder, "cold", str(cache))
        size = sum(p.stat().st_size for p in cache.rglob("*") if p.is_file())
        warm = _train(folder, "warm", str(cache))
    record = warm[1]["compile_cache"]
    if record["read_back"] != record["programs"]:
        raise RuntimeError(f"the warm run read back {record['read_back']} of {record['programs']} programs")
    results = {"compile_cache_folder_mib": round(size / 2**20, 1)}
    for name, (process_s, summary) in {"off": off, "cold": cold, "warm": warm}.items():
        results[f"compile_cache_{name}_compile_s"] = round(summary["compile_s"], 2)
        results[f"compile_cache_{name}_process_s"] = round(process_s, 2)
    results["compile_cache_compile_speedup"] = round(cold[1]["compile_s"] / warm[1]["compile_s"], 2)
    results["compile_cache_restart_speedup"] = round(cold[0] / warm[0], 2)
    results["compile_cache_cold_overhead"] = round(cold[1]["compile_s"] / off[1]["compile_s"], 2)
    return results
