"""GPU state doctor: is this GPU in a state where timings mean anything?

`l2lightning doctor` (or `python -m l2lightning doctor`) reads and prints the GPU's name, SMs and L2
size; its P-state, memory clock, power draw and active clock-throttle reasons at idle and *under
load* (sampled from a thread while a memory-saturating device-to-device copy loop runs); the
measured copy bandwidth (bytes read + written over time, >= 1 GiB buffers, CUDA events); the cost
of one empty kernel inside a CUDA graph; and, where systemd runs, whether `nvidia-powerd`
(Dynamic Boost) is active.

The trap it was written for: on a laptop, nvidia-powerd held the GPU at P5 with its memory clock
at 810 MHz under load and the "SW Power Cap" throttle set at 46 W of an 80 W limit, which cut copy
bandwidth tenfold. Every benchmark run in that state measures the daemon, not the code.

The doctor only reads. It never changes clocks, power limits or daemons; each finding says what
the user can run (e.g. ``sudo systemctl stop nvidia-powerd`` for this boot).

Structure: :func:`collect` gathers a *state* dict from the live GPU (telemetry from NVML through
``pynvml`` from nvidia-ml-py, or parsed from ``nvidia-smi --query-gpu=... --format=csv``); every
other function is pure and takes recorded values, so CPU tests feed recorded states:
:func:`diagnose` turns a state into :class:`Finding` objects, :func:`ready_for_timing` says whether
to time, :func:`format_report` renders text and :func:`to_dict` renders JSON.

State keys (None where unknown): ``gpu_available``, ``unavailable_reason``, ``device_index``,
``gpu_name``, ``uuid``, ``compute_capability``, ``sm_count``, ``l2_bytes``, ``total_memory_bytes``,
``memory_bus_width_bits``, ``max_mem_clock_mhz``, ``max_sm_clock_mhz``, ``power_limit_w``,
``default_power_limit_w``, ``driver_version``, ``torch_version``, ``torch_cuda``,
``telemetry_source`` (``"nvml"`` / ``"nvidia-smi"``), ``telemetry_error``, ``idle`` (one sample),
``load`` (a summary of the samples taken under load, see :func:`summarize_samples`),
``copy_bandwidth_bytes_per_s``, ``copy_buffer_bytes``, ``empty_kernel_us``,
``empty_kernel_launches``, ``powerd`` (``{"status", "detail"}``) and ``raw`` (raw tool output).

A sample is ``{"pstate": "P0", "mem_clock_mhz", "sm_clock_mhz", "power_w", "power_limit_w",
"temperature_c", "throttle_mask", "throttle_reasons": [names]}``.
"""

from __future__ import annotations

import csv
import io
import json
import shutil
import subprocess
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from l2lightning.probes import (
    GIB,
    MIB,
    measure_copy_load,
    measure_empty_kernel,
    pstate_number,
    round_int,
    summarize_samples,
)

SCHEMA = "l2lightning.doctor/1"
NVML_INSTALL_HINT = "`pip install nvidia-ml-py` (provides `pynvml`)"

# NVML clocks-event ("throttle") reason bits, nvmlClocksEventReason* / nvmlClocksThrottleReason*.
THROTTLE_BITS: dict[int, str] = {
    0x1: "gpu_idle",
    0x2: "applications_clocks_setting",
    0x4: "sw_power_cap",
    0x8: "hw_slowdown",
    0x10: "sync_boost",
    0x20: "sw_thermal_slowdown",
    0x40: "hw_thermal_slowdown",
    0x80: "hw_power_brake_slowdown",
    0x100: "display_clock_setting",
}
THROTTLE_LABELS: dict[str, str] = {
    "gpu_idle": "GPU Idle",
    "applications_clocks_setting": "Applications Clocks Setting",
    "sw_power_cap": "SW Power Cap",
    "hw_slowdown": "HW Slowdown",
    "sync_boost": "Sync Boost",
    "sw_thermal_slowdown": "SW Thermal Slowdown",
    "hw_thermal_slowdown": "HW Thermal Slowdown",
    "hw_power_brake_slowdown": "HW Power Brake Slowdown",
    "display_clock_setting": "Display Clock Setting",
}
# Reasons that lower clocks below what the workload asks for: timings taken under them are not comparable.
LIMITING_REASONS = (
    "sw_power_cap",
    "hw_slowdown",
    "sw_thermal_slowdown",
    "hw_thermal_slowdown",
    "hw_power_brake_slowdown",
)
# Clocks pinned by a setting: worth knowing, not a reason to refuse timing.
SETTING_REASONS = ("applications_clocks_setting", "display_clock_setting")

