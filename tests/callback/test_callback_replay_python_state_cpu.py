"""L2GraphCallback on the CPU graph emulator (continued from ``test_callback_replay_cpu.py``): Python
state a replay would freeze (what the step reads or writes outside tensors), found and kept right.

Each fit with the callback is compared with the eager fit it must equal: its baseline when captured,
plain Lightning when refused.
"""

from __future__ import annotations

import copy
import functools
import re
import warnings

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch import Callback, seed_everything
from torch import nn

from l2lightning import L2GraphCallback
from tests.baselines import (
    baseline_of,
    capturable_from_of_the_last_callback_fit,  # noqa: F401 -- the fixture records each callback fit's switch step
)
from tests.between_step_models import (
    AnomalyDetectionFromEpochOne,
    AsksAHelperForTheTime,
    HalvesItsLossAfterAWhile,
    LogsAClosure,
    SetsTheConfigEachEpoch,
    TF32FromEpochOne,
)
from tests.callback.test_callback_replay_step_python_cpu import TargetSync
from tests.idiom_modules import IDIOMS
from tests.lightning_models import (
    TinyMLP,
    quiet_trainer,
    regression_loader,
)
from tests.replay_helpers import (
    Recorder,
    assert_captured_again_like_baseline,
    assert_same,
    callback,
    captured_pair,
    fit,
)

# every test here runs on the CPU graph emulator (tests/conftest.py)
pytestmark = pytest.mark.usefixtures("emulated_cuda_graphs")


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
    from l2lightning.callback.prefetch_setup import PrefetchSetup

    def dry_run_hooks(self, pl_module):  # what finding the prefetch chain does: one more training_step
        logging = pl_module.log
        pl_module.log = lambda *a, **k: None  # as the real dry run, which must not log
        try:
            with torch.no_grad():
                self._fit.originals["training_step"](self.static_batch.batch, 0)
        finally:
            pl_module.log = logging
        return None

    monkeypatch.setattr(PrefetchSetup, "_prefetch_hooks", dry_run_hooks)
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
    from tests.idiom_variants import IDIOM_VARIANTS

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
    from l2lightning.guards.step_trace import HostRead

    temperature = torch.tensor(1.0)

    class NotesAndAnneals(Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            graph = cb._slots.state.graph
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
    from tests.idiom_variants import IDIOM_VARIANTS

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
