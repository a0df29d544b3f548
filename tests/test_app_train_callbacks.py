"""CPU tests: the callbacks/ and logger/ groups of the training entry point, and what users add to them.

Callbacks added on the command line (`+callbacks.NAME={...}` or `+trainer.callbacks=[...]`) run beside
the group's; the group's model checkpoint, progress bar and LR monitor follow the Trainer switches and
the loggers.
"""

from __future__ import annotations

import csv

import pytest

from tests.train_helpers import run_overrides

TINY = [
    "model.width=16",
    "model.depth=1",
    "data.batch_size=4",
    "data.train_batches=2",  # two steps are one whole epoch: epoch-end checkpoints are written
    "data.val_batches=1",
    "trainer=cpu",
    "trainer.max_steps=2",
    "validate=false",
]

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_config_added_callbacks_run(tmp_path):
    mine, extra = tmp_path / "mine", tmp_path / "extra"
    overrides = [
        *TINY,
        # the documented way: a named entry beside the group's
        f"+callbacks.my_checkpoint={{_target_:lightning.pytorch.callbacks.ModelCheckpoint,dirpath:{mine}}}",
        # the repro: a Trainer callbacks list, kept too
        # (every_n_train_steps: Lightning refuses two ModelCheckpoints with the same settings)
        f"+trainer.callbacks=[{{_target_:lightning.pytorch.callbacks.ModelCheckpoint,dirpath:{extra},"
        "every_n_train_steps:1}]",
    ]
    result = run_overrides(overrides, tmp_path / "run")
    assert result["status"] == "ok" and result["steps"] == 2
    assert [p.name for p in mine.glob("*.ckpt")] == ["epoch=0-step=2.ckpt"]
    assert [p.name for p in extra.glob("*.ckpt")] == ["epoch=0-step=2.ckpt"]
    # trainer/cpu.yaml keeps the group's own checkpoint off; the users' checkpoints turned the switch on
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_group_checkpoint_lr_monitor_and_csv_logger(tmp_path):
    run_dir = tmp_path / "run"
    result = run_overrides([*TINY, "trainer.enable_checkpointing=true"], run_dir)
    assert sorted(p.name for p in (run_dir / "checkpoints").glob("*.ckpt")) == [
        "epoch0-step2.ckpt",
        "last.ckpt",
    ]
    assert "lr-AdamW" in result["metrics"]  # callbacks.lr_monitor
    with (run_dir / "csv" / "metrics.csv").open() as f:
        assert "lr-AdamW" in next(csv.reader(f))


def test_no_logger_leaves_lr_monitor_out(tmp_path):
    run_dir = tmp_path / "run"
    result = run_overrides([*TINY, "~logger"], run_dir)
    assert result["status"] == "ok" and "lr-AdamW" not in result["metrics"]
    assert not (run_dir / "csv").exists()


def test_dropping_a_group_callback(tmp_path):
    # ~callbacks.l2: the callback is validated but not in the callbacks; result.json says so
    result = run_overrides([*TINY, "~callbacks.l2", "~callbacks.progress_bar"], tmp_path / "run")
    assert result["callback"] is False and result["l2"].startswith("none (")
