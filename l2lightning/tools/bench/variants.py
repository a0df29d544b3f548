"""The benchmark's variants: one list, read by the harness, its CLI and the plots.

Importing it needs nothing beyond Python, so that ``l2lightning bench --help`` lists the variants
before torch is loaded.
"""

from __future__ import annotations

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
COMPILE_VARIANTS = ("compile_ro", "compile_graph", "compile_graph_prefetch")
LIGHTNING_VARIANTS = ("lightning_eager", "callback_off", "callback_auto", "callback_decoy")
# What a family case runs unless --variants says otherwise (the decoy is a control, asked for by name).
FAMILY_DEFAULT_VARIANTS = ("lightning_eager", "callback_off", "callback_auto")

# Plots and tables list the baselines first, then the harness's order.
BASELINE_VARIANTS = ("lightning_eager", "eager")
VARIANT_ORDER = BASELINE_VARIANTS + tuple(v for v in STEP_VARIANTS if v not in BASELINE_VARIANTS)
