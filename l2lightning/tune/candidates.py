"""The candidate plans the tuner races, and the rule that prunes them before any timing.

The rule is the one the H200 measurements support: the current and the next ``distance`` layers
must fit in L2 together, and the prefetch must be able to finish within the layer's op time at
`BLOCK_PREFETCH_RATE` per block (with `RATE_SLACK`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from l2lightning.prefetch.plan import MIB, PrefetchPlan

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
