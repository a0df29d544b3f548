"""User-style modules for the callback's checks around replays, shared by the CPU emulator tests and the
GPU tests: steps that read state a hook changes between steps (the callback must see each change
before a replay and capture again), and steps that cannot be replayed (refused by name)."""

from __future__ import annotations

import argparse
import functools
import logging
import time
import types
from dataclasses import dataclass, field
from time import monotonic

import torch
from lightning.pytorch import Callback
from omegaconf import OmegaConf
from torch import manual_seed, nn

from tests.lightning_models import TinyMLP, regression_loader


class NoisyDataset(torch.utils.data.Dataset):
    """A dataset carrying a curriculum's noise level, which a hook raises each epoch."""

    def __init__(self):
        self.data = regression_loader(n=240, width=32).dataset
        self.noise = 0.0

    def __len__(self):
        return len(self.data)

    def __getitem__(self, i):
        return self.data[i]


class ReadsTheDataset(TinyMLP):
    """Reads the curriculum's noise from its dataset through the Trainer, by getattr."""

    def on_train_epoch_start(self):
        self.trainer.train_dataloader.dataset.noise = 0.1 * self.current_epoch

    def training_step(self, batch, batch_idx):
        x, y = batch
        noise = getattr(self.trainer.train_dataloader.dataset, "noise", 0.0)
        loss = (1 + noise) * (self.head(self.net(x)).squeeze(-1) - y).square().mean()
        self.log("train/loss", loss)
        return loss


class WeightOnACallback(Callback):
    """Holds a loss weight it raises each epoch."""

    def __init__(self):
        self.alpha = 1.0

    def on_train_epoch_start(self, trainer, pl_module):
        self.alpha = 1.0 + trainer.current_epoch


class TF32FromEpochOne(Callback):
    """Turns TF32 matmuls on for epoch 1 and off again from epoch 2 (a precision schedule), then puts
    back the setting it found. On a GPU TF32 changes an FP32 step's numbers; a graph keeps the kernels
    of its capture."""

    def on_fit_start(self, trainer, pl_module):
        self.found = torch.backends.cuda.matmul.allow_tf32

    def on_train_epoch_start(self, trainer, pl_module):
        torch.backends.cuda.matmul.allow_tf32 = trainer.current_epoch == 1

    def on_fit_end(self, trainer, pl_module):
        torch.backends.cuda.matmul.allow_tf32 = self.found


class AnomalyDetectionFromEpochOne(Callback):
    """Turns autograd's anomaly detection on from epoch 1 (debugging a NaN), off at the fit's end. Its
    NaN checks read every backward output on the host, which a replay would skip."""

    def on_train_epoch_start(self, trainer, pl_module):
        if trainer.current_epoch == 1:
            torch.autograd.set_detect_anomaly(True)

    def on_fit_end(self, trainer, pl_module):
        torch.autograd.set_detect_anomaly(False)


class ReadsACallback(TinyMLP):
    """Weights its loss by a number another callback holds (``self.trainer.callbacks[1].alpha``)."""

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = self.trainer.callbacks[1].alpha * (self.head(self.net(x)).squeeze(-1) - y).square().mean()
        self.log("train/loss", loss)
        return loss


class SwitchesItsLoss(TinyMLP):
    """An epoch-start hook switches what the step calls: a loss function, a partial, a loss module,
    an activation module (parameterless: no parameter or buffer registration changes)."""

    def __init__(self, what="function", **kw):
        super().__init__(**kw)
        self.what = what
        self.on_train_epoch_start()

    def on_train_epoch_start(self):
        epoch = self.current_epoch if self._trainer is not None else 0
        if self.what == "function":
            self.loss_fn = torch.nn.functional.l1_loss if epoch % 2 else torch.nn.functional.mse_loss
        elif self.what == "partial":
            self.loss_fn = functools.partial(torch.nn.functional.huber_loss, delta=1.0 / (1 + epoch))
        elif self.what == "loss module":
            self.loss_fn = nn.HuberLoss(delta=1.0 / (1 + epoch))
        else:
            self.act = nn.GELU() if epoch % 2 else nn.ReLU()

    def training_step(self, batch, batch_idx):
        x, y = batch
        h = self.net(x)
        if self.what == "activation module":
            loss = (self.head(self.act(h)).squeeze(-1) - y).square().mean()
        else:
            loss = self.loss_fn(self.head(h).squeeze(-1), y)
        self.log("train/loss", loss)
        return loss


