"""Training entry point: `python -m l2lightning.train` or `l2lightning-train`, configured by Hydra (conf/train.yaml).

    python -m l2lightning.train                                    # the default experiment
    python -m l2lightning.train experiment=vit                     # one row of the seed results
    python -m l2lightning.train model=vit trainer=gpu l2=autotune data.batch_size=8
    python -m l2lightning.train -m model=mlp_stack,rl_policy data.batch_size=4,16

On a GPU the run trains with `L2GraphCallback` (as `l2=` configures it). Without CUDA it trains
eagerly on the CPU with trainer/cpu.yaml's settings (trainer.* overrides from the command line are
kept) and no callback, and prints one line saying why. Every run writes `result.json` to its run
directory: model, batch size, eager vs captured step time, speedup, prefetch plans, the verify
verdict, final loss, device. A multirun also writes `summary.csv` and `summary.md` (one row per
job) to the sweep directory, through the Hydra callback `SweepSummary` configured in train.yaml.
"""

from __future__ import annotations

import copy
import csv
import json
import math
import statistics
import time
import traceback
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import hydra
import lightning.pytorch as pl
import torch
from hydra.core.hydra_config import HydraConfig
from hydra.experimental.callback import Callback as HydraCallback
from omegaconf import DictConfig, OmegaConf, open_dict

from l2lightning import _env
from l2lightning._resources import config_dir

CPU_FALLBACK_MESSAGE = "l2lightning: no CUDA device ({reason}); training eagerly on CPU without the callback"
RESULT_FILE = "result.json"
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
    "captured",
    "eager_step_ms",
    "graph_step_ms",
    "speedup",
    "verify",
    "final_loss",
    "overrides",
)
# the trainer keys that must change on a machine without CUDA, whatever the command line says
FORCED_CPU_KEYS = ("accelerator", "devices")


# ---------------------------------------------------------------------- timing
class StepTimer(pl.Callback):
    """Wall time of every training step, from batch start to batch end, with CUDA synchronised at both ends.

    The eager baseline of runs without `L2GraphCallback` (which times its own steps with CUDA events).
    """

    def __init__(self) -> None:
        self.times_ms: list[float] = []
        self._start: float | None = None

    @staticmethod
    def _sync(trainer: pl.Trainer) -> None:
        device = trainer.strategy.root_device
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        self._sync(trainer)
        self._start = time.perf_counter()

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if self._start is None:
            return
        self._sync(trainer)
        self.times_ms.append((time.perf_counter() - self._start) * 1e3)
        self._start = None

    def median_ms(self, skip: int = 3) -> float | None:
        """Median step time after the first `skip` steps (fewer skipped when the run is shorter)."""
        if not self.times_ms:
            return None
        skip = min(skip, len(self.times_ms) - 1)
        return statistics.median(self.times_ms[skip:])


# ---------------------------------------------------------------------- config handling
def _hydra_node(cfg: DictConfig) -> Any:
    """The Hydra node: from HydraConfig inside `hydra.main`, else `cfg.hydra` (compose with return_hydra_config)."""
    if HydraConfig.initialized():
        return HydraConfig.get()
    return cfg.get("hydra") if isinstance(cfg, DictConfig) else None


def _override_key(override: str) -> str:
    """The dotted key of a command-line override: ``"++trainer.max_steps=2"`` -> ``"trainer.max_steps"``."""
    return override.lstrip("+~").split("=", 1)[0].strip()


def cpu_fallback(cfg: DictConfig, overrides: Sequence[str] = ()) -> str | None:
    """Without CUDA, switch `cfg` (in place) to trainer/cpu.yaml's settings and drop the callback.

    Trainer keys given on the command line (`overrides`) are kept, except the accelerator and the
    device count. Returns the one-line message to print, or None when nothing had to change.
    """
    reason = _env.cuda_unavailable_reason()
    if reason is None:
        return None
    changed = False
    if cfg.trainer.get("accelerator") != "cpu":
        cpu = OmegaConf.load(config_dir() / "trainer" / "cpu.yaml")
        kept = {
            _override_key(o).removeprefix("trainer.")
            for o in overrides
            if _override_key(o).startswith("trainer.")
        }
        with open_dict(cfg):
            for key, value in cpu.items():
                if key in FORCED_CPU_KEYS or key not in kept:
                    cfg.trainer[key] = value
        changed = True
    if cfg.get("l2") is not None:
        with open_dict(cfg):
            cfg.l2 = None
        changed = True
    return CPU_FALLBACK_MESSAGE.format(reason=reason) if changed else None


def build_callback(cfg: DictConfig) -> pl.Callback | None:
    """The `L2GraphCallback` that `cfg.l2` describes, or None for ``l2: null`` (l2=off)."""
    node = cfg.get("l2")
    if node is None:
        return None
    if not isinstance(node, DictConfig) or "_target_" not in node:
        raise ValueError(f"`l2` must be null (l2=off) or a config with a `_target_`, got {node!r}")
    return hydra.utils.instantiate(node, _convert_="all")


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


