"""Gradient accumulation (``accumulate_grad_batches``) captured, on the CPU graph emulator.

Every micro-batch is replayed from a graph of its role (l2lightning.graph.accumulation, graph_slots): a
window's first zeroes and makes the gradients, the next ones add to them, the closing one adds and
steps the optimizer. Each fit is compared bit for bit with its baseline: every micro-batch's loss and
logged values, the parameters and the optimizer's state, Lightning's loop progress.
"""

from __future__ import annotations

import pytest
import torch
from lightning.pytorch.callbacks import GradientAccumulationScheduler

from tests import graph_emulator as emu
from tests.baselines import (  # noqa: F401 -- the fixture records each callback fit's switch step
    baseline_of,
    capturable_from_of_the_last_callback_fit,
)
from tests.graph.test_amp_fp16_cpu import FusedSGD, fp16
from tests.lightning_models import TinyMLP
from tests.replay_helpers import assert_same, callback, fit

pytestmark = pytest.mark.usefixtures("emulated_cuda_graphs")


def assert_same_state(a, b):
    """assert_same, and the optimizer's state (what a checkpoint saves) bit for bit."""
    assert_same(a, b)
    sa, sb = a[2].optimizers[0].state_dict()["state"], b[2].optimizers[0].state_dict()["state"]
    assert sa.keys() == sb.keys()
    for i in sa:
        for k in sa[i]:
            x, y = sa[i][k], sb[i][k]
            same = torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y
            assert same, f"optimizer state {k!r} of parameter {i} differs"


def accumulated_pair(
    cls=TinyMLP, factor=2, steps=30, callbacks=list, trainer_kwargs=None, callback_kwargs=None, **kw
):
    callback_kwargs = callback_kwargs or {}
    trainer_kwargs = {"accumulate_grad_batches": factor, **(trainer_kwargs or {})}
    base = fit(baseline_of(cls), list(callbacks()), steps=steps, trainer_kwargs=trainer_kwargs, **kw)
    cb = callback(check_share=1.0, **callback_kwargs)
    run = fit(cls, [cb, *callbacks()], steps=steps, trainer_kwargs=trainer_kwargs, **kw)
    base[0]  # the deferred baseline fit runs now
    # the sampled check compares replays with their eager steps: a wrong replay would surface here
    # (and then train eagerly, so the bitwise comparison alone would not tell)
    assert cb.replay_check.mismatches == 0, cb.summary()["replay_check"]
    return base, run, cb


@pytest.mark.parametrize("factor", [2, 4])
def test_accumulation_captures_every_micro_batch_bitwise_the_baseline(factor):
    base, run, cb = accumulated_pair(factor=factor, steps=30, fused=True)
    s = cb.summary()
    # a graph per role: the window's first micro-batch, (factor 4) the adding ones, the closing one
    assert (
        s["captured"] and s["captures"] == s["graphs"] == (2 if factor == 2 else 3) and s["recaptures"] == 0
    ), s
    # 30 optimizer steps of `factor` micro-batches: all but the warm-up's replayed (or checked)
    assert emu.FakeGraph.replays + s["replay_check"]["checks"] > 30 * factor - 16, s
    assert s["fallback_steps"] == 0, s
    assert s["replay_check"]["checks"] >= 1 and s["replay_check"]["mismatches"] == 0, s["replay_check"]
    assert run[2].global_step == base[2].global_step == 30
    # every micro-batch's loss and logs, as in plain Lightning (an epoch of 30 ends on a shorter window)
    assert len(run[1].losses) == len(base[1].losses) > 30 * (factor - 1)
    assert_same_state(base, run)


def test_accumulation_with_foreach_adamw_and_gradient_clipping():
    base, run, cb = accumulated_pair(factor=2, trainer_kwargs={"gradient_clip_val": 0.05})
    assert cb.summary()["captured"], cb.summary()
    assert_same_state(base, run)


def test_an_epoch_not_a_multiple_of_the_factor_steps_at_its_last_batch():
    # 30 batches an epoch, factor 4: windows of 4, 4, ..., then 2 (adds) at the epoch's end, and
    # factor 7: a last window of 2; factor 3 over 31 batches: a last window of one (zeroes first)
    for factor, n in ((4, 240), (7, 240), (3, 248)):
        base, run, cb = accumulated_pair(factor=factor, steps=-1, n=n, trainer_kwargs={"max_epochs": 4})
        assert run[2].global_step == base[2].global_step
        assert cb.summary()["captured"], cb.summary()
        assert_same_state(base, run)


