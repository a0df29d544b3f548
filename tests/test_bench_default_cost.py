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


def test_a_family_case_fits_the_familys_module_on_its_data(monkeypatch):
    """The family case's wiring on the CPU: its module and data, one fit, the row's fields (the
    CUDA memory counters and the GPU Trainer replaced by stand-ins: the timing itself needs a GPU)."""
    import l2lightning.tools.bench.lightning_runners as runners

    for name in ("empty_cache", "reset_peak_memory_stats", "synchronize"):
        monkeypatch.setattr(bench.torch.cuda, name, lambda *a, **k: None)
    monkeypatch.setattr(bench.torch.cuda, "max_memory_allocated", lambda *a, **k: 1 << 30)
    monkeypatch.setattr(bench.torch.cuda, "max_memory_reserved", lambda *a, **k: 2 << 30)
    real = runners.lightning_trainer
    made = []

    def on_cpu(settings, max_steps, callbacks, accelerator="cuda", **overrides):
        made.append((max_steps, overrides))
        return real(settings, max_steps, callbacks, accelerator="cpu", **overrides)

    monkeypatch.setattr(runners, "lightning_trainer", on_cpu)
    row = bench.fit_family_once("plain", "rl_policy", 4, untimed=3, steps=3)
    assert row["case"] == "rl_policy b4" and row["variant"] == "plain" and row["step_ms"] > 0, row
    assert row["peak_alloc_gib"] == 1.0 and row["peak_reserved_gib"] == 2.0 and row["param_gib"] > 0
    assert made == [(7, {"precision": "32-true"})]


def test_rounds_alternate_the_order_of_the_variants():
    assert bench.round_order(["plain", "off", "default"], 0) == ["plain", "off", "default"]
    assert bench.round_order(["plain", "off", "default"], 1) == ["default", "off", "plain"]
    assert bench.round_order(["off", "default"], 2) == ["off", "default"]
