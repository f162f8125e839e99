"""What XLA made of the train step, read from the compiled program (``jaxtrain plan --hlo-report``).

The optimised, scheduled HLO text of the compiled step gives: every collective with its kind, the bytes
it carries per device, the mesh axes its device groups span, how often a step runs it (loop trip
counts: the layer scan, the micro-batch scan), whether it is asynchronous and has compute scheduled
between its start and its done (overlap); the number of fusions; the attention kernel (cuDNN's fused
attention is a custom call; XLA attention is plain fusions); the matmul FLOPs per step by the element types the
dots multiply (after XLA's converts: a float32 product in a bfloat16 program runs at TF32's rate at best); the
bytes each kind of kernel reads and writes per step (matmuls, attention, the elementwise and reduction rest: what
the rest moves, over the memory bandwidth, is step time no matmul speed recovers); and
the warnings XLA wrote while compiling
(e.g. ``[SPMD] Involuntary full rematerialization``). jax offers the HLO only as text, so it is parsed
here; what cannot be parsed is reported as unknown, never guessed.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import re
import sys
import tempfile
from collections.abc import Callable, Iterator

import numpy as np

from jaxtrain import compile_cache

COLLECTIVES = ("all-gather", "reduce-scatter", "all-reduce", "all-to-all", "collective-permute")
# instructions that do work on the device: scheduled between an async start and its done, they overlap it
COMPUTE_OPCODES = {"fusion", "fusion-start", "custom-call", "dot", "convolution", "while", "call", "conditional"}
DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "f8e4m3fn": 1, "f8e5m2": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2,
               "s32": 4, "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16}
# a fusion, and the start of one run asynchronously (jax 0.11's XLA; its done only waits for it)
FUSION_OPCODES = {"fusion", "fusion-start"}
# top-level instructions that run as kernels and move their operands and results through device memory
KERNEL_OPCODES = FUSION_OPCODES | {"custom-call", "copy", "transpose", "reduce", "scatter", "gather", "concatenate", "pad",
                  "convert", "select-and-scatter", "sort", "dot", "convolution", "dynamic-slice", "dynamic-update-slice"}
_SLICING = {"dynamic-slice", "slice", "gather"}
# the scratch a library call (cuBLAS, cuDNN) returns last in its result tuple: a byte array it need not write whole
_WORKSPACE = re.compile(r"\b[su]8\[\d*\](?:\{[^}]*\})?\)?$")
LARGEST_KERNELS = 5  # the "other" kernels (by XLA's op name) the report lists, most bytes first
# XLA's C++ log lines of severity warning or error start W or E and the date (absl's format)
WARNING_LINE = re.compile(r"^\s*[WE]\d{4} \d\d:\d\d|Involuntary full rematerialization|\bWARNING\b")
_BELOW_SCHEDULING_LIMIT = re.compile(r"Can't reduce memory use below ([\d.]+)GiB .*only reduced to ([\d.]+)GiB")


def warning_meaning(warning: str) -> str | None:
    """What an XLA warning the report knows means for the step, in a line; None for others."""
    if "Involuntary full rematerialization" in warning:
        return ("GSPMD reached a layout only by replicating a tensor whole on every device (its memory and traffic "
                "unsplit); the warning names the operation: a layout constraint before it, or another rule set, avoids it")
    if below := _BELOW_SCHEDULING_LIMIT.search(warning):
        return (f"the step needs {below[2]} GiB at its peak, above the {below[1]} GiB XLA's GPU compiler schedules for "
                "(its limit from the device's memory less the step's arguments and outputs, not jax's allocator pool): "
                "XLA recomputed what it could and ordered the step for memory before overlap (jax 0.11.2 also left "
                "collectives synchronous for llama3_70b on h100x64). It still runs where the pool holds the peak; more "
                "micro-batches or a stronger remat policy bring the peak under the limit")
    return None


_INSTRUCTION = re.compile(r"^\s+(?:ROOT )?%?([\w.\-]+) = (.*)$")
_COMPUTATION = re.compile(r"^(?:ENTRY )?%?([\w.\-]+) .*\{$")
_ARRAY = re.compile(r"\b([a-z]+\d*(?:e\d+m\d+(?:fn)?)?)\[([\d,]*)\]")


@dataclasses.dataclass(frozen=True)
class Instruction:
    name: str
    type: str
    opcode: str
    operands: tuple[str, ...]
    attributes: str
    literal: str = ""  # a parameter's number (the operand of its fusion it stands for), a constant's value


@dataclasses.dataclass(frozen=True)
class Collective:
    kind: str  # one of COLLECTIVES
    axes: tuple[str, ...] | None  # mesh axes its device groups span; None: groups not understood
    group_size: int
    tensors: int  # arrays it carries (XLA combines several into one collective)
    bytes: int  # per device per execution: the whole buffer (gathered, before scattering, or reduced)
    executions: int  # per step: the trip counts of the loops it sits in
    executions_known: bool  # False inside a loop XLA gives no trip count (one its loop pipelining peeled): a lower bound
    is_async: bool
    overlapped: bool  # compute scheduled between its start and its done
    dtypes: tuple[str, ...] = ()  # element type of each array it carries (XLA's names: f32, bf16, ...)
    senders: float = 1.0  # a collective permute: the share of the devices that send

    @property
    def traffic(self) -> float:
        """Bytes each device sends per step with ring algorithms, as step_cost counts them: an all-gather or
        reduce-scatter of N bytes over n devices N (n-1)/n, an all-reduce twice that; a collective permute N from
        each device that sends to another (averaged over the devices: a permute between half of them, N / 2)."""
        if self.kind == "collective-permute":
            return self.executions * self.bytes * self.senders
        n = self.group_size
        share = (n - 1) / n if n > 1 else 0.0
        return self.executions * self.bytes * share * (2 if self.kind == "all-reduce" else 1)


@dataclasses.dataclass(frozen=True)
class HloReport:
    collectives: tuple[Collective, ...]
    fusions: int
    attention: str  # "cudnn" (fused cuDNN kernel) or "xla"
    attention_calls: int  # cuDNN fused-attention custom calls (forward and backward)
    warnings: tuple[str, ...]
    # FLOPs per step of the dots, fused or not, by their operands' element types ("bf16 x bf16", "f32 x f32", ...)
    matmul_flops: dict[str, float] = dataclasses.field(default_factory=dict)
    # bytes read and written per step by the kernels of each kind ("matmul", "attention", "other"), and the largest
    # "other" kernels: (XLA's op name of the kernel's root, bytes per step)
    kernel_bytes: dict[str, float] = dataclasses.field(default_factory=dict)
    largest_other_kernels: tuple[tuple[str, float], ...] = ()
    # of matmul_flops: those run by a gemm library (cuBLAS) rather than XLA's own kernels, and those of products
    # computed a second time (the same two arrays multiplied again in the same computation)
    library_matmul_flops: float = 0.0
    duplicated_matmul_flops: float = 0.0
    # custom calls run per step by target: library kernels (cuBLAS, cuDNN) and kernels of jax's (Pallas: Triton
    # and Mosaic GPU), e.g. tokamax's grouped matmul ("__gpu$xla.gpu.triton")
    custom_calls: dict[str, float] = dataclasses.field(default_factory=dict)

    def groups(self) -> list[dict]:
        """The collectives by (kind, mesh axes): instructions, executions, bytes and traffic per step, async and
        overlapped counts."""
        out: dict[tuple, dict] = {}
        for c in self.collectives:
            row = out.setdefault((c.kind, c.axes), {"kind": c.kind, "axes": None if c.axes is None else list(c.axes),
                                                    "instructions": 0, "tensors": 0, "executions": 0, "bytes": 0,
                                                    "traffic_bytes": 0.0, "async": 0, "overlapped": 0,
                                                    "executions_known": True})
            row["instructions"] += 1
            row["tensors"] += c.tensors * c.executions
            row["executions"] += c.executions
            row["bytes"] += c.bytes * c.executions
            row["traffic_bytes"] += c.traffic
            row["async"] += c.is_async
            row["overlapped"] += c.overlapped
            row["executions_known"] &= c.executions_known
        return sorted(out.values(), key=lambda r: (COLLECTIVES.index(r["kind"]), r["axes"] or []))

    def traffic_by_step_cost_kind(self, batch_axes: tuple[str, ...], stage_axes: tuple[str, ...] = (),
                                  expert_axes: tuple[str, ...] = (), replica_axes: tuple[str, ...] = ()) -> dict[str, float]:
        """Traffic in step_cost's terms: collectives over pipeline stage axes are the pipeline's, all-gathers,
        reduce-scatters and all-to-alls over batch axes but no expert axis FSDP's (an all-to-all there: the embedding
        lookup's gradient to the table's columns), but all-gathers and reduce-scatters over ``replica_axes`` alone (batch
        axes that split no weight) data parallelism's: ZeRO-1/2's gathers of the updated weights and reduce-scatters of
        the gradients over the axes a rule set's optimizer_state / gradients section adds (they were counted as FSDP's,
        which step_cost's prediction was not); all-reduces over batch axes data parallelism's, all-to-alls,
        all-gathers and reduce-scatters over an expert axis expert parallelism's (tokens to their experts and back:
        jaxtrain/models/moe.py), collectives over other axes tensor parallelism's (an all-to-all over tensor among them: counted
        as the experts', it was left out of the printed comparison of a dense model, which predicts none)."""
        out = {"fsdp": 0.0, "data": 0.0, "tensor": 0.0}
        for c in self.collectives:
            on_batch = c.axes is not None and set(c.axes) <= set(batch_axes)
            scattered = c.kind in ("all-gather", "reduce-scatter") and not set(c.axes or ()) <= set(replica_axes)
            kind = ("fsdp" if scattered else "data") if on_batch else "tensor"
            by_expert = bool(set(c.axes or ()) & set(expert_axes))
            if c.kind == "all-to-all" or by_expert and c.kind in ("all-gather", "reduce-scatter"):
                kind = "expert" if by_expert else "fsdp" if on_batch else "tensor"
            if stage_axes and c.axes and set(c.axes) <= set(stage_axes):  # shifts, and the circular schedule's weights
                kind = "pipeline"
            out[kind] = out.get(kind, 0.0) + c.traffic
        return out

    def to_json(self) -> dict:
        return {"collectives": self.groups(), "fusions": self.fusions, "attention": self.attention,
                "attention_calls": self.attention_calls, "xla_warnings": list(self.warnings),
                "xla_warning_meanings": [warning_meaning(w) for w in self.warnings],
                "matmul_flops_by_operand_types": self.matmul_flops, "library_matmul_flops": self.library_matmul_flops,
                "duplicated_matmul_flops": self.duplicated_matmul_flops, "kernel_bytes_per_step": self.kernel_bytes,
                "largest_other_kernels": [{"op_name": name, "bytes": b} for name, b in self.largest_other_kernels],
                "custom_calls_per_step": self.custom_calls}


