"""The sampled replay check: at chosen replays the step is also computed eagerly and compared bit for bit.

Before each replay the callback decides from what it can read on the host (the step's source, Python
state, tensor identities and addresses, the batch's structure) whether the graph still stands for
the eager step. Those checks know the idioms they were written for. This module is the net under
them that knows none: at chosen replays (:class:`CheckSchedule`: replay 1, 2, 4, 8, ... of each
capture, and the first replay after an epoch starts, a validation loop ends, a checkpoint is loaded
or a hook sets a CUDA generator's state; all but replay 1 within a share of the fit's wall time) the
callback

1. saves everything the step writes (:class:`WrittenState`: parameters, buffers, the optimizer's
   state, the bound metrics' states, the tensors the step reads from attributes, the carried state)
   and the random generators;
2. replays the graph, and keeps what the replay produced (those tensors, the loss and the tensors
   the step returns, the gradients the graph leaves);
3. puts the saved state back and runs the step eagerly, as a plain step runs it (its logs, hooks and
   Python effects are the step's own);
4. compares the two bit for bit, with one host sync (:func:`first_differing`).

The eager step is the step that stands, so a replay that differs is never kept. On a difference the
callback replays once more from the saved state: a replay that differs from itself means the step's
kernels are not deterministic (atomics in ``index_add``/``scatter_add``, some cuDNN backward
algorithms), and the eager step is judged against the two replays' spread
(:func:`beyond_replay_spread`); a difference beyond it, or a deterministic replay that differs, is a
wrong replay: the step is captured again once, and a second one means eager training for the rest
of the fit.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from l2lightning.graph.rng import GeneratorStates
from l2lightning.guards import check_kernels
from l2lightning.verify import compare_tensors

# Replays counted per capture: a check at replay 1, 2, 4, 8, ... (a power of two).
FIRST_CHECKED_REPLAY = 1


def is_checked_replay(replay: int) -> bool:
    """Whether the `replay`-th replay of a capture (1-based) is checked: 1, 2, 4, 8, 16, ..."""
    return replay >= FIRST_CHECKED_REPLAY and replay & (replay - 1) == 0


# The most of a fit's wall time the checks may take by default (L2GraphCallback(check_share=...)).
CHECK_SHARE = 0.02


class CheckSchedule:
    """Which replays the sampled check computes eagerly too (see the module docstring).

    The first replay of each capture and the first replay after an event (an epoch start, a
    validation loop, a checkpoint load, a CUDA generator's state set between steps: where what the
    step reads changes) are always checked: a replay made wrong there would stand until the next
    check. The other power-of-two replays are checked only while the checks so far and one more (as
    long as the last) take at most `share` of the fit's wall time; beyond it the check is owed, and
    made at the first replay within it, so a fast fit is checked as its time grows rather than at a
    fixed cost per replay.
    """

    def __init__(self, share: float = CHECK_SHARE) -> None:
        self.share = share
        self.replays = 0  # replays of the current capture
        self.pending: str | None = None  # an event since the last check that asks for the next replay
        self.owed: str | None = None  # a scheduled check put off by the time share
        self.deferred = 0  # scheduled checks put off (or merged into an owed one), over the fit
        self.last_cost_s = 0.0  # the last check's seconds: a check runs only if one more fits the share

    def captured(self) -> None:
        """A new capture: its replays are counted from 1, and the first is checked."""
        self.replays = 0
        self.pending = None
        self.owed = None

    def after(self, event: str) -> None:
        """The next replay is checked: `event` (an epoch start, a validation loop, a checkpoint load)
        may have changed what the step reads in ways the per-replay checks do not see."""
        if self.pending is None:
            self.pending = event

    def due(self, spent_s: float = 0.0, elapsed_s: float = float("inf")) -> str | None:
        """Count one replay; why it is checked, or None. `spent_s`: the checks' seconds so far in the
        fit; `elapsed_s`: the fit's seconds so far."""
        self.replays += 1
        reason = None
        event = self.pending is not None
        if event:
            reason, self.pending = f"the first replay after {self.pending}", None
        elif is_checked_replay(self.replays):
            reason = "a power-of-two replay of its capture"
        if self.replays == 1 or event:
            self.owed = None  # this check is the owed one's too
            return reason
        if reason is None and self.owed is None:
            return None
        if spent_s + self.last_cost_s > self.share * elapsed_s:
            if reason is not None:
                self.deferred += 1
                self.owed = self.owed or reason
            return None
        if reason is None:
            reason = f"{self.owed} (deferred to keep the checks within {self.share:.0%} of the fit's time)"
        self.owed = None
        return reason


