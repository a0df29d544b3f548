"""The whole-step gate's logic on synthetic replay times: turn order, bookkeeping, the verdict."""

from __future__ import annotations

import math

import pytest

from l2lightning.callback.step_gate import StepGate, judge


def test_pairs_alternate_their_order():
    gate = StepGate(prefetch_graph="P", pairs=3)
    order = []
    while not gate.complete:
        variant = gate.next_variant()
        order.append(variant)
        gate.record(variant, None, None)
    assert order == ["prefetch", "off", "off", "prefetch", "prefetch", "off"]
    assert gate.needs_off_graph  # nothing captured it in this test


def test_a_clear_whole_step_gain_keeps_the_plans():
    prefetch = [0.90 + 0.002 * (i % 3) for i in range(24)]
    off = [1.00 + 0.002 * (i % 2) for i in range(24)]
    result = judge(prefetch, off)
    assert result.kept == "prefetch" and result.gain.low > 0.09 and result.gain.n == 24, result
    assert result.prefetch_ms == pytest.approx(0.902) and result.off_ms == pytest.approx(1.001)


@pytest.mark.parametrize(
    ("prefetch", "off"),
    [
        ([1.05, 1.06, 1.04, 1.05] * 6, [1.0, 1.01, 0.99, 1.0] * 6),  # a loss: 5% slower
        ([0.97, 1.03, 1.0, 0.99] * 6, [1.0, 1.0, 1.01, 0.99] * 6),  # within noise: the CI holds zero
    ],
)
def test_a_loss_or_a_gain_within_noise_keeps_the_step_without_prefetch(prefetch, off):
    result = judge(prefetch, off)
    assert result.kept == "off" and "not above" in result.reason and result.gain.low <= 0.0, result


def test_min_gain_raises_the_bar():
    prefetch, off = [0.98, 0.981, 0.979] * 8, [1.0, 1.0, 1.0] * 8
    assert judge(prefetch, off).kept == "prefetch"
    assert judge(prefetch, off, min_gain=0.03).kept == "off"


def test_one_pair_is_no_evidence():
    result = judge([0.5], [1.0])
    assert result.kept == "off" and "only 1" in result.reason and math.isinf(result.gain.low)


def test_decide_reads_each_replays_events_through_the_seam():
    gate = StepGate(prefetch_graph="P", pairs=4)
    gate.graphs["off"] = "O"
    times = {}
    for i in range(8):
        variant = gate.next_variant()
        start, end = object(), object()
        times[id(end)] = (0.8 if variant == "prefetch" else 1.0) + 0.001 * i
        gate.record(variant, start, end)
    assert gate.complete and not gate.needs_off_graph
    result = gate.decide(lambda start, end: times[id(end)])
    assert result.kept == "prefetch" and gate.winner_and_loser(result) == ("P", "O")
    assert result.to_dict()["pairs"] == 4 and result.to_dict()["kept"] == "prefetch"
    assert result.method == "second capture" and result.to_dict()["method"] == "second capture"


class RecordingSwitch:
    def __init__(self):
        self.enabled = True
        self.calls = []

    def set(self, enabled):
        self.calls.append(enabled)
        self.enabled = enabled


@pytest.mark.parametrize(("prefetch_ms", "kept"), [(0.8, "prefetch"), (1.2, "off")])
def test_a_switched_trial_replays_one_graph_with_its_prefetch_on_and_off_and_settles_on_the_winner(
    prefetch_ms, kept
):
    switch = RecordingSwitch()
    gate = StepGate(prefetch_graph="P", pairs=4, switch=switch)
    assert not gate.needs_off_graph and gate.graphs == {"prefetch": "P", "off": "P"}
    times, states = {}, []
    while not gate.complete:
        variant = gate.next_variant()
        assert gate.graph_for(variant) == "P"
        states.append((variant, switch.enabled))
        end = object()
        times[id(end)] = (prefetch_ms if variant == "prefetch" else 1.0) + 0.001 * len(states)
        gate.record(variant, object(), end)
    assert all(enabled == (variant == "prefetch") for variant, enabled in states), states
    result = gate.decide(lambda start, end: times[id(end)])
    gate.settle(result.kept)
    assert result.kept == kept and result.method == "switch" and switch.enabled == (kept == "prefetch")


@pytest.mark.parametrize("pairs", [0, 1, 2.5, True, "24"])
def test_pairs_must_be_an_int_of_at_least_two(pairs):
    with pytest.raises(ValueError, match="`pairs` must be an int >= 2"):
        StepGate(prefetch_graph="P", pairs=pairs)


def test_record_names_the_variants():
    with pytest.raises(ValueError, match=r"`variant` must be one of \('prefetch', 'off'\)"):
        StepGate(prefetch_graph="P").record("decoy", None, None)
