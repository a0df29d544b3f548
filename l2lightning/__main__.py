"""``python -m l2lightning COMMAND``: the same as the ``l2lightning`` console script (doctor, bench)."""

from __future__ import annotations

import sys

from l2lightning.tools.cli import main

if __name__ == "__main__":
    sys.exit(main())
