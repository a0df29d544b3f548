"""L2GraphCallback without CUDA: it warns once, trains eagerly and identically, validates its arguments."""

from __future__ import annotations

import atexit
import sys
from types import SimpleNamespace

import pytest
import torch
import torchmetrics
from lightning.fabric.utilities.distributed import _destroy_dist_connection
from lightning.pytorch import Callback, Trainer, seed_everything

from l2lightning import L2GraphCallback, PrefetchPlan
from l2lightning.callback import fit_report
from l2lightning.callback.prefetch_setup import PrefetchSetup
from l2lightning.callback.step_gate import StepGateResult
from l2lightning.callback.warmup_steps import WarmupSteps, metric_update_reason
from l2lightning.graph.optim import baked_schedule_advice
from l2lightning.guards.metric_binding import (
    sync_free_nan_check,
    unreplayable_reason,
    update_counts,
    updated_between,
)
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
        ({"verify": "yes"}, r"`verify` must be one of \('sampled', 'capture', False\)"),
        ({"compile": 1}, "`compile` must be a bool"),
        ({"eager_optimizer_fallback": None}, "`eager_optimizer_fallback` must be a bool"),
        ({"operand_scalars": "yes"}, r"`operand_scalars` must be a bool \(True or False\), got 'yes'"),
        (
            {"eager_steps": 10},
            r"`eager_steps` must be None or a callable \(trainer, batch_idx\) -> bool, got 10",
        ),
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


def test_manual_optimization_without_cuda_trains_eagerly_with_a_warning_naming_why():
    """Lightning's basic-GAN tutorial style: the fit plain Lightning runs, the callback runs too (eagerly,
    here for want of CUDA; the capture itself: tests/graph/test_manual_optimization_cpu.py)."""

    from tests.graph.test_manual_optimization_cpu import (
        ManualMLP,  # zero_grad, manual_backward, step; returns None
    )

    def run(callbacks):
        torch.manual_seed(0)
        model = ManualMLP()
        trainer = quiet_trainer(accelerator="cpu", max_steps=3, callbacks=callbacks)
        trainer.fit(model, regression_loader())
        return model, trainer

    graph = L2GraphCallback()
    with pytest.warns(UserWarning, match=r"no CUDA"):
        model, trainer = run([graph])
    plain, _ = run([])
    assert trainer.global_step == 3
    assert graph.summary()["captured"] is False and "no CUDA" in graph.summary()["reason"]
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), plain.parameters()))


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


class DestroyGlooGroupAtExit(Callback):
    """Destroys the gloo process group at each worker's exit, while the interpreter is still alive.

    Lightning registers that for NCCL only. Left to interpreter finalization, gloo's worker threads
    sometimes abort the process ("terminate called without an active exception", SIGABRT) after a
    fit that finished, with or without L2GraphCallback; CI saw it once in a plain ddp_spawn fit.
    """

    def setup(self, trainer, pl_module, stage):
        atexit.register(_destroy_dist_connection)


def test_ddp_on_cpu_gloo_falls_back_and_trains_like_plain_ddp():
    plain, _ = fit([DestroyGlooGroupAtExit()], steps=4, strategy="ddp_spawn", devices=2)
    cb = L2GraphCallback()
    with_cb, _ = fit([cb, DestroyGlooGroupAtExit()], steps=4, strategy="ddp_spawn", devices=2)
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
    """Updates a torchmetrics object inside training_step (captured with the step)."""

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


def _counted_training_step(model):
    """Update counts around training_step only, as the callback takes them."""
    model.log = lambda *a, **k: None  # no Trainer attached
    before = update_counts(model)
    model.training_step(next(iter(regression_loader())), 0)
    return updated_between(before, update_counts(model))


@pytest.mark.parametrize("call", ["update", "forward"])
def test_metric_updated_in_training_step_is_detected_by_name(call):
    model = MetricInStep(call)
    assert update_counts(model) == {"train_mean": 0}
    assert _counted_training_step(model) == ["train_mean"]
    assert unreplayable_reason("train_mean", model.train_mean) is None  # a sum-reduced tensor state
    reason = metric_update_reason(["train_cat"], "it keeps a list")
    assert "['train_cat']" in reason and "on_train_batch_end" in reason


def test_list_and_mean_reduced_metric_states_are_named_as_unreplayable():
    cat = torchmetrics.CatMetric()
    assert "`preds` (CatMetric) keeps a list state `value`" in unreplayable_reason("preds", cat)

    class MeanReduced(torchmetrics.Metric):
        def __init__(self):
            super().__init__()
            self.add_state("m", default=torch.tensor(0.0), dist_reduce_fx="mean")

        def update(self, x):
            self.m += x

        def compute(self):
            return self.m

    assert "reduces its state `m` with dim_zero_mean" in unreplayable_reason("m", MeanReduced())


def test_metric_detection_names_nested_metrics_and_ignores_modules_without_any(monkeypatch):
    model = TinyMLP()
    assert update_counts(model) == {}
    model.metrics = torch.nn.ModuleDict({"acc": torchmetrics.MeanMetric()})
    before = update_counts(model)
    model.metrics["acc"].update(torch.tensor(1.0))
    assert updated_between(before, update_counts(model)) == ["metrics.acc"]
    # torchmetrics never imported: nothing can be a metric, and nothing is imported to find out
    monkeypatch.delitem(sys.modules, "torchmetrics")
    assert update_counts(model) == {}


