"""The results a user reads at a glance: per packaged family and batch, the `Trainer.fit` step time of
Lightning eager, `torch.compile(mode="reduce-overhead")` and L2GraphCallback, from committed CSVs.

    python -m l2lightning.tools.results_plot            # writes docs/img/fit_step_times.png

The four small families come from ``host_overhead.csv`` (their packaged configs with the progress
bar and logger on; reduce-overhead measured for the RL policy only), ViT and the text encoder from
``harness_families/results.csv`` (the callback with its default ``prefetch="auto"``; no
reduce-overhead run). A missing measurement stays missing: the plot says "not measured" and the
table leaves the cell empty. The README's table is :func:`markdown_table` of the same rows
(``tests/test_tools_results_plot.py`` checks that).
"""

from __future__ import annotations

import argparse
import csv
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
RESULTS = REPO / "benchmarks" / "results" / "h200"
HOST_OVERHEAD_CSV = RESULTS / "host_overhead.csv"
HARNESS_FAMILIES_CSV = RESULTS / "harness_families" / "results.csv"
PLOT = REPO / "docs" / "img" / "fit_step_times.png"
# the families of harness_families/results.csv that host_overhead.csv does not have
HARNESS_ONLY = ("vit", "text_encoder")
MACHINE = "NVIDIA H200, torch 2.11.0+cu130, Lightning 2.6.6"


@dataclass(frozen=True)
class FitStep:
    """One family at one batch size: median `Trainer.fit` step times in ms (None: not measured)."""

    family: str
    batch: int
    eager_ms: float
    compile_ro_ms: float | None
    callback_ms: float
    source: str

    @property
    def speedup(self) -> float:
        return self.eager_ms / self.callback_ms


def _ms(text: str) -> float | None:
    return float(text) if text.strip() else None


def fit_step_rows(
    host_overhead_csv: Path = HOST_OVERHEAD_CSV, harness_families_csv: Path = HARNESS_FAMILIES_CSV
) -> list[FitStep]:
    """The rows of the plot and of the README's table, in the CSVs' order."""
    rows = []
    with host_overhead_csv.open() as f:
        for r in csv.DictReader(f):
            rows.append(
                FitStep(
                    r["family"],
                    int(r["batch"]),
                    float(r["lightning_eager_ms"]),
                    _ms(r["compile_ro_ms"]),
                    float(r["callback_step_ms"]),
                    host_overhead_csv.name,
                )
            )
    times: dict[tuple[str, int], dict[str, float]] = {}
    with harness_families_csv.open() as f:
        for r in csv.DictReader(f):
            if r["family"] in HARNESS_ONLY and r["chain"] == "step":
                times.setdefault((r["family"], int(r["batch"])), {})[r["variant"]] = (
                    float(r["median_us"]) / 1e3
                )
    source = f"{harness_families_csv.parent.name}/{harness_families_csv.name}"
    for (family, batch), by_variant in times.items():
        rows.append(
            FitStep(family, batch, by_variant["lightning_eager"], None, by_variant["callback_auto"], source)
        )
    return rows


def markdown_table(rows: Sequence[FitStep]) -> str:
    """The README's table: one line per family and batch, ms per step and the callback's speedup."""

    def cell(value: float | None) -> str:
        return "" if value is None else f"{value:.2f}"

    lines = [
        "| family | batch | Lightning eager ms | `torch.compile` reduce-overhead ms | L2GraphCallback ms | speedup over eager |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r.family} | {r.batch} | {cell(r.eager_ms)} | {cell(r.compile_ro_ms)} | "
            f"{cell(r.callback_ms)} | {r.speedup:.1f}× |"
        )
    return "\n".join(lines)


def plot_fit_steps(rows: Sequence[FitStep], path: Path) -> Path:
    """One panel per family: grouped bars per batch (eager, reduce-overhead, callback), ms per step."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    families = list(dict.fromkeys(r.family for r in rows))
    fig = Figure(figsize=(12, 6.4), dpi=110)
    FigureCanvasAgg(fig)
    axes = fig.subplots(2, (len(families) + 1) // 2, squeeze=False).ravel()
    series = (
        ("Lightning eager", "eager_ms", "#9e9e9e"),
        ('torch.compile "reduce-overhead"', "compile_ro_ms", "#f0a030"),
        ("L2GraphCallback", "callback_ms", "#2a7ab8"),
    )
    width = 0.27
    for ax, family in zip(axes, families):
        mine = [r for r in rows if r.family == family]
        for k, (label, attr, color) in enumerate(series):
            for i, r in enumerate(mine):
                value = getattr(r, attr)
                x = i + (k - 1) * width
                if value is None:
                    ax.text(x, 0, "not\nmeasured", ha="center", va="bottom", fontsize=6, color="#b07010")
                    continue
                ax.bar(x, value, width, color=color, label=label if i == 0 else None)
                if attr == "callback_ms":
                    ax.text(x, value, f"{r.speedup:.1f}×", ha="center", va="bottom", fontsize=7)
        ax.set_xticks(range(len(mine)), [f"batch {r.batch}" for r in mine], fontsize=8)
        ax.set_title(f"{family}  ({mine[0].source})", fontsize=9)
        ax.set_ylabel("ms per Trainer.fit step", fontsize=8)
        ax.tick_params(axis="y", labelsize=8)
    for ax in axes[len(families) :]:
        ax.set_visible(False)
    # the legend of the panel that has every series (reduce-overhead is measured for one family only)
    handles, labels = max((ax.get_legend_handles_labels() for ax in axes), key=lambda hl: len(hl[1]))
    fig.legend(handles, labels, loc="lower center", ncol=3, fontsize=9, frameon=False)
    fig.suptitle(
        f"Trainer.fit step time per packaged family (median; lower is better; × = speedup over eager). {MACHINE}",
        fontsize=10,
    )
    fig.tight_layout(rect=(0, 0.05, 1, 0.95))
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=PLOT, help="the PNG to write (default: %(default)s)")
    parser.add_argument("--table", action="store_true", help="also print the README's Markdown table")
    args = parser.parse_args(argv)
    rows = fit_step_rows()
    print(f"wrote {plot_fit_steps(rows, args.out)}")
    if args.table:
        print(markdown_table(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
