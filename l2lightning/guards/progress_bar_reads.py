"""Progress-bar values read from the device when something reads them, not at every step's end.

At the end of every training batch Lightning's logger connector rebuilds its metric dictionaries
(``_LoggerConnector.on_batch_end``) and, for each value logged with ``prog_bar=True``, converts the
tensor to a Python number right there: a ``.item()`` per value per step, whether or not a progress
bar is shown or refreshed at that step. Under a replayed CUDA graph each of those makes the host
wait for the step's GPU work and then for a device-to-host copy (issue 13: "no host sync per step by
default; the progress bar and loggers read them at their own cadence").

:func:`defer_progress_bar_reads` keeps those tensors as they are at the end of a batch and converts
them when ``trainer.progress_bar_metrics`` is read (by the progress bar at its refresh rate, by user
code, at the end of the fit). The tensor behind each value is the step's own copy (Lightning's
``_ResultMetric`` stores a fresh tensor per step, and so does the callback's log replay), so a
later read gives the number an immediate one would have given. Nothing else changes:
``callback_metrics`` and ``logged_metrics`` hold tensors in plain Lightning too, and the loggers read
at ``log_every_n_steps`` through their own path.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

try:  # private in Lightning: where _ResultCollection.metrics looks up the conversion it applies
    from lightning.pytorch.trainer.connectors.logger_connector import result as _result_module
    from lightning.pytorch.trainer.connectors.logger_connector.logger_connector import _LoggerConnector
except ImportError:  # pragma: no cover - another Lightning layout: values are converted as before
    _result_module = None
    _LoggerConnector = None


def _unconverted(value: Any) -> Any:
    return value


def read_now(metrics: dict[str, Any]) -> None:
    """Convert the tensors left in `metrics` to Python numbers, in place (what Lightning stores)."""
    for name, value in metrics.items():
        if isinstance(value, torch.Tensor):
            metrics[name] = value.item()


class _DeferredProgressBarReads:
    """Placed before Lightning's logger connector class: the batch end keeps tensors, reads convert."""

    def on_batch_end(self) -> None:
        convert = _result_module.convert_tensors_to_scalars
        _result_module.convert_tensors_to_scalars = _unconverted
        try:
            super().on_batch_end()
        finally:
            _result_module.convert_tensors_to_scalars = convert

    @property
    def progress_bar_metrics(self) -> dict[str, Any]:
        metrics = super().progress_bar_metrics
        read_now(metrics)
        return metrics

    def teardown(self) -> None:
        read_now(self._progress_bar_metrics)
        super().teardown()


_DEFERRED_CLASSES: dict[type, type] = {}


def defer_progress_bar_reads(trainer: Any) -> Callable[[], None] | None:
    """Make `trainer` read progress-bar values when they are read; returns the undo, or None if not possible.

    Not possible when Lightning's logger connector is not the class this was written against (a
    subclass of one's own, another Lightning version): the values are then converted at every step as
    before.
    """
    connector = getattr(trainer, "_logger_connector", None)
    if (
        _result_module is None
        or not callable(getattr(_result_module, "convert_tensors_to_scalars", None))
        or type(connector) is not _LoggerConnector
        or not isinstance(getattr(connector, "_progress_bar_metrics", None), dict)
    ):
        return None
    original = type(connector)
    deferred = _DEFERRED_CLASSES.get(original)
    if deferred is None:
        deferred = type(f"Deferred{original.__name__}", (_DeferredProgressBarReads, original), {})
        _DEFERRED_CLASSES[original] = deferred
    connector.__class__ = deferred

    def undo() -> None:
        if type(connector) is deferred:
            read_now(connector._progress_bar_metrics)
            connector.__class__ = original

    return undo
