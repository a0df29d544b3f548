"""Reading step-counter branches and logged expressions from a module's training_step source."""

from __future__ import annotations

from types import SimpleNamespace

from l2lightning.guards.step_source import analyse


class Module:
    def __init__(self, step=0):
        self.global_step = step
        self.current_epoch = 0
        self.period = 10

    def training_step(self, batch, batch_idx):
        if self.global_step % self.period == 0:  # a target-network sync
            pass
        every = self.global_step // 2
        if every % 3 == 0:  # a local assigned once from a step counter: inlined
            pass
        helper = self.compute()
        if self.global_step > helper:  # reads a call's result: cannot be evaluated
            pass
        if batch_idx % 50 == 0:
            pass
        self.log("lr", self.lr_schedulers().get_last_lr()[0])
        self.log("twice", float(self.global_step) * 2)
        self.log("call", self.compute())
        return None

    def compute(self):
        return 1


def test_conditions_on_step_counters_are_found_and_evaluated_per_step():
    source = analyse(Module())
    assert len(source.conditions) == 4
    assert (
        len(source.opaque_conditions) == 1 and "if self.global_step > helper" in source.opaque_conditions[0]
    )
    assert "test_step_source.py:" in source.opaque_conditions[0]
    assert source.branch_key(Module(0), 0) == (True, True, True)
    assert source.branch_key(Module(10), 7) == (True, False, False)
    assert source.branch_key(Module(4), 50) == (False, False, True)


class _ReassignsItsLocals:
    """Locals assigned from themselves (``x = x.float()``: the one assignment the reader records) and
    from each other, read by branch tests: one cycle reaches a step counter, one does not."""

    def __init__(self, step=0):
        self.global_step = step

    def training_step(self, batch, batch_idx):
        x, y = batch
        x = x * 1.0
        if x.shape[0] > 1:  # a tensor's shape, through a local that reads itself: no counter
            pass
        a = b + self.global_step  # noqa: F821 - read before assignment: only the source is analysed
        b = a * 2
        if b > 5:  # a counter reached through two locals that read each other
            pass
        return None


def test_locals_that_read_themselves_or_each_other_are_followed_once():
    found = analyse(_ReassignsItsLocals())
    (condition,) = found.conditions
    assert "if b > 5:" in condition.line and condition.on_counters
    assert condition.evaluate is None  # a value without end cannot be computed before the step


def test_logged_python_expressions_are_recomputed_where_they_only_read():
    source = analyse(Module())
    assert set(source.log_values) == {"lr", "twice"}  # a call to one's own method is not evaluated
    module = Module(7)
    module.lr_schedulers = lambda: SimpleNamespace(get_last_lr=lambda: [0.25])
    assert source.log_value("lr", module, 0) == 0.25
    assert source.log_value("twice", module, 0) == 14.0


def test_library_hooks_and_missing_sources_give_nothing():
    from lightning.pytorch import LightningModule

    assert analyse(LightningModule(), ("on_before_backward",)).conditions == []
    assert analyse(SimpleNamespace(), ("training_step",)).conditions == []


def test_reads_are_the_attributes_the_step_computes_with_not_those_it_only_logs():
    from lightning.pytorch import LightningModule

    from l2lightning.guards.step_source import analyse

    class Module(LightningModule):
        beta = 0.5
        samples_seen = 0

        def training_step(self, batch, batch_idx):
            loss = self.helper(batch) * self.beta
            self.log("samples_seen", self.samples_seen)
            self.log_dict({"beta": self.beta})
            return loss

        def helper(self, batch):
            return batch.sum() * self.scale

    reads = analyse(Module()).reads
    assert {"beta", "helper", "scale"} <= reads
    assert "samples_seen" not in reads and "log" in reads


class _PeriodicCallback:
    """Stands in for a Lightning Callback: a step hook with the Trainer and module as its parameters."""

    def __init__(self):
        self.scale = 0.5
        self.on = True

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        if trainer.global_step % 5 == 4 and self.on:
            for p in pl_module.parameters():
                p.grad.mul_(self.scale)


def test_callback_hooks_add_their_step_counter_tests_and_the_attributes_they_read():
    from l2lightning.guards.step_source import StepSource, analyse_callbacks

    cb = _PeriodicCallback()
    found = StepSource()
    analyse_callbacks([cb], ("on_before_optimizer_step", "on_after_backward"), found)
    assert len(found.conditions) == 1 and found.conditions[0].evaluate is not None
    assert "trainer.global_step % 5 == 4" in found.conditions[0].line
    module = SimpleNamespace(trainer=SimpleNamespace(global_step=9))
    assert found.branch_key(module, 0) == (True,)
    module.trainer.global_step = 10
    assert found.branch_key(module, 0) == (False,)
    cb.on = False
    module.trainer.global_step = 9
    assert found.branch_key(module, 0) == (False,)  # the callback's own flag is read per step too
    assert found.callback_reads == [(cb, {"scale", "on"})]
    assert found.reads == set()  # the module's reads are the module's own


