"""What the sampled replay check (``verify="sampled"``, the default) costs a fit, per packaged family.

Per family and batch, one full ``Trainer.fit`` of ``--steps`` steps with ``L2GraphCallback(prefetch=
"off")`` (the check on, the default) and one with ``verify=False`` (off), interleaved over ``--rounds``
rounds in one process (the order reversed in every other round). Prefetch is off in both so that the
fit's wall time is the steps' and not the tuner's, which makes the check's share the larger. Each
family's module, precision and data as ``bench_default_cost.py`` fits them (drawn once, cycled).

Columns of ``replay_check.csv`` (medians over rounds): ``fit_wall_s`` with the check on and off, their
ratio, the check's own wall seconds from ``summary()["replay_check"]["seconds"]`` (the checked steps:
copies, the eager step, the comparison) and its share of the checked fit's wall time, the checks made,
those deferred by the default ``check_share`` (2% of the fit's time), those judged against two
replays' spread (kernels that are not deterministic), any mismatch, and the checks' seconds by
phase (``summary()["replay_check"]["phases_s"]``: the copies, the replay, the eager step, the
comparison, the second replay's judgment). ``replay_check.json`` holds every fit (with its place in
its process and the number of Python objects alive after it), the command and the GPU check.

With ``--isolate`` every fit runs in a fresh Python process: the fits of one process are not
independent when host-bound (a process's later fits of the same module ran slower than its first;
``ab_host_path_between_step_checks.json``), which an on/off difference of a few tenths of a
millisecond per step cannot be told from.

With ``--cupy-loaded`` the process imports CuPy and loads the prefetch kernels before its first fit,
as a fit with prefetch on (``prefetch="auto"``, the default) has done at set-up: the check then
compares with its own kernels (``l2lightning.guards.check_kernels``), which it uses only once CuPy is
imported. Without it, fits with prefetch off compare with torch's kernels.

    python benchmarks/bench_replay_check.py --out OUTDIR [--steps 1000] [--rounds 3] [--isolate] [--cupy-loaded]
"""

from __future__ import annotations

import argparse
import csv
import gc
import json
import statistics
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_default_cost  # noqa: E402  (the fit of a packaged family, its measurement)

from l2lightning.tools import doctor  # noqa: E402

VARIANTS = {"check_on": {"prefetch": "off"}, "check_off": {"prefetch": "off", "verify": False}}
DEFAULT_FAMILIES = "mlp_stack@16,rl_policy@4,recommender@16,conv_stack@16,vit@16,text_encoder@16"
CSV_COLUMNS = (
    "case",
    "fit_wall_s_on",
    "fit_wall_s_off",
    "on_over_off",
    "check_s",
    "check_share",
    "checks",
    "deferred",
    "within_spread",
    "mismatches",
    "step_ms_on",
    "step_ms_off",
    "phases_ms_on",
)
# fits made in this process so far: a row's place among them
_FITS_IN_PROCESS = 0


def _fit(variant: str, family: str, batch: int, steps: int) -> dict:
    """One fit of `family` at `batch`, `steps` steps, the check on or off (bench_default_cost's fit)."""
    global _FITS_IN_PROCESS
    bench_default_cost.VARIANTS.setdefault(variant, VARIANTS[variant])
    row = bench_default_cost.fit_family_once(variant, family, batch, 0, steps)
    _FITS_IN_PROCESS += 1
    gc.collect()
    row.update({"fit_in_process": _FITS_IN_PROCESS, "python_objects_after": len(gc.get_objects())})
    return row


def load_cupy_as_prefetch_does() -> None:
    """Import CuPy and load the prefetch kernels, as a fit with prefetch on does at set-up."""
    import torch

    from l2lightning.prefetch.kernels import load_prefetch_kernels

    load_prefetch_kernels(torch.cuda.current_device())


def _fit_isolated(variant: str, family: str, batch: int, steps: int, cupy_loaded: bool = False) -> dict:
    """The same fit in a fresh Python process (``--one``): its row from the last line it prints."""
    done = subprocess.run(
        [sys.executable, __file__, "--one", variant, f"{family}@{batch}", "--steps", str(steps)]
        + (["--cupy-loaded"] if cupy_loaded else []),
        capture_output=True,
        text=True,
        check=False,
    )
    lines = done.stdout.strip().splitlines()
    if done.returncode != 0 or not lines:
        raise RuntimeError(f"the isolated fit exited {done.returncode}: {done.stderr.strip()[-600:]}")
    return json.loads(lines[-1])


