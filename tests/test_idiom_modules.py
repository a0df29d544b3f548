"""CPU: the idiom modules of issue 12 (tests/idiom_modules.py) and the harness that judges them.

The GPU verdicts are in tests/gpu/test_idioms_gpu.py; here every module fits a few steps with a
plain Trainer, and the harness's comparison and refusal handling are checked on the CPU (where the
callback trains eagerly and must equal plain Lightning).
"""

from __future__ import annotations

import pytest
import torch
from lightning.pytorch import LightningModule

from tests.idiom_harness import compare, judge, run_idiom
from tests.idiom_modules import IDIOMS

EXPECTED = [
    "autoencoder",
    "preds_metrics_on_batch_end",
    "dqn_target_sync",
    "docs_lr_warmup",
    "sgd_onecycle_clip",
    "print_item_every_50",
    "hydra_template_mnist",
    "torchmetrics_docs_forward",
    "macro_metric_collection",
    "cpu_causal_mask_transformer",
    "dlrm_cpu_indices",
    "grad_norm_logging",
    "vae_randn",
    "grad_checkpointing",
    "ema_on_batch_end",
    "bf16_true_lambdalr",
    "cleanrl_ppo",
    "manual_gan",
    "word_language_model",
    "adamw_onecycle_momentum",
]


def test_registry_has_the_twenty_idioms():
    assert list(IDIOMS) == EXPECTED
    for name, idiom in IDIOMS.items():
        assert idiom.name == name
        assert idiom.expect in ("capture", "refuse")
        assert idiom.why
        assert idiom.callback_kwargs == {}
        assert idiom.trainer_kwargs["max_steps"] == 60 * idiom.optimizer_steps_per_batch
    assert sum(idiom.expect == "capture" for idiom in IDIOMS.values()) == 17


@pytest.mark.parametrize("name", EXPECTED)
def test_idiom_fits_three_steps_on_cpu(name, one_torch_thread):
    idiom = IDIOMS[name]
    module = idiom.make_module()
    assert isinstance(module, LightningModule)
    assert type(module).__doc__, f"{type(module).__name__} needs a docstring naming its idiom"
    assert idiom.make_loader().dataset[0][0].device.type == "cpu"

    run = run_idiom(name, "plain", steps=3, accelerator="cpu")

    assert run.steps == 3
    if module.automatic_optimization:
        assert all(loss is not None and torch.isfinite(loss).all() for loss in run.losses)
    else:
        assert run.losses == [None, None, None]
        assert {"g_loss", "d_loss"} <= set(run.metrics[-1][1])
    assert run.params and all(torch.isfinite(p).all() for p in run.params.values() if p.is_floating_point())
    if name == "print_item_every_50":
        assert run.stdout.startswith("step 0 loss ")


def test_fresh_modules_and_loaders():
    idiom = IDIOMS["hydra_template_mnist"]
    a, b = idiom.make_module(), idiom.make_module()
    assert a.net is not b.net
    x1, y1 = next(iter(idiom.make_loader()))
    x2, y2 = next(iter(idiom.make_loader()))
    assert torch.equal(x1, x2) and torch.equal(y1, y2)
    assert len(IDIOMS["print_item_every_50"].make_loader()) == 25


def test_compare_is_bitwise_and_nan_aware(one_torch_thread):
    a = run_idiom("autoencoder", "plain", steps=4, accelerator="cpu")
    b = run_idiom("autoencoder", "plain", steps=4, accelerator="cpu")
    assert compare(a, b) is None  # a plain fit is deterministic

    nan_a = run_idiom("autoencoder", "plain", steps=4, accelerator="cpu")
    nan_b = run_idiom("autoencoder", "plain", steps=4, accelerator="cpu")
    nan_a.losses[1] = torch.tensor(float("nan"))
    nan_b.losses[1] = torch.tensor(float("nan"))
    assert compare(nan_a, nan_b) is None
    assert "loss at step 1" in compare(a, nan_b)

    b.params["encoder.0.weight"].view(-1)[0] += 1e-6
    assert "encoder.0.weight" in compare(a, b)
    c = run_idiom("autoencoder", "plain", steps=4, accelerator="cpu")
    c.metrics[3][1]["train_loss"] = c.metrics[3][1]["train_loss"].nextafter(torch.tensor(1.0))
    assert "train_loss" in compare(a, c)
    c = run_idiom("autoencoder", "plain", steps=4, accelerator="cpu")
    key = "epoch_loop.automatic_optimization.optim_progress.optimizer.zero_grad.total.completed"
    assert c.loops[key] == 4  # one zero_grad per step
    c.loops[key] += 1
    assert f"loop progress {key}: 4 (plain) vs 5 (plain)" == compare(a, c)
    c = run_idiom("autoencoder", "plain", steps=5, accelerator="cpu")
    assert "steps" in compare(a, c)


