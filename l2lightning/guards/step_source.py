"""Reading a LightningModule's step source for the Python a replayed graph would freeze.

A graph replays one path through ``training_step`` with the Python values of its capture. What in
the source can change from step to step in a way the graph cannot see:

* conditions on the step counters or on other attributes of the module (``if self.global_step % 10 == 0:``
  for a target-network sync, ``if self.use_aux_loss:`` for a flag an epoch hook sets,
  ``if batch_idx % 50 == 0: print(...)``), in the step hooks and in the module's own methods they
  call (``self.sync_target(batch_idx)``, ``self(x)``, ``super().training_step(...)``): :func:`analyse`
  finds every ``if``/``while``/ternary test that reads ``global_step``, ``current_epoch`` or the
  ``batch_idx`` argument and, where the test only needs ``self`` and ``batch_idx`` (locals assigned
  once from such expressions are inlined), compiles it. :meth:`StepSource.branch_key` evaluates them
  each step; a step whose key differs from the captured one runs eagerly. Tests it cannot evaluate
  are named in a warning.
* numbers computed from the step counters outside branch tests (``w = max(0.0, (self.global_step -
  10) * 0.1)``) and values read through ``self`` (``self.hparams.kl_weight``, ``self.weights[0]``):
  baked into the graph, compared before each replay (:mod:`l2lightning.guards.step_values`); a new value
  captures the step again.
* module-level values (``loss * LOSS_WEIGHT``, ``if USE_AUX:``, ``CONFIG["w"]``), read by the step, by
  plain functions of the user's own code it calls (``weighted(loss)``) or as attributes of the user's
  own modules (``cfg.LOSS_W``), and closure variables of a module made in a factory function: baked
  in as well and compared before each replay (``StepSource.global_reads``); so are attribute and
  constant-subscript chains rooted at such names, where the root is a config (``args.ent_coef`` of an
  ``argparse`` namespace, ``RUN.loss.weight``, ``Hyper.LOSS_WEIGHT``, an OmegaConf config), as
  ``StepSource.attribute_values`` (:func:`_record_global_chains`); names the step assigns
  (``global STEPS; STEPS += 1``) are collected so that the callback can refuse the step
  (``StepSource.global_writes``).
* Python numbers passed to ``self.log`` and as the entries of a literal dict to ``self.log_dict``
  (``self.lr_schedulers().get_last_lr()[0]``, ``{"phase": self.phase}``): a replay would re-log the
  capture-time value. :meth:`StepSource.log_value` re-evaluates the logged expression where it can be
  (same rules, plus the side-effect-free calls ``lr_schedulers()``, ``optimizers()``,
  ``get_last_lr()``); the keys logged with a number fixed for one graph (a literal, a batch shape) and
  those logged with an expression no replay can evaluate are named (``log_constants``,
  ``log_opaque``), and so are the log calls whose keys the source does not show (``log_unknown``).
* the module read through another name than ``self``: a function of the user's given the module
  (``losses.regularized(self, pred, y)`` reading ``model.aux_weight``, ``functools.partial(f, self)``,
  a method of an object the module holds), a local alias (``m = self``), a lambda or a method the module
  keeps in an attribute or a container (``self.loss_fns = {"mse": self._mse_loss}``), a callback hook's
  ``pl_module`` handed to its helpers: read as the module's code (:func:`read_with_module`), their
  reads join ``reads`` and their tests and values the comparisons. Where the source does not say
  which attribute is read (``getattr(self, f"_{kind}_loss")``, ``vars(self)``, ``self`` handed to code
  that cannot be read), ``StepSource.read_patterns`` records the names it may be, and every public
  attribute of the module they match counts as read (:meth:`StepSource.resolve_reads`); the
  module's methods a computed name may call are read as the step's helpers.

The Trainer's other callbacks' hooks inside the step are read the same way
(:func:`analyse_callbacks`). Evaluation only reads attributes and calls the whitelisted builtins and
methods above, so it has no side effects of its own.
"""

from __future__ import annotations

import argparse
import ast
import builtins
import datetime
import dis
import functools
import inspect
import linecache
import math
import os
import re
import sysconfig
import textwrap
import time
import types
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from l2lightning.graph.operand_scalars import OperandSite
from l2lightning.guards.step_values import (
    BAKED_VALUES,
    AttributeValue,
    CounterValue,
    Identity,
    frozen,
    guarded,
    unreadable,
)

# What changes from step to step on the module and its Trainer: the step counters, and the fit
# loop's flag for an epoch's last batch (``if self.trainer.is_last_batch:``)
STEP_COUNTERS = ("global_step", "current_epoch", "is_last_batch")
# getattr only with a constant, non-dunder name (see _constant_getattr)
_SAFE_BUILTINS = {"min", "max", "abs", "int", "float", "bool", "len", "round", "divmod", "pow", "getattr"}
_SAFE_METHODS = {"lr_schedulers", "optimizers", "get_last_lr"}
# the ``math`` functions an operand site's number may call: pure functions of numbers (schedules)
_MATH_FUNCTIONS = {
    "cos", "sin", "tan", "exp", "log", "log2", "log10", "log1p", "expm1", "sqrt", "pow", "tanh",
    "floor", "ceil", "fabs", "atan", "erf",
}  # fmt: skip
_BRANCH_ERROR = object()


@dataclass
class Condition:
    """A test on the step counters in the step's source."""

    line: str  # "file:line (`source`)"
    evaluate: Callable[[Any, int], Any] | None  # (module, batch_idx) -> value, or None if not evaluable
    # True: reads the step counters (its value moves as training goes); False: only other attributes
    on_counters: bool = True


@dataclass
class HandedOn:
    """``batch_idx`` handed to ``self.<attributes>(...)`` where the attributes do not name a method of
    the class of `holder` (the object ``self`` is there): a submodule, a function or an object kept in
    an attribute, a method of a submodule. See :func:`read_handed_on`."""

    holder: Any
    path: tuple[str, ...]  # the attributes called (() for ``self(...)``)
    where: int | str  # the argument's position among the call's, or its keyword
    # the same for the module, where the call hands it on too (``self.loss_fn(self, pred, batch_idx)``)
    module_at: int | str | None
    counters: list[CounterValue]  # batch_idx as a compared number, where the callee cannot be read
    depth: int
    compared: bool = False  # `counters` joined the comparisons


@dataclass
class StepSource:
    """What :func:`analyse` found in a module's step hooks."""

    conditions: list[Condition] = field(default_factory=list)
    log_values: dict[str, tuple[str, Callable[[Any, int], Any]]] = field(default_factory=dict)
    # numbers training_step returns beside its loss, computed from the step counters
    # (``return {"loss": loss, "step": self.global_step}``): re-evaluated for each replay's outputs
    output_values: dict[str, tuple[str, Callable[[Any, int], Any]]] = field(default_factory=dict)
    # names X of every `self.X` the step hooks and their helpers read: a Python number among them
    # (`loss * self.beta`) is baked into the graph, so a change between steps must capture again
    reads: set[str] = field(default_factory=set)
    # the same for the Trainer's other callbacks whose hooks run inside the step: (callback, names)
    callback_reads: list[tuple[Any, set[str]]] = field(default_factory=list)
    # numbers computed from the step counters that a graph would bake in, evaluated before each replay
    counter_values: list[CounterValue] = field(default_factory=list)
    # values read through self (attribute and constant-subscript chains), compared before each replay
    attribute_values: list[AttributeValue] = field(default_factory=list)
    # module-level names the step hooks and their helpers read (``loss * LOSS_WEIGHT``), per globals
    # dict: id -> (the function's __globals__, names). A number or tensor among them is baked in too.
    # (closure variables too: key ("closure", id(function)), namespace a ClosureCells)
    global_reads: dict[Any, tuple[Any, set[str]]] = field(default_factory=dict)
    # module-level or closure names the step hooks assign (``global STEP; STEP += 1``, ``nonlocal``):
    # "`STEP` at file:line (...)"
    global_writes: list[str] = field(default_factory=list)
    # reads that reach the step's work of values Lightning changes between steps and no check before a
    # replay can follow: the Trainer's metric dictionaries (``self.trainer.callback_metrics["val_loss"]``)
    # and an LR scheduler's state (``self.lr_schedulers().get_last_lr()[0]``). "file:line (...)"
    trainer_metric_reads: list[str] = field(default_factory=list)
    scheduler_reads: list[str] = field(default_factory=list)
    # calls of the host clock (``time.monotonic()``) whose reading reaches the step's work (a branch, a
    # factor) rather than only a log or host text: a replay keeps the capture step's reading
    clock_reads: list[str] = field(default_factory=list)
    # ``next(...)`` of an iterator the module (or the module's file) holds (``if next(self.counter) >= 16:``,
    # ``extra = next(self.aux_iter)``): the step advances Python state no replay advances, and no
    # check before a replay can read an iterator's position. "file:line (...)"
    iterator_advances: list[str] = field(default_factory=list)
    # the module's attributes read through an alias whose name the source does not spell out: a computed
    # ``getattr(self, f"_{self.loss_name}_loss")`` (the pattern of its constant parts), ``vars(self)``,
    # ``self`` handed to code that cannot be read (any name), a method called through an alias in code
    # read as the module's (its exact name). (line, pattern, whether the attribute is called: the
    # module's methods it matches run in the step.) :meth:`resolve_reads` adds the module's attributes
    # they match to `reads`, at setup and at each capture.
    read_patterns: list[tuple[str, re.Pattern[str], bool]] = field(default_factory=list)
    # keys of the step's logs (``self.log``, ``self.log_dict``) whose Python number is the same for every
    # replay of one graph: a literal, or a number of the batch's shapes (a graph replays one batch layout)
    log_constants: set[str] = field(default_factory=set)
    # keys logged with an expression a replay cannot evaluate again (a call of the user's, a local from
    # the step's work): key -> "file:line (...)". A Python number among them would repeat the capture's
    log_opaque: dict[str, str] = field(default_factory=dict)
    # log calls whose keys the source does not show (``self.log(f"loss/{k}", v)``, ``self.log_dict(d)``)
    log_unknown: list[str] = field(default_factory=list)
    # (id of a function's code, the name bound to the module in it): the functions read as the module's
    # code (a loss helper given ``self``, a lambda closing over it), each read once however often the
    # analysis is asked again (at each capture)
    module_functions_read: set[tuple[int, str]] = field(default_factory=set, repr=False)
    # calls that hand ``batch_idx`` on to code the module holds rather than defines (``self.criterion(
    # logits, y, batch_idx)`` for a submodule or a function kept in an attribute, ``self.model.
    # training_step(batch, batch_idx)``): that code is read with its parameter bound to batch_idx
    # (:func:`read_handed_on`), its tests joining the branch key; where it cannot be, the argument is
    # compared before each replay like any number computed from the step counters
    handed_on: list[HandedOn] = field(default_factory=list, repr=False)
    # (id of the object its self is, id of its code, the parameter bound to batch_idx) of each function
    # read so, once; with the object and the function, which the ids must not outlive
    callees_read: dict[tuple[int, int, str], tuple[Any, Any]] = field(default_factory=dict, repr=False)
    # (object, method name, the class whose method was read, the class a ``super()`` lookup started
    # after) of each method read as the step's code: :meth:`code_bindings` snapshots where each is bound
    methods_read: list[tuple[Any, str, type, type | None]] = field(default_factory=list, repr=False)
    # tensor `*`, `+`, `-` whose other side is a Python number the module alone evaluates (``loss -
    # self.ent_coef * entropy``): the capture hands their ops device scalars (l2lightning.graph.operand_scalars)
    operand_sites: list[OperandSite] = field(default_factory=list)
    # the module's attributes X read as `self.X` only inside those sites' numbers, and those read
    # anywhere else (any other way, or by code not read): a change of one only in the first set is
    # written to the device scalars instead of capturing again
    site_reads: dict[str, set[tuple]] = field(default_factory=dict)  # name -> the sites' keys
    other_reads: set[str] = field(default_factory=set)
    # the same for module-level names (``loss * AUX_WEIGHT``), by (id of the globals dict, name)
    site_globals: dict[tuple[int, str], set[tuple]] = field(default_factory=dict)
    other_globals: set[tuple[int, str]] = field(default_factory=set)

    def code_bindings(self) -> list[tuple[Any, str, Any, str]]:
        """(attribute dict, name, what it holds now, where: ```self.name``` or ```Class.name```) of every
        place that decides which code a method the step's source was read through runs: the object's own ``__dict__`` (a method rebound on the
        instance, ``self.compute_loss = self.compute_loss_smooth``, is found there first) and each class
        of its MRO up to the one whose method was read (``type(self).compute_loss = ...`` patched on the
        class, or on a subclass, shadows it). Compared by identity before each step
        (:func:`l2lightning.guards.python_state.rebound`): the conditions, values and logs the callback compares
        were read from that code, so another one makes them stale, and replays would run the old one."""
        checks: list[tuple[Any, str, Any, str]] = []
        for obj, name, owner, after in self.methods_read:
            attributes = getattr(obj, "__dict__", None)
            if isinstance(attributes, dict) and after is None:
                checks.append((attributes, name, attributes.get(name), f"`self.{name}`"))
            mro = type(obj).__mro__
            start = mro.index(after) + 1 if after is not None and after in mro else 0
            for klass in mro[start:]:
                checks.append(
                    (klass.__dict__, name, klass.__dict__.get(name), f"`{klass.__qualname__}.{name}`")
                )
                if klass is owner:
                    break
        return checks

    def resolve_reads(self, module: Any) -> None:
        """Add to `reads` the module's public attributes that :attr:`read_patterns` match now (the
        attributes a hook set since the last call included)."""
        if not self.read_patterns:
            return
        try:
            names = [n for n in vars(module) if isinstance(n, str) and not n.startswith("_")]
        except TypeError:
            return
        patterns = {p for _, p, _ in self.read_patterns}
        matched = {n for n in names if any(p.fullmatch(n) for p in patterns)}
        self.reads.update(matched)
        self.other_reads.update(matched)

    def add_read_pattern(self, line: str, pattern: re.Pattern[str], called: bool) -> None:
        """Record a :attr:`read_patterns` entry once (the analysis is asked again at each capture)."""
        known = {(where, p.pattern, c) for where, p, c in self.read_patterns}
        if (line, pattern.pattern, called) not in known:
            self.read_patterns.append((line, pattern, called))

    def attribute_snapshot(self, module: Any, batch_idx: int) -> list[tuple[AttributeValue, Any]]:
        """The attribute values that are Python numbers (or small containers of them) now, frozen;
        the others (tensors, modules) are followed by other checks or cannot be baked."""
        out = []
        for a in self.attribute_values:
            value = a.value(module, batch_idx)
            if value is not None:
                # (unreadable too: an attribute absent at capture, `if hasattr(self, "aux_w"):`, that
                # a hook sets later reads as a value then, and the step is captured again)
                out.append((a, value))
        return out

    def changed_attribute_values(
        self, snapshot: list[tuple[AttributeValue, Any]], module: Any, batch_idx: int
    ) -> list[str]:
        """Lines of the attribute values in `snapshot` that differ (or cannot be read) at this step."""
        return [a.line for a, was in snapshot if a.value(module, batch_idx) != was]

    def counter_snapshot(self, module: Any, batch_idx: int) -> tuple:
        """The value of every :class:`CounterValue` for this step."""
        return tuple(c.value(module, batch_idx) for c in self.counter_values)

    def changed_counter_values(
        self, captured: tuple, module: Any, batch_idx: int, served: frozenset = frozenset()
    ) -> list[str]:
        """Lines of the counter values that differ from `captured` (or cannot be read) at this step,
        but those whose index is in `served` (the graph reads them from operand scalars)."""
        return [
            c.line
            for i, (c, was) in enumerate(zip(self.counter_values, captured))
            if i not in served
            and ((now := c.value(module, batch_idx)) is unreadable or was is unreadable or now != was)
        ]

    @property
    def opaque_conditions(self) -> list[str]:
        """Lines of step-counter conditions that cannot be evaluated per step."""
        return [c.line for c in self.conditions if c.evaluate is None]

    def branch_key(self, module: Any, batch_idx: int) -> tuple:
        """The value of every evaluable step-counter condition for this step (its branch through the step)."""
        key = []
        for c in self.conditions:
            if c.evaluate is None:
                continue
            try:
                key.append(bool(c.evaluate(module, batch_idx)))
            except Exception:  # a condition that cannot be read now: never equal to a captured key
                key.append(_BRANCH_ERROR)
        return tuple(key)

    def log_value(self, key: str, module: Any, batch_idx: int) -> Any:
        """The current value of the expression logged under `key` (raises if it was not found)."""
        return self.log_values[key][1](module, batch_idx)


