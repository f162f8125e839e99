"""Where a profiled step's device time went, read from jax's profiler trace and the compiled step's HLO.

``log.profile_steps`` (and ``benchmarks/throughput.py --profile-steps``) trace some steps with jax's profiler, which
writes a Perfetto ``*.trace.json.gz`` beside its ``.xplane.pb``. Its events on the first device, the GPU's kernels
(each names the HLO instruction it runs in ``args.hlo_op``) or XLA:CPU's ops, are summed by kind, the kind read off
the compiled program (``hlo_report.kernel_kinds``): matmuls, attention (cuDNN's fused kernels), the elementwise,
reduction and copy rest, and collectives; an event that names no instruction (a kernel inside a CUDA graph, the
runtime's memsets) by its kernel's name: XLA's fusion kernels carry the fusion's, library kernels their kind's. Per step: each kind's milliseconds, the device's busy
time (the union of its events: collectives on their own streams overlap compute), the idle rest of the span the
events cover (launch gaps, the host's work between steps), the rates the matmuls and the rest reached (FLOPs and
bytes per step from ``hlo_report``) and the largest ops. What MFU does not say: where the rest of the step went.
"""

from __future__ import annotations

import collections
import dataclasses
import gzip
import json
import re
import socket
from pathlib import Path

from jaxtrain.plan import hlo_report

KINDS = ("matmul", "attention", "other", "collective")
SUMMARY_FILE = "step_profile.json"  # written beside the trace it summarizes
LARGEST_OPS = 10
# kernels the program does not name, by their name (cuBLAS / CUTLASS / Triton gemms, cuDNN attention, NCCL)
_NAMED_KINDS = (("collective", re.compile(r"nccl", re.I)), ("attention", re.compile(r"sdpa|fmha|flash", re.I)),
                ("matmul", re.compile(r"gemm|nvjet|xmma|cutlass|wgmma", re.I)))
_DEVICE_PROCESS = re.compile(r"^/device:(GPU|TPU):(\d+)$")
# the lines the profiler derives from a device's kernels (xprof's names): the same time again
_DERIVED_LINES = {"XLA Modules", "XLA Ops", "XLA TraceMe", "Steps", "TensorFlow Ops", "TensorFlow Name Scope",
                  "Framework Ops", "Framework Name Scope", "Source code", "Launch Stats"}


@dataclasses.dataclass(frozen=True)
class StepProfile:
    steps: int
    device: str  # the trace's process of the events read: "/device:GPU:0", or "/host:CPU" for XLA:CPU's ops
    ms_by_kind: dict[str, float]  # per step, each kind's events summed
    busy_ms: float  # per step, the union of the events' intervals
    span_ms: float  # per step, first event's start to last event's end
    unattributed_ms: float  # per step, of ms_by_kind: events the compiled program does not name
    matmul_tflops: float | None  # the matmul FLOPs of a step over its matmul time
    other_gb_per_s: float | None  # the bytes the "other" kernels move per step over their time
    # (op, kind, ms per step, runs per step, the jax operation it came from), most time first
    largest_ops: tuple[tuple[str, str, float, float, str], ...]

    @property
    def idle_ms(self) -> float:
        return max(self.span_ms - self.busy_ms, 0.0)

    def to_json(self) -> dict:
        return {"steps": self.steps, "device": self.device, "ms_per_step_by_kind": self.ms_by_kind,
                "busy_ms_per_step": self.busy_ms, "span_ms_per_step": self.span_ms, "idle_ms_per_step": self.idle_ms,
                "unattributed_ms_per_step": self.unattributed_ms, "matmul_tflops": self.matmul_tflops,
                "other_gb_per_s": self.other_gb_per_s,
                "largest_ops": [{"op": op, "kind": kind, "ms_per_step": ms, "runs_per_step": runs, "source": source}
                                for op, kind, ms, runs, source in self.largest_ops]}

    def lines(self) -> list[str]:
        """Two lines for a person: the step by kind, then the largest ops."""
        def share(ms: float) -> str:
            return f"{ms:.1f} ms ({100 * ms / self.span_ms:.0f}%)" if self.span_ms else f"{ms:.1f} ms"
        rates = {"matmul": f", {self.matmul_tflops:.3g} TFLOP/s" if self.matmul_tflops else "",
                 "other": f", {self.other_gb_per_s:.0f} GB/s" if self.other_gb_per_s else ""}
        kinds = ", ".join(f"{kind} {share(self.ms_by_kind[kind])}{rates.get(kind, '')}" for kind in KINDS if self.ms_by_kind[kind])
        largest = ", ".join(f"{op} ({kind}{': ' + _short(source) if source else ''}) {ms:.2f} ms"
                            for op, kind, ms, _, source in self.largest_ops[:5])
        return [f"device time per step ({self.device}, {self.steps} steps): span {self.span_ms:.1f} ms, busy "
                f"{self.busy_ms:.1f}, idle {share(self.idle_ms)}; {kinds}",
                f"largest ops per step: {largest}"]


