"""Orbax checkpoints of a run: the sharded train state, the data pipeline's position and a JSON record
of how and when each step was written; resume, fallback past unreadable checkpoints, preemption.

A checkpoint is ``RUN_DIR/checkpoints/STEP/`` with three items: ``state`` (every process writes only
its own shards), ``data`` (grain iterator state, one file per process) and ``meta``. Orbax writes into
a temporary directory and renames it when complete, so a killed save never looks like a checkpoint.
"""

from __future__ import annotations

import dataclasses
import datetime
import fcntl
import json
import logging
import math
import os
import re
import shutil
import signal
import sys
import threading
import time
import traceback
from collections import Counter
from pathlib import Path

import grain.checkpoint
import jax
import numpy as np
import orbax.checkpoint as ocp
from jax.experimental import multihost_utils

from jaxtrain.config import CheckpointConfig, check_run_dir
from jaxtrain.data.pipeline import PLAIN_SEEDS, SEED_SCHEME, SEED_SCHEMES
from jaxtrain.distributed import LostPeer
from jaxtrain.errors import UserError
from jaxtrain.mesh import describe_axes
from jaxtrain.observe.records import CHECKPOINTS_DIR, committed_steps  # jax-free, for the adapter pool
from jaxtrain import spikes as spikes_lib

QUARANTINE_DIR = "unreadable_checkpoints"  # beside checkpoints/, so Orbax never lists them again
PREEMPTED_EXIT_STATUS = 143  # 128 + SIGTERM, what schedulers expect from a job that stopped on SIGTERM
INTERRUPTED_EXIT_STATUS = 130  # 128 + SIGINT, what a shell reports for a command stopped by Ctrl-C
_TMP_MARK = ".orbax-checkpoint-tmp"
# Replicas of a large array (data-parallel copies across hosts) still share its writing; a small one is written by one
# replica. Saving the tiny model's state on 8 CPU devices: first save 6.0 -> 0.3 s, later ones 0.45 -> 0.23 s
# (2026-12-03, 2-core Intel Xeon VM).
REPLICA_SLICE_MIN_BYTES = 1 << 20
# The layout of what a checkpoint holds (state tree, data position, meta record), recorded in each one's meta. Raise it
# with a change the jaxtrain before would misread or fail to read: that one then refuses such a checkpoint in one line
# (``_check_format``), where a jaxtrain without the record took a later layout for damage, moved the run's checkpoints
# aside and trained again from step 0. A checkpoint without the record is format 1 (its older layouts: ``_read``).
CHECKPOINT_FORMAT = 1
FORMAT_KEY = "checkpoint_format"


class Preempted(Exception):
    """The run stopped early on a preemption notice (SIGTERM) or a Ctrl-C (SIGINT, ``interrupted``), after committing
    a checkpoint of ``step``; ``status`` is the process's exit status (143 or 130)."""

    def __init__(self, step: int, *, interrupted: bool = False):
        what = "interrupted" if interrupted else "preempted"
        super().__init__(f"{what}: checkpoint of step {step} committed; run the same command again to resume")
        self.step = step
        self.status = INTERRUPTED_EXIT_STATUS if interrupted else PREEMPTED_EXIT_STATUS


class Interrupted(KeyboardInterrupt):
    """A second Ctrl-C in the training loop: the run stopped without waiting for a save in flight, which may still
    be writing in a background thread (only ending the process stops it)."""


class PreemptionWatch:
    """Whether to stop after the current step: a SIGTERM to this process, or, with several processes,
    jax's preemption sync point (every process agrees on the same step); or, once ``watch_interrupts`` is called
    (the training loop), a Ctrl-C. The first Ctrl-C asks for the same stop (with several processes it goes through
    the same sync point: this process gives itself the SIGTERM jax's notifier listens for) and gives SIGINT back to
    Python, so a second one raises KeyboardInterrupt: a user pressing Ctrl-C twice gets out."""

    def __init__(self):
        self.multiprocess = jax.process_count() > 1
        self.signalled = False
        self.interrupted = False
        self.watching = False  # the training loop began
        # several processes: jax's preemption notifier owns SIGTERM and syncs the hosts
        self._previous = None if self.multiprocess else signal.signal(signal.SIGTERM, self._on_sigterm)
        self._previous_int = None

    def _on_sigterm(self, signum, frame):
        self.signalled = True  # a second SIGTERM during the final save changes nothing

    def watch_interrupts(self) -> None:
        """From now on the first Ctrl-C stops after the current step (before, one stops the command at once: there
        is nothing to save). Not where SIGINT is ignored (a command started in the background by a shell script)."""
        self.watching = True
        if self._previous_int is None and signal.getsignal(signal.SIGINT) is signal.default_int_handler:
            self._previous_int = signal.signal(signal.SIGINT, self._on_sigint)

    def _on_sigint(self, signum, frame):
        self.interrupted = self.signalled = True
        signal.signal(signal.SIGINT, self._previous_int)  # the next Ctrl-C raises KeyboardInterrupt
        if self.multiprocess:
            signal.raise_signal(signal.SIGTERM)  # to jax's notifier, which agrees on the step with the other processes

    def reached(self, step: int) -> bool:
        if self.multiprocess:
            return multihost_utils.reached_preemption_sync_point(step)
        return self.signalled

    def close(self) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGTERM, self._previous)
            self._previous = None
        if self._previous_int is not None:
            signal.signal(signal.SIGINT, self._previous_int)
            self._previous_int = None


def _all_processes(ok: bool) -> bool:
    if jax.process_count() == 1:
        return ok
    return bool(np.all(multihost_utils.process_allgather(np.array(ok))))


