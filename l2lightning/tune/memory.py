"""The tuner's memory: what a throwaway chain would hold, estimated before it is built, and the bound on it.

Tuning times copies of a layer's block (:mod:`l2lightning.tune.throwaway`); the copies, their
gradients and the activations of the timing graphs are memory the model itself never needs, so the
tuner keeps them within a budget: ``Autotuner(memory_budget=...)`` times the model's parameter
bytes (:data:`DEFAULT_MEMORY_BUDGET`, a quarter, by default). Tuning then cannot be what runs a fit
out of memory, because:

* the bytes a chain of n copies would hold are estimated from shapes and dtypes before anything is
  allocated (:func:`chain_footprint`);
* the chain is shortened to what fits (:meth:`ChainFootprint.copies_within`), but never below the
  shortest chain that still puts a prefetched layer at every candidate distance from the layer it
  warms; a shape whose shortest chain does not fit gets no plan, and its row says why;
* one shape is measured at a time and its chain is freed before the next; the
  :class:`MemoryLedger` keeps count, so the report can show the most held at once.

Not counted: library workspaces (PyTorch keeps a cuBLAS workspace per cuBLAS handle and stream a
GEMM ran on, 32 MiB by default on Hopper; backward runs on autograd's own thread, with its own
handle; measured on the H200, a backward tuning run held three at its peak) and the caching
allocator's rounding. They do not grow with the model or the chain.
"""

from __future__ import annotations

import contextlib
import copy
import math
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from l2lightning.prefetch.chain import Layer, iter_tensors
from l2lightning.prefetch.plan import MIB
from l2lightning.tune.candidates import PHASES
from l2lightning.tune.throwaway import ChainUnit, chain_unit, drop_hooks

__all__ = [
    "DEFAULT_MEMORY_BUDGET",
    "ChainFootprint",
    "ChainSizing",
    "MemoryLedger",
    "chain_footprint",
    "check_memory_budget",
    "size_chain",
    "tensor_bytes",
]

# A quarter of the model's parameter bytes: with the defaults, tuning must never be what a fit
# runs out of memory for, so it may only add a small share to what the model itself holds.
DEFAULT_MEMORY_BUDGET = 0.25
# Where a copy cannot run on the meta device (a custom kernel, a shape that depends on the data), its
# saved activations are taken as this many inputs' worth and its output as large as its input.
FALLBACK_SAVED_INPUTS = 4
# Activations in flight besides what the chain keeps: the one being written while the previous one
# is read (forward), an activation's gradient and the next one's (backward).
IN_FLIGHT = 2


def check_memory_budget(value: Any) -> float | None:
    """`value` as a validated ``memory_budget``: a positive finite number, or None (no bound).

    Raises:
        ValueError: anything else, naming the argument and what it accepts.
    """
    if value is None:
        return None
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not math.isfinite(value)
        or not value > 0
    ):
        raise ValueError(
            "`memory_budget` must be a positive number, the multiple of the model's parameter bytes "
            f"that tuning's throwaway copies may hold (0.25: a quarter), or None for no bound; got {value!r}"
        )
    return float(value)


