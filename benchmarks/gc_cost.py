"""What a garbage collection costs in a training process: the callback's one-time costs are largely
full collections.

The callback runs ``gc.collect()`` (all generations, through ``l2lightning.graph.cuda_memory.free_cached_memory``)
before the prefetch tuning, before a fit's first capture, after the whole-step gate's trial and when a
fit it stopped handling gives its stream's memory back; a re-capture collects the young generations
only (``gc.collect(1)``). A full collection walks every tracked Python object of the process, so its
cost grows with what the process has loaded (torch, Lightning, the user's modules), not with the model.

In one process this script fits an idiom of ``tests/idiom_modules.py`` plain once (``--idiom``, on
``--accelerator``), so that Lightning, torch and the module are loaded and alive as in a training run,
then times ``gc.collect(generation)`` for generations 0, 1 and 2, ``--repeats`` times each in turn,
and reports the median of each with the number of objects the collector tracks.

    python3 benchmarks/gc_cost.py --out OUT [--idiom own_step_counter] [--accelerator cpu] [--repeats 5]

Writes ``OUT/gc_cost.json``.
"""

from __future__ import annotations

import argparse
import gc
import json
import platform
import shlex
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def time_collections(repeats: int) -> dict[str, dict[str, float]]:
    """Median and spread of ``gc.collect(g)`` in ms for g = 0, 1, 2, the generations taken in turn."""
    times: dict[int, list[float]] = {0: [], 1: [], 2: []}
    for _ in range(repeats):
        for generation in times:
            started = time.perf_counter()
            gc.collect(generation)
            times[generation].append((time.perf_counter() - started) * 1e3)
    return {
        f"generation_{g}": {"median_ms": statistics.median(ms), "min_ms": min(ms), "max_ms": max(ms)}
        for g, ms in times.items()
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="directory for gc_cost.json")
    parser.add_argument(
        "--idiom", default="own_step_counter", help="the idiom fitted first (default own_step_counter)"
    )
    parser.add_argument(
        "--accelerator", choices=("gpu", "cpu"), default=None, help="default: gpu if CUDA is available"
    )
    parser.add_argument("--steps", type=int, default=20, help="batches of the plain fit (default 20)")
    parser.add_argument("--repeats", type=int, default=5, help="collections per generation (default 5)")
    args = parser.parse_args(argv)
    if args.repeats < 1:
        parser.error(f"--repeats must be at least 1, got {args.repeats}")
    sys.path.insert(0, str(ROOT))
    import lightning
    import torch

    from tests.idiom_harness import run_idiom
    from tests.idiom_modules import IDIOMS
    from tests.idiom_variants import IDIOM_VARIANTS

    if args.idiom not in IDIOMS and args.idiom not in IDIOM_VARIANTS:
        parser.error(f"--idiom: unknown idiom {args.idiom!r}; known: {sorted({**IDIOMS, **IDIOM_VARIANTS})}")
    accelerator = args.accelerator or ("gpu" if torch.cuda.is_available() else "cpu")
    run_idiom(args.idiom, "plain", steps=args.steps, accelerator=accelerator)
    result = {
        "collections": time_collections(args.repeats),
        "tracked_objects": len(gc.get_objects()),
        "after": f"one plain fit of {args.idiom!r}, {args.steps} batches, on {accelerator}",
        "machine": {
            "device": torch.cuda.get_device_name(0)
            if accelerator == "gpu"
            else platform.processor() or platform.machine(),
            "python": platform.python_version(),
            "torch": torch.__version__,
            "lightning": lightning.__version__,
        },
        "command": " ".join(
            shlex.quote(a) for a in [sys.executable, *(sys.argv if argv is None else [__file__, *argv])]
        ),
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "gc_cost.json").write_text(json.dumps(result, indent=2) + "\n")
    for name, stats in result["collections"].items():
        print(
            f"{name}: median {stats['median_ms']:.1f} ms (min {stats['min_ms']:.1f}, max {stats['max_ms']:.1f})"
        )
    print(f"{result['tracked_objects']} tracked objects; wrote {args.out / 'gc_cost.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
