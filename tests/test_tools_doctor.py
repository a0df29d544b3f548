"""CPU tests of the GPU doctor: parsing recorded nvidia-smi / NVML values, findings, readiness, rendering."""

from __future__ import annotations

import json
import os
import stat
import sys
import types
from pathlib import Path

import pytest

from l2lightning.tools import doctor
from tests.benchmark_scripts import load_benchmark

FIXTURES = Path(__file__).parent / "fixtures"


def _read(name: str) -> str:
    return (FIXTURES / name).read_text()


def laptop_state() -> dict:
    return doctor.state_from_nvidia_smi(
        _read("nvidia_smi_laptop_powerd_idle.csv"),
        _read("nvidia_smi_laptop_powerd_load.csv"),
        json.loads(_read("laptop_powerd_measured.json")),
    )


def h200_state() -> dict:
    return doctor.state_from_nvidia_smi(
        _read("nvidia_smi_h200_idle.csv"),
        _read("nvidia_smi_h200_load.csv"),
        json.loads(_read("h200_measured.json")),
    )


def by_code(findings, code):
    return [f for f in findings if f.code == code]


# ---------------------------------------------------------------------- parsing
def test_parse_nvidia_smi_csv_fields_and_missing_values():
    rows = doctor.parse_nvidia_smi_csv(_read("nvidia_smi_laptop_powerd_load.csv"))
    assert len(rows) == 5
    row = rows[0]
    assert row["name"] == "NVIDIA GeForce RTX 3070 Laptop GPU"
    assert row["pstate"] == "P5"
    assert row["clocks.mem"] == "810"
    text = "NVIDIA H200, [N/A], 1.0, P0, 3201, 1980, [Not Supported], 1980, 100.5, 700.00, 700.00, 30, 0x0, 143771\n"
    row = doctor.parse_nvidia_smi_csv(text)[0]
    assert row["uuid"] is None and row["clocks.max.mem"] is None
    sample = doctor.sample_from_smi_row(row)
    assert sample["throttle_reasons"] == [] and sample["power_w"] == 100.5


def test_parse_nvidia_smi_csv_rejects_wrong_field_count():
    with pytest.raises(ValueError, match="3 values for 14 fields"):
        doctor.parse_nvidia_smi_csv("a, b, c\n")


def test_decode_throttle_mask():
    assert doctor.decode_throttle_mask(0x4) == ["sw_power_cap"]
    assert doctor.decode_throttle_mask(0x5) == ["gpu_idle", "sw_power_cap"]
    assert doctor.decode_throttle_mask(0) == []
    assert doctor.decode_throttle_mask(None) == []
    assert doctor.decode_throttle_mask(0x1000) == ["bit_0x1000"]


def test_sample_from_smi_row_laptop_load():
    row = doctor.parse_nvidia_smi_csv(_read("nvidia_smi_laptop_powerd_load.csv"))[1]
    sample = doctor.sample_from_smi_row(row)
    assert sample == {
        "pstate": "P5",
        "mem_clock_mhz": 810,
        "sm_clock_mhz": 1275,
        "power_w": 46.02,
        "power_limit_w": 80.0,
        "temperature_c": 59,
        "throttle_mask": 4,
        "throttle_reasons": ["sw_power_cap"],
    }


def test_pstate_number():
    assert doctor.pstate_number("P0") == 0
    assert doctor.pstate_number("P5") == 5
    assert doctor.pstate_number("P32") is None
    assert doctor.pstate_number(None) is None
    assert doctor.pstate_number("x") is None


def test_summarize_samples_mode_median_and_half_rule():
    samples = json.loads(_read("nvml_laptop_powerd_samples.json"))
    load = doctor.summarize_samples(samples)
    assert load["samples"] == 7
    assert load["pstate"] == "P5"  # the first sample (still ramping, P8) does not decide
    assert load["pstates_seen"] == ["P5", "P8"]
    assert load["mem_clock_mhz"] == 810
    assert load["mem_clock_min_mhz"] == 405
    assert load["throttle_reasons"] == ["sw_power_cap"]
    assert "gpu_idle" not in load["throttle_reasons_seen"]
    assert doctor.summarize_samples([]) is None


def test_summarize_samples_tie_goes_to_slower_pstate():
    samples = [{"pstate": "P0"}, {"pstate": "P2"}]
    assert doctor.summarize_samples(samples)["pstate"] == "P2"


def test_peak_bandwidth():
    assert doctor.peak_bandwidth_bytes_per_s(h200_state()) == pytest.approx(6144 / 8 * 3201e6 * 2)
    assert (
        doctor.peak_bandwidth_bytes_per_s({"memory_bus_width_bits": None, "max_mem_clock_mhz": 3201}) is None
    )


