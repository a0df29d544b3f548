"""Host overhead of a captured `Trainer.fit` step on the small model families (issue 13).

What it measures, per packaged small family (``--families``, default mlp_stack, rl_policy,
recommender, conv_stack) and batch size (``--batches``, default 4, 8, 16), in one process with the
variants interleaved over ``--rounds`` rounds (medians of per-step times, then of rounds):

- ``lightning_eager_ms``: plain Lightning ``Trainer.fit`` per-step time, with the progress bar and
  the loggers the family's packaged config has (``conf/trainer/default.yaml``: tqdm bar refreshed
  every step, CSVLogger, ``log_every_n_steps``); checkpointing, model summary and validation off.
- ``callback_step_ms``: the same fit with ``L2GraphCallback(prefetch="off")``; only the steps after
  the capture step are timed.
- ``replay_ms``: the callback's own CUDA-event time of one graph replay (``summary()["graph_step_ms"]``).
- ``floor_ms``: the callback's per-step ``Trainer.fit`` time on a 1->1 Linear, batch 1, no logger, no
  progress bar, no ``self.log`` (the harness's BenchModule): Lightning's loop floor, in this process.
- ``lightning_bare_ms``: plain
  Lightning's per-step ``Trainer.fit`` time when the step does nothing at all (manual optimization, a
  ``training_step`` that returns None, the floor's loader, no logger or progress bar): Lightning's own
  loop and hook dispatch, which no design that keeps Lightning's per-step loop (and so its per-step
  hooks) can go under. ``floor_ms - lightning_bare_ms`` is the callback's own per-step path on the
  floor's module: the most that running several optimizer steps per replay could remove per step.
- ``raw_graph_loop_ms`` (rl_policy only): a hand-written whole-update CUDA graph in a plain PyTorch
  loop (LeanRL's method: capturable AdamW, ``torch.cuda.graph`` around zero_grad, forward, loss,
  backward, step; static input buffers the next batch is copied into; warm-up on a side stream),
  timed per step with CUDA events.
- ``compile_ro_ms`` (rl_policy only): ``bench._raise_compile_limits()
        module.compile(mode="reduce-overhead", dynamic=False)`` in a plain PyTorch
  loop with fused AdamW, per-step CUDA-event time.

How: modules, data and optimizers come from the harness's builders (``l2lightning.tools.bench.run``:
``compose_family``, ``build_family``, ``family_batches``, ``module_optimizer``, ``_loader``,
``time_steps``, ``_lightning_module``, ``make_batches``, ``_trainer``). As in the
harness, ``FAMILY_BATCHES`` batches are drawn from the family's data module once and cycled, so the
family's own data pipeline (CartPole rollouts, synthetic images) is not timed; unlike the harness
they stay on the host, so every step pays Lightning's host-to-device batch copy as a user's fit does.
A ``Trainer.fit`` step is timed by ``l2lightning.step_timer.StepTimer``: from one ``on_train_batch_start`` to the next (CUDA events on a GPU:
in a host-bound loop their spacing is the host's wall time; ``perf_counter`` on the CPU).

The profile (``host_profile.json``): one more callback fit per family at batch 4 and 16 runs under
cProfile for ``--profile-steps`` steps after the capture; every function's own time is put in one
bucket (data loading/collation, host-to-device batch copy, Lightning loop and hook dispatch,
``self.log``/logger connector, progress bar, metric updates, the callback's replay path, host syncs,
other) by its file, or, for generic code (torch, builtins, lightning_utilities, the family modules),
split over its callers in proportion to the time each caller spent in it. cProfile slows Python
down, so read the buckets as shares; ``profiled_step_ms`` beside them is the profiled step time.
``floor_profile`` in the same file profiles the floor's fit with the callback and Lightning's bare
fit over the same steps, and lists the functions whose own time per step differs most between them:
where ``floor_ms - lightning_bare_ms`` goes.

Output in ``--out``: ``host_overhead.csv`` (columns ``CSV_COLUMNS``, empty where a variant does not
apply or was not run), ``host_overhead.json`` (rows, every round, why columns are empty, the machine:
GPU name, doctor state, torch/Lightning versions, the command line), ``host_profile.json`` and
``host_overhead.png``. Results must name the machine and the command that made them (both are in
the JSON; copy the command into results/<gpu>/COMMANDS.md).

The GPU state is checked with the doctor (``l2lightning.tools.doctor``) before timing, as the harness
does; timing is refused when it is not ready unless ``--force`` (the JSON then says forced).
``--smoke`` runs on a CPU-only machine (accelerator cpu, tiny models, a few steps, no doctor load,
no CUDA-only variants: their columns stay empty and the JSON says why); it checks the plumbing, its
numbers mean nothing.

    python benchmarks/bench_host_overhead.py --out benchmarks/results/h200/host_overhead
    python benchmarks/bench_host_overhead.py --out /tmp/smoke --smoke
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import csv
import json
import math
import os
import pstats
import statistics
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if (ROOT / "l2lightning").is_dir() and str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))  # run from a checkout without installing

# host_overhead_pinned.csv (--pinned): the callback step from pageable and from pinned batches
PINNED_CSV_COLUMNS = (
    "family",
    "batch",
    "callback_step_ms",
    "callback_pinned_step_ms",
    "replay_ms",
    "floor_ms",
)
CSV_COLUMNS = (
    "family",
    "batch",
    "lightning_eager_ms",
    "callback_step_ms",
    "replay_ms",
    "floor_ms",
    "lightning_bare_ms",  # beside floor_ms: their difference is the callback's own per-step path
    "raw_graph_loop_ms",
    "compile_ro_ms",
)
SMALL_FAMILIES = ("mlp_stack", "rl_policy", "recommender", "conv_stack")
ANCHOR_FAMILIES = ("rl_policy",)  # raw_graph_loop_ms and compile_ro_ms
PROFILE_BATCHES = (4, 16)
BUCKETS = (
    "data_loading",
    "h2d_copy",
    "lightning_loop",
    "log_and_logger",
    "progress_bar",
    "metric_updates",
    "callback_replay",
    "host_sync",
    "other",
)
SKIP = 8  # untimed Trainer.fit steps at the start of every fit (the harness's lightning_skip)


# ---------------------------------------------------------------------- timing helpers
def _step_ms(timer: Any, start: int, steps: int) -> list[float]:
    """Per-step ms of the ``StepTimer``'s steps from the `start`-th on (at most `steps` of them)."""
    return [ms for _, ms in timer.step_times()][start : start + steps]


