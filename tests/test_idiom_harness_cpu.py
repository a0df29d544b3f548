"""The idiom harness (tests/idiom_harness.py): where a fit's timed steps start (Recorder), and which
exceptions before a fit's first step count as the callback refusing it by name."""

from __future__ import annotations

import pytest

from l2lightning import L2GraphCallback
from tests.idiom_harness import Recorder, refused_by_the_callback
from tests.lightning_models import TinyMLP, quiet_trainer, regression_loader


@pytest.mark.parametrize(("factor", "first_batch"), [(1, 3), (4, 12)])
def test_the_clock_starts_at_the_timed_optimizer_step_not_only_the_timed_batch(factor, first_batch):
    # Under accumulation the callback captures at an optimizer step, several batches in: a clock
    # started at batch 3 would time the capture in one fit and not in the other.
    rec = Recorder(first_timed=3)
    trainer = quiet_trainer(accelerator="cpu", max_steps=6, accumulate_grad_batches=factor, callbacks=[rec])
    trainer.fit(TinyMLP(width=8, depth=1), regression_loader(n=64, width=8, batch_size=2))
    step_ms, timed = rec.step_ms()
    assert rec.timed_from == first_batch
    assert timed == 6 * factor - first_batch
    assert step_ms is not None and step_ms > 0


def _raised(make) -> BaseException:
    try:
        make()
    except Exception as exc:  # noqa: BLE001 -- what was raised is the subject
        return exc
    raise AssertionError("nothing raised")


def test_only_the_callbacks_own_refusal_counts_as_refused_by_name():
    class Strategy:  # stands in for the Trainer's strategy (FSDP) the callback refuses at set-up
        pass

    Strategy.__name__ = "FSDPStrategy"
    trainer = type("Trainer", (), {"strategy": Strategy()})()
    refusal = _raised(lambda: L2GraphCallback().setup(trainer, None, "fit"))
    assert isinstance(refusal, ValueError) and refused_by_the_callback(refusal)
    # a TypeError from elsewhere before the first step (SWA's deep copy of the module once) is a crash
    assert not refused_by_the_callback(_raised(lambda: __import__("copy").deepcopy(__import__("os"))))
    assert not refused_by_the_callback(ValueError("L2GraphCallback named, but raised outside the package"))