@pytest.mark.parametrize("strategy", ["warn", "ignore", 0.5])
def test_sync_free_nan_check_matches_the_eager_mean_without_nan_and_ignores_nan(strategy):
    eager, patched = (
        torchmetrics.MeanMetric(nan_strategy=strategy),
        torchmetrics.MeanMetric(nan_strategy=strategy),
    )
    patched._cast_and_nan_check_input = sync_free_nan_check(patched)
    x = torch.randn(37)
    eager.update(x)
    patched.update(x)
    assert torch.equal(eager.compute(), patched.compute())
    with_nan = torch.tensor([1.0, float("nan"), 3.0])
    expected = 2.0 if strategy != 0.5 else 1.5
    patched.reset()
    patched.update(with_nan)
    assert float(patched.compute()) == pytest.approx(expected)


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


# ---------------------------------------------------------------- l2/* metrics to the loggers


class _RecordingLogger:
    def __init__(self):
        self.rows = []

    def log_metrics(self, metrics, step):
        self.rows.append((step, dict(metrics)))


def _logging_state(replays: int, last_done: bool = True, rank_zero: bool = True):
    """A callback as it stands after a capture with `replays` timed replays, and a Trainer stand-in."""
    cb = L2GraphCallback()
    cb._fit.module = TinyMLP()
    cb._slots.state.graph = object()
    cb._capture.captured = True
    cb.capture_step = 3
    cb._capture.pool_mib = 12.5
    cb.plans = [
        {"layer": "net.0.1", "mib": 1.5, "forward": "hint8", "backward": None},
        {"layer": "net.1.1", "mib": 2.0, "forward": None, "backward": None},
    ]
    cb._fit_report.timing.eager.extend([(_DoneEvent(), _DoneEvent(9.0)), (_DoneEvent(), _DoneEvent(4.0))])
    cb._fit_report.timing.graph.extend((_DoneEvent(), _DoneEvent(2.0)) for _ in range(replays))
    cb._fit_report.timing.graph_count = replays
    if replays:
        cb._fit_report.timing.graph[-1][1].done = last_done
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
    cb.on_train_batch_end(trainer, cb._fit.module, None, None, 0)


def test_l2_metrics_are_logged_once_at_the_first_batch_end_after_timed_replays():
    n = fit_report.TIMED_REPLAYS_BEFORE_LOG
    cb, trainer, logger = _logging_state(replays=n - 1)
    _batch_end(cb, trainer)
    assert logger.rows == []  # not known yet
    cb._fit_report.timing.graph.append((_DoneEvent(), _DoneEvent(2.0)))
    cb._fit_report.timing.graph_count += 1
    trainer.fit_loop.epoch_loop._batches_that_stepped += 1
    trainer.global_step += 1  # in on_train_batch_end, one ahead of the step Lightning logs at
    _batch_end(cb, trainer)
    assert len(logger.rows) == 1
    step, metrics = logger.rows[0]
    assert step == n + 3 and trainer.global_step == n + 4  # Lightning's step for this batch's metrics
    assert metrics == {
        "l2/eager_step_ms": 6.5,  # the median of the timed eager steps
        "l2/graph_step_ms": 2.0,
        "l2/replay_speedup": 3.25,
        "l2/graph_pool_mib": 12.5,
        "l2/tuning_s": 0.0,  # this state was set up by hand: no tuning, capture or compile ran
        "l2/capture_s": 0.0,
        "l2/compile_s": 0.0,
        "l2/recapture_s": 0.0,
        "l2/prefetch_layers": 1.0,
        "l2/prefetch_mib": 1.5,
        "l2/fallback_steps": 0.0,
    }
    assert all(type(v) is float for v in metrics.values())
    _batch_end(cb, trainer)
    _batch_end(cb, trainer)
    assert len(logger.rows) == 1  # once per fit


def test_l2_metrics_wait_for_the_replays_to_finish_without_syncing():
    cb, trainer, logger = _logging_state(replays=fit_report.TIMED_REPLAYS_BEFORE_LOG, last_done=False)
    _batch_end(cb, trainer)
    assert logger.rows == []
    cb._fit_report.timing.graph[-1][1].done = True
    _batch_end(cb, trainer)
    assert len(logger.rows) == 1


def test_l2_metrics_are_logged_once_enough_replays_completed_though_the_host_runs_ahead():
    """A host that does not wait for the device finds the latest replay pending at every batch end;
    the metrics go out once the first replays are done, over the done ones."""
    n = fit_report.TIMED_REPLAYS_BEFORE_LOG
    cb, trainer, logger = _logging_state(replays=n + 3)
    for _, end in list(cb._fit_report.timing.graph)[n - 1 :]:
        end.done = False  # the device is 4 replays behind
    _batch_end(cb, trainer)
    assert logger.rows == []
    cb._fit_report.timing.graph[n - 1][1].done = True
    cb._fit_report.timing.graph[n - 1][1].ms = 4.0  # the median over the n done: of [2.0] * (n - 1) + [4.0]
    _batch_end(cb, trainer)
    assert len(logger.rows) == 1 and logger.rows[0][1]["l2/graph_step_ms"] == 2.0


@pytest.mark.parametrize("case", ["not rank zero", "log_timing off", "no graph"])
def test_l2_metrics_are_not_logged_early_off_rank_zero_without_opt_in_or_graph(case):
    cb, trainer, logger = _logging_state(
        replays=fit_report.TIMED_REPLAYS_BEFORE_LOG + 2, rank_zero=case != "not rank zero"
    )
    if case == "log_timing off":
        cb.log_timing = False
    if case == "no graph":
        cb._slots.state.graph = None
    _batch_end(cb, trainer)
    assert logger.rows == []


