"""Modules whose step runs code beyond training_step's own source (l2lightning.guards.called_code): a custom
layer's forward and hooks registered on the module, its parameters and nn.Module's global hooks, each
reading a module-level value an epoch hook changes. Shared by the CPU and GPU callback tests."""

from __future__ import annotations

import functools

import torch
from lightning.pytorch import Callback
from torch import nn

from tests.lightning_models import TinyMLP

# what the layers, hooks and losses below read; `Raise` sets them at each epoch's start
SCALE = 1.0
CLIP = 0.01
GAMMA = 1.0
# what the step's code appends to (one element per step)
SEEN: list = []
# what a hook counts with `global` (refused)
CALLS = 0


class Raise(Callback):
    """Sets the module-level values to a new number at every epoch's start (the first one included)."""

    def on_train_epoch_start(self, trainer, pl_module):
        global SCALE, CLIP, GAMMA
        SCALE = 1.0 + trainer.current_epoch
        CLIP = 0.01 * (1 + trainer.current_epoch)
        GAMMA = 1.0 + trainer.current_epoch


def reset() -> None:
    global SCALE, CLIP, GAMMA, CALLS
    SCALE, CLIP, GAMMA, CALLS = 1.0, 0.01, 1.0, 0
    SEEN.clear()


class Scaled(nn.Module):
    """A custom layer: its forward reads SCALE through a helper method."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x):
        return self.scaled(self.inner(x))

    def scaled(self, y):
        return y * SCALE


class Encoder(nn.Module):
    """A layer whose step-time method is not its forward (a VAE's `encode`)."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x):
        return self.inner(x)

    def encode(self, x):
        return self.inner(x) * SCALE


class EncodesInTheStep(TinyMLP):
    def __init__(self, **kw):
        super().__init__(**kw)
        self.encoder = Encoder(self.head)

    def training_step(self, batch, batch_idx):
        x, y = batch
        pred = self.encoder.encode(self.net(x)).squeeze(-1)
        loss = (pred - y).square().mean()
        self.log("train/loss", loss)
        return loss


class ScaleGradient(torch.autograd.Function):
    """A custom autograd Function (a domain-adversarial gradient reversal's shape): backward reads SCALE."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad * SCALE


class ScalesItsGradient(TinyMLP):
    def training_step(self, batch, batch_idx):
        x, y = batch
        pred = self.head(ScaleGradient.apply(self.net(x))).squeeze(-1)
        loss = (pred - y).square().mean()
        self.log("train/loss", loss)
        return loss


class WrapsItsHead(TinyMLP):
    """TinyMLP whose head is wrapped in the custom layer `layer`."""

    layer: type  # set by each subclass

    def __init__(self, **kw):
        super().__init__(**kw)
        self.head = type(self).layer(self.head)


class ScaledHead(WrapsItsHead):
    layer = Scaled


def clip_grad(grad):
    return grad.clamp(-CLIP, CLIP)


def clamp_accumulated(param):
    param.grad.clamp_(-CLIP, CLIP)


def scale_output(module, inputs, output):
    return output * SCALE


def count_call(grad):
    global CALLS
    CALLS += 1


class ClipsFromTrainStart(Callback):
    """Registers the clipping hook in on_train_start; listed after L2GraphCallback, it runs after its."""

    def on_train_start(self, trainer, pl_module):
        pl_module.head.weight.register_hook(clip_grad)


class Clipper:
    """A hook object of the user's: its limit is an attribute a callback changes."""

    def __init__(self) -> None:
        self.limit = 0.01

    def __call__(self, grad):
        return grad.clamp(-self.limit, self.limit)


class WidenClipper(Callback):
    """Widens the module's Clipper at every epoch's start."""

    def on_train_epoch_start(self, trainer, pl_module):
        pl_module.clipper.limit = 0.01 * (1 + trainer.current_epoch)


class Hooked(TinyMLP):
    """TinyMLP with one hook registered in __init__, by kind."""

    def __init__(self, hook: str = "tensor", **kw):
        super().__init__(**kw)
        self.clipper = None
        weight = self.head.weight
        if hook == "tensor":  # a plain function, read from its source
            weight.register_hook(clip_grad)
        elif hook == "tensor-lambda":  # a lambda, read from its bytecode
            weight.register_hook(lambda grad: grad.clamp(-CLIP, CLIP))
        elif hook == "post-accumulate":
            weight.register_post_accumulate_grad_hook(clamp_accumulated)
        elif hook == "forward":
            self.head.register_forward_hook(scale_output)
        elif hook == "full-backward":
            self.head.register_full_backward_hook(lambda m, gin, gout: (gin[0] * SCALE,))
        elif hook == "object":  # a callable object: its attributes are compared like a callback's
            self.clipper = Clipper()
            weight.register_hook(self.clipper)
        elif hook == "counts":
            weight.register_hook(count_call)
        elif hook == "appends":
            weight.register_hook(lambda grad: SEEN.append(grad.norm().detach()))
        else:
            raise ValueError(f"hook: {hook!r}")


class GlobalForwardHook(TinyMLP):
    """A global nn.Module forward hook (register_module_forward_hook), removed at the fit's end."""

    def on_fit_start(self):
        head = self.head
        self._handle = torch.nn.modules.module.register_module_forward_hook(
            lambda m, i, o: o * SCALE if m is head else None
        )

    def on_fit_end(self):
        self._handle.remove()


class AppendsToAModuleList(TinyMLP):
    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        SEEN.append(loss.detach())
        return loss


def weighted_mse(pred, target, weight=1.0):
    return (pred - target).square().mean() * GAMMA * weight


class WeightedMSE:
    """A loss object of the user's (not a module): its __call__ reads GAMMA."""

    def __call__(self, pred, target):
        return (pred - target).square().mean() * GAMMA


class Schedule:
    """A plain object of the user's whose method the step calls (`self.schedule.weight()`)."""

    def weight(self):
        return GAMMA


class HeldLoss(TinyMLP):
    """The step calls a loss the module keeps in an attribute: a function, a partial, its own method,
    a loss object, or a plain loss times a held schedule object's weight; each reads GAMMA."""

    def __init__(self, held: str = "function", **kw):
        super().__init__(**kw)
        self.loss_fn = {
            "function": weighted_mse,
            "partial": functools.partial(weighted_mse, weight=2.0),
            "method": self.own_loss,
            "object": WeightedMSE(),
            "schedule-method": lambda pred, target: (pred - target).square().mean(),
        }[held]
        self.schedule = Schedule() if held == "schedule-method" else None

    def own_loss(self, pred, target):
        return (pred - target).square().mean() * GAMMA

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = self.loss_fn(self.head(self.net(x)).squeeze(-1), y)
        if self.schedule is not None:
            loss = loss * self.schedule.weight()
        self.log("train/loss", loss)
        return loss


def double(module, inputs, output):
    return output * 2


class ChangesHooksAtEpoch1(Callback):
    """At epoch 1's start: adds a gradient clamp, adds a forward hook, or removes the module's own."""

    def __init__(self, how: str) -> None:
        self.how = how

    def on_train_epoch_start(self, trainer, pl_module):
        if trainer.current_epoch != 1:
            return
        if self.how == "add-tensor-hook":
            pl_module.head.weight.register_hook(clip_grad)
        elif self.how == "add-forward-hook":
            pl_module.head.register_forward_hook(double)
        else:
            pl_module.doubling.remove()


class DoublesItsHead(TinyMLP):
    """A forward hook doubling the head's output, registered at construction (removable)."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self.doubling = self.head.register_forward_hook(double)


class Activated(nn.Module):
    """A custom layer holding its activation function in an attribute."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner
        self.act = torch.tanh

    def forward(self, x):
        return self.act(self.inner(x))


class ActivatedHead(WrapsItsHead):
    layer = Activated


class SwapsTheActivation(Callback):
    """Swaps the head's activation function at epoch 1's start."""

    def on_train_epoch_start(self, trainer, pl_module):
        if trainer.current_epoch == 1:
            pl_module.head.act = torch.sigmoid


class Weighted(nn.Module):
    """A custom layer reading a number from a dict it holds (changed in place by a callback)."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner
        self.weights = {"out": 1.0}

    def forward(self, x):
        return self.inner(x) * self.weights["out"]


class WeightedHead(WrapsItsHead):
    layer = Weighted


class RaisesTheLayersWeight(Callback):
    def on_train_epoch_start(self, trainer, pl_module):
        pl_module.head.weights["out"] = 1.0 + trainer.current_epoch


class Boosted(nn.Module):
    """A custom layer that branches on an entry of a dict it holds."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner
        self.options = {"boost": False}

    def forward(self, x):
        if self.options["boost"]:
            return self.inner(x) * 3.0
        return self.inner(x)


class BoostedHead(WrapsItsHead):
    layer = Boosted


class BoostsFromEpoch1(Callback):
    def on_train_epoch_start(self, trainer, pl_module):
        pl_module.head.options["boost"] = trainer.current_epoch >= 1
