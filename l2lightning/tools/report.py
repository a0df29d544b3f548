"""Benchmark reporting: floors, medians with confidence intervals, pre-registered criteria, plots, writers.

Floors say how fast a training step could possibly be on this GPU, from two measured ceilings
(the doctor's copy bandwidth and empty-kernel cost): the bytes that must move, and the kernels
that must launch. Every timing is reported as a ratio to the larger floor.

Pre-registered criteria are expectations written down *before* timing: a YAML file whose SHA-256
is printed and stored before the first measurement, and evaluated after it. A failed criterion is
a result like any other, kept in the report.

Medians come with a distribution-free 95% confidence interval from order statistics (binomial):
see :func:`median_ci`. Plots use matplotlib's Agg canvas directly (no pyplot, no global backend
change). :class:`StepReport` formats a per-phase breakdown of one training step.
"""

from __future__ import annotations

import csv
import hashlib
import json
import math
import os
import platform
import shlex
import statistics
import sys
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

# ---------------------------------------------------------------------- floors
DTYPE_BYTES: dict[str, int] = {
    "float64": 8,
    "float32": 4,
    "tfloat32": 4,
    "float16": 2,
    "bfloat16": 2,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "float8_e4m3fnuz": 1,
    "float8_e5m2fnuz": 1,
    "int64": 8,
    "int32": 4,
    "int16": 2,
    "int8": 1,
    "uint8": 1,
}
CHAINS = ("forward", "forward_backward", "step")

# Host-side CUDA calls that put one kernel, copy or fill on a stream.
LAUNCH_API_NAMES = frozenset(
    {
        "cudaLaunchKernel",
        "cudaLaunchKernelExC",
        "cuLaunchKernel",
        "cuLaunchKernelEx",
        "cudaMemcpyAsync",
        "cudaMemsetAsync",
    }
)


def dtype_name(dtype: Any) -> str:
    """``torch.bfloat16`` or ``"torch.bfloat16"`` -> ``"bfloat16"``."""
    return str(dtype).replace("torch.", "")


def dtype_bytes(dtype: Any) -> int:
    """Bytes per element of a dtype given as a torch dtype or its name.

    Raises:
        ValueError: an unknown dtype name (the message lists the known ones).
    """
    name = dtype_name(dtype)
    if name not in DTYPE_BYTES:
        raise ValueError(f"unknown dtype {name!r}; known: {sorted(DTYPE_BYTES)}")
    return DTYPE_BYTES[name]


def param_bytes_by_dtype(model: Any) -> dict[str, int]:
    """Parameter bytes of a torch module, per dtype name (each parameter counted once)."""
    out: dict[str, int] = {}
    for p in model.parameters():
        name = dtype_name(p.dtype)
        out[name] = out.get(name, 0) + p.numel() * p.element_size()
    return out


