"""The replay's closure (l2lightning.graph.replay_closure) on the CPU through the graph emulator: the same
hooks, in the same order, with the same arguments and the same values as Lightning's own closure,
while hooks nobody overrides are not dispatched; and where it does not apply, why."""

from __future__ import annotations

import functools

import pytest
import torch
from lightning.pytorch import Callback
from lightning.pytorch.loops.optimization.automatic import Closure, ClosureResult
from lightning.pytorch.plugins.precision import MixedPrecision, Precision
from lightning.pytorch.profilers import PassThroughProfiler, SimpleProfiler
from lightning.pytorch.trainer import call

from l2lightning import L2GraphCallback
from l2lightning.graph import replay_closure
from l2lightning.graph.replay_closure import CLOSURE_HOOKS, is_stock_closure, why_not_fast
from l2lightning.guards.log_replay import ReissuedLog
from tests.baselines import (
    baseline_of,
    capturable_from_of_the_last_callback_fit,  # noqa: F401 -- records switch steps
)
from tests.lightning_models import TinyMLP
from tests.replay_helpers import assert_same, callback, fit

# every test here runs on the CPU graph emulator (tests/conftest.py)
pytestmark = pytest.mark.usefixtures("emulated_cuda_graphs")


class LoggingHooks(Callback):
    """Every closure hook logs a value of its own, from what it was given or from the gradients."""

    def on_before_zero_grad(self, trainer, pl_module, optimizer):
        pl_module.log("cb_zero_grad", pl_module.head.weight.sum())

    def on_before_backward(self, trainer, pl_module, loss):
        pl_module.log("cb_loss_x3", loss.detach() * 3)

    def on_after_backward(self, trainer, pl_module):
        pl_module.log("cb_after_backward", pl_module.head.weight.grad.abs().sum())

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        pl_module.log("cb_before_step", pl_module.head.weight.grad.sum() * 2)


class HookedModule(TinyMLP):
    """Module hooks inside the closure: one updates a buffer in place, one logs."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self.register_buffer("zero_grad_calls", torch.zeros(()))

    def on_before_zero_grad(self, optimizer):
        with torch.no_grad():
            self.zero_grad_calls.add_(1)

    def on_before_backward(self, loss):
        self.log("module_loss_seen", loss.detach() * 2)


def fit_counting(monkeypatch, model_cls, callbacks, steps):
    """A fit, with the replays' closures that ReplayClosure ran and the log re-issues per hook."""
    ran, shortcuts = [], {}
    real_call = replay_closure.ReplayClosure.__call__
    real_shortcut = ReissuedLog._shortcut

    def counted_call(self, trainer, closure):
        ran.append(trainer.global_step)
        return real_call(self, trainer, closure)

    def counted_shortcut(self, *args):
        shortcuts[self.fx] = shortcuts.get(self.fx, 0) + 1
        return real_shortcut(self, *args)

    with monkeypatch.context() as m:
        m.setattr(replay_closure.ReplayClosure, "__call__", counted_call)
        m.setattr(ReissuedLog, "_shortcut", counted_shortcut)
        run = fit(model_cls, callbacks, steps=steps)
    return run, ran, shortcuts


def test_replays_call_the_closure_hooks_as_lightnings_closure_does(monkeypatch):
    cb_fast = callback(verify=False)  # every step after the capture a replay (no checked step)
    fast, ran, fast_shortcuts = fit_counting(monkeypatch, HookedModule, [cb_fast, LoggingHooks()], 20)
    s = cb_fast.summary()
    assert s["captured"] and s["fallback_steps"] == 0 and len(ran) == 20 - s["capture_step"] - 1, (s, ran)
    assert cb_fast._dispatch.replay_closure.calls == len(ran)
    with monkeypatch.context() as m:
        m.setattr("l2lightning.callback.step_dispatch.is_stock_closure", lambda closure: False)
        cb_real = callback(verify=False)
        real, ran_real, real_shortcuts = fit_counting(m, HookedModule, [cb_real, LoggingHooks()], 20)
    assert cb_real.summary()["captured"] and ran_real == []
    # the same values logged from every hook, step by step, and the same training
    names = {"cb_zero_grad", "cb_loss_x3", "cb_after_backward", "cb_before_step", "module_loss_seen"}
    assert names <= set(fast[1].logged[-1])
    assert_same(fast, real)
    assert float(fast[0].zero_grad_calls) == float(real[0].zero_grad_calls) == 20
    # every hook's logs took the same re-issue path: the hook ran with its own name current
    hooks = {"on_before_zero_grad", "on_before_backward", "on_after_backward", "on_before_optimizer_step"}
    assert hooks <= set(fast_shortcuts) and fast_shortcuts == real_shortcuts
    # and as an eager fit does
    assert_same(fit(baseline_of(HookedModule), [LoggingHooks()], steps=20), fast)


def test_module_hooks_are_called_in_replays_without_any_callback_hook(monkeypatch):
    # (a callback's hook of the same name would re-issue the module's logs too: none here)
    cb = callback()
    run, ran, shortcuts = fit_counting(monkeypatch, HookedModule, [cb], 16)
    assert cb.summary()["captured"] and ran and shortcuts.get("on_before_backward") == len(ran)
    assert float(run[0].zero_grad_calls) == 16
    assert_same(fit(baseline_of(HookedModule), steps=16), run)


