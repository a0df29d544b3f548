"""Shared by the entry point's tests: composing `conf/train.yaml`, running it in-process or as a subprocess."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from hydra import compose, initialize_config_dir

import l2lightning.app.train as train
from l2lightning._resources import config_dir

REPO = Path(__file__).resolve().parents[1]


def compose_train(overrides: list[str]):
    """`conf/train.yaml` composed with `overrides`, Hydra's own config included (as `-m`/`run` see it)."""
    with initialize_config_dir(str(config_dir()), version_base="1.3"):
        return compose("train", overrides=overrides, return_hydra_config=True)


def run_overrides(overrides: list[str], run_dir: Path) -> dict:
    """`l2lightning.app.train.run` in this process, writing to `run_dir`; returns its result record."""
    return train.run(compose_train(overrides), output_dir=run_dir, overrides=overrides)


def python_env(extra_path: Path | None = None) -> dict[str, str]:
    """The environment for a subprocess running the entry point from this checkout (one OpenMP thread)."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    paths = [str(p) for p in (extra_path, REPO) if p is not None]
    if env.get("PYTHONPATH"):
        paths.append(env["PYTHONPATH"])
    env["PYTHONPATH"] = os.pathsep.join(paths)
    return env


def run_entry_point(
    args: list[str], cwd: Path, extra_path: Path | None = None
) -> subprocess.CompletedProcess:
    """`python -m l2lightning.app.train ARGS` in a subprocess from `cwd`; output captured as text."""
    return subprocess.run(
        [sys.executable, "-m", "l2lightning.app.train", *args],
        cwd=cwd,
        env=python_env(extra_path),
        capture_output=True,
        text=True,
        timeout=300,
    )