def test_a_gradient_accumulation_scheduler_changing_the_factor_mid_fit():
    def schedule():
        return [GradientAccumulationScheduler({0: 1, 1: 2, 2: 4})]

    base, run, cb = accumulated_pair(
        factor=1, steps=-1, n=240, callbacks=schedule, trainer_kwargs={"max_epochs": 4}
    )
    assert run[2].global_step == base[2].global_step
    s = cb.summary()
    assert s["captured"] and s["captures"] >= 3, s  # one graph per factor
    assert_same_state(base, run)


def test_accumulation_with_16_mixed_and_fused_sgd():
    kw = {"plugins": [fp16()]}
    base = fit(baseline_of(FusedSGD), steps=30, trainer_kwargs={"accumulate_grad_batches": 2, **kw})
    cb = callback(check_share=1.0)
    run = fit(FusedSGD, [cb], steps=30, trainer_kwargs={"accumulate_grad_batches": 2, "plugins": [fp16()]})
    base[0]
    assert cb.replay_check.mismatches == 0, cb.summary()["replay_check"]
    assert cb.summary()["captured"], cb.summary()
    assert_same_state(base, run)
    sa, sb = base[2].precision_plugin.scaler, run[2].precision_plugin.scaler
    assert torch.equal(sa._scale, sb._scale) and torch.equal(sa._growth_tracker, sb._growth_tracker)


def test_the_capture_steps_eager_check_sees_the_accumulated_gradients():
    base, run, cb = accumulated_pair(factor=3, callback_kwargs={"verify": True})
    assert cb.summary()["captured"], cb.summary()
    assert_same_state(base, run)


def test_accumulating_micro_batches_keep_their_hooks_and_logs():
    """on_after_backward / on_before_optimizer_step log per micro-batch (the accumulating ones run
    eagerly, the closing one's logs are re-issued after its replay) the values of plain Lightning."""
    from lightning.pytorch import Callback

    class Hooks(Callback):
        def on_after_backward(self, trainer, pl_module):
            pl_module.log("grad_after_backward", pl_module.head.weight.grad.norm())

        def on_before_optimizer_step(self, trainer, pl_module, optimizer):
            pl_module.log("grad_before_step", pl_module.head.weight.grad.norm())

    base, run, cb = accumulated_pair(factor=2, callbacks=lambda: [Hooks()], fused=True)
    assert cb.summary()["captured"], cb.summary()
    assert emu.FakeGraph.replays > 15
    assert "grad_before_step" in run[1].logged[-1] and "grad_after_backward" in run[1].logged[-2]
    assert_same_state(base, run)  # every micro-batch's logged values, bit for bit


def test_idiom_accumulate_bf16_decay_groups_is_captured_bitwise_the_baseline():
    from lightning.pytorch import seed_everything

    from tests.idiom_variants import IDIOM_VARIANTS
    from tests.lightning_models import quiet_trainer
    from tests.replay_helpers import Recorder

    idiom = IDIOM_VARIANTS["accumulate_bf16_decay_groups"]
    assert idiom.expect == "capture"

    def run(with_callback):
        seed_everything(0)
        module = idiom.make_module()
        if not with_callback:
            module.__class__ = baseline_of(type(module))
        rec, cb = Recorder(), callback(check_share=1.0) if with_callback else None
        kwargs = {**idiom.trainer_kwargs, "max_steps": 20}
        trainer = quiet_trainer(accelerator="cpu", callbacks=[rec, *([cb] if cb else [])], **kwargs)
        trainer.fit(module, idiom.make_loader())
        return (module, rec, trainer), cb

    got, cb = run(True)
    base, _ = run(False)
    assert cb.summary()["captured"] and cb.replay_check.mismatches == 0, cb.summary()
    assert emu.FakeGraph.replays >= 5
    assert_same_state(base, got)


class ZeroesInPlace(TinyMLP):
    """Gradients zeroed in place at each window's start (`set_to_none=False`): the same memory all fit."""

    def optimizer_zero_grad(self, epoch, batch_idx, optimizer):
        optimizer.zero_grad(set_to_none=False)


