"""The process-wide numerics settings a graph keeps from its capture, read and compared."""

import torch

from l2lightning.guards import numerics_settings


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


def test_the_per_backend_precision_api_is_read_where_torch_refuses_the_legacy_getters():
    """torch >= 2.9: once `fp32_precision` is set, `torch.get_float32_matmul_precision()` raises.
    Run in a fresh process: the state cannot be fully put back in this one."""
    import subprocess
    import sys

    code = """
import torch
from l2lightning.guards import numerics_settings as ns
if not hasattr(torch.backends.cuda.matmul, "fp32_precision"):
    print("no per-backend API"); raise SystemExit
before = ns.read()
torch.backends.cuda.matmul.fp32_precision = "tf32"
now = ns.read()
changes = ns.changes(before, now)
assert "torch.backends.cuda.matmul.fp32_precision: none -> tf32" in changes, changes
assert any(c.startswith("torch.set_float32_matmul_precision: highest -> unreadable") for c in changes), changes
assert ns.read() == now
print("ok")
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() in ("ok", "no per-backend API")


def test_the_kernel_library_choices_are_among_the_settings():
    """cuBLAS or cuBLASLt, cuSOLVER or MAGMA choose other kernels (set only on a CUDA build)."""
    assert {
        "torch.backends.cuda.preferred_blas_library",
        "torch.backends.cuda.preferred_linalg_library",
    } <= set(numerics_settings.NAMES)


def test_the_default_dtype_and_anomaly_detection_are_compared_too():
    before = numerics_settings.read()
    dtype = torch.get_default_dtype()
    try:
        torch.set_default_dtype(torch.float64)
        with torch.autograd.set_detect_anomaly(True):
            changed = numerics_settings.changes(before, numerics_settings.read())
    finally:
        torch.set_default_dtype(dtype)
    assert f"torch.set_default_dtype: {dtype} -> torch.float64" in changed
    assert "torch.autograd.set_detect_anomaly: False -> True" in changed
    assert numerics_settings.read() == before
