"""Decode numerics against an FP32 reference, whole-step times, FlashInfer, and step reports (issue 18).

For SmolLM2-135M and Qwen2.5-0.5B shapes (full depth, random bf16 weights, batch 1) at the issue's
cache lengths (SmolLM2 96, 320, 1000; Qwen 150, 700, 1800) and every context of bench_decode.py
(``--contexts issue`` for the issue's six only):

1. Numerics. The FP32 reference is the same model with its bf16 weights upcast, eager PyTorch
   (SDPA math backend, no TF32), every layer recorded (``l2lightning.decode.model.Fp32Reference``).
   "ours" is ``DecodeSession`` (auto attention, compiled elementwise ops, CUDA graph) and
   "baseline" the compiled-SDPA whole-step graph (``TorchDecodeSession``), both recording their
   layers (``record_layers=True``). Each of `--samples` independent draws of a random KV cache and
   next token goes to all of them (``compare_with_reference``); errors are relative norms over all
   draws together: the logits, each layer's attention output against the reference's (with what
   the layers before passed on), and each layer's attention operation alone (its output against
   float64 attention over the inputs it got), next to the error of rounding that float64 result
   once to bf16 (the floor for any bf16 output). The recording sessions' logits are checked to be
   bitwise those of the timed sessions (recording copies only; prefetch never changes a bit).
2. Times: the timed sessions (ours with autotuned prefetch, the baseline, and DecodeSession with
   FlashInfer attention where ``import flashinfer`` works), interleaved rounds of 8 graph replays,
   medians, as bench_decode.py times them.
3. Step reports (``l2lightning.decode.model.decode_step_report``), after all timing: for ours and the
   baseline at SmolLM2 320 and Qwen 700, kernels per step and per layer and each part's kernel
   time against the bytes it must move.

Writes under --out: decode_reference.csv (model, context, ours_rel_err_fp32, baseline_rel_err_fp32,
ours_us, baseline_us, flashinfer_us; the rel errs are the logits'), decode_reference_layers.csv
(per layer and variant), decode_reference.json (everything, with the verdicts), decode_step_report.json,
decode_reference.md; prints a short table at the end. Expected 1-2 minutes on an H200 (written to stay under 3).

Usage: python3 benchmarks/decode_reference.py --out DIR [--contexts issue] [--samples 8]
       python3 benchmarks/decode_reference.py --smoke --out DIR   (CPU plumbing check: 2 layers, eager, no timing)
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

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))  # bench_decode beside this file
sys.path.append(str(HERE.parent))  # the checkout's package, unless PYTHONPATH or an install has one

from bench_decode import (  # noqa: E402
    MODELS,
    STEP_CONTEXTS,
    STEPS_PER_SAMPLE,
    copy_bandwidth,
    gpu_state,
    time_steps,
    warn_gpu_state,
    write_csv,
)

from l2lightning.decode.attention import (  # noqa: E402
    AttentionChoice,
    flashinfer_layout_reason,
    flashinfer_unavailable_reason,
)
from l2lightning.decode.model import (  # noqa: E402
    DecodeSession,
    Fp32Reference,
    TorchDecodeSession,
    build_decoder,
    compare_with_reference,
    decode_step_bytes,
    decode_step_report,
    length_bucket,
)

ISSUE_CONTEXTS = {"smollm2-135m": (96, 320, 1000), "qwen2.5-0.5b": (150, 700, 1800)}
REPORT_CONTEXTS = {"smollm2-135m": 320, "qwen2.5-0.5b": 700}
SMOKE_CONTEXTS = {"smollm2-135m": (96,), "qwen2.5-0.5b": (150,)}
CSV_COLUMNS = (
    "model",
    "context",
    "ours_rel_err_fp32",
    "baseline_rel_err_fp32",
    "ours_us",
    "baseline_us",
    "flashinfer_us",
)
TOLERANCE = 1.10  # ours may be at most 10% further from FP32 than the baseline
FLASHINFER_NOT_INSTALLED = (
    "FlashInfer is not installed on the H200 test machine, which has no network access: "
    "flashinfer-python 0.7.2.post1 (a 62,052,965-byte wheel) and what `import flashinfer` needs "
    "(apache-tvm-ffi and more, about 107 MB together) were not brought there (benchmarks/README.md, Decode)"
)


def contexts_for(which: str) -> dict[str, tuple[int, ...]]:
    if which == "issue":
        return dict(ISSUE_CONTEXTS)
    if which == "bench":
        return dict(STEP_CONTEXTS)
    return {name: tuple(sorted(set(ISSUE_CONTEXTS[name]) | set(STEP_CONTEXTS[name]))) for name in MODELS}


def _mean(values: list[float] | None) -> float | None:
    return statistics.fmean(values) if values else None


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def _round(x: float | None, digits: int = 6) -> float | None:
    return None if x is None else round(x, digits)


def bitwise_twin(recording: DecodeSession, timed: DecodeSession, context: int) -> bool:
    """One step of both on the recording session's cache and one fixed token: same logits bits?"""
    with torch.no_grad():
        timed.state.k_cache[:, :, :, :context].copy_(recording.state.k_cache[:, :, :, :context])
        timed.state.v_cache[:, :, :, :context].copy_(recording.state.v_cache[:, :, :, :context])
    tokens = torch.full((recording.batch,), 123, dtype=torch.long, device=recording.device)
    for s in (recording, timed):
        s.set_length(context, tokens)
        s.step()
    return bool(torch.equal(recording.logits, timed.logits))


