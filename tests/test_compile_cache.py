"""The persistent compilation cache (train.compile_cache): a re-run of the same command reads its compiled steps
back instead of compiling them and trains bit-identically; off, the run uses no cache; a default folder that cannot
be written is a warning, not a stop; the planner's --hlo-report compiles past any cache."""

import json
from pathlib import Path

from conftest import REPO, run_cli, small_config, with_

from jaxtrain import compile_cache
from jaxtrain.plan import estimate as plan_lib
from jaxtrain.layout import make_layout
from jaxtrain.train import build, train

ARGS = ["train.steps=3", "log.every=1", "train.eval_batches=1", "train.global_batch=8", "data.seq_len=32",
        "model.num_layers=2", "model.d_model=64", "log.progress=false"]


def _losses(run_dir: Path) -> list[float]:
    return [r["loss"] for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines()) if "loss" in r]


def _cache_record(run_dir: Path) -> dict | None:
    return json.loads((run_dir / "summary.json").read_text())["compile_cache"]


def test_a_rerun_reads_its_compiled_steps_back_and_trains_identically(tmp_path):
    folder = tmp_path / "cache"
    for run in ("first", "second"):
        result = run_cli("train", "tiny", "--run-dir", str(tmp_path / run), *ARGS, f"train.compile_cache={folder}", cwd=REPO)
        assert result.returncode == 0, result.stderr[-3000:]
    first, second = _cache_record(tmp_path / "first"), _cache_record(tmp_path / "second")
    assert first["folder"] == str(folder) and first["read_back"] == 0 and first["programs"] >= 2  # train and eval steps
    assert second == first | {"read_back": first["programs"]}
    assert f"{first['programs']} of {first['programs']} programs read back from the compilation cache {folder}" in result.stderr
    assert any(folder.iterdir())
    assert _losses(tmp_path / "second") == _losses(tmp_path / "first") and len(_losses(tmp_path / "first")) == 3


def test_off_uses_no_cache_and_an_unwritable_default_folder_is_a_warning(corpus, tmp_path, monkeypatch, capsys):
    cfg = with_(small_config(), train={"steps": 1})
    trainer = build(cfg, corpus)
    train(with_(cfg, train={"compile_cache": False}), tmp_path / "off", trainer)
    assert _cache_record(tmp_path / "off") is None
    assert "(no compilation cache)" in capsys.readouterr().err

    not_a_folder = tmp_path / "file"
    not_a_folder.write_text("")
    monkeypatch.setenv("XDG_CACHE_HOME", str(not_a_folder))  # the default folder would be file/jaxtrain/xla
    train(cfg, tmp_path / "unwritable", trainer)
    assert _cache_record(tmp_path / "unwritable") is None and _losses(tmp_path / "unwritable")
    warning = [line for line in capsys.readouterr().err.splitlines() if "warning" in line]
    assert warning == [f"jaxtrain: warning: compiling without a cache: cannot write to {not_a_folder}/jaxtrain/xla "
                       "(NotADirectoryError: Not a directory); set train.compile_cache=PATH to a writable folder, or false"]


def test_directory_follows_the_setting(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert compile_cache.directory("auto") == compile_cache.directory(True) == tmp_path / "xdg" / "jaxtrain" / "xla"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert compile_cache.directory("auto") == Path.home() / ".cache" / "jaxtrain" / "xla"
    assert compile_cache.directory("~/elsewhere") == Path.home() / "elsewhere"
    assert compile_cache.directory(False) is None


def test_the_cache_setting_jax_had_is_back_after_the_block(tmp_path):
    """Compiles after a command's block (another command in the same process, a notebook's next cell) read and wrote
    the folder the block named."""
    import jax

    before = jax.config.jax_compilation_cache_dir, jax.config.jax_enable_compilation_cache
    for setting in (str(tmp_path), False):
        with compile_cache.using(setting):
            assert jax.config.jax_compilation_cache_dir == (str(tmp_path) if setting else None)
        assert (jax.config.jax_compilation_cache_dir, jax.config.jax_enable_compilation_cache) == before


def test_the_hlo_report_compiles_past_the_cache(tmp_path):
    """XLA writes its warnings only while compiling: a report from a program read back would miss them."""
    layout = make_layout(small_config())
    counts = {}
    for hlo_report in (False, True):  # the first also compiles the small programs lowering runs, once a process
        with compile_cache.using(str(tmp_path)), compile_cache.counting() as counts[hlo_report]:
            plan_lib.compile_truth(layout, hlo_report=hlo_report)
    assert counts[False].lookups >= 1 and counts[True].lookups == 0


def _compile_in(folder: Path):
    """Compile a small function with the cache in ``folder`` (every program written: no minimum compile time); the
    compile's cache count, and the folder's entries by size."""
    import jax
    import jax.numpy as jnp

    minimum = jax.config.jax_persistent_cache_min_compile_time_secs
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    try:
        with compile_cache.using(str(folder)), compile_cache.counting() as count:
            jax.jit(lambda x: jnp.sin(x) @ x.T + 1)(jnp.ones((4, 4))).block_until_ready()
    finally:
        jax.config.update("jax_persistent_cache_min_compile_time_secs", minimum)
        jax.clear_caches()  # the next compile goes to the folder again
    return count, {p.name: p.stat().st_size for p in folder.iterdir()}


def test_a_cache_entry_cut_short_is_replaced_and_none_is_left_cut_short(tmp_path, monkeypatch):
    """A QA report: jax writes an entry in place, so a process killed while writing one (preempted during its first
    compile's write) or a full disk left it cut short; every later run warned that it could not read it and compiled
    again, for good, as jax never writes over an entry. Now it is written under a temporary name and renamed, and the
    compile after a damaged entry replaces it."""
    import os
    import warnings

    folder = tmp_path / "cache"
    _, whole = _compile_in(folder)
    for name, size in whole.items():
        os.truncate(folder / name, size // 2)
    with warnings.catch_warnings(record=True):  # jax's warning for each entry it cannot read
        missed, repaired = _compile_in(folder)
    assert missed.lookups >= 1 and missed.hits == 0 and repaired.keys() == whole.keys()  # written over, not beside
    read_back, _ = _compile_in(folder)
    assert read_back.hits == read_back.lookups >= 1

    def cut_short(cache, key, value):  # the disk fills up half-way through the entry
        (cache.path / f"{key}-cache").write_bytes(value[: len(value) // 2])
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(compile_cache, "_put_in_place", cut_short)
    with warnings.catch_warnings(record=True):  # jax's warning for the failed write
        _compile_in(tmp_path / "full")
    assert list((tmp_path / "full").iterdir()) == []
