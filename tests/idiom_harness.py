"""Fit an idiom module (``tests/idiom_modules.py``) plain, against the capturable baseline, or with
``L2GraphCallback``, and compare the runs bit for bit (issue 12).

* ``run_idiom(name, variant)``: one seeded, deterministic ``Trainer.fit``; variant ``"plain"`` (no
  callback), ``"baseline"`` (plain, with every optimizer passed through ``make_capturable`` at
  ``on_fit_start``: the configuration the callback trains with) or ``"callback"``
  (``L2GraphCallback(**idiom.callback_kwargs)``). A recorder keeps each step's loss, the
  ``trainer.callback_metrics`` at the start and at the end of each step and at the end of the fit,
  the final ``state_dict``, what the module printed, and the per-step wall time.
* ``compare(a, b)``: None when losses, logged metrics, final parameters and printed text are
  bitwise equal (NaN equals NaN), else the first difference in one line.
* ``judge(name)``: plain, baseline and callback runs; the callback run is compared with the baseline
  if it captured, else with the plain run; then a second plain fit in the same process must equal
  the first (a failed or refused capture leaves the process as it found it).

A callback run that raises ``ValueError``/``TypeError`` before its first step is a refusal by name
(e.g. manual optimization): the user removes the callback, so the run is then a plain fit of a fresh
module in the same process, with ``captured=False`` and the exception text as ``reason``. Any other
exception is a crash (``captured=False``, ``error`` set, never equal).
"""

from __future__ import annotations

import contextlib
import gc
import io
import math
import os
import time
import traceback
import warnings
from dataclasses import dataclass, field
from typing import Any

import torch
from lightning.pytorch import Callback, Trainer, seed_everything

from tests.idiom_modules import IDIOMS
from tests.idiom_variants import IDIOM_VARIANTS

# Lightning's deterministic=True sets this too, but only once a Trainer exists; cuBLAS reads it when
# its first handle is created.
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

VARIANTS = ("plain", "baseline", "callback")
FIRST_TIMED_STEP = 10
# The callback's own timing metrics (logged to loggers, never to callback_metrics today): not the
# user's values, so never compared.
IGNORED_METRIC_PREFIXES = ("l2/",)


@dataclass
class IdiomRun:
    """One fit of an idiom module; tensors are on the CPU."""

    name: str
    variant: str
    losses: list[torch.Tensor | None] = field(default_factory=list)
    # (when, callback_metrics snapshot): "start of step i", "end of step i", "end of fit"
    metrics: list[tuple[str, dict[str, Any]]] = field(default_factory=list)
    params: dict[str, torch.Tensor] = field(default_factory=dict)
    stdout: str = ""
    step_ms: float | None = None
    timed_steps: int = 0
    captured: bool | None = None  # callback variant only
    reason: str | None = None  # callback variant: summary()["reason"] or the refusal's text
    refused_at_setup: bool = False
    error: str | None = None  # the fit crashed (a bug, never a refusal)
    summary: dict[str, Any] = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)
    note: str | None = None  # e.g. make_capturable skipped off CUDA
    loops: dict[str, Any] = field(default_factory=dict)  # loop_state(trainer) after the fit
    # the wall seconds of the whole `trainer.fit` (its GPU work finished): what the user waits for, warm-up,
    # capture and checks included, which the per-step time from `first_timed` leaves out
    fit_s: float | None = None

    @property
    def steps(self) -> int:
        return len(self.losses)


def loop_state(trainer: Trainer) -> dict[str, Any]:
    """The fit loop's progress (what a checkpoint saves under `loops`) as {dotted key: value}."""

    def flat(state: dict[str, Any], prefix: str) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for key, value in state.items():
            if isinstance(value, dict):
                out.update(flat(value, f"{prefix}{key}."))
            else:
                out[f"{prefix}{key}"] = value
        return out

    return flat(trainer.fit_loop.state_dict(), "")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _snapshot(trainer: Trainer) -> dict[str, Any]:
    out = {}
    for key, value in trainer.callback_metrics.items():
        if key.startswith(IGNORED_METRIC_PREFIXES):
            continue
        out[key] = value.detach().clone() if isinstance(value, torch.Tensor) else value
    return out


