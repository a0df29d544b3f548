"""Where a peak of GPU memory goes: the allocations alive at the peak, grouped by the code that made them.

A diagnostic for issue 16's memory targets, not a timing. Each scenario runs with PyTorch's memory
history recorded (``torch.cuda.memory._record_memory_history``: every allocation and free with its
Python stack); the trace is replayed to find the moment the allocated bytes peaked, and the
allocations alive then are grouped by the innermost frame of this package (else of Lightning or
torch) that made them.

Scenarios:

- ``tune-training``: the autotuner, forward and backward phases, ``memory_budget=0.75``, on 32 blocks
  (LayerNorm, Linear, GELU) of d=2048 in bf16: the case of ``tests/gpu/test_tune_gpu.py`` whose
  peak overshot the budget by about 80 MiB;
- ``fit-off``, ``fit-default``: a ``Trainer.fit`` of ``bench_default_cost.py``'s d1536x40 b16 stack
  with ``L2GraphCallback(prefetch="off")`` and with the defaults; ``fit-plain``: without it;
- ``fit-off-1024``, ``fit-default-1024``, ``fit-no-gate-1024``: the same on its d1024x60 b8 stack, the
  last with the tuned plans kept without the whole-step gate (``auto_no_gate``);
- ``fit-gate-switch-1024``, ``fit-gate-capture-1024``: that stack with ``prefetch="default"`` (plans
  on every layer, whatever the tuner would keep) put through the whole-step gate, its step without
  prefetch made by switching the prefetch nodes off and by a second capture (the switch disabled);
- ``oom-fit-plain``, ``oom-fit-callback``: the fit of ``tests/gpu/test_oom_gpu.py`` (without the
  memory filler), plain and with the defaults, with the reserved memory per stream at the end and
  the device memory outside PyTorch's allocator at the fit's milestones;
- ``oom-steps-plain``, ``oom-steps-capture-fails``: that fit plain, and with the defaults on a module
  whose capture runs out of memory (the rest of the fit trains eagerly), with each step's peak and
  the step's own allocations alive at it;
- ``accumulate-plain``, ``accumulate-callback``, ``accumulate-callback-factor-1``: a fit with
  ``accumulate_grad_batches=4`` (a graph per micro-batch role with the callback) and, to compare, the
  callback's fit of the same module without accumulation;
- ``outside-torch``: what each thing the callback does before its first step (CuPy, the prefetch
  kernels, a new stream, the capturable optimizer, the op tracer) adds outside PyTorch's allocator.

Output in ``--out``: ``memory_peak.json`` (per scenario: the peak, what was allocated before the
recording, the top groups with bytes and counts).

    python3 benchmarks/memory_peak.py --out DIR [--scenarios tune-training,fit-off]
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
from collections import defaultdict
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

MIB = float(1 << 20)
TOP_GROUPS = 14
# innermost frame of the first of these that an allocation's stack passes through names its group
OWNERS = ("/l2lightning/", "/lightning/", "/torch/optim/", "/torch/")


def frame_label(frames: list[dict[str, Any]]) -> str:
    """The allocation's group: its innermost frame in this package, else in Lightning, else in torch."""
    for owner in OWNERS:
        for f in frames:
            name = f.get("filename", "")
            if owner in name:
                short = name.split(owner, 1)[1]
                return f"{owner.strip('/')}/{short}:{f.get('line')} {f.get('name')}"
    return (
        "(no Python frame: a C++ allocation, cuBLAS workspace or autograd engine)"
        if not frames
        else (f"{frames[0].get('filename')}:{frames[0].get('line')} {frames[0].get('name')}")
    )


