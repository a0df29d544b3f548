"""The package's import graph keeps the architecture the tree shows.

Every module of ``l2lightning`` is parsed (never imported) and every ``import`` statement in it
counts, at module level and inside functions alike: a function-local import runs as soon as the
function does, so a cycle through one is still a cycle, only a later one. Imports under
``if TYPE_CHECKING:`` never run and do not count. ``from l2lightning import NAME`` resolves through
the package's lazy export table to the module that defines NAME, because that is what runs.

Checked: no import cycles; the library (everything outside ``l2lightning.tools`` and
``l2lightning.app``) imports neither the tools nor the app; the captured graph's mechanics
(``l2lightning.graph``) and the replay's guards (``l2lightning.guards``) never import the callback;
the benchmark tools import in no circle even counting their ``TYPE_CHECKING`` imports (a reader
follows those too); and, in a fresh interpreter, importing the callback, constructing
``L2GraphCallback(report=True)`` and building a step report loads no module of the tools or the app.
"""

from __future__ import annotations

import ast
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import l2lightning

PACKAGE_DIR = Path(l2lightning.__file__).resolve().parent
# `python -m l2lightning` is the tools' command line, so the package's __main__ belongs to the tools.
OUTSIDE_CORE = ("l2lightning.tools", "l2lightning.app", "l2lightning.__main__")


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE_DIR.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def package_modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(PACKAGE_DIR.rglob("*.py"))}


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _import_nodes(tree: ast.AST, type_checking: bool = False) -> list[ast.Import | ast.ImportFrom]:
    """The import statements of `tree`; those under ``if TYPE_CHECKING:`` only with `type_checking`."""
    found: list[ast.Import | ast.ImportFrom] = []

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node) and not type_checking:
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            found.append(node)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return found


def imports_of(name: str, path: Path, modules: dict[str, Path], type_checking: bool = False) -> set[str]:
    """The package modules that running `name` (any of its functions included) may import; with
    `type_checking`, also those its ``TYPE_CHECKING`` block names (what a reader has to follow)."""
    is_package = path.name == "__init__.py"
    exports = getattr(l2lightning, "_EXPORTS", {})
    targets: set[str] = set()
    for node in _import_nodes(ast.parse(path.read_text(), str(path)), type_checking):
        if isinstance(node, ast.Import):
            targets.update(alias.name for alias in node.names)
            continue
        base = node.module or ""
        if node.level:
            anchor = name.split(".") if is_package else name.split(".")[:-1]
            anchor = anchor[: len(anchor) - (node.level - 1)]
            base = ".".join(anchor + ([base] if base else []))
        for alias in node.names:
            if f"{base}.{alias.name}" in modules:
                targets.add(f"{base}.{alias.name}")
            elif base == "l2lightning" and alias.name in exports:
                targets.add(exports[alias.name])
            else:
                targets.add(base)
    return {t for t in targets if t in modules and t != name}


def import_graph(type_checking: bool = False) -> dict[str, set[str]]:
    modules = package_modules()
    return {name: imports_of(name, path, modules, type_checking) for name, path in modules.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def connect(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for succ in sorted(graph[node]):
            if succ not in index:
                connect(succ)
                low[node] = min(low[node], low[succ])
            elif succ in on_stack:
                low[node] = min(low[node], index[succ])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            connect(node)
    return found


def is_core(name: str) -> bool:
    return not any(name == top or name.startswith(top + ".") for top in OUTSIDE_CORE)


def test_the_graph_sees_function_local_and_lazy_imports():
    graph = import_graph()
    # the fit report imports the step report inside its methods; the CLI reaches the doctor the same way.
    assert "l2lightning.step_report" in graph["l2lightning.callback.fit_report"]
    assert "l2lightning.tools.doctor" in graph["l2lightning.tools.cli"]
    assert "l2lightning.prefetch.hooks" in graph["l2lightning.callback.graph_callback"]


def test_cycles_finds_a_planted_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_the_package_has_no_import_cycles():
    assert cycles(import_graph()) == []


def test_the_library_never_imports_the_tools_or_the_app():
    wrong = {
        name: sorted(t for t in targets if not is_core(t))
        for name, targets in import_graph().items()
        if is_core(name)
    }
    assert {name: targets for name, targets in wrong.items() if targets} == {}


@pytest.mark.parametrize("group", ["l2lightning.graph", "l2lightning.guards"])
def test_the_graph_and_the_guards_never_import_the_callback(group):
    callback = "l2lightning.callback"
    wrong = {
        name: sorted(t for t in targets if t == callback or t.startswith(callback + "."))
        for name, targets in import_graph().items()
        if name == group or name.startswith(group + ".")
    }
    assert {name: targets for name, targets in wrong.items() if targets} == {}


def test_the_benchmark_tools_import_in_no_circle_even_for_type_checkers():
    bench = "l2lightning.tools.bench"
    graph = {
        name: {t for t in targets if t.startswith(bench + ".")}
        for name, targets in import_graph(type_checking=True).items()
        if name.startswith(bench + ".")
    }
    assert cycles(graph) == []


def test_type_checking_imports_are_read_only_when_asked(tmp_path):
    source = tmp_path / "m.py"
    source.write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import l2lightning.verify\n")
    modules = {"l2lightning.verify": source, "m": source}
    assert imports_of("m", source, modules) == set()
    assert imports_of("m", source, modules, type_checking=True) == {"l2lightning.verify"}


def test_the_tuner_is_called_by_the_resolver_and_never_calls_back_into_it():
    graph = import_graph()
    tuner = {name for name in graph if name.startswith("l2lightning.tune")}
    assert not graph["l2lightning.prefetch.install"] & tuner
    for name in tuner:
        assert "l2lightning.prefetch.hooks" not in graph[name], name


def test_callback_with_report_loads_no_tool_module():
    code = textwrap.dedent(
        """
        import sys
        import torch
        from l2lightning.callback.graph_callback import L2GraphCallback
        from l2lightning.step_report import build_report

        L2GraphCallback(report=True)
        model = torch.nn.Linear(256, 256)
        times = {"forward": 10.0, "backward": 20.0, "optimizer": 5.0}
        counts = {"forward": 2, "backward": 4, "optimizer": 3}
        build_report(model, times, counts, copy_bw=3e12, empty_kernel_us=2.0).format()
        loaded = sorted(m for m in sys.modules if m.startswith(("l2lightning.tools", "l2lightning.app")))
        print(",".join(loaded))
        """
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip() == ""
