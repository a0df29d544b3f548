"""L2GraphCallback's capture, replay and fallback on the CPU, through the graph emulator.

Every test compares a fit with the callback against the eager fit it must equal: the
baseline when the step is captured (plain Lightning, switched to ``make_capturable``'s configuration
at the callback's capture step: ``tests/baselines.py``), plain Lightning when it is refused.
"""

from __future__ import annotations

import collections
import copy
import functools
import inspect
import re
import warnings
import weakref
from collections import namedtuple
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F
import torchmetrics
from lightning.pytorch import Callback, LightningDataModule, LightningModule, seed_everything
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

from l2lightning import L2GraphCallback, python_state
from l2lightning.fit_report import TIMING_WINDOW
from tests import graph_emulator as emu
from tests import user_step_config
from tests.baselines import (  # noqa: F401 -- the fixture records each callback fit's switch step
    DeferredFit,
    baseline_of,
    capturable_from_of_the_last_callback_fit,
    is_baseline,
)
from tests.between_step_models import (
    CONFIG_CHANGES,
    LAYER_CODE_CHANGES,
    AnomalyDetectionFromEpochOne,
    AsksAHelperForTheTime,
    HalvesItsLossAfterAWhile,
    LogsAClosure,
    LogsAnUnrecomputableNumber,
    LogsModuleLevelNumbers,
    MovesTheScaleEachEpoch,
    NoisyDataset,
    ReadsACallback,
    ReadsTheDataset,
    ReadsWhatItAppended,
    ScalesByAPlainTensor,
    SeedsInTheStep,
    SetsTheConfigEachEpoch,
    SetsTheLoggedNumbersEachEpoch,
    SwitchesItsLoss,
    TensorInAContainer,
    TF32FromEpochOne,
    ValidatedDistribution,
    WeightOnACallback,
    WritesOutEveryStep,
)
from tests.idiom_harness import loop_state
from tests.idiom_modules import IDIOMS
from tests.lightning_models import (
    AdagradMLP,
    CheckpointedDropout,
    CheckpointedDropoutUnpreserved,
    DecayingAdagradMLP,
    DropoutOutsideCheckpoint,
    Finetuned,
    IgnoresTheNames,
    NamedSamples,
    ReadsTheNames,
    StepWithoutBatchIdx,
    TinyMLP,
    quiet_trainer,
    regression_loader,
)
from tests.logging_models import LoggedEverywhere, ManyLogs, assert_logged_alike

# every test here runs on the CPU graph emulator (tests/conftest.py)
pytestmark = pytest.mark.usefixtures("emulated_cuda_graphs")


class Recorder(Callback):
    """Per step: the loss Lightning saw, every logged value, and the step's outputs."""

    def __init__(self):
        self.losses, self.logged, self.outputs = [], [], []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
        self.losses.append(loss.detach().clone() if isinstance(loss, torch.Tensor) else None)
        self.logged.append(
            {
                k: (v.detach().clone() if isinstance(v, torch.Tensor) else v)
                for k, v in trainer.callback_metrics.items()
            }
        )
        self.outputs.append(outputs)


def fit(
    model_cls, callbacks=(), steps=30, n=240, loader=None, model=None, trainer_kwargs=None, **model_kwargs
):
    if is_baseline(model if model is not None else model_cls):
        # the baseline switches where the callback fit of the test switched: run after it
        return DeferredFit(
            lambda: _fit(model_cls, callbacks, steps, n, loader, model, trainer_kwargs, **model_kwargs)
        )
    return _fit(model_cls, callbacks, steps, n, loader, model, trainer_kwargs, **model_kwargs)


def _fit(model_cls, callbacks, steps, n, loader, model, trainer_kwargs, **model_kwargs):
    seed_everything(0)
    model = model_cls(width=32, depth=3, **model_kwargs) if model is None else model
    rec = Recorder()
    trainer = quiet_trainer(
        accelerator="cpu", max_steps=steps, callbacks=[rec, *callbacks], **(trainer_kwargs or {})
    )
    trainer.fit(model, loader if loader is not None else regression_loader(n=n, width=32))
    return model, rec, trainer


def callback(**kwargs):
    return L2GraphCallback(prefetch="off", log_timing=False, **kwargs)


def assert_refused_like_plain(cls, match, steps=20, **model_kwargs):
    """The callback refuses `cls`'s step with a warning matching `match`, and the fit trains bit for
    bit like plain Lightning (pass ``fused=True``: the warm-up steps' capturable AdamW updates equal
    the plain ones only when fused)."""
    plain = fit(cls, steps=steps, **model_kwargs)
    cb = callback()
    with pytest.warns(UserWarning, match=match):
        run = fit(cls, [cb], steps=steps, **model_kwargs)
    assert not cb.summary()["captured"], cb.summary()
    assert_same(plain, run)
    return cb


def assert_captured_again_like_baseline(
    cls, match, captures=3, steps=90, callbacks=(), callback_kwargs=None, **model_kwargs
):
    """`cls`'s step is captured again when what it reads changes (a warning matching `match`, once per
    epoch with 30 batches an epoch: `captures` in all), and the fit is bit for bit its baseline; each
    fit gets `callbacks` before the graph callback, made with `callback_kwargs`."""
    base = fit(baseline_of(cls), list(callbacks), steps=steps, **model_kwargs)
    cb = callback(**(callback_kwargs or {}))
    with pytest.warns(UserWarning, match=match):
        run = fit(cls, [*callbacks, cb], steps=steps, **model_kwargs)
    assert cb.summary()["captured"] and cb.summary()["captures"] == captures, cb.summary()
    assert_same(base, run)


def assert_same(a, b):
    """Same losses, same logged values, same parameters: bit for bit; the same loop progress (what a
    checkpoint saves under `loops`)."""
    (ma, ra, ta), (mb, rb, tb) = a, b
    assert loop_state(ta) == loop_state(tb)
    assert len(ra.losses) == len(rb.losses)
    for i, (x, y) in enumerate(zip(ra.losses, rb.losses)):
        assert (x is None and y is None) or torch.equal(x, y), f"loss differs at step {i}"
    for i, (x, y) in enumerate(zip(ra.logged, rb.logged)):
        assert x.keys() == y.keys(), f"logged keys differ at step {i}: {sorted(x)} vs {sorted(y)}"
        for k in x:
            same = torch.equal(x[k], y[k]) if isinstance(x[k], torch.Tensor) else x[k] == y[k]
            assert same, f"logged {k!r} differs at step {i}: {x[k]} vs {y[k]}"
    for (name, p), q in zip(ma.named_parameters(), mb.parameters()):
        assert torch.equal(p, q), f"parameter {name} differs"


def captured_pair(cls, callback_kwargs=None, **kwargs):
    base = fit(baseline_of(cls), **kwargs)
    cb = callback(**(callback_kwargs or {}))
    run = fit(cls, [cb, *kwargs.pop("callbacks", ())], **kwargs)
    return base, run, cb


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
# would be refused as step state; tests/test_replay_closure_cpu.py checks their Python calls)
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
    from l2lightning.metric_binding import drop_autograd_graphs

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
    original = L2GraphCallback._capture_into

    def capture_into(self, *a, **k):
        seen.append(
            [
                n
                for n, m in self._module.named_modules()
                if getattr(m, "_forward_cache", None) is not None
                and getattr(m._forward_cache, "grad_fn", None) is not None
            ]
        )
        return original(self, *a, **k)

    monkeypatch.setattr(L2GraphCallback, "_capture_into", capture_into)
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
    assert cb._traced_steps == 0 and cb.summary()["eager_step_ms"] is None, cb.summary()


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

    from l2lightning.step_overrides import presenting_signature_of

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


# --------------------------------------------------------------------------- 4. step-variant Python
class TargetSync(TinyMLP):
    """CleanRL-style DQN: a target network copied every 10 steps inside training_step."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self.target = copy.deepcopy(self.head).requires_grad_(False)

    def training_step(self, batch, batch_idx):
        x, y = batch
        if self.global_step % 10 == 0:
            self.target.load_state_dict(self.head.state_dict())
        h = self.net(x)
        loss = (self.head(h).squeeze(-1) - self.target(h).squeeze(-1) - y).square().mean()
        self.log("train/loss", loss)
        return loss


def test_steps_on_another_branch_of_the_step_counter_run_eagerly():
    base, run, cb = captured_pair(TargetSync)
    s = cb.summary()
    assert s["captured"] and s["fallback_steps"] == 2  # steps 10 and 20 copy the target network eagerly
    assert_same(base, run)


class PeriodicPrint(TinyMLP):
    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        if batch_idx % 7 == 0:
            print(f"step {batch_idx} loss {loss.item():.4f}")
        return loss


def test_a_periodic_print_of_item_runs_on_its_steps_and_the_rest_replays(capsys):
    base, run, cb = captured_pair(PeriodicPrint)
    assert cb.summary()["captured"]
    assert_same(base, run)
    printed = [line for line in capsys.readouterr().out.splitlines() if line.startswith("step ")]
    assert len(printed) == 2 * 5  # the baseline's five prints, then the callback run's five


class LocalStepCondition(TinyMLP):
    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        every = self.helper_period()
        if self.global_step % every == 0:
            loss = loss * 1.0
        return loss

    def helper_period(self):
        return 10


def test_eager_steps_predicate_runs_those_steps_eagerly_and_an_opaque_branch_is_named():
    cb = callback(eager_steps=lambda trainer, batch_idx: trainer.global_step % 10 == 0)
    with pytest.warns(
        UserWarning,
        match=r"cannot evaluate.*test_callback_replay_cpu.py:\d+ \(`if self.global_step % every == 0:`\)",
    ):
        base = fit(baseline_of(LocalStepCondition))
        run = fit(LocalStepCondition, [cb])
    assert cb.summary()["captured"] and cb.fallback_steps == 3  # steps 0 (in the warm-up), 10 and 20
    assert_same(base, run)


def test_an_opaque_step_counter_branch_without_eager_steps_is_refused_by_name_and_trains_like_plain():
    """Without `eager_steps` a replay would take the capture step's branch at every step (the other
    branch's steps silently trained on the wrong one): the capture is refused, naming the line."""
    plain = fit(LocalStepCondition, fused=True)
    cb = callback()
    with pytest.warns(
        UserWarning,
        match=r"cannot evaluate, at .*test_callback_replay_cpu.py:\d+ \(`if self.global_step % every == 0:`\).*"
        r"training eagerly",
    ):
        run = fit(LocalStepCondition, [cb], fused=True)
    assert not cb.summary()["captured"] and "eager_steps" in cb.summary()["reason"]
    assert_same(plain, run)  # fused AdamW: the capturable and the configured steps agree bitwise


class SchedulerInStep(TinyMLP):
    """A per-step LR schedule stepped by hand inside training_step (Lightning's manual-optimization
    pattern, used with automatic optimization), or the LR set there directly (a hand-written warm-up)."""

    def __init__(self, schedule="lambda", **kw):
        super().__init__(fused=True, **kw)
        self.schedule = schedule

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=1e-2, fused=True)
        if self.schedule == "assign":
            return opt
        sch = (
            torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
            if self.schedule == "lambda"
            else torch.optim.lr_scheduler.StepLR(opt, step_size=10, gamma=0.1)
        )
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sch, "interval": "epoch"}}

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        if self.schedule == "assign":
            for group in self.optimizers().param_groups:
                group["lr"] = 1e-2 * min(1.0, (self.global_step + 1) / 20)
        else:
            self.lr_schedulers().step()
        return loss


@pytest.mark.parametrize("schedule", ["lambda", "step", "assign"])
def test_a_learning_rate_changed_inside_training_step_is_refused_by_name(schedule):
    """A replay runs no Python: an LR changed inside the step would stay at the capture's value (with
    StepLR, silently: its LR is constant through the warm-up steps, so nothing else differs). Refused,
    and the fit is plain Lightning's bit for bit: the warm-up steps kept the float LRs, and StepLR, which
    computes each LR from the last, no longer carries the float32 rounding of an LR tensor."""
    plain = fit(SchedulerInStep, steps=25, schedule=schedule)
    cb = callback()
    with pytest.warns(UserWarning, match=r"optimizer's hyperparameters \(param group 0's `lr`"):
        run = fit(SchedulerInStep, [cb], steps=25, schedule=schedule)
    assert not cb.summary()["captured"]
    assert run[2].optimizers[0].param_groups[0]["lr"] == plain[2].optimizers[0].param_groups[0]["lr"]
    assert_same(plain, run)


class ScaledMSE:
    """A plain Python loss object (not an nn.Module) with a number of its own, read in ``__call__``."""

    def __init__(self, count_calls=False):
        self.scale = 1.0
        self.calls = 0
        self.count_calls = count_calls

    def __call__(self, pred, y):
        if self.count_calls:
            self.calls += 1  # its own counter, read below: what a replay would freeze
            return (1.0 + 0.01 * self.calls) * (pred - y).square().mean()
        return self.scale * (pred - y).square().mean()


class HeldLossObject(TinyMLP):
    def __init__(self, count_calls=False, **kw):
        super().__init__(fused=True, **kw)
        self.criterion = ScaledMSE(count_calls)

    def on_train_epoch_start(self):
        self.criterion.scale = 1.0 + self.current_epoch  # a per-epoch loss weight, set by a hook

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = self.criterion(self.head(self.net(x)).squeeze(-1), y)
        self.log("train/loss", loss)
        return loss


def test_a_number_held_by_a_plain_loss_object_is_compared_before_each_replay():
    """The loss object's ``scale`` changes each epoch (a hook sets it): the graph baked the old value,
    so each change captures again; once it went unseen and replays trained on epoch 0's weight."""
    base = fit(baseline_of(HeldLossObject), steps=90)  # 30 batches per epoch: three epochs
    cb = callback()
    with pytest.warns(
        UserWarning, match=r"capturing the step again: Python numbers the step reads changed \(scale\)"
    ):
        run = fit(HeldLossObject, [cb], steps=90)
    assert cb.summary()["captured"] and cb.summary()["captures"] == 3, cb.summary()
    assert_same(base, run)


