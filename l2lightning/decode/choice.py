"""Which attention implementation a length bucket gets: every candidate measured, the fastest kept.

The kernel's split count and heads per block depend on the layout, the length and the GPU in ways a
heuristic only approximates, and whether SDPA or FlashInfer beats it varies with the length too, so
:func:`choose_attention` times the candidates where they will run: each in its own CUDA graph of
back-to-back calls on separate caches (like layers), graphs replayed in interleaved rounds,
CUDA-event medians. A candidate that fails or misses the float64 reference is reported with its
reason and never chosen.
"""

from __future__ import annotations

import dataclasses
import statistics
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch

from l2lightning.decode.backends import (
    AttentionBackend,
    AttentionSpec,
    backend_for_layout,
    implementation_of,
    unavailable_reason,
)
from l2lightning.decode.checks import DecodeLayout, check_int, random_decode_inputs
from l2lightning.decode.kernel import (
    MAX_SPLITS,
    KernelConfig,
    default_heads_per_block,
    device_sm_count,
    plan_launch,
)
from l2lightning.decode.numerics import reference_decode_attention, relative_error
from l2lightning.decode.timing import time_graph_replays
from l2lightning.graph.capture import graph_capture

# A candidate further than this from float64 attention is wrong, not merely rounded: bf16 attention
# outputs sit at about 1.7e-3 from it (the rounding floor, measured on the H200 in
# benchmarks/README.md), so 2e-2 leaves a margin of more than 10x.
MAX_CANDIDATE_REL_ERR = 2e-2


