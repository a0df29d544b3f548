"""Does a host-to-device batch copy make the host wait for the GPU?

Lightning moves a batch with ``tensor.to(device, non_blocking=True)``. From page-locked memory that
call only enqueues the copy; from pageable memory the CUDA driver may stage it synchronously, and
if it waits for the work already queued on the stream, every step's copy removes the overlap of the
host's next step with the GPU's current one. Measured directly: queue ``--busy-ms`` of GPU work
(``torch.cuda._sleep``), then time the host call of the copy, for pageable and pinned sources of a
few sizes (a small family's batch is a few KiB), on the default stream and on a side stream.

Output: ``h2d_wait.json`` in ``--out`` and a table on stdout (host ms per copy call; a value near
``--busy-ms`` means the call waited for the queued work).

    python3 benchmarks/h2d_wait.py --out DIR
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

SIZES_KIB = (1, 16, 64, 256, 4096)
REPEATS = 7


def cycles_for(ms: float) -> int:
    """`torch.cuda._sleep` cycles that keep the GPU busy about `ms` milliseconds (measured once)."""
    probe = 10_000_000
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(probe)
    end.record()
    end.synchronize()
    return int(probe * ms / start.elapsed_time(end))


def host_ms(src: torch.Tensor, cycles: int, stream: torch.cuda.Stream) -> float:
    """Median host time of the copy call issued behind `cycles` of queued GPU work on `stream`."""
    times = []
    for _ in range(REPEATS):
        torch.cuda.synchronize()
        with torch.cuda.stream(stream):
            torch.cuda._sleep(cycles)
            started = time.perf_counter()
            src.to("cuda", non_blocking=True)
            times.append((time.perf_counter() - started) * 1e3)
    torch.cuda.synchronize()
    return statistics.median(times)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--busy-ms", type=float, default=5.0, help="GPU work queued before each copy")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("h2d_wait.py needs a CUDA GPU", file=sys.stderr)
        return 2
    cycles = cycles_for(args.busy_ms)
    side = torch.cuda.Stream()
    rows = []
    for kib in SIZES_KIB:
        pageable = torch.randn(kib * 256)  # float32: 256 per KiB
        pinned = pageable.pin_memory()
        for stream_name, stream in (("default", torch.cuda.current_stream()), ("side", side)):
            row = {
                "kib": kib,
                "stream": stream_name,
                "pageable_host_ms": host_ms(pageable, cycles, stream),
                "pinned_host_ms": host_ms(pinned, cycles, stream),
            }
            rows.append(row)
            print(
                f"{kib:6d} KiB {stream_name:8s} pageable {row['pageable_host_ms']:8.3f} ms   "
                f"pinned {row['pinned_host_ms']:8.3f} ms"
            )
    args.out.mkdir(parents=True, exist_ok=True)
    result = {
        "command": f"python3 benchmarks/h2d_wait.py --out DIR --busy-ms {args.busy_ms}",
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "busy_ms": args.busy_ms,
        "method": "host perf_counter around tensor.to('cuda', non_blocking=True), issued right after "
        "torch.cuda._sleep queued busy_ms of GPU work on the same stream; median of repeats",
        "rows": rows,
    }
    (args.out / "h2d_wait.json").write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
