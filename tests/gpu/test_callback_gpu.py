"""GPU: L2GraphCallback in Trainer.fit is bit-identical to an eager fit of the same optimizer configuration."""

from __future__ import annotations

import contextlib

import pytest
import torch
from lightning.pytorch import Callback, Trainer, seed_everything
from lightning.pytorch.loggers import Logger

from l2lightning import EquivalenceError, L2GraphCallback
from l2lightning.callback.prefetch_setup import PrefetchSetup
from tests.baselines import (  # noqa: F401 -- the fixture records each callback fit's switch step
    DeferredFit,
    baseline_of,
    capturable_from_of_the_last_callback_fit,
    is_baseline,
)
from tests.between_step_models import (
    CONFIG_CHANGES,
    LAYER_CODE_CHANGES,
    LogsAnUnrecomputableNumber,
    LogsModuleLevelNumbers,
    MovesTheScaleEachEpoch,
    ReadsACallback,
    ReadsWhatItAppended,
    ScalesByAPlainTensor,
    SeedsInTheStep,
    SetsTheConfigEachEpoch,
    SetsTheLoggedNumbersEachEpoch,
    SwitchesItsLoss,
    TF32FromEpochOne,
    WeightOnACallback,
    WritesOutEveryStep,
)
from tests.lightning_models import (
    AdagradMLP,
    CheckpointedDropout,
    CheckpointedDropoutUnpreserved,
    DropoutOutsideCheckpoint,
    Finetuned,
    IgnoresTheNames,
    NamedSamples,
    ReadsTheNames,
    StepWithoutBatchIdx,
    TinyMLP,
    quiet_trainer,
    regression_loader,
)

pytestmark = pytest.mark.gpu


CapturableBaseline = baseline_of(TinyMLP)


class LossRecorder(Callback):
    def __init__(self):
        self.losses = []
        self.logged = []
        self.metrics = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.losses.append(outputs["loss"].detach().clone())
        logged = trainer.callback_metrics.get("train/loss")  # (a module may log under other names)
        if logged is not None:
            self.logged.append(logged.detach().clone())

    def on_train_epoch_end(self, trainer, pl_module):
        self.metrics.append({k: v.detach().clone() for k, v in trainer.callback_metrics.items()})


def fit(
    model_cls,
    callbacks,
    steps=30,
    n=240,
    batch_size=8,
    precision="32-true",
    ckpt_path=None,
    trainer_out=None,
    max_epochs=None,
    baseline=False,
    loader=None,
    **model_kwargs,
):
    if baseline:
        model_cls = baseline_of(model_cls)
    arguments = dict(
        n=n, batch_size=batch_size, precision=precision, ckpt_path=ckpt_path, trainer_out=trainer_out
    )
    if is_baseline(model_cls):
        # the baseline switches where the test's callback fit switched: it runs after that fit
        return DeferredFit(
            lambda: _fit(model_cls, callbacks, steps, max_epochs, loader, arguments, model_kwargs)
        )
    return _fit(model_cls, callbacks, steps, max_epochs, loader, arguments, model_kwargs)


def _fit(model_cls, callbacks, steps, max_epochs, loader, arguments, model_kwargs):
    n, batch_size, precision = arguments["n"], arguments["batch_size"], arguments["precision"]
    ckpt_path, trainer_out = arguments["ckpt_path"], arguments["trainer_out"]
    seed_everything(0)
    torch.use_deterministic_algorithms(True, warn_only=True)
    model = model_cls(width=512, depth=4, **model_kwargs)
    rec = LossRecorder()
    trainer = quiet_trainer(
        accelerator="gpu",
        devices=1,
        max_steps=steps,
        precision=precision,
        callbacks=[rec, *callbacks],
        deterministic=True,
        max_epochs=max_epochs,
    )
    data = loader() if loader is not None else regression_loader(n=n, width=512, batch_size=batch_size)
    trainer.fit(model, data, ckpt_path=ckpt_path)
    if trainer_out is not None:
        trainer_out.append(trainer)
    return model, rec


def assert_same_run(a, b):
    (ma, ra), (mb, rb) = a, b
    assert len(ra.losses) == len(rb.losses)
    for i, (x, y) in enumerate(zip(ra.losses, rb.losses)):
        assert torch.equal(x, y), f"loss differs at step {i}: {x.item()} vs {y.item()}"
    for (name, p), q in zip(ma.named_parameters(), mb.parameters()):
        assert torch.equal(p, q), f"parameter {name} differs"


@pytest.mark.parametrize(
    ("scheduler", "fused"),
    [(None, False), ("step", False), ("cosine", False), ("step", True)],
    ids=["constant", "step", "cosine", "step-fused"],
)
def test_fit_30_steps_bitwise_equal_to_eager(scheduler, fused):
    base = fit(CapturableBaseline, [], scheduler=scheduler, fused=fused)
    cb = L2GraphCallback(prefetch="default")
    run = fit(TinyMLP, [cb], scheduler=scheduler, fused=fused)
    assert_same_run(base, run)
    summary = cb.summary()
    assert summary["captured"] and summary["capture_step"] == 3 and summary["fallback_steps"] == 0
    assert summary["graph_step_ms"] is not None
    # logged values follow the replays: they change from step to step after capture
    assert len({float(v) for v in run[1].logged[4:]}) > 5
    assert all(torch.equal(a, b) for a, b in zip(run[1].logged, base[1].logged))


def test_bf16_mixed():
    base = fit(CapturableBaseline, [], precision="bf16-mixed")
    cb = L2GraphCallback(prefetch="default")
    run = fit(TinyMLP, [cb], precision="bf16-mixed")
    assert cb.summary()["captured"]
    assert_same_run(base, run)


