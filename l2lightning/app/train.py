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

This module is the entry point and the order of a run. What a run needs along the way has a module
of its own: :mod:`~l2lightning.app.config_checks` (the config, before anything is built),
:mod:`~l2lightning.app.builders` (callback, loggers, callbacks), :mod:`~l2lightning.app.fit_timing`
(which step times count), :mod:`~l2lightning.app.result_record` (result.json and the summary line)
and :mod:`~l2lightning.app.sweep_summary` (a multirun's table). Their public names are importable
from here too, where conf/train.yaml (``SweepSummary``, ``BelowWarning``) and users name them.
"""

from __future__ import annotations

import contextlib
import copy
import gc
import json
import logging
import sys
import traceback
import warnings
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import hydra
import lightning.pytorch as pl
import torch
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf, open_dict

from l2lightning import _env
from l2lightning._resources import config_dir
from l2lightning.app.builders import (
    build_callback,
    build_callbacks,
    build_loggers,
    has_l2_entry,
    instantiate_node,
    raising_callback,
    switches_for,
)
from l2lightning.app.config_checks import (
    TOP_LEVEL_KEYS,
    ConfigError,
    advice_line,
    check_ckpt_path,
    check_config,
    cpu_fallback,
    group_option,
)
from l2lightning.app.fit_timing import (
    FitStart,
    eager_step_time,
    fit_speedup,
    graph_step_time,
    timing_text,
)
from l2lightning.app.result_record import (
    RESULT_FILE,
    device_name,
    has_validation,
    jsonable,
    log_headline,
    scalar_metrics,
    summary_line,
)
from l2lightning.app.sweep_summary import SUMMARY_COLUMNS, SweepSummary, write_sweep_summary
from l2lightning.step_timer import StepTimer

__all__ = [
    "RESULT_FILE",
    "SUMMARY_COLUMNS",
    "TOP_LEVEL_KEYS",
    "BelowWarning",
    "ConfigError",
    "StepTimer",
    "SweepSummary",
    "build_callback",
    "build_callbacks",
    "build_loggers",
    "check_ckpt_path",
    "check_config",
    "cpu_fallback",
    "eager_step_time",
    "graph_step_time",
    "group_option",
    "hydra_main",
    "log_headline",
    "main",
    "run",
    "summary_line",
    "timing_text",
    "user_error",
    "write_sweep_summary",
]

log = logging.getLogger("l2lightning.app.train")


class BelowWarning(logging.Filter):
    """Passes records below WARNING: train.yaml's stdout console handler (warnings go to stderr)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno < logging.WARNING


def _hydra_node(cfg: DictConfig) -> Any:
    """The Hydra node: from HydraConfig inside `hydra.main`, else `cfg.hydra` (compose with return_hydra_config)."""
    if HydraConfig.initialized():
        return HydraConfig.get()
    return cfg.get("hydra") if isinstance(cfg, DictConfig) else None


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
    model = instantiate_node(cfg.model, "model", _convert_="all")
    datamodule = instantiate_node(cfg.data, "data", _convert_="all")
    timer = StepTimer()
    progress = build_callbacks(cfg, trainer_node, None, has_logger=False, only=("progress_bar",))
    trainer = instantiate_node(
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
    l2_in_callbacks = has_l2_entry(cfg)
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
    left_out: dict[str, str] = {}
    names: dict[int, str] = {}
    callbacks = build_callbacks(
        cfg, trainer_node, extra_callbacks, has_logger=bool(loggers), left_out=left_out, names=names
    )
    if l2_in_callbacks and l2_callback is not None and not use_l2:
        left_out["l2"] = f"no CUDA ({cuda_reason})" if cuda_reason else "not used"

    torch.set_float32_matmul_precision(cfg.get("float32_matmul_precision", "highest"))
    baseline: tuple[list[tuple[int, float]], str] | None = None
    if use_l2 and cfg.get("eager_baseline_steps", 0) > 0:
        baseline = _eager_baseline(cfg, trainer_node, int(cfg.eager_baseline_steps), out)

    pl.seed_everything(cfg.seed, workers=True, verbose=False)
    model = instantiate_node(cfg.model, "model", _convert_="all")
    datamodule = instantiate_node(cfg.data, "data", _convert_="all")
    timer, start = StepTimer(), FitStart()
    trainer = instantiate_node(
        trainer_node,
        "trainer",
        callbacks=[timer, start, *callbacks, *([l2_callback] if use_l2 else [])],
        logger=loggers or False,
        default_root_dir=str(out),
        **switches_for(callbacks, trainer_node),
    )
    _fit(trainer, model, datamodule, ckpt_path, names)
    train_metrics = scalar_metrics(trainer.callback_metrics)
    val_metrics = None
    if cfg.get("validate", True) and has_validation(datamodule) and trainer.limit_val_batches:
        val_metrics = scalar_metrics(trainer.validate(model, datamodule=datamodule, verbose=False)[0])

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
    speedup = fit_speedup(eager[0], graph[0])
    result = {
        "status": "ok",
        "model": family_of(model) or cfg.model.get("_target_"),
        "model_target": cfg.model.get("_target_"),
        "experiment": choices.get("experiment"),
        "l2": l2_ran,
        "l2_requested": requested,
        "callback": use_l2,
        "batch_size": cfg.data.get("batch_size"),
        "device": device_name(trainer),
        # the global step reached (a resumed fit counts on from its checkpoint's) and this fit's own steps
        "steps": trainer.global_step,
        "fit_steps": trainer.global_step - start.step,
        "resumed_from_step": start.step if ckpt_path is not None else None,
        "captured": captured,
        "reason": reason,
        # the headline: Trainer.fit wall-clock per-step times and their ratio
        "eager_step_ms": eager[0],
        "eager_steps_timed": eager[1],
        "graph_step_ms": graph[0],
        "graph_steps_timed": graph[1],
        "fit_step_speedup": speedup,
        "speedup": speedup,  # the same number as fit_step_speedup
        "timing": timing,
        # the callback's CUDA-event times: eager warm-up step vs one graph replay (l2/replay_speedup)
        "replay_eager_step_ms": summary.get("eager_step_ms"),
        "replay_graph_step_ms": summary.get("graph_step_ms"),
        "replay_speedup": summary.get("replay_speedup"),
        "plans": summary.get("plans") or [],
        "verify": summary.get("verify"),
        "replay_check": summary.get("replay_check"),
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
        "config": _marked_config(cfg, left_out),
    }
    result = jsonable(result)
    log_headline(trainer.loggers, trainer.global_step, eager[0], graph[0], speedup)
    (out / RESULT_FILE).write_text(json.dumps(result, indent=2) + "\n")
    log.info("l2lightning: run directory: %s", out)
    log.info(summary_line(result))
    return result


def _fit(
    trainer: pl.Trainer,
    model: pl.LightningModule,
    datamodule: pl.LightningDataModule,
    ckpt_path: str | None,
    names: dict[int, str],
) -> None:
    """``trainer.fit``; an error raised by a callback the config added is a ConfigError naming its key.

    (An ``EarlyStopping`` that monitors ``val/loss`` in a fit that ends before its first validation.)
    """
    try:
        trainer.fit(model, datamodule=datamodule, ckpt_path=ckpt_path)
    except Exception as exc:
        raised = raising_callback(exc, names)
        if raised is None:
            raise
        key, callback = raised
        text = advice_line(str(exc))
        if "val/" in text and not any(str(k).startswith("val/") for k in trainer.callback_metrics):
            text += (
                f" (no validation had run by step {trainer.global_step}: it runs at the end of each epoch"
                " of the training data, or every trainer.val_check_interval batches)"
            )
        raise ConfigError(f"{key} ({type(callback).__name__}): {text}") from exc


def _marked_config(cfg: DictConfig, left_out: Mapping[str, str]) -> dict[str, Any]:
    """The resolved config for result.json, each callbacks entry that was not used marked ``_unused_: why``."""
    config = OmegaConf.to_container(cfg, resolve=True)
    entries = config.get("callbacks")
    if isinstance(entries, dict):
        for name, why in left_out.items():
            if isinstance(entries.get(name), dict):
                entries[name] = {**entries[name], "_unused_": why}
    return config


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
            return advice_line(str(current))
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
                json.dumps(jsonable(failed), indent=2) + "\n"
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


if __name__ == "__main__":
    main()
