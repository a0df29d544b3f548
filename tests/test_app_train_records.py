"""CPU tests: what the training entry point records and prints.

Step times (which steps, which clock, how many), the headline `fit_step_speedup` (wall-clock
Trainer.fit step, eager fit / fit with the callback) beside the callback's CUDA-event
`replay_speedup`, the one-line summary, the path through the callback (on a CPU, where the callback
refuses and says why), and the warnings and Lightning lines that reach train.log.
"""

from __future__ import annotations

import logging
import warnings

import pytest

import l2lightning.app.train as train
from l2lightning import _env
from tests.train_helpers import run_overrides

pytestmark = pytest.mark.usefixtures("one_torch_thread")

TINY = [
    "model.width=16",
    "model.depth=1",
    "data.batch_size=4",
    "data.train_batches=4",
    "data.val_batches=1",
    "trainer=cpu",
    "validate=false",
]


def test_step_time_selection():
    times = [(0, 50.0), (1, 4.0), (2, 3.0), (3, 2.0), (4, 1.0), (5, 1.2), (6, 0.8)]
    # eager: the first three steps left out (lazy initialisation)
    assert train.eager_step_time(times) == (1.1, 4, 3)  # median of 2.0, 1.0, 1.2, 0.8
    # a short fit: fewer left out, at least one step timed
    assert train.eager_step_time(times[:2]) == (4.0, 1, 1)
    assert train.eager_step_time([]) == (None, 0, 0)
    # with the callback: the warm-up and capture steps (<= capture step) left out
    assert train.graph_step_time(times, capture_step=3) == (1.0, 3)
    assert train.graph_step_time(times, capture_step=None) == (None, 0)
    assert train.graph_step_time(times, capture_step=6) == (None, 0)


def test_timing_text_names_the_clock_and_counts_the_steps():
    cpu = train.timing_text("time.perf_counter on the host", (2.0, 1, 1))
    assert "only 1 step of this fit after its first 1" in cpu and "CUDA" not in cpu
    gpu = train.timing_text(
        "CUDA events at each step start, GPU timeline",
        (12.0, 17, 3),
        (2.0, 196),
        capture_step=3,
        eager_source="the 20-step eager baseline fit",
    )
    assert "eager: 17 steps of the 20-step eager baseline fit after its first 3" in gpu
    assert "with the callback: 196 steps after the capture step 3" in gpu
    assert "synchronised" not in gpu
    assert "no step after a capture" in train.timing_text("x", (1.0, 3, 3), (None, 0))


def test_summary_line_of_a_captured_run():
    result = {
        "status": "ok",
        "steps": 200,
        "device": "NVIDIA H200",
        "l2": "sized",
        "callback": True,
        "captured": True,
        "capture_step": 3,
        "eager_step_ms": 12.2,
        "graph_step_ms": 1.82,
        "fit_step_speedup": 12.2 / 1.82,
        "replay_speedup": 10.67,
        "final_loss": 0.01234,
    }
    assert train.summary_line(result) == (
        "l2lightning: 200 steps on NVIDIA H200; eager fit 12.2 ms/step, with L2GraphCallback 1.82 ms/step, "
        "speedup 6.70x (graph replay vs eager step, CUDA events: 10.67x); l2=sized, captured at step 3; "
        "final loss 0.01234"
    )
    result.update(captured=False, reason="no CUDA (x)", graph_step_ms=None, fit_step_speedup=None)
    line = train.summary_line(result)
    assert "with L2GraphCallback n/a/step, speedup n/a" in line
    assert "l2=sized, not captured: no CUDA (x)" in line
    assert train.summary_line({"status": "failed", "error": "boom"}) == "failed: boom"


def test_printed_summary_of_a_cpu_run(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="l2lightning.app.train")
    result = run_overrides([*TINY, "trainer.max_steps=5", "l2=none"], tmp_path / "run")
    lines = [r.getMessage() for r in caplog.records if r.name == "l2lightning.app.train"]
    assert lines[-2] == f"l2lightning: run directory: {tmp_path.resolve() / 'run'}"
    assert lines[-1] == train.summary_line(result)
    assert lines[-1].startswith("l2lightning: 5 steps on cpu; eager ") and "(2 steps timed)" in lines[-1]
    assert "not captured: l2 none (l2=none)" in lines[-1]


