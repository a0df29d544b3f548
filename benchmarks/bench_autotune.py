"""Benchmark of the measured autotuner (issue 4) on held-out chain configurations.

For each configuration (family x width x batch x phase) it builds a bf16 chain whose weights total
about 3x the GPU's L2, tunes it with :class:`l2lightning.Autotuner` (no cache: every decision is
measured here), captures three CUDA graphs of the same chain (plain, tuned plans, the tuned plans
aimed at the wrong layer = decoy), times their replays interleaved in one process (CUDA-event
medians, the order rotated every round) and checks that outputs and gradients are bit-identical.

The default widths are held out: none of them was used while developing the tuner (the H200
measurements note used 768/1024/1536/2560/3072/4096, the GPU tests use 256 and 2560, the CPU tests
fake their timings). Every row says whether its width is held out.

Summary targets: mean gain >= +3% over configurations with 2-16 MiB layers at batch <= 16; worst
configuration >= -1%; tuning time <= 0.6 s per layer shape.

The doctor checks the GPU state first (`l2lightning doctor`); timing is refused on a GPU that is not
ready unless `--force`. Its verdict is stored under `meta.doctor` in autotune.json, and one
telemetry sample taken after the grid under `meta.gpu_state_after`.

Usage:
    python benchmarks/bench_autotune.py --out benchmarks/results/h200/autotune            # full grid
    python benchmarks/bench_autotune.py --quick --out /tmp/autotune-quick                  # < 3 min
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import platform
import shlex
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

from l2lightning.prefetch.chain import device_l2_bytes, discover_chain
from l2lightning.prefetch.hooks import PrefetchHooks
from l2lightning.prefetch.plan import MIB
from l2lightning.tools import doctor
from l2lightning.tune.chain_timing import capture_chain, interleaved_replay_us
from l2lightning.tune.search import Autotuner
from l2lightning.tune.stats import mean_ci

DEV_WIDTHS = (256, 768, 1024, 1536, 2560, 3072, 4096)  # seen while developing (notes, GPU tests)
HELD_OUT_WIDTHS = (1280, 1792, 2304, 2816, 3584)
BATCHES = (1, 4, 16, 64)
FAMILIES = ("ln_linear_gelu", "linear_relu")
PHASES = ("fwd", "fwd+bwd")
QUICK = {"widths": (1792, 2816), "batches": (4, 16), "families": FAMILIES, "phases": PHASES}
TARGET_MEAN_GAIN, TARGET_WORST, TARGET_TUNE_S = 0.03, -0.01, 0.6


# ---------------------------------------------------------------------- GPU state
def device_name(meta: dict[str, Any]) -> str:
    """The GPU's name in a run's meta: from the doctor's state, or (runs stored before it) torch's."""
    state = meta.get("doctor", {}).get("state", {})
    legacy = meta.get("gpu_state_before", {}).get("torch_device", {})
    return state.get("gpu_name") or legacy.get("name") or "?"


def state_warnings(check: doctor.TimingCheck) -> list[str]:
    """The doctor's reasons not to time, then its warnings (a P2 GPU, a lowered power limit, ...)."""
    return check.reasons + [f.title for f in check.findings if f.level == "warning" and not f.blocks_timing]


def versions() -> dict[str, str]:
    from l2lightning.tune.cache import current_versions

    out = current_versions()
    out["python"] = platform.python_version()
    out["cuda"] = str(torch.version.cuda)
    return out


# ---------------------------------------------------------------------- models and graphs
def build(family: str, d: int, n_layers: int) -> nn.Sequential:
    if family == "ln_linear_gelu":
        blocks = [nn.Sequential(nn.LayerNorm(d), nn.Linear(d, d), nn.GELU()) for _ in range(n_layers)]
    elif family == "linear_relu":
        blocks = [nn.Sequential(nn.Linear(d, d), nn.ReLU()) for _ in range(n_layers)]
    else:
        raise ValueError(f"`family` must be one of {FAMILIES}, got {family!r}")
    return nn.Sequential(*blocks).to("cuda", torch.bfloat16)


