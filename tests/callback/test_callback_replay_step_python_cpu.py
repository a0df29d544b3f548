"""L2GraphCallback on the CPU graph emulator (continued from ``test_callback_replay_cpu.py``): Python
that varies from step to step, torchmetrics in ``training_step``, host syncs, bookkeeping and outputs.

Each fit with the callback is compared with the eager fit it must equal: its baseline when captured,
plain Lightning when refused.
"""

from __future__ import annotations

import copy
import warnings

import numpy as np
import pytest
import torch
import torchmetrics
from lightning.pytorch import Callback, LightningDataModule, seed_everything
from lightning.pytorch.callbacks import (
    ModelCheckpoint,
)
from lightning.pytorch.loggers import CSVLogger
from torch import nn
from torch.utils.data import DataLoader

from l2lightning import L2GraphCallback
from l2lightning.callback import fit_report
from l2lightning.callback.fit_report import TIMED_FIRST_REPLAYS, TIMING_STRIDE, TIMING_WINDOW
from tests import graph_emulator as emu
from tests.baselines import (
    baseline_of,
    capturable_from_of_the_last_callback_fit,  # noqa: F401 -- the fixture records each callback fit's switch step
)
from tests.between_step_models import (
    CONFIG_CHANGES,
    LogsAnUnrecomputableNumber,
    NoisyDataset,
    ReadsACallback,
    ReadsTheDataset,
    ReadsWhatItAppended,
    SeedsInTheStep,
    SetsTheConfigEachEpoch,
    SwitchesItsLoss,
    TensorInAContainer,
    ValidatedDistribution,
    WeightOnACallback,
    WritesOutEveryStep,
)
from tests.lightning_models import (
    CheckpointedDropout,
    CheckpointedDropoutUnpreserved,
    DropoutOutsideCheckpoint,
    TinyMLP,
    quiet_trainer,
    regression_loader,
)
from tests.logging_models import LoggedEverywhere, ManyLogs, assert_logged_alike
from tests.replay_helpers import (
    Recorder,
    assert_captured_again_like_baseline,
    assert_refused_like_plain,
    assert_same,
    callback,
    captured_pair,
    fit,
)

# every test here runs on the CPU graph emulator (tests/conftest.py)
pytestmark = pytest.mark.usefixtures("emulated_cuda_graphs")


# --------------------------------------------------------------------------- 4. step-variant Python
class TargetSync(TinyMLP):
    """CleanRL-style DQN: a target network copied every 10 steps inside training_step."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self.target = copy.deepcopy(self.head).requires_grad_(False)

    def training_step(self, batch, batch_idx):
        x, y = batch
        if self.global_step % 10 == 0:
            self.target.load_state_dict(self.head.state_dict())
        h = self.net(x)
        loss = (self.head(h).squeeze(-1) - self.target(h).squeeze(-1) - y).square().mean()
        self.log("train/loss", loss)
        return loss


def test_steps_on_another_branch_of_the_step_counter_run_eagerly():
    base, run, cb = captured_pair(TargetSync)
    s = cb.summary()
    assert s["captured"] and s["fallback_steps"] == 2  # steps 10 and 20 copy the target network eagerly
    assert_same(base, run)


class PeriodicPrint(TinyMLP):
    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        if batch_idx % 7 == 0:
            print(f"step {batch_idx} loss {loss.item():.4f}")
        return loss


def test_a_periodic_print_of_item_runs_on_its_steps_and_the_rest_replays(capsys):
    base, run, cb = captured_pair(PeriodicPrint)
    assert cb.summary()["captured"]
    assert_same(base, run)
    printed = [line for line in capsys.readouterr().out.splitlines() if line.startswith("step ")]
    assert len(printed) == 2 * 5  # the baseline's five prints, then the callback run's five


class LocalStepCondition(TinyMLP):
    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        every = self.helper_period()
        if self.global_step % every == 0:
            loss = loss * 1.0
        return loss

    def helper_period(self):
        return 10


def test_eager_steps_predicate_runs_those_steps_eagerly_and_an_opaque_branch_is_named():
    cb = callback(eager_steps=lambda trainer, batch_idx: trainer.global_step % 10 == 0)
    with pytest.warns(
        UserWarning,
        match=r"cannot evaluate.*test_callback_replay_step_python_cpu.py:\d+ \(`if self.global_step % every == 0:`\)",
    ):
        base = fit(baseline_of(LocalStepCondition))
        run = fit(LocalStepCondition, [cb])
    assert cb.summary()["captured"] and cb.fallback_steps == 3  # steps 0 (in the warm-up), 10 and 20
    assert_same(base, run)


def test_settings_set_on_the_callback_between_fits_apply_to_the_next_fit():
    """The callback's arguments are attributes its parts read as a fit starts: `eager_steps` and
    `recapture_wait` set after construction are the ones the next fit uses, and a change during a fit
    waits for the next one (its parts were made with the values it started with)."""
    cb = callback()
    cb.eager_steps = lambda trainer, batch_idx: trainer.global_step % 10 == 0
    cb.recapture_wait = False

    class ChangeMidFit(Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            if trainer.global_step == 12:
                cb.eager_steps = None  # too late for this fit

    base = fit(baseline_of(TinyMLP))
    run = fit(TinyMLP, [cb, ChangeMidFit()])
    assert cb.summary()["captured"] and not cb._decision._recapture_wait
    assert "`eager_steps` asked for it" in cb.summary()["fallback_causes"]
    assert cb.fallback_steps == 3, cb.summary()  # steps 0, 10 and 20: the change at step 12 waits
    assert_same(base, run)
    fit(TinyMLP, [cb])  # the next fit: eager_steps None from its start
    assert cb.summary()["captured"] and cb.fallback_steps == 0, cb.summary()


def test_an_opaque_step_counter_branch_without_eager_steps_is_refused_by_name_and_trains_like_plain():
    """Without `eager_steps` a replay would take the capture step's branch at every step (the other
    branch's steps silently trained on the wrong one): the capture is refused, naming the line."""
    plain = fit(LocalStepCondition, fused=True)
    cb = callback()
    with pytest.warns(
        UserWarning,
        match=r"cannot evaluate, at .*test_callback_replay_step_python_cpu.py:\d+ \(`if self.global_step % every == 0:`\).*"
        r"training eagerly",
    ):
        run = fit(LocalStepCondition, [cb], fused=True)
    assert not cb.summary()["captured"] and "eager_steps" in cb.summary()["reason"]
    assert_same(plain, run)  # fused AdamW: the capturable and the configured steps agree bitwise


