"""The GPU benchmark rows, run one after another inside a total time budget; one JSON line per row.

    python benchmarks/gpu_h200.py                      # every row, 540 s budget, on the local GPU
    python benchmarks/gpu_h200.py --only mfu_1b,attention_xla_1b --budget-s 300
    python benchmarks/gpu_h200.py --tiny               # the same rows with tiny shapes on CPU: checks the runner

Started by ``benchmarks/gpu_h200.sh`` (the one command for a lent GPU: wheels, path, GPU check, then this).
Each row is a separate process (``benchmarks/throughput.py``, ``bench_generate.py``, ``bench_hf.py``), so an out-of-memory row fails alone; rows
run in ROWS order (most wanted first), a row starts only while at least its ``min_s`` of the budget is
left and is killed when the budget runs out, or when the runner itself dies (on Linux). Every row writes one line: the throughput record (MFU, step
time, memory estimated / compiled / measured) with ``row`` added, or ``{"row", "status": "failed" |
"timeout" | "skipped", ...}``. The first line describes the environment (versions, device).
"""

from __future__ import annotations

import ctypes
import dataclasses
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from jaxtrain.errors import OneLineParser, positive_int  # no jax: the runner leaves the devices to its rows

BENCH_DIR = Path(__file__).resolve().parent
DEFAULT_BUDGET_S = 540  # the device tool's commands stop at 600 s; jax start-up and the install come first
# one H200: the sequence length of the Llama 3 rows, bf16 compute; batch = the most that fits with save_dots
GPU_SHAPE = ("data.seq_len=4096", "model.dtype=bfloat16", "train.microbatches=1")
# --tiny: the same rows on CPU in seconds (attention xla: CPUs have no cuDNN)
TINY_SHAPE = ("data.seq_len=512", "model.dtype=float32", "train.microbatches=1", "train.global_batch=2",
              "model.vocab_size=512", "model.d_model=64", "model.num_layers=2", "model.num_heads=4",
              "model.num_kv_heads=2", "model.mlp_dim=128", "model.attention=xla")


@dataclasses.dataclass(frozen=True)
class Row:
    name: str
    experiment: str
    overrides: tuple[str, ...]
    min_s: int  # not started with less budget left: compile plus a few steps would not finish
    script: str = "throughput.py"  # a benchmark script taking EXPERIMENT --mesh --rules [options] key=value...
    options: tuple[str, ...] = ()  # the script's own flags
    tiny_options: tuple[str, ...] = ()  # flags that replace them with --tiny (later flags win)
    min_devices: int = 1  # skipped, saying so, with fewer devices visible; --tiny gives it 8 simulated CPU devices
    tiny_overrides: tuple[str, ...] = ()  # key=value after the tiny shape (for sizes the row needs, e.g. divisible layers)
    xla_flags: str = ""  # added to XLA_FLAGS for the row's process; jaxtrain's defaults never override a flag set here

    def argv(self, python: str, steps: int, tiny: bool, cache: str) -> list[str]:
        """``cache``: the runner's compilation cache folder, new each run, for options that name ``{cache}``."""
        timed = ("--steps", str(steps)) if self.script == "throughput.py" else ()
        options = [option.replace("{cache}", cache) for option in (*self.options, *(self.tiny_options if tiny else ()))]
        # later overrides win: the tiny shape replaces the GPU one and the row's sizes
        return [python, str(BENCH_DIR / self.script), self.experiment, "--mesh", "gpu1", "--rules", "fsdp", *timed,
                *options, *GPU_SHAPE, *self.overrides, *((*TINY_SHAPE, *self.tiny_overrides) if tiny else ())]

    def env(self, tiny: bool) -> dict[str, str]:
        """The row's environment: XLA_FLAGS with the row's flags, and 8 simulated CPU devices for a tiny row that
        needs several devices."""
        simulated = "--xla_force_host_platform_device_count=8" if tiny and self.min_devices > 1 else ""
        return os.environ | {"XLA_FLAGS": " ".join(f for f in (os.environ.get("XLA_FLAGS", ""), self.xla_flags, simulated) if f)}


