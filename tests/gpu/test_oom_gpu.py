"""GPU: with memory filled until plain training barely fits, the callback falls back or fits, and the fit goes on.

The callback needs memory a plain fit does not: the tuner's throwaway copies and timing graphs, and
the captured graph's private pool (its gradients and activations). With only a few percent above a
plain fit's peak left free, its warm-up steps must still run (they are training steps: an
out-of-memory error there could not be retried safely), and a capture or tuning that runs out must
free what it took, say so, and train eagerly; either way the fit is bit for bit the plain fit
(fused AdamW: the capturable and the plain configuration give the same bits).

On the H200 (2026-12-01) the callback's fit now needs no more PyTorch memory than plain training,
so with 4% to spare it captures; and the tuner sizes its throwaway chains to the free memory it
finds (even with its memory budget lifted), so it skips the shapes it cannot fit instead of running
out. The out-of-memory fallback in the capture is exercised on the CPU
(tests/callback/test_callback_replay_state_cpu.py); the one in tuning here, by a real allocator error inside a
tuning capture: a bench that, once its chain is built, takes the memory that is still free (as
another process on the GPU could) before capturing. A process's first
kernel on a second CUDA stream takes 70 MiB outside PyTorch's allocator, which no fallback can avoid
(every capture needs such a stream): the scenario pays it before sizing the filler.

The scenario runs in a fresh process: its measurement of the plain fit's peak must not see memory
that earlier tests left cached, and a failure must not leave the rest of the suite a full GPU.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.gpu

SCENARIO = r"""
import gc, json, traceback, warnings
import torch
from lightning.pytorch import Callback, seed_everything
from l2lightning import L2GraphCallback
from tests.lightning_models import TinyMLP, quiet_trainer, regression_loader

WIDTH, DEPTH, BATCH, STEPS, HEADROOM = 2048, 8, 64, 12, 1.04
PRELUDE

class Losses(Callback):
    def __init__(self):
        self.values = []
    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.values.append(outputs["loss"].detach().clone())

def fit(callbacks):
    seed_everything(0)
    model = TinyMLP(width=WIDTH, depth=DEPTH, fused=True)
    losses = Losses()
    trainer = quiet_trainer(accelerator="gpu", devices=1, max_steps=STEPS, callbacks=[losses, *callbacks])
    trainer.fit(model, regression_loader(n=BATCH * (STEPS + 1), width=WIDTH, batch_size=BATCH))
    return model, losses.values

# A process's first kernel on a CUDA stream other than the default one takes device memory outside
# PyTorch's allocator, once: 70 MiB on the H200 (benchmarks/memory_peak.py, scenario outside-torch;
# a third stream adds nothing). Every CUDA graph capture needs such a stream, so no fallback can
# avoid it; it is paid here, before the filler is sized, and the README names it as the callback's
# fixed cost. What the scenario tests is the rest: tuning and capture within what is left.
side = torch.cuda.Stream()
with torch.cuda.stream(side):
    torch.ones(1, device="cuda").add_(1)
torch.cuda.synchronize()
plain_model, plain_losses = fit([])
plain_peak = torch.cuda.max_memory_reserved()
plain_state = {k: v.detach().clone() for k, v in plain_model.state_dict().items()}
del plain_model
gc.collect(); torch.cuda.empty_cache()
free, _ = torch.cuda.mem_get_info()  # besides what the plain run's copied results still hold
filler = torch.empty(int(free - plain_peak * HEADROOM), dtype=torch.uint8, device="cuda")
out = {"plain_peak_mib": plain_peak / 2**20}
cb = L2GraphCallback(**CALLBACK_KWARGS)
# where the memory is when it runs out: the allocations alive at the peak of the recorded history
torch.cuda.memory._record_memory_history(max_entries=1_000_000, stacks="python")
try:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model, losses = fit([cb])
    out["warnings"] = [str(w.message) for w in caught if "L2GraphCallback" in str(w.message)]
    out["summary"] = {k: cb.summary()[k] for k in ("captured", "reason", "fallback_steps", "captures")}
    tuning = cb.summary()["tuning"]
    out["tuning_reasons"] = [r["reason"] for r in tuning["rows"]] if tuning else None
    out["losses_equal"] = len(losses) == len(plain_losses) and all(torch.equal(a, b) for a, b in zip(losses, plain_losses))
    out["params_equal"] = all(torch.equal(v, plain_state[k]) for k, v in model.state_dict().items())