def attention_label(session: DecodeSession, context: int) -> str | None:
    choice = session.choices.get(length_bucket(context + 1, session.max_len))
    return choice.label if isinstance(choice, AttentionChoice) else choice


# ------------------------------------------------------------------------------------------ one model
def run_model(name: str, contexts: tuple[int, ...], args: argparse.Namespace, fi_ok: bool) -> dict:
    """Numerics for every context, then (on CUDA) the timed sessions' graphs captured and checked.
    Returns rows, per-layer rows, and the timed sessions for the timing pass."""
    config = MODELS[name]
    smoke = args.smoke
    device = "cuda" if not smoke else "cpu"
    t0 = time.time()
    model = build_decoder(config, layers=2 if smoke else None, device=device, seed=0)
    config = model.config
    fi_layout = flashinfer_layout_reason(config.heads, config.kv_heads)
    max_len = length_bucket(max(contexts) + STEPS_PER_SAMPLE + 1, 1 << 30) + 64
    if smoke:
        eager = {"attention": "torch", "compile_elementwise": False, "prefetch": None, "graph": False}
        recording = {
            "ours": DecodeSession(model, 1, max_len, **eager, record_layers=True),
            "baseline": DecodeSession(model, 1, max_len, **eager, record_layers=True),
        }
        timed = {
            "ours": DecodeSession(model, 1, max_len, **eager),
            "baseline": DecodeSession(model, 1, max_len, **eager),
        }
    else:
        recording = {
            "ours": DecodeSession(model, 1, max_len, attention="auto", prefetch=None, record_layers=True),
            "baseline": TorchDecodeSession(model, 1, max_len, record_layers=True),
        }
        timed = {
            "ours": DecodeSession(model, 1, max_len, attention="auto", prefetch=args.prefetch),
            "baseline": TorchDecodeSession(model, 1, max_len),
        }
        if fi_ok and fi_layout:
            print(f"FlashInfer skipped for {model.config.name}: {fi_layout}", flush=True)
        if fi_ok and not fi_layout:
            recording["flashinfer"] = DecodeSession(
                model, 1, max_len, attention="flashinfer", prefetch=None, record_layers=True
            )
            timed["flashinfer"] = DecodeSession(model, 1, max_len, attention="flashinfer", prefetch=None)
    reference = Fp32Reference(model, 1, max_len)
    rows, layer_rows = [], []
    for context in contexts:
        cmp = compare_with_reference(recording, reference, context, samples=args.samples, seed=context)
        twins = {label: bitwise_twin(recording[label], timed[label], context) for label in timed}
        if not smoke:  # every bucket the timed steps will touch, captured before any timing
            for session in timed.values():
                for j in range(STEPS_PER_SAMPLE):
                    session.graph_for(context + j)
        ours, base = cmp["ours"], cmp["baseline"]
        fi = cmp.get("flashinfer")
        row = {
            "model": config.name,
            "context": context,
            "ours_rel_err_fp32": ours["logits_rel_err"],
            "baseline_rel_err_fp32": base["logits_rel_err"],
            "flashinfer_rel_err_fp32": fi["logits_rel_err"] if fi else None,
            "logits_ratio": _ratio(ours["logits_rel_err"], base["logits_rel_err"]),
            "ours_attn_op_rel_err_mean": _mean(ours["attn_op_rel_err"]),
            "baseline_attn_op_rel_err_mean": _mean(base["attn_op_rel_err"]),
            "attn_op_rounding_floor_mean": _mean(ours["attn_op_rounding_floor"]),
            "attn_op_ratio": _ratio(_mean(ours["attn_op_rel_err"]), _mean(base["attn_op_rel_err"])),
            "ours_attn_rel_err_mean": _mean(ours["attn_rel_err"]),
            "baseline_attn_rel_err_mean": _mean(base["attn_rel_err"]),
            "ours_argmax_equal_fp32": ours["argmax_equal"],
            "baseline_argmax_equal_fp32": base["argmax_equal"],
            "ours_logits_rel_err_samples": ours["logits_rel_err_samples"],
            "baseline_logits_rel_err_samples": base["logits_rel_err_samples"],
            "recording_bitwise_timed": twins,
            "ours_attention": attention_label(timed["ours"], context),
            "samples": args.samples,
            "held_out": context in ISSUE_CONTEXTS[name],
        }
        row["passes"] = bool(
            row["logits_ratio"] is not None
            and row["logits_ratio"] <= TOLERANCE
            and (row["attn_op_ratio"] is None or row["attn_op_ratio"] <= TOLERANCE)
        )
        rows.append(row)
        for variant, res in cmp.items():
            for i in range(len(res["attn_rel_err"] or ())):
                layer_rows.append(
                    {
                        "model": config.name,
                        "context": context,
                        "variant": variant,
                        "layer": i,
                        "attn_rel_err_fp32": _round(res["attn_rel_err"][i], 7),
                        "attn_op_rel_err": _round(res["attn_op_rel_err"][i], 7),
                        "attn_op_rounding_floor": _round(res["attn_op_rounding_floor"][i], 7),
                    }
                )
        print(
            f"numerics {config.name:<13} ctx={context:<5} logits vs fp32: ours {row['ours_rel_err_fp32']:.4f} "
            f"baseline {row['baseline_rel_err_fp32']:.4f} ({row['logits_ratio']:.3f}x)  attention op: ours "
            f"{row['ours_attn_op_rel_err_mean']:.5f} baseline {row['baseline_attn_op_rel_err_mean']:.5f} "
            f"floor {row['attn_op_rounding_floor_mean']:.5f}  recording bitwise {twins}  [{row['ours_attention']}]",
            flush=True,
        )
    for s in recording.values():
        s.close()
    del recording, reference
    if not smoke:
        torch.cuda.empty_cache()
    print(f"{config.name}: numerics in {time.time() - t0:.0f} s", flush=True)
    return {
        "config": config,
        "model": model,
        "timed": timed,
        "rows": rows,
        "layer_rows": layer_rows,
        "flashinfer_layout": fi_layout,
    }


