"""Text encoder family: a BERT-small-like `nn.TransformerEncoder` (4 layers, width 512, 8 heads) on synthetic tokens.

Post-norm `nn.TransformerEncoderLayer(batch_first=True, activation="gelu")` layers, no masks, so
PyTorch's fast paths stay on: SDPA in training and the fused encoder-layer kernel in inference.
Task: sequence classification of synthetic token sequences whose class shows in which slice of the
vocabulary some of their tokens come from (`TokenData`).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.data import Dataset, TensorDataset

from l2lightning.app.models._common import (
    ClassifierFamily,
    SyntheticDataModule,
    check_int,
    parse_dtype,
)


class TextEncoder(ClassifierFamily):
    """Token + position embeddings, `nn.TransformerEncoder`, mean pooling, a linear classifier.

    Args:
        vocab_size: token vocabulary.
        seq_len: tokens per sequence (fixed: the position table has this many rows).
        d_model: width.
        nhead: attention heads (must divide `d_model`).
        num_layers: encoder layers.
        dim_feedforward: hidden width of each layer's MLP.
        num_classes: classes.
        dropout: dropout inside the layers (BERT uses 0.1; 0 keeps steps bitwise reproducible).
        dtype: parameter dtype.
        lr: AdamW learning rate.
        weight_decay: AdamW weight decay.

    Example:
        >>> model = TextEncoder(vocab_size=50, seq_len=8, d_model=32, nhead=2, num_layers=1, dim_feedforward=64)
        >>> model(torch.randint(0, 50, (3, 8))).shape
        torch.Size([3, 2])
    """

    def __init__(
        self,
        vocab_size: int = 8192,
        seq_len: int = 128,
        d_model: int = 512,
        nhead: int = 8,
        num_layers: int = 4,
        dim_feedforward: int = 2048,
        num_classes: int = 2,
        dropout: float = 0.0,
        dtype: str = "float32",
        lr: float = 1e-4,
        weight_decay: float = 0.01,
    ) -> None:
        super().__init__(lr, weight_decay)
        check_int("vocab_size", vocab_size, low=2)
        check_int("seq_len", seq_len)
        check_int("d_model", d_model)
        check_int("nhead", nhead)
        if d_model % nhead:
            raise ValueError(f"`nhead` ({nhead}) must divide `d_model` ({d_model})")
        check_int("num_layers", num_layers)
        check_int("dim_feedforward", dim_feedforward)
        check_int("num_classes", num_classes, low=2)
        self.param_dtype = parse_dtype(dtype)
        self.save_hyperparameters()
        self.embed = nn.Embedding(vocab_size, d_model)
        self.pos_embed = nn.Parameter(torch.zeros(1, seq_len, d_model))
        self.embed_norm = nn.LayerNorm(d_model)
        layer = nn.TransformerEncoderLayer(
            d_model, nhead, dim_feedforward, dropout, activation="gelu", batch_first=True
        )
        self.encoder = nn.TransformerEncoder(layer, num_layers, enable_nested_tensor=True)
        self.head = nn.Linear(d_model, num_classes)
        # BERT's initialisation; also gives each layer its own weights (TransformerEncoder deep-copies one)
        for name, param in self.named_parameters():
            if param.dim() > 1:
                nn.init.trunc_normal_(param, std=0.02)
            elif name.endswith("bias"):
                nn.init.zeros_(param)
        self.to(self.param_dtype)
        self.use_class_accuracy(num_classes)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed_norm(self.embed(tokens) + self.pos_embed)  # (B, L, d)
        return self.head(self.encoder(x).mean(dim=1))


class TokenData(SyntheticDataModule):
    """Synthetic token sequences: a fraction `signal` of each sequence's tokens comes from its class's
    slice of the vocabulary, the rest is uniform over the whole vocabulary.

    Args:
        vocab_size: token vocabulary (the model's).
        seq_len: tokens per sequence (the model's).
        num_classes: classes (at most `vocab_size`).
        signal: fraction of class tokens per sequence.
        batch_size, train_batches, val_batches, seed, num_workers, pin_memory: see `SyntheticDataModule`.
    """

    def __init__(
        self,
        vocab_size: int = 8192,
        seq_len: int = 128,
        num_classes: int = 2,
        signal: float = 0.2,
        batch_size: int = 8,
        train_batches: int = 64,
        val_batches: int = 4,
        seed: int = 0,
        num_workers: int = 0,
        pin_memory: bool = False,
    ) -> None:
        super().__init__(batch_size, train_batches, val_batches, seed, num_workers, pin_memory)
        self.vocab_size = check_int("vocab_size", vocab_size, low=2)
        self.seq_len = check_int("seq_len", seq_len)
        self.num_classes = check_int("num_classes", num_classes, low=2)
        if self.num_classes > self.vocab_size:
            raise ValueError(f"`num_classes` ({num_classes}) must not exceed `vocab_size` ({vocab_size})")
        if not 0.0 <= signal <= 1.0:
            raise ValueError(f"`signal` must be in [0, 1], got {signal!r}")
        self.signal = float(signal)

    def make_dataset(self, split: str, num_samples: int, seed: int) -> Dataset:
        gen = torch.Generator().manual_seed(seed * 7919 + 29)
        labels = torch.randint(self.num_classes, (num_samples,), generator=gen)
        slice_size = self.vocab_size // self.num_classes
        background = torch.randint(self.vocab_size, (num_samples, self.seq_len), generator=gen)
        in_slice = (
            torch.randint(slice_size, (num_samples, self.seq_len), generator=gen)
            + labels[:, None] * slice_size
        )
        use_signal = torch.rand(num_samples, self.seq_len, generator=gen) < self.signal
        return TensorDataset(torch.where(use_signal, in_slice, background), labels)
