"""Which part of a decode step launched each kernel: profiler ranges around the parts, and the
attribution of a profiled step's kernels to layers and parts.

A CUDA graph hides which module launched what, so the step report profiles one eager step with a
host range (``l2l::<part>``) around every Linear, the embedding, the attention call and each
elementwise function, and matches each kernel to the range its launch call happened in, through
the profiler's correlation ids (or, failing those, launch order).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

if TYPE_CHECKING:
    from l2lightning.decode.session import DecodeSession

RANGE_PREFIX = "l2l::"
# Host calls that put one kernel, copy or fill on a stream (floors.LAUNCH_API_NAMES and relatives).
_LAUNCH_NAMES = frozenset(
    {
        "cudaLaunchKernel",
        "cudaLaunchKernelExC",
        "cudaLaunchKernelEx",
        "cuLaunchKernel",
        "cuLaunchKernelEx",
        "cudaLaunchCooperativeKernel",
        "cudaMemcpyAsync",
        "cudaMemsetAsync",
        "cudaMemcpy2DAsync",
    }
)
# Finer roles -> the groups the step report shows as its phases.
ROLE_GROUPS = {
    "qkv": "linear",
    "o_proj": "linear",
    "gate_up": "linear",
    "down": "linear",
    "lm_head": "lm_head",
    "attention": "attention",
    "attention_prepare": "attention",
    "rms_norm": "elementwise",
    "add_rms_norm": "elementwise",
    "qkv_rope": "elementwise",
    "silu_mul": "elementwise",
    "embed": "other",
    "other": "other",
    "unattributed": "other",
}


@dataclass(frozen=True)
class ProfEvent:
    """One profiler event, reduced to what the kernel attribution needs (times in µs)."""

    name: str
    start_us: float
    end_us: float
    on_device: bool
    id: int = 0  # correlation id: a kernel's equals its launch call's
    linked: int = 0  # a kernel's linked correlation id: the host op (or range) it was launched in


def prof_events(prof: Any) -> list[ProfEvent]:
    """A ``torch.profiler.profile``'s events as :class:`ProfEvent` (device = CUDA-side records)."""
    cuda = torch.autograd.DeviceType.CUDA
    out = []
    for e in prof.events():
        name, tr = str(e.name), e.time_range
        on_device = getattr(e, "device_type", None) == cuda
        if on_device and (name.startswith(RANGE_PREFIX) or getattr(e, "is_user_annotation", False)):
            continue  # a host range drawn on the device timeline, not a kernel
        out.append(
            ProfEvent(
                name,
                float(tr.start),
                float(tr.end),
                on_device,
                int(getattr(e, "id", 0) or 0),
                int(getattr(e, "linked_correlation_id", 0) or 0),
            )
        )
    return out


def _launch_base(name: str) -> str:
    """``cudaLaunchKernel_v7000`` / ``..._ptsz`` -> ``cudaLaunchKernel``."""
    return re.sub(r"(_v\d+|_pt[sd]z)+$", "", name)


