"""Memory planner: will this config fit on the target devices, where does the memory go, and what to change.

Two views of the same train step, side by side:
- an analytic estimate per device, itemised (parameters, gradients, optimizer state, activations saved
  under the remat policy, the working sets of the loss and of one layer's backward; the peak counts what is live
  at the largest of the moments it can fall on), computed from
  the shardings of the real layout (``layout.make_layout``) and the model shape;
- the compiled truth: the real train step (``layout.lower_train_step``) compiled for the target mesh, on this
  machine's accelerators when it has enough, else on compile-only GPUs (``gpu_targets``), else on simulated
  CPU devices, read back with XLA's ``memory_analysis`` and ``cost_analysis``. The train step's peak is the run's: the
  eval step scores the batch in the train step's micro-batches, forward only, and with the state beside it holds less
  (tests/test_eval_step.py); the validation batches wait in host memory.
Suggestions (rule set, remat, micro-batches) are searched with the analytic estimate, which costs
milliseconds per candidate; the plan itself is compiled, so are the best suggestions until one fits, and
so is each micro-batch count ``train.microbatches=auto`` tries.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import itertools
import math
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import jax
import jax.numpy as jnp
import numpy as np
import psutil
from jax.sharding import PartitionSpec

from jaxtrain import compile_cache, xla_env
from jaxtrain.adapt.adapters import split_frozen
from jaxtrain.config import Config, as_override, as_overrides, flatten, resolve_for_devices, to_dict
from jaxtrain.errors import UserError
from jaxtrain.observe.flops import model_flops_per_token, parameter_counts, peak_flops
from jaxtrain.plan.gpu_targets import GPU_MEMORY_MIB, GPU_MODELS, compile_only_devices, gpu_memory_bytes
from jaxtrain.plan.hlo_report import HloReport, captured_stderr, report, warning_meaning
from jaxtrain.mesh import describe_axes
from jaxtrain.partitioning import batch_shards, gather_axes, logical_ways
from jaxtrain.stages import Schedule, pipelined_variants, schedule, stage_memory
from jaxtrain.state import bytes_per_device, gathered_elements
from jaxtrain.memory.offload import HOST, offloads_master_weights
from jaxtrain.plan.step_cost import (DEFAULT_GPU, StepTime, acting_remat, activation_widths, duration, embedding_gradient_by_columns,
                                     rematted_share, step_time)
from jaxtrain.layout import Layout, idle_axes_note, lower_train_step, make_layout, peak_bytes, unsplit_experts_note, unused_pipeline_note
from jaxtrain.models.attention import scored_fraction
from jaxtrain.models.pipeline import STAGES
from jaxtrain.models.config import REMAT_POLICIES, LlamaConfig

GIB = 2**30
MIB = 2**20
KIB = 2**10
DEFAULT_HEADROOM = 0.10  # share of device memory kept free for the CUDA context, NCCL buffers, fragmentation
RULE_SETS = ("dp", "fsdp", "tp", "fsdp_tp", "zero1", "zero2")
# weighed besides for a mixture of experts: on a mesh with an expert axis the rule sets above leave it idle
EXPERT_RULE_SETS = ("dp_ep", "fsdp_ep", "fsdp_tp_ep")
ACCELERATOR = "gpu"  # the platform plans are for, whatever the step was compiled on
# the offload_* policies are itemised (technique_effects), not searched: a compile on CPUs, which have one memory,
# cannot check what they save
SEARCHED_REMAT = tuple(p for p in REMAT_POLICIES if not p.startswith("offload_"))
# MLP-sized arrays one layer's backward holds in the compute dtype: the GPU compile holds five or six, beside which the
# other terms overcount the layer's weights (docs/PLANNER.md, "The MLP's backward")
MLP_BACKWARD_ARRAYS = 4
AUTO_COMPILES = 4  # train.microbatches=auto: compiles tried past the estimate's choice before giving up
T = TypeVar("T")


# ---------------------------------------------------------------------------------------------
# analytic estimate


def _ways(layout: Layout, logical: str) -> int:
    return logical_ways(layout.rules, layout.mesh, logical)


def platform(layout: Layout) -> str:
    """The platform the layout's devices are: "cpu" for simulated devices, else the accelerator's."""
    return layout.mesh.devices.flat[0].platform


def estimate(layout: Layout, for_platform: str | None = None) -> dict[str, int]:
    """Per-device bytes of the train step on ``for_platform`` (default: the layout's devices), itemised;
    ``estimate_total`` adds them up. Activation terms count, per layer and for one micro-batch on one device,
    the tensors each remat policy keeps for the backward pass."""
    cfg, m = layout.cfg, layout.cfg.model
    state = layout.abstract_state()
    trained = bytes_per_device(state.params)  # a LoRA run: the adapters; its frozen base counts in its storage dtype
    on_cpu = (for_platform or platform(layout)) == "cpu"
    if cfg.optim.offload and offloads_master_weights(m) and not on_cpu:  # master weights on the host, a compute copy here
        trained = trained * np.dtype(m.dtype).itemsize // np.dtype(m.param_dtype).itemsize
    params = trained + bytes_per_device(state.frozen)
    if on_cpu and state.frozen:  # XLA:CPU converts a LoRA run's frozen bfloat16 layer stacks to float32 copies for the
        # layer loops (mixtral_8x7b_lora: 21 GiB a device); a GPU reads them as stored. nf4 codes are not floats
        params += sum(4 * bytes_per_device(x) // x.dtype.itemsize for x in jax.tree.leaves(state.frozen["layers"])
                      if jnp.issubdtype(x.dtype, jnp.floating) and x.dtype.itemsize < 4)
    # optim.offload and the offload_* remat policies keep their arrays in host memory; the CPU backend has one
    # memory, where the compile counts them as it would unmoved arrays
    optimizer = (0 if cfg.optim.offload and not on_cpu else bytes_per_device(state.opt_state)) + bytes_per_device(state.spikes)
    as_placed = lambda shardings, dtype=None: bytes_per_device(  # noqa: E731
        jax.tree.map(lambda x, sh: x.update(sharding=sh, dtype=dtype or x.dtype), state.params, shardings))
    grads, updates = as_placed(layout.gradient_shardings()), as_placed(layout.optimizer_shardings())
    accumulator = as_placed(layout.gradient_shardings(), jnp.float32)  # float32 whatever the parameters' dtype (jaxtrain/step.py)
    k = cfg.train.microbatches
    b = cfg.train.global_batch // k / batch_shards(layout.rules, layout.mesh)  # sequences per device per pass
    seq = cfg.data.seq_len
    # a pipeline's stage works on one of its micro-batches at a time and keeps, for the backward, what each of
    # the schedule's iterations saved: its layers of one repeat on one micro-batch (the bubble's too)
    pipe = schedule(cfg, layout.rules, layout.mesh)
    # the save_ policies also keep cuDNN's fused attention output and its float32 softmax statistics (per query and
    # head; jaxtrain/models/llama.py), stages or not
    keeps_fused_attention = m.remat.startswith("save_") and m.attention == "cudnn"
    remat = acting_remat(m.remat, pipe.stages)
    if on_cpu:
        remat = remat.replace("offload_", "save_")
    tokens = b / pipe.microbatches * seq
    per_stage = m.num_layers / (pipe.stages * pipe.repeats)  # layers a stage runs in one iteration
    layers_saved = pipe.iterations * per_stage
    act = np.dtype(m.dtype).itemsize
    # XLA's CPU pipeline converts every bfloat16 stack saved across the layer scan to a float32 copy before the
    # backward loop; the HLO jax emits keeps them in the compute dtype, as a GPU does
    stack = 4 if on_cpu else act
    hd = m.resolved_head_dim
    embed = tokens * m.d_model  # elements of one residual-stream tensor (the embed axis is never sharded)
    heads = m.num_heads / _ways(layout, "activation_heads")
    # a mixture of experts: each token's hidden states in its top_k experts (capacity_factor x that many slots on
    # the capacity path; dropless: the tokens of the device's whole expert group, gathered over the expert axes)
    # and the shared experts
    moe, widths = m.moe, activation_widths(layout)
    qkv, mlp, routed = tokens * widths.qkv, tokens * widths.mlp, widths.routed
    # attention through XLA materialises a score for every (query, key) pair and head; flash attention (cudnn)
    # keeps only blocks of them; chunked attention the pairs of each query chunk with the keys up to its end
    scored = {"cudnn": 0.0, "chunked": scored_fraction(seq)}.get(m.attention, 1.0)
    scores = scored * b / pipe.microbatches * heads * seq**2
    saved_under = {
        # float32 norm inputs, the projections and 4 MLP intermediates (gate, up and their SwiGLU product among them:
        # jaxtrain/models/llama.py recomputes the SwiGLU's own), float32 and compute-dtype probabilities
        "none": 16 * embed + stack * (2 * embed + qkv + 4 * mlp) + (4 + stack) * scores,
        "full": stack * embed,  # the layer input
        "save_dots": stack * (2 * embed + qkv + 2 * mlp),  # input, q k v, output projection, MLP gate and up
        "save_qkv_out": stack * (2 * embed + qkv),
        # offloaded to host memory; the device keeps each layer's input (the scan saves it) as with full remat
        "offload_dots": stack * embed,
        "offload_qkv_out": stack * embed,
    }
    fused_attention = keeps_fused_attention * tokens * heads * (hd * act + 4)  # output, float32 statistics
    # model.remat_layers: the rematerialised layers save what the policy keeps, the others what remat none does
    share = rematted_share(m)
    saved_per_layer = share * (fused_attention + saved_under[remat]) + (1 - share) * saved_under["none"]
    # one layer's weights gathered over the batch axes (FSDP) for its forward and backward: compute-dtype copy
    # and float32 gradient; the tensor axes keep their split
    trained_axes, frozen_axes = split_frozen(layout.spec.logical_axes)

    def per_layer(tree, logical_axes) -> float:  # elements of one stacked layer, gathered over its batch axes
        axes = jax.tree.leaves(logical_axes["layers"], is_leaf=lambda a: isinstance(a, PartitionSpec))
        return sum(gathered_elements(x, gather_axes(layout.rules, a)) / x.sharding.shard_shape(x.shape)[0]
                   for x, a in zip(jax.tree.leaves(tree["layers"]), axes))

    layer_weights = per_layer(state.params, trained_axes)
    # a LoRA run's frozen layer: gathered in storage, dequantized to the compute dtype (counted as one compute copy
    # of its weights: nf4 codes hold two per byte; the CPU compile also holds a float32 one), no gradient
    frozen_layer = (act + 4 * on_cpu) * per_layer(state.frozen, frozen_axes) * (2 if m.base_quant == "nf4" else 1) if state.frozen else 0
    vocab_table = m.d_model * m.vocab_size / _ways(layout, "vocab")  # elements, gathered over fsdp
    # the embedding lookup's gradient: the columns the device holds (jaxtrain/models/llama.py), or where those are split over
    # an axis the batch is not, autodiff's lookup: the whole gathered table's; none for a frozen table (LoRA)
    lookup_gradient = ("embed" in state.params) * vocab_table / (_ways(layout, "embed") if embedding_gradient_by_columns(layout) else 1)
    # backward of one layer: XLA attention's score arrays (probabilities, their gradient, the scores' gradient:
    # two in float32 and two in the compute dtype on a GPU; three in float32 and one in the compute dtype on the
    # CPU compile); the residual stream's float32 gradients; the embedding lookup's float32 gradient, split as the
    # table is (with accumulators and copies on the CPU compile); the layer's gathered weights and their gradient
    attention_backward = (12 + act if on_cpu else 8 + 2 * act) * scores
    # a circular schedule's layer takes its repeat's weights from the stage's stack by a select over every repeat
    # (jaxtrain/models/pipeline.py), whose backward holds a gradient of the device's share of that layer for each repeat (the
    # CPU compile does; jax 0.11's GPU compile has the peak of a gather): the stage's stack over its layers per repeat
    circular_selection = bytes_per_device(state.params["layers"]) / per_stage if pipe.repeats > 1 else 0
    # a mixture of experts' routed rows in the backward: their hidden states (gate, up, their product) recomputed or
    # read and the gradients of those, the rows in and out and theirs, in the compute dtype
    routed_backward = act * tokens * routed * (6 * m.mlp_dim / _ways(layout, "activation_mlp") + 4 * m.d_model)
    # a dropless grouped matmul expanded into a dense product over every expert the device holds, (rows, experts,
    # hidden) arrays in a layer's backward: XLA's GPU compiler expands jax.lax.ragged_dot (model.moe.grouped_matmul=xla),
    # holding the rows' gate and up products for each expert; XLA:CPU expands every grouped matmul (tokamax's runs its
    # XLA fallback there), holding three such arrays in float32 (jax's) or two in the compute dtype (tokamax's)
    if moe.num_experts and moe.dispatch == "dropless" and (on_cpu or moe.grouped_matmul == "xla"):
        expanded = 3 * 4 if on_cpu and moe.grouped_matmul == "xla" else 2 * act  # arrays x bytes per element
        routed_backward += (expanded * moe.num_experts / _ways(layout, "experts") * tokens * routed * m.mlp_dim
                            / _ways(layout, "activation_mlp"))
    # the MLP's backward: gate and up (recomputed, or copies of the saved ones), the SwiGLU product's gradient and the
    # gate's and up's, in the compute dtype; routed experts' rows are routed_backward's
    dense_rows = moe.num_shared_experts if moe.num_experts else 1
    mlp_backward = MLP_BACKWARD_ARRAYS * act * tokens * m.mlp_dim * dense_rows / _ways(layout, "activation_mlp")
    layer_backward = attention_backward + 16 * embed + mlp_backward + (16 + act if on_cpu else 4) * lookup_gradient \
        + (4 + act) * layer_weights + frozen_layer + circular_selection + routed_backward
    logit_tokens = b * (cfg.train.loss_chunk or seq)  # train.loss_chunk: one chunk's logits live at a time
    # float32 logits and their gradient in the compute dtype (jaxtrain.step.cross_entropy's backward, cast by the
    # output projection's; float32 on the CPU compile); the output table gathered over fsdp: its compute copy, kept
    # for the backward (jaxtrain/models/llama.py), and its float32 gradient unless it is a LoRA run's frozen table (the CPU
    # compile also keeps the float32 value and compute copy of each gathered table)
    table_trains = ("embed" if m.tie_embeddings else "lm_head") in state.params
    loss = logit_tokens * m.vocab_size / _ways(layout, "activation_vocab") * (8 if on_cpu else 4 + act) + \
        ((1 if m.tie_embeddings else 2) * 12 if on_cpu else 4 * table_trains + act) * vocab_table
    grouped_sum = layout.grad_reduction is not None and layout.grad_reduction.rules is not None  # jaxtrain/memory/grad_comm.py
    items = {
        "parameters": params,
        "optimizer state": optimizer,
        # float32 gradients (split as the rule set's gradients: section says, ZeRO-2), filled during the backward;
        # with micro-batches the accumulator, held through the step. The GPU compiler applies the optimizer's update
        # in place, fused with computing it: no buffer of its size (llama3_3b on an H200: 19.2 GiB of temporaries,
        # less than its gradients and an update would take, 23.9). The CPU compile's peak holds one (the size of the
        # parameters split as the optimizer_state: section says, ZeRO-1/2): counted with the gradients there, it
        # keeps the CPU estimate within 15% of that compile (tests/test_plan.py)
        "gradients": grads + (updates if on_cpu else 0),
        # (or, summed once per step over groups vmapped on the summed axes, the groups' gradients before their sum)
        "gradient accumulator": accumulator if k > 1 else grads if grouped_sum else 0,
        # with a pipeline, also the micro-batch buffer the stages read and write, and its gradient; and, in the
        # backward of each iteration, two copies of what that iteration saved (its stage's layers of one repeat)
        "activations": int(layers_saved * saved_per_layer + (pipe.stages > 1) * (2 * b * seq * m.d_model * act + 2 * per_stage * saved_per_layer)),
        "logits and loss": int(loss),
        "layer backward": int(layer_backward),
    }
    if pipe.repeats > 1:  # the circular schedule's view of the layers (stored split contiguously over stages) is a copy
        items["circular re-layout"] = bytes_per_device(state.params["layers"])
    if share < 1 and pipe.stages == 1:  # the two layer scans' slices of the stacks (jaxtrain/models/pipeline.py), kept for the backward
        items["remat_layers slices"] = bytes_per_device(state.params["layers"]) + bytes_per_device((state.frozen or {}).get("layers", {}))
    # the dispatch and combine buffers (routed residual streams) each layer keeps: all of them, or those save_dots
    # names (jaxtrain/models/moe.py EXPERT_SAVED); the layers model.remat_layers leaves out keep theirs
    keeping_dispatch = (1 - share) + share * (remat in ("none", "save_dots"))
    if moe.num_experts and keeping_dispatch:
        items["dispatch buffers"] = int(keeping_dispatch * m.num_layers * stack * 2 * embed * routed)
    return items


# What is live together at each moment the peak can fall on, beside what lives through the whole step (the state,
# a micro-batching accumulator, a circular schedule's copy): the loss's working set at the start of the backward,
# every layer's saved activations still held and no layer's gradient yet; one layer's backward, the layer scan's
# stacked gradients allocated whole while the saved activations are not yet freed. Measured on an H200, the
# compiled and the device's peak agree with this within 3% for llama3_1b and llama3_3b; counting every item at once
# overstated them by 14-41% (README, "GPU: measured on an H200").
MOMENTS = {
    "loss": ("logits and loss", "activations", "dispatch buffers"),
    "layer backward": ("layer backward", "activations", "dispatch buffers", "gradients"),
}


def peak_moment(breakdown: dict[str, int]) -> str:
    """The moment of MOMENTS whose items add up to the most."""
    return max(MOMENTS, key=lambda moment: sum(breakdown.get(key, 0) for key in MOMENTS[moment]))


def peak_items(breakdown: dict[str, int]) -> dict[str, int]:
    """The items live at the peak: what lives through the step and the items of the peak moment."""
    transient = {key for keys in MOMENTS.values() for key in keys}
    live = set(MOMENTS[peak_moment(breakdown)])
    return {key: v for key, v in breakdown.items() if key not in transient or key in live}


def estimate_total(breakdown: dict[str, int]) -> int:
    """Peak bytes: the sum of ``peak_items``."""
    return sum(peak_items(breakdown).values())


# ---------------------------------------------------------------------------------------------
# compiled truth


@dataclasses.dataclass(frozen=True)
class Compiled:
    platform: str  # what it was compiled for: "cpu" (simulated devices) or the accelerator's platform
    device_kind: str
    attention: str  # the attention implementation compiled (CPUs have no cuDNN: "xla" in place of "cudnn")
    argument: int
    output: int
    alias: int
    temp: int
    total: int  # peak_bytes
    flops_per_device: float | None
    compile_s: float
    hlo: HloReport | None = None  # with --hlo-report: what the compiled program holds


def _with_cfg(layout: Layout, cfg: Config) -> Layout:
    return dataclasses.replace(layout, cfg=cfg)


def _with_attention(layout: Layout, attention: str) -> Layout:
    return _with_cfg(layout, dataclasses.replace(layout.cfg, model=dataclasses.replace(layout.cfg.model, attention=attention)))


def compile_truth(layout: Layout, hlo_report: bool = False) -> Compiled:
    """Compile the real train step for the layout's devices and read XLA's memory and cost analyses (and with
    ``hlo_report`` the compiled program itself, and what XLA logged compiling it). A cuDNN attention config is
    compiled with XLA attention where the devices are not GPUs."""
    if layout.cfg.model.attention == "cudnn" and platform(layout) != "gpu":  # the model is rebuilt: it holds the choice
        layout = make_layout(_with_attention(layout, "xla").cfg, list(layout.mesh.devices.flat))
    start = time.perf_counter()
    # the mesh's device as jax's default while tracing: tokamax's ragged dot (model.moe.grouped_matmul) picks its GPU
    # kernel by the default device, which is never a compile-only GPU
    with jax.default_device(layout.mesh.devices.flat[0]):
        train_lowered = lower_train_step(layout)
    # XLA logs its warnings only as it compiles: a program read back from a persistent cache (one set with
    # JAX_COMPILATION_CACHE_DIR) would come without them, so the report's compile bypasses any cache
    with captured_stderr() if hlo_report else contextlib.nullcontext([""]) as log, \
            compile_cache.using(False) if hlo_report else contextlib.nullcontext():
        compiled = train_lowered.compile()
    seconds = time.perf_counter() - start
    hlo = report(compiled.as_text(), dict(layout.mesh.shape), log[0]) if hlo_report else None
    mem = compiled.memory_analysis()
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    return Compiled(platform(layout), layout.mesh.devices.flat[0].device_kind, layout.cfg.model.attention,
                    mem.argument_size_in_bytes, mem.output_size_in_bytes, mem.alias_size_in_bytes, mem.temp_size_in_bytes,
                    peak_bytes(mem), (cost or {}).get("flops"), seconds, hlo)


def estimate_as_compiled(layout: Layout, compiled: Compiled) -> dict[str, int]:
    """The estimate for what was compiled (its platform and attention): the one to compare with it."""
    return estimate(_with_attention(layout, compiled.attention), compiled.platform)


def target_devices(count: int, gpu: str | None = None) -> list:
    """The devices a plan compiles for: this machine's accelerators when it has ``count`` of them; else
    ``count`` compile-only devices of GPU model ``gpu`` when jax's CUDA plugin is installed; else ``count``
    simulated CPU devices (the caller sets XLA's host device count before jax starts)."""
    if jax.default_backend() != "cpu" and jax.device_count() >= count:
        return jax.devices()[:count]
    return compile_only_devices(gpu, count) or jax.devices("cpu")[:count]


def compile_devices(cfg: Config, devices):
    """``devices``, or for a config with optim.offload on compile-only GPU devices, which have no host memory (XLA
    would compile its host arrays into device memory), as many simulated CPU devices: their one memory takes the
    host kinds, and ``accelerator_total`` takes the offloaded arrays out, as for any CPU plan."""
    if not cfg.optim.offload or devices is None or HOST in {m.kind for m in devices[0].addressable_memories()}:
        return devices
    return jax.devices("cpu")[:len(devices)]


def accelerator_total(layout: Layout, compiled: Compiled) -> int:
    """Per-device peak on the accelerator: the compiled total, less the estimated difference between what was
    compiled and the accelerator. On simulated CPU devices that is what only the CPU compile holds (float32
    copies of the saved bfloat16 stacks, more score arrays and vocabulary-table copies in the working sets) and
    the score arrays of XLA attention compiled in place of cuDNN's; on a GPU it is nothing."""
    return compiled.total - (estimate_total(estimate_as_compiled(layout, compiled)) - estimate_total(estimate(layout, ACCELERATOR)))


# ---------------------------------------------------------------------------------------------
# search


def _replace(cfg: Config, **changes) -> Config:
    train = {k: v for k, v in changes.items() if k == "microbatches"}
    cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, **train))
    if "remat" in changes:  # on every layer unless told
        model = dataclasses.replace(cfg.model, remat=changes["remat"], remat_layers=changes.get("remat_layers"))
        cfg = dataclasses.replace(cfg, model=model)
    if "rules" in changes:
        cfg = dataclasses.replace(cfg, rules=changes["rules"])
    if "offload" in changes:
        cfg = dataclasses.replace(cfg, optim=dataclasses.replace(cfg.optim, offload=changes["offload"]))
    return cfg


