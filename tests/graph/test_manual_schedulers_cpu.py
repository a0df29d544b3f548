"""LR schedulers that a manual-optimization step steps itself, on the CPU graph emulator.

Lightning leaves a manual step's schedulers to the step (``self.lr_schedulers().step()``, its
manual-optimization docs). The capture records each scheduler call among the step's log calls and
every replay steps the schedulers again in that order (l2lightning.graph.scheduler_steps): per step, the
learning rates, the schedulers' counters and last LRs, what the step logs before and after stepping
them, the parameters and the optimizers' state are bit for bit the baseline's. Schedules a replay
cannot repeat (stepped with a metric, before the optimizer's step, or moving a baked momentum) train
eagerly with one warning naming the cause, bit for bit plain Lightning.
"""

from __future__ import annotations

import pytest
import torch
from lightning.pytorch import Callback
from torch.optim import lr_scheduler

from tests import graph_emulator as emu
from tests.baselines import (  # noqa: F401 -- the fixture records each callback fit's switch step
    baseline_of,
    capturable_from_of_the_last_callback_fit,
)
from tests.graph.test_manual_optimization_cpu import (
    ByHand,
    ManualMLP,
    ManualTwoOptimizers,
    OptimizerStates,
    SavesAtBatch,
    assert_eager_like_plain,
    assert_same_optimizer_states,
    gan_fit,
)
from tests.idiom_modules import ManualGANScheduled
from tests.lightning_models import quiet_trainer, regression_loader
from tests.replay_helpers import assert_same, callback, fit

pytestmark = pytest.mark.usefixtures("emulated_cuda_graphs")


class ScheduleStates(Callback):
    """After every batch: each param group's learning rate, and each scheduler's counter and last LRs."""

    def __init__(self):
        self.lrs, self.schedulers = [], []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.lrs.append([g["lr"] for opt in trainer.optimizers for g in opt.param_groups])
        self.schedulers.append(
            [(c.scheduler.last_epoch, list(c.scheduler.get_last_lr())) for c in trainer.lr_scheduler_configs]
        )


class ManualScheduled(ManualMLP):
    """A per-step StepLR the step itself steps, logging the schedule's LR before and after stepping it."""

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=self.lr, foreach=True)
        return [opt], [lr_scheduler.StepLR(opt, 5, 0.5)]

    def training_step(self, batch, batch_idx):
        out = super().training_step(batch, batch_idx)
        self.log("lr_before", self.lr_schedulers().get_last_lr()[0])
        self.lr_schedulers().step()
        self.log("lr_after", self.lr_schedulers().get_last_lr()[0])
        return out


class DocsSchedulers(ByHand):
    """Lightning's manual-optimization docs: SGD with momentum, one scheduler stepped every N batches and
    one on the epoch's last batch (`if self.trainer.is_last_batch:`)."""

    def configure_optimizers(self):
        opt = torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9)
        return [opt], [lr_scheduler.StepLR(opt, 1, 0.8), lr_scheduler.CosineAnnealingLR(opt, T_max=4)]

    def training_step(self, batch, batch_idx):
        opt = self.optimizers()
        loss = super().training_step(batch, batch_idx)
        opt.zero_grad()
        self.manual_backward(loss)
        opt.step()
        every_n, every_epoch = self.lr_schedulers()
        if (batch_idx + 1) % 4 == 0:
            every_n.step()
        if self.trainer.is_last_batch:
            every_epoch.step()


class TwoOptimizersScheduled(ManualTwoOptimizers):
    """A StepLR on the first of two optimizers, stepped after both."""

    def configure_optimizers(self):
        optimizers = super().configure_optimizers()
        return optimizers, [lr_scheduler.StepLR(optimizers[0], 5, 0.5)]

    def training_step(self, batch, batch_idx):
        super().training_step(batch, batch_idx)
        self.lr_schedulers().step()


