"""Decode step: a Llama-style decoder and DecodeSession, which runs each decode step as one CUDA graph.

The model (RMSNorm, rotary embeddings, grouped-query attention, SiLU-gated MLP, tied or separate LM
head) comes with the layouts of SmolLM2-135M and Qwen2.5-0.5B and random weights (nothing is
downloaded). Q/K/V and gate/up are fused Linears; parameter counts equal the real models'.

:class:`DecodeSession` prefills eagerly, then captures one decode step (every layer, the LM head,
greedy argmax, and advancing the token and length buffers) into a single CUDA graph with static
buffers. The cache length lives on the device, so a graph serves every length of its length
bucket; each bucket gets its own graph, captured on first use, and with ``attention="auto"`` its
own measured attention choice (:func:`l2lightning.decode.attention.choose_attention`). The small
elementwise parts (RMSNorm with the residual add, rotary, SiLU-gate) are ``torch.compile``d in
default mode and warmed before capture; next-layer weights are prefetched into L2 by
:class:`l2lightning.prefetch.hooks.PrefetchHooks` (forward only) recorded into the graph.
:class:`TorchDecodeSession` is the plain-PyTorch baseline: same model, compiled elementwise ops,
SDPA attention over the bucket's window, the whole step in one graph, no prefetch.

Numerics: ``record_layers=True`` keeps each layer's attention inputs and output
(:class:`LayerRecorder`); :class:`Fp32Reference` is the same model with its weights upcast, run
eagerly in full precision on the same cache; :func:`compare_with_reference` measures sessions
against it. :func:`decode_step_report` says where a captured step's time goes (kernels per layer
and part against the bytes each must move).

Example:
    >>> model = build_decoder(SMOLLM2_135M, device="cuda")  # doctest: +SKIP
    >>> session = DecodeSession(model, batch=1, max_len=512)  # doctest: +SKIP
    >>> tokens = session.generate(torch.randint(0, 49152, (1, 16)), new_tokens=32)  # doctest: +SKIP
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import math
import re
import statistics
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from l2lightning.capture import graph_capture
from l2lightning.decode.attention import (
    MAX_SPLITS,
    AttentionBackend,
    AttentionChoice,
    AttentionSpec,
    choose_attention,
    make_backend,
    unavailable_reason,
)
from l2lightning.prefetch.plan import PrefetchPlan

ATTENTION_MODES = ("auto", "kernel", "torch", "flashinfer")


# ------------------------------------------------------------------------------------------ config
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


# ------------------------------------------------------------------------------------------ elementwise math
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


# ------------------------------------------------------------------------------------------ model
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


# ------------------------------------------------------------------------------------------ session
def length_bucket(n_keys: int, max_len: int) -> int:
    """The length bucket (attended keys) a step with `n_keys` keys runs in: multiples of 64 up to
    1024, of 128 beyond, capped at `max_len`. One graph per bucket."""
    granule = 64 if n_keys <= 1024 else 128
    return min(max_len, -(-n_keys // granule) * granule)


PrefetchArg = None | str | PrefetchPlan | Mapping[str, PrefetchPlan | None]


def _check_prefetch(prefetch: Any) -> None:
    if prefetch is None or prefetch in ("default", "auto") or isinstance(prefetch, PrefetchPlan):
        return
    if isinstance(prefetch, Mapping):
        for key, plan in prefetch.items():
            if plan is not None and not isinstance(plan, PrefetchPlan):
                raise TypeError(
                    f"`prefetch[{key!r}]` must be a PrefetchPlan or None, got {type(plan).__name__}"
                )
        return
    raise ValueError(
        f"`prefetch` must be None, 'default', 'auto', a PrefetchPlan or a mapping of layer name to plan; got {prefetch!r}"
    )


class DecodeSession:
    """Greedy decoding with each decode step replayed as one CUDA graph.

    Args:
        model: a :class:`LlamaDecoder` (on a CUDA device for graphs and the kernel).
        batch: sequences decoded together (prompts of one length).
        max_len: KV-cache capacity in tokens (prompt plus generated).
        attention: ``"auto"`` (measure each available implementation per length bucket at capture
            time and keep the fastest), ``"kernel"`` (kernels/decode_attention.cu), ``"torch"``
            (SDPA) or ``"flashinfer"``.
        compile_elementwise: ``torch.compile`` the RMSNorm/rotary/SiLU-gate parts (default mode).
        prefetch: next-layer L2 weight prefetch recorded into the graph: ``"auto"`` (the default:
            the autotuner keeps a plan per layer shape only where it measured a gain), ``"default"``
            (plans sized by layer bytes; these made the Qwen2.5-0.5B step 2-4% slower on an H200), a
            :class:`PrefetchPlan` or a mapping of layer name to plan; ``None`` turns it off.
        graph: capture steps into CUDA graphs (``False``: run each step eagerly, e.g. as a
            reference or on CPU with ``attention="torch"``).
        splits: the kernel's split count (default: sized per bucket).
        warmup: eager warm-up steps before each capture (compiles, cuBLAS handles).
        record_layers: keep each layer's attention inputs and output of the latest step in
            :attr:`recorder` (a :class:`LayerRecorder`; four small copies per layer, recorded into
            the graph too): for numerics checks, not for timing.

    Example:
        >>> session = DecodeSession(build_decoder("smollm2-135m"), batch=1, max_len=256)  # doctest: +SKIP
        >>> session.generate(prompt_ids, new_tokens=16)  # doctest: +SKIP
    """

    def __init__(
        self,
        model: LlamaDecoder,
        batch: int,
        max_len: int,
        attention: str = "auto",
        compile_elementwise: bool = True,
        prefetch: PrefetchArg = "auto",
        *,
        graph: bool = True,
        splits: int | None = None,
        warmup: int = 2,
        record_layers: bool = False,
    ) -> None:
        if not isinstance(model, LlamaDecoder):
            raise TypeError(f"`model` must be a LlamaDecoder (see build_decoder), got {type(model).__name__}")
        for name, value, low in (("batch", batch, 1), ("max_len", max_len, 2), ("warmup", warmup, 1)):
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"`{name}` must be an int >= {low}, got {value!r}")
        if attention not in ATTENTION_MODES:
            raise ValueError(f"`attention` must be one of {ATTENTION_MODES}, got {attention!r}")
        for name, value in (
            ("compile_elementwise", compile_elementwise),
            ("graph", graph),
            ("record_layers", record_layers),
        ):
            if not isinstance(value, bool):
                raise TypeError(f"`{name}` must be a bool, got {type(value).__name__}")
        _check_prefetch(prefetch)
        if splits is not None and (
            isinstance(splits, bool) or not isinstance(splits, int) or not 1 <= splits <= MAX_SPLITS
        ):
            raise ValueError(f"`splits` must be an int in [1, {MAX_SPLITS}] or None, got {splits!r}")
        if splits is not None and attention != "kernel":
            raise ValueError(f"`splits` applies to attention='kernel' only, got attention={attention!r}")
        param = next(model.parameters())
        self.device, self.dtype = param.device, param.dtype
        if self.device.type != "cuda":
            if graph:
                raise RuntimeError(
                    f"DecodeSession(graph=True) needs the model on a CUDA device, got {self.device}; "
                    "use graph=False with attention='torch' on CPU"
                )
            if attention in ("kernel", "flashinfer"):
                raise RuntimeError(
                    f"attention={attention!r} needs the model on a CUDA device, got {self.device}"
                )
        if attention in ("kernel", "flashinfer"):
            reason = unavailable_reason(attention, model.config.head_dim, self.dtype, self.device)
            if reason:
                raise RuntimeError(f"attention={attention!r} is unavailable: {reason}")
        self.model, self.config = model, model.config
        self.batch, self.max_len, self.attention = batch, max_len, attention
        self.use_graph, self.splits, self.warmup = graph, splits, warmup
        self.prefetch = prefetch
        fns = compiled_fns() if compile_elementwise else EAGER_FNS
        self.state = DecodeState.allocate(self.config, batch, max_len, self.device, self.dtype, fns)
        if record_layers:
            self.state.recorder = LayerRecorder(self.config, batch, self.device, self.dtype)
        self.tokens = torch.zeros(
            batch, dtype=torch.long, device=self.device
        )  # static input: this step's tokens
        self.cache_lens = torch.zeros(
            batch, dtype=torch.int32, device=self.device
        )  # static: tokens cached = positions
        self.next_tokens = torch.zeros(batch, dtype=torch.long, device=self.device)  # static output
        self.logits = torch.zeros(batch, self.config.vocab, dtype=self.dtype, device=self.device)
        self.length = 0  # host mirror of cache_lens (all sequences advance together)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.backends: dict[int, AttentionBackend] = {}
        self.choices: dict[int, AttentionChoice | str] = {}
        self.prefetch_summary: list[dict[str, Any]] = []
        self._ready = False
        self._eager_hooks = None
        if not graph and prefetch is not None:
            self._eager_hooks = self._install_hooks()

    # -------------------------------------------------------------- attention per bucket
    def _backend(self, bucket: int) -> AttentionBackend:
        backend = self.backends.get(bucket)
        if backend is not None:
            return backend
        c = self.config
        if self.attention == "auto":
            if self.device.type == "cuda":
                choice = choose_attention(
                    c.heads, c.kv_heads, c.head_dim, bucket, self.dtype, self.batch, self.device
                )
                spec: AttentionSpec = choice.spec
                self.choices[bucket] = choice
            else:
                spec = AttentionSpec("torch")
                self.choices[bucket] = "torch (not on CUDA)"
        else:
            spec = AttentionSpec(self.attention, splits=self.splits if self.attention == "kernel" else None)
        backend = make_backend(
            spec,
            batch=self.batch,
            heads=c.heads,
            kv_heads=c.kv_heads,
            head_dim=c.head_dim,
            max_len=self.max_len,
            window=bucket,
            dtype=self.dtype,
            device=self.device,
        )
        self.choices.setdefault(bucket, backend.label)
        self.backends[bucket] = backend
        return backend

    # -------------------------------------------------------------- prefetch
    def _install_hooks(self) -> Any:
        from l2lightning.prefetch.hooks import PrefetchHooks

        if self.state.attention is None:  # the hooks' dry run needs some attention: SDPA over the whole cache
            self.state.attention = (
                self._backend(self.max_len)
                if self.attention == "torch"
                else make_backend(
                    AttentionSpec("torch"),
                    batch=self.batch,
                    heads=self.config.heads,
                    kv_heads=self.config.kv_heads,
                    head_dim=self.config.head_dim,
                    max_len=self.max_len,
                    dtype=self.dtype,
                    device=self.device,
                )
            )
        plans = None if self.prefetch == "default" else self.prefetch
        # The dry run writes the current token's key/value at the current position, which the next
        # step writes again with the same values.
        hooks = PrefetchHooks(
            self.model, (self.tokens, self.cache_lens, self.state), backward=False, plans=plans
        )
        self.prefetch_summary = hooks.plan_summary()
        return hooks

    @contextlib.contextmanager
    def _capture_hooks(self) -> Iterator[Any]:
        """Prefetch hooks installed for one warm-up + capture only: the graph keeps the recorded
        prefetches, and the model stays plain PyTorch for everyone else afterwards."""
        if self.prefetch is None:
            yield None
            return
        hooks = self._install_hooks()
        try:
            yield hooks
        finally:
            hooks.remove()

    # -------------------------------------------------------------- step
    def _body(self) -> None:
        logits = self.model(self.tokens, self.cache_lens, self.state)
        self.logits.copy_(logits)
        self.next_tokens.copy_(torch.argmax(logits, dim=-1))

    def _advance(self) -> None:
        self.tokens.copy_(self.next_tokens)
        self.cache_lens.add_(1)

    def _capture(self, bucket: int) -> torch.cuda.CUDAGraph:
        backend = self._backend(bucket)
        self.state.attention = backend  # before the hooks' dry run, so that it computes this step
        backend.before_replay(self.length)
        with torch.no_grad(), self._capture_hooks():
            current = torch.cuda.current_stream(self.device)
            side = torch.cuda.Stream(device=self.device)
            side.wait_stream(current)
            with torch.cuda.stream(side):  # warm-up: compiles, cuBLAS workspaces, the kernel's workspace
                for _ in range(self.warmup):
                    self._body()  # rewrites this position's key/value with the same values
            current.wait_stream(side)
            torch.cuda.synchronize(self.device)
            graph = torch.cuda.CUDAGraph()
            with graph_capture(graph):
                self._body()
                self._advance()
        torch.cuda.synchronize(self.device)
        return graph

    def graph_for(self, cached: int) -> torch.cuda.CUDAGraph:
        """The graph of a step at `cached` tokens (captured now if its bucket has none); needs graph=True."""
        if not self.use_graph:
            raise RuntimeError("this session runs eagerly (graph=False)")
        bucket = length_bucket(cached + 1, self.max_len)
        graph = self.graphs.get(bucket)
        if graph is None:
            graph = self.graphs[bucket] = self._capture(bucket)
        return graph

    def step(self) -> torch.Tensor:
        """One decode step: returns the static buffer of next tokens [batch] (clone to keep)."""
        if not self._ready:
            raise RuntimeError("call prefill(prompt_ids) (or set_length) before step()")
        if self.length >= self.max_len:
            raise RuntimeError(
                f"the KV cache is full: {self.length} of max_len={self.max_len} positions used"
            )
        bucket = length_bucket(self.length + 1, self.max_len)
        if self.use_graph:
            graph = self.graph_for(self.length)
            self.backends[bucket].before_replay(self.length)
            graph.replay()
        else:
            backend = self._backend(bucket)
            self.state.attention = backend
            backend.before_replay(self.length)
            with torch.no_grad():
                self._body()
                self._advance()
        self.length += 1
        return self.next_tokens

    def prefill(self, prompt_ids: torch.Tensor) -> torch.Tensor:
        """Fill the cache from prompts [batch, T] (eager); returns the static logits of the last position.

        The next step's input token is set to the prompt's greedy continuation.
        """
        if not isinstance(prompt_ids, torch.Tensor) or prompt_ids.dim() != 2:
            raise ValueError(
                f"`prompt_ids` must be a [batch, T] tensor of token ids, got {getattr(prompt_ids, 'shape', prompt_ids)!r}"
            )
        if prompt_ids.dtype not in (torch.int64, torch.int32):
            raise ValueError(f"`prompt_ids` must hold integer token ids, got {prompt_ids.dtype}")
        batch, length = prompt_ids.shape
        if batch != self.batch:
            raise ValueError(f"`prompt_ids` has batch {batch}, the session was made for batch {self.batch}")
        if not 1 <= length < self.max_len:
            raise ValueError(f"`prompt_ids` length must be in [1, max_len={self.max_len}), got {length}")
        ids = prompt_ids.to(self.device, torch.long)
        with torch.no_grad():
            logits = self.model.prefill(ids, self.state)
            self.logits.copy_(logits)
            self.next_tokens.copy_(torch.argmax(logits, dim=-1))
            self.tokens.copy_(self.next_tokens)
            self.cache_lens.fill_(length)
        self.length = length
        self._ready = True
        return self.logits

    def set_length(self, cached: int, tokens: torch.Tensor | None = None) -> None:
        """Pretend `cached` tokens are in the cache (whatever it holds), e.g. for benchmarks; optionally
        set the next input tokens [batch]. Runs outside graphs."""
        if isinstance(cached, bool) or not isinstance(cached, int) or not 0 <= cached < self.max_len:
            raise ValueError(f"`cached` must be an int in [0, max_len={self.max_len}), got {cached!r}")
        self.cache_lens.fill_(cached)
        if tokens is not None:
            self.tokens.copy_(tokens)
        self.length = cached
        self._ready = True

    def generate(self, prompt_ids: torch.Tensor, new_tokens: int) -> torch.Tensor:
        """Greedy continuation: prefill, then ``new_tokens - 1`` decode steps; returns [batch, new_tokens]."""
        if isinstance(new_tokens, bool) or not isinstance(new_tokens, int) or new_tokens < 1:
            raise ValueError(f"`new_tokens` must be an int >= 1, got {new_tokens!r}")
        if (
            isinstance(prompt_ids, torch.Tensor)
            and prompt_ids.dim() == 2
            and prompt_ids.shape[1] + new_tokens - 1 > self.max_len
        ):
            raise ValueError(
                f"prompt ({prompt_ids.shape[1]}) + new_tokens ({new_tokens}) - 1 exceeds max_len={self.max_len}"
            )
        self.prefill(prompt_ids)
        out = torch.empty(self.batch, new_tokens, dtype=torch.long, device=self.device)
        out[:, 0] = self.next_tokens
        for i in range(1, new_tokens):
            out[:, i] = self.step()
        return out

    def describe(self) -> str:
        """Attention per captured bucket (with the measured table for "auto") and the prefetch plans."""
        lines = [
            f"{type(self).__name__}: {self.config.name} x{self.config.layers} layers, batch {self.batch}, "
            f"max_len {self.max_len}, attention={self.attention}, elementwise "
            f"{'compiled' if self.state.fns.compiled else 'eager'}, graph={self.use_graph}"
            + (", recording layers" if self.recorder is not None else "")
        ]
        for bucket, choice in sorted(self.choices.items()):
            lines.append(
                choice.table() if isinstance(choice, AttentionChoice) else f"bucket {bucket}: {choice}"
            )
        if self.prefetch is None:
            lines.append("prefetch: off")
        else:
            used = [r for r in self.prefetch_summary if r["forward"]]
            lines.append(
                f"prefetch ({self.prefetch if isinstance(self.prefetch, str) else 'custom'}): "
                f"{len(used)} of {len(self.prefetch_summary)} chain layers get a plan"
            )
        return "\n".join(lines)

    @property
    def recorder(self) -> LayerRecorder | None:
        """The per-layer recording of the latest step (``record_layers=True``), else None."""
        return self.state.recorder

    def close(self) -> None:
        """Drop the graphs and remove any installed hooks."""
        if self._eager_hooks is not None:
            self._eager_hooks.remove()
            self._eager_hooks = None
        self.graphs.clear()
        self.backends.clear()


class TorchDecodeSession(DecodeSession):
    """The plain-PyTorch baseline: same model, compiled elementwise ops, SDPA attention over the
    bucket's window, the whole step in one CUDA graph per bucket, no prefetch, no custom kernel."""

    def __init__(
        self,
        model: LlamaDecoder,
        batch: int,
        max_len: int,
        *,
        graph: bool = True,
        warmup: int = 2,
        record_layers: bool = False,
    ) -> None:
        super().__init__(
            model,
            batch,
            max_len,
            attention="torch",
            compile_elementwise=True,
            prefetch=None,
            graph=graph,
            warmup=warmup,
            record_layers=record_layers,
        )


