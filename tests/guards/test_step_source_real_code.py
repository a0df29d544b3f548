"""The step-source reader on thousands of real functions: whatever a step's source says, reading it never raises.

Two constructs once crashed a fit at setup (a local assigned from itself, sent round forever; a step
counter inside a slice, whose `:n` was parsed as an expression of its own). Every function of a few
libraries, grafted onto a module as its ``training_step``, is read here, as the reader would read a
user's step: whatever it finds, it must return.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import pkgutil
import types

import pytest

from l2lightning.guards.step_source import StepSource, analyse, analyse_callbacks

PACKAGES = ("torch.nn.modules", "torch.optim", "torchmetrics.functional", "lightning.pytorch.loops")


@functools.cache  # read once for both readers
def _functions(package: str) -> list[tuple[str, types.FunctionType]]:
    root = importlib.import_module(package)
    modules = [root]
    for info in pkgutil.walk_packages(root.__path__, f"{package}."):
        try:
            modules.append(importlib.import_module(info.name))
        except Exception:  # an optional dependency missing: not this test's business
            continue
    found = []
    for module in modules:
        for name, obj in vars(module).items():
            if inspect.isclass(obj) and obj.__module__ == module.__name__:
                found += [
                    (f"{obj.__qualname__}.{n}", f) for n, f in vars(obj).items() if inspect.isfunction(f)
                ]
            elif inspect.isfunction(obj) and obj.__module__ == module.__name__:
                found.append((name, obj))
    return found


def _read_as_training_step(hook: types.FunctionType) -> None:
    analyse(type("UserModule", (), {"training_step": hook})())


def _read_as_a_callbacks_hook(hook: types.FunctionType) -> None:
    # a callback's hook inside the step: (self, trainer, pl_module, ...) for the reader
    callback = type("UserCallback", (), {"on_before_optimizer_step": hook})()
    analyse_callbacks([callback], ("on_before_optimizer_step",), StepSource())


@pytest.mark.parametrize("read", [_read_as_training_step, _read_as_a_callbacks_hook])
@pytest.mark.parametrize("package", PACKAGES)
def test_reading_any_real_function_as_a_step_hook_never_raises(package, read):
    functions = _functions(package)
    assert len(functions) > 100, package  # the package was read, not skipped
    failures = []
    for qualname, function in functions:
        hook = types.FunctionType(
            function.__code__, function.__globals__, "hook", function.__defaults__, function.__closure__
        )
        hook.__module__ = "user_code"  # read like the user's own code, not skipped as a library's
        try:
            read(hook)
        except Exception as exc:
            failures.append(f"{qualname}: {type(exc).__name__}: {exc}")
    assert not failures, failures[:10]
