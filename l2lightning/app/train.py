"""Training entry point: `python -m l2lightning.app.train` or `l2lightning-train`, configured by Hydra (conf/train.yaml).

    python -m l2lightning.app.train                                    # the default experiment
    python -m l2lightning.app.train experiment=vit                     # one row of the seed results
    python -m l2lightning.app.train model=vit trainer=gpu l2=autotune data.batch_size=8
    python -m l2lightning.app.train ckpt_path=outputs/DAY/TIME/checkpoints/last.ckpt
    python -m l2lightning.app.train -m model=mlp_stack,rl_policy data.batch_size=4,16

The config follows lightning-hydra-template: groups with `_target_` (model, data, trainer,
callbacks, logger, l2) and experiments as `# @package _global_` deltas. Before anything is built the
config is checked: unknown top-level keys, unknown keys in `l2` and bad `l2` values (the
`L2GraphCallback` is constructed, on every machine) and `ckpt_path` stop the run with one line and
exit status 1, as does a missing optional package (e.g. scikit-learn for `data=digits`).

On a GPU the run trains with `L2GraphCallback` (the `l2` entry of the callbacks group) after a short
plain-Lightning eager fit (`eager_baseline_steps`) that times the eager `Trainer.fit` step. Without
CUDA it trains eagerly on the CPU with trainer/cpu.yaml's settings (trainer.* overrides from the
command line are kept) and no callback, and says why in one line and in result.json.

Every run writes `result.json` to its run directory (what ran and why, `Trainer.fit` wall-clock step
times of the eager fit and of the fit with the callback and their ratio `fit_step_speedup`, the
callback's CUDA-event `replay_speedup`, plans, verify verdict, final loss), logs its messages and
warnings to Hydra's `train.log`, and prints the run directory and a one-line summary. A multirun also
writes `summary.csv` and `summary.md` (one row per job) to the sweep directory, through the Hydra
callback `SweepSummary` configured in train.yaml, and prints their path.
"""

from __future__ import annotations

import contextlib
import copy
import csv
import gc
import inspect
import json
import logging
import math
import statistics
import sys
import time
import traceback
import warnings
import zipfile
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import hydra
import lightning.pytorch as pl
import torch
from hydra.core.hydra_config import HydraConfig
from hydra.errors import InstantiationException
from hydra.experimental.callback import Callback as HydraCallback
from lightning.fabric.utilities.exceptions import MisconfigurationException
from omegaconf import DictConfig, ListConfig, OmegaConf, open_dict

from l2lightning import _env
from l2lightning._resources import config_dir

log = logging.getLogger("l2lightning.app.train")

CPU_FALLBACK_MESSAGE = "l2lightning: no CUDA device ({reason}); training eagerly on CPU{without}"
RESULT_FILE = "result.json"
# every key train.yaml and its groups put at the top of the config; anything else is a typo
TOP_LEVEL_KEYS = (
    "seed",
    "validate",
    "float32_matmul_precision",
    "ckpt_path",
    "eager_baseline_steps",
    "paths",
    "model",
    "data",
    "trainer",
    "l2",
    "callbacks",
    "logger",
)
# columns of the sweep summary, in order
SUMMARY_COLUMNS = (
    "job",
    "status",
    "model",
    "experiment",
    "l2",
    "callback",
    "batch_size",
    "device",
    "steps",
    "captured",
    "reason",
    "eager_step_ms",
    "graph_step_ms",
    "fit_step_speedup",
    "replay_speedup",
    "verify",
    "final_loss",
    "overrides",
)
# the trainer keys that must change on a machine without CUDA, whatever the command line says
FORCED_CPU_KEYS = ("accelerator", "devices")
# entries of the callbacks group that follow a Trainer switch: Lightning refuses a ModelCheckpoint
# with enable_checkpointing=False and a progress bar with enable_progress_bar=False
SWITCHED_CALLBACKS = {"model_checkpoint": "enable_checkpointing", "progress_bar": "enable_progress_bar"}
# the callbacks entry that holds L2GraphCallback (conf/callbacks/l2.yaml: `l2: ${l2}`)
L2_ENTRY = "l2"
# eager steps left out of the eager step time (lazy initialisation, allocator growth)
EAGER_SKIP = 3
# exceptions raised while building a config's object that mean "this config value is wrong"
_CONFIG_VALUE_ERRORS = (ValueError, TypeError, ImportError, MisconfigurationException)


class ConfigError(ValueError):
    """A problem with the config or the installation that the user fixes: one line, exit status 1."""