class Recorder(Callback):
    """Per-step loss and logged metrics, and the wall time from the first batch that is both batch
    ``first_timed`` or later and optimizer step ``first_timed`` or later (under gradient accumulation
    the capture comes at an optimizer step, several batches in: the clock starts after it) to the last.

    Host syncs only at fit start and right before reading the end time; everything recorded stays on
    the device until the fit is over. Callbacks' ``on_train_batch_end`` runs before the module's, so
    what the module logs there shows in the next step's "start" snapshot (and in "end of fit").
    """

    def __init__(self, first_timed: int = FIRST_TIMED_STEP) -> None:
        self.first_timed = first_timed
        self.losses: list[torch.Tensor | None] = []
        self.metrics: list[tuple[str, dict[str, Any]]] = []
        self.started = 0
        self.ended = 0
        self.t0: float | None = None
        self.t_end: float | None = None
        self.timed_until = 0
        self.timed_from = 0  # the batch the clock started at

    def on_fit_start(self, trainer, pl_module):
        _sync(trainer.strategy.root_device)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if self.t0 is None and self.started >= self.first_timed and trainer.global_step >= self.first_timed:
            self.t0 = time.perf_counter()
            self.timed_from = self.started
        self.metrics.append((f"start of step {self.started}", _snapshot(trainer)))
        self.started += 1

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
        self.losses.append(loss.detach().clone() if isinstance(loss, torch.Tensor) else None)
        self.metrics.append((f"end of step {self.ended}", _snapshot(trainer)))
        self.ended += 1
        if 0 < trainer.max_steps <= trainer.global_step:
            self._stop_clock(trainer)

    def on_train_end(self, trainer, pl_module):
        if self.t_end is None:
            self._stop_clock(trainer)
        self.metrics.append(("end of fit", _snapshot(trainer)))

    def _stop_clock(self, trainer: Trainer) -> None:
        _sync(trainer.strategy.root_device)
        self.t_end = time.perf_counter()
        self.timed_until = self.ended

    def step_ms(self) -> tuple[float | None, int]:
        timed = self.timed_until - self.timed_from
        if self.t0 is None or self.t_end is None or timed <= 0:
            return None, 0
        return (self.t_end - self.t0) * 1000.0 / timed, timed


class MakeCapturable(Callback):
    """The baseline: every optimizer switched to the callback's configuration at global step `step`
    (the callback fit's ``capturable_from_step``; None: never), as ``l2lightning.CapturableFrom``."""

    def __init__(self, step: int | None = 0) -> None:
        self.note: str | None = None
        self.step = step

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        from l2lightning import make_capturable

        if self.step is None or trainer.global_step < self.step:
            return
        device = trainer.strategy.root_device
        if device.type not in ("cuda", *_EXTRA_CAPTURABLE_DEVICES):
            # make_capturable needs CUDA parameters; off CUDA the callback never captures either.
            self.note = f"make_capturable skipped: the Trainer runs on {device}"
            return
        for optimizer in trainer.optimizers:
            make_capturable(optimizer, device)  # a no-op once switched


# Devices other than CUDA on which the baseline switches (the CPU tests' graph emulator adds "cpu")
_EXTRA_CAPTURABLE_DEVICES: tuple[str, ...] = ()


