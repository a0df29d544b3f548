"""The warm-up tracer: op signatures, host syncs, comparisons between steps, host constants."""

from __future__ import annotations

import pytest
import torch

from l2lightning.guards.step_trace import (
    CaptureRefused,
    HostConstant,
    HostConstants,
    StepTrace,
    StepTracer,
    first_difference,
    same_bytes,
)


def trace(fn, device_type="cpu"):
    tracer = StepTracer(device_type)
    with tracer:
        fn()
    return tracer.trace


def test_a_python_number_that_changes_between_steps_is_the_first_difference():
    x = torch.ones(4)
    a = trace(lambda: x * 0.5 + 1)
    b = trace(lambda: x * 0.5 + 1)
    c = trace(lambda: x * 0.25 + 1)
    assert first_difference(a, b) is None
    difference = first_difference(a, c)
    assert (
        "op 0 was `mul.Tensor(" in difference and "0.5" in difference and "test_step_trace.py:" in difference
    )


def test_ops_of_hooks_that_run_after_each_replay_are_not_compared():
    a, b = StepTrace(), StepTrace()
    for t, value in ((a, 1.0), (b, 2.0)):
        t.ops += [("add.Tensor", (1,)), ("lift_fresh.default", (value,))]
        t.frames += [None, None]
        t.op_hooks += [None, "on_before_optimizer_step"]
    assert first_difference(a, b) is not None
    assert first_difference(a, b, skip_hooks={"on_before_optimizer_step"}) is None


def test_item_is_a_host_sync_named_with_the_users_line():
    x = torch.ones(3)
    t = trace(lambda: x.sum().item())
    assert len(t.syncs) == 1
    what, frame, hook = t.syncs[0]
    assert "`.item()`" in what and frame[0].endswith("test_step_trace.py") and hook is None


def test_a_sync_inside_a_capture_is_refused_before_it_runs():
    tracer = StepTracer("cpu", HostConstants([], torch.device("cpu")))
    with pytest.raises(CaptureRefused, match=r"`.item\(\)`.*test_step_trace.py:\d+"):
        with tracer:
            torch.ones(2).sum().item()


def test_work_on_a_stream_outside_the_capture_is_refused_naming_the_line(monkeypatch):
    from l2lightning.guards import step_trace

    # the check is CUDA's; on the CPU it is exercised on the meta device with the stream's answer set
    monkeypatch.setattr(step_trace, "_STREAM_CAPTURED_DEVICES", ("meta",))
    x = torch.ones(4, device="meta")
    captured = [True]
    monkeypatch.setattr(step_trace, "stream_is_captured", lambda: captured[0])
    current = [7]
    monkeypatch.setattr(step_trace, "current_stream_handle", lambda: current[0])
    capture_stream = type("Stream", (), {"cuda_stream": 5})()
    with StepTracer("meta", HostConstants([], torch.device("meta")), capture_stream=capture_stream):
        (x * 2).sum()  # on a stream forked from the capture's: recorded
    captured[0] = False
    current[0] = 5
    with StepTracer("meta", HostConstants([], torch.device("meta")), capture_stream=capture_stream):
        (x * 2).sum()  # on the capture's own stream: recorded, whatever else is asked
    current[0] = 7
    with pytest.raises(
        CaptureRefused, match=r"`mul.Tensor` at .*test_step_trace.py:\d+ \(`x \* 2`\) runs on a CUDA stream"
    ):
        with StepTracer("meta", HostConstants([], torch.device("meta")), capture_stream=capture_stream):
            x * 2
    with StepTracer("meta"):  # warm-up steps run eagerly: any stream is fine there
        x * 2


