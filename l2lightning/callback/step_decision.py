"""What each optimizer step does: replay, capture (again), or run eagerly, and why.

A part :class:`l2lightning.callback.graph_callback.L2GraphCallback` holds (``_decision``), one per fit:
:meth:`StepDecision.decide` runs before every step the callback wraps (``StepDispatch.step``). The
part declares in its own ``__init__`` what it alone writes (the module-level values compared before
each replay, why a step is checked, the operand scalars' changes, the steps a re-capture waited, the
fallback steps and their causes, the module flags it reads per replay, a refusal due at the next
step); what it keeps per graph (the branch run, the re-capture streak and wait) is the graph's, in
``graph_slots.RoleState``. It reads the fit and the step through
:class:`l2lightning.callback.fit_state.FitState` and reaches the rest of the callback only through
what it is given: the report, warm-up and prefetch parts, the graph slots, the callback's settings,
its replay check report and set of warned keys, and bound methods of the callback (which a Trainer
that spawns its processes pickles with it).
"""

from __future__ import annotations

import functools
import math
import time
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from l2lightning.graph.accumulation import accumulation_of
from l2lightning.graph.capture import read_batch
from l2lightning.guards import numerics_settings, python_state
from l2lightning.guards.compiled_calls import partial_arguments
from l2lightning.guards.module_flags import ModuleFlags
from l2lightning.guards.step_source import rebound_code
from l2lightning.guards.step_trace import describe_frame
from l2lightning.guards.step_values import (
    MAX_FROZEN_BYTES,
    MAX_FROZEN_ITEMS,
    NUMPY_ARRAYS,
    TooLarge,
    addresses,
    frozen_read,
)

if TYPE_CHECKING:  # the warm-up part imports this module's helpers: a cycle at run time
    from l2lightning.callback.fit_report import FitReport
    from l2lightning.callback.fit_state import FitState
    from l2lightning.callback.prefetch_setup import PrefetchSetup
    from l2lightning.callback.warmup_steps import WarmupSteps
    from l2lightning.graph.graph_slots import GraphSlots
    from l2lightning.guards.replay_check import ReplayCheckReport

# Module-level values python_state.baked_globals leaves out that step_values.frozen snapshots exactly
_UNCOMPARED_CONTAINERS = (*NUMPY_ARRAYS, deque, set, frozenset)
# Re-captures on consecutive steps after which a schedule is taken to change the graph every step.
RECAPTURE_STREAK_LIMIT = 3
# Steps on one other branch in a row after which that branch is captured in place of the current one
BRANCH_SWITCH_STEPS = 3
# How to keep a number a schedule moves at every step (a KL or loss-weight ramp, a cosine weight from
# global_step) out of the graph's baked constants: the graph then reads it from memory, one capture
PER_STEP_NUMBER_ADVICE = (
    "to capture the step once, keep the number in a registered buffer that a hook fills before each "
    "step (`self.register_buffer('w', torch.tensor(0.0))`; `self.w.fill_(schedule(self.global_step))` in "
    "`on_train_batch_start`; `loss + self.w * aux` in the step): a replay reads it from memory, and one "
    "capture serves the whole schedule"
)
# Why a replay is checked when it is one of the first with a new value in the graph's operand scalars,
# and how many of a graph's changes are checked so (a number that moves at every step, a KL ramp from
# global_step, is then left to the sampled check's schedule: the graph and the evaluation of its
# numbers are the same at every later change)
OPERAND_CHECK = "operand value changed"
OPERAND_CHECKS = 3
# The cause a waiting step counts under in summary()["fallback_causes"]
WAIT_CAUSE = "waiting to capture again until the eager steps have cost what a capture costs"
TOO_LATE_CAUSE = "too few steps left in the fit to pay for another capture"


def last_paying_step(trainer: Any, cost_s: float, saved_per_step_s: float) -> float:
    """The last optimizer step at which a capture costing `cost_s` still pays for itself before the fit
    ends, each later step saving `saved_per_step_s`; infinity where the fit's length is not known.

    The fit's length is Lightning's own estimate (``trainer.estimated_stepping_batches``: max_steps, or
    the epochs' batches over the accumulation factor). A fit that stops sooner (``max_time``, early
    stopping) can still end before a capture pays; one that runs to its end cannot."""
    try:
        total = float(trainer.estimated_stepping_batches)
    except Exception:  # noqa: BLE001 -- no estimate (an unsized loader): the fit's end is not known
        return math.inf
    if not math.isfinite(total) or total <= 0:
        return math.inf
    return total - math.ceil(cost_s / saved_per_step_s)


