"""The code a step runs beyond its module's own methods, read for what a replay would freeze.

Found by the second held-out idiom hunt, each silently wrong before (a replay kept the capture's value or
branch):

* lambdas reading attributes of objects (``lambda m, i, o: o + state.std * o``, a criterion lambda over
  ``args.smoothing``, a module-level ``aux = lambda p: CFG.weight * ...``): read from their bytecode only,
  the names but not the attributes, where a ``def`` with the same body was compared;
* ``batch_idx`` handed to a submodule, a function kept in an attribute or another module's method
  (``self.criterion(pred, y, batch_idx)``, ``self.model.training_step(batch, batch_idx)``): exempt from
  the comparisons as if the module's own method read it, but never read with it; and handed to the
  module's own methods where the reader did not follow it (deeper than ``HELPER_DEPTH``, a static method);
* a layer's test or number on the step counters that cannot be evaluated before a replay
  (``self._lm().global_step`` through a weakref to the module): dropped, where training_step's own are
  refused or compared.

And a base class's method called explicitly, ``Base.training_step(self, batch, batch_idx)`` (the
pre-``super()`` spelling): not read, so its batch_idx was compared as a number and every step captured
again until the fit went eager; now read as ``super().training_step(batch, batch_idx)`` is.
"""

from __future__ import annotations

import functools
import weakref
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from l2lightning.guards.called_code import analyse_called_code
from l2lightning.guards.step_source import HELPER_DEPTH, StepSource, analyse
from tests.baselines import (  # noqa: F401 -- the fixture records each callback fit's switch step
    baseline_of,
    capturable_from_of_the_last_callback_fit,
)
from tests.lightning_models import TinyMLP
from tests.replay_helpers import assert_refused_like_plain, assert_same, callback, fit

SWITCH_STEP = 13  # the global step at which a batch-start hook changes what the step reads


def _mse(pred, y):
    return (pred - y).square().mean()


def _analysed(module):
    """What the callback reads of `module` at setup and at the training start."""
    found = analyse(module)
    analyse_called_code(module, found)
    return found


# --------------------------------------------------------------------------- lambdas reading attributes
class NoiseState:
    def __init__(self):
        self.std = 0.0


LOSS_CFG = SimpleNamespace(weight=0.0)
aux_loss = lambda pred: LOSS_CFG.weight * pred.abs().mean()  # noqa: E731 - the idiom under test


class _SwitchesAtStep13(TinyMLP):
    def on_fit_start(self):
        LOSS_CFG.weight = 0.0

    def switch(self):
        raise NotImplementedError

    def on_train_batch_start(self, batch, batch_idx):
        if self.global_step == SWITCH_STEP:
            self.switch()


class LambdaHook(_SwitchesAtStep13):
    """A forward hook, a lambda over an object whose attribute the batch-start hook changes."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self.noise = NoiseState()
        state = self.noise
        self.net[0].register_forward_hook(lambda m, i, o: o + state.std * o.square())

    def switch(self):
        self.noise.std = 0.5


class DefHook(LambdaHook):
    """The control: the same hook written as a def closure (compared before the fix too)."""

    def __init__(self, **kw):
        TinyMLP.__init__(self, **kw)
        self.noise = NoiseState()
        state = self.noise

        def hook(m, i, o):
            return o + state.std * o.square()

        self.net[0].register_forward_hook(hook)


class LambdaCriterion(_SwitchesAtStep13):
    """A criterion kept in an attribute, a lambda over a namespace of arguments."""

    def __init__(self, **kw):
        super().__init__(**kw)
        args = SimpleNamespace(smoothing=0.0)
        self.args = args
        self.criterion = lambda pred, y: _mse(pred, y) + args.smoothing * pred.abs().mean()

    def switch(self):
        self.args.smoothing = 0.3

    def training_step(self, batch, batch_idx):
        x, y = batch
        return self.criterion(self.head(self.net(x)).squeeze(-1), y)


class ModuleLevelLambda(_SwitchesAtStep13):
    """A module-level lambda the step calls by name, reading a module-level config's attribute."""

    def switch(self):
        LOSS_CFG.weight = 0.5

    def training_step(self, batch, batch_idx):
        x, y = batch
        pred = self.head(self.net(x)).squeeze(-1)
        return _mse(pred, y) + aux_loss(pred)


