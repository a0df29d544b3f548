"""L2GraphCallback's capture, replay and fallback on the CPU, through the graph emulator: the plain
case, code beyond the step's source, faults that must leave nothing behind, what is checked before
each replay, and hooks and overrides.

Every test compares a fit with the callback against the eager fit it must equal: the
baseline when the step is captured (plain Lightning, switched to ``make_capturable``'s configuration
at the callback's capture step: ``tests/baselines.py``), plain Lightning when it is refused. The
sections that follow are in ``test_callback_replay_step_python_cpu.py``,
``test_callback_replay_state_cpu.py`` and ``test_callback_replay_python_state_cpu.py``.
"""

from __future__ import annotations

import functools
import inspect
import warnings
from collections import namedtuple
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from lightning.pytorch import Callback, LightningModule, seed_everything
from lightning.pytorch.callbacks import (
    BackboneFinetuning,
    EarlyStopping,
    GradientAccumulationScheduler,
    LearningRateMonitor,
    ModelCheckpoint,
    ModelPruning,
)
from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.utilities import grad_norm
from torch import nn
from torch.utils.data import DataLoader

from l2lightning.callback.step_capture import StepCapture
from l2lightning.guards import python_state
from tests import graph_emulator as emu
from tests.baselines import (
    baseline_of,
    capturable_from_of_the_last_callback_fit,  # noqa: F401 -- the fixture records each callback fit's switch step
)
from tests.between_step_models import (
    CONFIG_CHANGES,
    LAYER_CODE_CHANGES,
    LogsModuleLevelNumbers,
    MovesTheScaleEachEpoch,
    ScalesByAPlainTensor,
    SetsTheConfigEachEpoch,
    SetsTheLoggedNumbersEachEpoch,
)
from tests.callback.test_callback_replay_step_python_cpu import MetricsInStep
from tests.lightning_models import (
    Finetuned,
    StepWithoutBatchIdx,
    TinyMLP,
    quiet_trainer,
    regression_loader,
)
from tests.replay_helpers import (
    assert_captured_again_like_baseline,
    assert_refused_like_plain,
    assert_same,
    callback,
    captured_pair,
    fit,
)

# every test here runs on the CPU graph emulator (tests/conftest.py)
pytestmark = pytest.mark.usefixtures("emulated_cuda_graphs")


# --------------------------------------------------------------------------- the plain case
@pytest.mark.parametrize("scheduler", [None, "step", "cosine"])
def test_capture_replays_bitwise_equal_to_the_baseline(scheduler):
    base, run, cb = captured_pair(TinyMLP, scheduler=scheduler)
    s = cb.summary()
    assert s["captured"] and s["capture_step"] == 3 and s["fallback_steps"] == 0, s
    assert emu.FakeGraph.replays == 30 - 3
    assert_same(base, run)
    assert len({float(v["train/loss"]) for v in run[1].logged[4:]}) > 5  # logged values follow the replays


class ValidatedMLP(TinyMLP):
    def validation_step(self, batch, batch_idx):
        x, y = batch
        loss = (self.head(self.net(x)).squeeze(-1) - y).square().mean()
        self.log("val/loss", loss, on_epoch=True)


def _fit_with_lightnings_callbacks(cls, callbacks, root, scheduler):
    """Two epochs with ModelCheckpoint (every 7 steps, top 2 on a logged metric, last), a per-step
    LearningRateMonitor, EarlyStopping on a training metric, a CSVLogger every 3 steps and a validation
    every 10 batches."""
    seed_everything(0)
    checkpoints = ModelCheckpoint(
        dirpath=root / "ck", every_n_train_steps=7, save_last=True, monitor="train/loss", save_top_k=2
    )
    stop = EarlyStopping(monitor="train/loss", check_on_train_epoch_end=True, patience=1, min_delta=10.0)
    trainer = quiet_trainer(
        accelerator="cpu",
        max_epochs=4,
        callbacks=[checkpoints, LearningRateMonitor("step"), stop, *callbacks],
        logger=CSVLogger(root, name="log"),
        enable_checkpointing=True,
        val_check_interval=10,
        log_every_n_steps=3,
    )
    trainer.fit(cls(scheduler=scheduler), regression_loader(n=240), regression_loader(n=48, seed=1))
    return trainer, checkpoints


def _saved(path):
    """A checkpoint file's contents that a plain fit's must share: the callback's own state and the
    paths (another directory) left out, the optimizer's `capturable` as saved."""
    ckpt = torch.load(path, weights_only=False)
    ckpt["callbacks"] = {
        k: (
            {**v, "best_k_models": sorted(Path(p).name for p in v["best_k_models"])}
            if "best_k_models" in v
            else v
        )
        for k, v in ckpt["callbacks"].items()
        if k != "L2GraphCallback"
    }
    for v in ckpt["callbacks"].values():
        for key in ("dirpath", "best_model_path", "last_model_path", "kth_best_model_path"):
            if key in v:
                v[key] = Path(v[key]).name
    for group in ckpt["optimizer_states"][0]["param_groups"]:
        group.pop("capturable")
    return ckpt


