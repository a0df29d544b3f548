"""Prefetch plans and `prefetch(tensor, plan)`: one launch of an L2 prefetch kernel on the current stream.

A plan says how to warm L2 with a tensor's bytes: which kernel (`hint`: `prefetch.global.L2` per
`stride` bytes; `bulk`: `cp.async.bulk.prefetch.L2` per `chunk` bytes, sm_90+), with or without
the `evict_last` priority, how many blocks and threads, and how many layers ahead (`distance`) the
hooks aim it. The measurements on the H200 showed one block cannot keep up with a 4.5 MiB+ layer
(−60…−412%), so the default plan grows its block count with the layer's bytes.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

KINDS = ("hint", "hint_last", "bulk", "bulk_last")
_KERNEL_NAMES = {
    "hint": "l2_prefetch_hint",
    "hint_last": "l2_prefetch_hint_last",
    "bulk": "l2_prefetch_bulk",
    "bulk_last": "l2_prefetch_bulk_last",
}
MIB = 1 << 20


@dataclass(frozen=True)
class PrefetchPlan:
    """How to prefetch one layer's weights into L2.

    Args:
        kind: ``"hint"`` (``prefetch.global.L2``), ``"hint_last"`` (its ``::evict_last`` flavour),
            ``"bulk"`` (``cp.async.bulk.prefetch.L2``, sm_90+) or ``"bulk_last"`` (bulk with an
            ``evict_last`` cache policy).
        blocks: grid size, 1 to 1024.
        threads: threads per block, a multiple of 32 from 32 to 1024.
        stride: bytes between two hint prefetches (a power of two from 32 to 4096; 128 = one L2 line
            group). Used by the hint kinds.
        chunk: bytes per bulk prefetch (a multiple of 16, 16 B to 1 MiB). Used by the bulk kinds.
        distance: how many layers ahead the hooks aim (1 = the next layer), 1 to 8.

    Example:
        >>> PrefetchPlan(kind="hint", blocks=8)
        PrefetchPlan(kind='hint', blocks=8, threads=256, stride=128, chunk=32768, distance=1)
    """

    kind: str = "hint"
    blocks: int = 8
    threads: int = 256
    stride: int = 128
    chunk: int = 32768
    distance: int = 1

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"`kind` must be one of {KINDS}, got {self.kind!r}")
        _check_int("blocks", self.blocks, 1, 1024)
        _check_int("threads", self.threads, 32, 1024)
        if self.threads % 32:
            raise ValueError(f"`threads` must be a multiple of 32 (a whole warp), got {self.threads}")
        _check_int("stride", self.stride, 32, 4096)
        if self.stride & (self.stride - 1):
            raise ValueError(f"`stride` must be a power of two, got {self.stride}")
        _check_int("chunk", self.chunk, 16, MIB)
        if self.chunk % 16:
            raise ValueError(
                f"`chunk` must be a multiple of 16 bytes (bulk prefetch granularity), got {self.chunk}"
            )
        _check_int("distance", self.distance, 1, 8)

    @property
    def is_bulk(self) -> bool:
        return self.kind.startswith("bulk")

    @property
    def label(self) -> str:
        """Short name for tables, e.g. ``hint8`` or ``bulk_last16@d2``."""
        suffix = f"@d{self.distance}" if self.distance != 1 else ""
        return f"{self.kind}{self.blocks}{suffix}"

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> PrefetchPlan:
        unknown = set(data) - {f.name for f in dataclasses.fields(cls)}
        if unknown:
            raise ValueError(f"unknown PrefetchPlan fields {sorted(unknown)}")
        return cls(**data)


def _check_int(name: str, value: Any, low: int, high: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"`{name}` must be an int, got {type(value).__name__}")
    if not low <= value <= high:
        raise ValueError(f"`{name}` must be in [{low}, {high}], got {value}")


def default_plan(layer_bytes: int, l2_bytes: int | None = None) -> PrefetchPlan | None:
    """The plan used before (or without) autotuning, sized by the layer's bytes.

    None for layers too small to be worth a launch (< 256 KiB) and for layers so large that the
    current and next layer cannot both sit in L2 (the measured rule: 32 MiB layers on a 60 MiB L2
    always lost).
    """
    if layer_bytes < 256 * 1024:
        return None
    if l2_bytes is not None and 2 * layer_bytes > l2_bytes:
        return None
    if layer_bytes < 2 * MIB:
        return PrefetchPlan(kind="hint", blocks=4)
    if layer_bytes <= 16 * MIB:
        return PrefetchPlan(kind="hint", blocks=8)
    return PrefetchPlan(kind="hint", blocks=16)


def _launch_args(tensor: Any, plan: PrefetchPlan) -> tuple[str, tuple, int] | None:
    """(kernel name, kernel args, bytes covered) for `tensor`, or None when there is nothing to do."""
    import numpy as np

    nbytes = tensor.untyped_storage().nbytes() if tensor.numel() else 0
    nbytes = min(nbytes, tensor.numel() * tensor.element_size())
    if nbytes == 0:
        return None
    ptr = tensor.data_ptr()
    if plan.is_bulk:
        # bulk prefetch: 16-byte aligned start, size a multiple of 16; trim the unaligned edges
        # (at most 30 bytes of a multi-KiB layer go without a prefetch).
        start = (ptr + 15) & ~15
        nbytes = (nbytes - (start - ptr)) & ~15
        if nbytes <= 0:
            return None
        return _KERNEL_NAMES[plan.kind], (np.uint64(start), np.uint64(nbytes), np.uint32(plan.chunk)), nbytes
    return _KERNEL_NAMES[plan.kind], (np.uint64(ptr), np.uint64(nbytes), np.uint32(plan.stride)), nbytes


def kernel_defines(device_index: int) -> tuple[str, ...]:
    """Compile-time defines for kernels/l2_prefetch.cu on this device (bulk kernels on sm_90+)."""
    import torch

    major, _ = torch.cuda.get_device_capability(device_index)
    return ("L2L_HAVE_BULK",) if major >= 9 else ()


def supported_kinds(device_index: int) -> tuple[str, ...]:
    """The plan kinds this device can run."""
    return KINDS if kernel_defines(device_index) else ("hint", "hint_last")


def load_prefetch_kernels(device_index: int) -> None:
    """Compile kernels/l2_prefetch.cu for `device_index` now (must happen before a graph capture)."""
    from l2lightning._kernels import get_function, require_gpu_kernels

    require_gpu_kernels("L2 prefetch")
    defines = kernel_defines(device_index)
    for kind in supported_kinds(device_index):
        get_function("l2_prefetch.cu", _KERNEL_NAMES[kind], device_index, defines)


def prefetch(tensor: Any, plan: PrefetchPlan) -> None:
    """Issue one L2 prefetch of `tensor`'s bytes on torch's current CUDA stream.

    Never writes memory. Inside `torch.cuda.graph(...)` the launch is recorded into the graph.

    Raises:
        RuntimeError: no CUDA device or no CuPy (the message carries the install hint).
        ValueError: `tensor` is not a CUDA tensor, or the plan's kind needs sm_90+.

    Example:
        >>> w = torch.randn(1536, 1536, device="cuda", dtype=torch.bfloat16)  # doctest: +SKIP
        >>> prefetch(w, PrefetchPlan(kind="hint", blocks=8))  # doctest: +SKIP
    """
    from l2lightning._kernels import get_function, launch, require_gpu_kernels

    if not isinstance(plan, PrefetchPlan):
        raise TypeError(f"`plan` must be a PrefetchPlan, got {type(plan).__name__}")
    require_gpu_kernels("prefetch()")
    if not getattr(tensor, "is_cuda", False):
        raise ValueError(f"`tensor` must be a CUDA tensor, got a tensor on {getattr(tensor, 'device', '?')}")
    device_index = tensor.device.index
    if plan.kind not in supported_kinds(device_index):
        raise ValueError(
            f"plan kind {plan.kind!r} needs sm_90+; this device supports {supported_kinds(device_index)}"
        )
    args = _launch_args(tensor, plan)
    if args is None:
        return
    name, kernel_args, _ = args
    kernel = get_function("l2_prefetch.cu", name, device_index, kernel_defines(device_index))
    launch(kernel, plan.blocks, plan.threads, kernel_args, device_index)
