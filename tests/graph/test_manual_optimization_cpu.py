"""Manual optimization (``automatic_optimization = False``) on the CPU graph emulator.

The whole ``training_step`` is the captured step (l2lightning.graph.manual_step). One optimizer with
``self.optimizers()``, ``zero_grad``, ``manual_backward`` and ``step`` is captured and bit for bit
its baseline (per-step losses and logs, parameters, the optimizer's state, the loop's progress:
``global_step`` is the manual loop's optimizer-step count, which replays move on too). So are two
optimizers stepped in one step (Lightning's basic GAN, ``toggle_optimizer`` included: both updates in
the one graph, ``global_step`` two per batch, ``requires_grad`` after every step as in plain
Lightning). LR schedulers the step steps are in tests/graph/test_manual_schedulers_cpu.py. What is not
captured (hooks inside the step; a parameter two optimizers step; hyperparameters the step writes)
trains eagerly with one warning naming the cause, bit for bit plain Lightning, and never raises.

Here the CPU is the device, so the tutorial GAN's ``torch.randn`` without a device draws on the device
and is captured; on a GPU that draw is on the host and the fit trains eagerly, naming the line and
``device=self.device`` (the tracer's part is checked here, the whole fit in
tests/gpu/test_manual_optimization_gpu.py).
"""

from __future__ import annotations

import pytest
import torch
from lightning.pytorch import Callback, seed_everything

from l2lightning import L2GraphCallback
from l2lightning.graph.optim import installed_capturable
from tests import graph_emulator as emu
from tests.baselines import (  # noqa: F401 -- the fixture records each callback fit's switch step
    baseline_of,
    capturable_from_of_the_last_callback_fit,
)
from tests.idiom_modules import IDIOMS, ManualGAN, ManualGANDeviceNoise
from tests.lightning_models import TinyMLP, quiet_trainer
from tests.replay_helpers import Recorder, assert_same, callback, fit

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


class ManualTwoOptimizers(ByHand):
    """Two optimizers stepped one after the other (the GAN's shape on the MLP): AdamW on the layers,
    SGD with momentum on the head."""

    def configure_optimizers(self):
        return [
            torch.optim.AdamW(self.net.parameters(), lr=self.lr, foreach=True),
            torch.optim.SGD(self.head.parameters(), lr=self.lr, momentum=0.9),
        ]

    def training_step(self, batch, batch_idx):
        opt_a, opt_b = self.optimizers()
        loss = super().training_step(batch, batch_idx)
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


# --------------------------------------------------------------------------- several optimizers
class OptimizerStates(Callback):
    """After every batch: every optimizer's state tensors (keyed by optimizer, parameter name and
    entry), each parameter's `requires_grad`, what `toggle_optimizer` leaves on the module, and
    `global_step`."""

    def __init__(self):
        self.states, self.requires_grad, self.toggle_state, self.global_steps = [], [], [], []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        names = {id(p): n for n, p in pl_module.named_parameters()}
        self.states.append(
            {
                (i, names[id(p)], key): value.detach().clone()
                for i, opt in enumerate(trainer.optimizers)
                for p, state in opt.state.items()
                for key, value in state.items()
                if isinstance(value, torch.Tensor)
            }
        )
        self.requires_grad.append({n: p.requires_grad for n, p in pl_module.named_parameters()})
        self.toggle_state.append(dict(getattr(pl_module, "_param_requires_grad_state", {})))
        self.global_steps.append(trainer.global_step)


def assert_same_optimizer_states(a, b, optimizers=2):
    assert a.global_steps == b.global_steps
    assert a.requires_grad == b.requires_grad
    assert a.toggle_state == b.toggle_state
    assert len(a.states) == len(b.states) > 0
    for i, (x, y) in enumerate(zip(a.states, b.states)):
        assert x.keys() == y.keys(), f"optimizer state entries differ after step {i}"
        assert {k[0] for k in x} == set(range(optimizers)), f"not every optimizer has state after step {i}"
        for k in x:
            assert torch.equal(x[k], y[k]), f"optimizer state {k} differs after step {i}"


