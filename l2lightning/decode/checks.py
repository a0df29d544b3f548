"""Argument checks shared by the decode modules, and the random inputs their measurements use.

Every decode-attention implementation takes the same six tensors (see
:mod:`l2lightning.decode.attention`); :func:`check_inputs` validates them once for all of them and
names the offending argument in every error, so that a caller learns which tensor is wrong whichever
implementation it called. :func:`check_int` is the one integer check behind the sessions', the
kernel's and the chooser's arguments, so their messages read alike.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch


def check_int(name: str, value: Any, low: int, high: int | None = None, *, or_none: bool = False) -> None:
    """Raise ValueError unless `value` is an int (not a bool) in ``[low, high]`` (``high=None``: no
    upper bound); with `or_none`, None passes too. `name` is the argument's name in the message."""
    if or_none and value is None:
        return
    if (
        not isinstance(value, bool)
        and isinstance(value, int)
        and value >= low
        and (high is None or value <= high)
    ):
        return
    wanted = f"an int >= {low}" if high is None else f"an int in [{low}, {high}]"
    raise ValueError(f"`{name}` must be {wanted}{' or None' if or_none else ''}, got {value!r}")


@dataclass(frozen=True)
class DecodeLayout:
    """The sizes one decode-attention call works on: sequences, query and KV heads, head size and
    cache capacity (positions per sequence)."""

    batch: int
    heads: int
    kv_heads: int
    head_dim: int
    max_len: int

    @property
    def group(self) -> int:
        """Query heads per KV head."""
        return self.heads // self.kv_heads


@dataclass(frozen=True)
class DecodeInputs:
    """The checked arguments of one call: their layout and the new token's q/k/v as 3-d views."""

    layout: DecodeLayout
    q3: torch.Tensor  # [B, H, D]
    k3: torch.Tensor  # [B, KVH, D]
    v3: torch.Tensor


def squeeze_token(name: str, t: torch.Tensor, what: str) -> torch.Tensor:
    """`t` as [batch, `what`, head_dim]: a [batch, `what`, 1, head_dim] tensor loses its length-1 dim."""
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


def check_inputs(q: Any, k_new: Any, v_new: Any, k_cache: Any, v_cache: Any, cache_lens: Any) -> DecodeInputs:
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
    q3 = squeeze_token("q", q, "heads")
    k3 = squeeze_token("k_new", k_new, "kv_heads")
    v3 = squeeze_token("v_new", v_new, "kv_heads")
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
    return DecodeInputs(DecodeLayout(batch, heads, kv_heads, head_dim, max_len), q3, k3, v3)


def resolve_scale(scale: float | None, head_dim: int) -> float:
    """The softmax scale: `scale`, checked, or ``1/sqrt(head_dim)`` for None."""
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


def resolve_window(window: int | None, max_len: int) -> int:
    """The attended cache prefix: `window`, checked against `max_len`, or `max_len` for None."""
    if window is None:
        return max_len
    if isinstance(window, bool) or not isinstance(window, int) or not 1 <= window <= max_len:
        raise ValueError(f"`window` must be an int in [1, max_len={max_len}] or None, got {window!r}")
    return window


def random_decode_inputs(
    layout: DecodeLayout,
    dtype: torch.dtype,
    device: torch.device | str,
    generator: torch.Generator | None = None,
    caches: int = 1,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[torch.Tensor], list[torch.Tensor]]:
    """(q, k_new, v_new, k_caches, v_caches) drawn from normal(0, 1) in FP32 and rounded to `dtype`,
    in that order (a seeded `generator` gives every caller the same values), with `caches`
    separate caches of each kind (several layers' worth, for timing)."""
    lay = layout

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=generator, device=device, dtype=torch.float32).to(dtype)

    q = randn(lay.batch, lay.heads, lay.head_dim)
    k_new, v_new = randn(lay.batch, lay.kv_heads, lay.head_dim), randn(lay.batch, lay.kv_heads, lay.head_dim)
    cache_shape = (lay.batch, lay.kv_heads, lay.max_len, lay.head_dim)
    k_caches = [randn(*cache_shape) for _ in range(caches)]
    v_caches = [randn(*cache_shape) for _ in range(caches)]
    return q, k_new, v_new, k_caches, v_caches
