#!/usr/bin/env python3
"""Check that everything FlashInfer's decode JIT path compiles is present.

Uses FlashInfer's own JIT generators (flashinfer.jit.attention.modules) to
produce the JitSpecs that `single_decode_with_kv_cache` and
`BatchDecodeWithPagedKVCacheWrapper` build at first use, then for every
generated CUDA source:

  1. static check (always): follows every #include "..." / <...>
     transitively (ignoring #if branches, so it over-approximates) through the
     include dirs of the real compile command, and reports headers that
     resolve nowhere.  Headers only expected from the CUDA toolkit / libc++
     are listed as "external" (fine when nvcc is absent here).
  2. --deps (needs nvcc): runs the real nvcc command with -M, i.e. the real
     preprocessor incl. #if evaluation, and lists which package data files are
     used.  Fails if any header is missing.
  3. --build (needs nvcc, no GPU needed): runs the real ninja build
     (spec.build()), producing the .so in the JIT cache.

Works without a GPU: sets FLASHINFER_CUDA_ARCH_LIST=9.0a (H200) if unset.

Configs: fp16/bf16 x head_dim 64/128, pos_encoding NONE, no window/softcap.
  --tensor-cores also checks the prefill modules that decode uses when
  use_tensor_cores=True (fa2 and, on sm90, fa3).

Usage (PYTHONPATH must contain the site dir with flashinfer + tvm_ffi):
  python3 check_decode_jit.py [--deps] [--build] [--tensor-cores]
        [--dtypes fp16,bf16] [--head-dims 64,128] [--list-used FILE]
Exit code 0 iff nothing is missing.
"""

import argparse
import os
import re
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("FLASHINFER_CUDA_ARCH_LIST", "9.0a")
os.environ.setdefault("FLASHINFER_WORKSPACE_BASE", tempfile.mkdtemp(prefix="fi_ws_"))

import flashinfer  # noqa: E402
import torch  # noqa: E402
from flashinfer.jit import env as jit_env  # noqa: E402
from flashinfer.jit.attention import modules as M  # noqa: E402

INC_RE = re.compile(r'^\s*#\s*include\s*([<"])([^>"]+)[>"]', re.M)
DT = {"fp16": torch.float16, "bf16": torch.bfloat16}


def specs(dtypes, head_dims, tensor_cores):
    out = []
    for dn in dtypes:
        dt = DT[dn]
        for hd in head_dims:
            # single_decode_with_kv_cache(use_tensor_cores=False)
            out.append(M.gen_single_decode_module(dt, dt, dt, hd, hd, 0, False, False))
            # BatchDecodeWithPagedKVCacheWrapper (use_tensor_cores=False)
            out.append(M.gen_batch_decode_module(dt, dt, dt, torch.int32, hd, hd, 0, False, False))
            if tensor_cores:
                for be in ("fa2", "fa3"):
                    out.append(M.gen_single_prefill_module(be, dt, dt, dt, hd, hd, 0, False, False, False))
                    out.append(
                        M.gen_batch_prefill_module(
                            be, dt, dt, dt, torch.int32, hd, hd, 0, False, False, False
                        )
                    )
    return out


def include_dirs(args):
    quote, angle = [], []
    it = iter(args)
    for a in it:
        parts = a.split(None, 1)
        if parts[0] in ("-I", "-isystem") and len(parts) == 2:
            angle.append(Path(parts[1]))
        elif parts[0] in ("-I", "-isystem"):
            angle.append(Path(next(it)))
        elif a.startswith("-I"):
            angle.append(Path(a[2:]))
    return quote, angle


def static_trace(src, dirs, cache):
    """returns (files_found:set, missing:set of (includer, kind, name))"""
    found, missing, todo = set(), set(), [Path(src)]
    while todo:
        f = todo.pop()
        if f in found:
            continue
        found.add(f)
        try:
            text = f.read_text(errors="replace")
        except OSError:
            continue
        for kind, name in INC_RE.findall(text):
            key = (f.parent if kind == '"' else None, name)
            if key in cache:
                hit = cache[key]
            else:
                cands = ([f.parent] if kind == '"' else []) + dirs
                hit = next((d / name for d in cands if (d / name).is_file()), None)
                cache[key] = hit
            if hit is None:
                missing.add((str(f), kind, name))
            else:
                todo.append(hit.resolve())
    return found, missing


