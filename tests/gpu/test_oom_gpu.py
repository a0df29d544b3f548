"""GPU: with memory filled until plain training barely fits, the callback falls back and the fit goes on.

The callback needs memory a plain fit does not: the tuner's throwaway copies and timing graphs, and
the captured graph's private pool (its gradients and activations). With only a few percent above a
plain fit's peak left free, tuning and capture run out of memory; the callback must free what it
took, say so once, and train eagerly, bit for bit the plain fit (fused AdamW: the capturable and the
plain configuration give the same bits).
"""

from __future__ import annotations

import gc
import warnings

import pytest
import torch
from lightning.pytorch import Callback, seed_everything

from l2lightning import L2GraphCallback
from tests.lightning_models import TinyMLP, quiet_trainer, regression_loader

pytestmark = pytest.mark.gpu

WIDTH, DEPTH, BATCH, STEPS = 2048, 8, 64, 12
# Free memory left above the plain fit's peak reserved bytes: enough for the plain fit, not for a graph pool
HEADROOM = 1.04


class Losses(Callback):
    def __init__(self):
        self.values = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.values.append(outputs["loss"].detach().clone())


def fit(callbacks):
    seed_everything(0)
    model = TinyMLP(width=WIDTH, depth=DEPTH, fused=True)
    losses = Losses()
    trainer = quiet_trainer(accelerator="gpu", devices=1, max_steps=STEPS, callbacks=[losses, *callbacks])
    trainer.fit(model, regression_loader(n=BATCH * (STEPS + 1), width=WIDTH, batch_size=BATCH))
    return model, losses.values


def release():
    gc.collect()
    torch.cuda.empty_cache()


def test_a_callback_fit_in_memory_that_only_plain_training_fits_falls_back_and_trains_like_plain():
    release()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_reserved()
    plain_model, plain_losses = fit([])
    plain_peak = torch.cuda.max_memory_reserved() - before
    plain_state = {k: v.detach().clone() for k, v in plain_model.state_dict().items()}
    del plain_model
    release()
    free, _ = torch.cuda.mem_get_info()
    filler = torch.empty(int(free - plain_peak * HEADROOM), dtype=torch.uint8, device="cuda")
    try:
        cb = L2GraphCallback()  # the defaults: prefetch="auto", tuned afresh unless cached
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            model, losses = fit([cb])
        messages = [str(w.message) for w in caught if "L2GraphCallback" in str(w.message)]
        summary = cb.summary()
        assert not summary["captured"] and "out of memory" in (summary["reason"] or ""), (summary, messages)
        assert any("out of memory" in m for m in messages), messages
        assert len(losses) == len(plain_losses) == STEPS
        for i, (a, b) in enumerate(zip(losses, plain_losses)):
            assert torch.equal(a, b), f"loss differs at step {i}"
        for name, value in model.state_dict().items():
            assert torch.equal(value, plain_state[name]), f"{name} differs"
    finally:
        del filler
        release()
    # the process is usable afterwards: a fit with the callback and room to spare captures
    cb = L2GraphCallback(prefetch="off")
    fit([cb])
    assert cb.summary()["captured"], cb.summary()
