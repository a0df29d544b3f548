"""The ``l2lightning`` command line: ``doctor`` (GPU state check) and ``bench`` (the benchmark harness).

Installed as the ``l2lightning`` console script; ``python -m l2lightning ...`` runs the same.
Building the parser imports neither torch nor CUDA, so ``--help`` and argument errors are instant.

Example:
    $ l2lightning doctor --json doctor.json
    $ l2lightning bench --quick --criteria benchmarks/criteria.yaml
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from l2lightning.tools.args import non_negative_int, positive_float


def build_parser() -> argparse.ArgumentParser:
    """The argument parser with its ``doctor`` and ``bench`` subcommands."""
    from l2lightning import __version__
    from l2lightning.tools.bench.args import add_arguments as add_bench_arguments

    parser = argparse.ArgumentParser(
        prog="l2lightning",
        description="Whole-step CUDA graphs with measured L2 weight prefetch: tools.",
    )
    parser.add_argument("--version", action="version", version=f"l2lightning {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True

    doctor = sub.add_parser(
        "doctor",
        help="check that the GPU is in a state where timings mean anything (reads only, changes nothing)",
        description=(
            "Reads GPU name, SMs, L2 size, P-state, clocks, power and throttle reasons at idle and under a short "
            "copy load, measures copy bandwidth and the empty-kernel cost in a CUDA graph, and checks nvidia-powerd. "
            "Never changes clocks, power limits or daemons."
        ),
    )
    doctor.add_argument("--json", type=Path, metavar="PATH", help="also write the state and findings as JSON")
    doctor.add_argument("--device", type=non_negative_int, default=0, help="CUDA device index (default 0)")
    doctor.add_argument(
        "--load-seconds", type=positive_float, default=0.6, help="length of the copy load (default 0.6)"
    )
    doctor.add_argument(
        "--no-load",
        action="store_true",
        help="skip the load phase (idle readings only: not ready for timing)",
    )
    doctor.add_argument("--strict", action="store_true", help="exit 1 when the GPU is not ready for timing")

    bench = sub.add_parser(
        "bench",
        help="time Lightning eager, plain loops, whole-step graphs, prefetch and torch.compile per training step",
        description=(
            "Runs the doctor, stores the pre-registered criteria's SHA-256, then times every variant interleaved "
            "round-robin and writes JSON, CSV and PNG files."
        ),
    )
    add_bench_arguments(bench)
    return parser


def _doctor(args: argparse.Namespace) -> int:
    from l2lightning.tools import doctor

    state = doctor.collect(args.device, load_seconds=args.load_seconds, load=not args.no_load)
    findings = doctor.diagnose(state)
    print(doctor.format_report(state, findings))
    if args.json is not None:
        path = doctor.write_json(args.json, state, findings)
        print(f"\nwrote {path}")
    ready, _ = doctor.ready_for_timing(state, findings)
    return 1 if args.strict and not ready else 0


def _bench(args: argparse.Namespace, parser: argparse.ArgumentParser, argv: Sequence[str]) -> int:
    from l2lightning.tools.bench import run as bench
    from l2lightning.tools.bench.args import settings_from_args

    try:
        settings = settings_from_args(args)
    except ValueError as exc:
        parser.error(str(exc))
    return bench.run_bench(settings, argv=["l2lightning", *argv])


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``l2lightning`` console script; returns the exit code."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "doctor":
        return _doctor(args)
    if args.command == "bench":
        return _bench(args, parser, argv)
    parser.error(f"unknown command {args.command!r}")
    return 2


if __name__ == "__main__":
    sys.exit(main())
