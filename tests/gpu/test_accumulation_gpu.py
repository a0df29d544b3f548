"""GPU: gradient accumulation captured, bit-identical to its eager baseline.

Every micro-batch replays a graph of its role (``l2lightning.graph.accumulation``, ``graph_slots``): a
window's first makes the gradients, the next ones add to them, the closing one adds and steps the
optimizer. Every micro-batch's loss and logged values, the
parameters and the optimizer's state are compared with the baseline (plain Lightning, switched to
``make_capturable``'s configuration at the callback's capture step: ``tests/baselines.py``). Every
scheduled replay is also checked against its eager step (``check_share=1.0``).
"""

from __future__ import annotations

import pytest
import torch
from lightning.pytorch import Callback, seed_everything
from lightning.pytorch.callbacks import GradientAccumulationScheduler

from l2lightning import L2GraphCallback
from tests.baselines import (  # noqa: F401 -- the fixture records each callback fit's switch step
    DeferredFit,
    baseline_of,
    capturable_from_of_the_last_callback_fit,
    is_baseline,
)
from tests.lightning_models import TinyMLP, quiet_trainer, regression_loader

pytestmark = pytest.mark.gpu


class MicroBatchRecorder(Callback):
    """After every micro-batch: the loss Lightning saw, the logged values, and one weight."""

    def __init__(self):
        self.losses, self.logged, self.weights = [], [], []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.losses.append(outputs["loss"].detach().clone())
        self.logged.append({k: v.detach().clone() for k, v in trainer.callback_metrics.items()})
        self.weights.append(pl_module.head.weight.detach().clone())


def fit(model_cls, callbacks, steps=30, **trainer_kwargs):
    if is_baseline(model_cls):  # the baseline switches where the test's callback fit switched
        return DeferredFit(lambda: _fit(model_cls, callbacks, steps, trainer_kwargs))
    return _fit(model_cls, callbacks, steps, trainer_kwargs)


def _fit(model_cls, callbacks, steps, trainer_kwargs):
    seed_everything(0)
    torch.use_deterministic_algorithms(True, warn_only=True)
    model = model_cls(width=512, depth=4, fused=True)
    rec = MicroBatchRecorder()
    trainer = quiet_trainer(
        accelerator="gpu",
        devices=1,
        max_steps=steps,
        callbacks=[rec, *callbacks],
        deterministic=True,
        **trainer_kwargs,
    )
    trainer.fit(model, regression_loader(n=240, width=512, batch_size=8))
    return model, rec, trainer


def assert_same_run(a, b):
    (ma, ra, ta), (mb, rb, tb) = a, b
    assert len(ra.losses) == len(rb.losses)
    for i in range(len(ra.losses)):
        assert torch.equal(ra.losses[i], rb.losses[i]), f"loss differs at micro-batch {i}"
        assert ra.logged[i].keys() == rb.logged[i].keys()
        for k in ra.logged[i]:
            assert torch.equal(ra.logged[i][k], rb.logged[i][k]), f"logged {k!r} differs at micro-batch {i}"
        assert torch.equal(ra.weights[i], rb.weights[i]), f"head.weight differs after micro-batch {i}"
    for (name, p), q in zip(ma.named_parameters(), mb.parameters()):
        assert torch.equal(p, q), f"parameter {name} differs"
    sa, sb = ta.optimizers[0].state_dict(), tb.optimizers[0].state_dict()
    assert sa["param_groups"] == sb["param_groups"]
    for key, state in sa["state"].items():
        for name, value in state.items():
            assert torch.equal(value, sb["state"][key][name]), f"optimizer state {name} of {key} differs"


def assert_captured_and_checked(cb):
    summary = cb.summary()
    assert summary["captured"], summary
    assert summary["replay_check"]["checks"] >= 1 and summary["replay_check"]["mismatches"] == 0, summary


@pytest.mark.parametrize("factor", [2, 4])
def test_accumulation_with_fused_adamw_is_captured_bitwise_its_baseline(factor):
    cb = L2GraphCallback(prefetch="off", check_share=1.0)
    run = fit(TinyMLP, [cb], accumulate_grad_batches=factor)
    base = fit(baseline_of(TinyMLP), [], accumulate_grad_batches=factor)
    assert_captured_and_checked(cb)
    # a graph per role (the window's first, the adding ones, the closing one), none captured again
    summary = cb.summary()
    assert summary["captures"] == (2 if factor == 2 else 3) and summary["recaptures"] == 0, summary
    assert summary["fallback_steps"] == 0, summary
    assert_same_run(base, run)


def test_accumulation_with_gradient_clipping_and_prefetch_is_bitwise_its_baseline():
    cb = L2GraphCallback(prefetch="default", check_share=1.0)
    run = fit(TinyMLP, [cb], accumulate_grad_batches=3, gradient_clip_val=0.05)
    base = fit(baseline_of(TinyMLP), [], accumulate_grad_batches=3, gradient_clip_val=0.05)
    assert_captured_and_checked(cb)
    assert_same_run(base, run)


def test_a_gradient_accumulation_scheduler_is_bitwise_its_baseline():
    def schedule():
        return GradientAccumulationScheduler({0: 1, 1: 2, 2: 4})

    # a graph per factor: on the GPU the re-capture waits for eager steps to cost what a capture does,
    # longer than these short epochs (the first H200 run captured once); this test is about the graphs
    cb = L2GraphCallback(prefetch="off", check_share=1.0, recapture_wait=False)
    run = fit(TinyMLP, [cb, schedule()], steps=-1, max_epochs=4)
    base = fit(baseline_of(TinyMLP), [schedule()], steps=-1, max_epochs=4)
    assert_captured_and_checked(cb)
    assert cb.summary()["captures"] >= 3, cb.summary()
    assert_same_run(base, run)


def test_accumulation_with_16_mixed_fused_adamw_is_bitwise_its_baseline():
    cb = L2GraphCallback(prefetch="off", check_share=1.0)
    run = fit(TinyMLP, [cb], accumulate_grad_batches=2, precision="16-mixed")
    base = fit(baseline_of(TinyMLP), [], accumulate_grad_batches=2, precision="16-mixed")
    assert_captured_and_checked(cb)
    assert_same_run(base, run)
    assert run[2].precision_plugin.state_dict() == base[2].precision_plugin.state_dict()
