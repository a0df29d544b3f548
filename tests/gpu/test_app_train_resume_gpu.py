"""GPU: the training entry point with L2GraphCallback on CUDA.

`ckpt_path=` resumes a captured run exactly: the resumed fit warms up and captures again after the
checkpoint, and ends with the parameters and optimizer state of the uninterrupted run, bit for bit.
And result.json's headline is the wall-clock Trainer.fit step ratio, with the replay ratio beside it.
"""

from __future__ import annotations

import pytest

from tests.test_app_train_resume import assert_same_checkpoint, resume_overrides
from tests.train_helpers import run_overrides

pytestmark = pytest.mark.gpu

STEPS, EVERY = 12, 4  # capture at step 3 (3 warm-up steps); the resumed run captures again at step 7


def test_resume_with_the_callback_equals_uninterrupted_run(tmp_path):
    def overrides(run_dir):
        return [
            *resume_overrides(run_dir, steps=STEPS, every=EVERY, device="gpu", width=512),
            "l2=sized",
            "trainer.deterministic=true",
        ]

    full_dir, resumed_dir = tmp_path / "full", tmp_path / "resumed"
    full = run_overrides(overrides(full_dir), full_dir)
    assert full["callback"] is True and full["captured"] is True, full["reason"]
    assert full["capture_step"] == 3 and full["steps"] == STEPS and full["fallback_steps"] == 0
    mid = full_dir / "checkpoints" / f"epoch0-step{EVERY}.ckpt"
    assert mid.is_file()

    resumed = run_overrides([*overrides(resumed_dir), f"ckpt_path={mid}"], resumed_dir)
    assert resumed["callback"] is True and resumed["captured"] is True, resumed["reason"]
    assert resumed["capture_step"] == EVERY + 3  # re-captured after three warm-up steps of its own
    assert resumed["steps"] == STEPS and resumed["final_loss"] == full["final_loss"]
    last = f"epoch{STEPS // EVERY - 1}-step{STEPS}.ckpt"
    assert_same_checkpoint(full_dir / "checkpoints" / last, resumed_dir / "checkpoints" / last)
    assert_same_checkpoint(full_dir / "checkpoints" / "last.ckpt", resumed_dir / "checkpoints" / "last.ckpt")


def test_headline_is_the_wall_clock_fit_step_ratio(tmp_path):
    overrides = [
        *resume_overrides(tmp_path, steps=20, every=10, device="gpu", width=512),
        "l2=sized",
        "eager_baseline_steps=10",
    ]
    result = run_overrides(overrides, tmp_path)
    assert result["captured"] is True, result["reason"]
    assert result["eager_steps_timed"] == 7  # the 10-step eager baseline fit after its first 3
    assert result["graph_steps_timed"] == 20 - 4  # the steps after the capture step 3
    assert result["eager_step_ms"] > 0 and result["graph_step_ms"] > 0
    assert result["fit_step_speedup"] == pytest.approx(result["eager_step_ms"] / result["graph_step_ms"])
    assert result["speedup"] == result["fit_step_speedup"]
    assert result["replay_speedup"] > 0 and result["replay_graph_step_ms"] > 0
    assert "CUDA events" in result["timing"] and "synchronised" not in result["timing"]
    assert "10-step eager baseline fit" in result["timing"]
