"""Small LightningModules written the way users write them, and their registry.

Each module re-creates one public idiom (Lightning's docs and demos, lightning-hydra-template,
torchmetrics' docs, CleanRL, timm, DLRM, the classic pytorch/examples scripts) on synthetic data
drawn from a seeded ``torch.Generator``, at widths of 64-256 so that a 60-step fit takes a second
or two on a GPU. Modules are device-agnostic (they also fit on the CPU).

``IDIOMS`` maps each idiom's name to an :class:`Idiom` (``tests/idiom_variants.py`` holds more, as
``IDIOM_VARIANTS``): a fresh module, a fixed-order DataLoader of
CPU tensors, the Trainer and callback keyword arguments, and what ``L2GraphCallback`` is expected
to do with it (``"capture"``: capture and be bit-identical to the ``make_capturable`` baseline;
``"refuse"``: refuse by name and be bit-identical to plain Lightning). ``tests/idiom_harness.py``
runs them; ``tests/gpu/test_idioms_gpu.py`` and ``benchmarks/bench_idioms.py`` use it.
"""

from __future__ import annotations

import copy
import functools
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from lightning.pytorch import LightningModule
from lightning.pytorch.utilities import grad_norm
from torch import nn
from torch.optim.lr_scheduler import LambdaLR, OneCycleLR, StepLR
from torch.utils.checkpoint import checkpoint
from torch.utils.data import DataLoader, TensorDataset
from torchmetrics import MeanMetric, MetricCollection
from torchmetrics.classification import (
    Accuracy,
    BinaryAUROC,
    BinaryF1Score,
    MulticlassAccuracy,
    MulticlassF1Score,
    MulticlassPrecision,
)

DEFAULT_STEPS = 60


# ---------------------------------------------------------------------------------------- data
def _generator(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _loader(*tensors: torch.Tensor, batch_size: int) -> DataLoader:
    return DataLoader(TensorDataset(*tensors), batch_size=batch_size, shuffle=False)


def _digits(n: int, seed: int, channels: int = 1, size: int = 28, classes: int = 10):
    """Synthetic "digits": images in [0, 1) and labels a fixed random projection makes learnable."""
    g = _generator(seed)
    x = torch.rand(n, channels, size, size, generator=g)
    w = torch.randn(channels * size * size, classes, generator=g)
    y = (x.flatten(1) @ w).argmax(dim=1)
    return x, y


def _regression(n: int, dim: int, seed: int):
    g = _generator(seed)
    x = torch.randn(n, dim, generator=g)
    y = torch.tanh(x @ torch.randn(dim, generator=g) / math.sqrt(dim))
    return x, y


# -------------------------------------------------------------------------------------- modules
class LitAutoEncoder(LightningModule):
    """Lightning's README / "Lightning in 15 minutes" ``LitAutoEncoder``: encoder/decoder MLP, MSE,
    one ``self.log``, default (foreach) Adam."""

    def __init__(self, hidden: int = 64, code: int = 3) -> None:
        super().__init__()
        self.encoder = nn.Sequential(nn.Linear(28 * 28, hidden), nn.ReLU(), nn.Linear(hidden, code))
        self.decoder = nn.Sequential(nn.Linear(code, hidden), nn.ReLU(), nn.Linear(hidden, 28 * 28))

    def training_step(self, batch, batch_idx):
        x, _ = batch
        x = x.view(x.size(0), -1)
        z = self.encoder(x)
        x_hat = self.decoder(z)
        loss = F.mse_loss(x_hat, x)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=1e-3)


class PredsMetricsOnBatchEnd(LightningModule):
    """The pattern this project's README recommends: ``training_step`` returns detached ``preds``; a
    torchmetrics ``Accuracy`` is updated (forward call) in ``on_train_batch_end`` and logged there."""

    def __init__(self, hidden: int = 128, num_classes: int = 10) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Flatten(),
            nn.Linear(28 * 28, hidden),
            nn.ReLU(),
            nn.Linear(hidden, hidden),
            nn.ReLU(),
            nn.Linear(hidden, num_classes),
        )
        self.train_acc = Accuracy(task="multiclass", num_classes=num_classes)

    def training_step(self, batch, batch_idx):
        x, y = batch
        logits = self.net(x)
        loss = F.cross_entropy(logits, y)
        self.log("train_loss", loss)
        return {"loss": loss, "preds": logits.detach()}

    def on_train_batch_end(self, outputs, batch, batch_idx):
        _, y = batch
        self.train_acc(outputs["preds"], y)
        self.log("train_acc", self.train_acc, on_step=True, on_epoch=True)

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=1e-3)


