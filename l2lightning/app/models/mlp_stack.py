"""MLP stack family: N × (LayerNorm, Linear d×d, GELU) blocks with a regression or classification head.

This is the chain the prefetch was measured on: every block reads one d×d weight matrix, so the next
block's weights are the obvious thing to warm L2 with. `block="linear_relu"` gives the plain
`nn.Sequential(Linear, ReLU, ...)` chain instead. Data: `VectorData` (inputs and targets from a fixed
random teacher network, sized by config) or `DigitsData` (scikit-learn's bundled 8×8 digits, no download).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
import torchmetrics
from torch import nn
from torch.utils.data import Dataset, TensorDataset

from l2lightning.app.models._common import (
    FamilyModule,
    SyntheticDataModule,
    check_choice,
    check_int,
    cross_entropy,
    parse_dtype,
)

TASKS = ("regression", "classification")
BLOCKS = ("ln_linear_gelu", "linear_relu")


def make_block(kind: str, width: int) -> nn.Sequential:
    """One chain block: (LayerNorm, Linear, GELU) or (Linear, ReLU)."""
    if kind == "ln_linear_gelu":
        return nn.Sequential(nn.LayerNorm(width), nn.Linear(width, width), nn.GELU())
    return nn.Sequential(nn.Linear(width, width), nn.ReLU())


class MLPStack(FamilyModule):
    """`depth` × (LayerNorm, Linear width×width, GELU) with a regression or classification head.

    Args:
        width: the blocks' width d (each block reads a d×d weight).
        depth: number of blocks N.
        in_features: input features; ``None`` = `width` (no input projection).
        task: ``"regression"`` (MSE on `out_features` targets) or ``"classification"``
            (cross-entropy over `num_classes`).
        num_classes: classes for ``task="classification"``.
        out_features: targets per sample for ``task="regression"``.
        block: ``"ln_linear_gelu"`` or ``"linear_relu"`` (a plain nn.Sequential chain).
        dtype: parameter dtype, ``"float32"``, ``"bfloat16"`` or ``"float16"``; inputs are cast to it.
        lr: AdamW learning rate.
        weight_decay: AdamW weight decay.

    Example:
        >>> model = MLPStack(width=64, depth=2)
        >>> model(torch.randn(4, 64)).shape
        torch.Size([4, 1])
    """

    def __init__(
        self,
        width: int = 1024,
        depth: int = 8,
        in_features: int | None = None,
        task: str = "regression",
        num_classes: int = 10,
        out_features: int = 1,
        block: str = "ln_linear_gelu",
        dtype: str = "float32",
        lr: float = 1e-3,
        weight_decay: float = 0.01,
    ) -> None:
        super().__init__(lr, weight_decay)
        check_int("width", width)
        check_int("depth", depth)
        in_features = width if in_features is None else check_int("in_features", in_features)
        check_choice("task", task, TASKS)
        check_int("num_classes", num_classes, low=2)
        check_int("out_features", out_features)
        check_choice("block", block, BLOCKS)
        self.param_dtype = parse_dtype(dtype)
        self.save_hyperparameters()
        self.task = task
        self.stem = nn.Identity() if in_features == width else nn.Linear(in_features, width)
        self.blocks = nn.Sequential(*[make_block(block, width) for _ in range(depth)])
        self.head = nn.Linear(width, num_classes if task == "classification" else out_features)
        for module in (self.stem, self.blocks, self.head):
            module.to(self.param_dtype)
        if task == "classification":
            self.use_class_accuracy(num_classes)
        else:
            self.register_buffer("class_ids", torch.arange(num_classes), persistent=False)
            self.metric_name = "mse"
            self.train_metric = torchmetrics.MeanSquaredError()
            self.val_metric = torchmetrics.MeanSquaredError()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(self.stem(x.to(self.param_dtype))))

    def _loss(self, out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        if self.task == "classification":
            return cross_entropy(out, target, self.class_ids)
        return F.mse_loss(out.float(), target)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, target = batch
        out = self(x)
        loss = self._loss(out, target)
        self.log("train/loss", loss, batch_size=x.shape[0])
        return self.with_train_metric(loss, out.detach().float(), target)

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, target = batch
        out = self(x)
        self.log_validation(self._loss(out, target), out.float(), target)


class VectorData(SyntheticDataModule):
    """Random input vectors with targets from a fixed random teacher network.

    Regression targets are ``tanh(x W1 / sqrt(F)) W2`` plus a little noise; class labels are the
    teacher's argmax. Both are learnable, so the loss falls when training works.

    Args:
        num_features: input features (the model's `in_features`).
        task: ``"regression"`` or ``"classification"``.
        num_classes: classes for classification.
        out_features: targets per sample for regression.
        noise: standard deviation of the noise added to regression targets.
        batch_size, train_batches, val_batches, seed, num_workers, pin_memory: see `SyntheticDataModule`.
    """

    def __init__(
        self,
        num_features: int = 1024,
        task: str = "regression",
        num_classes: int = 10,
        out_features: int = 1,
        noise: float = 0.05,
        batch_size: int = 8,
        train_batches: int = 64,
        val_batches: int = 4,
        seed: int = 0,
        num_workers: int = 0,
        pin_memory: bool = False,
    ) -> None:
        super().__init__(batch_size, train_batches, val_batches, seed, num_workers, pin_memory)
        self.num_features = check_int("num_features", num_features)
        self.task = check_choice("task", task, TASKS)
        self.num_classes = check_int("num_classes", num_classes, low=2)
        self.out_features = check_int("out_features", out_features)
        self.noise = float(noise)

    def make_dataset(self, split: str, num_samples: int, seed: int) -> Dataset:
        # The teacher is the same for every split (seeded by self.seed); the inputs differ per split.
        teacher = torch.Generator().manual_seed(self.seed)
        hidden = 64
        w1 = torch.randn(self.num_features, hidden, generator=teacher) / self.num_features**0.5
        w2 = torch.randn(hidden, self.out_features, generator=teacher) / hidden**0.5
        wc = torch.randn(self.num_features, self.num_classes, generator=teacher)
        gen = torch.Generator().manual_seed(seed * 7919 + 17)
        x = torch.randn(num_samples, self.num_features, generator=gen)
        if self.task == "classification":
            return TensorDataset(x, (x @ wc).argmax(dim=1))
        y = torch.tanh(x @ w1) @ w2
        y = y + self.noise * torch.randn(y.shape, generator=gen)
        return TensorDataset(x, y)


class DigitsData(SyntheticDataModule):
    """scikit-learn's bundled handwritten digits (1797 images of 8×8 pixels, 10 classes), no download.

    Features are scaled to [0, 1] and standardised with the training split's statistics. The last
    ``val_batches * batch_size`` samples (after a seeded shuffle) are the validation split; the
    training split is cut to a whole number of batches.

    Args:
        num_features: must be 64 (8×8 pixels); there to catch a model configured for other inputs.
        num_classes: must be 10.
        batch_size, val_batches, seed, num_workers, pin_memory: see `SyntheticDataModule`
            (`train_batches` is fixed by the dataset's size).
    """

    def __init__(
        self,
        num_features: int = 64,
        num_classes: int = 10,
        batch_size: int = 8,
        val_batches: int = 16,
        seed: int = 0,
        num_workers: int = 0,
        pin_memory: bool = False,
    ) -> None:
        if num_features != 64:
            raise ValueError(
                f"`num_features` must be 64 for the digits dataset (8×8 pixels), got {num_features!r}; "
                "set model.in_features=64"
            )
        if num_classes != 10:
            raise ValueError(f"`num_classes` must be 10 for the digits dataset, got {num_classes!r}")
        super().__init__(batch_size, 1, val_batches, seed, num_workers, pin_memory)
        self._arrays: tuple[torch.Tensor, torch.Tensor] | None = None

    def _load(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self._arrays is None:
            try:
                from sklearn.datasets import load_digits
            except ImportError as exc:
                raise ImportError(
                    "the digits dataset needs scikit-learn: `pip install scikit-learn` "
                    "(or `pip install 'l2lightning[data]'`)"
                ) from exc
            data = load_digits()
            x = torch.tensor(data.data, dtype=torch.float32) / 16.0
            y = torch.tensor(data.target, dtype=torch.int64)
            order = torch.randperm(len(y), generator=torch.Generator().manual_seed(self.seed))
            self._arrays = (x[order], y[order])
        return self._arrays

    def setup(self, stage: str | None = None) -> None:
        x, y = self._load()
        n_val = self.val_batches * self.batch_size
        n_train = (len(y) - n_val) // self.batch_size * self.batch_size
        if n_train < self.batch_size:
            raise ValueError(
                f"`val_batches` * `batch_size` = {n_val} leaves fewer than one training batch of the "
                f"{len(y)} digits; lower `val_batches` or `batch_size`"
            )
        self.train_batches = n_train // self.batch_size
        mean, std = x[:n_train].mean(dim=0), x[:n_train].std(dim=0).clamp_min(1e-3)
        x = (x - mean) / std
        self.train_set = TensorDataset(x[:n_train], y[:n_train])
        self.val_set = TensorDataset(x[len(y) - n_val :], y[len(y) - n_val :]) if n_val else None
