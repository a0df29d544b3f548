"""What the callback's defaults cost: step time, fit wall time and peak memory per variant (issue 16).

Per case (bf16 MLP stacks of ``bench_callback.py``: LayerNorm, Linear, GELU x depth, fused AdamW;
default d1536x40 b16 and d1024x60 b8), one full ``Trainer.fit`` per variant, interleaved over
``--rounds`` rounds in one process (the variants' order reversed in every other round):

- ``plain``: Lightning without the callback;
- ``off``: ``L2GraphCallback(prefetch="off")``, the graph alone;
- ``default``: ``L2GraphCallback()`` (``prefetch="auto"`` with the whole-step gate);
- ``auto_no_gate``: ``prefetch="auto"`` with ``gate_pairs=0`` (the tuner's plans as they come);
- ``auto_budget_1`` and ``auto_unbounded``: the defaults with the tuner's memory budget at 1x the
  parameter bytes, and without a bound (``memory_budget=None``).

The tuner runs with ``cache=None`` in every fit, so each ``auto`` fit pays a first run's tuning.
``step_ms`` is the mean step time (``StepTimer``: start of one step to the next, CUDA events) over the
last ``--steps`` steps of the fit, after ``--untimed`` steps that hold the warm-up, the capture and
the gate's trial (3 + 1 + 1 + 2 x 24 steps with the defaults). ``fit_wall_s`` is ``Trainer.fit``'s wall
time (tuning and captures included); peak memory is ``torch.cuda.max_memory_allocated/reserved``
after ``reset_peak_memory_stats`` and an emptied cache before each fit. From the callback's summary:
the graph pool, tuning and capture seconds, and the gate's verdict.

``--families mlp_stack@16,rl_policy@4,...`` adds the packaged model families (``l2lightning.app.models``)
as cases: each family's module and precision, its data drawn once and cycled, no progress bar or
logger.

Output in ``--out``: ``default_cost.csv`` (columns ``CSV_COLUMNS``: medians over rounds) and
``default_cost.json`` (every fit, the command, the doctor's GPU check).

    python benchmarks/bench_default_cost.py --out benchmarks/results/h200
"""

from __future__ import annotations

import argparse
import csv
import gc
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from lightning.pytorch import seed_everything

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_callback import MLP, quiet_trainer, random_data  # noqa: E402  (the callback fit benchmark's)

from l2lightning import L2GraphCallback  # noqa: E402
from l2lightning.step_timer import StepTimer  # noqa: E402
from l2lightning.tools import doctor  # noqa: E402
from l2lightning.tune.memory import tensor_bytes  # noqa: E402

CSV_COLUMNS = ("case", "variant", "step_ms", "fit_wall_s", "peak_alloc_gib", "peak_reserved_gib")
VARIANTS = {
    "plain": None,
    "off": {"prefetch": "off"},
    "default": {"autotune": {"cache": None}},
    "auto_no_gate": {"autotune": {"cache": None}, "gate_pairs": 0},
    # the tuner's memory budget (default 0.25 x the parameter bytes) raised, and without a bound
    "auto_budget_1": {"autotune": {"cache": None, "memory_budget": 1.0}},
    "auto_unbounded": {"autotune": {"cache": None, "memory_budget": None}},
}
GIB = float(1 << 30)


def parse_cases(text: str) -> list[tuple[int, int, int]]:
    """``"1536x40x16,1024x60x8"`` -> [(width, depth, batch), ...]; a clear error naming `--cases`."""
    cases = []
    for item in text.split(","):
        parts = item.strip().split("x")
        if len(parts) != 3 or not all(p.isdigit() and int(p) > 0 for p in parts):
            raise ValueError(f"`--cases` takes WIDTHxDEPTHxBATCH items separated by commas, got {item!r}")
        cases.append((int(parts[0]), int(parts[1]), int(parts[2])))
    return cases


def parse_variants(text: str) -> list[str]:
    names = [v.strip() for v in text.split(",") if v.strip()]
    unknown = [v for v in names if v not in VARIANTS]
    if unknown or not names:
        raise ValueError(f"`--variants` takes names from {sorted(VARIANTS)}, got {text!r}")
    return names


