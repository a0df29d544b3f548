"""l2lightning.prefetch.ops: the custom-op points call their owner, pass values and gradients through."""

from __future__ import annotations

import gc

import torch

from l2lightning.prefetch import ops


class Owner:
    def __init__(self) -> None:
        self.calls: list[tuple[str, int]] = []

    def _on_forward_point(self, layer: int) -> None:
        self.calls.append(("forward", layer))

    def _on_backward_point(self, layer: int) -> None:
        self.calls.append(("backward", layer))


def test_points_are_identities_that_call_their_owner_in_forward_and_backward():
    owner = Owner()
    owner_id = ops.register(owner)
    token = torch.zeros(1)
    try:
        x = torch.randn(3, 4, requires_grad=True)
        y = ops.point_in(x, token, owner_id, 2)
        z = ops.point_out(y * 2, token, owner_id, 5)
        assert torch.equal(y, x) and torch.equal(z, x * 2)
        assert owner.calls == [("forward", 2)]
        z.sum().backward()
        assert owner.calls == [("forward", 2), ("backward", 5)]
        assert torch.equal(x.grad, torch.full_like(x, 2.0))
    finally:
        ops.unregister(owner_id)


def test_owners_are_held_weakly_and_unregistered_ids_are_ignored():
    owner = Owner()
    owner_id = ops.register(owner)
    other_id = ops.register(Owner())
    assert other_id != owner_id
    gc.collect()  # the second owner is gone: its points must do nothing
    token = torch.zeros(1)
    ops.point_in(torch.ones(2), token, other_id, 0)
    ops.unregister(owner_id)
    ops.point_in(torch.ones(2), token, owner_id, 0)
    assert owner.calls == []
