"""Is a fit with the callback faster than the same fit without it, step by step and over the whole
fit? Idioms of ``tests/idiom_modules.py`` and ``tests/idiom_variants.py`` fitted plain and with
``L2GraphCallback()`` in turns, several rounds in one process.

``bench_idioms.py`` fits each variant once, in its own process; one plain fit against another there
differs by 0.65x to 1.69x (``benchmarks/results/h100/idioms.csv``), so one idiom at 0.93x of its first
plain fit says nothing either way. Here each idiom's plain and callback fits alternate for ``--rounds``
rounds in one process (the order of each pair alternating), every fit seeded and
``deterministic=True`` as in ``tests/idiom_harness.run_idiom``, so a cost of the callback shows as a
ratio above 1.0 in most pairs, not as one sample. Where a callback fit captured, its round also fits
the baseline (plain, switched to ``make_capturable``'s configuration at the callback's capture step)
and the callback fit must equal it bit for bit; where it was refused, it must equal its round's plain
fit.

Per idiom it reports the median per-step time (``run_idiom``'s: wall time from optimizer step 10 to the
last step, the GPU synchronized) of each variant and ``callback_over_plain`` (the ratio of the medians),
the per-pair ratios and how many are above 1.0, the median whole-fit wall time of each variant and
``fit_callback_over_plain`` (warm-up, tuning, captures and checks included: "slower over its fit?"),
how many callback fits captured, whether every one equalled its reference, and the refusal's text.

Default idioms: those expected to be refused (``--only`` names any). On a CPU (``--accelerator cpu``)
the callback refuses every fit at its set-up for want of CUDA: a check of the script, not a
measurement.

    python3 benchmarks/bench_idiom_pairs.py --out OUT [--only a,b] [--rounds 5] [--steps 60]

Writes ``OUT/idiom_pairs.csv`` and ``OUT/idiom_pairs.json`` (rows, every fit, machine, GPU state,
command).
"""

from __future__ import annotations

import argparse
import csv
import json
import shlex
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT / "benchmarks") not in sys.path:  # loaded from its file by the tests, not run as a script
    sys.path.insert(0, str(ROOT / "benchmarks"))

from run_record import machine_record  # noqa: E402 -- after the path

COLUMNS = [
    "module",
    "rounds",
    "captured_fits",
    "equal_every_fit",
    "plain_ms",
    "callback_ms",
    "callback_over_plain",
    "pairs_callback_slower",
    "plain_fit_s",
    "callback_fit_s",
    "fit_callback_over_plain",
    "reason",
]


def refused_idioms() -> list[str]:
    """The idioms (``tests/idiom_modules.py``) and variants (``tests/idiom_variants.py``) expected refused."""
    from tests.idiom_modules import IDIOMS
    from tests.idiom_variants import IDIOM_VARIANTS

    return [name for name, idiom in {**IDIOMS, **IDIOM_VARIANTS}.items() if idiom.expect == "refuse"]


def summarize(name: str, fits: list[dict[str, Any]]) -> dict[str, Any]:
    """One idiom's row from its fits (``variant``, ``round``, ``step_ms``, ``fit_s``, ``captured``,
    ``equal``, ``reason``); a pair's ratio is callback over plain of the same round."""
    plain = {f["round"]: f for f in fits if f["variant"] == "plain"}
    callback = {f["round"]: f for f in fits if f["variant"] == "callback"}
    rounds = sorted(set(plain) & set(callback))
    ratios = [
        callback[r]["step_ms"] / plain[r]["step_ms"]
        for r in rounds
        if callback[r]["step_ms"] and plain[r]["step_ms"]
    ]

    def median(values: list[Any]) -> float | None:
        values = [v for v in values if v is not None]
        return statistics.median(values) if values else None

    def over(a: float | None, b: float | None) -> float | None:
        return a / b if a and b else None

    plain_ms = median([plain[r]["step_ms"] for r in rounds])
    callback_ms = median([callback[r]["step_ms"] for r in rounds])
    plain_fit_s = median([plain[r]["fit_s"] for r in rounds])
    callback_fit_s = median([callback[r]["fit_s"] for r in rounds])
    return {
        "module": name,
        "rounds": len(rounds),
        "captured_fits": sum(bool(callback[r]["captured"]) for r in rounds),
        "equal_every_fit": all(callback[r]["equal"] for r in rounds),
        "plain_ms": plain_ms,
        "callback_ms": callback_ms,
        "callback_over_plain": over(callback_ms, plain_ms),
        "pair_ratios": ratios,
        "pairs_callback_slower": sum(r > 1.0 for r in ratios),
        "plain_fit_s": plain_fit_s,
        "callback_fit_s": callback_fit_s,
        "fit_callback_over_plain": over(callback_fit_s, plain_fit_s),
        "reason": next((callback[r]["reason"] for r in rounds if callback[r]["reason"]), ""),
    }


def _fit(
    name: str, variant: str, steps: int, accelerator: str, rnd: int, switch_step: int | None = 0
) -> tuple[dict[str, Any], Any]:
    from tests.idiom_harness import run_idiom

    run = run_idiom(name, variant, steps=steps, accelerator=accelerator, switch_step=switch_step)
    if run.error:
        raise RuntimeError(f"{name}: the {variant} fit of round {rnd} crashed: {run.error}")
    fit = {
        "variant": variant,
        "round": rnd,
        "step_ms": run.step_ms,
        "fit_s": run.fit_s,
        "captured": run.captured,
        "reason": run.reason,
        "refused_at_setup": run.refused_at_setup,
    }
    return fit, run


