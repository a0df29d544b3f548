"""Turning the prefetch kernels of a captured step graph off and on, without capturing it again.

The whole-step gate (:mod:`l2lightning.callback.step_gate`) compares the step with its prefetch plans
against the same step without them. Capturing the step a second time for that doubles the graph
memory during the trial: every capture allocates its own gradients in its own pool (on the H200,
the d1024x60 bf16 stack's pool is 126 MiB, 120 of them gradients), and issue 16 bounds the
defaults at 10% over ``prefetch="off"``. A CUDA graph can instead switch single kernel nodes of its
instantiated form on and off (``cuGraphNodeSetEnabled``; a disabled node acts as an empty node, and
the change applies to the graph's next launches, not to one in flight). The prefetch kernels are
the only nodes that differ between the two variants, so the trial replays one graph with them on,
then off, and keeps it in the state that won.

Kernel nodes are matched by their function handle against the prefetch kernels CuPy loaded
(``Function.ptr``, a ``CUfunction``). Reading the nodes needs the graph's un-instantiated form,
which PyTorch keeps only for ``torch.cuda.CUDAGraph(keep_graph=True)``. Anything missing (that
argument, the driver entry points, no prefetch node found) makes :func:`find_switch` return
``None`` with a reason, and the gate falls back to the second capture.
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Iterable
from typing import Any

_CU_GRAPH_NODE_TYPE_KERNEL = 0
# CUDA_KERNEL_NODE_PARAMS(_v2) starts with its CUfunction; the rest of the struct (grid, block,
# arguments, and in v2/v3 a CUkernel and a context) is read into room to spare and ignored.
_KERNEL_PARAMS_BYTES = 256


@functools.cache
def _driver() -> Any:
    return ctypes.CDLL("libcuda.so.1")


def _entry(name: str, *alternatives: str) -> Any:
    driver = _driver()
    for symbol in (name, *alternatives):
        function = getattr(driver, symbol, None)
        if function is not None:
            function.restype = ctypes.c_int
            return function
    raise RuntimeError(f"the CUDA driver has no {name}")


def _check(result: int, what: str) -> None:
    if result != 0:
        raise RuntimeError(f"{what} failed with CUDA driver error {result}")


def kernel_nodes(raw_graph: int) -> list[tuple[int, int]]:
    """(node, CUfunction) of every kernel node of the un-instantiated graph `raw_graph` (a CUgraph)."""
    get_nodes = _entry("cuGraphGetNodes")
    get_type = _entry("cuGraphNodeGetType")
    get_params = _entry("cuGraphKernelNodeGetParams_v2", "cuGraphKernelNodeGetParams")
    count = ctypes.c_size_t(0)
    _check(get_nodes(ctypes.c_void_p(raw_graph), None, ctypes.byref(count)), "cuGraphGetNodes")
    nodes = (ctypes.c_void_p * count.value)()
    _check(get_nodes(ctypes.c_void_p(raw_graph), nodes, ctypes.byref(count)), "cuGraphGetNodes")
    found = []
    node_type = ctypes.c_int(0)
    params = ctypes.create_string_buffer(_KERNEL_PARAMS_BYTES)
    for node in nodes[: count.value]:
        _check(get_type(ctypes.c_void_p(node), ctypes.byref(node_type)), "cuGraphNodeGetType")
        if node_type.value != _CU_GRAPH_NODE_TYPE_KERNEL:
            continue
        _check(get_params(ctypes.c_void_p(node), params), "cuGraphKernelNodeGetParams")
        function = ctypes.c_void_p.from_buffer(params).value or 0
        found.append((int(node), int(function)))
    return found


class PrefetchSwitch:
    """The prefetch kernel nodes of one instantiated step graph, enabled or disabled together.

    Args:
        raw_exec: the graph's ``CUgraphExec`` (``torch.cuda.CUDAGraph.raw_cuda_graph_exec()``).
        nodes: the prefetch kernel nodes of the graph it was instantiated from.
        set_enabled: ``(raw_exec, node, enabled) -> None``; the driver's by default (a test seam).
    """

    def __init__(self, raw_exec: int, nodes: list[int], set_enabled: Any = None) -> None:
        if not nodes:
            raise ValueError("`nodes` must name at least one prefetch kernel node")
        self.raw_exec = raw_exec
        self.nodes = list(nodes)
        # the driver's entry point is resolved once: the gate's trial toggles every node per turn
        self._set_enabled = set_enabled or _driver_set_enabled(_entry("cuGraphNodeSetEnabled"))
        self.enabled = True  # as captured

    def set(self, enabled: bool) -> None:
        """Prefetch on or off from the graph's next replay on (no wait for one in flight)."""
        if enabled == self.enabled:
            return
        for node in self.nodes:
            self._set_enabled(self.raw_exec, node, enabled)
        self.enabled = enabled


