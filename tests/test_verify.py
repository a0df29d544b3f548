"""Bitwise verify reports: identical runs pass, a planted difference is named exactly."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from l2lightning.verify import EquivalenceError, assert_same_gradients, compare, compare_tensors, gradients


def grads_of(seed_offset: float = 0.0) -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 2))
    with torch.no_grad():
        model[2].weight.add_(seed_offset)
    model(torch.ones(3, 8)).sum().backward()
    return model


def test_identical_runs_are_bit_identical():
    report = assert_same_gradients(grads_of(), grads_of())
    assert report.ok and report.compared == 4


def test_planted_difference_names_first_tensor_count_and_max_diff():
    a, b = grads_of(), grads_of()
    with torch.no_grad():
        b[0].weight.grad[1, 2] += 0.5
        b[0].weight.grad[0, 0] += 0.25
    with pytest.raises(EquivalenceError) as info:
        assert_same_gradients(a, b)
    first = info.value.report.first_mismatch
    assert first.name == "0.weight"
    assert first.differing == 2 and first.total == 64
    assert first.max_abs_diff == pytest.approx(0.5, rel=1e-6)
    assert "0.weight: 2 of 64 elements differ" in str(info.value)


def test_one_ulp_and_signed_zero_and_nan_are_bits():
    x = torch.tensor([1.0, 0.0, float("nan")])
    y = x.clone()
    assert compare_tensors("x", x, y) is None  # NaN equals NaN bitwise
    y[1] = -0.0
    assert compare_tensors("x", x, y).differing == 1
    z = x.clone()
    z[0] = torch.nextafter(torch.tensor(1.0), torch.tensor(2.0))
    assert compare_tensors("x", x, z).differing == 1


def test_missing_grad_and_shape_mismatch_are_reported():
    assert "one side is None" in str(compare_tensors("g", None, torch.ones(1)))
    assert "shape/dtype" in str(compare_tensors("g", torch.ones(2), torch.ones(3)))
    report = compare({"a": torch.ones(1)}, {"b": torch.ones(1)}, "keys")
    assert not report.ok and "present on one side only" in str(report)


def test_bf16_compared_by_bits():
    a = torch.randn(100).bfloat16()
    b = a.clone()
    b[7] = -b[7]
    assert compare_tensors("w", a, b).differing == 1
    assert gradients(grads_of())["0.weight"].shape == (8, 8)