LAMBDAS = [LambdaHook, LambdaCriterion, ModuleLevelLambda]


@pytest.mark.parametrize("cls", LAMBDAS, ids=lambda c: c.__name__)
def test_an_attribute_a_lambda_reads_of_an_object_is_compared_before_each_replay(cls):
    module = cls()
    found = _analysed(module)
    snapshot = found.attribute_snapshot(module, 0)
    assert found.changed_attribute_values(snapshot, module, 1) == []
    module.on_fit_start()
    module.switch()
    changed = found.changed_attribute_values(snapshot, module, 1)
    assert changed, "the lambda's read of the object's attribute is not compared"
    LOSS_CFG.weight = 0.0


class TwoLambdasOnALine(nn.Module):
    """Two lambdas of the same parameters on one line: no source tells them apart, the bytecode does."""

    def __init__(self, cfg):
        super().__init__()
        self.scale_a, self.scale_b = (lambda p: p * cfg.a), (lambda p: p * cfg.b)

    def forward(self, x):
        return self.scale_b(self.scale_a(x))


def test_the_attributes_a_lambda_whose_source_cannot_be_told_apart_reads_are_read_from_its_bytecode():
    cfg = SimpleNamespace(a=1.0, b=2.0)
    holder = nn.Module()
    holder.layer = TwoLambdasOnALine(cfg)
    found = StepSource()
    analyse_called_code(holder, found)
    snapshot = found.attribute_snapshot(holder, 0)
    assert found.changed_attribute_values(snapshot, holder, 1) == []
    cfg.b = 3.0
    assert len(found.changed_attribute_values(snapshot, holder, 1)) == 1


@pytest.mark.usefixtures("emulated_cuda_graphs")
@pytest.mark.parametrize("cls", LAMBDAS, ids=lambda c: c.__name__)
def test_a_lambda_reading_an_attribute_changed_at_step_13_captures_again_and_trains_like_the_baseline(cls):
    """Silently wrong before: one capture, and from step 13 every replay kept the capture's number. The
    control, the same read in a def closure, was compared before and still is."""
    for model in (cls, DefHook):
        base = fit(baseline_of(model), steps=30)
        cb = callback()
        with pytest.warns(
            UserWarning, match=r"capturing the step again: .*(values|numbers) the step reads changed"
        ):
            run = fit(model, [cb], steps=30)
        s = cb.summary()
        assert s["captured"] and s["captures"] == 2 and s["fallback_steps"] == 0, (model, s)
        assert_same(base, run)


# --------------------------------------------------------------------------- batch_idx handed on
class PeriodicAux(nn.Module):
    """A loss module that adds a term on every tenth batch, by the batch_idx it is handed."""

    def forward(self, pred, y, batch_idx):
        loss = _mse(pred, y)
        if batch_idx % 10 == 9:
            loss = loss + 0.5 * pred.abs().mean()
        return loss


class IgnoresBatchIdx(nn.Module):
    """The control: handed batch_idx, never reads it."""

    def forward(self, pred, y, batch_idx):
        return _mse(pred, y)


def periodic_aux(pred, y, step):
    loss = _mse(pred, y)
    if step % 10 == 9:
        loss = loss + 0.5 * pred.abs().mean()
    return loss


class PeriodicByItsHelper(nn.Module):
    """batch_idx handed on again inside the loss module: to its own method, and to a layer of it."""

    def __init__(self):
        super().__init__()
        self.inner = PeriodicAux()

    def forward(self, pred, y, batch_idx):
        return self._weighted(pred, batch_idx) + self.inner(pred, y, batch_idx)

    def _weighted(self, pred, i):
        return pred.abs().mean() * (0.5 if i % 10 == 4 else 0.0)