def test_judge_on_cpu_callback_trains_eagerly_and_equals_plain(one_torch_thread):
    result = judge("autoencoder", steps=4, accelerator="cpu")
    assert set(result) >= {"module", "captured", "reason", "equal", "plain_ms", "callback_ms"}
    assert result["captured"] is False
    assert "CUDA" in result["reason"]
    assert result["equal"] is True, result["detail"]


@pytest.mark.parametrize("name", ["manual_gan", "manual_gan_device_noise", "manual_gan_schedulers"])
def test_judge_the_two_optimizer_gan_on_the_emulator_captures_it_equal_to_its_baseline(
    name, one_torch_thread, emulated_cuda_graphs, monkeypatch
):
    """On the CPU emulator the host is the device, so the tutorial's `torch.randn` without a device
    draws where the graph does and is captured too (on a GPU it is refused: tests/gpu/test_idioms_gpu.py)."""
    from tests import idiom_harness

    monkeypatch.setattr(idiom_harness, "_EXTRA_CAPTURABLE_DEVICES", ("cpu",))  # the baseline switches too
    result = judge(name, steps=8, accelerator="cpu")
    assert result["captured"] is True, result["reason"]
    assert result["extra"]["summary"]["captures"] == 1
    assert result["extra"]["summary"]["capturable_from_step"] == 6  # the fourth batch, two steps a batch
    assert result["equal"] is True, result["detail"]
    # the fits' whole wall times, and what the capture cost of them, for the "over its fit" question
    extra = result["extra"]
    assert all(extra[k] > 0 for k in ("plain_fit_s", "callback_fit_s", "plain_again_fit_s")), extra
    assert extra["summary"]["capture_s"] > 0 and extra["summary"]["recaptures"] == 0, extra["summary"]


@pytest.mark.parametrize(
    ("name", "captured", "named"),
    [
        ("nan_guard_bad_batch", False, "`on_before_optimizer_step` may write: `optimizer.zero_grad()`"),
        ("grad_norm_own_clipping", False, "the module's `configure_gradient_clipping` changes the gradients"),
        ("swa_from_configure_callbacks", True, ""),
        ("manual_wgan_gp", True, ""),
    ],
)
def test_judge_the_held_out_hunts_idioms_on_the_emulator(
    name, captured, named, one_torch_thread, emulated_cuda_graphs, monkeypatch
):
    """Idioms a held-out hunt found silently wrong, crashing or refused for a false cause: each now
    captured and equal to its baseline, or refused by name and equal to plain (the bad batch's NaN
    loss included, which the harness takes as equal to NaN)."""
    from tests import idiom_harness

    monkeypatch.setattr(idiom_harness, "_EXTRA_CAPTURABLE_DEVICES", ("cpu",))
    result = judge(name, steps=24, accelerator="cpu")
    assert result["captured"] is captured, result["reason"]
    assert named in (result["reason"] or "")
    assert result["equal"] is True, result["detail"]


@pytest.mark.parametrize("name", ["word_language_model_unchecked", "lstm_state_in_a_layer"])
def test_carried_lstm_state_alone_keeps_the_replays_their_baseline_on_the_emulator(
    name, one_torch_thread, emulated_cuda_graphs, monkeypatch
):
    """With no replay checked (verify=False), the carried hidden state alone keeps the replays right:
    on the module (the word language model) and on a layer that keeps its own (`self.state = ...` in
    a submodule's forward). The latter was reported by the third held-out hunt as found only by the
    sampled check; that was the emulator replaying oneDNN's CPU LSTM (tests/test_graph_emulator.py)."""
    from tests import idiom_harness

    monkeypatch.setattr(idiom_harness, "_EXTRA_CAPTURABLE_DEVICES", ("cpu",))
    result = judge(name, steps=30, accelerator="cpu")
    assert result["captured"] is True, result["reason"]
    assert result["extra"]["summary"]["captures"] == 1
    assert result["equal"] is True, result["detail"]
