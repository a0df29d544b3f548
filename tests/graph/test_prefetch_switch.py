"""CPU: finding and switching a graph's prefetch kernel nodes, against a stand-in CUDA driver."""

from __future__ import annotations

import ctypes

import pytest

from l2lightning.graph import prefetch_switch
from l2lightning.graph.prefetch_switch import PrefetchSwitch, find_switch, kernel_nodes

KERNEL, EVENT_RECORD = 0, 6  # CUgraphNodeType values


class Entry:
    """A driver entry point: callable, with the `restype` ctypes sets."""

    def __init__(self, function):
        self.function = function
        self.restype = None

    def __call__(self, *args):
        return self.function(*args)


class FakeDriver:
    """The four driver entry points the switch uses, over a graph of (node, type, function) rows."""

    def __init__(self, rows, fail=None):
        self.rows = rows
        self.fail = fail  # an entry point that returns an error
        self.enabled: dict[int, int] = {}
        self.cuGraphGetNodes = Entry(self._get_nodes)
        self.cuGraphNodeGetType = Entry(self._get_type)
        self.cuGraphKernelNodeGetParams_v2 = Entry(self._get_params)
        self.cuGraphNodeSetEnabled = Entry(self._set_enabled)

    def _get_nodes(self, graph, nodes, count):
        if self.fail == "cuGraphGetNodes":
            return 1
        if nodes is not None:
            for i, (node, _, _) in enumerate(self.rows):
                nodes[i] = node
        count._obj.value = len(self.rows)
        return 0

    def _get_type(self, node, out):
        out._obj.value = next(t for n, t, _ in self.rows if n == node.value)
        return 0

    def _get_params(self, node, params):
        function = next(f for n, _, f in self.rows if n == node.value)
        ctypes.c_void_p.from_buffer(params).value = function
        return 0

    def _set_enabled(self, graph_exec, node, enabled):
        if self.fail == "cuGraphNodeSetEnabled":
            return 700
        self.enabled[node.value] = enabled.value
        return 0


class FakeGraph:
    def __init__(self, raw=0x1000, raw_exec=0x2000):
        self.raw, self.raw_exec = raw, raw_exec

    def raw_cuda_graph(self):
        return self.raw

    def raw_cuda_graph_exec(self):
        return self.raw_exec


ROWS = [(11, KERNEL, 0xAA), (12, EVENT_RECORD, 0), (13, KERNEL, 0xBB), (14, KERNEL, 0xAA), (15, KERNEL, 0xCC)]


@pytest.fixture
def driver(monkeypatch):
    fake = FakeDriver(ROWS)
    monkeypatch.setattr(prefetch_switch, "_driver", lambda: fake)
    return fake


def test_kernel_nodes_lists_each_kernel_node_with_its_function(driver):
    assert kernel_nodes(0x1000) == [(11, 0xAA), (13, 0xBB), (14, 0xAA), (15, 0xCC)]


def test_the_switch_covers_the_nodes_of_the_prefetch_functions_and_sets_them_together(driver):
    switch, why = find_switch(FakeGraph(), [0xAA, 0xCC])
    assert switch is not None and switch.nodes == [11, 14, 15] and switch.raw_exec == 0x2000, why
    assert "3 prefetch kernel nodes" in why and switch.enabled
    switch.set(False)
    assert driver.enabled == {11: 0, 14: 0, 15: 0} and not switch.enabled
    driver.enabled.clear()
    switch.set(False)  # no change: no driver call
    assert driver.enabled == {}
    switch.set(True)
    assert driver.enabled == {11: 1, 14: 1, 15: 1}


@pytest.mark.parametrize(
    ("graph", "functions", "why"),
    [
        (FakeGraph(), [], "no prefetch kernel is loaded"),
        (FakeGraph(), [0xDD], "no prefetch kernel node"),
        (FakeGraph(raw=0), [0xAA], "no kept or instantiated graph"),
        (object(), [0xAA], "cannot be read (AttributeError"),
    ],
)
def test_no_switch_names_why(driver, graph, functions, why):
    switch, reason = find_switch(graph, functions)
    assert switch is None and why in reason, reason


def test_a_driver_error_leaves_no_switch(monkeypatch):
    monkeypatch.setattr(prefetch_switch, "_driver", lambda: FakeDriver(ROWS, fail="cuGraphGetNodes"))
    switch, why = find_switch(FakeGraph(), [0xAA])
    assert switch is None and "cuGraphGetNodes failed with CUDA driver error 1" in why


def test_a_driver_that_cannot_switch_nodes_leaves_no_switch(monkeypatch):
    driver = FakeDriver(ROWS)
    del driver.cuGraphNodeSetEnabled  # before CUDA 11.6
    monkeypatch.setattr(prefetch_switch, "_driver", lambda: driver)
    switch, why = find_switch(FakeGraph(), [0xAA])
    assert switch is None and "cannot be switched" in why and "cuGraphNodeSetEnabled" in why, why


def test_a_failed_switch_raises_with_the_driver_error(monkeypatch):
    monkeypatch.setattr(prefetch_switch, "_driver", lambda: FakeDriver(ROWS, fail="cuGraphNodeSetEnabled"))
    switch = PrefetchSwitch(0x2000, [11])
    with pytest.raises(RuntimeError, match="cuGraphNodeSetEnabled failed with CUDA driver error 700"):
        switch.set(False)
    assert switch.enabled  # the state it reports is the one the graph has


def test_a_switch_needs_nodes():
    with pytest.raises(ValueError, match="`nodes` must name at least one"):
        PrefetchSwitch(0x2000, [])


def test_new_cuda_graph_falls_back_without_keep_graph(monkeypatch):
    import torch

    made = []

    class OldGraph:
        def __init__(self):
            made.append("plain")

    monkeypatch.setattr(torch.cuda, "CUDAGraph", OldGraph)
    assert isinstance(prefetch_switch.new_cuda_graph(keep_graph=True), OldGraph) and made == ["plain"]
