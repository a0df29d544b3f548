#!/usr/bin/env bash
# One device call that validates the GPU side: the verify test as the first capture of a fresh
# process, the whole GPU suite, the autotuner benchmark (full held-out grid) and the decode examples.
# Each step has its own time limit so a slow one cannot starve the rest. Logs and results under $OUT.
# Usage on the device machine: bash benchmarks/gpu_validate.sh
set -u
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl >/dev/null 2>&1 || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,pstate,clocks.sm,clocks.mem,clocks_throttle_reasons.active,power.draw,power.limit --format=csv | tee "$OUT/gpu_state.txt"
python3 -c "import torch, cupy, lightning; print('torch', torch.__version__, 'cupy', cupy.__version__, 'lightning', lightning.__version__)" | tee -a "$OUT/gpu_state.txt"
PYTEST=(python3 -m pytest -m gpu -q --timeout 150 --no-header -p no:cacheprovider)
# verify=True must work as the first capture of a process (it failed that way once)
timeout 90 "${PYTEST[@]}" tests/gpu/test_callback_gpu.py -k "verify_passes" > "$OUT/pytest_verify_first.log" 2>&1
echo "verify-first rc=$?"; tail -3 "$OUT/pytest_verify_first.log"
timeout 300 "${PYTEST[@]}" tests/gpu > "$OUT/pytest_gpu.log" 2>&1
echo "gpu suite rc=$?"; grep -E "passed|failed|FAILED|Error" "$OUT/pytest_gpu.log" | grep -v DEBUG | tail -15
timeout 180 python3 benchmarks/bench_autotune.py --out "$OUT/autotune" > "$OUT/autotune.log" 2>&1
echo "autotune rc=$?"; tail -12 "$OUT/autotune.log"
{
  echo "=== python3 examples/decode_generate.py"; timeout 60 python3 examples/decode_generate.py; echo "rc=$?"
  echo "=== python3 examples/decode_predict_step.py"; timeout 60 python3 examples/decode_predict_step.py; echo "rc=$?"
} > "$OUT/examples.log" 2>&1
grep -v DEBUG "$OUT/examples.log" | tail -30
