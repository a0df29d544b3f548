"""A/B of the callback's host path between two source trees: one family fit per tree, alternating.

A change to the per-step Python of the callback (the replay path, the log re-issue, the progress
bar's reads) moves a small family's ``Trainer.fit`` step by a few percent, while the same fit moves
by tens of percent from one process to the next on a busy host. So the two trees run in turns, each
fit in a fresh process (a tree is imported as a whole), ``--pairs`` times, the order of each pair
alternating; per family the script reports every fit's median step time (``StepTimer``, as in
``bench_host_overhead.py``: from one ``on_train_batch_start`` to the next, steps after the capture
only) and the median of the per-pair ratios B/A.

Each fit is the family's packaged trainer (progress bar, CSV logger) with
``L2GraphCallback(prefetch="off")``, built by the B tree's ``bench_host_overhead.py`` helpers when the A
tree has none of its own. ``--emulate`` runs on the CPU with the graph emulator of the B tree's tests
(``tests/graph_emulator.py``) and a replay that runs nothing: the callback's host path and Lightning's
loop alone, no GPU, and no sampled replay check (``verify=False``: a replay that runs nothing would
fail it). On a GPU the fits are real, with the check as by default.

With ``--a . --b .`` both trees are this checkout and the script measures the fit-to-fit spread
itself: every fit's ratio to the median of its family's fits, and whether the fit that ran first or
second in its pair is the slower one. ``--pause S`` waits S seconds before each fit and
``--hash-seed N`` fixes ``PYTHONHASHSEED`` in every fit's process (dict and set layouts then repeat
from one process to the next), to test two causes of that spread.

    python3 benchmarks/ab_host_path.py --a OLD_TREE --b . --out DIR [--emulate] [--pause S] [--hash-seed N]

Output: ``ab_host_path.json`` in ``--out`` (every fit with its position in its pair, the host's
one-minute load before it and its process's wall time; the medians, ratios and spread; the command
line) and a table on stdout.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SKIP = 20  # steps left out after the capture (as bench_host_overhead's SKIP)


def child(args: argparse.Namespace) -> int:
    """One fit of `args.family` from the tree `args.tree`; prints one JSON line."""
    import contextlib

    tree = str(Path(args.tree).resolve())
    # the tree under test, not an installed (editable) l2lightning
    sys.meta_path[:] = [f for f in sys.meta_path if "editable" not in repr(f).lower()]
    sys.path[:0] = [tree, str(Path(tree) / "benchmarks")]
    sys.path.append(args.helpers)  # the B tree: its tests/ (graph emulator) and benchmark helpers
    import torch

    import l2lightning

    if not l2lightning.__file__.startswith(tree):
        raise RuntimeError(f"imported {l2lightning.__file__}, not the tree {tree}")
    if args.emulate:
        torch.set_num_threads(1)
        from tests import graph_emulator as emu

        emu.install(setattr)
        emu.FakeGraph.replay = lambda self: None  # the host path alone
    import bench_host_overhead as bho

    from l2lightning import L2GraphCallback
    from l2lightning.step_timer import StepTimer
    from l2lightning.tools.bench import run as bench

    setup = bho.FamilySetup(args.family, args.batch, [], Path(args.log_dir))
    # A replay that runs nothing differs from its eager step: the sampled replay check (the default)
    # would find that at the first checked replay and train the rest of the fit eagerly, so emulated
    # fits run without it (on a GPU the fits are real and keep it)
    verify = False if args.emulate else "sampled"
    timer, cb = StepTimer(), L2GraphCallback(prefetch="off", verify=verify)
    total = args.steps + SKIP + 10
    accelerator = "cpu" if args.emulate else "cuda"
    with bench._quiet_lightning(), open(os.devnull, "w") as sink, contextlib.redirect_stderr(sink):
        trainer = bho._family_trainer(setup.cfg, accelerator, 0, total, [timer, cb])
        trainer.fit(setup.module(), bench._loader(setup.host_batches, total))
    summary = cb.summary()
    start = max(SKIP, int(summary.get("capture_step") or 0) + 2)
    steps = bho._step_ms(timer, start, args.steps)
    print(
        json.dumps(
            {
                "step_ms": statistics.median(steps) if steps else None,
                # within the fit: is a slow fit slow at every step, or at some?
                "step_ms_p10_p90": statistics.quantiles(steps, n=10)[::8] if len(steps) > 1 else None,
                "steps": len(steps),
                "torch_threads": torch.get_num_threads(),
                "captured": summary.get("captured"),
                # a fit that stopped replaying (reason set) or fell back is not the host path under test
                "reason": summary.get("reason"),
                "fallback_steps": summary.get("fallback_steps"),
                "verify": verify,
                "replay_ms": summary.get("graph_step_ms"),
                "l2lightning": l2lightning.__file__,
                "python_hash_seed": os.environ.get("PYTHONHASHSEED"),
            }
        )
    )
    return 0


def spread(fits: list[dict]) -> dict[str, dict]:
    """Per family and tree: every fit's median step as a ratio to the median of those fits, and the
    medians of the fits run first and second in their pairs (the order effect, when A and B are one tree)."""
    out: dict[str, dict] = {}
    for family in sorted({f["family"] for f in fits}):
        mine = [f for f in fits if f["family"] == family and f.get("step_ms") is not None]
        if not mine:
            continue
        middle = statistics.median(f["step_ms"] for f in mine)
        by_position = {str(p): [f["step_ms"] for f in mine if f.get("position") == p] for p in (0, 1)}
        out[family] = {
            "median_ms": middle,
            "ratio_to_median": [round(f["step_ms"] / middle, 4) for f in mine],
            "max_deviation": max(abs(f["step_ms"] / middle - 1) for f in mine),
            "first_in_pair_median_ms": statistics.median(by_position["0"]) if by_position["0"] else None,
            "second_in_pair_median_ms": statistics.median(by_position["1"]) if by_position["1"] else None,
        }
    return out


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--a", help="tree A (a checkout's root)")
    p.add_argument("--b", default=".", help="tree B (default: this checkout)")
    p.add_argument("--out", type=Path)
    p.add_argument("--families", default="mlp_stack,recommender")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--pairs", type=int, default=5, help="fits per tree and family, in alternating pairs")
    p.add_argument("--steps", type=int, default=300, help="timed steps per fit")
    p.add_argument("--emulate", action="store_true", help="CPU graph emulator, replay runs nothing")
    p.add_argument("--pause", type=float, default=0.0, help="seconds to wait before each fit (default 0)")
    p.add_argument(
        "--hash-seed",
        default=None,
        help="PYTHONHASHSEED of every fit's process (default: each process draws its own, as Python does)",
    )
    # the child process's own arguments
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--tree", help=argparse.SUPPRESS)
    p.add_argument("--family", help=argparse.SUPPRESS)
    p.add_argument("--helpers", help=argparse.SUPPRESS)
    p.add_argument("--log-dir", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if not args.child:
        if not args.a or args.out is None:
            p.error("--a and --out are required")
        if args.pairs < 1 or args.steps < 1:
            p.error(f"--pairs and --steps must be positive (got {args.pairs}, {args.steps})")
        if args.pause < 0:
            p.error(f"--pause must be >= 0 seconds (got {args.pause})")
        if args.hash_seed is not None and not (
            args.hash_seed.isdigit() and int(args.hash_seed) <= 4294967295
        ):
            p.error(f"--hash-seed must be an integer in [0, 4294967295] (got {args.hash_seed!r})")
        for name in ("a", "b"):
            if not (Path(getattr(args, name)) / "l2lightning").is_dir():
                p.error(f"--{name} {getattr(args, name)!r} has no l2lightning/ package")
    return args


def write_results(args: argparse.Namespace, trees: dict[str, str], fits: list[dict], final: bool) -> None:
    """``ab_host_path.json`` from the fits so far (written after every fit: a run cut short keeps
    them); the table on stdout once all are done."""
    summary = {}
    for family in sorted({f["family"] for f in fits}):
        per = {t: [f.get("step_ms") for f in fits if f["family"] == family and f["tree"] == t] for t in "AB"}
        ratios = [b / a for a, b in zip(per["A"], per["B"]) if a is not None and b is not None and a > 0]
        summary[family] = {
            "A_ms": per["A"],
            "B_ms": per["B"],
            "A_median_ms": statistics.median([x for x in per["A"] if x is not None])
            if any(per["A"])
            else None,
            "B_median_ms": statistics.median([x for x in per["B"] if x is not None])
            if any(per["B"])
            else None,
            "ratio_B_over_A_per_pair": ratios,
            "ratio_B_over_A_median": statistics.median(ratios) if ratios else None,
        }
        s = summary[family]
        if final:
            print(
                f"{family:12s} b{args.batch}  A {s['A_median_ms']} ms  B {s['B_median_ms']} ms  "
                f"B/A per pair {[round(r, 3) for r in ratios]}  median {s['ratio_B_over_A_median']}"
            )
    (args.out / "ab_host_path.json").write_text(
        json.dumps(
            {
                "command": " ".join([Path(sys.executable).name, *sys.argv]),
                "trees": trees,
                "emulate": args.emulate,
                "batch": args.batch,
                "steps": args.steps,
                "pause_s": args.pause,
                "hash_seed": args.hash_seed,
                "complete": final,
                "spread": spread(fits),
                "summary": summary,
                "fits": fits,
            },
            indent=2,
        )
    )


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.child:
        return child(args)
    args.out.mkdir(parents=True, exist_ok=True)
    trees = {"A": str(Path(args.a).resolve()), "B": str(Path(args.b).resolve())}
    # The fits' own logger files (the packaged trainers' CSV logs) are no result: kept out of --out,
    # whose few files a run brings back (hundreds of log files beside them were once too many to)
    logs = Path(tempfile.mkdtemp(prefix="ab_host_path_logs_"))
    try:
        return _run_pairs(args, trees, logs)
    finally:
        shutil.rmtree(logs, ignore_errors=True)


def _run_pairs(args: argparse.Namespace, trees: dict[str, str], logs: Path) -> int:
    """Every family's fits, in alternating pairs, each in a process of its own."""
    fits: list[dict] = []
    for family in [f for f in args.families.split(",") if f]:
        for pair in range(args.pairs):
            order = ("A", "B") if pair % 2 == 0 else ("B", "A")
            for name in order:
                cmd = [
                    sys.executable,
                    str(Path(__file__).resolve()),
                    "--child",
                    "--tree",
                    trees[name],
                    "--family",
                    family,
                    "--batch",
                    str(args.batch),
                    "--steps",
                    str(args.steps),
                    "--helpers",
                    trees["B"],
                    "--log-dir",
                    str(logs / f"{family}_{name}_{pair}"),
                ] + (["--emulate"] if args.emulate else [])
                time.sleep(args.pause)
                env = dict(os.environ)
                if args.hash_seed is not None:
                    env["PYTHONHASHSEED"] = args.hash_seed
                load = os.getloadavg()[0]
                started = time.perf_counter()
                done = subprocess.run(cmd, capture_output=True, text=True, cwd=trees[name], env=env)
                lines = [ln for ln in done.stdout.splitlines() if ln.startswith("{")]
                record = (
                    json.loads(lines[-1])
                    if done.returncode == 0 and lines
                    else {"error": done.stderr[-2000:]}
                )
                # where in its pair the fit ran, and how loaded the host was just before it: the
                # fit-to-fit spread is read against these
                record.update(
                    tree=name,
                    family=family,
                    pair=pair,
                    position=order.index(name),
                    load_1min=load,
                    process_s=round(time.perf_counter() - started, 2),
                )
                fits.append(record)
                print(json.dumps(record), flush=True)
                write_results(args, trees, fits, final=False)
    write_results(args, trees, fits, final=True)
    return 0 if all("error" not in f for f in fits) else 1


if __name__ == "__main__":
    sys.exit(main())