def test_a_plain_loss_object_that_counts_its_calls_inside_the_step_is_refused_by_name():
    assert_refused_like_plain(
        HeldLossObject, r"changes Python state \(`self.criterion.calls`", steps=12, count_calls=True
    )


class ValidationWeightedLoss(TinyMLP):
    """The loss weighted by the last validation loss, read from the Trainer's metrics in the step."""

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", (self.head(self.net(x)).squeeze(-1) - y).square().mean())

    def training_step(self, batch, batch_idx):
        x, y = batch
        w = self.trainer.callback_metrics.get("val_loss", torch.tensor(1.0))
        loss = (1 + w) * (self.head(self.net(x)).squeeze(-1) - y).square().mean()
        self.log("train/loss", loss)
        return loss


def test_a_step_reading_the_trainers_metrics_is_refused_by_name_and_trains_like_plain():
    """Lightning replaces the validation loss after each validation; a graph would keep the value it
    was captured with (the default 1.0 here, for the whole fit: silently, before this check)."""

    def run(callbacks):
        seed_everything(0)
        model = ValidationWeightedLoss(width=32, depth=3, fused=True)
        rec = Recorder()
        trainer = quiet_trainer(
            accelerator="cpu",
            max_steps=40,
            callbacks=[rec, *callbacks],
            val_check_interval=10,
            limit_val_batches=2,
        )
        trainer.fit(model, regression_loader(n=240, width=32), regression_loader(n=32, width=32))
        return model, rec, trainer

    plain = run([])
    cb = callback()
    with pytest.warns(UserWarning, match=r"the step reads the Trainer's metrics \(.*callback_metrics"):
        got = run([cb])
    assert not cb.summary()["captured"]
    assert_same(plain, got)


class LearningRateInTheLoss(TinyMLP):
    """The scheduler's last LR read inside the step and used in the loss; StepLR moves it each epoch."""

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=1e-2, fused=True)
        sch = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sch, "interval": "epoch"}}

    def training_step(self, batch, batch_idx):
        x, y = batch
        lr = self.lr_schedulers().get_last_lr()[0]
        loss = (1 + lr) * (self.head(self.net(x)).squeeze(-1) - y).square().mean()
        self.log("train/loss", loss)
        return loss


def test_a_step_reading_its_schedulers_state_is_refused_by_name_and_trains_like_plain():
    """The LR is constant within an epoch, so the warm-up steps agree; a graph would then keep epoch
    0's value for the whole fit (silently, before this check)."""
    plain = fit(LearningRateInTheLoss, steps=60)
    cb = callback()
    with pytest.warns(UserWarning, match=r"the step reads an LR scheduler's state \(.*get_last_lr"):
        run = fit(LearningRateInTheLoss, [cb], steps=60)
    assert not cb.summary()["captured"]
    assert_same(plain, run)


class TracksItsLastEpoch(TinyMLP):
    """A number of its own named like a scheduler's state, set per epoch and read in the loss."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self.last_epoch = 0

    def on_train_epoch_start(self):
        self.last_epoch = self.current_epoch

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = (1 + 0.5 * self.last_epoch) * (self.head(self.net(x)).squeeze(-1) - y).square().mean()
        self.log("train/loss", loss)
        return loss


def test_the_modules_own_last_epoch_is_a_value_captured_again_not_a_schedulers_state():
    """`self.last_epoch` was refused as an LR scheduler's state; it is the module's number, compared
    before each replay: captured again per epoch (baked in), bitwise the baseline."""
    assert_captured_again_like_baseline(
        TracksItsLastEpoch,
        r"Python numbers the step reads changed \(last_epoch\)",
        callback_kwargs={"operand_scalars": False},
    )


class NumpyWeight(TinyMLP):
    """A loss weight kept as a NumPy scalar, set per epoch by a hook (np.float32 is not a Python float)."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self.beta = np.float32(1.0)

    def on_train_epoch_start(self):
        self.beta = np.float32(1.0 + self.current_epoch)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = (self.head(self.net(x)).squeeze(-1) - y).square().mean() * self.beta
        self.log("train/loss", loss)
        return loss


def test_a_numpy_scalar_the_step_reads_is_compared_before_each_replay():
    """Once only Python's numbers were compared: the graph kept epoch 0's NumPy weight for the whole fit."""
    assert_captured_again_like_baseline(NumpyWeight, "capturing the step again")


class CurriculumData(LightningDataModule):
    """A data module whose difficulty rises each epoch (its loader is rebuilt every epoch)."""

    def __init__(self):
        super().__init__()
        self.difficulty = 1.0

    def train_dataloader(self):
        self.difficulty = 1.0 + self.trainer.current_epoch
        return regression_loader(n=240, width=32)


class ReadsTheDataModule(TinyMLP):
    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = self.trainer.datamodule.difficulty * (self.head(self.net(x)).squeeze(-1) - y).square().mean()
        self.log("train/loss", loss)
        return loss


def test_a_number_the_step_reads_from_the_datamodule_is_compared_before_each_replay():
    """Read through the Trainer, the data module's difficulty once went unchecked: the graph kept epoch
    0's value for the whole fit."""

    def run(cls, callbacks):
        seed_everything(0)
        model = cls(width=32, depth=3)
        rec = Recorder()
        trainer = quiet_trainer(
            accelerator="cpu", max_steps=90, callbacks=[rec, *callbacks], reload_dataloaders_every_n_epochs=1
        )
        trainer.fit(model, datamodule=CurriculumData())
        return model, rec, trainer

    cb = callback(operand_scalars=False)  # baked in: each change is seen
    with pytest.warns(UserWarning, match=r"capturing the step again: values the step reads changed"):
        got = run(ReadsTheDataModule, [cb])
    base = run(baseline_of(ReadsTheDataModule), [])
    assert cb.summary()["captured"] and cb.summary()["captures"] == 3, cb.summary()
    assert_same(base, got)


@pytest.mark.parametrize("case", ["dataset (getattr)", "callback"])
def test_numbers_the_step_reads_through_the_trainer_from_the_users_objects_are_compared_before_each_replay(
    case,
):
    """The dataset behind ``trainer.train_dataloader`` and the Trainer's callbacks are the user's
    objects: values read from them once went unchecked, and the graph kept epoch 0's for the fit."""
    if case == "callback":
        cls, loader, extra = ReadsACallback, None, WeightOnACallback
    else:
        cls, loader, extra = ReadsTheDataset, DataLoader(NoisyDataset(), batch_size=8), None

    def callbacks():
        return [extra()] if extra else []

    base = fit(baseline_of(cls), callbacks(), steps=90, loader=loader)
    cb = callback(operand_scalars=False)  # baked in: each change is seen
    with pytest.warns(UserWarning, match=r"capturing the step again: values the step reads changed"):
        run = fit(cls, [*callbacks(), cb], steps=90, loader=loader)
    assert cb.summary()["captured"] and cb.summary()["captures"] == 3, cb.summary()
    assert_same(base, run)


@pytest.mark.parametrize("case", ["own last epoch", "callback", "config through a local"])
def test_numbers_read_only_as_tensor_operands_need_one_capture_and_equal_the_baseline(case):
    """The same numbers with device scalars (the default): each epoch's value is written before the
    replays, one capture, and the first replay with a new value is checked against the eager step."""
    extra = []
    if case == "own last epoch":
        cls = TracksItsLastEpoch
    elif case == "callback":
        cls, extra = ReadsACallback, [WeightOnACallback]
    else:
        cls, change = CONFIG_CHANGES["callback-through-a-local"]
        extra = [lambda: SetsTheConfigEachEpoch(change)]
    base = fit(baseline_of(cls), [make() for make in extra], steps=90)
    cb = callback()
    run = fit(cls, [*(make() for make in extra), cb], steps=90)
    s = cb.summary()
    assert s["captured"] and s["captures"] == 1 and s["operand_scalars"]["changes"] == 2, s
    assert (
        s["replay_check"]["reasons"].get("operand value changed") == 2
        and s["replay_check"]["mismatches"] == 0
    )
    assert_same(base, run)


@pytest.mark.parametrize("what", ["function", "partial", "loss module", "activation module"])
def test_a_function_or_submodule_the_step_calls_replaced_between_steps_is_captured_again(what):
    """A graph replays the ops of the code it was captured with: the replays once kept epoch 0's loss
    (or activation) for the whole fit, silently."""
    assert_captured_again_like_baseline(
        SwitchesItsLoss, r"the functions or submodules the step calls were replaced", what=what
    )


@pytest.mark.parametrize(
    ("how", "named"),
    [
        ("torch.manual_seed", "torch.manual_seed"),
        # bound at import: not the patched module attribute; seen as torch's call inside it
        ("imported manual_seed", "torch.random.manual_seed"),
        ("fork_rng", "torch.random.fork_rng"),
    ],
)
@pytest.mark.parametrize("constant", [False, True], ids=["seed-per-step", "constant-seed"])
def test_a_step_that_seeds_torch_is_refused_by_name_and_trains_like_plain(constant, how, named):
    """Replays do not seed: their dropout masks differed from an eager step's (silently, with a
    constant seed the warm-up steps agree on). A name imported from torch and a fork_rng block in the
    step were not seen at all."""
    assert_refused_like_plain(
        SeedsInTheStep,
        rf"`{named}` at .*between_step_models.py:\d+ .* seeds torch",
        constant=constant,
        how=how,
        fused=True,
    )


def test_dropout_in_a_block_checkpointing_recomputes_with_the_forwards_rng_is_refused_by_name():
    """On the CPU stand-in the replays' recomputation would draw other masks than their forward (its
    replay does not put the generator's state back), so outside CUDA the step is refused by name. On
    CUDA it is captured (tests/gpu/test_callback_gpu.py)."""
    assert_refused_like_plain(
        CheckpointedDropout,
        r"`bernoulli_.float` at .*lightning_models.py:\d+ .* draws random numbers .* inside a block "
        r"that `torch.utils.checkpoint` recomputes",
        fused=True,
    )


def test_the_checkpointing_with_dropout_idiom_is_refused_outside_cuda_by_name_and_trains_like_plain():
    """The Hugging Face-style idiom (dropout inside non-reentrant checkpointed residual blocks): refused
    here for the reason above, and the refused fit bitwise plain; on the GPU it is captured
    (tests/gpu/test_idioms_gpu.py)."""
    from tests.idiom_harness import judge

    result = judge("grad_checkpointing_dropout", steps=12, accelerator="cpu")
    assert result["captured"] is False and result["equal"] is True, result["detail"]
    assert "outside CUDA (cpu)" in result["reason"] and "idiom_modules.py" in result["reason"], result[
        "reason"
    ]


@pytest.mark.parametrize("cls", [CheckpointedDropoutUnpreserved, DropoutOutsideCheckpoint])
def test_checkpointed_blocks_without_a_put_back_rng_or_without_dropout_are_captured_bitwise(cls):
    base, run, cb = captured_pair(cls, fused=True)
    assert cb.summary()["captured"] and cb.summary()["fallback_steps"] == 0, cb.summary()
    assert_same(base, run)


@pytest.mark.parametrize(
    ("how", "named"),
    [
        ("print", "`print`"),
        ("self.print", "`print`"),  # LightningModule.print passes it on
        ("logging", "logging to `between_step_models`"),
        ("log_metrics", r"a write to the Trainer's logger \(`CSVLogger.log_metrics`\)"),
        ("experiment", r"a write to the Trainer's logger \(`CSVLogger.experiment`\)"),
    ],
)
def test_a_step_that_writes_out_every_step_is_refused_by_name_and_every_line_is_written(how, named, tmp_path):
    """Replays wrote nothing: every replayed step's print, log line or logger row was missing, silently."""
    from lightning.pytorch.loggers import CSVLogger

    def logger(name):
        return {"logger": CSVLogger(tmp_path / name)}

    plain = fit(WritesOutEveryStep, how=how, fused=True, trainer_kwargs=logger("plain"))
    cb = callback()
    with pytest.warns(UserWarning, match=rf"{named} at .*between_step_models.py:\d+ .* runs in the step"):
        run = fit(WritesOutEveryStep, [cb], how=how, fused=True, trainer_kwargs=logger("callback"))
    assert not cb.summary()["captured"]
    assert_same(plain, run)
    if how in ("log_metrics", "experiment"):
        rows = [
            (tmp_path / name).glob("**/metrics.csv").__next__().read_text().count("\n")
            for name in ("plain", "callback")
        ]
        assert rows[0] == rows[1] > 20


class ReturnsItsStep(TinyMLP):
    """Returns the step counters beside the loss (for a callback that reads them from the outputs)."""

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        return {"loss": loss, "step": self.global_step, "epoch": self.current_epoch, "seen": batch_idx * 8}


def test_step_counters_returned_beside_the_loss_are_each_replays_own_and_capture_once():
    """They reach the outputs, not the graph: the step captured again at every step until the callback
    gave up and trained eagerly (correct, but no replay); now each replay's outputs get its own."""
    base, run, cb = captured_pair(ReturnsItsStep, steps=70)
    s = cb.summary()
    assert s["captured"] and s["captures"] == 1 and s["fallback_steps"] == 0, s
    assert_same(base, run)
    numbers = [[(o["step"], o["epoch"], o["seen"]) for o in rec.outputs] for rec in (base[1], run[1])]
    assert numbers[0] == numbers[1] and numbers[1][40] == (40, 1, 80)


def test_a_step_reading_an_element_of_a_list_it_appends_to_is_refused_by_name_and_trains_like_plain():
    """The graph read the element it was captured with at every replay (silently before). Its test
    `if self.history` reads the list too, which a replay's branch choice before the step could not
    follow: either cause refuses it."""
    assert_refused_like_plain(
        ReadsWhatItAppended,
        r"the step reads tensors of `self.history`, a list it appends to|"
        r"the branch at .*tests `self.history`, which the step appends to",
        fused=True,
    )


