"""A gradient-equivalence test for your GPU CI: L2 prefetch must not change a single bit of a gradient.

    pytest examples/test_gradient_equivalence.py

Copy it into your tests and let `make_model` build your model. The prefetch kernels only issue
L2 prefetch instructions and never write memory, so gradients with the prefetch hooks (eager or in
a captured step) must equal the plain ones bit for bit; `assert_same_gradients` raises with the
first differing tensor if they do not. Without a CUDA GPU both tests are skipped.
"""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from l2lightning import PrefetchHooks, assert_same_gradients, capture_step
from l2lightning.verify import gradients

requires_cuda = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU: the prefetch kernels and graphs run only there"
)
WIDTH, DEPTH, BATCH = 1536, 8, 16


def make_model() -> nn.Module:
    torch.manual_seed(0)  # the same initial weights every call
    blocks = [nn.Sequential(nn.LayerNorm(WIDTH), nn.Linear(WIDTH, WIDTH), nn.GELU()) for _ in range(DEPTH)]
    return nn.Sequential(*blocks).cuda().to(torch.bfloat16)


def make_batch() -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator(device="cuda").manual_seed(1)
    x = torch.randn(BATCH, WIDTH, device="cuda", dtype=torch.bfloat16, generator=gen)
    return x, torch.randn(BATCH, WIDTH, device="cuda", dtype=torch.bfloat16, generator=gen)


def loss_fn(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = batch
    return F.mse_loss(model(x).float(), y.float())


@requires_cuda
def test_prefetch_hooks_keep_gradients_bit_identical():
    model, batch = make_model(), make_batch()
    loss_fn(model, batch).backward()
    plain = gradients(model)

    model.zero_grad(set_to_none=True)
    with PrefetchHooks(model, batch[0]):  # forward prefetches W_{i+1}, backward W_{i-1}
        loss_fn(model, batch).backward()
    assert_same_gradients(plain, model, label="eager with prefetch vs eager")


@requires_cuda
def test_captured_step_with_prefetch_matches_eager_step():
    batch = make_batch()
    eager = make_model()
    loss_fn(eager, batch).backward()

    captured = make_model()
    with PrefetchHooks(captured, batch[0]):
        step = capture_step(lambda b: loss_fn(captured, b), batch, captured, warmup_steps=3)
        step(batch)  # the first replay is the first step: the warm-up's effects were undone
    torch.cuda.synchronize()
    assert_same_gradients(eager, captured, label="captured step with prefetch vs eager")