class BelowWarning(logging.Filter):
    """Passes records below WARNING: train.yaml's stdout console handler (warnings go to stderr)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno < logging.WARNING


# ---------------------------------------------------------------------- timing
class StepTimer(pl.Callback):
    """Wall time of every `Trainer.fit` training step: from its start to the start of the next step.

    On a CUDA device the marks are CUDA events recorded on the current stream at each batch start
    (the GPU timeline, as the benchmark harness times Lightning): no host sync per step, so the
    replays of a captured step are not stalled. On the CPU they are ``time.perf_counter()``. The
    last step of an epoch (the next start is after validation) ends at its own batch end.
    """

    def __init__(self) -> None:
        self._cuda = False
        # [global step, epoch, batch index, start mark, end mark]
        self._records: list[list[Any]] = []

    @property
    def clock(self) -> str:
        if self._cuda:
            return "CUDA events at each step start, GPU timeline"
        return "time.perf_counter on the host"

    def _mark(self) -> Any:
        if self._cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._cuda = trainer.strategy.root_device.type == "cuda"

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        self._records.append([trainer.global_step, trainer.current_epoch, batch_idx, self._mark(), None])

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if self._records and self._records[-1][4] is None:
            self._records[-1][4] = self._mark()

    def step_times(self) -> list[tuple[int, float]]:
        """(global step, ms) of every timed step, in order; waits for the device once."""
        if self._cuda and self._records:
            torch.cuda.synchronize()
        times = []
        for i, (step, epoch, batch_idx, start, end) in enumerate(self._records):
            following = self._records[i + 1] if i + 1 < len(self._records) else None
            if following is not None and following[1] == epoch and following[2] == batch_idx + 1:
                end = following[3]
            if end is None:
                continue
            ms = start.elapsed_time(end) if self._cuda else (end - start) * 1e3
            times.append((int(step), float(ms)))
        return times


def eager_step_time(
    times: Sequence[tuple[int, float]], skip: int = EAGER_SKIP
) -> tuple[float | None, int, int]:
    """(median ms, steps timed, steps skipped) of an eager fit, after its first `skip` steps.

    Fewer steps are skipped when the fit is shorter, so that at least one is timed.
    """
    if not times:
        return None, 0, 0
    skip = min(skip, len(times) - 1)
    kept = [ms for _, ms in times[skip:]]
    return statistics.median(kept), len(kept), skip


def graph_step_time(times: Sequence[tuple[int, float]], capture_step: int | None) -> tuple[float | None, int]:
    """(median ms, steps timed) of the steps after the capture step (the warm-up and capture steps excluded)."""
    if capture_step is None:
        return None, 0
    kept = [ms for step, ms in times if step > capture_step]
    return (statistics.median(kept) if kept else None), len(kept)


def _count(n: int) -> str:
    return "only 1 step" if n == 1 else f"{n} steps"


def timing_text(
    clock: str,
    eager: tuple[float | None, int, int],
    graph: tuple[float | None, int] | None = None,
    capture_step: int | None = None,
    eager_source: str = "this fit",
) -> str:
    """What the step times in result.json are: which clock, which steps, how many."""
    _, n_eager, skip = eager
    parts = [
        f"Trainer.fit wall time per step ({clock}; start of a step to the start of the next), median",
        f"eager: {_count(n_eager)} of {eager_source} after its first {skip}"
        if n_eager
        else "eager: not timed",
    ]
    if graph is not None:
        _, n_graph = graph
        if n_graph:
            parts.append(f"with the callback: {_count(n_graph)} after the capture step {capture_step}")
        else:
            parts.append("with the callback: no step after a capture was timed")
    return "; ".join(parts)


# ---------------------------------------------------------------------- config handling
def _hydra_node(cfg: DictConfig) -> Any:
    """The Hydra node: from HydraConfig inside `hydra.main`, else `cfg.hydra` (compose with return_hydra_config)."""
    if HydraConfig.initialized():
        return HydraConfig.get()
    return cfg.get("hydra") if isinstance(cfg, DictConfig) else None


def _override_key(override: str) -> str:
    """The dotted key of a command-line override: ``"++trainer.max_steps=2"`` -> ``"trainer.max_steps"``."""
    return override.lstrip("+~").split("=", 1)[0].strip()


def _one_line(text: str) -> str:
    """The line of `text` that carries the advice (the first naming `pip install`, else the first)."""
    lines = [line.strip() for line in str(text).splitlines() if line.strip()]
    if not lines:
        return ""
    return next((line for line in lines if "pip install" in line), lines[0])


def group_option(group: str, name: str) -> DictConfig:
    """conf/<group>/<name>.yaml with the same-group entries of its defaults list merged in, as Hydra does."""
    raw = OmegaConf.load(config_dir() / group / f"{name}.yaml")
    defaults = list(raw.pop("defaults", None) or [])
    if "_self_" not in defaults:
        defaults.append("_self_")
    merged = OmegaConf.create()
    for entry in defaults:
        merged = OmegaConf.merge(merged, raw if entry == "_self_" else group_option(group, str(entry)))
    return merged


def cpu_fallback(cfg: DictConfig, overrides: Sequence[str] = ()) -> str | None:
    """Without CUDA, switch `cfg.trainer` (in place) to trainer/cpu.yaml's settings.

    Trainer keys given on the command line (`overrides`) are kept, except the accelerator and the
    device count. `cfg.l2` is left as it is: it is still validated, and `run` does not use the
    callback. Returns the one-line message to print, or None when CUDA is there or the run was a
    CPU run without the callback anyway.
    """
    reason = _env.cuda_unavailable_reason()
    if reason is None:
        return None
    wants_l2 = cfg.get("l2") is not None
    if cfg.trainer.get("accelerator") == "cpu" and not wants_l2:
        return None
    if cfg.trainer.get("accelerator") != "cpu":
        cpu = group_option("trainer", "cpu")
        kept = {
            _override_key(o).removeprefix("trainer.")
            for o in overrides
            if _override_key(o).startswith("trainer.")
        }
        with open_dict(cfg):
            for key, value in cpu.items():
                if key in FORCED_CPU_KEYS or key not in kept:
                    cfg.trainer[key] = value
    return CPU_FALLBACK_MESSAGE.format(reason=reason, without=" without the callback" if wants_l2 else "")


def check_config(cfg: DictConfig) -> None:
    """Refuse unknown top-level keys and malformed top-level values before anything is built."""
    unknown = [str(k) for k in cfg if k not in TOP_LEVEL_KEYS and k != "hydra"]
    if unknown:
        raise ConfigError(
            f"unknown top-level key `{unknown[0]}`"
            + (f" (and {', '.join(unknown[1:])})" if len(unknown) > 1 else "")
            + f"; accepted: {', '.join(TOP_LEVEL_KEYS)}"
        )
    for key in ("model", "data", "trainer"):
        if not isinstance(cfg.get(key), DictConfig):
            raise ConfigError(f"`{key}` must be a config with a `_target_`, got {cfg.get(key)!r}")
    steps = cfg.get("eager_baseline_steps", 0)
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 0:
        raise ConfigError(f"`eager_baseline_steps` must be an int >= 0, got {steps!r}")


def check_ckpt_path(value: Any) -> str | None:
    """The absolute path of `ckpt_path`, or None; a missing, unreadable or non-checkpoint file is a ConfigError."""
    if value is None:
        return None
    if not isinstance(value, str) or not value.strip():
        raise ConfigError(f"ckpt_path must be the path of a checkpoint file, got {value!r}")
    path = Path(hydra.utils.to_absolute_path(value))
    if not path.exists():
        raise ConfigError(f"ckpt_path: no such file: {path}")
    if not path.is_file():
        raise ConfigError(f"ckpt_path: not a file: {path}")
    try:
        with path.open("rb") as f:
            f.read(1)
    except OSError as exc:
        raise ConfigError(f"ckpt_path: cannot read {path}: {exc.strerror or exc}") from None
    if not zipfile.is_zipfile(path):
        raise ConfigError(
            f"ckpt_path: {path} is not a checkpoint (Lightning's torch.save writes a zip archive; this file is not one)"
        )
    return str(path)


def _l2_class(cfg: DictConfig) -> type | None:
    """The callback class of `cfg.l2` after checking its keys, or None for ``l2: null`` (l2=none)."""
    from l2lightning.callback import L2GraphCallback

    node = cfg.get("l2")
    if node is None:
        return None
    if not isinstance(node, DictConfig):
        raise ConfigError(
            f"`l2` must be a config of L2GraphCallback's arguments or null (l2=none), got {node!r}"
        )
    target = node.get("_target_")
    if target is None:
        raise ConfigError(
            "l2 has no `_target_`; expected l2lightning.L2GraphCallback (pick an option: l2=sized)"
        )
    try:
        cls = hydra.utils.get_class(str(target))
    except Exception as exc:
        raise ConfigError(f"l2._target_: cannot import {target!r} ({_one_line(str(exc))})") from None
    if not issubclass(cls, L2GraphCallback):
        raise ConfigError(f"l2._target_ must be l2lightning.L2GraphCallback (or a subclass), got {target!r}")
    params = inspect.signature(cls.__init__).parameters
    accepted = [
        name
        for name, p in params.items()
        if name != "self" and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
    ]
    if not any(p.kind == p.VAR_KEYWORD for p in params.values()):
        unknown = [str(k) for k in node if not str(k).startswith("_") and k not in accepted]
        if unknown:
            raise ConfigError(f"unknown key `l2.{unknown[0]}`; {cls.__name__} accepts: {', '.join(accepted)}")
    if node.get("prefetch") is False:
        raise ConfigError(
            'l2.prefetch is false: YAML reads a bare `off` as false; write prefetch: "off" (or pick l2=graph)'
        )
    return cls


def build_callback(cfg: DictConfig) -> pl.Callback | None:
    """The `L2GraphCallback` that `cfg.l2` describes, or None for ``l2: null`` (l2=none).

    Built on every machine (construction does not touch CUDA), so that its own argument checks run
    on a laptop too. Unknown keys and bad values raise :class:`ConfigError` naming the argument.
    """
    if _l2_class(cfg) is None:
        return None
    return _instantiate(cfg.l2, "l2")


def _instantiate(node: Any, where: str, **kwargs: Any) -> Any:
    """``hydra.utils.instantiate``; a bad value or a missing package becomes a one-line ConfigError."""
    try:
        return hydra.utils.instantiate(node, **kwargs)
    except InstantiationException as exc:
        cause = exc.__cause__
        if cause is None or isinstance(cause, _CONFIG_VALUE_ERRORS):
            text = str(cause) if cause is not None else str(exc)
            if isinstance(cause, ImportError) and "pip install" not in text:
                text = " ".join(text.split())  # "Error loading 'x.Y': ... Are you sure ... is installed?"
            else:
                text = _one_line(text)
            raise ConfigError(f"{where}: {text}") from exc
        raise
    except _CONFIG_VALUE_ERRORS as exc:  # raised by a _target_ called without Hydra's wrapping
        raise ConfigError(f"{where}: {_one_line(str(exc))}") from exc


def _l2_entry(cfg: DictConfig) -> bool:
    """Whether the callbacks group holds the L2GraphCallback entry (``callbacks.l2: ${l2}``)."""
    callbacks = cfg.get("callbacks")
    if not isinstance(callbacks, DictConfig) or L2_ENTRY not in callbacks:
        return False
    if OmegaConf.to_container(callbacks, resolve=False).get(L2_ENTRY) != "${l2}":
        raise ConfigError(
            "callbacks.l2 must stay `${l2}`: configure L2GraphCallback under `l2` (l2=..., l2.KEY=...), "
            "or drop it with ~callbacks.l2"
        )
    return True


def _as_list(node: Any) -> list[Any]:
    if node is None:
        return []
    if isinstance(node, (ListConfig, list, tuple)):
        return list(node)
    return [node]


def build_loggers(cfg: DictConfig, trainer_logger: Any = None) -> list[Any]:
    """The loggers of the `logger` group (one per entry; null entries skipped) plus ``trainer.logger``.

    ``trainer.logger=false`` means no logger at all, as in Lightning.
    """
    if trainer_logger is False:
        return []
    loggers = []
    group = cfg.get("logger")
    if group is not None:
        if not isinstance(group, DictConfig):
            raise ConfigError(f"`logger` must be a mapping of name -> logger config, got {group!r}")
        for name, node in group.items():
            if node is None:
                continue
            if not isinstance(node, DictConfig) or "_target_" not in node:
                raise ConfigError(f"logger.{name} must be a config with a `_target_`, got {node!r}")
            loggers.append(_instantiate(node, f"logger.{name}"))
    if trainer_logger is not None and trainer_logger is not True:
        for i, node in enumerate(_as_list(trainer_logger)):
            loggers.append(_instantiate(node, f"trainer.logger[{i}]"))
    return loggers


def build_callbacks(
    cfg: DictConfig,
    trainer_node: DictConfig,
    extra: Any,
    has_logger: bool,
    only: Sequence[str] | None = None,
) -> list[pl.Callback]:
    """The callbacks group's entries (except the l2 one) and ``trainer.callbacks``, built in that order.

    An entry that is null is skipped; ``model_checkpoint`` and ``progress_bar`` are left out when
    ``trainer.enable_checkpointing`` / ``trainer.enable_progress_bar`` is false, and ``lr_monitor``
    when there is no logger (Lightning would refuse each of them). `only`: build just these entries.
    """
    callbacks: list[pl.Callback] = []
    group = cfg.get("callbacks")
    if group is not None and not isinstance(group, DictConfig):
        raise ConfigError(f"`callbacks` must be a mapping of name -> callback config, got {group!r}")
    for name in group or {}:
        if name == L2_ENTRY or (only is not None and name not in only):
            continue
        node = group[name]
        if node is None:
            continue
        switch = SWITCHED_CALLBACKS.get(str(name))
        if switch is not None and trainer_node.get(switch, True) is False:
            log.debug("callbacks.%s left out: trainer.%s is false", name, switch)
            continue
        if name == "lr_monitor" and not has_logger:
            log.debug("callbacks.lr_monitor left out: no logger")
            continue
        if not isinstance(node, DictConfig) or "_target_" not in node:
            raise ConfigError(f"callbacks.{name} must be a config with a `_target_`, got {node!r}")
        callbacks.append(_instantiate(node, f"callbacks.{name}"))
    for i, node in enumerate(_as_list(extra) if only is None else []):
        callbacks.append(_instantiate(node, f"trainer.callbacks[{i}]"))
    return callbacks


def _switches_for(callbacks: Sequence[pl.Callback], trainer_node: DictConfig) -> dict[str, bool]:
    """Trainer switches to turn on for callbacks the user added (a ModelCheckpoint, a progress bar).

    The group's own entries are left out when their switch is off (:func:`build_callbacks`), so a
    checkpoint or progress bar among `callbacks` was added by the user: it runs, rather than making
    Lightning refuse the switch (trainer/cpu.yaml turns checkpointing off).
    """
    from lightning.pytorch.callbacks import Checkpoint, ProgressBar

    switches = {}
    for switch, kind in (("enable_checkpointing", Checkpoint), ("enable_progress_bar", ProgressBar)):
        if trainer_node.get(switch, True) is False and any(isinstance(c, kind) for c in callbacks):
            log.info("l2lightning: trainer.%s turned on for the %s you added", switch, kind.__name__)
            switches[switch] = True
    return switches


# ---------------------------------------------------------------------- results
def _jsonable(value: Any) -> Any:
    """`value` as plain JSON: dataclass-like objects through `to_dict`, non-finite floats as strings."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        return _jsonable(float(value))
    if isinstance(value, Mapping):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if hasattr(value, "to_dict"):
        return _jsonable(value.to_dict())
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return str(value)


