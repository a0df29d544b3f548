"""Making optimizers safe to capture in a CUDA graph, with hyperparameters that stay live after capture.

A captured optimizer step bakes every Python number it reads into the graph. So:

* Adam, AdamW, Adadelta and RMSprop run with ``capturable=True`` and read their learning rate from a
  0-dim device tensor during each step (Adadelta and RMSprop on their foreach path only, see
  :func:`reads_tensor_lr`). The param groups keep the float LR, as without capture, so schedulers,
  the user's own code (``pg["lr"] = ...``), ``_last_lr`` and checkpoints all see exact Python
  floats; the step copies the float into the tensor when it changed (a device fill, no host sync)
  and swaps the tensor into the group only for the duration of the step. A replayed graph reads
  the tensor, so an LR change reaches it with no re-capture.
* SGD driven by an LR scheduler (every param group holds the ``initial_lr`` a PyTorch scheduler
  sets) runs its fused path from the switch on (``fused=True``, ``foreach=False``), whose kernel
  reads a tensor LR on the device (``torch._fused_sgd_``'s tensor-LR overload; the foreach and
  single-tensor paths pass ``alpha=-lr``, a host read). So StepLR, cosine and OneCycleLR on SGD
  keep one graph. Fused SGD rounds as foreach SGD may not: the fit equals its ``CapturableFrom``
  baseline, not plain Lightning, from the capture step on. SGD without a scheduler keeps its
  configuration and its float LR (bitwise plain), baked into the graph.
* Adagrad has no capturable mode; where its LR does not decay (``lr_decay=0``, the default) its
  step needs none: its counters move to the device and its one host read of them, for the decay,
  is answered without reading (:func:`_adagrad_step_count_unread`), every number unchanged.
* Every other hyperparameter (betas, eps, weight decay, Adagrad's LR, SGD's momentum, ...)
  is a float baked into the graph. :meth:`CapturableOptimizer.baked_changes` names the ones that changed
  since capture, so the caller can capture again before replaying.

Capturable Adam computes its bias corrections with device tensors instead of host floats, so it is
not bit-identical to the default ``capturable=False`` path. The callback therefore keeps the user's
own configuration until it captures: :func:`intercept` installs the step wrapper alone, and
:meth:`CapturableOptimizer.switch_on` makes the optimizer capturable at the capture step (and
:meth:`CapturableOptimizer.switch_off` gives the configuration back where a capture is given up), so
every step before it, and a whole fit the callback refuses, trains as plain Lightning does.
``make_capturable(optimizer)`` (capturable from the first step) and :class:`l2lightning.CapturableFrom`
(from a given step) give users the eager baselines for their own checks.
"""

from __future__ import annotations

import contextlib
import types
from collections.abc import Callable, Iterator
from itertools import chain
from operator import is_not
from typing import Any

import torch
from torch.optim import adagrad as torch_adagrad  # the module (torch.optim's namespace drops it)

from l2lightning.guards.step_values import addresses

# Optimizers whose step is known to capture, and whether they can read a tensor LR inside the graph.
# Adam/AdamW read a tensor LR on every path (single-tensor, foreach, fused) under capturable=True.
TENSOR_LR_TYPES: tuple[type, ...] = (torch.optim.Adam, torch.optim.AdamW)
# Adadelta and RMSprop read it only on their foreach path: their single-tensor path passes the LR as
# `alpha=-lr`, which turns a tensor into a host number (torch/optim/adadelta.py: "If LR is a tensor,
# the else branch will internally call item()"). PyTorch takes the foreach path for CUDA parameters
# unless the user asks for foreach=False or differentiable=True.
FOREACH_TENSOR_LR_TYPES: tuple[type, ...] = (torch.optim.Adadelta, torch.optim.RMSprop)
# SGD reads a tensor LR on its fused path only (see _sgd_reads_tensor_lr), else it bakes a float LR
# into the graph; so does Adagrad, which has no capturable mode but needs none where its LR does not
# decay (see _adagrad_step_count_unread).
FLOAT_LR_TYPES: tuple[type, ...] = (torch.optim.SGD, torch.optim.Adagrad)
# SGD's fused kernel takes these parameter dtypes (torch/optim/sgd.py, _get_fused_kernels_supported_devices)
_FUSED_SGD_DTYPES = frozenset({torch.float16, torch.bfloat16, torch.float32, torch.float64})
# Device types capturable optimizer states may live on (CPU tests widen this with the graph emulator).
CAPTURABLE_DEVICE_TYPES: tuple[str, ...] = ("cuda",)
# Param-group entries that are not hyperparameters of the update.
_NOT_HYPERPARAMETERS = frozenset({"params", "initial_lr", "name"})
# Attribute on the torch optimizer naming the CapturableOptimizer installed on it.
_INSTALLED = "_l2lightning_capturable"


