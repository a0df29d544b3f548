"""The doctor's output: the report ``l2lightning doctor`` prints, and the JSON document benchmarks store.

A timing is only as good as the GPU state it was taken in, so the state and the verdict travel with
the results: :func:`to_dict` is the document the harness stores under ``"doctor"`` in results.json
and the benchmark scripts store in their own JSON; :func:`format_report` is the same for a person,
and :func:`summary_line` the line a benchmark prints before it times.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from l2lightning.probes import GIB, MIB
from l2lightning.tools.doctor_findings import (
    Finding,
    diagnose,
    format_bandwidth,
    peak_bandwidth_bytes_per_s,
    ready_for_timing,
)
from l2lightning.tools.doctor_state import SCHEMA
from l2lightning.tools.gpu_telemetry import THROTTLE_LABELS


def _cell(value: Any, unit: str = "") -> str:
    if value is None:
        return "?"
    if isinstance(value, float):
        value = f"{value:.0f}"
    return f"{value}{unit}"


def _reasons(sample: Mapping[str, Any] | None) -> str:
    if not sample:
        return "?"
    reasons = [THROTTLE_LABELS.get(r, r) for r in sample.get("throttle_reasons") or []]
    if sample.get("throttle_mask") is None and "throttle_reasons_seen" not in sample:
        return "?"
    return ", ".join(reasons) or "none"


def format_report(state: Mapping[str, Any], findings: Sequence[Finding] | None = None) -> str:
    """The human-readable report ``l2lightning doctor`` prints."""
    if findings is None:
        findings = diagnose(state)
    lines = ["l2lightning doctor (reads GPU state only; never changes clocks, power limits or daemons)", ""]
    if state.get("gpu_available"):
        cc = state.get("compute_capability")
        l2 = state.get("l2_bytes")
        mem = state.get("total_memory_bytes")
        parts = [
            f"sm_{cc.replace('.', '')}" if cc else "compute capability ?",
            f"{state.get('sm_count') or '?'} SMs",
        ]
        parts.append(f"L2 {l2 / MIB:.1f} MiB" if l2 else "L2 ?")
        if mem:
            parts.append(f"{mem / GIB:.1f} GiB")
        lines.append(f"GPU {state.get('device_index')}: {state.get('gpu_name')} ({', '.join(parts)})")
    else:
        lines.append(f"GPU: none usable ({state.get('unavailable_reason') or 'unknown reason'})")
    lines.append(
        f"driver {state.get('driver_version') or '?'}, torch {state.get('torch_version') or '?'} "
        f"(CUDA {state.get('torch_cuda') or 'none'})"
    )
    source = state.get("telemetry_source")
    lines.append(
        "telemetry: "
        + ({"nvml": "NVML (pynvml)", "nvidia-smi": "nvidia-smi --query-gpu"}.get(source, "none"))
        + (f" ({state['telemetry_error']})" if state.get("telemetry_error") else "")
    )
    idle, load = state.get("idle"), state.get("load")
    if idle or load:
        n = (load or {}).get("samples")
        header = f"under load ({n} samples, copy loop)" if load else "under load: not measured"
        rows = [
            ("P-state", _cell((idle or {}).get("pstate")), _cell((load or {}).get("pstate"))),
            (
                "memory clock",
                _cell((idle or {}).get("mem_clock_mhz"), " MHz"),
                _cell((load or {}).get("mem_clock_mhz"), " MHz")
                + (f" (max {state['max_mem_clock_mhz']})" if state.get("max_mem_clock_mhz") else ""),
            ),
            (
                "SM clock",
                _cell((idle or {}).get("sm_clock_mhz"), " MHz"),
                _cell((load or {}).get("sm_clock_mhz"), " MHz"),
            ),
            (
                "power",
                _cell((idle or {}).get("power_w"), " W"),
                _cell((load or {}).get("power_w"), " W")
                + f" of {_cell((load or {}).get('power_limit_w') or state.get('power_limit_w'), ' W')} limit",
            ),
            (
                "temperature",
                _cell((idle or {}).get("temperature_c"), " C"),
                _cell((load or {}).get("temperature_c"), " C"),
            ),
            ("throttle", _reasons(idle), _reasons(load)),
        ]
        lines.append("")
        lines.append(f"  {'':<14}{'idle':<14}{header}")
        lines.extend(f"  {name:<14}{a:<14}{b}" for name, a, b in rows)
    lines.append("")
    bw = state.get("copy_bandwidth_bytes_per_s")
    buf = state.get("copy_buffer_bytes")
    peak = peak_bandwidth_bytes_per_s(state)
    lines.append(
        f"  copy bandwidth  {format_bandwidth(bw)}"
        + (f" (read + written, {buf / GIB:.2f} GiB buffers)" if bw is not None and buf else "")
        + (f", {bw / peak:.0%} of {format_bandwidth(peak)} peak" if bw is not None and peak else "")
    )
    us = state.get("empty_kernel_us")
    lines.append(
        "  empty kernel    "
        + (
            f"{us:.2f} us per launch in a CUDA graph ({state.get('empty_kernel_launches')} launches)"
            if us
            else "unknown"
        )
    )
    lines.append(f"  nvidia-powerd   {(state.get('powerd') or {}).get('detail', 'not checked')}")
    lines.append("")
    lines.append("Findings:")
    for f in findings:
        tag = {"ok": "ok", "warning": "WARNING", "problem": "PROBLEM"}[f.level]
        lines.append(f"  [{tag}] {f.title}")
        if f.level != "ok" and f.detail:
            lines.append(f"      why: {f.detail}")
        if f.level != "ok" and f.fix:
            lines.append(f"      fix: {f.fix}")
    ready, reasons = ready_for_timing(state, findings)
    lines.append("")
    if ready:
        lines.append("Ready for timing: yes")
    else:
        lines.append("Ready for timing: NO")
        lines.extend(f"  - {r}" for r in reasons)
    return "\n".join(lines)


def summary_line(state: Mapping[str, Any]) -> str:
    """One line for a benchmark's log: the GPU, its P-state, clocks and throttle reasons under load, copy bandwidth."""
    if not state.get("gpu_available"):
        return f"GPU: none usable ({state.get('unavailable_reason') or 'unknown reason'})"
    load = state.get("load")
    sample, when = (load, "under load") if load else (state.get("idle") or {}, "idle (no sample under load)")
    max_mem = state.get("max_mem_clock_mhz")
    parts = [
        f"{_cell(sample.get('pstate'))} {when}",
        f"memory clock {_cell(sample.get('mem_clock_mhz'))}" + (f" of {max_mem}" if max_mem else "") + " MHz",
        f"SM clock {_cell(sample.get('sm_clock_mhz'), ' MHz')}",
        f"throttle {_reasons(sample)}",
        f"copy bandwidth {format_bandwidth(state.get('copy_bandwidth_bytes_per_s'))}",
    ]
    return f"{state.get('gpu_name') or 'GPU'}: " + ", ".join(parts)


def to_dict(state: Mapping[str, Any], findings: Sequence[Finding] | None = None) -> dict[str, Any]:
    """JSON-ready: the state, the findings and the readiness verdict."""
    if findings is None:
        findings = diagnose(state)
    ready, reasons = ready_for_timing(state, findings)
    return {
        "schema": SCHEMA,
        "state": dict(state),
        "findings": [f.to_dict() for f in findings],
        "ready_for_timing": ready,
        "not_ready_reasons": reasons,
    }


def write_json(path: str | Path, state: Mapping[str, Any], findings: Sequence[Finding] | None = None) -> Path:
    """Write :func:`to_dict` to `path` (parents created)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(to_dict(state, findings), indent=2, default=str) + "\n")
    return path
