"""CPU tests of the benchmark report: floors, median CIs, comparisons, pre-registered criteria, plots, writers."""

from __future__ import annotations

import csv
import hashlib
import json
from pathlib import Path

import pytest

from l2lightning import floors as floors_module
from l2lightning.tools import plots, report

CRITERIA_FILE = Path(__file__).resolve().parent.parent / "benchmarks" / "criteria.yaml"


# ---------------------------------------------------------------------- floors
def test_step_bytes_hand_computed():
    # P = 1000 bytes of bf16 = 500 elements; fp32 states: S = 500 * 4 = 2000 bytes.
    phases = floors_module.step_bytes({"bfloat16": 1000}, "step", state_bytes_per_element=4)
    assert phases == {"forward": 1000, "backward": 2000, "optimizer": 3 * 1000 + 4 * 2000}
    assert sum(phases.values()) == 6 * 1000 + 4 * 2000 == 14000
    assert floors_module.step_bytes({"bfloat16": 1000}, "forward") == {"forward": 1000}
    assert floors_module.step_bytes({"bfloat16": 1000}, "forward_backward") == {
        "forward": 1000,
        "backward": 2000,
    }


def test_step_bytes_mixed_dtypes_and_torch_dtype_keys():
    import torch

    # 1000 B bf16 (500 elements) + 400 B fp32 (100 elements): P = 1400, N = 600, S = 2400.
    phases = floors_module.step_bytes({torch.bfloat16: 1000, "float32": 400}, "step")
    assert sum(phases.values()) == 6 * 1400 + 4 * 2400
    with pytest.raises(ValueError, match="unknown dtype"):
        floors_module.step_bytes({"bfloat17": 10})
    with pytest.raises(ValueError, match="`chain`"):
        floors_module.step_bytes({"bfloat16": 10}, "sideways")


def test_floors_hand_computed():
    f = floors_module.floors({"bfloat16": 1000}, kernel_count=100, copy_bw=1e9, empty_kernel_us=0.5)
    assert f.bytes_moved == 14000
    assert f.bytes_us == pytest.approx(14.0)  # 14000 B / 1e9 B/s
    assert f.launch_us == pytest.approx(50.0)  # 100 x 0.5 us
    assert f.larger == pytest.approx(50.0) and f.bound == "launch"
    assert f.ratio(150.0) == pytest.approx(3.0)
    assert f.phase_floors("optimizer", 20) == (pytest.approx(11.0), pytest.approx(10.0))


def test_floors_bandwidth_bound_and_d1536x40_example():
    # d1536 x 40 bf16 on the H200 ceilings: weights 40*1536*1536*2 B, AdamW states in bf16 (2 B/element).
    p = 40 * 1536 * 1536 * 2
    f = floors_module.floors(
        {"bfloat16": p}, kernel_count=None, copy_bw=4.28e12, empty_kernel_us=0.87, state_bytes_per_element=2
    )
    assert f.bytes_moved == 10 * p
    assert f.bytes_us == pytest.approx(10 * p / 4.28e12 * 1e6)
    assert f.launch_us is None and f.bound == "bandwidth" and f.larger == f.bytes_us
    with pytest.raises(ValueError, match="copy_bw"):
        floors_module.floors({"bfloat16": p}, 1, 0, 1.0)


def test_param_bytes_by_dtype():
    import torch

    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2).to(torch.bfloat16))
    assert floors_module.param_bytes_by_dtype(model) == {"float32": (16 + 4) * 4, "bfloat16": (8 + 2) * 2}


# ---------------------------------------------------------------------- medians
def test_median_ci_order_statistics():
    ci = report.median_ci(list(range(1, 11)))
    assert ci.median == 5.5 and (ci.lo, ci.hi) == (2.0, 9.0)
    assert ci.coverage == pytest.approx(1 - 2 * 11 / 1024)
    ci = report.median_ci([3.0, 1.0, 2.0, 5.0, 4.0, 6.0])
    assert (ci.lo, ci.hi) == (1.0, 6.0) and ci.coverage == pytest.approx(1 - 2 / 64)
    small = report.median_ci([1.0, 2.0, 3.0])
    assert (small.lo, small.hi) == (1.0, 3.0) and small.coverage < 0.95
    one = report.median_ci([7.0])
    assert (one.median, one.lo, one.hi) == (7.0, 7.0, 7.0)
    big = report.median_ci(list(range(100)))
    assert big.lo < big.median < big.hi and big.coverage >= 0.95
    with pytest.raises(ValueError):
        report.median_ci([])