def test_host_constants_must_keep_their_bytes():
    same = [HostConstant("arg", torch.arange(3), None, ("f.py", 1))]
    other = [HostConstant("arg", torch.arange(1, 4), None, ("f.py", 1))]
    a, b, c = StepTrace(constants=same), StepTrace(constants=list(same)), StepTrace(constants=other)
    assert first_difference(a, b) is None
    assert "holds different values from step to step" in first_difference(a, c)
    constants = HostConstants(same, torch.device("cpu"))
    tracer = StepTracer("cuda", constants)
    assert torch.equal(tracer._next_constant(torch.arange(3), None), torch.arange(3))
    with pytest.raises(CaptureRefused, match="not in the traced warm-up steps"):
        tracer._next_constant(torch.arange(3), None)
    constants.used = 0
    with pytest.raises(CaptureRefused, match="changed since the warm-up steps"):
        tracer._next_constant(torch.arange(4, 7), ("f.py", 1))


def test_a_boolean_mask_filled_with_one_host_number_is_no_sync_other_mask_indexing_is():
    # ATen runs `x[mask] = 0.0` as masked_fill_ (torchmetrics' macro averages do it); reading
    # x[mask] or writing a tensor through it counts the mask first. Meta stands in for the device.
    tracer = StepTracer("meta")
    aten = torch.ops.aten
    x = torch.ones(4, device="meta")
    mask = torch.ones(4, dtype=torch.bool, device="meta")
    number = torch.tensor(0.0)
    reason = tracer._sync_reason
    assert reason(aten.index_put_.default, (x, [mask], number), {}, [x, mask, number]) is None
    assert reason(aten.index_put.default, (x, [mask], number, False), {}, [x, mask, number]) is None
    accumulating = reason(aten.index_put_.default, (x, [mask], number, True), {}, [x, mask, number])
    on_device = torch.tensor(0.0, device="meta")
    from_device = reason(aten.index_put_.default, (x, [mask], on_device), {}, [x, mask, on_device])
    values = torch.zeros(4)
    many = reason(aten.index_put_.default, (x, [mask], values), {}, [x, mask, values])
    read = reason(aten.index.Tensor, (x, [mask]), {}, [x, mask])
    for what in (accumulating, from_device, many, read):
        assert what is not None and "boolean mask" in what


def test_random_ops_are_told_apart_by_their_generator_or_by_name():
    from l2lightning.guards.step_trace import draws_random_numbers

    aten = torch.ops.aten
    for op in (
        aten.bernoulli_.float,
        aten.native_dropout.default,
        aten.randn_like.default,
        aten.randperm.default,
    ):
        assert draws_random_numbers(op), op
    for op in (aten.mul.Tensor, aten.dropout.default, aten.empty_like.default):
        assert not draws_random_numbers(op), op


def test_output_is_the_steps_only_when_its_own_code_makes_it(tmp_path):
    """print and logging from the user's code are noted; from torch's or an installed package's code
    (a model library's one-time warning) they are not; nothing is noted outside the watched block."""
    import logging

    tracer = StepTracer("cpu")
    for package in ("torch", "modellib"):
        library = tmp_path / "site-packages" / package / "chatty.py"
        library.parent.mkdir(parents=True)
        library.write_text(
            "import logging\ndef chatty():\n    print('lib')\n    logging.getLogger('lib').warning('lib')\n"
        )
        namespace: dict = {}
        exec(compile(library.read_text(), str(library), "exec"), namespace)
        with tracer.watching_output():
            namespace["chatty"]()
    assert tracer.trace.problems == []
    with tracer.watching_output():
        print("mine")
        logging.getLogger("mine").warning("mine")
    assert [p.split(" at ")[0] for p in tracer.trace.problems] == ["`print`", "logging to `mine`"]
    print("after")
    assert len(tracer.trace.problems) == 2


def test_compiled_code_runs_compiled_under_the_tracer_and_its_compilation_is_not_the_steps_seeding():
    from torch._dynamo.utils import counters

    @torch.compile(backend="eager")
    def scaled(x):
        return torch.nn.functional.gelu(x) * 0.5

    torch._dynamo.reset()
    counters.clear()
    tracer = StepTracer("cpu")
    x = torch.ones(4)
    with tracer, tracer.watching_seeds():
        scaled(x)  # dynamo compiles this frame here, saving and putting back the generators' states
    # a TorchDispatchMode that does not ignore compile internals makes dynamo run the frame eagerly
    assert counters["stats"]["unique_graphs"] == 1
    assert tracer.trace.problems == []
    seeding = StepTracer("cpu")
    with seeding, seeding.watching_seeds():
        scaled(x)
        torch.manual_seed(0)
    assert len(seeding.trace.problems) == 1 and "`torch.manual_seed`" in seeding.trace.problems[0]
    torch._dynamo.reset()


