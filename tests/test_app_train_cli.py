"""CPU tests of the training entry point: a real run as a subprocess (messages, train.log, progress
bar, honest result.json), every family in-process, the CPU fallback, failed runs, and the sweep
summary of a multirun."""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path

import pytest
from hydra.core.hydra_config import HydraConfig
from omegaconf import open_dict

import l2lightning.app.train as train
from l2lightning import _env
from l2lightning.app.models import FAMILIES
from tests.train_helpers import compose_train, run_entry_point

CPU_LINE = "l2lightning: no CUDA device ("
# sizes small enough for a 2-step CPU fit of each family, given as Hydra overrides
TINY = {
    "mlp_stack": [
        "model.width=32",
        "model.depth=2",
        "data.batch_size=4",
        "data.train_batches=4",
        "data.val_batches=1",
    ],
    "rl_policy": [
        "model.hidden=32",
        "model.depth=1",
        "data.batch_size=4",
        "data.steps_per_epoch=4",
        "data.env_backend=numpy",
    ],
    "recommender": [
        "model.num_tables=2",
        "model.num_embeddings=64",
        "model.embedding_dim=8",
        "model.bottom_mlp=[16]",
        "model.top_mlp=[32,16]",
        "data.batch_size=4",
        "data.train_batches=4",
        "data.val_batches=1",
    ],
    "conv_stack": [
        "model.channels=[4,8]",
        "data.image_size=16",
        "data.batch_size=2",
        "data.train_batches=4",
        "data.val_batches=1",
    ],
    "vit": [
        "model.image_size=32",
        "model.dim=32",
        "model.depth=1",
        "model.heads=2",
        "data.batch_size=2",
        "data.train_batches=4",
        "data.val_batches=1",
    ],
    "text_encoder": [
        "model.vocab_size=64",
        "model.seq_len=16",
        "model.d_model=32",
        "model.nhead=2",
        "model.num_layers=1",
        "model.dim_feedforward=64",
        "data.batch_size=2",
        "data.train_batches=4",
        "data.val_batches=1",
    ],
}
NO_CUDA = _env.cuda_unavailable_reason() is not None
TRAIN_METRIC = {
    "mlp_stack": "train/mse",
    "rl_policy": "train/value_explained_variance",
    "recommender": "train/acc",
    "conv_stack": "train/acc",
    "vit": "train/acc",
    "text_encoder": "train/acc",
}


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def read_result(directory: Path) -> dict:
    return json.loads((directory / "result.json").read_text())


