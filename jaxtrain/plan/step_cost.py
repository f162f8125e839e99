"""Estimated step time of a layout on a GPU model, to rank the planner's suggestions.

Compute: the PaLM FLOPs plus what the remat policy recomputes, at ASSUMED_MFU of the datasheet peak; a LoRA run's
frozen base takes no weight gradients (its 2N of the 6N left out, the adapters' own FLOPs added). Under pipeline
stages the dot-saving policies save no dot and recompute as full (``acting_remat``).
Communication: the collectives the rule set implies, with ring algorithms (an all-gather or
reduce-scatter of N bytes over n devices moves N (n-1)/n per device, an all-reduce twice that), each over
NVLink when all its mesh axes sit inside a node and over the network otherwise:
- FSDP: per micro-batch, each weight all-gathered over the batch axes it is split on (compute dtype): a layer's
  for the forward and again for the backward, the vocabulary tables once (their gathered copies kept for the
  backward; a tied table for the lookup and for the output layer apart); each gradient reduce-scattered, but the
  embedding lookup's (jaxtrain/models/llama.py): its rows' gradient goes to the devices that hold the table's columns (an
  all-to-all of the pass's residual-stream gradient, with the token ids all-gathered), and each adds its columns,
  summed over the batch's other axes (data) as a data-parallel gradient, in float32. Where the
  table's columns are split over an axis the batch is not (no shipped rule set) the lookup is autodiff's: the
  table gathered once and its gradient reduce-scattered, both in float32;
- data parallel: each gradient all-reduced over the batch axes its weight is replicated on. Over the batch axes
  no weight is split on, once per step after the last micro-batch when optim.grad_sync sums there
  (jaxtrain/memory/grad_comm.py: float32, or optim.grad_dtype; not overlapped with compute); otherwise per
  micro-batch, in GSPMD's backward pass (``jaxtrain plan --hlo-report`` shows XLA reducing inside the micro-batch
  loop), where gradients travel in the dtype the weight is used in: the compute dtype for matmul weights, float32
  for the norm scales (RMSNorm applies them in float32), as the compiled program shows;
- ZeRO-2 (gradients split over batch axes their weight is replicated on): those reduced by a reduce-scatter,
  half an all-reduce; ZeRO-1/2 (optimizer state split so): each updated float32 weight all-gathered once per
  step over those axes, and GSPMD's per-pass sum a reduce-scatter under ZeRO-1 too (the GPU compiler reduces to the
  state's slice; but the embedding lookup's gradient with one micro-batch, all-reduced);
- optim.offload: the optimizer state (and the float32 master weights under narrower compute) copied from host
  memory to the device and back once per step over PCIe (not overlapped); an offload_* remat policy: per micro-batch
  and layer, the activations it offloads copied to the host in the forward and back in the backward (counted as not
  overlapped either: an upper bound where XLA hides the copies behind the layer's compute);
- tensor parallel: per micro-batch and layer, the residual stream all-reduced after attention and the MLP
  in the forward and the backward, and again for each of those the remat policy recomputes; a vocabulary split
  over tensor, per micro-batch the looked-up rows and the output layer's input gradient;
- pipeline (jaxtrain/models/pipeline.py): per micro-batch pass, every iteration shifts each stage's micro-batch of
  activations to the next stage in the forward and back in the backward (point to point, on the critical
  path), and once a pass the output goes from stage 0 to every stage and the input's gradient is summed over
  them (all-reduces of the pass's activations); each stage idles the bubble share
  (stages - 1) / (repeats * microbatches + stages - 1) of the pass; FSDP gathers a stage's layers, and GSPMD
  sums their gradients over the data axes, in every iteration (iterations / repeats times per pass). The
  circular schedule (repeats > 1) also views the layers, stored split contiguously over the stages, per stage
  and repeat in every pass: an all-to-all over the stages of each device's layers (stored dtype) in the
  forward and of their gradients in the backward;
- expert parallel (mixture of experts, capacity dispatch): per micro-batch and layer, the dispatch buffer
  (top_k x capacity_factor tokens' residual streams) all-to-all to the experts and back, in the forward and
  the backward, and again in a recomputed forward (any policy but none, save_dots and offload_dots, which keep the
  routed rows); an all-to-all of N bytes over n devices moves
  N (n-1)/n per device. Dropless dispatch: per micro-batch and layer the expert group's tokens (the batch
  shards over the expert axes) gathered with their router weights and choices, and the outputs reduce-scattered
  back, in the forward; in the backward the outputs' gradient gathered and the tokens' and router weights'
  gradients reduce-scattered; the tokens and one of the two router arrays gathered again in a recomputed forward
  (any remat policy; XLA keeps the other; save_dots and offload_dots keep the tokens, so only that array); each moves (n - 1) x a device's share. Expert weights are neither gathered nor gradient-reduced over the expert axis.
Tensor-parallel all-reduces, pipeline shifts and expert all-to-alls sit on the critical path (each layer waits for them) and add to the compute;
weight gathers and gradient reductions do not depend on the layer being computed, so XLA's latency-hiding
scheduler overlaps them with it and only what exceeds the compute shows. A ranking heuristic, not a
measurement.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import numpy as np
from jax.sharding import PartitionSpec

from jaxtrain.adapt.adapters import split_frozen
from jaxtrain.observe.flops import active_mlps, adapter_params_per_token, model_flops_per_token, peak_flops
from jaxtrain.plan.gpu_targets import LINK_BYTES_PER_S
from jaxtrain.layout import Layout
from jaxtrain.memory.offload import offloads_master_weights
from jaxtrain.partitioning import batch_shards, gather_axes, logical_ways, spec_axes
from jaxtrain.stages import schedule
from jaxtrain.state import bytes_per_device, elements_per_device, gathered_elements
from jaxtrain.models.config import LlamaConfig
from jaxtrain.models.llama import EMBEDDING_AXES
from jaxtrain.models.moe import capacity
from jaxtrain.models.pipeline import STAGES

ASSUMED_MFU = 0.45  # share of the datasheet peak a well-tuned step reaches (MaxText reports 45-55% on H100)
DEFAULT_GPU = "h100"  # what a step is timed on when no GPU is named
# host <-> device bandwidth per direction (PCIe Gen5 x16 on H100 / H200, Gen4 on A100 and L4)
PCIE_BYTES_PER_S = {"h100": 64e9, "h200": 64e9, "a100": 32e9, "a100-40gb": 32e9, "l4": 32e9}
# forward all-reduces of the tensor-parallel residual stream that each policy recomputes in the backward: remat full
# the attention's, which the MLP's input needs (the MLP's own feeds only the layer's output, which the backward does
# not use); save_qkv_out saves the attention's output after its all-reduce (the compiled GPU program shows these)
RECOMPUTED_ALL_REDUCES = {"none": 0, "save_dots": 0, "save_qkv_out": 0, "full": 1, "offload_dots": 0, "offload_qkv_out": 0}
# the policies that recompute a LoRA adapter's rank-sized product x @ A in the backward (the dot-saving ones keep it)
ADAPTER_PRODUCT_RECOMPUTED = {"none": 0, "save_dots": 0, "save_qkv_out": 1, "full": 1, "offload_dots": 0, "offload_qkv_out": 1}


def rematted_share(m: LlamaConfig) -> float:
    """The share of the layers ``model.remat`` rematerialises: ``model.remat_layers`` of them (all when null); the
    others recompute nothing, as under remat none."""
    return 1.0 if m.remat_layers is None else m.remat_layers / m.num_layers


def expert_bytes_per_token(m: LlamaConfig, expert_ways: int) -> float:
    """Expert-parallel bytes a device moves per token of its share, layer and micro-batch (the module docstring)."""
    act, moe = np.dtype(m.dtype).itemsize, m.moe
    if moe.dispatch == "capacity":  # dispatch and combine, forward and backward, and again in the recomputed forward of a
        # policy that keeps none of the routed rows (jaxtrain/models/moe.py EXPERT_SAVED): all but none and the dot-saving ones
        all_to_alls = 4 + 2 * (m.remat not in ("none", "save_dots", "offload_dots")) * rematted_share(m)
        return all_to_alls * moe.top_k * moe.capacity_factor * m.d_model * act * (expert_ways - 1) / expert_ways
    gathers = m.d_model * act + moe.top_k * 8  # the tokens, their float32 router weights and int32 expert choices
    # a recomputed forward: the tokens and one k-wide router array (XLA keeps the other); save_dots and offload_dots
    # keep the gathered tokens (jaxtrain/models/moe.py EXPERT_SAVED), not that router array
    recomputed = moe.top_k * 4 + m.d_model * act * (m.remat not in ("save_dots", "offload_dots"))
    forward = gathers + m.d_model * act  # and the outputs back
    backward = 2 * m.d_model * act + moe.top_k * 4  # the outputs' gradient in, the tokens' and weights' back
    return (forward + backward + recomputed * (m.remat != "none") * rematted_share(m)) * (expert_ways - 1)


def adapter_all_reduces(layout: Layout) -> float:
    """Per token of a device's micro-batch, the bytes of LoRA's all-reduces over the axes that split a layer's
    activations (jaxtrain/models/lora.py): an adapter whose input is split (tensor parallel: o, down) sums its rank-sized
    x @ A there in the forward, and again where the remat policy recomputes it; one whose output is split (q, k, v,
    gate, up), the gradient of x @ A in the backward. Experts' adapters run inside the dispatch's own collectives."""
    m, act = layout.cfg.model, np.dtype(layout.cfg.model.dtype).itemsize
    remat = acting_remat(m.remat, schedule(layout.cfg, layout.rules, layout.mesh).stages)
    trained = split_frozen(layout.spec.logical_axes)[0]
    moved = 0.0
    for path, axes in jax.tree_util.tree_leaves_with_path(trained, is_leaf=lambda s: isinstance(s, PartitionSpec)):
        factor, adapter = getattr(path[-1], "key", None), getattr(path[-2], "key", "") if len(path) > 1 else ""
        if factor not in ("a", "b") or not str(adapter).startswith("lora_") or "experts" in axes:
            continue
        dims = tuple(a for a in axes if a != "layers")
        split = dims[:-1] if factor == "a" else dims[1:]  # A's input dimensions, B's output dimensions
        ways = math.prod(logical_ways(layout.rules, layout.mesh, f"activation_{a}") for a in split if a)
        times = 1 + ADAPTER_PRODUCT_RECOMPUTED[remat] * rematted_share(m) if factor == "a" else 1
        layers = m.num_layers if "layers" in axes else 1
        moved += layers * times * m.lora.rank * act * 2 * (ways - 1) / ways
    return moved


def acting_remat(remat: str, stages: int) -> str:
    """The remat policy as the step runs it: under pipeline stages the layers are vmapped over the stages
    (jaxtrain/models/pipeline.py), every dot has a batch dimension and a dot-saving (or -offloading) policy keeps none: full."""
    return "full" if stages > 1 and remat.endswith("_dots") else remat


@dataclasses.dataclass(frozen=True)
class ActivationWidths:
    """Elements per token of a device's micro-batch in one layer's activations, split as the layout splits them."""

    qkv: float  # q, k and v
    mlp: float  # one MLP intermediate (gate, up): a mixture of experts' in each of the token's expert slots and the shared experts
    routed: float  # a mixture of experts' expert slots per token: top_k x capacity_factor, or (dropless) the expert group's top_k


def activation_widths(layout: Layout) -> ActivationWidths:
    """The layout's ActivationWidths (the memory estimate's activation terms and the offloaded bytes use them)."""
    m, moe = layout.cfg.model, layout.cfg.model.moe

    def ways(logical: str) -> int:
        return logical_ways(layout.rules, layout.mesh, logical)

    qkv = m.resolved_head_dim * (m.num_heads / ways("activation_heads") + 2 * m.num_kv_heads / ways("activation_kv_heads"))
    routed = moe.top_k * (moe.capacity_factor if moe.dispatch == "capacity" else ways("experts")) if moe.num_experts else 0
    mlp = m.mlp_dim * (routed + moe.num_shared_experts if moe.num_experts else 1) / ways("activation_mlp")
    return ActivationWidths(qkv, mlp, routed)


def offloaded_bytes_per_token(layout: Layout, stages: int) -> float:
    """Bytes an offload_* remat policy moves to host memory per token of a device's micro-batch and per layer: what
    its save_ counterpart keeps on the device but the layer's input (the layer scan keeps that there): the attention's
    output projection, q, k, v and, for offload_dots, the MLP's gate and up and a mixture of experts' routed rows and
    outputs (jaxtrain/models/moe.py EXPERT_SAVED)."""
    m = layout.cfg.model
    remat = acting_remat(m.remat, stages)
    if not remat.startswith("offload_"):
        return 0.0
    widths = activation_widths(layout)
    elements = m.d_model + widths.qkv
    if remat == "offload_dots":
        elements += 2 * widths.mlp + 2 * m.d_model * widths.routed
    return elements * np.dtype(m.dtype).itemsize * rematted_share(m)


def expert_slots_per_token(m: LlamaConfig, seq_len: int) -> float:
    """SwiGLU MLPs of model.mlp_dim the step multiplies per token and layer: ``active_mlps``, but under capacity dispatch
    every slot of the experts' buffers, filled or not (jaxtrain/models/moe.py: capacity_factor x top_k, rounded up per expert)."""
    moe = m.moe
    if not moe.num_experts or moe.dispatch != "capacity":
        return active_mlps(m)
    return moe.num_experts * capacity(seq_len, moe.num_experts, moe.top_k, moe.capacity_factor) / seq_len + moe.num_shared_experts


