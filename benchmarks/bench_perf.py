"""Training-step performance, each comparison measured side by side in one process (medians of
interleaved repetitions, so a noisy shared machine slows both sides alike):

- ``overhead_ratio``: a hand-written plain jax + optax train step of the same model math and shapes
  (below) ÷ jaxtrain's compiled step, by step time; 1.0 = no framework overhead. On one device, and on
  the cpu8 mesh with fsdp_tp (the hand-written step then gets the same parameter and batch shardings).
- ``matmul_peak_flops`` (jaxtrain.observe.flops.measure_matmul_peak over all devices), ``model_flops_per_s``
  of jaxtrain's step on the same devices, and their ratio ``mfu_vs_matmul_peak``.
- ``compile_s_{2,8,32}_layers`` and ``step_s_{...}_layers``: layers scanned (``model.scan_layers=true``, as on
  GPUs; CPUs unroll by default), so compile time should not grow with depth.
- ``host_gap_ms_per_step``: the real loop (``jaxtrain.train.train``: data pipeline, metrics) per-step
  time minus the device-bound step time (same batch, steps queued back to back).
- ``remat_precision``: step time and compiled memory per remat policy x compute dtype.
- ``partial_remat``: the same for remat full on none, half and all of the (scanned) layers (``model.remat_layers``).
- ``step_profile``: what ``log.profile_steps`` costs (one device, the step of ``overhead_ratio``): the traced steps'
  time ÷ untraced steps' (``overhead``, interleaved rounds), seconds to write and summarize the trace
  (``summary_s``), and the summary's span per step ÷ the untraced step time (``span_vs_step``: whether the profile
  shows the step as it runs).
- ``cross_entropy``: the loss and its gradient over float32 logits of a 32K vocabulary (2048 tokens, one device),
  jaxtrain.step.cross_entropy against optax.softmax_cross_entropy_with_integer_labels: ``speedup`` (optax's time
  ÷ ours). What ours saves is on GPUs (one logits-sized float32 buffer, tests/test_plan_gpu.py); XLA:CPU does
  optax's scatter in place, and its elementwise exponential is slow, so here ours can be slower.
"""

from __future__ import annotations

import dataclasses
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxtrain import data as data_lib
from jaxtrain.config import AxisSizes, Config, DataConfig, LogConfig, MeshConfig, OptimConfig, TrainConfig
from jaxtrain.observe import step_profile
from jaxtrain.observe.flops import measure_matmul_peak, model_flops_per_token
from jaxtrain.layout import lower_train_step, make_layout
from jaxtrain.optim import decay_mask
from jaxtrain.state import init_state, model_spec
from jaxtrain.step import cross_entropy
from jaxtrain.train import Trainer, build, train
from jaxtrain.models.config import REMAT_POLICIES, LlamaConfig

REPEATS = 5  # timed repetitions per measurement; the median is reported
STEPS_PER_REPEAT = 4
CPU8 = MeshConfig(ici=AxisSizes(data=2, fsdp=2, tensor=2))
ONE_DEVICE = MeshConfig(ici=AxisSizes(data=1, fsdp=1, tensor=1))
# float32 compute: CPUs emulate bfloat16 matmuls slowly (the remat x precision matrix shows by how much)
STEP_MODEL = LlamaConfig(vocab_size=256, d_model=256, num_layers=2, num_heads=8, num_kv_heads=4, mlp_dim=1024, dtype="float32")


def config(model: LlamaConfig = STEP_MODEL, mesh: MeshConfig = CPU8, rules: str = "fsdp_tp", seq_len: int = 128,
           global_batch: int = 8, steps: int = 1000) -> Config:
    return Config(model=model, data=DataConfig(seq_len=seq_len), train=TrainConfig(steps=steps, global_batch=global_batch),
                  optim=OptimConfig(warmup_steps=10), log=LogConfig(every=10, progress=False), mesh=mesh, rules=rules)


