"""Memory planner: will this config fit on the target devices, where does the memory go, and what to change.

Two views of the same train step, side by side:
- an analytic estimate per device, itemised (parameters, gradients, optimizer state, activations saved
  under the remat policy, logits, the largest transient), computed from the shardings of the real
  layout (``train.make_layout``) and the model shape;
- the compiled truth: the real train step (``train.lower_steps``) compiled for the target mesh on
  simulated CPU devices, read back with XLA's ``memory_analysis`` and ``cost_analysis``.
Suggestions (rule set, remat, micro-batches) are searched with the analytic estimate, which costs
milliseconds per candidate; only the plan itself is compiled.
"""

from __future__ import annotations

import dataclasses
import math
import time

import jax
import numpy as np

from jaxtrain.config import Config
from jaxtrain.errors import UserError
from jaxtrain.flops import flops_per_token, peak_flops
from jaxtrain.mesh import describe_axes
from jaxtrain.partitioning import batch_shards
from jaxtrain.state import bytes_per_device
from jaxtrain.train import Layout, lower_steps, make_layout
from models.config import REMAT_POLICIES

GIB = 2**30
# Total memory per device as nvidia-smi reports it (MiB); the CUDA context and NCCL take some of it.
GPU_MEMORY_MIB = {"h100": 81559, "h200": 143771, "a100": 81920, "a100-40gb": 40960, "l4": 23034}
DEFAULT_HEADROOM = 0.10  # share of device memory kept free for the CUDA context, NCCL buffers, fragmentation
RULE_SETS = ("dp", "fsdp", "tp", "fsdp_tp")
MICROBATCH_OVERHEAD = 0.02  # step-time cost of each extra micro-batch (weights re-gathered, smaller matmuls)


def gpu_memory_bytes(name: str) -> int:
    key = name.lower()
    if key not in GPU_MEMORY_MIB:
        raise UserError(f"unknown GPU '{name}'; known: {', '.join(GPU_MEMORY_MIB)} (or give --device-memory GiB)")
    return GPU_MEMORY_MIB[key] * 2**20


# ---------------------------------------------------------------------------------------------
# analytic estimate


def _ways(layout: Layout, logical: str) -> int:
    return math.prod(layout.mesh.shape[a] for a in layout.rules.get(logical) or ())


