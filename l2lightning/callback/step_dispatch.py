"""The optimizer step the callback wraps: run it eagerly, capture it or replay it.

A part :class:`l2lightning.callback.graph_callback.L2GraphCallback` holds (``_dispatch``), one per fit:
:meth:`StepDispatch.step` is what the capturable optimizer's handler, the GradScaler's step, an
accumulating micro-batch and a manual step call (through the callback), and it runs every step the
decision part chose: a replay, a sampled replay check, a warm-up step, the capture or an eager step.
The part declares in its own ``__init__`` what it alone writes (whether one of its steps is under way,
the replay closure the training start sets up); it reads the fit and the step through
:class:`l2lightning.callback.fit_state.FitState` (the stream its eager steps run on and whether the
captures bake operand numbers in are the fit's, there, as the capture reads them too), the per-graph
state through the graph slots, and reaches the rest of the callback only through what it is given: the
report, warm-up, prefetch, overrides, decision and capture parts, the callback's cost record and
replay check report, and bound methods of the callback (which a Trainer that spawns its processes
pickles with it).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from typing import Any

import torch

from l2lightning.callback.fit_report import CaptureCosts, FitReport
from l2lightning.callback.fit_state import FitState
from l2lightning.callback.prefetch_setup import PrefetchSetup
from l2lightning.callback.step_capture import StepCapture
from l2lightning.callback.step_decision import OPERAND_CHECK, StepDecision
from l2lightning.callback.step_overrides import StepOverrides, copied_element
from l2lightning.callback.warmup_steps import WarmupSteps
from l2lightning.graph.accumulation import MicroBatchStep
from l2lightning.graph.capture import clear_cublas_workspaces, loss_of
from l2lightning.graph.cuda_memory import free_cached_memory
from l2lightning.graph.graph_slots import GraphSlots
from l2lightning.graph.replay_closure import ReplayClosure, is_stock_closure, one_closure_count
from l2lightning.guards.replay_check import (
    PhaseClock,
    ReplayCheckReport,
    WrittenState,
    beyond_replay_spread,
    describe_difference,
    first_differing,
    named_written_state,
    step_tensors,
)


class StepDispatch:
    """The optimizer step the callback wraps: run it eagerly, capture it or replay it."""

    def __init__(
        self,
        fit: FitState,
        fit_report: FitReport,
        warmup: WarmupSteps,
        prefetch: PrefetchSetup,
        overrides: StepOverrides,
        decision: StepDecision,
        capture: StepCapture,
        slots: GraphSlots,
        *,
        costs: CaptureCosts,
        replay_check: ReplayCheckReport,
        disable: Callable[[str], None],
        warn_once: Callable[[str, str], None],
        events: Callable[[], tuple[Any, Any]],
        device: Callable[[], torch.device],
        device_type: Callable[[], str],
    ) -> None:
        self._fit = fit
        self._fit_report = fit_report  # the replays' timing events and count
        self._warmup = warmup  # the warm-up's traced and timed steps
        self._prefetch = prefetch  # compile=True's first compiled step, the whole-step gate's turn
        # the module's methods (their bound methods are installed): handed the replayed graph, the check's output
        self._overrides = overrides
        self._decision = decision  # what each step does, asked first; why a check was chosen
        self._capture = capture  # the capture step, run where the decision chose it
        # the per-graph state of the graph serving the step (l2lightning.graph.graph_slots), read once per
        # method into a local: its graph, replay count, check schedule, re-capture cause
        self._slots = slots
        # The callback's objects, made per fit with the parts and never rebound: what capturing cost (this
        # part times the captures and compile=True's first step) and the sampled check's report (counts,
        # phases, mismatches)
        self._costs = costs
        self._replay_check = replay_check
        # The callback's, as bound methods: refuse the fit (the rest trains eagerly, saying why), warn once
        # per key, a timed step's CUDA events (a class's static method, which tests and benchmarks
        # replace), the fit's device and its type (read from the Trainer)
        self._disable = disable
        self._warn_once = warn_once
        self._events = events
        self._device = device
        self._device_type = device_type
        # whether one of this part's steps is under way: the overrides ask (a closure run outside
        # `optimizer.step` is none), and so do the callback's micro-batch handler, its CUDA generator
        # watch and the manual step
        self.in_step = False
        # what a replay's closure dispatches of Lightning's (l2lightning.graph.replay_closure), or None where
        # the closure runs as it is: set up by the callback at the training start, read at every replay
        self.replay_closure: ReplayClosure | None = None

    def step(self, run: Callable[..., Any], closure: Callable[[], Any] | None, kwargs: dict) -> Any:
        """Called by the capturable optimizer's ``step``: `run(closure)` is its eager step."""
        # what this step does (the decision part; Lightning's accumulation state is read off the closure,
        # l2lightning.graph.accumulation)
        mode = self._decision.decide(closure)
        if mode == "replay" and self._slots.state.graph.appends:
            mode = self._appends_redoable()
        self.in_step = True
        try:
            if mode == "replay":
                return self._replay_step(closure)
            if mode == "check":
                return self._checked_step(run, closure, kwargs)
            # torch.compile compiles at the first call of each compiled child: the step after set-up
            prefetch = self._prefetch
            compiling, prefetch.compile_pending = prefetch.compile_pending, False
            started = time.perf_counter()
            # A plain eager step (a fallback, a re-capture's wait) runs the closure as Lightning's
            # step does, so Lightning's own counting stands; the capture step runs it more than once
            trainer = self._fit.trainer
            counted = contextlib.nullcontext() if mode == "eager" else one_closure_count(trainer, closure)
            try:
                with self._on_step_stream(), counted:
                    return self._eager_modes(mode, run, closure, kwargs)
            finally:
                if compiling:
                    self._costs.seconds["compile_s"] += time.perf_counter() - started
        finally:
            self.in_step = False
            self._fit.pending = None
            self._fit.pending_tensors = []  # the batch's tensors: not kept past the step

    def _eager_modes(self, mode: str, run: Callable[..., Any], closure: Any, kwargs: dict) -> Any:
        """Every step that runs the step's own code: warm-up (traced or timed), the capture, eager."""
        if mode == "trace":
            return self._warmup.traced_step(run, closure, kwargs)
        if mode == "time":
            return self._warmup.timed_step(run, closure, kwargs)
        if mode == "capture":
            costs = self._costs
            started, tuned = time.perf_counter(), costs.seconds["tuning_s"]
            again = (
                self._slots.state.captures_here > 0
            )  # a capture after this graph's first: what a re-capture costs
            costs.once_s = 0.0
            try:
                return self._capture.capture(run, closure, kwargs)
            finally:  # the tuning inside it is counted apart
                elapsed = time.perf_counter() - started
                cost = elapsed - (costs.seconds["tuning_s"] - tuned)
                costs.seconds["capture_s"] += cost
                # What the re-capture wait weighs: what a capture after this one will cost, so not
                # what only the fit's first capture spends (its full garbage collection: 0.32 s of
                # the 0.35 s a first capture took on the H200 beside its tuning, where a re-capture
                # takes 0.03 s; benchmarks/results/h200/recapture_phases_before.json)
                costs.last_capture_s = cost - costs.once_s
                if again:
                    costs.seconds["recapture_s"] += elapsed  # its tuning included
                    costs.recaptures += 1
                    costs.last_recapture_s = elapsed
        self._fit.mode = "eager"
        return run(closure, **kwargs)

    @contextlib.contextmanager
    def _on_step_stream(self) -> Any:
        """Run an eager step (or the capture) on the capture's own stream.

        A step's autograd graph can outlive it: Lightning's result collection and torchmetrics keep a
        metric's batch value with its graph (``MeanMetric()(loss)``), users keep ``self.last_loss``. Such
        a graph keeps the parameters' AccumulateGrad nodes, bound to the stream of the step that made
        them, and a capture on another stream then fails ("AccumulateGrad node's stream does not
        match"; the lightning-hydra-template module on the H200). When every step the callback lets
        run eagerly runs on the capture stream, every such node is bound to it. The stream waits for
        the caller's work first and the caller waits for it after, so the order of work is unchanged.
        """
        if self._device_type() != "cuda" or not torch.cuda.is_available():
            yield
            return
        fit = self._fit
        if fit.step_stream is None:
            fit.step_stream = torch.cuda.Stream(self._device())
            # PyTorch's allocator caches freed blocks per stream: what the default stream left
            # cached (a sanity-check validation, an earlier fit) cannot serve this stream's
            # allocations. Give those blocks back once, before the first step on this stream. (A
            # precaution: on the H200 a fit with 4% more free memory than plain training needs still
            # ran out of memory in a warm-up step with it; tests/gpu/test_oom_gpu.py.)
            torch.cuda.empty_cache()
        stream = fit.step_stream
        caller = torch.cuda.current_stream()
        stream.wait_stream(caller)
        try:
            with torch.cuda.stream(stream):
                yield
        finally:
            caller.wait_stream(stream)

    def give_back_step_stream(self) -> None:
        """Free what the capture's stream holds once the rest of the fit trains plain on the caller's.

        The steps the callback ran on its stream left cuBLAS workspaces keyed to it (one per thread
        that ran a GEMM: the step's and autograd's, 32 MiB each on the H200) and freed blocks cached
        for it; plain steps on the caller's stream can use neither and allocate their own beside
        them. On the H200, with 4% more memory free than plain training needs, the first plain step
        after a capture that ran out of memory ran out itself (tests/gpu/test_oom_gpu.py); given
        back here, that fit's steps peak at plain's allocated bytes (benchmarks/memory_peak.py,
        scenario ``oom-steps-capture-fails``).
        """
        if self._fit.step_stream is None:
            return
        self._fit.step_stream = None
        clear_cublas_workspaces()
        free_cached_memory()

    def _launch_replay(self, graph: Any, timed: bool) -> tuple[Any, Any] | None:
        """This step's batch into the static buffers, the graph's inputs in place, one replay: its events
        (None where not `timed`)."""
        # StepDecision.decide flattened the batch and compared its signature with the graph's
        graph.static.copy_tensors(self._fit.pending_tensors)
        if graph.accumulated is not None:  # before bind_grads: the sum the earlier micro-batches left
            graph.accumulated.copy_in()
        graph.bind_grads()
        if graph.binding is not None:
            graph.binding.bring_home()
        for carried in graph.carried:  # the last step's recurrent state, into the memory the graph reads
            carried.copy_in()
        self._fit.optimizer.sync_tensors()
        events = self._events() if timed else None
        if events is not None:
            events[0].record()
        graph.graph.replay()
        if events is not None:
            events[1].record()
        return events

    def _appends_redoable(self) -> str:
        """What this step does instead of the replay StepDecision.decide chose: ``"replay"``, or
        ``"eager"`` where a list or deque the step appends to is gone (an epoch-end hook cleared the dict
        holding it, ``self.outputs.clear()`` on a ``defaultdict(list)``). What the step would append to
        then only its own code knows (the dict's factory, a ``setdefault``), so this one step runs it;
        the next replays append to what it made."""
        role = self._slots.state  # this step's graph's (l2lightning.graph.graph_slots)
        gone = [where.label for where, _ in role.graph.appends if where.current() is None]
        if not gone:
            return "replay"
        role.replays_since_capture -= 1  # StepDecision.decide counted this step as a replay
        self._prefetch.gate_turn = None  # the gate's turn goes to the next replay
        self._decision.fall_back(
            f"the step appends to {', '.join(gone)}, gone since the last step (an entry cleared from its dict, "
            "an attribute bound to no list or deque), which only its own code makes again"
        )
        return "eager"

    def _replay_step(self, closure: Any) -> Any:
        role = self._slots.state  # this step's graph's (l2lightning.graph.graph_slots)
        graph = role.graph
        timing = self._fit_report.timing
        prefetch = self._prefetch  # the whole-step gate's turn, while its trial runs
        events = self._launch_replay(graph, prefetch.gate_turn is not None or timing.times_replay())
        for where, element in graph.appends:  # what the step's Python appended, as in an eager step
            current = where.current()  # not None: _appends_redoable ran this step eagerly otherwise
            if current is not None:
                current.append(copied_element(element))
        for carried in graph.carried:  # what the step's Python rebound, as in an eager step
            carried.fresh_out()
        if events is not None:
            timing.graph.append(events)
            if prefetch.gate_turn is not None:
                role.gate.record(prefetch.gate_turn, *events)
                prefetch.gate_turn = None
        timing.graph_count += 1
        if graph.binding is not None:
            graph.binding.after_replay()
        self._fit.mode = "replay"
        overrides = self._overrides  # the module's methods answer for this replay: its output, its logs
        overrides.replayed = graph
        overrides.reissued = set()
        if closure is None:
            return loss_of(graph.output, "training_step")
        if self.replay_closure is not None:
            if is_stock_closure(closure):
                return self.replay_closure(self._fit.trainer, closure)
            if isinstance(closure, MicroBatchStep):
                return self.replay_closure.micro_batch(self._fit.trainer, self._fit.module, closure.closure)
        return closure()

    # ------------------------------------------------------------------ the sampled replay check
    def _written_state(self, graph: Any) -> WrittenState:
        """What this graph's step writes that outlives it (see :mod:`l2lightning.guards.replay_check`)."""
        binding = graph.binding
        metric_states = (
            [(name, binding.metrics[name], attr) for name, attr in binding.homes]
            if binding is not None
            else []
        )
        written = named_written_state(
            self._fit.module,
            self._fit.optimizer.optimizer,
            metric_states,
            graph.tensors,
            graph.external_writes,
        )
        devices = [self._device().index or 0] if self._device_type() == "cuda" else []
        return WrittenState(written, devices)

    def _checked_step(self, run: Callable[..., Any], closure: Any, kwargs: dict) -> Any:
        """A replay compared bit for bit with the eager step from the same state; the eager step stands."""
        report, graph = self._replay_check, self._slots.state.graph
        clock = PhaseClock(self._device_type() == "cuda")  # from when the steps queued before it are done
        started = clock.started
        if graph.binding is not None:
            graph.binding.bring_home()  # the metrics' states on the home tensors the graph writes
        written = self._written_state(graph)
        try:
            saved = written.save()
        except torch.OutOfMemoryError:
            self._check_skipped_for_memory()
            if graph.appends and self._appends_redoable() == "eager":
                self._fit.mode = "eager"
                with self._on_step_stream():
                    return run(closure, **kwargs)
            return self._replay_step(closure)
        clock.lap("save")
        targets = written.current()  # the tensors the graph writes, whatever the eager step rebinds
        self._launch_replay(graph, timed=False)  # the check times its phases itself
        try:
            replayed: list | None = written.snapshot()
            replayed_out = {label: t.detach().clone() for label, t in step_tensors(graph.output)}
            replayed_carried = {c.label: [t.detach().clone() for t in c.outputs] for c in graph.carried}
        except torch.OutOfMemoryError:
            replayed = None  # the eager step below still stands; only the comparison is skipped
        replayed_grads = list(graph.grad_tensors)  # in the graph's pool: the eager step allocates its own
        saved.restore()
        if graph.accumulated is not None:
            # A closing micro-batch's eager step adds to the gradients the earlier micro-batches left:
            # the replay copied them into its static tensors first, and may have written over them since
            # (gradients zeroed in place between windows are the graph's own gradient tensors)
            graph.accumulated.put_back()
        clock.lap("replay")
        overrides = self._overrides  # its training_step keeps the eager step's output
        overrides.record_output, overrides.checked_output = True, None
        try:
            with self._on_step_stream(), one_closure_count(self._fit.trainer, closure):
                result = run(closure, **kwargs)  # the step as a plain step runs it: its result stands
        finally:
            overrides.record_output = False
            self._fit.mode = "eager"
        eager_out = dict(step_tensors(overrides.checked_output))
        overrides.checked_output = None
        clock.lap("eager")
        if replayed is None:
            self._check_skipped_for_memory()
            return result
        names = {id(p): name for name, p in self._fit.module.named_parameters()}
        pairs = [
            (label, replayed_out.get(label), eager_out.get(label)) for label in {**replayed_out, **eager_out}
        ]
        pairs += [
            (f"gradient of `{names.get(id(p), '?')}`", g, p.grad)
            for p, g in zip(graph.params, replayed_grads)
            if g is not None or p.grad is not None
        ]
        pairs += [(w.label, r, e) for w, r, e in zip(written.written, replayed, written.current())]
        for carried in graph.carried:
            now = carried.current() or []
            pairs += [
                (f"carried state {carried.label}[{i}]", r, now[i] if i < len(now) else None)
                for i, r in enumerate(replayed_carried[carried.label])
            ]
        try:
            differing = first_differing(pairs)
        except torch.OutOfMemoryError:
            self._check_skipped_for_memory()
            return result
        clock.lap("compare")
        report.checks += 1
        why = self._decision.check_why  # why the decision chose to check this replay
        report.reasons[why] = report.reasons.get(why, 0) + 1
        if differing is not None:
            self._replay_differed(
                pairs[differing], graph, written, saved, (targets, replayed), replayed_out, eager_out
            )
            clock.lap("judge")
        report.add_phases(clock.laps)
        spent = time.perf_counter() - started
        report.seconds += spent
        self._slots.state.check_schedule.last_cost_s = spent
        return result

    def _check_skipped_for_memory(self) -> None:
        free_cached_memory()
        self._replay_check.skipped_memory += 1
        self._warn_once(
            "check-memory",
            "a sampled replay check was skipped: the copies of what the step writes did not fit in the "
            "GPU's memory (counted in `summary()['replay_check']['skipped_memory']`)",
        )

    def _replayed_again(
        self,
        graph: Any,
        written: WrittenState,
        saved: Any,
        replayed: tuple[list, list],
        replayed_out: dict,
        eager_out: dict,
        eager_now: list,
        after_eager: Any,
    ) -> tuple[str | None, str | None]:
        """Replay once more from the checked step's state: (the first tensor in which the two replays
        differ, or None; what of the eager step lies beyond the two replays' spread, or None)."""
        saved.restore()
        graph.graph.replay()
        targets, values = replayed
        again = [(w.label, a, b) for w, a, b in zip(written.written, values, targets)]
        now_out = dict(step_tensors(graph.output))
        again += [(label, t, now_out.get(label)) for label, t in replayed_out.items()]
        first = first_differing(again)
        if first is None:
            return None, None
        unrepeatable = again[first][0]  # named only: its description's kernels are not worth their first use
        eager_copies = {id(live): copy for live, copy in after_eager.tensors}
        triples = [
            (w.label, r1, r2, eager_copies.get(id(e)) if e is not None else None)
            for w, r1, r2, e in zip(written.written, values, targets, eager_now)
        ]
        triples += [(label, t, now_out.get(label), eager_out.get(label)) for label, t in replayed_out.items()]
        return unrepeatable, beyond_replay_spread(triples)

    def _replay_differed(
        self,
        differing: tuple[str, Any, Any],
        graph: Any,
        written: WrittenState,
        saved: Any,
        replayed: tuple[list, list],
        replayed_out: dict,
        eager_out: dict,
    ) -> None:
        """A checked replay differed from its eager step (whose result stands): judge why, and act.

        `differing`: the first (label, replayed, eager) that differs; `replayed`: (the tensors the graph
        wrote, copies of what it wrote there); `eager_out`: the eager step's loss and returned tensors
        by label."""
        report = self._replay_check
        # Described only for a message that needs it (a mismatch): rounding, the common case, needs
        # none. A gradient is described now, as the second replay below writes over the graph's.
        in_pool = any(differing[1] is g for g in graph.grad_tensors)
        difference = describe_difference(differing) if in_pool else None
        # Replayed once more from the same state: a graph that differs from itself holds kernels
        # that are not deterministic, whose eager step is judged against the two replays' spread.
        eager_now = written.current()
        try:
            after_eager = written.save()
        except torch.OutOfMemoryError:
            free_cached_memory()
            after_eager = None
        unrepeatable = beyond = None
        if after_eager is None:
            difference = (
                f"{difference or describe_difference(differing)} (not judged against a second replay: its "
                "copies did not fit in the GPU's memory)"
            )
        else:
            try:
                unrepeatable, beyond = self._replayed_again(
                    graph, written, saved, replayed, replayed_out, eager_out, eager_now, after_eager
                )
            except torch.OutOfMemoryError:
                free_cached_memory()  # not judged: a mismatch, as a deterministic replay's would be
            finally:
                after_eager.restore()  # the eager step's result stands
        if unrepeatable is not None and beyond is None:
            report.within_spread += 1
            self._warn_once(
                "check-nondeterministic",
                f"two replays of the step from the same state differ ({unrepeatable}): its kernels are not "
                "deterministic, so the sampled replay check judges the eager step against the two replays' "
                "spread instead of bit for bit (counted in `summary()['replay_check']['within_spread']`). "
                "`Trainer(deterministic=True)` makes them deterministic where PyTorch can",
            )
            return
        difference = difference or describe_difference(differing)
        if beyond is not None:
            difference = f"{difference}; a second replay from the same state differs too, and {beyond} lies beyond the two replays' spread"
        report.mismatches += 1
        report.first_mismatch = report.first_mismatch or difference
        why = self._decision.check_why
        cause = (
            f"a sampled replay check ({why}, step {int(self._fit.trainer.global_step)}) found the replay "
            f"differing from the eager step from the same state: {difference}; something the step reads changed "
            "in a way the checks before each replay do not see"
        )
        if why == OPERAND_CHECK:
            # one of the first replays with a new operand value: the number reached the step some other
            # way too. Captured again with such numbers baked in, as without operand scalars
            self._fit.operands_off = True
            cause += "; the step is captured again with the Python numbers it reads baked in"
        if report.mismatches >= 2:
            self._disable(f"{cause}, for the second time")
            return
        self._warn_once(
            "check-mismatch",
            f"{cause}. The eager step's result was kept; the step is captured again at the next step.",
        )
        self._slots.state.recapture_next = (
            "a sampled replay check found the replay differing from the eager step"
        )
