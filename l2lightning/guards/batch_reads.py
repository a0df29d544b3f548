"""Which parts of the batch the step's code can read, from ``training_step``'s source.

A batch often carries values besides its tensors: file names, sample ids, a text column, a per-batch
number. They differ from batch to batch, and a replay runs no Python, so a step whose code reads
them must run eagerly (the callback compares every non-tensor value of the batch before a replay).
Most steps never read them: ``x, y, paths = batch`` and ``paths`` is not used again, or
``batch["x"]`` and ``batch["y"]`` are the only keys read. :func:`batch_reads` reads the source for
what the step does read, and :meth:`BatchReads.unread_parts` names the top-level parts of a batch it
does not (an index of a tuple or list, a key of a mapping, a field of a namedtuple or dataclass);
their non-tensor values are then left out of the comparison, so the step is captured and replayed
while they change (their tensors are still copied into the graph's buffers, unread or not).

The reading is conservative: any use of the batch it cannot follow (the batch passed to a function
that is not one of the module's own methods, stored, returned, iterated, ``len(batch)``, ``locals()``
in the step, a ``*args`` parameter, source that cannot be read) makes every part count as read, and
a name bound by unpacking counts as read wherever that name is loaded in the function. Methods of the
module the batch is passed to (``self.model_step(batch)``, ``super().training_step(batch, i)``) are
read the same way, three calls deep; ``super(Other, self)`` calls and methods shadowed by an instance
attribute are not followed (the code read would not be the code that runs).
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import textwrap
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

# every part may be read: what any use that cannot be followed returns
EVERY_PART = None
# the names that let a function read its locals without naming them
_INTROSPECTION = {"locals", "vars", "eval", "exec", "globals"}
_MAX_DEPTH = 3


@dataclass(frozen=True)
class BatchReads:
    """What the step's code reads of its batch.

    ``items``: the constant indices and keys it subscripts the batch with (``batch[0]``,
    ``batch["x"]``, positions of an unpacking whose names are used); ``attributes``: the names it
    reads as attributes (``batch.x``); ``everything``: a use that could not be followed.
    """

    items: frozenset = frozenset()
    attributes: frozenset = frozenset()
    everything: bool = True
    # unread parts per batch layout (type, and length or keys): asked once per step, the same answer
    _by_layout: dict = dataclasses.field(default_factory=dict, compare=False, repr=False)

    def unread_parts(self, batch: Any) -> frozenset:
        """The top-level parts of `batch` (indices, or keys of a mapping) that the step never reads."""
        if self.everything:
            return frozenset()
        if isinstance(batch, Mapping):
            layout: Any = (type(batch), tuple(batch))
        elif isinstance(batch, (list, tuple)):
            layout = (type(batch), len(batch))
        else:
            layout = type(batch)
        parts = self._by_layout.get(layout)
        if parts is None:
            parts = self._by_layout[layout] = self._unread_parts(batch)
        return parts

    def _unread_parts(self, batch: Any) -> frozenset:
        if isinstance(batch, tuple) and hasattr(batch, "_fields"):  # namedtuple
            return self._unread_fields(list(batch._fields), items_allowed=True)
        if dataclasses.is_dataclass(batch) and not isinstance(batch, type):
            return self._unread_fields([f.name for f in dataclasses.fields(batch)], items_allowed=False)
        if self.attributes:  # a method of a list or dict (`batch.items()`) reads every part
            return frozenset()
        if isinstance(batch, (list, tuple)):
            read = self._positions_read(len(batch))
            return frozenset(i for i in range(len(batch)) if i not in read)
        if isinstance(batch, Mapping):
            if any(isinstance(i, int) and i not in batch for i in self.items):
                return frozenset()  # unpacked or indexed by position: a mapping of unusual iteration
            return frozenset(k for k in batch if k not in self.items)
        return frozenset()

    def _unread_fields(self, fields: list[str], items_allowed: bool) -> frozenset:
        if not self.attributes <= set(fields) or (self.items and not items_allowed):
            return frozenset()  # a method (`batch.to(device)`, `batch._asdict()`) reads every field
        read = self._positions_read(len(fields))
        return frozenset(i for i, name in enumerate(fields) if i not in read and name not in self.attributes)

    def _positions_read(self, n: int) -> set[int]:
        """The positions among `n` that the step's integer subscripts reach (``batch[-1]`` is ``n - 1``)."""
        return {i % n for i in self.items if isinstance(i, int) and -n <= i < n}


def batch_reads(module: Any) -> BatchReads:
    """What ``type(module).training_step`` reads of its batch argument (everything, if unsure)."""
    read = _reads_of_parameter(module, "training_step", 0, depth=0)
    if read is EVERY_PART:
        return BatchReads()
    items, attributes = read
    return BatchReads(frozenset(items), frozenset(attributes), everything=False)


def _function_ast(owner: type, name: str) -> ast.FunctionDef | ast.AsyncFunctionDef | None:
    """The parsed source of the plain method `name` defined in `owner` (None: not followed)."""
    function = vars(owner)[name]
    if not inspect.isfunction(function) or hasattr(function, "__wrapped__"):
        return None  # a staticmethod, a classmethod, a decorated or compiled function
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(function)))
    except (OSError, TypeError, SyntaxError):
        return None
    node = tree.body[0] if tree.body else None
    if (
        not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
        or node.name != name
        or node.decorator_list
    ):
        return None
    return node


