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
