"""What a fit with the callback reports: the step times, the l2/* metrics, the step report, the costs.

:class:`FitReport` is a part the callback holds (``L2GraphCallback._fit_report``): the state it keeps
is declared in its ``__init__`` (the CUDA-event pairs of timed steps, whether the metrics went out,
the captured step's phase events, kernel counts and report), and what it needs of the fit (the
Trainer, the module, the metrics, the capture's device and tuning report) comes in as arguments. The
metrics themselves are the callback's (``L2GraphCallback._timing_metrics``: a view of its
``summary()``). :class:`CaptureCosts` is the record of what capturing cost (``L2GraphCallback._costs``),
which the dispatch, capture and prefetch parts fill and ``summary()`` reports.
"""

from __future__ import annotations

import statistics
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from lightning.pytorch import Trainer

# Timed replays whose events must have completed before the l2/* metrics are first logged.
TIMED_REPLAYS_BEFORE_LOG = 5
# CUDA-event pairs kept for the step-time medians (a window, so a long fit holds no growing list).
TIMING_WINDOW = 256
# Replays timed: every one until the window holds TIMED_FIRST_REPLAYS pairs, then one in
# TIMING_STRIDE. Two events made and recorded per replay are host time a step with nothing else to
# do notices (each record also builds a Python object of the current stream); a median over a
# sample reads the same.
TIMED_FIRST_REPLAYS = 32
TIMING_STRIDE = 8


@dataclass
class _Timing:
    """CUDA-event pairs of eager and replayed steps (the latest ``TIMING_WINDOW``); read without host syncs."""

    eager: deque = field(default_factory=lambda: deque(maxlen=TIMING_WINDOW))
    graph: deque = field(default_factory=lambda: deque(maxlen=TIMING_WINDOW))
    graph_count: int = 0

    def times_replay(self) -> bool:
        """Whether the next replay is timed (its count is ``graph_count``)."""
        return len(self.graph) < TIMED_FIRST_REPLAYS or self.graph_count % TIMING_STRIDE == 0

    @staticmethod
    def _median_ms(pairs: Any) -> float | None:
        done = [start.elapsed_time(end) for start, end in pairs if end.query()]
        return statistics.median(done) if done else None

    def eager_ms(self) -> float | None:
        return self._median_ms(self.eager)

    def graph_ms(self) -> float | None:
        return self._median_ms(self.graph)


class CaptureCosts:
    """What capturing cost this fit, in wall seconds: one record, which the dispatch and the capture write
    (the prefetch part its tuning), the decision's re-capture wait weighs and ``summary()`` reports.
    Made per fit with the parts and given to each of them; never rebound, so every part sees what the
    others wrote."""

    __slots__ = ("seconds", "once_s", "last_capture_s", "recaptures", "last_recapture_s")

    def __init__(self) -> None:
        # of prefetch tuning (chain discovery and the tuner; the prefetch part), of the captures (verify
        # included, their tuning apart), of torch.compile's first compiled step, of the captures after
        # the fit's first (their tuning included): summary()'s `tuning_s`, `capture_s`, ...
        self.seconds: dict[str, float] = {
            "tuning_s": 0.0,
            "capture_s": 0.0,
            "compile_s": 0.0,
            "recapture_s": 0.0,
        }
        # of the capture under way, what a later capture does not repeat (the fit's first full garbage
        # collection: the capture adds it, the dispatch leaves it out of `last_capture_s`)
        self.once_s = 0.0
        # the last capture's cost, less its tuning and `once_s`: what a re-capture waits to pay (the
        # decision asks it through the callback's `_last_capture_cost`), None before the first
        self.last_capture_s: float | None = None
        self.recaptures = 0  # captures after the fit's first (the gate's second capture included)
        self.last_recapture_s: float | None = None  # the wall seconds of the last of them


