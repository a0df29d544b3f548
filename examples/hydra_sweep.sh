#!/usr/bin/env bash
# A Hydra multirun: two model families × two batch sizes, one result.json per run, one summary table.
#
#   examples/hydra_sweep.sh [SWEEP_DIR] [more Hydra overrides...]
#   examples/hydra_sweep.sh multirun/my_sweep trainer=gpu l2=autotune trainer.max_steps=300
#
# Each job trains with the L2GraphCallback on a GPU (eagerly on a CPU) and writes
# SWEEP_DIR/<job>/result.json; the SweepSummary Hydra callback (conf/train.yaml) collects them into
# SWEEP_DIR/summary.csv and SWEEP_DIR/summary.md, printed at the end.
set -euo pipefail

sweep_dir="${1:-multirun/hydra_sweep_example}"
shift || true
# make a source checkout importable without installing it
repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
export PYTHONPATH="${repo_root}${PYTHONPATH:+:${PYTHONPATH}}"

python -m l2lightning.app.train -m \
    model=mlp_stack,rl_policy \
    data.batch_size=4,16 \
    "hydra.sweep.dir=${sweep_dir}" \
    "$@"

cat "${sweep_dir}/summary.md"
