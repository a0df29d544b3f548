"""L2GraphCallback: Lightning's own training step captured in one CUDA graph, with L2 weight prefetch.

Route chosen: a callback that, in ``setup``, installs instance-level overrides of the
LightningModule's documented hooks (``training_step``, ``optimizer_step``, ``optimizer_zero_grad``,
``backward``) and removes them in ``teardown``. A callback cannot swap the Trainer's strategy, and
the product's front door is ``Trainer(callbacks=[L2GraphCallback()])`` on an unmodified module,
so hooks it is. No private Lightning method is patched.

One step of automatic optimization goes ``optimizer_step`` hook -> ``LightningOptimizer.step`` ->
``Strategy.optimizer_step`` -> ``Precision.optimizer_step`` -> ``optimizer.step(closure)``, where the
closure runs ``training_step``, ``optimizer_zero_grad`` and ``backward``. So:

* warm-up steps (``warmup_steps``) run eagerly and are timed;
* the capture step records the whole ``optimizer_step`` hook (the user's ``training_step`` on static
  batch buffers, backward, gradient clipping, the capturable optimizer update) into one graph and
  replays it once, which is that step's real update;
* every later step copies the batch into the static buffers, replays, and then calls the closure in
  a cheap replay mode: ``training_step`` returns the static outputs and re-issues the ``self.log``
  calls recorded at capture with this step's values, ``backward`` and ``optimizer_zero_grad`` do
  nothing (the graph's ``.grad`` tensors stay). Replay first, closure second, or Lightning would
  copy the previous step's loss.

Steps that cannot be replayed run eagerly, with one rank-zero warning naming the cause: another
batch shape or dtype (the last partial batch), a capture that fails (a host sync such as ``.item()``
in ``training_step``). Configurations the graph cannot honour (gradient accumulation, fp16 with a
GradScaler, manual optimization, hooks the replay would skip) are refused up front. A torchmetrics
object updated inside ``training_step`` is refused at the first warm-up step that updates it: a
replay would skip the metric's Python-side state, so the fit goes on eagerly with the optimizer as
it was configured.
"""

from __future__ import annotations

import contextlib
import math
import statistics
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from lightning.pytorch.utilities.model_helpers import is_overridden
from typing_extensions import override

from l2lightning._env import cuda_unavailable_reason, prefetch_unavailable_reason
from l2lightning.capture import StaticBatch, TrainingState, graph_capture, loss_of
from l2lightning.optim import CapturableOptimizer, OptimizerNotCapturableError, make_capturable
from l2lightning.prefetch import PrefetchPlan

PREFETCH_MODES = ("off", "default", "auto", "decoy")
# Hooks that run inside the captured step once, and that a replay would silently skip.
REPLAY_SKIPPED_HOOKS = ("on_before_backward", "on_after_backward", "on_before_optimizer_step")
UNSUPPORTED_STRATEGIES = ("FSDPStrategy", "DeepSpeedStrategy", "ModelParallelStrategy", "XLAStrategy")
_OVERRIDDEN = ("training_step", "optimizer_step", "optimizer_zero_grad", "backward")
# Timed replays whose events must have completed before the l2/* metrics are first logged.
TIMED_REPLAYS_BEFORE_LOG = 5


def metric_update_counts(module: torch.nn.Module) -> dict[str, int]:
    """``_update_count`` of every torchmetrics ``Metric`` among `module`'s submodules, by attribute path.

    ``update()`` and ``forward()`` both add one to it. torchmetrics is looked up in ``sys.modules``,
    never imported: if it was not imported, no submodule can be one of its metrics.
    """
    torchmetrics = sys.modules.get("torchmetrics")
    metric_type = getattr(torchmetrics, "Metric", None)
    if not isinstance(metric_type, type):
        return {}
    return {
        name: int(getattr(sub, "_update_count", 0))
        for name, sub in module.named_modules()
        if isinstance(sub, metric_type)
    }


def metrics_updated(before: dict[str, int], after: dict[str, int]) -> list[str]:
    """Attribute paths of the metrics whose update count changed between two snapshots."""
    return sorted(name for name, count in after.items() if count != before.get(name, 0))


def metric_update_reason(names: list[str]) -> str:
    """Why a step that updates these torchmetrics objects inside ``training_step`` is not captured."""
    return (
        f"training_step updates the torchmetrics objects {names}, and a replayed graph would skip their "
        "Python-side state (update count, list states, cached result), so their values would be wrong; "
        "update them in `on_train_batch_end` from the outputs training_step returns (for example "
        "`return {'loss': loss, 'preds': preds.detach()}`)"
    )


