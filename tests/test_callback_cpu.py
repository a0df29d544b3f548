"""L2GraphCallback without CUDA: it warns once, trains eagerly and identically, validates its arguments."""

from __future__ import annotations

import sys
import warnings
from types import SimpleNamespace

import pytest
import torch
import torchmetrics
from lightning.pytorch import Trainer, seed_everything

from l2lightning import L2GraphCallback, PrefetchPlan
from l2lightning import callback as callback_module
from l2lightning.callback import metric_update_counts, metric_update_reason, metrics_updated
from l2lightning.optim import CapturableOptimizer
from tests.lightning_models import TinyMLP, quiet_trainer, regression_loader


def fit(callbacks, steps: int = 6, model=None, **trainer_kwargs):
    seed_everything(0)
    model = TinyMLP() if model is None else model
    trainer = quiet_trainer(accelerator="cpu", max_steps=steps, callbacks=callbacks, **trainer_kwargs)
    trainer.fit(model, regression_loader())
    return model, trainer


def test_cpu_fit_with_callback_equals_fit_without():
    plain, _ = fit([])
    cb = L2GraphCallback()
    with pytest.warns(UserWarning, match="L2GraphCallback: no CUDA"):
        with_cb, trainer = fit([cb])
    assert trainer.global_step == 6
    for a, b in zip(plain.parameters(), with_cb.parameters()):
        assert torch.equal(a, b)
    summary = cb.summary()
    assert summary["captured"] is False and "no CUDA" in summary["reason"]
    assert all("training_step" not in vars(with_cb) for _ in [0])  # overrides were never installed


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"warmup_steps": 0}, "`warmup_steps` must be an int >= 1"),
        ({"warmup_steps": True}, "`warmup_steps` must be an int >= 1"),
        ({"prefetch": "fast"}, r"`prefetch` must be one of \('off', 'default', 'auto', 'decoy'\)"),
        ({"verify": "yes"}, "`verify` must be a bool"),
        ({"compile": 1}, "`compile` must be a bool"),
        ({"eager_optimizer_fallback": None}, "`eager_optimizer_fallback` must be a bool"),
    ],
)
def test_bad_arguments_are_rejected_naming_them(kwargs, message):
    with pytest.raises((ValueError, TypeError), match=message):
        L2GraphCallback(**kwargs)


def test_plan_object_is_accepted():
    assert L2GraphCallback(prefetch=PrefetchPlan(blocks=4)).prefetch.blocks == 4


def test_state_dict_round_trip():
    cb = L2GraphCallback()
    cb.capture_step = 7
    cb.plans = [{"layer": "net.0.1", "mib": 1.0, "forward": "hint8", "backward": None}]
    other = L2GraphCallback()
    other.load_state_dict(cb.state_dict())
    assert other.state_dict() == cb.state_dict()


def test_manual_optimization_is_refused_clearly():
    class Manual(TinyMLP):
        def __init__(self):
            super().__init__()
            self.automatic_optimization = False

    trainer = Trainer(
        accelerator="cpu",
        max_steps=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        callbacks=[L2GraphCallback()],
    )
    with pytest.raises(ValueError, match="supports automatic optimization only; Manual sets"):
        trainer.fit(Manual(), regression_loader())


def test_unsupported_strategy_is_named():
    from lightning.pytorch.strategies import SingleDeviceStrategy

    class FSDPStrategy(SingleDeviceStrategy):  # stands in for the real FSDP class name
        pass

    trainer = Trainer(
        strategy=FSDPStrategy(device=torch.device("cpu")),
        max_steps=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        callbacks=[L2GraphCallback()],
    )
    with pytest.raises(ValueError, match="does not support the FSDPStrategy.*FSDP, DeepSpeed"):
        trainer.fit(TinyMLP(), regression_loader())


