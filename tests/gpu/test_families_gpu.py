"""GPU: every model family fits a few steps through the entry point with `l2=verify`
(L2GraphCallback(verify=True, prefetch="default"), deterministic kernels): the step is captured and the
captured step is bit-identical to the eager one."""

from __future__ import annotations

import math

import pytest
from hydra import compose, initialize_config_dir

import l2lightning.app.train as train
from l2lightning import _env
from l2lightning._resources import config_dir
from l2lightning.app.models import FAMILIES

pytestmark = pytest.mark.gpu

# small, but with some layers of >= 256 KiB so that the default plans prefetch something
GPU_SIZES = {
    "mlp_stack": ["model.width=512", "model.depth=4", "data.batch_size=4"],
    "rl_policy": [
        "model.hidden=512",
        "model.depth=2",
        "data.batch_size=8",
        "data.steps_per_epoch=16",
        "data.env_backend=numpy",
    ],
    "recommender": [
        "model.num_tables=4",
        "model.num_embeddings=4096",
        "model.bottom_mlp=[128]",
        "model.top_mlp=[512,256]",
        "data.batch_size=8",
    ],
    "conv_stack": ["model.channels=[32,64]", "data.image_size=32", "data.batch_size=4"],
    "vit": ["model.image_size=64", "model.dim=128", "model.depth=2", "model.heads=4", "data.batch_size=4"],
    "text_encoder": [
        "model.vocab_size=512",
        "model.seq_len=32",
        "model.d_model=128",
        "model.nhead=4",
        "model.num_layers=2",
        "model.dim_feedforward=512",
        "data.batch_size=4",
    ],
}
COMMON = [
    "trainer=gpu",
    "l2=verify",
    "trainer.max_steps=8",  # 3 eager warm-up steps, the capture (verified), 4 replays
    "trainer.enable_progress_bar=false",
    "trainer.enable_model_summary=false",
    "validate=false",
]


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_family_is_captured_and_verified(family, tmp_path):
    overrides = [f"model={family}", *GPU_SIZES[family], *COMMON]
    if family != "rl_policy":
        overrides += ["data.train_batches=16", "data.val_batches=1"]
    with initialize_config_dir(str(config_dir()), version_base="1.3"):
        cfg = compose("train", overrides=overrides, return_hydra_config=True)
    assert cfg.l2.verify == "capture" and cfg.l2.prefetch == "default" and cfg.trainer.deterministic is True

    result = train.run(cfg, output_dir=tmp_path, overrides=overrides)

    assert result["callback"] is True and result["device"] != "cpu"
    assert result["captured"] is True, result["reason"]
    assert result["verify"] is not None and "bit-identical" in result["verify"], result["verify"]
    assert result["fallback_steps"] == 0
    assert result["steps"] == 8 and math.isfinite(result["final_loss"])
    assert result["graph_step_ms"] > 0 and result["eager_step_ms"] > 0 and result["speedup"] > 0
    if _env.prefetch_unavailable_reason() is None:
        assert result["plans"], "no layer chain reported"
        if family != "conv_stack":  # its conv weights are all < 256 KiB: no default plan
            assert any(row["forward"] for row in result["plans"]), result["plans"]
