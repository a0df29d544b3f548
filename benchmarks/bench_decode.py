"""Decode benchmark (issue 7): decode attention alone, and whole decode steps against the plain-PyTorch baseline.

Part 1, attention alone: for both models' head layouts (SmolLM2 9 q / 3 kv heads, Qwen2.5 14 / 2)
and head dims 64 and 128, batch 1, cache lengths 64..4096 keys: every kernel candidate, the torch
path (SDPA over the length's window) and FlashInfer where importable, each as one CUDA graph of
`layers` calls on separate caches, graphs replayed in interleaved rounds (CUDA-event medians) -- the
measurement `choose_attention` makes at capture time.

Part 2, decode steps: SmolLM2-135M and Qwen2.5-0.5B at full depth with random bf16 weights, batch 1,
at 6 cached-token contexts each (12 combinations): `DecodeSession` (auto attention, compiled
elementwise ops, L2 prefetch plans from the autotuner unless --prefetch default), the same without prefetch, and `TorchDecodeSession`
(compiled elementwise ops, SDPA, whole step in one CUDA graph), and, where ``import flashinfer``
works, DecodeSession with FlashInfer's decode attention ("flashinfer"; no prefetch). Before timing:
our logits vs the baseline's (bf16 tolerance) and prefetch vs no prefetch (bitwise). Each sample is
8 graph replays; variants interleave, rotating who goes first. (The H200 machine has no network:
FlashInfer reaches it only as the offline bundle of benchmarks/flashinfer_offline/; without it its
columns stay empty.)

The floor: bytes a step must read (every weight once, the KV cache of context + 1 positions) over
the measured device-to-device copy bandwidth (bytes read + written); each step is reported as a
multiple of it. No combination here was used while developing: the kernel and its heuristics were
written without access to a GPU, and this script is their first contact with one.

Writes decode.json, decode_steps.csv, decode_attention.csv and decode_summary.md under --out.
Usage: python benchmarks/bench_decode.py --out benchmarks/results/h200 [--quick]
"""

from __future__ import annotations

import argparse
import csv
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from l2lightning.decode.attention import (
    AttentionChoice,
    choose_attention,
    flashinfer_unavailable_reason,
)
from l2lightning.decode.model import (
    QWEN25_05B,
    SMOLLM2_135M,
    DecodeSession,
    TorchDecodeSession,
    build_decoder,
    decode_step_bytes,
    length_bucket,
)
from l2lightning.decode.timing import rotated
from l2lightning.decode.timing import time_steps as time_session_steps
from l2lightning.tools import doctor

MODELS = {"smollm2-135m": SMOLLM2_135M, "qwen2.5-0.5b": QWEN25_05B}
STEP_CONTEXTS = {
    "smollm2-135m": (64, 128, 192, 256, 512, 1024),
    "qwen2.5-0.5b": (64, 128, 192, 256, 512, 2048),
}
QUICK_STEP_CONTEXTS = {"smollm2-135m": (64, 512), "qwen2.5-0.5b": (128, 2048)}
ATTN_LAYOUTS = {"smollm2 9q/3kv": (9, 3, 30), "qwen2.5 14q/2kv": (14, 2, 24)}  # heads, kv heads, layers
ATTN_LENGTHS = (64, 128, 256, 512, 1024, 2048, 4096)
QUICK_ATTN_LENGTHS = (64, 512, 4096)
HEAD_DIMS = (64, 128)
DEVELOPED_ON: list[str] = []  # combinations looked at while developing: none (no GPU was available)
STEPS_PER_SAMPLE = 8


def check_gpu(force: bool, program: str) -> doctor.TimingCheck:
    """The doctor's check before timing (``l2lightning.tools.doctor``), as every benchmark does."""
    return doctor.check_before_timing(0, force=force, program=program)


def gpu_after() -> dict:
    """The doctor's telemetry sample after timing (clocks and throttle reasons then)."""
    from l2lightning.tools.gpu_telemetry import read_sample

    return read_sample(0)


def gpu_summary(meta: dict) -> str:
    """The GPU and its state in one line, from the doctor's check kept in `meta`."""
    from l2lightning.tools.doctor_report import summary_line

    state = (meta.get("doctor") or {}).get("state")
    return summary_line(state) if state else meta.get("device", "?")


