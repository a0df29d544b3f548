"""The sampled replay check (``verify="sampled"``, the default) on the CPU: its schedule, its bitwise
comparison, and, through the graph emulator, that it catches a stale replay the per-replay checks are
made to miss, keeps the eager result, and leaves no trace where the replays are right."""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch
import torchmetrics
from torch import nn

from l2lightning import L2GraphCallback
from l2lightning.guards import python_state
from l2lightning.guards.replay_check import (
    CheckSchedule,
    ReplayCheckReport,
    first_difference,
    is_checked_replay,
    named_written_state,
    step_tensors,
)
from tests import graph_emulator as emu
from tests.baselines import (  # noqa: F401 -- the fixture records each callback fit's switch step
    baseline_of,
    capturable_from_of_the_last_callback_fit,
)
from tests.between_step_models import MovesTheScaleEachEpoch, ScalesByAPlainTensor
from tests.lightning_models import TinyMLP
from tests.replay_helpers import assert_same, fit


# --------------------------------------------------------------------------- the schedule
def test_replays_checked_are_the_powers_of_two_of_each_capture():
    assert [r for r in range(1, 70) if is_checked_replay(r)] == [1, 2, 4, 8, 16, 32, 64]


def test_an_event_checks_the_next_replay_once_and_a_capture_starts_the_count_again():
    schedule = CheckSchedule()
    schedule.captured()
    assert [schedule.due() is not None for _ in range(5)] == [True, True, False, True, False]
    schedule.after("an epoch start")
    schedule.after("a validation loop")  # the first event names the check
    assert schedule.due() == "the first replay after an epoch start"
    assert schedule.due() is None  # replay 7
    assert schedule.due() == "a power-of-two replay of its capture"  # replay 8
    schedule.after("a checkpoint load")
    schedule.captured()  # a new capture: its own count, and the pending event is spent by its replay 1
    assert schedule.due() == "a power-of-two replay of its capture"
    assert schedule.due() == "a power-of-two replay of its capture"
    assert schedule.due() is None


# --------------------------------------------------------------------------- the comparison
def test_checks_beyond_the_time_share_are_owed_and_made_at_the_first_replay_within_it():
    schedule = CheckSchedule(share=0.02)
    schedule.captured()
    # replay 1 of a capture is checked whatever the checks have cost
    assert schedule.due(spent_s=5.0, elapsed_s=10.0) == "a power-of-two replay of its capture"
    assert schedule.due(spent_s=5.0, elapsed_s=10.0) is None  # replay 2: 50% spent, owed
    assert schedule.due(spent_s=5.0, elapsed_s=10.0) is None  # replay 3: nothing scheduled, still over
    assert schedule.due(spent_s=5.0, elapsed_s=20.0) is None  # replay 4: scheduled too, merged
    assert schedule.deferred == 2
    assert schedule.due(spent_s=5.0, elapsed_s=300.0) == (
        "a power-of-two replay of its capture (deferred to keep the checks within 2% of the fit's time)"
    )
    assert schedule.due(spent_s=5.0, elapsed_s=300.0) is None  # replay 6: nothing owed any more
    schedule.after("an epoch start")
    assert schedule.due(spent_s=5.0, elapsed_s=300.0) == "the first replay after an epoch start"


@pytest.mark.parametrize("value", [0, 0.0, -0.1, 1.5, True, "all", None])
def test_check_share_rejects_values_outside_zero_to_one_naming_the_argument(value):
    with pytest.raises(ValueError, match=r"`check_share` must be a number in \(0, 1\]"):
        L2GraphCallback(check_share=value)


@pytest.mark.usefixtures("emulated_cuda_graphs")
def test_the_default_share_defers_checks_on_the_emulator_and_counts_them():
    """The emulator's replays cost an eager step each, so a check (two steps and copies) soon exceeds
    2% of the fit: most scheduled checks are deferred, replay 1 is checked, and the fit is its baseline."""
    cb = L2GraphCallback(prefetch="off", log_timing=False)
    run = fit(TinyMLP, [cb], steps=60)
    base = fit(baseline_of(TinyMLP), steps=60)
    assert_same(base, run)
    report = cb.summary()["replay_check"]
    assert report["reasons"].get("a power-of-two replay of its capture", 0) >= 1, report
    assert report["deferred"] >= 1 and report["checks"] < 8, report


