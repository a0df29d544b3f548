"""The step-source reader on thousands of real functions: whatever a step's source says, reading it never raises.

Two constructs once crashed a fit at setup (a local assigned from itself, sent round forever; a step
counter inside a slice, whose `:n` was parsed as an expression of its own). Every function of a few
libraries, grafted onto a module as its ``training_step``, is read here, as the reader would read a
user's step: whatever it finds, it must return.
"""

from __future__ import annotations

import importlib
import inspect
import pkgutil
import types

import pytest

from l2lightning.step_source import analyse

PACKAGES = ("torch.nn.modules", "torch.optim", "torchmetrics.functional", "lightning.pytorch.loops")


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
                found += [(f"{obj.__qualname__}.{n}", f) for n, f in vars(obj).items() if inspect.isfunction(f)]
            elif inspect.isfunction(obj) and obj.__module__ == module.__name__:
                found.append((name, obj))
    return found


@pytest.mark.parametrize("package", PACKAGES)
def test_reading_any_real_function_as_a_training_step_never_raises(package):
    functions = _functions(package)
    assert len(functions) > 100, package  # the package was read, not skipped
    failures = []
    for qualname, function in functions:
        step = types.FunctionType(
            function.__code__, function.__globals__, "training_step", function.__defaults__, function.__closure__
        )
        step.__module__ = "user_code"  # read like a user's own step, not skipped as a library's
        module = type("UserModule", (), {"training_step": step})()
        try:
            analyse(module)
        except Exception as exc:
            failures.append(f"{qualname}: {type(exc).__name__}: {exc}")
    assert not failures, failures[:10]