def _remat_layer_counts(cfg: Config, remat: str, unit: int) -> list[int | None]:
    """The model.remat_layers the search weighs for a policy: every layer (None), or about a quarter, half or three
    quarters of them, as multiples of ``unit`` (a pipeline's stages x repeats: each stage rematerialises as many)."""
    layers = cfg.model.num_layers
    if remat == "none":
        return [None]
    return [None, *sorted({unit * round(layers * share / unit) for share in (0.25, 0.5, 0.75)} - {0, layers})]


def _valid_microbatches(cfg: Config, shards: int) -> list[int]:
    """Micro-batch counts that divide the global batch into passes the batch shards split evenly."""
    n = cfg.train.global_batch
    return [k for k in range(1, n + 1) if n % k == 0 and (n // k) % shards == 0]


def _layouts_by_rules(cfg: Config, devices, rule_sets) -> dict[str, Layout]:
    """The layout under each rule set that the mesh and model allow (make_layout does every check), leaving out
    a rule set that splits everything as an earlier one does (e.g. fsdp_tp on a mesh whose tensor axis is 1)."""
    out, seen = {}, set()
    for rules in rule_sets:
        try:
            layout = make_layout(_replace(cfg, rules=rules, microbatches=1), devices)
        except UserError:
            continue
        shapes, trained = jax.tree.leaves(layout.spec.shapes), jax.tree.leaves(split_frozen(layout.spec.shapes)[0])
        splits = (tuple(sh.shard_shape(x.shape) for x, sh in zip(shapes, jax.tree.leaves(layout.shardings.model_params))),
                  *(tuple(sh.shard_shape(x.shape) for x, sh in zip(trained, jax.tree.leaves(shardings)))
                    for shardings in (layout.gradient_shardings(), layout.optimizer_shardings())),
                  tuple(sorted((logical, _ways(layout, logical)) for logical in layout.rules)))
        if splits not in seen:
            seen.add(splits)
            out[rules] = layout
    return out


def _pipelined_layouts(cfg: Config, devices) -> dict[str, tuple[Config, Layout]]:
    """``stages.pipelined_variants`` and their layouts: for each stage count, the most micro-batches the batch allows."""
    out = {}
    for variant in pipelined_variants(cfg):
        name = f"{variant.rules} stage {variant.mesh.dcn.stage}"
        if name not in out:
            with contextlib.suppress(UserError):
                out[name] = (variant, make_layout(_replace(variant, microbatches=1), devices))
    return out


def _candidates(base: Layout, limit_bytes: float) -> list[int]:
    """Micro-batch counts for ``base`` (a layout of the config), from the fewest whose estimated accelerator total
    fits ``limit_bytes`` (the most the batch allows when none does) upwards."""
    cfg = base.cfg
    options = _valid_microbatches(cfg, batch_shards(base.rules, base.mesh) * schedule(cfg, base.rules, base.mesh).microbatches)
    fits = [i for i, k in enumerate(options)
            if estimate_total(estimate(_with_cfg(base, _replace(cfg, microbatches=k)), ACCELERATOR)) <= limit_bytes]
    return options[fits[0] if fits else -1:]


def unfitted_layout(cfg: Config, devices=None) -> Layout:
    """``make_layout``, with ``train.microbatches=auto`` at one pass until ``fit_microbatches`` decides (or for
    devices without a memory limit, for good): the count changes neither the model nor any sharding."""
    if cfg.train.microbatches == "auto":
        return make_layout(_replace(cfg, microbatches=1), devices, microbatches_auto=True)
    return make_layout(cfg, devices)


def fit_microbatches(base: Layout, limit_bytes: float, compile_fn: Callable[[Layout], tuple[T, int]]) -> tuple[Layout, T]:
    """``train.microbatches=auto`` on ``base`` (``unfitted_layout``'s): compile with the estimate's choice, and while
    the compiled peak (the second value ``compile_fn`` returns) exceeds ``limit_bytes`` try the next count, at most
    AUTO_COMPILES times. Returns the layout and what ``compile_fn`` made of it."""
    for k in _candidates(base, limit_bytes)[:AUTO_COMPILES]:
        layout = _with_cfg(base, _replace(base.cfg, microbatches=k))  # base.cfg: model.attention=auto resolved
        result, peak = compile_fn(layout)
        if peak <= limit_bytes:
            break
    return layout, result


# how far over the compiled step's peak the estimate may be on CPUs: tests/test_plan.py holds it to 15%, and to 25%
# where the vocabulary tables dominate (it is 18% over there)
ESTIMATE_TOLERANCE = 0.25


def check_host_memory(layout: Layout) -> None:
    """CPU devices report no memory size, and each of them keeps its shards in the host's memory: a train step the
    estimate puts, less its tolerance, above the memory this host has available is refused in one line before anything
    is compiled (llama3_8b on a laptop compiled for minutes, then swapped or was killed without a word); one within the
    tolerance of it is noted. The fix offered follows what does not fit: the model's state, or a step's activations."""
    if platform(layout) != "cpu":
        return
    devices = [d for d in layout.mesh.devices.flat if d.process_index == jax.process_index()]
    items = peak_items(estimate(layout))
    per_device = sum(items.values())
    needed, available = per_device * len(devices), psutil.virtual_memory().available
    if needed <= available:
        return
    said = (f"the train step needs about {needed / GIB:.1f} GiB of host memory ({per_device / GIB:.2f} GiB on each of the "
            f"{len(devices)} CPU devices, by the planner's estimate: `jaxtrain plan` with the same arguments itemises it), "
            f"more than the {available / GIB:.1f} GiB this machine has available")
    if needed * (1 - ESTIMATE_TOLERANCE) <= available:
        print(f"jaxtrain: note: {said}, within the estimate's {ESTIMATE_TOLERANCE:.0%}: the run may swap or be stopped for "
              "memory", file=sys.stderr, flush=True)
        return
    state = items.get("parameters", 0) + items.get("optimizer state", 0)
    if state * len(devices) * (1 - ESTIMATE_TOLERANCE) > available:
        fix = ("the parameters and optimizer state alone do not fit: train a smaller model (model.num_layers, model.d_model, "
               "or an experiment such as small), only adapters (model.lora.rank=16), or on GPUs")
    else:
        fix = (f"a step's activations do not fit: pass fewer tokens at a time (train.microbatches=N splits the batch of "
               f"{layout.cfg.train.global_batch} x {layout.cfg.data.seq_len} tokens; or a smaller train.global_batch or "
               f"data.seq_len), or keep fewer of them (model.remat=full)")
    raise UserError(f"{said}; {fix}")


def memory_limit(devices=None) -> float | None:
    """Usable bytes on the first device, as a plan counts them (``usable_bytes``): the device memory less the
    default headroom, at most jax's allocator pool. None where devices report no limit (CPU). By default the first
    of this process's devices: another process's refuses ``memory_stats`` (every process but 0 of a job)."""
    pool = ((devices or jax.local_devices())[0].memory_stats() or {}).get("bytes_limit")
    if pool is None:
        return None
    fraction = xla_env.memory_fraction()  # the pool's share of the device's memory, which devices do not report
    return usable_bytes(pool / fraction, DEFAULT_HEADROOM, fraction)


def usable_bytes(device_memory: float, headroom: float, allocator_fraction: float) -> float:
    """What XLA's buffers may take: the device memory less the headroom (the CUDA context, NCCL buffers and
    fragmentation), and no more than jax's allocator pool (``allocator_fraction`` of the device)."""
    return device_memory * min(1 - headroom, allocator_fraction)


@dataclasses.dataclass(frozen=True)
class Suggestion:
    cfg: Config
    changes: dict  # config key -> value
    total: int  # estimated bytes per device on the accelerator
    breakdown: dict
    relative_step_time: float  # vs. the planned config, by step_cost.step_time
    compiled: int | None = None  # the compiled step's bytes per device on the accelerator, when it was compiled
    saved: int = 0  # estimated bytes per device below the planned config
    host_s: float = 0.0  # step_cost.StepTime.host_s: optim.offload's or an offload_* remat policy's copies over PCIe per step

    def describe(self, limit: int) -> str:
        change = as_overrides(self.changes)
        checked = "" if self.compiled is None else \
            f"; compiled {_size(self.compiled)}: {'fits' if self.compiled <= limit else 'does NOT fit'}"
        host = f", costs {duration(self.host_s)}/step of host transfer at PCIe bandwidth" if self.host_s else ""
        return (f"{change}: saves {_size(self.saved)} per device{host}; {_size(self.total)} of {_size(limit)} "
                f"usable, step time x{self.relative_step_time:.2f}{checked}")


def suggest(cfg: Config, limit_bytes: float, devices=None, gpu: str | None = None, count: int = 5) -> list[Suggestion]:
    """Configurations that fit, over rule set (ZeRO-1/2 among them, and the expert-parallel ones for a mixture of
    experts; none that leaves a mesh axis idle the plan uses)
    x remat (on every layer, or a quarter, half or three quarters of them: model.remat_layers) x optim.offload
    x micro-batches (the fewest that fit for each),
    ranked by estimated step time on ``gpu`` (recompute and communication). Micro-batches are how the
    per-device batch shrinks: the global batch, a training hyper-parameter, is left alone."""
    rule_sets = (*RULE_SETS, *(EXPERT_RULE_SETS if cfg.model.moe.num_experts else ()))
    layouts = _layouts_by_rules(cfg, devices, dict.fromkeys((cfg.rules, *rule_sets)))
    planned = _with_cfg(layouts[cfg.rules], cfg)  # the layouts are built at one micro-batch: the plan's own count here
    base = step_time(planned, gpu)
    base_time = base.total_s
    base_total = estimate_total(estimate(planned, ACCELERATOR))
    options = {rules: (_replace(cfg, rules=rules), layout) for rules, layout in layouts.items()}
    if base.communication_s["fsdp"] > base.compute_s:  # FSDP's gathers dominate: weigh pipeline stages across nodes
        options |= _pipelined_layouts(cfg, devices)
    found = []
    current = flatten(to_dict(cfg))
    for variant, layout in options.values():
        if _idles_more(layout, planned):
            continue
        pipe = schedule(variant, layout.rules, layout.mesh)
        offloads = dict.fromkeys((cfg.optim.offload, True))
        # a dot-saving policy under stages runs as full: offered as full alone, not twice with the same figures
        policies = [(remat, layers, offload) for remat, offload in itertools.product(SEARCHED_REMAT, offloads)
                    if acting_remat(remat, pipe.stages) == remat
                    for layers in _remat_layer_counts(cfg, remat, pipe.stages * pipe.repeats)]
        for remat, layers, offload in policies:
            for k in _valid_microbatches(cfg, batch_shards(layout.rules, layout.mesh) * pipe.microbatches):
                candidate = _replace(variant, remat=remat, remat_layers=layers, microbatches=k, offload=offload)
                breakdown = estimate(_with_cfg(layout, candidate), ACCELERATOR)
                total = estimate_total(breakdown)
                if candidate != cfg and total <= limit_bytes:
                    changes = {key: new for key, new in flatten(to_dict(candidate)).items() if current[key] != new}
                    timed = step_time(_with_cfg(layout, candidate), gpu)
                    found.append(Suggestion(candidate, changes, total, breakdown, timed.total_s / base_time,
                                            saved=base_total - total, host_s=timed.host_s))
                    break  # more micro-batches only cost time
    return sorted(found, key=lambda s: (s.relative_step_time, len(s.changes), s.total))[:count]


def _idles_more(layout: Layout, planned: Layout) -> bool:
    """Whether ``layout`` leaves a mesh axis idle that the planned one uses: its devices would repeat each other's work
    (e.g. fsdp_tp on a mesh with a stage axis: half the GPUs redoing the other half's)."""
    return not set(layout.idle_axes) <= set(planned.idle_axes)


# each memory technique alone, as a config change the planner itemises (rule sets, offload, activation offload)
TECHNIQUES = ({"rules": "zero1"}, {"rules": "zero2"}, {"rules": "fsdp"}, {"offload": True}, {"remat": "offload_dots"})


@dataclasses.dataclass(frozen=True)
class Technique:
    change: str  # the config key=value (keys it sets together space-separated, as_overrides)
    saved: int  # estimated bytes per device on the accelerator below the planned config (negative: more)
    relative_step_time: float
    host_s: float

    def describe(self) -> str:
        host = f", {duration(self.host_s)}/step of host transfer at PCIe bandwidth" if self.host_s else ""
        effect = f"saves {_size(self.saved)}" if self.saved >= 0 else f"adds {_size(-self.saved)}"  # e.g. zero1 over FSDP
        return f"{self.change}: {effect} per device, step time x{self.relative_step_time:.2f}{host}"


def technique_effects(layout: Layout, gpu: str | None = None) -> list[Technique]:
    """What each memory technique alone would change of the planned layout: estimated bytes per device on the
    accelerator and step time (``step_cost``); those the config already uses, the mesh cannot take, that leave a mesh
    axis idle, that change neither memory nor step time, or that would not run as named (a dot-offloading remat
    policy under pipeline stages runs as full: its line named offloading, with full's figures and no host transfer),
    left out."""
    cfg = layout.cfg
    stages = schedule(cfg, layout.rules, layout.mesh).stages
    base_total, base_time = estimate_total(estimate(layout, ACCELERATOR)), step_time(layout, gpu).total_s
    current = flatten(to_dict(cfg))
    out = []
    for change in TECHNIQUES:
        candidate = _replace(cfg, **change)
        if candidate == cfg or "remat" in change and acting_remat(change["remat"], stages) != change["remat"]:
            continue
        try:
            changed = make_layout(candidate, list(layout.mesh.devices.flat)) if "rules" in change else _with_cfg(layout, candidate)
        except UserError:
            continue
        if _idles_more(changed, layout):
            continue
        timed = step_time(changed, gpu)
        saved = base_total - estimate_total(estimate(changed, ACCELERATOR))
        if saved == 0 and timed.total_s == base_time:  # e.g. another rule set on one device: the same program
            continue
        # every key the change sets: a remat policy is weighed on every layer, so model.remat_layers is named where set
        changes = {key: new for key, new in flatten(to_dict(candidate)).items() if current[key] != new}
        out.append(Technique(as_overrides(changes),
                             saved, timed.total_s / base_time, timed.host_s))
    return out


def compile_suggestions(suggestions: list[Suggestion], limit_bytes: float, devices=None) -> list[Suggestion]:
    """Compile the suggestions in rank order until one fits ``limit_bytes`` (at most AUTO_COMPILES of them),
    recording each compiled figure for the accelerator. Each gets a layout of its own: the model graph holds
    the remat policy."""
    out = list(suggestions)
    for i, suggestion in enumerate(out[:AUTO_COMPILES]):
        layout = make_layout(suggestion.cfg, compile_devices(suggestion.cfg, devices))
        out[i] = dataclasses.replace(suggestion, compiled=accelerator_total(layout, compile_truth(layout)))
        if out[i].compiled <= limit_bytes:
            break
    return out


# ---------------------------------------------------------------------------------------------
# the plan


@dataclasses.dataclass(frozen=True)
class Plan:
    cfg: Config
    devices: int
    mesh: dict
    device_memory: int | None
    headroom: float
    allocator_fraction: float  # jax's GPU allocator's share of device memory in the run planned (jaxtrain/xla_env.py)
    estimate: dict  # for what was compiled: its platform and attention (compared with the compiled total)
    accelerator_estimate: dict  # for the accelerator (the suggestions' figures)
    compiled: Compiled
    accelerator_total: int  # the compiled total, less what only the CPU backend adds
    step_time: StepTime
    flops_per_token: float
    tokens_per_step: int
    gpu: str | None
    tokens_per_s: float | None
    suggestions: list
    # with --hlo-report: the compiled program's collective traffic per device per step in step_cost's kinds
    compiled_traffic: dict | None = None
    techniques: tuple = ()  # technique_effects of the planned layout
    per_stage: dict | None = None  # with pipeline stages: stages.stage_memory of the accelerator estimate
    pipeline: Schedule | None = None  # with pipeline stages: their schedule
    idle_axes: dict = dataclasses.field(default_factory=dict)  # Layout.idle_axes: mesh axes whose devices repeat each other's work
    microbatches_auto: bool = False  # train.microbatches=auto: fitted to the usable memory; 1 where no memory size was given
    unsplit_experts_note: str | None = None  # layout.unsplit_experts_note of the planned layout
    unused_pipeline_note: str | None = None  # layout.unused_pipeline_note of the planned layout
    parameters: dict = dataclasses.field(default_factory=dict)  # observe.flops.parameter_counts of the planned layout

    @property
    def usable(self) -> int | None:
        return None if self.device_memory is None else int(usable_bytes(self.device_memory, self.headroom, self.allocator_fraction))

    @property
    def usable_because(self) -> str:
        """What sets the usable memory: the headroom, or jax's allocator pool where that is smaller."""
        if self.allocator_fraction >= 1 - self.headroom:
            return f"{100 * self.headroom:.0f}% headroom"
        return (f"jax's allocator takes {100 * self.allocator_fraction:.0f}% of it, its memory fraction "
                f"{self.allocator_fraction:g}; jaxtrain sets {xla_env.MEMORY_FRACTION} unless {xla_env.MEMORY_FRACTION_NAMES[0]} is set")

    @property
    def estimate_total(self) -> int:
        return estimate_total(self.estimate)

    @property
    def fits(self) -> bool | None:
        return None if self.usable is None else self.accelerator_total <= self.usable

    @property
    def unrolled_layers_note(self) -> str | None:
        """Where ``model.scan_layers=false`` unrolls the compiled layers (no pipeline stages, which scan them): the
        estimate models the scanned program, which the compile then is not. Without the note the gap read as the
        planner's error (tiny, seq 256, remat full, on CPUs: the estimate 57% under the compile)."""
        if self.cfg.model.scan_layers is not False or self.pipeline is not None:
            return None
        return ("note: model.scan_layers=false: the step compiled with its layers unrolled, the estimate models them scanned "
                "(unrolled, XLA:CPU keeps every layer's activations under any remat policy, and GPUs hold more too); "
                "drop model.scan_layers=false to compile the program the estimate models")

    @property
    def mfu_needed(self) -> float | None:
        peak = None if self.gpu is None else peak_flops(self.gpu, self.cfg.model.dtype)
        if peak is None or self.tokens_per_s is None:
            return None
        return self.flops_per_token * self.tokens_per_s / (peak * self.devices)

    @property
    def xla_flops_per_token(self) -> float | None:
        """XLA's cost analysis per token (it counts each loop body once: for reference only)."""
        flops = self.compiled.flops_per_device
        return None if flops is None else flops * self.devices / self.tokens_per_step

    def to_json(self) -> dict:
        c = self.compiled
        return {
            "experiment": {"rules": self.cfg.rules, "remat": self.cfg.model.remat, "remat_layers": self.cfg.model.remat_layers,
                           "attention": self.cfg.model.attention, "microbatches": self.cfg.train.microbatches,
                           "global_batch": self.cfg.train.global_batch, "seq_len": self.cfg.data.seq_len},
            "parameters": self.parameters,
            "mesh": self.mesh, "idle_axes": self.idle_axes, "unsplit_experts_note": self.unsplit_experts_note,
            "unused_pipeline_note": self.unused_pipeline_note, "unrolled_layers_note": self.unrolled_layers_note, "devices": self.devices,
            "gpu": self.gpu,
            "device_memory_bytes": self.device_memory, "headroom": self.headroom,
            "allocator_fraction": self.allocator_fraction, "usable_bytes": self.usable,
            "estimate_bytes": self.estimate | {"total": self.estimate_total},
            # the items the totals count: those live at the peak's moment (the text's items not in parentheses)
            "estimate_peak_items": list(peak_items(self.estimate)),
            "accelerator_estimate_peak_items": list(peak_items(self.accelerator_estimate)),
            "compiled_platform": c.platform, "compiled_device_kind": c.device_kind, "compiled_attention": c.attention,
            "compiled_bytes": {"argument": c.argument, "output": c.output, "alias": c.alias, "temp": c.temp, "total": c.total},
            "estimate_vs_compiled": self.estimate_total / c.total - 1,
            "accelerator_estimate_bytes": self.accelerator_estimate | {"total": estimate_total(self.accelerator_estimate)},
            "accelerator_total_bytes": self.accelerator_total,
            "fits": self.fits,
            "compile_s": c.compile_s,
            "step_time_s": {"total": self.step_time.total_s, "compute": self.step_time.compute_s} | self.step_time.communication_s,
            "run_s": run_seconds(self),  # train.steps at the estimated step time; null under train.epochs
            "flops_per_token": self.flops_per_token,
            "xla_flops_per_token": self.xla_flops_per_token,
            "tokens_per_s": self.tokens_per_s, "mfu_needed": self.mfu_needed,
            "suggestions": [{"changes": s.changes, "total_bytes": s.total, "compiled_bytes": s.compiled,
                             "relative_step_time": s.relative_step_time, "saved_bytes": s.saved, "host_transfer_s": s.host_s}
                            for s in self.suggestions],
            "techniques": [{"change": t.change, "saved_bytes": t.saved, "relative_step_time": t.relative_step_time,
                            "host_transfer_s": t.host_s} for t in self.techniques],
        } | ({} if self.per_stage is None else {"per_stage_bytes": self.per_stage}) | (
            {} if self.pipeline is None else {"pipeline": dataclasses.asdict(self.pipeline) | {"bubble": self.pipeline.bubble}}) | (
            {} if c.hlo is None else {"hlo_report": c.hlo.to_json() | {
                "traffic_bytes": {"predicted": self.step_time.traffic_bytes, "compiled": self.compiled_traffic}}})


def _compile_and_predict(layout: Layout, hlo_report: bool = False) -> tuple[tuple[Compiled, int], int]:
    compiled = compile_truth(layout, hlo_report)
    predicted = accelerator_total(layout, compiled)
    return (compiled, predicted), predicted


def make_plan(cfg: Config, *, device_memory: int | None = None, gpu: str | None = None, headroom: float = DEFAULT_HEADROOM,
              tokens_per_s: float | None = None, devices=None, hlo_report: bool = False,
              allocator_fraction: float | None = None) -> Plan:
    """Plan ``cfg`` on ``devices`` (default: all, i.e. the simulated target mesh). ``train.microbatches=auto`` is
    resolved against the usable memory, checked with the compiled step (1 when no memory size is given).
    ``hlo_report``: also read the compiled program (``Plan.compiled.hlo``). ``allocator_fraction``: jax's GPU
    allocator's share of device memory in the run planned (default: this environment's, else what ``jaxtrain train``
    sets)."""
    if device_memory is None and gpu is not None:
        device_memory = gpu_memory_bytes(gpu)
    if device_memory is not None and device_memory <= 0:
        raise UserError(f"device memory must be positive, got {device_memory / GIB:g} GiB; give --device-memory GiB or --gpu NAME")
    if not 0 <= headroom < 1:
        raise UserError(f"headroom={headroom} must be in [0, 1), e.g. 0.1 to keep 10% of device memory free")
    if allocator_fraction is None:
        allocator_fraction = xla_env.memory_fraction(default=xla_env.MEMORY_FRACTION)
    usable = None if device_memory is None else usable_bytes(device_memory, headroom, allocator_fraction)
    if gpu is not None or device_memory is not None:
        # a plan for a GPU gets its attention and layer scan even when compiled on CPUs; every GPU known is NVIDIA's. A
        # memory size alone is an accelerator's too: planned as the step time is, for DEFAULT_GPU
        cfg = resolve_for_devices(cfg, (gpu or DEFAULT_GPU).lower() in GPU_MEMORY_MIB)
    elif cfg.model.scan_layers == "auto":  # the estimate models the scanned program, as accelerators run it
        cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, scan_layers=True))
    devices = compile_devices(cfg, devices)
    layout = unfitted_layout(cfg, devices)
    microbatches_auto = cfg.train.microbatches == "auto"
    if microbatches_auto and usable is not None:
        layout, (compiled, predicted) = fit_microbatches(layout, usable, functools.partial(_compile_and_predict, hlo_report=hlo_report))
    else:
        (compiled, predicted), _ = _compile_and_predict(layout, hlo_report)
    cfg = layout.cfg
    accelerator_estimate = estimate(layout, ACCELERATOR)
    # what fits and holds less than the plan's own estimate: where the compiled figure is over the limit and the
    # estimate under it, changes that fit by adding memory were offered ("saves -4.3 GiB", llama3_405b_pp on h100s)
    suggestions = [] if usable is None or predicted <= usable else compile_suggestions(
        suggest(cfg, min(usable, estimate_total(accelerator_estimate) - 1), devices, gpu), usable, devices)
    traffic = None if compiled.hlo is None else compiled.hlo.traffic_by_step_cost_kind(
        tuple(layout.rules.get("activation_batch") or ()), tuple(layout.rules.get(STAGES) or ()),
        tuple(layout.rules.get("experts") or ()), layout.replica_axes)
    pipeline = schedule(cfg, layout.rules, layout.mesh)
    per_stage, pipeline = (stage_memory(layout, accelerator_estimate), pipeline) if pipeline.stages > 1 else (None, None)
    return Plan(cfg, layout.mesh.size, dict(layout.mesh.shape), device_memory, headroom, allocator_fraction, estimate_as_compiled(layout, compiled),
                accelerator_estimate, compiled, predicted, step_time(layout, gpu), model_flops_per_token(layout),
                cfg.train.global_batch * cfg.data.seq_len, gpu, tokens_per_s, suggestions, traffic, tuple(technique_effects(layout, gpu)), per_stage,
                pipeline, layout.idle_axes, microbatches_auto, unsplit_experts_note(layout), unused_pipeline_note(layout),
                parameter_counts(layout))