# ---------------------------------------------------------------------- comparisons
def synthetic_rows() -> list[dict]:
    rows = []
    for width, depth, mib in ((1536, 40, 4.5), (2560, 15, 12.5)):
        for batch in (4, 16):
            base = {
                "width": width,
                "depth": depth,
                "batch": batch,
                "dtype": "bfloat16",
                "layer_mib": mib,
                "floor_bytes_us": 400.0,
                "floor_launch_us": 600.0,
                "floor_us": 600.0,
                "forced": False,
            }
            times = {
                "lightning_eager": 15000.0,
                "eager": 13500.0,
                "callback_off": 4400.0,
                "callback_auto": 4300.0,
                "callback_decoy": 4500.0,
                "graph": 4376.0,
                "graph_prefetch": 4349.0,
                "graph_decoy": 4450.0,
                "compile_ro": 6522.0,
                "compile_graph": 4093.0,
                "compile_graph_prefetch": 4080.0,
            }
            for variant, t in times.items():
                rows.append({**base, "chain": "step", "variant": variant, "median_us": t * (1 + batch / 100)})
            for variant, t in {
                "eager": 1500.0,
                "graph": 500.0,
                "graph_prefetch": 487.0,
                "graph_decoy": 520.0,
            }.items():
                rows.append(
                    {
                        **base,
                        "chain": "forward",
                        "variant": variant,
                        "median_us": t,
                        "floor_bytes_us": 40.0,
                        "floor_launch_us": 100.0,
                        "floor_us": 100.0,
                    }
                )
    return rows


def test_add_comparisons():
    rows = report.add_comparisons(synthetic_rows())
    get = {(r["width"], r["batch"], r["chain"], r["variant"]): r for r in rows}
    cb = get[(1536, 4, "step", "callback_auto")]
    assert cb["speedup_vs_lightning_eager"] == pytest.approx(15000 / 4300)
    assert cb["speedup_vs_baseline"] == cb["speedup_vs_lightning_eager"]
    assert cb["gain_vs_no_prefetch"] == pytest.approx(4400 / 4300 - 1)
    assert cb["ratio_to_floor"] == pytest.approx(4300 * 1.04 / 600)
    graph = get[(1536, 4, "step", "graph")]
    assert graph["speedup_vs_reduce_overhead"] == pytest.approx(6522 / 4376)
    assert graph["gain_vs_no_prefetch"] is None
    best = get[(1536, 4, "step", "compile_graph_prefetch")]
    assert best["vs_best_alternative"] == pytest.approx(4093 / 4080)
    assert best["best_alternative"] == "compile_graph"
    fwd = get[(2560, 16, "forward", "graph_prefetch")]
    assert fwd["baseline"] == "eager" and fwd["speedup_vs_baseline"] == pytest.approx(1500 / 487)
    assert fwd["speedup_vs_lightning_eager"] is None


def test_add_comparisons_with_failed_variant():
    rows = synthetic_rows()[:11]
    rows[0]["median_us"] = None  # lightning_eager failed
    rows[0]["error"] = "run: boom"
    report.add_comparisons(rows)
    assert all(r["speedup_vs_lightning_eager"] is None for r in rows)


# ---------------------------------------------------------------------- criteria
CRITERIA_YAML = """\
criteria:
  - id: fast-callback
    description: callback at least 3x Lightning eager at small batch
    metric: speedup_vs_lightning_eager
    op: ">="
    threshold: 3.0
    scope: {variant: callback_auto, chain: step, batch: {"<=": 16}}
  - id: prefetch-not-worse
    description: prefetch never worse than -1%
    metric: gain_vs_no_prefetch
    op: ">="
    threshold: -0.01
    scope: {variant: [callback_auto, graph_prefetch, compile_graph_prefetch]}
  - id: decoy-no-help
    description: the decoy does not help
    metric: gain_vs_no_prefetch
    op: "<="
    threshold: -0.02
    scope: {variant: [graph_decoy]}
  - id: big-batch
    description: nothing ran at batch 64
    metric: speedup_vs_graph
    op: ">"
    threshold: 1.0
    scope: {batch: 64}
"""


def test_load_criteria_hash_is_sha256_of_bytes(tmp_path):
    path = tmp_path / "criteria.yaml"
    path.write_text(CRITERIA_YAML)
    criteria, sha = report.load_criteria(path)
    assert sha == hashlib.sha256(path.read_bytes()).hexdigest() == report.criteria_sha256(path)
    assert [c.id for c in criteria] == ["fast-callback", "prefetch-not-worse", "decoy-no-help", "big-batch"]
    assert criteria[0].scope == {"variant": "callback_auto", "chain": "step", "batch": {"<=": 16}}
    # Stable: same bytes, same hash; one changed byte, another hash.
    assert report.load_criteria(path)[1] == sha
    path.write_text(CRITERIA_YAML.replace("3.0", "3.1"))
    assert report.load_criteria(path)[1] != sha


