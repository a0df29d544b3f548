"""The check's own comparison kernels' host side (l2lightning.guards.check_kernels), through a CPU stand-in
of the kernels (tests/check_kernel_emulator.py): the same verdicts as torch's path, one launch per
device, items split and combined right."""

from __future__ import annotations

import math
import time

import pytest
import torch

from l2lightning.guards import check_kernels, replay_check
from tests import check_kernel_emulator


@pytest.fixture
def kernels(monkeypatch):
    """The kernel path on the CPU, chunks small enough that a test's tensors span several; the
    launches made, by kernel name."""
    check_kernel_emulator.install(monkeypatch)
    monkeypatch.setattr(check_kernels, "CHUNK_BYTES", 64)
    monkeypatch.setattr(check_kernels, "CHUNK_ELEMENTS", 8)
    launches: list[str] = []
    emulated = check_kernels._launch

    def counted(function, table, out, device):
        launches.append(function)
        return emulated(function, table, out, device)

    monkeypatch.setattr(check_kernels, "_launch", counted)
    return launches


def both_paths(fn, *args):
    """(fn on the kernel path, fn on torch's path)."""
    on_kernels = fn(*args)
    check_kernels.ENABLED = False
    try:
        return on_kernels, fn(*args)
    finally:
        check_kernels.ENABLED = True


def state(gen):
    return [
        torch.randn(300, generator=gen),  # 1200 bytes: 19 chunks of 64
        torch.randn(7, 5, generator=gen).to(torch.bfloat16),
        torch.randn(33, generator=gen).to(torch.float16),
        torch.randn(4, generator=gen, dtype=torch.float64),
        torch.randint(0, 9, (13,), generator=gen),
        torch.tensor([True, False, True]),
        torch.tensor(2.5),
        torch.empty(0),
    ]


def test_equal_state_is_one_launch_and_no_difference(kernels):
    tensors = state(torch.Generator().manual_seed(0))
    pairs = [(f"t{i}", t, t.clone()) for i, t in enumerate(tensors)]
    assert both_paths(replay_check.first_differing, pairs) == (None, None)
    assert kernels == ["l2l_bytes_differ"]


@pytest.mark.parametrize("where", [0, 1, 2, 3, 4, 5, 6])
def test_the_first_differing_tensor_is_found_as_torch_finds_it(kernels, where):
    tensors = state(torch.Generator().manual_seed(1))
    other = [t.clone() for t in tensors]
    # the last byte of the tensor: in the last chunk of a tensor that spans several
    other[where].reshape(-1).view(torch.uint8)[-1] ^= 1
    other[6].reshape(-1).view(torch.uint8)[0] ^= 1  # and a later one too: the first must be reported
    pairs = [(f"t{i}", a, b) for i, (a, b) in enumerate(zip(tensors, other))]
    assert both_paths(replay_check.first_differing, pairs) == (where, where)


def test_shapes_dtypes_and_none_are_decided_on_the_host(kernels):
    a = torch.ones(4)
    cases = [
        [("x", a, None)],
        [("x", None, None), ("y", a, a.reshape(2, 2))],
        [("x", a, a.double())],
    ]
    expected = [0, 1, 0]
    for pairs, want in zip(cases, expected):
        assert both_paths(replay_check.first_differing, pairs) == (want, want)
    assert kernels == []  # nothing to launch for


def test_a_tensor_the_kernels_cannot_read_leaves_the_call_to_torch(monkeypatch, kernels):
    monkeypatch.setattr(check_kernels, "usable", lambda device: False)
    a = torch.arange(6.0)
    b = a.clone()
    b[5] = -1
    assert replay_check.first_differing([("a", a, a.clone()), ("b", a, b)]) == 1
    assert kernels == []


def triples_with_rounding(gen):
    rows = []
    for dtype in (torch.float32, torch.bfloat16, torch.float16, torch.float64):
        r = torch.randn(40, generator=gen).to(dtype)
        again = (r.double() + torch.randn(40, generator=gen, dtype=torch.float64) * 1e-4).to(dtype)
        eager = (r.double() + torch.randn(40, generator=gen, dtype=torch.float64) * 1e-4).to(dtype)
        rows.append((f"{dtype}", r, again, eager))
    ints = torch.arange(10)
    rows.append(("ints", ints, ints.clone(), ints.clone()))
    return rows


def test_rounding_within_the_spread_passes_on_both_paths(kernels):
    rows = triples_with_rounding(torch.Generator().manual_seed(2))
    assert both_paths(replay_check.beyond_replay_spread, rows) == (None, None)
    assert kernels == ["l2l_spread_measure"]