def test_first_difference_is_bitwise_and_names_the_first_tensor_that_differs():
    a = torch.tensor([1.0, float("nan"), 0.0])
    same = a.clone()
    signed_zero = torch.tensor([1.0, float("nan"), -0.0])
    assert first_difference([("x", a, same)]) is None  # NaN against NaN: the same bits
    found = first_difference([("x", a, same), ("y", a, signed_zero), ("z", a, a + 1)])
    assert found.startswith("y: 1 of 3 elements differ"), found
    assert first_difference([("g", None, None)]) is None
    assert first_difference([("g", a, None)]) == "g (the eager step left none)"
    assert "shape/dtype" in first_difference([("w", a, a.double())])
    # the position alone, without describing it (what a check of rounding needs)
    from l2lightning.guards.replay_check import first_differing

    assert first_differing([("x", a, same), ("y", a, signed_zero), ("z", a, a + 1)]) == 1
    assert first_differing([("x", a, same), ("g", None, None)]) is None
    assert first_differing([("x", a, same), ("g", a, None)]) == 1


def test_step_tensors_label_the_loss_and_the_returned_tensors():
    loss, preds = torch.ones(()), torch.zeros(3)
    assert [label for label, _ in step_tensors({"loss": loss, "preds": preds, "n": 3})] == [
        "the loss",
        "output 'preds'",
    ]
    assert [label for label, _ in step_tensors(loss)] == ["the loss"]


def test_the_written_state_names_parameters_buffers_optimizer_and_metric_states():
    module = nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(2))
    opt = torch.optim.SGD(module.parameters(), lr=0.1, momentum=0.9)
    module(torch.randn(4, 2)).sum().backward()
    opt.step()
    metric = torchmetrics.MeanMetric()
    extra = torch.zeros(())
    labels = [
        w.label
        for w in named_written_state(module, opt, [("m", metric, "mean_value")], [({"e": extra}, "e", extra)])
    ]
    assert "parameter `0.weight`" in labels and "buffer `1.running_mean`" in labels
    assert "optimizer state `momentum_buffer` of `0.weight`" in labels
    assert "metric state `m.mean_value`" in labels and "tensor attribute `e`" in labels


# --------------------------------------------------------------------------- arguments
@pytest.mark.parametrize("value", ["always", 1, None, "Sampled"])
def test_verify_rejects_values_it_does_not_know_naming_the_accepted_ones(value):
    with pytest.raises(ValueError, match=r"`verify` must be one of \('sampled', 'capture', False\)"):
        L2GraphCallback(verify=value)


def test_verify_true_means_the_check_at_capture():
    assert L2GraphCallback(verify=True).verify == "capture"
    assert L2GraphCallback().verify == "sampled"
    assert L2GraphCallback(verify=False).summary()["replay_check"]["mode"] == "off"


# --------------------------------------------------------------------------- in a fit (graph emulator)
def _callback(**kwargs):
    # every scheduled check (the emulator's replays cost as much as an eager step: a 2% share would
    # defer most of them); the share itself is tested on its own below
    return L2GraphCallback(
        prefetch="off", log_timing=False, check_share=kwargs.pop("check_share", 1.0), **kwargs
    )