def scheduled_pair(cls, fit_one, optimizers=1, **kwargs):
    """`fit_one(cls, callbacks, **kwargs)` with the callback, then its baseline; both recorded."""
    run_states, base_states = OptimizerStates(), OptimizerStates()
    run_schedules, base_schedules = ScheduleStates(), ScheduleStates()
    cb = callback(check_share=1.0)
    run = fit_one(cls, [cb, run_states, run_schedules], **kwargs)
    base = fit_one(baseline_of(cls), [base_states, base_schedules], **kwargs)
    base = tuple(base)  # a deferred baseline fit runs now
    assert_same(base, run)
    assert_same_optimizer_states(base_states, run_states, optimizers=optimizers)
    assert run_schedules.lrs == base_schedules.lrs
    assert run_schedules.schedulers == base_schedules.schedulers
    return run, cb, run_schedules


def one_optimizer_fit(cls, callbacks, steps=30, **kwargs):
    return tuple(fit(cls, callbacks, steps=steps, **kwargs))


def two_optimizer_fit(cls, callbacks, batches=24):
    return tuple(fit(cls, callbacks, steps=2 * batches))


def test_a_scheduler_stepped_in_the_step_is_stepped_after_each_replay_bitwise_its_baseline():
    run, cb, schedules = scheduled_pair(ManualScheduled, one_optimizer_fit)
    s = cb.summary()
    assert s["captured"] and s["captures"] == 1 and s["fallback_steps"] == 0 and s["reason"] is None, s
    assert emu.FakeGraph.replays >= 30 - 4
    assert s["replay_check"]["checks"] >= 3 and s["replay_check"]["mismatches"] == 0, s
    # the schedule moved through the replays: six halvings in 30 steps, one StepLR count per step
    assert schedules.schedulers[-1][0][0] == 30 and schedules.lrs[-1] == [1e-2 * 0.5**6]
    # each replay's logs saw the schedule before and after the step moved it, as the eager step's do
    logged = run[1].logged
    assert [float(x["lr_after"]) for x in logged[:-1]] == [float(x["lr_before"]) for x in logged[1:]]
    assert len({float(x["lr_after"]) for x in logged}) == 7
    # given back at the fit's end
    assert "step" not in vars(run[2].lr_scheduler_configs[0].scheduler)


def test_lightning_docs_schedulers_every_n_batches_and_at_the_epochs_end_bitwise_their_baseline():
    run, cb, schedules = scheduled_pair(DocsSchedulers, one_optimizer_fit, steps=40, n=64)
    s = cb.summary()
    assert s["captured"] and s["captures"] == 1 and s["reason"] is None, s
    assert s["replay_check"]["mismatches"] == 0, s
    # the steps that step a scheduler take another branch and run eagerly; the others replay
    assert 0 < s["fallback_steps"] < 40 and emu.FakeGraph.replays >= 15, s
    every_n, every_epoch = schedules.schedulers[-1]
    assert every_n[0] == 10 and every_epoch[0] == 5  # 40 batches: every 4th, and 5 epochs of 8


def test_two_optimizers_one_of_them_scheduled_bitwise_their_baseline():
    run, cb, schedules = scheduled_pair(TwoOptimizersScheduled, two_optimizer_fit, optimizers=2)
    s = cb.summary()
    assert s["captured"] and s["captures"] == 1 and s["fallback_steps"] == 0 and s["reason"] is None, s
    assert schedules.lrs[-1][0] == 1e-2 * 0.5**4 and schedules.lrs[-1][1] == 1e-2  # 24 batches


def test_the_basic_gan_with_a_scheduler_per_optimizer_bitwise_its_baseline():
    run, cb, schedules = scheduled_pair(ManualGANScheduled, gan_fit, optimizers=2)
    s = cb.summary()
    assert s["captured"] and s["captures"] == 1 and s["fallback_steps"] == 0 and s["reason"] is None, s
    assert s["replay_check"]["checks"] >= 3 and s["replay_check"]["mismatches"] == 0, s
    assert [last for _, (last, _) in zip(range(2), schedules.schedulers[-1])] == [16, 16]


class PlateauInTheStep(ManualMLP):
    """ReduceLROnPlateau stepped in the step with its loss (it reads the metric on the host)."""

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=self.lr, foreach=True)
        return [opt], [lr_scheduler.ReduceLROnPlateau(opt, patience=0)]

    def __init__(self, **kwargs):
        super().__init__(returns=True, **kwargs)

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        self.lr_schedulers().step(loss.detach())
        return loss


