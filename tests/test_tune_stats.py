"""The autotuner's statistics on synthetic timings: t quantiles, confidence intervals and the keep/reject gate."""

from __future__ import annotations

import math

import numpy as np
import pytest

from l2lightning.tune.stats import (
    T_975,
    Interval,
    dominated,
    gate,
    mean_ci,
    paired_gains,
    t_cdf,
    t_quantile,
)


@pytest.mark.parametrize("dof", sorted(T_975))
def test_t_quantile_matches_the_table(dof):
    assert t_quantile(0.975, dof) == pytest.approx(T_975[dof], abs=1e-4)


def test_t_quantile_other_levels_symmetry_and_normal_limit():
    assert t_quantile(0.95, 10) == pytest.approx(1.8125, abs=1e-4)
    assert t_quantile(0.995, 5) == pytest.approx(4.0321, abs=1e-4)
    assert t_quantile(0.025, 7) == pytest.approx(-t_quantile(0.975, 7))
    assert t_quantile(0.5, 3) == 0.0
    assert t_quantile(0.975, 1e6) == pytest.approx(1.959964, abs=1e-4)  # the normal quantile
    assert t_cdf(t_quantile(0.9, 4), 4) == pytest.approx(0.9, abs=1e-10)


@pytest.mark.parametrize(("kwargs", "name"), [({"p": 1.0, "dof": 3}, "`p`"), ({"p": 0.9, "dof": 0}, "`dof`")])
def test_t_quantile_rejects_bad_arguments(kwargs, name):
    with pytest.raises(ValueError, match=name):
        t_quantile(**kwargs)


def test_mean_ci_by_hand():
    ci = mean_ci([1.0, 2.0, 3.0, 4.0, 5.0])
    half = 2.7764 * math.sqrt(2.5) / math.sqrt(5)  # t_{0.975,4} * sd / sqrt(n)
    assert ci.mean == 3.0 and ci.n == 5
    assert ci.low == pytest.approx(3.0 - half, abs=1e-3) and ci.high == pytest.approx(3.0 + half, abs=1e-3)


def test_mean_ci_with_fewer_than_two_values_is_unbounded():
    assert mean_ci([0.5]).low == -math.inf and mean_ci([0.5]).high == math.inf
    assert mean_ci([]).n == 0


def test_mean_ci_covers_the_true_mean_95_percent_of_the_time():
    rng = np.random.default_rng(7)
    trials = 3000
    hits = sum(1 for _ in range(trials) if (ci := mean_ci(rng.normal(2.0, 1.0, 5))).low <= 2.0 <= ci.high)
    assert 0.93 < hits / trials < 0.97


def _timings(gain, decoy_gain, noise, n=10, seed=0, decoy_noise=None):
    """Paired (plain, candidate, decoy) times: drift common to a round, independent noise per sample."""
    rng = np.random.default_rng(seed)
    drift = 100.0 * (1 + 0.01 * np.sin(np.arange(n)))  # slow drift hits all three alike
    plain = drift * (1 + rng.normal(0, noise, n))
    cand = drift * (1 - gain) * (1 + rng.normal(0, noise, n))
    decoy = drift * (1 - decoy_gain) * (1 + rng.normal(0, noise if decoy_noise is None else decoy_noise, n))
    return plain, cand, decoy


def test_gate_keeps_a_clear_win():
    result = gate(*_timings(gain=0.05, decoy_gain=-0.02, noise=0.003))
    assert result.keep, result.reason
    assert result.gain.low > 0.04 and result.gain.high < 0.06
    assert result.decoy_gain.mean < 0 and result.advantage.low > 0


def test_gate_rejects_a_win_inside_the_noise():
    result = gate(*_timings(gain=0.015, decoy_gain=-0.02, noise=0.03, n=6))
    assert not result.keep
    assert result.gain.low < 0.01 and "not above" in result.reason


def test_gate_rejects_a_plan_that_loses():
    result = gate(*_timings(gain=-0.05, decoy_gain=-0.02, noise=0.003))
    assert not result.keep and result.gain.high < 0


def test_gate_rejects_a_plan_that_does_not_beat_its_decoy():
    # the decoy gains just as much: the saving is not an L2 effect (seen at d=768 on the H200)
    result = gate(*_timings(gain=0.03, decoy_gain=0.03, noise=0.003, seed=3))
    assert not result.keep
    assert result.gain.low > 0.01  # the gain alone would have passed
    assert "decoy" in result.reason


def test_gate_rejects_when_the_decoy_is_faster():
    result = gate(*_timings(gain=0.03, decoy_gain=0.05, noise=0.003))
    assert not result.keep and "decoy" in result.reason


def test_gate_needs_two_pairs():
    result = gate([100.0], [90.0], [101.0])
    assert not result.keep and "1 paired" in result.reason


def test_gate_and_pairs_reject_bad_arguments():
    with pytest.raises(ValueError, match="`candidate`"):
        paired_gains([1.0, 2.0], [1.0])
    with pytest.raises(ValueError, match="`plain`"):
        paired_gains([1.0, -2.0], [1.0, 1.0])
    with pytest.raises(ValueError, match="`decoy`"):
        gate([1.0, 1.0], [1.0, 1.0], [1.0])
    with pytest.raises(ValueError, match="`min_gain`"):
        gate([1.0, 1.0], [1.0, 1.0], [1.0, 1.0], min_gain=2.0)
    with pytest.raises(ValueError, match="`confidence`"):
        mean_ci([1.0, 2.0], confidence=1.5)


def test_dominated_candidates_are_those_below_the_best_lower_bound():
    intervals = {
        "a": Interval(0.05, 0.04, 0.06, 5),
        "b": Interval(0.045, 0.03, 0.06, 5),
        "c": Interval(0.0, -0.02, 0.02, 5),
    }
    assert dominated(intervals) == {"c"}
    assert dominated({}) == set()