def run(
    cfg: DictConfig,
    output_dir: str | Path | None = None,
    overrides: Sequence[str] | None = None,
) -> dict[str, Any]:
    """Train once as `cfg` says and write ``result.json`` to `output_dir`; returns the result.

    Args:
        cfg: the composed train.yaml config (not modified).
        output_dir: where result.json, the CSV log and Lightning's files go; default: Hydra's run dir.
        overrides: the command-line overrides (their trainer.* keys survive the CPU fallback);
            default: Hydra's task overrides.
    """
    from hydra.utils import instantiate
    from lightning.pytorch.loggers import CSVLogger

    from l2lightning.models import family_of

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
    out = Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)

    cfg = copy.deepcopy(cfg)
    if "hydra" in cfg:
        with open_dict(cfg):
            del cfg["hydra"]
    fallback = cpu_fallback(cfg, overrides)
    if fallback:
        print(fallback, flush=True)

    pl.seed_everything(cfg.seed, workers=True, verbose=False)
    torch.set_float32_matmul_precision(cfg.get("float32_matmul_precision", "highest"))
    model = instantiate(cfg.model, _convert_="all")
    datamodule = instantiate(cfg.data, _convert_="all")
    l2_callback = build_callback(cfg)
    # Without the callback, time the eager steps here; with it, its CUDA-event timings are used and a
    # per-step synchronize would only stall the replays.
    timer = StepTimer() if l2_callback is None else None
    trainer_kwargs: dict[str, Any] = {
        "callbacks": [timer if timer is not None else l2_callback],
        "default_root_dir": str(out),
    }
    if cfg.trainer.get("logger", True) is True:
        trainer_kwargs["logger"] = CSVLogger(save_dir=str(out), name="csv", version="")
    trainer = instantiate(cfg.trainer, **trainer_kwargs)
    trainer.fit(model, datamodule=datamodule)
    train_metrics = _scalars(trainer.callback_metrics)
    val_metrics = None
    if cfg.get("validate", True) and _has_validation(datamodule) and trainer.limit_val_batches:
        val_metrics = _scalars(trainer.validate(model, datamodule=datamodule, verbose=False)[0])

    summary = dict(l2_callback.summary()) if l2_callback is not None else {}
    if timer is not None:
        eager_ms, timing = timer.median_ms(skip=3), "wall clock per step after the first 3, CUDA synchronised"
    else:
        eager_ms, timing = summary.get("eager_step_ms"), "L2GraphCallback CUDA events"
    if l2_callback is None:
        reason = fallback or "l2=off: no L2GraphCallback, plain eager training"
    else:
        reason = summary.get("reason")
    result = {
        "status": "ok",
        "model": family_of(model) or cfg.model.get("_target_"),
        "model_target": cfg.model.get("_target_"),
        "experiment": choices.get("experiment"),
        "l2": choices.get("l2") or ("off" if cfg.get("l2") is None else str(cfg.l2.get("prefetch"))),
        "callback": l2_callback is not None,
        "batch_size": cfg.data.get("batch_size"),
        "device": _device_name(trainer),
        "steps": trainer.global_step,
        "captured": bool(summary.get("captured", False)),
        "reason": reason,
        "eager_step_ms": eager_ms,
        "graph_step_ms": summary.get("graph_step_ms"),
        "speedup": summary.get("speedup"),
        "timing": timing,
        "plans": summary.get("plans") or [],
        "verify": summary.get("verify"),
        "capture_step": summary.get("capture_step"),
        "fallback_steps": summary.get("fallback_steps", 0),
        "fallback_causes": summary.get("fallback_causes") or [],
        "final_loss": train_metrics.get("train/loss"),
        "metrics": train_metrics,
        "val_metrics": val_metrics,
        "seed": cfg.seed,
        "overrides": list(overrides),
        "job_num": OmegaConf.select(hydra_node, "job.num", default=None) if hydra_node else None,
        "versions": {"torch": torch.__version__, "lightning": pl.__version__},
        "config": OmegaConf.to_container(cfg, resolve=True),
    }
    result = _jsonable(result)
    (out / RESULT_FILE).write_text(json.dumps(result, indent=2) + "\n")
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

    Returns the two paths. Jobs are ordered by job number.
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
        {**{k: r.get(k) for k in SUMMARY_COLUMNS}, "job": r.get("job_num", r.get("job"))} for r in results
    ]
    csv_path, md_path = sweep_dir / "summary.csv", sweep_dir / "summary.md"
    with csv_path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=SUMMARY_COLUMNS)
        writer.writeheader()
        writer.writerows({k: _cell(v) for k, v in row.items()} for row in rows)
    lines = [
        f"# Sweep summary: {len(rows)} run{'s' if len(rows) != 1 else ''}",
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
    finished. Configured in conf/train.yaml under ``hydra.callbacks``.
    """

    def _write(self, config: DictConfig) -> None:
        sweep_dir = OmegaConf.select(config, "hydra.sweep.dir", default=None)
        if sweep_dir is not None and Path(str(sweep_dir)).is_dir():
            write_sweep_summary(str(sweep_dir))

    def on_job_end(self, config: DictConfig, job_return: Any, **kwargs: Any) -> None:
        if _is_multirun(config):
            self._write(config)

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        self._write(config)


# ---------------------------------------------------------------------- entry point
def _run_and_record(cfg: DictConfig) -> dict[str, Any]:
    """`run`, writing a failed result.json (with the error) to the run directory when it raises."""
    try:
        return run(cfg)
    except Exception as exc:
        if HydraConfig.initialized():
            hydra_cfg = HydraConfig.get()
            failed = {
                "status": "failed",
                "error": f"{type(exc).__name__}: {exc}",
                "traceback": traceback.format_exc(),
                "overrides": list(hydra_cfg.overrides.task),
                "job_num": OmegaConf.select(hydra_cfg, "job.num", default=None),
                "model": OmegaConf.select(cfg, "model._target_", default=None),
            }
            Path(hydra_cfg.runtime.output_dir, RESULT_FILE).write_text(
                json.dumps(_jsonable(failed), indent=2) + "\n"
            )
        raise


@hydra.main(config_path=str(config_dir()), config_name="train", version_base="1.3")
def main(cfg: DictConfig) -> dict[str, Any]:
    """Console entry point `l2lightning-train`: Hydra parses the overrides from sys.argv, then `run`."""
    return _run_and_record(cfg)


if __name__ == "__main__":
    main()
