"""Decode numerics against an FP32 reference, whole-step times, FlashInfer, and step reports (issue 18).

For SmolLM2-135M and Qwen2.5-0.5B shapes (full depth, random bf16 weights, batch 1) at the issue's
cache lengths (SmolLM2 96, 320, 1000; Qwen 150, 700, 1800) and every context of bench_decode.py
(``--contexts issue`` for the issue's six only):

1. Numerics. The FP32 reference is the same model with its bf16 weights upcast, eager PyTorch
   (SDPA math backend, no TF32), every layer recorded (``l2lightning.decode.reference.Fp32Reference``).
   "ours" is ``DecodeSession`` (auto attention, compiled elementwise ops, CUDA graph) and
   "baseline" the compiled-SDPA whole-step graph (``TorchDecodeSession``), both recording their
   layers (``record_layers=True``). Each of `--samples` independent draws of a random KV cache and
   next token goes to all of them (``compare_with_reference``); errors are relative norms over all
   draws together: the logits, each layer's attention output against the reference's (with what
   the layers before passed on), and each layer's attention operation alone (its output against
   float64 attention over the inputs it got), next to the error of rounding that float64 result
   once to bf16 (the floor for any bf16 output). The recording sessions' logits are checked to be
   bitwise those of the timed sessions (recording copies only; prefetch never changes a bit).
2. Whole-step times: the timed sessions (ours with autotuned prefetch, the baseline, and, where
   ``import flashinfer`` works and FlashInfer's decode kernels take the model's query/KV group,
   ``DecodeSession(attention="flashinfer")``: the same decode-step graph with FlashInfer's batch
   decode as each layer's attention, re-planned on the host before each replay, as bench_decode.py
   runs it), interleaved rounds of 8 graph replays, medians. FlashInfer's sessions are built and
   every graph they will replay captured before anything else runs for the model, so a FlashInfer
   failure (its JIT compile, its plan, a capture) costs its columns, with the reason recorded, and
   not the run.
3. Attention alone, at each model's layout and every context (``context + 1`` keys, batch 1): our
   kernel (each candidate the automatic choice measures; the fastest reported), SDPA (the
   baseline's attention), FlashInfer's batch decode (the path a session uses) and its
   single-request decode, each one CUDA graph of a layer count of calls on separate caches, graphs
   replayed in interleaved rounds, CUDA-event medians per call (``choose_attention`` with explicit
   candidates). Where FlashInfer cannot run a shape, ``flashinfer_reason`` says why.
4. Step reports (``l2lightning.decode.step_report.decode_step_report``), after all timing: for ours
   and the baseline at SmolLM2 320 and Qwen 700, kernels per step and per layer and each part's
   kernel time against the bytes it must move.

Writes under --out: decode_reference.csv (model, context, ours_rel_err_fp32, baseline_rel_err_fp32,
ours_us, baseline_us, flashinfer_us; the rel errs are the logits'), decode_reference_layers.csv
(per layer and variant), decode_reference_attention.csv (attention alone), decode_reference.json
(everything, with the verdicts and FlashInfer's reasons), decode_step_report.json,
decode_reference.md; prints a short table at the end. The files are first written once the steps
are timed and written again after each later part, so a run stopped by a time limit keeps what it
measured. Expected 2-3 minutes on an H200 with FlashInfer (its first use JIT-compiles its decode
kernels); `--time-budget` (default 220 s) skips the attention-alone part and the step reports,
saying so, when too little of it is left for them.

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
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))  # bench_decode beside this file
sys.path.append(str(HERE.parent))  # the checkout's package, unless PYTHONPATH or an install has one

from bench_decode import (  # noqa: E402
    MODELS,
    STEP_CONTEXTS,
    STEPS_PER_SAMPLE,
    check_gpu,
    copy_bandwidth,
    gpu_after,
    gpu_summary,
    time_steps,
    write_csv,
)

from l2lightning.decode.attention import (  # noqa: E402
    FLASHINFER_IMPLEMENTATIONS,
    AttentionChoice,
    AttentionSpec,
    candidate_specs,
    choose_attention,
    flashinfer_layout_reason,
    flashinfer_unavailable_reason,
)
from l2lightning.decode.config import DecoderConfig  # noqa: E402
from l2lightning.decode.kernel import device_sm_count  # noqa: E402
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
from l2lightning.decode.timing import rotated  # noqa: E402

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
# Attention alone: the column of each implementation's fastest candidate (µs per call).
ATTENTION_IMPL_COLUMNS = {
    "kernel": "kernel_us",
    "torch": "sdpa_us",
    "flashinfer": "flashinfer_batch_us",
    "flashinfer_single": "flashinfer_single_us",
}
ATTENTION_COLUMNS = (
    "model",
    "context",
    "keys",
    "heads",
    "kv_heads",
    "head_dim",
    "calls",
    *ATTENTION_IMPL_COLUMNS.values(),
    "kernel_label",
    "fastest",
    "flashinfer_reason",
)
TOLERANCE = 1.10  # ours may be at most 10% further from FP32 than the baseline
# The H200 test machine has no network access: FlashInfer reaches it as an offline bundle.
FLASHINFER_INSTALL_NOTE = (
    "on a machine without network access, install FlashInfer 0.7.2.post1 from the bundle that "
    "benchmarks/flashinfer_offline/README.txt describes (bash benchmarks/flashinfer_offline/install.sh "
    "/tmp/site) and put /tmp/site on PYTHONPATH"
)
SMOKE_REASON = "not run in --smoke (the CPU plumbing check times nothing)"
# Each optional part runs only with at least this much of --time-budget left. What they cost: the
# H200 runs of results/h200/COMMANDS.md took 33.5 s without the step reports and 69.9 s with them;
# attention alone is a few hundred graph replays per shape, plus, once, the JIT compile of
# FlashInfer's single decode (about 13 s per decode module on 2 cores,
# benchmarks/flashinfer_offline/README.txt).
ATTENTION_RESERVE_S = 60.0
REPORT_RESERVE_S = 45.0


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


def brief(text: str, limit: int = 300) -> str:
    """The first line of `text`, cut at `limit` characters: FlashInfer's JIT errors carry whole
    compiler logs, and a CSV cell or a Markdown table row holds one line."""
    lines = text.strip().splitlines()
    first = lines[0] if lines else ""
    return first if len(first) <= limit else first[: limit - 3] + "..."


def one_line(exc: BaseException, limit: int = 300) -> str:
    """``Type: first line of the message``, cut at `limit` characters."""
    return brief(f"{type(exc).__name__}: {exc}", limit)


def flashinfer_model_reason(
    smoke: bool, unavailable: str | None, layout: str | None, failure: str | None = None
) -> str | None:
    """Why FlashInfer has no numbers for a model, or None where it ran: the smoke check runs none,
    then an import failure, an unsupported query/KV group, or a failure while building its sessions."""
    if smoke:
        return SMOKE_REASON
    return unavailable or layout or failure


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


def flashinfer_sessions(
    model: torch.nn.Module, max_len: int, contexts: tuple[int, ...]
) -> tuple[dict[str, DecodeSession], str | None]:
    """({"recording": ..., "timed": ...}, None), or ({}, why): two DecodeSessions with FlashInfer's
    attention, every graph the run will replay captured now. FlashInfer JIT-compiles its kernels at
    the first plan and plans on the host before every replay; whatever fails there fails here, and
    the run goes on without FlashInfer for this model."""
    sessions: dict[str, DecodeSession] = {}
    try:
        sessions["recording"] = DecodeSession(
            model, 1, max_len, attention="flashinfer", prefetch=None, record_layers=True
        )
        sessions["timed"] = DecodeSession(model, 1, max_len, attention="flashinfer", prefetch=None)
        for context in contexts:
            sessions["recording"].graph_for(context)  # compare_with_reference steps at `context`
            for j in range(STEPS_PER_SAMPLE):  # the timed samples step from `context` on
                sessions["timed"].graph_for(context + j)
    except Exception as exc:  # reported in the row and the JSON; the other variants still run
        for s in sessions.values():
            s.close()
        try:
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
        except Exception as sync_exc:  # a broken CUDA context: say so, the next CUDA call will fail too
            print(f"after FlashInfer's failure CUDA reports: {one_line(sync_exc)}", flush=True)
        return {}, f"FlashInfer failed while building its decode-step graphs: {one_line(exc)}"
    return sessions, None


# ------------------------------------------------------------------------------------------ one model
def run_model(
    name: str, contexts: tuple[int, ...], args: argparse.Namespace, fi_unavailable: str | None
) -> dict:
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
    fi_failure = None
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
        if fi_unavailable is None and fi_layout is None:
            t_fi = time.time()
            fi, fi_failure = flashinfer_sessions(model, max_len, contexts)
            if fi:
                recording["flashinfer"], timed["flashinfer"] = fi["recording"], fi["timed"]
                print(f"FlashInfer sessions for {config.name}: graphs captured in {time.time() - t_fi:.0f} s")
    fi_reason = flashinfer_model_reason(smoke, fi_unavailable, fi_layout, fi_failure)
    if fi_reason and not smoke:
        print(f"FlashInfer skipped for {config.name}: {fi_reason}", flush=True)
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
            "flashinfer_attn_op_rel_err_mean": _mean(fi["attn_op_rel_err"]) if fi else None,
            "flashinfer_reason": fi_reason,
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
        fi_text = f" flashinfer {row['flashinfer_rel_err_fp32']:.4f}" if fi else ""
        print(
            f"numerics {config.name:<13} ctx={context:<5} logits vs fp32: ours {row['ours_rel_err_fp32']:.4f} "
            f"baseline {row['baseline_rel_err_fp32']:.4f} ({row['logits_ratio']:.3f}x){fi_text}  attention op: ours "
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
        "flashinfer_reason": fi_reason,
    }


def time_model(entry: dict, contexts: tuple[int, ...], rounds: int, bandwidth: float) -> None:
    """Interleaved timing of the timed sessions at each context; fills the rows' *_us columns."""
    timed, config = entry["timed"], entry["config"]
    tokens = torch.tensor([123], device="cuda")
    for row, context in zip(entry["rows"], contexts):
        samples: dict[str, list[float]] = {label: [] for label in timed}
        for r in range(rounds):
            for label in rotated(list(timed), r):
                samples[label].append(time_steps(timed[label], context, tokens))
        med = {label: statistics.median(v) for label, v in samples.items()}
        floor_us = decode_step_bytes(config, 1, context)["total"] / bandwidth * 1e6
        row["ours_us"] = round(med["ours"], 2)
        row["baseline_us"] = round(med["baseline"], 2)
        row["flashinfer_us"] = round(med["flashinfer"], 2) if "flashinfer" in med else None
        row["floor_us"] = round(floor_us, 2)
        row["ours_x_floor"] = round(med["ours"] / floor_us, 3)
        row["speedup_vs_baseline"] = round(med["baseline"] / med["ours"], 4)
        row["ours_vs_flashinfer"] = round(med["flashinfer"] / med["ours"], 4) if "flashinfer" in med else None
        print(
            f"time     {config.name:<13} ctx={context:<5} ours {row['ours_us']} µs  baseline {row['baseline_us']} µs"
            f"  flashinfer {row['flashinfer_us']}  ({row['speedup_vs_baseline']}x, ours {row['ours_x_floor']}x floor)",
            flush=True,
        )