@pytest.mark.parametrize("scheduler", [None, "step"])
def test_checkpoints_logs_and_early_stopping_are_those_of_the_baseline_fit(tmp_path, scheduler):
    cb = callback()
    run, run_ck = _fit_with_lightnings_callbacks(ValidatedMLP, [cb], tmp_path / "b", scheduler)
    plain, plain_ck = _fit_with_lightnings_callbacks(baseline_of(ValidatedMLP), [], tmp_path / "a", scheduler)
    assert cb.summary()["captured"] and emu.FakeGraph.replays > 40, cb.summary()
    assert run.global_step == plain.global_step and run.should_stop and plain.should_stop  # stopped early
    assert torch.equal(run_ck.best_model_score, plain_ck.best_model_score)
    files = sorted(p.name for p in (tmp_path / "a" / "ck").iterdir())
    assert files == sorted(p.name for p in (tmp_path / "b" / "ck").iterdir()) and len(files) == 3
    csv = [(tmp_path / d / "log" / "version_0" / "metrics.csv").read_text() for d in "ab"]
    assert csv[0] == csv[1] and "lr-AdamW" in csv[0] and ",val/loss" in csv[0]
    for name in files:
        a, b = _saved(tmp_path / "a" / "ck" / name), _saved(tmp_path / "b" / "ck" / name)
        assert a.keys() == b.keys()
        for key in a:
            if key == "state_dict":
                assert (
                    all(torch.equal(a[key][k], b[key][k]) for k in a[key]) and a[key].keys() == b[key].keys()
                )
            elif key == "optimizer_states":
                assert repr(a[key]) == repr(b[key])  # the same tensors print the same
            else:
                assert a[key] == b[key], key


def test_a_backbone_unfrozen_mid_fit_is_captured_again_and_trains_like_the_baseline():
    def unfreezing():
        return BackboneFinetuning(unfreeze_backbone_at_epoch=1, lambda_func=lambda epoch: 1.5)

    base = fit(baseline_of(Finetuned), [unfreezing()], steps=90)
    cb = callback()
    with pytest.warns(UserWarning, match="requires_grad"):
        run = fit(Finetuned, [unfreezing(), cb], steps=90)
    summary = cb.summary()
    assert summary["captured"] and summary["captures"] == 2 and emu.FakeGraph.replays > 80, summary
    assert (
        len(run[2].optimizers[0].param_groups) == 2
        and run[2].optimizers[0].param_groups[1]["capturable"] is False
    )
    assert_same(base, run)


def test_weights_pruned_at_each_epoch_end_are_captured_again_and_train_like_the_baseline():
    """Lightning's ModelPruning re-parametrizes every Linear at each epoch end (``weight`` becomes a
    plain attribute computed by a forward pre-hook from ``weight_orig`` and a mask)."""

    def pruning():
        return ModelPruning("l1_unstructured", amount=0.3)

    base = fit(baseline_of(TinyMLP), [pruning()], steps=90)
    cb = callback()
    with pytest.warns(UserWarning, match="capturing the step again: hooks were registered"):
        run = fit(TinyMLP, [pruning(), cb], steps=90)
    assert cb.summary()["captured"] and cb.summary()["captures"] == 3, cb.summary()
    assert_same(base, run)


def test_tensors_rebound_in_layers_are_named_by_their_path_in_the_module():
    module = TinyMLP()
    assert python_state.baked_tensors(module, set()) == []  # no plain tensor attributes yet
    layers = (module.net[0][1], module.net[1][1], module.head)
    for layer in layers:
        layer.scale = torch.ones(())
    checks = python_state.baked_tensors(module, set())
    for layer in layers:
        layer.scale = torch.ones(())  # rebound: the graph would read the old tensors
    assert python_state.rebound(checks, module) == ["net.0.1.scale", "net.1.1.scale", "head.scale"]
    assert python_state.rebound(checks) == ["scale", "scale", "scale"]


# --------------------------------------------------------------------------- code beyond the step's source
@pytest.fixture
def called_code():
    from tests import called_code_models

    called_code_models.reset()
    yield called_code_models
    called_code_models.reset()


@pytest.mark.parametrize("layer", ["ScaledHead", "EncodesInTheStep", "ScalesItsGradient"])
def test_a_custom_layer_reading_a_module_level_number_is_captured_again_when_it_changes(called_code, layer):
    """Silent before: the layer's forward (through a helper method), the method training_step calls
    on it (`self.encoder.encode(x)`) or a custom autograd Function's backward multiplies by SCALE,
    which an epoch hook raises; the graph kept the capture's SCALE and the fit left its baseline at
    the first epoch."""
    cls = getattr(called_code, layer)
    base = fit(baseline_of(cls), [called_code.Raise()], steps=90)
    called_code.reset()
    cb = callback()
    with pytest.warns(UserWarning, match=r"Python numbers the step reads changed \(SCALE\)"):
        run = fit(cls, [called_code.Raise(), cb], steps=90)
    assert cb.summary()["captured"] and cb.summary()["captures"] == 3, cb.summary()
    assert_same(base, run)


@pytest.mark.parametrize("held", ["function", "partial", "method", "object", "schedule-method"])
def test_a_loss_kept_in_an_attribute_reading_a_module_level_number_is_captured_again(called_code, held):
    """Silent before: `self.loss_fn = weighted_mse` (or a partial of it, the module's own method, a loss
    object) multiplies by GAMMA, which an epoch hook raises; the graph kept the capture's GAMMA."""
    base = fit(baseline_of(called_code.HeldLoss), [called_code.Raise()], steps=90, held=held)
    called_code.reset()
    cb = callback()
    with pytest.warns(UserWarning, match=r"Python numbers the step reads changed \(GAMMA\)"):
        run = fit(called_code.HeldLoss, [called_code.Raise(), cb], steps=90, held=held)
    assert cb.summary()["captured"] and cb.summary()["captures"] == 3, cb.summary()
    assert_same(base, run)


