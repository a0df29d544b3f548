"""Hook order with a recording issuer: forward issues i+d, backward issues i-1, decoy, scope, remove()."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from l2lightning.prefetch.hooks import PrefetchHooks
from l2lightning.prefetch.install import Issuer
from l2lightning.prefetch.plan import PrefetchPlan


class Recorder(Issuer):
    def __init__(self) -> None:
        self.events: list[tuple[str, str, int]] = []

    def issue(self, layer, plan, phase):
        self.events.append(("issue", phase, layer.index))

    def join(self, phase):
        self.events.append(("join", phase, -1))


def stack(n: int = 4, d: int = 64) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.LayerNorm(d), nn.Linear(d, d), nn.GELU()) for _ in range(n)])


PLAN = PrefetchPlan(kind="hint", blocks=2)


def make(model, **kw):
    rec = Recorder()
    plan = kw.pop("plan", PLAN)
    plans = {f"{i}.1": plan for i in range(len(model))}
    hooks = PrefetchHooks(model, torch.randn(2, 64), plans=plans, issuer=rec, **kw)
    return hooks, rec


def test_chain_is_linear_layers_in_execution_order():
    model = stack()
    hooks, _ = make(model)
    assert [layer.name for layer in hooks.chain] == ["0.1", "1.1", "2.1", "3.1"]
    assert all(
        layer.nbytes == 64 * 64 * 4 for layer in hooks.chain
    )  # the 256-byte bias is not worth a launch


def test_each_layer_knows_its_block_only_where_the_block_holds_just_that_layer():
    from l2lightning.prefetch.chain import discover_chain

    class Residual(nn.Module):  # same shape in and out, one Linear inside
        def __init__(self, d):
            super().__init__()
            self.body = nn.Sequential(nn.LayerNorm(d), nn.Linear(d, d), nn.GELU())

        def forward(self, x):
            return x + self.body(x)

    model = nn.Sequential(
        Residual(64),  # the largest block around 0.body.1 is the Residual
        nn.Sequential(nn.Linear(64, 128), nn.ReLU()),  # changes the shape: no block
        nn.Sequential(nn.Linear(128, 128), nn.Linear(128, 128)),  # two chain layers: no block
        nn.Linear(128, 8),  # directly in the model: no block
    )
    chain = discover_chain(model, torch.randn(2, 64))
    assert [layer.name for layer in chain] == ["0.body.1", "1.0", "2.0", "2.1", "3"]
    assert chain[0].block is model[0] and chain[0].block_input == ((2, 64), torch.float32)
    assert chain[0].context == "Residual(LayerNorm,Linear,GELU)"
    assert chain[0].shape_key.endswith("@Residual(LayerNorm,Linear,GELU)")
    assert all(layer.block is None and "@" not in layer.shape_key for layer in chain[1:])


def test_a_block_called_twice_is_not_a_tuning_unit():
    from l2lightning.prefetch.chain import discover_chain

    block = nn.Sequential(nn.Linear(64, 64), nn.GELU())
    model = nn.Sequential(block, block)  # shared: its two calls see different inputs
    (layer,) = discover_chain(model, torch.randn(2, 64))
    assert layer.block is None


def test_forward_issues_next_layer_then_joins_once():
    model = stack()
    hooks, rec = make(model, backward=False)
    with torch.no_grad():
        model(torch.randn(2, 64))
    assert rec.events == [
        ("issue", "forward", 1),
        ("issue", "forward", 2),
        ("issue", "forward", 3),
        ("join", "forward", -1),
    ]


def test_distance_two_issues_two_ahead():
    model = stack()
    hooks, rec = make(model, backward=False, plan=PrefetchPlan(blocks=2, distance=2))
    with torch.no_grad():
        model(torch.randn(2, 64))
    assert [e[2] for e in rec.events if e[0] == "issue"] == [2, 3]


def test_backward_issues_previous_layer_and_joins_before_first_layer():
    model = stack()
    hooks, rec = make(model)
    rec.events.clear()
    model(torch.randn(2, 64)).square().mean().backward()
    backward = [e for e in rec.events if e[1] == "backward"]
    assert backward == [
        ("issue", "backward", 2),
        ("issue", "backward", 1),
        ("issue", "backward", 0),
        ("join", "backward", -1),
    ]
    # the forward join comes before any backward event
    assert rec.events.index(("join", "forward", -1)) < rec.events.index(backward[0])


def test_decoy_aims_half_the_chain_away():
    model = stack()
    hooks, rec = make(model, backward=False, decoy=True)
    with torch.no_grad():
        model(torch.randn(2, 64))
    assert [e[2] for e in rec.events if e[0] == "issue"] == [3, 0, 1]


def test_submodule_called_alone_issues_nothing():
    model = stack()
    hooks, rec = make(model)
    rec.events.clear()
    out = model[1](torch.randn(2, 64, requires_grad=True))
    out.sum().backward()
    assert rec.events == []


def test_remove_restores_plain_pytorch():
    model = stack()
    x = torch.randn(2, 64)
    with torch.no_grad():
        expected = model(x)
    hooks, rec = make(model)
    hooks.remove()
    rec.events.clear()
    with torch.no_grad():
        out = model(x)
    assert rec.events == []
    assert torch.equal(out, expected)
    assert not hooks.enabled
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in model.modules())


def test_manual_scope_acts_only_inside_the_block():
    model = stack()
    hooks, rec = make(model, backward=False, scope="manual")
    with torch.no_grad():
        model(torch.randn(2, 64))
    assert rec.events == []
    with hooks.scope(), torch.no_grad():
        model[0](torch.randn(2, 64))
        model[1](torch.randn(2, 64))
    assert rec.events == [("issue", "forward", 1), ("issue", "forward", 2), ("join", "forward", -1)]


def test_dry_run_leaves_batchnorm_stats_and_rng_alone():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16), nn.BatchNorm1d(16), nn.Dropout(0.5), nn.Linear(16, 16))
    x = torch.randn(8, 16)
    before = [b.clone() for b in model.buffers()]
    rng = torch.get_rng_state()
    PrefetchHooks(model, x, issuer=Recorder())
    assert all(torch.equal(a, b) for a, b in zip(before, model.buffers()))
    assert torch.equal(rng, torch.get_rng_state())


def test_fused_transformer_layer_is_one_chain_step():
    layer = nn.TransformerEncoderLayer(64, 4, 128, batch_first=True)
    model = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
    hooks = PrefetchHooks(model, torch.randn(2, 5, 64), issuer=Recorder(), plans=PLAN)
    assert [layer.name for layer in hooks.chain] == ["layers.0", "layers.1"]


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"plans": "fast"}, "`plans` must be None, 'auto'"),
        ({"plans": {"nope": PLAN}}, "not in the chain"),
        ({"plans": {"0.1": 3}}, "`plans['0.1']` must be a PrefetchPlan"),
        ({"scope": "everywhere"}, "`scope` must be"),
        ({"backward": "yes"}, "`backward` must be a bool"),
    ],
)
def test_bad_arguments_name_the_argument(kwargs, message):
    with pytest.raises((ValueError, TypeError), match=message.replace("[", r"\[").replace("(", r"\(")):
        PrefetchHooks(stack(), torch.randn(2, 64), issuer=Recorder(), **kwargs)


def test_without_cuda_prefetch_is_a_noop_with_one_warning():
    model = stack()
    with pytest.warns(UserWarning, match="L2 prefetch is off") as record:
        hooks = PrefetchHooks(model, torch.randn(2, 64))
        PrefetchHooks(model, torch.randn(2, 64))
    assert len([w for w in record if "L2 prefetch is off" in str(w.message)]) == 1
    assert not hooks.enabled


class WithPositionEmbedding(nn.Module):
    """A container with parameters of its own (like a ViT): not a chain step; backward still joins last."""

    def __init__(self, d: int = 64) -> None:
        super().__init__()
        self.pos = nn.Parameter(torch.zeros(d))
        self.blocks = stack(3, d)
        self.head = nn.Linear(d, d)

    def forward(self, x):
        return self.head(self.blocks(x + self.pos))


def test_container_with_own_parameters_is_not_a_chain_step_and_join_comes_last():
    model = WithPositionEmbedding()
    rec = Recorder()
    names = ["blocks.0.1", "blocks.1.1", "blocks.2.1", "head"]
    hooks = PrefetchHooks(model, torch.randn(2, 64), plans=dict.fromkeys(names, PLAN), issuer=rec)
    assert [layer.name for layer in hooks.chain] == names
    rec.events.clear()
    model(torch.randn(2, 64)).sum().backward()
    backward = [e for e in rec.events if e[1] == "backward"]
    assert backward[-1] == ("join", "backward", -1)
    assert [e[2] for e in backward[:-1]] == [2, 1, 0]


def test_backward_join_fires_once_after_a_partial_backward():
    model = stack()
    hooks, rec = make(model)
    rec.events.clear()
    out = model(torch.randn(2, 64))
    out[:, :3].sum().backward()  # every layer is on the path; only some outputs columns carry gradient
    assert rec.events[-1] == ("join", "backward", -1)
    assert sum(1 for e in rec.events if e == ("join", "backward", -1)) == 1


class TwoHeads(nn.Module):
    def __init__(self, d: int = 64) -> None:
        super().__init__()
        self.trunk = nn.Linear(d, d)
        self.head_a = nn.Linear(d, d)
        self.head_b = nn.Linear(d, d)

    def forward(self, x):
        h = self.trunk(x)
        return self.head_a(h), self.head_b(h)


def test_backward_join_fires_when_a_hooked_output_is_off_the_loss_path():
    model = TwoHeads()
    rec = Recorder()
    PrefetchHooks(
        model, torch.randn(2, 64), plans=dict.fromkeys(["trunk", "head_a", "head_b"], PLAN), issuer=rec
    )
    rec.events.clear()
    a, _ = model(torch.randn(2, 64))
    a.sum().backward()  # head_b's output gets no gradient: its hook never fires
    assert rec.events[-1] == ("join", "backward", -1)


def ops_hooks(model):
    rec = Recorder()
    plans = {f"{i}.1": PLAN for i in range(len(model))}
    hooks = PrefetchHooks(model, torch.randn(2, 64), plans=plans, issuer=rec, scope="manual", via="ops")
    return hooks, rec


EXPECTED_STEP = [
    ("issue", "forward", 1), ("issue", "forward", 2), ("issue", "forward", 3), ("join", "forward", -1),
    ("issue", "backward", 2), ("issue", "backward", 1), ("issue", "backward", 0), ("join", "backward", -1),
]  # fmt: skip


@pytest.mark.parametrize("backend", [None, "aot_eager", "inductor"])
def test_custom_op_points_issue_in_order_eager_and_compiled(backend):
    torch.manual_seed(0)
    model = stack()
    hooks, rec = ops_hooks(model)
    run = torch.compile(model, backend=backend) if backend else model
    x = torch.randn(2, 64)
    run(x).sum().backward()  # outside the scope: the points do nothing
    assert rec.events == []
    with hooks.scope():
        y = run(x)
    y.square().mean().backward()
    hooks.join()
    assert rec.events == EXPECTED_STEP


def test_custom_op_points_compile_to_one_graph_without_breaks():
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    model = stack()
    hooks, rec = ops_hooks(model)
    run = torch.compile(model, backend="aot_eager")
    x = torch.randn(2, 64)
    run(x).sum().backward()
    with hooks.scope():
        run(x).sum().backward()
    hooks.join()
    assert dict(counters["graph_break"]) == {}
    assert counters["stats"]["unique_graphs"] == 1  # the active step reused the inactive step's code


def test_custom_op_points_leave_outputs_and_gradients_unchanged():
    torch.manual_seed(0)
    model = stack()
    x = torch.randn(2, 64)
    model(x).square().sum().backward()
    plain = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    hooks, _ = ops_hooks(model)
    with hooks.scope():
        y = model(x)
    y.square().sum().backward()
    for n, p in model.named_parameters():
        assert torch.equal(p.grad, plain[n]), n
    hooks.remove()
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in model.modules())


def test_via_is_validated():
    with pytest.raises(ValueError, match="`via` must be 'hooks' or 'ops'"):
        PrefetchHooks(stack(), torch.randn(2, 64), issuer=Recorder(), via="magic")


def test_compiled_forward_compiles_torch_containers_and_keeps_the_points():
    from torch._dynamo.utils import counters

    from l2lightning.callback.prefetch_setup import _compiled_forward

    torch._dynamo.reset()
    counters.clear()
    model = stack()
    hooks, rec = ops_hooks(model)
    model.forward = _compiled_forward(model)  # an nn.Sequential: Module.compile() would compile nothing
    with hooks.scope():
        y = model(torch.randn(2, 64))
    y.square().mean().backward()
    hooks.join()
    assert counters["stats"]["unique_graphs"] == 1 and dict(counters["graph_break"]) == {}
    assert rec.events == EXPECTED_STEP


@pytest.mark.parametrize("backward", [False, True], ids=["forward_only", "with_backward"])
def test_a_hooked_pass_leaves_no_autograd_graph_for_the_collector(backward):
    # A graph kept alive by a reference cycle keeps the parameters' AccumulateGrad nodes, which are
    # bound to the stream they were made on: a later capture on another stream fails through them.
    import gc
    import weakref

    model = stack()
    hooks, rec = make(model, scope="manual")
    weight = model[0][1].weight
    collecting = gc.isenabled()
    gc.disable()  # only reference counting may free the graph
    try:
        x = torch.randn(2, 64, requires_grad=True)  # its AccumulateGrad node holds it
        with hooks.scope():
            out = model(x)
        graph_input = weakref.ref(x)
        del x
        if backward:
            out.sum().backward()
        del out
        if not backward:
            with hooks.scope():  # the next pass drops the forward-only pass's join hook
                model(torch.randn(2, 64))
        assert graph_input() is None  # the pass's autograd graph is gone
        assert weight.grad is not None if backward else weight.grad is None
        if backward:
            assert rec.events[-1] == ("join", "backward", -1)
    finally:
        if collecting:
            gc.enable()


def test_the_dry_run_calls_the_users_step_as_lightning_would_and_logs_nothing():
    """The chain discovery's dry run passed `batch_idx` 0 to every step: a `training_step(self, batch)`
    failed with a TypeError on the GPU (the default prefetch runs it), where the fit had been captured."""
    from l2lightning.callback.prefetch_setup import dry_step_of
    from tests.lightning_models import StepWithoutBatchIdx, TinyMLP

    batch = (torch.ones(3, 4), torch.ones(3))
    for cls in (StepWithoutBatchIdx, TinyMLP):  # both log their loss in the step
        module = cls(width=4, depth=1)
        logged = []
        installed_log = module.log = lambda *args, logged=logged, **kwargs: logged.append(args)
        loss = dry_step_of(module.training_step, installed_log)(module, batch)
        assert loss.shape == () and torch.isfinite(loss), cls.__name__
        assert logged == [] and module.log is installed_log, cls.__name__  # silent, and put back
