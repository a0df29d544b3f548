"""More changes made mid-epoch, the way users write them, on the CPU graph emulator.

Probes written after the third held-out hunt, each changing what the step depends on at global step
14 (between the sampled checks at steps 11 and 19), through a route the hunt did not take: a class
attribute read through the instance, ``getattr(self.hparams, ...)``, a property over a private number, a
``functools.cached_property`` invalidated, a criterion's ``label_smoothing``, a param group entry read
through the Trainer, a config class shared by instances, ``torch.autocast(enabled=...)``, a layer's
class attribute, a callback's scale in ``on_before_optimizer_step``, ``trainer.gradient_clip_val``, the
module's own clipping and ``optimizer_zero_grad`` reading attributes, ``nn.Dropout.p``, a functional
dropout's ``p``, a ``topk`` size, a module-level object's attribute and a callback the module holds.
Each was equal to its baseline when written; they stay here so that a change of the checks before each
replay (the core restructure) cannot lose one silently.
"""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch import Callback
from torch import nn

from tests.baselines import (  # noqa: F401 -- the fixture records each callback fit's switch step
    baseline_of,
    capturable_from_of_the_last_callback_fit,
)
from tests.guards.test_replay_guards_mid_epoch_cpu import STEPS, SWITCH, N, _Changes, mse
from tests.replay_helpers import assert_same, callback, fit

pytestmark = pytest.mark.usefixtures("emulated_cuda_graphs")


class _Weighted(_Changes):
    """The step adds `weight() * pred²` to its loss; subclasses say where the weight comes from."""

    def weight(self):
        raise NotImplementedError

    def training_step(self, batch, batch_idx):
        x, y = batch
        pred = self.predict(x)
        return mse(pred, y) + self.weight() * pred.square().mean()


class ClassAttribute(_Weighted):
    AUX = 0.0

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        type(self).AUX = 0.0  # each fit starts from the class as defined

    def change(self):
        type(self).AUX = 0.5

    def weight(self):
        return self.AUX


class HparamsGetattr(_Weighted):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.save_hyperparameters({"w": 0.0})

    def change(self):
        self.hparams.w = 0.5

    def weight(self):
        return getattr(self.hparams, "w", 0.0)


class PropertyOverAPrivateNumber(_Weighted):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self._w = 0.0

    @property
    def aux_weight(self):
        return self._w

    def change(self):
        self._w = 0.5

    def weight(self):
        return self.aux_weight


class CachedPropertyInvalidated(_Weighted):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.base = 0.0

    @functools.cached_property
    def cached_weight(self):
        return self.base * 2

    def change(self):
        self.base = 0.25
        self.__dict__.pop("cached_weight", None)

    def weight(self):
        return self.cached_weight


class ParamGroupEntry(_Weighted):
    def configure_optimizers(self):
        optimizer = super().configure_optimizers()
        optimizer = optimizer["optimizer"] if isinstance(optimizer, dict) else optimizer
        optimizer.param_groups[0]["aux"] = 0.0
        return optimizer

    def change(self):
        self.trainer.optimizers[0].param_groups[0]["aux"] = 0.5

    def weight(self):
        return self.trainer.optimizers[0].param_groups[0]["aux"]


class SharedConfig:
    w = 0.0


class ConfigClassThroughAnInstance(_Weighted):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        SharedConfig.w = 0.0
        self.cfg = SharedConfig()

    def change(self):
        SharedConfig.w = 0.5

    def weight(self):
        return self.cfg.w


class Holder:
    def __init__(self):
        self.w = 0.0


HOLDER = Holder()


class ModuleLevelObject(_Weighted):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        HOLDER.w = 0.0

    def change(self):
        HOLDER.w = 0.5

    def weight(self):
        return HOLDER.w


class Smoother(_Changes):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.criterion = nn.HuberLoss(delta=1.0)

    def change(self):
        self.criterion.delta = 0.1

    def training_step(self, batch, batch_idx):
        x, y = batch
        return self.criterion(self.predict(x), y)


class AutocastToggled(_Changes):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.use_amp = False

    def change(self):
        self.use_amp = True

    def training_step(self, batch, batch_idx):
        x, y = batch
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=self.use_amp):
            pred = self.predict(x)
        return mse(pred.float(), y)