@pytest.mark.parametrize(
    "hook, name",
    [
        ("tensor", "CLIP"),
        ("tensor-lambda", "CLIP"),
        ("post-accumulate", "CLIP"),
        ("forward", "SCALE"),
        ("full-backward", "SCALE"),
        ("global-forward", "SCALE"),
        ("object", "limit"),
    ],
)
def test_hooks_reading_a_value_that_changes_are_captured_again_when_it_does(called_code, hook, name):
    """Silent before: a hook registered on a parameter, on a layer or as nn.Module's global hook ran
    at the capture only, so its reads were baked in and kept after the value changed."""
    cls, kwargs = (
        (called_code.GlobalForwardHook, {})
        if hook == "global-forward"
        else (called_code.Hooked, {"hook": hook})
    )
    changes = called_code.WidenClipper if hook == "object" else called_code.Raise
    base = fit(baseline_of(cls), [changes()], steps=90, **kwargs)
    called_code.reset()
    cb = callback()
    with pytest.warns(UserWarning, match=rf"Python numbers the step reads changed \({name}\)"):
        run = fit(cls, [changes(), cb], steps=90, **kwargs)
    assert cb.summary()["captured"] and cb.summary()["captures"] == 3, cb.summary()
    assert_same(base, run)


def test_a_hook_registered_after_the_callbacks_train_start_is_read_at_the_capture(called_code):
    base = fit(baseline_of(TinyMLP), [called_code.Raise(), called_code.ClipsFromTrainStart()], steps=90)
    called_code.reset()
    cb = callback()
    with pytest.warns(UserWarning, match=r"Python numbers the step reads changed \(CLIP\)"):
        run = fit(TinyMLP, [called_code.Raise(), cb, called_code.ClipsFromTrainStart()], steps=90)
    assert cb.summary()["captured"] and cb.summary()["captures"] == 3, cb.summary()
    assert_same(base, run)


@pytest.mark.parametrize("how", ["add-tensor-hook", "add-forward-hook", "remove-forward-hook"])
def test_hooks_added_or_removed_after_the_capture_capture_the_step_again(called_code, how):
    """Silent before: a replay runs the capture's hooks only, so a gradient clamp a callback adds at
    epoch 1, or a forward hook it removes, was ignored by every later replay."""
    cls = called_code.DoublesItsHead if how.startswith("remove") else TinyMLP
    base = fit(baseline_of(cls), [called_code.ChangesHooksAtEpoch1(how)], steps=90)
    cb = callback()
    with pytest.warns(UserWarning, match="hooks were registered on or removed from the module"):
        run = fit(cls, [called_code.ChangesHooksAtEpoch1(how), cb], steps=90)
    assert cb.summary()["captured"] and cb.summary()["captures"] == 2, cb.summary()
    assert_same(base, run)


@pytest.mark.parametrize(
    "head, changer, match, captures",
    [
        # `self.act = torch.tanh` in a custom layer, swapped to sigmoid at epoch 1
        (
            "ActivatedHead",
            "SwapsTheActivation",
            r"functions or submodules the step calls were replaced .*\(act\)",
            2,
        ),
        # `x * self.weights["out"]` in a custom layer, the entry raised in place each epoch
        (
            "WeightedHead",
            "RaisesTheLayersWeight",
            r"values the step reads changed \(.*self.weights\[\"out\"\]",
            3,
        ),
        # `if self.options["boost"]:` in a custom layer, switched on at epoch 1
        ("BoostedHead", "BoostsFromEpoch1", "the step's branch changed and stayed changed", 2),
    ],
    ids=["swapped-function", "dict-entry", "branch-on-dict-entry"],
)
def test_what_a_layer_holds_changed_by_a_callback_captures_the_step_again(
    called_code, head, changer, match, captures
):
    """Silent before: each kept the capture's function, number or branch in every later replay."""
    cls, change = getattr(called_code, head), getattr(called_code, changer)
    base = fit(baseline_of(cls), [change()], steps=90)
    cb = callback()
    with pytest.warns(UserWarning, match=match):
        run = fit(cls, [change(), cb], steps=90)
    assert cb.summary()["captured"] and cb.summary()["captures"] == captures, cb.summary()
    assert_same(base, run)


def test_a_hook_that_assigns_a_module_level_name_is_refused_by_name(called_code):
    plain = fit(called_code.Hooked, steps=20, hook="counts")
    assert called_code.CALLS == 20
    called_code.reset()
    cb = callback()
    with pytest.warns(
        UserWarning, match=r"assigns module-level or closure names \(`CALLS` at .*called_code_models"
    ):
        run = fit(called_code.Hooked, [cb], steps=20, hook="counts")
    assert not cb.summary()["captured"] and called_code.CALLS == 20
    assert_same(plain, run)


@pytest.mark.parametrize("where", ["training_step", "hook"])
def test_a_module_level_list_the_step_appends_to_gets_every_steps_element(called_code, where):
    """Lost before: replays appended nothing, so the list held the warm-up steps' elements only."""
    cls, kwargs = (
        (called_code.AppendsToAModuleList, {})
        if where == "training_step"
        else (called_code.Hooked, {"hook": "appends"})
    )
    cb = callback()
    run = fit(cls, [cb], steps=30, **kwargs)
    got = list(called_code.SEEN)
    called_code.reset()
    base = list(fit(baseline_of(cls), steps=30, **kwargs))
    expected = list(called_code.SEEN)
    assert cb.summary()["captured"] and cb.summary()["captures"] == 1, cb.summary()
    assert len(expected) == 30 and len(got) == 30
    assert all(torch.equal(a, b) for a, b in zip(expected, got))
    assert_same(base, run)