def _array_bytes(type_text: str) -> list[int]:
    return [DTYPE_BYTES.get(dtype, 0) * math.prod(int(d) for d in dims.split(",") if d) for dtype, dims in _ARRAY.findall(type_text)]


def _type_of(types: dict[str, str], operand: str) -> str:
    """The type of an operand: an instruction's name, or ``name#i``, element i of a tuple (jax 0.11's XLA writes
    that where 0.10's had a get-tuple-element)."""
    name, _, index = operand.partition("#")
    type_text = types.get(name, "")
    if not index or not type_text.startswith("("):
        return type_text
    inner, elements, depth, start = re.sub(r"/\*.*?\*/", "", type_text)[1:-1], [], 0, 0
    for i, ch in enumerate(inner):
        depth += {"(": 1, "{": 1, "[": 1, ")": -1, "}": -1, "]": -1}.get(ch, 0)
        if ch == "," and depth == 0:
            elements.append(inner[start:i])
            start = i + 1
    elements.append(inner[start:])
    return elements[int(index)].strip() if int(index) < len(elements) else ""


def _split_instruction(rest: str) -> tuple[str, str, str]:
    """``TYPE opcode(operands), attributes`` -> (type, opcode, after the opening parenthesis); the type may be a
    tuple with spaces and comments in it."""
    if rest.startswith("("):
        depth = 0
        for i, ch in enumerate(rest):
            depth += {"(": 1, ")": -1}.get(ch, 0)
            if depth == 0:
                break
        type_text, rest = rest[:i + 1], rest[i + 1:].lstrip()
    else:
        type_text, _, rest = rest.partition(" ")
    opcode, _, rest = rest.partition("(")
    return type_text, opcode.strip(), rest


