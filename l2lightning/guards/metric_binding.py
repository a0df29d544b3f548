"""torchmetrics objects updated inside a captured training step: their states accumulate across replays.

A metric updated in ``training_step`` runs inside the graph. Three things would go wrong if nothing
were done, and this module does each:

1. ``Metric.forward`` (the ``self.acc(preds, y)`` idiom) *reassigns* its state attributes
   (``global + local`` makes a new tensor), so a replay would compute ``pre-capture state + batch``
   into the same output every time instead of accumulating. :class:`MetricBinding` gives every
   state a *home* tensor that lives outside the graph: at the end of the captured region the graph
   copies each reassigned state into its home, and the metric's attribute points back at the home.
2. Python-side state (``_update_count``, the computed cache, ``_forward_cache`` that an
   ``on_step`` ``self.log(metric)`` reads) is set by Python the graph does not run:
   :meth:`MetricBinding.after_replay` re-applies it after each replay.
3. ``reset()`` (Lightning calls it at epoch end) assigns new tensors: the binding re-points the
   attributes at their homes, filled with the defaults, before the next replay.

Only metrics whose states are tensors reduced by sum, max or min can be replayed faithfully; list
states (``CatMetric``, unbinned AUROC) and mean- or custom-reduced states are refused by name.
Aggregation metrics (``MeanMetric`` and the like) check their input for NaN with an ``if`` on a
device tensor, a host sync; :func:`sync_free_nan_check` gives them a check without it that gives
bit-identical results whenever the input holds no NaN (with NaN, the NaN entries are weighted
zero instead of removed, so the result is the same value, without the eager path's warning).
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

# Reductions whose replay is exact: the state is a tensor combined elementwise with each batch's.
_REPLAYABLE_REDUCTIONS = ("dim_zero_sum", "dim_zero_max", "dim_zero_min")


def metric_type() -> type | None:
    """``torchmetrics.Metric`` if torchmetrics was imported, else None (it is never imported here)."""
    torchmetrics = sys.modules.get("torchmetrics")
    found = getattr(torchmetrics, "Metric", None)
    return found if isinstance(found, type) else None


def named_metrics(module: nn.Module) -> Iterator[tuple[str, Any]]:
    """(attribute path, metric) for every torchmetrics ``Metric`` among `module`'s submodules."""
    kind = metric_type()
    if kind is None:
        return iter(())
    return (
        (name, sub) for name, sub in module.named_modules() if isinstance(sub, kind) and sub is not module
    )


def drop_autograd_graphs(module: nn.Module) -> list[str]:
    """Detach metric values that still hold an earlier step's autograd graph; the attribute paths detached.

    ``Metric.forward`` computes the batch value with gradients enabled, so ``MeanMetric()(loss)``
    (the lightning-hydra-template idiom) leaves ``_forward_cache`` holding the loss's whole autograd
    graph until the next forward. That graph keeps the parameters' AccumulateGrad nodes alive, bound
    to the stream of the step that made them; a capture on another stream then accumulates through
    them and fails. Detaching changes no value: the graph was spent by that step's backward.
    """
    from torch.utils._pytree import tree_leaves, tree_map

    def has_graph(value: Any) -> bool:
        return isinstance(value, torch.Tensor) and value.grad_fn is not None

    detached = []
    for name, m in named_metrics(module):
        for attr in ("_forward_cache", "_computed"):
            value = getattr(m, attr, None)
            if value is not None and any(has_graph(v) for v in tree_leaves(value)):
                setattr(m, attr, tree_map(lambda v: v.detach() if has_graph(v) else v, value))
                detached.append(f"{name}.{attr}")
    return detached


def update_counts(module: nn.Module) -> dict[str, int]:
    """``_update_count`` of every metric in `module`, by attribute path (``update`` and ``forward`` add one)."""
    return {name: int(getattr(m, "_update_count", 0)) for name, m in named_metrics(module)}


def updated_between(before: dict[str, int], after: dict[str, int]) -> list[str]:
    """Attribute paths of the metrics whose update count changed between two snapshots."""
    return sorted(name for name, count in after.items() if count != before.get(name, 0))


def unreplayable_reason(name: str, metric: Any) -> str | None:
    """Why `metric` cannot be updated inside a replayed graph, or None."""
    for attr, default in metric._defaults.items():
        if not isinstance(default, torch.Tensor):
            return (
                f"`{name}` ({type(metric).__name__}) keeps a list state `{attr}` that grows with each update, "
                "which a graph cannot do; update it in `on_train_batch_end` from the outputs training_step returns"
            )
        reduction = getattr(metric._reductions.get(attr), "__name__", repr(metric._reductions.get(attr)))
        if reduction not in _REPLAYABLE_REDUCTIONS:
            return (
                f"`{name}` ({type(metric).__name__}) reduces its state `{attr}` with {reduction}, which reads "
                "its update count in Python; update it in `on_train_batch_end` instead"
            )
    return None


