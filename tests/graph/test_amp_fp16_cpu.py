"""``precision="16-mixed"`` (a GradScaler) captured with fused optimizers, on the CPU graph emulator.

Lightning refuses fp16 AMP on a CPU accelerator by flag (it trains bf16 instead), so these fits pass
its plugin: ``MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu"))``; torch runs
fp16 autocast, the GradScaler and fused AdamW/SGD on the CPU. Each captured fit is compared bit for
bit with its baseline (``tests/baselines.py``): per-step losses and logged values, parameters, the
optimizer's state and the scaler's scale and growth tracker after every step, skipped steps after an
overflow included. A fit the callback refuses is compared with plain Lightning.
"""

from __future__ import annotations

import pytest
import torch
from lightning.pytorch import Callback, seed_everything
from lightning.pytorch.plugins.precision import MixedPrecision

from l2lightning.graph.amp_step import unfused_refusal
from tests import graph_emulator as emu
from tests.baselines import (  # noqa: F401 -- the fixture records each callback fit's switch step
    baseline_of,
    capturable_from_of_the_last_callback_fit,
)
from tests.idiom_harness import loop_state
from tests.lightning_models import TinyMLP, quiet_trainer
from tests.replay_helpers import assert_same, callback, fit

pytestmark = pytest.mark.usefixtures("emulated_cuda_graphs")


def fp16(**scaler_kwargs):
    """Lightning's 16-mixed plugin on the CPU, with a GradScaler of `scaler_kwargs`."""
    return MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu", **scaler_kwargs))


class ScalerRecorder(Callback):
    """After every step: the scaler's scale and growth tracker, and one weight (unchanged by a skipped step)."""

    def __init__(self):
        self.scales, self.trackers, self.weights = [], [], []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        scaler = trainer.precision_plugin.scaler
        self.scales.append(scaler._scale.clone())
        self.trackers.append(scaler._growth_tracker.clone())
        self.weights.append(pl_module.head.weight.detach().clone())


class FusedSGD(TinyMLP):
    """Fused SGD with momentum (its momentum buffers are made at the first step, which must not overflow)."""

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=1e-2, momentum=0.9, fused=True)


def amp_pair(cls, scaler_kwargs, callback_kwargs=None, steps=30, **model_kwargs):
    """(baseline fit, callback fit, callback, the baseline's and the callback fit's ScalerRecorder)."""
    base_rec, run_rec = ScalerRecorder(), ScalerRecorder()
    cb = callback(check_share=1.0, **(callback_kwargs or {}))
    run = fit(
        cls, [run_rec, cb], steps=steps, trainer_kwargs={"plugins": [fp16(**scaler_kwargs)]}, **model_kwargs
    )
    base = fit(
        baseline_of(cls),
        [base_rec],
        steps=steps,
        trainer_kwargs={"plugins": [fp16(**scaler_kwargs)]},
        **model_kwargs,
    )
    base[0]  # the deferred baseline fit runs now
    return base, run, cb, base_rec, run_rec


def assert_same_amp(base, run, base_rec, run_rec):
    """assert_same, and after every step the same scale, growth tracker and weight; the same
    optimizer state and scaler state (what a checkpoint saves) at the end."""
    assert_same(base, run)
    assert len(base_rec.scales) == len(run_rec.scales)
    for i, (a, b) in enumerate(zip(base_rec.scales, run_rec.scales)):
        assert torch.equal(a, b), f"scale differs after step {i}: {a} vs {b}"
    for i, (a, b) in enumerate(zip(base_rec.trackers, run_rec.trackers)):
        assert torch.equal(a, b), f"growth tracker differs after step {i}: {a} vs {b}"
    for i, (a, b) in enumerate(zip(base_rec.weights, run_rec.weights)):
        assert torch.equal(a, b), f"head.weight differs after step {i}"
    opt_a, opt_b = base[2].optimizers[0].state_dict(), run[2].optimizers[0].state_dict()
    assert opt_a["param_groups"] == opt_b["param_groups"]
    assert opt_a["state"].keys() == opt_b["state"].keys()
    for key, state in opt_a["state"].items():
        for name, value in state.items():
            assert torch.equal(value, opt_b["state"][key][name]), f"optimizer state {name} of {key} differs"
    assert base[2].precision_plugin.state_dict() == run[2].precision_plugin.state_dict()


