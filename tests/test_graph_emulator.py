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


def test_an_lstm_replayed_with_another_hidden_state_gets_the_eager_gradients(monkeypatch):
    """The state a recurrent model carries between steps is copied into the memory the graph read
    before each replay. oneDNN's CPU LSTM (mkldnn_rnn_layer and its backward), replayed so, gave other
    weight gradients than the eager step (2.3e-3 apart), where a CUDA graph of cuDNN's LSTM gives the
    eager ones (the word language model is bitwise its baseline on the H200): install() turns oneDNN
    off, and the replay equals the eager step."""
    emu.install(monkeypatch.setattr)
    assert not torch.backends.mkldnn.enabled
    torch.manual_seed(0)
    lstm = nn.LSTM(8, 16)
    x, h0, c0 = torch.randn(5, 4, 8), torch.randn(1, 4, 16), torch.randn(1, 4, 16)

    def step():
        lstm.zero_grad(set_to_none=True)
        out, (h, c) = lstm(x, (h0, c0))
        out.square().mean().backward()
        return out, h, c, lstm.weight_ih_l0.grad, lstm.weight_hh_l0.grad

    graph = emu.FakeGraph()
    with emu.emulated_graph_capture(graph):
        replayed = step()
    for seed in (1, 2):
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            h0.copy_(torch.randn(1, 4, 16, generator=g))
            c0.copy_(torch.randn(1, 4, 16, generator=g))
        graph.replay()
        got = [t.detach().clone() for t in replayed]
        assert all(torch.equal(a, b) for a, b in zip(got, step()))