@pytest.mark.usefixtures("emulated_cuda_graphs")
def test_checked_replays_leave_the_fit_bitwise_the_baseline_and_are_counted():
    cb = _callback()
    run = fit(TinyMLP, [cb], steps=90)
    base = fit(baseline_of(TinyMLP), steps=90)
    assert_same(base, run)
    summary = cb.summary()
    report = summary["replay_check"]
    assert summary["recapture_s"] == 0.0  # one capture: nothing spent on capturing again
    # captured at step 3: replays 1..86; powers of two 1..64 (7), and the first replays after the
    # epoch starts at steps 30 and 60 (replays 27 and 57)
    assert summary["captures"] == 1 and report["mismatches"] == 0, summary
    assert report["checks"] == 9 and report["reasons"] == {
        "a power-of-two replay of its capture": 7,
        "the first replay after an epoch start": 2,
    }, report
    assert emu.FakeGraph.replays == 1 + 86  # the capture step's replay, then every step after it
    assert summary["fallback_steps"] == 0 and report["seconds"] > 0
    # the phases of the checked steps: none judged (no difference), and they add up to at most the
    # checks' own seconds (the bookkeeping between them is not a phase)
    phases = report["phases_s"]
    assert set(phases) == {"save", "replay", "eager", "compare"}, phases
    assert all(v > 0 for v in phases.values()) and sum(phases.values()) <= report["seconds"] + 1e-6


class NormalizedMetricDropout(TinyMLP):
    """What a check must leave as a plain step leaves it: BatchNorm statistics, a metric's states and
    Python-side count, dropout's random numbers, logged values, a list the step appends to."""

    def __init__(self, width=32, **kw):
        super().__init__(width=width, **kw)
        self.net = nn.Sequential(nn.Linear(width, width), nn.BatchNorm1d(width), nn.GELU(), nn.Dropout(0.2))
        self.train_mae = torchmetrics.MeanAbsoluteError()
        self.seen = []

    def training_step(self, batch, batch_idx):
        x, y = batch
        pred = self.head(self.net(x)).squeeze(-1)
        loss = (pred - y).square().mean()
        self.train_mae(pred, y)
        self.seen.append(loss.detach())
        self.log("train/loss", loss)
        self.log("train/mae", self.train_mae, on_step=True, on_epoch=True)
        return loss


@pytest.mark.usefixtures("emulated_cuda_graphs")
def test_a_checked_replay_leaves_no_trace_of_itself():
    cb = _callback()
    run = fit(NormalizedMetricDropout, [cb], steps=70)
    rng_run = torch.get_rng_state()
    base = list(fit(baseline_of(NormalizedMetricDropout), steps=70))
    assert torch.equal(rng_run, torch.get_rng_state())  # dropout drew as often, from the same states
    assert cb.summary()["captured"] and cb.summary()["replay_check"]["checks"] >= 7, cb.summary()
    assert_same(base, run)
    (mr, _, _), (mb, _, _) = run, base
    for name in ("net.1.running_mean", "net.1.running_var", "net.1.num_batches_tracked"):
        assert torch.equal(mr.get_buffer(name), mb.get_buffer(name)), name
    assert torch.equal(mr.train_mae.sum_abs_error, mb.train_mae.sum_abs_error)
    assert mr.train_mae._update_count == mb.train_mae._update_count
    assert len(mr.seen) == len(mb.seen) == 70
    assert all(torch.equal(a, b) for a, b in zip(mr.seen, mb.seen))


def _unseen_moves(monkeypatch):
    """Switch off the two per-replay checks that see a plain tensor attribute moved to other memory
    (its address, and its value read through the step's source), so the replays after the move are
    stale (the emulator replays through the capture's memory, as a GPU graph does)."""
    from l2lightning.guards.step_source import StepSource

    monkeypatch.setattr(python_state, "addresses", lambda checks: ())
    monkeypatch.setattr(StepSource, "changed_attribute_values", lambda self, *args: [])


@pytest.mark.usefixtures("emulated_cuda_graphs")
def test_a_stale_replay_the_checks_before_it_miss_is_caught_redone_and_captured_again(monkeypatch):
    _unseen_moves(monkeypatch)
    stale = _callback(verify=False)
    fit(ScalesByAPlainTensor, [MovesTheScaleEachEpoch(), stale], steps=60)
    assert stale.summary()["captures"] == 1  # nothing saw the move: the replays read the old scale
    cb = _callback()
    with pytest.warns(
        UserWarning, match=r"a sampled replay check \(the first replay after an epoch start, step 30\)"
    ):
        run = fit(ScalesByAPlainTensor, [MovesTheScaleEachEpoch(), cb], steps=60)
    base = fit(baseline_of(ScalesByAPlainTensor), [MovesTheScaleEachEpoch()], steps=60)
    assert_same(base, run)
    summary = cb.summary()
    assert summary["captures"] == 2 and summary["replay_check"]["mismatches"] == 1, summary
    assert summary["replay_check"]["first_mismatch"].startswith("the loss"), summary
    assert summary["reason"] is None  # one mismatch: captured again, and the replays go on
    # the second capture's wall time, within all the captures'
    assert 0.0 < summary["recapture_s"] <= summary["capture_s"] + summary["tuning_s"], summary


