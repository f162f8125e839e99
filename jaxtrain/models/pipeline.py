"""Pipeline parallelism over the stacked layers, pure SPMD inside the one jitted step.

When the rule set splits the logical axis ``layer_stages`` over mesh axes, the stacked layers (num_layers, ...)
are viewed as (repeats, stages, layers_per_stage, ...) with the stage dimension split over those axes: stage s
holds layers r * stages * layers_per_stage + s * layers_per_stage + j for every repeat r (repeats > 1 is the
circular, interleaved schedule). The batch is cut into micro-batches; every iteration of a ``lax.scan`` runs
each stage on the activations it holds (``vmap`` over the stage dimension, which SPMD partitions so each device
computes its own stage only), then shifts the outputs one stage on (``jnp.roll`` along the split dimension:
a collective permute). Stage 0 reads its next input from a buffer of micro-batches, and writes back into it the
last stage's outputs the shift brings it, so after repeats * microbatches + stages - 1 iterations the buffer
holds the output.

The stored parameters keep their (num_layers, ...) shape: only the view inside the step depends on the stage
split, so checkpoints move freely between pipelined and plain meshes. With repeats > 1 the view is a re-layout
(the layers are stored split contiguously over the stages): an all-to-all of them, and of their gradients, in
every pass. Same scheme as MaxText's ``layers/pipeline.py`` (vmapped stages, rotated state, circular repeats),
written for NNX pure dicts.
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
from flax import nnx

from jaxtrain.models.config import PipelineConfig
from jaxtrain.models.quant import gathering_weights
from jaxtrain.models.sharding import constrain, logical_ways, mesh_axes_of

STAGES = "layer_stages"  # logical axis of the stage dimension (of parameters and of activations in flight)


def stages() -> int:
    """Pipeline stages under the active rule set and mesh: 1 (no pipeline) outside a context."""
    return logical_ways(STAGES)


def microbatches(schedule: PipelineConfig, num_stages: int) -> int:
    """Micro-batches in flight per pass: as many as stages unless set."""
    return schedule.microbatches or num_stages


def _rematted(layer: Callable, policy: Callable | None, looped: bool) -> Callable:
    """``layer`` rematerialised in the backward under ``policy`` (None: as autodiff keeps it). Only a recomputed layer
    lays its weights out for their products itself (jaxtrain/models/quant.py ``gathering_weights``). ``looped``: the layer runs
    in a loop XLA keeps, which alone stops it merging the recomputation with the forward; unrolled (or a loop of one
    layer, which XLA inlines), the merge undid the remat: the GPU compile of 8 unrolled layers held 4.2 GiB under
    remat full as under none, 0.9 with the merge prevented (README, "Partial remat")."""
    def traced(*args, **kwargs):  # the context is read while jax traces the layer
        with gathering_weights(policy is not None):
            return layer(*args, **kwargs)
    return jax.checkpoint(traced, policy=policy, prevent_cse=not looped) if policy else traced


def _scan(layer: Callable, x: jax.Array, xs: Any, policy: Callable | None, unroll: bool,
          in_loop: bool = False) -> tuple[jax.Array, Any]:
    """``lax.scan`` of ``layer`` rematerialised under ``policy`` over ``xs``; ``in_loop``: the scan runs inside another
    loop (the pipeline's iterations), whose backward is a loop of its own."""
    length = jax.tree.leaves(xs)[0].shape[0]
    return jax.lax.scan(_rematted(layer, policy, looped=in_loop or (not unroll and length > 1)), x, xs, unroll=unroll)


def _scan_layers(layer: Callable, x: jax.Array, params: Any, policy: Callable | None, rematted: int | None,
                 unroll: bool) -> tuple[jax.Array, Any]:
    """``lax.scan`` of ``layer`` over ``params`` (stacked on a leading layers axis), the first ``rematted`` layers (None:
    all) rematerialised under ``policy``, the others kept whole: two scans, over the stacks' two slices (XLA's GPU
    compiler then keeps a copy of the slices, at most the device's share of the layers' weights: README, "Partial
    remat")."""
    num_layers = jax.tree.leaves(params)[0].shape[0]
    if policy is None or rematted is None or rematted == num_layers:
        return _scan(layer, x, params, policy, unroll)
    x, recomputed = _scan(layer, x, jax.tree.map(lambda a: a[:rematted], params), policy, unroll)
    x, kept = _scan(layer, x, jax.tree.map(lambda a: a[rematted:], params), None, unroll)
    return x, jax.tree.map(lambda a, b: jnp.concatenate([a, b]), recomputed, kept)


def apply_layers(layer: Callable, params: nnx.State, x: jax.Array, schedule: PipelineConfig,
                 activation_axes: tuple[str, ...], remat_policy: Callable | None = None,
                 remat_layers: int | None = None, unroll: bool = False) -> tuple[jax.Array, Any]:
    """``layer(x, layer_params) -> (x, per-layer outputs)`` over every layer of ``params`` (stacked on a leading
    layers axis), the first ``remat_layers`` of them (None: all; under stages, that share of each stage's layers of
    each repeat) rematerialised in the backward under ``remat_policy`` (a ``jax.checkpoint`` policy; None: no remat):
    ``lax.scan`` (``unroll``: unrolled when compiling) without stages, returning x and the
    outputs stacked over layers; the pipeline with them, returning x and None (per-layer outputs, such as MoE
    router statistics, are not collected through stages), where the layer is called as ``layer(x, layer_params,
    rows=numbers)`` with the numbers in the batch of the rows x holds (so that each row draws the random masks it
    draws without stages).
    ``activation_axes``: logical axes of x."""
    num_stages = stages()
    if num_stages == 1:
        return _scan_layers(layer, x, params, remat_policy, remat_layers, unroll)
    repeats, num_micro = schedule.repeats, microbatches(schedule, num_stages)
    num_layers = jax.tree.leaves(params)[0].shape[0]
    per_stage = num_layers // (num_stages * repeats)

    # (layers, ...) -> (repeats, stages, per_stage, ...), stage dimension split. The reshape is first held in the
    # stored layout so the gradient's way back is a constraint-to-constraint all-to-all: reshaped straight from the
    # stage split, jax 0.11.2's partitioner replicated it whole (repeats > 1)
    def stage_view(v: nnx.Variable):
        stored = tuple(v.get_metadata()["out_sharding"])
        p = v[...].reshape(repeats, num_stages, per_stage, *v.shape[1:])
        # without repeats the stage split is the stored one already; held on the repeats dimension (of size 1) it
        # sent every weight and its gradient there and back by all-to-alls (llama3_1b on 2 stages: 2.8 GiB a step)
        if repeats > 1:
            p = constrain(p, stored[:1] + (None, None) + stored[1:])
        return v.replace(constrain(p, (None, STAGES, None) + stored[1:]))

    params = jax.tree.map(stage_view, params, is_leaf=lambda v: isinstance(v, nnx.Variable))

    def run_stage(stage_params, h, repeat, micro):  # one stage: its layers of this repeat on micro-batch micro, in order
        rows = micro + num_micro * jnp.arange(h.shape[0])  # micro-batch j holds rows j, j + num_micro, ... (below)
        # each layer takes its weights from the stage's (repeats, layers per stage) stack inside the remat: taken
        # outside, the slice of this iteration's repeat would be saved for the backward of every iteration
        # (iterations x the stage's weights of one repeat); inside, only the indices are, and the backward re-slices.
        # A select over the repeats, not p[repeat, j]: vmapped, that gather's gradient is a batched scatter that XLA's
        # GPU compiler of jax 0.10.2 rejects ("Repeated dimensions not allowed in scatter_dims_to_operand_dims"); that of
        # 0.11.2 compiles either to the same peak
        def layer_at(h, j):
            return layer(h, jax.tree.map(lambda p: jax.lax.select_n(repeat, *p[:, j]), stage_params), rows=rows)

        if remat_policy is None or remat_layers in (None, num_layers):
            return _scan(layer_at, h, jnp.arange(per_stage), remat_policy, unroll=False, in_loop=True)[0]
        rematted = remat_layers // (num_stages * repeats)
        h = _scan(layer_at, h, jnp.arange(rematted), remat_policy, unroll=False, in_loop=True)[0]
        return _scan(layer_at, h, jnp.arange(rematted, per_stage), None, unroll=False, in_loop=True)[0]

    # vmap over stages; its spmd axis keeps the per-stage constraints inside the layers split over stages
    all_stages = jax.vmap(run_stage, in_axes=(1, 0, 0, 0), spmd_axis_name=mesh_axes_of(STAGES))
    in_flight = (STAGES,) + activation_axes  # (stages, micro-batch, length, embed)
    batch = x.shape[0]
    # micro-batch j takes rows j, j + num_micro, ...: each batch shard keeps its rows (no data moves). The buffer
    # stays (rows, micro-batch, ...): swapped to (micro-batch, rows, ...), XLA's GPU compiler all-gathered all of it
    # over the batch axes in every iteration. Each stage holds a copy; only stage 0's is read and written, in place,
    # with what the shift brought it. Replicated over the stages instead, it cost a broadcast of the last stage's
    # output and a sum of the fed micro-batch's gradient over the stages in every iteration
    buffer_axes = (STAGES,) + activation_axes[:1] + (None,) + activation_axes[1:]  # (stages, rows, micro-batch, ...)
    buffer = constrain(jnp.broadcast_to(x.reshape(batch // num_micro, num_micro, *x.shape[1:]),
                                        (num_stages, batch // num_micro, num_micro, *x.shape[1:])), buffer_axes)
    first_stage = (jnp.arange(num_stages) == 0)[:, None, None, None]

    def iteration(carry, t):
        shifted, buffer = carry
        # stage 0 takes micro-batch t mod M (fresh on the first repeat, the last stage's output after);
        # stage s takes what stage s - 1 made one iteration before
        fed = jax.lax.dynamic_index_in_dim(buffer, t % num_micro, 2, keepdims=False)
        inputs = constrain(jnp.where(first_stage, fed, shifted), in_flight)
        # stage s works on micro-batch (t - s) mod M of repeat (t - s) // M; outside repeats 0 .. repeats - 1 it idles
        # (the bubble) on values never used
        repeat = jnp.clip((t - jnp.arange(num_stages)) // num_micro, 0, repeats - 1)
        micro = (t - jnp.arange(num_stages)) % num_micro
        # each stage's output on to the next stage (a collective permute): the last stage's to stage 0
        shifted = constrain(jnp.roll(constrain(all_stages(params, inputs, repeat, micro), in_flight), 1, axis=0), in_flight)
        done = t - (num_stages - 1)  # the micro-batch (counted over repeats) the last stage finished
        slot = done % num_micro
        kept = jax.lax.dynamic_index_in_dim(buffer, slot, 2, keepdims=False)
        buffer = jax.lax.dynamic_update_index_in_dim(buffer, jnp.where(done >= 0, shifted, kept), slot, 2)
        return (shifted, constrain(buffer, buffer_axes)), None

    shifted = constrain(jnp.zeros((num_stages, batch // num_micro) + x.shape[1:], x.dtype), in_flight)
    iterations = repeats * num_micro + num_stages - 1
    (_, buffer), _ = jax.lax.scan(iteration, (shifted, buffer), jnp.arange(iterations))
    return constrain(buffer[0].reshape(x.shape), activation_axes), None
