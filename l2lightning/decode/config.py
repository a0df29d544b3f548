"""Layouts of Llama-style decoders, and the bytes a decode step of one must move.

The layouts are SmolLM2-135M's and Qwen2.5-0.5B's (their parameter counts equal the real models').
The byte counts are the floors the decode benchmarks and the step report measure against: every
weight read once and the KV cache read once, so a step's time over them says how far it is from
being bound by memory bandwidth.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass


@dataclass(frozen=True)
class DecoderConfig:
    """Layout of a Llama-style decoder.

    Example:
        >>> SMOLLM2_135M.param_count()
        134515008
    """

    name: str
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    mlp: int
    vocab: int
    tie_embeddings: bool = True
    qkv_bias: bool = False
    rope_theta: float = 10000.0
    rms_eps: float = 1e-5

    def __post_init__(self) -> None:
        for name in ("hidden", "layers", "heads", "kv_heads", "head_dim", "mlp", "vocab"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"`{name}` must be a positive int, got {value!r}")
        if self.heads % self.kv_heads:
            raise ValueError(f"`heads` ({self.heads}) must be a multiple of `kv_heads` ({self.kv_heads})")
        if self.head_dim % 2:
            raise ValueError(f"`head_dim` must be even for rotary embeddings, got {self.head_dim}")

    @property
    def group(self) -> int:
        return self.heads // self.kv_heads

    def with_layers(self, layers: int) -> DecoderConfig:
        """The same layout with `layers` decoder layers (tests and quick runs)."""
        return dataclasses.replace(self, layers=layers)

    def param_count(self) -> int:
        """Parameters of the model this config builds (a tied LM head counted once)."""
        qkv_out = (self.heads + 2 * self.kv_heads) * self.head_dim
        per_layer = (
            self.hidden * qkv_out
            + (qkv_out if self.qkv_bias else 0)  # fused q/k/v
            + self.heads * self.head_dim * self.hidden  # o_proj
            + 3 * self.hidden * self.mlp  # gate, up, down
            + 2 * self.hidden  # two RMSNorm scales
        )
        embed = self.vocab * self.hidden
        return embed + self.layers * per_layer + self.hidden + (0 if self.tie_embeddings else embed)


SMOLLM2_135M = DecoderConfig(
    "SmolLM2-135M",
    hidden=576,
    layers=30,
    heads=9,
    kv_heads=3,
    head_dim=64,
    mlp=1536,
    vocab=49152,
    tie_embeddings=True,
    qkv_bias=False,
    rope_theta=100000.0,
    rms_eps=1e-5,
)
QWEN25_05B = DecoderConfig(
    "Qwen2.5-0.5B",
    hidden=896,
    layers=24,
    heads=14,
    kv_heads=2,
    head_dim=64,
    mlp=4864,
    vocab=151936,
    tie_embeddings=True,
    qkv_bias=True,
    rope_theta=1000000.0,
    rms_eps=1e-6,
)
CONFIGS = {"smollm2-135m": SMOLLM2_135M, "qwen2.5-0.5b": QWEN25_05B}


def get_config(name: str) -> DecoderConfig:
    """A named layout: one of ``CONFIGS`` (case-insensitive)."""
    key = name.lower()
    if key not in CONFIGS:
        raise ValueError(f"unknown decoder config {name!r}; known: {sorted(CONFIGS)}")
    return CONFIGS[key]


def decode_step_bytes(config: DecoderConfig, batch: int, cached: int, dtype_bytes: int = 2) -> dict[str, int]:
    """Bytes one decode step must move from memory at least: every weight read once (the embedding
    table only for its ``batch`` rows unless it is the tied LM head), and the KV cache of
    ``cached + 1`` positions per layer read (the new one written)."""
    params = config.param_count()
    embed = config.vocab * config.hidden
    weights = params - (0 if config.tie_embeddings else embed - batch * config.hidden)
    kv_row = (
        config.kv_heads * config.head_dim * dtype_bytes * batch * config.layers * 2
    )  # K and V, all layers
    return {
        "weights": weights * dtype_bytes,
        "kv_read": kv_row * (cached + 1),
        "kv_write": kv_row,
        "total": weights * dtype_bytes + kv_row * (cached + 2),
    }


def decode_part_bytes(config: DecoderConfig, batch: int, cached: int, dtype_bytes: int = 2) -> dict[str, int]:
    """Bytes each part of one decode step must move at least, per call (one layer's ``qkv``, one
    ``attention`` at `cached` tokens, ...): its weights (and bias) read once, the activations it
    reads and writes, and for attention the K/V of ``cached + 1`` positions read and the new key
    and value written. The elementwise parts move activations only (a few KB)."""
    c, b, e = config, batch, dtype_bytes
    qkv_out = (c.heads + 2 * c.kv_heads) * c.head_dim
    hd = c.heads * c.head_dim
    kv_row = c.kv_heads * c.head_dim * e * b  # one position of one layer's K (or V)

    def linear(n_in: int, n_out: int, bias: bool = False) -> int:
        return (n_in * n_out + (n_out if bias else 0)) * e + b * (n_in + n_out) * e

    return {
        "embed": b * c.hidden * e,
        "qkv": linear(c.hidden, qkv_out, c.qkv_bias),
        "o_proj": linear(hd, c.hidden),
        "gate_up": linear(c.hidden, 2 * c.mlp),
        "down": linear(c.mlp, c.hidden),
        "lm_head": linear(c.hidden, c.vocab),
        "attention": 2 * kv_row * (cached + 1) + 2 * kv_row + 2 * b * hd * e,
        "attention_prepare": 0,
        "rms_norm": 2 * b * c.hidden * e + c.hidden * e,
        "add_rms_norm": 4 * b * c.hidden * e + c.hidden * e,
        "qkv_rope": 2 * b * qkv_out * e + 2 * b * (c.head_dim // 2) * 4,
        "silu_mul": 3 * b * c.mlp * e,
        "other": 0,
        "unattributed": 0,
    }