def _reads_of_parameter(module: Any, name: str, position: int, depth: int, after: type | None = None) -> Any:
    """(items, attributes) read through positional parameter `position` (after ``self``) of method
    `name` as `module`'s class resolves it, or EVERY_PART. `after`: resolve it from the class after
    this one in the MRO (a ``super()`` call)."""
    if depth > _MAX_DEPTH:
        return EVERY_PART
    if after is None and depth > 0 and name in vars(module):
        return EVERY_PART  # an instance attribute in place of the method: not the class's code
    mro = type(module).__mro__
    start = mro.index(after) + 1 if after is not None and after in mro else 0
    owner = next((c for c in mro[start:] if name in vars(c)), None)
    func = _function_ast(owner, name) if owner is not None else None
    if func is None:
        return EVERY_PART
    args = func.args
    positional = [a.arg for a in (*args.posonlyargs, *args.args)]
    if len(positional) <= position + 1:
        return EVERY_PART  # the batch arrives in *args
    return _FunctionReads(module, owner, func, positional[position + 1], positional[0], depth).reads()


class _FunctionReads:
    """What the function `func` reads of its parameter `param`."""

    def __init__(
        self, module: Any, owner: type, func: ast.AST, param: str, self_name: str, depth: int
    ) -> None:
        self.module, self.owner, self.func = module, owner, func
        self.param, self.self_name, self.depth = param, self_name, depth
        self.parents: dict[int, ast.AST] = {}
        for node in ast.walk(func):
            for child in ast.iter_child_nodes(node):
                self.parents[id(child)] = node
        # every name loaded anywhere in the function (nested functions included): a name bound by
        # unpacking the batch counts as read if any of these is it
        self.loaded = {
            n.id for n in ast.walk(func) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)
        }

    def reads(self) -> Any:
        if self.loaded & _INTROSPECTION:
            return EVERY_PART
        items: set = set()
        attributes: set = set()
        for node in ast.walk(self.func):
            if not (isinstance(node, ast.Name) and node.id == self.param and isinstance(node.ctx, ast.Load)):
                continue
            use = self._use(node)
            if use is EVERY_PART:
                return EVERY_PART
            items |= use[0]
            attributes |= use[1]
        return items, attributes

    def _use(self, node: ast.Name) -> Any:
        parent = self.parents.get(id(node))
        if isinstance(parent, ast.Subscript) and parent.value is node and isinstance(parent.ctx, ast.Load):
            key = _constant_key(parent.slice)
            return EVERY_PART if key is None else ({key}, set())  # None: a slice, a computed key
        if isinstance(parent, ast.Attribute) and parent.value is node and isinstance(parent.ctx, ast.Load):
            return set(), {parent.attr}  # BatchReads decides per batch type whether it is a field
        if isinstance(parent, ast.Assign) and parent.value is node and len(parent.targets) == 1:
            target = parent.targets[0]
            if isinstance(target, (ast.Tuple, ast.List)):
                return self._unpacked(target)
            return EVERY_PART  # bound to another name: followed no further
        if isinstance(parent, ast.Call) and node in parent.args:
            return self._passed_to(parent, parent.args.index(node))
        return EVERY_PART

    def _unpacked(self, target: ast.Tuple | ast.List) -> Any:
        items: set = set()
        for i, element in enumerate(target.elts):
            names = [n.id for n in ast.walk(element) if isinstance(n, ast.Name)]
            used = not names or any(n in self.loaded for n in names)
            if isinstance(element, ast.Starred):
                # `x, y, *_ = batch`: the rest unread; a used or inner star's positions depend on the length
                if used or i != len(target.elts) - 1:
                    return EVERY_PART
            elif used:
                items.add(i)
        return items, set()

    def _passed_to(self, call: ast.Call, position: int) -> Any:
        """`self.method(..., batch, ...)` or `super().method(..., batch, ...)`: the method's reads."""
        func = call.func
        if not isinstance(func, ast.Attribute) or any(
            isinstance(a, ast.Starred) for a in call.args[:position]
        ):
            return EVERY_PART
        if isinstance(func.value, ast.Name) and func.value.id == self.self_name:
            return _reads_of_parameter(self.module, func.attr, position, self.depth + 1)
        if _is_super_call(func.value):
            return _reads_of_parameter(self.module, func.attr, position, self.depth + 1, after=self.owner)
        return EVERY_PART


def _constant_key(node: ast.AST) -> int | str | None:
    """``0``, ``-1`` or ``"x"`` as a subscript; None for anything else."""
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        inner = _constant_key(node.operand)
        return -inner if isinstance(inner, int) else None
    if isinstance(node, ast.Constant) and type(node.value) in (int, str):
        return node.value
    return None


def _is_super_call(node: ast.AST) -> bool:
    """``super()`` without arguments (``super(Other, self)`` may start anywhere in the MRO: not followed)."""
    return (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Name)
        and node.func.id == "super"
        and not node.args
        and not node.keywords
    )
