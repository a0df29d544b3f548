"""GPU: manual optimization (``automatic_optimization = False``) captured, bitwise its baseline.

The whole ``training_step`` (``self.optimizers()``, ``zero_grad``, ``manual_backward``, ``step``) is one
graph (l2lightning.graph.manual_step), with one optimizer or with two (Lightning's basic GAN, its noise drawn
on the device: both Adam updates and ``toggle_optimizer`` in the graph); every step's loss and logs,
the parameters, every optimizer's state, ``requires_grad`` and the loop's progress are compared with
the baseline (plain Lightning, switched to ``make_capturable``'s configuration at the callback's
capture step: ``tests/baselines.py``). The tutorial GAN as written draws its noise on the host
(``torch.randn`` without a device): it trains eagerly with one warning naming the line and
``device=self.device``, bitwise plain Lightning.
"""

from __future__ import annotations

import pytest
import torch
from lightning.pytorch import seed_everything

from l2lightning import L2GraphCallback
from tests.baselines import (  # noqa: F401 -- the fixture records each callback fit's switch step
    DeferredFit,
    baseline_of,
    capturable_from_of_the_last_callback_fit,
    is_baseline,
)
from tests.graph.test_manual_optimization_cpu import (
    AdamState,
    ManualMLP,
    ManualTwoOptimizers,
    OptimizerStates,
    assert_same_optimizer_states,
)
from tests.idiom_harness import loop_state
from tests.idiom_modules import IDIOMS, ManualGAN, ManualGANDeviceNoise
from tests.lightning_models import quiet_trainer, regression_loader

pytestmark = pytest.mark.gpu


class LossRecorder(AdamState):
    """Per step: the loss, the logged values and (`adam_state`) the first optimizer's state of
    `head.weight`; with several optimizers OptimizerStates records all of them instead."""

    def __init__(self, adam_state=True):
        super().__init__()
        self.adam_state = adam_state
        self.losses, self.logged = [], []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if self.adam_state:
            super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
        loss = outputs.get("loss") if isinstance(outputs, dict) else None
        self.losses.append(loss.detach().clone() if loss is not None else None)
        self.logged.append({k: v.detach().clone() for k, v in trainer.callback_metrics.items()})


def fit(model_cls, callbacks, steps=40, **model_kwargs):
    if is_baseline(model_cls):  # the baseline switches where the test's callback fit switched
        return DeferredFit(lambda: _fit(model_cls, callbacks, steps, **model_kwargs))
    return _fit(model_cls, callbacks, steps, **model_kwargs)


def _fit(model_cls, callbacks, steps, record_adam=True, **model_kwargs):
    seed_everything(0)
    torch.use_deterministic_algorithms(True, warn_only=True)
    model = model_cls(width=512, depth=4, **model_kwargs)
    rec = LossRecorder(adam_state=record_adam)
    trainer = quiet_trainer(
        accelerator="gpu", devices=1, max_steps=steps, callbacks=[rec, *callbacks], deterministic=True
    )
    trainer.fit(model, regression_loader(n=320, width=512, batch_size=8))
    return model, rec, trainer


def assert_same_manual_run(a, b):
    (ma, ra, ta), (mb, rb, tb) = a, b
    assert loop_state(ta) == loop_state(tb)
    assert ta.global_step == tb.global_step
    assert len(ra.losses) == len(rb.losses)
    for i, (x, y) in enumerate(zip(ra.losses, rb.losses)):
        assert (x is None and y is None) or torch.equal(x, y), f"loss differs at step {i}"
    for i, (x, y) in enumerate(zip(ra.logged, rb.logged)):
        assert x.keys() == y.keys(), i
        for k in x:
            assert torch.equal(x[k], y[k]), f"logged {k!r} differs at step {i}"
    for i, (x, y) in enumerate(zip(ra.states, rb.states)):
        for k in x:
            assert torch.equal(x[k], y[k]), f"optimizer state {k!r} differs after step {i}"
    for (name, p), q in zip(ma.named_parameters(), mb.parameters()):
        assert torch.equal(p, q), f"parameter {name} differs"