class _Ramp:
    """A module's step: counter reads that a graph bakes in, and ones it does not."""

    global_step = 0
    current_epoch = 0

    def helper(self, i):
        if i % 3 == 0:  # batch_idx arrives here by position: a Condition of the helper
            pass

    def training_step(self, batch, batch_idx):
        w = max(0.0, (self.global_step - 10) * 0.1)  # baked: followed per step
        print(f"step {batch_idx}")  # host text
        self.log("step", self.global_step)  # re-evaluated per replay
        if batch_idx % 7 == 0:  # a branch test: a Condition
            pass
        self.helper(batch_idx)  # read in the helper's own source
        return batch * (1 + w) * (1 + self.current_epoch)


def test_numbers_computed_from_the_step_counters_are_followed_and_host_only_reads_are_not():
    found = analyse(_Ramp())
    lines = sorted(c.line.split("(`", 1)[1] for c in found.counter_values)
    assert len(lines) == 2
    assert lines[0].startswith("return batch * (1 + w) * (1 + self.current_epoch)")
    assert lines[1].startswith("w = max(0.0, (self.global_step - 10) * 0.1)")
    assert len(found.conditions) == 2  # batch_idx % 7 in the step, i % 3 in the helper
    module = _Ramp()
    captured = found.counter_snapshot(module, 3)
    # max(0.0, -1.0), and 1 + current_epoch: the largest expression around the read that needs only the module
    assert sorted(captured) == [0.0, 1]
    module.global_step = 10
    assert found.changed_counter_values(captured, module, 4) == []  # still 0.0: the same graph
    module.global_step = 12
    assert len(found.changed_counter_values(captured, module, 5)) == 1
    module.current_epoch = 1
    assert len(found.changed_counter_values(captured, module, 5)) == 2


class _LogsEveryTenth:
    """A counter read inside a branch on the counters: baked only on steps that take the branch."""

    global_step = 0

    def training_step(self, batch, batch_idx):
        if batch_idx % 10 == 0:
            self.board.add_scalar("x", 1.0, self.global_step)  # TensorBoard style, every tenth step
        return batch * (2.0 if self.global_step > 5 else 1.0)


def test_a_counter_value_under_a_branch_is_compared_only_where_the_branch_is_taken():
    found = analyse(_LogsEveryTenth())
    module = _LogsEveryTenth()
    captured = found.counter_snapshot(module, 3)
    for step in range(4, 10):  # the branch is not taken: its value does not matter
        module.global_step = min(step, 5)
        assert found.changed_counter_values(captured, module, step) == []
    module.global_step = 10
    # taken at batch_idx 10: compared (the step's branch key differs too, so it runs eagerly anyway)
    assert len(found.changed_counter_values(captured, module, 10)) == 1
    assert len(found.conditions) == 2  # the two tests themselves are branch conditions


class _ReadsThroughSelf:
    """Values read through self by attribute and constant-subscript chains, and ones left to other checks."""

    global_step = 0

    def __init__(self):
        self.hparams = {"kl": 0.5}
        self.weights = [1.0, 2.0]
        self.schedule = list(range(1000))  # compared whole (`len(self.schedule)`): 1000 numbers
        self.head = None

    def training_step(self, batch, batch_idx):
        i = batch.index
        loss = batch * self.hparams["kl"] * self.weights[0] * self.weights[i]
        self.log("w", self.weights[1])  # re-evaluated per replay
        if self.weights[1] > 1:  # a branch test: a Condition
            loss = loss * 2
        return loss + self.schedule[3] + len(self.schedule)


def test_values_read_through_self_are_compared_where_they_are_python_numbers():
    from l2lightning.guards.step_values import frozen

    assert frozen(1.5) == frozen(1.5) != frozen(1)  # a float and an int differ
    assert frozen(float("nan")) == frozen(float("nan"))  # unchanged, though NaN != NaN
    assert frozen([1.0, {"a": 2}]) is not None and frozen(list(range(100))) is not None
    # a container too large to compare before each replay, and a value of another kind: None
    # (frozen_read tells the first apart: tests/guards/test_step_values_frozen_cpu.py)
    assert frozen(list(range(100000))) is None and frozen(object()) is None

    found = analyse(_ReadsThroughSelf())
    read = sorted(a.line.split("(`", 1)[1] for a in found.attribute_values)
    assert all("self.log" not in line for line in read)
    module = _ReadsThroughSelf()
    snapshot = found.attribute_snapshot(module, 0)
    # hparams["kl"], weights[0], weights (indexed by a local), schedule[3], schedule (`len(...)`)
    assert len(snapshot) == 5
    assert found.changed_attribute_values(snapshot, module, 1) == []
    module.hparams["kl"] = 1.0  # an entry changed in place
    module.weights = [1.0, 3.0]  # a new list, element 0 the same, but `self.weights[i]` reads all of it
    changed = found.changed_attribute_values(snapshot, module, 1)
    assert len(changed) == 2 and any('self.hparams["kl"]' in line for line in changed)


