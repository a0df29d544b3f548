"""Benchmark harness: what a user would pick instead, per training step, in one process.

For one model, batch and dtype it times, with variants interleaved round-robin over repeats:

============================  ==============================================================
``lightning_eager``           ``Trainer.fit`` with automatic optimization, timed by a callback
``callback_off``              ``Trainer(callbacks=[L2GraphCallback(prefetch="off")])``
``callback_auto``             the callback with autotuned prefetch (``prefetch="auto"``)
``callback_decoy``            the callback with the decoy (same traffic, wrong layer)
``eager``                     a plain PyTorch loop (zero-grad, forward, loss, backward, step)
``graph``                     the whole step captured with :func:`l2lightning.capture_step`
``graph_prefetch``            the same graph with :class:`l2lightning.PrefetchHooks`
``graph_decoy``               the same graph with the decoy prefetch
``compile_ro``                ``torch.compile(model, mode="reduce-overhead")`` in a plain loop
``compile_graph``             ``torch.compile`` (default mode) blocks inside a whole-step graph
``compile_graph_prefetch``    the same with prefetch
============================  ==============================================================

Chains: ``step`` (forward + loss + backward + AdamW, every variant above), ``forward_backward``
(zero-grad + forward + loss + backward) and ``forward`` (no grad), the last two with
``eager``/``graph``/``graph_prefetch``/``graph_decoy``.

Model: N x (LayerNorm, Linear d x d, GELU) in bf16 with an MSE regression loss, AdamW(foreach=True)
(``capturable=True`` through :func:`l2lightning.make_capturable` inside graphs). Each block holds
its parameters itself and runs ``F.layer_norm``/``F.linear``/``F.gelu`` (the same kernels as the
``nn`` modules), so that one block is one prefetch chain layer and, in the compiled variants, the
compiled block function runs *inside* the block while the prefetch hooks stay outside it.

Timing: CUDA events recorded at each step boundary (start to start, so the loop's own CPU work is
included, as a user sees it); Lightning steps are timed from ``on_train_batch_start`` to the
next. Each (variant, repeat) gives the median of its steps; the reported median and its
order-statistic 95% CI are over those per-repeat medians (see :func:`l2lightning.report.median_ci`).
Floors per case: bytes from :func:`l2lightning.report.step_bytes` (AdamW states in the parameters'
dtype, as PyTorch keeps them) over the doctor's copy bandwidth, and kernels counted on one eager
pass with ``torch.profiler`` times the doctor's empty-kernel cost (compiled variants launch fewer
kernels, so their launch floor is an upper estimate).

Graph lifetimes: every variant's graphs stay live through all repeats, in one process with eager
code, Lightning fits and compiled code interleaved, so nothing a graph reads or writes may be freed
before the runner's ``close()``. The library takes care of the two things that once were not held
(an ``illegal memory access`` on replay, found here): ``CapturedStep`` keeps its optimizer, whose
state the graph updates in place, and every capture goes through
:func:`l2lightning.capture.graph_capture`, which gives each graph's GEMMs a cuBLAS workspace in the
graph's own pool instead of one that Lightning's teardown or inductor's cudagraph trees free.

The GPU state is checked with the doctor first; timing is refused unless ``--force``, which marks
every result ``forced: true``. Pre-registered criteria are hashed and stored before any timing
and evaluated after it. ``results.json`` is rewritten after every case (``complete: false``) and
once at the end with the criteria verdicts, beside ``results.csv`` and the plots.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import gc
import json
import logging
import math
import re
import shutil
import statistics
import sys
import time
import traceback
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from l2lightning import report

STEP_VARIANTS = (
    "lightning_eager",
    "callback_off",
    "callback_auto",
    "callback_decoy",
    "eager",
    "graph",
    "graph_prefetch",
    "graph_decoy",
    "compile_ro",
    "compile_graph",
    "compile_graph_prefetch",
)
OPTIMIZER_IMPLS = ("fused", "foreach")
CHAIN_VARIANTS = {
    "step": STEP_VARIANTS,
    "forward_backward": ("eager", "graph", "graph_prefetch", "graph_decoy"),
    "forward": ("eager", "graph", "graph_prefetch", "graph_decoy"),
}
ALL_VARIANTS = STEP_VARIANTS
LIGHTNING_VARIANTS = ("lightning_eager", "callback_off", "callback_auto", "callback_decoy")
COMPILE_VARIANTS = ("compile_ro", "compile_graph", "compile_graph_prefetch")
CSV_COLUMNS = (
    "config",
    "chain",
    "variant",
    "width",
    "depth",
    "batch",
    "dtype",
    "layer_mib",
    "median_us",
    "ci_lo_us",
    "ci_hi_us",
    "ci_coverage",
    "n",
    "speedup_vs_baseline",
    "speedup_vs_lightning_eager",
    "speedup_vs_eager",
    "speedup_vs_graph",
    "speedup_vs_reduce_overhead",
    "gain_vs_no_prefetch",
    "vs_best_alternative",
    "best_alternative",
    "floor_bytes_us",
    "floor_launch_us",
    "floor_us",
    "floor_bound",
    "ratio_to_floor",
    "kernel_count",
    "forced",
    "error",
)
DEFAULT_RESULTS_ROOT = Path("benchmarks") / "results"
DEFAULT_CRITERIA = Path("benchmarks") / "criteria.yaml"


# ---------------------------------------------------------------------- settings
@dataclass
class BenchSettings:
    """What to time and how (the CLI fills it; see ``l2lightning bench --help``)."""

    models: list[tuple[int, int]] = field(default_factory=lambda: [(1536, 40)])
    batches: list[int] = field(default_factory=lambda: [4, 8, 16, 64])
    chains: list[str] = field(default_factory=lambda: ["step", "forward_backward", "forward"])
    variants: list[str] | None = None
    dtype: str = "bfloat16"
    repeats: int = 10
    steps: int = 30
    warmup: int = 3
    lightning_skip: int = 8
    prefetch: str = "auto"
    lr: float = 1e-4
    # AdamW implementation for every variant: "fused" (one pass over the state per step) or
    # "foreach" (about a dozen multi-tensor passes, which dominated the captured step on the H200)
    optimizer: str = "fused"
    device: int = 0
    criteria: Path | None = None
    out: Path | None = None
    force: bool = False
    quick: bool = False
    doctor_load_seconds: float = 0.6

    def __post_init__(self) -> None:
        if not self.models:
            raise ValueError("no model configuration: give `--widths`/`--depths` or `--models`")
        for w, d in self.models:
            if w < 1 or d < 1:
                raise ValueError(f"model widths and depths must be >= 1, got {w}x{d}")
        if not self.batches or any(b < 1 for b in self.batches):
            raise ValueError(f"batches must be >= 1, got {self.batches}")
        unknown = [c for c in self.chains if c not in CHAIN_VARIANTS]
        if unknown or not self.chains:
            raise ValueError(f"unknown chains {unknown}; known: {list(CHAIN_VARIANTS)}")
        if self.variants is not None:
            bad = [v for v in self.variants if v not in ALL_VARIANTS]
            if bad:
                raise ValueError(f"unknown variants {bad}; known: {list(ALL_VARIANTS)}")
        if self.repeats < 1 or self.steps < 1 or self.warmup < 0 or self.lightning_skip < 1:
            raise ValueError("repeats and steps must be >= 1, warmup >= 0, lightning skip >= 1")
        if self.optimizer not in OPTIMIZER_IMPLS:
            raise ValueError(f"optimizer must be one of {OPTIMIZER_IMPLS}, got {self.optimizer!r}")
        if self.prefetch not in ("auto", "default"):
            raise ValueError(f"prefetch must be 'auto' or 'default', got {self.prefetch!r}")
        report.dtype_bytes(self.dtype)  # raises on an unknown dtype

    def variants_for(self, chain: str) -> list[str]:
        return [v for v in CHAIN_VARIANTS[chain] if self.variants is None or v in self.variants]


def gpu_slug(name: str | None) -> str:
    """``"NVIDIA H200"`` -> ``"nvidia-h200"`` (directory name for results)."""
    slug = re.sub(r"[^a-z0-9]+", "-", (name or "unknown-gpu").lower()).strip("-")
    return slug or "unknown-gpu"


# ---------------------------------------------------------------------- model
def _mlp_block(x: Any, ln_weight: Any, ln_bias: Any, weight: Any, bias: Any) -> Any:
    import torch.nn.functional as F

    return F.gelu(F.linear(F.layer_norm(x, (x.shape[-1],), ln_weight, ln_bias), weight, bias))


@functools.lru_cache(maxsize=1)
def compiled_block() -> Callable[..., Any]:
    """``torch.compile(_mlp_block)`` (default mode), built once per process and shared by all blocks."""
    import torch

    return torch.compile(_mlp_block)


def _make_model_classes() -> tuple[type, type]:
    import torch
    from torch import nn

    class MLPBlock(nn.Module):
        """LayerNorm -> Linear(d, d) -> GELU, its four parameters held directly (one chain layer)."""

        def __init__(self, width: int, device: Any = None, dtype: Any = None) -> None:
            super().__init__()
            factory = {"device": device, "dtype": dtype}
            self.ln_weight = nn.Parameter(torch.ones(width, **factory))
            self.ln_bias = nn.Parameter(torch.zeros(width, **factory))
            self.weight = nn.Parameter(torch.empty(width, width, **factory))
            self.bias = nn.Parameter(torch.empty(width, **factory))
            nn.init.kaiming_uniform_(self.weight, a=math.sqrt(5))  # nn.Linear's initialisation
            nn.init.uniform_(self.bias, -1 / math.sqrt(width), 1 / math.sqrt(width))
            self.block_fn: Callable[..., Any] = _mlp_block

        def forward(self, x: Any) -> Any:
            return self.block_fn(x, self.ln_weight, self.ln_bias, self.weight, self.bias)

    class MLPStack(nn.Module):
        """`depth` x MLPBlock(width)."""

        def __init__(self, width: int, depth: int, device: Any = None, dtype: Any = None) -> None:
            super().__init__()
            self.blocks = nn.ModuleList(MLPBlock(width, device, dtype) for _ in range(depth))

        def forward(self, x: Any) -> Any:
            for block in self.blocks:
                x = block(x)
            return x

    return MLPBlock, MLPStack


@functools.lru_cache(maxsize=1)
def _model_classes() -> tuple[type, type]:
    return _make_model_classes()


def build_model(
    width: int, depth: int, device: Any, dtype: Any, seed: int = 0, compiled_blocks: bool = False
) -> Any:
    """The benchmark's MLP stack, initialised from `seed` (every variant starts from the same weights)."""
    import torch

    torch.manual_seed(seed)
    _, stack = _model_classes()
    model = stack(width, depth, device=device, dtype=dtype)
    if compiled_blocks:
        fn = compiled_block()
        for block in model.blocks:
            block.block_fn = fn
    return model