def skipped_steps(rec):
    """The steps whose update the scaler skipped (an overflow: the scale backed off)."""
    return [i for i in range(1, len(rec.scales)) if rec.scales[i] < rec.scales[i - 1]]


def grown_steps(rec):
    return [i for i in range(1, len(rec.scales)) if rec.scales[i] > rec.scales[i - 1]]


# --------------------------------------------------------------------------- captured, bitwise the baseline
@pytest.mark.parametrize(
    ("cls", "model_kwargs"), [(TinyMLP, {"fused": True}), (FusedSGD, {})], ids=["adamw", "sgd-momentum"]
)
def test_a_fused_optimizer_under_16_mixed_is_captured_bitwise_its_baseline(cls, model_kwargs):
    base, run, cb, base_rec, run_rec = amp_pair(cls, {"growth_interval": 4}, **model_kwargs)
    summary = cb.summary()
    assert summary["captured"] and summary["captures"] == 1 and summary["fallback_steps"] == 0, summary
    assert emu.FakeGraph.replays >= 30 - summary["capture_step"]
    check = summary["replay_check"]
    assert check["checks"] >= 4 and check["mismatches"] == 0, check  # replays 1, 2, 4, 8, 16
    assert_same_amp(base, run, base_rec, run_rec)
    # the scale grew inside the replays (every 4 clean steps), as in the eager fit
    assert [i for i in grown_steps(run_rec) if i > summary["capture_step"]], run_rec.scales
    plugin = run[2].precision_plugin
    assert "optimizer_step" not in vars(plugin)  # the callback's override is gone after the fit


def test_overflowing_steps_are_skipped_and_the_scale_backs_off_inside_the_replays_bitwise():
    """A scale far too large for fp16: the first steps' gradients overflow, the scaler skips their
    updates and halves the scale until they fit, then grows it back every 3 clean steps into the next
    overflow; the capture (step 4 here) falls among the skipped steps, so replays skip updates too."""
    base, run, cb, base_rec, run_rec = amp_pair(
        TinyMLP, {"init_scale": 2.0**24, "growth_interval": 3}, fused=True
    )
    summary = cb.summary()
    assert summary["captured"] and summary["captures"] == 1 and summary["fallback_steps"] == 0, summary
    assert summary["replay_check"]["mismatches"] == 0, summary["replay_check"]
    skipped = skipped_steps(run_rec)
    after_capture = [i for i in skipped if i > summary["capture_step"]]
    assert len(after_capture) >= 2, (skipped, summary["capture_step"])
    for i in after_capture:  # a skipped step leaves the parameters as they were
        assert torch.equal(run_rec.weights[i], run_rec.weights[i - 1]), i
    assert [i for i in grown_steps(run_rec) if i > summary["capture_step"]], run_rec.scales
    assert skipped == skipped_steps(base_rec)
    assert_same_amp(base, run, base_rec, run_rec)


def test_verify_capture_under_16_mixed_undoes_the_eager_checks_scale_update():
    """`verify="capture"` runs the capture step eagerly first and puts the model and optimizer back;
    the scaler's update of that eager step is put back too, or the fit would run one update ahead."""
    base, run, cb, base_rec, run_rec = amp_pair(
        TinyMLP, {"init_scale": 2.0**20, "growth_interval": 2}, {"verify": "capture"}, fused=True
    )
    summary = cb.summary()
    assert summary["captured"] and "bit-identical" in (summary["verify"] or ""), summary
    assert_same_amp(base, run, base_rec, run_rec)


class SlowsItsGrowthEachEpoch(Callback):
    """Sets the scaler's growth interval at each epoch start (a number its update kernel is passed)."""

    def on_train_epoch_start(self, trainer, pl_module):
        trainer.precision_plugin.scaler._growth_interval = 2 + trainer.current_epoch


