"""Is a fit with a submodule the user compiled (torch.compile, inductor) bitwise repeatable, with and
without L2GraphCallback?

tests/gpu/test_callback_gpu.py's compiled-submodule test compares one plain fit with one callback fit,
each after ``torch._dynamo.reset()``. When they differ, the cause is either the callback (its graph
computes something else) or inductor itself (two compilations of the same module choosing different
kernels, e.g. by timing candidate reduction configs at first launch). This script tells them apart:
it runs the test's fits in the order plain, callback, plain, callback, each after a dynamo reset,
under inductor's default settings and then with ``torch._inductor.config.deterministic`` (no
numerics-changing benchmarking), and reports the first step at which each fit's loss differs from
the first plain fit of the same setting, with dynamo's and inductor's counters per fit.

Output: ``compiled_submodule_bits.json`` in ``--out`` and a table on stdout.

    python3 benchmarks/compiled_submodule_bits.py --out DIR
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch


def counters() -> dict[str, dict[str, int]]:
    from torch._dynamo.utils import counters as c

    return {group: dict(c[group]) for group in ("stats", "inductor", "graph_break") if c[group]}


def one_fit(with_callback: bool, steps: int) -> dict:
    from torch._dynamo.utils import counters as c

    from l2lightning import L2GraphCallback
    from tests.gpu.test_callback_gpu import UserCompiled, fit

    torch._dynamo.reset()
    c.clear()
    cb = L2GraphCallback(prefetch="off") if with_callback else None
    _, rec = fit(UserCompiled, [cb] if cb else [], steps=steps, baseline=not with_callback)
    losses = [float(x) for x in rec.losses]
    bits = [int(x.view(torch.int32)) for x in rec.losses]
    out = {"variant": "callback" if cb else "plain", "losses": losses, "bits": bits, "counters": counters()}
    if cb is not None:
        summary = cb.summary()
        out["summary"] = {
            k: summary.get(k) for k in ("captured", "capture_step", "captures", "fallback_steps")
        }
    return out


def first_difference(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--pairs", type=int, default=2, help="plain/callback pairs per inductor setting")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("compiled_submodule_bits: needs CUDA (the fits are the GPU test's)", file=sys.stderr)
        return 2
    import torch._inductor.config as inductor_config

    results = []
    for setting in ("default", "deterministic"):
        inductor_config.deterministic = setting == "deterministic"
        fits = []
        for _ in range(args.pairs):
            for with_callback in (False, True):
                fits.append(one_fit(with_callback, args.steps))
        reference = fits[0]["bits"]
        for i, f in enumerate(fits):
            f["setting"] = setting
            f["index"] = i
            f["first_step_differing_from_first_plain"] = first_difference(reference, f["bits"])
            print(
                f"{setting:13} fit {i} {f['variant']:8} first differing step vs fit 0: "
                f"{f['first_step_differing_from_first_plain']}  loss[1]={f['losses'][1]:.9g} "
                f"counters={f['counters'].get('stats', {})}",
                flush=True,
            )
        results.extend(fits)
    inductor_config.deterministic = False
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "compiled_submodule_bits.json").write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
