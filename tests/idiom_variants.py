"""Variations of the idioms of ``tests/idiom_modules.py``, and their registry ``IDIOM_VARIANTS``.

Modules a held-out idiom hunt found (a NaN guard, a module's own clipping, SWA from
``configure_callbacks``, a WGAN-GP), and variations of the idioms that the callback once replayed
silently wrong on the CPU stand-in, with the coverage issues' own idioms (16-mixed with a fused
AdamW, accumulation with bf16, Adagrad, checkpointing with dropout). Each is an :class:`Idiom` as in
``IDIOMS``; ``tests/gpu/test_idioms_gpu.py`` and ``benchmarks/bench_idioms.py`` judge both registries.
"""

from __future__ import annotations

import copy
import functools

import torch
import torch.nn.functional as F
from lightning.pytorch import LightningModule
from lightning.pytorch.utilities import grad_norm
from torch import nn

from tests.idiom_modules import (
    DEFAULT_STEPS,
    BinaryMetricsOnLogits,
    CleanRLPPOAnnealedEntropy,
    DLRMInteraction,
    GradCheckpointingDropout,
    Idiom,
    LayerKeepsItsLSTMState,
    ManualGANDeviceNoise,
    ManualGANScheduled,
    VAEKLRamp,
    WordLanguageModel,
    _binary_digits_loader,
    _corrupt_regression_loader,
    _digits_loader,
    _dlrm_loader,
    _MSERegressor,
    _regression_loader,
    _rollout_loader,
    _steps,
    _text_loader,
)


# ------------------------------------------------------- found by a held-out idiom hunt (CPU emulator)
class NanGuard(_MSERegressor):
    """The forum recipe that skips the update on non-finite gradients, in on_before_optimizer_step."""

    def on_before_optimizer_step(self, optimizer):
        if not all(torch.isfinite(p.grad).all() for p in self.parameters() if p.grad is not None):
            optimizer.zero_grad()


class GradNormBeforeOwnClipping(_MSERegressor):
    """Lightning's grad_norm logged in on_after_backward, clipped by a configure_gradient_clipping of
    the module's own (Lightning's docs' example of it)."""

    def on_after_backward(self):
        self.log_dict(grad_norm(self, norm_type=2))

    def configure_gradient_clipping(self, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None):
        self.clip_gradients(optimizer, gradient_clip_val=0.5, gradient_clip_algorithm="norm")


class SWAConfigured(_MSERegressor):
    """Lightning's StochasticWeightAveraging from configure_callbacks: it comes after the Trainer's own
    callbacks, the graph callback included, and deep-copies the module at set-up."""

    def configure_callbacks(self):
        from lightning.pytorch.callbacks import StochasticWeightAveraging

        return [StochasticWeightAveraging(swa_lrs=1e-4, swa_epoch_start=2, annealing_epochs=1)]


class ManualWGANGP(LightningModule):
    """WGAN-GP under manual optimization: the critic every batch (gradient penalty through
    `torch.autograd.grad(create_graph=True)`), the generator every second one, each optimizer zeroed
    just before its own backward."""

    def __init__(self, dim: int = 64, z: int = 16, n_critic: int = 2) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.gen = nn.Sequential(nn.Linear(z, 128), nn.ReLU(), nn.Linear(128, dim))
        self.critic = nn.Sequential(nn.Linear(dim, 128), nn.LeakyReLU(0.2), nn.Linear(128, 1))
        self.z, self.n_critic = z, n_critic

    def gradient_penalty(self, real, fake):
        alpha = torch.rand(real.size(0), 1, device=self.device)
        inter = (alpha * real + (1 - alpha) * fake).requires_grad_(True)
        out = self.critic(inter)
        grads = torch.autograd.grad(out, inter, torch.ones_like(out), create_graph=True, retain_graph=True)[0]
        return ((grads.norm(2, dim=1) - 1) ** 2).mean()

    def training_step(self, batch, batch_idx):
        real, _ = batch
        opt_g, opt_d = self.optimizers()
        z = torch.randn(real.size(0), self.z, device=self.device)
        fake = self.gen(z)
        d_loss = self.critic(fake.detach()).mean() - self.critic(real).mean()
        d_loss = d_loss + 10 * self.gradient_penalty(real, fake.detach())
        opt_d.zero_grad()
        self.manual_backward(d_loss)
        opt_d.step()
        self.log("d_loss", d_loss)
        if batch_idx % self.n_critic == 0:
            g_loss = -self.critic(self.gen(z)).mean()
            opt_g.zero_grad()
            self.manual_backward(g_loss)
            opt_g.step()
            self.log("g_loss", g_loss)

    def configure_optimizers(self):
        return (
            torch.optim.Adam(self.gen.parameters(), lr=1e-4, betas=(0.0, 0.9)),
            torch.optim.Adam(self.critic.parameters(), lr=1e-4, betas=(0.0, 0.9)),
        )


