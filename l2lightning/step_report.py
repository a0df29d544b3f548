"""Where a captured training step's time goes: phase times inside the graph, kernels per phase, floors.

Used by ``L2GraphCallback(report=True)``:

* phase times come from CUDA events recorded *inside* the capture (``external=True`` events become
  event-record nodes of the graph) at the start, after forward, after backward and at the end of the
  step, read after a replay;
* kernels per phase come from one profiled eager step (the last warm-up step), counting the
  host-side launch calls that fall inside ``record_function`` ranges around forward and backward;
  the rest of the step is the optimizer phase (zero-grad, clipping and the update);
* floors (bytes over the measured copy bandwidth, kernels over the measured empty-kernel cost) and
  the formatting come from :mod:`l2lightning.floors`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch

from l2lightning.floors import LAUNCH_API_NAMES, PhaseTime, StepReport, floors, param_bytes_by_dtype

PHASES = ("forward", "backward", "optimizer")
_MARKS = ("start", "forward", "backward", "end")


class PhaseEvents:
    """Timing events recorded at phase boundaries inside a graph capture."""

    def __init__(self) -> None:
        try:
            self.events = {name: torch.cuda.Event(enable_timing=True, external=True) for name in _MARKS}
        except TypeError:  # a torch without external events: no phase times
            self.events = {}
        self.recorded: set[str] = set()

    def mark(self, name: str) -> None:
        """Record boundary `name` on the current stream (only while capturing)."""
        if name in self.events and torch.cuda.is_current_stream_capturing():
            self.events[name].record()
            self.recorded.add(name)

    def phase_times_us(self) -> dict[str, float] | None:
        """Phase times of the latest replay, or None if a boundary was not recorded."""
        if self.recorded != set(_MARKS):
            return None
        self.events["end"].synchronize()
        e = self.events
        return {
            "forward": e["start"].elapsed_time(e["forward"]) * 1e3,
            "backward": e["forward"].elapsed_time(e["backward"]) * 1e3,
            "optimizer": e["backward"].elapsed_time(e["end"]) * 1e3,
        }


class PhaseKernelCounter:
    """Counts the kernels each phase of one eager step launches, with the profiler."""

    def __init__(self) -> None:
        self.counts: dict[str, int] | None = None
        self._profiling = False

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Mark a phase range (only costs anything while a step is profiled)."""
        if not self._profiling:
            yield
            return
        with torch.profiler.record_function(f"l2l::{name}"):
            yield

    def profile(self, run_step: Callable[[], Any]) -> Any:
        """Run `run_step` under the profiler and keep per-phase kernel counts."""
        from torch.profiler import ProfilerActivity, profile

        self._profiling = True
        try:
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                with torch.profiler.record_function("l2l::step"):
                    out = run_step()
                torch.cuda.synchronize()
        finally:
            self._profiling = False
        self.counts = count_by_phase(list(prof.events()))
        return out


def count_by_phase(events: list[Any]) -> dict[str, int] | None:
    """Launch calls inside the ``l2l::forward`` / ``l2l::backward`` ranges; the rest of ``l2l::step`` is optimizer."""
    ranges = {}
    for e in events:
        name = getattr(e, "name", "")
        if name.startswith("l2l::"):
            ranges.setdefault(name[5:], []).append((e.time_range.start, e.time_range.end))
    if "step" not in ranges:
        return None
    launches = [e.time_range.start for e in events if getattr(e, "name", "") in LAUNCH_API_NAMES]

    def inside(phase: str, t: float) -> bool:
        return any(a <= t <= b for a, b in ranges.get(phase, []))

    counts = {phase: 0 for phase in PHASES}
    for t in launches:
        if not inside("step", t):
            continue
        if inside("forward", t):
            counts["forward"] += 1
        elif inside("backward", t):
            counts["backward"] += 1
        else:
            counts["optimizer"] += 1
    return counts


def prefetch_gains(tuning: Any) -> dict[str, float]:
    """Measured gain per (shape, phase) of the plans the autotuner kept."""
    if tuning is None:
        return {}
    return {
        f"{row.shape} [{row.phase}]": row.gain for row in tuning.rows if row.chosen and row.gain is not None
    }


def measure_ceilings(device_index: int) -> tuple[float | None, float | None]:
    """(copy bandwidth in bytes/s, empty-kernel µs) measured now with the GPU probes the doctor uses (short)."""
    from l2lightning import probes

    try:
        copy = probes.measure_copy_load(device_index, buffer_bytes=256 << 20, seconds=0.15)
        empty = probes.measure_empty_kernel(device_index, launches=500, replays=5, trials=3)
    except Exception:  # the report is informational; a failed probe leaves the floors unknown
        return None, None
    return copy.get("copy_bandwidth_bytes_per_s"), empty


def build_report(
    model: torch.nn.Module,
    times_us: Mapping[str, float],
    kernel_counts: Mapping[str, int] | None,
    copy_bw: float | None,
    empty_kernel_us: float | None,
    tuning: Any = None,
    label: str = "",
) -> StepReport:
    """A :class:`~l2lightning.floors.StepReport` of one captured training step."""
    phases = [
        PhaseTime(name, times_us[name], kernel_counts.get(name) if kernel_counts else None) for name in PHASES
    ]
    step_floors = None
    if copy_bw:
        total_kernels = sum(kernel_counts.values()) if kernel_counts else None
        step_floors = floors(
            param_bytes_by_dtype(model), total_kernels, copy_bw, empty_kernel_us, chain="step"
        )
    return StepReport(phases, step_floors, prefetch_gains(tuning), label=label)