def random_corpus(vocab_size: int, tokens: int = 400_000) -> data_lib.Corpus:
    rng = np.random.default_rng(0)
    return data_lib.Corpus(rng.integers(0, vocab_size, tokens).astype(np.int32),
                           rng.integers(0, vocab_size, tokens // 10).astype(np.int32), vocab_size, "uniform random tokens")


def fixed_batch(trainer: Trainer) -> dict:
    return next(data_lib.train_batches(trainer.corpus, trainer.cfg.data, trainer.cfg.train.global_batch, trainer.batch_sharding))


def seconds_per_step(step, carry, batch, steps: int = STEPS_PER_REPEAT):
    """Device-bound time per step: ``steps`` calls queued back to back, one sync at the end."""
    jax.block_until_ready(carry)
    start = time.perf_counter()
    for _ in range(steps):
        carry = step(carry, batch)
    jax.block_until_ready(carry)
    return (time.perf_counter() - start) / steps, carry


def interleaved_medians(contenders: dict, batch, repeats: int = REPEATS) -> dict[str, float]:
    """contenders: name -> (step(carry, batch) -> carry, carry). One warm-up step each, then repetitions
    taken in turn, so machine noise falls on every contender alike."""
    carries = {name: step(carry, batch) for name, (step, carry) in contenders.items()}
    times = {name: [] for name in contenders}
    for _ in range(repeats):
        for name, (step, _) in contenders.items():
            t, carries[name] = seconds_per_step(step, carries[name], batch)
            times[name].append(t)
    return {name: statistics.median(t) for name, t in times.items()}


# ---------------------------------------------------------------------------------------------------
# The hand-written reference: plain jax + optax, no Flax, no sharding annotations, the same math as
# jaxtrain/models/llama.py + jaxtrain/step.py + jaxtrain/optim.py, on the same parameter tree.

def _rms_norm(x, scale, eps):
    x32 = x.astype(jnp.float32)
    return (x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, -1, keepdims=True) + eps) * scale).astype(x.dtype)


def _rotary(x, sin, cos):
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    sin, cos = sin[None, :, None, :], cos[None, :, None, :]
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1).astype(x.dtype)


def hand_written_loss(cfg: LlamaConfig, params: dict, batch: dict) -> jax.Array:
    dt, tokens = jnp.dtype(cfg.dtype), batch["inputs"]
    hd = cfg.resolved_head_dim
    angles = jnp.arange(tokens.shape[1], dtype=jnp.float32)[:, None] / cfg.rope_theta ** (jnp.arange(0, hd, 2, dtype=jnp.float32) / hd)
    sin, cos = jnp.sin(angles), jnp.cos(angles)

    def layer(x, p):
        h = _rms_norm(x, p["attn_norm"]["scale"], cfg.norm_eps)
        a = p["attn"]
        q = _rotary(jnp.einsum("btd,dhk->bthk", h, a["wq"].astype(dt)), sin, cos)
        k = _rotary(jnp.einsum("btd,dhk->bthk", h, a["wk"].astype(dt)), sin, cos)
        v = jnp.einsum("btd,dhk->bthk", h, a["wv"].astype(dt))
        out = jax.nn.dot_product_attention(q, k, v, is_causal=True)
        x = x + jnp.einsum("bthk,hkd->btd", out, a["wo"].astype(dt))
        h, m = _rms_norm(x, p["mlp_norm"]["scale"], cfg.norm_eps), p["mlp"]
        return x + (jax.nn.silu(h @ m["w_gate"].astype(dt)) * (h @ m["w_up"].astype(dt))) @ m["w_down"].astype(dt), None

    x, _ = jax.lax.scan(layer, params["embed"][tokens].astype(dt), params["layers"], unroll=cfg.scan_layers is False)
    x = _rms_norm(x, params["final_norm"]["scale"], cfg.norm_eps)
    logits = jnp.einsum("btd,dv->btv", x, params["lm_head"].astype(dt), preferred_element_type=jnp.float32)
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"]).mean()