def _scalars(metrics: Mapping[str, Any]) -> dict[str, float]:
    return {
        key: float(value)
        for key, value in sorted(metrics.items())
        if isinstance(value, (int, float)) or (isinstance(value, torch.Tensor) and value.numel() == 1)
    }


def _device_name(trainer: pl.Trainer) -> str:
    device = trainer.strategy.root_device
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return device.type


def _has_validation(datamodule: pl.LightningDataModule) -> bool:
    from lightning.pytorch.utilities.model_helpers import is_overridden

    return is_overridden("val_dataloader", datamodule, pl.LightningDataModule) and bool(
        getattr(datamodule, "val_batches", 1)
    )


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a and b else None


def _ms(value: Any) -> str:
    return f"{value:.3g} ms" if isinstance(value, (int, float)) else "n/a"


def summary_line(result: Mapping[str, Any]) -> str:
    """The one line printed at the end of a run: steps, step times, speedup, captured or why not, final loss."""
    if result.get("status") != "ok":
        return f"failed: {result.get('error')}"
    parts = [f"{result.get('steps')} steps on {result.get('device')}"]
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
        parts.append(f"eager {_ms(result.get('eager_step_ms'))}/step ({_count(n)} timed)")
    if result.get("captured"):
        parts.append(f"l2={result.get('l2')}, captured at step {result.get('capture_step')}")
    elif result.get("callback"):
        parts.append(f"l2={result.get('l2')}, not captured: {result.get('reason')}")
    else:
        parts.append(f"not captured: l2 {result.get('l2')}")
    loss = result.get("final_loss")
    parts.append(f"final loss {loss:.4g}" if isinstance(loss, (int, float)) else "final loss n/a")
    return "l2lightning: " + "; ".join(parts)


