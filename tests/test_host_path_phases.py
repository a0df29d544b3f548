"""CPU: benchmarks/wall_phases.py splits time into exclusive phases and puts back what it wrapped, and
benchmarks/host_path_phases.py splits the emulated floor's replayed steps into them (not its numbers)."""

from __future__ import annotations

import json
import time

import pytest

from tests.benchmark_scripts import load_benchmark


class _Owner:
    def outer(self):
        time.sleep(0.002)
        return self.inner() + 1

    def inner(self):
        time.sleep(0.02)
        return 1

    @staticmethod
    def static(x):
        return x * 2


def test_phases_are_exclusive_of_the_phases_inside_them_and_are_undone():
    wall = load_benchmark("wall_phases")
    phases, undo = wall.WallPhases(), []
    outer, static = _Owner.outer, vars(_Owner)["static"]
    phases.wrap(_Owner, "outer", "outer", undo)
    phases.wrap(_Owner, "inner", "inner", undo)
    phases.wrap(_Owner, "static", "static", undo)
    _Owner().outer()  # no window open: nothing recorded
    assert phases.windows == []
    phases.open_window()
    started = time.perf_counter()
    assert _Owner().outer() == 2 and _Owner().static(3) == 6 and _Owner.static(4) == 8
    total = time.perf_counter() - started
    phases.close_window()
    window = phases.windows[0]
    assert 0.02 <= window["inner"] and 0.002 <= window["outer"] < window["inner"]
    assert sum(window.values()) <= total and phases.calls == [4]
    wall.undo_all(undo)
    assert _Owner.outer is outer and vars(_Owner)["static"] is static
    assert wall.wrapper_cost_s(calls=200) >= 0.0


def test_a_call_inside_its_outside_phase_stays_that_phases_time():
    """The CUDA event a step timer records is the timer's time; one recorded elsewhere is a phase."""
    wall = load_benchmark("wall_phases")
    phases, undo = wall.WallPhases(), []
    phases.wrap(_Owner, "inner", "inner", undo, outside="outer")
    phases.wrap(_Owner, "outer", "outer", undo)
    phases.open_window()
    _Owner().outer()  # inner runs inside outer: outer's own time
    phases.close_window()
    phases.open_window()
    _Owner().inner()  # inner on its own: a phase
    phases.close_window()
    wall.undo_all(undo)
    assert set(phases.windows[0]) == {"outer"} and phases.windows[0]["outer"] >= 0.02
    assert set(phases.windows[1]) == {"inner"} and phases.windows[1]["inner"] >= 0.02


def test_the_emulated_floor_is_split_into_the_callbacks_phases(tmp_path, monkeypatch):
    from l2lightning.callback.step_decision import StepDecision

    decide = StepDecision.decide
    script = load_benchmark("host_path_phases")
    assert script.main(["--out", str(tmp_path), "--rounds", "1", "--steps", "30"], monkeypatch.setattr) == 0
    assert StepDecision.decide is decide  # every wrapper undone
    result = json.loads((tmp_path / "host_path_phases_cpu.json").read_text())
    medians = result["medians"]
    assert medians["lightning_automatic_ms"] > 0 and medians["lightning_bare_ms"] > 0
    # the callback's step less the wrappers is Lightning's automatic optimization and the callback's own
    assert result["lightning_automatic_minus_bare_ms"] + result[
        "callback_step_minus_wrappers_minus_automatic_ms"
    ] == pytest.approx(result["callback_step_minus_wrappers_minus_bare_ms"])
    phases = medians["phases_ms"]
    assert {"decide", "launch_replay", "batch_copy", "replay_closure", script.STEP_TIMER, script.REST} <= set(
        phases
    )
    assert all(v >= 0 for k, v in phases.items() if k != script.REST)
    (round_,) = result["rounds"]
    assert round_["replayed_steps"] > 0 and round_["lightning_bare_ms"] > 0
    assert result["medians"]["wrapped_calls_per_step"] >= 8 and result["wrappers_ms_per_step"] >= 0
    assert result["command"].startswith("python3 benchmarks/host_path_phases.py")


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--rounds", "0"], "--rounds and --steps must be at least 1"),
        (["--steps", "0"], "--rounds and --steps must be at least 1"),
        (["--logs", "-1"], "--logs must be 0 or more, got -1"),
    ],
)
def test_host_path_phases_names_a_bad_count(argv, message, tmp_path, capsys):
    with pytest.raises(SystemExit):
        load_benchmark("host_path_phases").main(["--out", str(tmp_path), *argv])
    assert message in capsys.readouterr().err


def test_logged_values_are_costed_per_value(tmp_path, monkeypatch):
    script = load_benchmark("host_path_phases")
    argv = ["--out", str(tmp_path), "--rounds", "1", "--steps", "30", "--logs", "2"]
    assert script.main(argv, monkeypatch.setattr) == 0
    result = json.loads((tmp_path / "host_path_phases_cpu.json").read_text())
    per_log = result["per_log"]
    assert per_log["logs"] == 2 and "log_reissue" in per_log["phases_ms"]
    (round_,) = result["rounds"]
    # the logging fit re-issued its logs at every replay: its re-issue phase is longer than the plain fit's
    assert round_["with_logs"]["phases_ms"]["log_reissue"] > round_["phases_ms"].get("log_reissue", 0.0)


def test_host_path_phases_on_cuda_without_a_device_says_so(tmp_path, capsys):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a CUDA device: the refusal is for one without")
    with pytest.raises(SystemExit):
        load_benchmark("host_path_phases").main(["--out", str(tmp_path), "--device", "cuda"])
    assert "--device cuda: this torch sees no CUDA device" in capsys.readouterr().err


def test_split_lightning_times_lightnings_automatic_path_apart(tmp_path, monkeypatch):
    from lightning.pytorch.core.optimizer import LightningOptimizer

    step = LightningOptimizer.step
    script = load_benchmark("host_path_phases")
    argv = ["--out", str(tmp_path), "--rounds", "1", "--steps", "30", "--split-lightning"]
    assert script.main(argv, monkeypatch.setattr) == 0
    assert LightningOptimizer.step is step  # every wrapper undone
    phases = json.loads((tmp_path / "host_path_phases_cpu.json").read_text())["medians"]["phases_ms"]
    lightning = {name for name in phases if name.startswith("lightning.")}
    assert {
        "lightning.automatic_run",
        "lightning.lightning_optimizer_step",
        "lightning.strategy_optimizer_step",
        "lightning.precision_optimizer_step",
    } <= lightning
    assert "decide" in phases  # the callback's phases as without the flag