@pytest.mark.parametrize(
    "model_kwargs",
    [{"fused": True}, {"returns": True}, {"toggle": True}],
    ids=["fused", "returns-loss", "toggle"],
)
def test_manual_one_optimizer_step_is_captured_bitwise_its_baseline(model_kwargs):
    cb = L2GraphCallback(prefetch="off", check_share=1.0)
    run = fit(ManualMLP, [cb], **model_kwargs)
    base = fit(baseline_of(ManualMLP), [], **model_kwargs)
    summary = cb.summary()
    assert summary["captured"] and summary["captures"] == 1 and summary["fallback_steps"] == 0, summary
    assert summary["replay_check"]["checks"] >= 3 and summary["replay_check"]["mismatches"] == 0, summary
    assert_same_manual_run(base, run)


def test_manual_with_prefetch_default_captures_without_prefetch_bitwise_its_baseline():
    """The prefetch's set-up runs training_step without gradients, which manual_backward needs: off, said once."""
    cb = L2GraphCallback(prefetch="default")
    with pytest.warns(UserWarning, match=r"prefetch off under manual optimization"):
        run = fit(ManualMLP, [cb], fused=True)
    base = fit(baseline_of(ManualMLP), [], fused=True)
    summary = cb.summary()
    assert summary["captured"] and summary["fallback_steps"] == 0, summary
    assert summary["replay_check"]["mismatches"] == 0, summary
    assert_same_manual_run(base, run)


def _fit_gan(cls, callbacks, batches=16):
    seed_everything(0)
    torch.use_deterministic_algorithms(True, warn_only=True)
    model = cls()
    rec, states = LossRecorder(adam_state=False), OptimizerStates()
    trainer = quiet_trainer(
        accelerator="gpu",
        devices=1,
        max_steps=2 * batches,  # two optimizer steps per batch
        callbacks=[states, rec, *callbacks],
        deterministic=True,
    )
    trainer.fit(model, IDIOMS["manual_gan"].make_loader())
    return model, rec, trainer, states


def test_basic_gan_with_its_noise_on_the_device_is_one_graph_bitwise_its_baseline():
    cb = L2GraphCallback(prefetch="off", check_share=1.0)
    model, rec, trainer, states = _fit_gan(ManualGANDeviceNoise, [cb])
    base_model, base_rec, base_trainer, base_states = _fit_gan(baseline_of(ManualGANDeviceNoise), [])
    summary = cb.summary()
    assert summary["captured"] and summary["captures"] == 1 and summary["fallback_steps"] == 0, summary
    assert summary["replay_check"]["checks"] >= 3 and summary["replay_check"]["mismatches"] == 0, summary
    assert trainer.global_step == base_trainer.global_step == 32
    assert_same_manual_run((base_model, base_rec, base_trainer), (model, rec, trainer))
    assert_same_optimizer_states(base_states, states)
    assert all(all(flags.values()) for flags in states.requires_grad)  # untoggled after every step


def test_tutorial_gan_drawing_its_noise_on_the_host_trains_eagerly_naming_the_line_bitwise_plain():
    cb = L2GraphCallback(prefetch="off")
    with pytest.warns(
        UserWarning, match=r"draws random numbers on the host.*`randn` at .*idiom_modules.py"
    ) as caught:
        model, rec, trainer, states = _fit_gan(ManualGAN, [cb], batches=8)
    plain = _fit_gan(ManualGAN, [], batches=8)
    ours = [str(w.message) for w in caught if "L2GraphCallback" in str(w.message)]
    assert len(ours) == 1, ours  # one warning, with the fix
    assert "`torch.randn(..., device=self.device)`" in ours[0]
    summary = cb.summary()
    assert not summary["captured"] and summary["capturable_from_step"] is None, summary
    assert_same_manual_run(plain[:3], (model, rec, trainer))
    assert_same_optimizer_states(plain[3], states)


def test_two_optimizers_on_an_mlp_are_one_graph_bitwise_its_baseline():
    states, base_states = OptimizerStates(), OptimizerStates()
    cb = L2GraphCallback(prefetch="off", check_share=1.0)
    run = _fit(ManualTwoOptimizers, [cb, states], steps=2 * 20, record_adam=False)
    base = _fit(baseline_of(ManualTwoOptimizers), [base_states], steps=2 * 20, record_adam=False)
    summary = cb.summary()
    assert summary["captured"] and summary["captures"] == 1 and summary["fallback_steps"] == 0, summary
    assert summary["replay_check"]["mismatches"] == 0, summary
    assert run[2].global_step == 40
    assert_same_manual_run(base, run)
    assert_same_optimizer_states(base_states, states)