def _operands_and_attributes(rest: str) -> tuple[tuple[str, ...], str]:
    depth = 1
    for i, ch in enumerate(rest):
        depth += {"(": 1, ")": -1, "{": 1, "}": -1}.get(ch, 0)
        if depth == 0:
            break
    return tuple(re.findall(r"%([\w.\-]+(?:#\d+)?)", rest[:i])), rest[i + 1:]


def parse_computations(text: str) -> dict[str, list[Instruction]]:
    """The module's computations, each its instructions in schedule order (the text of a scheduled module lists
    them so)."""
    computations: dict[str, list[Instruction]] = {}
    current = None
    for line in text.splitlines():
        if current is None:
            match = _COMPUTATION.match(line)
            if match and not line.startswith("HloModule"):
                current = computations.setdefault(match.group(1), [])
            continue
        if line.startswith("}"):
            current = None
            continue
        match = _INSTRUCTION.match(line)
        if match:
            type_text, opcode, rest = _split_instruction(match.group(2))
            operands, attributes = _operands_and_attributes(rest)
            literal = rest[:rest.index(")")] if opcode in ("parameter", "constant") and ")" in rest else ""
            current.append(Instruction(match.group(1), type_text, opcode, operands, attributes, literal))
    return computations


def device_groups(attributes: str, devices: int) -> list[list[int]] | None:
    """The device groups of a collective's ``replica_groups`` (explicit lists, iota ``[G,S]<=[dims]T(perm)``, or
    ``mesh['a'=2,'b'=4] {'b'}``) or ``source_target_pairs``; all devices when it names none; None when the
    notation is not understood."""
    match = re.search(r"replica_groups=\{(\{[\d,]*\}(?:,\{[\d,]*\})*)\}", attributes)
    if match:
        return [[int(i) for i in group.split(",") if i] for group in re.findall(r"\{([\d,]*)\}", match.group(1))]
    match = re.search(r"replica_groups=\[([\d,]+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?", attributes)
    if match:
        return _iota(match.group(2), match.group(3)).reshape([int(i) for i in match.group(1).split(",")]).tolist()
    # mesh['a'=2,'b'=4], device_ids=([dims]T(perm)) {'b'}: the devices (iota, or the order given) laid out on the
    # named axes, one group per position of the axes not in braces
    match = re.search(r"replica_groups=mesh\[([^\]]*)\](?:,\s*device_ids=\(\[([\d,]+)\](?:T\(([\d,]+)\))?\))?\s*\{([^}]*)\}", attributes)
    if match:
        sizes = re.findall(r"'([^']+)'=(\d+)", match.group(1))
        names = [name for name, _ in sizes]
        grouped = [names.index(a) for a in re.findall(r"'([^']+)'", match.group(4))]
        order = _iota(match.group(2), match.group(3)) if match.group(2) else np.arange(math.prod(int(s) for _, s in sizes))
        ids = order.reshape([int(s) for _, s in sizes])
        rest = [i for i in range(len(names)) if i not in grouped]
        ids = ids.transpose(rest + grouped)
        return ids.reshape(-1, math.prod(ids.shape[len(rest):])).tolist()
    match = re.search(r"source_target_pairs=\{(\{\d+,\d+\}(?:,\{\d+,\d+\})*)\}", attributes)
    if match:
        return [[int(a), int(b)] for a, b in re.findall(r"\{(\d+),(\d+)\}", match.group(1))]
    if "replica_groups=" in attributes and "replica_groups={}" not in attributes:
        return None
    return [list(range(devices))]


