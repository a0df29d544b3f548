"""Progress-bar values read when read (l2lightning.guards.progress_bar_reads): no `.item()` per step at the batch
end, the same numbers wherever they are read, Lightning's connector as it was after the fit."""

from __future__ import annotations

import pytest
import torch
from lightning.pytorch import Callback, seed_everything
from lightning.pytorch.callbacks import TQDMProgressBar
from lightning.pytorch.trainer.connectors.logger_connector.logger_connector import _LoggerConnector

from l2lightning import L2GraphCallback
from l2lightning.guards.progress_bar_reads import defer_progress_bar_reads
from tests.baselines import (  # noqa: F401 -- the fixture records each callback fit's switch step
    baseline_of,
    capturable_from_of_the_last_callback_fit,
)
from tests.lightning_models import TinyMLP, quiet_trainer, regression_loader
from tests.logging_models import LoggedEverywhere, ManyLogs, assert_logged_alike


class CountsBatchEndReads(Callback):
    """Counts `Tensor.item` calls made inside Lightning's batch end (the logger connector's on_batch_end),
    and what its progress-bar dictionary holds right after it, before anyone reads it."""

    def __init__(self):
        self.reads_at_batch_end = 0
        self.held = []

    def setup(self, trainer, pl_module, stage):
        connector = trainer._logger_connector
        counter = self
        original_item = torch.Tensor.item

        def counting_item(t):
            counter.reads_at_batch_end += 1
            return original_item(t)

        def on_batch_end(*args, **kwargs):
            torch.Tensor.item = counting_item
            try:
                return type(connector).on_batch_end(connector, *args, **kwargs)
            finally:
                torch.Tensor.item = original_item

        connector.on_batch_end = on_batch_end  # an instance attribute: sees the class the callback swaps in

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        held = trainer._logger_connector._progress_bar_metrics
        self.held.append({k: type(v).__name__ for k, v in held.items()})

    def teardown(self, trainer, pl_module, stage):
        vars(trainer._logger_connector).pop("on_batch_end", None)


def fit(model_cls, callbacks, steps=12, **trainer_kwargs):
    seed_everything(0)
    trainer = quiet_trainer(accelerator="cpu", max_steps=steps, callbacks=callbacks, **trainer_kwargs)
    trainer.fit(model_cls(width=32, depth=2), regression_loader(n=96, width=32))
    return trainer


Baseline = baseline_of(ManyLogs)


def test_the_batch_end_reads_nothing_and_every_read_sees_the_eager_numbers(emulated_cuda_graphs):
    cb = L2GraphCallback(prefetch="off", log_timing=False)
    seen, reads = LoggedEverywhere(cb), CountsBatchEndReads()
    got = fit(ManyLogs, [reads, cb, seen])
    base_seen, base_reads = LoggedEverywhere(), CountsBatchEndReads()
    base = fit(Baseline, [base_reads, base_seen])
    assert cb.summary()["captured"]
    # plain Lightning converts each prog_bar value at every batch end; with the callback none are
    assert base_reads.reads_at_batch_end >= 12 * 3
    assert reads.reads_at_batch_end == 0
    # until read, the connector holds the step's tensors; reads (LoggedEverywhere, each step) get numbers
    assert any("Tensor" in held.values() for held in reads.held[1:])
    assert_logged_alike(base_seen, seen)
    # after the fit: Lightning's own connector class and plain numbers, equal to the eager fit's
    assert type(got._logger_connector) is _LoggerConnector
    assert got.progress_bar_metrics == base.progress_bar_metrics
    assert all(isinstance(v, float) for v in got._logger_connector._progress_bar_metrics.values())


