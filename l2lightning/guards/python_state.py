"""Python values a training step changes on the module and its callbacks: what a replay would freeze.

A replayed graph runs no Python. A step that counts in a Python attribute (``self.n += 1``, an
epsilon decayed per step, a step counter of its own), appends to a list (``self.outputs.append(preds)``,
Lightning's own migration advice for ``training_step_outputs``) or flips a flag would, replayed, stop
doing so: the counter freezes, a branch on it never fires again (a target-network sync every N of its
own steps), the list keeps one entry. None of that is visible to the op trace, whose work is the same
on most steps, so the callback snapshots the scalar attributes (int, float, bool, str), the
elements of lists and deques (by identity: a full ``deque(maxlen=n)`` drops its first element as it
appends, so its length alone does not show the append), the entries of dicts that hold lists or
deques (``self.outputs = defaultdict(list)``) with their lists' elements, of the module, its submodules
and the Trainer's other callbacks, and which tensor each of their tensor attributes, buffers and
parameters is (``self.running = 0.9 * self.running + x`` binds a new one each step, which a graph that
keeps reading the old one cannot follow), around each traced step and refuses, naming the attribute, a
step that changes one after the first warm-up step (a first step may build something once: a lazy
cache, an ``initialized`` flag). Private attributes are the step's state as public ones are, where
the object's class is the user's (``self._n += 1``, ``self._outputs.append(loss)``): only the names
its library base classes hold (``nn.Module``'s ``_parameters`` and hooks, Lightning's
``_current_fx_name``, which Lightning's code sets inside every step) are left out, and objects of
library classes keep their private attributes to themselves (:func:`own_attributes`). An optimizer of
the user's own class (``class MyAdamW(torch.optim.AdamW)`` with a step counter) is snapshot too
(:func:`optimizer_owners`): its ``step`` runs inside the captured step, around the closure. The one change a replay can redo is one ``append`` per step to a list
or deque, an attribute or an entry of a dict: the callback appends a fresh copy of the element the
capture appended (its tensors are the graph's, overwritten by each replay) after every replay, to
the container the attribute or entry holds then (where there is none, an epoch-end hook having
cleared the dict, that step runs eagerly: only its own code knows what it would append to). A
capture that does not complete puts the scalars, the lists' and deques' elements and the dicts'
entries back, so the eager step that replaces it changes them once.
"""

from __future__ import annotations

import functools
import os
import random
import sys
import sysconfig
import types
import weakref
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch

from l2lightning.guards.compiled_calls import partial_arguments
from l2lightning.guards.metric_binding import metric_type
from l2lightning.guards.step_values import NUMPY_SCALARS, VALUE_ATOMS, address, frozen
from l2lightning.guards.step_values import addresses as _addresses

# the scalar attributes a step may bake in: Python's numbers and strings, and NumPy's scalars
_SCALARS = (int, float, bool, str, *NUMPY_SCALARS)
# what a graph bakes in beside them, as immutable values compared with `==`: a branch or a lookup on
# an Enum member (`if self.phase is Phase.MAIN:`, a layer's `self.mode`), a Fraction or Decimal
# weight, a dtype or device the step casts to (functions are compared by identity as callables)
_BAKED = (*_SCALARS, *VALUE_ATOMS)
# public attributes that are not the step's own state: nn.Module's train/eval flag (the callback
# checks it per step, and a change captures again)
_IGNORED = frozenset({"training"})
# the containers a step appends its outputs to, whose one `append` per step a replay can redo
_SEQUENCES = (list, deque)
# the key of a value that is an attribute itself, not an entry of the dict an attribute holds
NO_KEY = object()


@dataclass(frozen=True)
class _Value:
    label: str  # "`self.n`", "`self.head.calls`", "`MyCallback.count`", "Python's global `random` generator"
    owner: Any
    name: str
    # "value", "tensor" (which object), "tensors", "rng", "held_rng" or "dict" ((what to compare, what to
    # restore)), "items" (a list or deque: (it, its elements, its maxlen)) or "entries" (a dict holding
    # lists or deques: (it, its (key, value) pairs))
    kind: str
    value: Any
    key: Any = NO_KEY  # an "items", "tensor" or "tensors" entry of the dict attribute `name`: its key there


# (id(owner), name), and (id(owner), name, key) for a list or deque in the dict attribute `name`
Snapshot = dict[tuple, _Value]

# The labels of random generators' states: the global ones, and the suffix of one held in an attribute
PYTHON_RANDOM_LABEL = "Python's global `random` generator"
NUMPY_RANDOM_LABEL = "NumPy's global `np.random` generator"
TORCH_CPU_RANDOM_LABEL = "torch's global CPU generator (`torch.rand(...)` without a `device`)"
HELD_GENERATOR_SUFFIX = " (a random generator)"


def names_a_generator(label: str) -> bool:
    """Whether a change's label (:func:`changed`) is a random generator's state."""
    return label in (PYTHON_RANDOM_LABEL, NUMPY_RANDOM_LABEL, TORCH_CPU_RANDOM_LABEL) or label.endswith(
        HELD_GENERATOR_SUFFIX
    )


# Packages whose objects a module may hold (a tokenizer, a logger, a config) without them being the
# step's own state: their public attributes are not snapshot or compared
_LIBRARY_PACKAGES = frozenset(
    {
        "builtins", "torch", "torchvision", "torchaudio", "torchmetrics", "lightning", "pytorch_lightning",
        "lightning_fabric", "lightning_utilities", "numpy", "omegaconf", "hydra", "l2lightning", "logging",
        "tqdm", "transformers", "tokenizers", "datasets", "wandb", "tensorboard", "matplotlib",
    }
)  # fmt: skip
# A held object with more public scalars than this is not a small loss or schedule object: left out
# of the comparisons before each replay (they run per step)
MAX_HELD_SCALARS = 32


def held_objects(obj: Any) -> list[tuple[str, Any]]:
    """(attribute name, object) for the plain Python objects `obj` holds in its own attributes
    (:func:`own_attributes`): instances of the user's own classes that are not modules, tensors,
    containers, functions or classes (a loss callable with a ``scale``, a schedule object). A replay
    runs no Python, so a number such an object holds and the step reads (inside its ``__call__``) is
    baked into the graph like the module's own."""
    return [(name, value) for name, value in own_attributes(obj) if _is_plain_object(value)]


