"""What a step reads of its module through another name than ``self``, and what it logs with ``log_dict``.

A replay runs no Python: a number the step reads from the module is baked into the graph, and the
callback compares the module's attributes the step's source reads before each replay. A read through
an alias of ``self`` (a loss function of the user's given the module, a lambda or a dict of bound
methods kept in an attribute, ``getattr(self, f"_{name}_loss")``) once went unseen: an attribute an
epoch hook lowered kept its capture-time value in every replay, silently. A Python number logged with
``self.log_dict({...})`` once kept its capture-time value in every replay's log the same way.
"""

from __future__ import annotations

import functools
import logging
import types
from types import SimpleNamespace

import pytest
from lightning.pytorch import Callback

from l2lightning.guards.called_code import analyse_called_code
from l2lightning.guards.step_source import StepSource, analyse, analyse_callbacks
from tests import graph_emulator as emu
from tests.baselines import (  # noqa: F401 -- the fixture records each callback fit's switch step
    baseline_of,
    capturable_from_of_the_last_callback_fit,
)
from tests.lightning_models import TinyMLP
from tests.replay_helpers import assert_same, callback, fit

pytestmark = pytest.mark.usefixtures("emulated_cuda_graphs")

_log = logging.getLogger(__name__)
SWITCH_STEP = 13  # the global step at which the module's number changes (not a sampled replay check's)


def regularized(model, pred, y):
    """A loss function of the user's own code, given the module: reads ``model.aux_weight``."""
    return (pred - y).square().mean() + model.aux_weight * pred.abs().mean()


def regularized_by_keyword(pred, y, *, model):
    return (pred - y).square().mean() + model.aux_weight * pred.abs().mean()


# the same function reached as an attribute of a module (``userlosses.regularized(self, ...)``), and
# held by a config object (``CFG.loss_fn(self, ...)``)
LOSSES = types.ModuleType("user_losses")
LOSSES.regularized = regularized
CFG = SimpleNamespace(loss_fn=regularized)


