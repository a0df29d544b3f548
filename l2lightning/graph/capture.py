"""Whole-step CUDA-graph capture: zero-grad, forward, loss, backward and optionally the optimizer step.

Follows PyTorch's rules for capturing backward: warm up on a side stream, set grads to None before
capture so `.grad` lives in the graph's memory pool, copy every batch into static input buffers.
Warm-up steps change the model; their effects (parameters, buffers such as BatchNorm statistics,
optimizer state, RNG) are undone before capture, so the first replay starts from exactly the state
an eager run would start from.
"""

from __future__ import annotations

import collections
import contextlib
import copy
import dataclasses
import gc
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from itertools import repeat
from typing import Any

import torch
from torch import nn

from l2lightning.graph.rng import GeneratorStates
from l2lightning.guards.batch_reads import BatchReads


class BatchMismatchError(ValueError):
    """A batch does not match the static buffers the graph was captured with."""


# ---------------------------------------------------------------------- batches
# A batch is any nesting of tensors in dicts (any Mapping), lists, tuples, namedtuples and
# dataclasses, with other leaves (ints, strings, None, ...) treated as values that must not change.
_PRIMITIVES = (int, float, complex, str, bytes, bool, type(None), torch.dtype, torch.device)


def flatten_batch(batch: Any) -> tuple[list[torch.Tensor], Any]:
    """Tensors of a nested batch, and a spec that rebuilds it around other tensors.

    Handles dicts (any ``Mapping``), lists, tuples, namedtuples and dataclasses, like Lightning's
    ``apply_to_collection``; any other leaf is kept as a value in the spec.
    """
    tensors: list[torch.Tensor] = []
    return tensors, _walk(batch, tensors)


def _walk(obj: Any, tensors: list[torch.Tensor]) -> Any:
    # A module-level function, not a closure: a recursive closure is a reference cycle, which would
    # keep every batch tensor it saw alive until the garbage collector runs.
    if isinstance(obj, torch.Tensor):
        tensors.append(obj)
        return ("T", len(tensors) - 1)
    if isinstance(obj, Mapping):
        # a defaultdict is rebuilt with its factory (as Lightning's apply_to_collection does)
        factory = obj.default_factory if isinstance(obj, collections.defaultdict) else None
        return ("M", type(obj), tuple((k, _walk(v, tensors)) for k, v in obj.items()), factory)
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):  # namedtuple
        return ("N", type(obj), tuple(_walk(v, tensors) for v in obj))
    if isinstance(obj, (list, tuple)):
        return ("S", type(obj), tuple(_walk(v, tensors) for v in obj))
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        names = tuple(f.name for f in dataclasses.fields(obj))
        return ("D", obj, names, tuple(_walk(getattr(obj, n), tensors) for n in names))
    return ("C", obj)


def unflatten_batch(spec: Any, tensors: Sequence[torch.Tensor]) -> Any:
    """The batch `spec` describes, with `tensors` in place of the original ones."""
    kind = spec[0]
    if kind == "T":
        return tensors[spec[1]]
    if kind == "M":
        # built from a dict, as Lightning's apply_to_collection builds a mapping: every Mapping type
        # takes one (a generator of pairs is refused by a mappingproxy, a defaultdict needs its factory)
        items = {k: unflatten_batch(v, tensors) for k, v in spec[2]}
        if issubclass(spec[1], collections.defaultdict):
            return spec[1](spec[3], items)
        return spec[1](items)
    if kind == "N":
        return spec[1](*(unflatten_batch(v, tensors) for v in spec[2]))
    if kind == "S":
        return spec[1](unflatten_batch(v, tensors) for v in spec[2])
    if kind == "D":
        rebuilt = copy.copy(spec[1])  # keeps fields that are not in __init__; frozen ones too
        for name, child in zip(spec[2], spec[3]):
            object.__setattr__(rebuilt, name, unflatten_batch(child, tensors))
        return rebuilt
    return spec[1]