# -------------------------------------------------------------------------------------- variants
# Variations of the idioms of tests/idiom_modules.py that the callback once replayed silently wrong on
# the CPU stand-in (a branch in a helper method, Python state the step changes, a flag an epoch hook
# flips). They are judged like the idioms (tests/gpu/test_idioms_gpu.py), kept apart from IDIOMS.
class _Regressor(LightningModule):
    def __init__(self, dim: int = 64, hidden: int = 128) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(dim, hidden), nn.ReLU(), nn.Linear(hidden, 1))
        self.target = copy.deepcopy(self.net).requires_grad_(False)

    def loss(self, batch):
        x, y = batch
        return F.mse_loss(self.net(x).squeeze(-1) + 0.1 * self.target(x).squeeze(-1), y)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


class DQNHelperSync(_Regressor):
    """The DQN target sync in a helper method the step calls, every `target_every` optimizer steps."""

    target_every = 10

    def sync_target(self):
        if self.global_step % self.target_every == 0:
            self.target.load_state_dict(self.net.state_dict())

    def training_step(self, batch, batch_idx):
        self.sync_target()
        loss = self.loss(batch)
        self.log("train_loss", loss)
        return loss


class TrainingStepOutputs(_Regressor):
    """Lightning 2.0's migration guide: outputs appended in training_step, reduced in on_train_epoch_end."""

    def __init__(self) -> None:
        super().__init__()
        self.training_step_outputs = []

    def training_step(self, batch, batch_idx):
        loss = self.loss(batch)
        self.training_step_outputs.append(loss.detach())
        return loss

    def on_train_epoch_end(self):
        self.log("epoch_loss", torch.stack(self.training_step_outputs).mean())
        self.training_step_outputs.clear()


class AuxLossFlag(_Regressor):
    """An auxiliary loss switched on by on_train_epoch_start, read by a branch in training_step."""

    use_aux = False

    def on_train_epoch_start(self):
        self.use_aux = self.current_epoch >= 1

    def training_step(self, batch, batch_idx):
        loss = self.loss(batch)
        if self.use_aux:
            loss = loss + 1e-3 * sum(p.square().sum() for p in self.net.parameters())
        return loss


class ReboundInput(_Regressor):
    """The input rebound from itself (`x = x.float()`, how CleanRL and vision steps normalise their
    observations) and read by a branch on its shape: the source reader once followed that local into
    itself forever, and the fit crashed at setup."""

    def training_step(self, batch, batch_idx):
        x, y = batch
        x = x.float()
        if x.shape[-1] != self.net[0].in_features:  # a user's own shape check
            raise ValueError(f"expected {self.net[0].in_features} features, got {tuple(x.shape)}")
        pred = self.net(x).squeeze(-1) + 0.1 * self.target(x).squeeze(-1)
        loss = F.mse_loss(pred, y)
        self.log("train_loss", loss)
        return loss


class OwnStepCounter(_Regressor):
    """A target sync every 10 steps of the module's own Python counter: no step counter to read."""

    def __init__(self) -> None:
        super().__init__()
        self.updates = 0

    def configure_optimizers(self):
        # fused: found at the second warm-up step, the refusal leaves the first step's update with the
        # capturable configuration, which equals the plain one bit for bit only for fused AdamW
        return torch.optim.AdamW(self.parameters(), lr=1e-3, fused=True)

    def training_step(self, batch, batch_idx):
        if self.updates % 10 == 0:
            self.target.load_state_dict(self.net.state_dict())
        self.updates += 1
        return self.loss(batch)