class QNetwork(nn.Module):
    """CleanRL ``dqn.py``'s QNetwork (MLP over observations, one output per action)."""

    def __init__(self, obs_dim: int, n_actions: int, hidden: int = 128) -> None:
        super().__init__()
        self.network = nn.Sequential(
            nn.Linear(obs_dim, hidden),
            nn.ReLU(),
            nn.Linear(hidden, hidden),
            nn.ReLU(),
            nn.Linear(hidden, n_actions),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.network(x)


class DQNTargetSync(LightningModule):
    """CleanRL-style DQN (and Lightning's DQN example): a Q network, a ``copy.deepcopy`` target network
    synced with ``load_state_dict`` under ``if self.global_step % 10 == 0`` inside ``training_step``, and a
    TD loss whose target max is taken under ``torch.no_grad()``. Transitions are synthetic."""

    def __init__(
        self,
        obs_dim: int = 8,
        n_actions: int = 4,
        gamma: float = 0.99,
        lr: float = 1e-3,
        target_every: int = 10,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.q = QNetwork(obs_dim, n_actions)
        self.target = copy.deepcopy(self.q)

    def training_step(self, batch, batch_idx):
        obs, actions, rewards, next_obs, dones = batch
        with torch.no_grad():
            target_max, _ = self.target(next_obs).max(dim=1)
            td_target = rewards.flatten() + self.hparams.gamma * target_max * (1 - dones.flatten())
        old_val = self.q(obs).gather(1, actions).squeeze()
        loss = F.mse_loss(td_target, old_val)
        self.log("losses/td_loss", loss)
        self.log("losses/q_values", old_val.mean())
        if self.global_step % self.hparams.target_every == 0:
            self.target.load_state_dict(self.q.state_dict())
        return loss

    def configure_optimizers(self):
        return torch.optim.Adam(self.q.parameters(), lr=self.hparams.lr)


def _layer_init(layer: nn.Linear, std: float = math.sqrt(2), bias_const: float = 0.0) -> nn.Linear:
    """CleanRL's ``layer_init``: orthogonal weights, constant bias."""
    torch.nn.init.orthogonal_(layer.weight, std)
    torch.nn.init.constant_(layer.bias, bias_const)
    return layer


class CleanRLPPO(LightningModule):
    """CleanRL ``ppo.py``'s update in Lightning: its ``Agent`` (actor and critic MLPs made with
    ``layer_init``), ``get_action_and_value`` with ``Categorical(logits=...)`` (torch.distributions,
    which checks its arguments by default: a host sync per distribution), advantages normalised per
    minibatch, the clipped policy loss, the clipped value loss and the entropy bonus; Adam with
    ``eps=1e-5`` and gradient clipping at 0.5 through the Trainer. Rollouts are synthetic."""

    def __init__(self, obs_dim: int = 8, n_actions: int = 4, clip_coef: float = 0.2, ent_coef: float = 0.01):
        super().__init__()
        self.save_hyperparameters()
        self.critic = nn.Sequential(
            _layer_init(nn.Linear(obs_dim, 64)),
            nn.Tanh(),
            _layer_init(nn.Linear(64, 64)),
            nn.Tanh(),
            _layer_init(nn.Linear(64, 1), std=1.0),
        )
        self.actor = nn.Sequential(
            _layer_init(nn.Linear(obs_dim, 64)),
            nn.Tanh(),
            _layer_init(nn.Linear(64, 64)),
            nn.Tanh(),
            _layer_init(nn.Linear(64, n_actions), std=0.01),
        )

    def get_action_and_value(self, x, action=None):
        logits = self.actor(x)
        probs = torch.distributions.Categorical(logits=logits)
        if action is None:
            action = probs.sample()
        return action, probs.log_prob(action), probs.entropy(), self.critic(x)

    def training_step(self, batch, batch_idx):
        obs, actions, logprobs, advantages, returns, values = batch
        _, newlogprob, entropy, newvalue = self.get_action_and_value(obs, actions)
        logratio = newlogprob - logprobs
        ratio = logratio.exp()
        with torch.no_grad():
            approx_kl = ((ratio - 1) - logratio).mean()
        advantages = (advantages - advantages.mean()) / (advantages.std() + 1e-8)
        pg_loss1 = -advantages * ratio
        pg_loss2 = -advantages * torch.clamp(ratio, 1 - self.hparams.clip_coef, 1 + self.hparams.clip_coef)
        pg_loss = torch.max(pg_loss1, pg_loss2).mean()
        newvalue = newvalue.view(-1)
        v_loss_unclipped = (newvalue - returns) ** 2
        v_clipped = values + torch.clamp(newvalue - values, -self.hparams.clip_coef, self.hparams.clip_coef)
        v_loss = 0.5 * torch.max(v_loss_unclipped, (v_clipped - returns) ** 2).mean()
        loss = pg_loss - self.hparams.ent_coef * entropy.mean() + v_loss * 0.5
        self.log("losses/policy_loss", pg_loss)
        self.log("losses/value_loss", v_loss)
        self.log("losses/approx_kl", approx_kl)
        return loss

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=2.5e-4, eps=1e-5)


class CleanRLPPOAnnealedEntropy(CleanRLPPO):
    """CleanRL's PPO update with its entropy coefficient annealed at every epoch start (exploration
    decayed over training, as PPO recipes do), over short epochs: one rollout of 8 minibatches each."""

    def on_train_epoch_start(self):
        self.hparams.ent_coef = 0.01 * (1 - self.current_epoch / 20)


def mnist_mlp(hidden: int) -> nn.Sequential:
    """The two-hidden-layer MNIST MLP of Lightning's docs examples (28x28 -> hidden -> hidden -> 10)."""
    return nn.Sequential(
        nn.Flatten(),
        nn.Linear(28 * 28, hidden),
        nn.ReLU(),
        nn.Linear(hidden, hidden),
        nn.ReLU(),
        nn.Linear(hidden, 10),
    )


class DocsLRWarmup(LightningModule):
    """The learning-rate warm-up of Lightning's optimization guide ("manually warm up lr without a
    scheduler"): an ``optimizer_step`` override that steps with the closure, then sets each param
    group's LR to ``min(1, (global_step + 1) / 500) * learning_rate`` while ``global_step < 500``."""

    def __init__(self, learning_rate: float = 1e-3, hidden: int = 256) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = mnist_mlp(hidden)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self.net(x), y)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=self.hparams.learning_rate)

    def optimizer_step(self, epoch, batch_idx, optimizer, optimizer_closure):
        # update params
        optimizer.step(closure=optimizer_closure)

        # manually warm up lr without a scheduler
        if self.trainer.global_step < 500:
            lr_scale = min(1.0, float(self.trainer.global_step + 1) / 500.0)
            for pg in optimizer.param_groups:
                pg["lr"] = lr_scale * self.hparams.learning_rate