def _first_line(error: BaseException) -> str:
    """The type and first line of the error ``error`` was raised from: Orbax wraps TensorStore's read errors in one
    whose first line ends in a cut-off repr of the store."""
    while error.__cause__ is not None:
        error = error.__cause__
    text = str(error).strip().splitlines()
    line = f"{type(error).__name__}: {text[0] if text else ''}"
    return line if len(line) <= 300 else line[:300].rsplit(" ", 1)[0] + " ..."  # cut between words, and said to be


def _flat_arrays(tree) -> dict:
    """'params/layers/attn/q/kernel' -> its array (or shape and dtype), for a state tree or Orbax's metadata of one."""
    leaves = jax.tree_util.tree_flatten_with_path(tree, is_leaf=lambda x: hasattr(x, "shape"))[0]
    return {"/".join(str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k)))) for k in path): leaf
            for path, leaf in leaves if hasattr(leaf, "shape")}


def _flat_shapes(tree) -> dict[str, tuple]:
    """'params/layers/attn/q/kernel' -> shape, for a state tree or Orbax's metadata of one."""
    return {name: tuple(leaf.shape) for name, leaf in _flat_arrays(tree).items()}


# how a checkpoint's top-level items are named in messages
_STATE_PARTS = {"params": "parameters", "opt_state": "optimizer state"}


def _note_other_dtypes(saved_metadata, target, where: str) -> None:
    """A note where the checkpoint holds arrays in another dtype than this run keeps them in, which Orbax casts as it
    reads them: a checkpoint of an earlier jaxtrain (a LoRA run's adapters and the Adam moments of bfloat16 parameters
    were bfloat16 until 2026-12-06) or of another model.param_dtype. The run goes on from the cast values, so not bit for
    bit as the checkpoint's own run would have (a QA report: an upgraded jaxtrain resumed such a run without a word)."""
    saved, wanted = _flat_arrays(saved_metadata), _flat_arrays(target)
    cast: dict[tuple[str, str], list[str]] = {}
    for name, array in wanted.items():
        if name in saved and saved[name].dtype != array.dtype:
            cast.setdefault((str(saved[name].dtype), str(array.dtype)), []).append(name)
    for (then, now), names in cast.items():
        parts = Counter(name.split("/", 1)[0] for name in names)
        counted = " and ".join(f"{count} of the {_STATE_PARTS.get(part, part)}" for part, count in parts.items())
        _say(f"jaxtrain: note: {where} holds {len(names)} arrays in {then} that this run keeps in {now} ({counted}, e.g. "
             f"{names[0]}): they are read as {now}, so the run goes on from those values, not bit for bit as it would have "
             f"(an earlier jaxtrain kept a LoRA run's adapters and the Adam moments of bfloat16 parameters in bfloat16, until "
             f"2026-12-06; or the run had another model.param_dtype)")


def check_same_shapes(saved_metadata, abstract_state, where: str) -> None:
    """UserError naming the first parameter whose shape (or presence) differs from the checkpoint's."""
    saved, wanted = _flat_shapes(saved_metadata), _flat_shapes(abstract_state)
    for name in sorted(wanted.keys() | saved.keys(), key=lambda n: (not n.startswith("params/"), n)):  # parameters first
        if saved.get(name) != wanted.get(name) and name.startswith("loss_scale/"):  # only a float16 run keeps one
            which = ("was trained with model.dtype=float16 (it holds a loss scale) and this config has another dtype"
                     if name in saved else "was trained with another model.dtype than this config's float16 (it holds no loss scale)")
            raise UserError(f"{where} {which}: a run cannot switch to or from float16 on resume; keep that run's "
                            "model.dtype, or start a new run from its weights with --init-from RUN_DIR --params-only")
        if saved.get(name) != wanted.get(name):
            raise UserError(
                f"{where} does not match the model: {name} has shape {saved.get(name, 'absent')} in the checkpoint but "
                f"{wanted.get(name, 'absent')} in this config; use the model config of that run or a new --run-dir")


def _state_type_handlers() -> ocp.type_handlers.TypeHandlerRegistry:
    """Orbax's standard handlers, with jax arrays split between their replicas for writing only where each replica's
    part is at least REPLICA_SLICE_MIN_BYTES: Orbax slices a replicated shard on its device, one small program per
    shape and device, which for norm scales and small models costs more than it saves (below). No per-array metadata
    files: Orbax keeps them for typed PRNG keys, and the train state holds none."""
    arrays = ocp.type_handlers.ArrayHandler(min_slice_bytes_for_replica_parallel=REPLICA_SLICE_MIN_BYTES)
    return ocp.type_handlers.create_type_handler_registry(
        *((kind, arrays if kind is jax.Array else ocp.type_handlers.get_type_handler(kind))
          for kind in ocp.type_handlers.supported_types()))


class DataPositionHandler(grain.checkpoint.CheckpointHandler):
    """grain's handler for the data iterator's position (a JSON file per process, ``process_I-of-N.json``), for any
    iterator with ``get_state``/``set_state``/``start_prefetch`` (grain's takes only its own iterators as JSON). grain's
    reads back only the file this process index and count wrote: a run resumed on another number of processes (a job
    requeued onto other nodes) found no such file, took the checkpoint for damaged and started again from step 0.
    Every process saves the same position, a count of sequences read (each takes its rows of the same batches,
    ``jaxtrain/data/pipeline.py``) and the seed scheme that shuffled them, so such a run reads the one the saving
    processes agree on."""

    def save(self, directory, item=None, args=None):
        state = json.dumps((item or args.item).get_state(), indent=4)
        (Path(directory) / f"process_{jax.process_index()}-of-{jax.process_count()}.json").write_text(state)

    def restore(self, directory, item=None, args=None):
        step_dir = Path(directory).parent
        state = _read_data_position(Path(directory))
        if state[SEED_SCHEME] not in SEED_SCHEMES:  # a later jaxtrain's: its order cannot be rebuilt here
            raise UserError(f"checkpoint {step_dir} holds a data position under seed scheme {state[SEED_SCHEME]}, which this "
                            f"jaxtrain does not know (it knows {', '.join(map(str, SEED_SCHEMES))}): resume it with the jaxtrain "
                            f"that wrote it, or start a new run from it with --init-from {step_dir} (its data from the beginning)")
        iterator = item or args.item
        try:
            iterator.set_state(state)
        except KeyError:  # the other data.format's position (text: sequences read; sft: the packer's state)
            written_with = saved_data_format(step_dir)
            raise UserError(f"checkpoint {step_dir} holds the data position of data.format={written_with}, which another format "
                            f"cannot take; give data.format={written_with} to go on with it, or start a new run from it with "
                            f"--init-from {step_dir} (its data from the beginning; add --params-only for its parameters alone)") from None
        iterator.start_prefetch()
        return iterator


