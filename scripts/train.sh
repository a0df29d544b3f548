#!/usr/bin/env bash
# The main job named in the README: set up .venv, then run the default Hydra training experiment.
# On a machine without CUDA it trains eagerly on the CPU and prints one line saying why.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/setup_venv.sh
exec .venv/bin/python -m l2lightning.app.train "$@"
