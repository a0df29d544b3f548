"""Changes a hook makes mid-epoch that the checks before each replay missed, on the CPU graph emulator.

Each module here changes something its step depends on at global step 14, mid-epoch (30 batches per
epoch), where no sampled replay check runs (they run at replays 1, 2, 4, 8 and 16 of a capture: steps
4, 5, 7, 11 and 19), so only the checks before each replay can see it. Every test failed before: the
replays from step 14 ran the capture's code or values, silently, until the check at step 19. Now:

* the code the step's source was read through, rebound (a helper method on the instance or patched on
  its class, ``training_step`` itself): the fit goes on eagerly, naming it, bit for bit its baseline;
* Enum members in a branch or in a layer, a teacher module kept in a list or dict out of the module
  tree, an attribute that appears (``hasattr``), a log key built from an attribute, a frozen dataclass
  replaced and handed to a free function, a registry object's attribute, a function attribute, an
  environment variable: the step is captured again, bit for bit its baseline;
* an iterator the step advances (``next(self.counter)``): refused by name, bit for bit plain.
"""

from __future__ import annotations

import copy
import dataclasses
import enum
import itertools
import os
import re

import pytest
import torch
from torch import nn

from tests import graph_emulator as emu
from tests.baselines import (  # noqa: F401 -- the fixture records each callback fit's switch step
    baseline_of,
    capturable_from_of_the_last_callback_fit,
)
from tests.lightning_models import TinyMLP
from tests.replay_helpers import assert_same, callback, fit

pytestmark = pytest.mark.usefixtures("emulated_cuda_graphs")

SWITCH = 14  # mid-epoch: between the sampled checks at steps 11 and 19
STEPS = 40
N = 240  # 30 batches of 8 per epoch


def mse(pred, y):
    return (pred - y).square().mean()


class _Changes(TinyMLP):
    """TinyMLP whose `change()` runs once, at the start of global step SWITCH."""

    def on_train_batch_start(self, batch, batch_idx):
        if self.global_step == SWITCH:
            self.change()

    def change(self):
        raise NotImplementedError

    def predict(self, x):
        return self.head(self.net(x)).squeeze(-1)


# --------------------------------------------------------------------------- code rebound: eager from there
class HelperReboundOnInstance(_Changes):
    def compute_loss(self, pred, y):
        return mse(pred, y)

    def compute_loss_scaled(self, pred, y):
        return 0.25 * mse(pred, y)

    def change(self):
        self.compute_loss = self.compute_loss_scaled

    def training_step(self, batch, batch_idx):
        x, y = batch
        return self.compute_loss(self.predict(x), y)


class HelperPatchedOnClass(HelperReboundOnInstance):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        # each fit starts unpatched (the baseline's fit and the callback's share the class)
        type(self).compute_loss = HelperReboundOnInstance.compute_loss

    def change(self):
        type(self).compute_loss = HelperReboundOnInstance.compute_loss_scaled


class TrainingStepRebound(_Changes):
    def finetune_step(self, batch, batch_idx):
        x, y = batch
        pred = self.predict(x)
        return mse(pred, y) + 0.1 * pred.square().mean()

    def change(self):
        self.training_step = self.finetune_step


@pytest.mark.parametrize(
    "cls, where",
    [
        (HelperReboundOnInstance, "`self.compute_loss`"),
        (HelperPatchedOnClass, "`HelperPatchedOnClass.compute_loss`"),
        (TrainingStepRebound, "`self.training_step`"),
    ],
)
def test_code_the_step_was_read_from_rebound_mid_epoch_runs_eagerly_from_there(cls, where):
    base = fit(baseline_of(cls), steps=STEPS, n=N)
    cb = callback()
    with pytest.warns(
        UserWarning,
        match=r"the code the step runs was rebound since the training start \(" + re.escape(where),
    ):
        run = fit(cls, [cb], steps=STEPS, n=N)
    summary = cb.summary()
    assert summary["captured"] and summary["captures"] == 1, summary
    assert emu.FakeGraph.replays == SWITCH - 3  # steps 3..13 after the capture at 2; none from the change on
    assert_same(base, run)
    if cls is HelperPatchedOnClass:
        cls.compute_loss = HelperReboundOnInstance.compute_loss


