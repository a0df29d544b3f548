"""Lightning's ``grad_norm`` after a replay with one read back from the GPU instead of one per parameter.

``self.log_dict(grad_norm(self, norm_type=2))`` in ``on_before_optimizer_step`` (Lightning's
debugging docs) computes each gradient's norm on the device, then the total from
``torch.tensor(list(norms.values()))``: a host tensor built from device numbers, one read back and
wait per parameter. A graph cannot hold that, so the callback runs such a read-only hook after each
replay (:meth:`l2lightning.callback.warmup_steps.WarmupSteps._runs_after_replay`), where those waits make
up most of its step: on the H200 the callback's step of the ``grad_norm_logging`` idiom was 7.29 ms
against plain Lightning's 7.75 (``benchmarks/results/h200/idioms.csv``).

:func:`batched_grad_norm` is the same function with the per-parameter norms stacked and copied to
the host at once; the total is then built from those host values as Lightning builds it from the
device ones, so every norm, the total included, is bit for bit Lightning's. With it the idiom's step
was 6.86 ms against plain's 9.74 (``idioms_sgd_gradnorm_recapture.csv``: single fits, so the two
results compare only as ratios, 1.06x before and 1.42x after).
:func:`batched_grad_norm_in` puts it in place of Lightning's for the duration of a hook's call:
under every name the hook's module binds Lightning's function to, and on Lightning's own modules.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import lightning.pytorch.utilities as lightning_utilities
import torch
from lightning.pytorch.utilities import grads as lightning_grads

LIGHTNING_GRAD_NORM = lightning_grads.grad_norm


def batched_grad_norm(
    module: torch.nn.Module, norm_type: float | int | str, group_separator: str = "/"
) -> dict[str, torch.Tensor]:
    """Lightning's ``grad_norm`` (same keys, same values bit for bit), the total from one host copy.

    Where the norms differ in dtype or device, ``torch.stack`` would convert them: Lightning's own
    function runs instead."""
    norm_type = float(norm_type)
    if norm_type <= 0:
        raise ValueError(f"`norm_type` must be a positive number or 'inf' (infinity norm). Got {norm_type}")
    norms = {
        f"grad_{norm_type}_norm{group_separator}{name}": p.grad.data.norm(norm_type)
        for name, p in module.named_parameters()
        if p.grad is not None
    }
    if not norms:
        return norms
    values = list(norms.values())
    if len({(v.dtype, v.device) for v in values}) != 1:
        return LIGHTNING_GRAD_NORM(module, norm_type, group_separator)
    # Lightning: torch.tensor(values) reads each device number into a host tensor of their dtype;
    # the same numbers, read at once, make the same host tensor
    host = torch.stack(values).cpu()
    norms[f"grad_{norm_type}_norm_total"] = torch.tensor(list(host.unbind())).norm(norm_type)
    return norms


class GradNormNames:
    """Where a hook's code finds Lightning's ``grad_norm``: the names its module's globals bind it to
    (found once per hook function), and Lightning's own two modules."""

    def __init__(self) -> None:
        self._names: dict[Any, tuple[dict[str, Any], tuple[str, ...]]] = {}

    def of(self, hook: Callable[..., Any]) -> tuple[dict[str, Any], tuple[str, ...]]:
        function = getattr(hook, "__func__", hook)
        found = self._names.get(function)
        if found is None:
            namespace = getattr(function, "__globals__", {})
            names = tuple(name for name, value in namespace.items() if value is LIGHTNING_GRAD_NORM)
            found = self._names[function] = (namespace, names)
        return found


@contextlib.contextmanager
def batched_grad_norm_in(hook: Callable[..., Any], names: GradNormNames) -> Iterator[None]:
    """:func:`batched_grad_norm` in place of Lightning's ``grad_norm`` while `hook` runs; everything
    is put back after, whatever the hook raises."""
    namespace, bound = names.of(hook)
    replaced = [(namespace, name) for name in bound if namespace.get(name) is LIGHTNING_GRAD_NORM]
    replaced += [
        (vars(owner), "grad_norm")
        for owner in (lightning_utilities, lightning_grads)
        if vars(owner).get("grad_norm") is LIGHTNING_GRAD_NORM
    ]
    for where, name in replaced:
        where[name] = batched_grad_norm
    try:
        yield
    finally:
        for where, name in replaced:
            where[name] = LIGHTNING_GRAD_NORM
