"""Generation speed with the key/value cache (``jaxtrain.generate``), measured side by side in one process:

- ``generate_prefill_tokens_per_s`` / ``generate_decode_tokens_per_s``: prompt tokens per second through
  the prefill, and new tokens per second through the one-token decoding steps (no stop token: every step runs), at batch 1 and 8
  (``generate_tokens_per_s``: both, with step times and compile time).
- ``generate_one_device_speedup``: batch-1 decoding on one CPU device (what ``jaxtrain generate`` uses on a CPU)
  ÷ on every simulated device of ``make bench`` with fsdp over all of them (what it used before 2026-12-07, each
  device gathering the weights it computes with); medians of interleaved repetitions, per-token seconds of both in
  ``generate_one_device_vs_all``.
- ``generate_cache_speedup``: per new token, one forward over the whole sequence (what generating
  without a cache costs; timed at the mean sequence length of such a generation, prompt + new / 2)
  ÷ one KV-cache decoding step; medians of interleaved repetitions, batch 1.

Small model on one device: d_model 256, 4 layers, 8 heads (4 KV), MLP 1024, vocab 256, float32;
prompt 128 tokens, 128 new tokens, greedy, random weights (the speed does not depend on them).

    python benchmarks/bench_generate.py llama3_1b --mesh gpu1 --rules fsdp model.param_dtype=bfloat16

runs the same measurement for an experiment on the local devices and prints one JSON line
(benchmarks/gpu_h200.sh).
"""

from __future__ import annotations

import json
import statistics
import sys
import time

REPEATS = 5
PROMPT, NEW = 128, 128


def small_config():
    from jaxtrain.config import AxisSizes, Config, MeshConfig
    from jaxtrain.models.config import LlamaConfig

    model = LlamaConfig(vocab_size=256, d_model=256, num_layers=4, num_heads=8, num_kv_heads=4, mlp_dim=1024, dtype="float32")
    return Config(model=model, mesh=MeshConfig(ici=AxisSizes(fsdp=1)), rules="dp")


def random_model(cfg, devices=None):
    """A ``Loaded`` model with the config's random initial parameters, placed with its rule set."""
    from jaxtrain.generate import Loaded
    from jaxtrain.state import init_state
    from jaxtrain.layout import make_layout

    layout = make_layout(cfg, devices)
    params = init_state(cfg.model, layout.tx, cfg.train.seed, layout.shardings).params
    return Loaded(cfg.model, params, layout.mesh, cfg.mesh, layout.rules, cfg.rules, encode=None, decode=None)


