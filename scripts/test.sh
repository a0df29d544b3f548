#!/usr/bin/env bash
# The test command named in the README: set up .venv on a fresh machine, lint, build the docs
# (mkdocs --strict: a broken link or reference fails), run the CPU suite.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/setup_venv.sh
.venv/bin/ruff check l2lightning tests benchmarks examples
.venv/bin/ruff format --check l2lightning tests benchmarks examples
SITE=$(mktemp -d)
trap 'rm -rf "$SITE"' EXIT
.venv/bin/mkdocs build --strict --quiet --site-dir "$SITE"
.venv/bin/python -m pytest -q "$@"