except Exception as exc:
    out["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:600]}"
    # where it ran out: the package's frames of the traceback (what the callback failed to catch)
    out["where"] = [f"{f.filename.split('l2lightning/')[-1]}:{f.lineno} {f.name}"
                    for f in traceback.extract_tb(exc.__traceback__) if "/l2lightning/" in f.filename]
    out["summary"] = {k: cb.summary()[k] for k in ("captured", "reason", "fallback_steps", "captures")}
    import sys
    sys.path.insert(0, "benchmarks")
    from memory_peak import groups, live_at_peak
    peak, alive = live_at_peak(torch.cuda.memory._snapshot()["device_traces"][torch.cuda.current_device()])
    out["alive_at_peak_mib"] = round(peak / 2**20, 1)
    out["alive_at_peak"] = [f"{g['mib']:.1f} MiB x{g['count']} {g['where']}" for g in groups(alive)]
torch.cuda.memory._record_memory_history(enabled=None)
del filler
gc.collect(); torch.cuda.empty_cache()
cb = L2GraphCallback(prefetch="off")  # with room to spare again, the same process captures
fit([cb])
out["captured_afterwards"] = cb.summary()["captured"]
print("RESULT " + json.dumps(out, default=str))
"""


def run_scenario(callback_kwargs: dict | str, prelude: str = "") -> dict:
    """The scenario with the callback built from `callback_kwargs` (a dict, or the source of an
    expression), after `prelude` (source run first)."""
    root = Path(__file__).resolve().parents[2]
    kwargs = callback_kwargs if isinstance(callback_kwargs, str) else repr(callback_kwargs)
    code = SCENARIO.replace("PRELUDE", prelude).replace("CALLBACK_KWARGS", kwargs)
    proc = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=240)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-3000:]
    out = json.loads(lines[-1][len("RESULT ") :])
    print(json.dumps(out, indent=1))
    return out


def test_a_callback_fit_in_memory_that_only_plain_training_fits_falls_back_and_trains_like_plain():
    out = run_scenario({})
    assert "error" not in out, out  # the fit with the callback must not crash
    summary = out["summary"]
    if not summary["captured"]:
        # the capture (or tuning) ran out of memory: said once, with the cause, and the fit went on
        assert "out of memory" in (summary["reason"] or ""), out
        assert any("out of memory" in m for m in out["warnings"]), out
    # captured or not, the fit trains bit for bit like the plain one
    assert out["losses_equal"] and out["params_equal"], out
    assert out["captured_afterwards"], out


def test_tuning_without_its_memory_budget_sizes_its_chains_to_free_memory_and_does_not_run_out():
    """The tuner without its memory budget (``memory_budget=None``) next to a fit that leaves 4% over
    plain training: it builds only the chains that fit in the memory it finds free, skips the rest
    with the reason in its rows, and the step is captured, training bit for bit like plain."""
    out = run_scenario({"autotune": {"memory_budget": None, "cache": None}})
    assert "error" not in out, out
    assert not [m for m in out["warnings"] if "out of memory" in m], out
    assert any("free memory" in (reason or "") for reason in out["tuning_reasons"]), out
    assert out["summary"]["captured"] and out["summary"]["fallback_steps"] == 0, out
    assert out["losses_equal"] and out["params_equal"] and out["captured_afterwards"], out


# A tuning bench that, once its chain is built, takes what is still free before its first capture:
# the capture's allocations then fail in the real allocator, inside a CUDA graph capture. The fit
# gets room for the tuner's chains (HEADROOM, and no memory budget), so that tuning reaches its captures.
MEMORY_TAKER = r"""
HEADROOM = 4.0
import torch
from l2lightning.tune import search as _search
from l2lightning.tune.timing import CudaShapeBench

class MemoryTakenBench(CudaShapeBench):
    taken = []
    def _graph(self, plan, decoy):
        if not MemoryTakenBench.taken:
            # blocks PyTorch caches would be given back to the capture when it runs out: none left
            torch.cuda.empty_cache()
            free, _ = torch.cuda.mem_get_info()
            MemoryTakenBench.taken.append(torch.empty(free - 2**20, dtype=torch.uint8, device="cuda"))
        return super()._graph(plan, decoy)
    def close(self):
        MemoryTakenBench.taken.clear()
        super().close()

_search.CudaShapeBench = MemoryTakenBench
"""


def test_an_out_of_memory_error_inside_tuning_is_caught_freed_and_warned_once_and_the_step_is_captured_without_prefetch():
    """An allocator error in a tuning capture (memory taken between sizing and capturing): the
    tuner's chains and graphs are freed, one warning names the cause and the sizes, and the step
    is captured without prefetch, training bit for bit like plain."""
    out = run_scenario({"autotune": {"memory_budget": None, "cache": None}}, prelude=MEMORY_TAKER)
    assert "error" not in out, out
    tuning = [m for m in out["warnings"] if "out of memory while tuning" in m]
    assert len(tuning) == 1 and "GiB free" in tuning[0], out
    assert out["summary"]["captured"] and out["summary"]["fallback_steps"] == 0, out
    assert out["losses_equal"] and out["params_equal"] and out["captured_afterwards"], out


def test_an_out_of_memory_error_inside_the_steps_capture_falls_back_to_eager_steps_that_train_like_plain():
    """An allocator error raised inside the step's CUDA graph capture, next to a fit that leaves 4%
    over plain training: the partial graph is dropped, one warning names the cause and the sizes, the
    fit goes on eagerly, bit for bit like plain, and the same process captures again afterwards."""
    prelude = "from tests.lightning_models import RunsOutOfMemoryInCapture as TinyMLP"
    out = run_scenario({}, prelude=prelude)
    assert "error" not in out, out
    summary = out["summary"]
    assert not summary["captured"] and "out of memory" in (summary["reason"] or ""), out
    assert len([m for m in out["warnings"] if "out of memory" in m]) == 1, out
    assert out["losses_equal"] and out["params_equal"] and out["captured_afterwards"], out
