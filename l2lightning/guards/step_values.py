"""Values a captured step bakes in from Python, snapshotted at capture and compared before each replay.

:mod:`l2lightning.guards.step_source` finds them in the step's source and compiles a reader for each:

* :class:`CounterValue`: a number the step computes from the step counters outside a branch test
  (``w = max(0.0, (self.global_step - 10) * 0.1)``, ``1 + 0.5 * self.current_epoch``). If it stays
  the same through the warm-up steps (a ramp that starts later, a weight per epoch), no comparison
  of traced steps sees it change;
* :class:`AttributeValue`: a value read through ``self`` by attribute and constant-subscript chains
  (``self.hparams.kl_weight``, ``self.weights[0]``, ``self.cfg["w"]``), which a hook or callback may
  change in place between steps.

A reader that raises gives :data:`unreadable`, never equal to a captured value. :func:`frozen`
turns a value into something comparable, exactly: Python and NumPy scalars (a float by its bits where
``==`` would not tell: NaN, -0.0), NumPy arrays (their dtype, shape and bytes: an array written in
place shows as changed), and lists, tuples, deques, sets and dicts of them, nested too, of at most
:data:`MAX_FROZEN_ITEMS` numbers; with ``tensors=True`` tensors too, by identity: a graph reads the
tensor it was captured with. A value made of those that is too large to compare before each replay is
:class:`TooLarge` from :func:`frozen_read` (the readers of the step's values: the callback refuses by
name to capture a step that reads one) and None from :func:`frozen`, as is a value of any other kind
(a module, an object of the user's: other checks follow those).
"""

from __future__ import annotations

import decimal
import enum
import fractions
import struct
import types
from array import array
from collections import deque
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
    # the operand sites (OperandSite.key) through which alone the number reaches the step's ops: where
    # the capture gave them all device scalars, a change is written there instead of capturing again
    sites: frozenset = frozenset()

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
    NUMPY_ARRAYS: tuple[type, ...] = (numpy.ndarray,)
except ImportError:  # pragma: no cover - torch without NumPy
    NUMPY_SCALARS = ()
    NUMPY_ARRAYS = ()

_PLAIN = (int, float, bool, str, type(None), tuple, *NUMPY_SCALARS)
# The most numbers (and strings, tensors, arrays) a value the step reads (a list, tuple, deque, set or
# dict, nested ones too, each counting as one more) may hold to be compared before each replay. A flat
# container of floats, or of ints (of strings), is compared in C: 1000 floats cost about 20 us per
# replay, what 63 cost one by one before (tests/guards/test_step_values_frozen_cpu.py compares them). One of
# mixed types, tensors (by identity) or arrays is compared element by element, about 0.3 us each: each
# counts as SLOW_ITEM_COST, so at most 256 of those, about 80 us.
MAX_FROZEN_ITEMS = 1024
SLOW_ITEM_COST = 4
# The most bytes of a NumPy array the step reads compared before each replay (a copy in C: about 1 us)
MAX_FROZEN_BYTES = 64 * 1024

_SCALARS = (bool, int, float, complex, str, type(None))
_CONTAINERS = (list, tuple, deque, set, frozenset)
# element types whose values `==` tells apart exactly among values of the one type (floats are
# compared by their bits: 0.0 == -0.0, and NaN equals nothing)
_EXACT_BY_VALUE = frozenset({bool, int, str, type(None)})
_OVER = object()  # the budget of numbers ran out
# immutable values of other kinds than numbers, compared with `==`: Enum members, Fraction and
# Decimal numbers, torch's dtypes and devices, functions and bound methods (by identity)
VALUE_ATOMS = (enum.Enum, fractions.Fraction, decimal.Decimal, torch.dtype, torch.device)
_ATOMS = (*VALUE_ATOMS, types.FunctionType, types.BuiltinFunctionType, types.MethodType)


class Identity:
    """An object compared by identity in a snapshot (the user's callable a step calls from a registry:
    another object there is other code); holds it, so its id cannot be taken by another while the
    snapshot lives."""

    __slots__ = ("obj",)

    def __init__(self, obj: Any) -> None:
        self.obj = obj

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Identity) and other.obj is self.obj

    def __hash__(self) -> int:
        return id(self.obj)


# Python values a graph bakes in that a comparison before each replay reads exactly: numbers and
# strings, and the immutable values of other kinds (an Enum member, a Fraction, a dtype)
BAKED_VALUES = (*_SCALARS, *NUMPY_SCALARS, *VALUE_ATOMS)