class SGDOneCycleClip(LightningModule):
    """Lightning tutorials' CIFAR-10 baseline: a small conv net with BatchNorm, ``SGD(momentum=0.9,
    weight_decay=5e-4)``, ``OneCycleLR`` stepped per batch (``interval: "step"``, ``cycle_momentum``
    left at True) over ``trainer.estimated_stepping_batches``; the Trainer clips with
    ``gradient_clip_val=1.0``."""

    def __init__(self, lr: float = 0.05, width: int = 64, num_classes: int = 10) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.model = nn.Sequential(
            nn.Conv2d(3, width // 2, 3, padding=1, bias=False),
            nn.BatchNorm2d(width // 2),
            nn.ReLU(inplace=True),
            nn.Conv2d(width // 2, width, 3, stride=2, padding=1, bias=False),
            nn.BatchNorm2d(width),
            nn.ReLU(inplace=True),
            nn.Conv2d(width, width, 3, stride=2, padding=1, bias=False),
            nn.BatchNorm2d(width),
            nn.ReLU(inplace=True),
            # the CIFAR ResNets' F.avg_pool2d(out, 4): AdaptiveAvgPool2d's CUDA backward has no
            # deterministic kernel and raises under Trainer(deterministic=True)
            nn.AvgPool2d(8),
            nn.Flatten(),
            nn.Linear(width, num_classes),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.log_softmax(self.model(x), dim=1)

    def training_step(self, batch, batch_idx):
        x, y = batch
        logits = self(x)
        loss = F.nll_loss(logits, y)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):
        optimizer = torch.optim.SGD(self.parameters(), lr=self.hparams.lr, momentum=0.9, weight_decay=5e-4)
        scheduler = OneCycleLR(optimizer, 0.1, total_steps=int(self.trainer.estimated_stepping_batches))
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


class PrintItemEvery50(LightningModule):
    """pytorch/examples ``mnist/main.py`` in Lightning: the example's conv net (with dropout), Adadelta
    (lr=1.0) and an epoch-level ``StepLR(step_size=1, gamma=0.7)``, and a host-syncing
    ``print(... loss.item())`` every 50 batches in ``training_step``. The loader has 25 batches, so
    the print fires at batch 0 of each epoch and the LR changes twice in 60 steps."""

    def __init__(self, lr: float = 1.0, gamma: float = 0.7) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.conv1 = nn.Conv2d(1, 32, 3, 1)
        self.conv2 = nn.Conv2d(32, 64, 3, 1)
        self.dropout1 = nn.Dropout(0.25)
        self.dropout2 = nn.Dropout(0.5)
        self.fc1 = nn.Linear(9216, 128)
        self.fc2 = nn.Linear(128, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.conv1(x))
        x = F.relu(self.conv2(x))
        x = F.max_pool2d(x, 2)
        x = self.dropout1(x)
        x = torch.flatten(x, 1)
        x = F.relu(self.fc1(x))
        x = self.dropout2(x)
        return F.log_softmax(self.fc2(x), dim=1)

    def training_step(self, batch, batch_idx):
        data, target = batch
        output = self(data)
        loss = F.nll_loss(output, target)
        if batch_idx % 50 == 0:
            print(f"step {batch_idx} loss {loss.item():.4f}")
        return loss

    def configure_optimizers(self):
        optimizer = torch.optim.Adadelta(self.parameters(), lr=self.hparams.lr)
        scheduler = StepLR(optimizer, step_size=1, gamma=self.hparams.gamma)
        return [optimizer], [scheduler]


class SimpleDenseNet(nn.Module):
    """lightning-hydra-template ``src/models/components/simple_dense_net.py`` (its mnist.yaml sizes)."""

    def __init__(
        self,
        input_size: int = 784,
        lin1_size: int = 64,
        lin2_size: int = 128,
        lin3_size: int = 64,
        output_size: int = 10,
    ) -> None:
        super().__init__()
        self.model = nn.Sequential(
            nn.Linear(input_size, lin1_size),
            nn.BatchNorm1d(lin1_size),
            nn.ReLU(),
            nn.Linear(lin1_size, lin2_size),
            nn.BatchNorm1d(lin2_size),
            nn.ReLU(),
            nn.Linear(lin2_size, lin3_size),
            nn.BatchNorm1d(lin3_size),
            nn.ReLU(),
            nn.Linear(lin3_size, output_size),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch_size, channels, width, height = x.size()
        x = x.view(batch_size, -1)
        return self.model(x)


class HydraTemplateMNIST(LightningModule):
    """lightning-hydra-template ``MNISTLitModule``: ``MeanMetric`` loss and multiclass ``Accuracy``
    updated inside ``training_step`` and logged as metric objects with ``on_step=False,
    on_epoch=True``; the optimizer arrives as a Hydra ``functools.partial`` (Adam, lr=1e-3). The
    template's ReduceLROnPlateau needs a validation monitor and is left out. MNIST's 55000 / 64
    leaves a partial last batch, and so does this loader (1000 / 64)."""

    def __init__(self, net: nn.Module, optimizer: Callable[..., torch.optim.Optimizer]) -> None:
        super().__init__()
        self.save_hyperparameters(logger=False, ignore=["net"])
        self.net = net
        self.criterion = torch.nn.CrossEntropyLoss()
        self.train_acc = Accuracy(task="multiclass", num_classes=10)
        self.train_loss = MeanMetric()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def model_step(self, batch):
        x, y = batch
        logits = self.forward(x)
        loss = self.criterion(logits, y)
        preds = torch.argmax(logits, dim=1)
        return loss, preds, y

    def training_step(self, batch, batch_idx):
        loss, preds, targets = self.model_step(batch)

        # update and log metrics
        self.train_loss(loss)
        self.train_acc(preds, targets)
        self.log("train/loss", self.train_loss, on_step=False, on_epoch=True, prog_bar=True)
        self.log("train/acc", self.train_acc, on_step=False, on_epoch=True, prog_bar=True)

        # return loss or backpropagation will fail
        return loss

    def configure_optimizers(self):
        optimizer = self.hparams.optimizer(params=self.trainer.model.parameters())
        return {"optimizer": optimizer}


class TorchmetricsDocsForward(LightningModule):
    """torchmetrics docs, "TorchMetrics in PyTorch Lightning": ``self.train_acc(logits, y)`` (forward:
    update and batch value) inside ``training_step``, then
    ``self.log("train_acc", self.train_acc, on_step=True, on_epoch=True)``."""

    def __init__(self, hidden: int = 128, num_classes: int = 10) -> None:
        super().__init__()
        self.l1 = nn.Linear(28 * 28, hidden)
        self.l2 = nn.Linear(hidden, num_classes)
        self.train_acc = Accuracy(task="multiclass", num_classes=num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.l2(torch.relu(self.l1(x.view(x.size(0), -1))))

    def training_step(self, batch, batch_idx):
        x, y = batch
        logits = self(x)
        loss = F.cross_entropy(logits, y)
        self.train_acc(logits, y)
        self.log("train_acc", self.train_acc, on_step=True, on_epoch=True)
        return loss

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=1e-3)


class BinaryMetricsOnLogits(LightningModule):
    """A binary classifier as torchmetrics' docs write one: ``Accuracy(task="binary")``, a binary F1
    and a binned ``BinaryAUROC`` called on the raw logits, which torchmetrics turns into probabilities
    when any leaves [0, 1] (a data-dependent choice: torchmetrics 1.9 makes it with ``torch.where`` on a
    GPU, with a host test on the CPU), logged as metric objects per step and epoch."""

    def __init__(self, hidden: int = 128) -> None:
        super().__init__()
        self.l1 = nn.Linear(28 * 28, hidden)
        self.l2 = nn.Linear(hidden, 1)
        self.train_acc = Accuracy(task="binary")
        self.train_f1 = BinaryF1Score()
        self.train_auroc = BinaryAUROC(thresholds=50)

    def training_step(self, batch, batch_idx):
        x, y = batch
        logits = self.l2(torch.relu(self.l1(x.view(x.size(0), -1)))).squeeze(-1)
        loss = F.binary_cross_entropy_with_logits(logits, y.float())
        self.train_acc(logits, y)
        self.train_f1(logits, y)
        self.train_auroc.update(logits, y)
        self.log("train_loss", loss)
        self.log("train_acc", self.train_acc, on_step=True, on_epoch=True)
        self.log("train_f1", self.train_f1, on_step=True, on_epoch=True)
        self.log("train_auroc", self.train_auroc, on_step=False, on_epoch=True)
        return loss

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=1e-3)


class MacroMetricCollection(LightningModule):
    """torchmetrics docs, "MetricCollection" in Lightning: ``metrics.clone(prefix="train/")`` of
    macro-averaged ``MulticlassAccuracy``, ``MulticlassF1Score`` and ``MulticlassPrecision`` (their
    default), called in ``training_step`` and logged with ``self.log_dict(...)``. Macro averages count
    per class with ``torch.bincount``, whose output size depends on the data (a host sync)."""

    def __init__(self, hidden: int = 128, num_classes: int = 10) -> None:
        super().__init__()
        self.l1 = nn.Linear(28 * 28, hidden)
        self.l2 = nn.Linear(hidden, num_classes)
        metrics = MetricCollection(
            {
                "acc": MulticlassAccuracy(num_classes),
                "f1": MulticlassF1Score(num_classes),
                "precision": MulticlassPrecision(num_classes),
            }
        )
        self.train_metrics = metrics.clone(prefix="train/")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.l2(torch.relu(self.l1(x.view(x.size(0), -1))))

    def training_step(self, batch, batch_idx):
        x, y = batch
        logits = self(x)
        loss = F.cross_entropy(logits, y)
        self.log_dict(self.train_metrics(logits, y), on_step=True, on_epoch=True)
        self.log("train/loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=1e-3)


class PositionalEncoding(nn.Module):
    """Lightning's demo / pytorch/examples ``PositionalEncoding``: built lazily on the input's device."""

    def __init__(self, dim: int, dropout: float = 0.1, max_len: int = 512) -> None:
        super().__init__()
        self.dropout = nn.Dropout(p=dropout)
        self.dim = dim
        self.max_len = max_len
        self.pe: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.pe is None:
            self.pe = self._init_pos_encoding(device=x.device)
        x = x + self.pe[:, : x.size(1)]
        return self.dropout(x)

    def _init_pos_encoding(self, device: torch.device) -> torch.Tensor:
        pe = torch.zeros(self.max_len, self.dim, device=device)
        position = torch.arange(0, self.max_len, dtype=torch.float, device=device).unsqueeze(1)
        div_term = torch.exp(
            torch.arange(0, self.dim, 2, device=device).float() * (-math.log(10000.0) / self.dim)
        )
        pe[:, 0::2] = torch.sin(position * div_term)
        pe[:, 1::2] = torch.cos(position * div_term)
        return pe.unsqueeze(0)


class CPUCausalMaskTransformer(LightningModule):
    """Lightning's demo ``Transformer`` / pytorch/examples word_language_model, as an
    ``nn.TransformerEncoder`` LM: forward builds the causal mask on the CPU at every call
    (``torch.triu(torch.full((T, T), -inf), diagonal=1)``) and moves it with ``.to(x.device)``;
    dropout 0.2; plain ``SGD(lr=0.1)`` as in the demo's ``LightningTransformer``.

    Like the demo, it passes ``mask=`` without ``is_causal``: ``nn.TransformerEncoder`` then detects
    a causal mask with ``bool((mask == causal).all())`` each forward, a host sync. ``is_causal=True``
    skips that check (not what the demo writes).
    """

    def __init__(
        self,
        vocab_size: int = 256,
        ninp: int = 64,
        nhead: int = 2,
        nhid: int = 128,
        nlayers: int = 2,
        dropout: float = 0.2,
        is_causal: bool | None = None,
    ) -> None:
        super().__init__()
        self.vocab_size = vocab_size
        self.ninp = ninp
        self.is_causal = is_causal
        self.embedding = nn.Embedding(vocab_size, ninp)
        self.pos_encoder = PositionalEncoding(ninp, dropout)
        layer = nn.TransformerEncoderLayer(ninp, nhead, nhid, dropout, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, nlayers, enable_nested_tensor=False)
        self.decoder = nn.Linear(ninp, vocab_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t = x.size(1)
        mask = torch.triu(torch.full((t, t), float("-inf")), diagonal=1)
        mask = mask.to(x.device)
        src = self.pos_encoder(self.embedding(x) * math.sqrt(self.ninp))
        if self.is_causal is None:
            output = self.encoder(src, mask=mask)
        else:
            output = self.encoder(src, mask=mask, is_causal=self.is_causal)
        return F.log_softmax(self.decoder(output), dim=-1)

    def training_step(self, batch, batch_idx):
        inputs, target = batch
        output = self(inputs)
        loss = F.nll_loss(output.view(-1, self.vocab_size), target.view(-1))
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


class DLRMInteraction(LightningModule):
    """facebookresearch/dlrm ``dlrm_s_pytorch.py``: bottom MLP over dense features, one
    ``EmbeddingBag(mode="sum")`` per sparse feature, the "dot" interaction whose pair indices ``li``/
    ``lj`` are built as CPU tensors from Python lists at every forward and used as ``Z[:, li, lj]``,
    and a top MLP with a sigmoid under ``BCELoss``. DLRM trains with Adagrad (no capturable mode);
    Adam here."""

    def __init__(
        self, dense_dim: int = 13, num_tables: int = 8, rows: int = 1000, emb_dim: int = 16, hidden: int = 128
    ) -> None:
        super().__init__()
        self.bot_l = nn.Sequential(
            nn.Linear(dense_dim, hidden), nn.ReLU(), nn.Linear(hidden, emb_dim), nn.ReLU()
        )
        self.emb_l = nn.ModuleList(nn.EmbeddingBag(rows, emb_dim, mode="sum") for _ in range(num_tables))
        n = num_tables + 1
        self.top_l = nn.Sequential(
            nn.Linear(emb_dim + n * (n - 1) // 2, hidden), nn.ReLU(), nn.Linear(hidden, 1), nn.Sigmoid()
        )
        self.loss_fn = nn.BCELoss(reduction="mean")

    def apply_emb(self, lS_i: torch.Tensor) -> list[torch.Tensor]:
        return [emb(lS_i[:, k]) for k, emb in enumerate(self.emb_l)]

    def interact_features(self, x: torch.Tensor, ly: list[torch.Tensor]) -> torch.Tensor:
        (batch_size, d) = x.shape
        T = torch.cat([x] + ly, dim=1).view((batch_size, -1, d))
        Z = torch.bmm(T, torch.transpose(T, 1, 2))
        _, ni, nj = Z.shape
        offset = 0  # arch_interaction_itself=False
        li = torch.tensor([i for i in range(ni) for j in range(i + offset)])
        lj = torch.tensor([j for i in range(nj) for j in range(i + offset)])
        Zflat = Z[:, li, lj]
        return torch.cat([x] + [Zflat], dim=1)

    def forward(self, dense_x: torch.Tensor, lS_i: torch.Tensor) -> torch.Tensor:
        x = self.bot_l(dense_x)
        ly = self.apply_emb(lS_i)
        z = self.interact_features(x, ly)
        return self.top_l(z)

    def training_step(self, batch, batch_idx):
        dense_x, lS_i, target = batch
        p = self(dense_x, lS_i).squeeze(-1)
        loss = self.loss_fn(p, target)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=1e-3)


class GradNormLogging(LightningModule):
    """Lightning docs ("Track and Visualize Experiments" / debugging): ``on_before_optimizer_step``
    logging ``self.log_dict(grad_norm(self, norm_type=2))``."""

    def __init__(self, hidden: int = 128) -> None:
        super().__init__()
        self.net = mnist_mlp(hidden)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self.net(x), y)
        self.log("train_loss", loss)
        return loss

    def on_before_optimizer_step(self, optimizer):
        # Compute the 2-norm for each layer
        # If using mixed precision, the gradients are already unscaled here
        norms = grad_norm(self, norm_type=2)
        self.log_dict(norms)

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=1e-3)


class VAERandn(LightningModule):
    """pytorch/examples ``vae/main.py``: the reparameterisation ``eps = torch.randn_like(std)`` inside
    the step, binary cross-entropy reconstruction (sum) + KL divergence; both terms logged."""

    def __init__(self, hidden: int = 256, latent: int = 16) -> None:
        super().__init__()
        self.fc1 = nn.Linear(784, hidden)
        self.fc21 = nn.Linear(hidden, latent)
        self.fc22 = nn.Linear(hidden, latent)
        self.fc3 = nn.Linear(latent, hidden)
        self.fc4 = nn.Linear(hidden, 784)

    def encode(self, x):
        h1 = F.relu(self.fc1(x))
        return self.fc21(h1), self.fc22(h1)

    def reparameterize(self, mu, logvar):
        std = torch.exp(0.5 * logvar)
        eps = torch.randn_like(std)
        return mu + eps * std

    def decode(self, z):
        h3 = F.relu(self.fc3(z))
        return torch.sigmoid(self.fc4(h3))

    def forward(self, x):
        mu, logvar = self.encode(x.view(-1, 784))
        z = self.reparameterize(mu, logvar)
        return self.decode(z), mu, logvar

    def training_step(self, batch, batch_idx):
        x, _ = batch
        recon_batch, mu, logvar = self(x)
        bce = F.binary_cross_entropy(recon_batch, x.view(-1, 784), reduction="sum")
        kld = -0.5 * torch.sum(1 + logvar - mu.pow(2) - logvar.exp())
        self.log("train/recon", bce)
        self.log("train/kl", kld)
        return bce + kld

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=1e-3)


class VAEKLRamp(VAERandn):
    """The same VAE with its KL term warmed up linearly over the first steps (KL annealing against
    posterior collapse, as beta-VAE and text-VAE recipes do): ``beta`` moves at every step."""

    def training_step(self, batch, batch_idx):
        x, _ = batch
        recon_batch, mu, logvar = self(x)
        bce = F.binary_cross_entropy(recon_batch, x.view(-1, 784), reduction="sum")
        kld = -0.5 * torch.sum(1 + logvar - mu.pow(2) - logvar.exp())
        beta = min(1.0, self.global_step / 50)
        self.log("train/recon", bce)
        self.log("train/kl", kld)
        return bce + beta * kld


class ResidualBlock(nn.Module):
    """Pre-norm residual MLP block."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.mlp = nn.Sequential(nn.Linear(width, 2 * width), nn.GELU(), nn.Linear(2 * width, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.mlp(self.norm(x))


class GradCheckpointing(LightningModule):
    """Activation checkpointing as Hugging Face / timm blocks do it: a deep residual MLP whose blocks
    run through ``torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False)``; AdamW."""

    def __init__(self, in_dim: int = 32, width: int = 128, depth: int = 8) -> None:
        super().__init__()
        self.stem = nn.Linear(in_dim, width)
        self.blocks = nn.ModuleList(ResidualBlock(width) for _ in range(depth))
        self.head = nn.Linear(width, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        for block in self.blocks:
            x = checkpoint(block, x, use_reentrant=False)
        return self.head(x).squeeze(-1)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.mse_loss(self(x), y)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


class DropoutResidualBlock(ResidualBlock):
    """ResidualBlock with Hugging Face's hidden dropout after its MLP (``hidden_dropout_prob``)."""

    def __init__(self, width: int, p: float = 0.1) -> None:
        super().__init__(width)
        self.dropout = nn.Dropout(p)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.dropout(self.mlp(self.norm(x)))


class GradCheckpointingDropout(GradCheckpointing):
    """GradCheckpointing with dropout inside each checkpointed block, as a Hugging Face model with
    ``gradient_checkpointing_enable()`` trains: the backward recomputes each block's forward, which
    must draw the same dropout mask again (checkpoint puts the generator's state back first)."""

    def __init__(self, in_dim: int = 32, width: int = 128, depth: int = 8) -> None:
        super().__init__(in_dim, width, depth)
        self.blocks = nn.ModuleList(DropoutResidualBlock(width) for _ in range(depth))


class ModelEma(nn.Module):
    """timm ``ModelEmaV2``/``V3``: a deep copy of the model (no grads) updated in place under no_grad."""

    def __init__(self, model: nn.Module, decay: float = 0.99) -> None:
        super().__init__()
        self.module = copy.deepcopy(model)
        self.module.eval()
        for p in self.module.parameters():
            p.requires_grad_(False)
        self.decay = decay

    @torch.no_grad()
    def update(self, model: nn.Module) -> None:
        for ema_v, model_v in zip(self.module.state_dict().values(), model.state_dict().values()):
            if ema_v.is_floating_point():
                ema_v.lerp_(model_v, 1.0 - self.decay)
            else:
                ema_v.copy_(model_v)


class EMAOnBatchEnd(LightningModule):
    """An EMA of the weights (timm ``ModelEmaV2``/``V3`` pattern, as Lightning users wire it): a
    deep-copied module with ``requires_grad=False``, updated with ``lerp_``/``copy_`` under
    ``torch.no_grad()`` in ``on_train_batch_end``; the net has BatchNorm, so buffers are averaged too."""

    def __init__(self, hidden: int = 128) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(64, hidden),
            nn.BatchNorm1d(hidden),
            nn.ReLU(),
            nn.Linear(hidden, hidden),
            nn.ReLU(),
            nn.Linear(hidden, 1),
        )
        self.ema = ModelEma(self.net, decay=0.99)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.mse_loss(self.net(x).squeeze(-1), y)
        self.log("train_loss", loss)
        return loss

    def on_train_batch_end(self, outputs, batch, batch_idx):
        self.ema.update(self.net)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.net.parameters(), lr=1e-3)


