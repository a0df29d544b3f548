"""``precision="16-mixed"``: Lightning's GradScaler step inside the captured step, with a fused optimizer.

Under a gradient scaler Lightning's ``MixedPrecision.optimizer_step`` does not hand the closure to
``optimizer.step``: it calls the closure itself (training step, backward of the scaled loss), then
``scaler.step(optimizer)``, which calls ``optimizer.step()`` without a closure, then
``scaler.update()``. A graph around ``optimizer.step`` would hold only the update. So for such a fit
:class:`ScaledStep` replaces the plugin's ``optimizer_step`` (an instance attribute, removed when the
fit ends) with one that hands the callback the whole of it: the closure Lightning's base ``Precision``
would pass to the optimizer (``Precision._wrap_closure``: the closure, then ``on_before_optimizer_step``
and gradient clipping), and, as the eager step, that closure followed by ``scaler.step`` and
``scaler.update``. Inside it the optimizer's own wrapper passes straight through (:func:`run_through`).

Only fused optimizers (Adam, AdamW, SGD with ``fused=True``; torch marks them
``_step_supports_amp_scaling``). For any other ``GradScaler.step`` unscales the gradients, then reads
the inf check back to the host (``_maybe_opt_step``: ``found_inf.item()``) to decide whether to step:
a host sync that no graph can hold. A fused optimizer gets the scale and the inf flag as device
tensors (``optimizer.grad_scale``, ``optimizer.found_inf``); its kernel unscales and, where the flag
is set, leaves parameters and moments alone and takes its step counters back; ``scaler.update()`` moves
the scale with ``torch._amp_update_scale_`` on the device (backoff after an overflow, growth after
``growth_interval`` clean steps). Nothing reads back, so a replay skips an overflowing step and backs
the scale off exactly as the eager step does. For such an optimizer Lightning's method is exactly
closure, ``_after_closure``, ``scaler.step``, ``scaler.update`` (it unscales beforehand only for the
others), which is what :meth:`ScaledStep.step` runs.

What a replay must keep right, though no Python runs in it:

* the scaler's Python state: ``scaler.step`` records its inf flags in ``_per_optimizer_states`` and
  ``scaler.update`` drops them again, so between steps that state is empty whether the step ran
  eagerly or was replayed;
* its device state: the scale and the growth tracker are written in place by the graph, the same
  tensors from the first step on (``load_state_dict`` fills them), so they are among what the
  sampled replay check saves and compares (:meth:`ScaledStep.written`), and checkpoints read them
  as they are;
* the numbers ``scaler.update`` passes to its kernel (growth and backoff factors, growth interval)
  are baked into the graph, and the graph writes the scale tensors it was captured with:
  :meth:`ScaledStep.baked_changes` names what changed since the capture, to capture again.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from lightning.pytorch.plugins.precision import MixedPrecision

from l2lightning.graph.attributes import ABSENT, put_back

# precision flags that mean a GradScaler (Lightning maps "16" to "16-mixed")
SCALED_PRECISIONS = ("16-mixed", "16")
# the fused optimizers torch ships (their `fused=True` takes the scale and the inf flag on the device)
FUSED_OPTIMIZERS = ("Adam", "AdamW", "SGD")


def grad_scaler_of(plugin: Any) -> torch.amp.GradScaler | None:
    """The gradient scaler of Lightning's precision `plugin`, or None (bf16, 32-bit: the plugin's
    ``optimizer_step`` then hands the closure to the optimizer). A disabled scaler still makes
    ``MixedPrecision`` run the closure itself; its ``step`` is then the optimizer's plain one."""
    return getattr(plugin, "scaler", None)


