"""The PyTorch decode-attention path: ``index_copy_`` append plus ``F.scaled_dot_product_attention``.

It runs anywhere (CPU included) and is the baseline the kernel is measured against. The query heads
of a group are folded into the query length, so grouped-query attention reads each KV head once
without ``repeat_interleave``; the cache length is applied as a mask computed on the device, so a
CUDA graph of it replays at any length of its window.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from l2lightning.decode.checks import check_inputs, resolve_scale, resolve_window


def torch_metadata(
    cache_lens: torch.Tensor,
    batch: int,
    kv_heads: int,
    max_len: int,
    window: int,
    row_base: torch.Tensor | None = None,
    positions: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(cache rows to write, [B, 1, 1, window] bool mask of attended positions); no host sync.

    `row_base` ([B, KVH] first row of each sequence's head) and `positions` (``arange(window)``)
    may be passed precomputed, as a backend does once for all steps."""
    device = cache_lens.device
    if row_base is None:
        row_base = (torch.arange(batch * kv_heads, device=device) * max_len).view(batch, kv_heads)
    if positions is None:
        positions = torch.arange(window, device=device)
    lens = cache_lens.long()
    rows = (row_base + lens[:, None]).reshape(-1)
    mask = (positions[None, :] <= lens[:, None]).view(batch, 1, 1, window)
    return rows, mask


def torch_append(
    k3: torch.Tensor, v3: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, rows: torch.Tensor
) -> None:
    """Write the new keys/values [B, KVH, D] into the caches' `rows` (flattened [B * KVH * max_len, D])."""
    d = k_cache.shape[-1]
    k_cache.view(-1, d).index_copy_(0, rows, k3.reshape(-1, d))
    v_cache.view(-1, d).index_copy_(0, rows, v3.reshape(-1, d))


def torch_attend(
    q3: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    mask: torch.Tensor,
    scale: float,
    window: int,
) -> torch.Tensor:
    """SDPA of q [B, H, D] over the first `window` cache positions, masked: [B, H, D]."""
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
    inputs = check_inputs(q, k_new, v_new, k_cache, v_cache, cache_lens)
    lay = inputs.layout
    scale = resolve_scale(scale, lay.head_dim)
    window = resolve_window(window, lay.max_len)
    rows, mask = torch_metadata(cache_lens, lay.batch, lay.kv_heads, lay.max_len, window)
    torch_append(inputs.k3, inputs.v3, k_cache, v_cache, rows)
    return torch_attend(inputs.q3, k_cache, v_cache, mask, scale, window).view(q.shape)