# How deep calls from a step hook into the module's own methods are followed (`self.sync_target()`
# calling `self._copy_weights()`...): a condition in a helper freezes in a replay like one in the hook.
HELPER_DEPTH = 3
# the Trainer's metric dictionaries: their values are replaced as steps log and validations run
TRAINER_METRICS = frozenset({"callback_metrics", "logged_metrics", "progress_bar_metrics"})
# what an LR scheduler holds of its progress (PyTorch's LRScheduler): changed by each scheduler step
SCHEDULER_STATE = frozenset({"get_last_lr", "_last_lr", "last_epoch"})
# The host clock's readers: what a step reads from them moves from step to step with no tensor to show it
CLOCKS = (
    time.time,
    time.time_ns,
    time.monotonic,
    time.monotonic_ns,
    time.perf_counter,
    time.perf_counter_ns,
    time.process_time,
    time.process_time_ns,
    time.thread_time,
    time.thread_time_ns,
    datetime.datetime.now,
    datetime.datetime.utcnow,
    datetime.datetime.today,
    datetime.date.today,
)
# The same by the names a step calls them, where its module's globals cannot be read
CLOCK_NAMES = frozenset(
    {f"time.{f.__name__}" for f in CLOCKS[:10]}
    | {"datetime.now", "datetime.utcnow", "datetime.today", "date.today"}
    | {"datetime.datetime.now", "datetime.datetime.utcnow", "datetime.datetime.today", "datetime.date.today"}
)


def rebound_code(checks: list[tuple[Any, str, Any, str]]) -> list[str]:
    """Where the methods among `checks` (:meth:`StepSource.code_bindings`) are bound to other code now
    (```self.compute_loss``` on the instance, ```Model.compute_loss``` on a class)."""
    return [where for attributes, name, held, where in checks if attributes.get(name) is not held]


def analyse(module: Any, hook_names: tuple[str, ...] = ("training_step",)) -> StepSource:
    """Conditions on step counters and logged Python expressions in `module`'s own step hooks and in
    the module's own methods they call (``self.helper(...)``, ``self(...)`` for ``forward``), and in
    the code that reads the module through another name (``losses.regularized(self, pred, y)`` reading
    ``model.aux_weight``, a lambda or a method the module keeps in an attribute)."""
    found = StepSource()
    _analyse_object(module, hook_names, found, found.reads, callback=False)
    # the code the step hands batch_idx to that the module holds (a submodule, a held function): read
    # now where it can be; the rest at the training start, once configure_model has built it
    read_handed_on(found, module, final=False)
    found.resolve_reads(module)
    return found


def analyse_callbacks(callbacks: list[Any], hook_names: tuple[str, ...], found: StepSource) -> None:
    """Add to `found` what the hooks `hook_names` of `callbacks` (the Trainer's other callbacks; their
    hooks inside the step are captured with it) branch on and read.

    A callback hook's ``if trainer.global_step % 5 == 4:`` freezes in a replay like the module's own,
    so its tests join the step's conditions, evaluated per step with the callback, the Trainer and
    the module; the callback's attributes it reads (``p.grad.mul_(self.scale)``) are compared before
    each replay like the module's.
    """
    for cb in callbacks:
        hooks = tuple(h for h in hook_names if callable(getattr(type(cb), h, None)))
        if not hooks:
            continue
        reads: set[str] = set()
        _analyse_object(cb, hooks, found, reads, callback=True)
        if reads:
            found.callback_reads.append((cb, reads))


def _analyse_object(
    obj: Any, hook_names: tuple[str, ...], found: StepSource, reads: set[str], callback: bool
) -> None:
    """Walk `obj`'s hooks `hook_names` and the methods of its own they call (see :func:`analyse`).

    `callback`: `obj` is a Lightning Callback, whose step hooks take ``(self, trainer, pl_module, ...)``;
    their tests are evaluated with those three. For the module (not `callback`), the methods that code
    read as the module's calls through another name (:attr:`StepSource.read_patterns` marked called)
    and the methods and functions the attributes it reads hold (``self.loss_fns[name](pred, y)``) are
    read as its helpers too."""
    seen: set[tuple[str, Any]] = set()
    seen_functions: set[int] = set()  # plain functions already read (ids of their code objects)
    # (method, depth, position of the batch_idx argument among its parameters after self, and for
    # a `super().name(...)` call the class whose method made it: the lookup starts after it in the MRO;
    # the positions of the Trainer and of the module among the arguments, where a hook hands them on)
    pending: list[tuple[str, int, int | None, type | None, int | None, int | None]] = [
        (hook, 0, 1 if hook == "training_step" else None, None, None, None) for hook in hook_names
    ]
    patterns_read = 0  # how many of found.read_patterns were looked up as methods
    # batch_idx handed to the object's own methods, by position: ((name, the class a super() call was made
    # from, position), its reads as compared numbers), and the (name, class, position) of the methods read
    # with that parameter bound to batch_idx. A call whose method was not read so (too deep, a static
    # method, a library's, a parameter the source does not show) has its batch_idx compared instead.
    withheld: list[tuple[tuple[str, type | None, int], list[CounterValue]]] = []
    bound: set[tuple[str, type | None, int]] = set()
    while pending:
        name, depth, batch_position, after, trainer_position, module_position = pending.pop(0)
        if (name, after) in seen:
            continue
        seen.add((name, after))
        owner, method = _lookup(type(obj), name, after)
        if method is None and module_position is not None:
            # `self.loss_fn(self, pred, y)`: a function the object holds, given the module
            _read_held_with_module(found, obj, name, module_position, depth, seen_functions, batch_position)
            continue
        method = method.fget if isinstance(method, property) else method
        if method is None or not callable(method) or _defined_by_library(method):
            continue
        tree, filename, first_line, params = _parse(
            method.__func__ if isinstance(method, staticmethod) else method
        )
        if tree is None:
            if module_position is not None:  # the module handed to a method that cannot be read
                found.add_read_pattern(f"{type(obj).__qualname__}.{name}", _ANY_NAME, False)
            continue
        found.methods_read.append((obj, name, owner, after))  # (its source is read: code_bindings)
        if isinstance(method, staticmethod):
            params = ["", *params]  # no self: its arguments are the call's from the first
        function = inspect.unwrap(getattr(method, "__func__", method))
        batch_idx = _parameter(params, batch_position)
        if batch_idx is not None and not callback:
            bound.add((name, after, batch_position))  # type: ignore[arg-type]
        module_param = _parameter(params, module_position)
        if callback:
            # a callback's step hook: (self, trainer, pl_module, ...); its helpers get them where the
            # hook hands them on by name (`self._clip(trainer, pl_module)`)
            if depth == 0:
                extra = tuple(params[1:3]) if len(params) >= 3 else ()
            else:
                trainer_param = _parameter(params, trainer_position)
                extra = (
                    (trainer_param or "_l2_trainer", module_param)
                    if module_param
                    else (trainer_param,)
                    if trainer_param
                    else ()
                )
            module_names = extra[1:2]
        else:
            extra = ()
            module_names = (params[0] if params else "self", *((module_param,) if module_param else ()))
        if not _is_user_code(function):
            # torch's own methods the step calls on the module (`self.parameters()`): they know none of
            # the user's attributes; what they do with `self` is not followed
            module_names = ()
        visitor = _Visitor(
            found,
            filename,
            first_line,
            params[0] if params else "self",
            batch_idx,
            extra,
            reads,
            obj if callback else None,
            returns_step_output=not callback and depth == 0 and name == "training_step",
            namespace=getattr(function, "__globals__", None),
            closure=ClosureCells(function) if getattr(function, "__closure__", None) else None,
            module_names=module_names,
            module_reads=None if callback else reads,
            owner=obj,
            reads_helpers=not callback,
            defining_class=owner,
        )
        visitor.run(tree)
        if not callback and isinstance(function, types.FunctionType):
            found.module_functions_read.add((id(function.__code__), visitor.self_name))
        if depth < HELPER_DEPTH:  # (deeper, the methods it calls are not read: their batch_idx is compared)
            # (is_super: False for self's method, True for super(), or the class an explicit
            # `Base.name(self, ...)` call's lookup starts after)
            withheld += [
                (
                    (
                        helper,
                        is_super if isinstance(is_super, type) else owner if is_super else None,
                        position,
                    ),
                    counters,
                )
                for (helper, is_super, position), counters in visitor.withheld.items()
            ]
        else:
            found.counter_values += [c for counters in visitor.withheld.values() for c in counters]
        found.handed_on += [
            HandedOn(obj, path, where, module_at, counters, depth + 1)
            for (path, where, module_at), counters in visitor.handed_on.items()
        ]
        _record_outside_reads(found, function, visitor, depth, seen_functions)
        if depth < HELPER_DEPTH:
            pending += [
                (helper, depth + 1, position, None, *visitor.helper_args.get((helper, False), (None, None)))
                for helper, position in sorted(visitor.helpers.items())
            ]
            pending += [
                (helper, depth + 1, position, owner, *visitor.helper_args.get((helper, True), (None, None)))
                for helper, position in sorted(visitor.super_helpers.items())
            ]
            pending += [
                (helper, depth + 1, position, after, None, None)
                for (helper, after), position in visitor.class_helpers.items()
            ]
            if not callback:
                pending += [
                    (helper, depth + 1, None, None, None, None)
                    for helper in _held_methods(obj, visitor.alias_attributes, found, depth, seen_functions)
                ]
        if not callback:
            # methods called through another name (`getattr(self, f"_{kind}_loss")(...)`, `model.helper()`
            # in a loss function given the module): every method of the module's class they may name
            new, patterns_read = found.read_patterns[patterns_read:], len(found.read_patterns)
            called = [p for _, p, is_called in new if is_called]
            pending += [
                (method_name, min(depth + 1, HELPER_DEPTH), None, None, None, None)
                for method_name in _methods_matching(type(obj), called)
            ]
    for key, counters in withheld:
        if key not in bound:
            found.counter_values += counters


def _parameter(params: list[str], position: int | None) -> str | None:
    """The name of the parameter (after self) at `position`, or None."""
    return params[position + 1] if position is not None and len(params) > position + 1 else None


def _methods_matching(cls: type, patterns: list[re.Pattern[str]]) -> list[str]:
    """The names of the user's methods (and properties) of `cls` that one of `patterns` matches."""
    if not patterns:
        return []
    names = []
    for klass in cls.__mro__:
        for name, value in vars(klass).items():
            value = value.fget if isinstance(value, property) else value
            value = value.__func__ if isinstance(value, (staticmethod, classmethod)) else value
            if (
                name not in names
                and isinstance(value, types.FunctionType)
                and not _defined_by_library(value)
                and _is_user_code(value)
                and any(p.fullmatch(name) for p in patterns)
            ):
                names.append(name)
    return sorted(names)


# The most entries a container may have to be looked into for the functions it holds (it is read at
# each capture)
MAX_HELD_CALLABLES = 256


def _held_callables_in(value: Any) -> list[Any]:
    """The callables `value` is or holds as a container's entries (``{"mse": self._mse_loss}``), one
    level deep; a ``functools.partial``'s function."""
    if isinstance(value, dict):
        items = list(value.values())
    elif isinstance(value, (list, tuple)):
        items = list(value)
    else:
        items = [value]
    if len(items) > MAX_HELD_CALLABLES:
        return []  # a history or a cache the step appends to, not a table of functions
    out = []
    for item in items:
        while isinstance(item, functools.partial):
            item = item.func
        if isinstance(item, (types.FunctionType, types.MethodType)):
            out.append(item)
    return out


def _held_methods(obj: Any, names: set[str], found: StepSource, depth: int, seen: set[int]) -> list[str]:
    """The module's methods that its attributes `names` (read by the step) hold, bound to it, alone or in
    a container (``self.loss_fns = {"mse": self._mse_loss}``): read as helpers (returned by name). The
    functions those attributes hold that close over the module (``self.loss_fn = lambda p, y: ... *
    self.aux_weight``), or methods of it that its class does not define under that name, are read
    here, as the module's code."""
    held = getattr(obj, "__dict__", None)
    if not isinstance(held, dict):
        return []
    methods = []
    for name in sorted(names):
        for item in _held_callables_in(held.get(name)):
            if isinstance(item, types.MethodType):
                if item.__self__ is not obj:
                    continue
                function = item.__func__
                method_name = getattr(function, "__name__", "")
                if _lookup(type(obj), method_name, None)[1] is function:
                    methods.append(method_name)
                    continue
                params = function.__code__.co_varnames[:1]
                if params:
                    read_with_module(found, function, params[0], f"`self.{name}`", depth + 1, seen)
                continue
            alias = _closure_name_of(item, obj)
            if alias is not None:
                read_with_module(found, item, alias, f"`self.{name}`", depth + 1, seen)
    return methods


def _closure_name_of(function: Any, obj: Any) -> str | None:
    """The name under which `function` closes over `obj` (``lambda p, y: ... self.w`` made in a
    method: ``self``), or None."""
    code, cells = getattr(function, "__code__", None), getattr(function, "__closure__", None)
    if code is None or not cells:
        return None
    for name, cell in zip(code.co_freevars, cells):
        try:
            if cell.cell_contents is obj:
                return name
        except ValueError:  # a cell not bound yet
            continue
    return None


def _read_held_with_module(
    found: StepSource,
    obj: Any,
    name: str,
    module_position: int,
    depth: int,
    seen: set[int],
    batch_position: int | None = None,
) -> None:
    """``self.loss_fn(self, pred, y)``: the function `obj` holds under `name`, given the module at
    `module_position`, read as the module's code; anything else given the module is not known. Given
    batch_idx too (at `batch_position`), it is read with that parameter bound to it, as the code
    :attr:`StepSource.handed_on` hands it to is."""
    held = (
        getattr(obj, "__dict__", {}).get(name) if isinstance(getattr(obj, "__dict__", None), dict) else None
    )
    while isinstance(held, functools.partial):
        held = held.func  # (the positions are then the partial's caller's: not followed exactly)
        module_position = -1
    line = f"`self.{name}(...)`"
    function = _unwrapped(held)
    if isinstance(function, types.FunctionType) and module_position >= 0 and _is_user_code(function):
        params = function.__code__.co_varnames[: function.__code__.co_argcount]
        if module_position < len(params):
            batch_idx = (
                params[batch_position]
                if batch_position is not None and batch_position < len(params)
                else None
            )
            if read_with_module(found, function, params[module_position], line, depth + 1, seen, batch_idx):
                if batch_idx is not None:  # (the held call's record finds it read so: read_handed_on)
                    found.callees_read[(id(None), id(function.__code__), batch_idx)] = (None, function)
            return
    found.add_read_pattern(line, _ANY_NAME, False)


def _lookup(cls: type, name: str, after: type | None) -> tuple[type | None, Any]:
    """(the class that defines it, the function) for `name` on `cls`, or for ``super().name`` from a
    method of `after`: the first definition after `after` in `cls`'s MRO."""
    mro = cls.__mro__
    start = mro.index(after) + 1 if after is not None and after in mro else 0
    for klass in mro[start:]:
        if name in vars(klass):
            return klass, vars(klass)[name]
    return None, None


def _defined_by_library(method: Any) -> bool:
    module = getattr(method, "__module__", "") or ""
    return module.startswith(("lightning.", "pytorch_lightning."))


def _parse(method: Any) -> tuple[Any, str, int, list[str]]:
    try:
        lines, first_line = inspect.getsourcelines(method)
        filename = inspect.getsourcefile(method) or "<unknown>"
    except (OSError, TypeError):
        return None, "", 0, []
    try:
        tree = ast.parse(textwrap.dedent("".join(lines)))
    except SyntaxError:
        return None, "", 0, []
    func = (
        tree.body[0]
        if tree.body and isinstance(tree.body[0], (ast.FunctionDef, ast.AsyncFunctionDef))
        else None
    )
    if func is None:
        return None, "", 0, []
    params = [a.arg for a in func.args.posonlyargs + func.args.args]
    return func, filename, first_line, params


