"""Sparse mixture-of-experts feed-forward block (Mixtral, Qwen2-MoE), chosen by ``model.moe.num_experts``.

A float32 router picks ``top_k`` SwiGLU experts per token; their outputs are mixed by the router's softmax
weights (renormalised over the chosen k). Two ways to bring tokens to their experts:

- ``dropless``: assignments sorted by expert and multiplied as one grouped matmul (``model.moe.grouped_matmul``:
  ``jax.lax.ragged_dot``, or tokamax's kernel where XLA's GPU compiler would expand the former over every expert);
  no token is ever dropped. On a mesh the sort is each device's own (``jax.shard_map``): a global sort of a batch
  split over devices made GSPMD gather every token to every device. With the experts split over an axis, a device
  first gathers the tokens of its expert group (all-gather over that axis), multiplies those assigned to its own
  experts, and the partial outputs are summed back to the tokens' devices (reduce-scatter): Megatron's all-gather
  dispatcher, fixed shapes (XLA:CPU has no ragged all-to-all).
- ``capacity``: each sequence fills a fixed (experts, capacity, d_model) buffer per expert (first choices
  before second choices, GShard); assignments past an expert's capacity are dropped and counted. The buffer
  is laid out by sequence and then by expert: with an ``expert`` mesh axis the change of layout between the
  two constraints is an all-to-all, which XLA emits on every backend (fixed shapes, unlike ragged all-to-all).

Router statistics (load-balancing loss, z-loss, expert load, dropped share) are kept as an
``nnx.Intermediate`` for the trainer to add to the loss and log (``pop_router_stats``).
"""

from __future__ import annotations

import dataclasses
import fractions
import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import PartitionSpec

from jaxtrain.models.config import EXPERT_LORA, LlamaConfig, adapter_name
from jaxtrain.models.layers import BATCH, EMBED_ACT, MLP, param
from jaxtrain.models.lora import expert_deltas
from jaxtrain.models.sharding import constrain, mesh_axes_of, split_axes

# a dispatched buffer (batch, experts, capacity, d_model) before and after the all-to-all: first split by
# sequence like every activation, then by expert on the expert axis (the batch keeps the other batch axes)
BY_SEQUENCE = (BATCH, None, None, "activation_embed")
BY_EXPERT = ("activation_batch_no_expert", "activation_expert", None, "activation_embed")
HIDDEN_BY_EXPERT = ("activation_batch_no_expert", "activation_expert", None, "activation_mlp")
STATS_NAME = "router_stats"
# the routed rows, their gate and up projections and their output: the experts' products are grouped matmuls (dropless)
# or dots batched over the experts (capacity), which a remat policy of dots without batch dimensions does not keep, so
# jaxtrain/models/llama.py's policies keep these by name
EXPERT_SAVED = ("expert_rows", "expert_gate", "expert_up", "expert_out")


def capacity(seq_len: int, num_experts: int, top_k: int, capacity_factor: float) -> int:
    """Slots per expert and sequence: capacity_factor x the fair share, rounded up, at most seq_len (an expert takes
    a token at most once). The factor as written (its shortest decimal): in floats 1.1 x 100 x 2 / 4 is
    55.00000000000001, one slot more than the documented ceiling."""
    return min(seq_len, math.ceil(fractions.Fraction(repr(float(capacity_factor))) * seq_len * top_k / num_experts))