@dataclass
class Written:
    """One tensor the step writes: a label for messages, and how to read it (the object may change)."""

    label: str
    read: Callable[[], torch.Tensor | None]


@dataclass
class SavedState:
    """Copies of the written tensors and the generators' states, to put back in place."""

    tensors: list[tuple[torch.Tensor, torch.Tensor]]
    generators: GeneratorStates

    def restore(self) -> None:
        with torch.no_grad():
            for live, saved in self.tensors:
                live.copy_(saved)
        self.generators.put_back()


class WrittenState:
    """The tensors a step writes, read through their owners (an eager step may rebind some)."""

    def __init__(self, written: Sequence[Written], cuda_devices: Sequence[int] = ()) -> None:
        self.written = list(written)
        self.cuda_devices = list(cuda_devices)

    def current(self) -> list[torch.Tensor | None]:
        return [w.read() for w in self.written]

    def save(self) -> SavedState:
        """Copies of every written tensor as it is now (raises ``torch.OutOfMemoryError`` if they do not fit)."""
        tensors = [(t, t.detach().clone()) for t in self.current() if isinstance(t, torch.Tensor)]
        return SavedState(tensors, GeneratorStates.save(self.cuda_devices))

    def snapshot(self) -> list[torch.Tensor | None]:
        """Copies of the written tensors as they are now, by position (for comparing later)."""
        return [t.detach().clone() if isinstance(t, torch.Tensor) else None for t in self.current()]


def named_written_state(
    module: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None,
    metric_states: Sequence[tuple[str, Any, str]] = (),
    attributes: Sequence[tuple[dict, str, Any]] = (),
    written_in_place: Sequence[tuple[torch.Tensor, str]] = (),
) -> list[Written]:
    """What a training step writes that outlives it, each with its label.

    `metric_states`: (metric path, metric, state name); `attributes`: (owner's ``__dict__``, name,
    tensor) for the tensors the step reads from plain attributes (it may update them in place);
    `written_in_place`: (tensor, where) for the other tensors from before the step that its ops write
    in place (seen by the step tracer at the capture: a counter in a dict, say).
    """
    written: list[Written] = []
    names = {}
    for name, p in module.named_parameters():
        names[id(p)] = name
        written.append(Written(f"parameter `{name}`", lambda p=p: p))
    for name, b in module.named_buffers():
        written.append(Written(f"buffer `{name}`", lambda b=b: b))
    if optimizer is not None:
        for p, state in optimizer.state.items():
            for key, value in state.items():
                if isinstance(value, torch.Tensor):
                    label = f"optimizer state `{key}` of `{names.get(id(p), 'a parameter')}`"
                    written.append(Written(label, lambda state=state, key=key: state.get(key)))
    for path, metric, attr in metric_states:
        written.append(Written(f"metric state `{path}.{attr}`", lambda m=metric, a=attr: getattr(m, a, None)))
    seen = {id(p) for p in module.parameters()} | {id(b) for b in module.buffers()}
    for owner, name, tensor in attributes:
        if id(tensor) in seen:
            continue
        seen.add(id(tensor))
        written.append(Written(f"tensor attribute `{name}`", lambda owner=owner, name=name: owner.get(name)))
    storages = {
        t.untyped_storage().data_ptr() for t in (w.read() for w in written) if isinstance(t, torch.Tensor)
    }
    for tensor, where in written_in_place:
        if tensor.untyped_storage().data_ptr() in storages:
            continue
        storages.add(tensor.untyped_storage().data_ptr())
        written.append(Written(f"a tensor the step writes in place ({where})", lambda t=tensor: t))
    return written


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """`t`'s bytes, flat: two tensors of one dtype and shape are bit-identical iff their bytes are.

    Every dtype compared as bytes runs one kind of kernel for all of them: on CUDA devices the check's
    own (:mod:`l2lightning.guards.check_kernels`, whose docstring says why), elsewhere torch's. Copying small
    states to the host and comparing them there instead was slower on the conv stack
    (``benchmarks/results/h200/replay_check_host_path.csv``).
    """
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def _bits_differ(a: torch.Tensor | None, b: torch.Tensor | None) -> torch.Tensor | bool:
    """A device bool: whether `a` and `b` differ in any bit (or a host bool where shapes decide)."""
    if a is None or b is None:
        return (a is None) != (b is None)
    if a.shape != b.shape or a.dtype != b.dtype:
        return True
    if a.numel() == 0:
        return False
    return (_bytes(a) != _bytes(b.to(a.device))).any()


