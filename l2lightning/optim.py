"""Making optimizers safe to capture in a CUDA graph, and keeping a captured learning rate current.

Adam and AdamW read a tensor learning rate when `capturable=True`, so a scheduler's in-place update
(`torch.optim.lr_scheduler` fills tensor LRs in place) reaches the graph with no re-capture. SGD
and others bake the float LR into the graph: a change is detected before replay and re-captured.

Capturable Adam computes its bias corrections (and, with a tensor LR, its decoupled weight decay)
with device tensors instead of host floats, so it is not bit-identical to the default
`capturable=False` path. Equivalence is therefore promised against an eager run of the *same*
configuration: `make_capturable(optimizer)` gives users that baseline for their own checks.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

# Optimizers whose step is known to capture, and whether they can read a tensor LR inside the graph.
TENSOR_LR_TYPES: tuple[type, ...] = (torch.optim.Adam, torch.optim.AdamW)
FLOAT_LR_TYPES: tuple[type, ...] = (torch.optim.SGD,)


class OptimizerNotCapturableError(TypeError):
    """The optimizer cannot run inside a CUDA graph."""


def capture_support(optimizer: torch.optim.Optimizer) -> str | None:
    """None if `optimizer` can be captured, else a reason naming it."""
    name = type(optimizer).__name__
    if isinstance(optimizer, TENSOR_LR_TYPES + FLOAT_LR_TYPES):
        return None
    if all("capturable" in group for group in optimizer.param_groups):
        return None
    return (
        f"optimizer {name} has no `capturable` mode, so its step cannot run inside a CUDA graph "
        "(supported: Adam, AdamW, SGD, and optimizers with a `capturable` option)"
    )


@dataclass
class CapturableOptimizer:
    """An optimizer switched to capturable mode, with what is needed to undo it for checkpoints."""

    optimizer: torch.optim.Optimizer
    tensor_lr: bool
    original_capturable: list[Any] = field(default_factory=list)
    captured_lrs: list[float] = field(default_factory=list)
    # the param groups' LRs before make_capturable turned them into tensors (for release())
    configured_lrs: list[Any] = field(default_factory=list)

    def lr_changed_since_capture(self) -> bool:
        """True when a float LR baked into the graph no longer matches the param group (re-capture)."""
        if self.tensor_lr:
            return False
        return [float(g["lr"]) for g in self.optimizer.param_groups] != self.captured_lrs

    def mark_captured(self) -> None:
        self.captured_lrs = [float(_scalar(g["lr"])) for g in self.optimizer.param_groups]

    def portable_state_dict(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        """A copy of `state_dict` as the optimizer would save it without capture (float LR, CPU steps)."""
        groups = []
        for group, original in zip(state_dict["param_groups"], self.original_capturable):
            group = dict(group)
            _plain_group(group, original, configured_lr=None)
            groups.append(group)
        state = {}
        for key, value in state_dict["state"].items():
            value = dict(value)
            step = value.get("step")
            if isinstance(step, torch.Tensor) and not self._steps_stay_on_device():
                value["step"] = step.detach().to("cpu", copy=True)
            state[key] = value
        return {**state_dict, "state": state, "param_groups": groups}

    def release(self) -> torch.optim.Optimizer:
        """Undo :func:`make_capturable` in place, for a fit that will not capture after all.

        The configured float LRs come back (where nothing has moved them since), the original
        ``capturable`` flags, and step counters where the optimizer keeps them without capture (on
        the CPU unless it was capturable or fused). Returns the optimizer.
        """
        groups = self.optimizer.param_groups
        configured = list(self.configured_lrs) + [None] * len(groups)
        for group, original, lr in zip(groups, self.original_capturable, configured):
            _plain_group(group, original, configured_lr=lr)
        if not self._steps_stay_on_device():
            for state in self.optimizer.state.values():
                step = state.get("step")
                if isinstance(step, torch.Tensor) and step.device.type != "cpu":
                    state["step"] = step.detach().to("cpu", copy=True)
        return self.optimizer

    def _steps_stay_on_device(self) -> bool:
        """Capturable or fused optimizers keep their step counters on the device, as PyTorch does."""
        return any(self.original_capturable) or _fused(self.optimizer)


def _plain_group(group: dict[str, Any], original_capturable: Any, configured_lr: Any) -> None:
    """Turn a param-group dict back to its non-capturable form, in place.

    A tensor LR becomes `configured_lr` when that float still rounds to the tensor's float32 value
    (nothing has moved the LR since), else the tensor's value as a float.
    """
    lr = group.get("lr")
    if isinstance(lr, torch.Tensor):
        value = float(lr)
        unchanged = (
            isinstance(configured_lr, float)
            and float(torch.tensor(configured_lr, dtype=torch.float32)) == value
        )
        group["lr"] = configured_lr if unchanged else value
    if "capturable" in group:
        group["capturable"] = original_capturable


def _fused(optimizer: torch.optim.Optimizer) -> bool:
    return any(bool(g.get("fused")) for g in optimizer.param_groups)


def _scalar(value: Any) -> float:
    return float(value.item()) if isinstance(value, torch.Tensor) else float(value)


def make_capturable(
    optimizer: torch.optim.Optimizer, device: torch.device | None = None
) -> CapturableOptimizer:
    """Switch `optimizer` to capturable mode before its first captured step.

    Sets ``capturable=True`` where the optimizer has the option, moves existing ``step`` state to
    the parameters' device (capturable steps live there), and for Adam/AdamW turns each group's
    float LR into a 0-dim float32 tensor on `device`, so LR schedulers update it in place.

    Raises:
        OptimizerNotCapturableError: the optimizer has no capturable mode (the message names it).
    """
    reason = capture_support(optimizer)
    if reason:
        raise OptimizerNotCapturableError(reason)
    if device is None:
        device = next((p.device for g in optimizer.param_groups for p in g["params"]), torch.device("cpu"))
    if device.type != "cuda":
        raise ValueError(
            f"capturable optimizers need CUDA parameters; `optimizer`'s parameters are on {device}"
        )
    original = [g.get("capturable") for g in optimizer.param_groups]
    configured_lrs = [g.get("lr") for g in optimizer.param_groups]
    tensor_lr = isinstance(optimizer, TENSOR_LR_TYPES)
    for group in optimizer.param_groups:
        if "capturable" in group:
            group["capturable"] = True
        if tensor_lr and not isinstance(group["lr"], torch.Tensor):
            group["lr"] = torch.tensor(float(group["lr"]), dtype=torch.float32, device=device)
        for p in group["params"]:
            state = optimizer.state.get(p, {})
            step = state.get("step")
            if isinstance(step, torch.Tensor) and step.device != p.device:
                state["step"] = step.to(p.device)
    wrapped = CapturableOptimizer(optimizer, tensor_lr, original, configured_lrs=configured_lrs)
    wrapped.mark_captured()
    return wrapped