def test_a_logged_python_number_a_replay_cannot_recompute_ends_the_capture_and_every_logged_value_is_plains():
    """Replays once logged the capture step's number for the rest of the fit (with a warning): wrong
    curves, and a ModelCheckpoint or EarlyStopping monitoring it deciding on a frozen value."""
    plain = fit(LogsAnUnrecomputableNumber, steps=20, fused=True)
    cb = callback()
    with pytest.warns(UserWarning, match=r"`self.log\('examples_seen', ...\)` .* cannot recompute"):
        run = fit(LogsAnUnrecomputableNumber, [cb], steps=20, fused=True)
    assert "examples_seen" in cb.summary()["reason"] and cb.captures == 1
    # every step logs its own number, as plain Lightning does (the losses match plain's to float
    # precision here: the CPU stand-in's capturable AdamW is not bitwise its plain one; on the GPU
    # they are, tests/gpu/test_callback_gpu.py)
    assert [r["examples_seen"] for r in run[1].logged] == [r["examples_seen"] for r in plain[1].logged]
    assert [r["examples_seen"] for r in run[1].logged] == [8.0 * (i + 1) for i in range(20)]
    assert all(torch.allclose(a, b) for a, b in zip(plain[1].losses, run[1].losses))


def test_a_distribution_that_asks_for_its_argument_checks_is_refused_and_trains_like_plain():
    """The default checks are switched off for the capture (the cleanrl_ppo idiom is captured); an
    explicit ``validate_args=True`` keeps them, and they sync inside the capture."""
    cb = assert_refused_like_plain(
        ValidatedDistribution, "waits for the GPU inside the captured step", fused=True
    )
    assert "Categorical(logits=self.pi(x), validate_args=True)" in cb.summary()["reason"], cb.summary()


def test_macro_averaged_metrics_counted_with_bincount_are_captured_and_log_what_the_baseline_logs():
    """torch.bincount syncs (its output size depends on the data): the macro-averaged metrics of
    torchmetrics were refused; traced and captured, their counts come from index_add_ alike."""
    from tests.idiom_modules import MacroMetricCollection, _digits_loader

    def made(cls):
        seed_everything(0)  # the same initial weights for both
        return cls()

    base = fit(None, steps=30, model=made(baseline_of(MacroMetricCollection)), loader=_digits_loader())
    cb = callback()
    run = fit(None, [cb], steps=30, model=made(MacroMetricCollection), loader=_digits_loader())
    assert cb.summary()["captured"] and cb.fallback_steps == 0, cb.summary()
    assert {"train/acc_step", "train/f1_step", "train/precision_step"} <= set(run[1].logged[-1])
    assert_same(base, run)  # losses, every logged value at every step, parameters


@pytest.mark.parametrize("container", ["dict", "list"])
def test_a_tensor_in_a_container_attribute_replaced_between_steps_is_captured_again(container):
    """Only numbers in containers were compared: the replays kept reading epoch 0's tensor, silently."""
    assert_captured_again_like_baseline(
        TensorInAContainer, r"capturing the step again: values the step reads changed", container=container
    )


class Annealed(TinyMLP):
    """A KL-annealing style weight computed in Python from the step counter."""

    def training_step(self, batch, batch_idx):
        x, y = batch
        beta = min(1.0, (self.global_step + 1) / 20)
        loss = beta * (self.head(self.net(x)).squeeze(-1) - y).square().mean()
        self.log("train/loss", loss)
        return loss


def test_python_values_that_change_per_step_are_refused_naming_the_op_and_line():
    plain = fit(Annealed, fused=True)
    cb = callback(operand_scalars=False)  # baked in (with device scalars the ramp is captured once)
    with pytest.warns(
        UserWarning,
        match=r"two warm-up steps ran different work \(op \d+ was `mul.Tensor\(.*\)` at .*test_callback_replay_cpu.py:\d+",
    ):
        run = fit(Annealed, [cb], fused=True)
    assert not cb.summary()["captured"]
    assert_same(plain, run)


class NoneAtThree(TinyMLP):
    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        return None if batch_idx == 3 else loss


@pytest.mark.parametrize("verify", [False, True])
def test_training_step_returning_none_at_the_capture_step_defers_the_capture(verify):
    base = fit(baseline_of(NoneAtThree))
    cb = callback(verify=verify)
    run = fit(NoneAtThree, [cb])
    assert cb.summary()["captured"] and cb.capture_step == 4
    assert_same(base, run)


class LogsScheduledLR(TinyMLP):
    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        self.log("lr", self.lr_schedulers().get_last_lr()[0])
        self.log("epoch_const", 3.0)
        return loss


class LogsLocalFloat(TinyMLP):
    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        self.log("twice_step", float(self.global_step) * 2)  # read from the source: recomputed per replay
        self.log("opaque", self.opaque_value())  # a call the callback does not evaluate
        return loss

    def opaque_value(self):
        return float(self.global_step)


def test_logged_python_numbers_are_recomputed_per_replay_or_named():
    base, run, cb = captured_pair(LogsScheduledLR, scheduler="cosine")
    assert cb.summary()["captured"]
    assert_same(base, run)
    assert len({s["lr"] for s in run[1].logged[5:]}) > 5
    cb2 = callback()
    with pytest.warns(
        UserWarning, match=r"`self.log\('opaque', ...\)` in training_step logs a Python number"
    ):
        _, rec, _ = fit(LogsLocalFloat, [cb2], steps=8)
    assert cb2.summary()["captured"]
    assert [s["twice_step"] for s in rec.logged] == [float(2 * i) for i in range(8)]


def test_reissued_logs_take_the_shortcut_and_leave_what_eager_logging_leaves(tmp_path):
    from lightning.pytorch.loggers import CSVLogger

    def run(cls, callbacks, name):
        seen = LoggedEverywhere(callbacks[0] if callbacks else None)
        logger = CSVLogger(tmp_path, name=name, version=0)
        result = fit(
            cls,
            [seen, *callbacks],
            steps=-1,
            n=96,
            trainer_kwargs={"max_epochs": 3, "logger": logger, "log_every_n_steps": 1},
        )
        result = tuple(result)  # a baseline fit runs now, before its CSV is read
        return result, seen, (tmp_path / name / "version_0" / "metrics.csv").read_text()

    cb = callback()
    got, got_seen, got_csv = run(ManyLogs, [cb], "callback")
    base, base_seen, base_csv = run(baseline_of(ManyLogs), [], "eager")
    assert cb.summary()["captured"] and cb.fallback_steps == 0
    assert_same(base, got)
    assert len(base_seen.seen) == len(got_seen.seen) == 36
    assert_logged_alike(base_seen, got_seen)
    assert got_csv == base_csv
    calls = got_seen.log_calls
    assert len(calls) == 12  # with TinyMLP's two
    # the steps after the capture replay, but those the sampled check computes eagerly log for real
    replays = 36 - 3 - cb.summary()["replay_check"]["checks"]
    # the first re-issue of each call registers it through the real self.log; the rest take the shortcut
    assert all(call.fast_issues == replays - 1 for call in calls), [(c.name, c.fast_issues) for c in calls]


class KeepsStepValues(Callback):
    """Holds on to the tensors callback_metrics gave it (EarlyStopping and ModelCheckpoint keep such a
    reference as their best score), and a copy of each, to check later that nothing overwrote them."""

    def __init__(self, key):
        self.key, self.kept = key, []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        value = trainer.callback_metrics[self.key]
        self.kept.append((value, value.clone()))


def test_a_tensor_logged_per_step_takes_the_one_copy_path_and_later_replays_leave_it_alone():
    base_keeper, keeper = KeepsStepValues("step_only"), KeepsStepValues("step_only")
    base = fit(baseline_of(ManyLogs), [base_keeper], steps=12)
    cb = callback()
    run = fit(ManyLogs, [cb, keeper], steps=12)
    assert cb.summary()["captured"] and cb.fallback_steps == 0
    assert_same(base, run)
    for step, ((held, kept_copy), (_, base_copy)) in enumerate(zip(keeper.kept, base_keeper.kept)):
        assert torch.equal(held, kept_copy), (
            f"the value kept at step {step} was overwritten by a later replay"
        )
        assert torch.equal(kept_copy, base_copy), f"step {step}: {kept_copy} vs {base_copy}"
    assert len({float(c) for _, c in keeper.kept}) > 1  # the values do change from step to step


def test_only_per_step_float_tensors_without_sync_take_the_one_copy_path():
    from l2lightning.log_replay import ReissuedLog

    class Logs(TinyMLP):
        def training_step(self, batch, batch_idx):
            loss = super().training_step(batch, batch_idx)
            self.log("per_step", loss)
            self.log("per_epoch", loss, on_step=False, on_epoch=True)
            self.log("both", loss, on_step=True, on_epoch=True)
            self.log("synced", loss, sync_dist=True)
            self.log("half", loss.half())
            return loss

    cb = callback()
    seen = LoggedEverywhere(cb)
    fit(Logs, [seen, cb], steps=8)
    assert cb.summary()["captured"]
    step_only = {c.name: c._step_only for c in seen.log_calls if isinstance(c, ReissuedLog)}
    # "synced" qualifies (sync_dist only matters across processes, checked per call); half does not
    assert step_only == {
        "train/loss": True,
        "train/pred_mean": True,
        "per_step": True,
        "per_epoch": False,
        "both": False,
        "synced": True,
        "half": False,
    }, step_only