_JOINED_BYTES = (
    64 * 2**20
)  # the most one joined comparison copies, per side: a check's extra memory stays small


def _all_same(pairs: Sequence[tuple[str, torch.Tensor | None, torch.Tensor | None]]) -> bool:
    """Whether every pair is bit-identical, decided with a few kernels and one read per device.

    The common case of a check: the bytes of each side are joined per device, up to `_JOINED_BYTES` at
    a time, and compared at once, instead of three kernels per tensor (on the MLP stack a check
    compares a few hundred tensors); a tensor larger than that is compared in slices of it. Shapes,
    dtypes and None are decided on the host first.
    """
    groups: dict[torch.device, list[tuple[torch.Tensor, torch.Tensor]]] = {}
    for _, a, b in pairs:
        if a is None or b is None:
            if (a is None) != (b is None):
                return False
            continue
        if a.shape != b.shape or a.dtype != b.dtype:
            return False
        if a.numel() == 0:
            continue
        groups.setdefault(a.device, []).append((_bytes(a), _bytes(b.to(a.device))))
    flags: dict[torch.device, list[torch.Tensor]] = {}
    for device, views in groups.items():
        for left, right in _joined_batches(views, _JOINED_BYTES):
            flags.setdefault(device, []).append((torch.cat(left) != torch.cat(right)).any())
    return not any(bool(torch.stack(f).any().cpu()) for f in flags.values())


def _joined_batches(
    views: Sequence[tuple[torch.Tensor, torch.Tensor]], per_join: int
) -> Iterator[tuple[list[torch.Tensor], list[torch.Tensor]]]:
    """The flat pairs of `views` in batches of at most `per_join` elements a side, a pair longer than
    that in slices of it."""
    left: list[torch.Tensor] = []
    right: list[torch.Tensor] = []
    joined = 0
    for a, b in views:
        for start in range(0, a.numel(), per_join):
            piece_a, piece_b = a[start : start + per_join], b[start : start + per_join]
            if left and joined + piece_a.numel() > per_join:
                yield left, right
                left, right, joined = [], [], 0
            left.append(piece_a)
            right.append(piece_b)
            joined += piece_a.numel()
    if left:
        yield left, right


def _kernel_flags(pairs: Sequence[tuple[str, torch.Tensor | None, torch.Tensor | None]]) -> list[bool] | None:
    """Per pair, whether it differs, decided by the check's own kernels (:mod:`l2lightning.guards.check_kernels`:
    one launch and one read per device) where every tensor pair is on a CUDA device they run on; None
    where one is not (host tensors, no CuPy: the torch path decides)."""
    flags: list[bool] = [False] * len(pairs)
    groups: dict[torch.device, list[tuple[int, torch.Tensor, torch.Tensor]]] = {}
    for i, (_, a, b) in enumerate(pairs):
        if a is None or b is None or a.shape != b.shape or a.dtype != b.dtype:
            flags[i] = not (a is None and b is None)
            continue
        if a.numel() == 0:
            continue
        if not check_kernels.usable(a.device):
            return None
        groups.setdefault(a.device, []).append((i, _bytes(a), _bytes(b.to(a.device))))
    for device, items in groups.items():
        differ = check_kernels.bytes_differ([(x, y) for _, x, y in items], device)
        for (i, _, _), flag in zip(items, differ):
            flags[i] = flag
    return flags


def first_differing(pairs: Sequence[tuple[str, torch.Tensor | None, torch.Tensor | None]]) -> int | None:
    """The position of the first of (label, replayed, eager) whose tensors differ in any bit; None if none.

    All equal (the common case) is decided by :func:`_all_same`; only then are the pairs compared one by
    one, with one host sync per device for their flags. Nothing is described here: a fit usually
    makes one check, and describing a difference (its count and size, :func:`describe_difference`)
    runs kernels that check uses nowhere else, whose first use in a process is most of their cost
    (``benchmarks/results/h200/check_first_use.json``); it is paid only for a message that needs it.
    """
    on_kernels = _kernel_flags(pairs)
    if on_kernels is not None:
        return next((i for i, differs in enumerate(on_kernels) if differs), None)
    if _all_same(pairs):
        return None
    flags = [_bits_differ(a, b) for _, a, b in pairs]
    # the flags of host tensors (a CPU tensor the step reads) and of device ones, read per device
    by_device: dict[torch.device, list[int]] = {}
    for i, f in enumerate(flags):
        if isinstance(f, torch.Tensor):
            by_device.setdefault(f.device, []).append(i)
    host: list[bool] = [f if isinstance(f, bool) else False for f in flags]
    for positions in by_device.values():
        for i, value in zip(positions, torch.stack([flags[i] for i in positions]).cpu().tolist()):
            host[i] = bool(value)
    return next((i for i, differs in enumerate(host) if differs), None)


