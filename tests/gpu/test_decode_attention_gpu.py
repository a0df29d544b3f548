"""GPU: the one-launch decode-attention kernel against the FP32 reference (lengths 0..4096, head dims
64/128, bf16/fp16, group sizes 1/3/7, batch 1 and 3), exact cache appends, 1000 graph replays with
the length advancing inside the graph, the torch and FlashInfer paths (batch and single-request
decode), and choose_attention, alone and as the attention-alone comparison of decode_reference.py."""

from __future__ import annotations

import pytest
import torch

from l2lightning.decode.attention import (
    AttentionSpec,
    DecodeWorkspace,
    KernelConfig,
    choose_attention,
    decode_attention,
    default_heads_per_block,
    flashinfer_decode_attention,
    flashinfer_layout_reason,
    flashinfer_unavailable_reason,
    main,
    make_backend,
    reference_decode_attention,
    torch_decode_attention,
)

pytestmark = pytest.mark.gpu
cupy = pytest.importorskip("cupy", reason="the decode-attention kernel needs CuPy")

LENGTHS = [0, 1, 7, 63, 64, 65, 300, 1000, 4095, 4096]  # cached tokens; the kernel attends over len + 1 keys
MAX_LEN = 4097
LAYOUTS = [(4, 4), (6, 2), (14, 2), (9, 3)]  # (heads, kv_heads): groups 1, 3, 7, 3
TOL = 1e-2  # relative norm error, as for bf16


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


def make_inputs(batch, heads, kv_heads, d, dtype, max_len=MAX_LEN, seed=0):
    gen = torch.Generator(device="cuda").manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=gen, device="cuda").to(dtype)

    return (randn(batch, heads, d), randn(batch, kv_heads, d), randn(batch, kv_heads, d),
            randn(batch, kv_heads, max_len, d), randn(batch, kv_heads, max_len, d))  # fmt: skip


