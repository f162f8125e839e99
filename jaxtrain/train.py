"""The training loop: config -> mesh -> sharded state -> compiled step -> loop with metrics.

``build`` does every check and compiles, touching no file; ``train`` then owns the run directory.
"""

from __future__ import annotations

import dataclasses
import json
import sys
import time
from pathlib import Path
from typing import Any, Callable, Iterable

import jax
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding

from jaxtrain import checkpoint as checkpoint_lib
from jaxtrain import compile_cache
from jaxtrain import config as config_lib
from jaxtrain import data as data_lib
from jaxtrain.observe import exporters
from jaxtrain.adapt import lora as lora_lib
from jaxtrain.adapt.adapters import read_record, split_frozen
from jaxtrain.plan import estimate as plan
from jaxtrain.config import Config
from jaxtrain.data.tokenizer import TOKENIZER_FILE
from jaxtrain.distributed import LostPeer, lost_peer
from jaxtrain.errors import UserError
from jaxtrain.interop import hf_config, hf_import, peft
from jaxtrain.layout import Layout, compile_train_step, lower_eval_step, with_train_steps
from jaxtrain.observe.metrics import MetricsLog
from jaxtrain.observe.records import CHECKPOINTS_DIR, committed_steps, read_records
from jaxtrain.optim import learning_rate_schedule
from jaxtrain.state import TrainState, model_spec, state_from_params, state_initializer
from jaxtrain.step import schedule_count
from jaxtrain.models.config import LlamaConfig


@dataclasses.dataclass
class Trainer:
    """Everything a run needs, validated and compiled; nothing written to disk yet."""

    layout: Layout
    corpus: data_lib.Corpus
    train_step: Callable[[TrainState, dict], tuple[TrainState, dict]]  # compiled; donates the state
    eval_step: Callable[[dict, dict], tuple[jax.Array, jax.Array]]  # compiled: (summed nats, counted tokens)
    compile_s: float
    compiled: compile_cache.CacheCount  # of the steps' programs, how many the compilation cache gave back
    initializer: Callable[[], TrainState]  # jitted: compiles on the first fresh state, not on every run
    microbatches_auto: str | None = None  # metrics.startup_summary's: how train.microbatches=auto chose the count

    @classmethod
    def of(cls, layout: Layout, corpus: data_lib.Corpus, train_step, eval_step, compile_s: float,
           compiled: compile_cache.CacheCount, microbatches_auto: str | None = None) -> Trainer:
        cfg = layout.cfg
        return cls(layout, corpus, train_step, eval_step, compile_s, compiled,
                   state_initializer(cfg.model, layout.tx, cfg.train.seed, layout.shardings, layout.spike_window), microbatches_auto)

    @property
    def cfg(self) -> Config:
        return self.layout.cfg

    @property
    def mesh(self) -> Mesh:
        return self.layout.mesh

    @property
    def batch_sharding(self) -> NamedSharding:
        return self.layout.batch_sharding

    def init_state(self) -> TrainState:
        return self.initializer()

    @property
    def tokens_per_step(self) -> int:
        return self.layout.tokens_per_step


@dataclasses.dataclass(frozen=True)
class Checked:
    """A config checked against the devices, mesh, rules, model and data: all a resume needs, nothing compiled."""

    layout: Layout  # under train.microbatches=auto, one pass until ``compile_steps`` fits the count
    corpus: data_lib.Corpus
    memory_limit: float | None  # train.microbatches=auto: the bytes the compiled step must fit; None to compile as is
    microbatches_auto: bool = False  # train.microbatches=auto (with no memory_limit: these devices report no memory size)


def check(cfg: Config, corpus: data_lib.Corpus | None = None, devices: list | None = None, run_dir: Path | None = None) -> Checked:
    """Validate the config against the devices, mesh, rules, model and data, without compiling; ``run_dir``: the run
    it starts or resumes, whose checkpoint train.epochs counts on from (``_epoch_steps``)."""
    if problems := config_lib.optimizer_rounding_problems(cfg):
        raise UserError("; ".join(problems))
    limit = plan.memory_limit(devices) if cfg.train.microbatches == "auto" else None  # None on CPU: one pass
    kind = (devices or jax.devices())[0].platform
    if cfg.model.attention == "cudnn" and kind != "gpu":
        raise UserError(f"model.attention=cudnn (cuDNN flash attention) runs only on NVIDIA GPUs and these devices are {kind}; "
                        "use model.attention=auto or xla")
    layout = plan.unfitted_layout(cfg, devices)  # every check before the data is read
    plan.check_host_memory(layout)
    corpus = corpus or data_lib.load_data(cfg.data)
    data_lib.check_sizes(corpus, cfg.data, cfg.train.global_batch, cfg.model.vocab_size)
    if cfg.train.epochs:
        layout = with_train_steps(layout, _epoch_steps(run_dir, cfg, corpus, layout.batch_sharding))
        if problems := config_lib.steps_problems(layout.cfg, epochs_counted=True):
            raise UserError("; ".join(problems))
    return Checked(layout, corpus, limit, cfg.train.microbatches == "auto")


