"""``l2lightning.CapturableFrom``: the eager reference a user's CI compares a captured fit with."""

from __future__ import annotations

import pytest

from l2lightning import CapturableFrom
from tests.baselines import capturable_from_of_the_last_callback_fit  # noqa: F401 -- records switch steps
from tests.lightning_models import TinyMLP
from tests.replay_helpers import assert_same, callback, fit


@pytest.mark.parametrize("step", [-1, True, 2.0, "3", None])
def test_a_step_that_is_not_a_global_step_is_rejected_naming_the_argument(step):
    with pytest.raises(ValueError, match=r"`step` must be an int >= 0 \(a global step\)"):
        CapturableFrom(step)


@pytest.mark.usefixtures("emulated_cuda_graphs")
def test_a_plain_fit_switched_at_the_capture_step_is_the_captured_fits_reference():
    graph = callback()
    run = fit(TinyMLP, [graph], steps=30)  # foreach AdamW: its capturable arithmetic differs
    step = graph.summary()["capturable_from_step"]
    assert step == graph.summary()["capture_step"] == 3
    reference = fit(TinyMLP, [CapturableFrom(step)], steps=30)
    assert_same(reference, run)
    plain = fit(TinyMLP, steps=30)
    with pytest.raises(AssertionError, match="differs"):  # plain AdamW differs after the capture step
        assert_same(plain, run)
