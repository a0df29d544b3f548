"""benchmarks/ab_host_path.py: argument checks, and one emulated pair on the CPU (the plumbing; its
numbers mean nothing here)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def load():
    spec = importlib.util.spec_from_file_location("ab_host_path", ROOT / "benchmarks" / "ab_host_path.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_arguments_are_checked(tmp_path, capsys):
    ab = load()
    with pytest.raises(SystemExit):
        ab.parse_args(["--out", str(tmp_path)])
    assert "--a and --out are required" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        ab.parse_args(["--a", str(tmp_path), "--out", str(tmp_path)])
    assert "has no l2lightning/ package" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        ab.parse_args(["--a", str(ROOT), "--out", str(tmp_path), "--pairs", "0"])
    assert "--pairs and --steps must be positive" in capsys.readouterr().err


def test_one_emulated_pair_runs_each_tree_in_its_own_process(tmp_path):
    ab = load()
    out = tmp_path / "ab"
    code = ab.main(
        [
            "--a",
            str(ROOT),
            "--b",
            str(ROOT),
            "--out",
            str(out),
            "--emulate",
            "--pairs",
            "1",
            "--steps",
            "5",
            "--families",
            "mlp_stack",
        ]
    )
    result = json.loads((out / "ab_host_path.json").read_text())
    assert code == 0, result["fits"]
    assert [f["tree"] for f in result["fits"]] == ["A", "B"]
    for fit in result["fits"]:
        assert fit["captured"] is True and fit["steps"] == 5
        assert fit["l2lightning"].startswith(str(ROOT))
    summary = result["summary"]["mlp_stack"]
    assert len(summary["ratio_B_over_A_per_pair"]) == 1 and summary["ratio_B_over_A_median"] > 0