def copy_bandwidth(nbytes: int = 1 << 30, reps: int = 10) -> float:
    """Device-to-device copy bandwidth in bytes/s counting bytes read + written (median of `reps`)."""
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    dst.copy_(src)
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1000)
    del src, dst
    torch.cuda.empty_cache()
    return 2 * nbytes / statistics.median(times)


# ------------------------------------------------------------------------------------------ attention alone
def bench_attention(lengths: tuple[int, ...], rounds: int, bandwidth: float) -> tuple[list[dict], list[dict]]:
    rows, choices = [], []
    for layout, (heads, kv_heads, layers) in ATTN_LAYOUTS.items():
        for head_dim in HEAD_DIMS:
            for keys in lengths:
                choice = choose_attention(
                    heads,
                    kv_heads,
                    head_dim,
                    keys,
                    torch.bfloat16,
                    1,
                    "cuda",
                    calls=layers,
                    rounds=rounds,
                    use_cache=False,
                )
                t = choice.timings_us
                kernels = {k: v for k, v in t.items() if k.startswith("kernel")}
                torch_us = next((v for k, v in t.items() if k.startswith("torch")), None)
                flashinfer_us = next((v for k, v in t.items() if k.startswith("flashinfer")), None)
                kv_bytes = 2 * kv_heads * keys * head_dim * 2
                best_kernel = min(kernels, key=kernels.get) if kernels else None
                row = {
                    "layout": layout,
                    "heads": heads,
                    "kv_heads": kv_heads,
                    "head_dim": head_dim,
                    "keys": keys,
                    "kernel_best": best_kernel,
                    "kernel_best_us": round(kernels[best_kernel], 3) if best_kernel else None,
                    "kernel_worst_us": round(max(kernels.values()), 3) if kernels else None,
                    "torch_us": round(torch_us, 3) if torch_us else None,
                    "flashinfer_us": round(flashinfer_us, 3) if flashinfer_us else None,
                    "chosen": choice.label,
                    "kv_floor_us": round(kv_bytes / bandwidth * 1e6, 3),
                }
                row["kernel_vs_torch"] = (
                    round(row["torch_us"] / row["kernel_best_us"], 3)
                    if row["torch_us"] and row["kernel_best_us"]
                    else None
                )
                rows.append(row)
                choices.append({"layout": layout, "head_dim": head_dim, "keys": keys, **choice.to_dict()})
                print(
                    f"attention {layout:<16} D={head_dim:<4} keys={keys:<5} kernel {row['kernel_best_us']} µs "
                    f"({best_kernel})  torch {row['torch_us']} µs  flashinfer {row['flashinfer_us']}  -> {choice.label}",
                    flush=True,
                )
                if [k for k in choice.errors if k.startswith("kernel")]:
                    print(f"  kernel candidates failed: {choice.errors}", flush=True)
    return rows, choices


# ------------------------------------------------------------------------------------------ decode steps
def time_steps(session: DecodeSession, context: int, tokens: torch.Tensor) -> float:
    """µs per step of one sample of STEPS_PER_SAMPLE graph replays from `context` cached tokens."""
    # the GPU is busy while the host enqueues the sample: no submission gap timed
    return time_session_steps(session, context, tokens, STEPS_PER_SAMPLE, queue_cycles=200_000)


