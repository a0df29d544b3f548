"""PrefetchSequential on the CPU: the same bits as nn.Sequential, hooks found on the first call."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from l2lightning.prefetch.sequential import PrefetchSequential


def blocks(n: int = 4, d: int = 32) -> list[nn.Module]:
    torch.manual_seed(0)
    return [nn.Sequential(nn.LayerNorm(d), nn.Linear(d, d), nn.GELU()) for _ in range(n)]


def test_same_output_as_nn_sequential_and_the_chain_is_found_on_the_first_call():
    layers = blocks()
    plain = nn.Sequential(*layers)
    seq = PrefetchSequential(layers, plans=None)
    x = torch.randn(2, 32)
    assert seq.hooks is None
    y = seq(x)
    assert seq.hooks is not None
    assert [layer.name for layer in seq.hooks.chain] == [f"layers.{i}.1" for i in range(4)]
    assert torch.equal(y, plain(x))
    y.sum().backward()  # backward works with the hooks in place
    seq.remove_prefetch()
    assert not seq.hooks.enabled
    assert torch.equal(seq(x), plain(x))


def test_an_example_input_installs_at_construction():
    seq = PrefetchSequential(blocks(2), example_input=torch.randn(2, 32), plans=None)
    assert seq.hooks is not None and len(seq.hooks.chain) == 2


def test_no_modules_is_an_error():
    with pytest.raises(ValueError, match="`modules`"):
        PrefetchSequential([])