class HeadEveryOtherBatch(TinyMLP):
    """An extra head reached only on even batches: on a closing micro-batch it may or may not hold an
    accumulated gradient, so the windows differ in which parameters hold one."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self.extra = torch.nn.Linear(32, 1)

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        if batch_idx % 2 == 0:
            loss = loss + self.extra(batch[0]).square().mean()
        return loss


def test_gradients_zeroed_in_place_between_windows():
    base, run, cb = accumulated_pair(ZeroesInPlace, factor=2, fused=True)
    assert cb.summary()["captured"], cb.summary()
    assert_same_state(base, run)


def test_parameters_holding_an_accumulated_gradient_on_some_windows_only():
    # factor 3 over batches 0..29: a closing micro-batch at idx 2, 5, 8, ... holds the extra head's
    # gradient from an even batch in its window; the windows alternate which batches are even
    with pytest.warns(UserWarning, match=r"adding to the accumulated gradients of \d+ of the \d+ parameters"):
        base, run, cb = accumulated_pair(HeadEveryOtherBatch, factor=3, fused=True)
    assert_same_state(base, run)


def test_an_accumulation_names_which_parameters_hold_a_sum_only_where_some_do_not():
    from l2lightning.graph.accumulation import Accumulation

    assert Accumulation(4, True, (True, True), False).describe() == (
        "accumulate_grad_batches=4, an accumulating micro-batch, adding to the accumulated gradients"
    )
    assert Accumulation(4, True, (True, False, True), True).describe() == (
        "accumulate_grad_batches=4, adding to the accumulated gradients of 2 of the 3 parameters"
    )


def test_a_post_accumulate_grad_hook_trains_the_closing_micro_batches_eagerly_by_name():
    class PostAccumulate(TinyMLP):
        def on_fit_start(self):
            self.head.weight.register_post_accumulate_grad_hook(lambda p: None)

    with pytest.warns(UserWarning, match="register_post_accumulate_grad_hook"):
        base, run, cb = accumulated_pair(PostAccumulate, factor=2, fused=True)
    s = cb.summary()
    # the window's first micro-batch makes the gradients afresh (the hook reads no sum there): captured
    assert s["captured"] and s["captures"] == 1, s
    assert s["fallback_steps"] >= 29 and any(
        "register_post_accumulate_grad_hook" in c for c in s["fallback_causes"]
    ), s
    assert_same_state(base, run)


class ScaledByAnEpochHook(TinyMLP):
    """A loss scale the epoch hook changes: every graph reads it as a baked number (device scalars off),
    so each role's graph is captured again at each change, as a fit without accumulation is."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self.scale = 1.0

    def on_train_epoch_start(self):
        self.scale = 1.0 + 0.5 * self.current_epoch

    def training_step(self, batch, batch_idx):
        return super().training_step(batch, batch_idx) * self.scale


def test_a_changed_number_captures_each_roles_graph_again_bitwise_the_baseline():
    # 30 batches an epoch, factor 3: ten windows of (first, adding, closing) micro-batches per epoch
    base, run, cb = accumulated_pair(
        ScaledByAnEpochHook,
        factor=3,
        steps=-1,
        trainer_kwargs={"max_epochs": 3},
        callback_kwargs={"operand_scalars": False, "recapture_wait": False},
        fused=True,
    )
    s = cb.summary()
    assert s["captures"] == 3 * 3 and s["recaptures"] == 2 * 3, s  # three roles, three epochs
    assert_same_state(base, run)


def test_the_first_replay_of_each_roles_graph_is_checked():
    cb = callback()  # the default check share: the first replay of each capture is always checked
    fit(TinyMLP, [cb], steps=20, trainer_kwargs={"accumulate_grad_batches": 4}, fused=True)
    s = cb.summary()
    assert s["captures"] == 3, s
    # replay 1 of each capture is always checked (counted among the power-of-two replays)
    assert s["replay_check"]["reasons"].get("a power-of-two replay of its capture", 0) >= 3, s["replay_check"]


