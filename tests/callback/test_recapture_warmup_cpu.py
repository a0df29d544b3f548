"""A capture after a change that finds the step's own code changing Python state warms up again, once.

HF transformers' rotary embedding (up to 4.37) grows its cos/sin cache, re-registering its buffers,
the first time a longer sequence arrives. Under a sequence-length curriculum the step is captured
again at each new length, and that capture's step is the one that grows the cache: it was refused
("changes Python state at every step") and the rest of the fit trained eagerly (found by the held-out
idiom hunt on the emulator). The step now runs eagerly (growing the cache as a plain step does), the
next ones warm up again and are captured, bitwise the baseline; a second change in the capture after
that still ends it.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch import LightningModule
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from tests.baselines import (  # noqa: F401 -- the fixture records each callback fit's switch step
    baseline_of,
    capturable_from_of_the_last_callback_fit,
)
from tests.replay_helpers import assert_same, callback, fit

pytestmark = pytest.mark.usefixtures("emulated_cuda_graphs")


class GrowingCache(nn.Module):
    """A position table grown (its buffer registered anew) when a longer sequence arrives."""

    def __init__(self, dim: int, length: int = 4) -> None:
        super().__init__()
        self.dim = dim
        self._grow(length)

    def _grow(self, length: int) -> None:
        self.length = length
        positions = torch.arange(length, dtype=torch.float32)[:, None]
        self.register_buffer("table", torch.cos(positions / (1 + torch.arange(self.dim))), persistent=False)

    def forward(self, length: int) -> torch.Tensor:
        if length > self.length:
            self._grow(length)
        return self.table[:length]


class CurriculumWithACache(LightningModule):
    """Sequences 4, 8, 12, 16 tokens long by epoch, with a position table grown as they lengthen."""

    def __init__(self, width: int = 8, depth: int = 1) -> None:
        super().__init__()
        self.emb = nn.Embedding(20, width)
        self.cache = GrowingCache(width)
        self.head = nn.Linear(width, 20)

    def training_step(self, batch, batch_idx):
        (tokens,) = batch
        length = min(4 * (self.current_epoch + 1), tokens.size(1))
        tokens = tokens[:, :length]
        h = self.emb(tokens[:, :-1]) * self.cache(length - 1)
        loss = F.cross_entropy(self.head(h).reshape(-1, 20), tokens[:, 1:].reshape(-1))
        self.log("train/loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2, fused=True)


def tokens(n: int = 64) -> DataLoader:
    g = torch.Generator().manual_seed(0)
    return DataLoader(TensorDataset(torch.randint(0, 20, (n, 16), generator=g)), batch_size=8)


def test_a_cache_grown_in_the_capture_after_a_new_length_warms_up_again_bitwise_the_baseline():
    base = fit(baseline_of(CurriculumWithACache), steps=32, loader=tokens())
    cb = callback()
    with pytest.warns(
        UserWarning, match=r"the next ones warm up again .*a second such change ends the capture"
    ):
        run = fit(CurriculumWithACache, [cb], steps=32, loader=tokens())
    s = cb.summary()
    assert s["captured"] and s["reason"] is None, s
    assert s["captures"] == 4, s  # one per length: 4, 8, 12, 16 tokens over four epochs of 8 batches
    assert_same(base, run)
    assert run[0].cache.length == 15


class ForgetsInCaptures(GrowingCache):
    """Forgets its table in every capture once `forgets` is set (the graph emulator flags its captures)."""

    forgets = False

    def forward(self, length: int) -> torch.Tensor:
        if self.forgets and torch.cuda.is_current_stream_capturing():
            self.length = 0
        return super().forward(length)


class ChangesStateInEveryLaterCapture(CurriculumWithACache):
    """From the second epoch on its table is grown in every capture: the capture after warming up again
    changes Python state too."""

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.cache = ForgetsInCaptures(self.emb.embedding_dim)

    def on_train_epoch_start(self):
        self.cache.forgets = self.current_epoch > 0


def test_a_second_change_of_python_state_in_a_capture_ends_the_capture_like_plain_from_there():
    base = fit(baseline_of(ChangesStateInEveryLaterCapture), steps=24, loader=tokens())
    cb = callback()
    with pytest.warns(UserWarning, match=r"changes Python state \(`self.cache.table`\).*; training eagerly"):
        run = fit(ChangesStateInEveryLaterCapture, [cb], steps=24, loader=tokens())
    s = cb.summary()
    # warmed up again once, then gave up
    assert s["captures"] == 1 and "`self.cache.table`" in s["reason"], s
    assert_same(base, run)  # the capturable configuration from its one capture on, as the baseline's
