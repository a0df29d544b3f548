"""GPU: changes a hook makes mid-epoch, where no sampled replay check runs, on the H200.

The modules of ``tests/guards/test_replay_guards_mid_epoch_cpu.py`` (each changes what its step depends on
at global step 14, between the sampled checks at steps 11 and 19), fit with real CUDA graphs: the
rebound code trains eagerly from there, the changed values are captured again, the advanced iterator
is refused, and each fit is bit for bit its baseline (plain Lightning for the refusal).
"""

from __future__ import annotations

import pytest

from l2lightning import L2GraphCallback
from tests.baselines import capturable_from_of_the_last_callback_fit  # noqa: F401 -- records switch steps
from tests.gpu.test_callback_gpu import assert_same_run, fit
from tests.guards import test_replay_guards_mid_epoch_cpu as guards

pytestmark = pytest.mark.gpu


def callback():
    return L2GraphCallback(prefetch="off", log_timing=False, recapture_wait=False)  # captures counted


@pytest.mark.parametrize(
    "cls", [guards.HelperReboundOnInstance, guards.HelperPatchedOnClass, guards.TrainingStepRebound]
)
def test_code_rebound_mid_epoch_runs_eagerly_from_there(cls):
    cb = callback()
    with pytest.warns(UserWarning, match=r"the code the step runs was rebound since the training start"):
        run = fit(cls, [cb], steps=guards.STEPS, n=guards.N)
    base = fit(cls, [], steps=guards.STEPS, n=guards.N, baseline=True)
    summary = cb.summary()
    assert summary["captured"] and summary["captures"] == 1, summary
    assert_same_run(base, run)
    if cls is guards.HelperPatchedOnClass:
        cls.compute_loss = guards.HelperReboundOnInstance.compute_loss


@pytest.mark.parametrize(
    "cls",
    [
        guards.EnumBranch,
        guards.EnumInALayer,
        guards.TeacherInAList,
        guards.TeacherInAListSlot,
        guards.TeacherInADict,
        guards.TeacherParameterRebound,
        guards.AttributeAppears,
        guards.LogKeyFromAnAttribute,
        guards.FrozenConfigReplaced,
        guards.RegistryObjectAnnealed,
        guards.FunctionAttributeKnob,
        guards.EnvironmentWeight,
    ],
)
def test_a_value_changed_mid_epoch_is_captured_again(cls, monkeypatch):
    monkeypatch.setenv("L2L_TEST_AUX_W", "0.0")
    cb = callback()
    with pytest.warns(UserWarning, match=r"capturing the step again"):
        run = fit(cls, [cb], steps=guards.STEPS, n=guards.N)
    base = fit(cls, [], steps=guards.STEPS, n=guards.N, baseline=True)
    summary = cb.summary()
    assert summary["captured"] and summary["captures"] == 2 and summary["replay_check"]["mismatches"] == 0, (
        summary
    )
    assert_same_run(base, run)


def test_a_step_advancing_an_iterator_it_holds_is_refused_like_plain():
    cb = callback()
    with pytest.warns(UserWarning, match=r"the step advances an iterator held outside it"):
        run = fit(guards.CountsWithAnIterator, [cb], steps=guards.STEPS, n=guards.N)
    plain = fit(guards.CountsWithAnIterator, [], steps=guards.STEPS, n=guards.N)
    assert not cb.summary()["captured"], cb.summary()
    assert_same_run(plain, run)
