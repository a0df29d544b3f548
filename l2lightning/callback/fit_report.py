"""What a fit with the callback reports: verify, the l2/* metrics, the step report.

A mixin of :class:`l2lightning.callback.graph_callback.L2GraphCallback`: its methods use the callback's run state
(set in ``_reset_run_state``); it is split out so that each concept reads in one module.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from lightning.pytorch import Trainer
from lightning.pytorch.utilities import rank_zero_info

from l2lightning.graph.capture import TrainingState, loss_of
from l2lightning.guards.metric_binding import (
    MetricBinding,
)

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


class FitReport:
    """What a fit with the callback reports: verify, the l2/* metrics, the step report."""

    def _verify_eager(
        self, run: Callable[..., Any], closure: Any, kwargs: dict, binding: MetricBinding | None
    ) -> Any:
        """The capture step run eagerly from the same state, recorded, then undone."""
        from l2lightning.verify import StepRecord, gradients, parameters

        module = self._module
        saved = TrainingState.save(
            module, self._optimizer.optimizer, binding.state_tensors() if binding else ()
        )
        saved_metrics = binding.python_state() if binding else {}
        self._mode = "verify"
        self._step_output = None
        try:
            # On the capture's stream (the caller's _on_step_stream): Lightning's closure keeps this
            # step's loss, and with it each parameter's AccumulateGrad node, alive into the capture;
            # a node bound to another stream aborts the capture (seen on the H200 when verify=True
            # ran as the first capture of a process).
            run(closure, **kwargs)
            if self._step_output is None:
                return None  # training_step returned None: the capture defers, nothing to compare
            loss = loss_of(self._step_output, "training_step")
            record = StepRecord(None, loss.detach().clone(), gradients(module), parameters(module))
            self._step_output = None
        finally:
            self._mode = "eager"
        torch.cuda.synchronize()
        saved.restore(self._optimizer.optimizer)
        if binding is not None:
            binding.rebind()
            binding.restore_python_state(saved_metrics)
        module.zero_grad(set_to_none=True)
        return record

    def _finish_verify(self, eager_record: Any) -> None:
        from l2lightning.verify import EquivalenceError, StepRecord, compare_steps, gradients, parameters

        if eager_record is None:
            return
        module = self._module
        loss = loss_of(self._graph.output, "training_step")
        graph_record = StepRecord(None, loss.detach().clone(), gradients(module), parameters(module))
        report = compare_steps(graph_record, eager_record, "captured step vs eager step")
        self.verify_report = report
        rank_zero_info(f"L2GraphCallback verify: {report}")
        for logger in module.trainer.loggers:
            logger.log_metrics({"l2/verify_ok": float(report.ok)}, step=int(self._trainer.global_step))
        if not report.ok:
            raise EquivalenceError(report)

    def _logs_timing(self, trainer: Trainer) -> bool:
        return bool(
            self.log_timing and self._module is not None and trainer.is_global_zero and trainer.loggers
        )

    def _log_timing_once_known(self, trainer: Trainer) -> None:
        """Log the l2/* metrics as soon as a captured run has timed replays, once per fit.

        Only when the first ``TIMED_REPLAYS_BEFORE_LOG`` timed replays have completed (``query``, no
        host sync), so the step path never waits for the device; until then each batch end checks
        again. Not the latest replay: a host that runs ahead of the device (no sync per step) would
        find it pending at every batch end (seen on the H200: logged only at the epoch's end).
        """
        if self._timing_logged or self._graph is None or not self._logs_timing(trainer):
            return
        replays = self._timing.graph
        if len(replays) < TIMED_REPLAYS_BEFORE_LOG or not replays[TIMED_REPLAYS_BEFORE_LOG - 1][1].query():
            return
        self._timing_logged = True
        self._emit_timing(trainer)

    def _log_timing(self, trainer: Trainer) -> None:
        """Epoch end: wait for the device, then log the l2/* metrics over the steps timed so far."""
        if not self._logs_timing(trainer):
            return
        torch.cuda.synchronize()
        self._emit_timing(trainer)

    def _timing_metrics(self) -> dict[str, float]:
        """The l2/* metrics, all from one ``summary()``: floats, non-finite or unknown ones left out."""
        summary = self.summary()
        metrics = {
            f"l2/{key}": float(summary[key])
            for key in (
                "eager_step_ms",
                "graph_step_ms",
                "replay_speedup",
                "graph_pool_mib",
                "tuning_s",
                "capture_s",
                "compile_s",
                "recapture_s",
            )
            if summary[key] is not None and math.isfinite(float(summary[key]))
        }
        prefetched = [row for row in self.plans if row.get("forward") or row.get("backward")]
        metrics["l2/prefetch_layers"] = float(len(prefetched))
        metrics["l2/prefetch_mib"] = float(sum(float(row.get("mib") or 0.0) for row in prefetched))
        metrics["l2/fallback_steps"] = float(self.fallback_steps)
        gate = self._gate_result
        if gate is not None and gate.gain is not None and math.isfinite(gate.gain.mean):
            metrics["l2/prefetch_gate_gain"] = float(gate.gain.mean)
        return metrics

    def _emit_timing(self, trainer: Trainer) -> None:
        metrics = self._timing_metrics()
        # The step Lightning logs this batch's own metrics at (as DeviceStatsMonitor and
        # LearningRateMonitor do): global_step is already one ahead in on_train_batch_end, and
        # loggers such as W&B drop rows whose step goes back.
        epoch_loop = getattr(getattr(trainer, "fit_loop", None), "epoch_loop", None)
        step = getattr(epoch_loop, "_batches_that_stepped", None)
        if not isinstance(step, int):
            step = int(trainer.global_step)
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=step)

    def _build_step_report(self) -> None:
        from l2lightning.step_report import build_report, measure_ceilings

        times = self._phase_events.phase_times_us()
        if times is None:
            return
        device = self._device()
        copy_bw, empty_us = measure_ceilings(device.index or 0)
        self.step_report = build_report(
            self._module,
            times,
            self._kernel_counter.counts,
            copy_bw,
            empty_us,
            self._tuning_report,
            label=f"{type(self._module).__name__}, captured step",
        )

    def _report_text(self) -> str:
        lines = ["L2GraphCallback step report", f"  captured at step {self.capture_step}"]
        if self.step_report is not None:
            lines.append(self.step_report.format())
        if self._tuning_report is not None and hasattr(self._tuning_report, "table"):
            lines.append(self._tuning_report.table())
        for row in self.plans:
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
