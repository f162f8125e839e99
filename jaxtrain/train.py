"""The training loop: config -> mesh -> sharded state -> compiled step -> loop with metrics.

``build`` does every check and compiles, touching no file; ``train`` then owns the run directory.
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from typing import Any, Callable

import jax
import numpy as np
import optax
from flax.core import spmd
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxtrain import checkpoint as checkpoint_lib
from jaxtrain import config as config_lib
from jaxtrain import data as data_lib
from jaxtrain.config import Config
from jaxtrain.errors import UserError
from jaxtrain.gpu_targets import is_nvidia_gpu
from jaxtrain.mesh import build_mesh
from jaxtrain.metrics import MetricsLog
from jaxtrain.optim import learning_rate_schedule, make_optimizer
from jaxtrain.partitioning import (Rules, batch_sharding, batch_shards, check_rules_against_mesh, flax_rules,
                                   load_rules)
from jaxtrain.state import ModelSpec, TrainState, abstract_state, init_state, model_spec, state_shardings
from jaxtrain.step import make_eval_step, make_train_step
from models.sharding import MissingLogicalRule


@dataclasses.dataclass(frozen=True)
class Layout:
    """How a config maps onto the devices: mesh, rules, model, optimizer, shardings. Checked, not compiled."""

    cfg: Config
    mesh: Mesh
    rules: Rules
    spec: ModelSpec
    tx: optax.GradientTransformation
    shardings: TrainState
    batch_sharding: NamedSharding

    def abstract_state(self) -> TrainState:
        return abstract_state(self.spec, self.tx, self.shardings)

    def abstract_batch(self) -> dict[str, jax.ShapeDtypeStruct]:
        shape = (self.cfg.train.global_batch, self.cfg.data.seq_len)
        return {k: jax.ShapeDtypeStruct(shape, np.int32, sharding=self.batch_sharding) for k in ("inputs", "targets")}


@dataclasses.dataclass
class Trainer:
    """Everything a run needs, validated and compiled; nothing written to disk yet."""

    layout: Layout
    corpus: data_lib.Corpus
    train_step: Callable[[TrainState, dict], tuple[TrainState, dict]]  # compiled; donates the state
    eval_step: Callable[[dict, dict], jax.Array]  # compiled
    compile_s: float

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
        return init_state(self.cfg.model, self.layout.tx, self.cfg.train.seed, self.layout.shardings)

    @property
    def tokens_per_step(self) -> int:
        return self.cfg.train.global_batch * self.cfg.data.seq_len


def make_layout(cfg: Config, devices: list | None = None) -> Layout:
    """Check the config against the devices, mesh, rules and model parameters; no compilation."""
    config_lib.check(cfg)
    mesh = build_mesh(cfg.mesh, devices)
    cfg = config_lib.resolve_attention(cfg, is_nvidia_gpu(mesh.devices.flat[0]))  # before the model is built
    rules = load_rules(cfg.rules)
    check_rules_against_mesh(rules, mesh, cfg.rules)
    spec = model_spec(cfg.model)
    tx = make_optimizer(cfg)
    shardings = state_shardings(spec, tx, rules, mesh)
    t = cfg.train
    shards = batch_shards(rules, mesh)
    if (t.global_batch // t.microbatches) % shards:
        raise UserError(
            f"train.global_batch={t.global_batch} / train.microbatches={t.microbatches} = {t.global_batch // t.microbatches} "
            f"sequences per micro-batch do not split over the {shards} batch shards of the mesh; use a multiple of {shards * t.microbatches}")
    return Layout(cfg, mesh, rules, spec, tx, shardings, batch_sharding(rules, mesh))


def lower_steps(layout: Layout) -> tuple[jax.stages.Lowered, jax.stages.Lowered]:
    """Trace and lower the train and eval steps (no XLA compilation yet). Activation axes without a
    rule surface here, as a UserError."""
    cfg, shardings, batch_sh = layout.cfg, layout.shardings, layout.batch_sharding
    replicated = NamedSharding(layout.mesh, PartitionSpec())
    train_fn = jax.jit(make_train_step(layout.spec.graphdef, layout.tx, learning_rate_schedule(cfg), cfg.train.microbatches,
                                       layer_norms=cfg.log.layer_every > 0, loss_chunk=cfg.train.loss_chunk),
                       in_shardings=(shardings, batch_sh), out_shardings=(shardings, replicated), donate_argnums=0)
    eval_fn = jax.jit(make_eval_step(layout.spec.graphdef, cfg.train.loss_chunk), in_shardings=(shardings.params, batch_sh), out_shardings=replicated)
    state, batch = layout.abstract_state(), layout.abstract_batch()
    with jax.set_mesh(layout.mesh), spmd.logical_axis_rules(flax_rules(layout.rules)):
        try:
            return train_fn.lower(state, batch), eval_fn.lower(state.params, batch)
        except MissingLogicalRule as e:
            raise UserError(f"logical axis '{e.axis}' (an activation of the model) has no rule in rule set {cfg.rules}; "
                            f"add '{e.axis}: null' or map it to mesh axes") from None


def build(cfg: Config, corpus: data_lib.Corpus | None = None, devices: list | None = None) -> Trainer:
    """Validate the config against the devices, mesh, rules, model and data, then compile the steps."""
    limit = None
    if cfg.train.microbatches == "auto":
        from jaxtrain import plan  # imported here: the planner is built on make_layout and lower_steps

        limit = plan.memory_limit(devices)
        if limit is None:  # devices that report no memory limit (CPU): one pass
            cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, microbatches=1))
    kind = (devices or jax.devices())[0].platform
    if cfg.model.attention == "cudnn" and kind != "gpu":
        raise UserError(f"model.attention=cudnn (cuDNN flash attention) runs only on NVIDIA GPUs and these devices are {kind}; "
                        "use model.attention=auto or xla")
    layout = make_layout(cfg, devices) if limit is None else None  # every check before the data is read
    corpus = corpus or data_lib.load_corpus(cfg.data)
    data_lib.check_sizes(corpus, cfg.data, cfg.train.global_batch, cfg.model.vocab_size)
    start = time.perf_counter()
    if layout is None:  # the fewest micro-batches whose compiled train step fits
        layout, (train_step, eval_lowered) = plan.fit_microbatches(cfg, limit, devices, compile_train_step)
    else:
        (train_step, eval_lowered), _ = compile_train_step(layout)
    return Trainer(layout, corpus, train_step, eval_lowered.compile(), time.perf_counter() - start)


def peak_bytes(memory) -> int:
    """Peak bytes per device from a compiled step's ``memory_analysis()``: inputs, outputs not written in place
    of a donated input, temporaries."""
    return memory.argument_size_in_bytes + memory.output_size_in_bytes - memory.alias_size_in_bytes + memory.temp_size_in_bytes


def compile_train_step(layout: Layout) -> tuple[tuple[jax.stages.Compiled, jax.stages.Lowered], int]:
    """The compiled train step and the lowered eval step, and the train step's peak bytes per device."""
    train_lowered, eval_lowered = lower_steps(layout)
    train_step = train_lowered.compile()
    return (train_step, eval_lowered), peak_bytes(train_step.memory_analysis())


