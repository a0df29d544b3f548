"""Statistics for the autotuner's gate: paired gains, Student-t confidence intervals, keep-or-reject.

Pure Python and numpy (no torch, no scipy), so the gate is tested on synthetic timings on any CPU.

The autotuner measures in interleaved rounds (plain, candidate, decoy, with the order rotated each
round) so slow drift of clocks or temperature hits every variant alike, then compares per round:

    gain_i      = 1 - t_candidate_i / t_plain_i     (> 0: the plan saves time)
    decoy_i     = 1 - t_decoy_i / t_plain_i         (the same traffic aimed at the wrong layer)
    advantage_i = 1 - t_candidate_i / t_decoy_i     (> 0: the saving comes from warming the *right* bytes)

A plan is kept only when the 95% confidence interval of the mean gain lies above `min_gain` (+1%)
and the interval of the mean advantage over the decoy lies above zero. Anything else runs plain.

The t quantile is computed exactly (to ~1e-10) by inverting the Student-t CDF, written with the
regularized incomplete beta function (continued fraction, Numerical Recipes' ``betacf`` / Lentz)
and bisection. `T_975` below holds textbook values that the tests check it against.
It is written here because none of the dependencies offers it: scipy (``scipy.stats.t.ppf``) is
not one, ``torch.distributions.StudentT.icdf`` raises NotImplementedError (torch 2.13), torch has no
regularized incomplete beta function to invert, and numpy has neither.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

# Two-sided 95% critical values t_{0.975, dof} from standard tables (used by the tests as a check).
T_975 = {
    1: 12.7062,
    2: 4.3027,
    3: 3.1824,
    4: 2.7764,
    5: 2.5706,
    6: 2.4469,
    7: 2.3646,
    8: 2.3060,
    9: 2.2622,
    10: 2.2281,
    15: 2.1314,
    20: 2.0860,
    30: 2.0423,
    60: 2.0003,
    120: 1.9799,
}


def _betacf(a: float, b: float, x: float) -> float:
    """Continued fraction of the incomplete beta function (modified Lentz, Numerical Recipes 6.4)."""
    tiny = 1e-300
    qab, qap, qam = a + b, a + 1.0, a - 1.0
    c, d = 1.0, 1.0 - qab * x / qap
    d = 1.0 / (d if abs(d) > tiny else tiny)
    h = d
    for m in range(1, 400):
        m2 = 2 * m
        aa = m * (b - m) * x / ((qam + m2) * (a + m2))
        d = 1.0 + aa * d
        d = 1.0 / (d if abs(d) > tiny else tiny)
        c = 1.0 + aa / c
        c = c if abs(c) > tiny else tiny
        h *= d * c
        aa = -(a + m) * (qab + m) * x / ((a + m2) * (qap + m2))
        d = 1.0 + aa * d
        d = 1.0 / (d if abs(d) > tiny else tiny)
        c = 1.0 + aa / c
        c = c if abs(c) > tiny else tiny
        delta = d * c
        h *= delta
        if abs(delta - 1.0) < 1e-14:
            break
    return h


def _betainc(a: float, b: float, x: float) -> float:
    """Regularized incomplete beta I_x(a, b) for 0 <= x <= 1."""
    if x <= 0.0:
        return 0.0
    if x >= 1.0:
        return 1.0
    log_front = math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x)
    front = math.exp(log_front)
    # The continued fraction converges fast for x < (a+1)/(a+b+2); use the symmetry otherwise.
    if x < (a + 1.0) / (a + b + 2.0):
        return front * _betacf(a, b, x) / a
    return 1.0 - front * _betacf(b, a, 1.0 - x) / b


def t_cdf(t: float, dof: float) -> float:
    """Student-t cumulative distribution function P(T <= t) with `dof` degrees of freedom."""
    if not dof > 0:
        raise ValueError(f"`dof` must be > 0, got {dof!r}")
    tail = 0.5 * _betainc(dof / 2.0, 0.5, dof / (dof + t * t))  # P(T > |t|)
    return 1.0 - tail if t >= 0 else tail


@functools.lru_cache(maxsize=256)
def t_quantile(p: float, dof: float) -> float:
    """The `p` quantile of Student's t with `dof` degrees of freedom (e.g. 0.975, 4 -> 2.7764).

    Inverts `t_cdf` by bisection: the CDF is monotone, so 200 halvings of a bracket that is grown
    until it holds the answer give full double precision without scipy.
    """
    if not 0.0 < p < 1.0:
        raise ValueError(f"`p` must be in (0, 1), got {p!r}")
    if not dof > 0:
        raise ValueError(f"`dof` must be > 0, got {dof!r}")
    if p == 0.5:
        return 0.0
    if p < 0.5:
        return -t_quantile(1.0 - p, dof)
    low, high = 0.0, 2.0
    while t_cdf(high, dof) < p:
        low, high = high, high * 2.0
        if high > 1e12:  # only reachable for p within ~1e-12 of 1 at dof ~ 1
            return high
    for _ in range(200):
        mid = 0.5 * (low + high)
        if t_cdf(mid, dof) < p:
            low = mid
        else:
            high = mid
        if high - low < 1e-12 * max(1.0, high):
            break
    return 0.5 * (low + high)


@dataclass(frozen=True)
class Interval:
    """Mean of `n` values with a two-sided confidence interval [low, high]."""

    mean: float
    low: float
    high: float
    n: int
    confidence: float = 0.95

    @property
    def half_width(self) -> float:
        return (self.high - self.low) / 2.0


def mean_ci(values: Sequence[float] | np.ndarray, confidence: float = 0.95) -> Interval:
    """Mean and two-sided Student-t confidence interval of `values` (n-1 degrees of freedom).

    With fewer than two values the interval is (-inf, +inf): one sample says nothing about noise.

    Example:
        >>> ci = mean_ci([1.0, 2.0, 3.0, 4.0, 5.0])
        >>> round(ci.low, 3), round(ci.high, 3)
        (1.037, 4.963)
    """
    if not 0.0 < confidence < 1.0:
        raise ValueError(f"`confidence` must be in (0, 1), got {confidence!r}")
    data = np.asarray(values, dtype=np.float64).ravel()
    if not np.all(np.isfinite(data)):
        raise ValueError("`values` must be finite numbers")
    n = int(data.size)
    if n == 0:
        return Interval(math.nan, -math.inf, math.inf, 0, confidence)
    mean = float(data.mean())
    if n == 1:
        return Interval(mean, -math.inf, math.inf, 1, confidence)
    sd = float(data.std(ddof=1))
    half = t_quantile(0.5 + confidence / 2.0, n - 1) * sd / math.sqrt(n)
    return Interval(mean, mean - half, mean + half, n, confidence)


def _times(name: str, values: Sequence[float] | np.ndarray) -> np.ndarray:
    data = np.asarray(values, dtype=np.float64).ravel()
    if data.size and (not np.all(np.isfinite(data)) or np.any(data <= 0)):
        raise ValueError(f"`{name}` must hold positive, finite times")
    return data


def paired_gains(plain: Sequence[float] | np.ndarray, candidate: Sequence[float] | np.ndarray) -> np.ndarray:
    """Per-pair relative saving ``1 - candidate_i / plain_i`` of paired timings."""
    p = _times("plain", plain)
    c = _times("candidate", candidate)
    if p.shape != c.shape:
        raise ValueError(f"`candidate` must pair with `plain`: {c.size} timings against {p.size}")
    return 1.0 - c / p


@dataclass(frozen=True)
class GateResult:
    """The gate's verdict on one plan from interleaved (plain, candidate, decoy) timings."""

    keep: bool
    gain: Interval  # of 1 - t_candidate / t_plain
    decoy_gain: Interval  # of 1 - t_decoy / t_plain
    advantage: Interval  # of 1 - t_candidate / t_decoy
    reason: str