def test_inductors_put_back_of_the_generators_is_not_the_steps_seeding_but_seeding_inside_it_is():
    """Inductor generates the backward's code lazily, below `loss.backward()` rather than below dynamo's
    compile entry, inside dynamo's `preserve_rng_state`: its put-back restores what it saved."""
    from torch._dynamo.utils import preserve_rng_state

    tracer = StepTracer("cpu")
    with tracer, tracer.watching_seeds():
        with preserve_rng_state():
            pass
    assert tracer.trace.problems == []
    seeding = StepTracer("cpu")
    with seeding, seeding.watching_seeds():
        with preserve_rng_state():
            torch.manual_seed(0)  # the step's own seeding, whatever context it runs in
    assert len(seeding.trace.problems) == 1 and "`torch.manual_seed`" in seeding.trace.problems[0]


def test_a_host_tensor_passed_into_a_compiled_submodule_is_a_problem_naming_it_and_the_line():
    layer = torch.nn.Linear(4, 4)
    on_device = StepTracer("cpu")  # CPU tensors are the device's here
    with on_device, on_device.watching_compiled_inputs([("encoder", layer)]):
        layer(torch.ones(2, 4))
    assert on_device.trace.problems == []
    tracer = StepTracer("cuda")
    with tracer, tracer.watching_compiled_inputs([("encoder", layer)]):
        layer(torch.ones(2, 4))
    (problem,) = tracer.trace.problems
    assert "passed into `encoder`, compiled with torch.compile" in problem
    assert "test_step_trace.py:" in problem
    assert not layer._forward_pre_hooks  # the watch's hook is gone after the step


def test_a_host_tensor_passed_into_a_module_compiled_in_place_is_a_problem_naming_it_and_the_line():
    """``module.compile()`` compiles the module's call with its hooks, but dynamo skips that call's own
    frame (torch's ``_call_impl``), so the check hooked on the module runs outside the compiled graph:
    found, and the same graph inside the watch and after it."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()

    class Doubled(torch.nn.Linear):  # a forward of the user's: dynamo compiles it (not torch's own)
        def forward(self, x):
            return super().forward(x) * 2

    layer = Doubled(4, 4)
    layer.compile()
    compiled_call = layer._compiled_call_impl
    tracer = StepTracer("cuda")  # the CPU tensors are host tensors to a CUDA step
    with tracer, tracer.watching_compiled_inputs([("encoder", layer)]):
        out = layer(torch.ones(2, 4))
    (problem,) = tracer.trace.problems
    assert "passed into `encoder`, compiled with torch.compile" in problem
    assert "test_step_trace.py:" in problem and "layer(torch.ones(2, 4))" in problem
    assert layer._compiled_call_impl is compiled_call
    assert torch.equal(out, layer(torch.ones(2, 4)))
    assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])
    torch._dynamo.reset()


HOST_SCALE = torch.tensor(0.5)  # a module-level host tensor, read by a compiled function below
HOST_BIAS = torch.tensor(0.0)  # a host tensor as a default argument


def test_a_host_tensor_passed_into_a_compiled_function_is_a_problem_naming_it_and_the_line():
    """A function compiled with torch.compile has no hook: dynamo's wrapper is watched during the step."""
    import torch._dynamo.eval_frame as eval_frame

    @torch.compile(backend="eager")
    def divided_by(x, temperature):
        return x / temperature

    torch._dynamo.reset()
    found = eval_frame.set_eval_frame
    on_device = StepTracer("cpu")  # CPU tensors are the device's here
    with on_device, on_device.watching_compiled_inputs([]):
        out = divided_by(torch.ones(3), torch.tensor(2.0))
    assert on_device.trace.problems == []
    assert torch.equal(out, torch.full((3,), 0.5))
    tracer = StepTracer("cuda")  # the CPU tensors are host tensors to a CUDA step
    with tracer, tracer.watching_compiled_inputs([]):
        divided_by(torch.ones(3), torch.tensor(2.0))
    (problem,) = tracer.trace.problems
    assert (
        "a host tensor is passed into `" in problem and "divided_by`, compiled with torch.compile" in problem
    )
    assert "test_step_trace.py:" in problem and "divided_by(torch.ones(3), torch.tensor(2.0))" in problem
    assert eval_frame.set_eval_frame is found  # the watch is gone after the step
    torch._dynamo.reset()


