"""What a sampled replay check's comparison costs the first time a process runs it, and after.

A fit usually makes one check: the rest keep to ``check_share`` of its time. So the check's cost is
mostly its first run's. Per model (the packaged conv stack, and the MLP stack at its packaged
1024x8) and per comparison path, a fresh process trains two steps (the step's own kernels loaded),
then times three times each on that model's tensors (parameters, gradients, buffers, AdamW's state):
the bitwise comparison of equal tensors (``replay_check.first_differing``), of tensors one of which
differs, and the judgment against two replays' spread (``beyond_replay_spread``). The paths:

- ``torch``: torch's kernels (the bytes joined in batches of at most 64 MiB a side, compared and
  reduced; multi-tensor subtractions and norms for the spread), ``check_kernels.ENABLED = False``;
- ``kernel``: the check's own kernels (``l2lightning.guards.check_kernels``, ``kernels/replay_check.cu``),
  CuPy imported and the prefetch kernels loaded first, as a fit with prefetch on has them at set-up
  (timed apart: ``cupy_import_ms``, ``prefetch_kernels_ms``); the first call includes compiling the
  check's module with NVRTC where CuPy's kernel cache does not hold it yet (the conv stack's process
  runs first: on a fresh machine it compiles, the MLP stack's loads).

A first call far above the second is the cost of the first use in the process (kernels, memory),
not of the work. ``--breakdown`` adds a process that times each operation of the device path on the
MLP stack's tensors once, in order (allocation, join, comparison, reduction, read), to say which
first use costs what.

    python benchmarks/probe_check_first_use.py --out OUTDIR   (writes OUTDIR/check_first_use.json)
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import torch

MODELS = ("conv_stack", "mlp_stack")
DEVICE = "cuda"  # --device cpu runs the probe's code paths without a GPU (its times mean nothing)
PATHS = ("torch", "kernel")


def _sync() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def _timed(fn) -> float:
    _sync()
    started = time.perf_counter()
    fn()
    _sync()
    return round((time.perf_counter() - started) * 1000, 3)


def _trained_tensors(model_name: str) -> list[torch.Tensor]:
    """A model's parameters, gradients, buffers and optimizer state after two training steps."""
    from l2lightning.app.models import ConvStack, MLPStack

    torch.manual_seed(0)
    if model_name == "conv_stack":
        model = ConvStack(in_channels=3, channels=[32, 64, 128], num_classes=10).to(DEVICE)
        x, y = torch.randn(16, 3, 32, 32, device=DEVICE), torch.randint(0, 10, (16,), device=DEVICE)
    else:
        model = MLPStack(width=1024, depth=8).to(DEVICE)
        x, y = torch.randn(16, 1024, device=DEVICE), torch.randn(16, 1, device=DEVICE)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True, capturable=DEVICE == "cuda")
    for _ in range(2):
        out = model(x)
        if model_name == "conv_stack":
            loss = torch.nn.functional.cross_entropy(out, y)
        else:
            loss = torch.nn.functional.mse_loss(out.float(), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    tensors = [p.detach() for p in model.parameters()] + [p.grad for p in model.parameters()]
    tensors += list(model.buffers())
    tensors += [v for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    return tensors


def _one(model_name: str, path: str) -> dict:
    from l2lightning.guards import check_kernels, replay_check

    tensors = _trained_tensors(model_name)
    cupy_import_ms = prefetch_kernels_ms = None
    if path == "torch":
        check_kernels.ENABLED = False
    else:
        # what a fit with prefetch on has done at set-up: CuPy imported, the prefetch kernels loaded
        started = time.perf_counter()
        import cupy  # noqa: F401

        cupy_import_ms = round((time.perf_counter() - started) * 1000, 3)
        from l2lightning.prefetch.kernels import load_prefetch_kernels

        started = time.perf_counter()
        load_prefetch_kernels(torch.cuda.current_device())
        prefetch_kernels_ms = round((time.perf_counter() - started) * 1000, 3)
    same = [(f"t{i}", t, t.clone()) for i, t in enumerate(tensors)]
    nudged = [t.clone() for t in tensors]
    nudged[0].view(-1)[0] += 1e-6  # one rounding-sized difference in a weight
    differ = [(f"t{i}", t, n) for i, (t, n) in enumerate(zip(tensors, nudged))]
    triples = [(f"t{i}", t, t.clone(), n) for i, (t, n) in enumerate(zip(tensors, nudged))]
    rows = {}
    for name, fn in (
        ("equal_first_differing", lambda: replay_check.first_differing(same)),
        ("differing_first_differing", lambda: replay_check.first_differing(differ)),
        ("beyond_replay_spread", lambda: replay_check.beyond_replay_spread(triples)),
    ):
        rows[name] = {"first_ms": _timed(fn), "second_ms": _timed(fn), "third_ms": _timed(fn)}
    return {
        "model": model_name,
        "path": path,
        "cupy_import_ms": cupy_import_ms,
        "prefetch_kernels_ms": prefetch_kernels_ms,
        "kernels_decide": check_kernels.usable(torch.device(DEVICE)),
        "tensors": len(tensors),
        "bytes_a_side": sum(t.numel() * t.element_size() for t in tensors),
        "rows": rows,
    }


def _timed_value(fn, *args, **kwargs):
    """(milliseconds, result) of fn(*args, **kwargs), the GPU idle before and after."""
    _sync()
    started = time.perf_counter()
    value = fn(*args, **kwargs)
    _sync()
    return round((time.perf_counter() - started) * 1000, 3), value


def _breakdown() -> dict:
    """Each operation of the device path's equal comparison on the MLP stack's tensors, timed once."""
    from l2lightning.guards.replay_check import _bytes, _joined_batches

    tensors = _trained_tensors("mlp_stack")
    copies = [t.clone() for t in tensors]
    views = [(_bytes(a), _bytes(b)) for a, b in zip(tensors, copies)]
    steps: list[tuple[str, float]] = []
    for left, right in _joined_batches(views, 64 * 2**20):
        total = sum(v.numel() for v in left)
        ms, _ = _timed_value(torch.empty, total, dtype=torch.uint8, device=DEVICE)
        steps.append(("allocate a join's output", ms))
        ms, joined_left = _timed_value(torch.cat, left)
        steps.append(("join the left side (cat)", ms))
        ms, joined_right = _timed_value(torch.cat, right)
        steps.append(("join the right side (cat)", ms))
        ms, differs = _timed_value(torch.ne, joined_left, joined_right)
        steps.append(("compare bytes (ne)", ms))
        ms, flag = _timed_value(torch.any, differs)
        steps.append(("reduce (any)", ms))
        ms, flags = _timed_value(torch.stack, [flag])
        steps.append(("stack the flags", ms))
        ms, _ = _timed_value(lambda f: bool(f.any().cpu()), flags)
        steps.append(("read to the host", ms))
    return {"model": "mlp_stack", "path": "device, one operation at a time", "steps": steps}


def _in_fresh_process(args: list[str]) -> dict:
    done = subprocess.run(
        [sys.executable, __file__, "--device", DEVICE, *args],
        capture_output=True,
        text=True,
        check=False,
        timeout=300,
    )
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode != 0 or not lines:
        return {"args": args, "error": (done.stderr or done.stdout)[-2000:]}
    return json.loads(lines[-1])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="output directory (the parent run)")
    parser.add_argument("--one", nargs=2, metavar=("MODEL", "PATH"), help="one measurement, this process")
    parser.add_argument(
        "--breakdown", action="store_true", help="also time the device path operation by operation"
    )
    parser.add_argument("--breakdown-here", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument(
        "--device", choices=("cuda", "cpu"), default="cuda", help="cpu: a dry run of the code paths"
    )
    args = parser.parse_args(argv)
    global DEVICE
    DEVICE = args.device
    if DEVICE == "cuda" and not torch.cuda.is_available():
        print("probe_check_first_use: needs CUDA", file=sys.stderr)
        return 2
    if args.one:
        model_name, path = args.one
        if model_name not in MODELS or path not in PATHS:
            parser.error(f"--one MODEL PATH: MODEL one of {MODELS}, PATH one of {PATHS}")
        print(json.dumps(_one(model_name, path)), flush=True)
        return 0
    if args.breakdown_here:
        print(json.dumps(_breakdown()), flush=True)
        return 0
    if not args.out:
        parser.error("--out is required")
    results = []
    for model_name in MODELS:
        for path in PATHS:
            result = _in_fresh_process(["--one", model_name, path])
            print(json.dumps(result), flush=True)
            results.append(result)
    if args.breakdown:
        result = _in_fresh_process(["--breakdown-here"])
        print(json.dumps(result), flush=True)
        results.append(result)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "check_first_use.json").write_text(
        json.dumps(
            {
                "command": " ".join(["python3", *sys.argv]),
                "device": torch.cuda.get_device_name(0) if DEVICE == "cuda" else "cpu (dry run)",
                "torch": torch.__version__,
                "results": results,
            },
            indent=2,
        )
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