def estimate(layout: Layout) -> dict[str, int]:
    """Per-device bytes of the train step, itemised. Activation terms count the tensors each remat policy
    keeps for the backward pass, per layer, for one micro-batch on one device."""
    cfg, m = layout.cfg, layout.cfg.model
    state = layout.abstract_state()
    params = bytes_per_device(state.params)
    optimizer = bytes_per_device(state.opt_state)
    k = cfg.train.microbatches
    b = cfg.train.global_batch // k / batch_shards(layout.rules, layout.mesh)  # sequences per device per pass
    tokens = b * cfg.data.seq_len
    act = np.dtype(m.dtype).itemsize
    hd = m.resolved_head_dim
    embed = tokens * m.d_model * act  # one residual-stream tensor (the embed axis is never sharded)
    qkv = tokens * hd * (m.num_heads / _ways(layout, "activation_heads") + 2 * m.num_kv_heads / _ways(layout, "activation_kv_heads")) * act
    attn_out = tokens * hd * m.num_heads / _ways(layout, "activation_heads") * act
    mlp = tokens * m.mlp_dim / _ways(layout, "activation_mlp") * act
    # XLA attention materialises float32 scores and probabilities for every (query, key) pair
    scores = b * m.num_heads / _ways(layout, "activation_heads") * cfg.data.seq_len**2 * 4
    everything = 6 * embed + 2 * qkv + 2 * attn_out + 4 * mlp + 2 * scores  # all of one layer's intermediates
    # The layer inputs are stacked across the layer scan for the backward pass. XLA's CPU backend builds
    # that stack in float32 whatever the compute dtype (it has no bfloat16 dynamic-update-slice); GPUs keep it
    # in the compute dtype.
    layer_input = tokens * m.d_model * (4 if jax.default_backend() == "cpu" else act)
    saved_per_layer = {
        "none": everything,
        "full": layer_input,
        "save_dots": layer_input + 2 * embed + qkv + attn_out + 2 * mlp,
        "save_qkv_out": layer_input + embed + qkv,
    }[m.remat]
    # the backward of one layer under remat: its recomputed intermediates, with the float32 scores and
    # probabilities overlapping for half their size (fitted on CPU compiles; see docs/PLANNER.md)
    layer_working_set = everything - scores / 2
    vocab_rows = m.vocab_size / _ways(layout, "activation_vocab")
    logit_tokens = b * (cfg.train.loss_chunk or cfg.data.seq_len)  # train.loss_chunk: one chunk's logits live at a time
    # the embedding / output tables are gathered over fsdp for the loss: float32 value, gradient, compute copy
    vocab_tables = (1 if m.tie_embeddings else 2) * 3 * m.d_model * m.vocab_size / _ways(layout, "vocab") * 4
    return {
        "parameters": params,
        "optimizer state": optimizer,
        # float32 gradients and the optimizer's update, each the size of the parameters; micro-batching adds
        # the accumulator
        "gradients": params * (3 if k > 1 else 2),
        "activations": int(m.num_layers * saved_per_layer),
        "logits and loss": int(2 * logit_tokens * vocab_rows * 4 + vocab_tables),  # float32 logits and their gradient
        "largest transient": int(layer_working_set if m.remat != "none" else 2 * scores + 2 * mlp),
    }


def recompute_factor(cfg: Config) -> float:
    """Step FLOPs relative to no remat: the forward work each policy repeats in the backward pass."""
    m, seq = cfg.model, cfg.data.seq_len
    total = flops_per_token(m, seq)
    attention_core = 2 * m.num_layers * seq * m.num_heads * m.resolved_head_dim  # causal fwd (the 6x formula / 3)
    layer_matmuls = 2 * m.num_layers * (m.d_model * m.resolved_head_dim * (2 * m.num_heads + 2 * m.num_kv_heads) + 3 * m.d_model * m.mlp_dim)
    mlp_matmuls = 2 * m.num_layers * 3 * m.d_model * m.mlp_dim
    extra = {"none": 0, "save_dots": attention_core, "save_qkv_out": attention_core + mlp_matmuls,
             "full": attention_core + layer_matmuls}[m.remat]
    return 1 + extra / total


# ---------------------------------------------------------------------------------------------
# compiled truth


@dataclasses.dataclass(frozen=True)
class Compiled:
    argument: int
    output: int
    alias: int
    temp: int
    flops_per_device: float | None
    compile_s: float

    @property
    def total(self) -> int:
        """Peak bytes per device: inputs, outputs not written in place of a donated input, temporaries."""
        return self.argument + self.output - self.alias + self.temp


def compile_truth(layout: Layout) -> Compiled:
    start = time.perf_counter()
    train_lowered, _ = lower_steps(layout)
    compiled = train_lowered.compile()
    seconds = time.perf_counter() - start
    mem = compiled.memory_analysis()
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    return Compiled(mem.argument_size_in_bytes, mem.output_size_in_bytes, mem.alias_size_in_bytes, mem.temp_size_in_bytes,
                    (cost or {}).get("flops"), seconds)


# ---------------------------------------------------------------------------------------------
# search


def _replace(cfg: Config, **changes) -> Config:
    train = {k: v for k, v in changes.items() if k == "microbatches"}
    cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, **train))
    if "remat" in changes:
        cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, remat=changes["remat"]))
    if "rules" in changes:
        cfg = dataclasses.replace(cfg, rules=changes["rules"])
    return cfg