def _epoch_steps(run_dir: Path | None, cfg: Config, corpus: data_lib.Corpus, sharding: NamedSharding) -> int:
    """train.epochs as steps. A run resumed on the stream its latest checkpoint read (no data key or file that changes
    it, ``_data_order_changes``, ``_other_data``) counts on from that checkpoint: the steps it has taken and those its
    data position needs to read the rest under this train.global_batch (counted from the beginning, a resume with
    another batch counted as if the whole run had read with it: doubling it half-way ended the run there, half the
    epochs unread); where train.epochs and every key of the data's order are the checkpoint's too, the steps it was
    written with, not counted again (counting instruction data packs every example of the epochs, about 3,500 a second
    on a 2-core VM: minutes at every start of a preempted run). A fresh run, or one resumed on another stream, counts
    from the data's beginning."""
    def count(start: dict | None = None) -> int:
        return data_lib.steps_for_epochs(corpus, cfg.data, cfg.train.global_batch, sharding, cfg.train.epochs, start)

    steps = [] if run_dir is None else committed_steps(run_dir / CHECKPOINTS_DIR)
    if not steps:
        return count()
    step_dir = run_dir / CHECKPOINTS_DIR / str(steps[-1])
    try:
        then = checkpoint_lib.saved_config(step_dir)
        before = config_lib.from_dict({"train": {"global_batch": then["train"]["global_batch"]}, "data": then["data"]})
        counted, epochs = then["train"]["steps"], then["train"]["epochs"]
        position = checkpoint_lib.saved_data_position(step_dir)
    except (OSError, ValueError, KeyError, UserError):  # an older or damaged checkpoint's records: from the beginning
        return count()
    changes = _data_order_changes(before, cfg)
    if any(not same for *_, same in changes.values()) or _other_data(step_dir, cfg, corpus) is not None:
        return count()
    if not changes and epochs == cfg.train.epochs:
        return counted
    return steps[-1] + count(position)


def compile_steps(checked: Checked) -> Trainer:
    """Compile the train and eval steps (under train.microbatches=auto, the fewest micro-batches whose compiled
    train step fits the device)."""
    start = time.perf_counter()
    with compile_cache.counting() as compiled:
        if checked.memory_limit is None:
            layout = checked.layout
            train_step, _ = compile_train_step(layout)
        else:
            layout, train_step = plan.fit_microbatches(checked.layout, checked.memory_limit, compile_train_step)
        eval_step = lower_eval_step(layout).compile()
    auto = None if not checked.microbatches_auto else "unsized" if checked.memory_limit is None else "fitted"
    return Trainer.of(layout, checked.corpus, train_step, eval_step, time.perf_counter() - start, compiled, auto)


def build(cfg: Config, corpus: data_lib.Corpus | None = None, devices: list | None = None) -> Trainer:
    """Check, then compile the steps."""
    return compile_steps(check(cfg, corpus, devices))


def evaluate(trainer: Trainer, params: dict, batches: Iterable[dict]) -> tuple[float, int]:
    """Mean nats per counted token over the validation batches (``data.eval_batches``, each put on the devices as it
    is scored), and the count."""
    nll = tokens = 0.0
    for batch in batches:
        # each batch's sums fetched before the next step is dispatched: XLA:CPU runs independent dispatched steps at
        # once, and with 100 in flight on 8 simulated devices their collectives' rendezvous deadlocked (aborted, status 134)
        batch_nll, batch_tokens = trainer.eval_step(params, batch)
        nll, tokens = nll + float(batch_nll), tokens + float(batch_tokens)
    return nll / tokens, int(tokens)


def check_run_dir(run_dir: Path) -> None:
    """Before any compile: the run directory must be a directory or not exist yet."""
    if run_dir.exists() and not run_dir.is_dir():
        raise UserError(f"--run-dir {run_dir} is an existing file, not a directory; give a new or existing run directory")
    # --run-dir for --init-from trained, writing checkpoints and config.yaml among the model's files (a QA report)
    if hf_config.is_hf_dir(run_dir) and not (run_dir / "config.yaml").exists():
        raise UserError(f"--run-dir {run_dir} is a Hugging Face model directory (config.json); give a new directory for the run, "
                        f"and --init-from {run_dir} to start from that model")


