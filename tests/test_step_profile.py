"""Where a profiled step's device time went (jaxtrain.observe.step_profile): a GPU-shaped trace, written here as
jax's profiler writes one on a GPU, summed by the kinds the compiled program gives its ops. The CPU traces of real
runs: tests/test_observability.py."""

import gzip
import json
import os
import socket

import pytest

from jaxtrain.observe import step_profile
from jaxtrain.plan import hlo_report

# the patterns of XLA's GPU program (tests/test_plan_gpu.py reads a real one): Triton gemm fusions, cuDNN's
# attention custom call, elementwise fusions, an asynchronous all-gather, a layer loop of two trips
HLO = """HloModule jit_train_step, is_scheduled=true

%gemm_fusion_dot.1_computation (p0: bf16[64,32], p1: bf16[32,16]) -> bf16[64,16] {
  %p0 = bf16[64,32]{1,0} parameter(0)
  %p1 = bf16[32,16]{1,0} parameter(1)
  ROOT %dot.1 = bf16[64,16]{1,0} dot(%p0, %p1), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

%fused_add (p0: f32[64,16]) -> f32[64,16] {
  %p0 = f32[64,16]{1,0} parameter(0)
  ROOT %add.1 = f32[64,16]{1,0} add(%p0, %p0)
}

%body (carry: (s32[], bf16[64,32], bf16[32,16])) -> (s32[], bf16[64,32], bf16[32,16]) {
  %carry = (s32[], bf16[64,32]{1,0}, bf16[32,16]{1,0}) parameter(0)
  %i = s32[] get-tuple-element(%carry), index=0
  %x = bf16[64,32]{1,0} get-tuple-element(%carry), index=1
  %w = bf16[32,16]{1,0} get-tuple-element(%carry), index=2
  %gemm_fusion_dot.1 = bf16[64,16]{1,0} fusion(%x, %w), kind=kCustom, calls=%gemm_fusion_dot.1_computation, metadata={op_name="jit(train_step)/while/body/mlp/dot_general"}
  ROOT %out = (s32[], bf16[64,32]{1,0}, bf16[32,16]{1,0}) tuple(%i, %x, %w)
}

%cond (carry: (s32[], bf16[64,32], bf16[32,16])) -> pred[] {
  %carry = (s32[], bf16[64,32]{1,0}, bf16[32,16]{1,0}) parameter(0)
  ROOT %t = pred[] constant(true)
}

ENTRY %main (a: bf16[64,32], b: bf16[32,16], c: f32[64,16], q: bf16[2,4,64,8]) -> f32[64,16] {
  %a = bf16[64,32]{1,0} parameter(0)
  %b = bf16[32,16]{1,0} parameter(1)
  %c = f32[64,16]{1,0} parameter(2)
  %q = bf16[2,4,64,8]{3,2,1,0} parameter(3)
  %zero = s32[] constant(0)
  %init = (s32[], bf16[64,32]{1,0}, bf16[32,16]{1,0}) tuple(%zero, %a, %b)
  %while.1 = (s32[], bf16[64,32]{1,0}, bf16[32,16]{1,0}) while(%init), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"2"}}
  %all-gather-start.1 = (bf16[32,16]{1,0}, bf16[64,16]{1,0}) all-gather-start(%b), replica_groups={{0}}, dimensions={0}
  %dot_product_attention_fwd.0 = (bf16[2,4,64,8]{3,2,1,0}, u8[0]{0}) custom-call(%q, %q, %q), custom_call_target="__cudnn$fmhaSoftmax"
  %all-gather-done.1 = bf16[64,16]{1,0} all-gather-done(%all-gather-start.1)
  %loop_add_fusion.7 = f32[64,16]{1,0} fusion(%c), kind=kLoop, calls=%fused_add
  ROOT %loop_add_fusion = f32[64,16]{1,0} fusion(%c), kind=kLoop, calls=%fused_add, metadata={op_name="jit(train_step)/add"}
}
"""

GPU0, GPU1, HOST = 10, 11, 1
COMPUTE, NCCL, DERIVED = 7, 9, 99
STEPS = 2


def _kernel(ts, dur, name, op=None, module="jit_train_step", pid=GPU0, tid=COMPUTE):
    args = {} if op is None else {"hlo_op": op, "hlo_module": module}
    return {"ph": "X", "pid": pid, "tid": tid, "ts": ts, "dur": dur, "name": name, "args": args}