# Most wanted first: MFU of the 1B and 3B (goal >= 55%), cuDNN vs XLA attention, scan vs unrolled layers, the
# remat trade; then generation and Hugging Face import / export.
GENERATE = dict(script="bench_generate.py", options=("--prompt-tokens", "512", "--new-tokens", "256"),
                tiny_options=("--prompt-tokens", "16", "--new-tokens", "8"))
MFU_1B = ("train.global_batch=8", "model.remat=save_dots", "model.attention=auto")  # the 1B rows' shape
# where the MFU rows' device time goes: 3 steps more under jax's profiler, by kind of kernel (record key "profile")
PROFILED = ("--profile-steps", "3")
# 4 micro-batches of 8 sequences, data 2 x fsdp over the rest: gradients summed over data (the grad_sync / grad_dtype rows)
GRAD_SUMS_OVER_DATA = ("train.global_batch=32", "train.microbatches=4", "mesh.ici.data=2", "mesh.ici.fsdp=-1")
ROWS = (
    Row("mfu_1b", "llama3_1b", MFU_1B, 60, options=PROFILED),
    Row("mfu_3b", "llama3_3b", ("train.global_batch=4", "model.remat=full", "model.attention=auto"), 75, options=PROFILED),
    # mfu_1b with XLA's dynamic-slice fusion on (XLA's default; jaxtrain turns it off with jaxlib >= 0.11,
    # jaxtrain/xla_env.py): compare step_s, and the records' duplicated_matmul_flops_per_step (what the autotuner
    # gave cuBLAS decides whether jax 0.11's XLA computes the scan's saved gemms twice)
    Row("dynamic_slice_fusion_1b", "llama3_1b", MFU_1B, 60, xla_flags="--xla_gpu_enable_dynamic_slice_fusion=true"),
    # scan vs unrolled layers on the GPU: step time and compile time beside mfu_1b (same shape, scanned)
    Row("unrolled_1b", "llama3_1b", (*MFU_1B, "model.scan_layers=false"), 75, options=PROFILED),
    Row("attention_xla_1b", "llama3_1b", ("train.global_batch=8", "model.remat=save_dots", "model.attention=xla"), 60),
    # chunked causal attention (what auto picks on CPUs) on a GPU: does scoring only the keys up to each query chunk
    # pay there too, against attention_xla_1b and cuDNN (mfu_1b)
    Row("attention_chunked_1b", "llama3_1b", ("train.global_batch=8", "model.remat=save_dots", "model.attention=chunked"), 60),
    Row("remat_full_1b", "llama3_1b", ("train.global_batch=8", "model.remat=full", "model.attention=auto"), 60),
    # remat full on 8 of the 16 layers (model.remat_layers): between remat_full_1b and save_dots (mfu_1b) in memory and time
    Row("remat_half_1b", "llama3_1b", ("train.global_batch=8", "model.remat=full", "model.remat_layers=8", "model.attention=auto"), 60,
        tiny_overrides=("model.remat_layers=1",)),
    Row("mfu_3b_save_dots", "llama3_3b", ("train.global_batch=4", "model.remat=save_dots", "model.attention=auto"), 75),
    Row("loss_chunk_1b", "llama3_1b", (*MFU_1B, "train.loss_chunk=512"), 60),
    # LoRA (rank 16 on every projection, bf16 frozen base) and QLoRA (nf4 base): tokens/s and peak memory
    Row("lora_1b", "llama3_1b", (*MFU_1B, "model.param_dtype=bfloat16", "model.lora.rank=16",
                                 "model.lora.alpha=32"), 60),
    Row("qlora_nf4_1b", "llama3_1b", (*MFU_1B, "model.param_dtype=bfloat16", "model.lora.rank=16",
                                      "model.lora.alpha=32", "model.base_quant=nf4"), 60),
    # KV-cache prefill and decode tokens/s, bf16 weights (benchmarks/bench_generate.py)
    Row("generate_1b_batch_1", "llama3_1b", ("model.param_dtype=bfloat16", "model.attention=auto"), 60,
        **GENERATE | {"options": (*GENERATE["options"], "--batch", "1")}),
    Row("generate_1b_batch_8", "llama3_1b", ("model.param_dtype=bfloat16", "model.attention=auto"), 60,
        **GENERATE | {"options": (*GENERATE["options"], "--batch", "8")}),
    # a random llama3_1b-shaped model (5 GB float32) imported onto the GPU and exported back: seconds and peak
    # host RSS growth beside the safetensors library's whole read and save (benchmarks/bench_hf.py)
    Row("hf_import_export_1b", "llama3_1b", (), 90, script="bench_hf.py"),
    # two Mixtral 8x7B layers (8 experts of MLP 14336, top-2, d 4096) on one H200: capacity dispatch (fixed-shape
    # buffers) and dropless (jax.lax.ragged_dot, which the GPU compiler expands over every expert: tokamax's kernels,
    # model.moe.grouped_matmul=auto elsewhere, do not run on the image's jax 0.11); MFU counts the active parameters;
    # and LoRA on the experts (rank 16 on attention and every expert, bf16 frozen base: PEFT's target_parameters)
    Row("moe_mixtral_layers_capacity", "mixtral_8x7b", ("model.num_layers=2", "train.global_batch=2", "model.remat=full",
                                                        "model.attention=auto", "model.moe.dispatch=capacity"), 75),
    # the same with save_dots, which keeps the experts' rows, gate, up and output (jaxtrain/models/moe.py EXPERT_SAVED): the
    # backward does not multiply by the experts again
    Row("moe_mixtral_layers_capacity_save_dots", "mixtral_8x7b", ("model.num_layers=2", "train.global_batch=2",
                                                                  "model.remat=save_dots", "model.attention=auto",
                                                                  "model.moe.dispatch=capacity"), 75),
    *(Row(f"moe_mixtral_layers_dropless{suffix}", "mixtral_8x7b", ("model.num_layers=2", "train.global_batch=2", "model.remat=full",
                                                                  "model.attention=auto", "model.moe.dispatch=dropless", *extra), 75)
      for suffix, extra in (("", ()), ("_lora", ("model.param_dtype=bfloat16", "model.lora.rank=16", "model.lora.alpha=32")))),
    # expert parallelism on 2+ GPUs (rules fsdp_ep: experts over expert 2, the rest fsdp): dropless gathers each expert
    # group's tokens and reduce-scatters the outputs back (jaxtrain/models/moe.py), capacity moves its buffers by all-to-all;
    # compare step_s, and the expert bytes with `jaxtrain plan mixtral_8x7b --hlo-report` on the same overrides
    *(Row(f"moe_expert_parallel_{dispatch}", "mixtral_8x7b", ("model.num_layers=2", "train.global_batch=8", "model.remat=full",
                                                             "model.attention=auto", f"model.moe.dispatch={dispatch}",
                                                             "mesh.ici.expert=2", "mesh.ici.fsdp=-1"), 75,
          options=("--rules", "fsdp_ep"), min_devices=2, tiny_overrides=("train.global_batch=8",))
      for dispatch in ("dropless", "capacity")),
    # memory techniques beside mfu_1b (bf16, same shape): quantized training's speed-up, offload's memory and
    # step time, float16 with loss scaling (benchmarks/bench_memory.py measures them all on CPU)
    Row("quant_fp8_1b", "llama3_1b", (*MFU_1B, "model.quant=fp8"), 60),
    Row("quant_int8_1b", "llama3_1b", (*MFU_1B, "model.quant=int8"), 60),
    Row("offload_1b", "llama3_1b", (*MFU_1B, "optim.offload=true"), 60),
    Row("float16_1b", "llama3_1b", (*MFU_1B, "model.dtype=float16"), 60),
    # the spike guard (train.skip_spikes, jaxtrain/spikes.py, OLMo 2's 6 deviations over 128 steps) against mfu_1b
    Row("skip_spikes_1b", "llama3_1b", (*MFU_1B, "train.skip_spikes=6"), 60),
    # the persistent compilation cache (train.compile_cache): mfu_1b's program compiled into the runner's new folder,
    # then read back by the next process, as a restart after preemption does; compare their compile_s
    Row("compile_cache_cold_1b", "llama3_1b", MFU_1B, 60, options=("--compile-cache", "{cache}")),
    Row("compile_cache_warm_1b", "llama3_1b", MFU_1B, 45, options=("--compile-cache", "{cache}")),
    # pipeline parallelism (rules pp_fsdp): 2 stages x fsdp over the rest of the GPUs, circular (16 layers = 2 stages x
    # 2 repeats x 4), 2 micro-batches in flight: bubble (2 - 1) / (2 x 2 + 2 - 1) = 20%; compare its MFU with mfu_1b's
    Row("pipeline_1b", "llama3_1b", (*MFU_1B, "mesh.ici.stage=2",
                                     "mesh.ici.fsdp=-1", "model.pipeline.microbatches=2", "model.pipeline.repeats=2"), 60,
        options=("--rules", "pp_fsdp"), min_devices=2, tiny_overrides=("model.num_layers=8", "train.global_batch=8")),
    # optim.grad_sync on 2+ GPUs: 4 micro-batches of llama3_1b, data 2 x fsdp over the rest, the sums over data once per
    # step against GSPMD's in every micro-batch (jaxtrain/memory/grad_comm.py; 4 micro-batches x bfloat16 against one
    # float32 sum: half the bytes over data); compare step_s, and hlo_report's bytes with `jaxtrain plan --hlo-report`
    *(Row(f"grad_sync_{sync}_1b", "llama3_1b", (*MFU_1B, *GRAD_SUMS_OVER_DATA, f"optim.grad_sync={sync}"), 60, min_devices=2,
          tiny_overrides=GRAD_SUMS_OVER_DATA[:2])
      for sync in ("step", "microbatch")),
    # optim.grad_dtype on 2+ GPUs under pure data parallelism (rules dp, which bfloat16 sums need): the sums over data
    # once a step in float32 against bfloat16, half the bytes; compare their step_s (on one GPU there is no sum)
    *(Row(f"grad_{short}_1b", "llama3_1b", (*MFU_1B, *GRAD_SUMS_OVER_DATA[:2], "mesh.ici.data=-1", "mesh.ici.fsdp=1",
                                            "optim.grad_sync=step", f"optim.grad_dtype={dtype}"), 60,
          options=("--rules", "dp"), min_devices=2, tiny_overrides=GRAD_SUMS_OVER_DATA[:2])
      for short, dtype in (("f32", "float32"), ("bf16", "bfloat16"))),
    # a 1 GiB state split over the GPUs saved (device to host to disk), restored, and saved in the background under a
    # loop of steps (benchmarks/bench_checkpoint.py; on one GPU its small replicated arrays have no replicas to share)
    Row("checkpoint_1gib", "tiny", (), 60, script="bench_checkpoint.py"),
    # not the GPU: the machine's own cores (16) training the torch peer's step on the CPU with glibc's malloc keeping
    # freed memory (JAXTRAIN_HOST_MALLOC), and jemalloc where the image has it, against the system's: does one malloc
    # arena cost anything on many cores? (benchmarks/bench_host_malloc.py: 1.18-1.34x, jemalloc 1.57x, on 2 cores)
    Row("host_malloc_cpu", "tiny", (), 120, script="bench_host_malloc.py"),
)