def scaled_step_refusal(plugin: Any) -> str | None:
    """Why a fit under `plugin` (the Trainer's precision plugin) cannot be captured for its gradient
    scaler, or None (no scaler, or Lightning's own ``MixedPrecision`` step around one)."""
    precision = str(getattr(plugin, "precision", ""))
    scaler = grad_scaler_of(plugin)
    name = type(plugin).__name__
    if scaler is None:
        if precision in SCALED_PRECISIONS and not isinstance(plugin, MixedPrecision):
            return (
                f"precision={precision!r} through the precision plugin {name}, whose gradient scaling the "
                "capture does not know; Lightning's MixedPrecision plugin is captured"
            )
        return None
    if (
        not isinstance(plugin, MixedPrecision)
        or type(plugin).optimizer_step is not MixedPrecision.optimizer_step
    ):
        return (
            f"the precision plugin {name} steps its gradient scaler in an `optimizer_step` of its own, which "
            "the capture does not know; Lightning's MixedPrecision plugin is captured"
        )
    if "optimizer_step" in vars(plugin):
        return (
            f"the precision plugin's `optimizer_step` is replaced on its instance ({name}.optimizer_step), so "
            "the capture cannot wrap Lightning's"
        )
    if not isinstance(scaler, torch.amp.GradScaler) or type(scaler).step is not torch.amp.GradScaler.step:
        return (
            f"the gradient scaler is a {type(scaler).__name__}, whose `step` the capture does not know; "
            "torch.amp.GradScaler is captured"
        )
    return None


def unfused_refusal(optimizer: torch.optim.Optimizer, precision: str, scaler: Any = None) -> str | None:
    """Why `optimizer`'s step under the GradScaler `scaler` cannot be captured (it is not fused), or None
    (fused, or a disabled `scaler`, whose ``step`` is the optimizer's own)."""
    if getattr(optimizer, "_step_supports_amp_scaling", False):
        return None
    if scaler is not None and not scaler.is_enabled():
        return None
    name = type(optimizer).__name__
    if "fused" in optimizer.defaults and name in FUSED_OPTIMIZERS:
        advice = f"pass `fused=True` to {name} (`torch.optim.{name}(..., fused=True)`)"
    else:
        advice = f"{name} has no fused step on CUDA; use Adam, AdamW or SGD with `fused=True`"
    return (
        f"precision={precision!r} with {name} without `fused=True`: its GradScaler step reads the inf check "
        "back on the host (`found_inf.item()`) to decide whether to step, which a CUDA graph cannot hold. "
        f"To capture the step, {advice}: a fused step takes the scale and the inf flag on the device"
    )


def run_through(run: Callable[..., Any], closure: Any, kwargs: dict) -> Any:
    """The optimizer wrapper's handler under a :class:`ScaledStep`: its eager step, as it is (the
    callback handles the whole step one level up, at the precision plugin)."""
    return run(closure, **kwargs)