class _Visitor:
    def __init__(
        self,
        found: StepSource,
        filename: str,
        first_line: int,
        self_name: str,
        batch_idx: str | None,
        extra: tuple[str, ...] = (),
        reads: set[str] | None = None,
        callback: Any = None,
        returns_step_output: bool = False,
        namespace: dict | None = None,
        closure: Any = None,
        module_names: tuple[str, ...] = (),
        module_reads: set[str] | None = None,
        owner: Any = None,
        reads_helpers: bool = False,
        defining_class: type | None = None,
    ):
        self.found = found
        # the caller reads the methods of `owner`'s class this code calls through `self_name` with the
        # batch_idx they are handed (the module's own analysis, :func:`_analyse_object`); else such a
        # call is one of those `handed_on`
        self.reads_helpers = reads_helpers
        # batch_idx handed on by position to a method of the class (name, through super(), position), and
        # to what `self_name`'s attributes hold (the attributes, the position or keyword): its reads as
        # compared numbers, which the caller adds to the comparisons where it cannot read the code
        # called with its parameter bound to batch_idx
        self.withheld: dict[tuple[str, bool, int], list[CounterValue]] = {}
        self.handed_on: dict[tuple[tuple[str, ...], int | str, int | str | None], list[CounterValue]] = {}
        # the object whose method this is, where known (what `self.ema.update` is, found without running
        # any of its code)
        self.owner = owner
        # the names bound to the LightningModule in this function (``self`` in the module's methods, a
        # callback hook's ``pl_module``, a loss function's ``model`` parameter), with the locals assigned
        # once from one of them (``m = self``): what it reads through them is the module's
        self.module_names = set(module_names)
        # where the attribute names read through them go (None: not recorded, as a callback's)
        self.module_reads = module_reads
        # the attributes of the module read through those names here (`self.loss_fns`)
        self.alias_attributes: set[str] = set()
        # what is read of the module by names the source does not show (StepSource.read_patterns)
        self.read_patterns: list[tuple[str, re.Pattern[str], bool]] = []
        # the user's functions handed the module: (function, position or keyword, "file:line (...)")
        self.module_arguments: list[tuple[Any, int | str, str]] = []
        # per method called on self (name, whether through super()): the positions among its
        # arguments of the Trainer and of the module (a callback's hook handing them on)
        self.helper_args: dict[tuple[str, bool], tuple[int | None, int | None]] = {}
        # the function's module globals and closure variables (a ClosureCells): a logged expression may
        # read them (``self.log("w", CFG.w)``), evaluated against them, live, at each replay
        self.namespace = namespace
        self.closure = closure
        # training_step itself: what its return statement holds is the step's output
        self.returns_step_output = returns_step_output
        self.filename = filename
        self.first_line = first_line
        self.self_name = self_name
        self.batch_idx = batch_idx
        # a callback hook's trainer and pl_module parameters: names its tests may read
        self.extra = extra
        self.reads = found.reads if reads is None else reads
        self.callback = callback
        self.assigned: dict[
            str, ast.expr | None
        ] = {}  # local -> its only assigned value (None: assigned twice)
        # the module's methods this one calls (self.name(...), self(...) for forward), with the position
        # among their parameters of the batch_idx argument passed on, if it is; the same for
        # super().name(...) calls
        self.helpers: dict[str, int | None] = {}
        self.super_helpers: dict[str, int | None] = {}
        # the same for a base class's method called explicitly (``Base.training_step(self, batch,
        # batch_idx)``): (name, the class of the MRO its lookup starts after) -> position
        self.class_helpers: dict[tuple[str, type | None], int | None] = {}
        # the class whose method this is (the module's own analysis), where explicit calls resolve
        self.defining_class = defining_class
        # names read that are not the function's own (parameters, assignments, imports, loop targets):
        # module globals (or builtins, or closure variables; the capture keeps the globals among them)
        self.global_names: set[str] = set()
        # `name.attr` reads rooted at such a name (``cfg.LOSS_W`` for an imported module ``cfg``)
        self.module_attributes: set[tuple[str, str]] = set()
        # plain calls by such a name or `name.attr` (``scale(loss)``, ``losses.focal(x)``): followed if
        # they are functions of the user's own code
        self.called_names: set[tuple[str, ...]] = set()
        # attribute and constant-subscript chains rooted at such a name (``CFG.loss.weight``,
        # ``args.ent_coef``): (root name, "file:line (...)", whether it is one attribute of the root,
        # reader of the chain from the root's value)
        self.global_chains: list[tuple[str, str, bool, Callable[[Any], Any]]] = []
        # every node inside an operand site's number -> the site's key (_operand_sites)
        self._site_of: dict[int, tuple] = {}
        self._func: ast.AST | None = None
        # module-level names read only inside operand sites' numbers (name -> their keys), and those
        # read anywhere else in the function: :func:`_record_globals` hands them to the StepSource
        self.global_sites: dict[str, set[tuple]] = {}
        self.global_other: set[str] = set()

    def run(self, func: ast.AST) -> None:
        for node in ast.walk(func):
            if (
                isinstance(node, ast.Assign)
                and len(node.targets) == 1
                and isinstance(node.targets[0], ast.Name)
            ):
                name = node.targets[0].id
                self.assigned[name] = None if name in self.assigned else node.value
            elif isinstance(node, (ast.AugAssign, ast.AnnAssign)) and isinstance(node.target, ast.Name):
                self.assigned[node.target.id] = None
        self._module_aliases()
        # what only self.log/self.log_dict arguments read is re-evaluated per replay, not baked
        logged = {
            id(inner)
            for node in ast.walk(func)
            if isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr in ("log", "log_dict")
            and isinstance(node.func.value, ast.Name)
            and node.func.value.id in (self.self_name, *self.extra[1:], *self.module_names)
            for arg in [*node.args, *(k.value for k in node.keywords)]
            for inner in ast.walk(arg)
        }
        parents: dict[int, ast.AST] = {}
        for node in ast.walk(func):
            for child in ast.iter_child_nodes(node):
                parents[id(child)] = node
        tests = {
            id(inner)
            for node in ast.walk(func)
            for test in (
                [node.test]
                if isinstance(node, (ast.If, ast.While, ast.IfExp))
                else node.ifs
                if isinstance(node, ast.comprehension)
                else []
            )
            for inner in ast.walk(test)
        }
        if self.returns_step_output:
            logged |= self._output_values(func, parents)
        self._func = func
        self._operand_sites(func, logged, parents, tests)
        self._counter_values(func, logged, parents, tests)
        self._attribute_values(func, logged, parents, tests)
        self.global_names = (
            _free_names(func)
            - self.module_names
            - {node.id for node in ast.walk(func) if isinstance(node, ast.Name) and id(node) in logged}
        )
        for node in ast.walk(func):
            if isinstance(node, ast.Name) and node.id in self.global_names and isinstance(node.ctx, ast.Load):
                if id(node) in self._site_of:
                    self.global_sites.setdefault(node.id, set()).add(self._site_of[id(node)])
                else:
                    self.global_other.add(node.id)
        for node in ast.walk(func):
            if (
                isinstance(node, ast.Attribute)
                and isinstance(node.value, ast.Name)
                and node.value.id in self.global_names
                and id(node) not in logged
            ):
                self.module_attributes.add((node.value.id, node.attr))
            if isinstance(node, ast.Call):
                if isinstance(node.func, ast.Name) and node.func.id in self.global_names:
                    self.called_names.add((node.func.id,))
                elif (
                    isinstance(node.func, ast.Attribute)
                    and isinstance(node.func.value, ast.Name)
                    and node.func.value.id in self.global_names
                ):
                    self.called_names.add((node.func.value.id, node.func.attr))
        self._global_chains(func, logged, parents)
        # names declared `global` or `nonlocal` and assigned: the step changes them, a replay would not
        declared = _declared(func, ast.Global) | _declared(func, ast.Nonlocal)
        self.found.global_writes += [
            f"`{node.id}` at {self._line(node)}"
            for node in ast.walk(func)
            if isinstance(node, ast.Name) and not isinstance(node.ctx, ast.Load) and node.id in declared
        ]
        # values Lightning changes between steps, where they reach the step's work (not a log's
        # argument, re-evaluated per replay, nor host text)
        for node in ast.walk(func):
            if self._reads_trainer_metrics(node):
                reads = self.found.trainer_metric_reads
            elif (
                isinstance(node, ast.Attribute)
                and node.attr in SCHEDULER_STATE
                and not self._own_attribute(node)
            ):
                reads = self.found.scheduler_reads
            else:
                continue
            if id(node) not in logged and not self._host_only(node, parents):
                reads.append(self._line(node))
        # the host clock, where its reading reaches the step's work
        for node in ast.walk(func):
            if (
                isinstance(node, ast.Call)
                and self._is_clock(node.func)
                and self._reaches_work(node, func, logged, parents, set())
            ):
                self.found.clock_reads.append(self._line(node))
        # iterators held outside the step, advanced by it (`next(iter(self.parameters()))` makes its own)
        for node in ast.walk(func):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Name)
                and node.func.id == "next"
                and "next" not in self.assigned
                and node.args
            ):
                base, links = _chain_base(node.args[0])
                if isinstance(base, ast.Name) and (
                    (links and base.id in (self.self_name, *self.extra, *self.module_names))
                    or base.id in self.global_names
                ):
                    self.found.iterator_advances.append(self._line(node))
        for node in ast.walk(func):
            if isinstance(node, (ast.If, ast.While, ast.IfExp)):
                self._condition(node.test)
            elif isinstance(node, ast.comprehension):
                for test in node.ifs:
                    self._condition(test)
            elif isinstance(node, ast.Call):
                self._log_call(node)
                self._helper_call(node)
            if (
                isinstance(node, ast.Attribute)
                and isinstance(node.value, ast.Name)
                and node.value.id == self.self_name
                and id(node) not in logged
            ):
                self.reads.add(node.attr)
                self._note_read(node, self.reads)
        self._module_uses(func, parents, logged)

    def _note_read(self, node: ast.Attribute, into: set[str] | None) -> None:
        """Record whether `node`, a read of the module's attribute when `into` (where it was recorded)
        is the module's reads, lies inside an operand site's number."""
        if into is not self.found.reads:
            return  # another object's attribute
        if id(node) in self._site_of:
            self.found.site_reads.setdefault(node.attr, set()).add(self._site_of[id(node)])
        else:
            self.found.other_reads.add(node.attr)

    def _module_aliases(self) -> None:
        """Add to :attr:`module_names` the locals assigned once from one of them (``model = self``)."""
        if not self.module_names:
            return
        grown = True
        while grown:
            grown = False
            for name, value in self.assigned.items():
                if (
                    isinstance(value, ast.Name)
                    and value.id in self.module_names
                    and name not in self.module_names
                ):
                    self.module_names.add(name)
                    grown = True

    def _module_uses(self, func: ast.AST, parents: dict[int, ast.AST], logged: set[int]) -> None:
        """Follow every use of a name bound to the module (:attr:`module_names`) that is not an attribute
        read through it (``self.w``, recorded as it is read): handed to a function (read as the module's
        code), to ``getattr`` by a computed name, assigned to a local (an alias), compared or formatted
        (nothing read). Any other use (``vars(self)``, ``self`` in a container, handed to code that cannot
        be read) may read any of the module's attributes: recorded as such (:attr:`read_patterns`)."""
        if not self.module_names:
            return
        for node in ast.walk(func):
            if not (
                isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load) and node.id in self.module_names
            ):
                continue
            parent = parents.get(id(node))
            if isinstance(parent, ast.Attribute) and parent.value is node:
                if parent.attr in _OPAQUE_DUNDERS:  # self.__dict__: every attribute
                    self._reads_any(node)
                elif id(parent) not in logged and not parent.attr.startswith("__"):
                    self.alias_attributes.add(parent.attr)
                    if self.module_reads is not None:
                        self.module_reads.add(parent.attr)
                    self._note_read(parent, self.module_reads)
                continue
            if isinstance(parent, ast.Call) and parent.func is node:
                if node.id != self.self_name:  # `model(x)`: the module's forward
                    self.read_patterns.append((self._line(node), re.compile("forward"), True))
                continue
            if isinstance(parent, ast.Call) and any(a is node for a in parent.args):
                self._module_argument(
                    parent, node, next(i for i, a in enumerate(parent.args) if a is node), parents
                )
                continue
            if isinstance(parent, ast.keyword) and parent.arg is not None:
                call = parents.get(id(parent))
                if isinstance(call, ast.Call):
                    self._module_argument(call, node, parent.arg, parents)
                    continue
            if (
                isinstance(parent, ast.Assign)
                and parent.value is node
                and all(isinstance(t, ast.Name) and t.id in self.module_names for t in parent.targets)
            ):
                continue  # an alias, followed by its own uses
            if isinstance(parent, (ast.Compare, ast.FormattedValue)):
                continue  # `self is other`, `f"{self}"`
            self._reads_any(node)

    def _reads_any(self, node: ast.AST) -> None:
        self.read_patterns.append((self._line(node), _ANY_NAME, False))

    def _module_argument(
        self, call: ast.Call, node: ast.Name, where: int | str, parents: dict[int, ast.AST]
    ) -> None:
        """The module, as `node`, handed to `call` as its argument `where` (a position or a keyword)."""
        func = call.func
        if (
            isinstance(func, ast.Attribute)
            and (isinstance(func.value, ast.Name) and func.value.id == self.self_name or _is_super_call(func))
            and not func.attr.startswith("__")
            and isinstance(where, int)
        ):
            return  # a method of the object read here: its parameter is followed (helper_args)
        if where == 0 and self._parent_call(call) is not None:
            return  # `Base.name(self, ...)`: the base class's method, read as the module's (_helper_call)
        target = self._callee(func)
        if target is getattr and where == 0:
            name = call.args[1] if len(call.args) >= 2 else None
            if isinstance(name, ast.Constant) and isinstance(name.value, str):
                if name.value in _OPAQUE_DUNDERS:
                    self._reads_any(node)
                elif not name.value.startswith("__"):
                    self.alias_attributes.add(name.value)
                    if self.module_reads is not None:
                        self.module_reads.add(name.value)
                    self.found.other_reads.add(name.value)
                return
            # getattr(self, f"_{kind}_loss"): the attributes the name can take; called, the methods
            outer = parents.get(id(call))
            called = isinstance(outer, ast.Call) and outer.func is call
            self.read_patterns.append((self._line(call), _name_pattern(name), called))
            return
        if target is hasattr and where == 0:
            name = call.args[1] if len(call.args) >= 2 else None
            if (
                isinstance(name, ast.Constant)
                and isinstance(name.value, str)
                and self.module_reads is not None
            ):
                self.module_reads.add(name.value)
                self.found.other_reads.add(name.value)
            return
        if any(target is harmless for harmless in _HARMLESS_BUILTINS):
            return
        line = self._line(call)
        if target is functools.partial and isinstance(where, int) and where >= 1 and call.args:
            # functools.partial(loss_fn, self): the function is handed the module when it is called
            function = _unwrapped(self._callee(call.args[0]))
            if isinstance(function, types.FunctionType) and _is_user_code(function):
                self.module_arguments.append((function, where - 1, line))
                return
            self._reads_any(node)
            return
        if isinstance(target, types.MethodType) and _is_user_code(target.__func__):
            if isinstance(where, int):
                where += 1  # after the bound object
            self.module_arguments.append((target.__func__, where, line))
            return
        function = _unwrapped(target)
        if isinstance(function, types.FunctionType) and _is_user_code(function):
            self.module_arguments.append((function, where, line))
            return
        if target is not _MISSING and not _is_users(target):
            # a library's function (`grad_norm(self, 2)`, `torch.func.functional_call(self, ...)`): it
            # knows none of the module's own attributes; it may run its forward
            self.read_patterns.append((line, re.compile("forward"), True))
            return
        self._reads_any(node)  # a callable the source does not name, or the user's class or object

    def _callee(self, func: ast.expr) -> Any:
        """What the called `func` is, where it is a module-level or closure name or a chain of attributes
        of modules and classes from one (``losses.focal``, ``torch.func.functional_call``), or a builtin;
        else :data:`_MISSING`."""
        if (
            isinstance(func, ast.Call)
            and isinstance(func.func, ast.Name)
            and func.func.id == "getattr"
            and func.args
        ):
            # `getattr(LightningModule, name)(self, ...)`: any attribute of a library's class or module
            # is the library's
            held = self._callee(func.args[0])
            if isinstance(held, (type, types.ModuleType)) and not _is_users(held):
                return held
            return _MISSING
        path: list[str] = []
        node = func
        while isinstance(node, ast.Attribute):
            path.insert(0, node.attr)
            node = node.value
        if isinstance(node, ast.Name) and node.id == self.self_name and self.owner is not None and path:
            # `self.ema.update(self)`: the object read here holds what is called, read statically
            return _called_object(_static_method(self.owner, path))
        if (
            not isinstance(node, ast.Name)
            or node.id in self.module_names
            or node.id in (self.self_name, self.batch_idx, *self.extra)
            or node.id in self.assigned
        ):
            return _MISSING
        if self.closure is not None and node.id in self.closure:
            held = self.closure[node.id]
        elif self.namespace is not None and node.id in self.namespace:
            held = self.namespace[node.id]
        elif node.id in self.global_names or self.namespace is None:
            held = getattr(builtins, node.id, _MISSING)
        else:
            return _MISSING  # a parameter or a local the reader did not follow
        for i, name in enumerate(path):
            if held is _MISSING:
                return _MISSING
            if not isinstance(held, (types.ModuleType, type)):
                # what an object held at module level holds (`CFG.loss_fn`, a config's function) or its
                # class's method (`LOSS.compute(self, ...)`, `logger.info(..., self)`), read statically
                return _called_object(_static_method(held, path[i:]))
            held = getattr(held, name, _MISSING)
        return _called_object(held)

    def _counter_values(
        self, func: ast.AST, logged: set[int], parents: dict[int, ast.AST], tests: set[int]
    ) -> None:
        """Record the numbers the step computes from the step counters outside branch tests.

        ``w = max(0.0, (self.global_step - 10) * 0.1)`` then ``loss * (1 + w)``: the graph bakes in the
        capture step's ``w``. If it stays the same through the warm-up steps (a ramp that starts
        later, a weight per epoch), no trace comparison sees it, so the largest expression around
        each read of a counter that can be evaluated from the module alone is evaluated before each
        replay, and a different value captures again. Reads that cannot reach a graph are left out:
        branch tests (:class:`Condition`), ``self.log`` arguments (re-evaluated per replay), f-strings
        and ``print`` (host text); ``batch_idx`` handed on to a method of the object read here or to
        what its attributes hold is set aside (:attr:`withheld`, :attr:`handed_on`): compared only
        where the code it is handed to is not read with it.
        """
        seen: set[int] = set()
        for node in ast.walk(func):
            if not self._is_counter_read(node) or id(node) in tests or id(node) in logged:
                continue
            if self._host_only(node, parents):
                continue
            # the largest expression around the read that the module alone evaluates
            counter = self._compile(node, allow_methods=False)
            if counter is None:
                # read through what cannot be evaluated before a replay (`self._lm().global_step`
                # through a weakref to the module, a method's result): never the same, so a replay of
                # a graph that bakes it in is never taken (it is captured again, then trained eagerly)
                counter = _cannot_evaluate
            top, evaluate = node, counter
            while counter is not _cannot_evaluate and isinstance(parent := parents.get(id(top)), ast.expr):
                wider = self._compile(parent, allow_methods=False)
                if wider is None:
                    break
                top, evaluate = parent, wider
            if id(top) in seen:
                continue
            seen.add(id(top))
            guards = self._guards(top, parents)
            if guards:
                evaluate, counter = guarded(evaluate, guards), guarded(counter, guards)
            line = self._line(top)
            if counter is _cannot_evaluate:
                line += ", read through what cannot be evaluated before a replay"
            value = CounterValue(line, evaluate, counter, self._sites_of(top, parents))
            handed = self._handed_on_to(node, parents) if top is node else None
            if handed is None:
                self.found.counter_values.append(value)
            elif handed[0] == "held":
                self.handed_on.setdefault(handed[1:], []).append(value)  # type: ignore[arg-type]
            else:
                self.withheld.setdefault(handed[1:], []).append(value)  # type: ignore[arg-type]

    def _operand_sites(
        self, func: ast.AST, logged: set[int], parents: dict[int, ast.AST], tests: set[int]
    ) -> None:
        """Record the tensor ``*``, ``+``, ``-`` whose other side is a Python number the module alone
        evaluates and that moves with it (reads the module, the step counters or batch_idx): ``loss -
        self.ent_coef * entropy``, ``beta * 1e-3 * reg`` with ``beta = 0.5 * min(self.current_epoch, 2)``.
        A side that evaluates too makes it Python arithmetic, not an op (``self.w * 2``)."""
        if self.reads is not self.found.reads and self.callback is None:
            return  # another object's code: its `self` is not what the module's evaluation reads
        movers = {self.self_name, self.batch_idx, *self.extra, *self.module_names} - {None, ""}
        # module-level numbers the function reads (``loss * AUX_WEIGHT``, a script's constant a hook sets)
        namespace = self.namespace if isinstance(self.namespace, dict) else {}
        movers |= {
            name
            for name in _free_names(func) - movers
            if name in namespace and type(namespace[name]) in (int, float)
        }
        for node in ast.walk(func):
            if (
                not isinstance(node, ast.BinOp)
                or not isinstance(node.op, (ast.Add, ast.Sub, ast.Mult))
                or id(node) in logged
                or id(node) in tests
                or self._host_only(node, parents)
            ):
                continue
            for side, other in ((node.left, node.right), (node.right, node.left)):
                inlined = self._inline(side, globals_ok=True)
                if inlined is None or not any(
                    isinstance(n, ast.Name) and n.id in movers for n in ast.walk(inlined)
                ):
                    continue
                evaluate = self._site_number(side)
                if evaluate is None or self._site_number(other) is not None:
                    continue
                key = self._position(node)
                if key is None:
                    break
                self.found.operand_sites.append(OperandSite(key, evaluate, self._line(node)))
                for inner in ast.walk(side):
                    self._site_of[id(inner)] = key
                break

    def _site_number(self, side: ast.expr) -> Callable[[Any, int], Any] | None:
        """An evaluator of `side` as an operand site's number: from the module, the step counters,
        batch_idx, the ``math`` module's functions, or the function's module globals (read live)."""
        evaluate = self._compile(side, allow_methods=False, math_only=True)
        if evaluate is None:
            evaluate = self._compile(side, allow_methods=False, globals_ok=True)
        return evaluate

    def _position(self, node: ast.expr) -> tuple[str, int, int, int, int] | None:
        """`node`'s (file, line, column, end line, end column) in the file, as CPython's co_positions
        gives them: the parsed source was dedented by the margin of its first line."""
        first = linecache.getline(self.filename, self.first_line)
        if not first.strip() or node.end_lineno is None or node.end_col_offset is None:
            return None
        margin = len(first) - len(first.lstrip(" \t"))
        return (
            self.filename,
            self.first_line + node.lineno - 1,
            node.col_offset + margin,
            self.first_line + node.end_lineno - 1,
            node.end_col_offset + margin,
        )

    def _sites_of(self, node: ast.AST, parents: dict[int, ast.AST], depth: int = 0) -> frozenset:
        """The operand sites through which alone the value `node` reads reaches the step's ops: the one
        it lies in, or, inside the value of a local assigned once (``beta = 0.5 * min(self.current_epoch,
        2)``, ``w = 0.5 * (1 + math.cos(...))``), those of every read of that local, followed the same
        way; empty where any read lies elsewhere."""
        if id(node) in self._site_of:
            return frozenset({self._site_of[id(node)]})
        top = node
        while isinstance(parent := parents.get(id(top)), ast.expr):
            top = parent
        parent = parents.get(id(top))
        if not (
            depth < 4
            and isinstance(parent, ast.Assign)
            and parent.value is top
            and len(parent.targets) == 1
            and isinstance(parent.targets[0], ast.Name)
            and self.assigned.get(parent.targets[0].id) is top
            and self._func is not None
        ):
            return frozenset()
        name = parent.targets[0].id
        loads = [
            n
            for n in ast.walk(self._func)
            if isinstance(n, ast.Name) and n.id == name and isinstance(n.ctx, ast.Load)
        ]
        sites: set = set()
        for load in loads:
            found = self._sites_of(load, parents, depth + 1)
            if not found:
                return frozenset()
            sites |= found
        return frozenset(sites)

    def _guards(
        self, node: ast.AST, parents: dict[int, ast.AST]
    ) -> list[tuple[Callable[[Any, int], Any], bool]]:
        """The branch tests `node` sits under, each with the side it is on, where all of them can be
        evaluated (else none: the value is then compared on every step, which is the safe side).

        A value inside ``if batch_idx % 100 == 0:`` reaches the graph only on steps that take that
        branch; the others do not bake it (and steps on another branch than the captured one run
        eagerly anyway), so it is compared only where its branch is taken.
        """
        guards = []
        child, parent = node, parents.get(id(node))
        while parent is not None:
            side = None
            if isinstance(parent, (ast.If, ast.While)) and child is not parent.test:
                side = child in parent.body
            elif isinstance(parent, ast.IfExp) and child is not parent.test:
                side = child is parent.body
            if side is not None:
                test = self._compile(parent.test, allow_methods=False)
                if test is None:
                    return []
                guards.append((test, side))
            child, parent = parent, parents.get(id(parent))
        return guards

    def _attribute_values(
        self, func: ast.AST, logged: set[int], parents: dict[int, ast.AST], tests: set[int]
    ) -> None:
        """Record the values the step reads through ``self`` by attributes and constant subscripts.

        ``loss * self.hparams.kl_weight``, ``self.weights[0]``, ``self.cfg["w"]``: a Python number read
        this way is baked into the graph, and a callback or hook may change it between steps without
        rebinding anything the other checks see (an element of a list, a key of a dict, an
        ``AttributeDict`` entry). Each such chain that can be evaluated from the module alone is
        compared before every replay (where its value is a Python number or a small container of
        them). Chains through the step counters, method calls, branch tests, ``self.log`` arguments
        and host text are left to the other checks.
        """
        roots = (self.self_name, *self.extra)
        for node in ast.walk(func):
            mapping_get = _constant_get(node)  # self.hparams.get("w", 1.0): read like self.hparams["w"]
            if mapping_get is not None and id(node) not in logged and not self._host_only(node, parents):
                # kept in branch tests too: a flag changed captures again, and the capture takes the
                # new branch (a test with a call is no Condition)
                receiver, key, default = mapping_get
                receiver = self._unaliased(receiver)  # hp = self.hparams; hp.get("w", 1.0)
                base, _ = _chain_base(receiver)
                chain = [n for n in ast.walk(receiver) if isinstance(n, ast.Attribute)]
                if (
                    isinstance(base, ast.Name)
                    and base.id in roots
                    and not any(n.attr in STEP_COUNTERS or n.attr == "trainer" for n in chain)
                    and (read := self._compile(receiver, allow_methods=False)) is not None
                ):
                    self.found.attribute_values.append(
                        AttributeValue(self._line(node), _getting(read, key, default))
                    )
                continue
            by_getattr = _constant_getattr(node)  # getattr(self.cfg, "w", 1.0) reads like self.cfg.w
            if not by_getattr and (
                not isinstance(node, (ast.Attribute, ast.Subscript)) or not isinstance(node.ctx, ast.Load)
            ):
                continue
            parent = parents.get(id(node))
            indexed_by_a_local = isinstance(parent, ast.Subscript) and not isinstance(
                parent.slice, ast.Constant
            )
            if (
                isinstance(parent, (ast.Attribute, ast.Subscript))
                and parent.value is node
                and not indexed_by_a_local
                and not _read_whole_by_a_view(node, parents)
            ):
                continue  # part of a longer chain (`self.weights[i]` follows `self.weights` whole)
            if isinstance(parent, ast.Call) and parent.func is node:
                # a method call, not a value; but a method of the user's object on the Trainer
                # (`self.trainer.callbacks[1].weight()`) reads what no check follows: that object's
                # own numbers are compared instead
                if not (isinstance(node, ast.Attribute) and _through_users_object_on_trainer(node.value)):
                    continue
                node = node.value
            if id(node) in tests or id(node) in logged or self._host_only(node, parents):
                continue
            # cb = self.trainer.callbacks[1]; cb.w: the chain the local holds, then the rest
            target = self._unaliased(node.args[0] if by_getattr else node)
            chain = [n for n in ast.walk(target) if isinstance(n, (ast.Attribute, ast.Subscript, ast.Name))]
            base, _ = _chain_base(target)
            if not (isinstance(base, ast.Name) and base.id in roots):
                continue
            if any(isinstance(n, ast.Attribute) and n.attr in STEP_COUNTERS for n in chain):
                continue  # the counters have their own check
            on_users_object = _through_users_object_on_trainer(target)
            if (
                any(isinstance(n, ast.Attribute) and n.attr == "trainer" for n in chain)
                and not on_users_object
            ):
                # the Trainer's own state is not the step's (and some of its properties compute);
                # the objects the user gave it are the user's (a curriculum's difficulty on the
                # data module or the dataset, a weight a callback holds)
                continue
            evaluate = self._compile(node, allow_methods=False)
            if evaluate is not None:
                if on_users_object:
                    # `next(c for c in self.trainer.callbacks if ...)`, a loop over them, a method of
                    # one: the objects reached are compared by their own numbers
                    evaluate = _users_objects_state_when_opaque(evaluate)
                self.found.attribute_values.append(
                    AttributeValue(self._line(node), evaluate, self._sites_of(node, parents))
                )

    def _global_chains(self, func: ast.AST, logged: set[int], parents: dict[int, ast.AST]) -> None:
        """Record the attribute and constant-subscript chains the function reads from a module-level or
        closure name: ``CFG.loss.weight``, ``args.ent_coef`` (an ``argparse`` namespace), ``Config.W`` (a
        class attribute), ``CONFIG["loss"]["w"]``. A Python number at the end of one is baked into the
        graph like ``self.weights[0]`` (:meth:`_attribute_values`), and a callback may change it in place
        between steps: :func:`_record_global_chains` keeps those whose root object may be read, compared
        before each replay. Unlike the chains through ``self``, those in branch tests are kept too (a
        changed flag captures the step again, and the new capture takes the new branch)."""
        for node in ast.walk(func):
            if id(node) in logged or self._host_only(node, parents):
                continue
            mapping_get = _constant_get(node)  # CONFIG.get("w", 1.0): read like CONFIG["w"]
            called = False
            if mapping_get is not None:
                chain, getting = mapping_get[0], mapping_get[1:]
            elif isinstance(node, (ast.Attribute, ast.Subscript)) and isinstance(node.ctx, ast.Load):
                parent = parents.get(id(node))
                continues = isinstance(parent, (ast.Attribute, ast.Subscript)) and parent.value is node
                if (
                    continues
                    and not (isinstance(parent, ast.Subscript) and not isinstance(parent.slice, ast.Constant))
                    and not _read_whole_by_a_view(node, parents)
                ):
                    continue  # part of a longer chain
                called = isinstance(parent, ast.Call) and parent.func is node
                chain, getting = node, None
            else:
                continue
            chain = self._unaliased(chain)  # c = CFG; c.loss.weight
            base, depth = _chain_base(chain)
            if not (isinstance(base, ast.Name) and base.id in self.global_names) or not _safe(chain, False):
                continue
            read = _chain_reader(chain, base.id)
            if read is None:
                continue
            if called:
                # `LOSSES["focal"](logits, y)`: what is called, compared (a function by identity, the
                # user's callable object by identity and its own numbers, which its `__call__` reads)
                read = _called_state(read)
            if getting is not None:
                key, default = getting
                read = _getting(read, key, default)
            one_attribute = getting is None and depth == 1 and isinstance(chain, ast.Attribute)
            self.global_chains.append((base.id, self._line(node), one_attribute, read))

    def _own_attribute(self, node: ast.Attribute) -> bool:
        """``self.last_epoch``: the module's own attribute (a LightningModule has no scheduler state of
        its own), compared before each replay like any other, not a scheduler's."""
        return isinstance(node.value, ast.Name) and node.value.id == self.self_name

    def _is_clock(self, func: ast.expr) -> bool:
        """Whether the called `func` is one of the host clock's readers (:data:`CLOCKS`): resolved in the
        function's module globals where they can be read (``from time import monotonic`` too), else
        by its dotted name (``time.time``)."""
        path: list[str] = []
        node = func
        while isinstance(node, ast.Attribute):
            path.insert(0, node.attr)
            node = node.value
        if (
            not isinstance(node, ast.Name)
            or node.id in (self.self_name, *self.extra)
            or node.id in self.assigned
        ):
            return False
        path.insert(0, node.id)
        if self.namespace is not None and path[0] in self.namespace:
            held = self.namespace[path[0]]
            for name in path[1:]:
                if not isinstance(held, (types.ModuleType, type)):
                    return False
                held = getattr(held, name, None)
            return callable(held) and any(_same_callable(held, c) for c in CLOCKS)
        return ".".join(path) in CLOCK_NAMES

    def _reaches_work(
        self, node: ast.AST, func: ast.AST, logged: set[int], parents: dict[int, ast.AST], followed: set[str]
    ) -> bool:
        """Whether the value of `node` reaches the step's work: not only a ``self.log`` argument or host
        text, directly or through the locals it is assigned to (``t = time.time()`` read only in a
        logged expression reaches nothing)."""
        if id(node) in logged or self._host_only(node, parents) or _written_out(node, parents):
            return False
        statement = parents.get(id(node))
        while statement is not None and not isinstance(statement, ast.stmt):
            statement = parents.get(id(statement))
        if not (
            isinstance(statement, ast.Assign)
            and len(statement.targets) == 1
            and isinstance(statement.targets[0], ast.Name)
        ):
            return True
        name = statement.targets[0].id
        if name in followed:
            return False
        followed.add(name)
        return any(
            self._reaches_work(use, func, logged, parents, followed)
            for use in ast.walk(func)
            if isinstance(use, ast.Name) and use.id == name and isinstance(use.ctx, ast.Load)
        )

    def _reads_trainer_metrics(self, node: ast.AST) -> bool:
        """`self.trainer.callback_metrics` (or ``logged_metrics``, ``progress_bar_metrics``), or in a
        callback's hook the same attributes of its ``trainer`` argument."""
        if not (isinstance(node, ast.Attribute) and node.attr in TRAINER_METRICS):
            return False
        owner = node.value
        if isinstance(owner, ast.Attribute) and owner.attr == "trainer":
            return isinstance(owner.value, ast.Name) and owner.value.id == self.self_name
        return isinstance(owner, ast.Name) and bool(self.extra) and owner.id == self.extra[0]

    def _is_counter_read(self, node: ast.AST) -> bool:
        if isinstance(node, ast.Attribute) and node.attr in STEP_COUNTERS:
            return True
        return isinstance(node, ast.Name) and self.batch_idx is not None and node.id == self.batch_idx

    def _host_only(self, node: ast.AST, parents: dict[int, ast.AST]) -> bool:
        """Whether `node` only feeds host-side text."""
        parent = parents.get(id(node))
        while parent is not None:
            if isinstance(parent, ast.JoinedStr) and not _selects(parent, parents):
                return True
            if isinstance(parent, ast.Call):
                f = parent.func
                if isinstance(f, ast.Name) and f.id == "print":
                    return True
                if (
                    isinstance(f, ast.Attribute)
                    and f.attr == "print"
                    and isinstance(f.value, ast.Name)
                    and f.value.id in (self.self_name, *self.module_names)
                    and self.self_name
                    and self.owner is not None
                    and _defined_by_library(_lookup(type(self.owner), "print", None)[1])
                ):
                    return True  # LightningModule.print: host text
            if isinstance(parent, ast.stmt):
                return False
            parent = parents.get(id(parent))
        return False

    def _handed_on_to(self, node: ast.AST, parents: dict[int, ast.AST]) -> tuple | None:
        """Where `node`, the batch_idx parameter itself, is handed on as a call's argument to code that may
        be read with it: ``("method", name, through super(), position)`` for a method of the class of
        the object read here (``self.helper(x, batch_idx)``, ``super().training_step(batch, batch_idx)``,
        ``self(x, batch_idx)``: its forward), where the caller reads them (:attr:`reads_helpers`);
        ``("held", attributes, position or keyword)`` for what the object's attributes hold
        (``self.criterion(logits, y, batch_idx)``, ``self.model.training_step(batch, batch_idx)``). Else
        None (a position after an unpacked argument, a call of anything else)."""
        if not (isinstance(node, ast.Name) and node.id == self.batch_idx):
            return None
        parent = parents.get(id(node))
        call: Any = parents.get(id(parent)) if isinstance(parent, ast.keyword) else parent
        if not isinstance(call, ast.Call):
            return None
        if isinstance(parent, ast.keyword):
            if parent.arg is None:
                return None
            where: int | str = parent.arg
        else:
            where = next((i for i, a in enumerate(call.args) if a is node), -1)
            if where < 0 or any(isinstance(a, ast.Starred) for a in call.args[:where]):
                return None
        func = call.func
        if _is_super_call(func):
            if self.reads_helpers and isinstance(where, int):
                return ("method", func.attr, True, where)
            return None
        after = self._parent_call(call)
        if after is not None:  # `Base.name(self, batch, batch_idx)`: after self, as a super() call's
            return ("method", func.attr, after, where - 1) if isinstance(where, int) else None
        path: list[str] = []
        while isinstance(func, ast.Attribute):
            path.insert(0, func.attr)
            func = func.value
        if not (isinstance(func, ast.Name) and func.id == self.self_name and self.self_name):
            return None
        if any(name.startswith("__") for name in path):
            return None
        if self.reads_helpers and len(path) <= 1:
            name = path[0] if path else "forward"
            held = getattr(self.owner, "__dict__", None)
            in_instance = bool(path) and isinstance(held, dict) and name in held
            if not in_instance and _lookup(type(self.owner), name, None)[1] is not None:
                # a method of the class (an instance attribute of the name would come first)
                return ("method", name, False, where) if isinstance(where, int) else None
        if self.owner is None:
            return None
        # the module handed on in the same call (`self.loss_fn(self, pred, batch_idx)`), by position or keyword
        module_at: int | str | None = next(
            (i for i, a in enumerate(call.args) if isinstance(a, ast.Name) and a.id in self.module_names),
            None,
        )
        if module_at is None:
            module_at = next(
                (
                    k.arg
                    for k in call.keywords
                    if isinstance(k.value, ast.Name) and k.value.id in self.module_names
                ),
                None,
            )
        return ("held", tuple(path), where, module_at)

    # ------------------------------------------------------------------ helpers
    def _line(self, node: ast.AST) -> str:
        import linecache

        line = self.first_line + node.lineno - 1
        source = linecache.getline(self.filename, line).strip()
        return f"{self.filename}:{line} (`{source}`)" if source else f"{self.filename}:{line}"

    def _inline(self, expr: ast.expr, depth: int = 0, globals_ok: bool = False) -> ast.expr | None:
        """`expr` with single-assignment locals replaced by their values; None if a local is not inlinable.
        With `globals_ok`, names of the function's module globals stay (evaluated against them)."""
        if depth > 4:
            return None

        class Inline(ast.NodeTransformer):
            ok = True

            def visit_Name(inner, node: ast.Name) -> Any:  # noqa: N805
                if (
                    node.id in (self.self_name, self.batch_idx, *self.extra)
                    or node.id in _SAFE_BUILTINS
                    or node.id in ("True", "False", "None")
                ):
                    return node
                if (
                    globals_ok
                    and node.id not in self.assigned
                    and (
                        (self.namespace is not None and node.id in self.namespace)
                        or (self.closure is not None and node.id in self.closure)
                    )
                ):
                    return node
                value = self.assigned.get(node.id)
                if value is None:
                    inner.ok = False
                    return node
                replaced = self._inline(value, depth + 1, globals_ok)
                if replaced is None:
                    inner.ok = False
                    return node
                return replaced

        transformer = Inline()
        try:
            # a copy to transform; parsed back from text, so parts of an expression that cannot
            # stand alone (a slice's `:n`, a starred `*args`, `yield`, `await`) are not evaluable
            parsed = ast.parse(ast.unparse(expr), mode="eval")
        except SyntaxError:
            return None
        result = transformer.visit(ast.fix_missing_locations(parsed).body)
        return result if transformer.ok else None

    def _reads_step_counter(self, expr: ast.AST, followed: set[str] | None = None) -> bool:
        """Whether `expr` reads a step counter, directly or through the locals it reads.

        `followed`: the locals whose values are already being read. A local assigned from itself
        (``x = x.float()``, the one assignment the record keeps) or two that read each other would
        otherwise be followed forever; each value is read once, which finds every counter they reach.
        """
        followed = set() if followed is None else followed
        for node in ast.walk(expr):
            if isinstance(node, ast.Attribute) and node.attr in STEP_COUNTERS:
                return True
            if isinstance(node, ast.Name):
                if node.id == self.batch_idx:
                    return True
                value = self.assigned.get(node.id)
                if value is None or node.id == self.self_name or node.id in followed:
                    continue
                followed.add(node.id)
                if self._reads_step_counter(value, followed):
                    return True
        return False

    def _compile(
        self, expr: ast.expr, allow_methods: bool, globals_ok: bool = False, math_only: bool = False
    ) -> Callable[[Any, int], Any] | None:
        """A function of (self, batch_idx[, the callback hook's trainer and module]) evaluating `expr`,
        or None where `expr` reads anything else or calls anything but the safe builtins (and, with
        `allow_methods`, the safe methods). With `globals_ok`, `expr` may read the function's module
        globals too, looked up at each evaluation; with `math_only`, of those only the standard
        ``math`` module, whose functions it may call (``math.cos(math.pi * self.global_step / T)``)."""
        inlined = self._inline(expr, globals_ok=globals_ok or math_only)
        if inlined is None or not _safe(inlined, allow_methods, math_calls=math_only):
            return None
        if math_only:
            known = {self.self_name, self.batch_idx, *self.extra, *_SAFE_BUILTINS}
            free = {n.id for n in ast.walk(inlined) if isinstance(n, ast.Name)} - known
            if free - {"math"} or (free and (self.namespace or {}).get("math") is not math):
                return None
            if not free:  # no math at all: the plain compilation
                return self._compile(expr, allow_methods)
            globals_ok = True  # `math`, looked up in the function's module globals
        args = [self.self_name, self.batch_idx or "_batch_idx", *self.extra]
        outside = (
            {n.id for n in ast.walk(inlined) if isinstance(n, ast.Name)} - set(args) - _SAFE_BUILTINS
            if globals_ok
            else set()
        )
        # closure variables first, as Python resolves a free name; passed in per evaluation, live
        cells = sorted(outside & self.closure.names) if self.closure is not None else []
        reads_globals = bool(outside - set(cells))
        args += cells
        lam = ast.Expression(
            body=ast.Lambda(
                args=ast.arguments(
                    posonlyargs=[],
                    args=[ast.arg(a) for a in args],
                    kwonlyargs=[],
                    kw_defaults=[],
                    defaults=[],
                ),
                body=inlined,
            )
        )
        try:
            code = compile(ast.fix_missing_locations(lam), "<l2lightning step source>", "eval")
            if reads_globals:
                # the module's own globals dict, so each evaluation reads their values now (_safe
                # admits no call but the safe builtins', whatever the namespace holds)
                evaluate = eval(code, self.namespace)  # noqa: S307 - only reads, see _safe
            else:
                env = {name: getattr(builtins, name) for name in _SAFE_BUILTINS}
                evaluate = eval(code, {"__builtins__": {}, **env})  # noqa: S307 - only reads, see _safe
        except Exception:
            return None
        if cells:
            evaluate = _with_closure(evaluate, self.closure, cells)
        if self.callback is None:
            return evaluate
        cb, extra = self.callback, len(self.extra)

        def for_callback(module: Any, batch_idx: int) -> Any:
            # a callback hook's test: its own self, then the Trainer and the module it was given
            return evaluate(cb, batch_idx, *(module.trainer, module)[:extra])

        return for_callback

    def _condition(self, test: ast.expr) -> None:
        if self._reads_step_counter(test):
            self.found.conditions.append(
                Condition(self._line(test), self._compile(test, allow_methods=False))
            )
            return
        # Any other test that reads only the module's attributes (a flag an epoch-start hook sets:
        # `if self.use_aux_loss:`) can change between steps too; evaluated per step like the above.
        # Tests that cannot be evaluated without running the step (on locals, tensors) are left to
        # the warm-up trace comparison.
        if self._reads_self(test):
            evaluate = self._compile(test, allow_methods=False)
            if evaluate is not None:
                self.found.conditions.append(Condition(self._line(test), evaluate, on_counters=False))

    def _reads_self(self, expr: ast.AST) -> bool:
        """Whether `expr` reads the module (or a callback hook's own names), directly or through the
        locals it reads (``me = self`` ... ``if me.flag:``)."""
        names = (self.self_name, *self.extra)
        inlined = self._inline(expr) if isinstance(expr, ast.expr) else None
        return any(
            isinstance(node, ast.Name) and node.id in names
            for node in ast.walk(expr if inlined is None else inlined)
        )

    def _unaliased(self, chain: ast.expr) -> ast.expr:
        """`chain` read through the local at its base, where that local holds one value assigned once:
        ``cb = self.trainer.callbacks[1]`` then ``cb.w`` reads ``self.trainer.callbacks[1].w``, and
        ``c = CFG`` then ``c.loss.w`` reads ``CFG.loss.w``. Anything else comes back as it is."""
        base, _ = _chain_base(chain)
        if not isinstance(base, ast.Name) or self.assigned.get(base.id) is None:
            return chain
        inlined = self._inline(chain, globals_ok=True)
        return chain if inlined is None else inlined

    def _parent_call(self, call: ast.Call) -> type | None:
        """For ``Base.name(self, ...)`` in a method of the module's own class, where ``Base`` is a class
        of the module's MRO after the one this method belongs to (a subclass calling its parent's
        method the way ``super().name(...)`` does): the class of the MRO the lookup of ``name`` starts
        after (``Base`` is found first). Else None."""
        func = call.func
        if not (
            self.reads_helpers
            and self.defining_class is not None
            and self.owner is not None
            and isinstance(func, ast.Attribute)
            and isinstance(func.value, ast.Name)
            and not func.attr.startswith("__")
            and call.args
            and isinstance(call.args[0], ast.Name)
            and call.args[0].id == self.self_name
        ):
            return None
        name = func.value.id
        if self.closure is not None and name in self.closure:
            klass = self.closure.get(name)
        else:
            klass = (self.namespace or {}).get(name)
        mro = type(self.owner).__mro__
        if not isinstance(klass, type) or klass not in mro or self.defining_class not in mro:
            return None
        at = mro.index(klass)
        if at <= mro.index(self.defining_class):
            return None
        return mro[at - 1]

    def _helper_call(self, node: ast.Call) -> None:
        func = node.func
        helpers = self.helpers
        after = self._parent_call(node)
        if after is not None:
            # `Base.training_step(self, batch, batch_idx)`: Base's method, read as a super() call's is
            # (the position of batch_idx among its parameters after self, as for the others)
            position = next(
                (
                    i - 1
                    for i, arg in enumerate(node.args)
                    if isinstance(arg, ast.Name) and arg.id == self.batch_idx
                ),
                None,
            )
            key = (func.attr, after)
            if self.class_helpers.get(key) is None:
                self.class_helpers[key] = position
            return
        if _is_super_call(func):
            name, helpers = func.attr, self.super_helpers
        elif isinstance(func, ast.Name) and func.id == self.self_name:
            name = "forward"
        elif (
            isinstance(func, ast.Attribute)
            and isinstance(func.value, ast.Name)
            and func.value.id == self.self_name
            and not func.attr.startswith("__")
        ):
            name = func.attr
        else:
            if (
                isinstance(func, ast.Attribute)
                and isinstance(func.value, ast.Name)
                and func.value.id in self.module_names
                and not func.attr.startswith("__")
                and func.attr not in ("log", "log_dict")  # read as logs (_log_call)
            ):
                # `model = self; model.helper()`, `pl_module.helper()` in a callback: the module's method
                self.read_patterns.append((self._line(node), re.compile(re.escape(func.attr)), True))
                if any(isinstance(a, ast.Name) and a.id in self.module_names for a in node.args):
                    self._reads_any(node)  # the module handed on to it again: not followed
            return
        position = next(
            (i for i, arg in enumerate(node.args) if isinstance(arg, ast.Name) and arg.id == self.batch_idx),
            None,
        )
        if helpers.get(name) is None:
            helpers[name] = position
        # the Trainer and the module handed on by position (a callback's `self._clip(trainer, pl_module)`)
        trainer = self.extra[0] if self.extra else None
        args = self.helper_args.setdefault((name, helpers is self.super_helpers), (None, None))
        for i, arg in enumerate(node.args):
            if isinstance(arg, ast.Name) and arg.id == trainer and args[0] is None:
                args = (i, args[1])
            elif isinstance(arg, ast.Name) and arg.id in self.module_names:
                if args[1] is None:
                    args = (args[0], i)
                elif args[1] != i:  # the module at two places: only one is followed
                    self._reads_any(node)
        self.helper_args[(name, helpers is self.super_helpers)] = args
        if any(
            isinstance(k.value, ast.Name) and k.value.id in self.module_names and k.value.id != self.self_name
            for k in node.keywords
        ) or any(isinstance(a, ast.Starred) for a in node.args):
            self._reads_any(node)  # handed on by keyword or unpacked: not followed

    def _output_values(self, func: ast.AST, parents: dict[int, ast.AST]) -> set[int]:
        """Record the numbers ``return {"loss": loss, "step": self.global_step}`` returns beside the
        loss that the module alone evaluates from the step counters, and return the ids of their
        nodes: they reach the step's output, never the graph, so instead of capturing again when they
        change they are evaluated anew for each replay's outputs. Only one return statement at the
        top of the function, holding a dict with constant string keys, is read this way."""
        returns = [node for node in ast.walk(func) if isinstance(node, ast.Return)]
        if len(returns) != 1 or parents.get(id(returns[0])) is not func:
            return set()
        value = returns[0].value
        if not isinstance(value, ast.Dict) or not all(
            isinstance(k, ast.Constant) and isinstance(k.value, str) for k in value.keys
        ):
            return set()
        ids: set[int] = set()
        for key, entry in zip(value.keys, value.values):
            if key.value == "loss" or not self._reads_step_counter(entry):
                continue
            evaluate = self._compile(entry, allow_methods=False)
            if evaluate is None:
                continue  # it needs the step's own values (a tensor): baked in, compared as before
            self.found.output_values[key.value] = (self._line(entry), evaluate)
            ids |= {id(inner) for inner in ast.walk(entry)}
        return ids

    def _log_call(self, node: ast.Call) -> None:
        """Record what ``self.log(key, value)`` and ``self.log_dict({...})`` log (through any name bound to
        the module, a callback hook's ``pl_module`` too): per key, an expression a replay evaluates again
        (:attr:`StepSource.log_values`), a number the same for every replay of one graph
        (:attr:`StepSource.log_constants`) or one it cannot compute (:attr:`StepSource.log_opaque`); calls
        whose keys the source does not show go to :attr:`StepSource.log_unknown`."""
        func = node.func
        if not (
            isinstance(func, ast.Attribute)
            and func.attr in ("log", "log_dict")
            and isinstance(func.value, ast.Name)
            and (
                func.value.id in self.module_names
                or (func.value.id == self.self_name and self.callback is None and not self.module_names)
            )
        ):
            return
        keywords = {k.arg: k.value for k in node.keywords if k.arg is not None}
        if func.attr == "log":
            key = node.args[0] if node.args else keywords.get("name")
            value = node.args[1] if len(node.args) >= 2 else keywords.get("value")
            entries = [(key, value)] if key is not None and value is not None else None
        else:
            entries = self._logged_entries(node.args[0] if node.args else keywords.get("dictionary"))
        if entries is None:
            self.found.log_unknown.append(self._line(node))
            return
        for key, value in entries:
            if not (isinstance(key, ast.Constant) and isinstance(key.value, str)):
                self.found.log_unknown.append(self._line(node))
                # a key built from the module's values (`f"train/{self.stage}_loss"`): a replay re-issues
                # the capture's key, so the key's value is compared before each replay like a value the
                # step reads, and a new one captures the step again
                evaluate = self._compile(key, allow_methods=True, globals_ok=True)
                if evaluate is not None and self._reads_self(key):
                    self.found.attribute_values.append(
                        AttributeValue(f"the logged key at {self._line(node)}", evaluate)
                    )
                continue
            # log_dict's entry by its own line (a dict literal spans lines); self.log's by the call's
            line = self._line(node if func.attr == "log" else value)
            evaluate = self._compile(value, allow_methods=True, globals_ok=True)
            if evaluate is not None:
                self.found.log_values.setdefault(key.value, (line, evaluate))
            elif self._fixed_per_graph(value, set()):
                self.found.log_constants.add(key.value)
            else:
                self.found.log_opaque.setdefault(key.value, line)

    def _logged_entries(self, mapping: ast.expr | None) -> list[tuple[ast.expr, ast.expr]] | None:
        """(key, value) of a dict ``self.log_dict`` is given as a literal (``{"phase": self.phase}``,
        ``dict(phase=self.phase)``), directly or through a local assigned once; None for any other."""
        for _ in range(5):
            if isinstance(mapping, ast.Name) and self.assigned.get(mapping.id) is not None:
                mapping = self.assigned[mapping.id]
        if isinstance(mapping, ast.Dict) and all(k is not None for k in mapping.keys):
            return list(zip(mapping.keys, mapping.values))
        if (
            isinstance(mapping, ast.Call)
            and isinstance(mapping.func, ast.Name)
            and mapping.func.id == "dict"
            and "dict" not in self.assigned
            and not mapping.args
            and all(k.arg is not None for k in mapping.keywords)
        ):
            return [(ast.Constant(k.arg), k.value) for k in mapping.keywords]
        return None

    def _fixed_per_graph(self, expr: ast.expr, followed: set[str]) -> bool:
        """Whether `expr` is a number that no replay of one graph can see change: literals, and the
        shapes of the step's own tensors and lengths of its batch (``x.shape[0]``, ``len(batch)``; a
        graph replays one batch layout), with arithmetic and ``int``/``float``/``round``/``min``/``max``."""
        if isinstance(expr, ast.Constant):
            return isinstance(expr.value, (int, float)) or expr.value is None
        if isinstance(expr, ast.BinOp):
            return self._fixed_per_graph(expr.left, followed) and self._fixed_per_graph(expr.right, followed)
        if isinstance(expr, ast.UnaryOp):
            return self._fixed_per_graph(expr.operand, followed)
        if isinstance(expr, ast.Name):
            value = self.assigned.get(expr.id)
            if value is None or expr.id in followed:
                return False
            return self._fixed_per_graph(value, followed | {expr.id})
        if isinstance(expr, ast.Subscript) and isinstance(expr.slice, ast.Constant):
            shape = expr.value
            return (
                isinstance(shape, ast.Attribute) and shape.attr == "shape" and self._step_local(shape.value)
            )
        if isinstance(expr, ast.Attribute) and expr.attr == "ndim":
            return self._step_local(expr.value)
        if isinstance(expr, ast.Call) and not expr.keywords:
            f = expr.func
            if isinstance(f, ast.Attribute) and f.attr in ("size", "numel", "dim"):
                return self._step_local(f.value) and all(isinstance(a, ast.Constant) for a in expr.args)
            if isinstance(f, ast.Name) and f.id not in self.assigned:
                if f.id == "len" and len(expr.args) == 1:
                    return self._step_local(expr.args[0])
                if f.id in ("int", "float", "round", "min", "max", "abs"):
                    return all(self._fixed_per_graph(a, followed) for a in expr.args)
        return False

    def _step_local(self, expr: ast.expr) -> bool:
        """Whether `expr` is a parameter or local of the step (or a constant subscript of one): not the
        module's, not a module-level name (``batch``, ``x``, ``batch[0]``)."""
        while isinstance(expr, ast.Subscript) and isinstance(expr.slice, ast.Constant):
            expr = expr.value
        return (
            isinstance(expr, ast.Name)
            and expr.id not in self.module_names
            and expr.id not in (self.self_name, *self.extra)
            and expr.id not in self.global_names
        )