class Bf16TrueLambdaLR(LightningModule):
    """``precision="bf16-true"`` with AdamW and a per-step linear warm-up + cosine ``LambdaLR`` (the
    nanoGPT / Hugging Face ``get_cosine_schedule_with_warmup`` shape), logging
    ``self.lr_schedulers().get_last_lr()[0]`` (a Python float) every step in ``training_step``."""

    def __init__(self, width: int = 256, depth: int = 4, lr: float = 3e-4, warmup_steps: int = 10) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = nn.Sequential(
            *[nn.Sequential(nn.LayerNorm(width), nn.Linear(width, width), nn.GELU()) for _ in range(depth)],
            nn.Linear(width, 1),
        )

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.mse_loss(self.net(x).squeeze(-1), y)
        self.log("train_loss", loss)
        self.log("lr", self.lr_schedulers().get_last_lr()[0])
        return loss

    def configure_optimizers(self):
        optimizer = torch.optim.AdamW(self.parameters(), lr=self.hparams.lr, weight_decay=0.1)
        total = int(self.trainer.estimated_stepping_batches)
        warmup = self.hparams.warmup_steps

        def lr_lambda(step: int) -> float:
            if step < warmup:
                return (step + 1) / warmup
            progress = (step - warmup) / max(1, total - warmup)
            return 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))

        scheduler = LambdaLR(optimizer, lr_lambda)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


