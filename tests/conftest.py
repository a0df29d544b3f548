"""Shared test set-up: GPU tests skip with a clear reason where CUDA (or CuPy) is missing, and the
run ends with one line per skip reason (how many tests it skipped, and why)."""

from __future__ import annotations

from collections import Counter

import pytest


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    from l2lightning._env import cuda_unavailable_reason

    reason = cuda_unavailable_reason()
    if not reason:
        return
    skip = pytest.mark.skip(reason=f"GPU test: {reason}")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _fresh_warnings():
    """Each test sees l2lightning's one-time warnings afresh."""
    from l2lightning._env import reset_warnings

    reset_warnings()
    yield


@pytest.fixture
def one_torch_thread():
    """Tiny models: one intra-op thread beats several threads contending for a small CI machine's cores."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def emulated_cuda_graphs(monkeypatch, one_torch_thread):
    """CUDA graph capture and replay stood in for on the CPU (tests/graph_emulator.py), for this test."""
    from tests import graph_emulator

    graph_emulator.install(monkeypatch.setattr)
    yield


def skip_reason(report: pytest.TestReport) -> str:
    """The reason a skipped test report gives, without pytest's ``Skipped: `` prefix."""
    longrepr = report.longrepr
    text = longrepr[2] if isinstance(longrepr, tuple) and len(longrepr) == 3 else str(longrepr)
    return text.removeprefix("Skipped: ")


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    """One line per skip reason, most frequent first: ``158 skipped: GPU test: ...`` instead of ``sss``."""
    reasons = Counter(skip_reason(r) for r in terminalreporter.stats.get("skipped", []))
    if not reasons:
        return
    terminalreporter.write_sep("-", "skip reasons")
    for reason, count in reasons.most_common():
        terminalreporter.write_line(f"{count} skipped: {reason}")