def sync_free_nan_check(metric: Any) -> Any:
    """A ``_cast_and_nan_check_input`` for an aggregation metric with no host sync (see module docstring)."""
    fill = {"MaxMetric": float("-inf"), "MinMetric": float("inf")}.get(type(metric).__name__, 0.0)
    strategy = metric.nan_strategy

    def check(x: Any, weight: Any = None) -> tuple[torch.Tensor, torch.Tensor]:
        if not isinstance(x, torch.Tensor):
            x = torch.as_tensor(x, dtype=metric.dtype, device=metric.device)
        if weight is not None and not isinstance(weight, torch.Tensor):
            weight = torch.as_tensor(weight, dtype=metric.dtype, device=metric.device)
        if weight is None:
            weight = torch.ones_like(x)
        bad = torch.isnan(x) | torch.isnan(weight)
        if isinstance(strategy, float):
            x = torch.where(bad, torch.full_like(x, strategy), x)
            weight = torch.where(bad, torch.ones_like(weight), weight)
        else:
            x = torch.where(bad, torch.full_like(x, fill), x)
            weight = torch.where(bad, torch.zeros_like(weight), weight)
        return x.to(metric.dtype), weight.to(metric.dtype)

    return check


def needs_sync_free_nan_check(metric: Any) -> bool:
    """Aggregation metrics whose NaN check syncs: every strategy but ``"disable"`` and ``"error"``."""
    strategy = getattr(metric, "nan_strategy", None)
    return hasattr(metric, "_cast_and_nan_check_input") and strategy not in (None, "disable", "error")


class MetricBinding:
    """The metrics a captured step updates, bound to home tensors that accumulate across replays.

    Build it right before the capture with the metrics the warm-up saw updated; call
    :meth:`bring_home` at the end of the captured region (still inside the capture) and before each
    replay, :meth:`finish_capture` after the capture, :meth:`after_replay` after each replay.
    """

    def __init__(self, metrics: dict[str, Any]) -> None:
        self.metrics = dict(metrics)
        # (metric, attr) -> home tensor, the object the attribute held before the capture
        self.homes: dict[tuple[str, str], torch.Tensor] = {
            (name, attr): getattr(m, attr) for name, m in self.metrics.items() for attr in m._defaults
        }
        self._counts = {name: int(m._update_count) for name, m in self.metrics.items()}
        self._deltas: dict[str, int] = {}
        self._forward_caches: dict[str, Any] = {}
        self._plain_attributes = {name for name, m in self.metrics.items() if _plain_step_attributes(m)}

    def state_tensors(self) -> list[torch.Tensor]:
        """Every home tensor (for snapshots that must undo what a warm-up or a capture changed)."""
        return list(self.homes.values())

    def bring_home(self) -> None:
        """Copy each reassigned state into its home and point the attribute back at the home.

        At the end of the captured region (so every replay does it), and before each replay
        (``reset()`` and eager steps assign new tensors between replays).
        """
        with torch.no_grad():
            for (name, attr), home in self.homes.items():
                metric = self.metrics[name]
                current = getattr(metric, attr)
                if current is not home:
                    home.copy_(current)
                    setattr(metric, attr, home)

    def rebind(self) -> None:
        """Point every state attribute at its home tensor, leaving the homes' values as they are."""
        for (name, attr), home in self.homes.items():
            if getattr(self.metrics[name], attr) is not home:
                setattr(self.metrics[name], attr, home)

    def finish_capture(self) -> None:
        """After the capture: what one replay does to each metric's Python-side state."""
        for name, m in self.metrics.items():
            self._deltas[name] = int(m._update_count) - self._counts[name]
            self._forward_caches[name] = m._forward_cache

    def fresh_forward_caches(self) -> None:
        """Each metric's step value as a fresh tensor (the graph overwrites its own at the next replay)."""
        for m in self.metrics.values():
            if isinstance(m._forward_cache, torch.Tensor):
                # detached: the capture's autograd graph must not outlive the capture (drop_autograd_graphs)
                m._forward_cache = m._forward_cache.detach().clone()

    def after_replay(self) -> None:
        """Re-apply what the step's Python did to each metric: count, cache, the step's value."""
        for name, m in self.metrics.items():
            cache = self._forward_caches.get(name)
            # a fresh tensor per step: loggers and callback_metrics may keep it past the next replay
            cache = cache.detach().clone() if isinstance(cache, torch.Tensor) else cache
            count = m._update_count + self._deltas.get(name, 0)
            if name in self._plain_attributes:
                # what nn.Module.__setattr__ ends in for these attributes, without its checks per step
                m.__dict__.update(_update_count=count, _computed=None, _forward_cache=cache)
            else:
                m._update_count, m._computed, m._forward_cache = count, None, cache

    def python_state(self) -> dict[str, tuple[int, Any, Any]]:
        """The Python-side state of every bound metric (to put back after a step that must leave no trace)."""
        return {name: (m._update_count, m._forward_cache, m._computed) for name, m in self.metrics.items()}

    def restore_python_state(self, saved: dict[str, tuple[int, Any, Any]]) -> None:
        for name, (count, cache, computed) in saved.items():
            m = self.metrics[name]
            m._update_count, m._forward_cache, m._computed = count, cache, computed


_STEP_ATTRIBUTES = ("_update_count", "_computed", "_forward_cache")


def _plain_step_attributes(metric: Any) -> bool:
    """Whether setting `metric`'s per-step attributes is a plain instance-dict write.

    True when its class keeps torchmetrics' ``__setattr__`` (which only refuses a few constant names,
    then defers to ``nn.Module.__setattr__``) and none of the attributes is a parameter, buffer or
    submodule: ``nn.Module.__setattr__`` then ends in ``object.__setattr__``.
    """
    metric_class = metric_type()
    if metric_class is None or type(metric).__setattr__ is not metric_class.__setattr__:
        return False
    managed = (
        getattr(metric, "_parameters", {}),
        getattr(metric, "_buffers", {}),
        getattr(metric, "_modules", {}),
    )
    return all(name in vars(metric) and not any(name in d for d in managed) for name in _STEP_ATTRIBUTES)
