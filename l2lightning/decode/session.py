"""DecodeSession: greedy decoding with each decode step replayed as one CUDA graph.

At batch 1 a decode step of a small model is hundreds of short kernels, and launching them one by
one from Python costs more than running them; a graph launches the whole step at once. The session
prefills eagerly, then captures one decode step (every layer, the LM head, greedy argmax, and
advancing the token and length buffers) into a single graph with static buffers. The cache length
lives on the device, so a graph serves every length of its length bucket; each bucket gets its own
graph, captured on first use, and with ``attention="auto"`` its own measured attention choice
(:func:`~l2lightning.decode.choice.choose_attention`). Next-layer weights are prefetched into L2 by
:class:`l2lightning.prefetch.hooks.PrefetchHooks` (forward only), recorded into the graph.
:class:`TorchDecodeSession` is the plain-PyTorch baseline: same model, compiled elementwise ops,
SDPA attention over the bucket's window, the whole step in one graph, no prefetch.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from typing import Any

import torch

from l2lightning.decode.backends import (
    AttentionBackend,
    AttentionSpec,
    backend_for_layout,
    unavailable_reason,
)
from l2lightning.decode.checks import DecodeLayout, check_int
from l2lightning.decode.choice import AttentionChoice, choose_attention
from l2lightning.decode.decoder import LlamaDecoder
from l2lightning.decode.elementwise import EAGER_FNS, compiled_fns
from l2lightning.decode.kernel import MAX_SPLITS
from l2lightning.decode.state import DecodeState, LayerRecorder
from l2lightning.graph.capture import graph_capture
from l2lightning.prefetch.plan import PrefetchPlan, check_plans_arg

ATTENTION_MODES = ("auto", "kernel", "torch", "flashinfer")


def length_bucket(n_keys: int, max_len: int) -> int:
    """The length bucket (attended keys) a step with `n_keys` keys runs in: multiples of 64 up to
    1024, of 128 beyond, capped at `max_len`. One graph per bucket."""
    granule = 64 if n_keys <= 1024 else 128
    return min(max_len, -(-n_keys // granule) * granule)


PrefetchArg = None | str | PrefetchPlan | Mapping[str, PrefetchPlan | None]


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
            :class:`PrefetchPlan` or a mapping of layer name to plan; ``None`` (or ``"off"``, the
            prefetch hooks' name for it) turns it off.
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
            check_int(name, value, low)
        if attention not in ATTENTION_MODES:
            raise ValueError(f"`attention` must be one of {ATTENTION_MODES}, got {attention!r}")
        for name, value in (
            ("compile_elementwise", compile_elementwise),
            ("graph", graph),
            ("record_layers", record_layers),
        ):
            if not isinstance(value, bool):
                raise TypeError(f"`{name}` must be a bool, got {type(value).__name__}")
        check_plans_arg("prefetch", prefetch)
        prefetch = None if prefetch == "off" else prefetch
        check_int("splits", splits, 1, MAX_SPLITS, or_none=True)
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
            c = model.config
            reason = unavailable_reason(
                attention, c.head_dim, self.dtype, self.device, heads=c.heads, kv_heads=c.kv_heads
            )
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
        backend = self._make_backend(spec, bucket)
        self.choices.setdefault(bucket, backend.label)
        self.backends[bucket] = backend
        return backend

    def _make_backend(self, spec: AttentionSpec, window: int) -> AttentionBackend:
        """`spec` bound to this session's layout and cache, sized for `window` attended keys."""
        c = self.config
        layout = DecodeLayout(self.batch, c.heads, c.kv_heads, c.head_dim, self.max_len)
        return backend_for_layout(spec, layout, window=window, dtype=self.dtype, device=self.device)

    # -------------------------------------------------------------- prefetch
    def _install_hooks(self) -> Any:
        from l2lightning.prefetch.hooks import PrefetchHooks

        if self.state.attention is None:  # the hooks' dry run needs some attention: SDPA over the whole cache
            self.state.attention = (
                self._backend(self.max_len)
                if self.attention == "torch"
                else self._make_backend(AttentionSpec("torch"), self.max_len)
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
