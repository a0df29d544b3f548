"""The harness's own model: an MLP stack whose every block is one prefetch chain layer.

N x (LayerNorm, Linear d x d, GELU) in bf16 with an MSE regression loss, AdamW(foreach=True)
(``capturable=True`` through :func:`l2lightning.make_capturable` inside graphs). Each block holds
its parameters itself and runs ``F.layer_norm``/``F.linear``/``F.gelu`` (the same kernels as the
``nn`` modules), so that one block is one prefetch chain layer and, in the compiled variants, the
compiled block function runs *inside* the block while the prefetch hooks stay outside it.
A :class:`BenchCase` is one width x depth x batch x dtype of it, timed over one chain.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

from l2lightning import floors as floors_module
from l2lightning.tools import report

if TYPE_CHECKING:
    from l2lightning.tools.bench.settings import BenchSettings, RunInfo


def _mlp_block(x: Any, ln_weight: Any, ln_bias: Any, weight: Any, bias: Any) -> Any:
    import torch.nn.functional as F

    return F.gelu(F.linear(F.layer_norm(x, (x.shape[-1],), ln_weight, ln_bias), weight, bias))


@functools.lru_cache(maxsize=1)
def compiled_block() -> Callable[..., Any]:
    """``torch.compile(_mlp_block)`` (default mode), built once per process and shared by all blocks."""
    import torch

    return torch.compile(_mlp_block)


def _make_model_classes() -> tuple[type, type]:
    import torch
    from torch import nn

    class MLPBlock(nn.Module):
        """LayerNorm -> Linear(d, d) -> GELU, its four parameters held directly (one chain layer)."""

        def __init__(self, width: int, device: Any = None, dtype: Any = None) -> None:
            super().__init__()
            factory = {"device": device, "dtype": dtype}
            self.ln_weight = nn.Parameter(torch.ones(width, **factory))
            self.ln_bias = nn.Parameter(torch.zeros(width, **factory))
            self.weight = nn.Parameter(torch.empty(width, width, **factory))
            self.bias = nn.Parameter(torch.empty(width, **factory))
            nn.init.kaiming_uniform_(self.weight, a=math.sqrt(5))  # nn.Linear's initialisation
            nn.init.uniform_(self.bias, -1 / math.sqrt(width), 1 / math.sqrt(width))
            self.block_fn: Callable[..., Any] = _mlp_block

        def forward(self, x: Any) -> Any:
            return self.block_fn(x, self.ln_weight, self.ln_bias, self.weight, self.bias)

    class MLPStack(nn.Module):
        """`depth` x MLPBlock(width)."""

        def __init__(self, width: int, depth: int, device: Any = None, dtype: Any = None) -> None:
            super().__init__()
            self.blocks = nn.ModuleList(MLPBlock(width, device, dtype) for _ in range(depth))

        def forward(self, x: Any) -> Any:
            for block in self.blocks:
                x = block(x)
            return x

    return MLPBlock, MLPStack


@functools.lru_cache(maxsize=1)
def _model_classes() -> tuple[type, type]:
    return _make_model_classes()


def build_model(
    width: int, depth: int, device: Any, dtype: Any, seed: int = 0, compiled_blocks: bool = False
) -> Any:
    """The benchmark's MLP stack, initialised from `seed` (every variant starts from the same weights)."""
    import torch

    torch.manual_seed(seed)
    _, stack = _model_classes()
    model = stack(width, depth, device=device, dtype=dtype)
    if compiled_blocks:
        fn = compiled_block()
        for block in model.blocks:
            block.block_fn = fn
    return model


def make_batches(
    width: int, batch: int, device: Any, dtype: Any, count: int = 4, seed: int = 1
) -> list[tuple[Any, Any]]:
    """`count` (x, y) regression batches on the device."""
    import torch

    gen = torch.Generator(device="cpu").manual_seed(seed)
    out = []
    for _ in range(count):
        x = torch.randn(batch, width, generator=gen).to(device=device, dtype=dtype)
        y = (0.1 * torch.randn(batch, width, generator=gen)).to(device=device, dtype=dtype)
        out.append((x, y))
    return out


def regression_loss(model: Any, batch: Any) -> Any:
    import torch.nn.functional as F

    x, y = batch
    return F.mse_loss(model(x), y)


def lightning_module(model: Any, lr: float, impl: str) -> Any:
    """`model` in a LightningModule: the regression loss as its step, AdamW (`impl`: fused or foreach)."""
    import lightning.pytorch as pl
    import torch

    class BenchModule(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = model

        def training_step(self, batch: Any, batch_idx: int) -> Any:
            return regression_loss(self.net, batch)

        def configure_optimizers(self) -> Any:
            return torch.optim.AdamW(self.parameters(), lr=lr, **{impl: True})

    return BenchModule()


@dataclass
class BenchCase:
    """One configuration of one chain."""

    width: int
    depth: int
    batch: int
    dtype: str
    chain: str

    @property
    def label(self) -> str:
        return report.config_label(asdict(self))

    def key(self) -> dict[str, Any]:
        return {
            "width": self.width,
            "depth": self.depth,
            "batch": self.batch,
            "dtype": self.dtype,
            "chain": self.chain,
        }

    def variants(self, settings: BenchSettings) -> list[str]:
        return settings.variants_for(self.chain)

    def prepare(self) -> None:
        """Nothing to build before the runners (see :meth:`FamilyCase.prepare`)."""

    def row_fields(self) -> dict[str, Any]:
        return {"layer_mib": self.width * self.width * floors_module.dtype_bytes(self.dtype) / (1 << 20)}

    def variant_fields(self, variant: str, runner: RunInfo | None) -> dict[str, Any]:
        return {}