def render(plan: Plan) -> str:
    c, cfg = plan.compiled, plan.cfg
    # one unit down the table (a tiny model's is not all 0.00 GiB), but a row under a tenth of it drops to the unit
    # that shows two digits of it: a long sequence's plan of a tiny model had 0.00 GiB of parameters
    units = [(GIB, "GiB"), (MIB, "MiB"), (KIB, "KiB")][0 if c.total >= GIB else 1:]

    def gib(n):
        # the table's unit, else the first below it that shows the row (KiB at the least)
        scale, unit = next((u for u in units if n == 0 or abs(n) / u[0] >= 0.1), units[-1])
        return f"{n / scale:8.2f} {unit}"

    mesh = describe_axes(plan.mesh)
    moe = cfg.model.moe
    grouped = f"experts' grouped matmul {moe.grouped_matmul}, " if moe.num_experts and moe.dispatch == "dropless" else ""
    lines = [(f"plan: {plan.devices} devices ({mesh}), rules {cfg.rules}, remat {cfg.model.remat_description}, "
              f"{cfg.model.attention} attention, "
              f"{grouped}batch {cfg.train.global_batch} x {cfg.data.seq_len} tokens in {cfg.train.microbatches} micro-batch(es)"
              f"{' (auto)' if plan.microbatches_auto else ''}"
              + ("" if plan.pipeline is None else f"; {plan.pipeline.describe()}")),
             *([f"note: XLA's GPU compiler expands jax.lax.ragged_dot over every expert ({moe.num_experts}x the experts' "
                "FLOPs and a dense (experts, rows, hidden) array per product, the estimate's layer backward counts its gate "
                "and up); pip install 'jaxtrain[moe-gpu]' for tokamax's kernels (model.moe.grouped_matmul=auto picks them)"]
               if grouped and moe.grouped_matmul == "xla" and plan.gpu else []),
             *([f"note: --device-memory without --gpu: attention, layer scan and grouped matmul chosen as for an "
                f"{DEFAULT_GPU.upper()} (--gpu NAME for another)"] if plan.gpu is None and plan.device_memory is not None else []),
             *([note] if (note := idle_axes_note(plan.idle_axes, cfg.rules)) else []),
             *([plan.unsplit_experts_note] if plan.unsplit_experts_note else []),
             *([plan.unused_pipeline_note] if plan.unused_pipeline_note else []),
             *([plan.unrolled_layers_note] if plan.unrolled_layers_note else []),
             ""]
    # compiled on CPUs for a GPU: beside the CPU program's estimate, the GPU's own, whose items and peak moment can differ
    # in kind (llama3_8b on h100s: the CPU's peak is a layer's backward, 158 GiB; the GPU's the loss, 49 GiB)
    target = (plan.gpu or DEFAULT_GPU) if c.platform == "cpu" and plan.device_memory is not None else None
    target_header = f"estimate for {target}" if target else ""
    width = len(target_header) + 2 if target else 0
    on_target = peak_items(plan.accelerator_estimate)

    def target_cell(value: int | None, live: bool = True) -> str:  # the units aligned, what is not live at its peak in parentheses
        text = "" if value is None else gib(value).strip()
        return f"{text + ' ' if live or value is None else f'({text})':>{width}}"

    lines.append(f"{'per device':<22}{'estimate':>12}{target_header:>{width}}   "
                 f"compiled by XLA for {c.device_kind}, {c.attention} attention")
    compiled_rows = [("arguments (state, batch)", c.argument), ("outputs not aliased", c.output - c.alias), ("temporaries", c.temp)]
    at_peak = peak_items(plan.estimate)
    keys = list(dict.fromkeys([*plan.estimate, *(plan.accelerator_estimate if target else ())]))
    for i, key in enumerate(keys):  # more items than compiled rows
        left = (f"{key if key in at_peak else f'({key})':<22}{gib(plan.estimate[key]) if key in plan.estimate else '':>12}"
                f"{target_cell(plan.accelerator_estimate.get(key) if target else None, key in on_target)}")
        right = f"   {compiled_rows[i][0]:<24}{gib(compiled_rows[i][1])}" if i < len(compiled_rows) else ""
        lines.append((left + right).rstrip())
    target_total = target_cell(estimate_total(plan.accelerator_estimate)) if target else ""
    lines.append(f"{'total':<22}{gib(plan.estimate_total):>12}{target_total}   {'total':<24}{gib(c.total)}   "
                 f"(estimate {100 * (plan.estimate_total / c.total - 1):+.1f}%)")
    target_peak = f" (for {target}: {peak_moment(plan.accelerator_estimate)})" if target else ""
    lines.append(f"(items in parentheses are not live at the peak, {peak_moment(plan.estimate)}{target_peak}: "
                 f"{'each' if target else 'the'} total counts what is live then)")
    if c.platform == "cpu":
        only_cpu = "float32 copies of saved stacks, extra score and table copies" + (
            ", XLA attention's scores" if c.attention != cfg.model.attention else "") + (
            ", float32 copies of the frozen base" if cfg.model.lora.rank else "") + (
            ", grouped matmuls expanded over every expert" if grouped else "") + (
            ", what the accelerator keeps in host memory" if cfg.optim.offload or cfg.model.remat.startswith("offload_") else "")
        # that share is itself estimated: llama3_405b_pp's is 67.0 GiB where the estimate says 50.8 (README, "Pipeline").
        # A GPU the planner can describe compiled on CPUs without optim.offload (which no compile-only GPU takes): no plugin
        compilable = plan.gpu is not None and plan.gpu.lower() in GPU_MODELS and not cfg.optim.offload
        lines.append(f"on the accelerator: {_size(plan.accelerator_total)}, the compiled total less an estimated "
                     f"{_size(c.total - plan.accelerator_total)} that only the CPU compile holds ({only_cpu})"
                     + (f"; install jax's CUDA plugin (pip install 'jaxtrain[gpu-plan]') to compile for the {plan.gpu} itself"
                        if compilable else ""))
    if plan.per_stage is not None:
        lines.append("per pipeline stage, estimate on the accelerator (every stage alike: each also holds the embedding and output layer): "
                     + ", ".join(f"{key} {_size(value)}" for key, value in plan.per_stage.items()))
    lines.append("")
    if plan.usable is None:
        # auto fits the micro-batches to a memory size: without one, a 70B model's plan held 1.6 TiB of activations unexplained
        lines.append("verdict: no device memory given (--gpu NAME or --device-memory GiB)" +
                     ("; train.microbatches=auto planned as 1 micro-batch for want of one" if plan.microbatches_auto else ""))
    else:
        verdict = "fits" if plan.fits else "DOES NOT FIT"
        lines.append(f"verdict: {verdict}: {_size(plan.accelerator_total)} of {_size(plan.usable)} usable "
                     f"({_size(plan.device_memory)}, {plan.usable_because})")
        with_headroom = plan.device_memory * (1 - plan.headroom)
        if not plan.fits and plan.accelerator_total <= with_headroom:  # only the allocator's pool is too small
            # the smallest pool that holds the step, rounded up to the printed digits: at most 1 - headroom, so never above 1
            fraction = math.ceil(round(100 * plan.accelerator_total / plan.device_memory, 6)) / 100
            default_fits = plan.accelerator_total <= usable_bytes(plan.device_memory, plan.headroom, xla_env.MEMORY_FRACTION)
            lines.append(f"  0. a larger allocator pool: {_size(plan.accelerator_total)} fits in {_size(with_headroom)} "
                         f"with {xla_env.MEMORY_FRACTION_NAMES[0]}={fraction:.2f}" + (" or more, up to 1" if fraction < 1 else "")
                         + (f", or with it unset (jaxtrain then sets {xla_env.MEMORY_FRACTION})" if default_fits else "")
                         + "; the same step time")
    for i, s in enumerate(plan.suggestions, 1):
        lines.append(f"  {i}. {s.describe(plan.usable)}")
    own = estimate_total(plan.accelerator_estimate)
    if plan.usable is not None and not plan.fits and own <= plan.usable and (not plan.suggestions or c.platform == "cpu"):
        lines.append(f"  the estimate for the GPU ({_size(own)}) fits, the compiled figure does not"
                     + ("; with jax's CUDA plugin the plan compiles for the GPU itself (docs/PLANNER.md)" if c.platform == "cpu" else ""))
    elif plan.usable is not None and not plan.fits and not plan.suggestions:
        lines.append("  no rule set, remat policy or micro-batch count fits by the estimate: use more devices or a mesh with more fsdp/tensor ways")
    if plan.techniques:
        lines.append("memory techniques, each alone (estimate per device on the accelerator):")
        lines += [f"  {t.describe()}" for t in plan.techniques]
    lines.append(f"estimated step time: {plan.step_time.describe()}" + ("" if plan.gpu else " (no --gpu given: an H100 assumed)"))
    lines.append(describe_run(plan))
    lines.append(describe_parameters(plan.parameters, plan.cfg.model))
    xla = plan.xla_flops_per_token
    frozen_base = ", the frozen base's weights 4 per parameter, not 6" if plan.cfg.model.lora.rank else ""
    lines.append(f"FLOPs per token: {plan.flops_per_token:.4g} (PaLM formula, causal attention halved{frozen_base})"
                 + ("" if xla is None else f"; XLA cost analysis {xla:.4g} (counts each loop body - layer scan, micro-batch scan - once)"))
    if plan.mfu_needed is not None:
        impossible = (f": impossible, above the GPU's peak; the plan's estimated step time gives "
                      f"{plan.tokens_per_step / plan.step_time.total_s:,.0f} tokens/s") if plan.mfu_needed > 1 else ""
        lines.append(f"{plan.tokens_per_s:,.0f} tokens/s on {plan.devices} x {plan.gpu} needs MFU {100 * plan.mfu_needed:.1f}%{impossible}")
    lines.append(f"compiled in {c.compile_s:.1f}s")
    if c.hlo is not None:
        lines += ["", *render_hlo(plan)]
    return "\n".join(lines)


