"""The table of a multirun: every job's result.json collected into summary.csv and summary.md.

A sweep (``l2lightning-train -m ...``) leaves one run directory per job; comparing them means one
table. Hydra calls :class:`SweepSummary` (configured in conf/train.yaml under ``hydra.callbacks``)
after each job, so a sweep that stops half-way still leaves the table of the jobs that finished.
"""

from __future__ import annotations

import csv
import json
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback as HydraCallback
from omegaconf import DictConfig, OmegaConf

from l2lightning.app.result_record import RESULT_FILE

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
