"""GPU: Python numbers read from device scalars by the graph's ops (l2lightning.graph.operand_scalars), on
CUDA graphs: a number annealed per epoch or computed from the epoch is captured once and every fit is
bit for bit its baseline (float32: PyTorch's CUDA kernels compute ``tensor * number`` and ``tensor *
0-dim tensor`` alike); numbers that reach the step another way are captured again."""

from __future__ import annotations

import pytest

from l2lightning import L2GraphCallback
from tests.baselines import capturable_from_of_the_last_callback_fit  # noqa: F401 -- records switch steps
from tests.gpu.test_callback_gpu import assert_same_run, fit
from tests.operand_models import (
    OPERAND_BAKED,
    OPERAND_SERVED,
    AnnealedWithAHostRead,
    CosineLossWeight,
    KLRamp,
)

pytestmark = pytest.mark.gpu

STEPS = 60  # 30 batches an epoch: two values of each number


def callback():
    return L2GraphCallback(prefetch="off", log_timing=False, recapture_wait=False)  # captures counted


@pytest.mark.parametrize("cls", OPERAND_SERVED, ids=lambda c: c.__name__)
def test_a_number_read_only_as_an_operand_is_captured_once_and_bitwise(cls):
    cb = callback()
    run = fit(cls, [cb], steps=STEPS)
    base = fit(cls, [], steps=STEPS, baseline=True)
    s = cb.summary()
    assert s["captured"] and s["captures"] == 1 and s["operand_scalars"]["changes"] == 1, s
    assert (
        s["replay_check"]["reasons"].get("operand value changed") == 1
        and s["replay_check"]["mismatches"] == 0
    )
    assert_same_run(base, run)


@pytest.mark.parametrize("cls", OPERAND_BAKED, ids=lambda c: c.__name__)
def test_a_number_that_reaches_the_step_another_way_is_captured_again(cls):
    cb = callback()
    with pytest.warns(UserWarning, match="capturing the step again"):
        run = fit(cls, [cb], steps=STEPS)
    base = fit(cls, [], steps=STEPS, baseline=True)
    s = cb.summary()
    assert s["captures"] == 2 and s["operand_scalars"]["changes"] == 0, s
    assert_same_run(base, run)


@pytest.mark.parametrize("cls", [KLRamp, CosineLossWeight], ids=lambda c: c.__name__)
def test_a_number_moving_at_every_step_is_captured_once_and_bitwise(cls):
    """Its warm-up steps ran the device scalars too (bitwise plain work), so their traces agree."""
    cb = callback()
    run = fit(cls, [cb], steps=STEPS)
    base = fit(cls, [], steps=STEPS, baseline=True)
    s = cb.summary()
    assert (
        s["captured"] and s["captures"] == 1 and s["operand_scalars"]["changes"] == 40 - s["capture_step"]
    ), s
    assert s["replay_check"]["mismatches"] == 0
    assert_same_run(base, run)


def test_without_device_scalars_a_number_moving_at_every_step_is_refused_like_plain():
    cb = L2GraphCallback(prefetch="off", log_timing=False, operand_scalars=False)
    with pytest.warns(UserWarning, match="computes a number from the step counters that changed"):
        run = fit(KLRamp, [cb], steps=STEPS)
    plain = fit(KLRamp, [], steps=STEPS)
    assert not cb.summary()["captured"]
    assert_same_run(plain, run)


def test_a_refused_step_whose_warm_up_read_device_scalars_trains_like_plain():
    cb = callback()
    with pytest.warns(UserWarning, match="reading a tensor's value on the host"):
        run = fit(AnnealedWithAHostRead, [cb], steps=STEPS)
    plain = fit(AnnealedWithAHostRead, [], steps=STEPS)
    assert not cb.summary()["captured"]
    assert_same_run(plain, run)


def test_numbers_read_through_the_trainers_objects_as_operands_need_one_capture():
    """A weight on another callback, and a config value read through a local: each epoch's value
    written to the device scalar, bitwise the baseline."""
    from tests.between_step_models import (
        CONFIG_CHANGES,
        ReadsACallback,
        SetsTheConfigEachEpoch,
        WeightOnACallback,
    )
    from tests.gpu.test_callback_gpu import assert_captured_like_baseline

    assert_captured_like_baseline(ReadsACallback, 1, callbacks=lambda: [WeightOnACallback()], steps=90)
    cls, change = CONFIG_CHANGES["callback-through-a-local"]
    assert_captured_like_baseline(cls, 1, callbacks=lambda: [SetsTheConfigEachEpoch(change)], steps=90)
