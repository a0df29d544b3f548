"""CPU tests: the training entry point checks its config before it builds anything, on every machine.

Bad `l2` values fail on a CPU too (the callback is built there, then not used), naming the argument;
unknown keys in `l2` and at the top level are refused with the accepted ones; a missing or
unreadable `ckpt_path` and a missing optional package stop the run with one line and exit status 1.
"""

from __future__ import annotations

import json

import pytest

import l2lightning.app.train as train
from tests.train_helpers import compose_train, run_entry_point, run_overrides

TINY = [
    "model.width=16",
    "model.depth=1",
    "data.batch_size=4",
    "data.train_batches=2",
    "data.val_batches=1",
    "trainer=cpu",
    "trainer.max_steps=2",
]

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["l2.prefetch=bogus"], r"^l2: `prefetch` must be one of \('off', 'default', 'auto', 'decoy'\)"),
        (["l2.warmup_steps=-1"], r"^l2: `warmup_steps` must be an int >= 1, got -1$"),
        (["l2.verify=maybe"], r"^l2: `verify` must be "),
        # the example: the unknown key is named first, with the accepted ones
        (
            ["+l2.prefetchh=auto", "l2.warmup_steps=-1"],
            r"^unknown key `l2.prefetchh`; L2GraphCallback accepts: warmup_steps, prefetch, backward_prefetch,",
        ),
        (["l2.prefetch=false"], r'YAML reads a bare `off` as false; write prefetch: "off"'),
        (
            ["l2._target_=lightning.pytorch.callbacks.ModelCheckpoint"],
            r"^l2._target_ must be l2lightning.L2GraphCallback",
        ),
        (["l2=verify", "l2.prefetch=bogus"], r"^l2: `prefetch` must be one of"),
    ],
)
def test_bad_l2_fails_on_cpu_naming_the_argument(overrides, message, tmp_path):
    with pytest.raises(train.ConfigError, match=message):
        run_overrides([*TINY, *overrides], tmp_path / "run")
    assert not (tmp_path / "run" / "result.json").exists()  # refused before anything ran


def test_good_l2_options_pass_on_cpu(tmp_path):
    # l2=graph is `prefetch: "off"` (the graph without prefetch), not the absence of the callback
    cfg = compose_train([*TINY, "l2=graph"])
    assert cfg.l2.prefetch == "off"
    assert train.build_callback(cfg).prefetch == "off"


def test_unknown_top_level_key_is_refused(tmp_path):
    with pytest.raises(train.ConfigError) as info:
        run_overrides([*TINY, "+trainr.max_steps=3"], tmp_path / "run")
    assert str(info.value) == ("unknown top-level key `trainr`; accepted: " + ", ".join(train.TOP_LEVEL_KEYS))


def test_callbacks_l2_entry_is_configured_under_l2(tmp_path):
    with pytest.raises(train.ConfigError, match=r"^callbacks.l2 must stay `\$\{l2\}`"):
        run_overrides([*TINY, "callbacks.l2={_target_:l2lightning.L2GraphCallback}"], tmp_path / "run")


def test_missing_or_unreadable_ckpt_path(tmp_path, monkeypatch):
    missing = tmp_path / "nonexistent.ckpt"
    with pytest.raises(train.ConfigError) as info:
        run_overrides([*TINY, f"ckpt_path={missing}"], tmp_path / "run")
    assert str(info.value) == f"ckpt_path: no such file: {missing}"
    with pytest.raises(train.ConfigError, match=r"^ckpt_path: not a file: "):
        train.check_ckpt_path(str(tmp_path))
    garbage = tmp_path / "garbage.ckpt"
    garbage.write_bytes(b"not a checkpoint")
    with pytest.raises(train.ConfigError, match=r"is not a checkpoint \(Lightning's torch.save writes a zip"):
        train.check_ckpt_path(str(garbage))
    # relative paths are relative to where the command was started
    monkeypatch.chdir(tmp_path)
    with pytest.raises(train.ConfigError, match="not a checkpoint"):
        train.check_ckpt_path("garbage.ckpt")