def time_model(entry: dict, contexts: tuple[int, ...], rounds: int, bandwidth: float) -> None:
    """Interleaved timing of the timed sessions at each context; fills the rows' *_us columns."""
    timed, config = entry["timed"], entry["config"]
    tokens = torch.tensor([123], device="cuda")
    for row, context in zip(entry["rows"], contexts):
        samples: dict[str, list[float]] = {label: [] for label in timed}
        order = list(timed)
        for r in range(rounds):
            for label in order[r % len(order) :] + order[: r % len(order)]:
                samples[label].append(time_steps(timed[label], context, tokens))
        med = {label: statistics.median(v) for label, v in samples.items()}
        floor_us = decode_step_bytes(config, 1, context)["total"] / bandwidth * 1e6
        row["ours_us"] = round(med["ours"], 2)
        row["baseline_us"] = round(med["baseline"], 2)
        row["flashinfer_us"] = round(med["flashinfer"], 2) if "flashinfer" in med else None
        row["floor_us"] = round(floor_us, 2)
        row["ours_x_floor"] = round(med["ours"] / floor_us, 3)
        row["speedup_vs_baseline"] = round(med["baseline"] / med["ours"], 4)
        print(
            f"time     {config.name:<13} ctx={context:<5} ours {row['ours_us']} µs  baseline {row['baseline_us']} µs"
            f"  flashinfer {row['flashinfer_us']}  ({row['speedup_vs_baseline']}x, ours {row['ours_x_floor']}x floor)",
            flush=True,
        )