class Gate(nn.Module):
    open = False

    def forward(self, x):
        return x * 2 if self.open else x


class LayerClassAttribute(_Changes):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        Gate.open = False
        self.gate = Gate()

    def change(self):
        Gate.open = True

    def training_step(self, batch, batch_idx):
        x, y = batch
        return mse(self.head(self.gate(self.net(x))).squeeze(-1), y)


class DropoutP(_Changes):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.drop = nn.Dropout(0.0)

    def change(self):
        self.drop.p = 0.5

    def training_step(self, batch, batch_idx):
        x, y = batch
        return mse(self.predict(self.drop(x)), y)


class FunctionalDropoutP(_Changes):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.p = 0.0

    def change(self):
        self.p = 0.5

    def training_step(self, batch, batch_idx):
        x, y = batch
        return mse(self.predict(F.dropout(x, p=self.p, training=self.training)), y)


class TopKSize(_Changes):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.k = 2

    def change(self):
        self.k = 4

    def training_step(self, batch, batch_idx):
        x, y = batch
        h = self.net(x)
        return mse(self.head(h).squeeze(-1), y) + 0.1 * h.topk(self.k, dim=1).values.mean()


class OwnClipping(_Changes):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.max_norm = 10.0

    def change(self):
        self.max_norm = 0.01

    def configure_gradient_clipping(self, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None):
        self.clip_gradients(optimizer, gradient_clip_val=self.max_norm, gradient_clip_algorithm="norm")


class ZeroGradReadsAnAttribute(_Changes):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.set_none = True

    def change(self):
        self.set_none = False

    def optimizer_zero_grad(self, epoch, batch_idx, optimizer):
        optimizer.zero_grad(set_to_none=self.set_none)


class ScalesGradients(Callback):
    def __init__(self):
        self.scale = 1.0

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_step == SWITCH:
            self.scale = 0.25

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        for p in pl_module.parameters():
            if p.grad is not None:
                p.grad.mul_(self.scale)


class WidensClipping(Callback):
    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_step == SWITCH:
            trainer.gradient_clip_val = 0.01


class Plain(_Changes):
    def change(self):
        pass


class HoldsItsCallback(_Weighted):
    """The module keeps a reference to a callback of its own and reads its number."""

    def configure_callbacks(self):
        return [AnnealsAWeight()]

    def on_fit_start(self):
        self.annealer = next(c for c in self.trainer.callbacks if isinstance(c, AnnealsAWeight))

    def change(self):
        pass

    def weight(self):
        return self.annealer.w


class AnnealsAWeight(Callback):
    def __init__(self):
        self.w = 0.0

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_step == SWITCH:
            self.w = 0.5


@pytest.mark.parametrize(
    "cls, callbacks, trainer_kwargs",
    [
        (ClassAttribute, (), None),
        (HparamsGetattr, (), None),
        (PropertyOverAPrivateNumber, (), None),
        (CachedPropertyInvalidated, (), None),
        (ParamGroupEntry, (), None),
        (ConfigClassThroughAnInstance, (), None),
        (ModuleLevelObject, (), None),
        (Smoother, (), None),
        (AutocastToggled, (), None),
        (LayerClassAttribute, (), None),
        (DropoutP, (), None),
        (FunctionalDropoutP, (), None),
        (TopKSize, (), None),
        (OwnClipping, (), None),
        (ZeroGradReadsAnAttribute, (), None),
        (HoldsItsCallback, (), None),
        (Plain, (ScalesGradients,), None),
        (Plain, (WidensClipping,), {"gradient_clip_val": 1.0}),
    ],
    ids=lambda v: v.__name__ if isinstance(v, type) else None,
)
def test_a_change_made_mid_epoch_is_seen_before_the_next_replay(cls, callbacks, trainer_kwargs):
    base = fit(baseline_of(cls), [c() for c in callbacks], steps=STEPS, n=N, trainer_kwargs=trainer_kwargs)
    cb = callback()
    run = fit(cls, [*(c() for c in callbacks), cb], steps=STEPS, n=N, trainer_kwargs=trainer_kwargs)
    summary = cb.summary()
    # captured before the change, and the change seen: a capture of its own after it
    assert summary["captured"] and summary["captures"] == 2, summary
    assert_same(base, run)
