"""CPU: benchmarks/host_floor_emulated.py runs its three fits and writes what it says (not its numbers)."""

from __future__ import annotations

import json

import pytest

from tests.benchmark_scripts import load_benchmark


def test_the_emulated_floor_writes_its_medians_and_rounds(tmp_path, monkeypatch):
    # the emulator it installs (and its replay that runs nothing) is undone after the test
    assert (
        load_benchmark("host_floor_emulated").main(
            ["--out", str(tmp_path), "--rounds", "2", "--steps", "5"], monkeypatch.setattr
        )
        == 0
    )
    result = json.loads((tmp_path / "host_floor_emulated.json").read_text())
    names = {"lightning_bare_ms", "plain_floor_ms", "callback_floor_ms"}
    assert set(result["medians_ms"]) == set(result["rounds_ms"]) == names
    assert all(len(v) == 2 and all(t > 0 for t in v) for v in result["rounds_ms"].values())
    medians = result["medians_ms"]
    assert (
        result["callback_floor_minus_bare_ms"] == medians["callback_floor_ms"] - medians["lightning_bare_ms"]
    )
    assert result["command"] and result["machine"]["torch"]


@pytest.mark.parametrize("argv", [["--rounds", "0"], ["--steps", "0"]])
def test_the_emulated_floor_names_a_bad_count(argv, tmp_path, capsys):
    with pytest.raises(SystemExit):
        load_benchmark("host_floor_emulated").main(["--out", str(tmp_path), *argv])
    assert "--rounds and --steps must be at least 1" in capsys.readouterr().err
