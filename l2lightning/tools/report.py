"""Benchmark reporting: medians with confidence intervals, comparisons, pre-registered criteria, writers.

Every timing is reported as a ratio to the larger floor (:mod:`l2lightning.floors`, shared with the
library's step report). Pre-registered criteria are expectations written down *before* timing: a
YAML file whose SHA-256 is printed and stored before the first measurement, and evaluated after it.
A failed criterion is a result like any other, kept in the report.

Medians come with a distribution-free 95% confidence interval from order statistics (binomial):
see :func:`median_ci`. Plots are in :mod:`l2lightning.tools.plots`.
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
