"""Where a decode step's time goes: kernels per step, per layer and per part, each part's time
against the bytes it must move, and the whole step against its bandwidth and launch floors.

A decode step at batch 1 is far above its bytes floor (14.8x for SmolLM2-135M at 320 cached tokens
on the H200, benchmarks/README.md), and whether launches or slow kernels are to blame decides what
to change; this report answers it from one profiled eager step (attributed with
:mod:`~l2lightning.decode.kernel_attribution`) and one profiled graph replay.
"""

from __future__ import annotations

import statistics
from typing import Any

import torch

from l2lightning.decode.config import DecoderConfig, decode_part_bytes, decode_step_bytes
from l2lightning.decode.kernel import device_index_of
from l2lightning.decode.kernel_attribution import ROLE_GROUPS, attribute_kernels, prof_events, profile_ranges
from l2lightning.decode.session import DecodeSession, length_bucket
from l2lightning.decode.timing import median_step_us


def _summarise(
    rows: list[dict[str, Any]], part_bytes: dict[str, int], layers: int, bw: float, key: str
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(per role, per layer) sums of kernels, time (`key` of each row), bytes and bytes floor."""
    instances: dict[tuple[Any, str], float] = {}  # (layer, role) -> time
    counts: dict[tuple[Any, str], int] = {}
    for r in rows:
        k = (r["layer"], r["role"])
        instances[k] = instances.get(k, 0.0) + r[key]
        counts[k] = counts.get(k, 0) + 1
    # Bytes count once per call of a part: layer parts once per layer, the rest once per step;
    # elementwise calls happen several times per layer (rms_norm once, add_rms_norm twice).
    calls_per_layer = {"add_rms_norm": 2}
    by_role: dict[str, dict[str, Any]] = {}
    by_layer: dict[int, dict[str, Any]] = {}
    for (layer, role), t in instances.items():
        n = counts[(layer, role)]
        nbytes = part_bytes.get(role, 0) * calls_per_layer.get(role, 1)
        agg = by_role.setdefault(
            role,
            {
                "role": role,
                "group": ROLE_GROUPS.get(role, "other"),
                "kernels": 0,
                "layered_kernels": 0,
                "time_us": 0.0,
                "bytes": 0,
            },
        )
        agg["kernels"] += n
        agg["layered_kernels"] += n if layer is not None else 0
        agg["time_us"] += t
        agg["bytes"] += nbytes
        if layer is not None:
            lay = by_layer.setdefault(layer, {"layer": layer, "kernels": 0, "time_us": 0.0, "bytes": 0})
            lay["kernels"] += n
            lay["time_us"] += t
            lay["bytes"] += nbytes
    for agg in [*by_role.values(), *by_layer.values()]:
        agg["floor_us"] = agg["bytes"] / bw * 1e6
        agg["x_floor"] = agg["time_us"] / agg["floor_us"] if agg["floor_us"] > 0 else None
        agg["us_per_kernel"] = agg["time_us"] / agg["kernels"] if agg["kernels"] else None
    for agg in by_role.values():  # None for parts outside the layers (embed, lm_head, ...)
        layered = agg.pop("layered_kernels")
        agg["kernels_per_layer"] = layered / layers if layered else None
    roles = sorted(by_role.values(), key=lambda a: -a["time_us"])
    return roles, [by_layer[i] for i in sorted(by_layer)]


def _parts_table(roles: list[dict[str, Any]]) -> list[str]:
    lines = [
        f"  {'part':<18}{'kernels':>8}{'/layer':>8}{'time us':>10}{'us/kernel':>11}"
        f"{'bytes floor us':>16}{'x floor':>9}"
    ]
    for r in roles:
        x = f"{r['x_floor']:.1f}" if r["x_floor"] else "-"
        per_layer = f"{r['kernels_per_layer']:.2f}" if r["kernels_per_layer"] is not None else "-"
        lines.append(
            f"  {r['role']:<18}{r['kernels']:>8}{per_layer:>8}{r['time_us']:>10.1f}"
            f"{r['us_per_kernel'] or 0:>11.2f}{r['floor_us']:>16.3f}{x:>9}"
        )
    return lines


def step_report_from_kernels(
    rows: list[dict[str, Any]],
    config: DecoderConfig,
    batch: int,
    cached: int,
    step_us: float,
    copy_bw: float,
    empty_kernel_us: float | None,
    *,
    dtype_bytes: int = 2,
    label: str = "",
    graph_info: dict[str, Any] | None = None,
    time_source: str = "eager",
) -> dict[str, Any]:
    """The report :func:`decode_step_report` returns, from attributed kernel rows
    (:func:`attribute_kernels`): sums per part and per layer against :func:`decode_part_bytes`, and
    the whole step as a :class:`l2lightning.floors.StepReport` with the part groups as phases."""
    from l2lightning.floors import Floors, PhaseTime, StepReport

    c = config
    graph_info = graph_info or {}
    part_bytes = decode_part_bytes(c, batch, cached, dtype_bytes)
    roles, per_layer = _summarise(rows, part_bytes, c.layers, copy_bw, "time_us")
    kernel_sum = sum(r["time_us"] for r in rows)
    groups: dict[str, dict[str, Any]] = {}
    for role in roles:
        g = groups.setdefault(role["group"], {"time_us": 0.0, "kernels": 0, "bytes": 0})
        g["time_us"] += role["time_us"]
        g["kernels"] += role["kernels"]
        g["bytes"] += role["bytes"]
    step_floor_bytes = decode_step_bytes(c, batch, cached, dtype_bytes)["total"]
    n_kernels = len(rows)
    bytes_us = step_floor_bytes / copy_bw * 1e6
    launch_us = None if empty_kernel_us is None else n_kernels * empty_kernel_us
    floors = Floors(
        bytes_us=bytes_us,
        launch_us=launch_us,
        larger=bytes_us if launch_us is None else max(bytes_us, launch_us),
        bound="launch" if launch_us is not None and launch_us > bytes_us else "bandwidth",
        bytes_moved=step_floor_bytes,
        bytes_by_phase={name: g["bytes"] for name, g in groups.items()},
        kernel_count=n_kernels,
        copy_bw_bytes_per_s=float(copy_bw),
        empty_kernel_us=empty_kernel_us,
        chain="decode",
    )
    phases = [PhaseTime(name, g["time_us"], g["kernels"]) for name, g in groups.items()]
    title = label or f"{c.name} decode step at {cached} cached tokens"
    step_report = StepReport(phases, floors, step_time_us=step_us, label=title)
    layer_kernels = [lay["kernels"] for lay in per_layer]
    per_layer_median = statistics.median(layer_kernels) if layer_kernels else None
    text = "\n".join(
        [
            step_report.format(),
            f"  kernels: {n_kernels} per step (eager, prefetch excluded), "
            f"{per_layer_median if per_layer_median is not None else '?'} per layer (median); "
            f"in the graph: {graph_info.get('kernels', '?')} ({graph_info.get('extra_kernels', '?')} only in the graph)",
            f"  kernel time {kernel_sum:.1f} us of the {step_us:.1f} us step "
            f"({time_source} kernel times; the rest is the gaps between kernels)",
            *_parts_table(roles),
        ]
    )
    return {
        "label": title,
        "model": c.name,
        "layers": c.layers,
        "batch": batch,
        "cached": cached,
        "step_us": step_us,
        "kernel_sum_us": kernel_sum,
        "gap_us": step_us - kernel_sum,
        "kernels_per_step": n_kernels,
        "kernels_per_layer": per_layer_median,
        "time_source": time_source,
        "copy_bandwidth_tbps": copy_bw / 1e12,
        "empty_kernel_us": empty_kernel_us,
        "bytes_floor_us": bytes_us,
        "x_bytes_floor": step_us / bytes_us,
        "graph": graph_info,
        "parts": roles,
        "per_layer": per_layer,
        "kernels": rows,
        "step_report": step_report.to_dict(),
        "text": text,
    }


def decode_step_report(
    session: DecodeSession,
    cached: int,
    tokens: torch.Tensor | None = None,
    *,
    step_us: float | None = None,
    copy_bw: float | None = None,
    empty_kernel_us: float | None = None,
    label: str = "",
) -> dict[str, Any]:
    """Where one decode step's time goes: kernels per step, per layer and per part, each part's time
    against the bytes it must move.

    Two profiled runs of the step at `cached` tokens: one eager step through the session's own
    modules, backend and (compiled) elementwise functions with :func:`profile_ranges` marking each
    part (which kernel belongs to which layer and part, :func:`attribute_kernels`), and one replay
    of the captured graph (the kernels' times inside the graph, and the prefetch kernels only the
    graph has). Where the graph's kernels, prefetch left aside, have the eager step's names in the
    same order, the per-kernel times are the graph's (``time_source: "graph"``), else the eager
    step's. Floors: bytes (:func:`decode_part_bytes`) over `copy_bw` (bytes read + written per
    second, as the decode benchmark's floor), launches times `empty_kernel_us`; both measured with
    the doctor's probes when not given. The whole step (`step_us`, timed here from graph replays
    when not given) is reported through :class:`l2lightning.floors.StepReport` with the part
    groups (linear, attention, elementwise, lm_head, other) as phases.

    Returns a JSON-ready dict; ``"text"`` holds the formatted report. Needs a CUDA graph session.
    """
    from torch.profiler import ProfilerActivity, profile

    if session.device.type != "cuda" or not session.use_graph:
        raise RuntimeError("decode_step_report profiles a CUDA graph session (graph=True on a CUDA device)")
    c = session.config
    device_index = device_index_of(session.device)
    if copy_bw is None or empty_kernel_us is None:
        from l2lightning.step_report import measure_ceilings

        measured_bw, measured_empty = measure_ceilings(device_index)
        copy_bw = copy_bw or measured_bw
        empty_kernel_us = empty_kernel_us if empty_kernel_us is not None else measured_empty
    if not copy_bw:
        raise RuntimeError("decode_step_report: the copy bandwidth could not be measured; pass copy_bw")
    bucket = length_bucket(cached + 1, session.max_len)
    session.set_length(cached, tokens)
    session.step()  # captures this bucket's graph if it has none yet
    if step_us is None:
        step_us = median_step_us(session, cached, tokens)
    backend = session.backends[bucket]

    # 1. one eager step (the graph's work: the body and the advance of tokens and lengths), parts marked
    def eager_step() -> None:
        backend.before_replay(cached)
        session.state.attention = backend
        with torch.no_grad(), profile_ranges(session):
            session._body()
            session._advance()

    session.set_length(cached, tokens)
    eager_step()  # warm (compiled functions, cuBLAS) outside the profiler
    session.set_length(cached, tokens)
    torch.cuda.synchronize(session.device)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        eager_step()
        torch.cuda.synchronize(session.device)
    rows, method = attribute_kernels(prof_events(prof))
    for r in rows:
        r["eager_us"] = r["time_us"]

    # 2. one graph replay
    graph_info: dict[str, Any] = {}
    time_source = "eager"
    try:
        session.set_length(cached, tokens)
        torch.cuda.synchronize(session.device)
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as gprof:
            session.step()
            torch.cuda.synchronize(session.device)
        dev = sorted((e for e in prof_events(gprof) if e.on_device), key=lambda e: e.start_us)
        eager_names = [r["name"] for r in rows]
        known = set(eager_names)
        same = [e for e in dev if e.name in known]
        extra = [e for e in dev if e.name not in known]
        aligned = bool(dev) and [e.name for e in same] == eager_names
        extra_names: dict[str, int] = {}
        for e in extra:
            extra_names[e.name] = extra_names.get(e.name, 0) + 1
        graph_info = {
            "kernels": len(dev),
            "aligned_with_eager": aligned,
            "extra_kernels": len(extra),
            "extra_kernel_names": extra_names,
            "extra_time_us": sum(e.end_us - e.start_us for e in extra),
            "span_us": (max(e.end_us for e in dev) - min(e.start_us for e in dev)) if dev else None,
        }
        if aligned:
            for r, e in zip(rows, same):
                r["time_us"] = e.end_us - e.start_us
            time_source = "graph"
        elif dev:
            mismatch = next(
                (i for i, (a, b) in enumerate(zip(eager_names, [e.name for e in same])) if a != b),
                min(len(eager_names), len(same)),
            )
            graph_info["first_mismatch"] = {
                "index": mismatch,
                "eager": eager_names[mismatch] if mismatch < len(eager_names) else None,
                "graph": same[mismatch].name if mismatch < len(same) else None,
                "eager_count": len(eager_names),
                "graph_count": len(same),
            }
    except Exception as exc:  # the eager attribution still stands; say why the graph part is missing
        graph_info = {"error": f"{type(exc).__name__}: {exc}"}

    # 3. sums, floors, the StepReport
    out = step_report_from_kernels(
        rows,
        c,
        session.batch,
        cached,
        step_us,
        copy_bw,
        empty_kernel_us,
        dtype_bytes=session.state.k_cache.element_size(),
        label=label,
        graph_info=graph_info,
        time_source=time_source,
    )
    out.update(
        bucket=bucket,
        attention=backend.label,
        prefetch=None if session.prefetch is None else str(session.prefetch),
        attribution=method,
    )
    return out
