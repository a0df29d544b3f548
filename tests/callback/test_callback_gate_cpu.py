"""The whole-step gate inside L2GraphCallback, on the CPU through the graph emulator.

The prefetch hooks are a stand-in (the real ones need CUDA and CuPy): it counts the captures that
enter its scope, and the replay times the gate reads are synthetic, per variant. What is checked is
the callback's side: the second capture runs without the prefetch scope, the two graphs take turns,
training stays bit-identical to the eager baseline whichever graph replays, the loser is dropped,
and a rejected prefetch is removed for the rest of the fit.
"""

from __future__ import annotations

import contextlib
import itertools

import pytest

from l2lightning import L2GraphCallback
from l2lightning.callback import step_gate
from l2lightning.callback.prefetch_setup import PrefetchSetup
from l2lightning.callback.step_dispatch import StepDispatch
from l2lightning.callback.step_gate import VARIANTS
from tests.baselines import (
    baseline_of,
    capturable_from_of_the_last_callback_fit,  # noqa: F401 -- records switch steps
)
from tests.lightning_models import TinyMLP
from tests.replay_helpers import assert_same, fit


class StandInHooks:
    """What the callback uses of PrefetchHooks, with counters instead of kernels."""

    via = "hooks"
    tuning_report = None

    def __init__(self, fit_state):
        self.fit_state = fit_state  # the callback's FitState, which the prefetch part reads
        self.scoped_captures = 0
        self.removed = False
        self.removed_at: int | None = None  # the global step of remove() (teardown removes them too)

    @property
    def enabled(self):
        return not self.removed

    @contextlib.contextmanager
    def scope(self):
        if self.fit_state.mode == "capture":
            self.scoped_captures += 1
        yield

    def plan_summary(self):
        return [{"layer": "net.0.1", "mib": 0.004, "forward": "b4", "backward": None}]

    def remove(self):
        self.removed = True
        self.removed_at = int(self.fit_state.trainer.global_step)


# every test here runs on the CPU graph emulator (tests/conftest.py)
pytestmark = pytest.mark.usefixtures("emulated_cuda_graphs")


def gated(monkeypatch, prefetch_ms, off_ms, **kwargs):
    """A callback with stand-in hooks whose gate reads `prefetch_ms`/`off_ms` (plus a little noise)."""
    cb = L2GraphCallback(prefetch="auto", log_timing=False, **kwargs)
    made = []

    def hooks(self, module):
        made.append(StandInHooks(self._fit))
        return made[-1]

    monkeypatch.setattr(PrefetchSetup, "_prefetch_hooks", hooks)
    decide = step_gate.StepGate.decide
    noise = itertools.cycle([0.0, 0.004, -0.003, 0.002])

    def synthetic(self, elapsed_ms=None):
        variant_of = {id(end): v for v in VARIANTS for _, end in self.events[v]}
        base = {"prefetch": prefetch_ms, "off": off_ms}
        return decide(self, lambda start, end: base[variant_of[id(end)]] + next(noise))

    monkeypatch.setattr(step_gate.StepGate, "decide", synthetic)
    return cb, made


def test_a_faster_prefetched_step_keeps_its_plans_and_trains_like_the_baseline(monkeypatch):
    base = fit(baseline_of(TinyMLP), steps=40)
    cb, hooks = gated(monkeypatch, prefetch_ms=0.9, off_ms=1.0, gate_pairs=8)
    run = fit(TinyMLP, [cb], steps=40)
    s = cb.summary()
    assert s["captured"] and s["captures"] == 2 and s["capture_step"] == 3 and s["fallback_steps"] == 0, s
    gate = s["prefetch_gate"]
    assert gate["kept"] == "prefetch" and gate["pairs"] == 8 and gate["gain"] > 0.05, gate
    assert len(hooks) == 1 and hooks[0].scoped_captures == 1  # the gate's capture ran without the scope
    assert (
        hooks[0].removed_at == 40 and s["plans"] and cb._slots.state.graph is None
    )  # only teardown removed them
    assert_same(base, run)


