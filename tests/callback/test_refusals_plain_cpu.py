"""A fit the callback refuses, at whichever warm-up step or at the capture, is plain Lightning bit for
bit, with foreach AdamW too (whose capturable arithmetic differs from the plain one in the last
bits): the optimizer keeps the user's configuration until a capture succeeds."""

from __future__ import annotations

import math

import pytest
import torch
from torch.optim.lr_scheduler import OneCycleLR

from tests.baselines import (  # noqa: F401 -- the fixture records each callback fit's switch step
    baseline_of,
    capturable_from_of_the_last_callback_fit,
)
from tests.callback.test_callback_replay_cpu import FailsInCapture
from tests.lightning_models import TinyMLP
from tests.replay_helpers import assert_same, callback, fit

pytestmark = pytest.mark.usefixtures("emulated_cuda_graphs")


class SyncsInItsStep(TinyMLP):
    """Refused at the first traced step: `.item()` waits for the device."""

    def __init__(self, **kw):
        super().__init__(sync_in_step=True, **kw)


class CountsItsSteps(TinyMLP):
    """Refused at the second traced step: a Python counter a replay would freeze."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self.updates = 0

    def training_step(self, batch, batch_idx):
        self.updates += 1
        return super().training_step(batch, batch_idx)


class CyclesItsBetas(TinyMLP):
    """Refused before the first step: OneCycleLR's default ``cycle_momentum=True`` moves AdamW's beta1
    at every step, known from the scheduler Lightning steps."""

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=1e-3, foreach=True)
        scheduler = OneCycleLR(opt, max_lr=1e-2, total_steps=200)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


class RampsItsBetas(TinyMLP):
    """Refused at the capture decision, after three warm-up steps: a hook moves AdamW's beta1 at every
    step, which no scheduler tells beforehand."""

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3, foreach=True)

    def on_train_batch_start(self, batch, batch_idx):
        group = self.optimizers().optimizer.param_groups[0]
        group["betas"] = (0.85 + 0.001 * self.global_step, group["betas"][1])


class MovesAQueuePointer(TinyMLP):
    """Refused in the warm-up: MoCo's queue pointer, a Python int a hook moves after every
    step and the step reads in a slice (`self.queue[self.ptr:self.ptr + n] = k`). The warning once said
    only that two warm-up steps ran different work and suggested `eager_steps`; it names the number now."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self.register_buffer("queue", torch.zeros(64, 32))
        self.ptr = 0

    def training_step(self, batch, batch_idx):
        x, _ = batch
        self.queue[self.ptr : self.ptr + x.shape[0]] = x.detach()
        return super().training_step(batch, batch_idx) + 0.0 * self.queue.sum()

    def on_train_batch_end(self, outputs, batch, batch_idx):
        self.ptr = (self.ptr + batch[0].shape[0]) % 64


class RampsALossWeight(TinyMLP):
    """Refused in the warm-up: a cosine loss weight computed from global_step in the step, a new
    number at every step, handed to a tensor method (not a `*` the graph can read from a device
    scalar). The warning names its line and the buffer a hook fills, which captures once
    (test_a_per_step_weight_kept_in_a_buffer_is_captured_once)."""

    def training_step(self, batch, batch_idx):
        w = 0.5 * (1 + math.cos(math.pi * min(self.global_step, 40) / 40))
        return super().training_step(batch, batch_idx).mul(1 + w)


class RampsALossWeightInABuffer(TinyMLP):
    def __init__(self, **kw):
        super().__init__(**kw)
        self.register_buffer("w", torch.tensor(0.0))

    def on_train_batch_start(self, batch, batch_idx):
        self.w.fill_(0.5 * (1 + math.cos(math.pi * min(self.global_step, 40) / 40)))

    def training_step(self, batch, batch_idx):
        return super().training_step(batch, batch_idx) * (1 + self.w)


def test_a_per_step_weight_kept_in_a_buffer_is_captured_once():
    base = fit(baseline_of(RampsALossWeightInABuffer), steps=30)
    cb = callback()
    run = fit(RampsALossWeightInABuffer, [cb], steps=30)
    summary = cb.summary()
    assert summary["captured"] and summary["captures"] == 1 and summary["fallback_steps"] == 0, summary
    assert_same(base, run)


