"""Where the host time of a replayed ``Trainer.fit`` step goes, by the code that spends it: the split
of issue 37's ``floor_ms - lightning_bare_ms`` that a profiler cannot give without inflating it.

In one process, ``--rounds`` rounds of three fits on ``bench_host_overhead.py``'s floor (a 1->1 Linear,
batch 1, its loader and Trainer: no logger, no progress bar):

- **bare**: plain Lightning with a step that does nothing (``bench_host_overhead.fit_bare``); its
  per-step wall time (``StepTimer``) is ``lightning_bare_ms``;
- **automatic**: plain Lightning on the automatic-optimization path with the step's work taken out
  through documented hooks (``bench_host_overhead.fit_automatic``: ``training_step`` returns a tensor
  it holds, ``backward`` and ``optimizer_zero_grad`` do nothing, ``optimizer_step`` only runs the
  closure): ``lightning_automatic_ms``. Between it and bare lies Lightning's automatic optimization,
  which the callback keeps by contract; between the callback's step and it, the callback's own path;
- **callback**: the floor's module with ``L2GraphCallback(prefetch="off", log_timing=False)``, whose
  replayed steps are split into phases by wall-clock wrappers around the callback's own functions
  (``wall_phases.py``; each phase exclusive of the phases inside it): the step decision, the batch's
  copy into the graph's inputs, the replay's launch, the callback's CUDA events (the benchmark's own
  step-timer marks are a phase apart, ``step_timer_marks``: the bare fit makes them too), the graph's ``replay()``, the replay
  closure, the installed ``training_step`` and its log re-issue, Lightning's ``ClosureResult`` (its
  loss clone), the rest of the callback's step path, the callback's own Lightning hooks, the progress
  bar's deferred reads; and ``lightning_and_rest``, the step's wall time (one ``on_train_batch_start``
  to the next) minus all of them.

A window is a step whose replay ran (a checked step is not one). Per phase the median over a fit's
replayed steps after ``bench_host_overhead.SKIP``, then the median over rounds; the wrappers' own
cost per call is measured (``wall_phases.wrapper_cost_s``) and reported with the calls per step, so
``callback_step_ms`` can be read without it.

On a CPU (``--device cpu``) the graph emulator of ``tests/graph_emulator.py`` stands in for CUDA
graphs, with a replay that runs nothing and the sampled check off, as ``host_floor_emulated.py``:
the callback's Python and Lightning's loop alone. With ``--device cuda`` the fits are real, the
sampled check as by default.

With ``--logs N`` each round also fits the module whose step logs its loss N times per step
(``self.log(..., prog_bar=True)``), and the result gives each phase's cost per logged value: the log
re-issue is the callback's; Lightning's batch-end handling of each key falls in the progress bar's reads.

With ``--split-lightning`` the callback fit's phases also split Lightning's automatic-optimization path
around the replay (``lightning.*``: the loop's run, the closure's making, the ``optimizer_step`` hook's
dispatch, ``LightningOptimizer.step``, the strategy's and precision plugin's ``optimizer_step``).

    python3 benchmarks/host_path_phases.py --out OUTDIR [--device cpu|cuda] [--rounds 3] [--steps 300] [--logs 4] [--split-lightning]
        (writes OUTDIR/host_path_phases_<device>.json)
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]

from run_record import machine_record  # noqa: E402 -- after the path
from wall_phases import WallPhases, undo_all, wrapper_cost_s  # noqa: E402

REST = "lightning_and_rest"
# the benchmark's own step timer (a mark at each step's start and end), in the bare fit as well
STEP_TIMER = "step_timer_marks"


def _wrap_callback_path(phases: WallPhases, undo: list, device: str) -> None:
    """Time the replayed step's own functions as phases (the callback's, and what it calls per replay)."""
    import torch
    from lightning.pytorch import Callback
    from lightning.pytorch.loops.optimization.automatic import ClosureResult

    from l2lightning import L2GraphCallback
    from l2lightning.callback.step_decision import StepDecision
    from l2lightning.callback.step_dispatch import StepDispatch
    from l2lightning.callback.step_overrides import StepOverrides
    from l2lightning.graph import capture, replay_closure
    from l2lightning.guards import progress_bar_reads
    from l2lightning.step_timer import StepTimer

    targets: list[tuple[object, str, str]] = [
        (StepDecision, "decide", "decide"),  # the decision part's, before every step
        (capture.StaticBatch, "copy_tensors", "batch_copy"),
        (StepDispatch, "_launch_replay", "launch_replay"),
        (StepDispatch, "_replay_step", "replay_step"),
        (StepDispatch, "step", "dispatch"),
        (replay_closure.ReplayClosure, "__call__", "replay_closure"),
        (StepOverrides, "training_step", "training_step_override"),
        (StepOverrides, "_reissue", "log_reissue"),
        (ClosureResult, "__post_init__", "closure_result"),
        (progress_bar_reads._DeferredProgressBarReads, "on_batch_end", "progress_bar_reads"),
        (torch.cuda.CUDAGraph, "replay", "graph_replay"),
    ]
    if device == "cuda":
        targets.append((L2GraphCallback, "_events", "cuda_events"))
        # the step timer's own event (one per step, the bare fit records it too) apart from the callback's
        phases.wrap(torch.cuda.Event, "record", "cuda_events", undo, outside=STEP_TIMER)
    phases.wrap(StepTimer, "_mark", STEP_TIMER, undo)
    # the callback's own Lightning hooks (each one Lightning calls per step)
    hooks = [name for name in vars(L2GraphCallback) if name.startswith("on_") and hasattr(Callback, name)]
    targets += [(L2GraphCallback, name, "callback_hooks") for name in hooks]
    for owner, name, phase in targets:
        phases.wrap(owner, name, phase, undo)


def _wrap_lightning_path(phases: WallPhases, undo: list) -> None:
    """Time the automatic-optimization path Lightning runs around the callback's replay as phases of
    their own (``lightning.*``): the loop's ``run``, its closure's making, its ``_optimizer_step``
    (the ``optimizer_step`` hook's dispatch), the module's ``optimizer_step``, ``LightningOptimizer.step``,
    the strategy's and the precision plugin's ``optimizer_step`` (torch's ``Optimizer.step`` wrapper
    inside it): where a replay could still skip what does nothing for its step."""
    from lightning.pytorch.core.module import LightningModule
    from lightning.pytorch.core.optimizer import LightningOptimizer
    from lightning.pytorch.loops.optimization.automatic import _AutomaticOptimization
    from lightning.pytorch.plugins.precision.precision import Precision
    from lightning.pytorch.strategies.strategy import Strategy

    for owner, name, phase in (
        (_AutomaticOptimization, "run", "lightning.automatic_run"),
        (_AutomaticOptimization, "_make_closure", "lightning.make_closure"),
        (_AutomaticOptimization, "_optimizer_step", "lightning.optimizer_step_dispatch"),
        (LightningModule, "optimizer_step", "lightning.module_optimizer_step"),
        (LightningOptimizer, "step", "lightning.lightning_optimizer_step"),
        (Strategy, "optimizer_step", "lightning.strategy_optimizer_step"),
        (Precision, "optimizer_step", "lightning.precision_optimizer_step"),
    ):
        phases.wrap(owner, name, phase, undo)


def _windowing(phases: WallPhases, cb: Any, windows: list[dict[str, Any]]) -> Any:
    """A Lightning callback, first in the list: one window per training batch, from its
    ``on_train_batch_start`` to the next; a window is kept with its step's total time and whether the
    step replayed (the callback's replay count moved)."""
    from lightning.pytorch import Callback

    class Windows(Callback):
        def __init__(self) -> None:
            self.started: float | None = None
            self.replays = 0

        def _close(self) -> None:
            if self.started is None:
                return
            phases.close_window()
            replays = cb._fit_report.timing.graph_count
            windows.append(
                {
                    "total": time.perf_counter() - self.started,
                    "replayed": replays > self.replays,
                    "phases": phases.windows[-1],
                    "calls": phases.calls[-1],
                }
            )
            self.replays = replays

        def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
            self._close()
            phases.open_window()
            self.started = time.perf_counter()

        def on_train_end(self, trainer: Any, pl_module: Any) -> None:
            self._close()
            self.started = None

    return Windows()


def callback_fit(
    floor: argparse.Namespace, device: str, skip: int, logs: int = 0, split_lightning: bool = False
) -> dict[str, Any]:
    """One floor fit with the callback, its replayed steps split into phases (ms, medians); the step
    logs its loss `logs` times (``self.log(..., prog_bar=True)``, as ``bench_host_overhead``'s log cost)."""
    import bench_host_overhead as bho
    import torch

    from l2lightning import L2GraphCallback

    undo: list = []
    phases = WallPhases()
    cb = L2GraphCallback(prefetch="off", log_timing=False, **({"verify": False} if device == "cpu" else {}))
    windows: list[dict[str, Any]] = []
    try:
        _wrap_callback_path(phases, undo, device)
        if split_lightning:
            _wrap_lightning_path(phases, undo)
        module = bho._logging_module(
            logs,
            torch.device(device, 0) if device == "cuda" else torch.device("cpu"),
            "fused" if device == "cuda" else "foreach",
        )
        bho._fit_on_floor_loader(floor, module, [_windowing(phases, cb, windows), cb])
    finally:
        undo_all(undo)
    summary = cb.summary()
    if not summary["captured"]:
        raise RuntimeError(f"the floor fit with the callback did not capture: {summary['reason']}")
    replayed = [w for w in windows[skip:] if w["replayed"]]
    if not replayed:
        raise RuntimeError("no replayed step after the skipped ones: give more --steps")
    names = sorted({name for w in replayed for name in w["phases"]})
    per_phase = {name: bho._median([w["phases"].get(name, 0.0) * 1e3 for w in replayed]) for name in names}
    per_phase[REST] = bho._median([(w["total"] - sum(w["phases"].values())) * 1e3 for w in replayed])
    return {
        "step_ms": bho._median([w["total"] * 1e3 for w in replayed]),
        "phases_ms": per_phase,
        "wrapped_calls_per_step": bho._median([w["calls"] for w in replayed]),
        "replayed_steps": len(replayed),
        "replay_checks": (summary.get("replay_check") or {}).get("checks"),
    }


def main(argv: list[str] | None = None, set_attr: Any = setattr) -> int:
    """`set_attr` installs the graph emulator on a CPU (a test passes ``monkeypatch.setattr``)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--out", type=Path, required=True, help="directory for host_path_phases_<device>.json"
    )
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument(
        "--rounds",
        type=int,
        default=3,
        help="rounds of the bare, the automatic and the callback fit (default 3)",
    )
    parser.add_argument("--steps", type=int, default=300, help="timed steps per fit (default 300)")
    parser.add_argument(
        "--logs",
        type=int,
        default=0,
        help="also a callback fit whose step logs N values per step, and each phase's cost per log (default 0: none)",
    )
    parser.add_argument(
        "--split-lightning",
        action="store_true",
        help="also time Lightning's automatic-optimization path around the replay as phases (lightning.*)",
    )
    args = parser.parse_args(argv)
    if args.rounds < 1 or args.steps < 1:
        parser.error(f"--rounds and --steps must be at least 1, got {args.rounds} and {args.steps}")
    if args.logs < 0:
        parser.error(f"--logs must be 0 or more, got {args.logs}")

    import bench_host_overhead as bho
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: this torch sees no CUDA device")
    if args.device == "cpu":
        from tests import graph_emulator as emu

        emu.install(set_attr)
        set_attr(emu.FakeGraph, "replay", lambda self: None)
    floor = argparse.Namespace(accelerator=args.device, device=0, steps=args.steps)
    threads = torch.get_num_threads()
    if args.device == "cpu":
        torch.set_num_threads(1)  # as host_floor_emulated.py: the host path alone
    rounds: list[dict[str, Any]] = []
    try:
        with bho._quiet_progress(True):
            for _ in range(args.rounds):
                bare = bho.fit_bare(floor)
                automatic = bho.fit_automatic(floor)
                row = {
                    "lightning_bare_ms": bare,
                    "lightning_automatic_ms": automatic,
                    **callback_fit(floor, args.device, bho.SKIP, split_lightning=args.split_lightning),
                }
                if args.logs:
                    row["with_logs"] = callback_fit(floor, args.device, bho.SKIP, args.logs)
                rounds.append(row)
    finally:
        torch.set_num_threads(threads)
    wrapper_s = wrapper_cost_s()
    phase_names = sorted({name for r in rounds for name in r["phases_ms"]})
    medians = {
        "lightning_bare_ms": bho._median([r["lightning_bare_ms"] for r in rounds]),
        "lightning_automatic_ms": bho._median([r["lightning_automatic_ms"] for r in rounds]),
        "callback_step_ms": bho._median([r["step_ms"] for r in rounds]),
        "phases_ms": {
            name: bho._median([r["phases_ms"].get(name, 0.0) for r in rounds]) for name in phase_names
        },
        "wrapped_calls_per_step": bho._median([r["wrapped_calls_per_step"] for r in rounds]),
    }
    wrappers_ms = wrapper_s * 1e3 * medians["wrapped_calls_per_step"]
    per_log: dict[str, Any] | None = None
    if args.logs:
        logged = [r["with_logs"] for r in rounds]
        names = sorted(set(phase_names) | {name for r in logged for name in r["phases_ms"]})
        with_logs = {name: bho._median([r["phases_ms"].get(name, 0.0) for r in logged]) for name in names}
        per_log = {
            "logs": args.logs,
            "step_ms": (bho._median([r["step_ms"] for r in logged]) - medians["callback_step_ms"])
            / args.logs,
            "phases_ms": {
                name: (with_logs[name] - medians["phases_ms"].get(name, 0.0)) / args.logs for name in names
            },
        }
    result = {
        "medians": medians,
        "wrapper_ms_per_call": wrapper_s * 1e3,
        "wrappers_ms_per_step": wrappers_ms,
        "callback_step_minus_wrappers_minus_bare_ms": medians["callback_step_ms"]
        - wrappers_ms
        - medians["lightning_bare_ms"],
        # the two parts of that difference: Lightning's automatic optimization, which the callback
        # keeps by contract, and the callback's own step path
        "lightning_automatic_minus_bare_ms": medians["lightning_automatic_ms"] - medians["lightning_bare_ms"],
        "callback_step_minus_wrappers_minus_automatic_ms": medians["callback_step_ms"]
        - wrappers_ms
        - medians["lightning_automatic_ms"],
        "per_log": per_log,
        "rounds": rounds,
        "steps": args.steps,
        "machine": machine_record(torch.cuda.get_device_name(0) if args.device == "cuda" else None),
        "command": " ".join(
            shlex.quote(a)
            for a in [
                "python3",
                "benchmarks/host_path_phases.py",
                *(argv if argv is not None else sys.argv[1:]),
            ]
        ),
    }
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"host_path_phases_{args.device}.json"
    path.write_text(json.dumps(result, indent=2) + "\n")
    print(f"{'phase':28s} ms per replayed step (median over {args.rounds} rounds)")
    for name, value in sorted(medians["phases_ms"].items(), key=lambda kv: -(kv[1] or 0.0)):
        print(f"{name:28s} {value:.4f}")
    print(
        f"callback step {medians['callback_step_ms']:.4f} ms, bare {medians['lightning_bare_ms']:.4f} ms, "
        f"automatic {medians['lightning_automatic_ms']:.4f} ms, "
        f"wrappers {wrappers_ms:.4f} ms ({medians['wrapped_calls_per_step']:.0f} calls)"
    )
    print(
        f"callback - wrappers - bare {result['callback_step_minus_wrappers_minus_bare_ms']:.4f} ms = "
        f"Lightning's automatic optimization {result['lightning_automatic_minus_bare_ms']:.4f} + "
        f"the callback's own {result['callback_step_minus_wrappers_minus_automatic_ms']:.4f}"
    )
    if per_log is not None:
        print(f"per logged value ({args.logs} per step): step {per_log['step_ms']:.4f} ms")
        for name, value in sorted(per_log["phases_ms"].items(), key=lambda kv: -kv[1]):
            print(f"  {name:26s} {value:.4f}")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
