"""GPU: the sampled replay check (``verify="sampled"``, the default) on the H200.

A stale replay the per-replay checks are made to miss is caught at its first checked replay, the
eager result stands and the step is captured again, so the fit equals its baseline; a fit whose
replays are right checks them and stays bitwise its baseline (BatchNorm statistics, a metric,
dropout's random numbers, logs).
"""

from __future__ import annotations

import pytest
import torch

from l2lightning import L2GraphCallback
from l2lightning.guards import python_state
from tests.baselines import capturable_from_of_the_last_callback_fit  # noqa: F401 -- records switch steps
from tests.between_step_models import MovesTheScaleEachEpoch, ScalesByAPlainTensor
from tests.gpu.test_callback_gpu import assert_same_run, fit
from tests.guards.test_replay_check_cpu import NormalizedMetricDropout

pytestmark = pytest.mark.gpu


def test_a_stale_replay_the_checks_before_it_miss_is_caught_redone_and_captured_again(monkeypatch):
    from l2lightning.guards.step_source import StepSource

    # the two per-replay checks that see the scale's memory move (its address, its value), off
    monkeypatch.setattr(python_state, "addresses", lambda checks: ())
    monkeypatch.setattr(StepSource, "changed_attribute_values", lambda self, *args: [])
    cb = L2GraphCallback(prefetch="off", log_timing=False, recapture_wait=False)  # captures counted
    with pytest.warns(UserWarning, match=r"a sampled replay check \(the first replay after an epoch start"):
        run = fit(ScalesByAPlainTensor, [MovesTheScaleEachEpoch(), cb], steps=60)
    base = fit(ScalesByAPlainTensor, [MovesTheScaleEachEpoch()], steps=60, baseline=True)
    summary = cb.summary()
    assert summary["captures"] == 2 and summary["replay_check"]["mismatches"] == 1, summary
    assert summary["replay_check"]["first_mismatch"].startswith("the loss"), summary
    assert_same_run(base, run)


def test_checked_replays_leave_no_trace_and_the_fit_is_its_baseline():
    cb = L2GraphCallback(prefetch="off", log_timing=False, check_share=1.0)  # every scheduled check
    run = fit(NormalizedMetricDropout, [cb], steps=70)
    base = list(fit(NormalizedMetricDropout, [], steps=70, baseline=True))
    report = cb.summary()["replay_check"]
    assert cb.summary()["captured"] and report["checks"] >= 7 and report["mismatches"] == 0, report
    assert report["off_reason"] is None, report
    assert_same_run(base, run)
    for name in ("net.1.running_mean", "net.1.running_var", "net.1.num_batches_tracked"):
        assert torch.equal(run[0].get_buffer(name), base[0].get_buffer(name)), name
    assert torch.equal(run[0].train_mae.sum_abs_error, base[0].train_mae.sum_abs_error)
