#!/usr/bin/env bash
# One device call: install Hydra wheels, run GPU tests and the named benchmarks, logs under $OUT.
# Usage on the device machine: bash benchmarks/gpu_session.sh "<pytest paths>" "<bench commands ;-separated>"
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 || exit 1
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,pstate,clocks.sm,clocks.mem,clocks_throttle_reasons.active,power.draw,power.limit --format=csv | tee "$OUT/gpu_state.txt"
python3 -c "import torch, cupy, lightning; print('torch', torch.__version__, 'cupy', cupy.__version__, 'lightning', lightning.__version__)" | tee -a "$OUT/gpu_state.txt"
if [ -n "${1:-}" ]; then
  timeout 400 python3 -m pytest -m gpu -q --timeout 150 --no-header -p no:cacheprovider $1 2>&1 | tee "$OUT/pytest_gpu.log" | tail -40
fi
IFS=';' read -ra BENCHES <<< "${2:-}"
for cmd in "${BENCHES[@]}"; do
  [ -z "$cmd" ] && continue
  echo "=== $cmd"
  eval "$cmd" 2>&1 | tee -a "$OUT/bench.log" | tail -30
done
