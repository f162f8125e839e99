"""Run the benchmark suite: every ``benchmarks/bench_*.py`` module's ``run() -> dict``, merged with a
machine description into ``benchmarks/results/latest.json`` (written atomically).

    python benchmarks/run.py                  # every module
    python benchmarks/run.py --only perf      # bench_perf.py only; keys of modules not run are kept
    make bench ONLY=perf,checkpoint

Each module owns its keys; two modules returning the same key is an error. Without an accelerator,
jax gets 8 simulated CPU devices (the cpu8 mesh), as in the tests and ``make train``; a module that sets
``SIMULATED_CPU_DEVICES`` to another count runs in a process of its own with that many.
"""

from __future__ import annotations

import argparse
import datetime
import importlib
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

from jaxtrain.cli import simulate_cpu_devices
from jaxtrain.errors import UserError
from jaxtrain.memory import host_malloc

BENCH_DIR = Path(__file__).resolve().parent
REPO = BENCH_DIR.parent
DEFAULT_OUT = BENCH_DIR / "results" / "latest.json"
SIMULATED_CPU_DEVICES = 8


def discover() -> list[str]:
    """Names of the benchmark modules, without the ``bench_`` prefix: ``bench_perf.py`` -> ``perf``."""
    return sorted(p.stem.removeprefix("bench_") for p in BENCH_DIR.glob("bench_*.py"))


def machine() -> dict:
    import jax

    cpu = platform.processor()
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.is_file():
        names = [line.split(":", 1)[1].strip() for line in cpuinfo.read_text().splitlines() if line.startswith("model name")]
        cpu = names[0] if names else cpu
    devices = jax.devices()
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "memory_gib": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1),
        "platform": devices[0].platform,
        "device_kind": devices[0].device_kind,
        "device_count": len(devices),
        "jax": jax.__version__,
        "python": platform.python_version(),
        "host_malloc": host_malloc.allocator(), "host_malloc_kept": host_malloc.kept(),  # README, "Host memory on CPUs"
    }


def run_module(name: str) -> tuple[dict, int]:
    """(bench_{name}.run(), the simulated CPU devices it ran with): in a process of its own when the module asks
    for another count (XLA:CPU gives every device a thread, so idle simulated devices are extra threads on the
    same cores)."""
    module = importlib.import_module(f"bench_{name}")
    devices = getattr(module, "SIMULATED_CPU_DEVICES", SIMULATED_CPU_DEVICES)
    if devices == SIMULATED_CPU_DEVICES:
        return module.run(), devices
    with tempfile.TemporaryDirectory() as folder:
        out = Path(folder) / "keys.json"
        child = subprocess.run([sys.executable, __file__, "--only", name, "--devices", str(devices), "--keys-out", str(out)])
        if child.returncode != 0:
            raise RuntimeError(f"bench_{name} in its own process with {devices} simulated CPU device(s) exited {child.returncode}")
        return json.loads(out.read_text()), devices


def write_atomically(path: Path, results: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile("w", dir=path.parent, suffix=".tmp", delete=False) as f:
        json.dump(results, f, indent=2, sort_keys=True)
        f.write("\n")
    os.replace(f.name, path)


def main(argv: list[str] | None = None) -> int:
    available = discover()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default="", help=f"comma-separated modules to run (of: {', '.join(available)}); default all")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    # run_module's child process: one module, its keys to a file
    parser.add_argument("--devices", type=int, default=SIMULATED_CPU_DEVICES, help=argparse.SUPPRESS)
    parser.add_argument("--keys-out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    chosen = [name.strip() for name in args.only.split(",") if name.strip()] or available
    unknown = sorted(set(chosen) - set(available))
    if unknown:
        print(f"error: --only names unknown benchmark(s) {', '.join(unknown)}; available: {', '.join(available)}", file=sys.stderr)
        return 2

    # before jax starts: the simulated device count and malloc's setting only take effect then; both as `jaxtrain train`
    simulate_cpu_devices(args.devices)
    try:
        host_malloc.reexec_with_jemalloc()
        host_malloc.configure()
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    sys.path.insert(0, str(REPO))
    sys.path.insert(0, str(BENCH_DIR))
    if args.keys_out:
        write_atomically(args.keys_out, importlib.import_module(f"bench_{chosen[0]}").run())
        return 0

    # a subset run keeps the other modules' keys from the previous run
    results = json.loads(args.out.read_text()) if args.out.is_file() and args.only else {}
    runs, failed = results.setdefault("runs", {}), []
    for name in chosen:
        print(f"bench {name} ...", file=sys.stderr, flush=True)
        start = time.perf_counter()
        try:
            found, devices = run_module(name)
        except Exception:  # one broken benchmark must not lose the others' results
            traceback.print_exc()
            failed.append(name)
            continue
        stale = set(runs.get(name, {}).get("keys", []))
        clashes = sorted(k for k in found if k in results and k not in stale)
        if clashes:
            print(f"error: bench_{name} returns keys another module owns: {', '.join(clashes)}", file=sys.stderr)
            failed.append(name)
            continue
        for key in stale:
            results.pop(key, None)
        results.update(found)
        seconds = time.perf_counter() - start
        runs[name] = {"seconds": round(seconds, 1), "keys": sorted(found), "simulated_cpu_devices": devices,
                      "finished": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
        print(f"bench {name}: {len(found)} keys in {seconds:.0f}s", file=sys.stderr, flush=True)
    results["machine"] = machine()
    write_atomically(args.out, results)
    print(f"wrote {args.out}" + (f"; failed: {', '.join(failed)}" if failed else ""), file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