def saved_data_position(step_dir: Path) -> dict:
    """The data position checkpoint ``step_dir`` holds for this process: its data iterator's state."""
    return _read_data_position(step_dir / "data")


def _read_data_position(directory: Path) -> dict:
    """``DataPositionHandler``'s read of the data item ``directory``: this process's file, or the one the saving
    processes agree on; older checkpoints' positions in today's form."""
    index, count = jax.process_index(), jax.process_count()
    own = directory / f"process_{index}-of-{count}.json"
    saved = {own.read_text()} if own.exists() else {path.read_text() for path in directory.glob("process_*-of-*.json")}
    if len(saved) != 1:
        raise ValueError(f"{directory} holds {len(saved)} different data positions and none for process {index} of {count}")
    state = json.loads(saved.pop())
    if list(state) == ["next_index"]:  # grain's own position, written until 2026-12-05: a count of global batches
        state = {"sequences": state["next_index"] * saved_config(directory.parent)["train"]["global_batch"]}
    state.setdefault(SEED_SCHEME, PLAIN_SEEDS)  # written before the record: shuffled with data.seed as it is
    return state


# grain's argument types name its own handler; orbax matches an item's arguments to its handler by type
@ocp.args.register_with_handler(DataPositionHandler, for_save=True)
@dataclasses.dataclass
class DataPositionSave(ocp.args.CheckpointArgs):
    item: object


@ocp.args.register_with_handler(DataPositionHandler, for_restore=True)
@dataclasses.dataclass
class DataPositionRestore(ocp.args.CheckpointArgs):
    item: object


def _manager(directory: Path, cfg: CheckpointConfig | None, write_failed: threading.Event | None = None) -> ocp.CheckpointManager:
    """The run's own manager (``cfg``), or, without ``cfg``, one that only reads. With several processes, a save whose
    background write fails on this process sets ``write_failed`` (``_barrier_refusing_failed_saves``)."""
    _quiet_abandoned_reads()  # before any read: a failed one's abandoned siblings print as it unwinds
    absl_log = logging.getLogger("absl")
    if _not_an_item_without_metadata not in absl_log.filters:
        absl_log.addFilter(_not_an_item_without_metadata)
    if cfg is None:
        options = ocp.CheckpointManagerOptions(save_interval_steps=0, create=False)
    else:
        several = write_failed is not None and jax.process_count() > 1
        # only the configured steps: Orbax's default policy also saves the first step and on its own preemption check
        options = ocp.CheckpointManagerOptions(
            save_decision_policy=ocp.checkpoint_managers.FixedIntervalPolicy(cfg.every),
            preservation_policy=_preservation(directory, cfg),
            enable_async_checkpointing=cfg.async_save, create=True,
            async_options=ocp.AsyncOptions(barrier_sync_fn=_barrier_refusing_failed_saves(write_failed)) if several else None)
    handlers = {"state": ocp.PyTreeCheckpointHandler(type_handler_registry=_state_type_handlers()),
                "data": DataPositionHandler(), "meta": ocp.JsonCheckpointHandler()}
    return ocp.CheckpointManager(directory.absolute(), options=options, item_handlers=handlers)


def _preservation(directory: Path, cfg: CheckpointConfig):
    """The latest ``cfg.keep`` steps, those ``cfg.keep_every`` divides, and those already kept for good by the
    ``checkpoint.keep_every`` each was written under: a resume with another value, or without the override, would
    otherwise delete them at its first save."""
    policies = [ocp.checkpoint_managers.LatestN(n=cfg.keep), ocp.checkpoint_managers.CustomSteps(_kept_for_good(directory))]
    if cfg.keep_every:
        policies.append(ocp.checkpoint_managers.EveryNSteps(cfg.keep_every))
    return ocp.checkpoint_managers.AnyPreservationPolicy(policies)


def _kept_for_good(directory: Path) -> list[int]:
    """The steps in ``directory`` whose own ``meta`` item's ``checkpoint.keep_every`` divides them (one without a
    readable ``meta`` item is left to ``keep`` and ``keep_every`` alone)."""
    kept = []
    for step_dir in directory.iterdir() if directory.is_dir() else ():
        if step_dir.name.isdigit():
            try:
                keep_every = saved_config(step_dir)["checkpoint"]["keep_every"]
            except (OSError, ValueError, KeyError):
                continue
            if keep_every and int(step_dir.name) % keep_every == 0:
                kept.append(int(step_dir.name))
    return kept


