"""Reading a run's ``metrics.jsonl`` and which of its checkpoints are committed: for ``jaxtrain plot``, the trainer's
resume and the adapter pool, without importing jax or matplotlib."""

from __future__ import annotations

import json
from pathlib import Path

from jaxtrain.errors import UserError

CHECKPOINTS_DIR = "checkpoints"  # in the run directory
SKIP_KEYS = ("skipped_spike", "skipped_nonfinite")  # a skipped update's record, beside its step's own


def is_skip_record(record: dict) -> bool:
    """A skipped update's record: its step's loss and grad norm again, which the dashboards and the plot take from the
    step records alone (one value a step, every log.every steps; a skip at a logged step was drawn twice)."""
    return any(key in record for key in SKIP_KEYS)


def read_records(path: Path) -> list[dict]:
    """The records of a ``metrics.jsonl``, less a partial last line (no newline yet: a live run still writing it, or
    one killed while it did); a damaged line is one line naming it."""
    try:
        lines = path.read_text(encoding="utf-8").split("\n")  # after the last newline: "" or a partial last line
    except UnicodeDecodeError:
        raise UserError(f"{path} is not UTF-8 text; the file is damaged, or not a run's metrics") from None
    records = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            if number == len(lines):  # no newline after it: a record still being written, or cut short by a kill
                break
            # e.lineno counts within the one line parsed, so always 1
            raise UserError(f"{path} line {number} is not JSON ({e.msg}); the file is damaged") from None
        # every record the trainer writes is an object with its step (a list or a record without one was a traceback)
        if not (isinstance(record, dict) and isinstance(record.get("step"), int)):
            raise UserError(f"{path} line {number} is not a metrics record (a JSON object with an integer 'step'); "
                            "the file is damaged, or not a run's metrics")
        records.append(record)
    return records


def committed_steps(directory: Path) -> list[int]:
    """The steps of the complete checkpoints in a checkpoints directory (Orbax renames a save's temporary directory
    to the step once it is committed); looks only."""
    if not directory.is_dir():
        return []
    return sorted(int(p.name) for p in directory.iterdir() if p.name.isdigit() and p.is_dir())