def _at_peak(trace: list[dict[str, Any]], added: str, removed: str) -> tuple[int, dict[int, dict[str, Any]]]:
    """(the most bytes that `added` events minus `removed` ones reached, the `added` events alive then).

    Two passes: the first finds the moment, the second replays the trace up to it (a copy of what is
    alive at every new peak would cost a copy per allocation on a growing trace).
    """
    live: dict[int, int] = {}
    total = peak = peak_at = 0
    for i, event in enumerate(trace):
        action = event["action"]
        if action == added:
            live[event["addr"]] = event["size"]
            total += event["size"]
            if total > peak:
                peak, peak_at = total, i
        elif action == removed and event["addr"] in live:
            total -= live.pop(event["addr"])
    alive: dict[int, dict[str, Any]] = {}
    for event in trace[: peak_at + 1]:
        if event["action"] == added:
            alive[event["addr"]] = event
        elif event["action"] == removed:
            alive.pop(event["addr"], None)
    return peak, alive


def live_at_peak(trace: list[dict[str, Any]]) -> tuple[int, dict[int, dict[str, Any]]]:
    """(peak bytes above the recording's start, the allocations alive at that moment) from one device's trace."""
    return _at_peak(trace, "alloc", "free_completed")


def reserved_at_peak(trace: list[dict[str, Any]]) -> tuple[int, dict[int, dict[str, Any]]]:
    """(peak reserved bytes above the recording's start, the segments mapped at that moment)."""
    return _at_peak(trace, "segment_alloc", "segment_free")


def _ranked(labelled: Iterable[tuple[str, int]]) -> list[dict[str, Any]]:
    """(label, bytes) pairs summed per label: the largest :data:`TOP_GROUPS`, in MiB with their counts."""
    by: dict[str, list[int]] = defaultdict(list)
    for label, size in labelled:
        by[label].append(size)
    rows = [{"where": k, "mib": sum(v) / MIB, "count": len(v)} for k, v in by.items()]
    return sorted(rows, key=lambda r: -r["mib"])[:TOP_GROUPS]


def segment_groups(segments: dict[int, dict[str, Any]]) -> list[dict[str, Any]]:
    return _ranked(
        (f"stream {e.get('stream')}: {frame_label(e.get('frames', []))}", e["size"])
        for e in segments.values()
    )


