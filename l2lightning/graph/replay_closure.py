"""Lightning's optimizer closure for a replayed step, dispatching only the hooks that do something.

After a replay the callback runs Lightning's closure in replay mode, so that Lightning gets the
step's outputs and every hook of the step is called as in an eager step. Most of what that closure
does is then dispatch: ``on_before_zero_grad``, ``optimizer_zero_grad``, ``backward`` (through the
strategy and the precision plugin), ``on_before_backward``, ``on_after_backward``,
``on_before_optimizer_step`` and ``configure_gradient_clipping``, each through Lightning's
``_call_callback_hooks`` (every callback, a profiler context each) and
``_call_lightning_module_hook``. In replay mode the module's ``optimizer_zero_grad``, ``backward``
and ``configure_gradient_clipping`` are the callback's own and do nothing (the graph did it), and
a callback that does not override a hook runs ``Callback``'s empty method. On a small model that
dispatch is a sizable part of a replayed step's host time (issue 13).

:class:`ReplayClosure` runs the same sequence with the same arguments, through Lightning's own
dispatch, for the hooks that some callback or the module overrides, and skips the rest: the calls
that remain are those that can change anything, in Lightning's order. It applies only where the
closure's path is the stock one this mirrors (Lightning's ``Closure`` wrapped by
``Precision._wrap_closure``; a strategy and precision plugin whose backward adds nothing else: the
single-device strategy, 32-bit, 16/bf16 without a gradient scaler) and no profiler is recording; anywhere else :func:`why_not_fast` says why and the real closure runs. In replay mode
the training step returns the graph's outputs, never None, so the closure's "returned None"
warning has no counterpart here.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from typing import Any

import torch
from lightning.pytorch import Callback, LightningModule
from lightning.pytorch.loops.optimization.automatic import Closure, ClosureResult, _AutomaticOptimization
from lightning.pytorch.plugins.precision import MixedPrecision, Precision
from lightning.pytorch.profilers import PassThroughProfiler
from lightning.pytorch.strategies import SingleDeviceStrategy, Strategy
from lightning.pytorch.trainer import call
from lightning.pytorch.utilities.model_helpers import is_overridden

# The hooks inside Lightning's optimizer closure, in the order it calls them (zero_grad, backward,
# after the closure): a capture runs them once in the graph, a replay re-issues their log calls
CLOSURE_HOOKS = ("on_before_zero_grad", "on_before_backward", "on_after_backward", "on_before_optimizer_step")
# Precision-plugin methods on the closure's path that must be Lightning's base ones
_PRECISION_PATH = (
    "pre_backward",
    "backward",
    "post_backward",
    "_after_closure",
    "_wrap_closure",
    "_clip_gradients",
)


def why_not_fast(trainer: Any) -> str | None:
    """Why this fit's replays must run Lightning's own closure, or None when :class:`ReplayClosure` may
    run it (for each step's closure that :func:`is_stock_closure`)."""
    if not isinstance(getattr(trainer, "profiler", None), PassThroughProfiler):
        return "a profiler records every hook call"
    strategy = getattr(trainer, "strategy", None)
    # DDP's backward path is the same for automatic optimization, but no replay under DDP has run
    # through this closure yet: it keeps Lightning's until one has
    if type(strategy) is not SingleDeviceStrategy or type(strategy).backward is not Strategy.backward:
        return f"strategy {type(strategy).__name__}"
    precision = getattr(strategy, "precision_plugin", None)
    if not _stock_precision(precision):
        return f"precision plugin {type(precision).__name__}"
    return None


def _stock_precision(precision: Any) -> bool:
    if not isinstance(precision, Precision):
        return False
    for name in _PRECISION_PATH:
        own = getattr(type(precision), name)
        if own is getattr(Precision, name):
            continue
        # MixedPrecision scales the loss before backward, and only with a gradient scaler
        if name == "pre_backward" and own is MixedPrecision.pre_backward and precision.scaler is None:
            continue
        return False
    return True


def is_stock_closure(closure: Any) -> bool:
    """Whether `closure` is what automatic optimization passes to ``optimizer.step``: Lightning's
    ``Closure`` wrapped by ``Precision._wrap_closure``."""
    return (
        isinstance(closure, functools.partial)
        and getattr(closure.func, "__func__", None) is Precision._wrap_closure
        and len(closure.args) == 3
        and not closure.keywords
        and isinstance(closure.args[2], Closure)
    )


def lightning_closure(closure: Any) -> Closure | None:
    """Lightning's ``Closure`` inside what the callback's step got: an optimizer step's (wrapped by the
    precision plugin, :func:`is_stock_closure`) or an accumulating micro-batch's (the
    ``l2lightning.graph.accumulation.MicroBatchStep`` holding it); None for any other closure."""
    if is_stock_closure(closure):
        return closure.args[2]
    inner = getattr(closure, "closure", None)  # (a Closure's own `closure` is its method: None below)
    return inner if isinstance(inner, Closure) else None


def zero_grad_progress(trainer: Any) -> Any:
    """Automatic optimization's ``zero_grad`` progress counters (saved in checkpoints under ``loops``)."""
    return trainer.fit_loop.epoch_loop.automatic_optimization.optim_progress.optimizer.zero_grad


@contextlib.contextmanager
def one_closure_count(trainer: Any, closure: Any) -> Iterator[None]:
    """Leave Lightning's ``zero_grad`` progress as one run of `closure` leaves it, however often it ran.

    The capture step runs the step's closure more than once (the verify step, the capture, the
    replay that performs the update); an eager step runs it once, and the counters a checkpoint
    saves must read the same. Only for Lightning's closure, whose ``zero_grad_fn`` is known.
    """
    inner = lightning_closure(closure)
    if trainer is None or inner is None:
        yield
        return
    progress = zero_grad_progress(trainer)
    before = progress.state_dict()
    try:
        yield
    finally:
        progress.load_state_dict(before)
        if inner._zero_grad_fn is not None:
            progress.increment_ready()
            progress.increment_started()
            progress.increment_completed()


class ReplayClosure:
    """Runs a replay's closure, calling the closure's hooks that some callback or the module overrides.

    Which callbacks and module hooks override what is read once per list of callbacks (a callback
    added or removed mid-fit is seen at the next step).
    """

    def __init__(self) -> None:
        self._key: tuple = ()
        self._callback_hooks: frozenset[str] = frozenset()
        self._module_hooks: frozenset[str] = frozenset()
        self.calls = 0  # replays whose closure ran here (tests read it)

    def _refresh(self, trainer: Any, module: LightningModule) -> None:
        key = (id(module), *map(id, trainer.callbacks))
        if key == self._key:
            return
        self._key = key
        self._callback_hooks = frozenset(
            hook
            for hook in CLOSURE_HOOKS
            if any(is_overridden(hook, cb, parent=Callback) for cb in trainer.callbacks)
        )
        self._module_hooks = frozenset(
            hook for hook in CLOSURE_HOOKS if is_overridden(hook, module, parent=LightningModule)
        )

    def __call__(self, trainer: Any, closure: functools.partial) -> Any:
        """What ``closure()`` returns (the step's loss), with its ``ClosureResult`` kept for Lightning."""
        module, optimizer, inner = closure.args
        loss = self._closure(trainer, module, optimizer, inner)
        # Precision._wrap_closure, then its _after_closure
        self._hook(trainer, "on_before_optimizer_step", optimizer)
        # configure_gradient_clipping: the callback's, a no-op in replay mode (the graph clipped)
        return loss

    def micro_batch(self, trainer: Any, module: LightningModule, inner: Closure) -> Any:
        """What an accumulating micro-batch's ``closure()`` returns (Lightning calls it itself, outside
        the precision plugin's wrapper: no ``on_before_optimizer_step``, no clipping)."""
        return self._closure(trainer, module, trainer.optimizers[0], inner)

    def _closure(self, trainer: Any, module: LightningModule, optimizer: Any, inner: Closure) -> Any:
        """Lightning's ``Closure.__call__`` in replay mode: the step's loss, its result kept for Lightning."""
        self._refresh(trainer, module)
        self.calls += 1
        with torch.enable_grad():  # Closure.closure's
            step_output = self._step_output(trainer, inner)
            if inner._zero_grad_fn is not None:
                # _AutomaticOptimization's zero_grad_fn: its progress counters are checkpointed
                # (`loops` in the checkpoint), so they advance as in an eager step
                progress = zero_grad_progress(trainer)
                progress.increment_ready()
                self._hook(trainer, "on_before_zero_grad", optimizer)
                progress.increment_started()
                # optimizer_zero_grad: the callback's, a no-op in replay mode
                progress.increment_completed()
            loss = step_output.closure_loss
            if inner._backward_fn is not None and loss is not None:
                self._hook(trainer, "on_before_backward", loss)
                # module.backward: the callback's, a no-op in replay mode
                self._hook(trainer, "on_after_backward")
        inner._result = step_output
        return step_output.loss

    def _step_output(self, trainer: Any, inner: Closure) -> ClosureResult:
        """Lightning's ``_AutomaticOptimization._training_step``, without the loss's division by the
        accumulation factor where that factor is 1 and nothing sees the divided loss.

        ``closure_loss / 1`` equals ``closure_loss`` bit for bit; on a GPU it is a kernel launch per
        step (host time Lightning's bare loop does not spend). The divided tensor reaches only
        ``on_before_backward`` (no callback or module overrides it here) and the module's
        ``backward``, which in replay mode is the callback's and does nothing; ``ClosureResult``
        clones the loss as in an eager step, so what Lightning keeps is a fresh tensor either way.
        Anywhere else (another loop's step function, a result class of its own) Lightning's runs.
        """
        step_fn = inner._step_fn
        loop = getattr(getattr(step_fn, "func", None), "__self__", None)
        if (
            "on_before_backward" in self._callback_hooks
            or "on_before_backward" in self._module_hooks
            or trainer.accumulate_grad_batches != 1
            or not isinstance(step_fn, functools.partial)
            or getattr(step_fn.func, "__func__", None) is not _AutomaticOptimization._training_step
            or type(loop).output_result_cls is not ClosureResult
            or len(step_fn.args) != 1
            or step_fn.keywords
        ):
            return step_fn()
        output = call._call_strategy_hook(trainer, "training_step", *step_fn.args[0].values())
        trainer.strategy.post_training_step()  # called by Lightning "for backward compatibility"
        if isinstance(output, torch.Tensor):
            return ClosureResult(output)
        if isinstance(output, dict) and isinstance(output.get("loss"), torch.Tensor):
            return ClosureResult(output["loss"], extra={k: v for k, v in output.items() if k != "loss"})
        # anything else (a Mapping of another type): Lightning's own conversion, division included
        return ClosureResult.from_training_step_output(output, trainer.accumulate_grad_batches)

    def _hook(self, trainer: Any, hook: str, *args: Any) -> None:
        if hook in self._callback_hooks:
            call._call_callback_hooks(trainer, hook, *args)
        if hook in self._module_hooks:
            call._call_lightning_module_hook(trainer, hook, *args)
