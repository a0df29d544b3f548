"""Forward-graph prefetch benchmark (issue 2): plain vs prefetch plans vs decoy, interleaved, H200.

Chains of (LayerNorm, Linear d, GELU) in bf16, captured as one forward graph each; every variant is
a separate graph of the same chain, replayed in round-robin order so clock drift hits all alike.
Prints a table and writes JSON/CSV under --out. The doctor checks the GPU state first (`l2lightning
doctor`); timing is refused on a GPU that is not ready unless `--force`, and the verdict is stored in
the JSON under `doctor`.
"""

from __future__ import annotations

import argparse
import csv
import json
import statistics
import sys
from pathlib import Path

import torch
from torch import nn

from l2lightning import PrefetchHooks, PrefetchPlan
from l2lightning.tools import doctor

CASES = [(1536, 40, 16), (2560, 15, 4)]  # (width, layers, batch), from the issue


def graph_of(model: nn.Module, x: torch.Tensor) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
    with torch.no_grad():
        model(x)
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            out = model(x)
    return g, out


def time_graph(g: torch.cuda.CUDAGraph, replays: int) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        g.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1000 / replays  # µs per replay


def run_case(width: int, layers: int, batch: int, rounds: int, replays: int) -> list[dict]:
    torch.manual_seed(0)
    model = nn.Sequential(
        *[nn.Sequential(nn.LayerNorm(width), nn.Linear(width, width), nn.GELU()) for _ in range(layers)]
    )
    model = model.cuda().to(torch.bfloat16)
    x = torch.randn(batch, width, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        reference = model(x).clone()
    variants: dict[str, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {"plain": graph_of(model, x)}
    plans = {f"hint{b}": PrefetchPlan(kind="hint", blocks=b) for b in (4, 8, 16)}
    plans.update(
        {
            "hint_last8": PrefetchPlan(kind="hint_last", blocks=8),
            "bulk8": PrefetchPlan(kind="bulk", blocks=8, threads=32),
            "bulk_last8": PrefetchPlan(kind="bulk_last", blocks=8, threads=32),
        }
    )
    for name, plan in list(plans.items()) + [("decoy_hint8", PrefetchPlan(kind="hint", blocks=8))]:
        hooks = PrefetchHooks(model, x, plans=plan, backward=False, decoy=name.startswith("decoy"))
        variants[name] = graph_of(model, x)
        hooks.remove()
    # correctness before timing: every variant reproduces the eager output bitwise
    identical = {}
    for name, (g, out) in variants.items():
        g.replay()
        torch.cuda.synchronize()
        identical[name] = torch.equal(out, reference)
    samples = {name: [] for name in variants}
    for _ in range(rounds):
        for name, (g, _) in variants.items():
            samples[name].append(time_graph(g, replays))
    layer_mib = width * width * 2 / (1 << 20)
    plain = statistics.median(samples["plain"])
    rows = []
    for name, values in samples.items():
        med = statistics.median(values)
        q = statistics.quantiles(values, n=4)
        rows.append(
            {
                "width": width,
                "layers": layers,
                "batch": batch,
                "layer_mib": round(layer_mib, 2),
                "variant": name,
                "median_us": round(med, 2),
                "q1_us": round(q[0], 2),
                "q3_us": round(q[2], 2),
                "gain_vs_plain": round(1 - med / plain, 4),
                "outputs_identical": identical[name],
            }
        )
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/h200"))
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--replays", type=int, default=50)
    parser.add_argument("--force", action="store_true", help=doctor.FORCE_HELP)
    args = parser.parse_args(argv)
    check = doctor.check_before_timing(0, force=args.force, program="bench_prefetch_forward")
    if check.refused:
        return 2
    rows = []
    for width, layers, batch in CASES:
        rows += run_case(width, layers, batch, args.rounds, args.replays)
    args.out.mkdir(parents=True, exist_ok=True)
    with open(args.out / "prefetch_forward.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    meta = {
        "command": " ".join([sys.executable, *sys.argv]),
        "torch": torch.__version__,
        "doctor": check.to_dict(),
        "forced": check.forced,
        "rounds": args.rounds,
        "replays_per_sample": args.replays,
        "rows": rows,
    }
    (args.out / "prefetch_forward.json").write_text(json.dumps(meta, indent=2))
    print(f"{'case':<22}{'variant':<14}{'median µs':>10}{'IQR µs':>16}{'gain':>9}")
    for r in rows:
        case = f"d{r['width']}x{r['layers']} b{r['batch']}"
        print(
            f"{case:<22}{r['variant']:<14}{r['median_us']:>10.1f}{r['q1_us']:>8.1f}-{r['q3_us']:<7.1f}{r['gain_vs_plain'] * 100:>8.2f}%"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
