"""CPU tests of StepTimer: a real fit on the host clock, the CUDA-event path with stand-in events."""

from __future__ import annotations

import time
from types import SimpleNamespace

import lightning.pytorch as pl
import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from l2lightning.step_timer import StepTimer, WallClockMark

pytestmark = pytest.mark.usefixtures("one_torch_thread")

EPOCH_PAUSE_S = 0.05


class _Tiny(pl.LightningModule):
    """A 4 -> 1 linear regression that pauses at the start of every epoch after the first."""

    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Linear(4, 1)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def on_train_epoch_start(self) -> None:
        if self.current_epoch > 0:
            time.sleep(EPOCH_PAUSE_S)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _fit(timer: StepTimer, epochs: int = 2, batches: int = 3) -> None:
    data = TensorDataset(torch.randn(batches * 2, 4), torch.randn(batches * 2, 1))
    trainer = pl.Trainer(
        accelerator="cpu",
        max_epochs=epochs,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[timer],
    )
    trainer.fit(_Tiny(), DataLoader(data, batch_size=2))


def test_a_cpu_fit_times_every_step_on_the_host_clock():
    timer = StepTimer()
    _fit(timer)
    times = timer.step_times()
    assert [step for step, _ in times] == [0, 1, 2, 3, 4, 5]
    assert all(ms > 0 for _, ms in times)
    assert not timer.cuda and timer.clock == "time.perf_counter on the host"
    assert len(timer.events) == 6 and all(isinstance(m, WallClockMark) for m in timer.events)
    # The last step of the first epoch ends at its own batch end, not at the next epoch's first
    # start: the pause between the epochs is in no step.
    assert times[2][1] < EPOCH_PAUSE_S * 1e3
    # Within an epoch a step lasts from its start to the next start.
    assert times[0][1] == pytest.approx(timer.events[0].elapsed_time(timer.events[1]))


def test_window_takes_consecutive_steps_after_the_first_few():
    timer = StepTimer()
    _fit(timer, epochs=1, batches=5)
    all_ms = [ms for _, ms in timer.step_times()]
    assert timer.window_ms(2, 3) == all_ms[2:5]
    with pytest.raises(RuntimeError, match="timed 5 steps, expected at least 6"):
        timer.window_ms(2, 4)
    with pytest.raises(ValueError, match="`first` must be >= 0"):
        timer.window_ms(-1, 2)
    with pytest.raises(ValueError, match="`steps` must be >= 1"):
        timer.window_ms(0, 0)


class _StandInEvent:
    """torch.cuda.Event's interface, on the host clock; counts how many were recorded."""

    recorded = 0

    def __init__(self, enable_timing: bool = False) -> None:
        assert enable_timing, "StepTimer must ask for timing events"
        self.t = None

    def record(self) -> None:
        _StandInEvent.recorded += 1
        self.t = time.perf_counter()

    def elapsed_time(self, end: _StandInEvent) -> float:
        return (end.t - self.t) * 1e3


def test_on_a_cuda_device_the_marks_are_cuda_events_read_after_one_sync(monkeypatch):
    syncs = []
    monkeypatch.setattr(torch.cuda, "Event", _StandInEvent)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: syncs.append(1))
    _StandInEvent.recorded = 0
    trainer = SimpleNamespace(
        strategy=SimpleNamespace(root_device=torch.device("cuda", 0)), global_step=0, current_epoch=0
    )
    timer = StepTimer()
    timer.on_train_start(trainer, None)
    for batch_idx in range(3):
        trainer.global_step = batch_idx
        timer.on_train_batch_start(trainer, None, None, batch_idx)
        timer.on_train_batch_end(trainer, None, None, None, batch_idx)
    assert timer.cuda and "CUDA events" in timer.clock
    assert _StandInEvent.recorded == 6 and not syncs  # no host sync while training
    times = timer.step_times()
    assert syncs == [1]
    assert [step for step, _ in times] == [0, 1, 2] and all(ms >= 0 for _, ms in times)
    assert all(isinstance(e, _StandInEvent) for e in timer.events)


def test_wall_clock_marks_read_like_cuda_events():
    start = WallClockMark()
    end = WallClockMark()
    end.seconds = start.seconds + 0.25
    assert start.elapsed_time(end) == pytest.approx(250.0)
