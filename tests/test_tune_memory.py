"""The autotuner's memory bound on CPU: throwaway chains sized from shapes before they are built, kept
within ``memory_budget`` (checked by the tuner's own ledger and by a fake allocator in the fake
benches), shortened without changing a plan's distance, shapes that do not fit left plain with the
reason said, the argument validated by name, and cached decisions reused without memory."""

from __future__ import annotations

import inspect
import warnings

import pytest
import torch
from torch import nn

from l2lightning._env import reset_warnings
from l2lightning.prefetch.chain import Layer, discover_chain
from l2lightning.prefetch.hooks import PrefetchHooks, make_autotuner
from l2lightning.prefetch.install import Issuer
from l2lightning.prefetch.plan import MIB
from l2lightning.tune.cache import PlanCache
from l2lightning.tune.candidates import make_plan
from l2lightning.tune.memory import (
    DEFAULT_MEMORY_BUDGET,
    FALLBACK_SAVED_INPUTS,
    ChainFootprint,
    MemoryLedger,
    chain_footprint,
    tensor_bytes,
)
from l2lightning.tune.search import Autotuner
from l2lightning.tune.throwaway import build_throwaway
from tests.tune_fakes import Factory, FakeClock, fake_layer, hint8_wins, tuner

# Shapes left plain for the budget warn once each; the tests that look for the warning catch it.
pytestmark = pytest.mark.filterwarnings("ignore:l2lightning. autotune leaves")

LAYER_2560 = 2560 * 2560 * 2  # a d=2560 Linear's weight in bf16: 12.5 MiB
VERSIONS = {"torch": "t", "cupy": "c", "kernel": "k", "l2lightning": "v"}


@pytest.fixture(autouse=True)
def _fresh_warnings():
    reset_warnings()  # the budget warning is shown once per shape and process
    yield
    reset_warnings()


class FakeAllocator:
    """What the fake benches hold now and the most they held at once, as a real allocator would count."""

    def __init__(self) -> None:
        self.now = 0
        self.peak = 0
        self.per_bench: list[int] = []

    def allocate(self, nbytes: int) -> None:
        self.now += nbytes
        self.peak = max(self.peak, self.now)
        self.per_bench.append(nbytes)

    def free(self, nbytes: int) -> None:
        self.now -= nbytes


class AllocatingFactory(Factory):
    """Fake benches whose chains allocate their copies' weights (and gradients in backward graphs)."""

    def __init__(self, clock, gain_of, allocator, **kw):
        super().__init__(clock, gain_of, **kw)
        self.allocator = allocator

    def __call__(self, layer, phase, device, max_copies):
        bench = super().__call__(layer, phase, device, max_copies)
        nbytes = bench.copies * layer.nbytes * (2 if phase == "backward" else 1)
        self.allocator.allocate(nbytes)
        close = bench.close

        def close_and_free():
            self.allocator.free(nbytes)
            close()

        bench.close = close_and_free
        return bench


def chain_of(*widths_and_counts):
    """Layer records of `count` layers of each width, in order (each layer its own weights)."""
    chain = []
    for d, count in widths_and_counts:
        for _ in range(count):
            chain.append(fake_layer(d=d, index=len(chain), name=f"l{len(chain)}"))
    return chain


def planned_distances(factory):
    return {key[0].distance for bench in factory.benches for key in bench.calls if key[0] is not None}


# ---------------------------------------------------------------------- the argument
def test_the_default_budget_is_a_quarter_of_the_parameter_bytes():
    assert DEFAULT_MEMORY_BUDGET == 0.25
    assert inspect.signature(Autotuner).parameters["memory_budget"].default == 0.25
    assert Autotuner(cache=None).memory_budget == 0.25
    assert make_autotuner(None).memory_budget == 0.25
    clock = FakeClock()
    tuned = Autotuner(
        cache=None, clock=clock, bench_factory=Factory(clock, hint8_wins), l2_bytes=60 * MIB, device_name="f"
    )
    report = tuned.tune([fake_layer()], "cpu", ("forward",), model_bytes=1000 * MIB)
    assert report.memory_budget == 0.25 and report.model_bytes == 1000 * MIB
    assert report.memory_budget_bytes == 250 * MIB
    # without model_bytes, the chain's parameters stand for the model's
    assert tuned.tune([fake_layer()], "cpu", ("forward",)).model_bytes == LAYER_2560