class HandsBatchIdxOn(TinyMLP):
    """``self.<what>(pred, y, batch_idx)``: a submodule, a function kept in an attribute, by position or
    by keyword."""

    def __init__(self, held: str = "submodule", **kw):
        super().__init__(**kw)
        self.held = held
        if held in ("submodule", "keyword"):
            self.criterion = PeriodicAux()
        elif held == "function":
            self.criterion = periodic_aux
        elif held == "nested":
            self.criterion = PeriodicByItsHelper()
        elif held == "control":
            self.criterion = IgnoresBatchIdx()

    def training_step(self, batch, batch_idx):
        x, y = batch
        return self.criterion(self.head(self.net(x)).squeeze(-1), y, batch_idx)


class HandsBatchIdxOnByKeyword(HandsBatchIdxOn):
    def training_step(self, batch, batch_idx):
        x, y = batch
        return self.criterion(self.head(self.net(x)).squeeze(-1), y, batch_idx=batch_idx)


HANDED = ["submodule", "function", "keyword", "nested"]


@pytest.mark.parametrize("held", HANDED)
def test_the_code_handed_batch_idx_is_read_with_it_and_its_tests_join_the_branch_key(held):
    module = (HandsBatchIdxOnByKeyword if held == "keyword" else HandsBatchIdxOn)(held=held)
    found = _analysed(module)
    assert found.opaque_conditions == []
    keys = {found.branch_key(module, i) for i in range(10)}
    assert found.branch_key(module, 9) != found.branch_key(module, 8), "the callee's test is not in the key"
    assert len(keys) == (3 if held == "nested" else 2)  # (the helper's own test: batch 4)
    # handed on to code read with it: not compared as a number (which would capture every step again)
    assert not any("self.criterion" in c.line for c in found.counter_values)
    control = HandsBatchIdxOn(held="control")
    found = _analysed(control)
    assert [c for c in found.conditions if c.on_counters] == [] and found.counter_values == []


class HandsBatchIdxToWhatCannotBeRead(TinyMLP):
    """batch_idx handed where the parameter it arrives in cannot be told, or the code is not read: the
    argument is compared before each replay."""

    def __init__(self, how: str = "partial", **kw):
        super().__init__(**kw)
        self.how = how
        if how == "partial":
            self.criterion = functools.partial(periodic_aux)
        elif how == "star":
            self.criterion = lambda pred, y, *rest: periodic_aux(pred, y, *rest)  # noqa: E731

    def training_step(self, batch, batch_idx):
        x, y = batch
        pred = self.head(self.net(x)).squeeze(-1)
        if self.how == "deep":
            return self.h1(pred, y, batch_idx)
        if self.how == "static":
            return self.static_loss(pred, y, batch_idx)
        return self.criterion(pred, y, batch_idx)

    # deeper than HELPER_DEPTH: h3 is read, but not the method it hands batch_idx to
    def h1(self, pred, y, i):
        return self.h2(pred, y, i)

    def h2(self, pred, y, i):
        return self.h3(pred, y, i)

    def h3(self, pred, y, i):
        return self.h4(pred, y, i)

    def h4(self, pred, y, i):
        return periodic_aux(pred, y, i)

    @staticmethod
    def static_loss(pred, y, i):
        loss = _mse(pred, y)
        if i % 10 == 9:
            loss = loss + 0.5 * pred.abs().mean()
        return loss


@pytest.mark.parametrize("how", ["partial", "star", "deep", "static"])
def test_batch_idx_handed_where_it_cannot_be_followed_is_compared_or_read(how):
    assert HELPER_DEPTH == 3  # (h1..h4 above)
    module = HandsBatchIdxToWhatCannotBeRead(how=how)
    found = _analysed(module)
    if how == "static":  # a static method: read with batch_idx in its own parameter
        assert found.branch_key(module, 9) != found.branch_key(module, 8)
        return
    captured = found.counter_snapshot(module, 3)
    assert found.changed_counter_values(captured, module, 4), (
        "batch_idx handed on is neither read nor compared"
    )