def test_a_scaler_setting_changed_between_steps_captures_the_step_again():
    base_rec, run_rec = ScalerRecorder(), ScalerRecorder()
    cb = callback(check_share=1.0)
    with pytest.warns(
        UserWarning, match=r"capturing the step again: the GradScaler's growth interval 2 -> 3"
    ):
        run = fit(
            TinyMLP,
            [SlowsItsGrowthEachEpoch(), run_rec, cb],
            steps=90,
            fused=True,
            trainer_kwargs={"plugins": [fp16()]},
        )
    base = fit(
        baseline_of(TinyMLP),
        [SlowsItsGrowthEachEpoch(), base_rec],
        steps=90,
        fused=True,
        trainer_kwargs={"plugins": [fp16()]},
    )
    assert cb.summary()["captures"] == 3, cb.summary()
    assert_same_amp(base, run, base_rec, run_rec)


def test_a_checkpoint_saved_after_replays_holds_the_baselines_scaler_and_optimizer(tmp_path):
    base, run, cb, _, _ = amp_pair(TinyMLP, {"init_scale": 2.0**20, "growth_interval": 2}, fused=True)
    assert cb.summary()["captured"]
    paths = []
    for name, (_, _, trainer) in (("base", base), ("run", run)):
        paths.append(tmp_path / f"{name}.ckpt")
        trainer.save_checkpoint(paths[-1])
    a, b = (torch.load(p, weights_only=False) for p in paths)
    assert a["MixedPrecision"] == b["MixedPrecision"] and a["MixedPrecision"]["scale"] < 2.0**20
    assert repr(a["optimizer_states"]) == repr(b["optimizer_states"])


def test_a_capture_failing_inside_the_scalers_step_is_undone_and_the_fit_is_plain(monkeypatch):
    """The capture fails inside the optimizer's fused kernel, after ``scaler.step`` has begun: the
    scaler's stage and the scale it lent the optimizer are dropped, and the step runs eagerly."""
    original = torch._fused_adamw_

    def fused_adamw(*args, **kwargs):
        if emu.CAPTURING[0]:
            raise RuntimeError("operation not permitted when stream is capturing")
        return original(*args, **kwargs)

    monkeypatch.setattr(torch, "_fused_adamw_", fused_adamw)
    base_rec, run_rec = ScalerRecorder(), ScalerRecorder()
    plain = fit(TinyMLP, [base_rec], fused=True, trainer_kwargs={"plugins": [fp16(growth_interval=2)]})
    cb = callback()
    with pytest.warns(UserWarning, match=r"could not be captured \(RuntimeError: operation not permitted"):
        run = fit(TinyMLP, [run_rec, cb], fused=True, trainer_kwargs={"plugins": [fp16(growth_interval=2)]})
    assert not cb.summary()["captured"], cb.summary()
    assert_same_amp(plain, run, base_rec, run_rec)
    assert not hasattr(run[2].optimizers[0], "grad_scale")


def test_a_disabled_scaler_is_captured_with_any_optimizer():
    """`GradScaler(enabled=False)` (AMP switched off by a flag): Lightning still runs the closure
    itself, and the scaler's step is the optimizer's own, so foreach AdamW is captured too."""
    base = fit(baseline_of(TinyMLP), trainer_kwargs={"plugins": [fp16(enabled=False)]})
    cb = callback(check_share=1.0)
    run = fit(TinyMLP, [cb], trainer_kwargs={"plugins": [fp16(enabled=False)]})
    summary = cb.summary()
    assert summary["captured"] and summary["fallback_steps"] == 0, summary
    assert summary["replay_check"]["checks"] >= 4 and summary["replay_check"]["mismatches"] == 0
    assert_same(base, run)


# --------------------------------------------------------------------------- the idiom
def test_the_fp16_fused_adamw_idiom_is_captured_bitwise_its_baseline():
    """``fp16_fused_adamw`` (tests/idiom_variants.py) as users write it, with the CPU's explicit plugin."""
    from tests.idiom_variants import IDIOM_VARIANTS
    from tests.replay_helpers import Recorder

    idiom = IDIOM_VARIANTS["fp16_fused_adamw"]
    assert idiom.expect == "capture" and idiom.trainer_kwargs["precision"] == "16-mixed"

    def run(with_callback):
        seed_everything(0)
        module = idiom.make_module()
        if not with_callback:
            module.__class__ = baseline_of(type(module))
        rec = Recorder()
        cb = callback(check_share=1.0) if with_callback else None
        trainer = quiet_trainer(
            accelerator="cpu",
            max_steps=40,
            callbacks=[rec, *([cb] if cb else [])],
            plugins=[fp16()],
        )
        trainer.fit(module, idiom.make_loader())
        return module, rec, trainer, cb

    got = run(True)
    cb = got[3]
    assert cb.summary()["captured"] and cb.summary()["replay_check"]["mismatches"] == 0, cb.summary()
    reference = run(False)
    assert_same(reference[:3], got[:3])
    assert reference[2].precision_plugin.state_dict() == got[2].precision_plugin.state_dict()
    assert loop_state(reference[2]) == loop_state(got[2])