class OptimizerNotCapturableError(TypeError):
    """The optimizer cannot run inside a CUDA graph."""


def reads_tensor_lr(optimizer: torch.optim.Optimizer) -> bool:
    """Whether `optimizer`'s capturable step reads its LR from a device tensor (so a scheduler's LR
    change reaches a replayed graph without a new capture)."""
    if isinstance(optimizer, TENSOR_LR_TYPES):
        return True
    if isinstance(optimizer, FOREACH_TENSOR_LR_TYPES):
        return all(
            g.get("foreach") is not False and not g.get("differentiable") for g in optimizer.param_groups
        )
    if isinstance(optimizer, torch.optim.SGD):
        return _sgd_reads_tensor_lr(optimizer)
    return False


def _sgd_reads_tensor_lr(optimizer: torch.optim.SGD) -> bool:
    """Whether SGD runs fused with a tensor LR once switched on: where a PyTorch LR scheduler drives
    every param group (it sets ``initial_lr``), so that its LR changes; the parameters are floats the
    fused kernel takes, and the step is not differentiable. Without a scheduler SGD keeps its own
    configuration, bitwise plain, and a baked LR."""
    groups = optimizer.param_groups
    return bool(groups) and all(
        "initial_lr" in g
        and not g.get("differentiable")
        and all(p.dtype in _FUSED_SGD_DTYPES and not p.is_sparse for p in g["params"])
        for g in groups
    )


def capture_support(optimizer: torch.optim.Optimizer) -> str | None:
    """None if `optimizer` can be captured, else a reason naming it."""
    name = type(optimizer).__name__
    if isinstance(optimizer, torch.optim.Adagrad):
        return _adagrad_support(optimizer)
    if isinstance(optimizer, TENSOR_LR_TYPES + FLOAT_LR_TYPES):
        return None
    if all("capturable" in group for group in optimizer.param_groups):
        return None
    return (
        f"optimizer {name} has no `capturable` mode, so its step cannot run inside a CUDA graph "
        "(supported: Adam, AdamW, SGD, Adagrad without `lr_decay`, and optimizers with a `capturable` option)"
    )


def _adagrad_support(optimizer: torch.optim.Optimizer) -> str | None:
    """None if this Adagrad's step can run inside a graph (see :func:`_adagrad_step_count_unread`)."""
    decaying = [i for i, g in enumerate(optimizer.param_groups) if g.get("lr_decay", 0) != 0]
    if decaying:
        return (
            f"Adagrad with `lr_decay` != 0 (param group {decaying[0]}) divides its learning rate by a number "
            "it reads from its step count on the host (`.item()`), which a CUDA graph cannot hold; "
            "`lr_decay=0` (the default) is captured"
        )
    if not hasattr(torch_adagrad, "_get_value"):
        return "this torch's Adagrad reads its step count in a way l2lightning does not know"
    return None


