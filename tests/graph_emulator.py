"""A CPU stand-in for CUDA-graph capture and replay, to drive L2GraphCallback's capture, replay and
fallback on a machine without a GPU (adapted from the project's graph-emulator tool).

Capture: every aten op is recorded (TorchDispatchMode). Ops run for real during capture (so shapes and
allocations exist), but every pre-existing tensor an op mutates is snapshotted first and restored at
capture end, and the CPU RNG is restored too: like a real capture, nothing the capture "ran" has any
effect on pre-existing state. Host syncs (.item(), bool(tensor), equal) raise, like a capture does.
Replay: re-runs the recorded ops in order; out-of-place results are copied into the tensors recorded
at capture (static addresses), in-place ops re-run on the same memory; a tensor from before the
capture is read through an alias of the memory it had then (a GPU graph holds addresses, so
``t.data = other`` later is not seen by a replay). Python code does NOT run at
replay -- exactly the property of CUDA graphs the callback has to cope with.

Only what goes through the dispatcher is recorded: code torch.compile's inductor generated for the
CPU calls its C++ kernels directly, so a replay here skips it (a user-compiled submodule trains wrong
under the emulator only; tests/gpu/test_callback_gpu.py checks that case on the GPU).
"""

from __future__ import annotations

import contextlib

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

SYNC_OPS = {
    torch.ops.aten._local_scalar_dense.default,
    torch.ops.aten.is_nonzero.default,
    torch.ops.aten.equal.default,
}


class CaptureError(RuntimeError):
    pass