def _median(values: list[float]) -> float | None:
    values = [v for v in values if v is not None and not math.isnan(v)]
    return statistics.median(values) if values else None


class _Profiler:
    """A Lightning callback that runs cProfile from its `start`-th training batch for `steps` batches."""

    def __new__(cls, start: int, steps: int) -> Any:
        import lightning.pytorch as pl

        class StepProfiler(pl.Callback):
            def __init__(self) -> None:
                self.profile = cProfile.Profile()
                self.calls = 0
                self.t0 = self.t1 = None

            def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
                if self.calls == start:
                    self.t0 = time.perf_counter()
                    self.profile.enable()
                elif self.calls == start + steps:
                    self.profile.disable()
                    self.t1 = time.perf_counter()
                self.calls += 1

            def on_train_end(self, trainer: Any, pl_module: Any) -> None:
                if self.t0 is not None and self.t1 is None:
                    self.profile.disable()
                    self.t1 = time.perf_counter()

        return StepProfiler()


# ---------------------------------------------------------------------- fits
def _family_trainer(cfg: Any, accelerator: str, device: int, max_steps: int, callbacks: list[Any]) -> Any:
    """A Trainer with the family's packaged progress bar and loggers; no checkpoints or validation."""
    from hydra.utils import instantiate

    from l2lightning.app.train import build_loggers
    from l2lightning.tools.bench import run as bench

    tr = cfg.trainer
    callbacks = list(callbacks)
    bar = bool(tr.get("enable_progress_bar", True))
    if bar and cfg.get("callbacks") is not None and cfg.callbacks.get("progress_bar") is not None:
        callbacks.append(instantiate(cfg.callbacks.progress_bar))
    loggers = build_loggers(cfg, tr.get("logger"))
    return bench._trainer(
        SimpleNamespace(device=device),
        max_steps,
        callbacks,
        accelerator,
        precision=tr.get("precision", "32-true"),
        logger=loggers or False,
        log_every_n_steps=int(tr.get("log_every_n_steps", 50)),
        enable_progress_bar=bar,
    )


def packaged_refresh_rate(family: str) -> int | None:
    """The refresh rate of `family`'s packaged progress bar (None: the family trains without one)."""
    from l2lightning.tools.bench import run as bench

    cfg = bench.compose_family(family, 4, [])
    bar = (cfg.get("callbacks") or {}).get("progress_bar")
    if not cfg.trainer.get("enable_progress_bar", True) or bar is None:
        return None
    return int(bar.get("refresh_rate", 1))


class FamilySetup:
    """One family at one batch: its composed config and host batches (drawn once, cycled every fit)."""

    def __init__(self, family: str, batch: int, overrides: list[str], log_dir: Path) -> None:
        import torch
        from omegaconf import open_dict

        from l2lightning.tools.bench import run as bench

        self.family, self.batch = family, batch
        self.cfg = bench.compose_family(family, batch, overrides)
        with open_dict(self.cfg):
            self.cfg.paths.output_dir = str(log_dir / f"{family}_b{batch}")
        _, datamodule = bench.build_family(self.cfg)
        self.host_batches = bench.family_batches(datamodule, torch.device("cpu"))
        self._pinned: list[Any] | None = None

    def pinned_batches(self) -> list[Any]:
        """The host batches in page-locked memory (as a DataLoader with ``pin_memory=True`` yields them)."""
        import torch
        from torch.utils._pytree import tree_map

        if self._pinned is None:
            self._pinned = [
                tree_map(lambda t: t.pin_memory() if isinstance(t, torch.Tensor) else t, b)
                for b in self.host_batches
            ]
        return self._pinned

    def module(self) -> Any:
        from l2lightning.tools.bench import run as bench

        module, _ = bench.build_family(self.cfg)
        return module


def fit_family(
    setup: FamilySetup,
    args: argparse.Namespace,
    with_callback: bool,
    profile_steps: int = 0,
    pinned: bool = False,
) -> dict[str, Any]:
    """One ``Trainer.fit``; per-step ms (after capture with the callback), the callback's summary.
    `pinned`: the batches come from page-locked host memory."""
    from l2lightning import L2GraphCallback
    from l2lightning.step_timer import StepTimer
    from l2lightning.tools.bench import run as bench

    timer = StepTimer()
    callbacks: list[Any] = [timer]
    cb = L2GraphCallback(prefetch="off") if with_callback else None
    if cb is not None:
        callbacks.append(cb)
    prof = None
    # timed steps start after SKIP; the profile window after the timed window would start too late
    # for a short smoke run, so it starts at SKIP as well (a profiled fit is not timed)
    if profile_steps:
        prof = _Profiler(SKIP, profile_steps)
        callbacks.append(prof)
    total = SKIP + max(args.steps, profile_steps) + 1
    with bench._quiet_lightning(), _quiet_progress(args.smoke):
        trainer = _family_trainer(setup.cfg, args.accelerator, args.device, total, callbacks)
        batches = setup.pinned_batches() if pinned else setup.host_batches
        trainer.fit(setup.module(), bench._loader(batches, total))
    out: dict[str, Any] = {}
    start = SKIP
    if cb is not None:
        summary = bench.callback_summary(cb)
        out["callback"] = summary
        if summary.get("captured") and summary.get("capture_step") is not None:
            start = max(SKIP, int(summary["capture_step"]) + 2)
        out["replay_ms"] = summary.get("graph_step_ms")
    if prof is not None:
        out["profile"] = prof
        return out
    times = _step_ms(timer, start, args.steps)
    out["step_ms"] = _median(times)
    out["timed_steps"] = len(times)
    return out


