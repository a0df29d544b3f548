"""What this process can do: CUDA, CuPy, environment switches.

Nothing here imports CuPy or initialises CUDA at import time; each probe runs on first use and is
cached, so `import l2lightning` stays free on a CPU-only CI machine.
"""

from __future__ import annotations

import functools
import os
import warnings

CUPY_INSTALL_HINT = (
    "install CuPy for your CUDA version: `pip install cupy-cuda12x` (CUDA 12) or "
    "`pip install cupy-cuda13x` (CUDA 13), or `pip install 'l2lightning[cuda12]'` / `'l2lightning[cuda13]'`"
)

# Every environment variable the package reads. The README has one row per entry.
ENV_VARS = {
    "L2L_RETUNE": "1 ignores the autotuner's plan cache and measures again",
    "L2L_CACHE_DIR": "directory of the autotuner's plan cache (default ~/.cache/l2lightning)",
    "L2L_DISABLE_PREFETCH": "1 turns every prefetch into a no-op (plain PyTorch), for A/B checks",
}


def env_flag(name: str) -> bool:
    """True when the `L2L_` variable `name` is set to 1/true/yes."""
    if name not in ENV_VARS:
        raise KeyError(f"unknown l2lightning environment variable {name!r}; known: {sorted(ENV_VARS)}")
    return os.environ.get(name, "").strip().lower() in {"1", "true", "yes", "on"}


@functools.lru_cache(maxsize=1)
def cuda_unavailable_reason() -> str | None:
    """None when a CUDA device is usable, else a one-line reason."""
    import torch

    if not torch.cuda.is_available():
        if torch.version.cuda is None:
            return f"this torch build ({torch.__version__}) has no CUDA support"
        return "torch reports no usable CUDA device"
    return None


@functools.lru_cache(maxsize=1)
def cupy_unavailable_reason() -> str | None:
    """None when CuPy imports, else a reason that carries the install hint."""
    try:
        import cupy  # noqa: F401
    except Exception as exc:  # ImportError, or a CuPy/driver mismatch raising at import
        return f"CuPy is not importable ({type(exc).__name__}: {exc}); {CUPY_INSTALL_HINT}"
    return None


def prefetch_unavailable_reason() -> str | None:
    """None when the prefetch kernels can run here, else why not."""
    if env_flag("L2L_DISABLE_PREFETCH"):
        return "L2L_DISABLE_PREFETCH=1 is set"
    return cuda_unavailable_reason() or cupy_unavailable_reason()


_warned: set[str] = set()


def warn_once(key: str, message: str, category: type[Warning] = UserWarning) -> None:
    """Warn once per process for `key` (rank-zero filtering is left to the caller)."""
    if key in _warned:
        return
    _warned.add(key)
    warnings.warn(message, category, stacklevel=3)


def reset_warnings() -> None:
    """Forget which one-time warnings were shown (tests use this)."""
    _warned.clear()
