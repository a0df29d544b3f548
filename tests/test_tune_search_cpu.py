"""The autotuner's search on CPU: pruning by the L2 rule, the staged race and gate with an injected fake
bench, the per-shape time budget with a fake clock, the plan cache, and the report's mapping to a chain."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from l2lightning.prefetch.chain import Layer, discover_chain
from l2lightning.prefetch.hooks import PrefetchHooks, resolve_plans
from l2lightning.prefetch.install import Issuer
from l2lightning.prefetch.plan import KINDS, MIB, PrefetchPlan
from l2lightning.tune.cache import PlanCache
from l2lightning.tune.candidates import (
    candidate_grid,
    chain_step_plans,
    ineligibility,
    make_plan,
    prune_candidates,
)
from l2lightning.tune.report import TuningReport, TuningRow
from l2lightning.tune.search import Autotuner
from l2lightning.tune.throwaway import SkipShape, build_throwaway, copies_for
from tests.tune_fakes import L2, Factory, FakeClock, fake_layer, hint8_wins, tuner


# ---------------------------------------------------------------------- pruning
def test_l2_rule_prunes_layers_that_do_not_fit_with_their_neighbours():
    small_l2 = 32 * MIB
    d1, d2 = make_plan("hint", 8), make_plan("hint", 8, 2)
    assert ineligibility(d1, 12 * MIB, small_l2, None) is None  # 24 MiB fits
    assert "do not fit" in ineligibility(d2, 12 * MIB, small_l2, None)  # 36 MiB does not
    assert prune_candidates([d1, d2], 20 * MIB, small_l2, None) == []
    assert prune_candidates([d1, d2], 20 * MIB, L2, None) == [d1, d2]  # 60 MiB: 3 x 20 fits exactly


def test_issue_rate_rule_prunes_too_few_blocks():
    layer, op = int(4.5 * MIB), 11.6e-6  # d=1536 in bf16, the measured op time at batch 16
    kept = prune_candidates(candidate_grid(["hint"], distances=(1,)), layer, L2, op)
    assert [p.blocks for p in kept] == [2, 4, 8, 16, 32]  # one block lost 60-412% on the H200
    assert "block(s)" in ineligibility(make_plan("hint", 1), layer, L2, op)
    # the measured winners at 12.5 MiB survive: hint4 and hint8 with ~15 us ops
    assert ineligibility(make_plan("hint", 4), int(12.5 * MIB), L2, 15.5e-6) is None


def test_make_plan_uses_one_warp_per_bulk_block():
    assert make_plan("bulk_last", 16).threads == 32
    assert make_plan("hint", 8).threads == 256
    assert len(candidate_grid(KINDS)) == 4 * 6 * 2


def test_autotuner_skips_layers_outside_the_rule_without_measuring():
    clock = FakeClock()
    factory = Factory(clock, hint8_wins)
    huge = fake_layer(d=4096, index=0, name="huge")  # 32 MiB: 2 x 32 > 60 MiB
    tiny = fake_layer(d=256, index=1, name="tiny")  # 128 KiB
    report = tuner(clock, factory).tune([huge, tiny], "cpu", ("forward",))
    assert factory.benches == []
    assert [r.chosen for r in report.rows] == [False, False]
    assert "L2" in report.rows[0].reason and "not worth a launch" in report.rows[1].reason


# ---------------------------------------------------------------------- search and gate
def test_clear_winner_is_chosen_with_a_confirmed_interval():
    clock = FakeClock()
    factory = Factory(clock, hint8_wins)
    report = tuner(clock, factory).tune([fake_layer()], "cpu", ("forward",))
    (row,) = report.rows
    assert row.chosen, row.reason
    assert row.plan == make_plan("hint", 8)
    assert 0.04 < row.ci_low < row.gain < row.ci_high < 0.06
    assert row.decoy_gain < 0 and row.measured and not row.from_cache
    assert row.candidates <= 10  # staged: block counts, then flavours at the best count
    assert factory.benches[0].closed


def test_the_best_flavour_wins_the_second_stage():
    def bulk_last_best(plan):
        gain = hint8_wins(plan)
        return 0.07 if (plan.kind, plan.blocks, plan.distance) == ("bulk_last", 8, 1) else gain

    clock = FakeClock()
    report = tuner(clock, Factory(clock, bulk_last_best)).tune([fake_layer()], "cpu", ("forward",))
    assert report.rows[0].chosen and report.rows[0].plan == make_plan("bulk_last", 8)


@pytest.mark.parametrize(
    ("gain_of", "decoy_gain", "noise", "why"),
    [
        (lambda p: 0.004, -0.02, 0.002, "too small"),  # below +1%
        (lambda p: -0.05, -0.02, 0.002, "loses"),
        (lambda p: 0.015, -0.02, 0.05, "inside the noise"),
        (lambda p: 0.04, 0.04, 0.002, "no better than its decoy"),
    ],
)
def test_plans_that_do_not_provably_pay_run_plain(gain_of, decoy_gain, noise, why):
    clock = FakeClock()
    factory = Factory(clock, gain_of, decoy_gain=decoy_gain, noise=noise)
    report = tuner(clock, factory).tune([fake_layer()], "cpu", ("forward",))
    (row,) = report.rows
    assert not row.chosen, f"{why}: {row.reason}"
    assert report.plans_for([fake_layer()], "forward") == [None]
    if why == "no better than its decoy":
        assert "decoy" in row.reason


def test_explicit_candidates_are_raced_alone():
    clock = FakeClock()
    factory = Factory(clock, hint8_wins)
    plans = [make_plan("hint", 8), make_plan("hint", 16)]
    report = tuner(clock, factory, candidates=plans).tune([fake_layer()], "cpu", ("forward",))
    seen = {k[0] for k in factory.benches[0].calls if k[0] is not None}
    assert seen <= set(plans)
    assert report.rows[0].plan == plans[0]


def test_a_shape_that_cannot_be_built_runs_plain():
    def factory(layer, phase, device, max_copies):
        raise SkipShape("cannot deep-copy Weird")

    report = tuner(FakeClock(), factory).tune([fake_layer()], "cpu", ("forward", "backward"))
    assert [r.reason for r in report.rows] == ["cannot deep-copy Weird"] * 2
    assert not any(r.chosen for r in report.rows)


def test_a_failing_candidate_is_dropped_not_fatal():
    clock = FakeClock()
    factory = Factory(clock, hint8_wins)

    def flaky(layer, phase, device, max_copies):
        bench = factory(layer, phase, device, max_copies)
        sample = bench.sample

        def sample_or_fail(plan, decoy=False):
            if plan is not None and plan.blocks == 16:
                raise RuntimeError("capture failed")
            return sample(plan, decoy)

        bench.sample = sample_or_fail
        return bench

    report = tuner(clock, flaky).tune([fake_layer()], "cpu", ("forward",))
    assert report.rows[0].chosen and report.rows[0].plan.blocks == 8


def test_out_of_memory_while_building_a_chain_reaches_the_caller():
    """Unlike a shape that cannot be built, running out of memory is not the shape's fault: it
    reaches the caller (L2GraphCallback captures without prefetch, with one warning)."""

    def factory(layer, phase, device, max_copies):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 64.00 MiB")

    with pytest.raises(torch.OutOfMemoryError, match="64.00 MiB"):
        tuner(FakeClock(), factory).tune([fake_layer()], "cpu", ("forward",))


@pytest.mark.parametrize(
    "when",
    ["plain sample", "candidate race", "confirmation"],
)
def test_out_of_memory_while_timing_reaches_the_caller_with_the_bench_closed(when):
    """An allocator error in any of the search's stages is not taken for a failing candidate (which
    would leave the tuner trying every later shape in a full GPU): it propagates, and the bench
    whose chain and graphs hold the memory is closed on the way out."""
    clock = FakeClock()
    factory = Factory(clock, hint8_wins)

    def failing(layer, phase, device, max_copies):
        bench = factory(layer, phase, device, max_copies)
        sample = bench.sample
        taken = {"plain": 0}

        def sample_or_fail(plan, decoy=False):
            if plan is None:
                taken["plain"] += 1
            stage = (
                "plain sample"
                if plan is None and taken["plain"] == 1
                else "candidate race"
                if plan is not None and not decoy
                else "confirmation"
                if decoy
                else None
            )
            if stage == when:
                raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
            return sample(plan, decoy)

        bench.sample = sample_or_fail
        return bench

    with pytest.raises(torch.OutOfMemoryError):
        tuner(clock, failing).tune([fake_layer(), fake_layer(d=2048, index=1, name="b")], "cpu", ("forward",))
    assert len(factory.benches) == 1 and factory.benches[0].closed  # no later shape was tried


# ---------------------------------------------------------------------- budget
@pytest.mark.parametrize("budget", [0.6, 0.3])
def test_per_shape_budget_is_honoured_with_a_fake_clock(budget):
    clock = FakeClock()
    # slow captures and samples, so the budget, not the search, ends the tuning
    factory = Factory(clock, hint8_wins, capture_s=0.03, sample_s=0.012)
    layers = [fake_layer(d=2560, name="a"), fake_layer(d=2048, index=1, name="b")]
    report = tuner(clock, factory, budget_s=budget).tune(layers, "cpu", ("forward", "backward"))
    assert len(report.rows) == 4
    for shape, seconds in report.seconds_per_shape().items():
        assert seconds <= budget + 1e-9, (shape, seconds)
    assert all(r.samples > 0 for r in report.rows)
    assert clock.now <= 2 * budget + 1e-9
    # forward may use at most its share; backward gets the rest
    fwd = [r for r in report.rows if r.phase == "forward"]
    assert all(r.seconds <= 0.4 * budget + 1e-9 for r in fwd)


def test_a_budget_too_small_to_confirm_rejects():
    clock = FakeClock()
    factory = Factory(clock, hint8_wins, capture_s=0.05, sample_s=0.02)
    report = tuner(clock, factory, budget_s=0.2).tune([fake_layer()], "cpu", ("forward",))
    (row,) = report.rows
    assert not row.chosen
    assert row.seconds <= 0.2 + 1e-9


def test_more_budget_means_more_samples():
    def samples(budget):
        clock = FakeClock()
        factory = Factory(clock, lambda p: 0.004, noise=0.01)  # undecided: uses all it gets
        return (
            tuner(clock, factory, budget_s=budget).tune([fake_layer()], "cpu", ("forward",)).rows[0].samples
        )

    assert samples(2.0) > samples(0.3)


# ---------------------------------------------------------------------- RNG, cache
def test_the_rng_is_left_as_it_was():
    layer = fake_layer()  # nn.Linear's own init draws from the RNG: before the snapshot
    torch.manual_seed(123)
    state = torch.get_rng_state()
    clock = FakeClock()
    tuner(clock, Factory(clock, hint8_wins)).tune([layer], "cpu", ("forward",))
    assert torch.equal(torch.get_rng_state(), state)


def test_a_training_forward_plan_is_measured_in_its_own_context(tmp_path, monkeypatch):
    # Tuning both phases is a training step: its forward row is context "train", cached apart from
    # a forward-only (inference) decision, and the CUDA bench runs forward + backward graphs.
    monkeypatch.delenv("L2L_RETUNE", raising=False)
    versions = {"torch": "t", "cupy": "c", "kernel": "k", "l2lightning": "v"}
    clock = FakeClock()
    factory = Factory(clock, hint8_wins)
    cache = PlanCache(tmp_path / "plans.json", versions=versions, retune=False)
    inference = tuner(clock, factory, cache=cache).tune([fake_layer()], "cpu", ("forward",))
    assert [(r.phase, r.context) for r in inference.rows] == [("forward", "")]
    training = tuner(clock, factory, cache=cache).tune([fake_layer()], "cpu", ("forward", "backward"))
    assert [(r.phase, r.context) for r in training.rows] == [("forward", "train"), ("backward", "")]
    assert not training.rows[0].from_cache, "a forward-only decision must not stand in for training"
    assert "forward@train" in training.table()
    assert TuningRow.from_dict(training.rows[0].to_dict()).context == "train"

    made = []

    class RecordingBench:
        def __init__(self, layer, phase, device, **kw):
            made.append((phase, kw["training"]))

    monkeypatch.setattr("l2lightning.tune.search.CudaShapeBench", RecordingBench)
    real = Autotuner(cache=None)
    real._factory("train")(fake_layer(), "forward", torch.device("cpu"), max_copies=4)
    real._factory("")(fake_layer(), "forward", torch.device("cpu"), max_copies=4)
    assert made == [("forward", True), ("forward", False)]


def test_cached_decisions_are_reused_and_retune_measures_again(tmp_path, monkeypatch):
    monkeypatch.setenv("L2L_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("L2L_RETUNE", raising=False)
    versions = {"torch": "t", "cupy": "c", "kernel": "k", "l2lightning": "v"}
    clock = FakeClock()
    factory = Factory(clock, hint8_wins)
    first = tuner(clock, factory, cache=PlanCache(versions=versions)).tune(
        [fake_layer()], "cpu", ("forward",)
    )
    assert len(factory.benches) == 1 and first.rows[0].chosen
    assert (tmp_path / "plans.json").is_file()

    second = tuner(clock, factory, cache=PlanCache(versions=versions)).tune(
        [fake_layer()], "cpu", ("forward",)
    )
    assert len(factory.benches) == 1, "a cache hit must not measure"
    row = second.rows[0]
    assert row.from_cache and row.chosen and row.plan == first.rows[0].plan
    assert row.tuned_seconds == pytest.approx(first.rows[0].seconds)
    assert row.seconds == 0.0

    monkeypatch.setenv("L2L_RETUNE", "1")
    third = tuner(clock, factory, cache=PlanCache(versions=versions)).tune(
        [fake_layer()], "cpu", ("forward",)
    )
    assert len(factory.benches) == 2 and not third.rows[0].from_cache

    # other settings, other key: a decision made under one gate is not reused under another
    monkeypatch.delenv("L2L_RETUNE")
    tuner(clock, factory, cache=PlanCache(versions=versions), min_gain=0.02).tune(
        [fake_layer()], "cpu", ("forward",)
    )
    assert len(factory.benches) == 3


def test_rule_decisions_are_not_cached(tmp_path):
    cache = PlanCache(tmp_path / "plans.json", versions={"torch": "t"}, retune=False)
    clock = FakeClock()
    tuner(clock, Factory(clock, hint8_wins), cache=cache).tune([fake_layer(d=256)], "cpu", ("forward",))
    assert not (tmp_path / "plans.json").exists()


# ---------------------------------------------------------------------- report
def ln_linear_stack(d=1024, n=3):
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.LayerNorm(d), nn.Linear(d, d), nn.GELU()) for _ in range(n)])


def test_plans_for_counts_distance_in_significant_layers():
    model = ln_linear_stack()
    x = torch.randn(2, 1024)
    chain = discover_chain(model, x)
    # LayerNorm(1024)'s 4 KiB scale is a chain step, the 4 MiB Linear is the significant layer
    assert [layer.name for layer in chain] == ["0.0", "0.1", "1.0", "1.1", "2.0", "2.1"]
    linear = chain[1].shape_key
    plan = make_plan("hint", 8)
    report = TuningReport(
        rows=[
            TuningRow(shape=linear, phase="forward", layer_bytes=chain[1].nbytes, plan=plan, chosen=True),
            TuningRow(shape=linear, phase="backward", layer_bytes=chain[1].nbytes, plan=plan, chosen=True),
        ]
    )
    forward = report.plans_for(chain, "forward")
    backward = report.plans_for(chain, "backward")
    assert [p.distance if p else None for p in forward] == [None, None, None, 2, None, 2]
    assert [p.distance if p else None for p in backward] == [None, 2, None, 2, None, None]

    class Recorder(Issuer):
        def __init__(self):
            self.events = []
            self.current = None

        def issue(self, layer, plan, phase):
            self.events.append((phase, layer.index))

        def join(self, phase):
            pass

    rec = Recorder()
    names = [layer.name for layer in chain]
    hooks = PrefetchHooks(
        model,
        x,
        plans=dict(zip(names, forward)),
        backward_plans=dict(zip(names, backward)),
        issuer=rec,
    )
    model(x).square().mean().backward()
    # forward: Linear 1 and 2 are fetched while the previous Linear runs; backward: Linear 0 and 1
    assert rec.events == [("forward", 3), ("forward", 5), ("backward", 3), ("backward", 1)]
    hooks.remove()


def test_table_and_dict():
    clock = FakeClock()
    # a forward + backward graph 3x the forward-only one: the training-context forward op stays as long
    report = tuner(clock, Factory(clock, hint8_wins, base=300e-6)).tune(
        [fake_layer(), fake_layer(d=256, index=1, name="t")], "cpu", ("forward", "backward")
    )
    text = report.table()
    assert "hint8" in text and "95% CI" in text and "not worth a launch" in text
    assert len(text.splitlines()) == 2 + 4
    data = json.loads(json.dumps(report.to_dict()))
    assert data["rows"][0]["plan"]["kind"] == "hint" and data["rows"][0]["plan_label"] == "hint8"
    assert TuningRow.from_dict(data["rows"][0]).plan == make_plan("hint", 8)


def test_log_table_goes_to_rank_zero_info(caplog):
    import logging

    caplog.set_level(logging.INFO)
    TuningReport(device="fake").log_table()
    assert "l2lightning autotune on fake" in caplog.text


def test_prefetch_hooks_auto_on_cpu_runs_plain(monkeypatch, tmp_path):
    monkeypatch.setenv("L2L_CACHE_DIR", str(tmp_path))

    class Recorder(Issuer):
        def issue(self, layer, plan, phase):
            raise AssertionError("nothing should be issued")

        def join(self, phase):
            pass

    model = ln_linear_stack(d=64)
    hooks = PrefetchHooks(model, torch.randn(2, 64), plans="auto", issuer=Recorder())
    assert hooks.forward_plans == [None] * len(hooks.chain)
    assert hooks.backward_plans == [None] * len(hooks.chain)
    assert all("not a CUDA GPU" in r.reason for r in hooks.tuning_report.rows)
    model(torch.randn(2, 64)).sum().backward()
    # "auto" for a phase that is not prefetched tunes nothing: an empty report, no timing.
    assert resolve_plans(hooks.chain, hooks.device, None, "auto", backward=False).tuning_report.rows == []


def test_exports():
    import l2lightning

    assert l2lightning.Autotuner is Autotuner and l2lightning.TuningReport is TuningReport


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"budget_s": 0}, "`budget_s`"),
        ({"candidates": []}, "`candidates`"),
        ({"candidates": ["hint8"]}, "`candidates`"),
        ({"min_gain": 0.7}, "`min_gain`"),
        ({"repeats": 2}, "`repeats`"),
        ({"repeats": 4, "min_repeats": 6}, "`min_repeats`"),
        ({"blocks": (0,)}, "`blocks`"),
        ({"distances": (9,)}, "`distances`"),
        ({"kinds": ("fast",)}, "`kinds`"),
        ({"replays": 0}, "`replays`"),
        ({"confidence": 1.0}, "`confidence`"),
    ],
)
def test_bad_arguments_are_named(kwargs, name):
    with pytest.raises(ValueError, match=name):
        Autotuner(cache=None, **kwargs)


def test_bad_types_are_named():
    with pytest.raises(TypeError, match="`clock`"):
        Autotuner(cache=None, clock=1.0)
    with pytest.raises(TypeError, match="`cache`"):
        Autotuner(cache="somewhere")
    with pytest.raises(ValueError, match="`phases`"):
        Autotuner(cache=None).tune([], "cpu", ("sideways",))
    with pytest.raises(TypeError, match="`chain`"):
        Autotuner(cache=None).tune([PrefetchPlan()], "cpu")


# ---------------------------------------------------------------------- the throwaway chain (CPU parts)
class RecordingIssuer(Issuer):
    def __init__(self):
        self.events = []

    def issue(self, layer, plan, phase):
        self.events.append((phase, layer.index))

    def join(self, phase):
        self.events.append((phase, "join"))


def chain_layer(module, x):
    (layer,) = [c for c in discover_chain(module, x)]
    return layer


def test_throwaway_chain_copies_with_fresh_weights_and_leaves_the_model_alone():
    torch.manual_seed(0)
    original = nn.Linear(64, 64)
    saved = [p.detach().clone() for p in original.parameters()]

    def must_not_fire(module, args):
        raise AssertionError("a hook of the real model fired inside the throwaway chain")

    original.register_forward_pre_hook(must_not_fire)
    layer = Layer(0, "lin", original, [original.weight], 64 * 64 * 4, (4, 64))
    t = build_throwaway(layer, "forward", l2_bytes=64 * 64 * 4 * 4)
    assert t.mode == "chain" and t.copies == 8  # 2 x L2 / layer bytes
    assert t.names == [f"layers.{i}" for i in range(8)]
    copies = list(t.model.layers)
    assert all(c.weight.data_ptr() != original.weight.data_ptr() for c in copies)
    assert not torch.equal(copies[0].weight, copies[1].weight)
    assert t.run().shape == (4, 64)
    for p, before in zip(original.parameters(), saved):
        assert torch.equal(p, before)


def test_throwaway_copies_the_layers_block_with_fresh_weights():
    model = nn.Sequential(*[nn.Sequential(nn.LayerNorm(64), nn.Linear(64, 64), nn.GELU()) for _ in range(3)])
    chain = discover_chain(model, torch.randn(4, 64))
    assert chain[1].block is model[1]
    saved = [p.detach().clone() for p in model.parameters()]
    t = build_throwaway(chain[1], "backward", l2_bytes=64 * 64 * 4 * 4)
    assert t.mode == "block" and t.copies == 8
    assert t.names == [f"layers.{i}.1" for i in range(8)]  # the Linear inside each block copy
    copies = list(t.model.layers)
    assert all(isinstance(c[0], nn.LayerNorm) and isinstance(c[2], nn.GELU) for c in copies)
    assert all(c[1].weight.data_ptr() != model[1][1].weight.data_ptr() for c in copies)
    assert not torch.equal(copies[0][1].weight, copies[1][1].weight)
    t.run()
    assert all(c[1].weight.grad is not None for c in copies)
    assert all(torch.equal(p, before) and p.grad is None for p, before in zip(model.parameters(), saved))


def test_a_wide_layernorm_is_a_companion_in_its_block_not_a_second_layer():
    d = 1100  # the LayerNorm's 4.4 KiB scale is a chain layer of its own (>= 4 KiB), the Linear 4.6 MiB
    model = nn.Sequential(*[nn.Sequential(nn.LayerNorm(d), nn.Linear(d, d), nn.GELU()) for _ in range(2)])
    chain = discover_chain(model, torch.randn(2, d))
    assert [layer.name for layer in chain] == ["0.0", "0.1", "1.0", "1.1"]
    linear = chain[1]
    assert linear.block is model[0] and linear.context == "Sequential(LayerNorm,Linear,GELU)"
    assert chain[0].block is None  # the LayerNorm's block holds a layer 1000x its size
    t = build_throwaway(linear, "forward", l2_bytes=None)
    assert t.mode == "block" and t.names == [f"layers.{i}.1" for i in range(t.copies)]
    assert t.steps == [f"layers.{i}.{j}" for i in range(t.copies) for j in (0, 1)]
    # distance 1 = the previous Linear, two chain steps back (the LayerNorm between gets no plan)
    two_back = make_plan("hint", 8, 2)
    forward = t.plans(make_plan("hint", 8, 1), "forward")
    assert forward == {f"layers.{i}.1": two_back for i in range(1, t.copies)}
    backward = t.plans(make_plan("hint", 8, 1), "backward")
    assert backward == {f"layers.{i}.1": two_back for i in range(t.copies - 1)}


def test_distances_count_significant_layers_in_the_bench_and_the_model_alike():
    # chain steps: LN0 Lin0 LN1 Lin1 LN2 Lin2; the Linears (1, 3, 5) are the significant ones
    d1, d2 = make_plan("hint", 8, 1), make_plan("hint", 8, 2)
    forward = chain_step_plans(6, [1, 3, 5], {1: d1, 3: d1, 5: d2}, "forward")
    # Lin1 is fetched while Lin0 runs (2 steps back), Lin2 while Lin0 runs (4 steps back)
    assert forward == [None, None, None, make_plan("hint", 8, 2), None, make_plan("hint", 8, 4)]
    backward = chain_step_plans(6, [1, 3, 5], {1: d1, 3: d1, 5: d1}, "backward")
    assert backward == [None, make_plan("hint", 8, 2), None, make_plan("hint", 8, 2), None, None]
    # more than 8 steps away: plain
    assert chain_step_plans(12, [0, 11], {11: d1}, "forward") == [None] * 12


def test_throwaway_is_at_least_as_long_as_the_models_run_of_that_shape():
    lin = nn.Linear(64, 64)
    layer = Layer(0, "l", lin, [lin.weight], 64 * 64 * 4, (2, 64))
    assert build_throwaway(layer, "forward", l2_bytes=None).copies == 6
    assert build_throwaway(layer, "forward", l2_bytes=None, min_copies=20).copies == 20
    assert build_throwaway(layer, "forward", l2_bytes=None, min_copies=100).copies == 32


def test_throwaway_fan_mode_for_layers_that_change_shape():
    up = nn.Linear(64, 256)
    layer = Layer(0, "up", up, [up.weight], 64 * 256 * 4, (4, 64))
    t = build_throwaway(layer, "backward", l2_bytes=None)
    assert t.mode == "fan" and t.copies == 6
    assert len(t.inputs) == 6 and all(x.requires_grad for x in t.inputs)
    loss = t.run()
    assert loss.dim() == 0
    assert all(c.weight.grad is not None for c in t.model.layers)
    assert all(x.grad is not None for x in t.inputs)  # every copy computed grad-input (reads W)
    t.zero_grads()
    assert all(c.weight.grad is None for c in t.model.layers) and all(x.grad is None for x in t.inputs)


def test_throwaway_backward_order_in_fan_mode_matches_a_chain():
    up = nn.Linear(64, 256)
    layer = Layer(0, "up", up, [up.weight], 64 * 256 * 4, (4, 64))
    t = build_throwaway(layer, "backward", l2_bytes=None)
    rec = RecordingIssuer()
    plans = {name: make_plan("hint", 8) for name in t.names}
    hooks = PrefetchHooks(t.model, t.inputs, backward=True, plans={}, backward_plans=plans, issuer=rec)
    t.run()
    hooks.remove()
    backward = [e for e in rec.events if e[0] == "backward"]
    assert backward == [("backward", i) for i in range(4, -1, -1)] + [("backward", "join")]


def test_throwaway_embedding_gets_integer_input():
    emb = nn.Embedding(1000, 64)
    layer = Layer(0, "emb", emb, [emb.weight], 1000 * 64 * 4, (4, 16))
    t = build_throwaway(layer, "forward", l2_bytes=None)
    assert t.mode == "fan" and t.inputs[0].dtype == torch.int64
    assert t.run()[0].shape == (4, 16, 64)


def test_throwaway_refuses_what_it_cannot_rebuild():
    import threading

    class Locked(nn.Linear):
        def __init__(self):
            super().__init__(8, 8)
            self.lock = threading.Lock()  # cannot be deep-copied

    m = Locked()
    with pytest.raises(SkipShape, match="deep-copy"):
        build_throwaway(Layer(0, "l", m, [m.weight], 256, (2, 8)), "forward", None)
    lin = nn.Linear(8, 8)
    with pytest.raises(SkipShape, match="failed on a random"):
        build_throwaway(Layer(0, "l", lin, [lin.weight], 256, (2, 3)), "forward", None)
    with pytest.raises(SkipShape, match="input shape is unknown"):
        build_throwaway(Layer(0, "l", lin, [lin.weight], 256, None), "forward", None)
    with pytest.raises(SkipShape, match="not enough free memory"):
        build_throwaway(Layer(0, "l", lin, [lin.weight], 256, (2, 8)), "forward", None, max_bytes=300)


def test_copies_for_bounds():
    assert copies_for(12 * MIB, L2) == 10
    assert copies_for(32 * MIB, L2) == 6
    assert copies_for(MIB, L2) == 32
    assert copies_for(MIB, None) == 6