def two_optimizer_pair(fit_one, cls, callback_kwargs=None, **kwargs):
    """`fit_one(cls, callbacks, **kwargs)` with the callback, then its baseline (which switches where
    the callback fit switched); each fit's OptimizerStates recorder last."""
    run_states, base_states = OptimizerStates(), OptimizerStates()
    cb = callback(check_share=1.0, **(callback_kwargs or {}))
    run = fit_one(cls, [cb, run_states], **kwargs)
    base = fit_one(baseline_of(cls), [base_states], **kwargs)
    return base, run, cb, base_states, run_states


def mlp_fit(cls, callbacks, batches=24, **kwargs):
    # Lightning's max_steps counts optimizer steps: two per batch here
    return tuple(fit(cls, callbacks, steps=2 * batches, **kwargs))


def test_two_optimizers_in_one_manual_step_are_captured_bitwise_their_baseline():
    base, run, cb, base_states, run_states = two_optimizer_pair(mlp_fit, ManualTwoOptimizers)
    s = cb.summary()
    assert s["captured"] and s["captures"] == 1 and s["fallback_steps"] == 0 and s["reason"] is None, s
    assert s["capture_step"] == s["capturable_from_step"] == 2 * 3  # the fourth batch, two steps a batch
    assert emu.FakeGraph.replays >= 24 - 4
    assert s["replay_check"]["checks"] >= 3 and s["replay_check"]["mismatches"] == 0, s
    assert run[2].global_step == base[2].global_step == 48
    assert run_states.global_steps == [2 * (i + 1) for i in range(24)]  # two optimizer steps per batch
    assert_same(base, run)
    assert_same_optimizer_states(base_states, run_states)
    # the replays did move both optimizers on (a graph holding one of the two updates would not)
    adam, sgd = run[2].optimizers
    assert int(adam.state[run[0].net[0][1].weight]["step"]) == 24
    assert sgd.state[run[0].head.weight]["momentum_buffer"].abs().sum() > 0
    # given back at the fit's end as configured: no step wrapper, AdamW's own `capturable`
    assert all(installed_capturable(o) is None and "step" not in vars(o) for o in (adam, sgd))
    assert adam.param_groups[0]["capturable"] is False


class OneMadeCapturable(ManualTwoOptimizers):
    """The user makes the first optimizer capturable in `configure_optimizers`; the second is the callback's."""

    def configure_optimizers(self):
        from l2lightning import make_capturable

        adamw, sgd = super().configure_optimizers()
        make_capturable(adamw, torch.device("cpu"))
        return [adamw, sgd]


def test_an_optimizer_the_user_made_capturable_stays_theirs_beside_the_callbacks():
    base, run, cb, base_states, run_states = two_optimizer_pair(mlp_fit, OneMadeCapturable)
    s = cb.summary()
    assert s["captured"] and s["captures"] == 1 and s["reason"] is None, s
    assert_same(base, run)
    assert_same_optimizer_states(base_states, run_states)
    adamw, sgd = run[2].optimizers
    assert installed_capturable(adamw) is not None and adamw.param_groups[0]["capturable"] is True
    assert installed_capturable(sgd) is None and "step" not in vars(sgd)


class FrozenLayerGAN(ManualGANDeviceNoise):
    """The GAN with the discriminator's first layer frozen: `toggle_optimizer` saves its
    `requires_grad=False` and `untoggle_optimizer` puts it back every step."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.discriminator.model[0].requires_grad_(False)


class WarmedUpGAN(ManualGANDeviceNoise):
    """Both learning rates warmed up before each step: the Adams read them from device tensors, which
    each replay's LR fill must reach in both optimizers."""

    def on_train_batch_start(self, batch, batch_idx):
        for opt in self.optimizers():
            for group in opt.param_groups:
                group["lr"] = self.hparams.lr * min(1.0, (batch_idx + 1) / 12)


def gan_fit(cls, callbacks, batches=16, **model_kwargs):
    seed_everything(0)
    model = cls(**model_kwargs)
    rec = Recorder()
    trainer = quiet_trainer(accelerator="cpu", max_steps=2 * batches, callbacks=[rec, *callbacks])
    trainer.fit(model, IDIOMS["manual_gan"].make_loader())
    return model, rec, trainer


