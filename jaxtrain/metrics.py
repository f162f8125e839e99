"""Metrics records: RUN_DIR/metrics.jsonl and the progress bar (process 0 only)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import tqdm


class MetricsLog:
    def __init__(self, run_dir: Path, total_steps: int, initial_step: int, *, enabled: bool, progress: bool):
        self.enabled = enabled
        self.file = open(run_dir / "metrics.jsonl", "a") if enabled else None
        self.bar = tqdm.tqdm(total=total_steps, initial=initial_step, unit="step", dynamic_ncols=True,
                             disable=not (enabled and progress))

    def write(self, record: dict) -> None:
        if not self.enabled:
            return
        record = {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in record.items()}
        self.file.write(json.dumps(record) + "\n")
        self.file.flush()
        shown = {k: record[k] for k in ("loss", "eval_loss", "tokens_per_s") if record.get(k) is not None}
        if shown:
            self.bar.set_postfix({k: f"{v:.4g}" for k, v in shown.items()}, refresh=False)

    def advance(self, steps: int) -> None:
        self.bar.update(steps)

    def close(self) -> None:
        self.bar.close()
        if self.file:
            self.file.close()
