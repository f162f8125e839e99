#!/usr/bin/env bash
# Everything benchmarks/gpu_h200.sh does on a lent GPU machine, here on the CPU (make gpu-dry-run):
# 1. an environment like the GPU image's: .venv-image, jaxtrain's dependencies less the packages named in
#    benchmarks/gpu_wheels.txt (which the image lacks), and not jaxtrain itself;
# 2. those wheels downloaded as `make gpu-wheels` does, but for this Python, into a temporary folder;
# 3. gpu_h200.sh with TINY=1: installs them with --target into a temporary site folder, runs every row
#    with tiny shapes on the CPU, and the JSON lines land in the temporary folder (printed too).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
IMAGE=.venv-image
if [ ! -f "$IMAGE/.installed" ] || [ pyproject.toml -nt "$IMAGE/.installed" ] || [ benchmarks/gpu_wheels.txt -nt "$IMAGE/.installed" ]; then
  rm -rf "$IMAGE"
  "$PYTHON" -m venv "$IMAGE"
  # every dependency, then out with what the image lacks: their own dependencies stay, as on the image
  "$IMAGE/bin/python" -m pip install --quiet .
  mapfile -t lacking < <(grep -v '^#' benchmarks/gpu_wheels.txt | cut -d= -f1)
  "$IMAGE/bin/python" -m pip uninstall --quiet --yes jaxtrain "${lacking[@]}"
  touch "$IMAGE/.installed"
fi
if "$IMAGE/bin/python" -c 'import grain' 2>/dev/null; then
  echo "gpu_dry_run.sh: $IMAGE has grain, so it does not stand for the GPU image; delete $IMAGE" >&2; exit 1
fi
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
version=$("$IMAGE/bin/python" -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')
make --no-print-directory gpu-wheels GPU_PYTHON_VERSION="$version" WHEELS="$tmp/whl"
# the runner's default budget keeps a lent machine's command under the device tool's 600 s; on this CPU every row is
# wanted, and the tiny rows together take longer (2 cores: 16 min at 2e0798a), so a budget of their own (a --budget-s
# given to this script still wins: the last one counts; make's target passes none)
TINY=1 PY="$IMAGE/bin/python" WHEELS="$tmp/whl" SITE="$tmp/site" OUT="$tmp" benchmarks/gpu_h200.sh \
  --budget-s "${DRY_RUN_BUDGET_S:-1800}" "$@"
