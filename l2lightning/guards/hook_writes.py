"""Whether a hook's own code may write anything: read from its source, not from one run of it.

A hook inside the step that turns tensors into host values (Lightning's ``grad_norm`` in
``on_before_optimizer_step``) cannot be in the graph; the callback runs it after each replay instead,
where it sees what it would see in an eager step, as long as it only reads. A warm-up step's trace
shows what the hook wrote in that step, not what it may write in another: the common guard that skips
the update on non-finite gradients (``if not torch.isfinite(g).all(): optimizer.zero_grad()``) writes
only on the step whose batch is bad, and run after a replay it would zero the gradients after the
update has used them (found by the held-out idiom hunt: every later loss NaN, with no warning).

So a hook runs after replays only if its source, and the source of the user's own functions and
methods it calls, holds nothing that may write: an assignment, augmented assignment or ``del`` whose
target is not a plain local name (``self.x = ...``, ``p.grad = None``, ``d[k] = v``), a call of a
method or function that writes by its name (``zero_grad``, ``step``, ``backward``, a torch in-place
method or function ending in ``_`` such as ``clip_grad_value_`` or ``mul_``, ``setattr``,
``load_state_dict``, ...), and a call the analysis cannot follow into code of the user's own
(``self.helper.update(x)`` on an object it cannot resolve) is taken as one that may write. Library
code is trusted to read only unless its name says it writes. Where the source cannot be read the
answer is "may write": the hook stays out of the after-replay path.
"""

from __future__ import annotations

import ast
import builtins
import inspect
import textwrap
import types
from collections.abc import Callable
from typing import Any

from l2lightning.guards.step_source import _is_user_code

# names of calls that write whatever they are called on (besides the in-place `name_` convention)
_WRITING_CALLS = frozenset(
    {
        "zero_grad",
        "step",
        "backward",
        "manual_backward",
        "clip_gradients",
        "setattr",
        "delattr",
        "load_state_dict",
        "register_buffer",
        "register_parameter",
        "add_module",
        "update",
        "append",
        "extend",
        "insert",
        "pop",
        "popitem",
        "clear",
        "remove",
        "setdefault",
        "appendleft",
        "extendleft",
        "popleft",
        "requires_grad_",
        "train",
        "eval",
        "toggle_optimizer",
        "untoggle_optimizer",
    }
)
# how deep the analysis follows the user's own functions from the hook
_MAX_DEPTH = 3
# what a hook may call on its module and is taken as output, not a write: logging and printing
_OUTPUT_ATTRIBUTES = frozenset({"log", "log_dict", "logger", "loggers", "print"})
# constructors of containers: a local name bound to one holds the hook's own object, whose writes
# (`norms[name] = value`, `values.append(v)`) stay inside the hook
_FRESH_CONTAINERS = frozenset({"dict", "list", "set", "OrderedDict", "defaultdict", "Counter", "deque"})


def possible_writes(hook: Callable[..., Any], owner: Any = None) -> list[str]:
    """What in `hook`'s code (bound to `owner`, whose methods it may call through ``self``) may write,
    each as ``source at file:line (why)``, the source line in backticks; empty when nothing may."""
    found: list[str] = []
    _scan(hook, owner, found, set(), 0)
    return found


def _scan(fn: Any, owner: Any, found: list[str], seen: set[int], depth: int) -> None:
    fn = inspect.unwrap(getattr(fn, "__func__", fn))
    if id(fn) in seen or not isinstance(fn, types.FunctionType):
        return
    seen.add(id(fn))
    code = fn.__code__
    try:
        lines, first = inspect.getsourcelines(fn)
        tree = ast.parse(textwrap.dedent("".join(lines)))
    except (OSError, TypeError, SyntaxError):
        found.append(f"{code.co_filename}:{code.co_firstlineno} (its source cannot be read)")
        return
    if not tree.body or not isinstance(tree.body[0], (ast.FunctionDef, ast.AsyncFunctionDef)):
        found.append(f"{code.co_filename}:{code.co_firstlineno} (its source is not a function definition)")
        return
    scan = _FunctionScan(fn, owner, tree.body[0], lines, first)
    for node in ast.walk(tree.body[0]):
        why = scan.writes(node)
        if why:
            found.append(scan.describe(node, why))
        if isinstance(node, ast.Call):
            callee = scan.user_callee(node)
            if callee is not None and depth < _MAX_DEPTH:
                _scan(callee, owner, found, seen, depth + 1)