# Hooks Lightning calls inside the optimizer closure: a replay runs their tensor work in the graph,
# so they are counted with a tensor, which counts what the graph did (a Python list appended there
# would be refused as step state; tests/graph/test_replay_closure_cpu.py checks their Python calls)
IN_STEP_HOOKS = ("on_before_zero_grad", "on_before_backward", "on_after_backward", "on_before_optimizer_step")


def _counting(name, owner):
    """An in-step hook: counts its calls in a tensor (a replay adds in the graph)."""

    def count(self, *args, **kwargs):
        self.in_step[name].add_(1)
        return getattr(LightningModule, name)(self, *args, **kwargs) if owner == "module" else None

    return count


def _recording(name, owner):
    """A hook outside the step: appends (its name, the global step)."""

    def record(self, *args, **kwargs):
        if owner == "module":
            self.hook_calls.append((name, self.trainer.global_step))
            return getattr(LightningModule, name)(self, *args, **kwargs)
        self.calls.append((name, args[0].global_step))
        return None

    return record


class HookCalls(Callback):
    """Every Callback hook: the order and global step of those outside the step, counts of those in it."""

    def __init__(self):
        self.calls = []
        self.in_step = {name: torch.zeros(()) for name in IN_STEP_HOOKS}


class HookCallsMLP(TinyMLP):
    """Every LightningModule `on_*` hook, recorded as HookCalls records the callback's."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self.hook_calls = []
        self.in_step = {name: torch.zeros(()) for name in IN_STEP_HOOKS}


for _name in dir(Callback):
    if _name.startswith("on_") or _name in ("setup", "teardown"):
        make = _counting if _name in IN_STEP_HOOKS else _recording
        setattr(HookCalls, _name, make(_name, "callback"))
for _name in dir(LightningModule):
    if _name.startswith("on_") and callable(getattr(LightningModule, _name)) and _name not in vars(TinyMLP):
        make = _counting if _name in IN_STEP_HOOKS else _recording
        setattr(HookCallsMLP, _name, make(_name, "module"))


def test_every_hook_is_called_as_in_the_baseline_fit():
    """The same Callback and LightningModule hooks, in the same order at the same steps, as the eager fit."""
    runs = []
    cb = callback()
    for cls, callbacks in ((HookCallsMLP, [cb]), (baseline_of(HookCallsMLP), [])):  # the baseline after
        hooks = HookCalls()
        model, _, _ = fit(cls, [hooks, *callbacks], steps=12)
        in_step = {
            k: int(v)
            for k, v in {**hooks.in_step, **{f"module.{k}": v for k, v in model.in_step.items()}}.items()
        }
        runs.append((hooks.calls, model.hook_calls, in_step))
    assert cb.summary()["captured"] and emu.FakeGraph.replays >= 6, cb.summary()
    (calls_cb, module_calls_cb, in_step_cb), (calls, module_calls, in_step) = runs
    assert ("on_train_batch_end", 12) in calls and ("on_train_batch_start", 11) in module_calls
    assert calls_cb == calls and module_calls_cb == module_calls
    assert in_step == in_step_cb and set(in_step.values()) == {12}


# --------------------------------------------------------------------------- 1. faults leave nothing behind
class Boom(Callback):
    def __init__(self, at, exc):
        self.at, self.exc = at, exc

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step == self.at:
            raise self.exc("boom")


@pytest.mark.parametrize("exc", [RuntimeError, KeyboardInterrupt])
def test_an_exception_during_fit_leaves_nothing_installed(exc):
    seed_everything(0)
    model = TinyMLP(width=32, depth=3)
    trainer = quiet_trainer(accelerator="cpu", max_steps=30, callbacks=[callback(), Boom(8, exc)])
    with pytest.raises((RuntimeError, SystemExit)):
        trainer.fit(model, regression_loader(n=240, width=32))
    optimizer = trainer.optimizers[0]
    assert not {"training_step", "backward", "optimizer_zero_grad", "log"} & set(vars(model))
    assert "step" not in vars(optimizer)
    group = optimizer.param_groups[0]
    assert group["lr"] == 0.01 and group["capturable"] is False
    # a later plain fit of the same model trains like plain eager Lightning: no stale graph replays
    clean = TinyMLP(width=32, depth=3)
    clean.load_state_dict(model.state_dict())
    replays = emu.FakeGraph.replays
    for m in (model, clean):
        seed_everything(1)
        quiet_trainer(accelerator="cpu", max_steps=5).fit(m, regression_loader(n=240, width=32, seed=5))
    assert emu.FakeGraph.replays == replays
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), clean.parameters()))


class FailsInCapture(TinyMLP):
    """An op that only fails inside a capture (the emulator sets CAPTURING while it records)."""

    def training_step(self, batch, batch_idx):
        if emu.CAPTURING[0]:
            raise RuntimeError("operation not permitted when stream is capturing")
        return super().training_step(batch, batch_idx)


def test_a_failed_capture_is_undone_and_the_fit_goes_on_eagerly():
    plain = fit(FailsInCapture, fused=True)  # fused AdamW: capturable and configured steps agree bitwise
    cb = callback()
    with pytest.warns(
        UserWarning,
        match=r"could not be captured \(RuntimeError: operation not permitted.*test_callback_replay_cpu.py:\d+",
    ):
        run = fit(FailsInCapture, [cb], fused=True)
    assert not cb.summary()["captured"]
    assert_same(plain, run)
    group = run[2].optimizers[0].param_groups[0]
    assert isinstance(group["lr"], float) and group["capturable"] is False


class KeepsLastLoss(TinyMLP):
    """Keeps the loss with its autograd graph; inside a capture, PyTorch then warns about the stale
    AccumulateGrad node and the capture fails (stood in for here: the emulator has no streams)."""

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        if emu.CAPTURING[0] and self.last_loss is not None:
            warnings.warn(
                "The AccumulateGrad node's stream does not match the stream of the node ...", stacklevel=1
            )
            raise RuntimeError("CUDA error: operation failed due to a previous error during capture")
        self.last_loss = loss
        return loss

    last_loss = None


def test_a_capture_failing_on_a_kept_autograd_graph_names_the_cause():
    cb = callback()
    with pytest.warns(
        UserWarning, match=r"a tensor kept from an earlier step still holds .*`self.last_loss = loss`"
    ):
        fit(KeepsLastLoss, [cb], steps=6)
    assert not cb.summary()["captured"]


def test_metric_values_holding_the_last_steps_autograd_graph_are_detached_before_capture(monkeypatch):
    from l2lightning.guards.metric_binding import drop_autograd_graphs

    # torchmetrics computes a forward's batch value with gradients on: MeanMetric()(loss) holds the graph
    model = MetricsInStep(width=32, depth=3)
    x, y = torch.randn(8, 32), torch.randn(8)
    loss = (model.head(model.net(x)).squeeze(-1) - y).square().mean()
    model.train_loss(loss)
    cache = model.train_loss._forward_cache
    assert cache.grad_fn is not None
    assert drop_autograd_graphs(model) == ["train_loss._forward_cache"]
    assert model.train_loss._forward_cache.grad_fn is None and torch.equal(
        model.train_loss._forward_cache, cache
    )

    seen = []
    original = StepCapture._capture_into

    def capture_into(self, *a, **k):
        seen.append(
            [
                n
                for n, m in self._fit.module.named_modules()
                if getattr(m, "_forward_cache", None) is not None
                and getattr(m._forward_cache, "grad_fn", None) is not None
            ]
        )
        return original(self, *a, **k)

    monkeypatch.setattr(StepCapture, "_capture_into", capture_into)
    base, run, cb = captured_pair(MetricsInStep, steps=8)
    assert cb.summary()["captured"] and seen == [[]]
    assert_same(base, run)


# --------------------------------------------------------------------------- 2. checked before each replay
Pair = namedtuple("Pair", "x y")


@dataclass
class Example:
    x: torch.Tensor
    y: torch.Tensor
    tag: str = "train"


def structured_loader(kind, n=240):
    data = regression_loader(n=n, width=32).dataset

    def collate(items):
        x, y = torch.stack([a for a, _ in items]), torch.stack([b for _, b in items])
        return Pair(x, y) if kind == "namedtuple" else Example(x, y)

    return DataLoader(data, batch_size=8, collate_fn=collate)


class StructuredStep(TinyMLP):
    def training_step(self, batch, batch_idx):
        return super().training_step((batch.x, batch.y), batch_idx)


@pytest.mark.parametrize("kind", ["namedtuple", "dataclass"])
def test_namedtuple_and_dataclass_batches_are_copied_into_the_graph(kind):
    base, run, cb = captured_pair(StructuredStep, loader=structured_loader(kind))
    assert cb.summary()["captured"] and cb.fallback_steps == 0
    assert_same(base, run)


class SGDSchedule(TinyMLP):
    interval = "step"

    def configure_optimizers(self):
        opt = torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)
        sched = torch.optim.lr_scheduler.StepLR(opt, 1 if self.interval == "epoch" else 30, 0.5)
        if self.interval == "step":
            sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, 30)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": self.interval}}


class SGDEpochSchedule(SGDSchedule):
    interval = "epoch"


def test_sgd_with_a_per_step_schedule_is_captured_once_and_bitwise_its_baseline():
    """A per-step cosine on SGD changes the LR at every step: a tensor the fused step reads, so the
    warm-up is not refused and one graph serves every step."""
    base, run, cb = captured_pair(SGDSchedule)
    assert cb.summary()["captured"] and cb.captures == 1 and cb.fallback_steps == 0, cb.summary()
    assert_same(base, run)


def test_sgd_without_a_scheduler_keeps_its_configuration_and_is_bitwise_plain():
    """No scheduler: SGD keeps its own (foreach) path and a baked float LR, so the captured fit is
    plain Lightning's bit for bit."""

    class ConstantSGD(TinyMLP):
        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)

    plain = fit(ConstantSGD)
    cb = callback()
    run = fit(ConstantSGD, [cb])
    assert cb.summary()["captured"] and cb.captures == 1
    assert not run[2].optimizers[0].param_groups[0]["fused"]
    assert_same(plain, run)