class HelperBoundAtInit(TinyMLP):
    """The instance's own binding is what `self.compute_loss(...)` calls, and its branch on the step
    counter is what the analysis must read: the class's `compute_loss` has none."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.compute_loss = self._ramped_loss

    def compute_loss(self, pred, y):
        return mse(pred, y)

    def _ramped_loss(self, pred, y):
        loss = mse(pred, y)
        if self.global_step >= 14:  # (a literal: a test on a module-level name is not evaluated)
            loss = loss * 0.5
        return loss

    def training_step(self, batch, batch_idx):
        x, y = batch
        return self.compute_loss(self.head(self.net(x)).squeeze(-1), y)


def test_a_method_bound_on_the_instance_before_the_fit_is_read_in_place_of_the_class_one():
    base = fit(baseline_of(HelperBoundAtInit), steps=STEPS, n=N)
    cb = callback()
    run = fit(HelperBoundAtInit, [cb], steps=STEPS, n=N)
    assert cb.summary()["captured"], cb.summary()
    assert_same(base, run)


# --------------------------------------------------------------------------- values: captured again
class Phase(enum.Enum):
    WARMUP = "warmup"
    MAIN = "main"


class EnumBranch(_Changes):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.phase = Phase.WARMUP

    def change(self):
        self.phase = Phase.MAIN

    def training_step(self, batch, batch_idx):
        x, y = batch
        pred = self.predict(x)
        loss = mse(pred, y)
        if self.phase is Phase.MAIN:
            loss = loss + 0.5 * pred.square().mean()
        return loss


class ModeBlock(nn.Module):
    def __init__(self, width):
        super().__init__()
        self.lin = nn.Linear(width, width)
        self.mode = Phase.WARMUP

    def forward(self, x):
        out = self.lin(x)
        return x + out if self.mode is Phase.MAIN else out


class EnumInALayer(_Changes):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.block = ModeBlock(self.head.in_features)

    def change(self):
        self.block.mode = Phase.MAIN

    def training_step(self, batch, batch_idx):
        x, y = batch
        return mse(self.head(self.block(self.net(x))).squeeze(-1), y)


class TeacherInAList(_Changes):
    """A teacher kept out of the module tree (out of `parameters()` and `state_dict`), refreshed."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.teacher_box = [copy.deepcopy(self.head).requires_grad_(False)]

    def on_fit_start(self):
        # Lightning moves only the module tree to the device; a teacher kept out of it is moved by
        # hand, as its user would (in place, so the dict of TeacherInADict holds the moved one too)
        self.teacher_box[0].to(self.device)

    def change(self):
        self.teacher_box = [copy.deepcopy(self.head).requires_grad_(False)]

    def training_step(self, batch, batch_idx):
        x, y = batch
        h = self.net(x)
        with torch.no_grad():
            t = self.teacher_box[0](h).squeeze(-1)
        pred = self.head(h).squeeze(-1)
        return mse(pred, y) + mse(pred, t)


class TeacherInAListSlot(TeacherInAList):
    def change(self):
        self.teacher_box[0] = copy.deepcopy(self.head).requires_grad_(False)


class TeacherInADict(TeacherInAList):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.aux = {"teacher": self.teacher_box[0]}

    def change(self):
        self.aux["teacher"] = copy.deepcopy(self.head).requires_grad_(False)

    def training_step(self, batch, batch_idx):
        x, y = batch
        h = self.net(x)
        with torch.no_grad():
            t = self.aux["teacher"](h).squeeze(-1)
        pred = self.head(h).squeeze(-1)
        return mse(pred, y) + mse(pred, t)


class TeacherParameterRebound(TeacherInAList):
    def change(self):
        self.teacher_box[0].weight = nn.Parameter(self.head.weight.detach().clone(), requires_grad=False)


class AttributeAppears(_Changes):
    def change(self):
        self.aux_w = 0.5

    def training_step(self, batch, batch_idx):
        x, y = batch
        pred = self.predict(x)
        loss = mse(pred, y)
        if hasattr(self, "aux_w"):
            loss = loss + self.aux_w * pred.square().mean()
        return loss


class LogKeyFromAnAttribute(_Changes):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.stage = "warmup"

    def change(self):
        self.stage = "main"

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = mse(self.predict(x), y)
        self.log(f"train/{self.stage}_loss", loss)
        return loss


@dataclasses.dataclass(frozen=True)
class LossConfig:
    weight: float = 0.0


def regularized(pred, y, cfg):
    return mse(pred, y) + cfg.weight * pred.square().mean()


class FrozenConfigReplaced(_Changes):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.cfg = LossConfig()

    def change(self):
        self.cfg = dataclasses.replace(self.cfg, weight=0.5)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return regularized(self.predict(x), y, self.cfg)


class ScaledLoss:
    def __init__(self, scale):
        self.scale = scale

    def __call__(self, pred, y):
        return self.scale * mse(pred, y)


LOSSES = {"scaled": ScaledLoss(1.0)}


