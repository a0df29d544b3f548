"""Manual optimization (``automatic_optimization = False``): the whole ``training_step`` as the captured step.

Under manual optimization Lightning hands no closure to ``optimizer.step``: its ``_ManualOptimization``
loop calls ``training_step`` once, and the step itself calls ``opt.zero_grad()``, ``manual_backward``
and ``opt.step()`` (``LightningOptimizer.step``: the precision plugin's ``optimizer_step`` with a closure
that does nothing but Lightning's ``_after_closure``). So the boundary of the captured step is the whole
``training_step`` call: :class:`ManualStep` installs its :meth:`ManualStep.training_step` as the module's
``training_step`` and hands the callback's ``StepDispatch.step`` a ``run`` that calls the closure and a
closure that runs the callback's own ``training_step`` override (capture, replay and log re-issue as for
automatic optimization). The optimizer steps inside it go through the capturable optimizer's wrapper
straight to its step (:meth:`ManualStep.optimizer_step`), inside the graph at the capture. A step may
step several optimizers (Lightning's basic GAN: ``opt_g, opt_d = self.optimizers()``, each toggled,
stepped, zeroed and untoggled in turn): every one of them is wrapped, all their updates are in the one
graph, and the callback switches, checks, saves and compares them together
(:class:`~l2lightning.graph.joined_optimizers.CapturableOptimizers`).

What a replay must keep right, though no Python runs in it:

* the manual loop's step counter: ``LightningOptimizer.step`` counts each optimizer step in
  ``optim_step_progress`` (``trainer.global_step`` under manual optimization; two per batch for the
  GAN). The capture counts the optimizer steps the graph holds, whichever optimizers make them; after
  each replay the counter moves on by that many, as the eager step's Python would have moved it;
* ``toggle_optimizer``/``untoggle_optimizer``: they set parameters' ``requires_grad`` inside the step,
  which decides the gradients the captured backward makes, and put it back by the step's end. A replay
  runs neither, and leaves the flags as the untoggled step does; the flags are compared with the
  graph's before each replay (a step that leaves them changed is captured again);
* the LR schedulers the step steps (``self.lr_schedulers().step()``): the capture records each call among
  the step's log calls instead of running it, and each replay steps them again in that order
  (:mod:`l2lightning.graph.scheduler_steps`); the next replay's optimizer reads the learning rate they set
  from a device tensor. A scheduler stepped with arguments, before its optimizer's step, or moving a
  hyperparameter the graph bakes in (OneCycleLR's momentum) is refused by name;
* what ``training_step`` returns: a manual step mostly returns None, which the capture reads as "no
  step to capture" (a step that returned None skips the optimizer under automatic optimization). The
  module's ``training_step`` is called through :func:`none_as_empty` so that None reaches the callback
  as ``{}`` (which Lightning's ``ManualResult`` reads exactly as None) and goes back to None for Lightning.

What is not captured (the fit trains eagerly, with one warning naming the cause, :func:`manual_refusal`,
:func:`manual_start_refusal`): a parameter that two optimizers step (each parameter's optimizer state is
saved and compared once), the LR schedules above that a replay cannot repeat, a gradient scaler (16-mixed:
the step calls ``scaler.step`` itself, outside the plugin step the callback wraps), hooks the module or
a callback overrides that run inside the step (``on_before_backward``, ``on_after_backward``,
``on_before_optimizer_step``: a replay would not call them), and ``verify="capture"`` (which compares a
loss the manual step need not return).
"""

from __future__ import annotations

import contextlib
import copy
import functools
import re
from collections.abc import Callable
from typing import Any

from lightning.pytorch import Callback
from lightning.pytorch.utilities.model_helpers import is_overridden

from l2lightning.graph.joined_optimizers import members_of, optimizer_names, shared_parameter
from l2lightning.graph.optim import baked_schedule_advice
from l2lightning.graph.scheduler_steps import ReissuedSchedulerStep, ScheduledStep, SchedulerSteps
from l2lightning.guards.step_trace import CaptureRefused

# the hooks that run inside a manual step (manual_backward: on_before_backward, on_after_backward;
# LightningOptimizer.step: on_before_optimizer_step); Lightning's on_before_zero_grad runs only in automatic
MANUAL_STEP_HOOKS = ("on_before_backward", "on_after_backward", "on_before_optimizer_step")


