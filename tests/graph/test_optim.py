"""l2lightning.graph.optim on the CPU: which optimizers capture, and what make_capturable changes and undoes."""

from __future__ import annotations

import warnings

import pytest
import torch

from l2lightning.graph import optim
from l2lightning.graph.optim import (
    OptimizerNotCapturableError,
    capture_support,
    installed_capturable,
    make_capturable,
)


def params() -> list[torch.nn.Parameter]:
    return list(torch.nn.Linear(4, 4).parameters())


@pytest.mark.parametrize("kind", [torch.optim.Adam, torch.optim.AdamW, torch.optim.SGD])
def test_known_optimizers_capture(kind):
    assert capture_support(kind(params(), lr=0.1)) is None


def scheduled(optimizer):
    """`optimizer` with a PyTorch LR scheduler made for it (which sets each group's `initial_lr`)."""
    torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    return optimizer


@pytest.mark.parametrize(
    ("make", "tensor_lr"),
    [
        (lambda: torch.optim.Adam(params(), lr=0.1), True),
        (lambda: torch.optim.AdamW(params(), lr=0.1, fused=True), True),
        (lambda: torch.optim.Adadelta(params()), True),
        (lambda: torch.optim.RMSprop(params(), foreach=True), True),
        (lambda: torch.optim.Adadelta(params(), foreach=False), False),  # alpha=-lr would read the host
        (lambda: torch.optim.RMSprop(params(), differentiable=True), False),
        (lambda: torch.optim.SGD(params(), lr=0.1), False),  # no scheduler: its float LR, bitwise plain
        (lambda: scheduled(torch.optim.SGD(params(), lr=0.1, momentum=0.9)), True),  # fused, a tensor LR
        (lambda: scheduled(torch.optim.SGD(params(), lr=0.1, differentiable=True)), False),
        (lambda: torch.optim.Adagrad(params()), False),  # captured, its LR a baked float like SGD's
    ],
)
def test_which_optimizers_read_their_lr_from_a_tensor(make, tensor_lr):
    assert optim.reads_tensor_lr(make()) is tensor_lr


def test_an_lr_change_fills_the_tensor_and_is_not_a_baked_change(monkeypatch):
    monkeypatch.setattr(optim, "CAPTURABLE_DEVICE_TYPES", ("cuda", "cpu"))
    opt = torch.optim.Adadelta(params(), lr=1.0)
    wrapped = make_capturable(opt)
    opt.param_groups[0]["lr"] = 0.7
    wrapped.sync_tensors()
    assert wrapped.lr_tensors[0].item() == pytest.approx(0.7) and wrapped.baked_changes() == []
    opt.param_groups[0]["rho"] = 0.8  # still baked: named
    assert wrapped.baked_changes() == ["group 0 `rho` 0.9 -> 0.8"]


def test_an_optimizer_without_a_capturable_mode_is_named():
    reason = capture_support(torch.optim.LBFGS(params()))
    assert reason is not None and "LBFGS" in reason
    with pytest.raises(OptimizerNotCapturableError, match="LBFGS"):
        make_capturable(torch.optim.LBFGS(params()))


def test_cpu_parameters_are_refused_with_the_device():
    with pytest.raises(ValueError, match="on cpu"):
        make_capturable(torch.optim.AdamW(params(), lr=0.1))


def test_make_capturable_sets_the_flag_once_and_release_restores_it(monkeypatch):
    # The CPU tests' graph emulator widens the device types the same way.
    monkeypatch.setattr(optim, "CAPTURABLE_DEVICE_TYPES", ("cuda", "cpu"))
    opt = torch.optim.AdamW(params(), lr=0.1)
    assert installed_capturable(opt) is None
    wrapped = make_capturable(opt)
    assert all(group["capturable"] is True for group in opt.param_groups)
    assert installed_capturable(opt) is wrapped
    assert make_capturable(opt) is wrapped  # a second call must not wrap the wrapper
    assert wrapped.release() is opt
    assert all(group["capturable"] is False for group in opt.param_groups)
    assert installed_capturable(opt) is None
    assert isinstance(opt.param_groups[0]["lr"], float)


