"""Static batch buffers, batch signatures and undoing warm-up: the parts of capture that need no GPU."""

from __future__ import annotations

import collections
import types

import pytest
import torch
from torch import nn

from l2lightning.graph.capture import (
    BatchMismatchError,
    StaticBatch,
    TrainingState,
    flatten_batch,
    unflatten_batch,
)
from l2lightning.graph.optim import (
    CapturableOptimizer,
    OptimizerNotCapturableError,
    capture_support,
    make_capturable,
)


def test_nested_batch_round_trips():
    batch = {"x": torch.ones(2, 3), "pair": (torch.zeros(2), [torch.arange(2)]), "tag": "train"}
    tensors, spec = flatten_batch(batch)
    assert len(tensors) == 3
    rebuilt = unflatten_batch(spec, [t + 1 for t in tensors])
    assert rebuilt["tag"] == "train" and torch.equal(rebuilt["pair"][1][0], torch.arange(2) + 1)


@pytest.mark.parametrize(
    "make",
    [
        lambda x: collections.defaultdict(list, {"x": x, "n": 3}),
        lambda x: types.MappingProxyType({"x": x, "n": 3}),
        lambda x: collections.OrderedDict(x=x, n=3),
    ],
    ids=["defaultdict", "mappingproxy", "OrderedDict"],
)
def test_mapping_batches_are_rebuilt_as_their_own_type(make):
    """Rebuilt from a dict, as Lightning's apply_to_collection rebuilds them (a defaultdict with its
    factory): a collate_fn's defaultdict once made the capture raise a TypeError."""
    batch = make(torch.ones(2))
    static = StaticBatch(batch)
    assert type(static.batch) is type(batch) and static.batch["n"] == 3
    assert getattr(static.batch, "default_factory", None) is getattr(batch, "default_factory", None)
    assert static.batch["x"] is static.tensors[0] and static.mismatch(make(torch.zeros(2))) is None


def test_static_batch_copies_and_rejects_other_shapes_and_dtypes():
    static = StaticBatch((torch.ones(4, 3), torch.zeros(4, dtype=torch.long)))
    static.copy_in((torch.full((4, 3), 2.0), torch.ones(4, dtype=torch.long)))
    assert float(static.batch[0].sum()) == 24.0
    assert "batch tensor 0 is (3, 3)" in static.mismatch((torch.ones(3, 3), torch.zeros(3, dtype=torch.long)))
    with pytest.raises(BatchMismatchError, match="torch.int32"):
        static.copy_in((torch.ones(4, 3), torch.zeros(4, dtype=torch.int32)))
    assert "structure" in static.mismatch([torch.ones(4, 3)])


def test_training_state_restore_undoes_adam_warmup_in_place():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    fresh_model = [p.clone() for p in model.parameters()]
    saved = TrainingState.save(model, opt)
    weight = model[0].weight
    for _ in range(3):
        opt.zero_grad()
        model(torch.randn(8, 4)).sum().backward()
        opt.step()
    exp_avg = opt.state[weight]["exp_avg"]
    saved.restore(opt)
    assert model[0].weight is weight and opt.state[weight]["exp_avg"] is exp_avg  # same objects
    assert all(torch.equal(a, b) for a, b in zip(fresh_model, model.parameters()))
    assert float(model[1].num_batches_tracked) == 0
    assert float(exp_avg.abs().sum()) == 0 and float(opt.state[weight]["step"]) == 0


def test_host_only_save_copies_host_tensors_and_leaves_device_tensors_in_place():
    # What a failed capture undoes: it ran no kernel, so device tensors are left as they are (not
    # copied, which would cost three times the parameter bytes, and not zeroed at restore). Meta
    # tensors stand in for device tensors on a CPU-only machine.
    model = nn.Linear(2, 2)
    device_weight = torch.zeros(2, 2, device="meta")
    model.register_buffer("counter", torch.zeros(()))  # a host buffer a step could bump
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.ones(1, 2)).sum().backward()
    opt.step()
    weight_state = opt.state[model.weight]
    exp_avg_on_host = weight_state["exp_avg"].clone()
    weight_state["exp_avg_device"] = device_weight  # an optimizer state tensor off the host
    saved = TrainingState.save(model, opt, host_only=True)
    assert not isinstance(saved.optimizer_state[id(model.weight)]["exp_avg_device"], torch.Tensor)
    assert isinstance(saved.optimizer_state[id(model.weight)]["exp_avg"], torch.Tensor)
    model.counter.add_(1)
    weight_state["exp_avg"].add_(1)
    weight_state["step"].add_(1)
    saved.restore(opt)
    assert float(model.counter) == 0 and float(weight_state["step"]) == 1
    assert torch.equal(weight_state["exp_avg"], exp_avg_on_host)
    assert weight_state["exp_avg_device"] is device_weight  # not replaced

    everything = TrainingState.save(model, opt)
    assert isinstance(everything.optimizer_state[id(model.weight)]["exp_avg_device"], torch.Tensor)