def describe_difference(pair: tuple[str, torch.Tensor | None, torch.Tensor | None]) -> str:
    """(label, replayed, eager) that differ, described: how many elements and by how much."""
    label, a, b = pair
    if a is None or b is None:
        return f"{label} ({'the replay' if a is None else 'the eager step'} left none)"
    mismatch = compare_tensors(label, a, b)
    return str(mismatch) if mismatch is not None else label


def first_difference(pairs: Sequence[tuple[str, torch.Tensor | None, torch.Tensor | None]]) -> str | None:
    """The first of (label, replayed, eager) whose tensors differ in any bit, described; None if none."""
    i = first_differing(pairs)
    return None if i is None else describe_difference(pairs[i])


# Kernels that are not deterministic (atomics in scatter_add/index_add, some cuDNN backward algorithms)
# make two replays from one state differ in their last bits. An eager step from that state is one more
# sample of the same rounding: it may sit further from a replay than the second replay does, but not
# by much. A replay that read something that changed (memory freed and reused, a value the checks
# before each replay do not see) sits far off, or its two replays differ by more than rounding can.
# How much further than the second replay the eager step may sit from the first, relative to the
# values. 16 for what the step computes from its kernels (a gradient), twice that for what squares it:
# Adam's second moment doubles a gradient's relative difference. On the H200 the conv stack's eager
# step sat 21x the replays' relative spread from its replay in `exp_avg_sq` of its first conv, a
# rounding difference that 16 took for a wrong replay (``replay_check_host_path.csv``). A wrong
# replay (a stale value, memory reused) differs by what the stale value changes, not by rounding.
SPREAD_FACTOR = 32.0
ROUNDING_SPREAD = 1e-2  # the largest difference of two replays, relative to the values, put down to rounding
ROUNDING_ULPS = 8.0  # the least allowance: units in the last place of the tensor's dtype, at its scale


def beyond_replay_spread(
    triples: Sequence[tuple[str, torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]],
) -> str | None:
    """The first of (label, replay, the replay again from the same state, eager step) that rounding
    cannot explain, described; None if every difference is within it.

    Kernels that are not deterministic round differently from run to run, and not in every tensor at
    every run: a tensor equal in the two replays may still differ in the eager step. So a tensor's
    allowance is `SPREAD_FACTOR` times the larger of its own two replays' difference and the largest
    difference of the two replays relative to the values over all tensors (times its values' scale),
    and at least `ROUNDING_ULPS` units in the last place of its dtype at that scale. Beyond that, or
    two replays further apart than `ROUNDING_SPREAD` of the values, is no rounding; integer and bool
    tensors must be equal in all three.
    """
    measured: list[tuple[str, torch.Tensor, torch.Tensor, torch.Tensor, float]] = []
    for label, replay, again, eager in triples:
        if replay is None or again is None or eager is None:
            if (replay is None) != (eager is None):
                return f"{label} ({'the replay' if replay is None else 'the eager step'} left none)"
            continue
        if replay.shape != eager.shape or replay.dtype != eager.dtype or replay.shape != again.shape:
            return f"{label} (shape or dtype)"
        if replay.numel() == 0:
            continue
        eager, again = eager.to(replay.device), again.to(replay.device)
        if not (replay.is_floating_point() or replay.is_complex()):
            # integers and bools have no rounding: any difference, between the replays or from the
            # eager step, is beyond it
            measured.append((label, replay.detach(), again.detach(), eager.detach(), -1.0))
            continue
        if replay.is_complex():
            replay, again, eager = (
                torch.view_as_real(t.detach().resolve_conj()) for t in (replay, again, eager)
            )
        eps = float(torch.finfo(replay.dtype).eps)
        measured.append((label, replay.detach(), again.detach(), eager.detach(), eps))
    if not measured:
        return None
    host = _measured_differences(measured)  # (gap, spread, scale) per row, on the host
    relative_spread = max((host[i][1] / host[i][2] for i, m in enumerate(measured) if m[4] > 0), default=0.0)
    for i, (label, _, _, _, eps) in enumerate(measured):
        gap, spread, scale = host[i]
        if eps < 0:  # an integer or bool tensor
            if gap:
                return f"{label} (integers: the eager step or the second replay differs)"
            continue
        if spread > ROUNDING_SPREAD * scale:
            return f"{label} (two replays from the same state differ by {spread:.3e}, {spread / scale:.1e} of its values)"
        allowed = max(SPREAD_FACTOR * max(spread, relative_spread * scale), ROUNDING_ULPS * eps * scale)
        if gap > allowed:
            return (
                f"{label} (the eager step differs from the replay by {gap:.3e}, {gap / scale:.1e} of its values; "
                f"two replays from each other by {spread:.3e}, by up to {relative_spread:.1e} of the values "
                "over all tensors)"
            )
    return None


