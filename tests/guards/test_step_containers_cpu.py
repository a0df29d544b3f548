"""Lists, deques and dicts of lists a step appends to, on the CPU (graph emulator).

A replay runs no Python, so the one change it redoes is one ``append`` per step: after each replay the
callback appends a fresh copy of the element the capture appended, to the container the attribute or
the dict's entry holds then. A ``deque(maxlen=n)`` that is full drops its first element as it appends
(its length stays), and per-key outputs live in a ``defaultdict(list)`` or a dict of lists: both were
replayed appending nothing (found by the held-out idiom hunt), and an aborted capture left a deque
with the entry its run appended. Any other change (a ``popleft``, ``extend``, ``insert`` or ``clear``, a
dict that gains a key) is refused by the attribute's name, and the fit trains like plain Lightning.
"""

from __future__ import annotations

import collections
import random
import re
import types

import pytest
import torch

from l2lightning.guards import python_state
from tests.baselines import (  # noqa: F401 -- the fixture records each callback fit's switch step
    baseline_of,
    capturable_from_of_the_last_callback_fit,
)
from tests.lightning_models import TinyMLP
from tests.replay_helpers import assert_same, callback, fit

pytestmark = pytest.mark.usefixtures("emulated_cuda_graphs")

# 12 batches an epoch over 3 epochs: replays cross two epoch ends, whose hooks read the containers
EPOCHS = dict(steps=-1, n=96, trainer_kwargs={"max_epochs": 3})


def assert_same_elements(a, b):
    """Two containers of tensors hold as many, bit for bit equal."""
    a, b = list(a), list(b)
    assert len(a) == len(b), f"{len(a)} elements vs {len(b)}"
    for i, (x, y) in enumerate(zip(a, b)):
        assert torch.equal(x, y), f"element {i} differs: {x} vs {y}"


def log_containers(module, containers):
    """At epoch end: each container's mean and count (`name`, container)."""
    for name, values in containers:
        module.log(f"{name}_mean", torch.stack(list(values)).mean())
        module.log(f"{name}_count", float(len(values)))


# --------------------------------------------------------------------------- replayed appends
class AppendsToADeque(TinyMLP):
    """Its last losses in a deque (an RL-style smoothing window), logged at each epoch end."""

    def __init__(self, maxlen=None, **kw):
        super().__init__(**kw)
        self.recent = collections.deque(maxlen=maxlen)

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        self.recent.append(loss.detach())
        return loss

    def on_train_epoch_end(self):
        log_containers(self, [("recent", self.recent)])


@pytest.mark.parametrize(
    ("maxlen", "verify"),
    [(None, False), (4, False), (2, False), (4, "sampled")],
    ids=["unbounded", "maxlen-4-fills-after-capture", "maxlen-2-full-at-capture", "maxlen-4-sampled-checks"],
)
def test_a_deque_the_step_appends_to_gets_every_steps_element(maxlen, verify):
    """Replays appended nothing before: a deque's length was not tracked, and a full one's never changes.
    With maxlen=2 the deque is full at the capture step, whose append drops its first element."""
    cb = callback(verify=verify)
    run = fit(AppendsToADeque, [cb], maxlen=maxlen, **EPOCHS)
    base = fit(baseline_of(AppendsToADeque), maxlen=maxlen, **EPOCHS)
    summary = cb.summary()
    assert summary["captured"] and summary["captures"] == 1 and summary["fallback_steps"] == 0, summary
    assert_same(base, run)  # recent_mean and recent_count at every step after each epoch end
    assert_same_elements(run[0].recent, base[0].recent)
    assert len(run[0].recent) == (maxlen or 36)


class KeepsOutputsInADefaultdict(TinyMLP):
    """``self.outputs = defaultdict(list)``; ``self.outputs["loss"].append(...)`` per step, cleared
    at each epoch end (so the next epoch's first step makes the entries again)."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self.outputs = collections.defaultdict(list)

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        self.outputs["loss"].append(loss.detach())
        self.outputs["doubled"].append(loss.detach() * 2)
        return loss

    def on_train_epoch_end(self):
        log_containers(self, sorted(self.outputs.items()))
        self.outputs.clear()


class KeepsOutputsInADict(TinyMLP):
    """A plain dict holding a list and a ``deque(maxlen=3)``, emptied in place at each epoch end."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self.outputs = {"loss": [], "recent": collections.deque(maxlen=3)}

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        self.outputs["loss"].append(loss.detach())
        self.outputs["recent"].append(loss.detach() * 2)
        return loss

    def on_train_epoch_end(self):
        log_containers(self, sorted(self.outputs.items()))
        for values in self.outputs.values():
            values.clear()