class TooLarge:
    """A value made of numbers a graph may bake in (a list of 100000 floats, a NumPy array of 1 MB)
    that is too large to compare before each replay (:func:`frozen_read`). Equal to nothing: a
    snapshot holding one always differs, and the callback refuses by name to capture a step that
    reads one (``StepDecision._too_large_to_compare``), rather than replay a value it cannot check."""

    __slots__ = ("what",)

    def __init__(self, what: str) -> None:
        self.what = what  # "a list of 100000 numbers"

    def __eq__(self, other: object) -> bool:
        return False

    def __ne__(self, other: object) -> bool:
        return True

    __hash__ = object.__hash__

    def __repr__(self) -> str:
        return f"TooLarge({self.what!r})"


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
    """`value` as an exact, comparable snapshot (see the module's docstring): a Python or NumPy scalar,
    a NumPy array (dtype, shape, bytes: written in place, it compares changed), a list, tuple, deque,
    set or dict of them (nested too, in their order) of at most :data:`MAX_FROZEN_ITEMS` numbers; with
    `tensors`, a tensor too (by identity and address, for values a graph reads:
    ``self.weights["w"] = torch.full(...)`` between steps binds another one). Else None: a value of
    another kind (a module, an object), or one too large (:func:`frozen_read` tells it apart)."""
    out = _freeze(value, [MAX_FROZEN_ITEMS + 1] if budget is None else budget, tensors)
    return None if out is _OVER else out


def frozen_read(value: Any, tensors: bool = False) -> Any:
    """:func:`frozen` for a value the step reads, compared before each replay: one made of numbers that
    is too large to compare is :class:`TooLarge` (equal to nothing), never None, which a caller takes
    for a value of a kind other checks follow, and which would compare equal to the None of the
    capture whatever the value became."""
    out = _freeze(value, [MAX_FROZEN_ITEMS + 1], tensors)
    if out is not _OVER:
        return out
    what = _too_large(value, tensors)
    return None if what is None else TooLarge(what)


def _freeze(value: Any, budget: list[int], tensors: bool) -> Any:
    """:func:`frozen`'s snapshot, None, or _OVER where `budget` (the numbers left) runs out."""
    budget[0] -= 1  # every number, string, tensor, array and container counts
    if budget[0] < 0:
        return _OVER
    if isinstance(value, NUMPY_SCALARS):  # before float: np.float64 is one
        return ("numpy", type(value), value.dtype, value.tobytes())
    if isinstance(value, _SCALARS):
        if isinstance(value, float) and (value != value or value == 0.0):
            # NaN equals nothing, not even itself, and 0.0 == -0.0: by their bits
            return ("scalar", type(value).__name__, struct.pack("<d", value))
        if isinstance(value, complex):
            return ("scalar", type(value).__name__, struct.pack("<dd", value.real, value.imag))
        return ("scalar", type(value).__name__, value)
    if tensors and isinstance(value, torch.Tensor):
        return ("tensor", Same(value))
    if isinstance(value, NUMPY_ARRAYS):
        return _frozen_array(value, budget, tensors)
    if isinstance(value, _CONTAINERS):
        items = _frozen_items(value, budget, tensors)
        return items if items is None or items is _OVER else (type(value).__name__, items)
    if isinstance(value, _ATOMS):
        # values that a graph may bake in but that are not numbers: an Enum member, a Fraction, a
        # dtype, a function picked from a loss table (`{"ce": (1.0, F.cross_entropy)}`); `==` tells
        # them apart exactly (a function, an enum member by identity)
        return ("atom", type(value), value)
    if isinstance(value, Identity):
        return ("identity", value)
    if isinstance(value, (slice, range)):
        ends = _freeze((value.start, value.stop, value.step), budget, tensors)
        return ends if ends is None or ends is _OVER else (type(value).__name__, ends)
    if isinstance(value, dict):
        # its keys and values in their order (a sum over the values adds in it); the keys are not
        # counted in the budget (a dict of 100 weights holds 100 numbers)
        keys = _frozen_items(value.keys(), [MAX_FROZEN_ITEMS + 1], False)
        if keys is None or keys is _OVER:
            return keys
        values = _frozen_items(value.values(), budget, tensors)
        return values if values is None or values is _OVER else ("dict", keys, values)
    return None