@pytest.mark.usefixtures("emulated_cuda_graphs")
def test_a_second_mismatch_means_eager_training_for_the_rest_of_the_fit(monkeypatch):
    _unseen_moves(monkeypatch)
    cb = _callback()
    with pytest.warns(UserWarning, match=r"for the second time; training eagerly"):
        run = fit(ScalesByAPlainTensor, [MovesTheScaleEachEpoch(), cb], steps=90)
    base = fit(baseline_of(ScalesByAPlainTensor), [MovesTheScaleEachEpoch()], steps=90)
    assert_same(base, run)  # the optimizer keeps make_capturable's configuration after the capture
    summary = cb.summary()
    assert summary["replay_check"]["mismatches"] == 2 and "sampled replay check" in summary["reason"], summary
    assert summary["captures"] == 2


@pytest.mark.usefixtures("emulated_cuda_graphs")
def test_without_the_check_the_same_stale_replays_train_wrong(monkeypatch):
    """The test above fails without the check: what it catches is real."""
    _unseen_moves(monkeypatch)
    cb = _callback(verify=False)
    run = fit(ScalesByAPlainTensor, [MovesTheScaleEachEpoch(), cb], steps=60)
    base = fit(baseline_of(ScalesByAPlainTensor), [MovesTheScaleEachEpoch()], steps=60)
    with pytest.raises(AssertionError, match="loss differs at step 30"):
        assert_same(base, run)


def _noisy_replays(monkeypatch, noise):
    """Replays that add ``noise(call)`` to the head's bias after running: rounding that differs from one
    replay to the next, as kernels with atomics give, or worse."""
    replay = emu.FakeGraph.replay
    calls = [0]
    model: list = [None]

    def unrepeatable(graph):
        replay(graph)
        calls[0] += 1
        with torch.no_grad():
            model[0].head.bias.add_(noise(calls[0]))

    class Remembers(TinyMLP):
        def on_fit_start(self):
            model[0] = self

    monkeypatch.setattr(emu.FakeGraph, "replay", unrepeatable)
    return Remembers


@pytest.mark.usefixtures("emulated_cuda_graphs")
def test_replays_that_differ_by_rounding_are_judged_against_their_spread_and_stay_checked(monkeypatch):
    """Kernels that are not deterministic (atomics) make two replays from one state differ: the check
    judges the eager step against the two replays' spread, says so once, and goes on checking."""
    module = _noisy_replays(monkeypatch, lambda call: 1e-6 if call % 2 else -1e-6)
    cb = _callback()
    with pytest.warns(UserWarning, match=r"judges the eager step against the two replays' spread"):
        fit(module, [cb], steps=20)
    summary = cb.summary()
    report = summary["replay_check"]
    assert summary["captured"] and summary["reason"] is None and summary["captures"] == 1, summary
    # replays 1, 2, 4, 8, 16 checked, each within the spread
    assert report["checks"] == 5 and report["within_spread"] == 5 and report["mismatches"] == 0, report
    assert report["off_reason"] is None, report


