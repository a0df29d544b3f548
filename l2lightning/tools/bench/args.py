"""The ``l2lightning bench`` options, and the :class:`BenchSettings` they give.

Apart from the harness (:mod:`l2lightning.tools.bench.run`) so that the CLI builds its parser
without importing the harness's run loop, and the harness never imports the CLI.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from l2lightning.tools.args import int_list, model_list, name_list, non_negative_int, positive_int
from l2lightning.tools.bench.settings import DEFAULT_CRITERIA, BenchSettings, family_names
from l2lightning.tools.bench.variants import (
    ALL_VARIANTS,
    CHAIN_VARIANTS,
    OPTIMIZER_IMPLS,
)
from l2lightning.tools.doctor import FORCE_HELP


def family_list(text: str) -> list[str]:
    """``vit,recommender`` or ``all`` -> family names, checked against ``l2lightning.app.models.FAMILIES``."""
    known = family_names()
    names = [v for v in text.replace(" ", "").split(",") if v]
    if "all" in names:
        return list(known)
    bad = [n for n in names if n not in known]
    if bad or not names:
        raise argparse.ArgumentTypeError(
            f"unknown model families {bad or text!r}; choose from all, {', '.join(known)}"
        )
    return list(dict.fromkeys(names))  # each family once, in the order given


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``l2lightning bench`` options."""
    # --widths/--depths default to None so that giving only --families runs no MLP case.
    parser.add_argument("--widths", type=int_list, default=None, help="layer widths d (default 1536)")
    parser.add_argument(
        "--depths", type=int_list, default=None, help="block counts (default 40); crossed with --widths"
    )
    parser.add_argument(
        "--models",
        type=model_list,
        default=None,
        help="WIDTHxDEPTH pairs, e.g. 1536x40,1024x60 (overrides --widths/--depths)",
    )
    parser.add_argument(
        "--families",
        type=family_list,
        default=None,
        metavar="NAME[,NAME...]",
        help=(
            "model families of l2lightning.app.models (conf/model/<NAME>.yaml), e.g. vit,recommender, or `all`: "
            "each is fitted at every --batches size with the Lightning variants only (lightning_eager, "
            "callback_off, callback_auto; callback_decoy when --variants names it). Without --models, "
            "--widths or --depths, no MLP case runs"
        ),
    )
    parser.add_argument(
        "--batches", type=int_list, default=None, help="batch sizes (default 4,8,16,64; --quick: 16)"
    )
    parser.add_argument(
        "--chains",
        type=name_list(tuple(CHAIN_VARIANTS)),
        default=None,
        help="step,forward_backward,forward (default all)",
    )
    parser.add_argument(
        "--variants",
        type=name_list(ALL_VARIANTS),
        default=None,
        help=f"subset of: {', '.join(ALL_VARIANTS)}",
    )
    parser.add_argument(
        "--dtype",
        default="bfloat16",
        choices=("bfloat16", "float16", "float32"),
        help="MLP parameter dtype (default bfloat16); families keep their configs' dtype",
    )
    parser.add_argument(
        "--repeats",
        type=positive_int,
        default=None,
        help="interleaved repeats per variant (default 10; --quick: 6)",
    )
    parser.add_argument(
        "--steps", type=positive_int, default=None, help="timed steps per repeat (default 30; --quick: 10)"
    )
    parser.add_argument(
        "--prefetch", choices=("auto", "default"), default="auto", help="plans for graph_prefetch variants"
    )
    parser.add_argument(
        "--optimizer",
        choices=OPTIMIZER_IMPLS,
        default="fused",
        help="AdamW implementation of every MLP variant; families use their configure_optimizers()",
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
    parser.add_argument("--device", type=non_negative_int, default=0, help="CUDA device index")
    parser.add_argument("--force", action="store_true", help=FORCE_HELP)
    parser.add_argument("--quick", action="store_true", help="a short run (< 3 minutes on an H200)")


def settings_from_args(args: argparse.Namespace) -> BenchSettings:
    """BenchSettings from parsed ``bench`` arguments (``--quick`` shortens the defaults only).

    ``--families`` alone runs family cases only; with ``--models``, ``--widths`` or ``--depths``
    the MLP cases run too.
    """
    families = args.families or []
    if args.models:
        models = args.models
    elif families and args.widths is None and args.depths is None:
        models = []
    else:
        models = [(w, d) for w in args.widths or [1536] for d in args.depths or [40]]
    if args.criteria is None:
        criteria = DEFAULT_CRITERIA if DEFAULT_CRITERIA.is_file() else None
    else:
        criteria = args.criteria if str(args.criteria) not in ("", ".") else None
    return BenchSettings(
        models=models,
        families=families,
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
