"""Floors of a case: how fast its step could be, from bytes moved and kernels launched.

A step time says little alone; against what the GPU could do it says how much is left. Floors per
case: bytes from :func:`l2lightning.floors.step_bytes` (AdamW states in the parameters' dtype, as
PyTorch keeps them) over the doctor's copy bandwidth, and kernels counted on one eager pass with
``torch.profiler`` times the doctor's empty-kernel cost (compiled variants launch fewer kernels, so
their launch floor is an upper estimate). For a family the eager pass is one ``training_step`` +
backward + ``step()`` of the module's own optimizer, outside Lightning.
"""

from __future__ import annotations

import gc
import warnings
from collections.abc import Callable
from typing import Any

from l2lightning import floors as floors_module
from l2lightning.tools.bench.families import (
    FamilyCase,
    build_family,
    eager_family_step,
    family_batches,
    family_step_floors,
    module_optimizer,
)
from l2lightning.tools.bench.mlp import BenchCase
from l2lightning.tools.bench.runners import PlainRunner
from l2lightning.tools.bench.settings import BenchSettings


def count_kernels(fn: Callable[[], Any]) -> int | None:
    """CUDA kernels (and memcpy/memset) launched by one call of `fn`, from the profiler; None if unknown."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    try:
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            fn()
            torch.cuda.synchronize()
        events = list(prof.events())
    except Exception:
        return None
    # GPU-side records first (one per kernel, memcpy, memset); else the host-side launch calls.
    cuda = torch.autograd.DeviceType.CUDA
    on_gpu = sum(1 for e in events if getattr(e, "device_type", None) == cuda)
    launches = sum(1 for e in events if getattr(e, "name", "") in floors_module.LAUNCH_API_NAMES)
    return on_gpu or launches or None


def case_floors(
    case: BenchCase | FamilyCase, gpu_state: dict[str, Any], settings: BenchSettings
) -> tuple[Any, int | None]:
    """(Floors or None, kernel count) of `case`: kernels counted on one eager pass."""
    import torch

    if isinstance(case, FamilyCase):
        return family_floors(case, gpu_state, settings)
    bw, empty = gpu_state.get("copy_bandwidth_bytes_per_s"), gpu_state.get("empty_kernel_us")
    runner = PlainRunner("eager", case, settings, {})
    runner.setup()
    try:
        step = runner.built_step()
        step(0)
        kernels = count_kernels(lambda: step(1))
        model = runner._keep[0]
        param_bytes = floors_module.param_bytes_by_dtype(model)
    finally:
        runner.close()
        torch.cuda.empty_cache()
    if not bw:
        return None, kernels
    f = floors_module.floors(
        param_bytes,
        kernels,
        bw,
        empty,
        chain=case.chain,
        # PyTorch's AdamW keeps exp_avg / exp_avg_sq in the parameters' dtype.
        state_bytes_per_element=floors_module.dtype_bytes(case.dtype),
    )
    return f, kernels


def family_floors(
    case: FamilyCase, gpu_state: dict[str, Any], settings: BenchSettings
) -> tuple[Any, int | None]:
    """(Floors or None, kernel count) of a family case: kernels of one eager training step."""
    import torch

    case.prepare()
    facts = case.facts
    if facts is None:
        raise RuntimeError(f"{case.label}: prepare() read no parameters")
    try:
        kernels = _count_family_step_kernels(case, torch.device("cuda", settings.device))
    finally:
        gc.collect()  # the counting module, its batches and optimizer states are garbage by now
        torch.cuda.empty_cache()
    bw, empty = gpu_state.get("copy_bandwidth_bytes_per_s"), gpu_state.get("empty_kernel_us")
    if not bw:
        return None, kernels
    return family_step_floors(facts, kernels, bw, empty), kernels


def _count_family_step_kernels(case: FamilyCase, device: Any) -> int | None:
    """Kernels of the second eager step of a fresh copy of the family's module (the first makes the states)."""
    module, datamodule = build_family(case.cfg)
    module.to(device).train()
    step = eager_family_step(module, module_optimizer(module), family_batches(datamodule, device, count=2))
    with warnings.catch_warnings():
        # training_step's self.log warns on every call without a Trainer; it logs nothing either way.
        warnings.simplefilter("ignore")
        step(0)
        return count_kernels(lambda: step(1))