def _structure(spec: Any) -> Any:
    """What must stay equal between batches, apart from tensor metadata: containers and values.

    Values that are not plain Python/torch scalars are compared by identity (a new object each
    step means a new batch structure: the step then runs eagerly, never on a stale value).
    """
    kind = spec[0]
    if kind == "T":
        return "T"
    if kind == "M":
        return ("M", spec[1], tuple((k, _structure(v)) for k, v in spec[2]))
    if kind in ("N", "S"):
        return (kind, spec[1], tuple(_structure(v) for v in spec[2]))
    if kind == "D":
        return ("D", type(spec[1]), spec[2], tuple(_structure(v) for v in spec[3]))
    value = spec[1]
    return ("C", value) if isinstance(value, _PRIMITIVES) else ("C", type(value), id(value))


def batch_signature(batch: Any) -> tuple:
    """What must match for a batch to be copied into the static buffers: structure, values, shapes, dtypes, devices.

    Built from metadata only: no tensor is read, so this never waits for the device.
    """
    return signature_of(*flatten_batch(batch))


# what an unread part's non-tensor values become in a batch's signature (compared by identity)
_UNREAD = object()


def without_unread_values(spec: Any, parts: frozenset) -> Any:
    """`spec` with the non-tensor values inside the top-level `parts` (indices, or a mapping's keys)
    replaced by one marker: values the step never reads (a batch's file names) then no longer make
    two batches differ. Tensors stay as they are (still compared by shape and copied)."""
    if not parts:
        return spec
    kind = spec[0]
    if kind == "M":
        return (kind, spec[1], tuple((k, _masked(v) if k in parts else v) for k, v in spec[2]), spec[3])
    if kind in ("N", "S"):
        return (kind, spec[1], tuple(_masked(v) if i in parts else v for i, v in enumerate(spec[2])))
    if kind == "D":
        return (kind, spec[1], spec[2], tuple(_masked(v) if i in parts else v for i, v in enumerate(spec[3])))
    return spec


def _masked(spec: Any) -> Any:
    kind = spec[0]
    if kind == "T":
        return spec
    if kind == "C":
        return ("C", _UNREAD)
    if kind == "M":
        return (kind, spec[1], tuple((k, _masked(v)) for k, v in spec[2]), spec[3])
    if kind in ("N", "S"):
        return (kind, spec[1], tuple(_masked(v) for v in spec[2]))
    return (kind, spec[1], spec[2], tuple(_masked(v) for v in spec[3]))


def signature_of(tensors: list[torch.Tensor], spec: Any) -> tuple:
    """:func:`batch_signature` of a batch already flattened by :func:`flatten_batch`."""
    return (_structure(spec), _metadata(tensors))


def read_signature(batch: Any, tensors: list[torch.Tensor], spec: Any, reads: BatchReads) -> tuple:
    """The signature of `batch` (flattened into `tensors` and `spec`) without the values of the parts
    the step never reads (`reads`): what the step's graph depends on."""
    return signature_of(tensors, without_unread_values(spec, reads.unread_parts(batch)))


def read_batch(batch: Any, reads: BatchReads) -> tuple[list[torch.Tensor], tuple]:
    """(the tensors of `batch`, :func:`read_signature` of it): what the callback reads of each batch
    before a replay.

    A batch that is a plain tuple, list or dict of tensors alone (what most loaders yield) has no
    value for `reads` to mask and a structure known from its type and length (or keys): its
    signature is built directly, without the nested spec, a few microseconds per step less on the
    host. It equals :func:`read_signature`'s (``tests/graph/test_batch_signature_cpu.py``).
    """
    kind = type(batch)
    if kind is tuple or kind is list:
        if all(map(_is_tensor, batch)):
            tensors = list(batch)
            return tensors, (("S", kind, ("T",) * len(tensors)), _metadata(tensors))
    elif kind is dict and all(map(_is_tensor, batch.values())):
        tensors = list(batch.values())
        return tensors, (("M", dict, tuple(zip(batch, repeat("T")))), _metadata(tensors))
    tensors, spec = flatten_batch(batch)
    return tensors, read_signature(batch, tensors, spec, reads)