def step_flops_per_token(layout: Layout) -> float:
    """FLOPs per token the train step computes: the PaLM count (observe/flops.py, MFU's convention), the forward work
    the remat policy repeats in the backward, and under capacity dispatch the experts' empty slots. A LoRA run's
    (``model_flops_per_token``: 4 per frozen base parameter, 6 per adapter parameter) adds the adapters' forward
    (counted whole) where the policy recomputes x @ A."""
    cfg, m, seq = layout.cfg, layout.cfg.model, layout.cfg.data.seq_len
    remat = acting_remat(m.remat, schedule(cfg, layout.rules, layout.mesh).stages)
    attention_core = 2 * m.num_layers * seq * m.num_heads * m.resolved_head_dim  # causal fwd (the 6x formula / 3)
    mlp_forward = 2 * m.num_layers * 3 * m.d_model * m.mlp_dim  # one SwiGLU MLP's matmuls, forward
    mlp_matmuls = mlp_forward * expert_slots_per_token(m, seq)
    layer_matmuls = 2 * m.num_layers * m.d_model * m.resolved_head_dim * (2 * m.num_heads + 2 * m.num_kv_heads) + mlp_matmuls
    recomputed = {"none": 0, "save_dots": attention_core, "save_qkv_out": attention_core + mlp_matmuls,
                  "full": attention_core + layer_matmuls}[remat.replace("offload_", "save_")]  # offloading recomputes as saving
    if m.remat.startswith("save_") and m.attention == "cudnn":  # they keep flash attention's output (jaxtrain/models/llama.py)
        recomputed -= attention_core
    frozen_base = split_frozen(layout.spec.shapes)[1] is not None  # a LoRA run: every base weight is frozen
    # the experts' empty capacity slots, multiplied as the filled ones are: forward, input gradient and (a trained base)
    # weight gradient
    empty_slots = mlp_forward * (expert_slots_per_token(m, seq) - active_mlps(m))
    flops = model_flops_per_token(layout) + (2 if frozen_base else 3) * empty_slots + recomputed * rematted_share(m)
    if frozen_base:
        flops += 2 * adapter_params_per_token(layout) * ADAPTER_PRODUCT_RECOMPUTED[remat] * rematted_share(m)
    return flops