def parse_families(text: str) -> list[tuple[str, int]]:
    """``"mlp_stack@16,vit@4"`` -> [(family, batch), ...] (batch 16 when left out); "" -> []."""
    from l2lightning.app.models import FAMILIES

    out = []
    for item in (i.strip() for i in text.split(",")):
        if not item:
            continue
        name, _, batch = item.partition("@")
        if name not in FAMILIES or (batch and not (batch.isdigit() and int(batch) > 0)):
            raise ValueError(
                f"`--families` takes FAMILY[@BATCH] items separated by commas, FAMILY from {sorted(FAMILIES)}, "
                f"got {item!r}"
            )
        out.append((name, int(batch) if batch else 16))
    return out


def fit_once(variant: str, width: int, depth: int, batch: int, untimed: int, steps: int) -> dict:
    """One fit of the bf16 MLP stack d`width` x `depth` at `batch`."""

    def build() -> tuple:
        model = MLP(width, depth, "fused").to(torch.bfloat16)
        return model, random_data(width, batch, untimed + steps + 2)

    return _measure(
        variant, f"d{width}x{depth} b{batch}", build, lambda n, cbs: quiet_trainer(n, cbs), untimed, steps
    )


def fit_family_once(variant: str, family: str, batch: int, untimed: int, steps: int) -> dict:
    """One fit of the packaged model family at `batch`: its module, its precision, its data drawn
    once and cycled (no data pipeline timed), without its progress bar and loggers."""
    from types import SimpleNamespace

    from bench_host_overhead import FamilySetup

    from l2lightning.tools.bench.lightning_runners import cycled_loader, lightning_trainer

    with tempfile.TemporaryDirectory() as logs:
        setup = FamilySetup(family, batch, [], Path(logs))
        precision = setup.cfg.trainer.get("precision", "32-true")

        def build() -> tuple:
            return setup.module(), cycled_loader(setup.host_batches, untimed + steps + 2)

        def trainer(max_steps: int, callbacks: list) -> object:
            return lightning_trainer(SimpleNamespace(device=0), max_steps, callbacks, precision=precision)

        return _measure(variant, f"{family} b{batch}", build, trainer, untimed, steps)


def _measure(variant: str, case: str, build, make_trainer, untimed: int, steps: int) -> dict:
    """Fit what `build()` returns (model, data) with `variant`'s callback; the step time, fit time,
    peak memory and the callback's summary."""
    seed_everything(0)
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    model, data = build()
    timer = StepTimer()
    cb = L2GraphCallback(log_timing=False, **VARIANTS[variant]) if VARIANTS[variant] is not None else None
    trainer = make_trainer(untimed + steps + 1, [timer] + ([cb] if cb is not None else []))
    started = time.perf_counter()
    trainer.fit(model, data)
    torch.cuda.synchronize()
    wall = time.perf_counter() - started
    row = {
        "case": case,
        "variant": variant,
        "step_ms": statistics.fmean(timer.window_ms(untimed, steps)),
        "fit_wall_s": wall,
        "peak_alloc_gib": torch.cuda.max_memory_allocated() / GIB,
        "peak_reserved_gib": torch.cuda.max_memory_reserved() / GIB,
        "param_gib": tensor_bytes(model.parameters()) / GIB,
    }
    if cb is not None:
        s = cb.summary()
        row.update(
            {
                "captured": s["captured"],
                "reason": s["reason"],
                "graph_replay_ms": s["graph_step_ms"],
                "graph_pool_mib": s["graph_pool_mib"],
                "tuning_s": s["tuning_s"],
                "capture_s": s["capture_s"],
                "captures": s["captures"],
                "prefetch_layers": sum(1 for r in s["plans"] if r.get("forward") or r.get("backward")),
                "prefetch_gate": s["prefetch_gate"],
                "replay_check": s["replay_check"],
            }
        )
    return row


def medians(rows: list[dict], cases: list[str], variants: list[str]) -> list[dict]:
    """Per case name and variant, the median of each CSV column over the rounds (None: every fit failed)."""
    table = []
    for case in cases:
        for variant in variants:
            mine = [r for r in rows if r["case"] == case and r["variant"] == variant and "error" not in r]
            entry = {"case": case, "variant": variant}
            for column in CSV_COLUMNS[2:]:
                entry[column] = statistics.median(r[column] for r in mine) if mine else None
            table.append(entry)
    return table


