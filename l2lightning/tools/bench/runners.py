"""Runners: one variant of one case, set up once and timed per repeat (the plain-loop and graph variants).

Timing: CUDA events recorded at each step boundary (start to start, so the loop's own CPU work is
included, as a user sees it). The Lightning variants are in
:mod:`l2lightning.tools.bench.lightning_runners`.

Graph lifetimes: every variant's graphs stay live through all repeats, in one process with eager
code, Lightning fits and compiled code interleaved, so nothing a graph reads or writes may be freed
before the runner's ``close()``. The library takes care of the two things that once were not held
(an ``illegal memory access`` on replay, found here): ``CapturedStep`` keeps its optimizer, whose
state the graph updates in place, and every capture goes through
:func:`l2lightning.graph.capture.graph_capture`, which gives each graph's GEMMs a cuBLAS workspace in the
graph's own pool instead of one that Lightning's teardown or inductor's cudagraph trees free.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from l2lightning.tools.bench.mlp import build_model, make_batches, regression_loss

if TYPE_CHECKING:
    from l2lightning.tools.bench.families import FamilyCase
    from l2lightning.tools.bench.mlp import BenchCase
    from l2lightning.tools.bench.settings import BenchSettings


def time_steps(step: Callable[[int], Any], steps: int, warmup: int) -> list[float]:
    """Run `warmup` untimed then `steps` timed calls of ``step(i)``; per-step µs, start to start."""
    import torch

    for i in range(warmup):
        step(i)
    torch.cuda.synchronize()
    events = [torch.cuda.Event(enable_timing=True) for _ in range(steps + 1)]
    events[0].record()
    for i in range(steps):
        step(warmup + i)
        events[i + 1].record()
    events[-1].synchronize()
    return [events[i].elapsed_time(events[i + 1]) * 1e3 for i in range(steps)]


class Runner:
    """One variant of one case: ``setup()`` once, ``run(steps)`` per repeat, ``close()``."""

    def __init__(
        self, variant: str, case: BenchCase | FamilyCase, settings: BenchSettings, shared: dict[str, Any]
    ) -> None:
        import torch

        self.variant = variant
        self.case = case
        self.settings = settings
        self.shared = shared  # per-case: tuned plans handed from the prefetch variant to its decoy
        self.device = torch.device("cuda", settings.device)
        self.dtype = getattr(torch, case.dtype)
        self.info: dict[str, Any] = {}
        self.step: Callable[[int], Any] | None = None
        self.batches: list[tuple[Any, Any]] = []
        self._keep: list[Any] = []

    def setup(self) -> None:
        raise NotImplementedError

    def built_step(self) -> Callable[[int], Any]:
        """The step ``setup()`` built; a RuntimeError before it (or after ``close()``)."""
        if self.step is None:
            raise RuntimeError(
                f"the {self.variant} runner of {self.case.label} has no step: call setup() first"
            )
        return self.step

    def run(self, steps: int) -> list[float]:
        return time_steps(self.built_step(), steps, self.settings.warmup)

    def close(self) -> None:
        import torch

        if self._keep and torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.synchronize()  # no replay may still run on memory about to be freed
        for obj in self._keep:
            remove = getattr(obj, "remove", None)
            if callable(remove):
                remove()
        self._keep.clear()
        self.step = None
        self.batches = []


def _optimizer(model: Any, lr: float, capturable: bool, impl: str) -> Any:
    import torch

    from l2lightning import make_capturable

    opt = torch.optim.AdamW(model.parameters(), lr=lr, **{impl: True})
    if capturable:
        return make_capturable(opt).optimizer
    return opt


def _install_prefetch(runner: Runner, model: Any, decoy: bool) -> Any:
    """PrefetchHooks on `model` (autotuned or default plans; the decoy reuses the tuned plans)."""
    from l2lightning import PrefetchHooks

    case, settings = runner.case, runner.settings
    backward = case.chain != "forward"
    example = runner.batches[0][0]
    tuned = runner.shared.get("plans")
    plans: Any
    backward_plans: Any
    if decoy and tuned is not None:
        plans, backward_plans = tuned
        source = "plans of the prefetch variant, aimed at the wrong layer"
    elif tuned is not None and runner.variant == "compile_graph_prefetch":
        # Same layer shapes as graph_prefetch: reuse its plans rather than tune a compiled function,
        # which the tuner's throwaway graphs could make recompile inside a capture.
        plans, backward_plans = tuned
        source = "plans tuned for graph_prefetch (same layer shapes)"
    elif settings.prefetch == "auto":
        plans, backward_plans, source = "auto", None, "autotuned"
    else:
        plans, backward_plans, source = None, None, "default (sized by layer bytes)"
    try:
        hooks = PrefetchHooks(
            model, example, backward=backward, plans=plans, backward_plans=backward_plans, decoy=decoy
        )
    except Exception as exc:
        if plans != "auto":
            raise
        # The autotuner failing is a result worth keeping, not a reason to drop the variant.
        source = f"default (autotune failed: {type(exc).__name__}: {exc})"
        hooks = PrefetchHooks(model, example, backward=backward, decoy=decoy)
    if not decoy:
        runner.shared["plans"] = (
            {layer.name: plan for layer, plan in zip(hooks.chain, hooks.forward_plans)},
            {layer.name: plan for layer, plan in zip(hooks.chain, hooks.backward_plans)},
        )
    runner.info.update(
        prefetch_active=hooks.enabled,
        plans_source=source,
        plans=hooks.plan_summary(),
        decoy=decoy,
    )
    runner._keep.append(hooks)
    return hooks


class PlainRunner(Runner):
    """eager / graph / graph_prefetch / graph_decoy / compile_graph(_prefetch) / compile_ro."""

    def setup(self) -> None:
        import torch

        self._build()
        step = self.built_step()
        # Untimed steps: cuBLAS/allocator warm-up; reduce-overhead records its CUDA graphs here.
        for i in range(5 if self.variant == "compile_ro" else 2):
            step(i)
        torch.cuda.synchronize()

    def _build(self) -> None:
        import torch

        from l2lightning import capture_step

        case, s, v = self.case, self.settings, self.variant
        compiled = v.startswith("compile_graph")
        model = build_model(case.width, case.depth, self.device, self.dtype, compiled_blocks=compiled)
        self._keep.append(model)
        self.batches = make_batches(case.width, case.batch, self.device, self.dtype)
        batches = self.batches
        if compiled:
            # Compile now (forward with and without grad, backward), not inside the autotuner's
            # measurements or a graph capture, where compiling cannot run.
            with torch.no_grad():
                model(batches[0][0])
            regression_loss(model, batches[0]).backward()
            model.zero_grad(set_to_none=True)
            torch.cuda.synchronize()
        if v in ("graph_prefetch", "compile_graph_prefetch"):
            _install_prefetch(self, model, decoy=False)
        elif v == "graph_decoy":
            _install_prefetch(self, model, decoy=True)
        graph = v.startswith("graph") or compiled

        if case.chain == "forward":
            if not graph:

                def step(i: int) -> Any:
                    with torch.no_grad():
                        return model(batches[i % len(batches)][0])
            else:
                step = _capture_forward(model, batches)
            self.step = step
            return

        with_optimizer = case.chain == "step"
        if v == "compile_ro":
            cmodel = torch.compile(model, mode="reduce-overhead")
            opt = _optimizer(model, s.lr, capturable=False, impl=s.optimizer)

            def step(i: int) -> Any:
                torch.compiler.cudagraph_mark_step_begin()
                opt.zero_grad(set_to_none=True)
                loss = regression_loss(cmodel, batches[i % len(batches)])
                loss.backward()
                opt.step()
                return loss

            self.step = step
            return
        if not graph:
            opt = _optimizer(model, s.lr, capturable=False, impl=s.optimizer) if with_optimizer else None

            def step(i: int) -> Any:
                if opt is not None:
                    opt.zero_grad(set_to_none=True)
                else:
                    model.zero_grad(set_to_none=True)
                loss = regression_loss(model, batches[i % len(batches)])
                loss.backward()
                if opt is not None:
                    opt.step()
                return loss

            self.step = step
            return
        opt = _optimizer(model, s.lr, capturable=True, impl=s.optimizer) if with_optimizer else None
        # CapturedStep holds the optimizer: the graph updates its state tensors in place.
        captured = capture_step(lambda b: regression_loss(model, b), batches[0], model, opt)
        self._keep.append(captured)
        self.step = lambda i: captured(batches[i % len(batches)])


def _capture_forward(model: Any, batches: list[tuple[Any, Any]]) -> Callable[[int], Any]:
    """A CUDA graph of ``model(x)`` under no_grad; the step copies each x into the static input."""
    import torch

    from l2lightning.graph.capture import graph_capture

    static_x = batches[0][0].clone()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side), torch.no_grad():
        for _ in range(3):
            model(static_x)
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with graph_capture(graph), torch.no_grad():
        out = model(static_x)

    def step(i: int) -> Any:
        static_x.copy_(batches[i % len(batches)][0], non_blocking=True)
        graph.replay()
        return out

    step.graph = graph  # type: ignore[attr-defined]  # keep the graph alive with the closure
    return step
