"""The values a captured step reads, compared before each replay: NumPy arrays and scalars, and long
containers of numbers (l2lightning/guards/step_values.py ``frozen``, ``frozen_read``).

A value that could not be frozen once compared equal to itself as None whatever it became: a list of
70 task weights rebound by a hook, a NumPy array written in place, a dict of 100 per-class margins
were replayed with the capture's numbers (the held-out hunt's C4). Now each is compared exactly, and
a value too large to compare before each replay is refused by name. The unit tests check each kind's
snapshot and its comparison; the fits check, on the CPU graph emulator, that the step is captured
again and trains bit for bit like its baseline (``verify=False`` too: the sampled replay check, which
runs at epoch starts, cannot hide a miss), or is refused by name and trains bit for bit like plain.
"""

from __future__ import annotations

import collections
import timeit

import numpy as np
import pytest
import torch
from torch import nn

from l2lightning.guards.step_values import (
    MAX_FROZEN_BYTES,
    MAX_FROZEN_ITEMS,
    SLOW_ITEM_COST,
    AttributeValue,
    TooLarge,
    frozen,
    frozen_read,
)
from tests.baselines import (
    baseline_of,
    capturable_from_of_the_last_callback_fit,  # noqa: F401 -- the autouse fixture
)
from tests.lightning_models import TinyMLP
from tests.replay_helpers import assert_same, callback, fit

# the fits run on the CPU graph emulator (tests/conftest.py)
pytestmark = pytest.mark.usefixtures("emulated_cuda_graphs")


# --------------------------------------------------------------------------- the snapshots
def test_python_numbers_are_frozen_by_type_and_exact_value():
    assert frozen(1.5) == frozen(1.5) != frozen(1)
    assert frozen(1) != frozen(True)  # 1 == True, but another type
    assert frozen(float("nan")) == frozen(float("nan"))  # unchanged, though NaN != NaN
    assert frozen(0.0) != frozen(-0.0)  # 0.0 == -0.0, but `w * x` differs in the sign of a zero


def test_numpy_scalars_are_frozen_by_dtype_and_bytes():
    assert frozen(np.float32(0.5)) == frozen(np.float32(0.5))
    assert frozen(np.float32(0.5)) != frozen(np.float64(0.5)) != frozen(0.5)
    assert frozen(np.float64("nan")) == frozen(np.float64("nan"))
    assert frozen(np.float64(0.0)) != frozen(np.float64(-0.0))


def test_a_numpy_array_is_frozen_by_its_contents_so_a_write_in_place_shows():
    weights = np.ones(5)
    snapshot = frozen(weights)
    assert snapshot is not None and frozen(weights.copy()) == snapshot
    weights[:] = 0.5  # the same object, written in place: compared by contents, not identity
    assert frozen(weights) != snapshot
    ones = np.ones(6)
    assert frozen(ones.astype(np.float32)) != frozen(ones)  # the same values, another dtype
    assert frozen(ones.reshape(2, 3)) != frozen(ones.reshape(3, 2))  # the same bytes, another shape
    assert frozen(np.array([1.0, None], dtype=object)) == frozen(np.array([1.0, None], dtype=object))
    masked = np.ma.masked_array([1.0, 2.0], mask=[False, False])
    before = frozen(masked)
    masked.mask = [True, False]
    assert frozen(masked) != before  # the values under the mask are not what a step reads


