"""jaxtrain/atomic.py: an output appears whole or not at all."""

import os

import pytest

from jaxtrain.atomic import atomic_file


def test_a_failed_rewrite_leaves_the_previous_file_whole_and_nothing_beside_it(tmp_path):
    """A resume rewrites metrics.jsonl (the records past its checkpoint dropped): a write that fails half-way (a full
    disk, a kill) must leave the previous file as it was, not a truncated one or none, and no temporary file."""
    path = tmp_path / "metrics.jsonl"
    path.write_bytes(b"old\n")
    with pytest.raises(OSError), atomic_file(path, "metrics file") as f:
        f.write(b"half")
        raise OSError(28, "No space left on device")
    assert path.read_bytes() == b"old\n" and os.listdir(tmp_path) == ["metrics.jsonl"]
    with atomic_file(path, "metrics file") as f:
        f.write(b"new\n")
    assert path.read_bytes() == b"new\n" and os.listdir(tmp_path) == ["metrics.jsonl"]
    assert path.stat().st_mode & 0o777 == 0o644  # temporary files are created private; the output is not
