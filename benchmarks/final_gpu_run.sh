#!/usr/bin/env bash
# The session's last device call: GPU tests for what changed, then benchmarks in priority order,
# each step with its own time limit so a slow one cannot starve the rest. Logs under $OUT.
set -u
OUT=${OUT:-/tmp/out}
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,pstate,clocks.sm,clocks.mem,clocks_throttle_reasons.active --format=csv 
timeout 200 python3 -m pytest -m gpu -q -p no:cacheprovider --timeout 150 \
  tests/gpu/test_core_gpu.py tests/gpu/test_callback_gpu.py tests/gpu/test_autotune_gpu.py tests/gpu/test_decode_step_gpu.py \
  > "$OUT/pytest_gpu.log" 2>&1; echo "pytest rc=$?"; grep -E "passed|failed|FAILED|Error" "$OUT/pytest_gpu.log" | grep -v DEBUG | tail -12
timeout 150 python3 benchmarks/bench_callback.py --out "$OUT" --json-name callback_compile.json --rounds 1 --steps 40 \
  --cases 1536x40x16 --variants lightning,callback,callback+compile,callback+compile+prefetch 2>&1 | grep -v DEBUG | tail -6
timeout 150 python3 benchmarks/harness.py --quick --out /tmp/harness > "$OUT/harness.log" 2>&1; echo "harness rc=$?"
cp /tmp/harness/results.json "$OUT/harness_results.json" 2>/dev/null; cp /tmp/harness/speedup.png "$OUT/harness_speedup.png" 2>/dev/null
echo "illegal: $(grep -c 'illegal memory' "$OUT/harness.log")"; grep -v DEBUG "$OUT/harness.log" | tail -25
timeout 90 python3 benchmarks/bench_decode.py --skip-attention --out /tmp/decode_auto 2>&1 | grep -v DEBUG | tail -18
cp /tmp/decode_auto/decode_summary.md "$OUT/decode_auto_summary.md" 2>/dev/null; cp /tmp/decode_auto/decode.json "$OUT/decode_auto.json" 2>/dev/null
