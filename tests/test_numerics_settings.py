"""The process-wide numerics settings a graph keeps from its capture, read and compared."""

import torch

from l2lightning import numerics_settings


def test_each_setting_has_a_name_and_a_reader_and_reading_twice_is_equal():
    now = numerics_settings.read()
    assert len(now) == len(numerics_settings.NAMES) >= 10
    assert numerics_settings.read() == now
    assert numerics_settings.changes(now, now) == []


def test_a_changed_setting_is_named_with_its_old_and_new_value():
    before = numerics_settings.read()
    precision = torch.get_float32_matmul_precision()
    deterministic = torch.are_deterministic_algorithms_enabled()
    other = "medium" if precision != "medium" else "highest"
    try:
        torch.set_float32_matmul_precision(other)
        torch.use_deterministic_algorithms(not deterministic)
        changed = numerics_settings.changes(before, numerics_settings.read())
    finally:
        torch.set_float32_matmul_precision(precision)
        torch.use_deterministic_algorithms(deterministic)
    assert f"torch.set_float32_matmul_precision: {precision} -> {other}" in changed
    assert f"torch.use_deterministic_algorithms: {deterministic} -> {not deterministic}" in changed
    # put back, each differs from `before` at most in torch's per-backend precisions, which read "none"
    # until a precision is first set ("ieee" after setting "highest" again): one more capture at most
    after = numerics_settings.changes(before, numerics_settings.read())
    assert all(".fp32_precision: none -> " in change for change in after), after
