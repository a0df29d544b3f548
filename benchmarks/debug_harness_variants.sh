#!/usr/bin/env bash
# Runs each harness variant alone on a tiny model (one process each, CUDA_LAUNCH_BLOCKING=1) to find
# which one raises an illegal memory access. Prints one line per variant and the first error.
for v in ${1:-lightning_eager callback_off callback_auto callback_decoy eager graph}; do
  CUDA_LAUNCH_BLOCKING=1 timeout 120 python3 benchmarks/harness.py --quick --models 512x4 --batches 4 --repeats 2 \
    --steps 3 --force --criteria '' --variants "$v" --chains step --out "/tmp/h_$v" > "/tmp/h_$v.log" 2>&1
  rc=$?
  echo "variant $v rc=$rc illegal=$(grep -c 'illegal memory' /tmp/h_$v.log)"
  grep -m3 -B2 -A12 'illegal memory\|Traceback' "/tmp/h_$v.log" | grep -v DEBUG | head -40
done