# ------------------------------------------------------------------------------------------ numerics
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


def upcast_decoder(model: LlamaDecoder, dtype: torch.dtype = torch.float32) -> LlamaDecoder:
    """A copy of `model` with every parameter converted to `dtype` (bf16 -> fp32 is exact), tied
    LM head kept tied, on the same device; `model` itself is untouched."""
    if not isinstance(model, LlamaDecoder):
        raise TypeError(f"`model` must be a LlamaDecoder, got {type(model).__name__}")
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ValueError(f"`dtype` must be a floating-point torch.dtype, got {dtype!r}")
    return copy.deepcopy(model).to(dtype).eval()


@contextlib.contextmanager
def full_precision() -> Iterator[None]:
    """FP32 matmuls without TF32 (``set_float32_matmul_precision("highest")``) and SDPA's math
    backend, for reference computations; the previous settings are restored afterwards."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    previous = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")
    try:
        with sdpa_kernel(SDPBackend.MATH):
            yield
    finally:
        torch.set_float32_matmul_precision(previous)


class Fp32Reference:
    """The eager full-precision reference of a decode step, layer by layer.

    Holds a copy of `model` with its weights upcast to `dtype` (exactly: every bf16 value is an
    fp32 value) and an eager session over it (SDPA's math backend, no TF32, every layer recorded in
    :attr:`recorder`). :meth:`step` copies the first ``cached`` positions of a KV cache (e.g. the
    bf16 session's under test, upcast) into its own cache and runs one step, so the reference and
    the session see the same weights, the same cache and the same token.

    Args:
        model: the (bf16) decoder under test.
        batch: sequences per step.
        max_len: cache capacity; at least the session's.
        dtype: reference precision (``torch.float32``; ``torch.float64`` for a check of the check).

    Example:
        >>> ref = Fp32Reference(model, 1, 1024)  # doctest: +SKIP
        >>> logits = ref.step(session.state.k_cache, session.state.v_cache, 320, tokens)  # doctest: +SKIP
        >>> relative_error(session.logits, logits), ref.recorder.attn[5]  # doctest: +SKIP
    """

    def __init__(
        self, model: LlamaDecoder, batch: int, max_len: int, dtype: torch.dtype = torch.float32
    ) -> None:
        self.model = upcast_decoder(model, dtype)
        self.session = DecodeSession(
            self.model,
            batch,
            max_len,
            attention="torch",
            compile_elementwise=False,
            prefetch=None,
            graph=False,
            record_layers=True,
        )

    @property
    def recorder(self) -> LayerRecorder:
        assert self.session.recorder is not None
        return self.session.recorder

    def step(
        self, k_cache: torch.Tensor, v_cache: torch.Tensor, cached: int, tokens: torch.Tensor
    ) -> torch.Tensor:
        """One step at `cached` cached tokens with next input `tokens` [batch], over positions
        ``[0, cached)`` of `k_cache`/`v_cache` ([layers, batch, kv_heads, >= cached, head_dim], any
        float dtype). Returns the logits [batch, vocab] (this reference's buffer: clone to keep)."""
        state = self.session.state
        shape = state.k_cache.shape
        for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
            if (
                not isinstance(t, torch.Tensor)
                or t.dim() != 5
                or t.shape[:3] != shape[:3]
                or t.shape[4] != shape[4]
            ):
                raise ValueError(
                    f"`{name}` must be [layers, batch, kv_heads, positions, head_dim] = "
                    f"[{shape[0]}, {shape[1]}, {shape[2]}, >= cached, {shape[4]}], got {tuple(getattr(t, 'shape', ()))}"
                )
        if isinstance(cached, bool) or not isinstance(cached, int) or not 0 <= cached <= k_cache.shape[3]:
            raise ValueError(f"`cached` must be an int in [0, {k_cache.shape[3]}], got {cached!r}")
        with torch.no_grad(), full_precision():
            state.k_cache[:, :, :, :cached].copy_(k_cache[:, :, :, :cached])
            state.v_cache[:, :, :, :cached].copy_(v_cache[:, :, :, :cached])
            self.session.set_length(cached, tokens.to(self.session.device))
            self.session.step()
        return self.session.logits


def recorded_attention_reference(session: DecodeSession) -> torch.Tensor:
    """Float64 attention (returned as float32) over each layer's recorded q, k, v and the session's
    cache at its latest step: [layers, batch, heads, head_dim].

    Compared with ``session.recorder.attn`` this is the error of the attention operation alone,
    given the inputs it actually got, apart from what the layers before it passed on. Needs
    ``record_layers=True`` and a step run since the cache was last changed. Syncs with the host.
    """
    from l2lightning.decode.attention import reference_decode_attention

    rec = session.recorder
    if rec is None:
        raise RuntimeError("the session records no layers: create it with record_layers=True")
    lens = (session.cache_lens - 1).to(torch.int32)  # the latest step ran at cache_lens - 1 cached
    if bool((lens < 0).any()):
        raise RuntimeError("no decode step has run on this session yet")
    state = session.state
    return torch.stack(
        [
            reference_decode_attention(rec.q[i], rec.k[i], rec.v[i], state.k_cache[i], state.v_cache[i], lens)
            for i in range(session.config.layers)
        ]
    )


def compare_with_reference(
    sessions: Mapping[str, DecodeSession],
    reference: Fp32Reference,
    cached: int,
    *,
    samples: int = 8,
    seed: int = 0,
) -> dict[str, dict[str, Any]]:
    """Each session's decode step against the full-precision reference, over `samples` independent
    draws of a random KV cache (normal(0, 1), as the decode benchmark fills it) and next tokens.

    For every sample, each session (all of one model, batch and dtype) and the reference get the
    same cache in positions ``[0, cached)`` and the same tokens, and take one step. Errors are
    :func:`relative_error` over all samples together: one draw alone is noisy (two bf16 runs of a
    full-depth random model that differ only in how attention rounds reach logits errors whose
    ratio moves by tens of percent from draw to draw), several independent draws average that out.
    Per session:

    - ``logits_rel_err``: the logits against the reference's; ``logits_rel_err_samples`` per draw;
      ``argmax_equal``: the fraction of sequences whose greedy token is the reference's.
    - with ``record_layers=True``: ``attn_rel_err`` per layer, the attention output against the
      reference's (what the layers before passed on included); ``attn_op_rel_err`` per layer, the
      attention output against float64 attention over the inputs this session's layer actually got
      (the attention operation alone, :func:`recorded_attention_reference`); and
      ``attn_op_rounding_floor`` per layer, the error of that float64 result rounded once to the
      session's dtype: no implementation that returns the session's dtype can be closer.

    Leaves every session's cache holding the last draw.
    """
    if not sessions:
        raise ValueError("`sessions` is empty: nothing to compare")
    if not isinstance(reference, Fp32Reference):
        raise TypeError(f"`reference` must be an Fp32Reference, got {type(reference).__name__}")
    if isinstance(samples, bool) or not isinstance(samples, int) or samples < 1:
        raise ValueError(f"`samples` must be an int >= 1, got {samples!r}")
    first = next(iter(sessions.values()))
    cfg, batch, device, dtype = first.config, first.batch, first.device, first.dtype
    for name, s in sessions.items():
        if (s.config, s.batch, s.device, s.dtype) != (cfg, batch, device, dtype):
            raise ValueError(
                f"session {name!r} differs in model layout, batch, device or dtype from the others"
            )
        if not 0 <= cached < s.max_len:
            raise ValueError(f"`cached` ({cached}) must be below session {name!r}'s max_len ({s.max_len})")
    shape = (cfg.layers, batch, cfg.kv_heads, cached, cfg.head_dim)
    gen = torch.Generator(device=device).manual_seed(seed)
    keys = ("logits", "attn", "op_ref")
    got: dict[str, dict[str, list[torch.Tensor]]] = {n: {k: [] for k in keys} for n in sessions}
    ref_logits: list[torch.Tensor] = []
    ref_attn: list[torch.Tensor] = []
    for _ in range(samples):
        k = torch.randn(shape, generator=gen, device=device).to(dtype)
        v = torch.randn(shape, generator=gen, device=device).to(dtype)
        tokens = torch.randint(0, cfg.vocab, (batch,), generator=gen, device=device)
        ref_logits.append(reference.step(k, v, cached, tokens).float().clone())
        ref_attn.append(reference.recorder.attn.float().clone())
        for name, s in sessions.items():
            with torch.no_grad():
                s.state.k_cache[:, :, :, :cached].copy_(k)
                s.state.v_cache[:, :, :, :cached].copy_(v)
            s.set_length(cached, tokens)
            s.step()
            got[name]["logits"].append(s.logits.float().clone())
            if s.recorder is not None:
                got[name]["attn"].append(s.recorder.attn.float().clone())
                got[name]["op_ref"].append(recorded_attention_reference(s))
    r_logits, r_attn = torch.stack(ref_logits), torch.stack(ref_attn)  # [S, B, V], [S, L, B, H, D]
    out: dict[str, dict[str, Any]] = {}
    for name, g in got.items():
        logits = torch.stack(g["logits"])
        row: dict[str, Any] = {
            "logits_rel_err": relative_error(logits, r_logits),
            "logits_rel_err_samples": [relative_error(a, b) for a, b in zip(logits, r_logits)],
            "argmax_equal": (logits.argmax(-1) == r_logits.argmax(-1)).double().mean().item(),
            "attn_rel_err": None,
            "attn_op_rel_err": None,
            "attn_op_rounding_floor": None,
        }
        if g["attn"]:
            attn, op_ref = torch.stack(g["attn"]), torch.stack(g["op_ref"])
            rounded = op_ref.to(dtype).float()
            layers = range(cfg.layers)
            row["attn_rel_err"] = [relative_error(attn[:, i], r_attn[:, i]) for i in layers]
            row["attn_op_rel_err"] = [relative_error(attn[:, i], op_ref[:, i]) for i in layers]
            row["attn_op_rounding_floor"] = [relative_error(rounded[:, i], op_ref[:, i]) for i in layers]
        out[name] = row
    return out


# ------------------------------------------------------------------------------------------ step report
RANGE_PREFIX = "l2l::"
# Host calls that put one kernel, copy or fill on a stream (floors.LAUNCH_API_NAMES and relatives).
_LAUNCH_NAMES = frozenset(
    {
        "cudaLaunchKernel",
        "cudaLaunchKernelExC",
        "cudaLaunchKernelEx",
        "cuLaunchKernel",
        "cuLaunchKernelEx",
        "cudaLaunchCooperativeKernel",
        "cudaMemcpyAsync",
        "cudaMemsetAsync",
        "cudaMemcpy2DAsync",
    }
)
# Finer roles -> the groups the step report shows as its phases.
ROLE_GROUPS = {
    "qkv": "linear",
    "o_proj": "linear",
    "gate_up": "linear",
    "down": "linear",
    "lm_head": "lm_head",
    "attention": "attention",
    "attention_prepare": "attention",
    "rms_norm": "elementwise",
    "add_rms_norm": "elementwise",
    "qkv_rope": "elementwise",
    "silu_mul": "elementwise",
    "embed": "other",
    "other": "other",
    "unattributed": "other",
}


@dataclass(frozen=True)
class ProfEvent:
    """One profiler event, reduced to what the kernel attribution needs (times in µs)."""

    name: str
    start_us: float
    end_us: float
    on_device: bool
    id: int = 0  # correlation id: a kernel's equals its launch call's
    linked: int = 0  # a kernel's linked correlation id: the host op (or range) it was launched in


def prof_events(prof: Any) -> list[ProfEvent]:
    """A ``torch.profiler.profile``'s events as :class:`ProfEvent` (device = CUDA-side records)."""
    cuda = torch.autograd.DeviceType.CUDA
    out = []
    for e in prof.events():
        name, tr = str(e.name), e.time_range
        on_device = getattr(e, "device_type", None) == cuda
        if on_device and (name.startswith(RANGE_PREFIX) or getattr(e, "is_user_annotation", False)):
            continue  # a host range drawn on the device timeline, not a kernel
        out.append(
            ProfEvent(
                name,
                float(tr.start),
                float(tr.end),
                on_device,
                int(getattr(e, "id", 0) or 0),
                int(getattr(e, "linked_correlation_id", 0) or 0),
            )
        )
    return out


def _launch_base(name: str) -> str:
    """``cudaLaunchKernel_v7000`` / ``..._ptsz`` -> ``cudaLaunchKernel``."""
    return re.sub(r"(_v\d+|_pt[sd]z)+$", "", name)


def attribute_kernels(events: list[ProfEvent]) -> tuple[list[dict[str, Any]], str]:
    """Which part of a decode step launched each device-side event of one profiled eager step.

    Ranges are the ``l2l::`` host ranges :func:`profile_ranges` opens around each Linear
    (``layers.3.qkv``, ``lm_head``), the embedding, the attention call and each elementwise function.
    A kernel's launch time is that of the host launch call with its correlation id, else the start
    of the host op its linked correlation id names (the op it was launched in); a time after the
    kernel's own start is not believed. When some kernel has no time that way and there are as
    many launch calls as kernels, the k-th launch call is taken for the k-th kernel (one stream).
    A kernel's role is the innermost range around its launch (``"other"`` outside every range,
    ``"unattributed"`` without a launch time); its layer is the last ``layers.<i>.qkv`` range begun
    before it, ``None`` before the first layer and from the LM head on. Returns (rows in device
    order, method: ``"correlation"``, ``"order"``, ``"partial"`` or ``"none"``).
    """
    ranges = [
        (e.name[len(RANGE_PREFIX) :], e.start_us, e.end_us)
        for e in events
        if not e.on_device and e.name.startswith(RANGE_PREFIX)
    ]
    launches, ops = [], []
    for e in events:
        if not e.on_device:
            (launches if _launch_base(e.name) in _LAUNCH_NAMES else ops).append(e)
    launches.sort(key=lambda e: e.start_us)
    kernels = sorted((e for e in events if e.on_device), key=lambda e: e.start_us)
    # CUPTI ids (kernels, launch calls) and torch op ids are separate counters: look each up only
    # among its own kind.
    launch_at: dict[int, float] = {}
    for e in launches:
        if e.id:
            launch_at.setdefault(e.id, e.start_us)
    op_at: dict[int, float] = {}
    for e in ops:
        if e.id:
            op_at.setdefault(e.id, e.start_us)
    host: list[float | None] = []
    for k in kernels:
        t = launch_at.get(k.id) if k.id else None
        if t is None and k.linked:
            t = op_at.get(k.linked)
        host.append(t if t is not None and t <= k.start_us else None)
    method = "correlation"
    if kernels and any(t is None for t in host):
        if len(launches) == len(kernels):
            host, method = [e.start_us for e in launches], "order"
        else:
            method = "partial" if any(t is not None for t in host) else "none"
    marks = sorted(
        (start, int(m.group(1)))
        for name, start, _ in ranges
        if (m := re.fullmatch(r"layers\.(\d+)\.qkv", name)) is not None
    )
    head_start = min((start for name, start, _ in ranges if name == "lm_head"), default=math.inf)
    rows = []
    for k, t in zip(kernels, host):
        role, layer = "unattributed", None
        if t is not None:
            around = [(start, -(end - start), name) for name, start, end in ranges if start <= t <= end]
            name = max(around)[2] if around else None  # innermost: the latest start, then the shortest
            role = "other" if name is None else name.rsplit(".", 1)[-1]
            if t < head_start:
                before = [i for start, i in marks if start <= t]
                layer = before[-1] if before else None
        rows.append(
            {
                "name": k.name,
                "start_us": k.start_us,
                "time_us": k.end_us - k.start_us,
                "role": role,
                "layer": layer,
            }
        )
    return rows, method


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


class _RangedAttention:
    """An attention backend whose calls open ``l2l::attention`` profiler ranges."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner

    def prepare(self, cache_lens: torch.Tensor) -> None:
        with torch.profiler.record_function(RANGE_PREFIX + "attention_prepare"):
            self.inner.prepare(cache_lens)

    def __call__(self, *args: Any) -> torch.Tensor:
        with torch.profiler.record_function(RANGE_PREFIX + "attention"):
            return self.inner(*args)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def _ranged(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    def call(*args: Any, **kwargs: Any) -> Any:
        with torch.profiler.record_function(RANGE_PREFIX + name):
            return fn(*args, **kwargs)

    return call


@contextlib.contextmanager
def profile_ranges(session: DecodeSession) -> Iterator[None]:
    """While open, an eager step of `session` marks its parts with ``l2l::`` profiler ranges: each
    Linear and the embedding under its module name (``layers.3.qkv``, ``lm_head``), the attention
    call, and each elementwise function. Forward hooks and wrappers only: nothing is recorded into
    a graph, and the model and state are restored on exit."""
    state = session.state
    handles: list[Any] = []
    open_ranges: dict[str, Any] = {}

    def pre(name: str) -> Callable[..., None]:
        def hook(module: nn.Module, args: Any) -> None:
            rf = torch.profiler.record_function(RANGE_PREFIX + name)
            rf.__enter__()
            open_ranges[name] = rf

        return hook

    def post(name: str) -> Callable[..., None]:
        def hook(module: nn.Module, args: Any, output: Any) -> None:
            rf = open_ranges.pop(name, None)
            if rf is not None:
                rf.__exit__(None, None, None)

        return hook

    saved_fns, saved_attention = state.fns, state.attention
    try:
        for name, module in session.model.named_modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                handles.append(module.register_forward_pre_hook(pre(name)))
                handles.append(module.register_forward_hook(post(name)))
        f = saved_fns
        state.fns = dataclasses.replace(
            f,
            rms_norm=_ranged("rms_norm", f.rms_norm),
            add_rms_norm=_ranged("add_rms_norm", f.add_rms_norm),
            qkv_rope=_ranged("qkv_rope", f.qkv_rope),
            silu_mul=_ranged("silu_mul", f.silu_mul),
        )
        if saved_attention is not None:
            state.attention = _RangedAttention(saved_attention)  # type: ignore[assignment]
        yield
    finally:
        for h in handles:
            h.remove()
        for rf in open_ranges.values():
            rf.__exit__(None, None, None)
        state.fns, state.attention = saved_fns, saved_attention


def _time_replays(session: DecodeSession, cached: int, tokens: torch.Tensor | None, rounds: int = 5) -> float:
    """Median µs per step of `rounds` samples of 8 graph replays from `cached` tokens on."""
    for j in range(8):  # every bucket the samples touch, captured before timing
        session.graph_for(cached + j)
    samples = []
    for _ in range(rounds):
        session.set_length(cached, tokens)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(8):
            session.step()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) * 1000 / 8)
    return statistics.median(samples)


def _summarise(
    rows: list[dict[str, Any]], part_bytes: dict[str, int], layers: int, bw: float, key: str
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(per role, per layer) sums of kernels, time (`key` of each row), bytes and bytes floor."""
    instances: dict[tuple[Any, str], float] = {}  # (layer, role) -> time
    counts: dict[tuple[Any, str], int] = {}
    for r in rows:
        k = (r["layer"], r["role"])
        instances[k] = instances.get(k, 0.0) + r[key]
        counts[k] = counts.get(k, 0) + 1
    # Bytes count once per call of a part: layer parts once per layer, the rest once per step;
    # elementwise calls happen several times per layer (rms_norm once, add_rms_norm twice).
    calls_per_layer = {"add_rms_norm": 2}
    by_role: dict[str, dict[str, Any]] = {}
    by_layer: dict[int, dict[str, Any]] = {}
    for (layer, role), t in instances.items():
        n = counts[(layer, role)]
        nbytes = part_bytes.get(role, 0) * calls_per_layer.get(role, 1)
        agg = by_role.setdefault(
            role,
            {
                "role": role,
                "group": ROLE_GROUPS.get(role, "other"),
                "kernels": 0,
                "layered_kernels": 0,
                "time_us": 0.0,
                "bytes": 0,
            },
        )
        agg["kernels"] += n
        agg["layered_kernels"] += n if layer is not None else 0
        agg["time_us"] += t
        agg["bytes"] += nbytes
        if layer is not None:
            lay = by_layer.setdefault(layer, {"layer": layer, "kernels": 0, "time_us": 0.0, "bytes": 0})
            lay["kernels"] += n
            lay["time_us"] += t
            lay["bytes"] += nbytes
    for agg in [*by_role.values(), *by_layer.values()]:
        agg["floor_us"] = agg["bytes"] / bw * 1e6
        agg["x_floor"] = agg["time_us"] / agg["floor_us"] if agg["floor_us"] > 0 else None
        agg["us_per_kernel"] = agg["time_us"] / agg["kernels"] if agg["kernels"] else None
    for agg in by_role.values():  # None for parts outside the layers (embed, lm_head, ...)
        layered = agg.pop("layered_kernels")
        agg["kernels_per_layer"] = layered / layers if layered else None
    roles = sorted(by_role.values(), key=lambda a: -a["time_us"])
    return roles, [by_layer[i] for i in sorted(by_layer)]


def _parts_table(roles: list[dict[str, Any]]) -> list[str]:
    lines = [
        f"  {'part':<18}{'kernels':>8}{'/layer':>8}{'time us':>10}{'us/kernel':>11}"
        f"{'bytes floor us':>16}{'x floor':>9}"
    ]
    for r in roles:
        x = f"{r['x_floor']:.1f}" if r["x_floor"] else "-"
        per_layer = f"{r['kernels_per_layer']:.2f}" if r["kernels_per_layer"] is not None else "-"
        lines.append(
            f"  {r['role']:<18}{r['kernels']:>8}{per_layer:>8}{r['time_us']:>10.1f}"
            f"{r['us_per_kernel'] or 0:>11.2f}{r['floor_us']:>16.3f}{x:>9}"
        )
    return lines


def step_report_from_kernels(
    rows: list[dict[str, Any]],
    config: DecoderConfig,
    batch: int,
    cached: int,
    step_us: float,
    copy_bw: float,
    empty_kernel_us: float | None,
    *,
    dtype_bytes: int = 2,
    label: str = "",
    graph_info: dict[str, Any] | None = None,
    time_source: str = "eager",
) -> dict[str, Any]:
    """The report :func:`decode_step_report` returns, from attributed kernel rows
    (:func:`attribute_kernels`): sums per part and per layer against :func:`decode_part_bytes`, and
    the whole step as a :class:`l2lightning.floors.StepReport` with the part groups as phases."""
    from l2lightning.floors import Floors, PhaseTime, StepReport

    c = config
    graph_info = graph_info or {}
    part_bytes = decode_part_bytes(c, batch, cached, dtype_bytes)
    roles, per_layer = _summarise(rows, part_bytes, c.layers, copy_bw, "time_us")
    kernel_sum = sum(r["time_us"] for r in rows)
    groups: dict[str, dict[str, Any]] = {}
    for role in roles:
        g = groups.setdefault(role["group"], {"time_us": 0.0, "kernels": 0, "bytes": 0})
        g["time_us"] += role["time_us"]
        g["kernels"] += role["kernels"]
        g["bytes"] += role["bytes"]
    step_floor_bytes = decode_step_bytes(c, batch, cached, dtype_bytes)["total"]
    n_kernels = len(rows)
    bytes_us = step_floor_bytes / copy_bw * 1e6
    launch_us = None if empty_kernel_us is None else n_kernels * empty_kernel_us
    floors = Floors(
        bytes_us=bytes_us,
        launch_us=launch_us,
        larger=bytes_us if launch_us is None else max(bytes_us, launch_us),
        bound="launch" if launch_us is not None and launch_us > bytes_us else "bandwidth",
        bytes_moved=step_floor_bytes,
        bytes_by_phase={name: g["bytes"] for name, g in groups.items()},
        kernel_count=n_kernels,
        copy_bw_bytes_per_s=float(copy_bw),
        empty_kernel_us=empty_kernel_us,
        chain="decode",
    )
    phases = [PhaseTime(name, g["time_us"], g["kernels"]) for name, g in groups.items()]
    title = label or f"{c.name} decode step at {cached} cached tokens"
    step_report = StepReport(phases, floors, step_time_us=step_us, label=title)
    layer_kernels = [lay["kernels"] for lay in per_layer]
    per_layer_median = statistics.median(layer_kernels) if layer_kernels else None
    text = "\n".join(
        [
            step_report.format(),
            f"  kernels: {n_kernels} per step (eager, prefetch excluded), "
            f"{per_layer_median if per_layer_median is not None else '?'} per layer (median); "
            f"in the graph: {graph_info.get('kernels', '?')} ({graph_info.get('extra_kernels', '?')} only in the graph)",
            f"  kernel time {kernel_sum:.1f} us of the {step_us:.1f} us step "
            f"({time_source} kernel times; the rest is the gaps between kernels)",
            *_parts_table(roles),
        ]
    )
    return {
        "label": title,
        "model": c.name,
        "layers": c.layers,
        "batch": batch,
        "cached": cached,
        "step_us": step_us,
        "kernel_sum_us": kernel_sum,
        "gap_us": step_us - kernel_sum,
        "kernels_per_step": n_kernels,
        "kernels_per_layer": per_layer_median,
        "time_source": time_source,
        "copy_bandwidth_tbps": copy_bw / 1e12,
        "empty_kernel_us": empty_kernel_us,
        "bytes_floor_us": bytes_us,
        "x_bytes_floor": step_us / bytes_us,
        "graph": graph_info,
        "parts": roles,
        "per_layer": per_layer,
        "kernels": rows,
        "step_report": step_report.to_dict(),
        "text": text,
    }


def decode_step_report(
    session: DecodeSession,
    cached: int,
    tokens: torch.Tensor | None = None,
    *,
    step_us: float | None = None,
    copy_bw: float | None = None,
    empty_kernel_us: float | None = None,
    label: str = "",
) -> dict[str, Any]:
    """Where one decode step's time goes: kernels per step, per layer and per part, each part's time
    against the bytes it must move.

    Two profiled runs of the step at `cached` tokens: one eager step through the session's own
    modules, backend and (compiled) elementwise functions with :func:`profile_ranges` marking each
    part (which kernel belongs to which layer and part, :func:`attribute_kernels`), and one replay
    of the captured graph (the kernels' times inside the graph, and the prefetch kernels only the
    graph has). Where the graph's kernels, prefetch left aside, have the eager step's names in the
    same order, the per-kernel times are the graph's (``time_source: "graph"``), else the eager
    step's. Floors: bytes (:func:`decode_part_bytes`) over `copy_bw` (bytes read + written per
    second, as the decode benchmark's floor), launches times `empty_kernel_us`; both measured with
    the doctor's probes when not given. The whole step (`step_us`, timed here from graph replays
    when not given) is reported through :class:`l2lightning.floors.StepReport` with the part
    groups (linear, attention, elementwise, lm_head, other) as phases.

    Returns a JSON-ready dict; ``"text"`` holds the formatted report. Needs a CUDA graph session.
    """
    from torch.profiler import ProfilerActivity, profile

    if session.device.type != "cuda" or not session.use_graph:
        raise RuntimeError("decode_step_report profiles a CUDA graph session (graph=True on a CUDA device)")
    c = session.config
    device_index = session.device.index if session.device.index is not None else torch.cuda.current_device()
    if copy_bw is None or empty_kernel_us is None:
        from l2lightning.step_report import measure_ceilings

        measured_bw, measured_empty = measure_ceilings(device_index)
        copy_bw = copy_bw or measured_bw
        empty_kernel_us = empty_kernel_us if empty_kernel_us is not None else measured_empty
    if not copy_bw:
        raise RuntimeError("decode_step_report: the copy bandwidth could not be measured; pass copy_bw")
    bucket = length_bucket(cached + 1, session.max_len)
    session.set_length(cached, tokens)
    session.step()  # captures this bucket's graph if it has none yet
    if step_us is None:
        step_us = _time_replays(session, cached, tokens)
    backend = session.backends[bucket]

    # 1. one eager step (the graph's work: the body and the advance of tokens and lengths), parts marked
    def eager_step() -> None:
        backend.before_replay(cached)
        session.state.attention = backend
        with torch.no_grad(), profile_ranges(session):
            session._body()
            session._advance()

    session.set_length(cached, tokens)
    eager_step()  # warm (compiled functions, cuBLAS) outside the profiler
    session.set_length(cached, tokens)
    torch.cuda.synchronize(session.device)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        eager_step()
        torch.cuda.synchronize(session.device)
    rows, method = attribute_kernels(prof_events(prof))
    for r in rows:
        r["eager_us"] = r["time_us"]

    # 2. one graph replay
    graph_info: dict[str, Any] = {}
    time_source = "eager"
    try:
        session.set_length(cached, tokens)
        torch.cuda.synchronize(session.device)
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as gprof:
            session.step()
            torch.cuda.synchronize(session.device)
        dev = sorted((e for e in prof_events(gprof) if e.on_device), key=lambda e: e.start_us)
        eager_names = [r["name"] for r in rows]
        known = set(eager_names)
        same = [e for e in dev if e.name in known]
        extra = [e for e in dev if e.name not in known]
        aligned = bool(dev) and [e.name for e in same] == eager_names
        extra_names: dict[str, int] = {}
        for e in extra:
            extra_names[e.name] = extra_names.get(e.name, 0) + 1
        graph_info = {
            "kernels": len(dev),
            "aligned_with_eager": aligned,
            "extra_kernels": len(extra),
            "extra_kernel_names": extra_names,
            "extra_time_us": sum(e.end_us - e.start_us for e in extra),
            "span_us": (max(e.end_us for e in dev) - min(e.start_us for e in dev)) if dev else None,
        }
        if aligned:
            for r, e in zip(rows, same):
                r["time_us"] = e.end_us - e.start_us
            time_source = "graph"
        elif dev:
            mismatch = next(
                (i for i, (a, b) in enumerate(zip(eager_names, [e.name for e in same])) if a != b),
                min(len(eager_names), len(same)),
            )
            graph_info["first_mismatch"] = {
                "index": mismatch,
                "eager": eager_names[mismatch] if mismatch < len(eager_names) else None,
                "graph": same[mismatch].name if mismatch < len(same) else None,
                "eager_count": len(eager_names),
                "graph_count": len(same),
            }
    except Exception as exc:  # the eager attribution still stands; say why the graph part is missing
        graph_info = {"error": f"{type(exc).__name__}: {exc}"}

    # 3. sums, floors, the StepReport
    out = step_report_from_kernels(
        rows,
        c,
        session.batch,
        cached,
        step_us,
        copy_bw,
        empty_kernel_us,
        dtype_bytes=session.state.k_cache.element_size(),
        label=label,
        graph_info=graph_info,
        time_source=time_source,
    )
    out.update(
        bucket=bucket,
        attention=backend.label,
        prefetch=None if session.prefetch is None else str(session.prefetch),
        attribution=method,
    )
    return out
