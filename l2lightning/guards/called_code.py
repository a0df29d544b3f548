"""The user's code a step runs beyond the step hooks' own source, read for what a replay would freeze.

:func:`l2lightning.guards.step_source.analyse` reads ``training_step``, the hooks inside the step and the
module's own methods they call. A step runs more of the user's Python than that: the ``forward`` of
every submodule of the user's own classes (``x * SCALE`` in a custom layer), and the hooks registered
on the module tree, on its parameters and as nn.Module's global hooks (``p.register_hook(clip)``,
``layer.register_forward_hook(lambda m, i, o: o * ALPHA)``). A replay runs none of it, so a
module-level number or a closure variable it reads is baked into the graph exactly like one
``training_step`` reads, and a module-level name it assigns stops changing.

:func:`analyse_called_code` adds what that code reads from outside itself to the step source's
``global_reads`` (compared before each replay: a new value captures the step again) and what it
assigns with ``global``/``nonlocal`` to ``global_writes`` (refused). A layer's other methods may run
in the step too (``self.vae.encode(x)`` from ``training_step``), and so may the user's callables the
module and its layers keep in attributes (``self.loss_fn = weighted_mse``, a ``functools.partial``,
``self.my_loss``, a loss object with ``__call__``), and the user's classes that code names (a custom
``torch.autograd.Function``'s ``forward`` and ``backward``): they are read for what they read only,
since what they assign is not known to happen in the step. Its conditions and ``self.``
reads are not the LightningModule's, so they stay out of the step source: a submodule's public
scalars are compared before each replay anyway (every submodule the step calls), and the objects
whose methods run as hooks are returned so that their Python state is watched like the module's.
Code it cannot read (no source: a lambda on a line that does not parse alone) is read from its
bytecode: every name it loads that its globals or closure hold.

:class:`StepHooks` records the hooks a capture ran, so that one added or removed later (a replay
runs the capture's hooks only) captures the step again.
"""

from __future__ import annotations

import functools
import inspect
import types
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.hooks import RemovableHandle

from l2lightning.guards.step_source import (
    HELPER_DEPTH,
    ClosureCells,
    StepSource,
    _closure_name_of,
    _held_callables_in,
    _is_user_code,
    _lookup,
    _methods_matching,
    _parse_function,
    _record_outside_reads,
    _Visitor,
    add_conditions,
    add_counter_values,
    add_self_reads,
    evaluated_on,
    read_bytecode,
    read_handed_on,
    read_with_module,
)
from l2lightning.guards.step_values import AttributeValue

# nn.Module's per-module hook registries that run during a forward or a backward
_MODULE_HOOKS = ("_forward_pre_hooks", "_forward_hooks", "_backward_pre_hooks", "_backward_hooks")
# the global ones (torch.nn.modules.module.register_module_forward_hook and friends)
_GLOBAL_HOOKS = (
    "_global_forward_pre_hooks",
    "_global_forward_hooks",
    "_global_backward_pre_hooks",
    "_global_backward_hooks",
)
# a tensor's registries: Tensor.register_hook, Tensor.register_post_accumulate_grad_hook
_TENSOR_HOOKS = ("_backward_hooks", "_post_accumulate_grad_hooks")


def _registries(module: torch.nn.Module) -> list[dict]:
    """The hook dicts that run when `module` runs forward and backward, those holding hooks."""
    registries = [getattr(torch.nn.modules.module, name, None) for name in _GLOBAL_HOOKS]
    for sub in module.modules():
        registries += [getattr(sub, name, None) for name in _MODULE_HOOKS]
    for param in module.parameters():
        registries += [getattr(param, name, None) for name in _TENSOR_HOOKS]
    return [registry for registry in registries if registry]


def _users(registry: dict) -> list[Any]:
    """The hooks in `registry` that are not l2lightning's own."""
    return [hook for hook in list(registry.values()) if not _ours(hook)]


def _ours(hook: Any) -> bool:
    while isinstance(hook, functools.partial):
        hook = hook.func
    function = getattr(hook, "__func__", hook)
    module = getattr(function, "__module__", None) or type(hook).__module__ or ""
    return module == "l2lightning" or module.startswith("l2lightning.")


def step_hooks(module: torch.nn.Module) -> list[Any]:
    """The callables registered as hooks that run when `module` runs forward and backward."""
    return [hook for registry in _registries(module) for hook in list(registry.values())]


