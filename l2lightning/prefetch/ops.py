"""Prefetch points as custom ops, so `torch.compile` keeps them inside one compiled graph.

The hook path (hooks.py) calls CuPy from Python hooks; under `torch.compile` every such hook is a
graph break, which splits inductor's fusion regions. Here each chain layer instead gets two
identity autograd functions that dynamo traces into the graph:

* `point_in` on the layer's input: its forward runs the op `l2lightning::forward_point`, which (at
  run time, not at trace time) issues the forward prefetches scheduled at that layer and records the
  layer as part of this pass;
* `point_out` on the layer's output: its backward runs `l2lightning::backward_point` just before the
  layer's backward, which issues W_{i-distance} for backward.

Both ops "mutate" a one-element token tensor. Nothing is written to it; the declared mutation is
the side effect that keeps the compiler from dropping an op with no outputs, and the activation
passed alongside orders the op after the value it is attached to. The op bodies look the owning
`PrefetchHooks` up by id, so compiled code does not specialise on Python state.
"""

from __future__ import annotations

import threading
import weakref
from typing import Any

import torch

_registry: dict[int, Any] = {}
_lock = threading.Lock()
_next_id = [1]


def register(owner: Any) -> int:
    """An id under which custom-op bodies find `owner` (held weakly)."""
    with _lock:
        owner_id = _next_id[0]
        _next_id[0] += 1
        _registry[owner_id] = weakref.ref(owner)
    return owner_id


def unregister(owner_id: int) -> None:
    with _lock:
        _registry.pop(owner_id, None)


def _owner(owner_id: int) -> Any:
    ref = _registry.get(owner_id)
    return ref() if ref is not None else None


@torch.library.custom_op("l2lightning::forward_point", mutates_args=("token",))
def forward_point(token: torch.Tensor, x: torch.Tensor, owner_id: int, layer: int) -> None:
    owner = _owner(owner_id)
    if owner is not None:
        owner._on_forward_point(layer)


@forward_point.register_fake
def _forward_point_fake(token: torch.Tensor, x: torch.Tensor, owner_id: int, layer: int) -> None:
    return None


@torch.library.custom_op("l2lightning::backward_point", mutates_args=("token",))
def backward_point(token: torch.Tensor, grad: torch.Tensor, owner_id: int, layer: int) -> None:
    owner = _owner(owner_id)
    if owner is not None:
        owner._on_backward_point(layer)


@backward_point.register_fake
def _backward_point_fake(token: torch.Tensor, grad: torch.Tensor, owner_id: int, layer: int) -> None:
    return None


class _PointIn(torch.autograd.Function):
    """Identity on a layer's input; its forward issues the forward prefetch."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, token: torch.Tensor, owner_id: int, layer: int) -> torch.Tensor:
        torch.ops.l2lightning.forward_point(token, x, owner_id, layer)
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        return grad, None, None, None


class _PointOut(torch.autograd.Function):
    """Identity on a layer's output; its backward issues the backward prefetch."""

    @staticmethod
    def forward(ctx: Any, y: torch.Tensor, token: torch.Tensor, owner_id: int, layer: int) -> torch.Tensor:
        # Not save_for_backward: the token's version moves with every declared mutation, and it
        # holds no value anyone reads.
        ctx.token = token
        ctx.owner_id = owner_id
        ctx.layer = layer
        return y.view_as(y)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        torch.ops.l2lightning.backward_point(ctx.token, grad, ctx.owner_id, ctx.layer)
        return grad, None, None, None


def point_in(x: torch.Tensor, token: torch.Tensor, owner_id: int, layer: int) -> torch.Tensor:
    return _PointIn.apply(x, token, owner_id, layer)


def point_out(y: torch.Tensor, token: torch.Tensor, owner_id: int, layer: int) -> torch.Tensor:
    return _PointOut.apply(y, token, owner_id, layer)
