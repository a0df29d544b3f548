"""The eager reference a fit with L2GraphCallback must equal bit for bit, for the tests.

The callback trains with the user's optimizer configuration until its capture step and in
``make_capturable``'s configuration from then on until the fit ends (``summary()["capturable_from_step"]``;
see ``l2lightning.baseline``). A test's baseline is therefore plain Lightning that switches at the
step the callback fit switched at and switches back when the fit ends: :func:`baseline_of` makes
such a module class. A baseline module's n-th fit reads the step of the n-th fit of the callback
that ended a fit last (a module fit twice by one Trainer and callback: two switch steps), recorded at
each callback fit's teardown by the autouse fixture :func:`capturable_from_of_the_last_callback_fit`,
which a test module imports. A baseline fit that starts before any callback fit of its test raises
instead of guessing.
"""

from __future__ import annotations

from typing import Any

import pytest

from l2lightning import L2GraphCallback, make_capturable
from l2lightning.graph.optim import installed_capturable

# the test's callback fits, in order: (the callback's id, its capturable_from_step)
_recorded: list[tuple[int, int | None]] = []


@pytest.fixture(autouse=True)
def capturable_from_of_the_last_callback_fit(monkeypatch):
    """Record, at each callback fit's teardown, the step from which its optimizer was capturable."""
    _recorded.clear()
    original = L2GraphCallback.teardown

    def teardown(self, trainer, pl_module, stage):
        original(self, trainer, pl_module, stage)
        if stage == "fit":
            _recorded.append((id(self), self.capturable_from_step))

    monkeypatch.setattr(L2GraphCallback, "teardown", teardown)
    yield


def next_switch_step(fits_before: int) -> int | None:
    """The switch step of the callback fit that a baseline module's fit mirrors (None: it never switched),
    `fits_before`: the module's fits before this one."""
    if not _recorded:
        raise RuntimeError(
            "a baseline fit started before any fit with L2GraphCallback in this test: run the callback "
            "fit first (the baseline switches the optimizer at the step that fit switched at)"
        )
    last = _recorded[-1][0]
    steps = [step for owner, step in _recorded if owner == last]
    return steps[min(fits_before, len(steps) - 1)]


def is_baseline(model_or_class: Any) -> bool:
    cls = model_or_class if isinstance(model_or_class, type) else type(model_or_class)
    return bool(getattr(cls, "_l2_baseline", False))


def baseline_of(cls: type) -> type:
    """`cls`, trained as the callback trains it: its optimizer switched to make_capturable's
    configuration at the callback fit's ``capturable_from_step``."""

    class Baseline(cls):
        _l2_baseline = True

        def on_fit_start(self):
            fits = getattr(self, "_l2_fits", 0)
            self._l2_switch_step, self._l2_fits = next_switch_step(fits), fits + 1
            return super().on_fit_start()

        def on_fit_end(self):
            out = super().on_fit_end()
            for optimizer in self.trainer.optimizers:  # the callback gives the optimizer back at the end
                wrapped = installed_capturable(optimizer)
                if wrapped is not None:
                    wrapped.release()
            return out

        def on_train_batch_start(self, batch, batch_idx):
            step = getattr(self, "_l2_switch_step", None)
            if step is not None and self.trainer.global_step >= step:
                for optimizer in self.trainer.optimizers:
                    make_capturable(optimizer, self.trainer.strategy.root_device)  # once: then a no-op
            return super().on_train_batch_start(batch, batch_idx)

    Baseline.__name__ = f"Baseline{cls.__name__}"
    Baseline.__qualname__ = Baseline.__name__
    return Baseline


class DeferredFit:
    """A baseline fit run when its result is first read (after the callback fit it follows)."""

    def __init__(self, run) -> None:
        self._run = run
        self._result = None

    def _value(self):
        if self._result is None:
            self._result = self._run()
        return self._result

    def __iter__(self):
        return iter(self._value())

    def __getitem__(self, index):
        return self._value()[index]

    def __len__(self) -> int:
        return len(self._value())
