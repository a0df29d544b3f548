"""What a benchmark's result file records of its run: the device, the versions and the source tree."""

from __future__ import annotations

import platform
import subprocess
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


def _git(*args: str) -> str:
    return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True).stdout.strip()


def machine_record(device: str | None = None) -> dict[str, Any]:
    """`device` (default: the processor), the platform, Python, torch (and its CUDA) and Lightning
    versions, and the checkout's commit (None outside git; marked where the tree that ran had
    uncommitted changes, since it is then not that commit's)."""
    import lightning
    import torch

    commit = _git("rev-parse", "HEAD")
    if commit and _git("status", "--porcelain", "--untracked-files=no"):
        commit += " with uncommitted changes"
    return {
        "device": device or platform.processor() or platform.machine(),
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "lightning": lightning.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "git_commit": commit or None,
    }