@pytest.mark.parametrize("value", [0, -0.25, float("nan"), float("inf"), True, "0.25", [0.25]])
def test_a_bad_memory_budget_is_named_with_what_is_accepted(value):
    with pytest.raises(ValueError, match=r"`memory_budget` must be a positive number.*or None"):
        Autotuner(cache=None, memory_budget=value)
    # the mapping L2GraphCallback(autotune=...) and Hydra's l2.autotune pass
    with pytest.raises(ValueError, match="`memory_budget`"):
        make_autotuner({"memory_budget": value})


def test_the_budget_is_reachable_from_the_callback_and_none_means_no_bound():
    from l2lightning import L2GraphCallback

    with pytest.raises(ValueError, match="`memory_budget`"):
        L2GraphCallback(autotune={"memory_budget": 0})
    assert make_autotuner(L2GraphCallback(autotune={"memory_budget": 2}).autotune).memory_budget == 2.0
    assert make_autotuner({"memory_budget": None}).memory_budget is None


def test_the_budget_is_configured_from_hydra():
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from l2lightning._resources import config_dir

    def autotune(override):
        with initialize_config_dir(str(config_dir()), version_base="1.3"):
            cfg = compose("train", overrides=[f"l2.autotune={override}"])
        return OmegaConf.to_container(cfg.l2.autotune)

    assert make_autotuner(autotune("{memory_budget: 0.5, cache: null}")).memory_budget == 0.5
    assert make_autotuner(autotune("{memory_budget: null, cache: null}")).memory_budget is None
    with pytest.raises(ValueError, match="`memory_budget`"):
        make_autotuner(autotune("{memory_budget: 0, cache: null}"))


def test_model_bytes_is_checked_by_name():
    with pytest.raises(ValueError, match="`model_bytes`"):
        Autotuner(cache=None).tune([fake_layer()], "cpu", ("forward",), model_bytes=-1)


# ---------------------------------------------------------------------- the bound
@pytest.mark.parametrize("budget", [0.5, 1.0, 2.0])
def test_copies_held_never_exceed_the_budget(budget):
    clock = FakeClock()
    allocator = FakeAllocator()
    factory = AllocatingFactory(clock, hint8_wins, allocator)
    chain = chain_of((2560, 4), (2048, 4), (1536, 4))
    model_bytes = tensor_bytes(layer.weights[0] for layer in chain)
    limit = int(budget * model_bytes)
    report = tuner(clock, factory, memory_budget=budget).tune(chain, "cpu", ("forward", "backward"))
    assert report.memory_budget_bytes == limit
    measured = [r for r in report.rows if r.measured]
    assert measured, report.table()
    # the tuner's own ledger: per row and the most held at once
    assert all(0 < r.held_bytes <= limit for r in measured)
    assert report.memory_peak_bytes == max(r.held_bytes for r in measured) <= limit
    per_shape = report.held_bytes_per_shape()
    assert set(per_shape) == {r.shape for r in report.rows} and max(per_shape.values()) <= limit
    # a fake allocator counting what the benches built: the same bound, one chain at a time, all freed
    assert allocator.peak <= limit and allocator.peak == max(allocator.per_bench)
    assert allocator.now == 0 and all(b.closed for b in factory.benches)
    # the ledger accounts for at least what each chain allocated
    held = [r.held_bytes for r in report.rows if r.measured]
    assert all(a <= h for a, h in zip(allocator.per_bench, held))
    # chains are shortened, never below the shortest that holds distance 2, and no plan reaches past them
    assert all(r.copies >= 3 for r in measured)
    assert any("shortened" in r.reason for r in measured)
    assert all(d < min(r.copies for r in measured) for d in planned_distances(factory))