@pytest.mark.usefixtures("emulated_cuda_graphs")
def test_replays_far_apart_from_each_other_are_a_mismatch_not_rounding(monkeypatch):
    """Two replays from one state further apart than rounding can put them (a graph reading memory that
    changed under it): a mismatch, captured again, not a check switched off."""
    # call 1 is the capture step's own replay, call 2 the first checked one, call 3 its second replay
    module = _noisy_replays(monkeypatch, lambda call: 0.5 if call == 2 else 1e-6 * (-1) ** call)
    cb = _callback()
    with pytest.warns(UserWarning, match=r"found the replay differing from the eager step"):
        fit(module, [cb], steps=20)
    report = cb.summary()["replay_check"]
    assert report["mismatches"] == 1 and cb.summary()["captures"] == 2, report
    assert "lies beyond the two replays' spread" in report["first_mismatch"], report
    assert report["first_mismatch"].startswith("parameter `head.bias`"), report
    assert "two replays from the same state differ by" in report["first_mismatch"], report


def test_beyond_replay_spread_judges_each_tensor_by_its_own_spread():
    from l2lightning.guards.replay_check import beyond_replay_spread

    r = torch.tensor([1.0, 2.0, 3.0])
    assert beyond_replay_spread([("w", r, r + 1e-6, r - 1e-6)]) is None  # eager within the spread
    far = beyond_replay_spread([("w", r, r + 1e-6, r + 1e-3)])
    assert far is not None and far.startswith("w (the eager step differs from the replay by 1.000e-03")
    # two replays further apart than rounding: not explained whatever the eager step
    wide = beyond_replay_spread([("w", r, r + 0.1, r)])
    assert wide is not None and "two replays from the same state differ by" in wide
    # a tensor whose two replays agree is allowed the spread other tensors show, relative to its values
    # (rounding does not hit every tensor at every run), and not much more
    w = torch.tensor([0.5, -0.25])
    assert beyond_replay_spread([("w", r, r + 3e-6, r), ("b", w, w.clone(), w + 2e-6)]) is None
    assert beyond_replay_spread([("w", r, r + 3e-6, r), ("b", w, w.clone(), w + 1e-3)]) is not None
    assert beyond_replay_spread([("loss", r, r.clone(), r + 1e-3)]) is not None
    n = torch.tensor([1.0, float("nan")])
    assert beyond_replay_spread([("n", n, n.clone(), n.clone())]) is None  # NaN where all three have it
    assert beyond_replay_spread([("n", n, n.clone(), torch.tensor([1.0, 0.0]))]) is not None
    i = torch.tensor([1, 2])
    assert beyond_replay_spread([("count", i, i.clone(), i.clone())]) is None
    assert beyond_replay_spread([("count", i, i.clone(), i + 1)]) is not None
    assert beyond_replay_spread([("count", i, i + 1, i.clone())]) is not None  # integers have no rounding
    assert beyond_replay_spread([("x", None, None, None)]) is None
    assert beyond_replay_spread([("x", r, r, None)]) == "x (the eager step left none)"


@pytest.mark.usefixtures("emulated_cuda_graphs")
@pytest.mark.parametrize(
    "copies",
    ["save", "snapshot"],
    ids=["before-the-replay", "after-the-replay"],
)
def test_a_check_whose_copies_do_not_fit_is_skipped_counted_and_the_fit_is_its_baseline(monkeypatch, copies):
    """Out of memory for the copies of the state before the replay (the step replays as usual) or of
    what the replay wrote (the state goes back and the eager step stands)."""
    from l2lightning.guards import replay_check

    def out_of_memory(self):
        raise torch.OutOfMemoryError("no room for the copies")

    monkeypatch.setattr(replay_check.WrittenState, copies, out_of_memory)
    cb = _callback()
    with pytest.warns(UserWarning, match="a sampled replay check was skipped"):
        run = fit(TinyMLP, [cb], steps=20)
    base = fit(baseline_of(TinyMLP), steps=20)
    assert_same(base, run)
    report = cb.summary()["replay_check"]
    assert report["checks"] == 0 and report["skipped_memory"] == 5, report  # replays 1, 2, 4, 8, 16


def test_the_report_is_plain_data():
    report = ReplayCheckReport(checks=2, seconds=0.1234567891)
    report.add_phases({"save": 0.25, "eager": 1.0})
    report.add_phases({"save": 0.5})
    assert report.to_dict()["seconds"] == 0.123457 and report.to_dict()["mode"] == "sampled"
    assert report.to_dict()["phases_s"] == {"save": 0.75, "eager": 1.0}


