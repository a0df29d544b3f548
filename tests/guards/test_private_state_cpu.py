"""The user's private attributes and the user's optimizer's own Python state, on the CPU graph emulator.

A replay runs no Python. The callback snapshots the Python state a step changes around each traced
warm-up step and the capture (l2lightning.guards.python_state): a counter it refuses by name, a list appended
to once per step it re-appends after each replay, a tensor rebound to the step's own result it
carries. Private attributes (``self._n``) were left out, so the same code with an underscore was
captured and replayed with its Python frozen, silently; so was the Python of an optimizer of the
user's own class (``class MyAdamW(torch.optim.AdamW)`` counting its steps), which runs inside the
captured ``optimizer.step`` but around the closure the snapshots surrounded. Every test here failed
before: a refused step now trains bit for bit as plain Lightning, naming the attribute; a replayed
one is bit for bit its baseline. Lightning's and torch's own private state, which their code sets
inside every step (``self.log``, ``toggle_optimizer``, a torchmetrics update, an LR scheduler marking
the optimizer's step), is theirs, and leaves the step captured.
"""

from __future__ import annotations

import re

import pytest
import torch
import torchmetrics
from lightning.pytorch import Callback, LightningModule
from torch import nn

from l2lightning.guards import python_state
from tests import graph_emulator as emu
from tests.baselines import (  # noqa: F401 -- the fixture records each callback fit's switch step
    baseline_of,
    capturable_from_of_the_last_callback_fit,
)
from tests.graph.test_manual_optimization_cpu import ManualTwoOptimizers
from tests.lightning_models import TinyMLP
from tests.replay_helpers import assert_same, callback, fit

pytestmark = pytest.mark.usefixtures("emulated_cuda_graphs")

# the elements a step appends to a private module-level list (a global of this module the step reads)
_SEEN: list[torch.Tensor] = []


def refused_like_plain(cls, label, message="the step changes Python state", steps=20, callback_kwargs=None):
    """`cls`'s step is refused with a warning naming `label`, and the fit is bit for bit plain Lightning."""
    plain = fit(cls, steps=steps)
    cb = callback(**(callback_kwargs or {}))
    with pytest.warns(UserWarning, match=re.escape(message) + r"[^;]*" + re.escape(label)):
        run = fit(cls, [cb], steps=steps)
    assert not cb.summary()["captured"] and emu.FakeGraph.replays == 0, cb.summary()
    assert_same(plain, run)


def captured_like_baseline(cls, steps=90, captures=1, callbacks=()):
    """`cls`'s step is captured (`captures` times) and replayed, and the fit is bit for bit its baseline."""
    base = fit(baseline_of(cls), list(callbacks), steps=steps)
    cb = callback()
    run = fit(cls, [*callbacks, cb], steps=steps)
    summary = cb.summary()
    assert summary["captured"] and summary["captures"] == captures and summary["fallback_steps"] == 0, summary
    assert emu.FakeGraph.replays >= len(run[1].losses) - 4  # all but the warm-up and capture steps
    assert_same(base, run)
    return run


# --------------------------------------------------------------------------- private counters: refused
class CountsPrivately(TinyMLP):
    """`self._n += 1` in the step, an extra term in the loss from its 13th step on: replayed, the
    counter froze at the capture's value and the term never came."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self._n = 0

    def training_step(self, batch, batch_idx):
        self._n += 1
        loss = super().training_step(batch, batch_idx)
        return loss * 2 if self._n > 12 else loss


class CountingGate(nn.Module):
    """A residual branch switched on by the layer's own private call count."""

    def __init__(self, width):
        super().__init__()
        self.fc = nn.Linear(width, width)
        self._calls = 0

    def forward(self, x):
        if self.training:
            self._calls += 1
        return x + self.fc(x) if self._calls > 12 else x


