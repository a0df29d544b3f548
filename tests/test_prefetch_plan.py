"""PrefetchPlan validation, default plans by bytes, kernel source discovery, GPU-only errors."""

from __future__ import annotations

import subprocess
import sys

import pytest

from l2lightning._resources import kernel_source, kernels_dir
from l2lightning.prefetch.kernels import prefetch
from l2lightning.prefetch.plan import MIB, PrefetchPlan, default_plan


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("kind", "magic", "`kind` must be one of"),
        ("blocks", 0, r"`blocks` must be in \[1, 1024\]"),
        ("blocks", 2.0, "`blocks` must be an int"),
        ("threads", 48, "`threads` must be a multiple of 32"),
        ("stride", 100, "`stride` must be a power of two"),
        ("chunk", 1000, "`chunk` must be a multiple of 16"),
        ("distance", 9, r"`distance` must be in \[1, 8\]"),
    ],
)
def test_bad_plan_fields_are_named(field, value, message):
    with pytest.raises((ValueError, TypeError), match=message):
        PrefetchPlan(**{field: value})


def test_plan_is_frozen_and_round_trips():
    plan = PrefetchPlan(kind="bulk_last", blocks=16, distance=2)
    with pytest.raises(AttributeError):
        plan.blocks = 3
    assert PrefetchPlan.from_dict(plan.to_dict()) == plan
    assert plan.label == "bulk_last16@d2"
    with pytest.raises(ValueError, match="unknown PrefetchPlan fields"):
        PrefetchPlan.from_dict({"blocks": 2, "speed": 9})


def test_default_plan_grows_with_layer_bytes_and_respects_l2():
    assert default_plan(100 * 1024) is None
    assert default_plan(1 * MIB).blocks == 4
    assert default_plan(int(4.5 * MIB)).blocks == 8
    assert default_plan(20 * MIB).blocks == 16
    assert default_plan(32 * MIB, l2_bytes=60 * MIB) is None  # current + next do not fit together


def test_kernel_source_found_in_checkout():
    assert kernels_dir().name == "kernels"
    src = kernel_source("l2_prefetch.cu")
    for name in ("l2_prefetch_hint", "l2_prefetch_hint_last", "l2_prefetch_bulk", "l2_prefetch_bulk_last"):
        assert f"void {name}(" in src
    # the kernels never store: no st.global / assignments through the pointer
    assert "st.global" not in src and "base[" not in src


def test_prefetch_without_cuda_raises_with_reason():
    import torch

    with pytest.raises(RuntimeError, match="needs a CUDA GPU"):
        prefetch(torch.zeros(4), PrefetchPlan())


def test_import_touches_neither_cuda_nor_cupy():
    code = "import sys, l2lightning; import l2lightning.prefetch.install, l2lightning.graph.capture; print('cupy' in sys.modules, __import__('torch').cuda.is_initialized())"
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout.split()
    assert out == ["False", "False"]
