"""The callback and its per-step policy: what each step does (decide), how it runs (dispatch), the
module methods it stands in for (overrides), the warm-up, the capture step, prefetch set-up and the
whole-step gate, and what a fit reports.

``L2GraphCallback`` is loaded on first use, as from the package root: importing the package touches
neither CUDA nor Lightning's loops.
"""

from __future__ import annotations

from typing import Any

__all__ = ["L2GraphCallback"]


def __getattr__(name: str) -> Any:
    if name == "L2GraphCallback":
        from l2lightning.callback.graph_callback import L2GraphCallback

        return L2GraphCallback
    raise AttributeError(f"module 'l2lightning.callback' has no attribute {name!r}")
