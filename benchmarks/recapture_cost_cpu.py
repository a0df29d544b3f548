"""The host seconds of a re-capture on the CPU graph emulator, with and without the source-path cache.

A re-capture runs the step once more under the tracer, re-reads the code the step calls
(``called_code.analyse_called_code``) and captures. The last of those is the emulator's here, so
only the host work is measured, which is the same Python on a GPU machine. Per round, one fit of the
``epoch_weighted_aux`` idiom (``tests/idiom_variants.py``: a loss weight from ``current_epoch``, three
20-step epochs, so two re-captures) with ``L2GraphCallback(prefetch="off", verify=False)`` per
variant, interleaved: ``cached`` (as shipped: ``step_source._is_user_code`` keeps its verdict per
code file name) and ``uncached`` (every call judges the path again, as before the cache). Reported
per variant: the medians of ``summary()["recapture_s"]`` and ``["capture_s"]``.

    python benchmarks/recapture_cost_cpu.py --out OUTDIR [--rounds 5]   (writes OUTDIR/recapture_cost_cpu.json)
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

VARIANTS = ("cached", "uncached")


def _fit(variant: str) -> dict:
    import torch
    from lightning.pytorch import seed_everything

    from l2lightning import L2GraphCallback
    from l2lightning.guards import step_source
    from tests import graph_emulator
    from tests.idiom_variants import IDIOM_VARIANTS
    from tests.lightning_models import quiet_trainer

    undo: list[tuple[object, str, object]] = []

    def setattr_undone(obj: object, name: str, value: object) -> None:
        undo.append((obj, name, getattr(obj, name)))
        setattr(obj, name, value)

    graph_emulator.install(setattr_undone)
    if variant == "uncached":
        setattr_undone(step_source, "_is_user_code", step_source._judged_user_code)
    step_source._USER_FILES.clear()  # each fit starts as a process's first fit would
    torch.set_num_threads(1)
    try:
        idiom = IDIOM_VARIANTS["epoch_weighted_aux"]
        seed_everything(0, verbose=False)
        module = idiom.make_module()
        cb = L2GraphCallback(prefetch="off", verify=False, log_timing=False)
        trainer = quiet_trainer(accelerator="cpu", max_epochs=3, max_steps=60, callbacks=[cb])
        trainer.fit(module, idiom.make_loader())
        s = cb.summary()
        return {
            "variant": variant,
            "captures": s["captures"],
            "recapture_s": s["recapture_s"],
            "capture_s": s["capture_s"],
        }
    finally:
        for obj, name, value in reversed(undo):
            setattr(obj, name, value)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="output directory")
    parser.add_argument("--rounds", type=int, default=5, help="interleaved rounds (default 5)")
    args = parser.parse_args(argv)
    if args.rounds < 1:
        parser.error("`--rounds` must be >= 1")
    rows = []
    for r in range(args.rounds):
        for variant in VARIANTS if r % 2 == 0 else VARIANTS[::-1]:
            row = _fit(variant)
            row["round"] = r
            rows.append(row)
            print(json.dumps(row), flush=True)
    table = {
        v: {
            key: round(statistics.median(r[key] for r in rows if r["variant"] == v), 4)
            for key in ("recapture_s", "capture_s")
        }
        for v in VARIANTS
    }
    print(table, flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "recapture_cost_cpu.json").write_text(
        json.dumps(
            {
                "command": " ".join(["python3", "benchmarks/recapture_cost_cpu.py", *(argv or sys.argv[1:])]),
                "machine": {"processor": platform.processor(), "python": platform.python_version()},
                "rows": rows,
                "medians": table,
            },
            indent=2,
        )
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