@pytest.mark.parametrize(
    ("rc", "out", "err", "status"),
    [
        (None, "", "", "not-applicable"),
        (0, "active\n", "", "active"),
        (3, "inactive\n", "", "inactive"),
        (3, "failed\n", "", "inactive"),
        (
            1,
            "",
            "System has not been booted with systemd as init system (PID 1). Can't operate.\nFailed to connect to bus: Host is down",
            "not-applicable",
        ),
        (1, "offline\n", "", "not-applicable"),
    ],
)
def test_parse_powerd(rc, out, err, status):
    assert doctor.parse_powerd(rc, out, err)["status"] == status


def test_parse_powerd_without_systemctl_says_not_applicable():
    assert doctor.parse_powerd(None, "", "")["detail"] == "no systemd: not applicable"


def test_check_powerd_without_systemctl(monkeypatch):
    monkeypatch.setattr(doctor.shutil, "which", lambda name: None)
    assert doctor.check_powerd()["detail"] == "no systemd: not applicable"


# ---------------------------------------------------------------------- diagnosis
def test_laptop_powerd_trap_is_a_problem_with_the_fix():
    state = laptop_state()
    assert state["load"]["pstate"] == "P5"
    assert state["load"]["mem_clock_mhz"] == 810
    findings = doctor.diagnose(state)
    throttle = by_code(findings, "throttle-load")
    assert len(throttle) == 1 and throttle[0].level == "problem"
    assert "SW Power Cap" in throttle[0].title and "46 W" in throttle[0].title and "80 W" in throttle[0].title
    assert "sudo systemctl stop nvidia-powerd" in throttle[0].fix
    pstate = by_code(findings, "pstate-load")[0]
    assert pstate.level == "problem" and "P5" in pstate.title
    assert "sudo systemctl stop nvidia-powerd" in pstate.fix
    mem = by_code(findings, "mem-clock-load")[0]
    assert mem.level == "problem" and "810 MHz" in mem.title
    bw = by_code(findings, "copy-bandwidth")[0]
    assert bw.level == "problem"
    powerd = by_code(findings, "powerd")[0]
    assert powerd.level == "warning" and "sudo systemctl stop nvidia-powerd" in powerd.fix

    ready, reasons = doctor.ready_for_timing(state)
    assert not ready
    assert any("P5" in r for r in reasons)
    assert any("SW Power Cap" in r for r in reasons)


def test_laptop_trap_from_nvml_samples():
    state = laptop_state()
    state["telemetry_source"] = "nvml"
    state["load"] = doctor.summarize_samples(json.loads(_read("nvml_laptop_powerd_samples.json")))
    findings = doctor.diagnose(state)
    assert any(f.code == "throttle-load" and f.level == "problem" for f in findings)
    assert not doctor.ready_for_timing(state)[0]


def test_sw_power_cap_alone_detects_trap_without_powerd_info():
    state = laptop_state()
    state["powerd"] = {"status": "not-applicable", "detail": "no systemd: not applicable"}
    throttle = by_code(doctor.diagnose(state), "throttle-load")[0]
    assert throttle.level == "problem" and "nvidia-powerd" in throttle.fix


def test_healthy_h200_is_ok_and_ready():
    state = h200_state()
    assert state["load"]["pstate"] == "P0" and state["load"]["mem_clock_mhz"] == 3201
    findings = doctor.diagnose(state)
    assert all(f.level == "ok" for f in findings), [f for f in findings if f.level != "ok"]
    assert by_code(findings, "pstate-load")[0].title == "P-state under load: P0"
    assert "3201 of 3201 MHz" in by_code(findings, "mem-clock-load")[0].title
    assert "87%" in by_code(findings, "copy-bandwidth")[0].title
    assert doctor.ready_for_timing(state) == (True, [])


def test_p2_under_load_is_a_warning_but_not_ready():
    state = h200_state()
    state["load"] = {**state["load"], "pstate": "P2"}
    finding = by_code(doctor.diagnose(state), "pstate-load")[0]
    assert finding.level == "warning" and finding.blocks_timing
    assert not doctor.ready_for_timing(state)[0]


def test_p1_under_load_is_ready():
    state = h200_state()
    state["load"] = {**state["load"], "pstate": "P1"}
    assert doctor.ready_for_timing(state)[0]