class GatedByALayersCount(TinyMLP):
    def __init__(self, width=32, **kwargs):
        super().__init__(width=width, **kwargs)
        self.gate = CountingGate(width)

    def training_step(self, batch, batch_idx):
        x, y = batch
        pred = self.head(self.gate(self.net(x))).squeeze(-1)
        return (pred - y).square().mean()


class CountsInAPrivateDict(TinyMLP):
    """`self._stats["n"] += 1`, a branch on it after 12 steps."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self._stats = {"n": 0}

    def training_step(self, batch, batch_idx):
        self._stats["n"] += 1
        loss = super().training_step(batch, batch_idx)
        return loss * 2 if self._stats["n"] > 12 else loss


class CountingLoss:
    """A loss object of the user's that counts its calls in a private attribute."""

    def __init__(self):
        self._calls = 0

    def __call__(self, pred, target):
        self._calls += 1
        return (pred - target).square().mean() * (2.0 if self._calls > 12 else 1.0)


class HoldsALossPrivately(TinyMLP):
    """The loss object held under a private name (`self._loss`): neither it nor its counter were
    snapshot."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self._loss = CountingLoss()

    def training_step(self, batch, batch_idx):
        x, y = batch
        return self._loss(self.head(self.net(x)).squeeze(-1), y)


@pytest.mark.parametrize(
    "cls, label",
    [
        (CountsPrivately, "`self._n`"),
        (GatedByALayersCount, "`self.gate._calls`"),
        (CountsInAPrivateDict, "`self._stats`"),
        (HoldsALossPrivately, "`self._loss._calls`"),
    ],
)
def test_a_private_counter_the_step_changes_is_refused_by_name(cls, label):
    """Silent before: captured, the counter frozen, the loss left plain Lightning's at step 12."""
    refused_like_plain(cls, label)


# --------------------------------------------------------------------------- private outputs and carried state: replayed
class KeepsOutputsPrivately(TinyMLP):
    """`self._outputs.append(loss.detach())`, their mean logged at each epoch's end (Lightning's
    migration advice for `training_step_outputs`, under a private name)."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self._outputs = []

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        self._outputs.append(loss.detach())
        return loss

    def on_train_epoch_end(self):
        self.log("epoch_mean", torch.stack(self._outputs).mean())
        self.log("epoch_outputs", float(len(self._outputs)))
        self._outputs.clear()


class NormalisesByAPrivateRunningMean(TinyMLP):
    """`self._ema = 0.9 * self._ema + 0.1 * loss.detach()`: rebound to the step's own result, carried
    from replay to replay."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self._ema = torch.ones(())

    def training_step(self, batch, batch_idx):
        raw = super().training_step(batch, batch_idx)
        self._ema = 0.9 * self._ema + 0.1 * raw.detach()
        self.log("ema", self._ema)
        return raw / self._ema


def test_a_private_list_the_step_appends_to_gets_every_steps_element():
    """Wrong before: the list kept the warm-up steps' elements only, and the logged epoch mean was not
    the baseline's from the first epoch's end."""
    _, rec, _ = captured_like_baseline(KeepsOutputsPrivately)
    assert [float(v["epoch_outputs"]) for v in rec.logged if "epoch_outputs" in v][-1] == 30.0


def test_a_private_tensor_rebound_to_the_steps_result_is_carried():
    """Wrong before: the graph kept reading the capture's `_ema`; the sampled check caught it twice and
    the fit ended neither its baseline nor plain."""
    captured_like_baseline(NormalisesByAPrivateRunningMean)


class AppendsToAPrivateModuleList(TinyMLP):
    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        _SEEN.append(loss.detach())
        return loss


def test_a_private_module_level_list_the_step_appends_to_gets_every_steps_element():
    """Lost before: replays appended nothing to `_SEEN` (a private global of the step's module)."""
    _SEEN.clear()
    cb = callback()
    run = fit(AppendsToAPrivateModuleList, [cb], steps=30)
    got = list(_SEEN)
    _SEEN.clear()
    base = list(fit(baseline_of(AppendsToAPrivateModuleList), steps=30))
    expected = list(_SEEN)
    _SEEN.clear()
    assert cb.summary()["captured"] and cb.summary()["captures"] == 1, cb.summary()
    assert len(expected) == 30 and len(got) == 30
    assert all(torch.equal(a, b) for a, b in zip(expected, got))
    assert_same(base, run)


