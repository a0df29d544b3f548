"""The autotuner's plan cache: one JSON file of measured decisions, reused across runs.

An entry is keyed by everything that can change a measurement's outcome: the device (name, SM
count, L2 size), the layer shape, the phase (forward or backward), the dtype, the versions of
torch, CuPy, l2lightning and the prefetch kernel source (a digest of kernels/l2_prefetch.cu) and a
tag of the tuner's settings. A version change therefore gives a different key: old entries are
simply never found again (they stay in the file, harmless, until it is deleted).

The file is written atomically (a temporary file in the same directory, fsync, `os.replace`), so
a crash mid-write leaves the previous file intact, and read-modify-write runs under an advisory
`flock` where the OS has one, so ranks of one job writing at once do not drop each other's entries.

Environment:
    L2L_CACHE_DIR: directory of ``plans.json`` (default ``$XDG_CACHE_HOME/l2lightning``, and
        ``~/.cache/l2lightning`` where XDG_CACHE_HOME is unset or empty, as the XDG base directory
        specification says).
    L2L_RETUNE=1: ignore the cached entries (measure again); fresh results are still written.
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from l2lightning._env import env_flag, warn_once

CACHE_FILE = "plans.json"
FORMAT_VERSION = 1


def default_cache_path() -> Path:
    """``$L2L_CACHE_DIR/plans.json``, else ``$XDG_CACHE_HOME/l2lightning/plans.json``, else
    ``~/.cache/l2lightning/plans.json``."""
    root = os.environ.get("L2L_CACHE_DIR", "").strip()
    # The XDG base directory specification: an unset, empty or relative XDG_CACHE_HOME is ignored.
    xdg = os.environ.get("XDG_CACHE_HOME", "").strip()
    xdg_root = Path(xdg) if xdg and Path(xdg).is_absolute() else Path.home() / ".cache"
    base = Path(root).expanduser() if root else xdg_root / "l2lightning"
    return base / CACHE_FILE


def current_versions() -> dict[str, str]:
    """Versions that invalidate cached plans when they change: torch, CuPy, l2lightning, kernel source."""
    import torch

    import l2lightning

    try:
        import cupy

        cupy_version = str(cupy.__version__)
    except Exception:  # not installed, or a CuPy/driver mismatch raising at import
        cupy_version = "none"
    try:
        from l2lightning._kernels import source_digest

        kernel = source_digest("l2_prefetch.cu")
    except (FileNotFoundError, OSError):
        kernel = "missing"
    return {
        "torch": str(torch.__version__),
        "cupy": cupy_version,
        "l2lightning": l2lightning.__version__,
        "kernel": kernel,
    }


def atomic_write_json(path: Path, data: Any) -> None:
    """Write `data` as JSON to `path` so that readers see the old file or the new one, never half of one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    # Same directory as the target: os.replace is only atomic within one file system.
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(data, f, indent=1, sort_keys=True)
            f.write("\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


@contextlib.contextmanager
def _file_lock(path: Path) -> Iterator[None]:
    """Advisory exclusive lock on ``<path>.lock`` (POSIX flock); a no-op where flock is missing."""
    try:
        import fcntl
    except ImportError:  # Windows: atomic replace still keeps the file valid, merges may race
        yield
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_name(path.name + ".lock"), "a+") as lock:
        fcntl.flock(lock.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock.fileno(), fcntl.LOCK_UN)


class PlanCache:
    """Tuned plans on disk, keyed by device, shape, phase, dtype and software versions.

    Args:
        path: the JSON file; default :func:`default_cache_path` (``$L2L_CACHE_DIR``, ``$XDG_CACHE_HOME``, ``~/.cache``).
        retune: ignore cached entries (still write new ones); default: the ``L2L_RETUNE`` variable.
        versions: the version fields of the key; default :func:`current_versions` (tests pass their own).

    Example:
        >>> cache = PlanCache("/tmp/l2l-doc/plans.json", versions={"torch": "x"})
        >>> key = cache.key(device="H200", shape="Linear[8x8]:bfloat16:in4x8", phase="forward", dtype="bfloat16")
        >>> cache.put(key, {"chosen": False})
        >>> cache.get(key)
        {'chosen': False}
    """

    def __init__(
        self,
        path: str | os.PathLike[str] | None = None,
        *,
        retune: bool | None = None,
        versions: Mapping[str, str] | None = None,
    ) -> None:
        if retune is not None and not isinstance(retune, bool):
            raise TypeError(f"`retune` must be a bool or None, got {type(retune).__name__}")
        if versions is not None and not isinstance(versions, Mapping):
            raise TypeError(f"`versions` must be a mapping of name to version, got {type(versions).__name__}")
        self.path = Path(path).expanduser() if path is not None else default_cache_path()
        self.retune = env_flag("L2L_RETUNE") if retune is None else retune
        self._versions = dict(versions) if versions is not None else None

    @property
    def versions(self) -> dict[str, str]:
        if self._versions is None:  # computed on first use: it imports torch and maybe CuPy
            self._versions = current_versions()
        return self._versions

    def key(self, *, device: str, shape: str, phase: str, dtype: str, tuner: str = "") -> str:
        """The entry key: readable, and different whenever any input or version differs."""
        for name, value in (("device", device), ("shape", shape), ("phase", phase), ("dtype", dtype)):
            if not isinstance(value, str) or not value:
                raise ValueError(f"`{name}` must be a non-empty string, got {value!r}")
        versions = " ".join(f"{k}={v}" for k, v in sorted(self.versions.items()))
        return f"{device} | {shape} | {phase} | {dtype} | {versions} | tuner={tuner}"

    def entries(self) -> dict[str, dict[str, Any]]:
        """Every entry in the file ({} when it is missing or unreadable)."""
        try:
            text = self.path.read_text()
        except FileNotFoundError:
            return {}
        except OSError as exc:
            warn_once(
                f"plan-cache-read:{self.path}", f"l2lightning: cannot read the plan cache {self.path}: {exc}"
            )
            return {}
        try:
            data = json.loads(text)
            if not isinstance(data, dict) or data.get("format") != FORMAT_VERSION:
                raise ValueError(f"expected a dict with format {FORMAT_VERSION}")
            entries = data.get("entries", {})
            if not isinstance(entries, dict):
                raise ValueError("`entries` is not a dict")
        except ValueError as exc:  # json.JSONDecodeError is a ValueError
            warn_once(
                f"plan-cache-bad:{self.path}",
                f"l2lightning: ignoring the unreadable plan cache {self.path} ({exc}); it will be rewritten",
            )
            return {}
        return entries

    def get(self, key: str) -> dict[str, Any] | None:
        """The cached entry for `key`, or None (always None with ``retune``)."""
        if self.retune:
            return None
        entry = self.entries().get(key)
        return dict(entry) if isinstance(entry, dict) else None

    def put(self, key: str, entry: Mapping[str, Any]) -> None:
        """Store `entry` (JSON-serialisable) under `key`, atomically rewriting the file."""
        if not isinstance(entry, Mapping):
            raise TypeError(f"`entry` must be a mapping, got {type(entry).__name__}")
        json.dumps(dict(entry))  # fail before touching the file if the entry cannot be written
        with _file_lock(self.path):
            entries = self.entries()
            entries[key] = dict(entry)
            atomic_write_json(self.path, {"format": FORMAT_VERSION, "entries": entries})

    def clear(self) -> None:
        """Delete the cache file."""
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()
