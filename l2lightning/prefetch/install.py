"""PlanHooks: cross-layer L2 weight prefetch on an unmodified model, through module and tensor hooks.

One dry run finds the chain of weight-reading layers in execution order. Then, while layer i runs
forward, a side stream prefetches the weights of layer i+distance; in backward, just before layer
i's gradients are computed, it prefetches W_{i-1}. The side stream waits on the main stream right
before each issue (so a prefetch starts when op i starts) and the main stream waits on the side
stream once at the end of forward and once when the last chain layer's output gradient is ready
(`torch.autograd.graph.register_multi_grad_hook`, which knows which gradients this backward will
compute, whatever the order): a CUDA-graph capture must rejoin every stream it forks, and a join
costs a graph edge, so there are exactly two.

The hooks act only while the model's own forward runs (a flag set by a forward pre-hook on the
model), so calling a submodule on its own behaves like plain PyTorch. Fused blocks
(`nn.TransformerEncoderLayer`, `nn.MultiheadAttention`, ...) are treated as one layer and hooked
from the outside, so PyTorch's fused fast paths stay on.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from l2lightning._env import prefetch_unavailable_reason, warn_once
from l2lightning.prefetch.chain import Layer, device_l2_bytes, discover_chain, iter_tensors
from l2lightning.prefetch.plan import PlansArg, PrefetchPlan, check_plans_arg, layer_plans


class Issuer:
    """Where the hooks' prefetches go. The CUDA issuer launches kernels; tests record the calls."""

    def issue(self, layer: Layer, plan: PrefetchPlan, phase: str) -> None:
        raise NotImplementedError

    def join(self, phase: str) -> None:
        raise NotImplementedError


class CudaIssuer(Issuer):
    """Launches prefetches on a side stream forked from the current stream, and joins it back."""

    def __init__(self, device: torch.device) -> None:
        from l2lightning.prefetch.kernels import load_prefetch_kernels

        self.device = device
        load_prefetch_kernels(device.index or 0)  # compile now: NVRTC must not run inside a capture
        self.side = torch.cuda.Stream(device=device)
        self._pending = False

    def issue(self, layer: Layer, plan: PrefetchPlan, phase: str) -> None:
        from l2lightning.prefetch.kernels import prefetch

        main = torch.cuda.current_stream(self.device)
        self.side.wait_stream(main)  # start when the current op starts, never earlier
        with torch.cuda.stream(self.side):
            for w in layer.weights:
                prefetch(w, plan)
        self._pending = True

    def join(self, phase: str) -> None:
        # Only a used side stream is joined: joining an unforked stream inside a capture is an error.
        if self._pending:
            torch.cuda.current_stream(self.device).wait_stream(self.side)
            self._pending = False


@dataclass
class _BackwardPass:
    """Layers whose outputs got a gradient hook in one forward pass (backward follows it)."""

    layers: set[int] = field(default_factory=set)
    outputs: list[torch.Tensor] = field(default_factory=list)
    # The backward join's handle. `register_multi_grad_hook` closes over the grad_fns it hooks, so
    # its hook makes a reference cycle with the autograd graph; only removing the hook breaks it.
    join: Any = None

    def release(self) -> None:
        """Remove the join hook (once): its reference cycle no longer holds this pass's graph."""
        if self.join is not None:
            self.join.remove()
            self.join = None