def train(cfg: Config, run_dir: Path, trainer: Trainer | None = None, *, init_from: Path | None = None,
          params_only: bool = False) -> TrainState:
    """Train to ``cfg.train.steps``, resuming from RUN_DIR's latest checkpoint if any; raises
    ``checkpoint.Preempted`` after committing a checkpoint when preempted (SIGTERM) or interrupted (a Ctrl-C in the
    training loop), and ``checkpoint.Interrupted`` on a second Ctrl-C there. A Ctrl-C before the first step is
    KeyboardInterrupt, with no checkpoint written."""
    check_run_dir(run_dir)
    # a mistyped path fails before the compile; a resumed run ignores --init-from, which may be gone since (a step of a
    # run training on, removed by its checkpoint.keep)
    if init_from is not None and not hf_config.is_hf_dir(init_from) and not checkpoint_lib.has_checkpoints(run_dir):
        _check_not_peft_adapter(init_from)
        _check_not_lora_run(init_from, checkpoint_lib.checkpoints_dir(init_from, "--init-from")[0].parent)
    if cfg.log.prometheus_port and jax.process_index() == 0:
        exporters.check_port_free(cfg.log.prometheus_port)
    if cfg.log.mlflow and jax.process_index() == 0:
        exporters.check_mlflow(cfg.log.mlflow, run_dir)
    if checkpoint_lib.has_checkpoints(run_dir):  # a resume with another model fails before the compile
        try:
            checkpoint_lib.check_resume_shapes(run_dir, split_frozen(model_spec(cfg.model).shapes)[0])
        except UserError as e:
            # the run's shape came from --init-from HF_DIR's config.json, which a resume without it does not read
            if init_from is None and (run_dir / hf_config.RUN_SUBDIR).is_dir():
                raise UserError(f"{run_dir} started from a Hugging Face model, whose config.json gives the model's shape: "
                                f"give --init-from that model's directory again, as the run's first command did ({e})") from None
            raise
        if cfg.model.lora.rank:
            lora_lib.check_resume_dtype(run_dir, cfg.model)
    with compile_cache.using(cfg.train.compile_cache) as cache_dir:
        return _train(cfg, run_dir, trainer, init_from, params_only, cache_dir)


def _train(cfg: Config, run_dir: Path, trainer: Trainer | None, init_from: Path | None, params_only: bool,
           cache_dir: Path | None) -> TrainState:
    checked = Checked(trainer.layout, trainer.corpus, None) if trainer else check(cfg, run_dir=run_dir)
    fresh = not checkpoint_lib.has_checkpoints(run_dir)
    if fresh:  # compiled before the run directory is made: a config only the tracer refuses leaves none behind
        trainer = trainer or compile_steps(checked)
    # a resumed run compiles only once its checkpoint is read: a finished one started again compiles nothing
    layout = checked.layout
    requested = cfg.model
    cfg = layout.cfg  # model.attention and scan_layers resolved for the devices
    t = cfg.train
    batches = data_lib.train_batches(checked.corpus, cfg.data, t.global_batch, layout.batch_sharding)
    # every check of --init-from (path, complete checkpoint, shapes) before the run directory is touched
    # a LoRA run: --init-from names the frozen base, loaded (and checked against the run's record) on every start
    base = lora_lib.run_base(layout, run_dir, init_from) if cfg.model.lora.rank else None
    if fresh and init_from is not None and hf_config.is_hf_dir(init_from):
        _note_past_source_context(init_from, cfg.data.seq_len)
    if base is not None and base.record["path"] is None and fresh:
        _say(f"jaxtrain: note: no --init-from, so the LoRA adapters train on a base initialised from train.seed="
             f"{base.record['seed']}, not on a trained model; give --init-from HF_DIR (or a run directory) to adapt one")
    initial = (None if init_from is None or base is not None or not fresh
               else _init_from(layout, init_from, batches, checked.corpus, params_only))
    if jax.process_index() == 0:
        try:
            run_dir.mkdir(parents=True, exist_ok=True)
        except OSError as e:  # where access(2) let it pass (a full disk; root, to whom /proc looks writable): a traceback
            raise UserError(f"--run-dir {run_dir}: cannot make the directory ({e.strerror}); give a path in a writable directory") from None
    checkpoints = checkpoint_lib.RunCheckpoints(run_dir, cfg.checkpoint, t.steps)
    log = None
    try:  # from here on every exit closes the checkpoints (and the SIGTERM handler) and the metrics log
        state = checkpoints.restore_latest(layout.abstract_state(), batches.iterator)
        owes_evaluation = state is not None and _final_evaluation_owed(run_dir, int(state.step), t.steps)
        finished = state is not None and int(state.step) >= t.steps and not owes_evaluation
        if state is not None and not finished:
            _say(checkpoints.resumed_line)
            if owes_evaluation:
                _say(f"jaxtrain: note: the evaluation of step {t.steps}, the last, has no record in {run_dir / 'metrics.jsonl'} "
                     "(the run stopped after its checkpoint, before it): evaluating it now")
            if _keeps_plain_seeds(batches, cfg.data.seed):
                seed = cfg.data.seed
                _say(f"jaxtrain: note: the checkpoint's data position predates spread shuffle seeds, so the run keeps its order "
                     f"(grain's seed is data.seed={seed} itself, whose epoch e + 1 is seed {seed + 1}'s epoch e); "
                     "new runs spread data.seed")
        if state is not None and init_from is not None and base is None:
            _say(f"jaxtrain: note: --init-from {init_from} is not used: the run resumes from its own checkpoint "
                 "(--init-from starts a run only while it has none)")
        if base is not None:
            state = base.start_state(layout) if state is None else state.replace(frozen=base.frozen)
        if finished:  # a finished run started again: nothing to write but where its LoRA base is now
            goal, key = ((f"the {t.steps} steps train.epochs={t.epochs:g} came to", "train.epochs") if t.epochs
                         else (f"train.steps={t.steps}", "train.steps"))
            _say(f"jaxtrain: {run_dir} is already at step {int(state.step)} of {goal}, nothing to do; raise {key} to train on")
            if base is not None and jax.process_index() == 0 and lora_lib.record_moved_base(run_dir, base):
                _say(f"jaxtrain: note: {run_dir / lora_lib.BASE_RECORD} now names the LoRA base at {base.record['path']} "
                     "(the same content hash), for export-hf and generate")
        else:
            if state is None and initial is None and init_from is not None:  # the run's own checkpoints were all unreadable
                initial = _init_from(layout, init_from, batches, checked.corpus, params_only)
            trainer = trainer or compile_steps(checked)
            checkpoints.meta = _checkpoint_meta(trainer) | ({"lora_base": base.record} if base is not None else {})
            if state is None:
                state = trainer.init_state() if initial is None else initial
            if not fresh:
                _note_model_changes(run_dir, cfg, requested)
                _note_optimizer_changes(run_dir, cfg, state)
                other_data = checkpoints.restored and _other_data(checkpoints.directory / str(checkpoints.restored[0]), cfg,
                                                                  checked.corpus)
                _note_data_order_changes(run_dir, cfg, batches, other_data)
                _note_evaluation_changes(run_dir, cfg)
            if checkpoints.restored:
                _note_layout_changes(checkpoints.directory / str(checkpoints.restored[0]), trainer)
            # only now, once the run's own checkpoint fits this config: a refused start leaves the run directory as it was
            _write_run_files(trainer, run_dir, base, init_from if fresh else None)
            eval_data = data_lib.eval_batches(checked.corpus, cfg.data, t.global_batch, layout.batch_sharding, t.eval_batches)
            if jax.process_count() > 1:  # the first record's clock starts once every process has come this far: process 0,
                # its step read back from the compilation cache, had timed its first step waiting for a process still compiling
                multihost_utils.sync_global_devices("jaxtrain: the steps start")
            epoch = data_lib.epoch(checked.corpus, cfg.data)
            log = MetricsLog(trainer.layout, run_dir, int(state.step), compile_s=trainer.compile_s,
                             compile_cache=trainer.compiled.record(cache_dir), data=checked.corpus.description,
                             enabled=jax.process_index() == 0, microbatches_auto=trainer.microbatches_auto,
                             epoch=epoch, data_position=batches.position(),
                             # a compiled step gives its program for the profile's summary; a wrapped one (tests) none
                             step_program=getattr(trainer.train_step, "as_text", None))
            if checkpoints.restored:  # the checkpoint to fall back on (Prometheus: age since it was written, not NaN)
                log.checkpoint_saved(*checkpoints.restored)
            state = _loop(trainer, state, batches, epoch, eval_data, checkpoints, log)
    except BaseException as e:  # the error in flight is the one to report: one in closing is only a warning
        if isinstance(e, LostPeer) or lost_peer(e):  # the saves in flight wait on processes that are gone: wait for nothing
            checkpoints.abandon()
            if log is not None:
                log.close("FAILED")
            raise e if isinstance(e, LostPeer) else LostPeer("a collective with the job's other processes", e) from None
        _close(log, checkpoints, error=e)
        if isinstance(e, KeyboardInterrupt) and checkpoints.preemption.watching:  # a second Ctrl-C, in the loop
            raise checkpoints.interrupted_error() from None
        raise
    try:
        _close(log, checkpoints, error=None)
    except KeyboardInterrupt:  # a Ctrl-C while the last save is written (the first one lets it finish)
        raise checkpoints.interrupted_error() from None
    return state