def _measured_differences(
    rows: list[tuple[str, torch.Tensor, torch.Tensor, torch.Tensor, float]],
) -> list[list[float]]:
    """Rows (label, replay, again, eager, eps) -> [max |replay - eager|, max |replay - again|, the
    replay's largest finite magnitude] per row, read to the host; an integer or bool row (eps < 0)
    comes back as [1 if the eager step or the second replay differs from the replay else 0, 0, 1].

    On CUDA devices the check's own kernels measure every row in one launch
    (:func:`_kernel_measures`). Elsewhere (and without CuPy), per (device, dtype), three multi-tensor subtractions and norms in the tensors' own dtype and one
    read: a check of kernels that are not deterministic judges every tensor of the step. On the H200
    the conv stack's judgment took 23 ms of its 44 ms check with a double-precision pass per tensor
    (a dozen kernels each, ``benchmarks/results/h200/replay_check_ab_before.csv``), 15 and 29 ms with
    this in two later runs (``replay_check.csv`` and the run it replaced). The difference of two nearby floats is exact (Sterbenz) and of far ones
    within one rounding, either way well inside `SPREAD_FACTOR`; where a norm comes out NaN or
    infinite (a NaN or infinity in the values, an overflowing difference) that tensor is measured
    again exactly, in double precision.
    """
    on_kernels = _kernel_measures(rows)
    if on_kernels is not None:
        return on_kernels
    out: list[list[float]] = [[0.0, 0.0, 1.0] for _ in rows]
    groups: dict[tuple, list[int]] = {}
    for i, (_, replay, _, _, eps) in enumerate(rows):
        groups.setdefault((replay.device, replay.dtype if eps > 0 else None), []).append(i)
    tiny = torch.finfo(torch.float64).tiny
    inf = float("inf")
    for (_, dtype), positions in groups.items():
        if dtype is None:  # integer rows: whether the eager step or the second replay differs, read at once
            flags = [
                ((_bytes(r) != _bytes(e)) | (_bytes(r) != _bytes(a))).any()
                for r, a, e in (rows[i][1:4] for i in positions)
            ]
            for i, flag in zip(positions, torch.stack(flags).tolist()):
                out[i] = [float(flag), 0.0, 1.0]
            continue
        replays = [rows[i][1] for i in positions]
        gaps = torch._foreach_norm(torch._foreach_sub(replays, [rows[i][3] for i in positions]), inf)
        spreads = torch._foreach_norm(torch._foreach_sub(replays, [rows[i][2] for i in positions]), inf)
        scales = torch._foreach_norm(replays, inf)
        norms = torch.stack([torch.stack(gaps), torch.stack(spreads), torch.stack(scales)], dim=1)
        for i, (gap, spread, scale) in zip(positions, norms.tolist()):  # exact: floats of the dtype's values
            if all(map(math.isfinite, (gap, spread, scale))):
                out[i] = [gap, spread, max(scale, tiny)]
                continue
            _, replay, again, eager, _ = rows[i]
            r, a, e = replay.double(), again.double(), eager.double()
            scale_t = torch.nan_to_num(r.abs(), nan=0.0, posinf=0.0).max().clamp_min(tiny)
            exact = torch.stack([_largest_difference(r, e), _largest_difference(r, a), scale_t])
            out[i] = exact.tolist()
    return out


