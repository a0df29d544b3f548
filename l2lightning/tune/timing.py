"""Timing one layer shape on the GPU: CUDA graphs of a throwaway chain, plain and with each plan.

The plans are installed through :class:`~l2lightning.prefetch.install.PlanHooks`, the same hooks
the model gets, so the tuner measures what will run.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import torch

from l2lightning.graph.capture import graph_capture
from l2lightning.prefetch.chain import Layer, device_l2_bytes
from l2lightning.prefetch.install import PlanHooks
from l2lightning.prefetch.plan import PrefetchPlan
from l2lightning.tune.throwaway import build_throwaway


class ShapeBench(Protocol):
    """Measures one layer shape in one phase. ``Autotuner(bench_factory=...)`` injects fakes.

    Attributes:
        copies: layers in the throwaway chain (the op time per layer is the replay time / copies).
        mode: ``"block"`` (copies of the layer's block, each feeding the next), ``"chain"`` (copies of
            the lone layer, each feeding the next) or ``"fan"`` (each copy reads its own input).
    """

    copies: int
    mode: str

    def sample(self, plan: PrefetchPlan | None, decoy: bool = False) -> float:
        """One timing sample: seconds per replay of the chain with `plan` (None = plain)."""
        ...

    def close(self) -> None:
        """Free graphs and throwaway weights."""
        ...


# factory(layer, phase, device, max_copies=n): a bench whose chain holds at most n copies (the
# memory budget's bound, see l2lightning.tune.memory).
BenchFactory = Callable[..., ShapeBench]


class CudaShapeBench:
    """Times one layer shape in one phase on the GPU, with CUDA graphs of a throwaway chain.

    The chain (:func:`build_throwaway`) holds `chain_copies` copies of the layer's block (or of
    ``layer.module``) with random weights, at most `max_copies`; one graph is captured per variant (plain, each plan, each decoy) on first use, all
    sharing one memory pool (graphs replay one at a time and write every pool tensor before
    reading it, so sharing is safe and memory stays near one graph's worth; each forward graph also
    keeps its output). Forward phase: a
    forward-only graph under no_grad. Backward phase: forward + ``out.float().square().mean()``
    + backward, grads set to None before each capture, the plan on the backward pass only.
    ``training=True`` (forward phase only): forward + backward graphs with the plan on the forward
    pass, as a training step runs it.
    Random weights draw from the RNG: :class:`Autotuner` forks it around all of this.

    Args:
        layer: the chain layer whose shape is measured (its module is deep-copied, never run).
        phase: ``"forward"`` or ``"backward"``.
        device: the CUDA device.
        replays: graph replays per sample (one sample = mean over them, timed by CUDA events).
        l2_bytes: the L2 size (default: what the device reports).
        training: measure a forward plan in forward + backward graphs.
        min_copies: the model's layers of this shape: the throwaway is at least as long (up to
            32), so what builds up along a chain (lines an evict_last prefetch keeps) shows.
        max_copies: the most copies (the tuner's memory budget); None: no bound but free memory.
    """

    def __init__(
        self,
        layer: Layer,
        phase: str,
        device: torch.device,
        *,
        replays: int = 5,
        l2_bytes: int | None = None,
        training: bool = False,
        min_copies: int = 1,
        max_copies: int | None = None,
    ) -> None:
        from l2lightning.prefetch.kernels import load_prefetch_kernels

        self.device = torch.device(
            "cuda", device.index if device.index is not None else torch.cuda.current_device()
        )
        self.replays = replays
        self.graphs: dict[tuple[PrefetchPlan | None, bool], tuple[Any, Any, PlanHooks | None]] = {}
        load_prefetch_kernels(self.device.index)  # NVRTC and module loading must not happen inside a capture
        l2 = l2_bytes if l2_bytes is not None else device_l2_bytes(self.device)
        free, _ = torch.cuda.mem_get_info(self.device.index)
        # A training-context forward phase runs forward + backward graphs (prefetch in forward only).
        graph_phase = "backward" if training else phase
        # weights (x3 in backward: grads and allocator slack) within 40% of the free memory
        max_bytes = int(0.4 * free) // (3 if graph_phase == "backward" else 1)
        self.chain = build_throwaway(
            layer, graph_phase, l2, max_bytes=max_bytes, min_copies=min_copies, max_copies=max_copies
        )
        self.phase = phase
        self.copies = self.chain.copies
        self.mode = self.chain.mode
        self.pool = torch.cuda.graph_pool_handle()
        self._start = torch.cuda.Event(enable_timing=True)
        self._end = torch.cuda.Event(enable_timing=True)
        self._warm_up()

    def _warm_up(self) -> None:
        # Eager passes on a side stream before any capture (cuBLAS handles/workspaces, lazy init).
        main = torch.cuda.current_stream(self.device)
        side = torch.cuda.Stream(device=self.device)
        side.wait_stream(main)
        with torch.cuda.stream(side):
            for _ in range(2):
                self.chain.zero_grads()
                self.chain.run()
        main.wait_stream(side)
        torch.cuda.synchronize(self.device)

    def _graph(self, plan: PrefetchPlan | None, decoy: bool) -> Any:
        key = (plan, decoy)
        if key in self.graphs:
            return self.graphs[key][0]
        hooks = None
        chain = self.chain
        if plan is not None:
            plans = chain.plans(plan, self.phase)
            if self.phase == "forward":
                hooks = PlanHooks(chain.model, chain.inputs, backward=False, plans=plans, decoy=decoy)
            else:
                hooks = PlanHooks(
                    chain.model, chain.inputs, backward=True, plans={}, backward_plans=plans, decoy=decoy
                )
        try:
            chain.zero_grads()
            graph = torch.cuda.CUDAGraph()
            with graph_capture(graph, pool=self.pool):
                out = chain.run()
        finally:
            if hooks is not None:
                hooks.remove()  # the launches are recorded in the graph; the hooks are done
        graph.replay()  # warm-up replay before any timing
        torch.cuda.synchronize(self.device)
        self.graphs[key] = (graph, out, hooks)
        return graph

    def sample(self, plan: PrefetchPlan | None, decoy: bool = False) -> float:
        """Seconds per replay, averaged over `replays` back-to-back replays timed by CUDA events."""
        graph = self._graph(plan, decoy)
        stream = torch.cuda.current_stream(self.device)
        self._start.record(stream)
        for _ in range(self.replays):
            graph.replay()
        self._end.record(stream)
        self._end.synchronize()
        return self._start.elapsed_time(self._end) * 1e-3 / self.replays

    def close(self) -> None:
        """Drop graphs, throwaway weights and the pool (their memory returns to the allocator)."""
        torch.cuda.synchronize(self.device)
        self.graphs.clear()
        self.chain = None
        self.pool = None