def manual_refusal(trainer: Any, pl_module: Any, verify: Any, own: Any = None) -> str | None:
    """Why the manual-optimization fit of `pl_module` cannot be captured, known at set-up, or None
    (`own`: the graph callback itself, whose hooks are not the user's)."""
    name = type(pl_module).__name__
    lead = f"{name} sets `automatic_optimization = False` (manual optimization)"
    if getattr(trainer.precision_plugin, "scaler", None) is not None:
        return (
            f"{lead} under precision={str(trainer.precision)!r}: its step calls the GradScaler itself, which "
            "the capture of manual optimization does not handle"
        )
    if verify == "capture":
        return f"{lead} with verify='capture', which compares the step's loss; use verify='sampled' (the default)"
    hooks = [h for h in MANUAL_STEP_HOOKS if is_overridden(h, pl_module)]
    for cb in trainer.callbacks:
        hooks += [
            f"{type(cb).__name__}.{h}"
            for h in MANUAL_STEP_HOOKS
            if cb is not own and is_overridden(h, cb, parent=Callback)
        ]
    if hooks:
        return (
            f"{lead} with hooks that run inside the step ({', '.join(hooks)}); a replay of a manual step "
            "does not call them"
        )
    return None


def manual_start_refusal(trainer: Any, pl_module: Any) -> str | None:
    """Why the manual-optimization fit cannot be captured, known once its optimizers are configured."""
    lead = f"{type(pl_module).__name__} sets `automatic_optimization = False` (manual optimization)"
    if not trainer.optimizers:
        return f"{lead} without an optimizer (`configure_optimizers` returned none): there is no update to capture"
    shared = shared_parameter(pl_module, trainer.optimizers)
    if shared is not None:
        names = ", ".join(type(o).__name__ for o in trainer.optimizers)
        return (
            f"{lead} with {len(trainer.optimizers)} optimizers ({names}) that both step the parameter "
            f"`{shared}`; the capture handles each parameter's optimizer state once. Give each parameter to "
            "one optimizer"
        )
    return None


def manual_source_refusal(source: Any, pl_module: Any) -> str | None:
    """Why what the manual step's source reads of the step counters cannot be followed, or None.

    Under manual optimization ``global_step`` counts optimizer steps: it moves inside the step, at each
    ``opt.step()``. The callback evaluates the step's counter conditions, counter values and logged
    counter expressions before each replay, with the counter as the step starts; code after an
    ``opt.step()`` reads it one further, so such a read would take the wrong branch or log the wrong
    value. Only reads that show ``batch_idx``, ``current_epoch`` or ``trainer.is_last_batch`` (constant
    through a step) and not ``global_step`` or the Trainer's other attributes are followed; anything
    else is refused, naming its line."""
    counter_reads = [c.line for c in source.conditions if c.on_counters]
    counter_reads += [c.line for c in source.counter_values]
    # numbers re-evaluated per replay (`self.lr_schedulers().get_last_lr()[0]`): any but global_step's
    values = [line for line, _ in source.log_values.values()]
    values += [line for line, _ in source.output_values.values()]
    unsure = [line for line in counter_reads if not _follows_within_a_step(line)]
    unsure += [line for line in values if not _follows_within_a_step(line, reads_a_counter=False)]
    if "global_step" in source.reads and not unsure:
        unsure = ["`self.global_step`"]
    if not unsure:
        return None
    return (
        f"{type(pl_module).__name__} sets `automatic_optimization = False` (manual optimization) and its step "
        f"reads the step counters at {'; '.join(unsure[:3])}: under manual optimization `global_step` moves "
        "inside the step at each `opt.step()`, where a replay cannot follow it. Read `batch_idx` instead, or "
        "decide in `on_train_batch_start`"
    )


# what a manual step may read of the Trainer: constant through the step (`if self.trainer.is_last_batch:`,
# Lightning's docs' per-epoch scheduler step), unlike `global_step`, which each `opt.step()` moves on
_TRAINER_READS_KEPT = re.compile(r"trainer\.(is_last_batch|current_epoch)\b")


def _follows_within_a_step(line: str, reads_a_counter: bool = True) -> bool:
    """Whether the source of `line` ("file:line (`source`)") reads only counters a manual step keeps
    (`reads_a_counter`: a read of the step counters that shows none of them reads one some other way)."""
    code = line.split(" (`", 1)[-1]
    if "global_step" in code or "trainer" in _TRAINER_READS_KEPT.sub("", code):
        return False
    return not reads_a_counter or any(
        name in code for name in ("batch_idx", "current_epoch", "is_last_batch")
    )


def none_as_empty(training_step: Callable[..., Any]) -> Callable[..., Any]:
    """`training_step` returning ``{}`` where it returns None (Lightning's ManualResult reads both alike)."""

    @functools.wraps(training_step)
    def step(*args: Any, **kwargs: Any) -> Any:
        out = training_step(*args, **kwargs)
        return {} if out is None else out

    return step


def _hyperparameters(optimizer: Any) -> list[dict[str, Any]]:
    """Each param group's hyperparameters (all but its parameters), as they are now."""
    return [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]