def test_evaluate_marks_pass_fail_and_no_data(tmp_path):
    path = tmp_path / "criteria.yaml"
    path.write_text(CRITERIA_YAML)
    criteria, _ = report.load_criteria(path)
    rows = report.add_comparisons(synthetic_rows())
    results = {r.criterion.id: r for r in report.evaluate(criteria, rows)}
    assert results["fast-callback"].status == "passed"
    assert len(results["fast-callback"].observations) == 4  # 2 models x batches 4 and 16
    assert results["prefetch-not-worse"].passed
    decoy = results["decoy-no-help"]
    assert decoy.status == "failed"  # graph_decoy loses 1.7% (step) and 3.8% (forward): one misses -2%
    assert decoy.worst == pytest.approx(max(o["value"] for o in decoy.observations))
    assert any(not o["passed"] for o in decoy.observations) and any(o["passed"] for o in decoy.observations)
    assert results["big-batch"].status == "no data"
    # Failed criteria are kept as results, with their observations.
    dumped = results["decoy-no-help"].to_dict()
    assert dumped["status"] == "failed" and dumped["observations"] and dumped["id"] == "decoy-no-help"
    assert str(results["decoy-no-help"]).startswith("[FAILED] decoy-no-help")


def test_evaluate_counts_errored_runs_as_failures(tmp_path):
    path = tmp_path / "criteria.yaml"
    path.write_text(CRITERIA_YAML)
    criteria, _ = report.load_criteria(path)
    rows = report.add_comparisons(synthetic_rows())
    for r in rows:
        if r["variant"] == "callback_auto":
            r.update(median_us=None, error="setup: ImportError: no L2GraphCallback")
    res = report.evaluate(criteria[:1], rows)[0]
    assert res.status == "failed" and res.observations[0]["error"].startswith("setup")


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("criteria:\n  - id: a\n    metric: speed\n    op: '>='\n    threshold: 1\n", "unknown metric"),
        ("criteria:\n  - id: a\n    metric: median_us\n    op: '=>'\n    threshold: 1\n", "`op`"),
        ("criteria:\n  - id: a\n    metric: median_us\n    op: '>='\n    threshold: fast\n", "`threshold`"),
        ("criteria:\n  - id: a\n    metric: median_us\n    op: '>='\n", "missing keys"),
        (
            "criteria:\n  - id: a\n    metric: median_us\n    op: '>='\n    threshold: 1\n    scope: {gpu: h200}\n",
            "unknown scope key",
        ),
        (
            "criteria:\n  - {id: a, metric: median_us, op: '>=', threshold: 1}\n  - {id: a, metric: median_us, op: '>=', threshold: 2}\n",
            "duplicate",
        ),
        ("just text\n", "criteria:"),
    ],
)
def test_load_criteria_rejects_bad_files(tmp_path, text, message):
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with pytest.raises(ValueError, match=message):
        report.load_criteria(path)


def test_repository_criteria_file_loads():
    criteria, sha = report.load_criteria(CRITERIA_FILE)
    assert len(criteria) >= 5 and len(sha) == 64
    ids = {c.id for c in criteria}
    assert "callback-4x-lightning-eager-small-batch" in ids
    assert "prefetch-never-worse-than-minus-1pct" in ids
    assert "whole-step-graph-beats-reduce-overhead" in ids
    # Every criterion can be evaluated against the rows the harness produces.
    results = report.evaluate(criteria, report.add_comparisons(synthetic_rows()))
    assert {r.status for r in results} <= {"passed", "failed", "no data"}


# ---------------------------------------------------------------------- plots and writers
def test_make_plots_writes_pngs(tmp_path):
    rows = report.add_comparisons(synthetic_rows())
    paths = plots.make_plots(
        {"results": rows, "environment": {"gpu": {"l2_bytes": 60 << 20}}}, tmp_path / "plots"
    )
    names = sorted(p.name for p in paths)
    assert names == ["prefetch_gain_vs_layer.png", "speedup.png", "time_vs_floors.png"]
    for p in paths:
        data = p.read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n"
        assert len(data) > 10_000


def test_make_plots_skips_plots_without_data(tmp_path):
    rows = report.add_comparisons([r for r in synthetic_rows() if r["variant"] in ("eager", "graph")])
    names = {p.name for p in plots.make_plots(rows, tmp_path)}
    assert "prefetch_gain_vs_layer.png" not in names and "speedup.png" in names


