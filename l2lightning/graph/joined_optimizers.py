"""Several optimizers handled as one capturable optimizer: a manual step that steps two or more.

Under manual optimization one ``training_step`` may step several optimizers (Lightning's basic GAN:
``opt_g, opt_d = self.optimizers()``, each toggled, stepped and zeroed in turn), and the callback
captures the whole step, every optimizer's update inside the one graph (:mod:`l2lightning.graph.manual_step`).
What the callback does with its :class:`~l2lightning.graph.optim.CapturableOptimizer` (switch it to
``make_capturable``'s configuration at the capture step, fill its LR tensors before each replay,
compare its baked hyperparameters and its state with the graph's before each replay, note what the
step's code writes of its param groups, save and put back its state around a capture and the sampled
replay check) it does here with each of them: :class:`CapturableOptimizers` answers for all, naming
the optimizer in what it reports, and its :attr:`CapturableOptimizers.optimizer` is a view
(:class:`JoinedOptimizer`) of every optimizer's per-parameter state and param groups, which is what
the state saves and the check's comparisons read.

A parameter that two of the optimizers step is refused before the fit's first step
(:func:`shared_parameter`): the view's state would hold only one of its two entries, so the capture's
undo and the sampled check would miss the other.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from l2lightning.graph.optim import (
    CapturableOptimizer,
    OptimizerNotCapturableError,
    installed_capturable,
    intercept,
)


class JoinedOptimizer:
    """The per-parameter state and the param groups of several torch optimizers, read as one optimizer's.

    Only what the callback's state saves and comparisons read of an optimizer: ``state`` (parameter ->
    its state dict, the optimizers' own dicts, so writes into them reach the optimizers),
    ``param_groups`` (every optimizer's, in order) and ``zero_grad``.
    """

    def __init__(self, optimizers: Sequence[torch.optim.Optimizer]) -> None:
        self.optimizers = list(optimizers)

    @property
    def state(self) -> dict[Any, dict[str, Any]]:
        # read anew each time: an optimizer adds a parameter's entry at its first step
        return {p: s for opt in self.optimizers for p, s in opt.state.items()}

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return [g for opt in self.optimizers for g in opt.param_groups]

    def zero_grad(self, set_to_none: bool = True) -> None:
        for opt in self.optimizers:
            opt.zero_grad(set_to_none=set_to_none)


class CapturableOptimizers:
    """:class:`~l2lightning.graph.optim.CapturableOptimizer`'s interface over several of them (see the module docstring).

    Args:
        members: one capturable wrapper per optimizer, in the Trainer's order (a checkpoint's
            ``optimizer_states`` order).
        owned: per member, whether the callback installed it (:func:`intercept`) rather than the
            user (``make_capturable`` in ``configure_optimizers``): only those are released at the end.
    """

    def __init__(self, members: Sequence[CapturableOptimizer], owned: Sequence[bool]) -> None:
        if not members:
            raise ValueError("`members` must hold at least one capturable optimizer")
        if len(members) != len(owned):
            raise ValueError(
                f"`owned` must have one entry per member: {len(members)} members, {len(owned)} entries"
            )
        self.members = list(members)
        self.owned = list(owned)
        self.optimizer = JoinedOptimizer([m.optimizer for m in self.members])
        # the members this object switched on (switch_on), which alone switch_off gives back: a
        # member the user made capturable keeps that configuration
        self._switched_here = [False] * len(self.members)

    def label(self, index: int) -> str:
        """``optimizer 1, SGD``: the optimizer's place in ``self.optimizers()`` and its class."""
        return f"optimizer {index}, {type(self.members[index].optimizer).__name__}"

    @property
    def switched(self) -> bool:
        return all(m.switched for m in self.members)

    @property
    def handler(self) -> Callable[..., Any] | None:
        return self.members[0].handler

    @handler.setter
    def handler(self, handler: Callable[..., Any] | None) -> None:
        for m in self.members:
            m.handler = handler

    def switch_on(self) -> None:
        for i, m in enumerate(self.members):
            if not m.switched:
                m.switch_on()
                self._switched_here[i] = True

    def switch_off(self) -> None:
        for i, m in enumerate(self.members):
            if self._switched_here[i]:
                m.switch_off()
                self._switched_here[i] = False

    def sync_tensors(self) -> None:
        for m in self.members:
            m.sync_tensors()

    def freeze(self, frozen: bool) -> None:
        for m in self.members:
            m.freeze(frozen)

    def mark_captured(self) -> None:
        for m in self.members:
            m.mark_captured()

    def state_replaced(self) -> str | None:
        for i, m in enumerate(self.members):
            replaced = m.state_replaced()
            if replaced:
                return f"{replaced} ({self.label(i)})"
        return None

    def baked_changes(self) -> list[str]:
        return [
            f"{change} ({self.label(i)})" for i, m in enumerate(self.members) for change in m.baked_changes()
        ]

    def baked_snapshot(self) -> list[dict[str, Any]]:
        """Every member's baked hyperparameters, one entry per param group, in order."""
        return [group for m in self.members for group in m.baked_snapshot()]

    def hyperparameter_writes(self) -> list[str]:
        # each starts "param group i's ...", which the callback's refusal reads as an optimizer's hyperparameter
        return [
            f"{write} ({self.label(i)})"
            for i, m in enumerate(self.members)
            for write in m.hyperparameter_writes()
        ]

    def release(self) -> None:
        """Release the members the callback installed; the user's own keep their configuration."""
        for m, owned in zip(self.members, self.owned):
            if owned:
                m.release()
            else:
                m.handler = None


def members_of(wrapped: Any) -> list[CapturableOptimizer]:
    """The capturable optimizers `wrapped` stands for: its members, or itself."""
    return list(wrapped.members) if isinstance(wrapped, CapturableOptimizers) else [wrapped]


def optimizer_names(wrapped: Any) -> str:
    """The class name of `wrapped`'s optimizer, or of each of several (``Adam, Adam``)."""
    return ", ".join(type(m.optimizer).__name__ for m in members_of(wrapped))


def intercept_all(optimizers: Sequence[torch.optim.Optimizer], device: torch.device) -> CapturableOptimizers:
    """:func:`~l2lightning.graph.optim.intercept` each of `optimizers` (or take the wrapper the user's
    ``make_capturable`` installed), as one :class:`CapturableOptimizers`.

    Raises:
        OptimizerNotCapturableError: one of them has no capturable mode; the wrappers installed on the
            ones before it are removed again, so the fit trains on the user's optimizers as configured.
    """
    members, owned = [], []
    try:
        for optimizer in optimizers:
            existing = installed_capturable(optimizer)
            members.append(existing or intercept(optimizer, device))
            owned.append(existing is None)
    except OptimizerNotCapturableError:
        for member, ours in zip(members, owned):
            if ours:
                member.release()
        raise
    return CapturableOptimizers(members, owned)


def shared_parameter(module: torch.nn.Module, optimizers: Sequence[torch.optim.Optimizer]) -> str | None:
    """The name of a parameter that two of `optimizers` step, or None."""
    names = {id(p): name for name, p in module.named_parameters()}
    seen: set[int] = set()
    for optimizer in optimizers:
        mine = {id(p) for group in optimizer.param_groups for p in group["params"]}
        both = mine & seen
        if both:
            return names.get(next(iter(both)), "a parameter the module does not register")
        seen |= mine
    return None