def gate(
    plain: Sequence[float] | np.ndarray,
    candidate: Sequence[float] | np.ndarray,
    decoy: Sequence[float] | np.ndarray,
    min_gain: float = 0.01,
    confidence: float = 0.95,
) -> GateResult:
    """Keep a plan only if it provably pays, and pays because it warms the right bytes.

    Args:
        plain, candidate, decoy: paired timings, element i of each taken in the same interleaved round.
        min_gain: the lower confidence bound of the mean gain must exceed this (0.01 = +1%).
        confidence: two-sided confidence level of the intervals.

    Returns:
        A :class:`GateResult`; ``keep`` is True when the gain's lower bound is above `min_gain`, the
        candidate's mean time is below the decoy's and the advantage's lower bound is above zero.

    Example:
        >>> r = gate([100, 101, 99, 100], [95, 96, 94, 95], [101, 102, 100, 101])
        >>> r.keep, round(r.gain.mean, 3)
        (True, 0.05)
    """
    if not -1.0 < min_gain < 1.0:
        raise ValueError(f"`min_gain` must be a fraction in (-1, 1), got {min_gain!r}")
    gains = paired_gains(plain, candidate)
    d = _times("decoy", decoy)
    if d.shape != gains.shape:
        raise ValueError(f"`decoy` must pair with `plain`: {d.size} timings against {gains.size}")
    decoy_gains = paired_gains(plain, d)
    advantage = 1.0 - _times("candidate", candidate) / d if d.size else d
    g = mean_ci(gains, confidence)
    dg = mean_ci(decoy_gains, confidence)
    adv = mean_ci(advantage, confidence)
    pct = int(round(confidence * 100))
    if g.n < 2:
        return GateResult(False, g, dg, adv, f"only {g.n} paired sample(s): no confidence interval")
    if not g.low > min_gain:
        return GateResult(
            False, g, dg, adv, f"gain {g.mean:+.2%}, {pct}% CI low {g.low:+.2%} is not above {min_gain:+.2%}"
        )
    if not (float(np.mean(candidate)) < float(np.mean(d)) and adv.low > 0.0):
        return GateResult(
            False,
            g,
            dg,
            adv,
            f"does not beat its decoy (decoy gain {dg.mean:+.2%}, advantage CI low {adv.low:+.2%}): not an L2 effect",
        )
    return GateResult(True, g, dg, adv, f"gain {g.mean:+.2%} [{g.low:+.2%}, {g.high:+.2%}], beats decoy")


def dominated(intervals: Mapping[Hashable, Interval]) -> set[Hashable]:
    """Keys whose upper bound lies below the best lower bound: they cannot be the best (early stop)."""
    if not intervals:
        return set()
    best_low = max(ci.low for ci in intervals.values())
    return {key for key, ci in intervals.items() if ci.high < best_low}