def _barrier_refusing_failed_saves(write_failed: threading.Event):
    """Orbax's barrier among the processes, with its timeout (20 minutes, kept: a large save takes minutes), but for a
    thread of Orbax's own that comes to it with an error in flight: its save failed on this process (a full disk) before
    the barrier where the other processes wait for it, and it unwinds to another barrier (the ``finally`` of its
    finalization), so both sides waited out the timeout, then aborted as if a process were lost, never naming the disk.
    That thread raises its error instead, ending the save on this process, and sets ``write_failed``: the training
    thread reports it at its next step (``RunCheckpoints.after_step``), this process stops, and so the others' next
    collective fails, each saying so."""
    waiting = ocp.multihost.get_barrier_sync_fn()
    owner = threading.current_thread()  # the training thread, which starts the saves; Orbax's own threads finish them

    def barrier(*, key: str, timeout_ms: int) -> None:
        failure = sys.exc_info()[1]  # inside a ``finally`` that unwinds from an error: that error
        if failure is not None and threading.current_thread() is not owner:
            write_failed.set()
            raise failure
        waiting(key=key, timeout_ms=timeout_ms)

    return barrier


def _state_restore(target, *, partial: bool = False) -> ocp.args.PyTreeRestore:
    """Restore onto ``target``'s shardings (ShapeDtypeStructs): each device reads only its own shards."""
    return ocp.args.PyTreeRestore(target, restore_args=ocp.checkpoint_utils.construct_restore_args(target), partial_restore=partial)


def saved_part(state):
    """What a checkpoint holds of a train state: all but a LoRA run's frozen base (recorded by path and hash instead)."""
    return state.replace(frozen=None)


def saved_meta(step_dir: Path) -> dict:
    """A checkpoint's ``meta`` item: how it was laid out, the config it was written under, its time."""
    return json.loads((step_dir / "meta" / "metadata").read_text())


def _check_format(step_dir: Path, where: str) -> None:
    """A checkpoint a later jaxtrain wrote in a layout this one does not read is one line, and left where it is: read,
    it failed or was misread, and a run took it for damaged, moved every checkpoint aside and trained from step 0."""
    try:
        written = saved_meta(step_dir).get(FORMAT_KEY, 1)
    except (OSError, ValueError, AttributeError):  # a damaged or missing meta item: the read falls back past it
        return
    if not isinstance(written, int) or written > CHECKPOINT_FORMAT:
        raise UserError(f"{where} was written by a later jaxtrain (checkpoint format {written}; this one reads format "
                        f"{CHECKPOINT_FORMAT} and earlier): use that jaxtrain, or a later one, for it; every checkpoint is left "
                        "as it was")


def saved_config(step_dir: Path) -> dict:
    """The config a checkpoint was written under (its ``meta`` item's, as ``to_dict`` gives it)."""
    return saved_meta(step_dir)["config"]


def saved_data_format(step_dir: Path) -> str:
    """The data.format a checkpoint was written under: text where its config predates the key."""
    return saved_config(step_dir)["data"].get("format", "text")


def _restore_args(abstract_state, data_iterator, *, partial: bool = False) -> ocp.args.Composite:
    """``partial``: the checkpoint may hold more of the state than ``abstract_state`` (a spike window it leaves out)."""
    items = {"state": _state_restore(abstract_state, partial=partial), "meta": ocp.args.JsonRestore()}
    if data_iterator is not None:
        items["data"] = DataPositionRestore(data_iterator)
    return ocp.args.Composite(**items)


def _read(manager: ocp.CheckpointManager, step: int, abstract_state, data_iterator, where: str, *, params_only: bool = False,
          data_format: str | None = None):
    """Checkpoint ``step`` restored onto ``abstract_state``'s shardings (its ``state`` item holding only the parameters
    with ``params_only``), after checking that its shapes are the model's (``where`` names it in that error). With
    ``data_format``, the data position is read only from a checkpoint written under that data.format (another's
    position cannot be taken, and a new run from it starts its data at the beginning)."""
    _check_format(Path(manager.directory) / str(step), where)
    if data_format is not None and saved_data_format(Path(manager.directory) / str(step)) != data_format:
        data_iterator = None
    saved = manager.item_metadata(step)["state"]
    if saved is None:  # Orbax's answer where the item's metadata is gone: reading on would fail on None, naming nothing
        raise FileNotFoundError(f"the metadata of its state item ({Path(manager.directory) / str(step) / 'state' / '_METADATA'}) "
                                "is missing or unreadable")
    if params_only:
        check_same_shapes({"params": saved["params"]}, {"params": abstract_state.params}, where)  # named as in a whole state
        return manager.restore(step, args=ocp.args.Composite(state=_state_restore({"params": abstract_state.params}, partial=True)))
    target = saved_part(abstract_state)
    unclipped = _written_unclipped(saved)
    if unclipped:
        target = target.replace(opt_state=target.opt_state[1])
    saved_window = {name: shape for name, shape in _flat_shapes(saved).items() if name.startswith("spikes/")}
    kept = _flat_shapes({"spikes": target.spikes}) == saved_window
    # the spike window is the guard's alone: switched on or off, or of another length, it starts again empty
    check_same_shapes({name: value for name, value in saved.items() if name != "spikes"}, target.replace(spikes=None), where)
    read = target if kept else target.replace(spikes=None)
    # a field the train state gained since the checkpoint's jaxtrain (spikes, 2026-12-05; None here): Orbax refuses a
    # target with a node the saved tree lacks, and the run took every such checkpoint for damaged and began again
    absent = [field.name for field in dataclasses.fields(read) if field.name not in saved]
    item = {field.name: getattr(read, field.name) for field in dataclasses.fields(read) if field.name in saved} if absent else read
    restored = manager.restore(step, args=_restore_args(item, data_iterator, partial=not kept))
    _note_other_dtypes(saved, read, where)
    state = read.replace(**restored.state) if absent else restored.state
    if unclipped:
        state = state.replace(opt_state=(abstract_state.opt_state[0], state.opt_state))
    if not kept and target.spikes is not None:
        length = target.spikes["loss"].shape[0]
        _say(f"jaxtrain: note: {where} holds no spike window of {length} steps (its run had train.skip_spikes off or another "
             f"train.spike_window): the guard skips nothing until {spikes_lib.verdict_after(length)} steps have entered an empty one")
        shardings = jax.tree.map(lambda a: a.sharding, target.spikes)
        state = state.replace(spikes=jax.jit(lambda: spikes_lib.initial_window(length), out_shardings=shardings)())
    return ocp.args.Composite(**(dict(restored) | {"state": state}))