# ------------------------------------------------------------------------------------------ attention alone
def attention_specs(config: DecoderConfig, keys: int, sm_count: int) -> list[AttentionSpec]:
    """The candidates of the attention-alone comparison: every kernel candidate the automatic
    choice would measure at this length, SDPA, and FlashInfer's batch and single-request decode."""
    kernels = [
        s
        for s in candidate_specs(config.heads, config.kv_heads, config.head_dim, keys, 1, sm_count)
        if s.impl == "kernel"
    ]
    return [*kernels, AttentionSpec("torch"), AttentionSpec("flashinfer"), AttentionSpec("flashinfer_single")]


def flashinfer_shape_reason(reasons: Mapping[str, str]) -> str | None:
    """Why FlashInfer has no time at a shape, from the reasons per implementation: one reason where
    both of its paths share it (not importable, the group size), else each path's, named; None
    where both ran."""
    batch, single = reasons.get("flashinfer"), reasons.get("flashinfer_single")
    if batch is None and single is None:
        return None
    if batch == single:
        return batch
    return "; ".join(
        f"{path}: {why}" for path, why in (("batch decode", batch), ("single decode", single)) if why
    )


def attention_row(
    config: DecoderConfig,
    context: int,
    calls: int,
    best: Mapping[str, tuple[str, float]],
    reasons: Mapping[str, str],
) -> dict[str, Any]:
    """One row of decode_reference_attention.csv from the fastest candidate per implementation
    (``AttentionChoice.best_per_impl``: impl -> (label, µs per call)) and the reasons per
    implementation that has none (``AttentionChoice.reasons_per_impl``)."""
    row: dict[str, Any] = {
        "model": config.name,
        "context": context,
        "keys": context + 1,
        "heads": config.heads,
        "kv_heads": config.kv_heads,
        "head_dim": config.head_dim,
        "calls": calls,
    }
    for impl, column in ATTENTION_IMPL_COLUMNS.items():
        row[column] = round(best[impl][1], 3) if impl in best else None
    row["kernel_label"] = best["kernel"][0] if "kernel" in best else None
    fastest = min(best, key=lambda impl: best[impl][1]) if best else None
    row["fastest"] = (
        ATTENTION_IMPL_COLUMNS[fastest].removesuffix("_us") if fastest in ATTENTION_IMPL_COLUMNS else fastest
    )
    row["flashinfer_reason"] = flashinfer_shape_reason(reasons)
    return row