def test_a_slower_prefetched_step_is_dropped_for_the_rest_of_the_fit(monkeypatch):
    base = fit(baseline_of(TinyMLP), steps=40)
    cb, hooks = gated(monkeypatch, prefetch_ms=1.05, off_ms=1.0, gate_pairs=8)
    seen = []
    original = StepDispatch._replay_step

    def replay(self, closure):
        seen.append(self._slots.state.graph)
        return original(self, closure)

    monkeypatch.setattr(StepDispatch, "_replay_step", replay)
    run = fit(TinyMLP, [cb], steps=40)
    s = cb.summary()
    assert s["prefetch_gate"]["kept"] == "off" and "not above" in s["prefetch_gate"]["reason"], s
    assert hooks[0].removed_at < 40 and s["plans"] == []
    # two graphs in turn during the trial, then only the one without prefetch
    trial, after = seen[: 2 * 8], seen[2 * 8 :]
    assert len({id(g) for g in trial}) == 2 and len({id(g) for g in after}) == 1
    assert after[0] is not seen[0]  # the first replay after the capture was the prefetched graph's
    assert_same(base, run)


class EpochWeightedLoss(TinyMLP):
    """A Python loss weight an epoch hook changes: the step is captured again at each epoch."""

    weight = 1.0

    def on_train_epoch_start(self):
        self.weight = 1.0 + 0.5 * self.current_epoch

    def training_step(self, batch, batch_idx):
        return super().training_step(batch, batch_idx) * self.weight


def test_a_capture_during_the_trial_ends_it_without_prefetch(monkeypatch):
    kwargs = {
        "steps": -1,
        "n": 64,
        "trainer_kwargs": {"max_epochs": 3},
    }  # 8 steps an epoch, a new loss weight per epoch
    base = fit(baseline_of(EpochWeightedLoss), **kwargs)
    cb, hooks = gated(monkeypatch, prefetch_ms=0.5, off_ms=1.0, gate_pairs=8, operand_scalars=False)
    run = fit(EpochWeightedLoss, [cb], **kwargs)
    s = cb.summary()
    assert s["prefetch_gate"]["kept"] == "off" and "captured again" in s["prefetch_gate"]["reason"], s
    assert s["prefetch_gate"]["method"] == "second capture"  # the emulator's graphs cannot be switched
    assert hooks[0].removed_at < 24 and hooks[0].scoped_captures == 1
    assert_same(base, run)


def test_gate_pairs_zero_keeps_the_tuned_plans_without_a_trial(monkeypatch):
    cb, hooks = gated(monkeypatch, prefetch_ms=2.0, off_ms=1.0, gate_pairs=0)
    fit(TinyMLP, [cb], steps=20)
    s = cb.summary()
    assert s["captures"] == 1 and s["prefetch_gate"] is None and hooks[0].removed_at == 20


def test_the_gate_is_for_auto_only(monkeypatch):
    cb, hooks = gated(monkeypatch, prefetch_ms=2.0, off_ms=1.0)
    cb.prefetch = "default"
    fit(TinyMLP, [cb], steps=20)
    assert cb.summary()["captures"] == 1 and cb.summary()["prefetch_gate"] is None


def test_the_gate_gain_is_logged_with_the_l2_metrics(monkeypatch):
    cb, _ = gated(monkeypatch, prefetch_ms=0.9, off_ms=1.0, gate_pairs=4)
    fit(TinyMLP, [cb], steps=20)
    assert cb._timing_metrics()["l2/prefetch_gate_gain"] == pytest.approx(0.1, abs=0.02)


class StandInSwitch:
    """What the gate uses of PrefetchSwitch: the state of the graph's prefetch nodes, per replay."""

    def __init__(self):
        self.enabled = True
        self.toggles = 0

    def set(self, enabled):
        self.toggles += enabled != self.enabled
        self.enabled = enabled


