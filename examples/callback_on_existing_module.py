"""The L2GraphCallback on an existing LightningModule: add one callback, change nothing else.

    python examples/callback_on_existing_module.py

On a GPU the whole training step (forward, loss, backward, AdamW step) is captured in one CUDA graph
after three eager warm-up steps, with L2 weight prefetch inside it where CuPy is installed. Without
CUDA the callback says why and Lightning trains eagerly, exactly as it would without the callback.
"""

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from l2lightning import L2GraphCallback


class Regressor(pl.LightningModule):
    """An ordinary LightningModule, written without l2lightning in mind."""

    def __init__(self, width: int = 1024, depth: int = 8) -> None:
        super().__init__()
        blocks = [
            nn.Sequential(nn.LayerNorm(width), nn.Linear(width, width), nn.GELU()) for _ in range(depth)
        ]
        self.net = nn.Sequential(*blocks, nn.Linear(width, 1))

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.mse_loss(self(x), y)
        self.log("train/loss", loss)  # log tensors; no loss.item() in the step (it would stop the capture)
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3, foreach=True)


def main() -> None:
    pl.seed_everything(0, verbose=False)
    width = 1024 if torch.cuda.is_available() else 256  # keep the eager CPU run short
    x = torch.randn(512, width)
    y = x[:, :1].sin()
    # 512 samples in batches of 8: every batch has the same shape, so every step replays the graph
    loader = DataLoader(TensorDataset(x, y), batch_size=8, shuffle=True)

    callback = L2GraphCallback(prefetch="default")
    trainer = pl.Trainer(
        accelerator="auto",
        devices=1,
        max_steps=30,
        callbacks=[callback],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(Regressor(width), loader)

    summary = callback.summary()
    print(f"final loss: {float(trainer.callback_metrics['train/loss']):.4f}")
    if summary["captured"]:
        print(
            f"captured: yes; eager {summary['eager_step_ms']:.3f} ms/step, graph {summary['graph_step_ms']:.3f} "
            f"ms/step, replay speedup {summary['replay_speedup']:.2f}x; prefetching layers: "
            f"{sum(1 for row in summary['plans'] if row.get('forward') or row.get('backward'))}"
        )
    else:
        print(f"captured: no ({summary['reason']})")


if __name__ == "__main__":
    main()
