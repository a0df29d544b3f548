"""Small LightningModules shared by the callback tests (CPU and GPU)."""

from __future__ import annotations

import torch
import torch.utils.checkpoint
from lightning.pytorch import LightningModule
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


class TinyMLP(LightningModule):
    """N x (LayerNorm, Linear, GELU) regression; logs loss and a second tensor."""

    def __init__(
        self,
        width: int = 32,
        depth: int = 3,
        lr: float = 1e-2,
        scheduler: str | None = None,
        dtype: torch.dtype = torch.float32,
        sync_in_step: bool = False,
        fused: bool = False,
    ) -> None:
        super().__init__()
        self.net = nn.Sequential(
            *[nn.Sequential(nn.LayerNorm(width), nn.Linear(width, width), nn.GELU()) for _ in range(depth)]
        )
        self.head = nn.Linear(width, 1)
        self.lr = lr
        self.scheduler = scheduler
        self.sync_in_step = sync_in_step
        self.fused = fused
        self.to(dtype)

    def training_step(self, batch, batch_idx):
        x, y = batch
        pred = self.head(self.net(x)).squeeze(-1)
        loss = (pred.float() - y.float()).square().mean()
        if self.sync_in_step:
            _ = loss.item()  # a host sync: cannot be captured
        self.log("train/loss", loss, prog_bar=True)
        self.log("train/pred_mean", pred.float().mean())
        return loss

    def configure_optimizers(self):
        impl = {"fused": True} if self.fused else {"foreach": True}
        opt = torch.optim.AdamW(self.parameters(), lr=self.lr, **impl)
        if self.scheduler == "step":
            return {
                "optimizer": opt,
                "lr_scheduler": {
                    "scheduler": torch.optim.lr_scheduler.StepLR(opt, 5, 0.5),
                    "interval": "step",
                },
            }
        if self.scheduler == "cosine":
            return {
                "optimizer": opt,
                "lr_scheduler": {
                    "scheduler": torch.optim.lr_scheduler.CosineAnnealingLR(opt, 30),
                    "interval": "step",
                },
            }
        return opt


class RunsOutOfMemoryInCapture(TinyMLP):
    """TinyMLP whose step, the first time a CUDA graph captures it in this process, asks for the
    device's whole memory (as if something else had taken it mid-capture): a real allocator
    out-of-memory error raised inside the capture. Eager steps, and later captures, allocate nothing."""

    raised = [False]

    def training_step(self, batch, batch_idx):
        if not RunsOutOfMemoryInCapture.raised[0] and torch.cuda.is_current_stream_capturing():
            RunsOutOfMemoryInCapture.raised[0] = True
            _, total = torch.cuda.mem_get_info()
            torch.empty(total, dtype=torch.uint8, device="cuda")
        return super().training_step(batch, batch_idx)


def quiet_trainer(**kwargs):
    """A Trainer without logger, checkpoints, progress bar or model summary; `kwargs` add or override."""
    from lightning.pytorch import Trainer

    settings = dict(
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False
    )
    return Trainer(**{**settings, **kwargs})


def regression_loader(
    n: int = 64, width: int = 32, batch_size: int = 8, seed: int = 0, dtype: torch.dtype = torch.float32
) -> DataLoader:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, width, generator=g).to(dtype)
    y = torch.randn(n, generator=g)
    return DataLoader(TensorDataset(x, y), batch_size=batch_size, shuffle=False)


class NamedSamples(torch.utils.data.Dataset):
    """Regression samples that carry their file name, as image and text datasets often do."""

    def __init__(self, n=240, width=32):
        self.data = regression_loader(n=n, width=width).dataset

    def __len__(self):
        return len(self.data)

    def __getitem__(self, i):
        x, y = self.data[i]
        return x, y, f"sample_{i:04d}.png"


class Finetuned(TinyMLP):
    """A backbone (the MLP) frozen until epoch 1 by Lightning's BackboneFinetuning, which then adds its
    parameters to the optimizer as a new param group, with the optimizer's defaults."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self.backbone = self.net

    def configure_optimizers(self):
        impl = {"fused": True} if self.fused else {"foreach": True}
        return torch.optim.AdamW([p for p in self.parameters() if p.requires_grad], lr=self.lr, **impl)


class IgnoresTheNames(TinyMLP):
    def training_step(self, batch, batch_idx):
        x, y, paths = batch
        return super().training_step((x, y), batch_idx)


class ReadsTheNames(TinyMLP):
    def training_step(self, batch, batch_idx):
        x, y, paths = batch
        loss = super().training_step((x, y), batch_idx)
        return loss * 2 if paths[0].endswith("0.png") else loss

    def configure_optimizers(self):
        # SGD: its capturable configuration (the 24 traced steps') updates like the plain one, bit for
        # bit on the CPU too (fused AdamW's tensor LR rounds otherwise there)
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)


class CheckpointedDropout(TinyMLP):
    """Activation checkpointing around blocks with dropout (Hugging Face and timm transformer blocks):
    the recomputation in backward must draw the forward's masks again, which torch.utils.checkpoint
    does by saving the random generators' state and putting it back (`preserve_rng_state=True`)."""

    preserve_rng_state = True
    dropout_inside = True

    def __init__(self, **kw):
        super().__init__(**kw)
        self.drop = nn.Dropout(0.2)

    def block(self, i, x):
        x = self.net[i](x)
        return self.drop(x) if self.dropout_inside else x

    def training_step(self, batch, batch_idx):
        x, y = batch
        for i in range(len(self.net)):
            x = torch.utils.checkpoint.checkpoint(
                self.block, i, x, use_reentrant=False, preserve_rng_state=self.preserve_rng_state
            )
        if not self.dropout_inside:
            x = self.drop(x)
        loss = (self.head(x).squeeze(-1).float() - y.float()).square().mean()
        self.log("train/loss", loss)
        return loss


class CheckpointedDropoutUnpreserved(CheckpointedDropout):
    """The same without the put-back: the recomputation draws masks of its own, in eager steps too."""

    preserve_rng_state = False


class DropoutOutsideCheckpoint(CheckpointedDropout):
    """Checkpointed blocks without dropout (their random state is still put back), dropout after them."""

    dropout_inside = False


class StepWithoutBatchIdx(TinyMLP):
    """`training_step(self, batch)`: Lightning passes `batch_idx` only to a step that takes it."""

    def training_step(self, batch):
        x, y = batch
        loss = (self.head(self.net(x)).squeeze(-1) - y).square().mean()
        self.log("train/loss", loss)
        return loss


class AdagradMLP(TinyMLP):
    """DLRM's and TorchRec's optimizer, as torch gives it (no capturable mode), on a TinyMLP."""

    lr_decay = 0.0

    def configure_optimizers(self):
        return torch.optim.Adagrad(self.parameters(), lr=0.05, weight_decay=1e-4, lr_decay=self.lr_decay)


class DecayingAdagradMLP(AdagradMLP):
    """Adagrad whose LR decays with its step count, which it reads on the host."""

    lr_decay = 0.01