class _Curriculum:
    """A sequence-length curriculum: the step counter inside a slice (`tokens[:, : 4 + step // 10]`)."""

    global_step = 0

    def training_step(self, batch, batch_idx):
        tokens = batch[:, : 4 + self.global_step // 10]
        return tokens.sum()


def test_a_counter_read_inside_a_slice_is_compared_as_the_slices_bound():
    """A slice's `:n` is no expression of its own (reading it once raised a SyntaxError and crashed the
    fit at setup): the largest expression around the read that is one is the slice's bound."""
    found = analyse(_Curriculum())
    (value,) = found.counter_values
    assert "tokens = batch[:, : 4 + self.global_step // 10]" in value.line
    module = _Curriculum()
    captured = found.counter_snapshot(module, 0)
    assert captured == (4,)
    module.global_step = 9
    assert found.changed_counter_values(captured, module, 9) == []
    module.global_step = 10
    assert len(found.changed_counter_values(captured, module, 10)) == 1  # a longer sequence: captured again


class _ReadsTrainerMetrics:
    """The Trainer's metric dictionaries read by the step: into the work, into a print, into a log."""

    global_step = 0

    def training_step(self, batch, batch_idx):
        w = self.trainer.callback_metrics.get("val_loss", 1.0)  # reaches the loss: baked by a graph
        print(f"{self.trainer.progress_bar_metrics}")  # host text only
        self.log("seen", self.trainer.logged_metrics.get("x", 0.0))  # re-evaluated per replay
        return batch * w


def test_reads_of_the_trainers_metrics_that_reach_the_work_are_found():
    found = analyse(_ReadsTrainerMetrics())
    (line,) = found.trainer_metric_reads
    assert 'w = self.trainer.callback_metrics.get("val_loss", 1.0)' in line


def test_a_callbacks_hook_reading_its_trainers_metrics_is_found():
    from l2lightning.guards.step_source import StepSource, analyse_callbacks

    class ScalesByValidation:
        def on_before_optimizer_step(self, trainer, pl_module, optimizer):
            for p in pl_module.parameters():
                p.grad.mul_(trainer.callback_metrics["val_acc"])

    found = StepSource()
    analyse_callbacks([ScalesByValidation()], ("on_before_optimizer_step",), found)
    assert (
        len(found.trainer_metric_reads) == 1 and "trainer.callback_metrics" in found.trainer_metric_reads[0]
    )


class _ReadsSchedulerState:
    global_step = 0

    def training_step(self, batch, batch_idx):
        lr = self.lr_schedulers().get_last_lr()[0]  # reaches the loss: baked by a graph
        self.log("lr", self.lr_schedulers().get_last_lr()[0])  # re-evaluated per replay
        return batch * (1 + lr)


def test_reads_of_an_lr_schedulers_state_that_reach_the_work_are_found():
    (line,) = analyse(_ReadsSchedulerState()).scheduler_reads
    assert "lr = self.lr_schedulers().get_last_lr()[0]" in line


class _ReadsByGetattr:
    """getattr with a constant name reads like an attribute; with a computed or dunder name it is not
    evaluated (a dunder could reach anything, a computed name is not known before the step runs)."""

    def __init__(self):
        self.cfg = SimpleNamespace(w=1.0)
        self.use_aux = False

    def training_step(self, batch, batch_idx):
        name = batch.name
        loss = batch.x * getattr(self.cfg, "w", 1.0)
        if getattr(self, "use_aux", False):
            loss = loss * 2
        loss = loss * getattr(self.cfg, name) * getattr(self, "__class__").scale  # noqa: B009
        return loss


def test_getattr_with_a_constant_name_is_compared_like_an_attribute_and_no_other_getattr_is_evaluated():
    found = analyse(_ReadsByGetattr())
    module = _ReadsByGetattr()
    # what is evaluated: getattr(self.cfg, "w", 1.0), and self.cfg (twice: the objects are not
    # compared, only numbers and small containers are); neither the computed name nor the dunder
    values = [a.evaluate(module, 0) for a in found.attribute_values]
    assert values == [1.0, module.cfg, module.cfg], values
    assert [c.line.split("(`", 1)[1] for c in found.conditions] == ['if getattr(self, "use_aux", False):`)']
    snapshot = found.attribute_snapshot(module, 0)
    module.cfg.w = 2.0
    assert any("getattr(self.cfg" in line for line in found.changed_attribute_values(snapshot, module, 0))


class ReturnsCounters:
    def __init__(self):
        self.global_step = 7
        self.current_epoch = 1

    def training_step(self, batch, batch_idx):
        loss = batch * 2
        return {
            "loss": loss,
            "step": self.global_step,
            "seen": (batch_idx + 1) * 8,
            "scaled": loss * self.current_epoch,  # needs the step's tensor: baked in the graph
        }


def test_counter_numbers_returned_beside_the_loss_are_evaluated_not_compared():
    found = analyse(ReturnsCounters())
    assert set(found.output_values) == {"step", "seen"}
    assert found.output_values["seen"][1](ReturnsCounters(), 4) == 40
    assert found.output_values["step"][1](ReturnsCounters(), 0) == 7
    baked = [c.line for c in found.counter_values]
    assert len(baked) == 1 and "self.current_epoch" in baked[0]


class ReturnsInABranch(ReturnsCounters):
    def training_step(self, batch, batch_idx):
        if batch_idx:
            return {"loss": batch, "step": self.global_step}
        return {"loss": batch, "step": self.global_step}


def test_counters_in_returns_other_than_one_at_the_top_stay_compared():
    found = analyse(ReturnsInABranch())
    assert found.output_values == {} and len(found.counter_values) == 2


MODULE_SETTINGS = SimpleNamespace(weight=1.0, loss=SimpleNamespace(beta=0.5), flags={"aux": True})


class _ReadsModuleLevelChains:
    def training_step(self, batch, batch_idx):
        import math

        import torch

        loss = batch * MODULE_SETTINGS.weight * MODULE_SETTINGS.loss.beta * math.pi
        if MODULE_SETTINGS.flags["aux"]:  # a branch test: compared too, a change captures the new branch
            loss = loss.to(torch.float32)
        return loss


def test_chains_read_from_a_module_level_config_are_compared_and_a_librarys_are_not():
    found = analyse(_ReadsModuleLevelChains())
    lines = sorted(a.line.split("(`", 1)[1] for a in found.attribute_values)
    # the two chains of the loss's line and the branch test's; not `math.pi` or `torch.float32`
    assert len(lines) == 3 and lines[0].startswith("if MODULE_SETTINGS.flags"), lines
    assert lines[1] == lines[2] and "MODULE_SETTINGS.loss.beta * math.pi" in lines[1], lines
    module = _ReadsModuleLevelChains()
    snapshot = found.attribute_snapshot(module, 0)
    assert found.changed_attribute_values(snapshot, module, 1) == []
    try:
        MODULE_SETTINGS.loss.beta = 0.25  # in place, two attributes deep
        MODULE_SETTINGS.flags["aux"] = False
        changed = found.changed_attribute_values(snapshot, module, 1)
    finally:
        MODULE_SETTINGS.loss.beta, MODULE_SETTINGS.flags["aux"] = 0.5, True
    assert len(changed) == 2 and any("MODULE_SETTINGS.loss.beta" in line for line in changed)


class _CountsGets:
    """An object with a `get` method that does something (a queue's): never called by a comparison."""

    def __init__(self):
        self.calls = 0

    def get(self, key, default=None):
        self.calls += 1
        return default


class _ReadsWithGet:
    def __init__(self):
        self.hparams = {"kl": 0.5}
        self.queue = _CountsGets()

    def training_step(self, batch, batch_idx):
        return batch * self.hparams.get("kl", 1.0) * self.queue.get("w", 1.0)


def test_a_constant_get_of_a_mapping_is_compared_and_another_objects_get_is_never_called():
    module = _ReadsWithGet()
    found = analyse(module)
    assert len(found.attribute_values) == 2
    snapshot = found.attribute_snapshot(module, 0)
    assert found.changed_attribute_values(snapshot, module, 1) == []
    module.hparams["kl"] = 0.25
    assert len(found.changed_attribute_values(snapshot, module, 1)) == 1
    assert module.queue.calls == 0


LOGGED_SCALE = 2.0


class _LogsModuleLevel:
    def training_step(self, batch, batch_idx):
        self.log("scaled", LOGGED_SCALE * MODULE_SETTINGS.weight)
        self.log("unknown", undefined_here)  # noqa: F821 - a name the module does not have: not evaluable
        return batch


def test_a_logged_expression_of_module_globals_is_evaluated_against_them_live():
    global LOGGED_SCALE
    found = analyse(_LogsModuleLevel())
    assert sorted(found.log_values) == ["scaled"]
    assert found.log_value("scaled", _LogsModuleLevel(), 0) == 2.0
    LOGGED_SCALE = 3.0
    try:
        assert found.log_value("scaled", _LogsModuleLevel(), 0) == 3.0
    finally:
        LOGGED_SCALE = 2.0