def _written_unclipped(saved_metadata) -> bool:
    """Whether a checkpoint holds AdamW's state alone, as a run with optim.clip_norm=0 saved it until 2026-12-05 (since,
    the clipping step's empty state always comes first: ``jaxtrain/optim.py``)."""
    return any(name.startswith("opt_state/0/mu/") for name in _flat_shapes(saved_metadata))


def _quiet_abandoned_reads() -> None:
    """Drop what Orbax's abandoned reads print after a failed restore: it closes its event loop on the first error,
    leaving the other reads running; as they finish, their callbacks find the loop closed, their coroutines, closed
    unfinished, raise from an ``except BaseException``, and their finished tasks' errors are never retrieved. Python
    and asyncio print each (often at exit, with a TensorStore spec of 60 lines) after the line that already said
    the checkpoint is unreadable."""
    asyncio_log = logging.getLogger("asyncio")
    if _not_from_abandoned_read not in asyncio_log.filters:
        asyncio_log.addFilter(_not_from_abandoned_read)
    if getattr(sys.unraisablehook, "quiets_abandoned_reads", False):
        return
    previous = sys.unraisablehook

    def hook(unraisable, previous=previous):
        code = getattr(unraisable.object, "cr_code", None)
        if "/orbax/" not in getattr(code, "co_filename", "") and str(unraisable.exc_value) != "Event loop is closed":
            previous(unraisable)

    hook.quiets_abandoned_reads = True
    sys.unraisablehook = hook


def _not_from_abandoned_read(record: logging.LogRecord) -> bool:
    """False for asyncio's report of an abandoned read or write (a task, future or gathering future): an Orbax one
    (by its message or its traceback), or a TensorStore future (its error names the array store)."""
    message = record.getMessage()
    frames = traceback.extract_tb(record.exc_info[2]) if record.exc_info and record.exc_info[2] else []
    return not ("exception was never retrieved" in message
                and ("/orbax/" in message or any("/orbax/" in frame.filename for frame in frames)
                     or "OCDBT database" in message or re.search(r'Error opening "\w+" driver', message)))


def _quiet_replaced_partial_saves() -> None:
    """Drop Orbax's errors (``_not_orbax_error``) and its warning, in the middle of the progress lines, that it replaces
    the temporary directory a killed or interrupted save left (``Attempted to create temporary directory
    .../8.orbax-checkpoint-tmp which already exists. Removing existing directory since it is not finalized.``): that
    directory was never a checkpoint. Of its warnings only that one: absl's others still print."""
    absl_log = logging.getLogger("absl")
    for keep in (_not_a_replaced_partial_save, _not_orbax_error):
        if keep not in absl_log.filters:
            absl_log.addFilter(keep)


def _not_a_replaced_partial_save(record: logging.LogRecord) -> bool:
    message = record.getMessage()
    return not (message.startswith("Attempted to create temporary directory") and _TMP_MARK in message
                and "since it is not finalized" in message)


def _not_an_item_without_metadata(record: logging.LogRecord) -> bool:
    """False for Orbax's warning that no handler fits an item it found (``Item "state" was found in the checkpoint, but
    could not be restored. Please provide a CheckpointHandlerRegistry ...``): every item here has its handler, so it
    means the item's metadata is gone, which the line saying the checkpoint is unreadable names (``_read``)."""
    return "was found in the checkpoint, but could not be restored" not in record.getMessage()


def _not_orbax_error(record: logging.LogRecord) -> bool:
    """False for Orbax's errors: a failed write (a full disk) is logged at ERROR, with its traceback, by each thread
    that took part (hundreds of lines), and raised to the save or the wait, where ``_write_error`` says it in one."""
    return not (record.levelno >= logging.ERROR and "/orbax/" in record.pathname)


def _ran_out_of_memory(error: BaseException | None) -> bool:
    """Whether reading failed for want of device or host memory (XLA's RESOURCE_EXHAUSTED, Python's MemoryError), here or
    in what the error was raised from."""
    while error is not None:
        if isinstance(error, MemoryError) or "RESOURCE_EXHAUSTED" in str(error).split("\n", 1)[0]:
            return True
        error = error.__cause__ or error.__context__
    return False


def _newest_readable(steps, read) -> tuple[int | None, object, list[tuple[int, str]]]:
    """(step, ``read(step)``) of the newest of ``steps`` every process reads, and (step, reason) for each newer one
    that some process could not read; (None, None, all of them) when none is readable. A UserError (a model that
    does not match) is not a damaged file: it propagates; nor is a read that ran out of memory (a run resumed on too
    few devices), which took every checkpoint of the run for damaged, moved them aside and started from step 0."""
    unreadable = []
    for step in sorted(steps, reverse=True):
        try:
            restored, error = read(step), None
        except UserError:
            raise
        except Exception as e:  # noqa: BLE001 - any unreadable file must lead to the previous checkpoint
            restored, error = None, e
        if not _all_processes(not _ran_out_of_memory(error)):
            raise UserError(f"checkpoint step {step} did not fit in memory as it was read ("
                            f"{_first_line(error) if error else 'on another process'}); it is left in place: resume on more "
                            "devices, or with a rule set that splits the state further (`jaxtrain plan` says what fits)")
        if _all_processes(error is None):
            return step, restored, unreadable
        unreadable.append((step, _first_line(error) if error else "unreadable on another process"))
    return None, None, unreadable