def _cpu(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach().to("cpu", copy=True)
    if isinstance(value, dict):
        return {k: _cpu(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_cpu(v) for v in value)
    return value


def _short(exc: BaseException, limit: int = 400) -> str:
    text = f"{type(exc).__name__}: {exc}".strip().replace("\n", " ")
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _plain_summary(summary: dict[str, Any]) -> dict[str, Any]:
    keep = (
        "captured",
        "reason",
        "capture_step",
        "capturable_from_step",
        "captures",
        "graphs",
        "eager_step_ms",
        "graph_step_ms",
        "replay_speedup",
        "verify",
    )
    out = {k: summary.get(k) for k in keep}
    out["fallback_steps"] = summary.get("fallback_steps")
    out["fallback_causes"] = list(summary.get("fallback_causes") or [])
    out["graph_pool_mib"] = summary.get("graph_pool_mib")
    out["replay_check"] = summary.get("replay_check")
    # what the capture cost the fit (wall seconds), beside its per-step times: the fit's own accounting
    for key in ("tuning_s", "capture_s", "compile_s", "recapture_s", "recaptures", "recapture_wait_steps"):
        out[key] = summary.get(key)
    return out


def default_accelerator() -> str:
    return "gpu" if torch.cuda.is_available() else "cpu"


def run_idiom(
    name: str, variant: str, steps: int = 60, accelerator: str = "gpu", switch_step: int | None = 0
) -> IdiomRun:
    """Fit idiom `name` for `steps` batches as `variant` ("plain", "baseline" or "callback"); the
    baseline switches to make_capturable's configuration at `switch_step` (the callback fit's
    ``capturable_from_step``)."""
    if variant not in VARIANTS:
        raise ValueError(f"variant must be one of {VARIANTS}, got {variant!r}")
    flags = _global_flags()
    try:
        return _run_idiom(name, variant, steps, accelerator, switch_step)
    finally:
        _restore_global_flags(flags)


def _global_flags() -> tuple[bool, bool, bool, bool]:
    return (
        torch.are_deterministic_algorithms_enabled(),
        torch.is_deterministic_algorithms_warn_only_enabled(),
        torch.backends.cudnn.deterministic,
        torch.backends.cudnn.benchmark,
    )


def _restore_global_flags(flags: tuple[bool, bool, bool, bool]) -> None:
    """Trainer(deterministic=True) sets these process-wide and leaves them set; put them back."""
    torch.use_deterministic_algorithms(flags[0], warn_only=flags[1])
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = flags[2], flags[3]


def _run_idiom(name: str, variant: str, steps: int, accelerator: str, switch_step: int | None) -> IdiomRun:
    idiom = IDIOMS[name] if name in IDIOMS else IDIOM_VARIANTS[name]
    seed_everything(0, verbose=False)
    # Trainer(deterministic=True) below turns this into warn_only=False: a nondeterministic op raises.
    torch.use_deterministic_algorithms(True, warn_only=True)
    module = idiom.make_module()
    loader = idiom.make_loader()
    recorder = Recorder(first_timed=min(FIRST_TIMED_STEP, max(1, steps // 2)))
    callbacks: list[Callback] = []
    cb = baseline = None
    if variant == "baseline":
        baseline = MakeCapturable(switch_step)
        callbacks.append(baseline)
    elif variant == "callback":
        from l2lightning import L2GraphCallback

        cb = L2GraphCallback(**idiom.callback_kwargs)
        callbacks.append(cb)
    callbacks.append(recorder)  # last: it sees what the other callbacks did at batch end
    trainer_kwargs = {k: v for k, v in idiom.trainer_kwargs.items() if k != "max_steps"}
    trainer = Trainer(
        accelerator=accelerator,
        devices=1,
        max_steps=steps * idiom.optimizer_steps_per_batch,
        deterministic=True,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=callbacks,
        **trainer_kwargs,
    )
    run = IdiomRun(name=name, variant=variant)
    out = io.StringIO()
    error: BaseException | None = None
    tb = ""
    with warnings.catch_warnings(record=True) as caught, contextlib.redirect_stdout(out):
        warnings.simplefilter("always")
        fit_started = time.perf_counter()
        try:
            trainer.fit(module, loader)
            _sync(trainer.strategy.root_device)
            run.fit_s = time.perf_counter() - fit_started
        except Exception as exc:  # judged below: a refusal by name, or a crash
            error = exc
            tb = traceback.format_exc()
    run.warnings = sorted({str(w.message)[:500] for w in caught})
    run.stdout = out.getvalue()
    run.losses = _cpu(recorder.losses)
    run.metrics = _cpu(recorder.metrics)
    run.params = _cpu(dict(module.state_dict()))
    run.loops = loop_state(trainer)
    run.step_ms, run.timed_steps = recorder.step_ms()
    if baseline is not None:
        run.note = baseline.note
    if cb is not None:
        summary = cb.summary()
        run.summary = _plain_summary(summary)
        run.captured = bool(summary.get("captured"))
        run.reason = summary.get("reason")
    del trainer, module, loader, cb
    _release()
    if error is None:
        return run
    if variant == "callback" and recorder.started == 0 and refused_by_the_callback(error):
        # Refused by name before any step: what the user runs next is a plain fit, in this process.
        refit = run_idiom(name, "plain", steps=steps, accelerator=accelerator)
        refit.variant = "callback"
        refit.captured = False
        refit.refused_at_setup = True
        refit.reason = _short(error)
        refit.warnings = sorted(set(run.warnings) | set(refit.warnings))
        refit.summary = run.summary
        return refit
    if variant != "callback":
        raise error
    run.captured = False
    run.error = f"crashed at step {recorder.started}: {_short(error)}"
    run.reason = run.error
    run.summary["traceback"] = tb[-4000:]
    return run


def refused_by_the_callback(error: BaseException) -> bool:
    """Whether `error` is the callback refusing the fit by name (a strategy it does not support): a
    ValueError or TypeError it raises itself, saying so. Any other exception before the first step is
    a crash, even a TypeError: Lightning's StochasticWeightAveraging failing to deep-copy the module
    (``cannot pickle 'module' object``) was once counted as a refusal and judged equal."""
    if not isinstance(error, (ValueError, TypeError)) or "L2GraphCallback" not in str(error):
        return False
    frames = traceback.extract_tb(error.__traceback__)
    return bool(frames) and f"{os.sep}l2lightning{os.sep}" in frames[-1].filename


def _release() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


# ------------------------------------------------------------------------------------ comparison
def _same_tensor(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if torch.equal(a, b):
        return True
    if not (a.is_floating_point() or a.is_complex()):
        return False
    both_nan = torch.isnan(a) & torch.isnan(b)
    return bool(((a == b) | both_nan).all())


def _same_value(a: Any, b: Any) -> bool:
    if a is None or b is None:
        return a is None and b is None
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return _same_tensor(a, b)
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return False  # a tensor where the other run logged a Python number
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    return a == b


def _show(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        if value.numel() == 1:
            return f"{value.item()!r} ({value.dtype})"
        return f"tensor{tuple(value.shape)} {value.dtype}"
    return repr(value)


def compare(a: IdiomRun, b: IdiomRun) -> str | None:
    """None if the two runs are bitwise equal, else a one-line description of the first difference."""
    for run in (a, b):
        if run.error:
            return f"{run.variant} run: {run.error}"
    if a.steps != b.steps:
        return f"{a.steps} steps ({a.variant}) vs {b.steps} steps ({b.variant})"
    for i, (x, y) in enumerate(zip(a.losses, b.losses)):
        if not _same_value(x, y):
            return f"loss at step {i}: {_show(x)} ({a.variant}) vs {_show(y)} ({b.variant})"
    if len(a.metrics) != len(b.metrics):
        return f"{len(a.metrics)} metric snapshots ({a.variant}) vs {len(b.metrics)} ({b.variant})"
    for (when, ma), (_, mb) in zip(a.metrics, b.metrics):
        if ma.keys() != mb.keys():
            only_a, only_b = sorted(ma.keys() - mb.keys()), sorted(mb.keys() - ma.keys())
            return f"logged keys at {when}: only in {a.variant} {only_a}, only in {b.variant} {only_b}"
        for key in ma:
            if not _same_value(ma[key], mb[key]):
                return f"logged {key!r} at {when}: {_show(ma[key])} ({a.variant}) vs {_show(mb[key])} ({b.variant})"
    if a.params.keys() != b.params.keys():
        return f"state_dict keys differ: {sorted(a.params.keys() ^ b.params.keys())}"
    for key in a.params:
        if not _same_value(a.params[key], b.params[key]):
            x, y = a.params[key], b.params[key]
            if x.shape == y.shape and x.dtype == y.dtype and x.is_floating_point():
                delta = (x.double() - y.double()).abs().max().item()
                return f"final {key!r} differs (max abs diff {delta:.3g})"
            return f"final {key!r} differs"
    for key in sorted(a.loops.keys() | b.loops.keys()):
        if a.loops.get(key) != b.loops.get(key):
            return (
                f"loop progress {key}: {a.loops.get(key)} ({a.variant}) vs {b.loops.get(key)} ({b.variant})"
            )
    if a.stdout != b.stdout:
        la, lb = a.stdout.splitlines(), b.stdout.splitlines()
        for i in range(max(len(la), len(lb))):
            x = la[i] if i < len(la) else "<none>"
            y = lb[i] if i < len(lb) else "<none>"
            if x != y:
                return f"printed line {i}: {x!r} ({a.variant}) vs {y!r} ({b.variant})"
    return None


def judge(name: str, steps: int = 60, accelerator: str = "gpu", recheck_plain: bool = True) -> dict[str, Any]:
    """Plain, baseline and callback fits of idiom `name`, judged.

    Returns ``module, captured, reason, equal, plain_ms, callback_ms`` (the benchmark's columns) and
    ``detail``: the first difference, or why the verdict is what it is (None when equal), and
    ``extra``: the step times of the baseline and of the second plain fit (the first fit in a process
    pays one-time costs), the callback's summary and warnings.
    """
    plain = run_idiom(name, "plain", steps=steps, accelerator=accelerator)
    cb = run_idiom(name, "callback", steps=steps, accelerator=accelerator)
    # the callback's optimizer ran make_capturable's configuration from its first capture on
    switch_step = cb.summary.get("capturable_from_step") if cb.summary else None
    try:
        baseline: IdiomRun | None = run_idiom(
            name, "baseline", steps=steps, accelerator=accelerator, switch_step=switch_step
        )
        baseline_error = None
    except Exception as exc:
        baseline, baseline_error = None, _short(exc)
    captured = bool(cb.captured)
    if cb.error:
        detail: str | None = cb.error
    elif captured and baseline is None:
        detail = f"the make_capturable baseline failed: {baseline_error}"
    else:
        reference = baseline if captured and baseline is not None else plain
        detail = compare(cb, reference)
        if detail:
            detail = f"callback vs {reference.variant}: {detail}"
    again: IdiomRun | None = None
    if detail is None and recheck_plain and not cb.refused_at_setup:
        again = run_idiom(name, "plain", steps=steps, accelerator=accelerator)
        diff = compare(again, plain)
        if diff:
            detail = f"a plain fit after the callback's fit differs from the first plain fit: {diff}"
    return {
        "module": name,
        "captured": captured,
        "reason": cb.reason or "",
        "equal": detail is None,
        "plain_ms": plain.step_ms,
        "callback_ms": cb.step_ms,
        "detail": detail,
        "extra": {
            "expect": (IDIOMS[name] if name in IDIOMS else IDIOM_VARIANTS[name]).expect,
            "baseline_ms": baseline.step_ms if baseline is not None else None,
            "plain_again_ms": again.step_ms if again is not None else None,
            "plain_fit_s": plain.fit_s,
            "callback_fit_s": cb.fit_s,
            "plain_again_fit_s": again.fit_s if again is not None else None,
            "baseline_error": baseline_error,
            "baseline_note": baseline.note if baseline is not None else None,
            "refused_at_setup": cb.refused_at_setup,
            "steps": cb.steps,
            "timed_steps": cb.timed_steps,
            "summary": cb.summary,
            "callback_warnings": [w for w in cb.warnings if "L2GraphCallback" in w or "l2lightning" in w],
        },
    }
