"""The sampled replay check's comparisons on a CUDA device, every tensor of a check in one launch.

A fit usually makes one or two checks (the rest keep to ``check_share``), so what a check costs is
mostly the first use of its kernels in the process: on the H200 torch's byte comparison and
reduction took 36-45 ms the first time and 1-5 ms after, the multi-tensor subtractions and norms of
the spread judgment 21-33 ms and 2-5 ms (``benchmarks/results/h200/check_first_use.json``), for
work of well under a millisecond. ``kernels/replay_check.cu`` does both jobs with two kernels of
one module: each tensor is split into items of a table, one block per item writes one result, and
the host reads all of them with one copy.

Used by :mod:`l2lightning.guards.replay_check` for CUDA tensors once CuPy (the prefetch kernels'
dependency) is imported (:func:`usable`); elsewhere, and for host tensors, that module's torch path
decides, with the same verdicts. The kernels only read the tensors.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Sequence

import torch

# Set False to decide with torch's kernels even where these could run (the first-use probe's A/B).
ENABLED = True
SOURCE = "replay_check.cu"
THREADS = 256  # a multiple of 32, at most 1024 (the kernels' block reduction)
CHUNK_BYTES = 1 << 20  # bytes of one pair per block: a large tensor spreads over many blocks
CHUNK_ELEMENTS = 1 << 16  # elements of one triple per block in the spread measure

# the kernels' dtype codes; another float dtype (float8, complex before its real view) is left to torch
_FLOAT_CODES = {torch.float32: 1, torch.float64: 2, torch.float16: 3, torch.bfloat16: 4}
BYTES_CODE = 0


def usable(device: torch.device) -> bool:
    """Whether the kernels decide for tensors on `device`: CUDA, CuPy imported already, and not
    switched off.

    The check never imports CuPy itself: on the H200 its import took 107-123 ms
    (``check_first_use.json``), more than torch's kernels' first use costs. A fit with prefetch on
    (``prefetch="auto"``, the default) has imported it at set-up; a fit with prefetch off decides
    with torch's kernels unless something else imported it.
    """
    if not ENABLED or device.type != "cuda" or "cupy" not in sys.modules:
        return False
    from l2lightning._env import cupy_unavailable_reason

    return cupy_unavailable_reason() is None


# the devices whose kernels prepare() has started to compile, and the threads doing it
_preparing: dict[int, threading.Thread] = {}


def prepare(device: torch.device, import_cupy: bool = False) -> threading.Thread | None:
    """Compile and load the kernels for `device` in a background thread, once per process; return
    the thread (None where nothing was started: not CUDA, switched off, CuPy not imported and not
    `import_cupy`, or started before).

    On a machine whose CuPy kernel cache is empty, NVRTC's compile is most of what the check costs: on
    the H200 the first check of a 1000-step MLP-stack fit took 204.6 ms against 18.9 ms with the cache
    filled (``benchmarks/results/h200/replay_check_kernel_cache_cold.csv``, ``_warm.csv``). Started at
    the training start, the compile runs beside the warm-up steps, the prefetch tuning and the capture
    (NVRTC runs without Python's lock); a check that comes first waits for it in :func:`_launch`'s
    ``get_function``, as it would have compiled itself, and a capture waits for it first
    (:func:`wait_prepared`). `import_cupy`: import CuPy in that thread first
    (a fit with prefetch on imports it for its kernels anyway, later, on the training thread).
    """
    if not ENABLED or device.type != "cuda" or not (import_cupy or "cupy" in sys.modules):
        return None
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index in _preparing:
        return None
    from l2lightning._env import cupy_unavailable_reason
    from l2lightning._kernels import get_function

    def compile_both() -> None:
        try:
            if cupy_unavailable_reason() is None:  # (imports it)
                for function in ("l2l_bytes_differ", "l2l_spread_measure"):
                    get_function(SOURCE, function, index)
        except Exception:  # the check's own launch raises it again, on the training thread
            _preparing.pop(index, None)

    thread = threading.Thread(target=compile_both, name="l2l-check-kernels", daemon=True)
    _preparing[index] = thread
    thread.start()
    return thread


def wait_prepared() -> None:
    """Wait for the compiles :func:`prepare` started, if any are still running. Called before a capture:
    loading a compiled module is one of the calls a CUDA graph capture in global mode (torch's default)
    does not allow from any thread while it records."""
    for thread in list(_preparing.values()):
        thread.join()


def measurable(dtype: torch.dtype) -> bool:
    """Whether :func:`spread_measures` reads `dtype` (every integer and bool dtype as bytes)."""
    return dtype in _FLOAT_CODES or not (dtype.is_floating_point or dtype.is_complex)


def bytes_differ(pairs: Sequence[tuple[torch.Tensor, torch.Tensor]], device: torch.device) -> list[bool]:
    """Per pair of flat uint8 tensors of equal length on `device`: whether any byte differs."""
    table: list[int] = []
    owners: list[int] = []  # the pair of each item
    for i, (a, b) in enumerate(pairs):
        a_ptr, b_ptr, n = a.data_ptr(), b.data_ptr(), a.numel()
        for start in range(0, n, CHUNK_BYTES):  # chunk starts are multiples of 16: alignment kept
            table += [a_ptr + start, b_ptr + start, min(CHUNK_BYTES, n - start)]
            owners.append(i)
    flags = [False] * len(pairs)
    if not owners:
        return flags
    out = torch.empty(len(owners), dtype=torch.int32, device=device)
    _launch("l2l_bytes_differ", table, out, device)
    for i, flag in zip(owners, out.cpu().tolist()):
        flags[i] = flags[i] or bool(flag)
    return flags


def spread_measures(
    triples: Sequence[tuple[torch.Tensor, torch.Tensor, torch.Tensor]], device: torch.device
) -> list[list[float]]:
    """Per (replay, again, eager) of one shape and dtype on `device`: [the largest |replay - eager|,
    the largest |replay - again|, the replay's largest finite magnitude] as exact doubles; for an
    integer or bool dtype [1.0 if any of the three differ else 0.0, 0.0, 1.0].

    Equal infinities and two NaNs are no difference, a NaN against a number an infinite one (as
    ``replay_check._largest_difference``). The tensors must satisfy :func:`measurable`.
    """
    table: list[int] = []
    owners: list[int] = []
    kept: list[torch.Tensor] = []  # contiguous copies the launch reads: alive until its results are read
    results: list[list[float]] = []
    for i, (replay, again, eager) in enumerate(triples):
        code = _FLOAT_CODES.get(replay.dtype, BYTES_CODE)
        views = [t.detach().contiguous() for t in (replay, again, eager)]
        if code == BYTES_CODE:
            views = [v.reshape(-1).view(torch.uint8) for v in views]
        kept += views
        results.append([0.0, 0.0, 1.0 if code == BYTES_CODE else 0.0])
        count, width = views[0].numel(), views[0].element_size()
        chunk = CHUNK_ELEMENTS * (8 if code == BYTES_CODE else 1)
        for start in range(0, count, chunk):
            table += [v.data_ptr() + start * width for v in views]
            table += [min(chunk, count - start), code]
            owners.append(i)
    if not owners:
        return results
    out = torch.empty(len(owners), 3, dtype=torch.float64, device=device)
    _launch("l2l_spread_measure", table, out, device)
    for i, (gap, spread, scale) in zip(owners, out.cpu().tolist()):
        row = results[i]
        row[0], row[1], row[2] = max(row[0], gap), max(row[1], spread), max(row[2], scale)
    del kept
    return results


def _launch(function: str, table: list[int], out: torch.Tensor, device: torch.device) -> None:
    """Launch `function` with one block per item of `table` on torch's current stream of `device`."""
    import numpy as np

    from l2lightning._kernels import get_function, launch

    index = device.index if device.index is not None else torch.cuda.current_device()
    # pageable to device: the copy is done (its host side) before the call returns, and the launch
    # after it on the same stream reads the table it wrote
    items = torch.tensor(table, dtype=torch.int64).to(device)
    kernel = get_function(SOURCE, function, index)
    blocks = out.shape[0]
    launch(kernel, blocks, THREADS, (np.uint64(items.data_ptr()), np.uint64(out.data_ptr())), index)