# model keys that choose how the same function is computed (memory, speed, rounding), not which: no resume note
HOW_NOT_WHAT = ("model.remat", "model.attention", "model.scan_layers", "model.pipeline.", "model.moe.grouped_matmul")


def _note_model_changes(run_dir: Path, cfg: Config, requested: LlamaConfig) -> None:
    """A note per model key whose value differs from the run's config.yaml (its last start): a resume with, say,
    another model.rope_theta or model.lora.alpha fits the checkpoint's shapes but trains another function from here.
    A key of ``HOW_NOT_WHAT`` is not one (a QA report: another pipeline schedule was noted as another function), nor
    is a key left at ``auto``: jaxtrain chose it for these devices (a pipelined run resumed on a plain mesh,
    a CPU run on a GPU), the same function computed another way, and the start-up summary names the choice."""
    if not (run_dir / "config.yaml").is_file():
        return
    before = config_lib.flatten(config_lib.to_dict(config_lib.load_run_config(run_dir).model), "model.")
    chosen_here = {key for key, value in config_lib.flatten(config_lib.to_dict(requested), "model.").items() if value == "auto"}
    for key, value in config_lib.flatten(config_lib.to_dict(cfg.model), "model.").items():
        if key not in chosen_here and not key.startswith(HOW_NOT_WHAT) and before.get(key) != value:
            _note_trains_with(key, value, before.get(key), run_dir)


def _note_trains_with(key: str, value, before, run_dir: Path) -> None:
    now, then = config_lib.as_override(value), config_lib.as_override(before)
    fix = f"give {key}={then}"
    if key.removeprefix("model.") in hf_config.SHAPE_KEYS and (run_dir / hf_config.RUN_SUBDIR).is_dir():
        # --init-from's config.json decides it, and refuses it given on the command line (that advice was an error)
        fix = f"give --init-from the model directory the run started from (its config.json is kept in {run_dir / hf_config.RUN_SUBDIR})"
    _say(f"jaxtrain: note: {key}={now} here but {then} in {run_dir / 'config.yaml'}, which the checkpoints trained with: from "
         f"this step on the run trains with {now}; {fix} to continue as before")