def measure(name: str, rounds: int, steps: int, accelerator: str) -> list[dict[str, Any]]:
    """`rounds` pairs of a plain and a callback fit of idiom `name`, the order alternating by round.
    A callback fit that captured is compared bit for bit with a baseline fit switched where it switched
    (run after the pair, untimed in the table); one that was refused, with its round's plain fit."""
    from tests.idiom_harness import compare

    fits = []
    for rnd in range(rounds):
        order = ("plain", "callback") if rnd % 2 == 0 else ("callback", "plain")
        runs = {}
        pair = []
        for variant in order:
            fit, runs[variant] = _fit(name, variant, steps, accelerator, rnd)
            pair.append(fit)
        reference = runs["plain"]
        if runs["callback"].captured:
            switch = runs["callback"].summary.get("capturable_from_step")
            _, reference = _fit(name, "baseline", steps, accelerator, rnd, switch_step=switch)
        difference = compare(runs["callback"], reference)
        for fit in pair:
            fit["equal"] = difference is None
            fit["difference"] = difference
            fit["reference"] = reference.variant
        fits += pair
    return fits


def _gpu_state(accelerator: str) -> dict[str, Any]:
    """The doctor's readiness verdict before timing (clocks, other processes, throttling), or why none."""
    if accelerator != "gpu":
        return {"checked": False, "why": "CPU run"}
    from l2lightning.tools import doctor

    state = doctor.collect(0, load_seconds=0.6)
    ready, reasons = doctor.ready_for_timing(state, doctor.diagnose(state))
    return {"checked": True, "ready": ready, "not_ready_reasons": reasons, "gpu_name": state.get("gpu_name")}


def _machine(accelerator: str) -> dict[str, Any]:
    import torch

    gpu = accelerator == "gpu" and torch.cuda.is_available()
    return {**machine_record(torch.cuda.get_device_name(0) if gpu else None), "accelerator": accelerator}


def _fmt(value: Any) -> Any:
    return f"{value:.4f}" if isinstance(value, float) else value


def write(out: Path, rows: list[dict[str, Any]], fits: dict[str, list], meta: dict[str, Any]) -> None:
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "idiom_pairs.csv", "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(COLUMNS)
        for row in rows:
            writer.writerow([_fmt(row[c]) for c in COLUMNS])
    payload = {"rows": rows, "fits": fits, **meta}
    (out / "idiom_pairs.json").write_text(json.dumps(payload, indent=2, default=str) + "\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="directory for idiom_pairs.csv and .json")
    parser.add_argument(
        "--only", default="", help="comma-separated idiom names (default: the refused idioms)"
    )
    parser.add_argument("--rounds", type=int, default=5, help="pairs of fits per idiom (default 5)")
    parser.add_argument("--steps", type=int, default=60, help="batches per fit (default 60)")
    parser.add_argument(
        "--accelerator", choices=("gpu", "cpu"), default=None, help="default: gpu if CUDA is available"
    )
    args = parser.parse_args(argv)
    if args.rounds < 1:
        parser.error(f"--rounds must be at least 1, got {args.rounds}")
    if args.steps < 12:
        parser.error(
            f"--steps must be at least 12 (the time is taken from optimizer step 10), got {args.steps}"
        )
    sys.path.insert(0, str(ROOT))
    import torch

    from tests.idiom_modules import IDIOMS
    from tests.idiom_variants import IDIOM_VARIANTS

    accelerator = args.accelerator or ("gpu" if torch.cuda.is_available() else "cpu")
    names = [n.strip() for n in args.only.split(",") if n.strip()] or refused_idioms()
    unknown = [n for n in names if n not in IDIOMS and n not in IDIOM_VARIANTS]
    if unknown:
        parser.error(f"--only: unknown idioms {unknown}; known: {sorted({**IDIOMS, **IDIOM_VARIANTS})}")
    meta = {
        "machine": _machine(accelerator),
        "gpu_state": _gpu_state(accelerator),
        "command": " ".join(
            shlex.quote(a) for a in [sys.executable, *(sys.argv if argv is None else [__file__, *argv])]
        ),
        "rounds": args.rounds,
        "steps": args.steps,
    }
    rows, fits = [], {}
    started = time.perf_counter()
    for name in names:
        fits[name] = measure(name, args.rounds, args.steps, accelerator)
        rows.append(summarize(name, fits[name]))
        r = rows[-1]
        ratio = "-" if r["callback_over_plain"] is None else f"{r['callback_over_plain']:.3f}"
        fit_ratio = "-" if r["fit_callback_over_plain"] is None else f"{r['fit_callback_over_plain']:.3f}"
        print(
            f"{name:30s} plain {r['plain_ms'] or 0:8.3f} ms  callback {r['callback_ms'] or 0:8.3f} ms  "
            f"ratio {ratio}  slower in {r['pairs_callback_slower']}/{r['rounds']} pairs  "
            f"fit ratio {fit_ratio}  captured {r['captured_fits']}/{r['rounds']}  equal {r['equal_every_fit']}",
            flush=True,
        )
        meta["wall_s"] = round(time.perf_counter() - started, 1)
        write(args.out, rows, fits, meta)  # after every idiom: a run cut by a time limit keeps its rows
    print(f"wrote {args.out / 'idiom_pairs.csv'} and {args.out / 'idiom_pairs.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