def test_sgd_with_dampening_refuses_inexact_undo():
    model = nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, dampening=0.1)
    saved = TrainingState.save(model, opt)
    model(torch.ones(1, 2)).sum().backward()
    opt.step()
    with pytest.raises(ValueError, match="dampening"):
        saved.restore(opt)


def test_make_capturable_refuses_cpu_parameters():
    opt = torch.optim.AdamW(nn.Linear(2, 2).parameters(), lr=1e-3)
    with pytest.raises(ValueError, match="parameters are on cpu"):
        make_capturable(opt)


def test_portable_state_dict_turns_tensor_lr_and_device_steps_back():
    opt = torch.optim.AdamW(nn.Linear(2, 2).parameters(), lr=1e-3)
    wrapped = CapturableOptimizer(
        opt, tensor_lr=True, original_capturable=[False]
    )  # as make_capturable leaves it
    state_dict = {
        "state": {0: {"step": torch.tensor(3.0), "exp_avg": torch.ones(2)}},
        "param_groups": [{"lr": torch.tensor(5e-4), "capturable": True, "params": [0]}],
    }
    portable = wrapped.portable_state_dict(state_dict)
    assert portable["param_groups"][0]["lr"] == pytest.approx(5e-4) and isinstance(
        portable["param_groups"][0]["lr"], float
    )
    assert portable["param_groups"][0]["capturable"] is False
    assert portable["state"][0] is not state_dict["state"][0]  # live optimizer state is never edited
    assert isinstance(state_dict["param_groups"][0]["lr"], torch.Tensor)


@pytest.fixture
def capturable_on_cpu(monkeypatch):
    """Let make_capturable and torch's capturable optimizers accept CPU parameters (their math is plain tensor ops)."""
    import torch.optim.adam as adam_module

    from l2lightning.graph import optim

    monkeypatch.setattr(optim, "CAPTURABLE_DEVICE_TYPES", ("cuda", "cpu"))
    monkeypatch.setattr(adam_module, "_get_capturable_supported_devices", lambda *a, **k: ["cuda", "cpu"])


def test_make_capturable_keeps_float_lrs_and_steps_with_a_tensor_that_follows_them(capturable_on_cpu):
    model = nn.Linear(2, 2)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=True)
    sched = torch.optim.lr_scheduler.StepLR(opt, 1, 0.5)
    wrapped = make_capturable(opt)
    seen = []
    for _ in range(3):
        opt.zero_grad()
        model(torch.ones(1, 2)).sum().backward()
        opt.step()
        seen.append(float(wrapped.lr_tensors[0]))
        sched.step()
    group = opt.param_groups[0]
    assert type(group["lr"]) is float and group["lr"] == 1e-2 * 0.5**3  # exact: the scheduler's double math
    assert all(type(v) is float for v in sched.get_last_lr())
    assert seen == [float(torch.tensor(v, dtype=torch.float32)) for v in (1e-2, 5e-3, 2.5e-3)]
    group["lr"] = 0.125  # user code setting the LR by hand (Lightning docs' warm-up)
    opt.step()
    assert float(wrapped.lr_tensors[0]) == 0.125 and group["lr"] == 0.125
    assert make_capturable(opt) is wrapped  # a second call keeps the one wrapper


def test_release_gives_back_the_configured_optimizer(capturable_on_cpu):
    opt = torch.optim.AdamW(nn.Linear(2, 2).parameters(), lr=3e-4)
    had_step = "step" in vars(opt)
    wrapped = make_capturable(opt)
    assert opt.param_groups[0]["capturable"] is True and "step" in vars(opt)
    assert wrapped.release() is opt
    assert opt.param_groups[0]["capturable"] is False and opt.param_groups[0]["lr"] == 3e-4
    assert ("step" in vars(opt)) == had_step