LOG_COST_LOGS = 4  # self.log calls per step in the log-cost fits


def _logging_module(logs: int, device: Any, impl: str) -> Any:
    """The floor's 1->1 Linear, logging the loss `logs` times per step (prog_bar=True, as in the issue)."""
    import torch

    from l2lightning.tools.bench import run as bench

    torch.manual_seed(0)
    module = bench._lightning_module(torch.nn.Linear(1, 1).to(device), 1e-3, impl)
    if logs:
        plain_step = module.training_step

        def training_step(batch: Any, batch_idx: int) -> Any:
            loss = plain_step(batch, batch_idx)
            for i in range(logs):
                module.log(f"loss_{i}", loss, prog_bar=True)
            return loss

        module.training_step = training_step
    return module


def _floor_device(args: argparse.Namespace) -> Any:
    import torch

    return torch.device("cuda", args.device) if args.accelerator == "cuda" else torch.device("cpu")


def _fit_on_floor_loader(args: argparse.Namespace, module: Any, callbacks: list[Any]) -> Any:
    """Fit `module` for ``SKIP + args.steps + 1`` steps on the floor's loader (batch 1) and Trainer (no
    logger or progress bar) with `callbacks`; returns the fit's StepTimer."""
    import torch

    from l2lightning.step_timer import StepTimer
    from l2lightning.tools.bench import run as bench

    batches = bench.make_batches(1, 1, _floor_device(args), torch.float32)
    timer = StepTimer()
    total = SKIP + args.steps + 1
    with bench._quiet_lightning():
        trainer = bench._trainer(
            SimpleNamespace(device=args.device), total, [timer, *callbacks], args.accelerator
        )
        trainer.fit(module, bench._loader(batches, total))
    return timer


def fit_floor(args: argparse.Namespace, logs: int = 0, with_callback: bool = True) -> float | None:
    """``Trainer.fit`` step on a 1->1 Linear, batch 1, no logger or progress bar: with the callback and
    ``logs=0``, the loop floor; with ``logs`` self.log calls per step, the cost of logging."""
    from l2lightning import L2GraphCallback
    from l2lightning.tools.bench import run as bench

    cuda = args.accelerator == "cuda"
    module = _logging_module(logs, _floor_device(args), "fused" if cuda else "foreach")
    cb = L2GraphCallback(prefetch="off", log_timing=False) if with_callback else None
    timer = _fit_on_floor_loader(args, module, [cb] if cb else [])
    start = SKIP
    if cb is not None:
        summary = bench.callback_summary(cb)
        if summary.get("captured") and summary.get("capture_step") is not None:
            start = max(SKIP, int(summary["capture_step"]) + 2)
    return _median(_step_ms(timer, start, args.steps))


