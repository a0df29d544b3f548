"""Conv stack family: a small CNN for batches of 1–8 images, and the synthetic image data (also used by ViT).

Stages of (3×3 conv with stride 2, BatchNorm, ReLU), a global average (a mean over H, W: the
`AdaptiveAvgPool2d` backward has no deterministic CUDA kernel) and a linear classifier. BatchNorm's
running statistics are buffers the callback restores after its warm-up steps.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn
from torch.utils.data import Dataset

from l2lightning.app.models._common import (
    ClassifierFamily,
    SyntheticDataModule,
    check_int,
    check_sizes,
    parse_dtype,
)


class ConvStack(ClassifierFamily):
    """A small CNN classifier: ``len(channels)`` stages of (conv 3×3 stride 2, BatchNorm, ReLU), mean pool, linear.

    Args:
        in_channels: image channels.
        channels: output channels of each stage (each halves the resolution).
        num_classes: classes.
        dtype: parameter dtype.
        lr: AdamW learning rate.
        weight_decay: AdamW weight decay.

    Example:
        >>> model = ConvStack(channels=[8, 16], num_classes=4)
        >>> model(torch.randn(2, 3, 32, 32)).shape
        torch.Size([2, 4])
    """

    def __init__(
        self,
        in_channels: int = 3,
        channels: Sequence[int] = (32, 64, 128),
        num_classes: int = 10,
        dtype: str = "float32",
        lr: float = 1e-3,
        weight_decay: float = 0.01,
    ) -> None:
        super().__init__(lr, weight_decay)
        check_int("in_channels", in_channels)
        channels = check_sizes("channels", channels)
        check_int("num_classes", num_classes, low=2)
        self.param_dtype = parse_dtype(dtype)
        self.save_hyperparameters()
        stages: list[nn.Module] = []
        for c_in, c_out in zip([in_channels, *channels[:-1]], channels):
            stages += [
                nn.Conv2d(c_in, c_out, 3, stride=2, padding=1, bias=False),
                nn.BatchNorm2d(c_out),
                nn.ReLU(),
            ]
        self.features = nn.Sequential(*stages)
        self.head = nn.Linear(channels[-1], num_classes)
        self.features.to(self.param_dtype)
        self.head.to(self.param_dtype)
        self.use_class_accuracy(num_classes)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(images.to(self.param_dtype)).mean(dim=(2, 3)))


class SyntheticImages(Dataset):
    """Images made on the fly: a fixed smooth pattern per class plus Gaussian noise, label = class.

    Item ``i`` is the same every time (seeded by ``noise_seed`` and ``i``), and nothing is
    stored but the class patterns, so 224×224 datasets cost no memory.
    """

    def __init__(
        self,
        num_samples: int,
        image_size: int,
        channels: int,
        num_classes: int,
        pattern_seed: int,
        noise_seed: int,
        noise: float,
    ) -> None:
        self.num_samples = num_samples
        self.image_size = image_size
        self.channels = channels
        self.num_classes = num_classes
        self.noise_seed = noise_seed
        self.noise = noise
        # class patterns: coarse 4×4 random grids upsampled to full size (learnable by a CNN or a ViT)
        gen = torch.Generator().manual_seed(pattern_seed)
        coarse = torch.randn(num_classes, channels, 4, 4, generator=gen)
        self.patterns = coarse.repeat_interleave(-(-image_size // 4), dim=2).repeat_interleave(
            -(-image_size // 4), dim=3
        )
        self.patterns = self.patterns[:, :, :image_size, :image_size].contiguous()

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        if not 0 <= index < self.num_samples:
            raise IndexError(f"index {index} out of range for {self.num_samples} images")
        gen = torch.Generator().manual_seed(self.noise_seed * 1_000_003 + index)
        label = int(torch.randint(self.num_classes, (1,), generator=gen))
        noise = torch.randn(self.channels, self.image_size, self.image_size, generator=gen)
        return self.patterns[label] + self.noise * noise, torch.tensor(label)


class ImageData(SyntheticDataModule):
    """Synthetic labelled images (see `SyntheticImages`) for `ConvStack` and `ViT`.

    Args:
        image_size: height = width in pixels.
        channels: image channels.
        num_classes: classes.
        noise: standard deviation of the per-image noise (the class patterns have unit variance).
        batch_size, train_batches, val_batches, seed, num_workers, pin_memory: see `SyntheticDataModule`.
    """

    def __init__(
        self,
        image_size: int = 64,
        channels: int = 3,
        num_classes: int = 10,
        noise: float = 1.0,
        batch_size: int = 4,
        train_batches: int = 64,
        val_batches: int = 4,
        seed: int = 0,
        num_workers: int = 0,
        pin_memory: bool = False,
    ) -> None:
        super().__init__(batch_size, train_batches, val_batches, seed, num_workers, pin_memory)
        self.image_size = check_int("image_size", image_size)
        self.channels = check_int("channels", channels)
        self.num_classes = check_int("num_classes", num_classes, low=2)
        self.noise = float(noise)

    def make_dataset(self, split: str, num_samples: int, seed: int) -> Dataset:
        # the same class patterns in every split (self.seed), other labels and noise (seed)
        return SyntheticImages(
            num_samples, self.image_size, self.channels, self.num_classes, self.seed, seed, self.noise
        )