def test_last_partial_batch_falls_back_and_training_continues():
    base = fit(CapturableBaseline, [], n=60, steps=20)  # 8 batches per epoch, the last has 4 rows
    cb = L2GraphCallback(prefetch="default")
    with pytest.warns(UserWarning, match="running this step eagerly"):
        run = fit(TinyMLP, [cb], n=60, steps=20)
    assert cb.summary()["fallback_steps"] >= 2
    assert_same_run(base, run)


def assert_refused_and_trains_like_plain(cls, warning: str, in_reason: str, **fit_kwargs) -> None:
    """A fit the callback refuses to capture: it says so (`warning`, `in_reason` naming the cause) and
    trains bit for bit like plain Lightning."""
    plain = fit(cls, [], **fit_kwargs)
    cb = L2GraphCallback(prefetch="off")
    with pytest.warns(UserWarning, match=warning):
        run = fit(cls, [cb], **fit_kwargs)
    s = cb.summary()
    assert not s["captured"] and in_reason in s["reason"], s
    assert_same_run(plain, run)


def assert_captured_like_baseline(
    cls, captures: int, warning: str | None = None, callbacks=list, operand_scalars=True, **fit_kwargs
):
    """A fit the callback captures `captures` times (the recaptures warned of by `warning`), with no eager
    step after the first capture, bitwise the capturable baseline. `callbacks` makes the fit's other
    callbacks (each fit gets its own)."""
    base = fit(cls, callbacks(), baseline=True, **fit_kwargs)
    # captures counted
    cb = L2GraphCallback(prefetch="off", recapture_wait=False, operand_scalars=operand_scalars)
    with pytest.warns(UserWarning, match=warning) if warning else contextlib.nullcontext():
        run = fit(cls, [*callbacks(), cb], **fit_kwargs)
    summary = cb.summary()
    assert summary["captured"] and summary["captures"] == captures and summary["fallback_steps"] == 0, summary
    assert_same_run(base, run)


def test_a_training_step_without_batch_idx_is_captured_and_bitwise_the_baseline():
    base = fit(StepWithoutBatchIdx, [], baseline=True)
    cb = L2GraphCallback(prefetch="default")
    run = fit(StepWithoutBatchIdx, [cb])
    summary = cb.summary()
    assert summary["captured"] and summary["fallback_steps"] == 0, summary
    assert_same_run(base, run)


def test_host_sync_in_training_step_is_refused_at_the_first_step_and_trains_like_plain():
    assert_refused_and_trains_like_plain(
        TinyMLP, r"lightning_models.py:\d+.*makes the host wait", "eager_steps", steps=10, sync_in_step=True
    )


