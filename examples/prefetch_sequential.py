"""PrefetchSequential: an nn.Sequential whose forward and backward prefetch the next layer's weights into L2.

    python examples/prefetch_sequential.py

It runs the same modules in the same order as `nn.Sequential`, so outputs and gradients are
bit-identical; a side stream warms L2 with layer i+1's weights while layer i runs. `plans=None` uses
byte-sized default plans; `plans="auto"` lets the autotuner measure them on the first call. Without
CUDA (or CuPy) the prefetch is off and it behaves exactly like `nn.Sequential`; the timing part of
this example needs a GPU.
"""

import torch
from torch import nn

from l2lightning import PrefetchSequential


def cuda_ms(fn, x, repeats: int = 20) -> float:
    """Mean milliseconds per call of fn(x), measured with CUDA events after one warm-up call."""
    fn(x)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        fn(x)
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / repeats


def main() -> None:
    torch.manual_seed(0)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    width, depth = 1536, 24
    blocks = [nn.Sequential(nn.LayerNorm(width), nn.Linear(width, width), nn.GELU()) for _ in range(depth)]
    x = torch.randn(16, width, device=device, dtype=dtype)

    seq = PrefetchSequential(blocks, example_input=None, plans=None).to(device, dtype)
    seq.install(x)  # find the chain now, on the device and dtype it will run with
    plain = nn.Sequential(*seq.layers)  # the very same modules, without prefetch

    with torch.no_grad():
        same = torch.equal(seq(x), plain(x))
    print(f"outputs bit-identical to nn.Sequential: {same}")
    print(f"prefetch enabled: {seq.hooks.enabled}")
    if device != "cuda":
        print("timing: skipped, needs a CUDA GPU (torch.cuda.is_available() is False)")
        return
    with torch.no_grad():
        print(
            f"nn.Sequential: {cuda_ms(plain, x):.3f} ms, PrefetchSequential: {cuda_ms(seq, x):.3f} ms (eager forward)"
        )


if __name__ == "__main__":
    main()
