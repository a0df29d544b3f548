#!/usr/bin/env bash
# The test command named in the README: set up .venv on a fresh machine, lint, run the CPU suite.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ ! -x .venv/bin/python ]; then
  python3 -m venv .venv
fi
FIND_LINKS=()
[ -d /opt/wheels ] && FIND_LINKS=(--find-links /opt/wheels)
# The CPU build of torch 2.13.0 lies on this machine's disk; an unpinned torch would pull a CUDA build.
.venv/bin/pip install -q "${FIND_LINKS[@]}" "torch==2.13.0" -e ".[dev]"
.venv/bin/ruff check l2lightning tests benchmarks examples
.venv/bin/ruff format --check l2lightning tests benchmarks examples
.venv/bin/python -m pytest -q "$@"
