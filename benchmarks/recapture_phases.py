"""Where a re-capture's wall time goes, and what the eager steps of a re-capture wait cost over plain.

Two measurements on the idioms of issue 36 (``tests/idiom_variants.py``: ``global_loss_weight``,
``rebound_loss_weight``, ``epoch_weighted_aux``; a 64-dim regression MLP, batch 32, 60 steps):

* **captures**: one fit per idiom with ``L2GraphCallback(recapture_wait=False)`` (captured again at
  the step after the change), every capture's wall time split into phases by wall-clock wrappers
  around the callback's own functions (each phase's time is exclusive of the phases inside it):
  the code analysis, the Python snapshots, the saved state, the capture itself (its garbage
  collection apart), the first replay's closure, the gate's start, the prefetch set-up, ... and
  ``other`` (what no wrapper covers). Also the per-step times of the fit's traced and timed warm-up
  steps.
* **wait**: per idiom, interleaved over ``--rounds`` rounds, a plain fit and a fit whose callback
  waits for the rest of the fit after the change (its capture cost said to be an hour), timed
  per step from ``on_train_batch_start`` to ``on_train_batch_end``; the median over the steps from
  ``--from-step`` on past the change, and inside the callback's waiting steps the medians of
  ``StepDecision.decide`` (the decision part's) and of the eager step (``run(closure)``). With
  ``--baseline`` the fit whose optimizer is capturable from its capture step (``CapturableFrom``:
  what the waiting steps run) is timed too.

On a CPU (``--device cpu``, the default) with the graph emulator of ``tests/graph_emulator.py``
(capture and replay of the emulator, whose replay runs every op: its times are not a GPU's; the wait
is told the device is one it waits on and its step times are fixed, 3 ms eager and 0.14 ms a
replay, as on the H200). With ``--device cuda``, on the GPU as shipped.

    python benchmarks/recapture_phases.py --out OUTDIR [--device cpu|cuda] [--rounds 3] [--only a,b]
        (writes OUTDIR/recapture_phases_<device>.json)

With ``--ab TREE --pairs N``: an A/B between the source tree TREE (A; it must hold this script too)
and this one (B), one process per tree and measurement, in turn (ABBA...), each with the other
arguments: per pair the B/A ratios of the waiting steps' median and of the re-captures' wall time
(``summary()["recapture_s"]``); writes OUTDIR/recapture_phases_ab_<device>.json.
"""

from __future__ import annotations

import argparse
import functools
import json
import platform
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from wall_phases import WallPhases, set_undone, undo_all  # noqa: E402 -- after the path

IDIOMS = ("global_loss_weight", "rebound_loss_weight", "epoch_weighted_aux")
CHANGE_STEP = {"global_loss_weight": 13, "rebound_loss_weight": 13, "epoch_weighted_aux": 20}


def _step_times(device: str):
    """A callback recording each training batch's wall seconds, from ``on_train_batch_start`` to
    ``on_train_batch_end``, the GPU idle at both ends (a `device` other than "cpu")."""
    import torch
    from lightning.pytorch import Callback

    class StepTimes(Callback):
        def __init__(self) -> None:
            self.times: list[float] = []

        def on_train_batch_start(self, *args) -> None:
            if device != "cpu":
                torch.cuda.synchronize()
            self.started = time.perf_counter()

        def on_train_batch_end(self, *args) -> None:
            if device != "cpu":
                torch.cuda.synchronize()
            self.times.append(time.perf_counter() - self.started)

    return StepTimes()


def _emulate(setattr_undone, device: str) -> None:
    if device != "cpu":
        return
    import torch

    from tests import graph_emulator

    graph_emulator.install(setattr_undone)
    torch.set_num_threads(1)


def _trainer_kwargs(idiom, device: str) -> dict:
    from tests.lightning_models import quiet_trainer  # noqa: F401 -- the import checks the path

    return {"accelerator": "cpu" if device == "cpu" else "gpu", "devices": 1, **idiom.trainer_kwargs}