class SchedulerInStep(TinyMLP):
    """A per-step LR schedule stepped by hand inside training_step (Lightning's manual-optimization
    pattern, used with automatic optimization), or the LR set there directly (a hand-written warm-up)."""

    def __init__(self, schedule="lambda", **kw):
        super().__init__(fused=True, **kw)
        self.schedule = schedule

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=1e-2, fused=True)
        if self.schedule == "assign":
            return opt
        sch = (
            torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
            if self.schedule == "lambda"
            else torch.optim.lr_scheduler.StepLR(opt, step_size=10, gamma=0.1)
        )
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sch, "interval": "epoch"}}

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        if self.schedule == "assign":
            for group in self.optimizers().param_groups:
                group["lr"] = 1e-2 * min(1.0, (self.global_step + 1) / 20)
        else:
            self.lr_schedulers().step()
        return loss


@pytest.mark.parametrize("schedule", ["lambda", "step", "assign"])
def test_a_learning_rate_changed_inside_training_step_is_refused_by_name(schedule):
    """A replay runs no Python: an LR changed inside the step would stay at the capture's value (with
    StepLR, silently: its LR is constant through the warm-up steps, so nothing else differs). Refused,
    and the fit is plain Lightning's bit for bit: the warm-up steps kept the float LRs, and StepLR, which
    computes each LR from the last, no longer carries the float32 rounding of an LR tensor."""
    plain = fit(SchedulerInStep, steps=25, schedule=schedule)
    cb = callback()
    with pytest.warns(UserWarning, match=r"optimizer's hyperparameters \(param group 0's `lr`"):
        run = fit(SchedulerInStep, [cb], steps=25, schedule=schedule)
    assert not cb.summary()["captured"]
    assert run[2].optimizers[0].param_groups[0]["lr"] == plain[2].optimizers[0].param_groups[0]["lr"]
    assert_same(plain, run)


class ScaledMSE:
    """A plain Python loss object (not an nn.Module) with a number of its own, read in ``__call__``."""

    def __init__(self, count_calls=False):
        self.scale = 1.0
        self.calls = 0
        self.count_calls = count_calls

    def __call__(self, pred, y):
        if self.count_calls:
            self.calls += 1  # its own counter, read below: what a replay would freeze
            return (1.0 + 0.01 * self.calls) * (pred - y).square().mean()
        return self.scale * (pred - y).square().mean()


class HeldLossObject(TinyMLP):
    def __init__(self, count_calls=False, **kw):
        super().__init__(fused=True, **kw)
        self.criterion = ScaledMSE(count_calls)

    def on_train_epoch_start(self):
        self.criterion.scale = 1.0 + self.current_epoch  # a per-epoch loss weight, set by a hook

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = self.criterion(self.head(self.net(x)).squeeze(-1), y)
        self.log("train/loss", loss)
        return loss


def test_a_number_held_by_a_plain_loss_object_is_compared_before_each_replay():
    """The loss object's ``scale`` changes each epoch (a hook sets it): the graph baked the old value,
    so each change captures again; once it went unseen and replays trained on epoch 0's weight."""
    base = fit(baseline_of(HeldLossObject), steps=90)  # 30 batches per epoch: three epochs
    cb = callback()
    with pytest.warns(
        UserWarning, match=r"capturing the step again: Python numbers the step reads changed \(scale\)"
    ):
        run = fit(HeldLossObject, [cb], steps=90)
    assert cb.summary()["captured"] and cb.summary()["captures"] == 3, cb.summary()
    assert_same(base, run)


def test_a_plain_loss_object_that_counts_its_calls_inside_the_step_is_refused_by_name():
    assert_refused_like_plain(
        HeldLossObject, r"changes Python state \(`self.criterion.calls`", steps=12, count_calls=True
    )


class ValidationWeightedLoss(TinyMLP):
    """The loss weighted by the last validation loss, read from the Trainer's metrics in the step."""

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", (self.head(self.net(x)).squeeze(-1) - y).square().mean())

    def training_step(self, batch, batch_idx):
        x, y = batch
        w = self.trainer.callback_metrics.get("val_loss", torch.tensor(1.0))
        loss = (1 + w) * (self.head(self.net(x)).squeeze(-1) - y).square().mean()
        self.log("train/loss", loss)
        return loss


def test_a_step_reading_the_trainers_metrics_is_refused_by_name_and_trains_like_plain():
    """Lightning replaces the validation loss after each validation; a graph would keep the value it
    was captured with (the default 1.0 here, for the whole fit: silently, before this check)."""

    def run(callbacks):
        seed_everything(0)
        model = ValidationWeightedLoss(width=32, depth=3, fused=True)
        rec = Recorder()
        trainer = quiet_trainer(
            accelerator="cpu",
            max_steps=40,
            callbacks=[rec, *callbacks],
            val_check_interval=10,
            limit_val_batches=2,
        )
        trainer.fit(model, regression_loader(n=240, width=32), regression_loader(n=32, width=32))
        return model, rec, trainer

    plain = run([])
    cb = callback()
    with pytest.warns(UserWarning, match=r"the step reads the Trainer's metrics \(.*callback_metrics"):
        got = run([cb])
    assert not cb.summary()["captured"]
    assert_same(plain, got)