def own_attributes(obj: Any) -> list[tuple[str, Any]]:
    """(name, value) of the attributes of `obj` that are its Python state, not a library's.

    An object of library code (:func:`is_library_class`: torch's layers, Lightning's callbacks, a
    tokenizer) keeps its private attributes to itself: its public ones only. An object of the user's
    own class has its private attributes too (``self._n += 1``, ``self._outputs.append(loss)``: a
    replay would freeze them as it would their public spellings), but for those its library base
    classes hold (:func:`_library_names`: ``nn.Module``'s ``_parameters`` and hooks, Lightning's
    ``_current_fx_name`` and ``_param_requires_grad_state``, which Lightning's own code sets inside a
    step and every replay sets again) and dunders. A Python module of the user's (whose globals the
    step reads, :func:`global_namespaces`) has its private globals too. The user's optimizer (a subclass of a torch
    optimizer) leaves out the public ``state``, ``param_groups`` and ``defaults`` too: torch's."""
    attributes = getattr(obj, "__dict__", None)
    if not attributes:
        return []
    if isinstance(obj, types.ModuleType):  # the globals of a Python module the step's code reads
        library = None if _is_library_module(getattr(obj, "__name__", None)) else frozenset()
    else:
        library = _library_names(obj)
    if library is None:
        return [(n, v) for n, v in list(attributes.items()) if isinstance(n, str) and not n.startswith("_")]
    return [
        (n, v)
        for n, v in list(attributes.items())
        if isinstance(n, str) and n not in library and not (n.startswith("__") and n.endswith("__"))
    ]


def is_library_class(cls: type) -> bool:
    """Whether `cls` is library code, not the user's: defined in one of :data:`_LIBRARY_PACKAGES` or in
    Python's standard library (built-in and frozen modules too). Other installed packages are not: the
    user's own project installed with pip, or a third-party optimizer or layer whose Python counts its
    calls, is frozen by a replay as the user's own code is (and their objects held by the module are
    snapshot today, :func:`held_objects`). A class of ``__main__`` (a script's, a notebook's) is the user's."""
    found = _LIBRARY_CLASSES.get(cls)
    if found is None:
        found = _is_library_module(getattr(cls, "__module__", None))
        _LIBRARY_CLASSES[cls] = found
    return found


def _is_library_module(name: Any) -> bool:
    if not isinstance(name, str):
        return True  # nothing to tell its code by: as today, left to the library rule
    if name == "__main__":
        return False
    if name.split(".")[0] in _LIBRARY_PACKAGES:
        return True
    path = getattr(sys.modules.get(name), "__file__", None)
    if not isinstance(path, str):
        return True  # a built-in or frozen module
    path = os.path.realpath(path)
    if any(part in path for part in _INSTALLED_PARTS):
        return False  # an installed package (some distributions keep them under the standard library's root)
    return any(path.startswith(root) for root in _stdlib_roots())


# where installed packages live: not the standard library
_INSTALLED_PARTS = (f"{os.sep}site-packages{os.sep}", f"{os.sep}dist-packages{os.sep}")
# class -> is_library_class; weak: a class made per test or per fit is not kept alive here
_LIBRARY_CLASSES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
# class -> _library_names (None for library classes)
_LIBRARY_NAMES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


@functools.cache
def _stdlib_roots() -> tuple[str, ...]:
    paths = sysconfig.get_paths()
    return tuple(os.path.realpath(paths[key]) + os.sep for key in ("stdlib", "platstdlib") if paths.get(key))


# Names Lightning and torch set on the user's objects later than their constructors, from code of
# other classes: torch's LR schedulers mark each optimizer step (`optimizer._opt_called`), and the
# callback names its wrapper on the optimizer
_LATE_LIBRARY_NAMES = frozenset({"_opt_called", "_l2lightning_capturable"})


@functools.cache
def _root_names() -> tuple[tuple[type, frozenset[str]], ...]:
    """(library base class, the names a fresh instance of it holds) for the base classes the user's
    objects derive from: computed once, from the classes themselves, so that whatever a version of
    torch or Lightning holds is what is left out."""
    from lightning.pytorch import Callback, LightningModule

    def fresh_optimizer() -> Any:
        return torch.optim.Optimizer([torch.zeros(1, requires_grad=True)], {})

    roots: list[tuple[type, Any]] = [
        (LightningModule, LightningModule),
        (torch.nn.Module, torch.nn.Module),
        (Callback, Callback),
        (torch.optim.Optimizer, fresh_optimizer),
    ]
    return tuple((root, frozenset(vars(make()))) for root, make in roots)


def _library_names(obj: Any) -> frozenset[str] | None:
    """The attribute names the library base classes of `obj`'s class hold on its instances, which are
    not the user's state; None where the class is library code itself (or a torchmetrics metric,
    whose states are the metric binding's), whose objects keep the public-only rule.

    Each root base class (LightningModule, nn.Module, Callback, torch's Optimizer) the class derives
    from gives the names its fresh instance holds (:func:`_root_names`); any other library class in
    its MRO (``nn.LSTM`` under a user's LSTM subclass, ``ModelCheckpoint`` under a user's checkpoint
    callback, ``AdamW`` under a user's optimizer) gives the names its code mentions, which hold what it
    sets on the instance. For objects other than optimizers only the private names among them count:
    their public attributes stay the step's state as they always were."""
    cls = type(obj)
    try:
        return _LIBRARY_NAMES[cls]
    except KeyError:
        pass
    names: frozenset[str] | None
    if is_library_class(cls) or _is_metric(obj):
        names = None
    else:
        found: set[str] = set(_LATE_LIBRARY_NAMES)
        covered: set[type] = set()
        for root, fresh in _root_names():
            if issubclass(cls, root):
                found |= fresh
                covered.update(root.__mro__)
        for klass in cls.__mro__:
            if klass is not object and klass not in covered and is_library_class(klass):
                found |= _code_names(klass)
        if not isinstance(obj, torch.optim.Optimizer):
            found = {n for n in found if n.startswith("_")}
        names = frozenset(found)
    _LIBRARY_NAMES[cls] = names
    return names


def _code_names(klass: type) -> set[str]:
    """The names (attributes and globals) that the code of `klass`'s own functions mentions."""
    found: set[str] = set()
    for value in vars(klass).values():
        if isinstance(value, (staticmethod, classmethod)):
            value = value.__func__
        functions = [value.fget, value.fset, value.fdel] if isinstance(value, property) else [value]
        for fn in functions:
            for _ in range(8):  # a decorated function: its wrappers, down to the code itself
                code = getattr(fn, "__code__", None)
                if isinstance(code, types.CodeType):
                    found |= _names_in(code)
                fn = getattr(fn, "__wrapped__", None)
                if fn is None:
                    break
    return found


def _names_in(code: types.CodeType) -> set[str]:
    found = set(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):  # nested functions, comprehensions, lambdas
            found |= _names_in(const)
    return found


