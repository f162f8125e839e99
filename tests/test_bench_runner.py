"""benchmarks/run.py: discovers bench_*.py modules, merges their keys with the machine description (each run's own),
keeps other modules' keys on a subset run, refuses a key two modules claim or a return it cannot store, and a bad
--out or --only before any module runs; report.py; the benchmark scripts' argument errors in one line; and
bench_checkpoint and bench_tokenize run."""

import json
import shutil
import subprocess
import sys

import pytest

from conftest import REPO


# no bytecode cache: a module rewritten within the same second must be re-read; this checkout's jaxtrain first on the
# path (a git worktree's editable install points to another checkout)
ENV = {"JAX_PLATFORMS": "cpu", "PATH": "/usr/bin:/bin", "PYTHONDONTWRITEBYTECODE": "1", "PYTHONPATH": str(REPO)}


def _run(bench_dir, *args):
    return subprocess.run([sys.executable, str(bench_dir / "run.py"), *args], capture_output=True, text=True, timeout=120, env=ENV)


def test_discovers_merges_and_keeps_keys_of_modules_not_run(tmp_path):
    shutil.copy(REPO / "benchmarks" / "run.py", tmp_path / "run.py")
    (tmp_path / "bench_alpha.py").write_text("def run():\n    return {'alpha_s': 1.5}\n")
    (tmp_path / "bench_beta.py").write_text("def run():\n    return {'beta_s': 2}\n")
    out = tmp_path / "results" / "latest.json"
    assert _run(tmp_path).returncode == 0
    first = json.loads(out.read_text())
    assert (first["alpha_s"], first["beta_s"]) == (1.5, 2)
    assert first["machine"]["device_count"] == 8 and first["machine"]["platform"] == "cpu"
    assert first["runs"]["alpha"]["keys"] == ["alpha_s"] and first["runs"]["alpha"]["machine"] == first["machine"]

    # as if alpha had run on another machine: a subset run here keeps alpha's machine beside alpha's keys
    elsewhere = first["machine"] | {"cpu": "another machine's CPU"}
    moved = first["runs"] | {"alpha": first["runs"]["alpha"] | {"machine": elsewhere}}
    out.write_text(json.dumps(first | {"machine": elsewhere, "runs": moved}))
    (tmp_path / "bench_beta.py").write_text("def run():\n    return {'beta_s': 3}\n")
    twice = _run(tmp_path, "--only", "beta,beta")
    assert twice.returncode == 0 and twice.stderr.count("bench beta ...") == 1
    second = json.loads(out.read_text())
    assert (second["alpha_s"], second["beta_s"]) == (1.5, 3)
    assert (second["runs"]["alpha"]["machine"], second["runs"]["beta"]["machine"]) == (elsewhere, first["machine"])
    assert second["machine"] == first["machine"]  # the file's: its last run's
    assert list(out.parent.iterdir()) == [out]  # no temporary file left behind
    assert out.stat().st_mode & 0o777 == 0o644  # readable by all, as jaxtrain's own outputs

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


def _bench_dir_with_marking_module(tmp_path):
    """run.py beside a module that leaves a file when it runs, to show that a refused command ran nothing."""
    shutil.copy(REPO / "benchmarks" / "run.py", tmp_path / "run.py")
    (tmp_path / "bench_marker.py").write_text(
        "from pathlib import Path\ndef run():\n    (Path(__file__).parent / 'ran').touch()\n    return {'marker': 1}\n")
    return tmp_path


def test_a_module_returning_what_the_results_file_cannot_hold_fails_alone(tmp_path):
    shutil.copy(REPO / "benchmarks" / "run.py", tmp_path / "run.py")
    (tmp_path / "bench_alist.py").write_text("def run():\n    return [1, 2]\n")
    (tmp_path / "bench_aset.py").write_text("def run():\n    return {'aset_values': {1, 2}}\n")
    (tmp_path / "bench_cheap.py").write_text("def run():\n    return {'cheap_s': 1}\n")
    (tmp_path / "bench_solo.py").write_text("SIMULATED_CPU_DEVICES = 1\ndef run():\n    return {1: 'not a key'}\n")
    result = _run(tmp_path)
    assert result.returncode == 1 and "failed: alist, aset, solo" in result.stderr
    assert "bench_alist.run() returned [1, 2], not a dict with string keys" in result.stderr
    out = json.loads((tmp_path / "results" / "latest.json").read_text())
    assert out["cheap_s"] == 1 and list(out["runs"]) == ["cheap"]


