"""PrefetchHooks, and the one place a prefetch setting becomes per-layer plans.

A setting is what users and the library's own callers write: ``"default"`` (plans sized by layer
bytes), ``"off"``, ``"auto"`` (the autotuner measures a plan per layer shape), ``"decoy"`` (the
default plans aimed half the chain away, a control), one :class:`PrefetchPlan` for every layer
large enough, or a mapping from layer name to plan. :func:`resolve_plans` turns it into one plan
(or None) per chain layer, calling the tuner for ``"auto"``; :class:`PrefetchHooks` installs what it
returns through :class:`~l2lightning.prefetch.install.PlanHooks`.

The split is what keeps the imports acyclic: the tuner times its throwaway chains through
``PlanHooks``, so the hooks that install plans cannot be the module that calls the tuner.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from l2lightning.prefetch.chain import Layer, device_l2_bytes
from l2lightning.prefetch.install import Issuer, PlanHooks
from l2lightning.prefetch.plan import PlansArg, PrefetchPlan, layer_plans

# The settings a caller may pass besides a plan or a mapping.
SETTINGS = ("default", "off", "auto", "decoy")


@dataclass
class ResolvedPlans:
    """Per-layer plans for one chain: what the hooks install."""

    forward: list[PrefetchPlan | None]
    backward: list[PrefetchPlan | None]
    decoy: bool = False
    tuning_report: Any = None


def make_autotuner(autotune: Any) -> Any:
    """An :class:`~l2lightning.tune.search.Autotuner` from the ``autotune`` argument: None (the
    defaults: 0.6 s per shape, throwaway copies within a quarter of the model's parameter bytes,
    the on-disk plan cache), an ``Autotuner``, or a mapping of its keyword arguments
    (``{"budget_s": 1.0, "memory_budget": 0.5, "cache": None}``, what a Hydra config gives)."""
    from l2lightning.tune.search import Autotuner

    if autotune is None:
        return Autotuner()
    if isinstance(autotune, Autotuner):
        return autotune
    if isinstance(autotune, Mapping):
        accepted = sorted(inspect.signature(Autotuner).parameters)
        unknown = sorted(set(autotune) - set(accepted))
        if unknown:
            raise ValueError(f"`autotune` has unknown settings {unknown}; accepted: {accepted}")
        return Autotuner(**dict(autotune))
    raise TypeError(
        f"`autotune` must be None, an l2lightning.Autotuner or a mapping of its settings, "
        f"got {type(autotune).__name__}"
    )


def hook_settings(setting: Any) -> tuple[PlansArg, bool]:
    """(plans argument, decoy) for a prefetch setting; ``"decoy"`` is the default plans, misaimed."""
    if isinstance(setting, str) and setting == "decoy":
        return None, True
    return setting, False


def resolve_plans(
    chain: Sequence[Layer],
    device: torch.device,
    plans: PlansArg,
    backward_plans: PlansArg = None,
    *,
    backward: bool = True,
    autotune: Any = None,
    model_bytes: int | None = None,
) -> ResolvedPlans:
    """Per-layer plans of a setting (see the module docstring) for `chain` on `device`.

    ``backward_plans`` None means the same setting as forward. ``"auto"`` tunes the phases that ask
    for it (backward only when `backward`) with the tuner `autotune` describes (:func:`make_autotuner`);
    `model_bytes`, the model's parameter bytes, scales its memory budget (default: the chain's).
    """
    plans, decoy = hook_settings(plans)
    backward_arg = plans if backward_plans is None else hook_settings(backward_plans)[0]
    report = None
    if plans == "auto" or backward_arg == "auto":
        from l2lightning.tune.report import TuningReport

        phases = tuple(
            phase
            for phase, on in (("forward", plans == "auto"), ("backward", backward and backward_arg == "auto"))
            if on
        )
        report = (
            make_autotuner(autotune).tune(chain, device, phases, model_bytes=model_bytes)
            if phases
            else TuningReport()
        )
    l2 = device_l2_bytes(device)
    forward = (
        report.plans_for(chain, "forward") if plans == "auto" else layer_plans(chain, plans, l2, "plans")
    )
    backward_list = (
        report.plans_for(chain, "backward")
        if backward_arg == "auto"
        else layer_plans(chain, backward_arg, l2, "backward_plans")
    )
    return ResolvedPlans(forward, backward_list, decoy, report)


class PrefetchHooks(PlanHooks):
    """Installs forward/backward L2 prefetch hooks on an unmodified model, for any prefetch setting.

    The arguments are :class:`~l2lightning.prefetch.install.PlanHooks`' (model, example_input,
    backward, step, backward_plans, decoy, scope, via, issuer), with two additions:

    Args:
        plans: as in ``PlanHooks``, and ``"auto"``: the autotuner measures plans per layer shape
            (``backward_plans`` may be ``"auto"`` too).
        autotune: the tuner for ``"auto"``: None (its defaults), an :class:`~l2lightning.Autotuner`,
            or a mapping of its settings (see :func:`make_autotuner`).

    Example:
        >>> model = nn.Sequential(*[nn.Linear(1536, 1536) for _ in range(8)]).cuda()  # doctest: +SKIP
        >>> hooks = PrefetchHooks(model, torch.randn(16, 1536, device="cuda"))  # doctest: +SKIP
        >>> y = model(x)  # forward and backward now prefetch the next layer's weights  # doctest: +SKIP
        >>> hooks.remove()  # doctest: +SKIP
    """

    def __init__(
        self,
        model: nn.Module,
        example_input: Any,
        backward: bool = True,
        step: Callable[[nn.Module, Any], Any] | None = None,
        plans: PlansArg = None,
        *,
        backward_plans: PlansArg = None,
        decoy: bool = False,
        scope: str = "forward",
        via: str = "hooks",
        issuer: Issuer | None = None,
        autotune: Any = None,
    ) -> None:
        # Built now, so that a wrong `autotune` fails before the dry run.
        self._autotune = None if autotune is None else make_autotuner(autotune)
        super().__init__(
            model,
            example_input,
            backward,
            step,
            plans,
            backward_plans=backward_plans,
            decoy=decoy,
            scope=scope,
            via=via,
            issuer=issuer,
        )

    def _plans_for(
        self, plans: PlansArg, backward_plans: PlansArg
    ) -> tuple[list[PrefetchPlan | None], list[PrefetchPlan | None]]:
        from l2lightning.tune.memory import tensor_bytes

        resolved = resolve_plans(
            self.chain,
            self.device,
            plans,
            backward_plans,
            backward=self.backward,
            autotune=self._autotune,
            model_bytes=tensor_bytes(self.model.parameters()),
        )
        self.tuning_report = resolved.tuning_report
        return resolved.forward, resolved.backward
