"""The measured autotuner: time candidate prefetch plans per layer shape and keep one only where it provably pays.

For each distinct layer shape of a chain (``Layer.shape_key``: type, weight shapes and dtype, input
shape, enclosing block) and each phase (``"forward"``: a forward-only graph; ``"backward"``: forward
+ backward with prefetch only in backward), the tuner builds a throwaway chain of copies of that
layer's block (``Layer.block``: LayerNorm, Linear, GELU), or of the lone layer where the model has
no such block, with fresh random weights (the model's own tensors are only read once, by ``copy.deepcopy``), long
enough that its weights exceed L2 twice over so each layer's weights are evicted between replays,
captures it in CUDA graphs without and with each candidate plan installed through
:class:`~l2lightning.prefetch.install.PrefetchHooks`, and times graph replays with CUDA events.

Search, inside a wall-time budget (0.6 s per distinct shape by default):

1. Prune by the rule the H200 measurements support: the current and the next ``distance`` layers
   must fit in L2 together, and the prefetch must be able to finish in time. The op time comes
   from the measured plain chain; the prefetch time from `BLOCK_PREFETCH_RATE` per block.
2. Screen (a race of paired (plain, candidate) samples, order alternating): first block counts of
   the ``hint`` kind at distance 1, then the other kinds and distance 2 at the best block count.
   After three pairs a candidate is dropped when its confidence interval's upper bound falls below
   the best lower bound or below ``min_gain``; the better half survives every second round.
3. Confirm the winner on *fresh* interleaved (plain, plan, decoy) rounds (the screening samples
   picked it, so reusing them would overstate its gain) and apply the gate of
   :mod:`l2lightning.tune.stats`: mean-gain CI above +1% and a win over the decoy. Otherwise the
   shape runs plain.

Decisions are cached on disk (:mod:`l2lightning.tune.cache`). The measuring step is injectable
(``Autotuner(bench_factory=...)``), which is how the CPU tests drive the search with fake timings.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import hashlib
import math
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch import nn

from l2lightning.capture import graph_capture
from l2lightning.prefetch.install import (
    Layer,
    PrefetchHooks,
    _flatten_tensors,
    device_l2_bytes,
    discover_chain,
)
from l2lightning.prefetch.plan import KINDS, MIB, PrefetchPlan
from l2lightning.tune.cache import PlanCache
from l2lightning.tune.stats import GateResult, gate, mean_ci

__all__ = [
    "Autotuner",
    "TuningReport",
    "TuningRow",
    "ShapeBench",
    "SkipShape",
    "CudaShapeBench",
    "Throwaway",
    "build_throwaway",
    "copies_for",
    "tune_hooks",
    "log_table",
    "make_plan",
    "chain_step_plans",
    "candidate_grid",
    "ineligibility",
    "prune_candidates",
]

PHASES = ("forward", "backward")
DEFAULT_BLOCKS = (1, 2, 4, 8, 16, 32)
DEFAULT_DISTANCES = (1, 2)
# Layers smaller than this are not worth a launch (the same floor as prefetch.default_plan).
MIN_LAYER_BYTES = 256 * 1024
# Bytes per second one prefetch block can pull into L2, for pruning only. Derived from the H200
# measurements rather than from DRAM bandwidth / SM count (~36 GB/s per SM, which would be the
# fair share with every SM streaming): a prefetch block does not compete with 131 others for
# issue slots. With the 2x slack below, 128 GB/s keeps every measured winner (hint8 on 4.5 MiB
# layers in ~11.6 us ops needs >= 24 GB/s per block; hint4 on 12.5 MiB in ~15.5 us ops needs
# >= 106 GB/s) and drops the measured disasters (hint1 on 4.5 MiB: >= 203 GB/s needed, lost
# 60-412%). A lower constant such as 25 GB/s would prune hint8 at 12.5 MiB, a measured +3.8%.
BLOCK_PREFETCH_RATE = 128e9
RATE_SLACK = 2.0
# A layer's backward (grad input + grad weight) is about two thirds of its forward+backward time.
BACKWARD_OP_SHARE = 2.0 / 3.0
# When both phases of a shape are tuned, forward may use this share of the shape's budget; backward
# (graphs three times longer) gets the rest, including whatever forward left unused.
FORWARD_BUDGET_SHARE = 0.4
# Deadlines of the search stages as fractions of a row's budget; confirmation gets the rest.
STAGE1_END, STAGE2_END = 0.45, 0.70
MIN_PAIRS = 3  # paired samples before a candidate can be judged (t with 2 dof is already wide)


class SkipShape(Exception):
    """A shape cannot be tuned (cannot be copied or called on a random input, out of memory...)."""


class ShapeBench(Protocol):
    """Measures one layer shape in one phase. ``Autotuner(bench_factory=...)`` injects fakes.

    Attributes:
        copies: layers in the throwaway chain (the op time per layer is the replay time / copies).
        mode: ``"block"`` (copies of the layer's block, each feeding the next), ``"chain"`` (copies of
            the lone layer, each feeding the next) or ``"fan"`` (each copy reads its own input).
    """

    copies: int
    mode: str

    def sample(self, plan: PrefetchPlan | None, decoy: bool = False) -> float:
        """One timing sample: seconds per replay of the chain with `plan` (None = plain)."""
        ...

    def close(self) -> None:
        """Free graphs and throwaway weights."""
        ...


BenchFactory = Callable[[Layer, str, torch.device], ShapeBench]


# ---------------------------------------------------------------------- candidates
def make_plan(kind: str, blocks: int, distance: int = 1) -> PrefetchPlan:
    """A candidate plan. Bulk kinds use one warp per block (one 32 KiB bulk prefetch per thread),
    the measured ``bulkN`` shape; hint kinds use 256 threads, 128-byte stride."""
    threads = 32 if kind.startswith("bulk") else 256
    return PrefetchPlan(kind=kind, blocks=blocks, threads=threads, distance=distance)


def chain_step_plans(
    length: int, significant: Sequence[int], plans: dict[int, PrefetchPlan], phase: str
) -> list[PrefetchPlan | None]:
    """Per chain step, the plan with its distance counted in chain steps.

    A tuned distance counts *significant* layers (those worth a prefetch); the chain also holds
    small steps that hide almost no time (a LayerNorm's 5 KiB scale and shift in bf16 at d=2560).
    Forward, the prefetch of significant layer j is issued when the ``distance``-th previous
    significant layer starts; backward, when the ``distance``-th next one's backward starts. The
    throwaway bench and the model's mapping (:meth:`TuningReport.plans_for`) both go through
    here, so a measured plan is the plan the model runs. A layer with no such source, or one more
    than 8 chain steps away, runs plain; so does a step that is not significant.
    """
    position = {i: k for k, i in enumerate(significant)}
    out: list[PrefetchPlan | None] = [None] * length
    for j, plan in plans.items():
        if j not in position:
            continue
        k = position[j]
        if phase == "forward":
            source = k - plan.distance
            gap = j - significant[source] if source >= 0 else None
        else:
            source = k + plan.distance
            gap = significant[source] - j if source < len(significant) else None
        if gap is not None and gap <= 8:
            out[j] = dataclasses.replace(plan, distance=gap)
    return out


def candidate_grid(
    kinds: Sequence[str], blocks: Sequence[int] = DEFAULT_BLOCKS, distances: Sequence[int] = DEFAULT_DISTANCES
) -> list[PrefetchPlan]:
    """Every (kind, blocks, distance) combination as a plan."""
    return [make_plan(k, b, d) for k in kinds for d in distances for b in blocks]


def ineligibility(
    plan: PrefetchPlan,
    layer_bytes: int,
    l2_bytes: int | None,
    op_seconds: float | None,
    *,
    block_rate: float = BLOCK_PREFETCH_RATE,
    slack: float = RATE_SLACK,
) -> str | None:
    """Why `plan` cannot pay for a layer of `layer_bytes`, or None when it is worth measuring.

    The rule from the measurements: the current layer and the ``distance`` layers ahead must fit
    in L2 together ((distance + 1) x layer bytes <= L2; 32 MiB layers on a 60 MiB L2 always
    lost), and the prefetch must finish before the target op starts: bytes / (blocks x
    `block_rate`) may exceed ``distance`` op times by at most `slack` (one block on a 4.5 MiB
    layer lost 60-412% because the final join waited for it).
    """
    if l2_bytes is not None and (plan.distance + 1) * layer_bytes > l2_bytes:
        return (
            f"{plan.label}: {plan.distance + 1} x {layer_bytes / MIB:.1f} MiB layers do not fit in "
            f"{l2_bytes / MIB:.0f} MiB of L2"
        )
    if op_seconds is not None and op_seconds > 0:
        fetch = layer_bytes / (plan.blocks * block_rate)
        budget = slack * plan.distance * op_seconds
        if fetch > budget:
            return (
                f"{plan.label}: ~{fetch * 1e6:.1f} us to fetch {layer_bytes / MIB:.1f} MiB with {plan.blocks} "
                f"block(s) > {slack:g} x {plan.distance} op(s) of {op_seconds * 1e6:.1f} us"
            )
    return None


def prune_candidates(
    candidates: Sequence[PrefetchPlan],
    layer_bytes: int,
    l2_bytes: int | None,
    op_seconds: float | None,
    *,
    block_rate: float = BLOCK_PREFETCH_RATE,
    slack: float = RATE_SLACK,
) -> list[PrefetchPlan]:
    """The candidates that pass :func:`ineligibility`, in their order."""
    return [
        c
        for c in candidates
        if ineligibility(c, layer_bytes, l2_bytes, op_seconds, block_rate=block_rate, slack=slack) is None
    ]


# ---------------------------------------------------------------------- report
@dataclass
class TuningRow:
    """The decision for one (layer shape, phase).

    ``plain_us`` is the time of one layer op in the plain throwaway graph (replay time / copies);
    ``plan`` is the best measured plan whether or not it was kept (``chosen``); ``gain``, ``ci_low``,
    ``ci_high`` and ``decoy_gain`` come from the confirmation rounds (``1 - t/t_plain``).
    """

    shape: str
    phase: str
    layer_bytes: int
    dtype: str = ""
    layers: int = 1  # chain layers sharing this shape
    copies: int = 0
    mode: str = ""
    # "train": a forward plan measured in a forward + backward graph (how a training step runs it);
    # "" otherwise (a forward-only graph, or the backward phase, which always runs forward + backward)
    context: str = ""
    plain_us: float | None = None
    plan: PrefetchPlan | None = None
    gain: float | None = None
    ci_low: float | None = None
    ci_high: float | None = None
    decoy_gain: float | None = None
    advantage_low: float | None = None
    chosen: bool = False
    seconds: float = 0.0
    tuned_seconds: float = 0.0  # the original tuning time of a cached row
    from_cache: bool = False
    measured: bool = False
    candidates: int = 0
    samples: int = 0
    reason: str = ""

    @property
    def label(self) -> str:
        return self.plan.label if self.plan is not None else "-"

    def to_dict(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        data["plan"] = self.plan.to_dict() if self.plan is not None else None
        data["plan_label"] = self.plan.label if self.plan is not None else None
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TuningRow:
        fields = {f.name for f in dataclasses.fields(cls)}
        kwargs = {k: v for k, v in data.items() if k in fields}
        plan = kwargs.get("plan")
        kwargs["plan"] = PrefetchPlan.from_dict(plan) if isinstance(plan, dict) else None
        return cls(**kwargs)


@dataclass
class TuningReport:
    """Per (layer shape, phase): what was measured and which plan, if any, was kept.

    Example:
        >>> report = Autotuner().tune(hooks.chain, hooks.device, ("forward",))  # doctest: +SKIP
        >>> print(report.table())  # doctest: +SKIP
        >>> plans = report.plans_for(hooks.chain, "forward")  # doctest: +SKIP
    """

    rows: list[TuningRow] = field(default_factory=list)
    device: str = ""
    min_layer_bytes: int = MIN_LAYER_BYTES
    budget_s: float = 0.6
    min_gain: float = 0.01
    confidence: float = 0.95

    def row(self, shape: str, phase: str) -> TuningRow | None:
        """The row of `shape` in `phase`, or None."""
        return next((r for r in self.rows if r.shape == shape and r.phase == phase), None)

    def plans_for(self, chain: Sequence[Layer], phase: str) -> list[PrefetchPlan | None]:
        """Each chain layer's plan: its shape's kept plan in `phase`, or None.

        The tuned distance counts layers of the throwaway chain, where every layer is a real op.
        In a model's chain, layers below ``min_layer_bytes`` (a LayerNorm's 5 KiB scale and shift
        in bf16 at d=2560) are steps of the chain but hide almost no time, so the distance is
        translated: forward, the prefetch of layer j is issued when the ``distance``-th previous
        significant layer starts (backward: the ``distance``-th next one, whose backward runs
        first). A layer with no such layer, or one more than 8 chain steps away, runs plain.
        """
        if phase not in PHASES:
            raise ValueError(f"`phase` must be one of {PHASES}, got {phase!r}")
        by_shape = {r.shape: r for r in self.rows if r.phase == phase}
        significant = [i for i, layer in enumerate(chain) if layer.nbytes >= self.min_layer_bytes]
        kept: dict[int, PrefetchPlan] = {}
        for j, layer in enumerate(chain):
            row = by_shape.get(layer.shape_key)
            if row is not None and row.chosen and row.plan is not None:
                kept[j] = row.plan
        return chain_step_plans(len(chain), significant, kept, phase)

    def seconds_per_shape(self) -> dict[str, float]:
        """Tuning wall time of each shape in this run, summed over its phases."""
        out: dict[str, float] = {}
        for r in self.rows:
            out[r.shape] = out.get(r.shape, 0.0) + r.seconds
        return out

    def to_dict(self) -> dict[str, Any]:
        return {
            "device": self.device,
            "min_layer_bytes": self.min_layer_bytes,
            "budget_s": self.budget_s,
            "min_gain": self.min_gain,
            "confidence": self.confidence,
            "rows": [r.to_dict() for r in self.rows],
        }

    def table(self) -> str:
        """A printable text table, one line per (shape, phase)."""
        pct = f"{int(round(self.confidence * 100))}% CI"
        headers = [
            "shape",
            "phase",
            "MiB",
            "n",
            "plain us",
            "best",
            "gain",
            pct,
            "decoy",
            "kept",
            "s",
            "src",
            "note",
        ]

        def fmt(x: float | None, spec: str) -> str:
            return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, spec)

        lines = []
        for r in self.rows:
            ci = "-" if r.ci_low is None else f"[{fmt(r.ci_low, '+.1%')}, {fmt(r.ci_high, '+.1%')}]"
            src = "cache" if r.from_cache else ("measured" if r.measured else "rule")
            note = r.reason if len(r.reason) <= 70 else r.reason[:67] + "..."
            lines.append(
                [
                    r.shape,
                    f"{r.phase}@{r.context}" if r.context else r.phase,
                    f"{r.layer_bytes / MIB:.2f}",
                    str(r.layers),
                    fmt(r.plain_us, ".1f"),
                    r.label,
                    fmt(r.gain, "+.1%"),
                    ci,
                    fmt(r.decoy_gain, "+.1%"),
                    "yes" if r.chosen else "no",
                    f"{r.seconds:.2f}",
                    src,
                    note,
                ]
            )
        widths = [
            max(len(h), *(len(line[i]) for line in lines)) if lines else len(h) for i, h in enumerate(headers)
        ]
        title = f"l2lightning autotune on {self.device or '?'} (keep: {pct} of gain > {self.min_gain:+.0%} and beats decoy)"
        out = [title, "  ".join(h.ljust(w) for h, w in zip(headers, widths))]
        out += ["  ".join(c.ljust(w) for c, w in zip(line, widths)).rstrip() for line in lines]
        return "\n".join(out)

    def log_table(self) -> None:
        """Print :meth:`table` once (rank zero under Lightning, plain print otherwise)."""
        log_table(self)


def log_table(report: TuningReport) -> None:
    """Log `report`'s table with Lightning's ``rank_zero_info`` when Lightning is importable, else print it."""
    text = report.table()
    try:
        from lightning.pytorch.utilities import rank_zero_info
    except Exception:  # Lightning missing or broken: the table still reaches the user
        print(text)
        return
    rank_zero_info(text)


# ---------------------------------------------------------------------- measuring helper
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


# ---------------------------------------------------------------------- the tuner
class Autotuner:
    """Measures prefetch plans per layer shape on throwaway weights; keeps a plan only where it pays.

    Args:
        budget_s: wall seconds of tuning per distinct layer shape (all its phases together).
        candidates: plans to race (pruned by the L2/issue-rate rule first); default: a staged
            search over `blocks` x kinds x `distances` (block counts first, then flavours).
        min_gain: the gain's lower confidence bound must exceed this (0.01 = +1%).
        repeats: most confirmation rounds (plain, plan, decoy) for the winner; the gate is checked
            after ``min_repeats`` rounds and every 3 rounds after, stopping once it has decided.
        min_repeats: confirmation rounds before the first check.
        confidence: two-sided confidence level of the intervals.
        clock: wall clock in seconds (tests inject a fake one).
        cache: a :class:`~l2lightning.tune.cache.PlanCache`, ``"default"`` (``$L2L_CACHE_DIR``, honours
            ``L2L_RETUNE``) or None (no cache).
        blocks, distances, kinds: the default grid; kinds default to what the device supports.
        block_rate, slack: the pruning rule's per-block prefetch rate (bytes/s) and tolerance.
        min_layer_bytes: smaller layers run plain without measuring (not worth a launch).
        replays: graph replays per timing sample (CUDA bench).
        screen_rounds: most screening pairs per candidate.
        bench_factory: ``factory(layer, phase, device) -> ShapeBench``; default: :class:`CudaShapeBench`.
        l2_bytes, device_name: overrides of what the device reports (tests, fake benches).

    Example:
        >>> tuner = Autotuner(budget_s=0.6)  # doctest: +SKIP
        >>> report = tuner.tune(hooks.chain, torch.device("cuda", 0), ("forward", "backward"))  # doctest: +SKIP
        >>> print(report.table())  # doctest: +SKIP
    """

    def __init__(
        self,
        budget_s: float = 0.6,
        candidates: Sequence[PrefetchPlan] | None = None,
        min_gain: float = 0.01,
        repeats: int = 12,
        clock: Callable[[], float] = time.perf_counter,
        cache: PlanCache | str | None = "default",
        *,
        min_repeats: int = 6,
        confidence: float = 0.95,
        blocks: Sequence[int] = DEFAULT_BLOCKS,
        distances: Sequence[int] = DEFAULT_DISTANCES,
        kinds: Sequence[str] | None = None,
        block_rate: float = BLOCK_PREFETCH_RATE,
        slack: float = RATE_SLACK,
        min_layer_bytes: int = MIN_LAYER_BYTES,
        replays: int = 5,
        screen_rounds: int = 8,
        bench_factory: BenchFactory | None = None,
        l2_bytes: int | None = None,
        device_name: str | None = None,
    ) -> None:
        if isinstance(budget_s, bool) or not isinstance(budget_s, (int, float)) or not budget_s > 0:
            raise ValueError(f"`budget_s` must be a positive number of seconds, got {budget_s!r}")
        if candidates is not None:
            candidates = list(candidates)
            if not candidates or not all(isinstance(c, PrefetchPlan) for c in candidates):
                raise ValueError("`candidates` must be None or a non-empty sequence of PrefetchPlan")
        if isinstance(min_gain, bool) or not isinstance(min_gain, (int, float)) or not 0 <= min_gain < 0.5:
            raise ValueError(f"`min_gain` must be a fraction in [0, 0.5), got {min_gain!r}")
        _check_count("repeats", repeats, 3)
        _check_count("min_repeats", min_repeats, 2)
        if min_repeats > repeats:
            raise ValueError(f"`min_repeats` ({min_repeats}) must not exceed `repeats` ({repeats})")
        if not isinstance(confidence, float) or not 0.5 < confidence < 1:
            raise ValueError(f"`confidence` must be a float in (0.5, 1), got {confidence!r}")
        if not callable(clock):
            raise TypeError("`clock` must be a callable returning seconds")
        if cache == "default":
            cache = PlanCache()
        elif cache is not None and not isinstance(cache, PlanCache):
            raise TypeError(f"`cache` must be a PlanCache, 'default' or None, got {cache!r}")
        if not blocks or not all(isinstance(b, int) and 1 <= b <= 1024 for b in blocks):
            raise ValueError(f"`blocks` must be block counts in [1, 1024], got {blocks!r}")
        if not distances or not all(isinstance(d, int) and 1 <= d <= 8 for d in distances):
            raise ValueError(f"`distances` must be layer distances in [1, 8], got {distances!r}")
        if kinds is not None and (not kinds or any(k not in KINDS for k in kinds)):
            raise ValueError(f"`kinds` must be a non-empty subset of {KINDS}, got {kinds!r}")
        if not block_rate > 0:
            raise ValueError(f"`block_rate` must be > 0 bytes/s, got {block_rate!r}")
        if not slack > 0:
            raise ValueError(f"`slack` must be > 0, got {slack!r}")
        _check_count("min_layer_bytes", min_layer_bytes, 0)
        _check_count("replays", replays, 1)
        _check_count("screen_rounds", screen_rounds, MIN_PAIRS)
        if bench_factory is not None and not callable(bench_factory):
            raise TypeError("`bench_factory` must be a callable factory(layer, phase, device) -> ShapeBench")
        if l2_bytes is not None:
            _check_count("l2_bytes", l2_bytes, 1)
        self.budget_s = float(budget_s)
        self.candidates = candidates
        self.min_gain = float(min_gain)
        self.repeats = repeats
        self.min_repeats = min_repeats
        self.confidence = confidence
        self.clock = clock
        self.cache: PlanCache | None = cache
        self.blocks = tuple(blocks)
        self.distances = tuple(distances)
        self.kinds = tuple(kinds) if kinds is not None else None
        self.block_rate = float(block_rate)
        self.slack = float(slack)
        self.min_layer_bytes = min_layer_bytes
        self.replays = replays
        self.screen_rounds = screen_rounds
        self.bench_factory = bench_factory
        self.l2_bytes = l2_bytes
        self.device_name = device_name

    # ------------------------------------------------------------ public
    def tune(
        self, chain: Sequence[Layer], device: torch.device | str, phases: Sequence[str] = ("forward",)
    ) -> TuningReport:
        """Tune every distinct layer shape of `chain` in each of `phases` ("forward", "backward").

        Never touches the model's tensors (copies are made and re-initialised) nor, visibly, its RNG.
        """
        if isinstance(phases, str):
            phases = (phases,)
        phases = tuple(phases)
        bad = [p for p in phases if p not in PHASES]
        if bad or len(set(phases)) != len(phases):
            raise ValueError(f"`phases` must be distinct values from {PHASES}, got {phases!r}")
        if not all(isinstance(layer, Layer) for layer in chain):
            raise TypeError(
                "`chain` must be a list of l2lightning.prefetch.install.Layer (PrefetchHooks.chain)"
            )
        device = torch.device(device)
        on_cuda = device.type == "cuda"
        if on_cuda and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        report = TuningReport(
            device=self._device_name(device),
            min_layer_bytes=self.min_layer_bytes,
            budget_s=self.budget_s,
            min_gain=self.min_gain,
            confidence=self.confidence,
        )
        shapes: dict[str, tuple[Layer, int]] = {}
        for layer in chain:
            first, count = shapes.get(layer.shape_key, (layer, 0))
            shapes[layer.shape_key] = (first, count + 1)
        unavailable = self._unavailable_reason(device) if phases and shapes else None
        l2 = kinds = None
        if unavailable is None:
            l2 = self.l2_bytes if self.l2_bytes is not None else device_l2_bytes(device)
            kinds = self._kinds(device)
        used_cuda = False
        if unavailable is None and self.bench_factory is None:
            from l2lightning.prefetch.plan import load_prefetch_kernels

            load_prefetch_kernels(device.index)  # a first NVRTC compile is not tuning time
        # Tuning both phases means a training step: its forward plan is measured in a forward +
        # backward graph. A plan measured in a forward-only graph did not transfer there (H200:
        # +4-6% forward-only, -20% and -46% once backward ran in the same graph).
        training = "backward" in phases
        with self._context(device, active=unavailable is None):
            for layer, count in shapes.values():
                shape_start = self.clock()
                for k, phase in enumerate(phases):
                    share = FORWARD_BUDGET_SHARE if (len(phases) == 2 and k == 0) else 1.0
                    deadline = shape_start + self.budget_s * share
                    context = "train" if (training and phase == "forward") else ""
                    row = self._row(layer, count, phase, context, device, deadline, l2, kinds, unavailable)
                    used_cuda |= row.measured and not row.from_cache and self.bench_factory is None
                    report.rows.append(row)
        if used_cuda:
            torch.cuda.empty_cache()  # hand the throwaway chains' memory back (their graphs are gone)
        return report

    # ------------------------------------------------------------ internals
    def _device_name(self, device: torch.device) -> str:
        if self.device_name:
            return self.device_name
        if device.type == "cuda" and torch.cuda.is_available():
            props = torch.cuda.get_device_properties(device)
            l2 = getattr(props, "L2_cache_size", 0) or 0
            return f"{props.name} ({props.multi_processor_count} SMs, {l2 / MIB:.0f} MiB L2)"
        return str(device)

    def _kinds(self, device: torch.device) -> tuple[str, ...]:
        if self.kinds is not None:
            return self.kinds
        if device.type == "cuda" and torch.cuda.is_available():
            from l2lightning.prefetch.plan import supported_kinds

            return supported_kinds(device.index or 0)
        return ("hint", "hint_last")  # every device that runs the hint kernel supports these

    def _unavailable_reason(self, device: torch.device) -> str | None:
        if self.bench_factory is not None:  # an injected bench measures wherever it likes
            return None
        if device.type != "cuda":
            return f"the layers are on {device}, not a CUDA GPU: nothing to measure"
        from l2lightning._env import prefetch_unavailable_reason

        reason = prefetch_unavailable_reason()
        if reason:
            return reason
        if torch.cuda.is_current_stream_capturing():
            return "called inside a CUDA graph capture (tuning needs its own captures and host syncs)"
        return None

    @contextlib.contextmanager
    def _context(self, device: torch.device, active: bool) -> Iterator[None]:
        """Around all measurements: the layer's device current, the RNG forked (random weights and
        graph replays must not move the model's RNG), inference mode off (backward graphs need grad)."""
        if not active or device.type != "cuda":
            with torch.random.fork_rng(devices=[]):
                yield
            return
        with (
            torch.cuda.device(device),
            torch.random.fork_rng(devices=[device.index]),
            torch.inference_mode(False),
        ):
            yield

    def _tuner_tag(self, kinds: Sequence[str]) -> str:
        """Short hash of the settings that shape a decision, so other settings do not reuse it."""
        space = (
            [c.to_dict() for c in self.candidates]
            if self.candidates is not None
            else ("staged", self.blocks, self.distances, tuple(kinds))
        )
        settings = (
            space,
            self.min_gain,
            self.confidence,
            self.block_rate,
            self.slack,
            self.budget_s,
            self.repeats,
        )
        return hashlib.sha1(repr(settings).encode()).hexdigest()[:10]

    def _row(
        self,
        layer: Layer,
        count: int,
        phase: str,
        context: str,
        device: torch.device,
        deadline: float,
        l2: int | None,
        kinds: tuple[str, ...],
        unavailable: str | None,
    ) -> TuningRow:
        start = self.clock()
        dtype = str(layer.weights[0].dtype).replace("torch.", "") if layer.weights else "none"
        row = TuningRow(
            shape=layer.shape_key,
            phase=phase,
            layer_bytes=layer.nbytes,
            dtype=dtype,
            layers=count,
            context=context,
        )
        if unavailable:
            row.reason = unavailable
            return row
        if layer.nbytes < self.min_layer_bytes:
            row.reason = f"layer of {layer.nbytes / 1024:.0f} KiB < {self.min_layer_bytes / 1024:.0f} KiB: not worth a launch"
            return row
        if l2 is not None and 2 * layer.nbytes > l2:
            row.reason = f"2 x {layer.nbytes / MIB:.1f} MiB does not fit in {l2 / MIB:.0f} MiB of L2"
            return row
        key = None
        if self.cache is not None:
            key = self.cache.key(
                device=self._device_name(device),
                shape=layer.shape_key,
                phase=f"{phase}@{context}" if context else phase,
                dtype=dtype,
                tuner=self._tuner_tag(kinds),
            )
            cached = self.cache.get(key)
            if cached is not None:
                try:
                    hit = TuningRow.from_dict(cached)
                except (TypeError, ValueError):
                    hit = None  # an entry from an incompatible layout: measure again and overwrite it
                if hit is not None:
                    hit.layers, hit.from_cache = count, True
                    hit.tuned_seconds, hit.seconds = hit.seconds or hit.tuned_seconds, self.clock() - start
                    return hit
        self._measure(row, layer, count, phase, context, device, start, deadline, l2, kinds)
        row.seconds = row.tuned_seconds = self.clock() - start
        if key is not None and row.measured:
            try:
                self.cache.put(key, row.to_dict())
            except OSError as exc:
                from l2lightning._env import warn_once

                warn_once(
                    "plan-cache-write", f"l2lightning: cannot write the plan cache {self.cache.path}: {exc}"
                )
        return row

    def _factory(self, context: str, count: int = 1) -> BenchFactory:
        if self.bench_factory is not None:
            return self.bench_factory  # a fake bench models whatever context it likes
        replays = self.replays
        l2 = self.l2_bytes

        def cuda_factory(layer: Layer, phase: str, device: torch.device) -> ShapeBench:
            return CudaShapeBench(
                layer,
                phase,
                device,
                replays=replays,
                l2_bytes=l2,
                training=context == "train",
                min_copies=count,
            )

        return cuda_factory

    def _measure(
        self,
        row: TuningRow,
        layer: Layer,
        count: int,
        phase: str,
        context: str,
        device: torch.device,
        start: float,
        deadline: float,
        l2: int | None,
        kinds: tuple[str, ...],
    ) -> None:
        try:
            bench = self._factory(context, count)(layer, phase, device)
        except SkipShape as exc:
            row.reason = str(exc)
            return
        except Exception as exc:  # a layer we cannot rebuild runs plain rather than failing the run
            row.reason = f"could not build a throwaway chain ({type(exc).__name__}: {exc})"
            return
        try:
            self._search(row, bench, layer, phase, start, deadline, l2, kinds)
        finally:
            bench.close()

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
        try:
            # Two plain samples: the first includes the capture and a cold start; the faster one
            # gives the op time that the issue-rate rule needs.
            t_plain = min(s.take(None), s.take(None))
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

        if self.candidates is not None:
            first = prune_candidates(self.candidates, layer.nbytes, l2, op_seconds, **rule)
            pool = self.candidates
        else:
            base_kind = "hint" if "hint" in kinds else kinds[0]
            pool = [make_plan(base_kind, b, min(self.distances)) for b in self.blocks]
            first = prune_candidates(pool, layer.nbytes, l2, op_seconds, **rule)
        if not first:
            why = next(r for c in pool if (r := ineligibility(c, layer.nbytes, l2, op_seconds, **rule)))
            row.reason = f"no candidate passes the L2 / issue-rate rule (e.g. {why})"
            row.samples = s.samples
            return
        alive = self._screen(s, first, gains, failed, stage_end[0])
        if self.candidates is None:
            measured = [c for c in first if gains.get(c)]
            base = max(measured, key=lambda c: _mean(gains[c]), default=None)
            # Flavours at the best block count, unless every block count clearly lost (the
            # 32 MiB case: every plan lost 3-400%; other kinds will not rescue it).
            if base is not None and mean_ci(gains[base], self.confidence).high >= 0:
                flavours = [make_plan(k, base.blocks, base.distance) for k in kinds if k != base.kind]
                flavours += [
                    make_plan(base.kind, base.blocks, d) for d in self.distances if d != base.distance
                ]
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