def _bare_module(device: Any) -> Any:
    """A LightningModule whose step does nothing: manual optimization, ``training_step`` returns None."""
    import lightning.pytorch as pl
    import torch

    class BareModule(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.automatic_optimization = False
            self.net = torch.nn.Linear(1, 1)

        def training_step(self, batch: Any, batch_idx: int) -> None:
            return None

        def configure_optimizers(self) -> Any:
            return torch.optim.SGD(self.parameters(), lr=0.0)  # never stepped

    return BareModule().to(device)


def fit_bare(args: argparse.Namespace) -> float | None:
    """Plain Lightning's ``Trainer.fit`` step when the step does nothing, on the floor's loader and
    Trainer: Lightning's loop and hook dispatch alone (``lightning_bare_ms``)."""
    timer = _fit_on_floor_loader(args, _bare_module(_floor_device(args)), [])
    return _median(_step_ms(timer, SKIP, args.steps))


def _automatic_module(device: Any) -> Any:
    """A LightningModule on Lightning's automatic-optimization path with the step's own work taken
    out through documented hooks: ``training_step`` returns a tensor it holds, ``backward`` and
    ``optimizer_zero_grad`` do nothing, and its optimizer's ``step`` only runs the closure. Lightning's
    default ``optimizer_step`` stays, so the step goes through what a plain fit's does (the
    ``LightningOptimizer``, the strategy and precision plugin, the closure and its hooks,
    ``ClosureResult`` with its loss division and clone), which the bare loop's manual step skips."""
    import lightning.pytorch as pl
    import torch

    class ClosureOnly(torch.optim.Optimizer):
        """An optimizer whose step runs the closure and updates nothing."""

        def __init__(self, params: Any) -> None:
            super().__init__(params, {})

        def step(self, closure: Any = None) -> Any:
            return closure() if closure is not None else None

    class AutomaticModule(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = torch.nn.Linear(1, 1)
            self.register_buffer("loss_value", torch.zeros(()))

        def training_step(self, batch: Any, batch_idx: int) -> Any:
            return self.loss_value

        def backward(self, loss: Any, *args: Any, **kwargs: Any) -> None:
            return None

        def optimizer_zero_grad(self, epoch: int, batch_idx: int, optimizer: Any) -> None:
            return None

        def configure_optimizers(self) -> Any:
            return ClosureOnly(self.parameters())

    return AutomaticModule().to(device)


def fit_automatic(args: argparse.Namespace) -> float | None:
    """Plain Lightning's ``Trainer.fit`` step on the automatic-optimization path with no work in the
    step (:func:`_automatic_module`), on the floor's loader and Trainer: ``lightning_automatic_ms``.
    Between it and ``lightning_bare_ms`` lies Lightning's own automatic optimization, which the
    callback keeps (one Lightning iteration per optimizer step, its hooks as in plain Lightning);
    between ``floor_ms`` and it, the callback's own step path."""
    timer = _fit_on_floor_loader(args, _automatic_module(_floor_device(args)), [])
    return _median(_step_ms(timer, SKIP, args.steps))


def log_cost(args: argparse.Namespace) -> dict[str, Any]:
    """Per-``self.log`` cost per step, plain Lightning and with the callback: (t(k logs) - t(0)) / k.

    ``--log-cost-pairs N`` fits each variant N times with and without the logs, in adjacent pairs
    whose order alternates; the cost is the median of the per-pair differences (a drift of the host
    between fits then falls on both fits of a pair), the step times the medians of their fits."""
    out: dict[str, Any] = {}
    for variant, with_callback in (("plain", False), ("callback", True)):
        nones, somes, per_log = [], [], []
        for pair in range(args.log_cost_pairs):
            order = (0, LOG_COST_LOGS) if pair % 2 == 0 else (LOG_COST_LOGS, 0)
            times = {logs: fit_floor(args, logs, with_callback) for logs in order}
            none, some = times[0], times[LOG_COST_LOGS]
            nones.append(none)
            somes.append(some)
            if none and some:
                per_log.append((some - none) / LOG_COST_LOGS)
        out[f"{variant}_step_ms_0_logs"] = _median([t for t in nones if t])
        out[f"{variant}_step_ms_{LOG_COST_LOGS}_logs"] = _median([t for t in somes if t])
        out[f"{variant}_ms_per_log"] = _median(per_log)
        out[f"{variant}_ms_per_log_pairs"] = per_log
    return out


@contextlib.contextmanager
def _quiet_progress(smoke: bool) -> Any:
    """--smoke sends the progress bar's output to /dev/null (the bar still runs)."""
    if not smoke:
        yield
        return
    with open(os.devnull, "w") as sink, contextlib.redirect_stderr(sink), contextlib.redirect_stdout(sink):
        yield


# ---------------------------------------------------------------------- plain-PyTorch anchors (CUDA)
def _adamw(module: Any, impl: str, capturable: bool) -> Any:
    """AdamW with the family optimizer's hyperparameters, `impl` (fused/foreach), capturable or not."""
    import torch

    from l2lightning.tools.bench import run as bench

    group = bench.module_optimizer(module).param_groups[0]
    return torch.optim.AdamW(
        module.parameters(),
        lr=float(group["lr"]),
        betas=tuple(group.get("betas", (0.9, 0.999))),
        eps=float(group.get("eps", 1e-8)),
        weight_decay=float(group.get("weight_decay", 0.0)),
        capturable=capturable,
        **{impl: True},
    )


def _copy_into(dst: Any, src: Any) -> None:
    import torch

    if isinstance(dst, torch.Tensor):
        dst.copy_(src, non_blocking=True)
    elif isinstance(dst, dict):
        for k in dst:
            _copy_into(dst[k], src[k])
    elif isinstance(dst, (list, tuple)):
        for d, s in zip(dst, src):
            _copy_into(d, s)


def raw_graph_loop(setup: FamilySetup, args: argparse.Namespace) -> float:
    """LeanRL's whole-update graph of the family's training step in a plain loop; median ms per step."""
    import torch

    from l2lightning.graph.capture import loss_of
    from l2lightning.tools.bench import run as bench

    device = torch.device("cuda", args.device)
    module = setup.module().to(device).train()
    opt = _adamw(module, args.anchor_optimizer, capturable=True)
    from lightning.fabric.utilities.apply_func import move_data_to_device

    batches = [move_data_to_device(b, device) for b in setup.host_batches]
    static = move_clone(batches[0])
    source = f"{type(module).__name__}.training_step"

    def update() -> Any:
        opt.zero_grad(set_to_none=True)
        loss = loss_of(module.training_step(static, 0), source)
        loss.backward()
        opt.step()
        return loss

    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        for _ in range(3):
            update()
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        update()

    def step(i: int) -> None:
        _copy_into(static, batches[i % len(batches)])
        graph.replay()

    per_step_us = bench.time_steps(step, args.steps, warmup=5)
    return statistics.median(per_step_us) / 1e3


def move_clone(batch: Any) -> Any:
    import torch

    if isinstance(batch, torch.Tensor):
        return batch.clone()
    if isinstance(batch, dict):
        return {k: move_clone(v) for k, v in batch.items()}
    if isinstance(batch, (list, tuple)):
        return type(batch)(move_clone(v) for v in batch)
    return batch


def compile_ro_loop(setup: FamilySetup, args: argparse.Namespace, cache: dict[str, Any]) -> float:
    """``bench._raise_compile_limits()
        module.compile(mode="reduce-overhead", dynamic=False)`` in a plain loop with fused AdamW; median ms per step.

    The compiled module is kept in `cache` across rounds (compiling once per batch size).
    """
    import torch
    from lightning.fabric.utilities.apply_func import move_data_to_device

    from l2lightning.graph.capture import loss_of
    from l2lightning.tools.bench import run as bench

    key = f"{setup.family}_b{setup.batch}"
    if key not in cache:
        device = torch.device("cuda", args.device)
        module = setup.module().to(device).train()
        bench._raise_compile_limits()
        module.compile(mode="reduce-overhead", dynamic=False)
        opt = _adamw(module, "fused", capturable=False)
        batches = [move_data_to_device(b, device) for b in setup.host_batches]
        source = f"{type(module).__name__}.training_step"

        def step(i: int) -> Any:
            torch.compiler.cudagraph_mark_step_begin()
            opt.zero_grad(set_to_none=True)
            loss = loss_of(module.training_step(batches[i % len(batches)], i), source)
            loss.backward()
            opt.step()
            return loss

        cache[key] = step
    per_step_us = bench.time_steps(cache[key], args.steps, warmup=5)
    return statistics.median(per_step_us) / 1e3


# ---------------------------------------------------------------------- profile buckets
def _norm(path: str) -> str:
    return path.replace("\\", "/")


def classify(func: tuple[str, int, str]) -> str | None:
    """The bucket of a function's own time, or None for generic code (split over its callers)."""
    path, _, name = func
    p = _norm(path)
    if path == "~":  # builtins
        if any(s in name for s in ("'item'", "'cpu'", "'tolist'", "'numpy'", "_local_scalar_dense")):
            return "host_sync"
        if "synchronize" in name or "'__bool__'" in name or "'__float__'" in name:
            return "host_sync"
        return None
    if "/l2lightning/app/models/" in p or "/l2lightning/models/" in p:
        return None  # the family's own hooks: their time goes where they were called from
    if "/l2lightning/" in p:
        return "callback_replay"
    if "/torchmetrics/" in p:
        return "metric_updates"
    if "/tqdm/" in p or "/lightning/pytorch/callbacks/progress/" in p:
        return "progress_bar"
    if (
        "/lightning/pytorch/trainer/connectors/logger_connector/" in p
        or "/lightning/pytorch/loggers/" in p
        or "/lightning/fabric/loggers/" in p
        or (
            "/lightning/pytorch/core/module.py" in p
            and name in ("log", "log_dict", "__check_allowed", "__to_tensor")
        )
        or "/lightning/pytorch/core/module.py" in p
        and name.startswith("_LightningModule__")
    ):
        return "log_and_logger"
    if (
        "/torch/utils/data/" in p
        or "/lightning/pytorch/loops/fetchers.py" in p
        or "/lightning/pytorch/utilities/combined_loader.py" in p
        or "/lightning/pytorch/trainer/connectors/data_connector.py" in p
    ):
        return "data_loading"
    if (
        ("/lightning/fabric/utilities/apply_func.py" in p and name in ("move_data_to_device", "batch_to"))
        or ("/lightning/pytorch/strategies/" in p and name == "batch_to_device")
        or ("/lightning/pytorch/core/hooks.py" in p and name == "transfer_batch_to_device")
    ):
        return "h2d_copy"
    if "/lightning/pytorch/" in p or "/lightning/fabric/" in p:
        return "lightning_loop"
    return None


def bucket_profile(profile: cProfile.Profile) -> dict[str, float]:
    """Seconds per bucket: own time by file, generic code split over its callers by time spent."""
    stats = pstats.Stats(profile).stats  # func -> (cc, nc, tt, ct, callers{caller: (cc, nc, tt, ct)})
    memo: dict[Any, dict[str, float]] = {}
    active: set[Any] = set()

    def share(func: Any) -> dict[str, float]:
        if func in memo:
            return memo[func]
        own = classify(func)
        if own is not None:
            memo[func] = {own: 1.0}
            return memo[func]
        if func in active or func not in stats:
            return {"other": 1.0}
        active.add(func)
        callers = stats[func][4]
        weights = {c: v[3] for c, v in callers.items() if v[3] > 0}
        total = sum(weights.values())
        out: dict[str, float] = {}
        if not total:
            out = {"other": 1.0}
        else:
            for caller, w in weights.items():
                for b, f in share(caller).items():
                    out[b] = out.get(b, 0.0) + f * w / total
        active.discard(func)
        memo[func] = out
        return out

    buckets = dict.fromkeys(BUCKETS, 0.0)
    for func, (_, _, tt, _, _) in stats.items():
        if tt <= 0:
            continue
        for b, f in share(func).items():
            buckets[b] += tt * f
    return buckets


def profile_family(setup: FamilySetup, args: argparse.Namespace) -> dict[str, Any]:
    """One callback fit with cProfile over `--profile-steps` steps; ms per step per bucket."""
    out = fit_family(setup, args, with_callback=True, profile_steps=args.profile_steps)
    prof = out["profile"]
    n = min(args.profile_steps, max(prof.calls - SKIP - 1, 0))
    if prof.t0 is None or n <= 0:
        return {"error": "the profile window was never reached", "callback": out.get("callback")}
    seconds = bucket_profile(prof.profile)
    own = _own_ms_per_step(prof.profile, n)
    top_funcs = [
        {"function": function, "ms_per_step": ms}
        for function, ms in sorted(own.items(), key=lambda kv: -kv[1])[:40]
    ]
    return {
        "family": setup.family,
        "batch": setup.batch,
        "profiled_steps": n,
        "profiled_step_ms": (prof.t1 - prof.t0) * 1e3 / n,
        "buckets_ms_per_step": {b: seconds[b] * 1e3 / n for b in BUCKETS},
        "top_functions_own_time": top_funcs,
        "captured": (out.get("callback") or {}).get("captured"),
        "capture_reason": (out.get("callback") or {}).get("reason"),
    }


def _own_ms_per_step(profile: cProfile.Profile, steps: int) -> dict[str, float]:
    """Each function's own time per step in ms, by ``file:line(name)`` (site-packages stripped)."""
    stats = pstats.Stats(profile).stats
    return {
        f"{_norm(f[0]).split('site-packages/')[-1]}:{f[1]}({f[2]})": v[2] * 1e3 / steps
        for f, v in stats.items()
        if v[2] > 0
    }


def profile_floor(args: argparse.Namespace, top: int = 40) -> dict[str, Any]:
    """Where ``floor_ms - lightning_bare_ms`` goes (issue 37): the floor's fit with the callback and
    Lightning's bare fit, each under cProfile for ``--profile-steps`` steps from step SKIP (after the
    capture), on the floor's loader and Trainer. Per variant the profiled step time and the buckets;
    then the `top` functions whose own time per step differs most between the two (callback minus
    bare: what the callback's replay path and automatic optimization add, and what they skip).

    The callback runs with ``verify=False`` here: the sampled check's eager steps (at the 8th, 16th,
    32nd, 64th replay) would fall in the window and outweigh the per-step difference, which the
    medians of ``floor_ms`` and ``lightning_bare_ms`` leave them out of."""
    from l2lightning import L2GraphCallback

    device = _floor_device(args)
    impl = "fused" if args.accelerator == "cuda" else "foreach"
    floor_args = SimpleNamespace(**{**vars(args), "steps": args.profile_steps})
    variants: dict[str, Any] = {}
    own: dict[str, dict[str, float]] = {}
    for name in ("callback_floor", "bare"):
        profiler = _Profiler(SKIP, args.profile_steps)
        if name == "bare":
            callbacks: list[Any] = [profiler]
            module = _bare_module(device)
        else:
            callback = L2GraphCallback(prefetch="off", log_timing=False, verify=False)
            callbacks = [callback, profiler]
            module = _logging_module(0, device, impl)
        _fit_on_floor_loader(floor_args, module, callbacks)
        steps = min(args.profile_steps, max(profiler.calls - SKIP - 1, 0))
        if profiler.t0 is None or steps <= 0:
            return {"error": f"the {name} fit never reached its profile window"}
        own[name] = _own_ms_per_step(profiler.profile, steps)
        variants[name] = {
            "profiled_steps": steps,
            "profiled_step_ms": (profiler.t1 - profiler.t0) * 1e3 / steps,
            "buckets_ms_per_step": {b: v * 1e3 / steps for b, v in bucket_profile(profiler.profile).items()},
        }
        if name == "callback_floor":
            summary = callback.summary()
            variants[name]["captured"] = summary["captured"]
            variants[name]["capture_reason"] = summary["reason"]
    functions = set(own["callback_floor"]) | set(own["bare"])
    differences = sorted(
        (
            {
                "function": f,
                "callback_floor_ms": own["callback_floor"].get(f, 0.0),
                "bare_ms": own["bare"].get(f, 0.0),
                "difference_ms": own["callback_floor"].get(f, 0.0) - own["bare"].get(f, 0.0),
            }
            for f in functions
        ),
        key=lambda row: -abs(row["difference_ms"]),
    )
    return {**variants, "largest_differences": differences[:top]}


# ---------------------------------------------------------------------- output
def _rounded(value: Any) -> Any:
    """`value` to 4 decimals for the log line: a number, or each number of a list."""
    if isinstance(value, list):
        return [_rounded(v) for v in value]
    return round(value, 4) if isinstance(value, float) else value


def _fmt(v: Any) -> str:
    return "" if v is None else f"{v:.4f}"


def write_csv(path: Path, rows: list[dict[str, Any]], columns: tuple[str, ...] = CSV_COLUMNS) -> None:
    """`rows` under `columns`, whose first two are family and batch (the rest: milliseconds)."""
    with path.open("w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(columns)
        for r in rows:
            w.writerow([r["family"], r["batch"], *(_fmt(r.get(c)) for c in columns[2:])])


def plot(path: Path, rows: list[dict[str, Any]]) -> str | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        return f"no plot: {exc}"
    families = sorted({r["family"] for r in rows})
    if not families:
        return "no plot: no family was timed (--families empty: the log cost alone)"
    fig, axes = plt.subplots(1, len(families), figsize=(4 * len(families), 3.5), squeeze=False)
    for ax, fam in zip(axes[0], families):
        fr = sorted((r for r in rows if r["family"] == fam), key=lambda r: r["batch"])
        xs = [r["batch"] for r in fr]
        for col, label, style in (
            ("callback_step_ms", "callback Trainer.fit step", "o-"),
            ("replay_ms", "graph replay", "s--"),
            ("floor_ms", "loop floor (1->1 Linear)", ":"),
            ("lightning_eager_ms", "Lightning eager", "x-"),
        ):
            ys = [r.get(col) for r in fr]
            if any(y is not None for y in ys):
                ax.plot(xs, [math.nan if y is None else y for y in ys], style, label=label)
        ax.set_title(fam)
        ax.set_xlabel("batch")
        ax.set_ylabel("ms per step")
        ax.set_xscale("log", base=2)
        ax.grid(True, alpha=0.3)
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return None


def _ratio(a: float | None, b: float | None) -> str:
    return f"{a / b:.2f}x" if a and b else "n/a"


def print_table(rows: list[dict[str, Any]]) -> None:
    print(
        f"\n{'family':<12}{'b':>4}{'eager':>9}{'callback':>10}{'replay':>9}{'floor':>8}{'bare':>8}{'raw':>8}{'ro':>8}"
        f"{'eager/cb':>10}{'cb/max(rp,fl)':>15}{'cb/raw':>8}"
    )
    for r in rows:
        cb = r.get("callback_step_ms")
        bound = max([v for v in (r.get("replay_ms"), r.get("floor_ms")) if v] or [0]) or None

        def ms(v: Any) -> str:
            return f"{v:.3f}" if v is not None else "-"

        print(
            f"{r['family']:<12}{r['batch']:>4}{ms(r.get('lightning_eager_ms')):>9}{ms(cb):>10}"
            f"{ms(r.get('replay_ms')):>9}{ms(r.get('floor_ms')):>8}{ms(r.get('lightning_bare_ms')):>8}"
            f"{ms(r.get('raw_graph_loop_ms')):>8}"
            f"{ms(r.get('compile_ro_ms')):>8}{_ratio(r.get('lightning_eager_ms'), cb):>10}"
            f"{_ratio(cb, bound):>15}{_ratio(cb, r.get('raw_graph_loop_ms')):>8}"
        )


# ---------------------------------------------------------------------- main
def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--families", default=",".join(SMALL_FAMILIES))
    p.add_argument("--batches", default="4,8,16")
    p.add_argument("--steps", type=int, default=200, help="timed steps per fit / per anchor run")
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds of every variant")
    p.add_argument("--profile-steps", type=int, default=100, help="callback steps under cProfile")
    p.add_argument(
        "--log-cost-pairs",
        type=int,
        default=1,
        help="pairs of log-cost fits (without and with the logs) per variant and round",
    )
    p.add_argument("--no-profile", action="store_true", help="skip host_profile.json")
    p.add_argument(
        "--anchor-optimizer",
        choices=("fused", "foreach"),
        default="fused",
        help="AdamW implementation of the hand-written graph loop (the families configure fused on CUDA)",
    )
    p.add_argument(
        "--pinned",
        action="store_true",
        help="also time the callback fit with its batches in page-locked host memory (callback_pinned_step_ms "
        "in host_overhead.json and host_overhead_pinned.csv): whether the pageable host-to-device copy waits "
        "for the GPU",
    )
    p.add_argument("--device", type=int, default=0)
    p.add_argument("--force", action="store_true", help="time even if the doctor says the GPU is not ready")
    p.add_argument("--smoke", action="store_true", help="CPU, tiny models, a few steps (plumbing check)")
    args = p.parse_args(argv)
    if args.log_cost_pairs < 1:
        p.error(f"--log-cost-pairs must be at least 1 (got {args.log_cost_pairs})")
    args.families = [f for f in args.families.split(",") if f]
    args.batches = [int(b) for b in args.batches.split(",") if b]
    if args.smoke:
        args.steps = min(args.steps, 4)
        args.rounds = 1
        args.profile_steps = min(args.profile_steps, 3)
    return args


def check_gpu(args: argparse.Namespace, log: Callable[[str], None]) -> tuple[int | None, dict[str, Any]]:
    """(exit code or None to go on, machine facts) from the doctor, as ``l2lightning bench`` checks."""
    import torch

    from l2lightning.tools import doctor

    if args.smoke:
        args.accelerator = "cpu"
        return None, {"doctor": "not run (--smoke: CPU plumbing check)", "gpu_name": None, "forced": None}
    state = doctor.collect(args.device, load_seconds=0.6)
    findings = doctor.diagnose(state)
    ready, reasons = doctor.ready_for_timing(state, findings)
    log(doctor.format_report(state, findings))
    if not state.get("gpu_available"):
        log("bench_host_overhead: no usable CUDA GPU; nothing can be timed (run with --smoke on a CPU)")
        return 2, {}
    if not ready and not args.force:
        log("bench_host_overhead: the GPU is not ready for timing (reasons above); fix them or pass --force")
        return 2, {}
    args.accelerator = "cuda"
    torch.cuda.set_device(args.device)
    return None, {
        "gpu_name": state.get("gpu_name") or torch.cuda.get_device_name(args.device),
        "forced": not ready,
        "not_ready_reasons": reasons,
        "doctor": json.loads(json.dumps(state, default=str)),
    }


def main(argv: list[str] | None = None) -> int:
    import lightning
    import torch

    from l2lightning.tools.bench import run as bench

    t_start = time.perf_counter()
    args = parse_args(argv)
    command = " ".join([sys.executable, *(sys.argv if argv is None else [__file__, *argv])])
    known = bench.family_names()
    bad = [f for f in args.families if f not in known]
    if bad:
        print(f"unknown families {bad}; known: {', '.join(known)}", file=sys.stderr)
        return 2
    code, machine = check_gpu(args, print)
    if code is not None:
        return code
    machine.update(
        {
            "torch": torch.__version__,
            "torch_cuda": torch.version.cuda,
            "lightning": lightning.__version__,
            "python": sys.version.split()[0],
            "accelerator": args.accelerator,
            "command": command,
            "started_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        }
    )
    cuda = args.accelerator == "cuda"
    empty_why = {}
    if not cuda:
        why = "CUDA-only (no CUDA in --smoke): "
        empty_why = {
            "replay_ms": why + "the callback refuses without CUDA and trains eagerly, so there is no replay; "
            "callback_step_ms and floor_ms are then eager steps with the callback attached",
            "raw_graph_loop_ms": why + "torch.cuda.graph",
            "compile_ro_ms": why + "mode='reduce-overhead' records CUDA graphs",
        }
    empty_why.setdefault(
        "raw_graph_loop_ms (other families)", f"only measured for {', '.join(ANCHOR_FAMILIES)}"
    )
    empty_why.setdefault("compile_ro_ms (other families)", f"only measured for {', '.join(ANCHOR_FAMILIES)}")

    args.out.mkdir(parents=True, exist_ok=True)
    # the fits' CSV logs and checkpoints: nothing of them is kept, and nothing is left behind
    with tempfile.TemporaryDirectory(prefix="host_overhead_logs_") as logs:
        log_dir = Path(logs)
        setups: dict[tuple[str, int], FamilySetup] = {}
        errors: list[dict[str, Any]] = []
        for fam in args.families:
            for b in args.batches:
                overrides = bench.TINY_FAMILY_OVERRIDES.get(fam, []) if args.smoke else []
                try:
                    setups[fam, b] = FamilySetup(fam, b, overrides, log_dir)
                except Exception as exc:
                    errors.append({"family": fam, "batch": b, "variant": "setup", "error": repr(exc)[:400]})
                    print(f"{fam} b{b}: setup failed: {exc!r}", flush=True)

        runs: list[dict[str, Any]] = []
        compiled: dict[str, Any] = {}

        def attempt(fam: str, b: int, variant: str, fn: Callable[[], Any]) -> Any:
            try:
                value = fn()
            except Exception as exc:  # a failing variant is a result too
                errors.append(
                    {
                        "family": fam,
                        "batch": b,
                        "variant": variant,
                        "error": repr(exc)[:400],
                        "trace": traceback.format_exc()[-1500:],
                    }
                )
                print(f"{fam} b{b} {variant}: FAILED {exc!r}", flush=True)
                return None
            return value

        log_costs: list[dict[str, Any]] = []
        for rnd in range(args.rounds):
            cost = attempt("log_cost", 0, "log_cost", lambda: log_cost(args))
            if cost:
                log_costs.append({"round": rnd, **cost})
                print({"round": rnd, **{k: _rounded(v) for k, v in cost.items()}}, flush=True)
            for fam in args.families:
                floor = attempt(fam, 0, "floor", lambda: fit_floor(args))
                bare = attempt(fam, 0, "lightning_bare", lambda: fit_bare(args))
                for b in args.batches:
                    setup = setups.get((fam, b))
                    if setup is None:
                        continue
                    run: dict[str, Any] = {
                        "round": rnd,
                        "family": fam,
                        "batch": b,
                        "floor_ms": floor,
                        "lightning_bare_ms": bare,
                    }
                    eager = attempt(fam, b, "lightning_eager", lambda s=setup: fit_family(s, args, False))
                    run["lightning_eager_ms"] = eager and eager.get("step_ms")
                    cbr = attempt(fam, b, "callback", lambda s=setup: fit_family(s, args, True))
                    if cbr:
                        run["callback_step_ms"] = cbr.get("step_ms")
                        run["replay_ms"] = cbr.get("replay_ms") if cuda else None
                        run["callback"] = cbr.get("callback")
                    if cuda and args.pinned:
                        pinned = attempt(
                            fam, b, "callback_pinned", lambda s=setup: fit_family(s, args, True, pinned=True)
                        )
                        run["callback_pinned_step_ms"] = pinned and pinned.get("step_ms")
                    if cuda and fam in ANCHOR_FAMILIES:
                        run["raw_graph_loop_ms"] = attempt(
                            fam, b, "raw_graph_loop", lambda s=setup: raw_graph_loop(s, args)
                        )
                        run["compile_ro_ms"] = attempt(
                            fam, b, "compile_ro", lambda s=setup: compile_ro_loop(s, args, compiled)
                        )
                    runs.append(run)
                    print(
                        {
                            k: (round(v, 4) if isinstance(v, float) else v)
                            for k, v in run.items()
                            if k != "callback"
                        },
                        flush=True,
                    )

        rows = []
        for (fam, b), _setup in setups.items():
            mine = [r for r in runs if r["family"] == fam and r["batch"] == b]
            row: dict[str, Any] = {"family": fam, "batch": b}
            for col in CSV_COLUMNS[2:]:
                row[col] = _median([r.get(col) for r in mine if r.get(col) is not None])
            if args.pinned:
                row["callback_pinned_step_ms"] = _median(
                    [
                        r.get("callback_pinned_step_ms")
                        for r in mine
                        if r.get("callback_pinned_step_ms") is not None
                    ]
                )
            row["captured"] = [(r.get("callback") or {}).get("captured") for r in mine]
            row["capture_reason"] = next(
                (
                    (r.get("callback") or {}).get("reason")
                    for r in mine
                    if (r.get("callback") or {}).get("reason")
                ),
                None,
            )
            rows.append(row)

        profiles: list[dict[str, Any]] = []
        profile_note = None
        floor_profile: dict[str, Any] | None = None
        if args.no_profile:
            profile_note = "skipped (--no-profile)"
        else:
            for fam in args.families:
                for b in PROFILE_BATCHES:
                    setup = setups.get((fam, b))
                    if setup is None:
                        continue
                    prof = attempt(fam, b, "profile", lambda s=setup: profile_family(s, args))
                    if prof:
                        profiles.append(prof)
                        print(
                            f"profile {fam} b{b}: "
                            + ", ".join(
                                f"{k} {v:.3f}" for k, v in prof.get("buckets_ms_per_step", {}).items()
                            ),
                            flush=True,
                        )
            if not profiles:
                profile_note = f"no family ran at the profiled batches {list(PROFILE_BATCHES)}"
            floor_profile = attempt("floor", 1, "floor profile", lambda: profile_floor(args))
            if floor_profile and "error" not in floor_profile:
                gap = (
                    floor_profile["callback_floor"]["profiled_step_ms"]
                    - floor_profile["bare"]["profiled_step_ms"]
                )
                print(f"profile floor - bare: {gap:.3f} ms per profiled step", flush=True)

        write_csv(args.out / "host_overhead.csv", rows)
        if args.pinned:
            write_csv(args.out / "host_overhead_pinned.csv", rows, PINNED_CSV_COLUMNS)
        plot_note = plot(args.out / "host_overhead.png", rows)
        result = {
            "machine": machine,
            "settings": {
                "families": args.families,
                "batches": args.batches,
                "steps": args.steps,
                "rounds": args.rounds,
                "skip": SKIP,
                "smoke": args.smoke,
                "anchor_optimizer": f"AdamW({args.anchor_optimizer}=True, capturable=True) for raw_graph_loop_ms; "
                "AdamW(fused=True) for compile_ro_ms; the family's own configure_optimizers() in the fits",
                "trainer": "family's progress bar and loggers; checkpointing, model summary, validation off",
                # each refresh reads every prog_bar value back from the GPU: the step times depend on it
                "progress_bar_refresh_rate": {fam: packaged_refresh_rate(fam) for fam in args.families},
                "data": f"{bench.FAMILY_BATCHES} host batches drawn once from the family's data module, cycled",
            },
            "columns": list(CSV_COLUMNS),
            "empty_columns_why": empty_why,
            "rows": rows,
            "runs": runs,
            "log_cost": {
                "method": f"fit_floor's module logging its loss {LOG_COST_LOGS} times per step (prog_bar=True), "
                "no logger or progress bar; ms_per_log = (step with the logs - step without) / logs, per pair of "
                f"adjacent fits ({args.log_cost_pairs} per variant and round, order alternating), median of "
                "the pairs per round, then of the rounds",
                "median": {
                    k: _median([c.get(k) for c in log_costs])
                    for k in (log_costs[0] if log_costs else {})
                    if k != "round" and not k.endswith("_pairs")
                },
                "rounds": log_costs,
            },
            "errors": errors,
            "plot": plot_note or "host_overhead.png",
            "elapsed_s": round(time.perf_counter() - t_start, 1),
        }
        (args.out / "host_overhead.json").write_text(json.dumps(result, indent=2, default=str))
        (args.out / "host_profile.json").write_text(
            json.dumps(
                {
                    "machine": machine,
                    "buckets": list(BUCKETS),
                    "method": "cProfile of callback Trainer.fit steps after capture; own time by file, generic "
                    "code split over callers by time; ms per step (cProfile overhead included)",
                    "note": profile_note,
                    "profiles": profiles,
                    "floor_profile": floor_profile,
                },
                indent=2,
                default=str,
            )
        )
        print_table(rows)
        written = [
            n
            for n in ("host_overhead.csv", "host_overhead.json", "host_profile.json", "host_overhead.png")
            if (args.out / n).exists()
        ]
        print(f"\nwrote {', '.join(written)} in {args.out}")
        return 0


if __name__ == "__main__":
    raise SystemExit(main())
