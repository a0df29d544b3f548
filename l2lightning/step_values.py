"""Values a captured step bakes in from Python, snapshotted at capture and compared before each replay.

:mod:`l2lightning.step_source` finds them in the step's source and compiles a reader for each:

* :class:`CounterValue`: a number the step computes from the step counters outside a branch test
  (``w = max(0.0, (self.global_step - 10) * 0.1)``, ``1 + 0.5 * self.current_epoch``). If it stays
  the same through the warm-up steps (a ramp that starts later, a weight per epoch), no comparison
  of traced steps sees it change;
* :class:`AttributeValue`: a value read through ``self`` by attribute and constant-subscript chains
  (``self.hparams.kl_weight``, ``self.weights[0]``, ``self.cfg["w"]``), which a hook or callback may
  change in place between steps.

A reader that raises gives :data:`unreadable`, never equal to a captured value. :func:`frozen`
turns a value into something comparable (Python scalars and small containers of them; with
``tensors=True`` tensors too, by identity: a graph reads the tensor it was captured with).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch

# A value that could not be read: never equal to another, so the step is captured again
unreadable = object()


@dataclass
class CounterValue:
    """A number the step computes from the step counters outside a branch test (see ``_counter_values``)."""

    line: str  # "file:line (`source`)"
    evaluate: Callable[[Any, int], Any]  # (module, batch_idx) -> value
    # the counter read alone: compared instead where the expression gives something else than a
    # plain Python value (a tensor), which evaluating per step would compute again
    counter: Callable[[Any, int], Any]

    def value(self, module: Any, batch_idx: int) -> Any:
        try:
            value = self.evaluate(module, batch_idx)
            if not isinstance(value, _PLAIN):
                value = ("counter", self.counter(module, batch_idx))
        except Exception:  # cannot be read now: never equal to a captured value
            return unreadable
        return value


try:  # NumPy's scalars (np.float32(0.5), np.int64(3)) are numbers a step computes with, like Python's
    import numpy

    NUMPY_SCALARS: tuple[type, ...] = (numpy.generic,)
except ImportError:  # pragma: no cover - torch without NumPy
    NUMPY_SCALARS = ()

_PLAIN = (int, float, bool, str, type(None), tuple, *NUMPY_SCALARS)
# The most scalars a list, tuple or dict read by the step may hold to be compared before each replay
MAX_FROZEN_ITEMS = 64


def address(tensor: torch.Tensor) -> int | None:
    """Where `tensor`'s memory starts (what a graph reads), or None for a tensor without storage (sparse)."""
    try:
        return tensor.data_ptr()
    except RuntimeError:
        return None


def addresses(tensors: Iterable[torch.Tensor]) -> tuple:
    """:func:`address` of each of `tensors`, read in C (these run before every replay, for every
    parameter and optimizer state tensor); one by one only where a tensor has no storage."""
    tensors = tuple(tensors)
    try:
        return tuple(map(torch.Tensor.data_ptr, tensors))
    except RuntimeError:
        return tuple(map(address, tensors))


class Same:
    """A tensor in a snapshot, equal only to a snapshot of the same tensor object (it holds it, so its
    id cannot be taken by another tensor while the snapshot lives) at the same memory (a graph reads
    the address of its capture; ``t.data = other`` keeps the object and moves the memory)."""

    __slots__ = ("obj", "address")

    def __init__(self, obj: Any) -> None:
        self.obj = obj
        self.address = address(obj)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Same) and other.obj is self.obj and other.address == self.address

    def __hash__(self) -> int:
        return id(self.obj)


def frozen(value: Any, budget: list[int] | None = None, tensors: bool = False) -> Any:
    """`value` as a comparable snapshot if it is a Python scalar, or a list, tuple or dict of them (at
    most ``MAX_FROZEN_ITEMS`` in all, nested too); with `tensors`, a tensor too (by identity, for
    values a graph reads: ``self.weights["w"] = torch.full(...)`` between steps binds another one);
    else None (a module, a large container, a tensor without `tensors`)."""
    budget = [MAX_FROZEN_ITEMS] if budget is None else budget
    budget[0] -= 1  # every scalar and container counts
    if budget[0] < 0:
        return None
    if isinstance(value, (bool, int, float, str, type(None), *NUMPY_SCALARS)):
        # NaN compares unequal to itself: it is the same value here
        return ("scalar", type(value).__name__, "nan" if bool(value != value) else value)
    if tensors and isinstance(value, torch.Tensor):
        return ("tensor", Same(value))
    if isinstance(value, (list, tuple)):
        items = [frozen(v, budget, tensors) for v in value]
        return None if any(i is None for i in items) else (type(value).__name__, tuple(items))
    if isinstance(value, dict):
        items = [(k, frozen(v, budget, tensors)) for k, v in value.items()]
        if any(i is None for _, i in items) or not all(isinstance(k, (str, int)) for k, _ in items):
            return None
        return ("dict", tuple(sorted(items, key=lambda kv: str(kv[0]))))
    return None


@dataclass
class AttributeValue:
    """A value the step reads through ``self`` (``self.hparams.kl_weight``, ``self.weights[0]``,
    ``self.cfg["w"]``): a Python number there is baked into the graph (see ``_attribute_values``)."""

    line: str  # "file:line (`source`)"
    evaluate: Callable[[Any, int], Any]  # (module, batch_idx) -> value

    def value(self, module: Any, batch_idx: int) -> Any:
        """The value now, :func:`frozen` (None: not a Python number or a small container of them), or
        :data:`unreadable`."""
        try:
            return frozen(self.evaluate(module, batch_idx), tensors=True)
        except Exception:
            return unreadable


def guarded(
    evaluate: Callable[[Any, int], Any], guards: list[tuple[Callable[[Any, int], Any], bool]]
) -> Callable[[Any, int], Any]:
    """`evaluate`, read only on steps where every guard's test is on its side (else a fixed marker)."""

    def value(module: Any, batch_idx: int) -> Any:
        if all(bool(test(module, batch_idx)) == side for test, side in guards):
            return evaluate(module, batch_idx)
        return "branch not taken"

    return value