def capture_segments(trace: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The segments mapped while a step was being captured (a frame in ``_capture_into``), grouped
    by stream and the innermost frame of the allocation that made each: what a graph's pool holds."""

    def label(event: dict[str, Any]) -> str:
        frames = event.get("frames", [])
        inner = frames[0] if frames else {}
        where = f"{inner.get('filename', '?').rsplit('/site-packages/', 1)[-1]}:{inner.get('line')} {inner.get('name')}"
        return f"stream {event.get('stream')}: {where} (via {frame_label(frames)})"

    return _ranked(
        (label(e), e["size"])
        for e in trace
        if e["action"] == "segment_alloc"
        and any(f.get("name") == "_capture_into" for f in e.get("frames", []))
    )


def groups(alive: dict[int, dict[str, Any]]) -> list[dict[str, Any]]:
    return _ranked((frame_label(e.get("frames", [])), e["size"]) for e in alive.values())


def recorded(run: Callable[[], dict[str, Any]], step_starts: list[int] | None = None) -> dict[str, Any]:
    """`run` with the memory history recorded; with `step_starts` (the trace's length at each step's
    start, filled by `run`), each step's peak too (:func:`step_peaks`)."""
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    torch.cuda.memory._record_memory_history(max_entries=2_000_000, stacks="python")
    try:
        info = run()
        torch.cuda.synchronize()
        snapshot = torch.cuda.memory._snapshot()
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
    device = torch.cuda.current_device()
    peak, alive = live_at_peak(snapshot["device_traces"][device])
    reserved_peak, segments = reserved_at_peak(snapshot["device_traces"][device])
    return {
        **info,
        "max_memory_reserved_mib": torch.cuda.max_memory_reserved() / MIB,
        "reserved_peak_over_before_mib": reserved_peak / MIB,
        "segments_at_reserved_peak": segment_groups(segments),
        "segments_made_by_captures": capture_segments(snapshot["device_traces"][device]),
        "allocated_before_mib": before / MIB,
        "max_memory_allocated_mib": torch.cuda.max_memory_allocated() / MIB,
        "peak_over_before_mib": peak / MIB,
        "alive_at_peak": groups(alive),
        **({"steps": step_peaks(snapshot["device_traces"][device], step_starts)} if step_starts else {}),
    }


def tune_training() -> dict[str, Any]:
    from torch import nn

    from l2lightning.graph.capture import clear_cublas_workspaces
    from l2lightning.prefetch.chain import discover_chain
    from l2lightning.tune.search import Autotuner

    torch.manual_seed(0)
    blocks = [nn.Sequential(nn.LayerNorm(2048), nn.Linear(2048, 2048), nn.GELU()) for _ in range(32)]
    model = nn.Sequential(*blocks).to("cuda", torch.bfloat16)
    x = torch.randn(4, 2048, device="cuda", dtype=torch.bfloat16)
    chain = discover_chain(model, x)
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    clear_cublas_workspaces()

    def run() -> dict[str, Any]:
        report = Autotuner(memory_budget=0.75, cache=None).tune(
            chain, x.device, ("forward", "backward"), model_bytes=params
        )
        return {
            "budget_mib": report.memory_budget_bytes / MIB,
            "ledger_peak_mib": report.memory_peak_bytes / MIB,
            "param_mib": params / MIB,
        }

    return recorded(run)


def fit(variant: str, width: int = 1536, depth: int = 40, batch: int = 16) -> dict[str, Any]:
    from bench_default_cost import VARIANTS, fit_once

    def run() -> dict[str, Any]:
        row = fit_once(variant, width, depth, batch, 60, 20)
        return {
            k: row.get(k)
            for k in (
                "case",
                "variant",
                "peak_alloc_gib",
                "peak_reserved_gib",
                "graph_pool_mib",
                "captured",
                "captures",
                "prefetch_gate",
                "prefetch_layers",
            )
        }

    if variant not in VARIANTS:
        raise ValueError(f"unknown variant {variant!r}; accepted: {sorted(VARIANTS)}")
    return recorded(run)


def step_peaks(trace: list[dict[str, Any]], starts: list[int]) -> list[dict[str, Any]]:
    """Per step (`starts`: the trace's length at each step's start), the allocated bytes above the
    recording's start at the step's start and at its peak, and what was alive at that peak: grouped,
    and the step's own allocations alive then, the largest first, with their stream and frames."""
    bounds = list(zip(starts, [*starts[1:], len(trace)]))
    live: dict[int, dict[str, Any]] = {}
    total = 0
    rows: list[dict[str, Any]] = []
    step = -1
    for i, event in enumerate(trace):
        while step + 1 < len(bounds) and i >= bounds[step + 1][0]:
            step += 1
            rows.append({"start_mib": total / MIB, "peak_mib": total / MIB, "alive": dict(live)})
        if event["action"] == "alloc":
            live[event["addr"]] = event
            total += event["size"]
            if step >= 0 and total / MIB > rows[step]["peak_mib"]:
                rows[step]["peak_mib"] = total / MIB
                rows[step]["peak_at"] = i
        elif event["action"] == "free_completed":
            gone = live.pop(event["addr"], None)
            total -= gone["size"] if gone else 0
    # the alive sets at each peak: a second replay up to each peak (a copy per new peak would cost
    # a copy per allocation)
    for row, (start, _) in zip(rows, bounds):
        at = row.pop("peak_at", None)
        alive = row.pop("alive")
        if at is None:
            row["alive_at_peak"], row["own_at_peak"] = groups(alive), []
            continue
        for event in trace[start : at + 1]:
            if event["action"] == "alloc":
                alive[event["addr"]] = {**event, "own": True}
            elif event["action"] == "free_completed":
                alive.pop(event["addr"], None)
        row["alive_at_peak"] = groups(alive)
        own = sorted((e for e in alive.values() if e.get("own")), key=lambda e: -e["size"])[:8]
        row["own_at_peak"] = [
            {
                "mib": e["size"] / MIB,
                "stream": e.get("stream"),
                "frames": [
                    f"{f.get('filename', '?').rsplit('/', 1)[-1]}:{f.get('line')} {f.get('name')}"
                    for f in e.get("frames", [])[:4]
                ],
            }
            for e in own
        ]
    return rows


def tiny_mlp_fit(with_callback: bool, model_name: str = "TinyMLP", per_step: bool = False) -> dict[str, Any]:
    """tests/gpu/test_oom_gpu.py's fit (TinyMLP 2048 x 8, batch 64, fused AdamW, 12 steps), without filler.

    `model_name`: a class of tests/lightning_models.py (``RunsOutOfMemoryInCapture``: the capture
    runs out of memory, the rest of the fit trains eagerly). `per_step`: also each step's peak.
    """
    root = Path(__file__).resolve().parents[1]
    if str(root) not in sys.path:
        sys.path.insert(0, str(root))
    from lightning.pytorch import Callback, seed_everything

    from l2lightning import L2GraphCallback
    from tests import lightning_models
    from tests.lightning_models import quiet_trainer, regression_loader

    model_cls = getattr(lightning_models, model_name)
    trace_starts: list[int] = []

    class StepStarts(Callback):
        """The memory trace's length at each step's start (a snapshot: cheap enough for 12 steps)."""

        def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, i: int) -> None:
            torch.cuda.synchronize()
            trace_starts.append(
                len(torch.cuda.memory._snapshot()["device_traces"][torch.cuda.current_device()])
            )

    class OutsideTorch(Callback):
        """Memory outside PyTorch's allocator at the fit's milestones (it shrinks what a fit may allocate)."""

        def __init__(self) -> None:
            self.seen: dict[str, float] = {"before_fit": outside_torch_mib()}

        def on_train_start(self, trainer: Any, pl_module: Any) -> None:
            self.seen["train_start"] = outside_torch_mib()

        def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, i: int) -> None:
            if i in (0, 1, 4, 8):
                self.seen[f"after_step_{i}"] = outside_torch_mib()

    def run() -> dict[str, Any]:
        seed_everything(0)
        model = model_cls(width=2048, depth=8, fused=True)
        cb = L2GraphCallback() if with_callback else None
        outside = OutsideTorch()
        starts = [StepStarts()] if per_step else []
        trainer = quiet_trainer(
            accelerator="gpu", devices=1, max_steps=12, callbacks=[*starts, outside, *([cb] if cb else [])]
        )
        trainer.fit(model, regression_loader(n=64 * 13, width=2048, batch_size=64))
        segments: dict[str, float] = defaultdict(float)
        for seg in torch.cuda.memory._snapshot()["segments"]:
            segments[f"stream {seg.get('stream')}"] += seg["total_size"] / MIB
        return {
            "peak_reserved_mib": torch.cuda.max_memory_reserved() / MIB,
            "reserved_by_stream_at_end_mib": dict(segments),
            "outside_torch_mib": outside.seen,
            "captured": cb.summary()["captured"] if cb else None,
            "reason": cb.summary()["reason"] if cb else None,
        }

    return recorded(run, trace_starts if per_step else None)