@pytest.mark.parametrize("verify", [False, "sampled"])
def test_a_defaultdict_of_lists_gets_every_steps_element_and_its_entries_made_again(verify):
    """Replays appended nothing before. After each epoch end's `clear()` the entries are gone: what the
    step appends to then only its own code knows (the defaultdict's factory), so that one step runs
    eagerly (where a sampled check does not run it eagerly anyway) and the replays after it append
    to the entries it made."""
    cb = callback(verify=verify)
    run = fit(KeepsOutputsInADefaultdict, [cb], **EPOCHS)
    base = fit(baseline_of(KeepsOutputsInADefaultdict), **EPOCHS)
    summary = cb.summary()
    assert summary["captured"] and summary["captures"] == 1, summary
    if not verify:  # the first step of epochs 2 and 3
        assert summary["fallback_steps"] == 2, summary
        assert any("`self.outputs['loss']`" in cause for cause in summary["fallback_causes"]), summary
    assert_same(base, run)  # each key's mean and count at every step after each epoch end
    assert run[1].logged[-1]["loss_count"] == 12.0
    assert sorted(run[0].outputs) == sorted(base[0].outputs) == []  # cleared at the last epoch end


def test_a_dict_of_a_list_and_a_deque_gets_every_steps_element():
    """Replays appended nothing before: a dict of lists of tensors was not tracked at all."""
    cb = callback(verify=False)
    run = fit(KeepsOutputsInADict, [cb], **EPOCHS)
    base = fit(baseline_of(KeepsOutputsInADict), **EPOCHS)
    summary = cb.summary()
    assert summary["captured"] and summary["captures"] == 1 and summary["fallback_steps"] == 0, summary
    assert_same(base, run)  # each entry's mean and count at every step after each epoch end
    assert run[1].logged[-1]["loss_count"] == 12.0 and run[1].logged[-1]["recent_count"] == 3.0


# --------------------------------------------------------------------------- an aborted capture
class AppendsThenFailsInTheCapture(TinyMLP):
    """Appends to a list, a deque and a defaultdict's entry, then raises, inside a capture only (an op
    the warm-up could not foresee failing there): the capture's run of the step appended once."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self.history = []
        self.recent = collections.deque()
        self.full = collections.deque(maxlen=2)
        self.outputs = collections.defaultdict(list)

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        for container in (self.history, self.recent, self.full, self.outputs["loss"]):
            container.append(loss.detach())
        if torch.cuda.is_current_stream_capturing():
            raise RuntimeError("operation not permitted when stream is capturing")
        return loss


def test_a_failed_capture_puts_the_deques_and_dict_entries_back_and_trains_like_plain():
    """The aborted capture's entry stayed in the deque and the dict's list before (the list attribute
    was cut back), one more than plain Lightning's from the capture step on; a full deque lost the
    element its append dropped."""
    plain = fit(AppendsThenFailsInTheCapture, steps=20, fused=True)
    cb = callback()
    with pytest.warns(
        UserWarning, match=r"the step could not be captured \(RuntimeError: operation not permitted"
    ):
        run = fit(AppendsThenFailsInTheCapture, [cb], steps=20, fused=True)
    assert not cb.summary()["captured"], cb.summary()
    assert_same(plain, run)
    for name in ("history", "recent", "full"):
        assert_same_elements(getattr(run[0], name), getattr(plain[0], name))
    assert list(run[0].outputs) == ["loss"]
    assert_same_elements(run[0].outputs["loss"], plain[0].outputs["loss"])


# --------------------------------------------------------------------------- refused by name
def _zeros(n):
    return [torch.zeros(()) for _ in range(n)]


class PopsLeft(TinyMLP):
    """A sliding window kept by hand: append, then ``popleft`` (an unbounded deque's length stays)."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self.window = collections.deque(_zeros(3))

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        self.window.append(loss.detach())
        self.window.popleft()
        return loss


class AppendsLeft(PopsLeft):
    def training_step(self, batch, batch_idx):
        loss = TinyMLP.training_step(self, batch, batch_idx)
        self.window.appendleft(loss.detach())
        return loss


class ExtendsByTwo(PopsLeft):
    def training_step(self, batch, batch_idx):
        loss = TinyMLP.training_step(self, batch, batch_idx)
        self.window.extend([loss.detach(), loss.detach() * 2])
        return loss


class InsertsFirst(TinyMLP):
    """``insert(0, x)``: one element more, as an append, but a replay's append would put it last."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self.history = []

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        self.history.insert(0, loss.detach())
        return loss


class ClearsThenAppends(TinyMLP):
    """Keeps only this step's loss: ``clear()`` then ``append`` (the list's length stays 1, from the start)."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self.last = _zeros(1)

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        self.last.clear()
        self.last.append(loss.detach())
        return loss