def _iota(dims: str, perm: str | None) -> np.ndarray:
    """XLA's iota device list ``[dims]T(perm)``, flattened."""
    ids = np.arange(math.prod(int(i) for i in dims.split(","))).reshape([int(i) for i in dims.split(",")])
    return (ids.transpose([int(i) for i in perm.split(",")]) if perm else ids).reshape(-1)


def mesh_axes(groups: list[list[int]] | None, mesh_shape: dict[str, int]) -> tuple[str, ...] | None:
    """The mesh axes along which the devices of any group differ (device i of the compiled program is the mesh's
    i-th device in row-major order)."""
    if groups is None:
        return None
    varying = set()
    for group in groups:
        coords = np.unravel_index(np.asarray(group), tuple(mesh_shape.values()))
        varying.update(i for i, row in enumerate(coords) if len(set(row.tolist())) > 1)
    return tuple(name for i, name in enumerate(mesh_shape) if i in varying)


def _multipliers(computations: dict[str, list[Instruction]], entry: str) -> dict[str, tuple[int, bool, str | None]]:
    """For each computation reached from ``entry``: how many times one step runs it (the product of the trip counts
    of the while loops around it), whether every one of those counts is known, and, for the body of an async
    start, the name of that start."""
    out = {entry: (1, True, None)}
    pending = [entry]
    while pending:
        name = pending.pop()
        times, known, _ = out[name]
        for ins in computations.get(name, []):
            trip = re.search(r'"known_trip_count":\{"n":"(\d+)"\}', ins.attributes)
            for key, callee in re.findall(r"\b(body|calls|to_apply|condition|branch_computations)=\{?%([\w.\-]+)", ins.attributes):
                if callee in out or callee not in computations or ins.opcode in FUSION_OPCODES:
                    continue
                looped = key in ("body", "condition")
                factor = int(trip.group(1)) if looped and trip else 1
                out[callee] = (times * factor, known and (trip is not None or not looped),
                               ins.name if ins.opcode == "async-start" else None)
                pending.append(callee)
    return out


