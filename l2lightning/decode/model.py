"""Decode step: a Llama-style decoder and DecodeSession, which runs each decode step as one CUDA graph.

The model (RMSNorm, rotary embeddings, grouped-query attention, SiLU-gated MLP, tied or separate LM
head) comes with the layouts of SmolLM2-135M and Qwen2.5-0.5B and random weights (nothing is
downloaded). Q/K/V and gate/up are fused Linears; parameter counts equal the real models'.

Each concept lives in its own module; this one gathers their names where callers import them
from, and defines nothing itself:

- :mod:`~l2lightning.decode.config`: :class:`DecoderConfig`, the two layouts, the bytes a step
  must move (:func:`decode_step_bytes`, :func:`decode_part_bytes`).
- :mod:`~l2lightning.decode.elementwise`: RMSNorm, rotary, SiLU-gate math, eager or compiled.
- :mod:`~l2lightning.decode.decoder`: :class:`LlamaDecoder` and :func:`build_decoder`.
- :mod:`~l2lightning.decode.state`: :class:`DecodeState` (KV cache, rotary tables) and
  :class:`LayerRecorder`.
- :mod:`~l2lightning.decode.session`: :class:`DecodeSession` (one CUDA graph per cache-length
  bucket, measured attention choice, L2 prefetch recorded into the graph) and the plain-PyTorch
  baseline :class:`TorchDecodeSession`.
- :mod:`~l2lightning.decode.numerics` and :mod:`~l2lightning.decode.reference`: the relative error,
  :class:`Fp32Reference` and :func:`compare_with_reference` (numerics against an FP32 copy).
- :mod:`~l2lightning.decode.kernel_attribution` and :mod:`~l2lightning.decode.step_report`:
  :func:`decode_step_report`, where a captured step's time goes.

Example:
    >>> model = build_decoder(SMOLLM2_135M, device="cuda")  # doctest: +SKIP
    >>> session = DecodeSession(model, batch=1, max_len=512)  # doctest: +SKIP
    >>> tokens = session.generate(torch.randint(0, 49152, (1, 16)), new_tokens=32)  # doctest: +SKIP
"""

from __future__ import annotations

from l2lightning.decode.config import (
    CONFIGS,
    QWEN25_05B,
    SMOLLM2_135M,
    DecoderConfig,
    decode_part_bytes,
    decode_step_bytes,
    get_config,
)
from l2lightning.decode.decoder import DecoderLayer, LlamaDecoder, RMSNorm, build_decoder
from l2lightning.decode.elementwise import (
    EAGER_FNS,
    ElementwiseFns,
    add_rms_norm,
    apply_rotary,
    compiled_fns,
    qkv_rope,
    rms_norm,
    rope_tables,
    silu_mul,
)
from l2lightning.decode.kernel_attribution import (
    RANGE_PREFIX,
    ROLE_GROUPS,
    ProfEvent,
    attribute_kernels,
    prof_events,
    profile_ranges,
)
from l2lightning.decode.numerics import relative_error
from l2lightning.decode.reference import (
    Fp32Reference,
    compare_with_reference,
    full_precision,
    recorded_attention_reference,
    upcast_decoder,
)
from l2lightning.decode.session import (
    ATTENTION_MODES,
    DecodeSession,
    PrefetchArg,
    TorchDecodeSession,
    length_bucket,
)
from l2lightning.decode.state import DecodeState, LayerRecorder
from l2lightning.decode.step_report import decode_step_report, step_report_from_kernels

__all__ = [
    "ATTENTION_MODES",
    "CONFIGS",
    "EAGER_FNS",
    "QWEN25_05B",
    "RANGE_PREFIX",
    "ROLE_GROUPS",
    "SMOLLM2_135M",
    "DecodeSession",
    "DecodeState",
    "DecoderConfig",
    "DecoderLayer",
    "ElementwiseFns",
    "Fp32Reference",
    "LayerRecorder",
    "LlamaDecoder",
    "PrefetchArg",
    "ProfEvent",
    "RMSNorm",
    "TorchDecodeSession",
    "add_rms_norm",
    "apply_rotary",
    "attribute_kernels",
    "build_decoder",
    "compare_with_reference",
    "compiled_fns",
    "decode_part_bytes",
    "decode_step_bytes",
    "decode_step_report",
    "full_precision",
    "get_config",
    "length_bucket",
    "prof_events",
    "profile_ranges",
    "qkv_rope",
    "recorded_attention_reference",
    "relative_error",
    "rms_norm",
    "rope_tables",
    "silu_mul",
    "step_report_from_kernels",
    "upcast_decoder",
]