def _mean(values: Sequence[float]) -> float:
    return float(sum(values) / len(values)) if values else -math.inf


def _check_count(name: str, value: Any, low: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"`{name}` must be an int >= {low}, got {value!r}")


# ---------------------------------------------------------------------- the CUDA bench
class _ThrowawayChain(nn.Module):
    """Copies of one layer: run in sequence (``chain``: each copy's output feeds the next) or each on
    its own input (``fan``: for layers whose output cannot feed a copy of themselves, Linear d->4d)."""

    def __init__(self, layers: list[nn.Module], fan: bool) -> None:
        super().__init__()
        self.layers = nn.ModuleList(layers)
        self.fan = fan

    def forward(self, *xs: torch.Tensor) -> Any:
        if self.fan:
            return tuple(layer(x) for layer, x in zip(self.layers, xs))
        x = xs[0]
        for layer in self.layers:
            x = layer(x)
        return x


_HOOK_DICTS = (
    "_forward_hooks",
    "_forward_hooks_with_kwargs",
    "_forward_hooks_always_called",
    "_forward_pre_hooks",
    "_forward_pre_hooks_with_kwargs",
    "_backward_hooks",
    "_backward_pre_hooks",
)


def _fresh_copy(module: nn.Module, requires_grad: bool) -> nn.Module:
    """A deep copy of `module` with new random weights and no hooks (the model's tensors stay untouched)."""
    try:
        clone = copy.deepcopy(module)
    except Exception as exc:
        raise SkipShape(f"cannot deep-copy {type(module).__name__} ({type(exc).__name__}: {exc})") from exc
    for sub in clone.modules():
        # deepcopy carries hook dicts over (hook functions are shared, not copied): another
        # PrefetchHooks' hooks must not fire inside the throwaway chain.
        for attr in _HOOK_DICTS:
            hooks = getattr(sub, attr, None)
            if isinstance(hooks, dict):
                hooks.clear()
    with torch.no_grad():
        for name, p in clone.named_parameters():
            if not p.is_floating_point():
                continue
            if p.dim() >= 2:
                # fan-in scaling keeps activations O(1) through a chain of copies (no bf16 overflow)
                p.normal_(0.0, 1.0 / math.sqrt(max(1, p[0].numel())))
            else:
                # norm scales near 1, biases near 0
                p.normal_(1.0 if name.rsplit(".", 1)[-1] == "weight" else 0.0, 0.02)
            p.requires_grad_(requires_grad)
    return clone


