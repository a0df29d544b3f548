"""What the callback's CPU tests share: fit a module on the graph emulator and compare two fits.

``fit`` runs a seeded ``Trainer.fit`` of a TinyMLP-like module with a :class:`Recorder` (each step's
loss, logged values and outputs); ``assert_same`` compares two fits bit for bit; ``callback`` is the
callback as these tests use it (no prefetch, no timing logs). A fit of a baseline class
(``tests/baselines.py``) runs after the callback fit of its test, where that fit switched.
"""

from __future__ import annotations

import pytest
import torch
from lightning.pytorch import Callback, seed_everything

from l2lightning import L2GraphCallback
from tests.baselines import DeferredFit, baseline_of, is_baseline
from tests.idiom_harness import loop_state
from tests.lightning_models import (
    quiet_trainer,
    regression_loader,
)


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