class SchedulerBeforeTheStep(ManualScheduled):
    """The scheduler stepped before the optimizer's step (the step's update reads the moved LR)."""

    def training_step(self, batch, batch_idx):
        self.lr_schedulers().step()
        return ManualMLP.training_step(self, batch, batch_idx)


class OneCycleMomentum(ManualMLP):
    """OneCycleLR with its default `cycle_momentum=True` on AdamW, stepped in the step: it moves the betas."""

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=self.lr, foreach=True)
        return [opt], [lr_scheduler.OneCycleLR(opt, max_lr=1e-2, total_steps=100)]

    def training_step(self, batch, batch_idx):
        super().training_step(batch, batch_idx)
        self.lr_schedulers().step()


@pytest.mark.parametrize(
    ("cls", "match"),
    [
        (
            PlateauInTheStep,
            r"steps its LR scheduler ReduceLROnPlateau with arguments \(`step\(<Tensor>\)`\).*on_train_epoch_end",
        ),
        (SchedulerBeforeTheStep, r"steps its LR scheduler StepLR before its optimizer's step"),
        (
            OneCycleMomentum,
            r"param group 0's `betas`\) through its LR scheduler \(OneCycleLR, stepped in the step\).*"
            r"cycle_momentum=False",
        ),
    ],
    ids=["plateau-metric", "before-the-optimizer", "cycled-momentum"],
)
@pytest.mark.filterwarnings("ignore:Detected call of `lr_scheduler.step\\(\\)` before")
def test_what_a_replay_cannot_repeat_of_a_schedule_trains_eagerly_naming_it(cls, match):
    cb = assert_eager_like_plain(cls, match, steps=12)
    assert cb.summary()["capturable_from_step"] is None  # refused at a warm-up step: plain all along
    assert cb.summary()["captures"] == 0


class PlateauAtTheEpochsEnd(ManualMLP):
    """Lightning's docs: ReduceLROnPlateau stepped in `on_train_epoch_end` with a logged metric."""

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=self.lr, foreach=True)
        return [opt], [lr_scheduler.ReduceLROnPlateau(opt, patience=0, factor=0.5)]

    def on_train_epoch_end(self):
        self.lr_schedulers().step(self.trainer.current_epoch)  # never better: halved every epoch


def test_a_plateau_schedule_stepped_at_the_epochs_end_is_captured_bitwise_its_baseline():
    run, cb, schedules = scheduled_pair(PlateauAtTheEpochsEnd, one_optimizer_fit, steps=40, n=64)
    s = cb.summary()
    assert s["captured"] and s["reason"] is None, s
    assert schedules.lrs[-1][0] < 1e-2  # the plateau halved it between epochs, replays read the new LR


def test_a_checkpoint_holds_the_schedulers_state_as_plain_lightning_saves_it_and_resumes(tmp_path):
    cb = callback()
    fit(ManualScheduled, [cb, SavesAtBatch(tmp_path / "run.ckpt", batch=20)], steps=24)
    assert cb.summary()["captured"] and cb.summary()["capture_step"] < 20, cb.summary()
    fit(ManualScheduled, [SavesAtBatch(tmp_path / "plain.ckpt", batch=20)], steps=24)
    saved, plain = (
        torch.load(tmp_path / f, weights_only=False)["lr_schedulers"] for f in ("run.ckpt", "plain.ckpt")
    )
    assert saved == plain and "step" not in saved[0]
    # resumed from it with the callback: the schedule goes on from the saved count
    model = ManualScheduled(width=32, depth=3)
    trainer = quiet_trainer(accelerator="cpu", max_steps=30, callbacks=[callback()])
    trainer.fit(model, regression_loader(n=240, width=32), ckpt_path=tmp_path / "run.ckpt")
    scheduler = trainer.lr_scheduler_configs[0].scheduler
    assert scheduler.last_epoch == 30 and "step" not in vars(scheduler)