# --------------------------------------------------------------------------- refused: eager, plain bit for bit
def test_a_non_fused_optimizer_under_16_mixed_trains_eagerly_with_a_warning_naming_fused():
    plain_rec, run_rec = ScalerRecorder(), ScalerRecorder()
    plain = fit(TinyMLP, [plain_rec], steps=20, trainer_kwargs={"plugins": [fp16(growth_interval=3)]})
    cb = callback()
    with pytest.warns(UserWarning, match=r"AdamW without `fused=True`.*pass `fused=True` to AdamW"):
        run = fit(TinyMLP, [run_rec, cb], steps=20, trainer_kwargs={"plugins": [fp16(growth_interval=3)]})
    summary = cb.summary()
    assert not summary["captured"] and "found_inf.item()" in summary["reason"], summary
    assert emu.FakeGraph.instances == 0
    assert_same_amp(plain, run, plain_rec, run_rec)
    assert "optimizer_step" not in vars(run[2].precision_plugin)


@pytest.mark.parametrize(
    ("make", "advice"),
    [
        (lambda ps: torch.optim.Adam(ps, foreach=True), "pass `fused=True` to Adam"),
        (lambda ps: torch.optim.SGD(ps, lr=0.1), "pass `fused=True` to SGD"),
        (
            lambda ps: torch.optim.RMSprop(ps),
            "RMSprop has no fused step on CUDA; use Adam, AdamW or SGD with `fused=True`",
        ),
    ],
    ids=["adam", "sgd", "rmsprop"],
)
def test_the_refusal_of_a_non_fused_optimizer_names_the_fused_option(make, advice):
    optimizer = make([torch.nn.Parameter(torch.zeros(2))])
    assert advice in unfused_refusal(optimizer, "16-mixed")
    fused = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))], fused=True)
    assert unfused_refusal(fused, "16-mixed") is None


class OwnScaledStep(MixedPrecision):
    """A precision plugin stepping its scaler in its own way."""

    def optimizer_step(self, optimizer, model, closure, **kwargs):
        return super().optimizer_step(optimizer, model=model, closure=closure, **kwargs)


def test_a_precision_plugin_with_its_own_optimizer_step_is_refused_by_name():
    def plugin():
        return OwnScaledStep("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu"))

    plain = fit(TinyMLP, steps=10, fused=True, trainer_kwargs={"plugins": [plugin()]})
    cb = callback()
    with pytest.warns(UserWarning, match=r"the precision plugin OwnScaledStep steps its gradient scaler"):
        run = fit(TinyMLP, [cb], steps=10, fused=True, trainer_kwargs={"plugins": [plugin()]})
    assert not cb.summary()["captured"]
    assert_same(plain, run)


def test_gradient_clipping_with_a_fused_optimizer_raises_lightnings_error_as_without_the_callback():
    """Lightning refuses to clip the gradients of an optimizer that unscales them in its own step; the
    callback leaves that error as it is, and nothing of its own installed."""
    kwargs = {"gradient_clip_val": 1.0}
    with pytest.raises(RuntimeError, match="does not allow for gradient clipping") as plain:
        fit(TinyMLP, steps=5, fused=True, trainer_kwargs={**kwargs, "plugins": [fp16()]})
    plugin = fp16()
    with pytest.raises(RuntimeError, match="does not allow for gradient clipping") as run:
        fit(TinyMLP, [callback()], steps=5, fused=True, trainer_kwargs={**kwargs, "plugins": [plugin]})
    assert str(plain.value) == str(run.value)
    assert "optimizer_step" not in vars(plugin)