@pytest.mark.skipif(not NO_CUDA, reason="checks the CPU fallback; a CUDA machine trains with the callback")
def test_module_entry_point_trains_eagerly_on_cpu(tmp_path):
    run_dir = tmp_path / "run"
    proc = run_entry_point([*TINY["mlp_stack"], "trainer.max_steps=2", f"hydra.run.dir={run_dir}"], tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    lines = [line for line in proc.stdout.splitlines() if line.startswith("l2lightning:")]
    assert len(lines) == 3, proc.stdout
    assert lines[0].startswith(CPU_LINE) and lines[0].endswith("training eagerly on CPU without the callback")
    # at the end: the run directory and a one-line summary
    assert lines[1] == f"l2lightning: run directory: {run_dir.resolve()}"
    assert lines[2].startswith("l2lightning: 2 steps on cpu; eager ") and "(only 1 step timed)" in lines[2]
    assert "not captured: l2 none (no CUDA: " in lines[2] and "final loss " in lines[2]
    assert "Epoch 0" in proc.stdout + proc.stderr  # the progress bar is on in the CPU fallback too
    result = read_result(run_dir)
    assert result["status"] == "ok"
    assert (result["model"], result["batch_size"], result["device"], result["steps"]) == (
        "mlp_stack",
        4,
        "cpu",
        2,
    )
    # what ran, and why: the callback was asked for (and validated) but not used
    assert result["l2"].startswith("none (no CUDA: ") and result["l2_requested"] == "sized"
    assert result["callback"] is False and result["captured"] is False
    assert result["reason"].startswith("no CUDA (") and "l2=sized was validated" in result["reason"]
    assert result["eager_step_ms"] > 0 and result["eager_steps_timed"] == 1
    assert result["graph_step_ms"] is None and result["fit_step_speedup"] is None
    assert result["replay_speedup"] is None and result["speedup"] is None
    assert "CUDA synchronised" not in result["timing"] and "perf_counter" in result["timing"]
    assert "only 1 step" in result["timing"]
    assert result["plans"] == [] and result["verify"] is None
    assert math.isfinite(result["final_loss"])
    assert result["config"]["trainer"]["accelerator"] == "cpu"  # trainer/cpu.yaml's settings were used
    assert result["overrides"][-1] == "trainer.max_steps=2"
    assert result["run_dir"] == str(run_dir.resolve())
    # the CSV log holds both steps' losses; the last one is the reported final loss
    with (run_dir / "csv" / "metrics.csv").open() as f:
        losses = [float(row["train/loss"]) for row in csv.DictReader(f) if row.get("train/loss")]
    assert len(losses) == 2 and losses[-1] == pytest.approx(result["final_loss"])
    # Hydra's train.log has the entry point's messages, Lightning's lines and the summary
    log = (run_dir / "train.log").read_text()
    for line in lines:
        assert line in log
    assert "`Trainer.fit` stopped: `max_steps=2` reached." in log
    assert not (run_dir / "checkpoints").exists()  # trainer/cpu.yaml: checkpoints off


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_every_family_fits_two_steps_through_the_entry_point(family, tmp_path, capsys):
    overrides = [f"model={family}", *TINY[family], "trainer=cpu", "trainer.max_steps=2", "l2=none"]
    result = train.run(compose_train(overrides), output_dir=tmp_path, overrides=overrides)
    assert result == read_result(tmp_path)
    model_cls, _ = FAMILIES[family]
    assert (
        result["model"] == family and result["model_target"] == f"l2lightning.app.models.{model_cls.__name__}"
    )
    assert result["steps"] == 2 and result["device"] == "cpu" and result["l2"] == "none (l2=none)"
    assert result["reason"].startswith("l2=none: no L2GraphCallback")
    assert math.isfinite(result["final_loss"]) and result["final_loss"] == result["metrics"]["train/loss"]
    assert math.isfinite(result["metrics"][TRAIN_METRIC[family]])
    assert result["eager_step_ms"] > 0 and result["timing"].startswith("Trainer.fit wall time per step")
    assert result["batch_size"] == int(
        next(o for o in TINY[family] if o.startswith("data.batch_size=")).split("=")[1]
    )
    if family == "rl_policy":
        assert result["val_metrics"] is None  # no validation data for RL
    else:
        assert "val/loss" in result["val_metrics"]
    assert CPU_LINE not in capsys.readouterr().out  # trainer=cpu l2=none: nothing to fall back from


def test_experiment_run_records_its_choices(tmp_path):
    overrides = [
        "experiment=small_batch_mlp",
        "trainer=cpu",
        "model.width=32",
        "model.depth=1",
        "trainer.max_steps=2",
        "l2=none",
    ]
    result = train.run(compose_train(overrides), output_dir=tmp_path, overrides=overrides)
    assert result["experiment"] == "small_batch_mlp" and result["model"] == "mlp_stack"
    assert result["config"]["data"]["_target_"] == "l2lightning.app.models.DigitsData"
    assert "train/acc" in result["metrics"] and "val/acc" in result["val_metrics"]


def test_cpu_fallback_forces_cpu_settings_and_keeps_command_line(monkeypatch):
    monkeypatch.setattr(_env, "cuda_unavailable_reason", lambda: "no GPU here")
    cfg = compose_train(["trainer=gpu", "l2=verify", "trainer.max_steps=5", "trainer.accelerator=gpu"])
    message = train.cpu_fallback(
        cfg, ["trainer=gpu", "l2=verify", "trainer.max_steps=5", "trainer.accelerator=gpu"]
    )
    assert (
        message == "l2lightning: no CUDA device (no GPU here); training eagerly on CPU without the callback"
    )
    assert cfg.l2.verify == "capture"  # still there: run() validates it, then does not use it
    assert cfg.trainer.accelerator == "cpu"  # forced even though the command line said gpu
    assert cfg.trainer.max_steps == 5  # the command line's value survives
    assert cfg.trainer.log_every_n_steps == 1 and cfg.trainer.enable_checkpointing is False  # from cpu.yaml
    assert cfg.trainer.enable_progress_bar is True  # feedback on the CPU too
    assert cfg.trainer.deterministic is False  # l2=verify's setting belongs to the GPU run


def test_cpu_fallback_changes_nothing_with_cuda_or_on_a_cpu_run(monkeypatch):
    monkeypatch.setattr(_env, "cuda_unavailable_reason", lambda: None)
    cfg = compose_train([])
    assert train.cpu_fallback(cfg, []) is None
    assert cfg.trainer.accelerator == "gpu" and cfg.l2 is not None
    monkeypatch.setattr(_env, "cuda_unavailable_reason", lambda: "no GPU here")
    cfg = compose_train(["trainer=cpu", "l2=none"])
    assert train.cpu_fallback(cfg, []) is None
    cfg = compose_train(["trainer=gpu", "l2=none"])
    assert train.cpu_fallback(cfg, []) == "l2lightning: no CUDA device (no GPU here); training eagerly on CPU"


def _with_hydra_run_dir(cfg, run_dir):
    with open_dict(cfg):
        cfg.hydra.runtime.output_dir = str(run_dir)
    HydraConfig.instance().set_config(cfg)


def test_failed_run_writes_a_failed_result(tmp_path, caplog):
    # a bad config value: one logged line, a failed result.json, the process exits 1 at the end
    cfg = compose_train(
        [*TINY["mlp_stack"], "trainer=cpu", "model.dtype=float64", f"hydra.run.dir={tmp_path}"]
    )
    _with_hydra_run_dir(cfg, tmp_path)
    train._FAILED.clear()
    try:
        failed = train._run_and_record(cfg)
    finally:
        HydraConfig.instance().cfg = None
    assert failed["status"] == "failed" and failed["error"].startswith("model: `dtype` must be one of")
    assert train._FAILED == [failed["error"]]
    train._FAILED.clear()
    assert [r.getMessage() for r in caplog.records if r.levelname == "ERROR"] == [
        f"l2lightning: error: {failed['error']}"
    ]
    result = read_result(tmp_path)
    assert result["status"] == "failed" and result["reason"] == failed["error"]
    assert "model.dtype=float64" in result["overrides"]


def test_unexpected_error_keeps_its_traceback(tmp_path, monkeypatch):
    def broken(cfg):
        raise RuntimeError("a bug")

    monkeypatch.setattr(train, "run", broken)
    cfg = compose_train([f"hydra.run.dir={tmp_path}"])
    _with_hydra_run_dir(cfg, tmp_path)
    try:
        with pytest.raises(RuntimeError, match="a bug"):
            train._run_and_record(cfg)
    finally:
        HydraConfig.instance().cfg = None
    result = read_result(tmp_path)
    assert result["error"] == "RuntimeError: a bug" and "Traceback" in result["traceback"]
    assert train._FAILED == []


def test_write_sweep_summary(tmp_path):
    rows = [
        {
            "status": "ok",
            "job_num": 1,
            "model": "vit",
            "batch_size": 8,
            "captured": True,
            "reason": "captured at step 3",
            "fit_step_speedup": 3.14159,
            "replay_speedup": 10.5,
            "eager_step_ms": 10.0,
            "graph_step_ms": 3.18,
            "verify": "a | b",
            "overrides": ["model=vit"],
        },
        {
            "status": "ok",
            "job_num": 0,
            "model": "mlp_stack",
            "batch_size": 4,
            "captured": False,
            "reason": "no CUDA (x): l2=sized was validated (L2GraphCallback built) but not used",
            "overrides": [],
        },
        {"status": "failed", "job_num": 2, "error": "boom", "overrides": ["model=x"]},
    ]
    for row in rows:
        (tmp_path / str(row["job_num"])).mkdir()
        (tmp_path / str(row["job_num"]) / "result.json").write_text(json.dumps(row))
    csv_path, md_path = train.write_sweep_summary(tmp_path)
    with csv_path.open() as f:
        table = list(csv.DictReader(f))
    assert [r["job"] for r in table] == ["0", "1", "2"]
    assert list(table[0]) == list(train.SUMMARY_COLUMNS)
    assert (table[1]["model"], table[1]["fit_step_speedup"], table[1]["captured"]) == ("vit", "3.142", "yes")
    assert table[1]["replay_speedup"] == "10.5"
    # the reason column: what ran and why, the error for a failed job
    assert [r["reason"] for r in table] == [rows[1]["reason"], "captured at step 3", "boom"]
    assert table[2]["status"] == "failed"
    md = md_path.read_text().splitlines()
    assert md[0] == "# Sweep summary: 3 runs"
    assert "fit_step_speedup: Trainer.fit wall-clock step time" in md[2]
    assert md[4].startswith("| job | status | model |") and len(md) == 9
    assert "a \\| b" in md[7]


def test_multirun_writes_results_and_a_summary(tmp_path):
    sweep_dir = tmp_path / "sweep"
    proc = run_entry_point(
        [
            "-m",
            *TINY["mlp_stack"][:2],
            "data.batch_size=2,4",
            "data.train_batches=2",
            "data.val_batches=1",
            "trainer=cpu",
            "trainer.max_steps=2",
            f"hydra.sweep.dir={sweep_dir}",
        ],
        tmp_path,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"l2lightning: sweep summary: {sweep_dir / 'summary.md'} (and summary.csv)" in proc.stdout
    results = [read_result(sweep_dir / str(job)) for job in (0, 1)]
    assert [r["batch_size"] for r in results] == [2, 4] and [r["job_num"] for r in results] == [0, 1]
    with (sweep_dir / "summary.csv").open() as f:
        table = list(csv.DictReader(f))
    assert [(row["job"], row["model"], row["batch_size"], row["status"]) for row in table] == [
        ("0", "mlp_stack", "2", "ok"),
        ("1", "mlp_stack", "4", "ok"),
    ]
    assert float(table[1]["final_loss"]) == pytest.approx(results[1]["final_loss"], rel=1e-3)
    assert all(row["reason"] == result["reason"] and row["reason"] for row, result in zip(table, results))
    md = (sweep_dir / "summary.md").read_text()
    assert md.startswith("# Sweep summary: 2 runs") and md.count("| mlp_stack |") == 2


def test_help_says_what_the_app_is(tmp_path):
    proc = run_entry_point(["--help"], tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.startswith("l2lightning-train: train a model family with PyTorch Lightning")
    assert "l2: autotune, default, graph, none, sized, verify" in proc.stdout
    assert "callbacks: default, l2, lr_monitor, model_checkpoint" in proc.stdout
    assert "logger: csv, tensorboard" in proc.stdout


def help_examples(text: str) -> list[list[str]]:
    """The example command lines `--help` prints (`  l2lightning-train ARGS`), as argument lists."""
    import shlex

    prefix = "l2lightning-train "
    return [shlex.split(line.strip())[1:] for line in text.splitlines() if line.strip().startswith(prefix)]


@pytest.mark.skipif(not NO_CUDA, reason="runs the examples on the CPU default config")
def test_every_help_example_runs_on_the_cpu_default_config(tmp_path):
    # the repro: the early-stopping example failed with a 41-line traceback on the CPU
    proc = run_entry_point(["--help"], tmp_path)
    examples = help_examples(proc.stdout)
    assert len(examples) == 5 and any("-m" in args for args in examples), proc.stdout
    for i, args in enumerate(examples):
        where = "hydra.sweep.dir" if "-m" in args else "hydra.run.dir"
        run = run_entry_point([*args, f"{where}={tmp_path / str(i)}"], tmp_path)
        errors = [line for line in run.stderr.splitlines() if line.startswith("l2lightning: error: ")]
        assert "Traceback" not in run.stdout + run.stderr, (args, run.stderr[-3000:])
        if run.returncode == 0:
            assert not errors and "l2lightning: run directory: " in run.stdout, (args, run.stdout[-2000:])
        else:
            # an example with a placeholder to fill in says what is wrong with it, in one line
            assert run.returncode == 1 and len(errors) == 1, (args, run.stderr[-3000:])
            assert errors[0].startswith("l2lightning: error: ckpt_path: no such file: "), errors
    assert sum("ckpt_path=" in " ".join(args) for args in examples) == 1


def test_a_configured_callback_that_fails_in_the_fit_is_one_line(tmp_path):
    # EarlyStopping on val/loss in a fit that ends before its first validation
    run_dir = tmp_path / "run"
    early_stop = "+callbacks.early_stop={_target_:lightning.pytorch.callbacks.EarlyStopping,monitor:val/loss}"
    proc = run_entry_point(
        [*TINY["mlp_stack"], "data.train_batches=8", "trainer=cpu", "trainer.max_steps=2", early_stop]
        + [f"hydra.run.dir={run_dir}"],
        tmp_path,
    )
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    (line,) = [line for line in proc.stderr.splitlines() if line.startswith("l2lightning:")]
    assert line.startswith(
        "l2lightning: error: callbacks.early_stop (EarlyStopping): Early stopping conditioned on metric "
        "`val/loss` which is not available."
    )
    assert line.endswith(
        "(no validation had run by step 2: it runs at the end of each epoch of the "
        "training data, or every trainer.val_check_interval batches)"
    )
    result = read_result(run_dir)
    assert result["status"] == "failed" and "Traceback" in result["traceback"]


def test_an_error_outside_the_configured_callbacks_keeps_its_traceback(tmp_path, monkeypatch):
    import lightning.pytorch as pl

    def broken_fit(self, *args, **kwargs):
        raise RuntimeError("a bug, not a config value")

    monkeypatch.setattr(pl.Trainer, "fit", broken_fit)
    with pytest.raises(RuntimeError, match="a bug, not a config value"):
        train.run(compose_train([*TINY["mlp_stack"], "trainer=cpu"]), output_dir=tmp_path / "run")
