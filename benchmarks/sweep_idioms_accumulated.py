"""Every idiom of ``tests/idiom_modules.py`` and ``tests/idiom_variants.py`` again with gradient accumulation, on the CPU graph emulator.

Each idiom that does not accumulate already is fit with ``accumulate_grad_batches=FACTOR`` added to
its Trainer arguments: plain, with ``L2GraphCallback`` and against its ``make_capturable`` baseline
(``tests/idiom_harness.judge``), so every micro-batch of every window goes through the graph of its
role. The verdict per idiom: captured and bitwise its baseline, or refused by name and bitwise plain.
A module Lightning itself refuses to accumulate (manual optimization) is recorded as such.

Usage: python benchmarks/sweep_idioms_accumulated.py --out DIR [--factor 2] [--steps 24] [--only a,b]
Writes DIR/idioms_accumulated_fFACTOR.csv and .json. Needs no GPU (the emulator stands in for CUDA graphs).
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import json
import sys
import time
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="directory for the CSV and JSON")
    parser.add_argument("--factor", type=int, default=2, help="accumulate_grad_batches (at least 2)")
    parser.add_argument("--steps", type=int, default=24, help="batches per fit")
    parser.add_argument("--only", default="", help="comma-separated idiom names (default: all)")
    args = parser.parse_args()
    if args.factor < 2:
        parser.error(f"--factor must be at least 2 (got {args.factor}): 1 is no accumulation")
    if args.steps < 1:
        parser.error(f"--steps must be positive (got {args.steps})")
    sys.path.insert(0, str(ROOT))
    import torch

    torch.set_num_threads(1)  # as the CPU tests run the emulator: bitwise-repeatable reductions
    from lightning.pytorch.utilities.exceptions import MisconfigurationException

    from tests import graph_emulator, idiom_harness, idiom_modules, idiom_variants

    graph_emulator.install(lambda owner, name, value: setattr(owner, name, value))
    idiom_harness._EXTRA_CAPTURABLE_DEVICES = ("cpu",)  # the baseline switches where the callback did
    tables = (idiom_modules.IDIOMS, idiom_variants.IDIOM_VARIANTS)
    names = [n for n in idiom_modules.IDIOMS] + [
        n for n in idiom_variants.IDIOM_VARIANTS if n not in idiom_modules.IDIOMS
    ]
    if args.only:
        wanted = args.only.split(",")
        unknown = sorted(set(wanted) - set(names))
        if unknown:
            parser.error(f"--only: unknown idioms {unknown}; known: {', '.join(names)}")
        names = wanted
    rows = []
    started = time.perf_counter()
    for name in names:
        idiom = idiom_modules.IDIOMS.get(name) or idiom_variants.IDIOM_VARIANTS[name]
        if idiom.trainer_kwargs.get("accumulate_grad_batches", 1) != 1:
            continue  # accumulates already (tests/graph/test_accumulation_cpu.py)
        accumulated = dataclasses.replace(
            idiom, trainer_kwargs={**idiom.trainer_kwargs, "accumulate_grad_batches": args.factor}
        )
        for table in tables:
            if name in table:
                table[name] = accumulated
        row = {"module": name, "verdict": "", "captured": None, "equal": None, "graphs": None, "reason": ""}
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                result = idiom_harness.judge(name, steps=args.steps, accelerator="cpu", recheck_plain=False)
        except MisconfigurationException as exc:
            row.update(verdict="Lightning refuses it", reason=str(exc).splitlines()[0])
        else:
            summary = result["extra"].get("summary") or {}
            row.update(
                captured=result["captured"],
                equal=result["equal"],
                graphs=summary.get("graphs"),
                reason=result["reason"] or result["detail"] or "",
            )
            if not result["equal"]:
                row["verdict"] = "DIFFERS"
            else:
                row["verdict"] = "captured, its baseline" if result["captured"] else "refused by name, plain"
        rows.append(row)
        print(f"{name:32s} {row['verdict']:24s} graphs={row['graphs']}  {row['reason'][:90]}", flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    fields = ["module", "verdict", "captured", "equal", "graphs", "reason"]
    stem = f"idioms_accumulated_f{args.factor}"
    with open(args.out / f"{stem}.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=fields)
        writer.writeheader()
        writer.writerows(rows)
    import lightning

    meta = {
        "command": "python benchmarks/sweep_idioms_accumulated.py " + " ".join(sys.argv[1:]),
        "factor": args.factor,
        "steps": args.steps,
        "torch": torch.__version__,
        "lightning": lightning.__version__,
        "wall_s": round(time.perf_counter() - started, 1),
        "rows": rows,
    }
    (args.out / f"{stem}.json").write_text(json.dumps(meta, indent=1, default=str) + "\n")
    differ = [r["module"] for r in rows if r["verdict"] == "DIFFERS"]
    print(f"{len(rows)} idioms; differing from their reference: {differ or 'none'}")
    return 1 if differ else 0


if __name__ == "__main__":
    raise SystemExit(main())