class Generator(nn.Module):
    """Lightning docs basic GAN generator (smaller)."""

    def __init__(self, latent_dim: int = 32, img_dim: int = 784) -> None:
        super().__init__()

        def block(in_feat: int, out_feat: int, normalize: bool = True) -> list[nn.Module]:
            layers: list[nn.Module] = [nn.Linear(in_feat, out_feat)]
            if normalize:
                layers.append(nn.BatchNorm1d(out_feat, 0.8))
            layers.append(nn.LeakyReLU(0.2, inplace=True))
            return layers

        self.model = nn.Sequential(
            *block(latent_dim, 128, normalize=False), *block(128, 256), nn.Linear(256, img_dim), nn.Tanh()
        )

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        return self.model(z).view(z.size(0), 1, 28, 28)


class Discriminator(nn.Module):
    """Lightning docs basic GAN discriminator (smaller)."""

    def __init__(self, img_dim: int = 784) -> None:
        super().__init__()
        self.model = nn.Sequential(
            nn.Linear(img_dim, 256),
            nn.LeakyReLU(0.2, inplace=True),
            nn.Linear(256, 128),
            nn.LeakyReLU(0.2, inplace=True),
            nn.Linear(128, 1),
            nn.Sigmoid(),
        )

    def forward(self, img: torch.Tensor) -> torch.Tensor:
        return self.model(img.view(img.size(0), -1))