def test_l2_metrics_are_logged_again_at_epoch_end(monkeypatch):
    cb, trainer, logger = _logging_state(replays=fit_report.TIMED_REPLAYS_BEFORE_LOG)
    _batch_end(cb, trainer)
    cb._fit_report.timing.graph.append((_DoneEvent(), _DoneEvent(1.0)))
    cb._fit_report.timing.graph_count += 1
    cb._decision.fallback_steps = 1  # (the decision part counts the steps that ran eagerly)
    trainer.fit_loop.epoch_loop._batches_that_stepped += 1
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: None)
    cb.on_train_epoch_end(trainer, cb._fit.module)
    assert len(logger.rows) == 2
    step, metrics = logger.rows[1]
    assert step == fit_report.TIMED_REPLAYS_BEFORE_LOG + 4
    assert metrics["l2/fallback_steps"] == 1.0 and metrics["l2/graph_step_ms"] == 2.0
    assert set(metrics) == set(logger.rows[0][1])  # one consistent set of keys


def test_autotune_argument_is_checked_up_front_and_reaches_the_tuner(monkeypatch):
    from l2lightning.prefetch import hooks as prefetch_hooks

    with pytest.raises(ValueError, match=r"`autotune` has unknown settings \['budget'\]"):
        L2GraphCallback(autotune={"budget": 1.0})
    with pytest.raises(TypeError, match="`autotune` must be None, an l2lightning.Autotuner"):
        L2GraphCallback(autotune=3)
    seen = {}

    class Hooks:
        def __init__(self, *args, **kwargs):
            seen.update(kwargs)

    monkeypatch.setattr(prefetch_hooks, "PrefetchHooks", Hooks)
    monkeypatch.setattr("l2lightning.callback.prefetch_setup.prefetch_unavailable_reason", lambda: None)
    cb = L2GraphCallback(autotune={"budget_s": 0.2, "cache": None})
    cb._prefetch.static_batch = type("S", (), {"batch": None})()
    cb._fit.originals = {"training_step": None, "log": None}
    cb._prefetch._prefetch_hooks(torch.nn.Linear(1, 1))
    assert seen["autotune"] == {"budget_s": 0.2, "cache": None} and seen["plans"] == "auto"


@pytest.mark.parametrize(
    "changed, advice",
    [
        (
            ["lr"],
            "Use Adam or AdamW (their learning rate is read from a tensor) or step the schedule per epoch",
        ),
        (
            ["lr", "momentum"],
            "Use Adam or AdamW (their learning rate is read from a tensor), pass `cycle_momentum=False` to "
            "OneCycleLR or CyclicLR (it cycles the momentum by default), or step the schedule per epoch",
        ),
        (
            ["betas"],
            "Pass `cycle_momentum=False` to OneCycleLR or CyclicLR (it cycles the momentum by default) or step "
            "the schedule per epoch",
        ),
        (["weight_decay"], "Step the schedule per epoch"),
    ],
)
def test_a_per_step_schedule_of_baked_hyperparameters_gets_advice_for_what_it_changes(changed, advice):
    assert baked_schedule_advice(changed) == advice


def test_traced_steps_watch_the_submodules_the_user_compiled_and_those_compile_true_compiled():
    cb = L2GraphCallback()
    module = TinyMLP(width=8, depth=2)
    assert cb._warmup.compiled_submodules() == []  # before the fit: no module
    cb._fit.module = module
    module.net[0] = torch.compile(module.net[0], backend="eager")
    module.net[1].compile(backend="eager")  # compiled in place
    cb._compiled_children.append(module.head)  # (the list the warm-up part holds)
    assert [(name, type(sub).__name__) for name, sub in cb._warmup.compiled_submodules()] == [
        ("net.0", "OptimizedModule"),
        ("net.1", "Sequential"),
        ("head", "Linear"),
    ]


def assert_held_part(cb, part, cls, given=(), old_names=()):
    """`part` (a `cls`) is one the callback holds, not a base of it: the callback is never among what the
    part was given, the callables named in `given` are bound methods of the callback, and none of
    `old_names` (what the callback had while `cls` was a mixin) is left on the callback."""
    assert isinstance(part, cls) and not isinstance(cb, cls) and cls not in type(cb).__mro__
    assert all(value is not cb for value in vars(part).values())  # the callback's callables, never itself
    assert all(getattr(part, name).__self__ is cb for name in given), given
    for name in old_names:
        assert not hasattr(cb, name), name


def test_the_fit_report_is_a_part_the_callback_holds_with_its_own_state():
    """FitReport declares its state in its __init__; the callback keeps none of it itself, and each
    fit gets a fresh one (its timed steps and logged flag are per fit)."""
    cb = L2GraphCallback()
    assert isinstance(cb._fit_report, fit_report.FitReport) and not isinstance(cb, fit_report.FitReport)
    part = fit_report.FitReport(report=False)
    assert set(vars(part)) == {"timing", "timing_logged", "phase_events", "kernel_counter", "step_report"}
    for name in ("_timing", "_timing_logged", "_phase_events", "_kernel_counter"):
        assert not hasattr(cb, name)
    first = cb._fit_report
    first.timing_logged = True
    cb._reset_run_state()
    assert cb._fit_report is not first and cb._fit_report.timing_logged is False
    assert cb.step_report is None and cb.summary()["step_report"] is None


