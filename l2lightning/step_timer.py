"""StepTimer: the time of every ``Trainer.fit`` training step, for the app, the tools and the benchmarks.

The training entry point reports eager and captured step times, the benchmark harness times its
Lightning variants, and the benchmark scripts time whole fits. They all need the same measurement,
so they share this one callback rather than each marking step boundaries its own way.

A step lasts from its ``on_train_batch_start`` to the next step's, so Lightning's own per-step work
is included, as a user sees it. On a CUDA device the marks are CUDA events recorded on the current
stream: no host sync per step, so the replays of a captured step are not stalled; the events are
read once, after the fit. Elsewhere they are ``time.perf_counter()`` stamps. The last step of an
epoch (and of the fit) has no next start in its epoch, and ends at its own ``on_train_batch_end``.

Needs only torch and Lightning, so it lives in the library; constructing it touches no CUDA.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import lightning.pytorch as pl
import torch


class WallClockMark:
    """A host time stamp read like a ``torch.cuda.Event``: ``start.elapsed_time(end)`` is in ms."""

    __slots__ = ("seconds",)

    def __init__(self) -> None:
        self.seconds = time.perf_counter()

    def elapsed_time(self, end: WallClockMark) -> float:
        return (end.seconds - self.seconds) * 1e3


@dataclass
class _StepMarks:
    global_step: int
    epoch: int
    batch_idx: int
    start: Any
    end: Any = None


class StepTimer(pl.Callback):
    """Wall time of every ``Trainer.fit`` training step: from its start to the start of the next step.

    Read after the fit: :meth:`step_times` gives ``(global step, ms)`` per step, :meth:`window_ms`
    a run of consecutive steps after the first few, and :attr:`events` the raw start marks.
    """

    def __init__(self) -> None:
        self.cuda = False
        self._steps: list[_StepMarks] = []

    @property
    def clock(self) -> str:
        """Which clock the marks come from, in words (result records say it)."""
        if self.cuda:
            return "CUDA events at each step start, GPU timeline"
        return "time.perf_counter on the host"

    @property
    def events(self) -> list[Any]:
        """The start mark of every step so far, in order (``torch.cuda.Event`` or :class:`WallClockMark`)."""
        return [step.start for step in self._steps]

    def _mark(self) -> Any:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return WallClockMark()

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.cuda = trainer.strategy.root_device.type == "cuda"

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        self._steps.append(_StepMarks(trainer.global_step, trainer.current_epoch, batch_idx, self._mark()))

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if self._steps and self._steps[-1].end is None:
            self._steps[-1].end = self._mark()

    def step_times(self) -> list[tuple[int, float]]:
        """(global step, ms) of every timed step, in order; waits for the device once."""
        if self.cuda and self._steps:
            torch.cuda.synchronize()
        times = []
        for i, step in enumerate(self._steps):
            following = self._steps[i + 1] if i + 1 < len(self._steps) else None
            end = step.end
            if (
                following is not None
                and following.epoch == step.epoch
                and following.batch_idx == step.batch_idx + 1
            ):
                end = following.start
            if end is None:
                continue
            times.append((int(step.global_step), float(step.start.elapsed_time(end))))
        return times

    def window_ms(self, first: int, steps: int) -> list[float]:
        """ms of `steps` consecutive steps from the `first`-th timed step on (0-based, in the order they ran).

        A benchmark leaves out the warm-up (and capture) steps at the start of a fit this way.

        Raises:
            ValueError: `first` < 0 or `steps` < 1.
            RuntimeError: the fit timed fewer than ``first + steps`` steps (the message says how many).
        """
        if first < 0:
            raise ValueError(f"`first` must be >= 0, got {first}")
        if steps < 1:
            raise ValueError(f"`steps` must be >= 1, got {steps}")
        times = self.step_times()
        if len(times) < first + steps:
            raise RuntimeError(f"Trainer.fit timed {len(times)} steps, expected at least {first + steps}")
        return [ms for _, ms in times[first : first + steps]]