class _AuxSwitch(TinyMLP):
    """An auxiliary loss weight an epoch-style hook lowers once, at global step 13, and a counter its
    batch-end hook moves at every step, which the step never reads (it must not capture every step)."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self.aux_weight = 1.0
        self.loss_name = "mse"
        self.seen = 0

    def on_train_batch_start(self, batch, batch_idx):
        if self.global_step == SWITCH_STEP:
            self.aux_weight = 0.1

    def on_train_batch_end(self, outputs, batch, batch_idx):
        self.seen += 1

    def predict(self, x):
        return self.head(self.net(x)).squeeze(-1)

    def _mse_loss(self, pred, y):
        return (pred - y).square().mean() + self.aux_weight * pred.abs().mean()


class ByFreeFunction(_AuxSwitch):
    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = regularized(self, self.predict(x), y)
        self.log("train/loss", loss)
        return loss


class ByModuleAttribute(_AuxSwitch):
    def training_step(self, batch, batch_idx):
        x, y = batch
        return LOSSES.regularized(self, self.predict(x), y)


class ByConfigFunction(_AuxSwitch):
    def training_step(self, batch, batch_idx):
        x, y = batch
        return CFG.loss_fn(self, self.predict(x), y)


class ByKeyword(_AuxSwitch):
    def training_step(self, batch, batch_idx):
        x, y = batch
        return regularized_by_keyword(self.predict(x), y, model=self)


class ByLocalAlias(_AuxSwitch):
    def training_step(self, batch, batch_idx):
        x, y = batch
        model = self
        pred = model.predict(x)
        return (pred - y).square().mean() + model.aux_weight * pred.abs().mean()


class ByPartial(_AuxSwitch):
    def training_step(self, batch, batch_idx):
        x, y = batch
        loss_fn = functools.partial(regularized, self)
        return loss_fn(self.predict(x), y)


class ByLambda(_AuxSwitch):
    def __init__(self, **kw):
        super().__init__(**kw)
        self.loss_fn = lambda p, y: (p - y).square().mean() + self.aux_weight * p.abs().mean()

    def training_step(self, batch, batch_idx):
        x, y = batch
        return self.loss_fn(self.predict(x), y)


class ByDictOfMethods(_AuxSwitch):
    def __init__(self, **kw):
        super().__init__(**kw)
        self.loss_fns = {"mse": self._mse_loss}

    def training_step(self, batch, batch_idx):
        x, y = batch
        return self.loss_fns[self.loss_name](self.predict(x), y)


class ByComputedGetattr(_AuxSwitch):
    def training_step(self, batch, batch_idx):
        x, y = batch
        return getattr(self, f"_{self.loss_name}_loss")(self.predict(x), y)


ALIASES = [
    ByFreeFunction,
    ByModuleAttribute,
    ByConfigFunction,
    ByKeyword,
    ByLocalAlias,
    ByPartial,
    ByLambda,
    ByDictOfMethods,
    ByComputedGetattr,
]


# --------------------------------------------------------------------------- the analysis
@pytest.mark.parametrize("cls", ALIASES, ids=lambda c: c.__name__)
def test_an_attribute_read_through_an_alias_of_self_is_among_the_reads_and_compared(cls):
    module = cls(width=4, depth=1)
    found = analyse(module)
    assert "aux_weight" in found.reads, sorted(found.reads)
    assert "seen" not in found.reads  # the hook's counter is no read of the step
    # where it is read through a parameter or a closure variable, the read value is compared too
    snapshot = found.attribute_snapshot(module, 0)
    module.aux_weight = 0.1
    changed = found.changed_attribute_values(snapshot, module, 0)
    assert any("aux_weight" in line for line in changed), changed


def test_a_function_given_the_module_is_read_with_its_parameter_as_the_module():
    class Branches(_AuxSwitch):
        def training_step(self, batch, batch_idx):
            return _late_boost(self, batch)

    found = analyse(Branches(width=4, depth=1))
    # its condition on the module's step counter is the step's branch, evaluated with the module
    (condition,) = [c for c in found.conditions if "model.global_step" in c.line]
    assert condition.evaluate(SimpleNamespace(global_step=3), 0) is False
    assert condition.evaluate(SimpleNamespace(global_step=30), 0) is True
    # the module's methods it calls through its parameter are read as the step's helpers
    assert "aux_weight" in found.reads and "net" in found.reads
    assert found.read_patterns and all(called for _, _, called in found.read_patterns)


def _late_boost(model, batch):
    x, y = batch
    loss = model._mse_loss(model.predict(x), y)
    if model.global_step > 20:
        loss = loss * 2
    return loss


class _HandsSelfAway(_AuxSwitch):
    def __init__(self, how, **kw):
        super().__init__(**kw)
        self.how = how
        self.keep = []

    def training_step(self, batch, batch_idx):
        x, y = batch
        pred = self.predict(x)
        if self.how == "vars":
            w = vars(self)["aux_weight"]
        elif self.how == "getattr":
            w = getattr(self, self.loss_name)
        elif self.how == "dict":
            w = self.__dict__["aux_weight"]
        elif self.how == "container":
            w = [self][0].aux_weight
        else:
            w = self.keep[0](self)  # a callable the source does not name
        return (pred - y).square().mean() + w * pred.abs().mean()


@pytest.mark.parametrize("how", ["vars", "getattr", "dict", "container", "unknown callable"])
def test_where_the_analysis_cannot_tell_what_is_read_every_public_attribute_counts_as_read(how):
    module = _HandsSelfAway(how, width=4, depth=1)
    found = analyse(module)
    assert any(p.pattern == ".*" for _, p, _ in found.read_patterns), found.read_patterns
    assert {"aux_weight", "seen", "how"} <= found.reads
    assert "_modules" not in found.reads and "_parameters" not in found.reads  # public ones only
    # an attribute first set after the analysis (by a hook) is added at the next capture
    module.late = 2.0
    analyse_called_code(module, found)
    assert "late" in found.reads


def test_a_library_function_given_the_module_reads_none_of_its_attributes():
    from lightning.pytorch.utilities import grad_norm

    class LogsNorms(_AuxSwitch):
        def on_before_optimizer_step(self, optimizer):
            self.log_dict(grad_norm(self, norm_type=2))

    found = analyse(LogsNorms(width=4, depth=1), ("on_before_optimizer_step",))
    assert all(p.pattern == "forward" for _, p, _ in found.read_patterns)
    assert "seen" not in found.reads and found.log_unknown  # the norms' keys are not in the source


class _Average:
    """A user's EMA helper, handed the module: reads one of its numbers."""

    def __init__(self):
        self.decay = 0.9

    def update(self, model):
        return model.aux_weight * self.decay


