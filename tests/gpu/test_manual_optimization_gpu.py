"""GPU: manual optimization (``automatic_optimization = False``) with one optimizer captured, bitwise its baseline.

The whole ``training_step`` (``self.optimizers()``, ``zero_grad``, ``manual_backward``, ``step``) is one
graph (l2lightning.manual_step); every step's loss and logs, the parameters, the optimizer's state and
the loop's progress are compared with the baseline (plain Lightning, switched to ``make_capturable``'s
configuration at the callback's capture step: ``tests/baselines.py``). Lightning's basic GAN (two
optimizers) trains eagerly with a warning naming the cause, bitwise plain Lightning.
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
from tests.idiom_harness import loop_state
from tests.idiom_modules import IDIOMS
from tests.lightning_models import quiet_trainer, regression_loader
from tests.test_manual_optimization_cpu import AdamState, ManualMLP

pytestmark = pytest.mark.gpu


class LossRecorder(AdamState):
    def __init__(self):
        super().__init__()
        self.losses, self.logged = [], []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
        loss = outputs.get("loss") if isinstance(outputs, dict) else None
        self.losses.append(loss.detach().clone() if loss is not None else None)
        self.logged.append({k: v.detach().clone() for k, v in trainer.callback_metrics.items()})


def fit(model_cls, callbacks, steps=40, **model_kwargs):
    if is_baseline(model_cls):  # the baseline switches where the test's callback fit switched
        return DeferredFit(lambda: _fit(model_cls, callbacks, steps, **model_kwargs))
    return _fit(model_cls, callbacks, steps, **model_kwargs)


def _fit(model_cls, callbacks, steps, **model_kwargs):
    seed_everything(0)
    torch.use_deterministic_algorithms(True, warn_only=True)
    model = model_cls(width=512, depth=4, **model_kwargs)
    rec = LossRecorder()
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


def test_basic_gan_trains_eagerly_naming_two_optimizers_bitwise_plain():
    idiom = IDIOMS["manual_gan"]

    def run(callbacks):
        seed_everything(0)
        torch.use_deterministic_algorithms(True, warn_only=True)
        model = idiom.make_module()
        trainer = quiet_trainer(
            accelerator="gpu", devices=1, max_steps=10, callbacks=callbacks, deterministic=True
        )
        trainer.fit(model, idiom.make_loader())
        return model, trainer

    cb = L2GraphCallback(prefetch="off")
    with pytest.warns(UserWarning, match=r"2 optimizers \(Adam, Adam\).*supports exactly one"):
        model, trainer = run([cb])
    plain, plain_trainer = run([])
    assert not cb.summary()["captured"]
    assert loop_state(trainer) == loop_state(plain_trainer)
    for (name, p), q in zip(model.named_parameters(), plain.parameters()):
        assert torch.equal(p, q), f"parameter {name} differs"
