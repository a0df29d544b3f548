"""The measured autotuner: time candidate prefetch plans per layer shape and keep one only where it provably pays.

For each distinct layer shape of a chain (``Layer.shape_key``: type, weight shapes and dtype, input
shape, enclosing block) and each phase (``"forward"``: a forward-only graph; ``"backward"``: forward
+ backward with prefetch only in backward), the tuner builds a throwaway chain of copies of that
layer's block (``Layer.block``: LayerNorm, Linear, GELU), or of the lone layer where the model has
no such block, with fresh random weights (the model's own tensors are only read once, by ``copy.deepcopy``), long
enough that its weights exceed L2 twice over so each layer's weights are evicted between replays,
captures it in CUDA graphs without and with each candidate plan installed through
:class:`~l2lightning.prefetch.install.PlanHooks`, and times graph replays with CUDA events.

Search, inside a wall-time budget (0.6 s per distinct shape by default):

1. Prune by the rule the H200 measurements support: the current and the next ``distance`` layers
   must fit in L2 together, and the prefetch must be able to finish in time. The op time comes
   from the measured plain chain; the prefetch time from `BLOCK_PREFETCH_RATE` per block.
2. Screen (a race of paired (plain, candidate) samples, order alternating): first block counts of
   the ``hint`` kind at distance 1, then the other kinds and distance 2 at the best block count.
   After three pairs a candidate is dropped when its confidence interval's upper bound falls below
   the best lower bound or below ``min_gain``; the better half survives every second round.
3. Confirm the winner on *fresh* interleaved (plain, plan, decoy) rounds (the screening samples
   picked it, so reusing them would overstate its gain) and apply the gate of
   :mod:`l2lightning.tune.stats`: mean-gain CI above +1% and a win over the decoy. Otherwise the
   shape runs plain.

Memory is bounded (:mod:`l2lightning.tune.memory`): the throwaway chains may hold at most
``memory_budget`` (a quarter by default) times the model's parameter bytes. Each chain's bytes are
estimated from shapes before it is built; it is shortened to fit, down to the shortest chain that
still holds every candidate distance, and a shape that does not fit even then runs plain, the
reason in its row. One shape is measured at a time, its chain freed before the next.

Decisions are cached on disk (:mod:`l2lightning.tune.cache`). The measuring step is injectable
(``Autotuner(bench_factory=...)``), which is how the CPU tests drive the search with fake timings.

This module is the search alone (the grid, the throwaway chains, the timing, the report and the
statistics live beside it in this package); it stays near 750 lines because the staged race is one
state machine over shared deadlines and samples, which reads best in one class.
"""

from __future__ import annotations

import contextlib
import hashlib
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

from l2lightning.graph.rng import forked_rng
from l2lightning.prefetch.chain import Layer, device_l2_bytes
from l2lightning.prefetch.plan import KINDS, MIB, PrefetchPlan
from l2lightning.tune.cache import PlanCache
from l2lightning.tune.candidates import (
    BLOCK_PREFETCH_RATE,
    DEFAULT_BLOCKS,
    DEFAULT_DISTANCES,
    MIN_LAYER_BYTES,
    PHASES,
    RATE_SLACK,
)
from l2lightning.tune.memory import (
    DEFAULT_MEMORY_BUDGET,
    ChainSizing,
    MemoryLedger,
    check_memory_budget,
    size_chain,
    tensor_bytes,
)
from l2lightning.tune.report import TuningReport, TuningRow
from l2lightning.tune.staged_search import MIN_PAIRS, StagedSearch
from l2lightning.tune.throwaway import SkipShape, chain_copies
from l2lightning.tune.timing import BenchFactory, CudaShapeBench, ShapeBench

__all__ = ["Autotuner"]

# When both phases of a shape are tuned, forward may use this share of the shape's budget; backward
# (graphs three times longer) gets the rest, including whatever forward left unused.
FORWARD_BUDGET_SHARE = 0.4


# ---------------------------------------------------------------------- measuring helper