@pytest.mark.usefixtures("emulated_cuda_graphs")  # capturable AdamW steps on CPU parameters
def test_a_param_group_added_mid_fit_is_made_capturable_before_its_first_step():
    first, added = params(), [torch.nn.Parameter(torch.ones(3))]
    opt = torch.optim.AdamW(first, lr=0.1)
    wrapped = make_capturable(opt)
    opt.add_param_group({"params": added, "lr": 0.01})  # what BaseFinetuning does when it unfreezes
    assert opt.param_groups[1]["capturable"] is False  # the optimizer's default
    added[0].grad = torch.ones(3)
    opt.step()
    assert opt.param_groups[1]["capturable"] is True and opt.state[added[0]]["step"].device == added[0].device
    assert wrapped.lr_tensors[1] is not None and wrapped.lr_tensors[1].item() == torch.tensor(0.01).item()
    assert isinstance(opt.param_groups[1]["lr"], float)  # the group keeps its float between steps
    opt.param_groups[1]["lr"] = 0.5  # a fine-tuning schedule's change reaches the group's tensor
    opt.step()
    assert float(wrapped.lr_tensors[1]) == 0.5
    wrapped.release()
    assert [g["capturable"] for g in opt.param_groups] == [False, False]


def test_a_scheduler_made_after_make_capturable_wraps_the_step_and_the_step_still_reaches_the_handler(
    monkeypatch,
):
    """Lightning's StochasticWeightAveraging and LearningRateFinder make their schedulers mid-fit; the
    scheduler's constructor wraps ``optimizer.step`` through ``step.__func__``, which the installed
    step once lacked (AttributeError: 'function' object has no attribute '__func__')."""
    monkeypatch.setattr(optim, "CAPTURABLE_DEVICE_TYPES", ("cuda", "cpu"))
    opt = torch.optim.SGD(params(), lr=0.1)
    wrapped = make_capturable(opt)
    calls = []
    wrapped.handler = lambda run, closure, kwargs: calls.append("handler") or run(closure, **kwargs)
    scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    opt.step()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "lr_scheduler.step() before optimizer.step()" warning
        scheduler.step()
    assert calls == ["handler"] and opt.param_groups[0]["lr"] == 0.05
    wrapped.release()
    assert "step" not in vars(opt)  # the class's step again, the scheduler's wrapper with ours


# --------------------------------------------------------------------------- Adagrad
def test_adagrad_is_captured_where_its_lr_does_not_decay():
    assert capture_support(torch.optim.Adagrad(params())) is None
    reason = capture_support(torch.optim.Adagrad(params(), lr_decay=0.01))
    assert reason is not None and "`lr_decay` != 0 (param group 0)" in reason and "lr_decay=0" in reason
    with pytest.raises(OptimizerNotCapturableError, match="lr_decay"):
        make_capturable(torch.optim.Adagrad(params(), lr_decay=0.01))


def test_adagrad_reads_no_step_count_inside_its_switched_step_and_puts_the_read_back():
    from torch.optim import adagrad

    original = adagrad._get_value
    read: list = []
    opt = torch.optim.Adagrad(params())
    with optim._adagrad_step_count_unread(opt):
        assert adagrad._get_value(torch.tensor(7.0)) == 1.0
        read.append(adagrad._get_value)
    assert adagrad._get_value is original and read[0] is not original
    decaying = torch.optim.Adagrad(params(), lr_decay=0.5)
    with optim._adagrad_step_count_unread(decaying):  # its LR needs the count: read as torch reads it
        assert adagrad._get_value is original


@pytest.mark.parametrize(
    "kwargs",
    [{}, {"foreach": True}, {"weight_decay": 0.1}, {"foreach": True, "maximize": True, "weight_decay": 0.1}],
    ids=["single-tensor", "foreach", "weight-decay", "foreach-maximize-decay"],
)
def test_switched_adagrad_steps_are_bitwise_the_plain_ones(monkeypatch, kwargs):
    """The step count unread changes no number of Adagrad's update: five switched steps equal five
    plain ones bit for bit, parameters, sums and counters."""
    monkeypatch.setattr(optim, "CAPTURABLE_DEVICE_TYPES", ("cuda", "cpu"))

    def run(switched: bool):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
        opt = torch.optim.Adagrad(model.parameters(), lr=0.05, **kwargs)
        wrapped = make_capturable(opt) if switched else None
        for i in range(5):
            x = torch.randn(4, 8, generator=torch.Generator().manual_seed(i))
            opt.zero_grad()
            model(x).square().mean().backward()
            (wrapped.run if wrapped else opt.step)()
        state = [(s["sum"].clone(), s["step"].clone()) for s in opt.state.values()]
        return [p.detach().clone() for p in model.parameters()], state

    plain, switched = run(False), run(True)
    for a, b in zip(plain[0], switched[0]):
        assert torch.equal(a.view(torch.int32), b.view(torch.int32))
    for (sa, ta), (sb, tb) in zip(plain[1], switched[1]):
        assert torch.equal(sa, sb) and float(ta) == float(tb) == 5.0


