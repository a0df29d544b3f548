"""Gradient accumulation: every micro-batch a graph of its role, adding to the gradients the earlier ones left.

With ``Trainer(accumulate_grad_batches=N)`` Lightning runs the closure of an accumulating micro-batch
itself (training step and backward, no ``optimizer.step``), and the closing micro-batch through
``optimizer.step`` as any step. The closing one reaches the callback through the capturable
optimizer's wrapper; the accumulating ones through :class:`MicroBatchClosures`, which hands each of
their closures to the callback (by wrapping the closure factory of this Trainer's
automatic-optimization loop, nothing global) as a :class:`MicroBatchStep`, whose call is the
callback's step without an optimizer update.

A micro-batch's role (:attr:`Accumulation.role`) says which graph serves it: the window's first
(its closure zeroes the gradients, ``zero_grad_fn``, so its backward makes them afresh), one that
adds to the sum the earlier ones left, and the closing one that adds and steps the optimizer. Each
role has a graph of its own (:mod:`l2lightning.graph.graph_slots`): a window of four micro-batches replays
three graphs. The factor is in the step's key too, since Lightning divides the loss by it inside the
closure. A window of one micro-batch (an epoch's last, when its length is not a multiple of N)
zeroes first and steps: a plain step's role, with the factor in its key.

A graph that adds must add its own gradients to the sum, as eager backward does (``AccumulateGrad``:
``grad += new``), before ``on_after_backward``, the clipping and the update read it. At its capture
the accumulated gradients are copied into static tensors (:class:`AccumulatedGrads`), the captured
backward adds them to the fresh gradients it makes (``new + acc``: IEEE addition commutes, so the sum
is bitwise eager's ``acc + new``), and before each replay the sum the last micro-batch left is copied
into them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from lightning.pytorch.loops.optimization.automatic import Closure

from l2lightning.graph.replay_closure import lightning_closure


@dataclass(frozen=True)
class Accumulation:
    """A step's accumulation: the factor Lightning divides the loss by, whether it adds to gradients
    earlier micro-batches left, (if so) which parameters hold such gradients, and whether it closes
    its window with the optimizer step (an accumulating micro-batch does not)."""

    factor: int = 1
    adds: bool = False
    holding: tuple[bool, ...] = ()
    closes: bool = True

    @property
    def role(self) -> tuple[bool, bool]:
        """Which graph of the fit serves this step (l2lightning.graph.graph_slots): the factor and which
        parameters hold a sum may change within one graph's life; the role never does."""
        return (self.adds, self.closes)

    def describe(self) -> str:
        if self.factor == 1:
            return "no accumulation"
        what = "the window's first micro-batch" if not self.adds else "adding to the accumulated gradients"
        if self.adds and not all(self.holding):
            # part of the key: which parameters hold a sum (a head some micro-batches skip) tells two
            # adding steps apart that read the same otherwise
            what += f" of {sum(self.holding)} of the {len(self.holding)} parameters"
        if not self.closes:
            what = f"an accumulating micro-batch, {what}"
        return f"accumulate_grad_batches={self.factor}, {what}"


PLAIN = Accumulation()


def accumulation_of(trainer: Any, closure: Any, module: Any) -> Accumulation | str:
    """This step's :class:`Accumulation` (an optimizer step's, or an accumulating micro-batch's whose
    `closure` is a :class:`MicroBatchStep`), or why it cannot be told (the step trains eagerly)."""
    closes = not isinstance(closure, MicroBatchStep)
    factor = int(getattr(trainer, "accumulate_grad_batches", 1) or 1)
    if factor == 1 and closes:
        return PLAIN
    params = tuple(module.parameters())
    inner = lightning_closure(closure)
    if inner is None:
        return (
            f"gradient accumulation (accumulate_grad_batches={factor}) through another closure than "
            "Lightning's: whether the step adds to accumulated gradients cannot be told"
        )
    if inner._backward_fn is None:
        return f"gradient accumulation (accumulate_grad_batches={factor}) with the backward skipped"
    if inner._zero_grad_fn is not None:
        return Accumulation(factor, False, closes=closes)
    holding = []  # one pass over the parameters: asked before every adding micro-batch
    for p in params:
        grad = p.grad
        holding.append(grad is not None)
        if grad is not None and (grad.is_sparse or p._post_accumulate_grad_hooks):
            # a post-accumulate hook reads the sum mid-backward; a sparse sum is not added in place
            return (
                f"gradient accumulation (accumulate_grad_batches={factor}) with sparse gradients or "
                "`register_post_accumulate_grad_hook` hooks is not captured"
            )
    return Accumulation(factor, True, tuple(holding), closes)