def test_the_joined_comparison_agrees_with_the_one_by_one_comparison():
    """Mixed dtypes and sizes joined per element size: equal only where every pair's bits are."""
    from l2lightning.guards.replay_check import _all_same

    tensors = [torch.randn(5), torch.randn(2, 3).half(), torch.arange(4), torch.tensor(True), torch.zeros(0)]
    same = [(f"t{i}", t, t.clone()) for i, t in enumerate(tensors)]
    assert _all_same(same) and first_difference(same) is None
    for i in range(4):
        changed = [(label, a, b.clone()) for label, a, b in same]
        flipped = changed[i][2].reshape(-1)
        flipped[0] = ~flipped[0] if flipped.dtype == torch.bool else flipped[0] + 1
        assert not _all_same(changed)
        assert first_difference(changed).startswith(f"t{i}"), first_difference(changed)


class SeedsInAHook(pl.Callback):
    """A user's callback that re-seeds at step 40 (``seed_everything`` in a hook)."""

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_step == 40:
            torch.manual_seed(40)


@pytest.mark.usefixtures("emulated_cuda_graphs")
def test_a_seed_set_between_steps_checks_the_next_replay():
    """torch.manual_seed sets the CUDA generators through torch.cuda.manual_seed_all: the replay after it
    is checked (cuDNN re-seeds its RNN dropout state at the next eager nn.LSTM call, never in a replay)."""
    cb = _callback()
    run = fit(TinyMLP, [SeedsInAHook(), cb], steps=50)
    base = fit(baseline_of(TinyMLP), [SeedsInAHook()], steps=50)
    assert_same(base, run)
    reasons = cb.summary()["replay_check"]["reasons"]
    assert reasons.get("the first replay after a call of `torch.cuda.manual_seed_all`") == 1, reasons
    assert torch.cuda.manual_seed_all is torch.cuda.random.manual_seed_all, "the watch outlived the fit"


def test_a_cuda_state_set_inside_the_step_is_the_steps_own_and_checks_nothing():
    """Activation checkpointing's recomputation puts the forward's CUDA state back at every eager
    backward: inside the step it must not call for a check (every replay would be checked)."""
    cb = _callback()
    cb._dispatch.in_step = True
    cb._cuda_state_set("set_rng_state")
    assert cb._slots.state.check_schedule.pending is None
    cb._dispatch.in_step = False
    cb._cuda_state_set("set_rng_state")
    assert cb._slots.state.check_schedule.pending == "a call of `torch.cuda.set_rng_state`"


def test_the_multi_tensor_measurement_agrees_with_double_precision_per_tensor():
    """The spread judgment's one pass per dtype (own-dtype subtraction and norms) against the exact
    double-precision measurement of each tensor, NaN and infinity included (those take the exact path)."""
    from l2lightning.guards.replay_check import _largest_difference, _measured_differences

    gen = torch.Generator().manual_seed(3)
    rows = []
    for dtype, n in ((torch.float32, 40), (torch.bfloat16, 17), (torch.float64, 5), (torch.float32, 1)):
        r = torch.randn(n, generator=gen).to(dtype)
        a = r + (torch.randn(n, generator=gen) * 1e-3).to(dtype)
        e = r - (torch.randn(n, generator=gen) * 1e-2).to(dtype)
        rows.append(("t", r, a, e, float(torch.finfo(dtype).eps)))
    inf_row = torch.tensor([float("inf"), 1.0, 3.0])
    rows.append(("inf", inf_row, inf_row.clone(), torch.tensor([float("inf"), 1.5, 3.0]), 1e-7))
    nan_row = torch.tensor([float("nan"), -2.0])
    rows.append(("nan", nan_row, torch.tensor([1.0, -2.0]), nan_row.clone(), 1e-7))
    ints = torch.tensor([1, 2, 3])
    rows.append(("int", ints, ints.clone(), torch.tensor([1, 2, 4]), -1.0))  # the eager step differs
    rows.append(("int again", ints, torch.tensor([0, 2, 3]), ints.clone(), -1.0))  # the second replay
    rows.append(("int equal", ints, ints.clone(), ints.clone(), -1.0))
    measured = _measured_differences(rows)
    for (label, r, a, e, eps), (gap, spread, scale) in zip(rows, measured):
        if eps < 0:
            assert (gap, spread, scale) == ((0.0 if label == "int equal" else 1.0), 0.0, 1.0), label
            continue
        rd, ad, ed = r.double(), a.double(), e.double()
        want_scale = float(torch.nan_to_num(rd.abs(), nan=0.0, posinf=0.0).max())
        assert scale == pytest.approx(want_scale, rel=1e-6), label
        assert gap == pytest.approx(float(_largest_difference(rd, ed)), rel=1e-2, abs=0), label
        assert spread == pytest.approx(float(_largest_difference(rd, ad)), rel=1e-2, abs=0), label
    assert measured[-5][0] == 0.5 and measured[-4][1] == float("inf")  # inf == inf; NaN against a number