def make_batches(
    width: int, batch: int, device: Any, dtype: Any, count: int = 4, seed: int = 1
) -> list[tuple[Any, Any]]:
    """`count` (x, y) regression batches on the device."""
    import torch

    gen = torch.Generator(device="cpu").manual_seed(seed)
    out = []
    for _ in range(count):
        x = torch.randn(batch, width, generator=gen).to(device=device, dtype=dtype)
        y = (0.1 * torch.randn(batch, width, generator=gen)).to(device=device, dtype=dtype)
        out.append((x, y))
    return out


def regression_loss(model: Any, batch: Any) -> Any:
    import torch.nn.functional as F

    x, y = batch
    return F.mse_loss(model(x), y)


# ---------------------------------------------------------------------- timing
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


@dataclass
class BenchCase:
    """One configuration of one chain."""

    width: int
    depth: int
    batch: int
    dtype: str
    chain: str

    @property
    def label(self) -> str:
        return report.config_label(asdict(self))

    def key(self) -> dict[str, Any]:
        return {
            "width": self.width,
            "depth": self.depth,
            "batch": self.batch,
            "dtype": self.dtype,
            "chain": self.chain,
        }


class Runner:
    """One variant of one case: ``setup()`` once, ``run(steps)`` per repeat, ``close()``."""

    def __init__(
        self, variant: str, case: BenchCase, settings: BenchSettings, shared: dict[str, Any]
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

    def run(self, steps: int) -> list[float]:
        assert self.step is not None
        return time_steps(self.step, steps, self.settings.warmup)

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
        assert self.step is not None
        # Untimed steps: cuBLAS/allocator warm-up; reduce-overhead records its CUDA graphs here.
        for i in range(5 if self.variant == "compile_ro" else 2):
            self.step(i)
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

    from l2lightning.capture import graph_capture

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


class LightningRunner(Runner):
    """``Trainer.fit`` per repeat (optionally with L2GraphCallback), timed by a step-timer callback."""

    PREFETCH = {
        "lightning_eager": None,
        "callback_off": "off",
        "callback_auto": "auto",
        "callback_decoy": "decoy",
    }

    def setup(self) -> None:
        case = self.case
        model = build_model(case.width, case.depth, self.device, self.dtype)
        self.module = _lightning_module(model, self.settings.lr, self.settings.optimizer)
        self.batches = make_batches(case.width, case.batch, self.device, self.dtype)
        self.callback_summaries: list[dict[str, Any]] = []
        if self.variant != "lightning_eager":
            from l2lightning import L2GraphCallback  # noqa: F401  (fail in setup, with the reason, if missing)

    def run(self, steps: int) -> list[float]:
        import torch

        skip = self.settings.lightning_skip
        timer = _step_timer()
        callbacks: list[Any] = [timer]
        cb = None
        prefetch = self.PREFETCH[self.variant]
        if prefetch is not None:
            from l2lightning import L2GraphCallback

            cb = L2GraphCallback(prefetch=prefetch)
            callbacks.append(cb)
        with _quiet_lightning():
            trainer = _trainer(self.settings, skip + steps + 1, callbacks)
            trainer.fit(self.module, _loader(self.batches, skip + steps + 1))
        torch.cuda.synchronize()
        events = timer.events[skip : skip + steps + 1]
        if len(events) < steps + 1:
            raise RuntimeError(f"Trainer.fit ran {len(timer.events)} steps, expected {skip + steps + 1}")
        if cb is not None:
            summary = callback_summary(cb)
            self.callback_summaries.append(summary)
            self.info["callback"] = summary
        return [events[i].elapsed_time(events[i + 1]) * 1e3 for i in range(steps)]


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


def _lightning_module(model: Any, lr: float, impl: str) -> Any:
    import lightning.pytorch as pl
    import torch

    class BenchModule(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = model

        def training_step(self, batch: Any, batch_idx: int) -> Any:
            return regression_loss(self.net, batch)

        def configure_optimizers(self) -> Any:
            return torch.optim.AdamW(self.parameters(), lr=lr, **{impl: True})

    return BenchModule()


def _step_timer() -> Any:
    import lightning.pytorch as pl
    import torch

    class StepTimer(pl.Callback):
        """Records a CUDA event at the start of every training batch."""

        def __init__(self) -> None:
            self.events: list[Any] = []

        def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self.events.append(event)

    return StepTimer()


def _loader(batches: list[tuple[Any, Any]], length: int) -> Any:
    import torch

    class Batches(torch.utils.data.Dataset):
        def __len__(self) -> int:
            return length

        def __getitem__(self, i: int) -> Any:
            return batches[i % len(batches)]

    return torch.utils.data.DataLoader(Batches(), batch_size=None, shuffle=False, num_workers=0)


def _trainer(settings: BenchSettings, max_steps: int, callbacks: list[Any]) -> Any:
    import lightning.pytorch as pl

    return pl.Trainer(
        accelerator="cuda",
        devices=[settings.device],
        max_steps=max_steps,
        max_epochs=1,
        precision="32-true",  # the model already is bf16; nothing to cast
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
        use_distributed_sampler=False,
        callbacks=callbacks,
    )


@contextlib.contextmanager
def _quiet_lightning() -> Iterator[None]:
    loggers = [logging.getLogger(n) for n in ("lightning.pytorch", "lightning.fabric", "pytorch_lightning")]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.WARNING)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*does not have many workers.*")
            warnings.filterwarnings("ignore", message=".*smaller than the logging interval.*")
            warnings.filterwarnings("ignore", message=".*LeafSpec.*")
            yield
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)


