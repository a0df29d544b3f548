"""The capture step: record the closure and the optimizer update in one graph, or undo everything.

A part :class:`l2lightning.callback.graph_callback.L2GraphCallback` holds (``_capture``), one per fit:
:meth:`StepCapture.capture` is what the dispatch part runs at a step the decision chose to capture.
The part declares in its own ``__init__`` what it alone writes (the fit's captures and those whose
graph steps the optimizer, whether any step was captured and the accumulation roles with a graph, the
pools alive, the operand sites the last capture read from device scalars, the ``verify="capture"``
report, whether that check is off for the fit); the callback's public ``captures`` and
``verify_report`` are read-only views of it. It reads the fit through
:class:`l2lightning.callback.fit_state.FitState` (the step the optimizer turned capturable from, which
the callback's training start and release set too, the stream the capture runs on, whether operand
numbers are baked in), the per-graph state through the graph slots, and reaches the rest of the
callback only through what it is given: the report, warm-up, prefetch, overrides and decision parts,
the callback's settings and cost record, and bound methods of the callback (which a Trainer that
spawns its processes pickles with it), among them the one that sets the callback's ``capture_step``,
which its state_dict saves beyond the fit.
"""

from __future__ import annotations

import copy
import gc
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from operator import attrgetter, is_not
from typing import Any

import torch
from lightning.pytorch.utilities import rank_zero_info

from l2lightning.callback.fit_report import CaptureCosts, FitReport
from l2lightning.callback.fit_state import FitState
from l2lightning.callback.prefetch_setup import PrefetchSetup
from l2lightning.callback.step_decision import StepDecision
from l2lightning.callback.step_overrides import StepOverrides, copied_element
from l2lightning.callback.warmup_steps import WarmupSteps
from l2lightning.graph.accumulation import AccumulatedGrads
from l2lightning.graph.capture import (
    StaticBatch,
    TrainingState,
    clear_cublas_workspaces,
    graph_capture,
    loss_of,
)
from l2lightning.graph.carried_state import Carried, split_carried
from l2lightning.graph.cuda_memory import free_cached_memory, memory_state
from l2lightning.graph.graph_slots import GraphSlots
from l2lightning.graph.operand_scalars import OperandScalars, substituting
from l2lightning.graph.prefetch_switch import new_cuda_graph
from l2lightning.graph.scheduler_steps import ReissuedSchedulerStep
from l2lightning.guards import check_kernels, numerics_settings, python_state
from l2lightning.guards.called_code import StepHooks, analyse_called_code
from l2lightning.guards.log_replay import ReissuedLog
from l2lightning.guards.metric_binding import (
    MetricBinding,
    drop_autograd_graphs,
    named_metrics,
)
from l2lightning.guards.step_trace import (
    CaptureRefused,
    HostConstants,
    HostRead,
    StepTracer,
    describe_frame,
    first_line,
    user_frame_of_traceback,
)
from l2lightning.guards.step_values import Same, addresses

# PyTorch's warning when a gradient reaches a parameter through an AccumulateGrad node made in an
# earlier step (kept alive by a tensor that still holds that step's autograd graph)
STALE_GRAPH_WARNING = "AccumulateGrad node's stream does not match"
STALE_GRAPH_HINT = (
    "a tensor kept from an earlier step still holds that step's autograd graph (for example a loss "
    "stored on the module, `self.last_loss = loss`), and its parameters' gradient accumulators are bound "
    "to the stream that step ran on; keep `loss.detach()` instead"
)


_grad_of = attrgetter("grad")  # per parameter per replay: mapped in C, not a Python loop