def _age(seconds: float) -> str:
    return str(datetime.timedelta(seconds=round(max(seconds, 0))))


class RunCheckpoints:
    """The checkpoints of one run directory: resume, periodic, final and preemption saves."""

    def __init__(self, run_dir: Path, cfg: CheckpointConfig, last_step: int, meta: dict | None = None):
        self.directory = run_dir / CHECKPOINTS_DIR
        self.last_step = last_step
        # how this run is laid out (train sets it once its steps are compiled): written into every checkpoint's meta item
        self.meta = meta or {}
        _check_writable(self.directory)
        self._lock = _lock_run_dir(run_dir)
        self.write_failed = threading.Event()  # a save's background write failed on this process (several processes)
        self.manager = _manager(self.directory, cfg, self.write_failed)
        _quiet_replaced_partial_saves()
        self.preemption = PreemptionWatch()
        self.closed = False
        self.started = None  # the step of the latest save started: an async write fails later, on wait
        self.uncommitted: list[tuple[int, float]] = []  # (step, time taken) of the saves started and not yet seen committed
        self.resumed_line = None
        self.restored = None  # (step, time written) of the checkpoint the run resumed from

    def restore_latest(self, abstract_state, data_iterator):
        """The state of the latest readable checkpoint (restored onto ``abstract_state``'s shardings,
        with the data iterator moved to its position), or None when there is none. Unreadable
        checkpoints are moved aside with a one-line warning. The caller prints ``resumed_line``: a finished run
        started again resumes nothing."""
        # Orbax restores the items in the order of their names, the data position before the state: a checkpoint
        # whose arrays do not read has moved the iterator on by then
        beginning = None if data_iterator is None else data_iterator.get_state()
        step, restored, unreadable = _newest_readable(self.manager.all_steps(), lambda s: _read(
            self.manager, s, abstract_state, data_iterator, f"checkpoint step {s} in {self.directory}"))
        for bad, reason in unreadable:
            self._quarantine(bad, reason, "falling back to the previous one" if step is not None or bad != unreadable[-1][0]
                             else "no earlier checkpoint is readable: training starts from step 0")
        if step is None:
            if unreadable and data_iterator is not None:  # training starts from step 0: at the first sequence too
                data_iterator.set_state(beginning)
            return None
        written = restored.meta.get("time", time.time())
        self.restored = (step, written)
        age = time.time() - written
        self.resumed_line = f"jaxtrain: resuming from checkpoint step {step} in {self.directory} (written {_age(age)} ago)"
        return restored.state

    def _quarantine(self, step: int, reason: str, then: str) -> None:
        target = self.directory.parent / QUARANTINE_DIR / f"{step}-{int(time.time())}"
        _say(f"jaxtrain: warning: checkpoint step {step} is unreadable ({reason}); moved to {target}, {then}")
        if jax.process_index() == 0:
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.move(self.directory / str(step), target)
        if jax.process_count() > 1:
            multihost_utils.sync_global_devices(f"jaxtrain quarantine checkpoint {step}")
        self.manager.reload()

    def preempted(self, step: int) -> bool:
        """Whether to stop after ``step`` (every process must ask at every step, in the same order)."""
        return step < self.last_step and self.preemption.reached(step)

    def after_step(self, step: int, state, data_iterator, *, preempted: bool, epoch: float | None = None) -> None:
        """Save if due (always at the last step), with ``epoch`` (the epochs of training data read) in its meta for
        `jaxtrain checkpoints`; on preemption (or Ctrl-C) save, wait for the commit and raise Preempted. With several
        processes, a save whose background write failed on this process raises its error here, at the step after
        (``_barrier_refusing_failed_saves``): the others are in the step's collectives then, which fail when this process
        stops, not at a save's barrier, where they waited for it until Orbax's timeout."""
        if self.write_failed.is_set():
            self.finish()  # raises the failed save's error
        self.save(step, state, data_iterator, force=preempted or step == self.last_step, epoch=epoch)
        if preempted:
            self.close()
            raise Preempted(step, interrupted=self.preemption.interrupted)

    def save(self, step: int, state, data_iterator, *, force: bool = False, epoch: float | None = None) -> bool:
        """Start saving ``step`` if it is due (or ``force``); the write continues in the background
        when asynchronous. Returns whether a save started."""
        taken = time.time()
        args = ocp.args.Composite(
            state=ocp.args.PyTreeSave(saved_part(state)),
            data=DataPositionSave(data_iterator),
            meta=ocp.args.JsonSave(self.meta | {"step": step, "time": taken, "epoch": epoch, FORMAT_KEY: CHECKPOINT_FORMAT}))
        try:
            started = self.manager.save(step, args=args, force=force)  # first waits for the previous save
        except Exception as e:  # noqa: BLE001 - a failed write (full disk, permissions) is the user's to fix
            raise self._write_error(self.started or step, e) from e
        if started:
            self.started = step
            self.uncommitted.append((step, taken))
        return started

    def newly_committed(self) -> tuple[int, float] | None:
        """(step, time taken) of the newest save committed since the last call, or None: an asynchronous save can still
        fail after it starts (Prometheus's last checkpoint). Only the newest save can be in flight, as each save first
        waits for the one before."""
        in_flight = self.uncommitted[-1:] if self.manager.is_saving_in_progress() else []
        finished = self.uncommitted[:len(self.uncommitted) - len(in_flight)]
        if not finished:
            return None
        self.uncommitted = in_flight
        on_disk = set(committed_steps(self.directory))
        return next((save for save in reversed(finished) if save[0] in on_disk), None)

    def finish(self) -> None:
        """Wait until every started save is committed."""
        try:
            self.manager.wait_until_finished()
        except Exception as e:  # noqa: BLE001
            raise self._write_error(self.started, e) from e

    def _write_error(self, step, error: BaseException) -> UserError | LostPeer:
        # a collective or barrier among the processes (Orbax raises a barrier's failure as a TimeoutError from it)
        among_processes = next((e for e in (error, error.__cause__) if isinstance(e, jax.errors.JaxRuntimeError)), None)
        if jax.process_count() > 1 and among_processes is not None:
            return LostPeer(f"the save of checkpoint step {step} under {self.directory}", among_processes)
        try:
            earlier = [s for s in committed_steps(self.directory) if step is None or s < step]
            intact = f"earlier checkpoints are intact (the newest: step {earlier[-1]})" if earlier else "no earlier checkpoint"
        except OSError:  # the directory cannot even be listed
            intact = "earlier checkpoints are untouched"
        return UserError(f"could not write checkpoint step {step} under {self.directory} ({_first_line(error)}); "
                         f"free disk space or fix permissions there; {intact}")

    def close(self) -> None:
        """Wait for the saves in flight (a second SIGTERM meanwhile changes nothing), then let go. A Ctrl-C meanwhile
        (KeyboardInterrupt: a second one, the first asked for the stop) leaves them, as ``abandon`` does."""
        if self.closed:
            return
        self.closed = True
        aborted = False
        try:
            self.finish()
        except KeyboardInterrupt:
            aborted = True
            raise
        finally:
            try:
                if not aborted:
                    self.manager.close()
            finally:
                self.preemption.close()
                self._unlock()

    def abandon(self) -> None:
        """Let go of the signals without waiting for the saves in flight (a Ctrl-C stops the process instead)."""
        self.closed = True
        self.preemption.close()
        self._unlock()

    def _unlock(self) -> None:
        if self._lock is not None:
            os.close(self._lock)  # closing the descriptor releases its flock
            self._lock = None

    def interrupted_error(self) -> Interrupted:
        """What a KeyboardInterrupt in the training loop says: a second Ctrl-C (the first asked to stop after the
        step), or one while the last step's checkpoint is written."""
        what = "interrupted again" if self.preemption.interrupted else "interrupted"
        committed = committed_steps(self.directory)
        again = f"resume from step {committed[-1]}" if committed else "start again"
        partial = [s for s in _partial_steps(self.directory) if not committed or s > committed[-1]]
        if partial:
            return Interrupted(f"{what}: stopped without waiting for the save of step {max(partial)}, which may be incomplete "
                               f"(a resume never picks an incomplete checkpoint); run the same command again to {again}")
        return Interrupted(f"{what}; run the same command again to {again}")


