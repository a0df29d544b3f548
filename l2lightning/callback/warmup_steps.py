"""Warm-up steps: traced and compared before anything is captured, or timed.

A part :class:`l2lightning.callback.graph_callback.L2GraphCallback` holds (``_warmup``), one per fit: it
keeps what the warm-up learns (the traced steps by group, the hooks that may run after each replay,
where the step draws hidden random state) in its own ``__init__``, reads the fit through
:class:`l2lightning.callback.fit_state.FitState` and reaches the rest of the callback only through
the callables it is given (refuse the fit, serve the step's operand scalars, make CUDA events).
"""

from __future__ import annotations

import re
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from lightning.pytorch import LightningModule

from l2lightning.callback.fit_report import FitReport
from l2lightning.callback.fit_state import FitState
from l2lightning.callback.step_decision import PER_STEP_NUMBER_ADVICE, _first_names
from l2lightning.graph.attributes import ABSENT
from l2lightning.graph.carried_state import split_carried
from l2lightning.graph.joined_optimizers import members_of, optimizer_names
from l2lightning.graph.operand_scalars import substituting
from l2lightning.graph.optim import baked_schedule_advice
from l2lightning.guards import python_state
from l2lightning.guards.hook_writes import possible_writes
from l2lightning.guards.metric_binding import (
    named_metrics,
    unreplayable_reason,
    update_counts,
    updated_between,
)
from l2lightning.guards.step_trace import (
    StepTrace,
    StepTracer,
    describe_frame,
    first_difference,
    sync_free_bincount,
)
from l2lightning.guards.step_values import unreadable

# Traced warm-up steps after which a fit that found no capturable stretch stops trying.
MAX_TRACED_STEPS = 24


def metric_update_reason(names: list[str], detail: str | None = None) -> str:
    """Why torchmetrics objects updated inside ``training_step`` keep the step from being captured."""
    return (
        f"training_step updates the torchmetrics objects {names}, and "
        + (detail or "a replayed graph would skip their Python-side state")
        + "; update them in `on_train_batch_end` from the outputs training_step returns "
        "(for example `return {'loss': loss, 'preds': preds.detach()}`)"
    )


# the hooks that may run after each replay instead of inside the graph (_after_replay_obstacle)
AFTER_REPLAY_HOOKS = ("on_after_backward", "on_before_optimizer_step")


@dataclass
class _Group:
    """Traced warm-up steps that share a batch signature and a branch through the step."""

    traces: list[StepTrace] = field(default_factory=list)
    metrics: set[str] = field(default_factory=set)
    problem: str | None = None  # why this group can never be captured
    dropped_first: bool = False  # its first traced step differed from the next and was set aside
    timed: int = 0  # untraced, timed eager steps of this group
    appended: list[frozenset[str]] = field(default_factory=list)  # lists each traced step appended to
    # the module's Python numbers its source reads and the numbers the step computes from the step
    # counters (StepSource.counter_values), as the last traced step read them: a difference between
    # two traced steps names the number that made their work differ
    last_read: dict[str, Any] | None = None
    last_counters: tuple | None = None


