"""GPU ceiling probes: the measured copy bandwidth and the cost of one empty kernel in a CUDA graph.

Both the step report of ``L2GraphCallback(report=True)`` (its floors) and the GPU doctor (its
findings) measure these, so they live in the library; the doctor adds what only a tool needs
(telemetry readers, findings, formatting). A copy probe can sample telemetry from a thread while
it runs (any object with ``sample() -> dict``), summarised by :func:`summarize_samples`.
"""

from __future__ import annotations

import statistics
import threading
import time
from collections import Counter
from collections.abc import Mapping, Sequence
from typing import Any


def round_int(value: float | None) -> int | None:
    return None if value is None else int(round(value))


def pstate_number(pstate: str | None) -> int | None:
    """``"P5"`` -> 5; None for unknown (``"P32"`` is NVML's 'unknown')."""
    if not pstate or not pstate.upper().startswith("P"):
        return None
    try:
        number = int(pstate[1:])
    except ValueError:
        return None
    return None if number >= 32 else number


def summarize_samples(samples: Sequence[Mapping[str, Any]]) -> dict[str, Any] | None:
    """Summary of the samples taken under load; None when there are none.

    P-state: the most frequent one (ties go to the slower, higher-numbered state); memory/SM clock:
    the median (and the minimum); power and temperature: the maximum; throttle reasons: those set in
    at least half the samples (all seen ones are counted in ``throttle_reasons_seen``). ``gpu_idle``
    is dropped: between two batches of the copy loop the GPU can look idle for a moment.
    """
    if not samples:
        return None

    def values(key: str) -> list[Any]:
        return [s[key] for s in samples if s.get(key) is not None]

    pstates = Counter(s["pstate"] for s in samples if s.get("pstate"))
    pstate = None
    if pstates:
        top = max(pstates.values())
        pstate = max((p for p, c in pstates.items() if c == top), key=lambda p: pstate_number(p) or 0)
    seen: Counter[str] = Counter()
    for s in samples:
        seen.update(r for r in s.get("throttle_reasons") or [] if r != "gpu_idle")
    half = len(samples) / 2
    mem, sm, power, limit, temp = (
        values(k) for k in ("mem_clock_mhz", "sm_clock_mhz", "power_w", "power_limit_w", "temperature_c")
    )
    return {
        "samples": len(samples),
        "pstate": pstate,
        "pstates_seen": sorted(pstates, key=lambda p: pstate_number(p) or 0),
        "mem_clock_mhz": round_int(statistics.median(mem)) if mem else None,
        "mem_clock_min_mhz": min(mem) if mem else None,
        "sm_clock_mhz": round_int(statistics.median(sm)) if sm else None,
        "power_w": max(power) if power else None,
        "power_limit_w": statistics.median(limit) if limit else None,
        "temperature_c": max(temp) if temp else None,
        "throttle_reasons": sorted(r for r, c in seen.items() if c >= half),
        "throttle_reasons_seen": dict(seen),
    }


MIB = 1 << 20
GIB = 1 << 30


class _Sampler(threading.Thread):
    """Samples telemetry every `interval` seconds until stopped."""

    def __init__(self, reader: Any, interval: float = 0.02) -> None:
        super().__init__(daemon=True)
        self.reader = reader
        self.interval = interval
        self.samples: list[dict[str, Any]] = []
        self.errors: list[str] = []
        self._stop_event = threading.Event()

    def run(self) -> None:
        while not self._stop_event.is_set():
            try:
                self.samples.append(self.reader.sample())
            except Exception as exc:
                self.errors.append(f"{type(exc).__name__}: {exc}")
            self._stop_event.wait(self.interval)

    def stop(self) -> None:
        self._stop_event.set()
        self.join(timeout=30)


def measure_copy_load(
    device_index: int,
    buffer_bytes: int = GIB,
    seconds: float = 0.6,
    reader: Any = None,
) -> dict[str, Any]:
    """Run a device-to-device copy loop for about `seconds`, sampling telemetry from a thread.

    Bandwidth = bytes read + bytes written / time, per batch of copies timed with CUDA events; the
    median batch after the first (warm-up) is reported. Returns ``copy_bandwidth_bytes_per_s``,
    ``copy_buffer_bytes``, ``load`` (summary of samples) and ``load_samples``.
    """
    import torch

    device = torch.device("cuda", device_index)
    free, _ = torch.cuda.mem_get_info(device)
    nbytes = buffer_bytes
    while 2 * nbytes + 256 * MIB > free and nbytes > 64 * MIB:
        nbytes //= 2
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    src.fill_(1)
    per_batch = 8
    bandwidths: list[float] = []
    sampler = _Sampler(reader) if reader is not None else None
    try:
        deadline = None
        batch = 0
        while True:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(per_batch):
                dst.copy_(src)
            end.record()
            end.synchronize()
            if batch > 0:
                bandwidths.append(2 * nbytes * per_batch / (start.elapsed_time(end) / 1e3))
            elif sampler is not None:
                sampler.start()  # the first batch ramps the clocks up; sample from the second on
            batch += 1
            if deadline is None:
                deadline = time.perf_counter() + seconds
            if (
                time.perf_counter() >= deadline
                and batch >= 3
                and (sampler is None or len(sampler.samples) >= 3)
            ):
                break
            if time.perf_counter() >= deadline + 10:  # a reader too slow to give 3 samples: stop anyway
                break
    finally:
        if sampler is not None and sampler.is_alive():
            sampler.stop()
        del src, dst
        torch.cuda.empty_cache()
    samples = sampler.samples if sampler is not None else []
    return {
        "copy_bandwidth_bytes_per_s": statistics.median(bandwidths) if bandwidths else None,
        "copy_buffer_bytes": nbytes,
        "load": summarize_samples(samples),
        "load_samples": samples,
        "load_errors": sampler.errors[:3] if sampler is not None else [],
    }


def measure_empty_kernel(
    device_index: int, launches: int = 1000, replays: int = 20, trials: int = 5
) -> float:
    """Microseconds per launch of a one-element add inside a CUDA graph of `launches` launches."""
    import torch

    device = torch.device("cuda", device_index)
    x = torch.zeros(1, device=device)
    side = torch.cuda.Stream(device=device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        for _ in range(3):
            x.add_(1)
    torch.cuda.current_stream(device).wait_stream(side)
    torch.cuda.synchronize(device)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(launches):
            x.add_(1)
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize(device)
    per_launch = []
    for _ in range(trials):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(replays):
            graph.replay()
        end.record()
        end.synchronize()
        per_launch.append(start.elapsed_time(end) * 1e3 / (replays * launches))
    del graph
    return statistics.median(per_launch)