class StepDecision:
    """What each optimizer step does: replay, capture (again), or run eagerly, and why."""

    def __init__(
        self,
        fit: FitState,
        fit_report: FitReport,
        warmup: WarmupSteps,
        prefetch: PrefetchSetup,
        slots: GraphSlots,
        *,
        eager_steps: Callable[[Any, int], bool] | None,
        recapture_wait: bool,
        check_on: bool,
        rental_devices: tuple[str, ...],
        replay_check: ReplayCheckReport,
        warned: set[str],
        disable: Callable[[str], None],
        warn_once: Callable[[str, str], None],
        device_type: Callable[[], str],
        manual: Callable[[], bool],
        installed: Callable[[], dict[str, Any]],
        last_capture_cost: Callable[[], float | None],
        operand_lines: Callable[[], list[str]],
    ) -> None:
        self._fit = fit
        self._fit_report = fit_report  # the measured eager and replayed step times (the re-capture wait)
        self._warmup = warmup  # what the warm-up decides before the first capture of a graph
        self._prefetch = prefetch  # the whole-step gate's turn at a replay
        # the per-graph state of the graph serving the step (l2lightning.graph.graph_slots), read once per
        # method into a local: its graph, branch run, re-capture streak and wait, check schedule
        self._slots = slots
        # The callback's settings as this fit starts (each fit makes a new part): `eager_steps`,
        # `recapture_wait`, whether the sampled replay check is on (verify="sampled"), and the devices
        # whose step timings decide when a re-capture pays (its class attribute, which tests widen)
        self._eager_steps = eager_steps
        self._recapture_wait = recapture_wait
        self._check_on = check_on
        self._rental_devices = rental_devices
        # the callback's replay check report, made per fit as the parts are (a scheduled check deferred
        # for the check's share of the fit's time is counted there)
        self._replay_check = replay_check
        # The keys the callback's warn_once has warned under (its set, filled in place): a wait's start
        # after the first asks it before building its warning
        self._warned = warned
        # The callback's, as bound methods: refuse the fit (the rest trains eagerly, saying why), warn once
        # per key, the device's type; and what is the callback's and rebound during the fit, so asked
        # when needed (never per replay): whether the step is a manual one (set up after this part is
        # made), the module methods set-up installed, the last capture's cost (StepDispatch measures it),
        # the operand sites the last capture read from device scalars (StepCapture sets them)
        self._disable = disable
        self._warn_once = warn_once
        self._device_type = device_type
        self._manual = manual
        self._installed = installed
        self._last_capture_cost = last_capture_cost
        self._operand_lines = operand_lines
        # The module-level NumPy arrays, deques and sets the step reads (``loss * WEIGHTS[0]``), as
        # step_values.frozen snapshots taken as the step is captured, compared before each replay like
        # python_state.baked_globals' containers (which holds lists, tuples and dicts only). Rebound, never
        # changed in place, by _too_large_to_compare.
        self._module_values: list[tuple[dict, str, Any]] = []
        self.check_why = ""  # why this step is checked (CheckSchedule.due; StepDispatch's check reads it)
        # the values written to the operand scalars since the fit's start (summary()['operand_scalars'])
        self.operand_changes = 0
        self.waited_steps = 0  # steps run eagerly while a re-capture waited (within `fallback_steps`)
        # the steps it ran eagerly (a fallback, `eager_steps`, a re-capture's wait) and why (the callback's
        # public `fallback_steps` and summary()['fallback_causes'])
        self.fallback_steps = 0
        self.fallback_causes: set[str] = set()
        # the module's train()/requires_grad flags and code, read before every replay (made at the
        # fit's first read of them; the capture records them through module_flags() and reads the
        # tensors and registrations they count); released at the fit's end
        self.flags: ModuleFlags | None = None
        # why the next step trains eagerly for the rest of the fit (disable_at_next_step), or None
        self._disable_next: str | None = None

    def release(self) -> None:
        """The fit's end (or a new fit's start): the module flags' global registration hooks removed."""
        if self.flags is not None:
            self.flags.close()
            self.flags = None

    def disable_at_next_step(self, reason: str) -> None:
        """Between steps: the next step the callback decides trains eagerly, and the rest of the fit, for `reason`."""
        self._disable_next = reason

    def decide(self, closure: Any) -> str:
        """What this step does: "eager", "trace" (warm-up), "time" (untraced timed warm-up), "capture",
        "check" (a sampled replay check), "replay". `closure`: the one the optimizer's step got (Lightning's
        accumulation state is read off it)."""
        role = self._slots.state  # this step's graph's (l2lightning.graph.graph_slots)
        if self._fit.disabled_reason or self._fit.pending is None or self._fit.optimizer is None:
            return "eager"
        if self._disable_next is not None:  # disable_at_next_step
            self._disable(self._disable_next)
            return "eager"
        rebound = rebound_code(self._fit.code_bindings)
        if rebound:
            # the branch tests, values and logs compared before each replay were read from the old code,
            # and a replay would run it: this step and the rest of the fit run the new code eagerly
            self._disable(
                f"the code the step runs was rebound since the training start ({', '.join(rebound)}): its "
                "source was read then, and a replay would run the captured code"
            )
            return "eager"
        trainer, module = self._fit.trainer, self._fit.module
        batch, batch_idx = self._fit.pending
        # Lightning's accumulation state: an accumulating micro-batch, and a closing one that adds to the
        # gradients the earlier ones left, are graphs of their own (l2lightning.graph.accumulation), the factor
        # in their key; _enter_role made this role's graph the current one (l2lightning.graph.graph_slots)
        accumulation = accumulation_of(trainer, closure, module)
        if isinstance(accumulation, str):
            self.fall_back(accumulation)
            return "eager"
        if self._eager_steps is not None and self._eager_steps(trainer, batch_idx):
            self._count_fallback("`eager_steps` asked for it")
            return "eager"
        # values in parts of the batch the step never reads (file names, ids) may change
        tensors, signature = read_batch(batch, self._fit.batch_reads)
        self._fit.pending_tensors = tensors  # a replay copies them into the static batch
        key = ((self._fit.source.branch_key(module, batch_idx), accumulation), signature)
        self._fit.pending_key = key
        graph = role.graph
        if graph is None:
            decision = self._warmup.decision(key)
            if decision == "capture" and self._slots.gate_elsewhere():
                # captured once the trial has chosen whether the fit's graphs prefetch
                self.fall_back(
                    f"{accumulation.describe()}: waiting for the whole-step gate's trial on another graph"
                )
                return "eager"
            if decision == "capture" and (problem := self._too_large_to_compare()):
                self._disable(problem)
                return "eager"
            return decision
        if key[0] != graph.key[0]:
            # A branch that stays switched (clipping on from step 10, an auxiliary loss from epoch 1)
            # gets a graph of its own after a few steps; a periodic one (a target sync every N
            # steps) keeps running eagerly on its steps.
            run = role.other_branch[1] + 1 if role.other_branch[0] == key[0] else 1
            role.other_branch = (key[0], run)
            if key[0][1] != graph.key[0][1]:
                # an epoch's shorter last window, or a GradientAccumulationScheduler's new factor
                if run > BRANCH_SWITCH_STEPS and key[1] == graph.static.signature:
                    role.other_branch = (None, 0)
                    return self._recapture(
                        f"gradient accumulation changed and stayed changed ({key[0][1].describe()})"
                    )
                self.fall_back(
                    f"gradient accumulation ({key[0][1].describe()}) other than the captured graph's "
                    f"({graph.key[0][1].describe()})"
                )
                return "eager"
            if run > BRANCH_SWITCH_STEPS and key[1] == graph.static.signature:
                role.other_branch = (None, 0)
                return self._recapture("the step's branch changed and stayed changed")
            self.fall_back("the step takes another branch on the step counters than the captured one")
            return "eager"
        role.other_branch = (None, 0)
        if key[1] != graph.static.signature:
            self.fall_back(f"batch {batch_idx}: {graph.static.mismatch(batch)}")
            return "eager"
        for carried in graph.carried:
            problem = carried.mismatch()
            if problem:
                self.fall_back(f"the carried state {problem}")
                return "eager"
        if role.recapture_next:
            # before the rest of the checks: a waiting step (_capture_not_paid_for) runs
            # eagerly whatever they find, and the capture that ends the wait reads everything anew
            cause, role.recapture_next = role.recapture_next, None
            return self._recapture(cause)
        flags = self.module_flags()
        # an accumulating micro-batch's graph neither reads nor writes the optimizer's state
        replaced = self._fit.optimizer.state_replaced() if accumulation.closes else None
        if replaced:
            # the graph updates the old state tensors: this step makes the new state eagerly
            role.recapture_next = f"{replaced} since capture"
            self.fall_back(f"{replaced} since capture (captured again next step)")
            return "eager"
        if flags != graph.flags:
            if flags[1] != graph.flags[1]:
                # new trainable parameters need their optimizer state made eagerly, outside a graph
                role.recapture_next = "parameters' `requires_grad` changed since capture"
                self.fall_back("parameters' `requires_grad` changed since capture (captured again next step)")
                return "eager"
            if flags[0] == graph.flags[0]:  # as many modules (one `training` each): their code differs
                changed, replaced = self.flags.changed_code(graph.flags, flags)
                if replaced:  # `self.act = nn.GELU()`, in the module's tree (`self.net[1] = ...` too)
                    return self._recapture(
                        f"the functions or submodules the step calls were replaced since capture "
                        f"({_first_names(replaced)})"
                    )
                return self._recapture(
                    f"the code of layers changed since capture (their class, their class's `forward` or a `forward` "
                    f"assigned to the instance: {_first_names(changed)}; a replay runs the captured code)"
                )
            return self._recapture("modules' `train()`/`eval()` mode changed since capture")
        changes = self._fit.optimizer.baked_changes() if accumulation.closes else None
        if changes:
            return self._recapture(f"the optimizer's {', '.join(changes)} (baked into the graph)")
        if graph.hooks is not None and graph.hooks.changed(module):
            return self._recapture(
                "hooks were registered on or removed from the module, its layers or its parameters since "
                "capture (a replay runs the capture's hooks only)"
            )
        scalars = python_state.changed_scalars(graph.scalars)
        if graph.containers:
            scalars += python_state.changed_containers(graph.containers)
        if self._module_values:
            scalars += python_state.changed_containers(self._module_values)
        if scalars:
            return self._recapture(f"Python numbers the step reads changed ({', '.join(scalars)})")
        now = addresses(graph.registered_tensors)
        if now != graph.data_ptrs:
            # `p.data = ...` or `module.half()` between steps: the graph's addresses are no longer the
            # tensors' (and the old memory may already hold something else)
            moved = [name for (name, _), a, b in zip(graph.registered, now, graph.data_ptrs) if a != b]
            return self._recapture(
                f"parameters' or buffers' data moved since capture ({', '.join(moved[:3])}"
                f"{', ...' if len(moved) > 3 else ''}: `tensor.data = ...`, a dtype change)"
            )
        replaced = python_state.rebound(graph.callables)
        if replaced:
            return self._recapture(
                f"the functions or submodules the step calls were replaced since capture ({', '.join(replaced)})"
            )
        if graph.partials:
            bound = python_state.changed_partial_bindings(graph.partials)
            if bound:
                return self._recapture(
                    f"the arguments `functools.partial` binds changed since capture ({', '.join(bound)})"
                )
        rebound = python_state.rebound(graph.tensors, module)
        if self.flags.generation != graph.generation:
            # something was registered since capture: a parameter or buffer may be a new tensor
            rebound += self.flags.rebound(graph.registered)
            if not rebound:
                graph.generation = self.flags.generation
        if rebound:
            return self._recapture(
                f"the module's tensors {_first_names(rebound)} are other objects than at capture (the graph reads "
                "the old ones; update them in place, `self.w.mul_(0.9)`, to keep one graph)"
            )
        if graph.tensor_addresses and python_state.addresses(graph.tensors) != graph.tensor_addresses:
            moved = python_state.moved(graph.tensors, graph.tensor_addresses)
            return self._recapture(
                f"the module's tensors {_first_names(moved)} hold other memory than at capture (`t.data = ...`, "
                "`t.set_(...)`; the graph reads the old memory)"
            )
        # after the tensors' own check, whose message is the more specific for an attribute's tensor
        counters = self._fit.source.changed_counter_values(
            graph.counters, module, batch_idx, graph.counters_served
        )
        if counters:
            return self._recapture(
                f"numbers the step computes from the step counters changed ({'; '.join(counters)})"
            )
        attributes = self._fit.source.changed_attribute_values(graph.attributes, module, batch_idx)
        if attributes:
            return self._recapture(f"values the step reads changed ({'; '.join(attributes)})")
        changed_hosts = [read for read in graph.host_reads if read.changed()]
        if changed_hosts:
            if graph.constants is not None:
                graph.constants.take_changed_sources()  # the next capture substitutes the new values
            where = sorted({describe_frame(read.frame) for read in changed_hosts})
            return self._recapture(
                f"host tensors the step reads changed in place since capture (read at {', '.join(where[:3])}"
                f"{', ...' if len(where) > 3 else ''}; the graph holds the values it read then)"
            )
        numerics = numerics_settings.read()
        if numerics != graph.numerics:
            changed = "; ".join(numerics_settings.changes(graph.numerics, numerics))
            return self._recapture(
                f"torch's numerics settings changed since capture ({changed}; the graph holds the kernels "
                "its capture chose)"
            )
        fresh = False  # one of the first replays with a new value in the operand scalars
        if graph.operands is not None:
            written = graph.operands.update(module, batch_idx)
            if written is None:
                return self._recapture(
                    "a number the graph reads from a device scalar is no longer a Python int or float "
                    f"(one of {', '.join(self._operand_lines())})"
                )
            if written:
                self.operand_changes += 1
                fresh = graph.operands.changes <= OPERAND_CHECKS
        role.recapture_streak = 0
        role.replays_since_capture += 1
        if self._check_on:
            started = self._fit.started_at
            elapsed = time.perf_counter() - started if started is not None else float("inf")
            report = self._replay_check
            why = role.check_schedule.due(report.seconds, elapsed)
            report.deferred = self._slots.deferred()
            if fresh:
                # the eager step from the same state judges the new value (one check for it and any
                # check the schedule had due: its count of replays moves on as at any replay)
                why = OPERAND_CHECK
            if why is not None:
                self.check_why = why
                return "check"  # a gate trial under way takes its next turn at the next replay
        gate = role.gate
        if gate is not None:
            prefetch = self._prefetch
            if gate.needs_off_graph:
                prefetch.gate_capturing = True
                return "capture"
            if gate.complete:
                prefetch.finish_gate()
            else:
                prefetch.gate_turn = gate.next_variant()
                try:
                    role.graph = gate.graph_for(prefetch.gate_turn)
                except RuntimeError as exc:  # the driver refused to switch a prefetch node
                    role.graph = gate.graphs["prefetch"]
                    prefetch.abandon_gate(f"the prefetch kernel nodes could not be switched ({exc})")
        return "replay"

    def _recapture(self, cause: str) -> str:
        role = self._slots.state  # this step's graph's (l2lightning.graph.graph_slots)
        too_late = self._too_late_to_capture()  # asked first: the wait's bookkeeping below moves on
        if self._capture_not_paid_for(cause):
            # The graph is stale and stays unused (the cause is kept, so it never replays again):
            # these steps run eagerly, as a plain step does, until they have cost what a capture costs.
            role.recapture_next = cause
            self.waited_steps += 1
            self._count_fallback(TOO_LATE_CAUSE if too_late else WAIT_CAUSE)
            return "eager"
        problem = self._too_large_to_compare()
        if problem:  # a value the step reads grew past what a comparison before each replay holds
            self._disable(problem)
            return "eager"
        role.recapture_streak += 1
        if role.recapture_streak >= RECAPTURE_STREAK_LIMIT:
            per_step = cause.startswith("numbers the step computes from the step counters")
            self._disable(
                f"{cause}, on {role.recapture_streak} steps in a row: every step would need a new capture"
                + (f"; {PER_STEP_NUMBER_ADVICE}" if per_step else "")
            )
            return "eager"
        self._warn_once(f"recapture:{cause.split(' ')[0]}", f"capturing the step again: {cause}.")
        return "capture"

    def _capture_not_paid_for(self, cause: str) -> bool:
        """Whether this step runs eagerly instead of capturing again (warned once per fit), or False to capture now.

        A capture costs the fit its wall time; each replay saves the eager step's time less the
        replay's. A value that changes every few steps (a loss weight an epoch hook sets over short
        epochs) captured again at each change makes the fit slower than plain (the ``epoch_weighted_aux``
        idiom: 0.32x on the H200, ``benchmarks/results/h200/idioms_sgd_gradnorm_recapture.csv``). So,
        as one rents skis until the rent paid equals the price: after a change the steps run eagerly
        until what they cost over replays (the measured eager step less the measured replay, per
        step) adds up to what the last capture took (of the fit's first capture, what a later one
        repeats: StepDispatch._eager_modes leaves out its full garbage collection), and only then is
        the step captured again. A value that changes sooner costs no capture; one that stays costs
        at most one capture's time more than capturing at once. Only where both step times are
        measured on the device (CUDA events of warm-up steps and replays): without them the step is
        captured again at once. And not at all once the fit's steps left (Lightning's estimate of its
        length, :func:`last_paying_step`) are too few for the replays to save what the capture costs:
        a capture near the fit's end made it slower than plain (the ``aux_loss_flag`` and
        ``rebound_loss_weight`` idioms, captured again at steps 59 and 55 of 60: 0.86x and 0.94x on an
        H100, ``benchmarks/results/h100/idioms.csv``).
        """
        role = self._slots.state  # this step's graph's (l2lightning.graph.graph_slots)
        if not self._recapture_wait or role.captures_here == 0:
            return False
        if role.rented_s > 0.0:
            # A step of a wait under way: its saving per step was fixed at the wait's start (the
            # step times it reads do not change while no graph replays), so a waiting step does
            # no more than a plain step's bookkeeping (benchmarks/recapture_phases.py).
            if role.rented_s >= role.rent_target_s:
                if self._too_late_to_capture():
                    self._warn_too_late_to_capture()
                    return True  # the rest of the fit runs eagerly: no capture it could pay back
                role.rented_s = 0.0
                return False
            role.rented_s += role.rent_per_step_s
            return True
        if self._device_type() not in self._rental_devices:
            return False
        cost = self._last_capture_cost()
        eager_ms, graph_ms = self._fit_report.timing.eager_ms(), self._fit_report.timing.graph_ms()
        if cost is None or eager_ms is None or graph_ms is None:
            return False
        saved_per_step = (eager_ms - graph_ms) / 1000.0
        if saved_per_step <= 0:
            return False  # no graph has shown a gain here: capturing at once changes nothing to the cost
        # the start of a wait: did the stale graph pay for its capture? Each one that did not
        # doubles the next wait, so captures that do not pay grow rarer and rarer
        paid = role.replays_since_capture * saved_per_step >= cost
        role.rental_factor = 1 if paid else role.rental_factor * 2
        target = cost * role.rental_factor
        if target <= 0.0:
            return False
        role.rent_target_s, role.rent_per_step_s = target, saved_per_step
        role.rented_s = saved_per_step
        # Under manual optimization Lightning's estimate counts batches where global_step counts each
        # optimizer step (two a batch for a GAN): no common unit, so no bound there
        role.last_paying_step = (
            last_paying_step(self._fit.trainer, cost, saved_per_step) if not self._manual() else math.inf
        )
        if "recapture-wait" in self._warned:
            return True
        self._warn_once(
            "recapture-wait",
            f"the step will be captured again ({cause}) once the eager steps since have cost about what a "
            f"capture costs ({target:.3f} s, at {saved_per_step * 1000:.2f} ms per step: about "
            f"{max(1, round(target / saved_per_step))} steps, twice as many after each graph that did not pay "
            "for its capture); until then it runs eagerly, so that a value that changes every few steps costs no "
            "capture each time (counted in `summary()['fallback_steps']` and `['recapture_wait_steps']`)",
        )
        return True

    def _too_late_to_capture(self) -> bool:
        """Whether a wait under way is over and the fit's steps left are too few to pay for the capture."""
        role = self._slots.state  # this step's graph's (l2lightning.graph.graph_slots)
        return (
            role.rented_s > 0.0
            and role.rented_s >= role.rent_target_s
            and self._fit.trainer.global_step > role.last_paying_step
        )

    def _warn_too_late_to_capture(self) -> None:
        role = self._slots.state  # this step's graph's (l2lightning.graph.graph_slots)
        self._warn_once(
            "recapture-too-late",
            f"not capturing the step again: the fit's optimizer steps after step {role.last_paying_step} "
            f"are too few to pay for a capture ({self._last_capture_cost():.3f} s at "
            f"{role.rent_per_step_s * 1000:.2f} ms saved per step, by `trainer.estimated_stepping_batches`); "
            "the rest of the fit runs eagerly, as plain Lightning's does",
        )

    def _too_large_to_compare(self) -> str | None:
        """A refusal, naming it, where a value the step reads is made of numbers a graph may bake in but
        is too large to compare before each replay (:class:`l2lightning.guards.step_values.TooLarge`): a replay
        runs no Python, so a hook that changed it (`self.class_weights = ...`, an array written in
        place) would go unseen. Asked before each capture: of the values read through ``self`` and
        module-level chains (``StepSource.attribute_values``), the module-level names the step reads
        (``StepSource.global_reads``), and the arguments the ``functools.partial`` it calls bind."""
        module, source = self._fit.module, self._fit.source
        batch_idx = self._fit.pending[1] if self._fit.pending is not None else 0
        found = []
        for value in source.attribute_values:
            now = value.value(module, batch_idx)
            if isinstance(now, TooLarge):
                found.append(f"{now.what} at {value.line}")
        callables, module_values = [], []
        for namespace, names in source.global_reads.values():
            for name in sorted(names):
                if name.startswith("__") or name not in namespace:
                    continue
                held = namespace[name]
                now = frozen_read(held, tensors=True)
                if isinstance(now, TooLarge):
                    found.append(f"{now.what} in the module-level `{name}`")
                elif isinstance(held, _UNCOMPARED_CONTAINERS) and now is not None:
                    module_values.append((namespace, name, now))
                elif isinstance(held, functools.partial):
                    callables.append((name, held))
        self._module_values = module_values
        callables += [
            (name, held)
            for _, name, held in python_state.baked_callables(module, source.reads, None, self._installed())
            if isinstance(held, functools.partial)
        ]
        for name, held in callables:
            now = frozen_read(partial_arguments(held), tensors=True)
            if isinstance(now, TooLarge):
                found.append(f"{now.what} bound by the `functools.partial` `{name}`")
        if not found:
            return None
        more = f" (and {len(found) - 1} more)" if len(found) > 1 else ""
        return (
            f"the step reads {found[0]}{more}, too large to compare before each replay (at most "
            f"{MAX_FROZEN_ITEMS} numbers, or a NumPy array of {MAX_FROZEN_BYTES // 1024} KiB, are): a replay "
            "runs no Python, so a change to it would go unseen; keep it in a tensor buffer "
            "(`self.register_buffer(...)`, updated in place), which the graph reads from memory"
        )

    def module_flags(self) -> tuple:
        """The module's flags as they are now (ModuleFlags.read): compared before each replay, recorded at capture."""
        if self.flags is None:
            self.flags = ModuleFlags(self._fit.module)
        return self.flags.read()

    def _count_fallback(self, cause: str) -> None:
        self.fallback_steps += 1
        self.fallback_causes.add(cause)

    def fall_back(self, cause: str) -> None:
        """This one step runs eagerly; the graph stays for later steps."""
        kind = cause.split(":", 1)[-1].strip()
        self._count_fallback(kind)
        self._warn_once(
            f"fallback:{kind}", f"running this step eagerly ({cause}); the graph is kept for later steps."
        )


def _first_names(names: list[str], shown: int = 6) -> str:
    """The first `shown` of `names`, and how many there are in all when that is more."""
    if len(names) <= shown:
        return ", ".join(names)
    return f"{', '.join(names[:shown])}, ... ({len(names)} in all)"