@pytest.mark.parametrize(
    "cls",
    [ManualGAN, ManualGANDeviceNoise, FrozenLayerGAN, WarmedUpGAN],
    ids=["tutorial", "device-noise", "frozen-layer", "lr-warmup-hook"],
)
def test_the_basic_gan_is_one_graph_bitwise_its_baseline(cls):
    """Lightning's basic GAN: two Adams, each toggled, stepped, zeroed and untoggled in the one step."""
    base, run, cb, base_states, run_states = two_optimizer_pair(gan_fit, cls)
    s = cb.summary()
    assert s["captured"] and s["captures"] == 1 and s["fallback_steps"] == 0 and s["reason"] is None, s
    assert emu.FakeGraph.replays >= 16 - 4
    assert s["replay_check"]["checks"] >= 3 and s["replay_check"]["mismatches"] == 0, s
    assert run[2].global_step == base[2].global_step == 32
    assert all(x is None for x in run[1].losses)  # the step returns nothing
    # g_loss and d_loss as every step logged them (re-issued after each replay)
    assert all({"g_loss", "d_loss"} <= set(logged) for logged in run[1].logged)
    assert len({float(logged["d_loss"]) for logged in run[1].logged}) == 16
    assert_same(base, run)
    assert_same_optimizer_states(base_states, run_states)
    # toggling: between steps every parameter is as untoggle_optimizer left it, as in plain Lightning
    frozen = {n for n, p in cls().named_parameters() if not p.requires_grad}
    assert frozen == (
        {"discriminator.model.0.weight", "discriminator.model.0.bias"} if cls is FrozenLayerGAN else set()
    )
    assert all({n for n, g in flags.items() if not g} == frozen for flags in run_states.requires_grad)
    assert all(state == {} for state in run_states.toggle_state)


class SharedParameter(ManualTwoOptimizers):
    """The head in both optimizers."""

    def configure_optimizers(self):
        return [
            torch.optim.AdamW(self.parameters(), lr=self.lr, foreach=True),
            torch.optim.SGD(self.head.parameters(), lr=self.lr),
        ]


class HeadLRInTheStep(ManualTwoOptimizers):
    """The second optimizer's LR warmed up inside the step (after its update)."""

    def training_step(self, batch, batch_idx):
        out = super().training_step(batch, batch_idx)
        self.optimizers()[1].param_groups[0]["lr"] = 1e-2 * min(1.0, (batch_idx + 1) / 20)
        return out


class DecayingAdagradHead(ManualTwoOptimizers):
    """A second optimizer with no capturable step (Adagrad whose LR decays reads its step count)."""

    def configure_optimizers(self):
        return [
            torch.optim.AdamW(self.net.parameters(), lr=self.lr, foreach=True),
            torch.optim.Adagrad(self.head.parameters(), lr=0.05, lr_decay=0.01),
        ]


@pytest.mark.parametrize(
    ("cls", "match"),
    [
        (SharedParameter, r"2 optimizers \(AdamW, SGD\) that both step the parameter `head.weight`"),
        (
            HeadLRInTheStep,
            r"changes the optimizer's hyperparameters \(param group 0's `lr` \(optimizer 1, SGD\)\)",
        ),
    ],
    ids=["shared-parameter", "lr-in-step"],
)
def test_what_two_optimizers_cannot_capture_trains_eagerly_naming_it(cls, match):
    cb = assert_eager_like_plain(cls, match, steps=24)
    assert cb.summary()["capturable_from_step"] is None  # never switched: plain all along


