"""``python -m l2lightning.tools.bench ARGS``: the same as ``l2lightning bench ARGS``."""

from __future__ import annotations

import sys

from l2lightning.tools.cli import main

if __name__ == "__main__":
    sys.exit(main(["bench", *sys.argv[1:]]))