# --------------------------------------------------------------------------- 5. torchmetrics in training_step
class MetricsInStep(TinyMLP):
    """The hydra-template and torchmetrics-docs patterns: metrics updated and logged in training_step."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self.classes = nn.Linear(32, 4)
        self.train_loss = torchmetrics.MeanMetric()
        self.train_max = torchmetrics.MaxMetric()
        self.train_acc = torchmetrics.Accuracy(task="multiclass", num_classes=4)

    def training_step(self, batch, batch_idx):
        x, y = batch
        h = self.net(x)
        pred = self.head(h).squeeze(-1)
        logits = self.classes(h)
        target = (y.abs() * 2).long().clamp(max=3)
        loss = (pred - y).square().mean() + nn.functional.cross_entropy(logits, target)
        self.train_loss(loss)
        self.train_max.update(pred.max())
        self.train_acc(logits, target)
        self.log("train/loss", self.train_loss, on_step=False, on_epoch=True)
        self.log("train/acc", self.train_acc, on_step=True, on_epoch=True)
        self.log("train/max", self.train_max, on_step=False, on_epoch=True)
        return loss


def test_after_replay_writes_a_metrics_step_attributes_through_its_own_setattr_when_it_has_one():
    from l2lightning.metric_binding import MetricBinding, _plain_step_attributes

    class Watched(torchmetrics.MeanMetric):
        def __setattr__(self, name, value):
            if name in ("_update_count", "_computed", "_forward_cache"):
                self.__dict__.setdefault("set_through_setattr", []).append(name)
            super().__setattr__(name, value)

    plain, watched = torchmetrics.MeanMetric(), Watched()
    assert _plain_step_attributes(plain) and not _plain_step_attributes(watched)
    for metric in (plain, watched):
        binding = MetricBinding({"m": metric})
        metric(torch.tensor(2.0))  # what a captured step does: one update, a step value
        binding.finish_capture()
        vars(metric).pop("set_through_setattr", None)
        before = metric._update_count
        binding.after_replay()
        assert metric._update_count == before + 1 and metric._computed is None
        assert torch.equal(metric._forward_cache, torch.tensor(2.0))
    assert "set_through_setattr" not in vars(plain)
    assert vars(watched)["set_through_setattr"] == ["_update_count", "_computed", "_forward_cache"]


def test_tensor_state_metrics_update_inside_the_graph_and_log_like_eager():
    base, run, cb = captured_pair(MetricsInStep, steps=-1, n=96, trainer_kwargs={"max_epochs": 3})
    assert cb.summary()["captured"] and cb.fallback_steps == 0
    assert_same(base, run)
    for key in ("train/loss", "train/acc_epoch", "train/max", "train/acc_step"):
        assert torch.equal(base[2].callback_metrics[key], run[2].callback_metrics[key]), key


class CatInStep(TinyMLP):
    def __init__(self, **kw):
        super().__init__(**kw)
        self.preds = torchmetrics.CatMetric()

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        self.preds.update(loss.detach())
        return loss


def test_list_state_metrics_are_refused_by_name_and_train_like_plain():
    plain = fit(CatInStep)
    cb = callback()
    with pytest.warns(UserWarning, match=r"`preds` \(CatMetric\) keeps a list state"):
        run = fit(CatInStep, [cb])
    assert not cb.summary()["captured"]
    assert_same(plain, run)


# --------------------------------------------------------------------------- 7. host syncs
def test_a_host_sync_every_step_is_refused_at_the_first_step_naming_the_line():
    plain = fit(TinyMLP, sync_in_step=True)
    cb = callback()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        run = fit(TinyMLP, [cb], sync_in_step=True)
    messages = [str(w.message) for w in caught if "L2GraphCallback" in str(w.message)]
    assert any("lightning_models.py:" in m and "`.item()`" in m and "eager_steps" in m for m in messages), (
        messages
    )
    assert emu.FakeGraph.instances == 0
    assert_same(plain, run)  # refused before the first update: the plain fit, bit for bit


# --------------------------------------------------------------------------- 8./9. bookkeeping and outputs
class DictOutputs(TinyMLP):
    def training_step(self, batch, batch_idx):
        x, y = batch
        pred = self.head(self.net(x)).squeeze(-1)
        loss = (pred - y).square().mean()
        return {"loss": loss, "preds": pred.detach()}


def test_extra_outputs_are_fresh_tensors_each_step():
    base, run, cb = captured_pair(DictOutputs, steps=12)
    preds_b = [o["preds"] for o in base[1].outputs]
    preds_r = [o["preds"] for o in run[1].outputs]
    assert all(torch.equal(a, b) for a, b in zip(preds_b, preds_r))
    assert len({p.data_ptr() for p in preds_r}) == len(preds_r)


def test_partial_batch_at_the_capture_step_defers_the_capture():
    base = fit(baseline_of(TinyMLP), steps=-1, n=28, trainer_kwargs={"max_epochs": 4})  # batches 8, 8, 8, 4
    cb = callback()
    run = fit(TinyMLP, [cb], steps=-1, n=28, trainer_kwargs={"max_epochs": 4})
    assert cb.summary()["captured"] and cb.fallback_steps == 3  # only the three later partial batches
    assert_same(base, run)


def test_timing_is_a_bounded_window_and_teardown_drops_references():
    cb = callback()
    model, _, trainer = fit(TinyMLP, [cb], steps=TIMING_WINDOW + 40)
    assert len(cb._timing.graph) == TIMING_WINDOW
    assert cb._module is None and cb._graph is None and cb._optimizer is None and cb._trainer is None
    assert not {"training_step", "log"} & set(vars(model))
    assert "step" not in vars(trainer.optimizers[0])


class StepSchedule(TinyMLP):
    def __init__(self, **kw):
        super().__init__(scheduler="step", **kw)


def test_checkpoints_hold_exact_float_lrs_and_resume_equals_an_uninterrupted_run(tmp_path):
    def run(with_cb, ckpt_path=None, save_dir=None, steps=30):
        seed_everything(0)
        model = (StepSchedule if with_cb else baseline_of(StepSchedule))(width=32, depth=3)
        cbs = [callback()] if with_cb else []
        if save_dir is not None:
            cbs.append(
                ModelCheckpoint(dirpath=save_dir, every_n_train_steps=10, save_top_k=-1, filename="{step}")
            )
        t = quiet_trainer(
            accelerator="cpu", max_steps=steps, callbacks=cbs, enable_checkpointing=save_dir is not None
        )
        t.fit(model, regression_loader(n=80, width=32), ckpt_path=ckpt_path)
        return model, t

    full, trainer = run(True, save_dir=tmp_path / "cb")
    scheduler = trainer.lr_scheduler_configs[0].scheduler
    assert all(type(v) is float for v in scheduler._last_lr)
    ck = torch.load(tmp_path / "cb" / "step=20.ckpt", weights_only=False)
    group = ck["optimizer_states"][0]["param_groups"][0]
    assert group["lr"] == 0.01 * 0.5**4 and type(group["lr"]) is float and group["capturable"] is False
    assert all(type(v) is float for v in ck["lr_schedulers"][0]["_last_lr"])
    resumed, _ = run(True, ckpt_path=str(tmp_path / "cb" / "step=20.ckpt"))
    assert all(torch.equal(p, q) for p, q in zip(full.parameters(), resumed.parameters()))


class BatchNormAndMetric(MetricsInStep):
    def __init__(self, **kw):
        super().__init__(**kw)
        self.net = nn.Sequential(nn.Linear(32, 32), nn.BatchNorm1d(32), nn.GELU())


def test_finding_the_prefetch_chain_leaves_no_trace(monkeypatch):
    """The prefetch set-up runs training_step on the static batch (and the tuner times layer copies):
    BatchNorm statistics, metric states and the RNG must come out as they went in."""
    from l2lightning import callback as callback_module

    def dry_run_hooks(self, pl_module):
        self._originals["log"], saved_log = (lambda *a, **k: None), self._originals["log"]
        try:
            self._originals["training_step"](self._static_for_prefetch.batch, 0)
            torch.rand(3)  # the tuner draws random inputs
        finally:
            self._originals["log"] = saved_log
        return None

    monkeypatch.setattr(callback_module.L2GraphCallback, "_prefetch_hooks", dry_run_hooks)
    base = fit(baseline_of(BatchNormAndMetric), steps=-1, n=96, trainer_kwargs={"max_epochs": 2})
    cb = L2GraphCallback(prefetch="default", log_timing=False)
    run = fit(BatchNormAndMetric, [cb], steps=-1, n=96, trainer_kwargs={"max_epochs": 2})
    assert cb.summary()["captured"]
    assert_same(base, run)


# --------------------------------------------------------------------------- more of the same kind
class Planted(TinyMLP):
    """Differs only inside a capture: what verify=True exists to catch."""

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        return loss * 1.001 if emu.CAPTURING[0] else loss


def test_a_verify_failure_raises_and_leaves_nothing_installed():
    from l2lightning import EquivalenceError

    seed_everything(0)
    model = Planted(width=32, depth=3)
    trainer = quiet_trainer(accelerator="cpu", max_steps=8, callbacks=[callback(verify=True)])
    with pytest.raises(EquivalenceError, match="captured step vs eager step"):
        trainer.fit(model, regression_loader(n=240, width=32))
    assert not {"training_step", "backward", "optimizer_zero_grad", "log"} & set(vars(model))
    group = trainer.optimizers[0].param_groups[0]
    assert group["capturable"] is False and type(group["lr"]) is float
    assert "step" not in vars(trainer.optimizers[0])


def test_a_second_fit_on_the_same_trainer_and_callback_matches():
    def two_fits(cls, callbacks):
        seed_everything(0)
        model = cls(width=32, depth=3)
        trainer = quiet_trainer(accelerator="cpu", max_steps=10, callbacks=callbacks)
        trainer.fit(model, regression_loader(n=240, width=32))
        trainer.fit_loop.epoch_loop.max_steps = 25
        trainer.fit(model, regression_loader(n=240, width=32))
        return model, trainer

    cb = callback()
    run, trainer = two_fits(TinyMLP, [cb])
    base, _ = two_fits(baseline_of(TinyMLP), [])
    assert trainer.global_step == 25 and cb.summary()["captured"]
    assert all(torch.equal(p, q) for p, q in zip(base.parameters(), run.parameters()))


class ValidatedStepSchedule(StepSchedule):
    def validation_step(self, batch, batch_idx):
        self.log("val", super().training_step(batch, batch_idx))


def test_partial_batches_with_a_step_schedule_and_validation_match():
    kw = dict(
        steps=40,
        n=60,
        trainer_kwargs={"val_check_interval": 3, "num_sanity_val_steps": 0},
    )

    def run(cls, callbacks):
        seed_everything(0)
        model = cls(width=32, depth=3)
        trainer = quiet_trainer(
            accelerator="cpu", max_steps=kw["steps"], callbacks=callbacks, **kw["trainer_kwargs"]
        )
        trainer.fit(model, regression_loader(n=kw["n"], width=32), regression_loader(n=16, width=32, seed=4))
        return model, trainer

    cb = callback()
    model, tr = run(ValidatedStepSchedule, [cb])
    base, tb = run(baseline_of(ValidatedStepSchedule), [])
    assert cb.summary()["captured"] and cb.fallback_steps > 0  # the partial last batch of each epoch
    assert all(torch.equal(p, q) for p, q in zip(base.parameters(), model.parameters()))
    sb, sr = tb.lr_scheduler_configs[0].scheduler, tr.lr_scheduler_configs[0].scheduler
    assert sb.last_epoch == sr.last_epoch and sb.get_last_lr() == sr.get_last_lr()
    assert torch.equal(tb.callback_metrics["val"], tr.callback_metrics["val"])


class InfAtLargeInputs(TinyMLP):
    def training_step(self, batch, batch_idx):
        x, y = batch
        x = x * torch.where(x.abs().max() > 2.9, torch.tensor(float("inf")), torch.tensor(1.0))
        return super().training_step((x, y), batch_idx)


def test_gradient_clipping_with_non_finite_gradients_matches_bit_for_bit():
    from l2lightning.verify import compare

    base, run, cb = captured_pair(InfAtLargeInputs, steps=20, trainer_kwargs={"gradient_clip_val": 0.5})
    assert cb.summary()["captured"]
    assert compare(dict(base[0].named_parameters()), dict(run[0].named_parameters()), "params").ok


# --------------------------------------------------------------------------- the packaged families
@pytest.mark.parametrize("family", ["mlp_stack", "rl_policy", "recommender", "conv_stack", "text_encoder"])
def test_families_update_their_metrics_in_the_graph_and_log_like_eager(family):
    from tests.logging_models import LoggedEverywhere, assert_logged_alike
    from tests.test_app_models import tiny

    def run(with_callback):
        model, dm = tiny(family)
        if not with_callback:
            model.__class__ = baseline_of(type(model))  # the same seeded module, the baseline optimizer
        cb = callback() if with_callback else None
        seen = LoggedEverywhere(cb)
        seed_everything(0)
        trainer = quiet_trainer(accelerator="cpu", max_epochs=3, callbacks=[seen, *([cb] if cb else [])])
        trainer.fit(model, datamodule=dm)
        return model, seen, cb

    model, seen, cb = run(True)
    base_model, base_seen, _ = run(False)
    summary = cb.summary()
    assert summary["captured"] and summary["fallback_steps"] == 0, summary
    assert any(call.name.startswith("train/") and call.fx == "training_step" for call in seen.log_calls)
    assert_logged_alike(base_seen, seen)
    for (name, p), q in zip(base_model.named_parameters(), model.parameters()):
        assert torch.equal(p, q), f"{family}: parameter {name} differs"


def _mapping_loader(mapping_type):
    """The regression batches as `mapping_type` instances, as a user's collate_fn might build them."""

    def collate(samples):
        batch = mapping_type()
        batch["x"] = torch.stack([x for x, _ in samples])
        batch["y"] = torch.stack([y for _, y in samples])
        return batch

    return DataLoader(regression_loader(n=240, width=32).dataset, batch_size=8, collate_fn=collate)


def test_names_in_the_batch_the_step_never_reads_are_captured_and_replay_bitwise():
    """Every batch's file names differ, and the batch's non-tensor values are compared before each
    replay: every step ran eagerly. Unread (the source says so), they are left out of the comparison."""
    loader = lambda: DataLoader(NamedSamples(), batch_size=8)  # noqa: E731
    base, run, cb = captured_pair(IgnoresTheNames, loader=loader())
    s = cb.summary()
    assert s["captured"] and s["fallback_steps"] == 0 and s["captures"] == 1, s
    assert_same(base, run)


def test_names_in_the_batch_the_step_reads_keep_their_steps_eager_and_like_plain():
    loader = lambda: DataLoader(NamedSamples(), batch_size=8)  # noqa: E731
    plain = fit(ReadsTheNames, loader=loader())
    cb = callback()
    with pytest.warns(UserWarning, match="every batch held other non-tensor values .* the step reads them"):
        run = fit(ReadsTheNames, [cb], loader=loader())
    s = cb.summary()
    assert not s["captured"], s
    assert_same(plain, run)


class TakesMappingBatches(TinyMLP):
    def training_step(self, batch, batch_idx):
        return super().training_step((batch["x"], batch["y"]), batch_idx)


def test_a_defaultdict_batch_is_captured_and_replays_bitwise():
    loader = lambda: _mapping_loader(lambda: collections.defaultdict(list))  # noqa: E731
    base = fit(baseline_of(TakesMappingBatches), loader=loader())
    cb = callback()
    run = fit(TakesMappingBatches, [cb], loader=loader())
    assert cb.summary()["captured"] and cb.summary()["fallback_steps"] == 0, cb.summary()
    assert_same(base, run)


def test_a_batch_the_static_buffers_cannot_rebuild_is_refused_by_name_and_trains_like_plain(monkeypatch):
    """Whatever Lightning can move to the device the buffers rebuild the same way; should a type still
    fail there, the capture is refused with the reason, and the fit goes on eagerly."""
    from l2lightning import step_capture

    def cannot_rebuild(batch, reads=None):
        raise TypeError("Exotic() takes no arguments")

    plain = fit(TinyMLP, fused=True)
    monkeypatch.setattr(step_capture, "StaticBatch", cannot_rebuild)
    cb = callback()
    with pytest.warns(
        UserWarning, match=r"the batch \(list\) cannot be rebuilt .*Exotic\(\) takes no arguments"
    ):
        run = fit(TinyMLP, [cb], fused=True)
    assert not cb.summary()["captured"]
    assert_same(plain, run)  # fused AdamW: the capturable and the configured steps agree bitwise


# --------------------------------------------------------------------------- what capturing costs, OOM
class OOMInCapture(TinyMLP):
    def training_step(self, batch, batch_idx):
        if emu.CAPTURING[0]:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return super().training_step(batch, batch_idx)


def test_out_of_memory_in_the_capture_falls_back_to_eager_naming_it():
    plain = fit(OOMInCapture, fused=True)
    cb = callback()
    with pytest.warns(
        UserWarning, match=r"could not be captured: out of memory \(.*Tried to allocate 2.00 GiB"
    ):
        run = fit(OOMInCapture, [cb], fused=True)
    assert not cb.summary()["captured"]
    assert_same(plain, run)


