"""CPU tests of the results plot and the README's results table: both come from the committed CSVs."""

from __future__ import annotations

from pathlib import Path

from l2lightning.tools import results_plot

REPO = Path(__file__).resolve().parents[1]


def test_rows_come_from_the_committed_csvs():
    rows = results_plot.fit_step_rows()
    families = list(dict.fromkeys(r.family for r in rows))
    assert families == ["mlp_stack", "rl_policy", "recommender", "conv_stack", "vit", "text_encoder"]
    rl4 = next(r for r in rows if (r.family, r.batch) == ("rl_policy", 4))
    # host_overhead.csv: rl_policy,4,5.0328,0.6984,0.2513,0.3962,0.1868,0.2472,3.0232
    assert (rl4.eager_ms, rl4.callback_ms, rl4.compile_ro_ms) == (5.0328, 0.6984, 3.0232)
    vit64 = next(r for r in rows if (r.family, r.batch) == ("vit", 64))
    assert vit64.compile_ro_ms is None and vit64.source == "harness_families/results.csv"
    assert all(r.eager_ms > 0 and r.callback_ms > 0 for r in rows)


def test_the_readme_table_is_the_csvs_table():
    table = results_plot.markdown_table(results_plot.fit_step_rows())
    assert table in (REPO / "README.md").read_text()


def test_the_plot_is_written(tmp_path):
    path = results_plot.plot_fit_steps(results_plot.fit_step_rows(), tmp_path / "plot.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (REPO / "docs" / "img" / "fit_step_times.png").is_file()  # the committed one the README shows