def _cannot_evaluate(module: Any, batch_idx: int) -> Any:
    """The reader of a number computed from the step counters that cannot be evaluated before a replay:
    it raises, so the value is :data:`~l2lightning.guards.step_values.unreadable`, never equal to a captured one."""
    raise LookupError("read through what cannot be evaluated before a replay")


def _record_outside_reads(
    found: StepSource, function: Any, visitor: _Visitor, depth: int, seen: set[int]
) -> None:
    """What `function` (its source read by `visitor`) reads from outside itself: module-level names,
    imported modules' attributes and closure variables; then the user's functions it calls. What it
    reads of the module through another name: the functions it hands the module to (read as the
    module's code) and the attributes it reads by names the source does not spell out
    (:attr:`StepSource.read_patterns`)."""
    for line, pattern, called in visitor.read_patterns:
        found.add_read_pattern(line, pattern, called)
    for target, where, line in visitor.module_arguments:
        _read_given_module(found, target, where, line, depth + 1, seen)
    namespace = getattr(function, "__globals__", None)
    if not isinstance(namespace, dict):
        return
    _record_globals(found, namespace, visitor.global_names, visitor.module_attributes, visitor)
    _record_closure(found, function, visitor.global_names)
    _record_global_chains(found, function, namespace, visitor.global_chains)
    _follow_functions(found, namespace, visitor.called_names, depth + 1, seen)


