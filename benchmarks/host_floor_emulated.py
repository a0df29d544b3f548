"""The callback's own per-step host path on a CPU, with the graph emulator: issue 37's
``floor_ms - lightning_bare_ms`` where no GPU is at hand.

What it measures, in one process, ``--rounds`` rounds of three fits interleaved (each fit
``bench_host_overhead.SKIP + --steps + 1`` steps on the floor's loader and Trainer: batch 1, no logger
or progress bar; the median per-step time of each fit after its skip, then the median over rounds):

- ``lightning_bare_ms``: plain Lightning when the step does nothing (``bench_host_overhead.fit_bare``);
- ``plain_floor_ms``: plain Lightning on the floor's 1->1 Linear with foreach AdamW, run eagerly on the
  CPU (its compute is the CPU's: not a GPU figure);
- ``callback_floor_ms``: the same module with ``L2GraphCallback(prefetch="off", verify=False)``, the
  steps after its capture timed. ``tests/graph_emulator.py`` stands in for CUDA-graph capture and its
  replay runs nothing, so a replayed step is the callback's Python and Lightning's loop alone. The
  sampled check is off: a replay that runs nothing differs from its eager step.

``callback_floor_ms - lightning_bare_ms`` is the callback's replay path plus Lightning's automatic
optimization around it, on this CPU. A GPU adds what only it has (the replay launch, the batch's copy
to the device, CUDA events); read the figure as a lead for the GPU's, not as one.

    python3 benchmarks/host_floor_emulated.py --out benchmarks/results/cpu-emulator --rounds 5
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def main(argv: list[str] | None = None, set_attr=setattr) -> int:
    """`set_attr` installs the graph emulator (a test passes ``monkeypatch.setattr``, so it is undone)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="directory for host_floor_emulated.json")
    parser.add_argument("--rounds", type=int, default=5, help="rounds of the three fits (default 5)")
    parser.add_argument("--steps", type=int, default=400, help="timed steps per fit (default 400)")
    args = parser.parse_args(argv)
    if args.rounds < 1 or args.steps < 1:
        parser.error(f"--rounds and --steps must be at least 1, got {args.rounds} and {args.steps}")

    sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]
    import torch

    from tests import graph_emulator as emu

    emu.install(set_attr)
    set_attr(emu.FakeGraph, "replay", lambda self: None)
    import bench_host_overhead as bho
    from run_record import machine_record

    from l2lightning import L2GraphCallback

    floor = argparse.Namespace(accelerator="cpu", device=0, steps=args.steps)

    def callback_floor() -> float | None:
        cb = L2GraphCallback(prefetch="off", log_timing=False, verify=False)
        timer = bho._fit_on_floor_loader(floor, bho._logging_module(0, torch.device("cpu"), "foreach"), [cb])
        summary = cb.summary()
        if not summary["captured"]:
            raise RuntimeError(f"the emulated floor fit did not capture: {summary['reason']}")
        start = max(bho.SKIP, int(summary["capture_step"]) + 2)
        return bho._median(bho._step_ms(timer, start, args.steps))

    variants = {
        "lightning_bare_ms": lambda: bho.fit_bare(floor),
        "plain_floor_ms": lambda: bho.fit_floor(floor, 0, with_callback=False),
        "callback_floor_ms": callback_floor,
    }
    rounds: dict[str, list[float]] = {name: [] for name in variants}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as ab_host_path.py --emulate: one thread, the host path alone
    try:
        with bho._quiet_progress(True):
            for _ in range(args.rounds):
                for name, run in variants.items():
                    rounds[name].append(run())
    finally:
        torch.set_num_threads(threads)
    medians = {name: statistics.median(values) for name, values in rounds.items()}
    result = {
        "medians_ms": medians,
        "callback_floor_minus_bare_ms": medians["callback_floor_ms"] - medians["lightning_bare_ms"],
        "rounds_ms": rounds,
        "steps": args.steps,
        "machine": machine_record(),
        "command": " ".join(shlex.quote(a) for a in [sys.executable, *sys.argv]),
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "host_floor_emulated.json").write_text(json.dumps(result, indent=2) + "\n")
    for name, value in medians.items():
        print(f"{name:20s} {value:.4f}  rounds {[round(v, 4) for v in rounds[name]]}")
    print(f"callback_floor - bare {result['callback_floor_minus_bare_ms']:.4f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
