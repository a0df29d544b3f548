"""Re-issuing a captured step's ``self.log`` calls after each replay, at a fraction of their cost.

A replay runs no Python, so the callback re-issues every ``self.log`` call that the captured hooks
made, with this replay's values. Through ``LightningModule.log`` each one costs about as much as a
small model's whole replay (``log_cost`` in ``benchmarks/bench_host_overhead.py`` measures it), almost
all of it argument validation (``apply_to_collection`` twice, the hook's logging levels,
``inspect.signature`` of ``training_step``), building and comparing the call's ``_Metadata``, and
``_ResultMetric.to(device)``. Every replay repeats the very call the capture recorded, with the same
arguments, hook and device, so all of that gives the same answer as the first time.

``ReissuedLog`` therefore sends the first re-issue of a call through the real ``self.log`` (which
validates it and registers its ``_ResultMetric``) and later ones straight to what ``self.log`` does
with the value: the same ``clone().detach().squeeze()`` (or ``torch.tensor`` for a Python number),
the same per-hook reset, batch size and ``_ResultCollection.update_metrics``. The tensors that reach
the progress bar, ``callback_metrics`` and the loggers are computed by the same operations, so they
are bitwise those of the slow path. Whenever anything the shortcut relies on is not as it was (another
result collection, the key re-registered or reset away, another hook name, a dataloader index, a
value of another kind), the call goes through ``self.log`` again.

The most common call, a tensor logged per step only (``self.log("loss", loss)`` in
``training_step``), takes a shorter path still: Lightning's ``_ResultMetric.update`` would clone the
value once more, run it through the (inactive) distributed sync and store the clone as the step's
value; the shortcut stores one fresh copy itself. It does so only where the first, real call left
exactly that behind (the step's value a copy of the logged one, held as both the cached and the
current value), and never when the value is synced across processes (``sync_dist=True``).
"""

from __future__ import annotations

import inspect
import numbers
from collections.abc import Callable
from typing import Any

import torch
from lightning.pytorch import LightningModule

from l2lightning.guards.metric_binding import metric_type

try:  # private in Lightning: what self.log itself uses for Python numbers
    from lightning.pytorch.trainer.connectors.logger_connector.result import _get_default_dtype
except ImportError:  # pragma: no cover - an older or newer Lightning: every call takes the real path
    _get_default_dtype = None

_LOG_SIGNATURE = inspect.signature(LightningModule.log)