def _l2_name(cfg: DictConfig, choices: Mapping[str, Any]) -> str:
    """The l2 option asked for: its group choice (l2=sized), else a description of `cfg.l2`."""
    if choices.get("l2"):
        return str(choices["l2"])
    node = cfg.get("l2")
    return "none" if node is None else f"prefetch={node.get('prefetch')}"


def _eager_baseline(
    cfg: DictConfig, trainer_node: DictConfig, steps: int, out: Path
) -> tuple[list[tuple[int, float]], str]:
    """Fit a fresh model for `steps` steps with plain Lightning: the eager step times the callback is compared with.

    Same model, data, seed and Trainer settings as the fit with the callback, and the same progress
    bar (a per-step cost the user has either way); no callback of its own, logger, checkpoint or
    validation, so it leaves nothing behind.
    """
    log.info(
        "l2lightning: eager baseline: %d steps of plain Lightning (no callback) to time the eager Trainer.fit step",
        steps,
    )
    pl.seed_everything(cfg.seed, workers=True, verbose=False)
    model = _instantiate(cfg.model, "model", _convert_="all")
    datamodule = _instantiate(cfg.data, "data", _convert_="all")
    timer = StepTimer()
    progress = build_callbacks(cfg, trainer_node, None, has_logger=False, only=("progress_bar",))
    trainer = _instantiate(
        trainer_node,
        "trainer",
        max_steps=steps,
        callbacks=[timer, *progress],
        logger=False,
        enable_checkpointing=False,
        enable_model_summary=False,
        limit_val_batches=0,
        num_sanity_val_steps=0,
        default_root_dir=str(out / "eager_baseline"),
    )
    trainer.fit(model, datamodule=datamodule)
    times, clock = timer.step_times(), timer.clock
    del trainer, model, datamodule
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return times, clock