class MoE(nnx.Module):
    def __init__(self, cfg: LlamaConfig, rngs: nnx.Rngs):
        moe = cfg.moe
        d, m, e, pd = cfg.d_model, cfg.mlp_dim, moe.num_experts, jnp.dtype(cfg.param_dtype)
        self.moe = moe
        self.dtype = jnp.dtype(cfg.dtype)
        self.router = param(rngs, (d, e), ("embed", None), cfg.init_std, pd)
        self.w_gate = param(rngs, (e, d, m), ("experts", "embed", "mlp"), cfg.init_std, pd)
        self.w_up = param(rngs, (e, d, m), ("experts", "embed", "mlp"), cfg.init_std, pd)
        self.w_down = param(rngs, (e, m, d), ("experts", "mlp", "embed"), cfg.init_std / (2 * cfg.num_layers) ** 0.5, pd)
        if moe.num_shared_experts:
            self.shared = MLP(dataclasses.replace(cfg, mlp_dim=moe.num_shared_experts * m), rngs)
            if moe.shared_expert_gate:
                self.shared_gate = param(rngs, (d, 1), ("embed", None), cfg.init_std, pd)

    def __call__(self, x):
        """x (batch, length, d_model) -> (batch, length, d_model)."""
        logits = jnp.einsum("btd,de->bte", x.astype(jnp.float32), self.router[...].astype(jnp.float32))
        probs = jax.nn.softmax(logits, axis=-1)
        weights, experts = _top_k(probs, self.moe.top_k)
        if self.moe.normalize_top_k:
            weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
        if self.moe.dispatch == "dropless":
            y, kept = self._dropless(x, weights, experts), jnp.ones(experts.shape, bool)
        else:
            y, kept = self._capacity(x, weights, experts)
        if self.moe.num_shared_experts:
            shared = self.shared(x)
            if self.moe.shared_expert_gate:
                shared = shared * jax.nn.sigmoid(x @ self.shared_gate[...].astype(self.dtype))
            y = y + shared
        stats = router_stats(logits, probs, experts, kept)
        # what this layer adds to the training loss (the trainer takes the mean over layers)
        stats["router_loss"] = self.moe.aux_loss_weight * stats["aux_loss"] + self.moe.router_z_loss_weight * stats["z_loss"]
        self.router_stats = nnx.Intermediate(stats)
        return constrain(y, EMBED_ACT)

    def _expert_params(self) -> tuple[tuple[jax.Array, jax.Array, jax.Array], dict]:
        """The expert weights (gate, up, down) and the adapters' factors by name (jaxtrain/models/lora.py ExpertLoRA), in the
        compute dtype."""
        adapters = {name: getattr(self, adapter_name(name)) for name in EXPERT_LORA if hasattr(self, adapter_name(name))}
        return (tuple(w[...].astype(self.dtype) for w in (self.w_gate, self.w_up, self.w_down)),
                {name: adapter.factors(self.dtype) for name, adapter in adapters.items()})

    def _dropless(self, x, weights, experts):
        axes = dropless_axes(x.shape[0])
        if axes is None:  # one device, or a layout the per-device sort does not cover: GSPMD partitions the global one
            # jax's grouped matmul there on a mesh: GSPMD cannot split a kernel's custom call, and replicated the
            # experts' weights for tokamax's (pure tensor parallelism, tp: the batch split over no axis)
            mesh = jax.sharding.get_abstract_mesh()
            grouped_matmul = self.moe.grouped_matmul if mesh.empty or mesh.size == 1 else "xla"
            return _own_experts_output(x, weights, experts, self._expert_params(), grouped_matmul)
        batch, by_expert, embed, mlp = axes
        own = self.moe.num_experts // math.prod(jax.sharding.get_abstract_mesh().shape[a] for a in by_expert)
        # how each array is split: the weights (gate, up, down), then the adapters' (a, b) by their logical axes
        # (jaxtrain/models/lora.py ExpertLoRA)
        expert_weights, adapters = self._expert_params()
        up, down = _Split((by_expert, embed, mlp), 1), _Split((by_expert, mlp, embed), 2)
        adapter_splits = {"gate_up": (_Split((by_expert, embed, ()), 1), _Split((by_expert, (), (), mlp))),
                          "down": (_Split((by_expert, mlp, ())), _Split((by_expert, (), (), embed), 3))}
        splits = ((up, up, down), {name: adapter_splits[name] for name in adapters})
        is_split = lambda node: isinstance(node, _Split)  # noqa: E731

        def per_device(x, weights, experts, params):
            if by_expert:  # the tokens of this device's expert group (its batch shard and theirs)
                x, weights, experts = (jax.lax.all_gather(a, by_expert, axis=0, tiled=True) for a in (x, weights, experts))
            if embed:  # FSDP: the embed dimension gathered (its transpose reduce-scatters the gradients)
                params = jax.tree.map(lambda split, w: w if split.embed_dim is None else
                                      _gather_dimension(w, embed, split.embed_dim), splits, params, is_leaf=is_split)
            first = jax.lax.axis_index(by_expert) * own if by_expert else None
            y = _own_experts_output(x, weights, experts, params, self.moe.grouped_matmul, first)
            if by_expert:  # every expert's part of a token's output summed on the token's own device
                y = jax.lax.psum_scatter(y, by_expert, scatter_dimension=0, tiled=True)
            # the experts' hidden dimension split (tensor parallel): partial sums, the down adapter's too (its A
            # contracts the hidden dimension)
            return _sum_over(y, mlp) if mlp else y

        tokens = PartitionSpec(batch)
        specs = jax.tree.map(lambda split: PartitionSpec(*(axes or None for axes in split.axes)), splits, is_leaf=is_split)
        # check_vma=False: tokamax's kernels (model.moe.grouped_matmul) declare no varying mesh axes for their outputs.
        # Autodiff sums the tokens' gradient over tensor at the boundary, after reducing it to the device's own tokens
        # (with the check, tokens not cast to vary over tensor had it summed for the whole expert group, before)
        return jax.shard_map(per_device, mesh=jax.sharding.get_abstract_mesh(), in_specs=(tokens, tokens, tokens, specs),
                             out_specs=tokens, check_vma=False)(x, weights, experts, (expert_weights, adapters))

    def _capacity(self, x, weights, experts):
        b, t, d = x.shape
        e, k = self.moe.num_experts, self.moe.top_k
        slots = capacity(t, e, k, self.moe.capacity_factor)
        # each assignment's slot in its expert's buffer, counted in the order (choice, position)
        chosen = jax.nn.one_hot(experts, e, dtype=jnp.int32).transpose(0, 2, 1, 3).reshape(b, k * t, e)
        slot = jnp.sum((jnp.cumsum(chosen, axis=1) - 1) * chosen, axis=-1).reshape(b, k, t).transpose(0, 2, 1)
        kept = slot < slots

        def dispatch(tokens, expert, slot):  # one sequence: slots past the capacity are dropped
            buffer = jnp.zeros((e, slots, d), tokens.dtype)
            return buffer.at[expert, slot].set(jnp.broadcast_to(tokens[:, None], (t, k, d)), mode="drop")

        buffer = constrain(constrain(jax.vmap(dispatch)(x, experts, slot), BY_SEQUENCE), BY_EXPERT)
        # each expert's slots by its own weights: (batch, experts, capacity, in) x (experts, in, out)
        out = _experts_swiglu(buffer, lambda slots, w: jnp.einsum("beci,eio->beco", slots, w), self._expert_params(),
                              lambda h: constrain(h, HIDDEN_BY_EXPERT))
        out = checkpoint_name(constrain(constrain(out, BY_EXPERT), BY_SEQUENCE), EXPERT_SAVED[-1])
        gathered = jax.vmap(lambda o, expert, slot: o.at[expert, slot].get(mode="fill", fill_value=0))(out, experts, slot)
        return jnp.einsum("btkd,btk->btd", gathered, (weights * kept).astype(gathered.dtype)), kept


