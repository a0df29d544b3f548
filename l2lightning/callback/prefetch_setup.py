"""Prefetch and compile for the captured step: hooks, tuning, the whole-step gate.

A mixin of :class:`l2lightning.callback.graph_callback.L2GraphCallback`: its methods use the callback's run state
(set in ``_reset_run_state``); it is split out so that each concept reads in one module.
"""

from __future__ import annotations

import contextlib
import io
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from lightning.pytorch import LightningModule
from lightning.pytorch.utilities import rank_zero_info
from lightning.pytorch.utilities.rank_zero import rank_zero_debug
from lightning.pytorch.utilities.signature_utils import is_param_in_hook_signature

from l2lightning._env import prefetch_unavailable_reason
from l2lightning.callback.step_gate import StepGate, StepGateResult
from l2lightning.callback.step_overrides import shallow_copy
from l2lightning.graph.attributes import ABSENT
from l2lightning.graph.capture import StaticBatch, TrainingState
from l2lightning.graph.cuda_memory import free_cached_memory, memory_state
from l2lightning.guards.metric_binding import (
    named_metrics,
)
from l2lightning.guards.step_trace import first_line

if TYPE_CHECKING:  # the capture module imports this one's helpers
    from l2lightning.callback.step_capture import _Graph


class PrefetchSetup:
    """Prefetch and compile for the captured step: hooks, tuning, the whole-step gate."""

    def _prepare_compiled(self, pl_module: LightningModule, batch: Any) -> None:
        """compile=True: install the prefetch points first, then compile the children.

        Dynamo guards on a module's hooks, so hooks added after the first compiled call would force
        a recompile inside the capture, where compiling cannot run. The points are custom ops
        (l2lightning.prefetch.ops) that dynamo traces into the compiled graph; they act only inside
        the capture's scope, checked at run time, so the warm-up steps run the same compiled code.
        """
        self._static_for_prefetch = StaticBatch(batch, self._batch_reads)
        self._install_prefetch(pl_module)
        for child in pl_module.children():
            self._compiled_children.append(child)
            self._children_forward.append(vars(child).get("forward", ABSENT))
            child.forward = _compiled_forward(child)  # type: ignore[method-assign]
        self._compile_pending = True

    def _install_prefetch(self, pl_module: LightningModule) -> None:
        if self.prefetch == "off" or self._prefetch_failed:
            return
        # Finding the layer chain runs training_step on the static batch, and the tuner times
        # copies of layers: neither may leave a trace (BatchNorm statistics, metric states, RNG).
        started = time.perf_counter()
        if torch.cuda.is_available():
            # The warm-up steps' freed blocks stay cached on the step's stream, where the tuner (on
            # its own streams) cannot reuse them: given back first, they are not part of tuning's
            # peak. On the d1024x60 stack the defaults' reserved peak was tuning's 86 MiB on top of
            # 190 MiB of such segments, 80 MiB over `off` (benchmarks/memory_peak.py on the H200).
            free_cached_memory()
            self._collected_for_capture = True
        out_of_memory = None
        try:
            with _leaves_no_trace(pl_module, self._fit.optimizer.optimizer if self._fit.optimizer else None):
                self._hooks = self._prefetch_hooks(pl_module)
        except torch.OutOfMemoryError as exc:
            # The tuner's throwaway copies and timing graphs did not fit: capture the step without
            # prefetch (the graph alone is most of the gain). Only the message is kept: the
            # traceback's frames hold the tuner's chains until the exception is gone.
            self._hooks = None
            out_of_memory = first_line(exc)
        finally:
            self._cost_s["tuning_s"] += time.perf_counter() - started
        if out_of_memory is not None:
            free_cached_memory()  # the chains are unreachable now: their blocks go back to the driver
            self._warn_once(
                "prefetch-oom",
                f"prefetch off: out of memory while tuning it ({memory_state()}; {out_of_memory}); "
                "capturing the step without prefetch.",
            )
            self._prefetch_failed = True
        if self._hooks is not None:
            self._tuning_report = self._hooks.tuning_report
            self.plans = self._hooks.plan_summary()
        else:
            # No prefetch here (no kernel to launch: no CuPy, no CUDA): a re-capture does not try
            # again, which would save and put back the module's and the optimizer's state for nothing
            self._prefetch_failed = True

    def _prefetch_hooks(self, pl_module: LightningModule) -> Any:
        if self.prefetch == "off":
            return None
        reason = prefetch_unavailable_reason()
        if reason:
            self._warn_once("prefetch", f"prefetch off ({reason}); capturing the graph without it.")
            return None
        from l2lightning.prefetch.hooks import PrefetchHooks

        static_batch = self._static_for_prefetch.batch
        dry_step = dry_step_of(
            self._fit.originals["training_step"], self._installed.get("log", self._fit.originals["log"])
        )

        plans: Any = None if self.prefetch in ("default", "decoy") else self.prefetch
        return PrefetchHooks(
            pl_module,
            static_batch,
            backward=self.backward_prefetch,
            step=dry_step,
            plans=plans,
            decoy=self.prefetch == "decoy",
            scope="manual",
            via="ops" if self.compile else "hooks",
            autotune=self.autotune,
        )

    def _prefetch_scope(self) -> Any:
        if self._hooks is None or self._gate_capturing:
            # no scope: the hooks issue nothing, forward or backward (the gate's capture without prefetch)
            return contextlib.nullcontext()
        return self._hooks.scope()

    def _gate_may_start(self) -> bool:
        """Whether a capture now, with the tuned plans, starts the whole-step gate's trial."""
        hooks = self._hooks
        return not (
            self.gate_pairs == 0
            or self.prefetch not in self._GATED_MODES
            or self._gate_result is not None  # one trial per fit
            or hooks is None
            or not hooks.enabled
            or getattr(hooks, "via", "hooks") != "hooks"  # compile=True: custom-op points, no scope
            or not any(row.get("forward") or row.get("backward") for row in self.plans)
            # another accumulation role's graph, captured with the plans, would keep them whatever the trial says
            or bool(self._slots.parked_graphs())
        )

    def _start_gate(self, graph: _Graph) -> None:
        """After the first capture with tuned plans: the trial, on this graph with its prefetch
        switched off and on, or (where it cannot be switched) on a second capture without it."""
        if not self._gate_may_start():
            return
        switch, why = self._prefetch_switch(graph.graph)
        if switch is None:
            rank_zero_debug(f"L2GraphCallback: whole-step gate by a second capture: {why}")
        self._gate = StepGate(graph, self.gate_pairs, switch=switch)

    def _prefetch_switch(self, graph: Any) -> tuple[Any, str]:
        """The switch over `graph`'s prefetch kernel nodes (instantiating it), or None and why."""
        from l2lightning.graph.prefetch_switch import find_switch, prefetch_functions

        try:
            instantiate = getattr(graph, "instantiate", None)
            if instantiate is None:
                return None, "the graph cannot be instantiated before its first replay"
            instantiate()
            return find_switch(graph, prefetch_functions(self._fit.module.device.index or 0))
        except Exception as exc:  # noqa: BLE001 - any failure leaves the second capture, which always works
            return None, f"{type(exc).__name__}: {first_line(exc)}"

    def _finish_gate(self) -> None:
        """Judge the trial (one wait for its last replay), keep the faster graph, free the other."""
        gate, self._gate = self._gate, None
        result = gate.decide()
        kept, dropped = gate.winner_and_loser(result)
        gate.settle(result.kept)
        self._gate_result = result
        self._graph = kept
        # the dropped graph's gradients must not keep its pool alive
        kept.bind_grads()
        self._pool_mib = self._pools_alive_mib(kept)  # the dropped graph's pool no longer counts
        if result.kept == "off":
            self._reject_prefetch()
        self._fit_report.timing.graph.clear()  # graph_step_ms: the kept graph's replays from here on
        del gate, dropped
        free_cached_memory()
        rank_zero_info(
            f"L2GraphCallback: whole-step gate: {result.reason}; the step runs "
            f"{'with its prefetch plans' if result.kept == 'prefetch' else 'without prefetch'}."
        )

    def _abandon_gate(self, reason: str) -> None:
        """A trial that cannot finish proves nothing: the fit goes on without prefetch."""
        method = None
        if self._gate is not None:
            self._gate.settle("off")
            method = self._gate.method
        self._gate = None
        self._gate_turn = None
        self._gate_result = StepGateResult("off", None, None, None, reason, method)
        self._reject_prefetch()

    def _reject_prefetch(self) -> None:
        """No prefetch for the rest of the fit (a later capture captures the step without it)."""
        if self._hooks is not None:
            self._hooks.remove()
            self._hooks = None
        self._prefetch_failed = True
        self.plans = []


