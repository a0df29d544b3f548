"""Benchmark plots: speedup, prefetch gain against layer size, time against the floors.

Drawn on matplotlib's Agg canvas directly (no pyplot, no global backend change); matplotlib is the
``plots`` extra, imported only when a plot is drawn.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from l2lightning.tools.bench.variants import VARIANT_ORDER
from l2lightning.tools.report import BASELINES, config_label


def _rows_of(results: Any) -> list[dict[str, Any]]:
    if isinstance(results, Mapping):
        return list(results.get("results", []))
    return list(results)


def _figure(width: float, height: float, ncols: int = 1) -> tuple[Any, list[Any]]:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height), dpi=110)
    FigureCanvasAgg(fig)
    axes = fig.subplots(1, ncols, squeeze=False)[0]
    return fig, list(axes)


def _ordered_variants(rows: Sequence[Mapping[str, Any]]) -> list[str]:
    seen = {r["variant"] for r in rows}
    known = [v for v in VARIANT_ORDER if v in seen]
    return known + sorted(seen - set(known))


def _configs(rows: Sequence[Mapping[str, Any]]) -> list[str]:
    keyed = sorted(
        {(r.get("width"), r.get("depth"), r.get("batch"), config_label(r)) for r in rows}, key=lambda t: t[:3]
    )
    return [t[3] for t in keyed]


def _variant_color(variant: str) -> Any:
    from matplotlib import colormaps

    index = (
        VARIANT_ORDER.index(variant) if variant in VARIANT_ORDER else len(VARIANT_ORDER) + hash(variant) % 8
    )
    return colormaps["tab20"](index % 20)


def _legend_below(ax: Any, ncol: int = 4) -> None:
    ax.legend(fontsize=7, ncol=ncol, loc="upper center", bbox_to_anchor=(0.5, -0.22), frameon=False)


def _grouped_bars(
    ax: Any, rows: Sequence[Mapping[str, Any]], value_key: str
) -> tuple[list[str], list[str], float]:
    configs = _configs(rows)
    variants = _ordered_variants(rows)
    width = 0.8 / max(1, len(variants))
    index = {(config_label(r), r["variant"]): r for r in rows}
    for j, variant in enumerate(variants):
        xs, ys = [], []
        color = _variant_color(variant)
        for i, cfg in enumerate(configs):
            row = index.get((cfg, variant))
            if row is not None and row.get(value_key) is not None:
                xs.append(i - 0.4 + width * (j + 0.5))
                ys.append(row[value_key])
        if xs:
            ax.bar(xs, ys, width=width, label=variant, color=color)
    ax.set_xticks(range(len(configs)))
    ax.set_xticklabels(configs, rotation=20, ha="right", fontsize=8)
    return configs, variants, width


def plot_speedup(rows: Sequence[Mapping[str, Any]], path: Path) -> Path | None:
    """Bar chart: speedup of each variant over its chain's baseline, per configuration."""
    rows = [r for r in rows if r.get("speedup_vs_baseline") is not None]
    chains = [c for c in ("step", "forward_backward", "forward") if any(r.get("chain") == c for r in rows)]
    if not chains:
        return None
    fig, axes = _figure(6.5 * len(chains), 5.6, len(chains))
    for ax, chain in zip(axes, chains):
        _grouped_bars(ax, [r for r in rows if r.get("chain") == chain], "speedup_vs_baseline")
        ax.axhline(1.0, color="black", linewidth=0.8)
        ax.set_ylabel(f"speedup vs {BASELINES[chain]} (x)")
        ax.set_title(f"{chain}: speedup per configuration")
        _legend_below(ax)
    fig.tight_layout()
    fig.savefig(path)
    return path