# optimizer keys that choose how the same update is computed or where it is kept, not which: no resume note
OPTIM_HOW_NOT_WHAT = ("optim.offload", "optim.grad_dtype", "optim.grad_sync")
# what the learning rate of an update depends on (jaxtrain/optim.py learning_rate_schedule)
SCHEDULE_KEYS = ("optim.lr", "optim.warmup_steps", "optim.min_lr_ratio", "optim.schedule", "optim.decay_fraction", "optim.decay_shape",
                 "train.steps")


def _note_optimizer_changes(run_dir: Path, cfg: Config, state: TrainState) -> None:
    """Resumed with another optimizer setting, the run trains on with it: a note per changed optimizer key, as for the
    model's; the learning-rate schedule's keys (with train.steps, where the decay ends) in one, with the rate of the
    next update under this schedule and under the run's last start's (raising train.steps to extend a run: a cosine's
    rate jumps back up, a wsd schedule's in its stable phase stays)."""
    if not (run_dir / "config.yaml").is_file():
        return
    saved = config_lib.load_run_config(run_dir)

    def settings(c: Config) -> dict:
        return config_lib.flatten(config_lib.to_dict(c.optim), "optim.") | {"train.steps": c.train.steps}

    then, now = settings(saved), settings(cfg)
    changed = [key for key in now if now[key] != then.get(key) and key not in OPTIM_HOW_NOT_WHAT]
    for key in changed:
        if key not in SCHEDULE_KEYS:
            _note_trains_with(key, now[key], then.get(key), run_dir)
    schedule = [key for key in changed if key in SCHEDULE_KEYS]
    if schedule:
        update = int(schedule_count(state.opt_state))  # counted from 0: the next update's
        here, before = (float(learning_rate_schedule(c)(update)) for c in (cfg, saved))
        differences = ", ".join(f"{key}={config_lib.as_override(now[key])} here but {config_lib.as_override(then.get(key))} there"
                                for key in schedule)
        _say(f"jaxtrain: note: the learning-rate schedule differs from that of {run_dir / 'config.yaml'}, which the checkpoints "
             f"trained with ({differences}): the next update's rate is {here:.4g}, {before:.4g} under the run's schedule")


# keys that keep the examples and their order, so the data position (a count of them read) stays exact: instruction
# data's, cut or packed another way; plain text reads none of them
SAME_EXAMPLES = {"sft": ("data.seq_len", "data.pack", "data.truncate"), "text": ()}
UNREAD = {"sft": (), "text": ("data.pack", "data.truncate")}


def _data_order_changes(before: Config, cfg: Config) -> dict[str, tuple[str, str, bool]]:
    """Each key that decides which sequences come next (``train.global_batch`` and every ``data.*`` key) whose value
    differs in ``before``: key -> (value here, value before, whether the data position still counts the same stream)."""
    def data_order(c: Config) -> dict:
        # the files data.path and data.tokenizer name, not their spelling: `corpus` and `../here/corpus`, a symbolic link
        # and its target, a tokenizer's directory and its tokenizer.json are one each (a QA report: those resumed with a
        # note of another stream, and --init-from started the data again from its beginning)
        path, tokenizer = (c.data.path and Path(c.data.path).resolve()), (c.data.tokenizer and Path(c.data.tokenizer).resolve())
        if tokenizer and (tokenizer / TOKENIZER_FILE).is_file():
            tokenizer /= TOKENIZER_FILE
        data = dataclasses.replace(c.data, path=path and str(path), tokenizer=tokenizer and str(tokenizer))
        return {"train.global_batch": c.train.global_batch} | config_lib.flatten(config_lib.to_dict(data), "data.")

    then, now = data_order(before), data_order(cfg)
    same_stream = ("train.global_batch", *SAME_EXAMPLES[cfg.data.format])
    return {key: (config_lib.as_override(value), config_lib.as_override(then[key]), key in same_stream)
            for key, value in now.items() if then[key] != value and key not in UNREAD[cfg.data.format]}


def _note_data_order_changes(run_dir: Path, cfg: Config, batches: data_lib.GlobalBatches, other_data: str | None) -> None:
    """A note per key that decides which sequences come next whose value differs from the run's config.yaml: the
    checkpoint's data position counts the sequences (instruction data: examples) read, so another batch size goes on
    at the next one, while another stream (sequence length, shuffle, data) starts elsewhere in it. Where no key makes
    another stream, ``other_data`` (``_other_data``: files added to data.path) may."""
    if not (run_dir / "config.yaml").is_file():
        return
    where, read, unit = run_dir / "config.yaml", batches.position(), batches.unit
    changes = _data_order_changes(config_lib.load_run_config(run_dir), cfg)
    if other_data and all(same_stream for *_, same_stream in changes.values()):
        _say(f"jaxtrain: note: {other_data}, whose {unit} the checkpoint's data position counts ({read} read): here it goes "
             f"on at position {read} of another stream, so {unit} are skipped or seen twice; put the files back as they were "
             "to continue where the run stopped")
    for key, (now, then, same_stream) in changes.items():
        if same_stream:
            _say(f"jaxtrain: note: {key}={now} here but {then} in {where}: the data goes on after the {read} {unit} the "
                 f"checkpoint's position counts, none skipped or read twice")
        else:
            _say(f"jaxtrain: note: {key}={now} here but {then} in {where}, whose {unit} the checkpoint's data position "
                 f"counts ({read} read): here it goes on at position {read} of another stream, so {unit} are skipped or "
                 f"seen twice; give {key}={then} to continue where the run stopped")