# ---------------------------------------------------------------------- the tuner
class Autotuner(StagedSearch):
    """Measures prefetch plans per layer shape on throwaway weights; keeps a plan only where it pays.

    Args:
        budget_s: wall seconds of tuning per distinct layer shape (all its phases together).
        candidates: plans to race (pruned by the L2/issue-rate rule first); default: a staged
            search over `blocks` x kinds x `distances` (block counts first, then flavours).
        min_gain: the gain's lower confidence bound must exceed this (0.01 = +1%).
        repeats: most confirmation rounds (plain, plan, decoy) for the winner; the gate is checked
            after ``min_repeats`` rounds and every 3 rounds after, stopping once it has decided.
        min_repeats: confirmation rounds before the first check.
        confidence: two-sided confidence level of the intervals.
        clock: wall clock in seconds (tests inject a fake one).
        cache: a :class:`~l2lightning.tune.cache.PlanCache`, ``"default"`` (``$L2L_CACHE_DIR``, honours
            ``L2L_RETUNE``) or None (no cache).
        blocks, distances, kinds: the default grid; kinds default to what the device supports.
        block_rate, slack: the pruning rule's per-block prefetch rate (bytes/s) and tolerance.
        min_layer_bytes: smaller layers run plain without measuring (not worth a launch).
        replays: graph replays per timing sample (CUDA bench).
        screen_rounds: most screening pairs per candidate.
        bench_factory: ``factory(layer, phase, device, max_copies=n) -> ShapeBench``, whose chain
            holds at most ``n`` copies; default: :class:`CudaShapeBench`.
        l2_bytes, device_name: overrides of what the device reports (tests, fake benches).
        memory_budget: the most the throwaway copies, their gradients and the timing graphs'
            activations may hold at once, as a multiple of the model's parameter bytes (0.25, the
            default: a quarter; above 1 allows more than the model itself), or None for no bound
            beyond free memory. A chain is shortened to fit, down to the shortest one that still
            holds every candidate distance (the largest distance + 1 copies); a shape whose
            shortest chain does not fit runs plain, the reason in its row and in a warning.
            Cached decisions need no memory. Each row reports the bytes its chain held
            (``held_bytes``), the report the budget and the most held at once.

    Example:
        >>> tuner = Autotuner(budget_s=0.6)  # doctest: +SKIP
        >>> report = tuner.tune(hooks.chain, torch.device("cuda", 0), ("forward", "backward"))  # doctest: +SKIP
        >>> print(report.table())  # doctest: +SKIP
    """

    def __init__(
        self,
        budget_s: float = 0.6,
        candidates: Sequence[PrefetchPlan] | None = None,
        min_gain: float = 0.01,
        repeats: int = 12,
        clock: Callable[[], float] = time.perf_counter,
        cache: PlanCache | str | None = "default",
        *,
        min_repeats: int = 6,
        confidence: float = 0.95,
        blocks: Sequence[int] = DEFAULT_BLOCKS,
        distances: Sequence[int] = DEFAULT_DISTANCES,
        kinds: Sequence[str] | None = None,
        block_rate: float = BLOCK_PREFETCH_RATE,
        slack: float = RATE_SLACK,
        min_layer_bytes: int = MIN_LAYER_BYTES,
        replays: int = 5,
        screen_rounds: int = 8,
        bench_factory: BenchFactory | None = None,
        l2_bytes: int | None = None,
        device_name: str | None = None,
        memory_budget: float | None = DEFAULT_MEMORY_BUDGET,
    ) -> None:
        if isinstance(budget_s, bool) or not isinstance(budget_s, (int, float)) or not budget_s > 0:
            raise ValueError(f"`budget_s` must be a positive number of seconds, got {budget_s!r}")
        if candidates is not None:
            candidates = list(candidates)
            if not candidates or not all(isinstance(c, PrefetchPlan) for c in candidates):
                raise ValueError("`candidates` must be None or a non-empty sequence of PrefetchPlan")
        if isinstance(min_gain, bool) or not isinstance(min_gain, (int, float)) or not 0 <= min_gain < 0.5:
            raise ValueError(f"`min_gain` must be a fraction in [0, 0.5), got {min_gain!r}")
        _check_count("repeats", repeats, 3)
        _check_count("min_repeats", min_repeats, 2)
        if min_repeats > repeats:
            raise ValueError(f"`min_repeats` ({min_repeats}) must not exceed `repeats` ({repeats})")
        if not isinstance(confidence, float) or not 0.5 < confidence < 1:
            raise ValueError(f"`confidence` must be a float in (0.5, 1), got {confidence!r}")
        if not callable(clock):
            raise TypeError("`clock` must be a callable returning seconds")
        if cache == "default":
            cache = PlanCache()
        elif cache is not None and not isinstance(cache, PlanCache):
            raise TypeError(f"`cache` must be a PlanCache, 'default' or None, got {cache!r}")
        if not blocks or not all(isinstance(b, int) and 1 <= b <= 1024 for b in blocks):
            raise ValueError(f"`blocks` must be block counts in [1, 1024], got {blocks!r}")
        if not distances or not all(isinstance(d, int) and 1 <= d <= 8 for d in distances):
            raise ValueError(f"`distances` must be layer distances in [1, 8], got {distances!r}")
        if kinds is not None and (not kinds or any(k not in KINDS for k in kinds)):
            raise ValueError(f"`kinds` must be a non-empty subset of {KINDS}, got {kinds!r}")
        if not block_rate > 0:
            raise ValueError(f"`block_rate` must be > 0 bytes/s, got {block_rate!r}")
        if not slack > 0:
            raise ValueError(f"`slack` must be > 0, got {slack!r}")
        _check_count("min_layer_bytes", min_layer_bytes, 0)
        _check_count("replays", replays, 1)
        _check_count("screen_rounds", screen_rounds, MIN_PAIRS)
        if bench_factory is not None and not callable(bench_factory):
            raise TypeError(
                "`bench_factory` must be a callable factory(layer, phase, device, max_copies=n) -> ShapeBench"
            )
        if l2_bytes is not None:
            _check_count("l2_bytes", l2_bytes, 1)
        self.memory_budget = check_memory_budget(memory_budget)
        self.budget_s = float(budget_s)
        self.candidates = candidates
        self.min_gain = float(min_gain)
        self.repeats = repeats
        self.min_repeats = min_repeats
        self.confidence = confidence
        self.clock = clock
        self.cache: PlanCache | None = cache
        self.blocks = tuple(blocks)
        self.distances = tuple(distances)
        self.kinds = tuple(kinds) if kinds is not None else None
        self.block_rate = float(block_rate)
        self.slack = float(slack)
        self.min_layer_bytes = min_layer_bytes
        self.replays = replays
        self.screen_rounds = screen_rounds
        self.bench_factory = bench_factory
        self.l2_bytes = l2_bytes
        self.device_name = device_name

    # ------------------------------------------------------------ public
    def tune(
        self,
        chain: Sequence[Layer],
        device: torch.device | str,
        phases: Sequence[str] = ("forward",),
        *,
        model_bytes: int | None = None,
    ) -> TuningReport:
        """Tune every distinct layer shape of `chain` in each of `phases` ("forward", "backward").

        Never touches the model's tensors (copies are made and re-initialised) nor, visibly, its RNG.
        `model_bytes` is the model's parameter bytes, which ``memory_budget`` multiplies; default:
        the parameters of the chain's layers (the model's weight-reading layers, so at most the model's).
        """
        if isinstance(phases, str):
            phases = (phases,)
        phases = tuple(phases)
        bad = [p for p in phases if p not in PHASES]
        if bad or len(set(phases)) != len(phases):
            raise ValueError(f"`phases` must be distinct values from {PHASES}, got {phases!r}")
        if not all(isinstance(layer, Layer) for layer in chain):
            raise TypeError(
                "`chain` must be a list of l2lightning.prefetch.chain.Layer (PrefetchHooks.chain)"
            )
        if model_bytes is None:
            model_bytes = tensor_bytes(p for layer in chain for p in layer.module.parameters())
        else:
            _check_count("model_bytes", model_bytes, 0)
        ledger = MemoryLedger(None if self.memory_budget is None else int(self.memory_budget * model_bytes))
        device = torch.device(device)
        on_cuda = device.type == "cuda"
        if on_cuda and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        report = TuningReport(
            device=self._device_name(device),
            min_layer_bytes=self.min_layer_bytes,
            budget_s=self.budget_s,
            min_gain=self.min_gain,
            confidence=self.confidence,
            memory_budget=self.memory_budget,
            memory_budget_bytes=ledger.budget_bytes,
            model_bytes=model_bytes,
        )
        shapes: dict[str, tuple[Layer, int]] = {}
        for layer in chain:
            first, count = shapes.get(layer.shape_key, (layer, 0))
            shapes[layer.shape_key] = (first, count + 1)
        unavailable = self._unavailable_reason(device) if phases and shapes else None
        l2 = kinds = None
        if unavailable is None:
            l2 = self.l2_bytes if self.l2_bytes is not None else device_l2_bytes(device)
            kinds = self._kinds(device)
        used_cuda = False
        if unavailable is None and self.bench_factory is None:
            from l2lightning.prefetch.kernels import load_prefetch_kernels

            load_prefetch_kernels(device.index)  # a first NVRTC compile is not tuning time
        # Tuning both phases means a training step: its forward plan is measured in a forward +
        # backward graph. A plan measured in a forward-only graph did not transfer there (H200:
        # +4-6% forward-only, -20% and -46% once backward ran in the same graph).
        training = "backward" in phases
        with self._context(device, active=unavailable is None):
            for layer, count in shapes.values():
                shape_start = self.clock()
                for k, phase in enumerate(phases):
                    share = FORWARD_BUDGET_SHARE if (len(phases) == 2 and k == 0) else 1.0
                    deadline = shape_start + self.budget_s * share
                    context = "train" if (training and phase == "forward") else ""
                    row = self._row(
                        layer, count, phase, context, device, deadline, l2, kinds, unavailable, ledger
                    )
                    used_cuda |= row.measured and not row.from_cache and self.bench_factory is None
                    report.rows.append(row)
        report.memory_peak_bytes = ledger.peak
        if used_cuda:
            torch.cuda.empty_cache()  # hand the throwaway chains' memory back (their graphs are gone)
        return report

    # ------------------------------------------------------------ internals
    def _device_name(self, device: torch.device) -> str:
        if self.device_name:
            return self.device_name
        if device.type == "cuda" and torch.cuda.is_available():
            props = torch.cuda.get_device_properties(device)
            l2 = getattr(props, "L2_cache_size", 0) or 0
            return f"{props.name} ({props.multi_processor_count} SMs, {l2 / MIB:.0f} MiB L2)"
        return str(device)

    def _kinds(self, device: torch.device) -> tuple[str, ...]:
        if self.kinds is not None:
            return self.kinds
        if device.type == "cuda" and torch.cuda.is_available():
            from l2lightning.prefetch.kernels import supported_kinds

            return supported_kinds(device.index or 0)
        return ("hint", "hint_last")  # every device that runs the hint kernel supports these

    def _unavailable_reason(self, device: torch.device) -> str | None:
        if self.bench_factory is not None:  # an injected bench measures wherever it likes
            return None
        if device.type != "cuda":
            return f"the layers are on {device}, not a CUDA GPU: nothing to measure"
        from l2lightning._env import prefetch_unavailable_reason

        reason = prefetch_unavailable_reason()
        if reason:
            return reason
        if torch.cuda.is_current_stream_capturing():
            return "called inside a CUDA graph capture (tuning needs its own captures and host syncs)"
        return None

    @contextlib.contextmanager
    def _context(self, device: torch.device, active: bool) -> Iterator[None]:
        """Around all measurements: the layer's device current, the RNG forked (random weights and
        graph replays must not move the model's RNG), inference mode off (backward graphs need grad)."""
        if not active or device.type != "cuda":
            with forked_rng():
                yield
            return
        with (
            torch.cuda.device(device),
            forked_rng([device.index]),
            torch.inference_mode(False),
        ):
            yield

    def _longest_distance(self) -> int:
        """The largest prefetch distance the search may race."""
        if self.candidates is not None:
            return max(c.distance for c in self.candidates)
        return max(self.distances)

    def _graphs(self, kinds: Sequence[str]) -> int:
        """The most graphs one shape's search captures: plain, each candidate, the winner's decoy."""
        if self.candidates is not None:
            return len(self.candidates) + 2
        return len(self.blocks) + (len(kinds) - 1) + (len(self.distances) - 1) + 2

    def _over_budget(self, row: TuningRow, sizing: ChainSizing, l2: int | None, ledger: MemoryLedger) -> None:
        """No plan for a shape whose shortest chain does not fit the memory budget: say why in the
        row, and once as a warning where a plan could have mattered. A model whose weights all fit
        in L2 gains nothing from prefetch, so the default budget leaving it untuned is no news."""
        from l2lightning._env import warn_once

        why = f"{sizing.over_budget()} (memory_budget={self.memory_budget:g} x the model's parameter bytes)"
        row.reason = f"not tuned: {why}"
        model_bytes = ledger.budget_bytes / self.memory_budget if self.memory_budget else None
        if l2 is not None and model_bytes is not None and model_bytes <= l2:
            return
        phase = f"{row.phase}@{row.context}" if row.context else row.phase
        warn_once(
            f"autotune-memory:{row.shape}:{row.phase}:{row.context}",
            f"l2lightning: autotune leaves {row.shape} ({phase}) without a plan: {why}; "
            "a larger `memory_budget` (or None) tunes it",
        )

    def _tuner_tag(self, kinds: Sequence[str]) -> str:
        """Short hash of the settings that shape a decision, so other settings do not reuse it."""
        space = (
            [c.to_dict() for c in self.candidates]
            if self.candidates is not None
            else ("staged", self.blocks, self.distances, tuple(kinds))
        )
        settings = (
            space,
            self.min_gain,
            self.confidence,
            self.block_rate,
            self.slack,
            self.budget_s,
            self.repeats,
        )
        return hashlib.sha1(repr(settings).encode()).hexdigest()[:10]

    def _row(
        self,
        layer: Layer,
        count: int,
        phase: str,
        context: str,
        device: torch.device,
        deadline: float,
        l2: int | None,
        kinds: tuple[str, ...],
        unavailable: str | None,
        ledger: MemoryLedger,
    ) -> TuningRow:
        start = self.clock()
        dtype = str(layer.weights[0].dtype).replace("torch.", "") if layer.weights else "none"
        row = TuningRow(
            shape=layer.shape_key,
            phase=phase,
            layer_bytes=layer.nbytes,
            dtype=dtype,
            layers=count,
            context=context,
        )
        if unavailable:
            row.reason = unavailable
            return row
        if layer.nbytes < self.min_layer_bytes:
            row.reason = f"layer of {layer.nbytes / 1024:.0f} KiB < {self.min_layer_bytes / 1024:.0f} KiB: not worth a launch"
            return row
        if l2 is not None and 2 * layer.nbytes > l2:
            row.reason = f"2 x {layer.nbytes / MIB:.1f} MiB does not fit in {l2 / MIB:.0f} MiB of L2"
            return row
        # A training-context forward phase is timed in forward + backward graphs.
        graph_phase = "backward" if context == "train" else phase
        try:
            sizing = size_chain(
                layer,
                graph_phase,
                graphs=self._graphs(kinds),
                wanted=chain_copies(layer.nbytes, l2, count),
                shortest=self._longest_distance() + 1,
                budget_bytes=ledger.budget_bytes,
            )
        except SkipShape as exc:
            row.reason = str(exc)
            return row
        key = None
        if self.cache is not None:
            key = self.cache.key(
                device=self._device_name(device),
                shape=layer.shape_key,
                phase=f"{phase}@{context}" if context else phase,
                dtype=dtype,
                tuner=self._tuner_tag(kinds),
            )
            cached = self.cache.get(key)
            if cached is not None:
                try:
                    hit = TuningRow.from_dict(cached)
                except (TypeError, ValueError):
                    hit = None  # an entry from an incompatible layout: measure again and overwrite it
                # A decision measured on a shorter chain than this run would build (a tighter
                # memory budget or less free memory then) is measured again; any decision beats
                # none when no chain fits at all, and costs no memory.
                if hit is not None and hit.copies >= sizing.copies:
                    hit.layers, hit.from_cache, hit.held_bytes = count, True, 0  # nothing built
                    hit.tuned_seconds, hit.seconds = hit.seconds or hit.tuned_seconds, self.clock() - start
                    return hit
        if sizing.copies == 0:
            self._over_budget(row, sizing, l2, ledger)
            return row
        self._measure(row, layer, count, phase, context, device, start, deadline, l2, kinds, sizing, ledger)
        row.seconds = row.tuned_seconds = self.clock() - start
        if key is not None and row.measured:
            try:
                self.cache.put(key, row.to_dict())
            except OSError as exc:
                from l2lightning._env import warn_once

                warn_once(
                    "plan-cache-write", f"l2lightning: cannot write the plan cache {self.cache.path}: {exc}"
                )
        return row

    def _factory(self, context: str, count: int = 1) -> BenchFactory:
        if self.bench_factory is not None:
            return self.bench_factory  # a fake bench models whatever context it likes
        replays = self.replays
        l2 = self.l2_bytes

        def cuda_factory(layer: Layer, phase: str, device: torch.device, max_copies: int) -> ShapeBench:
            return CudaShapeBench(
                layer,
                phase,
                device,
                replays=replays,
                l2_bytes=l2,
                training=context == "train",
                min_copies=count,
                max_copies=max_copies,
            )

        return cuda_factory

    def _measure(
        self,
        row: TuningRow,
        layer: Layer,
        count: int,
        phase: str,
        context: str,
        device: torch.device,
        start: float,
        deadline: float,
        l2: int | None,
        kinds: tuple[str, ...],
        sizing: ChainSizing,
        ledger: MemoryLedger,
    ) -> None:
        # The chain's bytes count as held from before it is built until it is closed.
        with ledger.hold(sizing.footprint.bytes_for(sizing.copies)):
            try:
                bench = self._factory(context, count)(layer, phase, device, max_copies=sizing.copies)
            except SkipShape as exc:
                row.reason = str(exc)
                return
            except torch.OutOfMemoryError:
                # Out of memory is no fault of this shape: every later shape would run out too, and
                # the caller (L2GraphCallback) frees what tuning took and captures without prefetch,
                # with one warning. The chain's memory is released as the exception unwinds.
                raise
            except Exception as exc:  # a layer we cannot rebuild runs plain rather than failing the run
                row.reason = f"could not build a throwaway chain ({type(exc).__name__}: {exc})"
                return
            try:
                built = max(1, int(getattr(bench, "copies", 1)))
                if built > sizing.copies:
                    raise ValueError(
                        f"`bench_factory` built a chain of {built} copies; the tuner allowed "
                        f"max_copies={sizing.copies}"
                    )
                row.held_bytes = sizing.footprint.bytes_for(built)
                self._search(row, bench, layer, phase, start, deadline, l2, kinds)
                if built < sizing.wanted:
                    why = "the memory budget" if built == sizing.copies else "free memory"
                    note = f"chain shortened to {built} of {sizing.wanted} copies by {why}"
                    row.reason = f"{row.reason} ({note})" if row.reason else note
            finally:
                bench.close()


def _check_count(name: str, value: Any, low: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"`{name}` must be an int >= {low}, got {value!r}")
