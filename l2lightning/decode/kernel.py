"""The one-launch decode-attention kernel (kernels/decode_attention.cu): how a launch is cut, its
workspace, compiling it through NVRTC and launching it on torch's stream.

One launch appends the new key/value at ``cache_lens`` and attends over the cache with split-K
blocks whose last finisher merges the partial results, so a decode step's attention is one kernel
per layer and replays in a CUDA graph at any cache length (the length is read on the device).
CuPy is imported only when a kernel is compiled or launched, never at import time.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch

from l2lightning.decode.checks import check_inputs, check_int, resolve_scale, resolve_window

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
MAX_GRID_ROWS = 65535  # gridDim.y of one launch


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
        check_int("heads_per_block", self.heads_per_block, 1, MAX_HEADS_PER_BLOCK)
        check_int("warps", self.warps, 1, 16)
        check_int("unroll", self.unroll, 1, 16)

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


@dataclass(frozen=True)
class KernelLaunch:
    """How one launch is cut: the kernel's configuration, head chunks per KV head, grid rows
    (``batch * kv_heads * head_chunks``), keys per block iteration and blocks per grid row."""

    config: KernelConfig
    head_chunks: int
    units: int
    granule: int
    splits: int


def plan_launch(
    batch: int,
    heads: int,
    kv_heads: int,
    head_dim: int,
    window: int,
    *,
    config: KernelConfig | None = None,
    splits: int | None = None,
    sm_count: int | None = None,
) -> KernelLaunch:
    """The launch for this layout: `config` (default: the group in balanced blocks of at most 8
    heads) and `splits` (default: :func:`default_splits` for `window` keys on `sm_count` SMs, which
    is then required). The one place the kernel's call, its backend and the candidate list size a
    launch, so that they agree."""
    group = heads // kv_heads
    if config is None:
        config = KernelConfig(heads_per_block=default_heads_per_block(group))
    head_chunks = -(-group // config.heads_per_block)
    units = batch * kv_heads * head_chunks
    granule = config.granule(head_dim)
    if splits is None:
        if sm_count is None:
            raise ValueError("plan_launch: pass `sm_count` to size the default split count")
        splits = default_splits(units, window, config.heads_per_block, granule, sm_count)
    return KernelLaunch(config, head_chunks, units, granule, splits)


@functools.cache
def device_sm_count(device_index: int) -> int:
    """Streaming multiprocessors of a CUDA device (cached: the default split count asks per call)."""
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def device_index_of(device: torch.device) -> int:
    """The CUDA index of `device`, the current device for a bare ``cuda``."""
    return device.index if device.index is not None else torch.cuda.current_device()


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

    @classmethod
    def for_launch(cls, launch: KernelLaunch, head_dim: int, device: torch.device | str) -> DecodeWorkspace:
        """The workspace `launch` needs."""
        return cls(launch.units, launch.splits, launch.config.heads_per_block, head_dim, device)

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


def _workspace_for(
    workspace: DecodeWorkspace | None,
    launch: KernelLaunch,
    head_dim: int,
    device: torch.device,
    device_index: int,
) -> DecodeWorkspace:
    """`workspace` checked against `launch`, or the one cached per shape and device (allocated now,
    which a graph capture cannot do)."""
    hpb = launch.config.heads_per_block
    if workspace is None:
        key = (device_index, launch.units, launch.splits, hpb, head_dim)
        cached = _WORKSPACES.get(key)
        if cached is None:
            if torch.cuda.is_current_stream_capturing():
                raise RuntimeError(
                    "decode_attention() needs a workspace allocated before a CUDA graph capture: pass `workspace=` "
                    "or call it once with the same shapes before capturing"
                )
            cached = _WORKSPACES[key] = DecodeWorkspace.for_launch(launch, head_dim, device)
        return cached
    if not isinstance(workspace, DecodeWorkspace):
        raise TypeError(f"`workspace` must be a DecodeWorkspace or None, got {type(workspace).__name__}")
    if not workspace.fits(launch.units, launch.splits, hpb, head_dim):
        raise ValueError(
            f"`workspace` was made for (units, splits, heads_per_block, head_dim) = ({workspace.units}, {workspace.splits}, "
            f"{workspace.heads_per_block}, {workspace.head_dim}); this launch needs ({launch.units}, {launch.splits}, {hpb}, {head_dim})"
        )
    return workspace


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
        q, k_new, v_new, k_cache, v_cache, cache_lens: see :mod:`l2lightning.decode.attention`
            (bf16 or fp16, head dim 64 or 128, CUDA, 16-byte aligned).
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
    inputs = check_inputs(q, k_new, v_new, k_cache, v_cache, cache_lens)
    lay = inputs.layout
    if q.device.type != "cuda":
        raise ValueError(
            f"`q` must be a CUDA tensor for the kernel, got a tensor on {q.device}; use torch_decode_attention on CPU"
        )
    if q.dtype not in KERNEL_DTYPES:
        raise ValueError(f"`q` dtype must be bfloat16 or float16 for the kernel, got {q.dtype}")
    if lay.head_dim not in HEAD_DIMS:
        raise ValueError(f"head_dim must be one of {HEAD_DIMS} for the kernel, got {lay.head_dim}")
    if config is not None and not isinstance(config, KernelConfig):
        raise TypeError(f"`config` must be a KernelConfig or None, got {type(config).__name__}")
    scale = resolve_scale(scale, lay.head_dim)
    window = resolve_window(window, lay.max_len)
    check_int("splits", splits, 1, MAX_SPLITS, or_none=True)
    device_index = device_index_of(q.device)
    launch = plan_launch(
        lay.batch,
        lay.heads,
        lay.kv_heads,
        lay.head_dim,
        window,
        config=config,
        splits=splits,
        sm_count=device_sm_count(device_index) if splits is None else None,
    )
    if launch.units > MAX_GRID_ROWS:
        raise ValueError(
            f"batch * kv_heads * head_chunks = {launch.units} exceeds the {MAX_GRID_ROWS} grid rows of one launch"
        )
    workspace = _workspace_for(workspace, launch, lay.head_dim, q.device, device_index)
    if not cache_lens.is_contiguous():
        raise ValueError("`cache_lens` must be contiguous: the kernel reads cache_lens[b] by index")
    q3, k3, v3 = (t if t.is_contiguous() else t.contiguous() for t in (inputs.q3, inputs.k3, inputs.v3))
    out = torch.empty((lay.batch, lay.heads, lay.head_dim), dtype=q.dtype, device=q.device)
    for name, t in (("q", q3), ("k_new", k3), ("v_new", v3), ("k_cache", k_cache), ("v_cache", v_cache)):
        if t.data_ptr() % 16:
            raise ValueError(
                f"`{name}` must start on a 16-byte boundary for the kernel's vector loads (data_ptr {t.data_ptr():#x})"
            )
    kernel = load_decode_kernel(device_index, lay.head_dim, q.dtype, launch.config)
    ptr = np.uint64
    args = (
        *(ptr(t.data_ptr()) for t in (q3, k3, v3, k_cache, v_cache, cache_lens, out)),
        *(ptr(t.data_ptr()) for t in (workspace.part_acc, workspace.part_ml, workspace.tickets)),
        np.int32(lay.heads),
        np.int32(lay.kv_heads),
        np.int32(launch.head_chunks),
        np.int32(lay.max_len),
        np.int32(launch.splits),
        np.int32(launch.granule),
        np.float32(scale * LOG2E),
    )
    _launch(kernel, (launch.splits, launch.units), launch.config.threads, args, device_index)
    return out.view(q.shape)