def _gather_dimension(w, axes, dim: int):
    """``all_gather(w, axes, axis=dim, tiled=True)``, gathered as a new leading dimension and then moved into place.
    XLA's GPU compiler lays an all-gather's operand out with the gathered dimension outermost: gathering a middle
    dimension of a layer's slice made it copy the whole stack of every layer's weights into that layout before the
    layer loop (mixtral_8x7b_lora on 8 H100s: the frozen experts' gate, up and down, 10.5 GiB a device)."""
    gathered = jax.lax.all_gather(w, axes, axis=0)
    return jnp.moveaxis(gathered, 0, dim).reshape(*w.shape[:dim], -1, *w.shape[dim + 1:])


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def _sum_over(x, axes):
    """``psum`` over ``axes`` for a shard_map without vma checks, whose output is replicated over ``axes``: there
    autodiff hands each device 1 / (devices over ``axes``) of the output's gradient and transposes psum to another
    psum (an all-reduce of the gradient over tensor in every layer's backward); the gradient of each partial sum is
    the output's whole gradient, so this scales it back instead (numerically equal: tests/test_moe.py)."""
    return jax.lax.psum(x, axes)


_sum_over.defvjp(lambda x, axes: (jax.lax.psum(x, axes), None), lambda axes, _, g: (g * jax.lax.psum(1, axes),))


class _Split(NamedTuple):
    """How the dropless dispatch's shard_map takes an expert array: its dimensions' mesh axes, and which dimension
    is the embed one (FSDP, gathered inside), if any."""

    axes: tuple[tuple[str, ...], ...]
    embed_dim: int | None = None