class RegistryObjectAnnealed(_Changes):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        LOSSES["scaled"].scale = 1.0  # each fit starts from the same registry

    def change(self):
        LOSSES["scaled"].scale = 0.25

    def training_step(self, batch, batch_idx):
        x, y = batch
        return LOSSES["scaled"](self.predict(x), y)


def knob_loss(pred, y):
    return knob_loss.weight * mse(pred, y)


knob_loss.weight = 1.0


class FunctionAttributeKnob(_Changes):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        knob_loss.weight = 1.0

    def change(self):
        knob_loss.weight = 0.25

    def training_step(self, batch, batch_idx):
        x, y = batch
        return knob_loss(self.predict(x), y)


class EnvironmentWeight(_Changes):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        os.environ["L2L_TEST_AUX_W"] = "0.0"

    def change(self):
        os.environ["L2L_TEST_AUX_W"] = "0.5"

    def training_step(self, batch, batch_idx):
        x, y = batch
        pred = self.predict(x)
        return mse(pred, y) + float(os.environ.get("L2L_TEST_AUX_W", "0")) * pred.square().mean()


def named(*parts):
    """A pattern of the warning's `parts` in order, anything on the line between them."""
    return r"[^\n]*".join(map(re.escape, parts))


@pytest.mark.parametrize(
    "cls, pattern",
    [
        (EnumBranch, named("Python numbers the step reads changed (phase)")),
        (EnumInALayer, named("Python numbers the step reads changed (mode)")),
        (TeacherInAList, named("replaced since capture (teacher_box)")),
        (TeacherInAListSlot, named("replaced since capture (self.teacher_box[0])")),
        (TeacherInADict, named("replaced since capture (self.aux['teacher'])")),
        (TeacherParameterRebound, named("replaced since capture (self.teacher_box[0].weight)")),
        (AttributeAppears, named("values the step reads changed (", "self.aux_w")),
        (LogKeyFromAnAttribute, named("values the step reads changed (the logged key at", "self.stage")),
        (FrozenConfigReplaced, named("Python numbers the step reads changed (cfg)")),
        (RegistryObjectAnnealed, named("values the step reads changed (", 'LOSSES["scaled"]')),
        (FunctionAttributeKnob, named("values the step reads changed (", "knob_loss.weight")),
        (EnvironmentWeight, named("values the step reads changed (", "os.environ.get")),
    ],
)
def test_a_value_the_step_depends_on_changed_mid_epoch_captures_it_again(cls, pattern, monkeypatch):
    monkeypatch.setenv("L2L_TEST_AUX_W", "0.0")  # (put back after the test)
    base = fit(baseline_of(cls), steps=STEPS, n=N)
    cb = callback()
    with pytest.warns(UserWarning, match="capturing the step again: [^\n]*" + pattern):
        run = fit(cls, [cb], steps=STEPS, n=N)
    summary = cb.summary()
    assert summary["captured"] and summary["captures"] == 2, summary
    assert_same(base, run)


# --------------------------------------------------------------------------- iterators: refused
class CountsWithAnIterator(TinyMLP):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.counter = itertools.count()

    def training_step(self, batch, batch_idx):
        x, y = batch
        pred = self.head(self.net(x)).squeeze(-1)
        loss = mse(pred, y)
        if next(self.counter) >= SWITCH:
            loss = loss + 0.5 * pred.square().mean()
        return loss


class MakesItsOwnIterator(TinyMLP):
    """`next(iter(self.parameters()))` makes the iterator it advances: nothing held is advanced."""

    def training_step(self, batch, batch_idx):
        x, y = batch
        first = next(iter(self.parameters()))
        return mse(self.head(self.net(x.to(first.dtype))).squeeze(-1), y)


def test_a_step_advancing_an_iterator_it_holds_is_refused_like_plain():
    plain = fit(CountsWithAnIterator, steps=STEPS, n=N)
    cb = callback()
    with pytest.warns(
        UserWarning,
        match=re.escape("the step advances an iterator held outside it (") + ".*next\\(self.counter\\)",
    ):
        run = fit(CountsWithAnIterator, [cb], steps=STEPS, n=N)
    assert not cb.summary()["captured"] and emu.FakeGraph.replays == 0, cb.summary()
    assert_same(plain, run)


def test_a_step_making_its_own_iterator_is_captured():
    base = fit(baseline_of(MakesItsOwnIterator), steps=STEPS, n=N)
    cb = callback()
    run = fit(MakesItsOwnIterator, [cb], steps=STEPS, n=N)
    assert cb.summary()["captured"] and cb.summary()["fallback_steps"] == 0, cb.summary()
    assert_same(base, run)