class LearningRateInTheLoss(TinyMLP):
    """The scheduler's last LR read inside the step and used in the loss; StepLR moves it each epoch."""

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=1e-2, fused=True)
        sch = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sch, "interval": "epoch"}}

    def training_step(self, batch, batch_idx):
        x, y = batch
        lr = self.lr_schedulers().get_last_lr()[0]
        loss = (1 + lr) * (self.head(self.net(x)).squeeze(-1) - y).square().mean()
        self.log("train/loss", loss)
        return loss


def test_a_step_reading_its_schedulers_state_is_refused_by_name_and_trains_like_plain():
    """The LR is constant within an epoch, so the warm-up steps agree; a graph would then keep epoch
    0's value for the whole fit (silently, before this check)."""
    plain = fit(LearningRateInTheLoss, steps=60)
    cb = callback()
    with pytest.warns(UserWarning, match=r"the step reads an LR scheduler's state \(.*get_last_lr"):
        run = fit(LearningRateInTheLoss, [cb], steps=60)
    assert not cb.summary()["captured"]
    assert_same(plain, run)


class TracksItsLastEpoch(TinyMLP):
    """A number of its own named like a scheduler's state, set per epoch and read in the loss."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self.last_epoch = 0

    def on_train_epoch_start(self):
        self.last_epoch = self.current_epoch

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = (1 + 0.5 * self.last_epoch) * (self.head(self.net(x)).squeeze(-1) - y).square().mean()
        self.log("train/loss", loss)
        return loss


def test_the_modules_own_last_epoch_is_a_value_captured_again_not_a_schedulers_state():
    """`self.last_epoch` was refused as an LR scheduler's state; it is the module's number, compared
    before each replay: captured again per epoch (baked in), bitwise the baseline."""
    assert_captured_again_like_baseline(
        TracksItsLastEpoch,
        r"Python numbers the step reads changed \(last_epoch\)",
        callback_kwargs={"operand_scalars": False},
    )


class NumpyWeight(TinyMLP):
    """A loss weight kept as a NumPy scalar, set per epoch by a hook (np.float32 is not a Python float)."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self.beta = np.float32(1.0)

    def on_train_epoch_start(self):
        self.beta = np.float32(1.0 + self.current_epoch)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = (self.head(self.net(x)).squeeze(-1) - y).square().mean() * self.beta
        self.log("train/loss", loss)
        return loss


def test_a_numpy_scalar_the_step_reads_is_compared_before_each_replay():
    """Once only Python's numbers were compared: the graph kept epoch 0's NumPy weight for the whole fit."""
    assert_captured_again_like_baseline(NumpyWeight, "capturing the step again")


class CurriculumData(LightningDataModule):
    """A data module whose difficulty rises each epoch (its loader is rebuilt every epoch)."""

    def __init__(self):
        super().__init__()
        self.difficulty = 1.0

    def train_dataloader(self):
        self.difficulty = 1.0 + self.trainer.current_epoch
        return regression_loader(n=240, width=32)


class ReadsTheDataModule(TinyMLP):
    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = self.trainer.datamodule.difficulty * (self.head(self.net(x)).squeeze(-1) - y).square().mean()
        self.log("train/loss", loss)
        return loss


def test_a_number_the_step_reads_from_the_datamodule_is_compared_before_each_replay():
    """Read through the Trainer, the data module's difficulty once went unchecked: the graph kept epoch
    0's value for the whole fit."""

    def run(cls, callbacks):
        seed_everything(0)
        model = cls(width=32, depth=3)
        rec = Recorder()
        trainer = quiet_trainer(
            accelerator="cpu", max_steps=90, callbacks=[rec, *callbacks], reload_dataloaders_every_n_epochs=1
        )
        trainer.fit(model, datamodule=CurriculumData())
        return model, rec, trainer

    cb = callback(operand_scalars=False)  # baked in: each change is seen
    with pytest.warns(UserWarning, match=r"capturing the step again: values the step reads changed"):
        got = run(ReadsTheDataModule, [cb])
    base = run(baseline_of(ReadsTheDataModule), [])
    assert cb.summary()["captured"] and cb.summary()["captures"] == 3, cb.summary()
    assert_same(base, got)


@pytest.mark.parametrize("case", ["dataset (getattr)", "callback"])
def test_numbers_the_step_reads_through_the_trainer_from_the_users_objects_are_compared_before_each_replay(
    case,
):
    """The dataset behind ``trainer.train_dataloader`` and the Trainer's callbacks are the user's
    objects: values read from them once went unchecked, and the graph kept epoch 0's for the fit."""
    if case == "callback":
        cls, loader, extra = ReadsACallback, None, WeightOnACallback
    else:
        cls, loader, extra = ReadsTheDataset, DataLoader(NoisyDataset(), batch_size=8), None

    def callbacks():
        return [extra()] if extra else []

    base = fit(baseline_of(cls), callbacks(), steps=90, loader=loader)
    cb = callback(operand_scalars=False)  # baked in: each change is seen
    with pytest.warns(UserWarning, match=r"capturing the step again: values the step reads changed"):
        run = fit(cls, [*callbacks(), cb], steps=90, loader=loader)
    assert cb.summary()["captured"] and cb.summary()["captures"] == 3, cb.summary()
    assert_same(base, run)


@pytest.mark.parametrize("case", ["own last epoch", "callback", "config through a local"])
def test_numbers_read_only_as_tensor_operands_need_one_capture_and_equal_the_baseline(case):
    """The same numbers with device scalars (the default): each epoch's value is written before the
    replays, one capture, and the first replay with a new value is checked against the eager step."""
    extra = []
    if case == "own last epoch":
        cls = TracksItsLastEpoch
    elif case == "callback":
        cls, extra = ReadsACallback, [WeightOnACallback]
    else:
        cls, change = CONFIG_CHANGES["callback-through-a-local"]
        extra = [lambda: SetsTheConfigEachEpoch(change)]
    base = fit(baseline_of(cls), [make() for make in extra], steps=90)
    cb = callback()
    run = fit(cls, [*(make() for make in extra), cb], steps=90)
    s = cb.summary()
    assert s["captured"] and s["captures"] == 1 and s["operand_scalars"]["changes"] == 2, s
    assert (
        s["replay_check"]["reasons"].get("operand value changed") == 2
        and s["replay_check"]["mismatches"] == 0
    )
    assert_same(base, run)