class OOMHoldingCaptureTensors(TinyMLP):
    """Runs out of memory in the capture with a tensor of the capture alive in its frame, and records,
    at each later step, whether that tensor still exists."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self.held = None  # a weak reference to the capture's tensor
        self.alive_at_later_steps: list[bool] = []

    def training_step(self, batch, batch_idx):
        if emu.CAPTURING[0]:
            partial = torch.ones(1024)  # what a capture has allocated in its pool when it runs out
            self.held = weakref.ref(partial)
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        if self.held is not None:
            self.alive_at_later_steps.append(self.held() is not None)
        return super().training_step(batch, batch_idx)


def test_the_eager_fallback_after_an_out_of_memory_capture_runs_without_the_captures_tensors():
    """The exception's frames hold what the capture allocated; the fallback's eager step, which may
    need that memory, must run after they are gone."""
    cb = callback()
    with pytest.warns(UserWarning, match="could not be captured: out of memory"):
        model, _, _ = fit(OOMHoldingCaptureTensors, [cb], steps=8, fused=True)
    assert model.alive_at_later_steps and not any(model.alive_at_later_steps), model.alive_at_later_steps


class StreamLedger:
    """Stands in for the capture's CUDA stream on the CPU: which steps ran on it, and when what it
    holds (cuBLAS workspaces, cached blocks) was freed, by global step."""

    def __init__(self, monkeypatch):
        import contextlib

        from l2lightning import step_dispatch

        self.on_stream: list[int] = []
        self.freed: list[tuple[str, int]] = []
        ledger = self

        @contextlib.contextmanager
        def on_step_stream(cb):
            cb._step_stream = "the capture's stream"
            ledger.on_stream.append(cb._trainer.global_step)
            yield

        monkeypatch.setattr(L2GraphCallback, "_on_step_stream", on_step_stream)
        self.trainer: Any = None
        for name in ("clear_cublas_workspaces", "free_cached_memory"):
            monkeypatch.setattr(
                step_dispatch, name, lambda name=name: ledger.freed.append((name, ledger.step()))
            )

    def step(self) -> int:
        return self.trainer.global_step


def test_after_a_failed_capture_the_captures_stream_gives_back_its_memory_once_before_the_plain_steps(
    monkeypatch,
):
    """The steps the callback ran on its stream left cuBLAS workspaces and cached blocks there that
    the plain steps on Lightning's stream cannot use: freed once, before the first plain step, so
    that a fit with little memory to spare does not hold both (an H200 fit with 4% spare ran out)."""
    ledger = StreamLedger(monkeypatch)
    cb = callback(check_share=1.0)  # every scheduled check, whatever the emulator's steps cost
    trainer = quiet_trainer(accelerator="cpu", max_steps=8, callbacks=[Recorder(), cb])
    ledger.trainer = trainer
    seed_everything(0)
    with pytest.warns(UserWarning, match="could not be captured: out of memory"):
        trainer.fit(OOMInCapture(width=32, depth=3, fused=True), regression_loader(n=240, width=32))
    capture_step = cb.warmup_steps
    # the warm-up steps and the failed capture's eager step ran on the stream, no later step did
    assert ledger.on_stream == list(range(capture_step + 1)), ledger.on_stream
    # freed once, after that step and before the next (global_step has counted it)
    assert ledger.freed == [
        ("clear_cublas_workspaces", capture_step + 1),
        ("free_cached_memory", capture_step + 1),
    ], ledger.freed
    assert cb._step_stream is None


def test_a_captured_fit_keeps_its_stream_and_frees_nothing_between_steps(monkeypatch):
    ledger = StreamLedger(monkeypatch)
    cb = callback(check_share=1.0)  # every scheduled check, whatever the emulator's steps cost
    trainer = quiet_trainer(accelerator="cpu", max_steps=8, callbacks=[Recorder(), cb])
    ledger.trainer = trainer
    seed_everything(0)
    trainer.fit(TinyMLP(width=32, depth=3), regression_loader(n=240, width=32))
    assert cb.summary()["captured"]
    # the warm-up steps, the capture, and the eager steps of the sampled check (replays 1, 2 and 4)
    assert ledger.freed == [] and ledger.on_stream == [*range(cb.warmup_steps + 1), 4, 5, 7]


def test_out_of_memory_while_tuning_captures_without_prefetch(monkeypatch):
    def tuner_runs_out(self, pl_module):
        torch.zeros(3)  # the tuner allocates, then the device is full
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 512.00 MiB")

    monkeypatch.setattr(L2GraphCallback, "_prefetch_hooks", tuner_runs_out)
    base = fit(baseline_of(TinyMLP))
    cb = L2GraphCallback(prefetch="default", log_timing=False)
    with pytest.warns(UserWarning, match=r"prefetch off: out of memory while tuning it .*512.00 MiB"):
        run = fit(TinyMLP, [cb])
    summary = cb.summary()
    assert summary["captured"] and summary["plans"] == [] and cb.prefetch == "default"
    assert summary["tuning_s"] > 0 and summary["capture_s"] > 0 and summary["compile_s"] == 0
    assert_same(base, run)


# --------------------------------------------------------------------------- gradients a step adds to
class NeverZeroGrad(TinyMLP):
    """Gradients summed over every step: the module's own choice, which a captured step (it starts
    from fresh gradients) would silently drop."""

    def optimizer_zero_grad(self, epoch, batch_idx, optimizer):
        pass


class ZeroGradEveryOtherStep(TinyMLP):
    def optimizer_zero_grad(self, epoch, batch_idx, optimizer):
        if batch_idx % 2 == 0:
            optimizer.zero_grad()


class ZeroGradInPlace(TinyMLP):
    def optimizer_zero_grad(self, epoch, batch_idx, optimizer):
        optimizer.zero_grad(set_to_none=False)


@pytest.mark.parametrize("model_cls", [NeverZeroGrad, ZeroGradEveryOtherStep])
def test_a_step_that_adds_to_earlier_gradients_is_refused_and_trains_like_plain(model_cls):
    # fused AdamW: the warm-up steps' capturable configuration gives plain's bits
    plain = fit(model_cls, fused=True)
    cb = callback()
    with pytest.warns(UserWarning, match=r"gradients still hold an earlier step's values"):
        run = fit(model_cls, [cb], fused=True)
    assert not cb.summary()["captured"]
    assert_same(plain, run)


def test_gradients_zeroed_in_place_are_captured_and_train_like_the_baseline():
    base = fit(baseline_of(ZeroGradInPlace))
    cb = callback()
    run = fit(ZeroGradInPlace, [cb])
    assert cb.summary()["captured"], cb.summary()["reason"]
    assert_same(base, run)


# --------------------------------------------------------------------------- tensors rebound between steps
class WeightedLoss(TinyMLP):
    """The loss times a weight the module keeps in a tensor: a registered buffer, or a plain attribute."""

    def __init__(self, as_buffer=True, rebind_every=1, **kwargs):
        super().__init__(**kwargs)
        if as_buffer:
            self.register_buffer("weight", torch.ones(()))
        else:
            self.weight = torch.ones(())
        self.rebind_every = rebind_every

    def training_step(self, batch, batch_idx):
        x, y = batch
        pred = self.head(self.net(x)).squeeze(-1)
        loss = (pred - y).square().mean() * self.weight
        self.log("train/loss", loss)
        return loss

    def on_train_batch_end(self, outputs, batch, batch_idx):
        if (batch_idx + 1) % self.rebind_every == 0:
            self.weight = self.weight * 0.9  # a new tensor: a graph would keep reading the old one

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr)  # capturable or not, the same bits


@pytest.mark.parametrize("as_buffer", [True, False], ids=["buffer", "attribute"])
def test_a_tensor_rebound_after_every_step_is_seen_and_the_fit_trains_like_plain(as_buffer):
    plain = fit(WeightedLoss, as_buffer=as_buffer)
    cb = callback()
    with pytest.warns(UserWarning, match=r"tensors weight are other objects than at capture"):
        run = fit(WeightedLoss, [cb], as_buffer=as_buffer)
    assert cb.summary()["captures"] >= 1 and "every step would need a new capture" in cb.summary()["reason"]
    assert_same(plain, run)


@pytest.mark.parametrize("as_buffer", [True, False], ids=["buffer", "attribute"])
def test_a_tensor_rebound_now_and_then_is_captured_again_and_trains_like_plain(as_buffer):
    plain = fit(WeightedLoss, as_buffer=as_buffer, rebind_every=7)
    cb = callback()
    run = fit(WeightedLoss, [cb], as_buffer=as_buffer, rebind_every=7)
    summary = cb.summary()
    assert summary["captured"] and summary["captures"] >= 3, summary
    assert_same(plain, run)


# --------------------------------------------------------------------------- other callbacks' hooks inside the step
class SGDRegressor(TinyMLP):
    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)  # capturable or not, the same bits


class HalveGradsEveryFifthStep(Callback):
    """A callback hook inside the captured step that branches on the Trainer's step counter."""

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        if trainer.global_step % 5 == 4:
            for p in pl_module.parameters():
                p.grad.mul_(0.5)


class ScaleGradsBy(Callback):
    """A callback hook inside the step reads a Python number the callback changes between steps."""

    def __init__(self):
        self.scale = 1.0

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        for p in pl_module.parameters():
            p.grad.mul_(self.scale)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if batch_idx == 9:
            self.scale = 0.25


class TightenClipping(Callback):
    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if batch_idx == 9:
            trainer.gradient_clip_val = 0.01


@pytest.mark.parametrize(
    ("extra", "trainer_kwargs", "eager_steps", "captures"),
    [
        (HalveGradsEveryFifthStep, {}, 6, 1),  # steps 4, 9, ..., 29 of 30 run eagerly
        (ScaleGradsBy, {}, 0, 2),  # captured again after the scale changed
        (TightenClipping, {"gradient_clip_val": 1.0}, 0, 2),
    ],
    ids=["branch-on-trainer-step", "callback-number", "trainer-clip-value"],
)
def test_what_other_callbacks_hooks_in_the_step_depend_on_is_followed(
    extra, trainer_kwargs, eager_steps, captures
):
    plain = fit(SGDRegressor, [extra()], trainer_kwargs=trainer_kwargs)
    cb = callback()
    run = fit(SGDRegressor, [extra(), cb], trainer_kwargs=trainer_kwargs)
    summary = cb.summary()
    assert summary["captured"], summary["reason"]
    assert summary["fallback_steps"] == eager_steps and summary["captures"] == captures, summary
    assert_same(plain, run)


# --------------------------------------------------------------------------- optimizer state replaced between steps
class MomentumRegressor(TinyMLP):
    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)  # capturable or not, the same bits


class ResetMomentum(Callback):
    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if batch_idx == 12:
            trainer.optimizers[0].state.clear()


class ReloadOptimizer(Callback):
    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if batch_idx == 12:
            optimizer = trainer.optimizers[0]
            state = optimizer.state_dict()
            for entry in state["state"].values():
                entry["momentum_buffer"] = entry["momentum_buffer"] * 0  # a restore that changes values
            optimizer.load_state_dict(state)


class ReplaceOneEntry(Callback):
    """One parameter's state replaced by a new dict (a per-layer momentum reset)."""

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if batch_idx == 12:
            optimizer = trainer.optimizers[0]
            p = next(pl_module.parameters())
            optimizer.state[p] = {"momentum_buffer": torch.zeros_like(p)}


class ReplaceOneTensor(Callback):
    """One tensor in one parameter's state replaced (not updated in place)."""

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if batch_idx == 12:
            optimizer = trainer.optimizers[0]
            p = list(pl_module.parameters())[-1]
            optimizer.state[p]["momentum_buffer"] = optimizer.state[p]["momentum_buffer"] * 0.5


class MoveOneTensor(Callback):
    """One tensor in one parameter's state given other memory under the same object (``.data = ...``):
    a graph updates the memory it was captured with."""

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if batch_idx == 12:
            optimizer = trainer.optimizers[0]
            p = list(pl_module.parameters())[-1]
            buffer = optimizer.state[p]["momentum_buffer"]
            buffer.data = buffer * 0.5


@pytest.mark.parametrize(
    "extra",
    [ResetMomentum, ReloadOptimizer, ReplaceOneEntry, ReplaceOneTensor, MoveOneTensor],
    ids=["state-cleared", "state-reloaded", "one-entry-replaced", "one-tensor-replaced", "one-tensor-moved"],
)
def test_optimizer_state_replaced_between_steps_is_made_eagerly_then_captured_again(extra):
    plain = fit(MomentumRegressor, [extra()])
    cb = callback()
    run = fit(MomentumRegressor, [extra(), cb])
    summary = cb.summary()
    assert summary["captured"] and summary["captures"] == 2 and summary["fallback_steps"] == 1, summary
    assert_same(plain, run)


class SwapOptimizerAtStep12(Callback):
    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_step == 12:
            trainer.strategy.optimizers = [torch.optim.SGD(pl_module.parameters(), lr=0.01)]


def test_an_optimizer_swapped_in_during_the_fit_trains_eagerly_and_says_why():
    plain = fit(MomentumRegressor, [SwapOptimizerAtStep12()])
    cb = callback()
    with pytest.warns(UserWarning, match=r"the Trainer's optimizer was replaced during the fit"):
        run = fit(MomentumRegressor, [SwapOptimizerAtStep12(), cb])
    assert_same(plain, run)


class ProjectsWeightsByRebinding(MomentumRegressor):
    """Weights projected after the optimizer step by assigning `.data` (older WGAN-style code)."""

    def on_train_batch_end(self, outputs, batch, batch_idx):
        if batch_idx in (9, 19):
            for p in self.parameters():
                p.data = p.data.clamp(-0.05, 0.05)  # new storage under the same Parameter


class ScaledByBuffer(MomentumRegressor):
    """A buffer the step reads, its data replaced between steps through `.data` (new storage)."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self.register_buffer("scale", torch.ones(()))

    def training_step(self, batch, batch_idx):
        return super().training_step(batch, batch_idx) * self.scale

    def on_train_batch_end(self, outputs, batch, batch_idx):
        if batch_idx == 9:
            self.scale.data = self.scale.data * 0.5


def test_buffer_data_assigned_between_steps_is_captured_again_and_named():
    plain = fit(ScaledByBuffer)
    cb = callback()
    with pytest.warns(UserWarning, match=r"buffers' data moved since capture \(scale: `tensor.data = ...`"):
        run = fit(ScaledByBuffer, [cb])
    assert cb.summary()["captured"] and cb.summary()["captures"] == 2, cb.summary()
    assert_same(plain, run)


# Module-level values a step reads: a number, a flag in a branch, a tensor (set by the tests below)
LOSS_WEIGHT = 1.0
USE_AUX = False
OFFSET = torch.zeros(())
CONFIG = {"aux_weight": 0.0, "name": "run"}


class Settings:
    """A config object of the user's own class, held at module level."""

    def __init__(self, scale):
        self.scale = scale


def plain_penalty(w):
    return w.square().mean()


def abs_penalty(w):
    return w.abs().mean()


