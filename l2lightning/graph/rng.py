"""Putting the random generators back without side effects a plain fit would not have.

Every way PyTorch offers to set a CUDA generator's state (``torch.cuda.set_rng_state``,
``Generator.set_state``, ``Generator.set_offset``, ``manual_seed``, and so ``torch.random.fork_rng``'s
put-back) also tells cuDNN to re-seed its RNN dropout state: the next ``nn.LSTM``/``nn.GRU``/``nn.RNN``
call in training with ``dropout > 0`` reads a number back to the host (``.item()``, a sync that ends a
graph capture), draws it from the generator and makes a new dropout-state buffer. A plain fit re-seeds
once, after ``seed_everything``; a fit that put the generator back between its warm-up, traced and
checked steps re-seeded at each, drew other dropout masks than the plain fit, and could not capture.

The flag that asks for the re-seed belongs to the generator object; the seed and offset live in a
state object it points to. ``graphsafe_get_state()`` returns a second generator that points to the same
state object with a flag of its own, so setting the state through it puts the seed and offset back
and leaves the default generator's flag, and so cuDNN's dropout state, alone.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch


def cuda_rng_states(devices: Sequence[int]) -> list[tuple[int, torch.Tensor]]:
    """Each CUDA device's default generator state (seed and offset), as ``torch.cuda.get_rng_state``."""
    return [(d, torch.cuda.get_rng_state(d)) for d in devices]


def put_back_cuda_rng(states: Sequence[tuple[int, torch.Tensor]]) -> None:
    """Put each CUDA device's default generator back to a state saved with :func:`cuda_rng_states`,
    without making cuDNN re-seed its RNN dropout state (see the module's docstring)."""
    for device, state in states:
        generator = torch.cuda.default_generators[device]
        if hasattr(generator, "graphsafe_get_state"):
            generator.graphsafe_get_state().set_state(state)
        else:  # a torch without graph-safe generator states: the re-seed cannot be avoided
            torch.cuda.set_rng_state(state, device)


def reset_cuda_generators(states: Sequence[tuple[int, torch.Tensor]]) -> None:
    """Give each CUDA device's default generator a fresh state object holding `states`' seed and offset.

    After a capture that failed (a host sync, an op that cannot be captured), the generator's state
    object keeps a per-capture offset that only a completed capture resets, and from then on every
    CUDA random op in the process raises ``Offset increment outside graph capture encountered
    unexpectedly``. ``graphsafe_set_state`` swaps in the state object of a new generator (offset 0, not
    capturing) after ``set_state`` has put the saved seed and offset into it, so the default generator
    goes on from exactly where it was, with nothing left of the failed capture; the default
    generator's own re-seed flag is not touched.
    """
    for device, state in states:
        generator = torch.cuda.default_generators[device]
        fresh = torch.Generator(device=f"cuda:{device}")
        fresh.set_state(state)
        generator.graphsafe_set_state(fresh)


@dataclass(frozen=True)
class GeneratorStates:
    """The CPU generator's state and `cuda` devices' default generators' states, saved to be put back."""

    cpu: torch.Tensor
    cuda: list[tuple[int, torch.Tensor]]

    @classmethod
    def save(cls, cuda_devices: Sequence[int] = ()) -> GeneratorStates:
        return cls(torch.get_rng_state(), cuda_rng_states(cuda_devices))

    def put_back(self) -> None:
        """Every generator back where it was, without a cuDNN re-seed (:func:`put_back_cuda_rng`)."""
        torch.set_rng_state(self.cpu)
        put_back_cuda_rng(self.cuda)

    def reset(self) -> None:
        """Every generator back where it was after a capture that failed (:func:`reset_cuda_generators`)."""
        torch.set_rng_state(self.cpu)
        reset_cuda_generators(self.cuda)


@contextlib.contextmanager
def forked_rng(cuda_devices: Sequence[int] = ()) -> Iterator[None]:
    """``torch.random.fork_rng`` for the CPU generator and `cuda_devices`' default generators, putting
    the CUDA ones back with :func:`put_back_cuda_rng` (no cuDNN re-seed) on the way out."""
    saved = GeneratorStates.save(cuda_devices)
    try:
        yield
    finally:
        saved.put_back()


# torch.cuda's functions that set a CUDA generator's state; torch.manual_seed and fork_rng's put-back
# call them through the torch.cuda module, so wrapping the module's attributes sees those too
_CUDA_STATE_SETTERS = (
    "manual_seed",
    "manual_seed_all",
    "seed",
    "seed_all",
    "set_rng_state",
    "set_rng_state_all",
)


def watch_cuda_state_setters(on_set: Callable[[str], None]) -> Callable[[], None]:
    """Call ``on_set(name)`` after each call of ``torch.cuda.NAME`` that sets a CUDA generator's state
    (`_CUDA_STATE_SETTERS`), until the returned function is called.

    Such a call (``seed_everything`` in a hook, ``fork_rng`` around a draw) makes cuDNN re-seed its RNN
    dropout state at the next eager ``nn.LSTM`` call, which a graph's replays never make: the next
    replay must be checked against the eager step. A generator's own methods
    (``torch.cuda.default_generators[0].manual_seed``) are C methods and cannot be wrapped.
    """
    originals = {name: getattr(torch.cuda, name) for name in _CUDA_STATE_SETTERS if hasattr(torch.cuda, name)}

    def wrapped(name: str, original: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(original)
        def setter(*args: Any, **kwargs: Any) -> Any:
            result = original(*args, **kwargs)
            on_set(name)
            return result

        return setter

    for name, original in originals.items():
        setattr(torch.cuda, name, wrapped(name, original))

    def undo() -> None:
        for name, original in originals.items():
            setattr(torch.cuda, name, original)

    return undo