class FitReport:
    """The step times a fit measured, the l2/* metrics it logs, and the captured step's report."""

    def __init__(self, report: bool) -> None:
        """`report`: the callback's ``report`` argument (the captured step's phase report, on a GPU)."""
        from l2lightning.step_report import PhaseEvents, PhaseKernelCounter

        self.timing = _Timing()  # CUDA-event pairs of eager and replayed steps
        self.timing_logged = False  # the l2/* metrics went out once the first replays were timed
        self.phase_events: Any = PhaseEvents() if report and torch.cuda.is_available() else _NoPhaseEvents()
        self.kernel_counter = PhaseKernelCounter()
        self.step_report: Any = None

    @staticmethod
    def logs_to(trainer: Trainer, enabled: bool) -> bool:
        """Whether this process logs the l2/* metrics: `enabled` (``log_timing`` and a fit under way),
        rank zero, and a logger to log to."""
        return bool(enabled and trainer.is_global_zero and trainer.loggers)

    def log_once_known(
        self, trainer: Trainer, enabled: bool, metrics: Callable[[], dict[str, float]]
    ) -> None:
        """Log the l2/* metrics as soon as a captured run has timed replays, once per fit.

        Only when the first ``TIMED_REPLAYS_BEFORE_LOG`` timed replays have completed (``query``, no
        host sync), so the step path never waits for the device; until then each batch end checks
        again. Not the latest replay: a host that runs ahead of the device (no sync per step) would
        find it pending at every batch end (seen on the H200: logged only at the epoch's end).
        `enabled`: ``log_timing``, a fit under way and a graph captured (the callback's to say).
        """
        if self.timing_logged or not self.logs_to(trainer, enabled):
            return
        replays = self.timing.graph
        if len(replays) < TIMED_REPLAYS_BEFORE_LOG or not replays[TIMED_REPLAYS_BEFORE_LOG - 1][1].query():
            return
        self.timing_logged = True
        self.emit(trainer, metrics())

    def log_at_epoch_end(
        self, trainer: Trainer, enabled: bool, metrics: Callable[[], dict[str, float]]
    ) -> None:
        """Wait for the device, then log the l2/* metrics over the steps timed so far."""
        if not self.logs_to(trainer, enabled):
            return
        torch.cuda.synchronize()
        self.emit(trainer, metrics())

    @staticmethod
    def emit(trainer: Trainer, metrics: dict[str, float]) -> None:
        # The step Lightning logs this batch's own metrics at (as DeviceStatsMonitor and
        # LearningRateMonitor do): global_step is already one ahead in on_train_batch_end, and
        # loggers such as W&B drop rows whose step goes back.
        epoch_loop = getattr(getattr(trainer, "fit_loop", None), "epoch_loop", None)
        step = getattr(epoch_loop, "_batches_that_stepped", None)
        if not isinstance(step, int):
            step = int(trainer.global_step)
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=step)

    def build_step_report(self, module: Any, device: torch.device, tuning_report: Any) -> None:
        """The captured step's report from its phase events and kernel counts (None without events)."""
        from l2lightning.step_report import build_report, measure_ceilings

        times = self.phase_events.phase_times_us()
        if times is None:
            return
        copy_bw, empty_us = measure_ceilings(device.index or 0)
        self.step_report = build_report(
            module,
            times,
            self.kernel_counter.counts,
            copy_bw,
            empty_us,
            tuning_report,
            label=f"{type(module).__name__}, captured step",
        )

    def text(self, capture_step: int | None, tuning_report: Any, plans: list[dict[str, Any]]) -> str:
        """The step report as the callback prints it after a capture with ``report=True``."""
        lines = ["L2GraphCallback step report", f"  captured at step {capture_step}"]
        if self.step_report is not None:
            lines.append(self.step_report.format())
        if tuning_report is not None and hasattr(tuning_report, "table"):
            lines.append(tuning_report.table())
        for row in plans:
            lines.append(
                f"  {row['layer']:<40} {row['mib']:>8.2f} MiB  fwd {row['forward']}  bwd {row['backward']}"
            )
        return "\n".join(lines)


class _NoPhaseEvents:
    """Stands in for PhaseEvents when no report is asked for: marking costs nothing."""

    def mark(self, name: str) -> None:
        return None

    def phase_times_us(self) -> None:
        return None
