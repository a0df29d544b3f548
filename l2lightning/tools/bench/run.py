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

Where each part lives: :mod:`~l2lightning.tools.bench.settings` (what to time),
:mod:`~l2lightning.tools.bench.mlp` (the harness's MLP and its cases),
:mod:`~l2lightning.tools.bench.families` (``--families``: the package's LightningModules),
:mod:`~l2lightning.tools.bench.runners` and :mod:`~l2lightning.tools.bench.lightning_runners` (one
variant each, timed), :mod:`~l2lightning.tools.bench.step_floors` (how fast a step could be) and
:mod:`~l2lightning.tools.bench.results` (rows, CSV, plots). This module runs them in order; their
names are importable from here too, as the tests and benchmarks/bench_host_overhead.py use them.

Timing: each (variant, repeat) gives the median of its steps; the reported median and its
order-statistic 95% CI are over those per-repeat medians (see :func:`l2lightning.tools.report.median_ci`).

The GPU state is checked with the doctor first (:func:`l2lightning.tools.doctor.check_before_timing`);
timing is refused unless ``--force``, which marks every result ``forced: true``. Pre-registered
criteria are hashed and stored before any timing and evaluated after it. ``results.json`` is
rewritten after every case (``complete: false``) and once at the end with the criteria verdicts,
beside ``results.csv`` and the plots (the MLP cases' in the output directory, each family's in
``families/<family>/``). A case that fails as a whole (a family whose config does not compose, say)
gives error rows and the sweep goes on.
"""

from __future__ import annotations

import gc
import shutil
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from l2lightning.step_timer import StepTimer
from l2lightning.tools import report
from l2lightning.tools.bench.families import (
    FAMILY_BATCHES,
    TINY_FAMILY_OVERRIDES,
    FamilyCase,
    ModelFacts,
    build_family,
    capture_fields,
    compose_family,
    eager_family_step,
    family_batches,
    family_step_floors,
    model_facts,
    module_optimizer,
)
from l2lightning.tools.bench.lightning_runners import (
    FamilyRunner,
    LightningRunner,
    callback_summary,
    cycled_loader,
    lightning_trainer,
    quiet_lightning,
)
from l2lightning.tools.bench.mlp import (
    BenchCase,
    build_model,
    compiled_block,
    lightning_module,
    make_batches,
    regression_loss,
)
from l2lightning.tools.bench.results import (
    CSV_COLUMNS,
    FAMILY_CSV_COLUMNS,
    error_text,
    gpu_slug,
    print_rows,
    variant_row,
    write_plots,
)
from l2lightning.tools.bench.runners import PlainRunner, Runner, time_steps
from l2lightning.tools.bench.settings import (
    DEFAULT_CRITERIA,
    DEFAULT_RESULTS_ROOT,
    BenchSettings,
    family_names,
)
from l2lightning.tools.bench.step_floors import case_floors, count_kernels, family_floors
from l2lightning.tools.bench.variants import LIGHTNING_VARIANTS

__all__ = [
    "CSV_COLUMNS",
    "DEFAULT_CRITERIA",
    "DEFAULT_RESULTS_ROOT",
    "FAMILY_BATCHES",
    "FAMILY_CSV_COLUMNS",
    "TINY_FAMILY_OVERRIDES",
    "BenchCase",
    "BenchSettings",
    "FamilyCase",
    "FamilyRunner",
    "LightningRunner",
    "ModelFacts",
    "PlainRunner",
    "Runner",
    "bench_cases",
    "build_family",
    "build_model",
    "callback_summary",
    "capture_fields",
    "case_floors",
    "compiled_block",
    "compose_family",
    "count_kernels",
    "eager_family_step",
    "family_batches",
    "family_floors",
    "family_names",
    "family_step_floors",
    "gpu_slug",
    "make_batches",
    "make_runner",
    "model_facts",
    "module_optimizer",
    "regression_loss",
    "run_bench",
    "run_case",
    "time_steps",
    "variant_row",
    "write_plots",
]

# benchmarks/bench_host_overhead.py builds its fits from these, under the names they had here.
_step_timer = StepTimer
_trainer = lightning_trainer
_loader = cycled_loader
_quiet_lightning = quiet_lightning
_lightning_module = lightning_module


def make_runner(
    variant: str, case: BenchCase | FamilyCase, settings: BenchSettings, shared: dict[str, Any]
) -> Runner:
    """The runner of `variant` for `case`; a family case runs only the Lightning variants (ValueError otherwise)."""
    if isinstance(case, FamilyCase):
        if variant not in LIGHTNING_VARIANTS:
            raise ValueError(
                f"family cases run only the Lightning variants {list(LIGHTNING_VARIANTS)}, not {variant!r}"
            )
        return FamilyRunner(variant, case, settings, shared)
    cls = LightningRunner if variant in LIGHTNING_VARIANTS else PlainRunner
    return cls(variant, case, settings, shared)


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
        log(f"  floors unavailable for {case.label}: {error_text(exc)}")
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
            errors[v] = f"setup: {error_text(exc)}"
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
                errors[v] = f"run (repeat {r}): {error_text(exc)}"
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

    check = doctor.check_before_timing(
        settings.device, force=settings.force, load_seconds=settings.doctor_load_seconds, log=log
    )
    if check.refused:
        return 2
    state, forced = check.state, check.forced

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
            "doctor": check.to_dict(),
            "ready_for_timing": check.ready,
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
            error = f"case: {error_text(exc)}"
            case_rows = [variant_row(case, v, settings, forced, error=error) for v in variants]
        report.add_comparisons(case_rows)
        print_rows(case_rows, log)
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


def _raise_compile_limits() -> None:
    """Many configurations recompile the block function; past dynamo's limit it would silently run eager."""
    try:
        import torch._dynamo

        for name in ("recompile_limit", "cache_size_limit"):
            if hasattr(torch._dynamo.config, name):
                setattr(torch._dynamo.config, name, max(64, getattr(torch._dynamo.config, name)))
    except Exception:
        pass
