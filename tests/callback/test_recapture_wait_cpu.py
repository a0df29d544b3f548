"""CPU (graph emulator): after a change that makes the graph stale, the step is captured again only
once the eager steps since have cost what a capture costs (StepDecision._capture_not_paid_for).

The emulator's step timings are host timings of emulated replays, so the wait runs on CUDA only;
here the callback is told the device is one it waits on, and its measured costs are fixed: a capture
costs 20 ms and a replay saves 4 ms over the eager step, so a capture pays for itself in 5 steps."""

from __future__ import annotations

import math

import pytest

from l2lightning import L2GraphCallback
from l2lightning.callback import fit_report
from l2lightning.callback.step_decision import TOO_LATE_CAUSE, WAIT_CAUSE, last_paying_step
from tests.baselines import (
    baseline_of,
    capturable_from_of_the_last_callback_fit,  # noqa: F401 -- records switch steps
)
from tests.graph.test_manual_optimization_cpu import ManualTwoOptimizers
from tests.lightning_models import TinyMLP
from tests.replay_helpers import assert_same, fit

pytestmark = pytest.mark.usefixtures("emulated_cuda_graphs")

CAPTURE_S = 0.02  # what each capture is said to cost
EAGER_MS, REPLAY_MS = 5.0, 1.0  # so each eager step forgoes 4 ms


class FixedCosts(L2GraphCallback):
    """The callback with the device's measurements fixed (see the module docstring)."""

    _RENTAL_DEVICES = ("cpu",)

    def _last_capture_cost(self):
        # what the decision part asks (not the wall time measured on the CPU, which this test is not about)
        return CAPTURE_S if self.captures else None


def fixed_costs(**kwargs):
    # the weights below are baked in (no device scalars), so that each change makes the graph stale
    kwargs.setdefault("operand_scalars", False)
    return FixedCosts(prefetch="off", log_timing=False, check_share=1.0, **kwargs)


@pytest.fixture
def measured_steps(monkeypatch):
    monkeypatch.setattr(fit_report._Timing, "eager_ms", lambda self: EAGER_MS)
    monkeypatch.setattr(fit_report._Timing, "graph_ms", lambda self: REPLAY_MS)


class EpochWeight(TinyMLP):
    """A loss weight an epoch hook sets: the step is captured again when it changes."""

    weight = 1.0
    every = None  # change the weight every `every` steps instead of every epoch

    def on_train_epoch_start(self):
        if self.every is None:
            self.weight = 1.0 + 0.5 * self.current_epoch

    def on_train_batch_start(self, batch, batch_idx):
        if self.every is not None and self.global_step >= 8 and self.global_step % self.every == 0:
            self.weight = 1.0 + 0.01 * self.global_step

    def training_step(self, batch, batch_idx):
        return super().training_step(batch, batch_idx) * self.weight


class EveryThirdStep(EpochWeight):
    every = 3


EPOCHS = {"steps": -1, "n": 128, "trainer_kwargs": {"max_epochs": 3}}  # 16 steps an epoch


@pytest.mark.usefixtures("measured_steps")
def test_a_change_per_epoch_waits_five_eager_steps_then_captures_and_equals_the_baseline():
    base = fit(baseline_of(EpochWeight), **EPOCHS)
    cb = fixed_costs()
    with pytest.warns(UserWarning, match=r"captured again .* once the eager steps since have cost"):
        run = fit(EpochWeight, [cb], **EPOCHS)
    summary = cb.summary()
    # captured at step 3; the weight changes at steps 16 and 32, each followed by 5 eager steps
    # (4 ms forgone each, 20 ms in all) and a capture at steps 21 and 37
    assert summary["captures"] == 3 and summary["fallback_steps"] == 10, summary
    assert summary["recapture_wait_steps"] == 10 and summary["recaptures"] == 2, summary
    assert_same(base, run)


@pytest.mark.usefixtures("measured_steps")
def test_a_value_changing_faster_than_a_capture_pays_waits_longer_each_time():
    """Changed every 3 steps, no graph lives the 5 replays that pay for its capture: each wait is
    twice the one before (10, 20, ... steps), so captures grow rarer, and the fit stays the baseline."""
    kwargs = {"steps": 60}
    base = fit(baseline_of(EveryThirdStep), **kwargs)
    cb = fixed_costs()
    run = fit(EveryThirdStep, [cb], **kwargs)
    summary = cb.summary()
    # capture at 3; change at 9: the first graph had 5 replays (4..8), paid: wait 5 (9..13), capture
    # at 14; change at 15 after 0 replays: wait 10 (15..24), capture at 25; change at 27 after 1
    # replay: wait 20 (27..46), capture at 47; change at 48: wait 40 (48..59, the fit ends)
    assert summary["captures"] == 4, summary
    assert summary["fallback_steps"] == 5 + 10 + 20 + 12, summary
    assert_same(base, run)


class ChangedNearTheEnd(EpochWeight):
    """The weight changed once, 8 steps before a 48-step fit ends (and not at the epoch start)."""

    def on_train_epoch_start(self):
        pass

    def on_train_batch_start(self, batch, batch_idx):
        if self.global_step == 40:
            self.weight = 2.0