def run_length(seconds: float) -> str:
    """A whole run's time in the unit that reads: step_cost.duration's below a minute, then minutes, hours, days."""
    if seconds < 60:
        return duration(seconds)
    if seconds < 3600:
        return f"{seconds / 60:.1f} min"
    return f"{seconds / 3600:.1f} h" if seconds < 2 * 86400 else f"{seconds / 86400:,.1f} days"


def run_seconds(plan: Plan) -> float | None:
    """``train.steps`` at the estimated step time; None under ``train.epochs``, whose steps only the data tells."""
    return None if plan.cfg.train.epochs else plan.cfg.train.steps * plan.step_time.total_s


def describe_run(plan: Plan) -> str:
    """The plan's run line: what the estimated step time comes to over the run's steps, before anything is rented."""
    t = plan.cfg.train
    if t.epochs:
        return (f"run: train.epochs={t.epochs:g}, whose steps `jaxtrain train` counts from the data as it starts (the plan "
                f"reads no data); each 1,000 steps of {plan.tokens_per_step:,} tokens about "
                f"{run_length(1000 * plan.step_time.total_s)} at the estimated step time")
    return (f"run: train.steps={t.steps:,} of {plan.tokens_per_step:,} tokens each ({t.steps * plan.tokens_per_step:,} tokens): "
            f"about {run_length(run_seconds(plan))} at the estimated step time, evaluation and checkpoints not counted")