@contextlib.contextmanager
def _adagrad_step_count_unread(optimizer: torch.optim.Optimizer) -> Iterator[None]:
    """Adagrad's step without its host read of the step count, where its LR does not decay.

    torch's Adagrad reads each parameter's step count on the host (``_get_value(step_t)``, an
    ``.item()`` of a device counter once the counters live on the device) for one purpose: its
    learning rate ``lr / (1 + (step - 1) * lr_decay)``. With ``lr_decay == 0`` that is ``lr / 1.0``
    whatever the count, so answering 1 instead of reading it leaves every number of the step as it
    was, and the step, counters included (``step_t += 1`` on the device), runs inside a graph. The
    read is answered only during this optimizer's step; with a decaying LR nothing is changed (the
    capture then fails on the read and the step trains eagerly).
    """
    module = torch_adagrad
    if not isinstance(optimizer, torch.optim.Adagrad) or _adagrad_support(optimizer) is not None:
        yield
        return
    original = module._get_value
    module._get_value = lambda step: 1.0
    try:
        yield
    finally:
        module._get_value = original


_MISSING = object()  # a key a param group no longer has


class CapturableOptimizer:
    """An optimizer switched to capturable mode by :func:`make_capturable`, and how to undo it.

    Attributes:
        optimizer: the torch optimizer (its ``step`` is wrapped while this object is installed).
        tensor_lr: whether the step reads its LR from device tensors (see :func:`reads_tensor_lr`).
        lr_tensors: per param group, the device tensor the step reads, or None (a float LR).
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        tensor_lr: bool,
        original_capturable: list[Any],
        lr_tensors: list[torch.Tensor | None] | None = None,
        device: torch.device | None = None,
    ) -> None:
        self.optimizer = optimizer
        self.device = device if device is not None else _params_device(optimizer)
        # whether the capturable configuration is on (switch_on); off, steps run the user's configuration
        self.switched = lr_tensors is not None
        self.tensor_lr = tensor_lr
        self.original_capturable = list(original_capturable)
        # SGD reads its tensor LR on the fused path only: switched on, its groups run fused, and
        # each group's own (fused, foreach) flags are kept here to be given back
        self._fused_for_lr = tensor_lr and isinstance(optimizer, torch.optim.SGD)
        self.original_paths: list[tuple[Any, Any] | None] = [None] * len(optimizer.param_groups)
        self.lr_tensors: list[torch.Tensor | None] = (
            list(lr_tensors) if lr_tensors is not None else [None] * len(optimizer.param_groups)
        )
        # the float each LR tensor holds, so a step fills it only when the group's LR moved
        self._filled: list[Any] = [
            g.get("lr") if t is not None else None for g, t in zip(optimizer.param_groups, self.lr_tensors)
        ]
        self._frozen = False
        self._released = False
        self._baked: list[dict[str, Any]] = []
        # During a step (tensor_hyperparameters): per group, its hyperparameters and its LR tensor's
        # version as the step found them, to see what the step's own code wrote (hyperparameter_writes)
        self._entry: list[tuple[dict[str, Any], int | None]] | None = None
        # Called as handler(run, closure, kwargs) instead of the step when set (L2GraphCallback's capture/replay).
        self.handler: Callable[[Callable[..., Any], Any, dict], Any] | None = None
        self._inner_step: Callable[..., Any] | None = None
        self._had_instance_step = False
        self._previous_step: Any = None

    # ------------------------------------------------------------------ the step
    def install(self) -> None:
        """Wrap ``optimizer.step`` (an instance attribute, so schedulers' own wrappers stay inside)."""
        if self._inner_step is not None:
            return
        opt = self.optimizer
        self._had_instance_step = "step" in vars(opt)
        self._previous_step = vars(opt).get("step")
        self._inner_step = opt.step

        def step(_opt: Any, closure: Callable[[], Any] | None = None, **kwargs: Any) -> Any:
            return self._step(closure, **kwargs)

        # LR schedulers warn unless optimizer.step carries the marker their own wrapper sets
        if hasattr(self._inner_step, "_wrapped_by_lr_sched"):
            step._wrapped_by_lr_sched = True  # type: ignore[attr-defined]
        # A bound method, as optimizer.step is: a scheduler made later in the fit (Lightning's
        # StochasticWeightAveraging makes SWALR at its first epoch) wraps it through `step.__func__`
        opt.step = types.MethodType(step, opt)  # type: ignore[method-assign]
        setattr(opt, _INSTALLED, self)

    def uninstall(self) -> None:
        """Remove the wrapper installed by :meth:`install`."""
        if self._inner_step is None:
            return
        opt = self.optimizer
        if self._had_instance_step:
            opt.step = self._previous_step  # type: ignore[method-assign]
        elif "step" in vars(opt):
            del opt.step
        if getattr(opt, _INSTALLED, None) is self:
            delattr(opt, _INSTALLED)
        self._inner_step = None

    @property
    def inner_step(self) -> Callable[..., Any]:
        """The optimizer's own step (with the schedulers' wrappers), without the tensor-LR swap."""
        return self._inner_step if self._inner_step is not None else self.optimizer.step

    def _step(self, closure: Callable[[], Any] | None = None, **kwargs: Any) -> Any:
        if len(self.optimizer.param_groups) > len(self.lr_tensors):
            self.adopt_new_groups()
        if self.handler is not None:
            return self.handler(self.run, closure, kwargs)
        return self.run(closure, **kwargs)

    def run(self, closure: Callable[[], Any] | None = None, **kwargs: Any) -> Any:
        """One eager step of the optimizer with its LR tensors in place (as configured, once released)."""
        inner = self.inner_step
        if self._released:
            return inner(closure, **kwargs)
        counts = _adagrad_step_count_unread(self.optimizer) if self.switched else contextlib.nullcontext()
        with self.tensor_hyperparameters(), counts:  # switched off: only what the step's code writes is noted
            return inner(closure, **kwargs)

    def adopt_new_groups(self) -> None:
        """Make param groups added since :func:`make_capturable` capturable as it made the first ones.

        Fine-tuning callbacks add groups mid-fit (Lightning's ``BaseFinetuning``
        ``unfreeze_and_add_param_group``, through ``optimizer.add_param_group``), which gives them the
        optimizer's defaults: ``capturable=False``, whose step reads its counters on the host and so
        cannot be captured. Adopted before their first step, they run as the first groups do, here and
        in a ``make_capturable`` baseline alike, and :meth:`release` gives them their own flag back.
        """
        for group in self.optimizer.param_groups[len(self.lr_tensors) :]:
            self.original_capturable.append(group.get("capturable"))
            self.original_paths.append(None)
            tensor = _make_group_capturable(group, self.tensor_lr, self.device) if self.switched else None
            if self.switched:
                self._take_fused_path(len(self.lr_tensors), group)
            self.lr_tensors.append(tensor)
            self._filled.append(group.get("lr") if tensor is not None else None)

    def _take_fused_path(self, index: int, group: dict[str, Any]) -> None:
        """SGD with a tensor LR: group `index` runs fused (its own flags kept to be given back)."""
        if not self._fused_for_lr:
            return
        while len(self.original_paths) <= index:
            self.original_paths.append(None)
        if self.original_paths[index] is None:
            self.original_paths[index] = (group.get("fused"), group.get("foreach"))
        group["fused"], group["foreach"] = True, False

    def _give_back_paths(self, groups: list[dict[str, Any]]) -> None:
        """The (fused, foreach) flags each group had before :meth:`_take_fused_path`, in `groups`."""
        for group, original in zip(groups, self.original_paths):
            if original is not None:
                group["fused"], group["foreach"] = original

    def switch_on(self) -> None:
        """Make the optimizer capturable (see :func:`make_capturable`); a no-op when it already is.

        Sets ``capturable=True`` where the optimizer has the option, moves ``step`` state to the
        parameters' device (exact: the counters are whole numbers) and, where :func:`reads_tensor_lr`
        holds, gives each group the device tensor its step reads the learning rate from.
        """
        if self.switched:
            return
        self.switched = True
        self.lr_tensors = [
            _make_group_capturable(g, self.tensor_lr, self.device) for g in self.optimizer.param_groups
        ]
        for i, group in enumerate(self.optimizer.param_groups):
            self._take_fused_path(i, group)
        self._filled = [
            g.get("lr") if t is not None else None
            for g, t in zip(self.optimizer.param_groups, self.lr_tensors)
        ]
        for group in self.optimizer.param_groups:
            for p in group["params"]:
                state = self.optimizer.state.get(p, {})
                step = state.get("step")
                if isinstance(step, torch.Tensor) and step.device != p.device:
                    state["step"] = step.to(p.device)
        self.mark_captured()

    def switch_off(self) -> None:
        """Give the optimizer the user's configuration back (``capturable`` flags, step counters where
        the optimizer keeps them, float learning rates); the step wrapper stays installed."""
        if not self.switched:
            return
        self.switched = False
        for i, (group, original) in enumerate(zip(self.optimizer.param_groups, self.original_capturable)):
            if "capturable" in group:
                group["capturable"] = original
            tensor = self.lr_tensors[i] if i < len(self.lr_tensors) else None
            if tensor is not None and group.get("lr") is tensor:  # switched off in the middle of a step
                group["lr"] = self._lr_now(i, self._filled[i])
        self._give_back_paths(self.optimizer.param_groups)
        self.original_paths = [None] * len(self.optimizer.param_groups)
        self.lr_tensors = [None] * len(self.optimizer.param_groups)
        self._filled = [None] * len(self.optimizer.param_groups)
        if not self._steps_stay_on_device():
            for state in self.optimizer.state.values():
                step = state.get("step")
                if isinstance(step, torch.Tensor) and step.device.type != "cpu":
                    state["step"] = step.detach().to("cpu", copy=True)

    def sync_tensors(self) -> None:
        """Copy each group's float LR into its device tensor where it changed (a fill, no host sync)."""
        for i, (group, tensor) in enumerate(zip(self.optimizer.param_groups, self.lr_tensors)):
            if tensor is None:
                continue
            value = group["lr"]
            if value is tensor or value == self._filled[i]:
                continue
            if isinstance(value, torch.Tensor):  # someone put a tensor of their own there
                raise TypeError(
                    f"param group {i}'s `lr` was replaced by a tensor after make_capturable; set a float "
                    "(schedulers and `pg['lr'] = value` both work)"
                )
            if self._frozen:
                raise RuntimeError(
                    f"param group {i}'s learning rate changed inside a captured step ({self._filled[i]} -> "
                    f"{value}); change it outside `optimizer.step`, e.g. in `optimizer_step` after the step"
                )
            tensor.fill_(float(value))
            self._filled[i] = value

    def tensor_hyperparameters(self) -> _TensorHyperparameters:
        """Context: the groups hold the LR tensors (filled from their floats), then the floats again."""
        return _TensorHyperparameters(self)

    def hyperparameter_writes(self) -> list[str]:
        """What the code run so far inside this step (the closure: ``training_step`` and its hooks)
        changed of the param groups' hyperparameters: an LR assigned, an LR tensor written in place (a
        PyTorch LR scheduler stepped inside the step fills it), another hyperparameter replaced.

        A replay runs no Python, so such a change would happen at the capture only; the callback
        refuses the capture for it. Empty outside a step.
        """
        if self._entry is None:
            return []
        writes = []
        for i, (group, (entry, version)) in enumerate(zip(self.optimizer.param_groups, self._entry)):
            tensor = self.lr_tensors[i] if i < len(self.lr_tensors) else None
            for key, was in entry.items():
                now = group.get(key, _MISSING)
                if key == "lr" and tensor is not None and was is tensor:
                    if now is not tensor:
                        writes.append(f"param group {i}'s `lr` (assigned)")
                    elif tensor._version != version:
                        writes.append(
                            f"param group {i}'s `lr` (written in place, as an LR scheduler's step does)"
                        )
                elif now is not was and not (isinstance(was, (int, float, bool, str, tuple)) and now == was):
                    writes.append(f"param group {i}'s `{key}`")
        return writes

    def _lr_now(self, i: int, saved: Any) -> Any:
        """The float for group `i` once its LR tensor leaves the group: `saved` (what the group held),
        or, when the step's code wrote the tensor in place (an LR scheduler stepped inside the step),
        the value it wrote, read back (a host sync; never inside a capture)."""
        tensor = self.lr_tensors[i]
        entry = self._entry[i] if self._entry is not None and i < len(self._entry) else None
        if entry is None or tensor is None or tensor._version == entry[1] or self._frozen:
            return saved
        value = float(tensor.item())
        self._filled[i] = value
        return value

    def freeze(self, frozen: bool) -> None:
        """While frozen (a capture), an LR change raises instead of filling a tensor inside the graph."""
        self._frozen = frozen

    # ------------------------------------------------------------------ baked hyperparameters
    def mark_captured(self) -> None:
        """Remember the hyperparameters a capture bakes into its graph, and the state it updates."""
        self._baked = [self._baked_values(i, g) for i, g in enumerate(self.optimizer.param_groups)]
        state = self.optimizer.state
        entries = tuple(state.values())
        values = _state_values(entries)
        tensors = tuple(v for v in values if isinstance(v, torch.Tensor))
        self._captured_state = (state, len(state), entries, values, tensors, addresses(tensors))

    def state_replaced(self) -> str | None:
        """Why the optimizer's state is not the one the graph was captured with, or None.

        The graph updates the state tensors it was captured with (moments, momentum buffers), so a
        state replaced between steps (``load_state_dict``) or emptied (``optimizer.state.clear()``, a
        momentum reset), one parameter's entry replaced (``optimizer.state[p] = {}``) or one tensor in
        it (``optimizer.state[p]["exp_avg"] = torch.zeros_like(p)``) or given other memory under the
        same object (``exp_avg.data = ...``, ``set_``) would be ignored by a replay, which then trains
        on from the old memory. Every entry and every value is compared by identity, mapped in C, and
        every tensor value by the address of its memory: a few comparisons per state value per step.
        """
        captured = getattr(self, "_captured_state", None)
        if captured is None:
            return None
        state, size, entries, values, tensors, memory = captured
        if self.optimizer.state is not state:
            return "the optimizer's state was replaced (`load_state_dict`)"
        if len(state) != size:
            return f"the optimizer's state has {len(state)} entries, the graph updates {size}"
        if any(map(is_not, state.values(), entries)):
            return "a parameter's entry in the optimizer's state was replaced (`optimizer.state[p] = ...`)"
        now = _state_values(entries)
        if len(now) != len(values) or any(map(is_not, now, values)):
            return (
                "a value in the optimizer's state was replaced or added (`optimizer.state[p][key] = ...`; "
                "update tensors in place, `.zero_()`, to keep one graph)"
            )
        # the values are the captured objects (checked above): their memory, read in C
        if addresses(tensors) != memory:
            return (
                "a tensor in the optimizer's state was given other memory (`.data = ...`, `set_`; "
                "update it in place, `.copy_()`, to keep one graph)"
            )
        return None

    def _baked_values(self, index: int, group: dict[str, Any]) -> dict[str, Any]:
        # the LR a capturable step reads from a tensor is not baked, whether switched on yet or not
        return {
            key: value
            for key, value in group.items()
            if key not in _NOT_HYPERPARAMETERS
            and not isinstance(value, torch.Tensor)
            and not (key == "lr" and self.tensor_lr)
        }

    def baked_changes(self) -> list[str]:
        """``"group i: key a -> b"`` for each hyperparameter baked into the graph that changed since capture."""
        groups = self.optimizer.param_groups
        if len(groups) != len(self._baked):
            return [
                f"the optimizer has {len(groups)} param groups, the graph was captured with {len(self._baked)}"
            ]
        changes = []
        for i, (group, baked) in enumerate(zip(groups, self._baked)):
            for key, value in baked.items():
                now = group.get(key)
                if now is not value and now != value:
                    changes.append(f"group {i} `{key}` {value!r} -> {now!r}")
        return changes

    def baked_snapshot(self) -> list[dict[str, Any]]:
        """The baked hyperparameters as they are now (to compare warm-up steps with each other)."""
        return [self._baked_values(i, g) for i, g in enumerate(self.optimizer.param_groups)]

    # ------------------------------------------------------------------ undoing
    def portable_state_dict(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        """A copy of `state_dict` as the optimizer would save it without capture (original flags, CPU steps)."""
        groups = []
        for group, original in zip(state_dict["param_groups"], self.original_capturable):
            group = dict(group)
            if isinstance(group.get("lr"), torch.Tensor):
                group["lr"] = float(group["lr"])
            if "capturable" in group:
                group["capturable"] = original
            groups.append(group)
        self._give_back_paths(groups)
        state = {}
        for key, value in state_dict["state"].items():
            value = dict(value)
            step = value.get("step")
            if isinstance(step, torch.Tensor) and not self._steps_stay_on_device():
                value["step"] = step.detach().to("cpu", copy=True)
            state[key] = value
        return {**state_dict, "state": state, "param_groups": groups}

    def release(self) -> torch.optim.Optimizer:
        """Undo :func:`make_capturable` in place: the step wrapper, ``capturable`` flags, step counters.

        The learning rates were floats all along. Step counters go back to the CPU where the
        optimizer keeps them without capture (unless it was capturable or fused); see
        :meth:`switch_off`. Returns the optimizer.
        """
        self.switch_off()
        self.uninstall()
        self._released = True
        self.handler = None
        return self.optimizer

    def _steps_stay_on_device(self) -> bool:
        """Capturable or fused optimizers keep their step counters on the device, as PyTorch does."""
        return any(self.original_capturable) or _fused(self.optimizer)


class _TensorHyperparameters:
    """See :meth:`CapturableOptimizer.tensor_hyperparameters`."""

    def __init__(self, owner: CapturableOptimizer) -> None:
        self.owner = owner
        self.saved: list[Any] = []

    def __enter__(self) -> None:
        owner = self.owner
        owner.sync_tensors()
        self.saved = []
        for group, tensor in zip(owner.optimizer.param_groups, owner.lr_tensors):
            self.saved.append(group.get("lr"))
            if tensor is not None:
                group["lr"] = tensor
        owner._entry = [
            (
                {k: v for k, v in group.items() if k != "params"},
                tensor._version if tensor is not None else None,
            )
            for group, tensor in zip(owner.optimizer.param_groups, owner.lr_tensors)
        ]

    def __exit__(self, *exc: Any) -> None:
        owner = self.owner
        for i, (group, tensor, saved) in enumerate(
            zip(owner.optimizer.param_groups, owner.lr_tensors, self.saved)
        ):
            # a float the step's closure set stays (it is the user's); our tensor goes back to the
            # float, or to what the step's code wrote into it
            if tensor is not None and group.get("lr") is tensor:
                group["lr"] = owner._lr_now(i, saved)
        owner._entry = None


def _fused(optimizer: torch.optim.Optimizer) -> bool:
    return any(bool(g.get("fused")) for g in optimizer.param_groups)


def make_capturable(
    optimizer: torch.optim.Optimizer, device: torch.device | None = None
) -> CapturableOptimizer:
    """Switch `optimizer` to capturable mode before its first captured step.

    Sets ``capturable=True`` where the optimizer has the option, moves existing ``step`` state to
    the parameters' device (capturable steps live there), and where :func:`reads_tensor_lr` holds
    makes each step read its learning rate from a 0-dim float32 tensor on `device` that follows the
    param group's float (see the module docstring). Applied in ``configure_optimizers``, every step
    of the fit runs the capturable configuration (the callback then keeps it from the first step
    too); :class:`l2lightning.CapturableFrom` switches at a given step instead, which is the eager
    reference of a fit the callback captures at that step.

    Raises:
        OptimizerNotCapturableError: the optimizer has no capturable mode (the message names it).
        ValueError: the parameters are not on a CUDA device.
    """
    existing = installed_capturable(optimizer)
    if existing is not None:
        existing.switch_on()  # already wrapped: a second wrapper would swap tensors into tensors
        return existing
    wrapped = intercept(optimizer, device)
    wrapped.switch_on()
    return wrapped


def intercept(optimizer: torch.optim.Optimizer, device: torch.device | None = None) -> CapturableOptimizer:
    """Install the step wrapper of :class:`CapturableOptimizer` on `optimizer`, its configuration as it is.

    Steps go through :attr:`CapturableOptimizer.handler` (the callback's capture and replay) and run
    the user's configuration until :meth:`CapturableOptimizer.switch_on`.

    Raises:
        OptimizerNotCapturableError: the optimizer has no capturable mode (the message names it).
        ValueError: the parameters are not on a CUDA device.
    """
    existing = installed_capturable(optimizer)
    if existing is not None:
        return existing
    reason = capture_support(optimizer)
    if reason:
        raise OptimizerNotCapturableError(reason)
    if device is None:
        device = _params_device(optimizer)
    if device.type not in CAPTURABLE_DEVICE_TYPES:
        raise ValueError(
            f"capturable optimizers need CUDA parameters; `optimizer`'s parameters are on {device}"
        )
    original = [g.get("capturable") for g in optimizer.param_groups]
    wrapped = CapturableOptimizer(optimizer, reads_tensor_lr(optimizer), original, device=device)
    wrapped.install()
    return wrapped


def _params_device(optimizer: torch.optim.Optimizer) -> torch.device:
    """The device of the optimizer's first parameter (the CPU for an optimizer without any)."""
    return next((p.device for g in optimizer.param_groups for p in g["params"]), torch.device("cpu"))


def _make_group_capturable(
    group: dict[str, Any], tensor_lr: bool, device: torch.device
) -> torch.Tensor | None:
    """Switch one param group to capturable mode; return the LR tensor on `device` its step reads, or
    None where it reads the float (`tensor_lr` false, or an LR that already is a tensor)."""
    if "capturable" in group:
        group["capturable"] = True
    lr = group.get("lr")
    if tensor_lr and not isinstance(lr, torch.Tensor):
        return torch.tensor(float(lr), dtype=torch.float32, device=device)
    return None


def installed_capturable(optimizer: torch.optim.Optimizer) -> CapturableOptimizer | None:
    """The :class:`CapturableOptimizer` that :func:`make_capturable` installed on `optimizer`, if any."""
    existing = getattr(optimizer, _INSTALLED, None)
    return (
        existing if isinstance(existing, CapturableOptimizer) and existing._inner_step is not None else None
    )


def _state_values(entries: tuple) -> tuple:
    """Every value of every per-parameter state entry, in order (the objects, compared by identity)."""
    return tuple(chain.from_iterable(map(dict.values, entries)))


def baked_schedule_advice(changed: list[str]) -> str:
    """What keeps one graph when a per-step schedule changes the baked hyperparameters `changed`."""
    advice = []
    if "lr" in changed:
        advice.append("use Adam or AdamW (their learning rate is read from a tensor)")
    if {"betas", "momentum"} & set(changed):
        # OneCycleLR and CyclicLR cycle the momentum (Adam's beta1) unless told not to
        advice.append(
            "pass `cycle_momentum=False` to OneCycleLR or CyclicLR (it cycles the momentum by default)"
        )
    advice.append("step the schedule per epoch")
    if len(advice) == 1:
        text = advice[0]
    elif len(advice) == 2:
        text = " or ".join(advice)
    else:
        text = ", ".join(advice[:-1]) + ", or " + advice[-1]
    return text[0].upper() + text[1:]
