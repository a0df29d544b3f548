"""Freeing and describing CUDA memory when a capture or the tuner runs out of it."""

from __future__ import annotations

import gc

import torch


def free_cached_memory() -> None:
    """Collect garbage (reference cycles holding tensors), then give PyTorch's cached blocks back."""
    gc.collect()
    torch.cuda.empty_cache()


def memory_state() -> str:
    """The device's free and total memory and what PyTorch holds, for an out-of-memory warning."""
    if not torch.cuda.is_available():
        return "no CUDA device"
    free, total = torch.cuda.mem_get_info()
    gib = 1 << 30
    return (
        f"{free / gib:.2f} of {total / gib:.2f} GiB free, PyTorch holding "
        f"{torch.cuda.memory_allocated() / gib:.2f} GiB allocated, {torch.cuda.memory_reserved() / gib:.2f} reserved"
    )