# Builtins that read nothing of an object handed to them but its identity, type or text (or set it)
_HARMLESS_BUILTINS = (
    isinstance, issubclass, id, type, print, repr, str, hash, callable, dir, super, format, bool, setattr, delattr,
)  # fmt: skip
# Attributes that reach every other: read through them, anything may be read
_OPAQUE_DUNDERS = frozenset({"__dict__", "__getattribute__", "__getattr__"})


def _unwrapped(held: Any) -> Any:
    """`held` unwrapped of its decorators' ``__wrapped__`` if it is callable (else None)."""
    try:
        return inspect.unwrap(held) if callable(held) else None
    except ValueError:  # a cycle of __wrapped__
        return None


def _called_object(held: Any) -> Any:
    """`held`, or for an object of the user's class called (``LOSS(self, pred, y)``) its class's
    ``__call__`` bound to it."""
    if held is not _MISSING and not isinstance(held, (type, types.FunctionType, types.MethodType)):
        call = inspect.getattr_static(type(held), "__call__", None)
        if isinstance(call, types.FunctionType) and _is_users(held):
            return types.MethodType(call, held)
    return held


def _static_method(obj: Any, path: list[str]) -> Any:
    """What ``obj.<path>`` is, found in instance dicts (a torch module's submodules too) and in classes,
    never by running a property or ``__getattr__``; a function found on the last object's class comes
    bound to it. :data:`_MISSING` where the chain cannot be followed so."""
    held = obj
    for i, name in enumerate(path):
        attributes = getattr(held, "__dict__", None)
        attributes = attributes if isinstance(attributes, dict) else {}
        modules = attributes.get("_modules")
        if name in attributes:
            held = attributes[name]
        elif isinstance(modules, dict) and name in modules:
            held = modules[name]
        else:
            found = inspect.getattr_static(type(held), name, _MISSING)
            if isinstance(found, types.FunctionType) and i == len(path) - 1:
                return types.MethodType(found, held)
            if found is _MISSING or hasattr(found, "__get__"):  # a property, a descriptor: not run
                return _MISSING
            held = found
    return held


