"""Several captured graphs in one fit: one per role a step plays in gradient accumulation.

With ``accumulate_grad_batches=N`` the micro-batches of a window do three kinds of work: the first
zeroes the gradients and makes them, the next ones add to them, the last adds to them and steps the
optimizer (:mod:`l2lightning.graph.accumulation`). Each kind is a graph of its own, all alive at once, and
the steps of a window take turns among them. What the callback keeps per graph (the graph, its
replays and sampled-check schedule, a re-capture pending or waited for, the whole-step gate's trial,
which logged values its replays re-issue) moves with it: before each step, the state of the graph
that served the last step is parked and the state of the one for this step comes back, so that the
code that decides, captures and replays reads one graph's state, as in a fit without accumulation.
A fit without accumulation only ever uses one role, and nothing is ever parked.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from l2lightning.graph.accumulation import PLAIN
from l2lightning.guards.replay_check import CheckSchedule


def fresh_state(check_share: float) -> dict[str, Any]:
    """Each per-graph attribute of the callback, as it is before its role's first capture."""
    return {
        "_graph": None,
        "_replays_since_capture": 0,  # replays of this graph, checked ones included
        "_check_schedule": CheckSchedule(check_share),  # which of its replays the sampled check computes
        "_other_branch": (None, 0),  # a branch key other than the graph's, and its run of steps
        "_recapture_next": None,  # why this role's next step captures again
        "_recapture_streak": 0,
        "_captures_here": 0,  # captures of this role (a later one is a re-capture)
        # the re-capture wait (StepDecision._capture_not_paid_for)
        "_rented_s": 0.0,
        "_rent_target_s": 0.0,
        "_rent_per_step_s": 0.0,
        "_rental_factor": 1,
        "_last_paying_step": None,  # the last optimizer step whose capture the fit's steps left pay for
        "_warmed_up_again": False,
        "_memo": [],  # the step tracer's memo of host constants, for a re-capture
    }


PER_GRAPH = tuple(fresh_state(0.0))
# The per-graph state the callback's parts keep, parked with the callback's own above: the whole-step
# gate's trial, on the graph it started with (``owner._prefetch.gate``, l2lightning.callback.prefetch_setup),
# and the logged values the graph's replays re-issue read from Python (``owner._overrides.live_log_values``,
# l2lightning.callback.step_overrides)
GATE = "_prefetch.gate"
LIVE_LOGS = "_overrides.live_log_values"


class GraphSlots:
    """The parked per-graph state of the roles other than the current one (see the module docstring)."""

    def __init__(self) -> None:
        self.current = PLAIN.role  # an optimizer step that is its window's only micro-batch
        self.parked: dict[tuple[bool, bool], dict[str, Any]] = {}
        # the checks the parked graphs' schedules put off (their counts do not move while parked), so
        # that the fit's count, asked at every replay, adds one number to the current schedule's
        self._parked_deferred = 0

    def enter(self, owner: Any, role: tuple[bool, bool]) -> None:
        """Make `role`'s per-graph state the `owner`'s (the callback's) attributes, its gate trial the
        prefetch part's (`GATE`) and its live logged values the overrides part's (`LIVE_LOGS`), parking
        the current one's."""
        if role == self.current:
            return
        prefetch, overrides = owner._prefetch, owner._overrides
        parked = {name: getattr(owner, name) for name in PER_GRAPH}
        parked[GATE] = prefetch.gate
        parked[LIVE_LOGS] = overrides.live_log_values
        self.parked[self.current] = parked
        self._parked_deferred += owner._check_schedule.deferred
        state = self.parked.pop(role, None) or {
            **fresh_state(owner.check_share),
            GATE: None,
            LIVE_LOGS: set(),
        }
        self._parked_deferred -= state["_check_schedule"].deferred
        prefetch.gate = state.pop(GATE)
        overrides.live_log_values = state.pop(LIVE_LOGS)
        for name, value in state.items():
            setattr(owner, name, value)
        self.current = role

    def parked_graphs(self) -> list[Any]:
        return [state["_graph"] for state in self.parked.values() if state["_graph"] is not None]

    def schedules(self, owner: Any) -> Iterator[CheckSchedule]:
        """The sampled check's schedule of every graph: an event (an epoch start) concerns them all."""
        yield owner._check_schedule
        for state in self.parked.values():
            yield state["_check_schedule"]

    def deferred(self, owner: Any) -> int:
        """Scheduled checks put off over the fit, all graphs together (those of graphs dropped since included)."""
        return owner._check_schedule.deferred + self._parked_deferred

    def gate_elsewhere(self) -> bool:
        """Whether the whole-step gate's trial is under way on a parked graph: until it ends, no other
        role captures (it would capture with a prefetch the trial may reject)."""
        return any(state[GATE] is not None for state in self.parked.values())

    def clear(self) -> None:
        """Drop every parked graph (the fit trains eagerly from here, or ends); their put-off checks stay counted."""
        self.parked = {}
