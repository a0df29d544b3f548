"""LightningModules and callbacks for checking that logged values reach users as in an eager fit."""

from __future__ import annotations

import torch
import torchmetrics
from lightning.pytorch import Callback

from tests.lightning_models import TinyMLP


class ManyLogs(TinyMLP):
    """Every kind of self.log a step makes: reductions, levels, explicit batch size, log_dict, a metric
    object, a recomputed Python number, a log in a gradient hook."""

    def __init__(self, **kw):
        super().__init__(scheduler="cosine", **kw)
        self.train_mean = torchmetrics.MeanMetric()

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        x, _ = batch
        self.train_mean(loss)
        self.log("step_only", loss * 2, on_step=True, on_epoch=False, prog_bar=True)
        self.log("epoch_mean", loss, on_step=False, on_epoch=True, prog_bar=True)
        self.log("both", x.abs().mean(), on_step=True, on_epoch=True, batch_size=3)
        self.log("biggest", x.max(), on_epoch=True, reduce_fx="max")
        self.log("summed", loss, on_step=False, on_epoch=True, reduce_fx="sum")
        self.log_dict({"d/a": loss + 1, "d/b": x.min()}, prog_bar=True)
        self.log("metric", self.train_mean, on_step=False, on_epoch=True)
        self.log("lr", self.lr_schedulers().get_last_lr()[0], prog_bar=True)
        return loss

    def on_before_optimizer_step(self, optimizer):
        self.log("head_grad", self.head.weight.grad.norm())


class LoggedEverywhere(Callback):
    """What each step's logs left where users read them: progress bar, callback_metrics, logger."""

    def __init__(self, graph_of=None):
        self.seen = []
        self.graph_of, self.log_calls = graph_of, []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if self.graph_of is not None and self.graph_of._slots.state.graph is not None:
            self.log_calls = (
                self.graph_of._slots.state.graph.log_calls
            )  # the callback drops its graph at teardown
        self.seen.append(
            {
                "pbar": dict(trainer.progress_bar_metrics),
                "callback": {k: v.clone() for k, v in trainer.callback_metrics.items()},
                "logged": {k: v.clone() for k, v in trainer.logged_metrics.items()},
            }
        )


def assert_logged_alike(a: LoggedEverywhere, b: LoggedEverywhere) -> None:
    """Per step: the same progress bar values, and bitwise the same callback and logged metrics."""
    assert len(a.seen) == len(b.seen)
    for step, (x, y) in enumerate(zip(a.seen, b.seen)):
        assert x["pbar"] == y["pbar"], f"progress bar differs at step {step}: {x['pbar']} vs {y['pbar']}"
        for where in ("callback", "logged"):
            assert x[where].keys() == y[where].keys(), (where, step)
            for k in x[where]:
                assert torch.equal(x[where][k], y[where][k]), f"{where} {k!r} differs at step {step}"
