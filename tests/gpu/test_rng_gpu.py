"""GPU: putting the CUDA generator back leaves cuDNN's RNN dropout state alone (``l2lightning.graph.rng``).

Setting a CUDA generator's state the usual way (``torch.cuda.set_rng_state``) makes the next cuDNN
RNN call with dropout re-seed its dropout state: a host sync (``.item()``) that no graph capture can
hold, and other masks than a plain fit draws. The word language model of ``tests/idiom_modules.py``
(a 2-layer LSTM with dropout, its hidden state carried across steps) is the idiom that needs it: it
is captured, its replays are checked against the eager step with cuDNN's dropout state saved and put
back, and the fit is bitwise its baseline.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from l2lightning.graph.rng import cuda_rng_states, put_back_cuda_rng
from tests.idiom_harness import judge

pytestmark = pytest.mark.gpu


@pytest.fixture
def lstm_and_input():
    torch.manual_seed(0)
    lstm = nn.LSTM(16, 16, 2, dropout=0.2).cuda()
    x = torch.randn(5, 3, 16, device="cuda")
    lstm(x)  # the first call after manual_seed seeds cuDNN's dropout state (a sync, once)
    torch.cuda.synchronize()
    return lstm, x


def _syncs(call) -> bool:
    torch.cuda.set_sync_debug_mode("error")
    try:
        call()
    except RuntimeError as exc:
        if "synchroniz" not in str(exc):
            raise
        return True
    finally:
        torch.cuda.set_sync_debug_mode("default")
    return False


def test_put_back_restores_the_generator_without_a_cudnn_reseed(lstm_and_input):
    lstm, x = lstm_and_input
    saved = cuda_rng_states([torch.cuda.current_device()])
    torch.rand(1000, device="cuda")  # moves the offset on
    put_back_cuda_rng(saved)
    assert torch.equal(torch.cuda.get_rng_state(), saved[0][1])
    assert not _syncs(lambda: lstm(x)), "the LSTM re-seeded its dropout state after put_back_cuda_rng"


def test_torch_set_rng_state_still_makes_cudnn_reseed(lstm_and_input):
    """What put_back_cuda_rng works around: if torch stops re-seeding, this fails and the module's
    reason is gone (the put-back would still be right)."""
    lstm, x = lstm_and_input
    torch.cuda.set_rng_state(torch.cuda.get_rng_state())
    assert _syncs(lambda: lstm(x))


def test_the_word_language_model_is_captured_checked_and_its_baseline():
    result = judge("word_language_model", steps=60, accelerator="gpu")
    assert result["captured"] is True, result["reason"]
    assert result["equal"] is True, result["detail"]
    report = result["extra"]["summary"]["replay_check"]
    # replay 1 of each capture always; the rest within the default 2% of the fit's time
    assert report["checks"] >= 1 and report["mismatches"] == 0 and report["off_reason"] is None, report


@pytest.mark.parametrize("name", ["word_language_model_unchecked", "lstm_state_in_a_layer"])
def test_carried_lstm_state_alone_keeps_the_replays_bitwise(name):
    """With no replay checked (verify=False) nothing but the carried state stands between a replay and
    stale hidden state: on the module (the word language model) or on a layer of its own
    (``self.state = ...`` in a submodule's forward). On the CPU graph emulator both differ from their
    baselines at rounding level from the first replays (CPU nn.LSTM), which is why this runs here."""
    result = judge(name, steps=60, accelerator="gpu")
    assert result["captured"] is True, result["reason"]
    assert result["equal"] is True, result["detail"]
