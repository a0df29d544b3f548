"""L2GraphCallback on the CPU graph emulator (continued from ``test_callback_replay_cpu.py``): the
packaged families, what capturing costs and out-of-memory errors, gradients a step adds to, tensors
rebound between steps, other callbacks' hooks inside the step, optimizer state replaced between
steps, and Adagrad.

Each fit with the callback is compared with the eager fit it must equal: its baseline when captured,
plain Lightning when refused.
"""

from __future__ import annotations

import collections
import weakref
from typing import Any

import pytest
import torch
from lightning.pytorch import Callback, seed_everything
from lightning.pytorch.utilities import grad_norm
from torch.utils.data import DataLoader

from l2lightning import L2GraphCallback
from l2lightning.callback.prefetch_setup import PrefetchSetup
from tests import graph_emulator as emu
from tests import user_step_config
from tests.baselines import (
    baseline_of,
    capturable_from_of_the_last_callback_fit,  # noqa: F401 -- the fixture records each callback fit's switch step
)
from tests.lightning_models import (
    AdagradMLP,
    DecayingAdagradMLP,
    IgnoresTheNames,
    NamedSamples,
    ReadsTheNames,
    TinyMLP,
    quiet_trainer,
    regression_loader,
)
from tests.logging_models import LoggedEverywhere, assert_logged_alike
from tests.replay_helpers import (
    Recorder,
    assert_refused_like_plain,
    assert_same,
    callback,
    captured_pair,
    fit,
)

# every test here runs on the CPU graph emulator (tests/conftest.py)
pytestmark = pytest.mark.usefixtures("emulated_cuda_graphs")


# --------------------------------------------------------------------------- the packaged families
@pytest.mark.parametrize("family", ["mlp_stack", "rl_policy", "recommender", "conv_stack", "text_encoder"])
def test_families_update_their_metrics_in_the_graph_and_log_like_eager(family):
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


@pytest.mark.parametrize(
    "mapping", [dict, lambda: collections.defaultdict(list)], ids=["dict", "defaultdict"]
)
def test_a_mapping_batch_is_captured_and_replays_bitwise(mapping):
    """A plain dict takes read_batch's shortcut, a defaultdict the general path: both replay bitwise."""
    loader = lambda: _mapping_loader(mapping)  # noqa: E731
    base = fit(baseline_of(TakesMappingBatches), loader=loader())
    cb = callback()
    run = fit(TakesMappingBatches, [cb], loader=loader())
    assert cb.summary()["captured"] and cb.summary()["fallback_steps"] == 0, cb.summary()
    assert_same(base, run)


def test_a_dict_batch_with_another_key_runs_that_step_eagerly_and_trains_like_plain():
    """The dict shortcut's signature holds the keys: a batch with a key more (a tensor the step never
    reads) does not fit the graph's buffers, so that step runs eagerly and the graph serves the rest."""
    counter = iter(range(10**6))

    def mapping():
        batch: dict = {}
        if next(counter) == 12:  # one batch of the fit carries an extra tensor
            batch["w"] = torch.zeros(8)
        return batch

    loader = lambda: _mapping_loader(mapping)  # noqa: E731
    base = fit(baseline_of(TakesMappingBatches), loader=loader())
    counter = iter(range(10**6))
    cb = callback()
    with pytest.warns(UserWarning, match="running this step eagerly"):
        run = fit(TakesMappingBatches, [cb], loader=loader())
    summary = cb.summary()
    assert summary["captured"] and summary["fallback_steps"] == 1, summary
    assert_same(base, run)


def test_a_batch_the_static_buffers_cannot_rebuild_is_refused_by_name_and_trains_like_plain(monkeypatch):
    """Whatever Lightning can move to the device the buffers rebuild the same way; should a type still
    fail there, the capture is refused with the reason, and the fit goes on eagerly."""
    from l2lightning.callback import step_capture

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

        from l2lightning.callback import step_dispatch

        self.on_stream: list[int] = []
        self.freed: list[tuple[str, int]] = []
        ledger = self

        @contextlib.contextmanager
        def on_step_stream(part):
            part._fit.step_stream = "the capture's stream"
            ledger.on_stream.append(part._fit.trainer.global_step)
            yield

        monkeypatch.setattr(step_dispatch.StepDispatch, "_on_step_stream", on_step_stream)
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
    assert cb._fit.step_stream is None


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

    monkeypatch.setattr(PrefetchSetup, "_prefetch_hooks", tuner_runs_out)
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

    import l2lightning.graph.capture
    from l2lightning.guards.step_source import _is_user_code

    assert _is_user_code(weighted) and _is_user_code(user_step_config)
    assert not _is_user_code(torch.nn.functional.relu)  # an installed package
    assert not _is_user_code(os.path.join)  # the standard library
    assert not _is_user_code(l2lightning.graph.capture.flatten_batch)  # the callback's own code
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

    from l2lightning.guards.step_source import _free_names

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


# --------------------------------------------------------------------------- Adagrad


def test_adagrad_is_captured_and_bitwise_the_plain_fit():
    """Its switched step changes no number (l2lightning.graph.optim._adagrad_step_count_unread): the fit with
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