def _is_plain_object(value: Any) -> bool:
    if isinstance(
        value, (torch.Tensor, torch.nn.Module, type, list, tuple, dict, set, *_SCALARS)
    ) or callable(getattr(value, "__func__", None)):
        return False
    if not hasattr(value, "__dict__") or type(value).__module__ is None:
        return False
    return type(value).__module__.split(".")[0] not in _LIBRARY_PACKAGES


def owners(module: Any, callbacks: Iterable[Any] = ()) -> list[tuple[str, Any]]:
    """(label prefix, object) for the module, its submodules, the plain objects they hold
    (:func:`held_objects`) and `callbacks`."""
    found = [("self", module)]
    found += [(f"self.{name}", sub) for name, sub in module.named_modules() if name]
    found += [
        (f"{prefix}.{name}", held) for prefix, holder in list(found) for name, held in held_objects(holder)
    ]
    found += [(type(cb).__name__, cb) for cb in callbacks]
    return found


def optimizer_owners(optimizers: Iterable[Any]) -> list[tuple[str, Any]]:
    """(label prefix, optimizer) for those of `optimizers` whose class is the user's own (``class
    MyAdamW(torch.optim.AdamW)`` with a step counter of its own): its Python runs inside the captured
    step, so a replay would freeze what it changes. torch's own optimizers hold no Python state of
    the user's (their ``state`` and param groups are the capturable optimizer's to handle)."""
    return [(type(o).__name__, o) for o in optimizers if _library_names(o) is not None]


def global_namespaces(global_reads: Iterable[tuple[Any, set[str]]]) -> list[tuple[str, Any]]:
    """(module name, module) for the Python modules whose globals `global_reads` (the step source's
    ``(namespace, names)``) come from: the step's code reads their names, so a module-level list it
    appends to or a number it assigns is the step's Python state too. Closure variables and the
    attributes of the user's objects are left out."""
    found = []
    for namespace, _ in global_reads:
        name = namespace.get("__name__") if isinstance(namespace, dict) else None
        module = sys.modules.get(name) if isinstance(name, str) else None
        if module is not None and vars(module) is namespace and all(module is not m for _, m in found):
            found.append((name, module))
    return found


def snapshot(
    objects: Iterable[tuple[str, Any]],
    skip: frozenset[tuple[int, str]] = frozenset(),
    device_type: str = "cpu",
    generators: bool = True,
) -> Snapshot:
    """The scalar attributes, lists and deques (their elements), dicts holding lists or deques (their
    entries, and the lists' elements) and small dicts of numbers of `objects` (their own attributes,
    :func:`own_attributes`: public ones, and the private ones of the user's own classes), and the state
    of Python's and NumPy's global random generators (a step that draws from them, an epsilon-greedy
    branch on ``random.random()``, would draw once and then replay that one branch; not with
    `generators` False). `skip`: (id(object), name) pairs left out (attributes the callback itself sets
    around a capture).

    `device_type` is the device the step trains on. Off the CPU, torch's global CPU generator is the
    host's too: a draw from it (``if torch.rand(1) < p``, a torchvision v2 random transform called in
    the step) runs on the host at capture only, so a replay would keep its outcome, and plain training
    would have moved the generator on for every later draw (a ``DataLoader``'s shuffle order). On the
    CPU that generator is the device's, drawn by the captured ops themselves (dropout)."""
    out: Snapshot = {}
    # a generator's value: (what to compare, what to restore)
    state = random.getstate()
    if generators:
        out[0, "random"] = _Value(PYTHON_RANDOM_LABEL, None, "random", "rng", (state, state))
    if generators and device_type != "cpu":
        state = torch.default_generator.get_state()
        out[0, "torch"] = _Value(TORCH_CPU_RANDOM_LABEL, None, "torch", "rng", (bytes(state.numpy()), state))
    numpy = sys.modules.get("numpy")
    if generators and numpy is not None:
        state = numpy.random.get_state()
        kind, keys, position, has_gauss, cached = state[:5]
        comparable = (kind, keys.tobytes(), position, has_gauss, cached)
        out[0, "numpy"] = _Value(NUMPY_RANDOM_LABEL, None, "numpy", "rng", (comparable, state))
    for prefix, obj in objects:
        attributes = getattr(obj, "__dict__", None)
        if not attributes:
            continue
        tracks_tensors = not _is_metric(obj)  # metric states are the metric binding's, rebound by design
        for name, value in own_attributes(obj):
            if name in _IGNORED or (id(obj), name) in skip:
                continue
            if isinstance(value, _SCALARS):
                out[id(obj), name] = _Value(f"`{prefix}.{name}`", obj, name, "value", value)
            elif isinstance(value, _SEQUENCES):
                out[id(obj), name] = _Value(f"`{prefix}.{name}`", obj, name, "items", _items(value))
            elif isinstance(value, dict) and (
                not value or any(isinstance(v, _SEQUENCES) for v in value.values())
            ):
                # per-key outputs (`self.outputs["loss"].append(x)`, a defaultdict(list), empty until
                # the first step's append makes its entry): which object each key holds, and the
                # elements of each list or deque among them
                label = f"`{prefix}.{name}`"
                out[id(obj), name] = _Value(label, obj, name, "entries", (value, tuple(value.items())))
                for key, held in value.items():
                    if isinstance(held, _SEQUENCES):
                        out[id(obj), name, key] = _Value(
                            f"`{prefix}.{name}[{key!r}]`", obj, name, "items", _items(held), key
                        )
            elif tracks_tensors and isinstance(value, dict) and _tensor_entries(value):
                # tensors a step keeps by key (`self.feats[name] = out` in a forward hook): which
                # tensor each key holds, rebound each step like a tensor attribute (carried state)
                for key, held in value.items():
                    kind = "tensor" if isinstance(held, torch.Tensor) else "tensors"
                    out[id(obj), name, key] = _Value(
                        f"`{prefix}.{name}[{key!r}]`", obj, name, kind, held, key
                    )
            elif isinstance(value, dict) and (entries := frozen(value)) is not None:
                # a small dict of numbers (`self.stats["n"] += 1`): (what to compare, what to restore)
                out[id(obj), name] = _Value(f"`{prefix}.{name}`", obj, name, "dict", (entries, dict(value)))
            elif tracks_tensors and isinstance(value, torch.Tensor):
                out[id(obj), name] = _Value(f"`{prefix}.{name}`", obj, name, "tensor", value)
            elif tracks_tensors and _tensor_tuple(value):
                # an LSTM's (h, c) kept on the module: rebound each step, like a tensor (carried state)
                out[id(obj), name] = _Value(f"`{prefix}.{name}`", obj, name, "tensors", value)
            elif (state := _held_generator_state(value)) is not None:
                # a random generator of the step's own (`self.rng = random.Random(0)`): a draw that
                # only steers a rarely taken branch leaves the traced steps alike, so its state is
                # what shows that the step draws from it
                out[id(obj), name] = _Value(
                    f"`{prefix}.{name}`{HELD_GENERATOR_SUFFIX}", obj, name, "held_rng", state
                )
        if tracks_tensors:
            # `self.running = 0.9 * self.running + ...`: a new tensor bound each step. The graph keeps
            # reading the tensor it was captured with, so the value would stop moving.
            for store in ("_buffers", "_parameters"):
                for name, value in (attributes.get(store) or {}).items():
                    if isinstance(value, torch.Tensor) and (id(obj), name) not in skip:
                        out[id(obj), name] = _Value(f"`{prefix}.{name}`", obj, name, "tensor", value)
    return out