def _done(computation: list[Instruction], start: str) -> tuple[Instruction | None, bool]:
    """The done of the async start named ``start``, and whether compute is scheduled between the two."""
    names = [ins.name for ins in computation]
    begin = names.index(start)
    for i in range(begin + 1, len(computation)):
        if start in computation[i].operands and computation[i].opcode.endswith("-done"):
            return computation[i], any(ins.opcode in COMPUTE_OPCODES for ins in computation[begin + 1:i])
    return None, False


def _library_call(ins: Instruction) -> str:
    """The target of a custom call (cuBLAS's ``__cublas$lt$matmul``, cuDNN's ``__cudnn$fmhaSoftmax``...), else ""."""
    target = re.search(r'custom_call_target="([^"]+)"', ins.attributes) if ins.opcode == "custom-call" else None
    return target.group(1) if target else ""


def _library_calls(computations: dict[str, list[Instruction]], ins: Instruction) -> Iterator[str]:
    """The library calls ``ins`` makes: its own, or those inside the fusion it is (XLA's dynamic-slice fusion wraps a
    cuBLAS gemm that reads a slice of a stack or writes into one)."""
    if ins.opcode in FUSION_OPCODES:
        for inner in computations.get(_callee(ins), []):
            yield from _library_calls(computations, inner)
    elif _library_call(ins):
        yield _library_call(ins)


def _is_gemm(ins: Instruction) -> bool:
    """A dot or convolution, or a call of a gemm library (cuBLAS: XLA's choice for a dot where its autotuner finds
    it faster than its own kernel, and always with ``--xla_gpu_enable_triton_gemm=false``)."""
    return ins.opcode in ("dot", "convolution") or bool(re.search(r"gemm|matmul", _library_call(ins)))


def _gemm_flops(ins: Instruction, types: dict[str, str]) -> tuple[str, float]:
    """("LHS x RHS" element types, FLOPs) of one dot or library gemm."""
    (lhs, lhs_dims), (rhs, _) = (match.groups() if (match := _ARRAY.search(_type_of(types, o))) else ("?", "")
                                 for o in ins.operands[:2])
    # a dot's attribute, or a library gemm's backend config (JSON: "lhs_contracting_dimensions":["1"])
    contracting = re.search(r'lhs_contracting_dims=\{([\d,]*)\}|"lhs_contracting_dimensions":\[([^\]]*)\]', ins.attributes)
    shape = [int(d) for d in lhs_dims.split(",") if d]
    depth = math.prod(shape[int(i)] for i in re.findall(r"\d+", (contracting.group(1) or contracting.group(2)) if contracting else ""))
    # a library gemm returns (result, workspace): the result is the first array
    outputs = math.prod(int(d) for d in _ARRAY.search(ins.type).group(2).split(",") if d)
    return f"{lhs} x {rhs}", 2.0 * outputs * depth


def _callee(ins: Instruction, opcodes: set[str] = FUSION_OPCODES) -> str:
    """The computation a fusion (or another of ``opcodes``) runs, else ""."""
    callee = re.search(r"calls=%?([\w.\-]+)", ins.attributes) if ins.opcode in opcodes else None
    return callee.group(1) if callee else ""


def _gemms(computations: dict[str, list[Instruction]], name: str) -> Iterator[tuple[Instruction, str, float]]:
    """(the instruction, "LHS x RHS" element types, FLOPs) of each dot and library gemm in computation ``name`` and
    in the fusions it calls."""
    instructions = computations.get(name, [])
    types = {ins.name: ins.type for ins in instructions}
    for ins in instructions:
        if ins.opcode in FUSION_OPCODES:
            yield from _gemms(computations, _callee(ins))
        elif ins.opcode != "convolution" and _is_gemm(ins) and len(ins.operands) >= 2:
            yield ins, *_gemm_flops(ins, types)


