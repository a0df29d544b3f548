# Sourced by scripts/test.sh and scripts/train.sh from the repository root: create .venv on a fresh
# machine and install the package with its dev extras. The CPU build of torch 2.13.0 lies on this
# machine's disk; an unpinned torch would pull a multi-gigabyte CUDA build.
if [ ! -x .venv/bin/python ]; then
  # the first run installs torch, Lightning and the dev tools: say so before the wait
  echo "l2lightning: setting up .venv (first run only: installs torch 2.13.0, Lightning and the dev tools; about a minute)" >&2
  python3 -m venv .venv
fi
FIND_LINKS=()
[ -d /opt/wheels ] && FIND_LINKS=(--find-links /opt/wheels)
.venv/bin/pip install -q "${FIND_LINKS[@]}" "torch==2.13.0" -e ".[dev]"
