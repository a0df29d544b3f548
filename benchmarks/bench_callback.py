"""Trainer.fit per-step time: L2GraphCallback vs plain Lightning vs torch.compile(reduce-overhead) (issue 3).

MLP stacks (LayerNorm, Linear d, GELU) x depth in bf16 with AdamW (`--optimizer fused` or `foreach`, the
same for every variant), as in the issue:
d1536x40 b16, d1024x60 b8, d768x96 b4. Each variant is a full `Trainer.fit` of `--steps` steps with
progress bar, logger and checkpointing off; the step time is the mean over `--steps` steps after
warm-up and capture, each from its start to the next step's start (`l2lightning.step_timer.StepTimer`,
CUDA events), so Lightning's own per-step work is in it, as a user waits for it.
Variants are interleaved over `--rounds` rounds in one process. The doctor checks the GPU state
first (`l2lightning doctor`); timing is refused on a GPU that is not ready unless `--force`, and the
verdict is stored in the JSON under `doctor`.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch
from lightning.pytorch import Callback, LightningModule, Trainer, seed_everything
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from l2lightning import L2GraphCallback
from l2lightning.step_timer import StepTimer
from l2lightning.tools import doctor

CASES = [(1536, 40, 16), (1024, 60, 8), (768, 96, 4)]
# Steps before the timed ones: warm-up and the capture step of the callback variants.
UNTIMED_STEPS = 10


class MLP(LightningModule):
    def __init__(self, width: int, depth: int, optimizer: str) -> None:
        super().__init__()
        self.optimizer = optimizer
        self.net = nn.Sequential(
            *[nn.Sequential(nn.LayerNorm(width), nn.Linear(width, width), nn.GELU()) for _ in range(depth)]
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = (self(x).float() - y.float()).square().mean()
        self.log("train/loss", loss)
        return loss

    def configure_optimizers(self):
        # fused: one kernel per parameter group pass; foreach: ~a dozen multi-tensor passes, each
        # reading and writing the optimizer state (what dominates a captured step, see README)
        return torch.optim.AdamW(self.parameters(), lr=1e-4, **{self.optimizer: True})


def random_data(width: int, batch: int, batches: int) -> DataLoader:
    """`batches` batches of random bf16 (input, target) pairs of `width` features, on the host."""
    n = batch * batches
    return DataLoader(
        TensorDataset(
            torch.randn(n, width, dtype=torch.bfloat16), torch.randn(n, width, dtype=torch.bfloat16)
        ),
        batch_size=batch,
    )


def quiet_trainer(max_steps: int, callbacks: list[Callback]) -> Trainer:
    """One GPU, `max_steps` steps; no logger, checkpoints, progress bar or model summary."""
    return Trainer(
        accelerator="gpu",
        devices=1,
        max_steps=max_steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=callbacks,
    )


def run(variant: str, width: int, depth: int, batch: int, steps: int, optimizer: str) -> dict:
    # each variant compiles afresh: one reusing an earlier variant's compiled code would not show a
    # failure of its own compile path (run AR: a compile variant captured only through that reuse)
    torch._dynamo.reset()
    seed_everything(0)
    model = MLP(width, depth, optimizer).to(torch.bfloat16)
    timer = StepTimer()
    callbacks: list[Callback] = [timer]
    cb = None
    if variant.startswith("callback"):
        prefetch = {
            "callback": "off",
            "callback+prefetch": "default",
            "callback+compile": "off",
            "callback+compile+prefetch": "default",
        }[variant]
        cb = L2GraphCallback(prefetch=prefetch, compile="compile" in variant, log_timing=False)
        callbacks.append(cb)
    if variant == "compile-reduce-overhead":
        model = torch.compile(model, mode="reduce-overhead")
    trainer = quiet_trainer(UNTIMED_STEPS + steps + 1, callbacks)
    trainer.fit(model, random_data(width, batch, UNTIMED_STEPS + steps + 2))
    out = {
        "variant": variant,
        "optimizer": optimizer,
        "width": width,
        "depth": depth,
        "batch": batch,
        "step_ms": statistics.fmean(timer.window_ms(UNTIMED_STEPS, steps)),
    }
    if cb is not None:
        summary = cb.summary()
        out.update(
            {
                "captured": summary["captured"],
                "reason": summary["reason"],
                "graph_replay_ms": summary["graph_step_ms"],
            }
        )
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/h200"))
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument(
        "--variants",
        default="lightning,callback,callback+prefetch,callback+compile,callback+compile+prefetch,compile-reduce-overhead",
    )
    parser.add_argument("--cases", default="all", help="comma-separated WIDTHxDEPTHxBATCH, e.g. 1536x40x16")
    parser.add_argument("--json-name", default="callback_fit.json")
    parser.add_argument(
        "--optimizer",
        choices=("fused", "foreach"),
        default="fused",
        help="AdamW implementation (all variants)",
    )
    parser.add_argument("--force", action="store_true", help=doctor.FORCE_HELP)
    args = parser.parse_args(argv)
    check = doctor.check_before_timing(0, force=args.force, program="bench_callback")
    if check.refused:
        return 2
    variants = args.variants.split(",")
    cases = (
        CASES if args.cases == "all" else [tuple(int(v) for v in c.split("x")) for c in args.cases.split(",")]
    )
    rows = []
    for width, depth, batch in cases:
        for _ in range(args.rounds):
            for variant in variants:
                try:
                    rows.append(run(variant, width, depth, batch, args.steps, args.optimizer))
                except Exception as exc:  # a failing variant is a result too
                    rows.append(
                        {
                            "variant": variant,
                            "width": width,
                            "depth": depth,
                            "batch": batch,
                            "error": repr(exc)[:300],
                        }
                    )
                print(rows[-1], flush=True)
    table = []
    for width, depth, batch in cases:

        def med(v, width=width):
            vals = [
                r["step_ms"] for r in rows if r["variant"] == v and r["width"] == width and r.get("step_ms")
            ]
            return statistics.median(vals) if vals else None

        base = med("lightning")
        for v in variants:
            m = med(v)
            table.append(
                {
                    "case": f"d{width}x{depth} b{batch}",
                    "variant": v,
                    "step_ms": m,
                    "speedup_vs_lightning": (base / m) if base and m else None,
                }
            )
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / args.json_name).write_text(
        json.dumps(
            {
                "command": " ".join([sys.executable, *sys.argv]),
                "torch": torch.__version__,
                "optimizer": f"AdamW({args.optimizer}=True)",
                "doctor": check.to_dict(),
                "forced": check.forced,
                "runs": rows,
                "table": table,
            },
            indent=2,
        )
    )
    print(f"{'case':<18}{'variant':<26}{'ms/step':>10}{'vs Lightning':>14}")
    for r in table:
        ms = f"{r['step_ms']:.2f}" if r["step_ms"] else "n/a"
        sp = f"{r['speedup_vs_lightning']:.2f}x" if r["speedup_vs_lightning"] else "n/a"
        print(f"{r['case']:<18}{r['variant']:<26}{ms:>10}{sp:>14}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