@pytest.mark.usefixtures("emulated_cuda_graphs")
@pytest.mark.parametrize("held", ["submodule", "function"])
def test_a_callee_branching_on_the_batch_idx_it_is_handed_runs_its_other_branch_eagerly(held):
    """Silently wrong before: one capture, and steps 9, 19, 29 replayed the capture's branch. The control
    (a submodule handed batch_idx that never reads it) stays one capture, no step eager."""
    base = fit(baseline_of(HandsBatchIdxOn), steps=30, held=held)
    cb = callback()
    run = fit(HandsBatchIdxOn, [cb], steps=30, held=held)
    s = cb.summary()
    assert s["captured"] and s["captures"] == 1 and s["fallback_steps"] == 3, s
    assert_same(base, run)
    base = fit(baseline_of(HandsBatchIdxOn), steps=30, held="control")
    cb = callback()
    run = fit(HandsBatchIdxOn, [cb], steps=30, held="control")
    s = cb.summary()
    assert s["captured"] and s["captures"] == 1 and s["fallback_steps"] == 0, s
    assert_same(base, run)


def warm_periodic(model, pred, y, i):
    """Given the module and batch_idx: a test on both."""
    loss = _mse(pred, y)
    if i % 10 == 9 and model.global_step >= model.warm:
        loss = loss + 0.5 * pred.abs().mean()
    return loss


class HandsModuleAndBatchIdxOn(TinyMLP):
    def __init__(self, **kw):
        super().__init__(**kw)
        self.warm = 5
        self.loss_fn = warm_periodic

    def training_step(self, batch, batch_idx):
        x, y = batch
        return self.loss_fn(self, self.head(self.net(x)).squeeze(-1), y, batch_idx)


def test_a_held_function_given_the_module_and_batch_idx_tests_both_per_step():
    """Before, read as the module's code without batch_idx: its test on both could not be evaluated."""
    module = HandsModuleAndBatchIdxOn()
    found = _analysed(module)
    assert found.opaque_conditions == [] and found.counter_values == []
    assert "warm" in found.reads
    module.warm = 0  # (global_step is 0 without a Trainer)
    assert found.branch_key(module, 9) != found.branch_key(module, 8)
    module.warm = 1
    assert found.branch_key(module, 9) == found.branch_key(module, 8)


class Inner(TinyMLP):
    def training_step(self, batch, batch_idx):
        x, y = batch
        return _mse(self.head(self.net(x)).squeeze(-1), y)


class Wrapper(TinyMLP):
    """A module delegating its step to another's: ``self.model.training_step(batch, batch_idx)``."""

    def __init__(self, width=32, depth=3, **kw):
        super().__init__(width=width, depth=1, **kw)
        self.model = Inner(width=width, depth=depth)

    def training_step(self, batch, batch_idx):
        return self.model.training_step(batch, batch_idx)


@pytest.mark.usefixtures("emulated_cuda_graphs")
def test_a_wrapper_handing_batch_idx_to_an_inner_step_that_never_reads_it_is_captured_once():
    """Captured three times and then trained eagerly before, for 'numbers the step computes from the
    step counters changed' at the call: the inner step is read with batch_idx now, and never reads it."""
    found = _analysed(Wrapper())
    assert found.counter_values == [] and found.conditions == []
    base = fit(baseline_of(Wrapper), steps=30)
    cb = callback()
    run = fit(Wrapper, [cb], steps=30)
    s = cb.summary()
    assert s["captured"] and s["captures"] == 1 and s["fallback_steps"] == 0, s
    assert_same(base, run)


# --------------------------------------------------------------------------- a layer's counter reads
class StepAware(nn.Module):
    """A layer that reads the module's step counter through a weakref to it (no check can evaluate
    that before a replay), and, the control, a test of its own that does not read the counters."""

    def __init__(self, width):
        super().__init__()
        self.fc = nn.Linear(width, width)
        self._lm = None

    def gate(self):
        return 1

    def forward(self, x):
        if self.gate() > 0:  # a test through a call, on no step counter: left to the trace comparison
            x = x * 1.0
        if self._lm is not None and self._lm().global_step >= 10:
            return x + self.fc(x)
        return x


class StepRamp(StepAware):
    """The same read for a number: 0.0 through the warm-up and the capture, growing from step 11."""

    def forward(self, x):
        w = max(0.0, (self._lm().global_step - 10) * 0.1)
        return x + w * self.fc(x)


