"""Attention backends: one implementation bound to a layout, cache capacity and length bucket.

A decode step calls its backend once per layer inside the step's CUDA graph, so whatever does not
change between steps (kernel compilation, split count and workspace, the torch path's row offsets,
FlashInfer's wrapper and buffers) is made once here, before any capture. ``prepare`` computes
per-step metadata inside the graph (once for all layers); ``before_replay`` is the host work a
graph needs before each replay (FlashInfer's plan).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from l2lightning.decode.checks import DecodeLayout, resolve_scale, resolve_window
from l2lightning.decode.flashinfer_adapter import (
    FlashInferBatchDecode,
    flashinfer_layout_reason,
    flashinfer_single_decode,
    flashinfer_unavailable_reason,
)
from l2lightning.decode.kernel import (
    HEAD_DIMS,
    KERNEL_DTYPES,
    DecodeWorkspace,
    KernelConfig,
    decode_attention,
    device_index_of,
    device_sm_count,
    load_decode_kernel,
    plan_launch,
)
from l2lightning.decode.torch_attention import torch_append, torch_attend, torch_metadata

# "flashinfer_single" attends over a cache exactly as long as its keys, so it is measured alone
# (choose_attention with explicit specs) and never offered to a session: see FlashInferSingleBackend.
IMPLEMENTATIONS = ("kernel", "torch", "flashinfer", "flashinfer_single")
FLASHINFER_IMPLEMENTATIONS = ("flashinfer", "flashinfer_single")


@dataclass(frozen=True)
class AttentionSpec:
    """One candidate implementation: ``impl`` in ("kernel", "torch", "flashinfer",
    "flashinfer_single"), kernel knobs.

    ``splits`` / ``heads_per_block`` = None take the kernel's defaults for the length bucket.
    """

    impl: str
    splits: int | None = None
    heads_per_block: int | None = None

    def __post_init__(self) -> None:
        if self.impl not in IMPLEMENTATIONS:
            raise ValueError(f"`impl` must be one of {IMPLEMENTATIONS}, got {self.impl!r}")

    @property
    def label(self) -> str:
        if self.impl != "kernel":
            return self.impl
        parts = [
            f"s={self.splits}" if self.splits else "",
            f"hpb={self.heads_per_block}" if self.heads_per_block else "",
        ]
        inner = ",".join(p for p in parts if p)
        return f"kernel({inner})" if inner else "kernel"


def implementation_of(label: str) -> str:
    """The implementation a spec's or backend's label names: every label starts with it
    (``kernel(s=4,hpb=3)`` -> ``kernel``, ``torch(window=512)`` -> ``torch``)."""
    return label.partition("(")[0]


class AttentionBackend:
    """An implementation bound to one layout, cache capacity and length bucket (``window``).

    ``prepare(cache_lens)`` runs once per step before the layers (inside the graph: per-step
    metadata such as the torch path's mask); ``before_replay(cached)`` runs on the host before each
    replay (FlashInfer's plan); calling it appends and attends for one layer.
    """

    def __init__(
        self,
        spec: AttentionSpec,
        batch: int,
        heads: int,
        kv_heads: int,
        head_dim: int,
        max_len: int,
        window: int,
        dtype: torch.dtype,
        device: torch.device,
        scale: float | None = None,
    ) -> None:
        self.spec = spec
        self.batch, self.heads, self.kv_heads, self.head_dim = batch, heads, kv_heads, head_dim
        self.max_len, self.window, self.dtype, self.device = (
            max_len,
            resolve_window(window, max_len),
            dtype,
            device,
        )
        self.scale = resolve_scale(scale, head_dim)

    @property
    def layout(self) -> DecodeLayout:
        return DecodeLayout(self.batch, self.heads, self.kv_heads, self.head_dim, self.max_len)

    def prepare(self, cache_lens: torch.Tensor) -> None:
        """Per-step metadata (default: none)."""

    def before_replay(self, cached: int) -> None:
        """Host-side work before a graph replay at `cached` tokens (default: none)."""

    def __call__(
        self,
        q: torch.Tensor,
        k_new: torch.Tensor,
        v_new: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        cache_lens: torch.Tensor,
    ) -> torch.Tensor:
        raise NotImplementedError

    @property
    def label(self) -> str:
        return self.spec.label


class KernelBackend(AttentionBackend):
    """kernels/decode_attention.cu with splits fixed for the bucket and a private workspace."""

    def __init__(self, spec: AttentionSpec, *args: Any, **kwargs: Any) -> None:
        super().__init__(spec, *args, **kwargs)
        device_index = device_index_of(self.device)
        self.launch = plan_launch(
            self.batch,
            self.heads,
            self.kv_heads,
            self.head_dim,
            self.window,
            config=KernelConfig(spec.heads_per_block) if spec.heads_per_block else None,
            splits=spec.splits or None,
            sm_count=device_sm_count(device_index),
        )
        self.config, self.splits = self.launch.config, self.launch.splits
        self.workspace = DecodeWorkspace.for_launch(self.launch, self.head_dim, self.device)
        # compiled now: a graph capture cannot compile
        load_decode_kernel(device_index, self.head_dim, self.dtype, self.config)

    def __call__(
        self,
        q: torch.Tensor,
        k_new: torch.Tensor,
        v_new: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        cache_lens: torch.Tensor,
    ) -> torch.Tensor:
        return decode_attention(
            q,
            k_new,
            v_new,
            k_cache,
            v_cache,
            cache_lens,
            scale=self.scale,
            splits=self.splits,
            workspace=self.workspace,
            config=self.config,
        )

    @property
    def label(self) -> str:
        return f"kernel(s={self.splits},hpb={self.config.heads_per_block})"


class TorchBackend(AttentionBackend):
    """index_copy_ + SDPA over the bucket's window; mask and rows computed once per step.

    The FlashInfer backends append the same way and replace only :meth:`attend`.
    """

    def __init__(self, spec: AttentionSpec, *args: Any, **kwargs: Any) -> None:
        super().__init__(spec, *args, **kwargs)
        self._row_base = (torch.arange(self.batch * self.kv_heads, device=self.device) * self.max_len).view(
            self.batch, self.kv_heads
        )
        self._positions = torch.arange(self.window, device=self.device)
        self._meta: tuple[torch.Tensor, torch.Tensor] | None = None
        self._meta_lens: torch.Tensor | None = None

    def prepare(self, cache_lens: torch.Tensor) -> None:
        self._meta = torch_metadata(
            cache_lens, self.batch, self.kv_heads, self.max_len, self.window, self._row_base, self._positions
        )
        self._meta_lens = cache_lens

    def __call__(
        self,
        q: torch.Tensor,
        k_new: torch.Tensor,
        v_new: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        cache_lens: torch.Tensor,
    ) -> torch.Tensor:
        mask = self._append(k_new, v_new, k_cache, v_cache, cache_lens)
        return self.attend(q.reshape(self.batch, self.heads, -1), k_cache, v_cache, mask).view(q.shape)

    def attend(
        self, q3: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, mask: torch.Tensor
    ) -> torch.Tensor:
        """Attention of q [B, H, D] over the caches the new key/value are already in: [B, H, D]."""
        return torch_attend(q3, k_cache, v_cache, mask, self.scale, self.window)

    def _append(
        self,
        k_new: torch.Tensor,
        v_new: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        cache_lens: torch.Tensor,
    ) -> torch.Tensor:
        """Write the new keys and values into the caches (index_copy_); returns the window's mask."""
        if self._meta is None or self._meta_lens is not cache_lens:
            self.prepare(cache_lens)
        rows, mask = self._meta
        torch_append(
            k_new.reshape(self.batch, self.kv_heads, -1),
            v_new.reshape(self.batch, self.kv_heads, -1),
            k_cache,
            v_cache,
            rows,
        )
        return mask

    @property
    def label(self) -> str:
        return f"torch(window={self.window})"


class FlashInferBackend(TorchBackend):
    """FlashInfer batch decode (graph mode: re-planned on the host before each replay); torch append."""

    def __init__(self, spec: AttentionSpec, *args: Any, **kwargs: Any) -> None:
        super().__init__(spec, *args, **kwargs)
        self.fi = FlashInferBatchDecode(self.layout, self.dtype, self.device, self.scale)

    def before_replay(self, cached: int) -> None:
        self.fi.plan(cached)

    def attend(
        self, q3: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, mask: torch.Tensor
    ) -> torch.Tensor:
        if self.fi.planned is None:
            raise RuntimeError(
                "FlashInfer backend: call before_replay(cached) before the first call (it plans on the host)"
            )
        return self.fi.run(q3 if q3.is_contiguous() else q3.contiguous(), k_cache, v_cache)

    @property
    def label(self) -> str:
        return "flashinfer"


class FlashInferSingleBackend(TorchBackend):
    """FlashInfer's single-request decode over the whole cache of one sequence; torch append.

    ``single_decode_with_kv_cache`` attends over every position of the tensor it gets and takes
    its length from the shape, so this backend serves batch 1, a window that is the whole cache
    (``window == max_len``), and a step at exactly ``max_len - 1`` cached tokens: the shape
    :func:`choose_attention` times each candidate at. It measures FlashInfer's simplest decode path
    next to the others; a session (whose length moves within a bucket) cannot use it.
    """

    def __init__(self, spec: AttentionSpec, *args: Any, **kwargs: Any) -> None:
        super().__init__(spec, *args, **kwargs)
        if self.batch != 1:
            raise ValueError(f"flashinfer_single serves one sequence: `batch` must be 1, got {self.batch}")
        if self.window != self.max_len:
            raise ValueError(
                f"flashinfer_single attends over its whole cache: `window` ({self.window}) must equal "
                f"`max_len` ({self.max_len})"
            )
        reason = flashinfer_unavailable_reason() or flashinfer_layout_reason(self.heads, self.kv_heads)
        if reason:
            raise RuntimeError(reason)

    def before_replay(self, cached: int) -> None:
        if cached != self.max_len - 1:
            raise ValueError(
                f"flashinfer_single attends over all {self.max_len} cache positions: a step must have "
                f"{self.max_len - 1} cached tokens, got {cached}"
            )

    def attend(
        self, q3: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, mask: torch.Tensor
    ) -> torch.Tensor:
        return flashinfer_single_decode(q3[0], k_cache[0], v_cache[0], self.scale).unsqueeze(0)

    @property
    def label(self) -> str:
        return "flashinfer_single"


_BACKENDS = {
    "kernel": KernelBackend,
    "torch": TorchBackend,
    "flashinfer": FlashInferBackend,
    "flashinfer_single": FlashInferSingleBackend,
}


def make_backend(
    spec: AttentionSpec,
    *,
    batch: int,
    heads: int,
    kv_heads: int,
    head_dim: int,
    max_len: int,
    window: int | None = None,
    dtype: torch.dtype,
    device: torch.device | str,
    scale: float | None = None,
) -> AttentionBackend:
    """Build the backend for `spec` (compiles kernels / plans nothing yet; call before a capture)."""
    layout = DecodeLayout(batch, heads, kv_heads, head_dim, max_len)
    return backend_for_layout(spec, layout, window=window, dtype=dtype, device=device, scale=scale)


def backend_for_layout(
    spec: AttentionSpec,
    layout: DecodeLayout,
    *,
    window: int | None = None,
    dtype: torch.dtype,
    device: torch.device | str,
    scale: float | None = None,
) -> AttentionBackend:
    """:func:`make_backend` for a :class:`DecodeLayout` (``window`` None: the whole cache)."""
    if not isinstance(spec, AttentionSpec):
        raise TypeError(f"`spec` must be an AttentionSpec, got {type(spec).__name__}")
    lay = layout
    return _BACKENDS[spec.impl](
        spec,
        lay.batch,
        lay.heads,
        lay.kv_heads,
        lay.head_dim,
        lay.max_len,
        window if window is not None else lay.max_len,
        dtype,
        torch.device(device),
        scale,
    )


def unavailable_reason(
    impl: str,
    head_dim: int,
    dtype: torch.dtype,
    device: torch.device | str,
    *,
    heads: int | None = None,
    kv_heads: int | None = None,
) -> str | None:
    """Why `impl` cannot run this layout here, or None. With `heads` and `kv_heads`, FlashInfer's
    group sizes are checked too (its decode kernels are compiled for a few only)."""
    device = torch.device(device)
    if impl == "torch":
        return None
    if impl not in IMPLEMENTATIONS:
        raise ValueError(f"unknown implementation {impl!r}; known: {IMPLEMENTATIONS}")
    if device.type != "cuda":
        return f"{impl} needs a CUDA device, got {device}"
    if impl in FLASHINFER_IMPLEMENTATIONS:
        layout = None if heads is None or kv_heads is None else flashinfer_layout_reason(heads, kv_heads)
        return flashinfer_unavailable_reason() or layout
    from l2lightning._env import cuda_unavailable_reason, cupy_unavailable_reason

    if head_dim not in HEAD_DIMS:
        return f"the kernel supports head_dim {HEAD_DIMS}, not {head_dim}"
    if dtype not in KERNEL_DTYPES:
        return f"the kernel supports bfloat16 and float16, not {dtype}"
    return cuda_unavailable_reason() or cupy_unavailable_reason()