def accumulated_fit(with_callback: bool, factor: int = 4) -> dict[str, Any]:
    """Gradient accumulation's memory (issue 35): TinyMLP 1024 x 8 at batch 512, fused AdamW, 12
    optimizer steps of `factor` micro-batches, plain or with the callback's defaults. With the
    callback each micro-batch role (the window's first, the adding ones, the closing one) replays a
    graph of its own, each pool holding a micro-batch's activations; `graph_pool_mib` is their sum.
    ``factor=1`` is the same fit without accumulation, one graph, to compare against."""
    root = Path(__file__).resolve().parents[1]
    if str(root) not in sys.path:
        sys.path.insert(0, str(root))
    from lightning.pytorch import seed_everything

    from l2lightning import L2GraphCallback
    from tests.lightning_models import TinyMLP, quiet_trainer, regression_loader

    def run() -> dict[str, Any]:
        seed_everything(0)
        model = TinyMLP(width=1024, depth=8, fused=True)
        cb = L2GraphCallback() if with_callback else None
        trainer = quiet_trainer(
            accelerator="gpu",
            devices=1,
            max_steps=12,
            accumulate_grad_batches=factor,
            callbacks=[cb] if cb else [],
        )
        trainer.fit(model, regression_loader(n=512 * factor * 13, width=1024, batch_size=512))
        summary = cb.summary() if cb else {}
        return {
            "factor": factor,
            "peak_reserved_mib": torch.cuda.max_memory_reserved() / MIB,
            **{
                k: summary.get(k)
                for k in ("captured", "reason", "graphs", "graph_pool_mib", "fallback_steps")
            },
        }

    return recorded(run)


