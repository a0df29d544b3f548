#!/usr/bin/env bash
# The main job named in the README: set up .venv, then run the default Hydra training experiment.
# On a machine without CUDA it trains eagerly on the CPU and prints one line saying why.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ ! -x .venv/bin/python ]; then
  python3 -m venv .venv
fi
FIND_LINKS=()
[ -d /opt/wheels ] && FIND_LINKS=(--find-links /opt/wheels)
.venv/bin/pip install -q "${FIND_LINKS[@]}" "torch==2.13.0" -e ".[dev]"
exec .venv/bin/python -m l2lightning.train "$@"
