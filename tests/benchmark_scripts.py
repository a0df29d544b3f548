"""Loading a script of ``benchmarks/`` as a module, for the tests of its plumbing (the scripts are not
a package: each is loaded from its file)."""

from __future__ import annotations

import importlib.util
import types
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"


def load_benchmark(name: str) -> types.ModuleType:
    """``benchmarks/<name>.py`` as a fresh module named `name`."""
    spec = importlib.util.spec_from_file_location(name, BENCHMARKS / f"{name}.py")
    if spec is None or spec.loader is None:
        raise FileNotFoundError(f"no benchmark script {BENCHMARKS / f'{name}.py'}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
