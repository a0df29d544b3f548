"""CPU test: `ckpt_path=` through the training entry point resumes a run exactly.

An uninterrupted run and a run resumed from its mid-run checkpoint end with bit-identical parameters
and optimizer state. The checkpoint is taken at an epoch boundary, and the data comes in a fixed
order (`OrderedVectorData`): Lightning restarts a plain DataLoader at the start of its epoch after a
resume, and the packaged data modules shuffle from one generator per fit, whose state is not in the
checkpoint, so with them a resumed run sees other batches from the next epoch on.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch.utils.data import DataLoader

import l2lightning.app.train as train
from l2lightning.app.models import VectorData
from tests.train_helpers import run_overrides

pytestmark = pytest.mark.usefixtures("one_torch_thread")

# `data._target_` of the runs: the class below, found by Hydra from the repository root
ORDERED_DATA = "tests.test_app_train_resume.OrderedVectorData"
STEPS, MID = 6, 2  # checkpoints every 2 steps, one epoch each


class OrderedVectorData(VectorData):
    """`VectorData` without shuffling: every epoch sees the batches in the same order."""

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.train_set, batch_size=self.batch_size, shuffle=False)


def resume_overrides(
    run_dir: Path, steps: int = STEPS, every: int = MID, device: str = "cpu", width: int = 16
) -> list[str]:
    """The runs' overrides: an MLP, checkpoints every `every` steps (each an epoch end), all kept."""
    return [
        f"model.width={width}",
        "model.depth=2",
        f"data._target_={ORDERED_DATA}",
        "data.batch_size=4",
        f"data.train_batches={every}",
        "data.val_batches=1",
        f"trainer={device}",
        f"trainer.max_steps={steps}",
        "trainer.enable_checkpointing=true",
        "trainer.enable_progress_bar=false",
        f"callbacks.model_checkpoint.every_n_train_steps={every}",
        "callbacks.model_checkpoint.save_top_k=-1",
        "validate=false",
        "eager_baseline_steps=0",
        f"hydra.run.dir={run_dir}",
    ]


def assert_same_checkpoint(a: Path, b: Path) -> None:
    """Model parameters and optimizer state of two checkpoints, bit for bit."""
    sa, sb = (torch.load(p, map_location="cpu", weights_only=False) for p in (a, b))
    assert sa["global_step"] == sb["global_step"]
    assert sa["state_dict"].keys() == sb["state_dict"].keys()
    for name, tensor in sa["state_dict"].items():
        assert torch.equal(tensor, sb["state_dict"][name]), name
    for state_a, state_b in zip(
        sa["optimizer_states"][0]["state"].values(), sb["optimizer_states"][0]["state"].values()
    ):
        for key, value in state_a.items():
            assert torch.equal(torch.as_tensor(value), torch.as_tensor(state_b[key])), key


def test_resume_from_mid_run_checkpoint_equals_uninterrupted_run(tmp_path):
    full_dir, resumed_dir = tmp_path / "full", tmp_path / "resumed"
    full = run_overrides(resume_overrides(full_dir), full_dir)
    mid = full_dir / "checkpoints" / f"epoch0-step{MID}.ckpt"
    assert mid.is_file() and full["steps"] == STEPS

    overrides = [*resume_overrides(resumed_dir), f"ckpt_path={mid}"]
    resumed = run_overrides(overrides, resumed_dir)

    assert resumed["ckpt_path"] == str(mid) and resumed["steps"] == STEPS
    # it says it resumed, and counts the steps it ran itself
    assert full["resumed_from_step"] is None and full["fit_steps"] == STEPS
    assert resumed["resumed_from_step"] == MID and resumed["fit_steps"] == STEPS - MID
    assert train.summary_line(resumed).startswith(
        f"l2lightning: {STEPS - MID} steps (resumed from step {MID}, to step {STEPS}) on cpu;"
    )
    assert train.summary_line(full).startswith(f"l2lightning: {STEPS} steps on cpu;")
    assert resumed["final_loss"] == full["final_loss"]
    # only the steps after the checkpoint ran (and were timed)
    assert resumed["eager_steps_timed"] < full["eager_steps_timed"]
    last = f"epoch{STEPS // MID - 1}-step{STEPS}.ckpt"
    assert_same_checkpoint(full_dir / "checkpoints" / last, resumed_dir / "checkpoints" / last)
    assert_same_checkpoint(full_dir / "checkpoints" / "last.ckpt", resumed_dir / "checkpoints" / "last.ckpt")
