"""PrefetchHooks on an unmodified model, inside a training step captured as one CUDA graph.

    python examples/prefetch_hooks_captured_step.py

`PrefetchHooks(model, x)` finds the chain of weight-reading layers with one dry run and hooks them:
while layer i runs, a side stream prefetches layer i+1's weights into L2 (and W_{i-1} before each
backward). `capture_step` records zero-grad, forward, loss, backward and the AdamW step in one graph;
each call copies a batch into the graph's static buffers and replays it. The capture needs CUDA;
on a CPU the example shows the chain the hooks found and skips the rest.
"""

import torch
import torch.nn.functional as F
from torch import nn

from l2lightning import PrefetchHooks, capture_step


def main() -> None:
    torch.manual_seed(0)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    width, depth, batch = 1536, 24, 16
    model = nn.Sequential(
        *[nn.Sequential(nn.LayerNorm(width), nn.Linear(width, width), nn.GELU()) for _ in range(depth)]
    ).to(device, dtype)
    x = torch.randn(batch, width, device=device, dtype=dtype)
    y = torch.randn(batch, width, device=device, dtype=dtype)

    hooks = PrefetchHooks(model, x)  # without CUDA or CuPy: warns once and leaves the model plain
    rows = hooks.plan_summary()  # one row per weight-reading layer: name, MiB, forward/backward plan
    planned = [row for row in rows if row["forward"] or row["backward"]]
    print(f"chain: {len(rows)} weight-reading layers, {len(planned)} with a prefetch plan")
    if device != "cuda":
        print("capture: skipped, capture_step needs a CUDA GPU (torch.cuda.is_available() is False)")
        hooks.remove()
        return

    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True, capturable=True)
    step = capture_step(lambda b: F.mse_loss(model(b[0]).float(), b[1].float()), (x, y), model, optimizer)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(50):
        loss = step((torch.randn_like(x), y))  # copy the batch in, replay the whole step
    end.record()
    torch.cuda.synchronize()
    print(
        f"captured step with prefetch: {start.elapsed_time(end) / 50:.3f} ms/step, last loss {float(loss):.4f}"
    )
    hooks.remove()


if __name__ == "__main__":
    main()