class EpochWeightedAux(_Regressor):
    """An auxiliary term whose weight is computed from current_epoch in training_step (KL-annealing
    style, stepped per epoch): constant through the warm-up steps, then baked into the graph."""

    def training_step(self, batch, batch_idx):
        beta = 0.5 * min(self.current_epoch, 2)
        loss = self.loss(batch) + beta * 1e-3 * sum(p.square().sum() for p in self.net.parameters())
        self.log("train_loss", loss)
        return loss


class SGDCosinePerEpoch(_Regressor):
    """SimCLR-style optimization (and Lightning's BoringModel's SGD with a per-epoch schedule): SGD
    with momentum and weight decay, ``CosineAnnealingLR`` stepped per epoch over short epochs."""

    def training_step(self, batch, batch_idx):
        loss = self.loss(batch)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):
        opt = torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9, weight_decay=1e-4)
        return [opt], [torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=4)]


class _BufferWeighted(_Regressor):
    """A loss weight kept in a buffer; the subclasses change it once, each in its own way."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("w", torch.ones(()))

    def training_step(self, batch, batch_idx):
        return self.loss(batch) * self.w


class ReboundLossWeight(_BufferWeighted):
    """The buffer replaced by a new tensor once (`self.w = self.w * 0.5`)."""

    def on_train_batch_end(self, outputs, batch, batch_idx):
        if self.global_step == 12:
            self.w = self.w * 0.5


# A module-level loss weight, as a script's constant that a hook changes mid-fit (GlobalLossWeight)
AUX_WEIGHT = 1.0


class GlobalLossWeight(_Regressor):
    """A module-level loss weight the step reads, lowered by the module's own hook once."""

    def __init__(self) -> None:
        super().__init__()
        global AUX_WEIGHT
        AUX_WEIGHT = 1.0  # every fit starts from the script's value

    def training_step(self, batch, batch_idx):
        return self.loss(batch) * AUX_WEIGHT

    def on_train_batch_end(self, outputs, batch, batch_idx):
        global AUX_WEIGHT
        if self.global_step == 12:
            AUX_WEIGHT = 0.5


class MomentumReset(_Regressor):
    """The first layer's optimizer state replaced by a fresh entry once (a per-layer momentum reset)."""

    def training_step(self, batch, batch_idx):
        return self.loss(batch)

    def on_train_batch_end(self, outputs, batch, batch_idx):
        if self.global_step == 12:
            optimizer = self.optimizers().optimizer
            p = self.net[0].weight
            optimizer.state[p] = {
                k: (torch.zeros_like(v) if k != "step" else v.clone()) for k, v in optimizer.state[p].items()
            }


class BufferDataMoved(_BufferWeighted):
    """The buffer's data replaced through `.data` once (new storage under the same tensor)."""

    def on_train_batch_end(self, outputs, batch, batch_idx):
        if self.global_step == 12:
            self.w.data = self.w.data * 0.5


class DLRMAdagrad(DLRMInteraction):
    """facebookresearch/dlrm as it trains: the same model with Adagrad (its default optimizer for the
    embedding tables and MLPs, ``lr_decay=0``), which has no capturable mode."""

    def configure_optimizers(self):
        return torch.optim.Adagrad(self.parameters(), lr=0.01)


class FP16FusedAdamW(LightningModule):
    """``Trainer(precision="16-mixed")`` with ``torch.optim.AdamW(self.parameters(), lr=1e-3, fused=True)``,
    as Lightning's precision docs write it: the forward under fp16 autocast, and a GradScaler whose
    unscale, inf check and skip run inside the fused step, its scale update on the device after it."""

    def __init__(self, dim: int = 64, hidden: int = 256) -> None:
        super().__init__()
        self.model = nn.Sequential(
            nn.Linear(dim, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(), nn.Linear(hidden, 1)
        )

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.mse_loss(self.model(x).squeeze(-1), y)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3, fused=True)


