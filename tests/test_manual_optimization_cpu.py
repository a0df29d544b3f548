"""Manual optimization (``automatic_optimization = False``) on the CPU graph emulator.

The whole ``training_step`` is the captured step (l2lightning.manual_step). One optimizer with
``self.optimizers()``, ``zero_grad``, ``manual_backward`` and ``step`` is captured and bit for bit
its baseline (per-step losses and logs, parameters, the optimizer's state, the loop's progress:
``global_step`` is the manual loop's optimizer-step count, which replays move on too). What is not
captured (two optimizers: Lightning's basic GAN; LR schedulers the step steps; hooks inside the step)
trains eagerly with one warning naming the cause, bit for bit plain Lightning, and never raises.
"""

from __future__ import annotations

import pytest
import torch
from lightning.pytorch import Callback

from l2lightning import L2GraphCallback
from tests import graph_emulator as emu
from tests.baselines import (  # noqa: F401 -- the fixture records each callback fit's switch step
    baseline_of,
    capturable_from_of_the_last_callback_fit,
)
from tests.idiom_modules import IDIOMS
from tests.lightning_models import TinyMLP
from tests.test_callback_replay_cpu import assert_same, callback, fit

pytestmark = pytest.mark.usefixtures("emulated_cuda_graphs")


class ByHand(TinyMLP):
    """TinyMLP with `automatic_optimization = False`: its subclasses' `training_step` steps by hand."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.automatic_optimization = False


class ManualMLP(ByHand):
    """TinyMLP trained by hand: ``opt.zero_grad(); self.manual_backward(loss); opt.step()``; returns
    nothing (`returns=False`) or the loss."""

    def __init__(self, returns: bool = False, toggle: bool = False, **kwargs):
        super().__init__(**kwargs)
        self.returns = returns
        self.toggle = toggle

    def training_step(self, batch, batch_idx):
        opt = self.optimizers()
        if self.toggle:
            self.toggle_optimizer(opt)
        loss = super().training_step(batch, batch_idx)
        opt.zero_grad()
        self.manual_backward(loss)
        opt.step()
        if self.toggle:
            self.untoggle_optimizer(opt)
        return loss if self.returns else None


class ManualScheduled(ManualMLP):
    """A per-step scheduler the step itself steps (`self.lr_schedulers().step()`)."""

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=self.lr, foreach=True)
        return [opt], [torch.optim.lr_scheduler.StepLR(opt, 5, 0.5)]

    def training_step(self, batch, batch_idx):
        out = super().training_step(batch, batch_idx)
        self.lr_schedulers().step()
        return out


class ManualTwoOptimizers(ManualMLP):
    """Two optimizers stepped one after the other (the GAN's shape on the MLP)."""

    def configure_optimizers(self):
        return [
            torch.optim.AdamW(self.net.parameters(), lr=self.lr, foreach=True),
            torch.optim.SGD(self.head.parameters(), lr=self.lr),
        ]

    def training_step(self, batch, batch_idx):
        opt_a, opt_b = self.optimizers()
        loss = TinyMLP.training_step(self, batch, batch_idx)
        opt_a.zero_grad()
        opt_b.zero_grad()
        self.manual_backward(loss)
        opt_a.step()
        opt_b.step()


class ManualWithHook(ManualMLP):
    def on_after_backward(self):
        self.log("after_backward", 1.0)


class AdamState(Callback):
    """The optimizer's state after every step (exp_avg of the head's weight, the step count)."""

    def __init__(self):
        self.states = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        opt = trainer.optimizers[0]
        state = opt.state[pl_module.head.weight]
        self.states.append({k: v.detach().clone() for k, v in state.items() if isinstance(v, torch.Tensor)})


def manual_pair(cls, steps=30, callback_kwargs=None, **model_kwargs):
    base_rec, run_rec = AdamState(), AdamState()
    cb = callback(check_share=1.0, **(callback_kwargs or {}))
    run = fit(cls, [run_rec, cb], steps=steps, **model_kwargs)
    base = fit(baseline_of(cls), [base_rec], steps=steps, **model_kwargs)
    base[0]  # the deferred baseline fit runs now
    return base, run, cb, base_rec, run_rec


def assert_same_state(base_rec, run_rec):
    assert len(base_rec.states) == len(run_rec.states)
    for i, (a, b) in enumerate(zip(base_rec.states, run_rec.states)):
        assert a.keys() == b.keys()
        for k in a:
            assert torch.equal(a[k], b[k]), f"optimizer state {k!r} differs after step {i}"


# --------------------------------------------------------------------------- captured
@pytest.mark.parametrize(
    "model_kwargs",
    [{}, {"returns": True}, {"toggle": True}, {"fused": True}],
    ids=["returns-none", "returns-loss", "toggle", "fused"],
)
def test_one_optimizer_manual_step_is_captured_bitwise_its_baseline(model_kwargs):
    base, run, cb, base_rec, run_rec = manual_pair(ManualMLP, **model_kwargs)
    s = cb.summary()
    assert s["captured"] and s["captures"] == 1 and s["fallback_steps"] == 0 and s["reason"] is None, s
    assert emu.FakeGraph.replays >= 30 - 4
    assert run[2].global_step == base[2].global_step == 30
    assert_same(base, run)
    assert_same_state(base_rec, run_rec)
    if model_kwargs.get("returns"):
        assert all(isinstance(x, torch.Tensor) for x in run[1].losses)
    else:
        assert all(x is None for x in run[1].losses)


def test_manual_replays_are_checked_and_agree():
    _, _, cb, _, _ = manual_pair(ManualMLP, steps=40)
    check = cb.summary()["replay_check"]
    assert check["checks"] >= 2 and check["mismatches"] == 0, check


# --------------------------------------------------------------------------- eager by name
def assert_eager_like_plain(cls, match, steps=12, **model_kwargs):
    plain = fit(cls, steps=steps, **model_kwargs)
    cb = callback()
    with pytest.warns(UserWarning, match=match):
        run = fit(cls, [cb], steps=steps, **model_kwargs)
    s = cb.summary()
    assert not s["captured"], s
    assert "manual optimization" in s["reason"], s
    assert_same(plain, run)
    return cb


def test_two_optimizers_train_eagerly_naming_them():
    assert_eager_like_plain(ManualTwoOptimizers, r"with 2 optimizers \(AdamW, SGD\).*supports exactly one")


def test_a_scheduler_the_step_steps_trains_eagerly_naming_it():
    assert_eager_like_plain(ManualScheduled, r"LR schedulers \(StepLR\).*a replay would not step them")


def test_a_hook_inside_the_manual_step_trains_eagerly_naming_it():
    assert_eager_like_plain(ManualWithHook, r"hooks that run inside the step \(on_after_backward\)")


def test_verify_capture_trains_eagerly_naming_it():
    plain = fit(ManualMLP, steps=8)
    cb = callback(verify="capture")
    with pytest.warns(UserWarning, match=r"verify='capture'"):
        run = fit(ManualMLP, [cb], steps=8)
    assert not cb.summary()["captured"]
    assert_same(plain, run)


def test_a_host_sync_in_the_manual_step_trains_eagerly():
    assert_eager_like_plain_sync = fit(ManualMLP, steps=10, sync_in_step=True)
    cb = callback()
    with pytest.warns(UserWarning):
        run = fit(ManualMLP, [cb], steps=10, sync_in_step=True)
    assert not cb.summary()["captured"], cb.summary()
    assert_same(assert_eager_like_plain_sync, run)


def test_the_basic_gan_trains_eagerly_by_name_bitwise_plain():
    idiom = IDIOMS["manual_gan"]

    def run(callbacks):
        from lightning.pytorch import seed_everything

        from tests.lightning_models import quiet_trainer

        seed_everything(0)
        model = idiom.make_module()
        trainer = quiet_trainer(accelerator="cpu", max_steps=8, callbacks=callbacks)
        trainer.fit(model, idiom.make_loader())
        return model, trainer

    cb = callback()
    with pytest.warns(UserWarning, match=r"ManualGAN sets `automatic_optimization = False`.*2 optimizers"):
        model, trainer = run([cb])
    plain, plain_trainer = run([])
    assert not cb.summary()["captured"]
    assert trainer.global_step == plain_trainer.global_step == 8
    for (name, p), q in zip(model.named_parameters(), plain.parameters()):
        assert torch.equal(p, q), name


class ManualClipped(ByHand):
    """Lightning's `self.clip_gradients` between manual_backward and the step."""

    def training_step(self, batch, batch_idx):
        opt = self.optimizers()
        loss = super().training_step(batch, batch_idx)
        opt.zero_grad()
        self.manual_backward(loss)
        self.clip_gradients(opt, gradient_clip_val=0.05, gradient_clip_algorithm="norm")
        opt.step()
        return loss


class ManualEveryOther(ByHand):
    """An optimizer step at every other batch only (the gradients of the others are dropped)."""

    def training_step(self, batch, batch_idx):
        opt = self.optimizers()
        loss = super().training_step(batch, batch_idx)
        opt.zero_grad()
        self.manual_backward(loss)
        if batch_idx % 2 == 0:
            opt.step()
        return loss


@pytest.mark.parametrize("cls", [ManualClipped, ManualEveryOther], ids=["clip_gradients", "every-other"])
def test_manual_variants_are_bitwise_their_baseline(cls):
    base, run, cb, base_rec, run_rec = manual_pair(cls, steps=24)
    s = cb.summary()
    assert s["captured"] and s["captures"] == 1 and s["reason"] is None, s
    assert emu.FakeGraph.replays >= (24 - 4) // (2 if cls is ManualEveryOther else 1)
    assert run[2].global_step == base[2].global_step
    assert_same(base, run)
    assert_same_state(base_rec, run_rec)


def test_manual_capture_over_epochs_with_validation_is_bitwise_its_baseline():
    """Three epochs of 30 batches: the step counter (`global_step`) and the loop's progress across
    epoch ends, as replays move them."""
    base, run, cb, base_rec, run_rec = manual_pair(ManualMLP, steps=75, returns=True)
    assert cb.summary()["captured"], cb.summary()
    assert run[2].global_step == 75 and run[2].current_epoch == base[2].current_epoch
    assert_same(base, run)
    assert_same_state(base_rec, run_rec)


def test_prefetch_is_off_under_manual_optimization_said_once():
    cb = L2GraphCallback(prefetch="default", log_timing=False)
    with pytest.warns(UserWarning, match=r"prefetch off under manual optimization"):
        run = fit(ManualMLP, [cb], steps=12)
    base = fit(baseline_of(ManualMLP), steps=12)
    assert cb.summary()["captured"], cb.summary()
    assert_same(base, run)


class HiddenScheduler(ManualMLP):
    """An LR scheduler the module keeps (not configured through Lightning), stepped inside the step."""

    def on_train_start(self):
        self.sched = torch.optim.lr_scheduler.StepLR(self.optimizers().optimizer, 3, 0.5)

    def training_step(self, batch, batch_idx):
        out = super().training_step(batch, batch_idx)
        self.sched.step()
        return out


class AssignedLR(ManualMLP):
    def training_step(self, batch, batch_idx):
        out = super().training_step(batch, batch_idx)
        for group in self.optimizers().param_groups:
            group["lr"] = 1e-2 * min(1.0, (batch_idx + 1) / 20)
        return out


@pytest.mark.parametrize("cls", [HiddenScheduler, AssignedLR], ids=["module-scheduler", "assigned-lr"])
def test_hyperparameters_changed_inside_the_manual_step_train_eagerly_naming_them(cls):
    assert_eager_like_plain(
        cls,
        r"training_step \(manual optimization\) changes the optimizer's hyperparameters \(param group 0's `lr`\)",
    )


class ZeroGradAfterStep(ByHand):
    """The GAN tutorial's order: backward, step, then zero_grad (no gradients between steps)."""

    def training_step(self, batch, batch_idx):
        opt = self.optimizers()
        loss = super().training_step(batch, batch_idx)
        self.manual_backward(loss)
        opt.step()
        opt.zero_grad()
        return loss


class WarmupBeforeStep(ManualMLP):
    """The LR set in `on_train_batch_start` (a hand-written warm-up): replays read it as it is."""

    def on_train_batch_start(self, batch, batch_idx):
        for group in self.optimizers().param_groups:
            group["lr"] = 1e-2 * min(1.0, (self.global_step + 1) / 20)


@pytest.mark.parametrize(
    "cls", [ZeroGradAfterStep, WarmupBeforeStep], ids=["zero-grad-after", "lr-warmup-hook"]
)
def test_manual_step_orders_and_lr_hooks_are_captured_bitwise_their_baseline(cls):
    base, run, cb, base_rec, run_rec = manual_pair(cls, steps=24)
    s = cb.summary()
    assert s["captured"] and s["captures"] == 1 and s["reason"] is None, s
    assert emu.FakeGraph.replays >= 24 - 4
    assert_same(base, run)
    assert_same_state(base_rec, run_rec)
    assert all(p.grad is None for p in run[0].parameters()) == (cls is ZeroGradAfterStep)


class GlobalStepAfterStep(ByHand):
    """`global_step` read after `opt.step()`: under manual optimization it has moved on by then."""

    def training_step(self, batch, batch_idx):
        opt = self.optimizers()
        loss = super().training_step(batch, batch_idx)
        opt.zero_grad()
        self.manual_backward(loss)
        opt.step()
        if self.global_step % 5 == 0:
            with torch.no_grad():
                self.head.weight.mul_(0.5)
        self.log("gs", float(self.trainer.global_step))
        return loss


def test_step_counters_read_in_a_manual_step_train_eagerly_naming_the_line():
    assert_eager_like_plain(
        GlobalStepAfterStep, r"reads the step counters at .*`if self.global_step % 5 == 0:`", steps=20
    )
