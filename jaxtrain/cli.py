"""Command line: ``jaxtrain train EXPERIMENT [--mesh FILE] [--rules NAME] [--run-dir DIR] [--devices N] [key=value ...]``,
and ``plan``, ``checkpoints``, ``adapters``, ``plot``, ``tokenize``, ``train-tokenizer``, ``export-hf``; ``jaxtrain generate RUN_DIR|HF_DIR --prompt TEXT``.

jax is imported only after the arguments are read, because the simulated CPU device count and jaxtrain's default
XLA settings (xla_env.py) must be in the environment, and glibc's malloc set to keep freed memory on CPUs
(memory/host_malloc.py), before jax starts.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import os
import re
import sys
import time
from pathlib import Path

from jaxtrain import config as config_lib
from jaxtrain import distributed, xla_env
from jaxtrain.adapt import adapters
from jaxtrain.atomic import sigterm_cleans_up
from jaxtrain.config import SamplingConfig
from jaxtrain.errors import OneLineParser, UserError, positive_int
from jaxtrain.interop import hf_config, hf_weights, peft
from jaxtrain.memory import host_malloc

DEFAULT_CPU_DEVICES = 8
ONE_DEVICE_MESH = "gpu1"  # the shipped mesh of one device (every axis 1): generate's on a CPU
INTERRUPTED_EXIT_STATUS = 130  # checkpoint.INTERRUPTED_EXIT_STATUS, without importing jax before the arguments are read
_DEVICE_FLAG = "--xla_force_host_platform_device_count"
_DEVICES_HELP = (f"simulated CPU devices when there is no accelerator (default: the mesh's size, at most {DEFAULT_CPU_DEVICES}; "
                 f"{DEFAULT_CPU_DEVICES} when an axis is -1)")


def simulate_cpu_devices(count: int | None, default: int = DEFAULT_CPU_DEVICES) -> None:
    """Ask XLA for ``count`` CPU devices (ignored by GPU backends). When ``count`` is None: keeps an existing
    setting, else asks for ``default``."""
    flags = os.environ.get("XLA_FLAGS", "")
    if count is None and _DEVICE_FLAG in flags:
        return
    flags = re.sub(rf"{_DEVICE_FLAG}=\d+", "", flags).strip()
    os.environ["XLA_FLAGS"] = f"{flags} {_DEVICE_FLAG}={count or default}".strip()


def default_cpu_devices(mesh_cfg: config_lib.MeshConfig, num_processes: int | None) -> int:
    """Simulated CPU devices of ``jaxtrain train``, ``generate`` and ``export-hf`` without --devices: as many as
    this process's part of the mesh holds, so a 1-device mesh runs on one device, whose XLA:CPU thread pool has a
    thread per core (a thread per device when there are more: README, "--devices"). At most DEFAULT_CPU_DEVICES,
    which a mesh with a -1 axis also gets: a cluster's mesh on a CPU is still the one-line error that asks for
    --devices. Processes: ``num_processes`` (--num-processes), else those srun or mpirun started (the flags left out)."""
    processes = num_processes or distributed.cluster_tasks()
    local = mesh_cfg.ici.as_tuple() if processes > 1 else mesh_cfg.ici.as_tuple() + mesh_cfg.dcn.as_tuple()
    return DEFAULT_CPU_DEVICES if -1 in local else min(math.prod(local), DEFAULT_CPU_DEVICES)


def _positive_int32(text: str) -> int:
    """A count that jax's C++ reads as int32 (--num-processes): a larger one was a TypeError traceback from jax's
    coordinator."""
    value = positive_int(text)
    if value > config_lib.INT32_MAX:
        raise argparse.ArgumentTypeError(f"expected a positive integer of at most {config_lib.INT32_MAX}, got {text!r}")
    return value


def _simulated_devices(text: str) -> int:
    """--devices: simulated CPU devices, at most as many as XLA:CPU compiles a program for (``config.CPU_MAX_DEVICES``):
    more took minutes and gigabytes to start and to stop (16,384: over 3 minutes on a 2-core VM) before the compile
    failed with a traceback (past int32, XLA printed its whole flag table)."""
    value = positive_int(text)
    if value > config_lib.CPU_MAX_DEVICES:
        raise argparse.ArgumentTypeError(f"expected at most {config_lib.CPU_MAX_DEVICES} simulated CPU devices, as many as "
                                         f"XLA:CPU compiles a program for, got {text!r}")
    return value


def check_output_path(flag: str, path: Path) -> None:
    """One line before any work where ``path`` cannot be created: a part of it that exists is a file, or a
    directory this user cannot write in (an existing directory, a run to resume, needs no write access above it)."""
    for part in path.parents:
        if part.exists():
            if not part.is_dir():
                raise UserError(f"{flag} {path}: {part} is a file, not a directory; give a path inside a directory")
            if not path.is_dir() and not os.access(part, os.W_OK | os.X_OK):
                if os.statvfs(part).f_flag & os.ST_RDONLY:  # access(2) says EROFS, which "permission denied" hid
                    raise UserError(f"{flag} {path}: {part} is on a read-only file system; give a path on a writable one")
                raise UserError(f"{flag} {path}: this user cannot write in {part} (permission denied); "
                                "give a path in a directory you can write")
            return


def resolve_config(experiment: str, mesh: str | None, rules: str | None, overrides: list[str],
                   hf_dir: Path | None = None, *, weights: bool = True) -> config_lib.Config:
    """The experiment's config with the mesh file, rule set and overrides applied; with ``hf_dir`` (a Hugging
    Face model), the model's shape from its config.json, checked against the model keys the user gave (and, with
    ``weights``, its weight files against that shape)."""
    cfg = config_lib.load_experiment(experiment)
    if mesh:
        cfg = dataclasses.replace(cfg, mesh=config_lib.load_mesh_file(mesh))
    if rules:
        cfg = dataclasses.replace(cfg, rules=rules)
    given = hf_config.given_model_keys(cfg.model, overrides) if hf_dir else set()
    cfg = config_lib.apply_overrides(cfg, overrides)
    if hf_dir:
        cfg = dataclasses.replace(cfg, model=hf_config.model_config(hf_dir, cfg.model, given, cfg.data.seq_len))
    config_lib.check(cfg)
    if hf_dir and weights:
        hf_weights.check_dir(hf_dir, cfg.model)
    for note in config_lib.unused_key_notes(cfg):
        print(f"jaxtrain: note: {note}", file=sys.stderr)
    return cfg


def default_run_dir(experiment: str) -> Path:
    """runs/EXPERIMENT; for a run's own config.yaml given as the experiment (beside its metrics or checkpoints), that
    run's directory: the command resumes it (runs/config was a new run beside it). A config.yaml of the user's elsewhere
    is an experiment like any other, whose run is not written into its folder."""
    path = Path(experiment)
    if path.name == "config.yaml" and ((path.parent / "metrics.jsonl").is_file() or (path.parent / "checkpoints").is_dir()):
        return path.parent
    return Path("runs") / path.stem


def cmd_train(args) -> int:
    hf_dir = Path(args.init_from) if args.init_from and hf_config.is_hf_dir(Path(args.init_from)) else None
    cfg = resolve_config(args.experiment, args.mesh, args.rules, args.overrides, hf_dir)
    simulate_cpu_devices(args.devices, default=default_cpu_devices(cfg.mesh, args.num_processes))
    run_dir = Path(args.run_dir or default_run_dir(args.experiment))
    check_output_path("--run-dir", run_dir)
    if args.params_only and not args.init_from:
        raise UserError("--params-only needs --init-from PATH (the checkpoint whose parameters to start from)")
    distributed.initialize(args.coordinator, args.num_processes, args.process_id)  # before jax sees devices
    distributed.check_same_start(config_lib.flatten(config_lib.to_dict(config_lib.with_absolute_paths(cfg))) | {
        "--run-dir": str(run_dir.absolute()), "--num-processes": args.num_processes,
        "--init-from": args.init_from and str(Path(args.init_from).absolute()), "--params-only": args.params_only})
    from jaxtrain import checkpoint as checkpoint_lib  # starts jax
    from jaxtrain import train as train_lib

    with distributed.failing_fast():  # an error on one process of a job ends the job at once (but these, handled here)
        try:
            train_lib.train(cfg, run_dir, init_from=args.init_from and Path(args.init_from), params_only=args.params_only)
        except checkpoint_lib.Preempted as e:  # SIGTERM (143), or Ctrl-C in the training loop (130)
            print(f"jaxtrain: {e}", file=sys.stderr)
            return e.status
        except distributed.LostPeer as e:
            print(f"jaxtrain: error: {e}", file=sys.stderr, flush=True)
            sys.stdout.flush()
            # out now: jax's shutdown would wait on the gone process at its barrier, then abort with C++ logs
            os._exit(distributed.LOST_PEER_EXIT_STATUS)
        except checkpoint_lib.Interrupted as e:  # a second Ctrl-C in the loop: out now
            print(f"jaxtrain: {e}", file=sys.stderr, flush=True)
            sys.stdout.flush()
            os._exit(checkpoint_lib.INTERRUPTED_EXIT_STATUS)  # a save's background thread would hold the process until written
        except KeyboardInterrupt:  # before the first step: compile, data, restore
            newest = max(checkpoint_lib.committed_steps(run_dir / checkpoint_lib.CHECKPOINTS_DIR), default=None)
            again = "start" if newest is None else f"resume from step {newest}"
            print(f"jaxtrain: interrupted before the first step, no checkpoint written; run the same command again to {again}",
                  file=sys.stderr)
            return checkpoint_lib.INTERRUPTED_EXIT_STATUS
    return 0


def _process_index() -> int:
    import jax  # starts jax: call it after distributed.initialize

    return jax.process_index()


def cmd_export_hf(args) -> int:
    run_dir, out = Path(args.run_dir), Path(args.out)
    cfg = config_lib.weights_on_device(config_lib.load_run_config(run_dir))
    if args.mesh:
        cfg = dataclasses.replace(cfg, mesh=config_lib.load_mesh_file(args.mesh))
    if args.rules:
        cfg = dataclasses.replace(cfg, rules=args.rules)
    if out.exists():
        raise UserError(f"--out {out} already exists; give a new directory (export-hf never overwrites)")
    check_output_path("--out", out)
    if args.adapter_only and not cfg.model.lora.rank:
        raise UserError(f"--adapter-only exports a LoRA run's adapters, and {run_dir} trained every parameter (model.lora.rank=0)")
    simulate_cpu_devices(args.devices, default=default_cpu_devices(cfg.mesh, args.num_processes))
    distributed.initialize(args.coordinator, args.num_processes, args.process_id)  # before jax sees devices
    import jax  # starts jax

    # one process: a SIGTERM (a scheduler's time limit) exits through the export's cleanup, not leaving OUT.partial's
    # shards behind; with several, jax's preemption notifier owns SIGTERM
    with sigterm_cleans_up() if jax.process_count() == 1 else contextlib.nullcontext(), distributed.failing_fast():
        if cfg.model.lora.rank:
            from jaxtrain.adapt import lora

            lora.export(cfg, run_dir, out, step=args.step, adapter_only=args.adapter_only,
                        dtype=args.dtype or ("float32" if args.adapter_only else "bfloat16"))
        else:
            from jaxtrain.interop import hf_export

            hf_export.export(cfg, run_dir, out, step=args.step, dtype=args.dtype or "bfloat16")
    if cfg.model.moe.num_experts and cfg.model.moe.dispatch == "capacity" and _process_index() == 0:
        print(f"jaxtrain: note: {run_dir} routed with model.moe.dispatch=capacity, where a token past an expert's "
              f"slots (capacity_factor {cfg.model.moe.capacity_factor:g}) skips it; transformers' mixture-of-experts models "
              "route every token (dropless), so the exported model's logits differ wherever the run dropped tokens; a run "
              "trained with model.moe.dispatch=dropless exports exactly", file=sys.stderr, flush=True)
    return 0


def plan_device_count(mesh_cfg: config_lib.MeshConfig, devices: int | None) -> int:
    """Devices the plan simulates: --devices when given, else the mesh file's product, where a -1 inside a
    node (ici) fills an 8-GPU node; a -1 across nodes (dcn) needs --devices."""
    if devices:
        return devices
    if -1 in mesh_cfg.dcn.as_tuple():
        raise UserError("the mesh has a -1 (fill) axis across nodes (dcn), so its size is unknown; pass --devices N, the total device count")
    per_node = math.prod(mesh_cfg.ici.as_tuple())
    return math.prod(mesh_cfg.dcn.as_tuple()) * (8 if per_node < 0 else per_node)


def cmd_plan(args) -> int:
    hf_dir = Path(args.init_from) if args.init_from else None
    if hf_dir is not None and not hf_config.is_hf_dir(hf_dir):
        raise UserError(f"--init-from {hf_dir} is not a Hugging Face model directory (config.json); plan takes the model's shape "
                        "from one (its config.json alone will do)")
    # a plan needs the shape alone: config.json without the weights plans a model before it is downloaded
    cfg = resolve_config(args.experiment, args.mesh, args.rules, args.overrides, hf_dir, weights=False)
    if hf_dir is None and hf_config.has_placeholder_shape(cfg.model):
        print(f"jaxtrain: note: experiment {args.experiment} sets no model shape of its own (it takes one from --init-from "
              "HF_DIR): this plans a placeholder model; give --init-from HF_DIR (its config.json will do)", file=sys.stderr)
    if args.device_memory is not None and not 0 < args.device_memory < math.inf:
        raise UserError(f"--device-memory {args.device_memory:g} must be a positive, finite size in GiB per device, e.g. 80")
    if not 0 <= args.headroom < 1:
        raise UserError(f"--headroom {args.headroom:g} must be in [0, 1): the share of device memory kept free, e.g. 0.1")
    if args.tokens_per_s is not None and not 0 < args.tokens_per_s < math.inf:
        raise UserError(f"--tokens-per-s {args.tokens_per_s:g} must be a positive throughput (tokens per second, all devices)")
    if args.tokens_per_s is not None and args.gpu is None:
        raise UserError("--tokens-per-s needs --gpu NAME: the MFU it takes is a share of that GPU's peak FLOP/s")
    if args.plot:
        from jaxtrain.observe.plot import check_image_path

        check_image_path("--plot", Path(args.plot))
        check_output_path("--plot", Path(args.plot))
    count = plan_device_count(cfg.mesh, args.devices)
    simulate_cpu_devices(count)
    # jax's CUDA plugin, where installed, checks the CUDA driver as jax starts; a plan needs only its compiler
    os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")
    from jaxtrain.plan import estimate as plan_lib  # starts jax

    memory = None if args.device_memory is None else int(args.device_memory * plan_lib.GIB)
    plan = plan_lib.make_plan(cfg, device_memory=memory, gpu=args.gpu, headroom=args.headroom, tokens_per_s=args.tokens_per_s,
                              devices=plan_lib.target_devices(count, args.gpu), hlo_report=args.hlo_report)
    print(json.dumps(plan.to_json(), indent=2) if args.json else plan_lib.render(plan))
    if args.plot:
        plan_lib.plot(plan, Path(args.plot))
        print(f"jaxtrain: wrote {args.plot}", file=sys.stderr)
    return 0


def cmd_generate(args) -> int:
    sampling = config_lib.SamplingConfig(args.max_new_tokens, args.temperature, args.top_p, args.seed)
    if sampling.problems():
        raise UserError("; ".join(sampling.problems()))
    path = Path(args.path)
    if not (hf_config.is_hf_dir(path) or (path / "config.yaml").is_file()):
        if peft.is_adapter_dir(path):  # the line below did not say that an adapter goes with --adapter
            raise UserError(f"{path} is a PEFT adapter ({peft.CONFIG_FILE}), not a model: give its base model and the adapter, "
                            f"jaxtrain generate BASE_DIR --adapter {path}")
        raise UserError(f"{path} is neither a run directory (config.yaml) nor a Hugging Face model directory (config.json); "
                        "give the --run-dir of a training run or a model directory")
    run_cfg = None if hf_config.is_hf_dir(path) else config_lib.load_run_config(path)
    if args.adapter:
        adapters.check_adapter(Path(args.adapter))
    if args.adapter and run_cfg is not None and run_cfg.model.lora.rank:
        raise UserError(f"{path} is a LoRA run, and `jaxtrain generate {path}` already applies its adapters on its base; drop "
                        f"--adapter, or give the base the adapter {args.adapter} was trained on")
    # the model's context: a Hugging Face model's, that of the one a run was initialised from (RUN_DIR/hf) or the longer
    # sequences the run trained on, else the positions a run trained from scratch learnt (a QA report: --max-new-tokens
    # 100000 on a 256-position run decoded on)
    if run_cfg is None:
        context, context_key = hf_config.context_length(path) or (None, None)
    else:
        trained = hf_config.trained_context(run_cfg.model, run_cfg.data.seq_len)
        context, context_key = hf_config.context_length(path / hf_config.RUN_SUBDIR, trained) or trained

    def check_context(prompt_tokens: int | None) -> None:
        """None: before the prompt is encoded (and jax started), the new tokens alone."""
        if context is None or (prompt_tokens or 0) + sampling.max_new_tokens <= context:
            return
        limit = f"the model's context of {context} positions ({context_key})"
        if prompt_tokens is None:
            raise UserError(f"--max-new-tokens {sampling.max_new_tokens} runs past {limit} before any prompt; give fewer than "
                            f"{context}, less the prompt's tokens")
        if prompt_tokens >= context:
            raise UserError(f"the prompt is {prompt_tokens} tokens and fills {limit}, leaving no room for a new token; shorten the prompt")
        raise UserError(f"--max-new-tokens {sampling.max_new_tokens} with a prompt of {prompt_tokens} tokens runs past {limit}; "
                        f"give --max-new-tokens {context - prompt_tokens} or less")

    check_context(None)
    if run_cfg is not None and run_cfg.model.moe.num_experts and run_cfg.model.moe.dispatch == "capacity":
        print(f"jaxtrain: note: {path} routed with model.moe.dispatch=capacity; generation routes every token to its experts "
              "(dropless: a token's capacity drops depend on later tokens, which decoding has not made yet), as its export-hf does",
              file=sys.stderr, flush=True)
    # on a CPU, without --mesh or --devices: one device, whose thread pool has every core, rather than the simulated
    # devices of the run's mesh, each of which gathered the weights it computes with (a 1 GB model on 8 of them decoded
    # 0.9 tokens/s in 8.8 GB, on one 9.7 tokens/s in 2.8 GB)
    one_cpu_device = args.mesh is None and args.devices is None and host_malloc.computes_on_cpu()
    mesh = config_lib.load_mesh_file(args.mesh) if args.mesh else run_cfg.mesh if run_cfg else config_lib.Config().mesh
    simulate_cpu_devices(args.devices, default=1 if one_cpu_device else default_cpu_devices(mesh, None))
    import jax
    import numpy as np

    from jaxtrain import compile_cache
    from jaxtrain import generate as generate_lib  # starts jax

    # (a process whose devices were set before, as the tests' 8, keeps the run's mesh)
    mesh_file = ONE_DEVICE_MESH if one_cpu_device and jax.device_count() == 1 else args.mesh

    # a run's own train.compile_cache; a Hugging Face model directory the default folder
    cache = run_cfg.train.compile_cache if run_cfg else "auto"
    codec = generate_lib.load_codec(path, chat=args.chat)
    prompt = codec[0](args.prompt)  # a prompt too long or out of the vocabulary is refused before any weight is read
    check_context(len(prompt))
    generate_lib.check_request(path, mesh_file, args.rules, 1, len(prompt), sampling.max_new_tokens)  # its cache, from the configs
    with compile_cache.using(cache) as folder, compile_cache.counting() as compiled:
        loaded = generate_lib.load(path, mesh_file, args.rules, codec=codec)
        if args.adapter:
            from jaxtrain.adapt import lora

            loaded = lora.with_adapter(loaded, Path(args.adapter))
        out = generate_lib.generate(loaded, np.array([prompt], np.int32), sampling, loaded.stops)
    new = out.tokens[0]
    text = loaded.decode(new) if args.chat else args.prompt + loaded.decode(new, prompt)
    print(text, flush=True)
    decode = f"{out.decode_tokens_per_s:,.1f} tokens/s" if out.decode_tokens_per_s else "no decoding steps"
    print(f"jaxtrain: {1 + out.decode_steps} new tokens; prefill {out.prompt_tokens} tokens in {out.prefill_s:.3f} s "
          f"({out.prefill_tokens_per_s:,.0f} tokens/s); decode {decode}; compile {out.compile_s:.1f} s "
          f"({compile_cache.describe(compiled.record(folder))}); on {loaded.mesh.size} x {jax.devices()[0].platform}, mesh "
          f"{config_lib.describe_axes(dict(loaded.mesh.shape))}", file=sys.stderr)
    return 0


def cmd_checkpoints(args) -> int:
    from jaxtrain import checkpoint as checkpoint_lib  # starts jax

    rows = checkpoint_lib.describe(Path(args.run_dir))
    if not rows:  # a header over nothing says less than this line
        print(f"jaxtrain: {Path(args.run_dir) / checkpoint_lib.CHECKPOINTS_DIR} holds no checkpoint yet", file=sys.stderr)
        return 0
    print(checkpoint_lib.format_table(rows))
    return 0


def cmd_adapters(args) -> int:
    print(adapters.format_pool(adapters.pool(Path(args.dir))))
    return 0


def cmd_plot(args) -> int:
    from jaxtrain.observe import plot

    run_dirs = [Path(d) for d in args.run_dirs]
    for run_dir in run_dirs:
        config_lib.check_run_dir(run_dir)
    out = Path(args.out) if args.out else run_dirs[0] / "metrics.png"
    check_output_path("--out", out)
    plot.plot_runs(run_dirs, out)
    print(f"jaxtrain: wrote {out}", file=sys.stderr)
    return 0


def cmd_tokenize(args) -> int:
    from jaxtrain.data import token_file

    check_output_path("--out", Path(args.out))
    start = time.perf_counter()
    sidecar = token_file.write_token_file(args.inputs, args.tokenizer, args.out)
    seconds = time.perf_counter() - start
    print(f"jaxtrain: wrote {args.out}: {sidecar['tokens']} tokens ({sidecar['dtype']}) from {sidecar['documents']} documents "
          f"in {seconds:.1f}s; sidecar {token_file.sidecar_path(Path(args.out))}", file=sys.stderr)
    return 0


def cmd_train_tokenizer(args) -> int:
    from jaxtrain.data import tokenizer

    check_output_path("--out", Path(args.out))
    trained = tokenizer.train_tokenizer(args.inputs, args.vocab_size, args.out)
    short = f" (of the {args.vocab_size} asked for: the text has no more pairs to merge)" if trained.vocab_size < args.vocab_size else ""
    print(f"jaxtrain: wrote {args.out}: byte-level BPE, vocabulary {trained.vocab_size}{short}, "
          f"end-of-text {tokenizer.END_OF_TEXT} = {trained.end_of_text}", file=sys.stderr)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(prog="jaxtrain", description="Train large language models with JAX on device meshes.")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=OneLineParser)
    train = sub.add_parser("train", help="train an experiment; resumes a run directory that has checkpoints")
    train.add_argument("experiment", help="a name under jaxtrain/experiments/ (e.g. tiny), or a path to an experiment .py file "
                                          "or a .yaml file of config sections (a run's config.yaml resumes that run)")
    # default=[]: argparse counts a '*' positional without a default as required, and named key=value as missing
    train.add_argument("overrides", nargs="*", default=[], metavar="key=value",
                       help="config overrides, e.g. train.steps=100 optim.lr=3e-4")
    train.add_argument("--mesh", help="mesh file (a path, or a name under jaxtrain/experiments/meshes/)")
    train.add_argument("--rules", help="sharding rule set (a name under jaxtrain/sharding_rules/, or a path)")
    train.add_argument("--run-dir", help="run directory (default runs/EXPERIMENT; for a run's config.yaml, that run's directory)")
    train.add_argument("--devices", type=_simulated_devices, help=_DEVICES_HELP)
    train.add_argument("--init-from", metavar="PATH", help="start from another run's checkpoint (run dir or step dir), or from a "
                       "Hugging Face model directory (its config.json gives the model's shape); ignored once this run has checkpoints of its own")
    train.add_argument("--params-only", action="store_true", help="with --init-from: take only the parameters (fresh optimizer, step 0)")
    _add_process_flags(train)
    train.set_defaults(func=cmd_train)
    plan = sub.add_parser("plan", help="per-device memory of an experiment on a target mesh: estimate, compiled truth, fixes")
    plan.add_argument("experiment", help="a name under jaxtrain/experiments/ (e.g. llama3_8b), or a path to an experiment .py "
                                         "or .yaml file")
    plan.add_argument("overrides", nargs="*", default=[], metavar="key=value", help="config overrides, e.g. train.microbatches=auto")
    plan.add_argument("--mesh", help="the target mesh file (a path, or a name under jaxtrain/experiments/meshes/)")
    plan.add_argument("--rules", help="sharding rule set (a name under jaxtrain/sharding_rules/, or a path)")
    plan.add_argument("--devices", type=_simulated_devices,
                      help="devices to simulate (default: the mesh's size; an ici -1 fills an 8-GPU node)")
    plan.add_argument("--init-from", metavar="HF_DIR", help="the model's shape from a Hugging Face model directory's config.json, "
                      "as `train --init-from` takes it (the weights need not be there)")
    memory = plan.add_mutually_exclusive_group()
    memory.add_argument("--gpu", help="target GPU, for its memory and peak FLOP/s (h100, h200, a100, a100-40gb, l4); h100, h200 "
                        "and a100 are compiled for with XLA's GPU compiler where jax's CUDA plugin is installed")
    memory.add_argument("--device-memory", type=float, metavar="GiB", help="memory per device in GiB")
    plan.add_argument("--headroom", type=float, default=0.10, help="share of device memory kept free (default 0.10)")
    plan.add_argument("--tokens-per-s", type=float, metavar="N", help="target throughput: report the MFU it needs (with --gpu)")
    plan.add_argument("--json", action="store_true", help="print the plan as JSON")
    plan.add_argument("--hlo-report", action="store_true", help="also read the compiled program: collectives (kind, bytes, mesh "
                      "axes, async, overlapped) next to step_cost's prediction, fusions, attention kernel, XLA's warnings")
    plan.add_argument("--plot", metavar="FILE.png", help="write a stacked per-device memory chart of the plan and suggestions")
    plan.set_defaults(func=cmd_plan)
    generate = sub.add_parser("generate", help="continue a prompt with a run's latest checkpoint or a Hugging Face model: "
                              "KV-cache decoding, jitted, sharded with the run's rules; prints the text and tokens/s")
    generate.add_argument("path", metavar="RUN_DIR|HF_DIR", help="a training run directory (config.yaml and checkpoints/) or a "
                          "Hugging Face model directory (config.json, safetensors; computed in float32)")
    # type=str: text, where empty is a value (an empty user message with --chat), not an unset variable
    generate.add_argument("--prompt", required=True, type=str, help="text (byte-level runs: its UTF-8 bytes; Hugging Face models: their "
                          "tokenizer.json); token ids, e.g. '12 7 99', for models without a tokenizer")
    generate.add_argument("--chat", action="store_true", help="the prompt is one user message rendered with the tokenizer's chat "
                          "template (instruction-tuned models, data.format=sft runs); prints the answer up to the end of its turn")
    generate.add_argument("--max-new-tokens", type=int, default=SamplingConfig.max_new_tokens, metavar="N",
                          help=f"tokens to generate (default {SamplingConfig.max_new_tokens})")
    generate.add_argument("--temperature", type=float, default=SamplingConfig.temperature, metavar="T",
                          help="0: greedy (default); above 0: sample from softmax(logits / T)")
    generate.add_argument("--top-p", type=float, default=SamplingConfig.top_p, metavar="P",
                          help="sample among the most likely tokens whose probability reaches P (default 1: all)")
    generate.add_argument("--seed", type=int, default=SamplingConfig.seed, help="sampling seed (default 0)")
    generate.add_argument("--adapter", metavar="RUN_DIR|PEFT_DIR", help="LoRA adapters to apply to the model: a LoRA run trained "
                          "on it, or a PEFT adapter directory (adapter_config.json); merged into the weights before generating")
    generate.add_argument("--mesh", help="mesh file to generate on (default: the run's mesh; HF_DIR: every device on fsdp)")
    generate.add_argument("--rules", help="sharding rule set (default: the run's; HF_DIR: fsdp_tp)")
    generate.add_argument("--devices", type=_simulated_devices, help=_DEVICES_HELP)
    generate.set_defaults(func=cmd_generate)
    checkpoints = sub.add_parser("checkpoints", help="list a run's checkpoints: step, size, time, committed, mesh/rules")
    checkpoints.add_argument("run_dir", metavar="RUN_DIR", help="a training run's directory (its --run-dir)")
    checkpoints.set_defaults(func=cmd_checkpoints)
    adapters = sub.add_parser("adapters", help="list the LoRA adapters in DIR (runs and PEFT directories) by base: base hash, "
                              "rank, targets, steps, last eval loss")
    adapters.add_argument("dir", metavar="DIR", help="a LoRA run or PEFT adapter directory, or a directory of them")
    adapters.set_defaults(func=cmd_adapters)
    plot = sub.add_parser("plot", help="one PNG of loss, eval loss, tokens/s, MFU and memory over steps; runs overlaid")
    plot.add_argument("run_dirs", nargs="+", metavar="RUN_DIR")
    plot.add_argument("--out", metavar="FILE.png", help="output image, .png, .pdf or .svg (default RUN_DIR/metrics.png of the first run)")
    plot.set_defaults(func=cmd_plot)
    tokenize = sub.add_parser("tokenize", help="text files, directories or .jsonl files -> a token file (.bin) and its .bin.json sidecar")
    tokenize.add_argument("inputs", nargs="+", metavar="INPUT", help="text files, .jsonl files (one JSON object with 'text' a line), or directories of them")
    tokenize.add_argument("--tokenizer", required=True, metavar="PATH", help="a tokenizer.json or a directory holding one")
    tokenize.add_argument("--out", required=True, metavar="TOKENS.bin", help="the token file (uint16, or uint32 for vocabularies over 65536)")
    tokenize.set_defaults(func=cmd_tokenize)
    train_tok = sub.add_parser("train-tokenizer", help="train a byte-level BPE tokenizer that transformers' AutoTokenizer loads")
    train_tok.add_argument("inputs", nargs="+", metavar="INPUT", help="text files, .jsonl files, or directories of them")
    train_tok.add_argument("--vocab-size", required=True, type=positive_int, metavar="N", help="vocabulary size, special token included")
    train_tok.add_argument("--out", required=True, metavar="DIR", help="new directory for tokenizer.json and tokenizer_config.json")
    train_tok.set_defaults(func=cmd_train_tokenizer)
    export = sub.add_parser("export-hf", help="a run's checkpoint as a Hugging Face model directory (config.json, safetensors shards)")
    export.add_argument("run_dir", metavar="RUN_DIR")
    export.add_argument("--out", required=True, metavar="DIR", help="the new model directory (must not exist)")
    export.add_argument("--step", type=int, metavar="N", help="checkpoint step (default: the latest)")
    export.add_argument("--dtype", choices=("bfloat16", "float32"), help="weight dtype in the files (default bfloat16; "
                        "--adapter-only: float32, the adapters' training dtype, as PEFT saves them)")
    export.add_argument("--adapter-only", action="store_true", help="a LoRA run: write its adapters as a PEFT adapter directory "
                        "(adapter_config.json, adapter_model.safetensors) instead of the merged model")
    export.add_argument("--mesh", help="mesh to restore onto (default: the run's)")
    export.add_argument("--rules", help="sharding rule set to restore with (default: the run's)")
    export.add_argument("--devices", type=_simulated_devices, help=_DEVICES_HELP)
    _add_process_flags(export)
    export.set_defaults(func=cmd_export_hf)
    for command_parser in sub.choices.values():  # an unknown option is reported by its command: `jaxtrain train --help`
        command_parser.set_defaults(command_parser=command_parser)
    return parser


def _add_process_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--coordinator", metavar="HOST:PORT", help="multi-process: address of process 0's coordinator")
    parser.add_argument("--num-processes", type=_positive_int32, metavar="N", help="multi-process: number of processes")
    parser.add_argument("--process-id", type=int, metavar="I", help="multi-process: this process's index, 0..N-1")


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    # key=value overrides may come before or after options, which argparse leaves over as extras
    args, extras = parser.parse_known_args(argv)
    unknown = [e for e in extras if e.startswith("-") or not hasattr(args, "overrides")]
    if unknown:
        args.command_parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    args.overrides = [*getattr(args, "overrides", []), *extras]
    if args.func not in (cmd_train, cmd_generate, cmd_export_hf):  # theirs follows the mesh they run on
        simulate_cpu_devices(getattr(args, "devices", None))
    try:
        xla_env.set_defaults()
        # not for the commands that never start jax: one arena for every thread ran the tokenizers library 3.5x slower
        if args.func not in (cmd_tokenize, cmd_train_tokenizer):
            host_malloc.configure()  # before jax starts its threads
        return args.func(args)
    except UserError as e:
        print(f"jaxtrain: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # Ctrl-C: one line, the status a shell gives a command stopped by SIGINT (128 + 2)
        print("jaxtrain: interrupted", file=sys.stderr)
        return INTERRUPTED_EXIT_STATUS


if __name__ == "__main__":  # `python -m jaxtrain.cli`: the command, as `jaxtrain` and `python -m jaxtrain` run it
    from jaxtrain.__main__ import main as command

    sys.exit(command())