def step_bytes(
    param_bytes: Mapping[Any, int],
    chain: str = "step",
    state_bytes_per_element: int = 4,
    activation_bytes: int = 0,
) -> dict[str, int]:
    """Bytes that must cross DRAM in one pass of `chain`, per phase.

    The byte model (P = parameter bytes in their own dtypes, N = parameter elements, S = N x
    `state_bytes_per_element`, the size of one optimizer state tensor set):

    - forward: every weight is read once: P.
    - backward: every weight is read again (input gradients) and every gradient is written: 2P.
    - optimizer (AdamW): read params P, write params P, read grads P, read and write exp_avg
      (2S) and exp_avg_sq (2S): 3P + 4S.

    So a whole step moves 6P + 4S bytes. Activations are left out by default (at small batch they
    are a small fraction of the weights); pass `activation_bytes` to add them to forward. Each
    byte is counted once per pass, as if every tensor streamed through DRAM exactly once: real
    kernels re-read (foreach optimizers take several passes), so this is a floor, not a model.
    PyTorch's AdamW keeps its states in the parameters' dtype; `state_bytes_per_element=4` is the
    fp32-state (mixed precision master) case.

    Args:
        param_bytes: parameter bytes per dtype (``{"bfloat16": 2 * n}``); keys are names or torch dtypes.
        chain: ``"forward"``, ``"forward_backward"`` or ``"step"`` (forward + backward + AdamW).
        state_bytes_per_element: bytes per element of each AdamW state tensor.
        activation_bytes: extra bytes added to forward.
    """
    if chain not in CHAINS:
        raise ValueError(f"`chain` must be one of {CHAINS}, got {chain!r}")
    if state_bytes_per_element <= 0:
        raise ValueError(f"`state_bytes_per_element` must be positive, got {state_bytes_per_element}")
    p = sum(int(b) for b in param_bytes.values())
    n = sum(int(b) // dtype_bytes(d) for d, b in param_bytes.items())
    s = n * state_bytes_per_element
    phases = {"forward": p + int(activation_bytes)}
    if chain in ("forward_backward", "step"):
        phases["backward"] = 2 * p
    if chain == "step":
        phases["optimizer"] = 3 * p + 4 * s
    return phases


@dataclass(frozen=True)
class Floors:
    """The two lower bounds of a step's time, in microseconds.

    Attributes:
        bytes_us: bytes that must move / measured copy bandwidth (bytes read + written per second).
        launch_us: kernel count x measured empty-kernel cost inside a CUDA graph (None if unknown).
        larger: the larger of the two (µs).
        bound: ``"bandwidth"`` or ``"launch"``: which floor is larger.
    """

    bytes_us: float
    launch_us: float | None
    larger: float
    bound: str
    bytes_moved: int = 0
    bytes_by_phase: dict[str, int] = field(default_factory=dict)
    kernel_count: int | None = None
    copy_bw_bytes_per_s: float = 0.0
    empty_kernel_us: float | None = None
    chain: str = "step"

    def ratio(self, measured_us: float) -> float:
        """How far above the larger floor a measurement is (1.0 = at the floor)."""
        return measured_us / self.larger

    def phase_floors(self, phase: str, kernel_count: int | None = None) -> tuple[float | None, float | None]:
        """(bytes floor, launch floor) of one phase in µs; None where unknown."""
        nbytes = self.bytes_by_phase.get(phase)
        b = None if nbytes is None else nbytes / self.copy_bw_bytes_per_s * 1e6
        launch = (
            None
            if kernel_count is None or self.empty_kernel_us is None
            else kernel_count * self.empty_kernel_us
        )
        return b, launch

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def floors(
    param_bytes: Mapping[Any, int],
    kernel_count: int | None,
    copy_bw: float,
    empty_kernel_us: float | None,
    *,
    chain: str = "step",
    state_bytes_per_element: int = 4,
    activation_bytes: int = 0,
) -> Floors:
    """Bytes floor and launch floor of one pass of `chain` (see :func:`step_bytes` for the byte model).

    Args:
        param_bytes: parameter bytes per dtype.
        kernel_count: kernels launched per pass (None: no launch floor).
        copy_bw: measured copy bandwidth in bytes (read + written) per second.
        empty_kernel_us: measured cost of an empty kernel inside a CUDA graph (µs).

    Example:
        >>> f = floors({"bfloat16": 1000}, kernel_count=100, copy_bw=1e9, empty_kernel_us=0.5)
        >>> f.bytes_us, f.launch_us, f.larger, f.bound
        (14.0, 50.0, 50.0, 'launch')
    """
    if not copy_bw or copy_bw <= 0:
        raise ValueError(f"`copy_bw` must be a positive bytes/s value, got {copy_bw!r}")
    phases = step_bytes(param_bytes, chain, state_bytes_per_element, activation_bytes)
    moved = sum(phases.values())
    bytes_us = moved / copy_bw * 1e6
    launch_us = None if kernel_count is None or empty_kernel_us is None else kernel_count * empty_kernel_us
    larger = bytes_us if launch_us is None else max(bytes_us, launch_us)
    bound = "launch" if launch_us is not None and launch_us > bytes_us else "bandwidth"
    return Floors(
        bytes_us=bytes_us,
        launch_us=launch_us,
        larger=larger,
        bound=bound,
        bytes_moved=moved,
        bytes_by_phase=phases,
        kernel_count=kernel_count,
        copy_bw_bytes_per_s=float(copy_bw),
        empty_kernel_us=empty_kernel_us,
        chain=chain,
    )


# ---------------------------------------------------------------------- medians and intervals
@dataclass(frozen=True)
class MedianCI:
    """A median with a distribution-free confidence interval.

    ``coverage`` is the interval's exact coverage probability (>= the requested confidence when
    enough samples exist; with too few, the full range [min, max] and its lower coverage).
    """

    median: float
    lo: float
    hi: float
    n: int
    coverage: float
    method: str = "order-statistic (binomial)"


def _binom_cdf_half(k: int, n: int) -> float:
    """P(B <= k) for B ~ Binomial(n, 1/2)."""
    if k < 0:
        return 0.0
    return sum(math.comb(n, i) for i in range(min(k, n) + 1)) / 2**n


def median_ci(values: Sequence[float], confidence: float = 0.95) -> MedianCI:
    """Median of `values` with an order-statistic confidence interval.

    The interval is [x_(k), x_(n-k+1)] of the sorted sample with the largest k whose coverage
    1 - 2 P(B <= k-1), B ~ Binomial(n, 1/2), is still >= `confidence`. It assumes only independent
    samples from one continuous distribution (no normality). 95% needs n >= 6; with fewer samples
    the interval is [min, max] and ``coverage`` says how much less it covers.

    Example:
        >>> ci = median_ci([5.0, 1.0, 4.0, 2.0, 3.0, 6.0, 7.0, 8.0, 9.0, 10.0])
        >>> ci.median, ci.lo, ci.hi, round(ci.coverage, 3)
        (5.5, 2.0, 9.0, 0.979)
    """
    xs = sorted(float(v) for v in values)
    n = len(xs)
    if n == 0:
        raise ValueError("median_ci needs at least one value")
    if not 0 < confidence < 1:
        raise ValueError(f"`confidence` must be in (0, 1), got {confidence}")
    med = statistics.median(xs)
    k = 1
    coverage = 1 - 2 * _binom_cdf_half(0, n) if n > 1 else 0.0
    while k + 1 <= n - k and 1 - 2 * _binom_cdf_half(k, n) >= confidence:
        k += 1
        coverage = 1 - 2 * _binom_cdf_half(k - 1, n)
    return MedianCI(med, xs[k - 1], xs[n - k], n, coverage)


# ---------------------------------------------------------------------- comparisons
# `family` is None for the harness's MLP rows; family rows have no width or depth.
GROUP_KEYS = ("family", "width", "depth", "batch", "dtype", "chain")
# Per chain, the variant every other one is compared with.
BASELINES = {"step": "lightning_eager", "forward_backward": "eager", "forward": "eager"}
# A prefetch variant and the same configuration without prefetch.
PREFETCH_BASELINES = {
    "callback_auto": "callback_off",
    "callback_decoy": "callback_off",
    "graph_prefetch": "graph",
    "graph_decoy": "graph",
    "compile_graph_prefetch": "compile_graph",
}
METRICS = (
    "median_us",
    "speedup_vs_baseline",
    "speedup_vs_lightning_eager",
    "speedup_vs_eager",
    "speedup_vs_graph",
    "speedup_vs_reduce_overhead",
    "vs_best_alternative",
    "gain_vs_no_prefetch",
    "ratio_to_floor",
)


def config_label(row: Mapping[str, Any]) -> str:
    """``d1536x40 b16``, or ``vit b16`` for a model-family row (plus the chain when it is not a whole step)."""
    if row.get("family") and row.get("width") is None:
        label = f"{row['family']} b{row.get('batch')}"
    else:
        label = f"d{row.get('width')}x{row.get('depth')} b{row.get('batch')}"
    return label if row.get("chain", "step") == "step" else f"{label} {row['chain']}"


def add_comparisons(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Fill each row's ratio metrics (see :data:`METRICS`) from the other rows of its configuration.

    Rows are dicts with the :data:`GROUP_KEYS`, ``variant`` and ``median_us`` (None when the
    variant failed); ``floor_us`` (the larger floor) enables ``ratio_to_floor``. Speedups are
    ``other / this`` (> 1: this variant is faster); ``gain_vs_no_prefetch`` is
    ``no_prefetch / this - 1`` (+0.027 = 2.7% faster); ``vs_best_alternative`` compares with the
    fastest other variant of the same configuration. Returns `rows`, changed in place.
    """
    groups: dict[tuple, dict[str, dict[str, Any]]] = {}
    for row in rows:
        groups.setdefault(tuple(row.get(k) for k in GROUP_KEYS), {})[row["variant"]] = row

    def med(group: Mapping[str, Mapping[str, Any]], variant: str | None) -> float | None:
        row = group.get(variant) if variant else None
        return None if row is None else row.get("median_us")

    def ratio(a: float | None, b: float | None) -> float | None:
        return None if a is None or b is None or b == 0 else a / b

    for group in groups.values():
        for variant, row in group.items():
            this = row.get("median_us")
            chain = row.get("chain", "step")
            row["baseline"] = BASELINES.get(chain)
            row["speedup_vs_baseline"] = ratio(med(group, BASELINES.get(chain)), this)
            row["speedup_vs_lightning_eager"] = ratio(med(group, "lightning_eager"), this)
            row["speedup_vs_eager"] = ratio(med(group, "eager"), this)
            row["speedup_vs_graph"] = ratio(med(group, "graph"), this)
            row["speedup_vs_reduce_overhead"] = ratio(med(group, "compile_ro"), this)
            base = PREFETCH_BASELINES.get(variant)
            r = ratio(med(group, base), this)
            row["gain_vs_no_prefetch"] = None if r is None else r - 1
            others = [
                (o.get("median_us"), v) for v, o in group.items() if v != variant and o.get("median_us")
            ]
            if others and this:
                best, best_variant = min(others)
                row["vs_best_alternative"] = best / this
                row["best_alternative"] = best_variant
            else:
                row["vs_best_alternative"] = None
                row["best_alternative"] = None
            floor = row.get("floor_us")
            row["ratio_to_floor"] = ratio(this, floor)
    return rows


# ---------------------------------------------------------------------- pre-registered criteria
OPS = {
    ">=": lambda a, b: a >= b,
    ">": lambda a, b: a > b,
    "<=": lambda a, b: a <= b,
    "<": lambda a, b: a < b,
    "==": lambda a, b: a == b,
    "!=": lambda a, b: a != b,
}
SCOPE_KEYS = ("variant", "chain", "width", "depth", "batch", "dtype", "layer_mib", "forced")


@dataclass(frozen=True)
class Criterion:
    """One pre-registered expectation: every result in `scope` must satisfy ``metric op threshold``.

    `scope` maps a result key to a value (equality), a list (membership) or a mapping of
    comparison operators to values (``{"<=": 16}``); all entries must hold.
    """

    id: str
    description: str
    metric: str
    op: str
    threshold: float
    scope: dict[str, Any] = field(default_factory=dict)

    def matches(self, row: Mapping[str, Any]) -> bool:
        for key, want in self.scope.items():
            have = row.get(key)
            if isinstance(want, Mapping):
                if have is None or not all(OPS[op](have, value) for op, value in want.items()):
                    return False
            elif isinstance(want, (list, tuple)):
                if have not in want:
                    return False
            elif have != want:
                return False
        return True


@dataclass
class CriterionResult:
    """How a criterion fared: status ``"passed"``, ``"failed"`` or ``"no data"`` (nothing in scope ran)."""

    criterion: Criterion
    status: str
    observations: list[dict[str, Any]] = field(default_factory=list)
    worst: float | None = None

    @property
    def passed(self) -> bool:
        return self.status == "passed"

    def to_dict(self) -> dict[str, Any]:
        return {
            **asdict(self.criterion),
            "status": self.status,
            "worst": self.worst,
            "observations": self.observations,
        }

    def __str__(self) -> str:
        c = self.criterion
        worst = "" if self.worst is None else f" (worst {self.worst:.4g})"
        return f"[{self.status.upper()}] {c.id}: {c.metric} {c.op} {c.threshold}{worst} over {len(self.observations)} result(s)"


def criteria_sha256(path: str | Path) -> str:
    """SHA-256 (hex) of the file's bytes."""
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def _criterion_from(entry: Any, index: int, path: Path) -> Criterion:
    where = f"{path} criterion #{index + 1}"
    if not isinstance(entry, Mapping):
        raise ValueError(f"{where}: must be a mapping, got {type(entry).__name__}")
    missing = [k for k in ("id", "metric", "op", "threshold") if k not in entry]
    if missing:
        raise ValueError(f"{where}: missing keys {missing}")
    unknown = set(entry) - {"id", "description", "metric", "op", "threshold", "scope"}
    if unknown:
        raise ValueError(f"{where} ({entry['id']!r}): unknown keys {sorted(unknown)}")
    if entry["metric"] not in METRICS:
        raise ValueError(
            f"{where} ({entry['id']!r}): unknown metric {entry['metric']!r}; known: {list(METRICS)}"
        )
    if entry["op"] not in OPS:
        raise ValueError(f"{where} ({entry['id']!r}): `op` must be one of {list(OPS)}, got {entry['op']!r}")
    if isinstance(entry["threshold"], bool) or not isinstance(entry["threshold"], (int, float)):
        raise ValueError(
            f"{where} ({entry['id']!r}): `threshold` must be a number, got {entry['threshold']!r}"
        )
    scope = entry.get("scope") or {}
    if not isinstance(scope, Mapping):
        raise ValueError(f"{where} ({entry['id']!r}): `scope` must be a mapping")
    for key, want in scope.items():
        if key not in SCOPE_KEYS:
            raise ValueError(
                f"{where} ({entry['id']!r}): unknown scope key {key!r}; known: {list(SCOPE_KEYS)}"
            )
        if isinstance(want, Mapping) and any(op not in OPS for op in want):
            raise ValueError(
                f"{where} ({entry['id']!r}): scope {key!r} uses an unknown operator in {dict(want)}"
            )
    return Criterion(
        id=str(entry["id"]),
        description=str(entry.get("description", "")).strip(),
        metric=entry["metric"],
        op=entry["op"],
        threshold=float(entry["threshold"]),
        scope=dict(scope),
    )


def load_criteria(path: str | Path) -> tuple[list[Criterion], str]:
    """Read a criteria YAML file; returns (criteria, SHA-256 of the file's bytes).

    The file is a mapping with a ``criteria`` list (or a bare list); each entry has ``id``,
    ``description``, ``metric`` (one of :data:`METRICS`), ``op`` (``>=``, ``>``, ``<=``, ``<``,
    ``==``, ``!=``), ``threshold`` and an optional ``scope``.

    Raises:
        FileNotFoundError: no such file.
        ValueError: malformed entries (the message names the entry and the key).
    """
    import yaml

    path = Path(path)
    data = path.read_bytes()
    parsed = yaml.safe_load(data)
    entries = parsed.get("criteria") if isinstance(parsed, Mapping) else parsed
    if not isinstance(entries, list):
        raise ValueError(f"{path}: expected a `criteria:` list of expectations")
    criteria = [_criterion_from(e, i, path) for i, e in enumerate(entries)]
    ids = [c.id for c in criteria]
    dupes = sorted({i for i in ids if ids.count(i) > 1})
    if dupes:
        raise ValueError(f"{path}: duplicate criterion ids {dupes}")
    return criteria, hashlib.sha256(data).hexdigest()


def evaluate(criteria: Sequence[Criterion], results: Iterable[Mapping[str, Any]]) -> list[CriterionResult]:
    """Mark each criterion passed / failed / no data against result rows (after :func:`add_comparisons`).

    Every row in scope that has the metric is an observation and must pass. A row in scope whose
    variant failed to run (``error`` set) counts as a failed observation. Rows in scope without
    the metric (e.g. no baseline in that configuration) are skipped.
    """
    rows = list(results)
    out = []
    for c in criteria:
        observations = []
        for row in rows:
            if not c.matches(row):
                continue
            base = {"config": config_label(row), "variant": row.get("variant")}
            if row.get("error"):
                observations.append({**base, "value": None, "passed": False, "error": row["error"]})
                continue
            value = row.get(c.metric)
            if value is None:
                continue
            observations.append({**base, "value": value, "passed": bool(OPS[c.op](value, c.threshold))})
        values = [o["value"] for o in observations if o["value"] is not None]
        worst = None
        if values:
            worst = min(values) if c.op in (">=", ">") else max(values) if c.op in ("<=", "<") else values[0]
        if not observations:
            status = "no data"
        else:
            status = "passed" if all(o["passed"] for o in observations) else "failed"
        out.append(CriterionResult(c, status, observations, worst))
    return out


# ---------------------------------------------------------------------- environment and writers
def _dist_version(*names: str) -> str | None:
    from importlib import metadata

    for name in names:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return None


def environment_info(
    gpu_state: Mapping[str, Any] | None = None, argv: Sequence[str] | None = None
) -> dict[str, Any]:
    """Command line, versions (python, torch, lightning, cupy, ...) and the doctor's GPU state."""
    import torch

    argv = list(sys.argv if argv is None else argv)
    return {
        "command": shlex.join([Path(argv[0]).name if argv else "l2lightning", *argv[1:]]),
        "argv": argv,
        "cwd": os.getcwd(),
        "time_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "lightning": _dist_version("lightning", "pytorch-lightning"),
        "cupy": _dist_version("cupy", "cupy-cuda13x", "cupy-cuda12x", "cupy-cuda11x"),
        "numpy": _dist_version("numpy"),
        "l2lightning": _dist_version("l2lightning") or __import__("l2lightning").__version__,
        "env": {k: v for k, v in os.environ.items() if k.startswith("L2L_") or k == "CUDA_VISIBLE_DEVICES"},
        "gpu": dict(gpu_state) if gpu_state is not None else None,
    }


def write_json(path: str | Path, document: Mapping[str, Any]) -> Path:
    """Write `document` as indented JSON (parents created; non-JSON values via ``str``)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(document, indent=2, default=str) + "\n")
    return path


def write_csv(
    path: str | Path, rows: Sequence[Mapping[str, Any]], columns: Sequence[str] | None = None
) -> Path:
    """Write rows as CSV; lists and dicts are stored as JSON text. Columns: first-seen order by default."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    if columns is None:
        columns = []
        for row in rows:
            columns.extend(k for k in row if k not in columns)
    with path.open("w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=list(columns), extrasaction="ignore")
        writer.writeheader()
        for row in rows:
            writer.writerow(
                {
                    k: json.dumps(v, default=str) if isinstance(v, (list, dict, tuple)) else v
                    for k, v in row.items()
                }
            )
    return path


# ---------------------------------------------------------------------- plots
VARIANT_ORDER = (
    "lightning_eager",
    "eager",
    "callback_off",
    "callback_auto",
    "callback_decoy",
    "graph",
    "graph_prefetch",
    "graph_decoy",
    "compile_ro",
    "compile_graph",
    "compile_graph_prefetch",
)


def _rows_of(results: Any) -> list[dict[str, Any]]:
    if isinstance(results, Mapping):
        return list(results.get("results", []))
    return list(results)


def _figure(width: float, height: float, ncols: int = 1) -> tuple[Any, list[Any]]:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height), dpi=110)
    FigureCanvasAgg(fig)
    axes = fig.subplots(1, ncols, squeeze=False)[0]
    return fig, list(axes)


def _ordered_variants(rows: Sequence[Mapping[str, Any]]) -> list[str]:
    seen = {r["variant"] for r in rows}
    known = [v for v in VARIANT_ORDER if v in seen]
    return known + sorted(seen - set(known))


def _configs(rows: Sequence[Mapping[str, Any]]) -> list[str]:
    keyed = sorted(
        {(r.get("width"), r.get("depth"), r.get("batch"), config_label(r)) for r in rows}, key=lambda t: t[:3]
    )
    return [t[3] for t in keyed]


def _variant_color(variant: str) -> Any:
    from matplotlib import colormaps

    index = (
        VARIANT_ORDER.index(variant) if variant in VARIANT_ORDER else len(VARIANT_ORDER) + hash(variant) % 8
    )
    return colormaps["tab20"](index % 20)


def _legend_below(ax: Any, ncol: int = 4) -> None:
    ax.legend(fontsize=7, ncol=ncol, loc="upper center", bbox_to_anchor=(0.5, -0.22), frameon=False)


def _grouped_bars(
    ax: Any, rows: Sequence[Mapping[str, Any]], value_key: str
) -> tuple[list[str], list[str], float]:
    configs = _configs(rows)
    variants = _ordered_variants(rows)
    width = 0.8 / max(1, len(variants))
    index = {(config_label(r), r["variant"]): r for r in rows}
    for j, variant in enumerate(variants):
        xs, ys = [], []
        color = _variant_color(variant)
        for i, cfg in enumerate(configs):
            row = index.get((cfg, variant))
            if row is not None and row.get(value_key) is not None:
                xs.append(i - 0.4 + width * (j + 0.5))
                ys.append(row[value_key])
        if xs:
            ax.bar(xs, ys, width=width, label=variant, color=color)
    ax.set_xticks(range(len(configs)))
    ax.set_xticklabels(configs, rotation=20, ha="right", fontsize=8)
    return configs, variants, width


def plot_speedup(rows: Sequence[Mapping[str, Any]], path: Path) -> Path | None:
    """Bar chart: speedup of each variant over its chain's baseline, per configuration."""
    rows = [r for r in rows if r.get("speedup_vs_baseline") is not None]
    chains = [c for c in ("step", "forward_backward", "forward") if any(r.get("chain") == c for r in rows)]
    if not chains:
        return None
    fig, axes = _figure(6.5 * len(chains), 5.6, len(chains))
    for ax, chain in zip(axes, chains):
        _grouped_bars(ax, [r for r in rows if r.get("chain") == chain], "speedup_vs_baseline")
        ax.axhline(1.0, color="black", linewidth=0.8)
        ax.set_ylabel(f"speedup vs {BASELINES[chain]} (x)")
        ax.set_title(f"{chain}: speedup per configuration")
        _legend_below(ax)
    fig.tight_layout()
    fig.savefig(path)
    return path


def plot_gain_vs_layer(
    rows: Sequence[Mapping[str, Any]], path: Path, l2_bytes: int | None = None
) -> Path | None:
    """Scatter: prefetch gain (%) vs layer size (MiB), one marker per variant, the L2 size marked."""
    rows = [r for r in rows if r.get("gain_vs_no_prefetch") is not None and r.get("layer_mib") is not None]
    if not rows:
        return None
    from matplotlib.ticker import NullFormatter, ScalarFormatter

    fig, (ax,) = _figure(7.0, 5.2)
    markers = {"step": "o", "forward_backward": "s", "forward": "^"}
    for variant in _ordered_variants(rows):
        for chain, marker in markers.items():
            sel = [r for r in rows if r["variant"] == variant and r.get("chain", "step") == chain]
            if sel:
                ax.scatter(
                    [r["layer_mib"] for r in sel],
                    [100 * r["gain_vs_no_prefetch"] for r in sel],
                    label=variant if chain == "step" else f"{variant} ({chain})",
                    marker=marker,
                    color=_variant_color(variant),
                    alpha=0.85,
                )
    ax.axhline(0.0, color="black", linewidth=0.8)
    if l2_bytes:
        l2_mib = l2_bytes / (1 << 20)
        ax.axvline(l2_mib, color="red", linestyle="--", label=f"L2 = {l2_mib:.0f} MiB")
        ax.axvline(l2_mib / 2, color="red", linestyle=":", label="L2 / 2 (current + next layer fit)")
    ax.set_xscale("log")
    lo, hi = ax.get_xlim()
    ax.set_xticks([2.0**k for k in range(-6, 12) if lo <= 2.0**k <= hi])
    ax.xaxis.set_major_formatter(ScalarFormatter())
    ax.xaxis.set_minor_formatter(NullFormatter())
    ax.set_xlabel("layer weights (MiB)")
    ax.set_ylabel("gain vs no prefetch (%)")
    ax.set_title("prefetch gain vs layer size (o step, s forward+backward, ^ forward)")
    _legend_below(ax, ncol=3)
    fig.tight_layout()
    fig.savefig(path)
    return path


def plot_time_vs_floors(rows: Sequence[Mapping[str, Any]], path: Path) -> Path | None:
    """Bars: median step time per variant and configuration, with the bytes and launch floors marked."""
    rows = [r for r in rows if r.get("median_us") is not None]
    chains = [c for c in ("step", "forward_backward", "forward") if any(r.get("chain") == c for r in rows)]
    if not chains:
        return None
    fig, axes = _figure(6.5 * len(chains), 5.6, len(chains))
    for ax, chain in zip(axes, chains):
        sel = [r for r in rows if r.get("chain") == chain]
        configs, _, _ = _grouped_bars(ax, sel, "median_us")
        for i, cfg in enumerate(configs):
            row = next(r for r in sel if config_label(r) == cfg)
            for key, style, name in (
                ("floor_bytes_us", "--", "bytes floor"),
                ("floor_launch_us", ":", "launch floor"),
            ):
                if row.get(key) is not None:
                    ax.hlines(
                        row[key],
                        i - 0.45,
                        i + 0.45,
                        colors="black",
                        linestyles=style,
                        label=name if i == 0 else None,
                    )
        ax.set_yscale("log")
        ax.set_ylabel("median time per pass (us)")
        ax.set_title(f"{chain}: time vs floors")
        _legend_below(ax)
    fig.tight_layout()
    fig.savefig(path)
    return path


def make_plots(results: Any, out_dir: str | Path, l2_bytes: int | None = None) -> list[Path]:
    """Write the three plots (PNG) for a result document or list of rows; returns the files written.

    ``speedup.png`` (speedup per configuration), ``prefetch_gain_vs_layer.png`` (gain vs layer MiB
    with the L2 size marked) and ``time_vs_floors.png`` (time with floor markers). A plot without
    data is skipped. `l2_bytes` defaults to the GPU state stored in the document.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    rows = _rows_of(results)
    if l2_bytes is None and isinstance(results, Mapping):
        l2_bytes = ((results.get("environment") or {}).get("gpu") or {}).get("l2_bytes")
    written = [
        plot_speedup(rows, out / "speedup.png"),
        plot_gain_vs_layer(rows, out / "prefetch_gain_vs_layer.png", l2_bytes),
        plot_time_vs_floors(rows, out / "time_vs_floors.png"),
    ]
    return [p for p in written if p is not None]


# ---------------------------------------------------------------------- step report
@dataclass(frozen=True)
class PhaseTime:
    """One phase of a step as measured by the caller (CUDA events between phases)."""

    name: str
    time_us: float
    kernel_count: int | None = None


def classify_bound(
    measured_us: float, bytes_us: float | None, launch_us: float | None, factor: float = 2.0
) -> str:
    """``"launch"`` or ``"bandwidth"`` when the time is within `factor` x the larger floor, else ``"compute"``.

    ``"compute"`` means more than `factor` x above both floors: the time goes to arithmetic or to
    memory passes beyond the one-pass byte model, not to what the floors count. ``"unknown"``
    without any floor.
    """
    known = [(v, name) for v, name in ((launch_us, "launch"), (bytes_us, "bandwidth")) if v is not None]
    if not known:
        return "unknown"
    larger, name = max(known)
    return name if measured_us <= factor * larger else "compute"


@dataclass
class StepReport:
    """Where one training step's time goes: per-phase times and kernels, floors, prefetch gains.

    Args:
        phases: forward / backward / optimizer (names matching the floors' phases get per-phase floors).
        floors: the step's :class:`Floors` (from :func:`floors`), or None.
        prefetch_gains: fractional gain per layer shape (``0.027`` = 2.7% faster with prefetch).
        step_time_us: the whole step; default: the sum of the phases.
        label: a title, e.g. ``"d1536x40 b16"``.
        bound_factor: see :func:`classify_bound`.

    Example:
        >>> f = floors({"bfloat16": 2_000_000}, kernel_count=600, copy_bw=4e12, empty_kernel_us=1.0)
        >>> r = StepReport([PhaseTime("forward", 200, 150), PhaseTime("backward", 400, 300),
        ...                 PhaseTime("optimizer", 150, 150)], f)
        >>> r.bound(), r.dominant_phase().name
        ('launch', 'backward')
    """

    phases: list[PhaseTime]
    floors: Floors | None = None
    prefetch_gains: dict[str, float] = field(default_factory=dict)
    step_time_us: float | None = None
    label: str = ""
    bound_factor: float = 2.0

    def __post_init__(self) -> None:
        if not self.phases and self.step_time_us is None:
            raise ValueError("`phases` is empty and `step_time_us` is not given: nothing to report")
        for p in self.phases:
            if p.time_us < 0:
                raise ValueError(f"phase {p.name!r} has a negative time ({p.time_us} us)")

    @property
    def total_us(self) -> float:
        return self.step_time_us if self.step_time_us is not None else sum(p.time_us for p in self.phases)

    @property
    def kernel_count(self) -> int | None:
        counts = [p.kernel_count for p in self.phases]
        return None if not counts or any(c is None for c in counts) else sum(counts)

    def dominant_phase(self) -> PhaseTime | None:
        return max(self.phases, key=lambda p: p.time_us) if self.phases else None

    def bound(self) -> str:
        """``"launch"``, ``"bandwidth"``, ``"compute"`` or ``"unknown"`` for the whole step."""
        if self.floors is None:
            return "unknown"
        return classify_bound(self.total_us, self.floors.bytes_us, self.floors.launch_us, self.bound_factor)

    def phase_bound(self, phase: PhaseTime) -> str:
        if self.floors is None:
            return "unknown"
        b, launch = self.floors.phase_floors(phase.name, phase.kernel_count)
        return classify_bound(phase.time_us, b, launch, self.bound_factor)

    def to_dict(self) -> dict[str, Any]:
        dom = self.dominant_phase()
        return {
            "label": self.label,
            "total_us": self.total_us,
            "kernel_count": self.kernel_count,
            "bound": self.bound(),
            "dominant_phase": dom.name if dom else None,
            "phases": [{**asdict(p), "bound": self.phase_bound(p)} for p in self.phases],
            "floors": self.floors.to_dict() if self.floors else None,
            "prefetch_gains": dict(self.prefetch_gains),
        }

    def format(self) -> str:
        """A small table plus one-line verdicts: which floor binds and which phase dominates."""
        total = self.total_us
        lines = [f"Step report{(': ' + self.label) if self.label else ''} ({total:.1f} us per step)"]
        if self.phases:
            lines.append(
                f"  {'phase':<11}{'time us':>10}{'share':>7}{'kernels':>9}{'us/kernel':>11}"
                f"{'bytes floor':>13}{'launch floor':>14}  bound"
            )
            for p in self.phases:
                b, launch = self.floors.phase_floors(p.name, p.kernel_count) if self.floors else (None, None)
                per_kernel = f"{p.time_us / p.kernel_count:.2f}" if p.kernel_count else "?"
                lines.append(
                    f"  {p.name:<11}{p.time_us:>10.1f}{p.time_us / total:>7.0%}"
                    f"{p.kernel_count if p.kernel_count is not None else '?':>9}{per_kernel:>11}"
                    f"{'?' if b is None else f'{b:.1f}':>13}{'?' if launch is None else f'{launch:.1f}':>14}"
                    f"  {self.phase_bound(p)}"
                )
        f = self.floors
        if f is not None:
            launch = (
                "unknown"
                if f.launch_us is None
                else (f"{f.launch_us:.1f} us ({f.kernel_count} kernels x {f.empty_kernel_us:.2f} us)")
            )
            lines.append(
                f"  floors: bytes {f.bytes_us:.1f} us ({f.bytes_moved / 1e9:.3f} GB at "
                f"{f.copy_bw_bytes_per_s / 1e12:.2f} TB/s), launch {launch}; larger: {f.bound}"
            )
            verdict = self.bound()
            why = {
                "launch": "kernel launches set the pace: fewer or fused kernels help, bandwidth does not",
                "bandwidth": "moving the bytes sets the pace: fewer bytes or better L2 reuse help",
                "compute": "neither floor explains the time: arithmetic or extra memory passes dominate",
            }[verdict]
            lines.append(f"  {f.ratio(total):.2f}x the larger floor -> {verdict}-bound ({why})")
        dom = self.dominant_phase()
        if dom is not None:
            lines.append(f"  dominant phase: {dom.name} ({dom.time_us / total:.0%} of the step)")
        if self.prefetch_gains:
            lines.append("  prefetch gain per layer shape:")
            for shape, gain in sorted(self.prefetch_gains.items(), key=lambda kv: -kv[1]):
                lines.append(f"    {gain:+.1%}  {shape}")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.format()