@pytest.mark.parametrize(
    ("cls", "match"),
    [
        (SyncsInItsStep, r"makes the host wait for the GPU inside the step"),
        (
            RampsALossWeight,
            r"ran different work .*The step computes a number from the step counters that changed between "
            r"them, at [^\n]*`w = 0.5 \* \(1 \+ math.cos[^\n]*keep the number in a registered buffer",
        ),
        (MovesAQueuePointer, r"ran different work .*The step reads `self.ptr` \(\d+ -> \d+\), which changed"),
        (CountsItsSteps, r"the step changes Python state \(`self.updates`\)"),
        (CyclesItsBetas, r"AdamW's \['betas'\] change at every step: OneCycleLR with `cycle_momentum=True`"),
        (RampsItsBetas, r"AdamW's \['betas'\] changed at every warm-up step"),
        (FailsInCapture, r"could not be captured \(RuntimeError: operation not permitted"),
    ],
    ids=[
        "first-traced-step",
        "per-step-number",
        "moved-number",
        "second-traced-step",
        "before-the-first-step",
        "capture-decision",
        "failed-capture",
    ],
)
def test_a_refused_fit_with_foreach_adamw_is_plain_bit_for_bit(cls, match):
    plain = fit(cls, steps=20)
    cb = callback()
    with pytest.warns(UserWarning, match=match):
        run = fit(cls, [cb], steps=20)
    summary = cb.summary()
    assert not summary["captured"] and summary["capturable_from_step"] is None, summary
    assert_same(plain, run)
    group = run[2].optimizers[0].param_groups[0]
    assert group["capturable"] is False and isinstance(group["lr"], float) and group["foreach"] is True


def test_without_the_switch_at_capture_the_refused_foreach_fit_would_differ(monkeypatch):
    """The test above can fail: foreach AdamW made capturable from the first step trains otherwise."""
    from l2lightning.callback import graph_callback as callback_module
    from l2lightning.graph.optim import make_capturable

    monkeypatch.setattr(callback_module, "intercept", make_capturable)  # capturable from the first step
    plain = fit(CountsItsSteps, steps=20)
    with pytest.warns(UserWarning, match="the step changes Python state"):
        run = fit(CountsItsSteps, [callback()], steps=20)
    with pytest.raises(AssertionError, match="differs"):
        assert_same(plain, run)


class SparseEmbedding(TinyMLP):
    """An `nn.Embedding(sparse=True)` (DLRM-style tables) beside the MLP; `kind` its optimizer."""

    kind = "sgd"

    def __init__(self, **kw):
        super().__init__(**kw)
        self.emb = torch.nn.Embedding(10, 32, sparse=True)

    def training_step(self, batch, batch_idx):
        x, y = batch
        rows = (x[:, 0].abs() * 3).long().clamp(0, 9)
        return super().training_step((x + self.emb(rows), y), batch_idx)

    def configure_optimizers(self):
        if self.kind == "adagrad":
            return torch.optim.Adagrad(self.parameters(), lr=0.05)
        opt = torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)
        return [opt], [torch.optim.lr_scheduler.StepLR(opt, 1)]


class SparseEmbeddingAdagrad(SparseEmbedding):
    kind = "adagrad"


@pytest.mark.parametrize("cls", [SparseEmbedding, SparseEmbeddingAdagrad], ids=["sgd-momentum", "adagrad"])
def test_sparse_gradients_are_refused_by_name_and_the_fit_is_plain(cls):
    """The fit used to stop (a sparse momentum buffer has no storage); now it is refused at its first
    traced step, before that step's update, and trains as plain Lightning does."""
    kwargs = {"steps": -1, "n": 64, "trainer_kwargs": {"max_epochs": 3}}
    plain = fit(cls, **kwargs)
    cb = callback()
    with pytest.warns(UserWarning, match=r"parameters with sparse gradients \(`emb.weight`"):
        run = fit(cls, [cb], **kwargs)
    assert not cb.summary()["captured"] and cb.captures == 0, cb.summary()
    assert_same(plain, run)