def test_an_epoch_start_checks_the_next_replay_of_every_roles_graph():
    cb = callback()
    fit(
        TinyMLP,
        [cb],
        steps=-1,
        n=96,
        trainer_kwargs={"accumulate_grad_batches": 2, "max_epochs": 3},
        fused=True,
    )
    reasons = cb.summary()["replay_check"]["reasons"]
    # epochs 2 and 3: the first replay of each of the two graphs after the epoch start
    assert reasons.get("the first replay after an epoch start", 0) == 2 * 2, reasons


def test_the_micro_batch_closures_go_back_to_lightnings_when_the_fit_ends():
    cb = callback()
    _, _, trainer = fit(TinyMLP, [cb], steps=10, trainer_kwargs={"accumulate_grad_batches": 2}, fused=True)
    assert cb.summary()["captures"] == 2, cb.summary()
    loop = trainer.fit_loop.epoch_loop.automatic_optimization
    assert "_make_closure" not in vars(loop)  # the class's own method again


def test_role_of_tells_what_accumulation_of_tells():
    import functools
    from types import SimpleNamespace

    from lightning.pytorch.loops.optimization.automatic import Closure
    from lightning.pytorch.plugins.precision import Precision

    from l2lightning.graph.accumulation import MicroBatchStep, accumulation_of, role_of

    def stock_closure(inner):  # what automatic optimization hands optimizer.step
        return functools.partial(Precision()._wrap_closure, "model", "optimizer", inner)

    module = torch.nn.Linear(2, 2)
    module.weight.grad = torch.zeros(2, 2)

    def step():
        return None

    for factor in (1, 2, 4):
        trainer = SimpleNamespace(accumulate_grad_batches=factor)
        for zero_grad in (None, step):
            inner = Closure(step, backward_fn=lambda loss: None, zero_grad_fn=zero_grad)
            for closure in (stock_closure(inner), MicroBatchStep(inner)):
                if factor == 1 and isinstance(closure, MicroBatchStep):
                    continue  # no micro-batch accumulates without accumulation
                told = accumulation_of(trainer, closure, module)
                assert role_of(trainer, closure) == told.role, (factor, zero_grad, closure)


class LogsInClosureHooks(TinyMLP):
    """The closure's hooks on the module, logging values of the step (a replay re-issues them)."""

    def on_before_zero_grad(self, optimizer):
        self.log("before_zero_grad", self.head.weight.sum())

    def on_before_backward(self, loss):
        self.log("before_backward", loss * 2)

    def on_after_backward(self):
        self.log("grad_after_backward", self.head.weight.grad.norm())

    def on_before_optimizer_step(self, optimizer):
        self.log("grad_before_step", self.head.weight.grad.norm())


def test_replayed_micro_batches_call_the_closures_hooks_as_lightning_does():
    base, run, cb = accumulated_pair(LogsInClosureHooks, factor=3, fused=True)
    assert cb.summary()["graphs"] == 3, cb.summary()
    # the replays' closures ran through the callback's dispatch of the hooks that do something
    assert cb._dispatch.replay_closure is not None and cb._dispatch.replay_closure.calls > 40
    # every micro-batch's logged values as plain Lightning's: the window's first logs before zero_grad,
    # every micro-batch before and after backward, the closing one before the optimizer step
    assert {"before_zero_grad", "before_backward", "grad_after_backward", "grad_before_step"} <= set(
        run[1].logged[-1]
    )
    assert_same_state(base, run)


def test_every_kind_of_log_and_a_metric_object_through_the_roles_graphs():
    """ManyLogs (step and epoch reductions, log_dict, a torchmetrics MeanMetric updated in the step,
    a per-step LR) with factor 3 over 3 epochs: the metric's state passes from one graph's home
    tensors to the next's before each replay, and is reset at each epoch's end, as in plain Lightning."""
    from tests.logging_models import ManyLogs

    base, run, cb = accumulated_pair(
        ManyLogs, factor=3, steps=-1, trainer_kwargs={"max_epochs": 3}, fused=True
    )
    s = cb.summary()
    assert s["graphs"] == 3 and s["recaptures"] == 0, s
    assert_same_state(base, run)
    mean_a, mean_b = base[0].train_mean, run[0].train_mean
    assert torch.equal(mean_a.mean_value, mean_b.mean_value) and torch.equal(mean_a.weight, mean_b.weight)
    metrics_a, metrics_b = base[2].callback_metrics, run[2].callback_metrics
    assert metrics_a.keys() == metrics_b.keys()
    for key in metrics_a:
        assert torch.equal(metrics_a[key], metrics_b[key]), key


