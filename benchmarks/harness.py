"""Benchmark harness entry point: ``python benchmarks/harness.py [bench options]``.

A thin wrapper around ``l2lightning bench`` (see ``l2lightning/bench.py`` for what is timed and
how). Run it from the repository root so the default criteria (benchmarks/criteria.yaml) and
output directory (benchmarks/results/<gpu-name-slug>/) resolve.

Example:
    python benchmarks/harness.py --quick
    python benchmarks/harness.py --models 1536x40,1024x60,768x96 --batches 4,8,16
    python benchmarks/harness.py --families all --batches 4,8,16,64 --repeats 3 --steps 10
"""

from __future__ import annotations

import sys
from pathlib import Path

if __name__ == "__main__":
    root = Path(__file__).resolve().parent.parent
    if (root / "l2lightning").is_dir() and str(root) not in sys.path:
        sys.path.insert(0, str(root))  # run from a checkout without installing
    from l2lightning.tools.cli import main

    sys.exit(main(["bench", *sys.argv[1:]]))