def test_the_warmup_is_a_part_that_reads_the_fit_state_and_keeps_what_it_learns():
    """WarmupSteps declares what the warm-up learns in its __init__, reads the fit through the callback's
    FitState (the same object, not a copy) and is made afresh for each fit."""
    cb = L2GraphCallback(warmup_steps=4)
    assert not isinstance(cb, WarmupSteps) and WarmupSteps not in type(cb).__mro__
    part = cb._warmup
    assert part._fit is cb._fit and part._fit_report is cb._fit_report and part._warmup_steps == 4
    for name in ("_traced_steps", "_groups", "_tracer", "_eager_hooks", "_hidden_random", "_baked_history"):
        assert not hasattr(cb, name), name
    # the lists the callback fills at set-up are the ones the part reads
    assert part._compiled_children is cb._compiled_children
    assert part._callback_overrides is cb._callback_overrides
    module = TinyMLP(width=8, depth=2)
    cb._fit.module = module
    cb._compiled_children.append(module.head)
    assert [name for name, _ in part.compiled_submodules()] == ["head"]
    part.traced_steps, part.hidden_random = 3, "model.py:7"
    part.eager_hooks.add("on_after_backward")
    cb._reset_run_state()
    fresh = cb._warmup
    assert fresh is not part and fresh._fit is cb._fit and fresh._fit is not part._fit
    assert (fresh.traced_steps, fresh.hidden_random, fresh.eager_hooks, fresh.groups) == (0, None, set(), {})


class _WidenedRental(L2GraphCallback):
    """A subclass's devices for the re-capture wait reach the decision part (module-level: pickled)."""

    _RENTAL_DEVICES = ("cpu", "cuda")


def _never_eager(trainer, batch_idx):
    return False


def test_the_decision_is_a_part_that_declares_its_state_and_reads_the_fit_state():
    """StepDecision declares in its __init__ what it alone writes (none of it a class attribute every
    callback shares, none of it left on the callback), reads the fit through the callback's FitState, is
    given the callback's parts, settings, report and callables (bound methods: a Trainer that spawns its
    processes pickles the callback) but never the callback, reads what the callback rebinds during the
    fit through those callables, and is made afresh for each fit. The callback's summary() and public
    `fallback_steps` and `disabled_reason` read the part and the FitState."""
    import pickle

    from l2lightning.callback.step_decision import StepDecision

    cb = _WidenedRental(eager_steps=_never_eager, recapture_wait=False, verify="capture")
    part = cb._decision
    assert part._fit is cb._fit and part._fit_report is cb._fit_report and part._slots is cb._slots
    assert part._warmup is cb._warmup and part._prefetch is cb._prefetch
    assert part._replay_check is cb.replay_check and part._warned is cb._warned
    assert part._eager_steps is _never_eager and part._recapture_wait is False and part._check_on is False
    assert part._rental_devices == ("cpu", "cuda")
    given = ("_disable", "_warn_once", "_device_type", "_manual", "_installed", "_last_capture_cost")
    owned = {
        "_module_values", "check_why", "operand_changes", "waited_steps", "fallback_steps", "fallback_causes",
        "flags", "_disable_next",
    }  # fmt: skip
    assert owned <= set(vars(part)) and not owned & set(vars(StepDecision))
    old_names = (
        "_module_values", "_pending_tensors", "_check_why", "_operand_changes", "_waited_steps",
        "_fallback_causes", "_flags", "_disable_next", "_step_closure", "_fit_started_at", "_code_bindings",
        "_batch_reads", "_reset_decision_state", "_decide", "_recapture", "_capture_not_paid_for",
        "_too_late_to_capture", "_warn_too_late_to_capture", "_too_large_to_compare", "_module_flags",
        "_count_fallback", "_fall_back",
    )  # fmt: skip
    assert_held_part(cb, part, StepDecision, given=(*given, "_operand_lines"), old_names=old_names)
    # the fit's and the step's, which other parts read too, are the FitState's; the count is the part's
    assert {"disabled_reason", "fallback_steps"}.isdisjoint(vars(cb))
    assert (cb._fit.code_bindings, cb._fit.pending_tensors, cb._fit.started_at) == ([], [], None)
    # what the callback rebinds during the fit, read through the callables when the part needs it
    cb._capture.operand_lines, cb._costs.last_capture_s, cb._installed = ["model.py:7"], 0.25, {"log": print}
    assert part._operand_lines() == ["model.py:7"] and part._last_capture_cost() == 0.25
    assert part._installed() == {"log": print} and not part._manual()
    cb._manual = object()
    assert part._manual()
    cb._manual = None
    copied = pickle.loads(pickle.dumps(cb))  # the part and its callables travel with the callback
    assert copied._decision._disable.__self__ is copied and copied._decision._fit is copied._fit

    # what the summary reports of the decision is the part's
    part.fallback_steps, part.waited_steps, part.operand_changes = 4, 2, 3
    part.fallback_causes.add("a cause")
    summary = cb.summary()
    assert (summary["fallback_steps"], summary["recapture_wait_steps"], summary["fallback_causes"]) == (
        4,
        2,
        ["a cause"],
    )
    assert summary["operand_scalars"] == {"sites": ["model.py:7"], "changes": 3} and cb.fallback_steps == 4

    # a refusal due at the next step (a CUDA generator's state set between steps): the decision refuses
    # the fit there, through the callback, whose reason the FitState holds
    part.disable_at_next_step("a reason")
    cb._fit.pending, cb._fit.optimizer = (torch.zeros(1), 0), SimpleNamespace(handler=None)
    with pytest.warns(UserWarning, match="L2GraphCallback: a reason; training eagerly"):
        assert part.decide(None) == "eager"
    assert cb.disabled_reason == cb._fit.disabled_reason == "a reason" == cb.summary()["reason"]
    assert cb._fit.optimizer is None and part.decide(None) == "eager"

    # the module flags it reads before each replay: made at the first read, released with the fit
    cb._fit.module = TinyMLP(width=8, depth=2)
    flags = part.module_flags()
    assert part.flags is not None and flags == part.flags.read() and part.flags._handles
    watched = part.flags
    part.check_why, part._module_values = "why", [({}, "W", 1)]
    cb._reset_run_state()
    fresh = cb._decision
    assert not watched._handles  # its global registration hooks removed as the new fit starts
    assert fresh is not part and fresh._fit is cb._fit and fresh._fit is not part._fit
    assert fresh._warmup is cb._warmup and fresh._prefetch is cb._prefetch and fresh._slots is cb._slots
    assert fresh._replay_check is cb.replay_check and fresh._warned is cb._warned
    assert (fresh._module_values, fresh.check_why, fresh.flags, fresh._disable_next) == ([], "", None, None)
    assert (fresh.fallback_steps, fresh.fallback_causes, fresh.waited_steps, fresh.operand_changes) == (
        0,
        set(),
        0,
        0,
    )
    assert L2GraphCallback()._decision._module_values is not fresh._module_values  # one list per part
    summary = cb.summary()
    assert summary["recapture_wait_steps"] == 0 and summary["fallback_causes"] == []
    assert summary["fallback_steps"] == cb.fallback_steps == 0 and summary["reason"] is None
    assert cb.disabled_reason is None
    cb._fit.module = TinyMLP(width=8, depth=2)
    fresh.module_flags()
    cb._cleanup(None)  # the fit's end releases them too
    assert fresh.flags is None