def test_hooks_nobody_overrides_are_not_dispatched_in_replays(monkeypatch):
    dispatched = []
    real_dispatch = call._call_callback_hooks

    def counting(trainer, hook, *args, **kwargs):
        if hook in CLOSURE_HOOKS and trainer.global_step >= 5:  # replays only
            dispatched.append(hook)
        return real_dispatch(trainer, hook, *args, **kwargs)

    monkeypatch.setattr(call, "_call_callback_hooks", counting)

    class AfterBackwardOnly(Callback):
        def on_after_backward(self, trainer, pl_module):
            pass

    cb = callback(verify=False)  # steps from 5 on all replays
    fit(TinyMLP, [cb], steps=12)
    assert cb.summary()["captured"] and dispatched == []
    cb = callback(verify=False)  # steps from 5 on all replays
    fit(TinyMLP, [cb, AfterBackwardOnly()], steps=12)
    assert dispatched and set(dispatched) == {"on_after_backward"}


def test_a_profiler_keeps_lightnings_closure_and_its_records():
    cb = callback()
    profiler = SimpleProfiler()
    run = fit(TinyMLP, [cb], steps=12, trainer_kwargs={"profiler": profiler})
    assert cb.summary()["captured"] and cb._dispatch.replay_closure is None
    assert any("on_after_backward" in k for k in profiler.recorded_durations)
    assert_same(fit(baseline_of(TinyMLP), steps=12), run)


class _Trainer:
    def __init__(self, strategy, profiler=None):
        self.strategy = strategy
        self.profiler = profiler or PassThroughProfiler()


class _Strategy:
    pass


def test_why_not_fast_names_what_it_does_not_mirror():
    from lightning.pytorch.strategies import SingleDeviceStrategy

    stock = SingleDeviceStrategy(device=torch.device("cpu"), precision_plugin=Precision())
    assert why_not_fast(_Trainer(stock)) is None
    assert why_not_fast(_Trainer(stock, SimpleProfiler())) == "a profiler records every hook call"
    assert why_not_fast(_Trainer(_Strategy())) == "strategy _Strategy"
    from lightning.pytorch.strategies import DDPStrategy

    assert why_not_fast(_Trainer(DDPStrategy(precision_plugin=Precision()))) == "strategy DDPStrategy"
    bf16 = SingleDeviceStrategy(
        device=torch.device("cpu"), precision_plugin=MixedPrecision("bf16-mixed", "cpu")
    )
    assert why_not_fast(_Trainer(bf16)) is None

    class Scaling(Precision):
        def backward(self, tensor, model, optimizer, *args, **kwargs):
            super().backward(tensor * 2, model, optimizer, *args, **kwargs)

    scaled = SingleDeviceStrategy(device=torch.device("cpu"), precision_plugin=Scaling())
    assert why_not_fast(_Trainer(scaled)) == "precision plugin Scaling"
    fp16 = MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu"))
    with_scaler = SingleDeviceStrategy(device=torch.device("cpu"), precision_plugin=fp16)
    assert why_not_fast(_Trainer(with_scaler)) == "precision plugin MixedPrecision"


def test_only_lightnings_wrapped_closure_is_stock():
    precision = Precision()
    inner = Closure(step_fn=lambda: None)
    assert is_stock_closure(functools.partial(precision._wrap_closure, "model", "optimizer", inner))
    assert not is_stock_closure(
        functools.partial(precision._wrap_closure, "model", "optimizer", lambda: None)
    )
    assert not is_stock_closure(inner)
    assert not is_stock_closure(lambda: None)


def test_the_callback_decides_per_fit(monkeypatch):
    monkeypatch.setattr("l2lightning.callback.graph_callback.why_not_fast", lambda trainer: "forced")
    cb = L2GraphCallback(prefetch="off", log_timing=False)
    fit(TinyMLP, [cb], steps=8)
    assert cb.summary()["captured"] and cb._dispatch.replay_closure is None


class KeepsOutputs(Callback):
    """What Lightning hands `on_train_batch_end`: the step's loss, kept across steps."""

    def __init__(self):
        self.losses = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.losses.append(outputs["loss"])


def _converted_at(monkeypatch, callbacks, steps):
    """A fit with the steps (global_step) at which Lightning's ``from_training_step_output`` ran, and the
    replays' steps."""
    converted = []
    real = ClosureResult.from_training_step_output.__func__

    def counted(cls, output, normalize=1):
        converted.append(callbacks[0]._fit.trainer.global_step)
        return real(cls, output, normalize)

    with monkeypatch.context() as m:
        m.setattr(ClosureResult, "from_training_step_output", classmethod(counted))
        run, ran, _ = fit_counting(m, TinyMLP, callbacks, steps)
    return run, converted, ran


def test_replays_skip_lightnings_division_by_one_and_keep_fresh_losses(monkeypatch):
    cb, kept = callback(verify=False), KeepsOutputs()
    run, converted, ran = _converted_at(monkeypatch, [cb, kept], 16)
    assert cb.summary()["captured"] and len(ran) >= 10
    assert converted and not set(ran) & set(converted)  # the eager steps only
    base_kept = KeepsOutputs()
    assert_same(fit(baseline_of(TinyMLP), [base_kept], steps=16), run)
    # each step's loss is a tensor of its own, equal to the eager fit's, kept unchanged by later replays
    assert len({t.data_ptr() for t in kept.losses}) == len(kept.losses) == 16
    assert all(torch.equal(a, b) for a, b in zip(kept.losses, base_kept.losses))


def test_replays_divide_as_lightning_does_where_on_before_backward_sees_the_loss(monkeypatch):
    cb = callback(verify=False)
    run, converted, ran = _converted_at(monkeypatch, [cb, LoggingHooks()], 16)
    assert cb.summary()["captured"] and ran and set(ran) <= set(converted)
    assert_same(fit(baseline_of(TinyMLP), [LoggingHooks()], steps=16), run)
