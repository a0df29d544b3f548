"""PrefetchSequential: nn.Sequential with cross-layer L2 weight prefetch.

Runs its modules in order, exactly like `nn.Sequential(*modules)` (same ops, same output bits),
while a side stream prefetches the next layer's weights. Plans come from the autotuner when
`plans="auto"` (tuned on the first call, on throwaway weights) or are sized by layer bytes.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from l2lightning.prefetch.hooks import PrefetchHooks
from l2lightning.prefetch.plan import PlansArg


class PrefetchSequential(nn.Module):
    """An ``nn.Sequential`` whose forward (and backward) prefetches the next layer's weights into L2.

    Args:
        modules: the blocks, run in order.
        example_input: one input for the dry run that finds the weight-reading layers. When None,
            the chain is found on the first call.
        plans: as in :class:`~l2lightning.PrefetchHooks` (``None`` = byte-sized defaults,
            ``"auto"`` = measured by the autotuner on the first call).
        backward: prefetch W_{i-1} in backward too.

    Example:
        >>> blocks = [nn.Sequential(nn.LayerNorm(1536), nn.Linear(1536, 1536), nn.GELU()) for _ in range(40)]
        >>> seq = PrefetchSequential(blocks).cuda().to(torch.bfloat16)  # doctest: +SKIP
        >>> y = seq(x)  # same bits as nn.Sequential(*blocks)(x)  # doctest: +SKIP
    """

    def __init__(
        self,
        modules: Iterable[nn.Module],
        example_input: Any = None,
        plans: PlansArg = "auto",
        backward: bool = True,
    ) -> None:
        super().__init__()
        self.layers = nn.ModuleList(modules)
        if len(self.layers) == 0:
            raise ValueError("`modules` must contain at least one module")
        self.plans = plans
        self.backward = backward
        self.hooks: PrefetchHooks | None = None
        if example_input is not None:
            self.install(example_input)

    def install(self, example_input: Any) -> PrefetchHooks:
        """(Re)discover the chain with `example_input` and install the prefetch hooks."""
        if self.hooks is not None:
            self.hooks.remove()
        self.hooks = PrefetchHooks(self, example_input, backward=self.backward, plans=self.plans)
        return self.hooks

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.hooks is None and not _in_dry_run(self):
            # First call: tune/install with this input, then run normally (the hooks fire from now on).
            self._dry_run = True
            try:
                self.install(x)
            finally:
                self._dry_run = False
            return self(x)
        for layer in self.layers:
            x = layer(x)
        return x

    def remove_prefetch(self) -> None:
        """Remove the hooks: plain ``nn.Sequential`` behaviour."""
        if self.hooks is not None:
            self.hooks.remove()


def _in_dry_run(module: PrefetchSequential) -> bool:
    return getattr(module, "_dry_run", False)