def plot_gain_vs_layer(
    rows: Sequence[Mapping[str, Any]], path: Path, l2_bytes: int | None = None
) -> Path | None:
    """Scatter: prefetch gain (%) vs layer size (MiB), one marker per variant, the L2 size marked."""
    rows = [r for r in rows if r.get("gain_vs_no_prefetch") is not None and r.get("layer_mib") is not None]
    if not rows:
        return None
    from matplotlib.ticker import NullFormatter, ScalarFormatter

    fig, (ax,) = _figure(7.0, 5.2)
    markers = {"step": "o", "forward_backward": "s", "forward": "^"}
    for variant in _ordered_variants(rows):
        for chain, marker in markers.items():
            sel = [r for r in rows if r["variant"] == variant and r.get("chain", "step") == chain]
            if sel:
                ax.scatter(
                    [r["layer_mib"] for r in sel],
                    [100 * r["gain_vs_no_prefetch"] for r in sel],
                    label=variant if chain == "step" else f"{variant} ({chain})",
                    marker=marker,
                    color=_variant_color(variant),
                    alpha=0.85,
                )
    ax.axhline(0.0, color="black", linewidth=0.8)
    if l2_bytes:
        l2_mib = l2_bytes / (1 << 20)
        ax.axvline(l2_mib, color="red", linestyle="--", label=f"L2 = {l2_mib:.0f} MiB")
        ax.axvline(l2_mib / 2, color="red", linestyle=":", label="L2 / 2 (current + next layer fit)")
    ax.set_xscale("log")
    lo, hi = ax.get_xlim()
    ax.set_xticks([2.0**k for k in range(-6, 12) if lo <= 2.0**k <= hi])
    ax.xaxis.set_major_formatter(ScalarFormatter())
    ax.xaxis.set_minor_formatter(NullFormatter())
    ax.set_xlabel("layer weights (MiB)")
    ax.set_ylabel("gain vs no prefetch (%)")
    ax.set_title("prefetch gain vs layer size (o step, s forward+backward, ^ forward)")
    _legend_below(ax, ncol=3)
    fig.tight_layout()
    fig.savefig(path)
    return path


def plot_time_vs_floors(rows: Sequence[Mapping[str, Any]], path: Path) -> Path | None:
    """Bars: median step time per variant and configuration, with the bytes and launch floors marked."""
    rows = [r for r in rows if r.get("median_us") is not None]
    chains = [c for c in ("step", "forward_backward", "forward") if any(r.get("chain") == c for r in rows)]
    if not chains:
        return None
    fig, axes = _figure(6.5 * len(chains), 5.6, len(chains))
    for ax, chain in zip(axes, chains):
        sel = [r for r in rows if r.get("chain") == chain]
        configs, _, _ = _grouped_bars(ax, sel, "median_us")
        for i, cfg in enumerate(configs):
            row = next(r for r in sel if config_label(r) == cfg)
            for key, style, name in (
                ("floor_bytes_us", "--", "bytes floor"),
                ("floor_launch_us", ":", "launch floor"),
            ):
                if row.get(key) is not None:
                    ax.hlines(
                        row[key],
                        i - 0.45,
                        i + 0.45,
                        colors="black",
                        linestyles=style,
                        label=name if i == 0 else None,
                    )
        ax.set_yscale("log")
        ax.set_ylabel("median time per pass (us)")
        ax.set_title(f"{chain}: time vs floors")
        _legend_below(ax)
    fig.tight_layout()
    fig.savefig(path)
    return path


def make_plots(results: Any, out_dir: str | Path, l2_bytes: int | None = None) -> list[Path]:
    """Write the three plots (PNG) for a result document or list of rows; returns the files written.

    ``speedup.png`` (speedup per configuration), ``prefetch_gain_vs_layer.png`` (gain vs layer MiB
    with the L2 size marked) and ``time_vs_floors.png`` (time with floor markers). A plot without
    data is skipped. `l2_bytes` defaults to the GPU state stored in the document.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    rows = _rows_of(results)
    if l2_bytes is None and isinstance(results, Mapping):
        l2_bytes = ((results.get("environment") or {}).get("gpu") or {}).get("l2_bytes")
    written = [
        plot_speedup(rows, out / "speedup.png"),
        plot_gain_vs_layer(rows, out / "prefetch_gain_vs_layer.png", l2_bytes),
        plot_time_vs_floors(rows, out / "time_vs_floors.png"),
    ]
    return [p for p in written if p is not None]
