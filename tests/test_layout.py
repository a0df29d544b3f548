"""The tree's size rules: the core grouped by concept (``callback/``, ``graph/``, ``guards/``) with few
modules left at the package's root, and test files of a readable length. The import directions
between the groups are in tests/test_import_graph.py."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MAX_ROOT_MODULES = 12
MAX_TEST_LINES = 1500


def test_the_package_root_holds_at_most_a_dozen_modules():
    modules = sorted(p.name for p in (ROOT / "l2lightning").glob("*.py"))
    assert len(modules) <= MAX_ROOT_MODULES, modules


def test_the_core_is_grouped_into_its_three_subpackages():
    for group in ("callback", "graph", "guards"):
        package = ROOT / "l2lightning" / group
        assert (package / "__init__.py").is_file(), group
        assert len(list(package.glob("*.py"))) > 3, group


def test_no_test_file_is_over_1500_lines():
    files = [p for p in (ROOT / "tests").rglob("*.py") if "__pycache__" not in p.parts]
    long = {
        str(p.relative_to(ROOT)): n for p in files if (n := len(p.read_text().splitlines())) > MAX_TEST_LINES
    }
    assert not long
