"""The autotuner's search for one layer shape: screen the candidates, eliminate the dominated ones,
confirm the best against plain and its decoy.

A mixin of :class:`l2lightning.tune.search.Autotuner`: its methods use the tuner's settings (set in
``Autotuner.__init__``); it is split out so that the search reads apart from the bookkeeping around it.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch

from l2lightning.prefetch.chain import Layer
from l2lightning.prefetch.plan import PrefetchPlan
from l2lightning.tune.candidates import (
    BACKWARD_OP_SHARE,
    ineligibility,
    make_plan,
    prune_candidates,
)
from l2lightning.tune.report import TuningRow
from l2lightning.tune.stats import GateResult, gate, mean_ci
from l2lightning.tune.timing import ShapeBench

# Deadlines of the search stages as fractions of a row's budget; confirmation gets the rest.
STAGE1_END, STAGE2_END = 0.45, 0.70
MIN_PAIRS = 3  # paired samples before a candidate can be judged (t with 2 dof is already wide)


class StagedSearch:
    """The search for one layer shape (see the module docstring)."""

    def _search(
        self,
        row: TuningRow,
        bench: ShapeBench,
        layer: Layer,
        phase: str,
        start: float,
        deadline: float,
        l2: int | None,
        kinds: tuple[str, ...],
    ) -> None:
        s = _Sampler(bench, self.clock)
        row.copies = max(1, int(getattr(bench, "copies", 1)))
        row.mode = str(getattr(bench, "mode", ""))
        # A chain of n copies holds prefetches up to n - 1 layers ahead; a plan reaching further
        # would prefetch nothing there, and its distance must stay what the model will run.
        distances = tuple(d for d in self.distances if d < row.copies)
        candidates = (
            [c for c in self.candidates if c.distance < row.copies] if self.candidates is not None else None
        )
        if (not candidates) if candidates is not None else (not distances):
            row.reason = f"a chain of {row.copies} copies holds no candidate's prefetch distance"
            return
        try:
            # Two plain samples: the first includes the capture and a cold start; the faster one
            # gives the op time that the issue-rate rule needs.
            t_plain = min(s.take(None), s.take(None))
        except torch.OutOfMemoryError:
            raise  # not this shape's failure: the tuner has no memory left (see Autotuner._measure)
        except Exception as exc:
            row.reason = f"the plain throwaway chain failed ({type(exc).__name__}: {exc})"
            return
        row.measured = True
        row.plain_us = t_plain / row.copies * 1e6
        # the op a prefetch overlaps: backward's share of a forward + backward replay in the backward
        # phase, forward's share of it in a training-context forward phase
        share = {"backward": BACKWARD_OP_SHARE, "forward": 1.0 - BACKWARD_OP_SHARE if row.context else 1.0}
        op_seconds = t_plain / row.copies * share[phase]
        rule = dict(block_rate=self.block_rate, slack=self.slack)
        span = max(deadline - start, 0.0)
        # Screening must leave room to confirm: the decoy's capture and MIN_PAIRS (plain, plan,
        # decoy) rounds, at the costs just seen on the plain chain.
        reserve = s.first_cost + 3 * MIN_PAIRS * s.repeat_cost
        stage_end = [min(start + f * span, deadline - reserve) for f in (STAGE1_END, STAGE2_END)]
        gains: dict[PrefetchPlan, list[float]] = {}
        failed: dict[PrefetchPlan, str] = {}

        if candidates is not None:
            first = prune_candidates(candidates, layer.nbytes, l2, op_seconds, **rule)
            pool = candidates
        else:
            base_kind = "hint" if "hint" in kinds else kinds[0]
            pool = [make_plan(base_kind, b, min(distances)) for b in self.blocks]
            first = prune_candidates(pool, layer.nbytes, l2, op_seconds, **rule)
        if not first:
            why = next(r for c in pool if (r := ineligibility(c, layer.nbytes, l2, op_seconds, **rule)))
            row.reason = f"no candidate passes the L2 / issue-rate rule (e.g. {why})"
            row.samples = s.samples
            return
        alive = self._screen(s, first, gains, failed, stage_end[0])
        if candidates is None:
            measured = [c for c in first if gains.get(c)]
            base = max(measured, key=lambda c: _mean(gains[c]), default=None)
            # Flavours at the best block count, unless every block count clearly lost (the
            # 32 MiB case: every plan lost 3-400%; other kinds will not rescue it).
            if base is not None and mean_ci(gains[base], self.confidence).high >= 0:
                flavours = [make_plan(k, base.blocks, base.distance) for k in kinds if k != base.kind]
                flavours += [make_plan(base.kind, base.blocks, d) for d in distances if d != base.distance]
                second = prune_candidates(flavours, layer.nbytes, l2, op_seconds, **rule)
                if second:
                    carried = [c for c in alive if c == base]
                    alive = self._screen(s, carried + second, gains, failed, stage_end[1])
        row.candidates = sum(1 for g in gains.values() if g) + len(failed)
        best = max(alive, key=lambda c: _mean(gains[c]), default=None)
        if best is None:
            tried = [c for c in gains if gains[c]]
            top = max(tried, key=lambda c: _mean(gains[c]), default=None)
            row.plan = top
            row.gain = _mean(gains[top]) if top is not None else None
            if top is not None:
                row.reason = f"no candidate stays above {self.min_gain:+.0%} in screening"
            elif failed:
                row.reason = f"every candidate failed ({next(iter(failed.values()))})"
            else:
                row.reason = (
                    "budget spent before screening could start (captures and samples too slow for it)"
                )
            row.samples = s.samples
            return
        row.plan = best
        result, note = self._confirm(s, best, deadline)
        row.samples = s.samples
        if result is None:
            row.gain = _mean(gains[best])
            row.reason = note
            return
        row.gain, row.ci_low, row.ci_high = result.gain.mean, result.gain.low, result.gain.high
        row.decoy_gain = result.decoy_gain.mean
        row.advantage_low = result.advantage.low
        row.chosen = result.keep
        row.reason = result.reason + (f" ({note})" if note else "")

    def _screen(
        self,
        s: _Sampler,
        candidates: list[PrefetchPlan],
        gains: dict[PrefetchPlan, list[float]],
        failed: dict[PrefetchPlan, str],
        deadline: float,
    ) -> list[PrefetchPlan]:
        """Race `candidates` in rounds of one pair each; return the survivors."""
        alive = [c for c in candidates if c not in failed]
        for c in alive:
            gains.setdefault(c, [])
        for rnd in range(self.screen_rounds):
            for i, c in enumerate(list(alive)):
                if len(gains[c]) > rnd:  # carried over from an earlier stage with enough pairs
                    continue
                if not s.affordable([(None, False), (c, False)], deadline):
                    return self._survivors(alive, gains)
                try:
                    gains[c].append(s.pair(c, plain_first=(rnd + i) % 2 == 0))
                except torch.OutOfMemoryError:
                    raise
                except Exception as exc:  # a candidate that cannot be captured or run is out
                    failed[c] = f"{c.label} failed: {type(exc).__name__}: {exc}"
                    alive.remove(c)
            if rnd + 1 >= MIN_PAIRS:
                alive = self._eliminate(alive, gains, rnd)
            # one candidate left with enough pairs (or none left): nothing to race any more
            if len(alive) <= 1 and all(len(gains[c]) >= MIN_PAIRS for c in alive):
                break
        return self._survivors(alive, gains)

    def _eliminate(
        self, alive: list[PrefetchPlan], gains: dict[PrefetchPlan, list[float]], rnd: int
    ) -> list[PrefetchPlan]:
        judged = {c: mean_ci(gains[c], self.confidence) for c in alive if len(gains[c]) >= MIN_PAIRS}
        if not judged:
            return alive
        best_low = max(ci.low for ci in judged.values())
        # Out: a candidate that cannot be the best, or cannot pass the gate's +min_gain bar.
        keep = [
            c
            for c in alive
            if c not in judged or (judged[c].high >= best_low and judged[c].high > self.min_gain)
        ]
        # Successive halving: every second round from the first judgement, the better half goes on.
        if len(keep) > 2 and (rnd + 1 - MIN_PAIRS) % 2 == 0:
            keep = sorted(keep, key=lambda c: _mean(gains[c]), reverse=True)[: math.ceil(len(keep) / 2)]
        return keep

    def _survivors(
        self, alive: list[PrefetchPlan], gains: dict[PrefetchPlan, list[float]]
    ) -> list[PrefetchPlan]:
        # A candidate needs at least one pair to be compared; an unmeasured one did not run in time.
        return [c for c in alive if gains.get(c)]

    def _confirm(self, s: _Sampler, plan: PrefetchPlan, deadline: float) -> tuple[GateResult | None, str]:
        """Fresh interleaved (plain, plan, decoy) rounds, order rotated each round, then the gate."""
        plain: list[float] = []
        cand: list[float] = []
        decoy: list[float] = []
        variants = [(None, False), (plan, False), (plan, True)]
        result: GateResult | None = None
        note = ""
        checkpoints = set(range(self.min_repeats, self.repeats + 1, 3)) | {self.repeats}
        for k in range(self.repeats):
            if not s.affordable(variants, deadline):
                note = f"budget spent after {k} confirmation round(s)"
                break
            times: dict[tuple[PrefetchPlan | None, bool], float] = {}
            try:
                for v in variants[k % 3 :] + variants[: k % 3]:
                    times[v] = s.take(*v)
            except torch.OutOfMemoryError:
                raise
            except Exception as exc:
                return None, f"{plan.label} failed in confirmation: {type(exc).__name__}: {exc}"
            plain.append(times[variants[0]])
            cand.append(times[variants[1]])
            decoy.append(times[variants[2]])
            if k + 1 in checkpoints:
                result = gate(plain, cand, decoy, self.min_gain, self.confidence)
                decided_no = result.gain.high < self.min_gain or result.advantage.high < 0
                if result.keep or decided_no:
                    break
        if len(plain) >= 2 and (result is None or result.gain.n != len(plain)):
            result = gate(plain, cand, decoy, self.min_gain, self.confidence)
        if result is None:
            return None, note or "no confirmation round fit in the budget"
        return result, note


class _Sampler:
    """Takes samples from a bench and remembers what each variant costs in wall time (captures included)."""

    def __init__(self, bench: ShapeBench, clock: Callable[[], float]) -> None:
        self.bench = bench
        self.clock = clock
        self.cost: dict[tuple[PrefetchPlan | None, bool], float] = {}
        self.first_cost = 0.0  # the largest first-sample wall time seen: a new variant is captured first
        self.repeat_cost = 0.0  # the latest wall time of a sample of an already captured variant
        self.samples = 0

    def take(self, plan: PrefetchPlan | None, decoy: bool = False) -> float:
        key = (plan, decoy)
        start = self.clock()
        value = float(self.bench.sample(plan, decoy))
        spent = self.clock() - start
        if key not in self.cost:
            self.first_cost = max(self.first_cost, spent)
        else:
            self.repeat_cost = spent
        self.cost[key] = spent
        self.samples += 1
        if not (math.isfinite(value) and value > 0):
            raise ValueError(
                f"bench returned an invalid time {value!r} for {plan.label if plan else 'plain'}"
            )
        return value

    def affordable(self, keys: Sequence[tuple[PrefetchPlan | None, bool]], deadline: float) -> bool:
        need = sum(self.cost.get(k, self.first_cost) for k in keys)
        return self.clock() + need <= deadline

    def pair(self, plan: PrefetchPlan, plain_first: bool) -> float:
        """One paired gain 1 - t_plan / t_plain; the order alternates so drift cancels."""
        if plain_first:
            p = self.take(None)
            c = self.take(plan)
        else:
            c = self.take(plan)
            p = self.take(None)
        return 1.0 - c / p


def _mean(values: Sequence[float]) -> float:
    return float(sum(values) / len(values)) if values else -math.inf
