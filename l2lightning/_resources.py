"""Finds the files shipped beside the code: CUDA sources (kernels/) and Hydra configs (conf/).

From a source checkout they sit at the repository's top level; in an installed wheel setuptools
maps them to the packages `l2lightning._kernel_src` and `l2lightning._conf` (see pyproject.toml).
The checkout wins when both exist, so editing a .cu file in a checkout takes effect at once.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

_CHECKOUT_ROOT = Path(__file__).resolve().parent.parent


def _find_dir(checkout_name: str, package: str) -> Path:
    candidate = _CHECKOUT_ROOT / checkout_name
    if candidate.is_dir() and (_CHECKOUT_ROOT / "pyproject.toml").is_file():
        return candidate
    spec = importlib.util.find_spec(package)
    if spec is not None and spec.submodule_search_locations:
        return Path(next(iter(spec.submodule_search_locations)))
    raise FileNotFoundError(
        f"cannot find l2lightning's {checkout_name}/ directory: looked in the checkout ({candidate}) and for "
        f"the installed package {package!r}; reinstall l2lightning"
    )


def kernels_dir() -> Path:
    """Directory that holds the .cu sources."""
    return _find_dir("kernels", "l2lightning._kernel_src")


def kernel_source(name: str) -> str:
    """Text of kernels/`name` (e.g. 'l2_prefetch.cu')."""
    path = kernels_dir() / name
    if not path.is_file():
        raise FileNotFoundError(f"kernel source {name!r} not found in {path.parent}")
    return path.read_text()


def config_dir() -> Path:
    """Directory that holds train.yaml and the Hydra config groups."""
    return _find_dir("conf", "l2lightning._conf")
