"""Carried state on the CPU (graph emulator): an attribute the step reads and rebinds to its own results
is handed to every replay, so pytorch/examples' word language model (its LSTM's hidden state under
``repackage_hidden``, ``init_hidden`` at each epoch start) trains bit for bit like its baseline."""

from __future__ import annotations

import pytest
import torch

from l2lightning import carried_state
from tests.baselines import (  # noqa: F401 -- the fixture records each callback fit's switch step
    baseline_of,
    capturable_from_of_the_last_callback_fit,
)
from tests.idiom_modules import WordLanguageModel, _text_loader
from tests.test_callback_replay_cpu import assert_same, callback, fit

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
    # oneDNN's LSTM kernel runs eagerly, the decomposed ops under the emulator's dispatch mode: off
    with torch.backends.mkldnn.flags(enabled=False):
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
    monkeypatch.setattr(carried_state, "carried_attributes", lambda changes, made: [])
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
    from l2lightning.step_trace import draws_hidden_random_state

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
