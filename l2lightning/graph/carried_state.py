"""Carried state: tensors a step reads from an attribute and rebinds to values it computes.

pytorch/examples' word language model keeps its LSTM's hidden state on the module: each step reads
``self.hidden`` and rebinds it to the state its forward returns (``self.hidden =
repackage_hidden(self.hidden)``, then ``output, self.hidden = self.model(data, self.hidden)``), and
``init_hidden`` puts zeros there at every epoch start. A graph reads the memory of the tensors it
was captured with and writes its results to memory of its own, so without more, every replay would
start from the capture's hidden state again.

:func:`carried_attributes` finds such attributes at the capture, from the Python state before and
after the captured step (:mod:`l2lightning.guards.python_state`): a plain attribute (a tensor or a tuple of
tensors), or an entry of a dict of tensors an attribute holds (``self.feats[name] = out`` in a
forward hook), that the step rebound to tensors of the same shapes, dtypes and devices that the step
itself made. :class:`Carried` then replays it as an eager step would: before each replay the
attribute's tensors, whatever set them (the last replay, an eager step, ``init_hidden``), are copied
into the memory the graph reads, where the step reads its old value at all (a value the step only
writes, a loss kept as ``self.last_loss``, is not read: the tensors bound at the capture may be held
elsewhere, in a list of the user's, and stay as they are); after it, the attribute holds fresh copies
of what the graph computed (a new tensor per step, as in plain training: the graph's own memory is
overwritten by the next replay).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch

from l2lightning.guards import python_state
from l2lightning.guards.python_state import NO_KEY, leaves


def _rebuilt(template: Any, tensors: Iterable[torch.Tensor]) -> Any:
    """`template`'s structure (a tensor or nested tuples) around `tensors`, in order."""
    it = iter(tensors)

    def build(node: Any) -> Any:
        if isinstance(node, torch.Tensor):
            return next(it)
        return tuple(build(v) for v in node)

    return build(template)


def _meta(tensors: list[torch.Tensor]) -> list[tuple]:
    return [(tuple(t.shape), t.dtype, t.device, t.layout) for t in tensors]


@dataclass
class Carried:
    """One carried attribute: where it lives, the tensors the graph reads and those it writes."""

    label: str  # "`self.hidden`", "`self.feats['l1']`"
    owner: dict  # the ``__dict__`` the attribute lives in
    name: str
    template: Any  # the value's structure (a tensor or nested tuples of them)
    inputs: list[torch.Tensor]  # the attribute's tensors at the capture (what the graph reads, if any)
    outputs: list[torch.Tensor]  # what the graph writes: the attribute's tensors after the capture
    key: Any = NO_KEY  # an entry of the dict the attribute holds: its key there
    reads_inputs: bool = True  # whether the captured step read `inputs` (else nothing is copied in)

    def current(self) -> list[torch.Tensor] | None:
        holder, slot = _place(self.owner, self.name, self.key)
        return leaves(holder.get(slot)) if holder is not None else None

    def mismatch(self) -> str | None:
        """Why the attribute's value now cannot be handed to the graph, or None (always, for a value the
        step does not read: whatever it holds, the step writes it anew)."""
        if not self.reads_inputs:
            return None
        now = self.current()
        if now is None:
            return f"{self.label} holds no tensor (or tuple of tensors) now"
        if _meta(now) != _meta(self.inputs):
            return f"{self.label} holds tensors of other shapes, dtypes or devices than at capture"
        return None

    def copy_in(self) -> None:
        """Copy the attribute's tensors into the memory the graph reads (call :meth:`mismatch` first)."""
        if not self.reads_inputs:
            return
        with torch.no_grad():
            for dst, src in zip(self.inputs, self.current() or ()):
                if src is not dst:
                    dst.copy_(src)

    def fresh_out(self) -> None:
        """Point the attribute at fresh copies of what the graph computed (the next replay overwrites its own)."""
        holder, slot = _place(self.owner, self.name, self.key)
        if holder is not None:  # (a dict entry whose attribute holds no dict now: nothing to bind)
            holder[slot] = _rebuilt(self.template, [t.detach().clone() for t in self.outputs])


def _place(owner: dict, name: str, key: Any) -> tuple[dict | None, Any]:
    """(the dict a carried value lives in now, its key there): the attributes `owner` and `name`, or
    for an entry (`key`) the dict the attribute holds now and `key` (None where it holds no dict)."""
    if key is NO_KEY:
        return owner, name
    held = owner.get(name)
    return (held if isinstance(held, dict) else None), key


def split_carried(
    before: Any, after: Any, made: set[int], changed: list[str], read: set[int] | None = None
) -> tuple[list[Carried], list[str]]:
    """The carried attributes between two :func:`l2lightning.guards.python_state.snapshot` of a step, and the
    labels among `changed` (its other Python changes) that are not theirs. `read`: the storages the
    step's ops read from before it (``StepTracer.read_from_before``; None: all count as read)."""
    carried = carried_attributes(python_state.rebound_tensors(before, after), made, read)
    labels = {c.label for c in carried}
    return carried, [label for label in changed if label not in labels]


def carried_attributes(
    changes: Iterable[tuple[Any, Any]], made: set[int], read: set[int] | None = None
) -> list[Carried]:
    """The carried attributes among `changes`, the (before, after) entries of
    :func:`l2lightning.guards.python_state.rebound_tensors`: rebound to tensors the step made (their storages
    in `made`) of the same shapes, dtypes and devices. `read` as :func:`split_carried`'s."""
    found = []
    for then, now in changes:
        before, after = leaves(then.value), leaves(now.value)
        if before is None or after is None or _meta(before) != _meta(after):
            continue
        if not all(t.untyped_storage().data_ptr() in made for t in after):
            continue  # rebound to tensors from before the step (an alias of a parameter, say)
        owner = getattr(now.owner, "__dict__", None)
        if owner is None:
            continue
        holder, slot = _place(owner, now.name, now.key)
        if holder is None or holder.get(slot) is not now.value:
            continue
        reads = read is None or any(t.untyped_storage().data_ptr() in read for t in before)
        found.append(Carried(now.label, owner, now.name, then.value, before, after, now.key, reads))
    return found