def _captures_fit(name: str, device: str) -> dict:
    """One fit with `recapture_wait=False`: every capture's phases, the warm-up steps' times."""
    from lightning.pytorch import seed_everything

    from l2lightning import L2GraphCallback
    from l2lightning.callback import (
        prefetch_setup,
        step_capture,
        step_decision,
        step_dispatch,
        step_overrides,
        warmup_steps,
    )
    from tests.idiom_variants import IDIOM_VARIANTS
    from tests.lightning_models import quiet_trainer

    undo: list = []

    setattr_undone = functools.partial(set_undone, undo)

    _emulate(setattr_undone, device)
    phases = WallPhases()
    cls = L2GraphCallback
    capture = step_capture.StepCapture.capture

    def timed_capture(part, run, closure, kwargs):
        """The capture part's capture (the fit's only callback's): one window per capture."""
        phases.open_window()
        started = time.perf_counter()
        try:
            with phases.phase("other"):
                return capture(part, run, closure, kwargs)
        finally:
            phases.close_window()
            phases.windows[-1]["total"] = time.perf_counter() - started

    setattr_undone(step_capture.StepCapture, "capture", timed_capture)
    for owner, attr, phase in [
        (step_capture, "analyse_called_code", "analyse_called_code"),
        (cls, "_source_refusal", "source_refusal"),
        (warmup_steps.WarmupSteps, "python_holders", "python_holders"),
        (step_capture.python_state, "snapshot", "python_snapshots"),
        (step_capture.python_state, "restore", "python_restore"),
        (step_capture, "_scheduler_states", "scheduler_states"),
        (step_capture.TrainingState, "save", "training_state_save"),
        (step_capture, "StaticBatch", "static_batch"),
        (step_capture, "HostConstants", "host_constants"),
        (step_capture, "new_cuda_graph", "new_cuda_graph"),
        (prefetch_setup.PrefetchSetup, "install", "install_prefetch"),
        (step_capture.StepCapture, "_verify_eager", "verify_eager"),
        (step_capture.StepCapture, "_capture_into", "capture_into"),
        (step_capture, "free_cached_memory", "gc_and_empty_cache"),
        (step_capture, "clear_cublas_workspaces", "clear_cublas_workspaces"),
        (prefetch_setup.PrefetchSetup, "start_gate", "start_gate"),
        (step_decision.StepDecision, "module_flags", "module_flags"),
        (step_capture.StepHooks, "of", "step_hooks"),
        (step_capture.python_state, "baked_scalars", "baked_values"),
        (step_capture.python_state, "baked_tensors", "baked_values"),
        (step_capture.python_state, "baked_callables", "baked_values"),
        (step_capture.python_state, "baked_globals", "baked_values"),
        (step_capture.python_state, "baked_callback_attributes", "baked_values"),
        (step_overrides.StepOverrides, "python_log_sources", "log_sources"),
        (step_capture.torch.cuda, "synchronize", "cuda_synchronize"),
    ]:
        phases.wrap(owner, attr, phase, undo)

    modes: list[str] = []
    eager_modes = step_dispatch.StepDispatch._eager_modes

    def noting(part, mode, *args, **kwargs):
        """The dispatch part's `_eager_modes` (the fit's only callback's): the mode of each eager step."""
        modes.append(mode)
        return eager_modes(part, mode, *args, **kwargs)

    setattr_undone(step_dispatch.StepDispatch, "_eager_modes", noting)
    del warmup_steps
    try:
        idiom = IDIOM_VARIANTS[name]
        seed_everything(0, verbose=False)
        module = idiom.make_module()
        cb = L2GraphCallback(recapture_wait=False, log_timing=False)
        times = _step_times(device)
        trainer = quiet_trainer(callbacks=[times, cb], **_trainer_kwargs(idiom, device))
        trainer.fit(module, idiom.make_loader())
        s = cb.summary()
    finally:
        undo_all(undo)
    warmup = [
        {"step": i, "mode": m, "ms": round(1000 * t, 3)}
        for i, (m, t) in enumerate(zip(modes, times.times))
        if m in ("trace", "time")
    ]
    return {
        "idiom": name,
        "summary": {
            k: s[k]
            for k in (
                "captures",
                "capture_step",
                "capture_s",
                "recapture_s",
                "tuning_s",
                "fallback_steps",
                "plans",
            )
        },
        "prefetch_gate": s["prefetch_gate"],
        "warmup_steps": warmup,
        "captures": [
            {k: round(v * 1000, 3) for k, v in sorted(c.items(), key=lambda kv: -kv[1])}
            for c in phases.windows
        ],
    }