def test_a_long_list_of_numbers_is_compared_item_by_item():
    weights = [1.0] * 70
    snapshot = frozen(weights, tensors=True)
    assert snapshot is not None and frozen(list(weights), tensors=True) == snapshot
    weights[42] = 0.5
    assert frozen(weights, tensors=True) != snapshot
    assert frozen([1, 2] * 500) != frozen([1.0, 2.0] * 500)  # equal under ==, other types
    assert frozen([0.0] * 1000) != frozen([0.0] * 999 + [-0.0])
    assert frozen([1.0, 2, "a"] * 80) == frozen([1.0, 2, "a"] * 80) != frozen([1.0, 2, "b"] * 80)
    assert frozen(list(range(MAX_FROZEN_ITEMS))) is not None
    # compared one by one (mixed types, tensors by identity): at most a quarter as many
    slow = MAX_FROZEN_ITEMS // SLOW_ITEM_COST
    assert frozen([1, 0.5] * (slow // 2)) is not None and frozen([1, 0.5] * (slow // 2) + [1]) is None
    tensors = [torch.zeros(1) for _ in range(slow + 1)]
    assert frozen(tensors[:slow], tensors=True) is not None
    assert frozen_read(tensors, tensors=True).what == f"a list of {slow + 1} values"


def test_a_dict_of_a_hundred_entries_is_compared_entry_by_entry_in_its_order():
    margins = {i: 0.0 for i in range(100)}
    snapshot = frozen(margins)
    assert snapshot is not None and frozen(dict(margins)) == snapshot
    margins[3] = 0.5  # one entry changed in place
    assert frozen(margins) != snapshot
    # a sum over the values adds in the dict's order: another order is another value
    assert frozen({"a": 0.1, "b": 0.2}) != frozen({"b": 0.2, "a": 0.1})


def test_deques_and_sets_of_numbers_are_compared():
    recent = collections.deque([1.0, 2.0], maxlen=4)
    snapshot = frozen(recent)
    recent.append(3.0)
    assert snapshot is not None and frozen(recent) != snapshot
    assert frozen({1, 2}) == frozen({1, 2}) != frozen({1, 3})


def test_a_value_too_large_to_compare_is_told_apart_from_a_value_of_another_kind():
    """frozen() gives None for both (its callers snapshot the step's own writes); frozen_read(), for
    the values a step reads, a TooLarge that is equal to nothing, not even another of the same value,
    with what it is, for the refusal."""
    too_many = [0.5] * (MAX_FROZEN_ITEMS + 1)
    assert frozen(too_many) is None
    found = frozen_read(too_many)
    assert isinstance(found, TooLarge) and found != frozen_read(too_many)
    assert found.what == f"a list of {MAX_FROZEN_ITEMS + 1} numbers"
    array = np.zeros(MAX_FROZEN_BYTES // 8 + 1)
    assert frozen(array) is None
    assert frozen_read(array).what == f"a NumPy array of {array.size} float64 values ({array.nbytes} bytes)"
    assert frozen_read([array]).what.startswith("a list holding a NumPy array of")
    nested = frozen_read([[1.0] * 600, [2.0] * 600])
    assert nested.what == "a list of 2 entries holding 1200 numbers"
    # made of values of a kind frozen() does not snapshot, long or short: other checks follow those
    assert frozen_read([nn.Identity()] * 2000) is None and frozen_read([nn.Identity()]) is None
    # a reader of the step's values gives it as it is
    reader = AttributeValue("here", lambda module, batch_idx: module.weights)
    assert isinstance(reader.value(type("M", (), {"weights": too_many})(), 0), TooLarge)


def test_a_thousand_numbers_cost_per_replay_about_what_sixty_four_did():
    """The comparison before each replay runs per step: a flat list of 1000 floats is frozen in C, in
    about the time 64 mixed numbers (one by one, as every list was before) take."""
    flat = [1.0 + i for i in range(1000)]
    mixed = [1.0 + i if i % 2 else i for i in range(63)]
    assert frozen(flat, tensors=True) is not None and frozen(mixed, tensors=True) is not None

    def cost(value):
        return min(timeit.repeat(lambda: frozen(value, tensors=True), number=200, repeat=5)) / 200

    assert cost(flat) < 4 * cost(mixed), (cost(flat), cost(mixed))


# --------------------------------------------------------------------------- the fits
# weights that a hook changes at step 13 (30 batches an epoch: no epoch start in between)
CHANGE_STEP = 13
GLOBAL_WEIGHTS = np.ones(8)


def _initial(kind):
    if kind == "list":
        return [1.0] * 70
    if kind == "long_list":
        return [1.0 + 0.001 * i for i in range(1000)]
    if kind in ("ndarray", "ndarray_in_place"):
        return np.ones(8)
    if kind == "dict":
        return {i: 1.0 for i in range(100)}
    if kind == "too_large":
        return [1.0] * 100_000
    return [1.0] * 100  # "grows_too_large"


def _changed(kind, weights):
    if kind == "ndarray_in_place":
        weights[3] = 0.25  # the same array object
        return weights
    if kind == "dict":
        weights[3] = 0.25  # the same dict object
        return weights
    if kind == "ndarray":
        return np.full(8, 0.5)
    if kind == "grows_too_large":
        return [0.5] * 100_000
    return [0.5 + 0.001 * i for i in range(len(weights))]


class WeightsFromAHook(TinyMLP):
    """Per-sample loss weights the step reads from a container of Python or NumPy numbers, changed by
    a batch-start hook at step 13 (re-estimated class weights, a curriculum's per-task weights)."""

    def __init__(self, kind="list", **kwargs):
        super().__init__(**kwargs)
        self.kind = kind
        self.weights = _initial(kind)

    def on_train_batch_start(self, batch, batch_idx):
        if self.global_step == CHANGE_STEP:
            self.weights = _changed(self.kind, self.weights)

    def training_step(self, batch, batch_idx):
        x, y = batch
        per_sample = (self.head(self.net(x)).squeeze(-1) - y).square()
        # each a Python (or NumPy) number baked into the graph as it is captured
        loss = sum(self.weights[i] * per_sample[i] for i in range(8))
        self.log("train/loss", loss)
        return loss


class AsATensor(WeightsFromAHook):
    """The same weights turned into a tensor in the step (`torch.tensor(self.class_weights)`): the
    graph holds the tensor the capture made."""

    def training_step(self, batch, batch_idx):
        x, y = batch
        per_sample = (self.head(self.net(x)).squeeze(-1) - y).square()
        values = list(self.weights.values()) if isinstance(self.weights, dict) else self.weights
        loss = (per_sample * torch.tensor(values, dtype=torch.float32)[:8]).sum()
        self.log("train/loss", loss)
        return loss


class ModuleLevelArray(TinyMLP):
    """Weights in a module-level NumPy array, read with constant subscripts and written in place."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        GLOBAL_WEIGHTS[:] = 1.0  # each fit starts from the same weights

    def on_train_batch_start(self, batch, batch_idx):
        if self.global_step == CHANGE_STEP:
            GLOBAL_WEIGHTS[0] = 3.0

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = (self.head(self.net(x)).squeeze(-1) - y).square().mean() * GLOBAL_WEIGHTS[0]
        self.log("train/loss", loss)
        return loss


def _captured_again_like_baseline(cls, verify, **model_kwargs):
    base = fit(baseline_of(cls), **model_kwargs)
    cb = callback(verify=verify)
    with pytest.warns(UserWarning, match="capturing the step again: .*changed"):
        run = fit(cls, [cb], **model_kwargs)
    s = cb.summary()
    assert s["captured"] and s["captures"] == 2 and s["fallback_steps"] == 0, s
    assert_same(base, run)


@pytest.mark.parametrize("verify", [True, False], ids=["verify", "no-verify"])
@pytest.mark.parametrize(
    "kind", ["list", "long_list", "ndarray", "ndarray_in_place", "dict"], ids=lambda k: k.replace("_", "-")
)
def test_weights_a_hook_changes_are_captured_again_and_train_like_the_baseline(kind, verify):
    _captured_again_like_baseline(WeightsFromAHook, verify, kind=kind)


@pytest.mark.parametrize("verify", [True, False], ids=["verify", "no-verify"])
@pytest.mark.parametrize("kind", ["list", "ndarray", "dict"])
def test_weights_turned_into_a_tensor_in_the_step_are_captured_again_like_the_baseline(kind, verify):
    _captured_again_like_baseline(AsATensor, verify, kind=kind)


@pytest.mark.parametrize("verify", [True, False], ids=["verify", "no-verify"])
def test_a_module_level_array_written_in_place_is_captured_again_like_the_baseline(verify):
    _captured_again_like_baseline(ModuleLevelArray, verify)


TOO_LARGE = (
    r"the step reads a list of 100000 numbers at .*too large to compare before each replay.*register_buffer"
)


@pytest.mark.parametrize("verify", [True, False], ids=["verify", "no-verify"])
def test_weights_too_large_to_compare_are_refused_by_name_and_train_like_plain(verify):
    plain = fit(WeightsFromAHook, kind="too_large", fused=True)
    cb = callback(verify=verify)
    with pytest.warns(UserWarning, match=TOO_LARGE):
        run = fit(WeightsFromAHook, [cb], kind="too_large", fused=True)
    s = cb.summary()
    assert not s["captured"] and emulated_replays() == 0, s
    assert_same(plain, run)


def test_weights_that_grow_too_large_after_the_capture_are_refused_by_name_and_train_like_the_baseline():
    """100 weights are compared; the hook's 100000 at step 13 are not: that step and the rest run
    eagerly (in make_capturable's configuration from the capture on, as the baseline's)."""
    base = fit(baseline_of(WeightsFromAHook), kind="grows_too_large")
    cb = callback(verify=False)
    with pytest.warns(UserWarning, match=TOO_LARGE):
        run = fit(WeightsFromAHook, [cb], kind="grows_too_large")
    s = cb.summary()
    assert s["captures"] == 1 and s["reason"] and "100000 numbers" in s["reason"], s
    assert_same(base, run)


def emulated_replays():
    from tests import graph_emulator

    return graph_emulator.FakeGraph.replays


def test_enum_members_fractions_dtypes_slices_and_functions_are_frozen_and_compared():
    """Found by the third held-out hunt: a value of one of these kinds, or a loss table holding a
    function beside its weight (`{"ce": (1.0, F.cross_entropy)}`), froze to None, which compared equal
    to the capture's None whatever a hook changed it to mid-epoch."""
    import enum
    from fractions import Fraction

    class Phase(enum.Enum):
        WARM = "warm"
        MAIN = "main"

    assert frozen(Phase.WARM) == frozen(Phase.WARM) != frozen(Phase.MAIN)
    assert frozen(Fraction(1, 2)) == frozen(Fraction(1, 2)) != frozen(Fraction(1, 3))
    assert frozen(torch.float32) != frozen(torch.bfloat16)
    assert frozen(slice(0, 4)) == frozen(slice(0, 4)) != frozen(slice(0, 8))
    assert frozen(range(3)) != frozen(range(4))
    table = {"ce": (1.0, torch.nn.functional.cross_entropy), "reg": (0.1, torch.square)}
    snapshot = frozen(table)
    assert snapshot is not None and frozen(dict(table)) == snapshot
    table["reg"] = (0.5, torch.square)
    assert frozen(table) != snapshot
    table["reg"] = (0.1, torch.abs)  # another function, the same weight
    assert frozen(table) != snapshot