def _is_tensor(obj: Any) -> bool:
    return isinstance(obj, torch.Tensor)


def _metadata(tensors: list[torch.Tensor]) -> tuple:
    """Each tensor's (shape, dtype, device): the part of a batch's signature a copy depends on."""
    return tuple((tuple(t.shape), t.dtype, t.device) for t in tensors)


def describe_mismatch(expected: tuple, got: tuple) -> str:
    """One line saying how a batch differs from the captured one."""
    if expected[0] != got[0]:
        return "the batch's structure (or a non-tensor value in it) differs from the captured batch"
    for i, (a, b) in enumerate(zip(expected[1], got[1])):
        if a != b:
            return f"batch tensor {i} is {tuple(b[0])} {b[1]} on {b[2]}, the graph was captured with {tuple(a[0])} {a[1]} on {a[2]}"
    return "the batch differs from the captured batch"


class StaticBatch:
    """Static input buffers: the graph reads them, each new batch is copied into them."""

    def __init__(self, batch: Any, reads: BatchReads | None = None) -> None:
        """`reads`: what the step reads of its batch; the values of parts it never reads may differ
        from batch to batch (the signature leaves them out)."""
        self.reads = reads if reads is not None else BatchReads()
        tensors, self.spec = flatten_batch(batch)
        self.signature = read_signature(batch, tensors, self.spec, self.reads)
        self.tensors = [t.detach().clone() for t in tensors]
        self.batch = unflatten_batch(self.spec, self.tensors)
        # one foreach copy for the whole batch only where its tensors share a device (a batch that
        # keeps, say, an LSTM's lengths on the CPU beside CUDA tensors is copied one tensor at a time)
        self._one_foreach = len(self.tensors) > 1 and len({t.device for t in self.tensors}) == 1

    def mismatch(self, batch: Any) -> str | None:
        """None if `batch` fits the buffers, else why not."""
        tensors, spec = flatten_batch(batch)
        signature = read_signature(batch, tensors, spec, self.reads)
        if signature == self.signature:
            return None
        return describe_mismatch(self.signature, signature)

    def copy_in(self, batch: Any, checked: bool = False) -> None:
        """Copy `batch`'s tensors into the buffers (asynchronously where the source allows).

        `checked=True`: the caller already compared the batch's signature with these buffers'.

        Raises:
            BatchMismatchError: `batch` has another structure, value, shape, dtype or device.
        """
        tensors, spec = flatten_batch(batch)
        if not checked:
            signature = read_signature(batch, tensors, spec, self.reads)
            if signature != self.signature:
                raise BatchMismatchError(describe_mismatch(self.signature, signature))
        self.copy_tensors(tensors)

    def copy_tensors(self, tensors: Sequence[torch.Tensor]) -> None:
        """Copy a flattened batch whose signature matches these buffers' (the caller compared them).

        Several tensors on one device are copied by one ``torch._foreach_copy_``: one call from Python,
        and on a GPU one kernel for the tensors of one dtype, where a ``copy_`` each is a launch each
        (host time a replayed step spends before its replay). A copy either way: the same bits.
        """
        if self._one_foreach:
            torch._foreach_copy_(self.tensors, list(tensors), non_blocking=True)
            return
        for dst, src in zip(self.tensors, tensors):
            dst.copy_(src, non_blocking=True)


# ---------------------------------------------------------------------- state snapshots
# An optimizer state tensor TrainingState.save(host_only=True) did not copy (distinct from a
# tensor the optimizer created after the save, which restore zeroes).
_LEFT_IN_PLACE = object()