# nvidia-smi fallback: the query, in order. The reason field was renamed in newer drivers.
SMI_FIELDS = (
    "name",
    "uuid",
    "driver_version",
    "pstate",
    "clocks.mem",
    "clocks.sm",
    "clocks.max.mem",
    "clocks.max.sm",
    "power.draw",
    "power.limit",
    "power.default_limit",
    "temperature.gpu",
    "clocks_throttle_reasons.active",
    "memory.total",
)
SMI_REASON_FIELDS = ("clocks_throttle_reasons.active", "clocks_event_reasons.active")

POWERD_FIX = (
    "`sudo systemctl stop nvidia-powerd` (for this boot; `sudo systemctl disable nvidia-powerd` keeps it off "
    "after reboots), then run `l2lightning doctor` again"
)


# ---------------------------------------------------------------------- findings
@dataclass(frozen=True)
class Finding:
    """One conclusion of the doctor.

    Attributes:
        code: stable identifier (``"pstate-load"``, ``"throttle-load"``, ...).
        level: ``"ok"``, ``"warning"`` or ``"problem"``.
        title: one line saying what was seen.
        detail: why it matters.
        fix: what the user can run or change (the doctor never does it), or None.
        blocks_timing: True when timings taken in this state would not be trustworthy.
    """

    code: str
    level: str
    title: str
    detail: str = ""
    fix: str | None = None
    blocks_timing: bool = False

    def __post_init__(self) -> None:
        if self.level not in ("ok", "warning", "problem"):
            raise ValueError(f"`level` must be 'ok', 'warning' or 'problem', got {self.level!r}")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


# ---------------------------------------------------------------------- parsing (pure)
def decode_throttle_mask(mask: int | None) -> list[str]:
    """Reason names set in an NVML clocks-event bitmask (unknown bits as ``bit_0x...``)."""
    if mask is None:
        return []
    names = [name for bit, name in THROTTLE_BITS.items() if mask & bit]
    unknown = mask & ~sum(THROTTLE_BITS)
    if unknown:
        names.extend(f"bit_{1 << i:#x}" for i in range(64) if unknown & (1 << i))
    return names


def _smi_value(text: str) -> str | None:
    text = text.strip()
    if not text or text.strip("[]").lower() in {
        "n/a",
        "not supported",
        "unknown error",
        "insufficient permissions",
    }:
        return None
    return text


def _num(text: str | None) -> float | None:
    if text is None:
        return None
    try:
        return float(text.split()[0])
    except (ValueError, IndexError):
        return None


def parse_nvidia_smi_csv(text: str, fields: Sequence[str] = SMI_FIELDS) -> list[dict[str, str | None]]:
    """Rows of ``nvidia-smi --query-gpu=<fields> --format=csv,noheader,nounits`` as dicts (one per GPU).

    ``[N/A]`` / ``[Not Supported]`` become None.

    Raises:
        ValueError: a line has a different number of values than `fields` (the message shows it).
    """
    rows = []
    for values in csv.reader(io.StringIO(text.strip()), skipinitialspace=True):
        if not values:
            continue
        if len(values) != len(fields):
            raise ValueError(f"nvidia-smi line has {len(values)} values for {len(fields)} fields: {values!r}")
        rows.append({f: _smi_value(v) for f, v in zip(fields, values)})
    return rows


def sample_from_smi_row(row: Mapping[str, str | None]) -> dict[str, Any]:
    """One telemetry sample from a parsed nvidia-smi row."""
    reason_text = next((row[f] for f in SMI_REASON_FIELDS if row.get(f)), None)
    mask = int(reason_text, 16) if reason_text else None
    return {
        "pstate": row.get("pstate"),
        "mem_clock_mhz": round_int(_num(row.get("clocks.mem"))),
        "sm_clock_mhz": round_int(_num(row.get("clocks.sm"))),
        "power_w": _num(row.get("power.draw")),
        "power_limit_w": _num(row.get("power.limit")),
        "temperature_c": round_int(_num(row.get("temperature.gpu"))),
        "throttle_mask": mask,
        "throttle_reasons": decode_throttle_mask(mask),
    }


