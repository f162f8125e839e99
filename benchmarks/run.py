"""Run the benchmark suite: every ``benchmarks/bench_*.py`` module's ``run() -> dict``, merged with a
machine description into ``benchmarks/results/latest.json`` (written atomically; each module's ``runs`` entry keeps
the machine it ran on).

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

from jaxtrain.atomic import atomic_file
from jaxtrain.cli import simulate_cpu_devices
from jaxtrain.errors import OneLineParser, UserError
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


def keys_of(name: str) -> dict:
    """bench_{name}.run()'s keys, checked here so that a module returning something else fails alone instead of
    the merge or the final write failing for every module."""
    found = importlib.import_module(f"bench_{name}").run()
    if not (isinstance(found, dict) and all(isinstance(key, str) for key in found)):
        raise TypeError(f"bench_{name}.run() returned {str(found)[:200]}, not a dict with string keys")
    json.dumps(found, sort_keys=True)  # a TypeError now for a value the results file cannot hold
    return found


def run_module(name: str) -> tuple[dict, int]:
    """(bench_{name}.run(), the simulated CPU devices it ran with): in a process of its own when the module asks
    for another count (XLA:CPU gives every device a thread, so idle simulated devices are extra threads on the
    same cores)."""
    module = importlib.import_module(f"bench_{name}")
    devices = getattr(module, "SIMULATED_CPU_DEVICES", SIMULATED_CPU_DEVICES)
    if devices == SIMULATED_CPU_DEVICES:
        return keys_of(name), devices
    with tempfile.TemporaryDirectory() as folder:
        out = Path(folder) / "keys.json"
        child = subprocess.run([sys.executable, __file__, "--only", name, "--devices", str(devices), "--keys-out", str(out)])
        if child.returncode != 0:
            raise RuntimeError(f"bench_{name} in its own process with {devices} simulated CPU device(s) exited {child.returncode}")
        return json.loads(out.read_text()), devices


def write_atomically(path: Path, results: dict) -> None:
    with atomic_file(path, "--out") as f:
        f.write((json.dumps(results, indent=2, sort_keys=True) + "\n").encode())


def check_out(path: Path, keep_keys: bool) -> dict:
    """The results to start from (``path``'s when ``keep_keys``), or a UserError before any module runs: a path
    that cannot take the results file would otherwise lose the whole suite's results at its end."""
    if path.is_dir():
        raise UserError(f"--out {path} is a directory; give a file path such as {path / DEFAULT_OUT.name}")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise UserError(f"--out {path}: cannot make the directory {path.parent} ({e.strerror})") from None
    if not (keep_keys and path.exists()):
        return {}
    try:
        results = json.loads(path.read_text())
    except OSError as e:
        raise UserError(f"--out {path} cannot be read ({e.strerror}); give another --out") from None
    except ValueError as e:  # not UTF-8, or not JSON
        raise UserError(f"--out {path} is not a results file: not JSON ({e}); give another --out, or remove it "
                        "to start afresh") from None
    if not (isinstance(results, dict) and isinstance(results.get("runs", {}), dict)):
        raise UserError(f"--out {path} is JSON but not a results file (an object whose 'runs' is an object); give "
                        "another --out, or remove it to start afresh")
    return results


def main(argv: list[str] | None = None) -> int:
    available = discover()
    parser = OneLineParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", help=f"comma-separated modules to run (of: {', '.join(available)}); default all")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    # run_module's child process: one module, its keys to a file
    parser.add_argument("--devices", type=int, default=SIMULATED_CPU_DEVICES, help=argparse.SUPPRESS)
    parser.add_argument("--keys-out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    # a name given twice runs once (perf takes 12 minutes)
    chosen = available if args.only is None else list(dict.fromkeys(name.strip() for name in args.only.split(",") if name.strip()))
    unknown = sorted(set(chosen) - set(available))
    try:
        if not chosen:
            raise UserError(f"--only {args.only!r} names no benchmark; available: {', '.join(available)}")
        if unknown:
            raise UserError(f"--only names unknown benchmark(s) {', '.join(unknown)}; available: {', '.join(available)}")
        # a subset run keeps the other modules' keys from the previous run
        results = {} if args.keys_out else check_out(args.out, keep_keys=args.only is not None)
        # before jax starts: the simulated device count and malloc's setting only take effect then; both as `jaxtrain train`
        simulate_cpu_devices(args.devices)
        host_malloc.reexec_with_jemalloc()
        host_malloc.configure()
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    sys.path.insert(0, str(REPO))
    sys.path.insert(0, str(BENCH_DIR))
    if args.keys_out:
        write_atomically(args.keys_out, keys_of(chosen[0]))
        return 0

    runs, failed, finished = results.setdefault("runs", {}), [], []
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
        finished.append(name)
        print(f"bench {name}: {len(found)} keys in {seconds:.0f}s", file=sys.stderr, flush=True)
    # each run keeps the machine it ran on: a subset run on another machine must not relabel the kept keys
    results["machine"] = machine()
    for name in finished:
        runs[name]["machine"] = results["machine"]
    write_atomically(args.out, results)
    print(f"wrote {args.out}" + (f"; failed: {', '.join(failed)}" if failed else ""), file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