def _frozen_items(items: Any, budget: list[int], tensors: bool) -> Any:
    """The snapshots of a container's `items`: in C where all are floats (their bytes) or all of one
    type whose values ``==`` tells apart (ints, strings), else one by one; None or _OVER as :func:`_freeze`."""
    if len(items) > budget[0]:
        return _OVER
    items = tuple(items)
    kinds = set(map(type, items))
    if len(kinds) == 1:
        (kind,) = kinds
        if kind is float:
            budget[0] -= len(items)
            return ("floats", array("d", items).tobytes())
        if kind in _EXACT_BY_VALUE:
            budget[0] -= len(items)
            return (kind.__name__, items)
    budget[0] -= (SLOW_ITEM_COST - 1) * len(items)  # _freeze counts one more for each
    if budget[0] < len(items):
        return _OVER
    out = []
    for item in items:
        snapshot = _freeze(item, budget, tensors)
        if snapshot is None or snapshot is _OVER:
            return snapshot
        out.append(snapshot)
    return tuple(out)


def _frozen_array(value: Any, budget: list[int], tensors: bool) -> Any:
    """A NumPy array's snapshot: its type, dtype, shape and bytes (and a masked array's mask); one of
    Python objects, its elements' snapshots. _OVER past :data:`MAX_FROZEN_BYTES`."""
    head = ("ndarray", type(value), value.dtype, value.shape)  # np.dtype's == tells byte orders, fields apart
    if value.dtype.hasobject:
        items = _frozen_items(value.ravel(), budget, tensors)
        return items if items is None or items is _OVER else (*head, items)
    if value.nbytes > MAX_FROZEN_BYTES:
        return _OVER
    if type(value) is numpy.ndarray:
        return (*head, value.tobytes())
    mask = getattr(value, "mask", None)  # numpy.ma: the values under the mask are not what it reads
    return (*head, value.tobytes(), None if mask is None else numpy.asarray(mask).tobytes())


def _too_large(value: Any, tensors: bool) -> str | None:
    """What `value`, whose :func:`_freeze` ran out of budget, is ("a list of 100000 numbers"), or None
    where it holds a value of a kind :func:`frozen` does not snapshot (then it is that kind's: a list of
    modules is no more compared when long than when short). Read once, at a refusal."""
    if isinstance(value, NUMPY_ARRAYS) and not value.dtype.hasobject:
        return f"a NumPy array of {value.size} {value.dtype} values ({value.nbytes} bytes)"
    kind = "NumPy array" if isinstance(value, NUMPY_ARRAYS) else type(value).__name__
    found = _leaves(value, tensors)
    if found is None:
        return None
    count, numbers, large = found
    if large is not None:
        return f"a {kind} holding {large}"
    noun = "numbers" if numbers else "values"
    if count == len(value):
        return f"a {kind} of {count} {noun}"
    return f"a {kind} of {len(value)} entries holding {count} {noun}"


def _leaves(value: Any, tensors: bool) -> tuple[int, bool, str | None] | None:
    """(how many numbers, strings and tensors `value` holds, nested too; whether all are numbers; what
    the first NumPy array too large in it is), or None where it holds a value of another kind."""
    if isinstance(value, (*NUMPY_SCALARS, *_SCALARS)) or (tensors and isinstance(value, torch.Tensor)):
        return 1, isinstance(value, (int, float, complex, *NUMPY_SCALARS)), None
    if isinstance(value, NUMPY_ARRAYS) and not value.dtype.hasobject:
        return 1, True, (_too_large(value, tensors) if value.nbytes > MAX_FROZEN_BYTES else None)
    if isinstance(value, dict):
        items: Any = value.values()
    elif isinstance(value, (*_CONTAINERS, *NUMPY_ARRAYS)):
        items = value.ravel() if isinstance(value, NUMPY_ARRAYS) else value
    else:
        return None
    count, numbers, large = 0, True, None
    for item in items:
        inner = _leaves(item, tensors)
        if inner is None:
            return None
        count, numbers, large = count + inner[0], numbers and inner[1], large or inner[2]
    return count, numbers, large


@dataclass
class AttributeValue:
    """A value the step reads through ``self`` (``self.hparams.kl_weight``, ``self.weights[0]``,
    ``self.cfg["w"]``): a Python number there is baked into the graph (see ``_attribute_values``)."""

    line: str  # "file:line (`source`)"
    evaluate: Callable[[Any, int], Any]  # (module, batch_idx) -> value
    sites: frozenset = frozenset()  # as CounterValue.sites

    def value(self, module: Any, batch_idx: int) -> Any:
        """The value now, :func:`frozen_read` (None: not made of numbers; :class:`TooLarge`: too large to
        compare), or :data:`unreadable`."""
        try:
            return frozen_read(self.evaluate(module, batch_idx), tensors=True)
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
