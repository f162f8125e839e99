"""``jaxtrain plot RUN_DIR [RUN_DIR ...] --out FILE.png``: loss, tokens/s, MFU and memory over steps,
several runs overlaid, from their ``metrics.jsonl``."""

from __future__ import annotations

import logging
from pathlib import Path

from jaxtrain.atomic import atomic_file, sigterm_cleans_up
from jaxtrain.errors import UserError
from jaxtrain.observe.records import is_skip_record, read_records

# matplotlib warns at import about its own cache folders (a home not writable on a cluster node, a font cache
# to build): two lines that say nothing about the plot, quieted for the import only
_matplotlib_log = logging.getLogger("matplotlib")
_level = _matplotlib_log.level
_matplotlib_log.setLevel(logging.ERROR)
try:
    import matplotlib

    matplotlib.use("Agg")  # files only; no display on clusters or in CI
    import matplotlib.pyplot as plt
finally:
    _matplotlib_log.setLevel(_level)

MOE_PANEL = "mixture of experts"
# (title, y label, [(record key, line style)]); a run draws every key it has records for
PANELS = (
    ("loss", "nats per token", [("loss", "-"), ("eval_loss", "o--")]),
    ("throughput", "tokens/s", [("tokens_per_s", "-")]),
    ("MFU", "model FLOPs utilisation", [("mfu", "-")]),
    ("memory", "GiB", [("memory_in_use_gib", "-"), ("memory_peak_gib", ":")]),
    (MOE_PANEL, "router loss terms, dropped share", [("moe_aux_loss", "-"), ("moe_z_loss", "--"),
                                                                ("moe_dropped_fraction", ":")]),
)


def read_metrics(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        raise UserError(f"{path} does not exist; give run directories written by 'jaxtrain train'")
    records = read_records(path)
    if not records:
        raise UserError(f"{path} holds no records yet; plot the run once it has logged a step (every log.every steps)")
    return records


def series(records: list[dict], key: str) -> tuple[list[int], list[float]]:
    points = [(r["step"], r[key]) for r in records if r.get(key) is not None and not is_skip_record(r)]
    return [s for s, _ in points], [v for _, v in points]


def panels_for(runs) -> list[tuple]:
    """The PANELS to draw for these runs' records: the mixture-of-experts panel only when a run has MoE metrics."""
    return [p for p in PANELS if p[0] != MOE_PANEL or any(series(records, "moe_aux_loss")[0] for records in runs)]


IMAGE_SUFFIXES = (".png", ".pdf", ".svg")  # what the charts are written as (jaxtrain plot --out, jaxtrain plan --plot)


def check_image_path(flag: str, out: Path) -> None:
    if out.suffix.lower() not in IMAGE_SUFFIXES:
        raise UserError(f"{flag} {out} must end in {', '.join(IMAGE_SUFFIXES[:-1])} or {IMAGE_SUFFIXES[-1]}")
    if out.is_dir():
        raise UserError(f"{flag} {out} is an existing directory; give a file name, e.g. {out / ('plot' + out.suffix)}")


def save_figure(fig, out: Path, **savefig_args) -> None:
    """Write ``fig`` to ``out`` (checked by cli.check_output_path) whole or not at all, making the directories it
    needs, and close it. A path the early checks pass can still fail here (a file system that refuses it, e.g.
    /proc): one line."""
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        with sigterm_cleans_up(), atomic_file(out, "image") as f:  # killed while writing, it left its temporary file
            fig.savefig(f, format=out.suffix[1:].lower(), **savefig_args)
    except OSError as e:
        raise UserError(f"cannot write {out}: {e.strerror or e}; give another path") from None
    finally:
        plt.close(fig)


def plot_runs(run_dirs: list[Path], out: Path) -> None:
    check_image_path("--out", out)
    runs = {str(d): read_metrics(d) for d in run_dirs}
    panels = panels_for(runs.values())
    rows = (len(panels) + 1) // 2
    fig, axes = plt.subplots(rows, 2, figsize=(12, 4 * rows), constrained_layout=True, squeeze=False)
    for ax in axes.flat[len(panels):]:
        ax.remove()
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for ax, (title, ylabel, keys) in zip(axes.flat, panels):
        for i, (name, records) in enumerate(runs.items()):
            for key, style in keys:
                steps, values = series(records, key)
                if steps:
                    ax.plot(steps, values, style, color=colors[i % len(colors)], label=f"{name} {key}")
        ax.set(title=title, xlabel="step", ylabel=ylabel)
        ax.grid(alpha=0.3)
        if ax.has_data():
            ax.legend(fontsize="small")
    save_figure(fig, out, dpi=100)
