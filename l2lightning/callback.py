"""L2GraphCallback: Lightning's own training step captured in one CUDA graph, with L2 weight prefetch.

Route chosen: a callback that installs instance-level overrides of the LightningModule's documented
hooks (``training_step``, ``optimizer_zero_grad``, ``backward``, ``configure_gradient_clipping``
and, where the user defined them, ``on_before_zero_grad``, ``on_before_backward``,
``on_after_backward``, ``on_before_optimizer_step``), and wraps the optimizer's ``step``. A
callback cannot swap the Trainer's strategy, and the product's front door is
``Trainer(callbacks=[L2GraphCallback()])`` on an unmodified module. No private Lightning method is
patched; everything is removed again at ``teardown`` and, after an error, at ``on_exception``.

One step of automatic optimization goes ``optimizer_step`` hook -> ``LightningOptimizer.step`` ->
``Precision.optimizer_step`` -> ``optimizer.step(closure)``, where the closure runs
``training_step``, ``on_before_zero_grad``/``optimizer_zero_grad``, ``backward`` with its hooks,
``on_before_optimizer_step`` and gradient clipping. The callback works at ``optimizer.step``, so a
user's ``optimizer_step`` override (an LR warm-up setting ``pg["lr"]``) runs in Python every step,
around whatever the step does:

* warm-up steps run eagerly and are traced (:mod:`l2lightning.step_trace`): two steps that run
  different ops or host values, host syncs, host tensors that change, list-state metrics are
  refused before anything is captured, naming the user's line;
* the capture step records the closure and the optimizer update in one graph and replays it once,
  which is that step's real update;
* every later step copies the batch into the static buffers, replays, and calls the closure in
  replay mode: ``training_step`` returns this step's outputs (extra tensors as fresh copies), every
  ``self.log`` call recorded at capture is re-issued with this replay's values (Python numbers
  re-evaluated from their source where it can be read), hooks the graph ran are not run again, and
  torchmetrics objects updated in the step get their Python-side state back
  (:mod:`l2lightning.metric_binding`).

Before each replay the callback checks, from metadata only (never a host sync), what a graph
cannot see: the batch's structure and shapes, the branch the step takes on the step counters
(:mod:`l2lightning.step_source`), ``eager_steps``, the accumulation factor, the optimizer's baked
hyperparameters, modules' ``training`` flags and parameters' ``requires_grad``. A step that does
not match runs eagerly or is captured again (bounded); anything that cannot be replayed faithfully
runs eagerly with one warning naming the cause. A capture that fails leaves the model, optimizer,
RNG (the CUDA generator included) and process as a plain fit would have them.
"""

from __future__ import annotations

import contextlib
import gc
import io
import math
import statistics
import time
import warnings
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from lightning.pytorch.utilities.model_helpers import is_overridden
from typing_extensions import override

from l2lightning import python_state
from l2lightning._env import cuda_unavailable_reason, prefetch_unavailable_reason
from l2lightning.capture import StaticBatch, TrainingState, batch_signature, graph_capture, loss_of
from l2lightning.log_replay import ReissuedLog
from l2lightning.metric_binding import (
    MetricBinding,
    drop_autograd_graphs,
    named_metrics,
    needs_sync_free_nan_check,
    sync_free_nan_check,
    unreplayable_reason,
    update_counts,
    updated_between,
)
from l2lightning.module_flags import ModuleFlags
from l2lightning.optim import (
    CapturableOptimizer,
    OptimizerNotCapturableError,
    installed_capturable,
    make_capturable,
)
from l2lightning.prefetch.plan import PrefetchPlan
from l2lightning.step_gate import GATE_PAIRS, StepGate, StepGateResult
from l2lightning.step_source import StepSource, analyse
from l2lightning.step_trace import (
    CaptureRefused,
    HostConstants,
    StepTrace,
    StepTracer,
    describe_frame,
    first_difference,
    user_frame_of_traceback,
)

PREFETCH_MODES = ("off", "default", "auto", "decoy")
# Hooks inside the closure that the graph runs once at capture; a replay re-issues their log calls.
CAPTURED_HOOKS = (
    "on_before_zero_grad",
    "on_before_backward",
    "on_after_backward",
    "on_before_optimizer_step",
)
UNSUPPORTED_STRATEGIES = ("FSDPStrategy", "DeepSpeedStrategy", "ModelParallelStrategy", "XLAStrategy")
# Module methods replaced for the fit: replay mode skips them or answers from the graph.
_MODULE_OVERRIDES = ("training_step", "optimizer_zero_grad", "backward", "configure_gradient_clipping", "log")
# Timed replays whose events must have completed before the l2/* metrics are first logged.
TIMED_REPLAYS_BEFORE_LOG = 5
# CUDA-event pairs kept for the step-time medians (a window, so a long fit holds no growing list).
TIMING_WINDOW = 256
# Traced warm-up steps after which a fit that found no capturable stretch stops trying.
MAX_TRACED_STEPS = 24
# Re-captures on consecutive steps after which a schedule is taken to change the graph every step.
RECAPTURE_STREAK_LIMIT = 3
# Steps on one other branch in a row after which that branch is captured in place of the current one
BRANCH_SWITCH_STEPS = 3


def metric_update_reason(names: list[str], detail: str | None = None) -> str:
    """Why torchmetrics objects updated inside ``training_step`` keep the step from being captured."""
    return (
        f"training_step updates the torchmetrics objects {names}, and "
        + (detail or "a replayed graph would skip their Python-side state")
        + "; update them in `on_train_batch_end` from the outputs training_step returns "
        "(for example `return {'loss': loss, 'preds': preds.detach()}`)"
    )


# PyTorch's warning when a gradient reaches a parameter through an AccumulateGrad node made in an
# earlier step (kept alive by a tensor that still holds that step's autograd graph)
STALE_GRAPH_WARNING = "AccumulateGrad node's stream does not match"
STALE_GRAPH_HINT = (
    "a tensor kept from an earlier step still holds that step's autograd graph (for example a loss "
    "stored on the module, `self.last_loss = loss`), and its parameters' gradient accumulators are bound "
    "to the stream that step ran on; keep `loss.detach()` instead"
)


@dataclass
class _Timing:
    """CUDA-event pairs of eager and replayed steps (the latest ``TIMING_WINDOW``); read without host syncs."""

    eager: deque = field(default_factory=lambda: deque(maxlen=TIMING_WINDOW))
    graph: deque = field(default_factory=lambda: deque(maxlen=TIMING_WINDOW))
    graph_count: int = 0

    @staticmethod
    def _median_ms(pairs: Any) -> float | None:
        done = [start.elapsed_time(end) for start, end in pairs if end.query()]
        return statistics.median(done) if done else None

    def eager_ms(self) -> float | None:
        return self._median_ms(self.eager)

    def graph_ms(self) -> float | None:
        return self._median_ms(self.graph)


@dataclass
class _Group:
    """Traced warm-up steps that share a batch signature and a branch through the step."""

    traces: list[StepTrace] = field(default_factory=list)
    metrics: set[str] = field(default_factory=set)
    problem: str | None = None  # why this group can never be captured
    dropped_first: bool = False  # its first traced step differed from the next and was set aside
    timed: int = 0  # untraced, timed eager steps of this group
    appended: list[frozenset[str]] = field(default_factory=list)  # lists each traced step appended to


@dataclass
class _Graph:
    """One captured step and what its replays need."""

    graph: Any
    static: StaticBatch
    key: tuple
    output: Any = None
    grads: list[tuple[torch.Tensor, torch.Tensor | None]] = field(default_factory=list)
    log_calls: list[ReissuedLog] = field(default_factory=list)
    binding: MetricBinding | None = None
    constants: HostConstants | None = None
    flags: tuple = ()
    # lists the step appends to, with the element the capture appended (graph tensors: copied per replay)
    appends: list[tuple[python_state.Append, Any]] = field(default_factory=list)
    # Python numbers the capture may have baked in (python_state.baked_scalars), checked before each replay
    scalars: list[tuple[dict, str, Any]] = field(default_factory=list)


class _Defer(Exception):
    """training_step returned None at the capture step: capture at a later step."""