# ------------------------------------------------------------------------------------------ output
def summary_markdown(meta: dict, rows: list[dict], reports: list[dict]) -> str:
    lines = [
        "# Decode against an FP32 reference",
        "",
        f"`{meta['command']}`, {meta.get('gpu_state', {}).get('name', meta['device'])}, torch {meta['torch']}; "
        f"{meta['samples']} random cache + token draws per row; FlashInfer: {meta['flashinfer']}.",
        "Logits and attention errors are relative norms against the FP32 model (bf16 weights upcast, same "
        "cache and token). 'op' = each layer's attention output against float64 attention over the inputs "
        "it got (mean over layers); 'floor' = that float64 result rounded once to bf16.",
        "",
        "| model | context | logits ours | logits baseline | ratio | op ours | op baseline | op floor | op ratio "
        "| ours µs | baseline µs | flashinfer µs | ours × floor | verdict |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]

    def f(x: float | None, spec: str) -> str:
        return "" if x is None else format(x, spec)

    for r in rows:
        lines.append(
            f"| {r['model']} | {r['context']}{'' if r['held_out'] else ' (bench)'} | {f(r['ours_rel_err_fp32'], '.4f')} | "
            f"{f(r['baseline_rel_err_fp32'], '.4f')} | {f(r['logits_ratio'], '.3f')} | "
            f"{f(r['ours_attn_op_rel_err_mean'], '.5f')} | {f(r['baseline_attn_op_rel_err_mean'], '.5f')} | "
            f"{f(r['attn_op_rounding_floor_mean'], '.5f')} | {f(r['attn_op_ratio'], '.3f')} | "
            f"{f(r.get('ours_us'), '.1f')} | {f(r.get('baseline_us'), '.1f')} | {f(r.get('flashinfer_us'), '.1f')} | "
            f"{f(r.get('ours_x_floor'), '.2f')} | {'ok' if r['passes'] else 'FURTHER'} |"
        )
    if reports:
        lines += ["", "## Step reports", ""]
        for rep in reports:
            lines += ["```", rep.get("text", rep.get("error", "")), "```", ""]
    return "\n".join(lines) + "\n"


def short_table(rows: list[dict]) -> str:
    head = f"{'model':<13}{'ctx':>6}{'ours err':>10}{'base err':>10}{'ratio':>7}{'op ratio':>9}{'ours µs':>10}{'base µs':>10}{'fi µs':>8}  verdict"
    out = [head]
    for r in rows:
        out.append(
            f"{r['model']:<13}{r['context']:>6}{r['ours_rel_err_fp32']:>10.4f}{r['baseline_rel_err_fp32']:>10.4f}"
            f"{r['logits_ratio'] or 0:>7.3f}{r['attn_op_ratio'] or 0:>9.3f}{r.get('ours_us') or '-':>10}"
            f"{r.get('baseline_us') or '-':>10}{r.get('flashinfer_us') or '-':>8}  {'ok' if r['passes'] else 'FURTHER'}"
        )
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument(
        "--contexts",
        choices=("all", "issue", "bench"),
        default="all",
        help="the issue's six cache lengths, bench_decode.py's twelve, or both (default)",
    )
    parser.add_argument("--samples", type=int, default=8, help="random cache + token draws per combination")
    parser.add_argument("--rounds", type=int, default=9, help="interleaved timing rounds per combination")
    parser.add_argument("--prefetch", default="auto", choices=("auto", "default"))
    parser.add_argument("--skip-step-report", action="store_true")
    parser.add_argument(
        "--smoke",
        action="store_true",
        help="CPU plumbing check: 2-layer models, eager torch sessions, no timing or step report",
    )
    args = parser.parse_args(argv)
    if args.samples < 1 or args.rounds < 1:
        parser.error("--samples and --rounds must be >= 1")
    if not args.smoke and not torch.cuda.is_available():
        print("decode_reference: no CUDA device; nothing to measure (--smoke runs the CPU plumbing check)")
        return 1
    t_start = time.time()
    contexts = SMOKE_CONTEXTS if args.smoke else contexts_for(args.contexts)
    fi_reason = flashinfer_unavailable_reason()
    fi_ok = fi_reason is None and not args.smoke
    state, bandwidth, empty_us = {}, None, None
    if not args.smoke:
        state = gpu_state()
        print(
            "GPU state before timing:", state, *(f"\nWARNING: {w}" for w in warn_gpu_state(state)), flush=True
        )
        bandwidth = copy_bandwidth()
        print(f"device-to-device copy: {bandwidth / 1e12:.2f} TB/s (read + written)", flush=True)
    print(
        f"FlashInfer: {'importable' if fi_ok else (fi_reason or 'not used in --smoke')}"
        + ("" if fi_ok or args.smoke else f"\n  not carried: {FLASHINFER_NOT_INSTALLED}"),
        flush=True,
    )
    entries = {name: run_model(name, contexts[name], args, fi_ok) for name in MODELS}
    if not args.smoke:  # all timing before any profiling (the profiler may slow later launches)
        for name, entry in entries.items():
            time_model(entry, contexts[name], args.rounds, bandwidth)
    reports: list[dict] = []
    if not args.smoke and not args.skip_step_report:
        try:
            from l2lightning.probes import measure_empty_kernel

            empty_us = measure_empty_kernel(torch.cuda.current_device(), launches=500, replays=5, trials=3)
        except Exception as exc:  # the report still has the bytes floor
            print(f"empty-kernel probe failed: {exc}", flush=True)
        for name, entry in entries.items():
            context = REPORT_CONTEXTS[name]
            row = next((r for r in entry["rows"] if r["context"] == context), None)
            for label in ("ours", "baseline"):
                session = entry["timed"][label]
                step_us = row.get(f"{label}_us") if row else None
                try:
                    rep = decode_step_report(
                        session,
                        context,
                        torch.tensor([123], device="cuda"),
                        step_us=step_us,
                        copy_bw=bandwidth,
                        empty_kernel_us=empty_us,
                        label=f"{entry['config'].name} {label} at {context} cached tokens",
                    )
                    rep["variant"] = label
                except Exception as exc:  # the CSVs must still come out
                    rep = {"variant": label, "model": entry["config"].name, "cached": context}
                    rep["error"] = f"{type(exc).__name__}: {exc}"
                reports.append(rep)
                print(rep.get("text") or f"step report {label} {context}: {rep.get('error')}", flush=True)
    rows = [r for entry in entries.values() for r in entry["rows"]]
    layer_rows = [r for entry in entries.values() for r in entry["layer_rows"]]
    for entry in entries.values():
        for s in entry["timed"].values():
            s.close()
    meta = {
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "device": "cpu (smoke)" if args.smoke else torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "flashinfer": "importable" if fi_ok else (fi_reason or "not used in --smoke"),
        "flashinfer_not_installed": None if fi_ok else FLASHINFER_NOT_INSTALLED,
        # why FlashInfer has no numbers for a model it cannot run (its decode kernels' group sizes)
        "flashinfer_layouts": {
            entry["config"].name: entry["flashinfer_layout"] or "supported" for entry in entries.values()
        },
        "gpu_state": state,
        "gpu_state_after": {} if args.smoke else gpu_state(),
        "copy_bandwidth_tbps": bandwidth / 1e12 if bandwidth else None,
        "empty_kernel_us": empty_us,
        "samples": args.samples,
        "rounds": args.rounds,
        "steps_per_sample": STEPS_PER_SAMPLE,
        "prefetch": args.prefetch,
        "contexts": {MODELS[n].name: list(c) for n, c in contexts.items()},
        "held_out_contexts": {MODELS[n].name: list(c) for n, c in ISSUE_CONTEXTS.items()},
        "tolerance": TOLERANCE,
        "all_pass": all(r["passes"] for r in rows),
        "seconds": round(time.time() - t_start, 1),
    }
    args.out.mkdir(parents=True, exist_ok=True)
    with open(args.out / "decode_reference.csv", "w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=list(CSV_COLUMNS), extrasaction="ignore")
        writer.writeheader()
        for r in rows:
            writer.writerow(
                {
                    **{k: r.get(k) for k in CSV_COLUMNS},
                    "ours_rel_err_fp32": _round(r["ours_rel_err_fp32"]),
                    "baseline_rel_err_fp32": _round(r["baseline_rel_err_fp32"]),
                }
            )
    write_csv(args.out / "decode_reference_layers.csv", layer_rows)
    (args.out / "decode_reference.json").write_text(
        json.dumps({**meta, "rows": rows, "layers": layer_rows}, indent=2, default=str)
    )
    if reports:
        (args.out / "decode_step_report.json").write_text(
            json.dumps({"command": meta["command"], "reports": reports}, indent=2, default=str)
        )
    (args.out / "decode_reference.md").write_text(summary_markdown(meta, rows, reports))
    print()
    print(short_table(rows))
    verdict = "every combination within" if meta["all_pass"] else "SOME combination NOT within"
    print(f"ours vs baseline distance from FP32: {verdict} {TOLERANCE:.2f}x (logits and attention op)")
    written = [
        "decode_reference.csv",
        "decode_reference_layers.csv",
        "decode_reference.json",
        "decode_reference.md",
    ]
    if reports:
        written.insert(3, "decode_step_report.json")
    print(f"wrote {', '.join(str(args.out / w) for w in written)} in {meta['seconds']} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