def candidate_specs(
    heads: int, kv_heads: int, head_dim: int, max_len_bucket: int, batch: int, sm_count: int = 132
) -> list[AttentionSpec]:
    """The kernel at its default split count, half and double of it, and for groups of 4+ heads
    also with the group in two head chunks; then torch and flashinfer."""
    group = heads // kv_heads
    specs = []
    hpbs = [default_heads_per_block(group)]
    if group >= 4 and -(-group // 2) not in hpbs:
        hpbs.append(-(-group // 2))
    for hpb in hpbs:
        launch = plan_launch(
            batch, heads, kv_heads, head_dim, max_len_bucket, config=KernelConfig(hpb), sm_count=sm_count
        )
        base = launch.splits
        cap = max(1, min(MAX_SPLITS, -(-max_len_bucket // launch.granule)))
        for s in sorted({base, max(1, base // 2), min(cap, base * 2)}):
            specs.append(AttentionSpec("kernel", splits=s, heads_per_block=hpb))
    return specs + [AttentionSpec("torch"), AttentionSpec("flashinfer")]


@dataclass
class AttentionChoice:
    """The implementation picked for one layout and length bucket, with the measurements behind it."""

    spec: AttentionSpec
    label: str
    timings_us: dict[str, float]
    errors: dict[str, str] = field(default_factory=dict)
    specs: dict[str, AttentionSpec] = field(default_factory=dict)
    heads: int = 0
    kv_heads: int = 0
    head_dim: int = 0
    max_len_bucket: int = 0
    dtype: str = ""
    batch: int = 0
    calls: int = 0
    rounds: int = 0

    @property
    def name(self) -> str:
        return self.spec.impl

    def best_per_impl(self) -> dict[str, tuple[str, float]]:
        """The fastest measured candidate of each implementation: impl -> (label, µs per call)."""
        best: dict[str, tuple[str, float]] = {}
        for label, us in self.timings_us.items():
            impl = implementation_of(label)
            if impl not in best or us < best[impl][1]:
                best[impl] = (label, us)
        return best

    def reasons_per_impl(self) -> dict[str, str]:
        """Why an implementation has no time at all: impl -> the first error among its candidates.
        An implementation with at least one measured candidate is not listed."""
        timed = {implementation_of(label) for label in self.timings_us}
        out: dict[str, str] = {}
        for label, why in self.errors.items():
            impl = implementation_of(label)
            if impl not in timed:
                out.setdefault(impl, why)
        return out

    def table(self) -> str:
        """A small text table: each candidate's µs per call and its ratio to the best."""
        lines = [
            f"attention choice: heads={self.heads} kv_heads={self.kv_heads} head_dim={self.head_dim} "
            f"bucket={self.max_len_bucket} {self.dtype} batch={self.batch} "
            f"({self.calls} calls per graph replay, median of {self.rounds} interleaved rounds)",
            f"  {'candidate':<26}{'µs/call':>10}{'vs best':>10}",
        ]
        best = min(self.timings_us.values()) if self.timings_us else float("nan")
        for label, us in sorted(self.timings_us.items(), key=lambda kv: kv[1]):
            mark = "*" if label == self.label else " "
            lines.append(f"{mark} {label:<26}{us:>10.2f}{us / best:>9.2f}x")
        for label, why in self.errors.items():
            lines.append(f"  {label:<26}  skipped: {why}")
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["spec"] = dataclasses.asdict(self.spec)
        out["specs"] = {k: dataclasses.asdict(v) for k, v in self.specs.items()}
        return out


_CHOICES: dict[tuple, AttentionChoice] = {}


def _build_candidates(
    specs: Sequence[AttentionSpec], layout: DecodeLayout, dtype: torch.dtype, device: torch.device
) -> tuple[dict[str, AttentionBackend], dict[str, AttentionSpec], dict[str, str]]:
    """(backend per label, spec per label, error per label) for the specs that can run here; one
    backend per distinct label (two specs may resolve to the same launch)."""
    backends: dict[str, AttentionBackend] = {}
    label_spec: dict[str, AttentionSpec] = {}
    errors: dict[str, str] = {}
    for spec in specs:
        why = unavailable_reason(
            spec.impl, layout.head_dim, dtype, device, heads=layout.heads, kv_heads=layout.kv_heads
        )
        if why:
            errors[spec.label] = why
            continue
        try:
            backend = backend_for_layout(spec, layout, dtype=dtype, device=device)
        except Exception as exc:  # a candidate that cannot be built is reported, not fatal
            errors[spec.label] = f"{type(exc).__name__}: {exc}"
            continue
        if backend.label not in backends:
            backends[backend.label] = backend
            label_spec[backend.label] = spec
    return backends, label_spec, errors


def _capture_candidates(
    backends: dict[str, AttentionBackend],
    layout: DecodeLayout,
    dtype: torch.dtype,
    device: torch.device,
    calls: int,
    errors: dict[str, str],
) -> dict[str, torch.cuda.CUDAGraph]:
    """One graph per backend of `calls` calls on separate random caches, every sequence at a full
    bucket, after an eager call checked against float64 attention. A backend that fails goes to
    `errors` instead."""
    gen = torch.Generator(device=device).manual_seed(1234)
    q, k_new, v_new, k_caches, v_caches = random_decode_inputs(layout, dtype, device, gen, caches=calls)
    cached = layout.max_len - 1
    lens = torch.full((layout.batch,), cached, dtype=torch.int32, device=device)
    ref = reference_decode_attention(q, k_new, v_new, k_caches[0], v_caches[0], lens)
    graphs: dict[str, torch.cuda.CUDAGraph] = {}
    side = torch.cuda.Stream(device=device)
    for label, backend in backends.items():
        try:
            with torch.cuda.device(device), torch.no_grad():
                backend.before_replay(cached)
                side.wait_stream(torch.cuda.current_stream(device))
                with torch.cuda.stream(side):  # warm-up off the default stream, as for any capture
                    backend.prepare(lens)
                    out = backend(q, k_new, v_new, k_caches[0], v_caches[0], lens)
                torch.cuda.current_stream(device).wait_stream(side)
                torch.cuda.synchronize(device)
                err = relative_error(out, ref)
                if not err < MAX_CANDIDATE_REL_ERR:
                    raise RuntimeError(f"output differs from the FP32 reference (relative error {err:.3g})")
                graph = torch.cuda.CUDAGraph()
                with graph_capture(graph):
                    backend.prepare(lens)
                    for i in range(calls):
                        backend(q, k_new, v_new, k_caches[i], v_caches[i], lens)
                graph.replay()
                torch.cuda.synchronize(device)
                graphs[label] = graph
        except Exception as exc:
            errors[label] = f"{type(exc).__name__}: {exc}"
            if backend.spec.impl == "kernel":
                warnings.warn(
                    f"l2lightning: decode-attention kernel candidate {label} failed: {exc}", stacklevel=3
                )
    return graphs


def choose_attention(
    heads: int,
    kv_heads: int,
    head_dim: int,
    max_len_bucket: int,
    dtype: torch.dtype,
    batch: int,
    device: torch.device | str,
    *,
    specs: Sequence[AttentionSpec] | None = None,
    calls: int = 8,
    rounds: int = 9,
    use_cache: bool = True,
) -> AttentionChoice:
    """Time each available implementation inside CUDA graphs and return the fastest.

    Each candidate gets its own graph of ``calls`` back-to-back calls (separate caches per call, like
    layers) with every sequence at a full bucket (``max_len_bucket - 1`` cached tokens); the graphs
    replay in interleaved rounds and the median CUDA-event time per call decides. A candidate that
    fails, or whose output misses the FP32 reference (relative error >= 2e-2), is reported in
    ``errors`` and not chosen. Results are cached per layout in this process (``use_cache``).

    Example:
        >>> choice = choose_attention(14, 2, 64, 1024, torch.bfloat16, 1, "cuda")  # doctest: +SKIP
        >>> print(choice.table())  # doctest: +SKIP
    """
    from l2lightning._env import cuda_unavailable_reason

    for name, value, low in (
        ("heads", heads, 1),
        ("kv_heads", kv_heads, 1),
        ("head_dim", head_dim, 8),
        ("max_len_bucket", max_len_bucket, 1),
        ("batch", batch, 1),
        ("calls", calls, 1),
        ("rounds", rounds, 1),
    ):
        check_int(name, value, low)
    if heads % kv_heads:
        raise ValueError(f"`heads` ({heads}) must be a multiple of `kv_heads` ({kv_heads})")
    device = torch.device(device)
    if device.type != "cuda":
        raise ValueError(f"choose_attention times CUDA graphs: `device` must be a CUDA device, got {device}")
    reason = cuda_unavailable_reason()
    if reason:
        raise RuntimeError(f"choose_attention needs a CUDA GPU: {reason}")
    if device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    key = (
        heads,
        kv_heads,
        head_dim,
        max_len_bucket,
        dtype,
        batch,
        device.index,
        calls,
        rounds,
        tuple(specs) if specs is not None else None,
    )
    if use_cache and key in _CHOICES:
        return _CHOICES[key]
    if specs is None:
        specs = candidate_specs(
            heads, kv_heads, head_dim, max_len_bucket, batch, device_sm_count(device.index)
        )
    layout = DecodeLayout(batch, heads, kv_heads, head_dim, max_len_bucket)
    backends, label_spec, errors = _build_candidates(specs, layout, dtype, device)
    graphs = _capture_candidates(backends, layout, dtype, device, calls, errors)
    if not graphs:
        raise RuntimeError(
            "choose_attention: no implementation ran; " + "; ".join(f"{k}: {v}" for k, v in errors.items())
        )
    samples = time_graph_replays(
        graphs,
        rounds=rounds,
        calls_per_replay=calls,
        device=device,
        before_replay={label: partial(backends[label].before_replay, max_len_bucket - 1) for label in graphs},
    )
    timings = {label: statistics.median(v) for label, v in samples.items()}
    best = min(timings, key=timings.__getitem__)
    choice = AttentionChoice(
        spec=label_spec[best],
        label=best,
        timings_us=timings,
        errors=errors,
        specs=label_spec,
        heads=heads,
        kv_heads=kv_heads,
        head_dim=head_dim,
        max_len_bucket=max_len_bucket,
        dtype=str(dtype).replace("torch.", ""),
        batch=batch,
        calls=calls,
        rounds=rounds,
    )
    del graphs
    if use_cache:
        _CHOICES[key] = choice
    return choice