def test_a_method_of_an_object_the_module_holds_is_read_with_the_module_as_its_argument():
    import torch

    class Averages(_AuxSwitch):
        def __init__(self, **kw):
            super().__init__(**kw)
            self.average = _Average()
            self.swa = torch.optim.swa_utils.AveragedModel(self.net)

        def on_before_zero_grad(self, optimizer):
            self.average.update(self)  # the user's method: read with `model` the module
            self.swa.update_parameters(self)  # torch's: it knows none of the module's attributes
            _log.debug("%s", self)  # a library object's method

    found = analyse(Averages(width=4, depth=1), ("on_before_zero_grad",))
    assert "aux_weight" in found.reads and "seen" not in found.reads
    assert all(p.pattern == "forward" for _, p, _ in found.read_patterns), found.read_patterns


class _AveragesInACallback(Callback):
    def __init__(self):
        self.average = _Average()

    def on_before_zero_grad(self, trainer, pl_module, optimizer):
        self.average.update(pl_module)


def test_a_callback_handing_the_module_to_a_method_of_an_object_it_holds_is_followed():
    found = StepSource()
    analyse_callbacks([_AveragesInACallback()], ("on_before_zero_grad",), found)
    assert "aux_weight" in found.reads and found.read_patterns == []


class _ClipsByModule(Callback):
    def __init__(self):
        self.scale = 1.0

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        self._clip(trainer, pl_module)
        regularized(pl_module, 0.0, 0.0)

    def _clip(self, trainer, module):
        if trainer.global_step % 4 == 0:
            for p in module.parameters():
                p.grad.mul_(self.scale * module.aux_weight)


def test_a_callback_handing_the_module_on_is_followed_without_counting_every_attribute_as_read():
    found = StepSource()
    analyse_callbacks([_ClipsByModule()], ("on_before_optimizer_step",), found)
    # the module handed to its own helper and to a user function: followed, nothing unknown
    assert [p.pattern for _, p, _ in found.read_patterns] == ["parameters"]  # a method it calls
    assert "aux_weight" in found.reads  # read by the user function the module was handed to
    module = SimpleNamespace(aux_weight=0.5, trainer=SimpleNamespace(global_step=8))
    lines = [a.line for a in found.attribute_values]
    assert any("module.aux_weight" in line for line in lines), lines  # the helper's parameter
    snapshot = found.attribute_snapshot(module, 0)
    module.aux_weight = 0.25
    assert len(found.changed_attribute_values(snapshot, module, 0)) == 2
    (condition,) = found.conditions  # the helper's test on the Trainer it was handed
    assert condition.evaluate(module, 0) is True


class _LogsInEveryWay(TinyMLP):
    def __init__(self, **kw):
        super().__init__(**kw)
        self.phase = 0.0

    def phase_of(self):
        return self.phase

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = (self.head(self.net(x)).squeeze(-1) - y).square().mean()
        self.log_dict({"train/loss": loss, "phase": self.phase, "epoch": float(self.current_epoch)})
        self.log_dict(dict(kw_phase=self.phase * 2))
        metrics = {"bs": x.shape[0], "const": 3, "called": self.phase_of()}
        self.log_dict(metrics)
        self.log("n", len(batch) * 2.0)
        self.log("opaque", self.phase_of())
        self.log_dict({f"loss/{k}": v for k, v in {"a": loss}.items()})
        self.log(f"{self.phase}", loss)
        return loss