def _kernel_measures(
    rows: list[tuple[str, torch.Tensor, torch.Tensor, torch.Tensor, float]],
) -> list[list[float]] | None:
    """:func:`_measured_differences` by the check's own kernels, exact in double precision (one launch
    and one read per device), where every row is on a CUDA device they run on and of a dtype they
    read; None otherwise."""
    groups: dict[torch.device, list[int]] = {}
    for i, (_, replay, _, _, _) in enumerate(rows):
        if not (check_kernels.usable(replay.device) and check_kernels.measurable(replay.dtype)):
            return None
        groups.setdefault(replay.device, []).append(i)
    tiny = torch.finfo(torch.float64).tiny
    out: list[list[float]] = [[0.0, 0.0, 1.0] for _ in rows]
    for device, positions in groups.items():
        triples = [(rows[i][1], rows[i][2], rows[i][3]) for i in positions]
        for i, (gap, spread, scale) in zip(positions, check_kernels.spread_measures(triples, device)):
            out[i] = [gap, spread, max(scale, tiny)]
    return out


def _largest_difference(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """max |a - b| as a device scalar: NaN where both are NaN counts as equal, where one is as infinite;
    equal infinities are equal (their difference is NaN)."""
    same = (a.isnan() & b.isnan()) | (a == b)
    diff = torch.where(same, torch.zeros((), dtype=a.dtype, device=a.device), (a - b).abs())
    return torch.nan_to_num(diff, nan=float("inf")).max()


def step_tensors(output: Any, prefix: str = "") -> Iterator[tuple[str, torch.Tensor]]:
    """(label, tensor) for the loss and every tensor a training step returned."""
    if isinstance(output, torch.Tensor):
        yield (prefix or "the loss"), output
    elif isinstance(output, dict):
        for key, value in output.items():
            label = (
                "the loss"
                if key == "loss" and not prefix
                else f"{prefix}[{key!r}]"
                if prefix
                else f"output {key!r}"
            )
            yield from step_tensors(value, label)
    elif isinstance(output, (list, tuple)):
        for i, value in enumerate(output):
            yield from step_tensors(value, f"{prefix or 'output'}[{i}]")


class PhaseClock:
    """Wall seconds of a checked step's phases (the copies, the replay, the eager step, the comparison,
    the second replay's judgment), for ``summary()["replay_check"]["phases_s"]``.

    On CUDA the clock starts once the GPU has finished the work queued before the check, and each lap
    waits for the GPU first, so that a phase's seconds are its own work and not the work queued
    before it; a checked step syncs once for its comparison anyway, and these few syncs are made at
    checked steps only.
    """

    def __init__(self, cuda: bool) -> None:
        self.cuda = cuda
        self.laps: dict[str, float] = {}
        if cuda:
            # the steps queued before the check are theirs, not the check's: a GPU-bound fit's host
            # runs ahead of it by several replays, which the check's first copies would wait for
            torch.cuda.synchronize()
        self.started = self._last = time.perf_counter()

    def lap(self, phase: str) -> None:
        if self.cuda:
            torch.cuda.synchronize()
        now = time.perf_counter()
        self.laps[phase] = self.laps.get(phase, 0.0) + now - self._last
        self._last = now


@dataclass
class ReplayCheckReport:
    """What the sampled replay check did in a fit (``summary()["replay_check"]``)."""

    mode: str = "sampled"
    checks: int = 0
    mismatches: int = 0
    # checks not made: the copies did not fit in memory
    skipped_memory: int = 0
    # scheduled checks put off because the checks had taken their share of the fit's time
    deferred: int = 0
    seconds: float = 0.0  # wall time of the checked steps (their eager step, copies and comparison)
    off_reason: str | None = None  # why the check stopped for the rest of the fit
    # checks whose eager step and replay differed only as two replays of the step differ (kernels that
    # are not deterministic): judged against that spread instead of bit for bit
    within_spread: int = 0
    first_mismatch: str | None = None
    reasons: dict[str, int] = field(default_factory=dict)  # what called for the checks, counted
    # the checked steps' seconds by phase (PhaseClock), summed over the fit
    phases_s: dict[str, float] = field(default_factory=dict)

    def add_phases(self, laps: dict[str, float]) -> None:
        for phase, seconds in laps.items():
            self.phases_s[phase] = self.phases_s.get(phase, 0.0) + seconds

    def to_dict(self) -> dict[str, Any]:
        return {
            "mode": self.mode,
            "checks": self.checks,
            "mismatches": self.mismatches,
            "skipped_memory": self.skipped_memory,
            "deferred": self.deferred,
            "seconds": round(self.seconds, 6),
            "off_reason": self.off_reason,
            "within_spread": self.within_spread,
            "first_mismatch": self.first_mismatch,
            "reasons": dict(self.reasons),
            "phases_s": {phase: round(seconds, 6) for phase, seconds in self.phases_s.items()},
        }