def _items(container: list | deque) -> tuple[Any, tuple, int | None]:
    """(the list or deque, its elements, its maxlen): the elements themselves, held, so that while
    the snapshot lives no other object takes the id of one the step removes."""
    return container, tuple(container), container.maxlen if isinstance(container, deque) else None


def host_tensors(objects: Iterable[tuple[str, Any]]) -> dict[int, str]:
    """The host (CPU) tensors `objects` hold as attributes (:func:`own_attributes`) or buffers, by storage, with their
    labels (`` `self.seen` ``). A step training on a GPU that changes one in place changes it only in
    its eager steps: a replay runs the GPU's work alone. Metrics' states are the metric binding's."""
    found: dict[int, str] = {}
    for prefix, obj in objects:
        attributes = getattr(obj, "__dict__", None)
        if not attributes or _is_metric(obj):
            continue
        held = list((attributes.get("_buffers") or {}).items())  # first: a view's owner names it
        held += own_attributes(obj)
        for name, value in held:
            if (
                isinstance(value, torch.Tensor)
                and value.device.type == "cpu"
                and value.layout == torch.strided  # a sparse one has no storage to name
                and value.numel() > 0
            ):
                found.setdefault(value.untyped_storage().data_ptr(), f"`{prefix}.{name}`")
    return found


def _held_generator_state(value: Any) -> tuple[Any, Any] | None:
    """(what to compare, what to restore: the generator and its state) of a random generator object
    held in an attribute: Python's ``random.Random``, NumPy's ``Generator`` or ``RandomState``, a CPU
    ``torch.Generator``; else None."""
    if isinstance(value, random.Random):
        state = value.getstate()
        return state, (value, state)
    if isinstance(value, torch.Generator):
        if value.device.type != "cpu":
            return None  # the step tracer refuses a draw from a device generator of the step's own
        state = value.get_state()
        return bytes(state.numpy()), (value, state)
    numpy = sys.modules.get("numpy")
    if numpy is None:
        return None
    if isinstance(value, numpy.random.Generator):
        state = value.bit_generator.state
        return repr(state), (value, state)
    if isinstance(value, numpy.random.RandomState):
        state = value.get_state()
        return (state[0], state[1].tobytes(), *state[2:]), (value, state)
    return None


def _set_held_generator_state(saved: tuple[Any, Any]) -> None:
    """Put a held generator's state back, into the generator it was read from (the attribute may hold
    another object by now)."""
    generator, state = saved
    if isinstance(generator, random.Random):
        generator.setstate(state)
    elif isinstance(generator, torch.Generator):
        generator.set_state(state)
    elif hasattr(generator, "bit_generator"):
        generator.bit_generator.state = state
    else:
        generator.set_state(state)


def _is_metric(obj: Any) -> bool:
    metric = metric_type()
    return metric is not None and isinstance(obj, metric)


def _changes(before: Snapshot, after: Snapshot) -> list[tuple[_Value | None, _Value]]:
    """(before, after) of every entry that differs: set, changed, grown or shrunk, rebound, or removed
    (then `after` is the entry as it was)."""
    found = []
    for key, now in after.items():
        then = before.get(key)
        if now.kind == "tensor" and now.value.requires_grad:
            # recomputed from the parameters in every forward (weight_norm's `weight`): the graph
            # recomputes it too; a running value that a replay would freeze is detached
            continue
        if now.kind == "tensors" and any(t.requires_grad for t in leaves(now.value)):
            continue  # the same, for a tuple (a recurrent state that carried_state replays)
        if then is None or then.kind != now.kind or _differs(then.value, now.value, now.kind):
            found.append((then, now))
    found += [(None, then) for key, then in before.items() if key not in after]
    return found


def changed(before: Snapshot, after: Snapshot) -> list[str]:
    """Labels of the attributes that differ between snapshots (see :func:`_changes`)."""
    return sorted({now.label for _, now in _changes(before, after)})


def _tensor_entries(mapping: dict) -> bool:
    """Whether `mapping` is a non-empty dict of at most :data:`MAX_TENSOR_ENTRIES` tensors or tuples of
    tensors."""
    return 0 < len(mapping) <= MAX_TENSOR_ENTRIES and all(
        isinstance(v, torch.Tensor) or _tensor_tuple(v) for v in mapping.values()
    )


# The most entries a dict of tensors may hold to have each one followed (a dict keyed by something
# that grows per step is another idiom: its keys are compared as the step's Python state elsewhere)
MAX_TENSOR_ENTRIES = 64


def _tensor_tuple(value: Any) -> bool:
    """Whether `value` is a non-empty tuple of tensors (nested tuples too): an LSTM's ``(h, c)``."""
    return isinstance(value, tuple) and bool(value) and leaves(value) is not None