def run(
    cfg: DictConfig,
    output_dir: str | Path | None = None,
    overrides: Sequence[str] | None = None,
) -> dict[str, Any]:
    """Check `cfg`, train once as it says and write ``result.json`` to `output_dir`; returns the result.

    Args:
        cfg: the composed train.yaml config (not modified).
        output_dir: where result.json, checkpoints and logs go; default: Hydra's run dir.
        overrides: the command-line overrides (their trainer.* keys survive the CPU fallback);
            default: Hydra's task overrides.

    Raises:
        ConfigError: a bad config value, a missing or unreadable ``ckpt_path``, a missing package.
    """
    from l2lightning.app.models import family_of

    hydra_node = _hydra_node(cfg)
    if output_dir is None:
        if hydra_node is None or OmegaConf.select(hydra_node, "runtime.output_dir", default=None) is None:
            raise ValueError(
                "`output_dir` is required outside `hydra.main` (no Hydra run directory to write to)"
            )
        output_dir = hydra_node.runtime.output_dir
    if overrides is None:
        overrides = (
            list(OmegaConf.select(hydra_node, "overrides.task", default=None) or []) if hydra_node else []
        )
    choices = dict(OmegaConf.select(hydra_node, "runtime.choices", default=None) or {}) if hydra_node else {}
    out = Path(output_dir).resolve()
    out.mkdir(parents=True, exist_ok=True)

    cfg = copy.deepcopy(cfg)
    with open_dict(cfg):
        if "hydra" in cfg:
            del cfg["hydra"]
        OmegaConf.update(cfg, "paths.output_dir", str(out), force_add=True)

    # ---- everything that can be wrong with the config, before anything is built
    check_config(cfg)
    ckpt_path = check_ckpt_path(cfg.get("ckpt_path"))
    l2_callback = build_callback(cfg)  # on every machine: the callback's own checks
    l2_in_callbacks = _l2_entry(cfg)
    cuda_reason = _env.cuda_unavailable_reason()
    use_l2 = l2_callback is not None and l2_in_callbacks and cuda_reason is None
    fallback = cpu_fallback(cfg, overrides)
    if fallback:
        log.info(fallback)
    trainer_node = copy.deepcopy(cfg.trainer)
    with open_dict(trainer_node):
        extra_callbacks = trainer_node.pop("callbacks", None)
        trainer_logger = trainer_node.pop("logger", None)

    loggers = build_loggers(cfg, trainer_logger)
    callbacks = build_callbacks(cfg, trainer_node, extra_callbacks, has_logger=bool(loggers))

    torch.set_float32_matmul_precision(cfg.get("float32_matmul_precision", "highest"))
    baseline: tuple[list[tuple[int, float]], str] | None = None
    if use_l2 and cfg.get("eager_baseline_steps", 0) > 0:
        baseline = _eager_baseline(cfg, trainer_node, int(cfg.eager_baseline_steps), out)

    pl.seed_everything(cfg.seed, workers=True, verbose=False)
    model = _instantiate(cfg.model, "model", _convert_="all")
    datamodule = _instantiate(cfg.data, "data", _convert_="all")
    timer = StepTimer()
    trainer = _instantiate(
        trainer_node,
        "trainer",
        callbacks=[timer, *callbacks, *([l2_callback] if use_l2 else [])],
        logger=loggers or False,
        default_root_dir=str(out),
        **_switches_for(callbacks, trainer_node),
    )
    trainer.fit(model, datamodule=datamodule, ckpt_path=ckpt_path)
    train_metrics = _scalars(trainer.callback_metrics)
    val_metrics = None
    if cfg.get("validate", True) and _has_validation(datamodule) and trainer.limit_val_batches:
        val_metrics = _scalars(trainer.validate(model, datamodule=datamodule, verbose=False)[0])

    # ---- what ran, and how fast
    times = timer.step_times()
    summary = dict(l2_callback.summary()) if use_l2 else {}
    captured = bool(summary.get("captured", False))
    capture_step = summary.get("capture_step") if captured else None
    requested = _l2_name(cfg, choices)
    if use_l2:
        if baseline is not None:
            eager = eager_step_time(baseline[0])
            source = f"the {cfg.eager_baseline_steps}-step eager baseline fit"
        else:
            eager, source = (None, 0, 0), "no eager baseline (eager_baseline_steps=0)"
        graph = graph_step_time(times, capture_step)
        timing = timing_text(timer.clock, eager, graph, capture_step, eager_source=source)
        l2_ran = requested
        if captured:
            reason = f"captured at step {capture_step}"
            if summary.get("fallback_steps"):
                reason += f"; {summary['fallback_steps']} steps fell back to eager ({', '.join(summary.get('fallback_causes') or [])})"
        else:
            reason = summary.get("reason") or "L2GraphCallback did not capture the step"
    else:
        eager, graph = eager_step_time(times), (None, 0)
        timing = timing_text(timer.clock, eager)
        if l2_callback is None:
            l2_ran = "none (l2=none)"
            reason = "l2=none: no L2GraphCallback, plain eager training"
        elif cuda_reason is not None:
            l2_ran = f"none (no CUDA: {cuda_reason})"
            reason = (
                f"no CUDA ({cuda_reason}): l2={requested} was validated (L2GraphCallback built) "
                "but not used; plain eager training on the CPU"
            )
        else:
            l2_ran = "none (no callbacks.l2 entry)"
            reason = "the callbacks group has no `l2` entry: plain eager training without L2GraphCallback"
    fit_speedup = _ratio(eager[0], graph[0])
    result = {
        "status": "ok",
        "model": family_of(model) or cfg.model.get("_target_"),
        "model_target": cfg.model.get("_target_"),
        "experiment": choices.get("experiment"),
        "l2": l2_ran,
        "l2_requested": requested,
        "callback": use_l2,
        "batch_size": cfg.data.get("batch_size"),
        "device": _device_name(trainer),
        "steps": trainer.global_step,
        "captured": captured,
        "reason": reason,
        # the headline: Trainer.fit wall-clock per-step times and their ratio
        "eager_step_ms": eager[0],
        "eager_steps_timed": eager[1],
        "graph_step_ms": graph[0],
        "graph_steps_timed": graph[1],
        "fit_step_speedup": fit_speedup,
        "speedup": fit_speedup,  # the same number as fit_step_speedup
        "timing": timing,
        # the callback's CUDA-event times: eager warm-up step vs one graph replay (l2/replay_speedup)
        "replay_eager_step_ms": summary.get("eager_step_ms"),
        "replay_graph_step_ms": summary.get("graph_step_ms"),
        "replay_speedup": summary.get("replay_speedup"),
        "plans": summary.get("plans") or [],
        "verify": summary.get("verify"),
        "capture_step": capture_step,
        "fallback_steps": summary.get("fallback_steps", 0),
        "fallback_causes": summary.get("fallback_causes") or [],
        "final_loss": train_metrics.get("train/loss"),
        "metrics": train_metrics,
        "val_metrics": val_metrics,
        "ckpt_path": ckpt_path,
        "run_dir": str(out),
        "seed": cfg.seed,
        "overrides": list(overrides),
        "job_num": OmegaConf.select(hydra_node, "job.num", default=None) if hydra_node else None,
        "versions": {"torch": torch.__version__, "lightning": pl.__version__},
        "config": OmegaConf.to_container(cfg, resolve=True),
    }
    result = _jsonable(result)
    log_headline(trainer.loggers, trainer.global_step, eager[0], graph[0], fit_speedup)
    (out / RESULT_FILE).write_text(json.dumps(result, indent=2) + "\n")
    log.info("l2lightning: run directory: %s", out)
    log.info(summary_line(result))
    return result