class SyncsInsideCapture(TinyMLP):
    """Dropout, and a device sync the tracer cannot see: the capture itself fails on the GPU."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self.drop = torch.nn.Dropout(0.2)

    def training_step(self, batch, batch_idx):
        x, y = batch
        torch.cuda.synchronize()  # not an op: only the CUDA capture sees it
        pred = self.head(self.drop(self.net(x))).squeeze(-1)
        loss = (pred.float() - y.float()).square().mean()
        self.log("train/loss", loss)
        return loss


def test_a_failed_capture_leaves_the_rng_usable_and_later_fits_train_like_plain():
    base = fit(SyncsInsideCapture, [], steps=12, fused=True)
    cb = L2GraphCallback(prefetch="off")
    with pytest.warns(UserWarning, match="could not be captured"):
        run = fit(SyncsInsideCapture, [cb], steps=12, fused=True)
    assert not cb.summary()["captured"]
    assert_same_run(base, run)  # fused AdamW: capturable and configured steps agree bitwise
    torch.nn.functional.dropout(torch.ones(64, device="cuda"), 0.5)  # the CUDA generator still works
    again = fit(SyncsInsideCapture, [], steps=6, fused=True)  # a plain fit with dropout, same process
    first = fit(SyncsInsideCapture, [], steps=6, fused=True)
    assert_same_run(again, first)


class DrawsOnTheDevice(TinyMLP):
    """Random draws on the device inside the step, as RL and data-efficient training code does them:
    a minibatch order from ``torch.randperm`` and sampled actions from ``torch.multinomial``."""

    def training_step(self, batch, batch_idx):
        x, y = batch
        order = torch.randperm(x.shape[0], device=x.device)
        pred = self.head(self.net(x[order])).squeeze(-1)
        picked = torch.multinomial(torch.softmax(pred.detach(), 0), 2, replacement=True)
        loss = (pred.float() - y[order].float()).square().mean() + 1e-3 * pred[picked].float().mean()
        self.log("train/loss", loss)
        return loss


def test_randperm_and_multinomial_in_the_step_replay_the_draws_of_eager_steps():
    """The graph's random ops draw from the CUDA generator's Philox state, advanced per replay as an
    eager step advances it: captured, the fit equals its eager baseline bit for bit."""
    cb = L2GraphCallback(prefetch="off")
    run = fit(DrawsOnTheDevice, [cb], steps=30, fused=True)
    summary = cb.summary()
    assert summary["captured"] and summary["fallback_steps"] == 0, summary
    assert_same_run(fit(DrawsOnTheDevice, [], steps=30, fused=True, baseline=True), run)


@pytest.mark.parametrize(
    "cls",
    [CheckpointedDropout, CheckpointedDropoutUnpreserved, DropoutOutsideCheckpoint],
    ids=["dropout-inside-preserved", "dropout-inside-unpreserved", "dropout-outside"],
)
def test_activation_checkpointing_with_dropout_is_captured_and_bitwise_its_baseline(cls):
    """Dropout inside a block recomputed with the forward's random state put back (the replay's
    backward must redraw its own forward's masks, through the graph-safe generator state), without
    the put-back, and with the dropout outside the block: captured, checked, bitwise the baseline."""
    cb = L2GraphCallback(prefetch="off", check_share=1.0)  # every scheduled check
    run = fit(cls, [cb], steps=30, fused=True)
    summary = cb.summary()
    assert summary["captured"] and summary["fallback_steps"] == 0, summary
    report = summary["replay_check"]
    assert report["checks"] >= 4 and report["mismatches"] == 0 and report["within_spread"] == 0, report
    assert_same_run(fit(cls, [], steps=30, fused=True, baseline=True), run)


@pytest.mark.parametrize("how", ["print", "logging"])
def test_a_step_that_writes_out_every_step_is_refused_by_name_and_trains_like_plain(how):
    """Replays write nothing: a print or a log line per step would go missing."""
    assert_refused_and_trains_like_plain(
        WritesOutEveryStep, "runs in the step", "a replay runs no Python", how=how, fused=True
    )


class ReturnsItsStep(TinyMLP):
    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        return {"loss": loss, "step": self.global_step, "seen": batch_idx * 8}


def test_step_counters_returned_beside_the_loss_are_evaluated_per_replay_and_capture_once():
    assert_captured_like_baseline(ReturnsItsStep, 1, steps=40, fused=True)


def named_samples():
    return torch.utils.data.DataLoader(NamedSamples(width=512), batch_size=8)


def test_file_names_in_the_batch_the_step_never_reads_are_captured_and_replay_bitwise():
    """Each batch carries other file names; unread, they no longer keep every step eager."""
    cb = L2GraphCallback(prefetch="off")
    run = fit(IgnoresTheNames, [cb], loader=named_samples, fused=True)
    summary = cb.summary()
    assert summary["captured"] and summary["fallback_steps"] == 0, summary
    assert_same_run(fit(IgnoresTheNames, [], loader=named_samples, fused=True, baseline=True), run)


class ReadsTheNamesAdamW(ReadsTheNames):
    """The step reads its file names; fused AdamW as configured by TinyMLP."""

    configure_optimizers = TinyMLP.configure_optimizers


def test_file_names_the_step_reads_are_refused_after_the_warm_up_limit_and_the_fit_is_plains():
    """Refused after 24 traced warm-up steps with make_capturable's configuration: with fused AdamW
    the fit is still bitwise the plain one (on the CPU stand-in it is not: its fused kernel rounds a
    tensor LR otherwise)."""
    assert_refused_and_trains_like_plain(
        ReadsTheNamesAdamW,
        "every batch held other non-tensor values",
        "the step reads them",
        loader=named_samples,
        fused=True,
    )


def test_verify_passes_and_is_reported():
    cb = L2GraphCallback(prefetch="default", verify=True)
    fit(TinyMLP, [cb], steps=6)
    assert cb.verify_report is not None and cb.verify_report.ok


class Planted(TinyMLP):
    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        if torch.cuda.is_current_stream_capturing():
            loss = loss + 1e-3  # differs only inside the graph
        return loss


def test_verify_detects_a_planted_mismatch():
    with pytest.raises(EquivalenceError, match="captured step vs eager step"):
        fit(Planted, [L2GraphCallback(prefetch="off", verify=True)], steps=6)


def test_gradient_clipping_is_captured_and_exact():
    def run(model_cls, cbs):
        seed_everything(0)
        model = model_cls(width=512, depth=4)
        trainer = Trainer(
            accelerator="gpu",
            max_steps=12,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            gradient_clip_val=0.1,
            callbacks=cbs,
        )
        trainer.fit(model, regression_loader(n=240, width=512))
        return model

    cb = L2GraphCallback(prefetch="off")
    b = run(TinyMLP, [cb])
    a = run(CapturableBaseline, [])
    assert cb.summary()["captured"]
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))


def test_checkpoint_resume_equals_uninterrupted(tmp_path):
    from lightning.pytorch.callbacks import ModelCheckpoint

    def run(ckpt_path=None):
        seed_everything(0)
        model = TinyMLP(width=512, depth=4)
        cb = L2GraphCallback(prefetch="default")
        saver = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=10, save_top_k=-1, filename="{step}")
        trainer = Trainer(
            accelerator="gpu",
            max_steps=30,
            logger=False,
            enable_progress_bar=False,
            callbacks=[cb, saver] if ckpt_path is None else [cb],
            enable_model_summary=False,
        )
        trainer.fit(model, regression_loader(n=80, width=512), ckpt_path=ckpt_path)
        return model, cb, trainer

    full, _, _ = run()
    path = tmp_path / "step=10.ckpt"
    saved = torch.load(path, weights_only=False)
    group = saved["optimizer_states"][0]["param_groups"][0]
    assert isinstance(group["lr"], float) and group["capturable"] is False  # as without the callback
    assert saved["global_step"] == 10
    resumed, cb, trainer = run(ckpt_path=str(path))
    assert trainer.global_step == 30
    assert cb.summary()["captured"]  # re-captured after resuming
    for (name, p), q in zip(full.named_parameters(), resumed.parameters()):
        assert torch.equal(p, q), name


def test_compile_with_prefetch_is_captured_verified_and_close_to_compile_without_prefetch():
    """With compile=True the prefetch points are ops in the graph inductor compiles, so its kernels
    may differ from those of the graph without them: on the H200 one run of this test had the two
    fits' losses apart in the last bits from step 1 (9.670486 vs 9.670404), another had them equal.
    Each fit's replays are verified bitwise against its own eager step; the two fits agree to rounding."""
    # each fit compiles afresh: inductor generates the backward's code at the first backward, inside
    # the traced warm-up (a fit reusing the other's code would not show that the capture survives it)
    torch._dynamo.reset()
    without = L2GraphCallback(compile=True, prefetch="off", verify=True)
    plain = fit(TinyMLP, [without], steps=8)
    assert without.summary()["captured"] and without.verify_report.ok, without.summary()
    torch._dynamo.reset()
    cb = L2GraphCallback(compile=True, prefetch="default", verify=True)
    run = fit(TinyMLP, [cb], steps=8)
    summary = cb.summary()
    assert summary["captured"] and summary["fallback_steps"] == 0, summary
    assert any(row["forward"] for row in cb.plans)  # the prefetch points are in the compiled graph
    assert cb.verify_report.ok
    a, b = torch.stack(plain[1].losses), torch.stack(run[1].losses)
    torch.testing.assert_close(b, a, rtol=1e-4, atol=0)


