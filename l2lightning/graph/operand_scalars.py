"""Python numbers a step multiplies, adds or subtracts to a tensor, read by the graph from device scalars.

A loss weight an epoch hook anneals (``loss - self.ent_coef * entropy``, CleanRL's PPO), or one the step
computes from the epoch (``beta = 0.5 * min(self.current_epoch, 2)``; ``loss + beta * reg``), is a
Python number: a captured graph bakes it in, and every change used to capture the step again, with its
warm-up, which over short epochs made the fit slower than plain. Where such a number reaches the graph
only as the operand of a tensor ``*``, ``+`` or ``-`` written in the step's source, the capture hands the
op a 0-dim device tensor instead (an :class:`OperandSite` per such expression in the source), and
before each replay the callback evaluates the expression again and writes its value there: one capture
serves every value.

Bitwise the eager step, by construction of the cases taken:

* only ``Tensor * number``, ``Tensor + number``, ``Tensor - number`` and ``number - Tensor`` (``mul``,
  ``add``, ``sub``, ``rsub`` from a ``BinOp`` of the source, found by the Python frame's instruction
  position) on float32 and float64 tensors. PyTorch computes those in the tensor's own dtype with the
  number rounded to it once, whether the number comes as a Python scalar or as a 0-dim tensor of that
  dtype, and their backward multiplies by the same value. Not division (PyTorch multiplies by the
  reciprocal of a Python scalar) and not float16/bfloat16 (a Python scalar stays in float32 there);
* the number must equal the expression's value at the capture, and every read of what it depends on
  must lie inside such sites (:mod:`l2lightning.guards.step_source` decides that from the source; anything
  else, a branch on it, a log, a Python product kept in a local, keeps the re-capture);
* the first replays with a new value (``OPERAND_CHECKS`` of each capture) are sampled replay checks
  (:mod:`l2lightning.guards.replay_check`): the eager step from the same state, compared bit for bit; a
  mismatch captures again with such numbers baked in. So device scalars are used only with
  ``verify="sampled"``: a use of the number that no analysis saw (code read as another object's, a
  C function's) is not compared before each replay any more, and the check is what sees it.

The warm-up steps hand the sites device scalars too (the same work, bit for bit), so a number that
moves at every step (a KL ramp from ``global_step``) leaves their traces alike and is captured once.
"""

from __future__ import annotations

import math
import os
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

# What a BinOp of the source reaches __torch_function__ as (Tensor first: `w * t` comes as mul(t, w))
_BINARY_OPS = frozenset({torch.Tensor.mul, torch.Tensor.add, torch.Tensor.sub, torch.Tensor.__rsub__})
_EXACT_DTYPES = (torch.float32, torch.float64)
_TORCH_DIR = os.path.dirname(torch.__file__)


@dataclass(frozen=True)
class OperandSite:
    """A ``BinOp`` of the step's source whose one side is a Python number the module alone evaluates."""

    # (file, line, column, end line, end column) of the BinOp in the file: what CPython's
    # co_positions gives for the instruction that runs it
    key: tuple[str, int, int, int, int]
    evaluate: Callable[[Any, int], Any]  # (module, batch_idx) -> the number
    line: str  # "file:line (`source`)"


def is_number(value: Any) -> bool:
    """A Python int or float (not bool) that a device scalar holds exactly as the op would use it."""
    return type(value) in (int, float) and (type(value) is int or math.isfinite(value))


@dataclass
class _Scalar:
    site: OperandSite
    tensors: dict[torch.dtype, torch.Tensor] = field(default_factory=dict)
    value: Any = None
    used: set[torch.dtype] = field(default_factory=set)  # the dtypes its ops took: written per change


class OperandScalars:
    """The device scalars of one capture: made before it, handed to its ops, filled before each replay."""

    def __init__(self, sites: list[OperandSite], device: torch.device, module: Any, batch_idx: int) -> None:
        self.sites = {s.key: _Scalar(s) for s in sites}
        self.device = device
        self.hit: set[tuple] = set()  # sites whose op took a device scalar at the capture
        self.baked: set[tuple] = set()  # sites whose number reached something else: baked as before
        # the sites every run of whose op in the capture took the device scalar: set as each
        # substitution ends, so a replay's update reads it without building it again
        self.live: frozenset[tuple] = frozenset()
        self.changes = 0  # values written after the capture (summary()['operand_scalars'])
        for scalar in self.sites.values():
            try:
                scalar.value = scalar.site.evaluate(module, batch_idx)
            except Exception:
                scalar.value = None
            if not is_number(scalar.value):
                self.baked.add(scalar.site.key)
                continue
            # made before the capture: a fill inside it would run again at every replay
            for dtype in _EXACT_DTYPES:
                scalar.tensors[dtype] = torch.full((), scalar.value, dtype=dtype, device=device)

    def take(self, site_key: tuple, tensor: Any, number: Any) -> torch.Tensor | None:
        """The device scalar for `number` at the site, or None (the site is then baked)."""
        scalar = self.sites.get(site_key)
        if scalar is None:
            return None
        if (
            not isinstance(tensor, torch.Tensor)
            or tensor.dtype not in scalar.tensors
            or tensor.device != self.device
            or type(number) is not type(scalar.value)
            or number != scalar.value
        ):
            self.baked.add(site_key)
            return None
        self.hit.add(site_key)
        scalar.used.add(tensor.dtype)
        return scalar.tensors[tensor.dtype]

    def update(self, module: Any, batch_idx: int) -> bool | None:
        """Before a replay: each live site's value now, written where it changed. True if one changed,
        False if none did, None if one is no longer a number (the step is captured again)."""
        changed = False
        for key in self.live:
            scalar = self.sites[key]
            try:
                now = scalar.site.evaluate(module, batch_idx)
            except Exception:
                return None
            if not is_number(now):
                return None
            if type(now) is type(scalar.value) and now == scalar.value:
                continue
            for dtype in scalar.used:
                scalar.tensors[dtype].fill_(now)
            scalar.value = now
            changed = True
        if changed:
            self.changes += 1
        return changed


@contextmanager
def substituting(operands: OperandScalars | None) -> Iterator[None]:
    """Around a traced or captured step: each site's op gets its device scalar instead of the number
    (nothing to substitute where `operands` is None)."""
    if operands is None:
        yield
        return
    try:
        with _Substitution(operands):
            yield
    finally:
        operands.live = frozenset(operands.hit - operands.baked)


class _Substitution(TorchFunctionMode):
    def __init__(self, scalars: OperandScalars) -> None:
        super().__init__()
        self.scalars = scalars
        self.positions: dict[Any, list] = {}

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func in _BINARY_OPS and len(args) == 2 and not kwargs and type(args[1]) in (int, float):
            key = self._site_key()
            if key is not None:
                scalar = self.scalars.take(key, args[0], args[1])
                if scalar is not None:
                    return func(args[0], scalar)
        return func(*args, **kwargs)

    def _site_key(self) -> tuple | None:
        """(file, line, column, end line, end column) of the user's instruction that made this call."""
        frame = sys._getframe(2)
        while frame is not None and frame.f_code.co_filename.startswith(_TORCH_DIR):
            frame = frame.f_back
        if frame is None:
            return None
        code = frame.f_code
        positions = self.positions.get(code)
        if positions is None:
            positions = self.positions[code] = list(code.co_positions())
        index = frame.f_lasti // 2
        if index >= len(positions):
            return None
        line, end_line, column, end_column = positions[index]
        return (code.co_filename, line, column, end_line, end_column)
