"""Recommender family: a DLRM-style click model on synthetic power-law (Zipf) categorical IDs.

Dense features go through a bottom MLP; each categorical feature is a bag of `ids_per_bag` IDs summed
by an `nn.EmbeddingBag` (a fixed bag size, so the indices are one dense (B, bag) tensor and every
batch has the same shape); the pairwise dot products of the bottom output and the bag embeddings
(DLRM's feature interaction) and the bottom output feed a 1024-wide FP32 top MLP that predicts the
click logit.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
import torchmetrics
from torch import nn
from torch.utils.data import Dataset, TensorDataset

from l2lightning.app.models._common import (
    FamilyModule,
    SyntheticDataModule,
    check_int,
    check_sizes,
    mlp,
    parse_dtype,
)


def pair_selector(num_features: int) -> torch.Tensor:
    """A 0/1 matrix (F*F, F*(F-1)/2) that picks the strict upper triangle of a flattened F×F matrix.

    Multiplying by it instead of indexing keeps the backward deterministic on CUDA (index/gather
    backward accumulates with atomics) and exact (each output is one product with 1, plus zeros).
    """
    rows, cols = torch.triu_indices(num_features, num_features, offset=1)
    select = torch.zeros(num_features * num_features, rows.numel())
    select[rows * num_features + cols, torch.arange(rows.numel())] = 1.0
    return select


class Recommender(FamilyModule):
    """DLRM-style click model: embedding bags + bottom MLP + pairwise dot interaction + top MLP.

    Args:
        num_dense: dense features per sample.
        num_tables: categorical features (one embedding table each).
        num_embeddings: rows per table.
        embedding_dim: embedding width (the bottom MLP ends at this width too).
        ids_per_bag: IDs per categorical feature and sample (summed by the bag).
        bottom_mlp: hidden widths of the bottom MLP.
        top_mlp: hidden widths of the top MLP.
        dtype: parameter dtype (``"float32"`` as in DLRM training, or ``"bfloat16"``).
        lr: AdamW learning rate.
        weight_decay: AdamW weight decay.

    Example:
        >>> model = Recommender(num_tables=2, num_embeddings=50, embedding_dim=8, bottom_mlp=[16], top_mlp=[16])
        >>> model(torch.randn(3, 13), torch.randint(0, 50, (3, 2, 4))).shape
        torch.Size([3])
    """

    metric_name = "acc"

    def __init__(
        self,
        num_dense: int = 13,
        num_tables: int = 8,
        num_embeddings: int = 20000,
        embedding_dim: int = 64,
        ids_per_bag: int = 4,
        bottom_mlp: Sequence[int] = (512, 256),
        top_mlp: Sequence[int] = (1024, 1024, 512),
        dtype: str = "float32",
        lr: float = 1e-3,
        weight_decay: float = 0.0,
    ) -> None:
        super().__init__(lr, weight_decay)
        check_int("num_dense", num_dense)
        check_int("num_tables", num_tables)
        check_int("num_embeddings", num_embeddings)
        check_int("embedding_dim", embedding_dim)
        check_int("ids_per_bag", ids_per_bag)
        bottom_mlp, top_mlp = check_sizes("bottom_mlp", bottom_mlp), check_sizes("top_mlp", top_mlp)
        self.param_dtype = parse_dtype(dtype)
        self.save_hyperparameters()
        self.embeddings = nn.ModuleList(
            nn.EmbeddingBag(num_embeddings, embedding_dim, mode="sum") for _ in range(num_tables)
        )
        self.bottom = mlp([num_dense, *bottom_mlp, embedding_dim], last_activation=True)
        num_features = num_tables + 1
        num_pairs = num_features * (num_features - 1) // 2
        self.top = mlp([embedding_dim + num_pairs, *top_mlp, 1])
        for module in (self.embeddings, self.bottom, self.top):
            module.to(self.param_dtype)
        self.register_buffer(
            "pair_select", pair_selector(num_features).to(self.param_dtype), persistent=False
        )
        self.train_metric = torchmetrics.classification.BinaryAccuracy(validate_args=False)
        # binned AUROC: constant memory, and no float cumsum (refused on CUDA in deterministic mode)
        self.val_metric = torchmetrics.classification.BinaryAUROC(thresholds=200, validate_args=False)

    def forward(self, dense: torch.Tensor, sparse: torch.Tensor) -> torch.Tensor:
        """Click logits (B,) from dense features (B, num_dense) and IDs (B, num_tables, ids_per_bag)."""
        bottom = self.bottom(dense.to(self.param_dtype))  # (B, D)
        bags = [table(sparse[:, t]) for t, table in enumerate(self.embeddings)]  # num_tables × (B, D)
        features = torch.stack([bottom, *bags], dim=1)  # (B, F, D)
        dots = torch.bmm(features, features.transpose(1, 2))  # (B, F, F)
        pairs = dots.flatten(1) @ self.pair_select  # (B, F*(F-1)/2)
        return self.top(torch.cat([bottom, pairs], dim=1)).squeeze(-1)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        dense, sparse, clicks = batch
        logits = self(dense, sparse).float()
        loss = F.binary_cross_entropy_with_logits(logits, clicks)
        self.log("train/loss", loss, batch_size=dense.shape[0])
        # hard predictions: a float input would make torchmetrics check its range on the host
        return self.with_train_metric(loss, (logits.detach() > 0).long(), clicks.long())

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        dense, sparse, clicks = batch
        logits = self(dense, sparse).float()
        loss = F.binary_cross_entropy_with_logits(logits, clicks)
        self.val_metric.update(torch.sigmoid(logits), clicks.long())
        self.log("val/loss", loss, on_epoch=True, batch_size=dense.shape[0])
        self.log("val/auroc", self.val_metric, on_epoch=True, batch_size=dense.shape[0])


class ClickData(SyntheticDataModule):
    """Synthetic click logs: Gaussian dense features, Zipf-distributed IDs, clicks from a hidden model.

    Each table's IDs follow a Zipf law (exponent `zipf_a`) over a seeded random permutation of its
    rows, so a few IDs are very popular and most are rare, as in real click logs. A click happens with
    probability ``sigmoid(w·dense + Σ_tables mean(score[id]) - bias)`` for fixed hidden weights and
    per-ID scores, so the model has something to learn.

    Args:
        num_dense, num_tables, num_embeddings, ids_per_bag: must match the model.
        zipf_a: Zipf exponent (> 1; smaller = heavier tail).
        batch_size, train_batches, val_batches, seed, num_workers, pin_memory: see `SyntheticDataModule`.
    """

    def __init__(
        self,
        num_dense: int = 13,
        num_tables: int = 8,
        num_embeddings: int = 20000,
        ids_per_bag: int = 4,
        zipf_a: float = 1.2,
        batch_size: int = 16,
        train_batches: int = 64,
        val_batches: int = 4,
        seed: int = 0,
        num_workers: int = 0,
        pin_memory: bool = False,
    ) -> None:
        super().__init__(batch_size, train_batches, val_batches, seed, num_workers, pin_memory)
        self.num_dense = check_int("num_dense", num_dense)
        self.num_tables = check_int("num_tables", num_tables)
        self.num_embeddings = check_int("num_embeddings", num_embeddings)
        self.ids_per_bag = check_int("ids_per_bag", ids_per_bag)
        if not zipf_a > 1.0:
            raise ValueError(f"`zipf_a` must be > 1 (a Zipf law needs it), got {zipf_a!r}")
        self.zipf_a = float(zipf_a)

    def make_dataset(self, split: str, num_samples: int, seed: int) -> Dataset:
        hidden = np.random.default_rng(self.seed)  # the same hidden click model for every split
        w_dense = hidden.normal(size=self.num_dense) / np.sqrt(self.num_dense)
        scores = hidden.normal(size=(self.num_tables, self.num_embeddings))
        perms = np.stack([hidden.permutation(self.num_embeddings) for _ in range(self.num_tables)])
        rng = np.random.default_rng(seed * 7919 + 23)
        dense = rng.normal(size=(num_samples, self.num_dense))
        ranks = (
            rng.zipf(self.zipf_a, size=(num_samples, self.num_tables, self.ids_per_bag)) - 1
        ) % self.num_embeddings
        ids = perms[np.arange(self.num_tables)[None, :, None], ranks]
        id_signal = scores[np.arange(self.num_tables)[None, :, None], ids].mean(axis=2).sum(axis=1)
        logit = dense @ w_dense + id_signal / np.sqrt(self.num_tables) - 1.0
        clicks = (rng.random(num_samples) < 1.0 / (1.0 + np.exp(-logit))).astype(np.float32)
        return TensorDataset(
            torch.tensor(dense, dtype=torch.float32),
            torch.tensor(ids, dtype=torch.int64),
            torch.from_numpy(clicks),
        )
