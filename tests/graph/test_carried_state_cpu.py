"""Carried state on the CPU (graph emulator): an attribute the step reads and rebinds to its own results
is handed to every replay, so pytorch/examples' word language model (its LSTM's hidden state under
``repackage_hidden``, ``init_hidden`` at each epoch start) trains bit for bit like its baseline. An
attribute or a dict entry the step only writes (``self.last_loss = loss.detach()``, a forward hook's
``self.feats[name] = out``) gets a new tensor per replay as in plain training, and the tensor bound at
the capture is left as it is (a hook of the user's may have kept it)."""

from __future__ import annotations

import pytest
import torch

from l2lightning.graph import carried_state
from tests.baselines import (  # noqa: F401 -- the fixture records each callback fit's switch step
    baseline_of,
    capturable_from_of_the_last_callback_fit,
)
from tests.idiom_modules import WordLanguageModel, _text_loader
from tests.lightning_models import TinyMLP
from tests.replay_helpers import assert_same, callback, fit

pytestmark = pytest.mark.usefixtures("emulated_cuda_graphs")

# value clipping as the example does; 21 chunks an epoch: 45 steps cross two epoch starts
SETTINGS = dict(
    steps=45, loader=None, trainer_kwargs=dict(gradient_clip_val=0.25, gradient_clip_algorithm="value")
)


class WordGRU(WordLanguageModel):
    """The example's ``--model GRU``: one tensor of hidden state instead of a tuple."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self.model.rnn = torch.nn.GRU(64, 64, 2, dropout=0.2)

    def on_train_epoch_start(self):
        self.hidden = self.model.init_hidden(self.batch_size)[0]


def _fit(cls, callbacks=(), baseline=False):
    torch.manual_seed(0)  # the same initial weights for every fit
    model = (baseline_of(cls) if baseline else cls)()
    # (the emulator runs CPU LSTMs without oneDNN: graph_emulator.install)
    return list(fit(None, list(callbacks), model=model, **{**SETTINGS, "loader": _text_loader()}))


@pytest.mark.parametrize("cls", [WordLanguageModel, WordGRU], ids=["lstm", "gru"])
def test_the_hidden_state_is_carried_across_replays_and_epochs_bit_for_bit(cls):
    cb = callback(check_share=1.0)  # every scheduled check: counted below
    run = _fit(cls, [cb])
    base = _fit(cls, baseline=True)
    summary = cb.summary()
    assert summary["captured"] and summary["captures"] == 1 and summary["fallback_steps"] == 0, summary
    assert summary["replay_check"]["checks"] >= 7 and summary["replay_check"]["mismatches"] == 0, summary
    assert_same(base, run)
    hidden_run, hidden_base = carried_state.leaves(run[0].hidden), carried_state.leaves(base[0].hidden)
    assert all(torch.equal(a, b) for a, b in zip(hidden_run, hidden_base))


def test_without_carrying_it_the_replays_start_from_the_captures_hidden_state(monkeypatch):
    """Silent before: every replay read the capture's hidden state (22% apart after 40 steps)."""
    monkeypatch.setattr(carried_state, "carried_attributes", lambda changes, made, read=None: [])
    run = _fit(WordLanguageModel, [callback(verify=False)])
    base = _fit(WordLanguageModel, baseline=True)
    with pytest.raises(AssertionError, match="differs"):
        assert_same(base, run)


def test_a_carried_attribute_is_copied_in_checked_for_shape_and_rebound_to_fresh_copies():
    graph_reads = (torch.zeros(2, 3), torch.zeros(2, 3))
    graph_writes = (torch.ones(2, 3), torch.full((2, 3), 2.0))
    owner = {"hidden": graph_writes}
    carried = carried_state.Carried(
        "`self.hidden`", owner, "hidden", graph_reads, list(graph_reads), list(graph_writes)
    )
    assert carried.mismatch() is None
    carried.copy_in()  # the last step's state into the memory the graph reads
    assert torch.equal(graph_reads[0], graph_writes[0]) and torch.equal(graph_reads[1], graph_writes[1])
    carried.fresh_out()
    assert owner["hidden"][0] is not graph_writes[0] and torch.equal(owner["hidden"][1], graph_writes[1])
    owner["hidden"] = (torch.zeros(2, 5), torch.zeros(2, 5))  # another batch size
    assert "other shapes" in carried.mismatch()
    owner["hidden"] = None
    assert "holds no tensor" in carried.mismatch()