# --------------------------------------------------------------------------- the user's optimizer
class ShrinksEveryTenthStep(torch.optim.AdamW):
    """An AdamW of the user's whose step counts itself and shrinks the weights every tenth step."""

    def __init__(self, params, **kwargs):
        super().__init__(params, **kwargs)
        self.t = 0

    @torch.no_grad()
    def step(self, closure=None):
        loss = super().step(closure)
        self.t += 1
        if self.t % 10 == 0:
            for group in self.param_groups:
                for p in group["params"]:
                    p.mul_(0.9)
        return loss


class SteppedByItsOwnOptimizer(TinyMLP):
    def configure_optimizers(self):
        return ShrinksEveryTenthStep(self.parameters(), lr=self.lr, foreach=True)


class SteppedByHandWithItsOwnOptimizer(SteppedByItsOwnOptimizer):
    """The same optimizer under manual optimization: its step runs inside training_step."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.automatic_optimization = False

    def training_step(self, batch, batch_idx):
        opt = self.optimizers()
        loss = super().training_step(batch, batch_idx)
        opt.zero_grad()
        self.manual_backward(loss)
        opt.step()


@pytest.mark.parametrize("verify", ["sampled", False])
def test_an_optimizer_of_the_users_that_counts_its_steps_is_refused_by_name(verify):
    """Silent before, with or without the sampled check: the optimizer's Python ran at the capture only,
    its counter froze and the tenth step's shrink never came."""
    refused_like_plain(
        SteppedByItsOwnOptimizer,
        "`ShrinksEveryTenthStep.t`",
        message="the optimizer's step changes Python state",
        callback_kwargs={"verify": verify},
    )


def test_an_optimizer_of_the_users_that_counts_its_steps_under_manual_optimization_is_refused_by_name():
    refused_like_plain(
        SteppedByHandWithItsOwnOptimizer,
        "`ShrinksEveryTenthStep.t`",
        message="the optimizer's step changes Python state",
    )


class ShrinksBy(torch.optim.AdamW):
    """An AdamW of the user's whose step multiplies the weights by a number it holds (`self.shrink`),
    which a callback sets per epoch; it readies itself at its first step (`self._ready`), once."""

    def __init__(self, params, **kwargs):
        super().__init__(params, **kwargs)
        self.shrink = 1.0
        self._ready = False

    @torch.no_grad()
    def step(self, closure=None):
        loss = super().step(closure)
        self._ready = True
        for group in self.param_groups:
            for p in group["params"]:
                p.mul_(self.shrink)
        return loss


class SetsTheShrinkEachEpoch(Callback):
    def on_train_epoch_start(self, trainer, pl_module):
        trainer.optimizers[0].shrink = 1.0 - 0.01 * trainer.current_epoch


class ShrunkByItsOptimizer(TinyMLP):
    """Its optimizer's shrink, and a StepLR stepped per step (torch's scheduler marks every optimizer
    step in the optimizer's `_opt_called`: torch's own state, not the user's)."""

    def configure_optimizers(self):
        opt = ShrinksBy(self.parameters(), lr=self.lr, foreach=True)
        scheduler = torch.optim.lr_scheduler.StepLR(opt, 5, 0.5)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


def test_a_number_the_users_optimizer_reads_changed_between_steps_captures_the_step_again():
    """Silent before: the graph kept multiplying by the capture's `shrink` (the sampled check caught it
    at the epoch starts and ended the capture); now each change captures again, before the replay."""
    base = fit(baseline_of(ShrunkByItsOptimizer), [SetsTheShrinkEachEpoch()], steps=90)
    cb = callback()
    with pytest.warns(UserWarning, match=re.escape("Python numbers the step reads changed (shrink)")):
        run = fit(ShrunkByItsOptimizer, [SetsTheShrinkEachEpoch(), cb], steps=90)
    summary = cb.summary()
    assert summary["captured"] and summary["captures"] == 3 and summary["fallback_steps"] == 0, summary
    assert_same(base, run)