def table(rows: list[dict], cases: list[str]) -> list[dict]:
    out = []
    for case in cases:
        on = [r for r in rows if r["case"] == case and r["variant"] == "check_on" and "error" not in r]
        off = [r for r in rows if r["case"] == case and r["variant"] == "check_off" and "error" not in r]
        if not on or not off:
            out.append({"case": case})
            continue
        wall_on = statistics.median(r["fit_wall_s"] for r in on)
        wall_off = statistics.median(r["fit_wall_s"] for r in off)
        check_s = statistics.median(r["replay_check"].get("seconds", 0.0) for r in on)
        out.append(
            {
                "case": case,
                "fit_wall_s_on": round(wall_on, 4),
                "fit_wall_s_off": round(wall_off, 4),
                "on_over_off": round(wall_on / wall_off, 4),
                "check_s": round(check_s, 4),
                "check_share": round(check_s / wall_on, 4),
                "checks": statistics.median(r["replay_check"].get("checks", 0) for r in on),
                "deferred": statistics.median(r["replay_check"].get("deferred", 0) for r in on),
                "within_spread": statistics.median(r["replay_check"].get("within_spread", 0) for r in on),
                "mismatches": max(r["replay_check"].get("mismatches", 0) for r in on),
                "step_ms_on": round(statistics.median(r["step_ms"] for r in on), 4),
                "step_ms_off": round(statistics.median(r["step_ms"] for r in off), 4),
                "phases_ms_on": " ".join(
                    f"{phase}={1000 * statistics.median(r['replay_check'].get('phases_s', {}).get(phase, 0.0) for r in on):.1f}"
                    for phase in sorted({p for r in on for p in r["replay_check"].get("phases_s", {})})
                ),
            }
        )
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="output directory (required but with --one)")
    parser.add_argument("--families", default=DEFAULT_FAMILIES, help="FAMILY@BATCH items, comma-separated")
    parser.add_argument("--steps", type=int, default=1000, help="steps per fit (default 1000)")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds (default 3)")
    parser.add_argument("--force", action="store_true", help=doctor.FORCE_HELP)
    parser.add_argument("--isolate", action="store_true", help="every fit in a fresh Python process")
    parser.add_argument(
        "--cupy-loaded",
        action="store_true",
        help="import CuPy and load the prefetch kernels before the fits, as prefetch on does at set-up",
    )
    parser.add_argument(
        "--one", nargs=2, metavar=("VARIANT", "FAMILY@BATCH"), help=argparse.SUPPRESS
    )  # one fit, its row printed as JSON (what --isolate runs)
    args = parser.parse_args(argv)
    if args.steps < 10 or args.rounds < 1:
        parser.error("`--steps` must be >= 10 and `--rounds` >= 1")
    if args.one is not None:
        if args.one[0] not in VARIANTS:
            parser.error(f"`--one` variant must be one of {sorted(VARIANTS)}, got {args.one[0]!r}")
        [(family, batch)] = bench_default_cost.parse_families(args.one[1])
        if args.cupy_loaded:
            load_cupy_as_prefetch_does()
        print(json.dumps(_fit(args.one[0], family, batch, args.steps), default=str), flush=True)
        return 0
    if args.out is None:
        parser.error("the following arguments are required: --out")
    try:
        families = bench_default_cost.parse_families(args.families)
    except ValueError as exc:
        parser.error(str(exc))
    check = bench_default_cost.gpu_ready("bench_replay_check", args.force)
    if check is None:
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.cupy_loaded and not args.isolate:
        load_cupy_as_prefetch_does()
    rows: list[dict] = []
    for r in range(args.rounds):
        for family, batch in families:
            for variant in bench_default_cost.round_order(list(VARIANTS), r):
                try:
                    if args.isolate:
                        row = _fit_isolated(variant, family, batch, args.steps, args.cupy_loaded)
                    else:
                        row = _fit(variant, family, batch, args.steps)
                except Exception as exc:  # noqa: BLE001 -- a failed fit is reported, the rest go on
                    row = {
                        "case": f"{family} b{batch}",
                        "variant": variant,
                        "error": f"{type(exc).__name__}: {exc}",
                    }
                row["round"] = r
                row["isolated"] = args.isolate
                row["cupy_loaded"] = args.cupy_loaded
                rows.append(row)
                print(
                    json.dumps({k: row.get(k) for k in ("case", "variant", "fit_wall_s", "error")}),
                    flush=True,
                )
    cases = [f"{family} b{batch}" for family, batch in families]
    summary = table(rows, cases)
    with open(out / "replay_check.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=CSV_COLUMNS, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(summary)
    (out / "replay_check.json").write_text(
        json.dumps(
            {**bench_default_cost.run_metadata(check), "rows": rows, "table": summary}, indent=2, default=str
        )
    )
    for entry in summary:
        print(entry, flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
