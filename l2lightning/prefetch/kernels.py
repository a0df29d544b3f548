"""`prefetch(tensor, plan)`: one launch of an L2 prefetch kernel (kernels/l2_prefetch.cu) on the current stream.

The CUDA source is compiled through CuPy's NVRTC by :mod:`l2lightning._kernels` (shared with the
decode attention kernel, which is why the loader stays outside this package); this module knows
the prefetch kernels' names, their arguments and which kinds a device can run.
"""

from __future__ import annotations

from typing import Any

from l2lightning.prefetch.plan import KINDS, PrefetchPlan

_KERNEL_NAMES = {
    "hint": "l2_prefetch_hint",
    "hint_last": "l2_prefetch_hint_last",
    "bulk": "l2_prefetch_bulk",
    "bulk_last": "l2_prefetch_bulk_last",
}


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
