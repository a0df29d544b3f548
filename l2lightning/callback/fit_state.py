"""What every part of the callback reads of the fit under way: the Trainer, the module, the step.

The callback's parts (the warm-up, the decision, the capture, the dispatch, the overrides, the
prefetch set-up, the report) all act on the same fit and the same step. They hold one
:class:`FitState` rather than reading each other's attributes, so what they share is named here
and nowhere else; what a part keeps for itself it declares in its own ``__init__``.
"""

from __future__ import annotations

from typing import Any

from l2lightning.guards.batch_reads import BatchReads
from l2lightning.guards.step_source import StepSource


class FitState:
    """The fit under way and the step in hand, shared by the callback's parts.

    Set at the fit's ``setup`` (Trainer, module, the module's hooks as they were, what their source
    reads and where it was read from, what the step reads of its batch), at the training start (the
    optimizer, the start's time, a resumed fit's capturable step), when the callback refuses the fit
    (why), when the optimizer turns capturable (from which step), at the first eager step (the
    stream the steps and captures run on), when a check rules out operand scalars, and at each step
    (the pending batch, its key and tensors, the mode the step runs in); a fresh one at every fit, so
    nothing of an earlier fit is reachable.
    """

    __slots__ = (
        "trainer",
        "module",
        "optimizer",
        "source",
        "code_bindings",
        "batch_reads",
        "originals",
        "hook_owners",
        "started_at",
        "disabled_reason",
        "capturable_from_step",
        "step_stream",
        "operands_off",
        "mode",
        "pending",
        "pending_key",
        "pending_tensors",
    )

    def __init__(self) -> None:
        self.trainer: Any = None
        self.module: Any = None
        # the optimizer whose steps the callback handles (a CapturableOptimizer, or several joined, which a
        # manual step steps as one); None before the training start and once the callback lets it go
        self.optimizer: Any = None
        self.source = StepSource()  # what the step's code reads (l2lightning.guards.step_source)
        # (attribute dict, name, held) of the methods whose source the step was read from
        # (StepSource.code_bindings, at set-up): the decision compares them before each step
        self.code_bindings: list[tuple[Any, str, Any, str]] = []
        # what training_step reads of its batch (l2lightning.guards.batch_reads; everything, until set up):
        # the decision reads the batch's tensors by it at each step, the capture and compile=True build
        # the static batch by it
        self.batch_reads = BatchReads()
        self.originals: dict[str, Any] = {}  # the module's methods the callback replaced, as they were
        # objects of the user's whose methods run as hooks inside the step (l2lightning.guards.called_code)
        self.hook_owners: list[Any] = []
        # perf_counter at the training start (None before): the sampled check's share of the fit's time,
        # which the decision reads before each replay
        self.started_at: float | None = None
        # why the callback refused the fit (the rest of it trains eagerly; the callback's public
        # `disabled_reason`), or None: the callback's hooks, the decision and the manual step read it
        self.disabled_reason: str | None = None
        # the global step from which the optimizer runs make_capturable's configuration (the callback's public
        # `capturable_from_step`, which its state_dict saves), or None: the capture sets it at the first
        # capture that switches the optimizer (and clears it when that capture defers), the callback's
        # training start where a resumed fit was capturable, and the optimizer's release where no
        # stepping capture completed
        self.capturable_from_step: int | None = None
        # the CUDA stream every step the callback runs eagerly runs on, and the capture too (made at the
        # fit's first such step by the dispatch, which runs the steps on it and gives it back once the
        # fit trains plain; the capture captures on it): None before, off CUDA and once given back
        self.step_stream: Any = None
        # a sampled check after an operand value's change found the replay differing: the rest of the
        # fit's captures bake the Python numbers the step reads in (the dispatch's check finds it, the
        # capture acts on it; a verdict on the fit, as `disabled_reason` is)
        self.operands_off = False
        # what the step under way runs as: "eager" (a timed warm-up step and a sampled check's eager step
        # too), "trace", "capture", "verify" or "replay"; the overridden module methods act on it
        self.mode = "eager"
        self.pending: tuple[Any, int] | None = None  # this step's (batch, batch_idx)
        self.pending_key: tuple = ()  # its batch signature and branch (the warm-up's groups)
        # its batch's tensors, flattened by the decision (read_batch), which a replay copies into the
        # graph's static batch; dropped at the step's end
        self.pending_tensors: list[Any] = []
