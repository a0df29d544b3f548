"""Exclusive wall-clock time per named phase, measured by wrappers around functions: for the scripts
that split a step's or a capture's time by the code that spent it (``recapture_phases.py``,
``host_path_phases.py``).

A *window* is one unit the caller measures (a capture step, a replayed step): the caller opens it,
wraps functions into phases, and closes it. A phase's time excludes the phases opened inside it, so
the phases of a window add up to the time the wrappers saw; what no wrapper covers is the caller's to
name (the window's total minus their sum). Wrappers cost time of their own (two ``perf_counter``
calls and a Python frame each): :func:`wrapper_cost_s` measures it, for the caller to report beside
the phases.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from typing import Any


class WallPhases:
    """Exclusive wall seconds per phase, per window (a stack of the phases open)."""

    def __init__(self) -> None:
        self.stack: list[list] = []  # [name, started, seconds of the phases inside it]
        self.windows: list[dict[str, float]] = []
        self.calls: list[int] = []  # wrapped calls per window (each adds the wrapper's own cost)
        self.active = False

    def open_window(self) -> None:
        self.windows.append({})
        self.calls.append(0)
        self.stack.clear()
        self.active = True

    def close_window(self) -> None:
        self.active = False

    def wrap(self, owner: object, name: str, phase: str, undo: list, outside: str | None = None) -> None:
        """Replace `owner.name` by a wrapper timing it as `phase`, recording in `undo` what to put back
        (:func:`undo_all`). The wrapper is a plain function (no context-manager object per call): its
        own cost is what :func:`wrapper_cost_s` measures. `outside`: a call made while that phase is
        the innermost open one is no phase of its own, its time stays that phase's (a CUDA event the
        benchmark's own step timer records is the timer's, not the callback's)."""
        original = getattr(owner, name)
        raw = vars(owner).get(name, original) if isinstance(owner, type) else original
        enter, leave, stack = self._enter, self._leave, self.stack

        def timed(*args: Any, **kwargs: Any) -> Any:
            if outside is not None and stack and stack[-1][0] == outside:
                return original(*args, **kwargs)
            entry = enter(phase)
            if entry is None:
                return original(*args, **kwargs)
            try:
                return original(*args, **kwargs)
            finally:
                leave(entry)

        if isinstance(raw, classmethod):
            function = raw.__func__

            def timed_cls(cls: Any, *args: Any, **kwargs: Any) -> Any:
                entry = enter(phase)
                if entry is None:
                    return function(cls, *args, **kwargs)
                try:
                    return function(cls, *args, **kwargs)
                finally:
                    leave(entry)

            replacement: object = classmethod(timed_cls)
        else:
            # a static method stays one (the function alone would be bound to the instance)
            replacement = staticmethod(timed) if isinstance(raw, staticmethod) else timed
        undo.append((owner, name, vars(owner).get(name) if isinstance(owner, type) else original))
        setattr(owner, name, replacement)

    def _enter(self, name: str) -> list | None:
        if not self.active:
            return None
        self.calls[-1] += 1
        entry = [name, time.perf_counter(), 0.0]
        self.stack.append(entry)
        return entry

    def _leave(self, entry: list) -> None:
        spent = time.perf_counter() - entry[1]
        if not self.active or not self.stack or self.stack[-1] is not entry:
            return  # the window closed (or was opened anew) while the phase ran
        self.stack.pop()
        current = self.windows[-1]
        current[entry[0]] = current.get(entry[0], 0.0) + spent - entry[2]
        if self.stack:
            self.stack[-1][2] += spent

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """The block as `name` (for code the caller runs itself rather than a wrapped function)."""
        entry = self._enter(name)
        try:
            yield
        finally:
            if entry is not None:
                self._leave(entry)


def set_undone(undo: list, obj: object, attr: str, value: object) -> None:
    """`setattr(obj, attr, value)`, what it replaces recorded in `undo` for :func:`undo_all`."""
    undo.append((obj, attr, vars(obj).get(attr) if isinstance(obj, type) else getattr(obj, attr)))
    setattr(obj, attr, value)


def undo_all(undo: list) -> None:
    """Put back what `undo` recorded, last first (a class attribute that was not its own goes)."""
    for obj, attr, value in reversed(undo):
        if value is None and isinstance(obj, type):
            delattr(obj, attr)
        else:
            setattr(obj, attr, value)


def wrapper_cost_s(calls: int = 20000) -> float:
    """Seconds one wrapped call adds to a no-op function, measured here (median of 5 runs)."""

    class _Owner:
        @staticmethod
        def noop() -> None:
            return None

    def per_call(function: Callable[[], None]) -> float:
        started = time.perf_counter()
        for _ in range(calls):
            function()
        return (time.perf_counter() - started) / calls

    phases, undo = WallPhases(), []
    bare = sorted(per_call(_Owner.noop) for _ in range(5))[2]
    phases.wrap(_Owner, "noop", "noop", undo)
    phases.open_window()
    try:
        wrapped = sorted(per_call(_Owner.noop) for _ in range(5))[2]
    finally:
        phases.close_window()
        undo_all(undo)
    return max(wrapped - bare, 0.0)