class ManualGAN(LightningModule):
    """Lightning docs "Manual Optimization" / basic GAN: ``self.automatic_optimization = False``, two
    Adam optimizers, ``toggle_optimizer``, ``manual_backward``; ``z`` drawn with ``torch.randn`` on the
    CPU and ``type_as(imgs)``."""

    def __init__(self, latent_dim: int = 32, lr: float = 2e-4, b1: float = 0.5, b2: float = 0.999) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.automatic_optimization = False
        self.generator = Generator(latent_dim)
        self.discriminator = Discriminator()

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        return self.generator(z)

    def adversarial_loss(self, y_hat: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.binary_cross_entropy(y_hat, y)

    def training_step(self, batch, batch_idx):
        imgs, _ = batch
        optimizer_g, optimizer_d = self.optimizers()

        # sample noise
        z = self.sample_noise(imgs)

        # train generator
        self.toggle_optimizer(optimizer_g)
        valid = torch.ones(imgs.size(0), 1).type_as(imgs)
        g_loss = self.adversarial_loss(self.discriminator(self(z)), valid)
        self.log("g_loss", g_loss, prog_bar=True)
        self.manual_backward(g_loss)
        optimizer_g.step()
        optimizer_g.zero_grad()
        self.untoggle_optimizer(optimizer_g)

        # train discriminator
        self.toggle_optimizer(optimizer_d)
        valid = torch.ones(imgs.size(0), 1).type_as(imgs)
        real_loss = self.adversarial_loss(self.discriminator(imgs), valid)
        fake = torch.zeros(imgs.size(0), 1).type_as(imgs)
        fake_loss = self.adversarial_loss(self.discriminator(self(z).detach()), fake)
        d_loss = (real_loss + fake_loss) / 2
        self.log("d_loss", d_loss, prog_bar=True)
        self.manual_backward(d_loss)
        optimizer_d.step()
        optimizer_d.zero_grad()
        self.untoggle_optimizer(optimizer_d)

    def sample_noise(self, imgs: torch.Tensor) -> torch.Tensor:
        # the tutorial's two lines: drawn on the host, then copied to the batch's device
        z = torch.randn(imgs.shape[0], self.hparams.latent_dim)
        return z.type_as(imgs)

    def configure_optimizers(self):
        lr, b1, b2 = self.hparams.lr, self.hparams.b1, self.hparams.b2
        opt_g = torch.optim.Adam(self.generator.parameters(), lr=lr, betas=(b1, b2))
        opt_d = torch.optim.Adam(self.discriminator.parameters(), lr=lr, betas=(b1, b2))
        return [opt_g, opt_d], []


class ManualGANDeviceNoise(ManualGAN):
    """ManualGAN with its noise drawn on the device (``torch.randn(..., device=self.device)``), the fix
    the callback's warning names for the tutorial's draw on the host: the whole two-optimizer step, both
    Adam updates and the toggling, is one graph."""

    def sample_noise(self, imgs: torch.Tensor) -> torch.Tensor:
        return torch.randn(imgs.shape[0], self.hparams.latent_dim, device=self.device, dtype=imgs.dtype)


class ManualGANScheduled(ManualGANDeviceNoise):
    """ManualGANDeviceNoise with an exponential LR decay on each of its Adams, stepped by the step itself
    after both updates (under manual optimization Lightning leaves the schedulers to the step)."""

    def configure_optimizers(self):
        (opt_g, opt_d), _ = super().configure_optimizers()
        return [opt_g, opt_d], [
            torch.optim.lr_scheduler.ExponentialLR(opt_g, 0.97),
            torch.optim.lr_scheduler.ExponentialLR(opt_d, 0.95),
        ]

    def training_step(self, batch, batch_idx):
        super().training_step(batch, batch_idx)
        sch_g, sch_d = self.lr_schedulers()
        sch_g.step()
        sch_d.step()


# ------------------------------------------------------- found by a held-out idiom hunt (CPU emulator)
class _MSERegressor(LightningModule):
    """A small regression MLP with its MSE logged and Adam: the base of the modules below."""

    def __init__(self, dim: int = 64) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(dim, 128), nn.GELU(), nn.Linear(128, 1))

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.mse_loss(self.net(x).squeeze(-1), y)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=1e-3)


# --------------------------------------------------------------------------------------- loaders
def _digits_loader(n: int = 640, batch_size: int = 32, seed: int = 0) -> DataLoader:
    return _loader(*_digits(n, seed), batch_size=batch_size)


def _binary_digits_loader(n: int = 640, batch_size: int = 32, seed: int = 15) -> DataLoader:
    """The synthetic digits with a binary label (the class is 5 or more)."""
    x, y = _digits(n, seed)
    return _loader(x, (y >= 5).long(), batch_size=batch_size)


def _transitions_loader(
    n: int = 640, batch_size: int = 32, obs_dim: int = 8, n_actions: int = 4
) -> DataLoader:
    g = _generator(3)
    obs = torch.randn(n, obs_dim, generator=g)
    actions = torch.randint(0, n_actions, (n, 1), generator=g)
    rewards = torch.randn(n, generator=g)
    next_obs = obs + 0.1 * torch.randn(n, obs_dim, generator=g)
    dones = (torch.rand(n, generator=g) < 0.05).float()
    return _loader(obs, actions, rewards, next_obs, dones, batch_size=batch_size)


def _rollout_loader(n: int = 512, batch_size: int = 64, obs_dim: int = 8, n_actions: int = 4) -> DataLoader:
    """A synthetic PPO rollout: observations, actions, their log-probabilities, advantages, returns, values."""
    g = _generator(14)
    obs = torch.randn(n, obs_dim, generator=g)
    actions = torch.randint(0, n_actions, (n,), generator=g)
    logprobs = -torch.rand(n, generator=g) - math.log(n_actions) * 0.5
    advantages = torch.randn(n, generator=g)
    values = torch.randn(n, generator=g)
    return _loader(obs, actions, logprobs, advantages, values + advantages, values, batch_size=batch_size)


def _cifar_loader(n: int = 512, batch_size: int = 32) -> DataLoader:
    x, y = _digits(n, seed=4, channels=3, size=32)
    return _loader((x - 0.5) / 0.25, y, batch_size=batch_size)


def _mnist_example_loader() -> DataLoader:
    x, y = _digits(1600, seed=5)
    return _loader((x - 0.1307) / 0.3081, y, batch_size=64)  # 25 batches, the example's normalisation


def _tokens_loader(n: int = 512, seq: int = 32, vocab: int = 256, batch_size: int = 16) -> DataLoader:
    g = _generator(6)
    data = torch.randint(0, vocab, (n, seq + 1), generator=g)
    return _loader(data[:, :-1].contiguous(), data[:, 1:].contiguous(), batch_size=batch_size)