def test_power_cap_at_the_limit_and_thermal_throttle_block_timing():
    state = h200_state()
    state["load"] = {**state["load"], "throttle_reasons": ["sw_power_cap"], "power_w": 699.0}
    finding = by_code(doctor.diagnose(state), "throttle-load")[0]
    assert (
        finding.level == "problem" and "power limit" in finding.title and "powerd" not in (finding.fix or "")
    )
    state["load"] = {**state["load"], "throttle_reasons": ["hw_thermal_slowdown"]}
    finding = by_code(doctor.diagnose(state), "throttle-load")[0]
    assert "HW Thermal Slowdown" in finding.title
    assert not doctor.ready_for_timing(state)[0]


def test_application_clocks_warn_without_blocking():
    state = h200_state()
    state["load"] = {**state["load"], "throttle_reasons": ["applications_clocks_setting"]}
    findings = doctor.diagnose(state)
    assert by_code(findings, "clock-setting")[0].level == "warning"
    assert doctor.ready_for_timing(state)[0]


def test_lowered_power_limit_warns():
    state = h200_state()
    state["power_limit_w"] = 500.0
    finding = by_code(doctor.diagnose(state), "power-limit")[0]
    assert finding.level == "warning" and "nvidia-smi -pl 700" in finding.fix


def test_slow_empty_kernel_warns():
    state = h200_state()
    state["empty_kernel_us"] = 4.0
    assert by_code(doctor.diagnose(state), "empty-kernel")[0].level == "warning"


def test_missing_load_or_telemetry_is_not_ready():
    state = h200_state()
    state["load"] = None
    assert not doctor.ready_for_timing(state)[0]
    state = h200_state()
    state["telemetry_source"] = None
    state["telemetry_error"] = "pynvml not installed"
    finding = by_code(doctor.diagnose(state), "telemetry")[0]
    assert finding.level == "problem" and "nvidia-ml-py" in finding.fix
    assert not doctor.ready_for_timing(state)[0]


def test_no_gpu_state_explains_and_is_not_ready():
    state = doctor.empty_state()
    state.update(
        unavailable_reason="this torch build (2.13.0+cpu) has no CUDA support",
        powerd={"status": "not-applicable", "detail": "no systemd: not applicable"},
    )
    findings = doctor.diagnose(state)
    assert findings[0].code == "gpu" and findings[0].level == "problem"
    ready, reasons = doctor.ready_for_timing(state, findings)
    assert not ready and "no usable CUDA GPU" in reasons[0]
    text = doctor.format_report(state, findings)
    assert "GPU: none usable (this torch build (2.13.0+cpu) has no CUDA support)" in text
    assert "Ready for timing: NO" in text


def test_finding_rejects_unknown_level():
    with pytest.raises(ValueError, match="`level`"):
        doctor.Finding("x", "fatal", "title")


# ---------------------------------------------------------------------- rendering
def test_format_report_laptop_shows_trap_and_fix():
    state = laptop_state()
    text = doctor.format_report(state)
    assert "NVIDIA GeForce RTX 3070 Laptop GPU" in text
    assert "L2 4.0 MiB" in text
    assert "P8" in text and "P5" in text
    assert "810 MHz (max 7001)" in text
    assert "SW Power Cap" in text
    assert "fix: `sudo systemctl stop nvidia-powerd`" in text
    assert "never changes clocks" in text
    assert "Ready for timing: NO" in text


def test_format_report_h200():
    text = doctor.format_report(h200_state())
    assert "NVIDIA H200 (sm_90, 132 SMs, L2 60.0 MiB" in text
    assert "4.28 TB/s" in text and "0.87 us per launch" in text
    assert "no systemd: not applicable" in text
    assert "Ready for timing: yes" in text


def test_summary_line_says_state_under_load_in_one_line():
    assert doctor.summary_line(h200_state()) == (
        "NVIDIA H200: P0 under load, memory clock 3201 of 3201 MHz, SM clock 1980 MHz, throttle none, "
        "copy bandwidth 4.28 TB/s"
    )
    laptop = doctor.summary_line(laptop_state())
    assert "P5 under load" in laptop and "810 of 7001 MHz" in laptop and "SW Power Cap" in laptop
    idle_only = {**h200_state(), "load": None}
    assert "P0 idle (no sample under load)" in doctor.summary_line(idle_only)
    assert doctor.summary_line(doctor.empty_state()) == "GPU: none usable (unknown reason)"


def test_to_dict_and_write_json_roundtrip(tmp_path):
    state = laptop_state()
    path = doctor.write_json(tmp_path / "sub" / "doctor.json", state)
    data = json.loads(path.read_text())
    assert data["schema"] == "l2lightning.doctor/1"
    assert data["ready_for_timing"] is False
    assert data["state"]["load"]["pstate"] == "P5"
    assert {f["level"] for f in data["findings"]} >= {"problem", "warning"}