@pytest.mark.parametrize("what", ["function", "partial", "loss module", "activation module"])
def test_a_function_or_submodule_the_step_calls_replaced_between_steps_is_captured_again(what):
    """A graph replays the ops of the code it was captured with: the replays once kept epoch 0's loss
    (or activation) for the whole fit, silently."""
    assert_captured_again_like_baseline(
        SwitchesItsLoss, r"the functions or submodules the step calls were replaced", what=what
    )


@pytest.mark.parametrize(
    ("how", "named"),
    [
        ("torch.manual_seed", "torch.manual_seed"),
        # bound at import: not the patched module attribute; seen as torch's call inside it
        ("imported manual_seed", "torch.random.manual_seed"),
        ("fork_rng", "torch.random.fork_rng"),
    ],
)
@pytest.mark.parametrize("constant", [False, True], ids=["seed-per-step", "constant-seed"])
def test_a_step_that_seeds_torch_is_refused_by_name_and_trains_like_plain(constant, how, named):
    """Replays do not seed: their dropout masks differed from an eager step's (silently, with a
    constant seed the warm-up steps agree on). A name imported from torch and a fork_rng block in the
    step were not seen at all."""
    assert_refused_like_plain(
        SeedsInTheStep,
        rf"`{named}` at .*between_step_models.py:\d+ .* seeds torch",
        constant=constant,
        how=how,
        fused=True,
    )


def test_dropout_in_a_block_checkpointing_recomputes_with_the_forwards_rng_is_refused_by_name():
    """On the CPU stand-in the replays' recomputation would draw other masks than their forward (its
    replay does not put the generator's state back), so outside CUDA the step is refused by name. On
    CUDA it is captured (tests/gpu/test_callback_gpu.py)."""
    assert_refused_like_plain(
        CheckpointedDropout,
        r"`bernoulli_.float` at .*lightning_models.py:\d+ .* draws random numbers .* inside a block "
        r"that `torch.utils.checkpoint` recomputes",
        fused=True,
    )


def test_the_checkpointing_with_dropout_idiom_is_refused_outside_cuda_by_name_and_trains_like_plain():
    """The Hugging Face-style idiom (dropout inside non-reentrant checkpointed residual blocks): refused
    here for the reason above, and the refused fit bitwise plain; on the GPU it is captured
    (tests/gpu/test_idioms_gpu.py)."""
    from tests.idiom_harness import judge

    result = judge("grad_checkpointing_dropout", steps=12, accelerator="cpu")
    assert result["captured"] is False and result["equal"] is True, result["detail"]
    assert "outside CUDA (cpu)" in result["reason"] and "idiom_modules.py" in result["reason"], result[
        "reason"
    ]


@pytest.mark.parametrize("cls", [CheckpointedDropoutUnpreserved, DropoutOutsideCheckpoint])
def test_checkpointed_blocks_without_a_put_back_rng_or_without_dropout_are_captured_bitwise(cls):
    base, run, cb = captured_pair(cls, fused=True)
    assert cb.summary()["captured"] and cb.summary()["fallback_steps"] == 0, cb.summary()
    assert_same(base, run)


@pytest.mark.parametrize(
    ("how", "named"),
    [
        ("print", "`print`"),
        ("self.print", "`print`"),  # LightningModule.print passes it on
        ("logging", "logging to `between_step_models`"),
        ("log_metrics", r"a write to the Trainer's logger \(`CSVLogger.log_metrics`\)"),
        ("experiment", r"a write to the Trainer's logger \(`CSVLogger.experiment`\)"),
    ],
)
def test_a_step_that_writes_out_every_step_is_refused_by_name_and_every_line_is_written(how, named, tmp_path):
    """Replays wrote nothing: every replayed step's print, log line or logger row was missing, silently."""

    def logger(name):
        return {"logger": CSVLogger(tmp_path / name)}

    plain = fit(WritesOutEveryStep, how=how, fused=True, trainer_kwargs=logger("plain"))
    cb = callback()
    with pytest.warns(UserWarning, match=rf"{named} at .*between_step_models.py:\d+ .* runs in the step"):
        run = fit(WritesOutEveryStep, [cb], how=how, fused=True, trainer_kwargs=logger("callback"))
    assert not cb.summary()["captured"]
    assert_same(plain, run)
    if how in ("log_metrics", "experiment"):
        rows = [
            (tmp_path / name).glob("**/metrics.csv").__next__().read_text().count("\n")
            for name in ("plain", "callback")
        ]
        assert rows[0] == rows[1] > 20


class ReturnsItsStep(TinyMLP):
    """Returns the step counters beside the loss (for a callback that reads them from the outputs)."""

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        return {"loss": loss, "step": self.global_step, "epoch": self.current_epoch, "seen": batch_idx * 8}


def test_step_counters_returned_beside_the_loss_are_each_replays_own_and_capture_once():
    """They reach the outputs, not the graph: the step captured again at every step until the callback
    gave up and trained eagerly (correct, but no replay); now each replay's outputs get its own."""
    base, run, cb = captured_pair(ReturnsItsStep, steps=70)
    s = cb.summary()
    assert s["captured"] and s["captures"] == 1 and s["fallback_steps"] == 0, s
    assert_same(base, run)
    numbers = [[(o["step"], o["epoch"], o["seen"]) for o in rec.outputs] for rec in (base[1], run[1])]
    assert numbers[0] == numbers[1] and numbers[1][40] == (40, 1, 80)