def test_baked_hyperparameters_that_change_are_named(capturable_on_cpu):
    opt = torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=0.1, momentum=0.9)
    wrapped = make_capturable(opt)
    assert wrapped.lr_tensors == [None] and wrapped.baked_changes() == []
    opt.param_groups[0]["lr"] = 0.05
    opt.param_groups[0]["momentum"] = 0.8
    assert wrapped.baked_changes() == ["group 0 `lr` 0.1 -> 0.05", "group 0 `momentum` 0.9 -> 0.8"]
    wrapped.mark_captured()
    assert wrapped.baked_changes() == []
    adam = make_capturable(torch.optim.Adam(nn.Linear(2, 2).parameters(), lr=0.1))
    adam.optimizer.param_groups[0]["lr"] = 0.01  # read from a tensor in the graph: not baked
    assert adam.baked_changes() == []


def test_uncapturable_optimizer_is_named():
    opt = torch.optim.LBFGS(nn.Linear(2, 2).parameters())
    assert "LBFGS" in capture_support(opt)
    with pytest.raises(OptimizerNotCapturableError, match="optimizer LBFGS has no `capturable` mode"):
        make_capturable(opt)


def test_captured_step_holds_what_its_graph_writes():
    import gc
    import weakref

    from l2lightning.graph.capture import CapturedStep

    model = nn.Linear(2, 2)
    opt = torch.optim.AdamW(model.parameters())
    step = CapturedStep(object(), StaticBatch(torch.ones(1, 2)), torch.zeros(()), model, opt)
    refs = weakref.ref(model), weakref.ref(opt)
    del model, opt
    gc.collect()
    assert all(r() is not None for r in refs)  # the graph updates them in place at every replay
    del step
    gc.collect()
    assert all(r() is None for r in refs)


def test_graph_capture_clears_cublas_workspaces_around_the_capture(monkeypatch):
    import contextlib

    from l2lightning.graph import capture

    events = []

    @contextlib.contextmanager
    def fake_graph(graph, pool=None, stream=None, capture_error_mode="global"):
        assert capture_error_mode == "thread_local"
        events.append("enter")
        yield
        events.append("exit")

    monkeypatch.setattr(capture, "clear_cublas_workspaces", lambda: events.append("clear"))
    monkeypatch.setattr(torch.cuda, "graph", fake_graph)
    with capture.graph_capture(object()):
        events.append("body")
    assert events == ["clear", "enter", "body", "exit", "clear"]


def test_flattening_a_batch_leaves_no_reference_cycle():
    # a cycle would keep the batch's tensors alive until the garbage collector runs
    import gc
    import weakref

    from l2lightning.graph.capture import batch_signature, flatten_batch

    x = torch.randn(3)
    ref = weakref.ref(x)
    collecting = gc.isenabled()
    gc.disable()
    try:
        flatten_batch({"x": [x, (x, 1)]})
        batch_signature((x, {"y": x}))
        del x
        assert ref() is None
    finally:
        if collecting:
            gc.enable()


def test_held_objects_are_the_users_plain_objects_only():
    import logging
    import random

    from l2lightning.guards.python_state import held_objects

    class Schedule:
        def __init__(self):
            self.weight = 0.5

    class Holder:
        pass

    holder = Holder()
    holder.schedule = Schedule()  # the user's own plain object: held
    holder.layer = nn.Linear(2, 2)  # a module: a submodule, not a held object
    holder.table = {
        "a": 1
    }  # containers, tensors, numbers and functions are not objects with state of their own
    holder.weights = torch.ones(2)
    holder.rate = 0.1
    holder.fn = lambda x: x
    holder.log = logging.getLogger("x")  # a library's object
    holder._private = Schedule()  # a private attribute of the user's own class is its state too
    names = [name for name, _ in held_objects(holder)]
    assert names == ["schedule", "_private"]
    # a library's object keeps its private attributes to itself: its own held objects are public only
    library_held = logging.getLogger("y")
    library_held._schedule = Schedule()
    assert held_objects(library_held) == []
    assert held_objects(random) == []  # a module object has no plain objects of the user's


@pytest.mark.parametrize("kind", ["random", "numpy", "numpy_legacy", "torch_cpu"])
def test_a_held_generators_draw_is_a_change_and_restore_puts_its_state_back(kind):
    """Random generators held in attributes are snapshot by state: a draw is a change (the callback
    refuses a step that draws), and restore (around the chain discovery's dry run) undoes the draw."""
    import random

    import numpy as np

    from l2lightning.guards import python_state

    made = {
        "random": lambda: random.Random(3),
        "numpy": lambda: np.random.default_rng(3),
        "numpy_legacy": lambda: np.random.RandomState(3),
        "torch_cpu": lambda: torch.Generator().manual_seed(3),
    }[kind]

    def draw(g):
        return (
            float(torch.rand(1, generator=g))
            if kind == "torch_cpu"
            else g.random()
            if kind != "numpy_legacy"
            else g.random_sample()
        )

    module = nn.Linear(2, 2)
    module.rng = made()
    holders = python_state.owners(module)
    before = python_state.snapshot(holders)
    assert python_state.changed(before, python_state.snapshot(holders)) == []
    first = draw(module.rng)
    assert python_state.changed(before, python_state.snapshot(holders)) == ["`self.rng` (a random generator)"]
    python_state.restore(before)
    assert draw(module.rng) == first  # the same draw again