@dataclasses.dataclass(frozen=True)
class StepTime:
    gpu: str
    compute_s: float
    communication_s: dict  # "fsdp", "data", "tensor" (and "pipeline" with stages, "expert" for a mixture of experts) -> seconds
    traffic_bytes: dict  # the same kinds -> bytes each device sends per step
    host_s: float = 0.0  # over PCIe: optim.offload's optimizer state (and master weights), an offload_* remat policy's activations
    gradients: str = ""  # how and when gradients are summed across devices (optim.grad_dtype, grad_sync), as describe() says it
    after_backward_s: float = 0.0  # the part of communication_s["data"] summed once after the last micro-batch: not overlapped
    bubble: float = 0.0  # the share of a pass each pipeline stage idles (stages.Schedule.bubble), counted in compute_s

    @property
    def total_s(self) -> float:
        """Compute, plus the tensor-parallel all-reduces and host transfers, plus the overlapped traffic the compute
        cannot hide."""
        c = self.communication_s
        overlapped = c["fsdp"] + c["data"] - self.after_backward_s
        return (self.compute_s + c["tensor"] + c.get("pipeline", 0.0) + c.get("expert", 0.0) + self.host_s + self.after_backward_s
                + max(0.0, overlapped - self.compute_s))

    def describe(self) -> str:
        shown = 1e-3 * self.total_s  # under a thousandth of the step is noise
        parts = ", ".join(f"{kind} {duration(seconds)}" for kind, seconds in self.communication_s.items() if seconds >= shown)
        host = f"; host transfer {duration(self.host_s)}" if self.host_s else ""
        after = f" but the {duration(self.after_backward_s)} of gradient sums after the backward" if self.after_backward_s >= shown else ""
        return (f"{duration(self.total_s)} on {self.gpu} (compute {duration(self.compute_s)} at {100 * ASSUMED_MFU:.0f}% MFU"
                + (f" with the pipeline's {100 * self.bubble:.3g}% bubble" if self.bubble else "")
                + (f"; communication {parts}, fsdp and data overlapped with compute{after}" if parts else "") + host
                + (f"; gradients summed in {self.gradients}" if self.gradients else "") + ")")


