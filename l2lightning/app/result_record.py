"""What a training run leaves behind: result.json's values, the printed summary line, the headline metrics.

The record outlives the run: sweeps collect it into tables (:mod:`l2lightning.app.sweep_summary`)
and users compare runs by it, so it must be plain JSON (no tensors, no non-finite floats), and the
line printed at the end of a run must say from it, in one line, what ran and how fast.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import lightning.pytorch as pl
import torch

from l2lightning.app.fit_timing import steps_text

RESULT_FILE = "result.json"


def jsonable(value: Any) -> Any:
    """`value` as plain JSON: dataclass-like objects through `to_dict`, non-finite floats as strings."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        return jsonable(float(value))
    if isinstance(value, Mapping):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    if hasattr(value, "to_dict"):
        return jsonable(value.to_dict())
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return str(value)


def scalar_metrics(metrics: Mapping[str, Any]) -> dict[str, float]:
    """The one-number entries of a Trainer's metrics, as floats, sorted by name."""
    return {
        key: float(value)
        for key, value in sorted(metrics.items())
        if isinstance(value, (int, float)) or (isinstance(value, torch.Tensor) and value.numel() == 1)
    }


def device_name(trainer: pl.Trainer) -> str:
    """The GPU's name for a CUDA run, else the device type (``"cpu"``)."""
    device = trainer.strategy.root_device
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return device.type


def has_validation(datamodule: pl.LightningDataModule) -> bool:
    """Whether `datamodule` has validation data (a ``val_dataloader`` and not ``val_batches=0``)."""
    from lightning.pytorch.utilities.model_helpers import is_overridden

    return is_overridden("val_dataloader", datamodule, pl.LightningDataModule) and bool(
        getattr(datamodule, "val_batches", 1)
    )


def _ms(value: Any) -> str:
    return f"{value:.3g} ms" if isinstance(value, (int, float)) else "n/a"


def summary_line(result: Mapping[str, Any]) -> str:
    """The one line printed at the end of a run: steps, step times, speedup, captured or why not, final loss."""
    if result.get("status") != "ok":
        return f"failed: {result.get('error')}"
    n = result.get("fit_steps", result.get("steps"))
    steps = f"{n} step" if n == 1 else f"{n} steps"
    resumed = result.get("resumed_from_step")
    if resumed is not None:
        steps += f" (resumed from step {resumed}, to step {result.get('steps')})"
    parts = [f"{steps} on {result.get('device')}"]
    if result.get("callback"):
        text = (
            f"eager fit {_ms(result.get('eager_step_ms'))}/step, "
            f"with L2GraphCallback {_ms(result.get('graph_step_ms'))}/step"
        )
        speedup = result.get("fit_step_speedup")
        text += f", speedup {speedup:.2f}x" if isinstance(speedup, (int, float)) else ", speedup n/a"
        replay = result.get("replay_speedup")
        if isinstance(replay, (int, float)):
            text += f" (graph replay vs eager step, CUDA events: {replay:.2f}x)"
        parts.append(text)
    else:
        n = result.get("eager_steps_timed") or 0
        parts.append(f"eager {_ms(result.get('eager_step_ms'))}/step ({steps_text(n)} timed)")
    if result.get("captured"):
        parts.append(f"l2={result.get('l2')}, captured at step {result.get('capture_step')}")
    elif result.get("callback"):
        parts.append(f"l2={result.get('l2')}, not captured: {result.get('reason')}")
    else:
        parts.append(f"not captured: l2 {result.get('l2')}")
    loss = result.get("final_loss")
    parts.append(f"final loss {loss:.4g}" if isinstance(loss, (int, float)) else "final loss n/a")
    return "l2lightning: " + "; ".join(parts)


def log_headline(
    loggers: list, step: int, eager_ms: float | None, fit_ms: float | None, speedup: float | None
) -> None:
    """Send the headline to the run's loggers: ``l2/speedup``, the wall-clock ``Trainer.fit`` step ratio.

    ``l2/eager_fit_step_ms`` and ``l2/fit_step_ms`` are its two sides; nothing is logged without both.
    (The callback logs its own CUDA-event ratio as ``l2/replay_speedup``.)
    """
    if speedup is None or eager_ms is None or fit_ms is None:
        return
    metrics = {
        "l2/speedup": float(speedup),
        "l2/eager_fit_step_ms": float(eager_ms),
        "l2/fit_step_ms": float(fit_ms),
    }
    for logger in loggers:
        logger.log_metrics(metrics, step=step)
        logger.save()
