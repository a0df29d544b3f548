"""Gradient accumulation: the closing micro-batch's graph adds the gradients the earlier ones left.

With ``Trainer(accumulate_grad_batches=N)`` Lightning runs the closure of an accumulating
micro-batch itself (training step and backward, no ``optimizer.step``), and the closing micro-batch
through ``optimizer.step`` as any step. Only the closing micro-batch reaches the callback's wrapper:
the accumulating ones train eagerly, as in a plain fit, and leave their sum in ``p.grad`` (eager
tensors, allocated anew at each window's ``zero_grad``). The closing step's graph must add its own
gradients to that sum, as eager backward does (``AccumulateGrad``: ``grad += new``), before
``on_after_backward``, the clipping and the update read it.

So a closing step that adds to accumulated gradients gets its own graph kind (:class:`Accumulation`
in the step's key, with the factor, since Lightning divides the loss by it inside the closure): at
its capture the accumulated gradients are copied into static tensors (:class:`AccumulatedGrads`),
the captured backward adds them to the fresh gradients it makes (``new + acc``: IEEE addition
commutes, so the sum is bitwise eager's ``acc + new``), and before each replay this step's
accumulated gradients are copied into them. Which step is which comes from Lightning's own state:
the closure zeroes the gradients (``zero_grad_fn``) exactly on a window's first micro-batch, so a
closure without it adds to earlier gradients. A window of one micro-batch (an epoch's last, when
its length is not a multiple of N) zeroes first: a plain step, with the factor in its key.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from l2lightning.replay_closure import is_stock_closure


@dataclass(frozen=True)
class Accumulation:
    """A closing step's accumulation: the factor Lightning divides the loss by, whether it adds to
    gradients earlier micro-batches left, and (if so) which parameters hold such gradients."""

    factor: int = 1
    adds: bool = False
    holding: tuple[bool, ...] = ()

    def describe(self) -> str:
        if self.factor == 1:
            return "no accumulation"
        if not self.adds:
            return f"accumulate_grad_batches={self.factor}, the window's first micro-batch"
        return f"accumulate_grad_batches={self.factor}, adding to the accumulated gradients"


PLAIN = Accumulation()


def accumulation_of(trainer: Any, closure: Any, module: Any) -> Accumulation | str:
    """This optimizer step's :class:`Accumulation`, or why it cannot be told (the step trains eagerly)."""
    factor = int(getattr(trainer, "accumulate_grad_batches", 1) or 1)
    if factor == 1:
        return PLAIN
    params = tuple(module.parameters())
    if not is_stock_closure(closure):
        return (
            f"gradient accumulation (accumulate_grad_batches={factor}) through another closure than "
            "Lightning's: whether the step adds to accumulated gradients cannot be told"
        )
    inner = closure.args[2]
    if inner._backward_fn is None:
        return f"gradient accumulation (accumulate_grad_batches={factor}) with the backward skipped"
    if inner._zero_grad_fn is not None:
        return Accumulation(factor, False)
    holding = tuple(p.grad is not None for p in params)
    for p in params:
        if p.grad is not None and (p.grad.is_sparse or p._post_accumulate_grad_hooks):
            # a post-accumulate hook reads the sum mid-backward; a sparse sum is not added in place
            return (
                f"gradient accumulation (accumulate_grad_batches={factor}) with sparse gradients or "
                "`register_post_accumulate_grad_hook` hooks is not captured"
            )
    return Accumulation(factor, True, holding)


class AccumulatedGrads:
    """The static tensors a closing step's graph reads the accumulated gradients from."""

    def __init__(self, params: tuple) -> None:
        self.params = params
        # copies outside the graph's pool (the capture reads them; each replay's copy writes them)
        self.tensors = tuple(p.grad.detach().clone() if p.grad is not None else None for p in params)

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
        """Before a replay: this step's accumulated gradients into the tensors the graph reads."""
        for p, acc in zip(self.params, self.tensors):
            if acc is not None:
                acc.copy_(p.grad)