def describe_parameters(counts: dict, m: LlamaConfig) -> str:
    """The plan's model line: parameters as published models count them (observe.flops.parameter_counts)."""
    active = (f", {counts['active_per_token']:,} active per token (top {m.moe.top_k} of {m.moe.num_experts} experts)"
              if m.moe.num_experts else "")
    trained = f", {counts['trained']:,} of them trained (the LoRA adapters)" if counts["trained"] != counts["total"] else ""
    return f"model: {counts['total']:,} parameters{active}{trained}"


def _size(n: float) -> str:
    """Bytes in the unit that shows them: GiB from 0.1 GiB, MiB from 0.1 MiB, KiB below (a tiny model's plan)."""
    if abs(n) >= GIB / 10:
        return f"{n / GIB:,.1f} GiB"
    return f"{n / MIB:.3g} MiB" if abs(n) >= MIB / 10 else f"{n / KIB:.3g} KiB"


def render_hlo(plan: Plan) -> list[str]:
    """The --hlo-report section: the compiled program's collectives next to step_cost's prediction, fusions,
    attention kernel, matmul FLOPs by operand element types, the kernels' memory traffic, XLA's warnings."""
    c, hlo = plan.compiled, plan.compiled.hlo
    attention = f"cuDNN fused ({hlo.attention_calls} custom calls)" if hlo.attention == "cudnn" else "XLA (no fused attention kernel)"
    lines = [f"compiled program ({c.device_kind}): {hlo.fusions} fusions; attention: {attention}",
             f"{'collectives per step':<36}{'instr.':>7}{'runs':>7}{'tensors':>8} {'bytes':>12} {'traffic':>12}{'async':>7}{'overlapped':>11}"]
    for g in hlo.groups():
        axes = "?" if g["axes"] is None else ",".join(g["axes"]) or "-"
        runs = f"{'' if g['executions_known'] else '>='}{g['executions']}"
        lines.append(f"  {g['kind'] + ' over ' + axes:<34}{g['instructions']:>7}{runs:>7}{g['tensors']:>8}"
                     f" {_size(g['bytes']):>12} {_size(g['traffic_bytes']):>12}{g['async']:>7}{g['overlapped']:>11}")
    if not hlo.collectives:
        lines.append("  none")
    if not all(c.executions_known for c in hlo.collectives):
        lines.append("  >=: inside a loop without a known trip count (XLA's loop pipelining peels loops): runs, bytes, "
                     "traffic are lower bounds")
    predicted, compiled = plan.step_time.traffic_bytes, plan.compiled_traffic
    lines.append("traffic per device per step, step_cost's prediction / compiled: "
                 + ", ".join(f"{kind} {_size(predicted[kind])} / {_size(compiled.get(kind, 0))}" for kind in predicted))
    total = sum(hlo.matmul_flops.values())
    lines.append(f"matmuls per step: {total:.3g} FLOPs per device" + "".join(
        f"{', ' if i else ': '}{types} {100 * flops / total:.1f}%" for i, (types, flops) in enumerate(hlo.matmul_flops.items()))
        + (f"; cuBLAS {100 * hlo.library_matmul_flops / total:.1f}%" if hlo.library_matmul_flops else ""))
    if hlo.duplicated_matmul_flops:
        lines.append(f"  computed twice: {hlo.duplicated_matmul_flops:.3g} FLOPs ({100 * hlo.duplicated_matmul_flops / total:.1f}%), "
                     "the same two arrays multiplied again (jax 0.11's dynamic-slice fusion of a cuBLAS gemm whose result "
                     "the layer scan saves: XLA_FLAGS=--xla_gpu_enable_dynamic_slice_fusion=false, jaxtrain's default)")
    if hlo.custom_calls:  # XLA does not see inside them: only a gemm library's calls are in the matmul line (_is_gemm)
        lines.append("custom calls per step (library and Pallas kernels; the gemms among them are counted in the matmul "
                     "FLOPs above, the others' FLOPs are not): "
                     + ", ".join(f"{target} {runs:g}" for target, runs in hlo.custom_calls.items()))
    moved = hlo.kernel_bytes
    bandwidth = next((g.memory_bandwidth for g in GPU_MODELS.values() if g.description == c.device_kind), None)
    at_bandwidth = f" (at least {1e3 * moved['other'] / bandwidth:.0f} ms at {bandwidth / 1e12:.2g} TB/s)" if bandwidth else ""
    lines.append(f"kernel memory traffic per step: elementwise and reductions {_size(moved['other'])}{at_bandwidth}, "
                 f"matmuls {_size(moved['matmul'])}, attention {_size(moved['attention'])}; largest elementwise and reductions:")
    lines += [f"  {_size(b):>10}  {name}" for name, b in hlo.largest_other_kernels]
    lines.append("XLA warnings: " + ("none" if not hlo.warnings else f"{len(hlo.warnings)}"))
    for warning in hlo.warnings:
        meaning = warning_meaning(warning)
        lines += [f"  {warning}"] + ([f"    means: {meaning}"] if meaning else [])
    return lines