def test_a_bad_out_or_only_is_one_line_before_any_module_runs(tmp_path):
    bench_dir = _bench_dir_with_marking_module(tmp_path)
    (tmp_path / "a_dir").mkdir()
    (tmp_path / "a_file").write_text("")
    (tmp_path / "garbage.json").write_text("garbage\n")
    (tmp_path / "list.json").write_text("[1, 2]\n")
    for args, message in [
            (["--out", str(tmp_path / "a_dir")], f"--out {tmp_path / 'a_dir'} is a directory; give a file path such as"),
            (["--out", str(tmp_path / "a_file" / "results.json")], "cannot make the directory"),
            (["--only", "marker", "--out", str(tmp_path / "garbage.json")], "is not a results file: not JSON (Expecting value"),
            (["--only", "marker", "--out", str(tmp_path / "list.json")], "is JSON but not a results file"),
            (["--only", " , ", "--out", str(tmp_path / "comma.json")], "--only ' , ' names no benchmark; available: marker"),
            (["--only", "nosuch", "--out", str(tmp_path / "unknown.json")], "--only names unknown benchmark(s) nosuch")]:
        result = _run(bench_dir, *args)
        assert (result.returncode, result.stderr.splitlines()) == (2, [result.stderr.strip()]), args
        assert result.stderr.startswith("error: ") and message in result.stderr, args
    assert not (tmp_path / "ran").exists()
    assert (tmp_path / "garbage.json").read_text() == "garbage\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a_dir", "a_file", "bench_marker.py", "garbage.json", "list.json", "run.py"]


def test_benchmark_scripts_refuse_bad_arguments_in_one_line():
    """Each benchmark command's mistakes, as the jaxtrain command's: one line, status 2, before any measurement."""
    for script, *args, message in [
            ("run.py", "--bogus", "run.py: error: unrecognized arguments: --bogus (see 'run.py --help')"),
            ("report.py", "a.json", "b.json", "report.py: error: unrecognized arguments: b.json"),
            ("gpu_h200.py", "--only", "mfu_1b,nosuch", "gpu_h200.py: error: unknown row(s) nosuch; rows: mfu_1b, "),
            ("gpu_h200.py", "--steps", "0", "gpu_h200.py: error: argument --steps: expected a positive integer, got '0'"),
            ("throughput.py", "tiny", "--steps", "0", "throughput.py: error: argument --steps: expected a positive integer, got '0'"),
            ("throughput.py", "tiny", "--peak-tflops=-1", "throughput: error: log.peak_tflops=-1.0 must be greater than 0"),
            ("bench_generate.py", "tiny", "--new-tokens", "0", "bench_generate.py: error: argument --new-tokens: expected a positive"),
            ("bench_hf.py", "nosuch", "bench_hf: error: unknown experiment 'nosuch'; available: "),
            ("finetune_demo.py", "--seeds", "0,x", "finetune_demo.py: error: argument --seeds: expected comma-separated integers")]:
        result = subprocess.run([sys.executable, str(REPO / "benchmarks" / script), *args], capture_output=True, text=True,
                                timeout=120, env=ENV)
        assert (result.returncode, result.stderr.splitlines()) == (2, [result.stderr.strip()]), (script, args, result.stderr[-2000:])
        assert result.stderr.startswith(message), (script, args, result.stderr)


def _report(*args):
    return subprocess.run([sys.executable, str(REPO / "benchmarks" / "report.py"), *args], capture_output=True, text=True,
                          timeout=120, env=ENV)


