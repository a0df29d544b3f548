"""Shared pieces of the model families: the LightningModule base, the data-module base, capture-safe losses.

Every family follows one rule that lets `L2GraphCallback` capture its training step in a CUDA graph:
`training_step` does tensor math, `self.log(...)` and torchmetrics updates of tensor-state metrics
only (no `.item()`, no Python branching on tensor values, no per-step `compute`) and returns detached
predictions. Losses here also avoid ops that have no
deterministic CUDA kernel (`nll_loss`, adaptive pooling, `index_select`/`gather` backward), so
`use_deterministic_algorithms(True)` holds and the callback's bitwise verify can pass.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def parse_dtype(dtype: str | torch.dtype) -> torch.dtype:
    """`"float32"` / `"bfloat16"` / `"float16"` (or the torch dtype itself) as a torch dtype."""
    if isinstance(dtype, torch.dtype) and dtype in DTYPES.values():
        return dtype
    if isinstance(dtype, str) and dtype.removeprefix("torch.") in DTYPES:
        return DTYPES[dtype.removeprefix("torch.")]
    raise ValueError(f"`dtype` must be one of {sorted(DTYPES)}, got {dtype!r}")


def check_int(name: str, value: Any, low: int = 1) -> int:
    """`value` if it is an int >= `low`, else a ValueError naming the argument."""
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"`{name}` must be an int >= {low}, got {value!r}")
    return value


def check_choice(name: str, value: Any, choices: tuple[str, ...]) -> str:
    if value not in choices:
        raise ValueError(f"`{name}` must be one of {choices}, got {value!r}")
    return value


def check_sizes(name: str, value: Any) -> list[int]:
    """A non-empty list of positive layer widths."""
    sizes = list(value) if hasattr(value, "__iter__") and not isinstance(value, str) else None
    if not sizes or any(isinstance(s, bool) or not isinstance(s, int) or s < 1 for s in sizes):
        raise ValueError(f"`{name}` must be a non-empty list of positive ints, got {value!r}")
    return sizes


def cross_entropy(logits: torch.Tensor, target: torch.Tensor, class_ids: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy of `logits` (B, C) against integer `target` (B,), computed in float32.

    Same value as `F.cross_entropy`, but built from a one-hot mask (`target == class_ids`) instead of
    `nll_loss`, whose CUDA kernel is refused under `torch.use_deterministic_algorithms(True)`, and
    without `F.one_hot`, which checks the targets' range on the host.
    """
    log_probs = F.log_softmax(logits.float(), dim=-1)
    one_hot = (target.unsqueeze(-1) == class_ids).to(log_probs.dtype)
    return -(one_hot * log_probs).sum(dim=-1).mean()


def mlp(
    sizes: list[int], activation: type[nn.Module] = nn.ReLU, last_activation: bool = False
) -> nn.Sequential:
    """Linear layers through `sizes` (in, hidden..., out) with `activation` between them."""
    layers: list[nn.Module] = []
    for i, (a, b) in enumerate(zip(sizes[:-1], sizes[1:])):
        layers.append(nn.Linear(a, b))
        if i < len(sizes) - 2 or last_activation:
            layers.append(activation())
    return nn.Sequential(*layers)


def adamw_implementation(device: torch.device) -> dict[str, bool]:
    """AdamW's implementation for parameters on `device`: ``fused`` on CUDA, ``foreach`` elsewhere.

    On CUDA, fused AdamW updates every parameter in one kernel per step; foreach AdamW makes a dozen
    passes over parameters, gradients and states, which in a captured step is most of a small
    family's replay (README: "Use a fused optimizer"). Both are capturable and bitwise the callback's
    baseline on the H200. On CPU the families keep foreach: capturable fused AdamW on CPU differs from
    its plain path in the last bits, and the CPU tests compare the callback (on the graph emulator)
    bit for bit with plain training.
    """
    return {"fused": True} if device.type == "cuda" else {"foreach": True}