def plot(plan: Plan, path: Path) -> None:
    """Stacked per-device memory on the accelerator of the plan and the suggestions (estimates, the items at
    the peak), the plan's compiled figure, and the limit."""
    from jaxtrain.observe.plot import plt, save_figure

    bars = [("plan (estimate)", plan.accelerator_estimate)] + [
        (" & ".join(f"{k.split('.')[-1]}={as_override(v)}" for k, v in s.changes.items()), s.breakdown) for s in plan.suggestions]
    fig, ax = plt.subplots(figsize=(max(6, 1.6 * (len(bars) + 1)), 5))
    items = list(plan.accelerator_estimate)
    for i, (_, breakdown) in enumerate(bars):
        bottom = 0.0
        at_peak = peak_items(breakdown)
        for j, item in enumerate(items):
            height = at_peak.get(item, 0) / GIB
            ax.bar(i, height, bottom=bottom, color=f"C{j}", label=item if i == 0 else None)
            bottom += height
    ax.bar(len(bars), plan.accelerator_total / GIB, color="0.6", label=f"compiled for {plan.compiled.device_kind}")
    ax.set_xticks(range(len(bars) + 1), [name for name, _ in bars] + ["plan (compiled)"], rotation=20, ha="right", fontsize=8)
    if plan.device_memory is not None:
        ax.axhline(plan.device_memory / GIB, color="k", label="device memory")
        ax.axhline(plan.usable / GIB, color="k", linestyle="--", label=f"usable ({plan.usable_because})")
    ax.set_ylabel("GiB per device on the accelerator")
    ax.set_title(f"{plan.devices} devices, rules {plan.cfg.rules}, remat {plan.cfg.model.remat_description}, "
                 f"{plan.cfg.train.microbatches} micro-batch(es)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    save_figure(fig, path)
