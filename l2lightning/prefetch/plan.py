"""Prefetch plans: what one L2 prefetch does, and which plan each layer of a chain gets.

A plan says how to warm L2 with a tensor's bytes: which kernel (`hint`: `prefetch.global.L2` per
`stride` bytes; `bulk`: `cp.async.bulk.prefetch.L2` per `chunk` bytes, sm_90+), with or without
the `evict_last` priority, how many blocks and threads, and how many layers ahead (`distance`) the
hooks aim it. The measurements on the H200 showed one block cannot keep up with a 4.5 MiB+ layer
(−60…−412%), so the default plan grows its block count with the layer's bytes.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

KINDS = ("hint", "hint_last", "bulk", "bulk_last")
MIB = 1 << 20


@dataclass(frozen=True)
class PrefetchPlan:
    """How to prefetch one layer's weights into L2.

    Args:
        kind: ``"hint"`` (``prefetch.global.L2``), ``"hint_last"`` (its ``::evict_last`` flavour),
            ``"bulk"`` (``cp.async.bulk.prefetch.L2``, sm_90+) or ``"bulk_last"`` (bulk with an
            ``evict_last`` cache policy).
        blocks: grid size, 1 to 1024.
        threads: threads per block, a multiple of 32 from 32 to 1024.
        stride: bytes between two hint prefetches (a power of two from 32 to 4096; 128 = one L2 line
            group). Used by the hint kinds.
        chunk: bytes per bulk prefetch (a multiple of 16, 16 B to 1 MiB). Used by the bulk kinds.
        distance: how many layers ahead the hooks aim (1 = the next layer), 1 to 8.

    Example:
        >>> PrefetchPlan(kind="hint", blocks=8)
        PrefetchPlan(kind='hint', blocks=8, threads=256, stride=128, chunk=32768, distance=1)
    """

    kind: str = "hint"
    blocks: int = 8
    threads: int = 256
    stride: int = 128
    chunk: int = 32768
    distance: int = 1

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"`kind` must be one of {KINDS}, got {self.kind!r}")
        _check_int("blocks", self.blocks, 1, 1024)
        _check_int("threads", self.threads, 32, 1024)
        if self.threads % 32:
            raise ValueError(f"`threads` must be a multiple of 32 (a whole warp), got {self.threads}")
        _check_int("stride", self.stride, 32, 4096)
        if self.stride & (self.stride - 1):
            raise ValueError(f"`stride` must be a power of two, got {self.stride}")
        _check_int("chunk", self.chunk, 16, MIB)
        if self.chunk % 16:
            raise ValueError(
                f"`chunk` must be a multiple of 16 bytes (bulk prefetch granularity), got {self.chunk}"
            )
        _check_int("distance", self.distance, 1, 8)

    @property
    def is_bulk(self) -> bool:
        return self.kind.startswith("bulk")

    @property
    def label(self) -> str:
        """Short name for tables, e.g. ``hint8`` or ``bulk_last16@d2``."""
        suffix = f"@d{self.distance}" if self.distance != 1 else ""
        return f"{self.kind}{self.blocks}{suffix}"

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> PrefetchPlan:
        unknown = set(data) - {f.name for f in dataclasses.fields(cls)}
        if unknown:
            raise ValueError(f"unknown PrefetchPlan fields {sorted(unknown)}")
        return cls(**data)


def _check_int(name: str, value: Any, low: int, high: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"`{name}` must be an int, got {type(value).__name__}")
    if not low <= value <= high:
        raise ValueError(f"`{name}` must be in [{low}, {high}], got {value}")


def default_plan(layer_bytes: int, l2_bytes: int | None = None) -> PrefetchPlan | None:
    """The plan used before (or without) autotuning, sized by the layer's bytes.

    None for layers too small to be worth a launch (< 256 KiB) and for layers so large that the
    current and next layer cannot both sit in L2 (the measured rule: 32 MiB layers on a 60 MiB L2
    always lost).
    """
    if layer_bytes < 256 * 1024:
        return None
    if l2_bytes is not None and 2 * layer_bytes > l2_bytes:
        return None
    if layer_bytes < 2 * MIB:
        return PrefetchPlan(kind="hint", blocks=4)
    if layer_bytes <= 16 * MIB:
        return PrefetchPlan(kind="hint", blocks=8)
    return PrefetchPlan(kind="hint", blocks=16)


# A setting for the hooks' plans: None or "default" (sized by layer bytes), "off" (no prefetch),
# "auto" (tuned; resolved by l2lightning.prefetch.hooks), one plan for every layer large enough,
# or layer name -> plan (None: that layer runs plain).
PlansArg = None | str | PrefetchPlan | Mapping[str, PrefetchPlan | None]
PLAN_SETTINGS = ("default", "off", "auto")


def check_plans_arg(name: str, value: Any) -> None:
    """Raise unless `value` is a plans setting (see `PlansArg`); `name` is the argument's name."""
    if value is None or isinstance(value, PrefetchPlan):
        return
    if isinstance(value, str) and value in PLAN_SETTINGS:
        return
    if isinstance(value, Mapping):
        for key, plan in value.items():
            if plan is not None and not isinstance(plan, PrefetchPlan):
                raise TypeError(
                    f"`{name}[{key!r}]` must be a PrefetchPlan or None, got {type(plan).__name__}"
                )
        return
    raise ValueError(
        f"`{name}` must be None, 'auto', 'default', 'off', a PrefetchPlan or a mapping of layer name to "
        f"PrefetchPlan; got {value!r}"
    )


def layer_plans(
    chain: Sequence[Any], plans: PlansArg, l2_bytes: int | None, name: str = "plans"
) -> list[PrefetchPlan | None]:
    """One plan (or None) per chain layer for an explicit setting: None/"default", "off", a plan or a
    mapping. `chain` holds :class:`~l2lightning.prefetch.chain.Layer` objects (their name and bytes)."""
    if plans is None or plans == "default":
        return [default_plan(layer.nbytes, l2_bytes) for layer in chain]
    if plans == "off":
        return [None] * len(chain)
    if isinstance(plans, PrefetchPlan):
        return [plans if default_plan(layer.nbytes, l2_bytes) is not None else None for layer in chain]
    if not isinstance(plans, Mapping):
        raise ValueError(f"`{name}` must be resolved to plans before this point, got {plans!r}")
    known = {layer.name for layer in chain}
    unknown = sorted(set(plans) - known)
    if unknown:
        raise ValueError(
            f"`{name}` names layers that are not in the chain: {unknown}; chain layers: {sorted(known)}"
        )
    return [plans.get(layer.name) for layer in chain]