def switched(monkeypatch, prefetch_ms, off_ms, **kwargs):
    """`gated`, with the graph's prefetch switched instead of a second capture; records the switch's
    state at every replay."""
    cb, hooks = gated(monkeypatch, prefetch_ms, off_ms, **kwargs)
    switches, states = [], []
    monkeypatch.setattr(
        PrefetchSetup,
        "_prefetch_switch",
        lambda self, graph: (switches.append(StandInSwitch()) or switches[-1], ""),
    )
    original = StepDispatch._replay_step

    def replay(self, closure):
        states.append(
            (
                self._prefetch.gate_turn,
                switches[-1].enabled if switches else None,
                id(self._slots.state.graph),
            )
        )
        return original(self, closure)

    monkeypatch.setattr(StepDispatch, "_replay_step", replay)
    return cb, hooks, switches, states


@pytest.mark.parametrize(("prefetch_ms", "kept"), [(0.9, "prefetch"), (1.05, "off")])
def test_a_switched_trial_times_one_graph_with_prefetch_on_and_off_and_keeps_the_winners_state(
    monkeypatch, prefetch_ms, kept
):
    base = fit(baseline_of(TinyMLP), steps=40)
    cb, hooks, switches, states = switched(monkeypatch, prefetch_ms, 1.0, gate_pairs=8, verify=False)
    run = fit(TinyMLP, [cb], steps=40)
    s = cb.summary()
    gate = s["prefetch_gate"]
    # one capture, no second pool: the trial replays the one graph with its prefetch nodes on and off
    assert s["captures"] == 1 and gate["method"] == "switch" and gate["kept"] == kept, s
    assert len(switches) == 1 and hooks[0].scoped_captures == 1
    trial = [st for st in states if st[0] is not None]
    assert len(trial) == 16 and len({st[2] for st in states}) == 1
    assert all(enabled == (turn == "prefetch") for turn, enabled, _ in trial), trial
    after = [enabled for turn, enabled, _ in states[len(states) - (40 - 3 - 1 - 16) :]]
    assert after and all(enabled == (kept == "prefetch") for enabled in after), after
    assert (s["plans"] == []) == (kept == "off")
    assert_same(base, run)


def test_a_switch_the_driver_refuses_ends_the_trial_without_prefetch_and_the_fit_goes_on(monkeypatch):
    base = fit(baseline_of(TinyMLP), steps=30)
    cb, hooks, switches, states = switched(monkeypatch, 0.9, 1.0, gate_pairs=8)

    def refuse(self, enabled):
        raise RuntimeError("cuGraphNodeSetEnabled failed with CUDA driver error 1")

    monkeypatch.setattr(StandInSwitch, "set", refuse)
    run = fit(TinyMLP, [cb], steps=30)
    s = cb.summary()
    assert s["captured"] and s["fallback_steps"] == 0 and s["prefetch_gate"]["kept"] == "off", s
    assert "could not be switched" in s["prefetch_gate"]["reason"] and s["plans"] == []
    assert s["prefetch_gate"]["method"] == "switch"
    assert_same(base, run)


def test_without_a_switch_the_trial_captures_the_step_a_second_time(monkeypatch):
    cb, hooks = gated(monkeypatch, prefetch_ms=0.9, off_ms=1.0, gate_pairs=4)
    monkeypatch.setattr(PrefetchSetup, "_prefetch_switch", lambda self, graph: (None, "no driver"))
    fit(TinyMLP, [cb], steps=20)
    s = cb.summary()
    assert s["captures"] == 2 and s["prefetch_gate"]["method"] == "second capture", s


@pytest.mark.parametrize("bad", [1, -1, 2.0, True, "8"])
def test_gate_pairs_is_checked_by_name(bad):
    with pytest.raises(ValueError, match="`gate_pairs` must be 0"):
        L2GraphCallback(gate_pairs=bad)