def test_a_progress_bar_refreshed_every_few_steps_shows_what_eager_shows(emulated_cuda_graphs, tmp_path):
    class Shown(TQDMProgressBar):
        def __init__(self):
            super().__init__(refresh_rate=5)
            self.shown = []

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
            if (batch_idx + 1) % 5 == 0:
                self.shown.append(self.get_metrics(trainer, pl_module))

    bar_base, bar = Shown(), Shown()
    fit(
        ManyLogs,
        [bar, L2GraphCallback(prefetch="off", log_timing=False)],
        enable_progress_bar=True,
        default_root_dir=tmp_path,
    )
    fit(Baseline, [bar_base], enable_progress_bar=True, default_root_dir=tmp_path)
    assert len(bar.shown) == len(bar_base.shown) == 2
    assert bar.shown == bar_base.shown
    assert all(isinstance(v, (int, float, str)) for shown in bar.shown for v in shown.values())


def test_a_connector_of_another_class_is_left_alone():
    class OwnConnector(_LoggerConnector):
        pass

    class FakeTrainer:
        pass

    trainer = FakeTrainer()
    trainer._logger_connector = OwnConnector.__new__(OwnConnector)
    trainer._logger_connector._progress_bar_metrics = {}
    assert defer_progress_bar_reads(trainer) is None
    assert type(trainer._logger_connector) is OwnConnector


def test_undo_reads_what_is_left_and_restores_the_class():
    class FakeTrainer:
        pass

    trainer = FakeTrainer()
    connector = _LoggerConnector.__new__(_LoggerConnector)
    connector._progress_bar_metrics = {"loss": torch.tensor(0.25), "lr": 0.1}
    trainer._logger_connector = connector
    undo = defer_progress_bar_reads(trainer)
    assert undo is not None and type(connector) is not _LoggerConnector
    assert isinstance(connector, _LoggerConnector)
    undo()
    assert type(connector) is _LoggerConnector
    assert connector._progress_bar_metrics == {"loss": 0.25, "lr": 0.1}
    undo()  # a second undo changes nothing
    assert type(connector) is _LoggerConnector


def test_an_interrupted_fit_leaves_lightnings_connector(emulated_cuda_graphs):
    class Stops(TinyMLP):
        def training_step(self, batch, batch_idx):
            if batch_idx == 6:
                raise RuntimeError("stop here")
            return super().training_step(batch, batch_idx)

    cb = L2GraphCallback(prefetch="off", log_timing=False)
    seed_everything(0)
    trainer = quiet_trainer(accelerator="cpu", max_steps=12, callbacks=[cb])
    with pytest.raises(RuntimeError, match="stop here"):
        trainer.fit(Stops(width=32, depth=2), regression_loader(n=96, width=32))
    assert type(trainer._logger_connector) is _LoggerConnector
    assert all(
        not isinstance(v, torch.Tensor) for v in trainer._logger_connector._progress_bar_metrics.values()
    )


class LogsInValidation(ManyLogs):
    def validation_step(self, batch, batch_idx):
        x, y = batch
        loss = (self.head(self.net(x)).squeeze(-1) - y).square().mean()
        self.log("val_step", loss, prog_bar=True)  # per step in validation: on_epoch by default
        self.log("val_last", loss * 2, on_step=True, on_epoch=False, prog_bar=True)
        return loss


def test_validation_progress_bar_values_read_later_are_the_eager_ones(emulated_cuda_graphs):
    def run(cls, callbacks):
        seen = LoggedEverywhere(callbacks[0] if callbacks else None)
        seed_everything(0)
        trainer = quiet_trainer(
            accelerator="cpu",
            max_steps=24,
            callbacks=[*callbacks, seen],
            val_check_interval=6,
            limit_val_batches=3,
            num_sanity_val_steps=0,
        )
        trainer.fit(
            cls(width=32, depth=2),
            regression_loader(n=96, width=32),
            regression_loader(n=24, width=32, seed=1),
        )
        return trainer, seen

    cb = L2GraphCallback(prefetch="off", log_timing=False)
    got, seen = run(LogsInValidation, [cb])
    base, base_seen = run(baseline_of(LogsInValidation), [])
    assert cb.summary()["captured"]
    assert_logged_alike(base_seen, seen)
    assert got.progress_bar_metrics == base.progress_bar_metrics
    assert "val_step" in got.progress_bar_metrics