def hand_written_step(cfg: Config, abstract_params=None, batch_sharding=None):
    """-> (jitted step((params, opt_state, loss), batch) -> same, optax transformation). With
    ``abstract_params`` (ShapeDtypeStructs carrying shardings), the step gets jaxtrain's placement."""
    o = cfg.optim
    schedule = optax.warmup_cosine_decay_schedule(0.0, o.lr, o.warmup_steps, cfg.train.steps, o.lr * o.min_lr_ratio)
    tx = optax.chain(optax.clip_by_global_norm(o.clip_norm),
                     optax.adamw(schedule, o.b1, o.b2, o.eps, weight_decay=o.weight_decay,
                                 mask=decay_mask(model_spec(cfg.model).logical_axes)))

    def step(carry, batch):
        params, opt_state, _ = carry
        loss, grads = jax.value_and_grad(lambda p: hand_written_loss(cfg.model, p, batch))(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    if abstract_params is None:
        return jax.jit(step, donate_argnums=0), tx
    replicated = jax.sharding.NamedSharding(batch_sharding.mesh, jax.sharding.PartitionSpec())
    param_shardings = jax.tree.map(lambda a: a.sharding, abstract_params)
    opt_shardings = optax.tree_map_params(tx, lambda _, s: s, jax.eval_shape(tx.init, abstract_params), param_shardings,
                                          transform_non_params=lambda _: replicated)
    carry = (param_shardings, opt_shardings, replicated)
    return jax.jit(step, in_shardings=(carry, batch_sharding), out_shardings=carry, donate_argnums=0), tx


def jaxtrain_contender(trainer: Trainer):
    return (lambda state, batch: trainer.train_step(state, batch)[0]), trainer.init_state()


def overhead(cfg: Config, corpus, sharded: bool) -> dict[str, float]:
    devices = None if sharded else jax.devices()[:1]
    trainer = build(cfg, corpus, devices)
    batch = fixed_batch(trainer)
    state = trainer.init_state()
    # trainer.cfg: model.scan_layers=auto resolved, so both steps loop over the layers alike (unrolled on CPUs)
    if sharded:
        hand, tx = hand_written_step(trainer.cfg, trainer.layout.abstract_state().params, trainer.batch_sharding)
    else:
        hand, tx = hand_written_step(trainer.cfg)
    params = jax.tree.map(jnp.copy, state.params)  # the same initial weights: the first losses must agree
    hand_carry = (params, tx.init(params), jnp.zeros((), jnp.float32))
    hand_loss = float(hand(hand_carry, batch)[2])
    hand_carry = (jax.tree.map(jnp.copy, state.params), tx.init(state.params), jnp.zeros((), jnp.float32))
    jaxtrain_loss = float(trainer.train_step(trainer.init_state(), batch)[1]["loss"])
    if abs(hand_loss - jaxtrain_loss) > 1e-4 * abs(jaxtrain_loss):
        raise AssertionError(f"hand-written step computes a different loss: {hand_loss} vs jaxtrain {jaxtrain_loss}")
    medians = interleaved_medians({"hand": (hand, hand_carry), "jaxtrain": jaxtrain_contender(trainer)}, batch)
    return {"hand_s": medians["hand"], "jaxtrain_s": medians["jaxtrain"], "ratio": medians["hand"] / medians["jaxtrain"],
            "flops_per_step": model_flops_per_token(trainer.layout) * trainer.tokens_per_step}


def compiled_train_step(cfg: Config, corpus):
    """Lower and compile only the train step (``build`` also compiles the eval step) -> (compiled,
    its contender (step, fresh state), a batch, lowering seconds, compile seconds)."""
    layout = make_layout(cfg)
    start = time.perf_counter()
    lowered = lower_train_step(layout)
    lowered_at = time.perf_counter()
    compiled = lowered.compile()
    done = time.perf_counter()
    batch = next(data_lib.train_batches(corpus, cfg.data, cfg.train.global_batch, layout.batch_sharding))
    state = init_state(cfg.model, layout.tx, cfg.train.seed, layout.shardings)
    return compiled, ((lambda st, b: compiled(st, b)[0]), state), batch, lowered_at - start, done - lowered_at


def compile_by_depth(corpus, depths=(2, 8, 32), repeats: int = 3) -> dict[str, float]:
    out, contenders = {}, {}
    model = dataclasses.replace(STEP_MODEL, d_model=64, num_heads=4, num_kv_heads=2, mlp_dim=256, scan_layers=True)
    for depth in depths:
        runs = [compiled_train_step(config(dataclasses.replace(model, num_layers=depth)), corpus) for _ in range(repeats)]
        _, contenders[depth], batch, _, _ = runs[-1]
        out[f"lower_s_{depth}_layers"] = statistics.median(r[3] for r in runs)
        out[f"compile_s_{depth}_layers"] = statistics.median(r[4] for r in runs)
    steps = interleaved_medians(contenders, batch)  # every depth has the same batch shape and sharding
    out |= {f"step_s_{depth}_layers": steps[depth] for depth in depths}
    out["compile_ratio_32_vs_2_layers"] = out["compile_s_32_layers"] / out["compile_s_2_layers"]
    return out


def host_gap(cfg: Config, corpus, intervals: int = 6) -> dict[str, float]:
    """The real loop's per-step time (from its own metrics.jsonl, log every 10 steps) minus the
    device-bound step time measured right before and after on the same trainer."""
    trainer = build(cfg, corpus)
    batch = fixed_batch(trainer)
    device_s = [interleaved_medians({"jaxtrain": jaxtrain_contender(trainer)}, batch)["jaxtrain"]]
    steps = cfg.log.every * (intervals + 1)
    cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, steps=steps, eval_batches=1))
    trainer = dataclasses.replace(trainer, layout=dataclasses.replace(trainer.layout, cfg=cfg))
    with tempfile.TemporaryDirectory() as run_dir:
        train(cfg, Path(run_dir), trainer)
        records = [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]
    device_s.append(interleaved_medians({"jaxtrain": jaxtrain_contender(trainer)}, batch)["jaxtrain"])
    # the first interval includes the asynchronous initialisation and the last one the final evaluation
    loop_s = statistics.median(r["step_time_s"] for r in records if "step_time_s" in r and 10 < r["step"] < steps)
    device = statistics.median(device_s)
    return {"host_gap_ms_per_step": 1e3 * (loop_s - device), "loop_step_s": loop_s, "device_step_s": device}