class FamilyModule(pl.LightningModule):
    """Base of every model family: AdamW from config (fused on CUDA), the training metric updated inside the step.

    Subclasses set ``self.train_metric`` / ``self.val_metric`` (torchmetrics) and ``self.metric_name``,
    and return ``self.with_train_metric(loss, preds, target)`` (detached preds and target) from
    ``training_step``.
    """

    metric_name = "metric"

    def __init__(self, lr: float = 1e-3, weight_decay: float = 0.0) -> None:
        super().__init__()
        if isinstance(lr, bool) or not isinstance(lr, (int, float)) or lr <= 0:
            raise ValueError(f"`lr` must be a positive number, got {lr!r}")
        if isinstance(weight_decay, bool) or not isinstance(weight_decay, (int, float)) or weight_decay < 0:
            raise ValueError(f"`weight_decay` must be a number >= 0, got {weight_decay!r}")
        self.lr = float(lr)
        self.weight_decay = float(weight_decay)

    def use_class_accuracy(self, num_classes: int) -> None:
        """Set up a classifier's metric: ``class_ids`` for the one-hot loss, train/val accuracy."""
        import torchmetrics

        self.register_buffer("class_ids", torch.arange(num_classes), persistent=False)
        self.metric_name = "acc"
        self.train_metric = torchmetrics.classification.MulticlassAccuracy(
            num_classes, average="micro", validate_args=False
        )
        self.val_metric = torchmetrics.classification.MulticlassAccuracy(
            num_classes, average="micro", validate_args=False
        )

    def configure_optimizers(self) -> torch.optim.Optimizer:
        impl = adamw_implementation(self.device)
        return torch.optim.AdamW(self.parameters(), lr=self.lr, weight_decay=self.weight_decay, **impl)

    def with_train_metric(
        self, loss: torch.Tensor, preds: torch.Tensor, target: torch.Tensor
    ) -> torch.Tensor:
        """Update the training metric from the step's detached `preds` and `target`; return `loss`.

        Called at the end of ``training_step``, the idiomatic place: the metric's tensor states update
        inside the captured graph, and ``L2GraphCallback`` re-applies its Python-side state per replay.
        Only ``update`` runs per step (no per-step ``compute``: some metrics, such as
        ``ExplainedVariance``, compute with boolean indexing, a host sync); the value is logged per epoch.
        The step returns the loss alone: nothing reads predictions from the step's outputs, and each
        tensor returned besides the loss costs a copy per replayed step (the graph overwrites its own).
        """
        self.train_metric.update(preds, target)
        self.log(
            f"train/{self.metric_name}",
            self.train_metric,
            on_step=False,
            on_epoch=True,
            batch_size=preds.shape[0],
        )
        return loss

    def log_validation(self, loss: torch.Tensor, preds: torch.Tensor, target: torch.Tensor) -> None:
        """Validation loss and metric, accumulated over the epoch."""
        self.val_metric.update(preds, target)
        batch_size = preds.shape[0]
        self.log("val/loss", loss, on_step=False, on_epoch=True, batch_size=batch_size)
        self.log(
            f"val/{self.metric_name}", self.val_metric, on_step=False, on_epoch=True, batch_size=batch_size
        )


class ClassifierFamily(FamilyModule):
    """A family whose batch is ``(inputs, labels)`` and whose forward returns class logits.

    Subclasses call :meth:`use_class_accuracy` in ``__init__`` (``class_ids`` and the accuracy metrics).
    """

    class_ids: torch.Tensor

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        inputs, labels = batch
        logits = self(inputs)
        loss = cross_entropy(logits, labels, self.class_ids)
        self.log("train/loss", loss, batch_size=inputs.shape[0])
        return self.with_train_metric(loss, logits.detach().float(), labels)

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        inputs, labels = batch
        logits = self(inputs)
        self.log_validation(cross_entropy(logits, labels, self.class_ids), logits.float(), labels)


class SyntheticDataModule(pl.LightningDataModule):
    """Map-style data sized in whole batches, so every batch has the same shape (static for a CUDA graph).

    Subclasses implement ``make_dataset(split, num_samples, seed)``. The train set has
    ``train_batches * batch_size`` samples, the validation set ``val_batches * batch_size``
    (``val_batches=0``: no validation). ``drop_last`` stays False: no sample is silently dropped.
    """

    def __init__(
        self,
        batch_size: int = 8,
        train_batches: int = 64,
        val_batches: int = 4,
        seed: int = 0,
        num_workers: int = 0,
        pin_memory: bool = False,
    ) -> None:
        super().__init__()
        self.batch_size = check_int("batch_size", batch_size)
        self.train_batches = check_int("train_batches", train_batches)
        self.val_batches = check_int("val_batches", val_batches, low=0)
        self.seed = check_int("seed", seed, low=0)
        self.num_workers = check_int("num_workers", num_workers, low=0)
        self.pin_memory = bool(pin_memory)
        self.train_set: Dataset | None = None
        self.val_set: Dataset | None = None

    def make_dataset(self, split: str, num_samples: int, seed: int) -> Dataset:
        raise NotImplementedError

    def setup(self, stage: str | None = None) -> None:
        if self.train_set is None:
            self.train_set = self.make_dataset("train", self.train_batches * self.batch_size, self.seed)
        if self.val_set is None and self.val_batches:
            self.val_set = self.make_dataset("val", self.val_batches * self.batch_size, self.seed + 1)

    def _loader(self, dataset: Dataset | None, shuffle: bool) -> DataLoader:
        if dataset is None:
            raise RuntimeError("call `setup()` before asking for a dataloader (the Trainer does this)")
        return DataLoader(
            dataset,
            batch_size=self.batch_size,
            shuffle=shuffle,
            drop_last=False,
            num_workers=self.num_workers,
            pin_memory=self.pin_memory,
            generator=torch.Generator().manual_seed(self.seed) if shuffle else None,
            persistent_workers=self.num_workers > 0,
        )

    def train_dataloader(self) -> DataLoader:
        return self._loader(self.train_set, shuffle=True)

    def val_dataloader(self) -> DataLoader | list:
        if not self.val_batches:
            return []
        return self._loader(self.val_set, shuffle=False)