def duration(seconds: float) -> str:
    """Seconds in the unit that shows them: s from 0.1 s, ms from 1 ms, µs below (a tiny model's plan)."""
    if seconds >= 0.1:
        return f"{seconds:,.2f} s"
    return f"{1e3 * seconds:.3g} ms" if seconds >= 1e-3 else f"{1e6 * seconds:.3g} µs"


def embedding_gradient_by_columns(layout: Layout) -> bool:
    """Whether the embedding lookup's gradient is built by the table's columns (jaxtrain/models/llama.py): the batch split over
    (at least) the mesh axes its columns are."""
    def split(logical: str) -> set[str]:
        axes = layout.rules.get(logical) or ()
        return {a for a in ((axes,) if isinstance(axes, str) else axes) if layout.mesh.shape[a] > 1}

    return split("embed") <= split("activation_batch")


def step_time(layout: Layout, gpu: str | None = None) -> StepTime:
    cfg, m = layout.cfg, layout.cfg.model
    name = (gpu or DEFAULT_GPU).lower()
    k, seq, act = cfg.train.microbatches, cfg.data.seq_len, np.dtype(m.dtype).itemsize
    # devices along an idle axis (one that splits neither the batch nor a parameter) repeat each other's work
    tokens_per_device = cfg.train.global_batch * seq / (layout.mesh.size / math.prod(layout.idle_axes.values()))
    pipe = schedule(cfg, layout.rules, layout.mesh)
    compute = step_flops_per_token(layout) * tokens_per_device / (peak_flops(name, m.dtype) * ASSUMED_MFU)
    compute /= 1 - pipe.bubble  # the stages idle that share of the pass

    batch_axes = layout.rules.get("activation_batch") or ()
    sequences = cfg.train.global_batch / k / batch_shards(layout.rules, layout.mesh)  # per device and micro-batch
    batch_ways = math.prod(layout.mesh.shape[a] for a in batch_axes)
    fsdp = data = 0.0
    fsdp_axes, data_axes = set(), set()
    params = layout.abstract_state().params
    # the trained parameters' (a LoRA run: the adapters') logical axes, leaf for leaf with params
    logical = jax.tree.leaves(split_frozen(layout.spec.logical_axes)[0], is_leaf=lambda s: isinstance(s, PartitionSpec))
    expert_axes = tuple(layout.rules.get("experts") or ())
    expert_ways = math.prod(layout.mesh.shape[a] for a in expert_axes)

    def ways(x, sharding) -> int:
        """How many ways ``x`` laid out by ``sharding`` is split over the batch axes."""
        placed = x.update(sharding=sharding)
        return gathered_elements(placed, batch_axes) // elements_per_device(placed)

    reduction = layout.grad_reduction  # the sums once per step, over its axes (optim.grad_sync, grad_dtype)
    summed_ways = 1 if reduction is None else reduction.ways
    after_backward = 0.0

    def passes_of(axes) -> float:
        """Per step, the passes that gather a weight with ``axes``: with stages, a layer's weights are gathered, and
        GSPMD sums their gradient over the data axes, in every iteration that runs them (iterations / repeats a pass)."""
        return k * (pipe.iterations / pipe.repeats if pipe.stages > 1 and "layers" in axes else 1)

    # train.loss_chunk (jaxtrain/models/llama.py _chunked_loss): the output table gathered once a pass, as without chunks; a
    # gathered table's gradient reduce-scattered in each chunk's backward, over the gather axes and the batch axes GSPMD
    # sums in every pass (one reduction where there were two), and gathered back over the latter after the loop
    chunks = seq // cfg.train.loss_chunk if cfg.train.loss_chunk else 0

    def output_table(axes) -> bool:
        return tuple(axes) == ("embed", "vocab") or (tuple(axes) == EMBEDDING_AXES and m.tie_embeddings)

    def gathers_per_pass(axes) -> int:
        """A layer's weights again for its recomputed backward; the embedding table also for a tied output layer."""
        return 2 if "layers" in axes or (tuple(axes) == EMBEDDING_AXES and m.tie_embeddings) else 1

    for x, axes, grad_sharding, moment_sharding in zip(jax.tree.leaves(params), logical, jax.tree.leaves(layout.gradient_shardings()),
                                                        jax.tree.leaves(layout.optimizer_shardings())):
        # an expert's weights live on its own devices: no gather or gradient reduction over the expert axes
        own = expert_axes if "experts" in axes else ()
        local, gathered = elements_per_device(x), gathered_elements(x, gather_axes(layout.rules, axes))
        split = gathered // local
        replicated = batch_ways // (split * (expert_ways if own else 1))
        grad = 4 if "norm" in axes else act
        passes = passes_of(axes)
        lookup = tuple(axes) == EMBEDDING_AXES
        # autodiff's lookup where the table's columns are split over an axis the batch is not (jaxtrain/models/llama.py): the
        # table gathered and its gradient summed in float32
        whole = lookup and not embedding_gradient_by_columns(layout)
        tied = lookup and m.tie_embeddings  # also the output layer's: gathered for it apart, its gradient reduced
        per_pass = replicated // summed_ways  # the replicas summed in every pass's backward, the rest once a step
        chunked = chunks and output_table(axes) and split > 1  # an ungathered table's sum is GSPMD's, once a pass
        # the chunked loss's reduce-scatter also over the replicas (where the embed dimension divides, as the model splits)
        chunk_replicas = per_pass if chunked and m.d_model % (logical_ways(layout.rules, layout.mesh, "embed") * per_pass) == 0 else 1
        reduced = x.dtype.itemsize if whole else 0 if lookup and not tied or chunked else grad
        fsdp += passes * gathered * (gathers_per_pass(axes) * (x.dtype.itemsize if whole else act) + reduced) * (split - 1) / split
        if chunked:
            reducing = split * chunk_replicas
            fsdp += passes * chunks * gathered * grad * (reducing - 1) / reducing
            # gathered back over the replicas, axes that split no weight: data parallelism's, as ZeRO's gathers
            data += passes * local * x.dtype.itemsize * (chunk_replicas - 1) / chunk_replicas
        if lookup and not whole and split > 1:  # the rows' gradient (batch, length, d_model) to the table's columns, and the ids
            fsdp += k * sequences * seq * (m.d_model * act * (split - 1) / split + 4 * (split - 1))
        # split further than the weight over the batch axes (an expert's weights: also over the expert axes, which
        # are batch axes but not gathered): reduce-scatter (ZeRO-2), else all-reduce
        stored_ways = ways(x, x.sharding)
        reductions = 1 if ways(x, grad_sharding) > stored_ways else 2
        optimizer_split = ways(x, moment_sharding) // stored_ways
        # GSPMD's sum in the pass: where only the optimizer state is split further (ZeRO-1) the update needs just the
        # state's slice of the gradient, and the GPU compiler reduce-scatters it too; with one micro-batch it keeps
        # the lookup table's all-reduce (the compiled programs of test_plan_gpu.py). grad_comm's sum once a step stays
        # an all-reduce on dp (over fsdp_tp the GPU compiler made it a reduce-scatter too: not modelled)
        pass_reductions = 1 if optimizer_split > 1 and not (lookup and k == 1) else reductions
        # the lookup's gradient summed over the data axes in the table's dtype, its float32 scatter-add's; the chunked
        # loss's output table's sum was in its reduce-scatter (a tied table's lookup part still summed)
        summed = x.dtype.itemsize if lookup and not whole else grad
        if not (chunk_replicas > 1 and not tied):
            data += passes * pass_reductions * local * summed * (per_pass - 1) / per_pass
        if reduction is not None:
            after_backward += reductions * local * reduction.dtype.itemsize * (summed_ways - 1) / summed_ways
        data += local * x.dtype.itemsize * (optimizer_split - 1) / optimizer_split  # ZeRO-1/2: the updated weights gathered
        used = spec_axes(x.sharding.spec)
        fsdp_axes.update(a for a in batch_axes if a in used and a not in own)
        data_axes.update(a for a in batch_axes if a not in used)
    frozen_axes = split_frozen(layout.spec.logical_axes)[1]
    if frozen_axes:
        # a LoRA run's frozen base: gathered as a trained weight is, never reduced; float weights in the compute dtype
        # (cast first), a quantized one's codes and scales as stored (jaxtrain/models/quant.py)
        frozen = jax.tree_util.tree_leaves_with_path(layout.abstract_state().frozen)
        quantized = {path[:-1] for path, _ in frozen if getattr(path[-1], "key", None) == "codes"}
        for (path, x), axes in zip(frozen, jax.tree.leaves(frozen_axes, is_leaf=lambda s: isinstance(s, PartitionSpec))):
            gathered = gathered_elements(x, gather_axes(layout.rules, axes))
            split = gathered // elements_per_device(x)
            itemsize = x.dtype.itemsize if path[:-1] in quantized else act
            fsdp += passes_of(axes) * gathers_per_pass(axes) * gathered * itemsize * (split - 1) / split
            fsdp_axes.update(a for a in batch_axes if a in spec_axes(x.sharding.spec))
    tensor_ways = logical_ways(layout.rules, layout.mesh, "activation_mlp")
    all_reduces = k * m.num_layers * (4 + RECOMPUTED_ALL_REDUCES[acting_remat(m.remat, pipe.stages)] * rematted_share(m))
    tensor = all_reduces * sequences * seq * m.d_model * act * 2 * (tensor_ways - 1) / tensor_ways
    tensor += k * sequences * seq * adapter_all_reduces(layout)
    # a vocabulary split over tensor: per micro-batch the looked-up rows summed over the table's shards, and the output
    # layer's input gradient
    vocab_ways = logical_ways(layout.rules, layout.mesh, "vocab")
    tensor += k * 2 * sequences * seq * m.d_model * act * 2 * (vocab_ways - 1) / vocab_ways
    shifts = 0 if pipe.stages == 1 else 2 * k * pipe.iterations  # forward and backward, every iteration of each pass
    pipeline = shifts * sequences / pipe.microbatches * seq * m.d_model * act
    # once a pass the output, held by stage 0, all-reduced to every stage, and the input's gradient summed over them
    pipeline += (pipe.stages > 1) * k * 2 * 2 * (pipe.stages - 1) / pipe.stages * sequences * seq * m.d_model * act
    if pipe.repeats > 1:  # the circular schedule's view of the layers (stored split contiguously over the stages)
        state = layout.abstract_state()  # moves (stages - 1) / stages of a device's layers in, and their gradients back
        moved = 2 * bytes_per_device(state.params.get("layers", {})) + bytes_per_device((state.frozen or {}).get("layers", {}))
        pipeline += k * moved * (pipe.stages - 1) / pipe.stages

    def seconds(traffic: float, axes) -> float:
        nvlink, network = LINK_BYTES_PER_S[name]
        across_nodes = any(getattr(cfg.mesh.dcn, a) != 1 for a in axes)
        return traffic / (network if across_nodes else nvlink)

    offloaded = (layout.abstract_state().opt_state, params if offloads_master_weights(m) else {})  # optim.offload: each way per step
    host = 2 * bytes_per_device(offloaded) if cfg.optim.offload else 0.0
    # an offload_* remat policy: each layer's offloaded activations to the host in the forward and back for the backward,
    # every micro-batch (a stage runs its share of the layers); counted as not overlapped with compute, as the above
    host += 2 * k * sequences * seq * m.num_layers / pipe.stages * offloaded_bytes_per_token(layout, pipe.stages)
    host /= PCIE_BYTES_PER_S[name]
    data += after_backward
    communication = {"fsdp": seconds(fsdp, fsdp_axes), "data": seconds(data, data_axes),
                     "tensor": seconds(tensor, layout.rules.get("activation_mlp") or ())}
    traffic = {"fsdp": fsdp, "data": data, "tensor": tensor}
    if pipe.stages > 1:
        traffic["pipeline"] = pipeline
        communication["pipeline"] = seconds(pipeline, layout.rules.get(STAGES) or ())
    if m.moe.num_experts:
        traffic["expert"] = k * m.num_layers * sequences * seq * expert_bytes_per_token(m, expert_ways)
        communication["expert"] = seconds(traffic["expert"], expert_axes)
    if batch_ways == 1:  # one batch shard: no device's gradient to sum with another's (the trainer's summary says so too)
        gradients = ""
    elif reduction is None:
        gradients = m.dtype + (" (norm scales float32)" if m.dtype != "float32" else "") + (" in every micro-batch" if k > 1 else "")
    else:
        gradients = f"{reduction.dtype} once per step over {', '.join(a for a in reduction.axes if layout.mesh.shape[a] > 1)}"
    return StepTime(name, compute, communication, traffic, host, gradients,
                    seconds(after_backward, reduction.axes) if reduction is not None else 0.0, pipe.bubble)
