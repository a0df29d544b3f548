"""Hooks that sync run after each replay only where they see what an eager step shows them and write nothing.

`l2lightning.guards.hook_writes` reads a hook's code (and its own helpers') for anything that may write; the
warm-up's trace shows only what one step wrote. Found by a held-out idiom hunt on the emulator: the
forum recipe that skips the update on non-finite gradients (`if not finite: self.zero_grad()`) ran after
each replay, so the zeroing came after the update (every loss NaN after the first bad batch, no
warning); and gradient norms logged in `on_after_backward` were read after the replay's clipping
(`configure_gradient_clipping` of the module's own, `clip_grad_value_` in `on_before_optimizer_step`).
Both now train eagerly, naming the cause, bitwise plain; a norm-logging hook that only reads still runs
after each replay, bitwise its baseline.
"""

from __future__ import annotations

import re

import pytest
import torch
from lightning.pytorch import Callback, LightningModule
from lightning.pytorch.utilities import grad_norm
from torch.utils.data import DataLoader, TensorDataset

from l2lightning.guards.hook_writes import possible_writes
from tests.baselines import (  # noqa: F401 -- the fixture records each callback fit's switch step
    baseline_of,
    capturable_from_of_the_last_callback_fit,
)
from tests.lightning_models import TinyMLP
from tests.replay_helpers import assert_same, callback, fit


# --------------------------------------------------------------------------- what the code may write
class Hooks(LightningModule):
    def logs_norms(self, optimizer):
        self.log_dict(grad_norm(self, norm_type=2))

    def fills_its_own_dict(self, optimizer):
        norms = {}
        values = []
        for name, p in self.named_parameters():
            norms[f"grad/{name}"] = p.grad.norm().item()
            values.append(norms[f"grad/{name}"])
        print(sum(values))
        self.log_dict(norms)
        self.logger.experiment.add_scalar("total", sum(values))

    def guards(self, optimizer):
        if not all(torch.isfinite(p.grad).all() for p in self.parameters()):
            optimizer.zero_grad()

    def guards_with_a_helper(self):
        if self._bad():
            self._skip()

    def _bad(self):
        return False

    def _skip(self):
        for p in self.parameters():
            p.grad = None

    def clips(self, optimizer):
        torch.nn.utils.clip_grad_value_(self.parameters(), 0.1)

    def counts(self):
        self.seen = self.seen + 1

    def calls_an_object(self):
        self.tracker.update(1.0)


@pytest.mark.parametrize("name", ["logs_norms", "fills_its_own_dict"])
def test_code_that_only_reads_and_logs_may_write_nothing(name):
    assert possible_writes(getattr(Hooks, name), Hooks()) == []


@pytest.mark.parametrize(
    ("name", "what"),
    [
        ("guards", r"`optimizer.zero_grad\(\)` at .*test_hook_writes_cpu.py:\d+ \(`zero_grad` writes\)"),
        ("guards_with_a_helper", r"`p.grad = None` at .* \(it writes an attribute or an item\)"),
        ("clips", r"`clip_grad_value_` writes"),
        ("counts", r"`self.seen = self.seen \+ 1` at .*it writes an attribute"),
        (
            "calls_an_object",
            r"it calls `self.tracker.update`, code the analysis cannot follow|`update` writes",
        ),
    ],
)
def test_code_that_may_write_is_named_with_its_line(name, what):
    found = possible_writes(getattr(Hooks, name), Hooks())
    assert found and any(re.search(what, f) for f in found), found


def test_code_without_a_readable_source_may_write():
    namespace: dict = {}
    exec("def hook(self):\n    pass\n", namespace)  # no file to read it from
    assert "its source cannot be read" in possible_writes(namespace["hook"], Hooks())[0]


# --------------------------------------------------------------------------- fits on the emulator
pytestmark_fits = pytest.mark.usefixtures("emulated_cuda_graphs")


def corrupt_loader(bad_batch=9, n=160, width=32):
    """The regression batches, one sample of batch `bad_batch` holding an inf."""
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(n, width, generator=g), torch.randn(n, generator=g)
    x[bad_batch * 8 + 3, 5] = float("inf")
    return DataLoader(TensorDataset(x, y), batch_size=8, shuffle=False)


class GuardAfterBackward(TinyMLP):
    """Skips the update on non-finite gradients: `self.zero_grad()` in `on_after_backward`."""

    def on_after_backward(self):
        valid = all(not (torch.isnan(p.grad).any() or torch.isinf(p.grad).any()) for p in self.parameters())
        if not valid:
            self.zero_grad()