class NewKeyEachStep(TinyMLP):
    """A dict that gains a key (holding a one-element list) at every step."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self.per_step = {}

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        self.per_step[len(self.per_step)] = [loss.detach()]
        return loss


class RebindsAnEntry(TinyMLP):
    """A dict of lists whose step appends to one entry and binds another anew."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self.outputs = {"loss": []}

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        self.outputs["loss"].append(loss.detach())
        self.outputs["last"] = loss.detach()
        return loss


def _containers(module):
    return {
        name: value
        for name, value in vars(module).items()
        if not name.startswith("_") and isinstance(value, (list, dict, collections.deque))
    }


@pytest.mark.parametrize(
    ("cls", "named", "callback_kwargs"),
    [
        (PopsLeft, "`self.window`", {}),
        (AppendsLeft, "`self.window`", {}),
        (ExtendsByTwo, "`self.window`", {}),
        (InsertsFirst, "`self.history`", {}),
        (ClearsThenAppends, "`self.last`", {}),
        (NewKeyEachStep, "`self.per_step[0]`, `self.per_step[1]`", {}),  # two warm-up steps disagree
        (NewKeyEachStep, "`self.per_step`", {"warmup_steps": 2}),  # one traced step: refused at the capture
        (RebindsAnEntry, "`self.outputs`", {}),
    ],
    ids=[
        "popleft",
        "appendleft",
        "extend",
        "insert",
        "clear",
        "new-key",
        "new-key-at-capture",
        "rebound-entry",
    ],
)
def test_other_changes_to_containers_are_refused_by_name_and_train_like_plain(cls, named, callback_kwargs):
    """Each was replayed before as if nothing (a deque, a dict of lists) or one `append` (`insert(0, x)`)
    happened, or not seen (a list's length that stays): the replays' containers differed from plain's."""
    plain = fit(
        cls, steps=20, fused=True
    )  # fused AdamW: the warm-up steps' capturable updates equal plain ones
    cb = callback(**callback_kwargs)
    with pytest.warns(UserWarning, match=rf"the step changes Python state \({re.escape(named)}\)"):
        run = fit(cls, [cb], steps=20, fused=True)
    assert not cb.summary()["captured"], cb.summary()
    assert_same(plain, run)
    ours, theirs = _containers(run[0]), _containers(plain[0])
    assert ours.keys() == theirs.keys()
    for name, values in ours.items():
        if isinstance(values, dict):  # its keys, and each entry's tensors
            assert list(values) == list(theirs[name])
            for key, held in values.items():
                assert_same_elements(_listed(held), _listed(theirs[name][key]))
        else:
            assert_same_elements(values, theirs[name])


def _listed(value):
    return list(value) if isinstance(value, (list, collections.deque)) else [value]


class ReadsTheLastOfADeque(TinyMLP):
    """Adds the previous step's loss, read from the deque it appends to."""

    def __init__(self, maxlen=None, **kw):
        super().__init__(**kw)
        self.recent = collections.deque(_zeros(2), maxlen=maxlen)

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        prev = self.recent[-1] if self.recent.maxlen is None else self.recent[0]
        self.recent.append(loss.detach())
        return loss + 0.01 * prev


@pytest.mark.parametrize("maxlen", [None, 2], ids=["last-element", "element-the-full-deque-drops"])
def test_a_step_reading_the_deque_it_appends_to_is_refused_by_name(maxlen):
    """A replay would read the element it was captured with at every step. With maxlen=2 the element
    read is the one the append drops, no longer in the deque after the step."""
    plain = fit(ReadsTheLastOfADeque, steps=20, fused=True, maxlen=maxlen)
    cb = callback()
    with pytest.warns(UserWarning, match=r"the step reads tensors of `self.recent`, a list it appends to"):
        run = fit(ReadsTheLastOfADeque, [cb], steps=20, fused=True, maxlen=maxlen)
    assert not cb.summary()["captured"], cb.summary()
    assert_same(plain, run)
    assert_same_elements(run[0].recent, plain[0].recent)


