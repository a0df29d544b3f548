"""The doctor's conclusions: findings about a GPU state, and whether timings taken in it can be trusted.

A state is only numbers; what a user needs is "this GPU is held at P5 by nvidia-powerd, run
``sudo systemctl stop nvidia-powerd``", and a benchmark needs a yes or no before it times. Both come
from :func:`diagnose` and :func:`ready_for_timing`, pure functions of a state (live or recorded).
The thresholds cite what was measured: a laptop held at P5 by nvidia-powerd (the trap the doctor
was written for, see :mod:`l2lightning.tools.doctor`), the H200's copy bandwidth and empty-kernel
cost.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from l2lightning.probes import MIB, pstate_number
from l2lightning.tools.gpu_telemetry import NVML_INSTALL_HINT, THROTTLE_LABELS

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

POWERD_FIX = (
    "`sudo systemctl stop nvidia-powerd` (for this boot; `sudo systemctl disable nvidia-powerd` keeps it off "
    "after reboots), then run `l2lightning doctor` again"
)


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


def peak_bandwidth_bytes_per_s(state: Mapping[str, Any]) -> float | None:
    """Theoretical DRAM bandwidth: bus width / 8 x max memory clock x 2 (double data rate).

    Matches the data sheets for HBM (H200: 6144 bit x 3201 MHz -> 4.9 TB/s) and GDDR6/6X, whose
    NVML memory clock is half the per-pin data rate. None when bus width or clock is unknown.
    """
    bits, mhz = state.get("memory_bus_width_bits"), state.get("max_mem_clock_mhz")
    if not bits or not mhz:
        return None
    return bits / 8 * mhz * 1e6 * 2


def format_bandwidth(bps: float | None) -> str:
    """``"4.12 TB/s"`` or ``"384.0 GB/s"``; ``"unknown"`` for None."""
    if bps is None:
        return "unknown"
    return f"{bps / 1e12:.2f} TB/s" if bps >= 1e12 else f"{bps / 1e9:.1f} GB/s"


def _w(value: float | None) -> str:
    return "?" if value is None else f"{value:.0f} W"


def diagnose(state: Mapping[str, Any]) -> list[Finding]:
    """Findings for a state (live from :func:`l2lightning.tools.doctor.collect` or recorded). Pure: no GPU access."""
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
            Finding(
                "copy-bandwidth",
                "ok",
                f"copy bandwidth {format_bandwidth(bw)} (read + written; peak unknown)",
            )
        ]
    fraction = bw / peak
    title = f"copy bandwidth {format_bandwidth(bw)} (read + written), {fraction:.0%} of the {format_bandwidth(peak)} peak"
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
