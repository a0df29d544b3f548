"""CPU (graph emulator): an out-of-memory error in a traced warm-up step's backward reaches the fit as
``torch.OutOfMemoryError``, as in a plain fit.

On CUDA, autograd runs backward on a device thread; an out-of-memory error an op raised there under
the step tracer (a ``TorchDispatchMode``) reached the fit as ``SystemError: <built-in method
run_backward ...> returned NULL without setting an exception`` (torch 2.11 on an H100,
``benchmarks/results/h100/pytest_gpu_operands_manual_oom_check_rng.log``). On the CPU backward runs on
the calling thread and the error arrives whole, so the tests below make the loss happen: the step's
backward turns the error it sees into that SystemError, after the tracer has seen the op fail."""

from __future__ import annotations

import pytest
import torch

from l2lightning.guards.step_trace import StepTracer
from tests.lightning_models import TinyMLP
from tests.replay_helpers import assert_same, callback, fit

pytestmark = pytest.mark.usefixtures("emulated_cuda_graphs")

LOST = (
    "<built-in method run_backward of torch._C._EngineBase object> returned NULL without setting an exception"
)


class _ScaleGrad(torch.autograd.Function):
    """Identity forward; its backward scales the gradient, losing an out-of-memory error as CUDA's
    device thread does when `lose` is set."""

    lose = False
    failing = False  # inside the backward's op: the patched tracer fails it

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        _ScaleGrad.failing = True
        try:
            return grad.mul(1.0)
        except torch.OutOfMemoryError:
            if _ScaleGrad.lose:
                raise SystemError(LOST) from None
            raise
        finally:
            _ScaleGrad.failing = False


class ScaledGrad(TinyMLP):
    def training_step(self, batch, batch_idx):
        x, y = batch
        return (self.head(self.net(_ScaleGrad.apply(x.requires_grad_()))).squeeze(-1) - y).square().mean()


def _fail_backward_op(monkeypatch, in_capture: bool) -> None:
    """The backward op runs out of memory under the tracer (plain steps are whole): in the warm-up's
    traced steps, or (`in_capture`) in the capture only."""
    dispatch = StepTracer._dispatch

    def out_of_memory_in_backward(self, func, args, kwargs):
        capturing = self.constants is not None
        if _ScaleGrad.failing and func is torch.ops.aten.mul.Tensor and capturing == in_capture:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (simulated)")
        return dispatch(self, func, args, kwargs)

    monkeypatch.setattr(StepTracer, "_dispatch", out_of_memory_in_backward)
    monkeypatch.setattr(_ScaleGrad, "lose", True)


@pytest.fixture
def failing_backward_op(monkeypatch):
    _fail_backward_op(monkeypatch, in_capture=False)


@pytest.mark.usefixtures("failing_backward_op")
def test_an_out_of_memory_error_lost_in_backward_reaches_the_fit_as_itself():
    with pytest.raises(torch.OutOfMemoryError, match=r"Tried to allocate 2.00 GiB \(simulated\)") as caught:
        fit(ScaledGrad, [callback()], steps=4)
    # the SystemError it stood behind stays on record
    assert isinstance(caught.value.__cause__, SystemError) and LOST in str(caught.value.__cause__)


def test_an_out_of_memory_error_lost_in_the_captures_backward_is_named_and_the_fit_trains_like_plain(
    monkeypatch,
):
    """In the capture (its step runs under the tracer too, through the same `WarmupSteps.run_traced`), running out
    of memory is caught: the fit trains eagerly, the warning naming the out-of-memory error, not the
    SystemError (which read as a step that cannot be captured)."""
    plain = fit(ScaledGrad, steps=12, fused=True)
    _fail_backward_op(monkeypatch, in_capture=True)
    cb = callback()
    with pytest.warns(
        UserWarning, match=r"could not be captured: out of memory \(.*Tried to allocate 2.00 GiB"
    ):
        run = fit(ScaledGrad, [cb], steps=12, fused=True)
    assert not cb.summary()["captured"]
    assert_same(plain, run)


def test_a_system_error_without_an_out_of_memory_error_stays_as_it_is(monkeypatch):
    """The translation needs the tracer to have seen an op run out of memory: another SystemError is
    the step's own and passes through unchanged."""

    def broken(ctx, grad):
        raise SystemError("a SystemError of the step's own")

    monkeypatch.setattr(_ScaleGrad, "backward", staticmethod(broken))
    with pytest.raises(SystemError, match="a SystemError of the step's own"):
        fit(ScaledGrad, [callback()], steps=4)