@dataclass
class _Graph:
    """One captured step and what its replays need."""

    graph: Any
    static: StaticBatch
    key: tuple
    output: Any = None
    # the parameters and the gradient tensors the graph writes for them (rebound before a replay if an
    # eager step replaced them), as two parallel tuples: the check before every replay maps them in C
    params: tuple = ()
    grad_tensors: tuple = ()
    # the step's self.log calls, and (manual optimization) its LR schedulers' steps, in their order
    log_calls: list[ReissuedLog | ReissuedSchedulerStep] = field(default_factory=list)
    binding: MetricBinding | None = None
    constants: HostConstants | None = None
    flags: tuple = ()
    # lists the step appends to, with the element the capture appended (graph tensors: copied per replay)
    appends: list[tuple[python_state.Append, Any]] = field(default_factory=list)
    # attributes the step reads and rebinds to its own results (a recurrent hidden state), replayed
    carried: list[Carried] = field(default_factory=list)
    # tensors from before the capture that its ops write in place, with the user's line (the step tracer's)
    external_writes: list[tuple[torch.Tensor, str]] = field(default_factory=list)
    # Python numbers the capture may have baked in (python_state.baked_scalars), checked before each replay
    scalars: list[tuple[dict, str, Any]] = field(default_factory=list)
    # small containers of numbers it reads from module globals (python_state.baked_globals), the same
    containers: list[tuple[dict, str, Any]] = field(default_factory=list)
    # tensors it reads from plain attributes (python_state.baked_tensors), checked before each replay
    tensors: list[tuple[dict, str, torch.Tensor]] = field(default_factory=list)
    # their memory at the capture (python_state.addresses): `t.data = ...` keeps the object, not the memory
    tensor_addresses: tuple = ()
    # the functions and submodules it calls through attributes (python_state.baked_callables), likewise
    callables: list[tuple[dict, str, Any]] = field(default_factory=list)
    # the arguments the functools.partial among them bind (python_state.partial_bindings), likewise
    partials: list[tuple[dict, str, Any]] = field(default_factory=list)
    # its parameters and buffers (ModuleFlags.tensors), compared after any registration (generation);
    # the graph reads and writes their data at these addresses, compared before each replay
    registered: list[tuple[str, torch.Tensor]] = field(default_factory=list)
    registered_tensors: tuple = ()
    data_ptrs: tuple = ()
    generation: int = 0
    # the numbers the step computes from the step counters (StepSource.counter_values) at capture
    counters: tuple = ()
    # the values the step reads through self that are Python numbers (StepSource.attribute_values)
    attributes: list = field(default_factory=list)
    # the hooks the graph ran (on the module, its layers, its parameters, nn.Module's global ones)
    hooks: StepHooks | None = None
    # the host tensors its device ops read at the capture (step_trace.HostRead), compared before each replay
    host_reads: list[HostRead] = field(default_factory=list)
    # the process-wide settings that chose its kernels (numerics_settings.read), likewise
    numerics: tuple = ()
    # a closing micro-batch's: the static copies of the accumulated gradients it adds to (l2lightning.graph.accumulation)
    accumulated: AccumulatedGrads | None = None
    # the device scalars its ops read Python numbers from (l2lightning.graph.operand_scalars), written before
    # each replay; the values they stand for are left out of the comparisons above
    operands: OperandScalars | None = None
    # indices into StepSource.counter_values of the numbers the operand scalars stand for
    counters_served: frozenset = frozenset()
    # the memory its capture reserved (MiB; None off CUDA): what its pool holds while it lives
    pool_mib: float | None = None

    def bind_grads(self) -> None:
        """Point every parameter's ``.grad`` at the tensor this graph writes for it (an eager step, the
        user or the gate's other graph may have replaced it). Per replay: the check is mapped in C."""
        if any(map(is_not, map(_grad_of, self.params), self.grad_tensors)):
            for param, grad in zip(self.params, self.grad_tensors):
                if param.grad is not grad:
                    param.grad = grad


