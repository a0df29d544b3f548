"""L2GraphCallback: Lightning's own training step captured in one CUDA graph, with L2 weight prefetch.

Route chosen: a callback that installs instance-level overrides of the LightningModule's documented
hooks (``training_step``, ``optimizer_zero_grad``, ``backward``, ``configure_gradient_clipping``
and, where the user defined them, ``on_before_zero_grad``, ``on_before_backward``,
``on_after_backward``, ``on_before_optimizer_step``), and wraps the optimizer's ``step`` (under manual
optimization every optimizer's: :mod:`l2lightning.graph.joined_optimizers`). A
callback cannot swap the Trainer's strategy, and the product's front door is
``Trainer(callbacks=[L2GraphCallback()])`` on an unmodified module. No private Lightning method is
patched; everything is removed again at ``teardown`` and, after an error, at ``on_exception``.

One step of automatic optimization goes ``optimizer_step`` hook -> ``LightningOptimizer.step`` ->
``Precision.optimizer_step`` -> ``optimizer.step(closure)``, where the closure runs
``training_step``, ``on_before_zero_grad``/``optimizer_zero_grad``, ``backward`` with its hooks,
``on_before_optimizer_step`` and gradient clipping. The callback works at ``optimizer.step``, so a
user's ``optimizer_step`` override (an LR warm-up setting ``pg["lr"]``) runs in Python every step,
around whatever the step does. (Under ``precision="16-mixed"`` Lightning's precision plugin runs the
closure itself, then the GradScaler's step and update: there the callback works one level up, at
the plugin's ``optimizer_step``, with a fused optimizer; :mod:`l2lightning.graph.amp_step`.) Each step:

* warm-up steps run eagerly and are traced (:mod:`l2lightning.guards.step_trace`): two steps that run
  different ops or host values, host syncs, host tensors that change, list-state metrics are
  refused before anything is captured, naming the user's line;
* the capture step records the closure and the optimizer update in one graph and replays it once,
  which is that step's real update;
* every later step copies the batch into the static buffers, replays, and calls the closure in
  replay mode: ``training_step`` returns this step's outputs (extra tensors as fresh copies), every
  ``self.log`` call recorded at capture is re-issued with this replay's values (Python numbers
  re-evaluated from their source where it can be read), hooks the graph ran are not run again, and
  torchmetrics objects updated in the step get their Python-side state back
  (:mod:`l2lightning.guards.metric_binding`).

Before each replay the callback checks, from metadata only (never a host sync), what a graph
cannot see: the batch's structure and shapes, the branch the step takes on the step counters
(:mod:`l2lightning.guards.step_source`), ``eager_steps``, the accumulation factor, the optimizer's baked
hyperparameters, modules' ``training`` flags and parameters' ``requires_grad``. A step that does
not match runs eagerly or is captured again (bounded); anything that cannot be replayed faithfully
runs eagerly with one warning naming the cause. A capture that fails leaves the model, optimizer,
RNG (the CUDA generator included) and process as a plain fit would have them.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import Any

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.utilities import rank_zero_warn
from lightning.pytorch.utilities.model_helpers import is_overridden
from lightning.pytorch.utilities.signature_utils import is_param_in_hook_signature
from typing_extensions import override

from l2lightning._env import cuda_unavailable_reason
from l2lightning.callback.fit_report import CaptureCosts, FitReport
from l2lightning.callback.fit_state import FitState
from l2lightning.callback.prefetch_setup import PrefetchSetup
from l2lightning.callback.step_capture import StepCapture, _Graph
from l2lightning.callback.step_decision import StepDecision
from l2lightning.callback.step_dispatch import StepDispatch
from l2lightning.callback.step_gate import GATE_PAIRS
from l2lightning.callback.step_overrides import StepOverrides, forwarding, presenting_signature_of
from l2lightning.callback.warmup_steps import WarmupSteps, momentum_cycled_every_step
from l2lightning.graph.accumulation import MicroBatchClosures, MicroBatchStep, role_of, run_micro_batch
from l2lightning.graph.amp_step import (
    ScaledStep,
    grad_scaler_of,
    run_through,
    scaled_step_refusal,
    unfused_refusal,
)
from l2lightning.graph.attributes import ABSENT, put_back
from l2lightning.graph.capture import StaticBatch
from l2lightning.graph.graph_slots import GraphSlots
from l2lightning.graph.joined_optimizers import (
    CapturableOptimizers,
    intercept_all,
    members_of,
    optimizer_names,
)
from l2lightning.graph.manual_step import (
    ManualStep,
    manual_refusal,
    manual_source_refusal,
    manual_start_refusal,
    none_as_empty,
)
from l2lightning.graph.optim import (
    CapturableOptimizer,
    OptimizerNotCapturableError,
    installed_capturable,
    intercept,
)
from l2lightning.graph.replay_closure import CLOSURE_HOOKS, ReplayClosure, why_not_fast
from l2lightning.graph.rng import watch_cuda_state_setters
from l2lightning.guards import check_kernels
from l2lightning.guards.batch_reads import batch_reads
from l2lightning.guards.called_code import analyse_called_code
from l2lightning.guards.metric_binding import (
    named_metrics,
    needs_sync_free_nan_check,
    sync_free_nan_check,
)
from l2lightning.guards.progress_bar_reads import defer_progress_bar_reads
from l2lightning.guards.replay_check import CHECK_SHARE, ReplayCheckReport
from l2lightning.guards.step_source import analyse, analyse_callbacks
from l2lightning.prefetch.plan import PrefetchPlan

PREFETCH_MODES = ("off", "default", "auto", "decoy")
VERIFY_MODES = ("sampled", "capture", False)
UNSUPPORTED_STRATEGIES = ("FSDPStrategy", "DeepSpeedStrategy", "ModelParallelStrategy", "XLAStrategy")
# Module methods replaced for the fit: replay mode skips them or answers from the graph.
_MODULE_OVERRIDES = ("training_step", "optimizer_zero_grad", "backward", "configure_gradient_clipping", "log")


def _stale_read(what: str, lines: list[str], changes: str, kept: str, advice: str) -> str:
    """The refusal of a step that reads `what` (at `lines`), a value that changes between steps where
    a replayed graph cannot see it."""
    return (
        f"the step reads {what} ({'; '.join(lines[:3])}), {changes}; a replayed graph would keep "
        f"{kept}. {advice}"
    )


class L2GraphCallback(Callback):
    """Capture the whole training step (forward, loss, backward, optimizer step) in one CUDA graph.

    Inside the graph a side-stream kernel prefetches into L2 the weights the next layer will read
    (forward: W_{i+1}; backward: W_{i-1}). Gradients stay bit-identical to an eager run of the same
    (capturable) optimizer configuration, ``make_capturable(optimizer)``; ``verify=True`` checks
    that at capture. What cannot be replayed faithfully runs eagerly, with one warning naming the
    cause and, where there is one, the user's line.

    During the fit, ``self.log`` calls are re-issued after each replay with that replay's values
    (:mod:`l2lightning.guards.log_replay`), and values logged with ``prog_bar=True`` are turned into numbers
    when ``trainer.progress_bar_metrics`` is read rather than at every batch end
    (:mod:`l2lightning.guards.progress_bar_reads`): the same numbers, without a host sync per step.

    The arguments below are also attributes, read when a fit starts (``setup``): one set on the
    callback between fits applies to the next fit; one set during a fit applies from the next fit, as
    the fit's parts were made with the values it started with.

    Args:
        warmup_steps: eager steps before the capture (>= 1). The first ``warmup_steps - 1`` (at
            least one) are traced and compared op by op, the last one is timed.
        prefetch: ``"auto"`` (the autotuner keeps a plan per layer shape only where it measurably
            pays), ``"default"`` (plans sized by layer bytes), ``"off"`` (graph only), ``"decoy"``
            (same traffic at the wrong layer: a control for benchmarks), or a
            :class:`~l2lightning.PrefetchPlan` for every layer large enough.
        backward_prefetch: also prefetch W_{i-1} in backward.
        verify: ``"sampled"`` (the default; :mod:`l2lightning.guards.replay_check`): at replay 1, 2, 4, 8, ...
            of each capture and at the first replay after each epoch start, validation loop and
            checkpoint load, the step is also computed eagerly from the replay's state and compared
            bit for bit (loss, returned tensors, gradients, parameters, buffers, optimizer and metric
            states); the eager step is the one that stands, a difference is warned about naming the
            first differing tensor and captured again once, a second one means eager training for
            the rest of the fit; counts and wall time in ``summary()["replay_check"]``.
            ``"capture"`` (or True): at capture only, run the step once eagerly and once captured from
            the same state and raise :class:`~l2lightning.EquivalenceError` if the loss, a gradient
            or a parameter differs in any bit (for users' GPU CI). False: no check.
        check_share: with ``verify="sampled"``, the most of the fit's wall time (so far, from the
            training start) the checks may take, a number in (0, 1]: a scheduled check beyond it is
            deferred to the first replay within it (counted in ``summary()["replay_check"]["deferred"]``);
            the first replay of every capture is always checked. 1.0 checks every scheduled replay.
        compile: compile the LightningModule's child modules with ``torch.compile`` (default mode,
            no CUDA graphs of its own) at the first step, so inductor's fusion runs inside the
            whole-step graph (prefetch through :mod:`l2lightning.prefetch.ops`).
        report: print the step report (per-layer plans, tuning table, timings) at capture.
        eager_optimizer_fallback: when the optimizer cannot be captured (it has no ``capturable``
            mode: LBFGS, Adagrad with ``lr_decay`` != 0), train eagerly with one warning naming it (the default), or, with
            False, raise :class:`~l2lightning.graph.optim.OptimizerNotCapturableError`.
        log_timing: log ``l2/eager_step_ms``, ``l2/graph_step_ms``, ``l2/replay_speedup`` (their ratio:
            CUDA-event time of an eager step over one graph replay, Lightning's host work left out;
            medians over the latest timed steps: every replay is timed until 32 are, then one in 8),
            ``l2/graph_pool_mib`` (what the captures of the graphs alive together reserved: one graph,
            or under gradient accumulation one per role), ``l2/tuning_s``, ``l2/capture_s``, ``l2/compile_s``,
            ``l2/recapture_s`` (wall seconds of prefetch tuning, of the captures, of the first compiled
            step, of the captures after the fit's first with their tuning), ``l2/prefetch_layers``,
            ``l2/prefetch_mib`` and ``l2/fallback_steps`` through the Trainer's loggers on rank zero, once the first
            replays have finished on the device (read without a host sync), and at each epoch end.
        recapture_wait: after a change that makes the graph stale (a value the step reads, the
            optimizer's state), run the steps eagerly until they have cost, over replays, what the last
            capture took (measured on the device: the eager step's and the replay's CUDA-event times),
            and only then capture again, the wait doubled after each graph that did not pay for its
            capture; so a value that changes every few steps costs no capture each time (the steps
            waited are counted in ``summary()["fallback_steps"]``); under automatic optimization,
            where the fit's steps left (``trainer.estimated_stepping_batches``) cannot pay for the
            capture any more, the rest of the fit runs eagerly. False captures again at the next step.
            CUDA only (elsewhere no step time is measured).
        operand_scalars: where a Python number the step reads reaches its ops only as the operand of a
            tensor ``*``, ``+`` or ``-`` written in the step's source (``loss - self.ent_coef * entropy``,
            ``beta * reg`` with ``beta`` computed from ``self.current_epoch``), on float32 or float64
            tensors, the graph reads it from a device scalar written before each replay, so a change
            (an epoch hook's annealing) needs no new capture; the first replays with a new value (three
            per capture) are checked against the eager step. Only with ``verify="sampled"`` (the check
            is what sees a use of the number no analysis found). False bakes such numbers in and
            captures again when they change (:mod:`l2lightning.graph.operand_scalars`).
        eager_steps: ``(trainer, batch_idx) -> bool``; steps for which it returns True run eagerly
            (a periodic target-network sync, image logging, a print), and their effects flow into
            the next replay. Branches on ``self.global_step``/``current_epoch``/``batch_idx`` that
            the callback can read in ``training_step`` are handled without it.
        autotune: the autotuner behind ``prefetch="auto"``: None (its defaults) or a mapping of
            :class:`~l2lightning.Autotuner`'s arguments.
        gate_pairs: with ``prefetch="auto"``, the whole-step gate (:mod:`l2lightning.callback.step_gate`):
            the next ``2 * gate_pairs`` steps replay the captured step with its prefetch kernel
            nodes switched on and off in turn (:mod:`l2lightning.graph.prefetch_switch`; where they
            cannot be switched, a second capture without prefetch replays in the off turns), and
            the plans stay only if the 95% confidence interval of the whole step's gain is above
            zero. 0 keeps the tuner's plans without the gate.

    Example:
        >>> from lightning.pytorch import Trainer
        >>> from l2lightning import L2GraphCallback
        >>> cb = L2GraphCallback(eager_steps=lambda trainer, batch_idx: trainer.global_step % 100 == 0)
        >>> trainer = Trainer(accelerator="gpu", devices=1, max_steps=1000, callbacks=[cb])
        >>> trainer.fit(model, datamodule=dm)  # doctest: +SKIP
    """

    # devices whose step timings (CUDA events) decide when a re-capture pays for itself (given to the
    # decision part: StepDecision._capture_not_paid_for); tests on the graph emulator widen it
    _RENTAL_DEVICES: tuple[str, ...] = ("cuda",)
    # under a GradScaler (16-mixed), the precision plugin's optimizer_step the fit's steps go through
    # (set at the training start, removed at clean-up; a class default, for a clean-up before any set-up)
    _scaled: ScaledStep | None = None
    _manual: ManualStep | None = None

    def __init__(
        self,
        warmup_steps: int = 3,
        prefetch: str | PrefetchPlan = "auto",
        backward_prefetch: bool = True,
        verify: str | bool = "sampled",
        check_share: float = CHECK_SHARE,
        compile: bool = False,
        report: bool = False,
        eager_optimizer_fallback: bool = True,
        log_timing: bool = True,
        eager_steps: Callable[[Trainer, int], bool] | None = None,
        autotune: Any = None,
        gate_pairs: int = GATE_PAIRS,
        recapture_wait: bool = True,
        operand_scalars: bool = True,
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
            ("compile", compile),
            ("report", report),
            ("eager_optimizer_fallback", eager_optimizer_fallback),
            ("log_timing", log_timing),
            ("recapture_wait", recapture_wait),
            ("operand_scalars", operand_scalars),
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
        if (
            isinstance(check_share, bool)
            or not isinstance(check_share, (int, float))
            or not 0.0 < float(check_share) <= 1.0
        ):
            raise ValueError(
                f"`check_share` must be a number in (0, 1] (the most of the fit's time the sampled replay "
                f"check may take), got {check_share!r}"
            )
        self.check_share = float(check_share)
        if verify is True:
            verify = "capture"  # what verify=True meant before the sampled check
        if (
            isinstance(verify, bool)
            and verify
            or not isinstance(verify, (str, bool))
            or verify not in VERIFY_MODES
        ):
            raise ValueError(f"`verify` must be one of {VERIFY_MODES} (True means 'capture'), got {verify!r}")
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
        self.recapture_wait = recapture_wait
        self.operand_scalars = operand_scalars
        self._reset_run_state()
        # Persisted through state_dict (chosen plans and capture step of the last run).
        self._resumed_capturable_from: int | None = None
        self.capture_step: int | None = None
        self.plans: list[dict[str, Any]] = []

    # ------------------------------------------------------------------ state
    def _reset_run_state(self) -> None:
        if getattr(self, "_decision", None) is not None:
            # the module flags' global registration hooks, should a fit have ended without clean-up
            self._decision.release()
        # the fit and the step every part reads (trainer, module, optimizer, whether the fit is refused,
        # the step's mode and batch)
        self._fit = FitState()
        self.replay_check = ReplayCheckReport(mode=str(self.verify) if self.verify else "off")
        # What the parts keep per captured graph (its replays, check schedule, re-capture state, ...):
        # `_slots.state`, that of the graph serving the current step; with gradient accumulation, one graph
        # per role of a micro-batch, the others' parked (l2lightning.graph.graph_slots)
        self._slots = GraphSlots(self.check_share)
        # Lightning's closures of accumulating micro-batches, handed to _micro_batch_step (on_train_start)
        self._micro_batches: MicroBatchClosures | None = None
        self._check_on = self.verify == "sampled"
        self._undo_cuda_state_watch: Callable[[], None] | None = None
        self._resumed_switched = False  # switched at train start: a resumed fit that was capturable
        self._warned: set[str] = set()
        self._installed: dict[str, Any] = {}  # module attribute -> our override
        # (callback, hook, what the callback's instance held under that name before, or ABSENT)
        self._callback_overrides: list[tuple[Any, str, Any]] = []
        self._shadowed: dict[str, Any] = {}
        self._undo_progress_bar_reads: Callable[[], None] | None = None
        # a capturable optimizer the callback no longer handles, kept switched on until the fit ends
        self._kept_optimizer: CapturableOptimizer | CapturableOptimizers | None = None
        self._owns_optimizer = False
        self._nan_patched: list[Any] = []
        # the children compile=True compiled (the prefetch part fills it, the warm-up part reads it)
        self._compiled_children: list[torch.nn.Module] = []
        # What capturing cost (wall seconds of tuning, captures, re-captures, compile=True's first step, and
        # the last capture's, which a re-capture waits to pay): one record, which the dispatch, the capture
        # and the prefetch part write and summary() reports (filled in place, never rebound)
        self._costs = CaptureCosts()
        # the step times, the l2/* metrics and the captured step's report (a part: its state is its own)
        self._fit_report = FitReport(self.report)
        # the warm-up steps and what they learn (a part: its state is its own)
        self._warmup = WarmupSteps(
            self._fit,
            self._fit_report,
            warmup_steps=self.warmup_steps,
            report=self.report,
            own_callback=self,
            disable=self._disable,
            operand_scalars=self._operand_scalars,
            events=self._events,
            device_type=self._device_type,
            compiled_children=self._compiled_children,
            callback_overrides=self._callback_overrides,
        )
        # the prefetch set-up, compile=True and the whole-step gate (a part: its state is its own)
        self._prefetch = PrefetchSetup(
            self._fit,
            self._fit_report,
            self._slots,
            prefetch=self.prefetch,
            backward_prefetch=self.backward_prefetch,
            autotune=self.autotune,
            compile=self.compile,
            gate_pairs=self.gate_pairs,
            warn_once=self._warn_once,
            cost_s=self._costs.seconds,
            compiled_children=self._compiled_children,
            installed_log=self._installed_log,
            plans=self._get_plans,
            set_plans=self._set_plans,
            keep_graph=self._keep_graph,
        )
        # the module's methods the callback replaces for the fit, and self.log through replays (a part: its
        # state is its own; its bound methods are what set-up installs)
        self._overrides = StepOverrides(
            self._fit,
            self._fit_report,
            self._warmup,
            self._prefetch,
            self._slots,
            disable=self._disable,
            stepping=self._stepping,
            manual=self._is_manual,
        )
        # what each step does: replay, capture (again), or run eagerly, and why (a part: its state is its
        # own; StepDispatch asks it before every step)
        self._decision = StepDecision(
            self._fit,
            self._fit_report,
            self._warmup,
            self._prefetch,
            self._slots,
            eager_steps=self.eager_steps,
            recapture_wait=self.recapture_wait,
            check_on=self._check_on,
            rental_devices=self._RENTAL_DEVICES,
            replay_check=self.replay_check,
            warned=self._warned,
            disable=self._disable,
            warn_once=self._warn_once,
            device_type=self._device_type,
            manual=self._is_manual,
            installed=self._installed_methods,
            last_capture_cost=self._last_capture_cost,
            operand_lines=self._get_operand_lines,
        )
        # the capture step: the graph recorded and replayed once, or everything undone (a part: its state is
        # its own; the dispatch runs it)
        self._capture = StepCapture(
            self._fit,
            self._fit_report,
            self._warmup,
            self._prefetch,
            self._overrides,
            self._decision,
            self._slots,
            costs=self._costs,
            prefetch_setting=self.prefetch,
            compile=self.compile,
            verify=self.verify,
            report=self.report,
            operand_scalars=self.operand_scalars,
            check_on=self._check_on,
            disable=self._disable,
            warn_once=self._warn_once,
            device=self._device,
            device_type=self._device_type,
            source_refusal=self._source_refusal,
            installed=self._installed_methods,
            plans=self._get_plans,
            set_capture_step=self._set_capture_step,
        )
        # how each step runs: replayed, checked, warmed up, captured or eager (a part: its state is its own;
        # the optimizer's handler, the GradScaler's step, a micro-batch and a manual step call its `step`)
        self._dispatch = StepDispatch(
            self._fit,
            self._fit_report,
            self._warmup,
            self._prefetch,
            self._overrides,
            self._decision,
            self._capture,
            self._slots,
            costs=self._costs,
            replay_check=self.replay_check,
            disable=self._disable,
            warn_once=self._warn_once,
            events=self._events,
            device=self._device,
            device_type=self._device_type,
        )

    # The callables the prefetch part is given (bound methods, not lambdas: a Trainer that spawns its
    # processes pickles its callbacks, their parts included)
    def _installed_log(self) -> Any:
        """The module's `log` during the fit: the callback's override (as it was, before set-up)."""
        return self._installed.get("log", self._fit.originals["log"])

    def _get_plans(self) -> list[dict[str, Any]]:
        return self.plans

    def _set_plans(self, plans: list[dict[str, Any]]) -> None:
        """The prefetch part's plans, once tuned (or none, once it rejects prefetch): the callback's
        public `plans`, which its state_dict saves and a later fit keeps until it tunes its own."""
        self.plans = plans

    def _keep_graph(self, graph: _Graph) -> None:
        """The whole-step gate's winner is the graph the steps replay; the pools alive are counted anew
        (by the capture part, which counts them at each capture: made after the prefetch part, so asked
        through the callback)."""
        self._capture.keep_graph(graph)

    # The callables the overrides part is given (bound methods, as above): what it asks of the callback's state
    def _stepping(self) -> bool:
        """Whether one of the callback's steps is under way (the dispatch part's, StepDispatch.step)."""
        return self._dispatch.in_step

    def _is_manual(self) -> bool:
        """Whether the fit's step is a manual-optimization one (l2lightning.graph.manual_step), set up at `setup`."""
        return self._manual is not None

    # The callables the decision part is given (bound methods, as above): what of the callback's it reads
    # that set-up, the capture and the dispatch rebind during the fit (asked at a capture or a wait's start,
    # never per replay)
    def _installed_methods(self) -> dict[str, Any]:
        """The module's methods set-up installed for the fit (module attribute -> the override)."""
        return self._installed

    def _last_capture_cost(self) -> float | None:
        """The wall seconds of the last capture (StepDispatch._eager_modes), what a re-capture waits to pay.
        (Asked through this method, not read off the cost record by the decision: tests and benchmarks
        override it in a subclass to fix what a capture costs.)"""
        return self._costs.last_capture_s

    def _get_operand_lines(self) -> list[str]:
        """The operand sites the last capture read from device scalars (StepCapture._serve_operands; the
        capture part is made after the decision part, so asked through the callback)."""
        return self._capture.operand_lines

    # The callables the warm-up part is given (bound methods, as above), of the capture part, made after it
    def _operand_scalars(self, gate_capture: bool, batch_idx: int) -> Any:
        """The device scalars a capture hands the step's operand sites (StepCapture.operand_scalars): the
        traced warm-up steps run the step with them too."""
        return self._capture.operand_scalars(gate_capture, batch_idx)

    # The callables the capture part is given (bound methods, as above): what of the callback's it sets
    def _set_capture_step(self, step: int) -> None:
        """The capture part's step of the fit's latest capture (not the gate's second one): the callback's
        public `capture_step`, which its state_dict saves and a later fit keeps (so the callback's, not
        the part's, which is made per fit; a checkpoint load and a manual step set it too)."""
        self.capture_step = step

    @property
    def captures(self) -> int:
        """The fit's captures, the whole-step gate's second one included (``summary()["captures"]``; the
        capture part counts them, nothing else sets them: read-only)."""
        return self._capture.captures

    @property
    def verify_report(self) -> Any:
        """With ``verify="capture"``, the captured step compared bit for bit with its eager step, or None
        (``summary()["verify"]``; the capture part's, read-only)."""
        return self._capture.verify_report

    @property
    def capturable_from_step(self) -> int | None:
        """The global step from which the optimizer ran make_capturable's configuration (the first capture,
        or the resumed fit's), or None (``summary()["capturable_from_step"]``, saved by ``state_dict``).
        The fit's (FitState): the capture sets it, the training start and the optimizer's release set it
        too; read-only here, as nothing outside them assigns it."""
        return self._fit.capturable_from_step

    @property
    def disabled_reason(self) -> str | None:
        """Why the callback refused the fit (the rest of it trains eagerly), or None (``summary()["reason"]``)."""
        return self._fit.disabled_reason

    @property
    def fallback_steps(self) -> int:
        """The steps the decision ran eagerly: fallbacks, `eager_steps`, a re-capture's wait
        (``summary()["fallback_steps"]``; the decision part counts them)."""
        return self._decision.fallback_steps

    @override
    def state_dict(self) -> dict[str, Any]:
        return {
            "capture_step": self.capture_step,
            "plans": self.plans,
            "capturable_from_step": self._fit.capturable_from_step,
        }

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.capture_step = state_dict.get("capture_step")
        self.plans = list(state_dict.get("plans", []))
        # a fit resumed past its capture step goes on in make_capturable's configuration, as the
        # uninterrupted fit did (on_train_start switches the optimizer before the first step)
        self._resumed_capturable_from = state_dict.get("capturable_from_step")

    @property
    def step_report(self) -> Any:
        """The captured step's phase report (``report=True`` on a GPU), or None."""
        return self._fit_report.step_report

    def _logs_timing(self) -> bool:
        """``log_timing`` asked for the l2/* metrics and a fit is under way."""
        return bool(self.log_timing and self._fit.module is not None)

    def _timing_metrics(self) -> dict[str, float]:
        """The l2/* metrics the fit's report logs, all from one ``summary()``: floats, non-finite or unknown
        ones left out."""
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
                "recapture_s",
            )
            if summary[key] is not None and math.isfinite(float(summary[key]))
        }
        prefetched = [row for row in self.plans if row.get("forward") or row.get("backward")]
        metrics["l2/prefetch_layers"] = float(len(prefetched))
        metrics["l2/prefetch_mib"] = float(sum(float(row.get("mib") or 0.0) for row in prefetched))
        metrics["l2/fallback_steps"] = float(self._decision.fallback_steps)
        gate = self._prefetch.gate_result
        if gate is not None and gate.gain is not None and math.isfinite(gate.gain.mean):
            metrics["l2/prefetch_gate_gain"] = float(gate.gain.mean)
        return metrics

    def summary(self) -> dict[str, Any]:
        """What happened in the last fit: captured or not (and why), timings, plans, verify verdict."""
        eager_ms = self._fit_report.timing.eager_ms()
        graph_ms = self._fit_report.timing.graph_ms()
        gate, tuning = self._prefetch.gate_result, self._prefetch.tuning_report
        decision, capture, costs = self._decision, self._capture, self._costs
        return {
            "captured": capture.captured,
            "reason": self._fit.disabled_reason,
            "capture_step": self.capture_step,
            "capturable_from_step": self._fit.capturable_from_step,
            "captures": capture.captures,
            "graphs": len(capture.captured_roles),
            "eager_step_ms": eager_ms,
            "graph_step_ms": graph_ms,
            "replay_speedup": (eager_ms / graph_ms) if eager_ms and graph_ms else None,
            "plans": self.plans,
            "verify": str(capture.verify_report) if capture.verify_report is not None else None,
            "replay_check": self.replay_check.to_dict(),
            "fallback_steps": decision.fallback_steps,
            "fallback_causes": sorted(decision.fallback_causes),
            "graph_pool_mib": capture.pool_mib,
            "prefetch_gate": gate.to_dict() if gate is not None else None,
            # wall seconds to the microsecond (a tuning that gives up at once is not 0)
            **{key: round(value, 6) for key, value in costs.seconds.items()},
            "recaptures": costs.recaptures,
            "last_recapture_s": None if costs.last_recapture_s is None else round(costs.last_recapture_s, 6),
            "recapture_wait_steps": decision.waited_steps,
            "operand_scalars": {"sites": list(capture.operand_lines), "changes": decision.operand_changes},
            "tuning": tuning.to_dict() if tuning is not None else None,
            "step_report": self.step_report.to_dict() if self.step_report is not None else None,
        }

    # ------------------------------------------------------------------ refusals
    def _warn_once(self, key: str, message: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            rank_zero_warn(f"L2GraphCallback: {message}")

    def _disable(self, reason: str) -> None:
        """Train eagerly for the rest of the fit, with one warning: with the optimizer as configured, or,
        after a capture, in make_capturable's configuration to the fit's end (the warning says so)."""
        if self._fit.disabled_reason is None:
            self._fit.disabled_reason = reason
            rank_zero_warn(f"L2GraphCallback: {reason}; training eagerly.{self._capturable_stretch()}")
        self._fit.mode = "eager"
        self._slots.state.graph = None
        self._overrides.replayed = None
        self._prefetch.drop_gate()
        self._slots.clear()  # the graphs of the other accumulation roles
        self._release_optimizer()

    def _capturable_stretch(self) -> str:
        """What of the fit runs in make_capturable's configuration, for a warning that gives up after a capture."""
        wrapped = self._fit.optimizer
        if wrapped is None or not self._owns_optimizer or not wrapped.switched:
            return ""
        if not (self._capture.stepping_captures or self._resumed_switched):
            return ""  # a capture that failed: the optimizer goes back to the user's configuration
        name = optimizer_names(wrapped)
        runs = "run" if isinstance(wrapped, CapturableOptimizers) else "runs"
        step = self._fit.capturable_from_step
        return (
            f" From step {step} on, {name} {runs} in make_capturable's configuration (`capturable=True`, the "
            "one the replays used), whose arithmetic can differ from yours in the last bits (Adam and AdamW "
            f"without `fused=True`); `l2lightning.CapturableFrom({step})` reproduces this fit eagerly"
        )

    def _release_optimizer(self, fit_ends: bool = False) -> None:
        """Stop handling the optimizer's steps; give it back as the user configured it unless it has
        run in make_capturable's configuration (from the capture step), which it then keeps until the
        fit ends (`fit_ends`), so that the whole fit has one eager reference (CapturableFrom)."""
        wrapped, self._fit.optimizer = self._fit.optimizer, None
        if wrapped is None:
            wrapped, self._kept_optimizer = self._kept_optimizer, None
            if wrapped is not None and fit_ends:
                wrapped.release()
            return
        wrapped.handler = None
        if self._owns_optimizer:
            stepping_captures = self._capture.stepping_captures
            if wrapped.switched and (stepping_captures or self._resumed_switched) and not fit_ends:
                self._kept_optimizer = wrapped  # released at the fit's end (_cleanup)
            else:
                wrapped.release()
                if not stepping_captures:  # switched for a capture that failed: the fit stayed plain
                    self._fit.capturable_from_step = None
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
        return self._configuration_refusal(trainer, pl_module)

    @staticmethod
    def _configuration_refusal(trainer: Trainer, pl_module: LightningModule) -> str | None:
        """What the Trainer's and the module's configuration rule out, on any device."""
        if is_param_in_hook_signature(pl_module.training_step, "dataloader_iter", explicit=True):
            return (
                "`training_step` takes `dataloader_iter` and fetches its own batches; the capture needs the batch "
                "Lightning passes to `training_step(batch, batch_idx)`"
            )
        # 16-mixed: Lightning's GradScaler step is captured around a fused optimizer (l2lightning.graph.amp_step;
        # whether the optimizer is fused is known at the training start, once it is configured)
        return scaled_step_refusal(trainer.precision_plugin)

    # ------------------------------------------------------------------ set-up and clean-up
    @override
    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        self._reset_run_state()
        self._scaled = None
        self._manual = None
        strategy = type(trainer.strategy).__name__
        if strategy in UNSUPPORTED_STRATEGIES:
            raise ValueError(
                f"L2GraphCallback does not support the {strategy}; supported: single-device strategies "
                "(DDP falls back to eager). Unsupported: FSDP, DeepSpeed, ModelParallel, XLA."
            )
        if not pl_module.automatic_optimization:
            # the whole training_step is the captured step (l2lightning.graph.manual_step); what it cannot
            # capture trains eagerly, saying why: a fit plain Lightning runs runs with the callback too
            reason = manual_refusal(trainer, pl_module, self.verify, own=self)
            if reason:
                self._disable(reason)
                return
            self._manual = ManualStep(self)
        reason = self._refusal(trainer, pl_module)
        if reason:
            self._disable(reason)
            return
        if self._manual is not None:
            # the prefetch's chain discovery runs training_step under no_grad: a manual step's
            # manual_backward and optimizer steps cannot run there (said at the training start)
            self._prefetch.failed = True
        user_hooks = tuple(h for h in CLOSURE_HOOKS if is_overridden(h, pl_module))
        # every hook of the module that runs inside the captured step (analyse skips Lightning's own)
        self._fit.source = analyse(
            pl_module,
            ("training_step", *user_hooks, "configure_gradient_clipping", "optimizer_zero_grad", "backward"),
        )
        analyse_callbacks([cb for cb in trainer.callbacks if cb is not self], CLOSURE_HOOKS, self._fit.source)
        self._fit.batch_reads = batch_reads(pl_module)
        reason = self._source_refusal() or (
            manual_source_refusal(self._fit.source, pl_module) if self._manual is not None else None
        )
        if reason:
            self._disable(reason)
            return
        self._fit.module = pl_module
        self._fit.trainer = trainer
        part = self._overrides  # the methods installed are the overrides part's, bound to it
        step = part.training_step if self._manual is None else self._manual.training_step
        overrides: dict[str, Any] = {
            "training_step": presenting_signature_of(pl_module.training_step, step),
            "optimizer_zero_grad": forwarding(part.optimizer_zero_grad),
            "backward": forwarding(part.backward),
            "configure_gradient_clipping": forwarding(part.configure_gradient_clipping),
            "log": forwarding(part.log),
        }
        for hook in user_hooks:
            overrides[hook] = part.captured_hook(hook, getattr(pl_module, hook))
        self._fit.originals = {name: getattr(pl_module, name) for name in overrides}
        if self._manual is not None:  # a manual step returning None is a step to capture all the same
            self._fit.originals["training_step"] = none_as_empty(self._fit.originals["training_step"])
        # what the module's instance itself holds (`model.training_step = fn`) goes back after the fit
        self._shadowed = {name: vars(pl_module).get(name, ABSENT) for name in overrides}
        for name, fn in overrides.items():
            setattr(pl_module, name, fn)
        self._installed = overrides
        for cb in trainer.callbacks:
            if cb is self:
                continue
            for hook in CLOSURE_HOOKS:
                if is_overridden(hook, cb, parent=Callback):
                    self._callback_overrides.append((cb, hook, vars(cb).get(hook, ABSENT)))
                    setattr(cb, hook, part.captured_hook(hook, getattr(cb, hook)))
        # where each method the step's source was read through is bound, the overrides above included
        self._fit.code_bindings = self._fit.source.code_bindings()

    def _cleanup(self, pl_module: LightningModule | None) -> None:
        """Undo everything the callback installed; drop every reference to the module and the graph."""
        module = self._fit.module or pl_module
        if module is not None:
            for name, fn in self._installed.items():
                if vars(module).get(name) is fn:  # not replaced again by someone else during the fit
                    put_back(module, name, self._shadowed[name])
        self._installed = {}
        self._shadowed = {}
        if self._undo_progress_bar_reads is not None:
            self._undo_progress_bar_reads()
            self._undo_progress_bar_reads = None
        if self._undo_cuda_state_watch is not None:
            self._undo_cuda_state_watch()
            self._undo_cuda_state_watch = None
        for cb, hook, before in self._callback_overrides:
            put_back(cb, hook, before)
        self._callback_overrides.clear()  # (the warm-up part holds the same list)
        self._prefetch.remove()  # the compiled children's forward put back, the prefetch hooks off
        self._release_optimizer(fit_ends=True)
        if self._scaled is not None:
            self._scaled.uninstall()
            self._scaled = None
        if self._manual is not None:
            self._manual.schedulers.uninstall()
        self._manual = None
        if self._micro_batches is not None:
            self._micro_batches.uninstall()
            self._micro_batches = None
        self._slots.state.graph = None
        self._prefetch.drop_gate()
        self._slots.clear()
        self._decision.release()  # the module flags' global registration hooks
        self._overrides.release()  # the graphs, the step's output and the logs it recorded
        self._warmup.groups = {}
        self._warmup.tracer = None
        self._fit.pending = None
        self._fit.pending_tensors = []
        self._fit.originals = {}
        self._fit.module = None
        self._fit.trainer = None

    def _source_refusal(self) -> str | None:
        """Why what the step's source does cannot be replayed (and the fit trains eagerly), or None."""
        source = self._fit.source
        if source.global_writes:
            return (
                f"the step assigns module-level or closure names ({'; '.join(source.global_writes[:3])}); a replayed "
                "graph runs no Python, so they would stop changing. Change them outside the step "
                "(`on_train_batch_end` runs after every replay)"
            )
        if source.trainer_metric_reads:
            return _stale_read(
                "the Trainer's metrics",
                source.trainer_metric_reads,
                "whose values Lightning replaces as steps log and validations run",
                "reading the values of the capture step",
                "Pass them in through an attribute updated in place (`self.w.copy_(value)` in "
                "`on_validation_end`) instead",
            )
        if source.scheduler_reads:
            return _stale_read(
                "an LR scheduler's state",
                source.scheduler_reads,
                "which each scheduler step changes",
                "the value of the capture step",
                'Read the learning rate from the optimizer (`self.optimizers().param_groups[0]["lr"]`), '
                "which replays read as it is at each step",
            )
        if source.clock_reads:
            return _stale_read(
                "the host clock",
                source.clock_reads,
                "which moves from step to step",
                "the capture step's reading",
                "Decide on the time in a hook outside the step (`on_train_batch_start`) and hand the "
                "decision in through an attribute the step reads (compared before each replay), or run "
                "such steps eagerly with `eager_steps=lambda trainer, batch_idx: ...`",
            )
        if source.iterator_advances:
            return (
                f"the step advances an iterator held outside it ({'; '.join(source.iterator_advances[:3])}); a "
                "replayed graph runs no Python, so it would stop advancing and every replay would keep the "
                "capture step's item. Advance it in a hook outside the step (`on_train_batch_start`) and hand "
                "the item in through an attribute the step reads (compared before each replay)"
            )
        if source.opaque_conditions and self.eager_steps is None:
            # A replayed graph would take the capture step's branch at every step: refused rather than
            # trained on the wrong branch; `eager_steps` tells the callback which steps take the other.
            return (
                "training_step branches on the step counters in a way the callback cannot evaluate, at "
                f"{'; '.join(source.opaque_conditions)}; a replayed graph would always take the branch "
                "of the capture step. Pass `eager_steps=lambda trainer, batch_idx: ...` returning True for "
                "the steps that take the other branch to capture the rest"
            )
        return None

    @override
    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if stage == "fit":
            self._cleanup(pl_module)

    @override
    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception: BaseException) -> None:
        # teardown does not run after an error (or KeyboardInterrupt): leave nothing installed
        self._cleanup(pl_module)
        self._fit.mode = "eager"

    @override
    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self._fit.disabled_reason or self._fit.module is None:
            return
        # Submodules (configure_model builds them after setup) and hooks registered up to now: what
        # their code reads joins the comparisons before each replay, what it assigns is refused
        self._fit.hook_owners = analyse_called_code(pl_module, self._fit.source)
        reason = self._source_refusal()
        if reason:
            self._disable(reason)
            return
        reason = manual_start_refusal(trainer, pl_module) if self._manual is not None else None
        if reason:
            self._disable(reason)
            return
        if self._manual is None and len(trainer.optimizers) != 1:
            # (a manual step may step several: they are captured together, l2lightning.graph.joined_optimizers)
            self._disable(
                f"{len(trainer.optimizers)} optimizers configured; the capture supports exactly one"
            )
            return
        reason = momentum_cycled_every_step(trainer) if self._manual is None else None
        if reason:
            self._disable(reason)
            return
        optimizer = trainer.optimizers[0]
        scaler = grad_scaler_of(trainer.precision_plugin)
        if scaler is not None:
            reason = unfused_refusal(optimizer, str(trainer.precision), scaler)
            if reason:
                self._disable(reason)
                return
        try:
            # the user's configuration until the capture step (StepCapture switches it on there)
            if len(trainer.optimizers) > 1:  # a manual step's (l2lightning.graph.joined_optimizers)
                wrapped = intercept_all(trainer.optimizers, trainer.strategy.root_device)
                owns = any(wrapped.owned)
            else:
                existing = installed_capturable(optimizer)
                wrapped = existing or intercept(optimizer, trainer.strategy.root_device)
                owns = existing is None
        except OptimizerNotCapturableError as exc:
            if not self.eager_optimizer_fallback:
                raise OptimizerNotCapturableError(
                    f"{exc}. Leave L2GraphCallback(eager_optimizer_fallback=True) (the default) to train "
                    "eagerly instead"
                ) from exc
            self._disable(str(exc))
            return
        self._fit.optimizer = wrapped
        self._owns_optimizer = owns
        if self._check_on:
            # the sampled check's kernels compile beside the warm-up steps, not at the first check
            # (CuPy imported for them where prefetch would import it anyway)
            check_kernels.prepare(trainer.strategy.root_device, import_cupy=self.prefetch != "off")
        if self._manual is not None:
            # the whole training_step is the step (ManualStep.training_step); its optimizer steps run as they are
            wrapped.handler = self._manual.optimizer_step
            # the LR schedulers the step steps itself: stepped again after each replay (l2lightning.graph.scheduler_steps)
            self._manual.schedulers.install([c.scheduler for c in trainer.lr_scheduler_configs])
            if self.prefetch != "off":
                self._warn_once(
                    "prefetch-manual",
                    "prefetch off under manual optimization (its set-up runs training_step without gradients, "
                    "which a manual step's `manual_backward` needs); capturing the graph without it.",
                )
        elif scaler is None:
            wrapped.handler = self._optimizer_step
        else:
            # the whole step (closure, scaler.step, scaler.update) is handled at the precision plugin;
            # the optimizer's step inside it runs as it is
            self._scaled = ScaledStep(
                trainer.precision_plugin,
                optimizer,
                self._scaled_step,
                active=lambda: self._fit.optimizer is not None,
                undone=lambda: self._fit.mode == "verify",
            )
            self._scaled.install()
            wrapped.handler = run_through
        if self._manual is None:
            # accumulating micro-batches, whose closures Lightning calls itself, are steps of the callback too
            self._micro_batches = MicroBatchClosures(trainer, self._micro_batch_step)
        resumed, self._resumed_capturable_from = self._resumed_capturable_from, None
        if resumed is not None and trainer.global_step >= resumed:
            wrapped.switch_on()  # resumed after the capture step: the configuration the fit had there
            self._fit.capturable_from_step = resumed
            self._resumed_switched = True
        # prog_bar values: read when the progress bar (or anyone) reads them, not with a host sync per step
        self._undo_progress_bar_reads = defer_progress_bar_reads(trainer)
        # a CUDA generator's state set between steps (a seed in a hook) re-seeds cuDNN's RNN dropout at
        # the next eager nn.LSTM call, never at a replay: the next replay is checked
        self._undo_cuda_state_watch = watch_cuda_state_setters(self._cuda_state_set)
        self._fit.started_at = time.perf_counter()
        # replays dispatch only the closure's hooks that something overrides (l2lightning.graph.replay_closure)
        self._dispatch.replay_closure = ReplayClosure() if why_not_fast(trainer) is None else None
        for _, metric in named_metrics(pl_module):
            if needs_sync_free_nan_check(metric) and "_cast_and_nan_check_input" not in vars(metric):
                metric._cast_and_nan_check_input = sync_free_nan_check(metric)
                self._nan_patched.append(metric)
        if self._fit.source.opaque_conditions:  # captured only because `eager_steps` was given (see setup)
            self._warn_once(
                "opaque",
                "training_step branches on the step counters in a way the callback cannot evaluate, at "
                f"{'; '.join(self._fit.source.opaque_conditions)}; replays take the branch of the capture step, "
                "and the steps your `eager_steps` selects run eagerly: it must select every step that takes "
                "the other branch",
            )

    def _optimizer_step(self, run: Callable[..., Any], closure: Any, kwargs: dict) -> Any:
        """The capturable optimizer's handler: the callback's step, on the graph of its accumulation role."""
        self._enter_role(closure)
        return self._dispatch.step(run, closure, kwargs)

    def _micro_batch_step(self, step: MicroBatchStep) -> Any:
        """An accumulating micro-batch (its closure, which Lightning calls itself): the callback's step
        without an optimizer update, on the graph of its role (l2lightning.graph.accumulation)."""
        if (
            self._fit.optimizer is None or self._dispatch.in_step
        ):  # given up on (or inside a step): as Lightning runs it
            return step()
        self._enter_role(step)
        return self._dispatch.step(run_micro_batch, step, {})

    def _enter_role(self, closure: Any) -> None:
        """The per-graph state of the graph that serves this step (l2lightning.graph.graph_slots)."""
        self._slots.enter(role_of(self._fit.trainer, closure))

    def _scaled_step(self, run: Callable[..., Any], closure: Any, kwargs: dict) -> Any:
        """The step under a GradScaler (:class:`~l2lightning.graph.amp_step.ScaledStep`'s handler): the
        callback's step, with what the graph holds of the scaler kept in view."""
        self._enter_role(closure)
        scaled, role = self._scaled, self._slots.state  # this step's graph's
        if role.graph is not None and role.recapture_next is None:
            changes = scaled.baked_changes()
            if changes:
                role.recapture_next = (
                    f"the GradScaler's {', '.join(changes)} since capture (baked into the graph)"
                )
        capture = self._capture
        captures = capture.captures
        result = self._dispatch.step(run, closure, kwargs)
        if capture.captures != captures and role.graph is not None:
            # written by scaler.update, outside the closure the step tracer sees: the sampled replay
            # check saves, puts back and compares them with the rest of what the step writes
            role.graph.external_writes += scaled.written()
            scaled.mark_captured()
        return result

    # ------------------------------------------------------------------ per-step decision
    @override
    def on_train_batch_start(
        self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if self._fit.disabled_reason or self._fit.module is None:
            self._fit.pending = None
            self._dispatch.give_back_step_stream()  # once, after the step that disabled the callback
            return
        self._fit.pending = (batch, batch_idx)
        if self.compile and not self._compiled_children:
            self._prefetch.prepare_compiled(pl_module, StaticBatch(batch, self._fit.batch_reads))

    # ------------------------------------------------------------------ device and timing events

    @staticmethod
    def _events() -> tuple[torch.cuda.Event, torch.cuda.Event]:
        return torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)

    def _device(self) -> torch.device:
        return self._fit.trainer.strategy.root_device

    def _device_type(self) -> str:
        return self._device().type

    # ------------------------------------------------------------------ checkpoints and metrics
    @override
    def on_save_checkpoint(
        self, trainer: Trainer, pl_module: LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        if self._manual is not None:  # the step wrappers a manual step's LR schedulers hold for the fit
            self._manual.schedulers.portable_states(checkpoint.get("lr_schedulers", []))
        wrapped = self._fit.optimizer or self._kept_optimizer
        if wrapped is None or "optimizer_states" not in checkpoint:
            return
        # Save what the optimizer would save without capture (original capturable flag, CPU steps);
        # several (a manual step's) are in the Trainer's order, as Lightning saves them
        states = checkpoint["optimizer_states"]
        for i, member in enumerate(members_of(wrapped)[: len(states)]):
            states[i] = member.portable_state_dict(states[i])

    @override
    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self._fit.mode = "eager"
        self._overrides.replayed = None  # its closure is over: the graph is the callback's alone again
        # as soon as a captured graph's first replays are timed; at each epoch's end again
        self._fit_report.log_once_known(
            trainer, self._logs_timing() and self._slots.state.graph is not None, self._timing_metrics
        )

    @override
    def on_train_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._fit_report.log_at_epoch_end(trainer, self._logs_timing(), self._timing_metrics)

    # ------------------------------------------------------------------ the sampled replay check's events
    def _cuda_state_set(self, name: str) -> None:
        """`torch.cuda.NAME` set a CUDA generator's state. Between steps (a hook) the next replay is
        checked; inside a step it is the step's own (activation checkpointing's recomputation puts the
        forward's state back at every backward), which the step tracer judges."""
        if self._dispatch.in_step:
            return
        self._checks_after(f"a call of `torch.cuda.{name}`")
        if (
            self._warmup.hidden_random is not None
            and not self._check_on
            and self._slots.state.graph is not None
        ):
            # plain Lightning's next nn.LSTM/GRU call re-seeds cuDNN's dropout state after this; a replay
            # never calls it, and without the sampled check no replay is compared: train eagerly
            self._decision.disable_at_next_step(
                f"`torch.cuda.{name}` was called between steps, after which cuDNN re-seeds its RNN dropout "
                f"state at the next eager call ({self._warmup.hidden_random}), which a replay never makes; with "
                f"verify={self.verify!r} no replay is compared with the eager step (verify='sampled' checks "
                "the next replay and captures again)"
            )

    @override
    def on_train_epoch_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._checks_after("an epoch start")

    @override
    def on_validation_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._checks_after("a validation loop")

    @override
    def on_load_checkpoint(
        self, trainer: Trainer, pl_module: LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        self._checks_after("a checkpoint load")

    def _checks_after(self, event: str) -> None:
        """The next replay of every graph is checked (an event may have changed what the step reads)."""
        for schedule in self._slots.schedules():
            schedule.after(event)