class WarmupSteps:
    """Warm-up steps: traced and compared before anything is captured, or timed."""

    def __init__(
        self,
        fit: FitState,
        fit_report: FitReport,
        *,
        warmup_steps: int,
        report: bool,
        own_callback: Any,
        disable: Callable[[str], None],
        operand_scalars: Callable[[bool, int], Any],
        events: Callable[[], tuple[Any, Any]],
        device_type: Callable[[], str],
        compiled_children: list[torch.nn.Module],
        callback_overrides: list[tuple[Any, str, Any]],
    ) -> None:
        self._fit = fit
        self._fit_report = fit_report
        self._warmup_steps = warmup_steps
        self._report = report  # the step report's kernel counts: timed steps are profiled instead
        self._own_callback = own_callback  # the callback holding this part: not one of the step's holders
        self._disable = disable  # refuse the fit: the rest of it trains eagerly, saying why
        # the step's operand sites as device scalars (StepCapture.operand_scalars: the capture part is made
        # after this one, so asked through the callback)
        self._operand_scalars = operand_scalars
        self._events = events
        self._device_type = device_type
        # the children compile=True compiled (PrefetchSetup) and the other callbacks' hooks the callback
        # wrapped, as (callback, hook, what its instance held): the callback's lists, filled at set-up
        self._compiled_children = compiled_children
        self._callback_overrides = callback_overrides
        # traced warm-up steps by batch signature and branch (StepDecision keys them)
        self.groups: dict[tuple, _Group] = {}
        self.baked_history: list[Any] = []  # the optimizer's baked hyperparameters at each warm-up step
        self.traced_steps = 0
        self.tracer: StepTracer | None = None  # the tracer of the traced step under way
        # the hooks that sync with the host and run after each replay instead of inside the graph
        self.eager_hooks: set[str] = set()
        # per hook name, what its functions' code may write (l2lightning.guards.hook_writes), read once a fit
        self._hook_writes: dict[str, list[str]] = {}
        # where the step draws from cuDNN's RNN dropout state (a buffer outside torch's generators):
        # eager work beside the fit's steps that cannot put it back (the prefetch's dry run, the
        # capture's eager check) is off; the sampled check saves and puts it back
        self.hidden_random: str | None = None

    def _why_no_two_batches_agree(self) -> str:
        """When only the batches' non-tensor values kept the warm-up steps apart, say so."""
        keys = list(self.groups)
        same_shapes_and_branch = len({(k[0], k[1][1]) for k in keys}) == 1
        if len(keys) > 1 and same_shapes_and_branch:
            return (
                ": every batch held other non-tensor values (strings, numbers) and the step reads them "
                "(a replay runs no Python, so it could not see them); compute what the step needs from "
                "them in the dataset, as tensors, or stop reading them in training_step"
            )
        return ""

    def decision(self, key: tuple) -> str:
        group = self.groups.setdefault(key, _Group())
        if key[0][1].closes:  # (an accumulating micro-batch's graph bakes no hyperparameter)
            self.baked_history.append(self._fit.optimizer.baked_snapshot())
        traced_needed = max(1, self._warmup_steps - 1)
        if len(group.traces) < traced_needed:
            if self.traced_steps >= MAX_TRACED_STEPS:
                self._disable(
                    f"no {traced_needed} warm-up steps in the first {MAX_TRACED_STEPS} shared a batch shape and a "
                    f"branch through training_step{self._why_no_two_batches_agree()}"
                )
                return "eager"
            return "trace"
        if group.problem:
            self._disable(group.problem)
            return "eager"
        if self._warmup_steps > 1 and group.timed < 1:
            return "time"
        problem = self._baked_every_step()
        if problem:
            self._disable(problem)
            return "eager"
        return "capture"

    def _baked_every_step(self) -> str | None:
        """A refusal when a baked hyperparameter changed between every pair of traced steps (a per-step schedule)."""
        snapshots = self.baked_history[-(self._warmup_steps + 1) :]
        if len(snapshots) < 3 or any(a == b for a, b in zip(snapshots, snapshots[1:])):
            return None
        changed = sorted(
            {
                k
                for a, b in zip(snapshots, snapshots[1:])
                for ga, gb in zip(a, b)
                for k in ga
                if ga[k] != gb.get(k)
            }
        )
        name = optimizer_names(self._fit.optimizer)  # several: a manual step's (`Adam, SGD`)
        return (
            f"{name}'s {changed} changed at every warm-up step (a per-step schedule such as OneCycleLR); {name} bakes "
            f"them into the graph as numbers, so every step would need a new capture. {baked_schedule_advice(changed)}"
        )

    def timed_step(self, run: Callable[..., Any], closure: Any, kwargs: dict) -> Any:
        self.groups[self._fit.pending_key].timed += 1
        self._fit.mode = "eager"
        if self._report:
            # profiled (and so not timed) to count the kernels each phase launches
            return self._fit_report.kernel_counter.profile(lambda: run(closure, **kwargs))
        start, end = self._events()
        start.record()
        out = run(closure, **kwargs)
        end.record()
        self._fit_report.timing.eager.append((start, end))
        return out

    def traced_step(self, run: Callable[..., Any], closure: Any, kwargs: dict) -> Any:
        """An eager warm-up step under the tracer; refusals come before this step's optimizer update."""
        key = self._fit.pending_key
        group = self.groups[key]
        tracer = StepTracer(self._device_type())
        tracer.parameter_storages = self._updated_storages()
        before = update_counts(self._fit.module)
        self._fit.mode = "trace"
        self.traced_steps += 1
        holders = self.python_holders()
        python_before = python_state.snapshot(holders, device_type=tracer.device_type)
        # the user's optimizer's own Python runs around the closure (`optimizer.step(closure)`): its
        # state is compared over the whole step
        optimizers = self.optimizer_holders()
        optimizer_before = python_state.snapshot(optimizers, generators=False)
        if tracer.device_type != "cpu":  # training on the host, its tensors are the step's device's
            tracer.host_state = python_state.host_tensors(holders)
        # The step's operand sites get device scalars here too (bitwise the same work: see
        # l2lightning.graph.operand_scalars), so a number that moves at every step (a KL ramp from global_step)
        # leaves the traces alike, where a baked one makes every two warm-up steps differ
        operands = self._operand_scalars(False, self._fit.pending[1])

        def traced() -> Any:
            with substituting(operands):
                out = self.run_traced(tracer, closure)
            # lists that grow by one element per step can be re-appended after each replay
            python_after = python_state.snapshot(holders, device_type=tracer.device_type)
            appended, python_changed = python_state.split_appends(python_before, python_after)
            # tensors the step rebinds to its own results (a recurrent hidden state): replayed as carried state
            _, python_changed = split_carried(python_before, python_after, tracer.made, python_changed)
            python_changed += self.optimizer_writes()
            group.appended.append(frozenset(a.label for a in appended))
            tracer.trace.problems += python_state.read_appended_elements(appended, tracer.trace.read_ids)
            tracer.trace.problems += self._branches_on_appended(appended)
            self._judge_trace(
                group, tracer.trace, updated_between(before, update_counts(self._fit.module)), python_changed
            )
            return out

        out = run(traced, **kwargs)
        changed = python_state.changed(optimizer_before, python_state.snapshot(optimizers, generators=False))
        if changed and self.traced_steps > 1:
            # this step ran eagerly as configured, its update included: plain Lightning's step
            self._disable(self.python_problem(changed))
        return out

    def _branches_on_appended(self, appended: list[python_state.Append]) -> list[str]:
        """Problems for the branches of the step that test a list or deque it appends to.

        The callback picks a replay's branch before the step runs (its tests are evaluated on the
        module), where an eager step tests after its own code ran up to there: a window kept by hand,
        ``self.window.append(x); if len(self.window) > 8: self.window.pop(0)``, was replayed as the
        branch without the pop on the step that first overflows, and kept one element too many from
        then on (found on the emulator). Whatever the order in the source, such a test reads what the
        step changes, so the step is not captured."""
        problems = []
        for where in appended:
            path = where.label.strip("`").split("[", 1)[0]  # `self.outputs['loss']`: the dict attribute
            reads = re.compile(rf"(?<![\w.]){re.escape(path)}\b")
            problems += [
                f"the branch at {c.line} tests {where.label}, which the step appends to: a replay's branch is "
                "chosen before the step runs, an eager step's after the append; keep the count in a tensor, "
                "or decide in `on_train_batch_start`"
                for c in self._fit.source.conditions
                if c.evaluate is not None and reads.search(c.line.split(" (`", 1)[-1])
            ]
        return problems

    def _updated_storages(self) -> frozenset[int]:
        """Storages the optimizer step updates: the module's parameters and the optimizer's state tensors."""
        tensors = list(self._fit.module.parameters())
        if self._fit.optimizer is not None:
            for state in self._fit.optimizer.optimizer.state.values():
                tensors += [v for v in state.values() if isinstance(v, torch.Tensor)]
        # a sparse tensor has no storage of its own, its values and indices have: SGD's momentum for an
        # nn.Embedding(sparse=True) in a fit resumed from a checkpoint, read here before the first
        # traced step refuses sparse gradients (_judge_trace)
        dense = [p for t in tensors for p in ((t._values(), t._indices()) if t.is_sparse else (t,))]
        return frozenset(t.untyped_storage().data_ptr() for t in dense)

    def run_traced(self, tracer: StepTracer, closure: Any) -> Any:
        """Lightning's closure under `tracer` (the captured hooks and ``self.log`` consult it)."""
        self.tracer = tracer
        try:
            loggers = self._fit.trainer.loggers if self._fit.trainer is not None else ()
            with (
                tracer,
                tracer.memoized(),
                tracer.watching_seeds(),
                tracer.watching_output(loggers),
                tracer.watching_compiled_inputs(self.compiled_submodules()),
                sync_free_bincount(),
            ):
                return closure() if closure is not None else None
        except Exception as exc:
            real = tracer.real_error(exc)  # an out-of-memory error autograd's device thread lost
            if real is exc:
                raise
            raise real from exc
        finally:
            self.tracer = None

    def compiled_submodules(self) -> list[tuple[str, torch.nn.Module]]:
        """The submodules whose calls run compiled code, by name: those the user wrapped with
        ``torch.compile(module)`` or compiled in place with ``module.compile()`` and, with
        ``compile=True``, the children this callback compiled."""
        # no torch.compile yet in this process: no compiled module (and dynamo, slow to import, stays out)
        eval_frame = sys.modules.get("torch._dynamo.eval_frame")
        if self._fit.module is None or eval_frame is None:
            return []
        ours = {id(child) for child in self._compiled_children}
        return [
            (name, sub)
            for name, sub in self._fit.module.named_modules()
            if isinstance(sub, eval_frame.OptimizedModule)
            or sub.__dict__.get("_compiled_call_impl") is not None
            or id(sub) in ours
        ]

    def python_holders(self) -> list[tuple[str, Any]]:
        """The objects whose Python state a captured step could change: the module, its submodules,
        the Trainer's other callbacks (their hooks inside the step are captured with it), the objects
        whose methods run as hooks, and the Python modules whose globals the step's code reads (a
        module-level list it appends to)."""
        callbacks = [cb for cb in getattr(self._fit.trainer, "callbacks", []) if cb is not self._own_callback]
        holders = python_state.owners(self._fit.module, [*callbacks, *self._fit.hook_owners])
        # under manual optimization the optimizers step inside training_step: their Python is the step's
        holders += self.optimizer_holders()
        return holders + python_state.global_namespaces(self._fit.source.global_reads.values())

    def optimizer_holders(self) -> list[tuple[str, Any]]:
        """The optimizers the step steps whose class is the user's own, by class name: their ``step``'s
        Python runs inside the captured step (python_state.optimizer_owners)."""
        if self._fit.optimizer is None:
            return []
        return python_state.optimizer_owners(m.optimizer for m in members_of(self._fit.optimizer))

    def optimizer_writes(self) -> list[str]:
        """The optimizer hyperparameters the step's own code has written so far (inside the step)."""
        return self._fit.optimizer.hyperparameter_writes() if self._fit.optimizer is not None else []

    def python_problem(self, changed: list[str], trace: StepTrace | None = None) -> str:
        """Why a step that changes the Python state `changed` cannot be replayed (`trace`: the step's,
        whose draws on the host name their lines)."""
        owned = tuple(f"`{label}." for label, _ in self.optimizer_holders())
        stepped = [label for label in changed if owned and label.startswith(owned)]
        if stepped:
            others = [label for label in changed if label not in stepped]
            return (
                f"the optimizer's step changes Python state ({', '.join(stepped)}) at every step, which a "
                "replay (it runs no Python) would freeze: the graph holds the optimizer's step as it ran at "
                "the capture. Keep such state in tensors the step updates in place (`self.t.add_(1)`, with "
                "`torch.where` for a branch on it), change it outside the optimizer's step "
                "(`on_train_batch_end`), or run such steps eagerly with "
                "`eager_steps=lambda trainer, batch_idx: ...`"
                + (f"; the step changes other Python state too ({', '.join(others)})" if others else "")
            )
        draws = trace.host_draws if trace is not None else []
        if python_state.TORCH_CPU_RANDOM_LABEL in changed and draws:
            # the GAN tutorial's `torch.randn(n, latent_dim)` then `.type_as(imgs)`: numbers drawn on the
            # host and copied to the device, which a graph holds as the capture's copy
            lines = sorted({f"`{op.split('::')[-1]}` at {describe_frame(frame)}" for op, frame in draws})
            others = [label for label in changed if label != python_state.TORCH_CPU_RANDOM_LABEL]
            return (
                f"the step draws random numbers on the host, from torch's global CPU generator "
                f"({'; '.join(lines[:3])}); a replay runs only the GPU's work, so it would reuse the numbers "
                "of the capture and leave the generator where the capture left it (every later draw from it, "
                "a DataLoader's shuffle included, would differ from plain training). Draw on the device "
                "instead (`torch.randn(..., device=self.device)`: each replay draws anew from the GPU's "
                "generator), or run such steps eagerly with `eager_steps=lambda trainer, batch_idx: ...`"
                + (f"; the step changes other Python state too ({', '.join(others)})" if others else "")
            )
        if any(label.startswith("param group") for label in changed):
            return (
                f"the step changes the optimizer's hyperparameters ({', '.join(changed)}), which a replay "
                "(it runs no Python) would freeze at the capture's values; step LR schedulers through "
                'Lightning (`configure_optimizers` returning the scheduler with `"interval": "step"`), '
                "or set them in `on_train_batch_start`, not inside `training_step`"
            )
        if any(map(python_state.names_a_generator, changed)):
            advice = (
                "draw with torch on the device instead (`torch.rand(..., device=self.device)`: each replay "
                "draws anew)"
            )
        else:
            advice = (
                "keep it in a tensor updated in place (`self.running.mul_(0.9).add_(x)`, not "
                "`self.running = 0.9 * self.running + x`), change it in `on_train_batch_end`"
            )
        return (
            f"the step changes Python state ({', '.join(changed)}) at every step, "
            f"which a replay (it runs no Python) would freeze; {advice}, or run such steps eagerly with "
            "`eager_steps=lambda trainer, batch_idx: ...`"
        )

    def _judge_trace(
        self, group: _Group, trace: StepTrace, updated: list[str], python_changed: list[str]
    ) -> None:
        """Compare a traced step with its group; refuse (before the update) what can never be replayed."""
        sparse = [
            name for name, p in self._fit.module.named_parameters() if p.grad is not None and p.grad.is_sparse
        ]
        if sparse:
            # torch's optimizers take sparse gradients on paths of their own (coalescing reads sizes on
            # the host), and a graph holds a sparse gradient's nonzeros as of the capture
            self._disable(
                f"parameters with sparse gradients ({_first_names([f'`{n}`' for n in sparse], 3)}: "
                "`nn.Embedding(sparse=True)` or "
                "`nn.EmbeddingBag(sparse=True)`) are not captured; dense gradients (`sparse=False`) are"
            )
            return
        if trace.hidden_random and self.hidden_random is None:
            self.hidden_random = describe_frame(trace.hidden_random[0])
        # the numbers the step read this time (a hook moves them after the step: `self.ptr` of a queue)
        values = {
            name: value
            for _, name, value in python_state.baked_scalars(self._fit.module, self._fit.source.reads, set())
        }
        batch_idx = self._fit.pending[1] if self._fit.pending is not None else 0
        counters = self._fit.source.counter_snapshot(self._fit.module, batch_idx)
        metrics = dict(named_metrics(self._fit.module))
        for name in updated:
            reason = unreplayable_reason(name, metrics[name])
            if reason:
                self._disable(metric_update_reason([name], reason))
                return
        problem = None
        for hook in sorted(trace.parameter_reading_hooks & self.eager_hooks):
            # let run after replays at an earlier traced step, it now reads what the step updates
            self.eager_hooks.discard(hook)
            problem = (
                f"`{hook}` turns tensors into host values, so it would run after each replay, but it reads "
                "parameters or the optimizer's state, which after a replay hold the step's update already; log "
                "tensors (`self.log(name, tensor)`) instead of Python numbers so it can stay in the graph"
            )
        for hook in sorted(trace.host_hooks | {h for _, _, h in trace.syncs if h}):
            self._runs_after_replay(hook, trace)  # marks the hooks that will run after each replay
        for hook in sorted(trace.host_hooks):
            if not self._runs_after_replay(hook, trace):
                problem = (
                    f"`{hook}` builds tensors from host values (`torch.tensor([...])`, often of `.item()`s, as "
                    "Lightning's `grad_norm` does), which a graph cannot hold, and cannot run after each replay "
                    f"instead: {self._after_replay_obstacle(hook, trace)}; log tensors (`self.log(name, tensor)`) "
                    "instead of Python numbers so it can stay in the graph"
                )
        syncs = [s for s in trace.syncs if not self._runs_after_replay(s[2], trace)]
        if syncs and problem is None and not trace.problems and not group.traces and not group.dropped_first:
            # A first step that syncs once is set aside, like a first step that builds something: a
            # lazy initialization (cuDNN seeds its RNN dropout state with a number read back at the
            # first nn.LSTM call after torch.manual_seed). The traced steps after it must not sync.
            group.dropped_first = True
            group.metrics.update(updated)
            return
        if syncs and problem is None:
            what, frame, hook = syncs[0]
            # a hook whose reads alone would run after each replay: why this one cannot
            obstacle = self._after_replay_obstacle(hook, trace) if hook in AFTER_REPLAY_HOOKS else None
            problem = (
                f"{what} at {describe_frame(frame)} makes the host wait for the GPU inside the step, which a CUDA "
                "graph cannot hold"
                + (f" (and `{hook}` cannot run after each replay instead: {obstacle})" if obstacle else "")
                + "; log the tensor with `self.log` instead, or run such steps eagerly with "
                "`eager_steps=lambda trainer, batch_idx: ...`"
            )
        elif trace.problems:
            problem = trace.problems[0]
        elif python_changed and self.traced_steps > 1:
            # the first traced step may build something once (a lazy cache, an `initialized` flag)
            problem = self.python_problem(python_changed, trace)
        elif len(group.appended) > 1 and group.appended[-1] != group.appended[-2] and self.traced_steps > 1:
            # a list appended to at one step and not the next: no one element per replay to redo
            problem = self.python_problem(sorted(group.appended[-1] ^ group.appended[-2]))
        elif group.traces:
            difference = first_difference(group.traces[-1], trace, skip_hooks=self.eager_hooks)
            if difference and len(group.traces) == 1 and not group.dropped_first:
                # the first step often builds something once (a cached positional encoding, a lazy
                # layer): it is dropped, and the steps after it must agree with each other
                group.traces, group.dropped_first = [], True
                difference = None
            if difference:
                moved = _moved_between(group.last_read, values)
                computed = _computed_differently(
                    self._fit.source.counter_values, group.last_counters, counters
                )
                problem = (
                    f"two warm-up steps ran different work ({difference}); a graph replays one of them. "
                    + (
                        f"The step reads {moved}, which changed between them: a number a graph bakes in, changed "
                        "between every two steps, needs a capture per step. Keep it in a tensor (a buffer updated "
                        "in place) or compute it on the device"
                        if moved
                        else f"The step computes a number from the step counters that changed between them, at "
                        f"{computed}: a graph bakes such a number in, so each step would need its own capture; "
                        f"{PER_STEP_NUMBER_ADVICE}"
                        if computed
                        else "If the difference is a periodic branch, pass `eager_steps=lambda trainer, batch_idx: ...` "
                        "for its steps"
                    )
                )
        group.traces.append(trace)
        group.last_read, group.last_counters = values, counters
        group.metrics.update(updated)
        if problem and not any(c.evaluate is not None and c.on_counters for c in self._fit.source.conditions):
            # no branch on the step counters: this step's branch is, as far as can be told, every step's
            self._disable(problem)
        elif problem:
            group.problem = group.problem or problem

    def _runs_after_replay(self, hook: str | None, trace: StepTrace) -> bool:
        """Whether a hook that syncs can run eagerly after each replay instead of inside the graph
        (see :meth:`_after_replay_obstacle`); marks it so, or unmarks it."""
        if self._after_replay_obstacle(hook, trace) is not None:
            self.eager_hooks.discard(hook)  # an earlier traced step may have let it run after replays
            return False
        self.eager_hooks.add(hook)
        return True

    def _after_replay_obstacle(self, hook: str | None, trace: StepTrace) -> str | None:
        """Why hook `hook` cannot run after each replay, or None where it can.

        Only hooks that read the step's gradients and write nothing (``self.log_dict(grad_norm(self, 2))``
        turns each norm into a Python float) and see, after a replay, exactly what they see in an eager
        step: ``on_after_backward`` and ``on_before_optimizer_step``, when nothing that runs after them
        in an eager step changes the gradients (gradient clipping, ``Trainer(gradient_clip_val=...)`` or
        a ``configure_gradient_clipping`` of the module's own; for ``on_after_backward`` also an
        ``on_before_optimizer_step`` that writes), when they read no parameter (after a replay it holds
        the step's update already), and when neither this step's trace nor their code shows a write: a
        write the warm-up did not take (a guard that zeroes non-finite gradients) would come after the
        update (l2lightning.guards.hook_writes).
        """
        if hook not in AFTER_REPLAY_HOOKS:
            return f"`{hook}` runs where a replay cannot be followed by it"
        if hook in trace.mutating_hooks:
            return f"`{hook}` writes tensors"
        if hook in trace.parameter_reading_hooks:
            return (
                f"`{hook}` reads parameters or the optimizer's state, which after a replay hold the step's "
                "update already"
            )
        clipping = self._clipping()
        if clipping:
            return f"{clipping} changes the gradients after `{hook}` reads them"
        if hook == "on_after_backward" and "on_before_optimizer_step" in trace.mutating_hooks:
            return "`on_before_optimizer_step` writes tensors after `on_after_backward` reads the gradients"
        writes = self._code_writes(hook)
        if writes:
            return f"`{hook}` may write: {writes[0]}, which after a replay would come after the update"
        return None

    def _clipping(self) -> str | None:
        """What clips the gradients in the step: the Trainer's setting or the module's own clipping."""
        if self._fit.trainer.gradient_clip_val:
            return f"gradient clipping (`gradient_clip_val={self._fit.trainer.gradient_clip_val}`)"
        if (
            type(self._fit.module).configure_gradient_clipping
            is not LightningModule.configure_gradient_clipping
        ):
            return "the module's `configure_gradient_clipping`"
        return None

    def _code_writes(self, hook: str) -> list[str]:
        """What the code of every function installed as `hook` (the module's, the callbacks') may
        write, read once a fit (l2lightning.guards.hook_writes)."""
        found = self._hook_writes.get(hook)
        if found is None:
            found = []
            original = self._fit.originals.get(hook)
            if original is not None:
                found += possible_writes(original, self._fit.module)
            for cb, name, before in self._callback_overrides:
                if name == hook:
                    found += possible_writes(getattr(type(cb), hook) if before is ABSENT else before, cb)
            self._hook_writes[hook] = found
        return found