def _short(source: str) -> str:
    """The last two parts of an XLA op_name ("jit(train_step)/.../mlp/dot_general" -> "mlp/dot_general"), less the
    brackets the cut leaves unmatched (a combined collective's "(name:name)" ended "bthk/dot_general))", a QA report)."""
    tail = "/".join(source.split("/")[-2:])
    opened, unmatched = [], set()
    for i, char in enumerate(tail):
        if char == "(":
            opened.append(i)
        elif char == ")":
            if opened:
                opened.pop()
            else:
                unmatched.add(i)
    unmatched.update(opened)
    return "".join(char for i, char in enumerate(tail) if i not in unmatched)


def trace_file(trace_dir: Path) -> Path:
    """The newest trace jax's profiler wrote under ``trace_dir``, this host's where several hosts wrote theirs
    (the profiler names each by its host)."""
    found = sorted(Path(trace_dir).rglob("*.trace.json.gz"), key=lambda p: p.stat().st_mtime)
    if not found:
        raise FileNotFoundError(f"no *.trace.json.gz under {trace_dir}")
    own = [p for p in found if p.name == f"{socket.gethostname()}.trace.json.gz"]
    return (own or found)[-1]


def _union_us(intervals: list[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for start, stop in sorted(intervals):
        if stop > end:
            total += stop - max(start, end)
            end = stop
    return total


def _device_events(events: list[dict], module: str, platform: str) -> tuple[str, list[dict]]:
    """The first device's events of the step's program: on a GPU its kernels (on its "Stream" lines where the
    trace names them, not the lines the profiler derives from them), on XLA:CPU the ops of device ordinal 0."""
    processes = {e["pid"]: e["args"]["name"] for e in events if e.get("ph") == "M" and e.get("name") == "process_name"}
    threads = {(e["pid"], e["tid"]): e["args"]["name"] for e in events if e.get("ph") == "M" and e.get("name") == "thread_name"}
    timed = [e for e in events if e.get("ph") == "X" and "dur" in e]
    devices = sorted((int(m.group(2)), pid) for pid, name in processes.items() if (m := _DEVICE_PROCESS.match(name)))

    def of_module(e: dict) -> bool:  # another program's events are not the step's; runtime events name none
        named = e.get("args", {}).get("hlo_module")
        return named is None or re.sub(r"\(\d+\)$", "", named) == module
    if devices:
        pid = devices[0][1]
        streams = any(key[0] == pid and name.startswith("Stream") for key, name in threads.items())

        def kernel_line(tid) -> bool:
            name = threads.get((pid, tid), "")
            return name.startswith("Stream") if streams else name not in _DERIVED_LINES
        return processes[pid], [e for e in timed if e["pid"] == pid and kernel_line(e["tid"]) and of_module(e)]
    if platform != "cpu":  # the host's events name the ops it launches: not the device's time
        raise ValueError(f"the trace has no events of a {platform} device (processes: {sorted(processes.values())}); "
                         "on NVIDIA GPUs jax's profiler reads kernels through CUPTI")
    ops = [e for e in timed if e.get("args", {}).get("hlo_module") and of_module(e)]
    first = min((e["args"].get("device_ordinal", "0") for e in ops), key=int, default="0")
    return "/host:CPU", [e for e in ops if e["args"].get("device_ordinal", "0") == first]


@dataclasses.dataclass(frozen=True)
class OpTime:
    kind: str  # one of KINDS
    ms: float  # per step
    runs: float  # per step
    source: str  # the jax operation it came from (XLA's op_name), "" where the program names none
    attributed: bool  # the event named an instruction of the program (else its kind is read off the kernel's name)


def op_times(trace: Path, hlo_text: str, steps: int, platform: str) -> tuple[str, dict[str, OpTime], list[tuple[float, float]]]:
    """(the device read, each op's time per step, the events' (start, end) in microseconds) of ``steps`` runs of the
    program ``hlo_text`` (``Compiled.as_text()``) on ``platform``'s devices ("cpu", "gpu") in the trace file ``trace``."""
    with gzip.open(trace, "rt") as f:
        document = json.load(f)
    events = document["traceEvents"] if isinstance(document, dict) else document
    module = re.match(r"HloModule ([\w.\-]+)", hlo_text)
    device, timed = _device_events(events, module.group(1) if module else "", platform)
    kinds = hlo_report.kernel_kinds(hlo_text)
    per_op: dict[str, list] = collections.defaultdict(lambda: ["", 0.0, 0, "", True])
    for e in timed:
        op = e.get("args", {}).get("hlo_op") or e["name"]
        if op not in kinds:  # a kernel XLA emitted for a fusion carries its name, "." made "_" ("loop_add_fusion_3")
            op = next((name for name in (e["name"], re.sub(r"_(\d+)$", r".\1", e["name"])) if name in kinds), op)
        kind, source = kinds.get(op, (None, ""))
        row = per_op[op]
        if kind is None:
            kind, row[4] = next((k for k, pattern in _NAMED_KINDS if pattern.search(e["name"])), "other"), False
        row[0], row[1], row[2], row[3] = kind, row[1] + e["dur"] / 1e3 / steps, row[2] + 1, source
    return (device, {op: OpTime(kind, ms, runs / steps, source, attributed)
                     for op, (kind, ms, runs, source, attributed) in per_op.items()},
            [(e["ts"], e["ts"] + e["dur"]) for e in timed])


def summarize(trace: Path, hlo_text: str, steps: int, mesh_shape: dict[str, int], platform: str) -> StepProfile:
    """The profile of ``steps`` steps of the program ``hlo_text`` (``Compiled.as_text()``, for a mesh of
    ``mesh_shape`` on ``platform``'s devices: "cpu", "gpu") in the Perfetto trace file ``trace``."""
    device, ops, intervals = op_times(trace, hlo_text, steps, platform)
    ms = {kind: sum(o.ms for o in ops.values() if o.kind == kind) for kind in KINDS}
    span = (max(end for _, end in intervals) - min(start for start, _ in intervals)) / 1e3 / steps if intervals else 0.0
    report = hlo_report.report(hlo_text, mesh_shape)
    flops, other_bytes = sum(report.matmul_flops.values()), report.kernel_bytes.get("other", 0.0)
    largest = sorted(((op, o.kind, o.ms, o.runs, o.source) for op, o in ops.items()), key=lambda r: -r[2])
    return StepProfile(steps, device, ms, _union_us(intervals) / 1e3 / steps, span,
                       sum(o.ms for o in ops.values() if not o.attributed),
                       flops / (ms["matmul"] * 1e-3) / 1e12 if flops and ms["matmul"] else None,
                       other_bytes / (ms["other"] * 1e-3) / 1e9 if other_bytes and ms["other"] else None,
                       tuple(largest[:LARGEST_OPS]))