def outside_torch_mib() -> float:
    """Device memory this process uses beyond PyTorch's allocator: CUDA context, loaded kernels,
    library handles and workspaces outside it, other allocators (CuPy's)."""
    free, total = torch.cuda.mem_get_info()
    return round((total - free - torch.cuda.memory_reserved()) / MIB, 1)


def outside_torch_steps() -> dict[str, Any]:
    """What each thing the callback does before its first step adds outside PyTorch's allocator.

    After a plain eager fused-AdamW step on the default stream (the kernels a plain fit loads), in
    order: CuPy's import, the prefetch kernels' compile and load, an elementwise kernel and then GEMMs
    on a new stream, a step of the capturable optimizer and a step under the callback's op tracer on
    that stream, a GEMM on a third stream.
    """
    from torch import nn

    from l2lightning.graph.optim import make_capturable
    from l2lightning.guards.step_trace import StepTracer

    seen: list[tuple[str, float]] = [("torch initialised", outside_torch_mib())]

    def mark(what: str) -> None:
        torch.cuda.synchronize()
        seen.append((what, outside_torch_mib()))

    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(2048, 2048) for _ in range(4)]).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    x = torch.randn(64, 2048, device="cuda")

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        model(x).square().mean().backward()
        opt.step()

    step()
    mark("plain fused AdamW step, default stream")
    step()
    mark("a second plain step")
    import cupy  # noqa: F401

    mark("import cupy")
    from l2lightning._env import prefetch_unavailable_reason

    reason = prefetch_unavailable_reason()
    if reason is None:
        from l2lightning.prefetch.kernels import load_prefetch_kernels

        load_prefetch_kernels(torch.cuda.current_device())
        mark("prefetch kernels compiled and loaded")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        x.add(1)
        mark("an elementwise kernel on a new stream")
        x @ x.T
        mark("a GEMM on that stream")
        model(x)
        mark("a forward on it")
        step()
        mark("a plain step on the new stream")
        make_capturable(opt, torch.device("cuda"))
        step()
        mark("a capturable fused AdamW step on it")
        with StepTracer("cuda"):
            step()
        mark("a step under the op tracer")
    torch.cuda.current_stream().wait_stream(side)
    third = torch.cuda.Stream()
    third.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(third):
        x @ x.T
        mark("a GEMM on a third stream")
    torch.cuda.current_stream().wait_stream(third)
    deltas = [(what, round(b - a, 1)) for (_, a), (what, b) in zip(seen, seen[1:])]
    return {
        "outside_torch_mib": dict(seen),
        "added_mib": dict(deltas),
        "prefetch_unavailable": reason,
        "alive_at_peak": [],
    }


