"""The decode-attention kernel's script mode: a small workload for compute-sanitizer, and one choice.

``python -m l2lightning.decode.attention --sanitize`` runs a few small launches (the merge and the
direct paths, grouped-query layouts, both dtypes and head dims, a graph replayed with the length
advancing inside it) under ``compute-sanitizer --tool memcheck`` / ``racecheck`` and checks each
result against float64 attention; ``--choose H,KVH,D,BUCKET,BATCH`` prints one
:func:`choose_attention` table.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

import torch

from l2lightning.decode.checks import DecodeLayout, random_decode_inputs
from l2lightning.decode.choice import choose_attention
from l2lightning.decode.kernel import DecodeWorkspace, decode_attention
from l2lightning.decode.numerics import reference_decode_attention, relative_error

# The kernel's outputs sit at about 1.7e-3 from float64 attention in bf16 (benchmarks/README.md);
# 1e-2 separates a rounding difference from a wrong merge or a missed key.
SANITIZE_TOLERANCE = 1e-2


def run_sanitize_workload(verbose: bool = True) -> int:
    """A few small launches (merge and direct paths, GQA, both dtypes and head dims, a graph replayed
    a few times) for compute-sanitizer's memcheck and racecheck; checks results too. Returns 0 when
    every result is within tolerance (and the graph left the merge tickets at 0), else 1."""
    from l2lightning._kernels import require_gpu_kernels

    require_gpu_kernels("decode_attention --sanitize")
    device = torch.device("cuda", torch.cuda.current_device())
    gen = torch.Generator(device=device).manual_seed(0)
    failures = 0
    cases = [  # (batch, heads, kv_heads, head_dim, dtype, max_len, lens, splits)
        (1, 14, 2, 64, torch.bfloat16, 160, [130], 4),
        (3, 9, 3, 64, torch.float16, 100, [0, 63, 64], 3),
        (2, 4, 4, 128, torch.bfloat16, 80, [7, 79], None),
        (1, 7, 1, 128, torch.float16, 300, [299], 8),
        (2, 16, 2, 64, torch.bfloat16, 64, [5, 40], 2),
    ]
    for batch, heads, kv_heads, d, dtype, max_len, lens_list, splits in cases:
        layout = DecodeLayout(batch, heads, kv_heads, d, max_len)
        q, k, v, (kc,), (vc,) = random_decode_inputs(layout, dtype, device, gen)
        lens = torch.tensor(lens_list, dtype=torch.int32, device=device)
        ref = reference_decode_attention(q, k, v, kc, vc, lens)
        out = decode_attention(q, k, v, kc, vc, lens, splits=splits)
        torch.cuda.synchronize()
        err = relative_error(out, ref)
        ok = err < SANITIZE_TOLERANCE
        failures += not ok
        if verbose:
            print(
                f"B={batch} H={heads} KVH={kv_heads} D={d} {str(dtype)[6:]} lens={lens_list} splits={splits}: "
                f"rel err {err:.2e} {'ok' if ok else 'FAIL'}"
            )
    # graph: capture once, replay with the length advancing in the graph
    layout = DecodeLayout(2, 14, 2, 64, 200)
    q, k, v, (kc,), (vc,) = random_decode_inputs(layout, torch.bfloat16, device)
    lens = torch.tensor([60, 100], dtype=torch.int32, device=device)
    ws = DecodeWorkspace(layout.batch * layout.kv_heads, 6, 7, layout.head_dim, device)
    decode_attention(q, k, v, kc, vc, lens, splits=6, workspace=ws)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = decode_attention(q, k, v, kc, vc, lens, splits=6, workspace=ws)
        lens.add_(1)
    for _ in range(5):
        graph.replay()
    torch.cuda.synchronize()
    lens.sub_(1)
    err = relative_error(out, reference_decode_attention(q, k, v, kc, vc, lens))
    tickets_zero = bool((ws.tickets == 0).all())
    ok = err < SANITIZE_TOLERANCE and tickets_zero
    failures += not ok
    if verbose:
        print(f"graph x5: rel err {err:.2e}, tickets reset {tickets_zero}: {'ok' if ok else 'FAIL'}")
        print("decode_attention sanitize workload done" + (f", {failures} FAILED" if failures else ""))
    return 1 if failures else 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m l2lightning.decode.attention",
        description="Decode attention: one new token per sequence appends its key/value to the KV cache and attends over it.",
    )
    parser.add_argument(
        "--sanitize",
        action="store_true",
        help="run a few small launches and one graph (for compute-sanitizer memcheck/racecheck)",
    )
    parser.add_argument(
        "--choose",
        metavar="H,KVH,D,BUCKET,BATCH",
        help="run choose_attention for one layout (bf16) and print its table",
    )
    args = parser.parse_args(argv)
    if args.sanitize:
        try:
            return run_sanitize_workload()
        except RuntimeError as exc:  # no GPU / no CuPy: say so in one line
            print(f"decode_attention --sanitize: {exc}", file=sys.stderr)
            return 2
    if args.choose:
        try:
            h, kvh, d, bucket, batch = (int(x) for x in args.choose.split(","))
        except ValueError:
            parser.error(f"--choose expects five integers H,KVH,D,BUCKET,BATCH, got {args.choose!r}")
        print(choose_attention(h, kvh, d, bucket, torch.bfloat16, batch, "cuda").table())
        return 0
    parser.print_help()
    return 0
