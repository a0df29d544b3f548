"""Throwaway chains: copies of one layer's block with fresh random weights, long enough to evict L2.

The tuner times these instead of the model, so tuning never touches the model's tensors (they are
read once, by ``copy.deepcopy``) and each layer's weights leave L2 between replays. Under the
tuner's memory budget (:mod:`l2lightning.tune.memory`) a chain may be shorter than that: down to
the shortest one that still holds every candidate distance.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from l2lightning.prefetch.chain import Layer, discover_chain, iter_tensors
from l2lightning.prefetch.plan import MIB, PrefetchPlan
from l2lightning.tune.candidates import PHASES, chain_step_plans


class SkipShape(Exception):
    """A shape cannot be tuned (cannot be copied or called on a random input, out of memory...)."""


class _ThrowawayChain(nn.Module):
    """Copies of one layer: run in sequence (``chain``: each copy's output feeds the next) or each on
    its own input (``fan``: for layers whose output cannot feed a copy of themselves, Linear d->4d)."""

    def __init__(self, layers: list[nn.Module], fan: bool) -> None:
        super().__init__()
        self.layers = nn.ModuleList(layers)
        self.fan = fan

    def forward(self, *xs: torch.Tensor) -> Any:
        if self.fan:
            return tuple(layer(x) for layer, x in zip(self.layers, xs))
        x = xs[0]
        for layer in self.layers:
            x = layer(x)
        return x


_HOOK_DICTS = (
    "_forward_hooks",
    "_forward_hooks_with_kwargs",
    "_forward_hooks_always_called",
    "_forward_pre_hooks",
    "_forward_pre_hooks_with_kwargs",
    "_backward_hooks",
    "_backward_pre_hooks",
)


def drop_hooks(module: nn.Module) -> None:
    """Clear the hooks of a deep copy: deepcopy carries hook dicts over (the hook functions are shared,
    not copied), and another PrefetchHooks' hooks must not fire inside a throwaway chain."""
    for sub in module.modules():
        for attr in _HOOK_DICTS:
            hooks = getattr(sub, attr, None)
            if isinstance(hooks, dict):
                hooks.clear()


def _fresh_copy(module: nn.Module, requires_grad: bool) -> nn.Module:
    """A deep copy of `module` with new random weights and no hooks (the model's tensors stay untouched)."""
    try:
        clone = copy.deepcopy(module)
    except Exception as exc:
        raise SkipShape(f"cannot deep-copy {type(module).__name__} ({type(exc).__name__}: {exc})") from exc
    drop_hooks(clone)
    with torch.no_grad():
        for name, p in clone.named_parameters():
            if not p.is_floating_point():
                continue
            if p.dim() >= 2:
                # fan-in scaling keeps activations O(1) through a chain of copies (no bf16 overflow)
                p.normal_(0.0, 1.0 / math.sqrt(max(1, p[0].numel())))
            else:
                # norm scales near 1, biases near 0
                p.normal_(1.0 if name.rsplit(".", 1)[-1] == "weight" else 0.0, 0.02)
            p.requires_grad_(requires_grad)
    return clone


def _loss_of(output: Any) -> torch.Tensor:
    terms = [
        t.float().square().mean() for t in iter_tensors(output) if t.is_floating_point() and t.requires_grad
    ]
    if not terms:
        raise SkipShape("no output of the layer needs a gradient: nothing to run backward on")
    return terms[0] if len(terms) == 1 else torch.stack(terms).sum()


MAX_COPIES = 32


def copies_for(layer_bytes: int, l2_bytes: int | None, low: int = 6, high: int = MAX_COPIES) -> int:
    """Copies in a throwaway chain: twice L2 worth of weights so each layer is evicted between
    replays, at least `low` (a steady state) and at most `high` (capture cost). Layers below
    L2 / 16 get a chain that may partly stay in L2: a conservative setting, which is where the
    measurements found no L2 effect anyway (d=768: the decoy gained as much as the plan)."""
    if l2_bytes is None or layer_bytes <= 0:
        return low
    return max(low, min(high, math.ceil(2 * l2_bytes / layer_bytes)))


def chain_copies(layer_bytes: int, l2_bytes: int | None, min_copies: int = 1) -> int:
    """Copies in the throwaway chain of a layer shape with no memory bound: :func:`copies_for`,
    lengthened to the model's `min_copies` layers of that shape (at most `MAX_COPIES`), so that what
    builds up along a chain (lines an evict_last prefetch keeps) shows."""
    return max(copies_for(layer_bytes, l2_bytes), min(min_copies, MAX_COPIES))


@dataclass
class ChainUnit:
    """What a throwaway chain repeats for one layer: the module it copies and the input it is timed on."""

    module: nn.Module  # the layer's block (``Layer.block``) or, where it has none, the layer itself
    input_shape: tuple[int, ...]
    input_dtype: torch.dtype  # int64 for an embedding's indices
    is_block: bool


def chain_unit(layer: Layer) -> ChainUnit:
    """The unit a throwaway chain of `layer` copies (see :func:`build_throwaway`), read from the layer
    record alone: nothing is copied, run or allocated.

    Raises:
        SkipShape: the layer's input shape is unknown.
    """
    if layer.input_shape is None or not layer.weights:
        raise SkipShape("the layer's input shape is unknown (its first argument is not a tensor)")
    if layer.block is not None and layer.block_input is not None:
        shape, dtype = layer.block_input
        return ChainUnit(layer.block, tuple(shape), dtype, is_block=True)
    embedding = isinstance(layer.module, (nn.Embedding, nn.EmbeddingBag))
    dtype = torch.int64 if embedding else layer.weights[0].dtype
    return ChainUnit(layer.module, tuple(layer.input_shape), dtype, is_block=False)


@dataclass
class Throwaway:
    """A throwaway chain for one layer shape: the module, its inputs and how it is laid out."""

    model: nn.Module
    inputs: tuple[torch.Tensor, ...]
    phase: str
    mode: str  # "block", "chain" or "fan"
    copies: int
    names: list[str]  # the chain layers' names inside `model` (for a name -> plan mapping)
    steps: list[str]  # every chain step of `model` (the layers and small steps such as a LayerNorm)

    def plans(self, plan: PrefetchPlan, phase: str) -> dict[str, PrefetchPlan]:
        """`plan` on every layer of `names` for the `phase` ("forward"/"backward") prefetch, its
        distance counted in chain steps as the model's is (:func:`chain_step_plans`: block copies
        may hold small steps between the layers). A training-context forward plan runs in a
        backward-phase chain, hence `phase` apart from ``self.phase``."""
        targets = set(self.names)
        significant = [i for i, name in enumerate(self.steps) if name in targets]
        per_step = chain_step_plans(len(self.steps), significant, dict.fromkeys(significant, plan), phase)
        return {name: p for name, p in zip(self.steps, per_step) if p is not None}

    def zero_grads(self) -> None:
        """Grads to None (before each capture, so each graph allocates its .grad in its pool)."""
        for p in self.model.parameters():
            p.grad = None
        for x in self.inputs:
            if x.requires_grad:
                x.grad = None

    def run(self) -> Any:
        """One pass: forward under no_grad, or forward + mean-square loss + backward."""
        if self.phase == "forward":
            with torch.no_grad():
                return self.model(*self.inputs)
        with torch.enable_grad():
            loss = _loss_of(self.model(*self.inputs))
            loss.backward()
        return loss


def _random_input(proto: nn.Module, unit: ChainUnit, device: torch.device) -> torch.Tensor:
    if unit.input_dtype == torch.int64 and isinstance(proto, (nn.Embedding, nn.EmbeddingBag)):
        return torch.randint(0, proto.num_embeddings, unit.input_shape, device=device)
    return torch.randn(unit.input_shape, device=device, dtype=unit.input_dtype)


def build_throwaway(
    layer: Layer,
    phase: str,
    l2_bytes: int | None,
    *,
    max_bytes: int | None = None,
    min_copies: int = 1,
    max_copies: int | None = None,
) -> Throwaway:
    """Copies of the layer's block (``layer.block``, mode ``block``) or of ``layer.module`` with fresh
    random weights, on the layer's device, with random inputs.

    ``block`` mode when the layer sits in a block that maps its input to the same shape and dtype
    (LayerNorm, Linear, GELU): each block copy feeds the next, so the norm and activation kernels
    run between the layers as they do in the model. Otherwise copies of the lone layer: ``chain``
    mode when a copy maps its input to a tensor of the same shape and dtype (each copy feeds the
    next); ``fan`` mode otherwise (Linear d->4d: each copy reads its own input, and in backward
    each input is a leaf that needs grad, so every copy computes grad-input and reads its W as a
    mid-model layer does). `min_copies` (the model's layers of this shape) lengthens the chain up
    to 32 copies (:func:`chain_copies`); `max_copies` (the tuner's memory budget) and `max_bytes`
    (the copies' weight bytes, from free GPU memory) shorten it.

    Raises:
        SkipShape: the module cannot be copied or called on a random input of the recorded shape,
            or too little memory is free.
    """
    if phase not in PHASES:
        raise ValueError(f"`phase` must be one of {PHASES}, got {phase!r}")
    if max_copies is not None and (
        isinstance(max_copies, bool) or not isinstance(max_copies, int) or max_copies < 2
    ):
        raise ValueError(
            f"`max_copies` must be an int >= 2 (a chain needs two layers) or None, got {max_copies!r}"
        )
    unit = chain_unit(layer)
    backward = phase == "backward"
    device = layer.weights[0].device
    proto = _fresh_copy(unit.module, backward)
    x = _random_input(proto, unit, device)
    try:
        with torch.no_grad():
            y = proto(x)
    except Exception as exc:
        raise SkipShape(
            f"a copy of {type(unit.module).__name__} failed on a random {tuple(x.shape)} input "
            f"({type(exc).__name__}: {exc})"
        ) from exc
    fan = not (isinstance(y, torch.Tensor) and y.shape == x.shape and y.dtype == x.dtype)
    del y
    n = chain_copies(layer.nbytes, l2_bytes, min_copies)
    if max_copies is not None:
        n = min(n, max_copies)
    if max_bytes is not None:
        n = min(n, max_bytes // max(1, layer.nbytes))
    if n < 2:
        raise SkipShape(
            f"not enough free memory for a throwaway chain of {layer.nbytes / MIB:.1f} MiB layers"
        )
    model = _ThrowawayChain([proto] + [_fresh_copy(proto, backward) for _ in range(n - 1)], fan)
    if fan and backward and x.is_floating_point():
        inputs: tuple[torch.Tensor, ...] = tuple(torch.randn_like(x).requires_grad_(True) for _ in range(n))
    elif fan:
        inputs = (x,) * n
    else:
        inputs = (x,)
    mode = "block" if unit.is_block else ("fan" if fan else "chain")
    steps = [c.name for c in discover_chain(model, inputs)]
    if mode == "block":
        # the layer's place inside each block copy (its LayerNorm companions get no plan)
        inner = _module_name(layer.block, layer.module)
        names = [f"layers.{i}.{inner}" for i in range(n)]
    else:
        names = steps
    return Throwaway(model, inputs, phase, mode, n, names, steps)


def _module_name(block: nn.Module, module: nn.Module) -> str:
    """``module``'s dotted name inside ``block`` (a proper descendant)."""
    for name, sub in block.named_modules():
        if sub is module and name:
            return name
    raise SkipShape(f"{type(module).__name__} is not inside its recorded block {type(block).__name__}")