@dataclass
class TrainingState:
    """Parameters, buffers, optimizer state and RNG, saved so warm-up can be undone in place.

    Restoring copies into the existing tensors (a graph records addresses, so the tensors must stay
    the same objects). Optimizer state created by warm-up (Adam moments, step counters, SGD momentum)
    is zeroed, which equals a fresh optimizer for Adam/AdamW and for SGD with dampening 0.
    """

    params: list[tuple[torch.Tensor, torch.Tensor]]
    buffers: list[tuple[torch.Tensor, torch.Tensor]]
    optimizer_state: dict[int, dict[str, Any]]
    generators: GeneratorStates

    @classmethod
    def save(
        cls,
        model: nn.Module,
        optimizer: torch.optim.Optimizer | None,
        extra: Sequence[torch.Tensor] = (),
        *,
        host_only: bool = False,
        offload: bool = False,
    ) -> TrainingState:
        """Snapshot `model`'s parameters and buffers, `optimizer`'s state, the RNGs and `extra` tensors.

        `extra` holds other tensors a step mutates in place (for example torchmetrics states, which
        are not registered buffers); they are restored like buffers.

        `host_only`: copy only the tensors in host memory and leave the others as they are at
        :meth:`restore`. For a stretch of work that runs no GPU kernel, a CUDA graph capture (it
        records kernels without running them): only host tensors (a CPU buffer, a CPU step counter)
        and the RNGs can change in it, and copies of every parameter and optimizer moment would add
        three times the parameter bytes to the fit's peak for nothing.

        `offload`: copy device tensors into host memory. For eager work that must be undone but
        whose copies must not add to the GPU's peak (the prefetch set-up's dry run of
        ``training_step``): the copies cost a transfer each way, once per fit, instead of the
        parameter and optimizer-state bytes again on the GPU.
        """

        def keep(t: torch.Tensor) -> bool:
            return not host_only or t.device.type == "cpu"

        def copy_of(t: torch.Tensor) -> torch.Tensor:
            t = t.detach()
            return t.to("cpu", copy=True) if offload and t.device.type != "cpu" else t.clone()

        params = [(p, copy_of(p)) for p in model.parameters() if keep(p)]
        buffers = [(b, copy_of(b)) for b in [*model.buffers(), *extra] if keep(b)]
        opt_state: dict[int, dict[str, Any]] = {}
        if optimizer is not None:
            for p, state in optimizer.state.items():
                opt_state[id(p)] = {
                    k: ((copy_of(v) if keep(v) else _LEFT_IN_PLACE) if isinstance(v, torch.Tensor) else v)
                    for k, v in state.items()
                }
        devices = sorted({p.device.index or 0 for p in model.parameters() if p.is_cuda})
        return cls(params, buffers, opt_state, GeneratorStates.save(devices))

    def restore(self, optimizer: torch.optim.Optimizer | None) -> None:
        with torch.no_grad():
            for live, saved in self.params + self.buffers:
                live.copy_(saved)
            if optimizer is not None:
                for p, state in optimizer.state.items():
                    saved_state = self.optimizer_state.get(id(p), {})
                    for key, value in state.items():
                        if not isinstance(value, torch.Tensor):
                            if key in saved_state:
                                state[key] = saved_state[key]
                            continue
                        if saved_state.get(key) is _LEFT_IN_PLACE:
                            continue  # saved with host_only: a device tensor nothing could change
                        if key in saved_state and isinstance(saved_state[key], torch.Tensor):
                            value.copy_(saved_state[key])
                        else:
                            if key == "momentum_buffer" and _dampening(optimizer, p) != 0:
                                raise ValueError(
                                    "cannot undo SGD warm-up bit-exactly with `dampening` != 0; capture with "
                                    "restore_state=False or use dampening=0"
                                )
                            value.zero_()
        self.generators.put_back()

    def restore_rng(self) -> None:
        """Put the CPU and CUDA generators back where they were, after a capture that failed.

        A capture that fails (a host sync, an op that cannot be captured) ends without the CUDA
        generator's capture epilogue, and from then on every CUDA random op in the process raises
        ``Offset increment outside graph capture encountered unexpectedly``. See
        :func:`l2lightning.graph.rng.reset_cuda_generators`.
        """
        self.generators.reset()


def _dampening(optimizer: torch.optim.Optimizer, param: torch.Tensor) -> float:
    for group in optimizer.param_groups:
        if any(p is param for p in group["params"]):
            return float(group.get("dampening", 0.0))
    return 0.0