def test_log_dict_entries_are_re_evaluated_like_log_values_and_the_rest_is_classified():
    found = analyse(_LogsInEveryWay(width=4, depth=1))
    module = SimpleNamespace(phase=0.5, current_epoch=2)
    assert {"phase", "epoch", "kw_phase", "const"} <= set(found.log_values)
    assert [found.log_value(k, module, 0) for k in ("phase", "epoch", "kw_phase")] == [0.5, 2.0, 1.0]
    assert found.log_constants == {"bs", "n"}  # the batch's shapes: the same for every replay of a graph
    assert set(found.log_opaque) == {"train/loss", "called", "opaque"}
    assert "self.phase_of()" in found.log_opaque["called"]  # the entry's own line
    assert len(found.log_unknown) == 2  # a comprehension's keys, a computed key


# --------------------------------------------------------------------------- fits on the emulator
@pytest.mark.parametrize("cls", ALIASES, ids=lambda c: c.__name__)
def test_a_number_read_through_an_alias_of_self_captures_again_when_it_changes_and_trains_like_the_baseline(
    cls,
):
    """Silently wrong before: one capture, and from step 13 every replay kept the weight 1.0. The weight
    baked in (no device scalars): each change is seen and captured again."""
    base = fit(baseline_of(cls), steps=30)
    cb = callback(operand_scalars=False)
    with pytest.warns(UserWarning, match=r"capturing the step again: Python numbers the step reads changed"):
        run = fit(cls, [cb], steps=30)
    s = cb.summary()
    # captured at step 3 and again once at step 13; the hook's counter captures nothing
    assert s["captured"] and s["captures"] == 2 and s["fallback_steps"] == 0, s
    assert run[0].seen == 30
    assert_same(base, run)


@pytest.mark.parametrize("cls", ALIASES, ids=lambda c: c.__name__)
def test_a_number_read_through_an_alias_of_self_with_device_scalars_trains_like_the_baseline(cls):
    """With device scalars (the default): a weight read only as a tensor operand in code the analysis
    reads with the module bound is written before each replay, one capture; read any other way, it
    is baked and captured again."""
    base = fit(baseline_of(cls), steps=30)
    cb = callback()
    run = fit(cls, [cb], steps=30)
    s = cb.summary()
    # the lambda's and the dict's reads are attribute values read some other way too: baked
    baked = cls in (ByLambda, ByDictOfMethods)
    assert s["captured"] and s["captures"] == (2 if baked else 1) and s["fallback_steps"] == 0, s
    assert s["operand_scalars"]["changes"] == (0 if baked else 1), s
    assert run[0].seen == 30
    assert_same(base, run)


def test_a_module_handed_where_nothing_can_be_told_trains_like_the_baseline():
    """``vars(self)``: every public scalar counts as read, the hook's counter too; the steps whose counter
    moved are captured again or run eagerly, never replayed with the capture's weight."""
    base = fit(baseline_of(_HandsSelfAway), steps=30, how="vars")
    cb = callback()
    with pytest.warns(UserWarning):
        run = fit(_HandsSelfAway, [cb], steps=30, how="vars")
    assert_same(base, run)


class LogsPhaseByLogDict(TinyMLP):
    def __init__(self, by_keywords: bool = False, **kw):
        super().__init__(**kw)
        self.phase = 0.0
        self.by_keywords = by_keywords

    def on_train_batch_start(self, batch, batch_idx):
        if self.global_step == SWITCH_STEP:
            self.phase = 1.0

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = (self.head(self.net(x)).squeeze(-1) - y).square().mean()
        if self.by_keywords:
            self.log_dict(dict(phase=self.phase))
        else:
            self.log_dict({"train/loss": loss, "phase": self.phase})
        return loss