@dataclass
class StepHooks:
    """The hooks a captured graph ran, to tell before each replay whether one was added or removed.

    A replay runs the hooks of its capture and no others: a gradient clamp a callback registers at
    epoch 1, or a forward hook it removes, would otherwise be ignored by every later replay. Adding a
    hook anywhere creates a ``RemovableHandle`` (``next_id`` counts them process-wide), so a replay
    whose count is unchanged needs no further look; removing one shrinks its registry, and only
    registries that held hooks at capture can shrink (usually none). Per replay: one attribute read
    and one ``len`` per such registry.
    """

    ids: tuple[int, ...]  # the hooks themselves, by identity
    # each registry that held the user's hooks: [registry, its size, how many of them are the user's]
    held: list[list]
    handles: int  # RemovableHandle.next_id when this was taken

    @classmethod
    def of(cls, module: torch.nn.Module) -> StepHooks:
        # l2lightning's own prefetch hooks are left out: they only place kernels at a capture, and the
        # whole-step gate removes them from a graph it keeps (its kernels switched off)
        users = [(registry, _users(registry)) for registry in _registries(module)]
        return cls(
            tuple(id(hook) for _, hooks in users for hook in hooks),
            [[registry, len(registry), len(hooks)] for registry, hooks in users if hooks],
            RemovableHandle.next_id,
        )

    def changed(self, module: torch.nn.Module) -> bool:
        """Whether `module`'s hooks are not those of the capture (added, removed or replaced)."""
        for entry in self.held:
            registry, size, users = entry
            if len(registry) != size:  # something was removed: the user's hook, or only one of ours
                if len(_users(registry)) != users:
                    return True
                entry[1] = len(registry)
        if RemovableHandle.next_id == self.handles:
            return False
        now = StepHooks.of(module)
        if now.ids != self.ids:
            return True
        self.handles = now.handles  # handles made elsewhere: no need to look again until the next one
        return False