SETTINGS = Settings(1.0)
PENALTY = plain_penalty
SCALES = {"w": torch.ones(())}


class ReadsModuleGlobals(MomentumRegressor):
    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx) * LOSS_WEIGHT * SETTINGS.scale
        if USE_AUX:
            loss = loss + self.head.weight.square().mean()
        loss = loss + CONFIG["aux_weight"] * self.head.bias.square().sum()
        return (loss + OFFSET + 0.01 * PENALTY(self.head.weight)) * SCALES["w"]


class ChangesAGlobal(Callback):
    def __init__(self, name, value):
        self.name, self.value = name, value

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if batch_idx == 10:
            if isinstance(self.value, dict):
                globals()[self.name].update(self.value)  # entries changed in place
            elif "." in self.name:  # an attribute of a module-level object
                holder, attribute = self.name.split(".")
                setattr(globals()[holder], attribute, self.value)
            else:
                globals()[self.name] = self.value


@pytest.mark.parametrize(
    "name, value",
    [
        ("LOSS_WEIGHT", 0.5),
        ("USE_AUX", True),
        ("OFFSET", torch.full((), 0.25)),
        ("CONFIG", {"aux_weight": 0.1}),
        ("SETTINGS.scale", 0.5),
        ("PENALTY", abs_penalty),
        ("SCALES", {"w": torch.full((), 0.5)}),
    ],
    ids=[
        "number",
        "flag",
        "tensor-rebound",
        "dict-entry",
        "object-attribute",
        "function",
        "dict-tensor-entry",
    ],
)
def test_a_module_global_the_step_reads_changed_between_steps_is_captured_again(name, value, monkeypatch):
    """The object attribute and the function were once silently kept at their capture-time values."""

    def defaults():
        return {
            "LOSS_WEIGHT": 1.0,
            "USE_AUX": False,
            "OFFSET": torch.zeros(()),
            "CONFIG": {"aux_weight": 0.0, "name": "run"},
            "SETTINGS": Settings(1.0),
            "PENALTY": plain_penalty,
            "SCALES": {"w": torch.ones(())},
        }

    for key, default in defaults().items():
        monkeypatch.setitem(globals(), key, default)
    plain = fit(ReadsModuleGlobals, [ChangesAGlobal(name, value)])
    globals().update(defaults())
    cb = callback(operand_scalars=False)  # baked in (the number, a tensor operand, is otherwise served)
    with pytest.warns(UserWarning, match=rf"capturing the step again: .*{name.split('.')[-1]}"):
        run = fit(ReadsModuleGlobals, [ChangesAGlobal(name, value), cb])
    assert cb.summary()["captured"] and cb.summary()["captures"] == 2, cb.summary()
    assert_same(plain, run)


def make_closure_module(weights):
    """A module made in a factory function: its step reads the factory's `weights` dict (a closure
    variable), which the caller changes between steps."""

    class FromFactory(MomentumRegressor):
        def training_step(self, batch, batch_idx):
            return super().training_step(batch, batch_idx) * weights["loss"]

    return FromFactory


class SetsAnEntry(Callback):
    def __init__(self, weights):
        self.weights = weights

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if batch_idx == 10:
            self.weights["loss"] = 0.5


def test_closure_variables_of_a_factory_made_module_are_compared_before_each_replay():
    weights = {"loss": 1.0}
    plain = fit(make_closure_module(weights), [SetsAnEntry(weights)])
    weights = {"loss": 1.0}
    cb = callback()
    with pytest.warns(UserWarning, match=r"capturing the step again: .*weights"):
        run = fit(make_closure_module(weights), [SetsAnEntry(weights), cb])
    assert cb.summary()["captures"] == 2, cb.summary()
    assert_same(plain, run)


class CountsInADict(MomentumRegressor):
    """A step that counts in a dict on the module: a replay would not count."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self.stats = {"steps": 0, "tag": "run"}

    def training_step(self, batch, batch_idx):
        self.stats["steps"] += 1
        return super().training_step(batch, batch_idx)


def test_a_step_that_changes_a_dict_of_numbers_on_the_module_is_refused_by_name():
    plain = fit(CountsInADict)
    cb = callback()
    with pytest.warns(UserWarning, match=r"the step changes Python state \(`self.stats`\)"):
        run = fit(CountsInADict, [cb])
    assert not cb.summary()["captured"]
    assert run[0].stats == plain[0].stats == {"steps": 30, "tag": "run"}
    assert_same(plain, run)


HELPER_WEIGHT = 1.0


def weighted(loss):
    """A plain helper function of the user's module: the step calls it, it reads a module global."""
    return loss * HELPER_WEIGHT


class ReadsThroughHelpers(MomentumRegressor):
    def training_step(self, batch, batch_idx):
        return weighted(super().training_step(batch, batch_idx)) * user_step_config.LOSS_W


class SetsAValue(Callback):
    def __init__(self, namespace, name, value):
        self.namespace, self.name, self.value = namespace, name, value

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if batch_idx == 10:
            self.namespace[self.name] = self.value


@pytest.mark.parametrize(
    "where, name",
    [("here", "HELPER_WEIGHT"), ("config", "LOSS_W")],
    ids=["global-read-by-a-helper-function", "attribute-of-an-imported-module"],
)
def test_values_read_through_helper_functions_and_imported_modules_are_followed(where, name, monkeypatch):
    namespace = globals() if where == "here" else vars(user_step_config)
    monkeypatch.setitem(namespace, name, 1.0)
    plain = fit(ReadsThroughHelpers, [SetsAValue(namespace, name, 0.5)])
    namespace[name] = 1.0
    cb = callback()
    with pytest.warns(UserWarning, match=rf"capturing the step again: .*{name}"):
        run = fit(ReadsThroughHelpers, [SetsAValue(namespace, name, 0.5), cb])
    assert cb.summary()["captures"] == 2, cb.summary()
    assert_same(plain, run)


STEPS_SEEN = 0


class CountsInAGlobal(MomentumRegressor):
    def training_step(self, batch, batch_idx):
        global STEPS_SEEN
        STEPS_SEEN += 1
        return super().training_step(batch, batch_idx)


def test_a_step_that_assigns_a_module_global_trains_eagerly_and_names_it(monkeypatch):
    monkeypatch.setitem(globals(), "STEPS_SEEN", 0)
    plain = fit(CountsInAGlobal)
    seen_plain = STEPS_SEEN
    globals()["STEPS_SEEN"] = 0
    cb = callback()
    with pytest.warns(
        UserWarning,
        match=r"the step assigns module-level or closure names \(`STEPS_SEEN` at .*STEPS_SEEN \+= 1",
    ):
        run = fit(CountsInAGlobal, [cb])
    assert not cb.summary()["captured"]
    assert STEPS_SEEN == seen_plain == 30
    assert_same(plain, run)


def test_only_the_users_own_functions_and_modules_are_followed():
    import os

    import l2lightning.capture
    from l2lightning.step_source import _is_user_code

    assert _is_user_code(weighted) and _is_user_code(user_step_config)
    assert not _is_user_code(torch.nn.functional.relu)  # an installed package
    assert not _is_user_code(os.path.join)  # the standard library
    assert not _is_user_code(l2lightning.capture.flatten_batch)  # the callback's own code
    assert not _is_user_code(len)  # no source file


def make_counting_module():
    """A factory-made module whose step counts in a closure variable (`nonlocal`)."""
    steps = 0

    class CountsInAClosure(MomentumRegressor):
        def training_step(self, batch, batch_idx):
            nonlocal steps
            steps += 1
            return super().training_step(batch, batch_idx)

    return CountsInAClosure


def test_a_step_that_assigns_a_closure_variable_trains_eagerly_and_names_it():
    cb = callback()
    with pytest.warns(UserWarning, match=r"closure names \(`steps` at .*steps \+= 1"):
        fit(make_counting_module(), [cb])
    assert not cb.summary()["captured"]


def test_the_names_a_function_reads_from_outside_it():
    import ast
    import textwrap

    from l2lightning.step_source import _free_names

    source = textwrap.dedent(
        """
        def step(self, batch, batch_idx, *rest, scale=1.0, **extra):
            import math
            from os import path as p
            x, y = batch
            total = [v * FACTOR for v in rest if v > LIMIT]
            def inner(z):
                return z + HIDDEN_IN_INNER
            for i in range(3):
                x = x + i
            try:
                pass
            except ValueError as err:
                print(err)
            global COUNTER
            COUNTER = 1
            return torch.relu(x * WEIGHT + math.pi) + inner(y) + len(total) + p.sep
        """
    )
    names = _free_names(ast.parse(source).body[0])
    assert names == {
        "FACTOR", "LIMIT", "HIDDEN_IN_INNER", "range", "print", "ValueError", "COUNTER", "torch", "WEIGHT", "len"
    }  # fmt: skip


def test_parameter_data_assigned_between_steps_is_captured_again():
    plain = fit(ProjectsWeightsByRebinding)
    cb = callback()
    with pytest.warns(UserWarning, match=r"parameters' or buffers' data moved since capture \(net"):
        run = fit(ProjectsWeightsByRebinding, [cb])
    assert cb.summary()["captured"] and cb.summary()["captures"] == 3, cb.summary()
    assert_same(plain, run)


class WeightFromHparams(MomentumRegressor):
    """Loss weights read through containers on self, changed in place between steps."""

    def __init__(self, where="hparams", **kw):
        super().__init__(**kw)
        self.save_hyperparameters({"w": 1.0})
        self.weights = [1.0, 1.0]
        self.cfg = {"w": 1.0}
        self.where = where

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = (self.head(self.net(x)).squeeze(-1) - y).square().mean()
        if self.where == "hparams":
            return loss * self.hparams.w
        if self.where == "list":
            return loss * self.weights[0]
        return loss * self.cfg["w"]

    def on_train_batch_end(self, outputs, batch, batch_idx):
        if batch_idx == 12:
            self.hparams.w = 0.5
            self.weights[0] = 0.5
            self.cfg["w"] = 0.5


@pytest.mark.parametrize("where", ["hparams", "list", "dict"])
def test_a_number_read_through_a_container_on_self_and_changed_in_place_is_captured_again(where):
    plain = fit(WeightFromHparams, where=where)
    cb = callback()
    with pytest.warns(UserWarning, match=r"values the step reads changed"):
        run = fit(WeightFromHparams, [cb], where=where)
    assert cb.summary()["captured"] and cb.summary()["captures"] == 2, cb.summary()
    assert_same(plain, run)


class ParameterNormBeforeStep(MomentumRegressor):
    """on_before_optimizer_step logs gradient norms (host numbers) and a parameter's norm."""

    def on_before_optimizer_step(self, optimizer):
        self.log_dict(grad_norm(self.head, norm_type=2))
        self.log("head_weight_norm", float(self.head.weight.norm()))  # before this step's update


class MomentumNormBeforeStep(MomentumRegressor):
    """on_before_optimizer_step logs gradient norms and the momentum buffer's norm (the optimizer's state)."""

    def on_before_optimizer_step(self, optimizer):
        self.log_dict(grad_norm(self.head, norm_type=2))
        state = optimizer.state.get(self.head.weight, {})
        if "momentum_buffer" in state:
            self.log("head_momentum_norm", float(state["momentum_buffer"].norm()))


@pytest.mark.parametrize("model_cls", [ParameterNormBeforeStep, MomentumNormBeforeStep])
def test_a_hook_that_reads_parameters_is_not_run_after_the_replay(model_cls):
    # After a replay the parameters and the optimizer's state hold the step's update: the hook would
    # log the next step's values
    plain = fit(model_cls)
    cb = callback()
    with pytest.warns(UserWarning, match=r"reads parameters"):
        run = fit(model_cls, [cb])
    assert not cb.summary()["captured"]
    assert_same(plain, run)  # the logged norms included


# --------------------------------------------------------------------------- Python state a replay would freeze
class HelperTargetSync(TargetSync):
    """The target-network sync in a helper method, with the step counter or batch_idx passed on."""

    def sync_every(self, i):
        if i % 10 == 0:
            self.target.load_state_dict(self.head.state_dict())

    def maybe_sync(self):
        if self.global_step % 10 == 5:
            self.target.load_state_dict(self.head.state_dict())

    def training_step(self, batch, batch_idx):
        x, y = batch
        self.sync_every(batch_idx)
        self.maybe_sync()
        h = self.net(x)
        return (self.head(h).squeeze(-1) - self.target(h).squeeze(-1) - y).square().mean()


def test_step_counter_branches_in_helper_methods_run_their_steps_eagerly():
    base, run, cb = captured_pair(HelperTargetSync, n=400)  # one epoch: batch_idx == global_step
    s = cb.summary()
    assert s["captured"] and s["fallback_steps"] == 5, s  # steps 5, 10, 15, 20, 25
    assert_same(base, run)


class LastBatchSync(TargetSync):
    def training_step(self, batch, batch_idx):
        x, y = batch
        if self.trainer.is_last_batch:
            self.target.load_state_dict(self.head.state_dict())
        h = self.net(x)
        return (self.head(h).squeeze(-1) - self.target(h).squeeze(-1) - y).square().mean()


class ClipFromStepTen(TinyMLP):
    """Gradient clipping switched on by a step-counter branch in configure_gradient_clipping."""

    def configure_gradient_clipping(self, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None):
        if self.global_step >= 10:
            self.clip_gradients(optimizer, gradient_clip_val=0.01, gradient_clip_algorithm="norm")


@pytest.mark.parametrize(
    ("cls", "eager", "captures"),
    [(LastBatchSync, 3, 1), (ClipFromStepTen, 3, 2)],
    ids=["is_last_batch", "clipping-hook"],
)
def test_branches_on_the_last_batch_and_in_the_clipping_hook_run_their_steps_eagerly(cls, eager, captures):
    base, run, cb = captured_pair(cls, steps=-1, n=96, trainer_kwargs={"max_epochs": 3})
    s = cb.summary()
    # the last batch of each epoch (periodic: one graph); steps 10-12, after which the branch that
    # stayed switched is captured in place of the first
    assert s["captured"] and s["fallback_steps"] == eager and s["captures"] == captures, s
    assert_same(base, run)


