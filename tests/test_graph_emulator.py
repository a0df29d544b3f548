"""The CPU stand-in for CUDA graphs (tests/graph_emulator.py) replays what it recorded, as a graph would."""

from __future__ import annotations

import torch
from torch import nn

from tests import graph_emulator as emu


def test_an_in_place_metadata_op_after_an_op_does_not_change_what_the_replay_of_that_op_writes():
    """A CPU `nn.GRU(batch_first=True)` ends with `transpose_` on the output it stacked: the replay
    of the stack once copied into the transposed object and failed (found with a sequence-length
    curriculum module under the callback)."""
    torch.manual_seed(0)
    rnn = nn.GRU(4, 5, batch_first=True)
    x = torch.randn(2, 3, 4)
    static = x.clone()
    graph = emu.FakeGraph()
    with torch.no_grad():
        with emu.emulated_graph_capture(graph):
            out, h = rnn(static)
        for seed in (1, 2):
            static.copy_(torch.randn(2, 3, 4, generator=torch.Generator().manual_seed(seed)))
            graph.replay()
            want, want_h = rnn(static)
            assert torch.equal(out, want) and torch.equal(h, want_h)
