"""The whole-step gate: keep the prefetch plans only if the whole captured step is faster with them.

The autotuner keeps a plan per layer shape when it pays on a throwaway chain of that shape, timing
forward and backward plans apart. Nothing there times the combination inside the real step, where
the plans of every shape, the optimizer and the rest of the model share L2 and the copy engines:
on the H200 the default was 5% slower than no prefetch on one MLP stack and 12% faster on another
(issue 16). So after the step is captured with its plans, the next ``2 * pairs`` training steps
replay it in turn with its prefetch kernels on and off: one graph whose prefetch kernel nodes are
switched (:mod:`l2lightning.graph.prefetch_switch`), or, where the driver or PyTorch cannot switch them,
a second capture of the step without prefetch. Both variants compute the same values (a prefetch
never writes memory), so which one replays a step does not change training; only their GPU times
differ. The plans stay when the 95% confidence interval
of the paired gain ``1 - t_prefetch / t_off`` lies above ``min_gain`` (zero by default: the per-shape
gate already asked for +1%); otherwise the step without prefetch is kept for the rest of the fit.

Pairs alternate their order (prefetch first, then off first) so a drift of clocks or temperature
during the trial hits both alike. Times are CUDA-event pairs around each replay, read once, when
the trial is complete: the trial adds no host sync per step.
"""

from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from l2lightning.tune.stats import Interval, mean_ci, paired_gains

# Replays of each graph in the trial: 24 pairs give a CI half-width of about 1% of the step at the
# replay-to-replay noise of small steps on the H200 (0.5-2% per replay).
GATE_PAIRS = 24
VARIANTS = ("prefetch", "off")


@dataclass(frozen=True)
class StepGateResult:
    """The verdict: which graph the fit keeps, the measured gain, and why."""

    kept: str  # "prefetch" or "off"
    gain: Interval | None  # of 1 - t_prefetch / t_off, per pair
    prefetch_ms: float | None
    off_ms: float | None
    reason: str
    # how the step without prefetch was made: "switch" (its kernel nodes switched off in the one
    # graph) or "second capture" (two graphs, two memory pools, during the trial); None before any
    method: str | None = None

    def to_dict(self) -> dict[str, Any]:
        gain = self.gain
        return {
            "kept": self.kept,
            "gain": round(gain.mean, 5) if gain is not None else None,
            "gain_ci": [round(gain.low, 5), round(gain.high, 5)] if gain is not None else None,
            "pairs": gain.n if gain is not None else 0,
            "prefetch_ms": self.prefetch_ms,
            "off_ms": self.off_ms,
            "reason": self.reason,
            "method": self.method,
        }


def judge(
    prefetch_ms: list[float], off_ms: list[float], min_gain: float = 0.0, confidence: float = 0.95
) -> StepGateResult:
    """The gate's decision from paired replay times (element i of each taken in the same pair)."""
    gains = paired_gains(off_ms, prefetch_ms)
    ci = mean_ci(gains, confidence)
    medians = (_median(prefetch_ms), _median(off_ms))
    pct = int(round(confidence * 100))
    if ci.n < 2:
        return StepGateResult("off", ci, *medians, f"only {ci.n} paired replay(s): no confidence interval")
    if ci.low > min_gain:
        return StepGateResult(
            "prefetch",
            ci,
            *medians,
            f"whole-step gain {ci.mean:+.2%}, {pct}% CI [{ci.low:+.2%}, {ci.high:+.2%}]",
        )
    return StepGateResult(
        "off",
        ci,
        *medians,
        f"whole-step gain {ci.mean:+.2%}, {pct}% CI low {ci.low:+.2%} is not above {min_gain:+.2%}",
    )


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


class StepGate:
    """The trial's bookkeeping: both graphs, whose turn it is, the event pairs of each replay.

    Args:
        prefetch_graph: the step captured with the plans (the callback's graph object).
        pairs: replays of each graph before the decision.
        min_gain: the lower confidence bound of the gain must exceed this.
        switch: the prefetch kernel nodes of `prefetch_graph`
            (:class:`l2lightning.graph.prefetch_switch.PrefetchSwitch`): the step without prefetch is
            the same graph with them off. None: a second capture makes it.
    """

    def __init__(
        self, prefetch_graph: Any, pairs: int = GATE_PAIRS, min_gain: float = 0.0, switch: Any = None
    ) -> None:
        if isinstance(pairs, bool) or not isinstance(pairs, int) or pairs < 2:
            raise ValueError(f"`pairs` must be an int >= 2, got {pairs!r}")
        self.switch = switch
        self.graphs: dict[str, Any] = {"prefetch": prefetch_graph, "off": prefetch_graph if switch else None}
        self.pairs = pairs
        self.min_gain = min_gain
        self.events: dict[str, list[tuple[Any, Any]]] = {v: [] for v in VARIANTS}
        self._turn = 0

    @property
    def needs_off_graph(self) -> bool:
        """The step without prefetch is still to be captured (the next replayable step does it)."""
        return self.graphs["off"] is None

    @property
    def method(self) -> str:
        return "switch" if self.switch is not None else "second capture"

    def graph_for(self, variant: str) -> Any:
        """The graph that replays `variant`'s turn, its prefetch nodes switched to match."""
        if self.switch is not None:
            self.switch.set(variant == "prefetch")
        return self.graphs[variant]

    def settle(self, kept: str) -> None:
        """After the verdict: the switched graph stays in the winner's state.

        A switch the driver refuses leaves some prefetch kernels in the other state: the step's
        values are the same either way (a prefetch never writes memory), only its time differs.
        """
        if self.switch is not None:
            try:
                self.switch.set(kept == "prefetch")
            except RuntimeError:
                pass

    def next_variant(self) -> str:
        """Whose turn it is: pairs alternate their order, (prefetch, off), (off, prefetch), ..."""
        pair, second = divmod(self._turn, 2)
        first = VARIANTS[pair % 2]
        return first if not second else VARIANTS[1 - VARIANTS.index(first)]

    def record(self, variant: str, start: Any, end: Any) -> None:
        """The CUDA events around one replay of `variant`'s graph."""
        if variant not in VARIANTS:
            raise ValueError(f"`variant` must be one of {VARIANTS}, got {variant!r}")
        self.events[variant].append((start, end))
        self._turn += 1

    @property
    def complete(self) -> bool:
        return all(len(self.events[v]) >= self.pairs for v in VARIANTS)

    def decide(self, elapsed_ms: Callable[[Any, Any], float] | None = None) -> StepGateResult:
        """Read the events (one wait for the last replay) and judge; `elapsed_ms` is a test seam."""
        if elapsed_ms is None:
            elapsed_ms = _event_ms
        n = min(len(self.events[v]) for v in VARIANTS)
        times = {v: [elapsed_ms(s, e) for s, e in self.events[v][:n]] for v in VARIANTS}
        return dataclasses.replace(judge(times["prefetch"], times["off"], self.min_gain), method=self.method)

    def winner_and_loser(self, result: StepGateResult) -> tuple[Any, Any]:
        kept = self.graphs[result.kept]
        other = self.graphs["off" if result.kept == "prefetch" else "prefetch"]
        return kept, other


def _event_ms(start: Any, end: Any) -> float:
    end.synchronize()
    return float(start.elapsed_time(end))
