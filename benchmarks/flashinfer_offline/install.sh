#!/usr/bin/env bash
# Offline install of the pruned FlashInfer 0.7.2.post1 bundle.
#   bash .fi/install.sh /tmp/site            # pruned csrc (decode/prefill path)
#   bash .fi/install.sh /tmp/site --full     # also restore every pruned csrc subdir
# Then use:  PYTHONPATH=/tmp/site python3 ...
# Env: PYTHON (default python3), TVM_FFI_WHEEL (override the tvm-ffi wheel, e.g. for another CPython).
set -euo pipefail
SITE="${1:-/tmp/site}"
MODE="${2:-}"
PY="${PYTHON:-python3}"
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
mkdir -p "$SITE"
SITE="$(cd "$SITE" && pwd)"

TVM_WHL="${TVM_FFI_WHEEL:-$(ls "$HERE"/wheels/apache_tvm_ffi-*.whl | head -n1)}"
echo "[fi-install] tvm-ffi wheel: $(basename "$TVM_WHL") -> $SITE"
"$PY" -m pip install -q --no-index --no-deps --upgrade --target "$SITE" "$TVM_WHL"

echo "[fi-install] unpacking pruned flashinfer -> $SITE"
tar -xJf "$HERE/flashinfer-0.7.2.post1-pruned.tar.xz" -C "$SITE"
if [ "$MODE" = "--full" ]; then
  echo "[fi-install] --full: restoring pruned csrc subdirectories"
  tar -xJf "$HERE/csrc_pruned_rest.tar.xz" -C "$SITE/flashinfer/data/csrc"
fi

# jinja2 is needed by the JIT generators; torch normally brings it. Fallback only.
if ! PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}" "$PY" -c "import jinja2" 2>/dev/null; then
  echo "[fi-install] jinja2 missing: installing bundled fallback wheels"
  "$PY" -m pip install -q --no-index --no-deps --upgrade --target "$SITE" "$HERE"/wheels/jinja2_fallback/*.whl
fi

command -v nvcc >/dev/null || echo "[fi-install] WARNING: nvcc not on PATH (set CUDA_HOME or PATH); JIT needs it"
command -v ninja >/dev/null || echo "[fi-install] WARNING: 'ninja' binary not on PATH; FlashInfer's JIT runs 'ninja' from PATH"

echo "[fi-install] import check:"
PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}" "$PY" -c "import flashinfer; print(flashinfer.__version__)"
