"""Every call into code compiled by ``torch.compile``, seen with its arguments, during a traced step.

The tracer sees compiled code as a whole, not its ops (``StepTracer.ignore_compile_internals``), so
what compiled code does with a host tensor is not traced: inductor turns a 0-d CPU tensor into a
number in its kernels' arguments, which a CUDA graph keeps from the capture. Submodules compiled with
``torch.compile(module)`` or ``module.compile()`` are watched through forward pre-hooks; a *function*
compiled with ``torch.compile`` has no hook. On the H200 a host temperature passed into
``@torch.compile def divided_by(pred, temperature)``, or read by such a function from its module's
globals, was captured once and every replay kept the capture's value while an epoch hook annealed it
(tests/gpu/test_callback_gpu.py; benchmarks/results/h200/pytest_gpu_run_ay.log).

Every compiled callable (function or module) is entered through dynamo's ``compile_wrapper``
(``torch/_dynamo/eval_frame.py``), whose first statement is ``prior = set_eval_frame(None)``, a
lookup of that name in the module's globals. :func:`watching_compiled_calls` puts a function of its
own under that name while a traced step runs, which reads the wrapper's frame (the compiled callable
``fn`` and the call's ``args`` and ``kwargs``) and hands them to the caller's check before calling
dynamo's own. Traced warm-up steps only: never a replay.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import sys
from collections.abc import Callable, Iterator
from typing import Any

import torch

# the compiled callable, its positional and keyword arguments
CompiledCallCheck = Callable[[Callable[..., Any], tuple, dict], None]

_WRAPPER_NAME = "compile_wrapper"


@contextlib.contextmanager
def watching_compiled_calls(check: CompiledCallCheck) -> Iterator[bool]:
    """Call `check(fn, args, kwargs)` at every call of a ``torch.compile``-d callable in this block.

    Yields whether the watch is in place: not when dynamo was never imported (then nothing is
    compiled) or its wrapper does not look up ``set_eval_frame`` as this was written against.
    """
    eval_frame = sys.modules.get("torch._dynamo.eval_frame")
    original = getattr(eval_frame, "set_eval_frame", None) if eval_frame is not None else None
    if original is None:
        yield False
        return
    wrapper_file = eval_frame.__file__
    check = never_compiled(check)

    def set_eval_frame(callback: Any) -> Any:
        caller = sys._getframe(1)
        code = caller.f_code
        if code.co_name == _WRAPPER_NAME and code.co_filename == wrapper_file:
            names = caller.f_locals
            # the wrapper's first call (`prior = ...`); it calls again on its way out, `prior` set
            fn, args, kwargs = names.get("fn"), names.get("args", ()), names.get("kwargs", {})
            if fn is not None and "prior" not in names:
                check(fn, args, kwargs)
        return original(callback)

    # The wrapper calls it again on its way out while dynamo still intercepts new frames
    _skip_own_frame(set_eval_frame, eval_frame)
    eval_frame.set_eval_frame = set_eval_frame
    try:
        yield True
    finally:
        eval_frame.set_eval_frame = original


def never_compiled(function: Callable[..., Any]) -> Callable[..., Any]:
    """`function`, run with dynamo off for its whole call, callees included.

    A check of ours that runs while dynamo intercepts new frames (a compiled module's pre-hook runs
    inside the compiled call; a compiled function called from compiled code's eager parts) would
    otherwise have its frames compiled by dynamo, with a graph break at ``sys._getframe`` and a
    warning to the user (seen on torch 2.11 and 2.13 with the pre-hook of a module compiled in place).
    """
    eval_frame = sys.modules.get("torch._dynamo.eval_frame")
    if eval_frame is None:  # nothing was ever compiled in this process: nothing intercepts frames
        return function
    import torch._dynamo

    return torch._dynamo.disable(function, recursive=True)


def _skip_own_frame(function: Callable[..., Any], eval_frame: Any) -> None:
    """Mark `function`'s own frame for dynamo to run as it is (its callees are not marked): for
    our ``set_eval_frame``, which cannot be wrapped by ``torch._dynamo.disable`` (that wrapper calls
    ``set_eval_frame`` itself) and calls no Python code on the way out of a compiled call."""
    skip_code = getattr(eval_frame, "skip_code", None)
    if skip_code is not None:
        skip_code(function.__code__)


def compiled_target(fn: Callable[..., Any]) -> tuple[torch.nn.Module | None, list[Callable[..., Any]]]:
    """What `fn` (the callable dynamo's wrapper calls) compiles: (the module whose call or forward it
    is, or None; the callables from `fn` inwards through ``functools.wraps``, which dynamo's own
    ``wrap_inline`` and the user's decorators use, and through ``functools.partial``, the user's
    function last)."""
    chain = []
    while fn is not None and len(chain) < 16:  # bounded: a wrapper chain is a few deep
        owner = getattr(fn, "__self__", None)
        if isinstance(owner, torch.nn.Module):
            return owner, chain
        chain.append(fn)
        fn = fn.func if isinstance(fn, functools.partial) else getattr(fn, "__wrapped__", None)
    return None, chain


def _cell(cell: Any) -> Any:
    try:
        return cell.cell_contents
    except ValueError:  # an empty cell
        return None


def host_tensors_read_by(function: Callable[..., Any], device_type: str) -> list[str]:
    """Names of the host tensors a plain function reads without being passed them: the globals its
    code names (nested code too: comprehensions, lambdas), its closure's cells and its own default
    arguments (what compiled code bakes in)."""
    if not inspect.isfunction(function):
        return []
    found = []
    module_globals = function.__globals__
    for name in sorted(_names_in(function.__code__)):
        if is_host_tensor(module_globals.get(name), device_type):
            found.append(name)
    for name, cell in zip(function.__code__.co_freevars, function.__closure__ or ()):
        if is_host_tensor(_cell(cell), device_type):
            found.append(name)
    try:
        parameters = inspect.signature(function, follow_wrapped=False).parameters.values()
    except (TypeError, ValueError):  # no signature to read
        parameters = ()
    found += [p.name for p in parameters if is_host_tensor(p.default, device_type)]
    return found


def _names_in(code: Any) -> set[str]:
    """The global and attribute names `code` and the code nested in it look up."""
    names = set(code.co_names)
    for const in code.co_consts:
        if inspect.iscode(const):
            names |= _names_in(const)
    return names


def partial_arguments(fn: Any) -> tuple[tuple, dict]:
    """The arguments a ``functools.partial`` binds (those a call of it passes on), else none."""
    if isinstance(fn, functools.partial):
        return fn.args, dict(fn.keywords)
    return (), {}


def is_host_tensor(value: Any, device_type: str) -> bool:
    """Whether `value` is a tensor off the step's device (`device_type`): a host tensor to the step."""
    return isinstance(value, torch.Tensor) and value.device.type != device_type
