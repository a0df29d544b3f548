"""LightningModules whose loss reads a Python number that changes between epochs, as users write them:
the number reaches the step's ops only as the operand of a tensor ``*``, ``+`` or ``-`` (read from a
device scalar, l2lightning.graph.operand_scalars), or some other way too (baked, captured again)."""

from __future__ import annotations

import math

import torch.nn.functional as F
from torch import nn

from tests.lightning_models import TinyMLP


class _Annealed(TinyMLP):
    """CleanRL's PPO style: an entropy-like coefficient annealed in ``on_train_epoch_start``."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.ent_coef = 0.01

    def on_train_epoch_start(self):
        self.ent_coef = 0.01 * (1 - self.current_epoch / 10)

    def forward_loss(self, batch):
        x, y = batch
        out = self.head(self.net(x)).squeeze(-1)
        return out, F.mse_loss(out, y)


class AnnealedAttribute(_Annealed):
    def training_step(self, batch, batch_idx):
        out, mse = self.forward_loss(batch)
        loss = mse - self.ent_coef * out.square().mean()
        self.log("train/loss", loss)
        return loss


class AnnealedEveryOperator(_Annealed):
    """The number on either side of `*`, `+` and `-`."""

    def training_step(self, batch, batch_idx):
        out, mse = self.forward_loss(batch)
        reg = out.square().mean()
        loss = mse + reg * self.ent_coef + (self.ent_coef - reg) * 0.5 + (reg - self.ent_coef) * 0.25
        return loss + self.ent_coef


class AnnealedHparam(TinyMLP):
    """``self.hparams.ent_coef``, changed in place in the AttributeDict."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.save_hyperparameters()
        self.hparams.ent_coef = 0.01

    def on_train_epoch_start(self):
        self.hparams.ent_coef = 0.01 * (1 - self.current_epoch / 10)

    def training_step(self, batch, batch_idx):
        x, y = batch
        out = self.head(self.net(x)).squeeze(-1)
        return F.mse_loss(out, y) - self.hparams.ent_coef * out.square().mean()


class EpochRamp(TinyMLP):
    """A KL-annealing-style weight the step computes from ``current_epoch`` into a local."""

    def training_step(self, batch, batch_idx):
        x, y = batch
        beta = 0.5 * min(self.current_epoch, 4)
        out = self.head(self.net(x)).squeeze(-1)
        loss = F.mse_loss(out, y) + beta * 1e-3 * sum(p.square().sum() for p in self.net.parameters())
        self.log("train/loss", loss)
        return loss


class KLRamp(TinyMLP):
    """A VAE-style KL weight ramped at every step from ``global_step``: each warm-up step reads another."""

    def training_step(self, batch, batch_idx):
        x, y = batch
        w = min(1.0, self.global_step / 40)
        out = self.head(self.net(x)).squeeze(-1)
        loss = F.mse_loss(out, y) + w * out.square().mean()
        self.log("train/loss", loss)
        return loss


class AnnealedWithAHostRead(AnnealedAttribute):
    """Refused (a host read in the step): its warm-up steps ran the device scalars, and the fit must
    still be plain Lightning's bit for bit."""

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        self.diverged = bool(loss > 1e6)
        return loss


class CosineLossWeight(TinyMLP):
    """An auxiliary weight on a cosine schedule from ``global_step`` (``math.cos``), moving every step."""

    def training_step(self, batch, batch_idx):
        x, y = batch
        out = self.head(self.net(x)).squeeze(-1)
        aux = 0.5 * (1 + math.cos(math.pi * min(self.global_step, 40) / 40))
        return F.mse_loss(out, y) + out.square().mean() * aux


class _ScaledHead(nn.Module):
    """A layer that reads its LightningModule's weight through a back-reference, as a Python number:
    code the analysis reads as another object's, so the weight's use here is not an operand site."""

    def __init__(self, owner_box: list, width: int) -> None:
        super().__init__()
        self.owner_box = owner_box
        self.lin = nn.Linear(width, 1)

    def forward(self, x):
        return self.lin(x) * (1 + self.owner_box[0].ent_coef)


class AnnealedReadByALayerToo(AnnealedAttribute):
    """`ent_coef` is an operand in the step and is also read by a layer: the device scalar serves the
    step's use only, and the first replay with a new value is caught by the check."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.head = _ScaledHead([self], self.head.in_features)


# a script's module-level loss weight, which the module's own hook lowers each epoch
AUX_WEIGHT = 0.01


class AnnealedModuleLevelWeight(TinyMLP):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        global AUX_WEIGHT
        AUX_WEIGHT = 0.01  # every fit starts from the script's value

    def on_train_epoch_start(self):
        global AUX_WEIGHT
        AUX_WEIGHT = 0.01 * (1 - self.current_epoch / 10)

    def training_step(self, batch, batch_idx):
        x, y = batch
        out = self.head(self.net(x)).squeeze(-1)
        return F.mse_loss(out, y) + AUX_WEIGHT * out.square().mean()


class ModuleLevelWeightReadTwice(AnnealedModuleLevelWeight):
    """The module-level weight also sets a Python branch: baked, captured again."""

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        return loss * 2.0 if AUX_WEIGHT > 0.0095 else loss


class AnnealedAndLogged(AnnealedAttribute):
    """The number logged too: a log re-issued per replay reads it, but also a branch on it."""

    def training_step(self, batch, batch_idx):
        out, mse = self.forward_loss(batch)
        loss = mse - self.ent_coef * out.square().mean()
        if self.ent_coef > 0.008:
            loss = loss * 1.0
        return loss


class AnnealedThroughALocal(_Annealed):
    """The number multiplied in Python first: the graph bakes the product, so it is captured again."""

    def training_step(self, batch, batch_idx):
        out, mse = self.forward_loss(batch)
        coef = self.ent_coef * 2
        return mse - coef * out.square().mean()


class AnnealedDivisor(_Annealed):
    """Divided by: PyTorch multiplies by a Python scalar's reciprocal, so it stays baked."""

    def training_step(self, batch, batch_idx):
        out, mse = self.forward_loss(batch)
        return mse - out.square().mean() / (1 / self.ent_coef)


OPERAND_SERVED = [
    AnnealedAttribute,
    AnnealedEveryOperator,
    AnnealedHparam,
    EpochRamp,
    AnnealedModuleLevelWeight,
]
OPERAND_BAKED = [
    AnnealedAndLogged,
    AnnealedThroughALocal,
    AnnealedDivisor,
    AnnealedReadByALayerToo,
    ModuleLevelWeightReadTwice,
]
