"""l2lightning.guards.compiled_calls: finding what a compiled call compiles and the host tensors it reads."""

from __future__ import annotations

import functools
import subprocess
import sys
import textwrap

import torch

from l2lightning.guards.compiled_calls import compiled_target, host_tensors_read_by, partial_arguments

HOST = torch.tensor(1.0)
ON_DEVICE = torch.ones(1, device="meta")  # "meta" stands for the device in these tests
HOST_BIAS = torch.tensor(0.0)


def reads_both(x):
    return x * HOST + ON_DEVICE


def test_the_target_of_a_module_call_is_the_module_and_of_wrappers_the_users_function_last():
    layer = torch.nn.Linear(2, 2)
    assert compiled_target(layer.forward) == (layer, [])

    @functools.wraps(reads_both)
    def wrapper(*args, **kwargs):
        return reads_both(*args, **kwargs)

    bound = functools.partial(wrapper, 2.0)
    module, chain = compiled_target(bound)
    assert module is None and chain == [bound, wrapper, reads_both]
    assert partial_arguments(bound) == ((2.0,), {}) and partial_arguments(wrapper) == ((), {})


def test_host_tensors_read_by_a_function_are_its_host_globals_closure_cells_and_defaults_only():
    local = torch.tensor(2.0)

    def closes_over(x, bias=HOST_BIAS, device_bias=ON_DEVICE):
        return x * local + bias + device_bias + torch.zeros(1)

    assert host_tensors_read_by(reads_both, "meta") == ["HOST"]  # ON_DEVICE is the device's
    assert host_tensors_read_by(closes_over, "meta") == ["local", "bias"]
    assert host_tensors_read_by(closes_over, "cpu") == ["device_bias"]
    assert host_tensors_read_by(torch.nn.Linear(1, 1), "meta") == []  # not a plain function


def test_without_dynamo_loaded_nothing_is_watched_and_no_function_is_wrapped():
    """A process that never compiled anything does not import dynamo for the watch."""
    code = textwrap.dedent(
        """
        import sys
        from l2lightning.guards.compiled_calls import never_compiled, watching_compiled_calls
        assert "torch._dynamo.eval_frame" not in sys.modules
        def check(*args):
            raise AssertionError("called")
        assert never_compiled(check) is check
        with watching_compiled_calls(check) as watching:
            assert watching is False
        assert "torch._dynamo.eval_frame" not in sys.modules
        print("ok")
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]