def make_runner(variant: str, case: BenchCase, settings: BenchSettings, shared: dict[str, Any]) -> Runner:
    cls = LightningRunner if variant in LIGHTNING_VARIANTS else PlainRunner
    return cls(variant, case, settings, shared)


# ---------------------------------------------------------------------- kernel counts and floors
def count_kernels(fn: Callable[[], Any]) -> int | None:
    """CUDA kernels (and memcpy/memset) launched by one call of `fn`, from the profiler; None if unknown."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    try:
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            fn()
            torch.cuda.synchronize()
        events = list(prof.events())
    except Exception:
        return None
    # GPU-side records first (one per kernel, memcpy, memset); else the host-side launch calls.
    cuda = torch.autograd.DeviceType.CUDA
    on_gpu = sum(1 for e in events if getattr(e, "device_type", None) == cuda)
    launches = sum(1 for e in events if getattr(e, "name", "") in report.LAUNCH_API_NAMES)
    return on_gpu or launches or None


def case_floors(
    case: BenchCase, gpu_state: dict[str, Any], settings: BenchSettings
) -> tuple[Any, int | None]:
    """(Floors or None, kernel count) of `case`: kernels counted on one eager pass."""
    import torch

    bw, empty = gpu_state.get("copy_bandwidth_bytes_per_s"), gpu_state.get("empty_kernel_us")
    runner = PlainRunner("eager", case, settings, {})
    runner.setup()
    try:
        assert runner.step is not None
        runner.step(0)
        step = runner.step
        kernels = count_kernels(lambda: step(1))
        model = runner._keep[0]
        param_bytes = report.param_bytes_by_dtype(model)
    finally:
        runner.close()
        torch.cuda.empty_cache()
    if not bw:
        return None, kernels
    f = report.floors(
        param_bytes,
        kernels,
        bw,
        empty,
        chain=case.chain,
        # PyTorch's AdamW keeps exp_avg / exp_avg_sq in the parameters' dtype.
        state_bytes_per_element=report.dtype_bytes(case.dtype),
    )
    return f, kernels


# ---------------------------------------------------------------------- the run
def _error_text(exc: BaseException) -> str:
    last = traceback.format_exception_only(type(exc), exc)[-1].strip()
    return last[:500]


def run_case(
    case: BenchCase,
    settings: BenchSettings,
    gpu_state: dict[str, Any],
    forced: bool,
    log: Callable[[str], None],
) -> list[dict[str, Any]]:
    """Time every selected variant of `case`, interleaved round-robin over repeats; one row per variant."""
    import torch

    variants = settings.variants_for(case.chain)
    floors_, kernels = None, None
    try:
        floors_, kernels = case_floors(case, gpu_state, settings)
    except Exception as exc:
        log(f"  floors unavailable for {case.label}: {_error_text(exc)}")
    shared: dict[str, Any] = {}
    runners: dict[str, Runner] = {}
    errors: dict[str, str] = {}
    setup_s: dict[str, float] = {}
    # The prefetch variant is set up before its decoy so the decoy can reuse the tuned plans.
    for v in variants:
        t0 = time.perf_counter()
        runner = make_runner(v, case, settings, shared)
        try:
            runner.setup()
            runners[v] = runner
        except Exception as exc:
            errors[v] = f"setup: {_error_text(exc)}"
            log(f"  {v}: setup failed: {errors[v]}")
            runner.close()
        setup_s[v] = time.perf_counter() - t0
    times: dict[str, list[list[float]]] = {v: [] for v in variants}
    for r in range(settings.repeats):
        order = [v for v in variants if v in runners]
        order = order[r % len(order) :] + order[: r % len(order)] if order else []
        for v in order:
            if v in errors:
                continue
            try:
                times[v].append(runners[v].run(settings.steps))
            except Exception as exc:
                errors[v] = f"run (repeat {r}): {_error_text(exc)}"
                log(f"  {v}: failed: {errors[v]}")
    rows = []
    for v in variants:
        repeat_medians = [statistics.median(t) for t in times[v]]
        row: dict[str, Any] = {
            "config": case.label,
            **case.key(),
            "variant": v,
            "layer_mib": case.width * case.width * report.dtype_bytes(case.dtype) / (1 << 20),
            "repeats": settings.repeats,
            "steps_per_repeat": settings.steps,
            "median_us": None,
            "ci_lo_us": None,
            "ci_hi_us": None,
            "ci_coverage": None,
            "n": len(repeat_medians),
            "repeat_medians_us": repeat_medians,
            "step_times_us": times[v],
            "kernel_count": kernels,
            "floor_bytes_us": floors_.bytes_us if floors_ else None,
            "floor_launch_us": floors_.launch_us if floors_ else None,
            "floor_us": floors_.larger if floors_ else None,
            "floor_bound": floors_.bound if floors_ else None,
            "forced": forced,
            "error": errors.get(v),
            "setup_s": round(setup_s.get(v, 0.0), 3),
            "info": runners[v].info if v in runners else {},
        }
        if repeat_medians and v not in errors:
            ci = report.median_ci(repeat_medians)
            row.update(median_us=ci.median, ci_lo_us=ci.lo, ci_hi_us=ci.hi, ci_coverage=ci.coverage)
        rows.append(row)
    # Only now, with every variant's graphs gone, is memory handed back (never between replays).
    compiled_ro = "compile_ro" in runners
    for runner in runners.values():
        runner.close()
    runners.clear()
    if compiled_ro:
        _reset_cudagraph_trees()
    gc.collect()
    torch.cuda.empty_cache()
    return rows


def _reset_cudagraph_trees() -> None:
    """Drop reduce-overhead's CUDA-graph trees (their graphs and pool) once the case is done.

    ``torch._dynamo.reset()``: it resets the cudagraph trees ("global state not tied to a specific
    backend instance", torch/_dynamo/__init__.py) together with the compiled code, whose cudagraph
    wrappers are bound to the tree manager they were first run under, so resetting the trees alone
    (``torch._inductor.cudagraph_trees.reset_cudagraph_trees``) would leave cached code that calls
    into a shut-down manager. The next case recompiles before any capture (in ``setup``).
    """
    try:
        import torch._dynamo

        torch._dynamo.reset()
    except Exception:
        pass


def _print_rows(rows: Sequence[dict[str, Any]], log: Callable[[str], None]) -> None:
    for row in rows:
        if row.get("error"):
            log(f"  {row['variant']:<24} ERROR {row['error']}")
            continue
        speed = row.get("speedup_vs_baseline")
        gain = row.get("gain_vs_no_prefetch")
        floor = row.get("ratio_to_floor")
        log(
            f"  {row['variant']:<24}{row['median_us']:>10.1f} us  [{row['ci_lo_us']:.1f}, {row['ci_hi_us']:.1f}]"
            + (f"  {speed:5.2f}x vs {row.get('baseline')}" if speed else "")
            + (f"  prefetch {gain:+.1%}" if gain is not None else "")
            + (f"  {floor:.1f}x floor" if floor else "")
        )


def run_bench(
    settings: BenchSettings, log: Callable[[str], None] = print, argv: Sequence[str] | None = None
) -> int:
    """The whole harness: criteria hash, doctor, timing, report files. Returns the exit code.

    Exit codes: 0 done (failed criteria are results, not errors), 2 refused (GPU not ready without
    ``--force``, no GPU, unreadable criteria).
    """
    from l2lightning import doctor

    t_start = time.perf_counter()
    criteria, sha = [], None
    if settings.criteria is not None:
        try:
            criteria, sha = report.load_criteria(settings.criteria)
        except (OSError, ValueError) as exc:
            log(f"l2lightning bench: cannot read criteria {settings.criteria}: {exc}")
            return 2
        log(f"pre-registered criteria: {settings.criteria} sha256={sha} ({len(criteria)} criteria)")
    else:
        log(
            "no pre-registered criteria (pass --criteria PATH); timings will not be checked against expectations"
        )

    state = doctor.collect(settings.device, load_seconds=settings.doctor_load_seconds)
    findings = doctor.diagnose(state)
    ready, reasons = doctor.ready_for_timing(state, findings)
    if not state.get("gpu_available"):
        log(doctor.format_report(state, findings))
        log("l2lightning bench: no usable CUDA GPU; nothing can be timed (see the doctor's report above)")
        return 2
    if not ready and not settings.force:
        log(doctor.format_report(state, findings))
        log(
            "l2lightning bench: the GPU is not ready for timing (reasons above); fix them, or pass --force to time "
            "anyway (results are then marked forced: true)"
        )
        return 2
    forced = not ready
    if forced:
        log(
            "l2lightning bench: GPU not ready for timing, continuing because of --force: "
            + "; ".join(reasons)
        )

    out = settings.out or DEFAULT_RESULTS_ROOT / gpu_slug(state.get("gpu_name"))
    out.mkdir(parents=True, exist_ok=True)
    prereg = {
        "criteria_path": str(settings.criteria) if settings.criteria else None,
        "sha256": sha,
        "registered_at_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "criteria": [asdict(c) for c in criteria],
    }
    if settings.criteria is not None:
        shutil.copyfile(settings.criteria, out / "criteria.yaml")
        report.write_json(out / "preregistration.json", prereg)
        log(f"criteria stored before timing: {out / 'preregistration.json'}")

    _raise_compile_limits()
    rows: list[dict[str, Any]] = []

    def document(complete: bool) -> dict[str, Any]:
        results = report.evaluate(criteria, rows) if complete else []
        return {
            "schema": "l2lightning.bench/1",
            "complete": complete,
            "environment": report.environment_info(state, argv),
            "doctor": doctor.to_dict(state, findings),
            "ready_for_timing": ready,
            "forced": forced,
            "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(settings).items()},
            "preregistration": prereg,
            "results": rows,
            "criteria_results": [r.to_dict() for r in results],
            "wall_s": round(time.perf_counter() - t_start, 1),
        }

    for width, depth in settings.models:
        for batch in settings.batches:
            for chain in settings.chains:
                case = BenchCase(width, depth, batch, settings.dtype, chain)
                if not settings.variants_for(chain):
                    continue
                log(f"{case.label} [{chain}]: {', '.join(settings.variants_for(chain))}")
                case_rows = run_case(case, settings, state, forced, log)
                report.add_comparisons(case_rows)
                _print_rows(case_rows, log)
                rows.extend(case_rows)
                # Written after every case (``complete: false``) so a crash late in a sweep keeps the rest.
                report.write_json(out / "results.json", document(complete=False))
    report.add_comparisons(rows)
    final = document(complete=True)
    json_path = report.write_json(out / "results.json", final)
    csv_path = report.write_csv(out / "results.csv", rows, CSV_COLUMNS)
    plots = []
    try:
        plots = report.make_plots(final, out)
    except Exception as exc:  # matplotlib missing or a plotting bug must not lose the timings
        log(f"plots skipped: {_error_text(exc)} (`pip install matplotlib`)")
    if final["criteria_results"]:
        log("criteria (pre-registered, sha256 " + (sha or "?") + "):")
        for res in report.evaluate(criteria, rows):
            log(f"  {res}")
    log(f"wrote {json_path}, {csv_path}" + "".join(f", {p}" for p in plots))
    log(f"total {final['wall_s']} s")
    return 0


def _raise_compile_limits() -> None:
    """Many configurations recompile the block function; past dynamo's limit it would silently run eager."""
    try:
        import torch._dynamo

        for name in ("recompile_limit", "cache_size_limit"):
            if hasattr(torch._dynamo.config, name):
                setattr(torch._dynamo.config, name, max(64, getattr(torch._dynamo.config, name)))
    except Exception:
        pass


# ---------------------------------------------------------------------- CLI glue
def _int_list(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.replace(" ", "").split(",") if v]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def _non_negative_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {text!r}")
    return value


def _model_list(text: str) -> list[tuple[int, int]]:
    out = []
    for part in text.replace(" ", "").split(","):
        m = re.fullmatch(r"(\d+)x(\d+)", part)
        if not m or int(m.group(1)) < 1 or int(m.group(2)) < 1:
            raise argparse.ArgumentTypeError(
                f"expected WIDTHxDEPTH[,WIDTHxDEPTH...] (e.g. 1536x40), got {text!r}"
            )
        out.append((int(m.group(1)), int(m.group(2))))
    return out


def _name_list(choices: Sequence[str]) -> Callable[[str], list[str]]:
    def parse(text: str) -> list[str]:
        names = [v for v in text.replace(" ", "").split(",") if v]
        bad = [n for n in names if n not in choices]
        if bad or not names:
            raise argparse.ArgumentTypeError(f"unknown {bad or text!r}; choose from {', '.join(choices)}")
        return names

    return parse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``l2lightning bench`` options."""
    parser.add_argument("--widths", type=_int_list, default=[1536], help="layer widths d (default 1536)")
    parser.add_argument(
        "--depths", type=_int_list, default=[40], help="block counts (default 40); crossed with --widths"
    )
    parser.add_argument(
        "--models",
        type=_model_list,
        default=None,
        help="WIDTHxDEPTH pairs, e.g. 1536x40,1024x60 (overrides --widths/--depths)",
    )
    parser.add_argument(
        "--batches", type=_int_list, default=None, help="batch sizes (default 4,8,16,64; --quick: 16)"
    )
    parser.add_argument(
        "--chains",
        type=_name_list(tuple(CHAIN_VARIANTS)),
        default=None,
        help="step,forward_backward,forward (default all)",
    )
    parser.add_argument(
        "--variants",
        type=_name_list(ALL_VARIANTS),
        default=None,
        help=f"subset of: {', '.join(ALL_VARIANTS)}",
    )
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    parser.add_argument(
        "--repeats",
        type=_positive_int,
        default=None,
        help="interleaved repeats per variant (default 10; --quick: 6)",
    )
    parser.add_argument(
        "--steps", type=_positive_int, default=None, help="timed steps per repeat (default 30; --quick: 10)"
    )
    parser.add_argument(
        "--prefetch", choices=("auto", "default"), default="auto", help="plans for graph_prefetch variants"
    )
    parser.add_argument(
        "--optimizer", choices=OPTIMIZER_IMPLS, default="fused", help="AdamW implementation (every variant)"
    )
    parser.add_argument(
        "--criteria",
        type=Path,
        default=None,
        help=f"pre-registered criteria YAML (default {DEFAULT_CRITERIA} when it exists; '' for none)",
    )
    parser.add_argument(
        "--out",
        type=Path,
        default=None,
        help="output directory (default benchmarks/results/<gpu-name-slug>/)",
    )
    parser.add_argument("--device", type=_non_negative_int, default=0, help="CUDA device index")
    parser.add_argument(
        "--force",
        action="store_true",
        help="time even when the doctor says the GPU is not ready (results marked forced)",
    )
    parser.add_argument("--quick", action="store_true", help="a short run (< 3 minutes on an H200)")


def settings_from_args(args: argparse.Namespace) -> BenchSettings:
    """BenchSettings from parsed ``bench`` arguments (``--quick`` shortens the defaults only)."""
    models = args.models or [(w, d) for w in args.widths for d in args.depths]
    if args.criteria is None:
        criteria = DEFAULT_CRITERIA if DEFAULT_CRITERIA.is_file() else None
    else:
        criteria = args.criteria if str(args.criteria) not in ("", ".") else None
    return BenchSettings(
        models=models,
        batches=args.batches or ([16] if args.quick else [4, 8, 16, 64]),
        chains=args.chains or ["step", "forward_backward", "forward"],
        variants=args.variants,
        dtype=args.dtype,
        repeats=args.repeats or (6 if args.quick else 10),
        steps=args.steps or (10 if args.quick else 30),
        lightning_skip=6 if args.quick else 8,
        prefetch=args.prefetch,
        optimizer=args.optimizer,
        device=args.device,
        criteria=criteria,
        out=args.out,
        force=args.force,
        quick=args.quick,
    )


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m l2lightning.bench`` / ``benchmarks/harness.py``: the same as ``l2lightning bench``."""
    from l2lightning.cli import main as cli_main

    return cli_main(["bench", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    sys.exit(main())
