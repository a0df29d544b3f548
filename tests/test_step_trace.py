"""The warm-up tracer: op signatures, host syncs, comparisons between steps, host constants."""

from __future__ import annotations

import pytest
import torch

from l2lightning.step_trace import (
    CaptureRefused,
    HostConstant,
    HostConstants,
    StepTrace,
    StepTracer,
    first_difference,
)


def trace(fn, device_type="cpu"):
    tracer = StepTracer(device_type)
    with tracer:
        fn()
    return tracer.trace


def test_a_python_number_that_changes_between_steps_is_the_first_difference():
    x = torch.ones(4)
    a = trace(lambda: x * 0.5 + 1)
    b = trace(lambda: x * 0.5 + 1)
    c = trace(lambda: x * 0.25 + 1)
    assert first_difference(a, b) is None
    difference = first_difference(a, c)
    assert (
        "op 0 was `mul.Tensor(" in difference and "0.5" in difference and "test_step_trace.py:" in difference
    )


def test_ops_of_hooks_that_run_after_each_replay_are_not_compared():
    a, b = StepTrace(), StepTrace()
    for t, value in ((a, 1.0), (b, 2.0)):
        t.ops += [("add.Tensor", (1,)), ("lift_fresh.default", (value,))]
        t.frames += [None, None]
        t.op_hooks += [None, "on_before_optimizer_step"]
    assert first_difference(a, b) is not None
    assert first_difference(a, b, skip_hooks={"on_before_optimizer_step"}) is None


def test_item_is_a_host_sync_named_with_the_users_line():
    x = torch.ones(3)
    t = trace(lambda: x.sum().item())
    assert len(t.syncs) == 1
    what, frame, hook = t.syncs[0]
    assert "`.item()`" in what and frame[0].endswith("test_step_trace.py") and hook is None


def test_a_sync_inside_a_capture_is_refused_before_it_runs():
    tracer = StepTracer("cpu", HostConstants([], torch.device("cpu")))
    with pytest.raises(CaptureRefused, match=r"`.item\(\)`.*test_step_trace.py:\d+"):
        with tracer:
            torch.ones(2).sum().item()


def test_host_constants_must_keep_their_bytes():
    same = [HostConstant("arg", torch.arange(3), None, ("f.py", 1))]
    other = [HostConstant("arg", torch.arange(1, 4), None, ("f.py", 1))]
    a, b, c = StepTrace(constants=same), StepTrace(constants=list(same)), StepTrace(constants=other)
    assert first_difference(a, b) is None
    assert "holds different values from step to step" in first_difference(a, c)
    constants = HostConstants(same, torch.device("cpu"))
    tracer = StepTracer("cuda", constants)
    assert torch.equal(tracer._next_constant(torch.arange(3), None), torch.arange(3))
    with pytest.raises(CaptureRefused, match="not in the traced warm-up steps"):
        tracer._next_constant(torch.arange(3), None)
    constants.used = 0
    with pytest.raises(CaptureRefused, match="changed since the warm-up steps"):
        tracer._next_constant(torch.arange(4, 7), ("f.py", 1))