class SeedsInTheStep(TinyMLP):
    """Seeds torch inside the step before its dropout (to make a step "reproducible"): per step from
    the counter, or with one constant, through `torch.manual_seed` or a name imported from torch; or
    draws its dropout inside `torch.random.fork_rng`, which puts the state back (every eager step then
    draws the same mask). A replay would not seed or put back again."""

    def __init__(self, constant=False, how="torch.manual_seed", **kw):
        super().__init__(**kw)
        self.constant = constant
        self.how = how
        self.drop = nn.Dropout(0.3)

    def training_step(self, batch, batch_idx):
        seed = 1234 if self.constant else 1000 + self.global_step
        x, y = batch
        if self.how == "fork_rng":
            with torch.random.fork_rng(devices=[x.device] if x.is_cuda else []):
                hidden = self.drop(self.net(x))
        else:
            (torch.manual_seed if self.how == "torch.manual_seed" else manual_seed)(seed)
            hidden = self.drop(self.net(x))
        loss = (self.head(hidden).squeeze(-1) - y).square().mean()
        self.log("train/loss", loss)
        return loss


class ReadsWhatItAppended(TinyMLP):
    """Penalises the change from the previous step's loss, kept in a list the step appends to."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self.history = []

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = (self.head(self.net(x)).squeeze(-1) - y).square().mean()
        prev = self.history[-1] if self.history else loss.detach()
        self.history.append(loss.detach())
        out = loss + 0.1 * (loss - prev).abs()
        self.log("train/loss", out)
        return out


class LogsAnUnrecomputableNumber(TinyMLP):
    """Logs a Python number computed from the batch (a local): it changes from step to step, and a
    replay, which runs no Python, cannot compute it again."""

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = (self.head(self.net(x)).squeeze(-1) - y).square().mean()
        self.log("train/loss", loss)
        self.log("examples_seen", float(x.shape[0] * (batch_idx + 1)))
        return loss


class ValidatedDistribution(TinyMLP):
    """A policy head whose Categorical asks for its argument checks (``validate_args=True``): they
    sync with the host, in a replay too, so the step cannot be captured."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self.pi = nn.Linear(32, 4)

    def training_step(self, batch, batch_idx):
        x, y = batch
        dist = torch.distributions.Categorical(logits=self.pi(x), validate_args=True)
        loss = (self.head(self.net(x)).squeeze(-1) - y).square().mean() - 0.01 * dist.entropy().mean()
        self.log("train/loss", loss)
        return loss


class TensorInAContainer(TinyMLP):
    """A loss weight kept as a tensor in a dict or list attribute, replaced by a new tensor per epoch
    (``self.weights["w"] = torch.full(...)``): the graph reads the tensor it was captured with."""

    def __init__(self, container="dict", **kw):
        super().__init__(**kw)
        self.container = container
        self.weights = {"w": torch.ones(())} if container == "dict" else [torch.ones(())]

    def on_train_epoch_start(self):
        key = "w" if self.container == "dict" else 0
        self.weights[key] = torch.full((), 1.0 + self.current_epoch)

    def training_step(self, batch, batch_idx):
        x, y = batch
        w = self.weights["w"] if self.container == "dict" else self.weights[0]
        loss = (self.head(self.net(x)).squeeze(-1) - y).square().mean() * w
        self.log("train/loss", loss)
        return loss


_log = logging.getLogger("between_step_models")


