"""Floors and the step report: how fast a step could possibly be, and where its time went.

Floors come from two measured ceilings (:mod:`l2lightning.probes`: the copy bandwidth and the
empty-kernel cost): the bytes that must move, and the kernels that must launch. A timing is
reported as a ratio to the larger floor. :class:`StepReport` formats a per-phase breakdown of one
training step against them; ``L2GraphCallback(report=True)``, the decode step report and the
benchmark harness all use it, which is why it lives in the library and not among the tools.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

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