def static_from_smi_row(row: Mapping[str, str | None]) -> dict[str, Any]:
    """The static part of the state (name, limits, max clocks) from a parsed nvidia-smi row."""
    total_mib = _num(row.get("memory.total"))
    return {
        "gpu_name": row.get("name"),
        "uuid": row.get("uuid"),
        "driver_version": row.get("driver_version"),
        "max_mem_clock_mhz": round_int(_num(row.get("clocks.max.mem"))),
        "max_sm_clock_mhz": round_int(_num(row.get("clocks.max.sm"))),
        "power_limit_w": _num(row.get("power.limit")),
        "default_power_limit_w": _num(row.get("power.default_limit")),
        "total_memory_bytes": None if total_mib is None else int(total_mib * MIB),
    }


def state_from_nvidia_smi(
    idle_csv: str,
    load_csv: str,
    measured: Mapping[str, Any] | None = None,
    fields: Sequence[str] = SMI_FIELDS,
) -> dict[str, Any]:
    """A state dict from recorded nvidia-smi output: one idle line, one line per load sample.

    `measured` adds or overrides keys (copy bandwidth, empty-kernel cost, powerd status, SMs, L2, ...).
    """
    idle_rows = parse_nvidia_smi_csv(idle_csv, fields)
    load_rows = parse_nvidia_smi_csv(load_csv, fields)
    if not idle_rows:
        raise ValueError("no nvidia-smi line for the idle sample")
    state = empty_state()
    state.update(gpu_available=True, device_index=0, telemetry_source="nvidia-smi")
    state.update(static_from_smi_row(idle_rows[0]))
    state["idle"] = sample_from_smi_row(idle_rows[0])
    state["load"] = summarize_samples([sample_from_smi_row(r) for r in load_rows])
    state["raw"] = {"nvidia_smi_idle": idle_csv, "nvidia_smi_load": load_csv}
    state.update(measured or {})
    return state


def empty_state() -> dict[str, Any]:
    """A state with every key present and unknown."""
    return {
        "schema": SCHEMA,
        "gpu_available": False,
        "unavailable_reason": None,
        "device_index": None,
        "gpu_name": None,
        "uuid": None,
        "compute_capability": None,
        "sm_count": None,
        "l2_bytes": None,
        "total_memory_bytes": None,
        "memory_bus_width_bits": None,
        "max_mem_clock_mhz": None,
        "max_sm_clock_mhz": None,
        "power_limit_w": None,
        "default_power_limit_w": None,
        "driver_version": None,
        "torch_version": None,
        "torch_cuda": None,
        "telemetry_source": None,
        "telemetry_error": None,
        "idle": None,
        "load": None,
        "copy_bandwidth_bytes_per_s": None,
        "copy_buffer_bytes": None,
        "empty_kernel_us": None,
        "empty_kernel_launches": None,
        "powerd": None,
        "raw": {},
    }


def peak_bandwidth_bytes_per_s(state: Mapping[str, Any]) -> float | None:
    """Theoretical DRAM bandwidth: bus width / 8 x max memory clock x 2 (double data rate).

    Matches the data sheets for HBM (H200: 6144 bit x 3201 MHz -> 4.9 TB/s) and GDDR6/6X, whose
    NVML memory clock is half the per-pin data rate. None when bus width or clock is unknown.
    """
    bits, mhz = state.get("memory_bus_width_bits"), state.get("max_mem_clock_mhz")
    if not bits or not mhz:
        return None
    return bits / 8 * mhz * 1e6 * 2


def parse_powerd(returncode: int | None, stdout: str, stderr: str) -> dict[str, str]:
    """``systemctl is-active nvidia-powerd`` output -> ``{"status", "detail"}``.

    ``returncode=None`` means no ``systemctl`` on PATH. status is ``"active"``, ``"inactive"`` or
    ``"not-applicable"`` (no systemd, or systemd not running as init, as in most containers).
    """
    if returncode is None:
        return {"status": "not-applicable", "detail": "no systemd: not applicable"}
    out = stdout.strip().splitlines()[0].strip() if stdout.strip() else ""
    err = stderr.strip()
    if "not been booted with systemd" in err or "Failed to connect to bus" in err or out == "offline":
        return {"status": "not-applicable", "detail": "systemd is not running here: not applicable"}
    if out in ("active", "activating", "reloading"):
        return {"status": "active", "detail": f"nvidia-powerd is {out} (Dynamic Boost)"}
    if out:
        return {"status": "inactive", "detail": f"nvidia-powerd is {out}"}
    return {"status": "not-applicable", "detail": f"systemctl gave no answer ({err or 'no output'})"}


# ---------------------------------------------------------------------- diagnosis (pure)
def _fmt_bw(bps: float | None) -> str:
    if bps is None:
        return "unknown"
    return f"{bps / 1e12:.2f} TB/s" if bps >= 1e12 else f"{bps / 1e9:.1f} GB/s"