def _trace(path, stream_names=("Stream #7(Compute)", "Stream #9(Nccl)")):
    meta = [{"ph": "M", "name": "process_name", "pid": pid, "args": {"name": name}}
            for pid, name in ((HOST, "/host:CPU"), (GPU0, "/device:GPU:0"), (GPU1, "/device:GPU:1"))]
    meta += [{"ph": "M", "name": "thread_name", "pid": GPU0, "tid": tid, "args": {"name": name}}
             for tid, name in ((COMPUTE, stream_names[0]), (NCCL, stream_names[1]), (DERIVED, "XLA Ops"))]
    events = []
    for step in range(STEPS):  # one step every 1000 us, microseconds as the trace has them
        t = 1000.0 * step
        events += [
            _kernel(t + 0, 100, "nvjet_tst_128x64_64x4_bz_TNT", "gemm_fusion_dot.1"),  # layer 1 (the loop)
            _kernel(t + 100, 100, "nvjet_tst_128x64_64x4_bz_TNT", "gemm_fusion_dot.1"),  # layer 2
            _kernel(t + 150, 300, "ncclDevKernel_AllGather_RING_LL", "all-gather-start.1", tid=NCCL),  # overlaps
            _kernel(t + 250, 200, "cudnn_generated_fort_native_sdpa_sm90", "dot_product_attention_fwd.0"),
            _kernel(t + 500, 50, "loop_add_fusion", "loop_add_fusion"),
            _kernel(t + 560, 20, "sm90_xmma_gemm_bf16bf16", "command_buffer.3"),  # inside a CUDA graph: by name
            _kernel(t + 590, 5, "loop_add_fusion_7", "command_buffer.3"),  # XLA's kernel for the fusion loop_add_fusion.7
            _kernel(t + 600, 10, "Memset (Device)"),  # the runtime's: no op, no module
            _kernel(t + 700, 300, "loop_add_fusion", "loop_add_fusion", module="jit_eval_step"),  # another program
            _kernel(t + 0, 999, "gemm_fusion_dot.1", "gemm_fusion_dot.1", tid=DERIVED),  # the profiler's own line
            _kernel(t + 0, 999, "gemm_fusion_dot.1", "gemm_fusion_dot.1", pid=GPU1),  # the other device
            _kernel(t + 0, 999, "gemm_fusion_dot.1", "gemm_fusion_dot.1", pid=HOST, tid=1),  # the host's launch
        ]
    with gzip.open(path, "wt") as f:
        json.dump({"displayTimeUnit": "ns", "traceEvents": meta + events}, f)
    return path


def test_kernel_kinds_of_the_gpu_program():
    kinds = hlo_report.kernel_kinds(HLO)
    assert kinds["gemm_fusion_dot.1"] == ("matmul", "jit(train_step)/while/body/mlp/dot_general")
    assert kinds["dot_product_attention_fwd.0"] == ("attention", "")
    assert kinds["loop_add_fusion"] == ("other", "jit(train_step)/add")
    assert kinds["all-gather-start.1"][0] == kinds["all-gather-done.1"][0] == "collective"
    assert kinds["while.1"] == kinds["a"] == ("other", "")  # a loop, a parameter: named, no kernel of their own
    assert "command_buffer.3" not in kinds