class WritesOutEveryStep(TinyMLP):
    """Writes a line per step from training_step: a print, Python logging, or the Trainer's logger
    (its `log_metrics`, or its `experiment` object). A replay would write nothing."""

    def __init__(self, how="print", **kw):
        super().__init__(**kw)
        self.how = how

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        if self.how == "print":
            print(f"step {self.global_step}")
        elif self.how == "self.print":
            self.print(f"step {self.global_step}")
        elif self.how == "logging":
            _log.warning("step %d", self.global_step)
        elif self.how == "log_metrics":
            self.logger.log_metrics({"seen": 1.0}, step=self.global_step)
        else:
            self.logger.experiment.log_metrics({"seen": 1.0}, step=self.global_step)
        return loss


# --------------------------------------------------------------------------- a layer's code changed mid-fit
class TriplesTheHeadFromEpochOne(Callback):
    """Replaces the head's forward on its instance at epoch 1 (a user's or a library's patch)."""

    def on_train_epoch_start(self, trainer, pl_module):
        if trainer.current_epoch == 1:
            plain = type(pl_module.head).forward
            pl_module.head.forward = lambda x: plain(pl_module.head, x) * 3


class TriplingHead(nn.Linear):
    """The class a conversion swaps in: the same parameters, three times the output."""

    def forward(self, x):
        return super().forward(x) * 3


class SwapsTheHeadsClassAtEpochOne(Callback):
    """Swaps the head's class at epoch 1 (as module conversions that keep the parameters do)."""

    def on_train_epoch_start(self, trainer, pl_module):
        if trainer.current_epoch == 1:
            pl_module.head.__class__ = TriplingHead


class OwnHead(nn.Linear):
    """A layer class of the user's, whose forward a callback patches mid-fit."""


class WithOwnHead(TinyMLP):
    """TinyMLP whose head is the user's own layer class."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self.head = OwnHead(self.head.in_features, 1)


class PatchesTheHeadsClassAtEpochOne(Callback):
    """Patches the head class's forward at epoch 1, and puts it back when the fit ends."""

    def on_train_epoch_start(self, trainer, pl_module):
        if trainer.current_epoch == 1:
            OwnHead.forward = lambda self, x: nn.Linear.forward(self, x) * 3

    def on_train_end(self, trainer, pl_module):
        if "forward" in vars(OwnHead):
            del OwnHead.forward

    def teardown(self, trainer, pl_module, stage):  # a fit that failed: the class is left unpatched too
        self.on_train_end(trainer, pl_module)


# (module class, callback changing its head's code at epoch 1), with their test ids: the CPU and GPU tests'
LAYER_CODE_CHANGES = {
    "instance-forward": (TinyMLP, TriplesTheHeadFromEpochOne),
    "class-swapped": (TinyMLP, SwapsTheHeadsClassAtEpochOne),
    "class-forward-patched": (WithOwnHead, PatchesTheHeadsClassAtEpochOne),
}


# Loss weights kept in configs that the step reads from module level or a closure, as scripts keep
# their hyperparameters, and that a callback sets at each epoch's start. Silent until the step source
# compared attribute chains rooted at module-level names (the replays kept the capture's weight, the
# loss leaving the baseline's at step 30): a config that is not an object of the user's own classes,
# a chain longer than one attribute, a class attribute, a closure variable's attribute; and a keyword
# a `functools.partial` binds, changed in place.
ARGS = argparse.Namespace(loss_weight=1.0)  # CleanRL's module-level `args`
SETTINGS = types.SimpleNamespace(loss_weight=1.0)
OMEGA = OmegaConf.create({"loss": {"weight": 1.0}})  # a Hydra config kept at module level


@dataclass
class LossSettings:
    weight: float = 1.0


@dataclass
class RunSettings:
    loss: LossSettings = field(default_factory=LossSettings)


RUN = RunSettings()


class Hyper:
    """A class of constants."""

    LOSS_WEIGHT = 1.0


