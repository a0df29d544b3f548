"""The tuner's result: one row per (layer shape, phase) with the decision, its evidence and its table.

A :class:`TuningReport` maps back onto a chain (:meth:`TuningReport.plans_for`), is what the plan
cache stores, and is what ``L2GraphCallback(report=True)`` prints.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from l2lightning.prefetch.chain import Layer
from l2lightning.prefetch.plan import MIB, PrefetchPlan
from l2lightning.tune.candidates import MIN_LAYER_BYTES, PHASES, chain_step_plans


@dataclass
class TuningRow:
    """The decision for one (layer shape, phase).

    ``plain_us`` is the time of one layer op in the plain throwaway graph (replay time / copies);
    ``plan`` is the best measured plan whether or not it was kept (``chosen``); ``gain``, ``ci_low``,
    ``ci_high`` and ``decoy_gain`` come from the confirmation rounds (``1 - t/t_plain``);
    ``held_bytes`` is what the throwaway chain held (:mod:`l2lightning.tune.memory`'s estimate, 0
    when none was built: a rule, a cache hit, a memory budget too small).
    """

    shape: str
    phase: str
    layer_bytes: int
    dtype: str = ""
    layers: int = 1  # chain layers sharing this shape
    copies: int = 0
    held_bytes: int = 0
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
    # The memory bound on throwaway chains: the multiple of `model_bytes` (None: no bound), in bytes,
    # and the most the chains held at once.
    memory_budget: float | None = None
    memory_budget_bytes: int | None = None
    model_bytes: int = 0
    memory_peak_bytes: int = 0

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

    def held_bytes_per_shape(self) -> dict[str, int]:
        """Bytes each shape's throwaway chains held in this run: the larger of its phases' (they run
        one after the other, each chain freed before the next)."""
        out: dict[str, int] = {}
        for r in self.rows:
            out[r.shape] = max(out.get(r.shape, 0), r.held_bytes)
        return out

    def to_dict(self) -> dict[str, Any]:
        return {
            "device": self.device,
            "min_layer_bytes": self.min_layer_bytes,
            "budget_s": self.budget_s,
            "min_gain": self.min_gain,
            "confidence": self.confidence,
            "memory_budget": self.memory_budget,
            "memory_budget_bytes": self.memory_budget_bytes,
            "model_bytes": self.model_bytes,
            "memory_peak_bytes": self.memory_peak_bytes,
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
            "held MiB",
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
                    f"{r.held_bytes / MIB:.1f}" if r.held_bytes else "-",
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
        memory = (
            f"; copies held <= {self.memory_budget_bytes / MIB:.1f} MiB, at most {self.memory_peak_bytes / MIB:.1f}"
            if self.memory_budget_bytes is not None
            else ""
        )
        title = (
            f"l2lightning autotune on {self.device or '?'} "
            f"(keep: {pct} of gain > {self.min_gain:+.0%} and beats decoy{memory})"
        )
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
