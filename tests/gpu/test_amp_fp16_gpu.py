"""GPU: ``precision="16-mixed"`` with fused AdamW captured, bit-identical to its eager baseline.

The GradScaler's unscale, inf check, skipped update after an overflow and scale update run inside
the graph; every step's loss, scale, growth tracker and a weight are compared with the baseline
(plain Lightning, switched to ``make_capturable``'s configuration at the callback's capture step:
``tests/baselines.py``), and at the end the parameters, the optimizer's state and the scaler's.
"""

from __future__ import annotations

import pytest
import torch
from lightning.pytorch import Callback, seed_everything
from lightning.pytorch.plugins.precision import MixedPrecision

from l2lightning import L2GraphCallback
from tests.baselines import (  # noqa: F401 -- the fixture records each callback fit's switch step
    DeferredFit,
    baseline_of,
    capturable_from_of_the_last_callback_fit,
    is_baseline,
)
from tests.lightning_models import TinyMLP, quiet_trainer, regression_loader

pytestmark = pytest.mark.gpu


class StepRecorder(Callback):
    """After every step: the loss, the scaler's scale and growth tracker, and one weight."""

    def __init__(self):
        self.losses, self.scales, self.trackers, self.weights = [], [], [], []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        scaler = trainer.precision_plugin.scaler
        self.losses.append(outputs["loss"].detach().clone())
        self.scales.append(scaler._scale.detach().clone())
        self.trackers.append(scaler._growth_tracker.detach().clone())
        self.weights.append(pl_module.head.weight.detach().clone())


def fit(model_cls, callbacks, scaler_kwargs=None, steps=30):
    """A 16-mixed fit of `model_cls` (fused AdamW) for `steps` steps; `scaler_kwargs`: the GradScaler's
    arguments, passed through Lightning's plugin (None: `precision="16-mixed"`, Lightning's own scaler)."""
    if is_baseline(model_cls):  # the baseline switches where the test's callback fit switched
        return DeferredFit(lambda: _fit(model_cls, callbacks, scaler_kwargs, steps))
    return _fit(model_cls, callbacks, scaler_kwargs, steps)


def _fit(model_cls, callbacks, scaler_kwargs, steps):
    seed_everything(0)
    torch.use_deterministic_algorithms(True, warn_only=True)
    model = model_cls(width=512, depth=4, fused=True)
    rec = StepRecorder()
    precision = (
        {"precision": "16-mixed"}
        if scaler_kwargs is None
        else {
            "plugins": [
                MixedPrecision("16-mixed", "cuda", scaler=torch.amp.GradScaler("cuda", **scaler_kwargs))
            ]
        }
    )
    trainer = quiet_trainer(
        accelerator="gpu",
        devices=1,
        max_steps=steps,
        callbacks=[rec, *callbacks],
        deterministic=True,
        **precision,
    )
    trainer.fit(model, regression_loader(n=240, width=512, batch_size=8))
    return model, rec, trainer


def assert_same_fp16_run(a, b):
    (ma, ra, ta), (mb, rb, tb) = a, b
    assert len(ra.losses) == len(rb.losses)
    for i in range(len(ra.losses)):
        assert torch.equal(ra.losses[i], rb.losses[i]), f"loss differs at step {i}"
        assert torch.equal(ra.scales[i], rb.scales[i]), f"scale differs after step {i}"
        assert torch.equal(ra.trackers[i], rb.trackers[i]), f"growth tracker differs after step {i}"
        assert torch.equal(ra.weights[i], rb.weights[i]), f"head.weight differs after step {i}"
    for (name, p), q in zip(ma.named_parameters(), mb.parameters()):
        assert torch.equal(p, q), f"parameter {name} differs"
    sa, sb = ta.optimizers[0].state_dict(), tb.optimizers[0].state_dict()
    assert sa["param_groups"] == sb["param_groups"]
    for key, state in sa["state"].items():
        for name, value in state.items():
            assert torch.equal(value, sb["state"][key][name]), f"optimizer state {name} of {key} differs"
    assert ta.precision_plugin.state_dict() == tb.precision_plugin.state_dict()


def test_fused_adamw_16_mixed_with_overflows_is_captured_bitwise_its_baseline():
    """A scale far too large for fp16 (2**24): the first steps overflow and are skipped, the scale
    halves until the gradients fit, then grows back every 3 clean steps into the next overflow; the
    capture falls among the skipped steps, so replays skip updates and move the scale too. Every
    scheduled replay is also checked against its eager step (`check_share=1.0`)."""
    scaler = {"init_scale": 2.0**24, "growth_interval": 3}
    cb = L2GraphCallback(prefetch="off", check_share=1.0)
    run = fit(TinyMLP, [cb], scaler)
    base = fit(baseline_of(TinyMLP), [], scaler)
    summary = cb.summary()
    assert summary["captured"] and summary["captures"] == 1 and summary["fallback_steps"] == 0, summary
    assert summary["replay_check"]["checks"] >= 4 and summary["replay_check"]["mismatches"] == 0, summary
    rec = run[1]
    skipped = [i for i in range(1, len(rec.scales)) if rec.scales[i] < rec.scales[i - 1]]
    replayed_skips = [i for i in skipped if i > summary["capture_step"]]
    assert replayed_skips, (skipped, summary["capture_step"], [float(s) for s in rec.scales])
    for i in replayed_skips:  # an overflowing step leaves the parameters as they were
        assert torch.equal(rec.weights[i], rec.weights[i - 1]), i
    assert_same_fp16_run(base, run)
    assert "optimizer_step" not in vars(run[2].precision_plugin)


def test_fused_adamw_16_mixed_by_flag_with_prefetch_is_bitwise_its_baseline():
    """`Trainer(precision="16-mixed")` as users write it (Lightning's own GradScaler), prefetch on."""
    cb = L2GraphCallback(prefetch="default")
    run = fit(TinyMLP, [cb])
    base = fit(baseline_of(TinyMLP), [])
    summary = cb.summary()
    assert summary["captured"] and summary["fallback_steps"] == 0, summary
    assert summary["replay_check"]["mismatches"] == 0, summary
    assert_same_fp16_run(base, run)


def test_non_fused_adamw_under_16_mixed_trains_eagerly_naming_fused():
    class ForeachAdamW(TinyMLP):
        def __init__(self, **kw):
            super().__init__(**{**kw, "fused": False})

    cb = L2GraphCallback(prefetch="off")
    with pytest.warns(UserWarning, match=r"pass `fused=True` to AdamW"):
        run = fit(ForeachAdamW, [cb])
    plain = fit(ForeachAdamW, [])
    assert not cb.summary()["captured"]
    assert_same_fp16_run(plain, run)