# --------------------------------------------------------------------------- Lightning's own private state: captured
class TogglesTwoOptimizersByHand(TinyMLP):
    """Manual optimization with Lightning's `toggle_optimizer` (which saves and restores every
    parameter's `requires_grad` in the module's private `_param_requires_grad_state` inside the step)
    and `self.log` (which sets the module's `_current_fx_name`), and losses of its own in a private list."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.automatic_optimization = False
        self._losses = []

    configure_optimizers = ManualTwoOptimizers.configure_optimizers

    def training_step(self, batch, batch_idx):
        opt_a, opt_b = self.optimizers()
        for opt in (opt_a, opt_b):
            self.toggle_optimizer(opt)
            loss = super().training_step(batch, batch_idx)
            opt.zero_grad()
            self.manual_backward(loss)
            opt.step()
            self.untoggle_optimizer(opt)
        self._losses.append(loss.detach())

    def on_train_epoch_end(self):
        self.log("epoch_mean", torch.stack(self._losses).mean())
        self._losses.clear()


class UpdatesAMetricInTheStep(TinyMLP):
    """A torchmetrics metric updated and logged in training_step (its private `_update_count`,
    `_forward_cache` and `_computed` move at every step: the metric binding's, not the user's), and the
    batch losses kept in a private list."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.train_mse = torchmetrics.MeanSquaredError()
        self._losses = []

    def training_step(self, batch, batch_idx):
        x, y = batch
        pred = self.head(self.net(x)).squeeze(-1)
        loss = (pred - y).square().mean()
        self.train_mse(pred.detach(), y)
        self.log("train/mse", self.train_mse, on_step=True, on_epoch=True)
        self._losses.append(loss.detach())
        return loss

    def on_train_epoch_end(self):
        self.log("epoch_mean", torch.stack(self._losses).mean())
        self._losses.clear()


@pytest.mark.parametrize("cls", [TogglesTwoOptimizersByHand, UpdatesAMetricInTheStep])
def test_lightnings_own_private_state_changed_in_the_step_leaves_it_captured(cls):
    """Wrong before (the private list kept the warm-up steps' losses); and what Lightning and
    torchmetrics set on the module and the metric inside the step is not refused as the user's."""
    captured_like_baseline(cls)


def test_the_library_bases_names_are_not_the_users_state():
    """What a fresh LightningModule, nn.Module, Callback or torch optimizer holds, and the private
    attributes of library classes, are left out; the user's private attributes are in."""
    model = CountsPrivately()
    mine = dict(python_state.own_attributes(model))
    assert "_n" in mine and "lr" in mine
    library = {
        "_parameters",
        "_modules",
        "_forward_hooks",
        "_current_fx_name",
        "_trainer",
        "_metric_attributes",
    }
    assert not library & set(mine)
    assert "_calls" in dict(python_state.own_attributes(CountingGate(4)))
    lstm = type("MyLSTM", (nn.LSTM,), {"__module__": __name__})(4, 4)  # a user's subclass of a torch layer
    assert "_flat_weights" not in dict(python_state.own_attributes(lstm))
    assert not any(n.startswith("_") for n, _ in python_state.own_attributes(nn.LSTM(4, 4)))
    opt = ShrinksBy(model.parameters(), lr=1e-3)
    assert sorted(dict(python_state.own_attributes(opt))) == ["_ready", "shrink"]
    assert python_state.optimizer_owners([opt, torch.optim.SGD(model.parameters(), lr=1.0)]) == [
        ("ShrinksBy", opt)
    ]
    assert not [n for n, _ in python_state.own_attributes(LightningModule()) if n.startswith("_")]
