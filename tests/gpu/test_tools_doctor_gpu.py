"""GPU tests of the doctor and the benchmark harness: a complete live state, and a complete result file.

Marked `gpu`: skipped with a reason on machines without CUDA. Run with `pytest -q -s tests/gpu/test_tools_doctor_gpu.py`
to see the doctor's report and the harness output.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from l2lightning.tools import cli, doctor
from l2lightning.tools.bench import variants as bench_variants

pytestmark = pytest.mark.gpu

ROOT = Path(__file__).resolve().parent.parent.parent
# May be None on a healthy GPU: no reason to report, no telemetry error.
MAY_BE_NONE = {"unavailable_reason", "telemetry_error"}
SAMPLE_KEYS = (
    "pstate",
    "mem_clock_mhz",
    "sm_clock_mhz",
    "power_w",
    "power_limit_w",
    "temperature_c",
    "throttle_reasons",
)


def test_collect_yields_a_complete_state():
    state = doctor.collect(0)
    findings = doctor.diagnose(state)
    print("\n" + doctor.format_report(state, findings))
    missing = sorted(k for k, v in state.items() if v is None and k not in MAY_BE_NONE)
    assert not missing, (
        f"state fields left unknown: {missing} (telemetry: {state['telemetry_source']}, {state['telemetry_error']})"
    )
    assert state["gpu_available"] is True
    assert state["telemetry_source"] in ("nvml", "nvidia-smi")
    assert state["powerd"]["status"] in ("active", "inactive", "not-applicable")  # systemd may be absent
    for name in ("idle", "load"):
        sample = state[name]
        assert all(sample.get(k) is not None for k in SAMPLE_KEYS), (name, sample)
    assert state["load"]["samples"] >= 3
    assert state["copy_buffer_bytes"] >= 1 << 30
    assert 1e10 < state["copy_bandwidth_bytes_per_s"] < 2e13
    assert 0.05 < state["empty_kernel_us"] < 50
    assert state["empty_kernel_launches"] == 1000
    assert state["l2_bytes"] > 0 and state["sm_count"] > 0
    json.dumps(doctor.to_dict(state, findings), default=str)
    ready, reasons = doctor.ready_for_timing(state, findings)
    assert isinstance(ready, bool) and (ready or reasons)


def test_harness_quick_tiny_config_writes_a_complete_result_file(tmp_path):
    out = tmp_path / "results"
    criteria = ROOT / "benchmarks" / "criteria.yaml"
    argv = [
        "bench",
        "--quick",
        "--models",
        "512x4",
        "--batches",
        "4",
        "--repeats",
        "2",
        "--steps",
        "3",
        "--force",
        "--out",
        str(out),
        "--criteria",
        str(criteria),
    ]
    assert cli.main(argv) == 0
    doc = json.loads((out / "results.json").read_text())
    assert doc["complete"] is True
    prereg = json.loads((out / "preregistration.json").read_text())
    assert prereg["sha256"] == doc["preregistration"]["sha256"]
    rows = doc["results"]
    expected = {(chain, v) for chain, variants in bench_variants.CHAIN_VARIANTS.items() for v in variants}
    assert {(r["chain"], r["variant"]) for r in rows} == expected
    failed = {(r["chain"], r["variant"]): r["error"] for r in rows if r["error"] or r["median_us"] is None}
    assert not failed, f"variants without a timing: {failed}"
    for r in rows:
        assert r["n"] == 2 and r["ci_lo_us"] <= r["median_us"] <= r["ci_hi_us"]
        assert r["floor_us"] and r["kernel_count"], r
        assert r["forced"] == doc["forced"]
    callback = next(r for r in rows if r["variant"] == "callback_off")
    assert callback["info"]["callback"].get("captured") is True, callback["info"]
    assert len(doc["criteria_results"]) == len(prereg["criteria"])
    assert doc["environment"]["torch"] and doc["environment"]["gpu"]["gpu_name"]
    for name in ("speedup.png", "prefetch_gain_vs_layer.png", "time_vs_floors.png", "results.csv"):
        assert (out / name).stat().st_size > 1000, name


# Run in a subprocess: a fault there is a failed test, not a poisoned CUDA context for the session.
GRAPH_LIFETIME_SCRIPT = r"""
import gc
import torch
from l2lightning.tools.bench import run as bench
settings = bench.BenchSettings(models=[(512, 4)], batches=[4], chains=["step"], repeats=1, steps=3)
case = bench.BenchCase(512, 4, 4, "bfloat16", "step")
live = bench.make_runner("graph", case, settings, {})
live.setup()
# What other variants do between this graph's replays in one harness process: capture another
# graph on the same capture stream and destroy it, then Lightning's teardown (cuBLAS workspaces
# cleared, cache emptied), then allocate and fill whatever memory was handed back.
other = bench.make_runner("graph", case, settings, {})
other.setup()
other.close()
del other
gc.collect()
torch._C._cuda_clearCublasWorkspaces()
torch.cuda.empty_cache()
junk = [torch.full((256 * 1024,), float("nan"), device="cuda") for _ in range(512)]
losses = [float(live.step(i)) for i in range(6)]
torch.cuda.synchronize()
print("losses", losses)
assert all(l == l and abs(l) < 1e4 for l in losses), losses
live.close()
print("ok")
"""


def test_harness_graph_survives_other_captures_and_lightning_teardown():
    import os
    import subprocess
    import sys

    env = {
        **os.environ,
        "CUDA_LAUNCH_BLOCKING": "1",
        "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
    }
    proc = subprocess.run(
        [sys.executable, "-c", GRAPH_LIFETIME_SCRIPT],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=env,
        timeout=300,
    )
    assert proc.returncode == 0 and "ok" in proc.stdout, proc.stdout[-2000:] + proc.stderr[-4000:]
