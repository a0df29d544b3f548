"""CPU tests of the commands the README names: what `scripts/setup_venv.sh` says before the first
set-up's wait, and how the test command's run ends (one line per skip reason, known third-party
warnings filtered by the pytest configuration in pyproject.toml)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SETUP_LINE = "l2lightning: setting up .venv (first run only:"


def _fake_tools(bin_dir: Path, log: Path) -> None:
    """`python3` that notes its call on stderr and in `log` and fails (no venv is made)."""
    bin_dir.mkdir()
    tool = bin_dir / "python3"
    tool.write_text(f'#!/bin/sh\necho "fake python3 $*" >&2\necho "$*" >> {log}\nexit 3\n')
    tool.chmod(0o755)


def test_setup_says_what_it_does_before_the_first_venv_is_made(tmp_path):
    checkout = tmp_path / "checkout"
    (checkout / "scripts").mkdir(parents=True)
    shutil.copy(REPO / "scripts" / "setup_venv.sh", checkout / "scripts")
    log = tmp_path / "calls.log"
    _fake_tools(tmp_path / "bin", log)
    env = dict(os.environ, PATH=f"{tmp_path / 'bin'}{os.pathsep}{os.environ['PATH']}")
    proc = subprocess.run(
        ["bash", "-e", "-c", "source scripts/setup_venv.sh"],
        cwd=checkout,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 3  # the fake python3's failure stops the set-up
    lines = proc.stderr.splitlines()
    # the line comes first, then the (slow) venv creation
    assert lines[0].startswith(SETUP_LINE) and lines[1] == "fake python3 -m venv .venv", lines
    assert log.read_text().splitlines() == ["-m venv .venv"]


def test_setup_is_quiet_once_the_venv_exists(tmp_path):
    checkout = tmp_path / "checkout"
    (checkout / "scripts").mkdir(parents=True)
    (checkout / ".venv" / "bin").mkdir(parents=True)
    shutil.copy(REPO / "scripts" / "setup_venv.sh", checkout / "scripts")
    for name in ("python", "pip"):
        tool = checkout / ".venv" / "bin" / name
        tool.write_text("#!/bin/sh\nexit 0\n")
        tool.chmod(0o755)
    proc = subprocess.run(
        ["bash", "-e", "-c", "source scripts/setup_venv.sh"],
        cwd=checkout,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0 and proc.stderr == "" and proc.stdout == ""


SAMPLE_TESTS = """
import warnings

import pytest


@pytest.mark.parametrize("i", range(3))
def test_needs_a_gpu(i):
    pytest.skip("GPU test: no CUDA here")


def test_needs_flashinfer():
    pytest.skip("FlashInfer is not installed")


def test_third_party_noise():
    warnings.warn("`torch.jit.script_method` is deprecated. Please switch to `torch.compile`.", DeprecationWarning)
    warnings.warn("a warning of this project's own", UserWarning)
"""


def test_the_test_run_ends_with_one_line_per_skip_reason_and_filters_known_warnings(tmp_path):
    (tmp_path / "test_sample.py").write_text(SAMPLE_TESTS)
    shutil.copy(REPO / "pyproject.toml", tmp_path)  # the repository's pytest configuration
    env = dict(os.environ, PYTHONPATH=str(REPO))
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "tests.conftest", "-p", "no:cacheprovider", "."],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    out = proc.stdout
    assert proc.returncode == 0, out[-3000:]
    lines = out.splitlines()
    start = next(i for i, line in enumerate(lines) if "skip reasons" in line)
    assert lines[start + 1 : start + 3] == [
        "3 skipped: GPU test: no CUDA here",
        "1 skipped: FlashInfer is not installed",
    ]
    # the known third-party deprecation is filtered; the other warning stays
    assert "script_method" not in out and "a warning of this project's own" in out
    assert "1 passed, 4 skipped, 1 warning" in lines[-1]
