"""What one training step does, op by op, as seen by a ``TorchDispatchMode``: for deciding what a graph may replay.

A CUDA graph replays the ops its capture recorded and runs no Python. So before capturing, the
callback traces its eager warm-up steps (:class:`StepTracer`) and learns:

* the op sequence, with every Python number and small host tensor the ops received: two steps that
  differ there (a branch on ``self.global_step``, a schedule computed in Python) cannot share one
  graph, and :func:`first_difference` names the op and the user's line;
* host syncs (``.item()``, ``print(tensor)``, ``if tensor:``, ``.cpu()``, boolean masks): a capture
  cannot contain them, so they are named (file:line) before any capture is tried;
* seeding and random-state put-backs (``torch.manual_seed`` however imported, ``fork_rng``, dropout
  inside a block activation checkpointing recomputes with the forward's state put back): a replay
  runs no Python, so it would not do them again;
* host-made constants: CPU tensors that reach the device inside the step (a causal mask built with
  ``torch.triu`` on the CPU and ``.to(device)``; index tensors built on the CPU). If their bytes are
  the same at every traced step, the capture substitutes a device-resident copy made beforehand
  (:class:`HostConstants`), because a host-to-device copy from pageable memory cannot be captured;
  if their bytes differ, the step cannot be captured, and the line is named.

During the capture itself the same mode runs with the constants (substituting them, and refusing a
sync before CUDA ever sees it, which keeps a refused capture clean), and notes every host tensor the
step's device ops read, with its bytes (:class:`HostRead`): the graph keeps those values, so the
callback compares them before each replay. A host tensor the step made with host ops
(``self.temperature.clamp(min=0.1)``) is noted as the host tensors it was made of, and so is one
whose value the step's own code reads on the host (``self.temperature.item()``): the step makes the
one anew and reads the other at every eager step, while the graph keeps the number of its capture.
A traced step that changes in place a host tensor the module, a callback or a global holds
(:attr:`StepTracer.host_state`) is refused: a replay would not change it. Code compiled by
``torch.compile`` runs compiled under the mode, as a whole (:meth:`StepTracer.ignore_compile_internals`);
host tensors passed into or held by compiled submodules (``torch.compile(module)``,
``module.compile()``) are noted as problems (:meth:`StepTracer.watching_compiled_inputs`).
"""

from __future__ import annotations

import contextlib
import functools
import linecache
import math
import os
import sys
import sysconfig
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

from l2lightning.guards.compiled_calls import (
    compiled_target,
    host_tensors_read_by,
    is_host_tensor,
    never_compiled,
    partial_arguments,
    watching_compiled_calls,
)

aten = torch.ops.aten

# Ops whose result the host must wait for when their input lives on the device.
_SYNC_OPS = {
    aten._local_scalar_dense.default,
    aten.is_nonzero.default,
    aten.equal.default,
    aten.nonzero.default,
    aten.masked_select.default,
    aten._unique2.default,
    aten.unique_dim.default,
    aten.unique_consecutive.default,
    aten.bincount.default,
}
_BOOL_INDEX_OPS = {
    aten.index.Tensor,
    aten.index_put.default,
    aten.index_put_.default,
    aten._index_put_impl_.default,
}
_REPEAT_INTERLEAVE = {aten.repeat_interleave.Tensor, aten.repeat_interleave.self_Tensor}
# Op arguments that carry random-number state: they differ every step by design, and a graph replays
# them correctly (PyTorch registers the generator with the capture).
_RNG_ARGUMENTS = frozenset({"philox_seed", "philox_offset", "seed", "offset", "rng_state", "generator"})
# Host tensors up to this many elements enter an op's signature by value (scalars, small index lists).
_SMALL_HOST_NUMEL = 64
# Host constants larger than this are refused rather than copied to the device (bytes).
MAX_HOST_CONSTANT_BYTES = 64 << 20
# Files that are not the user's: the first frame outside them is "the user's line".
_LIBRARY_PARTS = (
    "/torch/",
    "/lightning/",
    "/lightning_fabric/",
    "/pytorch_lightning/",
    "/lightning_utilities/",
    "/torchmetrics/",
    "/contextlib.py",
    "/functools.py",
    "<frozen ",
)


class CaptureRefused(RuntimeError):
    """Raised inside a capture before an op the graph cannot hold reaches CUDA."""


def _is_library(filename: str) -> bool:
    if _in_this_package(filename) or _generated_by_inductor(filename):
        return True
    return any(part in filename for part in _LIBRARY_PARTS)


def _generated_by_inductor(filename: str) -> bool:
    """Code torch.compile's inductor generated (its wrappers call aten ops into buffers it allocated
    without an op): in inductor's cache directory, wherever `TORCHINDUCTOR_CACHE_DIR` put it."""
    directory = _inductor_cache_dir()
    return directory is not None and filename.startswith(directory)


@functools.cache
def _inductor_cache_dir_once() -> str | None:
    # as inductor's `cache_dir()` finds it, without its side effects (it sets the variable and makes
    # the directory)
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    try:
        directory = os.environ.get("TORCHINDUCTOR_CACHE_DIR") or default_cache_dir()
    except Exception:  # noqa: BLE001 -- frame naming must never fail a user's step
        return None
    return os.path.abspath(directory) + os.sep


def _inductor_cache_dir() -> str | None:
    """Inductor's cache directory, once inductor is loaded (read once: it is read per traced frame)."""
    if "torch._inductor.runtime.cache_dir_utils" not in sys.modules:
        return None
    return _inductor_cache_dir_once()


def user_frame(skip: int = 1) -> tuple[str, int] | None:
    """(file, line) of the innermost caller outside torch, Lightning, torchmetrics and this package."""
    frame = sys._getframe(skip)
    while frame is not None:
        if not _is_library(frame.f_code.co_filename):
            return frame.f_code.co_filename, frame.f_lineno
        frame = frame.f_back
    return None


def _called_from_users_code() -> bool:
    """Whether the op being dispatched was asked for by the user's own code: the first frame above the
    dispatch outside torch and this package is the user's (not Lightning's or torchmetrics')."""
    frame = sys._getframe(1)
    while frame is not None and (
        frame.f_code.co_filename.startswith(_TORCH_DIR) or _in_this_package(frame.f_code.co_filename)
    ):
        frame = frame.f_back
    return frame is not None and _is_users_file(frame.f_code.co_filename)


def _in_this_package(filename: str) -> bool:
    return "/l2lightning/" in filename and "/l2lightning/models/" not in filename


def user_frame_of_traceback(tb: Any) -> tuple[str, int] | None:
    """(file, line) of the innermost user frame in an exception's traceback."""
    found = None
    while tb is not None:
        filename = tb.tb_frame.f_code.co_filename
        if not _is_library(filename):
            found = (filename, tb.tb_lineno)
        tb = tb.tb_next
    return found


def describe_frame(frame: tuple[str, int] | None) -> str:
    """``file:line (`source`)`` for a user frame, or a placeholder when none was found."""
    if frame is None:
        return "an unknown line"
    filename, line = frame
    source = linecache.getline(filename, line).strip()
    return f"{filename}:{line} (`{source}`)" if source else f"{filename}:{line}"


def _op_name(func: Any) -> str:
    return str(func).replace("aten.", "", 1)


def _value_key(value: Any) -> Any:
    if isinstance(value, float) and math.isnan(value):
        return "nan"
    return value


@dataclass
class HostConstant:
    """A host tensor that reached the device inside a traced step."""

    kind: str  # "to" (x.to(device)), "copy" (dev.copy_(host)), "arg" (a host tensor passed to a device op)
    value: torch.Tensor  # the host bytes (a CPU clone)
    result: (
        torch.Tensor | None
    )  # for "to": the device tensor the op produced (dtype/layout as the op made it)
    frame: tuple[str, int] | None