def check_resume_shapes(run_dir: Path, trained_shapes: dict) -> None:
    """Before the compile: the parameters of the run's newest committed checkpoint against ``trained_shapes`` (the
    model's trained parameters, a LoRA run's adapters), by their metadata alone. A checkpoint whose metadata does not
    read is left to the restore, which falls back past it."""
    directory = run_dir / CHECKPOINTS_DIR
    manager = _manager(directory, None)
    try:
        step = manager.latest_step()
        if step is None:
            return
        _check_format(directory / str(step), f"checkpoint step {step} in {directory}")
        try:
            saved = manager.item_metadata(step)["state"]["params"]
        except Exception:  # noqa: BLE001 - an unreadable checkpoint: the restore reports and passes it
            return
        check_same_shapes({"params": saved}, {"params": trained_shapes}, f"checkpoint step {step} in {directory}")
    finally:
        manager.close()


def has_checkpoints(run_dir: Path) -> bool:
    """Whether the run directory holds a complete checkpoint of its own (so a start resumes it); looks only."""
    return bool(committed_steps(run_dir / CHECKPOINTS_DIR))


def _partial_steps(directory: Path) -> list[int]:
    """The steps of the saves not (yet) committed: Orbax's temporary directories, STEP.orbax-checkpoint-tmp[-N]."""
    if not directory.is_dir():
        return []
    steps = (p.name.split(".", 1)[0] for p in directory.iterdir() if _TMP_MARK in p.name)
    return sorted({int(s) for s in steps if s.isdigit()})


def _check_writable(directory: Path) -> None:
    probe = directory / f".write-probe-{jax.process_index()}"
    try:
        directory.mkdir(parents=True, exist_ok=True)
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as e:
        raise UserError(f"checkpoint directory {directory} is not writable ({e.strerror}); fix its permissions or use another --run-dir") from None


def _lock_run_dir(run_dir: Path) -> int | None:
    """Process 0's exclusive flock on the run directory itself (no file written), its descriptor to close when the run
    lets go: two `jaxtrain train` of one run directory (a job requeued while the old one still runs, a command started
    twice) each removed the other's save in progress (Orbax replaces a step's temporary directory it finds, and the
    loser's error blamed the disk) and wrote their records into one metrics.jsonl. None on the other processes, and where
    the file system takes no locks (some network ones): the run goes on unguarded, as before."""
    lock, busy = None, False
    if jax.process_index() == 0:
        lock = os.open(run_dir, os.O_RDONLY)
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            os.close(lock)
            lock, busy = None, isinstance(e, BlockingIOError)
    if not _all_processes(not busy):
        raise UserError(f"--run-dir {run_dir} is in use by another jaxtrain train command, still running; wait for it to stop "
                        "(or stop it), or give another --run-dir")
    return lock


def _say(line: str) -> None:
    if jax.process_index() == 0:
        print(line, file=sys.stderr, flush=True)


def _none_saved_yet(path: Path, source: str) -> UserError:
    return UserError(f"{source} {path}: no checkpoints there yet; train the run until it saves one (every checkpoint.every "
                     "steps, and at its last step)")


