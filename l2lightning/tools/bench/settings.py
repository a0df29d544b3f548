"""What ``l2lightning bench`` times and how: :class:`BenchSettings`, checked when it is made.

The command line fills it (:mod:`l2lightning.tools.bench.args`) and every case, runner and row reads
it; checking every value here means a bad one stops the harness before the doctor and the criteria
run, naming the option. Importing it needs no torch, so the CLI builds its parser quickly.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from l2lightning import floors as floors_module
from l2lightning.tools.bench.variants import (
    ALL_VARIANTS,
    CHAIN_VARIANTS,
    FAMILY_DEFAULT_VARIANTS,
    LIGHTNING_VARIANTS,
    OPTIMIZER_IMPLS,
)

DEFAULT_RESULTS_ROOT = Path("benchmarks") / "results"
DEFAULT_CRITERIA = Path("benchmarks") / "criteria.yaml"


@dataclass
class BenchSettings:
    """What to time and how (the CLI fills it; see ``l2lightning bench --help``)."""

    models: list[tuple[int, int]] = field(default_factory=lambda: [(1536, 40)])
    # model families (names of l2lightning.app.models.FAMILIES), each timed at every batch size
    families: list[str] = field(default_factory=list)
    batches: list[int] = field(default_factory=lambda: [4, 8, 16, 64])
    chains: list[str] = field(default_factory=lambda: ["step", "forward_backward", "forward"])
    variants: list[str] | None = None
    dtype: str = "bfloat16"
    repeats: int = 10
    steps: int = 30
    warmup: int = 3
    lightning_skip: int = 8
    prefetch: str = "auto"
    lr: float = 1e-4
    # AdamW implementation for every variant: "fused" (one pass over the state per step) or
    # "foreach" (about a dozen multi-tensor passes, which dominated the captured step on the H200)
    optimizer: str = "fused"
    device: int = 0
    criteria: Path | None = None
    out: Path | None = None
    force: bool = False
    quick: bool = False
    doctor_load_seconds: float = 0.6

    def __post_init__(self) -> None:
        if not self.models and not self.families:
            raise ValueError(
                "no model configuration: give `--models` (or `--widths`/`--depths`) or `--families`"
            )
        if self.families:
            known = family_names()
            unknown_families = [f for f in self.families if f not in known]
            if unknown_families:
                raise ValueError(f"unknown model families {unknown_families}; known: all, {', '.join(known)}")
        for w, d in self.models:
            if w < 1 or d < 1:
                raise ValueError(f"model widths and depths must be >= 1, got {w}x{d}")
        if not self.batches or any(b < 1 for b in self.batches):
            raise ValueError(f"batches must be >= 1, got {self.batches}")
        unknown = [c for c in self.chains if c not in CHAIN_VARIANTS]
        if unknown or not self.chains:
            raise ValueError(f"unknown chains {unknown}; known: {list(CHAIN_VARIANTS)}")
        if self.variants is not None:
            bad = [v for v in self.variants if v not in ALL_VARIANTS]
            if bad:
                raise ValueError(f"unknown variants {bad}; known: {list(ALL_VARIANTS)}")
        if self.repeats < 1 or self.steps < 1 or self.warmup < 0 or self.lightning_skip < 1:
            raise ValueError("repeats and steps must be >= 1, warmup >= 0, lightning skip >= 1")
        if self.optimizer not in OPTIMIZER_IMPLS:
            raise ValueError(f"optimizer must be one of {OPTIMIZER_IMPLS}, got {self.optimizer!r}")
        if self.prefetch not in ("auto", "default"):
            raise ValueError(f"prefetch must be 'auto' or 'default', got {self.prefetch!r}")
        floors_module.dtype_bytes(self.dtype)  # raises on an unknown dtype

    def variants_for(self, chain: str) -> list[str]:
        return [v for v in CHAIN_VARIANTS[chain] if self.variants is None or v in self.variants]

    def family_variants(self) -> list[str]:
        """The variants a family case runs: Lightning ones only (the rest time the harness's own MLP).

        By default lightning_eager, callback_off and callback_auto; callback_decoy, a control, only
        when ``--variants`` names it.
        """
        if self.variants is None:
            return list(FAMILY_DEFAULT_VARIANTS)
        return [v for v in LIGHTNING_VARIANTS if v in self.variants]


def family_names() -> tuple[str, ...]:
    """The model families, in ``l2lightning.app.models.FAMILIES`` order (importing it imports Lightning)."""
    from l2lightning.app.models import FAMILIES

    return tuple(FAMILIES)


class RunInfo(Protocol):
    """What a case's result row reads of the runner that timed it (``Runner.info``): typed here, so
    that the cases and the results need not import the runners, which import the cases."""

    info: dict[str, Any]