def _loss_of(output: Any) -> torch.Tensor:
    terms = [
        t.float().square().mean()
        for t in _flatten_tensors(output)
        if t.is_floating_point() and t.requires_grad
    ]
    if not terms:
        raise SkipShape("no output of the layer needs a gradient: nothing to run backward on")
    return terms[0] if len(terms) == 1 else torch.stack(terms).sum()


MAX_COPIES = 32


def copies_for(layer_bytes: int, l2_bytes: int | None, low: int = 6, high: int = MAX_COPIES) -> int:
    """Copies in a throwaway chain: twice L2 worth of weights so each layer is evicted between
    replays, at least `low` (a steady state) and at most `high` (capture cost). Layers below
    L2 / 16 get a chain that may partly stay in L2: a conservative setting, which is where the
    measurements found no L2 effect anyway (d=768: the decoy gained as much as the plan)."""
    if l2_bytes is None or layer_bytes <= 0:
        return low
    return max(low, min(high, math.ceil(2 * l2_bytes / layer_bytes)))


@dataclass
class Throwaway:
    """A throwaway chain for one layer shape: the module, its inputs and how it is laid out."""

    model: nn.Module
    inputs: tuple[torch.Tensor, ...]
    phase: str
    mode: str  # "block", "chain" or "fan"
    copies: int
    names: list[str]  # the chain layers' names inside `model` (for a name -> plan mapping)
    steps: list[str]  # every chain step of `model` (the layers and small steps such as a LayerNorm)

    def plans(self, plan: PrefetchPlan, phase: str) -> dict[str, PrefetchPlan]:
        """`plan` on every layer of `names` for the `phase` ("forward"/"backward") prefetch, its
        distance counted in chain steps as the model's is (:func:`chain_step_plans`: block copies
        may hold small steps between the layers). A training-context forward plan runs in a
        backward-phase chain, hence `phase` apart from ``self.phase``."""
        targets = set(self.names)
        significant = [i for i, name in enumerate(self.steps) if name in targets]
        per_step = chain_step_plans(len(self.steps), significant, dict.fromkeys(significant, plan), phase)
        return {name: p for name, p in zip(self.steps, per_step) if p is not None}

    def zero_grads(self) -> None:
        """Grads to None (before each capture, so each graph allocates its .grad in its pool)."""
        for p in self.model.parameters():
            p.grad = None
        for x in self.inputs:
            if x.requires_grad:
                x.grad = None

    def run(self) -> Any:
        """One pass: forward under no_grad, or forward + mean-square loss + backward."""
        if self.phase == "forward":
            with torch.no_grad():
                return self.model(*self.inputs)
        with torch.enable_grad():
            loss = _loss_of(self.model(*self.inputs))
            loss.backward()
        return loss


