"""benchmarks/bench_default_cost.py's argument handling (the timing itself needs a GPU)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import bench_default_cost as bench  # noqa: E402


def test_cases_parse_and_bad_ones_name_the_option():
    assert bench.parse_cases("1536x40x16,1024x60x8") == [(1536, 40, 16), (1024, 60, 8)]
    for bad in ("1536x40", "1536x40x0", "ax2x3"):
        with pytest.raises(ValueError, match="`--cases` takes WIDTHxDEPTHxBATCH"):
            bench.parse_cases(bad)


def test_variants_are_checked_against_the_known_ones():
    assert bench.parse_variants("plain,default") == ["plain", "default"]
    with pytest.raises(ValueError, match="`--variants` takes names from"):
        bench.parse_variants("plain,fast")


def test_the_default_variant_is_the_callbacks_defaults_but_the_cache():
    # `default` must stay what L2GraphCallback() does (prefetch auto with the gate), tuned afresh
    assert bench.VARIANTS["default"] == {"autotune": {"cache": None}}
    assert bench.VARIANTS["auto_no_gate"]["gate_pairs"] == 0


def test_medians_over_rounds_per_case_and_variant():
    rows = [
        {
            "case": "d8x2 b4",
            "variant": "off",
            "step_ms": v,
            "fit_wall_s": 1.0,
            "peak_alloc_gib": 0.5,
            "peak_reserved_gib": 1.0,
        }
        for v in (1.0, 3.0, 2.0)
    ] + [{"case": "d8x2 b4", "variant": "plain", "error": "boom"}]
    table = bench.medians(rows, ["d8x2 b4"], ["off", "plain"])
    assert table[0]["step_ms"] == 2.0 and table[1]["step_ms"] is None


def test_families_parse_with_their_batch_and_bad_ones_name_the_option():
    assert bench.parse_families("") == []
    assert bench.parse_families("mlp_stack@4, rl_policy") == [("mlp_stack", 4), ("rl_policy", 16)]
    for bad in ("mlp", "mlp_stack@0", "mlp_stack@x"):
        with pytest.raises(ValueError, match=r"`--families` takes FAMILY\[@BATCH\] items.*mlp_stack"):
            bench.parse_families(bad)


def test_without_cuda_the_benchmark_says_so_and_exits_2(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(bench.torch.cuda, "is_available", lambda: False)
    assert bench.main(["--out", str(tmp_path), "--cases", "", "--families", "mlp_stack@4"]) == 2
    assert "no CUDA device" in capsys.readouterr().err
