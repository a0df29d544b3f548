"""The batch a replay reads and copies: read_batch's shortcut for plain tuples, lists and dicts of
tensors gives the general signature, and the static batch's copy gives the batch's bits."""

from __future__ import annotations

import collections
import dataclasses

import pytest
import torch

from l2lightning.graph.capture import (
    StaticBatch,
    flatten_batch,
    read_batch,
    read_signature,
)
from l2lightning.guards.batch_reads import BatchReads

Pair = collections.namedtuple("Pair", "x y")


@dataclasses.dataclass
class Sample:
    x: torch.Tensor
    name: str


class TupleOfOwn(tuple):
    pass


def _batches() -> list:
    x, y = torch.randn(4, 3), torch.arange(4)
    return [
        x,
        (x, y),
        [x, y],
        (),
        [x],
        {"x": x, "y": y},
        {"y": y, "x": x},  # the keys' order is part of the structure
        (x, y, "file.png"),
        [x, 3],
        {"x": x, "id": 7},
        {"x": x, "nested": (y, y)},
        ((x, y), y),
        Pair(x, y),
        TupleOfOwn((x, y)),
        collections.OrderedDict(x=x, y=y),
        collections.defaultdict(list, x=x),
        Sample(x, "a"),
        (x.half(), y.int(), x.t()),
        (torch.nn.Parameter(x),),
    ]


@pytest.mark.parametrize("everything", [True, False])
@pytest.mark.parametrize("index", range(len(_batches())))
def test_read_batch_equals_the_general_signature_and_tensors(index: int, everything: bool) -> None:
    batch = _batches()[index]
    # a step that reads only the first part: the values of the others leave the signature
    reads = BatchReads() if everything else BatchReads(items=frozenset({0, "x"}), everything=False)
    tensors, spec = flatten_batch(batch)
    expected = read_signature(batch, tensors, spec, reads)
    got_tensors, got = read_batch(batch, reads)
    assert got == expected
    assert len(got_tensors) == len(tensors)
    assert all(a is b for a, b in zip(got_tensors, tensors))


def test_read_batch_tells_apart_what_the_general_signature_tells_apart() -> None:
    x, y = torch.randn(4, 3), torch.arange(4)
    reads = BatchReads()
    signatures = [
        read_batch(b, reads)[1]
        for b in (
            (x, y),
            [x, y],
            (x,),
            (y, x),
            (x, y[:2]),
            (x.double(), y),
            {"x": x, "y": y},
            {"y": y, "x": x},
            {"x": x, "z": y},
            Pair(x, y),
            TupleOfOwn((x, y)),
        )
    ]
    assert len(set(signatures)) == len(signatures)


def test_copy_tensors_copies_every_tensor_bit_for_bit() -> None:
    batch = (
        torch.randn(4, 3),
        torch.randint(0, 9, (4,)),
        torch.randn(5, 2).half(),
        torch.tensor([float("nan"), -0.0, float("inf")]),
    )
    static = StaticBatch(batch)
    new = (
        torch.randn(3, 4).t(),  # not contiguous: copied by value all the same
        torch.randint(0, 9, (4,)),
        torch.randn(5, 2).half(),
        torch.tensor([-float("inf"), 0.0, float("nan")]),
    )
    addresses = [t.data_ptr() for t in static.tensors]
    static.copy_tensors(read_batch(new, static.reads)[0])
    for dst, src in zip(static.tensors, new):
        assert dst.dtype == src.dtype
        assert torch.equal(dst.view(torch.uint8), src.contiguous().view(torch.uint8))
    assert [t.data_ptr() for t in static.tensors] == addresses  # the graph's buffers stay in place


def test_copy_tensors_of_one_tensor() -> None:
    static = StaticBatch(torch.zeros(3))
    static.copy_tensors([torch.tensor([1.0, 2.0, 3.0])])
    assert static.tensors[0].tolist() == [1.0, 2.0, 3.0]


def test_a_batch_on_several_devices_is_copied_one_tensor_at_a_time(monkeypatch):
    """Only a batch whose tensors share a device takes the one foreach copy."""
    calls = []
    foreach = torch._foreach_copy_
    monkeypatch.setattr(torch, "_foreach_copy_", lambda *a, **k: calls.append(len(a[0])) or foreach(*a, **k))
    mixed = StaticBatch((torch.zeros(2), torch.zeros(2, device="meta")))
    mixed.copy_tensors([torch.ones(2), torch.ones(2, device="meta")])
    assert calls == [] and mixed.tensors[0].tolist() == [1.0, 1.0]
    one_device = StaticBatch((torch.zeros(2), torch.zeros(3)))
    one_device.copy_tensors([torch.ones(2), torch.full((3,), 2.0)])
    assert calls == [2] and one_device.tensors[1].tolist() == [2.0, 2.0, 2.0]