def test_host_tensors_a_compiled_function_reads_from_globals_closure_or_defaults_are_a_problem_naming_them():
    import functools

    shift = torch.tensor(1.0)

    def user_decorator(fn):
        @functools.wraps(fn)
        def wrapped(*args, **kwargs):
            return fn(*args, **kwargs)

        return wrapped

    @torch.compile(backend="eager")
    @user_decorator
    def scaled(x, bias=HOST_BIAS):
        return x * HOST_SCALE + shift + bias

    torch._dynamo.reset()
    tracer = StepTracer("meta")  # "meta" stands for the device: the CPU tensors are host tensors
    with tracer, tracer.watching_compiled_inputs([]):
        scaled(torch.ones(3, device="meta"))
    (problem,) = tracer.trace.problems
    assert (
        "scaled`, compiled with torch.compile, reads host tensors (`HOST_SCALE`, `bias`, `shift`)" in problem
    )
    # the same function reading only device tensors: nothing
    clean = StepTracer("cpu")
    with clean, clean.watching_compiled_inputs([]):
        scaled(torch.ones(3))
    assert clean.trace.problems == []
    torch._dynamo.reset()


def test_host_tensors_bound_by_a_compiled_partial_or_read_in_nested_code_are_a_problem_naming_them():
    import functools

    def scaled(x, scale):
        return x * scale

    def summed(xs):
        return sum(x * HOST_SCALE for x in xs)  # a generator: its own code object names the global

    torch._dynamo.reset()
    bound = torch.compile(functools.partial(scaled, scale=torch.tensor(0.5)), backend="eager")
    nested = torch.compile(summed, backend="eager")
    tracer = StepTracer("meta")
    with tracer, tracer.watching_compiled_inputs([]):
        bound(torch.ones(3, device="meta"))
        nested([torch.ones(3, device="meta")])
    first, second = tracer.trace.problems
    assert "a host tensor is passed into `" in first and "scaled`, compiled with torch.compile" in first
    assert "summed`, compiled with torch.compile, reads host tensors (`HOST_SCALE`)" in second
    torch._dynamo.reset()


def test_a_check_of_a_compiled_call_that_fails_is_a_problem_of_the_step_not_an_error_in_the_call(monkeypatch):
    from l2lightning.guards import step_trace

    @torch.compile(backend="eager")
    def doubled(x):
        return x * 2

    def broken(fn):
        raise RuntimeError("cannot read this callable")

    monkeypatch.setattr(step_trace, "compiled_target", broken)
    torch._dynamo.reset()
    tracer = StepTracer("cpu")
    with tracer, tracer.watching_compiled_inputs([]):
        out = doubled(torch.ones(2))
    assert torch.equal(out, torch.full((2,), 2.0))  # the user's call ran
    (problem,) = tracer.trace.problems
    assert "could not be checked for host tensors (RuntimeError: cannot read this callable)" in problem
    assert "test_step_trace.py:" in problem and "doubled(torch.ones(2))" in problem
    torch._dynamo.reset()