def test_cudnns_rnn_dropout_is_known_as_a_random_state_torch_cannot_restore():
    from l2lightning.guards.step_trace import draws_hidden_random_state

    op = torch.ops.aten._cudnn_rnn.default
    names = [a.name for a in op._schema.arguments]

    def args(dropout, train):
        values = [None] * len(names)
        values[names.index("dropout")], values[names.index("train")] = dropout, train
        return tuple(values)

    assert draws_hidden_random_state(op, args(0.2, True), {})
    assert not draws_hidden_random_state(op, args(0.0, True), {})  # no dropout between the layers
    assert not draws_hidden_random_state(op, args(0.2, False), {})  # eval: no dropout drawn
    assert not draws_hidden_random_state(torch.ops.aten.mm.default, (None, None), {})


def test_a_value_the_step_does_not_read_is_not_copied_in_and_an_entry_is_bound_in_its_dict_now():
    captured_then = torch.zeros(
        3
    )  # bound at the capture: the graph does not read it, a user's list may hold it
    graph_writes = torch.ones(3)
    module_attributes = {"feats": {"l1": graph_writes}}
    carried = carried_state.Carried(
        "`self.feats['l1']`",
        module_attributes,
        "feats",
        captured_then,
        [captured_then],
        [graph_writes],
        key="l1",
        reads_inputs=False,
    )
    module_attributes["feats"] = {}  # cleared by an epoch hook: the step writes the entry anew
    assert carried.mismatch() is None
    carried.copy_in()
    assert torch.equal(captured_then, torch.zeros(3))  # left as it was
    carried.fresh_out()  # into the dict the attribute holds now, a fresh tensor
    fresh = module_attributes["feats"]["l1"]
    assert fresh is not graph_writes and torch.equal(fresh, graph_writes)
    module_attributes["feats"] = None  # no dict now: nothing to bind, nothing raised
    carried.fresh_out()


class KeepsItsLastLoss(TinyMLP):
    """The step keeps its loss (`self.last_loss`), a callback-style hook collects it after each step,
    and the epoch end logs what it collected: a replay that rewrote one tensor would give every
    collected entry the last step's value, and one that copied into the capture's tensor would change
    an entry collected before it."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self.history = []

    def keep(self, loss):
        self.last_loss = loss.detach()

    def kept(self):
        return self.last_loss

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        self.keep(loss)
        return loss

    def on_train_batch_end(self, outputs, batch, batch_idx):
        self.history.append(self.kept())

    def on_train_epoch_end(self):
        self.log("history_mean", torch.stack(self.history).mean())
        self.log("history_count", float(len(self.history)))


class KeepsItsLastLossInADict(KeepsItsLastLoss):
    def __init__(self, **kw):
        super().__init__(**kw)
        self.latest = {}

    def keep(self, loss):
        self.latest["loss"] = loss.detach()

    def kept(self):
        return self.latest["loss"]


class KeepsFeaturesFromForwardHooks(TinyMLP):
    """Deep supervision through forward hooks: each hidden layer's output kept by name
    (`self.feats[name] = out`), read by the step's auxiliary loss."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self.feats = {}
        for i, layer in enumerate(m for m in self.net.modules() if isinstance(m, torch.nn.Linear)):
            layer.register_forward_hook(self._keep(f"layer{i}"))

    def _keep(self, name):
        def hook(module, inputs, output):
            self.feats[name] = output

        return hook

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        return loss + 1e-3 * sum(f.square().mean() for f in self.feats.values())


@pytest.mark.parametrize("cls", [KeepsItsLastLoss, KeepsItsLastLossInADict, KeepsFeaturesFromForwardHooks])
@pytest.mark.parametrize("verify", ["sampled", False])
def test_a_value_the_step_only_writes_gets_a_new_tensor_per_replay_and_one_capture(cls, verify):
    """Found by the held-out hunt: the dict's entries were not followed at all (every collected entry
    aliased the graph's one tensor), the attribute's capture tensor was overwritten by each replay's
    copy-in, and the forward hooks' entries, rebound by each checked eager step, made every check
    capture again (15 graphs in 32 steps)."""
    cb = callback(verify=verify, check_share=1.0)
    run = fit(cls, [cb], steps=-1, n=96, trainer_kwargs={"max_epochs": 3})
    base = fit(baseline_of(cls), steps=-1, n=96, trainer_kwargs={"max_epochs": 3})
    summary = cb.summary()
    assert summary["captured"] and summary["captures"] == 1 and summary["fallback_steps"] == 0, summary
    assert_same(base, run)
    if hasattr(run[0], "history"):
        assert len({id(t) for t in run[0].history}) == len(run[0].history) == 36
        assert all(torch.equal(a, b) for a, b in zip(run[0].history, base[0].history))