class GuardBeforeTheStep(TinyMLP):
    """The same in `on_before_optimizer_step`, through the optimizer."""

    def on_before_optimizer_step(self, optimizer):
        if not all(torch.isfinite(p.grad).all() for p in self.parameters()):
            optimizer.zero_grad()


class NormsThenOwnClipping(TinyMLP):
    """Logs gradient norms in `on_after_backward`; clips at its own value in `configure_gradient_clipping`."""

    def on_after_backward(self):
        self.log_dict(grad_norm(self, norm_type=2))

    def configure_gradient_clipping(self, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None):
        self.clip_gradients(optimizer, gradient_clip_val=0.05, gradient_clip_algorithm="norm")


class NormsThenValueClipping(TinyMLP):
    """Logs gradient norms in `on_after_backward`; `clip_grad_value_` in `on_before_optimizer_step`."""

    def on_after_backward(self):
        self.log_dict(grad_norm(self, norm_type=2))

    def on_before_optimizer_step(self, optimizer):
        torch.nn.utils.clip_grad_value_(self.parameters(), clip_value=0.01)


class NormsOnly(TinyMLP):
    """Lightning's debugging recipe alone: the norms, read after each replay."""

    def on_before_optimizer_step(self, optimizer):
        self.log_dict(grad_norm(self, norm_type=2))


class GuardCallback(Callback):
    """The guard in a callback, through the module."""

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        if not all(torch.isfinite(p.grad).all() for p in pl_module.parameters()):
            pl_module.zero_grad()


@pytestmark_fits
@pytest.mark.parametrize(
    ("cls", "extra", "match"),
    [
        (
            GuardAfterBackward,
            [],
            r"`on_after_backward` may write: `self.zero_grad\(\)` at .*zero_grad` writes",
        ),
        (GuardBeforeTheStep, [], r"`on_before_optimizer_step` may write: `optimizer.zero_grad\(\)`"),
        (TinyMLP, [GuardCallback], r"`on_before_optimizer_step` may write: `pl_module.zero_grad\(\)`"),
    ],
    ids=["module-after-backward", "module-before-the-step", "callback"],
)
def test_a_guard_that_zeroes_bad_gradients_trains_eagerly_naming_its_write_bitwise_plain(cls, extra, match):
    plain = fit(cls, [*(c() for c in extra)], steps=20, loader=corrupt_loader())
    cb = callback()
    with pytest.warns(UserWarning, match=match):
        run = fit(cls, [*(c() for c in extra), cb], steps=20, loader=corrupt_loader())
    assert not cb.summary()["captured"] and cb.summary()["capturable_from_step"] is None, cb.summary()
    # the bad batch's loss is NaN in both fits (torch.equal calls no NaN equal): bitwise, NaN as NaN
    for x, y in [*zip(plain[1].losses, run[1].losses), *zip(plain[0].parameters(), run[0].parameters())]:
        torch.testing.assert_close(x, y, rtol=0, atol=0, equal_nan=True)
    assert plain[1].losses[9].isnan() and all(p.isfinite().all() for p in run[0].parameters())


@pytestmark_fits
@pytest.mark.parametrize(
    ("cls", "match"),
    [
        (NormsThenOwnClipping, r"the module's `configure_gradient_clipping` changes the gradients after"),
        (
            NormsThenValueClipping,
            r"`on_before_optimizer_step` writes tensors after `on_after_backward` reads",
        ),
    ],
    ids=["configure_gradient_clipping", "clip_grad_value_"],
)
def test_norms_logged_before_the_steps_own_clipping_train_eagerly_bitwise_plain(cls, match):
    plain = fit(cls, steps=16)
    cb = callback()
    with pytest.warns(UserWarning, match=match):
        run = fit(cls, [cb], steps=16)
    assert not cb.summary()["captured"], cb.summary()
    assert_same(plain, run)  # the logged norms included


@pytestmark_fits
def test_norms_logged_by_a_hook_that_only_reads_still_run_after_each_replay_bitwise_the_baseline():
    base = fit(baseline_of(NormsOnly), steps=20)
    cb = callback()
    run = fit(NormsOnly, [cb], steps=20)
    s = cb.summary()
    assert s["captured"] and s["captures"] == 1 and s["reason"] is None, s
    assert_same(base, run)
    assert "grad_2.0_norm_total" in run[1].logged[-1]
