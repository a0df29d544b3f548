#!/usr/bin/env bash
# The GPU driver: run the named stages in order, each with its own time limit so a slow one cannot
# starve the rest; logs and results go to OUTDIR.
# Usage: bash benchmarks/gpu_run.sh OUTDIR STAGE [STAGE ...]   (from the repository root)
#   verify_first  the verify test as the first capture of a fresh process (it once failed that way)
#   tests[=PATH,...]  the GPU suite (default all of tests/gpu)
#   autotune      the autotuner benchmark over the held-out grid
#   examples      the decode examples (generation, Lightning predict_step)
#   callback      Trainer.fit per-step time, fused AdamW, the issue's three MLP stacks
#   callback-regression  Trainer.fit per-step time, fused AdamW, the three MLP stacks, Lightning and the
#                 callback only (the figures callback_fit_fused.json has, to compare against)
#   callback-compile  Trainer.fit per-step time at 1536x40 batch 16 with and without torch.compile
#   harness[=WxD,...]  the comparison harness over MLP stacks (default the issue's three) and
#                 batches 4, 8, 16, 64, every variant and chain
#   harness-quick the harness's --quick grid
#   harness-sweep the issue's three MLP stacks x batches 4, 8, 16, 64, whole training step only,
#                 without the torch.compile and decoy variants, 4 repeats of 10 steps
#   idioms[=NAME,...]  the LightningModule idioms (tests/idiom_modules.py): plain vs the callback per
#                 module, each in its own process, -> idioms.csv / idioms.json (written after each idiom)
#   idioms-resume=PATH  the idioms an earlier, cut run's idioms.json at PATH lacks, its rows kept
#   idiom-pairs[=ARGS]  benchmarks/bench_idiom_pairs.py with ARGS (as host-overhead's; default the refused
#                 idioms): plain and callback fits in turns, several rounds in one process, per step and
#                 over the whole fit -> idiom_pairs.csv / .json
#   harness-families[=FAMILY,...[@REPEATS]]  model families (default all) x batches 4, 8, 16, 64:
#                 Lightning eager vs the callback without and with autotuned prefetch, 10 steps per
#                 repeat (default 3 repeats)
#   decode-reference  benchmarks/decode_reference.py (FP32 reference, step reports) -> decode_reference.tgz
#   host-overhead[=ARGS]  benchmarks/bench_host_overhead.py with ARGS (commas for spaces, semicolons
#                 for the commas of a list: --families,mlp_stack;rl_policy)
#                 -> host_overhead.tgz
#   decode        the decode benchmark with the automatic attention choice (no attention sweep)
#   default-cost[=ARGS]  benchmarks/bench_default_cost.py with ARGS (as host-overhead's): step time,
#                 fit wall time and peak memory of plain, prefetch off, the defaults and auto without
#                 the whole-step gate -> default_cost.csv / default_cost.json
#   memory-peak[=SCENARIO,...]  benchmarks/memory_peak.py: the allocations alive at the peak of the tuner's
#                 training case and of callback fits, grouped by the code that made them -> memory_peak.json
#   host-path-phases[=ARGS]  benchmarks/host_path_phases.py --device cuda with ARGS (as host-overhead's): the
#                 floor's replayed step split by the callback's functions -> host_path_phases_cuda.json
#   ab-host-path=ARGS  benchmarks/ab_host_path.py with ARGS (as host-overhead's; --a and --b name source
#                 trees carried into the checkout, such as .ab_tree_a) -> ab_host_path_N/ab_host_path.json, N the
#                 stage's place among the run's A/B stages
#   h2d-wait      benchmarks/h2d_wait.py: whether a pageable or pinned host-to-device copy waits for queued GPU work
#   probe         benchmarks/probe_capture_idioms.py: cuDNN RNNs with carried state, checkpointed dropout and
#                 fp16 GradScaler with fused AdamW under torch.cuda.graph, bitwise -> probe_capture_idioms.json
#   check-first-use  benchmarks/probe_check_first_use.py: the check's comparison timed on its first three runs
#                 in a fresh process per model and comparison path (torch's kernels, the check's own) -> check_first_use.json
#   replay-check[=ARGS]  benchmarks/bench_replay_check.py with ARGS (as host-overhead's): the sampled replay
#                 check's cost per packaged family, on vs off -> replay_check.csv / replay_check.json
# Wheels in .whl/ (an offline machine's dependencies) are installed to /tmp/site first when present.
set -u
if [ $# -lt 1 ]; then
  echo "usage: bash benchmarks/gpu_run.sh OUTDIR STAGE [STAGE ...]" >&2
  exit 2
fi
OUT=$1
shift
mkdir -p "$OUT"
if compgen -G ".whl/*.whl" > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl >/dev/null 2>&1 || exit 1
  export PYTHONPATH=/tmp/site:$PWD
else
  export PYTHONPATH=$PWD
fi
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,pstate,clocks.sm,clocks.mem,clocks_throttle_reasons.active,power.draw,power.limit --format=csv | tee "$OUT/gpu_state.txt"
python3 -c "import torch, cupy, lightning; print('torch', torch.__version__, 'cupy', cupy.__version__, 'lightning', lightning.__version__)" | tee -a "$OUT/gpu_state.txt"
# A stage's ARGS: commas separate arguments, semicolons separate a list inside one
# (default-cost=--variants,plain;off,--rounds,2 -> --variants plain,off --rounds 2).
stage_args() { local a=${1//,/ }; echo "${a//;/,}"; }
PYTEST=(python3 -m pytest -m gpu -v --timeout 150 --no-header -p no:cacheprovider)
for stage in "$@"; do
  echo "=== stage $stage ($(date +%T))"
  case "$stage" in
    verify_first)
      timeout 90 "${PYTEST[@]}" tests/gpu/test_callback_gpu.py -k "verify_passes" > "$OUT/pytest_verify_first.log" 2>&1
      echo "rc=$?"; tail -1 "$OUT/pytest_verify_first.log" ;;
    idioms-resume=*)
      # complete a cut idioms run: its idioms.json (committed or copied into the tree) keeps its rows
      timeout 540 python3 benchmarks/bench_idioms.py --out "$OUT" --resume "${stage#*=}" > "$OUT/idioms.log" 2>&1
      echo "rc=$?"; grep -v DEBUG "$OUT/idioms.log" | tail -22 ;;
    idiom-pairs*)
      extra=""; [[ "$stage" == *=* ]] && extra=${stage#*=}
      timeout 540 python3 benchmarks/bench_idiom_pairs.py --out "$OUT" $(stage_args "$extra") > "$OUT/idiom_pairs.log" 2>&1
      echo "rc=$?"; grep -E "^[a-z_0-9]+ +plain|wrote|Error" "$OUT/idiom_pairs.log" | tail -20 ;;
    idioms*)
      only=""; [[ "$stage" == *=* ]] && only="--only ${stage#*=}"
      timeout 540 python3 benchmarks/bench_idioms.py --out "$OUT" $only > "$OUT/idioms.log" 2>&1
      echo "rc=$?"; grep -v DEBUG "$OUT/idioms.log" | tail -22 ;;
    tests*)
      # one log per tests stage of the run: pytest_gpu.log, then pytest_gpu_2.log, ...; -v names each
      # test as it ends, so a run cut by the time limit still says which tests passed and failed
      tests_run=$((${tests_run:-0} + 1)); log="$OUT/pytest_gpu.log"; [ "$tests_run" -gt 1 ] && log="$OUT/pytest_gpu_$tests_run.log"
      paths=tests/gpu; [[ "$stage" == *=* ]] && paths=${stage#*=}
      timeout 540 "${PYTEST[@]}" ${paths//,/ } > "$log" 2>&1
      echo "rc=$?"; grep -E "passed|failed|FAILED|Error" "$log" | grep -v DEBUG | tail -15 ;;
    autotune)
      timeout 200 python3 benchmarks/bench_autotune.py --out "$OUT/autotune" > "$OUT/autotune.log" 2>&1
      echo "rc=$?"; tail -8 "$OUT/autotune.log" ;;
    examples)
      for ex in decode_generate decode_predict_step; do
        echo "=== python3 examples/$ex.py"; timeout 60 python3 "examples/$ex.py"; echo "rc=$?"
      done > "$OUT/examples.log" 2>&1
      grep -v DEBUG "$OUT/examples.log" | tail -20 ;;
    callback-compile)
      timeout 150 python3 benchmarks/bench_callback.py --out "$OUT" --json-name callback_compile.json --rounds 1 --steps 40 \
        --cases 1536x40x16 --variants lightning,callback,callback+compile,callback+compile+prefetch > "$OUT/callback_compile.log" 2>&1
      echo "rc=$?"; grep -v DEBUG "$OUT/callback_compile.log" | tail -6 ;;
    callback-regression)
      timeout 150 python3 benchmarks/bench_callback.py --out "$OUT" --json-name callback_fit_regression.json \
        --optimizer fused --rounds 1 --steps 40 --variants lightning,callback > "$OUT/callback_regression.log" 2>&1
      echo "rc=$?"; grep -v DEBUG "$OUT/callback_regression.log" | tail -8 ;;
    callback)
      timeout 300 python3 benchmarks/bench_callback.py --out "$OUT" --json-name callback_fit_fused.json \
        --optimizer fused --rounds 1 --steps 40 \
        --variants lightning,callback,callback+compile,compile-reduce-overhead > "$OUT/callback.log" 2>&1
      echo "rc=$?"; grep -v DEBUG "$OUT/callback.log" | tail -14 ;;
    harness-quick)
      timeout 150 python3 benchmarks/harness.py --quick --out "$OUT/harness_quick" > "$OUT/harness_quick.log" 2>&1
      echo "rc=$?"; echo "illegal: $(grep -c 'illegal memory' "$OUT/harness_quick.log")"
      grep -v DEBUG "$OUT/harness_quick.log" | tail -25 ;;
    harness-sweep)
      timeout 380 python3 benchmarks/harness.py --models 1536x40,1024x60,768x96 --batches 4,8,16,64 \
        --chains step --variants lightning_eager,callback_off,callback_auto,eager,graph,graph_prefetch \
        --repeats 4 --steps 10 --out "$OUT/harness" > "$OUT/harness.log" 2>&1
      echo "rc=$?"; grep -v DEBUG "$OUT/harness.log" | grep -v "^  " | tail -30 ;;
    harness-families*)
      spec=all@3; [[ "$stage" == *=* ]] && spec=${stage#*=}; [[ "$spec" == *@* ]] || spec="$spec@3"
      timeout 280 python3 benchmarks/harness.py --families "${spec%@*}" --batches 4,8,16,64 --repeats "${spec#*@}" --steps 10 \
        --out "$OUT/harness_families" > "$OUT/harness_families.log" 2>&1
      echo "rc=$?"; grep -v DEBUG "$OUT/harness_families.log" | grep -E "^\[|^[a-z_]+ b[0-9]+|criteria|PASSED|FAILED|NO DATA|total|NOT captured|error" | tail -40 ;;
    harness*)
      models=1536x40,1024x60,768x96; [[ "$stage" == *=* ]] && models=${stage#*=}
      timeout 540 python3 benchmarks/harness.py --models "$models" --batches 4,8,16,64 \
        --out "$OUT/harness" > "$OUT/harness.log" 2>&1
      echo "rc=$?"; grep -v DEBUG "$OUT/harness.log" | grep -v "^  " | tail -30 ;;
    decode-reference)
      timeout 240 python3 benchmarks/decode_reference.py --out /tmp/decode_reference > "$OUT/decode_reference.log" 2>&1
      echo "rc=$?"; grep -v DEBUG "$OUT/decode_reference.log" | tail -25
      tar czf "$OUT/decode_reference.tgz" -C /tmp decode_reference ;;
    host-overhead*)
      extra=""; [[ "$stage" == *=* ]] && extra=${stage#*=}
      timeout 330 python3 benchmarks/bench_host_overhead.py --out /tmp/host_overhead $(stage_args "$extra") > "$OUT/host_overhead.log" 2>&1
      echo "rc=$?"; grep -v DEBUG "$OUT/host_overhead.log" | tail -40
      tar czf "$OUT/host_overhead.tgz" -C /tmp host_overhead ;;
    default-cost*)
      extra=""; [[ "$stage" == *=* ]] && extra=${stage#*=}
      timeout 300 python3 benchmarks/bench_default_cost.py --out "$OUT" $(stage_args "$extra") > "$OUT/default_cost.log" 2>&1
      echo "rc=$?"; grep -v DEBUG "$OUT/default_cost.log" | tail -12 ;;
    memory-peak*)
      extra=""; [[ "$stage" == *=* ]] && extra="--scenarios ${stage#*=}"
      timeout 240 python3 benchmarks/memory_peak.py --out "$OUT" $extra > "$OUT/memory_peak.log" 2>&1
      echo "rc=$?"; grep -v DEBUG "$OUT/memory_peak.log" | tail -40 ;;
    probe)
      timeout 300 python3 benchmarks/probe_capture_idioms.py --out "$OUT" > "$OUT/probe_capture_idioms.log" 2>&1
      echo "rc=$?"; grep -v DEBUG "$OUT/probe_capture_idioms.log" | tail -8 ;;
    check-first-use)
      timeout 240 python3 benchmarks/probe_check_first_use.py --out "$OUT" > "$OUT/check_first_use.log" 2>&1
      echo "rc=$?"; grep -v DEBUG "$OUT/check_first_use.log" | tail -8 ;;
    replay-check*)
      extra=""; [[ "$stage" == *=* ]] && extra=${stage#*=}
      timeout 570 python3 benchmarks/bench_replay_check.py --out "$OUT" $(stage_args "$extra") > "$OUT/replay_check.log" 2>&1
      echo "rc=$?"; grep -v DEBUG "$OUT/replay_check.log" | tail -10 ;;
    host-path-phases*)
      extra=""; [[ "$stage" == *=* ]] && extra=${stage#*=}
      timeout 300 python3 benchmarks/host_path_phases.py --out "$OUT" --device cuda $(stage_args "$extra") > "$OUT/host_path_phases.log" 2>&1
      echo "rc=$?"; grep -v DEBUG "$OUT/host_path_phases.log" | tail -20 ;;
    ab-host-path=*)
      # one directory per A/B stage of the run: ab_host_path_1/, ab_host_path_2/, ...
      ab_run=$((${ab_run:-0} + 1))
      timeout 300 python3 benchmarks/ab_host_path.py --out "$OUT/ab_host_path_$ab_run" $(stage_args "${stage#*=}") > "$OUT/ab_host_path_$ab_run.log" 2>&1
      echo "rc=$?"; grep -E "B/A|Error" "$OUT/ab_host_path_$ab_run.log" | tail -8 ;;
    h2d-wait)
      timeout 60 python3 benchmarks/h2d_wait.py --out "$OUT" > "$OUT/h2d_wait.log" 2>&1
      echo "rc=$?"; tail -12 "$OUT/h2d_wait.log" ;;
    decode)
      timeout 90 python3 benchmarks/bench_decode.py --skip-attention --out "$OUT/decode_auto" > "$OUT/decode_auto.log" 2>&1
      echo "rc=$?"; grep -v DEBUG "$OUT/decode_auto.log" | tail -18 ;;
    *) echo "unknown stage $stage" ;;
  esac
done
