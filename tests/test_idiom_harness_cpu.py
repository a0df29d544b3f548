"""The idiom harness's clock (tests/idiom_harness.py Recorder): where a fit's timed steps start."""

from __future__ import annotations

import pytest

from tests.idiom_harness import Recorder
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