def test_a_draw_from_torchs_global_cpu_generator_is_a_change_only_for_a_step_off_the_cpu():
    """Training on a GPU, torch's global CPU generator is the host's: a draw from it in the step runs at
    capture only, so it is Python state (refused, restored around the dry run). Training on the CPU, it
    is the device's generator, which the captured ops draw from themselves."""
    from l2lightning.guards import python_state

    module = nn.Linear(2, 2)
    holders = python_state.owners(module)
    for device_type, expected in (("cuda", [python_state.TORCH_CPU_RANDOM_LABEL]), ("cpu", [])):
        before = python_state.snapshot(holders, device_type=device_type)
        first = torch.rand(3)
        assert (
            python_state.changed(before, python_state.snapshot(holders, device_type=device_type)) == expected
        )
        python_state.restore(before)
        if expected:
            assert torch.equal(torch.rand(3), first)  # the same draw again
            assert python_state.names_a_generator(expected[0])


def test_host_tensors_are_the_cpu_tensors_held_as_attributes_or_buffers_by_storage_with_labels():
    from torchmetrics import MeanMetric

    from l2lightning.guards import python_state

    class Holder(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.seen = torch.zeros(())
            self.register_buffer("counts", torch.zeros(4))
            self.view_of_counts = self.counts[:2]  # the same storage: named once
            self.on_meta = torch.zeros(2, device="meta")  # the device's (meta stands for it)
            self._private = torch.zeros(2)
            self.empty = torch.zeros(0)
            self.adjacency = torch.eye(3).to_sparse()  # no storage: left out
            self.metric = MeanMetric()  # its states are the metric binding's

    module = Holder()
    found = python_state.host_tensors(python_state.owners(module))
    assert found == {
        module.seen.untyped_storage().data_ptr(): "`self.seen`",
        module.counts.untyped_storage().data_ptr(): "`self.counts`",
        # the user's class: its private attributes are its state too (nn.Module's own are not)
        module._private.untyped_storage().data_ptr(): "`self._private`",
    }


def test_the_arguments_a_partial_binds_are_compared_and_a_keyword_changed_in_place_is_named():
    import functools

    from l2lightning.guards import python_state

    holder = {"loss_fn": functools.partial(torch.nn.functional.smooth_l1_loss, beta=1.0), "act": torch.tanh}
    binds_a_module = functools.partial(torch.nn.functional.linear, weight=nn.Linear(2, 2))
    holder["project"] = binds_a_module
    checks = python_state.partial_bindings([(holder, name, value) for name, value in holder.items()])
    assert [name for _, name, _ in checks] == ["loss_fn"]  # not a plain function; not one binding a module
    assert python_state.changed_partial_bindings(checks) == []
    holder["loss_fn"].keywords["beta"] = 0.5  # the same partial object
    assert python_state.changed_partial_bindings(checks) == ["loss_fn"]


def test_a_tensor_moved_to_other_memory_is_named_though_it_is_the_same_object():
    """A graph reads a tensor at its capture's address: `t.data = other` and `t.set_(other)` keep the
    object (so an identity check passes) and move the memory."""
    from l2lightning.guards import python_state
    from l2lightning.guards.step_values import frozen

    holder = {"scale": torch.ones(3), "shift": torch.zeros(3)}
    checks = [(holder, name, value) for name, value in holder.items()]
    captured = python_state.addresses(checks)
    snapshot = frozen({"w": holder["scale"]}, tensors=True)
    assert python_state.addresses(checks) == captured and python_state.moved(checks, captured) == []
    holder["scale"].mul_(2)  # in place: the same memory
    assert (
        python_state.moved(checks, captured) == []
        and frozen({"w": holder["scale"]}, tensors=True) == snapshot
    )
    holder["scale"].data = torch.full((3,), 5.0)
    assert python_state.moved(checks, captured) == ["scale"]
    assert frozen({"w": holder["scale"]}, tensors=True) != snapshot  # a tensor in a container likewise
    holder["shift"].set_(torch.ones(3))
    assert python_state.moved(checks, captured) == ["scale", "shift"]
