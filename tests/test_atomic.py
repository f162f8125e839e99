"""jaxtrain/atomic.py: an output appears whole or not at all."""

import errno
import os
import socket
import subprocess
import sys

import pytest

from conftest import fill_disk, subprocess_env
from jaxtrain.atomic import atomic_dir, atomic_file
from jaxtrain.errors import UserError


def test_a_failed_rewrite_leaves_the_previous_file_whole_and_nothing_beside_it(tmp_path):
    """A resume rewrites metrics.jsonl (the records past its checkpoint dropped): a write that fails half-way (a full
    disk, a kill) must leave the previous file as it was, not a truncated one or none, and no temporary file."""
    path = tmp_path / "metrics.jsonl"
    path.write_bytes(b"old\n")
    with pytest.raises(OSError), atomic_file(path, "metrics file") as f:
        f.write(b"half")
        raise OSError(errno.EBADF, "Bad file descriptor")  # not a refusal of the disk's: as it was raised
    assert path.read_bytes() == b"old\n" and os.listdir(tmp_path) == ["metrics.jsonl"]
    with pytest.raises(UserError) as refused, atomic_file(path, "metrics file") as f:
        f.write(b"half")
        fill_disk(f"{tmp_path}/")  # a real full disk: the write below fails with ENOSPC
        f.write(b"x" * 65536)
    assert str(refused.value) == (f"could not write metrics file {path}: the disk is full (No space left on device); the file "
                                  "there before is kept; free space there or write elsewhere")
    assert path.read_bytes() == b"old\n" and os.listdir(tmp_path) == ["metrics.jsonl"]
    with atomic_file(path, "metrics file") as f:
        f.write(b"new\n")
    assert path.read_bytes() == b"new\n" and os.listdir(tmp_path) == ["metrics.jsonl"]
    assert path.stat().st_mode & 0o777 == 0o644  # temporary files are created private; the output is not


@pytest.fixture
def disk_events(monkeypatch):
    """The fsyncs (by path) and renames the atomic writers make, in order."""
    events = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd):
        events.append(("sync", os.readlink(f"/proc/self/fd/{fd}")))
        real_fsync(fd)

    def replace(src, dst):
        events.append(("rename", str(src), str(dst)))
        real_replace(src, dst)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    return events


def test_a_finished_file_is_on_disk_before_its_name_and_the_rename_after(tmp_path, disk_events):
    """Renamed unsynced, a power loss can leave the new name over an empty file: the old run config gone, no new one."""
    path = tmp_path / "config.yaml"
    with atomic_file(path, "run config") as f:
        f.write(b"model: {}\n")
    (rename, temp, target), = [e for e in disk_events if e[0] == "rename"]
    assert target == str(path) and disk_events == [("sync", temp), (rename, temp, target), ("sync", str(tmp_path))]


def test_a_finished_directory_is_synced_file_by_file_before_its_rename(tmp_path, disk_events):
    out = tmp_path / "tokenizer"
    with atomic_dir(out, "tokenizer directory") as temp:
        (temp / "sub").mkdir()
        (temp / "sub" / "vocab.json").write_text("{}")
        (temp / "tokenizer.json").write_text("{}")
    renamed = disk_events.index(("rename", str(temp), str(out)))
    assert sorted(path for _, path in disk_events[:renamed]) == sorted(
        [str(temp / "sub" / "vocab.json"), str(temp / "sub"), str(temp / "tokenizer.json"), str(temp)])
    assert disk_events[renamed + 1:] == [("sync", str(tmp_path))] and (out / "sub" / "vocab.json").read_text() == "{}"


def test_a_file_system_that_cannot_sync_a_directory_still_gets_the_output(tmp_path, monkeypatch):
    """Some FUSE and network file systems answer a directory's fsync with EINVAL: the file is written and renamed, so
    the command must not fail after it (nor leave the output missing)."""
    real_fsync = os.fsync

    def fsync(fd):
        if os.path.isdir(f"/proc/self/fd/{fd}"):
            raise OSError(errno.EINVAL, os.strerror(errno.EINVAL))
        real_fsync(fd)
    monkeypatch.setattr(os, "fsync", fsync)
    path = tmp_path / "config.yaml"
    with atomic_file(path, "run config") as f:
        f.write(b"model: {}\n")
    assert path.read_bytes() == b"model: {}\n" and os.listdir(tmp_path) == ["config.yaml"]


def test_a_rerun_removes_what_a_killed_writer_on_this_host_left_and_nothing_else(tmp_path, capsys):
    """A command killed while it wrote (SIGKILL, the out-of-memory killer) leaves its partial output hidden beside the
    output's path; run again, it wrote a second copy beside the first (a token file of a large corpus: tens of GB). The
    next write of that path removes a dead process's, with a note, and keeps a live process's, another host's (whose
    writer this host cannot see) and those named before temporaries named their process."""
    out = tmp_path / "tokens.bin"
    writer = subprocess.Popen([sys.executable, "-c", "import sys, time\nfrom pathlib import Path\nfrom jaxtrain.atomic import atomic_file\n"
                               f"with atomic_file(Path({str(out)!r}), 'token file') as f:\n"
                               "    f.write(b'partial'); f.flush(); print('writing', flush=True); time.sleep(600)"],
                              stdout=subprocess.PIPE, text=True, env=subprocess_env())
    assert writer.stdout.readline() == "writing\n"
    left = [p.name for p in tmp_path.iterdir()]
    writer.kill()
    writer.wait()
    assert len(left) == 1 and left[0].startswith(f".tokens.bin.{socket.gethostname()}-{writer.pid}.")
    dead_dir = tmp_path / f".tokens.bin.{socket.gethostname()}-{writer.pid}.x1_y.tmp"  # an atomic_dir's
    dead_dir.mkdir()
    (dead_dir / "part").write_bytes(b"partial")
    kept = [f".tokens.bin.{socket.gethostname()}-{os.getppid()}.abc.tmp", f".tokens.bin.otherhost-{writer.pid}.abc.tmp",
            ".tokens.bin.abc123.tmp", f".other.bin.{socket.gethostname()}-{writer.pid}.abc.tmp"]
    for name in kept:
        (tmp_path / name).write_bytes(b"not ours to remove")
    with atomic_file(out, "token file") as f:
        f.write(b"whole")
    assert out.read_bytes() == b"whole" and sorted(p.name for p in tmp_path.iterdir()) == sorted([*kept, "tokens.bin"])
    notes = capsys.readouterr().err.splitlines()
    assert sorted(notes) == sorted(f"jaxtrain: note: removed {tmp_path / name}, the partial token file {out} of process {writer.pid} "
                                   "on this host, which stopped before it finished (killed)" for name in (left[0], dead_dir.name))
