"""The yardsticks every decode measurement is judged with: one relative error, and float64 attention.

Kept apart from the sessions and the attention chooser so that both (and the sanitizer workload)
compare against the same reference the same way without importing each other.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from l2lightning.decode.checks import check_inputs, resolve_scale


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """``‖out − ref‖ / ‖ref‖`` over all elements, in float64 (0.0 when both are zero).

    Stack several samples (``torch.stack``) to get one error over all of them.

    Example:
        >>> relative_error(torch.tensor([3.0, 4.0]), torch.tensor([3.0, 0.0]))
        1.3333333333333333
    """
    for name, t in (("out", out), ("ref", ref)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"`{name}` must be a torch.Tensor, got {type(t).__name__}")
    if out.shape != ref.shape:
        raise ValueError(f"`out` shape {tuple(out.shape)} differs from `ref` shape {tuple(ref.shape)}")
    ref64 = ref.detach().to(out.device, torch.float64)
    diff = (out.detach().double() - ref64).norm().item()
    base = ref64.norm().item()
    if base == 0.0:
        return 0.0 if diff == 0.0 else math.inf
    return diff / base


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
    inputs = check_inputs(q, k_new, v_new, k_cache, v_cache, cache_lens)
    lay = inputs.layout
    scale = resolve_scale(scale, lay.head_dim)
    out = torch.empty((lay.batch, lay.heads, lay.head_dim), dtype=torch.float32, device=q.device)
    for b, n in enumerate(cache_lens.tolist()):
        if not 0 <= n < lay.max_len:
            raise ValueError(f"`cache_lens[{b}]` = {n} is outside [0, max_len={lay.max_len})")
        keys = torch.cat([k_cache[b, :, :n], inputs.k3[b, :, None]], dim=1).double()  # [KVH, n+1, D]
        values = torch.cat([v_cache[b, :, :n], inputs.v3[b, :, None]], dim=1).double()
        qg = inputs.q3[b].double().view(lay.kv_heads, lay.group, lay.head_dim)
        probs = torch.softmax(torch.einsum("kgd,knd->kgn", qg, keys) * scale, dim=-1)
        out[b] = torch.einsum("kgn,knd->kgd", probs, values).reshape(lay.heads, lay.head_dim).float()
    return out.view(q.shape)
