"""Modules' ``train()``/``eval()`` flags, parameters' ``requires_grad`` and the code each module runs
(its class, the class's ``forward`` and a ``forward`` its instance holds itself), read before every
replay.

A captured step bakes all three in (dropout on or off, which gradients exist, which code a layer
runs: a callback assigning ``model.head.forward = ...``, ``model.head.__class__ = ...`` or
``Head.forward = ...`` mid-fit was replayed with the old code, silently, on the CPU emulator), so
the callback compares them with the captured step's before each replay. Walking ``module.modules()`` and
``module.parameters()`` for that cost 84 us per step on a 50-module MLP (CPU); reading the same
flags from cached lists costs 5 us. The lists go stale only when a module or parameter is
registered somewhere (``self.head = nn.Linear(...)``, ``Sequential.append``): PyTorch's global
registration hooks mark them stale, and the next read walks the module again, so a new layer is
still seen (its flags make the tuple differ, and the step is captured again).

The same hooks count registrations (:attr:`ModuleFlags.generation`), buffers' too: assigning a new
tensor to a buffer or a parameter (``self.w = self.w * 0.9`` on a registered buffer) registers it
again. A graph reads the tensors it was captured with, so after such a registration the callback
compares the module's parameters and buffers with the captured step's (:meth:`ModuleFlags.rebound`),
a walk it skips on every step where nothing was registered.
"""

from __future__ import annotations

from itertools import repeat
from operator import attrgetter
from typing import Any

from torch import nn
from torch.nn.modules import module as torch_module

_training = attrgetter("training")
_requires_grad = attrgetter("requires_grad")
_instance_dict = attrgetter("__dict__")
_forward = attrgetter("forward")


class ModuleFlags:
    """The flags of `module`'s modules and parameters, from lists rebuilt only after a registration."""

    def __init__(self, module: nn.Module) -> None:
        self.module = module
        self._modules: tuple[nn.Module, ...] = ()
        self._names: list[str] = []
        self._parameters: list[nn.Parameter] = []
        self._stale = True
        # registrations anywhere in the process since this object was made (any module: a cheap
        # counter, the walk that tells whether this module's tensors changed comes only after one)
        self.generation = 0
        self._handles = [
            torch_module.register_module_module_registration_hook(self._mark_stale),
            torch_module.register_module_parameter_registration_hook(self._mark_stale),
            torch_module.register_module_buffer_registration_hook(self._count),
        ]

    def _mark_stale(self, *args: Any) -> None:
        self._stale = True  # returns None: the registration itself is left as it is
        self.generation += 1

    def _count(self, *args: Any) -> None:
        self.generation += 1

    def tensors(self) -> list[tuple[str, Any]]:
        """(name, tensor) of every parameter and buffer of the module, as ``named_parameters`` and
        ``named_buffers`` give them: what a graph captured now reads."""
        return [*self.module.named_parameters(), *self.module.named_buffers()]

    def rebound(self, captured: list[tuple[str, Any]]) -> list[str]:
        """Names of the parameters and buffers that are other tensors than in `captured` (from :meth:`tensors`)."""
        now = dict(self.tensors())
        was = dict(captured)
        changed = [name for name, tensor in captured if now.get(name) is not tensor]
        return changed + sorted(name for name in now if name not in was)

    def read(self) -> tuple[tuple[bool, ...], tuple[bool, ...], tuple[tuple[Any, ...], ...]]:
        """(every module's ``training``, every parameter's ``requires_grad``, the modules' code: (the
        modules, their classes, the classes' ``forward``, the ``forward`` each instance holds in its own
        ``__dict__`` or None)), in ``modules()`` order. The code part is flat tuples, mapped in C: with
        a tuple per module per step the emulated MLP-stack step was 3.3% longer than before the code
        part, with flat tuples 0.6% (benchmarks/results/cpu-emulator/ab_host_path_module_code_*.json)."""
        if self._stale:
            named = list(self.module.named_modules())
            self._names = [name or "the module" for name, _ in named]
            self._modules = tuple(m for _, m in named)  # one tuple until the next registration
            self._parameters = list(self.module.parameters())
            self._stale = False
        modules = self._modules
        classes = tuple(map(type, modules))
        return (
            tuple(map(_training, modules)),  # mapped in C: no Python loop per step
            tuple(map(_requires_grad, self._parameters)),
            (
                modules,
                classes,
                tuple(map(_forward, classes)),
                tuple(map(dict.get, map(_instance_dict, modules), repeat("forward"))),
            ),
        )

    def changed_code(self, captured: tuple, now: tuple) -> tuple[list[str], list[str]]:
        """(names of the modules whose class, class ``forward`` or instance ``forward`` changed; names of
        the modules that are other objects), between two :meth:`read` results with as many modules
        (the caller compares the first two parts first)."""
        changed, replaced = [], []
        for i, name in enumerate(self._names):
            if captured[2][0][i] is not now[2][0][i]:
                replaced.append(name)
            elif any(was[i] != is_[i] for was, is_ in zip(captured[2][1:], now[2][1:])):
                changed.append(name)
        return changed, replaced

    def close(self) -> None:
        """Remove the global registration hooks and drop the references to the module."""
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self._modules, self._parameters = (), []
