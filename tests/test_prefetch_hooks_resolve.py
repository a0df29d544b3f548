"""resolve_plans: the one place a prefetch setting becomes per-layer plans, and the `autotune` argument."""

from __future__ import annotations

import pytest
import torch

from l2lightning import PrefetchHooks
from l2lightning.prefetch.hooks import hook_settings, make_autotuner, resolve_plans
from l2lightning.prefetch.install import Issuer
from l2lightning.prefetch.plan import MIB, PrefetchPlan, default_plan
from l2lightning.tune.search import Autotuner


class FakeLayer:
    def __init__(self, name: str, nbytes: int) -> None:
        self.name, self.nbytes, self.shape_key = name, nbytes, name


CHAIN = [FakeLayer("a", 4 * MIB), FakeLayer("b", 1024), FakeLayer("c", 8 * MIB)]
CPU = torch.device("cpu")


def test_explicit_settings():
    sized = resolve_plans(CHAIN, CPU, "default")
    assert sized.forward == [default_plan(4 * MIB), None, default_plan(8 * MIB)]
    assert sized.backward == sized.forward and not sized.decoy and sized.tuning_report is None
    assert resolve_plans(CHAIN, CPU, None).forward == sized.forward
    assert resolve_plans(CHAIN, CPU, "off").forward == [None, None, None]
    plan = PrefetchPlan(kind="hint", blocks=2)
    assert resolve_plans(CHAIN, CPU, plan).forward == [plan, None, plan]  # too small a layer stays plain
    mapped = resolve_plans(CHAIN, CPU, {"c": plan}, "off")
    assert mapped.forward == [None, None, plan] and mapped.backward == [None, None, None]
    with pytest.raises(ValueError, match="not in the chain"):
        resolve_plans(CHAIN, CPU, {"z": plan})


def test_decoy_is_the_default_plans_aimed_elsewhere():
    assert hook_settings("decoy") == (None, True)
    decoy = resolve_plans(CHAIN, CPU, "decoy")
    assert decoy.decoy and decoy.forward == resolve_plans(CHAIN, CPU, "default").forward


def test_auto_calls_the_tuner_it_is_given_for_the_phases_that_ask():
    class Report:
        def plans_for(self, chain, phase):
            return [PrefetchPlan(kind="hint", blocks=4 if phase == "forward" else 8)] * len(chain)

    class Tuner(Autotuner):
        def tune(self, chain, device, phases=("forward",), *, model_bytes=None):
            calls.append(tuple(phases))
            return Report()

    calls: list[tuple[str, ...]] = []
    tuner = Tuner(cache=None)
    both = resolve_plans(CHAIN, CPU, "auto", autotune=tuner)
    assert calls == [("forward", "backward")] and both.forward[0].blocks == 4 and both.backward[0].blocks == 8
    forward_only = resolve_plans(CHAIN, CPU, "auto", "off", autotune=tuner)
    assert calls[-1] == ("forward",) and forward_only.backward == [None, None, None]
    resolve_plans(CHAIN, CPU, "auto", backward=False, autotune=tuner)
    assert calls[-1] == ("forward",)


def test_autotune_argument_is_checked_and_names_itself():
    assert isinstance(make_autotuner(None), Autotuner)
    tuner = Autotuner(cache=None)
    assert make_autotuner(tuner) is tuner
    built = make_autotuner({"budget_s": 1.5, "cache": None})
    assert built.budget_s == 1.5 and built.cache is None
    with pytest.raises(
        ValueError, match=r"`autotune` has unknown settings \['budget'\]; accepted: .*budget_s"
    ):
        make_autotuner({"budget": 1.0})
    with pytest.raises(ValueError, match="`budget_s`"):
        make_autotuner({"budget_s": -1})
    with pytest.raises(TypeError, match="`autotune` must be None, an l2lightning.Autotuner or a mapping"):
        make_autotuner("fast")


def test_prefetch_hooks_fail_on_a_wrong_autotune_before_the_dry_run():
    calls = []

    def step(model, x):
        calls.append(x)
        return model(x)

    with pytest.raises(TypeError, match="`autotune`"):
        PrefetchHooks(torch.nn.Linear(4, 4), torch.randn(1, 4), step=step, autotune=3)
    assert calls == []


def test_prefetch_hooks_accept_the_off_and_default_settings():
    class Recorder(Issuer):
        def issue(self, layer, plan, phase):
            pass

        def join(self, phase):
            pass

    model = torch.nn.Sequential(*[torch.nn.Linear(512, 512) for _ in range(3)])
    x = torch.randn(2, 512)
    off = PrefetchHooks(model, x, plans="off", issuer=Recorder())
    assert off.forward_plans == [None] * 3 and off.backward_plans == [None] * 3
    off.remove()
    sized = PrefetchHooks(model, x, plans="default", issuer=Recorder())
    assert sized.forward_plans == [default_plan(512 * 512 * 4)] * 3
    sized.remove()