def in_reference(includer, kind, name, dirs, data, ref):
    """Would this include resolve if package data were the unpruned reference?"""

    def remap(d):
        d = Path(d).resolve()
        try:
            return ref / d.relative_to(data)
        except ValueError:
            return d

    cands = ([remap(Path(includer).parent)] if kind == '"' else []) + [remap(d) for d in dirs]
    return any((d / name).is_file() for d in cands)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--deps", action="store_true")
    ap.add_argument("--build", action="store_true")
    ap.add_argument("--tensor-cores", action="store_true")
    ap.add_argument("--dtypes", default="fp16,bf16")
    ap.add_argument("--head-dims", default="64,128")
    ap.add_argument("--list-used", default=None, help="write used package data files here")
    ap.add_argument(
        "--reference",
        default=None,
        help="unpruned flashinfer/data dir: flag includes that resolve there but not here",
    )
    a = ap.parse_args()

    data = Path(jit_env.FLASHINFER_DATA).resolve()
    print("flashinfer", flashinfer.__version__, "from", Path(flashinfer.__file__).parent)
    print("data dir:", data, " arch list:", os.environ["FLASHINFER_CUDA_ARCH_LIST"])
    sp = specs(a.dtypes.split(","), [int(x) for x in a.head_dims.split(",")], a.tensor_cores)
    used_pkg, bad = set(), 0
    cache = {}
    all_unresolved = set()
    for spec in sp:
        print(f"\n== {spec.name}")
        for cc in spec.get_compile_commands():
            args = cc["arguments"] if "arguments" in cc else shlex.split(cc["command"])
            src = Path(cc["file"])
            _, dirs = include_dirs(args)
            dirs = [d for d in dirs]
            found, missing = static_trace(src, dirs, cache)
            pkg = {p for p in found if str(p).startswith(str(data))}
            used_pkg |= pkg
            # classify missing: anything whose name exists in the ORIGINAL
            # package layout would be a pruning bug; toolkit/std headers are external
            ext = sorted({n for _, _, n in missing})
            print(
                f"  {src.name}: static {len(found)} files ({len(pkg)} from package data),"
                f" unresolved(any #if branch)={len(ext)}"
            )
            all_unresolved.update(ext)
            if a.reference:
                pruned_away = sorted(
                    {
                        n
                        for f, k, n in missing
                        if in_reference(f, k, n, dirs, data, Path(a.reference).resolve())
                    }
                )
                if pruned_away:
                    bad += 1
                    print("    MISSING because pruned (exist in reference):", pruned_away)
            if a.deps:
                # same command, but preprocess only: drop -c/-o/-MF, add -M
                clean, skip = [], False
                for x in args:
                    if skip:
                        skip = False
                        continue
                    if x in ("-MF", "-o"):
                        skip = True
                        continue
                    if x in ("-c", "--generate-dependencies-with-compile"):
                        continue
                    clean.append(x)
                clean.append("-M")
                clean = [shlex.quote(x) for x in clean]
                cmd = " ".join(clean)
                r = subprocess.run(cmd, shell=True, capture_output=True, text=True)
                if r.returncode != 0:
                    bad += 1
                    print("    nvcc -M FAILED:\n" + r.stderr[-3000:])
                else:
                    deps = [Path(t) for t in r.stdout.replace("\\\n", " ").split()[1:]]
                    dpkg = {p.resolve() for p in deps if str(p.resolve()).startswith(str(data))}
                    used_pkg |= dpkg
                    print(f"    nvcc -M OK: {len(deps)} headers, {len(dpkg)} from package data")
        if a.build:
            try:
                spec.build(verbose=False)
                print("  BUILD OK ->", spec.jit_library_path, spec.jit_library_path.stat().st_size, "bytes")
            except Exception as e:  # noqa: BLE001
                bad += 1
                print("  BUILD FAILED:", str(e)[-4000:])
    top = {}
    for p in used_pkg:
        rel = p.relative_to(data)
        k = "/".join(rel.parts[:2]) if rel.parts[0] == "csrc" and len(rel.parts) > 2 else rel.parts[0]
        top[k] = top.get(k, 0) + 1
    print(
        "\nstatically unresolved names (toolkit / libstdc++ / inactive #if branches; "
        "not errors by themselves):",
        " ".join(sorted(all_unresolved)),
    )
    print("\npackage data files used, by area:", dict(sorted(top.items())))
    if a.list_used:
        Path(a.list_used).write_text("\n".join(sorted(str(p.relative_to(data)) for p in used_pkg)) + "\n")
    print("RESULT:", "OK" if bad == 0 else f"{bad} FAILURES")
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