def profile_cost(cfg: Config, corpus, rounds: int = 3) -> dict[str, float]:
    """Traced against untraced steps of one trainer, alternating (jaxtrain.observe.step_profile)."""
    trainer = build(cfg, corpus, jax.devices()[:1])
    step, state = jaxtrain_contender(trainer)
    batch = fixed_batch(trainer)
    plain, traced, summary_s, spans = [], [], [], []
    for _ in range(rounds):
        seconds, state = seconds_per_step(step, state, batch)
        plain.append(seconds)
        with tempfile.TemporaryDirectory() as trace_dir:
            jax.profiler.start_trace(trace_dir)
            seconds, state = seconds_per_step(step, state, batch)
            traced.append(seconds)
            start = time.perf_counter()
            jax.profiler.stop_trace()
            summary = step_profile.summarize(step_profile.trace_file(trace_dir), trainer.train_step.as_text(),
                                             STEPS_PER_REPEAT, dict(trainer.mesh.shape), "cpu")
            summary_s.append(time.perf_counter() - start)
            spans.append(summary.span_ms / 1e3)
    return {"overhead": statistics.median(traced) / statistics.median(plain), "step_s": statistics.median(plain),
            "traced_step_s": statistics.median(traced), "summary_s": statistics.median(summary_s),
            "span_vs_step": statistics.median(spans) / statistics.median(plain)}


def remat_precision(corpus) -> list[dict]:
    compiled, contenders = {}, {}
    for dtype in ("float32", "bfloat16"):
        for remat in REMAT_POLICIES:
            cfg = config(dataclasses.replace(STEP_MODEL, d_model=128, num_heads=4, num_kv_heads=2, mlp_dim=512, dtype=dtype, remat=remat))
            compiled[dtype, remat], contenders[dtype, remat], batch, _, _ = compiled_train_step(cfg, corpus)
    steps = interleaved_medians(contenders, batch)  # one batch shape and sharding for every variant
    return [{"dtype": dtype, "remat": remat, "step_s": steps[dtype, remat],
             "temp_mib_per_device": compiled[dtype, remat].memory_analysis().temp_size_in_bytes / 2**20,
             "tokens_per_s": cfg.train.global_batch * cfg.data.seq_len / steps[dtype, remat]} for dtype, remat in contenders]