class WeightedByAConfig(TinyMLP):
    """TinyMLP whose loss is scaled by :meth:`loss_weight`, read from a config."""

    def loss_weight(self):
        raise NotImplementedError

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = (self.head(self.net(x)).squeeze(-1) - y).square().mean() * self.loss_weight()
        self.log("train/loss", loss)
        return loss


class ReadsArgs(WeightedByAConfig):
    def loss_weight(self):
        return ARGS.loss_weight


class ReadsANamespace(WeightedByAConfig):
    def loss_weight(self):
        return SETTINGS.loss_weight


class ReadsAnOmegaConf(WeightedByAConfig):
    def loss_weight(self):
        return OMEGA.loss.weight


class ReadsANestedConfig(WeightedByAConfig):
    def loss_weight(self):
        return RUN.loss.weight


class ReadsAClassAttribute(WeightedByAConfig):
    def loss_weight(self):
        return Hyper.LOSS_WEIGHT


def _reads_a_closure():
    settings = types.SimpleNamespace(loss_weight=1.0)

    class ReadsAClosure(WeightedByAConfig):
        config = settings  # where the callback reaches it

        def loss_weight(self):
            return settings.loss_weight

    class LogsAClosure(TinyMLP):
        """Logs its factory's config value (not part of its loss)."""

        config = settings

        def training_step(self, batch, batch_idx):
            loss = super().training_step(batch, batch_idx)
            self.log("closure_weight", settings.loss_weight)
            return loss

    return ReadsAClosure, LogsAClosure


ReadsAClosure, LogsAClosure = _reads_a_closure()


class ReadsAPartial(TinyMLP):
    """Its loss a `functools.partial` with a keyword."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self.loss_fn = functools.partial(torch.nn.functional.smooth_l1_loss, beta=1.0)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = self.loss_fn(self.head(self.net(x)).squeeze(-1), y)
        self.log("train/loss", loss)
        return loss


class SetsTheConfigEachEpoch(Callback):
    """Calls ``set(module, 1 + epoch)`` at each epoch's start (1 at the first: every fit starts alike)."""

    def __init__(self, set):
        self.set = set

    def on_train_epoch_start(self, trainer, pl_module):
        self.set(pl_module, 1.0 + trainer.current_epoch)

    def current_weight(self):
        """The weight a change set on this callback (the cases that keep it here)."""
        return self.loss_weight


class ReadsHparamsWithGet(WeightedByAConfig):
    """``self.hparams.get(name, default)``, as steps read optional hyperparameters."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self.save_hyperparameters({"loss_weight": 1.0})

    def loss_weight(self):
        return self.hparams.get("loss_weight", 1.0)


TABLES = types.SimpleNamespace(weights={"loss": 1.0})


class ReadsATableWithGet(WeightedByAConfig):
    def loss_weight(self):
        return TABLES.weights.get("loss")


class WeighsItsLossesByItems(TinyMLP):
    """Multi-task weights in a dict, summed over ``.items()`` (read whole: no subscript names them)."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self.task_weights = {"mse": 1.0, "mae": 1.0}

    def training_step(self, batch, batch_idx):
        x, y = batch
        pred = self.head(self.net(x)).squeeze(-1)
        losses = {"mse": (pred - y).square().mean(), "mae": (pred - y).abs().mean()}
        loss = sum(weight * losses[name] for name, weight in self.task_weights.items())
        self.log("train/loss", loss)
        return loss


class WeighsByAConfigsValues(WeighsItsLossesByItems):
    """The same weights in a module-level config's dict, read through ``.values()``."""

    def training_step(self, batch, batch_idx):
        x, y = batch
        pred = self.head(self.net(x)).squeeze(-1)
        losses = [(pred - y).square().mean(), (pred - y).abs().mean()]
        loss = sum(weight * part for weight, part in zip(TABLES.weights.values(), losses))
        self.log("train/loss", loss)
        return loss


TASKS = types.SimpleNamespace(name="mse")