def checkpoints_dir(path: Path, source: str) -> tuple[Path, int | None]:
    """(checkpoints directory, step or None for the latest) for a run directory, its checkpoints/
    directory, or one step's directory."""
    if (path / CHECKPOINTS_DIR).is_dir():
        return path / CHECKPOINTS_DIR, None
    if path.name.isdigit() and (path / "state").is_dir():
        return path.parent, int(path.name)
    if path.is_dir() and any(p.name.isdigit() for p in path.iterdir()):
        return path, None
    if (path / "config.yaml").is_file():  # the right kind of path: a run that has not saved yet
        raise _none_saved_yet(path, source)
    raise UserError(f"{source} {path}: no checkpoints there; give a run directory, its checkpoints/ directory or one step's directory")


def restore_from(path: Path, abstract_state, data_iterator, *, params_only: bool, source: str = "--init-from"):
    """``--init-from`` (or ``source``, named in messages): another run's checkpoint, resharded onto
    ``abstract_state``. With ``params_only`` only the parameters are read (and returned); otherwise the
    whole state and the data position. A run directory gives its newest readable checkpoint: each newer,
    unreadable one is a warning and stays where it is (only ``jaxtrain train`` moves its own run's aside)."""
    return restore_step_from(path, abstract_state, data_iterator, params_only=params_only, source=source)[1]


def restore_step_from(path: Path, abstract_state, data_iterator, *, params_only: bool, source: str = "--init-from",
                      data_format: str | None = None) -> tuple[Path, object]:
    """``restore_from``, with the step directory it read (the checkpoint a run directory stood for then); the data
    position only from a checkpoint of ``data_format`` (``_read``)."""
    directory, step = checkpoints_dir(path, source)
    manager = _manager(directory, None)
    steps = manager.all_steps() if step is None else [s for s in manager.all_steps() if s == step]
    if not steps and step is None:  # a run's checkpoints/ is made when it starts, empty until its first save commits
        raise _none_saved_yet(path, source)
    if not steps:
        raise UserError(f"{source} {path}: no complete checkpoint found (steps: {list(manager.all_steps()) or 'none'})")
    found, restored, unreadable = _newest_readable(steps, lambda s: _read(
        manager, s, abstract_state, data_iterator, f"{source} {directory / str(s)}", params_only=params_only, data_format=data_format))
    manager.close()
    if found is None and step is not None:
        raise UserError(f"{source} {path}: checkpoint step {step} is unreadable ({unreadable[0][1]}); choose another step "
                        f"(`jaxtrain checkpoints {directory.parent}` lists them)")
    if found is None:
        raise UserError(f"{source} {path}: no checkpoint there is readable (steps {', '.join(str(s) for s, _ in unreadable)}; "
                        f"step {unreadable[0][0]}: {unreadable[0][1]}); restore them from a copy, or train again")
    for bad, reason in unreadable:
        _say(f"jaxtrain: warning: checkpoint step {bad} in {directory} is unreadable ({reason}); using step {found}, the newest "
             "readable one (left in place)")
    _say(f"jaxtrain: read {'the parameters' if params_only else 'the whole state'} of {directory / str(found)}")
    return directory / str(found), restored.state["params"] if params_only else restored.state


def _size(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def _human(size: int) -> str:
    exponent = min(int(math.log(max(size, 1), 1024)), 4)
    return f"{size / 1024 ** exponent:.1f} {['B', 'KiB', 'MiB', 'GiB', 'TiB'][exponent]}"


def describe(run_dir: Path) -> list[dict]:
    """One row per checkpoint directory (complete or not) of a run, oldest first. Complete means committed: Orbax
    renamed it from its temporary name once written. Its array files are not read (that costs as much as a
    restore), so one damaged since still counts as complete until a command reads it."""
    directory = run_dir / CHECKPOINTS_DIR
    check_run_dir(run_dir)
    if not run_dir.is_dir():
        raise UserError(f"{run_dir} does not exist; give the --run-dir of a training run")
    if not directory.is_dir():
        raise UserError(f"{run_dir} has no {CHECKPOINTS_DIR}/ directory; give the --run-dir of a training run")
    manager = _manager(directory, None)
    complete = set(manager.all_steps())
    rows = []
    for path in directory.iterdir():
        name = path.name.split(_TMP_MARK)[0]
        if not path.is_dir() or not name.isdigit():
            continue
        step = int(name)
        meta = {}
        if step in complete and _TMP_MARK not in path.name:
            try:
                meta = manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore())).meta
            except Exception:  # noqa: BLE001 - an old or damaged meta item: list the step anyway
                meta = {}
        rows.append({
            "step": step, "size": _size(path), "time": meta.get("time", path.stat().st_mtime),
            "complete": step in complete and _TMP_MARK not in path.name,
            "mesh": meta.get("mesh"), "rules": meta.get("rules"), "processes": meta.get("processes"),
            "epoch": meta.get("epoch"),  # the epochs of training data read (none recorded until 2026-12-06)
        })
    manager.close()
    return sorted(rows, key=lambda r: (r["step"], r["complete"]))


def format_table(rows: list[dict]) -> str:
    header = f"{'step':>8}  {'epoch':>8}  {'size':>10}  {'written':19}  {'committed':9}  mesh / rules"
    lines = [header]
    for r in rows:
        mesh = describe_axes(r["mesh"]) if r["mesh"] else "?"
        written = datetime.datetime.fromtimestamp(r["time"]).strftime("%Y-%m-%d %H:%M:%S")
        epoch = "?" if r.get("epoch") is None else f"{r['epoch']:.4f}"
        lines.append(f"{r['step']:>8}  {epoch:>8}  {_human(r['size']):>10}  {written:19}  {'yes' if r['complete'] else 'NO':9}  "
                     f"{mesh} / {r['rules'] or '?'} ({r['processes'] or '?'} process(es))")
    return "\n".join(lines)
