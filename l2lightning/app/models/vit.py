"""ViT family: a small Vision Transformer, 224×224 input in 16-pixel patches (196 patches + CLS = 197 tokens).

Built from `nn.TransformerEncoderLayer(batch_first=True, norm_first=True)` blocks (pre-norm, as in
ViT), so attention runs through PyTorch's fused kernels (SDPA in training, the encoder fast path in
inference) and the prefetch hooks treat each block as one layer. Data: `ImageData` from conv_stack.
"""

from __future__ import annotations

import torch
from torch import nn

from l2lightning.app.models._common import ClassifierFamily, check_int, parse_dtype


class ViT(ClassifierFamily):
    """A small ViT classifier (ViT-S/16-like by default: width 384, 6 blocks, 6 heads).

    Args:
        image_size: input height = width; a multiple of `patch_size`.
        patch_size: patch height = width.
        in_channels: image channels.
        num_classes: classes.
        dim: token width.
        depth: transformer blocks.
        heads: attention heads (must divide `dim`).
        mlp_ratio: hidden width of each block's MLP, as a multiple of `dim`.
        dropout: dropout inside the blocks (0 keeps steps bitwise reproducible and cheap to verify).
        dtype: parameter dtype.
        lr: AdamW learning rate.
        weight_decay: AdamW weight decay.

    Example:
        >>> model = ViT(image_size=32, patch_size=16, dim=32, depth=1, heads=2, num_classes=3)
        >>> model.num_tokens, model(torch.randn(2, 3, 32, 32)).shape
        (5, torch.Size([2, 3]))
    """

    def __init__(
        self,
        image_size: int = 224,
        patch_size: int = 16,
        in_channels: int = 3,
        num_classes: int = 10,
        dim: int = 384,
        depth: int = 6,
        heads: int = 6,
        mlp_ratio: float = 4.0,
        dropout: float = 0.0,
        dtype: str = "float32",
        lr: float = 3e-4,
        weight_decay: float = 0.05,
    ) -> None:
        super().__init__(lr, weight_decay)
        check_int("image_size", image_size)
        check_int("patch_size", patch_size)
        if image_size % patch_size:
            raise ValueError(f"`image_size` ({image_size}) must be a multiple of `patch_size` ({patch_size})")
        check_int("in_channels", in_channels)
        check_int("num_classes", num_classes, low=2)
        check_int("dim", dim)
        check_int("depth", depth)
        check_int("heads", heads)
        if dim % heads:
            raise ValueError(f"`heads` ({heads}) must divide `dim` ({dim})")
        self.param_dtype = parse_dtype(dtype)
        self.save_hyperparameters()
        self.num_tokens = (image_size // patch_size) ** 2 + 1
        self.patch_embed = nn.Conv2d(in_channels, dim, patch_size, stride=patch_size)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, dim))
        self.pos_embed = nn.Parameter(torch.zeros(1, self.num_tokens, dim))
        nn.init.trunc_normal_(self.pos_embed, std=0.02)
        nn.init.trunc_normal_(self.cls_token, std=0.02)
        # separate layers (not nn.TransformerEncoder's deep copies), so each block starts with its own weights
        self.blocks = nn.Sequential(
            *[
                nn.TransformerEncoderLayer(
                    dim,
                    heads,
                    int(dim * mlp_ratio),
                    dropout,
                    activation="gelu",
                    batch_first=True,
                    norm_first=True,
                )
                for _ in range(depth)
            ]
        )
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, num_classes)
        self.to(self.param_dtype)  # metrics keep their float32 states: torchmetrics ignores dtype casts
        self.use_class_accuracy(num_classes)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        x = self.patch_embed(images.to(self.param_dtype))  # (B, dim, H/p, W/p)
        x = x.flatten(2).transpose(1, 2)  # (B, patches, dim)
        x = torch.cat([self.cls_token.expand(x.shape[0], -1, -1), x], dim=1) + self.pos_embed
        x = self.norm(self.blocks(x))
        return self.head(x[:, 0])