def _w(value: float | None) -> str:
    return "?" if value is None else f"{value:.0f} W"


def diagnose(state: Mapping[str, Any]) -> list[Finding]:
    """Findings for a state (live from :func:`collect` or recorded). Pure: no GPU access."""
    findings: list[Finding] = []
    powerd = state.get("powerd") or {"status": "not-applicable", "detail": "not checked"}
    powerd_active = powerd.get("status") == "active"

    if not state.get("gpu_available"):
        findings.append(
            Finding(
                "gpu",
                "problem",
                f"no usable CUDA GPU: {state.get('unavailable_reason') or 'unknown reason'}",
                "Nothing can be timed here. The doctor measures clocks, copy bandwidth and launch cost on a GPU.",
                "run on a machine with an NVIDIA GPU and a CUDA build of torch "
                "(see https://pytorch.org/get-started/locally/ for the `pip install torch` line)",
                blocks_timing=True,
            )
        )
    else:
        l2 = state.get("l2_bytes")
        l2_text = f"L2 {l2 / MIB:.1f} MiB" if l2 else "L2 size unknown"
        findings.append(
            Finding(
                "gpu",
                "ok",
                f"{state.get('gpu_name') or 'GPU'}: {state.get('sm_count') or '?'} SMs, {l2_text}",
            )
        )

    if state.get("telemetry_source") is None:
        findings.append(
            Finding(
                "telemetry",
                "warning" if not state.get("gpu_available") else "problem",
                "no clock/power telemetry (neither NVML nor nvidia-smi answered)",
                "Without P-state, clocks and throttle reasons the doctor cannot tell a throttled GPU from a "
                "healthy one." + (f" ({state['telemetry_error']})" if state.get("telemetry_error") else ""),
                f"{NVML_INSTALL_HINT}, or put `nvidia-smi` on PATH",
                blocks_timing=True,
            )
        )

    load = state.get("load")
    if state.get("gpu_available") and state.get("telemetry_source") is not None:
        if not load:
            findings.append(
                Finding(
                    "load",
                    "problem",
                    "no telemetry sample was taken under load",
                    "The P-state and clocks that matter are those under load; idle readings say little.",
                    "run `l2lightning doctor` again (without --no-load)",
                    blocks_timing=True,
                )
            )
        else:
            findings.extend(_load_findings(state, load, powerd_active))

    findings.extend(_power_limit_findings(state))
    findings.extend(_bandwidth_findings(state))
    findings.extend(_launch_findings(state))

    if powerd_active:
        findings.append(
            Finding(
                "powerd",
                "warning",
                "nvidia-powerd (Dynamic Boost) is active",
                "On laptops this daemon moves power between CPU and GPU and has held the GPU at P5 with an "
                "810 MHz memory clock and 'SW Power Cap' at 46 W of an 80 W limit under load, cutting copy "
                "bandwidth tenfold. If the load readings above are healthy it is harmless now.",
                POWERD_FIX,
            )
        )
    else:
        findings.append(Finding("powerd", "ok", f"nvidia-powerd: {powerd.get('detail', 'unknown')}"))
    return findings


