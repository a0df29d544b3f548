"""Decode attention: one new token per sequence appends its key/value to the KV cache and attends over it.

Implementations with one signature, ``f(q, k_new, v_new, k_cache, v_cache, cache_lens, *, scale=None,
splits=None, workspace=None, window=None) -> out``:

- :func:`decode_attention` (:mod:`~l2lightning.decode.kernel`): kernels/decode_attention.cu, append +
  split-K attention + merge in one launch (bf16/fp16, head dim 64 or 128, any grouped-query layout,
  CUDA graph safe).
- :func:`torch_decode_attention` (:mod:`~l2lightning.decode.torch_attention`): ``index_copy_`` append
  + ``F.scaled_dot_product_attention`` with the query heads of a group folded into the query length
  (GQA without copying K/V), masked to the cache length. Runs anywhere, CPU included.
- :func:`flashinfer_decode_attention` (:mod:`~l2lightning.decode.flashinfer_adapter`): FlashInfer's
  paged decode, the cache seen as one page per sequence (only where ``import flashinfer`` works).
- :func:`reference_decode_attention` (:mod:`~l2lightning.decode.numerics`): float64 math returning
  float32, for tests; it does not write the cache.

Shapes: ``q`` [B, H, D] (or [B, H, 1, D]), ``k_new``/``v_new`` [B, KVH, D] (or [B, KVH, 1, D]),
caches [B, KVH, max_len, D] (contiguous, written in place), ``cache_lens`` int32 [B] on the device:
tokens already cached. Each call writes the new key/value at position ``cache_lens[b]`` and attends
over ``cache_lens[b] + 1`` keys; it does not advance ``cache_lens`` (the caller does, once per step
for all layers). Because the length lives on the device, a CUDA graph replays at any length.

:func:`make_backend` (:mod:`~l2lightning.decode.backends`) binds an implementation to a layout and
length bucket for a decode step's graph; :func:`choose_attention` (:mod:`~l2lightning.decode.choice`)
times every available implementation inside CUDA graphs (CUDA-event medians, candidates interleaved)
for one layout and length bucket and returns an :class:`AttentionChoice`;
``python -m l2lightning.decode.attention --sanitize`` runs a few small launches for
``compute-sanitizer`` (:mod:`~l2lightning.decode.sanitize`).

This module gathers those names where callers import them from; it defines nothing itself.
"""

from __future__ import annotations

import sys

from l2lightning.decode.backends import (
    FLASHINFER_IMPLEMENTATIONS,
    IMPLEMENTATIONS,
    AttentionBackend,
    AttentionSpec,
    FlashInferBackend,
    FlashInferSingleBackend,
    KernelBackend,
    TorchBackend,
    implementation_of,
    make_backend,
    unavailable_reason,
)
from l2lightning.decode.checks import DecodeLayout
from l2lightning.decode.choice import AttentionChoice, candidate_specs, choose_attention
from l2lightning.decode.flashinfer_adapter import (
    FLASHINFER_DECODE_GROUP_SIZES,
    FLASHINFER_INSTALL_HINT,
    flashinfer_decode_attention,
    flashinfer_layout_reason,
    flashinfer_single_decode,
    flashinfer_unavailable_reason,
)
from l2lightning.decode.kernel import (
    HEAD_DIMS,
    KERNEL_DTYPES,
    KERNEL_FILE,
    KERNEL_NAME,
    LOG2E,
    MAX_HEADS_PER_BLOCK,
    MAX_SPLITS,
    MERGE_ROW_BUDGET,
    DecodeWorkspace,
    KernelConfig,
    KernelLaunch,
    decode_attention,
    default_heads_per_block,
    default_splits,
    load_decode_kernel,
    plan_launch,
)
from l2lightning.decode.numerics import reference_decode_attention
from l2lightning.decode.sanitize import main
from l2lightning.decode.torch_attention import torch_decode_attention

__all__ = [
    "FLASHINFER_DECODE_GROUP_SIZES",
    "FLASHINFER_IMPLEMENTATIONS",
    "FLASHINFER_INSTALL_HINT",
    "HEAD_DIMS",
    "IMPLEMENTATIONS",
    "KERNEL_DTYPES",
    "KERNEL_FILE",
    "KERNEL_NAME",
    "LOG2E",
    "MAX_HEADS_PER_BLOCK",
    "MAX_SPLITS",
    "MERGE_ROW_BUDGET",
    "AttentionBackend",
    "AttentionChoice",
    "AttentionSpec",
    "DecodeLayout",
    "DecodeWorkspace",
    "FlashInferBackend",
    "FlashInferSingleBackend",
    "KernelBackend",
    "KernelConfig",
    "KernelLaunch",
    "TorchBackend",
    "candidate_specs",
    "choose_attention",
    "decode_attention",
    "default_heads_per_block",
    "default_splits",
    "flashinfer_decode_attention",
    "flashinfer_layout_reason",
    "flashinfer_single_decode",
    "flashinfer_unavailable_reason",
    "implementation_of",
    "load_decode_kernel",
    "main",
    "make_backend",
    "plan_launch",
    "reference_decode_attention",
    "torch_decode_attention",
    "unavailable_reason",
]

if __name__ == "__main__":
    sys.exit(main())