def test_a_model_whose_weights_fit_in_l2_is_left_untuned_without_a_warning():
    clock = FakeClock()
    factory = Factory(clock, hint8_wins)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no warning: prefetch cannot help weights that stay in L2
        report = tuner(clock, factory, memory_budget=0.25).tune([fake_layer()], "cpu", ("forward",))
    (row,) = report.rows
    assert row.reason.startswith("not tuned: its shortest throwaway chain") and factory.benches == []


def test_a_shape_too_big_for_the_budget_gets_no_plan_and_says_why():
    clock = FakeClock()
    factory = Factory(clock, hint8_wins)
    # one 12.5 MiB layer: a quarter of it holds no chain at all; with model weights beyond L2 (here
    # 100 MiB of them), a plan could have mattered, so it is also a warning
    with pytest.warns(UserWarning, match=r"without a plan: its shortest throwaway chain \(3 copies\)"):
        report = tuner(clock, factory, memory_budget=0.03125).tune(
            [fake_layer()], "cpu", ("forward",), model_bytes=100 * MIB
        )
    (row,) = report.rows
    assert factory.benches == [], "nothing may be built for a shape that does not fit"
    assert not row.chosen and not row.measured and row.plan is None
    assert row.reason.startswith("not tuned: its shortest throwaway chain (3 copies) needs 37.")
    assert "memory budget of 3.1 MiB (memory_budget=0.03125" in row.reason
    assert row.held_bytes == 0 and report.memory_peak_bytes == 0
    assert report.plans_for([fake_layer()], "forward") == [None]
    assert "not tuned" in report.table() and report.to_dict()["rows"][0]["reason"] == row.reason


def test_a_larger_budget_tunes_that_shape():
    clock = FakeClock()
    factory = Factory(clock, hint8_wins)
    # 4 x 12.5 MiB = 50 MiB: a chain of three copies (37.5 MiB and the activations), not the full ten
    report = tuner(clock, factory, memory_budget=4.0).tune([fake_layer()], "cpu", ("forward",))
    (row,) = report.rows
    assert row.chosen and row.plan == make_plan("hint", 8), row.reason
    assert row.copies == 3 and factory.benches[0].copies == 3
    assert 3 * LAYER_2560 < row.held_bytes <= report.memory_budget_bytes
    assert "chain shortened to 3 of 10 copies by the memory budget" in row.reason
    unbounded = tuner(clock, Factory(clock, hint8_wins)).tune([fake_layer()], "cpu", ("forward",))
    assert unbounded.rows[0].copies == 10 and unbounded.memory_budget_bytes is None
    assert "shortened" not in unbounded.rows[0].reason


def test_shortest_chain_follows_the_longest_candidate_distance():
    clock = FakeClock()
    reach3 = [make_plan("hint", 8, 3)]
    # 3.5 x 12.5 MiB holds three copies but not the four a distance-3 plan needs
    report = tuner(clock, Factory(clock, hint8_wins), candidates=reach3, memory_budget=3.5).tune(
        [fake_layer()], "cpu", ("forward",)
    )
    assert "shortest throwaway chain (4 copies)" in report.rows[0].reason
    factory = Factory(clock, lambda plan: 0.05)
    report = tuner(clock, factory, candidates=reach3, memory_budget=4.5).tune(
        [fake_layer()], "cpu", ("forward",)
    )
    assert report.rows[0].copies == 4 and report.rows[0].chosen
    assert planned_distances(factory) == {3}


