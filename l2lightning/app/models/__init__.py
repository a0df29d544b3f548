"""The model families used by conf/: trainable LightningModules with their data modules.

| family        | LightningModule | data module                   | what it is                                   |
|---------------|-----------------|-------------------------------|----------------------------------------------|
| mlp_stack     | `MLPStack`      | `VectorData`, `DigitsData`    | N × (LayerNorm, Linear d×d, GELU)            |
| rl_policy     | `RLPolicy`      | `CartPoleData`                | actor-critic MLP on CartPole                 |
| recommender   | `Recommender`   | `ClickData`                   | DLRM-style click model, Zipf IDs             |
| conv_stack    | `ConvStack`     | `ImageData`                   | small CNN at batch 1–8                       |
| vit           | `ViT`           | `ImageData`                   | small ViT, 224×224, 16-pixel patches         |
| text_encoder  | `TextEncoder`   | `TokenData`                   | BERT-small-like nn.TransformerEncoder        |

Every `training_step` is capture-safe: tensor math, `self.log`, and `update` of tensor-state
torchmetrics (the training metric, logged per epoch; the RL family's episode return per step).
"""

from __future__ import annotations

import lightning.pytorch as pl

from l2lightning.app.models.conv_stack import ConvStack, ImageData
from l2lightning.app.models.mlp_stack import DigitsData, MLPStack, VectorData
from l2lightning.app.models.recommender import ClickData, Recommender
from l2lightning.app.models.rl_policy import CartPole, CartPoleData, RLPolicy
from l2lightning.app.models.text_encoder import TextEncoder, TokenData
from l2lightning.app.models.vit import ViT

# family name (the conf/model/*.yaml name) -> (LightningModule class, default data module class)
FAMILIES: dict[str, tuple[type[pl.LightningModule], type[pl.LightningDataModule]]] = {
    "mlp_stack": (MLPStack, VectorData),
    "rl_policy": (RLPolicy, CartPoleData),
    "recommender": (Recommender, ClickData),
    "conv_stack": (ConvStack, ImageData),
    "vit": (ViT, ImageData),
    "text_encoder": (TextEncoder, TokenData),
}


def family_of(model: pl.LightningModule) -> str | None:
    """The family name of `model` (e.g. ``"vit"``), or None for a module from elsewhere."""
    for name, (cls, _) in FAMILIES.items():
        if type(model) is cls:
            return name
    return None


__all__ = [
    "FAMILIES",
    "CartPole",
    "CartPoleData",
    "ClickData",
    "ConvStack",
    "DigitsData",
    "ImageData",
    "MLPStack",
    "RLPolicy",
    "Recommender",
    "TextEncoder",
    "TokenData",
    "VectorData",
    "ViT",
    "family_of",
]