def _operand_form(computations: dict[str, list[Instruction]], operand: str, local: dict[str, Instruction],
                  outer: Callable[[int], str] | None = None, scope: str = "") -> str:
    """What ``operand`` is, written so that two reads of the same data compare equal: looking through bitcasts, a
    fusion's parameters (``outer(i)``: the form of the fusion's operand i), constants (their value), dynamic slices
    (of what, where) and fusions that only slice or bitcast their operands. Anything computed is its own name, inside
    a fusion prefixed by ``scope`` (the fusion's name: fusions may share one body). Operands are resolved only as far
    as a form needs them: a step's program is a deep graph of fusions."""
    name = operand.partition("#")[0]
    ins = local.get(name)
    if ins is None or (ins.opcode == "parameter" and outer is None):
        return operand
    if ins.opcode == "parameter":
        return outer(int(ins.literal)) if ins.literal.isdigit() else scope + operand
    if ins.opcode == "constant":
        return f"{ins.type.partition('{')[0]} {ins.literal}"
    if ins.opcode == "bitcast":
        return _operand_form(computations, ins.operands[0], local, outer, scope)
    if ins.opcode == "dynamic-slice":
        sizes = re.search(r"dynamic_slice_sizes=\{([\d,]*)\}", ins.attributes)
        starts = ", ".join(_operand_form(computations, o, local, outer, scope) for o in ins.operands)
        return f"ds({starts}; {sizes and sizes.group(1)})"
    if ins.opcode in ("async-done", "fusion-done") and ins.operands and ins.operands[0] in local:
        ins = local[ins.operands[0]]  # jax 0.11's asynchronous kernels: the start runs the computation
    body = computations.get(_callee(ins, FUSION_OPCODES | {"async-start"}), [])
    if body and "#" not in operand:
        inner = f"{scope}{ins.name}/"
        form = _operand_form(computations, body[-1].name, {i.name: i for i in body},
                             _operands_of(computations, ins, local, outer, scope), inner)
        if not form.startswith(inner):  # the fusion only slices or bitcasts its operands
            return form
    return scope + operand


def _operands_of(computations: dict[str, list[Instruction]], ins: Instruction, local: dict[str, Instruction],
                 outer: Callable[[int], str] | None, scope: str) -> Callable[[int], str]:
    """``outer`` for the body of fusion ``ins``: the form of its operand i, or its own name past the last one."""
    return lambda i: _operand_form(computations, ins.operands[i], local, outer, scope) if i < len(ins.operands) \
        else f"{scope}{ins.name}/{i}"


def _duplicated_flops(computations: dict[str, list[Instruction]], name: str) -> float:
    """FLOPs of the gemms in computation ``name`` that multiply the same data as another one there (``_operand_form``),
    directly or inside a fusion: the same product computed twice. jax 0.11's XLA does this where a cuBLAS gemm's
    result is also saved into the layer scan's stacks: its dynamic-slice fusion computes the gemm again to write into
    the stack."""
    seen: set[tuple] = set()
    duplicated = 0.0
    gemms = {g.name: flops for g, _, flops in _gemms(computations, name)}  # top-level ones and those in fusions
    top = {i.name: i for i in computations.get(name, [])}
    for ins in computations.get(name, []):
        body = _fusion_body(computations, ins)
        if body:
            outer, local = _operands_of(computations, ins, top, None, ""), {i.name: i for i in body}
            products = [(tuple(_operand_form(computations, o, local, outer, f"{ins.name}/") for o in g.operands[:2]),
                         gemms[g.name]) for g in body if g.name in gemms]
        else:
            products = [(tuple(_operand_form(computations, o, top) for o in ins.operands[:2]), gemms[ins.name])] \
                if ins.name in gemms else []
        for product in products:
            duplicated += product[1] if product in seen else 0.0
            seen.add(product)
    return duplicated


def _fusion_body(computations: dict[str, list[Instruction]], ins: Instruction) -> list[Instruction]:
    return computations.get(_callee(ins), [])


