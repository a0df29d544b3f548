"""The doctor's state: one dict holding everything read or measured about a GPU, live or recorded.

Every conclusion the doctor draws (:mod:`l2lightning.tools.doctor_findings`) and every rendering
(:mod:`l2lightning.tools.doctor_report`) takes this dict, never the GPU, so that a state recorded
on one machine (``l2lightning doctor --json``, or nvidia-smi output) can be diagnosed on another and
in CPU tests. :func:`l2lightning.tools.doctor.collect` fills it from the live GPU.

State keys (None where unknown): ``gpu_available``, ``unavailable_reason``, ``device_index``,
``gpu_name``, ``uuid``, ``compute_capability``, ``sm_count``, ``l2_bytes``, ``total_memory_bytes``,
``memory_bus_width_bits``, ``max_mem_clock_mhz``, ``max_sm_clock_mhz``, ``power_limit_w``,
``default_power_limit_w``, ``driver_version``, ``torch_version``, ``torch_cuda``,
``telemetry_source`` (``"nvml"`` / ``"nvidia-smi"``), ``telemetry_error``, ``idle`` (one sample),
``load`` (a summary of the samples taken under load, see :func:`l2lightning.probes.summarize_samples`),
``copy_bandwidth_bytes_per_s``, ``copy_buffer_bytes``, ``empty_kernel_us``,
``empty_kernel_launches``, ``powerd`` (``{"status", "detail"}``) and ``raw`` (raw tool output).
Samples are described in :mod:`l2lightning.tools.gpu_telemetry`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from l2lightning.probes import summarize_samples
from l2lightning.tools.gpu_telemetry import (
    SMI_FIELDS,
    parse_nvidia_smi_csv,
    sample_from_smi_row,
    static_from_smi_row,
)

SCHEMA = "l2lightning.doctor/1"


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