def analyse_called_code(module: torch.nn.Module, found: StepSource) -> list[Any]:
    """Add to `found` what the user's submodule ``forward`` methods and step hooks read and assign
    outside themselves; return the objects (not modules) whose methods run as hooks."""
    # the code the step hands batch_idx to that the module holds (`self.criterion(logits, y, batch_idx)`),
    # built by now (configure_model ran), or bound anew since the last capture: read with it
    read_handed_on(found, module, final=True)
    methods: list[tuple[Any, str, int]] = []
    functions: list[types.FunctionType] = []
    owners: list[Any] = []
    # a layer's other methods may run too (`self.vae.encode(x)` from training_step): read for what
    # they read only; what they assign is not known to be the step's
    other_methods: list[tuple[Any, str]] = []
    for sub in module.modules():
        if sub is not module:
            methods.append((sub, "forward", 0))
            other_methods += [(sub, name) for name in _own_functions(type(sub)) if name != "forward"]
    for hook in step_hooks(module):
        while isinstance(hook, functools.partial):
            hook = hook.func
        if isinstance(hook, types.MethodType):
            methods.append((hook.__self__, hook.__func__.__name__, 0))
            owner = hook.__self__
        elif isinstance(hook, types.FunctionType):
            functions.append(hook)
            continue
        else:  # a callable object of the user's: its __call__
            methods.append((hook, "__call__", 0))
            owner = hook
        if not isinstance(owner, torch.nn.Module) and all(owner is not o for o in owners):
            owners.append(owner)
    # the module's methods that code read as the module's calls through another name (a loss function's
    # `model.helper()`, `getattr(self, f"_{kind}_loss")(...)`, a callback's `pl_module.helper()`): they
    # run in the step (l2lightning.guards.step_source.read_with_module, StepSource.read_patterns)
    called = [pattern for _, pattern, is_called in found.read_patterns if is_called]
    for name in _methods_matching(type(module), called):
        function = _user_function(type(module), name)
        params = function.__code__.co_varnames[:1] if function is not None else ()
        if params and (id(function.__code__), params[0]) not in found.module_functions_read:
            methods.append((module, name, 0))  # (not read already as the step's helper)
    seen_code: set[int] = set()
    scratch = StepSource()  # the conditions and self-reads of code that is not the module's
    seen_methods: set[tuple[type, str]] = set()
    while methods:
        obj, name, depth = methods.pop(0)
        if (type(obj), name) in seen_methods:
            continue
        seen_methods.add((type(obj), name))
        function = _user_function(type(obj), name)
        if function is None:
            continue  # torch's own layers, installed packages, l2lightning's prefetch hooks
        reads: set[str] = set()
        visitor = _read(
            found, scratch, function, depth, seen_code, reads, owner=obj, branches=True, module=module
        )
        add_self_reads(found, module, obj, reads)
        if visitor is not None and depth < HELPER_DEPTH:
            methods += [(obj, helper, depth + 1) for helper in sorted(visitor.helpers)]
    for hook_function in functions:
        function = _users_own(hook_function)
        if function is not None and id(function.__code__) not in seen_code:
            _read(found, scratch, function, 0, seen_code, set(), owner=None, branches=True, module=module)
    found.global_writes += [w for w in scratch.global_writes if w not in found.global_writes]
    found.iterator_advances += [w for w in scratch.iterator_advances if w not in found.iterator_advances]
    ignored = StepSource()
    read_only = [(obj, _user_function(type(obj), name)) for obj, name in other_methods]
    for holder in module.modules():
        read_only += _held_callables(holder)
    # the callables the module keeps in containers its step reads (`self.loss_fns = {"mse": self._mse}`)
    for name in sorted(found.reads):
        value = vars(module).get(name)
        if isinstance(value, (dict, list, tuple)):
            read_only += [_callable_owner_and_function(item) for item in _held_callables_in(value)]
    for owner, function in read_only:
        if function is None or id(function.__code__) in seen_code:
            continue
        reads: set[str] = set()
        # at HELPER_DEPTH: the functions it calls are not followed (they might assign)
        _read(found, ignored, function, HELPER_DEPTH, seen_code, reads, owner=owner, module=module)
        add_self_reads(found, module, owner, reads)
    # the module's attributes read by names the source does not show (`vars(self)`, a computed getattr)
    found.resolve_reads(module)
    # the user's classes named in the code read so far: a custom autograd Function's forward and
    # backward run in the step (`GradReverse.apply(x)`), and so may a class's static helpers
    for cls in _named_classes(found):
        for name in _own_functions(cls):
            function = _user_function(cls, name)
            if function is not None and id(function.__code__) not in seen_code:
                _read(found, ignored, function, HELPER_DEPTH, seen_code, set(), owner=None)
    return owners


def _user_function(cls: type, name: str) -> types.FunctionType | None:
    """The plain function behind `cls`'s attribute `name` (a method, a static or class method's,
    unwrapped), if it is the user's own code; else None."""
    function = _lookup(cls, name, None)[1]
    return _users_own(_function_of(function)) if function is not None else None


def _named_classes(found: StepSource) -> list[type]:
    """The classes of the user's own code (not modules: their instances' forward is read) that the
    code read so far names: module-level names and attributes of the user's modules."""
    classes: list[type] = []
    for namespace, names in list(found.global_reads.values()):
        for name in sorted(names):
            value = namespace.get(name) if hasattr(namespace, "get") else None
            if (
                isinstance(value, type)
                and not issubclass(value, torch.nn.Module)
                and value not in classes
                and _is_user_code(value)
            ):
                classes.append(value)
    return classes


def _held_callables(holder: Any) -> list[tuple[Any, Any]]:
    """(the object its ``self`` is, or None; the function, or None if not the user's) for each callable that `holder`
    keeps in an attribute (``self.loss_fn = focal_loss``, ``functools.partial(focal, gamma=2)``,
    ``self.my_loss``, the methods of an object of the user's class such as a loss with ``__call__``):
    the step may call it through the attribute."""
    found: list[tuple[Any, Any]] = []
    for value in list(vars(holder).values()):
        while isinstance(value, functools.partial):
            value = value.func
        if isinstance(value, (types.FunctionType, types.MethodType)):
            found.append(_callable_owner_and_function(value))
        elif not isinstance(value, (type, torch.nn.Module, torch.Tensor)) and hasattr(value, "__dict__"):
            # an object of the user's own class (a loss with __call__, a schedule with a method the
            # step calls): every function its class defines
            cls = type(value)
            found += [(value, _user_function(cls, name)) for name in _own_functions(cls)]
    return found