class UserCompiled(TinyMLP):
    """A submodule the user compiled (inductor): its generated kernels launch on the capture stream."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self.net = torch.compile(self.net)


class UserCompiledWithDropout(TinyMLP):
    """A compiled submodule that draws random numbers: inductor's own RNG (seeds drawn from the CUDA
    generator, philox in its kernels), inside the captured graph."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self.net = torch.compile(torch.nn.Sequential(self.net, torch.nn.Dropout(0.1)))


@pytest.mark.parametrize("model_cls", [UserCompiled, UserCompiledWithDropout], ids=["plain", "dropout"])
def test_a_submodule_the_user_compiled_is_captured_and_the_fit_is_bitwise_the_baseline(model_cls):
    torch._dynamo.reset()
    base = fit(model_cls, [], steps=20, baseline=True)
    torch._dynamo.reset()
    cb = L2GraphCallback(prefetch="off")
    run = fit(model_cls, [cb], steps=20)
    assert cb.summary()["captured"], cb.summary()
    assert_same_run(base, run)


class ScaledBlock(torch.nn.Module):
    def __init__(self, width):
        super().__init__()
        self.lin = torch.nn.Linear(width, width)

    def forward(self, x, scale):
        return torch.nn.functional.gelu(self.lin(x)) * scale


class PassesAHostTensorIntoCompiled(TinyMLP):
    """Passes a CPU scalar tensor into a submodule it compiled: inductor makes it a kernel argument,
    which a graph would keep from the capture, and the tracer cannot see inside compiled code."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self.block = torch.compile(ScaledBlock(512))

    def training_step(self, batch, batch_idx):
        x, y = batch
        scale = torch.tensor(0.5)
        pred = self.head(self.block(self.net(x), scale)).squeeze(-1)
        loss = (pred - y).square().mean()
        self.log("train/loss", loss)
        return loss


class PassesAHostTensorIntoCompiledInPlace(PassesAHostTensorIntoCompiled):
    """The same, with the block compiled in place (``module.compile()``, which torch recommends)."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self.block = ScaledBlock(512)
        self.block.compile()


@pytest.mark.parametrize(
    "model_cls",
    [PassesAHostTensorIntoCompiled, PassesAHostTensorIntoCompiledInPlace],
    ids=["torch.compile(module)", "module.compile()"],
)
def test_a_host_tensor_passed_into_a_compiled_submodule_is_refused_by_name_and_trains_like_plain(model_cls):
    torch._dynamo.reset()
    assert_refused_and_trains_like_plain(
        model_cls,
        r"host tensor is passed into `block`",
        "compiled with torch.compile",
        steps=8,
    )


def test_report_times_phases_inside_the_graph_and_counts_kernels():
    cb = L2GraphCallback(prefetch="default", report=True)
    fit(TinyMLP, [cb], steps=6)
    report = cb.summary()["step_report"]
    assert report is not None, "no step report"
    phases = {p["name"]: p for p in report["phases"]}
    assert set(phases) == {"forward", "backward", "optimizer"}
    assert all(p["time_us"] > 0 for p in phases.values())
    assert all(p["kernel_count"] and p["kernel_count"] > 0 for p in phases.values())
    assert report["bound"] in ("launch", "bandwidth", "compute")


class MetricInStep(TinyMLP):
    """torchmetrics updated and logged inside training_step (the hydra-template pattern): captured."""

    def __init__(self, **kw):
        super().__init__(**kw)
        import torchmetrics

        self.classes = torch.nn.Linear(512, 4)
        self.train_mean = torchmetrics.MeanMetric()
        self.train_acc = torchmetrics.Accuracy(task="multiclass", num_classes=4)

    def training_step(self, batch, batch_idx):
        x, y = batch
        h = self.net(x)
        logits = self.classes(h)
        target = (y.abs() * 2).long().clamp(max=3)
        loss = (self.head(h).squeeze(-1) - y).square().mean() + torch.nn.functional.cross_entropy(
            logits, target
        )
        self.train_mean(loss.detach())
        self.train_acc(logits, target)
        self.log("train/loss", loss)
        self.log("train/mean", self.train_mean, on_step=False, on_epoch=True)
        self.log("train/acc", self.train_acc, on_step=True, on_epoch=True)
        return loss


def test_torchmetrics_in_training_step_are_captured_and_equal_to_the_baseline():
    base = fit(MetricInStep, [], steps=-1, n=96, max_epochs=3, baseline=True)
    cb = L2GraphCallback(prefetch="off")
    run = fit(MetricInStep, [cb], steps=-1, n=96, max_epochs=3)
    summary = cb.summary()
    assert summary["captured"] and summary["fallback_steps"] == 0, summary
    assert_same_run(base, run)
    for name in ("train/acc_epoch", "train/mean", "train/acc_step"):
        assert torch.equal(base[1].metrics[-1][name].cpu(), run[1].metrics[-1][name].cpu()), name


class RecordingLogger(Logger):
    def __init__(self):
        super().__init__()
        self.calls = []

    @property
    def name(self):
        return "recording"

    @property
    def version(self):
        return 0

    def log_hyperparams(self, params, *args, **kwargs):
        pass

    def log_metrics(self, metrics, step=None):
        self.calls.append((step, dict(metrics)))