def test_a_step_reading_an_element_of_a_list_it_appends_to_is_refused_by_name_and_trains_like_plain():
    """The graph read the element it was captured with at every replay (silently before). Its test
    `if self.history` reads the list too, which a replay's branch choice before the step could not
    follow: either cause refuses it."""
    assert_refused_like_plain(
        ReadsWhatItAppended,
        r"the step reads tensors of `self.history`, a list it appends to|"
        r"the branch at .*tests `self.history`, which the step appends to",
        fused=True,
    )


def test_a_logged_python_number_a_replay_cannot_recompute_ends_the_capture_and_every_logged_value_is_plains():
    """Replays once logged the capture step's number for the rest of the fit (with a warning): wrong
    curves, and a ModelCheckpoint or EarlyStopping monitoring it deciding on a frozen value."""
    plain = fit(LogsAnUnrecomputableNumber, steps=20, fused=True)
    cb = callback()
    with pytest.warns(UserWarning, match=r"`self.log\('examples_seen', ...\)` .* cannot recompute"):
        run = fit(LogsAnUnrecomputableNumber, [cb], steps=20, fused=True)
    assert "examples_seen" in cb.summary()["reason"] and cb.captures == 1
    # every step logs its own number, as plain Lightning does (the losses match plain's to float
    # precision here: the CPU stand-in's capturable AdamW is not bitwise its plain one; on the GPU
    # they are, tests/gpu/test_callback_gpu.py)
    assert [r["examples_seen"] for r in run[1].logged] == [r["examples_seen"] for r in plain[1].logged]
    assert [r["examples_seen"] for r in run[1].logged] == [8.0 * (i + 1) for i in range(20)]
    assert all(torch.allclose(a, b) for a, b in zip(plain[1].losses, run[1].losses))


def test_a_distribution_that_asks_for_its_argument_checks_is_refused_and_trains_like_plain():
    """The default checks are switched off for the capture (the cleanrl_ppo idiom is captured); an
    explicit ``validate_args=True`` keeps them, and they sync inside the capture."""
    cb = assert_refused_like_plain(
        ValidatedDistribution, "waits for the GPU inside the captured step", fused=True
    )
    assert "Categorical(logits=self.pi(x), validate_args=True)" in cb.summary()["reason"], cb.summary()


def test_macro_averaged_metrics_counted_with_bincount_are_captured_and_log_what_the_baseline_logs():
    """torch.bincount syncs (its output size depends on the data): the macro-averaged metrics of
    torchmetrics were refused; traced and captured, their counts come from index_add_ alike."""
    from tests.idiom_modules import MacroMetricCollection, _digits_loader

    def made(cls):
        seed_everything(0)  # the same initial weights for both
        return cls()

    base = fit(None, steps=30, model=made(baseline_of(MacroMetricCollection)), loader=_digits_loader())
    cb = callback()
    run = fit(None, [cb], steps=30, model=made(MacroMetricCollection), loader=_digits_loader())
    assert cb.summary()["captured"] and cb.fallback_steps == 0, cb.summary()
    assert {"train/acc_step", "train/f1_step", "train/precision_step"} <= set(run[1].logged[-1])
    assert_same(base, run)  # losses, every logged value at every step, parameters


@pytest.mark.parametrize("container", ["dict", "list"])
def test_a_tensor_in_a_container_attribute_replaced_between_steps_is_captured_again(container):
    """Only numbers in containers were compared: the replays kept reading epoch 0's tensor, silently."""
    assert_captured_again_like_baseline(
        TensorInAContainer, r"capturing the step again: values the step reads changed", container=container
    )


class Annealed(TinyMLP):
    """A KL-annealing style weight computed in Python from the step counter."""

    def training_step(self, batch, batch_idx):
        x, y = batch
        beta = min(1.0, (self.global_step + 1) / 20)
        loss = beta * (self.head(self.net(x)).squeeze(-1) - y).square().mean()
        self.log("train/loss", loss)
        return loss


def test_python_values_that_change_per_step_are_refused_naming_the_op_and_line():
    plain = fit(Annealed, fused=True)
    cb = callback(operand_scalars=False)  # baked in (with device scalars the ramp is captured once)
    with pytest.warns(
        UserWarning,
        match=r"two warm-up steps ran different work \(op \d+ was `mul.Tensor\(.*\)` at .*test_callback_replay_step_python_cpu.py:\d+",
    ):
        run = fit(Annealed, [cb], fused=True)
    assert not cb.summary()["captured"]
    assert_same(plain, run)


class NoneAtThree(TinyMLP):
    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        return None if batch_idx == 3 else loss


@pytest.mark.parametrize("verify", [False, True])
def test_training_step_returning_none_at_the_capture_step_defers_the_capture(verify):
    base = fit(baseline_of(NoneAtThree))
    cb = callback(verify=verify)
    run = fit(NoneAtThree, [cb])
    assert cb.summary()["captured"] and cb.capture_step == 4
    assert_same(base, run)


class LogsScheduledLR(TinyMLP):
    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        self.log("lr", self.lr_schedulers().get_last_lr()[0])
        self.log("epoch_const", 3.0)
        return loss


class LogsLocalFloat(TinyMLP):
    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        self.log("twice_step", float(self.global_step) * 2)  # read from the source: recomputed per replay
        self.log("opaque", self.opaque_value())  # a call the callback does not evaluate
        return loss

    def opaque_value(self):
        return float(self.global_step)


def test_logged_python_numbers_are_recomputed_per_replay_or_named():
    base, run, cb = captured_pair(LogsScheduledLR, scheduler="cosine")
    assert cb.summary()["captured"]
    assert_same(base, run)
    assert len({s["lr"] for s in run[1].logged[5:]}) > 5
    cb2 = callback()
    with pytest.warns(
        UserWarning, match=r"`self.log\('opaque', ...\)` in training_step logs a Python number"
    ):
        _, rec, _ = fit(LogsLocalFloat, [cb2], steps=8)
    assert cb2.summary()["captured"]
    assert [s["twice_step"] for s in rec.logged] == [float(2 * i) for i in range(8)]