def _changed(before: list[dict[str, Any]], after: list[dict[str, Any]], ignored: tuple = ()) -> list[str]:
    """The hyperparameters but `ignored` that differ between `before` and `after` (a new group counts)."""
    if len(before) != len(after):
        return [f"{len(before)} -> {len(after)} param groups"]
    changed = []
    for i, (was, now) in enumerate(zip(before, after)):
        for key in sorted((set(was) | set(now)) - set(ignored)):
            a, b = was.get(key, _MISSING), now.get(key, _MISSING)
            if a is b or (isinstance(a, (int, float, bool, str, tuple)) and a == b):
                continue
            changed.append(f"param group {i}'s `{key}`")
    return changed


_MISSING = object()
# what CapturableOptimizer.switch_on sets in each group at the capture step
_SWITCHED_KEYS = ("capturable", "fused", "foreach")


def _shown_arguments(args: tuple, kwargs: dict) -> str:
    """A call's arguments for a message: numbers and strings as they are, anything else by its type (a
    tensor's repr would read its values back from the device)."""

    def shown(value: Any) -> str:
        return repr(value) if isinstance(value, (int, float, str)) else f"<{type(value).__name__}>"

    return ", ".join([*map(shown, args), *(f"{k}={shown(v)}" for k, v in kwargs.items())])


def _run(closure: Callable[[], Any], **kwargs: Any) -> Any:
    """The eager manual step: the whole training_step (its optimizer steps inside it)."""
    return closure()