def evaluate(trainer: Trainer, params: dict, batches: list[dict]) -> float:
    """Mean nats per token over the given validation batches."""
    total = sum(float(trainer.eval_step(params, b)) for b in batches)
    return total / (len(batches) * trainer.tokens_per_step)


def train(cfg: Config, run_dir: Path, trainer: Trainer | None = None, *, init_from: Path | None = None,
          params_only: bool = False) -> TrainState:
    """Train to ``cfg.train.steps``, resuming from RUN_DIR's latest checkpoint if any; raises
    ``checkpoint.Preempted`` after committing a checkpoint when preempted (SIGTERM)."""
    trainer = trainer or build(cfg)
    cfg = trainer.cfg  # train.microbatches=auto resolved
    is_main = jax.process_index() == 0
    if is_main:
        run_dir.mkdir(parents=True, exist_ok=True)
        config_lib.save_yaml(cfg, run_dir / "config.yaml", {"resolved": _resolved(trainer)})

    t = cfg.train
    batches = data_lib.train_batches(trainer.corpus, cfg.data, t.global_batch, trainer.batch_sharding)
    checkpoints = checkpoint_lib.RunCheckpoints(run_dir, cfg.checkpoint, t.steps, _checkpoint_meta(trainer))
    state = _start_state(trainer, checkpoints, batches, init_from, params_only)
    eval_data = data_lib.eval_batches(trainer.corpus, cfg.data, t.global_batch, trainer.batch_sharding, t.eval_batches)
    log = MetricsLog(cfg, trainer, run_dir, int(state.step), enabled=is_main)
    try:
        for step in range(int(state.step) + 1, t.steps + 1):
            with log.timer("data_wait_s"):
                batch = next(batches)
            log.before_step(step)
            state, metrics = trainer.train_step(state, batch)
            log.after_step(step, metrics)  # raises NonFiniteError before a checkpoint of this step is saved
            with log.timer("checkpoint_s"):
                checkpoints.after_step(step, state, batches.iterator)  # raises Preempted once a preemption save is committed
            if step == t.steps or (t.eval_every and step % t.eval_every == 0):
                with log.timer("eval_s"):
                    eval_loss = evaluate(trainer, state.params, eval_data)
                log.write({"step": step, "eval_loss": eval_loss, "eval_tokens": len(eval_data) * trainer.tokens_per_step})
    finally:  # a stop on a non-finite value still commits the saves already started
        log.close()
        checkpoints.close()
    return state


def _checkpoint_meta(trainer: Trainer) -> dict[str, Any]:
    """How a checkpoint was laid out, for `jaxtrain checkpoints`."""
    return _resolved(trainer) | {"rules": trainer.cfg.rules, "config": config_lib.to_dict(trainer.cfg)}


def _start_state(trainer: Trainer, checkpoints: checkpoint_lib.RunCheckpoints, batches: data_lib.GlobalBatches,
                 init_from: Path | None, params_only: bool) -> TrainState:
    """The run's own latest checkpoint (so a restarted command resumes), else ``init_from``, else fresh."""
    abstract = trainer.layout.abstract_state()
    state = checkpoints.restore_latest(abstract, batches.iterator)
    if state is None and init_from and params_only:
        state = trainer.init_state().replace(params=checkpoint_lib.restore_from(init_from, abstract, None, params_only=True))
    elif state is None and init_from:
        state = checkpoint_lib.restore_from(init_from, abstract, batches.iterator, params_only=False)
    return trainer.init_state() if state is None else state


def _resolved(trainer: Trainer) -> dict[str, Any]:
    return {
        "mesh": dict(trainer.mesh.shape),
        "devices": trainer.mesh.size,
        "processes": jax.process_count(),
        "sharding_rules": {k: list(v) if v else None for k, v in trainer.layout.rules.items()},
        "num_params": trainer.layout.spec.num_params,
    }

