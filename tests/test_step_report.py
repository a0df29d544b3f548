"""Step report pieces that need no GPU: kernels per phase from profiler ranges, the report itself."""

from __future__ import annotations

from types import SimpleNamespace

import torch
from torch import nn

from l2lightning.step_report import build_report, count_by_phase, prefetch_gains


def event(name: str, start: float, end: float | None = None) -> SimpleNamespace:
    return SimpleNamespace(
        name=name, time_range=SimpleNamespace(start=start, end=start if end is None else end)
    )


def test_launches_are_counted_by_the_phase_range_they_fall_in():
    events = [
        event("l2l::step", 0, 100),
        event("l2l::forward", 10, 30),
        event("l2l::backward", 40, 70),
        event("cudaLaunchKernel", 5),  # zero-grad: optimizer phase
        event("cudaLaunchKernel", 12),
        event("cudaLaunchKernel", 20),
        event("cudaMemsetAsync", 45),
        event("cuLaunchKernel", 60),
        event("cudaLaunchKernel", 90),
        event("cudaLaunchKernel", 150),  # after the step: not counted
        event("aten::mm", 21),  # not a launch
    ]
    assert count_by_phase(events) == {"forward": 2, "backward": 2, "optimizer": 2}
    assert count_by_phase([event("cudaLaunchKernel", 1)]) is None  # no step range: unknown


def test_report_names_the_bound_and_the_dominant_phase():
    model = nn.Linear(1024, 1024).to(torch.bfloat16)
    tuning = SimpleNamespace(
        rows=[SimpleNamespace(shape="Linear[1024x1024]", phase="forward", gain=0.031, chosen=True)]
    )
    report = build_report(
        model,
        {"forward": 100.0, "backward": 250.0, "optimizer": 50.0},
        {"forward": 40, "backward": 90, "optimizer": 12},
        copy_bw=4.0e12,
        empty_kernel_us=0.9,
        tuning=tuning,
        label="demo",
    )
    text = report.format()
    assert report.dominant_phase().name == "backward"
    assert report.kernel_count == 142
    assert report.bound() in ("launch", "bandwidth", "compute")
    assert "dominant phase: backward" in text and "+3.1%" in text
    assert prefetch_gains(tuning) == {"Linear[1024x1024] [forward]": 0.031}
    assert (
        build_report(model, {"forward": 1.0, "backward": 1.0, "optimizer": 1.0}, None, None, None).floors
        is None
    )
