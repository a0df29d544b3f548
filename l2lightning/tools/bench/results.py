"""The harness's results: one row per variant of a case, the CSV columns, the plots.

A row carries the per-repeat medians and their CI (see :func:`l2lightning.tools.report.median_ci`),
the case's floors and whatever the variant recorded; :func:`l2lightning.tools.report.add_comparisons`
then adds the speedups. Kept apart from the run loop so that a stored sweep's rows can be rebuilt
and plotted without timing anything.
"""

from __future__ import annotations

import re
import statistics
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from l2lightning.tools import report

if TYPE_CHECKING:
    from l2lightning.tools.bench.families import FamilyCase
    from l2lightning.tools.bench.mlp import BenchCase
    from l2lightning.tools.bench.settings import BenchSettings, RunInfo

CSV_COLUMNS = (
    "config",
    "chain",
    "variant",
    "width",
    "depth",
    "batch",
    "dtype",
    "layer_mib",
    "median_us",
    "ci_lo_us",
    "ci_hi_us",
    "ci_coverage",
    "n",
    "speedup_vs_baseline",
    "speedup_vs_lightning_eager",
    "speedup_vs_eager",
    "speedup_vs_graph",
    "speedup_vs_reduce_overhead",
    "gain_vs_no_prefetch",
    "vs_best_alternative",
    "best_alternative",
    "floor_bytes_us",
    "floor_launch_us",
    "floor_us",
    "floor_bound",
    "ratio_to_floor",
    "kernel_count",
    "forced",
    "error",
)
# Appended to CSV_COLUMNS when the results hold family rows (an MLP-only CSV keeps its columns).
FAMILY_CSV_COLUMNS = ("family", "params", "captured", "capture_reason", "fallback_steps")


def gpu_slug(name: str | None) -> str:
    """``"NVIDIA H200"`` -> ``"nvidia-h200"`` (directory name for results)."""
    slug = re.sub(r"[^a-z0-9]+", "-", (name or "unknown-gpu").lower()).strip("-")
    return slug or "unknown-gpu"


def error_text(exc: BaseException) -> str:
    """The last line of `exc`'s traceback (type and message), at most 500 characters."""
    last = traceback.format_exception_only(type(exc), exc)[-1].strip()
    return last[:500]


def variant_row(
    case: BenchCase | FamilyCase,
    variant: str,
    settings: BenchSettings,
    forced: bool,
    times: Sequence[Sequence[float]] = (),
    floors_: Any = None,
    kernels: int | None = None,
    error: str | None = None,
    setup_s: float = 0.0,
    runner: RunInfo | None = None,
) -> dict[str, Any]:
    """The result row of one variant of one case (`times`: that variant's step times, one list per repeat)."""
    repeat_medians = [statistics.median(t) for t in times]
    row: dict[str, Any] = {
        "config": case.label,
        **case.key(),
        "variant": variant,
        **case.row_fields(),
        "repeats": settings.repeats,
        "steps_per_repeat": settings.steps,
        "median_us": None,
        "ci_lo_us": None,
        "ci_hi_us": None,
        "ci_coverage": None,
        "n": len(repeat_medians),
        "repeat_medians_us": repeat_medians,
        "step_times_us": [list(t) for t in times],
        "kernel_count": kernels,
        "floor_bytes_us": floors_.bytes_us if floors_ else None,
        "floor_launch_us": floors_.launch_us if floors_ else None,
        "floor_us": floors_.larger if floors_ else None,
        "floor_bound": floors_.bound if floors_ else None,
        "forced": forced,
        "error": error,
        "setup_s": round(setup_s, 3),
        "info": runner.info if runner is not None else {},
        **case.variant_fields(variant, runner),
    }
    if repeat_medians and error is None:
        ci = report.median_ci(repeat_medians)
        row.update(median_us=ci.median, ci_lo_us=ci.lo, ci_hi_us=ci.hi, ci_coverage=ci.coverage)
    return row


def print_rows(rows: Sequence[dict[str, Any]], log: Callable[[str], None]) -> None:
    """One line per row: median, CI, speedup over its baseline, prefetch gain, ratio to the floor."""
    for row in rows:
        if row.get("error"):
            log(f"  {row['variant']:<24} ERROR {row['error']}")
            continue
        speed = row.get("speedup_vs_baseline")
        gain = row.get("gain_vs_no_prefetch")
        floor = row.get("ratio_to_floor")
        log(
            f"  {row['variant']:<24}{row['median_us']:>10.1f} us  [{row['ci_lo_us']:.1f}, {row['ci_hi_us']:.1f}]"
            + (f"  {speed:5.2f}x vs {row.get('baseline')}" if speed else "")
            + (f"  prefetch {gain:+.1%}" if gain is not None else "")
            + (f"  {floor:.1f}x floor" if floor else "")
            + (f"  NOT captured: {row.get('capture_reason')}" if row.get("captured") is False else "")
        )


def write_plots(document: dict[str, Any], out: Path, log: Callable[[str], None]) -> list[Path]:
    """The MLP cases' plots in `out`, each family's in ``out/families/<family>/``; failures logged, not raised.

    Separate figures because the plots' labels and ordering come from width x depth, which
    family rows do not have (None): in one figure two families at one batch would share a label.
    """
    from l2lightning.tools.plots import make_plots

    rows = document.get("results", [])
    groups: dict[str | None, list[dict[str, Any]]] = {}
    for row in rows:
        groups.setdefault(row.get("family"), []).append(row)
    plots: list[Path] = []
    for family, group in groups.items():
        where = out if family is None else out / "families" / family
        try:
            plots += make_plots({**document, "results": group}, where)
        except Exception as exc:  # matplotlib missing or a plotting bug must not lose the timings
            log(
                f"plots skipped for {family or 'the MLP cases'}: {error_text(exc)} (`pip install matplotlib`)"
            )
    return plots
