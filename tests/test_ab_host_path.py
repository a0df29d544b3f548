"""benchmarks/ab_host_path.py: argument checks, and one emulated pair on the CPU (the plumbing; its
numbers mean nothing here)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.benchmark_scripts import load_benchmark

ROOT = Path(__file__).resolve().parent.parent


def load():
    return load_benchmark("ab_host_path")


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
    with pytest.raises(SystemExit):
        ab.parse_args(["--a", str(ROOT), "--out", str(tmp_path), "--pause", "-1"])
    assert "--pause must be >= 0 seconds (got -1.0)" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        ab.parse_args(["--a", str(ROOT), "--out", str(tmp_path), "--hash-seed", "random"])
    assert "--hash-seed must be an integer in [0, 4294967295] (got 'random')" in capsys.readouterr().err


def test_the_spread_is_each_fits_ratio_to_the_median_and_the_medians_by_position_in_the_pair():
    ab = load()
    fits = [
        {"family": "f", "tree": "A", "position": 0, "step_ms": 1.0},
        {"family": "f", "tree": "B", "position": 1, "step_ms": 1.5},
        {"family": "f", "tree": "B", "position": 0, "step_ms": 1.0},
        {"family": "f", "tree": "A", "position": 1, "step_ms": 1.4},
        {"family": "g", "tree": "A", "position": 0, "error": "crashed"},
    ]
    out = ab.spread(fits)
    assert set(out) == {"f"}
    f = out["f"]
    assert f["median_ms"] == 1.2
    assert f["ratio_to_median"] == [round(1 / 1.2, 4), 1.25, round(1 / 1.2, 4), round(1.4 / 1.2, 4)]
    assert f["max_deviation"] == pytest.approx(0.25)
    assert f["first_in_pair_median_ms"] == 1.0 and f["second_in_pair_median_ms"] == pytest.approx(1.45)


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
            "--hash-seed",
            "0",
        ]
    )
    result = json.loads((out / "ab_host_path.json").read_text())
    assert code == 0, result["fits"]
    assert [f["tree"] for f in result["fits"]] == ["A", "B"]
    assert [f["position"] for f in result["fits"]] == [0, 1] and result["hash_seed"] == "0"
    assert all(f["python_hash_seed"] == "0" for f in result["fits"])
    assert result["spread"]["mlp_stack"]["median_ms"] > 0 and result["complete"] is True
    p10, p90 = result["fits"][0]["step_ms_p10_p90"]
    assert p10 <= result["fits"][0]["step_ms"] <= p90
    for fit in result["fits"]:
        assert fit["captured"] is True and fit["steps"] == 5
        # the timed steps replayed (a sampled check of a replay that runs nothing would have stopped that)
        assert fit["reason"] is None and fit["fallback_steps"] == 0 and fit["verify"] is False
        assert fit["l2lightning"].startswith(str(ROOT))
    summary = result["summary"]["mlp_stack"]
    assert len(summary["ratio_B_over_A_per_pair"]) == 1 and summary["ratio_B_over_A_median"] > 0
    # the fits' logger files stay out of --out: its files are the run's results alone
    assert sorted(p.name for p in out.iterdir()) == ["ab_host_path.json"]
