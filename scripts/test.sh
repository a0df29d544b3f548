#!/usr/bin/env bash
# The test command named in the README: set up .venv on a fresh machine, lint, run the CPU suite.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/setup_venv.sh
.venv/bin/ruff check l2lightning tests benchmarks examples
.venv/bin/ruff format --check l2lightning tests benchmarks examples
.venv/bin/python -m pytest -q "$@"
