"""CPU smoke test of benchmarks/bench_host_overhead.py: the plumbing, not the numbers."""

from __future__ import annotations

import csv
import json
import tempfile
from pathlib import Path

import pytest
import torch

from tests.benchmark_scripts import load_benchmark


def _load():
    return load_benchmark("bench_host_overhead")


def test_smoke_writes_csv_json_profile_and_plot(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    bho = _load()
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))  # where the fits' logs go meanwhile
    code = bho.main(
        ["--out", str(tmp_path), "--smoke", "--families", "mlp_stack,rl_policy", "--batches", "4,16"]
    )
    assert code == 0
    # the fits' log folder is gone (it was left in /tmp before); torch's inductor cache folder may be
    # made there too, by the first use of torch.compile's machinery in this process (run alone)
    assert [p for p in scratch.iterdir() if not p.name.startswith("torchinductor_")] == []

    with (tmp_path / "host_overhead.csv").open() as fh:
        rows = list(csv.reader(fh))
    assert tuple(rows[0]) == (
        "family",
        "batch",
        "lightning_eager_ms",
        "callback_step_ms",
        "replay_ms",
        "floor_ms",
        "lightning_bare_ms",
        "raw_graph_loop_ms",
        "compile_ro_ms",
    )
    body = [dict(zip(rows[0], r)) for r in rows[1:]]
    assert {(r["family"], r["batch"]) for r in body} == {
        (f, b) for f in ("mlp_stack", "rl_policy") for b in ("4", "16")
    }
    for r in body:
        assert float(r["lightning_eager_ms"]) > 0
        assert float(r["callback_step_ms"]) > 0
        assert float(r["floor_ms"]) > 0
        assert float(r["lightning_bare_ms"]) > 0
        # CUDA-only variants stay empty on the CPU
        assert r["replay_ms"] == r["raw_graph_loop_ms"] == r["compile_ro_ms"] == ""

    result = json.loads((tmp_path / "host_overhead.json").read_text())
    assert result["machine"]["command"]
    assert result["machine"]["torch"] and result["machine"]["lightning"]
    assert {"replay_ms", "raw_graph_loop_ms", "compile_ro_ms"} <= set(result["empty_columns_why"])
    assert result["settings"]["progress_bar_refresh_rate"] == {"mlp_stack": 20, "rl_policy": 20}
    assert not result["errors"]
    # Lightning's loop alone (a step that does nothing), in the CSV's rows and in every round
    assert all(row["lightning_bare_ms"] > 0 for row in result["rows"])
    assert all(run["lightning_bare_ms"] > 0 for run in result["runs"])
    cost = result["log_cost"]["median"]
    for variant in ("plain", "callback"):
        assert cost[f"{variant}_step_ms_0_logs"] > 0 and cost[f"{variant}_step_ms_4_logs"] > 0
        assert cost[f"{variant}_ms_per_log"] is not None

    profile = json.loads((tmp_path / "host_profile.json").read_text())
    assert {(p["family"], p["batch"]) for p in profile["profiles"]} == {
        (f, b) for f in ("mlp_stack", "rl_policy") for b in (4, 16)
    }
    for p in profile["profiles"]:
        buckets = p["buckets_ms_per_step"]
        assert set(buckets) == set(bho.BUCKETS)
        assert sum(buckets.values()) > 0
        assert buckets["lightning_loop"] > 0
    floor = profile["floor_profile"]
    assert floor["callback_floor"]["profiled_steps"] > 0 and floor["bare"]["profiled_steps"] > 0
    assert set(floor["bare"]["buckets_ms_per_step"]) == set(bho.BUCKETS)
    assert (tmp_path / "host_overhead.png").stat().st_size > 0


@pytest.mark.usefixtures("emulated_cuda_graphs")
def test_the_floor_profile_names_what_the_callbacks_replays_add_to_the_bare_loop() -> None:
    """On the graph emulator the floor's fit is captured and replayed: the functions whose own time
    differs most from the bare fit's include the callback's replay path, absent from the bare fit,
    and the list is ordered by the size of the difference."""
    bho = _load()
    args = bho.parse_args(["--out", "unused", "--smoke", "--profile-steps", "30"])
    args.accelerator = "cpu"
    floor = bho.profile_floor(args, top=200)
    assert floor["callback_floor"]["captured"] is True, floor["callback_floor"]["capture_reason"]
    differences = floor["largest_differences"]
    sizes = [abs(row["difference_ms"]) for row in differences]
    assert sizes == sorted(sizes, reverse=True)
    (replay,) = [
        row
        for row in differences
        if "step_dispatch.py:" in row["function"] and row["function"].endswith("(_replay_step)")
    ]
    assert replay["bare_ms"] == 0.0 and replay["difference_ms"] == replay["callback_floor_ms"] > 0
    # the StepTimer both fits carry is in both
    timer = [row for row in differences if "step_timer.py" in row["function"]]
    assert timer and all(row["bare_ms"] > 0 and row["callback_floor_ms"] > 0 for row in timer)


