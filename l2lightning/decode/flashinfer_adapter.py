"""FlashInfer's decode attention over this package's KV cache, where ``import flashinfer`` works.

Two of FlashInfer's entry points are adapted, both on its CUDA-core decode kernels:

- :class:`FlashInferBatchDecode`: ``BatchDecodeWithPagedKVCacheWrapper`` with the cache seen as one
  page of ``max_len`` per sequence. It plans on the host for a given length, so a graph of it is
  re-planned before every replay; this is what a :class:`DecodeSession` with
  ``attention="flashinfer"`` runs.
- :func:`flashinfer_single_decode`: ``single_decode_with_kv_cache``, one request over a contiguous
  [kv_heads, keys, head_dim] cache, every key attended. Its length is the tensor's shape, so it only
  serves a cache exactly as long as the attended keys (attention measured alone, batch 1).

FlashInfer is imported only inside these functions: importing this module never needs it.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from l2lightning.decode.checks import DecodeLayout, check_inputs, resolve_scale, resolve_window
from l2lightning.decode.torch_attention import torch_append, torch_metadata

FLASHINFER_INSTALL_HINT = (
    "install FlashInfer for your torch/CUDA build (see https://docs.flashinfer.ai/installation.html)"
)
# The query-per-KV-head group sizes FlashInfer 0.7.2's decode kernels (CUDA cores, the path
# BatchDecodeWithPagedKVCacheWrapper and single_decode_with_kv_cache take by default) are compiled
# for: DISPATCH_GQA_GROUP_SIZE in its include/flashinfer/utils.cuh. Any other raises "Unsupported
# group_size" at plan time (seen on the H200 for Qwen2.5-0.5B: 14 query heads over 2 KV heads, group 7).
FLASHINFER_DECODE_GROUP_SIZES = (1, 2, 3, 4, 6, 8, 16)
WORKSPACE_BYTES = 128 << 20  # the float workspace FlashInfer's documentation recommends


@functools.lru_cache(maxsize=1)
def flashinfer_unavailable_reason() -> str | None:
    """None when ``import flashinfer`` works, else why not (with the install hint)."""
    try:
        import flashinfer  # noqa: F401
    except Exception as exc:
        return f"FlashInfer is not importable ({type(exc).__name__}: {exc}); {FLASHINFER_INSTALL_HINT}"
    return None


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


def _require_flashinfer(heads: int, kv_heads: int) -> Any:
    """The flashinfer module, or a RuntimeError saying why it cannot run this layout."""
    reason = flashinfer_unavailable_reason() or flashinfer_layout_reason(heads, kv_heads)
    if reason:
        raise RuntimeError(reason)
    import flashinfer

    return flashinfer


class FlashInferBatchDecode:
    """FlashInfer's BatchDecodeWithPagedKVCacheWrapper over our cache: one page of max_len per sequence.

    The cache [B, KVH, max_len, D] is FlashInfer's HND paged layout [pages, kv_heads, page_size, D]
    with page b = sequence b. FlashInfer plans on the host: `plan(cached)` must run before each call
    (outside a graph, before each replay) with the number of cached tokens.
    """

    def __init__(self, layout: DecodeLayout, dtype: torch.dtype, device: torch.device, scale: float) -> None:
        flashinfer = _require_flashinfer(layout.heads, layout.kv_heads)
        self.layout, self.dtype, self.scale = layout, dtype, scale
        batch = layout.batch
        self.float_workspace = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=device)
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
        lay = self.layout
        if not 0 <= cached < lay.max_len:
            raise ValueError(f"cached length {cached} is outside [0, max_len={lay.max_len})")
        cpu = torch.device("cpu")
        args = (
            torch.arange(lay.batch + 1, dtype=torch.int32, device=cpu),
            torch.arange(lay.batch, dtype=torch.int32, device=cpu),
            torch.full((lay.batch,), cached + 1, dtype=torch.int32, device=cpu),
            lay.heads,
            lay.kv_heads,
            lay.head_dim,
            lay.max_len,
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


def flashinfer_single_decode(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """FlashInfer's single-request decode of q [heads, head_dim] over every key of k/v
    [kv_heads, keys, head_dim] (HND): [heads, head_dim].

    FlashInfer derives the strides from the shape, so k and v must be contiguous: a cache slice
    ``k_cache[b, :, :n]`` is one only when ``n`` is the cache's whole length (or one KV head).
    """
    flashinfer = _require_flashinfer(q.shape[0], k.shape[0])
    for name, t in (("k", k), ("v", v)):
        if t.dim() != 3 or not t.is_contiguous():
            raise ValueError(
                f"`{name}` must be a contiguous [kv_heads, keys, head_dim] tensor for FlashInfer's single decode, "
                f"got shape {tuple(t.shape)} with strides {t.stride()}"
            )
    return flashinfer.single_decode_with_kv_cache(q.contiguous(), k, v, kv_layout="HND", sm_scale=scale)


_BATCH_DECODES: dict[tuple, FlashInferBatchDecode] = {}


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
    inputs = check_inputs(q, k_new, v_new, k_cache, v_cache, cache_lens)
    lay = inputs.layout
    scale = resolve_scale(scale, lay.head_dim)
    if window is None:
        lens = set(cache_lens.tolist())
        if len(lens) != 1:
            raise ValueError(
                f"flashinfer_decode_attention needs one length for all sequences, got cache_lens {sorted(lens)}"
            )
        cached = lens.pop()
    else:
        cached = resolve_window(window, lay.max_len) - 1
    key = (q.device, lay, q.dtype, scale)
    fi = _BATCH_DECODES.get(key)
    if fi is None:
        fi = _BATCH_DECODES[key] = FlashInferBatchDecode(lay, q.dtype, q.device, scale)
    fi.plan(cached)
    rows, _ = torch_metadata(cache_lens, lay.batch, lay.kv_heads, lay.max_len, 1)
    torch_append(inputs.k3, inputs.v3, k_cache, v_cache, rows)
    return fi.run(inputs.q3.contiguous(), k_cache, v_cache).view(q.shape)
