"""GPU: the decode step captured in one CUDA graph matches the eager decode step (bf16 tolerance,
greedy tokens), across length buckets, with every attention mode (FlashInfer's where it is
importable, refused by name for a query/KV group it has no kernel for); with L2 prefetch the
graph's output is bit-identical to the same graph without it."""

from __future__ import annotations

import pytest
import torch

from l2lightning._env import cupy_unavailable_reason
from l2lightning.decode.attention import flashinfer_layout_reason, flashinfer_unavailable_reason
from l2lightning.decode.model import (
    QWEN25_05B,
    SMOLLM2_135M,
    DecodeSession,
    TorchDecodeSession,
    build_decoder,
)
from l2lightning.prefetch.plan import PrefetchPlan

pytestmark = pytest.mark.gpu
needs_cupy = pytest.mark.skipif(
    cupy_unavailable_reason() is not None, reason="the kernel and the prefetch need CuPy"
)

BATCH = 2
_MODELS: dict[str, torch.nn.Module] = {}


def model_for(config) -> torch.nn.Module:
    """A 2-layer model of the layout, built once per test session."""
    if config.name not in _MODELS:
        _MODELS[config.name] = build_decoder(config, layers=2, device="cuda", seed=0)
    return _MODELS[config.name]


def prompt(vocab: int, length: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, vocab, (BATCH, length), generator=torch.Generator().manual_seed(seed))


def eager_reference(model, max_len: int) -> DecodeSession:
    return DecodeSession(
        model, BATCH, max_len, attention="torch", compile_elementwise=False, prefetch=None, graph=False
    )


def assert_step_matches(graph: DecodeSession, ref: DecodeSession, step: int) -> None:
    """Logits within bf16 tolerance; the greedy token equal wherever the reference's top-2 margin
    exceeds the observed logit noise (else the graph's token must be a near-tie of the best)."""
    a, b = graph.logits.float(), ref.logits.float()
    rel = ((a - b).norm() / b.norm()).item()
    assert rel < 2e-2, f"step {step}: logits relative error {rel:.3g}"
    noise = 4 * (a - b).abs().max().item()
    top2 = b.topk(2, dim=-1).values
    for i in range(BATCH):
        token = graph.next_tokens[i].item()
        if (top2[i, 0] - top2[i, 1]).item() > noise:
            assert token == ref.next_tokens[i].item(), f"step {step}, sequence {i}: greedy token differs"
        else:
            assert b[i, token].item() >= top2[i, 0].item() - noise


def run_against_eager(session: DecodeSession, prompt_len: int, steps: int) -> None:
    ref = eager_reference(session.model, session.max_len)
    ids = prompt(session.config.vocab, prompt_len)
    first = session.prefill(ids).clone()
    assert torch.equal(first, ref.prefill(ids))  # the same eager prefill
    for step in range(steps):
        session.step()
        ref.step()
        assert_step_matches(session, ref, step)
        ref.tokens.copy_(session.tokens)  # follow the graph's tokens
    assert session.cache_lens.tolist() == [prompt_len + steps] * BATCH


@pytest.mark.parametrize("config", [SMOLLM2_135M, QWEN25_05B], ids=lambda c: c.name)
@pytest.mark.parametrize("attention", [pytest.param("kernel", marks=needs_cupy), "torch"])
def test_graph_step_matches_eager(config, attention):
    session = DecodeSession(model_for(config), BATCH, 256, attention=attention, prefetch=None)
    run_against_eager(session, prompt_len=20, steps=4)
    assert len(session.graphs) == 1


@needs_cupy
def test_graph_steps_across_length_buckets():
    session = DecodeSession(model_for(SMOLLM2_135M), BATCH, 256, attention="kernel", prefetch=None)
    run_against_eager(session, prompt_len=60, steps=8)  # 61..68 keys: buckets 64 and 128
    assert sorted(session.graphs) == [64, 128]


@needs_cupy
@pytest.mark.parametrize(
    "prefetch",
    ["auto", "default", PrefetchPlan(kind="hint", blocks=4)],
    ids=["autotuned", "default-plans", "hint4-everywhere"],
)
def test_prefetch_graph_is_bit_identical_to_plain_graph(prefetch):
    model = model_for(SMOLLM2_135M)
    plain = DecodeSession(model, BATCH, 256, attention="kernel", prefetch=None)
    fetched = DecodeSession(model, BATCH, 256, attention="kernel", prefetch=prefetch)
    ids = prompt(SMOLLM2_135M.vocab, 30, seed=3)
    plain.prefill(ids)
    fetched.prefill(ids)
    for step in range(5):
        plain.step()
        fetched.step()
        assert torch.equal(plain.logits, fetched.logits), f"step {step}: logits differ with prefetch"
        assert torch.equal(plain.next_tokens, fetched.next_tokens)
    if prefetch == "auto":  # the tuner may keep no plan at all (then the graphs match trivially)
        assert fetched.prefetch_summary, "the autotuned session reports its chain"
    else:
        assert any(row["forward"] for row in fetched.prefetch_summary), fetched.prefetch_summary
    # the hooks live only during a capture: the model is plain PyTorch again afterwards
    assert not model._forward_pre_hooks and all(not m._forward_pre_hooks for m in model.modules())


def test_auto_attention_and_torch_baseline_match_eager():
    model = model_for(QWEN25_05B)
    auto = DecodeSession(model, BATCH, 512, attention="auto", prefetch=None)
    run_against_eager(auto, prompt_len=100, steps=3)
    text = auto.describe()
    print(text)
    assert "attention choice" in text
    baseline = TorchDecodeSession(model, BATCH, 512)
    run_against_eager(baseline, prompt_len=100, steps=3)


@needs_cupy
def test_generate_equals_stepping_and_full_cache_is_refused():
    model = model_for(SMOLLM2_135M)
    ids = prompt(SMOLLM2_135M.vocab, 12, seed=5)
    a = DecodeSession(model, BATCH, 64, attention="kernel")
    tokens = a.generate(ids, new_tokens=8)
    b = DecodeSession(model, BATCH, 64, attention="kernel")
    b.prefill(ids)
    manual = [b.next_tokens.clone()] + [b.step().clone() for _ in range(7)]
    assert torch.equal(tokens, torch.stack(manual, dim=1))
    b.set_length(63)
    b.step()  # the last position
    with pytest.raises(RuntimeError, match="KV cache is full"):
        b.step()


@pytest.mark.skipif(flashinfer_unavailable_reason() is not None, reason="FlashInfer is not importable")
@pytest.mark.parametrize("config", [SMOLLM2_135M, QWEN25_05B], ids=lambda c: c.name)
def test_flashinfer_step_matches_eager_or_is_refused_by_name(config):
    if flashinfer_layout_reason(config.heads, config.kv_heads):  # Qwen2.5-0.5B: group 7
        with pytest.raises(RuntimeError, match="group of 7"):
            DecodeSession(model_for(config), BATCH, 256, attention="flashinfer", prefetch=None)
        return
    session = DecodeSession(model_for(config), BATCH, 256, attention="flashinfer", prefetch=None)
    run_against_eager(session, prompt_len=60, steps=8)  # 61..68 keys: buckets 64 and 128, re-planned per step
    assert sorted(session.graphs) == [64, 128]