class ManualStep:
    """The module's ``training_step`` for a manual-optimization fit the callback handles.

    Args:
        callback: the :class:`~l2lightning.callback.graph_callback.L2GraphCallback` (its dispatch part's ``step``, its overrides
            part's ``training_step`` and recorded logs, mode and counters).
    """

    def __init__(self, callback: Any) -> None:
        self.callback = callback
        self._counting = 0  # the optimizer steps this step's capture recorded
        self.graph_steps = 0  # the optimizer steps the graph holds: counted after each replay
        # the optimizers (ids) stepped so far in the step running now: a scheduler must step after its own
        self._stepped: set[int] = set()
        self.schedulers = SchedulerSteps(self.scheduler_step)

    def optimizer_step(self, run: Callable[..., Any], closure: Any, kwargs: dict) -> Any:
        """The capturable optimizer's handler: its step as it is (inside the graph at the capture)."""
        cb = self.callback
        if cb._fit.mode == "capture":
            self._counting += 1
        # `run` is the CapturableOptimizer's: which of the step's optimizers this is
        self._stepped.add(id(getattr(getattr(run, "__self__", None), "optimizer", None)))
        tracer = cb._warmup.tracer
        if tracer is None:
            return run(closure, **kwargs)
        # outside what the step tracer sees, as the update after Lightning's closure is under
        # automatic optimization (the capture's own checks judge the capturable step)
        with tracer.paused():
            return run(closure, **kwargs)

    def scheduler_step(self, entry: ScheduledStep, args: tuple, kwargs: dict) -> Any:
        """A wrapped LR scheduler's ``step`` (l2lightning.graph.scheduler_steps): run as it is, except in a warm-up
        step that shows a schedule a replay cannot repeat (refused) and at the capture (recorded)."""
        cb = self.callback
        mode = cb._fit.mode
        if not cb._dispatch.in_step or mode not in ("trace", "capture"):
            return entry.run(*args, **kwargs)  # eager: between steps, fallbacks, the check's eager step
        problem = self._scheduler_problem(entry, args, kwargs)
        if problem is not None and mode == "capture":
            raise CaptureRefused(problem)
        if mode == "capture":
            # stepped by the re-issue of the step's logs that follows the capture, then after each replay
            cb._overrides.capture_logs.append(
                ReissuedSchedulerStep(cb._fit.module._current_fx_name or "training_step", entry)
            )
            return None
        tracer = cb._warmup.tracer
        if problem is not None and tracer is not None:
            tracer.trace.add_problem(problem)  # this step stays eager (the warm-up judges its trace)
        with tracer.paused() if tracer is not None else contextlib.nullcontext():
            return entry.run(*args, **kwargs)

    def _scheduler_problem(self, entry: ScheduledStep, args: tuple, kwargs: dict) -> str | None:
        """Why a replay could not repeat this call of `entry`'s ``step`` in the step, or None."""
        lead = (
            f"{type(self.callback._fit.module).__name__}'s training_step (manual optimization) steps its LR "
            f"scheduler {entry.name}"
        )
        if args or kwargs:
            return (
                f"{lead} with arguments (`step({_shown_arguments(args, kwargs)})`), which a replay cannot "
                "pass anew (ReduceLROnPlateau reads its metric on the host); step it in `on_train_epoch_end`, as "
                "Lightning's docs do"
            )
        if id(entry.optimizer) not in self._stepped:
            return (
                f"{lead} before its optimizer's step, so that step reads the learning rate the schedule set; a "
                "replay moves the schedule after the whole step. Step the scheduler after `opt.step()`"
            )
        return None

    def _hyperparameter_problem(
        self, optimizers: list[Any], before: list[list[dict[str, Any]]], ignored: tuple, counts: list[int]
    ) -> str | None:
        """Why the step's changes to the optimizers' hyperparameters (from `before`, bar `ignored`) cannot
        be replayed, or None. The step's Python ran (an LR scheduler it steps, `pg["lr"] = ...`), outside
        the optimizer's own step, where the capturable optimizer notes such writes. A learning rate that a
        scheduler stepped since the reading `counts` moved is replayed (scheduler_step) where the optimizer
        reads it from a device tensor; anything else a replay would freeze at the capture's values."""
        stepped: dict[int, list[str]] = {}  # optimizer id -> the schedulers of it that stepped
        for entry, was, now in zip(self.schedulers.entries, counts, self.schedulers.counts()):
            if now != was:
                stepped.setdefault(id(entry.optimizer), []).append(entry.name)
        tensor_lr = {id(m.optimizer) for m in members_of(self.callback._fit.optimizer) if m.tensor_lr}
        changed, keys, schedulers = [], set(), []
        for i, (optimizer, was) in enumerate(zip(optimizers, before)):
            scheduled = stepped.get(id(optimizer), [])
            skip = (*ignored, "lr") if scheduled and id(optimizer) in tensor_lr else ignored
            found = _changed(was, _hyperparameters(optimizer), skip)
            if found:
                keys |= {f.split("`")[1] for f in found if "`" in f}
                schedulers += scheduled
            if len(optimizers) > 1:  # which of `self.optimizers()`
                found = [f"{c} (optimizer {i}, {type(optimizer).__name__})" for c in found]
            changed += found
        if not changed:
            return None
        lead = (
            f"{type(self.callback._fit.module).__name__}'s training_step (manual optimization) changes the optimizer's "
            f"hyperparameters ({', '.join(changed)})"
        )
        if schedulers:
            return (
                f"{lead} through its LR scheduler ({', '.join(sorted(set(schedulers)))}, stepped in the step), and "
                f"{optimizer_names(self.callback._fit.optimizer)} bakes them into the graph as numbers, so every step "
                f"would need a new capture. {baked_schedule_advice(sorted(keys))}"
            )
        return (
            f"{lead}, which a replay (it runs no Python) would freeze at the capture's values; change them in "
            "`on_train_batch_start`, which runs before each replay"
        )

    def _progress(self) -> Any:
        return self.callback._fit.trainer.fit_loop.epoch_loop.manual_optimization.optim_step_progress

    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        cb = self.callback
        if cb._fit.disabled_reason or cb._fit.optimizer is None or cb._fit.pending is None:
            out = cb._overrides.training_step(*args, **kwargs)  # eager: the override passes it through
            return None if isinstance(out, dict) and not out else out
        progress = self._progress()
        before = copy.deepcopy(progress.state_dict())
        start_step = int(cb._fit.trainer.global_step)
        wrapped = cb._fit.optimizer
        optimizers = [m.optimizer for m in members_of(wrapped)]
        hyperparameters, switched = [_hyperparameters(o) for o in optimizers], wrapped.switched
        captures = cb._capture.captures  # (the capture part's count, not the callback's property: per step)
        self._counting = 0
        self._stepped = set()
        scheduled = self.schedulers.counts()
        out = cb._dispatch.step(_run, functools.partial(cb._overrides.training_step, *args, **kwargs), {})
        captured = cb._capture.captures != captures
        if (captured or cb._fit.mode != "replay") and cb._fit.optimizer is not None:
            # the capture step switched the optimizer to make_capturable's configuration: not the step's doing
            ignored = _SWITCHED_KEYS if wrapped.switched != switched else ()
            problem = self._hyperparameter_problem(optimizers, hyperparameters, ignored, scheduled)
            if problem:
                cb._disable(problem)
        if captured:
            self.graph_steps = self._counting
            # read by the capture after the step's Python had stepped the optimizers: the step it began at
            cb.capture_step = start_step
        if captured or cb._fit.mode == "replay":
            # a replay ran no Python, a capture step ran it more than once (its dry runs, the graph's
            # recording): the counter moves on as one eager step of the graph's optimizer steps moves it
            progress.load_state_dict(copy.deepcopy(before))
            for _ in range(self.graph_steps):
                progress.increment_ready()
                progress.increment_completed()
        return None if isinstance(out, dict) and not out else out
