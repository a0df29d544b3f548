"""The process-wide settings that choose a step's kernels and their precision, read as one tuple.

A CUDA graph holds the kernels its capture launched: TF32 or full-precision matmuls, cuDNN or not,
deterministic algorithms or not, which attention backend, the default dtype of the tensors it made;
and it runs none of anomaly detection's host checks. An eager step reads these settings each
time it runs, so a callback or an epoch hook that changes one mid-fit
(``torch.set_float32_matmul_precision("high")`` from epoch 5, ``torch.use_deterministic_algorithms``)
changes the eager step's numbers while a replay would keep the capture's kernels. The callback reads
them at capture and before each replay, and captures again when one changed.

torch's per-backend precisions (``torch.backends.cuda.matmul.fp32_precision``, torch >= 2.9) read
"none" until a precision is first set; setting the one in effect again
(``torch.set_float32_matmul_precision("highest")`` in an epoch hook) makes them "ieee", which counts
as a change: one more capture, nothing wrong. Once they are set directly, torch refuses to read the
legacy settings (``torch.get_float32_matmul_precision()`` raises): those read as unreadable, and the
per-backend ones carry the state.

They are read through torch's C getters (the Python properties call the same ones, slower); what
that costs a step is in ``benchmarks/results/cpu-emulator/ab_host_path_replay_checks.json``. A getter
this torch does not have is left out.
"""

from __future__ import annotations

import functools
import operator
from collections.abc import Callable
from typing import Any

import torch

# (what a user sets, torch._C getter): the getters the Python-level settings call
_GETTERS: tuple[tuple[str, str], ...] = (
    ("torch.set_float32_matmul_precision", "_get_float32_matmul_precision"),
    ("torch.backends.cuda.matmul.allow_tf32", "_get_cublas_allow_tf32"),
    (
        "torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction",
        "_get_cublas_allow_fp16_reduced_precision_reduction",
    ),
    (
        "torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction",
        "_get_cublas_allow_bf16_reduced_precision_reduction",
    ),
    ("torch.backends.cuda.matmul.allow_fp16_accumulation", "_get_cublas_allow_fp16_accumulation"),
    ("torch.backends.cuda.preferred_blas_library", "_get_blas_preferred_backend"),
    ("torch.backends.cuda.preferred_linalg_library", "_get_linalg_preferred_backend"),
    ("torch.backends.cudnn.enabled", "_get_cudnn_enabled"),
    ("torch.backends.cudnn.allow_tf32", "_get_cudnn_allow_tf32"),
    ("torch.backends.cudnn.benchmark", "_get_cudnn_benchmark"),
    ("torch.backends.cudnn.deterministic", "_get_cudnn_deterministic"),
    ("torch.use_deterministic_algorithms", "_get_deterministic_algorithms"),
    (
        "torch.utils.deterministic.fill_uninitialized_memory",
        "_get_deterministic_fill_uninitialized_memory",
    ),
    ("torch.backends.cuda.enable_flash_sdp", "_get_flash_sdp_enabled"),
    ("torch.backends.cuda.enable_mem_efficient_sdp", "_get_mem_efficient_sdp_enabled"),
    ("torch.backends.cuda.enable_math_sdp", "_get_math_sdp_enabled"),
    ("torch.backends.cuda.enable_cudnn_sdp", "_get_cudnn_sdp_enabled"),
    ("torch.backends.cuda.allow_fp16_bf16_reduction_math_sdp", "_get_math_sdp_allow_fp16_bf16_reduction"),
    # the dtype of factory ops without one (`torch.zeros(n)` in the step): a graph keeps the capture's
    ("torch.set_default_dtype", "get_default_dtype"),
    # anomaly detection checks every backward output for NaN on the host, which a replay would skip
    ("torch.autograd.set_detect_anomaly", "is_anomaly_enabled"),
    ("torch.autograd.set_detect_anomaly(check_nan=)", "is_anomaly_check_nan_enabled"),
)
# the per-backend precision settings of torch >= 2.9 (`torch.backends.cuda.matmul.fp32_precision`, ...)
_FP32_PRECISION: tuple[tuple[str, str, str], ...] = (
    ("torch.backends.cuda.matmul.fp32_precision", "cuda", "matmul"),
    ("torch.backends.cudnn.conv.fp32_precision", "cuda", "conv"),
    ("torch.backends.cudnn.rnn.fp32_precision", "cuda", "rnn"),
)


def _available() -> tuple[tuple[str, ...], tuple[Callable[[], Any], ...]]:
    names: list[str] = []
    getters: list[Callable[[], Any]] = []
    for name, getter in _GETTERS:
        if hasattr(torch._C, getter):
            names.append(name)
            getters.append(getattr(torch._C, getter))
    precision = getattr(torch._C, "_get_fp32_precision_getter", None)
    for name, backend, op in _FP32_PRECISION if precision is not None else ():
        try:
            precision(backend, op)
        except RuntimeError:  # a backend or op this torch does not know
            continue
        names.append(name)
        getters.append(functools.partial(precision, backend, op))  # a C call, unlike a lambda
    return tuple(names), tuple(getters)


NAMES, _READERS = _available()
_call = getattr(operator, "call", None) or (lambda reader: reader())  # operator.call: Python >= 3.11


def read() -> tuple:
    """The settings now, in the order of :data:`NAMES`."""
    try:
        return tuple(map(_call, _READERS))  # no Python frame per getter (Python >= 3.11)
    except RuntimeError:
        return tuple(map(_read_one, _READERS))


def _read_one(reader: Callable[[], Any]) -> Any:
    """One setting, or the reason torch gives for not telling it: the legacy getters raise once the
    per-backend precisions were set (`torch.backends.cuda.matmul.fp32_precision = "tf32"`), and that
    state is then read through the per-backend getters."""
    try:
        return reader()
    except RuntimeError as exc:
        return f"unreadable: {str(exc)[:60]}"


def changes(before: tuple, now: tuple) -> list[str]:
    """``name: old -> new`` for each setting that differs between two :func:`read` results."""
    return [f"{name}: {a} -> {b}" for name, a, b in zip(NAMES, before, now) if a != b]