# ---------------------------------------------------------------------- sweeps
def _cell(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        return f"{value:.4g}"
    if isinstance(value, list):
        return " ".join(str(v) for v in value)
    return str(value)


def write_sweep_summary(sweep_dir: str | Path) -> tuple[Path, Path]:
    """Collect every job's result.json under `sweep_dir` into ``summary.csv`` and ``summary.md`` there.

    Returns the two paths. Jobs are ordered by job number. A failed job's `reason` is its error.
    """
    sweep_dir = Path(sweep_dir)
    results = []
    for path in sweep_dir.rglob(RESULT_FILE):
        try:
            results.append(json.loads(path.read_text()))
        except (OSError, json.JSONDecodeError) as exc:
            results.append({"status": f"unreadable: {exc}", "job": str(path.parent.relative_to(sweep_dir))})
    results.sort(key=lambda r: (r.get("job_num") is None, r.get("job_num") or 0, str(r.get("overrides"))))
    rows = [
        {
            **{k: r.get(k) for k in SUMMARY_COLUMNS},
            "job": r.get("job_num", r.get("job")),
            "reason": r.get("reason") or r.get("error"),
        }
        for r in results
    ]
    csv_path, md_path = sweep_dir / "summary.csv", sweep_dir / "summary.md"
    with csv_path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=SUMMARY_COLUMNS)
        writer.writeheader()
        writer.writerows({k: _cell(v) for k, v in row.items()} for row in rows)
    lines = [
        f"# Sweep summary: {len(rows)} run{'s' if len(rows) != 1 else ''}",
        "",
        "fit_step_speedup: Trainer.fit wall-clock step time, eager fit / fit with L2GraphCallback; "
        "replay_speedup: CUDA-event eager step / graph replay.",
        "",
        "| " + " | ".join(SUMMARY_COLUMNS) + " |",
        "|" + "|".join("---" for _ in SUMMARY_COLUMNS) + "|",
    ]
    for row in rows:
        lines.append("| " + " | ".join(_cell(row[k]).replace("|", "\\|") for k in SUMMARY_COLUMNS) + " |")
    md_path.write_text("\n".join(lines) + "\n")
    return csv_path, md_path