def leaves(value: Any) -> list[torch.Tensor] | None:
    """The tensors of a tensor or a tuple of tensors (nested tuples too), in order; None otherwise."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, tuple) and value:
        out: list[torch.Tensor] = []
        for v in value:
            inner = leaves(v)
            if inner is None:
                return None
            out += inner
        return out
    return None


def rebound_tensors(before: Snapshot, after: Snapshot) -> list[tuple[_Value, _Value]]:
    """(before, after) of each plain attribute holding a tensor or a tuple of tensors that the step
    rebound (the candidates for carried state, :func:`l2lightning.graph.carried_state.carried_attributes`)."""
    found = []
    for key, now in after.items():
        then = before.get(key)
        if (
            then is not None
            and now.kind in ("tensor", "tensors")
            and then.kind == now.kind
            and then.value is not now.value
            and now.name in getattr(now.owner, "__dict__", {})  # not a buffer or a parameter
        ):
            found.append((then, now))
    return found


def _differs(a: Any, b: Any, kind: str = "value") -> bool:
    if kind in ("rng", "dict", "held_rng"):
        return a[0] != b[0]
    if kind == "items":  # another list or deque, or other elements
        return a[0] is not b[0] or not _same_objects(a[1], b[1])
    if kind == "entries":  # another dict, or keys added, removed or bound to other objects
        return a[0] is not b[0] or len(a[1]) != len(b[1]) or not _same_entries(a[1], b[1])
    if kind == "tensors":
        return a is not b  # rebound
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return a is not b  # rebound, not changed in place
    if type(a) is not type(b):
        return True
    if isinstance(a, (float, *NUMPY_SCALARS)) and bool(a != a):  # NaN: unchanged if it is still NaN
        return not bool(b != b)
    try:
        return bool(a != b)
    except Exception:  # a held object's own `__eq__` that cannot tell (returns an array, raises): changed
        return True


@dataclass(frozen=True)
class Append:
    """A list or deque the step appends one element to: an attribute (``self.training_step_outputs.append(x)``,
    ``self.recent.append(x)`` to a ``deque(maxlen=4)``) or an entry of the dict an attribute holds
    (``self.outputs["loss"].append(x)``, `key` its key)."""

    label: str
    owner: Any
    name: str
    key: Any = NO_KEY
    # the ids of the tensors it held before the step (alive as long as the snapshot that found them):
    # one a full deque dropped as the step appended is one of them
    earlier: frozenset[int] = field(default=frozenset(), compare=False, repr=False)

    def current(self) -> list | deque | None:
        """The list or deque the attribute or the dict's entry holds now (an epoch-end hook may have put
        a new one there, or cleared the dict); None where there is none: there, only the step's own code
        knows what it would append to (a defaultdict's factory, a ``setdefault``)."""
        value = getattr(self.owner, "__dict__", {}).get(self.name)
        if self.key is not NO_KEY:
            # `get`, not `[]`: a defaultdict's missing key is not made here
            value = value.get(self.key) if isinstance(value, dict) else None
        return value if isinstance(value, _SEQUENCES) else None


def read_appended_elements(appended: list[Append], read_ids: set[int]) -> list[str]:
    """Problems for the lists the step appends to whose earlier elements the step's ops read
    (``prev = self.history[-1]``; `read_ids`: the ids of the tensors the ops read, alive throughout
    the step as the list holds them, or the snapshot before it those a full deque dropped): a replay
    would read the element it was captured with forever, while an eager step reads the one the last
    step appended."""
    return [
        f"the step reads tensors of {a.label}, a list it appends to (`prev = self.history[-1]`): a replay runs "
        "no Python, so it would read the element it was captured with at every step; keep the value in "
        "a tensor the step updates in place"
        for a in appended
        if not a.earlier.isdisjoint(read_ids)
    ]


def split_appends(
    before: Snapshot, after: Snapshot, new_entries: bool = True
) -> tuple[list[Append], list[str]]:
    """The changes between snapshots, as lists and deques the step appended exactly one element to
    (:func:`_one_append`), and the labels of the other changes, which a replay cannot redo: among them
    a list or deque changed otherwise (a ``popleft``, ``extend``, ``insert`` or ``clear``) and a dict of
    lists that gained, lost or rebound a key.

    `new_entries`: whether a key the step adds to a dict of lists, holding a new list or deque with
    the one element it appended, counts as an append to that entry. In the warm-up it does: a
    ``defaultdict(list)``'s first ``self.outputs["loss"].append(x)`` makes the entry that the later
    steps append to, which then compare alike. At the capture it does not: its replays would append
    to that one entry at every step, where the step may make a new one each time
    (``self.per_batch[batch_idx] = [x]``)."""
    changes = _changes(before, after)
    made: set[tuple] = set()  # the snapshot keys of such entries
    grown: set[int] = set()  # the ids of the "entries" changes that made only those
    for then, now in changes if new_entries else ():
        if then is not None and then.kind == now.kind == "entries":
            keys = _made_entries(then.value, now.value)
            if keys is not None:
                made.update((id(now.owner), now.name, key) for key in keys)
                grown.add(id(now))
    appends, other = [], set()
    for then, now in changes:
        if then is not None and then.kind == now.kind == "items" and _one_append(then.value, now.value):
            earlier = frozenset(id(t) for t in then.value[1] if isinstance(t, torch.Tensor))
            appends.append(Append(now.label, now.owner, now.name, now.key, earlier))
        elif then is None and (id(now.owner), now.name, now.key) in made:
            appends.append(Append(now.label, now.owner, now.name, now.key))
        elif (then is None and now.key is not NO_KEY and now.kind == "items") or id(now) in grown:
            # a list added to or removed from its dict: the dict's own change names it (a dict of
            # tensors has no record of its own: its entries' changes name themselves)
            continue
        else:
            other.add(now.label)
    return appends, sorted(other)


def _made_entries(then: tuple, now: tuple) -> list | None:
    """The keys of an "entries" value `now` that `then`'s dict gained, each holding a new list or deque
    of one element, where that is all that changed (the same dict, its earlier entries the same); else None."""
    mapping, before = then
    after = now[1]
    if now[0] is not mapping or len(after) <= len(before) or not _same_entries(before, after[: len(before)]):
        return None
    earlier = {id(v) for _, v in before}
    added = after[len(before) :]
    if all(isinstance(v, _SEQUENCES) and len(v) == 1 and id(v) not in earlier for _, v in added):
        return [key for key, _ in added]
    return None


def _same_entries(a: tuple, b: tuple) -> bool:
    """Whether two dicts' (key, value) pairs, as many, are the same keys bound to the same objects (equal
    numbers; a tensor that requires grad is, as in :func:`_changes`, recomputed by the graph too)."""
    return all(
        ka is kb
        and (
            va is vb
            or (isinstance(va, _SCALARS) and not _differs(va, vb))
            or (isinstance(va, torch.Tensor) and isinstance(vb, torch.Tensor) and vb.requires_grad)
        )
        for (ka, va), (kb, vb) in zip(a, b)
    )


def _one_append(then: tuple, now: tuple) -> bool:
    """Whether the "items" value `now` is `then`'s container after one ``append``: the same list or
    deque, with its earlier elements (the same objects) and one more; a full deque with a `maxlen`
    drops its first element as it appends, and only such a one (an unbounded deque or a list that
    keeps its length had an element removed: a window kept by hand, which a replay's append would
    let grow). Any other change (a ``popleft``, ``appendleft``, ``extend`` or ``insert`` of more than
    the one element at the end, a ``clear``, another list bound) is not what a replay's append redoes.

    On a full bounded deque a ``popleft`` then an ``append`` leaves what one ``append`` leaves, and
    is taken for it: they differ only on a deque that is not full, which a step that pops before it
    appends would raise on once emptied (an epoch-end ``clear()``) unless it pops only when full."""
    container, before, maxlen = then
    if now[0] is not container:
        return False
    after = now[1]
    if len(after) == len(before) + 1:
        return _same_objects(after[:-1], before)
    return (
        maxlen is not None
        and 0 < maxlen == len(before) == len(after)
        and _same_objects(after[:-1], before[1:])
    )


def _same_objects(a: tuple, b: tuple) -> bool:
    return len(a) == len(b) and all(x is y for x, y in zip(a, b))


def restore(before: Snapshot) -> None:
    """Put the scalars and random states of `before` back, and its lists', deques' and dicts' contents
    (into the same objects, bound where they were: whoever else holds one sees it as it was)."""
    for entry in before.values():
        if entry.kind == "rng":
            if entry.name == "random":
                random.setstate(entry.value[1])
            elif entry.name == "torch":
                torch.default_generator.set_state(entry.value[1])
            elif "numpy" in sys.modules:
                sys.modules["numpy"].random.set_state(entry.value[1])
            continue
        attributes = getattr(entry.owner, "__dict__", {})
        if entry.kind == "held_rng":
            _set_held_generator_state(entry.value[1])
        elif entry.kind in ("tensor", "tensors") and entry.key is not NO_KEY:
            held = attributes.get(entry.name)
            if isinstance(held, dict):  # an entry of a dict of tensors, bound back in its dict
                held[entry.key] = entry.value
        elif entry.kind == "tensor":
            for store in (attributes.get("_buffers"), attributes.get("_parameters")):
                if store is not None and entry.name in store:
                    store[entry.name] = entry.value
                    break
            else:
                attributes[entry.name] = entry.value
        elif entry.kind in ("value", "tensors"):
            attributes[entry.name] = entry.value
        elif entry.kind == "dict":
            current = attributes.get(entry.name)
            if isinstance(current, dict):  # the same dict object, its entries as they were
                current.clear()
                current.update(entry.value[1])
            else:
                attributes[entry.name] = entry.value[1]
        elif entry.kind == "items":
            container, elements, _ = entry.value
            if entry.key is NO_KEY:  # an entry of a dict is bound back with its dict's entries
                attributes[entry.name] = container
            if isinstance(container, deque):  # a full one dropped what an aborted run appended past it
                container.clear()
                container.extend(elements)
            else:
                container[:] = elements
        elif entry.kind == "entries":
            mapping, items = entry.value
            attributes[entry.name] = mapping
            mapping.clear()  # the same dict object (a defaultdict keeps its factory), its entries as they were
            mapping.update(items)


def baked_scalars(
    module: Any, reads: Iterable[str], ran: set[int] | None = None
) -> list[tuple[dict, str, Any]]:
    """The Python numbers a captured step may have baked into its graph, to compare before each replay:
    the module's public scalar attributes that its step source reads (`reads`: ``loss * self.beta``),
    and every public scalar of its submodules but metrics (``nn.Dropout.p``) that the step called
    (`ran`: their ids; None for all). A submodule the step does not call (an EMA copy updated in
    ``on_train_batch_end``, with a counter of its own) is not checked. (attribute dict, name, value)."""
    checks, _ = _read_attributes(getattr(module, "__dict__", {}), reads)
    for attributes, held_name, held in _read_held_objects(module, reads, ran):
        # the object itself first: one a hook rebinds (`self.cfg = dataclasses.replace(self.cfg, w=0.5)`,
        # a frozen dataclass's only way to change) leaves the old one's values as they were; compared
        # with `==` (a dataclass's fields, another object's identity); a callable one is compared by
        # identity with the code the step calls (baked_callables)
        if not callable(held):
            checks.append((attributes, held_name, held))
        checks += [(vars(held), name, value) for name, value in _public(held, _BAKED)]
    for _, sub in module.named_modules():
        if sub is module or _is_metric(sub) or (ran is not None and id(sub) not in ran):
            continue
        for name, value in vars(sub).items():
            if name.startswith("_") or name in _IGNORED or name in _STRUCTURAL:
                continue
            if isinstance(value, _BAKED):
                checks.append((vars(sub), name, value))
    return checks


def _read_held_objects(
    module: Any, reads: Iterable[str], ran: set[int] | None
) -> list[tuple[dict, str, Any]]:
    """(the holder's attribute dict, the attribute, the object) for the plain objects
    (:func:`held_objects`) the step may read: those among the module's attributes its source reads
    (``self.criterion(pred, y)``), and those of the submodules it called; small ones only
    (:data:`MAX_HELD_SCALARS`)."""
    names = set(reads)
    found = [(vars(module), name, held) for name, held in held_objects(module) if name in names]
    for _, sub in module.named_modules():
        if sub is not module and not _is_metric(sub) and (ran is None or id(sub) in ran):
            found += [(vars(sub), name, held) for name, held in held_objects(sub)]
    return [found_ for found_ in found if len(_public(found_[2], _BAKED)) <= MAX_HELD_SCALARS]


def _public(obj: Any, kinds: tuple) -> list[tuple[str, Any]]:
    return [(n, v) for n, v in vars(obj).items() if not n.startswith("_") and isinstance(v, kinds)]


def _read_attributes(
    attributes: dict, names: Iterable[str]
) -> tuple[list[tuple[dict, str, Any]], list[tuple[dict, str, torch.Tensor]]]:
    """(scalar checks, tensor checks) for the public attributes among `names` that the step source
    reads from one object's `attributes` (a module's or a callback's ``__dict__``)."""
    scalars, tensors = [], []
    for name in sorted(set(names)):
        if name.startswith("_") or name in _IGNORED:
            continue
        value = attributes.get(name)
        if isinstance(value, _BAKED):
            scalars.append((attributes, name, value))
        elif isinstance(value, torch.Tensor):
            tensors.append((attributes, name, value))
    return scalars, tensors


# Sizes and switches of torch.nn layers that cannot change without changing their parameters' shapes
# or the layer's wiring: not worth a comparison before every replay (this check runs per step)
_STRUCTURAL = frozenset(
    {
        "in_features", "out_features", "in_channels", "out_channels", "num_embeddings", "embedding_dim",
        "padding_idx", "num_features", "affine", "track_running_stats", "inplace", "elementwise_affine",
        "groups", "padding_mode", "batch_first", "num_layers", "hidden_size", "input_size", "bidirectional",
        "proj_size", "embed_dim", "num_heads", "kdim", "vdim", "head_dim", "sparse", "scale_grad_by_freq",
    }
)  # fmt: skip


def baked_tensors(
    module: Any, reads: Iterable[str], ran: set[int] | None = None
) -> list[tuple[dict, str, torch.Tensor]]:
    """The tensors a captured step reads from plain attributes (not parameters or buffers, whose
    registrations :class:`~l2lightning.guards.module_flags.ModuleFlags` counts): the module's public tensor
    attributes that its step source reads (``loss * self.weight``), and every public tensor attribute
    of the submodules but metrics that the step called (`ran`, as in :func:`baked_scalars`). A graph
    keeps reading the tensor it was captured with, so ``self.weight = self.weight * 0.9`` between
    steps must be seen before the next replay. (attribute dict, name, tensor)."""
    _, checks = _read_attributes(getattr(module, "__dict__", {}), reads)
    for _, _, held in _read_held_objects(module, reads, ran):
        checks += [(vars(held), name, value) for name, value in _public(held, (torch.Tensor,))]
    for _, sub in module.named_modules():
        if sub is module or _is_metric(sub) or (ran is not None and id(sub) not in ran):
            continue
        for name, value in vars(sub).items():
            if not name.startswith("_") and isinstance(value, torch.Tensor):
                checks.append((vars(sub), name, value))
    return checks


def baked_callables(
    module: Any, reads: Iterable[str], ran: set[int] | None = None, skip: Iterable[str] = ()
) -> list[tuple[dict, str, Any]]:
    """The code a captured step calls through attributes, to compare by identity before each replay:
    the module's attributes that its step source reads and that hold a function or another callable
    (``self.loss_fn = F.l1_loss``, a ``functools.partial``), and every binding of a submodule the step
    called (`ran`, as in :func:`baked_scalars`) in its parent (``self.criterion = nn.HuberLoss(0.5)``,
    ``self.act = nn.GELU()``), and the public callables such a submodule holds itself (``self.act =
    torch.tanh`` in a custom layer). A graph replays the ops of the code it was captured with; one rebound
    between steps (an epoch-start hook switching the loss) must be seen, or the replays keep the old
    one. `skip`: attributes that are not the user's (the callback's own overrides). (attribute dict,
    name, object)."""
    attributes = getattr(module, "__dict__", {})
    checks = [
        (attributes, name, value)
        for name in sorted(set(reads) - set(skip))
        if not name.startswith("_")
        and callable(value := attributes.get(name))
        and not isinstance(value, type)
    ]
    for name in sorted(set(reads) - set(skip)):
        if not name.startswith("_"):
            checks += _held_code(attributes, name)
    for parent in module.modules():
        for name, child in vars(parent).get("_modules", {}).items():
            if child is not None and (ran is None or id(child) in ran):
                checks.append((parent._modules, name, child))
        if parent is module or (ran is not None and id(parent) not in ran):
            continue
        # a layer's own callables (`self.act = torch.tanh` in a custom layer, swapped by an epoch hook)
        attributes = vars(parent)
        checks += [
            (attributes, name, value)
            for name, value in attributes.items()
            if not name.startswith("_")
            and callable(value)
            and not isinstance(value, (type, torch.nn.Module, torch.Tensor))
        ]
    return checks


# The most modules, functions and their tensors kept in one container attribute that are compared
# before each replay (a teacher or an old policy kept out of the module tree: `self.teacher_box = [t]`)
MAX_HELD_CODE = 256


class _Held:
    """Entries of a container attribute (by key, or a list's or tuple's by position) or a held module's
    parameters, read with the ``get`` of a dict for :func:`rebound`: an entry a hook replaces
    (``self.teacher_box[0] = copy.deepcopy(self.net)``) reads as another object, one removed as None;
    `label` names where it is (```self.teacher_box```) in :func:`rebound`'s names."""

    __slots__ = ("items", "label", "tensors")

    def __init__(self, items: Any, label: str, tensors: bool = False) -> None:
        self.items, self.label, self.tensors = items, label, tensors

    def name(self, key: Any) -> str:
        """How :func:`rebound` names the entry `key`: ``self.teacher_box[0]``, ``self.aux['t'].weight``."""
        return f"{self.label}.{key}" if self.tensors else f"{self.label}[{key!r}]"

    def get(self, key: Any, default: Any = None) -> Any:
        items = self.items
        if isinstance(items, dict):
            return items.get(key, default)
        return items[key] if key < len(items) else default


def _held_code(attributes: dict, name: str) -> list[tuple[Any, str, Any]]:
    """Checks for the modules and functions a list, tuple or dict attribute holds (``self.teacher_box =
    [teacher]``, ``self.aux = {"teacher": t}``: a module kept out of the module tree, so out of its
    parameters, state_dict and the checks of its registered tensors): the container itself, each of
    those entries, and each parameter and buffer of such a module. A graph replays the capture's
    modules and reads their tensors at the capture's addresses: a teacher refreshed by a deepcopy
    mid-epoch, or a parameter of it rebound, must be seen. Empty where there is none, or too many
    (:data:`MAX_HELD_CODE`)."""
    held = attributes.get(name)
    if isinstance(held, dict):
        items = list(held.items())
    elif isinstance(held, (list, tuple)):
        items = list(enumerate(held))
    else:
        return []
    entries = _Held(held, f"self.{name}")
    if len(items) > MAX_HELD_CODE:
        return []
    code = [(key, item) for key, item in items if isinstance(item, torch.nn.Module) or _is_code(item)]
    if not code:
        return []
    checks: list[tuple[Any, str, Any]] = [(attributes, name, held)]
    checks += [(entries, key, item) for key, item in code]
    for key, item in code:
        if not isinstance(item, torch.nn.Module):
            continue
        for path, sub in item.named_modules():
            where = f"self.{name}[{key!r}]{'.' if path else ''}{path}"
            for kind in ("_parameters", "_buffers"):
                tensors = vars(sub).get(kind, {})
                held_tensors = _Held(tensors, where, tensors=True)
                checks += [(held_tensors, tensor_name, t) for tensor_name, t in tensors.items()]
            if len(checks) > MAX_HELD_CODE:
                return checks[: len(code) + 1]  # the entries alone: their tensors are too many to compare
    return checks


def _is_code(value: Any) -> bool:
    return callable(value) and not isinstance(value, (type, torch.Tensor))


def baked_callback_attributes(
    callback_reads: Iterable[tuple[Any, set[str]]],
) -> tuple[list[tuple[dict, str, Any]], list[tuple[dict, str, torch.Tensor]]]:
    """(scalar checks, tensor checks) for the public attributes of the Trainer's other callbacks that
    their hooks inside the captured step read (``p.grad.mul_(self.scale)``): baked into the graph
    like the module's own (:func:`baked_scalars`, :func:`baked_tensors`)."""
    scalars, tensors = [], []
    for cb, names in callback_reads:
        more_scalars, more_tensors = _read_attributes(vars(cb), names)
        scalars += more_scalars
        tensors += more_tensors
    return scalars, tensors


def baked_optimizer_attributes(
    optimizers: Iterable[tuple[str, Any]],
) -> tuple[list[tuple[dict, str, Any]], list[tuple[dict, str, torch.Tensor]]]:
    """(scalar checks, tensor checks) for the attributes of the user's own optimizers
    (:func:`optimizer_owners`) that are Python numbers or tensors: their ``step`` runs inside the
    captured step, so what it reads of them (``p.mul_(self.shrink)``, ``if self.warm:``) is baked into
    the graph like the module's own numbers (:func:`baked_scalars`, :func:`baked_tensors`); a callback
    that changes one between steps must capture again."""
    scalars, tensors = [], []
    for _, optimizer in optimizers:
        attributes = vars(optimizer)
        for name, value in own_attributes(optimizer):
            if isinstance(value, _BAKED):
                scalars.append((attributes, name, value))
            elif isinstance(value, torch.Tensor):
                tensors.append((attributes, name, value))
    return scalars, tensors


@dataclass
class BakedGlobals:
    """What a captured step read from module globals, to compare before each replay."""

    scalars: list[tuple[dict, str, Any]]
    tensors: list[tuple[dict, str, torch.Tensor]]
    # small lists, tuples and dicts of Python scalars and tensors (``CONFIG["w"]``), as step_values.frozen
    # snapshots (tensors by identity)
    containers: list[tuple[dict, str, Any]]
    # functions and other callables (``LOSS_FN = focal_loss``), compared by identity
    callables: list[tuple[dict, str, Any]]


def baked_globals(global_reads: Iterable[tuple[Any, set[str]]]) -> BakedGlobals:
    """The module-level names the step source reads (``loss * LOSS_WEIGHT``, ``if USE_AUX:``,
    ``CONFIG["w"]``): a number, a flag or the entries of a small container are baked into the graph
    and a tensor's address is, so a new value between steps must capture again; a function or other
    callable read by name is compared by identity (the graph replays the one it was captured with).
    Modules, classes and large containers read by name are not followed. `global_reads`: (namespace, names),
    the namespace a function's ``__globals__`` or its closure variables
    (:class:`l2lightning.guards.step_source.ClosureCells`)."""
    baked = BakedGlobals([], [], [], [])
    for namespace, names in global_reads:
        for name in sorted(names):
            if name.startswith("__") or name not in namespace:
                continue  # dunders, builtins and closure variables are not the module's globals
            value = namespace[name]
            if isinstance(value, _BAKED):
                baked.scalars.append((namespace, name, value))
            elif isinstance(value, torch.Tensor):
                baked.tensors.append((namespace, name, value))
            elif (
                isinstance(value, (list, tuple, dict))
                and (snapshot := frozen(value, tensors=True)) is not None
            ):
                baked.containers.append((namespace, name, snapshot))
            elif callable(value) and not isinstance(value, type):
                baked.callables.append((namespace, name, value))
    return baked


def changed_containers(checks: list[tuple[dict, str, Any]]) -> list[str]:
    """Names of the containers in `checks` (:attr:`BakedGlobals.containers`) whose entries changed."""
    return [
        name for namespace, name, snapshot in checks if frozen(namespace.get(name), tensors=True) != snapshot
    ]


def rebound(checks: list[tuple[dict, str, Any]], module: Any = None) -> list[str]:
    """Names of the attributes in `checks` (from :func:`baked_tensors`, :func:`baked_callables`) that
    hold another object now; given the `module`, a submodule's attribute is named by its path in it
    (``net.0.weight``, not a bare ``weight`` per pruned layer)."""
    found = [(attributes, name) for attributes, name, held in checks if attributes.get(name) is not held]
    # a container's entry or a held module's tensor (_held_code): `self.teacher_box[0]`, `self.aux['t'].weight`
    found = [(a, a.name(name)) if isinstance(a, _Held) else (a, name) for a, name in found]
    if not found or module is None:
        return [name for _, name in found]
    paths = {id(vars(sub)): path for path, sub in module.named_modules() if path}
    return [f"{paths[id(a)]}.{name}" if id(a) in paths else name for a, name in found]


def addresses(checks: list[tuple[dict, str, torch.Tensor]]) -> tuple:
    """The memory each tensor of `checks` (:func:`baked_tensors`) holds now: a graph reads a tensor at
    its capture's address, and ``t.data = other`` or ``t.set_(other)`` keeps the object but moves it."""
    return _addresses([tensor for _, _, tensor in checks])


def moved(checks: list[tuple[dict, str, torch.Tensor]], captured: tuple) -> list[str]:
    """Names of the tensors in `checks` whose memory is not their :func:`addresses` at capture."""
    return [name for (_, name, tensor), then in zip(checks, captured) if address(tensor) != then]


def partial_bindings(callables: list[tuple[dict, str, Any]]) -> list[tuple[dict, str, Any]]:
    """(attribute dict, name, snapshot) for each ``functools.partial`` among `callables` (from
    :func:`baked_callables`, :func:`baked_globals`): the arguments it binds
    (``partial(F.smooth_l1_loss, beta=1.0)``) reach the graph like the step's own numbers, and a keyword
    changed in place (``self.loss_fn.keywords["beta"] = 0.5``) leaves the partial the same object.
    Snapshots as :func:`l2lightning.guards.step_values.frozen` (tensors by identity); a partial binding anything
    else (a module) is left out."""
    out = []
    for attributes, name, held in callables:
        if isinstance(held, functools.partial) and (snapshot := _bound(held)) is not None:
            out.append((attributes, name, snapshot))
    return out


def changed_partial_bindings(checks: list[tuple[dict, str, Any]]) -> list[str]:
    """Names of the partials in `checks` (:func:`partial_bindings`) whose bound arguments changed."""
    return [
        name
        for attributes, name, snapshot in checks
        if isinstance(held := attributes.get(name), functools.partial) and _bound(held) != snapshot
    ]


def _bound(partial: functools.partial) -> Any:
    return frozen(partial_arguments(partial), tensors=True)


def unique_checks(checks: list[tuple[Any, str, Any]]) -> list[tuple[Any, str, Any]]:
    """`checks` (attribute dict, name, value) with each (dict, name) once, the first kept."""
    seen: set[tuple[int, str]] = set()
    out = []
    for check in checks:
        key = (id(check[0]), check[1])
        if key not in seen:
            seen.add(key)
            out.append(check)
    return out


def changed_scalars(checks: list[tuple[dict, str, Any]]) -> list[str]:
    """Names of the scalars in `checks` whose value is not the one recorded."""
    missing = object()
    return [
        name
        for attributes, name, value in checks
        if (now := attributes.get(name, missing)) is not value and _differs(value, now)
    ]