def test_the_prefetch_set_up_is_a_part_that_reads_the_fit_state_and_sets_the_callbacks_results():
    """PrefetchSetup declares the prefetch hooks, compile=True's children and the whole-step gate's trial in
    its __init__, reads the fit through the callback's FitState, is given the callback's settings, lists and
    callables but never the callback, sets the callback's plans and replayed graph through those callables,
    and is made afresh for each fit."""
    cb = L2GraphCallback(prefetch="auto", gate_pairs=4, compile=True, backward_prefetch=False)
    part = cb._prefetch
    assert part._fit is cb._fit and part._fit_report is cb._fit_report and part._slots is cb._slots
    assert part._cost_s is cb._costs.seconds and part._compiled_children is cb._compiled_children
    assert part._compiled_children is cb._warmup._compiled_children  # the one list both parts hold
    assert part._setting == "auto" and part._gate_pairs == 4  # the callback's settings, as the fit starts
    assert part._compile and not part._backward_prefetch
    old_names = (
        "_hooks", "_prefetch_failed", "_tuning_report", "_static_for_prefetch", "_gate", "_gate_turn",
        "_gate_capturing", "_gate_result", "_children_forward", "_compile_pending", "_prefetch_scope",
        "_install_prefetch", "_prefetch_hooks", "_prepare_compiled", "_gate_may_start", "_start_gate",
        "_finish_gate", "_abandon_gate", "_reject_prefetch", "_prefetch_switch", "_GATED_MODES",
    )  # fmt: skip
    assert_held_part(cb, part, PrefetchSetup, given=(), old_names=old_names)
    owned = {"hooks", "tuning_report", "failed", "static_batch", "_children_forward", "compile_pending"}
    assert owned | {"gate_turn", "gate_capturing", "gate_result"} <= set(vars(part))
    assert "gate" not in vars(part) and cb._slots.state.gate is None  # the trial is per graph: the role's

    class Hooks:  # what the part uses of PrefetchHooks
        enabled, via, removed = True, "hooks", False

        def remove(self):
            self.removed = True

    rows = [{"layer": "net.0", "mib": 1.0, "forward": "hint8", "backward": None}]
    part.hooks = hooks = Hooks()
    cb.plans = []
    assert not part.gate_may_start()  # no plan prefetches: no trial
    cb.plans = rows  # the callback's public plans (what its state_dict saves), read when asked
    assert part.gate_may_start()

    # the trial's verdict: the winner becomes the callback's replayed graph, its pool the one counted
    class Graph:
        pool_mib, bound = 3.0, False

        def bind_grads(self):
            self.bound = True

    kept = Graph()

    class Trial:  # what finish_gate uses of StepGate
        def decide(self):
            return StepGateResult("prefetch", None, 0.9, 1.0, "faster with prefetch", "switch")

        def winner_and_loser(self, result):
            return kept, Graph()

        def settle(self, variant):
            pass

    cb._slots.state.gate, part.gate_turn = Trial(), "off"
    part.finish_gate()
    assert (
        cb._slots.state.graph is kept
        and kept.bound
        and cb._capture.pool_mib == 3.0
        and cb._slots.state.gate is None
    )
    assert cb.summary()["prefetch_gate"]["reason"] == "faster with prefetch" and cb.plans == rows
    # a trial abandoned: prefetch off for the fit, the callback's plans emptied through the part
    part.gate_result = None
    part.abandon_gate("the step was captured again")
    assert hooks.removed and part.hooks is None and part.failed and cb.plans == []
    assert cb.summary()["prefetch_gate"]["kept"] == "off" and cb.summary()["plans"] == []

    # compile=True's children: compiled by the part into the callback's list, put back at the fit's end
    module = TinyMLP(width=8, depth=2)
    cb.prefetch = part._setting = "off"  # no tuning here: the children are only wrapped, not run
    part.failed = False
    static = SimpleNamespace(batch=None)
    part.prepare_compiled(module, static)
    children = list(module.children())
    assert cb._compiled_children == children and part.compile_pending and part.static_batch is static
    assert all("forward" in vars(child) for child in children)
    cb._cleanup(module)
    assert cb._compiled_children == [] and part._children_forward == [] and part.static_batch is None
    assert all("forward" not in vars(child) for child in children)
    assert cb.summary()["prefetch_gate"]["kept"] == "off"  # the fit's verdict outlives its clean-up

    cb.plans = rows
    cb._reset_run_state()
    fresh = cb._prefetch
    assert fresh is not part and fresh._fit is cb._fit and fresh._fit is not part._fit
    assert fresh._compiled_children is cb._compiled_children is cb._warmup._compiled_children
    assert fresh.hooks is None and cb._slots.state.gate is None and fresh.gate_result is None
    assert fresh._setting == "off"  # the callback's setting as this fit starts
    assert not fresh.failed and not fresh.compile_pending and fresh.static_batch is None
    assert cb.plans == rows and cb.summary()["prefetch_gate"] is None  # the plans are the callback's, kept


