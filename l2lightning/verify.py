"""Bitwise equivalence checks between two runs of a training step from the same state.

The prefetch kernels never write memory, and a CUDA graph replays the kernels eager mode launches,
so outputs, the loss and every gradient must be bit-identical. The chain of checks is: eager vs
eager (the baseline: is the step deterministic at all?), graph vs eager, graph+prefetch vs graph.
Reports name the first differing tensor. `assert_same_gradients` is for users' own test suites.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn


@dataclass(frozen=True)
class Mismatch:
    """The first tensor that differs between two runs."""

    name: str
    differing: int
    total: int
    max_abs_diff: float
    detail: str = ""

    def __str__(self) -> str:
        extra = f" ({self.detail})" if self.detail else ""
        return f"{self.name}: {self.differing} of {self.total} elements differ, max |diff| = {self.max_abs_diff:.3e}{extra}"


@dataclass
class VerifyReport:
    """Result of comparing two runs: `ok` when every compared tensor is bit-identical."""

    label: str
    compared: int = 0
    mismatches: list[Mismatch] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.mismatches

    @property
    def first_mismatch(self) -> Mismatch | None:
        return self.mismatches[0] if self.mismatches else None

    def __str__(self) -> str:
        if self.ok:
            return f"{self.label}: bit-identical ({self.compared} tensors)"
        return f"{self.label}: {len(self.mismatches)} of {self.compared} tensors differ; first: {self.mismatches[0]}"

    def to_dict(self) -> dict[str, Any]:
        return {
            "label": self.label,
            "ok": self.ok,
            "compared": self.compared,
            "mismatches": [m.__dict__ for m in self.mismatches],
        }


class EquivalenceError(AssertionError):
    """Two runs that must be bit-identical are not; `.report` holds the details."""

    def __init__(self, report: VerifyReport) -> None:
        super().__init__(str(report))
        self.report = report


def _bits(t: torch.Tensor) -> torch.Tensor:
    """A view of `t`'s bytes as integers, so NaN == NaN and -0.0 != +0.0, exactly like the bits."""
    t = t.detach().contiguous()
    if t.dtype == torch.bool:
        return t.to(torch.uint8)
    if not (t.is_floating_point() or t.is_complex()):
        return t
    size = t.element_size()
    view_dtype = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}.get(size)
    if t.is_complex():
        return _bits(torch.view_as_real(t))
    return t.view(view_dtype)


def compare_tensors(name: str, a: torch.Tensor | None, b: torch.Tensor | None) -> Mismatch | None:
    """None when `a` and `b` are bit-identical (or both None), else what differs."""
    if a is None or b is None:
        if a is None and b is None:
            return None
        return Mismatch(name, -1, -1, float("inf"), f"one side is None ({'a' if a is None else 'b'})")
    if a.shape != b.shape or a.dtype != b.dtype:
        return Mismatch(
            name,
            -1,
            a.numel(),
            float("inf"),
            f"shape/dtype {tuple(a.shape)} {a.dtype} vs {tuple(b.shape)} {b.dtype}",
        )
    b = b.to(a.device)
    differ = _bits(a) != _bits(b)
    count = int(differ.sum())
    if count == 0:
        return None
    diff = (a.detach().double() - b.detach().double()).abs() if a.is_floating_point() else (a != b).double()
    finite = diff[torch.isfinite(diff)]
    max_diff = float(finite.max()) if finite.numel() else float("nan")
    return Mismatch(name, count, a.numel(), max_diff)


def _named_tensors(obj: Any, prefix: str) -> Iterator[tuple[str, torch.Tensor | None]]:
    if obj is None or isinstance(obj, torch.Tensor):
        yield prefix, obj
    elif isinstance(obj, Mapping):
        for key, value in obj.items():
            yield from _named_tensors(value, f"{prefix}.{key}" if prefix else str(key))
    elif isinstance(obj, (list, tuple)):
        for i, value in enumerate(obj):
            yield from _named_tensors(value, f"{prefix}[{i}]")


def compare(a: Any, b: Any, label: str = "a vs b") -> VerifyReport:
    """Compare two nested structures of tensors (dicts, lists, tuples) bitwise."""
    report = VerifyReport(label)
    left = dict(_named_tensors(a, ""))
    right = dict(_named_tensors(b, ""))
    if left.keys() != right.keys():
        missing = sorted(set(left) ^ set(right))
        report.mismatches.append(
            Mismatch(missing[0], -1, -1, float("inf"), f"present on one side only: {missing[:5]}")
        )
    for name in [n for n in left if n in right]:
        report.compared += 1
        mismatch = compare_tensors(name, left[name], right[name])
        if mismatch:
            report.mismatches.append(mismatch)
    return report


def gradients(model: nn.Module) -> dict[str, torch.Tensor | None]:
    """Detached copies of every parameter's gradient, by parameter name."""
    return {n: (p.grad.detach().clone() if p.grad is not None else None) for n, p in model.named_parameters()}