@dataclass
class StepTrace:
    """One traced step: op signatures (with the user's line of each), syncs, host constants, problems."""

    ops: list[tuple] = field(default_factory=list)
    frames: list[tuple[str, int] | None] = field(default_factory=list)
    op_hooks: list[str | None] = field(default_factory=list)  # the Lightning hook each op ran in
    # (what, the user's line, the Lightning hook it ran in or None)
    syncs: list[tuple[str, tuple[str, int] | None, str | None]] = field(default_factory=list)
    mutating_hooks: set[str] = field(default_factory=set)  # hooks that wrote tensors they did not create
    # hooks that read what the optimizer step updates (a parameter's data, the optimizer's state; not
    # gradients): run after a replay they would see it updated already
    parameter_reading_hooks: set[str] = field(default_factory=set)
    # hooks that built tensors from Python data (`torch.tensor([...])`): their values may come from hidden syncs
    host_hooks: set[str] = field(default_factory=set)
    memo: list[tuple[str, Any]] = field(default_factory=list)  # results of MEMOIZED calls, in order
    constants: list[HostConstant] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)  # what can never be captured, each naming its line
    # ids of the tensor objects the step's ops read (which of them a Python list held before the step)
    read_ids: set[int] = field(default_factory=set)
    # the user's lines of ops that draw from a random state torch cannot save and put back (cuDNN's
    # RNN dropout state): an eager step beside a replay would draw other numbers (hidden_random_state)
    hidden_random: list[tuple[str, int] | None] = field(default_factory=list)
    # training off the CPU: (op, the user's line) of each draw from torch's global CPU generator, which
    # runs on the host (draws_on_the_host): a replay would neither draw anew nor move the generator on
    host_draws: list[tuple[str, tuple[str, int] | None]] = field(default_factory=list)

    def add_problem(self, problem: str) -> None:
        """Note `problem` once (a step may run the same call many times: each recomputed block, each
        put-back of a generator)."""
        if problem not in self.problems:
            self.problems.append(problem)


def first_difference(
    a: StepTrace, b: StepTrace, skip_hooks: set[str] | frozenset = frozenset()
) -> str | None:
    """None when two traced steps ran the same ops with the same host values, else the first difference.

    Ops that ran inside `skip_hooks` (hooks that run eagerly after each replay) are not compared.
    """
    ia = [i for i, h in enumerate(a.op_hooks) if h not in skip_hooks]
    ib = [i for i, h in enumerate(b.op_hooks) if h not in skip_hooks]
    for i, j in zip(ia, ib):
        if a.ops[i] != b.ops[j]:
            return (
                f"op {i} was `{_describe_op(a.ops[i])}` at {describe_frame(a.frames[i])} in one step and "
                f"`{_describe_op(b.ops[j])}` at {describe_frame(b.frames[j])} in another"
            )
    if a.memo != b.memo:
        return f"torch's {a.memo} in one step and {b.memo} in another (the same attention mask should decide alike)"
    if len(ia) != len(ib):
        (longer, li), (_, si) = sorted([(a, ia), (b, ib)], key=lambda t: -len(t[1]))
        i = li[len(si)]
        return (
            f"one step ran {len(li)} ops and another {len(si)}; the first extra one is "
            f"`{_describe_op(longer.ops[i])}` at {describe_frame(longer.frames[i])}"
        )
    for x, y in zip(a.constants, b.constants):
        if (
            x.value.shape != y.value.shape
            or x.value.dtype != y.value.dtype
            or not torch.equal(x.value, y.value)
        ):
            return (
                f"a host tensor that reaches the device at {describe_frame(x.frame)} holds different values "
                "from step to step, and a graph can only hold a constant one"
            )
    return None


def _describe_op(signature: tuple) -> str:
    name, args = signature
    shown = []
    for arg in args:
        if isinstance(arg, tuple) and arg and arg[0] == "dev":
            shown.append(f"<{arg[2]} {list(arg[3])}>")
        elif isinstance(arg, tuple) and arg and arg[0] == "host":
            shown.append(f"host{list(arg[2])}={arg[3]!r}")
        else:
            shown.append(repr(arg))
    text = f"{name}({', '.join(shown)})"
    return text if len(text) < 160 else text[:157] + "..."


class HostConstants:
    """The host constants of the traced steps, ready as device tensors for the capture to substitute."""

    def __init__(self, constants: Sequence[HostConstant], device: torch.device) -> None:
        self.entries = list(constants)
        self.device_copies: list[torch.Tensor] = []
        for c in self.entries:
            nbytes = c.value.numel() * c.value.element_size()
            if nbytes > MAX_HOST_CONSTANT_BYTES:
                raise ValueError(
                    f"the host tensor at {describe_frame(c.frame)} is {nbytes >> 20} MiB; build it on the "
                    "device once (a buffer in __init__) instead of copying it in every step"
                )
            if c.kind == "to" and c.result is not None:
                self.device_copies.append(c.result)
            else:
                self.device_copies.append(c.value.to(device))
        self.used = 0
        # the host tensor each constant was read from at the capture (set by the capture's tracer)
        self.sources: list[torch.Tensor | None] = [None] * len(self.entries)

    def take_changed_sources(self) -> None:
        """Make the constants whose host tensor holds other bytes now (changed in place since the
        capture) the values the next capture substitutes, as the warm-up steps had traced them."""
        for entry, source in zip(self.entries, self.sources):
            if source is None or same_bytes(source, entry.value):
                continue
            entry.value = source.detach().clone()
            if entry.kind == "to" and entry.result is not None:
                entry.result = source.detach().to(device=entry.result.device, dtype=entry.result.dtype)