def environment(python: str) -> dict:
    """Versions and devices as the rows' interpreter sees them (its own process: this one stays jax-free)."""
    probe = ("import json, sys, importlib.metadata as m, jax\n"
             "names = ['jax', 'jaxlib', 'flax', 'optax', 'orbax-checkpoint', 'grain', 'tensorboardX', 'numpy']\n"
             "def version(n):\n"
             "    try: return m.version(n)\n"
             "    except m.PackageNotFoundError: return None\n"
             "d = jax.devices()\n"
             "print(json.dumps({'python': sys.version.split()[0], 'versions': {n: version(n) for n in names},"
             " 'platform': d[0].platform, 'device_kind': d[0].device_kind, 'devices': len(d)}))")
    result = subprocess.run([python, "-c", probe], capture_output=True, text=True)
    if result.returncode:
        return {"status": "failed", "stderr_tail": result.stderr[-2000:]}
    return json.loads(result.stdout.splitlines()[-1])


PR_SET_PDEATHSIG = 1  # prctl(2): the signal a process gets when the thread that started it ends


def _die_with_runner(runner: int):
    """A row's process is killed with the runner: a runner killed from outside (the device tool's time limit, a
    test's timeout: SIGKILL, which it cannot pass on) would otherwise leave its row computing for as long as the
    row runs, on a device or a CI machine that has moved on."""
    def preexec() -> None:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
        if os.getppid() != runner:  # the runner died before the line above
            os._exit(1)
    return preexec


