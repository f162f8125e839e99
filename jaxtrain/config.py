"""Typed, frozen run configuration; dotted ``key=value`` overrides; experiment and mesh files.

Nothing here imports jax, so the CLI can load and check a config before jax starts (the simulated
device count has to be set before that).
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import functools
import importlib
import importlib.util
import math
import os
import sys
import traceback
import types
import typing
from pathlib import Path

import yaml

from jaxtrain import experiments
from jaxtrain.atomic import atomic_file
from jaxtrain.errors import UserError
from jaxtrain.models.config import LlamaConfig, tokamax_problem

MESH_AXES = ("data", "fsdp", "tensor", "stage", "expert")  # stage: pipeline stages (jaxtrain/models/pipeline.py)
DATA_FORMATS = ("text", "sft")
MESHES_DIR = Path(experiments.__file__).parent / "meshes"
EXPERIMENTS_DIR = Path(experiments.__file__).parent


GRAD_SYNCS = ("auto", "step", "microbatch")  # optim.grad_sync (jaxtrain/memory/grad_comm.py)
# optim.schedule, after the linear warmup (jaxtrain/optim.py): cosine or linear decay to lr * min_lr_ratio at train.steps;
# wsd (warmup-stable-decay): optim.lr until the last optim.decay_fraction of train.steps, then a decay of optim.decay_shape
SCHEDULES = ("cosine", "linear", "wsd")
DECAY_SHAPES = ("linear", "1-sqrt", "cosine")  # the factor at progress p of the decay: 1 - p, 1 - sqrt(p), (1 + cos(pi p)) / 2
# the train state's step counters are int32 (the spike window's count, the loss scale's run of finite steps): a larger
# train.spike_window or optim.loss_scale_period stopped the first step with jax's OverflowError traceback; XLA and jax
# read --num-processes as int32 too (cli.py)
INT32_MAX = 2**31 - 1
# XLA:CPU compiles a program for at most this many devices: past it every compile fails with "Multiprocess computations
# aren't implemented on the CPU backend" (jaxlib 0.10, simulated devices: 2048 compile, 2049 do not); here, not in
# mesh.py, for the command line's --devices, read before jax is imported
CPU_MAX_DEVICES = 2048


@dataclasses.dataclass(frozen=True)
class AxisSizes:
    """Size of each mesh axis at one level; -1 fills what the other axes leave."""

    data: int = 1
    fsdp: int = 1
    tensor: int = 1
    stage: int = 1
    expert: int = 1  # mixture-of-experts expert parallelism (rule sets *_ep); a data axis for everything else

    def as_tuple(self) -> tuple[int, ...]:
        return tuple(getattr(self, a) for a in MESH_AXES)

    def __str__(self) -> str:  # in messages: 'data -1 x fsdp -1 x tensor 2', not the dataclass's repr
        return describe_axes(dataclasses.asdict(self))


def describe_axes(sizes: typing.Mapping[str, int]) -> str:
    """'data 2 x fsdp 2 x tensor 2': how every message and listing shows mesh axis sizes (the stage and expert
    axes only where they are used)."""
    return " x ".join(f"{axis} {size}" for axis, size in sizes.items() if not (axis in ("stage", "expert") and size == 1))


@dataclasses.dataclass(frozen=True)
class MeshConfig:
    """ici: axis sizes inside one process (host); dcn: across processes. Final axis = ici * dcn."""

    ici: AxisSizes = AxisSizes(fsdp=-1)
    dcn: AxisSizes = AxisSizes()


@dataclasses.dataclass(frozen=True)
class DataConfig:
    path: str | None = None  # None: the running Python's standard library .py files
    tokenizer: str | None = None  # a tokenizer.json (or a directory holding one); None: raw bytes
    seq_len: int = 256
    val_fraction: float = 0.02  # share of files (or of a token file) held out for evaluation
    seed: int = 0  # shuffle seed
    # "text": language modelling of data.path (text, JSONL 'text', token files); "sft": instruction data, a JSONL file
    # of prompt/completion or messages rendered with data.tokenizer's chat template, loss on the answers only
    format: str = "text"
    pack: bool = True  # sft: several examples per sequence (segment ids); false: one example per sequence, padded
    truncate: bool = False  # sft: cut an example longer than data.seq_len + 1 tokens to that length; false: an error


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    steps: int = 100
    # > 0: passes over the training split to train, which replace train.steps once the data is read: the first step
    # whose batch reads that much of it (jaxtrain/data/batches.py steps_for_epochs); 0: train.steps decides
    epochs: float = 0
    global_batch: int = 32  # sequences per optimizer step, across all devices
    microbatches: int | str = 1  # gradient accumulation passes per step; "auto": the fewest that fit (jaxtrain/plan/estimate.py)
    seed: int = 0  # parameter initialisation
    eval_every: int = 0  # 0: evaluate only at the end
    eval_batches: int = 4  # global batches of the validation split per evaluation
    skip_nonfinite: int = 0  # updates with a non-finite loss or grad norm skipped before the run stops
    # skip an update whose loss or grad norm lies more than this many standard deviations from the mean of the last
    # spike_window steps' (jaxtrain/spikes.py; OLMo 2 trained with 6); 0: off
    skip_spikes: float = 0.0
    spike_window: int = 128
    loss_chunk: int = 0  # sequence positions per cross-entropy chunk (large vocabularies); 0: whole sequence
    # XLA programs kept on disk and read back by the next run that compiles them (jaxtrain/compile_cache.py):
    # auto (or true): $XDG_CACHE_HOME/jaxtrain/xla, else ~/.cache/jaxtrain/xla; a folder path; false: no cache
    compile_cache: bool | str = "auto"


@dataclasses.dataclass(frozen=True)
class OptimConfig:
    lr: float = 3e-4
    warmup_steps: int = 10
    min_lr_ratio: float = 0.1  # the schedule decays to lr * min_lr_ratio at train.steps
    schedule: str = "cosine"  # one of SCHEDULES
    decay_fraction: float = 0.2  # schedule=wsd: the share of train.steps its final decay takes
    decay_shape: str = "linear"  # schedule=wsd: one of DECAY_SHAPES
    weight_decay: float = 0.1
    b1: float = 0.9
    b2: float = 0.95
    eps: float = 1e-8
    clip_norm: float = 1.0  # global gradient-norm clipping; 0 disables
    offload: bool = False  # optimizer state (and float32 master weights under narrower compute) in host memory
    loss_scale_period: int = 2000  # model.dtype=float16: finite steps in a row before the loss scale doubles
    grad_dtype: str = "float32"  # bfloat16: gradients summed over the batch axes in bfloat16 (jaxtrain/memory/grad_comm.py)
    # when gradients are summed over the batch axes no weight is split over: "step" (once, after the last micro-batch),
    # "microbatch" (GSPMD's, in every pass's backward), "auto": once per step when that moves fewer bytes
    grad_sync: str = "auto"  # one of GRAD_SYNCS


@dataclasses.dataclass(frozen=True)
class LogConfig:
    every: int = 10  # steps between metrics records
    progress: bool = True  # progress bar on process 0 (plain log lines when stderr is not a terminal)
    layer_every: int = 100  # steps between per-layer gradient / parameter norm records; 0: never
    profile_steps: str | None = None  # "START:END": jax profiler trace of those steps into the run directory
    peak_tflops: float | None = None  # per-device peak for MFU; None: datasheet table, or measured on CPU
    tensorboard: bool = True  # TensorBoard event files in the run directory
    wandb: str | None = None  # Weights & Biases project name (needs the wandb package); None: off
    mlflow: str | None = None  # MLflow experiment name (needs mlflow; MLFLOW_TRACKING_URI picks the server); None: off
    prometheus_port: int | None = None  # process 0 serves gauges on this port (needs prometheus_client); None: off


@dataclasses.dataclass(frozen=True)
class CheckpointConfig:
    every: int = 50  # steps between checkpoints (the last step and a preemption always save)
    keep: int = 3  # latest checkpoints kept
    keep_every: int = 0  # also keep every step divisible by this, permanently; 0: none
    async_save: bool = True  # write in the background while training continues


@dataclasses.dataclass(frozen=True)
class Config:
    model: LlamaConfig = LlamaConfig()
    data: DataConfig = DataConfig()
    train: TrainConfig = TrainConfig()
    optim: OptimConfig = OptimConfig()
    log: LogConfig = LogConfig()
    checkpoint: CheckpointConfig = CheckpointConfig()
    mesh: MeshConfig = MeshConfig()
    rules: str = "fsdp_tp"  # a name under jaxtrain/sharding_rules/ or a path to a YAML rule set


@dataclasses.dataclass(frozen=True)
class SamplingConfig:
    """How `jaxtrain generate` picks each new token (command-line flags, not part of a run's config)."""

    max_new_tokens: int = 64
    temperature: float = 0.0  # 0: greedy (the most likely token)
    top_p: float = 1.0  # nucleus sampling: draw among the most likely tokens whose probability reaches top_p
    seed: int = 0

    # jax keys keep a seed's low 32 bits (2**32 is seed 0 again, 2**63 overflows); grain's shuffle takes no more either
    SEED_MAX = 2**32 - 1
    # the sampler divides in float32, where a larger temperature is inf (1e300 was taken, with numpy's overflow warning)
    TEMPERATURE_MAX = 3.4028234663852886e38

    def problems(self) -> list[str]:
        out = []
        if self.max_new_tokens < 1:
            out.append(f"--max-new-tokens {self.max_new_tokens} must be at least 1")
        elif self.max_new_tokens > 2**31 - 2:  # positions are int32, and the prompt takes one at least
            out.append(f"--max-new-tokens {self.max_new_tokens} must be at most {2**31 - 2} (positions are int32), "
                       "less the prompt's tokens")
        if self.temperature > self.TEMPERATURE_MAX:  # every logit / inf is 0 or nan: noise, not a sample
            out.append(f"--temperature {self.temperature:g} must be finite (at most {self.TEMPERATURE_MAX:.1e}, float32's largest); "
                       "give 0 (greedy) or a positive number, e.g. 1")
        elif not self.temperature >= 0:
            out.append(f"--temperature {self.temperature:g} must be 0 (greedy) or positive")
        if not 0 < self.top_p <= 1:  # also refuses nan
            out.append(f"--top-p {self.top_p:g} must be in (0, 1]; 1 samples from the whole distribution")
        if not 0 <= self.seed <= self.SEED_MAX:
            out.append(f"--seed {self.seed} must be in [0, {self.SEED_MAX}]")
        return out


# ---------------------------------------------------------------------------------------------
# dict / YAML conversion and overrides


def to_dict(cfg) -> dict:
    return dataclasses.asdict(cfg)


@functools.cache  # typing.get_type_hints evaluates every annotation's string anew: 0.14 s per from_dict uncached
def all_keys(cls=Config, prefix: str = "") -> types.MappingProxyType[str, type]:
    """Every dotted leaf key of a config class with its type (read-only: the one mapping is shared)."""
    out = {}
    for name, tp in typing.get_type_hints(cls).items():
        if dataclasses.is_dataclass(tp):
            out.update(all_keys(tp, f"{prefix}{name}."))
        else:
            out[f"{prefix}{name}"] = tp
    return types.MappingProxyType(out)


# other frameworks' names for keys of ours, which spelling alone does not find (optim.learning_rate looks more like
# optim.min_lr_ratio than optim.lr)
_OTHER_NAMES = {"learning_rate": "lr", "batch_size": "global_batch", "max_steps": "steps", "num_steps": "steps",
                "num_train_epochs": "epochs", "num_epochs": "epochs",
                "seq_length": "seq_len", "sequence_length": "seq_len", "max_seq_len": "seq_len", "warmup": "warmup_steps",
                "grad_clip": "clip_norm", "max_grad_norm": "clip_norm", "n_layers": "num_layers", "hidden_size": "d_model",
                "intermediate_size": "mlp_dim", "gradient_accumulation_steps": "microbatches", "lr_scheduler_type": "schedule",
                "lr_schedule": "schedule", "scheduler": "schedule", "decay_ratio": "decay_fraction", "min_lr_factor": "min_lr_ratio",
                "decay_type": "decay_shape", "freq": "every", "interval": "every",
                # the parallelism abbreviations (and our rule sets' names: dp, tp, pp_*): spelling alone offered fsdp for tp
                "dp": "data", "tp": "tensor", "pp": "stage", "ep": "expert", "pipeline": "stage"}


def _did_you_mean(key: str, candidates) -> str:
    """The hint after "unknown config key": a section's keys, the keys of that name (in the section given, else in
    any: `lr` is optim.lr), else the closest spelling, else every key. Our keys are lower case: TRAIN.STEPS is train.steps."""
    key = key.lower()
    inside = sorted(c for c in candidates if c.startswith(f"{key}."))
    if inside:
        return f", a section; give one of its keys: {', '.join(inside)}"
    section, _, name = key.rpartition(".")
    named = [c for c in candidates if c.rpartition(".")[2] == _OTHER_NAMES.get(name, name)]
    ours = [c for c in named if f".{c.rpartition('.')[0]}".endswith(f".{section}")] or named
    close = ours or difflib.get_close_matches(key, list(candidates), n=1, cutoff=0.5)
    return f"; did you mean {' or '.join(repr(c) for c in close)}?" if close else f"; valid keys: {', '.join(sorted(candidates))}"


# numeric keys whose 0 turns their feature off, and what 0 means: a value such as `none` or `off` there is refused with
# the way to turn it off
OFF_AT_ZERO = {"optim.clip_norm": "no clipping", "train.skip_spikes": "off", "checkpoint.keep_every": "off",
               "log.layer_every": "off"}


def _type_name(tp) -> str:
    return " or ".join(getattr(a, "__name__", str(a)) for a in typing.get_args(tp)) or tp.__name__


def parse_value(key: str, text, tp):
    """Convert ``text`` (a string from the command line, or a YAML value) to field type ``tp``."""
    args = typing.get_args(tp)
    if isinstance(tp, types.UnionType) or typing.get_origin(tp) is typing.Union:
        if text is None or (isinstance(text, str) and text.lower() in ("none", "null")):
            if type(None) in args:
                return None
        for option in (a for a in args if a is not type(None)):
            try:
                return parse_value(key, text, option)
            except UserError:
                pass
        raise UserError(f"{key} expects {_type_name(tp)}, got {text!r}")
    if tp is bool:
        if isinstance(text, bool):
            return text
        if isinstance(text, str) and text.lower() in ("true", "1", "yes", "on"):
            return True
        if isinstance(text, str) and text.lower() in ("false", "0", "no", "off"):
            return False
    elif tp is int:
        if isinstance(text, int) and not isinstance(text, bool):
            return text
        if isinstance(text, str):
            try:
                return int(text.replace("_", ""))
            except ValueError:
                pass
    elif tp is float:
        if isinstance(text, (int, float)) and not isinstance(text, bool):
            return float(text)
        if isinstance(text, str):
            try:
                return float(text)
            except ValueError:
                pass
    elif tp is str:
        if isinstance(text, str):
            return text
    off = f"; {key}=0 means {OFF_AT_ZERO[key]}" if key in OFF_AT_ZERO else ""
    raise UserError(f"{key} expects {_type_name(tp)}, got {text!r}{off}")


def _replace_path(obj, path: list[str], value):
    if len(path) == 1:
        return dataclasses.replace(obj, **{path[0]: value})
    child = getattr(obj, path[0])
    return dataclasses.replace(obj, **{path[0]: _replace_path(child, path[1:], value)})


# the keys whose value can be a file or folder path, where a leading ~ is the home folder
PATH_KEYS = ("data.path", "data.tokenizer", "train.compile_cache", "rules")


def set_key(cfg: Config, key: str, raw) -> Config:
    keys = all_keys()
    if key not in keys:
        raise UserError(f"unknown config key '{key}'{_did_you_mean(key, keys)}")
    value = parse_value(key, raw, keys[key])
    if key in PATH_KEYS and isinstance(value, str):  # the shell leaves ~ in data.path=~/corpus as it is
        value = os.path.expanduser(value)
    return _replace_path(cfg, key.split("."), value)


def as_override(value) -> str:
    """A config value as a ``key=value`` override gives it: true, false and null as YAML spells them (not Python's)."""
    return "null" if value is None else str(value).lower() if isinstance(value, bool) else str(value)


def as_overrides(changes: dict) -> str:
    """Config changes as space-separated ``key=value`` overrides, to paste after a command as printed."""
    return " ".join(f"{key}={as_override(value)}" for key, value in changes.items())


def apply_overrides(cfg: Config, overrides: list[str]) -> Config:
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise UserError(f"override {item!r} is not of the form key=value (e.g. train.steps=100)")
        cfg = set_key(cfg, key.strip(), raw.strip())
    return cfg


def flatten(d: dict, prefix: str = "") -> dict:
    """{"a": {"b": 1}} -> {"a.b": 1}: dotted keys, as overrides name them."""
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def from_dict(d: dict) -> Config:
    cfg = Config()
    for key, value in flatten(d).items():
        cfg = set_key(cfg, key, value)
    return cfg


def check_run_dir(run_dir: Path) -> None:
    """One line where a RUN_DIR argument is a file: it exists, and no --out under it was given."""
    if run_dir.is_file():
        raise UserError(f"{run_dir} is a file, not a run directory; give the --run-dir of a training run")


def load_run_config(run_dir: Path) -> Config:
    """The resolved config a run saved in RUN_DIR/config.yaml."""
    check_run_dir(run_dir)
    path = run_dir / "config.yaml"
    if not path.is_file():
        raise UserError(f"{run_dir} has no config.yaml; give the --run-dir of a training run")
    # a damaged file (a YAML error, a list) or a key another jaxtrain wrote: one line naming it, not a traceback
    body = read_yaml_mapping(path, "run config", "a mapping of config sections (model, data, train, ...)")
    if not body:  # read as the default Config it was another model, other steps, without a word
        raise UserError(f"run config {path} is empty (a write cut short?); remove it and run the run's `jaxtrain train` "
                        "command again, which writes it")
    body.pop("resolved", None)
    try:
        return from_dict(body)
    except UserError as e:
        # a typo by hand, or a key a later jaxtrain added, which the hint alone took for a misspelling of another
        later = " (or a later jaxtrain's key: read this run with that jaxtrain)" if str(e).startswith("unknown config key") else ""
        raise UserError(f"{path}: {e}{later}") from None


def weights_on_device(cfg: Config) -> Config:
    """A run's ``cfg`` without optim.offload, for the commands that read its weights without the train step (generate,
    export-hf): their programs take arrays where they lie and do not bring host memory in (until 2026-12-06 a bfloat16
    or float16 run trained with optim.offload, its master weights in host memory, stopped them with a traceback)."""
    return dataclasses.replace(cfg, optim=dataclasses.replace(cfg.optim, offload=False))


def save_yaml(cfg: Config, path: Path, extra: dict | None = None) -> None:
    """A run's config.yaml, its file paths made absolute: `generate` and `export-hf` read it from any directory."""
    body = to_dict(with_absolute_paths(cfg)) | (extra or {})
    # each start rewrites it: a full disk mid-write left it cut short, read back as another config (d_model: 256 cut
    # to d_model: 2) or, empty, as the defaults
    with atomic_file(path, "run config") as f:
        f.write(yaml.safe_dump(body, sort_keys=False).encode())


def with_absolute_paths(cfg: Config) -> Config:
    """``cfg`` with data.path, data.tokenizer, train.compile_cache and a rule-set file given by a relative path made
    absolute."""
    def absolute(value: str | None) -> str | None:
        return value if value is None or Path(value).is_absolute() else str(Path(value).absolute())

    rules = cfg.rules if not Path(cfg.rules).is_file() else absolute(cfg.rules)  # a name stays a name
    cache = cfg.train.compile_cache
    return dataclasses.replace(cfg, rules=rules,
                               data=dataclasses.replace(cfg.data, path=absolute(cfg.data.path), tokenizer=absolute(cfg.data.tokenizer)),
                               train=dataclasses.replace(cfg.train, compile_cache=cache if isinstance(cache, bool) or cache == "auto"
                                                         else absolute(cache)))


# ---------------------------------------------------------------------------------------------
# experiment and mesh files


def _available(directory: Path, suffix: str) -> str:
    return ", ".join(sorted(p.stem for p in directory.glob(f"*{suffix}") if not p.stem.startswith("_")))


# the top-level packages of jaxtrain's wheel until 2026-12-06, which an experiment file of then imports from
MOVED_PACKAGES = ("models", "experiments", "sharding_rules")


def _shipped(directory: Path, name: str, suffix: str) -> bool:
    """Whether ``name`` is one of the files ``_available`` lists (a bare name, not a path)."""
    return name.isidentifier() and not name.startswith("_") and (directory / f"{name}{suffix}").is_file()


@contextlib.contextmanager
def _imports_beside(experiment_file: Path | None):
    """The file's folder first on sys.path while it loads and its config() runs, as `python FILE.py` puts it: an
    experiment imports the helpers beside it, as ours import jaxtrain/experiments/_llama.py (a user's `from _common import
    base` was "No module named '_common'")."""
    if experiment_file is None:
        yield
        return
    folder = str(experiment_file.parent.resolve())
    sys.path.insert(0, folder)
    try:
        yield
    finally:
        sys.path.remove(folder)


YAML_SUFFIXES = (".yaml", ".yml")


def load_experiment(name_or_path: str) -> Config:
    """An experiment is a Python file under jaxtrain/experiments/ (or any path) with ``config() -> Config``, or a YAML
    file of config sections (a run's config.yaml among them: ``_yaml_experiment``)."""
    path = Path(name_or_path)
    # a directory is never an experiment: one in the working directory named as a shipped experiment (a user's
    # folder for its data) leaves the name to the experiment
    if path.suffix == ".py" or path.exists() and not (path.is_dir() and _shipped(EXPERIMENTS_DIR, name_or_path, ".py")):
        if path.is_dir():
            raise UserError(f"experiment {name_or_path} is a directory; give an experiment .py or .yaml file, or a name under "
                            f"jaxtrain/experiments/: {_available(EXPERIMENTS_DIR, '.py')}")
        if not path.is_file():
            raise UserError(f"experiment file {name_or_path} does not exist")
        if path.suffix in YAML_SUFFIXES:
            return _yaml_experiment(path)
        if path.suffix != ".py":
            raise UserError(f"experiment file {name_or_path} is neither a Python nor a YAML file; an experiment is a .py file "
                            # the example where it is installed
                            f"with config() -> Config (see {EXPERIMENTS_DIR / 'tiny.py'}) or a .yaml file of config "
                            "sections (a run's config.yaml is one)")
        spec = importlib.util.spec_from_file_location(f"_experiment_{path.stem}", path)
        module, experiment_file = importlib.util.module_from_spec(spec), path
        try:
            with _imports_beside(experiment_file):
                spec.loader.exec_module(module)
        except SyntaxError as e:  # the user's file, not ours: where, not a traceback through importlib
            raise UserError(f"experiment file {name_or_path} line {e.lineno}: {e.msg}; fix the file") from None
        except (Exception, SystemExit) as e:  # noqa: BLE001 - whatever running it raised (a missing import, a NameError, a
            # sys.exit that ended the command with its status and no word): one line too
            detail = f"{type(e).__name__}: {e}".splitlines()[0]
            moved = isinstance(e, ModuleNotFoundError) and e.name in MOVED_PACKAGES
            fix = (f"jaxtrain's {e.name} package is jaxtrain.{e.name} since 2026-12-06: import from jaxtrain.{e.name} where "
                   f"the file imports from {e.name}" if moved else "fix the file")
            raise UserError(f"experiment file {name_or_path} failed to load: {detail}; {fix}") from None
    else:
        if path.suffix or len(path.parts) > 1:  # a path, not a name: "unknown experiment" for a mistyped file was no help
            raise UserError(f"experiment file {name_or_path} does not exist; give an experiment .py file with config() -> Config, "
                            f"a .yaml file of config sections, or a name under jaxtrain/experiments/: {_available(EXPERIMENTS_DIR, '.py')}")
        if not _shipped(EXPERIMENTS_DIR, name_or_path, ".py"):
            raise UserError(
                f"unknown experiment '{name_or_path}'; available: {_available(EXPERIMENTS_DIR, '.py')} "
                "(or pass a path to a .py or .yaml file)"
            )
        module, experiment_file = importlib.import_module(f"jaxtrain.experiments.{name_or_path}"), None
    if not callable(getattr(module, "config", None)):
        raise UserError(f"experiment {name_or_path} defines no config() function returning a jaxtrain Config")
    try:
        with _imports_beside(experiment_file):
            cfg = module.config()
    except UserError:
        raise
    except Exception as e:
        if module.__name__.startswith("jaxtrain.experiments."):  # ours: a bug to see whole
            raise
        # the user's file (a misspelt LlamaConfig field, say): where in it, not a traceback
        lines = [frame.lineno for frame in traceback.extract_tb(e.__traceback__) if Path(frame.filename).resolve() == path.resolve()]
        detail = f"{type(e).__name__}: {e}".splitlines()[0]
        where = f" line {lines[-1]}" if lines else ""
        raise UserError(f"experiment file {name_or_path}{where}: config() raised {detail}; fix the file") from None
    if not isinstance(cfg, Config):
        raise UserError(f"experiment {name_or_path}: config() returned {type(cfg).__name__}, expected jaxtrain.config.Config")
    # dataclasses check no types: each value read as an override's is (LogConfig(progress="false") was truthy, a
    # string learning rate a traceback in the range checks)
    try:
        return from_dict(to_dict(cfg))
    except UserError as e:
        raise UserError(f"experiment {name_or_path}: in the Config its config() returned, {e}; fix the file") from None


def _yaml_experiment(path: Path) -> Config:
    """A YAML experiment: config sections as config.yaml writes them (``model:``, ``data:``, ``train:``, ...), each key
    read as its override is, a key not given at its default. A run's config.yaml is one: the same run again, or its
    resume without its overrides; its ``resolved:`` section (what the run's devices made of the config) is a record,
    not config, and is left out."""
    body = read_yaml_mapping(path, "experiment file", "a mapping of config sections (model, data, train, ...)")
    body.pop("resolved", None)
    try:
        return from_dict(body)
    except UserError as e:
        raise UserError(f"experiment file {path}: {e}; fix the file") from None


def _yaml_error_place(e: yaml.YAMLError) -> str:
    """Where in the file and what: PyYAML's first line alone was its context ("while parsing a flow sequence"), with
    neither the line nor the problem (an unclosed '[')."""
    mark, problem = getattr(e, "problem_mark", None), getattr(e, "problem", None)
    if mark is None or problem is None:
        return f": {str(e).splitlines()[0]}"
    context, context_mark = getattr(e, "context", None), getattr(e, "context_mark", None)
    since = f" ({context} from line {context_mark.line + 1})" if context and context_mark else ""
    return f" at line {mark.line + 1}, column {mark.column + 1}: {problem}{since}"


def read_yaml_mapping(path: Path, what: str, expected: str) -> dict:
    """The mapping in the user's YAML file ``path`` ({} when empty), else one line naming ``what`` it is and, when
    it holds something else, what it must be (``expected``) and the type found (not the contents: any file)."""
    try:
        body = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    except UnicodeDecodeError:
        raise UserError(f"{what} {path} is not UTF-8 text; give a YAML {what}") from None
    except yaml.YAMLError as e:
        raise UserError(f"{what} {path} is not valid YAML{_yaml_error_place(e)}") from None
    if not isinstance(body, dict):
        raise UserError(f"{what} {path} must be {expected}, got {type(body).__name__}")
    return body


def moved_file_hint(name_or_path: str, shipped_dir: Path) -> str:
    """Where ``name_or_path`` is a shipped mesh's or rule set's path in the checkout of before 2026-12-06
    (experiments/meshes/h100x8.yaml, sharding_rules/fsdp.yaml: top-level folders then, jaxtrain/... now), the advice
    to give its name, which works from any directory and installation; else ''."""
    path, old_folder = Path(name_or_path), shipped_dir.relative_to(Path(__file__).parent).as_posix()
    if path.suffix == ".yaml" and path.parent.as_posix().endswith(old_folder) and (shipped_dir / path.name).is_file():
        return f"the shipped ones are in jaxtrain/{old_folder}/ since 2026-12-06: give the name, {path.stem}; "
    return ""


def load_mesh_file(name_or_path: str) -> MeshConfig:
    """Mesh YAML: ``ici:`` and ``dcn:`` mappings of axis name to size (missing axes are 1)."""
    path = Path(name_or_path)
    if not path.is_file():  # a directory of a shipped mesh's name in the working directory leaves the name to the mesh
        path = MESHES_DIR / f"{name_or_path}.yaml"
    if not path.is_file():
        if name_or_path and Path(name_or_path).is_dir():
            raise UserError(f"--mesh {name_or_path} is a directory; give a mesh YAML file or one of: {_available(MESHES_DIR, '.yaml')}")
        raise UserError(f"mesh file '{name_or_path}' not found; {moved_file_hint(name_or_path, MESHES_DIR)}give a path or one "
                        f"of: {_available(MESHES_DIR, '.yaml')}")
    expected = "a mapping with only the keys 'ici' and 'dcn'"
    body = read_yaml_mapping(path, "mesh file", expected)
    if set(body) - {"ici", "dcn"}:
        raise UserError(f"mesh file {path} must be {expected}, got keys {', '.join(map(str, body))}")
    if not any(body.values()):  # read as every axis 1: an empty or cut-short file trained on one device (a QA report)
        raise UserError(f"mesh file {path} gives no axis sizes; give them, e.g. ici: {{data: 2, fsdp: 2, tensor: 2}} "
                        "(one device: --mesh gpu1)")
    levels = {}
    for level in ("ici", "dcn"):
        sizes = body.get(level) or {}
        if not isinstance(sizes, dict):
            raise UserError(f"mesh file {path}: '{level}' must map axis names to sizes, got {sizes!r}")
        for axis, size in sizes.items():
            if axis not in MESH_AXES:
                raise UserError(f"mesh file {path}: unknown axis '{level}.{axis}'; mesh axes are {', '.join(MESH_AXES)}")
            if not isinstance(size, int) or isinstance(size, bool) or (size < 1 and size != -1):
                raise UserError(f"mesh file {path}: {level}.{axis}={size!r} must be a positive integer or -1 (fill)")
        if list(sizes.values()).count(-1) > 1:
            raise UserError(f"mesh file {path}: at most one axis per level may be -1, got {level}={sizes}")
        levels[level] = AxisSizes(**{a: sizes.get(a, 1) for a in MESH_AXES})
    return MeshConfig(**levels)


def profile_range(spec: str) -> tuple[int, int]:
    """'START:END' (log.profile_steps) -> (START, END), steps counted from 1, both included."""
    start, sep, end = spec.partition(":")
    if not (sep and start.strip().isdigit() and end.strip().isdigit() and 0 < int(start) <= int(end)):
        raise UserError(f"log.profile_steps={spec!r} must be START:END with 0 < START <= END, e.g. log.profile_steps=10:12")
    return int(start), int(end)


def resolve_for_devices(cfg: Config, nvidia_gpu: bool, cpu: bool = False, pipelined: bool = False) -> Config:
    """The model's ``auto`` keys made concrete for the devices; explicit values stay.

    ``model.attention``: cuDNN flash attention on NVIDIA GPUs where it takes the model (half-precision compute, a
    head dimension that is a multiple of 8 up to 128: jax's cuDNN checks, 256 on Hopper kept out to hold on every
    GPU), chunked causal attention on CPUs (XLA:CPU has no fused kernel: jaxtrain/models/attention.py), XLA elsewhere.

    ``model.scan_layers``: unrolled on CPUs, scanned elsewhere and under pipeline stages (``pipelined``: each
    stage's layers run in the pipeline's scan whatever this says, jaxtrain/models/pipeline.py). On XLA:CPU the layer
    scan stacks what each layer saves and slices it back, and unrolled steps measured 1.12-1.22x faster at 2 to 32 layers for about 0.4 s of
    compile per layer (README, "Benchmarks and performance"); on GPUs the scan keeps compile time flat and memory
    lower (the unrolled program holds 13% more on an H200), and the memory planner models the scanned program.

    ``model.moe.grouped_matmul``: tokamax's ragged dot on NVIDIA GPUs where it can run (installed, and a jax its
    kernels run on: ``tokamax_problem``; XLA's GPU compiler expands jax.lax.ragged_dot into a dense matmul over every
    expert), jax.lax.ragged_dot elsewhere."""
    m = cfg.model
    if m.moe.grouped_matmul == "auto":
        tokamax = nvidia_gpu and tokamax_problem() is None
        m = dataclasses.replace(m, moe=dataclasses.replace(m.moe, grouped_matmul="tokamax" if tokamax else "xla"))
    if m.attention == "auto":
        cudnn = nvidia_gpu and m.dtype in ("bfloat16", "float16") and m.resolved_head_dim % 8 == 0 and m.resolved_head_dim <= 128
        m = dataclasses.replace(m, attention="cudnn" if cudnn else "chunked" if cpu else "xla")
    if m.scan_layers == "auto":
        m = dataclasses.replace(m, scan_layers=pipelined or not cpu)
    return dataclasses.replace(cfg, model=m)


# the keys that do nothing while a feature is off: (the keys, or their section; the feature's switch; whether its value
# is off; what off means and how to switch it on). One set to other than its default is noted: model.lora.alpha=32
# without model.lora.rank trained every weight without a word, model.rope_scaling.factor=8 without its type no scaling
UNUSED_WHILE_OFF = (
    ("model.lora.", "model.lora.rank", lambda v: v == 0, "no adapters: every weight trains; give model.lora.rank to train LoRA adapters"),
    ("model.moe.", "model.moe.num_experts", lambda v: v == 0, "a dense model; give model.moe.num_experts for a mixture of experts"),
    ("model.rope_scaling.", "model.rope_scaling.type", lambda v: v == "none", "no rotary scaling; give model.rope_scaling.type=llama3"),
    (("optim.decay_fraction", "optim.decay_shape"), "optim.schedule", lambda v: v != "wsd", "only optim.schedule=wsd's decay uses them"),
    (("data.pack", "data.truncate"), "data.format", lambda v: v != "sft", "only instruction data, data.format=sft, is packed and cut"),
    (("train.spike_window",), "train.skip_spikes", lambda v: v == 0, "no spike guard; give train.skip_spikes"),
    (("optim.loss_scale_period",), "model.dtype", lambda v: v != "float16", "only float16 compute, model.dtype=float16, scales the loss"),
)


# the keys resolve_for_devices turns from auto into a choice, which a run's config.yaml keeps: not the user's setting
CHOSEN_FOR_DEVICES = ("model.moe.grouped_matmul", "model.attention", "model.scan_layers")


def unused_key_notes(cfg: Config) -> list[str]:
    """A note per feature that is off where some of its keys are set (``UNUSED_WHILE_OFF``)."""
    values, defaults = flatten(to_dict(cfg)), flatten(to_dict(Config()))
    notes = []
    for keys, switch, is_off, meaning in UNUSED_WHILE_OFF:
        if not is_off(values[switch]):
            continue
        unused = [f"{key}={as_override(value)}" for key, value in values.items()
                  if key != switch and (key.startswith(keys) if isinstance(keys, str) else key in keys)
                  and value != defaults[key] and key not in CHOSEN_FOR_DEVICES]
        if unused:
            noun = "has" if len(unused) == 1 else "have"
            notes.append(f"{', '.join(unused)} {noun} no effect with {switch}={as_override(values[switch])} ({meaning})")
    return notes


def steps_problems(cfg: Config, epochs_counted: bool = False) -> list[str]:
    """log.profile_steps against train.steps; under train.epochs against the steps they came to, which are known only
    once the data is read (jaxtrain.train.check, ``epochs_counted``): before that, the range's form alone."""
    t, profile = cfg.train, cfg.log.profile_steps
    if profile is None:
        return []
    try:
        end = profile_range(profile)[1]
    except UserError as e:
        return [] if epochs_counted else [str(e)]
    if (t.epochs and not epochs_counted) or end <= t.steps:
        return []
    steps, raise_ = ((f"train.epochs={t.epochs:g} came to train.steps={t.steps:,}", "train.epochs") if t.epochs else
                     (f"train.steps={t.steps}", "train.steps"))
    return [f"log.profile_steps={profile} ends after {steps}; end the range by step {t.steps} or raise {raise_}"]


def log_problems(cfg: Config) -> list[str]:
    log, problems = cfg.log, []
    for key, value, package, pip_name in (("log.wandb", log.wandb, "wandb", "wandb"), ("log.mlflow", log.mlflow, "mlflow", "mlflow-skinny"),
                                          ("log.prometheus_port", log.prometheus_port, "prometheus_client", "prometheus-client")):
        if value not in (None, "") and importlib.util.find_spec(package) is None:  # '' is check()'s one line
            problems.append(f"{key}={value!r} needs the {package} package; pip install {pip_name}, or drop {key}")
    return problems


def _out_of_range(key: str, value: float, low: float, high: float = math.inf, *, low_open: bool = False,
                  high_open: bool = False, meaning: str = "") -> str | None:
    """The problem with ``value`` when it lies outside [low, high] (open ends excluded); NaN is never in range."""
    above = value > low if low_open else value >= low
    below = value < high if high_open else value <= high
    if above and below:
        return None

    def bound(x: float) -> str:  # an integer whole: :g printed INT32_MAX as 2.14748e+09
        return str(x) if isinstance(x, int) else f"{x:g}"

    if high == math.inf:
        what = f"{'greater than' if low_open else 'at least'} {bound(low)}"
    else:
        what = f"in {'(' if low_open else '['}{bound(low)}, {bound(high)}{')' if high_open else ']'}"
    finite = "" if isinstance(value, int) or math.isfinite(value) else "a finite number, "  # isfinite(10**400) raises
    return f"{key}={value} must be {finite}{what}{meaning}"


# The optimizer computes in float32, its state too (jaxtrain.optim.in_float32). A value float32 rounds to an end of its
# range passes the checks of range_problems yet breaks every update: b1 or b2 rounded to 1.0 (from 1 - 2^-25 on) makes
# Adam's bias correction 1 - b^t zero; eps below float32's smallest normal number is flushed to 0, so 0 / 0 where a
# gradient is 0; lr or weight_decay beyond its largest is infinite. The NaN updates have a finite loss and gradient norm,
# so the health guard stopped such a run only a step later, the NaN already in the parameters (and in a checkpoint of it).
# Training checks them (jaxtrain.train.check), not the commands that read a run, which trained before the check existed.
FLOAT32_SMALLEST_NORMAL, FLOAT32_LARGEST = 2.0 ** -126, (2 - 2.0 ** -23) * 2.0 ** 127
FLOAT32_LARGEST_BELOW_1 = 1 - 2.0 ** -24


def optimizer_rounding_problems(cfg: Config) -> list[str]:
    """The optimizer's values that its float32 arithmetic rounds to a broken update."""
    o = cfg.optim
    problems = []
    for key, value in (("optim.b1", o.b1), ("optim.b2", o.b2)):
        if 1 - 2.0 ** -25 <= value < 1:
            problems.append(f"{key}={value} is 1.0 in float32, the optimizer's arithmetic: Adam's bias correction "
                            f"1 - {key[-2:]}^t is 0 (every update NaN); use at most {FLOAT32_LARGEST_BELOW_1:.9g}")
    if 0 < o.eps < FLOAT32_SMALLEST_NORMAL:
        problems.append(f"optim.eps={o.eps} is below float32's smallest normal number, {FLOAT32_SMALLEST_NORMAL:.3g}, which the "
                        f"optimizer's arithmetic flushes to 0 (0 / 0 where a gradient is 0); use at least {FLOAT32_SMALLEST_NORMAL:.3g}")
    for key, value in (("optim.lr", o.lr), ("optim.weight_decay", o.weight_decay)):
        if FLOAT32_LARGEST < value < math.inf:
            problems.append(f"{key}={value} is infinite in float32, the optimizer's arithmetic; use at most {FLOAT32_LARGEST:.3g}")
    return problems


def range_problems(cfg: Config) -> list[str]:
    """Every numeric key against its valid range."""
    t, d, o, c = cfg.train, cfg.data, cfg.optim, cfg.checkpoint
    r = _out_of_range
    problems = [
        r("train.steps", t.steps, 1), r("train.global_batch", t.global_batch, 1), r("data.seq_len", d.seq_len, 1),
        r("train.epochs", t.epochs, 0, high_open=True, meaning=" (passes over the training split; 0: train.steps decides)"),
        r("log.every", cfg.log.every, 1), r("train.eval_batches", t.eval_batches, 1),
        r("checkpoint.every", c.every, 1), r("checkpoint.keep", c.keep, 1),
        r("train.eval_every", t.eval_every, 0, meaning=" (0: evaluate only at the end)"),
        r("checkpoint.keep_every", c.keep_every, 0, meaning=f" (0: {OFF_AT_ZERO['checkpoint.keep_every']})"),
        r("log.layer_every", cfg.log.layer_every, 0, meaning=f" (0: {OFF_AT_ZERO['log.layer_every']})"),
        r("train.skip_nonfinite", t.skip_nonfinite, 0, meaning=" (0: stop at the first)"),
        r("train.skip_spikes", t.skip_spikes, 0, high_open=True,
          meaning=f" (standard deviations; 0: {OFF_AT_ZERO['train.skip_spikes']})"),
        r("train.spike_window", t.spike_window, 2, INT32_MAX,
          meaning=" (the steps the mean and deviation of train.skip_spikes are taken over)"),
        r("train.seed", t.seed, 0, SamplingConfig.SEED_MAX), r("data.seed", d.seed, 0, SamplingConfig.SEED_MAX),
        r("data.val_fraction", d.val_fraction, 0, 1, low_open=True, high_open=True),
        r("optim.lr", o.lr, 0, high_open=True),
        r("optim.warmup_steps", o.warmup_steps, 0),
        r("optim.min_lr_ratio", o.min_lr_ratio, 0, 1, meaning=" (the share of optim.lr the schedule decays to)"),
        r("optim.decay_fraction", o.decay_fraction, 0, 1, meaning=" (the share of train.steps optim.schedule=wsd decays over)"),
        r("optim.weight_decay", o.weight_decay, 0, high_open=True),
        r("optim.b1", o.b1, 0, 1, high_open=True), r("optim.b2", o.b2, 0, 1, high_open=True),
        r("optim.eps", o.eps, 0, low_open=True, high_open=True),
        r("optim.clip_norm", o.clip_norm, 0, high_open=True, meaning=f" (0: {OFF_AT_ZERO['optim.clip_norm']})"),
        r("optim.loss_scale_period", o.loss_scale_period, 1, INT32_MAX),
    ]
    if isinstance(t.microbatches, int):
        problems.append(r("train.microbatches", t.microbatches, 1, meaning=" or 'auto'"))
    if cfg.log.peak_tflops is not None:
        problems.append(r("log.peak_tflops", cfg.log.peak_tflops, 0, low_open=True, high_open=True, meaning=" (per-device peak in TFLOP/s)"))
    if cfg.log.prometheus_port is not None:
        problems.append(r("log.prometheus_port", cfg.log.prometheus_port, 1, 65535, meaning=" (a free TCP port)"))
    for level in ("ici", "dcn"):
        sizes = getattr(cfg.mesh, level)
        for axis, size in zip(MESH_AXES, sizes.as_tuple()):
            if size < 1 and size != -1:
                problems.append(f"mesh.{level}.{axis}={size} must be a positive integer or -1 (fill)")
        if sizes.as_tuple().count(-1) > 1:
            problems.append(f"at most one mesh.{level} axis may be -1, got {sizes}")
    return [p for p in problems if p]


def check(cfg: Config) -> None:
    """Checks that need no devices; raises UserError with every problem found."""
    problems = list(cfg.model.problems())
    t, d = cfg.train, cfg.data
    if isinstance(t.microbatches, str) and t.microbatches != "auto":
        problems.append(f"train.microbatches={t.microbatches!r} must be a positive integer or 'auto'")
    problems.extend(range_problems(cfg))
    problems.extend(steps_problems(cfg))
    problems.extend(log_problems(cfg))
    if cfg.optim.grad_dtype not in ("float32", "bfloat16"):
        problems.append(f"optim.grad_dtype={cfg.optim.grad_dtype!r} must be float32 or bfloat16 (gradients summed across devices in bfloat16)")
    if cfg.optim.schedule not in SCHEDULES:
        problems.append(f"optim.schedule={cfg.optim.schedule!r} is not a learning-rate schedule; choose one of {', '.join(SCHEDULES)}")
    if cfg.optim.decay_shape not in DECAY_SHAPES:
        problems.append(f"optim.decay_shape={cfg.optim.decay_shape!r} is not a decay shape; choose one of {', '.join(DECAY_SHAPES)}")
    if cfg.optim.grad_sync not in GRAD_SYNCS:
        problems.append(f"optim.grad_sync={cfg.optim.grad_sync!r} must be one of {', '.join(GRAD_SYNCS)} (when gradients are summed "
                        "across the batch shards: once per step, or in every micro-batch's backward pass)")
    elif cfg.optim.grad_sync == "microbatch" and cfg.optim.grad_dtype != "float32":
        problems.append(f"optim.grad_sync=microbatch with optim.grad_dtype={cfg.optim.grad_dtype}: narrower sums run once per step, "
                        "after the last micro-batch; use optim.grad_sync=auto or step, or optim.grad_dtype=float32")
    if cfg.model.param_dtype == "float16":  # bfloat16 parameters (LoRA runs) keep float32's range; float16's do not
        problems.append(f"model.param_dtype=float16 (with model.dtype={cfg.model.dtype}) keeps no float32 master weights: small updates "
                        "vanish and small float16 gradients underflow, which loss scaling (model.dtype=float16) cannot undo; "
                        "set model.param_dtype=float32, or bfloat16 to halve the weights' memory")
    microbatches = 1 if isinstance(t.microbatches, str) else t.microbatches
    if t.loss_chunk < 0 or (t.loss_chunk > 0 and d.seq_len > 0 and d.seq_len % t.loss_chunk):
        problems.append(f"train.loss_chunk={t.loss_chunk} must be 0 (off) or a positive divisor of data.seq_len={d.seq_len}")
    if t.compile_cache == "":
        problems.append("train.compile_cache is empty; give auto, a folder path, or false (no cache)")
    elif isinstance(t.compile_cache, str) and t.compile_cache.lower() in ("none", "null"):  # off for other keys, a folder here
        problems.append(f"train.compile_cache={t.compile_cache} names a folder '{t.compile_cache}', not no cache; give false for no cache, "
                        f"or ./{t.compile_cache} for that folder")
    if d.path == "":  # Path("") is the working directory
        problems.append("data.path is empty; give a directory of text files, a .jsonl file or a token file (.npy, .bin)")
    for key, value, what in (("data.tokenizer", d.tokenizer, "a tokenizer.json or a directory holding one, or none for raw bytes"),
                             ("log.wandb", cfg.log.wandb, "a W&B project name, or none"),
                             ("log.mlflow", cfg.log.mlflow, "an MLflow experiment name, or none")):
        if value == "":  # '' read as off: data.tokenizer="$TOK" with TOK unset trained on raw bytes without a word
            problems.append(f"{key} is empty (an unset shell variable?); give {what}")
    if d.format not in DATA_FORMATS:
        problems.append(f"data.format={d.format!r} must be one of {', '.join(DATA_FORMATS)}")
    if microbatches > 0 and t.global_batch % microbatches:
        problems.append(f"train.global_batch={t.global_batch} is not divisible by train.microbatches={t.microbatches}")
    if problems:
        raise UserError("; ".join(problems))