def _load_findings(state: Mapping[str, Any], load: Mapping[str, Any], powerd_active: bool) -> list[Finding]:
    findings = []
    pstate = load.get("pstate")
    number = pstate_number(pstate)
    power, limit = load.get("power_w"), load.get("power_limit_w") or state.get("power_limit_w")
    reasons = list(load.get("throttle_reasons") or [])
    capped_below_limit = (
        "sw_power_cap" in reasons and power is not None and limit is not None and power < 0.9 * limit
    )
    trap_fix = POWERD_FIX if powerd_active or capped_below_limit else None

    if number is None:
        findings.append(
            Finding("pstate-load", "warning", f"P-state under load unknown ({pstate!r})", blocks_timing=True)
        )
    elif number <= 1:
        findings.append(Finding("pstate-load", "ok", f"P-state under load: {pstate}"))
    elif number == 2:
        findings.append(
            Finding(
                "pstate-load",
                "warning",
                f"P-state under load is {pstate}, not P0/P1",
                "GeForce cards run CUDA work at P2 with a lowered memory clock; timings are not comparable "
                "with a GPU at full clocks.",
                "time on a GPU that reaches P0 under load, or compare only runs taken in the same P-state",
                blocks_timing=True,
            )
        )
    else:
        findings.append(
            Finding(
                "pstate-load",
                "problem",
                f"P-state under load is {pstate}: the GPU stays in a low-power state while busy",
                "A memory-saturating copy loop should drive the GPU to P0. A low P-state under load means a "
                "power manager holds it down (on laptops: nvidia-powerd / Dynamic Boost).",
                trap_fix or "find what limits the GPU (power management daemon, power limit, thermals)",
                blocks_timing=True,
            )
        )

    mem, max_mem = load.get("mem_clock_mhz"), state.get("max_mem_clock_mhz")
    if mem is not None and max_mem:
        if mem < 0.9 * max_mem:
            findings.append(
                Finding(
                    "mem-clock-load",
                    "problem",
                    f"memory clock under load is {mem} MHz, {mem / max_mem:.0%} of its {max_mem} MHz maximum",
                    "Memory bandwidth scales with the memory clock, so every bandwidth-bound kernel slows by "
                    "the same factor.",
                    trap_fix or "find what limits the GPU (P-state, power cap, thermals) before timing",
                    blocks_timing=True,
                )
            )
        else:
            findings.append(
                Finding("mem-clock-load", "ok", f"memory clock under load: {mem} of {max_mem} MHz")
            )

    limiting = [r for r in reasons if r in LIMITING_REASONS]
    for reason in limiting:
        label = THROTTLE_LABELS.get(reason, reason)
        if reason == "sw_power_cap" and capped_below_limit:
            findings.append(
                Finding(
                    "throttle-load",
                    "problem",
                    f"'{label}' throttle active at {_w(power)} (power limit {_w(limit)})",
                    "The driver caps power well below the board's limit. On laptops nvidia-powerd (Dynamic "
                    "Boost) does this (seen: P5, 810 MHz memory clock, 46 W of 80 W, copy bandwidth cut "
                    "tenfold).",
                    POWERD_FIX,
                    blocks_timing=True,
                )
            )
        elif reason == "sw_power_cap":
            findings.append(
                Finding(
                    "throttle-load",
                    "problem",
                    f"'{label}' throttle active: the GPU runs at its {_w(limit)} power limit under load",
                    "Clocks drop to stay within the power limit, so timings depend on power draw.",
                    "check the power limit (`nvidia-smi -q -d POWER`) and cooling; the doctor changes nothing",
                    blocks_timing=True,
                )
            )
        elif "thermal" in reason:
            findings.append(
                Finding(
                    "throttle-load",
                    "problem",
                    f"'{label}' throttle active under load (max {load.get('temperature_c')} C)",
                    "The GPU is slowed to cool down; timings drift as it heats.",
                    "improve cooling or let the GPU cool, then run `l2lightning doctor` again",
                    blocks_timing=True,
                )
            )
        else:
            findings.append(
                Finding(
                    "throttle-load",
                    "problem",
                    f"'{label}' throttle active under load",
                    "Hardware slows the clocks (power brake, external power or thermal signal).",
                    "check power supply and cooling; `nvidia-smi -q -d PERFORMANCE` shows the details",
                    blocks_timing=True,
                )
            )
    for reason in reasons:
        if reason in SETTING_REASONS:
            findings.append(
                Finding(
                    "clock-setting",
                    "warning",
                    f"'{THROTTLE_LABELS.get(reason, reason)}' limits clocks under load",
                    "Clocks are pinned by an administrator setting; results hold for these clocks only.",
                    "`nvidia-smi -q -d CLOCK` shows the applied clocks; `sudo nvidia-smi -rac` resets application clocks",
                )
            )
    if not limiting:
        findings.append(Finding("throttle-load", "ok", "no clock-limiting throttle reason under load"))
    temp = load.get("temperature_c")
    if temp is not None and temp >= 85:
        findings.append(
            Finding(
                "temperature",
                "warning",
                f"GPU reached {temp} C under a short load",
                "Longer runs may throttle.",
            )
        )
    return findings


def _power_limit_findings(state: Mapping[str, Any]) -> list[Finding]:
    limit, default = state.get("power_limit_w"), state.get("default_power_limit_w")
    if limit is None or default is None or limit >= 0.95 * default:
        return []
    return [
        Finding(
            "power-limit",
            "warning",
            f"power limit {_w(limit)} is below the default {_w(default)}",
            "A lowered limit caps clocks under heavy load.",
            f"`sudo nvidia-smi -pl {default:.0f}` restores the default (the doctor changes nothing)",
        )
    ]


