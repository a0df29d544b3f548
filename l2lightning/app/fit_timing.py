"""The step times a training run reports: which steps count, their medians, and how that is said.

:class:`l2lightning.step_timer.StepTimer` marks every ``Trainer.fit`` step; the entry point then
has to decide which of those steps stand for the eager fit (not the first few: lazy
initialisation and allocator growth) and which for the fit with the callback (only those after the
capture step), and to say so in result.json. Those decisions live here, apart from the fits.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence

import lightning.pytorch as pl

# eager steps left out of the eager step time (lazy initialisation, allocator growth)
EAGER_SKIP = 3


class FitStart(pl.Callback):
    """Remembers the global step a fit started from: 0, or the step of the checkpoint it resumed from."""

    def __init__(self) -> None:
        self.step = 0

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.step = trainer.global_step


def eager_step_time(
    times: Sequence[tuple[int, float]], skip: int = EAGER_SKIP
) -> tuple[float | None, int, int]:
    """(median ms, steps timed, steps skipped) of an eager fit, after its first `skip` steps.

    Fewer steps are skipped when the fit is shorter, so that at least one is timed.
    """
    if not times:
        return None, 0, 0
    skip = min(skip, len(times) - 1)
    kept = [ms for _, ms in times[skip:]]
    return statistics.median(kept), len(kept), skip


def graph_step_time(times: Sequence[tuple[int, float]], capture_step: int | None) -> tuple[float | None, int]:
    """(median ms, steps timed) of the steps after the capture step (the warm-up and capture steps excluded)."""
    if capture_step is None:
        return None, 0
    kept = [ms for step, ms in times if step > capture_step]
    return (statistics.median(kept) if kept else None), len(kept)


def fit_speedup(eager_ms: float | None, graph_ms: float | None) -> float | None:
    """Eager step time over the step time with the callback; None unless both were timed."""
    return eager_ms / graph_ms if eager_ms and graph_ms else None


def steps_text(n: int) -> str:
    """``"only 1 step"`` or ``"N steps"``: a single timed step is worth pointing out."""
    return "only 1 step" if n == 1 else f"{n} steps"


def timing_text(
    clock: str,
    eager: tuple[float | None, int, int],
    graph: tuple[float | None, int] | None = None,
    capture_step: int | None = None,
    eager_source: str = "this fit",
) -> str:
    """What the step times in result.json are: which clock, which steps, how many."""
    _, n_eager, skip = eager
    parts = [
        f"Trainer.fit wall time per step ({clock}; start of a step to the start of the next), median",
        f"eager: {steps_text(n_eager)} of {eager_source} after its first {skip}"
        if n_eager
        else "eager: not timed",
    ]
    if graph is not None:
        _, n_graph = graph
        if n_graph:
            parts.append(f"with the callback: {steps_text(n_graph)} after the capture step {capture_step}")
        else:
            parts.append("with the callback: no step after a capture was timed")
    return "; ".join(parts)