def measure(loaded, batch: int, prompt_len: int, new: int, repeats: int = REPEATS) -> dict:
    """Prefill and decode speed; with batch 1 also the forward without a cache, interleaved."""
    import jax
    import numpy as np
    from flax import nnx

    from jaxtrain.config import SamplingConfig
    from jaxtrain.generate import generate
    from jaxtrain.partitioning import model_tracing
    from jaxtrain.state import model_spec

    prompts = np.random.default_rng(0).integers(0, loaded.model_cfg.vocab_size, (batch, prompt_len)).astype(np.int32)
    sampling = SamplingConfig(max_new_tokens=new)
    compile_s = generate(loaded, prompts, sampling).compile_s
    graphdef = model_spec(loaded.model_cfg).graphdef
    no_cache_tokens = np.zeros((batch, prompt_len + new // 2), np.int32)
    with model_tracing(loaded.mesh, loaded.rules, loaded.rules_name):
        forward = jax.jit(lambda params, tokens: nnx.merge(graphdef, params)(tokens)[:, -1].argmax(-1))
        forward = forward.lower(loaded.params, no_cache_tokens).compile()
    jax.block_until_ready(forward(loaded.params, no_cache_tokens))
    prefill, decode, no_cache = [], [], []
    for _ in range(repeats):
        out = generate(loaded, prompts, sampling)
        prefill.append(out.prefill_s)
        decode.append(out.decode_s / (new - 1))
        start = time.perf_counter()
        jax.block_until_ready(forward(loaded.params, no_cache_tokens))
        no_cache.append(time.perf_counter() - start)
    prefill_s, decode_step_s = statistics.median(prefill), statistics.median(decode)
    return {"batch": batch, "prompt_tokens": prompt_len, "new_tokens": new, "compile_s": round(compile_s, 2),
            "prefill_s": prefill_s, "prefill_tokens_per_s": batch * prompt_len / prefill_s,
            "decode_step_s": decode_step_s, "decode_tokens_per_s": batch / decode_step_s,
            "no_cache_forward_s": statistics.median(no_cache), "cache_speedup": statistics.median(no_cache) / decode_step_s}


def run() -> dict:
    import jax

    loaded = random_model(small_config(), jax.devices()[:1])
    rows = {f"batch_{b}": measure(loaded, b, PROMPT, NEW) for b in (1, 8)}
    one_vs_all = _one_device_vs_all(loaded)
    return {
        "generate_one_device_speedup": one_vs_all["all_devices_decode_step_s"] / one_vs_all["one_device_decode_step_s"],
        "generate_one_device_vs_all": one_vs_all,
        "generate_prefill_tokens_per_s": rows["batch_1"]["prefill_tokens_per_s"],
        "generate_decode_tokens_per_s": rows["batch_1"]["decode_tokens_per_s"],
        "generate_decode_tokens_per_s_batch_8": rows["batch_8"]["decode_tokens_per_s"],
        "generate_cache_speedup": rows["batch_1"]["cache_speedup"],
        "generate_tokens_per_s": rows,
    }


def _one_device_vs_all(one) -> dict:
    """Batch-1 decoding seconds per token of ``one`` (the small model on one device) and of the same model on every
    device, fsdp over all of them (rules fsdp_tp), interleaved."""
    import dataclasses

    import jax
    import numpy as np

    from jaxtrain.config import AxisSizes, MeshConfig, SamplingConfig
    from jaxtrain.generate import generate

    every = random_model(dataclasses.replace(small_config(), mesh=MeshConfig(ici=AxisSizes(fsdp=jax.device_count())), rules="fsdp_tp"))
    prompt, sampling = np.random.default_rng(0).integers(0, 256, (1, PROMPT)).astype(np.int32), SamplingConfig(max_new_tokens=NEW)
    steps = {"one_device": [], "all_devices": []}
    for _ in range(REPEATS):
        for name, loaded in (("one_device", one), ("all_devices", every)):
            steps[name].append(generate(loaded, prompt, sampling).decode_s / (NEW - 1))
    return {"devices": jax.device_count(), **{f"{name}_decode_step_s": statistics.median(s) for name, s in steps.items()}}


def main(argv: list[str] | None = None) -> int:
    from throughput import experiment_parser
    from jaxtrain.errors import positive_int

    parser = experiment_parser(__doc__.splitlines()[0])
    parser.add_argument("--batch", type=positive_int, default=1)
    parser.add_argument("--prompt-tokens", type=positive_int, default=512)
    parser.add_argument("--new-tokens", type=positive_int, default=256)
    args = parser.parse_intermixed_args(argv)
    from jaxtrain.cli import resolve_config
    from jaxtrain.errors import UserError

    try:
        cfg = resolve_config(args.experiment, args.mesh, args.rules, args.overrides)
        row = measure(random_model(cfg), args.batch, args.prompt_tokens, args.new_tokens)
    except UserError as e:
        print(f"bench_generate: error: {e}", file=sys.stderr)
        return 2
    import jax

    print(json.dumps({"experiment": args.experiment, "device": jax.devices()[0].device_kind, "devices": len(jax.devices()),
                      "dtype": cfg.model.dtype, "param_dtype": cfg.model.param_dtype, **row}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
