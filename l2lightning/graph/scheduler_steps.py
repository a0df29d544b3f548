"""LR schedulers that a manual step steps itself: stepped again after each replay, in the step's order.

Under manual optimization Lightning leaves the LR schedulers to the step (``sch = self.lr_schedulers();
sch.step()``, Lightning's manual-optimization docs), and a replay runs none of the step's Python. So for
the fit the callback wraps each configured scheduler's ``step`` (:class:`SchedulerSteps`). At the
capture a call is recorded, not run, as a :class:`ReissuedSchedulerStep` among the step's ``self.log`` calls
(:class:`~l2lightning.guards.log_replay.ReissuedLog`), and every replay (the capture's own first one included)
re-issues it in that order with the logs: the learning rate the next step reads (a device tensor that
the capturable optimizer fills from the float before each replay) and what the step logs after it
(``sch.get_last_lr()``, re-evaluated per replay) are what an eager step leaves. Eager steps (warm-up,
fallbacks, the sampled check's eager step) step the schedulers as they are.

What a replay cannot repeat this way, :class:`~l2lightning.graph.manual_step.ManualStep` refuses by name at
the warm-up step that shows it: a scheduler stepped with arguments (``ReduceLROnPlateau.step(metric)``
reads the metric on the host) or before its optimizer's step (that step's update would read the learning
rate the schedule had not moved yet in the replay), and a schedule that moves a hyperparameter the
optimizer bakes into the graph (OneCycleLR's momentum).

The wrapper is an instance attribute, so it shows in the scheduler's ``state_dict`` (torch saves the
whole ``__dict__`` but the optimizer): :meth:`SchedulerSteps.portable_states` drops it from a checkpoint.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

# a scheduler whose instance held no `step` of its own before the fit (the class's shows again after it)
_NO_STEP = object()


class ScheduledStep:
    """One configured LR scheduler whose ``step`` the callback handles during the fit.

    Attributes:
        scheduler: the scheduler.
        calls: how many times the scheduler's own ``step`` has run since the wrapper was installed.
    """

    def __init__(self, scheduler: Any) -> None:
        self.scheduler = scheduler
        self.calls = 0
        self._step: Callable[..., Any] = scheduler.step

    @property
    def optimizer(self) -> Any:
        return getattr(self.scheduler, "optimizer", None)

    @property
    def name(self) -> str:
        return type(self.scheduler).__name__

    def run(self, *args: Any, **kwargs: Any) -> Any:
        """The scheduler's own ``step``."""
        self.calls += 1
        return self._step(*args, **kwargs)


class ReissuedSchedulerStep:
    """A scheduler step the capture recorded in hook `fx`, among its log calls: re-issued per replay."""

    def __init__(self, fx: str, scheduled: ScheduledStep) -> None:
        self.fx = fx
        self.scheduled = scheduled

    def issue(self) -> None:
        """The scheduler steps as the captured step's Python stepped it."""
        self.scheduled.run()


class SchedulerSteps:
    """The ``step`` wrappers on the Trainer's LR schedulers for a manual-optimization fit.

    Args:
        handler: called as ``handler(entry, args, kwargs)`` for every call of a wrapped ``step``; it
            runs ``entry.run(*args, **kwargs)`` or records the call (the capture).
    """

    def __init__(self, handler: Callable[[ScheduledStep, tuple, dict], Any]) -> None:
        self.handler = handler
        self.entries: list[ScheduledStep] = []
        self._wrappers: list[tuple[Any, Any, Callable[..., Any]]] = []  # (scheduler, before, wrapper)

    def install(self, schedulers: Sequence[Any]) -> None:
        for scheduler in schedulers:
            entry = ScheduledStep(scheduler)

            # A plain function, not a bound method: copy.deepcopy of a scheduler's state_dict (the
            # capture saves the schedulers' states that way) would deep-copy a method's scheduler
            def step(*args: Any, _entry: ScheduledStep = entry, **kwargs: Any) -> Any:
                return self.handler(_entry, args, kwargs)

            self._wrappers.append((scheduler, vars(scheduler).get("step", _NO_STEP), step))
            scheduler.step = step
            self.entries.append(entry)

    def uninstall(self) -> None:
        for scheduler, before, step in self._wrappers:
            if vars(scheduler).get("step") is not step:
                continue  # replaced again by someone else during the fit: theirs stays
            if before is _NO_STEP:
                del scheduler.step
            else:
                scheduler.step = before
        self._wrappers = []
        self.entries = []

    def counts(self) -> list[int]:
        """How often each scheduler has stepped (compare two readings to see which stepped between)."""
        return [e.calls for e in self.entries]

    def portable_states(self, states: list[Any]) -> None:
        """Drop the wrappers from the schedulers' state dicts a checkpoint holds (in the Trainer's order)."""
        wrappers = {id(step) for _, _, step in self._wrappers}
        for state in states:
            if isinstance(state, dict) and id(state.get("step")) in wrappers:
                del state["step"]