class TensorLREpochSchedule(TinyMLP):
    """An epoch StepLR over Adadelta (the PyTorch MNIST example) or RMSprop. foreach=True is the
    path PyTorch takes for CUDA parameters (a CPU run would take the single-tensor one)."""

    kind = torch.optim.Adadelta

    def configure_optimizers(self):
        opt = self.kind(self.parameters(), lr=0.5, foreach=True)
        sched = torch.optim.lr_scheduler.StepLR(opt, 1, 0.7)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "epoch"}}


class RMSpropEpochSchedule(TensorLREpochSchedule):
    kind = torch.optim.RMSprop


@pytest.mark.parametrize("cls", [TensorLREpochSchedule, RMSpropEpochSchedule])
def test_adadelta_and_rmsprop_read_a_tensor_lr_so_an_epoch_schedule_needs_one_capture(cls):
    kwargs = {"steps": -1, "n": 64, "trainer_kwargs": {"max_epochs": 4}}
    base, run, cb = captured_pair(cls, **kwargs)
    assert cb.summary()["captured"] and cb.captures == 1 and cb.fallback_steps == 0, cb.summary()
    assert_same(base, run)
    opt = run[2].optimizers[0]
    assert opt.param_groups[0]["lr"] == pytest.approx(0.5 * 0.7**4) and isinstance(
        opt.param_groups[0]["lr"], float
    )


