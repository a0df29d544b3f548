"""Shared test set-up: GPU tests skip with a clear reason where CUDA (or CuPy) is missing."""

from __future__ import annotations

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