def test_log_cost_pairs_alternate_and_give_the_median_of_the_pairs(tmp_path: Path, monkeypatch) -> None:
    bho = _load()
    calls = []
    step_ms = {(False, 0): 1.0, (False, 4): 3.0, (True, 0): 0.5, (True, 4): 0.7}

    def fake_fit_floor(args, logs=0, with_callback=True):
        calls.append((with_callback, logs))
        return step_ms[with_callback, logs] + 0.01 * len(calls)  # a host that drifts fit by fit

    monkeypatch.setattr(bho, "fit_floor", fake_fit_floor)
    args = bho.parse_args(["--out", str(tmp_path), "--log-cost-pairs", "3"])
    cost = bho.log_cost(args)
    assert calls[:6] == [(False, 0), (False, 4), (False, 4), (False, 0), (False, 0), (False, 4)]
    assert len(cost["plain_ms_per_log_pairs"]) == len(cost["callback_ms_per_log_pairs"]) == 3
    # adjacent fits: the drift changes each pair's difference by 0.01 at most, in both directions
    assert all(abs(d - 0.5) <= 0.01 / 4 + 1e-9 for d in cost["plain_ms_per_log_pairs"])
    assert abs(cost["callback_ms_per_log"] - 0.05) <= 0.01 / 4 + 1e-9
    with pytest.raises(SystemExit):
        bho.parse_args(["--out", str(tmp_path), "--log-cost-pairs", "0"])


def test_classify_buckets() -> None:
    bho = _load()
    assert bho.classify(("~", 0, "<method 'item' of 'torch._C.TensorBase' objects>")) == "host_sync"
    assert bho.classify(("/x/site-packages/torchmetrics/metric.py", 1, "update")) == "metric_updates"
    assert bho.classify(("/x/site-packages/tqdm/std.py", 1, "update")) == "progress_bar"
    assert (
        bho.classify(("/w/l2lightning/callback/graph_callback.py", 1, "on_train_batch_start"))
        == "callback_replay"
    )
    assert bho.classify(("/w/l2lightning/app/models/rl_policy.py", 1, "training_step")) is None
    assert bho.classify(("/x/site-packages/torch/nn/modules/linear.py", 1, "forward")) is None


def test_bare_fit_runs_lightning_loop_without_any_step_work(monkeypatch) -> None:
    """fit_bare times every step of its fit, and the module's step neither computes nor steps."""
    bho = _load()
    args = bho.parse_args(["--out", "unused", "--smoke", "--steps", "4"])
    args.accelerator = "cpu"
    module = bho._bare_module("cpu")
    weight = module.net.weight.detach().clone()
    made = []
    monkeypatch.setattr(bho, "_bare_module", lambda device: made.append(module) or module)
    ms = bho.fit_bare(args)
    assert made == [module]
    assert ms is not None and ms > 0
    assert module.automatic_optimization is False
    assert module.trainer.fit_loop.epoch_loop.batch_progress.total.completed == bho.SKIP + args.steps + 1
    assert torch.equal(module.net.weight, weight)  # never stepped


def test_automatic_fit_goes_through_lightnings_automatic_path_without_updating(monkeypatch) -> None:
    """fit_automatic's module is on the automatic path: Lightning's default optimizer_step runs its
    optimizer's step, the closure and its hooks at every step (on_before_optimizer_step and
    on_before_zero_grad fire, the loss is cloned into Lightning's result), and no parameter moves."""
    from lightning.pytorch import Callback

    bho = _load()
    args = bho.parse_args(["--out", "unused", "--smoke", "--steps", "4"])
    args.accelerator = "cpu"
    module = bho._automatic_module("cpu")
    weight = module.net.weight.detach().clone()
    calls: dict[str, int] = {"on_before_optimizer_step": 0, "on_before_zero_grad": 0, "steps": 0}

    class Count(Callback):
        def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
            calls["on_before_optimizer_step"] += 1

        def on_before_zero_grad(self, trainer, pl_module, optimizer) -> None:
            calls["on_before_zero_grad"] += 1

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            # Lightning's ClosureResult: a clone of the loss, not the module's buffer
            assert outputs["loss"] is not pl_module.loss_value
            calls["steps"] += 1

    fit = bho._fit_on_floor_loader
    monkeypatch.setattr(bho, "_fit_on_floor_loader", lambda a, m, cbs: fit(a, m, [*cbs, Count()]))
    monkeypatch.setattr(bho, "_automatic_module", lambda device: module)
    ms = bho.fit_automatic(args)
    total = bho.SKIP + args.steps + 1
    assert ms is not None and ms > 0
    assert module.automatic_optimization is True
    assert calls == {"on_before_optimizer_step": total, "on_before_zero_grad": total, "steps": total}
    assert module.trainer.global_step == total  # each step counted as an optimizer step
    assert torch.equal(module.net.weight, weight)  # never updated