def _is_multirun(config: DictConfig) -> bool:
    mode = OmegaConf.select(config, "hydra.mode", default=None)
    return str(getattr(mode, "name", mode)).upper().endswith("MULTIRUN")


class SweepSummary(HydraCallback):
    """Hydra callback: after each job of a multirun (and at its end), rewrite the sweep's summary table.

    Rewriting after every job means a sweep that stops half-way still leaves a table of the runs that
    finished. At the end of the sweep it prints where the table is. Configured in conf/train.yaml
    under ``hydra.callbacks``.
    """

    def _write(self, config: DictConfig) -> tuple[Path, Path] | None:
        sweep_dir = OmegaConf.select(config, "hydra.sweep.dir", default=None)
        if sweep_dir is not None and Path(str(sweep_dir)).is_dir():
            return write_sweep_summary(str(sweep_dir))
        return None

    def on_job_end(self, config: DictConfig, job_return: Any, **kwargs: Any) -> None:
        if _is_multirun(config):
            self._write(config)

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        paths = self._write(config)
        if paths is not None:
            csv_path, md_path = paths
            print(f"l2lightning: sweep summary: {md_path.resolve()} (and {csv_path.name})", flush=True)


# ---------------------------------------------------------------------- entry point
# one-line errors of the runs of this process (main exits 1 when there are any)
_FAILED: list[str] = []