def test_a_second_optimizer_that_cannot_be_captured_trains_both_as_configured():
    seen = []

    class Wrapped(Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            seen.append(
                [installed_capturable(o) is not None or "step" in vars(o) for o in trainer.optimizers]
            )

    plain = fit(DecayingAdagradHead, steps=12)
    cb = callback()
    with pytest.warns(UserWarning, match=r"Adagrad with `lr_decay` != 0 .*; training eagerly"):
        run = fit(DecayingAdagradHead, [Wrapped(), cb], steps=12)
    assert not cb.summary()["captured"] and cb.summary()["capturable_from_step"] is None
    assert seen == [[False, False]] * 6  # the AdamW's step wrapper went again with the refusal
    assert_same(plain, run)


class RetunesTheHead(Callback):
    """Between steps: the head's SGD momentum changed (baked into the graph), later its state reset."""

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        sgd = trainer.optimizers[1]
        if batch_idx == 8:
            sgd.param_groups[0]["momentum"] = 0.5
        if batch_idx == 14:
            sgd.state.clear()


def test_the_second_optimizers_changes_are_named_and_captured_again_bitwise_its_baseline():
    run_states, base_states = OptimizerStates(), OptimizerStates()
    cb = callback(check_share=1.0)
    with pytest.warns(UserWarning) as caught:
        run = mlp_fit(ManualTwoOptimizers, [RetunesTheHead(), cb, run_states])
    base = mlp_fit(baseline_of(ManualTwoOptimizers), [RetunesTheHead(), base_states])
    messages = " | ".join(str(w.message) for w in caught)
    assert "group 0 `momentum` 0.9 -> 0.5 (optimizer 1, SGD)" in messages
    assert "the optimizer's state has 0 entries, the graph updates 2 (optimizer 1, SGD)" in messages
    s = cb.summary()
    assert s["captured"] and s["captures"] == 3 and s["reason"] is None, s
    assert_same(base, run)
    assert_same_optimizer_states(base_states, run_states)


class SavesAtBatch(Callback):
    def __init__(self, path, batch=10):
        self.path, self.batch = path, batch

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if batch_idx == self.batch:
            trainer.save_checkpoint(self.path)


def test_a_checkpoint_saves_both_optimizers_as_plain_lightning_does(tmp_path):
    cb = callback()
    gan_fit(ManualGANDeviceNoise, [cb, SavesAtBatch(tmp_path / "run.ckpt")])
    assert cb.summary()["captured"] and cb.summary()["capture_step"] < 2 * 10, cb.summary()
    gan_fit(ManualGANDeviceNoise, [SavesAtBatch(tmp_path / "plain.ckpt")])
    run, plain = (
        torch.load(tmp_path / f, weights_only=False)["optimizer_states"] for f in ("run.ckpt", "plain.ckpt")
    )
    assert len(run) == len(plain) == 2
    for i, (a, b) in enumerate(zip(run, plain)):
        assert a["param_groups"] == b["param_groups"], f"optimizer {i}"  # `capturable` as configured
        assert all(s["step"].device.type == "cpu" for s in a["state"].values())


def test_a_draw_on_the_host_is_named_with_its_line_and_the_device_fix():
    """Off the CPU (``meta`` stands for the device, as in tests/guards/test_step_trace.py), a draw from torch's
    global CPU generator is noted with the user's line, and the refusal of the Python state it changes
    names that line and `device=self.device`; draws on the device or from a generator of the step's own
    are not noted."""
    from l2lightning.guards import python_state
    from l2lightning.guards.step_trace import StepTracer

    tracer = StepTracer("meta")
    own = torch.Generator().manual_seed(0)
    before = python_state.snapshot([], device_type="meta")
    with tracer:
        z = torch.randn(4, 3)  # the tutorial's draw
        z.to("meta")
        torch.randn(4, 3, device="meta")
        torch.randn(4, 3, generator=own)
    changed = python_state.changed(before, python_state.snapshot([], device_type="meta"))
    assert changed == [python_state.TORCH_CPU_RANDOM_LABEL]
    assert [(op, line) for op, (_, line) in tracer.trace.host_draws] == [
        ("aten::randn", _line_of("the tutorial's draw"))
    ]
    message = L2GraphCallback()._warmup.python_problem(changed, tracer.trace)
    assert "draws random numbers on the host, from torch's global CPU generator (`randn` at " in message
    assert "z = torch.randn(4, 3)" in message
    assert "`torch.randn(..., device=self.device)`" in message
    # on the CPU the generator is the device's: the captured ops draw from it themselves
    on_cpu = StepTracer("cpu")
    with on_cpu:
        torch.randn(4, 3)
    assert on_cpu.trace.host_draws == []


def _line_of(marker: str) -> int:
    import inspect

    lines, start = inspect.getsourcelines(test_a_draw_on_the_host_is_named_with_its_line_and_the_device_fix)
    return start + next(i for i, line in enumerate(lines) if marker in line)


def test_capturable_optimizers_reject_bad_arguments_naming_them():
    from l2lightning.graph.joined_optimizers import CapturableOptimizers

    with pytest.raises(ValueError, match=r"`members` must hold at least one"):
        CapturableOptimizers([], [])
    with pytest.raises(ValueError, match=r"`owned` must have one entry per member: 1 members, 0 entries"):
        CapturableOptimizers([object()], [])


# --------------------------------------------------------------------------- backward more than once
class TwoBackwards(ByHand):
    """A main and an auxiliary loss backpropagated one after the other (their gradients add), then
    clipped and stepped: the second backward adds to the first's gradients by design."""

    def training_step(self, batch, batch_idx):
        opt = self.optimizers()
        x, y = batch
        opt.zero_grad()
        h = self.net(x)
        main = (self.head(h).squeeze(-1) - y).square().mean()
        self.manual_backward(main, retain_graph=True)
        self.manual_backward(0.1 * h.square().mean())
        self.clip_gradients(opt, gradient_clip_val=1.0, gradient_clip_algorithm="norm")
        opt.step()
        self.log("main", main)


class AccumulatesByHand(ByHand):
    """Lightning's docs' manual accumulation: `manual_backward` every batch, step and zero every 2nd:
    each step's first backward adds to the last step's gradients, which a replay would drop."""

    def training_step(self, batch, batch_idx):
        opt = self.optimizers()
        loss = super().training_step(batch, batch_idx) / 2
        self.manual_backward(loss)
        if (batch_idx + 1) % 2 == 0:
            opt.step()
            opt.zero_grad()


def test_two_backwards_in_one_manual_step_are_captured_bitwise_the_baseline():
    """Refused before, naming gradients "still holding an earlier step's values": the check of what a
    step's backward starts from now looks at the step's first backward only."""
    base, run, cb, base_rec, run_rec = manual_pair(TwoBackwards)
    s = cb.summary()
    assert s["captured"] and s["captures"] == 1 and s["fallback_steps"] == 0 and s["reason"] is None, s
    assert_same(base, run)
    assert_same_state(base_rec, run_rec)


def test_gradients_carried_from_the_last_manual_step_train_eagerly_naming_them():
    assert_eager_like_plain(
        AccumulatesByHand,
        r"backward adds to gradients an earlier step left",
        steps=16,
    )


class CriticThenGenerator(ByHand):
    """WGAN-style: the critic (`net`) stepped every batch, the generator (`head`) every other one, each
    optimizer zeroed just before its own backward: the head's gradients from its last step are still
    there when the critic's backward runs, which does not reach them."""

    def configure_optimizers(self):
        return [
            torch.optim.Adam(self.head.parameters(), lr=1e-3, betas=(0.0, 0.9)),
            torch.optim.Adam(self.net.parameters(), lr=1e-3, betas=(0.0, 0.9)),
        ]

    def training_step(self, batch, batch_idx):
        opt_head, opt_net = self.optimizers()
        x, y = batch
        critic = self.net(x).square().mean()
        opt_net.zero_grad()
        self.manual_backward(critic)
        opt_net.step()
        if batch_idx % 2 == 0:
            gen = (self.head(self.net(x).detach()).squeeze(-1) - y).square().mean()
            opt_head.zero_grad()
            self.manual_backward(gen)
            opt_head.step()


def test_gradients_another_optimizer_left_that_the_backward_does_not_reach_are_no_stale_sum():
    """Refused before as gradients 'still holding an earlier step's values' (any nonzero gradient when a
    backward started); only gradients the backward adds to count now."""
    run_states, base_states = OptimizerStates(), OptimizerStates()
    cb = callback(check_share=1.0)
    run = fit(CriticThenGenerator, [cb, run_states], steps=36)
    base = tuple(fit(baseline_of(CriticThenGenerator), [base_states], steps=36))
    s = cb.summary()
    assert s["captured"] and s["reason"] is None and s["replay_check"]["mismatches"] == 0, s
    assert_same(base, run)
    assert_same_optimizer_states(base_states, run_states)