def _is_users(obj: Any) -> bool:
    """Whether `obj` (a function, a class, or an object of a class) is the user's own code's."""
    if isinstance(obj, (types.FunctionType, type, types.ModuleType)):
        return _is_user_code(obj)
    if isinstance(obj, types.MethodType):
        return _is_user_code(obj.__func__)
    if isinstance(obj, types.BuiltinFunctionType):
        return False
    return _users_class(type(obj))


# Any attribute name: what code reads of the module where the analysis cannot tell (``vars(self)``,
# ``getattr(self, name)``, ``self`` handed to code it cannot read)
_ANY_NAME = re.compile(".*", re.DOTALL)


def _name_pattern(expr: ast.expr | None) -> re.Pattern[str]:
    """The attribute names a computed name can take: an f-string's constant parts, anything between
    them (``f"_{kind}_loss"``: ``_.*_loss``); any name for another expression."""
    if isinstance(expr, ast.Constant) and isinstance(expr.value, str):
        return re.compile(re.escape(expr.value))
    if isinstance(expr, ast.JoinedStr):
        parts = [
            re.escape(v.value) if isinstance(v, ast.Constant) and isinstance(v.value, str) else ".*"
            for v in expr.values
        ]
        return re.compile("".join(parts), re.DOTALL)
    return _ANY_NAME


def _read_given_module(
    found: StepSource, function: Any, where: int | str, line: str, depth: int, seen: set[int]
) -> None:
    """Read `function`, handed the module as its argument `where` (a position, or a keyword's name), as
    the module's code: its reads of that parameter are the module's. A function whose parameter cannot
    be told (``*args``, ``**kwargs``) reads any of the module's attributes."""
    code = function.__code__
    positional = code.co_varnames[: code.co_argcount]
    keywords = code.co_varnames[code.co_posonlyargcount : code.co_argcount + code.co_kwonlyargcount]
    if isinstance(where, int):
        param = positional[where] if where < len(positional) else None
    else:
        param = where if where in keywords else None
    if param is None:
        found.add_read_pattern(line, _ANY_NAME, False)
        return
    read_with_module(found, function, param, line, depth, seen)


def read_with_module(
    found: StepSource,
    function: types.FunctionType,
    name: str,
    line: str,
    depth: int,
    seen: set[int],
    batch_idx: str | None = None,
) -> bool:
    """Read `function`, in which `name` (a parameter, or a closure variable) is the module, as the
    module's code: the attributes it reads through `name` join `found.reads` (compared before each
    replay); its conditions, values read through `name` and logged expressions join `found` like the
    step's own (evaluated with the module); the module's methods it calls through `name` are marked
    for reading (:attr:`StepSource.read_patterns`). Each (function, name) is read once per `found`.
    Code that cannot be read (no source), or that lies deeper than ``HELPER_DEPTH``, reads any of the
    module's attributes, for all the analysis can tell (`line` says where it was given the module).
    `batch_idx`: its parameter handed the step's batch_idx, if one is. True where this call read it."""
    function = _unwrapped(function)
    if not isinstance(function, types.FunctionType):
        found.add_read_pattern(line, _ANY_NAME, False)
        return False
    key = (id(function.__code__), name)
    if key in found.module_functions_read:
        return False
    found.module_functions_read.add(key)
    seen.add(id(function.__code__))  # not read again as a plain function (_follow_functions)
    tree, filename, first_line, _ = _parse_function(function)
    if tree is None or depth > HELPER_DEPTH or not _is_user_code(function):
        found.add_read_pattern(line, _ANY_NAME, False)
        return False
    visitor = _Visitor(
        found,
        filename,
        first_line,
        name,
        batch_idx,
        (),
        found.reads,
        namespace=function.__globals__,
        closure=ClosureCells(function) if function.__closure__ else None,
        module_names=(name,),
        module_reads=found.reads,
    )
    visitor.run(tree)
    _record_outside_reads(found, function, visitor, depth, seen)
    # the module's methods it calls through `name`: read as the module's (by the module's analysis,
    # and at each capture by l2lightning.guards.called_code)
    for helper in sorted({*visitor.helpers, *visitor.super_helpers}):
        found.add_read_pattern(f"{line}: `{name}.{helper}(...)`", re.compile(re.escape(helper)), True)
    # (batch_idx handed on from here is compared: no record is kept of the code it reaches)
    found.counter_values += [c for counters in visitor.withheld.values() for c in counters]
    found.counter_values += [c for counters in visitor.handed_on.values() for c in counters]
    return True


# How many calls deep batch_idx is followed through the code the module holds (a submodule's forward
# handing it to a layer's, and on): deeper, it is compared before each replay
HANDED_ON_DEPTH = 2 * HELPER_DEPTH


def read_handed_on(found: StepSource, module: Any, final: bool) -> None:
    """Read the code that :attr:`StepSource.handed_on` calls hand batch_idx to, with the parameter it
    arrives in bound to batch_idx: its tests on it (``if batch_idx % 10 == 9:`` in a loss module's
    forward) join the branch key, evaluated per step on the object that code's ``self`` is, and the
    numbers it computes from it the comparisons; its tests that cannot be evaluated are refused like the
    step's own. What a call hands batch_idx to is looked up now, without running any of the user's code
    (:func:`_static_method`): a submodule (its ``forward``; not where a forward pre-hook may change
    its arguments), a method of one, a function, a bound method or a callable object of the user's
    class kept in an attribute. Where that is none of these, or its parameter cannot be told (``*args``,
    a ``functools.partial``), or the code cannot be read, the batch_idx argument is compared before
    each replay (a new value captures the step again) once `final` (at the training start and each
    capture: earlier, ``configure_model`` may not have built it yet). Called again at each capture, it
    reads each function once per object, and code bound anew since (a loss module replaced) too."""
    index = 0
    while index < len(found.handed_on):
        call = found.handed_on[index]
        index += 1
        target = _handed_to(call) if call.depth <= HANDED_ON_DEPTH else None
        if target is not None and _read_callee(found, module, call, *target):
            continue
        if final and not call.compared:
            call.compared = True
            found.counter_values += call.counters


def _handed_to(call: HandedOn) -> tuple[Any, types.FunctionType, str, str | None] | None:
    """(the object its ``self`` is, or None; the function; its parameter batch_idx arrives in; the one
    the module arrives in, if it is handed on too) of what `call` calls, or None where that cannot be
    told."""
    held = _static_method(call.holder, list(call.path)) if call.path else call.holder
    if held is _MISSING:
        return None
    if isinstance(held, torch.nn.Module):
        hooks = torch.nn.modules.module._global_forward_pre_hooks
        if getattr(held, "_forward_pre_hooks", None) or hooks:
            return None  # a forward pre-hook may hand forward other arguments
        forward = _lookup(type(held), "forward", None)[1]
        held = types.MethodType(forward, held) if isinstance(forward, types.FunctionType) else None
    else:
        held = _called_object(held)
    if isinstance(held, types.MethodType):
        owner, function, skip = held.__self__, held.__func__, 1
    elif isinstance(held, types.FunctionType):
        owner, function, skip = None, held, 0
    else:
        return None  # a partial, a class, a library's callable object
    if function is not _unwrapped(function) or not _is_user_code(function):
        return None  # a decorator's wrapper may hand on other arguments; a library's code is not read
    code = function.__code__
    names = code.co_varnames[code.co_posonlyargcount : code.co_argcount + code.co_kwonlyargcount]

    def parameter(where: int | str) -> str | None:
        if isinstance(where, int):
            # (past the positional parameters: into *args)
            return code.co_varnames[where + skip] if where + skip < code.co_argcount else None
        return where if where in names else None

    param = parameter(call.where)
    if param is None:
        return None
    return owner, function, param, parameter(call.module_at) if call.module_at is not None else None