@dataclass
class _LogCall:
    args: tuple
    kwargs: dict


@dataclass
class _Timing:
    """CUDA-event pairs of eager and replayed steps; read lazily so timing never syncs the host."""

    eager: list[tuple[torch.cuda.Event, torch.cuda.Event]] = field(default_factory=list)
    graph: list[tuple[torch.cuda.Event, torch.cuda.Event]] = field(default_factory=list)

    @staticmethod
    def _median_ms(pairs: list[tuple[torch.cuda.Event, torch.cuda.Event]]) -> float | None:
        done = [start.elapsed_time(end) for start, end in pairs if end.query()]
        return statistics.median(done) if done else None

    def eager_ms(self) -> float | None:
        # The first eager step pays for lazy initialisation (cuBLAS handles, allocator growth).
        return self._median_ms(self.eager[1:] or self.eager)

    def graph_ms(self) -> float | None:
        return self._median_ms(self.graph)


class L2GraphCallback(Callback):
    """Capture the whole training step (forward, loss, backward, optimizer step) in one CUDA graph.

    Inside the graph a side-stream kernel prefetches into L2 the weights the next layer will read
    (forward: W_{i+1}; backward: W_{i-1}). Gradients stay bit-identical to an eager run of the same
    (capturable) optimizer configuration; ``verify=True`` checks that at capture.

    Args:
        warmup_steps: eager steps before the capture (>= 1; PyTorch needs warm-up before capturing
            backward, and the optimizer's state must exist).
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
            whole-step graph. The prefetch then goes through custom ops that the compiler keeps in
            its graph (:mod:`l2lightning.prefetch_ops`), not through hooks that would break it.
        report: print the step report (per-layer plans, tuning table, timings) at capture.
        eager_optimizer_fallback: train eagerly (with a warning) when the optimizer cannot be
            captured, instead of raising.
        log_timing: log ``l2/eager_step_ms``, ``l2/graph_step_ms``, ``l2/speedup``,
            ``l2/graph_pool_mib``, ``l2/prefetch_layers``, ``l2/prefetch_mib`` and
            ``l2/fallback_steps`` through the Trainer's loggers on rank zero: once at the first
            ``on_train_batch_end`` after the first ``TIMED_REPLAYS_BEFORE_LOG`` replays have
            finished on the device (read without a host sync), and again at each epoch end.

    Example:
        >>> from lightning.pytorch import Trainer
        >>> from l2lightning import L2GraphCallback
        >>> trainer = Trainer(accelerator="gpu", devices=1, max_steps=100, callbacks=[L2GraphCallback()])
        >>> trainer.fit(model, datamodule=dm)  # doctest: +SKIP
    """

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
        self.warmup_steps = warmup_steps
        self.prefetch = prefetch
        self.backward_prefetch = backward_prefetch
        self.verify = verify
        self.compile = compile
        self.report = report
        self.eager_optimizer_fallback = eager_optimizer_fallback
        self.log_timing = log_timing
        self._reset_run_state()
        # Persisted through state_dict (chosen plans and capture step of the last run).
        self.capture_step: int | None = None
        self.plans: list[dict[str, Any]] = []

    # ------------------------------------------------------------------ state
    def _reset_run_state(self) -> None:
        self.disabled_reason: str | None = None
        self.verify_report: Any = None
        self.fallback_steps = 0
        self._fallback_causes: set[str] = set()
        self._module: LightningModule | None = None
        self._originals: dict[str, Any] = {}
        self._mode = "eager"
        self._steps_seen = 0
        self._graph: torch.cuda.CUDAGraph | None = None
        self._static: StaticBatch | None = None
        self._static_output: Any = None
        self._graph_grads: list[tuple[torch.Tensor, torch.Tensor | None]] = []
        self._log_calls: list[_LogCall] = []
        self._optimizer: CapturableOptimizer | None = None
        self._hooks: Any = None
        self._timing = _Timing()
        self._pool_mib: float | None = None
        self._timing_logged = False  # the l2/* metrics went to the loggers once they were known
        self._tuning_report: Any = None
        self._step_output: Any = None
        self._captured = False  # this fit captured a graph (capture_step may come from a checkpoint)
        self._compiled_children: list[torch.nn.Module] = []
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
            "eager_step_ms": eager_ms,
            "graph_step_ms": graph_ms,
            "speedup": (eager_ms / graph_ms) if eager_ms and graph_ms else None,
            "plans": self.plans,
            "verify": str(self.verify_report) if self.verify_report is not None else None,
            "fallback_steps": self.fallback_steps,
            "fallback_causes": sorted(self._fallback_causes),
            "graph_pool_mib": self._pool_mib,
            "tuning": self._tuning_report.to_dict() if self._tuning_report is not None else None,
            "step_report": self.step_report.to_dict() if self.step_report is not None else None,
        }

    # ------------------------------------------------------------------ set-up and refusals
    def _disable(self, reason: str) -> None:
        """Train eagerly for the rest of the fit, with one warning naming the reason."""
        if self.disabled_reason is None:
            self.disabled_reason = reason
            rank_zero_warn(f"L2GraphCallback: {reason}; training eagerly.")
        self._mode = "eager"

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
        if trainer.accumulate_grad_batches != 1:
            return f"gradient accumulation (accumulate_grad_batches={trainer.accumulate_grad_batches}) is not captured"
        precision = str(trainer.precision)
        if precision in ("16-mixed", "16"):
            return f"precision={precision!r} uses a GradScaler whose step syncs with the host; use 'bf16-mixed' or 'bf16-true'"
        skipped = [h for h in REPLAY_SKIPPED_HOOKS if is_overridden(h, pl_module)]
        skipped += [
            f"{type(cb).__name__}.{h}"
            for cb in trainer.callbacks
            if cb is not self
            for h in REPLAY_SKIPPED_HOOKS
            if is_overridden(h, cb, parent=Callback)
        ]
        if skipped:
            return f"hooks {skipped} would run only at capture, not at each replayed step"
        return None

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
        for name in _OVERRIDDEN:
            self._originals[name] = getattr(pl_module, name)
        pl_module.training_step = self._training_step  # type: ignore[method-assign]
        pl_module.optimizer_step = self._optimizer_step  # type: ignore[method-assign]
        pl_module.optimizer_zero_grad = self._optimizer_zero_grad  # type: ignore[method-assign]
        pl_module.backward = self._backward  # type: ignore[method-assign]

    @override
    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        for name in self._originals:
            if name in vars(pl_module):
                delattr(pl_module, name)
        self._originals = {}
        for child in self._compiled_children:
            if "forward" in vars(child):
                del child.forward  # back to the class's own forward
        self._compiled_children = []
        if self._hooks is not None:
            self._hooks.remove()
            self._hooks = None
        if self._optimizer is not None:
            self._restore_lr_floats()
        self._graph = None
        self._static = None
        self._static_output = None
        self._log_calls = []

    @override
    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self.disabled_reason:
            return
        if len(trainer.optimizers) != 1:
            self._disable(
                f"{len(trainer.optimizers)} optimizers configured; the capture supports exactly one"
            )
            return
        try:
            self._optimizer = make_capturable(trainer.optimizers[0], trainer.strategy.root_device)
        except OptimizerNotCapturableError as exc:
            if not self.eager_optimizer_fallback:
                raise OptimizerNotCapturableError(
                    f"{exc}. Pass L2GraphCallback(eager_optimizer_fallback=True) to train eagerly instead."
                ) from exc
            self._disable(str(exc))
            return
        self._mode = "warmup"

    # ------------------------------------------------------------------ per-step decision
    @override
    def on_train_batch_start(
        self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if self.disabled_reason or self._module is None:
            self._mode = "eager"
            return
        self._steps_seen += 1
        if self._steps_seen == 1 and self.compile:
            self._prepare_compiled(pl_module, batch)
        if self._steps_seen <= self.warmup_steps:
            self._mode = "warmup"
            return
        if self._graph is None:
            self._static = StaticBatch(batch)
            self._mode = "capture"
            return
        mismatch = self._static.mismatch(batch)
        if mismatch:
            self._fall_back_this_step(f"batch {batch_idx}: {mismatch}")
            return
        if self._optimizer is not None and self._optimizer.lr_changed_since_capture():
            # A float learning rate is baked into the graph (SGD): capture again with the new one.
            self._static = StaticBatch(batch)
            self._mode = "capture"
            return
        self._static.copy_in(batch)
        self._mode = "replay"

    def _fall_back_this_step(self, cause: str) -> None:
        self.fallback_steps += 1
        kind = cause.split(":", 1)[-1].strip()
        if kind not in self._fallback_causes:
            self._fallback_causes.add(kind)
            rank_zero_warn(
                f"L2GraphCallback: running this step eagerly ({cause}); the graph is kept for later steps."
            )
        self._mode = "fallback"

    # ------------------------------------------------------------------ the overridden LightningModule hooks
    def _training_step(self, *args: Any, **kwargs: Any) -> Any:
        if self._mode == "replay":
            self._reissue_logs()
            return self._static_output
        if self._mode in ("capture", "verify-eager"):
            # The graph reads the static buffers; the batch Lightning passed was copied into them.
            # The prefetch scope is the forward pass: its end joins the side stream and arms the
            # backward join on the outputs this forward produced.
            with self._prefetch_scope():
                output = self._originals["training_step"](self._static.batch, *args[1:], **kwargs)
            self._phase_events.mark("forward")
            self._step_output = output
            return output
        if self._mode == "warmup":
            return self._warmup_training_step(*args, **kwargs)
        with self._kernel_counter.phase("forward"):
            return self._originals["training_step"](*args, **kwargs)

    def _warmup_training_step(self, *args: Any, **kwargs: Any) -> Any:
        """An eager ``training_step`` that refuses the capture if it updates a torchmetrics object.

        Metrics are compared right around the user's ``training_step``, so updates in
        ``on_train_batch_end`` (the supported place) are not counted. The refusal comes before the
        optimizer update of this step (the closure runs first), so releasing the optimizer here
        makes the rest of the fit the eager one the user would have had without the callback.
        """
        before = metric_update_counts(self._module)
        with self._kernel_counter.phase("forward"):
            output = self._originals["training_step"](*args, **kwargs)
        updated = metrics_updated(before, metric_update_counts(self._module))
        if updated:
            self._disable(metric_update_reason(updated))
            # with no wrapper left, the checkpoint hook has nothing to convert
            wrapped, self._optimizer = self._optimizer, None
            if wrapped is not None:
                wrapped.release()
        return output

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

    def _optimizer_step(
        self, epoch: int, batch_idx: int, optimizer: Any, optimizer_closure: Callable | None = None
    ) -> None:
        original = self._originals["optimizer_step"]
        if self._mode == "replay":
            self._replay(optimizer_closure)
            return None
        if self._mode == "capture":
            self._capture(epoch, batch_idx, optimizer, optimizer_closure)
            return None
        if self._mode != "warmup":  # eager or a one-step fallback: not timed
            return original(epoch, batch_idx, optimizer, optimizer_closure)
        if self.report and self._steps_seen == self.warmup_steps:
            # The last warm-up step is profiled (and so not timed) to count kernels per phase.
            return self._kernel_counter.profile(
                lambda: original(epoch, batch_idx, optimizer, optimizer_closure)
            )
        start, end = self._events()
        start.record()
        out = original(epoch, batch_idx, optimizer, optimizer_closure)
        end.record()
        self._timing.eager.append((start, end))
        return out

    @staticmethod
    def _events() -> tuple[torch.cuda.Event, torch.cuda.Event]:
        return torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)

    # ------------------------------------------------------------------ logging through replays
    def _recording_log(self, *args: Any, **kwargs: Any) -> None:
        self._log_calls.append(_LogCall(args, kwargs))

    def _reissue_logs(self) -> None:
        """Call the real ``self.log`` for each call recorded at capture, with this replay's values."""
        module = self._module
        real_log = module.log
        for call in self._log_calls:
            args = list(call.args)
            if len(args) > 1 and isinstance(args[1], torch.Tensor):
                args[1] = args[1].detach().clone()
            kwargs = {
                k: (v.detach().clone() if isinstance(v, torch.Tensor) and k == "value" else v)
                for k, v in call.kwargs.items()
            }
            real_log(*args, **kwargs)

    # ------------------------------------------------------------------ capture, verify, replay
    def _prepare_compiled(self, pl_module: LightningModule, batch: Any) -> None:
        """compile=True: install the prefetch points first, then compile the children.

        Dynamo guards on a module's hooks, so hooks added after the first compiled call would force
        a recompile inside the capture, where compiling cannot run. The points are custom ops
        (l2lightning.prefetch_ops) that dynamo traces into the compiled graph; they act only inside
        the capture's scope, checked at run time, so the warm-up steps run the same compiled code.
        """
        self._static = StaticBatch(batch)
        self._install_prefetch(pl_module)
        for child in pl_module.children():
            self._compiled_children.append(child)
            child.forward = _compiled_forward(child)  # type: ignore[method-assign]

    def _install_prefetch(self, pl_module: LightningModule) -> None:
        self._hooks = self._prefetch_hooks(pl_module)
        if self._hooks is not None:
            self._tuning_report = self._hooks.tuning_report
            self.plans = self._hooks.plan_summary()

    def _prefetch_hooks(self, pl_module: LightningModule) -> Any:
        if self.prefetch == "off":
            return None
        reason = prefetch_unavailable_reason()
        if reason:
            rank_zero_warn(f"L2GraphCallback: prefetch off ({reason}); capturing the graph without it.")
            return None
        from l2lightning.hooks import PrefetchHooks

        static_batch = self._static.batch
        original_training_step = self._originals["training_step"]

        def dry_step(module: Any, batch: Any) -> Any:
            saved = module.log
            module.log = lambda *a, **k: None  # the dry run must not log
            try:
                return original_training_step(batch, 0)
            finally:
                module.log = saved

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
        )

    def _capture(self, epoch: int, batch_idx: int, optimizer: Any, closure: Any) -> None:
        module = self._module
        original = self._originals["optimizer_step"]
        torch.cuda.synchronize()
        if self._hooks is None and not self.compile:
            self._install_prefetch(module)
        if self.verify:
            eager_record = self._verify_eager(epoch, batch_idx, optimizer, closure)
        saved = TrainingState.save(module, None)
        try:
            graph = torch.cuda.CUDAGraph()
            self._log_calls = []
            self._step_output = None
            # self.log inside the capture is recorded, not run: Lightning's accumulation ops would
            # otherwise be baked into the graph and repeated on every replay.
            module.log = self._recording_log  # type: ignore[method-assign]
            try:
                self._capture_into(graph, epoch, batch_idx, optimizer, closure, original)
            finally:
                del module.log
        except Exception as exc:  # a host sync or an unsupported op inside training_step
            self._graph = None
            saved.restore(None)
            self._disable(
                f"the step could not be captured ({type(exc).__name__}: {str(exc).splitlines()[0][:200]})"
            )
            self._mode = "eager"
            original(epoch, batch_idx, optimizer, closure)
            return
        self._graph = graph
        self._graph_grads = [(p, p.grad) for p in module.parameters()]
        self._optimizer.mark_captured()
        self.capture_step = self._global_step()
        self._captured = True
        try:
            self._pool_mib = torch.cuda.memory_stats().get("allocated_bytes.all.current", 0) / (1 << 20)
        except Exception:  # memory stats are informational only
            self._pool_mib = None
        # The capture recorded but did not run the step: this replay is the step's real update.
        self._mode = "replay"
        start, end = self._events()
        start.record()
        graph.replay()
        end.record()
        self._reissue_logs_in_training_step_context()
        if self.verify:
            self._finish_verify(eager_record)
        if self.report:
            self._build_step_report()
            rank_zero_info(self._report_text())

    def _capture_into(
        self, graph: Any, epoch: int, batch_idx: int, optimizer: Any, closure: Any, original: Any
    ) -> None:
        with graph_capture(graph):
            self._phase_events.mark("start")
            original(epoch, batch_idx, optimizer, closure)
            self._phase_events.mark("end")
        # training_step ran inside the capture: its output tensors are the graph's static outputs.
        self._static_output = self._step_output

    def _prefetch_scope(self) -> Any:
        return self._hooks.scope() if self._hooks is not None else contextlib.nullcontext()

    def _reissue_logs_in_training_step_context(self) -> None:
        module = self._module
        previous = module._current_fx_name
        module._current_fx_name = "training_step"
        try:
            self._reissue_logs()
        finally:
            module._current_fx_name = previous

    def _replay(self, closure: Any) -> None:
        for param, grad in self._graph_grads:
            if param.grad is not grad:  # an eager fallback step replaced them
                param.grad = grad
        start, end = self._events()
        start.record()
        self._graph.replay()
        end.record()
        self._timing.graph.append((start, end))
        if closure is not None:
            closure()  # replay mode: static outputs, logs re-issued, no backward

    def _global_step(self) -> int:
        trainer = self._module.trainer
        return int(trainer.global_step)

    # ------------------------------------------------------------------ verify
    def _verify_eager(self, epoch: int, batch_idx: int, optimizer: Any, closure: Any) -> Any:
        from l2lightning.verify import StepRecord, gradients, parameters

        module = self._module
        saved = TrainingState.save(module, self._optimizer.optimizer)
        previous_mode = self._mode
        self._mode = "verify-eager"
        module.log = lambda *a, **k: None  # type: ignore[method-assign]  # logged once, by the real step
        try:
            # On a side stream, not the default one: Lightning's closure keeps this step's loss, and
            # with it each parameter's AccumulateGrad node, alive into the capture; a node bound to
            # the default stream makes the captured backward sync with it, which aborts the capture
            # (seen on the H200 when verify=True ran as the first capture of a process). The
            # synchronize below orders everything this step allocated before anyone else uses it.
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                self._originals["optimizer_step"](epoch, batch_idx, optimizer, closure)
            torch.cuda.current_stream().wait_stream(side)
            loss = loss_of(self._step_output, "training_step")
            record = StepRecord(None, loss.detach().clone(), gradients(module), parameters(module))
            # Drop the eager step's outputs: a live autograd graph from before the capture keeps
            # AccumulateGrad nodes bound to the eager stream, which breaks capturing backward.
            self._step_output = None
        finally:
            del module.log
            self._mode = previous_mode
        torch.cuda.synchronize()
        saved.restore(self._optimizer.optimizer)
        module.zero_grad(set_to_none=True)
        return record

    def _finish_verify(self, eager_record: Any) -> None:
        from l2lightning.verify import EquivalenceError, StepRecord, compare_steps, gradients, parameters

        module = self._module
        loss = loss_of(self._static_output, "training_step")
        graph_record = StepRecord(None, loss.detach().clone(), gradients(module), parameters(module))
        report = compare_steps(graph_record, eager_record, "captured step vs eager step")
        self.verify_report = report
        rank_zero_info(f"L2GraphCallback verify: {report}")
        for logger in module.trainer.loggers:
            logger.log_metrics({"l2/verify_ok": float(report.ok)}, step=self._global_step())
        if not report.ok:
            raise EquivalenceError(report)

    # ------------------------------------------------------------------ metrics
    def _restore_lr_floats(self) -> None:
        """Leave float learning rates behind, as the optimizer had them before the fit."""
        for group in self._optimizer.optimizer.param_groups:
            if isinstance(group.get("lr"), torch.Tensor):
                group["lr"] = float(group["lr"])

    @override
    def on_save_checkpoint(
        self, trainer: Trainer, pl_module: LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        if self._optimizer is None or "optimizer_states" not in checkpoint:
            return
        # Save what the optimizer would save without capture (float LR, original capturable flag).
        states = checkpoint["optimizer_states"]
        if states:
            states[0] = self._optimizer.portable_state_dict(states[0])

    @override
    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if self._mode == "fallback":
            self._mode = "replay" if self._graph is not None else "eager"
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
        if len(replays) < TIMED_REPLAYS_BEFORE_LOG or not replays[TIMED_REPLAYS_BEFORE_LOG - 1][1].query():
            return
        self._timing_logged = True
        self._emit_timing(trainer)

    def _log_timing(self, trainer: Trainer) -> None:
        """Epoch end: wait for the device, then log the l2/* metrics over every step timed so far."""
        if not self._logs_timing(trainer):
            return
        torch.cuda.synchronize()
        self._emit_timing(trainer)

    def _timing_metrics(self) -> dict[str, float]:
        """The l2/* metrics, all from one ``summary()``: floats, non-finite or unknown ones left out."""
        summary = self.summary()
        metrics = {
            f"l2/{key}": float(summary[key])
            for key in ("eager_step_ms", "graph_step_ms", "speedup", "graph_pool_mib")
            if summary[key] is not None and math.isfinite(float(summary[key]))
        }
        prefetched = [row for row in self.plans if row.get("forward") or row.get("backward")]
        metrics["l2/prefetch_layers"] = float(len(prefetched))
        metrics["l2/prefetch_mib"] = float(sum(float(row.get("mib") or 0.0) for row in prefetched))
        metrics["l2/fallback_steps"] = float(self.fallback_steps)
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
        device = self._module.trainer.strategy.root_device
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