def compare_attention(
    config: DecoderConfig, contexts: tuple[int, ...], rounds: int, smoke: bool
) -> tuple[list[dict], list[dict]]:
    """Attention alone at every context of one model: (CSV rows, every candidate's time and error)."""
    rows, details = [], []
    calls = config.layers

    def unmeasured(context: int, why: str) -> dict[str, Any]:
        return attention_row(config, context, calls, {}, dict.fromkeys(FLASHINFER_IMPLEMENTATIONS, why))

    for context in contexts:
        keys = context + 1
        if smoke:
            rows.append(unmeasured(context, SMOKE_REASON))
            continue
        try:
            choice = choose_attention(
                config.heads,
                config.kv_heads,
                config.head_dim,
                keys,
                torch.bfloat16,
                1,
                "cuda",
                specs=attention_specs(config, keys, device_sm_count(torch.cuda.current_device())),
                calls=calls,
                rounds=rounds,
                use_cache=False,
            )
        except Exception as exc:  # e.g. no candidate ran: the row says so, the other shapes still run
            why = f"the attention comparison failed: {one_line(exc)}"
            rows.append(unmeasured(context, why))
            details.append({"model": config.name, "context": context, "error": why})
            continue
        reasons = {impl: brief(why) for impl, why in choice.reasons_per_impl().items()}
        row = attention_row(config, context, calls, choice.best_per_impl(), reasons)
        rows.append(row)
        details.append(
            {
                "model": config.name,
                "context": context,
                "timings_us": choice.timings_us,
                "errors": choice.errors,
            }
        )
        print(
            f"attention {config.name:<13} keys={keys:<5} kernel {row['kernel_us']} µs ({row['kernel_label']})  "
            f"sdpa {row['sdpa_us']}  flashinfer batch {row['flashinfer_batch_us']} single {row['flashinfer_single_us']}"
            + (f"  [{row['flashinfer_reason']}]" if row["flashinfer_reason"] else ""),
            flush=True,
        )
    return rows, details