def test_the_overrides_are_a_part_whose_bound_methods_the_module_gets_for_the_fit(
    monkeypatch, one_torch_thread
):
    """StepOverrides declares in its __init__ what the module's replaced methods record and answer from,
    reads the fit through the callback's FitState, is given the callback's parts and callables (bound
    methods: a Trainer that spawns its processes pickles the callback) but never the callback, and is made
    afresh for each fit. The module's methods for the fit are its bound methods; the graph a replay's
    closure answers from is handed to it at each replay and dropped at the batch's end."""
    import inspect
    import pickle

    from l2lightning.callback.step_overrides import StepOverrides
    from tests import graph_emulator
    from tests.replay_helpers import callback
    from tests.replay_helpers import fit as recorded_fit

    cb = callback()
    part = cb._overrides
    assert part._fit is cb._fit and part._fit_report is cb._fit_report
    assert part._warmup is cb._warmup and part._prefetch is cb._prefetch
    old_names = (
        "_step_output", "_grads_before_step", "_checked_output", "_record_output", "_reissued",
        "_capture_logs", "_grad_norm_names", "_capture_graph", "_capture_accumulated", "_live_log_values",
        "_training_step", "_captured_hook", "_backward", "_optimizer_zero_grad",
        "_configure_gradient_clipping", "_log", "_reissue", "_reissue_call", "_held_gradients",
        "_stale_gradients_problem", "_pending_batch_idx", "_python_log_sources",
    )  # fmt: skip
    assert_held_part(cb, part, StepOverrides, given=("_disable", "_stepping", "_manual"), old_names=old_names)
    owned = {
        "replayed", "capture_graph", "capture_accumulated", "step_output", "capture_logs", "record_output",
        "checked_output", "reissued", "_grads_before_step", "_grad_norm_names",
    }  # fmt: skip
    assert owned <= set(vars(part)) and part._slots is cb._slots
    assert "live_log_values" not in vars(part)  # per graph: the role's (l2lightning.graph.graph_slots)
    copied = pickle.loads(pickle.dumps(cb))  # the part and its callables travel with the callback
    assert copied._overrides._disable.__self__ is copied and copied._overrides._fit is copied._fit
    graph_emulator.install(monkeypatch.setattr)  # from here the fit captures and replays on the CPU

    def bound_to(installed):
        """The object whose method an installed function runs (forwarding, presenting_signature_of, a hook)."""
        free = inspect.getclosurevars(installed).nonlocals
        if "replacement" in free:  # training_step (its __wrapped__ is the user's, for Lightning to inspect)
            return free["replacement"].__self__
        return free["method"].__self__ if "method" in free else free["self"]

    steps, after = [], []

    class Before(Callback):
        """Before the graph callback: at each batch end, the module's methods and what the part answers from."""

        def on_before_optimizer_step(self, trainer, pl_module, optimizer):
            pass  # a hook inside the step: the part wraps it for the fit

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            now = cb._overrides
            installed = [vars(pl_module)[name] for name in cb._installed] + [
                vars(self)["on_before_optimizer_step"]
            ]
            replayed = cb._fit.mode == "replay"
            steps.append(
                (replayed, now.replayed is cb._slots.state.graph and now.replayed is not None, now.reissued)
            )
            assert all(bound_to(fn) is now for fn in installed), [bound_to(fn) for fn in installed]

    class After(Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            after.append(cb._overrides.replayed)

    model, _, _ = recorded_fit(TinyMLP, [Before(), cb, After()], steps=8)
    fitted = cb._overrides
    assert fitted is not part and fitted._fit is cb._fit and cb.summary()["captured"]
    assert cb._installed == {} and "backward" not in vars(model)  # put back at the fit's end
    # every replay (the capture step's own at step 3; step 4 is the sampled check's eager step) answered
    # from the graph it replayed, re-issuing its hooks' logs; none outlives its batch
    replays = [replayed for replayed, _, _ in steps]
    assert replays[:5] == [False, False, False, True, False] and replays.count(True) >= 4, steps
    hooks = {"training_step", "on_before_optimizer_step"}
    assert all(graph and reissued == hooks for replayed, graph, reissued in steps if replayed), steps
    assert after == [None] * 8 and fitted.step_output is None and fitted.capture_logs == []
    assert not fitted.record_output and fitted.checked_output is None  # the check's eager output, compared

    cb._slots.state.live_log_values, fitted.record_output = {"train/lr"}, True
    cb._reset_run_state()
    fresh = cb._overrides
    assert fresh is not fitted and fresh._fit is cb._fit and fresh._fit is not fitted._fit
    assert fresh._warmup is cb._warmup and fresh._prefetch is cb._prefetch
    assert cb._slots.state.live_log_values == set() and not fresh.record_output and fresh.replayed is None
    assert fresh._slots is cb._slots


def test_the_dispatch_is_a_part_that_runs_each_step_and_declares_its_state(monkeypatch, one_torch_thread):
    """StepDispatch declares in its __init__ what it alone writes (whether one of its steps is under way,
    the replay closure), reads the fit through the callback's FitState (the stream its eager steps run on
    and whether captures bake operand numbers in are the fit's, as the capture reads them too), is given
    the callback's parts, cost record, replay check report and callables (bound methods: a Trainer that
    spawns its processes pickles the callback) but never the callback, and is made afresh for each fit.
    The optimizer's handler runs the part's step; summary() reads the cost record it fills."""
    import pickle

    from l2lightning.callback import step_dispatch
    from l2lightning.callback.step_dispatch import StepDispatch
    from tests import graph_emulator
    from tests.replay_helpers import callback
    from tests.replay_helpers import fit as recorded_fit

    cb = callback()
    part = cb._dispatch
    assert part._fit is cb._fit and part._fit_report is cb._fit_report and part._slots is cb._slots
    assert part._warmup is cb._warmup and part._prefetch is cb._prefetch
    assert (
        part._overrides is cb._overrides and part._decision is cb._decision and part._capture is cb._capture
    )
    assert part._costs is cb._costs and part._replay_check is cb.replay_check
    assert cb._prefetch._cost_s is cb._costs.seconds  # the one record's seconds, which tuning adds to
    given = ("_disable", "_warn_once", "_device", "_device_type")
    assert part._events is cb._events  # the class's static method (tests and benchmarks replace it)
    old_names = (
        "_in_step", "_step_stream", "_replay_closure", "_operands_off", "_cost_s", "_capture_once_s",
        "_last_capture_cost_s", "_recaptures", "_last_recapture_s", "_step", "_eager_modes",
        "_on_step_stream", "_give_back_step_stream", "_launch_replay", "_appends_redoable", "_replay_step",
        "_written_state", "_checked_step", "_check_skipped_for_memory", "_replayed_again", "_replay_differed",
    )  # fmt: skip
    assert_held_part(cb, part, StepDispatch, given=given, old_names=old_names)
    owned = {"in_step", "replay_closure"}
    assert owned <= set(vars(part)) and not owned & set(vars(StepDispatch))
    assert (part.in_step, part.replay_closure, cb._fit.step_stream, cb._fit.operands_off) == (
        False,
        None,
        None,
        False,
    )
    # whether a step is under way: the overrides ask the part, through the callback
    part.in_step = True
    assert cb._overrides._stepping()
    part.in_step = False
    assert not cb._overrides._stepping()
    copied = pickle.loads(pickle.dumps(cb))  # the part and its callables travel with the callback
    assert copied._dispatch._disable.__self__ is copied and copied._dispatch._fit is copied._fit
    assert copied._dispatch._decision is copied._decision and copied._dispatch._costs is copied._costs

    # what capturing cost: the record summary() reports and the re-capture wait asks through the callback
    costs = cb._costs
    costs.seconds["capture_s"], costs.recaptures, costs.last_recapture_s = 0.5, 2, 0.25
    costs.last_capture_s = 0.125
    summary = cb.summary()
    assert (summary["capture_s"], summary["recaptures"], summary["last_recapture_s"]) == (0.5, 2, 0.25)
    assert cb._last_capture_cost() == 0.125 == cb._decision._last_capture_cost()

    # the fit refused: the next batch's start gives the step stream back once, through the part
    freed = []
    for name in ("clear_cublas_workspaces", "free_cached_memory"):
        monkeypatch.setattr(step_dispatch, name, lambda name=name: freed.append(name))
    cb._fit.disabled_reason, cb._fit.module, cb._fit.step_stream = "a reason", TinyMLP(), "the stream"
    cb.on_train_batch_start(None, cb._fit.module, None, 0)
    cb.on_train_batch_start(None, cb._fit.module, None, 1)
    assert freed == ["clear_cublas_workspaces", "free_cached_memory"] and cb._fit.step_stream is None
    monkeypatch.undo()

    # a fit: the optimizer's handler runs the part's step (this fit's part), under which the step runs
    graph_emulator.install(monkeypatch.setattr)
    seen, step = [], StepDispatch.step

    def watched(self, run, closure, kwargs):
        def watched_run(closure, **kwargs):
            seen.append((self is cb._dispatch, self.in_step))
            return run(closure, **kwargs)

        return step(self, watched_run, closure, kwargs)

    monkeypatch.setattr(StepDispatch, "step", watched)
    recorded_fit(TinyMLP, [cb], steps=6)
    fitted = cb._dispatch
    assert fitted is not part and fitted._fit is cb._fit and cb.summary()["captured"], cb.summary()
    assert seen and all(ours and under_way for ours, under_way in seen) and not fitted.in_step, seen
    assert fitted.replay_closure is not None  # set up at the training start
    assert fitted._costs is cb._costs and cb._costs.last_capture_s is not None
    assert cb.summary()["capture_s"] == round(cb._costs.seconds["capture_s"], 6) > 0

    fitted.in_step, cb._fit.operands_off = True, True
    cb._reset_run_state()
    fresh = cb._dispatch
    assert fresh is not fitted and fresh._fit is cb._fit and fresh._fit is not fitted._fit
    assert fresh._decision is cb._decision and fresh._overrides is cb._overrides and fresh._slots is cb._slots
    assert fresh._capture is cb._capture and fresh._capture is not fitted._capture
    assert fresh._costs is cb._costs and fresh._costs is not fitted._costs
    assert (fresh.in_step, fresh.replay_closure, cb._fit.operands_off, cb._costs.last_capture_s) == (
        False,
        None,
        False,
        None,
    )
    assert cb.summary()["capture_s"] == 0.0 and cb.summary()["recaptures"] == 0


def test_the_capture_is_a_part_that_declares_what_it_records_and_sets_the_callbacks_capture_step(
    monkeypatch, one_torch_thread
):
    """StepCapture declares in its __init__ what it alone writes (the captures, those whose graph steps the
    optimizer, the roles with a graph, the pools alive, the operand sites, the verify report), reads the
    fit through the callback's FitState (the step the optimizer is capturable from is the fit's: the
    callback's training start and release set it too), is given the callback's parts, settings, cost record
    and callables (bound methods: a Trainer that spawns its processes pickles the callback) but never the
    callback, sets the callback's persisted `capture_step` through one of them, and is made afresh for each
    fit. The callback's public `captures`, `verify_report` and `capturable_from_step` are read-only views."""
    import pickle

    from l2lightning.callback.step_capture import StepCapture, _Graph
    from tests import graph_emulator
    from tests.replay_helpers import callback
    from tests.replay_helpers import fit as recorded_fit

    cb = callback(verify="capture", operand_scalars=False)  # (prefetch="off")
    assert type(cb).__mro__[1:] == (Callback, object)  # every part is held, none inherited
    part = cb._capture
    assert part._fit is cb._fit and part._fit_report is cb._fit_report and part._slots is cb._slots
    assert part._warmup is cb._warmup and part._prefetch is cb._prefetch
    assert part._overrides is cb._overrides and part._decision is cb._decision and part._costs is cb._costs
    assert cb._dispatch._capture is part  # the dispatch runs it
    # the callback's settings as the fit starts
    assert (part._verify, part._prefetch_setting, part._compile, part._report) == (
        "capture",
        "off",
        False,
        False,
    )
    assert not part._operand_scalars_on and part._check_on is False
    given = (
        "_disable", "_warn_once", "_device", "_device_type", "_source_refusal", "_installed", "_plans",
        "_set_capture_step",
    )  # fmt: skip
    old_names = (
        "_capture_step", "_capture_graph_step", "_capture_into", "_verify_eager", "_finish_verify",
        "_serve_operands", "_pools_alive_mib", "_undo_capture", "_capture_failure_reason",
        "_no_work_beside_the_steps", "_collect_before_capture", "_stepping_captures", "_captured_roles",
        "_pool_mib", "_operand_lines", "_verify_capture_off", "_collected_for_capture", "_captured",
    )  # fmt: skip
    assert_held_part(cb, part, StepCapture, given=given, old_names=old_names)
    owned = {
        "captures", "stepping_captures", "captured", "captured_roles", "pool_mib", "operand_lines",
        "verify_report", "_verify_capture_off", "_collected_for_capture",
    }  # fmt: skip
    assert owned <= set(vars(part)) and not owned & set(vars(StepCapture))
    # the public views: read-only where only the part (or the fit) sets them; capture_step is the callback's
    assert {"captures", "verify_report", "capturable_from_step"}.isdisjoint(vars(cb))
    for name in ("captures", "verify_report", "capturable_from_step"):
        with pytest.raises(AttributeError):
            setattr(cb, name, 1)
    part.captures, part.verify_report, cb._fit.capturable_from_step = 2, "a report", 5
    assert (cb.captures, cb.verify_report, cb.capturable_from_step) == (2, "a report", 5)
    assert cb.state_dict()["capturable_from_step"] == 5 and cb.summary()["captures"] == 2
    part.captured, part.pool_mib, part.operand_lines = True, 1.5, ["model.py:7"]
    part.captured_roles.add((False, True))
    summary = cb.summary()
    assert (summary["captured"], summary["graph_pool_mib"], summary["graphs"]) == (True, 1.5, 1)
    assert summary["verify"] == "a report" and summary["operand_scalars"]["sites"] == ["model.py:7"]
    assert cb._decision._operand_lines() == ["model.py:7"]  # the decision names them through the callback
    part._set_capture_step(9)
    assert cb.capture_step == 9 == cb.state_dict()["capture_step"]
    # the whole-step gate's winner (the prefetch part's verdict, through the callback): replayed, its pools counted
    kept = _Graph(graph=None, static=None, key=(), pool_mib=3.0)
    cb._prefetch._keep_graph(kept)
    assert cb._slots.state.graph is kept and part.pool_mib == 3.0
    copied = pickle.loads(pickle.dumps(cb))  # the part and its callables travel with the callback
    assert copied._capture._set_capture_step.__self__ is copied and copied._capture._fit is copied._fit
    assert copied._dispatch._capture is copied._capture and copied._capture._costs is copied._costs

    # a fit: the part captures (verify="capture": its eager check's report), the callback's capture_step set
    graph_emulator.install(monkeypatch.setattr)
    cb = callback(verify="capture")
    recorded_fit(TinyMLP, [cb], steps=6)
    fitted = cb._capture
    assert fitted._fit is cb._fit and cb.summary()["captured"], cb.summary()
    assert (cb.captures, fitted.stepping_captures, cb.capture_step) == (1, 1, cb.warmup_steps)
    assert cb.capturable_from_step == cb.warmup_steps == cb._fit.capturable_from_step
    assert cb.verify_report is fitted.verify_report and cb.verify_report.ok
    assert fitted.captured_roles == {(False, True)} and cb.summary()["graphs"] == 1

    cb._reset_run_state()
    fresh = cb._capture
    assert fresh is not fitted and fresh._fit is cb._fit and fresh._fit is not fitted._fit
    assert fresh._warmup is cb._warmup and fresh._decision is cb._decision and fresh._slots is cb._slots
    assert (fresh.captures, fresh.stepping_captures, fresh.captured, fresh.captured_roles) == (
        0,
        0,
        False,
        set(),
    )
    assert (fresh.pool_mib, fresh.operand_lines, fresh.verify_report) == (None, [], None)
    assert (cb.captures, cb.verify_report, cb.capturable_from_step) == (0, None, None)
    assert cb.capture_step == cb.warmup_steps  # the callback's, kept for a later fit (state_dict saves it)