def parameters(model: nn.Module) -> dict[str, torch.Tensor]:
    """Detached copies of every parameter, by name."""
    return {n: p.detach().clone() for n, p in model.named_parameters()}


@dataclass
class StepRecord:
    """What one training step produced: output, loss, gradients and the parameters after the step."""

    output: Any
    loss: torch.Tensor
    grads: dict[str, torch.Tensor | None]
    params: dict[str, torch.Tensor] = field(default_factory=dict)

    def as_tree(self) -> dict[str, Any]:
        return {"loss": self.loss, "output": self.output, "grad": self.grads, "param": self.params}


def compare_steps(a: StepRecord, b: StepRecord, label: str) -> VerifyReport:
    """Compare loss first, then outputs, gradients and updated parameters, in that order."""
    return compare(a.as_tree(), b.as_tree(), label)


def assert_same_gradients(
    a: nn.Module | Mapping[str, Any], b: nn.Module | Mapping[str, Any], label: str = "gradients"
) -> VerifyReport:
    """Raise :class:`EquivalenceError` unless the gradients of `a` and `b` are bit-identical.

    `a` and `b` are modules (their parameters' ``.grad`` is compared by name) or mappings of name to
    tensor (e.g. from :func:`gradients`).

    Example (a test in a user's GPU CI):
        >>> grads_plain = gradients(model)  # after loss.backward() without prefetch  # doctest: +SKIP
        >>> with PrefetchHooks(model, x):  # doctest: +SKIP
        ...     model.zero_grad(); loss_fn(model(x)).backward()
        >>> assert_same_gradients(grads_plain, model)  # doctest: +SKIP
    """
    left = gradients(a) if isinstance(a, nn.Module) else dict(a)
    right = gradients(b) if isinstance(b, nn.Module) else dict(b)
    report = compare(left, right, label)
    if not report.ok:
        raise EquivalenceError(report)
    return report


def assert_equivalent(report: VerifyReport) -> VerifyReport:
    """Raise :class:`EquivalenceError` if `report` is not ok; return it otherwise."""
    if not report.ok:
        raise EquivalenceError(report)
    return report


def _record(model: nn.Module, loss: torch.Tensor) -> StepRecord:
    return StepRecord(None, loss.detach().clone(), gradients(model), parameters(model))


def run_variant(
    variant: str,
    make_model: Any,
    step_fn_for: Any,
    batches: list[Any],
    make_optimizer: Any = None,
    make_hooks: Any = None,
) -> list[StepRecord]:
    """Train a fresh model over `batches` one way: ``"eager"``, ``"graph"`` or ``"graph+prefetch"``.

    `make_model()` must build the same initial weights every call (seed inside it); `step_fn_for(model)`
    returns ``step_fn(batch) -> loss``; `make_optimizer(model)` returns a capturable optimizer or None;
    `make_hooks(model)` installs :class:`PrefetchHooks` (for ``graph+prefetch``).
    """
    from l2lightning.graph.capture import capture_step, loss_of, run_step

    if variant not in ("eager", "graph", "graph+prefetch"):
        raise ValueError(f"`variant` must be 'eager', 'graph' or 'graph+prefetch', got {variant!r}")
    model = make_model()
    optimizer = make_optimizer(model) if make_optimizer else None
    step_fn = step_fn_for(model)
    hooks = make_hooks(model) if variant == "graph+prefetch" else None
    records = []
    try:
        if variant == "eager":
            for batch in batches:
                records.append(_record(model, loss_of(run_step(step_fn, batch, model, optimizer))))
            return records
        captured = capture_step(step_fn, batches[0], model, optimizer)
        for batch in batches:
            loss = captured(batch)
            records.append(_record(model, loss))
        return records
    finally:
        if hooks is not None:
            hooks.remove()


def equivalence_chain(
    make_model: Any,
    step_fn_for: Any,
    batches: list[Any],
    make_optimizer: Any = None,
    make_hooks: Any = None,
) -> list[VerifyReport]:
    """The three checks, in order: eager vs eager, graph vs eager, graph+prefetch vs graph (per step)."""
    runs = {
        name: run_variant(variant, make_model, step_fn_for, batches, make_optimizer, make_hooks)
        for name, variant in [("eager", "eager"), ("eager2", "eager"), ("graph", "graph")]
        + ([("graph+prefetch", "graph+prefetch")] if make_hooks else [])
    }
    pairs = [("eager2", "eager"), ("graph", "eager")] + ([("graph+prefetch", "graph")] if make_hooks else [])
    reports = []
    for left, right in pairs:
        report = VerifyReport(f"{left} vs {right}")
        for step, (a, b) in enumerate(zip(runs[left], runs[right])):
            sub = compare_steps(a, b, f"step {step}")
            report.compared += sub.compared
            report.mismatches += [
                Mismatch(f"step {step}: {m.name}", m.differing, m.total, m.max_abs_diff, m.detail)
                for m in sub.mismatches
            ]
        reports.append(report)
    return reports
