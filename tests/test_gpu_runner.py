"""The one command for a lent GPU machine (benchmarks/gpu_h200.sh), offline: it installs the carried wheels into
a site folder, stops at once when jax sees no GPU, and the row runner keeps to its time budget. The whole path
with real wheels and tiny rows on CPU is `make gpu-dry-run` (it downloads, so it is not a test)."""

import json
import subprocess
import sys
import zipfile
from pathlib import Path

from conftest import REPO, subprocess_env

SCRIPT = REPO / "benchmarks" / "gpu_h200.sh"


def _wheel(folder, name="carried_probe", version="0.1"):
    """A minimal pure-Python wheel, as `make gpu-wheels` would carry one."""
    dist = f"{name}-{version}.dist-info"
    path = folder / f"{name}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as whl:
        whl.writestr(f"{name}/__init__.py", "CARRIED = True\n")
        whl.writestr(f"{dist}/METADATA", f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
        whl.writestr(f"{dist}/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        whl.writestr(f"{dist}/RECORD", "")
    return path


def test_installs_the_wheels_then_stops_without_a_gpu(tmp_path):
    wheels, site, out = tmp_path / "whl", tmp_path / "site", tmp_path / "out"
    wheels.mkdir()
    _wheel(wheels)
    env = subprocess_env() | {
        "PY": sys.executable, "WHEELS": str(wheels), "SITE": str(site), "OUT": str(out), "JAX_PLATFORMS": "cpu"}
    result = subprocess.run(["bash", str(SCRIPT)], env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 3, result.stderr
    assert "jax sees no GPU" in result.stderr
    assert (site / "carried_probe" / "__init__.py").is_file()  # installed with --target, no index
    assert not out.exists()  # no row ran, nothing measured on the CPU


def test_rows_past_the_budget_are_skipped_and_recorded(tmp_path):
    out = tmp_path / "rows.jsonl"
    env = subprocess_env() | {"JAX_PLATFORMS": "cpu"}
    result = subprocess.run([sys.executable, str(REPO / "benchmarks" / "gpu_h200.py"), "--tiny", "--budget-s", "0",
                             "--only", "mfu_1b,attention_xla_1b", "--out", str(out)],
                            env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert records[0]["row"] == "environment" and records[0]["platform"] == "cpu"
    assert [(r["row"], r["status"]) for r in records[1:]] == [("mfu_1b", "skipped"), ("attention_xla_1b", "skipped")]


def test_tiny_rows_of_each_benchmark_script_run_and_the_warm_row_reads_the_cold_rows_programs(tmp_path):
    """The rows a lent GPU runs first compile on its minutes: each script (bench_generate, bench_hf, throughput
    with the runner's compilation cache folder) with tiny shapes on CPU, as `make gpu-dry-run` runs them all."""
    out = tmp_path / "rows.jsonl"
    rows = ["generate_1b_batch_1", "hf_import_export_1b", "compile_cache_cold_1b", "compile_cache_warm_1b"]
    result = subprocess.run([sys.executable, str(REPO / "benchmarks" / "gpu_h200.py"), "--tiny", "--steps", "1",
                             "--only", ",".join(rows), "--out", str(out)],
                            env=subprocess_env() | {"JAX_PLATFORMS": "cpu"}, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    records = {r["row"]: r for r in map(json.loads, out.read_text().splitlines())}
    assert [records[row]["status"] for row in rows] == ["ok"] * 4, result.stdout[-3000:]
    cold, warm = records["compile_cache_cold_1b"]["compile_cache"], records["compile_cache_warm_1b"]["compile_cache"]
    assert cold["folder"] == warm["folder"] and cold["read_back"] == 0 and warm["read_back"] == warm["programs"] >= 2
    assert not Path(cold["folder"]).exists()  # the runner removes its folder
    # MFU against the trainer's peak (metrics.resolve_peak), not a fixed 989 TFLOP/s whatever the device
    assert records["compile_cache_cold_1b"]["peak_source"] == "measured float32 matmul on 1 CPU devices"


def test_a_row_adds_its_xla_flags_to_the_callers(monkeypatch):
    """dynamic_slice_fusion_1b turns XLA's fusion back on over jaxtrain's default (its record's xla_flags shows what
    the row ran with); a tiny row that needs several devices gets 8 simulated CPUs."""
    monkeypatch.syspath_prepend(str(REPO / "benchmarks"))
    import gpu_h200

    monkeypatch.setenv("XLA_FLAGS", "--xla_dump_to=/tmp/d")
    rows = {row.name: row for row in gpu_h200.ROWS}
    assert rows["dynamic_slice_fusion_1b"].env(tiny=False)["XLA_FLAGS"] == \
        "--xla_dump_to=/tmp/d --xla_gpu_enable_dynamic_slice_fusion=true"
    assert rows["mfu_1b"].env(tiny=False)["XLA_FLAGS"] == "--xla_dump_to=/tmp/d"
    assert rows["pipeline_1b"].env(tiny=True)["XLA_FLAGS"] == "--xla_dump_to=/tmp/d --xla_force_host_platform_device_count=8"


def test_a_row_dies_with_the_runner(tmp_path):
    """A runner killed from outside (SIGKILL: the device tool's limit, a test's timeout) takes its row along:
    once, an orphaned tiny row kept a CI machine's core busy for an hour."""
    import os
    import signal
    import time

    runner = subprocess.Popen([sys.executable, str(REPO / "benchmarks" / "gpu_h200.py"), "--tiny", "--only", "mfu_1b",
                               "--out", str(tmp_path / "rows.jsonl")],
                              env=subprocess_env() | {"JAX_PLATFORMS": "cpu", "TMPDIR": str(tmp_path)},  # the killed runner's cache folder
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    children = Path(f"/proc/{runner.pid}/task/{runner.pid}/children")
    deadline = time.monotonic() + 60
    while not (rows := [int(pid) for pid in children.read_text().split() if "throughput.py" in _cmdline(pid)]) \
            and time.monotonic() < deadline:  # the environment probe, a short process, comes first
        time.sleep(0.05)
    assert rows, "the runner started no row within 60 s"
    runner.send_signal(signal.SIGKILL)
    runner.wait()
    deadline = time.monotonic() + 10
    while (alive := [pid for pid in rows if _state(pid) not in ("gone", "Z")]) and time.monotonic() < deadline:
        time.sleep(0.05)
    for pid in alive:  # leave no process behind, even when the test fails
        os.kill(pid, signal.SIGKILL)
    assert not alive, f"row process(es) {alive} outlived the runner"


def _cmdline(pid: str) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_text()
    except FileNotFoundError:
        return ""


def _state(pid: int) -> str:
    """The process's state letter (Z: a zombie, dead but not yet reaped), or "gone"."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return "gone"