def _callable_owner_and_function(value: Any) -> tuple[Any, types.FunctionType | None]:
    """(the object a method is bound to, or None for a function; the function, if the user's own)."""
    if isinstance(value, types.MethodType):
        return value.__self__, _users_own(value.__func__)
    return None, _users_own(value)


def _users_own(function: Any) -> types.FunctionType | None:
    """`function` unwrapped, if it is a plain function of the user's own code; else None."""
    function = inspect.unwrap(function)
    return function if isinstance(function, types.FunctionType) and _is_user_code(function) else None


def _own_functions(cls: type) -> list[str]:
    """Names of the functions that the user's own classes in `cls`'s MRO define, but ``__init__``
    (which runs when the object is made, not in a step)."""
    names: list[str] = []
    for klass in cls.__mro__:
        for name, value in vars(klass).items():
            function = _function_of(value)
            if (
                isinstance(function, types.FunctionType)
                and name not in names
                and name != "__init__"
                and _is_user_code(function)
            ):
                names.append(name)
    return names


def _function_of(value: Any) -> Any:
    """The function behind a class attribute: a plain function, or a static or class method's."""
    return value.__func__ if isinstance(value, (staticmethod, classmethod)) else value


def _read(
    found: StepSource,
    scratch: StepSource,
    function: types.FunctionType,
    depth: int,
    seen: set[int],
    reads: set[str],
    owner: Any,
    branches: bool = False,
    module: Any = None,
) -> _Visitor | None:
    """Record what `function` reads outside itself (from its source, else its bytecode). For a method
    (`owner`: the object its ``self`` is), its ``self.X`` reads go to `reads`, and the values it reads
    through ``self`` by constant subscripts and attributes (``self.cfg["w"]``, ``self.cfg.extra[0]``)
    join the step source's comparisons, evaluated on `owner`; with `branches` (code known to run in the
    step), so do its branch tests on ``self`` (``if self.cfg["boost"]:``), in the step's branch key.
    A function that closes over `module` (the LightningModule: ``lambda p, y: ... * self.aux_weight``
    kept in an attribute or registered as a hook) is read as the module's own code
    (:func:`l2lightning.guards.step_source.read_with_module`)."""
    seen.add(id(function.__code__))
    alias = _closure_name_of(function, module) if owner is None and module is not None else None
    if alias is not None:
        read_with_module(found, function, alias, f"`{function.__qualname__}`", depth, set())
        read_bytecode(found, function)
        return None
    tree, filename, first_line, params = _parse_function(function)  # a lambda's too
    if tree is None:  # source that does not parse alone, a lambda sharing its line with a like one
        read_bytecode(found, function)
        return None
    self_name = params[0] if owner is not None and params else ""
    visitor = _Visitor(
        scratch,
        filename,
        first_line,
        self_name,
        None,
        (),
        reads,
        namespace=function.__globals__,
        closure=ClosureCells(function) if function.__closure__ else None,
        module_names=(self_name,) if owner is module and self_name else (),
        module_reads=reads if owner is module and self_name else None,
        owner=owner,
    )
    values_before, conditions_before = len(scratch.attribute_values), len(scratch.conditions)
    counters_before = len(scratch.counter_values)
    visitor.run(tree)
    if owner is not None:
        # read again at each capture: each (line, owner) once
        known = {(v.line, getattr(v.evaluate, "owner_id", None)) for v in found.attribute_values}
        found.attribute_values += [
            AttributeValue(value.line, evaluated_on(owner, value.evaluate))
            for value in scratch.attribute_values[values_before:]
            if (value.line, id(owner)) not in known
        ]
    if branches:
        # its tests, evaluated per step on `owner`; those on the step counters that cannot be evaluated
        # (`if self._lm().global_step >= 10:` through a weakref to the module) are refused by name, as
        # training_step's are: the warm-up steps may all take one side of them
        add_conditions(
            found,
            scratch.conditions[conditions_before:],
            owner,
            f"`{function.__qualname__}`, which the step runs",
        )
        # and the numbers it computes from the step counters (`w = max(0.0, (self._lm[0].global_step - 10)
        # * 0.1)`): compared before each replay on `owner`, like training_step's own
        add_counter_values(found, scratch.counter_values[counters_before:], owner)
    _record_outside_reads(found, function, visitor, depth, seen)
    return visitor