class AuxLossFromEpochOne(TinyMLP):
    """A flag an epoch-start hook sets, read by a branch in training_step."""

    use_aux = False

    def on_train_epoch_start(self):
        self.use_aux = self.current_epoch >= 1

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        if self.use_aux:
            loss = loss + 0.1 * self.head.weight.square().sum()
        return loss


def test_a_branch_on_a_flag_set_outside_the_step_follows_the_flag():
    base, run, cb = captured_pair(AuxLossFromEpochOne, steps=-1, n=96, trainer_kwargs={"max_epochs": 3})
    s = cb.summary()
    # epochs 1 and 2 take the other branch: its first three steps eagerly, then a graph of its own
    assert s["captured"] and s["fallback_steps"] == 3 and s["captures"] == 2, s
    assert_same(base, run)


class OwnCounterSync(TargetSync):
    """A sync every 10 of the module's own Python-counted steps: no step counter to read."""

    def training_step(self, batch, batch_idx):
        x, y = batch
        self.calls = getattr(self, "calls", 0) + 1
        if self.calls % 10 == 1:
            self.target.load_state_dict(self.head.state_dict())
        h = self.net(x)
        return (self.head(h).squeeze(-1) - self.target(h).squeeze(-1) - y).square().mean()


class KeepsOutputs(TinyMLP):
    """Lightning 2.0's migration advice: training_step appends to a list that on_train_epoch_end reads."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self.training_step_outputs = []

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        self.training_step_outputs.append({"loss": loss.detach(), "n": 1})
        return loss

    def on_train_epoch_end(self):
        losses = torch.stack([o["loss"] for o in self.training_step_outputs])
        self.log("epoch_mean", losses.mean())
        self.log("epoch_count", float(len(self.training_step_outputs)))
        self.training_step_outputs = []  # a new list: the callback must follow the attribute


class KeepsTwoOutputs(KeepsOutputs):
    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        self.training_step_outputs.append({"loss": loss.detach() * 2, "n": -1})
        return loss


@pytest.mark.parametrize("verify", [False, True])
def test_a_list_the_step_appends_to_gets_a_fresh_element_per_replay(monkeypatch, verify):
    from l2lightning import callback as callback_module

    def dry_run_hooks(self, pl_module):  # what finding the prefetch chain does: one more training_step
        logging = pl_module.log
        pl_module.log = lambda *a, **k: None  # as the real dry run, which must not log
        try:
            with torch.no_grad():
                self._originals["training_step"](self._static_for_prefetch.batch, 0)
        finally:
            pl_module.log = logging
        return None

    monkeypatch.setattr(callback_module.L2GraphCallback, "_prefetch_hooks", dry_run_hooks)
    base = fit(baseline_of(KeepsOutputs), steps=-1, n=96, trainer_kwargs={"max_epochs": 3})
    cb = L2GraphCallback(prefetch="default", verify=verify, log_timing=False)
    run = fit(KeepsOutputs, [cb], steps=-1, n=96, trainer_kwargs={"max_epochs": 3})
    assert cb.summary()["captured"] and cb.fallback_steps == 0
    assert_same(base, run)  # epoch_mean and epoch_count at every step after each epoch end
    assert run[1].logged[-1]["epoch_count"] == 12.0


class KeepsStepNumbers(TinyMLP):
    """Appends the step's batch_idx with its loss: a replayed element would repeat the capture's number."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self.outputs = []

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        self.outputs.append({"loss": loss.detach(), "n": batch_idx})
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)  # capturable or not, the same bits


def test_a_step_number_in_an_appended_element_is_not_replayed_frozen():
    plain = fit(KeepsStepNumbers)
    cb = callback()
    with pytest.warns(UserWarning, match=r"numbers the step computes from the step counters changed"):
        run = fit(KeepsStepNumbers, [cb])
    assert_same(plain, run)
    assert [o["n"] for o in run[0].outputs] == [o["n"] for o in plain[0].outputs] == list(range(30))


class PythonRandomBranch(TinyMLP):
    """An epsilon-greedy style branch on Python's global random generator."""

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        import random

        return loss * 2 if random.random() < 0.5 else loss


class HeldGeneratorRareBranch(TinyMLP):
    """A branch taken on 10% of steps, drawn from a generator the module holds (a replay runs no Python:
    all three warm-up steps here miss the branch, so their traces agree, and the replays never took it)."""

    def __init__(self, kind="random", **kw):
        import random

        super().__init__(**kw)
        self.rng = random.Random(3) if kind == "random" else np.random.default_rng(3)

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        return loss * 2 if self.rng.random() < 0.1 else loss


