"""GPU: prefetch kernels inside graphs, bitwise equality with prefetch, whole-step capture vs eager."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from l2lightning import (
    PrefetchHooks,
    PrefetchPlan,
    PrefetchSequential,
    capture_step,
    make_capturable,
)
from l2lightning.graph.capture import run_step
from l2lightning.prefetch.kernels import prefetch, supported_kinds
from l2lightning.verify import assert_same_gradients, compare

pytestmark = pytest.mark.gpu
cupy = pytest.importorskip("cupy", reason="the prefetch kernels need CuPy")


def blocks(width: int, depth: int, seed: int = 0) -> list[nn.Module]:
    torch.manual_seed(seed)
    return [nn.Sequential(nn.LayerNorm(width), nn.Linear(width, width), nn.GELU()) for _ in range(depth)]


def stack(width=1536, depth=8, dtype=torch.bfloat16, seed=0) -> nn.Sequential:
    return nn.Sequential(*blocks(width, depth, seed)).cuda().to(dtype)


@pytest.mark.parametrize("kind", ["hint", "hint_last", "bulk", "bulk_last"])
def test_kernel_runs_inside_a_captured_graph_and_writes_nothing(kind):
    if kind not in supported_kinds(0):
        pytest.skip(f"{kind} needs sm_90+")
    w = torch.randn(4 << 20, device="cuda")
    before = w.clone()
    plan = PrefetchPlan(kind=kind, blocks=8)
    prefetch(w, plan)  # compiles before capture
    side = torch.cuda.Stream()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        main = torch.cuda.current_stream()
        side.wait_stream(main)
        with torch.cuda.stream(side):
            prefetch(w, plan)
        main.wait_stream(side)
    for _ in range(3):
        g.replay()
    torch.cuda.synchronize()
    assert torch.equal(w, before)


def test_the_prefetch_switch_finds_the_prefetch_nodes_and_the_graph_replays_alike_with_them_off_and_on():
    from l2lightning.graph.prefetch_switch import (
        find_switch,
        kernel_nodes,
        new_cuda_graph,
        prefetch_functions,
    )

    torch.manual_seed(0)
    w = torch.randn(1024, 1024, device="cuda")
    x = torch.randn(64, 1024, device="cuda")
    plan = PrefetchPlan(kind="hint", blocks=8)
    prefetch(w, plan)  # compiles before capture
    torch.tanh(x @ w)  # cuBLAS creates its handle outside the capture
    torch.cuda.synchronize()
    side = torch.cuda.Stream()
    g = new_cuda_graph(keep_graph=True)
    with torch.cuda.graph(g):
        main = torch.cuda.current_stream()
        y = x
        for _ in range(3):
            side.wait_stream(main)
            with torch.cuda.stream(side):
                prefetch(w, plan)
            y = torch.tanh(y @ w)
        main.wait_stream(side)
    g.instantiate()
    switch, why = find_switch(g, prefetch_functions(0))
    assert switch is not None and len(switch.nodes) == 3, why
    assert len(kernel_nodes(g.raw_cuda_graph())) > 3  # the GEMMs and tanh are not switched
    g.replay()
    first = y.clone()
    for enabled in (False, True, False, True):
        switch.set(enabled)
        y.zero_()
        g.replay()
        torch.cuda.synchronize()
        assert torch.equal(y, first), enabled


def test_forward_outputs_bit_identical_with_prefetch():
    model = stack()
    x = torch.randn(16, 1536, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        plain = model(x)
    with PrefetchHooks(model, x, plans=PrefetchPlan(blocks=8), backward=False) as hooks, torch.no_grad():
        assert any(p is not None for p in hooks.forward_plans)
        g = torch.cuda.CUDAGraph()
        model(x)
        with torch.cuda.graph(g):
            out = model(x)
        g.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, plain)


def _fwd_bwd_graph(model, x):
    model.zero_grad(set_to_none=True)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            model.zero_grad(set_to_none=True)
            model(x).float().square().mean().backward()
    torch.cuda.current_stream().wait_stream(s)
    model.zero_grad(set_to_none=True)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        loss = model(x).float().square().mean()
        loss.backward()
    g.replay()
    torch.cuda.synchronize()
    return loss.clone(), {n: p.grad.clone() for n, p in model.named_parameters()}


def test_forward_backward_capture_with_backward_prefetch_gives_identical_gradients():
    x = torch.randn(16, 1536, device="cuda", dtype=torch.bfloat16)
    loss_plain, grads_plain = _fwd_bwd_graph(stack(), x)
    model = stack()
    hooks = PrefetchHooks(model, x, plans=PrefetchPlan(blocks=8), backward=True)
    assert any(p is not None for p in hooks.backward_plans)
    loss_pf, grads_pf = _fwd_bwd_graph(model, x)
    hooks.remove()
    assert torch.equal(loss_plain, loss_pf)
    assert_same_gradients(grads_plain, grads_pf, "graph+prefetch vs graph")


def test_decoy_also_keeps_bits():
    x = torch.randn(16, 1536, device="cuda", dtype=torch.bfloat16)
    _, grads_plain = _fwd_bwd_graph(stack(), x)
    model = stack()
    PrefetchHooks(model, x, plans=PrefetchPlan(blocks=8), decoy=True)
    _, grads_decoy = _fwd_bwd_graph(model, x)
    assert_same_gradients(grads_plain, grads_decoy)


def test_prefetch_sequential_equals_nn_sequential():
    x = torch.randn(16, 1536, device="cuda", dtype=torch.bfloat16)
    ref = nn.Sequential(*blocks(1536, 6)).cuda().to(torch.bfloat16)
    seq = PrefetchSequential(blocks(1536, 6), plans=None).cuda().to(torch.bfloat16)
    seq.install(x)
    with torch.no_grad():
        assert torch.equal(seq(x), ref(x))
    seq(x).float().sum().backward()
    ref(x).float().sum().backward()
    assert_same_gradients(
        {n.replace("layers.", ""): p.grad for n, p in seq.named_parameters()},
        {n: p.grad for n, p in ref.named_parameters()},
    )


def test_whole_step_graph_with_capturable_adamw_matches_eager_for_10_steps():
    def make():
        model = stack(width=1024, depth=6, dtype=torch.float32, seed=1)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01, foreach=True)
        make_capturable(opt)
        return model, opt

    g = torch.Generator(device="cuda").manual_seed(0)
    batches = [
        (torch.randn(8, 1024, device="cuda", generator=g), torch.randn(8, 1024, device="cuda", generator=g))
        for _ in range(10)
    ]

    def step_fn_for(model):
        return lambda b: (model(b[0]) - b[1]).square().mean()

    eager_model, eager_opt = make()
    eager = []
    for b in batches:
        loss = run_step(step_fn_for(eager_model), b, eager_model, eager_opt)
        eager.append(
            (loss.detach().clone(), {n: p.detach().clone() for n, p in eager_model.named_parameters()})
        )
    graph_model, graph_opt = make()
    hooks = PrefetchHooks(graph_model, batches[0][0], plans=PrefetchPlan(blocks=4))
    step = capture_step(step_fn_for(graph_model), batches[0], graph_model, graph_opt)
    for i, b in enumerate(batches):
        loss = step(b).clone()
        report = compare(
            {"loss": loss, "p": {n: p for n, p in graph_model.named_parameters()}},
            {"loss": eager[i][0], "p": eager[i][1]},
            f"step {i}",
        )
        assert report.ok, str(report)
    hooks.remove()


def test_transformer_encoder_keeps_its_path_with_prefetch():
    """Hooks sit on whole encoder layers: PyTorch takes the same (fast or not) path with them as without."""
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(1024, 16, 4096, batch_first=True)
    model = nn.TransformerEncoder(layer, 4, enable_nested_tensor=False).cuda().half().eval()
    x = torch.randn(2, 64, 1024, device="cuda", dtype=torch.half)
    calls = []
    for m in model.layers:
        m.linear1.register_forward_hook(lambda *a: calls.append(1))
    with torch.inference_mode():
        plain = model(x)
    plain_calls = len(calls)
    hooks = PrefetchHooks(model, x, plans=PrefetchPlan(blocks=8), backward=False)
    calls.clear()
    assert [layer.name for layer in hooks.chain] == [f"layers.{i}" for i in range(4)]
    assert any(p is not None for p in hooks.forward_plans)
    with torch.inference_mode():
        out = model(x)
    torch.cuda.synchronize()
    assert len(calls) == plain_calls  # the same path: a fast path stays a fast path
    assert torch.equal(out, plain)
    hooks.remove()
