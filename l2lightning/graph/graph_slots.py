"""Several captured graphs in one fit: one per role a step plays in gradient accumulation.

With ``accumulate_grad_batches=N`` the micro-batches of a window do three kinds of work: the first
zeroes the gradients and makes them, the next ones add to them, the last adds to them and steps the
optimizer (:mod:`l2lightning.graph.accumulation`). Each kind is a graph of its own, all alive at once, and
the steps of a window take turns among them. What the callback's parts keep per graph (the graph, its
replays and sampled-check schedule, a re-capture pending or waited for, the whole-step gate's trial,
which logged values its replays re-issue) is one object, a :class:`RoleState`; before each step the one
of the graph that served the last step is parked and the one of this step's role becomes
``GraphSlots.state``, so that the code that decides, captures and replays reads one graph's state, as
in a fit without accumulation. A fit without accumulation only ever uses one role, and nothing is ever
parked.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from l2lightning.graph.accumulation import PLAIN
from l2lightning.guards.replay_check import CheckSchedule


class RoleState:
    """What the callback's parts keep per captured graph, as it is before its role's first capture.
    Slots: a typo in a name raises instead of keeping a second, unread copy."""

    __slots__ = (
        "graph",
        "replays_since_capture",
        "check_schedule",
        "other_branch",
        "recapture_next",
        "recapture_streak",
        "captures_here",
        "rented_s",
        "rent_target_s",
        "rent_per_step_s",
        "rental_factor",
        "last_paying_step",
        "warmed_up_again",
        "memo",
        "gate",
        "live_log_values",
    )

    def __init__(self, check_share: float) -> None:
        self.graph: Any = None  # the captured graph (l2lightning.callback.step_capture._Graph)
        self.replays_since_capture = 0  # replays of this graph, checked ones included
        self.check_schedule = CheckSchedule(check_share)  # which of its replays the sampled check computes
        self.other_branch: tuple[Any, int] = (
            None,
            0,
        )  # a branch key other than the graph's, and its run of steps
        self.recapture_next: str | None = None  # why this role's next step captures again
        self.recapture_streak = 0
        self.captures_here = 0  # captures of this role (a later one is a re-capture)
        # the re-capture wait (l2lightning.callback.step_decision, _capture_not_paid_for)
        self.rented_s = 0.0
        self.rent_target_s = 0.0
        self.rent_per_step_s = 0.0
        self.rental_factor = 1
        self.last_paying_step: int | None = (
            None  # the last optimizer step whose capture the steps left pay for
        )
        self.warmed_up_again = False
        self.memo: list[Any] = []  # the step tracer's memo of host constants, for a re-capture
        # the whole-step gate's trial, on the graph it started with (l2lightning.callback.prefetch_setup)
        self.gate: Any = None
        # the logged values the graph's replays re-issue read from Python (l2lightning.callback.step_overrides)
        self.live_log_values: set[str] = set()


class GraphSlots:
    """The per-graph state of the current role (`state`) and the parked one of the others (see the
    module docstring). Every part reads the current one through the same GraphSlots, so a role's
    switch is one assignment that all of them see."""

    def __init__(self, check_share: float) -> None:
        self._check_share = check_share
        self.current = PLAIN.role  # an optimizer step that is its window's only micro-batch
        self.state = RoleState(check_share)
        self.parked: dict[tuple[bool, bool], RoleState] = {}
        # the checks the parked graphs' schedules put off (their counts do not move while parked), so
        # that the fit's count, asked at every replay, adds one number to the current schedule's
        self._parked_deferred = 0

    def enter(self, role: tuple[bool, bool]) -> None:
        """Make `role`'s per-graph state the current one, parking the current one's."""
        if role == self.current:
            return
        self.parked[self.current] = self.state
        self._parked_deferred += self.state.check_schedule.deferred
        state = self.parked.pop(role, None) or RoleState(self._check_share)
        self._parked_deferred -= state.check_schedule.deferred
        self.state, self.current = state, role

    def parked_graphs(self) -> list[Any]:
        return [state.graph for state in self.parked.values() if state.graph is not None]

    def schedules(self) -> Iterator[CheckSchedule]:
        """The sampled check's schedule of every graph: an event (an epoch start) concerns them all."""
        yield self.state.check_schedule
        for state in self.parked.values():
            yield state.check_schedule

    def deferred(self) -> int:
        """Scheduled checks put off over the fit, all graphs together (those of graphs dropped since included)."""
        return self.state.check_schedule.deferred + self._parked_deferred

    def gate_elsewhere(self) -> bool:
        """Whether the whole-step gate's trial is under way on a parked graph: until it ends, no other
        role captures (it would capture with a prefetch the trial may reject)."""
        return any(state.gate is not None for state in self.parked.values())

    def clear(self) -> None:
        """Drop every parked graph (the fit trains eagerly from here, or ends); their put-off checks stay counted."""
        self.parked = {}
