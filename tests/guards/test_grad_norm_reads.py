"""CPU: Lightning's grad_norm with one read back (l2lightning.guards.grad_norm_reads), bit for bit Lightning's,
and the replay's use of it for a hook that runs after each replay."""

from __future__ import annotations

import sys
import types

import lightning.pytorch.utilities as lightning_utilities
import pytest
import torch
from lightning.pytorch.utilities import grad_norm
from lightning.pytorch.utilities import grads as lightning_grads
from torch import nn

from l2lightning.guards import grad_norm_reads
from l2lightning.guards.grad_norm_reads import GradNormNames, batched_grad_norm, batched_grad_norm_in
from tests.baselines import capturable_from_of_the_last_callback_fit  # noqa: F401 -- records switch steps
from tests.callback.test_callback_replay_cpu import GradNormLogging
from tests.graph_emulator import FakeGraph
from tests.replay_helpers import assert_same, captured_pair


def _with_grads(module: nn.Module, seed: int = 0) -> nn.Module:
    gen = torch.Generator().manual_seed(seed)
    for p in module.parameters():
        p.grad = torch.randn(p.shape, generator=gen).to(p.dtype) * 3.0
    return module


def _bits(norms: dict) -> dict:
    return {k: (v.dtype, v.shape, v.reshape(-1).view(torch.uint8).tolist()) for k, v in norms.items()}


@pytest.mark.parametrize("norm_type", [2, 1, 2.5, "inf", float("inf")])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_the_norms_and_their_total_are_lightnings_bit_for_bit(norm_type, dtype):
    module = _with_grads(nn.Sequential(nn.Linear(7, 13), nn.GELU(), nn.Linear(13, 3)).to(dtype))
    module[2].bias.grad = None  # a parameter without a gradient is left out by both
    ours, theirs = batched_grad_norm(module, norm_type), grad_norm(module, norm_type)
    assert list(ours) == list(theirs) and _bits(ours) == _bits(theirs)


def test_norms_of_mixed_dtypes_take_lightnings_own_function():
    module = _with_grads(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2).to(torch.bfloat16)))
    assert _bits(batched_grad_norm(module, 2)) == _bits(grad_norm(module, 2))


def test_no_gradients_and_a_bad_norm_type_behave_as_lightnings():
    module = nn.Linear(3, 3)
    assert batched_grad_norm(module, 2) == grad_norm(module, 2) == {}
    with pytest.raises(ValueError, match="`norm_type` must be a positive number"):
        batched_grad_norm(module, 0)


def _user_module(alias: str = "grad_norm") -> types.ModuleType:
    """A user's module that imported Lightning's grad_norm under `alias`, and a hook in it."""
    source = f"from lightning.pytorch.utilities import grad_norm as {alias}\n\ndef hook(m):\n    return {alias}(m, 2)\n"
    user = types.ModuleType("user_hooks")
    exec(compile(source, "user_hooks.py", "exec"), vars(user))
    return user


@pytest.mark.parametrize("alias", ["grad_norm", "gn"])
def test_the_hooks_names_and_lightnings_are_replaced_while_it_runs_and_put_back(alias):
    user = _user_module(alias)
    names = GradNormNames()
    with batched_grad_norm_in(user.hook, names):
        assert vars(user)[alias] is batched_grad_norm
        assert (
            lightning_utilities.grad_norm is batched_grad_norm
            and lightning_grads.grad_norm is batched_grad_norm
        )
    assert vars(user)[alias] is grad_norm_reads.LIGHTNING_GRAD_NORM
    assert lightning_utilities.grad_norm is grad_norm and lightning_grads.grad_norm is grad_norm
    with pytest.raises(RuntimeError, match="the hook failed"), batched_grad_norm_in(user.hook, names):
        raise RuntimeError("the hook failed")
    assert vars(user)[alias] is grad_norm and lightning_utilities.grad_norm is grad_norm


def test_a_name_the_user_rebound_is_left_alone():
    user = _user_module()
    names = GradNormNames()
    names.of(user.hook)  # found once: `grad_norm`
    mine = object()
    user.grad_norm = mine  # the user's own function by that name since
    with batched_grad_norm_in(user.hook, names):
        assert user.grad_norm is mine
    assert user.grad_norm is mine


@pytest.mark.usefixtures("emulated_cuda_graphs")
def test_the_hook_after_each_replay_reads_the_norms_at_once_and_logs_lightnings_values(monkeypatch):
    calls = []
    original = grad_norm_reads.batched_grad_norm

    def counted(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    monkeypatch.setattr(grad_norm_reads, "batched_grad_norm", counted)
    base, run, cb = captured_pair(GradNormLogging)
    summary = cb.summary()
    assert summary["captured"] and cb.fallback_steps == 0, summary
    # once per replayed step, the capture step's replay included; a checked step's replay runs no
    # hook (its eager step runs Lightning's own grad_norm, and its result stands)
    checked = summary["replay_check"]["checks"]
    assert len(calls) == FakeGraph.replays - checked > 0
    assert "grad_2.0_norm_total" in run[1].logged[-1]
    assert_same(base, run)  # the logged norms and totals included, bit for bit
    assert sys.modules[GradNormLogging.__module__].grad_norm is grad_norm  # put back after the fit
