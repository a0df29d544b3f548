"""l2lightning.guards.called_code without a Trainer: which hooks a step runs, and what the code it runs
beyond training_step's source reads and assigns outside itself."""

from __future__ import annotations

import functools

import torch
from torch import nn

from l2lightning.guards.called_code import StepHooks, analyse_called_code, step_hooks
from l2lightning.guards.step_source import StepSource
from tests import called_code_models as models

SHIFT = 0.0


def global_names(found: StepSource) -> set[str]:
    return {name for namespace, names in found.global_reads.values() for name in names}


def test_step_hooks_are_found_on_parameters_layers_and_as_global_module_hooks():
    module = models.Hooked("tensor")
    module.head.register_forward_hook(models.scale_output)
    handle = torch.nn.modules.module.register_module_forward_hook(models.scale_output)
    try:
        hooks = step_hooks(module)
    finally:
        handle.remove()
    assert hooks.count(models.scale_output) == 2 and models.clip_grad in hooks
    assert models.scale_output not in step_hooks(module.net)  # the global hook is gone
    assert step_hooks(models.TinyMLP()) == []


def test_a_custom_layers_forward_and_the_helpers_it_calls_are_read_but_torchs_layers_are_not():
    found = StepSource()
    owners = analyse_called_code(models.ScaledHead(), found)
    assert owners == [] and "SCALE" in global_names(found)  # read in Scaled.scaled, via forward
    assert found.reads == set() and found.conditions == []  # the layer's self-reads are not the module's
    plain = StepSource()
    analyse_called_code(nn.Sequential(nn.Linear(2, 2), nn.GELU()), plain)
    assert plain.global_reads == {} and plain.global_writes == []


def test_a_layers_other_methods_are_read_for_their_reads_but_not_their_assignments():
    class Counting(nn.Module):
        def forward(self, x):
            return x

        def encode(self, x):
            return x * models.SCALE + SHIFT

        def reset(self):
            global SHIFT
            SHIFT = 0.0

    module = models.TinyMLP()
    module.extra = Counting()
    found = StepSource()
    analyse_called_code(module, found)
    assert {"SHIFT", "models"} <= global_names(found)  # `models.SCALE`: the module `models` and its SCALE
    assert found.global_writes == []  # reset() is not known to run in the step


def test_hooks_are_read_from_source_or_bytecode_and_a_hook_objects_reads_are_compared_on_it():
    for hook, name in [("tensor", "CLIP"), ("tensor-lambda", "CLIP"), ("full-backward", "SCALE")]:
        found = StepSource()
        analyse_called_code(models.Hooked(hook), found)
        assert name in global_names(found), hook
    found = StepSource()
    module = models.Hooked("object")
    assert analyse_called_code(module, found) == [module.clipper]
    assert found.callback_reads == [(module.clipper, {"limit"})]


def test_a_partial_of_a_hook_is_read_and_an_assigning_hook_is_named():
    module = models.TinyMLP()
    module.head.weight.register_hook(functools.partial(models.count_call))
    found = StepSource()
    analyse_called_code(module, found)
    assert len(found.global_writes) == 1 and found.global_writes[0].startswith("`CALLS` at ")
    assert "called_code_models.py" in found.global_writes[0]


def test_the_modules_own_method_as_a_hook_reads_the_modules_attributes():
    class OwnHook(models.TinyMLP):
        def __init__(self):
            super().__init__()
            self.limit = 0.5
            self.head.weight.register_hook(self.clip)

        def clip(self, grad):
            return grad.clamp(-self.limit, self.limit)

    found = StepSource()
    assert analyse_called_code(OwnHook(), found) == []
    assert "limit" in found.reads


def test_step_hooks_change_when_a_hook_is_added_or_removed_but_not_for_hooks_elsewhere_or_ours():
    module = models.TinyMLP()
    hooks = StepHooks.of(module)
    assert not hooks.changed(module)
    elsewhere = nn.Linear(2, 2).register_forward_hook(models.double)  # a handle made elsewhere
    assert not hooks.changed(module) and hooks.handles == StepHooks.of(module).handles
    elsewhere.remove()
    handle = module.head.register_forward_hook(models.double)
    assert hooks.changed(module)
    hooks = StepHooks.of(module)
    handle.remove()
    assert hooks.changed(module)  # removed: its registry shrank, no handle was made
    ours = module.head.register_forward_hook(step_hooks)  # a function of l2lightning's own
    hooks = StepHooks.of(module)
    ours.remove()
    assert not hooks.changed(module) and hooks.held == []
