"""Decode step: a Llama-style decoder and DecodeSession, which runs each decode step as one CUDA graph.

The model (RMSNorm, rotary embeddings, grouped-query attention, SiLU-gated MLP, tied or separate LM
head) comes with the layouts of SmolLM2-135M and Qwen2.5-0.5B and random weights (nothing is
downloaded). Q/K/V and gate/up are fused Linears; parameter counts equal the real models'.

:class:`DecodeSession` prefills eagerly, then captures one decode step (every layer, the LM head,
greedy argmax, and advancing the token and length buffers) into a single CUDA graph with static
buffers. The cache length lives on the device, so a graph serves every length of its length
bucket; each bucket gets its own graph, captured on first use, and with ``attention="auto"`` its
own measured attention choice (:func:`l2lightning.decode_attention.choose_attention`). The small
elementwise parts (RMSNorm with the residual add, rotary, SiLU-gate) are ``torch.compile``d in
default mode and warmed before capture; next-layer weights are prefetched into L2 by
:class:`l2lightning.hooks.PrefetchHooks` (forward only) recorded into the graph.
:class:`TorchDecodeSession` is the plain-PyTorch baseline: same model, compiled elementwise ops,
SDPA attention over the bucket's window, the whole step in one graph, no prefetch.

Example:
    >>> model = build_decoder(SMOLLM2_135M, device="cuda")  # doctest: +SKIP
    >>> session = DecodeSession(model, batch=1, max_len=512)  # doctest: +SKIP
    >>> tokens = session.generate(torch.randint(0, 49152, (1, 16)), new_tokens=32)  # doctest: +SKIP
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from l2lightning.capture import graph_capture
from l2lightning.decode_attention import (
    MAX_SPLITS,
    AttentionBackend,
    AttentionChoice,
    AttentionSpec,
    choose_attention,
    make_backend,
    unavailable_reason,
)
from l2lightning.prefetch import PrefetchPlan

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
    ) -> None:
        if not isinstance(model, LlamaDecoder):
            raise TypeError(f"`model` must be a LlamaDecoder (see build_decoder), got {type(model).__name__}")
        for name, value, low in (("batch", batch, 1), ("max_len", max_len, 2), ("warmup", warmup, 1)):
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"`{name}` must be an int >= {low}, got {value!r}")
        if attention not in ATTENTION_MODES:
            raise ValueError(f"`attention` must be one of {ATTENTION_MODES}, got {attention!r}")
        for name, value in (("compile_elementwise", compile_elementwise), ("graph", graph)):
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
        from l2lightning.hooks import PrefetchHooks

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
        self, model: LlamaDecoder, batch: int, max_len: int, *, graph: bool = True, warmup: int = 2
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
        )
