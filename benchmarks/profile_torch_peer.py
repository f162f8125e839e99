"""Where the forward + backward time goes, op by op, for the torch peer's model (issue 16): jaxtrain's loss and
gradients on XLA:CPU under jax's profiler, and transformers' ``LlamaForCausalLM`` under torch's, same shapes and
batch as ``bench_torch_peer``. Not part of ``make bench`` (a profile, not a ratio); run by hand:

    PYTHONPATH=$PWD .venv/bin/python benchmarks/profile_torch_peer.py [--top 25] [--scanned]

jaxtrain's side: per compiled op (fusion, dot, copy), milliseconds per pass (mean of the profiled passes), the op's
source function in the model (from the HLO's stack frames; ops without one are the layer scan's stacking, copies and
zero-filled buffers), and the total per source function. torch's side: per aten op, self CPU time.
"""

from __future__ import annotations

import collections
import dataclasses
import os
import re
import sys
import tempfile

import jax

from jaxtrain.errors import OneLineParser, positive_int
from jaxtrain.memory import host_malloc

# the XLA:CPU process `make bench` runs bench_torch_peer in: one device, as many pool threads as cores
os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=1"
sys.path.insert(0, os.path.dirname(__file__))
host_malloc.reexec_with_jemalloc()  # malloc as in `make bench` and `jaxtrain train`
host_malloc.configure()

from bench_perf import ONE_DEVICE, config, fixed_batch, random_corpus  # noqa: E402
from bench_torch_peer import BATCH, PEER_MODEL, SEQ_LEN, torch_contender  # noqa: E402

from jaxtrain.observe import step_profile  # noqa: E402
from jaxtrain.step import token_nll  # noqa: E402
from jaxtrain.train import build  # noqa: E402

PASSES = 3


def source_of_ops(hlo: str) -> dict[str, str]:
    """HLO instruction name -> 'function (file:line)' of the model code it came from (innermost stack frame)."""
    def table(name):
        block = re.search(rf"^{name}\n(.*?)(?:\n\n|\n[A-Z%])", hlo, re.S | re.M)
        return dict(re.findall(r"^(\d+) (.*)$", block.group(1), re.M)) if block else {}
    files, functions, locations, frames = (table(n) for n in ("FileNames", "FunctionNames", "FileLocations", "StackFrames"))

    def frame(frame_id: str) -> str:
        location = locations[re.search(r"file_location_id=(\d+)", frames[frame_id]).group(1)]
        file_id, function_id, line = re.search(r"file_name_id=(\d+) function_name_id=(\d+) line=(\d+)", location).groups()
        return f"{functions[function_id].strip(chr(34))} ({os.path.basename(files[file_id].strip(chr(34)))}:{line})"

    ops = {}
    for name, frame_id in re.findall(r"^\s*(?:ROOT )?%([\w.\-]+) = .*?stack_frame_id=(\d+)", hlo, re.M):
        ops[name] = frame(frame_id)
    return ops


def jax_profile(scanned: bool) -> tuple[dict, dict, float]:
    """(op -> ms per pass, op -> source, total ms per pass) of jaxtrain's forward + backward."""
    model = dataclasses.replace(PEER_MODEL, scan_layers=True if scanned else "auto")  # auto: unrolled on CPUs
    cfg = config(model, mesh=ONE_DEVICE, rules="dp", seq_len=SEQ_LEN, global_batch=BATCH)
    trainer = build(cfg, random_corpus(model.vocab_size), jax.devices()[:1])
    batch, params = fixed_batch(trainer), trainer.init_state().params
    loss = lambda p, b: token_nll(trainer.layout.spec.graphdef, p, b).mean()  # noqa: E731
    compiled = jax.jit(jax.value_and_grad(loss)).lower(params, batch).compile()
    jax.block_until_ready(compiled(params, batch))
    with tempfile.TemporaryDirectory() as trace_dir:
        with jax.profiler.trace(trace_dir):
            for _ in range(PASSES):
                jax.block_until_ready(compiled(params, batch))
        _, ops, _ = step_profile.op_times(step_profile.trace_file(trace_dir), compiled.as_text(), PASSES, "cpu")
    times = collections.Counter({op: o.ms for op, o in ops.items()})
    return times, source_of_ops(compiled.as_text()), sum(times.values())


def torch_profile(top: int) -> str:
    import torch

    torch.set_num_threads(os.cpu_count())
    cfg = config(PEER_MODEL, mesh=ONE_DEVICE, rules="dp", seq_len=SEQ_LEN, global_batch=BATCH)
    trainer = build(cfg, random_corpus(PEER_MODEL.vocab_size), jax.devices()[:1])
    forward_backward, _ = torch_contender(cfg, fixed_batch(trainer))["forward_backward"]
    forward_backward(None, None)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for _ in range(PASSES):
            forward_backward(None, None)
    return prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=top)


def main() -> None:
    parser = OneLineParser(description=__doc__.splitlines()[0])
    parser.add_argument("--top", type=positive_int, default=25)
    parser.add_argument("--scanned", action="store_true", help="model.scan_layers=true (the default on CPUs unrolls)")
    args = parser.parse_args()
    times, sources, total = jax_profile(args.scanned)
    print(f"jaxtrain forward + backward: {total:.1f} ms of op time per pass (load average {os.getloadavg()[0]:.1f})")
    # plain dot ops are Eigen's (the rest of the products are YNNPACK fusions): XLA:CPU runs them asynchronously, so
    # their events time the launch only (a 805 MFLOP product traced at 0.9 ms that takes about 5)
    eigen = [op for op in times if re.fullmatch(r"dot(_general)?(\.\d+)?", op)]
    if eigen:
        print(f"  not counted: the work of {len(eigen)} Eigen products (plain dot ops), traced at their launch only "
              f"({sum(times[op] for op in eigen):.1f} ms)")
    by_source = collections.Counter()
    for op, ms in times.items():
        by_source[sources.get(op, "(no source: layer scan stacking, copies, zero fills)")] += ms
    print("\nper source function:")
    for source, ms in by_source.most_common(args.top):
        print(f"{ms:9.1f} ms  {100 * ms / total:5.1f}%  {source}")
    print("\nper op:")
    for op, ms in times.most_common(args.top):
        print(f"{ms:9.1f} ms  {100 * ms / total:5.1f}%  {op:42} {sources.get(op, '')}")
    print(f"\ntransformers forward + backward, {PASSES} passes (torch profiler, self CPU time):")
    print(torch_profile(args.top))


if __name__ == "__main__":
    main()
