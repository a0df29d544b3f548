"""CPU tests of the `l2lightning` command line: doctor without a GPU, --json, argument errors, bench refusal."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from l2lightning.tools import cli
from l2lightning.tools.bench import args as bench_args
from l2lightning.tools.bench import run as bench
from l2lightning.tools.bench import variants

ROOT = Path(__file__).resolve().parent.parent


def _cpu_only() -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("checks the no-GPU path; this machine has a GPU")


def _run(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    return subprocess.run(
        [sys.executable, *args], capture_output=True, text=True, cwd=ROOT, env=env, timeout=300
    )


def test_python_m_doctor_explains_missing_gpu_and_exits_0():
    _cpu_only()
    proc = _run("-m", "l2lightning", "doctor")
    assert proc.returncode == 0, proc.stderr
    assert "GPU: none usable" in proc.stdout
    assert "no usable CUDA GPU" in proc.stdout
    assert "Ready for timing: NO" in proc.stdout
    assert "never changes clocks" in proc.stdout


def test_doctor_json_writes_valid_json(tmp_path, capsys):
    _cpu_only()
    path = tmp_path / "out" / "doctor.json"
    assert cli.main(["doctor", "--json", str(path)]) == 0
    out = capsys.readouterr().out
    assert f"wrote {path}" in out
    data = json.loads(path.read_text())
    assert data["ready_for_timing"] is False
    assert data["state"]["gpu_available"] is False
    assert data["findings"][0]["code"] == "gpu"
    assert data["not_ready_reasons"]


def test_doctor_strict_exits_1_when_not_ready(capsys):
    _cpu_only()
    assert cli.main(["doctor", "--strict"]) == 1


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        ([], "required"),
        (["fly"], "invalid choice"),
        (["doctor", "--device", "-1"], "expected an integer >= 0"),
        (["doctor", "--load-seconds", "0"], "expected a positive number"),
        (["doctor", "--json"], "expected one argument"),
        (["bench", "--batches", "0"], "expected positive integers"),
        (["bench", "--batches", "four"], "comma-separated integers"),
        (["bench", "--models", "1536"], "WIDTHxDEPTH"),
        (["bench", "--variants", "graph,warp"], "unknown ['warp']"),
        (["bench", "--families", "vit,warp"], "unknown model families ['warp']; choose from all, mlp_stack"),
        (["bench", "--chains", "sideways"], "choose from"),
        (["bench", "--dtype", "int8"], "invalid choice"),
        (["bench", "--repeats", "0"], "expected a positive integer"),
        (["bench", "--steps", "x"], "expected a positive integer"),
        (["bench", "--prefetch", "always"], "invalid choice"),
        (["bench", "--optimizer", "lamb"], "invalid choice"),
    ],
)
def test_bad_arguments_give_argparse_errors(argv, message, capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "usage: l2lightning" in err and message in err


def test_version_and_help(capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(["--version"])
    assert exc.value.code == 0 and "l2lightning 0." in capsys.readouterr().out
    with pytest.raises(SystemExit):
        cli.main(["bench", "--help"])
    out = capsys.readouterr().out
    assert "--quick" in out and "--force" in out and "--criteria" in out and "--families" in out


def test_bench_settings_from_args_quick_defaults():
    parser = cli.build_parser()
    args = parser.parse_args(["bench", "--quick", "--criteria", ""])
    s = bench_args.settings_from_args(args)
    assert s.quick and s.batches == [16] and s.repeats == 6 and s.steps == 10
    assert s.models == [(1536, 40)] and s.criteria is None and s.optimizer == "fused"
    args = parser.parse_args(["bench", "--widths", "768,1536", "--depths", "40", "--batches", "4,8,16,64"])
    s = bench_args.settings_from_args(args)
    assert s.models == [(768, 40), (1536, 40)] and s.batches == [4, 8, 16, 64] and s.repeats == 10
    assert s.optimizer == "fused"
    s = bench_args.settings_from_args(parser.parse_args(["bench", "--optimizer", "foreach"]))
    assert s.optimizer == "foreach"
    with pytest.raises(ValueError, match="optimizer must be one of"):
        bench.BenchSettings(models=[(8, 2)], optimizer="sgd")
    args = parser.parse_args(["bench", "--models", "1536x40,1024x60", "--variants", "eager,graph"])
    s = bench_args.settings_from_args(args)
    assert s.models == [(1536, 40), (1024, 60)]
    assert s.variants_for("step") == ["eager", "graph"] and s.variants_for("forward") == ["eager", "graph"]


def test_bench_default_criteria_is_the_repository_file(monkeypatch):
    monkeypatch.chdir(ROOT)
    s = bench_args.settings_from_args(cli.build_parser().parse_args(["bench"]))
    assert s.criteria == Path("benchmarks/criteria.yaml")


def test_bench_refuses_without_gpu(tmp_path, capsys):
    _cpu_only()
    code = cli.main(
        [
            "bench",
            "--quick",
            "--out",
            str(tmp_path / "res"),
            "--criteria",
            str(ROOT / "benchmarks" / "criteria.yaml"),
        ]
    )
    out = capsys.readouterr().out
    assert code == 2
    assert "pre-registered criteria:" in out and "sha256=" in out
    assert "no usable CUDA GPU" in out
    assert not (tmp_path / "res").exists()  # nothing timed, nothing written


def test_bench_rejects_unreadable_criteria(tmp_path, capsys):
    bad = tmp_path / "c.yaml"
    bad.write_text("criteria:\n  - id: x\n    metric: nope\n    op: '>='\n    threshold: 1\n")
    assert cli.main(["bench", "--criteria", str(bad)]) == 2
    assert "unknown metric" in capsys.readouterr().out


def test_gpu_slug():
    assert bench.gpu_slug("NVIDIA H200") == "nvidia-h200"
    assert bench.gpu_slug("NVIDIA GeForce RTX 3070 Laptop GPU") == "nvidia-geforce-rtx-3070-laptop-gpu"
    assert bench.gpu_slug(None) == "unknown-gpu"


def test_harness_script_help():
    proc = _run("benchmarks/harness.py", "--help")
    assert proc.returncode == 0, proc.stderr
    assert "usage: l2lightning bench" in proc.stdout


# ---------------------------------------------------------------------- bench pipeline with stand-ins
FIXTURES = Path(__file__).parent / "fixtures"
FAKE_TIMES = {
    "lightning_eager": 15000.0,
    "callback_off": 4400.0,
    "callback_auto": 4300.0,
    "callback_decoy": 4500.0,
    "eager": 13500.0,
    "graph": 4376.0,
    "graph_prefetch": 4349.0,
    "graph_decoy": 4450.0,
    "compile_graph": 4093.0,
    "compile_graph_prefetch": 4080.0,
}


def _recorded_state(kind: str) -> dict:
    from l2lightning.tools import doctor

    prefix = {"h200": "nvidia_smi_h200", "laptop": "nvidia_smi_laptop_powerd"}[kind]
    measured = json.loads(
        (FIXTURES / {"h200": "h200_measured.json", "laptop": "laptop_powerd_measured.json"}[kind]).read_text()
    )
    return doctor.state_from_nvidia_smi(
        (FIXTURES / f"{prefix}_idle.csv").read_text(), (FIXTURES / f"{prefix}_load.csv").read_text(), measured
    )


@pytest.fixture
def fake_gpu(monkeypatch, tmp_path):
    """bench.run_bench on CPU: recorded doctor state, runners that return synthetic step times."""
    from l2lightning import floors as floors_module
    from l2lightning.tools import doctor

    calls: list[tuple[str, str]] = []
    out = tmp_path / "results"

    class FakeRunner(bench.Runner):
        def setup(self) -> None:
            if self.variant == "compile_ro":
                raise RuntimeError("no triton on this machine")
            self.info = {"fake": True}

        def run(self, steps: int) -> list[float]:
            assert (out / "preregistration.json").exists(), "criteria must be stored before any timing"
            calls.append((self.case.chain, self.variant))
            scale = 1.0 if self.case.chain == "step" else 0.1
            return [FAKE_TIMES[self.variant] * scale * (1 + 0.001 * i) for i in range(steps)]

    def fake_floors(case, gpu_state, settings):
        f = floors_module.floors(
            {"bfloat16": case.width * case.width * 2 * case.depth},
            700,
            gpu_state["copy_bandwidth_bytes_per_s"],
            gpu_state["empty_kernel_us"],
            chain=case.chain,
            state_bytes_per_element=2,
        )
        return f, 700

    state = {"value": _recorded_state("h200")}
    monkeypatch.setattr(doctor, "collect", lambda *a, **k: state["value"])
    monkeypatch.setattr(bench, "make_runner", lambda v, c, s, shared: FakeRunner(v, c, s, shared))
    monkeypatch.setattr(bench, "case_floors", fake_floors)
    return {"calls": calls, "out": out, "state": state}


def test_bench_pipeline_writes_complete_results(fake_gpu, capsys):
    out = fake_gpu["out"]
    criteria = ROOT / "benchmarks" / "criteria.yaml"
    code = cli.main(
        ["bench", "--quick", "--repeats", "3", "--steps", "4", "--out", str(out), "--criteria", str(criteria)]
    )
    printed = capsys.readouterr().out
    assert code == 0, printed
    sha = report_sha = __import__("hashlib").sha256(criteria.read_bytes()).hexdigest()
    assert f"sha256={sha}" in printed
    prereg = json.loads((out / "preregistration.json").read_text())
    assert prereg["sha256"] == report_sha and len(prereg["criteria"]) >= 5
    assert (out / "criteria.yaml").read_bytes() == criteria.read_bytes()

    doc = json.loads((out / "results.json").read_text())
    assert doc["complete"] is True and doc["forced"] is False and doc["ready_for_timing"] is True
    assert doc["environment"]["command"].startswith("l2lightning bench --quick")
    assert doc["environment"]["gpu"]["gpu_name"] == "NVIDIA H200"
    assert doc["doctor"]["ready_for_timing"] is True
    rows = doc["results"]
    step = {r["variant"]: r for r in rows if r["chain"] == "step"}
    assert set(step) == set(variants.STEP_VARIANTS)
    assert step["compile_ro"]["error"] == "setup: RuntimeError: no triton on this machine"
    assert step["compile_ro"]["median_us"] is None
    cb = step["callback_auto"]
    assert cb["n"] == 3 and cb["ci_lo_us"] <= cb["median_us"] <= cb["ci_hi_us"]
    assert cb["speedup_vs_lightning_eager"] == pytest.approx(15000 / 4300, rel=1e-2)
    assert cb["gain_vs_no_prefetch"] == pytest.approx(4400 / 4300 - 1, rel=1e-2)
    assert cb["kernel_count"] == 700 and cb["floor_us"] and cb["ratio_to_floor"] > 1
    assert {r["chain"] for r in rows} == {"step", "forward_backward", "forward"}
    assert all(r["forced"] is False for r in rows)

    # Interleaved: every repeat visits every variant before the next repeat starts, rotating the order.
    step_calls = [v for c, v in fake_gpu["calls"] if c == "step"]
    n = len(variants.STEP_VARIANTS) - 1  # compile_ro failed in setup
    assert len(step_calls) == 3 * n
    assert set(step_calls[:n]) == set(step_calls[n : 2 * n]) and step_calls[0] != step_calls[n]

    results = {c["id"]: c for c in doc["criteria_results"]}
    assert results["whole-step-graph-beats-reduce-overhead"]["status"] == "no data"  # compile_ro failed
    assert results["callback-3x-lightning-eager-small-batch"]["status"] == "passed"
    assert (
        results["callback-4x-lightning-eager-small-batch"]["status"] == "failed"
    )  # 3.5x < 4x: kept as a result
    assert "[FAILED] callback-4x-lightning-eager-small-batch" in printed

    with (out / "results.csv").open() as fh:
        lines = fh.read().splitlines()
    assert lines[0].startswith("config,chain,variant") and len(lines) == 1 + len(rows)
    for name in ("speedup.png", "prefetch_gain_vs_layer.png", "time_vs_floors.png"):
        data = (out / name).read_bytes()
        assert data[:4] == b"\x89PNG" and len(data) > 10_000


def test_bench_refuses_a_throttled_gpu_unless_forced(fake_gpu, capsys):
    fake_gpu["state"]["value"] = _recorded_state("laptop")
    out = fake_gpu["out"]
    argv = [
        "bench",
        "--quick",
        "--repeats",
        "1",
        "--steps",
        "2",
        "--chains",
        "forward",
        "--out",
        str(out),
        "--criteria",
        "",
    ]
    assert cli.main(argv) == 2
    printed = capsys.readouterr().out
    assert "not ready for timing" in printed and "sudo systemctl stop nvidia-powerd" in printed
    assert not fake_gpu["calls"] and not (out / "results.json").exists()

    assert cli.main([*argv, "--force"]) == 0
    printed = capsys.readouterr().out
    assert "continuing because of --force" in printed
    doc = json.loads((out / "results.json").read_text())
    assert doc["forced"] is True and doc["ready_for_timing"] is False
    assert doc["results"] and all(r["forced"] is True for r in doc["results"])
    assert doc["criteria_results"] == []


def test_bench_model_is_one_prefetch_chain_layer_per_block():
    import torch

    from l2lightning.prefetch.chain import discover_chain

    model = bench.build_model(64, 3, "cpu", torch.float32)
    x = torch.randn(2, 64)
    chain = discover_chain(model, x)
    assert [layer.name for layer in chain] == ["blocks.0", "blocks.1", "blocks.2"]
    assert all(len(layer.weights) == 1 and layer.weights[0].shape == (64, 64) for layer in chain)
    # Same maths as the nn modules: LayerNorm -> Linear -> GELU.
    blk = model.blocks[0]
    ref = torch.nn.functional.gelu(
        torch.nn.functional.linear(
            torch.nn.functional.layer_norm(x, (64,), blk.ln_weight, blk.ln_bias), blk.weight, blk.bias
        )
    )
    assert torch.equal(blk(x), ref)
    loss = bench.regression_loss(model, (x, torch.zeros(2, 64)))
    loss.backward()
    assert all(p.grad is not None for p in model.parameters())
    # Same seed, same weights: every variant starts from the same model.
    again = bench.build_model(64, 3, "cpu", torch.float32)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), again.parameters()))


# ---------------------------------------------------------------------- graph lifetimes (CPU stand-ins)