def test_report_shows_every_module_run_and_refuses_a_file_that_is_not_results_in_one_line(tmp_path):
    latest = json.loads((REPO / "benchmarks" / "results" / "latest.json").read_text())
    results = tmp_path / "tokenize_only.json"
    tokenize_machine = latest["machine"] | {"cpu": "the tokenize run's CPU"}
    results.write_text(json.dumps({
        "machine": latest["machine"], "tokenize_ratio": 1.11349, "tokenize_detail": {"rounds": [0.5, 2 / 3]}, "sft_fill_packed": 0.9,
        "runs": {"tokenize": {"seconds": 11.8, "keys": ["tokenize_detail", "tokenize_ratio"], "finished": "2026-12-05T06:00:00+00:00",
                              "machine": tokenize_machine},
                 "sft": {"seconds": 2, "keys": ["sft_fill_packed"], "finished": "2026-12-01T06:46:32+00:00"}}}))
    report = _report(str(results))
    assert report.returncode == 0, report.stderr
    assert "### tokenize: run finished 2026-12-05T06:00:00+00:00 in 12s\n\nMachine: the tokenize run's CPU, 2 cores" in report.stdout
    assert "### sft: run finished 2026-12-01T06:46:32+00:00 in 2s\n\nMachine: not recorded for this run." in report.stdout
    assert "perf" not in report.stdout
    assert '| tokenize_detail | {"rounds": [0.5, 0.6667]} |\n| tokenize_ratio | 1.113 |' in report.stdout

    # the checked-in results: perf's own tables, and a section for each of the other modules
    full = _report(str(REPO / "benchmarks" / "results" / "latest.json"))
    assert full.returncode == 0, full.stderr
    assert "| overhead_ratio (1 device, dp) |" in full.stdout and "| compute dtype | remat |" in full.stdout
    assert "| cross_entropy | {\"speedup\": " in full.stdout  # perf's keys outside its tables are not left out
    assert all(f"\n### {name}: run finished " in full.stdout for name in latest["runs"])

    (tmp_path / "garbage.json").write_text("garbage")
    (tmp_path / "list.json").write_text("[]")
    for path, message in [(tmp_path / "missing.json", "cannot read {} (No such file or directory)"),
                          (tmp_path / "garbage.json", "{} is not a results file: not JSON (Expecting value"),
                          (tmp_path / "list.json", "{} is not a results file of benchmarks/run.py")]:
        refused = _report(str(path))
        assert (refused.returncode, refused.stderr.splitlines()) == (2, [refused.stderr.strip()]), path
        assert refused.stderr.startswith("error: " + message.format(path)), path


def test_tokenize_benchmark_runs_its_rounds_at_a_small_size(monkeypatch):
    """More than one round: `jaxtrain tokenize` never overwrites a token file, so each round needs an --out of its own
    (the module failed in round 2 for days, unseen)."""
    monkeypatch.syspath_prepend(str(REPO / "benchmarks"))
    import bench_tokenize

    for name, value in {"INPUT_BYTES": 20_000, "TRAIN_BYTES": 20_000, "VOCAB": 300, "ROUNDS": 2, "SINGLE_FILE_VOCAB": 300}.items():
        monkeypatch.setattr(bench_tokenize, name, value)
    results = bench_tokenize.run()
    assert results["tokenize_vocab"] == 300 and results["tokenize_tokens"] > 1000
    peaks = results["tokenize_single_file_peak_rss_mb"]  # of the one and the 4 copies, both commands (each a Python process)
    assert list(peaks) == ["tokenize", "train_tokenizer"]
    assert all(len(by_size) == 2 and min(by_size.values()) > 20 for by_size in peaks.values())
    assert all(results[key] > 0 for key in ("tokenize_mb_per_s", "tokenize_ratio", "tokenize_ratio_vs_fast", "train_start_encode_speedup"))
    assert list(results["train_start_encode_s"]) == ["child", "in_process"]  # each round's tokens checked equal in the script


def test_tokenize_benchmark_reports_a_failing_command_by_its_stderr_not_its_thousands_of_arguments(monkeypatch):
    monkeypatch.syspath_prepend(str(REPO / "benchmarks"))
    import bench_tokenize

    fails = "import sys; print('noise', file=sys.stderr); sys.exit('jaxtrain: error: the reason')"
    command = [sys.executable, "-c", fails, *(f"/usr/lib/python3/module{i}.py" for i in range(600)), "--out", "/tmp/round1.bin"]
    with pytest.raises(RuntimeError) as failure:
        bench_tokenize._seconds(command)
    message = str(failure.value)
    assert message.endswith("exited 1; its stderr ends:\nnoise\njaxtrain: error: the reason")
    assert message.startswith(f"{sys.executable} -c ") and "--out /tmp/round1.bin exited 1" in message and len(message) < 500
