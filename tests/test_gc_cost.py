"""benchmarks/gc_cost.py on the CPU: it fits the idiom, times each generation and names bad arguments."""

from __future__ import annotations

import json

import pytest

from tests.benchmark_scripts import load_benchmark

bench = load_benchmark("gc_cost")


def test_the_timings_cover_every_generation_with_their_spread():
    timings = bench.time_collections(repeats=3)
    assert set(timings) == {"generation_0", "generation_1", "generation_2"}
    for stats in timings.values():
        assert 0 <= stats["min_ms"] <= stats["median_ms"] <= stats["max_ms"]


def test_a_cpu_run_writes_the_collections_after_a_plain_fit(tmp_path):
    assert bench.main(["--out", str(tmp_path), "--accelerator", "cpu", "--steps", "3", "--repeats", "2"]) == 0
    result = json.loads((tmp_path / "gc_cost.json").read_text())
    assert result["after"] == "one plain fit of 'own_step_counter', 3 batches, on cpu"
    assert result["tracked_objects"] > 10_000  # torch and Lightning are loaded
    # a full collection walks every tracked object: never cheaper than the youngest generation's
    assert (
        result["collections"]["generation_2"]["median_ms"] >= result["collections"]["generation_0"]["min_ms"]
    )


@pytest.mark.parametrize(
    ("argv", "named"),
    [
        (["--idiom", "nope"], "--idiom: unknown idiom 'nope'"),
        (["--repeats", "0"], "--repeats must be at least 1"),
    ],
)
def test_bad_arguments_are_named(argv, named, tmp_path, capsys):
    with pytest.raises(SystemExit):
        bench.main(["--out", str(tmp_path), "--accelerator", "cpu", *argv])
    assert named in capsys.readouterr().err