class PlanHooks:
    """Installs forward/backward L2 prefetch hooks with the plans it is given on an unmodified model.

    The public :class:`l2lightning.PrefetchHooks` is this class plus the ``"auto"`` setting (the tuner).

    Args:
        model: the model; its own forward and backward get the prefetch, a submodule called alone does not.
        example_input: one input for the dry run that finds the chain (tensor, tuple for ``*args``,
            dict for ``**kwargs``). The dry run restores buffers and RNG, and runs under no_grad.
        backward: also prefetch W_{i-1} in backward.
        step: ``step(model, example_input)`` to run the dry forward pass when calling the model
            needs more than ``model(example_input)``.
        plans: ``None`` or ``"default"`` (default plans sized by layer bytes), ``"off"``, a
            :class:`PrefetchPlan` for every layer large enough, or a mapping from layer name to plan
            (``None`` = no prefetch for that layer). ``"auto"`` is :class:`l2lightning.PrefetchHooks`'.
        backward_plans: like ``plans`` for the backward pass; default: the same as forward.
        decoy: aim the same traffic at the wrong layer (half the chain away), as a control.
        via: ``"hooks"`` (default): Python hooks issue the prefetches. ``"ops"``: the hooks insert
            identity autograd functions that call the custom ops of :mod:`l2lightning.prefetch.ops`,
            so ``torch.compile`` traces them into its graph instead of breaking it; the caller then
            joins the side stream after backward with :meth:`join`.
        scope: ``"forward"`` (default): the hooks act while ``model.forward`` runs. ``"manual"``: they
            act only inside ``with hooks.scope():``, for callers whose step reaches the layers
            without calling ``model(...)`` (a LightningModule's ``training_step`` calling ``self.net``).
        issuer: where prefetches go (advanced; tests pass a recorder). Default: CUDA kernels on a
            side stream of the model's device.

    Example:
        >>> model = nn.Sequential(*[nn.Linear(1536, 1536) for _ in range(8)]).cuda()  # doctest: +SKIP
        >>> hooks = PlanHooks(model, torch.randn(16, 1536, device="cuda"))  # doctest: +SKIP
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
    ) -> None:
        if not isinstance(model, nn.Module):
            raise TypeError(f"`model` must be an nn.Module, got {type(model).__name__}")
        if not isinstance(backward, bool):
            raise TypeError(f"`backward` must be a bool, got {type(backward).__name__}")
        if not isinstance(decoy, bool):
            raise TypeError(f"`decoy` must be a bool, got {type(decoy).__name__}")
        if step is not None and not callable(step):
            raise TypeError("`step` must be a callable step(model, example_input) or None")
        if scope not in ("forward", "manual"):
            raise ValueError(f"`scope` must be 'forward' or 'manual', got {scope!r}")
        self.scope_mode = scope
        if via not in ("hooks", "ops"):
            raise ValueError(f"`via` must be 'hooks' or 'ops', got {via!r}")
        self.via = via
        check_plans_arg("plans", plans)
        check_plans_arg("backward_plans", backward_plans)
        self.model = model
        self.backward = backward
        self.decoy = decoy
        self.chain = discover_chain(model, example_input, step)
        self.tuning_report: Any = None
        device = next((p.device for p in model.parameters()), torch.device("cpu"))
        self.device = device
        self._handles: list[Any] = []
        self._active = False
        self._pass: _BackwardPass | None = None
        self._removed = False
        self.issuer = issuer
        if issuer is None:
            reason = prefetch_unavailable_reason() or (
                None if device.type == "cuda" else f"the model is on {device}"
            )
            if reason:
                warn_once(
                    "prefetch-unavailable",
                    f"l2lightning: L2 prefetch is off ({reason}); running plain PyTorch.",
                )
                self.forward_plans = [None] * len(self.chain)
                self.backward_plans = [None] * len(self.chain)
                return
            self.issuer = CudaIssuer(device)
        backward_arg = plans if backward_plans is None else backward_plans
        self.forward_plans, self.backward_plans = self._plans_for(plans, backward_arg)
        self._install()

    # ---------------------------------------------------------------- plans
    def _plans_for(
        self, plans: PlansArg, backward_plans: PlansArg
    ) -> tuple[list[PrefetchPlan | None], list[PrefetchPlan | None]]:
        """Per-layer (forward, backward) plans of the given settings. These hooks only install plans:
        ``"auto"`` is resolved by :class:`l2lightning.prefetch.hooks.PrefetchHooks`, which calls the
        tuner (the tuner times its throwaway chains through this class, so it cannot be called from here)."""
        l2 = device_l2_bytes(self.device)
        for name, value in (("plans", plans), ("backward_plans", backward_plans)):
            if isinstance(value, str) and value == "auto":
                raise ValueError(
                    f"`{name}`='auto' needs the tuner: use l2lightning.PrefetchHooks, which resolves it"
                )
        return layer_plans(self.chain, plans, l2, "plans"), layer_plans(
            self.chain, backward_plans, l2, "plans"
        )

    def _forward_schedule(self) -> dict[int, list[tuple[int, PrefetchPlan]]]:
        """Issuing layer -> [(target layer, plan)]: target j is issued while layer j - distance runs."""
        schedule: dict[int, list[tuple[int, PrefetchPlan]]] = {}
        for j, plan in enumerate(self.forward_plans):
            if plan is not None and j - plan.distance >= 0:
                schedule.setdefault(j - plan.distance, []).append((j, plan))
        return schedule

    def _backward_schedule(self) -> dict[int, list[tuple[int, PrefetchPlan]]]:
        """Layer whose backward is about to run -> [(target layer, plan)]: W_{i-distance} next."""
        schedule: dict[int, list[tuple[int, PrefetchPlan]]] = {}
        for j, plan in enumerate(self.backward_plans):
            if plan is not None and j + plan.distance < len(self.chain):
                schedule.setdefault(j + plan.distance, []).append((j, plan))
        return schedule

    def _aim(self, target: int) -> Layer:
        """The layer whose bytes are fetched for `target`: itself, or half the chain away as the decoy."""
        if not self.decoy:
            return self.chain[target]
        return self.chain[(target + max(1, len(self.chain) // 2)) % len(self.chain)]

    # ---------------------------------------------------------------- hooks
    def _install(self) -> None:
        forward = self._forward_schedule()
        backward = self._backward_schedule() if self.backward else {}
        if self.via == "ops":
            self._install_ops(forward, backward)
            return
        if self.scope_mode == "forward":
            self._handles.append(self.model.register_forward_pre_hook(self._on_model_start))
            self._handles.append(self.model.register_forward_hook(self._on_model_end))
        for layer in self.chain:
            targets = forward.get(layer.index, [])
            if targets:
                self._handles.append(layer.module.register_forward_pre_hook(self._make_pre_hook(targets)))
            if self.backward and any(p is not None for p in self.backward_plans):
                self._handles.append(
                    layer.module.register_forward_hook(
                        self._make_post_hook(layer.index, backward.get(layer.index, []))
                    )
                )

    def _on_model_start(self, module: nn.Module, args: tuple) -> None:
        self._begin()

    def _on_model_end(self, module: nn.Module, args: tuple, output: Any) -> None:
        self._end()

    def _begin(self) -> None:
        self._release_pass()
        self._active = True
        self._pass = _BackwardPass()
        if self.via == "ops":
            self._ops_layers = set()

    def _end(self) -> None:
        if not self._active:
            return
        self._active = False
        self.issuer.join("forward")
        backward_pass = self._pass
        if backward_pass is not None and backward_pass.outputs:
            # Registered after every per-layer grad hook, so on the tensor whose gradient comes last
            # the prefetch issue runs first and this join second. Tensors this backward will not
            # reach are ignored by mode="all", so the join always fires when backward runs.
            backward_pass.join = torch.autograd.graph.register_multi_grad_hook(
                backward_pass.outputs, self._make_backward_join(backward_pass), mode="all"
            )
            backward_pass.outputs = []  # the hook holds what it needs; do not keep activations alive

    def _release_pass(self) -> None:
        """Drop the last pass's join hook if its backward never ran (a forward-only dry run).

        Left in place, its reference cycle keeps that pass's autograd graph alive until the garbage
        collector runs, and with it the parameters' AccumulateGrad nodes, which remember the stream
        they were made on: a graph captured on another stream then accumulates through them, and
        the capture fails ("AccumulateGrad node's stream does not match"), seen on the H200 when a
        dry run on the default stream preceded the capture and no collection ran in between.
        """
        if self._pass is not None:
            self._pass.release()

    @contextlib.contextmanager
    def scope(self) -> Iterator[None]:
        """With ``scope="manual"``: the forward pass inside this block gets the prefetch."""
        if self.scope_mode != "manual":
            raise RuntimeError(
                "PrefetchHooks.scope() is for scope='manual'; with 'forward' the model's forward is the scope"
            )
        if not self.enabled:
            yield
            return
        self._begin()
        try:
            yield
        finally:
            self._end()

    def _make_pre_hook(self, targets: list[tuple[int, PrefetchPlan]]) -> Callable[..., None]:
        def pre_hook(module: nn.Module, args: tuple) -> None:
            if self._active:
                for target, plan in targets:
                    self.issuer.issue(self._aim(target), plan, "forward")

        return pre_hook

    def _make_post_hook(self, index: int, targets: list[tuple[int, PrefetchPlan]]) -> Callable[..., None]:
        def post_hook(module: nn.Module, args: tuple, output: Any) -> None:
            if not (self._active and torch.is_grad_enabled()):
                return
            tensor = next((t for t in iter_tensors(output) if t.requires_grad), None)
            if tensor is None:
                return
            backward_pass = self._pass
            backward_pass.layers.add(index)
            backward_pass.outputs.append(tensor)
            tensor.register_hook(self._make_grad_hook(targets, backward_pass))

        return post_hook

    def _make_backward_join(self, backward_pass: _BackwardPass) -> Callable[[Any], None]:
        def join(grads: Any) -> None:
            # It fires once per pass: break its cycle when this backward ends (not from inside the
            # hook, whose own hook dictionary autograd is walking right now).
            torch.autograd.Variable._execution_engine.queue_callback(backward_pass.release)
            if not self._removed:
                self.issuer.join("backward")

        return join

    def _make_grad_hook(
        self, targets: list[tuple[int, PrefetchPlan]], backward_pass: _BackwardPass
    ) -> Callable[[torch.Tensor], None]:
        # Runs on the autograd thread right before layer `index`'s backward, with the stream of the
        # forward op current (the capture stream inside a graph capture).
        def grad_hook(grad: torch.Tensor) -> None:
            if self._removed:
                return
            for target, plan in targets:
                if target in backward_pass.layers:  # a layer without backward needs no weights
                    self.issuer.issue(self._aim(target), plan, "backward")

        return grad_hook

    # ---------------------------------------------------------------- custom-op points (via="ops")
    def _install_ops(
        self,
        forward: dict[int, list[tuple[int, PrefetchPlan]]],
        backward: dict[int, list[tuple[int, PrefetchPlan]]],
    ) -> None:
        from l2lightning.prefetch import ops as prefetch_ops

        self._ops_forward, self._ops_backward = forward, backward
        self._ops_layers: set[int] = set()
        self._token = torch.zeros(1, device=self.device)
        self._owner_id = prefetch_ops.register(self)
        if self.scope_mode == "forward":
            self._handles.append(self.model.register_forward_pre_hook(self._on_model_start))
            self._handles.append(self.model.register_forward_hook(self._on_model_end))
        for layer in self.chain:
            # Every layer gets an input point (it also records the layer as part of the pass);
            # an output point only where backward prefetches are scheduled.
            self._handles.append(layer.module.register_forward_pre_hook(self._make_point_in(layer.index)))
            if backward.get(layer.index):
                self._handles.append(layer.module.register_forward_hook(self._make_point_out(layer.index)))

    def _make_point_in(self, index: int) -> Callable[..., Any]:
        from l2lightning.prefetch.ops import point_in

        def pre_hook(module: nn.Module, args: tuple) -> Any:
            if not args or not isinstance(args[0], torch.Tensor):
                return None
            return (point_in(args[0], self._token, self._owner_id, index), *args[1:])

        return pre_hook

    def _make_point_out(self, index: int) -> Callable[..., Any]:
        from l2lightning.prefetch.ops import point_out

        def post_hook(module: nn.Module, args: tuple, output: Any) -> Any:
            if not isinstance(output, torch.Tensor) or not output.requires_grad:
                return None
            return point_out(output, self._token, self._owner_id, index)

        return post_hook

    def _on_forward_point(self, index: int) -> None:
        """Run time of an input point (eager, compiled, or being captured)."""
        if not self._active or self._removed:
            return
        self._ops_layers.add(index)
        for target, plan in self._ops_forward.get(index, []):
            self.issuer.issue(self._aim(target), plan, "forward")

    def _on_backward_point(self, index: int) -> None:
        """Run time of an output point's backward: just before layer `index`'s backward."""
        if self._removed:
            return
        for target, plan in self._ops_backward.get(index, []):
            if target in self._ops_layers:
                self.issuer.issue(self._aim(target), plan, "backward")

    def join(self) -> None:
        """Rejoin the side stream on the current stream (with via='ops', call after backward)."""
        if self.issuer is not None and not self._removed:
            self.issuer.join("backward")

    # ---------------------------------------------------------------- public
    @property
    def enabled(self) -> bool:
        """True when hooks are installed (prefetch available and not removed)."""
        return bool(self._handles) and not self._removed

    def plan_summary(self) -> list[dict[str, Any]]:
        """One row per chain layer: name, MiB, forward and backward plan labels."""
        return [
            {
                "layer": layer.name,
                "mib": round(layer.nbytes / (1 << 20), 3),
                "forward": fp.label if fp else None,
                "backward": bp.label if bp else None,
            }
            for layer, fp, bp in zip(self.chain, self.forward_plans, self.backward_plans)
        ]

    def remove(self) -> None:
        """Remove every hook: the model is plain PyTorch again."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self._release_pass()
        self._removed = True
        if getattr(self, "_owner_id", None) is not None:
            from l2lightning.prefetch import ops as prefetch_ops

            prefetch_ops.unregister(self._owner_id)
        self._active = False

    def __enter__(self) -> PlanHooks:
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()