def _bandwidth_findings(state: Mapping[str, Any]) -> list[Finding]:
    bw = state.get("copy_bandwidth_bytes_per_s")
    if bw is None:
        return []
    peak = peak_bandwidth_bytes_per_s(state)
    if peak is None:
        return [
            Finding("copy-bandwidth", "ok", f"copy bandwidth {_fmt_bw(bw)} (read + written; peak unknown)")
        ]
    fraction = bw / peak
    title = f"copy bandwidth {_fmt_bw(bw)} (read + written), {fraction:.0%} of the {_fmt_bw(peak)} peak"
    if fraction < 0.4:
        return [
            Finding(
                "copy-bandwidth",
                "problem",
                title,
                "A large device-to-device copy normally reaches 70-90% of peak. This low a value means the "
                "memory clock is held down (see the P-state and throttle findings).",
                "fix the clock/power findings above, then run `l2lightning doctor` again",
                blocks_timing=True,
            )
        ]
    if fraction < 0.6:
        return [
            Finding(
                "copy-bandwidth",
                "warning",
                title,
                "Lower than the usual 70-90% of peak: another process may share the GPU.",
                "check `nvidia-smi` for other processes",
            )
        ]
    return [Finding("copy-bandwidth", "ok", title)]


def _launch_findings(state: Mapping[str, Any]) -> list[Finding]:
    us = state.get("empty_kernel_us")
    if us is None:
        return []
    title = f"empty kernel in a CUDA graph: {us:.2f} us per launch"
    if us > 2.5:
        return [
            Finding(
                "empty-kernel",
                "warning",
                title,
                "Data-center GPUs replay an empty kernel in about 1 us (H200: 0.87 us). A high value raises "
                "the launch floor of every captured step.",
                "check for other processes on the GPU or MPS/MIG time slicing",
            )
        ]
    return [Finding("empty-kernel", "ok", title)]


def ready_for_timing(
    state: Mapping[str, Any], findings: Sequence[Finding] | None = None
) -> tuple[bool, list[str]]:
    """(True, []) when timings taken now are trustworthy, else (False, reasons).

    Not ready when: no GPU, no telemetry, no sample under load, a P-state other than P0/P1 under
    load, a memory clock below 90% of its maximum under load, a clock-limiting throttle reason
    under load, or a copy bandwidth below 40% of peak.
    """
    if findings is None:
        findings = diagnose(state)
    reasons = [f.title for f in findings if f.blocks_timing]
    return (not reasons, reasons)


# ---------------------------------------------------------------------- rendering (pure)
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
        f"  copy bandwidth  {_fmt_bw(bw)}"
        + (f" (read + written, {buf / GIB:.2f} GiB buffers)" if bw is not None and buf else "")
        + (f", {bw / peak:.0%} of {_fmt_bw(peak)} peak" if bw is not None and peak else "")
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


# ---------------------------------------------------------------------- live collection (GPU)
def check_powerd(run: Callable[..., Any] = subprocess.run) -> dict[str, str]:
    """Ask systemd whether nvidia-powerd is active (reads only)."""
    if shutil.which("systemctl") is None:
        return parse_powerd(None, "", "")
    try:
        proc = run(["systemctl", "is-active", "nvidia-powerd"], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError) as exc:
        return {"status": "not-applicable", "detail": f"systemctl failed ({exc})"}
    return parse_powerd(proc.returncode, proc.stdout, proc.stderr)


class TelemetryReader:
    """Reads one GPU's static values and samples. Subclasses: NVML and nvidia-smi."""

    source = "none"

    def static(self) -> dict[str, Any]:
        raise NotImplementedError

    def sample(self) -> dict[str, Any]:
        raise NotImplementedError

    def close(self) -> None:
        pass


