"""What a decode step reads besides the weights: the KV cache, the rotary tables, the elementwise
functions and the attention backend, all allocated once so that a captured graph's pointers stay
valid; and the optional per-layer recorder of attention inputs and outputs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from l2lightning.decode.config import DecoderConfig
from l2lightning.decode.elementwise import EAGER_FNS, ElementwiseFns, rope_tables

if TYPE_CHECKING:
    from l2lightning.decode.backends import AttentionBackend


class LayerRecorder:
    """Each layer's attention inputs and output of the latest decode step, for numerics checks.

    The decode step copies them into these preallocated buffers (four small copies per layer), so
    recording works inside a captured CUDA graph too: after each replay the buffers hold that
    step's values. ``q`` [layers, batch, heads, head_dim] is the query after rotary, ``k``/``v``
    [layers, batch, kv_heads, head_dim] the key/value appended at the step's position, ``attn``
    [layers, batch, heads, head_dim] the attention output; all in the model's dtype.

    Example:
        >>> session = DecodeSession(model, 1, 512, record_layers=True)  # doctest: +SKIP
        >>> session.step(); session.recorder.attn[3]  # layer 3's attention output  # doctest: +SKIP
    """

    def __init__(
        self, config: DecoderConfig, batch: int, device: torch.device | str, dtype: torch.dtype
    ) -> None:
        c = config

        def buf(heads: int) -> torch.Tensor:
            return torch.zeros(c.layers, batch, heads, c.head_dim, dtype=dtype, device=device)

        self.q, self.k, self.v, self.attn = buf(c.heads), buf(c.kv_heads), buf(c.kv_heads), buf(c.heads)

    def record(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn: torch.Tensor
    ) -> None:
        """Copy layer `layer`'s tensors (called by :meth:`LlamaDecoder.forward`)."""
        for dst, src in ((self.q, q), (self.k, k), (self.v, v), (self.attn, attn)):
            dst[layer].copy_(src.reshape(dst.shape[1:]))


@dataclass
class DecodeState:
    """Everything a decode step reads besides the weights: KV caches, rotary tables, the elementwise
    functions and the attention backend (one per length bucket)."""

    k_cache: torch.Tensor  # [layers, batch, kv_heads, max_len, head_dim]
    v_cache: torch.Tensor
    cos: torch.Tensor  # [max_len, head_dim / 2], FP32
    sin: torch.Tensor
    fns: ElementwiseFns = EAGER_FNS
    attention: AttentionBackend | None = None
    recorder: LayerRecorder | None = None  # per-layer attention inputs/outputs, for numerics checks

    @classmethod
    def allocate(
        cls,
        config: DecoderConfig,
        batch: int,
        max_len: int,
        device: torch.device,
        dtype: torch.dtype,
        fns: ElementwiseFns = EAGER_FNS,
    ) -> DecodeState:
        shape = (config.layers, batch, config.kv_heads, max_len, config.head_dim)
        cos, sin = rope_tables(config.head_dim, max_len, config.rope_theta, device)
        return cls(
            torch.zeros(shape, dtype=dtype, device=device),
            torch.zeros(shape, dtype=dtype, device=device),
            cos,
            sin,
            fns,
        )

    @property
    def max_len(self) -> int:
        return self.k_cache.shape[3]