def _kernel_kind(computations: dict[str, list[Instruction]], ins: Instruction) -> str:
    """"matmul" (a dot or convolution, fused or not, or a library gemm, also inside XLA's dynamic-slice fusion, which
    lets cuBLAS write into a slice of the layer scan's stacks), "attention" (cuDNN's fused attention) or "other"
    (elementwise, reductions, copies) for one top-level kernel."""
    if _is_gemm(ins) or any(_is_gemm(i) for i in _fusion_body(computations, ins)):
        return "matmul"
    return "attention" if "fmha" in _library_call(ins) else "other"


def kernel_kinds(hlo_text: str) -> dict[str, tuple[str, str]]:
    """Every instruction of the module by name (what a profile's events name in their ``hlo_op``): its kind as a
    kernel ("matmul", "attention", "other" as in ``kernel_bytes``, or "collective"; "other" too for what runs no
    kernel of its own) and the jax operation it came from (XLA's ``op_name``, "" where it has none)."""
    computations = parse_computations(hlo_text)
    out = {}
    for instructions in computations.values():
        for ins in instructions:
            if re.sub(r"-(start|done|update)$", "", ins.opcode) in COLLECTIVES:
                kind = "collective"
            else:
                kind = _kernel_kind(computations, ins) if ins.opcode in KERNEL_OPCODES else "other"
            source = re.search(r'op_name="([^"]*)"', ins.attributes)
            out[ins.name] = (kind, source.group(1) if source else "")
    return out


def _kernel(computations: dict[str, list[Instruction]], ins: Instruction, types: dict[str, str]) -> tuple[str, int]:
    """(kind, bytes read and written) of one top-level kernel. A fusion reads each parameter whole unless it only
    slices it (then the slices: the loss picking each target's logit reads one a token) or only updates a slice of
    it in place, at its root, writing only the update (the layer scan reads and writes one layer of its stacks
    so); either directly or through bitcasts (jax 0.11's XLA bitcasts the stack before updating it)."""
    kind, body = _kernel_kind(computations, ins), _fusion_body(computations, ins)
    if not body:
        written = _array_bytes(ins.type)
        if _library_call(ins) and _WORKSPACE.search(ins.type):
            written = written[:-1]
        return kind, sum(sum(_array_bytes(_type_of(types, o))) for o in ins.operands) + sum(written)
    local = {i.name: i for i in body}
    users: dict[str, list[Instruction]] = {}
    for i in body:
        for o in i.operands:
            users.setdefault(o, []).append(i)

    def through_bitcasts(name: str) -> list[tuple[str, Instruction]]:
        """(the operand's name, its user) for each instruction that reads ``name``, looking past bitcasts."""
        return [pair for u in users.get(name, []) for pair in (through_bitcasts(u.name) if u.opcode == "bitcast" else [(name, u)])]

    moved = 0
    for i in body:
        if i.opcode != "parameter":
            continue
        reads = through_bitcasts(i.name)
        if reads and all(u.opcode in _SLICING and u.operands[0] == read for read, u in reads):
            moved += sum(sum(_array_bytes(u.type)) for _, u in reads)
        elif not (reads and all(u.opcode == "dynamic-update-slice" and u.operands[0] == read for read, u in reads)):
            moved += sum(_array_bytes(i.type))
    root = body[-1]
    for result in ([local[o] for o in root.operands if o in local] if root.opcode == "tuple" else [root]):
        if result.opcode == "get-tuple-element" and result.operands[0] in local and _library_call(local[result.operands[0]]) \
                and _WORKSPACE.search(result.type):
            continue
        written = result
        while written.opcode == "bitcast" and written.operands[0] in local:
            written = local[written.operands[0]]
        in_place = written.opcode == "dynamic-update-slice" and written.operands[1] in local
        moved += sum(_array_bytes(local[written.operands[1]].type if in_place else result.type))
    return kind, moved