def _valid_microbatches(cfg: Config, shards: int) -> list[int]:
    """Micro-batch counts that divide the global batch into passes the batch shards split evenly."""
    n = cfg.train.global_batch
    return [k for k in range(1, n + 1) if n % k == 0 and (n // k) % shards == 0]


def _layouts_by_rules(cfg: Config, devices, rule_sets) -> dict[str, Layout]:
    """The layout under each rule set that the mesh and model allow (make_layout does every check)."""
    out = {}
    for rules in rule_sets:
        try:
            out[rules] = make_layout(_replace(cfg, rules=rules, microbatches=1), devices)
        except UserError:
            pass
    return out


def _with_cfg(layout: Layout, cfg: Config) -> Layout:
    return dataclasses.replace(layout, cfg=cfg)


def fewest_microbatches(cfg: Config, limit_bytes: float, devices=None) -> int:
    """The fewest micro-batches whose estimated per-device total fits in ``limit_bytes``; the most the
    batch allows when none does (the plan then reports it does not fit)."""
    layout = make_layout(_replace(cfg, microbatches=1), devices)
    options = _valid_microbatches(cfg, batch_shards(layout.rules, layout.mesh))
    for k in options:
        if sum(estimate(_with_cfg(layout, _replace(cfg, microbatches=k))).values()) <= limit_bytes:
            return k
    return options[-1]


def with_auto_microbatches(cfg: Config, devices=None) -> Config:
    """``train.microbatches=auto`` for training: the fewest micro-batches that fit in the memory limit the
    first device reports (less the default headroom); 1 where devices report none (CPU)."""
    devices = devices or jax.devices()
    limit = (devices[0].memory_stats() or {}).get("bytes_limit")
    k = 1 if limit is None else fewest_microbatches(cfg, limit * (1 - DEFAULT_HEADROOM), devices)
    return _replace(cfg, microbatches=k)


@dataclasses.dataclass(frozen=True)
class Suggestion:
    changes: dict  # config key -> value
    total: int  # estimated bytes per device
    breakdown: dict
    relative_step_time: float  # vs. the planned config, from recompute FLOPs and micro-batch overhead

    def describe(self, limit: int) -> str:
        change = " and ".join(f"{k}={v}" for k, v in self.changes.items())
        return f"{change}: {self.total / GIB:.1f} GiB of {limit / GIB:.1f} GiB usable, step time x{self.relative_step_time:.2f}"


def _step_cost(cfg: Config) -> float:
    return recompute_factor(cfg) * (1 + MICROBATCH_OVERHEAD * (cfg.train.microbatches - 1))


def suggest(cfg: Config, limit_bytes: float, devices=None, count: int = 5) -> list[Suggestion]:
    """Configurations that fit, over rule set x remat x micro-batches (the fewest that fit for each pair),
    ranked by estimated step time. Micro-batches are how the per-device batch shrinks: the global batch,
    a training hyper-parameter, is left alone."""
    base_cost = _step_cost(cfg)
    found = []
    for rules, layout in _layouts_by_rules(cfg, devices, dict.fromkeys((cfg.rules, *RULE_SETS))).items():
        for remat in REMAT_POLICIES:
            for k in _valid_microbatches(cfg, batch_shards(layout.rules, layout.mesh)):
                candidate = _replace(cfg, rules=rules, remat=remat, microbatches=k)
                breakdown = estimate(_with_cfg(layout, candidate))
                if candidate != cfg and sum(breakdown.values()) <= limit_bytes:
                    changes = {key: new for key, old, new in (
                        ("rules", cfg.rules, rules), ("model.remat", cfg.model.remat, remat),
                        ("train.microbatches", cfg.train.microbatches, k)) if old != new}
                    found.append(Suggestion(changes, sum(breakdown.values()), breakdown, _step_cost(candidate) / base_cost))
                    break  # more micro-batches only cost time
    return sorted(found, key=lambda s: (s.relative_step_time, len(s.changes), s.total))[:count]


# ---------------------------------------------------------------------------------------------
# the plan


@dataclasses.dataclass(frozen=True)
class Plan:
    cfg: Config
    devices: int
    mesh: dict
    device_memory: int | None
    headroom: float
    estimate: dict
    compiled: Compiled
    flops_per_token: float
    tokens_per_step: int
    gpu: str | None
    tokens_per_s: float | None
    suggestions: list

    @property
    def usable(self) -> int | None:
        return None if self.device_memory is None else int(self.device_memory * (1 - self.headroom))

    @property
    def estimate_total(self) -> int:
        return sum(self.estimate.values())

    @property
    def fits(self) -> bool | None:
        return None if self.usable is None else self.compiled.total <= self.usable

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
            "experiment": {"rules": self.cfg.rules, "remat": self.cfg.model.remat, "microbatches": self.cfg.train.microbatches,
                           "global_batch": self.cfg.train.global_batch, "seq_len": self.cfg.data.seq_len},
            "mesh": self.mesh, "devices": self.devices, "gpu": self.gpu,
            "device_memory_bytes": self.device_memory, "headroom": self.headroom, "usable_bytes": self.usable,
            "estimate_bytes": self.estimate | {"total": self.estimate_total},
            "compiled_bytes": {"argument": c.argument, "output": c.output, "alias": c.alias, "temp": c.temp, "total": c.total},
            "estimate_vs_compiled": self.estimate_total / c.total - 1,
            "fits": self.fits,
            "compile_s": c.compile_s,
            "flops_per_token": self.flops_per_token,
            "xla_flops_per_token": self.xla_flops_per_token,
            "tokens_per_s": self.tokens_per_s, "mfu_needed": self.mfu_needed,
            "suggestions": [{"changes": s.changes, "total_bytes": s.total, "relative_step_time": s.relative_step_time}
                            for s in self.suggestions],
        }


def make_plan(cfg: Config, *, device_memory: int | None = None, gpu: str | None = None, headroom: float = DEFAULT_HEADROOM,
              tokens_per_s: float | None = None, devices=None) -> Plan:
    """Plan ``cfg`` on ``devices`` (default: all, i.e. the simulated target mesh). ``train.microbatches=auto``
    is resolved against the usable memory first (1 when no memory size is given)."""
    if device_memory is None and gpu is not None:
        device_memory = gpu_memory_bytes(gpu)
    if device_memory is not None and device_memory <= 0:
        raise UserError(f"device memory must be positive, got {device_memory / GIB:g} GiB; give --device-memory GiB or --gpu NAME")
    if not 0 <= headroom < 1:
        raise UserError(f"headroom={headroom} must be in [0, 1), e.g. 0.1 to keep 10% of device memory free")
    usable = None if device_memory is None else device_memory * (1 - headroom)
    if cfg.train.microbatches == "auto":
        cfg = _replace(cfg, microbatches=1 if usable is None else fewest_microbatches(cfg, usable, devices))
    layout = make_layout(cfg, devices)
    compiled = compile_truth(layout)
    suggestions = [] if usable is None or compiled.total <= usable else suggest(cfg, usable, devices)
    return Plan(cfg, layout.mesh.size, dict(layout.mesh.shape), device_memory, headroom, estimate(layout), compiled,
                flops_per_token(cfg.model, cfg.data.seq_len), cfg.train.global_batch * cfg.data.seq_len, gpu, tokens_per_s,
                suggestions)


def render(plan: Plan) -> str:
    gib = lambda n: f"{n / GIB:8.2f} GiB"  # noqa: E731
    c, cfg = plan.compiled, plan.cfg
    mesh = describe_axes(plan.mesh)
    lines = [f"plan: {plan.devices} devices ({mesh}), rules {cfg.rules}, remat {cfg.model.remat}, "
             f"batch {cfg.train.global_batch} x {cfg.data.seq_len} tokens in {cfg.train.microbatches} micro-batch(es)",
             "", f"{'per device':<22}{'estimate':>12}   {'compiled (XLA, CPU)':>20}"]
    compiled_rows = [("arguments (state, batch)", c.argument), ("outputs not aliased", c.output - c.alias), ("temporaries", c.temp)]
    rows = list(plan.estimate.items())
    for i in range(max(len(rows), len(compiled_rows))):
        left = f"{rows[i][0]:<22}{gib(rows[i][1]):>12}" if i < len(rows) else " " * 34
        right = f"   {compiled_rows[i][0]:<25}{gib(compiled_rows[i][1])}" if i < len(compiled_rows) else ""
        lines.append(left + right)
    lines.append(f"{'total':<22}{gib(plan.estimate_total):>12}   {'total':<25}{gib(c.total)}   "
                 f"(estimate {100 * (plan.estimate_total / c.total - 1):+.1f}%)")
    lines.append("")
    if plan.usable is None:
        lines.append("verdict: no device memory given (--gpu NAME or --device-memory GiB)")
    else:
        verdict = "fits" if plan.fits else "DOES NOT FIT"
        lines.append(f"verdict: {verdict}: {c.total / GIB:.1f} GiB compiled of {plan.usable / GIB:.1f} GiB usable "
                     f"({plan.device_memory / GIB:.1f} GiB, {100 * plan.headroom:.0f}% headroom)")
    for i, s in enumerate(plan.suggestions, 1):
        lines.append(f"  {i}. {s.describe(plan.usable)}")
    if plan.usable is not None and not plan.fits and not plan.suggestions:
        lines.append("  no rule set, remat policy or micro-batch count fits by the estimate: use more devices or a mesh with more fsdp/tensor ways")
    xla = plan.xla_flops_per_token
    lines.append(f"FLOPs per token: {plan.flops_per_token:.4g} (PaLM formula, causal attention halved)"
                 + ("" if xla is None else f"; XLA cost analysis {xla:.4g} (counts each loop body - layer scan, micro-batch scan - once)"))
    if plan.mfu_needed is not None:
        lines.append(f"{plan.tokens_per_s:,.0f} tokens/s on {plan.devices} x {plan.gpu} needs MFU {100 * plan.mfu_needed:.1f}%")
    lines.append(f"compiled in {c.compile_s:.1f}s")
    return "\n".join(lines)


def plot(plan: Plan, path: str) -> None:
    """Stacked per-device memory of the plan (estimate and compiled) and the suggestions, with the limit."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    bars = [("plan (estimate)", plan.estimate)] + [(" & ".join(f"{k.split('.')[-1]}={v}" for k, v in s.changes.items()), s.breakdown)
                                                  for s in plan.suggestions]
    fig, ax = plt.subplots(figsize=(max(6, 1.6 * (len(bars) + 1)), 5))
    items = list(plan.estimate)
    for i, (_, breakdown) in enumerate(bars):
        bottom = 0.0
        for j, item in enumerate(items):
            ax.bar(i, breakdown[item] / GIB, bottom=bottom, color=f"C{j}", label=item if i == 0 else None)
            bottom += breakdown[item] / GIB
    c = plan.compiled
    ax.bar(len(bars), c.total / GIB, color="0.6", label="compiled total (XLA)")
    ax.set_xticks(range(len(bars) + 1), [name for name, _ in bars] + ["plan (compiled)"], rotation=20, ha="right", fontsize=8)
    if plan.device_memory is not None:
        ax.axhline(plan.device_memory / GIB, color="k", label="device memory")
        ax.axhline(plan.usable / GIB, color="k", linestyle="--", label=f"usable ({100 * plan.headroom:.0f}% headroom)")
    ax.set_ylabel("GiB per device")
    ax.set_title(f"{plan.devices} devices, rules {plan.cfg.rules}, remat {plan.cfg.model.remat}, {plan.cfg.train.microbatches} micro-batch(es)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