@pytest.mark.parametrize("which", ["float", "int-eager", "int-again", "nan"])
def test_a_wrong_value_is_beyond_the_spread_on_both_paths(kernels, which):
    rows = triples_with_rounding(torch.Generator().manual_seed(3))
    label, r, again, eager = rows[0 if which in ("float", "nan") else 4]
    eager = eager.clone()
    again = again.clone()
    if which == "float":
        eager[-1] += 1.0  # far beyond two replays' rounding, in the last chunk
    elif which == "int-eager":
        eager[-1] += 1
    elif which == "int-again":
        again[0] += 1
    else:
        eager[3] = float("nan")  # a NaN against a number: an infinite difference
    rows[0 if which in ("float", "nan") else 4] = (label, r, again, eager)
    on_kernels, on_torch = both_paths(replay_check.beyond_replay_spread, rows)
    assert on_kernels is not None and on_torch is not None
    assert on_kernels.split(" (")[0] == on_torch.split(" (")[0] == label


def test_the_measures_are_exact_and_combine_over_chunks(kernels):
    r = torch.tensor([1.0, float("inf"), float("nan"), 3.0] * 5 + [-7.0])
    again = r.clone()
    again[-1] = -7.5
    eager = r.clone()
    eager[1] = float("inf")  # equal infinities: no difference
    eager[2] = float("nan")  # two NaNs: no difference
    eager[16] = 1.25
    ((gap, spread, scale),) = check_kernels.spread_measures([(r, again, eager)], r.device)
    assert (gap, spread, scale) == (0.25, 0.5, 7.0)
    assert len(kernels) == 1
    flags = check_kernels.spread_measures([(r, r, torch.where(r.isnan(), 0.0, r))], r.device)
    assert flags[0][0] == math.inf  # a NaN against a number


def test_the_kernels_decide_on_cuda_only_once_cupy_is_imported(monkeypatch):
    import sys
    import types

    from l2lightning import _env

    cuda = torch.device("cuda", 0)
    monkeypatch.delitem(sys.modules, "cupy", raising=False)
    monkeypatch.setattr(_env, "cupy_unavailable_reason", lambda: None)
    assert not check_kernels.usable(cuda)  # the check never imports CuPy itself
    monkeypatch.setitem(sys.modules, "cupy", types.ModuleType("cupy"))
    assert check_kernels.usable(cuda)
    assert not check_kernels.usable(torch.device("cpu"))
    monkeypatch.setattr(check_kernels, "ENABLED", False)
    assert not check_kernels.usable(cuda)


def test_measurable_dtypes():
    assert all(check_kernels.measurable(d) for d in (torch.float32, torch.bfloat16, torch.int64, torch.bool))
    assert not check_kernels.measurable(torch.float8_e4m3fn)
    assert not check_kernels.usable(torch.device("cpu"))  # the real one: CUDA only


# --------------------------------------------------------------------------- the check's kernels, compiled early
def test_the_check_kernels_compile_once_per_device_in_the_background(monkeypatch):
    from l2lightning import _env, _kernels

    compiled = []

    def compiles(source, name, index):
        time.sleep(0.1)  # NVRTC takes its time: the capture's wait below must wait for it
        compiled.append((source, name, index))

    monkeypatch.setattr(_kernels, "get_function", compiles)
    monkeypatch.setattr(_env, "cupy_unavailable_reason", lambda: None)
    monkeypatch.setattr(check_kernels, "_preparing", {})
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    assert check_kernels.prepare(torch.device("cpu"), import_cupy=True) is None
    monkeypatch.delitem(__import__("sys").modules, "cupy", raising=False)
    assert check_kernels.prepare(torch.device("cuda", 0)) is None  # CuPy not imported, not asked to
    thread = check_kernels.prepare(torch.device("cuda", 0), import_cupy=True)
    check_kernels.wait_prepared()  # what a capture calls first
    assert not thread.is_alive()
    assert compiled == [
        ("replay_check.cu", "l2l_bytes_differ", 0),
        ("replay_check.cu", "l2l_spread_measure", 0),
    ]
    assert check_kernels.prepare(torch.device("cuda", 0), import_cupy=True) is None  # once per device
    monkeypatch.setattr(check_kernels, "ENABLED", False)
    assert check_kernels.prepare(torch.device("cuda", 1), import_cupy=True) is None


def test_a_failed_background_compile_is_tried_again_by_the_next_fit(monkeypatch):
    from l2lightning import _env, _kernels

    def fails(source, name, index):
        raise RuntimeError("NVRTC failed")

    monkeypatch.setattr(_kernels, "get_function", fails)
    monkeypatch.setattr(_env, "cupy_unavailable_reason", lambda: None)
    monkeypatch.setattr(check_kernels, "_preparing", {})
    check_kernels.prepare(torch.device("cuda", 0), import_cupy=True).join(10)
    assert check_kernels._preparing == {}  # the check's own launch raises it on the training thread