def tensor_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of the distinct tensors in `tensors` (a tied weight counts once). Reads shapes and
    dtypes only, so meta tensors count as what they describe."""
    seen: set[int] = set()
    total = 0
    for t in tensors:
        if id(t) not in seen:
            seen.add(id(t))
            total += t.numel() * t.element_size()
    return total


@dataclass(frozen=True)
class ChainFootprint:
    """The most bytes a throwaway chain of one layer shape holds at once, for any chain length.

    Attributes:
        per_copy: what each copy adds: its parameters and buffers; in backward graphs also their
            gradients and the activations autograd saves; in ``fan`` mode also its own input and
            output(s).
        fixed: what does not grow with the chain: its input, the final output (one per captured
            graph in forward) and loss, and the activations in flight.
        measured: True when the activations come from running a copy on the meta device; False
            when that failed and they are the fallback estimate (``FALLBACK_SAVED_INPUTS``).
    """

    per_copy: int
    fixed: int
    measured: bool = True

    def bytes_for(self, copies: int) -> int:
        """Bytes of a chain of `copies` copies."""
        return copies * self.per_copy + self.fixed

    def copies_within(self, budget_bytes: int | None, wanted: int, shortest: int) -> int:
        """The longest chain of at most `wanted` copies that fits in `budget_bytes` (None: no bound,
        `wanted`), or 0 when not even `shortest` copies fit."""
        if budget_bytes is None:
            return wanted
        fit = (budget_bytes - self.fixed) // self.per_copy if self.per_copy > 0 else wanted
        copies = min(wanted, fit)
        return copies if copies >= shortest else 0


@dataclass(frozen=True)
class ChainSizing:
    """How long one shape's throwaway chain may be within the budget, and what it holds."""

    footprint: ChainFootprint
    budget_bytes: int | None
    wanted: int  # its length with no memory bound
    shortest: int  # the shortest chain that holds every candidate distance
    copies: int  # the longest within the budget, at most `wanted`; 0: not even `shortest` fits

    def over_budget(self) -> str:
        """Why no chain is built (for a sizing whose `copies` is 0)."""
        need = self.footprint.bytes_for(self.shortest)
        return (
            f"its shortest throwaway chain ({self.shortest} copies) needs {need / MIB:.1f} MiB, over "
            f"the memory budget of {(self.budget_bytes or 0) / MIB:.1f} MiB"
        )


def size_chain(
    layer: Layer, phase: str, *, graphs: int, wanted: int, shortest: int, budget_bytes: int | None
) -> ChainSizing:
    """The sizing of `layer`'s throwaway chain: its :func:`chain_footprint` in `phase` with `graphs`
    graphs, and the longest chain of at most `wanted` copies, and at least `shortest`, within
    `budget_bytes` (None: no bound)."""
    footprint = chain_footprint(layer, phase, graphs)
    shortest = min(shortest, wanted)
    copies = footprint.copies_within(budget_bytes, wanted, shortest)
    return ChainSizing(footprint, budget_bytes, wanted, shortest, copies)


def chain_footprint(layer: Layer, phase: str, graphs: int) -> ChainFootprint:
    """What a throwaway chain of `layer` holds, from shapes and dtypes: nothing is allocated.

    The parameters, buffers and gradients of a copy are read off the layer's unit (its block, or the
    layer itself; :func:`~l2lightning.tune.throwaway.chain_unit`). Its output and the activations
    autograd saves are counted by running a copy whose tensors live on the meta device (shapes
    without storage) under a saved-tensor hook; parameters saved for backward are not counted twice.

    Args:
        layer: the chain layer whose shape is tuned.
        phase: the timing graphs' phase: ``"forward"`` (forward only, no grad) or ``"backward"``
            (forward + backward; a training-context forward phase runs these too).
        graphs: the most graphs the search captures on the chain (plain, each candidate, the decoy);
            each forward graph keeps its output.

    Raises:
        SkipShape: the layer's input shape is unknown.
    """
    if phase not in PHASES:
        raise ValueError(f"`phase` must be one of {PHASES}, got {phase!r}")
    if isinstance(graphs, bool) or not isinstance(graphs, int) or graphs < 1:
        raise ValueError(f"`graphs` must be an int >= 1, got {graphs!r}")
    unit = chain_unit(layer)
    backward = phase == "backward"
    params = list(unit.module.parameters())
    # The layer's own record is the floor: a unit whose parameters live elsewhere still copies them.
    weights = max(tensor_bytes([*params, *unit.module.buffers()]), layer.nbytes)
    # Every floating parameter of a copy gets a gradient in backward graphs (see _fresh_copy).
    grads = tensor_bytes(p for p in params if p.is_floating_point()) if backward else 0
    itemsize = torch.empty((), dtype=unit.input_dtype, device="meta").element_size()
    activation = math.prod(unit.input_shape) * itemsize
    probe = _meta_probe(unit, backward)
    if probe is None:
        # Unknown output: as large as the input, and laid out in fan mode (the dearer one).
        output, output_numel, fan = activation, math.prod(unit.input_shape), True
        saved = FALLBACK_SAVED_INPUTS * activation if backward else 0
    else:
        output, output_numel, saved, fan = probe
    loss_copy = output_numel * 4  # the loss squares a float32 copy of the output
    if not backward:
        per_copy = weights + (output * graphs if fan else 0)
        fixed = activation + (0 if fan else output * graphs) + IN_FLIGHT * max(activation, output)
    else:
        per_copy = weights + grads + saved + (2 * activation + output + loss_copy if fan else 0)
        fixed = activation + (0 if fan else output + loss_copy) + IN_FLIGHT * max(activation, loss_copy)
    return ChainFootprint(per_copy=per_copy, fixed=fixed, measured=probe is not None)