def test_l2_metrics_reach_the_logger_before_the_epoch_ends():
    seed_everything(0)
    logger = RecordingLogger()
    cb = L2GraphCallback(prefetch="off")
    trainer = quiet_trainer(
        accelerator="gpu",
        max_epochs=1,
        logger=logger,
        log_every_n_steps=1000,  # Lightning's own metrics stay out of the way
        callbacks=[cb],
    )
    trainer.fit(TinyMLP(width=512, depth=4), regression_loader(n=8 * 30, width=512))  # 30 steps, one epoch
    l2 = [(step, m) for step, m in logger.calls if "l2/graph_step_ms" in m]
    assert len(l2) >= 2, logger.calls  # once known, and at the epoch end
    first_step, first = l2[0]
    assert first_step < 29, f"first l2/* log at step {first_step}: only at the epoch end"
    assert first["l2/graph_step_ms"] > 0 and first["l2/replay_speedup"] > 0


def test_the_whole_step_gate_times_both_graphs_and_training_stays_bitwise_equal(monkeypatch):
    """The gate with real prefetch kernels and CUDA events (on the byte-sized plans, which the tuner
    may or may not keep on this model): one capture whose prefetch nodes are switched off and on,
    a verdict, the baseline's losses."""
    monkeypatch.setattr(PrefetchSetup, "_GATED_MODES", ("auto", "default"))
    base = fit(CapturableBaseline, [], steps=40)
    cb = L2GraphCallback(prefetch="default", gate_pairs=8)
    run = fit(TinyMLP, [cb], steps=40)
    assert_same_run(base, run)
    s = cb.summary()
    gate = s["prefetch_gate"]
    assert s["captured"] and s["captures"] == 1 and s["capture_step"] == 3 and s["fallback_steps"] == 0, s
    assert gate["method"] == "switch", gate
    assert gate["pairs"] == 8 and gate["kept"] in ("prefetch", "off") and gate["prefetch_ms"] > 0, gate
    assert (gate["kept"] == "off") == (s["plans"] == []), (gate, s["plans"])


class SideStreamScale(TinyMLP):
    """A step that puts part of its work on a CUDA stream of its own: a scale read from a buffer
    (never written, so no step races it), joined back before use; `fork` makes the stream first wait
    on the step's stream, which is what lets a capture record it."""

    def __init__(self, fork: bool = False, **kw):
        super().__init__(**kw)
        self.fork = fork
        self.register_buffer("scale_source", torch.full((), 0.5))
        self._side = None

    def on_fit_start(self):
        self._side = torch.cuda.Stream()

    def training_step(self, batch, batch_idx):
        x, y = batch
        main = torch.cuda.current_stream()
        if self.fork:
            self._side.wait_stream(main)
        with torch.cuda.stream(self._side):
            scale = self.scale_source * 2.0
        main.wait_stream(self._side)
        pred = self.head(self.net(x)).squeeze(-1) * scale
        loss = (pred - y).square().mean()
        self.log("train/loss", loss)
        return loss


def test_work_on_a_stream_the_capture_does_not_record_is_refused_by_name_and_trains_like_plain():
    # fused AdamW: the capturable and the configured steps agree bitwise
    assert_refused_and_trains_like_plain(
        SideStreamScale, "takes no part in the capture", "test_callback_gpu.py", steps=12, fused=True
    )


def test_a_side_stream_forked_from_the_steps_stream_is_captured_and_replays_bitwise():
    base = fit(SideStreamScale, [], steps=20, baseline=True, fork=True)
    cb = L2GraphCallback(prefetch="off")
    run = fit(SideStreamScale, [cb], steps=20, fork=True)
    s = cb.summary()
    assert s["captured"] and s["fallback_steps"] == 0, s
    assert_same_run(base, run)


@pytest.mark.parametrize("what", ["function", "loss module"])
def test_a_loss_an_epoch_hook_switches_is_captured_again_and_the_fit_is_bitwise_the_baseline(what):
    """A graph replays the code it was captured with: a loss function or loss module rebound between
    epochs must be seen before the next replay (the replays once kept epoch 0's loss, silently)."""
    assert_captured_like_baseline(SwitchesItsLoss, 3, steps=90, what=what)


def test_a_number_the_step_reads_from_another_callback_is_compared_before_each_replay():
    # baked in (no device scalars, which a weight read only as a tensor operand would otherwise use)
    assert_captured_like_baseline(
        ReadsACallback, 3, callbacks=lambda: [WeightOnACallback()], operand_scalars=False, steps=90
    )


class AnnealsAHostTemperature(TinyMLP):
    """Divides by a 0-d CPU tensor kept as a plain attribute (Lightning does not move it): each CUDA
    kernel reading it takes its value as an argument, which a graph keeps from the capture. An epoch
    hook anneals it in place."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self.temperature = torch.tensor(1.0)

    def training_step(self, batch, batch_idx):
        x, y = batch
        pred = self.scaled(self.head(self.net(x)).squeeze(-1))
        loss = (pred - y).square().mean()
        self.log("train/loss", loss)
        return loss

    def scaled(self, pred):
        return pred / self.temperature

    def on_train_epoch_end(self):
        self.temperature.mul_(0.5)


class AnnealsThroughAHostOp(AnnealsAHostTemperature):
    """Reads the temperature through a host op: the device op reads a tensor made anew each step."""

    def scaled(self, pred):
        return pred / self.temperature.clamp(min=0.1)


class AnnealsThroughItem(AnnealsAHostTemperature):
    """Reads the temperature's value on the host: a number in the captured kernel's arguments."""

    def scaled(self, pred):
        return pred / self.temperature.item()


class CountsOnTheHost(TinyMLP):
    """Decays a CPU tensor it holds (128 elements: too many to enter the traced ops' signatures by
    value, so every traced step looks alike): until the host-write check it was captured, and no
    replay decayed it again."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self.visits = torch.ones(128)

    def training_step(self, batch, batch_idx):
        x, y = batch
        self.visits.mul_(0.99)
        loss = (self.head(self.net(x)).squeeze(-1) - y).square().mean()
        self.log("train/loss", loss)
        return loss


