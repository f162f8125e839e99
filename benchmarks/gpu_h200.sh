#!/usr/bin/env bash
# The one command for a lent GPU machine that starts bare (its own Python and jax, no .venv, no network):
#
#   make gpu-wheels                          # here, once: the missing packages as wheels in .whl/ (git-ignored)
#   benchmarks/gpu_h200.sh                   # there (the device tool: carry .whl): every row within 540 s
#   benchmarks/gpu_h200.sh --only mfu_1b     # arguments go to benchmarks/gpu_h200.py (--budget-s, --steps)
#   TINY=1 benchmarks/gpu_h200.sh            # tiny shapes on CPU: checks this script and the rows (make gpu-dry-run)
#
# 1. installs the wheels of $WHEELS (default .whl) into $SITE (default /tmp/site), no index, no dependencies;
# 2. puts $SITE and this checkout on PYTHONPATH;
# 3. stops at once (status 3) unless jax sees a GPU, rather than measuring the CPU (TINY=1: runs on the CPU);
# 4. runs benchmarks/gpu_h200.py: one JSON line per row in $OUT/gpu_h200.jsonl where the device tool sets OUT,
#    else benchmarks/results/gpu_h200.jsonl.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-python3}
WHEELS=${WHEELS:-.whl}
SITE=${SITE:-/tmp/site}
if compgen -G "$WHEELS/*.whl" >/dev/null; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" "$WHEELS"/*.whl
fi
export PYTHONPATH="$SITE:$PWD${PYTHONPATH:+:$PYTHONPATH}"
args=()
if [ -n "${TINY:-}" ]; then
  export JAX_PLATFORMS=cpu
  args+=(--tiny)
else
  "$PY" -c 'import jax, sys
d = jax.devices()
if d[0].platform != "gpu":
    sys.exit(f"gpu_h200.sh: jax sees no GPU (devices: {d}); stopping rather than measuring the CPU")
print(f"gpu_h200.sh: {len(d)} x {d[0].device_kind}, jax {jax.__version__}", file=sys.stderr)' || exit 3
fi
exec "$PY" benchmarks/gpu_h200.py "${args[@]}" "$@"