def bench_steps(
    contexts_by_model: dict[str, tuple[int, ...]], rounds: int, bandwidth: float, prefetch: str = "auto"
) -> tuple[list[dict], dict]:
    rows, details = [], {}
    for name, config in MODELS.items():
        contexts = contexts_by_model[name]
        t0 = time.time()
        model = build_decoder(config, device="cuda", seed=0)
        max_len = length_bucket(max(contexts) + STEPS_PER_SAMPLE + 1, 1 << 30) + 64
        variants: dict[str, DecodeSession] = {
            "baseline_torch": TorchDecodeSession(model, 1, max_len),
            "ours": DecodeSession(model, 1, max_len, attention="auto", prefetch=prefetch),
            "ours_no_prefetch": DecodeSession(model, 1, max_len, attention="auto", prefetch=None),
        }
        if flashinfer_unavailable_reason() is None:
            variants["flashinfer"] = DecodeSession(model, 1, max_len, attention="flashinfer", prefetch=None)
        for session in variants.values():  # identical cache contents everywhere, so outputs compare
            gen = torch.Generator(device="cuda").manual_seed(7)
            session.state.k_cache.copy_(
                torch.randn(session.state.k_cache.shape, generator=gen, device="cuda")
            )
            session.state.v_cache.copy_(
                torch.randn(session.state.v_cache.shape, generator=gen, device="cuda")
            )
        tokens = torch.tensor([123], device="cuda")
        checks: dict[int, tuple[float, bool, bool]] = {}
        for context in contexts:  # pass 1: capture each bucket's graph and check outputs, before any timing
            logits = {}
            for label, session in variants.items():
                session.set_length(context, tokens)
                session.step()  # captures this bucket's graph (and, for "auto", measures the attention)
                session.set_length(context, tokens)
                session.step()
                torch.cuda.synchronize()
                logits[label] = session.logits.float().clone()
            base = logits["baseline_torch"]
            checks[context] = (
                ((logits["ours"] - base).norm() / base.norm()).item(),
                bool(torch.equal(logits["ours"].argmax(-1), base.argmax(-1))),
                bool(torch.equal(logits["ours"], logits["ours_no_prefetch"])),
            )
        for context in contexts:  # pass 2: timing
            rel, same_argmax, bitwise = checks[context]
            samples: dict[str, list[float]] = {label: [] for label in variants}
            for r in range(rounds):
                for label in rotated(list(variants), r):
                    samples[label].append(time_steps(variants[label], context, tokens))
            floor_bytes = decode_step_bytes(config, 1, context)
            floor_us = floor_bytes["total"] / bandwidth * 1e6
            base_med = statistics.median(samples["baseline_torch"])
            for label, values in samples.items():
                med = statistics.median(values)
                q1, _, q3 = statistics.quantiles(values, n=4) if len(values) > 1 else (med, med, med)
                bucket = length_bucket(context + 1, max_len)
                choice = variants[label].choices.get(bucket)
                rows.append(
                    {
                        "model": config.name,
                        "context": context,
                        "variant": label,
                        "median_us": round(med, 2),
                        "q1_us": round(q1, 2),
                        "q3_us": round(q3, 2),
                        "speedup_vs_baseline": round(base_med / med, 4),
                        "floor_us": round(floor_us, 2),
                        "x_floor": round(med / floor_us, 3),
                        "bytes_per_step": floor_bytes["total"],
                        "attention": choice.label if isinstance(choice, AttentionChoice) else choice,
                        "logits_rel_err_vs_baseline": round(rel, 5) if label == "ours" else None,
                        "argmax_equal_baseline": same_argmax if label == "ours" else None,
                        "bitwise_prefetch_vs_none": bitwise if label == "ours" else None,
                        "used_while_developing": f"{config.name}@{context}" in DEVELOPED_ON,
                    }
                )
            line = "  ".join(
                f"{r['variant']} {r['median_us']:.1f}µs ({r['x_floor']:.2f}x floor)"
                for r in rows[-len(variants) :]
            )
            print(
                f"step {config.name:<13} ctx={context:<5} {line}  | rel err {rel:.2e}, "
                f"argmax equal {same_argmax}, prefetch bitwise {bitwise}",
                flush=True,
            )
        details[config.name] = {
            label: {"describe": s.describe(), "prefetch_plans": s.prefetch_summary}
            for label, s in variants.items()
        }
        for session in variants.values():
            session.close()
        del variants, model
        torch.cuda.empty_cache()
        print(f"{config.name}: {time.time() - t0:.0f} s", flush=True)
    return rows, details


# ------------------------------------------------------------------------------------------ output
def write_csv(path: Path, rows: list[dict]) -> None:
    if not rows:
        return
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)