def test_lightnings_docs_schedule_of_falling_factors_is_bitwise_the_baseline():
    """Lightning's training-tricks docs: ``GradientAccumulationScheduler(scheduling={0: 8, 4: 4, 8: 1})``.
    Each role's graph is captured again once the new factor stays; at factor 1 the plain step's own graph."""

    def schedule():
        return [GradientAccumulationScheduler(scheduling={0: 8, 4: 4, 8: 1})]

    base, run, cb = accumulated_pair(
        factor=1,
        steps=-1,
        n=128,
        callbacks=schedule,
        trainer_kwargs={"max_epochs": 10},
        callback_kwargs={"recapture_wait": False},
        fused=True,
    )
    assert run[2].global_step == base[2].global_step
    s = cb.summary()
    assert s["graphs"] == 4 and s["recaptures"] >= 2, s  # three roles, then the plain step
    assert_same_state(base, run)


class ReadsTheGradientNormOnTheHost(TinyMLP):
    """A host read in `on_before_optimizer_step`: only the closing micro-batch's step can't be captured."""

    def on_before_optimizer_step(self, optimizer):
        _ = self.head.weight.grad.norm().item()


@pytest.mark.parametrize("fused", [False, True])
def test_a_refused_closing_micro_batch_after_replayed_micro_batches_leaves_the_fit_plain(fused):
    """Factor 4: the adding micro-batches' graph is captured and replayed before the closing micro-batch's
    warm-up refuses the fit; no capture switched the optimizer, so the fit is plain Lightning's bit for
    bit, foreach AdamW included."""
    kw = {"trainer_kwargs": {"accumulate_grad_batches": 4}, "fused": fused}
    plain = fit(ReadsTheGradientNormOnTheHost, steps=20, **kw)
    cb = callback(check_share=1.0)
    with pytest.warns(UserWarning, match="reading a tensor's value on the host"):
        run = fit(ReadsTheGradientNormOnTheHost, [cb], steps=20, **kw)
    s = cb.summary()
    assert s["captured"] and s["reason"] and s["capturable_from_step"] is None, s
    assert emu.FakeGraph.replays >= 1  # the adding micro-batches' graph made their update before the refusal
    assert_same_state(plain, run)


