"""benchmarks/run.py: discovers bench_*.py modules, merges their keys with the machine description,
keeps other modules' keys on a subset run, and refuses a key two modules claim; and bench_checkpoint runs."""

import json
import shutil
import subprocess
import sys

from conftest import REPO


def _run(bench_dir, *args):
    return subprocess.run([sys.executable, str(bench_dir / "run.py"), *args], capture_output=True, text=True, timeout=120,
                          # no bytecode cache: a module rewritten within the same second must be re-read
                          env={"JAX_PLATFORMS": "cpu", "PATH": "/usr/bin:/bin", "PYTHONDONTWRITEBYTECODE": "1"})


def test_discovers_merges_and_keeps_keys_of_modules_not_run(tmp_path):
    shutil.copy(REPO / "benchmarks" / "run.py", tmp_path / "run.py")
    (tmp_path / "bench_alpha.py").write_text("def run():\n    return {'alpha_s': 1.5}\n")
    (tmp_path / "bench_beta.py").write_text("def run():\n    return {'beta_s': 2}\n")
    out = tmp_path / "results" / "latest.json"
    assert _run(tmp_path).returncode == 0
    first = json.loads(out.read_text())
    assert (first["alpha_s"], first["beta_s"]) == (1.5, 2)
    assert first["machine"]["device_count"] == 8 and first["machine"]["platform"] == "cpu"
    assert first["runs"]["alpha"]["keys"] == ["alpha_s"]

    (tmp_path / "bench_beta.py").write_text("def run():\n    return {'beta_s': 3}\n")
    assert _run(tmp_path, "--only", "beta").returncode == 0
    second = json.loads(out.read_text())
    assert (second["alpha_s"], second["beta_s"]) == (1.5, 3)
    assert list(out.parent.iterdir()) == [out]  # no temporary file left behind

    (tmp_path / "bench_gamma.py").write_text("def run():\n    return {'alpha_s': 9}\n")
    clash = _run(tmp_path, "--only", "gamma")
    assert clash.returncode == 1 and "bench_gamma returns keys another module owns: alpha_s" in clash.stderr
    assert json.loads(out.read_text())["alpha_s"] == 1.5


def test_a_module_asking_for_another_device_count_runs_in_a_process_of_its_own(tmp_path):
    shutil.copy(REPO / "benchmarks" / "run.py", tmp_path / "run.py")
    count = "def run():\n    import jax\n    return {'%s_devices': len(jax.devices())}\n"
    (tmp_path / "bench_shared.py").write_text(count % "shared")
    (tmp_path / "bench_solo.py").write_text("SIMULATED_CPU_DEVICES = 1\n" + count % "solo")
    (tmp_path / "bench_broken.py").write_text("SIMULATED_CPU_DEVICES = 2\ndef run():\n    raise ValueError('broken')\n")
    result = _run(tmp_path)
    assert result.returncode == 1 and "bench_broken in its own process with 2 simulated CPU device(s) exited 1" in result.stderr
    out = json.loads((tmp_path / "results" / "latest.json").read_text())
    assert (out["shared_devices"], out["solo_devices"], out["machine"]["device_count"]) == (8, 1, 8)
    assert out["runs"]["solo"]["keys"] == ["solo_devices"] and "broken" not in out["runs"]
    assert (out["runs"]["solo"]["simulated_cpu_devices"], out["runs"]["shared"]["simulated_cpu_devices"]) == (1, 8)


def test_checkpoint_benchmark_runs_at_a_small_size(tmp_path, monkeypatch):
    """bench_checkpoint drives RunCheckpoints directly, so a change to what it saves can break the module unseen
    (it did once: a dict where a TrainState now goes); here at 16 MiB instead of 1 GiB, writing under tmp_path."""
    monkeypatch.syspath_prepend(str(REPO / "benchmarks"))
    import bench_checkpoint

    monkeypatch.setattr(bench_checkpoint, "STATE_BYTES", 16 << 20)
    monkeypatch.setattr(bench_checkpoint, "REPO", tmp_path)
    results = bench_checkpoint.run()
    assert results["checkpoint_state_bytes"] == (16 << 20) + 4  # the arrays and the int32 step
    assert all(results[key] > 0 for key in ("checkpoint_sync_save_s", "checkpoint_restore_s", "checkpoint_async_loop_s"))
    assert list((tmp_path / "runs").iterdir()) == []  # it deletes what it wrote
    # small replicated arrays: Orbax's default slicing side by side with jaxtrain's threshold, which it puts back.
    # The ratio is a measurement, not asserted: the tests' shared compilation cache may already hold Orbax's slicing
    # programs, so its first save need not compile them (0.92 in one clean-clone run, above 1 in others); what the
    # threshold does is test_checkpoint's (one replica writes a small array whole)
    times = results["small_replicated_save_s"]
    assert set(times) == {"jaxtrain", "orbax_default"} and all(len(t) == 2 and min(t) > 0 for t in times.values())
    assert results["small_replicated_first_save_ratio"] == times["orbax_default"][0] / times["jaxtrain"][0]
    assert bench_checkpoint.checkpoint_lib.REPLICA_SLICE_MIN_BYTES == 1 << 20