def gpu_ready(program: str, force: bool):
    """The doctor's check of GPU 0 before timing, or None (after saying why) when there is nothing to time."""
    if not torch.cuda.is_available():
        print(f"{program}: no CUDA device; nothing to time", file=sys.stderr)
        return None
    check = doctor.check_before_timing(0, force=force, program=program)
    return None if check.refused else check


def run_metadata(check) -> dict:
    """What a result file records of its run: the command, torch, the GPU and the doctor's check."""
    return {
        "command": " ".join([sys.executable, *sys.argv]),
        "torch": torch.__version__,
        "gpu": torch.cuda.get_device_name(0),
        "doctor": check.to_dict(),
        "forced": check.forced,
    }


def round_order(variants: list[str], round_index: int) -> list[str]:
    """The variants in the order one round fits them: as given in even rounds, reversed in odd ones,
    so that no variant always runs right after the same other one (a fit started just after another
    ran up to 50% slower on the H200: benchmarks/results/h200/ab_host_path_between_step_checks.json)."""
    return list(variants) if round_index % 2 == 0 else list(reversed(variants))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="output directory")
    parser.add_argument("--cases", default="1536x40x16,1024x60x8", help="WIDTHxDEPTHxBATCH, comma-separated")
    parser.add_argument(
        "--families",
        default="",
        help="packaged model families too, FAMILY[@BATCH] comma-separated (batch 16 when left out)",
    )
    parser.add_argument("--variants", default=",".join(VARIANTS), help=f"from {sorted(VARIANTS)}")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument(
        "--untimed", type=int, default=60, help="steps before the timed ones (>= 53 for the gate)"
    )
    parser.add_argument("--steps", type=int, default=60, help="timed steps per fit")
    parser.add_argument("--force", action="store_true", help=doctor.FORCE_HELP)
    args = parser.parse_args(argv)
    try:
        cases, variants = parse_cases(args.cases) if args.cases else [], parse_variants(args.variants)
        families = parse_families(args.families)
    except ValueError as exc:
        parser.error(str(exc))
    for name in ("rounds", "untimed", "steps"):
        if getattr(args, name) < 1:
            parser.error(f"`--{name}` must be >= 1, got {getattr(args, name)}")
    check = gpu_ready("bench_default_cost", args.force)
    if check is None:
        return 2
    fits = [
        (f"d{w}x{d} b{b}", lambda v, w=w, d=d, b=b: fit_once(v, w, d, b, args.untimed, args.steps))
        for w, d, b in cases
    ] + [
        (f"{f} b{b}", lambda v, f=f, b=b: fit_family_once(v, f, b, args.untimed, args.steps))
        for f, b in families
    ]
    rows = []
    for round_index in range(args.rounds):
        for case, fit in fits:
            for variant in round_order(variants, round_index):
                try:
                    rows.append(fit(variant))
                except Exception as exc:  # a failing variant is a result too
                    rows.append({"case": case, "variant": variant, "error": repr(exc)[:300]})
                print(json.dumps(rows[-1], default=str), flush=True)
    table = medians(rows, [case for case, _ in fits], variants)
    args.out.mkdir(parents=True, exist_ok=True)
    with open(args.out / "default_cost.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=CSV_COLUMNS)
        writer.writeheader()
        for entry in table:
            writer.writerow({k: (f"{v:.4f}" if isinstance(v, float) else v) for k, v in entry.items()})
    (args.out / "default_cost.json").write_text(
        json.dumps({**run_metadata(check), "runs": rows, "table": table}, indent=2, default=str)
    )
    print(f"{'case':<16}{'variant':<14}{'ms/step':>9}{'fit s':>8}{'alloc GiB':>11}{'reserved GiB':>14}")
    for e in table:
        cells = [e[c] for c in CSV_COLUMNS[2:]]
        print(
            f"{e['case']:<16}{e['variant']:<14}"
            + "".join(
                f"{v:>{w}.3f}" if v is not None else f"{'n/a':>{w}}" for v, w in zip(cells, (9, 8, 11, 14))
            )
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