def test_a_host_tensor_the_step_changes_in_place_is_refused_by_name_and_trains_like_plain():
    assert_refused_and_trains_like_plain(
        CountsOnTheHost,
        r"`self.visits`, a host \(CPU\) tensor, is changed in place",
        "on_train_batch_end",
        steps=10,
    )


@pytest.mark.parametrize(
    "model_cls",
    [AnnealsAHostTemperature, AnnealsThroughAHostOp, AnnealsThroughItem],
    ids=["direct", "host-op", "item"],
)
def test_a_host_tensor_annealed_in_place_is_compared_before_each_replay_and_the_fit_is_the_baseline(
    model_cls,
):
    assert_captured_like_baseline(
        model_cls, 3, "host tensors the step reads changed in place since capture", steps=90
    )


@torch.compile
def divided_by(pred, temperature):
    return pred / temperature


GLOBAL_TEMPERATURE = torch.tensor(1.0)  # a module-level host tensor a compiled function reads


@torch.compile
def divided_by_the_global_temperature(pred):
    return pred / GLOBAL_TEMPERATURE


class AnnealsIntoACompiledFunction(AnnealsAHostTemperature):
    """Passes the host temperature into a function the user compiled: what compiled code does with a
    host tensor is not traced, and a graph would keep the capture's value."""

    def scaled(self, pred):
        return divided_by(pred, self.temperature)


class AnnealsAGlobalOfACompiledFunction(AnnealsAHostTemperature):
    """A compiled function reads a module-level host tensor, which an epoch hook anneals in place."""

    def __init__(self, **kw):
        super().__init__(**kw)
        GLOBAL_TEMPERATURE.fill_(1.0)

    def scaled(self, pred):
        return divided_by_the_global_temperature(pred)

    def on_train_epoch_end(self):
        GLOBAL_TEMPERATURE.mul_(0.5)


@pytest.mark.parametrize(
    "model_cls", [AnnealsIntoACompiledFunction, AnnealsAGlobalOfACompiledFunction], ids=["argument", "global"]
)
def test_a_host_tensor_reaching_a_compiled_function_is_refused_by_name_and_trains_like_plain(model_cls):
    torch._dynamo.reset()
    plain = fit(model_cls, [], steps=90)
    torch._dynamo.reset()
    base = fit(model_cls, [], steps=90, baseline=True)
    torch._dynamo.reset()
    cb = L2GraphCallback(prefetch="off")
    run = fit(model_cls, [cb], steps=90)
    torch._dynamo.reset()
    summary = cb.summary()
    # what the fit did, for the message: equal to plain Lightning, to the capturable baseline
    same = {
        name: all(torch.equal(a, b) for a, b in zip(ref[1].losses, run[1].losses))
        for name, ref in (("plain", plain), ("baseline", base))
    }
    assert not summary["captured"], (summary, same)
    assert "compiled with torch.compile" in summary["reason"] and "`divided_by" in summary["reason"], summary
    assert_same_run(plain, run)


@pytest.mark.parametrize(("model_cls", "change"), LAYER_CODE_CHANGES.values(), ids=LAYER_CODE_CHANGES.keys())
def test_a_layers_code_changed_mid_fit_is_captured_again_and_bitwise_the_baseline(model_cls, change):
    """Silent on the CPU emulator until 9c733eb: the replays after the change ran the captured code."""
    assert_captured_like_baseline(
        model_cls, 2, "the code of layers changed since capture", callbacks=lambda: [change()], steps=90
    )


def test_tf32_switched_on_for_an_epoch_is_captured_again_and_the_fit_is_the_baseline():
    """TF32 matmuls change an FP32 step's numbers; a graph keeps the kernels its capture chose, so the
    replays after the switch would have trained in full precision (and back)."""
    found = torch.backends.cuda.matmul.allow_tf32
    try:
        cb = L2GraphCallback(prefetch="off", recapture_wait=False)  # captures counted
        with pytest.warns(UserWarning, match="numerics settings changed since capture"):
            run = fit(TinyMLP, [TF32FromEpochOne(), cb], steps=90)
        full = list(fit(TinyMLP, [], steps=90, baseline=True))
        base = list(fit(TinyMLP, [TF32FromEpochOne()], steps=90, baseline=True))
        # the switch changes the numbers (else this test could not fail): epoch 1 trains otherwise
        assert torch.equal(full[1].losses[29], base[1].losses[29])
        assert not torch.equal(full[1].losses[31], base[1].losses[31])
    finally:
        torch.backends.cuda.matmul.allow_tf32 = found
    summary = cb.summary()
    assert summary["captured"] and summary["captures"] == 3 and summary["fallback_steps"] == 0, summary
    assert_same_run(base, run)


@pytest.mark.parametrize(
    ("how", "named"),
    [
        ("torch.manual_seed", "torch.manual_seed"),
        ("imported manual_seed", "torch.random.manual_seed"),
        ("fork_rng", "torch.random.fork_rng"),
    ],
)
@pytest.mark.parametrize("constant", [False, True], ids=["seed-per-step", "constant-seed"])
def test_a_step_that_seeds_torch_is_refused_by_name_and_trains_like_plain(constant, how, named):
    """A replay would not seed the CUDA generator again (or put back its state, as fork_rng does): its
    dropout masks would differ from an eager step's (with a constant seed the capture itself succeeds,
    so only the refusal keeps it exact)."""
    assert_refused_and_trains_like_plain(
        SeedsInTheStep, rf"`{named}` at .* seeds torch", "seeds torch", constant=constant, how=how, fused=True
    )


def test_a_step_reading_an_element_of_a_list_it_appends_to_is_refused_by_name_and_trains_like_plain():
    assert_refused_and_trains_like_plain(
        ReadsWhatItAppended,
        "(a list it appends to|which the step appends to)",
        "`self.history`",
        steps=20,
        fused=True,
    )