def _experts_swiglu(x, matmul, expert_params, hidden_layout=lambda h: h, adapter_matmul=None):
    """The experts' SwiGLU with ``matmul(x, w)`` multiplying by each expert's weights (gate, up, down), plus the
    updates of their adapters (``MoE._expert_params``) by ``adapter_matmul`` (default: ``matmul``). The rows, the
    gate and up projections and the output are named for the save_dots and offload_dots remat policies
    (EXPERT_SAVED): kept, the backward neither gathers the rows nor multiplies by the experts again."""
    (w_gate, w_up, w_down), adapters = expert_params
    adapter_matmul = adapter_matmul or matmul
    rows_name, gate_name, up_name, _ = EXPERT_SAVED  # the output is named by the caller, in the layout it keeps
    x = checkpoint_name(x, rows_name)
    gate, up = matmul(x, w_gate), matmul(x, w_up)
    if "gate_up" in adapters:
        gate, up = (projection + delta for projection, delta in
                    zip((gate, up), expert_deltas(x, adapter_matmul, *adapters["gate_up"])))
    # named as laid out: a residual saved in another layout is moved back for the backward (capacity: an all-to-all)
    hidden = jax.nn.silu(checkpoint_name(hidden_layout(gate), gate_name)) * checkpoint_name(hidden_layout(up), up_name)
    out = matmul(hidden, w_down)
    return out + expert_deltas(hidden, adapter_matmul, *adapters["down"])[0] if "down" in adapters else out


def _grouped_matmul(kind: str):
    """``ragged_dot(lhs, rhs, group_sizes)`` of model.moe.grouped_matmul; ``auto``, as a model built directly has it
    (not resolved by the trainer), is jax's."""
    if kind == "tokamax":
        import tokamax  # optional (jaxtrain[moe-gpu]); jaxtrain/models/config.py checks that it is installed
        from absl import flags

        if not flags.FLAGS.is_parsed():  # else tokamax parses the command line as its absl flags and stops on ours
            flags.FLAGS.mark_as_parsed()
        # its Triton kernel on GPUs, XLA's elsewhere; not its Hopper (Mosaic GPU) kernel, the first it would pick
        # there: it failed to compile sides under 128 (a 64-wide expert split over tensor 2, "WGMMA rhs swizzle must
        # match lhs swizzle"), which no fallback catches, as the failure comes when XLA compiles
        return functools.partial(tokamax.ragged_dot, implementation=("triton", "xla"))
    return jax.lax.ragged_dot