def report(hlo_text: str, mesh_shape: dict[str, int], log: str = "") -> HloReport:
    """Read the compiled step's HLO text (``Compiled.as_text()``) for a mesh of ``mesh_shape``; ``log``: what XLA
    wrote while compiling it."""
    computations = parse_computations(hlo_text)
    entry_match = re.search(r"^ENTRY %?([\w.\-]+)", hlo_text, re.MULTILINE)
    entry = entry_match.group(1) if entry_match else next(iter(computations))
    reached = _multipliers(computations, entry)
    types = {ins.name: ins.type for instructions in computations.values() for ins in instructions}
    where = {ins.name: comp for comp, instructions in computations.items() for ins in instructions}
    devices = math.prod(mesh_shape.values())
    collectives = []
    fusions = attention_calls = 0
    matmul_flops: dict[str, float] = {}
    library_flops = duplicated_flops = 0.0
    kernel_bytes = {"matmul": 0.0, "attention": 0.0, "other": 0.0}
    other_kernels: dict[str, float] = {}
    custom_calls: dict[str, float] = {}
    for comp, (times, known, async_start) in reached.items():
        for gemm, operand_types, flops in _gemms(computations, comp):
            matmul_flops[operand_types] = matmul_flops.get(operand_types, 0.0) + times * flops
            library_flops += times * flops if _library_call(gemm) else 0.0
        duplicated_flops += times * _duplicated_flops(computations, comp)
        for ins in computations[comp]:
            fusions += ins.opcode in FUSION_OPCODES
            if ins.opcode in KERNEL_OPCODES:
                kernel_kind, moved = _kernel(computations, ins, types)
                kernel_bytes[kernel_kind] += times * moved
                if kernel_kind == "other":
                    name = re.search(r'op_name="([^"]*)"', ins.attributes)
                    key = name.group(1) if name else ins.name
                    other_kernels[key] = other_kernels.get(key, 0.0) + times * moved
            for call in _library_calls(computations, ins):
                attention_calls += "fmha" in call
                custom_calls[call] = custom_calls.get(call, 0.0) + times
            kind = ins.opcode.removesuffix("-start")
            if kind not in COLLECTIVES:
                continue
            operand_bytes = sum(sum(_array_bytes(_type_of(types, o))) for o in ins.operands)
            if ins.opcode.endswith("-start"):  # its done holds the results
                done, overlapped = _done(computations[comp], ins.name)
                is_async, result = done is not None, _array_bytes(done.type if done else ins.type)
            else:
                done, overlapped = _done(computations[where[async_start]], async_start) if async_start else (None, False)
                is_async, result = done is not None, _array_bytes(ins.type)
            full = operand_bytes if kind == "reduce-scatter" else sum(result)
            groups = device_groups(ins.attributes, devices)
            dtypes = tuple(dtype for dtype, _ in _ARRAY.findall(done.type if is_async and ins.opcode.endswith("-start") else ins.type))
            # a device's pair with itself moves nothing (XLA lists one for each device a layout change leaves in place)
            moving = groups if kind == "collective-permute" and groups else None
            senders = len({source for source, target in moving if source != target}) / devices if moving else 1.0
            collectives.append(Collective(kind, mesh_axes(groups, mesh_shape), len(groups[0]) if groups else 0, len(result),
                                          full, times, known, is_async, overlapped, dtypes, senders))
    warnings = tuple(dict.fromkeys(line.strip() for line in log.splitlines() if WARNING_LINE.search(line)))
    largest = tuple(sorted(other_kernels.items(), key=lambda item: -item[1])[:LARGEST_KERNELS])
    return HloReport(tuple(collectives), fusions, "cudnn" if attention_calls else "xla", attention_calls, warnings,
                     dict(sorted(matmul_flops.items(), key=lambda item: -item[1])), kernel_bytes, largest, library_flops,
                     duplicated_flops, dict(sorted(custom_calls.items(), key=lambda item: -item[1])))


def partitioned_hlo(lowered) -> str:
    """The HLO text of a lowered step right after XLA's SPMD partitioner: its collectives in the element types the program
    asks for, before a backend rewrites them (XLA:CPU promotes bfloat16 all-reduces to float32; a GPU keeps them).
    Compiled without the persistent cache: a program read back from it runs no passes, so nothing is dumped."""
    with tempfile.TemporaryDirectory() as dump, compile_cache.using(False):
        lowered.compile(compiler_options={"xla_dump_to": dump, "xla_dump_hlo_pass_re": "spmd-partitioning"})
        (path,) = [name for name in os.listdir(dump) if "after_spmd-partitioning" in name]
        with open(os.path.join(dump, path)) as f:
            return f.read()


@contextlib.contextmanager
def captured_stderr() -> Iterator[list[str]]:
    """Capture what is written to file descriptor 2 inside the block, XLA's C++ logging included; the list yielded
    receives the text at the end, and the text is written on to the real stderr so nothing is hidden."""
    out: list[str] = []
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile(mode="w+b") as sink:
        os.dup2(sink.fileno(), 2)
        try:
            yield out
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            sink.seek(0)
            text = sink.read().decode(errors="replace")
            out.append(text)
            if text:
                sys.stderr.write(text)
                sys.stderr.flush()