def test_scheduled_sgd_runs_fused_with_a_tensor_lr_once_switched_and_gets_its_flags_back(monkeypatch):
    """Switched on, SGD under a scheduler takes the fused path (the only one that reads a tensor LR
    without a host read); switched off, and in a portable state dict, its own flags and float LR."""
    monkeypatch.setattr(optim, "CAPTURABLE_DEVICE_TYPES", ("cuda", "cpu"))
    opt = scheduled(torch.optim.SGD(params(), lr=0.1, momentum=0.9, foreach=True))
    wrapped = optim.intercept(opt)
    assert opt.param_groups[0]["foreach"] is True and not opt.param_groups[0]["fused"]  # not yet switched
    wrapped.switch_on()
    group = opt.param_groups[0]
    assert group["fused"] is True and group["foreach"] is False and isinstance(group["lr"], float)
    assert wrapped.lr_tensors[0] is not None and wrapped.baked_changes() == []
    group["lr"] = 0.025  # a scheduler's step: a tensor fill, not a baked change
    wrapped.sync_tensors()
    assert wrapped.lr_tensors[0].item() == pytest.approx(0.025) and wrapped.baked_changes() == []
    group["momentum"] = 0.8  # still baked: named
    assert wrapped.baked_changes() == ["group 0 `momentum` 0.9 -> 0.8"]
    portable = wrapped.portable_state_dict(opt.state_dict())["param_groups"][0]
    assert portable["fused"] is None and portable["foreach"] is True and isinstance(portable["lr"], float)
    wrapped.switch_off()
    assert group["fused"] is None and group["foreach"] is True and group["lr"] == 0.025


def test_fused_sgd_with_a_tensor_lr_steps_as_fused_sgd_with_that_float(monkeypatch):
    """The switched step, its LR read from the tensor, is the fused step (momentum, weight decay,
    nesterov) with that LR as a float, bit for bit, through an LR change."""
    monkeypatch.setattr(optim, "CAPTURABLE_DEVICE_TYPES", ("cuda", "cpu"))
    torch.manual_seed(0)
    a = torch.nn.Linear(8, 8)
    b = torch.nn.Linear(8, 8)
    b.load_state_dict(a.state_dict())
    kwargs = {"lr": 0.1, "momentum": 0.9, "weight_decay": 1e-2, "nesterov": True}
    ours = scheduled(torch.optim.SGD(a.parameters(), **kwargs))
    ref = torch.optim.SGD(b.parameters(), fused=True, **kwargs)
    optim.make_capturable(ours)
    x = torch.randn(4, 8)
    for step in range(4):
        for model, opt in ((a, ours), (b, ref)):
            opt.zero_grad()
            model(x).square().mean().backward()
            opt.step()
            opt.param_groups[0]["lr"] = 0.1 * 0.5 ** (step + 1)
    for p, q in zip(a.parameters(), b.parameters()):
        assert torch.equal(p, q)


def test_torchs_capturable_adam_reads_tensor_betas_on_the_host(monkeypatch):
    """Why Adam's betas stay floats baked into the graph (OneCycleLR's and CyclicLR's
    ``cycle_momentum=True`` captures again at every step, so the warm-up refuses it): torch's own
    capturable AdamW, given its betas as device tensors, still turns them into host numbers
    (``_local_scalar_dense``, a sync on CUDA) on the foreach and the single-tensor path, where a
    tensor LR is read on the device. If this fails, torch reads tensor betas on the device: adopt them
    as the LR is."""
    from torch.optim import adam as torch_adam
    from torch.optim import optimizer as torch_optimizer
    from torch.utils._python_dispatch import TorchDispatchMode

    class HostReads(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.count = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.count += func is torch.ops.aten._local_scalar_dense.default
            return func(*args, **(kwargs or {}))

    devices = lambda supports_xla=True: ["cpu", "cuda"]  # noqa: E731 -- capturable on the CPU here
    monkeypatch.setattr(torch_optimizer, "_get_capturable_supported_devices", devices)
    monkeypatch.setattr(torch_adam, "_get_capturable_supported_devices", devices)
    for foreach in (True, False):
        reads = {}
        for betas in ((0.9, 0.99), (torch.tensor(0.9), torch.tensor(0.99))):
            p = torch.randn(4, requires_grad=True)
            opt = torch.optim.AdamW([p], lr=torch.tensor(0.01), betas=betas, capturable=True, foreach=foreach)
            p.grad = torch.randn(4)
            opt.step()
            with HostReads() as mode:
                opt.step()
            reads[isinstance(betas[0], torch.Tensor)] = mode.count
        assert reads[False] == 0 and reads[True] > 0, (foreach, reads)


def test_the_not_capturable_error_is_importable_from_the_package():
    import l2lightning

    assert l2lightning.OptimizerNotCapturableError is OptimizerNotCapturableError
    assert "OptimizerNotCapturableError" in l2lightning.__all__
