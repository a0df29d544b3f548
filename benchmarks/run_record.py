"""What a benchmark's result file records of its run: the host, the versions and the source tree."""

from __future__ import annotations

import platform
import subprocess
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


def machine_record() -> dict[str, Any]:
    """The processor, Python, torch and Lightning versions, and the checkout's commit (None outside git)."""
    import lightning
    import torch

    commit = subprocess.run(
        ["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True
    ).stdout.strip()
    return {
        "processor": platform.processor() or platform.machine(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "lightning": lightning.__version__,
        "git_commit": commit or None,
    }