# ---------------------------------------------------------------------- readers with stand-ins
def _fake_pynvml(mask: int = 4, pstate: int = 5) -> types.ModuleType:
    m = types.ModuleType("pynvml")

    class NVMLError(Exception):
        pass

    def not_supported(*a):
        raise NVMLError("Not Supported")

    m.NVMLError = NVMLError
    m.NVML_CLOCK_MEM, m.NVML_CLOCK_SM, m.NVML_TEMPERATURE_GPU = 2, 1, 0
    m.nvmlInit = lambda: None
    m.nvmlShutdown = lambda: None
    m.nvmlDeviceGetHandleByUUID = not_supported
    m.nvmlDeviceGetHandleByIndex = lambda i: ("handle", i)
    m.nvmlDeviceGetName = lambda h: b"NVIDIA GeForce RTX 3070 Laptop GPU"
    m.nvmlDeviceGetUUID = lambda h: "GPU-3b6f1c52"
    m.nvmlSystemGetDriverVersion = lambda: "550.120"
    m.nvmlDeviceGetMaxClockInfo = lambda h, c: 7001 if c == 2 else 1620
    m.nvmlDeviceGetClockInfo = lambda h, c: 810 if c == 2 else 1290
    m.nvmlDeviceGetEnforcedPowerLimit = lambda h: 80000
    m.nvmlDeviceGetPowerManagementDefaultLimit = lambda h: 80000
    m.nvmlDeviceGetMemoryBusWidth = lambda h: 256
    m.nvmlDeviceGetPerformanceState = lambda h: pstate
    m.nvmlDeviceGetPowerUsage = lambda h: 46020
    m.nvmlDeviceGetTemperature = not_supported
    m.nvmlDeviceGetCurrentClocksThrottleReasons = lambda h: mask
    return m