class KeepsAWindowByHand(TinyMLP):
    """A window of the last 8 losses kept by hand: append, then drop the oldest past 8."""

    def __init__(self, kind="list", **kw):
        super().__init__(**kw)
        self.window = [] if kind == "list" else collections.deque()

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        self.window.append(loss.detach())
        if len(self.window) > 8:
            self.window.pop(0) if isinstance(self.window, list) else self.window.popleft()
        return loss


@pytest.mark.parametrize("kind", ["list", "deque"])
def test_a_branch_testing_what_the_step_appends_to_is_refused_by_name(kind):
    """The callback picks a replay's branch before the step: the step that first overflowed the window
    was replayed without its pop, and the window kept 9 losses from then on (silently, with
    `verify=False`; found on the emulator)."""
    plain = fit(KeepsAWindowByHand, steps=20, fused=True, kind=kind)
    cb = callback(verify=False)
    with pytest.warns(
        UserWarning, match=r"the branch at .*`if len\(self.window\) > 8:`.* tests `self.window`"
    ):
        run = fit(KeepsAWindowByHand, [cb], steps=20, fused=True, kind=kind)
    assert not cb.summary()["captured"], cb.summary()
    assert_same(plain, run)
    assert len(run[0].window) == 8
    assert_same_elements(run[0].window, plain[0].window)


# --------------------------------------------------------------------------- what is one append
def _holder(**attributes):
    return types.SimpleNamespace(**attributes)


def _t(value):
    return torch.tensor(float(value))


def _split(holder, change, new_entries=True):
    before = python_state.snapshot([("self", holder)])
    change(holder)
    after = python_state.snapshot([("self", holder)])
    appends, other = python_state.split_appends(before, after, new_entries=new_entries)
    return [a.label for a in appends], other


@pytest.mark.parametrize(
    ("start", "change", "appended"),
    [
        (lambda: [_t(0)], lambda c: c.append(_t(1)), True),
        (lambda: [_t(0)], lambda c: c.extend([_t(1)]), True),  # the same as one append
        (lambda: collections.deque([_t(0)]), lambda c: c.append(_t(1)), True),
        (lambda: collections.deque([_t(0)], maxlen=3), lambda c: c.append(_t(1)), True),
        (lambda: collections.deque([_t(0), _t(1)], maxlen=2), lambda c: c.append(_t(2)), True),  # drops _t(0)
        (lambda: collections.deque([_t(0)], maxlen=1), lambda c: c.append(_t(2)), True),
        (lambda: collections.deque([_t(0), _t(1)]), lambda c: (c.append(_t(2)), c.popleft()), False),
        (
            lambda: collections.deque([_t(0), _t(1)], maxlen=3),
            lambda c: (c.append(_t(2)), c.popleft()),
            False,
        ),
        (lambda: collections.deque([_t(0)]), lambda c: c.appendleft(_t(1)), False),
        (lambda: collections.deque([_t(0), _t(1)]), lambda c: c.rotate(1), False),
        (lambda: collections.deque([_t(0)]), lambda c: c.popleft(), False),
        (lambda: [_t(0)], lambda c: c.insert(0, _t(1)), False),
        (lambda: [_t(0)], lambda c: c.extend([_t(1), _t(2)]), False),
        (lambda: [_t(0)], lambda c: c.__setitem__(0, _t(1)), False),
        (lambda: [_t(0)], lambda c: (c.clear(), c.append(_t(1))), False),
        (lambda: [_t(0)], lambda c: c.pop(), False),
    ],
)
def test_only_one_append_per_step_is_an_append(start, change, appended):
    labels, other = _split(_holder(c=start()), lambda h: change(h.c))
    assert (labels, other) == ((["`self.c`"], []) if appended else ([], ["`self.c`"]))


def test_a_list_bound_anew_by_the_step_is_not_an_append():
    """`self.c = self.c + [x]`: as long as one append, but others holding the old list do not see it."""
    labels, other = _split(_holder(c=[_t(0)]), lambda h: setattr(h, "c", [*h.c, _t(1)]))
    assert (labels, other) == ([], ["`self.c`"])


