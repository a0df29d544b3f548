"""The examples run: the Python ones in-process as scripts, the sweep script and the user-CI test file as
subprocesses. Without CUDA their GPU-only parts must say they were skipped."""

from __future__ import annotations

import csv
import os
import runpy
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parent.parent
EXAMPLES = REPO / "examples"
HAS_CUDA = torch.cuda.is_available()


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def run_example(name: str, capsys) -> str:
    runpy.run_path(str(EXAMPLES / name), run_name="__main__")
    return capsys.readouterr().out


def subprocess_env() -> dict[str, str]:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    # `python` in the sweep script is this interpreter; the checkout is importable without installing it
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env["PYTHONPATH"] = f"{REPO}{os.pathsep}{env['PYTHONPATH']}" if env.get("PYTHONPATH") else str(REPO)
    return env


def test_examples_open_with_what_they_show():
    names = [
        "callback_on_existing_module.py",
        "hydra_sweep.sh",
        "prefetch_hooks_captured_step.py",
        "prefetch_sequential.py",
        "test_gradient_equivalence.py",
    ]
    for name in names:
        text = (EXAMPLES / name).read_text()
        assert text.startswith('"""') or text.startswith("#!/usr/bin/env bash\n#"), name


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_callback_on_existing_module(capsys):
    out = run_example("callback_on_existing_module.py", capsys)
    assert "final loss: " in out
    if HAS_CUDA:
        assert "captured: yes" in out and "speedup" in out
    else:
        assert "captured: no (no CUDA (" in out


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_prefetch_hooks_captured_step(capsys):
    out = run_example("prefetch_hooks_captured_step.py", capsys)
    assert "chain: 48 weight-reading layers" in out  # 24 × (LayerNorm, Linear)
    if HAS_CUDA:
        assert "captured step with prefetch:" in out
    else:
        assert "chain: 48 weight-reading layers, 0 with a prefetch plan" in out
        assert "capture: skipped, capture_step needs a CUDA GPU" in out


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_prefetch_sequential(capsys):
    out = run_example("prefetch_sequential.py", capsys)
    assert "outputs bit-identical to nn.Sequential: True" in out
    if HAS_CUDA:
        assert "PrefetchSequential:" in out
    else:
        assert "prefetch enabled: False" in out
        assert "timing: skipped, needs a CUDA GPU" in out


def test_hydra_sweep_script(tmp_path):
    sweep_dir = tmp_path / "sweep"
    proc = subprocess.run(
        ["bash", str(EXAMPLES / "hydra_sweep.sh"), str(sweep_dir), "trainer=cpu", "trainer.max_steps=2"],
        cwd=tmp_path,
        env=subprocess_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "# Sweep summary: 4 runs" in proc.stdout  # the script prints summary.md
    with (sweep_dir / "summary.csv").open() as f:
        table = list(csv.DictReader(f))
    assert [(row["model"], row["batch_size"], row["status"]) for row in table] == [
        ("mlp_stack", "4", "ok"),
        ("mlp_stack", "16", "ok"),
        ("rl_policy", "4", "ok"),
        ("rl_policy", "16", "ok"),
    ]
    assert all((sweep_dir / str(job) / "result.json").is_file() for job in range(4))


def test_gradient_equivalence_example_runs_under_pytest(tmp_path):
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            str(EXAMPLES / "test_gradient_equivalence.py"),
        ],
        cwd=tmp_path,
        env=subprocess_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:]
    assert ("2 passed" if HAS_CUDA else "2 skipped") in proc.stdout


@pytest.mark.parametrize(
    "name, skip_line",
    [
        ("decode_generate.py", "decode_generate: skipped"),
        ("decode_predict_step.py", "decode_predict_step: skipped"),
    ],
)
def test_decode_examples(name, skip_line, capsys, monkeypatch):
    monkeypatch.setattr("sys.argv", [name])
    out = run_example(name, capsys)
    if HAS_CUDA:
        assert "generated" in out or "tokens/s" in out
    else:
        assert skip_line in out