def bit_identical(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


# ---------------------------------------------------------------------- one configuration
def run_config(family: str, d: int, b: int, phase: str, l2: int, args: argparse.Namespace) -> dict[str, Any]:
    layer_bytes = d * d * 2
    n_layers = max(4, round(args.l2_multiple * l2 / layer_bytes))
    row: dict[str, Any] = {
        "family": family,
        "width": d,
        "batch": b,
        "phase": phase,
        "layers": n_layers,
        "layer_mib": round(layer_bytes / MIB, 3),
        "total_mib": round(n_layers * layer_bytes / MIB, 1),
        "held_out": d not in DEV_WIDTHS,
    }
    torch.manual_seed(0)
    model = build(family, d, n_layers)
    x = torch.randn(b, d, device="cuda", dtype=torch.bfloat16)
    backward = phase == "fwd+bwd"
    chain = discover_chain(model, x)
    # No memory budget: this benchmark judges the search over full-length chains, as its committed
    # results did (the default budget leaves most of these shapes untuned; see tune/memory.py)
    tuner = Autotuner(budget_s=args.budget, cache=None, memory_budget=None)
    t0 = time.perf_counter()
    report = tuner.tune(chain, x.device, ("forward", "backward") if backward else ("forward",))
    row["tune_wall_s"] = round(time.perf_counter() - t0, 3)
    row["tune_s_per_shape_max"] = round(max(report.seconds_per_shape().values(), default=0.0), 3)
    row["chosen"] = {f"{r.phase}:{r.shape}": r.label for r in report.rows if r.chosen}
    row["tuning_rows"] = [r.to_dict() for r in report.rows if r.measured]
    names = [layer.name for layer in chain]
    forward = dict(zip(names, report.plans_for(chain, "forward")))
    backward_plans = dict(zip(names, report.plans_for(chain, "backward"))) if backward else None

    plain, w_plain = capture_chain(model, x, backward)
    graphs, written = [plain], [w_plain]
    for decoy in (False, True):
        hooks = PrefetchHooks(
            model, x, backward=backward, plans=forward, backward_plans=backward_plans, decoy=decoy
        )
        g, w = capture_chain(model, x, backward)
        hooks.remove()
        graphs.append(g)
        written.append(w)
    times = interleaved_replay_us(graphs, args.rounds, args.replays)
    p, t, dcy = (statistics.median(ts) for ts in times)
    gains = [1 - ti / pi for pi, ti in zip(times[0], times[1])]
    ci = mean_ci(gains)
    # replay plain then tuned and compare what each wrote (the prefetch never writes memory)
    identical = True
    for g, w in zip(graphs[1:], written[1:]):
        plain.replay()
        g.replay()
        torch.cuda.synchronize()
        identical &= bit_identical(w_plain, w)
    row.update(
        plain_us=round(p, 2),
        tuned_us=round(t, 2),
        decoy_us=round(dcy, 2),
        tuned_ratio=round(t / p, 4),
        decoy_ratio=round(dcy / p, 4),
        gain=round(1 - t / p, 4),
        gain_ci=[round(ci.low, 4), round(ci.high, 4)],
        decoy_gain=round(1 - dcy / p, 4),
        bit_identical=identical,
    )
    del graphs, written, plain, model
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    return row


# ---------------------------------------------------------------------- summary and output
def summarize(rows: list[dict[str, Any]]) -> dict[str, Any]:
    ok = [r for r in rows if "error" not in r]
    target = [r for r in ok if 2 <= r["layer_mib"] <= 16 and r["batch"] <= 16]
    worst = min(ok, key=lambda r: r["gain"], default=None)
    mean_gain = statistics.fmean(r["gain"] for r in target) if target else math.nan
    max_tune = max((r["tune_s_per_shape_max"] for r in ok), default=math.nan)
    # Where the tuner kept no plan, the "tuned" graph does the plain graph's work: the spread of
    # those gains is the bench's own floor (two captures of the same work placed differently).
    with_plan = [r for r in ok if r["chosen"]]
    same_work = [r["gain"] for r in ok if not r["chosen"]]
    worst_with_plan = min(with_plan, key=lambda r: r["gain"], default=None)
    return {
        "configs": len(rows),
        "errors": len(rows) - len(ok),
        "held_out_configs": sum(1 for r in ok if r["held_out"]),
        "target_set": "2-16 MiB layers, batch <= 16",
        "target_configs": len(target),
        "mean_gain_target_set": mean_gain,
        "mean_gain_target_met": bool(mean_gain >= TARGET_MEAN_GAIN),
        "worst_config": None
        if worst is None
        else {k: worst[k] for k in ("family", "width", "batch", "phase", "gain")},
        "worst_gain": None if worst is None else worst["gain"],
        "worst_target_met": bool(worst is not None and worst["gain"] >= TARGET_WORST),
        "max_tune_s_per_shape": max_tune,
        "tune_target_met": bool(max_tune <= TARGET_TUNE_S),
        "configs_with_a_chosen_plan": len(with_plan),
        "worst_config_with_a_plan": None
        if worst_with_plan is None
        else {k: worst_with_plan[k] for k in ("family", "width", "batch", "phase", "gain")},
        "mean_gain_with_a_plan": statistics.fmean(r["gain"] for r in with_plan) if with_plan else None,
        "same_work_gain_range": [min(same_work), max(same_work)] if same_work else None,
        "all_bit_identical": all(r["bit_identical"] for r in ok),
    }


CSV_FIELDS = [
    "family", "width", "batch", "phase", "held_out", "layers", "layer_mib", "total_mib", "plain_us", "tuned_us",
    "decoy_us", "tuned_ratio", "decoy_ratio", "gain", "gain_ci", "decoy_gain", "chosen", "tune_s_per_shape_max",
    "tune_wall_s", "bit_identical", "error",
]  # fmt: skip


def markdown(rows: list[dict[str, Any]], summary: dict[str, Any], meta: dict[str, Any]) -> str:
    lines = [
        "# Autotuner benchmark",
        "",
        f"Command: `{meta['command']}`",
        f"Device: {device_name(meta)}; versions: "
        + ", ".join(f"{k} {v}" for k, v in meta["versions"].items()),
        f"Held-out widths (not used while developing): {', '.join(map(str, HELD_OUT_WIDTHS))}; "
        f"widths seen in development: {', '.join(map(str, DEV_WIDTHS))}.",
        "",
        "| family | d | batch | phase | held out | layer MiB | plain µs | tuned µs | decoy µs | tuned/plain | "
        "decoy/plain | gain [95% CI] | chosen | tune s/shape | bits equal |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if "error" in r:
            lines.append(
                f"| {r['family']} | {r['width']} | {r['batch']} | {r['phase']} | error: {r['error']} |"
            )
            continue
        chosen = "; ".join(f"{k.split(':')[0]} {v}" for k, v in r["chosen"].items()) or "plain"
        lines.append(
            f"| {r['family']} | {r['width']} | {r['batch']} | {r['phase']} | {'yes' if r['held_out'] else 'no'} | "
            f"{r['layer_mib']:.1f} | {r['plain_us']:.1f} | {r['tuned_us']:.1f} | {r['decoy_us']:.1f} | "
            f"{r['tuned_ratio']:.4f} | {r['decoy_ratio']:.4f} | {r['gain']:+.2%} [{r['gain_ci'][0]:+.2%}, "
            f"{r['gain_ci'][1]:+.2%}] | {chosen} | {r['tune_s_per_shape_max']:.2f} | {r['bit_identical']} |"
        )
    s = summary
    worst = s["worst_config"] or {}
    lines += [
        "",
        "## Summary",
        f"- mean gain over {s['target_configs']} configs with {s['target_set']}: {s['mean_gain_target_set']:+.2%} "
        f"(target >= {TARGET_MEAN_GAIN:+.0%}: {'met' if s['mean_gain_target_met'] else 'NOT met'})",
        f"- worst config: {worst.get('family')} d{worst.get('width')} b{worst.get('batch')} {worst.get('phase')} "
        f"{(s['worst_gain'] or 0):+.2%} (target >= {TARGET_WORST:+.0%}: {'met' if s['worst_target_met'] else 'NOT met'})",
        f"- max tuning time per shape: {s['max_tune_s_per_shape']:.2f} s (target <= {TARGET_TUNE_S} s: "
        f"{'met' if s['tune_target_met'] else 'NOT met'})",
        f"- configs with a chosen plan: {s['configs_with_a_chosen_plan']} of {s['configs'] - s['errors']}; "
        f"errors: {s['errors']}; outputs and gradients bit-identical: {s['all_bit_identical']}",
    ]
    plan_worst = s.get("worst_config_with_a_plan")
    if plan_worst:
        lines.append(
            f"- configs with a chosen plan: mean {s['mean_gain_with_a_plan']:+.2%}, worst {plan_worst['family']} "
            f"d{plan_worst['width']} b{plan_worst['batch']} {plan_worst['phase']} {plan_worst['gain']:+.2%}"
        )
    if s.get("same_work_gain_range"):
        low, high = s["same_work_gain_range"]
        lines.append(
            f"- configs without a plan (the 'tuned' graph does the plain graph's work): {low:+.2%} to "
            f"{high:+.2%}, the spread between two captures of the same work"
        )
    for w in meta["warnings"]:
        lines.append(f"- WARNING: {w}")
    return "\n".join(lines) + "\n"


def resummarize(path: Path, out: Path) -> int:
    """Rewrite a stored run's summary (autotune.json, summary.md) with this script's summarize()."""
    stored = json.loads(path.read_text())
    stored["summary"] = summarize(stored["rows"])
    stored["meta"]["resummarized_by"] = shlex.join([sys.executable, *sys.argv])
    out.mkdir(parents=True, exist_ok=True)
    (out / "autotune.json").write_text(json.dumps(stored, indent=1, default=str))
    text = markdown(stored["rows"], stored["summary"], stored["meta"])
    (out / "summary.md").write_text(text)
    print(text)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--out", type=Path, required=True, help="directory for autotune.json, autotune.csv, summary.md"
    )
    parser.add_argument(
        "--quick", action="store_true", help="reduced grid (finishes in < 3 minutes on an H200)"
    )
    parser.add_argument("--widths", type=int, nargs="+", help=f"default: held-out {HELD_OUT_WIDTHS}")
    parser.add_argument("--batches", type=int, nargs="+", help=f"default: {BATCHES}")
    parser.add_argument("--families", nargs="+", choices=FAMILIES, help=f"default: {FAMILIES}")
    parser.add_argument("--phases", nargs="+", choices=PHASES, help=f"default: {PHASES}")
    parser.add_argument("--rounds", type=int, default=15, help="interleaved timing rounds per config")
    parser.add_argument("--replays", type=int, default=10, help="graph replays per timing sample")
    parser.add_argument("--budget", type=float, default=0.6, help="tuning seconds per layer shape")
    parser.add_argument("--l2-multiple", type=float, default=3.0, help="total weights as a multiple of L2")
    parser.add_argument(
        "--resummarize",
        type=Path,
        metavar="AUTOTUNE_JSON",
        help="no timing: recompute the summary of a stored autotune.json and rewrite it and summary.md in --out",
    )
    parser.add_argument("--force", action="store_true", help=doctor.FORCE_HELP)
    args = parser.parse_args(argv)
    if args.resummarize is not None:
        return resummarize(args.resummarize, args.out)
    if args.rounds < 3 or args.replays < 1:
        parser.error("`--rounds` must be >= 3 and `--replays` >= 1")

    from l2lightning._env import prefetch_unavailable_reason

    reason = prefetch_unavailable_reason()
    if reason:
        print(f"bench_autotune needs a CUDA GPU with CuPy: {reason}", file=sys.stderr)
        return 2
    grid = dict(QUICK) if args.quick else {
        "widths": HELD_OUT_WIDTHS, "batches": BATCHES, "families": FAMILIES, "phases": PHASES
    }  # fmt: skip
    for key in ("widths", "batches", "families", "phases"):
        if getattr(args, key):
            grid[key] = tuple(getattr(args, key))
    device = torch.device("cuda", torch.cuda.current_device())
    check = doctor.check_before_timing(device.index, force=args.force, program="bench_autotune")
    if check.refused:
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    l2 = device_l2_bytes(device)
    warnings = state_warnings(check)
    meta = {
        "command": shlex.join([sys.executable, *sys.argv]),
        "grid": {k: list(v) for k, v in grid.items()},
        "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "versions": versions(),
        "doctor": check.to_dict(),
        "forced": check.forced,
        "held_out_widths": list(HELD_OUT_WIDTHS),
        "dev_widths": list(DEV_WIDTHS),
        "warnings": warnings,
    }
    print(f"device {device_name(meta)}, L2 {l2 / MIB:.0f} MiB")
    for w in warnings:
        print(f"WARNING: {w}")
    held = [w for w in grid["widths"] if w not in DEV_WIDTHS]
    print(f"held-out widths in this grid (not used while developing): {held}; dev widths: "
          f"{[w for w in grid['widths'] if w in DEV_WIDTHS]}")  # fmt: skip

    rows: list[dict[str, Any]] = []
    t_start = time.perf_counter()
    for family in grid["families"]:
        for d in grid["widths"]:
            for b in grid["batches"]:
                for phase in grid["phases"]:
                    try:
                        row = run_config(family, d, b, phase, l2, args)
                    except Exception as exc:  # one broken config must not lose the rest of the grid
                        row = {"family": family, "width": d, "batch": b, "phase": phase,
                               "held_out": d not in DEV_WIDTHS, "error": f"{type(exc).__name__}: {exc}"}  # fmt: skip
                        torch.cuda.synchronize()
                        torch.cuda.empty_cache()
                    rows.append(row)
                    if "error" in row:
                        print(f"{family:15s} d{d:<5d} b{b:<3d} {phase:8s} ERROR {row['error']}", flush=True)
                    else:
                        print(
                            f"{family:15s} d{d:<5d} b{b:<3d} {phase:8s} {row['layer_mib']:5.1f} MiB x{row['layers']:<3d} "
                            f"plain {row['plain_us']:8.1f} us  tuned {row['tuned_ratio']:.4f}  decoy {row['decoy_ratio']:.4f}  "
                            f"gain {row['gain']:+.2%}  tune {row['tune_s_per_shape_max']:.2f} s/shape  "
                            f"{'; '.join(row['chosen'].values()) or 'plain'}  bits {'ok' if row['bit_identical'] else 'DIFFER'}",
                            flush=True,
                        )
    meta["elapsed_s"] = round(time.perf_counter() - t_start, 1)
    meta["gpu_state_after"] = doctor.read_sample(device.index)
    summary = summarize(rows)
    (args.out / "autotune.json").write_text(
        json.dumps({"meta": meta, "summary": summary, "rows": rows}, indent=1, default=str)
    )
    with open(args.out / "autotune.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=CSV_FIELDS, extrasaction="ignore")
        writer.writeheader()
        for r in rows:
            writer.writerow({**r, "chosen": "; ".join(f"{k}={v}" for k, v in r.get("chosen", {}).items())})
    text = markdown(rows, summary, meta)
    (args.out / "summary.md").write_text(text)
    print(text)
    print(f"wrote {args.out / 'autotune.json'}, autotune.csv, summary.md in {meta['elapsed_s']} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