def gated_fit(method: str) -> dict[str, Any]:
    """The gate's trial on the default plans (the gate judges only tuned plans otherwise)."""
    import bench_default_cost

    from l2lightning.callback.prefetch_setup import PrefetchSetup

    gated_modes = PrefetchSetup._GATED_MODES
    switch = PrefetchSetup._prefetch_switch
    bench_default_cost.VARIANTS["gated_default_plans"] = {"prefetch": "default"}
    PrefetchSetup._GATED_MODES = (*gated_modes, "default")
    if method == "capture":
        PrefetchSetup._prefetch_switch = lambda self, graph: (None, "disabled by memory_peak.py")
    try:
        return fit("gated_default_plans", 1024, 60, 8)
    finally:
        PrefetchSetup._GATED_MODES = gated_modes
        PrefetchSetup._prefetch_switch = switch
        del bench_default_cost.VARIANTS["gated_default_plans"]


SCENARIOS: dict[str, Callable[[], dict[str, Any]]] = {
    "outside-torch": outside_torch_steps,
    "oom-fit-plain": lambda: tiny_mlp_fit(False),
    "oom-fit-callback": lambda: tiny_mlp_fit(True),
    "oom-steps-plain": lambda: tiny_mlp_fit(False, per_step=True),
    "oom-steps-capture-fails": lambda: tiny_mlp_fit(True, "RunsOutOfMemoryInCapture", per_step=True),
    "accumulate-plain": lambda: accumulated_fit(False),
    "accumulate-callback": lambda: accumulated_fit(True),
    "accumulate-callback-factor-1": lambda: accumulated_fit(True, factor=1),
    "tune-training": tune_training,
    "fit-plain": lambda: fit("plain"),
    "fit-off": lambda: fit("off"),
    "fit-default": lambda: fit("default"),
    "fit-off-1024": lambda: fit("off", 1024, 60, 8),
    "fit-default-1024": lambda: fit("default", 1024, 60, 8),
    "fit-no-gate-1024": lambda: fit("auto_no_gate", 1024, 60, 8),
    "fit-gate-switch-1024": lambda: gated_fit("switch"),
    "fit-gate-capture-1024": lambda: gated_fit("capture"),
}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--scenarios", default=",".join(SCENARIOS))
    args = p.parse_args(argv)
    names = [s for s in args.scenarios.split(",") if s]
    unknown = [s for s in names if s not in SCENARIOS]
    if unknown:
        p.error(f"--scenarios: unknown {unknown}; accepted: {sorted(SCENARIOS)}")
    if not torch.cuda.is_available():
        print("memory_peak.py needs a CUDA GPU", file=sys.stderr)
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    results = {"command": "python3 benchmarks/memory_peak.py --out DIR --scenarios " + ",".join(names)}
    for name in names:
        try:
            results[name] = SCENARIOS[name]()
        except Exception as exc:  # one scenario's failure is a result; the others still run
            results[name] = {"error": f"{type(exc).__name__}: {exc}"}
        r = results[name]
        shown = {
            k: v
            for k, v in r.items()
            if k not in ("alive_at_peak", "segments_at_reserved_peak", "segments_made_by_captures", "steps")
        }
        print(f"== {name}: " + json.dumps(shown, default=str))
        for g in r.get("alive_at_peak", []):
            print(f"   {g['mib']:9.1f} MiB  x{g['count']:<5} {g['where']}")
        if r.get("segments_at_reserved_peak"):
            print("   segments mapped at the reserved peak:")
        for g in r.get("segments_at_reserved_peak", []):
            print(f"   {g['mib']:9.1f} MiB  x{g['count']:<5} {g['where']}")
        for i, step in enumerate(r.get("steps", [])):
            print(
                f"   step {i}: {step['start_mib']:.1f} MiB at its start, {step['peak_mib']:.1f} at its peak"
            )
            for own in step["own_at_peak"][:4]:
                print(f"      {own['mib']:8.1f} MiB  stream {own['stream']}  {' < '.join(own['frames'])}")
        if r.get("segments_made_by_captures"):
            print("   segments mapped by captures:")
        for g in r.get("segments_made_by_captures", []):
            print(f"   {g['mib']:9.1f} MiB  x{g['count']:<5} {g['where']}")
    (args.out / "memory_peak.json").write_text(json.dumps(results, indent=1, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