def _wait_fit(name: str, device: str, variant: str) -> dict:
    """`plain`, `baseline` (CapturableFrom at the callback's capture step) or `wait`: per-step times."""
    from lightning.pytorch import seed_everything

    from l2lightning import L2GraphCallback
    from l2lightning.callback import fit_report
    from l2lightning.callback.step_decision import StepDecision
    from l2lightning.callback.step_dispatch import StepDispatch
    from tests.idiom_variants import IDIOM_VARIANTS
    from tests.lightning_models import quiet_trainer

    undo: list = []

    setattr_undone = functools.partial(set_undone, undo)

    _emulate(setattr_undone, device)
    pieces: dict[str, list[float]] = defaultdict(list)
    cb = None
    waiting = [False]  # whether the step under way is a waiting one (its decision: eager after a capture)
    decide = StepDecision.decide

    def timed_decide(part, closure):
        """The decision part's `decide` (the waiting callback's, the fit's only one), timed on waiting steps."""
        started = time.perf_counter()
        mode = decide(part, closure)
        if mode == "eager" and cb.captures:
            pieces["decide_ms"].append(1000 * (time.perf_counter() - started))
        waiting[0] = mode == "eager" and cb.captures > 0
        return mode

    eager_modes, step = StepDispatch._eager_modes, StepDispatch.step

    def timed_eager_modes(part, mode, run, closure, kwargs):
        """The dispatch part's eager step (the waiting callback's), timed on waiting steps."""
        started = time.perf_counter()
        try:
            return eager_modes(part, mode, run, closure, kwargs)
        finally:
            if waiting[0]:
                pieces["eager_step_ms"].append(1000 * (time.perf_counter() - started))

    def timed_step(part, run, closure, kwargs):
        """The dispatch part's whole step (the waiting callback's), timed on waiting steps."""
        started = time.perf_counter()
        try:
            return step(part, run, closure, kwargs)
        finally:
            if waiting[0]:
                pieces["optimizer_step_ms"].append(1000 * (time.perf_counter() - started))

    class Waiting(L2GraphCallback):
        """The callback that waits out the rest of the fit after the change: a capture said to cost an hour."""

        _RENTAL_DEVICES = ("cpu", "cuda")

        def _last_capture_cost(self):
            return 3600.0

    try:
        idiom = IDIOM_VARIANTS[name]
        seed_everything(0, verbose=False)
        module = idiom.make_module()
        times = _step_times(device)
        callbacks: list = [times]
        if variant == "wait":
            if device == "cpu":  # the H200's step times (the emulator's replays run every op)
                setattr_undone(fit_report._Timing, "eager_ms", lambda self: 3.0)
                setattr_undone(fit_report._Timing, "graph_ms", lambda self: 0.14)
            cb = Waiting(log_timing=False)
            setattr_undone(StepDecision, "decide", timed_decide)
            setattr_undone(StepDispatch, "_eager_modes", timed_eager_modes)
            setattr_undone(StepDispatch, "step", timed_step)
            callbacks.append(cb)
        elif variant == "baseline":
            from l2lightning import CapturableFrom

            callbacks.append(CapturableFrom(3))
        trainer = quiet_trainer(callbacks=callbacks, **_trainer_kwargs(idiom, device))
        trainer.fit(module, idiom.make_loader())
    finally:
        undo_all(undo)
    row = {"idiom": name, "variant": variant, "step_ms": [round(1000 * t, 4) for t in times.times]}
    if cb is not None:
        s = cb.summary()
        row["captures"], row["fallback_steps"] = s["captures"], s["fallback_steps"]
        row.update({k: round(statistics.median(v), 4) for k, v in pieces.items() if v})
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="output directory")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument(
        "--rounds", type=int, default=3, help="interleaved rounds of the wait fits (default 3)"
    )
    parser.add_argument("--from-step", type=int, default=20, help="first step of the waiting steps' median")
    parser.add_argument("--only", default=",".join(IDIOMS), help="comma-separated idioms")
    parser.add_argument("--baseline", action="store_true", help="time the CapturableFrom baseline fit too")
    parser.add_argument("--skip", choices=("captures", "wait"), help="leave one measurement out")
    parser.add_argument("--ab", help="tree A of an A/B against this tree (B)")
    parser.add_argument("--pairs", type=int, default=4, help="A/B pairs (default 4)")
    args = parser.parse_args(argv)
    if args.rounds < 1:
        parser.error("`--rounds` must be >= 1")
    if args.ab:
        return _ab(args, argv if argv is not None else sys.argv[1:])
    names = [n for n in args.only.split(",") if n]
    result: dict = {
        "command": " ".join(["python3", "benchmarks/recapture_phases.py", *(argv or sys.argv[1:])]),
        "machine": {"processor": platform.processor(), "python": platform.python_version()},
    }
    if args.device == "cuda":
        import torch

        result["machine"]["device"] = torch.cuda.get_device_name()
    if args.skip != "captures":
        result["captures"] = []
        for name in names:
            row = _captures_fit(name, args.device)
            result["captures"].append(row)
            print(json.dumps({k: row[k] for k in ("idiom", "summary", "captures")}), flush=True)
    if args.skip != "wait":
        variants = ["plain", "wait"] + (["baseline"] if args.baseline else [])
        rows = []
        for r in range(args.rounds):
            for name in names:
                for variant in variants if r % 2 == 0 else variants[::-1]:
                    row = _wait_fit(name, args.device, variant)
                    row["round"] = r
                    rows.append(row)
        table = {}
        for name in names:
            entry = {}
            for variant in variants:
                mine = [r for r in rows if r["idiom"] == name and r["variant"] == variant]
                per_step = [statistics.median(s) for s in zip(*(r["step_ms"] for r in mine))]
                entry[f"{variant}_step_ms"] = round(statistics.median(per_step[args.from_step :]), 4)
                for key in ("decide_ms", "eager_step_ms", "optimizer_step_ms"):
                    values = [r[key] for r in mine if key in r]
                    if values:
                        entry[f"{variant}_{key}"] = round(statistics.median(values), 4)
            table[name] = entry
            print(name, entry, flush=True)
        result["wait"] = {"from_step": args.from_step, "medians": table, "rows": rows}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"recapture_phases_{args.device}.json").write_text(json.dumps(result, indent=1))
    return 0