# ------------------------------------------------------------------------------------------ output
def _cell(x: float | None, spec: str) -> str:
    return "" if x is None else format(x, spec)


def summary_markdown(meta: dict, rows: list[dict], reports: list[dict], attention_rows: list[dict]) -> str:
    lines = [
        "# Decode against an FP32 reference",
        "",
        f"`{meta['command']}`, {gpu_summary(meta)}, torch {meta['torch']}; "
        f"{meta['samples']} random cache + token draws per row; FlashInfer: {meta['flashinfer']}.",
        "Logits and attention errors are relative norms against the FP32 model (bf16 weights upcast, same "
        "cache and token). 'op' = each layer's attention output against float64 attention over the inputs "
        "it got (mean over layers); 'floor' = that float64 result rounded once to bf16.",
    ]
    for model, why in meta.get("flashinfer_reasons", {}).items():
        if why:
            lines.append(f"No FlashInfer step times for {model}: {why}.")
    lines += [
        "",
        "| model | context | logits ours | logits baseline | ratio | op ours | op baseline | op floor | op ratio "
        "| ours µs | baseline µs | flashinfer µs | ours × floor | verdict |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['model']} | {r['context']}{'' if r['held_out'] else ' (bench)'} | {_cell(r['ours_rel_err_fp32'], '.4f')} | "
            f"{_cell(r['baseline_rel_err_fp32'], '.4f')} | {_cell(r['logits_ratio'], '.3f')} | "
            f"{_cell(r['ours_attn_op_rel_err_mean'], '.5f')} | {_cell(r['baseline_attn_op_rel_err_mean'], '.5f')} | "
            f"{_cell(r['attn_op_rounding_floor_mean'], '.5f')} | {_cell(r['attn_op_ratio'], '.3f')} | "
            f"{_cell(r.get('ours_us'), '.1f')} | {_cell(r.get('baseline_us'), '.1f')} | {_cell(r.get('flashinfer_us'), '.1f')} | "
            f"{_cell(r.get('ours_x_floor'), '.2f')} | {'ok' if r['passes'] else 'FURTHER'} |"
        )
    if attention_rows:
        lines += [
            "",
            "## Attention alone (batch 1, µs per call, one graph of a layer count of calls on separate caches)",
            "",
            "| model | keys | ours (kernel) | SDPA | FlashInfer batch | FlashInfer single | kernel candidate | fastest | FlashInfer: why not |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
        for r in attention_rows:
            lines.append(
                f"| {r['model']} | {r['keys']} | {_cell(r['kernel_us'], '.2f')} | {_cell(r['sdpa_us'], '.2f')} | "
                f"{_cell(r['flashinfer_batch_us'], '.2f')} | {_cell(r['flashinfer_single_us'], '.2f')} | "
                f"{r['kernel_label'] or ''} | {r['fastest'] or ''} | {r['flashinfer_reason'] or ''} |"
            )
    for part, why in meta.get("skipped_parts", {}).items():
        lines += ["", f"Not run: {part} ({why})."]
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


def write_outputs(
    out: Path,
    meta: dict,
    rows: list[dict],
    layer_rows: list[dict],
    attention_rows: list[dict],
    attention_details: list[dict],
    reports: list[dict],
) -> list[str]:
    """Write every file of the run from what has been measured so far; returns their names."""
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "decode_reference.csv", "w", newline="") as fh:
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
    written = ["decode_reference.csv"]
    write_csv(out / "decode_reference_layers.csv", layer_rows)
    written.append("decode_reference_layers.csv")
    if attention_rows:
        with open(out / "decode_reference_attention.csv", "w", newline="") as fh:
            writer = csv.DictWriter(fh, fieldnames=list(ATTENTION_COLUMNS))
            writer.writeheader()
            writer.writerows(attention_rows)
        written.append("decode_reference_attention.csv")
    doc = {
        **meta,
        "rows": rows,
        "layers": layer_rows,
        "attention": attention_rows,
        "attention_candidates": attention_details,
    }
    (out / "decode_reference.json").write_text(json.dumps(doc, indent=2, default=str))
    written.append("decode_reference.json")
    if reports:
        (out / "decode_step_report.json").write_text(
            json.dumps({"command": meta["command"], "reports": reports}, indent=2, default=str)
        )
        written.append("decode_step_report.json")
    (out / "decode_reference.md").write_text(summary_markdown(meta, rows, reports, attention_rows))
    written.append("decode_reference.md")
    return written


