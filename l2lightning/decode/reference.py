"""Decode numerics against a full-precision copy of the model.

A bf16 decode step cannot match FP32 exactly, so "correct" here means: no further from the FP32
model than the plain-PyTorch baseline is. :class:`Fp32Reference` is the same model with its weights
upcast (exactly: every bf16 value is an fp32 value), run eagerly in full precision on the same
cache and token as the session under test; :func:`compare_with_reference` measures sessions against
it over several random caches (one draw alone is noisy), for the logits and, where sessions record
their layers, for each layer's attention output and attention operation alone.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator, Mapping
from typing import Any

import torch

from l2lightning.decode.checks import check_int
from l2lightning.decode.decoder import LlamaDecoder
from l2lightning.decode.numerics import reference_decode_attention, relative_error
from l2lightning.decode.session import DecodeSession
from l2lightning.decode.state import LayerRecorder


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
        recorder = self.session.recorder
        if recorder is None:  # the reference session is made with record_layers=True
            raise RuntimeError("Fp32Reference: its session records no layers")
        return recorder

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
        check_int("cached", cached, 0, k_cache.shape[3])
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
    check_int("samples", samples, 1)
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