class L2GraphCallback(Callback):
    """Capture the whole training step (forward, loss, backward, optimizer step) in one CUDA graph.

    Inside the graph a side-stream kernel prefetches into L2 the weights the next layer will read
    (forward: W_{i+1}; backward: W_{i-1}). Gradients stay bit-identical to an eager run of the same
    (capturable) optimizer configuration, ``make_capturable(optimizer)``; ``verify=True`` checks
    that at capture. What cannot be replayed faithfully runs eagerly, with one warning naming the
    cause and, where there is one, the user's line.

    Args:
        warmup_steps: eager steps before the capture (>= 1). The first ``warmup_steps - 1`` (at
            least one) are traced and compared op by op, the last one is timed.
        prefetch: ``"auto"`` (the autotuner keeps a plan per layer shape only where it measurably
            pays), ``"default"`` (plans sized by layer bytes), ``"off"`` (graph only), ``"decoy"``
            (same traffic at the wrong layer: a control for benchmarks), or a
            :class:`~l2lightning.PrefetchPlan` for every layer large enough.
        backward_prefetch: also prefetch W_{i-1} in backward.
        verify: at capture, run the step once eagerly and once captured from the same state, and
            raise :class:`~l2lightning.EquivalenceError` if the loss, a gradient or a parameter
            differs in any bit. Meant for users' GPU CI.
        compile: compile the LightningModule's child modules with ``torch.compile`` (default mode,
            no CUDA graphs of its own) at the first step, so inductor's fusion runs inside the
            whole-step graph (prefetch through :mod:`l2lightning.prefetch.ops`).
        report: print the step report (per-layer plans, tuning table, timings) at capture.
        eager_optimizer_fallback: train eagerly (with a warning) when the optimizer cannot be
            captured, instead of raising.
        log_timing: log ``l2/eager_step_ms``, ``l2/graph_step_ms``, ``l2/replay_speedup`` (their ratio:
            CUDA-event time of an eager step over one graph replay, Lightning's host work left out),
            ``l2/graph_pool_mib``, ``l2/tuning_s``, ``l2/capture_s``, ``l2/compile_s`` (wall seconds
            of prefetch tuning, of the captures, of the first compiled step), ``l2/prefetch_layers``,
            ``l2/prefetch_mib`` and ``l2/fallback_steps`` through the Trainer's loggers on rank zero, once the first
            replays have finished on the device (read without a host sync), and at each epoch end.
        eager_steps: ``(trainer, batch_idx) -> bool``; steps for which it returns True run eagerly
            (a periodic target-network sync, image logging, a print), and their effects flow into
            the next replay. Branches on ``self.global_step``/``current_epoch``/``batch_idx`` that
            the callback can read in ``training_step`` are handled without it.
        autotune: the autotuner behind ``prefetch="auto"``: None (its defaults) or a mapping of
            :class:`~l2lightning.Autotuner`'s arguments.
        gate_pairs: with ``prefetch="auto"``, the whole-step gate (:mod:`l2lightning.step_gate`):
            the step is captured a second time without prefetch, the next ``2 * gate_pairs`` steps
            replay the two graphs in turn, and the plans stay only if the 95% confidence interval
            of the whole step's gain is above zero. 0 keeps the tuner's plans without the gate.

    Example:
        >>> from lightning.pytorch import Trainer
        >>> from l2lightning import L2GraphCallback
        >>> cb = L2GraphCallback(eager_steps=lambda trainer, batch_idx: trainer.global_step % 100 == 0)
        >>> trainer = Trainer(accelerator="gpu", devices=1, max_steps=1000, callbacks=[cb])
        >>> trainer.fit(model, datamodule=dm)  # doctest: +SKIP
    """

    # Prefetch settings the whole-step gate judges: the tuner's plans. "default" and explicit plans are
    # what the user asked for, "decoy" is a control that benchmarks must see as it is.
    _GATED_MODES: tuple[str, ...] = ("auto",)

    def __init__(
        self,
        warmup_steps: int = 3,
        prefetch: str | PrefetchPlan = "auto",
        backward_prefetch: bool = True,
        verify: bool = False,
        compile: bool = False,
        report: bool = False,
        eager_optimizer_fallback: bool = False,
        log_timing: bool = True,
        eager_steps: Callable[[Trainer, int], bool] | None = None,
        autotune: Any = None,
        gate_pairs: int = GATE_PAIRS,
    ) -> None:
        super().__init__()
        if isinstance(warmup_steps, bool) or not isinstance(warmup_steps, int) or warmup_steps < 1:
            raise ValueError(f"`warmup_steps` must be an int >= 1, got {warmup_steps!r}")
        if not isinstance(prefetch, PrefetchPlan) and prefetch not in PREFETCH_MODES:
            raise ValueError(
                f"`prefetch` must be one of {PREFETCH_MODES} or a PrefetchPlan, got {prefetch!r}"
            )
        for name, value in [
            ("backward_prefetch", backward_prefetch),
            ("verify", verify),
            ("compile", compile),
            ("report", report),
            ("eager_optimizer_fallback", eager_optimizer_fallback),
            ("log_timing", log_timing),
        ]:
            if not isinstance(value, bool):
                raise TypeError(f"`{name}` must be a bool (True or False), got {value!r}")
        if (
            isinstance(gate_pairs, bool)
            or not isinstance(gate_pairs, int)
            or gate_pairs < 0
            or gate_pairs == 1
        ):
            raise ValueError(
                f"`gate_pairs` must be 0 (no whole-step gate) or an int >= 2, got {gate_pairs!r}"
            )
        if eager_steps is not None and not callable(eager_steps):
            raise TypeError(
                f"`eager_steps` must be None or a callable (trainer, batch_idx) -> bool, got {eager_steps!r}"
            )
        from l2lightning.prefetch.hooks import make_autotuner

        make_autotuner(autotune)  # a wrong `autotune` fails here, naming the argument, not at capture
        self.autotune = autotune
        self.warmup_steps = warmup_steps
        self.prefetch = prefetch
        self.backward_prefetch = backward_prefetch
        self.verify = verify
        self.compile = compile
        self.report = report
        self.eager_optimizer_fallback = eager_optimizer_fallback
        self.log_timing = log_timing
        self.eager_steps = eager_steps
        self.gate_pairs = gate_pairs
        self._reset_run_state()
        # Persisted through state_dict (chosen plans and capture step of the last run).
        self.capture_step: int | None = None
        self.plans: list[dict[str, Any]] = []

    # ------------------------------------------------------------------ state
    def _reset_run_state(self) -> None:
        if getattr(self, "_flags", None) is not None:
            self._flags.close()  # its global registration hooks, should a fit have ended without clean-up
        self.disabled_reason: str | None = None
        self.verify_report: Any = None
        self.fallback_steps = 0
        self.captures = 0
        self._fallback_causes: set[str] = set()
        self._warned: set[str] = set()
        self._module: LightningModule | None = None
        self._trainer: Trainer | None = None
        self._installed: dict[str, Any] = {}  # module attribute -> our override
        self._callback_overrides: list[tuple[Any, str]] = []
        self._mode = "eager"
        self._optimizer: CapturableOptimizer | None = None
        self._owns_optimizer = False
        self._nan_patched: list[Any] = []
        self._graph: _Graph | None = None
        self._flags: ModuleFlags | None = None  # the module's train()/requires_grad flags, read per replay
        self._groups: dict[tuple, _Group] = {}
        self._baked_history: list[Any] = []  # the optimizer's baked hyperparameters at each warm-up step
        self._traced_steps = 0
        self._tracer: StepTracer | None = None
        self._step_logs: dict[str, list[Any]] = {}  # Python-number log values per key, over the traced steps
        self._capture_logs: list[ReissuedLog] = []
        self._pending: tuple[Any, int] | None = None  # this step's (batch, batch_idx)
        self._pending_key: tuple = ()
        self._in_step = False
        self._reissued: set[str] = set()
        self._recapture_streak = 0
        self._recapture_next = False
        self._other_branch: tuple[Any, int] = (None, 0)  # a branch key other than the graph's, and its run
        self._live_log_values: set[str] = set()
        self._eager_hooks: set[str] = set()
        self._memo: list[tuple[str, Any]] = []
        self._originals: dict[str, Any] = {}
        self._capture_graph: _Graph | None = None
        self._source = StepSource()
        self._hooks: Any = None
        self._timing = _Timing()
        self._pool_mib: float | None = None
        self._timing_logged = False
        self._tuning_report: Any = None
        self._step_output: Any = None
        self._captured = False
        self._compiled_children: list[torch.nn.Module] = []
        self._static_for_prefetch: StaticBatch | None = None
        # The stream every non-replayed step runs on, and the capture too (set at the first step)
        self._step_stream: Any = None
        # What capturing cost: wall seconds of prefetch tuning (chain discovery and the tuner), of
        # the captures (verify included) and of torch.compile's first compiled step
        self._cost_s: dict[str, float] = {"tuning_s": 0.0, "capture_s": 0.0, "compile_s": 0.0}
        self._compile_pending = False  # compile=True: the next step compiles (and is timed as compile_s)
        # no prefetch for the rest of this fit: tuning ran out of memory, or the whole-step gate said no
        self._prefetch_failed = False
        # The whole-step gate's trial (both graphs and their replay times), whose turn this replay is,
        # whether the capture under way is the trial's step without prefetch, and the verdict.
        self._gate: StepGate | None = None
        self._gate_turn: str | None = None
        self._gate_capturing = False
        self._gate_result: StepGateResult | None = None
        from l2lightning.step_report import PhaseEvents, PhaseKernelCounter

        self._phase_events = PhaseEvents() if self.report and torch.cuda.is_available() else _NoPhaseEvents()
        self._kernel_counter = PhaseKernelCounter()
        self.step_report: Any = None

    @override
    def state_dict(self) -> dict[str, Any]:
        return {"capture_step": self.capture_step, "plans": self.plans}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.capture_step = state_dict.get("capture_step")
        self.plans = list(state_dict.get("plans", []))

    def summary(self) -> dict[str, Any]:
        """What happened in the last fit: captured or not (and why), timings, plans, verify verdict."""
        eager_ms = self._timing.eager_ms()
        graph_ms = self._timing.graph_ms()
        return {
            "captured": self._captured,
            "reason": self.disabled_reason,
            "capture_step": self.capture_step,
            "captures": self.captures,
            "eager_step_ms": eager_ms,
            "graph_step_ms": graph_ms,
            "replay_speedup": (eager_ms / graph_ms) if eager_ms and graph_ms else None,
            "plans": self.plans,
            "verify": str(self.verify_report) if self.verify_report is not None else None,
            "fallback_steps": self.fallback_steps,
            "fallback_causes": sorted(self._fallback_causes),
            "graph_pool_mib": self._pool_mib,
            "prefetch_gate": self._gate_result.to_dict() if self._gate_result is not None else None,
            **{key: round(value, 3) for key, value in self._cost_s.items()},
            "tuning": self._tuning_report.to_dict() if self._tuning_report is not None else None,
            "step_report": self.step_report.to_dict() if self.step_report is not None else None,
        }

    # ------------------------------------------------------------------ refusals
    def _warn_once(self, key: str, message: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            rank_zero_warn(f"L2GraphCallback: {message}")

    def _disable(self, reason: str) -> None:
        """Train eagerly for the rest of the fit, with the optimizer as configured, and one warning."""
        if self.disabled_reason is None:
            self.disabled_reason = reason
            rank_zero_warn(f"L2GraphCallback: {reason}; training eagerly.")
        self._mode = "eager"
        self._graph = None
        self._gate = None
        self._gate_turn = None
        self._release_optimizer()

    def _release_optimizer(self) -> None:
        """Give the optimizer back as the user configured it (the rest of the fit is plain Lightning)."""
        wrapped, self._optimizer = self._optimizer, None
        if wrapped is None:
            return
        wrapped.handler = None
        if self._owns_optimizer:
            wrapped.release()
        for metric in self._nan_patched:
            if "_cast_and_nan_check_input" in vars(metric):
                del metric._cast_and_nan_check_input
        self._nan_patched = []

    def _refusal(self, trainer: Trainer, pl_module: LightningModule) -> str | None:
        """Why this run cannot be captured at all (and trains eagerly), or None."""
        reason = cuda_unavailable_reason()
        if reason:
            return f"no CUDA ({reason})"
        if trainer.strategy.root_device.type != "cuda":
            return f"the Trainer runs on {trainer.strategy.root_device}, not a CUDA device"
        if trainer.world_size > 1:
            return (
                f"multi-process training (world size {trainer.world_size}) is not captured yet: the DDP capture "
                "path has not been validated on several GPUs"
            )
        return self._configuration_refusal(trainer)

    @staticmethod
    def _configuration_refusal(trainer: Trainer) -> str | None:
        if trainer.accumulate_grad_batches != 1:
            return f"gradient accumulation (accumulate_grad_batches={trainer.accumulate_grad_batches}) is not captured"
        precision = str(trainer.precision)
        if precision in ("16-mixed", "16"):
            return f"precision={precision!r} uses a GradScaler whose step syncs with the host; use 'bf16-mixed' or 'bf16-true'"
        return None

    # ------------------------------------------------------------------ set-up and clean-up
    @override
    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        self._reset_run_state()
        strategy = type(trainer.strategy).__name__
        if strategy in UNSUPPORTED_STRATEGIES:
            raise ValueError(
                f"L2GraphCallback does not support the {strategy}; supported: single-device strategies "
                "(DDP falls back to eager). Unsupported: FSDP, DeepSpeed, ModelParallel, XLA."
            )
        if not pl_module.automatic_optimization:
            raise ValueError(
                "L2GraphCallback supports automatic optimization only; "
                f"{type(pl_module).__name__} sets `automatic_optimization = False`. Remove the callback or "
                "use automatic optimization."
            )
        reason = self._refusal(trainer, pl_module)
        if reason:
            self._disable(reason)
            return
        self._module = pl_module
        self._trainer = trainer
        user_hooks = tuple(h for h in CAPTURED_HOOKS if is_overridden(h, pl_module))
        # every hook of the module that runs inside the captured step (analyse skips Lightning's own)
        self._source = analyse(
            pl_module,
            ("training_step", *user_hooks, "configure_gradient_clipping", "optimizer_zero_grad", "backward"),
        )
        overrides: dict[str, Any] = {
            "training_step": self._training_step,
            "optimizer_zero_grad": self._optimizer_zero_grad,
            "backward": self._backward,
            "configure_gradient_clipping": self._configure_gradient_clipping,
            "log": self._log,
        }
        for hook in user_hooks:
            overrides[hook] = self._captured_hook(hook, getattr(pl_module, hook))
        self._originals = {name: getattr(pl_module, name) for name in overrides}
        for name, fn in overrides.items():
            setattr(pl_module, name, fn)
        self._installed = overrides
        for cb in trainer.callbacks:
            if cb is self:
                continue
            for hook in CAPTURED_HOOKS:
                if is_overridden(hook, cb, parent=Callback):
                    setattr(cb, hook, self._captured_hook(hook, getattr(cb, hook)))
                    self._callback_overrides.append((cb, hook))

    def _cleanup(self, pl_module: LightningModule | None) -> None:
        """Undo everything the callback installed; drop every reference to the module and the graph."""
        module = self._module or pl_module
        if module is not None:
            for name, fn in self._installed.items():
                if vars(module).get(name) is fn:
                    delattr(module, name)
        self._installed = {}
        for cb, hook in self._callback_overrides:
            if hook in vars(cb):
                delattr(cb, hook)
        self._callback_overrides = []
        for child in self._compiled_children:
            if "forward" in vars(child):
                del child.forward  # back to the class's own forward
        self._compiled_children = []
        if self._hooks is not None:
            self._hooks.remove()
            self._hooks = None
        self._release_optimizer()
        self._graph = None
        self._gate = None
        self._gate_turn = None
        if self._flags is not None:
            self._flags.close()
            self._flags = None
        self._capture_graph = None
        self._groups = {}
        self._tracer = None
        self._pending = None
        self._step_output = None
        self._capture_logs = []
        self._static_for_prefetch = None
        self._originals = {}
        self._module = None
        self._trainer = None

    @override
    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if stage == "fit":
            self._cleanup(pl_module)

    @override
    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception: BaseException) -> None:
        # teardown does not run after an error (or KeyboardInterrupt): leave nothing installed
        self._cleanup(pl_module)
        self._mode = "eager"

    @override
    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self.disabled_reason or self._module is None:
            return
        if len(trainer.optimizers) != 1:
            self._disable(
                f"{len(trainer.optimizers)} optimizers configured; the capture supports exactly one"
            )
            return
        optimizer = trainer.optimizers[0]
        existing = installed_capturable(optimizer)
        try:
            wrapped = existing or make_capturable(optimizer, trainer.strategy.root_device)
        except OptimizerNotCapturableError as exc:
            if not self.eager_optimizer_fallback:
                raise OptimizerNotCapturableError(
                    f"{exc}. Pass L2GraphCallback(eager_optimizer_fallback=True) to train eagerly instead."
                ) from exc
            self._disable(str(exc))
            return
        self._optimizer = wrapped
        self._owns_optimizer = existing is None
        wrapped.handler = self._step
        for _, metric in named_metrics(pl_module):
            if needs_sync_free_nan_check(metric) and "_cast_and_nan_check_input" not in vars(metric):
                metric._cast_and_nan_check_input = sync_free_nan_check(metric)
                self._nan_patched.append(metric)
        if self._source.opaque_conditions:
            self._warn_once(
                "opaque",
                "training_step branches on the step counters in a way the callback cannot evaluate, at "
                f"{'; '.join(self._source.opaque_conditions)}; a replayed graph always takes the branch of the capture "
                "step. Pass "
                "`eager_steps=lambda trainer, batch_idx: ...` returning True for the steps that take the other branch",
            )

    # ------------------------------------------------------------------ per-step decision
    @override
    def on_train_batch_start(
        self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if self.disabled_reason or self._module is None:
            self._pending = None
            return
        self._pending = (batch, batch_idx)
        if self.compile and not self._compiled_children:
            self._prepare_compiled(pl_module, batch)

    def _decide(self) -> str:
        """What this step does: "eager", "trace" (warm-up), "time" (untraced timed warm-up), "capture", "replay"."""
        if self.disabled_reason or self._pending is None or self._optimizer is None:
            return "eager"
        trainer, module = self._trainer, self._module
        batch, batch_idx = self._pending
        if trainer.accumulate_grad_batches != 1:
            self._fall_back(
                f"gradient accumulation ({trainer.accumulate_grad_batches} batches) is not captured"
            )
            return "eager"
        if self.eager_steps is not None and self.eager_steps(trainer, batch_idx):
            self._count_fallback("`eager_steps` asked for it")
            return "eager"
        key = (self._source.branch_key(module, batch_idx), batch_signature(batch))
        self._pending_key = key
        graph = self._graph
        if graph is None:
            return self._warmup_decision(key)
        if key[0] != graph.key[0]:
            # A branch that stays switched (clipping on from step 10, an auxiliary loss from epoch 1)
            # gets a graph of its own after a few steps; a periodic one (a target sync every N
            # steps) keeps running eagerly on its steps.
            run = self._other_branch[1] + 1 if self._other_branch[0] == key[0] else 1
            self._other_branch = (key[0], run)
            if run > BRANCH_SWITCH_STEPS and key[1] == graph.static.signature:
                self._other_branch = (None, 0)
                return self._recapture("the step's branch changed and stayed changed")
            self._fall_back("the step takes another branch on the step counters than the captured one")
            return "eager"
        self._other_branch = (None, 0)
        if key[1] != graph.static.signature:
            self._fall_back(f"batch {batch_idx}: {graph.static.mismatch(batch)}")
            return "eager"
        flags = self._module_flags()
        if self._recapture_next:
            self._recapture_next = False
            return self._recapture("parameters' `requires_grad` changed since capture")
        if flags != graph.flags:
            if flags[1] != graph.flags[1]:
                # new trainable parameters need their optimizer state made eagerly, outside a graph
                self._recapture_next = True
                self._fall_back(
                    "parameters' `requires_grad` changed since capture (captured again next step)"
                )
                return "eager"
            return self._recapture("modules' `train()`/`eval()` mode changed since capture")
        changes = self._optimizer.baked_changes()
        if changes:
            return self._recapture(f"the optimizer's {', '.join(changes)} (baked into the graph)")
        scalars = python_state.changed_scalars(graph.scalars)
        if scalars:
            return self._recapture(f"Python numbers the step reads changed ({', '.join(scalars)})")
        self._recapture_streak = 0
        gate = self._gate
        if gate is not None:
            if gate.needs_off_graph:
                self._gate_capturing = True
                return "capture"
            if gate.complete:
                self._finish_gate()
            else:
                self._gate_turn = gate.next_variant()
                self._graph = gate.graphs[self._gate_turn]
        return "replay"

    def _warmup_decision(self, key: tuple) -> str:
        group = self._groups.setdefault(key, _Group())
        self._baked_history.append(self._optimizer.baked_snapshot())
        traced_needed = max(1, self.warmup_steps - 1)
        if len(group.traces) < traced_needed:
            if self._traced_steps >= MAX_TRACED_STEPS:
                self._disable(
                    f"no {traced_needed} warm-up steps in the first {MAX_TRACED_STEPS} shared a batch shape and a "
                    "branch through training_step"
                )
                return "eager"
            return "trace"
        if group.problem:
            self._disable(group.problem)
            return "eager"
        if self.warmup_steps > 1 and group.timed < 1:
            return "time"
        problem = self._baked_every_step()
        if problem:
            self._disable(problem)
            return "eager"
        return "capture"

    def _baked_every_step(self) -> str | None:
        """A refusal when a baked hyperparameter changed between every pair of traced steps (a per-step schedule)."""
        snapshots = self._baked_history[-(self.warmup_steps + 1) :]
        if len(snapshots) < 3 or any(a == b for a, b in zip(snapshots, snapshots[1:])):
            return None
        changed = sorted(
            {
                k
                for a, b in zip(snapshots, snapshots[1:])
                for ga, gb in zip(a, b)
                for k in ga
                if ga[k] != gb.get(k)
            }
        )
        name = type(self._optimizer.optimizer).__name__
        return (
            f"{name}'s {changed} changed at every warm-up step (a per-step schedule such as OneCycleLR); {name} bakes "
            "them into the graph as numbers, so every step would need a new capture. Use Adam or AdamW (their "
            "learning rate is read from a tensor), or step the schedule per epoch"
        )

    def _recapture(self, cause: str) -> str:
        self._recapture_streak += 1
        if self._recapture_streak >= RECAPTURE_STREAK_LIMIT:
            self._disable(
                f"{cause}, on {self._recapture_streak} steps in a row: every step would need a new capture"
            )
            return "eager"
        self._warn_once(f"recapture:{cause.split(' ')[0]}", f"capturing the step again: {cause}.")
        return "capture"

    def _module_flags(self) -> tuple:
        if self._flags is None:
            self._flags = ModuleFlags(self._module)
        return self._flags.read()

    def _count_fallback(self, cause: str) -> None:
        self.fallback_steps += 1
        self._fallback_causes.add(cause)

    def _fall_back(self, cause: str) -> None:
        """This one step runs eagerly; the graph stays for later steps."""
        kind = cause.split(":", 1)[-1].strip()
        self._count_fallback(kind)
        self._warn_once(
            f"fallback:{kind}", f"running this step eagerly ({cause}); the graph is kept for later steps."
        )

    # ------------------------------------------------------------------ the optimizer step
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
                with self._on_step_stream():
                    return self._eager_modes(mode, run, closure, kwargs)
            finally:
                if compiling:
                    self._cost_s["compile_s"] += time.perf_counter() - started
        finally:
            self._in_step = False
            self._pending = None

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
        caller = torch.cuda.current_stream()
        self._step_stream.wait_stream(caller)
        try:
            with torch.cuda.stream(self._step_stream):
                yield
        finally:
            caller.wait_stream(self._step_stream)

    def _timed_step(self, run: Callable[..., Any], closure: Any, kwargs: dict) -> Any:
        self._groups[self._pending_key].timed += 1
        self._mode = "eager"
        if self.report:
            # profiled (and so not timed) to count the kernels each phase launches
            return self._kernel_counter.profile(lambda: run(closure, **kwargs))
        start, end = self._events()
        start.record()
        out = run(closure, **kwargs)
        end.record()
        self._timing.eager.append((start, end))
        return out

    def _traced_step(self, run: Callable[..., Any], closure: Any, kwargs: dict) -> Any:
        """An eager warm-up step under the tracer; refusals come before this step's optimizer update."""
        key = self._pending_key
        group = self._groups[key]
        tracer = StepTracer(self._device_type())
        before = update_counts(self._module)
        self._mode = "trace"
        self._traced_steps += 1
        holders = self._python_holders()
        python_before = python_state.snapshot(holders)

        def traced() -> Any:
            out = self._run_traced(tracer, closure)
            # lists that grow by one element per step can be re-appended after each replay
            appended, python_changed = python_state.split_appends(
                python_before, python_state.snapshot(holders)
            )
            group.appended.append(frozenset(a.label for a in appended))
            self._judge_trace(
                group, tracer.trace, updated_between(before, update_counts(self._module)), python_changed
            )
            return out

        return run(traced, **kwargs)

    def _run_traced(self, tracer: StepTracer, closure: Any) -> Any:
        """Lightning's closure under `tracer` (the captured hooks and ``self.log`` consult it)."""
        self._tracer = tracer
        try:
            with tracer, tracer.memoized():
                return closure() if closure is not None else None
        finally:
            self._tracer = None

    def _python_holders(self) -> list[tuple[str, Any]]:
        """The objects whose Python state a captured step could change: the module, its submodules and
        the Trainer's other callbacks (their hooks inside the step are captured with it)."""
        callbacks = [cb for cb in getattr(self._trainer, "callbacks", []) if cb is not self]
        return python_state.owners(self._module, callbacks)

    def _python_problem(self, changed: list[str]) -> str:
        return (
            f"the step changes Python state ({', '.join(changed)}) at every step, "
            "which a replay (it runs no Python) would freeze; keep it in a tensor updated in place "
            "(`self.running.mul_(0.9).add_(x)`, not `self.running = 0.9 * self.running + x`), change it in "
            "`on_train_batch_end`, or run such steps eagerly with `eager_steps=lambda trainer, batch_idx: ...`"
        )

    def _judge_trace(
        self, group: _Group, trace: StepTrace, updated: list[str], python_changed: list[str]
    ) -> None:
        """Compare a traced step with its group; refuse (before the update) what can never be replayed."""
        metrics = dict(named_metrics(self._module))
        for name in updated:
            reason = unreplayable_reason(name, metrics[name])
            if reason:
                self._disable(metric_update_reason([name], reason))
                return
        problem = None
        for hook in sorted(trace.host_hooks | {h for _, _, h in trace.syncs if h}):
            self._runs_after_replay(hook, trace)  # marks the hooks that will run after each replay
        for hook in sorted(trace.host_hooks):
            if not self._runs_after_replay(hook, trace):
                problem = (
                    f"`{hook}` builds tensors from host values (`torch.tensor([...])`, often of `.item()`s, as "
                    "Lightning's `grad_norm` does), which a graph cannot hold"
                    + (
                        " and, with gradient clipping, cannot run after a replay either"
                        if self._trainer.gradient_clip_val
                        else ""
                    )
                )
        syncs = [s for s in trace.syncs if not self._runs_after_replay(s[2], trace)]
        if syncs and problem is None:
            what, frame, _ = syncs[0]
            problem = (
                f"{what} at {describe_frame(frame)} makes the host wait for the GPU inside the step, which a CUDA "
                "graph cannot hold; log the tensor with `self.log` instead, or run such steps eagerly with "
                "`eager_steps=lambda trainer, batch_idx: ...`"
            )
        elif trace.problems:
            problem = trace.problems[0]
        elif python_changed and self._traced_steps > 1:
            # the first traced step may build something once (a lazy cache, an `initialized` flag)
            problem = self._python_problem(python_changed)
        elif len(group.appended) > 1 and group.appended[-1] != group.appended[-2] and self._traced_steps > 1:
            # a list appended to at one step and not the next: no one element per replay to redo
            problem = self._python_problem(sorted(group.appended[-1] ^ group.appended[-2]))
        elif group.traces:
            difference = first_difference(group.traces[-1], trace, skip_hooks=self._eager_hooks)
            if difference and len(group.traces) == 1 and not group.dropped_first:
                # the first step often builds something once (a cached positional encoding, a lazy
                # layer): it is dropped, and the steps after it must agree with each other
                group.traces, group.dropped_first = [], True
                difference = None
            if difference:
                problem = (
                    f"two warm-up steps ran different work ({difference}); a graph replays one of them. If the "
                    "difference is a periodic branch, pass `eager_steps=lambda trainer, batch_idx: ...` for its steps"
                )
        group.traces.append(trace)
        group.metrics.update(updated)
        if problem and not any(c.evaluate is not None and c.on_counters for c in self._source.conditions):
            # no branch on the step counters: this step's branch is, as far as can be told, every step's
            self._disable(problem)
        elif problem:
            group.problem = group.problem or problem

    def _runs_after_replay(self, hook: str | None, trace: StepTrace) -> bool:
        """Whether a hook that syncs can run eagerly after each replay instead of inside the graph.

        Only hooks that read the step's gradients and write nothing (``self.log_dict(grad_norm(self, 2))``
        turns each norm into a Python float) and see, after a replay, exactly what they see in an eager
        step: ``on_after_backward`` and ``on_before_optimizer_step``, without gradient clipping (which
        runs after them in an eager step, before them in a replayed one).
        """
        if hook not in ("on_after_backward", "on_before_optimizer_step") or hook in trace.mutating_hooks:
            return False
        if self._trainer.gradient_clip_val:
            return False
        self._eager_hooks.add(hook)
        return True

    # ------------------------------------------------------------------ capture
    def _capture_step(self, run: Callable[..., Any], closure: Any, kwargs: dict) -> Any:
        gate_capture, self._gate_capturing = self._gate_capturing, False
        if self._gate is not None and not gate_capture:
            self._abandon_gate(
                "the step was captured again (see the warning) before the gate's trial finished"
            )
        try:
            result = self._capture_graph_step(run, closure, kwargs, gate_capture)
        finally:
            self._capture_graph = None
        return result

    def _capture_graph_step(
        self, run: Callable[..., Any], closure: Any, kwargs: dict, gate_capture: bool
    ) -> Any:
        """Capture the step (`gate_capture`: the gate's second capture, without prefetch), then replay it once."""
        module, wrapped = self._module, self._optimizer
        key = self._pending_key
        group = self._groups.get(key)
        batch = self._pending[0]
        torch.cuda.synchronize()
        if group is not None and group.traces:
            try:
                constants = HostConstants(group.traces[-1].constants, self._device())
            except ValueError as exc:
                self._disable(str(exc))
                return run(closure, **kwargs)
        elif self._graph is not None and self._graph.constants is not None:
            constants = self._graph.constants  # a re-capture: the same host constants, checked again
        else:
            constants = HostConstants([], self._device())
        constants.used = 0
        metrics = dict(named_metrics(module))
        bound = {name: metrics[name] for name in sorted(group.metrics if group else ()) if name in metrics}
        if self._graph is not None and self._graph.binding is not None:
            self._graph.binding.bring_home()
            bound.update(self._graph.binding.metrics)
        self._graph = None  # a re-capture replaces the graph; a failed one leaves none
        binding = MetricBinding(bound) if bound else None
        static = StaticBatch(batch)
        holders = self._python_holders()
        # The chain discovery's dry run and the verify step run training_step's Python too: what they
        # do to Python state (an appended output, a drawn random number) is undone like their tensors.
        python_start = python_state.snapshot(holders)
        if self._hooks is None and not self.compile:
            self._static_for_prefetch = static
            self._install_prefetch(module)
        eager_record = self._verify_eager(run, closure, kwargs, binding) if self.verify else None
        python_state.restore(python_start)
        saved = TrainingState.save(module, wrapped.optimizer, binding.state_tensors() if binding else ())
        saved_metrics = binding.python_state() if binding else {}
        # validate_args is switched off for the capture below, by the callback, not by the step
        ours = frozenset((id(m), "validate_args") for m in bound.values())
        python_before = python_state.snapshot(holders, ours)
        graph = _Graph(torch.cuda.CUDAGraph(), static, key, binding=binding, constants=constants)
        self._capture_logs = []
        self._step_output = None
        memo = group.traces[-1].memo if group is not None and group.traces else self._memo
        self._memo = memo
        tracer = StepTracer(self._device_type(), constants, memo)
        self._mode = "capture"
        self._capture_graph = graph
        wrapped.sync_tensors()
        wrapped.freeze(True)

        def captured() -> Any:
            out = self._run_traced(tracer, closure)
            if self._step_output is None:
                raise _Defer()
            appended, python_changed = python_state.split_appends(
                python_before, python_state.snapshot(holders, ours)
            )
            if python_changed and self._traced_steps >= 1:
                raise CaptureRefused(self._python_problem(python_changed))
            graph.appends = [(a, a.current()[-1]) for a in appended]
            return out

        drop_autograd_graphs(module)  # a metric's step value can hold the last step's autograd graph
        validating = [m for m in bound.values() if getattr(m, "validate_args", False)]
        for m in validating:
            m.validate_args = False  # input checks sync with the host; the warm-up steps ran them
        # Which submodules the step calls: their Python numbers (nn.Dropout.p) are baked into the graph.
        # Not with compile=True: a global hook would make dynamo recompile inside the capture.
        ran: set[int] | None = None if self.compile else set()
        hook = (
            torch.nn.modules.module.register_module_forward_pre_hook(lambda m, args: ran.add(id(m)))
            if ran is not None
            else None
        )
        try:
            try:
                self._capture_into(graph, run, captured, kwargs)
            finally:
                if hook is not None:
                    hook.remove()
                wrapped.freeze(False)
                for m in validating:
                    m.validate_args = True
        except _Defer:
            self._undo_capture(saved, binding, saved_metrics)
            python_state.restore(python_before)
            self._mode = "eager"
            if gate_capture:
                self._graph = self._gate.graphs["prefetch"]  # the gate captures at a later step
            return run(closure, **kwargs)  # training_step returned None: nothing to capture this step
        except Exception as exc:  # a host sync or an op that cannot be captured
            self._undo_capture(saved, binding, saved_metrics)
            python_state.restore(python_before)  # the eager step below changes them once
            if gate_capture:
                # the step with prefetch was captured; only the comparison failed: keep that graph
                self._graph = self._gate.graphs["prefetch"]
                self._capture_graph = graph = None
                self._gate = None
                self._gate_result = StepGateResult(
                    "prefetch",
                    None,
                    None,
                    None,
                    f"the step without prefetch could not be captured: {_first_line(exc)}",
                )
                _free_cached_memory()
                return run(closure, **kwargs)
            if isinstance(exc, torch.OutOfMemoryError):
                graph = self._capture_graph = None  # the partial graph's pool goes with them
                _free_cached_memory()
                self._disable(
                    f"the step could not be captured: out of memory ({_memory_state()}; {_first_line(exc)})"
                )
            else:
                self._disable(self._capture_failure_reason(exc))
            return run(closure, **kwargs)
        graph.output = self._step_output
        graph.log_calls = self._capture_logs
        graph.grads = [(p, p.grad) for p in module.parameters()]
        graph.flags = self._module_flags()
        graph.scalars = python_state.baked_scalars(module, self._source.reads, ran)
        if binding is not None:
            binding.finish_capture()
        wrapped.mark_captured()
        self._graph = graph
        self.captures += 1
        if gate_capture:
            self._gate.graphs["off"] = graph
        else:
            self.capture_step = int(self._trainer.global_step)
            self._start_gate(graph)
        self._captured = True
        self._groups = {}  # the traces and their host copies are not needed any more
        # The capture recorded but did not run the step: this replay is the step's real update. Then
        # the closure again, in replay mode, so Lightning keeps fresh outputs and the logs are issued.
        graph.graph.replay()
        for where, element in graph.appends:  # the capture appended graph tensors: now they hold values
            current = where.current()
            if current:
                current[-1] = _copied(element)
        if binding is not None:
            binding.fresh_forward_caches()
        self._live_log_values = self._python_log_sources(graph.log_calls)
        self._mode = "replay"
        self._reissued = set()
        result = closure() if closure is not None else None
        if self.verify:
            self._finish_verify(eager_record)
        if self.report and not gate_capture:
            self._build_step_report()
            rank_zero_info(self._report_text())
        if self.captures == 1 and self._source.conditions and not self._source.opaque_conditions:
            rank_zero_info(
                "L2GraphCallback: steps whose branch (on the step counters or the module's attributes) differs "
                "from the captured step's "
                f"({[c.line for c in self._source.conditions]}) run eagerly."
            )
        return result

    def _capture_into(self, graph: _Graph, run: Callable[..., Any], closure: Any, kwargs: dict) -> None:
        module = self._module
        reserved = 0
        if torch.cuda.is_available():
            # Collected first: a dead autograd graph in a reference cycle keeps AccumulateGrad nodes
            # bound to another stream, which would break the capture; and what torch.cuda.graph frees
            # before capturing must not count against the graph's pool.
            _free_cached_memory()
            reserved = torch.cuda.memory_reserved()
        # grads are allocated inside the capture, in the graph's pool
        self._optimizer.optimizer.zero_grad(set_to_none=True)
        module.zero_grad(set_to_none=True)
        caught: list = []
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                with graph_capture(graph.graph, stream=self._step_stream):
                    self._phase_events.mark("start")
                    run(closure, **kwargs)
                    if graph.binding is not None:
                        graph.binding.bring_home()
                    self._phase_events.mark("end")
        except Exception as exc:
            if any(STALE_GRAPH_WARNING in str(w.message) for w in caught):
                exc.add_note(STALE_GRAPH_HINT)
            raise
        finally:
            for w in caught:  # the user's warning filters decide, as if nothing had recorded them
                warnings.warn_explicit(w.message, w.category, w.filename, w.lineno, source=w.source)
        if torch.cuda.is_available():
            self._pool_mib = (torch.cuda.memory_reserved() - reserved) / (1 << 20)

    def _undo_capture(self, saved: TrainingState, binding: MetricBinding | None, metrics: dict) -> None:
        """A capture that did not complete leaves nothing: state, RNG (CUDA generator too), metrics, grads."""
        module = self._module
        saved.restore_rng()  # first: the CUDA generator may be unusable until it gets a fresh state
        saved.restore(self._optimizer.optimizer if self._optimizer is not None else None)
        if binding is not None:
            binding.rebind()  # attributes back on the home tensors restored above
            binding.restore_python_state(metrics)
        module.zero_grad(set_to_none=True)
        self._capture_logs = []
        self._step_output = None
        self._mode = "eager"

    def _capture_failure_reason(self, exc: BaseException) -> str:
        if isinstance(exc, CaptureRefused):
            return f"the step could not be captured: {exc}"
        where = user_frame_of_traceback(exc.__traceback__)
        first = str(exc).splitlines()[0][:200] if str(exc) else ""
        located = f" at {describe_frame(where)}" if where else ""
        if STALE_GRAPH_HINT in getattr(exc, "__notes__", ()):
            return f"the step could not be captured ({type(exc).__name__}: {first}): {STALE_GRAPH_HINT}"
        return (
            f"the step could not be captured ({type(exc).__name__}: {first}){located}; if that line syncs with the "
            "host (`.item()`, `print(tensor)`, `if tensor:`), log the tensor with `self.log` or run such steps "
            "eagerly with `eager_steps`"
        )

    # ------------------------------------------------------------------ replay
    def _replay_step(self, closure: Any) -> Any:
        graph = self._graph
        graph.static.copy_in(self._pending[0], checked=True)  # _decide compared the signatures
        for param, grad in graph.grads:
            if param.grad is not grad:  # an eager step replaced them
                param.grad = grad
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
                current.append(_copied(element))
        self._timing.graph.append((start, end))
        self._timing.graph_count += 1
        if self._gate_turn is not None:
            self._gate.record(self._gate_turn, start, end)
            self._gate_turn = None
        if graph.binding is not None:
            graph.binding.after_replay()
        self._mode = "replay"
        self._reissued = set()
        return closure() if closure is not None else loss_of(graph.output, "training_step")

    # ------------------------------------------------------------------ the overridden LightningModule hooks
    def _training_step(self, *args: Any, **kwargs: Any) -> Any:
        mode = self._mode
        if mode == "replay":
            self._reissue("training_step")
            return _fresh_extras(self._graph.output)
        accumulating = self._trainer is not None and self._trainer.accumulate_grad_batches != 1
        if (
            not self._in_step
            and self._pending is not None
            and self._optimizer is not None
            and not accumulating
        ):
            # the closure ran outside optimizer.step: the step cannot be wrapped around it
            self._disable(
                "the module's `optimizer_step` calls the optimizer closure itself, outside `optimizer.step`, so the "
                "captured step cannot include it"
            )
            mode = "eager"
        if mode == "capture":
            # The graph reads the static buffers; the batch Lightning passed is copied into them.
            # The prefetch scope is the forward pass: its end joins the side stream and arms the
            # backward join on the outputs this forward produced.
            with self._prefetch_scope():
                output = self._originals["training_step"](
                    self._capture_graph.static.batch, *args[1:], **kwargs
                )
            self._phase_events.mark("forward")
            self._step_output = output
            return output
        if mode == "verify":
            output = self._originals["training_step"](*args, **kwargs)
            self._step_output = output
            return output
        with self._kernel_counter.phase("forward"):
            return self._originals["training_step"](*args, **kwargs)

    def _captured_hook(self, name: str, original: Callable[..., Any]) -> Callable[..., Any]:
        """A hook the graph runs at capture: in replay mode only its log calls are re-issued."""

        def hook(*args: Any, **kwargs: Any) -> Any:
            mode = self._mode
            if name in self._eager_hooks:
                # a read-only hook that syncs with the host: kept out of the graph, run after each replay
                if mode == "capture":
                    return None
                if mode == "trace" and self._tracer is not None:
                    with self._tracer.paused():
                        return original(*args, **kwargs)
                return original(*args, **kwargs)
            if mode == "replay":
                self._reissue(name)
                return None
            if mode == "trace" and self._tracer is not None:
                with self._tracer.hook(name):
                    return original(*args, **kwargs)
            return original(*args, **kwargs)

        return hook

    def _backward(self, loss: torch.Tensor, *args: Any, **kwargs: Any) -> None:
        if self._mode == "replay":
            return None
        with self._kernel_counter.phase("backward"):
            out = self._originals["backward"](loss, *args, **kwargs)
        if self._hooks is not None and self._hooks.via == "ops":
            self._hooks.join()  # custom-op points leave the backward join to the caller
        self._phase_events.mark("backward")
        return out

    def _optimizer_zero_grad(self, epoch: int, batch_idx: int, optimizer: Any) -> None:
        if self._mode == "replay":
            return None  # keep the graph's .grad tensors
        if self._mode == "capture":
            optimizer.zero_grad(set_to_none=True)  # grads are allocated in the graph's pool
            return None
        return self._originals["optimizer_zero_grad"](epoch, batch_idx, optimizer)

    def _configure_gradient_clipping(self, optimizer: Any, *args: Any, **kwargs: Any) -> None:
        if self._mode == "replay":
            return None  # the graph clipped the gradients already
        return self._originals["configure_gradient_clipping"](optimizer, *args, **kwargs)

    @staticmethod
    def _events() -> tuple[torch.cuda.Event, torch.cuda.Event]:
        return torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)

    def _device(self) -> torch.device:
        return self._trainer.strategy.root_device

    def _device_type(self) -> str:
        return self._device().type

    # ------------------------------------------------------------------ logging through replays
    def _log(self, name: str, value: Any, *args: Any, **kwargs: Any) -> None:
        """``self.log`` for the fit: recorded during a capture, kept out of traces, passed through otherwise."""
        mode = self._mode
        if mode == "capture":
            fx = self._module._current_fx_name or "training_step"
            self._capture_logs.append(ReissuedLog(fx, (name, value, *args), kwargs))
            return None
        if mode == "verify":
            return None  # the verify step logs nothing; the real step does
        if mode == "trace" and self._tracer is not None:
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                self._step_logs.setdefault(name, []).append(value)
            with self._tracer.paused():
                return self._originals["log"](name, value, *args, **kwargs)
        return self._originals["log"](name, value, *args, **kwargs)

    def _reissue(self, fx: str) -> None:
        """Call the real ``self.log`` for each call recorded in hook `fx` at capture, with this replay's values."""
        if fx in self._reissued:
            return
        self._reissued.add(fx)
        for call in self._graph.log_calls:
            if call.fx == fx:
                self._reissue_call(call)

    def _reissue_call(self, call: ReissuedLog) -> None:
        # A tensor value is the graph's static output: self.log clones it, so the logged value is
        # this step's even after the next replay overwrites the output.
        value = call.value
        if (
            isinstance(value, (int, float))
            and not isinstance(value, bool)
            and call.name in self._live_log_values
        ):
            value = self._source.log_value(call.name, self._module, self._pending[1] if self._pending else 0)
        call.issue(self._module, self._originals["log"], value)

    def _python_log_sources(self, calls: list[ReissuedLog]) -> set[str]:
        """Keys of logged Python numbers to re-evaluate at each replay; warn about the ones that would freeze."""
        live = set()
        batch_idx = self._pending[1] if self._pending else 0
        for call in calls:
            name, value = call.args[0], call.args[1]
            if not isinstance(value, (int, float)) or isinstance(value, bool):
                continue
            if name in self._source.log_values:
                try:
                    if self._source.log_value(name, self._module, batch_idx) == value:
                        live.add(name)
                        continue
                except Exception:  # falls through to the warning below
                    pass
            seen = self._step_logs.get(name, [])
            if seen and all(v == value for v in seen):
                continue  # the same number at every traced step: a constant
            self._warn_once(
                f"frozen-log:{name}",
                f"`self.log({name!r}, ...)` in {call.fx} logs a Python number that a replay cannot recompute, so "
                "it would repeat the capture step's value; log a tensor, or log it in `on_train_batch_end`",
            )
        return live

    # ------------------------------------------------------------------ prefetch, compile
    def _prepare_compiled(self, pl_module: LightningModule, batch: Any) -> None:
        """compile=True: install the prefetch points first, then compile the children.

        Dynamo guards on a module's hooks, so hooks added after the first compiled call would force
        a recompile inside the capture, where compiling cannot run. The points are custom ops
        (l2lightning.prefetch.ops) that dynamo traces into the compiled graph; they act only inside
        the capture's scope, checked at run time, so the warm-up steps run the same compiled code.
        """
        self._static_for_prefetch = StaticBatch(batch)
        self._install_prefetch(pl_module)
        for child in pl_module.children():
            self._compiled_children.append(child)
            child.forward = _compiled_forward(child)  # type: ignore[method-assign]
        self._compile_pending = True

    def _install_prefetch(self, pl_module: LightningModule) -> None:
        if self.prefetch == "off" or self._prefetch_failed:
            return
        # Finding the layer chain runs training_step on the static batch, and the tuner times
        # copies of layers: neither may leave a trace (BatchNorm statistics, metric states, RNG).
        started = time.perf_counter()
        try:
            with _leaves_no_trace(pl_module, self._optimizer.optimizer if self._optimizer else None):
                self._hooks = self._prefetch_hooks(pl_module)
        except torch.OutOfMemoryError as exc:
            # The tuner's throwaway copies and timing graphs did not fit: free them and capture
            # the step without prefetch (the graph alone is most of the gain).
            self._hooks = None
            _free_cached_memory()
            self._warn_once(
                "prefetch-oom",
                f"prefetch off: out of memory while tuning it ({_memory_state()}; {_first_line(exc)}); "
                "capturing the step without prefetch.",
            )
            self._prefetch_failed = True
        finally:
            self._cost_s["tuning_s"] += time.perf_counter() - started
        if self._hooks is not None:
            self._tuning_report = self._hooks.tuning_report
            self.plans = self._hooks.plan_summary()

    def _prefetch_hooks(self, pl_module: LightningModule) -> Any:
        if self.prefetch == "off":
            return None
        reason = prefetch_unavailable_reason()
        if reason:
            self._warn_once("prefetch", f"prefetch off ({reason}); capturing the graph without it.")
            return None
        from l2lightning.prefetch.hooks import PrefetchHooks

        static_batch = self._static_for_prefetch.batch
        original_training_step = self._originals["training_step"]
        original_log = self._originals["log"]

        def dry_step(module: Any, batch: Any) -> Any:
            module.log = lambda *a, **k: None  # the dry run must not log
            try:
                return original_training_step(batch, 0)
            finally:
                module.log = self._installed.get("log", original_log)

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
        if self._hooks is None or self._gate_capture_running():
            return contextlib.nullcontext()  # no scope: the hooks issue nothing, forward or backward
        return self._hooks.scope()

    def _gate_capture_running(self) -> bool:
        gate = self._gate
        return gate is not None and gate.needs_off_graph and self._mode == "capture"

    # ------------------------------------------------------------------ the whole-step gate
    def _start_gate(self, graph: _Graph) -> None:
        """After the first capture with tuned plans: the next step captures the step without prefetch."""
        hooks = self._hooks
        if (
            self.gate_pairs == 0
            or self.prefetch not in self._GATED_MODES
            or self._gate_result is not None  # one trial per fit
            or hooks is None
            or not hooks.enabled
            or getattr(hooks, "via", "hooks") != "hooks"  # compile=True: custom-op points, no scope
            or not any(row.get("forward") or row.get("backward") for row in self.plans)
        ):
            return
        self._gate = StepGate(graph, self.gate_pairs)

    def _finish_gate(self) -> None:
        """Judge the trial (one wait for its last replay), keep the faster graph, free the other."""
        gate, self._gate = self._gate, None
        result = gate.decide()
        kept, dropped = gate.winner_and_loser(result)
        self._gate_result = result
        self._graph = kept
        for param, grad in kept.grads:  # the dropped graph's gradients must not keep its pool alive
            param.grad = grad
        if result.kept == "off":
            self._reject_prefetch()
        self._timing.graph.clear()  # graph_step_ms: the kept graph's replays from here on
        del gate, dropped
        _free_cached_memory()
        rank_zero_info(
            f"L2GraphCallback: whole-step gate: {result.reason}; the step runs "
            f"{'with its prefetch plans' if result.kept == 'prefetch' else 'without prefetch'}."
        )

    def _abandon_gate(self, reason: str) -> None:
        """A trial that cannot finish proves nothing: the fit goes on without prefetch."""
        self._gate = None
        self._gate_turn = None
        self._gate_result = StepGateResult("off", None, None, None, reason)
        self._reject_prefetch()

    def _reject_prefetch(self) -> None:
        """No prefetch for the rest of the fit (a later capture captures the step without it)."""
        if self._hooks is not None:
            self._hooks.remove()
            self._hooks = None
        self._prefetch_failed = True
        self.plans = []

    # ------------------------------------------------------------------ verify
    def _verify_eager(
        self, run: Callable[..., Any], closure: Any, kwargs: dict, binding: MetricBinding | None
    ) -> Any:
        """The capture step run eagerly from the same state, recorded, then undone."""
        from l2lightning.verify import StepRecord, gradients, parameters

        module = self._module
        saved = TrainingState.save(
            module, self._optimizer.optimizer, binding.state_tensors() if binding else ()
        )
        saved_metrics = binding.python_state() if binding else {}
        self._mode = "verify"
        self._step_output = None
        try:
            # On the capture's stream (the caller's _on_step_stream): Lightning's closure keeps this
            # step's loss, and with it each parameter's AccumulateGrad node, alive into the capture;
            # a node bound to another stream aborts the capture (seen on the H200 when verify=True
            # ran as the first capture of a process).
            run(closure, **kwargs)
            if self._step_output is None:
                return None  # training_step returned None: the capture defers, nothing to compare
            loss = loss_of(self._step_output, "training_step")
            record = StepRecord(None, loss.detach().clone(), gradients(module), parameters(module))
            self._step_output = None
        finally:
            self._mode = "eager"
        torch.cuda.synchronize()
        saved.restore(self._optimizer.optimizer)
        if binding is not None:
            binding.rebind()
            binding.restore_python_state(saved_metrics)
        module.zero_grad(set_to_none=True)
        return record

    def _finish_verify(self, eager_record: Any) -> None:
        from l2lightning.verify import EquivalenceError, StepRecord, compare_steps, gradients, parameters

        if eager_record is None:
            return
        module = self._module
        loss = loss_of(self._graph.output, "training_step")
        graph_record = StepRecord(None, loss.detach().clone(), gradients(module), parameters(module))
        report = compare_steps(graph_record, eager_record, "captured step vs eager step")
        self.verify_report = report
        rank_zero_info(f"L2GraphCallback verify: {report}")
        for logger in module.trainer.loggers:
            logger.log_metrics({"l2/verify_ok": float(report.ok)}, step=int(self._trainer.global_step))
        if not report.ok:
            raise EquivalenceError(report)

    # ------------------------------------------------------------------ checkpoints and metrics
    @override
    def on_save_checkpoint(
        self, trainer: Trainer, pl_module: LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        if self._optimizer is None or "optimizer_states" not in checkpoint:
            return
        # Save what the optimizer would save without capture (original capturable flag, CPU steps).
        states = checkpoint["optimizer_states"]
        if states:
            states[0] = self._optimizer.portable_state_dict(states[0])

    @override
    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self._mode = "eager"
        self._log_timing_once_known(trainer)

    @override
    def on_train_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._log_timing(trainer)

    def _logs_timing(self, trainer: Trainer) -> bool:
        return bool(
            self.log_timing and self._module is not None and trainer.is_global_zero and trainer.loggers
        )

    def _log_timing_once_known(self, trainer: Trainer) -> None:
        """Log the l2/* metrics as soon as a captured run has timed replays, once per fit.

        Only when the replays' end events have completed (``query``, no host sync), so the step
        path never waits for the device; until then each batch end checks again.
        """
        if self._timing_logged or self._graph is None or not self._logs_timing(trainer):
            return
        replays = self._timing.graph
        if self._timing.graph_count < TIMED_REPLAYS_BEFORE_LOG or not replays[-1][1].query():
            return
        self._timing_logged = True
        self._emit_timing(trainer)

    def _log_timing(self, trainer: Trainer) -> None:
        """Epoch end: wait for the device, then log the l2/* metrics over the steps timed so far."""
        if not self._logs_timing(trainer):
            return
        torch.cuda.synchronize()
        self._emit_timing(trainer)

    def _timing_metrics(self) -> dict[str, float]:
        """The l2/* metrics, all from one ``summary()``: floats, non-finite or unknown ones left out."""
        summary = self.summary()
        metrics = {
            f"l2/{key}": float(summary[key])
            for key in (
                "eager_step_ms",
                "graph_step_ms",
                "replay_speedup",
                "graph_pool_mib",
                "tuning_s",
                "capture_s",
                "compile_s",
            )
            if summary[key] is not None and math.isfinite(float(summary[key]))
        }
        prefetched = [row for row in self.plans if row.get("forward") or row.get("backward")]
        metrics["l2/prefetch_layers"] = float(len(prefetched))
        metrics["l2/prefetch_mib"] = float(sum(float(row.get("mib") or 0.0) for row in prefetched))
        metrics["l2/fallback_steps"] = float(self.fallback_steps)
        gate = self._gate_result
        if gate is not None and gate.gain is not None and math.isfinite(gate.gain.mean):
            metrics["l2/prefetch_gate_gain"] = float(gate.gain.mean)
        return metrics

    def _emit_timing(self, trainer: Trainer) -> None:
        metrics = self._timing_metrics()
        # The step Lightning logs this batch's own metrics at (as DeviceStatsMonitor and
        # LearningRateMonitor do): global_step is already one ahead in on_train_batch_end, and
        # loggers such as W&B drop rows whose step goes back.
        epoch_loop = getattr(getattr(trainer, "fit_loop", None), "epoch_loop", None)
        step = getattr(epoch_loop, "_batches_that_stepped", None)
        if not isinstance(step, int):
            step = int(trainer.global_step)
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=step)

    def _build_step_report(self) -> None:
        from l2lightning.step_report import build_report, measure_ceilings

        times = self._phase_events.phase_times_us()
        if times is None:
            return
        device = self._device()
        copy_bw, empty_us = measure_ceilings(device.index or 0)
        self.step_report = build_report(
            self._module,
            times,
            self._kernel_counter.counts,
            copy_bw,
            empty_us,
            self._tuning_report,
            label=f"{type(self._module).__name__}, captured step",
        )

    def _report_text(self) -> str:
        lines = ["L2GraphCallback step report", f"  captured at step {self.capture_step}"]
        if self.step_report is not None:
            lines.append(self.step_report.format())
        if self._tuning_report is not None and hasattr(self._tuning_report, "table"):
            lines.append(self._tuning_report.table())
        for row in self.plans:
            lines.append(
                f"  {row['layer']:<40} {row['mib']:>8.2f} MiB  fwd {row['forward']}  bwd {row['backward']}"
            )
        return "\n".join(lines)