def _note_evaluation_changes(run_dir: Path, cfg: Config) -> None:
    """A note where a resume evaluates another number of validation sequences (the first train.eval_batches batches of
    train.global_batch): its eval_loss is then taken over other sequences than the earlier records' (a QA report: no
    word of it)."""
    if not (run_dir / "config.yaml").is_file():
        return
    before = config_lib.load_run_config(run_dir).train
    now, then = cfg.train.eval_batches * cfg.train.global_batch, before.eval_batches * before.global_batch
    if now != then:
        _say(f"jaxtrain: note: the evaluation scores train.eval_batches x train.global_batch = {cfg.train.eval_batches} x "
             f"{cfg.train.global_batch} validation sequences here, {before.eval_batches} x {before.global_batch} in "
             f"{run_dir / 'config.yaml'}: eval_loss from here on is taken over other sequences than the earlier records'")


def _note_layout_changes(step_dir: Path, trainer: Trainer) -> None:
    """A note where the run resumes onto another mesh, rule set or number of processes than its checkpoint was written
    on: the state reads onto the new layout exactly, but the steps from here sum over another split of the work, so the
    losses leave the uninterrupted run's in their last bits, where a same-layout resume is bit for bit, and nothing
    said why. A checkpoint whose meta predates the record is passed in silence."""
    then = checkpoint_lib.saved_meta(step_dir)
    now = _resolved(trainer) | {"rules": trainer.cfg.rules}
    compared = ("mesh", "sharding_rules", "processes")
    if any(key not in then for key in compared) or all(then[key] == now[key] for key in compared):
        return

    def layout(meta: dict) -> str:
        return f"mesh {config_lib.describe_axes(meta['mesh'])}, rules {meta.get('rules', '?')}, {meta['processes']} process(es)"

    _say(f"jaxtrain: note: checkpoint {step_dir} was written on {layout(then)}; here {layout(now)}: its state was read onto "
         "this layout exactly, but the steps from here sum in another order, so the losses follow the old layout's to "
         "rounding, not bit for bit; resume on the old mesh, rules and process count to continue bit for bit")


def _write_run_files(trainer: Trainer, run_dir: Path, base: lora_lib.Base | None, fresh_init_from: Path | None) -> None:
    """config.yaml (what `jaxtrain generate` and `export-hf` read), a LoRA run's base record and, for a fresh run from
    a Hugging Face model, its tokenizer and config; process 0 only."""
    if jax.process_index() != 0:
        return
    cfg = trainer.cfg
    config_lib.save_yaml(cfg, run_dir / "config.yaml", {"resolved": _resolved(trainer)})
    if base is not None:
        lora_lib.write_record(run_dir, base, cfg.model)
    if fresh_init_from is not None and hf_config.is_hf_dir(fresh_init_from):  # its tokenizer and config, for generate and export
        hf_import.keep_source_files(fresh_init_from, run_dir)


def _loop(trainer: Trainer, state: TrainState, batches: data_lib.GlobalBatches, epoch: data_lib.Epoch, eval_data: data_lib.HostBatches,
          checkpoints: checkpoint_lib.RunCheckpoints, log: MetricsLog) -> TrainState:
    """The steps from ``state``'s to ``train.steps``, with their records, checkpoints and evaluations; ``epoch``, the
    training split's, tells the records and checkpoints the epochs read."""
    t = trainer.cfg.train
    checkpoints.preemption.watch_interrupts()  # a Ctrl-C from here on stops after the step, with a checkpoint
    resumed = int(state.step)
    if (0 < resumed < t.steps and t.eval_every and resumed % t.eval_every == 0) or resumed == t.steps:
        # a stop at an evaluation step comes after its checkpoint, before its evaluation: done now, recorded unless it
        # was (every process evaluates, as only process 0 reads the records); at the last step only when owed
        # (_final_evaluation_owed)
        _evaluate(trainer, state, eval_data, log, resumed)
    for step in range(resumed + 1, t.steps + 1):
        with log.timer("data_wait_s"):
            batch = next(batches)
        log.before_step(step)
        state, metrics = trainer.train_step(state, batch)
        preempted = checkpoints.preempted(step)
        # a record of the steps since the last one before any save (a preemption save too); raises NonFiniteError
        # before a checkpoint of a bad step is written
        read = batches.position()
        log.after_step(step, metrics, flush=preempted, data_position=read)
        with log.timer("checkpoint_s"):  # raises Preempted once committed
            checkpoints.after_step(step, state, batches.iterator, preempted=preempted, epoch=epoch.of(read))
        if (committed := checkpoints.newly_committed()) is not None:
            log.checkpoint_saved(*committed)
        if step == t.steps or (t.eval_every and step % t.eval_every == 0):
            _evaluate(trainer, state, eval_data, log, step)
    return state


