"""The elementwise parts of a decode step: RMSNorm (with the residual add), rotary embeddings, SiLU-gate.

At batch 1 each of these moves a few KB, so their cost is the launch, not the bytes (the step
report measured about five elementwise kernels per layer at about 1.1 µs each on the H200,
benchmarks/README.md): the decode step's graph runs them ``torch.compile``d, so that Inductor fuses
each into as few kernels as it can, and the eager versions serve prefill, the FP32 reference and
the CPU. Statistics and rotations are computed
in FP32 and the results cast back, as Llama and Qwen do.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm as in Llama/Qwen: statistics in FP32, scale applied in the input dtype."""
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(residual + x, rms_norm(residual + x)): the residual add fused with the next norm."""
    out = residual + x
    return out, rms_norm(out, weight, eps)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate halves (Llama's ``rotate_half`` layout): x [..., heads, D], cos/sin [..., D/2] in FP32."""
    x32 = x.float()
    x1, x2 = x32.chunk(2, dim=-1)
    c, s = cos.unsqueeze(-2), sin.unsqueeze(-2)
    return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1).to(x.dtype)


def qkv_rope(
    qkv: torch.Tensor,
    cos_table: torch.Tensor,
    sin_table: torch.Tensor,
    positions: torch.Tensor,
    heads: int,
    kv_heads: int,
    head_dim: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Split the fused projection [..., (H + 2 KVH) D] into q [..., H, D], k, v [..., KVH, D] (contiguous),
    rotating q and k by their positions (int tensor shaped like the leading dims)."""
    q = qkv[..., : heads * head_dim].unflatten(-1, (heads, head_dim))
    k = qkv[..., heads * head_dim : (heads + kv_heads) * head_dim].unflatten(-1, (kv_heads, head_dim))
    v = qkv[..., (heads + kv_heads) * head_dim :].unflatten(-1, (kv_heads, head_dim))
    pos = positions.long()
    cos, sin = cos_table[pos], sin_table[pos]
    return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin), v.contiguous()


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """SiLU(gate) * up for the fused [..., 2 * mlp] projection."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def rope_tables(
    head_dim: int, max_len: int, theta: float, device: torch.device | str = "cpu"
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin tables [max_len, head_dim / 2] in FP32 (computed in float64)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    angles = torch.outer(torch.arange(max_len, dtype=torch.float64), inv_freq)
    return angles.cos().float().to(device), angles.sin().float().to(device)


@dataclass(frozen=True)
class ElementwiseFns:
    """The elementwise parts of a step, eager or compiled."""

    rms_norm: Callable[..., torch.Tensor]
    add_rms_norm: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    qkv_rope: Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor]]
    silu_mul: Callable[..., torch.Tensor]
    compiled: bool = False


EAGER_FNS = ElementwiseFns(rms_norm, add_rms_norm, qkv_rope, silu_mul, compiled=False)


@functools.lru_cache(maxsize=1)
def compiled_fns() -> ElementwiseFns:
    """The elementwise parts through ``torch.compile`` (default mode: Inductor fusion, no cudagraphs
    of its own, static shapes). Compiled on first call per shape; warm them before a capture."""
    import torch._dynamo

    # Each model layout / batch is one more static specialisation of the same small functions.
    for name in ("recompile_limit", "cache_size_limit"):
        if getattr(torch._dynamo.config, name, 64) < 64:
            setattr(torch._dynamo.config, name, 64)

    def compile_(fn: Callable) -> Callable:
        return torch.compile(fn, dynamic=False, fullgraph=True)

    return ElementwiseFns(
        compile_(rms_norm), compile_(add_rms_norm), compile_(qkv_rope), compile_(silu_mul), compiled=True
    )