class StepCapture:
    """The capture step: record the closure and the optimizer update in one graph, or undo everything."""

    def __init__(
        self,
        fit: FitState,
        fit_report: FitReport,
        warmup: WarmupSteps,
        prefetch: PrefetchSetup,
        overrides: StepOverrides,
        decision: StepDecision,
        slots: GraphSlots,
        *,
        costs: CaptureCosts,
        prefetch_setting: Any,
        compile: bool,
        verify: str | bool,
        report: bool,
        operand_scalars: bool,
        check_on: bool,
        disable: Callable[[str], None],
        warn_once: Callable[[str, str], None],
        device: Callable[[], torch.device],
        device_type: Callable[[], str],
        source_refusal: Callable[[], str | None],
        installed: Callable[[], dict[str, Any]],
        plans: Callable[[], list[dict[str, Any]]],
        set_capture_step: Callable[[int], None],
    ) -> None:
        self._fit = fit
        self._fit_report = fit_report  # the capture's phase marks, the step report
        # the warm-up part: its traced steps (host constants, memo, metrics), the holders of Python state
        # the capture snapshots, the traced run of the step, hidden random state
        self._warmup = warmup
        # the prefetch part: its set-up at the first capture, the scope, the whole-step gate's trial
        self._prefetch = prefetch
        # the module's methods: handed the graph being captured, what the step returned and logged
        self._overrides = overrides
        self._decision = decision  # the module flags it compares before each replay, recorded at capture
        # the per-graph state of the graph serving the step (l2lightning.graph.graph_slots), read once per
        # method into a local: its graph (replaced here), gate trial, memo, capture counts
        self._slots = slots
        # what capturing cost (the callback's record, filled in place: the first capture's full collection
        # is what a later one does not repeat)
        self._costs = costs
        # The callback's settings as this fit starts (each fit makes a new part): prefetch (whether the dry
        # run is on), compile=True, verify ("capture": the eager check at capture), report, operand_scalars,
        # and whether the sampled replay check is on
        self._prefetch_setting = prefetch_setting
        self._compile = compile
        self._verify = verify
        self._report = report
        self._operand_scalars_on = operand_scalars
        self._check_on = check_on
        # The callback's, as bound methods: refuse the fit (the rest trains eagerly, saying why), warn once
        # per key, the fit's device and its type; and what is the callback's and rebound during the fit,
        # so asked at a capture: why the step's source cannot be replayed (the code analysed anew), the
        # module methods set-up installed, the public plans (set by the prefetch part), and the setter of
        # the public `capture_step` (the callback's: its state_dict saves it for a later fit, a checkpoint
        # load and a manual step set it too)
        self._disable = disable
        self._warn_once = warn_once
        self._device = device
        self._device_type = device_type
        self._source_refusal = source_refusal
        self._installed = installed
        self._plans = plans
        self._set_capture_step = set_capture_step
        # the fit's captures, the gate's second one included (the callback's public `captures`), and those
        # whose graph steps the optimizer (not an accumulating micro-batch's; the callback's release of the
        # optimizer reads them)
        self.captures = 0
        self.stepping_captures = 0
        self.captured = False  # a step was captured in this fit (summary()['captured'])
        self.captured_roles: set[tuple[bool, bool]] = set()  # the accumulation roles with a graph (summary)
        # what the pools of the graphs alive together reserved at their captures, MiB (None off CUDA)
        self.pool_mib: float | None = None
        # the operand sites (their lines) the last capture read from device scalars (summary()['operand_scalars'];
        # the decision names them through the callback)
        self.operand_lines: list[str] = []
        # verify="capture": the captured step compared with its eager step (the callback's public `verify_report`)
        self.verify_report: Any = None
        # that check is off for the fit (the step draws cuDNN's hidden RNN dropout state: _no_work_beside_the_steps)
        self._verify_capture_off = False
        # the prefetch set-up of the capture step under way collected all generations before tuning
        # (l2lightning.callback.prefetch_setup): the capture in the same step need not walk them again
        self._collected_for_capture = False

    # ------------------------------------------------------------------ verify (verify=True)
    def _verify_eager(
        self, run: Callable[..., Any], closure: Any, kwargs: dict, binding: MetricBinding | None
    ) -> Any:
        """The capture step run eagerly from the same state, recorded, then undone."""
        from l2lightning.verify import StepRecord, gradients, parameters

        module = self._fit.module
        saved = TrainingState.save(
            module, self._fit.optimizer.optimizer, binding.state_tensors() if binding else ()
        )
        saved_metrics = binding.python_state() if binding else {}
        self._fit.mode = "verify"
        overrides = self._overrides  # its training_step keeps the verify step's output
        overrides.step_output = None
        try:
            # On the capture's stream (the caller's _on_step_stream): Lightning's closure keeps this
            # step's loss, and with it each parameter's AccumulateGrad node, alive into the capture;
            # a node bound to another stream aborts the capture (seen on the H200 when verify=True
            # ran as the first capture of a process).
            run(closure, **kwargs)
            if overrides.step_output is None:
                return None  # training_step returned None: the capture defers, nothing to compare
            loss = loss_of(overrides.step_output, "training_step")
            record = StepRecord(None, loss.detach().clone(), gradients(module), parameters(module))
            overrides.step_output = None
        finally:
            self._fit.mode = "eager"
        torch.cuda.synchronize()
        saved.restore(self._fit.optimizer.optimizer)
        if binding is not None:
            binding.rebind()
            binding.restore_python_state(saved_metrics)
        module.zero_grad(set_to_none=True)
        return record

    def _finish_verify(self, eager_record: Any) -> None:
        from l2lightning.verify import EquivalenceError, StepRecord, compare_steps, gradients, parameters

        if eager_record is None:
            return
        module = self._fit.module
        loss = loss_of(self._slots.state.graph.output, "training_step")
        graph_record = StepRecord(None, loss.detach().clone(), gradients(module), parameters(module))
        report = compare_steps(graph_record, eager_record, "captured step vs eager step")
        self.verify_report = report
        rank_zero_info(f"L2GraphCallback verify: {report}")
        for logger in module.trainer.loggers:
            logger.log_metrics({"l2/verify_ok": float(report.ok)}, step=int(self._fit.trainer.global_step))
        if not report.ok:
            raise EquivalenceError(report)

    def operand_scalars(self, gate_capture: bool, batch_idx: int) -> OperandScalars | None:
        """The device scalars this capture hands the step's operand sites (l2lightning.graph.operand_scalars):
        the gate's second capture shares its first's, which the replays of both read."""
        gate = self._slots.state.gate
        if gate_capture and gate is not None:
            return gate.graphs["prefetch"].operands
        sites = self._fit.source.operand_sites if self._fit.source is not None else []
        if (
            not self._operand_scalars_on
            # the sampled check judges the first replays with new values: a use of the number that
            # no analysis saw would otherwise go unseen (the number would not be compared any more)
            or not self._check_on
            or self._fit.operands_off
            or not sites
            # a TorchFunctionMode around compiled code makes dynamo compile it again, inside the capture
            or self._compile
            or self._warmup.compiled_submodules()
        ):
            return None
        return OperandScalars(sites, self._device(), self._fit.module, batch_idx)

    def _serve_operands(self, graph: _Graph, operands: OperandScalars | None) -> None:
        """Leave out of `graph`'s comparisons the values its operand scalars stand for: a number read
        only inside operand sites whose every op took its device scalar at this capture."""
        self.operand_lines = []
        if operands is None or not operands.live:
            return
        live = operands.live
        graph.operands = operands
        source = self._fit.source
        graph.counters_served = frozenset(
            i for i, c in enumerate(source.counter_values) if c.sites and c.sites <= live
        )
        graph.attributes = [(a, v) for a, v in graph.attributes if not (a.sites and a.sites <= live)]
        own = vars(self._fit.module)
        served = {
            name
            for name, sites in source.site_reads.items()
            if name not in source.other_reads and sites <= live
        }
        served_globals = {
            key
            for key, sites in source.site_globals.items()
            if key not in source.other_globals and sites <= live
        }
        graph.scalars = [
            (attributes, name, value)
            for attributes, name, value in graph.scalars
            if not (attributes is own and name in served) and (id(attributes), name) not in served_globals
        ]
        self.operand_lines = sorted(operands.sites[key].site.line for key in live)

    def capture(self, run: Callable[..., Any], closure: Any, kwargs: dict) -> Any:
        """Capture this step (the dispatch part's, on the fit's step stream), then replay it once: its
        update; where it cannot be captured, the step runs eagerly (and the fit, saying why, if it must)."""
        # set by StepDecision.decide; the prefetch scope reads it too
        gate_capture = self._prefetch.gate_capturing
        if self._slots.state.gate is not None and not gate_capture:
            self._prefetch.abandon_gate(
                "the step was captured again (see the warning) before the gate's trial finished"
            )
        try:
            result = self._capture_graph_step(run, closure, kwargs, gate_capture)
        finally:
            self._overrides.capture_graph = None
            self._overrides.capture_accumulated = None
            self._prefetch.gate_capturing = False
        return result

    def _capture_graph_step(
        self, run: Callable[..., Any], closure: Any, kwargs: dict, gate_capture: bool
    ) -> Any:
        """Capture the step (`gate_capture`: the gate's second capture, without prefetch), then replay it once."""
        role = self._slots.state  # this step's graph's (l2lightning.graph.graph_slots)
        # the check kernels compiling in the background load their module when done, which a CUDA graph
        # capture in progress (the prefetch tuner's or the step's, global capture mode) would not survive
        check_kernels.wait_prepared()
        self._collected_for_capture = False  # set by this step's prefetch set-up, if it collects
        module, wrapped = self._fit.module, self._fit.optimizer
        key = self._fit.pending_key
        group = self._warmup.groups.get(key)
        batch, batch_idx = self._fit.pending
        # The steps before ran the user's configuration, so that a fit refused before its capture is
        # plain Lightning bit for bit; from here on the optimizer is capturable. (Not for an accumulating
        # micro-batch's graph, which makes no optimizer step: its closing micro-batch's capture switches it.)
        closes = key[0][1].closes
        switching = closes and not wrapped.switched
        if switching:
            wrapped.switch_on()
        if switching and self._fit.capturable_from_step is None:
            self._fit.capturable_from_step = int(self._fit.trainer.global_step)
        operands = self.operand_scalars(gate_capture, batch_idx)
        torch.cuda.synchronize()
        if group is not None and group.traces:
            try:
                constants = HostConstants(group.traces[-1].constants, self._device())
            except ValueError as exc:
                self._disable(str(exc))
                return run(closure, **kwargs)
        elif role.graph is not None and role.graph.constants is not None:
            constants = role.graph.constants  # a re-capture: the same host constants, checked again
        else:
            constants = HostConstants([], self._device())
        constants.used = 0
        metrics = dict(named_metrics(module))
        bound = {name: metrics[name] for name in sorted(group.metrics if group else ()) if name in metrics}
        if role.graph is not None and role.graph.binding is not None:
            role.graph.binding.bring_home()
            bound.update(role.graph.binding.metrics)
        role.graph = None  # a re-capture replaces the graph; a failed one leaves none
        binding = MetricBinding(bound) if bound else None
        try:
            static = StaticBatch(batch, self._fit.batch_reads)
        except Exception as exc:  # a container type that cannot be rebuilt around other tensors
            self._disable(
                f"the batch ({type(batch).__name__}) cannot be rebuilt around the graph's static "
                f"buffers: {type(exc).__name__}: {first_line(exc)}"
            )
            return run(closure, **kwargs)
        # hooks registered since training started (by a callback whose on_train_start ran after this
        # one's): read before this capture bakes in what they read
        self._fit.hook_owners = analyse_called_code(module, self._fit.source)
        reason = self._source_refusal()
        if reason:
            self._disable(reason)
            return run(closure, **kwargs)
        holders = self._warmup.python_holders()
        device_type = self._device_type()
        # The chain discovery's dry run and the verify step run training_step's Python too: what they
        # do to Python state (an appended output, a drawn random number) is undone like their tensors.
        self._no_work_beside_the_steps()
        python_start = python_state.snapshot(holders, device_type=device_type)
        # an LR scheduler the step itself steps (refused below, but it stepped in the dry run, the
        # verify step and the capture attempt): its counters go back with the rest of the Python state
        schedulers = _scheduler_states(self._fit.trainer)
        # A closing micro-batch adds to the gradients the earlier ones left: copied before anything
        # below drops them; each eager run of the step from here starts from copies of them again
        accumulated = AccumulatedGrads(tuple(module.parameters())) if key[0][1].adds else None
        # the module's methods (the overrides part): handed what the step answers from at the capture
        overrides = self._overrides
        overrides.capture_accumulated = accumulated
        if self._prefetch.hooks is None and not self._compile:
            # The last eager step's gradients are spent (its optimizer step read them; this step's
            # closure zeroes them, and the capture below drops them anyway): dropped before the
            # tuner runs, they are not part of its peak (180 MiB of the defaults' extra on the
            # d1536x40 stack; benchmarks/memory_peak.py on the H200).
            wrapped.optimizer.zero_grad(set_to_none=True)
            module.zero_grad(set_to_none=True)
            self._collected_for_capture = self._prefetch.install(module, static)
        verifying = self._verify == "capture" and not self._verify_capture_off
        if verifying and accumulated is not None:
            accumulated.put_back()
        eager_record = self._verify_eager(run, closure, kwargs, binding) if verifying else None
        python_state.restore(python_start)
        _put_back_schedulers(schedulers)
        # What a failed capture must undo: the capture runs no kernel, so only host tensors and the RNG
        saved = TrainingState.save(
            module, wrapped.optimizer, binding.state_tensors() if binding else (), host_only=True
        )
        saved_metrics = binding.python_state() if binding else {}
        # validate_args is switched off for the capture below, by the callback, not by the step
        ours = frozenset((id(m), "validate_args") for m in bound.values())
        python_before = python_state.snapshot(holders, ours, device_type)
        # A graph the whole-step gate will time with its prefetch on and off keeps its node list, to
        # switch those kernel nodes (l2lightning.graph.prefetch_switch) instead of capturing the step twice
        keep = not gate_capture and self._prefetch.gate_may_start()
        graph = _Graph(new_cuda_graph(keep_graph=keep), static, key, binding=binding, constants=constants)
        overrides.capture_logs = []
        overrides.step_output = None
        memo = group.traces[-1].memo if group is not None and group.traces else role.memo
        role.memo = memo
        tracer = StepTracer(device_type, constants, memo, capture_stream=self._fit.step_stream)
        self._fit.mode = "capture"
        overrides.capture_graph = graph
        wrapped.sync_tensors()
        wrapped.freeze(True)

        def captured() -> Any:
            # What the step's own code changes is read from here, inside the capture: what the
            # capture sets around the step is not the step's (the CPU graph emulator flags its
            # capture in a module-level list that tests' steps read). `python_before` stays what a
            # failed capture restores.
            python_started = python_state.snapshot(holders, ours, device_type)
            with substituting(operands):
                out = self._warmup.run_traced(tracer, closure)
            if overrides.step_output is None:
                raise _Defer()
            python_after = python_state.snapshot(holders, ours, device_type)
            # an entry a dict gained is refused here: its replays would append to it at every step
            appended, python_changed = python_state.split_appends(
                python_started, python_after, new_entries=False
            )
            carried, python_changed = split_carried(
                python_started, python_after, tracer.made, python_changed, tracer.read_from_before
            )
            python_changed += self._warmup.optimizer_writes()
            if python_changed and self._warmup.traced_steps >= 1:
                raise _PythonChangedInCapture(self._warmup.python_problem(python_changed, tracer.trace))
            graph.appends = [(a, a.current()[-1]) for a in appended]
            graph.carried = carried
            graph.external_writes = [
                (t, describe_frame(frame)) for t, frame in tracer.external_writes.values()
            ]
            graph.host_reads = tracer.host_reads
            return out

        drop_autograd_graphs(module)  # a metric's step value can hold the last step's autograd graph
        validating = [m for m in bound.values() if getattr(m, "validate_args", False)]
        for m in validating:
            m.validate_args = False  # input checks sync with the host; the warm-up steps ran them
        # torch.distributions checks its arguments by default (`Categorical(logits=...)` syncs on
        # `valid.all()`): the same, for the distributions the step makes without `validate_args=True`
        distributions_validate = torch.distributions.Distribution._validate_args
        torch.distributions.Distribution.set_default_validate_args(False)
        # Which submodules the step calls: their Python numbers (nn.Dropout.p) are baked into the graph.
        # Not with compile=True: a global hook would make dynamo recompile inside the capture.
        ran: set[int] | None = None if self._compile else set()
        hook = (
            torch.nn.modules.module.register_module_forward_pre_hook(lambda m, args: ran.add(id(m)))
            if ran is not None
            else None
        )
        optimizers = self._warmup.optimizer_holders()

        def run_whole(closure: Any, **kwargs: Any) -> Any:
            # the user's optimizer's own Python runs around the closure (`optimizer.step(closure)`)
            optimizer_before = python_state.snapshot(optimizers, generators=False)
            out = run(closure, **kwargs)
            after = python_state.snapshot(optimizers, generators=False)
            changed = python_state.changed(optimizer_before, after)
            if changed and self._warmup.traced_steps >= 1:
                raise _PythonChangedInCapture(self._warmup.python_problem(changed, tracer.trace))
            return out

        try:
            try:
                self._capture_into(graph, run_whole if optimizers else run, captured, kwargs)
            finally:
                if hook is not None:
                    hook.remove()
                wrapped.freeze(False)
                for m in validating:
                    m.validate_args = True
                torch.distributions.Distribution.set_default_validate_args(distributions_validate)
        except _Defer:
            self._undo_capture(saved, binding, saved_metrics)
            if accumulated is not None:
                accumulated.put_back()  # the eager step below adds to them
            python_state.restore(python_before)
            _put_back_schedulers(schedulers)
            self._fit.mode = "eager"
            if gate_capture:
                role.graph = role.gate.graphs["prefetch"]  # the gate captures at a later step
            elif switching:  # nothing captured yet: this step, too, runs the user's configuration
                wrapped.switch_off()
                if self._fit.capturable_from_step == int(self._fit.trainer.global_step):
                    self._fit.capturable_from_step = None
            return run(closure, **kwargs)  # training_step returned None: nothing to capture this step
        except Exception as exc:  # a host sync or an op that cannot be captured
            self._undo_capture(saved, binding, saved_metrics)
            python_state.restore(python_before)  # the eager step below changes them once
            _put_back_schedulers(schedulers)
            # Only what the fallback needs is kept: the exception's frames hold the partial
            # capture's tensors (in the graph's pool) until it is gone, and the eager step below
            # must not run next to them (with little memory to spare it would run out itself).
            failed = (
                first_line(exc)
                if gate_capture or isinstance(exc, torch.OutOfMemoryError)
                else self._capture_failure_reason(exc)
            )
            out_of_memory = isinstance(exc, torch.OutOfMemoryError)
            # A step captured again after a change (a curriculum's longer sequences) may build
            # something once in that first step at the new shapes, as a first warm-up step may (a
            # rotary cache grown and its buffers registered anew): warm up again, once per capture,
            # rather than train the rest of the fit eagerly
            warm_up_again = (
                isinstance(exc, _PythonChangedInCapture)
                and role.captures_here > 0
                and not gate_capture
                and not role.warmed_up_again
            )
        else:
            failed = None
        if failed is not None:
            graph = overrides.capture_graph = None  # the partial graph's pool goes with it
            if accumulated is not None:
                accumulated.put_back()  # the eager step below adds to them
            if gate_capture:
                # the step with prefetch was captured; only the comparison failed: keep that graph
                role.graph = self._prefetch.keep_prefetch_graph(
                    f"the step without prefetch could not be captured: {failed}"
                )
                free_cached_memory()
            elif out_of_memory:
                free_cached_memory()
                self._disable(f"the step could not be captured: out of memory ({memory_state()}; {failed})")
            elif warm_up_again:
                # no graph now: the steps from the next one are warm-up steps again, traced, then captured
                role.warmed_up_again = True
                self._warn_once(
                    "warm-up-again",
                    f"{failed}; this step runs eagerly and the next ones warm up again (a step at new shapes may "
                    "build something once, a cache grown); a second such change ends the capture",
                )
            else:
                self._disable(failed)
            return run(closure, **kwargs)
        graph.output = overrides.step_output
        graph.accumulated = accumulated
        graph.log_calls = overrides.capture_logs
        graph.params = tuple(module.parameters())
        graph.grad_tensors = tuple(p.grad for p in graph.params)
        decision = self._decision  # the module flags it compares before each replay, read through it
        graph.flags = decision.module_flags()
        graph.scalars = python_state.baked_scalars(module, self._fit.source.reads, ran)
        graph.tensors = python_state.baked_tensors(module, self._fit.source.reads, ran)
        graph.callables = python_state.baked_callables(module, self._fit.source.reads, ran, self._installed())
        graph.counters = self._fit.source.counter_snapshot(module, batch_idx)
        carried = {id(t) for c in graph.carried for t in c.outputs}
        graph.attributes = [  # a carried attribute is rebound by design: handed to each replay instead
            (a, v)
            for a, v in self._fit.source.attribute_snapshot(module, batch_idx)
            if not _holds(v, carried)
        ]
        scalars, tensors = python_state.baked_callback_attributes(self._fit.source.callback_reads)
        graph.scalars += scalars
        graph.tensors += tensors
        # the Python numbers and tensors the user's optimizer's step reads from its own attributes
        # (`p.mul_(self.shrink)`), baked into the graph like the module's
        scalars, tensors = python_state.baked_optimizer_attributes(optimizers)
        graph.scalars += scalars
        graph.tensors += tensors
        baked = python_state.baked_globals(self._fit.source.global_reads.values())
        graph.scalars += baked.scalars
        graph.tensors += baked.tensors
        # a module-level list the step appends to is the step's Python state, re-appended after each
        # replay (graph.appends), not a container whose entries the graph baked in
        appended = {(id(vars(a.owner)), a.name) for a, _ in graph.appends if hasattr(a.owner, "__dict__")}
        graph.containers = [c for c in baked.containers if (id(c[0]), c[1]) not in appended]
        graph.callables += baked.callables
        graph.partials = python_state.partial_bindings(graph.callables)
        # the Trainer's clipping settings, which Lightning passes to `configure_gradient_clipping` as
        # numbers (a callback that changes `trainer.gradient_clip_val` mid-fit)
        trainer_attributes = vars(self._fit.trainer)
        graph.scalars += [
            (trainer_attributes, name, trainer_attributes.get(name))
            for name in ("gradient_clip_val", "gradient_clip_algorithm")
            if name in trainer_attributes
        ]
        # an attribute reached two ways (a loss object the module holds whose method the step calls):
        # compared once
        graph.scalars = python_state.unique_checks(graph.scalars)
        self._serve_operands(graph, operands)
        graph.tensors = [  # a carried attribute is rebound by design: handed to each replay instead
            (owner, name, t)
            for owner, name, t in python_state.unique_checks(graph.tensors)
            if not any(owner is c.owner and name == c.name for c in graph.carried)
        ]
        graph.tensor_addresses = python_state.addresses(graph.tensors)
        graph.hooks = StepHooks.of(module)
        graph.numerics = numerics_settings.read()
        graph.registered = decision.flags.tensors()
        graph.registered_tensors = tuple(t for _, t in graph.registered)
        graph.data_ptrs = addresses(graph.registered_tensors)
        graph.generation = decision.flags.generation
        if binding is not None:
            binding.finish_capture()
        if closes:
            # what the graph's optimizer step bakes in and updates (an accumulating micro-batch's: nothing)
            wrapped.mark_captured()
            self.stepping_captures += 1
        role.graph = graph
        self.captures += 1
        role.captures_here += 1
        self.captured_roles.add(key[0][1].role)
        role.warmed_up_again = False  # a later capture may warm up again once itself
        capture_step = int(self._fit.trainer.global_step)
        if gate_capture:
            role.gate.graphs["off"] = graph
        else:
            self._set_capture_step(capture_step)
            role.check_schedule.captured()  # the sampled check counts this capture's replays from 1
            role.replays_since_capture = 0  # what the re-capture wait weighs against its cost
            self._prefetch.start_gate(graph)
        self.captured = True
        # the traces and their host copies are not needed any more: this role's (another accumulation
        # role's warm-up goes on)
        captured_role = key[0][1].role
        self._warmup.groups = {k: g for k, g in self._warmup.groups.items() if k[0][1].role != captured_role}
        # The capture recorded but did not run the step: this replay is the step's real update. Then
        # the closure again, in replay mode, so Lightning keeps fresh outputs and the logs are issued.
        graph.graph.replay()
        for where, element in graph.appends:  # the capture appended graph tensors: now they hold values
            current = where.current()
            if current:
                current[-1] = copied_element(element)
        for carried in graph.carried:
            carried.fresh_out()
        if binding is not None:
            binding.fresh_forward_caches()
        role.live_log_values, frozen_log = overrides.python_log_sources(graph.log_calls)
        self._fit.mode = "replay"
        overrides.replayed = graph
        overrides.reissued = set()
        result = closure() if closure is not None else None
        if self._verify == "capture":
            self._finish_verify(eager_record)
        if self._report and not gate_capture:
            tuning = self._prefetch.tuning_report
            self._fit_report.build_step_report(self._fit.module, self._device(), tuning)
            rank_zero_info(self._fit_report.text(capture_step, tuning, self._plans()))
        if self.captures == 1 and self._fit.source.conditions and not self._fit.source.opaque_conditions:
            rank_zero_info(
                "L2GraphCallback: steps whose branch (on the step counters or the module's attributes) differs "
                "from the captured step's "
                f"({[c.line for c in self._fit.source.conditions]}) run eagerly."
            )
        if frozen_log is not None:
            # this step's own log was right (the capture ran its Python); the next ones would not be
            self._disable(frozen_log)
        return result

    def _no_work_beside_the_steps(self) -> None:
        """Where the step draws from cuDNN's RNN dropout state (a buffer outside torch's generators,
        advanced by every call), eager work beside the fit's own steps that does not put that buffer
        back would move it on and change every later dropout mask. The sampled check saves and puts it
        back (the capture records it among the tensors the step writes); the prefetch's dry run of the
        forward and ``verify="capture"``'s eager step, both run before the capture has found the
        buffer, are off."""
        where = self._warmup.hidden_random
        if where is None:
            return
        turned_off = []
        if self._prefetch_setting != "off" and not self._prefetch.failed:
            self._prefetch.failed = True
            turned_off.append("the prefetch (whose set-up runs the step's forward once)")
        if self._verify == "capture":
            self._verify_capture_off = True
            turned_off.append(
                "the capture's eager check (`verify='sampled'` checks the first replay, with that state saved)"
            )
        if turned_off:
            self._warn_once(
                "hidden-random",
                f"the step draws dropout from cuDNN's RNN dropout state (at {where}), which lives outside "
                f"torch's generators and moves on at every call: {' and '.join(turned_off)} "
                f"{'is' if len(turned_off) == 1 else 'are'} off for this fit, so that it stays bitwise its "
                "eager reference",
            )

    def _collect_before_capture(self) -> None:
        """Give back what the eager steps left before the capture's pool is measured (on CUDA).

        The eager steps' cuBLAS workspaces are dropped here, before the pool's reading, rather than only
        at the capture's start (graph_capture drops them to give the graph its own, and
        torch.cuda.graph then empties the cache): released after the reading, they were subtracted
        from the pool's size, which read 64 MiB (the graph's two workspaces) short on the H200 whenever
        no tuning had released them first.
        """
        clear_cublas_workspaces()
        if self.captures == 0 and not self._collected_for_capture:
            # The fit's first capture collects all generations: a dead autograd graph in a reference
            # cycle (made before the fit, on another stream) keeps AccumulateGrad nodes bound to that
            # stream, which would break the capture.
            collecting = time.perf_counter()
            free_cached_memory()
            self._costs.once_s += time.perf_counter() - collecting
            return
        # The young generations only, where the full collection's work is done already. A full one
        # took 0.31-0.33 s of a 0.34-0.37 s re-capture on the H200, whose capture itself took 0.02 s
        # (benchmarks/results/h200/recapture_phases_before.json).
        # - The fit's first capture, when this step's prefetch set-up collected all generations
        #   before tuning: what ran since made no autograd graph on another stream (the chain
        #   discovery's dry run is under no_grad, the tuner times throwaway copies of the layers, the
        #   verify step runs on this capture's stream).
        # - A capture after the fit's first: every step since the fit's start ran on this capture's
        #   stream (_on_step_stream), so no AccumulateGrad node of a step's autograd graph is bound to
        #   another, and the graph this one replaces died by reference count when _capture_graph_step
        #   dropped it, its pool with it (tests/callback/test_recapture_cost_cpu.py), before the cache release.
        gc.collect(1)
        torch.cuda.empty_cache()

    def _capture_into(self, graph: _Graph, run: Callable[..., Any], closure: Any, kwargs: dict) -> None:
        module = self._fit.module
        # The capture allocates the gradients in the graph's pool. The eager step's gradients are
        # dropped first, so that the cache release below gives their memory back to the driver
        # before the pool asks for its own (otherwise the peak holds both), and so that the pool's
        # size below is measured from what the capture itself reserves.
        self._fit.optimizer.optimizer.zero_grad(set_to_none=True)
        module.zero_grad(set_to_none=True)
        reserved = 0
        if torch.cuda.is_available():
            self._collect_before_capture()
            reserved = torch.cuda.memory_reserved()
        caught: list = []
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                with graph_capture(graph.graph, stream=self._fit.step_stream):
                    self._fit_report.phase_events.mark("start")
                    run(closure, **kwargs)
                    if graph.binding is not None:
                        graph.binding.bring_home()
                    self._fit_report.phase_events.mark("end")
        except Exception as exc:
            if any(STALE_GRAPH_WARNING in str(w.message) for w in caught):
                exc.add_note(STALE_GRAPH_HINT)
            raise
        finally:
            for w in caught:  # the user's warning filters decide, as if nothing had recorded them
                warnings.warn_explicit(w.message, w.category, w.filename, w.lineno, source=w.source)
        if torch.cuda.is_available():
            graph.pool_mib = (torch.cuda.memory_reserved() - reserved) / (1 << 20)
            self.pool_mib = self._pools_alive_mib(graph)

    def keep_graph(self, graph: _Graph) -> None:
        """The whole-step gate's winner is the graph the steps replay from here; the pools alive are
        counted anew (the prefetch part's verdict, through the callback)."""
        self._slots.state.graph = graph
        self.pool_mib = self._pools_alive_mib(graph)

    def _pools_alive_mib(self, graph: _Graph) -> float | None:
        """The memory the pools of the graphs alive together reserved at their captures: `graph`'s, the
        whole-step gate's other graph while its trial runs, and under gradient accumulation the other
        roles' (l2lightning.graph.graph_slots); None where none was measured (off CUDA). The graph `graph`
        replaces is gone by then."""
        gate = self._slots.state.gate
        gate_graphs = gate.graphs.values() if gate is not None else ()
        alive = {id(g): g for g in (graph, *gate_graphs, *self._slots.parked_graphs()) if g is not None}
        sizes = [g.pool_mib for g in alive.values() if g.pool_mib is not None]
        return sum(sizes) if sizes else None

    def _undo_capture(self, saved: TrainingState, binding: MetricBinding | None, metrics: dict) -> None:
        """A capture that did not complete leaves nothing: state, RNG (CUDA generator too), metrics, grads."""
        module = self._fit.module
        saved.restore_rng()  # first: the CUDA generator may be unusable until it gets a fresh state
        saved.restore(self._fit.optimizer.optimizer if self._fit.optimizer is not None else None)
        if binding is not None:
            binding.rebind()  # attributes back on the home tensors restored above
            binding.restore_python_state(metrics)
        module.zero_grad(set_to_none=True)
        self._overrides.capture_logs = []
        self._overrides.step_output = None
        self._fit.mode = "eager"

    def _capture_failure_reason(self, exc: BaseException) -> str:
        if isinstance(exc, CaptureRefused):
            return f"the step could not be captured: {exc}"
        where = user_frame_of_traceback(exc.__traceback__)
        first = str(exc).splitlines()[0][:200] if str(exc) else ""
        located = f" at {describe_frame(where)}" if where else ""
        if STALE_GRAPH_HINT in getattr(exc, "__notes__", ()):
            return f"the step could not be captured ({type(exc).__name__}: {first}): {STALE_GRAPH_HINT}"
        return (
            f"the step could not be captured ({type(exc).__name__}: {first}){located}; if that line syncs with the "
            "host (`.item()`, `print(tensor)`, `if tensor:`), log the tensor with `self.log` or run such steps "
            "eagerly with `eager_steps`"
        )


def _scheduler_states(trainer: Any) -> list[tuple[Any, dict]]:
    """Each LR scheduler of the Trainer with a copy of its state (its counters and last LRs)."""
    configs = getattr(trainer, "lr_scheduler_configs", None) or []
    return [(c.scheduler, copy.deepcopy(c.scheduler.state_dict())) for c in configs]


def _put_back_schedulers(saved: list[tuple[Any, dict]]) -> None:
    for scheduler, state in saved:
        scheduler.load_state_dict(copy.deepcopy(state))


def _holds(frozen_value: Any, tensor_ids: set[int]) -> bool:
    """Whether a :func:`l2lightning.guards.step_values.frozen` value holds one of the tensors `tensor_ids`."""
    if isinstance(frozen_value, Same):
        return id(frozen_value.obj) in tensor_ids
    if isinstance(frozen_value, tuple):
        return any(_holds(v, tensor_ids) for v in frozen_value)
    return False


class _PythonChangedInCapture(CaptureRefused):
    """The captured step's own code changed Python state that a replay would not change."""


class _Defer(Exception):
    """training_step returned None at the capture step: capture at a later step."""
