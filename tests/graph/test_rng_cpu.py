"""The generator put-backs and the watch on torch.cuda's state setters (``l2lightning.graph.rng``), on the CPU.

What needs CUDA (that the put-back leaves cuDNN's re-seed flag alone) is in tests/gpu/test_rng_gpu.py.
"""

from __future__ import annotations

import torch

from l2lightning.graph.rng import forked_rng, watch_cuda_state_setters
from l2lightning.guards.step_trace import cudnn_dropout_state


def test_forked_rng_puts_the_cpu_generator_back():
    torch.manual_seed(5)
    want = torch.rand(3)
    torch.manual_seed(5)
    with forked_rng():
        torch.rand(100)
    assert torch.equal(torch.rand(3), want)


def test_forked_rng_puts_it_back_when_the_block_raises():
    torch.manual_seed(6)
    want = torch.get_rng_state()
    try:
        with forked_rng():
            torch.rand(10)
            raise KeyError("inside")
    except KeyError:
        pass
    assert torch.equal(torch.get_rng_state(), want)


def test_the_watch_sees_torch_manual_seed_and_fork_rng_and_undo_puts_the_functions_back():
    original = torch.cuda.manual_seed_all
    seen: list[str] = []
    undo = watch_cuda_state_setters(seen.append)
    try:
        torch.manual_seed(1)  # torch.random.manual_seed seeds CUDA through torch.cuda.manual_seed_all
        torch.cuda.manual_seed(2)
    finally:
        undo()
    assert seen == ["manual_seed_all", "manual_seed"]
    assert torch.cuda.manual_seed_all is original
    torch.manual_seed(3)
    assert seen == ["manual_seed_all", "manual_seed"]  # nothing after undo


def test_cudnn_dropout_state_is_the_ops_dropout_state_argument_only_with_dropout_in_training():
    op = torch.ops.aten._cudnn_rnn.default
    names = [a.name for a in op._schema.arguments]
    buffer = torch.zeros(8, dtype=torch.uint8)

    def args(dropout, train, state=buffer):
        values = [None] * len(names)
        values[names.index("dropout")], values[names.index("train")] = dropout, train
        values[names.index("dropout_state")] = state
        return tuple(values)

    assert cudnn_dropout_state(op, args(0.2, True), {}) is buffer
    assert cudnn_dropout_state(op, args(0.2, False), {}) is None
    assert cudnn_dropout_state(op, args(0.0, True), {}) is None
    assert cudnn_dropout_state(op, args(0.2, True, None), {}) is None
    assert cudnn_dropout_state(torch.ops.aten.mm.default, (None, None), {}) is None
