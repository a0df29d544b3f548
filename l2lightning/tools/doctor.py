"""GPU state doctor: is this GPU in a state where timings mean anything?

`l2lightning doctor` (or `python -m l2lightning doctor`) reads and prints the GPU's name, SMs and L2
size; its P-state, memory clock, power draw and active clock-throttle reasons at idle and *under
load* (sampled from a thread while a memory-saturating device-to-device copy loop runs); the
measured copy bandwidth (bytes read + written over time, >= 1 GiB buffers, CUDA events); the cost
of one empty kernel inside a CUDA graph; and, where systemd runs, whether `nvidia-powerd`
(Dynamic Boost) is active.

The trap it was written for: on a laptop, nvidia-powerd held the GPU at P5 with its memory clock
at 810 MHz under load and the "SW Power Cap" throttle set at 46 W of an 80 W limit, which cut copy
bandwidth tenfold. Every benchmark run in that state measures the daemon, not the code. So the
benchmark harness and the benchmark scripts (bench_callback.py, bench_prefetch_forward.py,
bench_autotune.py) call :func:`check_before_timing` before they time anything, and store its
verdict with their results.

The doctor only reads. It never changes clocks, power limits or daemons; each finding says what
the user can run (e.g. ``sudo systemctl stop nvidia-powerd`` for this boot).

Structure: :func:`collect` gathers a *state* dict (:mod:`l2lightning.tools.doctor_state`) from the
live GPU, its telemetry read by :mod:`l2lightning.tools.gpu_telemetry` (NVML through ``pynvml``
from nvidia-ml-py, or ``nvidia-smi --query-gpu=... --format=csv``); everything else is pure and
takes recorded values, so CPU tests feed recorded states: :func:`diagnose` turns a state into
:class:`Finding` objects and :func:`ready_for_timing` says whether to time
(:mod:`l2lightning.tools.doctor_findings`), :func:`format_report` renders text and :func:`to_dict`
JSON (:mod:`l2lightning.tools.doctor_report`). Their names are importable from here as well.
"""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from l2lightning.probes import (
    GIB,
    measure_copy_load,
    measure_empty_kernel,
    pstate_number,
    summarize_samples,
)
from l2lightning.tools.doctor_findings import (
    LIMITING_REASONS,
    POWERD_FIX,
    SETTING_REASONS,
    Finding,
    diagnose,
    peak_bandwidth_bytes_per_s,
    ready_for_timing,
)
from l2lightning.tools.doctor_report import format_report, summary_line, to_dict, write_json
from l2lightning.tools.doctor_state import SCHEMA, empty_state, state_from_nvidia_smi
from l2lightning.tools.gpu_telemetry import (
    NVML_INSTALL_HINT,
    SMI_FIELDS,
    SMI_REASON_FIELDS,
    THROTTLE_BITS,
    THROTTLE_LABELS,
    NvmlReader,
    SmiReader,
    TelemetryReader,
    decode_throttle_mask,
    open_telemetry,
    parse_nvidia_smi_csv,
    read_sample,
    sample_from_smi_row,
    static_from_smi_row,
)

__all__ = [
    "FORCE_HELP",
    "LIMITING_REASONS",
    "NVML_INSTALL_HINT",
    "POWERD_FIX",
    "SCHEMA",
    "SETTING_REASONS",
    "SMI_FIELDS",
    "SMI_REASON_FIELDS",
    "THROTTLE_BITS",
    "THROTTLE_LABELS",
    "Finding",
    "NvmlReader",
    "SmiReader",
    "TelemetryReader",
    "TimingCheck",
    "check_before_timing",
    "check_powerd",
    "collect",
    "decode_throttle_mask",
    "diagnose",
    "empty_state",
    "format_report",
    "open_telemetry",
    "parse_nvidia_smi_csv",
    "parse_powerd",
    "peak_bandwidth_bytes_per_s",
    "pstate_number",
    "read_sample",
    "ready_for_timing",
    "sample_from_smi_row",
    "state_from_nvidia_smi",
    "static_from_smi_row",
    "summarize_samples",
    "summary_line",
    "to_dict",
    "write_json",
]


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


def check_powerd(run: Callable[..., Any] = subprocess.run) -> dict[str, str]:
    """Ask systemd whether nvidia-powerd is active (reads only)."""
    if shutil.which("systemctl") is None:
        return parse_powerd(None, "", "")
    try:
        proc = run(["systemctl", "is-active", "nvidia-powerd"], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError) as exc:
        return {"status": "not-applicable", "detail": f"systemctl failed ({exc})"}
    return parse_powerd(proc.returncode, proc.stdout, proc.stderr)


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


# The --force option of the harness and of every benchmark script: one wording for one behaviour.
FORCE_HELP = "time even when the doctor says the GPU is not ready (results marked forced)"


@dataclass(frozen=True)
class TimingCheck:
    """The doctor's verdict taken before a benchmark times anything.

    Attributes:
        state: the state :func:`collect` read.
        findings: :func:`diagnose` of it.
        ready: whether timings taken now are trustworthy (:func:`ready_for_timing`).
        reasons: why not, one line each (empty when ready).
        refused: True when nothing may be timed: no usable GPU, or not ready and not forced.
    """

    state: dict[str, Any]
    findings: list[Finding]
    ready: bool
    reasons: list[str]
    refused: bool

    @property
    def forced(self) -> bool:
        """Timing goes on although the GPU is not ready (``--force``): results must say so."""
        return not self.ready and not self.refused

    def to_dict(self) -> dict[str, Any]:
        """The JSON document a benchmark stores with its results (:func:`to_dict` of the state)."""
        return to_dict(self.state, self.findings)


def check_before_timing(
    device_index: int = 0,
    *,
    force: bool = False,
    load_seconds: float = 0.6,
    program: str = "l2lightning bench",
    log: Callable[[str], None] = print,
) -> TimingCheck:
    """Collect and diagnose the state of GPU `device_index`, and say whether a benchmark may time now.

    Refused (``TimingCheck.refused``) without a usable GPU, or when the GPU is not ready for timing
    and `force` is False: the doctor's report is logged, then why, in a line starting with `program`.
    Otherwise the state is logged in one line (:func:`summary_line`); with `force` a GPU that is not
    ready is timed anyway, and the reasons are logged too.

    Raises:
        ValueError: `device_index` < 0 or `load_seconds` <= 0.
    """
    if device_index < 0:
        raise ValueError(f"`device_index` must be >= 0, got {device_index}")
    if load_seconds <= 0:
        raise ValueError(f"`load_seconds` must be > 0, got {load_seconds}")
    state = collect(device_index, load_seconds=load_seconds)
    findings = diagnose(state)
    ready, reasons = ready_for_timing(state, findings)
    refused = not state.get("gpu_available") or (not ready and not force)
    if not state.get("gpu_available"):
        log(format_report(state, findings))
        log(f"{program}: no usable CUDA GPU; nothing can be timed (see the doctor's report above)")
    elif refused:
        log(format_report(state, findings))
        log(
            f"{program}: the GPU is not ready for timing (reasons above); fix them, or pass --force to time "
            "anyway (results are then marked forced: true)"
        )
    elif not ready:
        log(f"{program}: GPU state: {summary_line(state)}")
        log(f"{program}: GPU not ready for timing, continuing because of --force: " + "; ".join(reasons))
    else:
        log(f"{program}: GPU ready for timing: {summary_line(state)}")
    return TimingCheck(state, findings, ready, reasons, refused)
