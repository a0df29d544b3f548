"""CPU (graph emulator): what a re-capture costs and repeats of the fit's first capture.

A re-capture runs no warm-up step and keeps the first capture's prefetch set-up; the graph it
replaces dies by reference count before it, so it collects the young generations only (the full
collection was 0.31-0.33 s of a 0.34 s re-capture on the H200); and what the re-capture wait weighs
is what a later capture will cost, not what only the first one spends. The emulated CPU has no
CUDA memory: the tests below show ``_capture_into`` a CUDA that is available, whose collections and
cache release they count."""

from __future__ import annotations

import gc
import time
import types
import weakref

import pytest
import torch

from l2lightning import L2GraphCallback
from l2lightning.callback import fit_report, prefetch_setup, step_capture
from l2lightning.callback.warmup_steps import WarmupSteps
from tests.baselines import (
    baseline_of,
    capturable_from_of_the_last_callback_fit,  # noqa: F401 -- records switch steps
)
from tests.callback.test_recapture_wait_cpu import EPOCHS, EpochWeight, FixedCosts
from tests.replay_helpers import assert_same, fit

pytestmark = pytest.mark.usefixtures("emulated_cuda_graphs")

FULL_COLLECTION_S = 0.2  # what the first capture's full collection is made to take (0.32 s on the H200)


class _Seen(list):
    sleep: list[float]


@pytest.fixture
def collections(monkeypatch):
    """`_capture_into` sees CUDA available: its full collections (free_cached_memory), young ones
    (gc.collect(1)) and cache releases are counted; the full one sleeps FULL_COLLECTION_S."""
    seen = _Seen()

    class Cuda:
        def __getattr__(self, name):
            return getattr(torch.cuda, name)

        @staticmethod
        def is_available():
            return True

        @staticmethod
        def memory_reserved(*args):
            return 0

        @staticmethod
        def empty_cache():
            seen.append("empty_cache")

    class Torch:
        cuda = Cuda()

        def __getattr__(self, name):
            return getattr(torch, name)

    def full():
        seen.append("full")
        time.sleep(sleep[0])

    sleep = [FULL_COLLECTION_S]

    def collect(generation=2):
        seen.append(f"collect({generation})")
        return gc.collect(generation)

    def full_before_tuning():
        seen.append("full before tuning")
        time.sleep(sleep[0])

    monkeypatch.setattr(step_capture, "torch", Torch())
    monkeypatch.setattr(step_capture, "free_cached_memory", full)
    # the prefetch set-up's own full collection, before its tuning (with prefetch on)
    monkeypatch.setattr(prefetch_setup, "torch", Torch())
    monkeypatch.setattr(prefetch_setup, "free_cached_memory", full_before_tuning)
    monkeypatch.setattr(step_capture, "gc", types.SimpleNamespace(collect=collect))
    seen.sleep = sleep  # a test may make the full collection slower
    return seen


def test_a_recapture_collects_the_young_generations_only_and_stays_the_baseline(collections):
    base = fit(baseline_of(EpochWeight), **EPOCHS)
    cb = L2GraphCallback(prefetch="off", log_timing=False, operand_scalars=False)
    run = fit(EpochWeight, [cb], **EPOCHS)
    summary = cb.summary()
    assert summary["captures"] == 3, summary
    # the first capture: the full collection; the two re-captures: a young one and the cache release
    assert collections == ["full", "collect(1)", "empty_cache", "collect(1)", "empty_cache"], collections
    assert_same(base, run)


def test_a_first_capture_after_the_prefetch_set_ups_full_collection_collects_the_young_generations_only(
    collections,
):
    """With prefetch on, the capture step's prefetch set-up collects all generations before tuning;
    the capture a moment later in the same step collects the young ones only (a second full walk
    of the process's objects would find nothing the first left), and the fit stays its baseline.
    (Here the set-up finds no CuPy and captures without prefetch, after its collection.)"""
    base = fit(baseline_of(EpochWeight), **EPOCHS)
    cb = L2GraphCallback(log_timing=False, operand_scalars=False)
    with pytest.warns(UserWarning, match=r"prefetch off \("):
        run = fit(EpochWeight, [cb], **EPOCHS)
    summary = cb.summary()
    assert summary["captures"] == 3, summary
    assert collections == [
        "full before tuning",
        "collect(1)",
        "empty_cache",
        "collect(1)",
        "empty_cache",
        "collect(1)",
        "empty_cache",
    ], collections
    # the first capture spent no full collection of its own: nothing for the re-capture wait to leave out
    assert summary["tuning_s"] >= FULL_COLLECTION_S
    assert_same(base, run)


def test_the_graph_a_recapture_replaces_dies_by_reference_count_before_it(monkeypatch):
    """What lets a re-capture skip the full collection: with the collector off, the old graph (and
    so, on a GPU, its pool) is gone when the new capture starts."""
    alive: list[list[bool]] = []
    graphs: list[weakref.ref] = []
    capture_into = step_capture.StepCapture._capture_into

    def watching(part, graph, *args, **kwargs):
        """The capture part's `_capture_into` (the fit's only callback's): which graphs are still alive."""
        alive.append([ref() is not None for ref in graphs])
        graphs.extend([weakref.ref(graph), weakref.ref(graph.graph)])
        return capture_into(part, graph, *args, **kwargs)

    monkeypatch.setattr(step_capture.StepCapture, "_capture_into", watching)
    cb = L2GraphCallback(prefetch="off", log_timing=False, operand_scalars=False)
    gc.disable()
    try:
        fit(EpochWeight, [cb], **EPOCHS)
    finally:
        gc.enable()
    assert cb.summary()["captures"] == 3
    assert alive == [[], [False, False], [False, False, False, False]], alive