def test_nvml_reader_decodes_units(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", _fake_pynvml())
    reader, error = doctor.open_telemetry(0, "3b6f1c52")
    assert error is None and isinstance(reader, doctor.NvmlReader)
    static = reader.static()
    assert static["gpu_name"] == "NVIDIA GeForce RTX 3070 Laptop GPU"
    assert static["power_limit_w"] == 80.0 and static["memory_bus_width_bits"] == 256
    sample = reader.sample()
    assert sample["pstate"] == "P5" and sample["mem_clock_mhz"] == 810
    assert sample["power_w"] == pytest.approx(46.02)
    assert sample["temperature_c"] is None  # not supported: unknown, not fatal
    assert sample["throttle_reasons"] == ["sw_power_cap"]
    reader.close()


def _fake_smi(tmp_path: Path, body: str) -> None:
    exe = tmp_path / "nvidia-smi"
    exe.write_text("#!/bin/sh\n" + body)
    exe.chmod(exe.stat().st_mode | stat.S_IEXEC)


def test_smi_reader_falls_back_to_renamed_reason_field(tmp_path, monkeypatch):
    line = _read("nvidia_smi_laptop_powerd_load.csv").splitlines()[0]
    # An old driver that knows only clocks_event_reasons.active (the renamed field).
    _fake_smi(
        tmp_path,
        'case "$*" in *clocks_throttle_reasons*) echo \'Field "clocks_throttle_reasons.active" is not a valid field to query.\'; exit 2;; esac\n'
        f"echo '{line}'\n",
    )
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setitem(sys.modules, "pynvml", None)  # import fails -> nvidia-smi
    reader, error = doctor.open_telemetry(0, None)
    assert isinstance(reader, doctor.SmiReader), error
    assert "pynvml not installed" in error
    assert "clocks_event_reasons.active" in reader.fields
    sample = reader.sample()
    assert sample["pstate"] == "P5" and sample["throttle_reasons"] == ["sw_power_cap"]
    assert reader.raw and reader.raw[-1] == line


def test_open_telemetry_reports_why_nothing_works(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", None)
    monkeypatch.setattr(doctor.shutil, "which", lambda name: None)
    reader, error = doctor.open_telemetry(0, None)
    assert reader is None
    assert "nvidia-ml-py" in error and "nvidia-smi" in error


def test_collect_without_gpu_degrades(monkeypatch):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU; the no-GPU path is tested on CPU machines")
    state = doctor.collect()
    assert state["gpu_available"] is False
    assert state["unavailable_reason"]
    assert state["powerd"]["status"] in ("active", "inactive", "not-applicable")
    assert not doctor.ready_for_timing(state)[0]


# ---------------------------------------------------------------------- the check before timing
@pytest.mark.parametrize(
    ("kind", "force", "refused", "forced", "said"),
    [
        ("h200", False, False, False, "bench_x: GPU ready for timing: NVIDIA H200: P0 under load"),
        ("laptop", False, True, False, "bench_x: the GPU is not ready for timing (reasons above)"),
        ("laptop", True, False, True, "bench_x: GPU not ready for timing, continuing because of --force"),
        ("none", True, True, False, "bench_x: no usable CUDA GPU; nothing can be timed"),
    ],
)
def test_check_before_timing(monkeypatch, kind, force, refused, forced, said):
    state = {"h200": h200_state, "laptop": laptop_state, "none": doctor.empty_state}[kind]()
    seen = []
    monkeypatch.setattr(doctor, "collect", lambda device, load_seconds: seen.append(device) or state)
    lines: list[str] = []
    check = doctor.check_before_timing(1, force=force, program="bench_x", log=lines.append)
    assert seen == [1]
    assert (check.refused, check.forced, check.ready) == (refused, forced, kind == "h200")
    assert any(line.startswith(said) for line in lines), lines
    assert ("Ready for timing: NO" in "\n".join(lines)) == refused  # the full report only when refused
    document = check.to_dict()
    assert document["ready_for_timing"] is check.ready and document["state"]["schema"] == doctor.SCHEMA
    with pytest.raises(ValueError, match="`device_index` must be >= 0"):
        doctor.check_before_timing(-1)
    with pytest.raises(ValueError, match="`load_seconds` must be > 0"):
        doctor.check_before_timing(0, load_seconds=0)


def test_read_sample_without_telemetry_says_why(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", None)
    monkeypatch.setattr(doctor.shutil, "which", lambda name: None)
    reading = doctor.read_sample(0)
    assert reading["sample"] is None and reading["telemetry_source"] is None
    assert "nvidia-smi" in reading["telemetry_error"]
    with pytest.raises(ValueError, match="`device_index` must be >= 0"):
        doctor.read_sample(-1)


def test_read_sample_through_nvml(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", _fake_pynvml())
    reading = doctor.read_sample(0)
    assert reading["telemetry_source"] == "nvml" and reading["telemetry_error"] is None
    assert reading["sample"]["pstate"] == "P5" and reading["sample"]["throttle_reasons"] == ["sw_power_cap"]


# ---------------------------------------------------------------------- the benchmark scripts use the check


def _benchmark(name: str) -> types.ModuleType:
    return load_benchmark(name)


@pytest.mark.parametrize("name", ["bench_callback", "bench_prefetch_forward"])
def test_benchmarks_refuse_a_gpu_that_is_not_ready(name, monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(doctor, "collect", lambda *a, **k: laptop_state())
    assert _benchmark(name).main(["--out", str(tmp_path / "out")]) == 2
    assert f"{name}: the GPU is not ready for timing" in capsys.readouterr().out
    assert not (tmp_path / "out").exists()  # nothing timed, nothing written


def test_a_benchmark_stores_the_doctors_verdict_with_its_results(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(doctor, "collect", lambda *a, **k: h200_state())
    argv = ["--out", str(tmp_path), "--cases", "8x1x2", "--variants", "lightning", "--rounds", "1"]
    # No GPU here: the fit fails and becomes an error row; the GPU-state record is what is checked.
    assert _benchmark("bench_callback").main([*argv, "--steps", "2"]) == 0
    assert "bench_callback: GPU ready for timing: NVIDIA H200: P0 under load" in capsys.readouterr().out
    stored = json.loads((tmp_path / "callback_fit.json").read_text())
    assert stored["doctor"]["ready_for_timing"] is True and stored["forced"] is False
    assert stored["doctor"]["state"]["gpu_name"] == "NVIDIA H200"


def test_the_autotune_benchmark_reads_the_device_from_new_and_stored_runs():
    bench = _benchmark("bench_autotune")
    assert bench.device_name({"doctor": {"state": {"gpu_name": "NVIDIA H200"}}}) == "NVIDIA H200"
    assert bench.device_name({"gpu_state_before": {"torch_device": {"name": "NVIDIA H100"}}}) == "NVIDIA H100"
    assert bench.device_name({}) == "?"
    findings = doctor.diagnose(laptop_state())
    check = doctor.TimingCheck(laptop_state(), findings, False, ["a reason"], refused=False)
    warnings = bench.state_warnings(check)
    assert warnings[0] == "a reason" and "nvidia-powerd (Dynamic Boost) is active" in warnings
