"""GPU: the check's own comparison kernels (kernels/replay_check.cu) decide as torch's path does.

Every case is decided twice, by the kernels and with them switched off (torch's kernels), on tensors
that span many items, sit at odd addresses, and hold NaNs, infinities, bf16, fp16, integers and bools.
"""

from __future__ import annotations

import math

import pytest
import torch

from l2lightning.guards import check_kernels, replay_check
from tests.guards.test_check_kernels_cpu import both_paths as kernel_and_torch_paths

pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True)
def cupy_imported():
    # the check uses its kernels once CuPy is imported (as a fit with prefetch on has it)
    pytest.importorskip("cupy", reason="the check's kernels need CuPy")


def both_paths(fn, *args):
    assert check_kernels.usable(torch.device("cuda")), "the kernel path must run on this GPU"
    return kernel_and_torch_paths(fn, *args)


def state():
    gen = torch.Generator(device="cuda").manual_seed(0)
    big = torch.randn(3 * check_kernels.CHUNK_BYTES // 4 + 5, device="cuda", generator=gen)  # 4 items
    odd = torch.randint(0, 255, (1001,), device="cuda", dtype=torch.uint8, generator=gen)[3:]  # misaligned
    return [
        big,
        odd,
        torch.randn(129, 65, device="cuda", generator=gen).to(torch.bfloat16),
        torch.randn(77, device="cuda", generator=gen).half(),
        torch.randn(9, device="cuda", generator=gen, dtype=torch.float64),
        torch.randint(0, 9, (13,), device="cuda", generator=gen),
        torch.rand(5, device="cuda", generator=gen) > 0.5,
        torch.tensor(2.5, device="cuda"),
        torch.randn(40, 6, device="cuda", generator=gen).t(),  # not contiguous
    ]


def test_equal_states_and_each_single_flipped_byte_decide_as_torch_does():
    tensors = state()
    same = [(f"t{i}", t, t.clone()) for i, t in enumerate(tensors)]
    assert both_paths(replay_check.first_differing, same) == (None, None)
    for where in range(len(tensors)):
        for byte in (0, -1):
            other = [t.clone() for t in tensors]
            flipped = other[where].contiguous().clone()  # reshape(-1) of a strided tensor is a copy
            flipped.reshape(-1).view(torch.uint8)[byte] ^= 1
            other[where].copy_(flipped)
            pairs = [(f"t{i}", a, b) for i, (a, b) in enumerate(zip(tensors, other))]
            assert both_paths(replay_check.first_differing, pairs) == (where, where), (where, byte)


def test_the_spread_measures_are_exact_where_the_values_are_special():
    # 180 001 values over three items of the spread kernel: 1, inf, NaN, 3, -inf, 0 repeated, then -7
    r = torch.tensor([1.0, math.inf, math.nan, 3.0, -math.inf, 0.0] * 30000 + [-7.0], device="cuda")
    again, eager = r.clone(), r.clone()
    again[-1] = -7.5  # the spread: 0.5
    eager[6 * 20000] = 1.25  # the gap: 0.25 (equal infinities and two NaNs elsewhere are no difference)
    ((gap, spread, scale),) = replay_check._measured_differences([("r", r, again, eager, 1e-7)])
    assert (gap, spread, scale) == (0.25, 0.5, 7.0)
    assert gap == float(replay_check._largest_difference(r.double(), eager.double()))
    eager[3] = math.nan  # a NaN against a number: an infinite difference
    ((gap, _, _),) = replay_check._measured_differences([("r", r, again, eager, 1e-7)])
    assert gap == math.inf


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_rounding_passes_and_a_wrong_value_does_not_on_both_paths(dtype):
    gen = torch.Generator(device="cuda").manual_seed(1)
    r = torch.randn(70000, device="cuda", generator=gen).to(dtype)
    noise = torch.finfo(dtype).eps / 4  # a rounding or none: well within ROUNDING_SPREAD of the values
    again = (
        r.double() * (1 + noise * torch.randn(70000, device="cuda", generator=gen, dtype=torch.float64))
    ).to(dtype)
    eager = (
        r.double() * (1 + noise * torch.randn(70000, device="cuda", generator=gen, dtype=torch.float64))
    ).to(dtype)
    ints = torch.arange(10, device="cuda")
    rows = [("x", r, again, eager), ("ints", ints, ints.clone(), ints.clone())]
    assert both_paths(replay_check.beyond_replay_spread, rows) == (None, None)
    wrong = eager.clone()
    wrong[-1] += 1.0
    on_kernels, on_torch = both_paths(replay_check.beyond_replay_spread, [("x", r, again, wrong)])
    assert on_kernels is not None and on_torch is not None and on_kernels.startswith("x (")
    wrong_ints = ints.clone()
    wrong_ints[3] = -1
    on_kernels, on_torch = both_paths(
        replay_check.beyond_replay_spread, [("ints", ints, ints.clone(), wrong_ints)]
    )
    assert on_kernels is not None and on_torch is not None