def test_write_csv_and_json(tmp_path):
    rows = report.add_comparisons(synthetic_rows())
    rows[0]["repeat_medians_us"] = [1.0, 2.0]
    path = report.write_csv(tmp_path / "r.csv", rows, ["config", "variant", "median_us", "repeat_medians_us"])
    with path.open() as fh:
        read = list(csv.DictReader(fh))
    assert len(read) == len(rows) and read[0]["variant"] == "lightning_eager"
    assert json.loads(read[0]["repeat_medians_us"]) == [1.0, 2.0]
    jpath = report.write_json(tmp_path / "a" / "r.json", {"results": rows, "path": tmp_path})
    assert json.loads(jpath.read_text())["results"][0]["variant"] == "lightning_eager"


def test_environment_info_has_versions_and_command():
    env = report.environment_info({"gpu_name": "NVIDIA H200"}, ["l2lightning", "bench", "--quick"])
    assert env["command"] == "l2lightning bench --quick"
    assert env["torch"] and env["lightning"] and env["python"]
    assert "cupy" in env and env["gpu"]["gpu_name"] == "NVIDIA H200"


# ---------------------------------------------------------------------- step report
def test_classify_bound():
    assert floors_module.classify_bound(100, 40, 60) == "launch"
    assert floors_module.classify_bound(100, 60, 40) == "bandwidth"
    assert floors_module.classify_bound(500, 60, 40) == "compute"
    assert floors_module.classify_bound(100, None, None) == "unknown"
    assert floors_module.classify_bound(100, 80, None) == "bandwidth"


def test_step_report_launch_bound():
    f = floors_module.floors({"bfloat16": 2_000_000}, kernel_count=600, copy_bw=4e12, empty_kernel_us=1.0)
    r = floors_module.StepReport(
        [
            floors_module.PhaseTime("forward", 200, 150),
            floors_module.PhaseTime("backward", 400, 300),
            floors_module.PhaseTime("optimizer", 150, 150),
        ],
        f,
        prefetch_gains={"Linear[1536x1536]:bfloat16": 0.027, "Linear[4096x4096]:bfloat16": -0.031},
        label="d1536x40 b16",
    )
    assert r.total_us == 750 and r.kernel_count == 600
    assert r.bound() == "launch" and r.dominant_phase().name == "backward"
    text = r.format()
    assert "Step report: d1536x40 b16 (750.0 us per step)" in text
    assert "launch-bound" in text and "dominant phase: backward (53% of the step)" in text
    assert "+2.7%" in text and "-3.1%" in text
    assert text.index("+2.7%") < text.index("-3.1%")
    d = r.to_dict()
    assert d["bound"] == "launch" and d["phases"][1]["bound"] == "launch"


def test_step_report_bandwidth_and_compute_bound():
    f = floors_module.floors({"bfloat16": 400_000_000}, kernel_count=100, copy_bw=4e12, empty_kernel_us=1.0)
    # 6P + 4S = 2.4e9 + 1.6e9... with fp32 states: S = 2e8 * 4 = 8e8 -> 2.4e9 + 3.2e9 = 5.6e9 B -> 1400 us.
    assert f.bytes_us == pytest.approx(1400.0)
    bw = floors_module.StepReport(
        [
            floors_module.PhaseTime("forward", 300),
            floors_module.PhaseTime("backward", 600),
            floors_module.PhaseTime("optimizer", 1100),
        ],
        f,
    )
    assert bw.bound() == "bandwidth" and "bandwidth-bound" in bw.format()
    slow = floors_module.StepReport([], f, step_time_us=10_000)
    assert slow.bound() == "compute" and "compute-bound" in slow.format()
    assert floors_module.StepReport([floors_module.PhaseTime("forward", 10)]).bound() == "unknown"
    with pytest.raises(ValueError, match="nothing to report"):
        floors_module.StepReport([])
    with pytest.raises(ValueError, match="negative"):
        floors_module.StepReport([floors_module.PhaseTime("forward", -1)])


def test_config_label_names_the_mlp_shape_or_the_family():
    assert report.config_label({"width": 1536, "depth": 40, "batch": 16}) == "d1536x40 b16"
    assert (
        report.config_label({"width": 1536, "depth": 40, "batch": 16, "chain": "forward"})
        == "d1536x40 b16 forward"
    )
    assert report.config_label({"family": "vit", "width": None, "depth": None, "batch": 8}) == "vit b8"