class BoringSGDEpochStepLR(TinyMLP):
    """Lightning's BoringModel optimizer: SGD(lr=0.1) with StepLR(step_size=1) per epoch; with momentum
    and weight decay as the SimCLR-style modules add them."""

    momentum = 0.0

    def configure_optimizers(self):
        opt = torch.optim.SGD(self.parameters(), lr=0.1, momentum=self.momentum, weight_decay=1e-4)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1)
        return [opt], [sched]


class CosineSGDMomentum(BoringSGDEpochStepLR):
    momentum = 0.9

    def configure_optimizers(self):
        opt = torch.optim.SGD(self.parameters(), lr=0.1, momentum=self.momentum, nesterov=True)
        return [opt], [torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=4)]


@pytest.mark.parametrize("cls", [SGDEpochSchedule, BoringSGDEpochStepLR, CosineSGDMomentum])
def test_sgd_under_an_epoch_schedule_reads_a_tensor_lr_so_it_needs_one_capture(cls):
    """SGD with a scheduler runs fused from the capture on, its LR a device tensor the scheduler's
    floats fill: four epochs, four LRs, one capture, bitwise the CapturableFrom baseline."""
    kwargs = {"steps": -1, "n": 64, "trainer_kwargs": {"max_epochs": 4}}
    base, run, cb = captured_pair(cls, **kwargs)
    summary = cb.summary()
    assert summary["captured"] and cb.captures == 1 and cb.fallback_steps == 0, summary
    assert summary["recapture_s"] == 0.0
    assert_same(base, run)
    group = run[2].optimizers[0].param_groups[0]
    assert isinstance(group["lr"], float) and group["lr"] < 0.1
    # the fit's end gives the user's configuration back
    assert not group["fused"] and group["foreach"] is None


class OneCycleSGD(TinyMLP):
    def configure_optimizers(self):
        opt = torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)
        sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.05, total_steps=40)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def test_onecycle_sgd_momentum_and_clipping_is_refused_by_name_and_equals_plain():
    plain = fit(OneCycleSGD, trainer_kwargs={"gradient_clip_val": 1.0})
    cb = callback()
    # the LR is a tensor (fused SGD under a scheduler); the momentum OneCycleLR cycles is baked:
    # known from the scheduler before the first step, so no step is traced
    with pytest.warns(UserWarning, match=r"SGD's \['momentum'\] change at every step: OneCycleLR with"):
        run = fit(OneCycleSGD, [cb], trainer_kwargs={"gradient_clip_val": 1.0})
    assert_same(plain, run)
    assert cb._warmup.traced_steps == 0 and cb.summary()["eager_step_ms"] is None, cb.summary()


class OneCycleAdamW(TinyMLP):
    cycle_momentum = True  # OneCycleLR's default: beta1 cycles with the learning rate

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=1e-2, foreach=True)
        sched = torch.optim.lr_scheduler.OneCycleLR(
            opt, max_lr=1e-2, total_steps=40, cycle_momentum=self.cycle_momentum
        )
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


class OneCycleAdamWConstantBetas(OneCycleAdamW):
    cycle_momentum = False


def test_onecycle_adamw_cycling_its_betas_is_refused_naming_the_option_that_keeps_one_graph():
    cb = callback()
    with pytest.warns(UserWarning, match=r"AdamW's \['betas'\] change at every step: OneCycleLR") as caught:
        fit(OneCycleAdamW, [cb])
    message = next(str(w.message) for w in caught if "betas" in str(w.message))
    assert "`cycle_momentum=False`" in message and "use Adam or AdamW" not in message.lower()
    assert not cb.summary()["captured"]
    # without the momentum cycle, only the learning rate moves: read from a tensor, one graph
    base, run, cb = captured_pair(OneCycleAdamWConstantBetas)
    assert cb.summary()["captured"] and cb.summary()["captures"] == 1, cb.summary()
    assert_same(base, run)


def test_a_gradient_accumulation_scheduler_gets_a_graph_per_role_and_matches():
    kw = dict(steps=-1, n=64, trainer_kwargs={"max_epochs": 3})
    base = fit(baseline_of(TinyMLP), [GradientAccumulationScheduler({0: 1, 1: 2})], **kw)
    cb = callback()
    run = fit(TinyMLP, [cb, GradientAccumulationScheduler({0: 1, 1: 2})], **kw)
    assert run[2].global_step == base[2].global_step
    # the plain step's graph (factor 1), then the window's first and the closing micro-batch's (factor 2)
    assert cb.summary()["graphs"] == 3, cb.summary()
    assert_same(base, run)


class Unfreeze(TinyMLP):
    def on_fit_start(self):
        self.net.requires_grad_(False)

    def on_train_epoch_start(self):
        if self.current_epoch == 1:
            self.net.requires_grad_(True)