def _read_callee(
    found: StepSource,
    module: Any,
    call: HandedOn,
    owner: Any,
    function: types.FunctionType,
    param: str,
    module_param: str | None,
) -> bool:
    """Read `function` (``self`` bound to `owner`, or a plain function where `owner` is None), handed
    batch_idx as its parameter `param`, as the step's code (see :func:`read_handed_on`); False where
    its source cannot be read. What it reads of the module, given as `module_param` or held in its
    closure, is the module's (as :func:`read_with_module` reads it): for a plain function, its tests
    on the module are evaluated with it."""
    key = (id(owner), id(function.__code__), param)
    if key in found.callees_read:
        return True
    tree, filename, first_line, params = _parse_function(function)
    if tree is None:
        return False
    found.callees_read[key] = (owner, function)
    alias = module_param or (_closure_name_of(function, module) if owner is None else None)
    if owner is not None:
        self_name = params[0] if params else ""
        module_names = tuple(n for n in (self_name if owner is module else None, module_param) if n)
    else:  # a plain function: the module, where it has it, is what its tests are evaluated with
        self_name = alias or ""
        module_names = (alias,) if alias else ()
    scratch = StepSource()  # its logs and reads of the Trainer are not the module's
    reads: set[str] = set()
    visitor = _Visitor(
        scratch,
        filename,
        first_line,
        self_name,
        param,
        (),
        reads,
        namespace=function.__globals__,
        closure=ClosureCells(function) if function.__closure__ else None,
        module_names=module_names,
        module_reads=found.reads if module_names else None,
        owner=owner if owner is not None else (module if alias else None),
    )
    visitor.run(tree)
    where = f"`{function.__qualname__}`, handed batch_idx"
    add_conditions(found, scratch.conditions, owner, where)
    add_counter_values(found, scratch.counter_values, owner)
    if owner is not None or alias:  # (read through self, or through the module a plain function has)
        found.attribute_values += [
            AttributeValue(a.line, evaluated_on(owner, a.evaluate)) for a in scratch.attribute_values
        ]
    found.global_writes += [w for w in scratch.global_writes if w not in found.global_writes]
    found.iterator_advances += [w for w in scratch.iterator_advances if w not in found.iterator_advances]
    # batch_idx handed on again (`self.inner(x, batch_idx)`, `self.helper(batch_idx)`): read the same way
    found.handed_on += [
        HandedOn(visitor.owner, path, at, module_at, counters, call.depth + 1)
        for (path, at, module_at), counters in visitor.handed_on.items()
    ]
    found.counter_values += [c for counters in visitor.withheld.values() for c in counters]  # (none here)
    add_self_reads(found, module, owner, reads)
    _record_outside_reads(found, function, visitor, min(call.depth, HELPER_DEPTH), set())
    if alias and owner is None:
        # the module's methods it calls through the module (without batch_idx): read as the module's,
        # as read_with_module marks them
        found.module_functions_read.add((id(function.__code__), alias))
        for helper in sorted({*visitor.helpers, *visitor.super_helpers}):
            found.add_read_pattern(
                f"`{function.__qualname__}`: `{alias}.{helper}(...)`", re.compile(re.escape(helper)), True
            )
    return True


def add_conditions(found: StepSource, conditions: list[Condition], owner: Any, where: str) -> None:
    """Add to `found` the branch tests of code known to run in the step whose ``self`` is `owner` (None:
    a plain function): those that can be evaluated, on `owner`, in the branch key; those on the step
    counters that cannot be, named (with `where`, the code they are in) among the opaque conditions,
    which the callback refuses like training_step's own. Each (line, owner) once."""
    known = {(c.line, getattr(c.evaluate, "owner_id", None)) for c in found.conditions}
    for c in conditions:
        if c.evaluate is not None:
            key = (c.line, id(owner) if owner is not None else None)
            if key not in known:
                found.conditions.append(Condition(c.line, evaluated_on(owner, c.evaluate), c.on_counters))
                known.add(key)
        elif c.on_counters:
            line = f"{c.line} in {where}"
            if (line, None) not in known:
                found.conditions.append(Condition(line, None))
                known.add((line, None))


def add_counter_values(found: StepSource, values: list[CounterValue], owner: Any) -> None:
    """Add to `found` the numbers computed from the step counters in code known to run in the step whose
    ``self`` is `owner` (None: a plain function), evaluated on `owner`; each (line, owner) once."""
    known = {(c.line, getattr(c.evaluate, "owner_id", None)) for c in found.counter_values}
    for c in values:
        key = (c.line, id(owner) if owner is not None else None)
        if key not in known:
            # (a layer's attribute of a counter's name may hold anything: a tensor is compared by identity)
            counter = _frozen_reader(evaluated_on(owner, c.counter))
            found.counter_values.append(CounterValue(c.line, evaluated_on(owner, c.evaluate), counter))
            known.add(key)


def _frozen_reader(read: Callable[[Any, int], Any]) -> Callable[[Any, int], Any]:
    """`read`, its value :func:`~l2lightning.guards.step_values.frozen` (tensors by identity) where it is not a
    plain Python value: comparable with ``!=`` whatever it is."""

    def value(module: Any, batch_idx: int) -> Any:
        held = read(module, batch_idx)
        return held if isinstance(held, (int, float, bool, str, type(None))) else frozen(held, tensors=True)

    return value


def evaluated_on(owner: Any, evaluate: Callable[[Any, int], Any]) -> Callable[[Any, int], Any]:
    """`evaluate` (compiled with ``self`` its first argument) evaluated with `owner` as ``self``; as it
    is where `owner` is None (a plain function's, whose first argument nothing reads)."""
    if owner is None:
        return evaluate

    def value(module: Any, batch_idx: int) -> Any:
        return evaluate(owner, batch_idx)

    value.owner_id = id(owner)  # type: ignore[attr-defined]
    return value


def add_self_reads(found: StepSource, module: Any, owner: Any, reads: set[str]) -> None:
    """Where the ``self.X`` reads of code whose ``self`` is `owner` are compared: the module's own
    (a hook or a callable that is the module's method), a plain object's like a callback's (a hook
    object, a loss object); a submodule's public numbers are compared anyway."""
    if owner is module:
        found.reads |= reads
        found.other_reads |= reads  # read without its source's positions: not known to be in a site
    elif owner is not None and not isinstance(owner, torch.nn.Module) and reads:
        add_object_reads(found, owner, reads)


def add_object_reads(found: StepSource, obj: Any, reads: set[str]) -> None:
    """Compare `obj`'s attributes `reads` before each replay, like a callback's (one entry per object)."""
    for held, names in found.callback_reads:
        if held is obj:
            names |= reads
            return
    found.callback_reads.append((obj, set(reads)))


def _parse_function(function: Any) -> tuple[Any, str, int, list[str]]:
    """:func:`_parse`, and for a lambda (whose source line is no function definition) the lambda
    expression on its line, where one alone there takes its parameters."""
    parsed = _parse(function)
    code = getattr(function, "__code__", None)
    if parsed[0] is not None or getattr(function, "__name__", None) != "<lambda>" or code is None:
        return parsed
    try:
        lines, first_line = inspect.getsourcelines(function)
        filename = inspect.getsourcefile(function) or "<unknown>"
    except (OSError, TypeError):
        return None, "", 0, []
    text = textwrap.dedent("".join(lines))
    tree = None
    # the line alone, then without what ends it inside a larger expression, then bracketed (the first
    # line of a call's argument that goes on below)
    for candidate, shift in ((text, 0), (text.rstrip().rstrip(",;"), 0), (f"(\n{text}\n)", 1)):
        try:
            tree = ast.parse(candidate)
        except SyntaxError:
            continue
        if shift:
            ast.increment_lineno(tree, -shift)
        break
    if tree is None:
        return None, "", 0, []
    params = list(code.co_varnames[: code.co_argcount + code.co_kwonlyargcount])
    lambdas = [
        node
        for node in ast.walk(tree)
        if isinstance(node, ast.Lambda)
        and [a.arg for a in node.args.posonlyargs + node.args.args + node.args.kwonlyargs] == params
        and node.lineno == code.co_firstlineno - first_line + 1
    ]
    if len(lambdas) != 1:
        return None, "", 0, []
    return lambdas[0], filename, first_line, params


def read_bytecode(found: StepSource, function: types.FunctionType) -> None:
    """What `function`, whose source cannot be read (a lambda sharing its line with another of the same
    parameters), reads from outside itself, from its bytecode (and the code nested in it): every name it
    loads that its globals or closure hold, and the attribute chains it loads from them (``CFG.weight``,
    ``state.std`` of a closure variable), compared before each replay like the chains read in source
    (:func:`_record_global_chains`)."""
    names: set[str] = set()
    chains: dict[tuple[str, str], tuple[str, Callable[[Any], Any]]] = {}
    pending = [function.__code__]
    while pending:
        code = pending.pop()
        names.update(code.co_names, code.co_freevars)
        pending += [c for c in code.co_consts if isinstance(c, types.CodeType)]
        for root, attributes, line in _bytecode_chains(code):
            where = linecache.getline(code.co_filename, line).strip() if line else ""
            text = f"{code.co_filename}:{line} (`{where}`)" if where else f"{code.co_filename}:{line}"
            key = (root, ".".join(attributes))
            chains.setdefault(key, (text, _attribute_reader(attributes)))
    namespace = getattr(function, "__globals__", {})
    _record_globals(found, namespace, {n for n in names if n in namespace}, set())
    _record_closure(found, function, names)
    _record_global_chains(
        found,
        function,
        namespace,
        [
            (root, line, False, read)
            for (root, _), (line, read) in sorted(chains.items(), key=lambda kv: kv[0])
        ],
    )


def _bytecode_chains(code: types.CodeType) -> list[tuple[str, tuple[str, ...], int | None]]:
    """(root name, attributes, line) of each chain of attribute loads from a global or closure name in
    `code`'s own instructions; a method called at the end of a chain is not part of it."""
    found = []
    instructions = list(dis.get_instructions(code))
    line = None
    for i, ins in enumerate(instructions):
        if ins.starts_line is not None and not isinstance(ins.starts_line, bool):
            line = ins.starts_line
        elif getattr(ins, "line_number", None) is not None:
            line = ins.line_number
        if ins.opname not in ("LOAD_GLOBAL", "LOAD_DEREF", "LOAD_NAME", "LOAD_CLASSDEREF"):
            continue
        attributes: list[str] = []
        for nxt in instructions[i + 1 :]:
            if nxt.opname != "LOAD_ATTR" or "NULL|self" in (nxt.argrepr or ""):
                break  # a method loaded to be called (LOAD_METHOD, or 3.12's LOAD_ATTR that pushes self)
            attributes.append(nxt.argval)
        if attributes and not any(a.startswith("__") for a in attributes):
            found.append((ins.argval, tuple(attributes), line))
    return found


def _attribute_reader(attributes: tuple[str, ...]) -> Callable[[Any], Any]:
    """A function of an object reading the attribute chain `attributes` from it."""

    def read(obj: Any) -> Any:
        for name in attributes:
            obj = getattr(obj, name)
        return obj

    return read


def _record_globals(
    found: StepSource,
    namespace: dict,
    names: set[str],
    module_attributes: set[tuple[str, str]],
    visitor: _Visitor | None = None,
) -> None:
    """Add to `found` the module-level names a function with globals `namespace` reads, and the
    attributes it reads of imported modules (``cfg.LOSS_W``: the name ``LOSS_W`` of ``cfg``); with
    the `visitor` that read its source, whether each is read only inside operand sites."""
    if names:
        found.global_reads.setdefault(id(namespace), (namespace, set()))[1].update(names)
    for name in names:
        key = (id(namespace), name)
        if visitor is not None and name in visitor.global_sites and name not in visitor.global_other:
            found.site_globals.setdefault(key, set()).update(visitor.global_sites[name])
        else:
            found.other_globals.add(key)
    for root, attr in module_attributes:
        held = namespace.get(root)
        if _attributes_recorded(held):
            attributes = vars(held)
            found.global_reads.setdefault(id(attributes), (attributes, set()))[1].add(attr)


def _attributes_recorded(held: Any) -> bool:
    """Whether :func:`_record_globals` compares the attributes the step reads of module-level `held`
    by name: an imported module of the user's (``cfg.LOSS_W``), or an object of one of the user's
    classes (``CONFIG.weight``, a config instance a callback updates; a module's, a function's or a
    class's type is not the user's code)."""
    user_module = isinstance(held, types.ModuleType) and _is_user_code(held)
    user_object = _is_user_code(type(held)) and isinstance(getattr(held, "__dict__", None), dict)
    return user_module or user_object


def _chain_reader(expr: ast.expr, root: str) -> Callable[[Any], Any] | None:
    """A function of the root object that reads the attribute and constant-subscript chain `expr`."""
    lam = ast.Expression(
        body=ast.Lambda(
            args=ast.arguments(
                posonlyargs=[], args=[ast.arg(root)], kwonlyargs=[], kw_defaults=[], defaults=[]
            ),
            body=expr,
        )
    )
    try:
        code = compile(ast.fix_missing_locations(lam), "<l2lightning step source>", "eval")
        return eval(code, {"__builtins__": {}})  # noqa: S307 - attribute and constant-subscript reads only
    except Exception:
        return None


# Objects whose public attributes are plain values (no properties): a config held at module level
_ATTRIBUTE_BAGS = (types.SimpleNamespace, argparse.Namespace)


def _called_state(read: Callable[[Any], Any]) -> Callable[[Any], Any]:
    """`read` (a chain's reader) giving what a call of the chain's value depends on: a function or
    method itself (compared by identity), an instance of the user's class as its identity and public
    numbers (``FocalLoss.gamma``, which a callback anneals in place), anything else None (not compared:
    modules and library code have checks of their own)."""

    def state(root: Any) -> Any:
        held = read(root)
        if isinstance(held, (types.FunctionType, types.MethodType)):
            return held if _is_user_code(getattr(held, "__func__", held)) else None
        if isinstance(held, (type, types.ModuleType, torch.nn.Module)) or not _is_user_code(type(held)):
            return None
        numbers = {
            name: value
            for name, value in getattr(held, "__dict__", {}).items()
            if not name.startswith("_") and isinstance(value, BAKED_VALUES)
        }
        return (Identity(held), numbers)

    return state


def _chain_root_followed(held: Any) -> bool:
    """Whether the chains the step reads from module-level object `held` are compared before each replay:
    the user's modules, classes and objects, attribute bags (an ``argparse`` or ``SimpleNamespace``
    config), OmegaConf configs and plain containers; not a library's modules or objects (``torch.float16``,
    ``np.pi``), which a step does not change."""
    if isinstance(held, types.ModuleType):
        # (`os.environ["AUX_W"]`, `os.environ.get(...)`: the process's environment, which a hook may set)
        return _is_user_code(held) or held is os
    if isinstance(held, types.FunctionType):
        return _is_user_code(held)  # a function attribute used as a knob (`weighted_ce.w`)
    if isinstance(held, (dict, list, tuple, *_ATTRIBUTE_BAGS)):
        return True
    if type(held).__module__.partition(".")[0] == "omegaconf":
        return True
    return _is_user_code(held if isinstance(held, type) else type(held))


