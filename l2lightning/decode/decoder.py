"""The Llama-style decoder: pre-norm attention blocks and SiLU-gated MLPs, q/k/v and gate/up fused.

``forward`` is one decode step (one token per sequence, attention through the step's backend,
elementwise parts through the state's functions, eager or compiled), which is what a
:class:`~l2lightning.decode.session.DecodeSession` captures; ``prefill`` fills the cache from a prompt
eagerly. Weights are random (:func:`build_decoder`): the decode measurements need the real shapes,
not trained values, and nothing is downloaded.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from l2lightning.decode.config import DecoderConfig, get_config
from l2lightning.decode.elementwise import add_rms_norm, qkv_rope, rms_norm, silu_mul
from l2lightning.decode.state import DecodeState


class RMSNorm(nn.Module):
    """Scale-only RMSNorm; the decode step calls :func:`rms_norm` / :func:`add_rms_norm` with its weight."""

    def __init__(self, hidden: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


class DecoderLayer(nn.Module):
    """Pre-norm attention block and SiLU-gated MLP, q/k/v and gate/up fused."""

    def __init__(self, config: DecoderConfig) -> None:
        super().__init__()
        c = config
        self.input_norm = RMSNorm(c.hidden, c.rms_eps)
        self.qkv = nn.Linear(c.hidden, (c.heads + 2 * c.kv_heads) * c.head_dim, bias=c.qkv_bias)
        self.o_proj = nn.Linear(c.heads * c.head_dim, c.hidden, bias=False)
        self.post_norm = RMSNorm(c.hidden, c.rms_eps)
        self.gate_up = nn.Linear(c.hidden, 2 * c.mlp, bias=False)
        self.down = nn.Linear(c.mlp, c.hidden, bias=False)


class LlamaDecoder(nn.Module):
    """Llama-style decoder. ``forward`` is one decode step (one token per sequence); ``prefill`` fills
    the cache from a prompt.

    Args:
        config: the layout.
    """

    def __init__(self, config: DecoderConfig) -> None:
        super().__init__()
        if not isinstance(config, DecoderConfig):
            raise TypeError(f"`config` must be a DecoderConfig, got {type(config).__name__}")
        self.config = config
        self.embed = nn.Embedding(config.vocab, config.hidden)
        self.layers = nn.ModuleList(DecoderLayer(config) for _ in range(config.layers))
        self.norm = RMSNorm(config.hidden, config.rms_eps)
        self.lm_head = nn.Linear(config.hidden, config.vocab, bias=False)
        if config.tie_embeddings:
            self.lm_head.weight = self.embed.weight

    def _next_norm_weight(self, i: int) -> torch.Tensor:
        return self.layers[i + 1].input_norm.weight if i + 1 < len(self.layers) else self.norm.weight

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, state: DecodeState) -> torch.Tensor:
        """One decode step: tokens [B] at positions [B] (int32, = tokens already cached) -> logits [B, vocab].

        Appends each layer's new key/value to ``state``'s caches; does not advance ``positions``.
        """
        c, fns, attend = self.config, state.fns, state.attention
        if attend is None:
            raise RuntimeError("DecodeState.attention is not set: a DecodeSession sets it per length bucket")
        attend.prepare(positions)
        x = self.embed(tokens)
        residual, h = x, fns.rms_norm(x, self.layers[0].input_norm.weight, c.rms_eps)
        for i, layer in enumerate(self.layers):
            q, k, v = fns.qkv_rope(
                layer.qkv(h), state.cos, state.sin, positions, c.heads, c.kv_heads, c.head_dim
            )
            a = attend(q, k, v, state.k_cache[i], state.v_cache[i], positions)
            if state.recorder is not None:
                state.recorder.record(i, q, k, v, a)
            residual, h = fns.add_rms_norm(
                layer.o_proj(a.reshape(a.shape[0], -1)), residual, layer.post_norm.weight, c.rms_eps
            )
            mlp = layer.down(fns.silu_mul(layer.gate_up(h)))
            residual, h = fns.add_rms_norm(mlp, residual, self._next_norm_weight(i), c.rms_eps)
        return self.lm_head(h)

    def prefill(self, tokens: torch.Tensor, state: DecodeState) -> torch.Tensor:
        """Eager causal pass over prompts [B, T]: fills cache positions [0, T), returns the last logits [B, vocab]."""
        c = self.config
        batch, length = tokens.shape
        positions = torch.arange(length, device=tokens.device).expand(batch, length)
        x = self.embed(tokens)
        residual, h = x, rms_norm(x, self.layers[0].input_norm.weight, c.rms_eps)
        for i, layer in enumerate(self.layers):
            q, k, v = qkv_rope(layer.qkv(h), state.cos, state.sin, positions, c.heads, c.kv_heads, c.head_dim)
            q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # [B, heads, T, D]
            state.k_cache[i][:, :, :length].copy_(k)
            state.v_cache[i][:, :, :length].copy_(v)
            k, v = k.repeat_interleave(c.group, dim=1), v.repeat_interleave(c.group, dim=1)
            a = (
                F.scaled_dot_product_attention(q, k, v, is_causal=True)
                .transpose(1, 2)
                .reshape(batch, length, -1)
            )
            residual, h = add_rms_norm(layer.o_proj(a), residual, layer.post_norm.weight, c.rms_eps)
            mlp = layer.down(silu_mul(layer.gate_up(h)))
            residual, h = add_rms_norm(mlp, residual, self._next_norm_weight(i), c.rms_eps)
        return self.lm_head(h[:, -1])


def build_decoder(
    config: DecoderConfig | str,
    *,
    layers: int | None = None,
    device: torch.device | str = "cuda",
    dtype: torch.dtype = torch.bfloat16,
    seed: int = 0,
    std: float = 0.02,
) -> LlamaDecoder:
    """A decoder with random weights (normal(0, `std`) matrices, unit norm scales), in eval mode.

    Args:
        config: a :class:`DecoderConfig` or a name from ``CONFIGS``.
        layers: override the layer count (e.g. 2 for tests).
        device: where to build it (``"meta"`` builds shapes only).
        dtype: parameter dtype (bf16 by default).
        seed: RNG seed of the weights (drawn on `device`).
        std: standard deviation of the weight matrices and embeddings.
    """
    if isinstance(config, str):
        config = get_config(config)
    if layers is not None:
        config = config.with_layers(layers)
    with torch.device(device):
        model = LlamaDecoder(config)
    if torch.device(device).type != "meta":
        gen = torch.Generator(device=device).manual_seed(seed)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith("norm.weight"):
                    p.fill_(1.0)
                else:
                    p.normal_(0.0, std, generator=gen)
    return model.to(dtype).eval()