def test_the_callback_path_records_what_ran_and_why(tmp_path, monkeypatch):
    # As if CUDA were there: the entry point runs the eager baseline fit and passes the callback to
    # the Trainer. The Trainer is on the CPU, so the callback refuses to capture and says why.
    monkeypatch.setattr(_env, "cuda_unavailable_reason", lambda: None)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the callback's own "training eagerly" warning
        result = run_overrides([*TINY, "trainer.max_steps=2", "eager_baseline_steps=3"], tmp_path / "run")
    assert result["callback"] is True and result["l2"] == "sized" and result["l2_requested"] == "sized"
    assert result["captured"] is False and result["reason"]  # the callback's reason
    assert result["eager_step_ms"] > 0 and result["eager_steps_timed"] == 1  # of the 3-step baseline
    assert result["graph_step_ms"] is None and result["fit_step_speedup"] is None
    assert "3-step eager baseline fit" in result["timing"]
    assert "with the callback: no step after a capture was timed" in result["timing"]
    assert not (tmp_path / "run" / "eager_baseline").exists()  # the baseline fit writes nothing


def test_warnings_and_lightning_lines_reach_the_log_file(tmp_path):
    from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn

    handler = logging.FileHandler(tmp_path / "train.log")
    root = logging.getLogger()
    root.addHandler(handler)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("always")
            with train._warnings_and_lightning_to_log():
                rank_zero_warn("L2GraphCallback: a capture failed; training eagerly.")
                rank_zero_info("`Trainer.fit` stopped: `max_steps=2` reached.")
            assert logging.getLogger("lightning.pytorch").handlers.count(handler) == 0  # detached again
    finally:
        root.removeHandler(handler)
        handler.close()
    text = (tmp_path / "train.log").read_text()
    assert "UserWarning: L2GraphCallback: a capture failed; training eagerly." in text
    assert "`Trainer.fit` stopped: `max_steps=2` reached." in text


def test_the_headline_goes_to_the_loggers_as_l2_speedup():
    class Recording:
        def __init__(self):
            self.rows, self.saved = [], 0

        def log_metrics(self, metrics, step):
            self.rows.append((step, metrics))

        def save(self):
            self.saved += 1

    logger = Recording()
    train.log_headline([logger], 40, 6.0, 1.5, 4.0)
    assert logger.rows == [(40, {"l2/speedup": 4.0, "l2/eager_fit_step_ms": 6.0, "l2/fit_step_ms": 1.5})]
    assert logger.saved == 1
    train.log_headline([logger], 41, 6.0, None, None)  # no capture timed: nothing to claim
    assert len(logger.rows) == 1


@pytest.mark.skipif(
    _env.cuda_unavailable_reason() is None, reason="checks a CPU run; with CUDA the l2 entry is used"
)
def test_a_cpu_run_marks_the_callbacks_it_did_not_use(tmp_path):
    run_dir = tmp_path / "run"
    result = run_overrides([*TINY, "trainer.max_steps=2"], run_dir)
    entries = result["config"]["callbacks"]
    # trainer/cpu.yaml turns checkpoints off: no ModelCheckpoint was built, its directory never made
    assert entries["model_checkpoint"]["_unused_"] == "trainer.enable_checkpointing is false"
    assert not (run_dir / "checkpoints").exists()
    assert entries["l2"]["_unused_"].startswith("no CUDA (")
    # the entries that ran are left as configured
    assert "_unused_" not in entries["lr_monitor"] and "_unused_" not in entries["progress_bar"]
    assert entries["l2"]["_target_"] == "l2lightning.L2GraphCallback"


def test_a_run_without_logger_marks_the_lr_monitor(tmp_path):
    result = run_overrides([*TINY, "trainer.max_steps=2", "~logger", "l2=none"], tmp_path / "run")
    assert result["config"]["callbacks"]["lr_monitor"]["_unused_"] == "no logger"
    assert result["config"]["callbacks"]["l2"] is None  # l2=none: nothing to mark


def test_summary_line_of_a_resumed_run():
    result = {
        "status": "ok",
        "steps": 20,
        "fit_steps": 10,
        "resumed_from_step": 10,
        "device": "cpu",
        "callback": False,
        "eager_step_ms": 2.0,
        "eager_steps_timed": 7,
        "l2": "none (l2=none)",
        "final_loss": 0.5,
    }
    assert train.summary_line(result).startswith(
        "l2lightning: 10 steps (resumed from step 10, to step 20) on cpu; eager 2 ms/step (7 steps timed)"
    )
    assert train.summary_line({**result, "fit_steps": 1}).startswith("l2lightning: 1 step (resumed")
