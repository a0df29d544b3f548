"""How decode work is timed: CUDA-event samples of graph replays, variants interleaved.

Every decode measurement (the attention chooser, the step report, the benchmarks) times the same
way, so their numbers compare: the GPU is kept busy while the host enqueues a sample
(:func:`queue_ahead`), and variants take turns within each round with the first place rotating
(:func:`rotated`), so that clock drift and a variant that warms the L2 for the next one spread over
all variants instead of favouring one.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch


def queue_ahead(cycles: int = 100_000) -> None:
    """Keep the GPU busy (~50 µs) while the host enqueues the next timed region, so that the start
    event fires when the work starts rather than when the host got around to submitting it."""
    sleep = getattr(torch.cuda, "_sleep", None)
    if sleep is not None:
        sleep(cycles)


def rotated(labels: Sequence[str], round_index: int) -> list[str]:
    """`labels` in order, starting at position ``round_index % len(labels)``: who goes first rotates."""
    if not labels:
        return []
    k = round_index % len(labels)
    return [*labels[k:], *labels[:k]]


def time_graph_replays(
    graphs: Mapping[str, torch.cuda.CUDAGraph],
    *,
    rounds: int,
    calls_per_replay: int,
    device: torch.device,
    before_replay: Mapping[str, Callable[[], None]] | None = None,
) -> dict[str, list[float]]:
    """µs per call of each graph: `rounds` samples of one replay each (a replay holds
    `calls_per_replay` calls), graphs interleaved within a round, each replay after its
    `before_replay` host work (if any) and :func:`queue_ahead`. All samples are enqueued before
    one synchronisation at the end."""
    order = list(graphs)
    events = {
        label: [
            (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
            for _ in range(rounds)
        ]
        for label in order
    }
    with torch.cuda.device(device):
        for r in range(rounds):
            for label in rotated(order, r):
                start, end = events[label][r]
                if before_replay and label in before_replay:
                    before_replay[label]()
                queue_ahead()
                start.record()
                graphs[label].replay()
                end.record()
        torch.cuda.synchronize(device)
    return {
        label: [s.elapsed_time(e) * 1000.0 / calls_per_replay for s, e in events[label]] for label in order
    }


def time_steps(
    session: Any, cached: int, tokens: torch.Tensor | None, steps: int, *, queue_cycles: int = 0
) -> float:
    """µs per step of one sample: `steps` back-to-back steps of a decode session from `cached`
    tokens on (next input `tokens`), between two CUDA events. With `queue_cycles` the GPU is kept
    busy that long first (:func:`queue_ahead`), so no host submission gap is timed."""
    session.set_length(cached, tokens)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    if queue_cycles:
        queue_ahead(queue_cycles)
    start.record()
    for _ in range(steps):
        session.step()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1000 / steps


def median_step_us(
    session: Any, cached: int, tokens: torch.Tensor | None, *, steps: int = 8, rounds: int = 5
) -> float:
    """Median µs per step of `rounds` samples of `steps` graph replays from `cached` tokens on;
    every length bucket the samples touch is captured first, outside the timing."""
    for j in range(steps):
        session.graph_for(cached + j)
    return statistics.median(time_steps(session, cached, tokens, steps) for _ in range(rounds))