class NvmlReader(TelemetryReader):
    """Telemetry through NVML (``pynvml`` from nvidia-ml-py)."""

    source = "nvml"

    def __init__(self, device_index: int, uuid: str | None) -> None:
        import pynvml

        self.nvml = pynvml
        pynvml.nvmlInit()
        handle = None
        if uuid:
            for candidate in (uuid, f"GPU-{uuid}"):
                try:
                    handle = pynvml.nvmlDeviceGetHandleByUUID(candidate)
                    break
                except pynvml.NVMLError:
                    continue
        if handle is None:
            handle = pynvml.nvmlDeviceGetHandleByIndex(_physical_index(device_index))
        self.handle = handle
        self._reasons = (
            getattr(pynvml, "nvmlDeviceGetCurrentClocksEventReasons", None)
            or pynvml.nvmlDeviceGetCurrentClocksThrottleReasons
        )

    def _try(self, fn: Callable[..., Any], *args: Any) -> Any:
        try:
            value = fn(self.handle, *args)
        except Exception:  # NVMLError_NotSupported and friends: the value is unknown, not fatal
            return None
        return value.decode() if isinstance(value, bytes) else value

    def static(self) -> dict[str, Any]:
        n = self.nvml
        limit = self._try(n.nvmlDeviceGetEnforcedPowerLimit)
        default = self._try(n.nvmlDeviceGetPowerManagementDefaultLimit)
        driver = n.nvmlSystemGetDriverVersion()
        bus = getattr(n, "nvmlDeviceGetMemoryBusWidth", None)
        return {
            "gpu_name": self._try(n.nvmlDeviceGetName),
            "uuid": self._try(n.nvmlDeviceGetUUID),
            "driver_version": driver.decode() if isinstance(driver, bytes) else driver,
            "max_mem_clock_mhz": self._try(n.nvmlDeviceGetMaxClockInfo, n.NVML_CLOCK_MEM),
            "max_sm_clock_mhz": self._try(n.nvmlDeviceGetMaxClockInfo, n.NVML_CLOCK_SM),
            "power_limit_w": None if limit is None else limit / 1000,
            "default_power_limit_w": None if default is None else default / 1000,
            "memory_bus_width_bits": self._try(bus) if bus else None,
        }

    def sample(self) -> dict[str, Any]:
        n = self.nvml
        pstate = self._try(n.nvmlDeviceGetPerformanceState)
        power = self._try(n.nvmlDeviceGetPowerUsage)
        limit = self._try(n.nvmlDeviceGetEnforcedPowerLimit)
        mask = self._try(self._reasons)
        return {
            "pstate": None if pstate is None else f"P{int(pstate)}",
            "mem_clock_mhz": self._try(n.nvmlDeviceGetClockInfo, n.NVML_CLOCK_MEM),
            "sm_clock_mhz": self._try(n.nvmlDeviceGetClockInfo, n.NVML_CLOCK_SM),
            "power_w": None if power is None else power / 1000,
            "power_limit_w": None if limit is None else limit / 1000,
            "temperature_c": self._try(n.nvmlDeviceGetTemperature, n.NVML_TEMPERATURE_GPU),
            "throttle_mask": None if mask is None else int(mask),
            "throttle_reasons": decode_throttle_mask(None if mask is None else int(mask)),
        }

    def close(self) -> None:
        try:
            self.nvml.nvmlShutdown()
        except Exception:
            pass


class SmiReader(TelemetryReader):
    """Telemetry parsed from ``nvidia-smi --query-gpu=... --format=csv,noheader,nounits``."""

    source = "nvidia-smi"

    def __init__(self, device_index: int, uuid: str | None) -> None:
        self.exe = shutil.which("nvidia-smi")
        if self.exe is None:
            raise FileNotFoundError("nvidia-smi is not on PATH")
        targets = [str(_physical_index(device_index))]
        if uuid:
            targets.insert(0, uuid if uuid.startswith("GPU-") else f"GPU-{uuid}")
        self.fields: tuple[str, ...] = SMI_FIELDS
        self.raw: list[str] = []
        last_error = ""
        # The UUID names the same GPU torch uses whatever CUDA_VISIBLE_DEVICES says; the index is
        # the fallback. The reason field was renamed in newer drivers: try both spellings.
        for target in targets:
            self.target = target
            for reason_field in SMI_REASON_FIELDS:
                fields = tuple(reason_field if f in SMI_REASON_FIELDS else f for f in SMI_FIELDS)
                ok, text = self._query(fields)
                if ok:
                    self.fields = fields
                    return
                last_error = text
        raise RuntimeError(f"nvidia-smi query failed: {last_error.strip()[:300]}")

    def _query(self, fields: Sequence[str]) -> tuple[bool, str]:
        proc = subprocess.run(
            [
                self.exe,
                f"--id={self.target}",
                f"--query-gpu={','.join(fields)}",
                "--format=csv,noheader,nounits",
            ],
            capture_output=True,
            text=True,
            timeout=20,
        )
        return proc.returncode == 0, proc.stdout if proc.returncode == 0 else proc.stdout + proc.stderr

    def _row(self) -> dict[str, str | None]:
        ok, text = self._query(self.fields)
        if not ok:
            raise RuntimeError(f"nvidia-smi query failed: {text.strip()[:300]}")
        self.raw.append(text.strip())
        rows = parse_nvidia_smi_csv(text, self.fields)
        if not rows:
            raise RuntimeError("nvidia-smi printed no GPU line")
        return rows[0]

    def static(self) -> dict[str, Any]:
        return static_from_smi_row(self._row())

    def sample(self) -> dict[str, Any]:
        return sample_from_smi_row(self._row())