def _final_evaluation_owed(run_dir: Path, step: int, steps: int) -> bool:
    """Whether a run restored at its last step has no record of that step's evaluation: stopped between the last
    checkpoint and the evaluation after it (killed, a second Ctrl-C, an error in the evaluation), it had stayed without
    one, as a re-run had nothing to do. Process 0's metrics.jsonl decides for every process."""
    owed = False
    if step == steps and jax.process_index() == 0:
        path = run_dir / "metrics.jsonl"
        owed = not any(r["step"] == step and "eval_loss" in r for r in (read_records(path) if path.exists() else []))
    return bool(multihost_utils.broadcast_one_to_all(np.array(owed))) if jax.process_count() > 1 else owed


def _evaluate(trainer: Trainer, state: TrainState, eval_data: data_lib.HostBatches, log: MetricsLog, step: int) -> None:
    # the train steps still running on the devices are step time: waited for inside the timer, they read as eval_s and
    # tokens/s and MFU read high
    jax.block_until_ready(state.params)
    started = time.perf_counter()
    with log.timer("eval_s"):
        eval_loss, eval_tokens = evaluate(trainer, state.model_params, eval_data)
    log.write({"step": step, "eval_loss": eval_loss, "eval_tokens": eval_tokens, "eval_s": time.perf_counter() - started})


def _say(line: str) -> None:
    if jax.process_index() == 0:
        print(line, file=sys.stderr, flush=True)


def _close(log: MetricsLog | None, checkpoints: checkpoint_lib.RunCheckpoints, *, error: BaseException | None) -> None:
    """Commit the saves already started (a stop on a non-finite value keeps them) and let go of everything; after a
    second Ctrl-C (the first asked for the stop) wait for nothing."""
    try:
        if isinstance(error, KeyboardInterrupt) and checkpoints.preemption.watching:
            checkpoints.abandon()
        else:
            checkpoints.close()
    except UserError as e:
        if error is None:
            raise
        print(f"jaxtrain: warning: {e}", file=sys.stderr, flush=True)
    finally:
        if log is not None:
            log.close("FINISHED" if error is None else "KILLED" if isinstance(error, (checkpoint_lib.Preempted, KeyboardInterrupt))
                      else "FAILED")


def _check_not_lora_run(init_from: Path, run_dir: Path) -> None:
    """A LoRA run's checkpoints hold its adapters alone: no model to start from, nor a base."""
    record = read_record(run_dir)
    if record is not None:
        base = record["path"] or f"initialised from train.seed={record['seed']}"
        raise UserError(f"--init-from {init_from} is a LoRA run, whose checkpoints hold only its adapters; start from its base "
                        f"({base}) or from its merged model: jaxtrain export-hf {run_dir} --out DIR, then --init-from DIR")


def _check_not_peft_adapter(init_from: Path) -> None:
    """A PEFT adapter directory holds adapters alone (it was "no checkpoints there"): say how adapters are used."""
    if not peft.is_adapter_dir(init_from):
        return
    try:  # the base's name is advice only: an adapter_config.json unreadable here is left to the commands that read it
        base = json.loads((init_from / peft.CONFIG_FILE).read_text()).get("base_model_name_or_path")
    except (OSError, ValueError, AttributeError):
        base = None
    raise UserError(f"--init-from {init_from} is a PEFT adapter ({peft.CONFIG_FILE}), which holds adapters, not a model to start "
                    f"from: give its base model{f' ({base})' if base else ''}, a Hugging Face model directory, to --init-from (new "
                    f"adapters on it: model.lora.rank > 0), and the adapter to jaxtrain generate BASE_DIR --adapter {init_from}; to "
                    "train on from the adapter, merge it into its base with peft (merge_and_unload) and --init-from the merged model")


def _init_from(layout: Layout, path: Path, batches: data_lib.GlobalBatches, corpus: data_lib.Corpus, params_only: bool) -> TrainState:
    """``--init-from``: a Hugging Face model directory's weights (fresh optimizer), or another run's whole state
    and data position, or only its parameters."""
    abstract = layout.abstract_state()
    if hf_config.is_hf_dir(path):
        params = hf_import.load_params(path, layout.cfg.model, abstract.params)
        return state_from_params(params, layout.tx, layout.shardings, layout.spike_window)
    if params_only:
        params = checkpoint_lib.restore_from(path, abstract, None, params_only=True)
        return state_from_params(params, layout.tx, layout.shardings, layout.spike_window)
    beginning = batches.iterator.get_state()
    data_format = layout.cfg.data.format
    step_dir, state = checkpoint_lib.restore_step_from(path, abstract, batches.iterator, params_only=False, data_format=data_format)
    written_with = checkpoint_lib.saved_data_format(step_dir)
    step, steps = int(state.step), layout.cfg.train.steps
    if step >= steps:  # else a run directory with nothing in it, started from there again on every re-run
        raise UserError(f"--init-from {path} is at step {step}, at or past train.steps={steps}, so nothing would train; "
                        f"raise train.steps above {step}, or add --params-only to start at step 0 from its parameters")
    applied = int(schedule_count(state.opt_state))  # the schedule counts applied updates: skipped ones hold it back
    schedule = f"step {step}" if applied == step else f"update {applied} (its run skipped {step - applied} of {step} updates)"
    data = (_take_data_position(step_dir, layout.cfg, batches, corpus, beginning) if written_with == data_format else
            f"not its data position, of data.format={written_with} (here {data_format}): this run's data starts from its beginning")
    _say(f"jaxtrain: note: --init-from {path} goes on from its step {step}: its optimizer state, the learning-rate schedule at "
         f"{schedule} and {data}; add --params-only to start at step 0 from its parameters alone")
    return state