def _random_input(proto: nn.Module, layer: Layer) -> torch.Tensor:
    device = layer.weights[0].device
    if isinstance(proto, (nn.Embedding, nn.EmbeddingBag)):
        return torch.randint(0, proto.num_embeddings, layer.input_shape, device=device)
    return torch.randn(layer.input_shape, device=device, dtype=layer.weights[0].dtype)


def build_throwaway(
    layer: Layer, phase: str, l2_bytes: int | None, *, max_bytes: int | None = None, min_copies: int = 1
) -> Throwaway:
    """Copies of the layer's block (``layer.block``, mode ``block``) or of ``layer.module`` with fresh
    random weights, on the layer's device, with random inputs.

    ``block`` mode when the layer sits in a block that maps its input to the same shape and dtype
    (LayerNorm, Linear, GELU): each block copy feeds the next, so the norm and activation kernels
    run between the layers as they do in the model. Otherwise copies of the lone layer: ``chain``
    mode when a copy maps its input to a tensor of the same shape and dtype (each copy feeds the
    next); ``fan`` mode otherwise (Linear d->4d: each copy reads its own input, and in backward
    each input is a leaf that needs grad, so every copy computes grad-input and reads its W as a
    mid-model layer does). `min_copies` (the model's layers of this shape) lengthens the chain up
    to 32 copies; `max_bytes` caps the copies' weight bytes (free GPU memory).

    Raises:
        SkipShape: the module cannot be copied or called on a random input of the recorded shape,
            or too little memory is free.
    """
    if phase not in PHASES:
        raise ValueError(f"`phase` must be one of {PHASES}, got {phase!r}")
    if layer.input_shape is None or not layer.weights:
        raise SkipShape("the layer's input shape is unknown (its first argument is not a tensor)")
    backward = phase == "backward"
    device = layer.weights[0].device
    if layer.block is not None and layer.block_input is not None:
        unit: nn.Module = layer.block
        shape, dtype = layer.block_input
        proto = _fresh_copy(unit, backward)
        x = torch.randn(shape, device=device, dtype=dtype)
    else:
        unit = layer.module
        proto = _fresh_copy(unit, backward)
        x = _random_input(proto, layer)
    try:
        with torch.no_grad():
            y = proto(x)
    except Exception as exc:
        raise SkipShape(
            f"a copy of {type(unit).__name__} failed on a random {tuple(x.shape)} input "
            f"({type(exc).__name__}: {exc})"
        ) from exc
    fan = not (isinstance(y, torch.Tensor) and y.shape == x.shape and y.dtype == x.dtype)
    del y
    n = max(copies_for(layer.nbytes, l2_bytes), min(min_copies, MAX_COPIES))
    if max_bytes is not None:
        n = min(n, max_bytes // max(1, layer.nbytes))
    if n < 2:
        raise SkipShape(
            f"not enough free memory for a throwaway chain of {layer.nbytes / MIB:.1f} MiB layers"
        )
    model = _ThrowawayChain([proto] + [_fresh_copy(proto, backward) for _ in range(n - 1)], fan)
    if fan and backward and x.is_floating_point():
        inputs: tuple[torch.Tensor, ...] = tuple(torch.randn_like(x).requires_grad_(True) for _ in range(n))
    elif fan:
        inputs = (x,) * n
    else:
        inputs = (x,)
    mode = "block" if unit is layer.block else ("fan" if fan else "chain")
    steps = [c.name for c in discover_chain(model, inputs)]
    if mode == "block":
        # the layer's place inside each block copy (its LayerNorm companions get no plan)
        inner = _module_name(layer.block, layer.module)
        names = [f"layers.{i}.{inner}" for i in range(n)]
    else:
        names = steps
    return Throwaway(model, inputs, phase, mode, n, names, steps)


def _module_name(block: nn.Module, module: nn.Module) -> str:
    """``module``'s dotted name inside ``block`` (a proper descendant)."""
    for name, sub in block.named_modules():
        if sub is module and name:
            return name
    raise SkipShape(f"{type(module).__name__} is not inside its recorded block {type(block).__name__}")


class CudaShapeBench:
    """Times one layer shape in one phase on the GPU, with CUDA graphs of a throwaway chain.

    The chain (:func:`build_throwaway`) holds `copies_for` copies of ``layer.module`` with random
    weights; one graph is captured per variant (plain, each plan, each decoy) on first use, all
    sharing one memory pool (graphs replay one at a time and write every pool tensor before
    reading it, so sharing is safe and memory stays at one graph's worth). Forward phase: a
    forward-only graph under no_grad. Backward phase: forward + ``out.float().square().mean()``
    + backward, grads set to None before each capture, the plan on the backward pass only.
    ``training=True`` (forward phase only): forward + backward graphs with the plan on the forward
    pass, as a training step runs it.
    Random weights draw from the RNG: :class:`Autotuner` forks it around all of this.

    Args:
        layer: the chain layer whose shape is measured (its module is deep-copied, never run).
        phase: ``"forward"`` or ``"backward"``.
        device: the CUDA device.
        replays: graph replays per sample (one sample = mean over them, timed by CUDA events).
        l2_bytes: the L2 size (default: what the device reports).
        training: measure a forward plan in forward + backward graphs.
        min_copies: the model's layers of this shape: the throwaway is at least as long (up to
            32), so what builds up along a chain (lines an evict_last prefetch keeps) shows.
    """

    def __init__(
        self,
        layer: Layer,
        phase: str,
        device: torch.device,
        *,
        replays: int = 5,
        l2_bytes: int | None = None,
        training: bool = False,
        min_copies: int = 1,
    ) -> None:
        from l2lightning.prefetch.plan import load_prefetch_kernels

        self.device = torch.device(
            "cuda", device.index if device.index is not None else torch.cuda.current_device()
        )
        self.replays = replays
        self.graphs: dict[tuple[PrefetchPlan | None, bool], tuple[Any, Any, PrefetchHooks | None]] = {}
        load_prefetch_kernels(self.device.index)  # NVRTC and module loading must not happen inside a capture
        l2 = l2_bytes if l2_bytes is not None else device_l2_bytes(self.device)
        free, _ = torch.cuda.mem_get_info(self.device.index)
        # A training-context forward phase runs forward + backward graphs (prefetch in forward only).
        graph_phase = "backward" if training else phase
        # weights (x3 in backward: grads and allocator slack) within 40% of the free memory
        max_bytes = int(0.4 * free) // (3 if graph_phase == "backward" else 1)
        self.chain = build_throwaway(layer, graph_phase, l2, max_bytes=max_bytes, min_copies=min_copies)
        self.phase = phase
        self.copies = self.chain.copies
        self.mode = self.chain.mode
        self.pool = torch.cuda.graph_pool_handle()
        self._start = torch.cuda.Event(enable_timing=True)
        self._end = torch.cuda.Event(enable_timing=True)
        self._warm_up()

    def _warm_up(self) -> None:
        # Eager passes on a side stream before any capture (cuBLAS handles/workspaces, lazy init).
        main = torch.cuda.current_stream(self.device)
        side = torch.cuda.Stream(device=self.device)
        side.wait_stream(main)
        with torch.cuda.stream(side):
            for _ in range(2):
                self.chain.zero_grads()
                self.chain.run()
        main.wait_stream(side)
        torch.cuda.synchronize(self.device)

    def _graph(self, plan: PrefetchPlan | None, decoy: bool) -> Any:
        key = (plan, decoy)
        if key in self.graphs:
            return self.graphs[key][0]
        hooks = None
        chain = self.chain
        if plan is not None:
            plans = chain.plans(plan, self.phase)
            if self.phase == "forward":
                hooks = PrefetchHooks(chain.model, chain.inputs, backward=False, plans=plans, decoy=decoy)
            else:
                hooks = PrefetchHooks(
                    chain.model, chain.inputs, backward=True, plans={}, backward_plans=plans, decoy=decoy
                )
        try:
            chain.zero_grads()
            graph = torch.cuda.CUDAGraph()
            with graph_capture(graph, pool=self.pool):
                out = chain.run()
        finally:
            if hooks is not None:
                hooks.remove()  # the launches are recorded in the graph; the hooks are done
        graph.replay()  # warm-up replay before any timing
        torch.cuda.synchronize(self.device)
        self.graphs[key] = (graph, out, hooks)
        return graph

    def sample(self, plan: PrefetchPlan | None, decoy: bool = False) -> float:
        """Seconds per replay, averaged over `replays` back-to-back replays timed by CUDA events."""
        graph = self._graph(plan, decoy)
        stream = torch.cuda.current_stream(self.device)
        self._start.record(stream)
        for _ in range(self.replays):
            graph.replay()
        self._end.record(stream)
        self._end.synchronize()
        return self._start.elapsed_time(self._end) * 1e-3 / self.replays

    def close(self) -> None:
        """Drop graphs, throwaway weights and the pool (their memory returns to the allocator)."""
        torch.cuda.synchronize(self.device)
        self.graphs.clear()
        self.chain = None
        self.pool = None


# ---------------------------------------------------------------------- PrefetchHooks(plans="auto")
def tune_hooks(hooks: PrefetchHooks, tune_forward: bool, tune_backward: bool) -> TuningReport:
    """Tune `hooks.chain` for ``PrefetchHooks(..., plans="auto")`` (called before the hooks are installed).

    Uses the default :class:`Autotuner` (0.6 s per shape, the on-disk plan cache). The caller maps
    the result with ``report.plans_for(hooks.chain, "forward" / "backward")``.
    """
    phases = tuple(p for p, on in (("forward", tune_forward), ("backward", tune_backward)) if on)
    if not phases:
        return TuningReport()
    return Autotuner().tune(hooks.chain, hooks.device, phases)
