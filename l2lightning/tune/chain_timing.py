"""Capturing a layer chain as one graph and timing graphs interleaved: shared by tests and benchmarks.

The autotuner's GPU test and `benchmarks/bench_autotune.py` both time the same chain plain and with
tuned plans; this is the one place that says how (warm-up on a side stream, grads set to None
before capture, CUDA-event timing with the replay order rotated every round so drift hits every
variant alike).
"""

from __future__ import annotations

import torch
from torch import nn

from l2lightning.graph.capture import graph_capture


def capture_chain(
    model: nn.Module, x: torch.Tensor, backward: bool
) -> tuple[torch.cuda.CUDAGraph, list[torch.Tensor]]:
    """A graph of ``model(x)`` (no_grad), or of forward + mean-square loss + backward.

    Returns the graph and the tensors its replays write (output or loss, then the gradients): keep
    them alive as long as the graph, and compare them to check two graphs compute the same bits.
    """

    def body() -> torch.Tensor:
        if not backward:
            with torch.no_grad():
                return model(x)
        loss = model(x).float().square().mean()
        loss.backward()
        return loss

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up on a side stream, PyTorch's rule for capturing backward
        for _ in range(2):
            model.zero_grad(set_to_none=True)
            body()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    model.zero_grad(set_to_none=True)  # grads allocated inside the capture, in the graph's pool
    graph = torch.cuda.CUDAGraph()
    with graph_capture(graph):
        out = body()
    graph.replay()
    torch.cuda.synchronize()
    written = [out] + [p.grad for p in model.parameters() if p.grad is not None]
    model.zero_grad(set_to_none=True)  # the next capture allocates its own grads
    return graph, written


def interleaved_replay_us(
    graphs: list[torch.cuda.CUDAGraph], rounds: int = 15, replays: int = 10
) -> list[list[float]]:
    """Per-replay µs of each graph, one sample per round; the order rotates every round."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times: list[list[float]] = [[] for _ in graphs]
    for r in range(rounds):
        order = list(range(len(graphs)))
        order = order[r % len(order) :] + order[: r % len(order)]
        for i in order:
            start.record()
            for _ in range(replays):
                graphs[i].replay()
            end.record()
            end.synchronize()
            times[i].append(start.elapsed_time(end) * 1e3 / replays)
    return times
