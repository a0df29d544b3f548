"""Lightning runners: ``Trainer.fit`` per repeat, with or without L2GraphCallback, timed by StepTimer.

The variants a user would actually pick (plain Lightning, the callback with and without prefetch)
go through the whole Lightning loop, so their step times include Lightning's per-step work.
Lightning steps are timed from ``on_train_batch_start`` to the next by
:class:`l2lightning.step_timer.StepTimer`, after ``BenchSettings.lightning_skip`` warm-up (and
capture) steps. The Trainer, loader and quiet logging here are shared with
benchmarks/bench_host_overhead.py.
"""

from __future__ import annotations

import contextlib
import json
import logging
import warnings
from collections.abc import Iterator
from typing import Any

from l2lightning.step_timer import StepTimer
from l2lightning.tools.bench.families import build_family, family_batches
from l2lightning.tools.bench.mlp import build_model, lightning_module, make_batches
from l2lightning.tools.bench.runners import Runner
from l2lightning.tools.bench.settings import BenchSettings


class LightningRunner(Runner):
    """``Trainer.fit`` per repeat (optionally with L2GraphCallback), timed by a step-timer callback."""

    PREFETCH = {
        "lightning_eager": None,
        "callback_off": "off",
        "callback_auto": "auto",
        "callback_decoy": "decoy",
    }

    def setup(self) -> None:
        self.module, self.batches = self._module_and_batches()
        self.callback_summaries: list[dict[str, Any]] = []
        if self.variant != "lightning_eager":
            from l2lightning import L2GraphCallback  # noqa: F401  (fail in setup, with the reason, if missing)

    def _module_and_batches(self) -> tuple[Any, list[Any]]:
        """The benchmark's MLP in a LightningModule, and its batches on the device."""
        case = self.case
        model = build_model(case.width, case.depth, self.device, self.dtype)
        module = lightning_module(model, self.settings.lr, self.settings.optimizer)
        return module, make_batches(case.width, case.batch, self.device, self.dtype)

    def run(self, steps: int) -> list[float]:
        skip = self.settings.lightning_skip
        timer = StepTimer()
        callbacks: list[Any] = [timer]
        cb = None
        prefetch = self.PREFETCH[self.variant]
        if prefetch is not None:
            from l2lightning import L2GraphCallback

            cb = L2GraphCallback(prefetch=prefetch)
            callbacks.append(cb)
        with quiet_lightning():
            trainer = lightning_trainer(self.settings, skip + steps + 1, callbacks)
            trainer.fit(self.module, cycled_loader(self.batches, skip + steps + 1))
        step_ms = timer.window_ms(skip, steps)  # waits for the device
        if cb is not None:
            summary = callback_summary(cb)
            self.callback_summaries.append(summary)
            self.info["callback"] = summary
        return [ms * 1e3 for ms in step_ms]


class FamilyRunner(LightningRunner):
    """A Lightning variant of a family case: the family's module, batches drawn from its data module.

    Fitted and timed exactly as the MLP's Lightning variants (:meth:`LightningRunner.run`).
    """

    def _module_and_batches(self) -> tuple[Any, list[Any]]:
        case = self.case
        case.prepare()
        module, datamodule = build_family(case.cfg)
        self.info["optimizer"] = "the module's configure_optimizers()"
        return module, family_batches(datamodule, self.device)


def callback_summary(cb: Any) -> dict[str, Any]:
    """The parts of ``L2GraphCallback.summary()`` the report keeps (JSON-safe); isolated on purpose."""
    keys = (
        "captured",
        "reason",
        "capture_step",
        "eager_step_ms",
        "graph_step_ms",
        "speedup",
        "plans",
        "verify",
        "fallback_steps",
        "fallback_causes",
    )
    try:
        summary = cb.summary()
    except Exception as exc:
        return {"summary_error": f"{type(exc).__name__}: {exc}"}
    if not isinstance(summary, dict):
        return {"summary": str(summary)}
    return {k: json.loads(json.dumps(summary.get(k), default=str)) for k in keys if k in summary}


def cycled_loader(batches: list[Any], length: int) -> Any:
    """A DataLoader of `length` items cycling through `batches` (already on the device): no data pipeline is timed."""
    import torch

    class Batches(torch.utils.data.Dataset):
        def __len__(self) -> int:
            return length

        def __getitem__(self, i: int) -> Any:
            return batches[i % len(batches)]

    return torch.utils.data.DataLoader(Batches(), batch_size=None, shuffle=False, num_workers=0)


def lightning_trainer(
    settings: BenchSettings, max_steps: int, callbacks: list[Any], accelerator: str = "cuda", **overrides: Any
) -> Any:
    """The Trainer every Lightning variant fits with (`accelerator="cpu"`: the CPU tests' stand-in).

    `overrides` replace its settings (a benchmark that keeps a family's logger and progress bar).
    """
    import lightning.pytorch as pl

    settings_ = dict(
        precision="32-true",  # the model already is bf16; nothing to cast
        logger=False,
        enable_progress_bar=False,
    )
    return pl.Trainer(
        accelerator=accelerator,
        devices=[settings.device] if accelerator == "cuda" else 1,
        max_steps=max_steps,
        max_epochs=1,
        enable_checkpointing=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
        use_distributed_sampler=False,
        callbacks=callbacks,
        **{**settings_, **overrides},
    )


@contextlib.contextmanager
def quiet_lightning() -> Iterator[None]:
    """Lightning's INFO lines and the warnings every harness fit would repeat, silenced for the block."""
    loggers = [logging.getLogger(n) for n in ("lightning.pytorch", "lightning.fabric", "pytorch_lightning")]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.WARNING)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*does not have many workers.*")
            warnings.filterwarnings("ignore", message=".*smaller than the logging interval.*")
            warnings.filterwarnings("ignore", message=".*LeafSpec.*")
            # family modules define validation_step; the harness's fits never validate
            warnings.filterwarnings("ignore", message=".*validation_step.*but have no .val_dataloader.*")
            yield
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)