class PicksItsLossByName(TinyMLP):
    """The loss picked by a config's task name through an f-string key (an f-string that selects, not
    host text)."""

    def training_step(self, batch, batch_idx):
        x, y = batch
        pred = self.head(self.net(x)).squeeze(-1)
        losses = {"mse_loss": (pred - y).square().mean(), "mae_loss": (pred - y).abs().mean()}
        loss = losses[f"{TASKS.name}_loss"]
        self.log("train/loss", loss)
        return loss


class ReadsACallbackThroughALocal(TinyMLP):
    """Finds the callback that holds its loss weight, keeps it in a local and reads the weight from it."""

    def training_step(self, batch, batch_idx):
        x, y = batch
        holder = self.trainer.callbacks[1]
        loss = holder.loss_weight * (self.head(self.net(x)).squeeze(-1) - y).square().mean()
        self.log("train/loss", loss)
        return loss


class FindsItsCallbackWithNext(WeightedByAConfig):
    """Finds the callback holding its weight with ``next(...)`` over the Trainer's callbacks."""

    def loss_weight(self):
        holder = next(c for c in self.trainer.callbacks if hasattr(c, "loss_weight"))
        return holder.loss_weight


class FindsItsCallbackInALoop(WeightedByAConfig):
    """Looks for the callback holding its weight in a loop over the Trainer's callbacks."""

    def loss_weight(self):
        weight = 1.0
        for c in self.trainer.callbacks:
            if hasattr(c, "loss_weight"):
                weight = c.loss_weight
        return weight


class AsksItsCallbackForTheWeight(WeightedByAConfig):
    """Calls a method of the callback that holds its weight."""

    def loss_weight(self):
        return self.trainer.callbacks[1].current_weight()


class ReadsAConfigThroughALocal(WeightedByAConfig):
    """A module-level config kept in a local first (``cfg = SETTINGS``)."""

    def loss_weight(self):
        cfg = SETTINGS
        return cfg.loss_weight


class BranchesOnAConfigThroughALocal(TinyMLP):
    """A branch on a module-level config's value, read through a local."""

    def training_step(self, batch, batch_idx):
        x, y = batch
        cfg = SETTINGS
        loss = (self.head(self.net(x)).squeeze(-1) - y).square().mean()
        if cfg.loss_weight > 1.5:
            loss = loss * 2.0
        self.log("train/loss", loss)
        return loss


def _set_on_the_callback(module, value):
    # the fits' callbacks: a recorder, then the one that sets the config (index 1)
    module.trainer.callbacks[1].loss_weight = value


def _set_omega(module, value):
    OMEGA.loss.weight = value


# (module class, what the callback sets), with their test ids: the CPU and GPU tests'
CONFIG_CHANGES = {
    "argparse-namespace": (ReadsArgs, lambda m, v: setattr(ARGS, "loss_weight", v)),
    "simple-namespace": (ReadsANamespace, lambda m, v: setattr(SETTINGS, "loss_weight", v)),
    "omegaconf": (ReadsAnOmegaConf, _set_omega),
    "nested-dataclass": (ReadsANestedConfig, lambda m, v: setattr(RUN.loss, "weight", v)),
    "class-attribute": (ReadsAClassAttribute, lambda m, v: setattr(Hyper, "LOSS_WEIGHT", v)),
    "closure": (ReadsAClosure, lambda m, v: setattr(type(m).config, "loss_weight", v)),
    "partial-keyword": (ReadsAPartial, lambda m, v: m.loss_fn.keywords.__setitem__("beta", 1.0 / v)),
    "hparams-get": (ReadsHparamsWithGet, lambda m, v: m.hparams.__setitem__("loss_weight", v)),
    "module-level-dict-get": (ReadsATableWithGet, lambda m, v: TABLES.weights.__setitem__("loss", v)),
    "dict-items": (WeighsItsLossesByItems, lambda m, v: m.task_weights.__setitem__("mae", v)),
    "module-level-dict-values": (WeighsByAConfigsValues, lambda m, v: TABLES.weights.__setitem__("loss", v)),
    "f-string-key": (PicksItsLossByName, lambda m, v: setattr(TASKS, "name", "mse" if v % 2 else "mae")),
    "callback-through-a-local": (ReadsACallbackThroughALocal, _set_on_the_callback),
    "callback-found-with-next": (FindsItsCallbackWithNext, _set_on_the_callback),
    "callback-found-in-a-loop": (FindsItsCallbackInALoop, _set_on_the_callback),
    "callback-method": (AsksItsCallbackForTheWeight, _set_on_the_callback),
    "config-through-a-local": (ReadsAConfigThroughALocal, lambda m, v: setattr(SETTINGS, "loss_weight", v)),
    "branch-through-a-local": (
        BranchesOnAConfigThroughALocal,
        lambda m, v: setattr(SETTINGS, "loss_weight", v),
    ),
}


