"""Per-step ``Trainer.fit`` time, plain Lightning vs L2GraphCallback, on modules written the way users
write them (issue 12), with the bitwise verdict for each.

What it measures: for each idiom module of ``tests/idiom_modules.py`` (20 public idioms: Lightning's
docs and demos, lightning-hydra-template, torchmetrics' docs, CleanRL, timm, DLRM, pytorch/examples)
and each variant of ``tests/idiom_variants.py``,
``tests/idiom_harness.judge`` fits it ``--steps`` batches three times in one process: plain, with
its optimizers passed through ``make_capturable`` (the baseline), and with
``L2GraphCallback()`` at its defaults; then a plain fit again. Every fit is seeded
(``seed_everything(0)``) and ``deterministic=True``, without logger, checkpointing, progress bar or
model summary. ``captured`` and ``reason`` come from ``L2GraphCallback.summary()`` (or the text of
an error the callback raised by name at setup, after which the run is a plain fit); ``equal`` is
True when losses, logged ``callback_metrics`` (each step's start and end), final ``state_dict`` and
printed text are bitwise equal to the baseline (if captured) or to plain Lightning (if not), and the
plain fit after the callback's fit equals the first one.

How the time is taken: wall time (``time.perf_counter``) from the ``on_train_batch_start`` of the
first batch that is batch 10 or later and optimizer step 10 or later (after warm-up and capture, which
under gradient accumulation come several batches in) to the ``on_train_batch_end`` of the last step, with a
``torch.cuda.synchronize()`` before reading the end (and one at fit start), divided by the number
of steps in between: what a user waits for per step, host work included. One fit per variant: the
numbers are single samples, not medians.

Each idiom runs in its own subprocess (``--one NAME`` prints one JSON line), so a crash or a
poisoned CUDA context stays in its row (``captured=False, equal=False``, the error in ``reason``).
Writes ``OUT/idioms.csv`` (``module,captured,reason,equal,plain_ms,callback_ms``, then from the details
``plain_again_ms`` and each fit's whole wall time, ``plain_fit_s,callback_fit_s,plain_again_fit_s``) and
``OUT/idioms.json`` (the same rows, the machine, the command line, and per-idiom details).

Run from the repository root with the package on PYTHONPATH (not necessarily installed):

    python3 benchmarks/bench_idioms.py --out benchmarks/results/h200/idioms_run
    python3 benchmarks/bench_idioms.py --out /tmp/x --only autoencoder,manual_gan --steps 8
    python3 benchmarks/bench_idioms.py --out /tmp/y --resume /tmp/x/idioms.json   # the idioms /tmp/x lacks

The files are written again after every idiom, so a run cut by a time limit keeps its finished rows;
``--resume`` completes such a run (on the same device) without measuring its rows again.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import platform
import shlex
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT / "benchmarks") not in sys.path:  # loaded from its file by the tests, not run as a script
    sys.path.insert(0, str(ROOT / "benchmarks"))

from run_record import machine_record  # noqa: E402 -- after the path

COLUMNS = ["module", "captured", "reason", "equal", "plain_ms", "callback_ms"]
# from each row's details: the second plain fit's step time (after the callback's; none for a fit refused
# at setup), which beside the first shows how far two plain fits of one process lie apart, and every
# fit's whole wall time
DETAIL_COLUMNS = ["plain_again_ms", "plain_fit_s", "callback_fit_s", "plain_again_fit_s"]
MARKER = "IDIOM_RESULT "


def _default_accelerator() -> str:
    import torch

    return "gpu" if torch.cuda.is_available() else "cpu"


def _one(name: str, steps: int, accelerator: str) -> int:
    """Judge one idiom in this process and print one JSON line (after everything the fits printed)."""
    sys.path.insert(0, str(ROOT))
    import torch

    from tests.idiom_harness import judge

    result = judge(name, steps=steps, accelerator=accelerator)
    result["extra"]["device"] = (
        torch.cuda.get_device_name(0)
        if accelerator == "gpu" and torch.cuda.is_available()
        else platform.processor()
    )
    sys.stdout.flush()
    print(MARKER + json.dumps(result, default=str), flush=True)
    return 0


def _failed_row(name: str, why: str) -> dict[str, Any]:
    return {
        "module": name,
        "captured": False,
        "reason": why,
        "equal": False,
        "plain_ms": None,
        "callback_ms": None,
        "detail": why,
        "extra": {},
    }


def _last_line(text: str) -> str:
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    return lines[-1][:500] if lines else ""


def _run_child(name: str, steps: int, accelerator: str, timeout: float) -> dict[str, Any]:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--one", name, "--steps", str(steps)]
    cmd += ["--accelerator", accelerator]
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
    try:
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return _failed_row(name, f"subprocess timed out after {timeout:.0f} s")
    except OSError as exc:
        return _failed_row(name, f"subprocess did not start: {exc}")
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith(MARKER):
            try:
                return json.loads(line[len(MARKER) :])
            except json.JSONDecodeError as exc:
                return _failed_row(name, f"unreadable result line: {exc}")
    cause = _last_line(proc.stderr) or _last_line(proc.stdout) or "no output"
    return _failed_row(name, f"subprocess failed (rc={proc.returncode}): {cause}")


def _fmt3(value: Any) -> str:
    """A number with three decimals (milliseconds or seconds), empty where none was measured."""
    return "" if value is None else f"{float(value):.3f}"


def _machine(rows: list[dict[str, Any]], accelerator: str) -> dict[str, Any]:
    device = next((r["extra"].get("device") for r in rows if r.get("extra", {}).get("device")), None)
    return {**machine_record(device), "accelerator": accelerator}


def _cells(row: dict[str, Any]) -> dict[str, Any]:
    """A row's table cells. The fits' wall times (``*_fit_s``: the whole ``trainer.fit``, warm-up,
    capture and checks included) answer "slower than plain over its fit?", which the per-step times
    from step 10 do not."""
    extra = row.get("extra", {})
    return {**{k: row[k] for k in COLUMNS}, **{k: extra.get(k) for k in DETAIL_COLUMNS}}


def _ratio(numerator: Any, denominator: Any) -> str:
    return f"{numerator / denominator:.2f}x" if numerator and denominator else ""


def _print_table(rows: list[dict[str, Any]]) -> None:
    """Per idiom: the per-step speedup over the first plain fit, and ``fit_x``, the whole fit's: the
    second plain fit's wall time over the callback fit's (both after the process's first fit, so
    neither pays its one-time costs; the callback's first capture and tuning are in it)."""
    print(
        f"{'module':32s} {'captured':8s} {'equal':5s} {'plain_ms':>9s} {'again_ms':>9s} {'cb_ms':>9s} "
        f"{'speedup':>7s} {'fit_x':>6s}  reason"
    )
    for r in rows:
        cells = _cells(r)
        print(
            f"{r['module']:32s} {str(r['captured']):8s} {str(r['equal']):5s} {_fmt3(r['plain_ms']):>9s} "
            f"{_fmt3(cells['plain_again_ms']):>9s} {_fmt3(r['callback_ms']):>9s} "
            f"{_ratio(r['plain_ms'], r['callback_ms']):>7s} "
            f"{_ratio(cells['plain_again_fit_s'], cells['callback_fit_s']):>6s}  {(r['reason'] or '')[:80]}"
        )
    captured = sum(bool(r["captured"]) for r in rows)
    equal = sum(bool(r["equal"]) for r in rows)
    print(f"{len(rows)} idioms: {captured} captured, {equal} equal to their reference")


def _load_resume(path: Path, accelerator: str) -> dict[str, Any]:
    """An earlier run's idioms.json, to be completed; refused when it was measured on another device."""
    try:
        earlier = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise SystemExit(f"--resume {path}: not a readable idioms.json ({exc})") from exc
    if not isinstance(earlier, dict) or not isinstance(earlier.get("rows"), list):
        raise SystemExit(f"--resume {path}: no 'rows' list; pass an idioms.json that bench_idioms.py wrote")
    import torch

    here = torch.cuda.get_device_name(0) if accelerator == "gpu" and torch.cuda.is_available() else None
    there = earlier.get("machine", {}).get("device")
    if here is not None and there != here:
        raise SystemExit(
            f"--resume {path}: its rows were measured on {there!r}, this run is on {here!r}; "
            "a table's speeds must come from one kind of device"
        )
    for row in earlier["rows"]:
        detail = earlier.get("details", {}).get(row["module"], {})
        row["detail"] = detail.get("detail")
        row["extra"] = {k: v for k, v in detail.items() if k != "detail"}
    return earlier


def _write(
    out: Path,
    rows: list[dict[str, Any]],
    earlier: dict[str, Any],
    accelerator: str,
    steps: int,
    wall_s: float,
) -> None:
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "idioms.csv", "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(COLUMNS + DETAIL_COLUMNS)
        for r in rows:
            cells = _cells(r)
            writer.writerow(
                [
                    r["module"],
                    r["captured"],
                    r["reason"] or "",
                    r["equal"],
                    *(_fmt3(cells[k]) for k in ("plain_ms", "callback_ms", *DETAIL_COLUMNS)),
                ]
            )
    command = " ".join(shlex.quote(a) for a in [sys.executable, *sys.argv])
    payload = {
        "rows": [_cells(r) for r in rows],
        "machine": _machine(rows, accelerator),
        "command": command,
        "steps": steps,
        "wall_s": round(wall_s, 1),
        "details": {r["module"]: {"detail": r.get("detail"), **r.get("extra", {})} for r in rows},
    }
    if earlier:
        # the rows kept from the earlier run: its command, tree and time stay on record beside this one's
        payload["resumed_from"] = {
            k: earlier.get(k) for k in ("command", "machine", "wall_s", "resumed_from")
        }
    (out / "idioms.json").write_text(json.dumps(payload, indent=2, default=str) + "\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, help="directory for idioms.csv and idioms.json")
    parser.add_argument(
        "--only", default="", help="comma-separated idiom names, variants included (default: every idiom)"
    )
    parser.add_argument("--steps", type=int, default=60, help="batches per fit (default 60)")
    parser.add_argument(
        "--accelerator", choices=("gpu", "cpu"), default=None, help="default: gpu if CUDA is available"
    )
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds per idiom subprocess")
    parser.add_argument(
        "--resume",
        type=Path,
        default=None,
        help="an idioms.json of an earlier, cut run on the same device: keep its rows, run the idioms it lacks",
    )
    parser.add_argument("--one", metavar="NAME", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    accelerator = args.accelerator or _default_accelerator()
    if args.one:
        return _one(args.one, args.steps, accelerator)
    if args.out is None:
        parser.error("--out is required")

    sys.path.insert(0, str(ROOT))
    from tests.idiom_modules import IDIOMS
    from tests.idiom_variants import IDIOM_VARIANTS

    names = [n.strip() for n in args.only.split(",") if n.strip()] or [*IDIOMS, *IDIOM_VARIANTS]
    unknown = [n for n in names if n not in IDIOMS and n not in IDIOM_VARIANTS]
    if unknown:
        parser.error(
            f"unknown idioms {unknown}; known: {list(IDIOMS)} and the variants {list(IDIOM_VARIANTS)}"
        )

    rows: list[dict[str, Any]] = []
    earlier: dict[str, Any] = {}
    if args.resume is not None:
        earlier = _load_resume(args.resume, accelerator)
        kept = {r["module"] for r in earlier["rows"]}
        rows = [r for r in earlier["rows"] if r["module"] in names]
        names = [n for n in names if n not in kept]
        print(f"resuming {args.resume}: {len(rows)} idioms kept, {len(names)} to run", flush=True)
    started = time.perf_counter()
    for name in names:
        t0 = time.perf_counter()
        row = _run_child(name, args.steps, accelerator, args.timeout)
        rows.append(row)
        verdict = "captured" if row["captured"] else "not captured"
        print(
            f"[{time.perf_counter() - t0:6.1f} s] {name}: {verdict}, equal={row['equal']}"
            + (f" ({row['detail']})" if row.get("detail") else ""),
            flush=True,
        )
        # written after every idiom, so a run cut by a time limit keeps what it finished (--resume)
        _write(args.out, rows, earlier, accelerator, args.steps, time.perf_counter() - started)

    _write(args.out, rows, earlier, accelerator, args.steps, time.perf_counter() - started)
    _print_table(rows)
    print(f"wrote {args.out / 'idioms.csv'} and {args.out / 'idioms.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