@pytest.mark.parametrize("by_keywords", [False, True], ids=["literal", "dict-keywords"])
def test_a_python_number_logged_with_log_dict_is_each_replays_own(by_keywords):
    """Silently wrong before: from step 13 every replay logged the capture's phase 0.0."""
    base = fit(baseline_of(LogsPhaseByLogDict), steps=30, by_keywords=by_keywords)
    cb = callback()
    run = fit(LogsPhaseByLogDict, [cb], steps=30, by_keywords=by_keywords)
    s = cb.summary()
    assert s["captured"] and s["captures"] == 1 and s["fallback_steps"] == 0, s
    assert_same(base, run)
    assert [r["phase"] for r in run[1].logged][SWITCH_STEP - 1 : SWITCH_STEP + 1] == [0.0, 1.0]
    assert emu.FakeGraph.replays == 30 - 3


class ManualLogsLR(TinyMLP):
    """Manual optimization logging its optimizer's LR with log_dict; the LR lowered from step 13."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self.automatic_optimization = False

    def on_train_batch_start(self, batch, batch_idx):
        if self.global_step >= SWITCH_STEP:
            for group in self.optimizers().param_groups:
                group["lr"] = 1e-4

    def training_step(self, batch, batch_idx):
        opt = self.optimizers()
        x, y = batch
        loss = (self.head(self.net(x)).squeeze(-1) - y).square().mean()
        opt.zero_grad()
        self.manual_backward(loss)
        opt.step()
        self.log_dict({"train/loss": loss, "lr": opt.param_groups[0]["lr"]})


def test_a_manual_steps_lr_logged_with_log_dict_is_each_replays_own():
    """Silently wrong before: the replays trained with the new LR, but logged the capture's 0.01."""
    base = fit(baseline_of(ManualLogsLR), steps=30)
    cb = callback()
    run = fit(ManualLogsLR, [cb], steps=30)
    s = cb.summary()
    assert s["captured"] and s["fallback_steps"] == 0, s
    assert_same(base, run)
    assert [r["lr"] for r in run[1].logged][SWITCH_STEP - 1 : SWITCH_STEP + 1] == [0.01, 1e-4]


def current_lr(optimizer):
    """A helper of the user's: a replay cannot call it again, and nothing before a replay compares it."""
    return optimizer.param_groups[0]["lr"]


class ManualLogsLRThroughAFunction(ManualLogsLR):
    def __init__(self, by_log_dict: bool = True, **kw):
        super().__init__(**kw)
        self.by_log_dict = by_log_dict

    def training_step(self, batch, batch_idx):
        opt = self.optimizers()
        x, y = batch
        loss = (self.head(self.net(x)).squeeze(-1) - y).square().mean()
        opt.zero_grad()
        self.manual_backward(loss)
        opt.step()
        self.log("train/loss", loss)
        if self.by_log_dict:
            self.log_dict({"lr": current_lr(opt)})
        else:
            self.log("lr", current_lr(opt))


def test_a_logged_number_a_replay_cannot_recompute_is_found_by_its_key_and_line():
    found = analyse(ManualLogsLRThroughAFunction(width=4, depth=1))
    assert "lr" not in found.log_values and "current_lr(opt)" in found.log_opaque["lr"]


@pytest.mark.parametrize("by_log_dict", [True, False], ids=["log_dict", "log"])
def test_a_logged_number_a_replay_cannot_recompute_is_refused_by_name_though_the_warm_up_kept_it(by_log_dict):
    """Silently wrong before (the warm-up steps logged 0.01 each time, taken for a constant): from step
    13 every replay logged 0.01 where the fit trains with 1e-4."""
    plain = fit(ManualLogsLRThroughAFunction, steps=30, by_log_dict=by_log_dict)
    cb = callback()
    with pytest.warns(UserWarning, match=r"`self.log\('lr', ...\)`.*cannot recompute.*current_lr\(opt\)"):
        run = fit(ManualLogsLRThroughAFunction, [cb], steps=30, by_log_dict=by_log_dict)
    assert not cb.summary()["captured"] or "lr" in (cb.summary()["reason"] or ""), cb.summary()
    assert [r["lr"] for r in run[1].logged] == [r["lr"] for r in plain[1].logged]