def attribute_kernels(events: list[ProfEvent]) -> tuple[list[dict[str, Any]], str]:
    """Which part of a decode step launched each device-side event of one profiled eager step.

    Ranges are the ``l2l::`` host ranges :func:`profile_ranges` opens around each Linear
    (``layers.3.qkv``, ``lm_head``), the embedding, the attention call and each elementwise function.
    A kernel's launch time is that of the host launch call with its correlation id, else the start
    of the host op its linked correlation id names (the op it was launched in); a time after the
    kernel's own start is not believed. When some kernel has no time that way and there are as
    many launch calls as kernels, the k-th launch call is taken for the k-th kernel (one stream).
    A kernel's role is the innermost range around its launch (``"other"`` outside every range,
    ``"unattributed"`` without a launch time); its layer is the last ``layers.<i>.qkv`` range begun
    before it, ``None`` before the first layer and from the LM head on. Returns (rows in device
    order, method: ``"correlation"``, ``"order"``, ``"partial"`` or ``"none"``).
    """
    ranges = [
        (e.name[len(RANGE_PREFIX) :], e.start_us, e.end_us)
        for e in events
        if not e.on_device and e.name.startswith(RANGE_PREFIX)
    ]
    launches, ops = [], []
    for e in events:
        if not e.on_device:
            (launches if _launch_base(e.name) in _LAUNCH_NAMES else ops).append(e)
    launches.sort(key=lambda e: e.start_us)
    kernels = sorted((e for e in events if e.on_device), key=lambda e: e.start_us)
    # CUPTI ids (kernels, launch calls) and torch op ids are separate counters: look each up only
    # among its own kind.
    launch_at: dict[int, float] = {}
    for e in launches:
        if e.id:
            launch_at.setdefault(e.id, e.start_us)
    op_at: dict[int, float] = {}
    for e in ops:
        if e.id:
            op_at.setdefault(e.id, e.start_us)
    host: list[float | None] = []
    for k in kernels:
        t = launch_at.get(k.id) if k.id else None
        if t is None and k.linked:
            t = op_at.get(k.linked)
        host.append(t if t is not None and t <= k.start_us else None)
    method = "correlation"
    if kernels and any(t is None for t in host):
        if len(launches) == len(kernels):
            host, method = [e.start_us for e in launches], "order"
        else:
            method = "partial" if any(t is not None for t in host) else "none"
    marks = sorted(
        (start, int(m.group(1)))
        for name, start, _ in ranges
        if (m := re.fullmatch(r"layers\.(\d+)\.qkv", name)) is not None
    )
    head_start = min((start for name, start, _ in ranges if name == "lm_head"), default=math.inf)
    rows = []
    for k, t in zip(kernels, host):
        role, layer = "unattributed", None
        if t is not None:
            around = [(start, -(end - start), name) for name, start, end in ranges if start <= t <= end]
            name = max(around)[2] if around else None  # innermost: the latest start, then the shortest
            role = "other" if name is None else name.rsplit(".", 1)[-1]
            if t < head_start:
                before = [i for start, i in marks if start <= t]
                layer = before[-1] if before else None
        rows.append(
            {
                "name": k.name,
                "start_us": k.start_us,
                "time_us": k.end_us - k.start_us,
                "role": role,
                "layer": layer,
            }
        )
    return rows, method


class _RangedAttention:
    """An attention backend whose calls open ``l2l::attention`` profiler ranges."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner

    def prepare(self, cache_lens: torch.Tensor) -> None:
        with torch.profiler.record_function(RANGE_PREFIX + "attention_prepare"):
            self.inner.prepare(cache_lens)

    def __call__(self, *args: Any) -> torch.Tensor:
        with torch.profiler.record_function(RANGE_PREFIX + "attention"):
            return self.inner(*args)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def _ranged(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    def call(*args: Any, **kwargs: Any) -> Any:
        with torch.profiler.record_function(RANGE_PREFIX + name):
            return fn(*args, **kwargs)

    return call


@contextlib.contextmanager
def profile_ranges(session: DecodeSession) -> Iterator[None]:
    """While open, an eager step of `session` marks its parts with ``l2l::`` profiler ranges: each
    Linear and the embedding under its module name (``layers.3.qkv``, ``lm_head``), the attention
    call, and each elementwise function. Forward hooks and wrappers only: nothing is recorded into
    a graph, and the model and state are restored on exit."""
    state = session.state
    handles: list[Any] = []
    open_ranges: dict[str, Any] = {}

    def pre(name: str) -> Callable[..., None]:
        def hook(module: nn.Module, args: Any) -> None:
            rf = torch.profiler.record_function(RANGE_PREFIX + name)
            rf.__enter__()
            open_ranges[name] = rf

        return hook

    def post(name: str) -> Callable[..., None]:
        def hook(module: nn.Module, args: Any, output: Any) -> None:
            rf = open_ranges.pop(name, None)
            if rf is not None:
                rf.__exit__(None, None, None)

        return hook

    saved_fns, saved_attention = state.fns, state.attention
    try:
        for name, module in session.model.named_modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                handles.append(module.register_forward_pre_hook(pre(name)))
                handles.append(module.register_forward_hook(post(name)))
        f = saved_fns
        state.fns = dataclasses.replace(
            f,
            rms_norm=_ranged("rms_norm", f.rms_norm),
            add_rms_norm=_ranged("add_rms_norm", f.add_rms_norm),
            qkv_rope=_ranged("qkv_rope", f.qkv_rope),
            silu_mul=_ranged("silu_mul", f.silu_mul),
        )
        if saved_attention is not None:
            state.attention = _RangedAttention(saved_attention)  # type: ignore[assignment]
        yield
    finally:
        for h in handles:
            h.remove()
        for rf in open_ranges.values():
            rf.__exit__(None, None, None)
        state.fns, state.attention = saved_fns, saved_attention