def summary_markdown(meta: dict, attn_rows: list[dict], step_rows: list[dict]) -> str:
    bw = meta["copy_bandwidth_tbps"]
    lines = [
        "# Decode benchmark",
        "",
        f"`{meta['command']}` ({gpu_summary(meta)}), torch {meta['torch']}, "
        f"FlashInfer: {meta['flashinfer']}.",
        f"Copy bandwidth (read + written): {bw:.2f} TB/s. Medians of CUDA-event timed graph replays, "
        f"variants interleaved. Combinations used while developing: none (written without a GPU).",
        "",
        "## Decode steps (batch 1)",
        "",
        "| model | context | baseline µs | ours µs | ours no-prefetch µs | flashinfer µs | speedup | floor µs | ours × floor | attention | checks |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    by_case: dict[tuple, dict[str, dict]] = {}
    for r in step_rows:
        by_case.setdefault((r["model"], r["context"]), {})[r["variant"]] = r
    for (model, context), v in by_case.items():
        ours, base, nopf = v["ours"], v["baseline_torch"], v["ours_no_prefetch"]
        fi_us = v["flashinfer"]["median_us"] if "flashinfer" in v else ""
        checks = (
            f"rel err {ours['logits_rel_err_vs_baseline']}, argmax {'=' if ours['argmax_equal_baseline'] else '≠'}, "
            f"prefetch {'bitwise' if ours['bitwise_prefetch_vs_none'] else 'DIFFERS'}"
        )
        lines.append(
            f"| {model} | {context} | {base['median_us']} | {ours['median_us']} | {nopf['median_us']} | {fi_us} | "
            f"{ours['speedup_vs_baseline']:.3f}x | {ours['floor_us']} | {ours['x_floor']} | {ours['attention']} | {checks} |"
        )
    lines += [
        "",
        "## Attention alone (batch 1, µs per call, one graph of `layers` calls on separate caches)",
        "",
        "| layout | D | keys | kernel best | kernel worst | torch | flashinfer | chosen | KV floor µs |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in attn_rows:
        lines.append(
            f"| {r['layout']} | {r['head_dim']} | {r['keys']} | {r['kernel_best_us']} ({r['kernel_best']}) | "
            f"{r['kernel_worst_us']} | {r['torch_us']} | {r['flashinfer_us']} | {r['chosen']} | {r['kv_floor_us']} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/h200"))
    parser.add_argument(
        "--quick", action="store_true", help="fewer lengths and contexts (< 2 minutes on an H200)"
    )
    parser.add_argument(
        "--rounds", type=int, default=None, help="interleaved rounds per case (default 9, quick 5)"
    )
    parser.add_argument("--skip-attention", action="store_true")
    parser.add_argument(
        "--prefetch",
        default="auto",
        choices=("auto", "default"),
        help="plans for 'ours': measured by the autotuner (auto) or sized by layer bytes (default)",
    )
    parser.add_argument("--skip-steps", action="store_true")
    parser.add_argument("--force", action="store_true", help=doctor.FORCE_HELP)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_decode: no CUDA device; nothing to measure")
        return 1
    t_start = time.time()
    rounds = args.rounds or (5 if args.quick else 9)
    check = check_gpu(args.force, "bench_decode")
    if check.refused:
        return 2
    bandwidth = copy_bandwidth()
    print(f"device-to-device copy: {bandwidth / 1e12:.2f} TB/s (read + written)", flush=True)
    attn_rows, attn_choices = (
        ([], [])
        if args.skip_attention
        else bench_attention(QUICK_ATTN_LENGTHS if args.quick else ATTN_LENGTHS, rounds, bandwidth)
    )
    step_rows, details = (
        ([], {})
        if args.skip_steps
        else bench_steps(
            QUICK_STEP_CONTEXTS if args.quick else STEP_CONTEXTS, rounds, bandwidth, args.prefetch
        )
    )
    try:
        import cupy

        cupy_version = cupy.__version__
    except Exception as exc:  # report, don't fail: the torch paths still ran
        cupy_version = f"not importable: {exc}"
    meta = {
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "torch": torch.__version__,
        "cupy": cupy_version,
        "flashinfer": flashinfer_unavailable_reason() or "importable",
        "doctor": check.to_dict(),
        "forced": check.forced,
        "gpu_after": gpu_after(),
        "copy_bandwidth_tbps": bandwidth / 1e12,
        "rounds": rounds,
        "steps_per_sample": STEPS_PER_SAMPLE,
        "quick": args.quick,
        "prefetch": args.prefetch,
        "used_while_developing": DEVELOPED_ON,
        "used_while_developing_note": "none: the kernel and its defaults were written without GPU access",
        "seconds": round(time.time() - t_start, 1),
    }
    args.out.mkdir(parents=True, exist_ok=True)
    payload = {
        **meta,
        "steps": step_rows,
        "attention": attn_rows,
        "attention_choices": attn_choices,
        "sessions": details,
    }
    (args.out / "decode.json").write_text(json.dumps(payload, indent=2, default=str))
    write_csv(args.out / "decode_steps.csv", step_rows)
    write_csv(args.out / "decode_attention.csv", attn_rows)
    summary = summary_markdown(meta, attn_rows, step_rows)
    (args.out / "decode_summary.md").write_text(summary)
    print(summary)
    print(
        f"wrote {args.out}/decode.json, decode_steps.csv, decode_attention.csv, decode_summary.md in {meta['seconds']} s"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