class AccumulateBF16DecayGroups(LightningModule):
    """An HF-style fine-tune: ``accumulate_grad_batches=4``, ``precision="bf16-mixed"``, and AdamW with
    weight decay on the weights only (biases and LayerNorm in a group with ``weight_decay=0.0``, as
    ``transformers``' Trainer builds its groups)."""

    def __init__(self, dim: int = 64, hidden: int = 128) -> None:
        super().__init__()
        self.model = nn.Sequential(
            nn.Linear(dim, hidden), nn.LayerNorm(hidden), nn.GELU(), nn.Linear(hidden, 1)
        )

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.mse_loss(self.model(x).squeeze(-1).float(), y)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def configure_optimizers(self):
        no_decay = [p for n, p in self.named_parameters() if n.endswith("bias") or ".1." in n]
        decay = [p for n, p in self.named_parameters() if not (n.endswith("bias") or ".1." in n)]
        groups = [{"params": decay, "weight_decay": 0.01}, {"params": no_decay, "weight_decay": 0.0}]
        return torch.optim.AdamW(groups, lr=5e-4)


_reg_loader = functools.partial(_regression_loader, n=640, dim=64, batch_size=32, seed=21)

IDIOM_VARIANTS: dict[str, Idiom] = {
    v.name: v
    for v in [
        Idiom(
            "word_language_model_unchecked",
            WordLanguageModel,
            _text_loader,
            "capture",
            "the word language model with no replay checked (verify=False): the carried hidden state alone "
            "must keep the replays its baseline",
            trainer_kwargs=_steps(gradient_clip_val=0.25, gradient_clip_algorithm="value"),
            callback_kwargs={"verify": False},
        ),
        Idiom(
            "lstm_state_in_a_layer",
            LayerKeepsItsLSTMState,
            _text_loader,
            "capture",
            "a layer carries its own LSTM state (verify=False): carried from a submodule's attribute",
            callback_kwargs={"verify": False},
        ),
        Idiom(
            "manual_gan_device_noise",
            ManualGANDeviceNoise,
            functools.partial(_digits_loader, seed=13),
            "capture",
            "the basic GAN with its noise drawn on the device: two optimizers toggled and stepped in one graph",
            trainer_kwargs=_steps(max_steps=2 * DEFAULT_STEPS),
            optimizer_steps_per_batch=2,
        ),
        Idiom(
            "manual_gan_schedulers",
            ManualGANScheduled,
            functools.partial(_digits_loader, seed=13),
            "capture",
            "the GAN's two LR schedulers, stepped in the step, are stepped again after each replay",
            trainer_kwargs=_steps(max_steps=2 * DEFAULT_STEPS),
            optimizer_steps_per_batch=2,
        ),
        Idiom(
            "nan_guard_bad_batch",
            NanGuard,
            _corrupt_regression_loader,
            "refuse",
            "the guard syncs and may zero the gradients, which after a replay would come after the update",
        ),
        Idiom(
            "grad_norm_own_clipping",
            GradNormBeforeOwnClipping,
            _reg_loader,
            "refuse",
            "the norms are read before the module's own clipping, which a replay has already done",
        ),
        Idiom(
            "swa_from_configure_callbacks",
            SWAConfigured,
            _reg_loader,
            "capture",
            "SWA after the graph callback deep-copies the module at set-up (it crashed once)",
        ),
        Idiom(
            "manual_wgan_gp",
            ManualWGANGP,
            _reg_loader,
            "capture",
            "the generator's last gradients are left while the critic's backward runs: no stale sum",
            trainer_kwargs=_steps(max_steps=2 * DEFAULT_STEPS),
        ),
        Idiom(
            "dqn_helper_sync",
            DQNHelperSync,
            _reg_loader,
            "capture",
            "the helper's step-counter branch is read",
        ),
        Idiom(
            "training_step_outputs",
            TrainingStepOutputs,
            _reg_loader,
            "capture",
            "the list grows by one per step: a fresh copy of the element per replay",
        ),
        Idiom(
            "aux_loss_flag",
            AuxLossFlag,
            _reg_loader,
            "capture",
            "a branch on a module attribute is read per step",
        ),
        Idiom("own_step_counter", OwnStepCounter, _reg_loader, "refuse", "`self.updates` changes every step"),
        Idiom(
            "dlrm_adagrad",
            DLRMAdagrad,
            _dlrm_loader,
            "capture",
            "Adagrad without lr_decay: its step count is not read, its counters live on the device",
        ),
        Idiom(
            "vae_kl_ramp",
            VAEKLRamp,
            functools.partial(_digits_loader, seed=9),
            "capture",
            "the KL weight moves at every step from global_step and reaches the loss only as a tensor "
            "operand: the graph reads it from a device scalar, one capture",
        ),
        Idiom(
            "cleanrl_ppo_annealed_entropy",
            CleanRLPPOAnnealedEntropy,
            _rollout_loader,
            "capture",
            "the entropy coefficient, annealed per 8-batch epoch, reaches the loss only as a tensor operand: "
            "the graph reads it from a device scalar, one capture for every value",
            trainer_kwargs=_steps(gradient_clip_val=0.5),
        ),
        Idiom(
            "epoch_weighted_aux",
            EpochWeightedAux,
            _reg_loader,
            "capture",
            "a number computed from current_epoch reaches the loss only as a tensor operand: read from a "
            "device scalar, one capture through every epoch",
            trainer_kwargs={"max_epochs": 3},
        ),
        Idiom(
            "sgd_cosine_per_epoch",
            SGDCosinePerEpoch,
            _reg_loader,
            "capture",
            "SGD under a scheduler runs fused with a tensor LR: one graph through every epoch's LR",
            trainer_kwargs={"max_epochs": 4, "max_steps": DEFAULT_STEPS},
        ),
        Idiom(
            "rebound_loss_weight",
            ReboundLossWeight,
            _reg_loader,
            "capture",
            "a buffer assigned a new tensor is seen before the next replay: captured again",
        ),
        Idiom(
            "global_loss_weight",
            GlobalLossWeight,
            _reg_loader,
            "capture",
            "a module-level number the step reads is compared per replay: captured again when it changes",
        ),
        Idiom(
            "momentum_reset_one_layer",
            MomentumReset,
            _reg_loader,
            "capture",
            "one parameter's optimizer state replaced: that step runs eagerly, the next is captured again",
        ),
        Idiom(
            "rebound_input",
            ReboundInput,
            _reg_loader,
            "capture",
            "a local rebound from itself and branched on: read once, captured",
        ),
        Idiom(
            "buffer_data_moved",
            BufferDataMoved,
            _reg_loader,
            "capture",
            "a buffer's data moved through `.data`: its address is compared per replay, captured again",
        ),
        Idiom(
            "binary_metrics_on_logits",
            BinaryMetricsOnLogits,
            _binary_digits_loader,
            "capture",
            "on a GPU torchmetrics picks sigmoid or not for logits with torch.where, and the binned AUROC "
            "counts with bincount: neither waits for the host inside the graph",
        ),
        Idiom(
            "fp16_fused_adamw",
            FP16FusedAdamW,
            _reg_loader,
            "capture",
            "16-mixed's GradScaler with a fused AdamW: unscale, inf check, skip and scale update run on the "
            "device, inside the graph (on the CPU Lightning needs its plugin passed for fp16)",
            trainer_kwargs=_steps(precision="16-mixed"),
        ),
        Idiom(
            "grad_checkpointing_dropout",
            GradCheckpointingDropout,
            functools.partial(_regression_loader, n=512, dim=32, batch_size=32, seed=10),
            "capture",
            "dropout inside non-reentrant checkpointed blocks: the recomputation in backward restores the "
            "generator's state and draws the forward's masks again, inside the graph",
        ),
        Idiom(
            "accumulate_bf16_decay_groups",
            AccumulateBF16DecayGroups,
            _reg_loader,
            "capture",
            "every micro-batch replays a graph of its role (the window's first, the adding ones, the "
            "closing one that steps); AdamW's two weight-decay groups live in one capturable step",
            trainer_kwargs=_steps(accumulate_grad_batches=4, precision="bf16-mixed"),
        ),
    ]
}
