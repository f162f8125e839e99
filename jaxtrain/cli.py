"""Command line: ``jaxtrain train EXPERIMENT [--mesh FILE] [--rules NAME] [--run-dir DIR] [--devices N] [key=value ...]``.

jax is imported only after the arguments are read, because the simulated CPU device count must be
in XLA_FLAGS before jax starts.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import sys
from pathlib import Path

from jaxtrain import config as config_lib
from jaxtrain import distributed
from jaxtrain.errors import UserError

DEFAULT_CPU_DEVICES = 8
_DEVICE_FLAG = "--xla_force_host_platform_device_count"


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, exit status 2, no usage dump
        print(f"jaxtrain: error: {message} (see '{self.prog} --help')", file=sys.stderr)
        sys.exit(2)


def simulate_cpu_devices(count: int | None) -> None:
    """Ask XLA for ``count`` CPU devices (ignored by GPU backends). Keeps an existing setting when
    ``count`` is None."""
    flags = os.environ.get("XLA_FLAGS", "")
    if count is None and _DEVICE_FLAG in flags:
        return
    flags = re.sub(rf"{_DEVICE_FLAG}=\d+", "", flags).strip()
    os.environ["XLA_FLAGS"] = f"{flags} {_DEVICE_FLAG}={count or DEFAULT_CPU_DEVICES}".strip()


def _positive_int(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return int(text)


def resolve_config(experiment: str, mesh: str | None, rules: str | None, overrides: list[str]) -> config_lib.Config:
    cfg = config_lib.load_experiment(experiment)
    if mesh:
        cfg = dataclasses.replace(cfg, mesh=config_lib.load_mesh_file(mesh))
    if rules:
        cfg = dataclasses.replace(cfg, rules=rules)
    cfg = config_lib.apply_overrides(cfg, overrides)
    config_lib.check(cfg)
    return cfg


def cmd_train(args) -> int:
    cfg = resolve_config(args.experiment, args.mesh, args.rules, args.overrides)
    run_dir = Path(args.run_dir or Path("runs") / Path(args.experiment).stem)
    if args.params_only and not args.init_from:
        raise UserError("--params-only needs --init-from PATH (the checkpoint whose parameters to start from)")
    distributed.initialize(args.coordinator, args.num_processes, args.process_id)  # before jax sees devices
    from jaxtrain import checkpoint as checkpoint_lib  # starts jax
    from jaxtrain import train as train_lib

    try:
        train_lib.train(cfg, run_dir, init_from=args.init_from and Path(args.init_from), params_only=args.params_only)
    except checkpoint_lib.Preempted as e:
        print(f"jaxtrain: {e}", file=sys.stderr)
        return checkpoint_lib.PREEMPTED_EXIT_STATUS
    return 0


def cmd_checkpoints(args) -> int:
    from jaxtrain import checkpoint as checkpoint_lib  # starts jax

    print(checkpoint_lib.format_table(checkpoint_lib.describe(Path(args.run_dir))))
    return 0


def cmd_plot(args) -> int:
    from jaxtrain import plot

    run_dirs = [Path(d) for d in args.run_dirs]
    out = Path(args.out) if args.out else run_dirs[0] / "metrics.png"
    plot.plot_runs(run_dirs, out)
    print(f"jaxtrain: wrote {out}", file=sys.stderr)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="jaxtrain", description="Train large language models with JAX on device meshes.")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    train = sub.add_parser("train", help="train an experiment; resumes a run directory that has checkpoints")
    train.add_argument("experiment", help="a name under experiments/ (e.g. tiny) or a path to an experiment .py file")
    train.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides, e.g. train.steps=100 optim.lr=3e-4")
    train.add_argument("--mesh", help="mesh file (a path, or a name under experiments/meshes/)")
    train.add_argument("--rules", help="sharding rule set (a name under sharding_rules/, or a path)")
    train.add_argument("--run-dir", help="run directory (default runs/EXPERIMENT)")
    train.add_argument("--devices", type=_positive_int, help=f"simulated CPU devices when there is no accelerator (default {DEFAULT_CPU_DEVICES})")
    train.add_argument("--init-from", metavar="PATH", help="start from another run's checkpoint (run dir or step dir); "
                       "ignored once this run has checkpoints of its own")
    train.add_argument("--params-only", action="store_true", help="with --init-from: take only the parameters (fresh optimizer, step 0)")
    train.add_argument("--coordinator", metavar="HOST:PORT", help="multi-process: address of process 0's coordinator")
    train.add_argument("--num-processes", type=_positive_int, metavar="N", help="multi-process: number of processes")
    train.add_argument("--process-id", type=int, metavar="I", help="multi-process: this process's index, 0..N-1")
    train.set_defaults(func=cmd_train)
    checkpoints = sub.add_parser("checkpoints", help="list a run's checkpoints: step, size, time, complete, mesh/rules")
    checkpoints.add_argument("run_dir", metavar="RUN_DIR")
    checkpoints.set_defaults(func=cmd_checkpoints)
    plot = sub.add_parser("plot", help="one PNG of loss, eval loss, tokens/s, MFU and memory over steps; runs overlaid")
    plot.add_argument("run_dirs", nargs="+", metavar="RUN_DIR")
    plot.add_argument("--out", metavar="FILE.png", help="output image (default RUN_DIR/metrics.png of the first run)")
    plot.set_defaults(func=cmd_plot)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    # key=value overrides may come before or after options, which argparse leaves over as extras
    args, extras = parser.parse_known_args(argv)
    unknown = [e for e in extras if e.startswith("-") or not hasattr(args, "overrides")]
    if unknown:
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    args.overrides = [*getattr(args, "overrides", []), *extras]
    simulate_cpu_devices(getattr(args, "devices", None))
    try:
        return args.func(args)
    except UserError as e:
        print(f"jaxtrain: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