def _kind(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return "tensor"
    if isinstance(value, numbers.Number) and not isinstance(value, bool):
        return "number"
    metric = metric_type()
    return "metric" if metric is not None and isinstance(value, metric) else "other"


class ReissuedLog:
    """One ``self.log(name, value, *args, **kwargs)`` call a captured hook `fx` made, re-issued per replay."""

    def __init__(self, fx: str, args: tuple, kwargs: dict) -> None:
        self.fx = fx
        self.args = args
        self.kwargs = kwargs
        try:
            bound = _LOG_SIGNATURE.bind(None, *args, **kwargs)
        except TypeError:  # the real self.log raises it, at the first re-issue as in an eager step
            bound = None
        else:
            bound.apply_defaults()
        self.name: str = bound.arguments["name"] if bound else args[0]
        self.batch_size: int | None = bound.arguments["batch_size"] if bound else None
        # a call the signature does not take never gets the shortcut (enable_graph's path is the real one)
        self.enable_graph: bool = bool(bound.arguments["enable_graph"]) if bound else True
        self.fast_issues = 0  # re-issues that took the shortcut (tests read it)
        self._results: Any = None
        self._metric: Any = None
        self._key = ""
        self._value_kind = ""
        self._step_only = False  # a tensor logged per step only: the shortcut stores the step's value itself

    @property
    def value(self) -> Any:
        """The value the capture logged (a graph output tensor, a Python number or a metric)."""
        return self.args[1]

    def issue(self, module: LightningModule, log: Callable[..., Any], value: Any, results: Any) -> None:
        """Log `value` for this call as `log` (the module's real ``self.log``) would; `results` is the
        Trainer's result collection now (``trainer._results``, a property that walks the loops: read
        once for all the calls of a hook)."""
        trainer = module._trainer
        metric = self._metric
        if (
            metric is not None
            and results is self._results
            and results.get(self._key) is metric
            and not metric.meta.enable_graph
            and results.dataloader_idx is None
            and module._current_fx_name == self.fx
            and _kind(value) == self._value_kind
        ):
            self._shortcut(module, trainer, results, metric, value)
            return
        log(self.name, value, *self.args[2:], **self.kwargs)
        self._remember(trainer, results, value)

    def _remember(self, trainer: Any, results: Any, value: Any) -> None:
        self._metric = None
        self._step_only = False
        kind = _kind(value)
        if results is None or kind == "other" or self.enable_graph:
            return
        if kind == "number" and _get_default_dtype is None:
            return
        if results.dataloader_idx is not None or getattr(trainer, "barebones", False):
            return
        key = f"{self.fx}.{self.name}"
        metric = results.get(key)
        if metric is None or metric.meta.fx != self.fx:
            return
        self._results, self._metric, self._key, self._value_kind = results, metric, key, kind
        self._step_only = kind == "tensor" and _holds_a_copy_as_step_value(metric, value)

    def _shortcut(self, module: LightningModule, trainer: Any, results: Any, metric: Any, value: Any) -> None:
        connector = trainer._logger_connector
        if connector.should_reset_tensors(self.fx):
            results.reset(metrics=False, fx=self.fx)
        if self._step_only and not metric.meta.sync.should:
            _store_step_value(metric, value)
        else:
            # LightningModule.log: the value as a fresh single-element tensor (`__to_tensor`); the
            # capture's first re-issue checked its size, and replays keep shapes
            if self._value_kind == "tensor":
                value = value.clone().detach().squeeze()
            elif self._value_kind == "number":
                value = torch.tensor(value, device=module.device, dtype=_get_default_dtype()).squeeze()
            # _ResultCollection.log: the metadata and device are those of the registered metric
            batch_size = results._extract_batch_size(metric, self.batch_size, metric.meta)
            results.update_metrics(self._key, value, batch_size)
        connector._current_fx = self.fx
        self.fast_issues += 1


def _store_step_value(metric: Any, value: torch.Tensor) -> None:
    """What ``self.log`` and ``_ResultMetric.update`` leave for a tensor logged per step only, with one copy.

    ``update`` clones ``self.log``'s clone and stores it as both the cached and the current value
    (``_forward_cache`` and ``value``); the torchmetrics wrapper around it clears ``_computed`` and
    counts the update; ``update_metrics`` clears ``has_reset``. One clone of the graph's output
    gives the same values (the real path's two copies are bitwise copies too).
    """
    fresh = value.detach().squeeze().clone()
    metric._forward_cache = fresh
    metric.value = fresh
    metric._computed = None
    metric._update_count += 1
    metric.has_reset = False


def _holds_a_copy_as_step_value(metric: Any, logged: torch.Tensor) -> bool:
    """Whether the real ``self.log`` left `metric` holding a copy of `logged` as its step value and nothing else.

    True for a tensor logged on step only (not accumulated over the epoch), in float32 or float64
    (``update`` converts other dtypes), with a single element, where the registered metric caches
    a new tensor with the logged value's dtype as both its step value and its current value: what
    Lightning's ``_ResultMetric.update`` does today. Any other behaviour (another Lightning
    version) keeps the call on the general shortcut.
    """
    meta = getattr(metric, "meta", None)
    cache = getattr(metric, "_forward_cache", None)
    return (
        meta is not None
        and getattr(metric, "is_tensor", False)
        and meta.on_step
        and not meta.on_epoch
        and logged.dtype in (torch.float32, torch.float64)
        and logged.numel() == 1
        and isinstance(cache, torch.Tensor)
        and cache is getattr(metric, "value", None)
        and cache is not logged
        and cache.dtype == logged.dtype
        and cache.dim() == 0
        and isinstance(getattr(metric, "_update_count", None), int)
    )
