"""Prefetch and compile for the captured step: hooks, tuning, the whole-step gate.

A part :class:`l2lightning.callback.graph_callback.L2GraphCallback` holds (``_prefetch``), one per fit: it
keeps what the prefetch set-up installs and decides (the prefetch hooks and their tuning report, whether
prefetch is off for the rest of the fit, compile=True's compiled children, the whole-step gate's trial,
its turn and its verdict) in its own ``__init__``, reads the fit through
:class:`l2lightning.callback.fit_state.FitState` and reaches the rest of the callback only through what
it is given: the callback's settings, its warnings, its cost counters, its list of compiled children,
the graphs of the other accumulation roles, and the callables that set what the callback owns (its
public ``plans``, the graph the steps replay).
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
from l2lightning.callback.fit_report import FitReport
from l2lightning.callback.fit_state import FitState
from l2lightning.callback.step_gate import StepGate, StepGateResult
from l2lightning.callback.step_overrides import shallow_copy
from l2lightning.graph.attributes import ABSENT, put_back
from l2lightning.graph.capture import StaticBatch, TrainingState
from l2lightning.graph.cuda_memory import free_cached_memory, memory_state
from l2lightning.graph.graph_slots import GraphSlots
from l2lightning.guards.metric_binding import (
    named_metrics,
)
from l2lightning.guards.step_trace import first_line

if TYPE_CHECKING:  # the capture module imports this one's helpers
    from l2lightning.callback.step_capture import _Graph
    from l2lightning.prefetch.plan import PrefetchPlan


class PrefetchSetup:
    """Prefetch and compile for the captured step: hooks, tuning, the whole-step gate."""

    # Prefetch settings the whole-step gate judges: the tuner's plans. "default" and explicit plans are
    # what the user asked for, "decoy" is a control that benchmarks must see as it is.
    _GATED_MODES: tuple[str, ...] = ("auto",)

    def __init__(
        self,
        fit: FitState,
        fit_report: FitReport,
        slots: GraphSlots,
        *,
        prefetch: str | PrefetchPlan,
        backward_prefetch: bool,
        autotune: Any,
        compile: bool,
        gate_pairs: int,
        warn_once: Callable[[str, str], None],
        cost_s: dict[str, float],
        compiled_children: list[torch.nn.Module],
        installed_log: Callable[[], Any],
        plans: Callable[[], list[dict[str, Any]]],
        set_plans: Callable[[list[dict[str, Any]]], None],
        keep_graph: Callable[[_Graph], None],
    ) -> None:
        self._fit = fit
        self._fit_report = fit_report  # the kept graph's replay times start afresh after the trial
        # the per-graph state (the trial's own) and the other accumulation roles' graphs, which the trial keeps away from
        self._slots = slots
        # the callback's settings as the fit started (its prefetch: "auto", "default", "off", "decoy" or a
        # PrefetchPlan; with compile=True the hooks are custom-op points in the compiled children)
        self._setting = prefetch
        self._backward_prefetch = backward_prefetch
        self._autotune = autotune
        self._compile = compile
        self._gate_pairs = gate_pairs
        self._warn_once = warn_once  # one warning per cause and fit (the callback's)
        # the seconds by cost of the callback's CaptureCosts record: tuning counts into "tuning_s"
        self._cost_s = cost_s
        # the children compile=True compiled: the callback's list (the warm-up part reads it too), filled
        # here and emptied in place at the fit's end
        self._compiled_children = compiled_children
        # the module's `log` during the fit (the callback's override), put back after the dry run
        self._installed_log = installed_log
        # What this part decides but the callback owns, through the callables it is given rather than by
        # holding the callback: the plans (read and set: the callback's public `plans`, which its state_dict
        # saves and a later fit keeps) and the trial's winner as the graph the steps replay (the role's
        # `_slots.state.graph`, the capture's and the decision's as much as the gate's, its pools alive
        # counted anew by the capture part, made after this one: so through the callback)
        self._plans = plans
        self._set_plans = set_plans
        self._keep_graph = keep_graph
        # the prefetch hooks (l2lightning.prefetch.hooks.PrefetchHooks), once installed
        self.hooks: Any = None
        self.tuning_report: Any = None  # what their tuner measured (summary()["tuning"])
        # no prefetch for the rest of this fit: tuning ran out of memory, the gate said no, the step is a
        # manual one or draws from cuDNN's RNN dropout state (which the dry run would move on)
        self.failed = False
        self.static_batch: StaticBatch | None = None  # the batch the chain discovery's dry run reads
        # per compiled child, the `forward` its instance held before compile=True replaced it, or ABSENT
        self._children_forward: list[Any] = []
        self.compile_pending = False  # compile=True: the next step compiles (and is timed as compile_s)
        # Of the whole-step gate's trial (its graphs and their replay times are per graph, `_slots.state.gate`:
        # GraphSlots parks it with its accumulation role's graph): whose turn this replay is, whether the
        # capture under way is the trial's step without prefetch (no scope: the hooks issue nothing), and the
        # verdict (one per fit).
        self.gate_turn: str | None = None
        self.gate_capturing = False
        self.gate_result: StepGateResult | None = None

    def prepare_compiled(self, pl_module: LightningModule, static: StaticBatch) -> None:
        """compile=True: install the prefetch points first (the dry run reads `static`), then compile the children.

        Dynamo guards on a module's hooks, so hooks added after the first compiled call would force
        a recompile inside the capture, where compiling cannot run. The points are custom ops
        (l2lightning.prefetch.ops) that dynamo traces into the compiled graph; they act only inside
        the capture's scope, checked at run time, so the warm-up steps run the same compiled code.
        """
        # (whether it collected does not matter here: the capture step, later, collects on its own)
        self.install(pl_module, static)
        for child in pl_module.children():
            self._compiled_children.append(child)
            self._children_forward.append(vars(child).get("forward", ABSENT))
            child.forward = _compiled_forward(child)  # type: ignore[method-assign]
        self.compile_pending = True

    def install(self, pl_module: LightningModule, static: StaticBatch) -> bool:
        """Find the layer chain (a dry run of the step on `static`), tune and install the prefetch hooks;
        whether it collected all generations before tuning (so the capture in the same step need not)."""
        self.static_batch = static
        if self._setting == "off" or self.failed:
            return False
        collected = False
        # Finding the layer chain runs training_step on the static batch, and the tuner times
        # copies of layers: neither may leave a trace (BatchNorm statistics, metric states, RNG).
        started = time.perf_counter()
        if torch.cuda.is_available():
            # The warm-up steps' freed blocks stay cached on the step's stream, where the tuner (on
            # its own streams) cannot reuse them: given back first, they are not part of tuning's
            # peak. On the d1024x60 stack the defaults' reserved peak was tuning's 86 MiB on top of
            # 190 MiB of such segments, 80 MiB over `off` (benchmarks/memory_peak.py on the H200).
            free_cached_memory()
            collected = True
        out_of_memory = None
        try:
            with _leaves_no_trace(pl_module, self._fit.optimizer.optimizer if self._fit.optimizer else None):
                self.hooks = self._prefetch_hooks(pl_module)
        except torch.OutOfMemoryError as exc:
            # The tuner's throwaway copies and timing graphs did not fit: capture the step without
            # prefetch (the graph alone is most of the gain). Only the message is kept: the
            # traceback's frames hold the tuner's chains until the exception is gone.
            self.hooks = None
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
            self.failed = True
        if self.hooks is not None:
            self.tuning_report = self.hooks.tuning_report
            self._set_plans(self.hooks.plan_summary())
        else:
            # No prefetch here (no kernel to launch: no CuPy, no CUDA): a re-capture does not try
            # again, which would save and put back the module's and the optimizer's state for nothing
            self.failed = True
        return collected

    def _prefetch_hooks(self, pl_module: LightningModule) -> Any:
        if self._setting == "off":
            return None
        reason = prefetch_unavailable_reason()
        if reason:
            self._warn_once("prefetch", f"prefetch off ({reason}); capturing the graph without it.")
            return None
        from l2lightning.prefetch.hooks import PrefetchHooks

        static_batch = self.static_batch.batch
        dry_step = dry_step_of(self._fit.originals["training_step"], self._installed_log())

        plans: Any = None if self._setting in ("default", "decoy") else self._setting
        return PrefetchHooks(
            pl_module,
            static_batch,
            backward=self._backward_prefetch,
            step=dry_step,
            plans=plans,
            decoy=self._setting == "decoy",
            scope="manual",
            via="ops" if self._compile else "hooks",
            autotune=self._autotune,
        )

    def scope(self) -> Any:
        """Around the captured forward: the prefetch hooks' scope (none: they issue nothing)."""
        if self.hooks is None or self.gate_capturing:
            # no scope: the hooks issue nothing, forward or backward (the gate's capture without prefetch)
            return contextlib.nullcontext()
        return self.hooks.scope()

    def gate_may_start(self) -> bool:
        """Whether a capture now, with the tuned plans, starts the whole-step gate's trial."""
        hooks = self.hooks
        return not (
            self._gate_pairs == 0
            or self._setting not in self._GATED_MODES
            or self.gate_result is not None  # one trial per fit
            or hooks is None
            or not hooks.enabled
            or getattr(hooks, "via", "hooks") != "hooks"  # compile=True: custom-op points, no scope
            or not any(row.get("forward") or row.get("backward") for row in self._plans())
            # another accumulation role's graph, captured with the plans, would keep them whatever the trial says
            or bool(self._slots.parked_graphs())
        )

    def start_gate(self, graph: _Graph) -> None:
        """After the first capture with tuned plans: the trial, on this graph with its prefetch
        switched off and on, or (where it cannot be switched) on a second capture without it."""
        if not self.gate_may_start():
            return
        switch, why = self._prefetch_switch(graph.graph)
        if switch is None:
            rank_zero_debug(f"L2GraphCallback: whole-step gate by a second capture: {why}")
        self._slots.state.gate = StepGate(graph, self._gate_pairs, switch=switch)

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

    def finish_gate(self) -> None:
        """Judge the trial (one wait for its last replay), keep the faster graph, free the other."""
        gate, self._slots.state.gate = self._slots.state.gate, None
        result = gate.decide()
        kept, dropped = gate.winner_and_loser(result)
        gate.settle(result.kept)
        self.gate_result = result
        kept.bind_grads()  # the dropped graph's gradients must not keep its pool alive
        self._keep_graph(kept)  # the one the steps replay; the dropped graph's pool no longer counts
        if result.kept == "off":
            self._reject_prefetch()
        self._fit_report.timing.graph.clear()  # graph_step_ms: the kept graph's replays from here on
        del gate, dropped
        free_cached_memory()
        rank_zero_info(
            f"L2GraphCallback: whole-step gate: {result.reason}; the step runs "
            f"{'with its prefetch plans' if result.kept == 'prefetch' else 'without prefetch'}."
        )

    def abandon_gate(self, reason: str) -> None:
        """A trial that cannot finish proves nothing: the fit goes on without prefetch."""
        method = None
        if self._slots.state.gate is not None:
            self._slots.state.gate.settle("off")
            method = self._slots.state.gate.method
        self._slots.state.gate = None
        self.gate_turn = None
        self.gate_result = StepGateResult("off", None, None, None, reason, method)
        self._reject_prefetch()

    def keep_prefetch_graph(self, reason: str) -> _Graph:
        """The trial's step without prefetch could not be captured (`reason`): the trial ends, and the
        graph with prefetch, returned, is the one the steps replay."""
        graph = self._slots.state.gate.graphs["prefetch"]
        self._slots.state.gate = None
        self.gate_result = StepGateResult("prefetch", None, None, None, reason, "second capture")
        return graph

    def drop_gate(self) -> None:
        """The fit trains eagerly from here on, or ends: the trial, unjudged, goes with its graphs."""
        self._slots.state.gate = None
        self.gate_turn = None

    def _reject_prefetch(self) -> None:
        """No prefetch for the rest of the fit (a later capture captures the step without it)."""
        if self.hooks is not None:
            self.hooks.remove()
            self.hooks = None
        self.failed = True
        self._set_plans([])

    def remove(self) -> None:
        """At the fit's end: compile=True's children get their `forward` back, the prefetch hooks come
        off, and nothing of the fit's batch is kept."""
        for child, before in zip(self._compiled_children, self._children_forward):
            put_back(child, "forward", before)  # the class's forward, or a library's per-instance wrapper
        self._compiled_children.clear()  # (the callback's list: the warm-up part holds it too)
        self._children_forward = []
        if self.hooks is not None:
            self.hooks.remove()
            self.hooks = None
        self.static_batch = None


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