@dataclass
class HostRead:
    """A host tensor an op of the captured step read on the device, and its bytes at the capture.

    The graph keeps what it read then: a 0-d CPU tensor (`logits / self.temperature`) is a number in
    the captured kernel's arguments, a larger one the device copy the capture substituted. Changed in
    place after the capture (an epoch hook's `self.temperature.mul_(0.9)`), replays would go on with
    the old value; the bytes are compared before each replay. Also a host tensor a host op made the
    device op's input of, or whose value the step read with `.item()`.
    """

    tensor: torch.Tensor
    captured: torch.Tensor
    frame: tuple[str, int] | None

    def changed(self) -> bool:
        return not same_bytes(self.tensor, self.captured)


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two host tensors hold the same shape, dtype and values (NaNs equal where both are)."""
    if a.shape != b.shape or a.dtype != b.dtype or a.layout != b.layout:
        return False
    if a.layout != torch.strided:  # sparse: torch.equal has no kernel for it
        a, b = a.to_dense(), b.to_dense()
    return bool(torch.equal(a, b) or _nan_equal(a, b))


def _nan_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    if not (a.is_floating_point() or a.is_complex()):
        return False
    return bool(
        torch.equal(torch.nan_to_num(a, nan=0.0), torch.nan_to_num(b, nan=0.0))
        and torch.equal(a.isnan(), b.isnan())
    )


# Library functions that sync only to decide a Python value from a tensor that a step builds the
# same way every time (nn.Transformer* checking whether a mask is causal: `bool((mask == causal).all())`).
# Traced steps record their results; a capture returns the recorded ones instead of syncing.
MEMOIZED: tuple[tuple[str, str], ...] = (("torch.nn.modules.transformer", "_detect_is_causal_mask"),)

# torch's functions that seed or set its random generators' state: a step that calls them cannot be
# replayed (a replay would draw on from where the last one left off); `lightning.seed_everything`
# calls torch.manual_seed
_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep
SEEDING: tuple[tuple[str, str], ...] = (
    *((m, f) for m in ("torch", "torch.random") for f in ("manual_seed", "seed", "set_rng_state")),
    *(
        ("torch.cuda", f)
        for f in ("manual_seed", "manual_seed_all", "seed", "seed_all", "set_rng_state", "set_rng_state_all")
    ),
)


_CHECKPOINT_FILE = os.path.join("utils", "checkpoint.py")
# dynamo's compilation of a frame (its entry, `_compile`, is in this file; inductor and AOTAutograd run
# below it): it saves the random generators' states before it traces and puts them back after (tracing
# draws nothing for real), a put-back that changes nothing. Only the compilation: dynamo's other files
# also wrap functions torch runs eagerly (`torch._dynamo.disable`), seeding included on some versions.
_COMPILE_ENTRY_FILE = os.path.join("_dynamo", "convert_frame.py")
# torch.compile's other put-back, `preserve_rng_state` (a context manager in this file): inductor wraps
# its code generation in it, including the backward's, which AOTAutograd compiles lazily at the first
# backward (so below `loss.backward()`, not below dynamo's entry). It puts back the states it saved on
# entry, so it changes nothing; exempt only when it is the seeding call's direct caller.
_RNG_PRESERVER = (os.path.join("_dynamo", "utils.py"), "preserve_rng_state")

# aten ops that draw from a random generator without a `generator` argument of their own (the others
# have one: bernoulli_, normal_, multinomial, ...)
_RANDOM_WITHOUT_GENERATOR_ARG = frozenset(
    {
        "aten::native_dropout",
        "aten::randn_like",
        "aten::rand_like",
        "aten::randint_like",
        "aten::randperm",
        "aten::rand",
        "aten::randn",
        "aten::randint",
    }
)


_CUDNN_RNN = aten._cudnn_rnn.default


def draws_hidden_random_state(func: Any, args: tuple, kwargs: dict) -> bool:
    """Whether aten op `func` draws from a random state that lives outside torch's generators: cuDNN's
    RNN with dropout in training (``nn.LSTM``/``nn.GRU``/``nn.RNN(dropout=p)``, p > 0), whose dropout
    masks come from a state buffer cuDNN keeps per device and advances at every call."""
    if func is not _CUDNN_RNN:
        return False
    return (
        bool(_argument(func, args, kwargs, "train"))
        and float(_argument(func, args, kwargs, "dropout") or 0.0) > 0.0
    )


def cudnn_dropout_state(func: Any, args: tuple, kwargs: dict) -> torch.Tensor | None:
    """The dropout-state buffer a cuDNN RNN op with dropout reads and advances (see
    :func:`draws_hidden_random_state`), None for any other op. It is one buffer per device, the same
    tensor at every call until cuDNN re-seeds (after the generator's state is set), so the step's
    graph and the replay check can hold, save and put it back like any tensor the step writes."""
    if not draws_hidden_random_state(func, args, kwargs):
        return None
    state = _argument(func, args, kwargs, "dropout_state")
    return state if isinstance(state, torch.Tensor) else None


def _argument(func: Any, args: tuple, kwargs: dict, name: str) -> Any:
    names = [a.name for a in func._schema.arguments]
    i = names.index(name)
    return args[i] if i < len(args) else kwargs.get(name)


def draws_random_numbers(func: Any) -> bool:
    """Whether the aten op `func` draws from a random generator (dropout's bernoulli_, randn_like, ...)."""
    schema = func._schema
    return schema.name in _RANDOM_WITHOUT_GENERATOR_ARG or any(
        a.name == "generator" for a in schema.arguments
    )


def draws_from_its_own_generator(func: Any, args: tuple, kwargs: dict, device_type: str) -> bool:
    """Whether the aten op `func` draws from a `device_type` generator other than that device's default
    one (``torch.randn(..., generator=g)`` with ``g = torch.Generator(device="cuda")``). A CUDA graph
    advances the default generator's offset at each replay; the capture of a draw from another, not
    registered with the graph, fails (PyTorch: "Attempt to increase offset for a CUDA generator not in
    capture mode")."""
    for i, argument in enumerate(func._schema.arguments):
        if argument.name != "generator":
            continue
        generator = args[i] if i < len(args) else kwargs.get("generator")
        if not isinstance(generator, torch.Generator) or generator.device.type != device_type:
            return False
        defaults = torch.cuda.default_generators if device_type == "cuda" else (torch.default_generator,)
        # by the C++ generator, not the Python object: an op that draws inside another (cuDNN seeding
        # its RNN dropout state with `random_(generator)`) hands a second Python wrapper of the default
        return all(_generator_id(generator) != _generator_id(default) for default in defaults)
    return False


def draws_on_the_host(func: Any, args: tuple, kwargs: dict, result: Any) -> bool:
    """Whether the aten op `func` drew random numbers from torch's global CPU generator into a CPU
    tensor (``torch.randn(n, d)`` without a `device`, ``torch.rand(1)``): no `generator`, or the default."""
    if not draws_random_numbers(func):
        return False
    out = [r for r in tree_flatten(result)[0] if isinstance(r, torch.Tensor)]
    if not out or any(r.device.type != "cpu" for r in out):
        return False
    for i, argument in enumerate(func._schema.arguments):
        if argument.name == "generator":
            generator = args[i] if i < len(args) else kwargs.get("generator")
            return generator is None or _generator_id(generator) == _generator_id(torch.default_generator)
    return True


def _generator_id(generator: torch.Generator) -> int:
    """The address of the C++ generator a Python ``torch.Generator`` wraps."""
    return int(getattr(generator, "_cdata", id(generator)))


# Helpers that only pass a message on: the call that counts is the one made to them (Logger.info and
# its kin, LightningModule.print, rank_zero_info / rank_zero_warn and their rank_zero_only wrapper)
_OUTPUT_HELPERS = (
    (os.path.join("logging", "__init__.py"), None),
    (os.path.join("lightning", "pytorch", "core", "module.py"), "print"),
    (os.path.join("lightning_utilities", "core", "rank_zero.py"), None),
)


def _is_users_file(filename: str) -> bool:
    """Whether code in `filename` is the user's own: not torch, Lightning, torchmetrics or this
    package, not an installed package (a model library's one-time warning) and not the standard
    library. A notebook cell (``<ipython-input-...>``) is the user's."""
    if _is_library(filename):
        return False
    if any(part in filename for part in ("site-packages", "dist-packages")):
        return False
    return not filename.startswith(_STDLIB_DIR)


_STDLIB_DIR = os.path.realpath(sysconfig.get_paths()["stdlib"]) + os.sep


def _output_caller(frame: Any) -> Any:
    """The frame that asked for a print or a log line, past the helpers that pass it on."""
    while frame is not None and any(
        frame.f_code.co_filename.endswith(path) and name in (None, frame.f_code.co_name)
        for path, name in _OUTPUT_HELPERS
    ):
        frame = frame.f_back
    return frame


def _torch_function_name(frame: Any) -> str | None:
    """``torch.random.manual_seed`` for a frame of that function; None for a decorator's inner function
    (torch.manual_seed runs inside two: dynamo's ``_fn`` and ``_compile``'s ``inner``), which its module
    does not hold by that name."""
    site = os.path.dirname(_TORCH_DIR.rstrip(os.sep))
    module = os.path.splitext(os.path.relpath(frame.f_code.co_filename, site))[0].replace(os.sep, ".")
    held = getattr(sys.modules.get(module), frame.f_code.co_name, None)
    return f"{module}.{frame.f_code.co_name}" if callable(held) else None


def _seeding_called_by_user(caller: Any, name: str) -> str | None:
    """What the step's code called to seed torch (`name` when it called the watched function itself),
    or None when activation checkpointing did it.

    The watched functions are module attributes, so the step reaches them directly
    (``torch.manual_seed``) or through torch's own code: a name imported from torch before the patch
    (``from torch import manual_seed``, whose body seeds CUDA through ``torch.cuda.manual_seed_all``),
    ``torch.random.fork_rng``'s put-back. Only ``torch.utils.checkpoint``'s recomputation is exempt: it
    puts back a state the same step took (a random op drawn while it is put back is refused on its
    own, :func:`draws_random_numbers`), and so are torch.compile's compilation of a frame and inductor's
    code generation (each puts back the states it saved before); anything else is the step's own
    seeding, named by the outermost torch function below the step's line.
    """
    if caller.f_code.co_filename.endswith(_RNG_PRESERVER[0]) and caller.f_code.co_name == _RNG_PRESERVER[1]:
        return None
    frame, outermost = caller, None
    while frame is not None and _is_library(frame.f_code.co_filename):
        filename = frame.f_code.co_filename
        if filename.startswith(_TORCH_DIR):
            if filename.endswith((_CHECKPOINT_FILE, _COMPILE_ENTRY_FILE)):
                return None
            named = _torch_function_name(frame)
            if named is not None:
                outermost = named
        frame = frame.f_back
    return outermost or name


def _written_tensors(func: Any, args: tuple, kwargs: dict) -> Iterator[torch.Tensor]:
    """The tensors aten op `func` writes in place: its arguments the schema marks as written
    (``self`` of ``add_``, ``out=``), lists of them flattened."""
    for i, arg in enumerate(func._schema.arguments):
        if arg.alias_info is None or not arg.alias_info.is_write:
            continue
        value = args[i] if i < len(args) else kwargs.get(arg.name)
        for t in tree_flatten(value)[0]:
            if isinstance(t, torch.Tensor):
                yield t


@contextlib.contextmanager
def sync_free_bincount() -> Iterator[None]:
    """While the step is traced or captured, torchmetrics counts without a host sync.

    torchmetrics' ``_bincount`` (macro-averaged classification metrics, confusion matrices, AUROC
    with thresholds) calls ``torch.bincount``, whose output size depends on the data: the host
    waits for the GPU, which a graph cannot hold. With ``minlength`` given, which torchmetrics always
    passes with the number of classes, the same counts come from ``index_add_`` into ``minlength``
    zeros: integers, so equal bit for bit, without the wait (an index out of range, which bincount
    would count in a longer output, fails loudly instead). Outside the traced and captured steps
    torchmetrics runs as it is.
    """
    data = sys.modules.get("torchmetrics.utilities.data")
    original = getattr(data, "_bincount", None)
    if original is None:
        yield
        return

    def bincount(x: torch.Tensor, minlength: int | None = None) -> torch.Tensor:
        if minlength is None or torch.are_deterministic_algorithms_enabled():
            return original(x, minlength)  # the unique count syncs anyway; the mesh path does not
        flat = x.reshape(-1).long()
        counts = torch.zeros(minlength, dtype=torch.long, device=x.device)
        return counts.index_add_(0, flat, torch.ones_like(flat))

    patched = [
        m
        for name, m in list(sys.modules.items())
        if name.startswith("torchmetrics") and getattr(m, "_bincount", None) is original
    ]
    for m in patched:
        m._bincount = bincount
    try:
        yield
    finally:
        for m in patched:
            m._bincount = original


def _fills_through_mask(func: Any, args: tuple, kwargs: dict) -> bool:
    """Whether ``x[mask] = number`` runs as ``masked_fill_``, which waits for nothing.

    ATen's ``index_put_`` takes that path (``canDispatchToMaskedFill``) when nothing accumulates, the
    only index is one boolean or byte mask on ``x``'s device and the value is one number held on the
    host (a Python number becomes such a tensor). torchmetrics' macro averages zero the weights of
    absent classes this way. Any other boolean-mask indexing counts the mask's true entries first.
    """
    if func is aten.index.Tensor:
        return False
    names = [a.name for a in func._schema.arguments]
    bound = dict(zip(names, args, strict=False)) | kwargs
    self, value = bound.get("self"), bound.get("values")
    masks = [i for i in bound.get("indices") or () if i is not None]
    return (
        not bound.get("accumulate", False)
        and isinstance(self, torch.Tensor)
        and isinstance(value, torch.Tensor)
        and value.numel() == 1
        and value.device.type == "cpu"
        and len(masks) == 1
        and masks[0].dtype in (torch.bool, torch.uint8)
        and masks[0].device == self.device
    )


_ABSENT = object()


@contextlib.contextmanager
def _replaced(replacements: Sequence[tuple[Any, str, Any]]) -> Iterator[None]:
    """Set each ``owner.name`` to its replacement for the block, then put back what was there; a name
    the owner only inherited (a logger's method, a base class's property) is deleted again, so the
    inherited one shows through."""
    saved: list[tuple[Any, str, Any]] = []
    try:
        for owner, name, replacement in replacements:
            saved.append((owner, name, vars(owner).get(name, _ABSENT)))
            setattr(owner, name, replacement)
        yield
    finally:
        for owner, name, original in reversed(saved):
            if original is _ABSENT:
                delattr(owner, name)
            else:
                setattr(owner, name, original)


# where a graph capture records streams (CUDA); elsewhere there is no stream to check
_STREAM_CAPTURED_DEVICES = ("cuda",)


def stream_is_captured() -> bool:
    """Whether the current CUDA stream records into the capture in progress (the capture's stream, or
    one forked from it by waiting on it); work on any other stream runs once, now, and never in a replay."""
    return torch.cuda.is_current_stream_capturing()


def current_stream_handle() -> int:
    return torch.cuda.current_stream().cuda_stream


class StepTracer(TorchDispatchMode):
    """Trace a step's ops (warm-up), or substitute host constants and refuse syncs (capture).

    Args:
        device_type: the device the step trains on ("cuda"); tensors elsewhere are host tensors.
        constants: for a capture, the host constants to substitute, in the order they occur.
        capture_stream: for a capture, the stream it runs on (its ops are recorded whatever else
            is asked); ops on any other stream must be recorded too, or the capture is refused.
    """

    def __init__(
        self,
        device_type: str = "cuda",
        constants: HostConstants | None = None,
        memo: Sequence[tuple[str, Any]] = (),
        capture_stream: Any = None,
    ) -> None:
        super().__init__()
        self.device_type = device_type
        self._capture_stream = getattr(capture_stream, "cuda_stream", None)
        self.constants = constants
        self._memo_replay = list(memo)
        self._seeding_depth = 0  # watched seeding calls under way (their inner watched calls are theirs)
        # inside activation checkpointing's recomputation with the forward's random state put back
        self._recomputing_with_forward_rng = False
        self.trace = StepTrace()
        # an out-of-memory error one of the step's ops raised: in backward, on CUDA, autograd's device
        # thread loses it and the step fails with a SystemError instead (see __torch_dispatch__)
        self.out_of_memory: torch.OutOfMemoryError | None = None
        # storages of every tensor the step's ops made (what an attribute rebound to them holds is
        # the step's own result: carried state, l2lightning.graph.carried_state)
        self.made: set[int] = set()
        # storages the step's ops read that they did not make: the step's inputs from before it (a
        # carried attribute whose old value the step never reads needs no copy into the graph's memory)
        self.read_from_before: set[int] = set()
        # capture: device tensors from before the step that its ops write in place (a counter in a
        # dict, an EMA in a list), by storage, with the user's line: what a replay changes besides the
        # module's parameters and buffers and the optimizer's state (l2lightning.guards.replay_check)
        self.external_writes: dict[int, tuple[torch.Tensor, tuple[str, int] | None]] = {}
        self._paused = 0
        self._hook: str | None = None
        self._hook_made: set[int] = set()  # storages created inside the current hook
        # storages the optimizer step updates (the module's parameters and the optimizer's state, set by
        # the caller): reads of them inside a hook are noted
        self.parameter_storages: frozenset[int] = frozenset()
        self._watching: str | None = None  # the eager hook whose reads are noted while paused
        # capture: the host tensors the step's device ops read (:class:`HostRead`), one per tensor
        self.host_reads: list[HostRead] = []
        self._host_read_ids: set[int] = set()
        # capture: for each host tensor a host op of the step made, the host tensors from before the
        # step its values come from (`self.temperature.clamp(min=0.1)`: the attribute), by id; the
        # made tensors are kept alive for the capture so that no id is reused
        self._host_sources: dict[int, list[torch.Tensor]] = {}
        self._host_made: list[torch.Tensor] = []
        # the host tensors the module, the callbacks and the globals the step reads hold, by storage, with
        # their names (set by the caller): the step changing one in place is noted as a problem
        self.host_state: dict[int, str] = {}

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        """Let code compiled by ``torch.compile`` run compiled under this tracer.

        By default dynamo does not compile while a TorchDispatchMode is active: it runs the frame
        eagerly, and on the H200 a submodule the user compiled then ran as eager PyTorch ops in the
        traced warm-up steps and in the captured graph, so the fit left the plain (compiled) one in
        the last bits from the first update on (tests/gpu/test_callback_gpu.py, the compiled-submodule
        test). With this, the tracer sees the compiled region as a whole, not its ops: dynamo keeps
        host syncs out of compiled graphs (a graph break runs them eagerly, where they are traced), and
        the Python numbers that compiled code reads are compared before each replay like any other
        (l2lightning.guards.called_code).
        """
        return True

    @contextlib.contextmanager
    def watching_compiled_inputs(self, compiled: Sequence[tuple[str, torch.nn.Module]]) -> Iterator[None]:
        """Note host tensors that reach code compiled by ``torch.compile`` during the step.

        Compiled code runs as a whole under this tracer (:meth:`ignore_compile_internals`), so what it
        does with a host tensor is not seen, while a graph keeps the capture's: a 0-d CPU tensor
        becomes a number in the captured kernels' arguments, so a value that changes from step to step
        would be the capture's at every replay. Noted as a problem of the step: a host tensor passed
        into one of the `compiled` submodules (name, module) or held in its attributes, and, for any
        other compiled callable (a function the user compiled, a compiled module held elsewhere), one
        passed into it or read by the function from its globals, closure or defaults
        (:mod:`l2lightning.guards.compiled_calls`), naming the callable and the line of the call.
        """
        # the hooks run inside the compiled call, where dynamo would compile them too
        handles = [
            module.register_forward_pre_hook(
                never_compiled(self._compiled_input_check(name)), with_kwargs=True
            )
            for name, module in compiled
        ]
        hooked = {id(module) for _, module in compiled}
        hooked |= {id(module._orig_mod) for _, module in compiled if hasattr(module, "_orig_mod")}
        try:
            with watching_compiled_calls(functools.partial(self._check_compiled_call, hooked)):
                yield
        finally:
            for handle in handles:
                handle.remove()

    def _check_compiled_call(self, hooked: set[int], fn: Any, args: tuple, kwargs: dict) -> None:
        """A call of a compiled callable that the submodules' hooks do not see: its host tensors.

        Runs inside the user's call of compiled code: a failure of the check itself is noted as a
        problem of the step (which then trains eagerly), never raised into the user's call."""
        try:
            self._check_compiled_target(hooked, fn, args, kwargs)
        except Exception as exc:  # noqa: BLE001 -- see above
            self.trace.add_problem(
                f"a call of code compiled with torch.compile at {describe_frame(user_frame())} could not be "
                f"checked for host tensors ({type(exc).__name__}: {first_line(exc)}); what compiled code "
                "reads from a host tensor is not traced"
            )

    def _check_compiled_target(self, hooked: set[int], fn: Any, args: tuple, kwargs: dict) -> None:
        module, chain = compiled_target(fn)
        if module is not None:
            if id(module) not in hooked:  # a compiled module outside the module's own tree
                self._compiled_input_check(type(module).__name__)(module, args, kwargs)
            return
        if not chain:
            return
        name = getattr(chain[-1], "__qualname__", None) or repr(chain[-1])
        for wrapper in chain:  # what a `functools.partial` on the way binds is passed in too (outer first)
            bound_args, bound_kwargs = partial_arguments(wrapper)
            args, kwargs = (*bound_args, *args), {**bound_kwargs, **kwargs}
        leaves = self._note_host_arguments(name, args, kwargs)
        for leaf in leaves:
            held = self._host_tensor_attributes(leaf) if isinstance(leaf, torch.nn.Module) else []
            if held:
                self.trace.add_problem(
                    f"a module holding host tensors in attributes ({', '.join(f'`{a}`' for a in held)}) is "
                    f"passed into `{name}`, compiled with torch.compile, at {describe_frame(user_frame())}; "
                    "what compiled code reads from them is not traced, and a graph would keep the capture's "
                    "values: register them as buffers (`register_buffer`), which Lightning moves to the device"
                )
        read = sorted({n for function in chain for n in host_tensors_read_by(function, self.device_type)})
        if read:
            self.trace.add_problem(
                f"`{name}`, compiled with torch.compile, reads host tensors ({', '.join(f'`{n}`' for n in read)}) "
                "from its globals, closure or defaults; what compiled code reads from them is not traced, and "
                "a graph would keep the capture's values: move them to the device"
            )

    def _note_host_arguments(self, name: str, args: tuple, kwargs: dict) -> list[Any]:
        """Note a problem if a host tensor is among the arguments of compiled `name`; returns the leaves."""
        leaves, _ = tree_flatten((args, kwargs))
        if any(is_host_tensor(t, self.device_type) for t in leaves):
            self.trace.add_problem(
                f"a host tensor is passed into `{name}`, compiled with torch.compile, at "
                f"{describe_frame(user_frame())}; what compiled code reads from a host tensor is "
                "not traced, and a graph would keep the capture's values: move it to the device first"
            )
        return leaves

    def _compiled_input_check(self, name: str) -> Any:
        def check(module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
            self._note_host_arguments(name, args, kwargs)
            held = self._host_tensor_attributes(module)
            if held:
                self.trace.add_problem(
                    f"`{name}`, compiled with torch.compile, holds host tensors in attributes "
                    f"({', '.join(f'`{a}`' for a in held)}); what compiled code reads from them is not "
                    "traced, and a graph would keep the capture's values: register them as buffers "
                    "(`register_buffer`), which Lightning moves to the device"
                )

        return check

    def _host_tensor_attributes(self, module: torch.nn.Module) -> list[str]:
        """Plain tensor attributes (not parameters or buffers, which Lightning moves) on the host."""
        held = []
        for prefix, sub in module.named_modules():
            for attr, value in vars(sub).items():
                if is_host_tensor(value, self.device_type):
                    path = f"{prefix}.{attr}" if prefix else attr
                    held.append(path.removeprefix("_orig_mod."))  # torch.compile's wrapper: the user's names
        return held

    @contextlib.contextmanager
    def memoized(self) -> Iterator[None]:
        """Patch the MEMOIZED functions: record their results (trace) or return the recorded ones (capture)."""
        import importlib

        replacements = []
        for module_name, attr in MEMOIZED:
            module = importlib.import_module(module_name)
            replacements.append((module, attr, self._memoize(attr, getattr(module, attr))))
        with _replaced(replacements):
            yield

    @contextlib.contextmanager
    def watching_output(self, loggers: Sequence[Any] = ()) -> Iterator[None]:
        """Note what the step's own code writes out: ``print``, Python logging, the Trainer's loggers.

        A replay runs no Python, so such output would appear only in the warm-up and eager steps:
        every replayed step's line, histogram or metric would be missing, silently. Each call from
        the user's code (not from torch, Lightning or this package) is noted as a problem of the step,
        then made as usual.
        """
        import builtins
        import logging

        original_print = builtins.print

        def watched_print(*args: Any, **kwargs: Any) -> Any:
            self._note_output("`print`", _output_caller(sys._getframe(1)))
            return original_print(*args, **kwargs)

        original_log = logging.Logger._log

        def watched_log(logger: logging.Logger, *args: Any, **kwargs: Any) -> Any:
            self._note_output(f"logging to `{logger.name}`", _output_caller(sys._getframe(1)))
            return original_log(logger, *args, **kwargs)

        replacements = [(builtins, "print", watched_print), (logging.Logger, "_log", watched_log)]
        for logger in loggers:
            for name in ("log_metrics", "log_hyperparams", "log_graph"):
                method = getattr(logger, name, None)
                if callable(method):
                    what = f"`{type(logger).__name__}.{name}`"
                    replacements.append((logger, name, self._watched_logger_call(what, method)))
            cls = type(logger)
            prop = getattr(cls, "experiment", None)
            if isinstance(prop, property) and prop.fget is not None:
                watched = self._watched_logger_call(f"`{cls.__name__}.experiment`", prop.fget)
                replacements.append((cls, "experiment", property(watched)))
        with _replaced(replacements):
            yield

    def _watched_logger_call(self, what: str, original: Any) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            self._note_output(f"a write to the Trainer's logger ({what})", sys._getframe(1))
            return original(*args, **kwargs)

        return call

    def _note_output(self, what: str, caller: Any) -> None:
        """A problem for output the step's own code makes (`caller`: the frame that made the call)."""
        if caller is None or not _is_users_file(caller.f_code.co_filename):
            return  # an installed package's or the standard library's own messages (a warning once)
        problem = (
            f"{what} at {describe_frame((caller.f_code.co_filename, caller.f_lineno))} runs in the step; a "
            "replay runs no Python, so it would happen only in the warm-up and eager steps. Move it to "
            "`on_train_batch_end`, which runs after every replay, or under a condition on `batch_idx` or "
            "`self.global_step` (the steps it holds for run eagerly)"
        )
        self.trace.add_problem(problem)

    @contextlib.contextmanager
    def watching_seeds(self) -> Iterator[None]:
        """Patch torch's seeding functions to note each call inside the step as a problem, then seed."""
        import importlib

        replacements = []
        for module_name, attr in SEEDING:
            module = importlib.import_module(module_name)
            original = getattr(module, attr, None)
            if original is not None:
                replacements.append((module, attr, self._seeding(f"{module_name}.{attr}", original)))
        with _replaced(replacements):
            yield

    def _seeding(self, name: str, original: Any) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            if self._seeding_depth:  # inside another watched call (torch.manual_seed seeds CUDA too)
                return original(*args, **kwargs)
            called = _seeding_called_by_user(sys._getframe(1), name)
            if called is None:
                # activation checkpointing's recomputation puts the forward's state back (called from
                # checkpoint.py) and fork_rng then restores the one before it (called from random.py):
                # random ops in between redraw the forward's numbers
                caller = sys._getframe(1).f_code.co_filename
                self._recomputing_with_forward_rng = caller.endswith(_CHECKPOINT_FILE)
            problem = called and (
                f"`{called}` at {describe_frame(user_frame(2))} seeds torch's random generators (or "
                "puts back their state) inside the step; a replay runs no Python, so it would not do "
                "it again, and the step's random ops (dropout, `torch.rand`) would draw other numbers "
                "than in an eager step; seed once before `fit`"
            )
            if problem:
                self.trace.add_problem(problem)  # fork_rng puts back CPU and CUDA states: one problem
            self._seeding_depth += 1
            try:
                return original(*args, **kwargs)
            finally:
                self._seeding_depth -= 1

        return call

    def _memoize(self, name: str, original: Any) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            if self.constants is not None:  # capturing
                if not self._memo_replay or self._memo_replay[0][0] != name:
                    raise CaptureRefused(
                        f"torch's `{name}` ran in the captured step but not in the warm-up steps"
                    )
                return self._memo_replay.pop(0)[1]
            with self.paused():
                result = original(*args, **kwargs)
            self.trace.memo.append((name, result))
            return result

        return call

    @contextlib.contextmanager
    def hook(self, name: str) -> Iterator[None]:
        """Attribute what runs inside to the Lightning hook `name` (its syncs, its writes)."""
        previous, made = self._hook, self._hook_made
        self._hook, self._hook_made = name, set()
        try:
            yield
        finally:
            self._hook, self._hook_made = previous, made

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Ops inside are neither traced nor changed (Lightning's own logging machinery)."""
        self._paused += 1
        try:
            yield
        finally:
            self._paused -= 1

    @contextlib.contextmanager
    def watching(self, hook: str) -> Iterator[None]:
        """Paused, but reads of :attr:`parameter_storages` are still noted for `hook` (a hook that runs
        eagerly after each replay: it must keep reading only what a replay leaves as an eager step does)."""
        previous, self._watching = self._watching, hook
        try:
            with self.paused():
                yield
        finally:
            self._watching = previous

    # ------------------------------------------------------------------ dispatch
    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        try:
            return self._dispatch(func, args, kwargs or {})
        except torch.OutOfMemoryError as exc:
            # Kept for the caller: raised in backward on CUDA, it reached the fit as "SystemError: <built-in
            # method run_backward ...> returned NULL without setting an exception" (torch 2.11 on an H100,
            # benchmarks/results/h100/pytest_gpu_operands_manual_oom_check_rng.log), which names nothing
            self.out_of_memory = exc
            raise

    def real_error(self, exc: BaseException) -> BaseException:
        """`exc`, or the out-of-memory error an op raised where autograd's device thread turned it into
        a SystemError (see __torch_dispatch__). The tracer lets go of the error it kept: its traceback
        holds the failed step's tensors, which must not stay alive beside an eager step after it."""
        kept, self.out_of_memory = self.out_of_memory, None
        if isinstance(exc, SystemError) and kept is not None:
            return kept
        return exc

    def _dispatch(self, func: Any, args: tuple, kwargs: dict) -> Any:
        if self._paused:
            if self._watching is not None and self._reads_updated(tree_flatten((args, kwargs))[0]):
                self.trace.parameter_reading_hooks.add(self._watching)
            return func(*args, **kwargs)
        flat, _ = tree_flatten((args, kwargs))
        tensors = [a for a in flat if isinstance(a, torch.Tensor)]
        on_device = any(t.device.type == self.device_type for t in tensors)
        frame = user_frame(2)
        self.trace.read_ids.update(map(id, tensors))
        if (
            self.constants is not None
            and on_device
            and self.device_type in _STREAM_CAPTURED_DEVICES
            and current_stream_handle() != self._capture_stream
            and not stream_is_captured()
        ):
            raise CaptureRefused(
                f"`{_op_name(func)}` at {describe_frame(frame)} runs on a CUDA stream that takes no part in the "
                "capture (a `torch.cuda.stream(s)` block whose stream did not first wait on the step's stream): "
                "the graph would not record it and every replay would skip it. Let the stream wait first "
                "(`s.wait_stream(torch.cuda.current_stream())`) and the step's stream wait on it after, or "
                "drop the side stream"
            )
        sync = self._sync_reason(func, args, kwargs, tensors) if on_device else None
        if sync is not None:
            if self.constants is not None:
                raise CaptureRefused(
                    f"{sync} at {describe_frame(frame)} waits for the GPU inside the captured step"
                )
            if not _in_input_validation():
                self.trace.syncs.append((sync, frame, self._hook))
        if self.device_type in _STREAM_CAPTURED_DEVICES and draws_from_its_own_generator(
            func, args, kwargs, self.device_type
        ):
            self.trace.add_problem(
                f"`{_op_name(func)}` at {describe_frame(frame)} draws from a {self.device_type.upper()} generator "
                "of the step's own (`generator=`), which a CUDA graph cannot advance from one replay to the next "
                "(only the device's default generator is), so the step trains eagerly. Draw from the default "
                "generator (seeded by `torch.manual_seed`), or draw the numbers outside the step"
            )
        if draws_hidden_random_state(func, args, kwargs):
            self.trace.hidden_random.append(frame)
            dropout_state = cudnn_dropout_state(func, args, kwargs)
            if self.constants is not None and dropout_state is not None:
                # not marked written in the op's schema, but advanced by it: the graph holds it (a
                # re-seed elsewhere cannot free it under the graph) and the check saves and compares it
                storage = dropout_state.untyped_storage().data_ptr()
                self.external_writes.setdefault(storage, (dropout_state, frame))
        if self._recomputing_with_forward_rng and draws_random_numbers(func) and self.device_type != "cuda":
            # On CUDA the recomputation puts the forward's state back through the graph-safe generator
            # state, so a replay's backward redraws its own forward's masks: bitwise on the H200 with
            # torch 2.11 (benchmarks/probe_capture_idioms.py, `checkpoint_dropout`; the sampled check
            # compares such replays with the eager step too). Elsewhere nothing puts it back in a replay.
            problem = (
                f"`{_op_name(func)}` at {describe_frame(frame)} draws random numbers (dropout) inside a block "
                "that `torch.utils.checkpoint` recomputes with the forward's random state put back; outside "
                f"CUDA ({self.device_type}) a replay's recomputation would not draw its own forward's numbers "
                "again, so the step trains eagerly. Keep the dropout outside the checkpointed block, or pass "
                "`preserve_rng_state=False`"
            )
            self.trace.add_problem(problem)
        if self._hook is not None:
            self._note_hook_writes(func, args, kwargs)
            if self._reads_updated(tensors):
                self.trace.parameter_reading_hooks.add(self._hook)
            if func is aten.lift_fresh.default:
                self.trace.host_hooks.add(self._hook)
        if func is aten.lift_fresh.default and on_device and self.device_type != "cpu":
            self.trace.problems.append(
                f"a tensor built from host data directly on the GPU (`torch.tensor(..., device=...)`) at "
                f"{describe_frame(frame)}: its copy cannot be captured; build it on the CPU and `.to(device)` it, "
                "or once in __init__ as a buffer"
            )
        host_kind = self._host_constant_kind(func, args, kwargs, tensors, on_device)
        capturing_beside_host = self.constants is not None and self.device_type != "cpu"
        if capturing_beside_host and (
            on_device or host_kind is not None or (func in _SYNC_OPS and _called_from_users_code())
        ):
            # a device op, or the step's own code reading a host tensor's value (`.item()`, `float()`):
            # the graph keeps the value read now
            self._note_host_reads(tensors, frame)
        if self.constants is not None and host_kind is not None:
            return self._substitute(func, host_kind, args, kwargs, frame)
        if self.host_state and not on_device and self._hook is None:
            # (a hook's writes have their own judgement: it may run after each replay instead)
            self._check_host_writes(func, args, kwargs, frame)
        if self.constants is not None and on_device:
            self._note_external_writes(func, args, kwargs, frame)
        result = func(*args, **kwargs)
        if capturing_beside_host and not on_device and tensors:
            self._note_host_made(tensors, result)
        if self.device_type != "cpu" and not on_device and draws_on_the_host(func, args, kwargs, result):
            self.trace.host_draws.append((func._schema.name, frame))
        made = [
            r.untyped_storage().data_ptr()
            for r in tree_flatten(result)[0]
            if isinstance(r, torch.Tensor) and r.layout == torch.strided
        ]
        # a view of an input (`h.detach()`) is not the step's own result: its storage is the input's
        inputs = {t.untyped_storage().data_ptr() for t in tensors if t.layout == torch.strided}
        self.read_from_before.update(ptr for ptr in inputs if ptr not in self.made)
        self.made.update(ptr for ptr in made if ptr not in inputs)
        if self._hook is not None:
            self._hook_made.update(made)
        self.trace.ops.append((_op_name(func), self._signature(func, args, kwargs)))
        self.trace.frames.append(frame)
        self.trace.op_hooks.append(self._hook)
        if host_kind is not None:
            self._record_constants(host_kind, args, result, frame)
        return result

    def _note_host_reads(self, tensors: list[torch.Tensor], frame: tuple[str, int] | None) -> None:
        """Note each host tensor among `tensors`, or, for one a host op of the step made, the host
        tensors from before the step it was made of (the step makes it anew at every eager step)."""
        for t in tensors:
            if t.device.type != "cpu":
                continue
            for source in self._host_sources.get(id(t), (t,)):
                if id(source) not in self._host_read_ids:
                    self._host_read_ids.add(id(source))
                    self.host_reads.append(HostRead(source, source.detach().clone(), frame))

    def _note_host_made(self, inputs: list[torch.Tensor], result: Any) -> None:
        """A host op ran in the captured step: its host outputs come from its inputs' sources."""
        sources: dict[int, torch.Tensor] = {}
        for t in inputs:
            if t.device.type == "cpu":
                for source in self._host_sources.get(id(t), (t,)):
                    sources[id(source)] = source
        for r in tree_flatten(result)[0]:
            if isinstance(r, torch.Tensor) and r.device.type == "cpu" and id(r) not in sources:
                self._host_made.append(r)
                self._host_sources[id(r)] = list(sources.values())

    def _note_external_writes(
        self, func: Any, args: tuple, kwargs: dict, frame: tuple[str, int] | None
    ) -> None:
        for t in _written_tensors(func, args, kwargs):
            if t.device.type != self.device_type or t.layout != torch.strided:
                continue
            storage = t.untyped_storage().data_ptr()
            if storage not in self.made and storage not in self.external_writes:
                self.external_writes[storage] = (t, frame)

    def _check_host_writes(self, func: Any, args: tuple, kwargs: dict, frame: tuple[str, int] | None) -> None:
        """The step changing a host tensor of :attr:`host_state` in place: a replay runs only the
        device's work, so it would never change it again (and a graph reading it keeps the value of
        its capture)."""
        for t in _written_tensors(func, args, kwargs):
            if t.device.type != "cpu" or t.layout != torch.strided:
                continue
            name = self.host_state.get(t.untyped_storage().data_ptr())
            if name is not None:
                self.trace.add_problem(
                    f"{name}, a host (CPU) tensor, is changed in place by `{_op_name(func)}` at "
                    f"{describe_frame(frame)}; a replay runs only the GPU's work, so it would not change "
                    "it again: keep it on the device (`register_buffer`, which Lightning moves), or "
                    "change it in `on_train_batch_end`, which runs after every replay"
                )
                return

    def _reads_updated(self, values: list[Any]) -> bool:
        """Whether any tensor among `values` lives in :attr:`parameter_storages`."""
        return bool(self.parameter_storages) and any(
            isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() in self.parameter_storages
            for t in values
        )

    def _note_hook_writes(self, func: Any, args: tuple, kwargs: dict) -> None:
        for t in _written_tensors(func, args, kwargs):
            if t.untyped_storage().data_ptr() not in self._hook_made:
                self.trace.mutating_hooks.add(self._hook)

    def _sync_reason(self, func: Any, args: tuple, kwargs: dict, tensors: list[torch.Tensor]) -> str | None:
        if func in _SYNC_OPS:
            return {
                aten._local_scalar_dense.default: "reading a tensor's value on the host (`.item()`, `float()`, `print`, `if tensor:`)",
                aten.is_nonzero.default: "`bool(tensor)` (an `if` or `while` on a tensor)",
            }.get(func, f"`{_op_name(func)}` (its output size depends on the data)")
        if self.device_type == "cpu":
            return None  # training on the host: copies to it are not syncs
        if func is aten._to_copy.default:
            target = kwargs.get("device")
            if (
                target is not None
                and torch.device(target).type == "cpu"
                and args[0].device.type == self.device_type
            ):
                return "copying a tensor to the host (`.cpu()`, `.tolist()`, `.numpy()`)"
        if func is aten.copy_.default:
            dst, src = args[0], args[1]
            if dst.device.type == "cpu" and src.device.type == self.device_type:
                return "copying a tensor to the host"
        if func in _BOOL_INDEX_OPS:
            indices = args[1] if len(args) > 1 else ()
            if any(
                isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in indices or ()
            ) and not _fills_through_mask(func, args, kwargs):
                return "indexing with a boolean mask (`x[mask]`; use `torch.where`)"
        if func in _REPEAT_INTERLEAVE and kwargs.get("output_size") is None:
            return "`repeat_interleave` without `output_size`"
        return None

    def _host_constant_kind(
        self, func: Any, args: tuple, kwargs: dict, tensors: list[torch.Tensor], on_device: bool
    ) -> str | None:
        if self.device_type == "cpu":
            return None  # training on the host: nothing crosses to a device
        if func is aten._to_copy.default:
            target = kwargs.get("device")
            to_device = target is not None and torch.device(target).type == self.device_type
            return "to" if to_device and args[0].device.type == "cpu" else None
        if not on_device:
            return None
        if func is aten.copy_.default:
            return "copy" if args[1].device.type == "cpu" and args[1].dim() > 0 else None
        if any(t.device.type == "cpu" and t.dim() > 0 for t in tensors):
            return "arg"
        return None

    # ------------------------------------------------------------------ tracing
    def _signature(self, func: Any, args: tuple, kwargs: dict) -> tuple:
        """The op's arguments as compared between steps; random-number state (seeds, offsets) left out."""
        keys: list[Any] = []
        for i, schema_arg in enumerate(func._schema.arguments):
            value = args[i] if i < len(args) else kwargs.get(schema_arg.name)
            if schema_arg.name in _RNG_ARGUMENTS:
                keys.append("rng")
                continue
            flat, _ = tree_flatten(value)
            keys.extend(self._arg_key(v) for v in flat)
        return tuple(keys)

    def _arg_key(self, arg: Any) -> Any:
        if isinstance(arg, torch.Tensor):
            host = arg.device.type == "cpu" and self.device_type != "cpu"
            if host and arg.numel() <= _SMALL_HOST_NUMEL:
                return (
                    "host",
                    str(arg.dtype),
                    tuple(arg.shape),
                    tuple(_value_key(v) for v in arg.flatten().tolist()),
                )
            return (
                "hostbig" if host else "dev",
                arg.device.type,
                str(arg.dtype),
                tuple(arg.shape),
            )
        if isinstance(arg, (int, float, bool, str, type(None))):
            return _value_key(arg)
        if isinstance(arg, (torch.dtype, torch.device, torch.layout, torch.memory_format)):
            return str(arg)
        return type(arg).__name__

    def _record_constants(self, kind: str, args: tuple, result: Any, frame: tuple[str, int] | None) -> None:
        if kind == "to":
            out = result if isinstance(result, torch.Tensor) else None
            if out is None or out.device.type != self.device_type:
                return
            self.trace.constants.append(
                HostConstant("to", args[0].detach().clone(), out.detach().clone(), frame)
            )
        elif kind == "copy":
            self.trace.constants.append(HostConstant("copy", args[1].detach().clone(), None, frame))
        else:
            for t in _host_args(args):
                self.trace.constants.append(HostConstant("arg", t.detach().clone(), None, frame))

    # ------------------------------------------------------------------ capture
    def _next_constant(self, value: torch.Tensor, frame: tuple[str, int] | None) -> torch.Tensor:
        constants = self.constants
        if constants is None:
            raise RuntimeError("host constants are substituted only while capturing")
        i = constants.used
        if i >= len(constants.entries):
            raise CaptureRefused(
                f"a host tensor reaches the device at {describe_frame(frame)} in the captured step but not in "
                "the traced warm-up steps"
            )
        entry = constants.entries[i]
        if (
            entry.value.shape != value.shape
            or entry.value.dtype != value.dtype
            or not torch.equal(entry.value, value)
        ):
            raise CaptureRefused(
                f"the host tensor that reaches the device at {describe_frame(frame)} changed since the warm-up "
                "steps; a graph can only hold a constant one"
            )
        constants.sources[i] = value
        constants.used += 1
        return constants.device_copies[i]

    def _substitute(
        self, func: Any, kind: str, args: tuple, kwargs: dict, frame: tuple[str, int] | None
    ) -> Any:
        if kind == "to":
            # a fresh device tensor, as `.to(device)` gives, copied on the device from the constant
            return self._next_constant(args[0], frame).clone()
        if kind == "copy":
            dst, src = args[0], args[1]
            return dst.copy_(self._next_constant(src, frame))

        def swap(a: Any) -> Any:
            if isinstance(a, torch.Tensor) and a.device.type == "cpu" and a.dim() > 0:
                return self._next_constant(a, frame)
            return a

        return func(*tree_map(swap, args), **tree_map(swap, kwargs))


_DISTRIBUTION_CHECKS = frozenset({"__init__", "_validate_sample"})
_DISTRIBUTION_FILE = os.path.join("torch", "distributions", "distribution.py")


def _in_input_validation() -> bool:
    """Whether the caller is an input check that runs in eager steps and is switched off for a capture:
    torchmetrics' (``*_validation``) and torch.distributions' argument and sample checks
    (``Distribution.__init__``, ``_validate_sample``)."""
    frame = sys._getframe(2)
    while frame is not None:
        code = frame.f_code
        if code.co_name.endswith("_validation") and "/torchmetrics/" in code.co_filename:
            return True
        if code.co_name in _DISTRIBUTION_CHECKS and code.co_filename.endswith(_DISTRIBUTION_FILE):
            return True
        frame = frame.f_back
    return False


def _host_args(args: tuple) -> list[torch.Tensor]:
    flat, _ = tree_flatten(args)
    return [a for a in flat if isinstance(a, torch.Tensor) and a.device.type == "cpu" and a.dim() > 0]


def first_line(exc: BaseException) -> str:
    """The first line of an exception's message (at most 240 characters), for one-line warnings."""
    text = str(exc).strip()
    return text.splitlines()[0][:240] if text else type(exc).__name__