# ---------------------------------------------------------------------- capturing safely
def clear_cublas_workspaces() -> None:
    """Drop PyTorch's cached cuBLAS/cuBLASLt workspaces: the next GEMM on a stream allocates anew.

    Uses ``torch._C._cuda_clearCublasWorkspaces`` (what Lightning's CUDA teardown and inductor's
    cudagraph trees call); without it this is a no-op.
    """
    import torch

    clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
    if clear is None or not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return
    torch.cuda.synchronize()
    clear()


@contextlib.contextmanager
def graph_capture(graph: torch.cuda.CUDAGraph, pool: Any = None, stream: Any = None) -> Iterator[None]:
    """``torch.cuda.graph(graph, pool, stream)`` whose GEMMs get a cuBLAS workspace of their own.

    PyTorch caches one cuBLAS workspace per (handle, stream), and every capture runs on the same
    side stream, so without this a graph can bake in a workspace owned by an earlier, maybe
    destroyed, graph or by the general pool; Lightning's teardown, inductor's cudagraph trees or a
    graph's destructor then free it, and the next ``empty_cache`` unmaps it under the live graph
    (an illegal address on replay, seen in the benchmark harness). Cleared before the capture, the
    first GEMM allocates its workspace inside the graph's private pool, which lives as long as the
    graph; cleared after, no later capture reuses it.
    """
    clear_cublas_workspaces()
    # No garbage collection here (torch.cuda.graph dropped it too: it costs tens of ms in a large
    # process, and the tuner captures a graph per candidate plan). A caller whose capture a dead
    # autograd graph in a reference cycle could break (its AccumulateGrad nodes bound to another
    # stream) collects first, as L2GraphCallback does.
    # The collector must not run *during* the capture: freeing a CUDA event left in a reference
    # cycle (an earlier fit's) is a CUDA call the capture forbids, and it aborts a capture that has
    # nothing wrong with it.
    collecting = gc.isenabled()
    gc.disable()
    # A tensor the user keeps from an earlier step (`self.last_loss = loss`) keeps that step's
    # AccumulateGrad nodes alive on the default stream; where PyTorch offers it, autograd then uses
    # the capturing stream for them instead of failing the capture.
    override = getattr(torch._C, "_set_override_stale_capture_stream", None)
    overriding = getattr(torch._C, "_override_stale_capture_stream", None)
    before = overriding() if override is not None and overriding is not None else None
    if before is not None:
        override(True)
    try:
        # thread_local: only this thread's unsafe CUDA calls end the capture. In the default "global"
        # mode any thread's does (the autograd engine's device thread freeing an unrelated graph, a
        # pin-memory thread), which aborted captures now and then on the H200 with "operation
        # failed due to a previous error during capture".
        with torch.cuda.graph(graph, pool=pool, stream=stream, capture_error_mode="thread_local"):
            yield
    finally:
        if before is not None:
            override(before)
        if collecting:
            gc.enable()
        clear_cublas_workspaces()


# ---------------------------------------------------------------------- the captured step
StepFn = Callable[[Any], Any]


def loss_of(output: Any, source: str = "`step_fn`") -> torch.Tensor:
    """The loss of a step's output: the tensor itself, or a dict's ``"loss"`` tensor.

    Raises:
        TypeError: naming `source` (what produced the output) when there is no loss tensor.
    """
    if isinstance(output, torch.Tensor):
        return output
    if isinstance(output, Mapping) and isinstance(output.get("loss"), torch.Tensor):
        return output["loss"]
    raise TypeError(
        f"{source} returned {type(output).__name__}; it must return the loss tensor or a dict with a 'loss' tensor"
    )