class _FunctionScan:
    """One function's source, read for writes."""

    def __init__(
        self, fn: types.FunctionType, owner: Any, node: ast.AST, lines: list[str], first: int
    ) -> None:
        self.fn, self.owner, self.lines, self.first = fn, owner, lines, first
        args = node.args
        params = [a.arg for a in (*args.posonlyargs, *args.args)]
        # the module the hook belongs to: calls through it resolve on `owner`
        self.self_name = params[0] if params and owner is not None else None
        self.fresh = _fresh_locals(node)

    def describe(self, node: ast.AST, why: str) -> str:
        row = getattr(node, "lineno", 1)
        text = self.lines[row - 1].strip() if 0 < row <= len(self.lines) else ""
        return f"`{text}` at {self.fn.__code__.co_filename}:{self.first + row - 1} ({why})"

    def writes(self, node: ast.AST) -> str | None:
        """Why `node` may write, or None."""
        if isinstance(node, (ast.Global, ast.Nonlocal)):
            return f"it rebinds `{', '.join(node.names)}` outside the function"
        targets: list[ast.AST] = []
        if isinstance(node, ast.Assign):
            targets = list(node.targets)
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            targets = [node.target]
        elif isinstance(node, ast.Delete):
            targets = list(node.targets)
        for target in targets:
            for part in ast.walk(target):
                if (
                    isinstance(part, (ast.Attribute, ast.Subscript))
                    and isinstance(part.ctx, (ast.Store, ast.Del))
                    and _root(part) not in self.fresh
                ):
                    return "it writes an attribute or an item"
        if isinstance(node, ast.Call):
            name = _call_name(node.func)
            if name is None or _root(node.func) in self.fresh:
                return None
            if name in _WRITING_CALLS or (name.endswith("_") and not name.endswith("__")):
                return f"`{name}` writes"
            if self._callee(node.func) is _UNRESOLVED and self._through_self(node.func):
                return f"it calls `{ast.unparse(node.func)}`, code the analysis cannot follow"
        return None

    def user_callee(self, node: ast.Call) -> Any:
        """The user's own function `node` calls (its code is read too), or None."""
        callee = self._callee(node.func)
        if callee is _UNRESOLVED or callee is None:
            return None
        callee = getattr(callee, "__func__", callee)
        return callee if isinstance(callee, types.FunctionType) and _is_user_code(callee) else None

    def _through_self(self, func: ast.AST) -> bool:
        """A call through the module (`self.tracker.update(x)`), other than its logging and printing."""
        chain = _chain(func)
        return (
            bool(chain)
            and chain[0] == self.self_name
            and (len(chain) < 2 or chain[1] not in _OUTPUT_ATTRIBUTES)
        )

    def _callee(self, func: ast.AST) -> Any:
        """The object `func` names, through the function's globals or the module; _UNRESOLVED if not."""
        chain = _chain(func)
        if not chain:
            return _UNRESOLVED
        head, attrs = chain[0], chain[1:]
        if head == self.self_name:
            obj = self.owner
        elif head in self.fn.__globals__:
            obj = self.fn.__globals__[head]
        elif hasattr(builtins, head):
            return None if not attrs else _UNRESOLVED  # `all`, `len`, `print`: builtins read only
        else:
            return _UNRESOLVED  # a local name: what it holds is known only at run time
        for attr in attrs:
            try:
                obj = inspect.getattr_static(obj, attr)
            except AttributeError:
                return _UNRESOLVED
            if isinstance(obj, (staticmethod, classmethod)):
                obj = obj.__func__
        return obj


_UNRESOLVED = object()


def _chain(node: ast.AST) -> list[str]:
    """`a.b.c` as ["a", "b", "c"]; [] when its root is not a name (`f().g`, `x[0].h`)."""
    attrs: list[str] = []
    while isinstance(node, ast.Attribute):
        attrs.append(node.attr)
        node = node.value
    return [node.id, *reversed(attrs)] if isinstance(node, ast.Name) else []


def _root(node: ast.AST) -> str | None:
    """The name an attribute, item or call target hangs from (`norms` of `norms[k].x`), or None."""
    while isinstance(node, (ast.Attribute, ast.Subscript, ast.Call)):
        node = node.func if isinstance(node, ast.Call) else node.value
    return node.id if isinstance(node, ast.Name) else None


def _call_name(func: ast.AST) -> str | None:
    if isinstance(func, ast.Attribute):
        return func.attr
    return func.id if isinstance(func, ast.Name) else None


def _fresh_locals(function: ast.AST) -> set[str]:
    """Local names bound only to containers the function makes itself (`norms = {}`, `out = list()`)."""
    fresh: set[str] = set()
    other: set[str] = set()
    for node in ast.walk(function):
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            value = node.value
            made = isinstance(
                value, (ast.Dict, ast.List, ast.Set, ast.DictComp, ast.ListComp, ast.SetComp)
            ) or (isinstance(value, ast.Call) and _call_name(value.func) in _FRESH_CONTAINERS)
            (fresh if made else other).add(node.targets[0].id)
        elif isinstance(
            node, (ast.For, ast.comprehension, ast.With, ast.AugAssign, ast.AnnAssign, ast.NamedExpr)
        ):
            for target in ast.walk(getattr(node, "target", node)):
                if isinstance(target, ast.Name) and isinstance(target.ctx, ast.Store):
                    other.add(target.id)
    return fresh - other
