"""Decode attention: one new token per sequence appends its key/value to the KV cache and attends over it.

Implementations with one signature, ``f(q, k_new, v_new, k_cache, v_cache, cache_lens, *, scale=None,
splits=None, workspace=None, window=None) -> out``:

- :func:`decode_attention`: kernels/decode_attention.cu, append + split-K attention + merge in one
  launch (bf16/fp16, head dim 64 or 128, any grouped-query layout, CUDA graph safe).
- :func:`torch_decode_attention`: ``index_copy_`` append + ``F.scaled_dot_product_attention`` with
  the query heads of a group folded into the query length (GQA without copying K/V), masked to the
  cache length. Runs anywhere, CPU included.
- :func:`flashinfer_decode_attention`: FlashInfer's paged decode, the cache seen as one page per
  sequence (only where ``import flashinfer`` works).
- :func:`reference_decode_attention`: float64 math returning float32, for tests; it does not write
  the cache.

Shapes: ``q`` [B, H, D] (or [B, H, 1, D]), ``k_new``/``v_new`` [B, KVH, D] (or [B, KVH, 1, D]),
caches [B, KVH, max_len, D] (contiguous, written in place), ``cache_lens`` int32 [B] on the device:
tokens already cached. Each call writes the new key/value at position ``cache_lens[b]`` and attends
over ``cache_lens[b] + 1`` keys; it does not advance ``cache_lens`` (the caller does, once per step
for all layers). Because the length lives on the device, a CUDA graph replays at any length.

:func:`choose_attention` times every available implementation inside CUDA graphs (CUDA-event
medians, candidates interleaved) for one layout and length bucket and returns an
:class:`AttentionChoice`; ``python -m l2lightning.decode.attention --sanitize`` runs a few small
launches for ``compute-sanitizer``.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import math
import statistics
import sys
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from l2lightning.capture import graph_capture

KERNEL_FILE = "decode_attention.cu"
KERNEL_NAME = "l2l_decode_attention"
HEAD_DIMS = (64, 128)
KERNEL_DTYPES = (torch.bfloat16, torch.float16)
MAX_SPLITS = 128  # L2L_MAX_SPLITS in the kernel: the merge keeps one weight per split in shared memory
MAX_HEADS_PER_BLOCK = 8
# The last block reads splits x heads_per_block partial rows; past ~256 rows its merge costs more
# than the extra parallelism buys (a rule of thumb, not a measurement: choose_attention measures).
MERGE_ROW_BUDGET = 256
LOG2E = 1.4426950408889634
IMPLEMENTATIONS = ("kernel", "torch", "flashinfer")
FLASHINFER_INSTALL_HINT = (
    "install FlashInfer for your torch/CUDA build (see https://docs.flashinfer.ai/installation.html)"
)


# ------------------------------------------------------------------------------------------ shapes
@dataclass(frozen=True)
class _Shapes:
    batch: int
    heads: int
    kv_heads: int
    head_dim: int
    max_len: int
    q3: torch.Tensor  # [B, H, D]
    k3: torch.Tensor  # [B, KVH, D]
    v3: torch.Tensor

    @property
    def group(self) -> int:
        return self.heads // self.kv_heads


def _squeeze_token(name: str, t: torch.Tensor, what: str) -> torch.Tensor:
    if t.dim() == 4:
        if t.shape[2] != 1:
            raise ValueError(
                f"`{name}` must hold one new token per sequence: [batch, {what}, head_dim] or "
                f"[batch, {what}, 1, head_dim], got shape {tuple(t.shape)}"
            )
        return t[:, :, 0]
    if t.dim() != 3:
        raise ValueError(
            f"`{name}` must be [batch, {what}, head_dim] (or with a length-1 third dim), got shape {tuple(t.shape)}"
        )
    return t


def _check_inputs(q: Any, k_new: Any, v_new: Any, k_cache: Any, v_cache: Any, cache_lens: Any) -> _Shapes:
    """Validate the common signature; name the offending argument in every error."""
    for name, t in (
        ("q", q),
        ("k_new", k_new),
        ("v_new", v_new),
        ("k_cache", k_cache),
        ("v_cache", v_cache),
        ("cache_lens", cache_lens),
    ):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"`{name}` must be a torch.Tensor, got {type(t).__name__}")
    if k_cache.dim() != 4:
        raise ValueError(
            f"`k_cache` must be [batch, kv_heads, max_len, head_dim], got shape {tuple(k_cache.shape)}"
        )
    if v_cache.shape != k_cache.shape:
        raise ValueError(
            f"`v_cache` shape {tuple(v_cache.shape)} differs from `k_cache` shape {tuple(k_cache.shape)}"
        )
    batch, kv_heads, max_len, head_dim = k_cache.shape
    q3 = _squeeze_token("q", q, "heads")
    k3 = _squeeze_token("k_new", k_new, "kv_heads")
    v3 = _squeeze_token("v_new", v_new, "kv_heads")
    if q3.shape[0] != batch or q3.shape[2] != head_dim:
        raise ValueError(
            f"`q` shape {tuple(q.shape)} does not match the cache (batch {batch}, head_dim {head_dim})"
        )
    heads = q3.shape[1]
    if heads % kv_heads:
        raise ValueError(f"`q` has {heads} heads, not a multiple of the cache's {kv_heads} kv heads")
    for name, t in (("k_new", k3), ("v_new", v3)):
        if tuple(t.shape) != (batch, kv_heads, head_dim):
            raise ValueError(
                f"`{name}` must be [{batch}, {kv_heads}, {head_dim}] to match the cache, got {tuple(t.shape)}"
            )
    for name, t in (("k_new", k_new), ("v_new", v_new), ("k_cache", k_cache), ("v_cache", v_cache)):
        if t.dtype != q.dtype:
            raise ValueError(
                f"`{name}` is {t.dtype} but `q` is {q.dtype}: all of q, k_new, v_new and the caches share one dtype"
            )
        if t.device != q.device:
            raise ValueError(f"`{name}` is on {t.device} but `q` is on {q.device}")
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        if not t.is_contiguous():
            raise ValueError(f"`{name}` must be contiguous: the new key/value are written into it in place")
    if cache_lens.dtype != torch.int32 or tuple(cache_lens.shape) != (batch,):
        raise ValueError(
            f"`cache_lens` must be an int32 tensor of shape ({batch},), got {cache_lens.dtype} {tuple(cache_lens.shape)}"
        )
    if cache_lens.device != q.device:
        raise ValueError(f"`cache_lens` is on {cache_lens.device} but `q` is on {q.device}")
    return _Shapes(batch, heads, kv_heads, head_dim, max_len, q3, k3, v3)


def _resolve_scale(scale: float | None, head_dim: int) -> float:
    if scale is None:
        return 1.0 / math.sqrt(head_dim)
    if (
        isinstance(scale, bool)
        or not isinstance(scale, (int, float))
        or not math.isfinite(scale)
        or scale <= 0
    ):
        raise ValueError(f"`scale` must be a positive finite number or None, got {scale!r}")
    return float(scale)


def _resolve_window(window: int | None, max_len: int) -> int:
    if window is None:
        return max_len
    if isinstance(window, bool) or not isinstance(window, int) or not 1 <= window <= max_len:
        raise ValueError(f"`window` must be an int in [1, max_len={max_len}] or None, got {window!r}")
    return window


# ------------------------------------------------------------------------------------------ kernel
@dataclass(frozen=True)
class KernelConfig:
    """Compile-time shape of the decode-attention kernel.

    Args:
        heads_per_block: query heads of one KV head that a block handles together (1 to 8); the
            group is cut into ``ceil(group / heads_per_block)`` head chunks.
        warps: warps per block.
        unroll: key rows each warp loads before using any (loads in flight per warp).
    """

    heads_per_block: int = 1
    warps: int = 4
    unroll: int = 4

    def __post_init__(self) -> None:
        for name, value, low, high in (
            ("heads_per_block", self.heads_per_block, 1, MAX_HEADS_PER_BLOCK),
            ("warps", self.warps, 1, 16),
            ("unroll", self.unroll, 1, 16),
        ):
            if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
                raise ValueError(f"`{name}` must be an int in [{low}, {high}], got {value!r}")

    @property
    def threads(self) -> int:
        return self.warps * 32

    def granule(self, head_dim: int) -> int:
        """Keys one block covers per iteration: split chunks are rounded up to this."""
        return self.warps * (32 // (head_dim // 8)) * self.unroll

    def defines(self, head_dim: int, dtype: torch.dtype) -> tuple[str, ...]:
        out = (
            f"L2L_HEAD_DIM={head_dim}",
            f"L2L_HEADS_PER_BLOCK={self.heads_per_block}",
            f"L2L_WARPS={self.warps}",
            f"L2L_UNROLL={self.unroll}",
            f"L2L_MAX_SPLITS={MAX_SPLITS}",
        )
        return out + (("L2L_BF16",) if dtype == torch.bfloat16 else ())


def default_heads_per_block(group: int) -> int:
    """The whole group in one block up to 8 heads; larger groups in balanced chunks of at most 8."""
    chunks = -(-group // MAX_HEADS_PER_BLOCK)
    return -(-group // chunks)


def default_splits(units: int, max_len_bucket: int, heads_per_block: int, granule: int, sm_count: int) -> int:
    """Splits for one launch: about one block per SM, no chunk smaller than `granule` keys at the
    bucket's length, and a merge of at most MERGE_ROW_BUDGET partial rows."""
    by_parallelism = -(-sm_count // max(units, 1))
    by_length = -(-max_len_bucket // granule)
    by_merge = max(1, MERGE_ROW_BUDGET // heads_per_block)
    return max(1, min(by_parallelism, by_length, by_merge, MAX_SPLITS))


@functools.cache
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


class DecodeWorkspace:
    """Split partials and merge tickets for :func:`decode_attention`.

    One workspace serves every layer of a step (launches on one stream run one after another). Two
    launches that may run at the same time (two streams, two graphs replayed concurrently) need two
    workspaces. The tickets start at 0 and every launch leaves them at 0.

    Args:
        units: ``batch * kv_heads * head_chunks``.
        splits: the launch's split count.
        heads_per_block: the kernel's heads per block.
        head_dim: 64 or 128.
        device: a CUDA device.
    """

    def __init__(
        self, units: int, splits: int, heads_per_block: int, head_dim: int, device: torch.device | str
    ) -> None:
        self.units, self.splits, self.heads_per_block, self.head_dim = (
            units,
            splits,
            heads_per_block,
            head_dim,
        )
        rows = units * splits * heads_per_block
        self.part_acc = torch.empty(rows * head_dim, dtype=torch.float32, device=device)
        self.part_ml = torch.empty(rows * 2, dtype=torch.float32, device=device)
        self.tickets = torch.zeros(units, dtype=torch.int32, device=device)

    def fits(self, units: int, splits: int, heads_per_block: int, head_dim: int) -> bool:
        return (units, splits, heads_per_block, head_dim) == (
            self.units,
            self.splits,
            self.heads_per_block,
            self.head_dim,
        )


_WORKSPACES: dict[tuple, DecodeWorkspace] = {}


def _launch(kernel: Any, grid: tuple[int, int], block: int, args: tuple, device_index: int) -> None:
    """Launch a 2-D grid on torch's current stream (what _kernels.launch does for 1-D grids)."""
    import cupy

    from l2lightning import _kernels

    stream = torch.cuda.current_stream(device_index)
    wrap = getattr(_kernels, "_external_stream", None)  # cached CuPy wrapper of a torch stream
    with cupy.cuda.Device(device_index):
        ext = (
            wrap(stream.cuda_stream, device_index)
            if wrap
            else cupy.cuda.ExternalStream(stream.cuda_stream, device_index)
        )
        with ext:
            kernel(grid, (block,), args)


def load_decode_kernel(device_index: int, head_dim: int, dtype: torch.dtype, config: KernelConfig) -> Any:
    """Compile (once) and return the kernel for this configuration; call before a graph capture."""
    from l2lightning._kernels import get_function, require_gpu_kernels

    require_gpu_kernels("decode_attention()")
    return get_function(KERNEL_FILE, KERNEL_NAME, device_index, config.defines(head_dim, dtype))


def decode_attention(
    q: torch.Tensor,
    k_new: torch.Tensor,
    v_new: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cache_lens: torch.Tensor,
    *,
    scale: float | None = None,
    splits: int | None = None,
    workspace: DecodeWorkspace | None = None,
    window: int | None = None,
    config: KernelConfig | None = None,
) -> torch.Tensor:
    """Append the new key/value at ``cache_lens`` and attend over the cache, in one kernel launch.

    Args:
        q, k_new, v_new, k_cache, v_cache, cache_lens: see the module docstring (bf16 or fp16, head
            dim 64 or 128, CUDA, 16-byte aligned).
        scale: softmax scale, default ``1/sqrt(head_dim)``.
        splits: blocks per (sequence, kv head, head chunk); fixed for a graph. Default: sized for
            ``window`` (or ``max_len``) by :func:`default_splits`.
        workspace: a :class:`DecodeWorkspace` matching the launch; default: one cached per shape
            and device (not safe for launches running concurrently on two streams).
        window: the length bucket the launch is sized for (only used for the default ``splits``);
            the kernel always attends over exactly ``cache_lens + 1`` keys.
        config: a :class:`KernelConfig`; default: the whole group per block.

    Returns:
        The attention output, shaped like ``q``. A ``cache_lens`` entry outside ``[0, max_len)``
        gives NaN for that sequence and appends nothing.

    Example:
        >>> out = decode_attention(q, k, v, k_cache, v_cache, lens)  # doctest: +SKIP
        >>> lens += 1  # the caller advances the length, once per step  # doctest: +SKIP
    """
    import numpy as np

    from l2lightning._kernels import require_gpu_kernels

    require_gpu_kernels("decode_attention()")
    shp = _check_inputs(q, k_new, v_new, k_cache, v_cache, cache_lens)
    if q.device.type != "cuda":
        raise ValueError(
            f"`q` must be a CUDA tensor for the kernel, got a tensor on {q.device}; use torch_decode_attention on CPU"
        )
    if q.dtype not in KERNEL_DTYPES:
        raise ValueError(f"`q` dtype must be bfloat16 or float16 for the kernel, got {q.dtype}")
    if shp.head_dim not in HEAD_DIMS:
        raise ValueError(f"head_dim must be one of {HEAD_DIMS} for the kernel, got {shp.head_dim}")
    if config is None:
        config = KernelConfig(heads_per_block=default_heads_per_block(shp.group))
    elif not isinstance(config, KernelConfig):
        raise TypeError(f"`config` must be a KernelConfig or None, got {type(config).__name__}")
    scale = _resolve_scale(scale, shp.head_dim)
    window = _resolve_window(window, shp.max_len)
    hpb = config.heads_per_block
    head_chunks = -(-shp.group // hpb)
    units = shp.batch * shp.kv_heads * head_chunks
    if units > 65535:
        raise ValueError(
            f"batch * kv_heads * head_chunks = {units} exceeds the 65535 grid rows of one launch"
        )
    device_index = q.device.index if q.device.index is not None else torch.cuda.current_device()
    granule = config.granule(shp.head_dim)
    if splits is None:
        splits = default_splits(units, window, hpb, granule, _sm_count(device_index))
    elif isinstance(splits, bool) or not isinstance(splits, int) or not 1 <= splits <= MAX_SPLITS:
        raise ValueError(f"`splits` must be an int in [1, {MAX_SPLITS}] or None, got {splits!r}")
    if workspace is None:
        key = (device_index, units, splits, hpb, shp.head_dim)
        workspace = _WORKSPACES.get(key)
        if workspace is None:
            if torch.cuda.is_current_stream_capturing():
                raise RuntimeError(
                    "decode_attention() needs a workspace allocated before a CUDA graph capture: pass `workspace=` "
                    "or call it once with the same shapes before capturing"
                )
            workspace = _WORKSPACES[key] = DecodeWorkspace(units, splits, hpb, shp.head_dim, q.device)
    elif not isinstance(workspace, DecodeWorkspace):
        raise TypeError(f"`workspace` must be a DecodeWorkspace or None, got {type(workspace).__name__}")
    elif not workspace.fits(units, splits, hpb, shp.head_dim):
        raise ValueError(
            f"`workspace` was made for (units, splits, heads_per_block, head_dim) = ({workspace.units}, {workspace.splits}, "
            f"{workspace.heads_per_block}, {workspace.head_dim}); this launch needs ({units}, {splits}, {hpb}, {shp.head_dim})"
        )
    if not cache_lens.is_contiguous():
        raise ValueError("`cache_lens` must be contiguous: the kernel reads cache_lens[b] by index")
    q3, k3, v3 = (t if t.is_contiguous() else t.contiguous() for t in (shp.q3, shp.k3, shp.v3))
    out = torch.empty((shp.batch, shp.heads, shp.head_dim), dtype=q.dtype, device=q.device)
    for name, t in (("q", q3), ("k_new", k3), ("v_new", v3), ("k_cache", k_cache), ("v_cache", v_cache)):
        if t.data_ptr() % 16:
            raise ValueError(
                f"`{name}` must start on a 16-byte boundary for the kernel's vector loads (data_ptr {t.data_ptr():#x})"
            )
    kernel = load_decode_kernel(device_index, shp.head_dim, q.dtype, config)
    ptr = np.uint64
    args = (
        ptr(q3.data_ptr()),
        ptr(k3.data_ptr()),
        ptr(v3.data_ptr()),
        ptr(k_cache.data_ptr()),
        ptr(v_cache.data_ptr()),
        ptr(cache_lens.data_ptr()),
        ptr(out.data_ptr()),
        ptr(workspace.part_acc.data_ptr()),
        ptr(workspace.part_ml.data_ptr()),
        ptr(workspace.tickets.data_ptr()),
        np.int32(shp.heads),
        np.int32(shp.kv_heads),
        np.int32(head_chunks),
        np.int32(shp.max_len),
        np.int32(splits),
        np.int32(granule),
        np.float32(scale * LOG2E),
    )
    _launch(kernel, (splits, units), config.threads, args, device_index)
    return out.view(q.shape)


# ------------------------------------------------------------------------------------------ torch
def _torch_metadata(
    cache_lens: torch.Tensor,
    batch: int,
    kv_heads: int,
    max_len: int,
    window: int,
    row_base: torch.Tensor | None = None,
    positions: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(cache rows to write, [B, 1, 1, window] bool mask of attended positions); no host sync."""
    device = cache_lens.device
    if row_base is None:
        row_base = (torch.arange(batch * kv_heads, device=device) * max_len).view(batch, kv_heads)
    if positions is None:
        positions = torch.arange(window, device=device)
    lens = cache_lens.long()
    rows = (row_base + lens[:, None]).reshape(-1)
    mask = (positions[None, :] <= lens[:, None]).view(batch, 1, 1, window)
    return rows, mask


def _torch_append(
    k3: torch.Tensor, v3: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, rows: torch.Tensor
) -> None:
    d = k_cache.shape[-1]
    k_cache.view(-1, d).index_copy_(0, rows, k3.reshape(-1, d))
    v_cache.view(-1, d).index_copy_(0, rows, v3.reshape(-1, d))


def _torch_attend(
    q3: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    mask: torch.Tensor,
    scale: float,
    window: int,
) -> torch.Tensor:
    # The G query heads of a KV head become G query rows against that head's keys: GQA without
    # repeat_interleave, and the K/V of a group are read once.
    batch, kv_heads, _, d = k_cache.shape
    heads = q3.shape[1]
    q4 = q3.reshape(batch, kv_heads, heads // kv_heads, d)
    out = F.scaled_dot_product_attention(
        q4, k_cache[:, :, :window], v_cache[:, :, :window], attn_mask=mask, scale=scale
    )
    return out.reshape(batch, heads, d)


def torch_decode_attention(
    q: torch.Tensor,
    k_new: torch.Tensor,
    v_new: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cache_lens: torch.Tensor,
    *,
    scale: float | None = None,
    splits: int | None = None,
    workspace: Any = None,
    window: int | None = None,
) -> torch.Tensor:
    """PyTorch path with the signature of :func:`decode_attention` (``splits``/``workspace`` unused).

    ``window`` limits the attended cache prefix to ``window`` positions (it must cover
    ``cache_lens + 1``); the default reads all ``max_len`` positions through the mask.
    """
    shp = _check_inputs(q, k_new, v_new, k_cache, v_cache, cache_lens)
    scale = _resolve_scale(scale, shp.head_dim)
    window = _resolve_window(window, shp.max_len)
    rows, mask = _torch_metadata(cache_lens, shp.batch, shp.kv_heads, shp.max_len, window)
    _torch_append(shp.k3, shp.v3, k_cache, v_cache, rows)
    return _torch_attend(shp.q3, k_cache, v_cache, mask, scale, window).view(q.shape)


def reference_decode_attention(
    q: torch.Tensor,
    k_new: torch.Tensor,
    v_new: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cache_lens: torch.Tensor,
    *,
    scale: float | None = None,
    splits: int | None = None,
    workspace: Any = None,
    window: int | None = None,
) -> torch.Tensor:
    """Float64 math, float32 result, shaped like ``q``; reads the caches, never writes them.

    The new token's key/value come from ``k_new``/``v_new`` (position ``cache_lens[b]``), so the
    result is the same before and after an implementation has appended them. Syncs with the host.
    """
    shp = _check_inputs(q, k_new, v_new, k_cache, v_cache, cache_lens)
    scale = _resolve_scale(scale, shp.head_dim)
    out = torch.empty((shp.batch, shp.heads, shp.head_dim), dtype=torch.float32, device=q.device)
    for b, n in enumerate(cache_lens.tolist()):
        if not 0 <= n < shp.max_len:
            raise ValueError(f"`cache_lens[{b}]` = {n} is outside [0, max_len={shp.max_len})")
        keys = torch.cat([k_cache[b, :, :n], shp.k3[b, :, None]], dim=1).double()  # [KVH, n+1, D]
        values = torch.cat([v_cache[b, :, :n], shp.v3[b, :, None]], dim=1).double()
        qg = shp.q3[b].double().view(shp.kv_heads, shp.group, shp.head_dim)
        probs = torch.softmax(torch.einsum("kgd,knd->kgn", qg, keys) * scale, dim=-1)
        out[b] = torch.einsum("kgn,knd->kgd", probs, values).reshape(shp.heads, shp.head_dim).float()
    return out.view(q.shape)


# ------------------------------------------------------------------------------------------ flashinfer
@functools.lru_cache(maxsize=1)
def flashinfer_unavailable_reason() -> str | None:
    """None when ``import flashinfer`` works, else why not (with the install hint)."""
    try:
        import flashinfer  # noqa: F401
    except Exception as exc:
        return f"FlashInfer is not importable ({type(exc).__name__}: {exc}); {FLASHINFER_INSTALL_HINT}"
    return None


# The query-per-KV-head group sizes FlashInfer 0.7.2's decode kernels (CUDA cores, the path
# BatchDecodeWithPagedKVCacheWrapper takes by default) are compiled for: DISPATCH_GQA_GROUP_SIZE in
# its include/flashinfer/utils.cuh. Any other raises "Unsupported group_size" at plan time (seen on
# the H200 for Qwen2.5-0.5B: 14 query heads over 2 KV heads, group 7).
FLASHINFER_DECODE_GROUP_SIZES = (1, 2, 3, 4, 6, 8, 16)


def flashinfer_layout_reason(heads: int, kv_heads: int) -> str | None:
    """Why FlashInfer's decode kernels cannot take `heads` query heads over `kv_heads`, or None."""
    if kv_heads <= 0 or heads % kv_heads:
        return f"{heads} query heads do not group evenly over {kv_heads} KV heads"
    group = heads // kv_heads
    if group not in FLASHINFER_DECODE_GROUP_SIZES:
        return (
            f"FlashInfer's decode kernels support query/KV head group sizes {FLASHINFER_DECODE_GROUP_SIZES}; "
            f"{heads} query heads over {kv_heads} KV heads is a group of {group}"
        )
    return None


class _FlashInferDecode:
    """FlashInfer's BatchDecodeWithPagedKVCacheWrapper over our cache: one page of max_len per sequence.

    The cache [B, KVH, max_len, D] is FlashInfer's HND paged layout [pages, kv_heads, page_size, D]
    with page b = sequence b. FlashInfer plans on the host: `plan(cached)` must run before each call
    (outside a graph, before each replay) with the number of cached tokens.
    """

    def __init__(
        self,
        batch: int,
        heads: int,
        kv_heads: int,
        head_dim: int,
        max_len: int,
        dtype: torch.dtype,
        device: torch.device,
        scale: float,
    ) -> None:
        reason = flashinfer_unavailable_reason() or flashinfer_layout_reason(heads, kv_heads)
        if reason:
            raise RuntimeError(reason)
        import flashinfer

        self.batch, self.heads, self.kv_heads, self.head_dim, self.max_len = (
            batch,
            heads,
            kv_heads,
            head_dim,
            max_len,
        )
        self.dtype, self.scale = dtype, scale
        self.float_workspace = torch.empty(128 << 20, dtype=torch.uint8, device=device)
        self.indptr = torch.arange(batch + 1, dtype=torch.int32, device=device)
        self.indices = torch.arange(batch, dtype=torch.int32, device=device)
        self.last_page_len = torch.ones(batch, dtype=torch.int32, device=device)
        self.wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
            self.float_workspace,
            "HND",
            use_cuda_graph=True,
            paged_kv_indptr_buffer=self.indptr,
            paged_kv_indices_buffer=self.indices,
            paged_kv_last_page_len_buffer=self.last_page_len,
        )
        self.planned: int | None = None

    def plan(self, cached: int) -> None:
        if not 0 <= cached < self.max_len:
            raise ValueError(f"cached length {cached} is outside [0, max_len={self.max_len})")
        cpu = torch.device("cpu")
        args = (
            torch.arange(self.batch + 1, dtype=torch.int32, device=cpu),
            torch.arange(self.batch, dtype=torch.int32, device=cpu),
            torch.full((self.batch,), cached + 1, dtype=torch.int32, device=cpu),
            self.heads,
            self.kv_heads,
            self.head_dim,
            self.max_len,
        )
        plan = getattr(self.wrapper, "plan", None) or self.wrapper.begin_forward
        try:
            plan(
                *args,
                pos_encoding_mode="NONE",
                q_data_type=self.dtype,
                kv_data_type=self.dtype,
                sm_scale=self.scale,
            )
        except TypeError:  # older FlashInfer: data_type, no sm_scale at plan time
            plan(*args, pos_encoding_mode="NONE", data_type=self.dtype)
        self.planned = cached

    def run(self, q3: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor:
        run = getattr(self.wrapper, "run", None)
        if run is not None:
            return run(q3, (k_cache, v_cache))
        return self.wrapper.forward(q3, (k_cache, v_cache), sm_scale=self.scale)


_FLASHINFER: dict[tuple, _FlashInferDecode] = {}


def flashinfer_decode_attention(
    q: torch.Tensor,
    k_new: torch.Tensor,
    v_new: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cache_lens: torch.Tensor,
    *,
    scale: float | None = None,
    splits: int | None = None,
    workspace: Any = None,
    window: int | None = None,
) -> torch.Tensor:
    """FlashInfer path with the signature of :func:`decode_attention` (eager use only).

    FlashInfer plans on the host, so every sequence must have the same length: ``window`` (the
    number of attended keys, ``cache_lens + 1``) when given, else ``cache_lens`` is read back (a
    host sync). Inside graphs use :func:`make_backend` with ``impl="flashinfer"``, whose
    ``before_replay`` re-plans between replays.
    """
    shp = _check_inputs(q, k_new, v_new, k_cache, v_cache, cache_lens)
    scale = _resolve_scale(scale, shp.head_dim)
    if window is None:
        lens = set(cache_lens.tolist())
        if len(lens) != 1:
            raise ValueError(
                f"flashinfer_decode_attention needs one length for all sequences, got cache_lens {sorted(lens)}"
            )
        cached = lens.pop()
    else:
        cached = _resolve_window(window, shp.max_len) - 1
    key = (q.device, shp.batch, shp.heads, shp.kv_heads, shp.head_dim, shp.max_len, q.dtype, scale)
    fi = _FLASHINFER.get(key)
    if fi is None:
        fi = _FLASHINFER[key] = _FlashInferDecode(
            shp.batch, shp.heads, shp.kv_heads, shp.head_dim, shp.max_len, q.dtype, q.device, scale
        )
    fi.plan(cached)
    rows, _ = _torch_metadata(cache_lens, shp.batch, shp.kv_heads, shp.max_len, 1)
    _torch_append(shp.k3, shp.v3, k_cache, v_cache, rows)
    return fi.run(shp.q3.contiguous(), k_cache, v_cache).view(q.shape)


# ------------------------------------------------------------------------------------------ backends
@dataclass(frozen=True)
class AttentionSpec:
    """One candidate implementation: ``impl`` in ("kernel", "torch", "flashinfer"), kernel knobs.

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
            _resolve_window(window, max_len),
            dtype,
            device,
        )
        self.scale = _resolve_scale(scale, head_dim)

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
        group = self.heads // self.kv_heads
        self.config = KernelConfig(heads_per_block=spec.heads_per_block or default_heads_per_block(group))
        units = self.batch * self.kv_heads * -(-group // self.config.heads_per_block)
        device_index = self.device.index if self.device.index is not None else torch.cuda.current_device()
        self.splits = spec.splits or default_splits(
            units,
            self.window,
            self.config.heads_per_block,
            self.config.granule(self.head_dim),
            _sm_count(device_index),
        )
        self.workspace = DecodeWorkspace(
            units, self.splits, self.config.heads_per_block, self.head_dim, self.device
        )
        load_decode_kernel(
            device_index, self.head_dim, self.dtype, self.config
        )  # compile now, not in a capture

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
    """index_copy_ + SDPA over the bucket's window; mask and rows computed once per step."""

    def __init__(self, spec: AttentionSpec, *args: Any, **kwargs: Any) -> None:
        super().__init__(spec, *args, **kwargs)
        self._row_base = (torch.arange(self.batch * self.kv_heads, device=self.device) * self.max_len).view(
            self.batch, self.kv_heads
        )
        self._positions = torch.arange(self.window, device=self.device)
        self._meta: tuple[torch.Tensor, torch.Tensor] | None = None
        self._meta_lens: torch.Tensor | None = None

    def prepare(self, cache_lens: torch.Tensor) -> None:
        self._meta = _torch_metadata(
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
        q3 = q.reshape(self.batch, self.heads, -1)
        return _torch_attend(q3, k_cache, v_cache, mask, self.scale, self.window).view(q.shape)

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
        _torch_append(
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
    """FlashInfer decode (graph mode: re-planned on the host before each replay); torch append."""

    def __init__(self, spec: AttentionSpec, *args: Any, **kwargs: Any) -> None:
        super().__init__(spec, *args, **kwargs)
        self.fi = _FlashInferDecode(
            self.batch,
            self.heads,
            self.kv_heads,
            self.head_dim,
            self.max_len,
            self.dtype,
            self.device,
            self.scale,
        )

    def before_replay(self, cached: int) -> None:
        self.fi.plan(cached)

    def __call__(
        self,
        q: torch.Tensor,
        k_new: torch.Tensor,
        v_new: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        cache_lens: torch.Tensor,
    ) -> torch.Tensor:
        self._append(k_new, v_new, k_cache, v_cache, cache_lens)
        q3 = q.reshape(self.batch, self.heads, -1)
        if self.fi.planned is None:
            raise RuntimeError(
                "FlashInfer backend: call before_replay(cached) before the first call (it plans on the host)"
            )
        return self.fi.run(q3 if q3.is_contiguous() else q3.contiguous(), k_cache, v_cache).view(q.shape)

    @property
    def label(self) -> str:
        return "flashinfer"


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
    if not isinstance(spec, AttentionSpec):
        raise TypeError(f"`spec` must be an AttentionSpec, got {type(spec).__name__}")
    cls = {"kernel": KernelBackend, "torch": TorchBackend, "flashinfer": FlashInferBackend}[spec.impl]
    return cls(
        spec,
        batch,
        heads,
        kv_heads,
        head_dim,
        max_len,
        window if window is not None else max_len,
        dtype,
        torch.device(device),
        scale,
    )


def unavailable_reason(
    impl: str, head_dim: int, dtype: torch.dtype, device: torch.device | str
) -> str | None:
    """Why `impl` cannot run this layout here, or None."""
    device = torch.device(device)
    if impl == "torch":
        return None
    if device.type != "cuda":
        return f"{impl} needs a CUDA device, got {device}"
    if impl == "flashinfer":
        return flashinfer_unavailable_reason()
    from l2lightning._env import cuda_unavailable_reason, cupy_unavailable_reason

    if impl == "kernel":
        if head_dim not in HEAD_DIMS:
            return f"the kernel supports head_dim {HEAD_DIMS}, not {head_dim}"
        if dtype not in KERNEL_DTYPES:
            return f"the kernel supports bfloat16 and float16, not {dtype}"
        return cuda_unavailable_reason() or cupy_unavailable_reason()
    raise ValueError(f"unknown implementation {impl!r}; known: {IMPLEMENTATIONS}")


def candidate_specs(
    heads: int, kv_heads: int, head_dim: int, max_len_bucket: int, batch: int, sm_count: int = 132
) -> list[AttentionSpec]:
    """The kernel at its default split count, half and double of it, and for groups of 4+ heads
    also with the group in two head chunks; then torch and flashinfer."""
    group = heads // kv_heads
    specs = []
    hpbs = [default_heads_per_block(group)]
    if group >= 4 and -(-group // 2) not in hpbs:
        hpbs.append(-(-group // 2))
    for hpb in hpbs:
        granule = KernelConfig(heads_per_block=hpb).granule(head_dim)
        units = batch * kv_heads * -(-group // hpb)
        base = default_splits(units, max_len_bucket, hpb, granule, sm_count)
        cap = max(1, min(MAX_SPLITS, -(-max_len_bucket // granule)))
        for s in sorted({base, max(1, base // 2), min(cap, base * 2)}):
            specs.append(AttentionSpec("kernel", splits=s, heads_per_block=hpb))
    return specs + [AttentionSpec("torch"), AttentionSpec("flashinfer")]


# ------------------------------------------------------------------------------------------ choice
@dataclass
class AttentionChoice:
    """The implementation picked for one layout and length bucket, with the measurements behind it."""

    spec: AttentionSpec
    label: str
    timings_us: dict[str, float]
    errors: dict[str, str] = field(default_factory=dict)
    specs: dict[str, AttentionSpec] = field(default_factory=dict)
    heads: int = 0
    kv_heads: int = 0
    head_dim: int = 0
    max_len_bucket: int = 0
    dtype: str = ""
    batch: int = 0
    calls: int = 0
    rounds: int = 0

    @property
    def name(self) -> str:
        return self.spec.impl

    def table(self) -> str:
        """A small text table: each candidate's µs per call and its ratio to the best."""
        lines = [
            f"attention choice: heads={self.heads} kv_heads={self.kv_heads} head_dim={self.head_dim} "
            f"bucket={self.max_len_bucket} {self.dtype} batch={self.batch} "
            f"({self.calls} calls per graph replay, median of {self.rounds} interleaved rounds)",
            f"  {'candidate':<26}{'µs/call':>10}{'vs best':>10}",
        ]
        best = min(self.timings_us.values()) if self.timings_us else float("nan")
        for label, us in sorted(self.timings_us.items(), key=lambda kv: kv[1]):
            mark = "*" if label == self.label else " "
            lines.append(f"{mark} {label:<26}{us:>10.2f}{us / best:>9.2f}x")
        for label, why in self.errors.items():
            lines.append(f"  {label:<26}  skipped: {why}")
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["spec"] = dataclasses.asdict(self.spec)
        out["specs"] = {k: dataclasses.asdict(v) for k, v in self.specs.items()}
        return out


_CHOICES: dict[tuple, AttentionChoice] = {}


def _queue_ahead(cycles: int = 100_000) -> None:
    """Keep the GPU busy (~50 µs) while the host enqueues the next timed region, so that the start
    event fires when the work starts rather than when the host got around to submitting it."""
    sleep = getattr(torch.cuda, "_sleep", None)
    if sleep is not None:
        sleep(cycles)


def _rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    diff = (out.float() - ref.float()).norm().item()
    return diff / max(ref.float().norm().item(), 1e-30)


def choose_attention(
    heads: int,
    kv_heads: int,
    head_dim: int,
    max_len_bucket: int,
    dtype: torch.dtype,
    batch: int,
    device: torch.device | str,
    *,
    specs: Sequence[AttentionSpec] | None = None,
    calls: int = 8,
    rounds: int = 9,
    use_cache: bool = True,
) -> AttentionChoice:
    """Time each available implementation inside CUDA graphs and return the fastest.

    Each candidate gets its own graph of ``calls`` back-to-back calls (separate caches per call, like
    layers) with every sequence at a full bucket (``max_len_bucket - 1`` cached tokens); the graphs
    replay in interleaved rounds and the median CUDA-event time per call decides. A candidate that
    fails, or whose output misses the FP32 reference (relative error >= 2e-2), is reported in
    ``errors`` and not chosen. Results are cached per layout in this process (``use_cache``).

    Example:
        >>> choice = choose_attention(14, 2, 64, 1024, torch.bfloat16, 1, "cuda")  # doctest: +SKIP
        >>> print(choice.table())  # doctest: +SKIP
    """
    from l2lightning._env import cuda_unavailable_reason

    for name, value, low in (
        ("heads", heads, 1),
        ("kv_heads", kv_heads, 1),
        ("head_dim", head_dim, 8),
        ("max_len_bucket", max_len_bucket, 1),
        ("batch", batch, 1),
        ("calls", calls, 1),
        ("rounds", rounds, 1),
    ):
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ValueError(f"`{name}` must be an int >= {low}, got {value!r}")
    if heads % kv_heads:
        raise ValueError(f"`heads` ({heads}) must be a multiple of `kv_heads` ({kv_heads})")
    device = torch.device(device)
    if device.type != "cuda":
        raise ValueError(f"choose_attention times CUDA graphs: `device` must be a CUDA device, got {device}")
    reason = cuda_unavailable_reason()
    if reason:
        raise RuntimeError(f"choose_attention needs a CUDA GPU: {reason}")
    if device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    key = (
        heads,
        kv_heads,
        head_dim,
        max_len_bucket,
        dtype,
        batch,
        device.index,
        calls,
        rounds,
        tuple(specs) if specs is not None else None,
    )
    if use_cache and key in _CHOICES:
        return _CHOICES[key]
    if specs is None:
        specs = candidate_specs(heads, kv_heads, head_dim, max_len_bucket, batch, _sm_count(device.index))
    errors: dict[str, str] = {}
    backends: dict[str, AttentionBackend] = {}
    label_spec: dict[str, AttentionSpec] = {}
    for spec in specs:
        why = unavailable_reason(spec.impl, head_dim, dtype, device)
        if why:
            errors[spec.label] = why
            continue
        try:
            backend = make_backend(
                spec,
                batch=batch,
                heads=heads,
                kv_heads=kv_heads,
                head_dim=head_dim,
                max_len=max_len_bucket,
                window=max_len_bucket,
                dtype=dtype,
                device=device,
            )
        except Exception as exc:  # a candidate that cannot be built is reported, not fatal
            errors[spec.label] = f"{type(exc).__name__}: {exc}"
            continue
        if backend.label not in backends:
            backends[backend.label] = backend
            label_spec[backend.label] = spec
    gen = torch.Generator(device=device).manual_seed(1234)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, device=device, dtype=torch.float32).to(dtype)

    q = randn(batch, heads, head_dim)
    k_new, v_new = randn(batch, kv_heads, head_dim), randn(batch, kv_heads, head_dim)
    k_caches = [randn(batch, kv_heads, max_len_bucket, head_dim) for _ in range(calls)]
    v_caches = [randn(batch, kv_heads, max_len_bucket, head_dim) for _ in range(calls)]
    lens = torch.full((batch,), max_len_bucket - 1, dtype=torch.int32, device=device)
    ref = reference_decode_attention(q, k_new, v_new, k_caches[0], v_caches[0], lens)
    graphs: dict[str, torch.cuda.CUDAGraph] = {}
    side = torch.cuda.Stream(device=device)
    for label, backend in list(backends.items()):
        try:
            with torch.cuda.device(device), torch.no_grad():
                backend.before_replay(max_len_bucket - 1)
                side.wait_stream(torch.cuda.current_stream(device))
                with torch.cuda.stream(side):  # warm-up off the default stream, as for any capture
                    backend.prepare(lens)
                    out = backend(q, k_new, v_new, k_caches[0], v_caches[0], lens)
                torch.cuda.current_stream(device).wait_stream(side)
                torch.cuda.synchronize(device)
                err = _rel_err(out, ref)
                if not err < 2e-2:
                    raise RuntimeError(f"output differs from the FP32 reference (relative error {err:.3g})")
                graph = torch.cuda.CUDAGraph()
                with graph_capture(graph):
                    backend.prepare(lens)
                    for i in range(calls):
                        backend(q, k_new, v_new, k_caches[i], v_caches[i], lens)
                graph.replay()
                torch.cuda.synchronize(device)
                graphs[label] = graph
        except Exception as exc:
            errors[label] = f"{type(exc).__name__}: {exc}"
            if backend.spec.impl == "kernel":
                warnings.warn(
                    f"l2lightning: decode-attention kernel candidate {label} failed: {exc}", stacklevel=2
                )
    if not graphs:
        raise RuntimeError(
            "choose_attention: no implementation ran; " + "; ".join(f"{k}: {v}" for k, v in errors.items())
        )
    samples: dict[str, list[float]] = {label: [] for label in graphs}
    order = list(graphs)
    events = {
        label: [
            (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
            for _ in range(rounds)
        ]
        for label in graphs
    }
    with torch.cuda.device(device):
        for r in range(rounds):
            for label in order[r % len(order) :] + order[: r % len(order)]:  # rotate who goes first
                start, end = events[label][r]
                backends[label].before_replay(max_len_bucket - 1)
                _queue_ahead()
                start.record()
                graphs[label].replay()
                end.record()
        torch.cuda.synchronize(device)
    for label in graphs:
        samples[label] = [s.elapsed_time(e) * 1000.0 / calls for s, e in events[label]]
    timings = {label: statistics.median(v) for label, v in samples.items()}
    best = min(timings, key=timings.__getitem__)
    choice = AttentionChoice(
        spec=label_spec[best],
        label=best,
        timings_us=timings,
        errors=errors,
        specs=label_spec,
        heads=heads,
        kv_heads=kv_heads,
        head_dim=head_dim,
        max_len_bucket=max_len_bucket,
        dtype=str(dtype).replace("torch.", ""),
        batch=batch,
        calls=calls,
        rounds=rounds,
    )
    del graphs
    if use_cache:
        _CHOICES[key] = choice
    return choice


# ------------------------------------------------------------------------------------------ script mode
def _sanitize(verbose: bool = True) -> int:
    """A few small launches (merge and direct paths, GQA, both dtypes and head dims, a graph replayed
    a few times) for compute-sanitizer's memcheck and racecheck; checks results too."""
    from l2lightning._kernels import require_gpu_kernels

    require_gpu_kernels("decode_attention --sanitize")
    device = torch.device("cuda", torch.cuda.current_device())
    gen = torch.Generator(device=device).manual_seed(0)
    failures = 0
    cases = [  # (batch, heads, kv_heads, head_dim, dtype, max_len, lens, splits)
        (1, 14, 2, 64, torch.bfloat16, 160, [130], 4),
        (3, 9, 3, 64, torch.float16, 100, [0, 63, 64], 3),
        (2, 4, 4, 128, torch.bfloat16, 80, [7, 79], None),
        (1, 7, 1, 128, torch.float16, 300, [299], 8),
        (2, 16, 2, 64, torch.bfloat16, 64, [5, 40], 2),
    ]
    for batch, heads, kv_heads, d, dtype, max_len, lens_list, splits in cases:
        q = torch.randn(batch, heads, d, generator=gen, device=device).to(dtype)
        k = torch.randn(batch, kv_heads, d, generator=gen, device=device).to(dtype)
        v = torch.randn(batch, kv_heads, d, generator=gen, device=device).to(dtype)
        kc = torch.randn(batch, kv_heads, max_len, d, generator=gen, device=device).to(dtype)
        vc = torch.randn(batch, kv_heads, max_len, d, generator=gen, device=device).to(dtype)
        lens = torch.tensor(lens_list, dtype=torch.int32, device=device)
        ref = reference_decode_attention(q, k, v, kc, vc, lens)
        out = decode_attention(q, k, v, kc, vc, lens, splits=splits)
        torch.cuda.synchronize()
        err = _rel_err(out, ref)
        ok = err < 1e-2
        failures += not ok
        if verbose:
            print(
                f"B={batch} H={heads} KVH={kv_heads} D={d} {str(dtype)[6:]} lens={lens_list} splits={splits}: "
                f"rel err {err:.2e} {'ok' if ok else 'FAIL'}"
            )
    # graph: capture once, replay with the length advancing in the graph
    batch, heads, kv_heads, d, max_len = 2, 14, 2, 64, 200
    q = torch.randn(batch, heads, d, device=device).bfloat16()
    k = torch.randn(batch, kv_heads, d, device=device).bfloat16()
    v = torch.randn(batch, kv_heads, d, device=device).bfloat16()
    kc = torch.randn(batch, kv_heads, max_len, d, device=device).bfloat16()
    vc = torch.randn(batch, kv_heads, max_len, d, device=device).bfloat16()
    lens = torch.tensor([60, 100], dtype=torch.int32, device=device)
    ws = DecodeWorkspace(batch * kv_heads, 6, 7, d, device)
    decode_attention(q, k, v, kc, vc, lens, splits=6, workspace=ws)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = decode_attention(q, k, v, kc, vc, lens, splits=6, workspace=ws)
        lens.add_(1)
    for _ in range(5):
        graph.replay()
    torch.cuda.synchronize()
    lens.sub_(1)
    err = _rel_err(out, reference_decode_attention(q, k, v, kc, vc, lens))
    tickets_zero = bool((ws.tickets == 0).all())
    ok = err < 1e-2 and tickets_zero
    failures += not ok
    if verbose:
        print(f"graph x5: rel err {err:.2e}, tickets reset {tickets_zero}: {'ok' if ok else 'FAIL'}")
        print("decode_attention sanitize workload done" + (f", {failures} FAILED" if failures else ""))
    return 1 if failures else 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m l2lightning.decode.attention", description=__doc__.splitlines()[0]
    )
    parser.add_argument(
        "--sanitize",
        action="store_true",
        help="run a few small launches and one graph (for compute-sanitizer memcheck/racecheck)",
    )
    parser.add_argument(
        "--choose",
        metavar="H,KVH,D,BUCKET,BATCH",
        help="run choose_attention for one layout (bf16) and print its table",
    )
    args = parser.parse_args(argv)
    if args.sanitize:
        try:
            return _sanitize()
        except RuntimeError as exc:  # no GPU / no CuPy: say so in one line
            print(f"decode_attention --sanitize: {exc}", file=sys.stderr)
            return 2
    if args.choose:
        try:
            h, kvh, d, bucket, batch = (int(x) for x in args.choose.split(","))
        except ValueError:
            parser.error(f"--choose expects five integers H,KVH,D,BUCKET,BATCH, got {args.choose!r}")
        print(choose_attention(h, kvh, d, bucket, torch.bfloat16, batch, "cuda").table())
        return 0
    parser.print_help()
    return 0


if __name__ == "__main__":
    sys.exit(main())