def role_of(trainer: Any, closure: Any) -> tuple[bool, bool]:
    """The :attr:`Accumulation.role` of the step `closure` runs, as :func:`accumulation_of` would tell
    it (where that says the step trains eagerly, any role: no graph of it replays), without reading
    the parameters: asked before every step."""
    closes = not isinstance(closure, MicroBatchStep)
    if closes and int(getattr(trainer, "accumulate_grad_batches", 1) or 1) == 1:
        return PLAIN.role
    inner = lightning_closure(closure)
    return (inner is not None and inner._zero_grad_fn is None, closes)


class MicroBatchStep:
    """An accumulating micro-batch's closure as the callback's step runs it: each call runs
    Lightning's closure once (training step, zero_grad on a window's first micro-batch, backward),
    with no optimizer update. The callback's step calls it as an optimizer calls its closure."""

    def __init__(self, closure: Closure) -> None:
        self.closure = closure

    def __call__(self) -> Any:
        return Closure.__call__(self.closure)


def run_micro_batch(closure: MicroBatchStep, **kwargs: Any) -> Any:
    """An accumulating micro-batch's eager step: its closure, as Lightning calls it (no optimizer step)."""
    return closure()


class _HandedClosure(Closure):
    """Lightning's closure of an accumulating micro-batch, whose call the callback handles."""

    def __init__(self, made: Closure, handle: Callable[[MicroBatchStep], Any]) -> None:
        super().__init__(made._step_fn, made._backward_fn, made._zero_grad_fn)
        self._handle = handle

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if args or kwargs:  # not how Lightning calls it: run it as Lightning's own would
            return super().__call__(*args, **kwargs)
        return self._handle(MicroBatchStep(self))


class MicroBatchClosures:
    """Hands the closures of a Trainer's accumulating micro-batches to the callback (`handle`).

    Lightning's automatic optimization makes one closure per batch (``_make_closure``) and calls an
    accumulating micro-batch's closure itself; the instance attribute set here on this Trainer's
    loop (not its class) wraps that factory for this fit, and :meth:`uninstall` removes it.
    """

    def __init__(self, trainer: Any, handle: Callable[[MicroBatchStep], Any]) -> None:
        self._loop = None
        self._previous: Any = None
        loop = getattr(
            getattr(getattr(trainer, "fit_loop", None), "epoch_loop", None), "automatic_optimization", None
        )
        make = getattr(loop, "_make_closure", None)
        if make is None or getattr(trainer.strategy, "handles_gradient_accumulation", False):
            return  # another Lightning, or a strategy that steps every micro-batch: nothing handed over
        self._loop, self._previous = loop, vars(loop).get("_make_closure")

        def make_closure(*args: Any, **kwargs: Any) -> Any:
            closure = make(*args, **kwargs)
            if type(closure) is Closure and trainer.fit_loop._should_accumulate():
                return _HandedClosure(closure, handle)
            return closure

        loop._make_closure = make_closure

    def uninstall(self) -> None:
        loop, self._loop = self._loop, None
        if loop is None:
            return
        if self._previous is None:
            vars(loop).pop("_make_closure", None)
        else:
            loop._make_closure = self._previous


class AccumulatedGrads:
    """The static tensors the graph of a micro-batch that adds to the sum reads the accumulated gradients from."""

    def __init__(self, params: tuple) -> None:
        self.params = params
        # copies outside the graph's pool (the capture reads them; each replay's copy writes them)
        self.tensors = tuple(p.grad.detach().clone() if p.grad is not None else None for p in params)
        # the parameters that hold a sum (the step's key says which), and the tensors their sums go to
        self._holding = tuple(p for p, acc in zip(params, self.tensors) if acc is not None)
        self._targets = [acc for acc in self.tensors if acc is not None]

    def put_back(self) -> None:
        """The accumulated gradients back in ``p.grad`` (copies: an eager run adds to them in place)."""
        for p, acc in zip(self.params, self.tensors):
            p.grad = acc.clone() if acc is not None else None

    def add_into_grads(self) -> None:
        """In the captured backward, after it: ``p.grad`` becomes this step's gradient plus the sum."""
        for p, acc in zip(self.params, self.tensors):
            if acc is None:
                continue
            if p.grad is None:  # this micro-batch reaches no gradient there: the sum alone
                p.grad = acc.clone()
            else:
                p.grad.add_(acc)

    def copy_in(self) -> None:
        """Before a replay: this step's accumulated gradients into the tensors the graph reads. One
        foreach copy, not a copy per parameter: it runs before every adding micro-batch's replay."""
        if self._targets:
            torch._foreach_copy_(self._targets, [p.grad for p in self._holding])