def test_reissued_logs_take_the_shortcut_and_leave_what_eager_logging_leaves(tmp_path):

    def run(cls, callbacks, name):
        seen = LoggedEverywhere(callbacks[0] if callbacks else None)
        logger = CSVLogger(tmp_path, name=name, version=0)
        result = fit(
            cls,
            [seen, *callbacks],
            steps=-1,
            n=96,
            trainer_kwargs={"max_epochs": 3, "logger": logger, "log_every_n_steps": 1},
        )
        result = tuple(result)  # a baseline fit runs now, before its CSV is read
        return result, seen, (tmp_path / name / "version_0" / "metrics.csv").read_text()

    cb = callback()
    got, got_seen, got_csv = run(ManyLogs, [cb], "callback")
    base, base_seen, base_csv = run(baseline_of(ManyLogs), [], "eager")
    assert cb.summary()["captured"] and cb.fallback_steps == 0
    assert_same(base, got)
    assert len(base_seen.seen) == len(got_seen.seen) == 36
    assert_logged_alike(base_seen, got_seen)
    assert got_csv == base_csv
    calls = got_seen.log_calls
    assert len(calls) == 12  # with TinyMLP's two
    # the steps after the capture replay, but those the sampled check computes eagerly log for real
    replays = 36 - 3 - cb.summary()["replay_check"]["checks"]
    # the first re-issue of each call registers it through the real self.log; the rest take the shortcut
    assert all(call.fast_issues == replays - 1 for call in calls), [(c.name, c.fast_issues) for c in calls]


class KeepsStepValues(Callback):
    """Holds on to the tensors callback_metrics gave it (EarlyStopping and ModelCheckpoint keep such a
    reference as their best score), and a copy of each, to check later that nothing overwrote them."""

    def __init__(self, key):
        self.key, self.kept = key, []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        value = trainer.callback_metrics[self.key]
        self.kept.append((value, value.clone()))


def test_a_tensor_logged_per_step_takes_the_one_copy_path_and_later_replays_leave_it_alone():
    base_keeper, keeper = KeepsStepValues("step_only"), KeepsStepValues("step_only")
    base = fit(baseline_of(ManyLogs), [base_keeper], steps=12)
    cb = callback()
    run = fit(ManyLogs, [cb, keeper], steps=12)
    assert cb.summary()["captured"] and cb.fallback_steps == 0
    assert_same(base, run)
    for step, ((held, kept_copy), (_, base_copy)) in enumerate(zip(keeper.kept, base_keeper.kept)):
        assert torch.equal(held, kept_copy), (
            f"the value kept at step {step} was overwritten by a later replay"
        )
        assert torch.equal(kept_copy, base_copy), f"step {step}: {kept_copy} vs {base_copy}"
    assert len({float(c) for _, c in keeper.kept}) > 1  # the values do change from step to step


def test_only_per_step_float_tensors_without_sync_take_the_one_copy_path():
    from l2lightning.guards.log_replay import ReissuedLog

    class Logs(TinyMLP):
        def training_step(self, batch, batch_idx):
            loss = super().training_step(batch, batch_idx)
            self.log("per_step", loss)
            self.log("per_epoch", loss, on_step=False, on_epoch=True)
            self.log("both", loss, on_step=True, on_epoch=True)
            self.log("synced", loss, sync_dist=True)
            self.log("half", loss.half())
            return loss

    cb = callback()
    seen = LoggedEverywhere(cb)
    fit(Logs, [seen, cb], steps=8)
    assert cb.summary()["captured"]
    step_only = {c.name: c._step_only for c in seen.log_calls if isinstance(c, ReissuedLog)}
    # "synced" qualifies (sync_dist only matters across processes, checked per call); half does not
    assert step_only == {
        "train/loss": True,
        "train/pred_mean": True,
        "per_step": True,
        "per_epoch": False,
        "both": False,
        "synced": True,
        "half": False,
    }, step_only


