"""The chain: the weight-reading layers of a model in the order one forward pass calls them.

One dry run (buffers and RNG restored, no_grad) records which parameter-holding modules run and
in what order, and for each the largest enclosing block (a LayerNorm, Linear, GELU group) the
autotuner times copies of. Both the hooks (:mod:`l2lightning.prefetch.install`) and the tuner
(:mod:`l2lightning.tune`) read the chain; it imports neither of them.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from l2lightning.graph.rng import forked_rng

# Blocks PyTorch runs through fused kernels that bypass their submodules' forward: hook them whole.
FUSED_BLOCK_TYPES: tuple[type[nn.Module], ...] = (
    nn.TransformerEncoderLayer,
    nn.TransformerDecoderLayer,
    nn.MultiheadAttention,
)
# Parameters smaller than this are not worth a launch (a Linear's bias, a norm's scale).
MIN_TENSOR_BYTES = 4096
# Chain layers below this size, and below an eighth of the layer's own size, may share its block (a
# wide LayerNorm's scale and shift next to its Linear): the autotuner never plans for them (the same
# floor as tune.candidates.MIN_LAYER_BYTES), so they are context, not another layer to tune.
BLOCK_COMPANION_BYTES = 256 * 1024


@dataclass
class Layer:
    """One weight-reading layer of the chain, in execution order."""

    index: int
    name: str
    module: nn.Module
    weights: list[torch.Tensor]
    nbytes: int
    input_shape: tuple[int, ...] | None = None
    # The largest module around this layer that holds no other chain layer and maps its input to a
    # tensor of the same shape and dtype (a (LayerNorm, Linear, GELU) block), with that input's
    # shape and dtype. The autotuner times copies of the block rather than of the lone layer: the
    # norm and activation kernels between two layers change what a prefetch overlaps with, and a
    # plan measured on lone layers did not transfer to the model (H200, d2560 b4: +3.0% measured,
    # -3.4% in the model).
    block: nn.Module | None = None
    block_input: tuple[tuple[int, ...], torch.dtype] | None = None

    @property
    def context(self) -> str:
        """The block's type and its leaf modules' types, e.g. ``Sequential(LayerNorm,Linear,GELU)``."""
        if self.block is None:
            return ""
        leaves = [type(m).__name__ for m in self.block.modules() if next(m.children(), None) is None]
        return f"{type(self.block).__name__}({','.join(leaves)})"

    @property
    def shape_key(self) -> str:
        """Identifies layers that behave alike for prefetch tuning (type, weight shapes, dtype, input,
        and the enclosing block when there is one)."""
        shapes = ",".join("x".join(map(str, w.shape)) for w in self.weights)
        dtype = str(self.weights[0].dtype).replace("torch.", "") if self.weights else "none"
        inp = "x".join(map(str, self.input_shape)) if self.input_shape else "?"
        key = f"{type(self.module).__name__}[{shapes}]:{dtype}:in{inp}"
        return f"{key}@{self.context}" if self.block is not None else key


def iter_tensors(obj: Any) -> Iterator[torch.Tensor]:
    """The tensors of a nested tuple/list/dict, depth first, lazily.

    Not :func:`l2lightning.graph.capture.flatten_batch`: that one also builds a spec to rebuild the batch,
    and its recursive closure is a reference cycle that keeps every tensor it saw alive until the
    garbage collector runs. The hooks call this on each layer's output during a pass; holding an
    output keeps its autograd graph and the parameters' AccumulateGrad nodes, which a later capture
    on another stream then fails through (see ``PlanHooks._release_pass``).
    """
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (list, tuple)):
        for item in obj:
            yield from iter_tensors(item)
    elif isinstance(obj, Mapping):
        for item in obj.values():
            yield from iter_tensors(item)


def call_model(model: nn.Module, example_input: Any) -> Any:
    """model(x), model(*x) for a tuple/list, model(**x) for a dict."""
    if isinstance(example_input, Mapping):
        return model(**example_input)
    if isinstance(example_input, (tuple, list)):
        return model(*example_input)
    return model(example_input)


@contextlib.contextmanager
def preserved_state(model: nn.Module) -> Iterator[None]:
    """Run a dry pass without side effects: buffers (BatchNorm statistics) and RNG are restored."""
    buffers = [(b, b.detach().clone()) for b in model.buffers()]
    devices = sorted(
        {b.device.index for b in model.buffers() if b.is_cuda}
        | {p.device.index for p in model.parameters() if p.is_cuda}
    )
    with forked_rng(devices), torch.no_grad():
        try:
            yield
        finally:
            for buf, saved in buffers:
                buf.copy_(saved)


def discover_chain(
    model: nn.Module, example_input: Any, step: Callable[[nn.Module, Any], Any] | None = None
) -> list[Layer]:
    """Weight-reading layers of `model` in the order one forward pass calls them, each with its
    enclosing block (see `Layer.block`) where the model has one."""
    names = {m: n for n, m in model.named_modules()}
    fused = [m for m in model.modules() if isinstance(m, FUSED_BLOCK_TYPES)]
    inside_fused = {sub for m in fused for sub in m.modules() if sub is not m}
    candidates = []
    for module in model.modules():
        if module in inside_fused:
            continue
        # A container that also holds parameters of its own (a ViT's position embedding) is not a
        # chain step: its forward spans its children, so "the next layer" would be ill-defined.
        is_leaf = next(module.children(), None) is None
        if isinstance(module, FUSED_BLOCK_TYPES) or (
            is_leaf and any(True for _ in module.parameters(recurse=False))
        ):
            candidates.append(module)
    order: list[tuple[nn.Module, tuple[int, ...] | None]] = []
    seen: set[int] = set()

    def record(module: nn.Module, args: tuple) -> None:
        if id(module) not in seen:
            seen.add(id(module))
            first = next(iter_tensors(args), None)
            order.append((module, tuple(first.shape) if first is not None else None))

    # Containers (blocks) record their calls' input and output signatures, to find `Layer.block`;
    # the fused blocks with children are chain steps themselves (candidates), not containers.
    containers = [
        m
        for m in model.modules()
        if m is not model
        and m not in inside_fused
        and not isinstance(m, FUSED_BLOCK_TYPES)
        and next(m.children(), None) is not None
    ]
    calls: dict[int, list] = {}

    def count_call(module: nn.Module, args: tuple, output: Any) -> None:
        only_arg = args[0] if len(args) == 1 else None
        calls.setdefault(id(module), []).append((_tensor_signature(only_arg), _tensor_signature(output)))

    handles = [m.register_forward_pre_hook(record) for m in candidates]
    handles += [m.register_forward_hook(count_call) for m in containers]
    try:
        with preserved_state(model):
            (step or call_model)(model, example_input)
    finally:
        for h in handles:
            h.remove()
    chain = []
    for module, input_shape in order:
        recurse = isinstance(module, FUSED_BLOCK_TYPES)
        weights = [
            p
            for p in module.parameters(recurse=recurse)
            if p.is_floating_point() and p.numel() * p.element_size() >= MIN_TENSOR_BYTES
        ]
        nbytes = sum(p.numel() * p.element_size() for p in weights)
        if not weights:  # a norm's scale and shift: nothing worth fetching, and not a chain step
            continue
        chain.append(
            Layer(len(chain), names.get(module, type(module).__name__), module, weights, nbytes, input_shape)
        )
    chain_modules = {id(layer.module): layer.nbytes for layer in chain}
    by_name = dict(model.named_modules())
    for layer in chain:
        layer.block, layer.block_input = _enclosing_block(model, layer, by_name, chain_modules, calls)
    return chain


def _tensor_signature(value: Any) -> tuple[tuple[int, ...], torch.dtype] | None:
    """(shape, dtype) of `value` when it is one tensor, else None."""
    return (tuple(value.shape), value.dtype) if isinstance(value, torch.Tensor) else None


def _enclosing_block(
    model: nn.Module,
    layer: Layer,
    modules: dict[str, nn.Module],
    chain_modules: dict[int, int],
    calls: dict[int, list],
) -> tuple[nn.Module | None, tuple[tuple[int, ...], torch.dtype] | None]:
    """The largest proper ancestor of `layer` (not the model) that contains no other chain layer
    (`chain_modules`: id -> weight bytes) except small companions (see `BLOCK_COMPANION_BYTES`), was
    called once on one tensor, and returned one tensor of the same shape and dtype; else (None, None)."""
    companion = min(BLOCK_COMPANION_BYTES, layer.nbytes // 8)
    parts = layer.name.split(".")
    if layer.module is model or len(parts) < 2:
        return None, None
    for depth in range(1, len(parts)):  # outermost first
        block = modules.get(".".join(parts[:depth]))
        if block is None:
            continue
        if any(
            m is not layer.module and chain_modules.get(id(m), 0) >= max(companion, 1)
            for m in block.modules()
        ):
            continue
        seen = calls.get(id(block), [])
        if len(seen) != 1:
            continue
        args, out = seen[0]
        if args is not None and args == out and args[1].is_floating_point:
            return block, args
    return None, None


def device_l2_bytes(device: torch.device) -> int | None:
    """The device's L2 size in bytes, or None where unknown (CPU)."""
    if device.type != "cuda":
        return None
    return getattr(torch.cuda.get_device_properties(device), "L2_cache_size", None)