@pytest.mark.parametrize(
    ("start", "change", "new_entries", "expected"),
    [
        # appends to entries that were there
        (lambda: {"a": [_t(0)], "b": collections.deque([_t(0)], maxlen=1)},
         lambda d: (d["a"].append(_t(1)), d["b"].append(_t(1))), False, (["`self.d['a']`", "`self.d['b']`"], [])),
        # a defaultdict's first append makes its entry: an append in the warm-up, refused at the capture
        (lambda: collections.defaultdict(list), lambda d: d["a"].append(_t(1)), True, (["`self.d['a']`"], [])),
        (lambda: collections.defaultdict(list), lambda d: d["a"].append(_t(1)), False, ([], ["`self.d`"])),
        (lambda: {"a": [_t(0)]}, lambda d: d.setdefault("b", []).append(_t(1)), True, (["`self.d['b']`"], [])),
        # any other change to the dict
        (lambda: {"a": [_t(0)]}, lambda d: d.__setitem__("b", [_t(1), _t(2)]), True, ([], ["`self.d`"])),
        (lambda: {"a": [_t(0)]}, lambda d: d.__setitem__("a", [_t(1)]), True, ([], ["`self.d['a']`", "`self.d`"])),
        (lambda: {"a": [_t(0)], "n": 1}, lambda d: (d["a"].append(_t(1)), d.__setitem__("n", 2)), True,
         (["`self.d['a']`"], ["`self.d`"])),
        (lambda: {"a": [_t(0)], "b": []}, lambda d: d.pop("b"), True, ([], ["`self.d`"])),
        (lambda: {"a": [_t(0)]}, lambda d: d.clear(), True, ([], ["`self.d`"])),
        (lambda: {"a": [_t(0)]}, lambda d: d["a"].insert(0, _t(1)), True, ([], ["`self.d['a']`"])),
    ],
    ids=[
        "appends-to-entries",
        "defaultdict-first-append-warm-up",
        "defaultdict-first-append-at-capture",
        "setdefault-first-append",
        "new-key-of-two",
        "entry-bound-anew",
        "number-beside-changed",
        "entry-removed",
        "cleared",
        "entry-inserted-into",
    ],
)  # fmt: skip
def test_a_dict_of_lists_changes_by_appends_to_its_entries_only(start, change, new_entries, expected):
    assert _split(_holder(d=start()), lambda h: change(h.d), new_entries) == expected


def test_restore_puts_back_elements_entries_and_bindings():
    """What an aborted capture undoes: the same objects, their elements as they were (a full deque's
    dropped first element too), a dict's keys (a defaultdict keeps its factory), rebound attributes."""
    a, b, c = _t(0), _t(1), _t(2)
    lst, unbounded, full, entry = [a], collections.deque([a]), collections.deque([a, b], maxlen=2), [a]
    outputs = collections.defaultdict(list, {"x": entry})
    holder = _holder(lst=lst, unbounded=unbounded, full=full, outputs=outputs, rebound=[a])
    before = python_state.snapshot([("self", holder)])
    state = random.getstate()
    for container in (lst, unbounded, full, entry, outputs["y"]):
        container.append(c)
    lst.insert(0, c)
    holder.rebound = [a, c]
    random.random()
    python_state.restore(before)
    assert holder.lst is lst and lst == [a]
    assert holder.unbounded is unbounded and list(unbounded) == [a]
    assert holder.full is full and list(full) == [a, b]
    assert holder.outputs is outputs and dict(outputs) == {"x": entry} and entry == [a]
    assert outputs.default_factory is list
    assert holder.rebound == [a] and random.getstate() == state


def test_appends_follow_the_container_bound_now():
    """A replay appends to the list or deque the attribute or entry holds then, and finds none where an
    epoch-end hook removed it (the step then runs eagerly: tests above)."""
    holder = _holder(recent=collections.deque(maxlen=2), outputs=collections.defaultdict(list))
    before = python_state.snapshot([("self", holder)])
    holder.recent.append(_t(0))
    holder.outputs["loss"].append(_t(0))
    appends, other = python_state.split_appends(before, python_state.snapshot([("self", holder)]))
    assert other == []
    labels_of = {a.label: a for a in appends}
    recent, loss = labels_of["`self.recent`"], labels_of["`self.outputs['loss']`"]
    assert recent.current() is holder.recent and loss.current() is holder.outputs["loss"]
    holder.recent = collections.deque(maxlen=5)
    assert recent.current() is holder.recent
    holder.outputs.clear()
    assert loss.current() is None and "loss" not in holder.outputs  # looked up without making it
    holder.recent = None
    assert recent.current() is None
