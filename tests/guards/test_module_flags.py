"""ModuleFlags: the per-replay flags come from cached lists that a registration makes stale."""

from __future__ import annotations

import torch
from torch import nn
from torch.nn.modules import module as torch_module

from l2lightning.guards.module_flags import ModuleFlags


def model():
    return nn.Sequential(nn.Linear(4, 4), nn.Dropout(0.1), nn.Linear(4, 1))


def test_flags_follow_train_eval_and_requires_grad():
    m = model()
    flags = ModuleFlags(m)
    first = flags.read()
    modules = tuple(m.modules())
    code = (modules, tuple(map(type, modules)), tuple(type(x).forward for x in modules), (None,) * 4)
    assert first == ((True,) * 4, (True,) * 4, code)
    m[1].eval()
    m[2].weight.requires_grad_(False)
    assert flags.read() == ((True, True, False, True), (True, True, False, True), code)
    flags.close()


def test_a_forward_assigned_to_a_modules_instance_or_a_class_swapped_is_read_and_named():
    """A captured step runs the code each layer had at capture: a forward replaced on the instance
    (`model.head.forward = ...`), a class swapped (`model.head.__class__ = ...`) or a class's forward
    patched (`Head.forward = ...`) is part of the flags, and named."""
    m = model()
    flags = ModuleFlags(m)
    captured = flags.read()
    original = m[2].forward
    m[2].forward = lambda x: original(x) * 3
    now = flags.read()
    assert now[:2] == captured[:2] and now != captured
    assert flags.changed_code(captured, now) == (["2"], [])
    del m[2].forward  # the class's forward again: the flags are the captured ones
    assert flags.read() == captured
    m.forward = lambda x: x
    assert flags.changed_code(captured, flags.read()) == (["the module"], [])
    del m.forward

    class Tripled(nn.Linear):
        def forward(self, x):
            return super().forward(x) * 3

    m[0].__class__ = Tripled
    assert flags.changed_code(captured, flags.read()) == (["0"], [])
    swapped = flags.read()
    plain = Tripled.forward
    Tripled.forward = lambda self, x: plain(self, x) * 2  # the class's own forward patched
    assert flags.changed_code(swapped, flags.read()) == (["0"], [])
    Tripled.forward = plain
    assert flags.read() == swapped
    m[1] = nn.GELU()  # another object in its place (a registration: the lists are read again)
    assert flags.changed_code(swapped, flags.read()) == ([], ["1"])
    flags.close()


def test_a_module_registered_later_is_seen():
    m = model()
    flags = ModuleFlags(m)
    before = flags.read()
    m.append(nn.Linear(1, 1))  # Sequential.append registers the new module
    after = flags.read()
    assert len(after[0]) == len(before[0]) + 1 and len(after[1]) == len(before[1]) + 2
    m[3].bias = nn.Parameter(m[3].bias.detach().clone())  # a parameter registered again: still seen
    assert flags.read() == after
    flags.close()


def test_close_removes_the_global_hooks():
    modules_before = len(torch_module._global_module_registration_hooks)
    params_before = len(torch_module._global_parameter_registration_hooks)
    buffers_before = len(torch_module._global_buffer_registration_hooks)
    flags = ModuleFlags(model())
    assert len(torch_module._global_module_registration_hooks) == modules_before + 1
    assert len(torch_module._global_buffer_registration_hooks) == buffers_before + 1
    flags.close()
    assert len(torch_module._global_module_registration_hooks) == modules_before
    assert len(torch_module._global_parameter_registration_hooks) == params_before
    assert len(torch_module._global_buffer_registration_hooks) == buffers_before


def test_a_rebound_buffer_or_parameter_counts_a_registration_and_is_named():
    m = model()
    m[0].register_buffer("scale", torch.ones(()))
    flags = ModuleFlags(m)
    captured, generation = flags.tensors(), flags.generation
    m[0].scale.mul_(2)  # in place: the same tensor, nothing registered
    assert flags.generation == generation and flags.rebound(captured) == []
    m[0].scale = m[0].scale * 2  # a new tensor assigned to the buffer registers it again
    assert flags.generation > generation
    assert flags.rebound(captured) == ["0.scale"]
    m[2].weight = nn.Parameter(m[2].weight.detach().clone())
    assert flags.rebound(captured) == ["2.weight", "0.scale"]
    flags.close()