def test_a_chain_shorter_than_allowed_races_only_the_distances_it_holds():
    clock = FakeClock()
    factory = Factory(clock, hint8_wins)

    def short_on_memory(layer, phase, device, max_copies):
        return factory(layer, phase, device, 2)  # free memory held only two copies

    report = tuner(clock, short_on_memory, memory_budget=4.0).tune([fake_layer()], "cpu", ("forward",))
    (row,) = report.rows
    assert row.copies == 2 and "chain shortened to 2 of 10 copies by free memory" in row.reason
    assert planned_distances(factory) == {1}


def test_a_bench_longer_than_allowed_is_an_error_naming_the_factory():
    clock = FakeClock()
    factory = Factory(clock, hint8_wins)

    def too_long(layer, phase, device, max_copies):
        return factory(layer, phase, device, max_copies + 1)

    with pytest.raises(ValueError, match="`bench_factory` built a chain of 4 copies"):
        tuner(clock, too_long, memory_budget=4.0).tune([fake_layer()], "cpu", ("forward",))
    assert factory.benches[0].closed


def test_a_throwaway_chain_is_no_longer_than_the_tuner_allows():
    lin = nn.Linear(64, 64)
    layer = Layer(0, "l", lin, [lin.weight], 64 * 64 * 4, (2, 64))
    assert build_throwaway(layer, "forward", l2_bytes=None, min_copies=20, max_copies=3).copies == 3
    assert build_throwaway(layer, "forward", l2_bytes=None, max_copies=100).copies == 6
    with pytest.raises(ValueError, match="`max_copies` must be an int >= 2"):
        build_throwaway(layer, "forward", l2_bytes=None, max_copies=1)


def test_the_ledger_refuses_to_hold_past_its_budget():
    ledger = MemoryLedger(100)
    with ledger.hold(60):
        with pytest.raises(RuntimeError, match="exceed the memory budget"):
            with ledger.hold(41):
                pass
        assert ledger.held == 60
    assert ledger.held == 0 and ledger.peak == 60
    with MemoryLedger(None).hold(10**15):
        pass


# ---------------------------------------------------------------------- the plan cache
def test_cached_decisions_cost_no_memory_and_short_chains_are_measured_again(tmp_path, monkeypatch):
    monkeypatch.delenv("L2L_RETUNE", raising=False)
    clock = FakeClock()
    factory = Factory(clock, hint8_wins)

    def run(budget):
        cache = PlanCache(tmp_path / "plans.json", versions=VERSIONS, retune=False)
        return tuner(clock, factory, cache=cache, memory_budget=budget).tune(
            [fake_layer()], "cpu", ("forward",)
        )

    short = run(4.0)  # a 3-copy chain, cached
    assert short.rows[0].copies == 3 and len(factory.benches) == 1
    assert run(4.0).rows[0].from_cache and len(factory.benches) == 1
    full = run(None)  # a longer chain is allowed now: measured again, on 10 copies, and cached
    assert not full.rows[0].from_cache and full.rows[0].copies == 10 and len(factory.benches) == 2
    tight = run(0.25)  # no chain fits, but the cached decision needs none
    (row,) = tight.rows
    assert row.from_cache and row.chosen and row.held_bytes == 0 and len(factory.benches) == 2
    assert tight.memory_peak_bytes == 0
    assert run(4.0).rows[0].from_cache and len(factory.benches) == 2


# ---------------------------------------------------------------------- the estimate
def ln_linear_gelu(d, n=3):
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.LayerNorm(d), nn.Linear(d, d), nn.GELU()) for _ in range(n)])


@pytest.mark.parametrize("phase", ["forward", "backward"])
def test_the_estimate_covers_what_a_real_chain_holds(phase):
    model = ln_linear_gelu(256)
    chain = discover_chain(model, torch.randn(8, 256))
    (linear,) = [layer for layer in chain if isinstance(layer.module, nn.Linear)][:1]
    footprint = chain_footprint(linear, phase, graphs=4)
    assert footprint.measured
    built = build_throwaway(linear, phase, l2_bytes=None)
    saved: dict[int, int] = {}

    def pack(t):
        base = t if t._base is None else t._base
        if not isinstance(base, nn.Parameter):
            saved[id(base)] = base.numel() * base.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        built.run()
    weights = tensor_bytes(built.model.parameters())
    grads = tensor_bytes(p.grad for p in built.model.parameters() if p.grad is not None)
    assert (grads > 0) == (phase == "backward")
    assert weights + grads + sum(saved.values()) <= footprint.bytes_for(built.copies)
    # the weights are the estimate's bulk, and exact
    block = tensor_bytes(linear.block.parameters())
    assert footprint.per_copy >= block * (2 if phase == "backward" else 1)


