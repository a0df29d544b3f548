"""Small prefetch workload for `compute-sanitizer --tool memcheck` (eager and inside a graph, every kind)."""

from __future__ import annotations

import torch
from torch import nn

from l2lightning import PrefetchHooks, PrefetchPlan
from l2lightning.prefetch.kernels import prefetch, supported_kinds


def main() -> None:
    w = torch.randn(3 << 20, device="cuda")
    odd = torch.randn(1000003, device="cuda")[1:]  # unaligned start, odd size: the bulk edge trimming
    for kind in supported_kinds(0):
        plan = PrefetchPlan(kind=kind, blocks=4)
        prefetch(w, plan)
        prefetch(odd, plan)
    model = nn.Sequential(*[nn.Linear(1024, 1024) for _ in range(4)]).cuda()
    x = torch.randn(8, 1024, device="cuda")
    hooks = PrefetchHooks(model, x, plans=PrefetchPlan(kind="hint", blocks=4))
    model(x).sum().backward()
    hooks.remove()
    torch.cuda.synchronize()
    print("prefetch sanitize workload done")


if __name__ == "__main__":
    main()