def test_what_the_wait_weighs_leaves_out_the_first_captures_full_collection(collections):
    cb = L2GraphCallback(prefetch="off", log_timing=False, recapture_wait=False, operand_scalars=False)
    fit(EpochWeight, [cb], steps=8)
    summary = cb.summary()
    assert summary["captures"] == 1, summary
    # capture_s is the capture's wall time, the collection included; the wait's cost leaves it out
    assert summary["capture_s"] >= FULL_COLLECTION_S
    assert summary["capture_s"] - cb._costs.last_capture_s == pytest.approx(cb._costs.once_s, abs=1e-6)
    assert cb._costs.once_s >= FULL_COLLECTION_S


@pytest.fixture
def measured_steps(monkeypatch):
    monkeypatch.setattr(fit_report._Timing, "eager_ms", lambda self: 5.0)
    monkeypatch.setattr(fit_report._Timing, "graph_ms", lambda self: 1.0)


class MeasuredCosts(L2GraphCallback):
    """The wait on the CPU, with the capture costs this fit measures (FixedCosts fixes them)."""

    _RENTAL_DEVICES = ("cpu",)


@pytest.mark.usefixtures("measured_steps")
def test_the_wait_after_a_first_capture_with_a_slow_collection_does_not_weigh_it(collections):
    """A first capture whose full collection takes 0.5 s: weighed in, the wait after the change at
    step 16 would be for 0.5 s or more of forgone replays (125 steps at 4 ms): the fit would end
    waiting. Left out, it waits for what the emulated capture itself took."""
    collections.sleep[0] = 0.5
    base = fit(baseline_of(EpochWeight), **EPOCHS)
    cb = MeasuredCosts(prefetch="off", log_timing=False, check_share=1.0, operand_scalars=False)
    run = fit(EpochWeight, [cb], **EPOCHS)
    summary = cb.summary()
    assert summary["recapture_wait_steps"] > 0, summary
    assert 0 < cb._slots.state.rent_target_s < 0.5, (cb._slots.state.rent_target_s, summary)
    assert summary["capture_s"] >= 0.5, summary
    assert_same(base, run)


@pytest.mark.usefixtures("measured_steps")
def test_the_summary_reports_the_recaptures_and_the_waited_steps():
    base = fit(baseline_of(EpochWeight), **EPOCHS)
    cb = FixedCosts(prefetch="off", log_timing=False, check_share=1.0, operand_scalars=False)
    run = fit(EpochWeight, [cb], **EPOCHS)
    summary = cb.summary()
    # as in test_recapture_wait_cpu: two waits of 5 steps, two re-captures
    assert summary["recaptures"] == 2 and summary["recapture_wait_steps"] == 10, summary
    assert 0 < summary["last_recapture_s"] <= summary["recapture_s"] < summary["capture_s"] + 1e-6, summary
    assert_same(base, run)


def test_without_a_recapture_the_summary_says_so():
    cb = L2GraphCallback(prefetch="off", log_timing=False, operand_scalars=False)
    fit(EpochWeight, [cb], steps=8)
    summary = cb.summary()
    assert summary["recaptures"] == 0 and summary["last_recapture_s"] is None, summary
    assert summary["recapture_wait_steps"] == 0 and summary["recapture_s"] == 0.0, summary


class _Hooks:
    """A stand-in for the prefetch hooks (the CPU has no prefetch kernel): tuned once, no plan kept."""

    enabled = True
    via = "hooks"
    tuning_report = None

    def plan_summary(self):
        return []

    def scope(self):
        import contextlib

        return contextlib.nullcontext()

    def remove(self):
        pass


def test_a_recapture_warms_up_no_step_and_keeps_the_first_captures_prefetch_set_up(monkeypatch):
    base = fit(baseline_of(EpochWeight), **EPOCHS)
    calls = {"tuned": 0, "trace": 0, "time": 0}

    def prefetch_hooks(self, module):
        calls["tuned"] += 1
        return _Hooks()

    for mode in ("trace", "time"):
        name = "traced_step" if mode == "trace" else "timed_step"
        original = getattr(WarmupSteps, name)

        def counted(self, *args, _original=original, _mode=mode, **kwargs):
            calls[_mode] += 1
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(WarmupSteps, name, counted)
    monkeypatch.setattr(prefetch_setup.PrefetchSetup, "_prefetch_hooks", prefetch_hooks)
    monkeypatch.setattr(step_capture, "free_cached_memory", lambda: None)
    cb = L2GraphCallback(prefetch="default", log_timing=False, operand_scalars=False)
    run = fit(EpochWeight, [cb], **EPOCHS)
    summary = cb.summary()
    assert summary["captures"] == 3, summary
    # the warm-up of the fit's start only (2 traced steps, 1 timed); the set-up of the first capture
    assert calls == {"tuned": 1, "trace": 2, "time": 1}, calls
    assert_same(base, run)