def _computed_differently(values: list[Any], before: tuple | None, now: tuple) -> str:
    """The lines (at most three) of the numbers the step computes from the step counters (`values`,
    StepSource.counter_values) whose values in `now` differ from `before` (none: no earlier step)."""
    if before is None:
        return ""
    lines = [
        v.line
        for v, was, is_ in zip(values, before, now)
        if was is not unreadable and is_ is not unreadable and was != is_
    ]
    return "; ".join(lines[:3])


def _moved_between(before: dict[str, Any] | None, now: dict[str, Any]) -> str:
    """The module's numbers among `now` that differ from `before` (the last traced step's,
    :attr:`_Group.last_read`), as "`self.ptr` (0 -> 8)"; empty where none did (or no earlier step)."""
    if before is None:
        return ""
    moved = [
        f"`self.{name}` ({before[name]!r} -> {value!r})"
        for name, value in now.items()
        if name in before and python_state.changed_scalars([(before, name, value)])
    ]
    return ", ".join(moved[:3])


def momentum_cycled_every_step(trainer: Any) -> str | None:
    """A refusal before the first warm-up step where a scheduler Lightning steps after every optimizer
    step cycles a hyperparameter the graph bakes: OneCycleLR and CyclicLR with ``cycle_momentum=True``
    (their default) write Adam's beta1 or SGD's momentum at every step, and the capturable and fused
    optimizers read those as host numbers (``tests/graph/test_optim.py``). The warm-up finds the same after
    three traced steps (WarmupSteps._baked_every_step); known here, the fit runs plain from its first
    step instead of paying for those traces (``adamw_onecycle_momentum`` on an H100: its warm-up steps
    took 24 ms each against a plain step's 2.6-4.5 ms, ``benchmarks/results/h100/idioms.json``)."""
    from torch.optim.lr_scheduler import CyclicLR, OneCycleLR

    for config in getattr(trainer, "lr_scheduler_configs", None) or []:
        scheduler = config.scheduler
        if not isinstance(scheduler, (OneCycleLR, CyclicLR)) or not getattr(
            scheduler, "cycle_momentum", False
        ):
            continue
        if config.interval != "step" or config.frequency != 1:
            continue  # a change every N steps or per epoch: captured again (or waited out) at each change
        key = "betas" if getattr(scheduler, "use_beta1", False) else "momentum"
        name = type(scheduler.optimizer).__name__
        return (
            f"{name}'s ['{key}'] change at every step: {type(scheduler).__name__} with `cycle_momentum=True` "
            f"(its default) is stepped after every optimizer step, and {name} bakes them into the graph as "
            f"numbers, so every step would need a new capture. {baked_schedule_advice([key])}"
        )
    return None
