"""L2GraphCallback without CUDA: it warns once, trains eagerly and identically, validates its arguments."""

from __future__ import annotations

import pytest
import torch
from lightning.pytorch import Trainer, seed_everything

from l2lightning import L2GraphCallback, PrefetchPlan
from tests.lightning_models import TinyMLP, regression_loader


def fit(callbacks, steps: int = 6, **trainer_kwargs):
    seed_everything(0)
    model = TinyMLP()
    trainer = Trainer(
        accelerator="cpu",
        max_steps=steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=callbacks,
        **trainer_kwargs,
    )
    trainer.fit(model, regression_loader())
    return model, trainer


def test_cpu_fit_with_callback_equals_fit_without():
    plain, _ = fit([])
    cb = L2GraphCallback()
    with pytest.warns(UserWarning, match="L2GraphCallback: no CUDA"):
        with_cb, trainer = fit([cb])
    assert trainer.global_step == 6
    for a, b in zip(plain.parameters(), with_cb.parameters()):
        assert torch.equal(a, b)
    summary = cb.summary()
    assert summary["captured"] is False and "no CUDA" in summary["reason"]
    assert all("training_step" not in vars(with_cb) for _ in [0])  # overrides were never installed


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"warmup_steps": 0}, "`warmup_steps` must be an int >= 1"),
        ({"warmup_steps": True}, "`warmup_steps` must be an int >= 1"),
        ({"prefetch": "fast"}, r"`prefetch` must be one of \('off', 'default', 'auto', 'decoy'\)"),
        ({"verify": "yes"}, "`verify` must be a bool"),
        ({"compile": 1}, "`compile` must be a bool"),
        ({"eager_optimizer_fallback": None}, "`eager_optimizer_fallback` must be a bool"),
    ],
)
def test_bad_arguments_are_rejected_naming_them(kwargs, message):
    with pytest.raises((ValueError, TypeError), match=message):
        L2GraphCallback(**kwargs)


def test_plan_object_is_accepted():
    assert L2GraphCallback(prefetch=PrefetchPlan(blocks=4)).prefetch.blocks == 4


def test_state_dict_round_trip():
    cb = L2GraphCallback()
    cb.capture_step = 7
    cb.plans = [{"layer": "net.0.1", "mib": 1.0, "forward": "hint8", "backward": None}]
    other = L2GraphCallback()
    other.load_state_dict(cb.state_dict())
    assert other.state_dict() == cb.state_dict()


def test_manual_optimization_is_refused_clearly():
    class Manual(TinyMLP):
        def __init__(self):
            super().__init__()
            self.automatic_optimization = False

    trainer = Trainer(
        accelerator="cpu",
        max_steps=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        callbacks=[L2GraphCallback()],
    )
    with pytest.raises(ValueError, match="supports automatic optimization only; Manual sets"):
        trainer.fit(Manual(), regression_loader())


def test_unsupported_strategy_is_named():
    from lightning.pytorch.strategies import SingleDeviceStrategy

    class FSDPStrategy(SingleDeviceStrategy):  # stands in for the real FSDP class name
        pass

    trainer = Trainer(
        strategy=FSDPStrategy(device=torch.device("cpu")),
        max_steps=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        callbacks=[L2GraphCallback()],
    )
    with pytest.raises(ValueError, match="does not support the FSDPStrategy.*FSDP, DeepSpeed"):
        trainer.fit(TinyMLP(), regression_loader())


def test_ddp_on_cpu_gloo_falls_back_and_trains_like_plain_ddp():
    plain, _ = fit([], steps=4, strategy="ddp_spawn", devices=2)
    cb = L2GraphCallback()
    with_cb, _ = fit([cb], steps=4, strategy="ddp_spawn", devices=2)
    for a, b in zip(plain.parameters(), with_cb.parameters()):
        assert torch.equal(a, b)
    assert not torch.equal(next(plain.parameters()), next(TinyMLP().parameters()))  # it did train


def test_summary_does_not_claim_a_capture_restored_from_a_checkpoint():
    cb = L2GraphCallback()
    cb.load_state_dict({"capture_step": 12, "plans": []})
    with pytest.warns(UserWarning, match="no CUDA"):
        fit([cb], steps=2)
    assert cb.summary()["captured"] is False and cb.summary()["capture_step"] == 12