def _note_past_source_context(hf_dir: Path, seq_len: int) -> None:
    """A note where a model is fine-tuned on longer sequences than its config.json's max_position_embeddings: it
    trains, with its rope as it is, on positions its source never saw (a QA report: nothing said so)."""
    limit, key = hf_config.context_length(hf_dir) or (None, None)
    if key == "max_position_embeddings" and seq_len > limit:
        _say(f"jaxtrain: note: data.seq_len={seq_len} is longer than {hf_dir}'s max_position_embeddings={limit}: the model "
             f"trains on positions its source was not trained on, with its rope unchanged; generate and export-hf take "
             f"{seq_len} positions as this run's context")


def _keeps_plain_seeds(batches: data_lib.GlobalBatches, seed: int) -> bool:
    """Whether the data goes on in an order that spreading ``data.seed`` changed: from a position written before the
    spread, of a seed the spread moves (0 is grain's seed 0 either way)."""
    return batches.iterator.seed_scheme == data_lib.PLAIN_SEEDS and data_lib.grain_seed(seed, data_lib.SPREAD_SEEDS) != seed


def _take_data_position(step_dir: Path, cfg: Config, batches: data_lib.GlobalBatches, corpus: data_lib.Corpus, beginning: dict) -> str:
    """Keep the data position ``--init-from`` restored where it counts this run's stream (the next sequence, or example,
    the run it comes from had not read, shuffled as it was: under its seed scheme); with another stream (sequence
    length, shuffle, data: continued training on new data) put the batches back at ``beginning``, where a count of
    another stream's would only skip that many, and a new stream's seed scheme. Returns what was done, for the note."""
    read, unit = batches.position(), batches.unit
    saved = checkpoint_lib.saved_config(step_dir)  # only what orders the data: its other keys may be an older jaxtrain's
    saved = config_lib.from_dict({"train": {"global_batch": saved["train"]["global_batch"]}, "data": saved["data"]})
    other = [f"{key}={now} here but {then} there" for key, (now, then, same) in _data_order_changes(saved, cfg).items() if not same]
    if not other and (files_changed := _other_data(step_dir, cfg, corpus)):  # the same keys, other files
        other = [files_changed]
    if not other:
        kept = (" in its order from before data.seed was spread over grain's shuffle seeds"
                if _keeps_plain_seeds(batches, cfg.data.seed) else "")
        return f"its data position, {read} {unit} read: this run reads on from the next one{kept}"
    batches.iterator.set_state(beginning)
    return (f"not its data position ({read} {unit} read), which counts another stream ({', '.join(other)}): this run's data "
            "starts from its beginning")


# the checkpoint meta's size of the training split (text: tokens; instruction data: examples): files added to or removed
# from the same data.path change the stream its data position counts, which no config key shows
TRAIN_SPLIT = "train_split"


def _checkpoint_meta(trainer: Trainer) -> dict[str, Any]:
    """How a checkpoint was laid out, for `jaxtrain checkpoints`, and the size of the training data it read."""
    # paths absolute: --init-from compares its data with the run's that starts from it, wherever each started
    return _resolved(trainer) | {"rules": trainer.cfg.rules, "config": config_lib.to_dict(config_lib.with_absolute_paths(trainer.cfg)),
                                 TRAIN_SPLIT: len(trainer.corpus.train)}


def _other_data(step_dir: Path, cfg: Config, corpus: data_lib.Corpus) -> str | None:
    """How the training data differs from that of the checkpoint ``step_dir``, where its size does (None where it is
    the same, or the checkpoint predates the record)."""
    then, now = checkpoint_lib.saved_meta(step_dir).get(TRAIN_SPLIT), len(corpus.train)
    if then is None or then == now:
        return None
    unit = "examples" if cfg.data.format == "sft" else "tokens"
    return (f"the training split of data.path={config_lib.as_override(cfg.data.path)} holds {now} {unit} here but {then} "
            f"in {step_dir} (documents added, removed or edited)")


def _resolved(trainer: Trainer) -> dict[str, Any]:
    return {
        "mesh": dict(trainer.mesh.shape),
        "devices": trainer.mesh.size,
        "processes": jax.process_count(),
        "sharding_rules": {k: list(v) if v else None for k, v in trainer.layout.rules.items()},
        "num_params": trainer.layout.spec.num_params,
    }