def _ab(args: argparse.Namespace, argv: list[str]) -> int:
    import subprocess
    import tempfile

    rest, skip = [], False
    for a in argv:  # the arguments every run shares: all but --ab, --pairs and --out
        if skip:
            skip = False
            continue
        if a in ("--ab", "--pairs", "--out"):
            skip = True
            continue
        if not a.startswith(("--ab=", "--pairs=", "--out=")):
            rest.append(a)
    trees = {"A": Path(args.ab).resolve(), "B": ROOT}
    pairs = []
    for p in range(args.pairs):
        row = {}
        for side in ("A", "B") if p % 2 == 0 else ("B", "A"):
            with tempfile.TemporaryDirectory() as tmp:
                subprocess.run(
                    [
                        sys.executable,
                        str(trees[side] / "benchmarks" / "recapture_phases.py"),
                        "--out",
                        tmp,
                        *rest,
                    ],
                    check=True,
                    cwd=trees[side],
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                )
                row[side] = json.loads((Path(tmp) / f"recapture_phases_{args.device}.json").read_text())
        pair = {}
        for side, result in row.items():
            for name, entry in result.get("wait", {}).get("medians", {}).items():
                pair.setdefault(name, {}).update({f"{side}_{k}": v for k, v in entry.items()})
            for c in result.get("captures", []):
                pair.setdefault(c["idiom"], {}).update(
                    {
                        f"{side}_recapture_s": c["summary"]["recapture_s"],
                        f"{side}_capture_s": c["summary"]["capture_s"],
                    }
                )
        for entry in pair.values():
            for key in ("wait_step_ms", "wait_decide_ms", "plain_step_ms", "recapture_s"):
                if entry.get(f"A_{key}") and f"B_{key}" in entry:
                    entry[f"{key}_b_over_a"] = round(entry[f"B_{key}"] / entry[f"A_{key}"], 4)
        pairs.append(pair)
        print(json.dumps(pair), flush=True)
    names = sorted({n for pair in pairs for n in pair})
    medians = {
        name: {
            key: round(statistics.median(pair[name][key] for pair in pairs if key in pair.get(name, {})), 4)
            for key in sorted({k for pair in pairs for k in pair.get(name, {})})
        }
        for name in names
    }
    print(json.dumps(medians, indent=1), flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"recapture_phases_ab_{args.device}.json").write_text(
        json.dumps(
            {
                "command": " ".join(["python3", "benchmarks/recapture_phases.py", *argv]),
                "machine": {"processor": platform.processor(), "python": platform.python_version()},
                "pairs": pairs,
                "medians": medians,
            },
            indent=1,
        )
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