# --------------------------------------------------------------------------- 5. torchmetrics in training_step
class MetricsInStep(TinyMLP):
    """The hydra-template and torchmetrics-docs patterns: metrics updated and logged in training_step."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self.classes = nn.Linear(32, 4)
        self.train_loss = torchmetrics.MeanMetric()
        self.train_max = torchmetrics.MaxMetric()
        self.train_acc = torchmetrics.Accuracy(task="multiclass", num_classes=4)

    def training_step(self, batch, batch_idx):
        x, y = batch
        h = self.net(x)
        pred = self.head(h).squeeze(-1)
        logits = self.classes(h)
        target = (y.abs() * 2).long().clamp(max=3)
        loss = (pred - y).square().mean() + nn.functional.cross_entropy(logits, target)
        self.train_loss(loss)
        self.train_max.update(pred.max())
        self.train_acc(logits, target)
        self.log("train/loss", self.train_loss, on_step=False, on_epoch=True)
        self.log("train/acc", self.train_acc, on_step=True, on_epoch=True)
        self.log("train/max", self.train_max, on_step=False, on_epoch=True)
        return loss


def test_after_replay_writes_a_metrics_step_attributes_through_its_own_setattr_when_it_has_one():
    from l2lightning.guards.metric_binding import MetricBinding, _plain_step_attributes

    class Watched(torchmetrics.MeanMetric):
        def __setattr__(self, name, value):
            if name in ("_update_count", "_computed", "_forward_cache"):
                self.__dict__.setdefault("set_through_setattr", []).append(name)
            super().__setattr__(name, value)

    plain, watched = torchmetrics.MeanMetric(), Watched()
    assert _plain_step_attributes(plain) and not _plain_step_attributes(watched)
    for metric in (plain, watched):
        binding = MetricBinding({"m": metric})
        metric(torch.tensor(2.0))  # what a captured step does: one update, a step value
        binding.finish_capture()
        vars(metric).pop("set_through_setattr", None)
        before = metric._update_count
        binding.after_replay()
        assert metric._update_count == before + 1 and metric._computed is None
        assert torch.equal(metric._forward_cache, torch.tensor(2.0))
    assert "set_through_setattr" not in vars(plain)
    assert vars(watched)["set_through_setattr"] == ["_update_count", "_computed", "_forward_cache"]


def test_tensor_state_metrics_update_inside_the_graph_and_log_like_eager():
    base, run, cb = captured_pair(MetricsInStep, steps=-1, n=96, trainer_kwargs={"max_epochs": 3})
    assert cb.summary()["captured"] and cb.fallback_steps == 0
    assert_same(base, run)
    for key in ("train/loss", "train/acc_epoch", "train/max", "train/acc_step"):
        assert torch.equal(base[2].callback_metrics[key], run[2].callback_metrics[key]), key


class CatInStep(TinyMLP):
    def __init__(self, **kw):
        super().__init__(**kw)
        self.preds = torchmetrics.CatMetric()

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        self.preds.update(loss.detach())
        return loss


def test_list_state_metrics_are_refused_by_name_and_train_like_plain():
    plain = fit(CatInStep)
    cb = callback()
    with pytest.warns(UserWarning, match=r"`preds` \(CatMetric\) keeps a list state"):
        run = fit(CatInStep, [cb])
    assert not cb.summary()["captured"]
    assert_same(plain, run)


# --------------------------------------------------------------------------- 7. host syncs
def test_a_host_sync_every_step_is_refused_at_the_first_step_naming_the_line():
    plain = fit(TinyMLP, sync_in_step=True)
    cb = callback()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        run = fit(TinyMLP, [cb], sync_in_step=True)
    messages = [str(w.message) for w in caught if "L2GraphCallback" in str(w.message)]
    assert any("lightning_models.py:" in m and "`.item()`" in m and "eager_steps" in m for m in messages), (
        messages
    )
    assert emu.FakeGraph.instances == 0
    assert_same(plain, run)  # refused before the first update: the plain fit, bit for bit


# --------------------------------------------------------------------------- 8./9. bookkeeping and outputs
class DictOutputs(TinyMLP):
    def training_step(self, batch, batch_idx):
        x, y = batch
        pred = self.head(self.net(x)).squeeze(-1)
        loss = (pred - y).square().mean()
        return {"loss": loss, "preds": pred.detach()}


def test_extra_outputs_are_fresh_tensors_each_step():
    base, run, cb = captured_pair(DictOutputs, steps=12)
    preds_b = [o["preds"] for o in base[1].outputs]
    preds_r = [o["preds"] for o in run[1].outputs]
    assert all(torch.equal(a, b) for a, b in zip(preds_b, preds_r))
    assert len({p.data_ptr() for p in preds_r}) == len(preds_r)


def test_partial_batch_at_the_capture_step_defers_the_capture():
    base = fit(baseline_of(TinyMLP), steps=-1, n=28, trainer_kwargs={"max_epochs": 4})  # batches 8, 8, 8, 4
    cb = callback()
    run = fit(TinyMLP, [cb], steps=-1, n=28, trainer_kwargs={"max_epochs": 4})
    assert cb.summary()["captured"] and cb.fallback_steps == 3  # only the three later partial batches
    assert_same(base, run)


def test_timing_is_a_bounded_window_and_teardown_drops_references(monkeypatch):
    monkeypatch.setattr(fit_report, "TIMING_STRIDE", 1)  # every replay timed: the window fills
    cb = callback()
    model, _, trainer = fit(TinyMLP, [cb], steps=TIMING_WINDOW + 40)
    assert len(cb._fit_report.timing.graph) == TIMING_WINDOW
    assert (
        cb._fit.module is None
        and cb._slots.state.graph is None
        and cb._fit.optimizer is None
        and cb._fit.trainer is None
    )
    assert not {"training_step", "log"} & set(vars(model))
    assert "step" not in vars(trainer.optimizers[0])


def test_replays_are_timed_each_until_the_first_window_then_one_in_the_stride():
    made = []
    cb = callback()
    events = cb._events
    cb._events = lambda: made.append(1) or events()  # the replays' events (the warm-up's too)
    base = fit(baseline_of(TinyMLP), steps=120)
    run = fit(TinyMLP, [cb], steps=120)
    assert_same(base, run)  # untimed replays run the same graph
    replays = cb._fit_report.timing.graph_count
    assert replays > TIMED_FIRST_REPLAYS + 4 * TIMING_STRIDE
    timed = TIMED_FIRST_REPLAYS + sum(
        1 for n in range(TIMED_FIRST_REPLAYS, replays) if n % TIMING_STRIDE == 0
    )
    assert timed < replays
    assert len(cb._fit_report.timing.graph) == timed
    assert len(made) == timed + len(
        cb._fit_report.timing.eager
    )  # no pair of events made for an untimed replay
    assert cb.summary()["graph_step_ms"] is not None


class StepSchedule(TinyMLP):
    def __init__(self, **kw):
        super().__init__(scheduler="step", **kw)


def test_checkpoints_hold_exact_float_lrs_and_resume_equals_an_uninterrupted_run(tmp_path):
    def run(with_cb, ckpt_path=None, save_dir=None, steps=30):
        seed_everything(0)
        model = (StepSchedule if with_cb else baseline_of(StepSchedule))(width=32, depth=3)
        cbs = [callback()] if with_cb else []
        if save_dir is not None:
            cbs.append(
                ModelCheckpoint(dirpath=save_dir, every_n_train_steps=10, save_top_k=-1, filename="{step}")
            )
        t = quiet_trainer(
            accelerator="cpu", max_steps=steps, callbacks=cbs, enable_checkpointing=save_dir is not None
        )
        t.fit(model, regression_loader(n=80, width=32), ckpt_path=ckpt_path)
        return model, t

    full, trainer = run(True, save_dir=tmp_path / "cb")
    scheduler = trainer.lr_scheduler_configs[0].scheduler
    assert all(type(v) is float for v in scheduler._last_lr)
    ck = torch.load(tmp_path / "cb" / "step=20.ckpt", weights_only=False)
    group = ck["optimizer_states"][0]["param_groups"][0]
    assert group["lr"] == 0.01 * 0.5**4 and type(group["lr"]) is float and group["capturable"] is False
    assert all(type(v) is float for v in ck["lr_schedulers"][0]["_last_lr"])
    resumed, _ = run(True, ckpt_path=str(tmp_path / "cb" / "step=20.ckpt"))
    assert all(torch.equal(p, q) for p, q in zip(full.parameters(), resumed.parameters()))


class BatchNormAndMetric(MetricsInStep):
    def __init__(self, **kw):
        super().__init__(**kw)
        self.net = nn.Sequential(nn.Linear(32, 32), nn.BatchNorm1d(32), nn.GELU())


def test_finding_the_prefetch_chain_leaves_no_trace(monkeypatch):
    """The prefetch set-up runs training_step on the static batch (and the tuner times layer copies):
    BatchNorm statistics, metric states and the RNG must come out as they went in."""
    from l2lightning.callback.prefetch_setup import PrefetchSetup

    def dry_run_hooks(self, pl_module):
        self._fit.originals["log"], saved_log = (lambda *a, **k: None), self._fit.originals["log"]
        try:
            self._fit.originals["training_step"](self.static_batch.batch, 0)
            torch.rand(3)  # the tuner draws random inputs
        finally:
            self._fit.originals["log"] = saved_log
        return None

    monkeypatch.setattr(PrefetchSetup, "_prefetch_hooks", dry_run_hooks)
    base = fit(baseline_of(BatchNormAndMetric), steps=-1, n=96, trainer_kwargs={"max_epochs": 2})
    cb = L2GraphCallback(prefetch="default", log_timing=False)
    run = fit(BatchNormAndMetric, [cb], steps=-1, n=96, trainer_kwargs={"max_epochs": 2})
    assert cb.summary()["captured"]
    assert_same(base, run)


# --------------------------------------------------------------------------- more of the same kind
class Planted(TinyMLP):
    """Differs only inside a capture: what verify=True exists to catch."""

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        return loss * 1.001 if emu.CAPTURING[0] else loss


def test_a_verify_failure_raises_and_leaves_nothing_installed():
    from l2lightning import EquivalenceError

    seed_everything(0)
    model = Planted(width=32, depth=3)
    trainer = quiet_trainer(accelerator="cpu", max_steps=8, callbacks=[callback(verify=True)])
    with pytest.raises(EquivalenceError, match="captured step vs eager step"):
        trainer.fit(model, regression_loader(n=240, width=32))
    assert not {"training_step", "backward", "optimizer_zero_grad", "log"} & set(vars(model))
    group = trainer.optimizers[0].param_groups[0]
    assert group["capturable"] is False and type(group["lr"]) is float
    assert "step" not in vars(trainer.optimizers[0])


def test_a_second_fit_on_the_same_trainer_and_callback_matches():
    def two_fits(cls, callbacks):
        seed_everything(0)
        model = cls(width=32, depth=3)
        trainer = quiet_trainer(accelerator="cpu", max_steps=10, callbacks=callbacks)
        trainer.fit(model, regression_loader(n=240, width=32))
        trainer.fit_loop.epoch_loop.max_steps = 25
        trainer.fit(model, regression_loader(n=240, width=32))
        return model, trainer

    cb = callback()
    run, trainer = two_fits(TinyMLP, [cb])
    base, _ = two_fits(baseline_of(TinyMLP), [])
    assert trainer.global_step == 25 and cb.summary()["captured"]
    assert all(torch.equal(p, q) for p, q in zip(base.parameters(), run.parameters()))


class ValidatedStepSchedule(StepSchedule):
    def validation_step(self, batch, batch_idx):
        self.log("val", super().training_step(batch, batch_idx))


def test_partial_batches_with_a_step_schedule_and_validation_match():
    kw = dict(
        steps=40,
        n=60,
        trainer_kwargs={"val_check_interval": 3, "num_sanity_val_steps": 0},
    )

    def run(cls, callbacks):
        seed_everything(0)
        model = cls(width=32, depth=3)
        trainer = quiet_trainer(
            accelerator="cpu", max_steps=kw["steps"], callbacks=callbacks, **kw["trainer_kwargs"]
        )
        trainer.fit(model, regression_loader(n=kw["n"], width=32), regression_loader(n=16, width=32, seed=4))
        return model, trainer

    cb = callback()
    model, tr = run(ValidatedStepSchedule, [cb])
    base, tb = run(baseline_of(ValidatedStepSchedule), [])
    assert cb.summary()["captured"] and cb.fallback_steps > 0  # the partial last batch of each epoch
    assert all(torch.equal(p, q) for p, q in zip(base.parameters(), model.parameters()))
    sb, sr = tb.lr_scheduler_configs[0].scheduler, tr.lr_scheduler_configs[0].scheduler
    assert sb.last_epoch == sr.last_epoch and sb.get_last_lr() == sr.get_last_lr()
    assert torch.equal(tb.callback_metrics["val"], tr.callback_metrics["val"])


class InfAtLargeInputs(TinyMLP):
    def training_step(self, batch, batch_idx):
        x, y = batch
        x = x * torch.where(x.abs().max() > 2.9, torch.tensor(float("inf")), torch.tensor(1.0))
        return super().training_step((x, y), batch_idx)


def test_gradient_clipping_with_non_finite_gradients_matches_bit_for_bit():
    from l2lightning.verify import compare

    base, run, cb = captured_pair(InfAtLargeInputs, steps=20, trainer_kwargs={"gradient_clip_val": 0.5})
    assert cb.summary()["captured"]
    assert compare(dict(base[0].named_parameters()), dict(run[0].named_parameters()), "params").ok