def _own_experts_output(x, weights, experts, expert_params, grouped_matmul: str, first=None):
    """x (batch, length, d_model) -> the part of the output from the experts whose weights (and adapters)
    ``expert_params`` are, numbered from ``first`` (None: every expert's): their assignments sorted by expert and
    multiplied as one grouped matmul (``_grouped_matmul``)."""
    b, t, d = x.shape
    k, count = experts.shape[-1], expert_params[0][0].shape[0]
    group = experts.reshape(-1)
    if first is not None:  # other experts' assignments sorted last, outside every group
        mine = (group >= first) & (group < first + count)
        group = jnp.where(mine, group - first, count)
    order = jnp.argsort(group, stable=True)
    sizes = jnp.bincount(group, length=count + (first is not None))[:count].astype(jnp.int32)
    # rows past the groups read zeros and are dropped on the way back (ragged_dot leaves them unspecified), by
    # indices out of range rather than masks, which would copy the rows
    source, target = (order // k, order) if first is None else \
        (jnp.where(mine[order], index, b * t * k) for index in (order // k, order))
    rows = x.reshape(b * t, d).at[source].get(mode="fill", fill_value=0)
    ragged_dot = _grouped_matmul(grouped_matmul)
    row_expert = jax.nn.one_hot(group[order], count, dtype=x.dtype)  # other experts' rows: all zeros
    in_groups = None if first is None else mine[order][:, None]  # else every row is in a group
    out = checkpoint_name(_experts_swiglu(rows, lambda lhs, w: ragged_dot(lhs, w, sizes), expert_params,
                                          adapter_matmul=lambda lhs, w: _rank_sized_matmul(lhs, w, row_expert, in_groups)),
                          EXPERT_SAVED[-1])
    out = jnp.zeros_like(out).at[target].set(out, mode="drop").reshape(b, t, k, d)  # back to token order
    return jnp.einsum("btkd,btk->btd", out, weights.astype(out.dtype))


def _rank_sized_matmul(lhs, w, row_expert, in_groups=None):
    """Each row of ``lhs`` (rows, in) by its expert's ``w`` (experts, in, out), one of whose sides is an adapter's rank,
    as dense matmuls over all the experts' ``w`` side by side: where ``out`` is the smaller side, every expert's
    product (rows x experts x out) and then the row's own kept (``row_expert``: one-hot, rows x experts); else the
    row spread to its expert's place (rows x experts x in, zeros elsewhere) and one product. Either costs experts x
    the smaller side per row and element of the other, a few percent of the weights' products for rank 16. A ragged
    dot does not suit them: XLA's GPU compiler expands it over every expert as wide as its output (experts x rows x
    the hidden dimension for B), and a grouped-matmul kernel's tiles are wider than a rank. ``in_groups`` (rows, 1),
    if given, keeps only those rows, of ``lhs`` and of the product's gradient: the others come from or go back to a
    grouped matmul, which leaves rows past its groups unspecified (NaN is possible), and 0 x NaN in these dense
    products reached the adapters' gradients."""
    experts, inputs, outputs = w.shape
    kept = (lambda rows: rows) if in_groups is None else (lambda rows: jnp.where(in_groups, rows, 0))
    lhs = kept(lhs)
    if outputs <= inputs:
        every = jnp.einsum("ri,eio->reo", lhs, w)
        return kept(jnp.einsum("reo,re->ro", every, row_expert))
    spread = (row_expert[:, :, None] * lhs[:, None, :]).reshape(lhs.shape[0], experts * inputs)
    return kept(spread @ w.reshape(experts * inputs, outputs))


def _top_k(probs, k: int):
    """``jax.lax.top_k`` of each device's tokens: with a tensor axis GSPMD gathered the probabilities of every batch
    shard to each device for it (XLA's GPU TopK; fsdp_tp, tp, fsdp_tp_ep)."""
    batch = _split_batch(probs.shape[0])
    if batch is None:
        return jax.lax.top_k(probs, k)
    tokens = PartitionSpec(batch)
    return jax.shard_map(lambda p: tuple(jax.lax.top_k(p, k)), mesh=jax.sharding.get_abstract_mesh(), in_specs=tokens,
                         out_specs=(tokens, tokens))(probs)


def _split_batch(batch_size: int) -> tuple[str, ...] | None:
    """The mesh axes of more than one device the active rule set splits the batch over, in its order (a spec's axes
    order the devices' blocks); None outside a sharding context, or where they are none or do not divide the batch."""
    mesh = jax.sharding.get_abstract_mesh()
    batch = tuple(a for a in mesh_axes_of(BATCH) if a in split_axes(BATCH))
    return batch if batch and batch_size % math.prod(mesh.shape[a] for a in batch) == 0 else None


def dropless_axes(batch_size: int) -> tuple[tuple[str, ...], ...] | None:
    """The mesh axes of the per-device dropless dispatch under the active rule set and mesh: (batch, experts, the
    weights' embed, the experts' hidden), each those of more than one device; None where it does not apply: no
    sharding context, a batch not split or not divisible by its split, experts split over an axis the batch is
    not, or the hidden dimension over a batch axis."""
    batch = _split_batch(batch_size)
    by_expert, embed, mlp = split_axes("experts"), split_axes("embed"), split_axes("mlp")
    if batch is None or not by_expert <= set(batch) or mlp & set(batch) or by_expert & embed:
        return None
    return (batch, *(tuple(a for a in mesh_axes_of(name) if a in split) for name, split in
                     (("experts", by_expert), ("embed", embed), ("mlp", mlp))))


def router_stats(logits, probs, experts, kept) -> dict:
    """Per-layer router statistics, float32: ``aux_loss`` (Switch Transformer: num_experts x the sum over experts
    of the share of assignments times the mean router probability; 1 when balanced), ``z_loss`` (mean squared
    log-sum-exp of the logits), ``expert_load`` (share of assignments per expert, sums to 1) and
    ``dropped_fraction`` (share of assignments past an expert's capacity)."""
    num_experts = logits.shape[-1]
    load = jnp.mean(jax.nn.one_hot(experts, num_experts, dtype=jnp.float32), axis=(0, 1, 2))
    importance = jnp.mean(probs, axis=(0, 1))
    return {
        "aux_loss": num_experts * jnp.sum(load * importance),
        "z_loss": jnp.mean(jnp.square(jax.nn.logsumexp(logits, axis=-1))),
        "expert_load": load,
        "dropped_fraction": 1.0 - jnp.mean(kept.astype(jnp.float32)),
    }


def pop_router_stats(model: nnx.Module) -> dict:
    """The router statistics the last forward pass of a Llama left (``Llama.layer_intermediates``), each
    stacked over layers (a leading layers axis); empty for a dense model. Popped: the model is as before."""
    sown = nnx.to_pure_dict(nnx.pop(model, nnx.Intermediate))
    return sown.get("layer_intermediates", {}).get("mlp", {}).get(STATS_NAME, {})