def user_error(exc: BaseException) -> str | None:
    """The one line to show for `exc` when it is the user's to fix (a ConfigError, a missing package), else None."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, ConfigError):
            return str(current)
        if isinstance(current, ImportError) and "pip install" in str(current):
            return _one_line(str(current))
        current = current.__cause__
    return None


def _run_and_record(cfg: DictConfig) -> dict[str, Any]:
    """`run`; when it fails, write a failed result.json (with the error) to the run directory.

    A user error (:func:`user_error`) is logged as one line and returned as the failed result (the
    process exits 1 at the end); any other exception is raised with its traceback.
    """
    try:
        return run(cfg)
    except Exception as exc:
        advice = user_error(exc)
        error = advice if advice is not None else f"{type(exc).__name__}: {exc}"
        failed = {"status": "failed", "error": error, "reason": error}
        if HydraConfig.initialized():
            hydra_cfg = HydraConfig.get()
            failed.update(
                traceback=traceback.format_exc(),
                overrides=list(hydra_cfg.overrides.task),
                job_num=OmegaConf.select(hydra_cfg, "job.num", default=None),
                model=OmegaConf.select(cfg, "model._target_", default=None),
            )
            Path(hydra_cfg.runtime.output_dir, RESULT_FILE).write_text(
                json.dumps(_jsonable(failed), indent=2) + "\n"
            )
        if advice is None:
            raise
        log.error("l2lightning: error: %s", advice)
        _FAILED.append(advice)
        return failed


def _show_warning(
    message: Warning | str,
    category: type[Warning],
    filename: str,
    lineno: int,
    file: Any = None,
    line: Any = None,
) -> None:
    logging.getLogger("py.warnings").warning(
        "%s: %s (%s:%d)", category.__name__, message, Path(filename).name, lineno
    )


@contextlib.contextmanager
def _warnings_and_lightning_to_log() -> Iterator[None]:
    """Python warnings (the callback's included) go to logging, and Lightning's log lines to the log files too."""
    previous = warnings.showwarning
    warnings.showwarning = _show_warning
    files = [h for h in logging.getLogger().handlers if isinstance(h, logging.FileHandler)]
    lightning_loggers = [logging.getLogger(name) for name in ("lightning.pytorch", "lightning.fabric")]
    for logger in lightning_loggers:
        for handler in files:
            logger.addHandler(handler)
    try:
        yield
    finally:
        warnings.showwarning = previous
        for logger in lightning_loggers:
            for handler in files:
                logger.removeHandler(handler)


@hydra.main(config_path=str(config_dir()), config_name="train", version_base="1.3")
def hydra_main(cfg: DictConfig) -> dict[str, Any]:
    """The Hydra task: one run (one job of a multirun), its warnings and Lightning's lines in train.log."""
    with _warnings_and_lightning_to_log():
        return _run_and_record(cfg)


def main() -> None:
    """Console entry point `l2lightning-train`: Hydra parses sys.argv; exit status 1 after a one-line error."""
    _FAILED.clear()
    hydra_main()
    if _FAILED:
        sys.exit(1)


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


if __name__ == "__main__":
    main()