class CapturedStep:
    """A training step captured in one CUDA graph. Build it with :func:`capture_step`.

    Attributes:
        graph: the ``torch.cuda.CUDAGraph``.
        static_batch: the input buffers (a :class:`StaticBatch`).
        output: what ``step_fn`` returned at capture; its tensors hold each replay's values.
        loss: the static loss tensor.
    """

    def __init__(
        self,
        graph: torch.cuda.CUDAGraph,
        static_batch: StaticBatch,
        output: Any,
        model: nn.Module | None = None,
        optimizer: torch.optim.Optimizer | None = None,
    ) -> None:
        self.graph = graph
        # The graph reads and writes the parameters, gradients and optimizer state in place: hold
        # them for as long as the graph lives, or a replay writes into freed memory.
        self.model = model
        self.optimizer = optimizer
        self.static_batch = static_batch
        self.output = output
        self.loss = loss_of(output)

    def __call__(self, batch: Any) -> torch.Tensor:
        """Copy `batch` into the static buffers, replay, return the (static) loss tensor.

        Raises:
            BatchMismatchError: `batch` has another structure, shape, dtype or device.
        """
        self.static_batch.copy_in(batch)
        self.graph.replay()
        return self.loss


def run_step(
    step_fn: StepFn,
    batch: Any,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None,
) -> Any:
    """One eager step with the same sequence the graph captures: zero-grad, forward+loss, backward, step."""
    if optimizer is not None:
        optimizer.zero_grad(set_to_none=True)
    else:
        model.zero_grad(set_to_none=True)
    output = step_fn(batch)
    loss_of(output).backward()
    if optimizer is not None:
        optimizer.step()
    return output


def capture_step(
    step_fn: StepFn,
    example_batch: Any,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    warmup_steps: int = 3,
    restore_state: bool = True,
    pool: Any = None,
) -> CapturedStep:
    """Capture zero-grad + ``step_fn(batch)`` (forward and loss) + backward (+ optimizer step) in one graph.

    Args:
        step_fn: ``step_fn(batch) -> loss`` (or a dict with ``"loss"``): forward and loss only.
        example_batch: a batch on the GPU; its structure, shapes and dtypes fix the static buffers.
        model: the module whose parameters get gradients.
        optimizer: stepped inside the graph when given. It must be capturable: see
            :func:`l2lightning.graph.optim.make_capturable`.
        warmup_steps: eager steps on a side stream before capture (PyTorch's rule for backward).
        restore_state: undo the warm-up's effects (parameters, buffers, optimizer state, RNG).
        pool: a graph memory pool to share (``torch.cuda.graph_pool_handle()``).

    Returns:
        A :class:`CapturedStep`; call it with each new batch. No step has been applied yet.

    Example:
        >>> opt = torch.optim.AdamW(model.parameters(), capturable=True)  # doctest: +SKIP
        >>> step = capture_step(lambda b: F.mse_loss(model(b[0]), b[1]), batch, model, opt)  # doctest: +SKIP
        >>> loss = step(next_batch)  # doctest: +SKIP
    """
    from l2lightning._env import cuda_unavailable_reason

    reason = cuda_unavailable_reason()
    if reason:
        raise RuntimeError(f"capture_step needs a CUDA GPU: {reason}")
    if not isinstance(warmup_steps, int) or warmup_steps < 1:
        raise ValueError(f"`warmup_steps` must be an int >= 1, got {warmup_steps!r}")
    if optimizer is not None:
        from l2lightning.graph.optim import capture_support

        problem = capture_support(optimizer)
        if problem:
            raise TypeError(problem)
    static_batch = StaticBatch(example_batch)
    saved = TrainingState.save(model, optimizer) if restore_state else None

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmup_steps):
            run_step(step_fn, static_batch.batch, model, optimizer)
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    if saved is not None:
        saved.restore(optimizer)

    # Grads must be allocated inside the capture so they live in the graph's pool.
    if optimizer is not None:
        optimizer.zero_grad(set_to_none=True)
    model.zero_grad(set_to_none=True)
    graph = torch.cuda.CUDAGraph()
    with graph_capture(graph, pool=pool):
        output = step_fn(static_batch.batch)
        loss_of(output).backward()
        if optimizer is not None:
            optimizer.step()
    return CapturedStep(graph, static_batch, output, model, optimizer)
