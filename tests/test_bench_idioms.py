"""CPU: benchmarks/bench_idioms.py's --resume names what is wrong with the file it is given."""

from __future__ import annotations

import pytest

from tests.benchmark_scripts import load_benchmark


@pytest.mark.parametrize(
    ("content", "named"),
    [
        ("not json", r"--resume .*: not a readable idioms.json"),
        ('{"machine": {}}', r"--resume .*: no 'rows' list; pass an idioms.json that bench_idioms.py wrote"),
    ],
    ids=["unreadable", "no-rows"],
)
def test_resume_refuses_a_file_that_is_not_an_idioms_table(tmp_path, content, named):
    earlier = tmp_path / "idioms.json"
    earlier.write_text(content)
    with pytest.raises(SystemExit, match=named):
        load_benchmark("bench_idioms").main(
            ["--out", str(tmp_path / "out"), "--only", "autoencoder", "--resume", str(earlier)]
        )


def test_resume_keeps_the_earlier_rows_and_their_details(tmp_path):
    earlier = tmp_path / "idioms.json"
    earlier.write_text(
        '{"rows": [{"module": "autoencoder", "captured": true, "reason": "", "equal": true, '
        '"plain_ms": 2.0, "callback_ms": 1.0}], "machine": {"device": "x"}, '
        '"details": {"autoencoder": {"detail": null, "plain_again_ms": 1.5}}}'
    )
    kept = load_benchmark("bench_idioms")._load_resume(earlier, "cpu")
    assert kept["rows"][0]["extra"] == {"plain_again_ms": 1.5} and kept["rows"][0]["detail"] is None


def test_the_printed_table_gives_the_whole_fits_ratio_beside_the_per_step_speedup(capsys):
    row = {
        "module": "autoencoder",
        "captured": True,
        "reason": "",
        "equal": True,
        "plain_ms": 4.0,
        "callback_ms": 1.0,
        "extra": {"plain_again_ms": 3.5, "plain_fit_s": 0.9, "callback_fit_s": 0.8, "plain_again_fit_s": 0.2},
    }
    refused_at_setup = {**row, "module": "x", "captured": False, "extra": {"plain_again_fit_s": None}}
    load_benchmark("bench_idioms")._print_table([row, refused_at_setup])
    header, first, second, _ = capsys.readouterr().out.splitlines()
    assert header.split()[6:8] == ["speedup", "fit_x"]
    # 4.0 / 1.0 per step; 0.2 / 0.8 over the whole fit: faster steps, a slower fit
    assert first.split()[6:8] == ["4.00x", "0.25x"]
    # no second plain fit (a fit refused at set-up): no whole-fit ratio, the row's last cell the speedup
    assert second.split()[-1] == "4.00x"
