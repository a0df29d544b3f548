"""GPU: re-issued ``self.log`` calls (the shortcut in ``l2lightning.guards.log_replay``) leave exactly what an
eager fit leaves in the progress bar, ``callback_metrics``, ``logged_metrics`` and a CSV logger."""

from __future__ import annotations

import pytest
import torch
from lightning.pytorch import seed_everything
from lightning.pytorch.loggers import CSVLogger

from l2lightning import L2GraphCallback
from tests.baselines import (  # noqa: F401 -- the fixture records each callback fit's switch step
    baseline_of,
    capturable_from_of_the_last_callback_fit,
)
from tests.lightning_models import quiet_trainer, regression_loader
from tests.logging_models import LoggedEverywhere, ManyLogs, assert_logged_alike

pytestmark = pytest.mark.gpu


def _fit(cls, callbacks, tmp_path, name):
    seed_everything(0)
    torch.use_deterministic_algorithms(True, warn_only=True)
    seen = LoggedEverywhere(callbacks[0] if callbacks else None)
    trainer = quiet_trainer(
        accelerator="gpu",
        devices=1,
        max_epochs=3,
        deterministic=True,
        logger=CSVLogger(tmp_path, name=name, version=0),
        log_every_n_steps=1,
        callbacks=[seen, *callbacks],
    )
    model = cls(width=256, depth=4)
    trainer.fit(model, regression_loader(n=96, width=256))
    return model, seen, (tmp_path / name / "version_0" / "metrics.csv").read_text()


@pytest.mark.parametrize("prefetch", ["off", "auto"])
def test_reissued_logs_equal_the_eager_fit_everywhere_users_read_them(tmp_path, prefetch):
    cb = L2GraphCallback(prefetch=prefetch, log_timing=False)
    model, seen, csv_text = _fit(ManyLogs, [cb], tmp_path, f"callback_{prefetch}")
    base_model, base_seen, base_csv = _fit(baseline_of(ManyLogs), [], tmp_path, "eager")
    summary = cb.summary()
    assert summary["captured"] and summary["fallback_steps"] == 0, summary
    # the replays dispatched only the overridden closure hooks (l2lightning.graph.replay_closure)
    assert cb._dispatch.replay_closure is not None and cb._dispatch.replay_closure.calls > 0
    assert_logged_alike(base_seen, seen)
    assert csv_text == base_csv
    for (name, p), q in zip(base_model.named_parameters(), model.parameters()):
        assert torch.equal(p, q), f"parameter {name} differs"
    assert seen.log_calls and all(call.fast_issues > 0 for call in seen.log_calls)
    # the per-step tensors (step_only, d/a, d/b, head_grad, TinyMLP's two) took the one-copy path
    assert {c.name for c in seen.log_calls if c._step_only} >= {"step_only", "d/a", "d/b", "head_grad"}
