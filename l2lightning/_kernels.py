"""Compiles the CUDA sources in kernels/ with CuPy (NVRTC) once per (device, source) and launches them.

Launches go to torch's *current* stream through a CuPy external-stream wrapper, so a kernel issued
inside `torch.cuda.graph(...)` (on the capture stream or on a stream forked from it) is recorded
into the graph. Compile before capturing: NVRTC and module loading must not run inside a capture.
"""

from __future__ import annotations

import functools
import hashlib
import threading
from typing import Any

from l2lightning._env import CUPY_INSTALL_HINT, cuda_unavailable_reason, cupy_unavailable_reason
from l2lightning._resources import kernel_source


class KernelCompileError(RuntimeError):
    """NVRTC rejected a kernel source; the message carries the compiler log."""


def require_gpu_kernels(what: str) -> None:
    """Raise a clear RuntimeError when `what` cannot run here (no CUDA or no CuPy)."""
    reason = cuda_unavailable_reason()
    if reason:
        raise RuntimeError(f"{what} needs a CUDA GPU: {reason}")
    reason = cupy_unavailable_reason()
    if reason:
        raise RuntimeError(f"{what} needs CuPy to compile its kernels: {reason}")


def source_digest(name: str) -> str:
    """Short SHA-256 of a kernel source, part of the autotuner's cache key."""
    return hashlib.sha256(kernel_source(name).encode()).hexdigest()[:16]


_lock = threading.Lock()
# one lock per (source, device, defines): a source compiling in the background (the replay check's,
# l2lightning.guards.check_kernels.prepare) does not hold up another's compile on the training thread
_module_locks: dict[tuple[str, int, tuple[str, ...]], threading.Lock] = {}


@functools.cache
def _module(name: str, device_index: int, defines: tuple[str, ...]) -> Any:
    import cupy

    options = ("--std=c++17",) + tuple(f"-D{d}" for d in defines)
    with cupy.cuda.Device(device_index):
        module = cupy.RawModule(code=kernel_source(name), options=options)
        try:
            module.compile()
        except cupy.cuda.compiler.CompileException as exc:
            raise KernelCompileError(f"NVRTC failed to compile kernels/{name}:\n{exc.get_message()}") from exc
    return module


def get_function(name: str, function: str, device_index: int, defines: tuple[str, ...] = ()) -> Any:
    """The compiled `function` from kernels/`name` on device `device_index` (compiled once, then cached)."""
    if cupy_unavailable_reason():
        raise RuntimeError(f"compiling kernels/{name} needs CuPy; {CUPY_INSTALL_HINT}")
    key = (name, device_index, tuple(sorted(defines)))
    with _lock:
        module_lock = _module_locks.setdefault(key, threading.Lock())
    with module_lock:
        module = _module(*key)
        with _device(device_index):
            return module.get_function(function)


def _device(index: int) -> Any:
    import cupy

    return cupy.cuda.Device(index)


@functools.lru_cache(maxsize=64)
def _external_stream(ptr: int, device_index: int) -> Any:
    import warnings

    import cupy

    with cupy.cuda.Device(device_index), warnings.catch_warnings():
        # CuPy 14 deprecates ExternalStream for Stream.from_external, which takes an object with
        # __cuda_stream__ rather than a raw pointer; the pointer form is what torch gives us.
        warnings.simplefilter("ignore", DeprecationWarning)
        warnings.simplefilter("ignore", FutureWarning)
        return cupy.cuda.ExternalStream(ptr, device_index)


def launch(kernel: Any, grid: int, block: int, args: tuple, device_index: int) -> None:
    """Launch `kernel` on torch's current CUDA stream of `device_index`."""
    import torch

    stream = torch.cuda.current_stream(device_index)
    with _device(device_index), _external_stream(stream.cuda_stream, device_index):
        kernel((grid,), (block,), args)
