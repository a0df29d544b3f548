"""CPU tests of the `l2lightning` command line: doctor without a GPU, --json, argument errors, bench refusal."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from l2lightning import bench, cli

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
        (["bench", "--chains", "sideways"], "choose from"),
        (["bench", "--dtype", "int8"], "invalid choice"),
        (["bench", "--repeats", "0"], "expected a positive integer"),
        (["bench", "--steps", "x"], "expected a positive integer"),
        (["bench", "--prefetch", "always"], "invalid choice"),
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
    assert "--quick" in out and "--force" in out and "--criteria" in out


def test_bench_settings_from_args_quick_defaults():
    parser = cli.build_parser()
    args = parser.parse_args(["bench", "--quick", "--criteria", ""])
    s = bench.settings_from_args(args)
    assert s.quick and s.batches == [16] and s.repeats == 6 and s.steps == 10
    assert s.models == [(1536, 40)] and s.criteria is None
    args = parser.parse_args(["bench", "--widths", "768,1536", "--depths", "40", "--batches", "4,8,16,64"])
    s = bench.settings_from_args(args)
    assert s.models == [(768, 40), (1536, 40)] and s.batches == [4, 8, 16, 64] and s.repeats == 10
    args = parser.parse_args(["bench", "--models", "1536x40,1024x60", "--variants", "eager,graph"])
    s = bench.settings_from_args(args)
    assert s.models == [(1536, 40), (1024, 60)]
    assert s.variants_for("step") == ["eager", "graph"] and s.variants_for("forward") == ["eager", "graph"]


def test_bench_default_criteria_is_the_repository_file(monkeypatch):
    monkeypatch.chdir(ROOT)
    s = bench.settings_from_args(cli.build_parser().parse_args(["bench"]))
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