class ScaledStep:
    """The precision plugin's ``optimizer_step`` for a fit the callback handles under a GradScaler.

    Args:
        plugin: Lightning's ``MixedPrecision`` plugin of the Trainer (:func:`scaled_step_refusal` is None).
        optimizer: the torch optimizer the callback handles (fused: :func:`unfused_refusal` is None).
        handler: called as ``handler(step, closure, kwargs)`` for each of that optimizer's steps:
            ``closure`` is Lightning's closure with the plugin's ``_after_closure``, ``step(closure,
            **kwargs)`` the eager step (the callback's ``StepDispatch.step``).
        active: whether the callback still handles the steps; when not, Lightning's method runs as is.
        undone: whether the step about to run is undone afterwards (the eager step of
            ``verify="capture"``, after which the callback puts back the model and the optimizer, not
            the scaler): its scale update is then undone here.
    """

    def __init__(
        self,
        plugin: MixedPrecision,
        optimizer: torch.optim.Optimizer,
        handler: Callable[[Callable[..., Any], Any, dict], Any],
        active: Callable[[], bool],
        undone: Callable[[], bool],
    ) -> None:
        self.plugin = plugin
        self.scaler = plugin.scaler
        self.optimizer = optimizer
        self.handler = handler
        self.active = active
        self.undone = undone
        self._original: Callable[..., Any] | None = None
        self._before: Any = ABSENT
        self._baked: tuple | None = None

    def install(self) -> None:
        """Replace the plugin's ``optimizer_step`` on its instance (the class's stays Lightning's)."""
        if self._original is not None:
            return
        self._before = vars(self.plugin).get("optimizer_step", ABSENT)
        self._original = self.plugin.optimizer_step
        self.plugin.optimizer_step = self._optimizer_step  # type: ignore[method-assign]

    def uninstall(self) -> None:
        if self._original is None:
            return
        if vars(self.plugin).get("optimizer_step") == self._optimizer_step:  # not replaced again since
            put_back(self.plugin, "optimizer_step", self._before)
        self._original = None

    def _optimizer_step(self, optimizer: Any, model: Any, closure: Callable[[], Any], **kwargs: Any) -> Any:
        if optimizer is not self.optimizer or not self.active():
            return self._original(optimizer, model=model, closure=closure, **kwargs)
        # the closure base Precision.optimizer_step hands to the optimizer (replay_closure.is_stock_closure):
        # the replay calls it for Lightning's outputs and the hooks' logs, the progress counters know it
        precision_closure = functools.partial(self.plugin._wrap_closure, model, optimizer, closure)
        return self.handler(self._eager(model), precision_closure, kwargs)

    def _eager(self, model: Any) -> Callable[..., Any]:
        def step(closure: Callable[[], Any], **kwargs: Any) -> Any:
            return self.step(model, closure, **kwargs)

        return step

    def step(self, model: Any, closure: Callable[[], Any], **kwargs: Any) -> Any:
        """``MixedPrecision.optimizer_step`` for a fused optimizer, `closure` running ``_after_closure``
        already: the closure, then (unless backward was skipped) ``scaler.step`` and ``scaler.update``."""
        scaler = self.scaler
        kept = [(t, t.detach().clone()) for t, _ in self.written()] if self.undone() else []
        try:
            result = closure()
            # Lightning's `skip_unscaling`: training_step returned None, no backward, no step, no update
            if result is None and model.automatic_optimization:
                return result
            out = scaler.step(self.optimizer, **kwargs)
            scaler.update()
            return out
        except BaseException:
            self._forget_partial_step()
            raise
        finally:
            with torch.no_grad():
                for live, saved in kept:
                    live.copy_(saved)

    def _forget_partial_step(self) -> None:
        """A step that raised inside ``scaler.step`` (a capture that failed) leaves the scaler's stage
        "stepped" and the scale on the optimizer, which the next step would refuse or multiply by:
        both go, as ``scaler.update`` and ``scaler.step`` would have dropped them."""
        self.scaler._per_optimizer_states.pop(id(self.optimizer), None)
        for name in ("grad_scale", "found_inf"):
            if name in vars(self.optimizer):
                delattr(self.optimizer, name)

    # ------------------------------------------------------------------ what the graph holds of the scaler
    def written(self) -> list[tuple[torch.Tensor, str]]:
        """The scaler's tensors the step writes in place, each with where: ``(tensor, where)`` (none
        for a disabled scaler, which has none)."""
        scaler = self.scaler
        pairs = [
            (getattr(scaler, "_scale", None), "the GradScaler's scale"),
            (getattr(scaler, "_growth_tracker", None), "the GradScaler's growth tracker"),
        ]
        return [(t, where) for t, where in pairs if isinstance(t, torch.Tensor)]

    def _baked_values(self) -> tuple:
        s = self.scaler
        if not s.is_enabled():
            return ()
        return (s._growth_factor, s._backoff_factor, s._growth_interval, s._scale, s._growth_tracker)

    def mark_captured(self) -> None:
        """Remember what a capture bakes into its graph of the scaler."""
        self._baked = self._baked_values()

    def baked_changes(self) -> list[str]:
        """What the graph holds of the scaler that changed since :meth:`mark_captured`: its numbers
        (``set_growth_factor``, ...) or its scale tensors replaced by other objects."""
        if self._baked is None:
            return []
        names = ("growth factor", "backoff factor", "growth interval")
        now = self._baked_values()
        changes = [f"{n} {a!r} -> {b!r}" for n, a, b in zip(names, self._baked, now) if a != b]
        if any(a is not b for a, b in zip(self._baked[3:], now[3:])):
            changes.append("scale tensors (replaced by other objects)")
        return changes