def _physical_index(device_index: int) -> int:
    """The NVML/nvidia-smi index of torch's `device_index` under a numeric CUDA_VISIBLE_DEVICES."""
    import os

    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "").strip()
    if visible:
        parts = [p.strip() for p in visible.split(",") if p.strip()]
        if device_index < len(parts) and parts[device_index].isdigit():
            return int(parts[device_index])
    return device_index


def open_telemetry(device_index: int, uuid: str | None) -> tuple[TelemetryReader | None, str | None]:
    """An NVML reader, else an nvidia-smi reader, else (None, why neither works)."""
    errors = []
    try:
        return NvmlReader(device_index, uuid), None
    except ImportError:
        errors.append(f"pynvml not installed ({NVML_INSTALL_HINT})")
    except Exception as exc:
        errors.append(f"NVML failed: {type(exc).__name__}: {exc}")
    try:
        reader = SmiReader(device_index, uuid)
        return reader, "; ".join(errors) + "; fell back to nvidia-smi" if errors else None
    except Exception as exc:
        errors.append(f"nvidia-smi: {exc}")
    return None, "; ".join(errors)


def collect(
    device_index: int = 0,
    *,
    load_seconds: float = 0.6,
    buffer_bytes: int = GIB,
    graph_launches: int = 1000,
    load: bool = True,
) -> dict[str, Any]:
    """Gather the live state of GPU `device_index` (reads only; changes no setting).

    Without a GPU the state says why (``gpu_available=False``, ``unavailable_reason``) and still
    holds whatever telemetry and systemd could tell.
    """
    import torch

    from l2lightning._env import cuda_unavailable_reason

    state = empty_state()
    state["torch_version"] = torch.__version__
    state["torch_cuda"] = torch.version.cuda
    state["powerd"] = check_powerd()
    reason = cuda_unavailable_reason()
    uuid = None
    if reason is None:
        if device_index >= torch.cuda.device_count():
            reason = f"device {device_index} does not exist ({torch.cuda.device_count()} visible)"
    if reason is not None:
        state["unavailable_reason"] = reason
        if shutil.which("nvidia-smi") is None:
            state["telemetry_error"] = "no GPU for NVML to read and no nvidia-smi on PATH"
            return state
    else:
        props = torch.cuda.get_device_properties(device_index)
        uuid_obj = getattr(props, "uuid", None)
        uuid = str(uuid_obj) if uuid_obj is not None else None
        state.update(
            gpu_available=True,
            device_index=device_index,
            gpu_name=props.name,
            compute_capability=f"{props.major}.{props.minor}",
            sm_count=props.multi_processor_count,
            l2_bytes=getattr(props, "L2_cache_size", None),
            total_memory_bytes=props.total_memory,
            memory_bus_width_bits=getattr(props, "memory_bus_width", None),
        )
    reader, error = open_telemetry(device_index, uuid)
    state["telemetry_error"] = error
    try:
        if reader is not None:
            state["telemetry_source"] = reader.source
            static = reader.static()
            for key, value in static.items():  # torch's values (name, memory) win; telemetry fills the rest
                if value is not None and state.get(key) is None:
                    state[key] = value
            if state.get("uuid") is None and uuid:
                state["uuid"] = uuid
            state["idle"] = reader.sample()
        if state["gpu_available"]:
            if load:
                measured = measure_copy_load(device_index, buffer_bytes, load_seconds, reader)
                state["copy_bandwidth_bytes_per_s"] = measured["copy_bandwidth_bytes_per_s"]
                state["copy_buffer_bytes"] = measured["copy_buffer_bytes"]
                state["load"] = measured["load"]
                state["raw"]["load_samples"] = measured["load_samples"]
                if measured["load_errors"]:
                    state["raw"]["load_errors"] = measured["load_errors"]
            state["empty_kernel_us"] = measure_empty_kernel(device_index, graph_launches)
            state["empty_kernel_launches"] = graph_launches
        if isinstance(reader, SmiReader):
            state["raw"]["nvidia_smi_fields"] = list(reader.fields)
            state["raw"]["nvidia_smi_lines"] = reader.raw
    finally:
        if reader is not None:
            reader.close()
    return state