@contextlib.contextmanager
def _leaves_no_trace(module: LightningModule, optimizer: Any) -> Any:
    """Run code on the module that must leave nothing behind: parameters, buffers, metrics, RNG."""
    metrics = [m for _, m in named_metrics(module)]
    attributes = [(m, attr, _shallow_copy(getattr(m, attr))) for m in metrics for attr in m._defaults]
    python = [(m, m._update_count, m._forward_cache, m._computed) for m in metrics]
    tensors = [value for _, _, value in attributes if isinstance(value, torch.Tensor)]
    saved = TrainingState.save(module, optimizer, tensors)
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


def _shallow_copy(value: Any) -> Any:
    return list(value) if isinstance(value, list) else value


def _fresh_extras(output: Any) -> Any:
    """A replay's step output: the static loss, and fresh copies of the other tensors it returned.

    Lightning copies the loss itself; the other tensors would otherwise be the graph's static
    outputs, overwritten by the next replay under anyone who kept them (collected predictions).
    """
    if isinstance(output, dict):
        return {
            k: (v.detach().clone() if k != "loss" and isinstance(v, torch.Tensor) else v)
            for k, v in output.items()
        }
    return output


def _copied(element: Any) -> Any:
    """`element` with every tensor in it copied (a graph's tensors are overwritten by its next replay)."""
    from torch.utils._pytree import tree_map

    return tree_map(lambda v: v.detach().clone() if isinstance(v, torch.Tensor) else v, element)


class _NoPhaseEvents:
    """Stands in for PhaseEvents when no report is asked for: marking costs nothing."""

    def mark(self, name: str) -> None:
        return None

    def phase_times_us(self) -> None:
        return None


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


def _free_cached_memory() -> None:
    """Collect garbage (reference cycles holding tensors), then give PyTorch's cached blocks back."""
    gc.collect()
    torch.cuda.empty_cache()


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0][:240] if text else type(exc).__name__


def _memory_state() -> str:
    """The device's free and total memory and what PyTorch holds, for an out-of-memory warning."""
    if not torch.cuda.is_available():
        return "no CUDA device"
    free, total = torch.cuda.mem_get_info()
    gib = 1 << 30
    return (
        f"{free / gib:.2f} of {total / gib:.2f} GiB free, PyTorch holding "
        f"{torch.cuda.memory_allocated() / gib:.2f} GiB allocated, {torch.cuda.memory_reserved() / gib:.2f} reserved"
    )
