"""``make finetune-demo`` (benchmarks/finetune_demo.py) with two seeds: held-out exact match of greedy answers
before and after LoRA fine-tuning a tiny random Hugging Face Llama to reverse words.

- ``finetune_demo_accuracy_before``: the highest of the seeds' base accuracies.
- ``finetune_demo_accuracy_after``: the lowest of the seeds' accuracies with the adapters.
- ``finetune_demo_steps``: optimizer steps per fine-tuning; ``finetune_demo_wall_s``: the longest seed's wall time
  (base, data, training through the CLI, both scorings). Each seed's own figures under ``finetune_demo_detail``.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import finetune_demo

SEEDS = (0, 1)


def run() -> dict:
    with tempfile.TemporaryDirectory(prefix="finetune_demo_") as tmp:
        results = [finetune_demo.report(finetune_demo.run(Path(tmp) / f"seed{seed}", seed)) for seed in SEEDS]
    return {"finetune_demo_accuracy_before": max(r["accuracy_before"] for r in results),
            "finetune_demo_accuracy_after": min(r["accuracy_after"] for r in results),
            "finetune_demo_steps": results[0]["steps"], "finetune_demo_wall_s": max(r["wall_s"] for r in results),
            "finetune_demo_detail": results}