def test_a_compiled_module_outside_the_watched_submodules_is_checked_through_the_wrapper_and_once_inside():
    """A compiled module the LightningModule holds outside its tree (in a plain list) is found by the
    wrapper's watch, named by its class; a watched submodule is reported by its hook alone."""
    from torch._dynamo.utils import counters

    class Scaled(torch.nn.Module):
        def forward(self, x, scale):
            return x * scale

    torch._dynamo.reset()
    counters.clear()
    hidden = torch.compile(Scaled(), backend="eager")
    tracer = StepTracer("meta")
    with tracer, tracer.watching_compiled_inputs([]):
        hidden(torch.ones(2, device="meta"), torch.tensor(2.0))
    (problem,) = tracer.trace.problems
    assert "passed into `Scaled`, compiled with torch.compile" in problem
    watched = StepTracer("meta")
    with watched, watched.watching_compiled_inputs([("block", hidden)]):
        hidden(torch.ones(2, device="meta"), torch.tensor(2.0))
    (problem,) = watched.trace.problems
    assert "passed into `block`, compiled with torch.compile" in problem
    assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])  # the watch makes no recompile
    torch._dynamo.reset()


def test_a_compiled_submodule_holding_a_host_tensor_attribute_is_a_problem_naming_it():
    class Scaled(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(4, 4)
            self.register_buffer("shift", torch.zeros(4))  # a buffer: Lightning moves it
            self.scale = torch.tensor(0.5)  # a plain attribute: stays on the host

        def forward(self, x):
            return self.lin(x) * self.scale + self.shift

    layer = Scaled().to("meta")  # "meta" stands for the device here: parameters and buffers move
    tracer = StepTracer("meta")
    with tracer, tracer.watching_compiled_inputs([("block", layer)]):
        layer(torch.ones(2, 4, device="meta"))
    (problem,) = tracer.trace.problems
    assert "`block`, compiled with torch.compile, holds host tensors in attributes (`scale`)" in problem


def test_a_capture_notes_the_host_tensors_its_device_ops_read_and_tells_when_one_changed_in_place():
    # "meta" stands for the device: a 0-d CPU tensor in a device op is a number in the kernel's
    # arguments, which a graph keeps from the capture
    temperature = torch.tensor(2.0)
    x = torch.ones(3, device="meta")
    tracer = StepTracer("meta", HostConstants([], torch.device("meta")))
    with tracer:
        x / temperature
        x / temperature  # read twice: noted once
        torch.ones(2) * temperature  # a host op: nothing for a graph to keep
    (read,) = tracer.host_reads
    assert read.tensor is temperature and read.frame[0].endswith("test_step_trace.py")
    assert not read.changed()
    temperature.mul_(0.9)  # an epoch hook annealing it in place
    assert read.changed()


@pytest.mark.parametrize(
    "step",
    [
        lambda x, t: x / t.clamp(min=0.1),  # a host op between the attribute and the device op
        lambda x, t: x / (t * 2).sqrt(),  # two of them
        lambda x, t: x * t.item(),  # the value read on the host, then a number in the device op
        lambda x, t: x * float(t),
    ],
    ids=["clamp", "chain", "item", "float"],
)
def test_a_host_tensor_reaching_the_device_through_host_ops_is_the_one_noted(step):
    """The step makes the host op's output anew at every eager step; what a replay keeps stale is the
    value of the host tensor it was made of (`self.temperature`, annealed by an epoch hook)."""
    temperature = torch.tensor(2.0)
    x = torch.ones(3, device="meta")
    tracer = StepTracer("meta", HostConstants([], torch.device("meta")))
    with tracer:
        step(x, temperature)
        torch.ones(2) * temperature  # a host op whose output stays on the host: nothing noted
    (read,) = tracer.host_reads
    assert read.tensor is temperature and read.frame[0].endswith("test_step_trace.py")
    assert not read.changed()
    temperature.mul_(0.9)
    assert read.changed()


@pytest.mark.parametrize(
    "write",
    [
        lambda seen, big: seen.add_(8),  # a host counter of samples seen
        lambda seen, big: big[:2].mul_(0.9),  # through a view
        lambda seen, big: torch.add(big, 1, out=big),
    ],
    ids=["counter", "view", "out"],
)
def test_a_step_changing_a_host_tensor_it_holds_in_place_is_a_problem_naming_it_and_the_line(write):
    seen, big = torch.zeros(()), torch.zeros(100)
    tracer = StepTracer("meta")  # "meta" stands for the device: CPU tensors are host tensors
    tracer.host_state = {
        seen.untyped_storage().data_ptr(): "`self.seen`",
        big.untyped_storage().data_ptr(): "`self.big`",
    }
    with tracer:
        own = torch.tensor([1.0, 2.0])  # the step's own host tensors, made anew at every step
        own.add_(1)
        torch.zeros(3)[:1].mul_(2)
        write(seen, big)
    (problem,) = tracer.trace.problems
    assert "a host (CPU) tensor, is changed in place by `" in problem
    assert problem.startswith(("`self.seen`", "`self.big`")) and "test_step_trace.py:" in problem


def test_sparse_host_tensors_compare_by_value():
    adjacency = torch.eye(3).to_sparse()
    assert same_bytes(adjacency, adjacency.detach().clone())
    assert not same_bytes(adjacency, (adjacency * 2).coalesce())
    assert not same_bytes(adjacency, adjacency.to_dense())


def test_a_substituted_host_constant_changed_in_place_is_what_the_next_capture_substitutes():
    mask = torch.tensor([1.0, 0.0, 1.0])
    x = torch.ones(3, device="meta")
    traced = StepTracer("meta")
    with traced:
        x * mask.to("meta")
    (entry,) = traced.trace.constants
    constants = HostConstants(traced.trace.constants, torch.device("meta"))
    capture = StepTracer("meta", constants)
    with capture:
        x * mask.to("meta")
    assert constants.sources == [mask] and [r.tensor for r in capture.host_reads] == [mask]
    mask[1] = 1.0
    assert capture.host_reads[0].changed()
    constants.take_changed_sources()
    assert torch.equal(entry.value, torch.ones(3)) and entry.result.device.type == "meta"
    again = HostConstants(traced.trace.constants, torch.device("meta"))
    with StepTracer("meta", again):
        x * mask.to("meta")  # the new bytes are the constant now: no refusal
    assert again.used == 1


def test_code_inductor_generated_is_not_the_users_line():
    """Inductor's wrappers (in its cache directory) call aten ops: a problem found there names the
    user's line that called the compiled code instead."""
    import os

    import torch._inductor.runtime.cache_dir_utils as cache_dir_utils

    from l2lightning.guards.step_trace import _is_library

    generated = os.path.join(os.path.abspath(cache_dir_utils.default_cache_dir()), "ab", "cabc.py")
    if os.environ.get("TORCHINDUCTOR_CACHE_DIR"):
        generated = os.path.join(os.path.abspath(os.environ["TORCHINDUCTOR_CACHE_DIR"]), "ab", "cabc.py")
    assert _is_library(generated)
    assert not _is_library(os.path.join(os.path.dirname(os.path.abspath(__file__)), "my_model.py"))


def test_a_draw_from_a_generator_of_the_steps_own_is_told_from_the_default_generators():
    from l2lightning.guards.step_trace import draws_from_its_own_generator

    randn = torch.ops.aten.randn.generator
    normal = torch.ops.aten.normal_.default  # `generator` is a keyword of the in-place draw
    own = torch.Generator().manual_seed(0)
    assert draws_from_its_own_generator(randn, ([2],), {"generator": own}, "cpu")
    assert draws_from_its_own_generator(normal, (torch.empty(2), 0.0, 1.0, own), {}, "cpu")
    assert not draws_from_its_own_generator(randn, ([2],), {"generator": torch.default_generator}, "cpu")
    assert not draws_from_its_own_generator(randn, ([2],), {"generator": None}, "cpu")
    assert not draws_from_its_own_generator(
        torch.ops.aten.add.Tensor, (torch.ones(1), torch.ones(1)), {}, "cpu"
    )
    # a host generator feeding a host op, in a step on another device: the Python-state snapshot's case
    assert not draws_from_its_own_generator(randn, ([2],), {"generator": own}, "cuda")