def _meta_probe(unit: ChainUnit, backward: bool) -> tuple[int, int, int, bool] | None:
    """(output bytes, output elements, saved activation bytes, fan mode) of one copy of `unit`, run
    on the meta device; None when the copy cannot be made or run there."""
    memo: dict[int, Any] = {}
    try:
        for t in [*unit.module.parameters(), *unit.module.buffers()]:
            meta = torch.empty_like(t, device="meta")
            # deepcopy looks every object up in its memo first: the copy gets these, the originals stay put
            memo[id(t)] = (
                nn.Parameter(meta, requires_grad=backward and t.is_floating_point())
                if isinstance(t, nn.Parameter)
                else meta
            )
        clone = copy.deepcopy(unit.module, memo)
    except Exception:  # a tensor type without a meta form, an uncopyable module (the build says so)
        return None
    drop_hooks(clone)
    parameters = {id(p) for p in clone.parameters()}
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        base = t if t._base is None else t._base  # a view saves its base's storage
        if id(base) not in parameters:
            saved[id(base)] = base.numel() * base.element_size()
        return t

    x = torch.empty(unit.input_shape, dtype=unit.input_dtype, device="meta")
    try:
        with torch.set_grad_enabled(backward), torch.autograd.graph.saved_tensors_hooks(pack, _unpack):
            y = clone(x)
    except Exception:  # a kernel without a meta implementation, a data-dependent shape
        return None
    outputs = list(iter_tensors(y))
    fan = not (isinstance(y, torch.Tensor) and y.shape == x.shape and y.dtype == x.dtype)
    output = tensor_bytes(outputs)
    numel = sum(t.numel() for t in outputs)
    return output, numel, sum(saved.values()), fan


def _unpack(t: torch.Tensor) -> torch.Tensor:
    return t


class MemoryLedger:
    """The bytes the tuner's throwaway chains hold now and the most they held at once, within a budget.

    Args:
        budget_bytes: the bound (None: none).
    """

    def __init__(self, budget_bytes: int | None) -> None:
        self.budget_bytes = budget_bytes
        self.held = 0
        self.peak = 0

    @contextlib.contextmanager
    def hold(self, nbytes: int) -> Iterator[None]:
        """Count `nbytes` as held inside the block.

        Raises:
            RuntimeError: the bytes would exceed the budget (the tuner sizes chains so they never do).
        """
        if self.budget_bytes is not None and self.held + nbytes > self.budget_bytes:
            raise RuntimeError(
                f"a throwaway chain of {nbytes} bytes would exceed the memory budget of "
                f"{self.budget_bytes} bytes ({self.held} already held)"
            )
        self.held += nbytes
        self.peak = max(self.peak, self.held)
        try:
            yield
        finally:
            self.held -= nbytes
