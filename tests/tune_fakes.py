"""Fakes for the autotuner's CPU tests: a clock, a bench that times a chain with scripted gains (and
advances the clock as the real one would spend), its factory, and layer records on the meta device."""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from l2lightning.prefetch.chain import Layer
from l2lightning.prefetch.plan import KINDS, MIB
from l2lightning.tune.search import Autotuner

L2 = 60 * MIB


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


class FakeBench:
    """Times a chain of `copies` layers: plan gains come from `gain_of`, with multiplicative noise.

    Each call advances the fake clock by what the real bench would spend: a capture the first time a
    variant is seen, then one sample.
    """

    def __init__(
        self,
        clock,
        gain_of,
        decoy_gain=-0.02,
        *,
        base=100e-6,
        noise=0.002,
        capture_s=0.02,
        sample_s=0.004,
        seed=0,
        copies=8,
    ):
        self.clock = clock
        self.gain_of = gain_of
        self.decoy_gain = decoy_gain
        self.base = base
        self.noise = noise
        self.capture_s = capture_s
        self.sample_s = sample_s
        self.rng = np.random.default_rng(seed)
        self.seen: set = set()
        self.calls: list = []
        self.copies = copies
        self.mode = "chain"
        self.closed = False

    def sample(self, plan, decoy=False):
        key = (plan, decoy)
        if key not in self.seen:
            self.seen.add(key)
            self.clock.advance(self.capture_s)
        self.clock.advance(self.sample_s)
        self.calls.append(key)
        torch.rand(1)  # a bench may use the RNG; the tuner must restore it
        gain = 0.0 if plan is None else (self.decoy_gain if decoy else self.gain_of(plan))
        return self.base * (1 - gain) * (1 + self.rng.normal(0, self.noise))

    def close(self):
        self.closed = True


class Factory:
    def __init__(self, clock, gain_of, **kw):
        self.clock, self.gain_of, self.kw = clock, gain_of, kw
        self.benches: list[FakeBench] = []

    def __call__(self, layer, phase, device, max_copies):
        bench = FakeBench(self.clock, self.gain_of, seed=len(self.benches), copies=max_copies, **self.kw)
        self.benches.append(bench)
        return bench


def fake_layer(d=2560, batch=4, index=0, name="l0", dtype=torch.bfloat16):
    # on the meta device: only shapes and dtypes are read (the fake benches build nothing)
    lin = nn.Linear(d, d, bias=False, device="meta", dtype=dtype)
    return Layer(index, name, lin, [lin.weight], d * d * lin.weight.element_size(), (batch, d))


def hint8_wins(plan):
    """The H200 shape of things at d=2560: 8 blocks best, more or fewer worse, distance 2 loses."""
    if plan.distance != 1:
        return -0.02
    if plan.kind != "hint":
        return 0.01
    return {8: 0.05, 16: 0.03, 32: 0.0}.get(plan.blocks, -0.1)


def tuner(clock, factory, **kw):
    kw.setdefault("cache", None)
    kw.setdefault("kinds", KINDS)
    kw.setdefault("memory_budget", None)  # the search alone; the memory bound has tests of its own
    return Autotuner(clock=clock, bench_factory=factory, l2_bytes=L2, device_name="fake", **kw)
