"""The eager reference a fit with :class:`~l2lightning.L2GraphCallback` equals bit for bit.

The callback trains with the optimizer as configured until it captures the step; from its capture
step on, the optimizer runs in :func:`~l2lightning.make_capturable`'s configuration (for Adam and
AdamW without ``fused=True`` its bias corrections are computed with device tensors, which can differ
from the plain configuration in the last bits). ``summary()["capturable_from_step"]`` names that
step; :class:`CapturableFrom` makes a plain fit switch at the same step, so that it is the reference
a user's own CI compares the callback's fit with.
"""

from __future__ import annotations

from typing import Any

from lightning.pytorch import Callback, LightningModule, Trainer
from typing_extensions import override

from l2lightning.graph.optim import make_capturable


class CapturableFrom(Callback):
    """Switch the Trainer's optimizers to ``make_capturable``'s configuration at global step `step`.

    Args:
        step: the ``trainer.global_step`` before whose update the switch happens (the callback's
            ``summary()["capturable_from_step"]``); 0 switches before the first step.

    Example:
        >>> from lightning.pytorch import Trainer
        >>> from l2lightning import CapturableFrom, L2GraphCallback
        >>> graph = L2GraphCallback()
        >>> Trainer(max_steps=100, callbacks=[graph]).fit(model)  # doctest: +SKIP
        >>> step = graph.summary()["capturable_from_step"]
        >>> Trainer(max_steps=100, callbacks=[CapturableFrom(step)]).fit(reference)  # doctest: +SKIP
    """

    def __init__(self, step: int) -> None:
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ValueError(f"`step` must be an int >= 0 (a global step), got {step!r}")
        self.step = step

    @override
    def on_train_batch_start(
        self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if trainer.global_step >= self.step:
            for optimizer in trainer.optimizers:
                make_capturable(optimizer, trainer.strategy.root_device)  # a no-op once switched
