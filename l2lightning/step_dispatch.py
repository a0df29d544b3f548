"""The optimizer step the callback wraps: run it eagerly, capture it or replay it.

A mixin of :class:`l2lightning.callback.L2GraphCallback`: its methods use the callback's run state
(set in ``_reset_run_state``); it is split out so that each concept reads in one module.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from typing import Any

import torch

from l2lightning.capture import clear_cublas_workspaces, loss_of
from l2lightning.cuda_memory import free_cached_memory
from l2lightning.replay_closure import is_stock_closure, one_closure_count
from l2lightning.step_overrides import copied_element


class StepDispatch:
    """The optimizer step the callback wraps: run it eagerly, capture it or replay it."""

    def _step(self, run: Callable[..., Any], closure: Callable[[], Any] | None, kwargs: dict) -> Any:
        """Called by the capturable optimizer's ``step``: `run(closure)` is its eager step."""
        mode = self._decide()
        self._in_step = True
        try:
            if mode == "replay":
                return self._replay_step(closure)
            # torch.compile compiles at the first call of each compiled child: the step after set-up
            compiling, self._compile_pending = self._compile_pending, False
            started = time.perf_counter()
            try:
                with self._on_step_stream(), one_closure_count(self._trainer, closure):
                    return self._eager_modes(mode, run, closure, kwargs)
            finally:
                if compiling:
                    self._cost_s["compile_s"] += time.perf_counter() - started
        finally:
            self._in_step = False
            self._pending = None
            self._pending_tensors = []  # the batch's tensors: not kept past the step

    def _eager_modes(self, mode: str, run: Callable[..., Any], closure: Any, kwargs: dict) -> Any:
        """Every step that runs the step's own code: warm-up (traced or timed), the capture, eager."""
        if mode == "trace":
            return self._traced_step(run, closure, kwargs)
        if mode == "time":
            return self._timed_step(run, closure, kwargs)
        if mode == "capture":
            started, tuned = time.perf_counter(), self._cost_s["tuning_s"]
            try:
                return self._capture_step(run, closure, kwargs)
            finally:  # the tuning inside it is counted apart
                self._cost_s["capture_s"] += (
                    time.perf_counter() - started - (self._cost_s["tuning_s"] - tuned)
                )
        self._mode = "eager"
        return run(closure, **kwargs)

    @contextlib.contextmanager
    def _on_step_stream(self) -> Any:
        """Run an eager step (or the capture) on the capture's own stream.

        A step's autograd graph can outlive it: Lightning's result collection and torchmetrics keep a
        metric's batch value with its graph (``MeanMetric()(loss)``), users keep ``self.last_loss``. Such
        a graph keeps the parameters' AccumulateGrad nodes, bound to the stream of the step that made
        them, and a capture on another stream then fails ("AccumulateGrad node's stream does not
        match"; the lightning-hydra-template module on the H200). When every step the callback lets
        run eagerly runs on the capture stream, every such node is bound to it. The stream waits for
        the caller's work first and the caller waits for it after, so the order of work is unchanged.
        """
        if self._device_type() != "cuda" or not torch.cuda.is_available():
            yield
            return
        if self._step_stream is None:
            self._step_stream = torch.cuda.Stream(self._device())
            # PyTorch's allocator caches freed blocks per stream: what the default stream left
            # cached (a sanity-check validation, an earlier fit) cannot serve this stream's
            # allocations. Give those blocks back once, before the first step on this stream. (A
            # precaution: on the H200 a fit with 4% more free memory than plain training needs still
            # ran out of memory in a warm-up step with it; tests/gpu/test_oom_gpu.py.)
            torch.cuda.empty_cache()
        caller = torch.cuda.current_stream()
        self._step_stream.wait_stream(caller)
        try:
            with torch.cuda.stream(self._step_stream):
                yield
        finally:
            caller.wait_stream(self._step_stream)

    def _give_back_step_stream(self) -> None:
        """Free what the capture's stream holds once the rest of the fit trains plain on the caller's.

        The steps the callback ran on its stream left cuBLAS workspaces keyed to it (one per thread
        that ran a GEMM: the step's and autograd's, 32 MiB each on the H200) and freed blocks cached
        for it; plain steps on the caller's stream can use neither and allocate their own beside
        them. On the H200, with 4% more memory free than plain training needs, the first plain step
        after a capture that ran out of memory ran out itself (tests/gpu/test_oom_gpu.py); given
        back here, that fit's steps peak at plain's allocated bytes (benchmarks/memory_peak.py,
        scenario ``oom-steps-capture-fails``).
        """
        if self._step_stream is None:
            return
        self._step_stream = None
        clear_cublas_workspaces()
        free_cached_memory()

    def _replay_step(self, closure: Any) -> Any:
        graph = self._graph
        graph.static.copy_tensors(self._pending_tensors)  # _decide flattened the batch, compared signatures
        graph.bind_grads()
        if graph.binding is not None:
            graph.binding.bring_home()
        self._optimizer.sync_tensors()
        start, end = self._events()
        start.record()
        graph.graph.replay()
        end.record()
        for where, element in graph.appends:  # what the step's Python appended, as in an eager step
            current = where.current()
            if current is not None:
                current.append(copied_element(element))
        self._timing.graph.append((start, end))
        self._timing.graph_count += 1
        if self._gate_turn is not None:
            self._gate.record(self._gate_turn, start, end)
            self._gate_turn = None
        if graph.binding is not None:
            graph.binding.after_replay()
        self._mode = "replay"
        self._reissued = set()
        if closure is None:
            return loss_of(graph.output, "training_step")
        if self._replay_closure is not None and is_stock_closure(closure):
            return self._replay_closure(self._trainer, closure)
        return closure()