def test_the_estimate_reads_shapes_only():
    # every tensor on the meta device: nothing could be allocated, and the figures are still there
    layer = fake_layer(d=4096, batch=16)
    forward = chain_footprint(layer, "forward", graphs=2)
    backward = chain_footprint(layer, "backward", graphs=2)
    assert forward.per_copy == 4096 * 4096 * 2
    activation = 16 * 4096 * 2
    # backward: the weight's gradient and the input the Linear saves
    assert backward.per_copy == 2 * 4096 * 4096 * 2 + activation
    assert forward.bytes_for(3) == 3 * forward.per_copy + forward.fixed


def test_a_module_the_meta_device_cannot_run_gets_the_fallback_estimate():
    class DataDependent(nn.Linear):
        def forward(self, x):
            return super().forward(x) * float(x.abs().max())  # reads a value: impossible on meta

    module = DataDependent(256, 256)
    layer = Layer(0, "dd", module, [module.weight], 256 * 256 * 4, (8, 256))
    footprint = chain_footprint(layer, "backward", graphs=3)
    activation = 8 * 256 * 4
    assert not footprint.measured
    assert footprint.per_copy >= 2 * tensor_bytes(module.parameters()) + FALLBACK_SAVED_INPUTS * activation


def test_copies_within_keeps_the_shortest_chain_or_none():
    footprint = ChainFootprint(per_copy=10, fixed=5)
    assert footprint.copies_within(None, wanted=12, shortest=3) == 12
    assert footprint.copies_within(1000, wanted=12, shortest=3) == 12
    assert footprint.copies_within(65, wanted=12, shortest=3) == 6
    assert footprint.copies_within(35, wanted=12, shortest=3) == 3
    assert footprint.copies_within(34, wanted=12, shortest=3) == 0


# ---------------------------------------------------------------------- the hooks pass the model's bytes
def test_prefetch_hooks_give_the_tuner_the_models_parameter_bytes(monkeypatch, tmp_path):
    monkeypatch.setenv("L2L_CACHE_DIR", str(tmp_path))
    seen = []

    class Recording(Autotuner):
        def tune(self, chain, device, phases=("forward",), *, model_bytes=None):
            seen.append(model_bytes)
            return super().tune(chain, device, phases, model_bytes=model_bytes)

    class Silent(Issuer):
        def issue(self, layer, plan, phase):
            raise AssertionError("nothing should be issued on a CPU")

        def join(self, phase):
            pass

    model = ln_linear_gelu(64)
    model.extra = nn.Parameter(torch.zeros(1000))  # not a chain layer, still the model's memory
    hooks = PrefetchHooks(
        model, torch.randn(2, 64), plans="auto", issuer=Silent(), autotune=Recording(cache=None)
    )
    assert seen == [tensor_bytes(model.parameters())]
    assert hooks.tuning_report.model_bytes == seen[0]
    assert hooks.tuning_report.memory_budget_bytes == int(0.25 * seen[0])
    hooks.remove()


def test_the_table_shows_the_bytes_held_and_the_budget():
    clock = FakeClock()
    report = tuner(clock, Factory(clock, hint8_wins), memory_budget=4.0).tune(
        [fake_layer()], "cpu", ("forward",)
    )
    text = report.table()
    assert "held MiB" in text and "copies held <= 50.0 MiB" in text
    assert f"{report.rows[0].held_bytes / MIB:.1f}" in text.splitlines()[2]