def _dlrm_loader(
    n: int = 1024, batch_size: int = 64, num_tables: int = 8, rows: int = 1000, bag: int = 2
) -> DataLoader:
    g = _generator(7)
    dense = torch.log1p(torch.rand(n, 13, generator=g) * 100)
    sparse = torch.randint(0, rows, (n, num_tables, bag), generator=g)
    clicks = (torch.rand(n, generator=g) < 0.25).float()
    return _loader(dense, sparse, clicks, batch_size=batch_size)


def _regression_loader(n: int, dim: int, batch_size: int, seed: int) -> DataLoader:
    return _loader(*_regression(n, dim, seed), batch_size=batch_size)


def _corrupt_regression_loader(bad_batch: int = 13) -> DataLoader:
    """The regression batches (n 640, dim 64, batch 32), one sample of batch `bad_batch` holding an inf."""
    x, y = _regression(640, 64, 21)
    x[bad_batch * 32 + 3, 5] = float("inf")
    return _loader(x, y, batch_size=32)


def _hydra_template_module() -> HydraTemplateMNIST:
    """What Hydra's ``instantiate`` builds from the template's ``configs/model/mnist.yaml``."""
    optimizer = functools.partial(torch.optim.Adam, lr=1e-3, weight_decay=0.0)  # `_partial_: true`
    return HydraTemplateMNIST(net=SimpleDenseNet(), optimizer=optimizer)


class RNNModel(nn.Module):
    """pytorch/examples ``word_language_model``'s model: encoder, a recurrent layer, decoder."""

    def __init__(self, ntoken: int, ninp: int, nhid: int, nlayers: int, dropout: float = 0.2) -> None:
        super().__init__()
        self.ntoken = ntoken
        self.drop = nn.Dropout(dropout)
        self.encoder = nn.Embedding(ntoken, ninp)
        self.rnn = nn.LSTM(ninp, nhid, nlayers, dropout=dropout)
        self.decoder = nn.Linear(nhid, ntoken)
        self.nlayers, self.nhid = nlayers, nhid

    def forward(self, input, hidden):
        emb = self.drop(self.encoder(input))
        output, hidden = self.rnn(emb, hidden)
        output = self.drop(output)
        decoded = self.decoder(output).view(-1, self.ntoken)
        return F.log_softmax(decoded, dim=1), hidden

    def init_hidden(self, bsz: int):
        weight = next(self.parameters())
        return (
            weight.new_zeros(self.nlayers, bsz, self.nhid),
            weight.new_zeros(self.nlayers, bsz, self.nhid),
        )


def repackage_hidden(h):
    """Wraps hidden states in new Tensors, to detach them from their history (the example's helper)."""
    if isinstance(h, torch.Tensor):
        return h.detach()
    return tuple(repackage_hidden(v) for v in h)


class WordLanguageModel(LightningModule):
    """pytorch/examples ``word_language_model`` as a LightningModule: a 2-layer LSTM over batchified
    text (``(bptt, batch)`` chunks in order), the hidden state kept on the module and carried across
    steps under ``repackage_hidden``, ``init_hidden`` at every epoch start, SGD with momentum, value
    clipping (``gradient_clip_algorithm="value"``) and ReduceLROnPlateau on the epoch's loss."""

    def __init__(
        self, ntoken: int = 200, ninp: int = 64, nhid: int = 64, nlayers: int = 2, batch_size: int = 8
    ):
        super().__init__()
        self.model = RNNModel(ntoken, ninp, nhid, nlayers)
        self.batch_size = batch_size
        self.hidden = None

    def on_train_epoch_start(self):
        self.hidden = self.model.init_hidden(self.batch_size)

    def training_step(self, batch, batch_idx):
        data, targets = batch
        data, targets = data.t(), targets.t()  # the loader batches chunks; the model is sequence-first
        self.hidden = repackage_hidden(self.hidden)
        output, self.hidden = self.model(data, self.hidden)
        loss = F.nll_loss(output, targets.reshape(-1))
        self.log("train_loss", loss, on_step=True, on_epoch=True)
        return loss

    def configure_optimizers(self):
        optimizer = torch.optim.SGD(self.parameters(), lr=1.0, momentum=0.9)
        scheduler = torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer, factor=0.25, patience=0)
        return {
            "optimizer": optimizer,
            "lr_scheduler": {"scheduler": scheduler, "monitor": "train_loss_epoch"},
        }


class StatefulLSTMEncoder(nn.Module):
    """A layer that keeps its own LSTM state across calls (``self.state = tuple(s.detach() ...)`` in
    ``forward``), as stateful sequence encoders do: the carried state lives on a submodule."""

    def __init__(self, ninp: int, nhid: int) -> None:
        super().__init__()
        self.rnn = nn.LSTM(ninp, nhid)
        self.state = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out, state = self.rnn(x, self.state)
        self.state = tuple(s.detach() for s in state)
        return out


class LayerKeepsItsLSTMState(LightningModule):
    """Token streams through an embedding and a :class:`StatefulLSTMEncoder`: the hidden state is
    carried by the layer, not by the LightningModule (reset at each epoch start)."""

    def __init__(self, ntoken: int = 200, ninp: int = 64, nhid: int = 64) -> None:
        super().__init__()
        self.embed = nn.Embedding(ntoken, ninp)
        self.encoder = StatefulLSTMEncoder(ninp, nhid)
        self.decoder = nn.Linear(nhid, ntoken)

    def on_train_epoch_start(self):
        self.encoder.state = None

    def training_step(self, batch, batch_idx):
        data, targets = batch
        out = self.encoder(self.embed(data.t()))
        return F.cross_entropy(self.decoder(out).flatten(0, 1), targets.t().reshape(-1))

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=1e-3)