def test_ddp_on_cpu_gloo_falls_back_and_trains_like_plain_ddp():
    plain, _ = fit([], steps=4, strategy="ddp_spawn", devices=2)
    cb = L2GraphCallback()
    with_cb, _ = fit([cb], steps=4, strategy="ddp_spawn", devices=2)
    for a, b in zip(plain.parameters(), with_cb.parameters()):
        assert torch.equal(a, b)
    assert not torch.equal(next(plain.parameters()), next(TinyMLP().parameters()))  # it did train


def test_summary_does_not_claim_a_capture_restored_from_a_checkpoint():
    cb = L2GraphCallback()
    cb.load_state_dict({"capture_step": 12, "plans": []})
    with pytest.warns(UserWarning, match="no CUDA"):
        fit([cb], steps=2)
    assert cb.summary()["captured"] is False and cb.summary()["capture_step"] == 12


# ---------------------------------------------------------------- torchmetrics inside training_step


class MetricInStep(TinyMLP):
    """Updates a torchmetrics object inside training_step: not replay-safe."""

    def __init__(self, call: str = "update"):
        super().__init__()
        self.train_mean = torchmetrics.MeanMetric()
        self.call = call

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        if self.call == "update":
            self.train_mean.update(loss.detach())
        else:
            self.train_mean(loss.detach())  # forward() updates the state too
        return loss


class MetricInBatchEnd(TinyMLP):
    """The supported pattern: training_step returns outputs, on_train_batch_end updates the metric."""

    def __init__(self):
        super().__init__()
        self.train_mean = torchmetrics.MeanMetric()

    def training_step(self, batch, batch_idx):
        return {"loss": super().training_step(batch, batch_idx)}

    def on_train_batch_end(self, outputs, batch, batch_idx):
        self.train_mean.update(outputs["loss"].detach())


def _batch():
    return next(iter(regression_loader()))


def _counted_training_step(model):
    """Update counts around training_step only, as the callback takes them, then on_train_batch_end."""
    model.log = lambda *a, **k: None  # no Trainer attached
    before = metric_update_counts(model)
    outputs = model.training_step(_batch(), 0)
    updated = metrics_updated(before, metric_update_counts(model))
    if isinstance(outputs, dict):
        model.on_train_batch_end(outputs, _batch(), 0)
    return updated


@pytest.mark.parametrize("call", ["update", "forward"])
def test_metric_updated_in_training_step_is_detected_by_name(call):
    model = MetricInStep(call)
    assert metric_update_counts(model) == {"train_mean": 0}
    assert _counted_training_step(model) == ["train_mean"]
    reason = metric_update_reason(["train_mean"])
    assert "['train_mean']" in reason and "on_train_batch_end" in reason


def test_metric_updated_in_on_train_batch_end_is_not_detected():
    model = MetricInBatchEnd()
    assert _counted_training_step(model) == []
    assert int(model.train_mean.update_count) == 1  # it was updated, outside training_step


def test_metric_detection_names_nested_metrics_and_ignores_modules_without_any(monkeypatch):
    model = TinyMLP()
    assert metric_update_counts(model) == {}
    model.metrics = torch.nn.ModuleDict({"acc": torchmetrics.MeanMetric()})
    before = metric_update_counts(model)
    model.metrics["acc"].update(torch.tensor(1.0))
    assert metrics_updated(before, metric_update_counts(model)) == ["metrics.acc"]
    # torchmetrics never imported: nothing can be a metric, and nothing is imported to find out
    monkeypatch.delitem(sys.modules, "torchmetrics")
    assert metric_update_counts(model) == {}


class _DoneEvent:
    """Stands in for a torch.cuda.Event on a machine without CUDA."""

    def __init__(self, ms: float = 1.0, done: bool = True):
        self.ms, self.done = ms, done

    def record(self):
        return None

    def query(self):
        return self.done

    def elapsed_time(self, end):
        return end.ms