# the profiler's names for a GPU's stream lines, and other names (then only the lines it derives are left out)
@pytest.mark.parametrize("stream_names", [("Stream #7(Compute)", "Stream #9(Nccl)"), ("Compute", "")])
def test_gpu_trace_summed_by_kind_per_step(tmp_path, stream_names, monkeypatch):
    (tmp_path / "plugins" / "profile" / "run").mkdir(parents=True)
    trace = _trace(tmp_path / "plugins" / "profile" / "run" / "host.trace.json.gz", stream_names)
    assert step_profile.trace_file(tmp_path) == trace
    other_host = _trace(tmp_path / "plugins" / "profile" / "run" / "other-host.trace.json.gz")
    os.utime(other_host, (trace.stat().st_mtime + 1,) * 2)  # written last
    assert step_profile.trace_file(tmp_path) == other_host
    monkeypatch.setattr(socket, "gethostname", lambda: "host")
    assert step_profile.trace_file(tmp_path) == trace
    profile = step_profile.summarize(trace, HLO, STEPS, {"fsdp": 1}, "gpu")
    assert profile.device == "/device:GPU:0" and profile.steps == STEPS
    # microseconds per step -> ms: the two gemm runs plus the CUDA graph's gemm (by its name), cuDNN, the fusions (one
    # by its kernel's name) plus the memset; the other program, the derived line, the other device, the host: not counted
    assert profile.ms_by_kind == pytest.approx({"matmul": 0.22, "attention": 0.2, "other": 0.065, "collective": 0.3})
    assert profile.unattributed_ms == pytest.approx(0.03)
    assert profile.span_ms == pytest.approx(1.61 / STEPS)  # 0 .. 1610 us: the wait for the second step is idle too
    # 0 .. 450 (the all-gather under the gemms and cuDNN), 500 .. 550, 560 .. 580, 590 .. 595, 600 .. 610
    assert profile.busy_ms == pytest.approx(0.535)
    assert profile.idle_ms == pytest.approx(0.805 - 0.535)
    # the loop's two trips of a 64 x 32 x 16 product per step, over the matmul kernels' time
    assert profile.matmul_tflops == pytest.approx(2 * 2 * 64 * 32 * 16 / 0.22e-3 / 1e12)
    assert profile.other_gb_per_s == pytest.approx(2 * 2 * 64 * 16 * 4 / 0.065e-3 / 1e9)  # each fusion 4 KiB in, 4 out
    ops = {op: (kind, ms, runs, source) for op, kind, ms, runs, source in profile.largest_ops}
    assert ops["gemm_fusion_dot.1"] == ("matmul", pytest.approx(0.2), 2.0, "jit(train_step)/while/body/mlp/dot_general")
    assert ops["loop_add_fusion.7"] == ("other", pytest.approx(0.005), 1.0, "")
    assert profile.largest_ops[0][0] == "all-gather-start.1"
    assert {op for op, *_ in profile.largest_ops[1:3]} == {"dot_product_attention_fwd.0", "gemm_fusion_dot.1"}
    assert json.loads(json.dumps(profile.to_json()))["idle_ms_per_step"] == pytest.approx(0.27)
    first, second = profile.lines()
    assert "span 0.8 ms" in first and "idle 0.3 ms (34%)" in first and "matmul 0.2 ms (27%)" in first and "mlp/dot_general" in second


def test_no_trace_or_no_gpu_events_are_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match=str(tmp_path)):
        step_profile.trace_file(tmp_path)
    # a GPU run whose trace holds only the host's side (no CUPTI): its launch events are not the device's time
    host_only = tmp_path / "host.trace.json.gz"
    with gzip.open(host_only, "wt") as f:
        json.dump([{"ph": "M", "name": "process_name", "pid": HOST, "args": {"name": "/host:CPU"}},
                   _kernel(0, 999, "gemm_fusion_dot.1", "gemm_fusion_dot.1", pid=HOST, tid=1)], f)
    with pytest.raises(ValueError, match="no events of a gpu device"):
        step_profile.summarize(host_only, HLO, 1, {"fsdp": 1}, "gpu")
    assert step_profile.summarize(host_only, HLO, 1, {"fsdp": 1}, "cpu").ms_by_kind["matmul"] == pytest.approx(0.999)


def test_the_largest_ops_line_names_an_op_by_the_end_of_its_source_with_matched_brackets():
    combined = "(jit(train_step)/attention/einsum(btd,dhk->bthk/dot_general):jit(train_step)/mlp/dot_general))"
    profile = step_profile.StepProfile(1, "/device:GPU:0", dict.fromkeys(step_profile.KINDS, 0.0), 1.0, 1.0, 0.0, None, None,
                                       (("all-reduce.192", "collective", 0.5, 1.0, combined),
                                        ("gemm.1", "matmul", 0.25, 2.0, "jit(train_step)/jvp(while)/body/mlp/dot_general")))
    assert profile.lines()[1] == ("largest ops per step: all-reduce.192 (collective: mlp/dot_general) 0.50 ms, "
                                  "gemm.1 (matmul: mlp/dot_general) 0.25 ms")