def partial_remat(corpus) -> list[dict]:
    """model.remat_layers: remat full on none, 2 and all 4 of a model's scanned layers (saved activations dominate:
    batch 8 x 512 tokens), compiled temporaries per device and step time, measured side by side."""
    model = dataclasses.replace(STEP_MODEL, num_layers=4, d_model=128, num_heads=4, num_kv_heads=2, mlp_dim=512, scan_layers=True)
    variants = {"none": dict(remat="none"), "full_on_2_of_4": dict(remat="full", remat_layers=2), "full": dict(remat="full")}
    compiled, contenders = {}, {}
    for name, changes in variants.items():
        cfg = config(dataclasses.replace(model, **changes), seq_len=512)
        compiled[name], contenders[name], batch, _, _ = compiled_train_step(cfg, corpus)
    steps = interleaved_medians(contenders, batch)
    return [{"remat": name, "step_s": steps[name], "step_time_vs_none": steps[name] / steps["none"],
             "temp_mib_per_device": compiled[name].memory_analysis().temp_size_in_bytes / 2**20} for name in variants]


def cross_entropy_comparison(tokens: int = 2048, vocab: int = 32768) -> dict:
    rng = np.random.default_rng(0)
    logits = jax.device_put(rng.normal(0, 3, (tokens, vocab)).astype(np.float32), jax.devices()[0])
    targets = jax.device_put(rng.integers(0, vocab, tokens).astype(np.int32), jax.devices()[0])
    steps = {name: jax.jit(jax.value_and_grad(lambda x, f=f: f(x, targets).mean()))
             for name, f in (("jaxtrain", cross_entropy), ("optax", optax.softmax_cross_entropy_with_integer_labels))}
    # each contender's carry is the logits, passed through unchanged: the loss and gradient are what is timed
    seconds = interleaved_medians({name: (lambda x, _, step=step: step(x)[1] * 0 + x, logits) for name, step in steps.items()}, None)
    return {"speedup": seconds["optax"] / seconds["jaxtrain"], "step_s": seconds, "tokens": tokens, "vocab": vocab}


def _timed(name: str, fn, *args):
    start = time.perf_counter()
    out = fn(*args)
    print(f"  perf/{name}: {time.perf_counter() - start:.0f}s", file=sys.stderr, flush=True)
    return out


def run() -> dict:
    corpus = random_corpus(STEP_MODEL.vocab_size)
    single = _timed("overhead_one_device", overhead, config(mesh=ONE_DEVICE, rules="dp"), corpus, False)
    cpu8 = _timed("overhead_cpu8", overhead, config(), corpus, True)
    peak = _timed("matmul_peak", measure_matmul_peak)
    model_flops = cpu8["flops_per_step"] / cpu8["jaxtrain_s"]
    return {
        "overhead_ratio": single["ratio"],
        "overhead_ratio_cpu8_fsdp_tp": cpu8["ratio"],
        "overhead_step_s": {"one_device": single, "cpu8_fsdp_tp": cpu8},
        "matmul_peak_flops": peak,
        "matmul_peak_flops_one_device": measure_matmul_peak(jax.devices()[:1]),
        "model_flops_per_s": model_flops,
        "model_flops_per_s_one_device": single["flops_per_step"] / single["jaxtrain_s"],
        "mfu_vs_matmul_peak": model_flops / peak,
        **_timed("compile_by_depth", compile_by_depth, corpus),
        **_timed("host_gap", host_gap, config(), corpus),
        "remat_precision": _timed("remat_precision", remat_precision, corpus),
        "partial_remat": _timed("partial_remat", partial_remat, corpus),
        "cross_entropy": _timed("cross_entropy", cross_entropy_comparison),
        "step_profile": _timed("step_profile", profile_cost, config(mesh=ONE_DEVICE, rules="dp"), corpus),
    }