@pytest.mark.usefixtures("measured_steps")
def test_no_capture_again_when_the_steps_left_cannot_pay_for_it():
    """A capture pays after 5 replays here, so in a 48-step fit the last step worth capturing at is 43.
    The change at step 40 waits its 5 steps (40..44); at 45 the wait is over, but 3 replays would not
    pay for the capture: the fit ends eagerly, like plain Lightning, with one warning saying why."""
    base = fit(baseline_of(ChangedNearTheEnd), steps=48)
    cb = fixed_costs()
    with pytest.warns(
        UserWarning, match=r"not capturing the step again: the fit's optimizer steps after step 43"
    ):
        run = fit(ChangedNearTheEnd, [cb], steps=48)
    summary = cb.summary()
    assert summary["captures"] == 1 and summary["recaptures"] == 0, summary
    assert summary["fallback_steps"] == 8 and summary["recapture_wait_steps"] == 8, summary
    assert summary["fallback_causes"] == sorted([WAIT_CAUSE, TOO_LATE_CAUSE]), summary
    assert_same(base, run)


class ManualWeightedLateChange(ManualTwoOptimizers):
    """Two optimizers stepped by hand (two global steps a batch), a loss weight changed at the third
    epoch's start: batch 32 of 48, global_step 64 where Lightning estimates 48 stepping batches."""

    weight = 1.0

    def on_train_epoch_start(self):
        if self.current_epoch == 2:
            self.weight = 2.0

    def training_step(self, batch, batch_idx):
        opt_a, opt_b = self.optimizers()
        loss = TinyMLP.training_step(self, batch, batch_idx) * self.weight
        opt_a.zero_grad()
        opt_b.zero_grad()
        self.manual_backward(loss)
        opt_a.step()
        opt_b.step()


@pytest.mark.usefixtures("measured_steps")
def test_under_manual_optimization_the_fits_end_does_not_bound_the_wait():
    """Lightning's estimate counts batches there (`estimated_stepping_batches`, 48) while global_step
    counts every optimizer step (two a batch): compared, the bound would call the change at batch 32
    too late to pay, with 11 batches left after its wait. Under manual optimization the wait captures
    again as it did before the bound (at batch 37)."""
    base = fit(baseline_of(ManualWeightedLateChange), **EPOCHS)
    cb = fixed_costs()
    run = fit(ManualWeightedLateChange, [cb], **EPOCHS)
    summary = cb.summary()
    assert summary["captures"] == 2 and summary["fallback_steps"] == 5, summary
    assert TOO_LATE_CAUSE not in summary["fallback_causes"], summary
    assert_same(base, run)


class _Stepping:
    def __init__(self, total):
        self.total = total

    @property
    def estimated_stepping_batches(self):
        if isinstance(self.total, Exception):
            raise self.total
        return self.total


@pytest.mark.parametrize(
    ("total", "expected"),
    [
        (48, 43),
        (48.0, 43),
        (100, 95),
        (float("inf"), math.inf),
        (0, math.inf),
        (TypeError("no len"), math.inf),
    ],
)
def test_last_paying_step_reads_the_fits_length_from_lightning(total, expected):
    # a capture of 20 ms that saves 4 ms per step pays after 5 steps
    assert last_paying_step(_Stepping(total), 0.020, 0.004) == expected


def test_a_capture_that_pays_in_a_fraction_of_a_step_needs_one_step():
    assert last_paying_step(_Stepping(10), 0.001, 0.004) == 9


def test_without_device_timings_the_step_is_captured_again_at_once():
    """Off the devices whose timings are measured (the CPU here), a change captures again at the next step."""
    base = fit(baseline_of(EpochWeight), **EPOCHS)
    cb = L2GraphCallback(prefetch="off", log_timing=False, operand_scalars=False)
    run = fit(EpochWeight, [cb], **EPOCHS)
    assert cb.summary()["captures"] == 3 and cb.summary()["fallback_steps"] == 0, cb.summary()
    assert_same(base, run)


@pytest.mark.usefixtures("measured_steps")
def test_recapture_wait_false_captures_again_at_the_next_step():
    base = fit(baseline_of(EpochWeight), **EPOCHS)
    cb = fixed_costs(recapture_wait=False)
    run = fit(EpochWeight, [cb], **EPOCHS)
    assert cb.summary()["captures"] == 3 and cb.summary()["fallback_steps"] == 0, cb.summary()
    assert_same(base, run)


def test_recapture_wait_must_be_a_bool():
    with pytest.raises(TypeError, match=r"`recapture_wait` must be a bool \(True or False\), got 'yes'"):
        L2GraphCallback(recapture_wait="yes")


@pytest.mark.usefixtures("measured_steps")
@pytest.mark.parametrize("verify", ["capture", False])
def test_the_wait_counts_replays_without_the_sampled_check_too(verify):
    """Whether a stale graph paid for its capture is read from its replays, not from the sampled
    check's schedule: without the check the waits are the same as with it."""
    base = fit(baseline_of(EpochWeight), **EPOCHS)
    cb = FixedCosts(prefetch="off", log_timing=False, verify=verify, operand_scalars=False)
    run = fit(EpochWeight, [cb], **EPOCHS)
    summary = cb.summary()
    assert summary["captures"] == 3 and summary["fallback_steps"] == 10, summary
    assert_same(base, run)