def _record_global_chains(
    found: StepSource,
    function: Any,
    namespace: dict,
    chains: list[tuple[str, str, bool, Callable[[Any], Any]]],
) -> None:
    """Add to `found` as :class:`AttributeValue` the chains (:meth:`_Visitor._global_chains`) whose root,
    a closure variable of `function` or a name in its globals `namespace`, may be followed. The root is
    looked up at every comparison (a config bound anew is read anew). A one-attribute chain on the user's
    module or object (``cfg.LOSS_W``) is compared through :func:`_record_globals` already."""
    closure = ClosureCells(function) if getattr(function, "__closure__", None) else None
    free = set(function.__code__.co_freevars) if hasattr(function, "__code__") else set()
    # the code read again (at each capture, or by two readers) adds each of its chains once: by (line,
    # root, where the root is held, which of that line's chains from the root it is)
    known = {getattr(a.evaluate, "chain_key", None) for a in found.attribute_values}
    counts: dict[tuple[str, str], int] = {}
    for root, line, one_attribute, read in chains:
        holder = closure if closure is not None and root in free else namespace
        held = holder.get(root, _MISSING)
        if held is _MISSING or not _chain_root_followed(held):
            continue
        if one_attribute and holder is namespace and _attributes_recorded(held):
            continue
        nth = counts[(line, root)] = counts.get((line, root), 0) + 1
        # (the function itself, not its id: a hook made anew at the same line must not pass for it)
        key = (line, root, function if holder is closure else id(namespace), nth)
        if key in known:
            continue
        known.add(key)
        evaluate = _reading_root(holder, root, read)
        evaluate.chain_key = key  # type: ignore[attr-defined]
        found.attribute_values.append(AttributeValue(line, evaluate))


def _reading_root(holder: Any, root: str, read: Callable[[Any], Any]) -> Callable[[Any, int], Any]:
    """An :class:`AttributeValue` reader: `read` applied to what `holder` binds to `root` now."""

    def evaluate(module: Any, batch_idx: int) -> Any:
        return read(holder[root])

    return evaluate


def _with_closure(evaluate: Callable[..., Any], closure: Any, names: list[str]) -> Callable[..., Any]:
    """`evaluate` given the current values of the closure variables `names` after its own arguments."""

    def value(*args: Any) -> Any:
        return evaluate(*args, *(closure[name] for name in names))

    return value


class ClosureCells:
    """A function's closure variables by name, read like a namespace dict (``get``, ``in``, ``[]``): what
    the per-replay comparisons of module-level values read, for a module made in a factory function
    (``def make(weight): class M(LightningModule): ... loss * weight``)."""

    def __init__(self, function: types.FunctionType) -> None:
        self._cells = dict(zip(function.__code__.co_freevars, function.__closure__ or ()))

    @property
    def names(self) -> frozenset[str]:
        """The function's closure variables' names."""
        return frozenset(self._cells)

    def get(self, name: str, default: Any = None) -> Any:
        try:
            return self._cells[name].cell_contents
        except (KeyError, ValueError):  # not a closure variable, or one not bound yet
            return default

    def __contains__(self, name: str) -> bool:
        return self.get(name, _MISSING) is not _MISSING

    def __getitem__(self, name: str) -> Any:
        value = self.get(name, _MISSING)
        if value is _MISSING:
            raise KeyError(name)
        return value


_MISSING = object()


def _record_closure(found: StepSource, function: Any, names: set[str]) -> None:
    """Add to `found` the closure variables among the names `function` reads from outside itself."""
    free = set(getattr(getattr(function, "__code__", None), "co_freevars", ())) & names
    if free and getattr(function, "__closure__", None):
        key = ("closure", id(function))
        found.global_reads.setdefault(key, (ClosureCells(function), set()))[1].update(free)


def _follow_functions(
    found: StepSource, namespace: dict, called: set[tuple[str, ...]], depth: int, seen: set[int]
) -> None:
    """Read the plain functions of the user's own code that a step function calls by name
    (``scale(loss)``, ``losses.focal(x)``) for the module-level names they read and assign, and the
    functions they call in turn, down to ``HELPER_DEPTH``."""
    if depth > HELPER_DEPTH:
        return
    for path in sorted(called):
        target = namespace.get(path[0])
        if len(path) == 2:
            target = getattr(target, path[1], None) if isinstance(target, types.ModuleType) else None
        target = inspect.unwrap(target) if callable(target) else None
        if not isinstance(target, types.FunctionType) or id(target.__code__) in seen:
            continue
        seen.add(id(target.__code__))
        if not _is_user_code(target):
            continue
        tree, filename, first_line, _ = _parse_function(target)  # a module-level lambda too
        if tree is None:
            read_bytecode(found, target)
            continue
        visitor = _Visitor(
            found,
            filename,
            first_line,
            "",
            None,
            (),
            set(),
            namespace=target.__globals__,
            closure=ClosureCells(target) if target.__closure__ else None,
        )
        visitor.run(tree)
        _record_outside_reads(found, target, visitor, depth, seen)


# Trainer attributes that hand back the user's own objects, cheaply (a property that returns what the
# fit loop holds): chains through them are the user's state, compared before each replay
USERS_OBJECTS_ON_TRAINER = frozenset({"datamodule", "train_dataloader", "callbacks"})


def _is_users_object_on_trainer(node: ast.AST) -> bool:
    """``<...>.trainer.datamodule`` (or ``train_dataloader``, ``callbacks``): the user's objects,
    reached through the Trainer."""
    return (
        isinstance(node, ast.Attribute)
        and node.attr in USERS_OBJECTS_ON_TRAINER
        and isinstance(node.value, ast.Attribute)
        and node.value.attr == "trainer"
    )


# Calls that write their arguments out (``self.print``, Python logging, rank-zero messages, a logger's
# experiment): a clock reading handed to one is host text (the writing itself is the tracer's business)
_OUTPUT_CALLS = frozenset(
    {
        "print",
        "debug",
        "info",
        "warning",
        "warn",
        "error",
        "critical",
        "exception",
        "rank_zero_info",
        "rank_zero_warn",
        "rank_zero_debug",
        "log_metrics",
        "add_scalar",
        "add_scalars",
        "write",
    }
)


def _written_out(node: ast.AST, parents: dict[int, ast.AST]) -> bool:
    """Whether `node` is (part of) an argument of a call that writes it out, within its statement."""
    parent = parents.get(id(node))
    while parent is not None and not isinstance(parent, ast.stmt):
        if isinstance(parent, ast.Call):
            name = (
                parent.func.attr
                if isinstance(parent.func, ast.Attribute)
                else getattr(parent.func, "id", None)
            )
            if name in _OUTPUT_CALLS:
                return True
        parent = parents.get(id(parent))
    return False


def _same_callable(held: Any, clock: Any) -> bool:
    """`held` is `clock`: the same function, or the same class's method (``datetime.now`` is a new
    bound object at each lookup); never through ``==``, which an arbitrary object may redefine."""
    if held is clock:
        return True
    owner = getattr(clock, "__self__", None)
    return (
        isinstance(owner, type)
        and getattr(held, "__self__", None) is owner
        and getattr(held, "__name__", None) == clock.__name__
    )


def _through_users_object_on_trainer(expr: ast.AST) -> bool:
    """Whether the chain `expr` passes through one of the user's objects on the Trainer."""
    return any(_is_users_object_on_trainer(n) for n in ast.walk(expr))


def _users_objects_state_when_opaque(evaluate: Callable[..., Any]) -> Callable[..., Any]:
    """`evaluate`, whose value, where it is not a Python value a snapshot can hold (a callback, the data
    module, a list of callbacks), is replaced by the state of the user's objects in it: per object of a
    class from the user's own files, its attributes that are Python numbers or strings, or dicts or
    tuples of them. A step that reaches such an object in a way no check follows (``next(...)`` over
    the callbacks, a loop, one of its methods) reads those numbers; a change between steps then
    captures the step again. Lists are left out: a callback's list is most often a history it appends
    to at every step, which would otherwise make every step a new capture."""

    def value(*args: Any) -> Any:
        held = evaluate(*args)
        if frozen(held, tensors=True) is not None:
            return held
        objects = held if isinstance(held, (list, tuple)) else [held]
        return tuple(
            (type(obj).__qualname__, _own_numbers(obj))
            for obj in objects
            if not isinstance(obj, type) and _users_class(type(obj))
        )

    return value


@functools.cache
def _users_class(cls: type) -> bool:
    """:func:`_is_user_code` for a class, once per class (it reads the file system; this runs per replay)."""
    return _is_user_code(cls)


def _own_numbers(obj: Any) -> str:
    """The attributes of `obj` a snapshot can hold, as one text (``repr`` keeps every float's bits)."""
    try:
        held = vars(obj)
    except TypeError:  # __slots__
        return ""
    items = [(k, f) for k, v in held.items() if not isinstance(v, list) and (f := frozen(v)) is not None]
    return repr(sorted(items, key=lambda kv: str(kv[0])))


# _is_user_code's verdicts for functions, by their code's file name: a function's source file is a
# function of that name alone, and every capture asks again for each method of the module's classes
# (a few file-system lookups each). Not a measured gain: a re-capture's host seconds on the CPU
# emulator are the same with and without it (benchmarks/results/cpu-emulator/recapture_cost_cpu.json)
_USER_FILES: dict[str, bool] = {}


def _is_user_code(obj: Any) -> bool:
    """Whether a function or module comes from the user's own files: not from an installed package
    (site-packages, dist-packages), the standard library or l2lightning itself."""
    code = getattr(obj, "__code__", None)
    if not isinstance(code, types.CodeType):
        return _judged_user_code(obj)
    known = _USER_FILES.get(code.co_filename)
    if known is None:
        known = _USER_FILES[code.co_filename] = _judged_user_code(obj)
    return known


# l2lightning's own directory (this module is in its guards/): its files are not the user's code
_PACKAGE_DIR = os.path.realpath(os.path.join(os.path.dirname(__file__), os.pardir))


def _judged_user_code(obj: Any) -> bool:
    try:
        path = inspect.getsourcefile(obj) or ""
    except TypeError:
        return False
    if not path or not os.path.isfile(path):  # "<frozen posixpath>", "<stdin>", a notebook cell
        return False
    resolved = os.path.realpath(path)
    if any(part in resolved for part in ("site-packages", "dist-packages")):
        return False
    stdlib = os.path.realpath(sysconfig.get_paths()["stdlib"])
    if resolved.startswith(stdlib + os.sep):
        return False
    return not resolved.startswith(_PACKAGE_DIR + os.sep)


def _free_names(func: ast.AST) -> set[str]:
    """Names `func` reads but never binds itself (nor in a nested function, class or comprehension):
    what Python looks up in the function's globals, closure or builtins."""
    bound: set[str] = set()
    read: set[str] = set()
    for node in ast.walk(func):
        if isinstance(node, ast.Name):
            (read if isinstance(node.ctx, ast.Load) else bound).add(node.id)
        elif isinstance(node, ast.arg):
            bound.add(node.arg)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and node is not func:
            bound.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            bound.update((a.asname or a.name).split(".")[0] for a in node.names)
        elif isinstance(node, ast.ExceptHandler) and node.name:
            bound.add(node.name)
        elif isinstance(node, (ast.Global, ast.Nonlocal)):
            read.update(node.names)  # declared global: still the module's name, bound or not
    return read - (bound - _declared(func, ast.Global))


def _declared(func: ast.AST, kind: type[ast.Global] | type[ast.Nonlocal]) -> set[str]:
    """The names `func` declares `global` (`kind` ast.Global) or `nonlocal` (ast.Nonlocal)."""
    return {n for node in ast.walk(func) if isinstance(node, kind) for n in node.names}


def _is_super_call(func: ast.expr) -> bool:
    """``super().name`` (the zero-argument form) as a call's function."""
    return (
        isinstance(func, ast.Attribute)
        and isinstance(func.value, ast.Call)
        and isinstance(func.value.func, ast.Name)
        and func.value.func.id == "super"
        and not func.value.args
    )


def _constant_getattr(node: ast.AST) -> bool:
    """``getattr(obj, "name")`` or ``getattr(obj, "name", default)``: an attribute read by a constant
    name (not a dunder), which reads like ``obj.name``."""
    return (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Name)
        and node.func.id == "getattr"
        and 2 <= len(node.args) <= 3
        and not node.keywords
        and isinstance(node.args[1], ast.Constant)
        and isinstance(node.args[1].value, str)
        and not node.args[1].value.startswith("__")
    )


def _selects(text: ast.JoinedStr, parents: dict[int, ast.AST]) -> bool:
    """Whether the f-string `text` picks what the step computes with rather than being host text: a
    subscript's key (``losses[f"{CFG.task}_loss"]``) or the name given to ``getattr``."""
    child, parent = text, parents.get(id(text))
    while parent is not None and not isinstance(parent, ast.stmt):
        if isinstance(parent, ast.Subscript) and child is parent.slice:
            return True
        if (
            isinstance(parent, ast.Call)
            and isinstance(parent.func, ast.Name)
            and parent.func.id == "getattr"
            and len(parent.args) >= 2
            and child is parent.args[1]
        ):
            return True
        child, parent = parent, parents.get(id(parent))
    return False


# Methods that hand back a mapping's entries whole (``for k, w in self.loss_weights.items()``)
_MAPPING_VIEWS = frozenset({"items", "values", "keys"})


def _read_whole_by_a_view(node: ast.AST, parents: dict[int, ast.AST]) -> bool:
    """Whether `node` is the receiver of ``.items()``, ``.values()`` or ``.keys()``: what the step reads
    is then all of it (compared whole, as a small container, before each replay)."""
    view = parents.get(id(node))
    call = parents.get(id(view)) if view is not None else None
    return (
        isinstance(view, ast.Attribute)
        and view.value is node
        and view.attr in _MAPPING_VIEWS
        and isinstance(call, ast.Call)
        and call.func is view
        and not call.args
        and not call.keywords
    )


def _chain_base(expr: ast.expr) -> tuple[ast.expr, int]:
    """(where the attribute and constant-subscript chain `expr` starts, how many links it has):
    ``(Name("CFG"), 2)`` for ``CFG.loss["w"]``; a subscript by anything but a constant ends it."""
    base, depth = expr, 0
    while isinstance(base, ast.Attribute) or (
        isinstance(base, ast.Subscript) and isinstance(base.slice, ast.Constant)
    ):
        base, depth = base.value, depth + 1
    return base, depth


def _constant_get(node: ast.AST) -> tuple[ast.expr, Any, Any] | None:
    """(the receiver, the key, the default) of ``<receiver>.get(<constant>)`` or
    ``<receiver>.get(<constant>, <constant>)``: a mapping's entry read by a constant key
    (``self.hparams.get("kl_weight", 1.0)``), which reads like a subscript; else None."""
    if not (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and node.func.attr == "get"
        and 1 <= len(node.args) <= 2
        and not node.keywords
        and all(isinstance(a, ast.Constant) for a in node.args)
    ):
        return None
    default = node.args[1].value if len(node.args) == 2 else None
    return node.func.value, node.args[0].value, default


# What a `.get` read gives when its receiver is not a mapping (a user object with a `get` method, which
# may do anything): a constant, so it is never compared and never called
NOT_A_MAPPING = "not a mapping"


def _getting(read: Callable[..., Any], key: Any, default: Any) -> Callable[..., Any]:
    """`read`, then the entry `key` (or `default`) of what it gives, where that is a dict (an
    ``AttributeDict`` too), the process's environment or an OmegaConf config; else :data:`NOT_A_MAPPING`."""

    def value(*args: Any) -> Any:
        mapping = read(*args)
        if (
            isinstance(mapping, dict)
            or mapping is os.environ  # `os.environ.get("AUX_W", "0")`: set by a hook between steps
            or type(mapping).__module__.partition(".")[0] == "omegaconf"
        ):
            return mapping.get(key, default)
        return NOT_A_MAPPING

    return value


def _safe(expr: ast.expr, allow_methods: bool, math_calls: bool = False) -> bool:
    """Only reads: names, attributes, subscripts, constants, arithmetic; whitelisted calls (with
    `math_calls`, the pure functions of the ``math`` module too)."""
    allowed = (
        ast.Name, ast.Attribute, ast.Subscript, ast.Constant, ast.BinOp, ast.UnaryOp, ast.Compare, ast.BoolOp,
        ast.IfExp, ast.Load, ast.operator, ast.unaryop, ast.cmpop, ast.boolop, ast.Slice, ast.Tuple, ast.Call,
        ast.keyword, ast.JoinedStr, ast.FormattedValue,
    )  # fmt: skip
    for node in ast.walk(expr):
        if not isinstance(node, allowed):
            return False
        if isinstance(node, ast.Call):
            f = node.func
            if isinstance(f, ast.Name) and f.id == "getattr" and not _constant_getattr(node):
                return False
            if isinstance(f, ast.Name) and f.id in _SAFE_BUILTINS:
                continue
            if allow_methods and isinstance(f, ast.Attribute) and f.attr in _SAFE_METHODS:
                continue
            if (
                math_calls
                and isinstance(f, ast.Attribute)
                and isinstance(f.value, ast.Name)
                and f.value.id == "math"
                and f.attr in _MATH_FUNCTIONS
            ):
                continue
            return False
        if isinstance(node, ast.Attribute) and node.attr.startswith("__"):
            return False
    return True
