"""GPU telemetry: P-state, clocks, power and clock-throttle reasons, read through NVML or nvidia-smi.

Whether a timing means anything depends on what the GPU was doing while it was taken (nvidia-powerd
held a laptop's memory clock at 810 of 7001 MHz under load). The doctor reads that state here, for
itself and for the benchmarks it checks before they time, through one reader: NVML via ``pynvml``
(from nvidia-ml-py) where it is installed, else ``nvidia-smi --query-gpu=... --format=csv``. The
parsing functions are pure, so CPU tests feed them recorded output.

A sample is ``{"pstate": "P0", "mem_clock_mhz", "sm_clock_mhz", "power_w", "power_limit_w",
"temperature_c", "throttle_mask", "throttle_reasons": [names]}``; the static values (name, limits,
maximum clocks) are what :meth:`TelemetryReader.static` returns.
"""

from __future__ import annotations

import csv
import io
import os
import shutil
import subprocess
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from l2lightning.probes import MIB, round_int

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


def read_sample(device_index: int = 0) -> dict[str, Any]:
    """One telemetry sample of GPU `device_index` now, without load: what a benchmark records after timing.

    Returns ``{"telemetry_source", "telemetry_error", "sample"}``; ``sample`` is None when neither
    NVML nor nvidia-smi answers (``telemetry_error`` says why).

    Raises:
        ValueError: `device_index` < 0.
    """
    if device_index < 0:
        raise ValueError(f"`device_index` must be >= 0, got {device_index}")
    reader, error = open_telemetry(device_index, None)
    if reader is None:
        return {"telemetry_source": None, "telemetry_error": error, "sample": None}
    try:
        return {"telemetry_source": reader.source, "telemetry_error": error, "sample": reader.sample()}
    except Exception as exc:  # a failed read is a recorded unknown, not a failed benchmark
        return {
            "telemetry_source": reader.source,
            "telemetry_error": f"{type(exc).__name__}: {exc}",
            "sample": None,
        }
    finally:
        reader.close()