def run_row(row: Row, argv: list[str], timeout_s: float, env: dict) -> dict:
    start = time.perf_counter()
    try:
        result = subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s, env=env,
                                preexec_fn=_die_with_runner(os.getpid()) if sys.platform == "linux" else None)
    except subprocess.TimeoutExpired as e:
        tail = (e.stderr or b"")[-2000:]
        return {"status": "timeout", "seconds": round(time.perf_counter() - start, 1),
                "stderr_tail": tail.decode(errors="replace") if isinstance(tail, bytes) else tail}
    seconds = round(time.perf_counter() - start, 1)
    lines = result.stdout.strip().splitlines()
    if result.returncode or not lines:
        return {"status": "failed", "returncode": result.returncode, "seconds": seconds, "stderr_tail": result.stderr[-2000:]}
    return {"status": "ok", "seconds": seconds} | json.loads(lines[-1])


def main(argv: list[str] | None = None) -> int:
    parser = OneLineParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", help="comma-separated row names (default: every row): " + ", ".join(r.name for r in ROWS))
    parser.add_argument("--budget-s", type=float, default=DEFAULT_BUDGET_S, help="total seconds for every row together")
    parser.add_argument("--steps", type=positive_int, default=8, help="timed steps per row (after 2 warm-up steps)")
    parser.add_argument("--tiny", action="store_true", help="tiny shapes on CPU: checks the runner, measures nothing")
    parser.add_argument("--out", help="JSON lines file, appended (default: $OUT/gpu_h200.jsonl where OUT is set, "
                        "else benchmarks/results/gpu_h200.jsonl)")
    args = parser.parse_args(argv)
    rows = ROWS
    if args.only:
        wanted = args.only.split(",")
        unknown = sorted(set(wanted) - {r.name for r in ROWS})
        if unknown:
            parser.error(f"unknown row(s) {', '.join(unknown)}; rows: {', '.join(r.name for r in ROWS)}")
        rows = tuple(r for r in ROWS if r.name in wanted)
    out = Path(args.out or (Path(os.environ["OUT"]) / "gpu_h200.jsonl" if os.environ.get("OUT") else BENCH_DIR / "results" / "gpu_h200.jsonl"))
    out.parent.mkdir(parents=True, exist_ok=True)
    deadline = time.monotonic() + args.budget_s

    def write(record: dict) -> None:
        with out.open("a") as f:
            f.write(json.dumps(record) + "\n")
        print(json.dumps(record), flush=True)

    env = environment(sys.executable)
    write({"row": "environment", "tiny": args.tiny, "budget_s": args.budget_s} | env)
    failed = False
    # empty: the cold row fills it, the warm row reads it; removed at the end, on an exception and on Ctrl-C
    with tempfile.TemporaryDirectory(prefix="jaxtrain-gpu-cache-") as cache:
        for row in rows:
            left = deadline - time.monotonic()
            if left < (5 if args.tiny else row.min_s):
                write({"row": row.name, "status": "skipped", "reason": f"{left:.0f} s of the budget left, the row needs {row.min_s} s"})
                continue
            if not args.tiny and env.get("devices", 0) < row.min_devices:
                write({"row": row.name, "status": "skipped",
                       "reason": f"needs {row.min_devices} or more devices, {env.get('devices', 0)} visible"})
                continue
            print(f"== {row.name} ({left:.0f} s of the budget left)", file=sys.stderr, flush=True)
            record = {"row": row.name} | run_row(row, row.argv(sys.executable, args.steps, args.tiny, cache), left, row.env(args.tiny))
            failed |= record["status"] != "ok"
            write(record)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