@contextlib.contextmanager
def _leaves_no_trace(module: LightningModule, optimizer: Any) -> Any:
    """Run code on the module that must leave nothing behind: parameters, buffers, metrics, RNG."""
    metrics = [m for _, m in named_metrics(module)]
    attributes = [(m, attr, shallow_copy(getattr(m, attr))) for m in metrics for attr in m._defaults]
    python = [(m, m._update_count, m._forward_cache, m._computed) for m in metrics]
    tensors = [value for _, _, value in attributes if isinstance(value, torch.Tensor)]
    # in host memory: on the GPU these copies (parameters, buffers, optimizer moments: three times the
    # parameter bytes with Adam) were the largest part of the defaults' peak over prefetch="off"
    # (benchmarks/memory_peak.py on the H200)
    saved = TrainingState.save(module, optimizer, tensors, offload=True)
    try:
        # a print in training_step (a periodic `print(loss.item())`) must not print for a step that is not one
        with contextlib.redirect_stdout(io.StringIO()):
            yield
    finally:
        for m, attr, value in attributes:
            setattr(m, attr, value)
        for m, count, cache, computed in python:
            m._update_count, m._forward_cache, m._computed = count, cache, computed
        saved.restore(optimizer)


def dry_step_of(training_step: Callable[..., Any], log: Callable[..., Any]) -> Callable[[Any, Any], Any]:
    """The user's `training_step` as the chain discovery's dry run calls it: `(module, batch)`, with
    ``batch_idx`` 0 where the step takes one (as Lightning decides: ``training_step(self, batch)``
    failed with a TypeError here), logging nothing, and `log` put back on the module after."""
    try:
        takes_batch_idx = is_param_in_hook_signature(training_step, "batch_idx", min_args=2)
    except (TypeError, ValueError):  # no signature to read: called as before, with batch_idx
        takes_batch_idx = True

    def dry_step(module: Any, batch: Any) -> Any:
        module.log = lambda *a, **k: None  # the dry run must not log
        try:
            return training_step(batch, 0) if takes_batch_idx else training_step(batch)
        finally:
            module.log = log

    return dry_step


def _compiled_forward(module: torch.nn.Module) -> Callable[..., Any]:
    """``module.forward`` compiled by ``torch.compile`` (default mode), entered through this file.

    ``nn.Module.compile()`` compiles ``_call_impl``, a frame in torch's own files that dynamo skips:
    for a container of torch modules (an ``nn.Sequential`` of Linear/LayerNorm/GELU) nothing gets
    compiled. A wrapper defined here is user code, so dynamo compiles it and inlines the module
    calls (and their hooks) below it.
    """
    original = module.forward

    def forward(*args: Any, **kwargs: Any) -> Any:
        return original(*args, **kwargs)

    return torch.compile(forward)
