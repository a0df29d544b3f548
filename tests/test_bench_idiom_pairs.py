"""bench_idiom_pairs.py's plumbing on the CPU: the pair statistics from synthetic fits, the default
idiom list, argument errors, and a real two-round run (the callback refuses every CPU fit for want of
CUDA, so each callback fit must be bitwise its pair's plain fit)."""

from __future__ import annotations

import csv
import json

import pytest

from tests.benchmark_scripts import load_benchmark

bench = load_benchmark("bench_idiom_pairs")


def _fit(variant, rnd, step_ms, fit_s=1.0, captured=False, equal=True, reason="refused: why"):
    return {
        "variant": variant,
        "round": rnd,
        "step_ms": step_ms,
        "fit_s": fit_s,
        "captured": captured if variant == "callback" else None,
        "equal": equal,
        "reason": reason if variant == "callback" else None,
    }


def test_summary_takes_medians_per_variant_and_ratios_per_pair():
    fits = [
        _fit("plain", 0, 10.0, fit_s=1.0),
        _fit("callback", 0, 11.0, fit_s=1.2),
        _fit("callback", 1, 9.0, fit_s=1.1),
        _fit("plain", 1, 10.0, fit_s=0.9),
        _fit("plain", 2, 8.0, fit_s=0.8),
        _fit("callback", 2, 10.0, fit_s=1.0),
    ]
    row = bench.summarize("x", fits)
    assert row["rounds"] == 3
    assert row["plain_ms"] == 10.0 and row["callback_ms"] == 10.0
    assert row["callback_over_plain"] == 1.0
    assert row["pair_ratios"] == pytest.approx([1.1, 0.9, 1.25])
    assert row["pairs_callback_slower"] == 2
    assert row["plain_fit_s"] == 0.9 and row["callback_fit_s"] == 1.1
    assert row["fit_callback_over_plain"] == pytest.approx(1.1 / 0.9)
    assert row["captured_fits"] == 0 and row["equal_every_fit"]
    assert row["reason"] == "refused: why"


def test_summary_says_when_a_fit_was_captured_or_differed():
    fits = [_fit("plain", 0, 10.0), _fit("callback", 0, 5.0, captured=True, equal=False)]
    row = bench.summarize("x", fits)
    assert row["captured_fits"] == 1 and not row["equal_every_fit"]
    assert row["pairs_callback_slower"] == 0


def test_default_idioms_are_the_ones_expected_refused():
    names = bench.refused_idioms()
    assert "manual_gan" in names and "own_step_counter" in names
    assert "autoencoder" not in names  # captured


@pytest.mark.parametrize(
    ("argv", "named"),
    [
        (["--only", "no_such_idiom"], "--only: unknown idioms ['no_such_idiom']"),
        (["--rounds", "0"], "--rounds must be at least 1, got 0"),
        (["--steps", "5"], "--steps must be at least 12"),
    ],
)
def test_bad_arguments_are_named(argv, named, tmp_path, capsys):
    with pytest.raises(SystemExit):
        bench.main(["--out", str(tmp_path), *argv])
    assert named in capsys.readouterr().err


def test_a_cpu_run_writes_pairs_that_are_refused_and_bitwise_plain(tmp_path):
    assert (
        bench.main(["--out", str(tmp_path), "--only", "own_step_counter", "--rounds", "2", "--steps", "12"])
        == 0
    )
    with open(tmp_path / "idiom_pairs.csv") as f:
        (row,) = list(csv.DictReader(f))
    assert row["module"] == "own_step_counter" and row["rounds"] == "2"
    assert row["captured_fits"] == "0" and row["equal_every_fit"] == "True"
    assert "no CUDA" in row["reason"]
    payload = json.loads((tmp_path / "idiom_pairs.json").read_text())
    fits = payload["fits"]["own_step_counter"]
    # the order alternates: plain first in round 0, the callback first in round 1
    assert [(f["round"], f["variant"]) for f in fits] == [
        (0, "plain"),
        (0, "callback"),
        (1, "callback"),
        (1, "plain"),
    ]
    assert all(f["step_ms"] > 0 for f in fits)
    assert {f["reference"] for f in fits} == {"plain"}  # refused: each callback fit against its plain pair
    assert payload["gpu_state"] == {"checked": False, "why": "CPU run"}


@pytest.mark.usefixtures("emulated_cuda_graphs")
def test_a_captured_idiom_is_compared_with_its_baseline_in_every_round(monkeypatch, tmp_path):
    """On the graph emulator the callback captures: each round then fits the baseline, switched where
    the callback switched, and the callback fit must equal it (not the plain fit, which differs)."""
    from tests import idiom_harness

    monkeypatch.setattr(idiom_harness, "_EXTRA_CAPTURABLE_DEVICES", ("cpu",))
    fits = bench.measure("autoencoder", rounds=2, steps=12, accelerator="cpu")
    assert [(f["round"], f["variant"]) for f in fits] == [
        (0, "plain"),
        (0, "callback"),
        (1, "callback"),
        (1, "plain"),
    ]
    assert all(f["reference"] == "baseline" and f["equal"] for f in fits), [f["difference"] for f in fits]
    row = bench.summarize("autoencoder", fits)
    assert row["captured_fits"] == 2 and row["equal_every_fit"]
    assert row["fit_callback_over_plain"] > 0