def step_reports(entries: dict, bandwidth: float) -> tuple[list[dict], float | None]:
    """(reports, the empty-kernel time they used): ours and the baseline at each model's report
    context, from the timed sessions."""
    empty_us = None
    try:
        from l2lightning.probes import measure_empty_kernel

        empty_us = measure_empty_kernel(torch.cuda.current_device(), launches=500, replays=5, trials=3)
    except Exception as exc:  # the report still has the bytes floor
        print(f"empty-kernel probe failed: {exc}", flush=True)
    reports: list[dict] = []
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
    return reports, empty_us


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
        "--force",
        action="store_true",
        help="time even when the doctor says the GPU is not ready (results marked forced)",
    )
    parser.add_argument("--skip-attention", action="store_true", help="no attention-alone comparison")
    parser.add_argument(
        "--time-budget",
        type=float,
        default=220.0,
        help="seconds the whole run may take: the attention-alone part and the step reports are "
        "skipped (and the skip recorded) when too little is left for them (default 220, for a 240 s limit)",
    )
    parser.add_argument(
        "--smoke",
        action="store_true",
        help="CPU plumbing check: 2-layer models, eager torch sessions, no timing or step report",
    )
    args = parser.parse_args(argv)
    if args.samples < 1 or args.rounds < 1:
        parser.error("--samples and --rounds must be >= 1")
    if args.time_budget <= 0:
        parser.error("--time-budget must be > 0 seconds")
    if not args.smoke and not torch.cuda.is_available():
        print("decode_reference: no CUDA device; nothing to measure (--smoke runs the CPU plumbing check)")
        return 1
    t_start = time.time()
    contexts = SMOKE_CONTEXTS if args.smoke else contexts_for(args.contexts)
    fi_unavailable = flashinfer_unavailable_reason()
    fi_ok = fi_unavailable is None and not args.smoke
    check, bandwidth = None, None
    if not args.smoke:
        check = check_gpu(args.force, "decode_reference")
        if check.refused:
            return 2
        bandwidth = copy_bandwidth()
        print(f"device-to-device copy: {bandwidth / 1e12:.2f} TB/s (read + written)", flush=True)
    print(
        f"FlashInfer: {'importable' if fi_ok else (fi_unavailable or 'not used in --smoke')}"
        + ("" if fi_ok or args.smoke else f"\n  {FLASHINFER_INSTALL_NOTE}"),
        flush=True,
    )
    entries = {name: run_model(name, contexts[name], args, fi_unavailable) for name in MODELS}
    if not args.smoke:  # all timing before any profiling (the profiler may slow later launches)
        for name, entry in entries.items():
            time_model(entry, contexts[name], args.rounds, bandwidth)
    rows = [r for entry in entries.values() for r in entry["rows"]]
    layer_rows = [r for entry in entries.values() for r in entry["layer_rows"]]
    meta = {
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "device": "cpu (smoke)" if args.smoke else torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "flashinfer": "importable" if fi_ok else (fi_unavailable or "not used in --smoke"),
        "flashinfer_install": None if fi_ok or args.smoke else FLASHINFER_INSTALL_NOTE,
        # why FlashInfer has no numbers for a model it cannot run (its decode kernels' group sizes)
        "flashinfer_layouts": {
            entry["config"].name: entry["flashinfer_layout"] or "supported" for entry in entries.values()
        },
        "flashinfer_reasons": {
            entry["config"].name: entry["flashinfer_reason"] for entry in entries.values()
        },
        "doctor": check.to_dict() if check is not None else None,
        "forced": check.forced if check is not None else False,
        "copy_bandwidth_tbps": bandwidth / 1e12 if bandwidth else None,
        "empty_kernel_us": None,
        "samples": args.samples,
        "rounds": args.rounds,
        "steps_per_sample": STEPS_PER_SAMPLE,
        "prefetch": args.prefetch,
        "contexts": {MODELS[n].name: list(c) for n, c in contexts.items()},
        "held_out_contexts": {MODELS[n].name: list(c) for n, c in ISSUE_CONTEXTS.items()},
        "tolerance": TOLERANCE,
        "all_pass": all(r["passes"] for r in rows),
        "time_budget_s": args.time_budget,
        "skipped_parts": {},
    }

    def checkpoint(
        attention_rows: list[dict], attention_details: list[dict], reports: list[dict]
    ) -> list[str]:
        meta["seconds"] = round(time.time() - t_start, 1)
        return write_outputs(args.out, meta, rows, layer_rows, attention_rows, attention_details, reports)

    def left_s() -> float:
        return args.time_budget - (time.time() - t_start)

    checkpoint([], [], [])  # the numerics and step times are safe from here on
    attention_rows: list[dict] = []
    attention_details: list[dict] = []
    if args.skip_attention:
        meta["skipped_parts"]["attention alone"] = "--skip-attention"
    elif not args.smoke and left_s() < ATTENTION_RESERVE_S:
        meta["skipped_parts"]["attention alone"] = f"{left_s():.0f} s of --time-budget left"
    else:
        t_attn = time.time()
        for name, entry in entries.items():
            got, details = compare_attention(entry["config"], contexts[name], args.rounds, args.smoke)
            attention_rows += got
            attention_details += details
        print(f"attention alone in {time.time() - t_attn:.0f} s", flush=True)
        checkpoint(attention_rows, attention_details, [])
    reports: list[dict] = []
    if not args.smoke and not args.skip_step_report:
        if left_s() < REPORT_RESERVE_S:
            meta["skipped_parts"]["step reports"] = f"{left_s():.0f} s of --time-budget left"
        else:
            reports, meta["empty_kernel_us"] = step_reports(entries, bandwidth)
    for entry in entries.values():
        for s in entry["timed"].values():
            s.close()
    meta["gpu_after"] = {} if args.smoke else gpu_after()
    for part, why in meta["skipped_parts"].items():
        print(f"not run: {part} ({why})", flush=True)
    written = checkpoint(attention_rows, attention_details, reports)
    print()
    print(short_table(rows))
    verdict = "every combination within" if meta["all_pass"] else "SOME combination NOT within"
    print(f"ours vs baseline distance from FP32: {verdict} {TOLERANCE:.2f}x (logits and attention op)")
    print(f"wrote {', '.join(str(args.out / w) for w in written)} in {meta['seconds']} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