def test_stochastic_weight_averaging_makes_its_scheduler_mid_fit_and_the_fit_is_bitwise_the_baseline():
    """SWALR, made at SWA's first epoch, wraps the optimizer's step after the callback did (a crash
    once); its annealed LR reaches the replays through the LR tensors."""
    from lightning.pytorch.callbacks import StochasticWeightAveraging

    def swa():
        return StochasticWeightAveraging(swa_lrs=1e-3, swa_epoch_start=1, annealing_epochs=2)

    base = fit(TinyMLP, [swa()], steps=90, baseline=True, fused=True)
    cb = L2GraphCallback(prefetch="off")
    run = fit(TinyMLP, [swa(), cb], steps=90, fused=True)
    assert cb.summary()["captured"], cb.summary()
    assert_same_run(base, run)


def test_a_backbone_unfrozen_mid_fit_is_captured_again_and_the_fit_is_bitwise_the_baseline():
    """The group BackboneFinetuning adds gets the optimizer's defaults (capturable=False): made
    capturable before its first step, the step is captured again instead of falling back to eager."""
    from lightning.pytorch.callbacks import BackboneFinetuning

    def unfreezing():
        return BackboneFinetuning(unfreeze_backbone_at_epoch=1, lambda_func=lambda epoch: 1.5)

    base = fit(Finetuned, [unfreezing()], steps=90, baseline=True, fused=True, lr=1e-3)
    cb = L2GraphCallback(prefetch="off", recapture_wait=False)  # captures counted
    run = fit(Finetuned, [unfreezing(), cb], steps=90, fused=True, lr=1e-3)
    summary = cb.summary()
    assert summary["captured"] and summary["captures"] == 2, summary
    assert_same_run(base, run)


@pytest.mark.parametrize("what", ["layer", "grad-hook", "appends", "late-hook"])
def test_code_beyond_the_steps_source_is_followed_and_the_fit_is_bitwise_the_baseline(what):
    """A custom layer's forward and a gradient hook read module-level numbers an epoch hook raises
    (captured again each epoch), a hook appends to a module-level list (re-appended per replay), and
    a callback adds a gradient clamp at epoch 1 (captured again then)."""
    from tests import called_code_models as models

    def late():
        return models.ChangesHooksAtEpoch1("add-tensor-hook")

    cls, kwargs, callbacks, captures = {
        "layer": (models.ScaledHead, {}, [models.Raise], 3),
        "grad-hook": (models.Hooked, {"hook": "tensor"}, [models.Raise], 3),
        "appends": (models.Hooked, {"hook": "appends"}, [], 1),
        "late-hook": (TinyMLP, {}, [late], 2),
    }[what]
    models.reset()
    cb = L2GraphCallback(prefetch="off", recapture_wait=False)  # captures counted
    run = fit(cls, [*(c() for c in callbacks), cb], steps=90, **kwargs)
    got = list(models.SEEN)
    models.reset()
    base = list(
        fit(cls, [c() for c in callbacks], steps=90, baseline=True, **kwargs)
    )  # after the callback fit
    expected = list(models.SEEN)
    models.SEEN[:] = got
    summary = cb.summary()
    assert summary["captured"] and summary["captures"] == captures, summary
    assert_same_run(base, run)
    assert len(models.SEEN) == len(expected) and all(torch.equal(a, b) for a, b in zip(expected, models.SEEN))
    models.reset()


def test_a_logged_number_a_replay_cannot_recompute_ends_the_capture_and_the_fit_is_bitwise_plain():
    """The capture step logs its own number; the steps after it run eagerly (replays would repeat it)."""
    plain = fit(LogsAnUnrecomputableNumber, [], steps=20, fused=True)
    cb = L2GraphCallback(prefetch="off", recapture_wait=False)  # captures counted
    with pytest.warns(UserWarning, match="cannot recompute"):
        run = fit(LogsAnUnrecomputableNumber, [cb], steps=20, fused=True)
    assert "examples_seen" in cb.summary()["reason"] and cb.captures == 1, cb.summary()
    assert_same_run(plain, run)


def shuffled_loader():
    """240 samples in shuffled batches of 8: a `RandomSampler` draws each epoch's order from torch's
    global CPU generator, so whatever else draws from it changes the later epochs' batches."""
    g = torch.Generator().manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(240, 512, generator=g), torch.randn(240, generator=g))
    return torch.utils.data.DataLoader(data, batch_size=8, shuffle=True)


class AugmentsOnARareHostCoin(TinyMLP):
    """An augmentation applied with probability 0.1, decided by a coin drawn on the host (no `device`):
    a graph keeps the capture's decision. The coin is 0 at most steps, so the warm-up steps' traces
    (which hold the host values the ops read) often agree, and only the generator's state shows the
    draw (before the snapshot of that state, such a fit could be captured and never flip)."""

    def training_step(self, batch, batch_idx):
        x, y = batch
        if torch.bernoulli(torch.full((), 0.1)):
            x = x.flip(0)
            y = y.flip(0)
        return super().training_step((x, y), batch_idx)


class DrawsOnTheHostForNothing(TinyMLP):
    """Draws from torch's global CPU generator and uses the draw on the host only (which sample to look
    at): nothing reaches the GPU, but plain training moves the generator on, and the shuffle with it."""

    def training_step(self, batch, batch_idx):
        look_at = int(torch.randint(len(batch[0]), ()))
        if batch_idx == -1:  # never: the draw is what matters
            self.print(look_at)
        return super().training_step(batch, batch_idx)


@pytest.mark.parametrize(
    "model_cls", [AugmentsOnARareHostCoin, DrawsOnTheHostForNothing], ids=["rare-branch", "host-only"]
)
def test_a_step_drawing_from_torchs_global_cpu_generator_is_refused_by_name_and_trains_like_plain(model_cls):
    assert_refused_and_trains_like_plain(
        model_cls,
        r"torch's global CPU generator",
        "torch's global CPU generator",
        steps=90,
        loader=shuffled_loader,
        fused=True,
    )


