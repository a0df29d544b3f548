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

Model families (``--families vit,recommender`` or ``all``; the names of
``l2lightning.app.models.FAMILIES``): for each family and each ``--batches`` size, a case ``vit b8
[step]`` fits the family's LightningModule with the Lightning variants only: ``lightning_eager``,
``callback_off``, ``callback_auto``, and ``callback_decoy`` when ``--variants`` names it. The other
variants time this harness's own MLP outside Lightning, so they are skipped for families (one note
in the log). Module and data module come from the package's Hydra configs (``conf/model/<family>``,
``conf/data/<family>``, composed as ``l2lightning-train model=<family> data.batch_size=<batch>``
would compose them), the module initialised from the config's seed and trained with its own
``configure_optimizers`` (``--dtype`` and ``--optimizer`` apply to MLP cases only). As for the
MLP, a few batches are drawn from the data module once, put on the GPU and cycled through each fit,
so the data pipeline is not timed. A family row has ``family``, ``params``, ``param_bytes`` and
``captured`` / ``capture_reason`` (whether the callback's fits captured the step, and why not),
with ``width``/``depth`` None and ``layer_mib`` the largest single parameter tensor. Without
``--models`` (or ``--widths``/``--depths``) only family cases run.

Timing: CUDA events recorded at each step boundary (start to start, so the loop's own CPU work is
included, as a user sees it); Lightning steps are timed from ``on_train_batch_start`` to the
next. Each (variant, repeat) gives the median of its steps; the reported median and its
order-statistic 95% CI are over those per-repeat medians (see :func:`l2lightning.tools.report.median_ci`).
Floors per case: bytes from :func:`l2lightning.tools.floors_module.step_bytes` (AdamW states in the parameters'
dtype, as PyTorch keeps them) over the doctor's copy bandwidth, and kernels counted on one eager
pass with ``torch.profiler`` times the doctor's empty-kernel cost (compiled variants launch fewer
kernels, so their launch floor is an upper estimate). For a family the eager pass is one
``training_step`` + backward + ``step()`` of the module's own optimizer, outside Lightning.

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
once at the end with the criteria verdicts, beside ``results.csv`` and the plots (the MLP cases'
in the output directory, each family's in ``families/<family>/``). A case that fails as a whole
(a family whose config does not compose, say) gives error rows and the sweep goes on.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import itertools
import json
import logging
import math
import re
import shutil
import statistics
import time
import traceback
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from l2lightning import floors as floors_module
from l2lightning.tools import report
from l2lightning.tools.bench.variants import (
    ALL_VARIANTS,
    CHAIN_VARIANTS,
    FAMILY_DEFAULT_VARIANTS,
    LIGHTNING_VARIANTS,
    OPTIMIZER_IMPLS,
)

# Distinct batches drawn from a family's data module and cycled through every fit (as make_batches).
FAMILY_BATCHES = 4
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
# Appended to CSV_COLUMNS when the results hold family rows (an MLP-only CSV keeps its columns).
FAMILY_CSV_COLUMNS = ("family", "params", "captured", "capture_reason", "fallback_steps")
DEFAULT_RESULTS_ROOT = Path("benchmarks") / "results"
DEFAULT_CRITERIA = Path("benchmarks") / "criteria.yaml"


# ---------------------------------------------------------------------- settings
@dataclass
class BenchSettings:
    """What to time and how (the CLI fills it; see ``l2lightning bench --help``)."""

    models: list[tuple[int, int]] = field(default_factory=lambda: [(1536, 40)])
    # model families (names of l2lightning.app.models.FAMILIES), each timed at every batch size
    families: list[str] = field(default_factory=list)
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
        if not self.models and not self.families:
            raise ValueError(
                "no model configuration: give `--models` (or `--widths`/`--depths`) or `--families`"
            )
        if self.families:
            known = family_names()
            unknown_families = [f for f in self.families if f not in known]
            if unknown_families:
                raise ValueError(f"unknown model families {unknown_families}; known: all, {', '.join(known)}")
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
        floors_module.dtype_bytes(self.dtype)  # raises on an unknown dtype

    def variants_for(self, chain: str) -> list[str]:
        return [v for v in CHAIN_VARIANTS[chain] if self.variants is None or v in self.variants]

    def family_variants(self) -> list[str]:
        """The variants a family case runs: Lightning ones only (the rest time the harness's own MLP).

        By default lightning_eager, callback_off and callback_auto; callback_decoy, a control, only
        when ``--variants`` names it.
        """
        if self.variants is None:
            return list(FAMILY_DEFAULT_VARIANTS)
        return [v for v in LIGHTNING_VARIANTS if v in self.variants]


def family_names() -> tuple[str, ...]:
    """The model families, in ``l2lightning.app.models.FAMILIES`` order (importing it imports Lightning)."""
    from l2lightning.app.models import FAMILIES

    return tuple(FAMILIES)


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

    def variants(self, settings: BenchSettings) -> list[str]:
        return settings.variants_for(self.chain)

    def prepare(self) -> None:
        """Nothing to build before the runners (see :meth:`FamilyCase.prepare`)."""

    def row_fields(self) -> dict[str, Any]:
        return {"layer_mib": self.width * self.width * floors_module.dtype_bytes(self.dtype) / (1 << 20)}

    def variant_fields(self, variant: str, runner: Runner | None) -> dict[str, Any]:
        return {}


# ---------------------------------------------------------------------- model families
@dataclass(frozen=True)
class ModelFacts:
    """What the floors and the rows need to know of a module's parameters."""

    params: int
    param_bytes: dict[str, int]
    # the dtype holding most parameter bytes (AdamW keeps its states in it)
    dtype: str
    # the largest single parameter tensor, the family counterpart of the MLP's d x d layer
    layer_mib: float


def model_facts(module: Any) -> ModelFacts:
    """Parameter count, bytes per dtype, dominant dtype and largest tensor (MiB) of a torch module."""
    params = list(module.parameters())
    if not params:
        raise ValueError(f"{type(module).__name__} has no parameters: nothing to train or time")
    param_bytes = floors_module.param_bytes_by_dtype(module)
    return ModelFacts(
        params=sum(p.numel() for p in params),
        param_bytes=param_bytes,
        dtype=max(param_bytes, key=lambda name: param_bytes[name]),
        layer_mib=max(p.numel() * p.element_size() for p in params) / (1 << 20),
    )


def compose_family(family: str, batch: int, overrides: Sequence[str] = ()) -> Any:
    """train.yaml composed for `family` as ``l2lightning-train model=<family> data.batch_size=<batch>``.

    The configs are found as the training entry point finds them (:func:`l2lightning._resources.config_dir`,
    a checkout or the installed wheel). `overrides` are further Hydra overrides (tests shrink the
    models with them). The data config then asks for only :data:`FAMILY_BATCHES` training batches
    (``train_batches`` or ``steps_per_epoch``, whichever it has) and no validation data: the
    harness draws that many batches and cycles them (see :func:`family_batches`).

    Raises:
        ValueError: an unknown family (the message lists the known ones).
    """
    from hydra import compose, initialize_config_dir
    from omegaconf import open_dict

    from l2lightning._resources import config_dir

    known = family_names()
    if family not in known:
        raise ValueError(f"unknown model family {family!r}; known: {', '.join(known)}")
    with initialize_config_dir(str(config_dir()), version_base="1.3"):
        cfg = compose("train", overrides=[f"model={family}", f"data.batch_size={batch}", *overrides])
    with open_dict(cfg.data):
        for key in ("train_batches", "steps_per_epoch"):
            if key in cfg.data:
                cfg.data[key] = FAMILY_BATCHES
        if "val_batches" in cfg.data:
            cfg.data.val_batches = 0  # the harness's Trainer never validates (limit_val_batches=0)
    return cfg


def build_family(cfg: Any) -> tuple[Any, Any]:
    """The LightningModule and data module `cfg` describes, as :func:`l2lightning.app.train.run` builds them.

    The module is initialised from ``cfg.seed`` (every variant starts from the same weights) and
    float32 matmuls run at the config's precision, as in the training entry point.
    """
    import torch
    from hydra.utils import instantiate

    torch.set_float32_matmul_precision(cfg.get("float32_matmul_precision", "highest"))
    torch.manual_seed(int(cfg.get("seed", 0)))
    module = instantiate(cfg.model, _convert_="all")
    datamodule = instantiate(cfg.data, _convert_="all")
    return module, datamodule


def family_batches(datamodule: Any, device: Any, count: int = FAMILY_BATCHES) -> list[Any]:
    """The first `count` training batches of `datamodule`, on `device`.

    Cycled through every fit by :func:`_loader`, as the MLP's batches are: the timed steps are the
    training step's, not the data pipeline's (synthetic images are made per sample on the CPU, and
    CartPole rollouts would run the policy on the host between steps).
    """
    from lightning.fabric.utilities.apply_func import move_data_to_device

    datamodule.setup("fit")
    batches = [
        move_data_to_device(batch, device) for batch in itertools.islice(datamodule.train_dataloader(), count)
    ]
    if not batches:
        raise ValueError(f"{type(datamodule).__name__}.train_dataloader() yielded no batch")
    return batches


def module_optimizer(module: Any) -> Any:
    """The (first) optimizer of ``module.configure_optimizers()``, in any of Lightning's return forms."""
    import torch

    conf = module.configure_optimizers()
    while not isinstance(conf, torch.optim.Optimizer):
        if isinstance(conf, Mapping) and "optimizer" in conf:
            conf = conf["optimizer"]
        elif isinstance(conf, (list, tuple)) and conf:
            conf = conf[0]
        else:
            raise TypeError(
                f"{type(module).__name__}.configure_optimizers() returned {type(conf).__name__}; "
                "expected an optimizer, a list of them or a dict with an 'optimizer'"
            )
    return conf


def eager_family_step(module: Any, optimizer: Any, batches: Sequence[Any]) -> Callable[[int], Any]:
    """``step(i)``: zero-grad, ``training_step`` on batch i, backward, optimizer step (outside Lightning)."""
    from l2lightning.capture import loss_of

    source = f"{type(module).__name__}.training_step"

    def step(i: int) -> Any:
        optimizer.zero_grad(set_to_none=True)
        loss = loss_of(module.training_step(batches[i % len(batches)], i), source)
        loss.backward()
        optimizer.step()
        return loss

    return step


def family_step_floors(
    facts: ModelFacts, kernel_count: int | None, copy_bw: float, empty_kernel_us: float | None
) -> floors_module.Floors:
    """Floors of one training step: weights, grads and both AdamW states (6P + 4S bytes, see step_bytes)."""
    return floors_module.floors(
        facts.param_bytes,
        kernel_count,
        copy_bw,
        empty_kernel_us,
        chain="step",
        # PyTorch's AdamW keeps exp_avg / exp_avg_sq in the parameters' dtype.
        state_bytes_per_element=floors_module.dtype_bytes(facts.dtype),
    )


def capture_fields(variant: str, summaries: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """``captured`` / ``capture_reason`` / ``fallback_steps`` of a variant over its fits' callback summaries.

    ``captured`` is True only when every fit captured its step; otherwise ``capture_reason`` gives
    the callback's reason (and in how many fits). None where there is no callback or no fit ran.
    """
    if variant == "lightning_eager" or not summaries:
        return {"captured": None, "capture_reason": None, "fallback_steps": None}
    missed = [s for s in summaries if s.get("captured") is not True]
    reason = None
    if missed:
        reason = next(
            (
                str(s.get("reason") or s.get("summary_error"))
                for s in missed
                if s.get("reason") or s.get("summary_error")
            ),
            "no reason given",
        )
        if len(missed) < len(summaries):
            reason = f"not captured in {len(missed)} of {len(summaries)} fits: {reason}"
    return {
        "captured": not missed,
        "capture_reason": reason,
        "fallback_steps": max(int(s.get("fallback_steps") or 0) for s in summaries),
    }


@dataclass
class FamilyCase:
    """One model family at one batch size: the whole training step, Lightning variants only."""

    family: str
    batch: int
    overrides: tuple[str, ...] = ()
    chain: str = "step"
    cfg: Any = field(default=None, repr=False, compare=False)
    facts: ModelFacts | None = field(default=None, compare=False)

    @property
    def label(self) -> str:
        return f"{self.family} b{self.batch}"

    @property
    def dtype(self) -> str:
        return self.facts.dtype if self.facts is not None else "float32"

    def key(self) -> dict[str, Any]:
        # width/depth are the MLP's; None keeps family rows out of criteria scoped on them.
        return {
            "family": self.family,
            "width": None,
            "depth": None,
            "batch": self.batch,
            "dtype": self.facts.dtype if self.facts is not None else None,
            "chain": self.chain,
        }

    def variants(self, settings: BenchSettings) -> list[str]:
        return settings.family_variants()

    def prepare(self) -> None:
        """Compose the configs and read the module's parameters (built once on the CPU); idempotent."""
        if self.facts is not None:
            return
        cfg = compose_family(self.family, self.batch, self.overrides)
        module, _ = build_family(cfg)
        self.cfg, self.facts = cfg, model_facts(module)

    def row_fields(self) -> dict[str, Any]:
        facts, cfg = self.facts, self.cfg
        return {
            "layer_mib": facts.layer_mib if facts else None,
            "params": facts.params if facts else None,
            "param_bytes": dict(facts.param_bytes) if facts else None,
            "model_target": cfg.model.get("_target_") if cfg is not None else None,
            "data_target": cfg.data.get("_target_") if cfg is not None else None,
        }

    def variant_fields(self, variant: str, runner: Runner | None) -> dict[str, Any]:
        return capture_fields(variant, getattr(runner, "callback_summaries", None) or [])


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
        self.module, self.batches = self._module_and_batches()
        self.callback_summaries: list[dict[str, Any]] = []
        if self.variant != "lightning_eager":
            from l2lightning import L2GraphCallback  # noqa: F401  (fail in setup, with the reason, if missing)

    def _module_and_batches(self) -> tuple[Any, list[Any]]:
        """The benchmark's MLP in a LightningModule, and its batches on the device."""
        case = self.case
        model = build_model(case.width, case.depth, self.device, self.dtype)
        module = _lightning_module(model, self.settings.lr, self.settings.optimizer)
        return module, make_batches(case.width, case.batch, self.device, self.dtype)

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


# Hydra overrides that shrink each family to a CPU-sized model (the configs allow them all): the
# CPU tests and the benchmarks' --smoke modes.
TINY_FAMILY_OVERRIDES: dict[str, list[str]] = {
    "mlp_stack": ["model.width=16", "model.depth=2"],
    "rl_policy": ["model.hidden=16", "model.depth=1", "data.env_backend=numpy"],
    "recommender": [
        "model.num_tables=2",
        "model.num_embeddings=50",
        "model.embedding_dim=8",
        "model.bottom_mlp=[16]",
        "model.top_mlp=[16]",
    ],
    "conv_stack": ["model.channels=[4,8]", "data.image_size=16"],
    "vit": ["model.image_size=32", "model.dim=16", "model.depth=1", "model.heads=2"],
    "text_encoder": [
        "model.vocab_size=64",
        "model.seq_len=8",
        "model.d_model=16",
        "model.nhead=2",
        "model.num_layers=1",
        "model.dim_feedforward=32",
    ],
}


def _trainer(
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
            # family modules define validation_step; the harness's fits never validate
            warnings.filterwarnings("ignore", message=".*validation_step.*but have no .val_dataloader.*")
            yield
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)


def make_runner(
    variant: str, case: BenchCase | FamilyCase, settings: BenchSettings, shared: dict[str, Any]
) -> Runner:
    if isinstance(case, FamilyCase):
        if variant not in LIGHTNING_VARIANTS:
            raise ValueError(
                f"family cases run only the Lightning variants {list(LIGHTNING_VARIANTS)}, not {variant!r}"
            )
        return FamilyRunner(variant, case, settings, shared)
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
    launches = sum(1 for e in events if getattr(e, "name", "") in floors_module.LAUNCH_API_NAMES)
    return on_gpu or launches or None


def case_floors(
    case: BenchCase | FamilyCase, gpu_state: dict[str, Any], settings: BenchSettings
) -> tuple[Any, int | None]:
    """(Floors or None, kernel count) of `case`: kernels counted on one eager pass."""
    import torch

    if isinstance(case, FamilyCase):
        return family_floors(case, gpu_state, settings)
    bw, empty = gpu_state.get("copy_bandwidth_bytes_per_s"), gpu_state.get("empty_kernel_us")
    runner = PlainRunner("eager", case, settings, {})
    runner.setup()
    try:
        assert runner.step is not None
        runner.step(0)
        step = runner.step
        kernels = count_kernels(lambda: step(1))
        model = runner._keep[0]
        param_bytes = floors_module.param_bytes_by_dtype(model)
    finally:
        runner.close()
        torch.cuda.empty_cache()
    if not bw:
        return None, kernels
    f = floors_module.floors(
        param_bytes,
        kernels,
        bw,
        empty,
        chain=case.chain,
        # PyTorch's AdamW keeps exp_avg / exp_avg_sq in the parameters' dtype.
        state_bytes_per_element=floors_module.dtype_bytes(case.dtype),
    )
    return f, kernels


def family_floors(
    case: FamilyCase, gpu_state: dict[str, Any], settings: BenchSettings
) -> tuple[Any, int | None]:
    """(Floors or None, kernel count) of a family case: kernels of one eager training step."""
    import torch

    case.prepare()
    assert case.facts is not None
    try:
        kernels = _count_family_step_kernels(case, torch.device("cuda", settings.device))
    finally:
        gc.collect()  # the counting module, its batches and optimizer states are garbage by now
        torch.cuda.empty_cache()
    bw, empty = gpu_state.get("copy_bandwidth_bytes_per_s"), gpu_state.get("empty_kernel_us")
    if not bw:
        return None, kernels
    return family_step_floors(case.facts, kernels, bw, empty), kernels


def _count_family_step_kernels(case: FamilyCase, device: Any) -> int | None:
    """Kernels of the second eager step of a fresh copy of the family's module (the first makes the states)."""
    module, datamodule = build_family(case.cfg)
    module.to(device).train()
    step = eager_family_step(module, module_optimizer(module), family_batches(datamodule, device, count=2))
    with warnings.catch_warnings():
        # training_step's self.log warns on every call without a Trainer; it logs nothing either way.
        warnings.simplefilter("ignore")
        step(0)
        return count_kernels(lambda: step(1))


# ---------------------------------------------------------------------- the run
def _error_text(exc: BaseException) -> str:
    last = traceback.format_exception_only(type(exc), exc)[-1].strip()
    return last[:500]


def run_case(
    case: BenchCase | FamilyCase,
    settings: BenchSettings,
    gpu_state: dict[str, Any],
    forced: bool,
    log: Callable[[str], None],
) -> list[dict[str, Any]]:
    """Time every selected variant of `case`, interleaved round-robin over repeats; one row per variant.

    Raises only when the case cannot be built at all (:meth:`FamilyCase.prepare`); a variant that
    fails in set-up or in a repeat gets an error row instead.
    """
    import torch

    variants = case.variants(settings)
    case.prepare()
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
    rows = [
        variant_row(
            case,
            v,
            settings,
            forced,
            times[v],
            floors_,
            kernels,
            errors.get(v),
            setup_s.get(v, 0.0),
            runners.get(v),
        )
        for v in variants
    ]
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


def variant_row(
    case: BenchCase | FamilyCase,
    variant: str,
    settings: BenchSettings,
    forced: bool,
    times: Sequence[Sequence[float]] = (),
    floors_: Any = None,
    kernels: int | None = None,
    error: str | None = None,
    setup_s: float = 0.0,
    runner: Runner | None = None,
) -> dict[str, Any]:
    """The result row of one variant of one case (`times`: that variant's step times, one list per repeat)."""
    repeat_medians = [statistics.median(t) for t in times]
    row: dict[str, Any] = {
        "config": case.label,
        **case.key(),
        "variant": variant,
        **case.row_fields(),
        "repeats": settings.repeats,
        "steps_per_repeat": settings.steps,
        "median_us": None,
        "ci_lo_us": None,
        "ci_hi_us": None,
        "ci_coverage": None,
        "n": len(repeat_medians),
        "repeat_medians_us": repeat_medians,
        "step_times_us": [list(t) for t in times],
        "kernel_count": kernels,
        "floor_bytes_us": floors_.bytes_us if floors_ else None,
        "floor_launch_us": floors_.launch_us if floors_ else None,
        "floor_us": floors_.larger if floors_ else None,
        "floor_bound": floors_.bound if floors_ else None,
        "forced": forced,
        "error": error,
        "setup_s": round(setup_s, 3),
        "info": runner.info if runner is not None else {},
        **case.variant_fields(variant, runner),
    }
    if repeat_medians and error is None:
        ci = report.median_ci(repeat_medians)
        row.update(median_us=ci.median, ci_lo_us=ci.lo, ci_hi_us=ci.hi, ci_coverage=ci.coverage)
    return row


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
            + (f"  NOT captured: {row.get('capture_reason')}" if row.get("captured") is False else "")
        )


def run_bench(
    settings: BenchSettings, log: Callable[[str], None] = print, argv: Sequence[str] | None = None
) -> int:
    """The whole harness: criteria hash, doctor, timing, report files. Returns the exit code.

    Exit codes: 0 done (failed criteria are results, not errors), 2 refused (GPU not ready without
    ``--force``, no GPU, unreadable criteria).
    """
    from l2lightning.tools import doctor

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

    for case in bench_cases(settings, log):
        variants = case.variants(settings)
        log(f"{case.label} [{case.chain}]: {', '.join(variants)}")
        try:
            case_rows = run_case(case, settings, state, forced, log)
        except Exception as exc:  # one case that cannot be built must not end the sweep
            error = f"case: {_error_text(exc)}"
            case_rows = [variant_row(case, v, settings, forced, error=error) for v in variants]
        report.add_comparisons(case_rows)
        _print_rows(case_rows, log)
        rows.extend(case_rows)
        # Written after every case (``complete: false``) so a crash late in a sweep keeps the rest.
        report.write_json(out / "results.json", document(complete=False))
    report.add_comparisons(rows)
    final = document(complete=True)
    json_path = report.write_json(out / "results.json", final)
    has_families = any(r.get("family") for r in rows)
    columns = CSV_COLUMNS + FAMILY_CSV_COLUMNS if has_families else CSV_COLUMNS
    csv_path = report.write_csv(out / "results.csv", rows, columns)
    plots = write_plots(final, out, log)
    if final["criteria_results"]:
        log("criteria (pre-registered, sha256 " + (sha or "?") + "):")
        for res in report.evaluate(criteria, rows):
            log(f"  {res}")
    log(f"wrote {json_path}, {csv_path}" + "".join(f", {p}" for p in plots))
    log(f"total {final['wall_s']} s")
    return 0


def bench_cases(settings: BenchSettings, log: Callable[[str], None]) -> Iterator[BenchCase | FamilyCase]:
    """The cases to time, in order: MLP cases (model x batch x chain), then family cases (family x batch)."""
    for width, depth in settings.models:
        for batch in settings.batches:
            for chain in settings.chains:
                if settings.variants_for(chain):
                    yield BenchCase(width, depth, batch, settings.dtype, chain)
    if not settings.families:
        return
    names = ", ".join(settings.families)
    if "step" not in settings.chains:
        log(
            f"model families ({names}) skipped: they time the whole training step, and --chains has no `step`"
        )
        return
    variants = settings.family_variants()
    if not variants:
        log(
            f"model families ({names}) skipped: --variants names no Lightning variant "
            f"({', '.join(LIGHTNING_VARIANTS)}), the only ones a family runs"
        )
        return
    skipped = [v for v in settings.variants_for("step") if v not in variants]
    if skipped:
        log(
            f"model families run {', '.join(variants)}; not for them: {', '.join(skipped)} "
            "(eager/graph/compile variants time the harness's own MLP outside Lightning; "
            "callback_decoy runs only when --variants names it)"
        )
    for family in settings.families:
        for batch in settings.batches:
            yield FamilyCase(family, batch)


def write_plots(document: dict[str, Any], out: Path, log: Callable[[str], None]) -> list[Path]:
    """The MLP cases' plots in `out`, each family's in ``out/families/<family>/``; failures logged, not raised.

    Separate figures because the plots' labels and ordering come from width x depth, which
    family rows do not have (None): in one figure two families at one batch would share a label.
    """
    from l2lightning.tools.plots import make_plots

    rows = document.get("results", [])
    groups: dict[str | None, list[dict[str, Any]]] = {}
    for row in rows:
        groups.setdefault(row.get("family"), []).append(row)
    plots: list[Path] = []
    for family, group in groups.items():
        where = out if family is None else out / "families" / family
        try:
            plots += make_plots({**document, "results": group}, where)
        except Exception as exc:  # matplotlib missing or a plotting bug must not lose the timings
            log(
                f"plots skipped for {family or 'the MLP cases'}: {_error_text(exc)} (`pip install matplotlib`)"
            )
    return plots


def _raise_compile_limits() -> None:
    """Many configurations recompile the block function; past dynamo's limit it would silently run eager."""
    try:
        import torch._dynamo

        for name in ("recompile_limit", "cache_size_limit"):
            if hasattr(torch._dynamo.config, name):
                setattr(torch._dynamo.config, name, max(64, getattr(torch._dynamo.config, name)))
    except Exception:
        pass