class HoldsAStepAwareLayer(TinyMLP):
    def __init__(self, ramp=False, **kw):
        super().__init__(**kw)
        self.mid = (StepRamp if ramp else StepAware)(self.head.in_features)
        self.mid._lm = weakref.ref(self)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return _mse(self.head(self.mid(self.net(x))).squeeze(-1), y)


def test_a_layers_test_on_the_step_counters_that_cannot_be_evaluated_is_named_and_its_numbers_compared():
    module = HoldsAStepAwareLayer()
    found = _analysed(module)
    assert len(found.opaque_conditions) == 1  # not the gate's test, which reads no counter
    (line,) = found.opaque_conditions
    assert "self._lm().global_step >= 10" in line and "StepAware.forward" in line
    ramp = HoldsAStepAwareLayer(ramp=True)
    found = _analysed(ramp)
    captured = found.counter_snapshot(ramp, 3)
    assert found.opaque_conditions == []
    assert any("self._lm().global_step - 10" in c for c in found.changed_counter_values(captured, ramp, 4))


@pytest.mark.usefixtures("emulated_cuda_graphs")
def test_a_layers_unevaluable_test_on_the_step_counters_is_refused_like_training_steps():
    """Silently wrong before: captured at step 3, replayed without the layer's branch from step 10."""
    assert_refused_like_plain(
        HoldsAStepAwareLayer,
        r"branches on the step counters in a way the callback cannot evaluate, at .*StepAware\.forward",
        steps=20,
    )


@pytest.mark.usefixtures("emulated_cuda_graphs")
def test_a_layers_number_from_the_step_counters_that_cannot_be_evaluated_is_never_replayed_stale():
    """Silently wrong before: the ramp's 0.0 of the capture step replayed from step 11 on."""
    base = fit(baseline_of(HoldsAStepAwareLayer), steps=20, ramp=True)
    cb = callback()
    with pytest.warns(UserWarning, match=r"cannot be evaluated before a replay"):
        run = fit(HoldsAStepAwareLayer, [cb], steps=20, ramp=True)
    assert_same(base, run)
    assert torch.is_tensor(run[1].losses[-1])


# --------------------------------------------------------------------------- Base.method(self, ...) calls
class BranchesEveryTenSteps(TinyMLP):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.aux_w = 0.0

    def training_step(self, batch, batch_idx):
        x, y = batch
        pred = self.head(self.net(x)).squeeze(-1)
        loss = _mse(pred, y)
        if batch_idx % 10 == 9:
            loss = loss * 2.0
        return loss + self.aux_w * pred.square().mean()


class CallsItsParentExplicitly(BranchesEveryTenSteps):
    def on_train_batch_start(self, batch, batch_idx):
        if self.global_step == SWITCH_STEP:
            self.aux_w = 0.5

    def training_step(self, batch, batch_idx):
        return BranchesEveryTenSteps.training_step(self, batch, batch_idx) * 0.5


def test_a_base_class_method_called_explicitly_is_read_as_a_super_call():
    found = analyse(CallsItsParentExplicitly())
    assert [c.line.split("(`")[1] for c in found.conditions] == ["if batch_idx % 10 == 9:`)"]
    assert all(c.evaluate is not None for c in found.conditions)
    assert found.counter_values == []  # batch_idx handed to Base's method is read there, not compared
    assert "aux_w" in found.reads


@pytest.mark.usefixtures("emulated_cuda_graphs")
def test_a_base_class_method_called_explicitly_is_captured_and_trains_like_the_baseline():
    base = fit(baseline_of(CallsItsParentExplicitly), steps=60)
    cb = callback(operand_scalars=False)  # the weight baked in: its change is seen through the base's code
    with pytest.warns(
        UserWarning, match=r"capturing the step again: Python numbers the step reads changed \(aux_w\)"
    ):
        run = fit(CallsItsParentExplicitly, [cb], steps=60)
    summary = cb.summary()
    assert summary["captured"] and summary["captures"] == 2, summary
    assert_same(base, run)