class SeedsAtStep10(pl.Callback):
    """A hook that seeds CUDA between steps, in a fit whose step is said to draw from cuDNN's RNN
    dropout state (the CPU has no cuDNN: the callback's record of such a draw is set by hand)."""

    def __init__(self, graph_callback):
        self.graph_callback = graph_callback

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_step == 10:
            self.graph_callback._warmup.hidden_random = "model.py:7 (`self.rnn(x, h)`)"
            torch.cuda.manual_seed(1)


@pytest.mark.usefixtures("emulated_cuda_graphs")
@pytest.mark.parametrize("verify", ["capture", False])
def test_without_the_sampled_check_a_seed_between_steps_of_a_cudnn_dropout_fit_trains_eagerly(verify):
    """Plain Lightning's next nn.LSTM call after a seed re-seeds cuDNN's dropout state; replays would
    go on with the old one, unseen without the sampled check: the rest of the fit runs eagerly."""
    base = fit(baseline_of(TinyMLP), steps=20)
    cb = _callback(verify=verify)
    with pytest.warns(UserWarning, match=r"`torch.cuda.manual_seed` was called between steps.*re-seeds"):
        run = fit(TinyMLP, [SeedsAtStep10(cb), cb], steps=20)
    summary = cb.summary()
    assert "cuDNN re-seeds its RNN dropout state" in summary["reason"], summary
    assert_same(base, run)
    # with the sampled check the next replay is checked instead (tests above), and the fit goes on
    cb = _callback()
    fit(TinyMLP, [SeedsAtStep10(cb), cb], steps=20)
    assert (
        cb.summary()["reason"] is None
        and "the first replay after a call of `torch.cuda.manual_seed`"
        in (cb.summary()["replay_check"]["reasons"])
    ), cb.summary()


def test_a_squared_gradients_rounding_is_within_the_spread_and_a_wrong_value_is_not():
    """Adam's second moment squares the gradient, doubling its relative rounding: on the H200 the conv
    stack's eager step sat 21x the two replays' relative spread from its replay in `exp_avg_sq`, which
    is rounding (replay_check.SPREAD_FACTOR); 40x or a difference of 1e-4 of the values is not."""
    from l2lightning.guards.replay_check import beyond_replay_spread

    g = torch.tensor([1.0, -0.5, 0.25], dtype=torch.float64)  # a gradient: two replays 1e-7 apart
    v = torch.tensor([1.0, 0.25, 0.0625], dtype=torch.float64)  # its square: the two replays agree

    def judged(eager_v):
        return beyond_replay_spread(
            [("grad", g, g + 1e-7, g + 1.2e-6), ("exp_avg_sq", v, v.clone(), eager_v)]
        )

    assert judged(v + 2.1e-6) is None  # 21x the relative spread: rounding, doubled by the square
    assert judged(v + 4e-6).startswith("exp_avg_sq (the eager step differs from the replay")
    assert judged(v + 1e-4) is not None
