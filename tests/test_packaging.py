"""The built wheel carries kernels/ and conf/, and the installed package finds them without the checkout."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


def _clean_source(tmp_path_factory) -> Path:
    """The checkout's files (tracked, and untracked but not ignored) copied apart: a wheel built in the
    checkout itself reuses its ignored ``build/``, which can still hold modules that moved or went."""
    listed = subprocess.run(
        ["git", "ls-files", "-co", "--exclude-standard"], cwd=REPO, capture_output=True, text=True
    )
    if listed.returncode != 0:  # not a git checkout (an unpacked sdist): build where it is
        return REPO
    source = tmp_path_factory.mktemp("source")
    for name in listed.stdout.splitlines():
        path = REPO / name
        if path.is_file():
            (source / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(path, source / name)
    return source


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Path:
    wheels = tmp_path_factory.mktemp("wheels")
    site = tmp_path_factory.mktemp("site")
    source = _clean_source(tmp_path_factory)
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "-q",
            "--no-deps",
            "--no-build-isolation",
            "-w",
            str(wheels),
            str(source),
        ],
        check=True,
    )
    (wheel,) = wheels.glob("l2lightning-*.whl")
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(site), str(wheel)],
        check=True,
    )
    return site


def run_installed(site: Path, cwd: Path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(site), "OMP_NUM_THREADS": "1"}
    return subprocess.run(
        [sys.executable, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=300
    )


def test_installed_package_finds_configs_and_kernels_outside_the_checkout(installed, tmp_path):
    code = (
        "import l2lightning, l2lightning._resources as r;"
        "print(l2lightning.__file__); print(r.config_dir()); print(r.kernels_dir());"
        "print('void l2_prefetch_hint(' in r.kernel_source('l2_prefetch.cu'));"
        "print(sorted(p.name for p in (r.config_dir() / 'model').glob('*.yaml')))"
    )
    proc = run_installed(installed, tmp_path, "-c", code)
    assert proc.returncode == 0, proc.stderr
    module_file, conf, kernels, has_kernel, models = proc.stdout.strip().splitlines()
    assert module_file.startswith(str(installed))
    assert conf.startswith(str(installed)) and conf.endswith("_conf")
    assert kernels.startswith(str(installed)) and has_kernel == "True"
    assert "mlp_stack.yaml" in models and "vit.yaml" in models


def test_installed_entry_point_trains_with_shipped_configs(installed, tmp_path):
    proc = run_installed(
        installed,
        tmp_path,
        "-m",
        "l2lightning.app.train",
        "trainer.max_steps=1",
        f"hydra.run.dir={tmp_path / 'run'}",
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert (tmp_path / "run" / "result.json").is_file()


def test_the_wheel_holds_every_subpackage_of_the_checkout(installed, tmp_path):
    # pyproject.toml lists the packages by name: one a move adds must be listed too
    checkout = {p.parent.relative_to(REPO) for p in (REPO / "l2lightning").rglob("__init__.py")}
    wheel = {p.parent.relative_to(installed) for p in (installed / "l2lightning").rglob("__init__.py")}
    assert checkout <= wheel, sorted(map(str, checkout - wheel))
    code = (
        "from l2lightning import L2GraphCallback;"
        "import l2lightning.callback.step_decision, l2lightning.graph.capture, l2lightning.guards.step_source;"
        "L2GraphCallback(); print('ok')"
    )
    proc = run_installed(installed, tmp_path, "-c", code)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-2000:]