class FreezeBatchNorm(TinyMLP):
    def __init__(self, **kw):
        super().__init__(**kw)
        self.net = nn.Sequential(
            nn.Linear(32, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Dropout(0.3), nn.Linear(32, 32)
        )

    def on_train_epoch_start(self):
        if self.current_epoch == 1:
            self.net[1].eval()  # fine-tuning: freeze BatchNorm statistics


@pytest.mark.parametrize("cls", [Unfreeze, FreezeBatchNorm])
def test_requires_grad_and_train_mode_changes_after_capture_are_honoured(cls):
    base, run, cb = captured_pair(cls, steps=-1, n=64, trainer_kwargs={"max_epochs": 3})
    assert cb.captures >= 2
    assert_same(base, run)


# --------------------------------------------------------------------------- 3. hooks and overrides
class DocsWarmup(TinyMLP):
    """Lightning docs: LR warm-up by hand in an `optimizer_step` override."""

    def optimizer_step(self, epoch, batch_idx, optimizer, optimizer_closure):
        optimizer.step(closure=optimizer_closure)
        if self.trainer.global_step < 20:
            scale = min(1.0, float(self.trainer.global_step + 1) / 20.0)
            for pg in optimizer.param_groups:
                pg["lr"] = scale * self.lr


def test_optimizer_step_override_runs_around_every_replay():
    base, run, cb = captured_pair(DocsWarmup)
    assert cb.summary()["captured"] and emu.FakeGraph.replays == 27
    assert_same(base, run)
    assert run[2].optimizers[0].param_groups[0]["lr"] == 0.01  # an exact float after the fit


class ClosureOutsideStep(TinyMLP):
    def optimizer_step(self, epoch, batch_idx, optimizer, optimizer_closure):
        optimizer_closure()
        optimizer.step()


def test_closure_called_outside_optimizer_step_is_refused_by_name():
    cb = callback()
    with pytest.warns(UserWarning, match="calls the optimizer closure itself"):
        fit(ClosureOutsideStep, [cb], steps=6)
    assert not cb.summary()["captured"]


def test_a_training_step_without_batch_idx_is_captured_and_equals_the_baseline():
    """Failed before with a TypeError: the callback's replacement took `*args`, so Lightning passed
    `batch_idx` to it, and it to the user's step."""
    base, run, cb = captured_pair(StepWithoutBatchIdx)
    assert cb.summary()["captured"] and emu.FakeGraph.replays == 27, cb.summary()
    assert_same(base, run)


class FetchesItsOwnBatches(TinyMLP):
    """`training_step(self, dataloader_iter)`: Lightning's experimental flavour, the step draws batches."""

    def training_step(self, dataloader_iter):
        batch, _, _ = next(dataloader_iter)
        x, y = batch
        loss = (self.head(self.net(x)).squeeze(-1) - y).square().mean()
        self.log("train/loss", loss, batch_size=len(y))
        return loss


def test_a_training_step_taking_dataloader_iter_is_refused_at_setup_and_trains_like_plain():
    """Before, the replacement's `*args` hid `dataloader_iter` from Lightning, which then passed
    batches to a step that draws from an iterator (a TypeError)."""
    cb = assert_refused_like_plain(
        FetchesItsOwnBatches, r"takes `dataloader_iter` and fetches its own batches"
    )
    assert cb.summary()["capture_step"] is None


def test_the_installed_training_step_is_inspected_by_lightning_as_the_users_own():
    from lightning.pytorch.utilities.signature_utils import is_param_in_hook_signature

    from l2lightning.callback.step_overrides import presenting_signature_of

    def passthrough(fn):
        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            return fn(*args, **kwargs)

        return wrapper

    class Steps:
        def without_idx(self, batch):
            return batch

        def with_idx(self, batch, batch_idx):
            return batch, batch_idx

        def fetching(self, dataloader_iter):
            return dataloader_iter

        @passthrough
        def decorated_without_idx(self, batch):
            return batch

        def any_args(self, *args):
            return args

        def keyword_idx(self, batch, *, batch_idx=0):
            return batch, batch_idx

    steps, calls = Steps(), []
    names = ("without_idx", "with_idx", "fetching", "decorated_without_idx", "any_args", "keyword_idx")
    for name in names:
        original = getattr(steps, name)
        presented = presenting_signature_of(original, lambda *a, **k: calls.append((a, k)) or "out")
        for param, kwargs in (("batch_idx", {"min_args": 2}), ("dataloader_iter", {"explicit": True})):
            expected = is_param_in_hook_signature(original, param, **kwargs)
            assert is_param_in_hook_signature(presented, param, **kwargs) == expected, (name, param)
        assert presented(1, batch_idx=2) == "out" and calls[-1] == ((1,), {"batch_idx": 2})
        assert presented.__name__ == name
        # what other code reads: the signature Python shows (for an undecorated step; a decorated one
        # shows what Lightning unwraps it to, its function), and the full argument spec
        unwrapped = getattr(original, "__wrapped__", original)
        assert inspect.signature(presented) == inspect.signature(unwrapped), name
        assert inspect.getfullargspec(presented.__wrapped__) == inspect.getfullargspec(unwrapped), name
    # what the checks above decide for these steps, so that they cannot pass by always agreeing
    assert is_param_in_hook_signature(steps.with_idx, "batch_idx", min_args=2)
    assert not is_param_in_hook_signature(steps.without_idx, "batch_idx", min_args=2)
    assert is_param_in_hook_signature(steps.fetching, "dataloader_iter", explicit=True)


def test_methods_the_instances_held_themselves_are_theirs_again_after_the_fit(monkeypatch):
    """The callback replaces the module's `training_step`, the closure hooks of other callbacks and,
    with compile=True, the children's `forward` for the fit; where the instance held its own (a
    method assigned to the instance, a library's per-instance wrapper) the clean-up deleted ours and
    left the class's, so a later fit or `trainer.validate` ran other code, silently."""
    import types

    monkeypatch.setattr(torch, "compile", functools.partial(torch.compile, backend="eager"))
    seed_everything(0)
    model = TinyMLP(width=32, depth=3)
    scaled = types.MethodType(
        lambda self, batch, batch_idx: TinyMLP.training_step(self, batch, batch_idx) * 2, model
    )
    model.training_step = scaled
    head_forward = model.head.forward  # a per-instance wrapper, as accelerate's hooks install one
    model.head.forward = lambda x: head_forward(x)
    instance_forward = model.head.forward

    class Counts(Callback):
        pass

    counts = Counts()
    calls = []
    counts.on_before_backward = lambda trainer, pl_module, loss: calls.append(1)
    instance_hook = counts.on_before_backward
    torch._dynamo.reset()
    cb = callback(compile=True)
    fit(TinyMLP, [counts, cb], steps=8, model=model)
    torch._dynamo.reset()
    assert cb.summary()["captured"], cb.summary()
    assert vars(model)["training_step"] is scaled
    assert vars(model.head)["forward"] is instance_forward
    assert vars(counts)["on_before_backward"] is instance_hook and calls


@pytest.mark.parametrize(("cls", "change"), LAYER_CODE_CHANGES.values(), ids=LAYER_CODE_CHANGES.keys())
def test_a_layers_code_changed_mid_fit_is_captured_again_and_equals_the_baseline(cls, change):
    """Silent before: the replays after the change ran the captured code (the loss left the
    baseline's at step 30)."""
    assert_captured_again_like_baseline(
        cls,
        r"the code of layers changed since capture \(their class, their class's `forward` or a `forward` "
        r"assigned to the instance: head",
        captures=2,
        callbacks=[change()],
    )


@pytest.mark.parametrize(("cls", "change"), CONFIG_CHANGES.values(), ids=CONFIG_CHANGES.keys())
def test_a_config_value_changed_mid_fit_is_captured_again_and_equals_the_baseline(cls, change):
    """Silent before: the replays kept the capture's weight (the loss left the baseline's at step 30).
    Baked in (no device scalars for a weight read only as a tensor operand): each change is seen."""
    assert_captured_again_like_baseline(
        cls,
        r"values the step reads changed \(.*between_step_models\.py|the arguments `functools.partial` binds "
        r"changed since capture \(loss_fn\)",
        captures=3,
        callbacks=[SetsTheConfigEachEpoch(change)],
        callback_kwargs={"operand_scalars": False},
    )


def test_logged_module_level_numbers_are_evaluated_per_replay_and_equal_the_baseline():
    base = fit(baseline_of(LogsModuleLevelNumbers), [SetsTheLoggedNumbersEachEpoch()], steps=90)
    cb = callback()
    run = fit(LogsModuleLevelNumbers, [SetsTheLoggedNumbersEachEpoch(), cb], steps=90)
    assert cb.summary()["captured"] and cb.summary()["captures"] == 1, cb.summary()
    assert_same(base, run)
    assert [float(run[1].logged[i]["config_weight"]) for i in (29, 30, 60)] == [1.0, 2.0, 3.0]


def test_a_plain_tensor_attribute_moved_to_other_memory_is_captured_again():
    """Silent before: the replays read the scale's old memory (the loss left the baseline's at step 30,
    on the emulator since it replays through aliases of the capture's memory)."""
    assert_captured_again_like_baseline(
        ScalesByAPlainTensor,
        r"the module's tensors scale hold other memory than at capture",
        captures=3,
        callbacks=[MovesTheScaleEachEpoch()],
    )


class EMAHook(TinyMLP):
    def __init__(self, **kw):
        super().__init__(**kw)
        self.register_buffer("ema", torch.zeros(()))
        self.register_buffer("ema_updates", torch.zeros(()))

    def on_before_zero_grad(self, optimizer):
        with torch.no_grad():
            self.ema.mul_(0.9).add_(self.head.weight.sum(), alpha=0.1)
            self.ema_updates.add_(1)


def test_on_before_zero_grad_runs_once_per_step():
    base, run, cb = captured_pair(EMAHook)
    assert cb.summary()["captured"]
    assert float(run[0].ema_updates) == 30
    assert_same(base, run)


class GradNormLogging(TinyMLP):
    def on_before_optimizer_step(self, optimizer):
        self.log_dict(grad_norm(self, norm_type=2))


class GradNormCallback(Callback):
    def on_after_backward(self, trainer, pl_module):
        pl_module.log("head_grad_abs", pl_module.head.weight.grad.abs().sum())


def test_gradient_hooks_are_captured_and_their_logs_follow_each_replay():
    base, run, cb = captured_pair(GradNormLogging, callbacks=[GradNormCallback()])
    assert cb.summary()["captured"] and cb.fallback_steps == 0
    assert "grad_2.0_norm_total" in run[1].logged[-1] and "head_grad_abs" in run[1].logged[-1]
    assert len({float(s["grad_2.0_norm_total"]) for s in run[1].logged[5:]}) > 5
    assert len({float(s["head_grad_abs"]) for s in run[1].logged[5:]}) > 5
    assert_same(base, run)


def test_a_grad_norm_hook_with_gradient_clipping_is_refused_by_name():
    plain = fit(GradNormLogging, fused=True, trainer_kwargs={"gradient_clip_val": 0.5})
    cb = callback()
    with pytest.warns(
        UserWarning, match=r"`on_before_optimizer_step` builds tensors from host values.*clipping"
    ):
        run = fit(GradNormLogging, [cb], fused=True, trainer_kwargs={"gradient_clip_val": 0.5})
    assert not cb.summary()["captured"]
    assert_same(plain, run)