class RebindsRunningMean(TinyMLP):
    """A running baseline bound anew each step (REINFORCE style): carried state, which a replay hands
    on (a graph alone would keep reading the old tensor)."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self.running = torch.zeros(())

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        self.running = 0.9 * self.running + 0.1 * loss.detach()
        return loss + 0.01 * self.running


class RebindsRunningBuffer(RebindsRunningMean):
    def __init__(self, **kw):
        super().__init__(**kw)
        del self.running
        self.register_buffer("running", torch.zeros(()))


def test_a_running_value_rebound_every_step_is_carried_into_each_replay():
    """Refused before (a graph alone keeps reading the capture's tensor): carried state now."""
    cb = callback()
    run = fit(RebindsRunningMean, [cb], steps=40)
    base = fit(baseline_of(RebindsRunningMean), steps=40)
    summary = cb.summary()
    assert summary["captured"] and summary["captures"] == 1 and summary["fallback_steps"] == 0, summary
    assert summary["replay_check"]["mismatches"] == 0, summary
    assert_same(base, run)
    assert torch.equal(run[0].running, base[0].running)


class WeightNormHead(TinyMLP):
    """weight_norm recomputes `head.weight` (a new tensor) in every forward: captured, not refused."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self.head = torch.nn.utils.weight_norm(nn.Linear(32, 1))


def test_a_weight_recomputed_every_forward_is_captured():
    base, run, cb = captured_pair(WeightNormHead)
    assert cb.summary()["captured"] and cb.fallback_steps == 0
    assert_same(base, run)


@pytest.mark.parametrize(
    ("cls", "named"),
    [
        (OwnCounterSync, "`self.calls`"),
        (KeepsTwoOutputs, "`self.training_step_outputs`"),
        (PythonRandomBranch, "Python's global `random` generator"),
        (HeldGeneratorRareBranch, "`self.rng` (a random generator)"),
        (RebindsRunningBuffer, "`self.running`"),
    ],
    ids=[
        "own-counter",
        "two-appends-per-step",
        "python-random",
        "held-generator",
        "rebound-buffer",
    ],
)
def test_python_state_the_step_changes_is_refused_by_name_and_trains_like_plain(cls, named):
    import random

    random.seed(0)
    plain = fit(cls, fused=True)  # fused AdamW: the warm-up steps' capturable updates equal plain ones
    random.seed(0)
    cb = callback()
    with pytest.warns(UserWarning, match=rf"the step changes Python state \({re.escape(named)}\)"):
        run = fit(cls, [cb], fused=True)
    assert not cb.summary()["captured"]
    assert_same(plain, run)


class LazyFlag(TinyMLP):
    """Builds something once at the first step (an `initialized` flag): allowed."""

    initialized = False

    def training_step(self, batch, batch_idx):
        if not self.initialized:
            self.initialized = True
        return super().training_step(batch, batch_idx)


def test_python_state_set_once_at_the_first_step_is_allowed():
    base, run, cb = captured_pair(LazyFlag)
    assert cb.summary()["captured"] and cb.fallback_steps == 0
    assert_same(base, run)


@pytest.mark.parametrize(
    "name",
    [
        "dqn_helper_sync",
        "training_step_outputs",
        "aux_loss_flag",
        "own_step_counter",
        "dlrm_adagrad",
        "epoch_weighted_aux",
        "cleanrl_ppo_annealed_entropy",
        "vae_kl_ramp",
        "sgd_cosine_per_epoch",
        "rebound_loss_weight",
        "global_loss_weight",
        "momentum_reset_one_layer",
        "buffer_data_moved",
        "rebound_input",
    ],
)
def test_idiom_variants_are_captured_and_equal_or_refused_and_plain(name):
    from tests.idiom_modules import IDIOM_VARIANTS

    idiom = IDIOM_VARIANTS[name]

    def run(with_callback, baseline):
        seed_everything(0)
        module = idiom.make_module()
        if baseline:
            module.__class__ = baseline_of(type(module))
        rec = Recorder()
        cb = callback() if with_callback else None
        trainer = quiet_trainer(accelerator="cpu", max_epochs=3, callbacks=[rec, *([cb] if cb else [])])
        trainer.fit(module, idiom.make_loader())
        return module, rec, cb, trainer

    got = run(True, False)
    cb = got[2]
    if idiom.expect == "capture":
        reference = run(False, True)
        assert cb.summary()["captured"], cb.summary()
        if name in (
            "sgd_cosine_per_epoch",
            "epoch_weighted_aux",
            "cleanrl_ppo_annealed_entropy",
            "vae_kl_ramp",
        ):
            # three epochs: three LRs read from a tensor, or three loss weights from a device scalar
            assert cb.captures == 1, cb.summary()
        assert_same(reference[:2] + reference[3:], got[:2] + got[3:])
        return
    reference = run(False, False)
    assert not cb.summary()["captured"] and "`self.updates`" in cb.summary()["reason"]
    # Refused: trains like the plain fit. On the CPU this module's GEMMs (64 -> 128 at batch 32) take
    # alignment-dependent MKL paths, so two fits whose allocations differ can differ in the last bits
    # (plain vs plain is bitwise equal; the callback's snapshots shift allocations): compared to
    # rounding here, bit for bit on the GPU (tests/gpu/test_idioms_gpu.py).
    for (name, p), q in zip(reference[0].named_parameters(), got[0].parameters()):
        assert torch.allclose(p, q, rtol=1e-4, atol=1e-6), f"parameter {name} differs"
    assert torch.allclose(torch.stack(reference[1].losses), torch.stack(got[1].losses), rtol=1e-4, atol=0)


class BetaAnnealing(TinyMLP):
    """A VAE-style KL weight (a Python float) raised by on_train_epoch_start and read in the step."""

    beta = 0.0

    def on_train_epoch_start(self):
        self.beta = min(1.0, 0.5 * self.current_epoch)

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        return loss + self.beta * self.head.weight.square().sum()


class DropoutAnnealing(TinyMLP):
    def __init__(self, **kw):
        super().__init__(**kw)
        self.net.insert(0, nn.Dropout(0.5))

    def on_train_epoch_start(self):
        self.net[0].p = 0.5 / (1 + self.current_epoch)


@pytest.mark.parametrize(
    "cls", [BetaAnnealing, DropoutAnnealing], ids=["module-attribute", "submodule-attribute"]
)
def test_python_numbers_the_graph_baked_are_checked_before_each_replay(cls):
    # baked in: without device scalars (which the beta, a tensor operand, would otherwise be read from)
    base, run, cb = captured_pair(
        cls, {"operand_scalars": False}, steps=-1, n=96, trainer_kwargs={"max_epochs": 3}
    )
    s = cb.summary()
    assert s["captured"] and s["captures"] == 3, s  # captured again at each epoch's new value
    assert_same(base, run)


class CountingEMA(nn.Module):
    """An EMA copy with a counter of its own, updated after the step (never called in it)."""

    def __init__(self, model):
        super().__init__()
        self.module = copy.deepcopy(model).requires_grad_(False)
        self.updates = 0

    @torch.no_grad()
    def update(self, model):
        self.updates += 1
        for e, m in zip(self.module.parameters(), model.parameters()):
            e.lerp_(m, 0.01)


class EMAWithCounter(TinyMLP):
    def __init__(self, **kw):
        super().__init__(**kw)
        self.ema = CountingEMA(self.net)

    def on_train_batch_end(self, outputs, batch, batch_idx):
        self.ema.update(self.net)


def test_a_submodule_the_step_does_not_call_may_count_outside_it():
    base, run, cb = captured_pair(EMAWithCounter)
    s = cb.summary()
    assert s["captured"] and s["captures"] == 1 and cb.fallback_steps == 0, s
    assert_same(base, run)


# Every idiom of the benchmark on the CPU stand-in: the checks a replay depends on must not refuse a
# module the GPU captures (tests/gpu/test_idioms_gpu.py compares them bit for bit there). Left out:
# manual_gan (its noise drawn with `torch.randn` without a device: refused on a GPU, where that is the
# host's generator, but captured here, where the CPU is the device: tests/test_idiom_modules.py) and print_item_every_50
# (on the CPU its Adadelta bakes the learning rate, and the stand-in's capture meets the
# every-50-batches `.item()`; captured on the GPU).
_EMULATED_IDIOMS = ("manual_gan", "print_item_every_50")


@pytest.mark.parametrize("name", [n for n in IDIOMS if n not in _EMULATED_IDIOMS])
def test_every_idiom_gets_its_verdict_on_the_cpu_stand_in(name):
    idiom = IDIOMS[name]
    seed_everything(0)
    module = idiom.make_module()
    cb = callback()
    settings = {**idiom.trainer_kwargs, "max_steps": 40}
    trainer = quiet_trainer(accelerator="cpu", callbacks=[cb], **settings)
    # (the emulator runs CPU LSTMs without oneDNN, as eager steps and baselines do: graph_emulator.install)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(module, idiom.make_loader())
    summary = cb.summary()
    if idiom.expect == "capture":
        assert summary["captured"] and summary["reason"] is None, summary["reason"]
    else:
        assert not summary["captured"] and summary["reason"], summary


class FunctionalLoss(TinyMLP):
    """TinyMLP whose loss is `F.mse_loss`: the step reads a module global (`F`, a Python module object)."""

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.mse_loss(self.head(self.net(x)).squeeze(-1), y)
        self.log("train/loss", loss)
        return loss


@pytest.mark.parametrize("ours_first", [False, True], ids=["theirs-first", "graph-callback-first"])
@pytest.mark.parametrize("which", ["swa", "lr_finder"])
def test_lightning_callbacks_that_make_a_scheduler_mid_fit_train_like_the_baseline(which, ours_first):
    """StochasticWeightAveraging (SWALR at its first epoch) and LearningRateFinder (its own scheduler
    for the search) made their schedulers after the callback had wrapped the optimizer's step: the
    fit crashed (AttributeError: 'function' object has no attribute '__func__'). With the graph
    callback first, SWA's deep copy of the module at the fit's start reached the callback through its
    methods installed on the module and failed (TypeError: cannot pickle 'module' object)."""
    from lightning.pytorch.callbacks import LearningRateFinder, StochasticWeightAveraging

    def made():
        if which == "swa":
            return StochasticWeightAveraging(swa_lrs=1e-3, swa_epoch_start=1)
        return LearningRateFinder(num_training_steps=20, early_stop_threshold=None)

    base = fit(baseline_of(FunctionalLoss), [made()], steps=90, fused=True)
    cb = callback()
    run = fit(FunctionalLoss, [cb, made()] if ours_first else [made(), cb], steps=90, fused=True)
    assert cb.summary()["captured"], cb.summary()
    assert_same(base, run)


def test_a_logged_closure_variable_of_a_factory_made_module_is_evaluated_per_replay():
    """`self.log("closure_weight", settings.loss_weight)` in a module made in a factory function: silent
    before (the replays logged the capture's value after the callback changed it)."""

    def set_weight(module, value):
        type(module).config.loss_weight = value

    base = fit(baseline_of(LogsAClosure), [SetsTheConfigEachEpoch(set_weight)], steps=90)
    cb = callback()
    run = fit(LogsAClosure, [SetsTheConfigEachEpoch(set_weight), cb], steps=90)
    assert cb.summary()["captured"] and cb.summary()["captures"] == 1, cb.summary()
    assert_same(base, run)
    assert [float(run[1].logged[i]["closure_weight"]) for i in (29, 30, 60)] == [1.0, 2.0, 3.0]


class ValidatedTinyMLP(TinyMLP):
    """TinyMLP with a validation loop of its own (3 batches)."""

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val/loss", (self.head(self.net(x)).squeeze(-1) - y).square().mean())

    def val_dataloader(self):
        return regression_loader(n=24, width=32)


@pytest.mark.parametrize("ema_first", [True, False], ids=["ema-first", "graph-callback-first"])
def test_lightnings_ema_weight_averaging_with_validation_swaps_trains_like_the_baseline(ema_first):
    """Lightning's EMAWeightAveraging (2.5+) deep-copies the module at setup, updates the average after
    every batch, swaps the weights in place around each validation and copies the average in at the
    end: in either callback order the fit, its validations and its final weights equal the baseline's."""
    from lightning.pytorch.callbacks import EMAWeightAveraging

    settings = {"limit_val_batches": 3, "val_check_interval": 30, "num_sanity_val_steps": 0}

    def callbacks(graph=None):
        ema = EMAWeightAveraging(decay=0.9)
        if graph is None:
            return [ema]
        return [ema, graph] if ema_first else [graph, ema]

    base = fit(baseline_of(ValidatedTinyMLP), callbacks(), steps=90, fused=True, trainer_kwargs=settings)
    cb = callback()
    run = fit(ValidatedTinyMLP, callbacks(cb), steps=90, fused=True, trainer_kwargs=settings)
    summary = cb.summary()
    assert summary["captured"] and summary["captures"] == 1 and summary["fallback_steps"] == 0, summary
    assert_same(base, run)
    assert base[2].callback_metrics["val/loss"] == run[2].callback_metrics["val/loss"]


def test_a_host_tensor_the_graph_read_changed_in_place_captures_the_step_again():
    """On the GPU a capture notes the host tensors its device ops read (a 0-d CPU tensor is a number in
    a kernel's arguments); on the CPU stand-in every tensor is the device's, so the note is made here as
    a GPU capture would make it, and an epoch hook's in-place change must bring a new capture."""
    from l2lightning.step_trace import HostRead

    temperature = torch.tensor(1.0)

    class NotesAndAnneals(Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            graph = cb._graph
            if graph is not None and not graph.host_reads:
                graph.host_reads.append(HostRead(temperature, temperature.clone(), ("model.py", 7)))

        def on_train_epoch_end(self, trainer, pl_module):
            temperature.mul_(0.5)

    cb = callback()
    with pytest.warns(
        UserWarning,
        match=r"capturing the step again: host tensors the step reads changed in place since capture "
        r"\(read at model.py:7; the graph holds the values it read then\)",
    ):
        fit(TinyMLP, [NotesAndAnneals(), cb], steps=90)
    assert cb.summary()["captured"] and cb.summary()["captures"] == 3, cb.summary()


def test_a_numerics_setting_changed_mid_fit_captures_the_step_again_naming_it():
    found = torch.backends.cuda.matmul.allow_tf32
    try:
        assert_captured_again_like_baseline(
            TinyMLP,
            r"capturing the step again: torch's numerics settings changed since capture "
            r"\(.*torch.backends.cuda.matmul.allow_tf32: False -> True; .*the graph holds the kernels",
            callbacks=[TF32FromEpochOne()],
        )
    finally:
        torch.backends.cuda.matmul.allow_tf32 = found


def test_anomaly_detection_turned_on_mid_fit_is_not_replayed_past():
    """Its host NaN checks cannot be in a graph: the step is captured again at epoch 1, that capture
    fails on the check's sync, and the fit trains on eagerly with anomaly detection working. Up to the
    switch the fit is its baseline bit for bit; after it the optimizer runs as configured again
    (README: a refusal at a capture), so only the first epoch is compared."""
    base = fit(baseline_of(TinyMLP), [AnomalyDetectionFromEpochOne()], steps=60)
    cb = callback()
    with pytest.warns(UserWarning, match=r"torch.autograd.set_detect_anomaly: False -> True"):
        run = fit(TinyMLP, [AnomalyDetectionFromEpochOne(), cb], steps=60)
    assert not torch.is_anomaly_enabled()
    summary = cb.summary()
    assert summary["captures"] == 1, summary  # the first capture only: the second failed
    assert "could not be captured" in summary["reason"], summary
    assert len(run[1].losses) == 60
    for step in range(30):
        assert torch.equal(base[1].losses[step], run[1].losses[step]), f"loss differs at step {step}"


@pytest.mark.skipif(
    not hasattr(torch.backends.cuda.matmul, "fp32_precision"),
    reason="torch < 2.9 has no per-backend precision API",
)
def test_a_fit_with_the_per_backend_precision_api_set_is_captured():
    """With `fp32_precision` set directly, torch's legacy precision getters raise; the settings the
    callback compares before each replay must still be read (they raised at the capture before)."""
    previous = torch.get_float32_matmul_precision()
    try:
        torch.backends.cuda.matmul.fp32_precision = "tf32"
        with pytest.raises(RuntimeError):
            torch.get_float32_matmul_precision()  # the state this test is about
        cb = callback()
        fit(TinyMLP, [cb], steps=8)
    finally:
        torch.set_float32_matmul_precision(previous)  # the legacy API readable again
    assert cb.summary()["captured"] and cb.summary()["fallback_steps"] == 0, cb.summary()


@pytest.mark.parametrize("backend", ["eager", "inductor"])
@pytest.mark.parametrize("how", ["compile=True", "a submodule the user compiled"])
def test_compiled_code_is_compiled_under_the_callback(monkeypatch, request, how, backend):
    """Until f94d068 dynamo ran compiled code eagerly under the warm-up tracer (a TorchDispatchMode),
    so neither compile=True's children nor a submodule the user compiled got a compiled graph.
    Inductor also generates the backward's code lazily, at the first backward, inside a put-back of
    the random generators' states that the seeding check took for the step's own seeding until
    the put-back's context manager was exempt (on the H200 compile=True then trained eagerly)."""
    import functools

    from torch._dynamo.utils import counters

    if backend == "eager":  # dynamo's own backend: compiled frames without code generation
        monkeypatch.setattr(torch, "compile", functools.partial(torch.compile, backend="eager"))
    else:  # code generated in this fit, not loaded from inductor's caches of an earlier run
        from torch._inductor import config as inductor_config

        patch = inductor_config.patch(force_disable_caches=True)
        patch.__enter__()
        request.addfinalizer(lambda: patch.__exit__(None, None, None))

    def compiled(cls):
        seed_everything(0)  # as fit() seeds before it builds the model
        model = cls(width=32, depth=3)
        model.net = torch.compile(model.net)
        return model

    torch._dynamo.reset()
    counters.clear()
    if how == "compile=True":
        cb = callback(compile=True)
        fit(TinyMLP, [cb], steps=8)
    else:
        cb = callback()
        run = fit(TinyMLP, [cb], steps=8, model=compiled(TinyMLP))
    assert cb.summary()["captured"], cb.summary()
    assert counters["stats"]["unique_graphs"] >= 1
    # the baseline compiles the same submodule; inductor's CPU kernels bypass the dispatcher, so the
    # emulator's replays skip them (the GPU test compares those)
    if how != "compile=True" and backend == "eager":
        torch._dynamo.reset()
        assert_same(fit(baseline_of(TinyMLP), steps=8, model=compiled(baseline_of(TinyMLP))), run)
    torch._dynamo.reset()


def test_binary_metrics_on_logits_are_refused_on_the_cpu_naming_the_metric_call_and_train_like_plain():
    """On the CPU torchmetrics 1.9 decides whether binary predictions are logits with a host test
    (``normalize_logits_if_needed``; on a GPU with ``torch.where``, captured in
    tests/gpu/test_idioms_gpu.py): the traced step names the metric's call and trains eagerly."""
    from tests.idiom_modules import IDIOM_VARIANTS

    idiom = IDIOM_VARIANTS["binary_metrics_on_logits"]

    def run(cb):
        seed_everything(0)
        module = idiom.make_module()
        rec = Recorder()
        trainer = quiet_trainer(accelerator="cpu", max_steps=30, callbacks=[rec, *([cb] if cb else [])])
        trainer.fit(module, idiom.make_loader())
        return module, rec, trainer

    plain = run(None)
    cb = callback()
    with pytest.warns(UserWarning, match=r"makes the host wait"):
        got = run(cb)
    assert not cb.summary()["captured"], cb.summary()
    assert "`self.train_acc(logits, y)`" in cb.summary()["reason"], cb.summary()["reason"]
    assert_same(plain, got)


@pytest.mark.parametrize("cls", [HalvesItsLossAfterAWhile, AsksAHelperForTheTime])
def test_a_step_branching_on_the_host_clock_is_refused_by_name_and_trains_like_plain(cls):
    """A branch on ``time.monotonic()`` (here after 0.3 s of a fit that lasts longer) was captured with
    the capture step's branch: the replays never halved the loss, silently, on the CPU emulator."""
    import time

    from tests.between_step_models import TRAINING_STARTED

    def timed_fit(callbacks):
        TRAINING_STARTED[0] = time.monotonic()
        return fit(cls, callbacks, steps=30, fused=True)

    cb = callback()
    with pytest.warns(UserWarning, match=r"the step reads the host clock \(.*between_step_models\.py"):
        run = timed_fit([cb])
    assert not cb.summary()["captured"], cb.summary()
    assert "a replayed graph would keep the capture step's reading" in cb.summary()["reason"]
    # the clock decides which steps halve: refused, the fit is eager, and a fit in which no step halves
    # (the branch never taken) is bitwise plain's
    cls.seconds, was = 1e9, cls.seconds
    try:
        plain = timed_fit([])
        cb = callback()
        with pytest.warns(UserWarning, match=r"the step reads the host clock"):
            run = timed_fit([cb])
    finally:
        cls.seconds = was
    assert_same(plain, run)


def test_a_clock_read_only_for_a_logged_throughput_is_not_refused_as_a_clock_read():
    from tests.between_step_models import LogsItsThroughput

    cb = callback()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        fit(LogsItsThroughput, [cb], steps=12)
    assert "host clock" not in (cb.summary()["reason"] or ""), cb.summary()["reason"]


# --------------------------------------------------------------------------- Adagrad


def test_adagrad_is_captured_and_bitwise_the_plain_fit():
    """Its switched step changes no number (l2lightning.optim._adagrad_step_count_unread): the fit with
    the callback equals the plain fit itself, not only a make_capturable baseline."""
    plain = fit(AdagradMLP, steps=30)
    cb = callback()
    run = fit(AdagradMLP, [cb], steps=30)
    summary = cb.summary()
    assert summary["captured"] and summary["fallback_steps"] == 0 and summary["reason"] is None, summary
    assert_same(plain, run)


def test_adagrad_with_a_decaying_lr_trains_eagerly_naming_lr_decay_and_like_plain():
    assert_refused_like_plain(DecayingAdagradMLP, r"Adagrad with `lr_decay` != 0")


def test_a_traced_step_does_not_keep_the_last_steps_gradients_alive_through_its_backward():
    """Lightning's zero_grad drops the last step's gradients before backward; the traced warm-up step
    must not hold them (a whole set of gradients more than plain training: out of memory on the H100
    with 4% to spare, tests/gpu/test_oom_gpu.py)."""

    class LastGradients(Callback):
        def __init__(self):
            self.refs, self.alive_in_backward = [], []

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            self.refs = [weakref.ref(p.grad) for p in pl_module.parameters() if p.grad is not None]

        def on_after_backward(self, trainer, pl_module):
            if self.refs:
                self.alive_in_backward.append(sum(r() is not None for r in self.refs))

    probe = LastGradients()
    cb = callback()
    fit(TinyMLP, [cb, probe], steps=3)
    assert probe.alive_in_backward and not any(probe.alive_in_backward), probe.alive_in_backward