@pytest.mark.parametrize(
    ("argv", "named"),
    [
        (["--factor", "1"], "--factor must be at least 2 (got 1)"),
        (["--steps", "0"], "--steps must be positive (got 0)"),
        (["--only", "no_such_idiom"], "--only: unknown idioms ['no_such_idiom']"),
    ],
)
def test_the_accumulation_sweep_names_a_bad_argument(argv, named, tmp_path):
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    script = root / "benchmarks" / "sweep_idioms_accumulated.py"
    proc = subprocess.run(
        [sys.executable, str(script), "--out", str(tmp_path), *argv],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2 and named in proc.stderr, proc.stderr


def test_the_accumulation_sweep_judges_an_idiom(tmp_path):
    import json
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    script = root / "benchmarks" / "sweep_idioms_accumulated.py"
    proc = subprocess.run(
        [
            sys.executable,
            str(script),
            "--out",
            str(tmp_path),
            "--only",
            "cleanrl_ppo,manual_gan",
            "--steps",
            "8",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = {r["module"]: r for r in json.loads((tmp_path / "idioms_accumulated_f2.json").read_text())["rows"]}
    assert rows["cleanrl_ppo"]["verdict"] == "captured, its baseline" and rows["cleanrl_ppo"]["graphs"] == 2
    assert rows["manual_gan"]["verdict"] == "Lightning refuses it"


def test_the_put_off_checks_of_every_roles_graph_are_counted():
    from l2lightning.graph.graph_slots import GraphSlots

    slots = GraphSlots(0.02)
    slots.state.check_schedule.deferred = 2
    slots.enter((False, False))  # the plain role's schedule parked with its 2
    slots.state.check_schedule.deferred = 3
    slots.enter((True, False))
    slots.state.check_schedule.deferred = 1
    assert slots.deferred() == 6 and len(list(slots.schedules())) == 3
    slots.enter((False, True))  # back to the first: its own 2 current, the others' 4 parked
    assert slots.state.check_schedule.deferred == 2 and slots.deferred() == 6
    slots.clear()
    assert slots.deferred() == 6  # dropped graphs' put-off checks stay in the fit's count


def test_a_roles_state_is_one_object_every_part_reads_through_the_same_slots():
    """The per-graph state is a RoleState the parts reach through the callback's one GraphSlots: a role's
    switch is seen by all of them, a new role starts fresh, a typo in a field's name raises."""
    from l2lightning import L2GraphCallback
    from l2lightning.graph.graph_slots import RoleState

    cb = L2GraphCallback(check_share=0.05)
    slots = cb._slots
    assert cb._prefetch._slots is slots and cb._overrides._slots is slots
    first = slots.state
    assert isinstance(first, RoleState) and first.check_schedule.share == 0.05 and first.graph is None
    slots.enter((False, False))
    assert slots.state is not first and slots.state.graph is None and slots.state.memo is not first.memo
    with pytest.raises(AttributeError):
        slots.state.graphs = "a typo"  # slots: no second, unread copy
    cb._reset_run_state()
    assert cb._slots is not slots and cb._prefetch._slots is cb._slots and cb._overrides._slots is cb._slots


def test_the_gate_trial_moves_with_its_roles_graph():
    """The whole-step gate's trial is per graph (`_slots.state.gate`): another role's step finds no trial
    of its own and sees it under way elsewhere; the trial's role gets it back."""
    from l2lightning import L2GraphCallback

    cb = L2GraphCallback()
    slots, trial = cb._slots, object()
    assert slots.current == (False, True) and slots.state.gate is None and not hasattr(cb._prefetch, "gate")
    slots.state.gate, slots.state.graph = trial, "the closing step's graph"
    slots.enter((False, False))  # a window's first micro-batch: its own, fresh state
    assert slots.state.gate is None and slots.state.graph is None and slots.gate_elsewhere()
    slots.enter((False, True))
    assert slots.state.gate is trial and slots.state.graph == "the closing step's graph"
    assert not slots.gate_elsewhere()


def test_the_live_logged_values_move_with_their_roles_graph():
    """The logged Python numbers a graph's replays re-evaluate are per graph (`_slots.state.live_log_values`,
    which the overrides part reads): another role's step finds none of its own; the role gets them back."""
    from l2lightning import L2GraphCallback

    cb = L2GraphCallback()
    slots, live = cb._slots, {"train/lr"}
    assert slots.state.live_log_values == set() and not hasattr(cb._overrides, "live_log_values")
    slots.state.live_log_values = live
    slots.enter((False, False))  # a window's first micro-batch: its own, fresh state
    assert slots.state.live_log_values == set()
    slots.state.live_log_values.add("train/step")
    slots.enter((True, False))
    assert slots.state.live_log_values == set()  # a fresh set, not the first micro-batch's
    slots.enter((False, True))
    assert slots.state.live_log_values is live
    slots.enter((False, False))
    assert slots.state.live_log_values == {"train/step"}


def test_graph_pool_mib_adds_the_pools_of_every_roles_graph():
    """`summary()["graph_pool_mib"]` is what the graphs alive together reserved: with factor 4, the
    three roles' graphs (the capture's own reading of the CUDA allocator is GPU-only; here each graph
    is given a size, and the sum is read while the fit holds them)."""
    from lightning.pytorch.callbacks import Callback

    seen = {}

    class ReadPools(Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if trainer.global_step == 8 and "sum" not in seen:
                graphs = [cb._slots.state.graph, *cb._slots.parked_graphs()]
                for size, graph in zip((1.0, 2.0, 4.0), graphs):
                    graph.pool_mib = size
                seen["graphs"] = len(graphs)
                seen["sum"] = cb._capture._pools_alive_mib(cb._slots.state.graph)
                seen["unsized"] = cb._capture._pools_alive_mib(
                    type(cb._slots.state.graph)(graph=None, static=None, key=())
                )

    cb = callback()
    fit(TinyMLP, [cb, ReadPools()], steps=10, trainer_kwargs={"accumulate_grad_batches": 4}, fused=True)
    assert seen == {"graphs": 3, "sum": 7.0, "unsized": 6.0}, seen
    assert cb.summary()["graph_pool_mib"] is None  # off CUDA no capture measures its pool