def _cpu_decision_harness(monkeypatch, cb, capturable: bool):
    """Run the callback's warm-up steps on the CPU: no CUDA refusal, CPU stand-ins for the CUDA parts.

    `capturable=True` configures the optimizer as make_capturable does (tensor LR, capturable=True),
    which AdamW refuses to step on CPU parameters: a fit only gets through if the callback gives the
    optimizer back as it was configured before the update.
    """

    def fake_make_capturable(optimizer, device=None):
        original = [g.get("capturable") for g in optimizer.param_groups]
        configured = [g.get("lr") for g in optimizer.param_groups]
        if capturable:
            for group in optimizer.param_groups:
                group["capturable"] = True
                group["lr"] = torch.tensor(float(group["lr"]), dtype=torch.float32)
        return CapturableOptimizer(
            optimizer, tensor_lr=capturable, original_capturable=original, configured_lrs=configured
        )

    monkeypatch.setattr(callback_module, "make_capturable", fake_make_capturable)
    monkeypatch.setattr(cb, "_refusal", lambda trainer, pl_module: None)
    monkeypatch.setattr(cb, "_events", lambda: (_DoneEvent(), _DoneEvent()))


@pytest.mark.parametrize("call", ["update", "forward"])
def test_metric_in_training_step_refuses_capture_and_trains_like_plain_eager(monkeypatch, call):
    seed_everything(0)
    plain = fit([], steps=6, model=MetricInStep(call))[0]
    cb = L2GraphCallback(warmup_steps=3)
    _cpu_decision_harness(monkeypatch, cb, capturable=True)
    seed_everything(0)
    model = MetricInStep(call)
    with pytest.warns(
        UserWarning, match=r"training_step updates the torchmetrics objects \['train_mean'\]"
    ) as rec:
        fit([cb], steps=6, model=model)  # past the warm-up: a capture would be tried without the refusal
    assert sum("L2GraphCallback" in str(w.message) for w in rec) == 1  # one warning
    summary = cb.summary()
    assert summary["captured"] is False and summary["capture_step"] is None
    assert "['train_mean']" in summary["reason"] and "on_train_batch_end" in summary["reason"]
    for a, b in zip(plain.parameters(), model.parameters()):
        assert torch.equal(a, b)
    assert int(model.train_mean.update_count) == int(plain.train_mean.update_count) == 6
    assert torch.equal(model.train_mean.compute(), plain.train_mean.compute())
    optimizer_group = model.trainer.optimizers[0].param_groups[0]
    assert isinstance(optimizer_group["lr"], float) and not optimizer_group["capturable"]


def test_metric_in_on_train_batch_end_is_not_refused(monkeypatch):
    cb = L2GraphCallback(warmup_steps=3)
    _cpu_decision_harness(monkeypatch, cb, capturable=False)
    model = MetricInBatchEnd()
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="L2GraphCallback")
        fit([cb], steps=3, model=model)  # the warm-up steps only: capturing needs CUDA
    assert cb.summary()["reason"] is None and cb._mode == "warmup"
    assert int(model.train_mean.update_count) == 3


# ---------------------------------------------------------------- l2/* metrics to the loggers


class _RecordingLogger:
    def __init__(self):
        self.rows = []

    def log_metrics(self, metrics, step):
        self.rows.append((step, dict(metrics)))


def _logging_state(replays: int, last_done: bool = True, rank_zero: bool = True):
    """A callback as it stands after a capture with `replays` timed replays, and a Trainer stand-in."""
    cb = L2GraphCallback()
    cb._module = TinyMLP()
    cb._graph = object()
    cb._captured = True
    cb.capture_step = 3
    cb._pool_mib = 12.5
    cb.plans = [
        {"layer": "net.0.1", "mib": 1.5, "forward": "hint8", "backward": None},
        {"layer": "net.1.1", "mib": 2.0, "forward": None, "backward": None},
    ]
    cb._timing.eager = [(_DoneEvent(), _DoneEvent(9.0)), (_DoneEvent(), _DoneEvent(4.0))]
    cb._timing.graph = [(_DoneEvent(), _DoneEvent(2.0)) for _ in range(replays)]
    if replays:
        cb._timing.graph[-1][1].done = last_done
    logger = _RecordingLogger()
    epoch_loop = SimpleNamespace(_batches_that_stepped=replays + 3)
    trainer = SimpleNamespace(
        loggers=[logger],
        is_global_zero=rank_zero,
        global_step=replays + 4,
        fit_loop=SimpleNamespace(epoch_loop=epoch_loop),
    )
    return cb, trainer, logger