def _text_loader(
    n_tokens: int = 8 * 35 * 21, bptt: int = 35, batch_size: int = 8, vocab: int = 200
) -> DataLoader:
    """Synthetic text batchified as the example does: ``batch_size`` streams, chunks of ``bptt`` in order."""
    g = _generator(16)
    # a learnable stream: each token mostly follows from the one before
    tokens = torch.empty(n_tokens + 1, dtype=torch.long)
    tokens[0] = 0
    jumps = torch.randint(0, vocab, (n_tokens,), generator=g)
    keep = torch.rand(n_tokens, generator=g) < 0.7
    for i in range(n_tokens):
        tokens[i + 1] = (tokens[i] * 7 + 3) % vocab if keep[i] else jumps[i]
    streams = tokens[: (n_tokens // batch_size) * batch_size + 1]
    data = streams[:-1].view(batch_size, -1)  # (batch, time)
    target = streams[1:].view(batch_size, -1)
    chunks = data.size(1) // bptt
    x = torch.stack([data[:, i * bptt : (i + 1) * bptt] for i in range(chunks)])  # (chunk, batch, bptt)
    y = torch.stack([target[:, i * bptt : (i + 1) * bptt] for i in range(chunks)])
    # one chunk per step, its (batch, bptt) block as it is (batch_size=None: no batching on top)
    return DataLoader(TensorDataset(x, y), batch_size=None, shuffle=False)


class AdamWOneCycleMomentum(_MSERegressor):
    """Lightning's docs recipe: ``OneCycleLR`` over ``trainer.estimated_stepping_batches``, stepped per
    batch, on foreach AdamW, with the scheduler's default ``cycle_momentum=True`` (it cycles beta1)."""

    def configure_optimizers(self):
        optimizer = torch.optim.AdamW(self.parameters(), lr=1e-3, weight_decay=0.01, foreach=True)
        scheduler = OneCycleLR(
            optimizer, max_lr=1e-2, total_steps=int(self.trainer.estimated_stepping_batches)
        )
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


# -------------------------------------------------------------------------------------- registry
@dataclass(frozen=True)
class Idiom:
    """One idiom: how to build it, how to fit it, and what the callback should do with it."""

    name: str
    make_module: Callable[[], LightningModule]
    make_loader: Callable[[], DataLoader]
    expect: str  # "capture" or "refuse"
    why: str
    trainer_kwargs: dict[str, Any] = field(default_factory=lambda: {"max_steps": DEFAULT_STEPS})
    callback_kwargs: dict[str, Any] = field(default_factory=dict)
    # optimizer steps per batch: Lightning's max_steps and global_step count optimizer steps, so a
    # module stepping two optimizers per batch needs twice the max_steps for the same batches
    optimizer_steps_per_batch: int = 1

    def __post_init__(self) -> None:
        if self.expect not in ("capture", "refuse"):
            raise ValueError(f"{self.name}: expect must be 'capture' or 'refuse', got {self.expect!r}")


def _steps(**kwargs: Any) -> dict[str, Any]:
    return {"max_steps": DEFAULT_STEPS, **kwargs}


_IDIOM_LIST = [
    Idiom(
        "autoencoder",
        LitAutoEncoder,
        _digits_loader,
        "capture",
        "one tensor self.log and foreach Adam: the case the callback was built for",
    ),
    Idiom(
        "preds_metrics_on_batch_end",
        PredsMetricsOnBatchEnd,
        _digits_loader,
        "capture",
        "metrics are updated outside the graph, from the per-step outputs training_step returns",
    ),
    Idiom(
        "dqn_target_sync",
        DQNTargetSync,
        _transitions_loader,
        "capture",
        "the steps whose global_step branch differs (target sync) must run eagerly, the rest replayed",
    ),
    Idiom(
        "docs_lr_warmup",
        DocsLRWarmup,
        _digits_loader,
        "capture",
        "the optimizer_step override only sets param-group LRs around optimizer.step(closure)",
    ),
    Idiom(
        "sgd_onecycle_clip",
        SGDOneCycleClip,
        _cifar_loader,
        "refuse",
        "OneCycleLR cycles SGD's momentum every step, a float baked into the graph (its LR is a tensor)",
        trainer_kwargs=_steps(gradient_clip_val=1.0),
    ),
    Idiom(
        "print_item_every_50",
        PrintItemEvery50,
        _mnist_example_loader,
        "capture",
        "the .item() print runs only every 50 batches; the epoch StepLR changes the LR twice",
    ),
    Idiom(
        "hydra_template_mnist",
        _hydra_template_module,
        functools.partial(_digits_loader, n=1000, batch_size=64, seed=8),
        "capture",
        "MeanMetric and Accuracy have tensor states that can update inside the graph",
    ),
    Idiom(
        "torchmetrics_docs_forward",
        TorchmetricsDocsForward,
        _digits_loader,
        "capture",
        "Accuracy has tensor states; its forward value and update count can be re-applied per replay",
    ),
    Idiom(
        "macro_metric_collection",
        MacroMetricCollection,
        _digits_loader,
        "capture",
        "macro averages count classes with torch.bincount (a sync); traced and captured, an index_add_ counts alike",
    ),
    Idiom(
        "cpu_causal_mask_transformer",
        CPUCausalMaskTransformer,
        _tokens_loader,
        "capture",
        "the CPU-built causal mask has the same bytes every step: a constant",
    ),
    Idiom(
        "dlrm_cpu_indices",
        DLRMInteraction,
        _dlrm_loader,
        "capture",
        "the CPU-built interaction indices have the same bytes every step: constants",
    ),
    Idiom(
        "grad_norm_logging",
        GradNormLogging,
        _digits_loader,
        "capture",
        "on_before_optimizer_step only computes tensors and logs them",
    ),
    Idiom(
        "vae_randn",
        VAERandn,
        functools.partial(_digits_loader, seed=9),
        "capture",
        "randn_like draws from the CUDA generator, which graphs replay with fresh offsets",
    ),
    Idiom(
        "grad_checkpointing",
        GradCheckpointing,
        functools.partial(_regression_loader, n=512, dim=32, batch_size=32, seed=10),
        "capture",
        "non-reentrant checkpointing recomputes inside backward: all of it is in the graph",
    ),
    Idiom(
        "ema_on_batch_end",
        EMAOnBatchEnd,
        functools.partial(_regression_loader, n=640, dim=64, batch_size=32, seed=11),
        "capture",
        "the EMA update runs eagerly in on_train_batch_end, after each replay",
    ),
    Idiom(
        "bf16_true_lambdalr",
        Bf16TrueLambdaLR,
        functools.partial(_regression_loader, n=640, dim=256, batch_size=32, seed=12),
        "capture",
        "AdamW reads a tensor LR; the logged get_last_lr() float must be re-evaluated per replay",
        trainer_kwargs=_steps(precision="bf16-true"),
    ),
    Idiom(
        "cleanrl_ppo",
        CleanRLPPO,
        _rollout_loader,
        "capture",
        "torch.distributions' argument checks sync; like torchmetrics' they run in eager steps, not in replays",
        trainer_kwargs=_steps(gradient_clip_val=0.5),
    ),
    Idiom(
        "manual_gan",
        ManualGAN,
        functools.partial(_digits_loader, seed=13),
        "refuse",
        "manual optimization with two optimizers is captured (manual_gan_device_noise), but the tutorial "
        "draws its noise on the host (`torch.randn` without a device), which a replay cannot redraw: it "
        "trains eagerly, with a warning naming the line and `device=self.device`",
        trainer_kwargs=_steps(max_steps=2 * DEFAULT_STEPS),
        optimizer_steps_per_batch=2,
    ),
]

_IDIOM_LIST += [
    Idiom(
        "word_language_model",
        WordLanguageModel,
        _text_loader,
        "capture",
        "the LSTM's hidden state is carried across steps on the module (repackage_hidden): replays carry it too",
        trainer_kwargs=_steps(gradient_clip_val=0.25, gradient_clip_algorithm="value"),
    ),
    Idiom(
        "adamw_onecycle_momentum",
        AdamWOneCycleMomentum,
        functools.partial(_regression_loader, n=640, dim=64, batch_size=16, seed=17),
        "refuse",
        "OneCycleLR cycles AdamW's beta1 every step (cycle_momentum=True): refused, and the fit equals plain",
    ),
]

IDIOMS: dict[str, Idiom] = {idiom.name: idiom for idiom in _IDIOM_LIST}