class NoiseFromItsOwnCudaGenerator(TinyMLP):
    """Input noise drawn from a CUDA generator the module holds (seeded once, for noise reproducible
    apart from the global seed). A replay cannot advance it (PyTorch fails the capture: "Attempt to
    increase offset for a CUDA generator not in capture mode"), so the step is refused before capture."""

    def on_fit_start(self):
        self.noise = torch.Generator(device=self.device).manual_seed(7)

    def training_step(self, batch, batch_idx):
        x, y = batch
        x = x + 0.1 * torch.randn(x.shape, device=x.device, generator=self.noise)
        return super().training_step((x, y), batch_idx)


def test_a_draw_from_a_cuda_generator_of_the_steps_own_is_refused_by_name_and_trains_like_plain():
    assert_refused_and_trains_like_plain(
        NoiseFromItsOwnCudaGenerator, r"generator of the step's own", "`generator=`", steps=90, fused=True
    )


class DropoutReseededEachEpoch(TinyMLP):
    """Dropout in the step, and the global seed set again at each epoch's start (a per-epoch
    reproducibility idiom): replays draw from the CUDA generator as reseeded, as eager steps do."""

    def on_train_epoch_start(self):
        torch.manual_seed(100 + self.current_epoch)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return super().training_step((torch.nn.functional.dropout(x, 0.2, training=True), y), batch_idx)


def test_dropout_reseeded_at_each_epoch_start_is_captured_once_and_bitwise_the_baseline():
    assert_captured_like_baseline(DropoutReseededEachEpoch, 1, steps=90, fused=True)


@pytest.mark.parametrize(("model_cls", "change"), CONFIG_CHANGES.values(), ids=CONFIG_CHANGES.keys())
def test_a_config_value_changed_mid_fit_is_captured_again_and_bitwise_the_baseline(model_cls, change):
    """Silent on the CPU emulator before the step source compared chains rooted at module-level names
    and the arguments partials bind: the replays kept the capture's weight."""
    assert_captured_like_baseline(
        model_cls,
        3,
        r"values the step reads changed|the arguments `functools.partial` binds changed",
        callbacks=lambda: [SetsTheConfigEachEpoch(change)],
        operand_scalars=False,  # baked in: each change is seen
        steps=90,
    )


class RecordsLogged(Callback):
    """The logged values of `names` after every batch."""

    def __init__(self, *names):
        self.names, self.values = names, []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.values.append(tuple(float(trainer.callback_metrics[n]) for n in self.names))


def test_logged_module_level_numbers_follow_the_epoch_hook_in_replays():
    """Silent on the CPU emulator before logged expressions were evaluated against the module's
    globals: the replays logged the capture's numbers."""
    logged = {}
    for variant in ("callback", "baseline"):  # the baseline switches where the callback fit did
        seen = RecordsLogged("temperature", "config_weight")
        callbacks = [SetsTheLoggedNumbersEachEpoch(), seen]
        if variant == "callback":
            cb = L2GraphCallback(prefetch="off")
            callbacks.append(cb)
        list(fit(LogsModuleLevelNumbers, callbacks, steps=90, baseline=variant == "baseline"))
        logged[variant] = seen.values
    summary = cb.summary()
    assert summary["captured"] and summary["captures"] == 1, summary
    assert logged["callback"] == logged["baseline"]
    assert logged["callback"][30] == (0.5, 2.0)


def test_a_plain_tensor_attribute_moved_to_other_memory_is_captured_again_and_bitwise_the_baseline():
    """`self.scale.data = ...` between epochs keeps the tensor object: a graph would go on reading the
    old memory (shown on the CPU emulator once it replayed through aliases of the capture's memory)."""
    assert_captured_like_baseline(
        ScalesByAPlainTensor,
        3,
        "hold other memory than at capture",
        callbacks=lambda: [MovesTheScaleEachEpoch()],
        steps=90,
    )


class MovesAnAdamMomentAtStep12(Callback):
    """``exp_avg.data = ...``: the same optimizer-state tensor object on other memory."""

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if batch_idx == 12:
            moment = trainer.optimizers[0].state[next(pl_module.parameters())]["exp_avg"]
            moment.data = moment * 0.5


def test_an_optimizer_state_tensor_moved_to_other_memory_is_made_eagerly_then_captured_again_bitwise():
    """Compared by identity alone before, the replays went on updating the old memory (silent on the
    CPU emulator: the losses left the plain fit's at step 14)."""
    base = fit(TinyMLP, [MovesAnAdamMomentAtStep12()], baseline=True, fused=True)
    cb = L2GraphCallback(prefetch="off", recapture_wait=False)  # captures counted
    with pytest.warns(UserWarning, match="given other memory"):
        run = fit(TinyMLP, [MovesAnAdamMomentAtStep12(), cb], fused=True)
    summary = cb.summary()
    assert summary["captured"] and summary["captures"] == 2 and summary["fallback_steps"] == 1, summary
    assert_same_run(base, run)


def test_adagrad_is_captured_and_bitwise_the_plain_fit():
    """Adagrad (no capturable mode) on CUDA: its counters on the device, its step count unread where its
    LR does not decay (l2lightning.graph.optim._adagrad_step_count_unread), foreach as torch picks it for CUDA
    parameters: captured, checked, and bitwise the plain fit itself."""
    plain = fit(AdagradMLP, [], steps=30)
    cb = L2GraphCallback(prefetch="off", check_share=1.0)
    run = fit(AdagradMLP, [cb], steps=30)
    summary = cb.summary()
    assert summary["captured"] and summary["fallback_steps"] == 0 and summary["reason"] is None, summary
    assert summary["replay_check"]["checks"] >= 4 and summary["replay_check"]["mismatches"] == 0, summary
    assert_same_run(plain, run)