def _driver_set_enabled(set_enabled: Any) -> Any:
    """``(raw_exec, node, enabled) -> None`` through the driver's resolved ``cuGraphNodeSetEnabled``."""

    def call(raw_exec: int, node: int, enabled: bool) -> None:
        _check(
            set_enabled(ctypes.c_void_p(raw_exec), ctypes.c_void_p(node), ctypes.c_uint(1 if enabled else 0)),
            "cuGraphNodeSetEnabled",
        )

    return call


def find_switch(graph: Any, functions: Iterable[int]) -> tuple[PrefetchSwitch | None, str]:
    """The switch over `graph`'s kernel nodes that run one of `functions`, or None and why not.

    `graph` is a ``torch.cuda.CUDAGraph`` made with ``keep_graph=True``, captured and instantiated.
    """
    wanted = {int(f) for f in functions if f}
    if not wanted:
        return None, "no prefetch kernel is loaded"
    try:
        raw_graph = int(graph.raw_cuda_graph())
        raw_exec = int(graph.raw_cuda_graph_exec())
    except (AttributeError, RuntimeError) as exc:  # an older PyTorch, or the graph was not kept
        return None, f"the graph's nodes cannot be read ({type(exc).__name__}: {exc})"
    if not raw_graph or not raw_exec:
        return None, "the graph's nodes cannot be read (no kept or instantiated graph)"
    try:
        nodes = [node for node, function in kernel_nodes(raw_graph) if function in wanted]
    except (OSError, RuntimeError) as exc:
        return None, f"the graph's nodes cannot be read ({exc})"
    if not nodes:
        return None, "no prefetch kernel node in the captured graph"
    try:
        return PrefetchSwitch(raw_exec, nodes), f"{len(nodes)} prefetch kernel nodes"
    except RuntimeError as exc:  # a driver older than CUDA 11.6 cannot switch nodes
        return None, f"the graph's nodes cannot be switched ({exc})"


def new_cuda_graph(keep_graph: bool = False) -> Any:
    """``torch.cuda.CUDAGraph(keep_graph=...)``; a PyTorch without the argument gets a plain graph."""
    import torch

    if keep_graph:
        try:
            return torch.cuda.CUDAGraph(keep_graph=True)
        except TypeError:
            pass
    return torch.cuda.CUDAGraph()


def prefetch_functions(device_index: int) -> list[int]:
    """The ``CUfunction`` handles of the prefetch kernels loaded for `device_index`."""
    from l2lightning._kernels import get_function
    from l2lightning.prefetch.kernels import _KERNEL_NAMES, kernel_defines, supported_kinds

    defines = kernel_defines(device_index)
    functions = []
    for kind in supported_kinds(device_index):
        kernel = get_function("l2_prefetch.cu", _KERNEL_NAMES[kind], device_index, defines)
        # a cupy.RawKernel; its loaded cupy.cuda.function.Function holds the CUfunction
        loaded = getattr(kernel, "kernel", kernel)
        functions.append(int(loaded.ptr))
    return functions