def test_bad_l2_exits_1_with_one_line(tmp_path):
    # the repro: exit 0 before; now one line on stderr, no traceback, a failed result.json
    run_dir = tmp_path / "run"
    proc = run_entry_point(
        ["trainer=cpu", "trainer.max_steps=3", "l2.prefetch=bogus", f"hydra.run.dir={run_dir}"], tmp_path
    )
    assert proc.returncode == 1, proc.stderr[-3000:]
    line = (
        "l2lightning: error: l2: `prefetch` must be one of ('off', 'default', 'auto', 'decoy') "
        "or a PrefetchPlan, got 'bogus'"
    )
    assert proc.stderr.strip() == line and proc.stdout.strip() == ""
    result = json.loads((run_dir / "result.json").read_text())
    assert result["status"] == "failed" and result["error"] == line.removeprefix("l2lightning: error: ")
    assert line in (run_dir / "train.log").read_text()


def test_missing_optional_package_prints_only_the_advice(tmp_path):
    # scikit-learn hidden behind a module that fails to import, as when it is not installed
    blocked = tmp_path / "blocked"
    blocked.mkdir()
    (blocked / "sklearn.py").write_text("raise ImportError(\"No module named 'sklearn'\")\n")
    run_dir = tmp_path / "run"
    proc = run_entry_point(
        [
            "experiment=small_batch_mlp",
            "model.width=16",
            "model.depth=1",
            "trainer=cpu",
            "trainer.max_steps=2",
            f"hydra.run.dir={run_dir}",
        ],
        tmp_path,
        blocked,
    )
    assert proc.returncode == 1, proc.stderr[-3000:]
    advice = (
        "l2lightning: error: the digits dataset needs scikit-learn: `pip install scikit-learn` "
        "(or `pip install 'l2lightning[data]'`)"
    )
    assert proc.stderr.strip().splitlines()[-1] == advice
    assert "Traceback" not in proc.stderr + proc.stdout
    assert [line for line in proc.stderr.splitlines() if "scikit-learn" in line] == [advice]
    # the traceback is kept in result.json for whoever needs it
    result = json.loads((run_dir / "result.json").read_text())
    assert result["status"] == "failed" and "Traceback" in result["traceback"]


@pytest.mark.parametrize(
    ("override", "message"),
    [
        # the repro: Lightning's own failure named neither the key nor the type
        ("trainer.max_steps=abc", "`trainer.max_steps` must be an int, got 'abc'"),
        ("trainer.max_steps=true", "`trainer.max_steps` must be an int, got True"),
        ("trainer.enable_progress_bar=maybe", "`trainer.enable_progress_bar` must be true or false or null"),
        ("trainer.limit_val_batches=few", "`trainer.limit_val_batches` must be a number or an int or null"),
        ("trainer.precision=bf17", "`trainer.precision` must be one of 64, 32, 16, 'transformer-engine'"),
        (
            "+trainer.max_step=3",
            "unknown key `trainer.max_step`; the Trainer accepts: accelerator, strategy,",
        ),
        ("float32_matmul_precision=foo", "`float32_matmul_precision` must be one of highest, high, medium"),
        ("validate=maybe", "`validate` must be true or false, got 'maybe'"),
        ("seed=abc", "`seed` must be an int, got 'abc'"),
    ],
)
def test_bad_trainer_and_top_level_values_name_the_key_and_the_type(override, message, tmp_path):
    with pytest.raises(train.ConfigError) as info:
        run_overrides([*TINY, override], tmp_path / "run")
    assert str(info.value).startswith(message), str(info.value)
    assert not (tmp_path / "run" / "result.json").exists()  # refused before anything ran


@pytest.mark.parametrize(
    "override",
    [
        "trainer.limit_val_batches=0.5",
        "trainer.devices=[0]",
        "trainer.deterministic=warn",
        "trainer.precision=32",
        "+trainer.max_time=00:00:10:00",
        "float32_matmul_precision=high",
    ],
)
def test_good_trainer_and_top_level_values_pass(override):
    train.check_config(compose_train([*TINY, override]))


def test_bad_trainer_value_fails_before_the_cpu_line(tmp_path):
    # before: "training eagerly on CPU" first, then "trainer: '<' not supported between ..."
    run_dir = tmp_path / "run"
    proc = run_entry_point(["trainer.max_steps=abc", f"hydra.run.dir={run_dir}"], tmp_path)
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert proc.stdout.strip() == ""
    assert proc.stderr.strip() == "l2lightning: error: `trainer.max_steps` must be an int, got 'abc'"