def _batch_end(cb, trainer):
    cb.on_train_batch_end(trainer, cb._module, None, None, 0)


def test_l2_metrics_are_logged_once_at_the_first_batch_end_after_timed_replays():
    n = callback_module.TIMED_REPLAYS_BEFORE_LOG
    cb, trainer, logger = _logging_state(replays=n - 1)
    _batch_end(cb, trainer)
    assert logger.rows == []  # not known yet
    cb._timing.graph.append((_DoneEvent(), _DoneEvent(2.0)))
    trainer.fit_loop.epoch_loop._batches_that_stepped += 1
    trainer.global_step += 1  # in on_train_batch_end, one ahead of the step Lightning logs at
    _batch_end(cb, trainer)
    assert len(logger.rows) == 1
    step, metrics = logger.rows[0]
    assert step == n + 3 and trainer.global_step == n + 4  # Lightning's step for this batch's metrics
    assert metrics == {
        "l2/eager_step_ms": 4.0,  # the first eager step (lazy initialisation) is left out
        "l2/graph_step_ms": 2.0,
        "l2/speedup": 2.0,
        "l2/graph_pool_mib": 12.5,
        "l2/prefetch_layers": 1.0,
        "l2/prefetch_mib": 1.5,
        "l2/fallback_steps": 0.0,
    }
    assert all(type(v) is float for v in metrics.values())
    _batch_end(cb, trainer)
    _batch_end(cb, trainer)
    assert len(logger.rows) == 1  # once per fit


def test_l2_metrics_wait_for_the_replays_to_finish_without_syncing():
    cb, trainer, logger = _logging_state(replays=callback_module.TIMED_REPLAYS_BEFORE_LOG, last_done=False)
    _batch_end(cb, trainer)
    assert logger.rows == []
    cb._timing.graph[-1][1].done = True
    _batch_end(cb, trainer)
    assert len(logger.rows) == 1


@pytest.mark.parametrize("case", ["not rank zero", "log_timing off", "no graph"])
def test_l2_metrics_are_not_logged_early_off_rank_zero_without_opt_in_or_graph(case):
    cb, trainer, logger = _logging_state(
        replays=callback_module.TIMED_REPLAYS_BEFORE_LOG + 2, rank_zero=case != "not rank zero"
    )
    if case == "log_timing off":
        cb.log_timing = False
    if case == "no graph":
        cb._graph = None
    _batch_end(cb, trainer)
    assert logger.rows == []


def test_l2_metrics_are_logged_again_at_epoch_end(monkeypatch):
    cb, trainer, logger = _logging_state(replays=callback_module.TIMED_REPLAYS_BEFORE_LOG)
    _batch_end(cb, trainer)
    cb._timing.graph.append((_DoneEvent(), _DoneEvent(1.0)))
    cb.fallback_steps = 1
    trainer.fit_loop.epoch_loop._batches_that_stepped += 1
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: None)
    cb.on_train_epoch_end(trainer, cb._module)
    assert len(logger.rows) == 2
    step, metrics = logger.rows[1]
    assert step == callback_module.TIMED_REPLAYS_BEFORE_LOG + 4
    assert metrics["l2/fallback_steps"] == 1.0 and metrics["l2/graph_step_ms"] == 2.0
    assert set(metrics) == set(logger.rows[0][1])  # one consistent set of keys