def _storage_key(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def _mutated_args(func, args, kwargs):
    out = []
    # native_batch_norm updates running stats in place without saying so in its schema
    if func is torch.ops.aten.native_batch_norm.default and len(args) > 5 and args[5]:
        out += [t for t in args[3:5] if isinstance(t, torch.Tensor)]
    for i, a in enumerate(func._schema.arguments):
        if a.alias_info is not None and a.alias_info.is_write:
            v = args[i] if i < len(args) else kwargs.get(a.name)
            flat, _ = tree_flatten(v)
            out += [t for t in flat if isinstance(t, torch.Tensor)]
    return out


def _as_it_is_now(t: torch.Tensor) -> torch.Tensor:
    """A view of `t`'s memory with `t`'s shape and strides as they are now, whatever later happens to `t`."""
    if t.layout != torch.strided:
        return t
    with torch.no_grad():
        return t.as_strided(t.size(), t.stride(), t.storage_offset())


def _fresh_outputs(func, result):
    """Tensors among `result` that are new allocations (returns without an alias annotation)."""
    returns = func._schema.returns
    parts = list(result) if len(returns) > 1 else [result]
    fresh = []
    for r, part in zip(returns, parts):
        if r.alias_info is not None:
            continue
        flat, _ = tree_flatten(part)
        fresh += [t for t in flat if isinstance(t, torch.Tensor)]
    return fresh


class _Recorder(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: list = []
        self.created: set[int] = set()
        self.snapshots: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._snap_ids: set[int] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in SYNC_OPS:
            raise CaptureError(f"emulated capture: host sync {func} not permitted while capturing")
        mutated = _mutated_args(func, args, kwargs)
        for t in mutated:
            if _storage_key(t) not in self.created and id(t) not in self._snap_ids:
                self._snap_ids.add(id(t))
                self.snapshots.append((t, t.detach().clone()))
        result = func(*args, **kwargs)
        fresh = _fresh_outputs(func, result)
        for t in fresh:
            self.created.add(_storage_key(t))
        # a CUDA graph keeps the addresses its capture read: a tensor from before the capture is
        # replayed through an alias of its memory then, so `t.data = other` or `t.set_(other)` later
        # leaves the replay reading the old memory, as on a GPU
        args, kwargs = tree_map(self._at_capture_address, (args, kwargs))
        self.ops.append((func, args, kwargs, [_as_it_is_now(t) for t in fresh]))
        return result

    def _at_capture_address(self, value):
        if not isinstance(value, torch.Tensor) or value.layout != torch.strided:
            return value
        if _storage_key(value) in self.created:
            # made by the capture: the replay writes its memory, seen as it is at this op (a later
            # in-place metadata op, `transpose_` ending a CPU GRU(batch_first=True), changes the
            # object's shape, not what this op read or wrote)
            return _as_it_is_now(value)
        return value.detach()

    def undo(self) -> None:
        with torch.no_grad():
            for live, saved in reversed(self.snapshots):
                live.copy_(saved)


class FakeGraph:
    """Stands in for torch.cuda.CUDAGraph."""

    instances = 0
    replays = 0

    def __init__(self) -> None:
        FakeGraph.instances += 1
        self.ops = None

    def replay(self) -> None:
        FakeGraph.replays += 1
        with torch.no_grad():
            for func, args, kwargs, fresh in self.ops:
                res = func(*args, **kwargs)
                for dst, src in zip(fresh, _fresh_outputs(func, res)):
                    if dst.untyped_storage().data_ptr() != src.untyped_storage().data_ptr():
                        dst.copy_(src)


CAPTURING = [False]


STATE_OWNERS: list = []  # (module, optimizer) of the capture in progress, set by the _capture_into patch


def _state_tensors():
    out = []
    for module, optimizer in STATE_OWNERS:
        out += list(module.parameters()) + list(module.buffers())
        if optimizer is not None:
            for st in optimizer.state.values():
                out += [v for v in st.values() if isinstance(v, torch.Tensor)]
            out += [g["lr"] for g in optimizer.param_groups if isinstance(g.get("lr"), torch.Tensor)]
    return out


@contextlib.contextmanager
def emulated_graph_capture(graph, pool=None, stream=None):
    rng = torch.get_rng_state()
    # safety net: whatever the capture ran, model/optimizer state is as before (a capture runs nothing)
    net = [(t, t.detach().clone()) for t in _state_tensors()]
    rec = _Recorder()
    CAPTURING[0] = True
    try:
        with rec:
            yield
    finally:
        CAPTURING[0] = False
        rec.undo()
        with torch.no_grad():
            for live, saved in net:
                if not torch.equal(live, saved):
                    UNDECLARED.append(tuple(live.shape))
                live.copy_(saved)
        torch.set_rng_state(rng)
    graph.ops = rec.ops


UNDECLARED: list = []


class _DoneEvent:
    def record(self, *a):
        return None

    def query(self):
        return True

    def elapsed_time(self, end):
        return 1.0


class _FakeStream:
    def wait_stream(self, other):
        return None


def install(monkeypatch_setattr) -> None:
    """Patch torch and l2lightning so L2GraphCallback captures and replays on the CPU via the emulator.

    `monkeypatch_setattr(obj, name, value)`: pytest's monkeypatch.setattr.
    """
    from l2lightning.callback import graph_callback as cbm
    from l2lightning.callback import step_capture
    from l2lightning.graph import optim as optim_mod

    def devices(*a, **k):
        return ["cuda", "cpu"]

    import importlib
    import pkgutil

    import torch.optim

    for info in pkgutil.iter_modules(torch.optim.__path__):
        module = importlib.import_module(f"torch.optim.{info.name}")
        if hasattr(module, "_get_capturable_supported_devices"):
            monkeypatch_setattr(module, "_get_capturable_supported_devices", devices)
    monkeypatch_setattr(optim_mod, "CAPTURABLE_DEVICE_TYPES", ("cuda", "cpu"))
    monkeypatch_setattr(step_capture, "graph_capture", emulated_graph_capture)
    monkeypatch_setattr(
        cbm.L2GraphCallback,
        "_refusal",
        lambda self, trainer, pl_module: self._configuration_refusal(trainer, pl_module),
    )
    monkeypatch_setattr(cbm.L2GraphCallback, "_events", staticmethod(lambda: (_DoneEvent(), _DoneEvent())))
    monkeypatch_setattr(torch.cuda, "CUDAGraph", FakeGraph)
    # oneDNN's CPU RNN kernels (mkldnn_rnn_layer and its backward) replayed here with another
    # hidden state than the capture's give other gradients than the eager step (up to 2e-3 on an
    # LSTM's weights; tests/test_graph_emulator.py), which a CUDA graph of cuDNN's RNN does not (the
    # word language model is bitwise its baseline on the H200): the emulator runs torch's own kernels
    monkeypatch_setattr(torch.backends.mkldnn, "enabled", False)
    original_capture_into = step_capture.StepCapture._capture_into

    def capture_into(self, *a, **k):
        STATE_OWNERS[:] = [(self._fit.module, self._fit.optimizer.optimizer if self._fit.optimizer else None)]
        try:
            return original_capture_into(self, *a, **k)
        finally:
            STATE_OWNERS.clear()

    monkeypatch_setattr(step_capture.StepCapture, "_capture_into", capture_into)
    monkeypatch_setattr(torch.cuda, "synchronize", lambda *a, **k: None)
    monkeypatch_setattr(torch.cuda, "is_current_stream_capturing", lambda: CAPTURING[0])
    monkeypatch_setattr(torch.cuda, "Stream", lambda *a, **k: _FakeStream())
    monkeypatch_setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    monkeypatch_setattr(torch.cuda, "current_stream", lambda *a, **k: _FakeStream())
    FakeGraph.instances = 0
    FakeGraph.replays = 0
    UNDECLARED.clear()
