"""What a sampled replay check's comparison costs the first time a process runs it, and after.

A fit usually makes one check: the rest keep to ``check_share`` of its time. So the check's cost is
mostly its first run's, and on the H200 its comparison took 12-24 ms on models whose tensors copy in
a fraction of that (``replay_check.csv``, ``phases_ms_on``). This probe times, in a fresh process,
after a training step of the conv stack has run (its kernels loaded), each part of the comparison
twice on that model's tensors: the bitwise comparison of equal tensors
(``replay_check.first_difference``), of tensors one of which differs (the description included),
and the judgment against two replays' spread (``beyond_replay_spread``). A first call far above the
second is the cost of the kernels' first use in the process, not of the work.

    python benchmarks/probe_check_first_use.py --out OUTDIR   (writes OUTDIR/check_first_use.json)
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch


def _timed(fn) -> float:
    torch.cuda.synchronize()
    started = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return round((time.perf_counter() - started) * 1000, 3)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="output directory")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("probe_check_first_use: needs CUDA", file=sys.stderr)
        return 2
    from l2lightning.app.models import ConvStack
    from l2lightning.replay_check import beyond_replay_spread, first_difference

    torch.manual_seed(0)
    model = ConvStack(in_channels=3, channels=[32, 64, 128], num_classes=10).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True, capturable=True)
    x = torch.randn(16, 3, 32, 32, device="cuda")
    y = torch.randint(0, 10, (16,), device="cuda")
    for _ in range(2):  # the training step's own kernels, loaded before the comparison runs
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    tensors = [p.detach() for p in model.parameters()] + [b for b in model.buffers()]
    tensors += [v for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    same = [(f"t{i}", t, t.clone()) for i, t in enumerate(tensors)]
    nudged = [t.clone() for t in tensors]
    nudged[0].view(-1)[0] += 1e-6  # one rounding-sized difference in a weight
    differ = [(f"t{i}", t, n) for i, (t, n) in enumerate(zip(tensors, nudged))]
    triples = [(f"t{i}", t, t.clone(), n) for i, (t, n) in enumerate(zip(tensors, nudged))]
    rows = {}
    for name, fn in (
        ("equal_first_difference", lambda: first_difference(same)),
        ("differing_first_difference", lambda: first_difference(differ)),
        ("beyond_replay_spread", lambda: beyond_replay_spread(triples)),
    ):
        rows[name] = {"first_ms": _timed(fn), "second_ms": _timed(fn), "third_ms": _timed(fn)}
        print(name, rows[name], flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "check_first_use.json").write_text(
        json.dumps(
            {
                "command": " ".join(["python3", *sys.argv]),
                "device": torch.cuda.get_device_name(0),
                "torch": torch.__version__,
                "tensors": len(tensors),
                "bytes": sum(t.numel() * t.element_size() for t in tensors),
                "rows": rows,
            },
            indent=2,
        )
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