LOGGED_TEMPERATURE = 1.0  # a module-level number the step logs (not part of its loss)


class LogsModuleLevelNumbers(TinyMLP):
    """Logs a module-level number and a config's, which a callback sets at each epoch's start: a replay
    must log the values of its step (until the logged expression was evaluated against the module's
    globals, replays logged the capture's values, silently, on the CPU emulator)."""

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        self.log("temperature", LOGGED_TEMPERATURE)
        self.log("config_weight", SETTINGS.loss_weight)
        return loss


class SetsTheLoggedNumbersEachEpoch(Callback):
    def on_train_epoch_start(self, trainer, pl_module):
        global LOGGED_TEMPERATURE
        LOGGED_TEMPERATURE = 1.0 / (1 + trainer.current_epoch)
        SETTINGS.loss_weight = 1.0 + trainer.current_epoch


class ScalesByAPlainTensor(TinyMLP):
    """A loss scale in a plain tensor attribute (not a buffer) on the module's device, whose memory a
    callback replaces at each epoch's start (``.data = ...``): a graph would go on reading the old
    memory (the CPU emulator replays through aliases of the capture's memory, as a GPU graph does)."""

    def on_fit_start(self):
        self.scale = torch.ones((), device=self.device)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = (self.head(self.net(x)).squeeze(-1) - y).square().mean() * self.scale
        self.log("train/loss", loss)
        return loss


class MovesTheScaleEachEpoch(Callback):
    def on_train_epoch_start(self, trainer, pl_module):
        pl_module.scale.data = torch.full_like(pl_module.scale, 1.0 + trainer.current_epoch)


# ---------------------------------------------------------------------------------------- the clock
TRAINING_STARTED = [0.0]  # set by the tests before each fit


class HalvesItsLossAfterAWhile(TinyMLP):
    """Branches on the wall clock: after `seconds` of training the loss is halved (a time-based
    curriculum). A replay would keep the capture step's branch."""

    seconds = 0.3

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = (self.head(self.net(x)).squeeze(-1) - y).square().mean()
        if time.monotonic() - TRAINING_STARTED[0] > self.seconds:
            loss = loss * 0.5
        self.log("train/loss", loss)
        return loss


def _elapsed():
    return monotonic() - TRAINING_STARTED[0]


class AsksAHelperForTheTime(HalvesItsLossAfterAWhile):
    """The same through a plain function of its module that calls ``monotonic`` imported by name."""

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = (self.head(self.net(x)).squeeze(-1) - y).square().mean()
        if _elapsed() > self.seconds:
            loss = loss * 0.5
        return loss


class LogsItsThroughput(TinyMLP):
    """Reads the clock only for a logged throughput and for a message every 10 batches (host text for
    the step's work)."""

    def training_step(self, batch, batch_idx):
        started = time.perf_counter()
        x, y = batch
        loss = (self.head(self.net(x)).squeeze(-1) - y).square().mean()
        elapsed = time.perf_counter() - started
        self.log("samples_per_s", x.shape[0] / max(elapsed, 1e-9))
        if batch_idx % 10 == 0:
            _log.info("batch %d at %.3f s", batch_idx, time.monotonic())
        return loss