def check_launch(q, k, v, kc, vc, lens, **kwargs):
    """One launch: output vs reference, appended row bit-exact, every other row untouched."""
    expected_k, expected_v = kc.clone(), vc.clone()
    for b, n in enumerate(lens.tolist()):
        expected_k[b, :, n], expected_v[b, :, n] = k[b], v[b]
    ref = reference_decode_attention(q, k, v, kc, vc, lens)
    out = decode_attention(q, k, v, kc, vc, lens, **kwargs)
    torch.cuda.synchronize()
    err = rel_err(out, ref)
    assert err < TOL, f"lens={lens.tolist()} {kwargs}: relative error {err:.3g}"
    assert torch.equal(kc.view(torch.int16), expected_k.view(torch.int16)), (
        f"k_cache wrong after append at {lens.tolist()}"
    )
    assert torch.equal(vc.view(torch.int16), expected_v.view(torch.int16)), (
        f"v_cache wrong after append at {lens.tolist()}"
    )
    return out


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("heads,kv_heads", LAYOUTS, ids=[f"{h}h{k}kv" for h, k in LAYOUTS])
def test_kernel_matches_reference_across_lengths(heads, kv_heads, head_dim, dtype):
    for batch in (1, 3):
        q, k, v, kc, vc = make_inputs(batch, heads, kv_heads, head_dim, dtype, seed=batch)
        for n in LENGTHS:
            lens_list = [n] if batch == 1 else [n, n // 3, min(n + 5, MAX_LEN - 1)]
            lens = torch.tensor(lens_list, dtype=torch.int32, device="cuda")
            for splits in (None, 5, 1):  # default, a split size that does not divide the lengths, direct path
                check_launch(q, k, v, kc, vc, lens, splits=splits)


def test_two_head_chunks_and_large_groups():
    # group 7 split as 4 + 3 heads per block; group 16 as 8 + 8
    for heads, kv_heads, hpb in ((14, 2, 4), (32, 2, None)):
        q, k, v, kc, vc = make_inputs(2, heads, kv_heads, 128, torch.bfloat16, max_len=1500)
        lens = torch.tensor([1234, 77], dtype=torch.int32, device="cuda")
        config = KernelConfig(heads_per_block=hpb or default_heads_per_block(heads // kv_heads))
        check_launch(q, k, v, kc, vc, lens, config=config, splits=9)


def test_non_contiguous_q_and_token_dim():
    q, k, v, kc, vc = make_inputs(2, 14, 2, 64, torch.bfloat16, max_len=300)
    lens = torch.tensor([100, 299], dtype=torch.int32, device="cuda")
    q_strided = torch.randn(2, 64, 14, device="cuda").bfloat16().transpose(1, 2)  # [B, H, D], not contiguous
    out = check_launch(q_strided, k, v, kc, vc, lens)
    assert out.shape == (2, 14, 64)
    out4 = decode_attention(q[:, :, None], k[:, :, None], v[:, :, None], kc, vc, lens)
    assert out4.shape == (2, 14, 1, 64)


def test_out_of_range_length_gives_nan_and_appends_nothing():
    q, k, v, kc, vc = make_inputs(2, 6, 2, 64, torch.bfloat16, max_len=128)
    before = kc.clone()
    lens = torch.tensor([128, 10], dtype=torch.int32, device="cuda")
    out = decode_attention(q, k, v, kc, vc, lens)
    torch.cuda.synchronize()
    assert out[0].isnan().all() and out[1].isfinite().all()
    assert torch.equal(kc[0], before[0]) and torch.equal(kc[1, :, 10], k[1])


@pytest.mark.parametrize("heads,kv_heads,head_dim", [(14, 2, 64), (9, 3, 64), (8, 8, 128)])
@pytest.mark.parametrize("advance", [True, False], ids=["advancing", "fixed"])
def test_graph_replayed_1000_times_stays_correct(heads, kv_heads, head_dim, advance):
    batch, max_len, start = 2, 1100, 0
    q, k, v, kc, vc = make_inputs(batch, heads, kv_heads, head_dim, torch.bfloat16, max_len=max_len)
    lens = torch.full((batch,), start if advance else 517, dtype=torch.int32, device="cuda")
    group = heads // kv_heads
    hpb = default_heads_per_block(group)
    splits = 12
    ws = DecodeWorkspace(batch * kv_heads * -(-group // hpb), splits, hpb, head_dim, "cuda")
    decode_attention(q, k, v, kc, vc, lens, splits=splits, workspace=ws)  # compile + warm outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = decode_attention(q, k, v, kc, vc, lens, splits=splits, workspace=ws)
        if advance:
            lens.add_(1)
    for chunk in range(10):
        for _ in range(100):
            graph.replay()
        torch.cuda.synchronize()
        used = lens - 1 if advance else lens  # the length the last replay attended at
        err = rel_err(out, reference_decode_attention(q, k, v, kc, vc, used.to(torch.int32)))
        assert err < TOL, f"after {(chunk + 1) * 100} replays: relative error {err:.3g}"
        assert torch.all(ws.tickets == 0), (
            f"tickets not reset after {(chunk + 1) * 100} replays: {ws.tickets.tolist()}"
        )
    if advance:
        assert lens.tolist() == [1000] * batch


def test_workspace_mismatch_is_rejected():
    q, k, v, kc, vc = make_inputs(1, 14, 2, 64, torch.bfloat16, max_len=256)
    lens = torch.zeros(1, dtype=torch.int32, device="cuda")
    with pytest.raises(ValueError, match="`workspace` was made for"):
        decode_attention(q, k, v, kc, vc, lens, splits=4, workspace=DecodeWorkspace(2, 3, 7, 64, "cuda"))
    with pytest.raises(ValueError, match="head_dim must be one of"):
        decode_attention(*make_inputs(1, 4, 4, 32, torch.bfloat16, max_len=16), lens)
    with pytest.raises(ValueError, match="bfloat16 or float16"):
        decode_attention(*make_inputs(1, 4, 4, 64, torch.float32, max_len=16), lens)


@pytest.mark.parametrize("window", [None, 512])
def test_torch_path_matches_reference_on_gpu(window):
    q, k, v, kc, vc = make_inputs(3, 14, 2, 64, torch.bfloat16, max_len=600)
    lens = torch.tensor([0, 300, 511], dtype=torch.int32, device="cuda")
    ref = reference_decode_attention(q, k, v, kc, vc, lens)
    out = torch_decode_attention(q, k, v, kc, vc, lens, window=window)
    assert rel_err(out, ref) < TOL


@pytest.mark.skipif(flashinfer_unavailable_reason() is not None, reason="FlashInfer is not importable")
@pytest.mark.parametrize(("heads", "kv_heads"), [(9, 3), (14, 2)], ids=["smollm2-group3", "qwen-group7"])
def test_flashinfer_path_matches_reference_or_names_the_group_size(heads, kv_heads):
    q, k, v, kc, vc = make_inputs(2, heads, kv_heads, 64, torch.bfloat16, max_len=600)
    lens = torch.tensor([300, 300], dtype=torch.int32, device="cuda")
    ref = reference_decode_attention(q, k, v, kc, vc, lens)
    if flashinfer_layout_reason(heads, kv_heads):  # FlashInfer 0.7.2 raised "Unsupported group_size: 7"
        with pytest.raises(RuntimeError, match="support query/KV head group sizes"):
            flashinfer_decode_attention(q, k, v, kc, vc, lens)
        return
    assert rel_err(flashinfer_decode_attention(q, k, v, kc, vc, lens), ref) < TOL


def test_choose_attention_measures_and_reports():
    choice = choose_attention(14, 2, 64, 1024, torch.bfloat16, 1, "cuda", rounds=5, use_cache=False)
    print(choice.table())
    assert choice.label in choice.timings_us
    assert any(label.startswith("kernel") for label in choice.timings_us), choice.errors
    assert any(label.startswith("torch") for label in choice.timings_us), choice.errors
    assert not [label for label in choice.errors if label.startswith("kernel")], choice.errors
    assert all(t > 0 for t in choice.timings_us.values())
    assert choice.spec.impl in ("kernel", "torch", "flashinfer")
    only_torch = choose_attention(
        9, 3, 64, 256, torch.bfloat16, 1, "cuda", specs=[AttentionSpec("torch")], use_cache=False
    )
    assert only_torch.name == "torch"


def test_sanitize_script_mode_runs_clean(capsys):
    assert main(["--sanitize"]) == 0
    assert "sanitize workload done" in capsys.readouterr().out


@pytest.mark.skipif(flashinfer_unavailable_reason() is not None, reason="FlashInfer is not importable")
def test_flashinfer_single_decode_matches_reference_and_refuses_other_lengths():
    # SmolLM2's layout at 321 keys: the cache exactly as long as the attended keys
    q, k, v, kc, vc = make_inputs(1, 9, 3, 64, torch.bfloat16, max_len=321)
    lens = torch.tensor([320], dtype=torch.int32, device="cuda")
    ref = reference_decode_attention(q, k, v, kc, vc, lens)
    backend = make_backend(
        AttentionSpec("flashinfer_single"),
        batch=1,
        heads=9,
        kv_heads=3,
        head_dim=64,
        max_len=321,
        dtype=torch.bfloat16,
        device="cuda",
    )
    backend.before_replay(320)
    assert rel_err(backend(q, k, v, kc, vc, lens), ref) < TOL
    with pytest.raises(ValueError, match="320 cached tokens"):
        backend.before_replay(100)


@pytest.mark.parametrize(("heads", "kv_heads"), [(9, 3), (14, 2)], ids=["smollm2-group3", "qwen-group7"])
def test_attention_alone_comparison_times_each_path_or_says_why(heads, kv_heads):
    """What decode_reference.py measures per shape: our kernel, SDPA and FlashInfer's two decode
    paths in one interleaved choose_attention; a path that cannot run has a reason instead of a time."""
    specs = [AttentionSpec(impl) for impl in ("kernel", "torch", "flashinfer", "flashinfer_single")]
    choice = choose_attention(
        heads, kv_heads, 64, 321, torch.bfloat16, 1, "cuda", specs=specs, calls=4, rounds=3, use_cache=False
    )
    print(choice.table())
    best, reasons = choice.best_per_impl(), choice.reasons_per_impl()
    assert {"kernel", "torch"} <= set(best), choice.errors
    flashinfer_runs = (
        flashinfer_unavailable_reason() is None and flashinfer_layout_reason(heads, kv_heads) is None
    )
    for impl in ("flashinfer", "flashinfer_single"):
        assert (impl in best) != (impl in reasons), (best, reasons)
        if flashinfer_runs:
            assert impl in best, reasons
        else:
            assert "FlashInfer" in reasons[impl]
