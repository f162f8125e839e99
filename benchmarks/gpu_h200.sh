#!/usr/bin/env bash
# Throughput on one H200 (< 8 minutes): each experiment at seq 4096, bf16 compute, cuDNN attention, for
# each remat policy in REMATS (the best is the fastest one that fits); one JSON line per run with
# TFLOP/s per device and MFU against 989 TFLOP/s (dense bf16), collected in benchmarks/results/gpu_h200.jsonl.
#
#   benchmarks/gpu_h200.sh                        # llama3_1b llama3_3b generate
#   benchmarks/gpu_h200.sh llama3_1b              # just one
#   benchmarks/gpu_h200.sh generate               # generation: KV-cache prefill and decode tokens/s of llama3_1b
#                                                 # (bf16 weights, prompt 512, 256 new tokens, batch 1 and 8)
#   ATTENTION=xla STEPS=2 benchmarks/gpu_h200.sh  # planner check: XLA attention (the estimate's model), memory
#                                                 # predicted (estimate, compiled) vs measured (memory_stats peak)
#   TINY=1 benchmarks/gpu_h200.sh                 # the same runs, tiny shapes, on CPU: checks the script
#   REMATS= benchmarks/gpu_h200.sh                # only the Hugging Face import / export row (NO_HF=1: without it)
#
# A run that fails (e.g. out of memory for a remat policy) is reported and the others go on.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
OUT=${OUT:-benchmarks/results/gpu_h200.jsonl}
REMATS=${REMATS:-save_dots full}
SEQ=${SEQ:-4096}
LOSS_CHUNK=${LOSS_CHUNK:-0}  # e.g. 512: chunked cross-entropy, less memory for a ~7% extra lm_head forward
# single-device flags; the latency-hiding scheduler overlaps the collectives of multi-GPU meshes
export XLA_FLAGS="${XLA_FLAGS:-} --xla_gpu_enable_latency_hiding_scheduler=true"
if [ "$#" -eq 0 ]; then set -- llama3_1b llama3_3b generate; fi

shape=(data.seq_len="$SEQ" model.dtype=bfloat16 model.attention="${ATTENTION:-cudnn}" train.microbatches=1 train.loss_chunk="$LOSS_CHUNK")
generate=(--prompt-tokens 512 --new-tokens 256 model.param_dtype=bfloat16)
mesh=gpu1
if [ -n "${TINY:-}" ]; then
  export JAX_PLATFORMS=cpu
  shape=(data.seq_len=64 model.dtype=float32 model.attention=xla train.microbatches=1 train.global_batch=2 train.loss_chunk=16
         model.vocab_size=512 model.d_model=64 model.num_layers=2 model.num_heads=4 model.num_kv_heads=2 model.mlp_dim=128)
  generate=(--prompt-tokens 16 --new-tokens 8)
fi

mkdir -p "$(dirname "$OUT")"
failed=0
for experiment in "$@"; do
  if [ "$experiment" = generate ]; then
    for batch in 1 8; do
      echo "== generate llama3_1b batch=$batch" >&2
      if ! timeout "${RUN_TIMEOUT:-240}" "$PY" benchmarks/bench_generate.py llama3_1b --mesh "$mesh" --rules fsdp --batch "$batch" \
          "${shape[@]}" "${generate[@]}" | tee -a "$OUT"; then
        echo "== generate batch=$batch FAILED" >&2
        failed=1
      fi
    done
    continue
  fi
  # sequences per step on one device: the most that fits with save_dots at seq 4096 (141 GB)
  case "$experiment" in llama3_1b) batch=8 ;; *) batch=4 ;; esac
  for remat in $REMATS; do
    echo "== $experiment remat=$remat" >&2
    if ! timeout "${RUN_TIMEOUT:-240}" "$PY" benchmarks/throughput.py "$experiment" --mesh "$mesh" --rules fsdp --steps "${STEPS:-8}" \
        train.global_batch="$batch" model.remat="$remat" "${shape[@]}" | tee -a "$OUT"; then
      echo "== $experiment remat=$remat FAILED" >&2
      failed=1
    fi
  done
done
# Hugging Face import / export of a random llama3_1b-shaped model (1.24B parameters, 5 GB in float32) onto
# the GPU and back: seconds and peak host RSS growth of each, beside the safetensors library's own whole
# read and save (benchmarks/bench_hf.py).
if [ -z "${NO_HF:-}" ]; then
  echo "== hf import/export llama3_1b" >&2
  hf_shape=()
  if [ -n "${TINY:-}" ]; then hf_shape=(model.vocab_size=512 model.d_model=64 model.num_layers=2 model.num_heads=4 model.num_kv_heads=2 model.mlp_dim=128); fi
  if ! timeout "${RUN_TIMEOUT:-240}" "$PY" benchmarks/bench_hf.py llama3_1b --mesh "$mesh" --rules fsdp "${hf_shape[@]}" | tee -a "$OUT"; then
    echo "== hf import/export FAILED" >&2
    failed=1
  fi
fi
exit $failed
