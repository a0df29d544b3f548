"""Python numbers that reach the step's ops as tensor operands, read from device scalars written before
each replay (l2lightning.graph.operand_scalars), on the CPU graph emulator: captured once, bitwise the
baseline, each new value's first replay checked; other uses keep the re-capture."""

from __future__ import annotations

import math

import pytest
import torch

from l2lightning.graph import operand_scalars
from tests.baselines import (  # noqa: F401 -- the fixture records each callback fit's switch step
    baseline_of,
    capturable_from_of_the_last_callback_fit,
)
from tests.lightning_models import TinyMLP, regression_loader
from tests.operand_models import (
    OPERAND_BAKED,
    OPERAND_SERVED,
    AnnealedAttribute,
    AnnealedEveryOperator,
    AnnealedWithAHostRead,
    CosineLossWeight,
    KLRamp,
)
from tests.replay_helpers import assert_same, callback, fit

pytestmark = pytest.mark.usefixtures("emulated_cuda_graphs")

STEPS = 60  # 30 batches an epoch (240 samples, batch 8): two changes of the number


@pytest.mark.parametrize("cls", OPERAND_SERVED, ids=lambda c: c.__name__)
def test_a_number_read_only_as_an_operand_is_captured_once_and_bitwise_the_baseline(cls):
    base = fit(baseline_of(cls), steps=STEPS)
    cb = callback()
    run = fit(cls, [cb], steps=STEPS)
    s = cb.summary()
    assert s["captured"] and s["captures"] == 1 and s["fallback_steps"] == 0, s
    assert s["operand_scalars"]["sites"] and s["operand_scalars"]["changes"] == 1, s["operand_scalars"]
    # the first replay with the new value was checked against the eager step, and matched
    assert s["replay_check"]["reasons"].get("operand value changed") == 1, s["replay_check"]
    assert s["replay_check"]["mismatches"] == 0
    assert_same(base, run)


@pytest.mark.parametrize("cls", OPERAND_BAKED, ids=lambda c: c.__name__)
def test_a_number_that_reaches_the_step_another_way_too_is_captured_again(cls):
    base = fit(baseline_of(cls), steps=STEPS)
    cb = callback()
    with pytest.warns(UserWarning, match="capturing the step again"):
        run = fit(cls, [cb], steps=STEPS)
    s = cb.summary()
    assert s["captures"] == 2 and s["operand_scalars"]["changes"] == 0, s
    assert_same(base, run)


@pytest.mark.parametrize("cls", [KLRamp, CosineLossWeight], ids=["linear-ramp", "math-cos"])
def test_a_number_moving_at_every_step_is_captured_once_and_its_first_changes_checked(cls):
    base = fit(baseline_of(cls), steps=STEPS)
    cb = callback()
    run = fit(cls, [cb], steps=STEPS)
    s = cb.summary()
    assert s["captured"] and s["captures"] == 1 and s["fallback_steps"] == 0, s
    # the ramp moves up to step 40: every replay after the capture step up to there wrote a new value
    assert s["operand_scalars"]["changes"] == 40 - s["capture_step"], s["operand_scalars"]
    assert s["replay_check"]["reasons"].get("operand value changed") == 3, s["replay_check"]
    assert_same(base, run)


def test_a_math_name_that_is_not_the_math_module_is_baked(monkeypatch):
    import tests.operand_models as models

    class Stand:  # `math` rebound in the module to something else: its cos is not known to be pure
        pi = math.pi
        cos = staticmethod(math.cos)

    monkeypatch.setattr(models, "math", Stand)
    cb = callback()
    with pytest.warns(UserWarning, match="computes a number from the step counters"):
        fit(CosineLossWeight, [cb], steps=20)
    assert not cb.summary()["captured"]


def test_without_device_scalars_a_number_moving_at_every_step_is_refused_like_plain():
    plain = fit(KLRamp, steps=STEPS)
    cb = callback(operand_scalars=False)
    with pytest.warns(UserWarning, match="computes a number from the step counters that changed"):
        run = fit(KLRamp, [cb], steps=STEPS)
    assert not cb.summary()["captured"]
    assert_same(plain, run)


def test_a_refused_step_whose_warm_up_read_device_scalars_trains_like_plain():
    plain = fit(AnnealedWithAHostRead, steps=STEPS)
    cb = callback()
    with pytest.warns(UserWarning, match="reading a tensor's value on the host"):
        run = fit(AnnealedWithAHostRead, [cb], steps=STEPS)
    assert not cb.summary()["captured"]
    assert_same(plain, run)


def test_switched_off_the_number_is_baked_and_captured_again():
    base = fit(baseline_of(AnnealedAttribute), steps=STEPS)
    cb = callback(operand_scalars=False)
    run = fit(AnnealedAttribute, [cb], steps=STEPS)
    assert cb.summary()["captures"] == 2 and not cb.summary()["operand_scalars"]["sites"]
    assert_same(base, run)


@pytest.mark.parametrize("verify", ["capture", False])
def test_without_the_sampled_check_the_number_is_baked_and_captured_again(verify):
    """No check to judge the first replays with new values: the number is compared, as before."""
    base = fit(baseline_of(AnnealedEveryOperator), steps=STEPS)
    cb = callback(verify=verify)
    run = fit(AnnealedEveryOperator, [cb], steps=STEPS)
    s = cb.summary()
    assert s["captures"] == 2 and not s["operand_scalars"]["sites"], s
    assert_same(base, run)


def test_a_value_not_written_is_caught_by_the_check_and_captured_again_baked(monkeypatch):
    # a stand-in for a use of the number no analysis foresaw: the device scalar keeps the old value
    base = fit(baseline_of(AnnealedAttribute), steps=STEPS)
    cb = callback()
    real_update = operand_scalars.OperandScalars.update

    def stale_update(self, module, batch_idx):
        before = {k: s.value for k, s in self.sites.items()}
        changed = real_update(self, module, batch_idx)
        if changed:
            for key, value in before.items():  # the tensors go back to the old value
                for t in self.sites[key].tensors.values():
                    t.fill_(value)
        return changed

    monkeypatch.setattr(operand_scalars.OperandScalars, "update", stale_update)
    with pytest.warns(UserWarning, match="captured again with the Python numbers it reads baked in"):
        run = fit(AnnealedAttribute, [cb], steps=STEPS)
    s = cb.summary()
    assert s["replay_check"]["mismatches"] == 1 and s["captures"] == 2, s
    assert not s["operand_scalars"]["sites"]  # the second capture baked the number in
    assert_same(base, run)


def test_a_bfloat16_operand_is_baked_where_a_device_scalar_would_round_differently():
    loader = regression_loader(n=240, width=32, dtype=torch.bfloat16)
    base = fit(baseline_of(AnnealedAttribute), steps=STEPS, loader=loader, dtype=torch.bfloat16)
    cb = callback()
    run = fit(AnnealedAttribute, [cb], steps=STEPS, loader=loader, dtype=torch.bfloat16)
    s = cb.summary()
    assert s["captures"] == 2 and not s["operand_scalars"]["sites"], s
    assert_same(base, run)


def test_a_plain_module_has_no_operand_sites():
    cb = callback()
    fit(TinyMLP, [cb], steps=10)
    assert cb.summary()["operand_scalars"] == {"sites": [], "changes": 0}
