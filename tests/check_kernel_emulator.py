"""A CPU stand-in for kernels/replay_check.cu: it reads the launch's table of addresses the way the
kernels do, so l2lightning.guards.check_kernels' host side (items, chunks, dtype codes, how results are
combined) and replay_check's use of it run without a GPU. The kernels themselves are checked against
torch's path on the GPU (tests/gpu/test_check_kernels_gpu.py)."""

from __future__ import annotations

import ctypes
import math

import torch

_DTYPES = {1: torch.float32, 2: torch.float64, 3: torch.float16, 4: torch.bfloat16}


def _read(address: int, count: int, dtype: torch.dtype) -> list[float]:
    width = torch.empty((), dtype=dtype).element_size()
    raw = bytearray(ctypes.string_at(address, count * width))
    return torch.frombuffer(raw, dtype=dtype).double().tolist()


def _distance(x: float, y: float) -> float:
    if x == y or (math.isnan(x) and math.isnan(y)):
        return 0.0
    if math.isnan(x) or math.isnan(y):
        return math.inf
    return abs(x - y)


def launch(function: str, table: list[int], out: torch.Tensor, device: torch.device) -> None:
    """What one launch of `function` writes into `out`, computed on the host."""
    if function == "l2l_bytes_differ":
        for k in range(0, len(table), 3):
            a, b, n = table[k : k + 3]
            out[k // 3] = int(ctypes.string_at(a, n) != ctypes.string_at(b, n))
        return
    if function != "l2l_spread_measure":
        raise ValueError(f"no kernel {function!r} in replay_check.cu")
    for k in range(0, len(table), 5):
        r, a, e, n, code = table[k : k + 5]
        if code == 0:
            rb, ab, eb = (ctypes.string_at(p, n) for p in (r, a, e))
            out[k // 5] = torch.tensor([float(rb != eb or rb != ab), 0.0, 1.0], dtype=torch.float64)
            continue
        rs, as_, es = (_read(p, n, _DTYPES[code]) for p in (r, a, e))
        gap = max(_distance(x, y) for x, y in zip(rs, es))
        spread = max(_distance(x, y) for x, y in zip(rs, as_))
        scale = max((abs(x) for x in rs if math.isfinite(x)), default=0.0)
        out[k // 5] = torch.tensor([gap, spread, scale], dtype=torch.float64)


def install(monkeypatch) -> None:
    """check_kernels decides for CPU tensors through this stand-in (pytest's monkeypatch)."""
    from l2lightning.guards import check_kernels

    monkeypatch.setattr(check_kernels, "usable", lambda device: check_kernels.ENABLED)
    monkeypatch.setattr(check_kernels, "_launch", launch)
