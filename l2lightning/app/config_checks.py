"""Checks of the composed training config, run before anything is built.

A typo in a key, a checkpoint path that does not exist or a machine without CUDA should stop (or
redirect) a run in its first second with one line, not after a model was built and a fit started.
These checks read the config only; building its objects is :mod:`l2lightning.app.builders`'s.
"""

from __future__ import annotations

import zipfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import hydra
from omegaconf import DictConfig, OmegaConf, open_dict

from l2lightning import _env
from l2lightning._resources import config_dir

CPU_FALLBACK_MESSAGE = "l2lightning: no CUDA device ({reason}); training eagerly on CPU{without}"
# every key train.yaml and its groups put at the top of the config; anything else is a typo
TOP_LEVEL_KEYS = (
    "seed",
    "validate",
    "float32_matmul_precision",
    "ckpt_path",
    "eager_baseline_steps",
    "paths",
    "model",
    "data",
    "trainer",
    "l2",
    "callbacks",
    "logger",
)
# the trainer keys that must change on a machine without CUDA, whatever the command line says
FORCED_CPU_KEYS = ("accelerator", "devices")


class ConfigError(ValueError):
    """A problem with the config or the installation that the user fixes: one line, exit status 1."""


def advice_line(text: str) -> str:
    """The line of `text` that carries the advice (the first naming `pip install`, else the first)."""
    lines = [line.strip() for line in str(text).splitlines() if line.strip()]
    if not lines:
        return ""
    return next((line for line in lines if "pip install" in line), lines[0])


def _override_key(override: str) -> str:
    """The dotted key of a command-line override: ``"++trainer.max_steps=2"`` -> ``"trainer.max_steps"``."""
    return override.lstrip("+~").split("=", 1)[0].strip()


def group_option(group: str, name: str) -> DictConfig:
    """conf/<group>/<name>.yaml with the same-group entries of its defaults list merged in, as Hydra does."""
    raw = OmegaConf.load(config_dir() / group / f"{name}.yaml")
    defaults = list(raw.pop("defaults", None) or [])
    if "_self_" not in defaults:
        defaults.append("_self_")
    merged = OmegaConf.create()
    for entry in defaults:
        merged = OmegaConf.merge(merged, raw if entry == "_self_" else group_option(group, str(entry)))
    return merged


def cpu_fallback(cfg: DictConfig, overrides: Sequence[str] = ()) -> str | None:
    """Without CUDA, switch `cfg.trainer` (in place) to trainer/cpu.yaml's settings.

    Trainer keys given on the command line (`overrides`) are kept, except the accelerator and the
    device count. `cfg.l2` is left as it is: it is still validated, and `run` does not use the
    callback. Returns the one-line message to print, or None when CUDA is there or the run was a
    CPU run without the callback anyway.
    """
    reason = _env.cuda_unavailable_reason()
    if reason is None:
        return None
    wants_l2 = cfg.get("l2") is not None
    if cfg.trainer.get("accelerator") == "cpu" and not wants_l2:
        return None
    if cfg.trainer.get("accelerator") != "cpu":
        cpu = group_option("trainer", "cpu")
        kept = {
            _override_key(o).removeprefix("trainer.")
            for o in overrides
            if _override_key(o).startswith("trainer.")
        }
        with open_dict(cfg):
            for key, value in cpu.items():
                if key in FORCED_CPU_KEYS or key not in kept:
                    cfg.trainer[key] = value
    return CPU_FALLBACK_MESSAGE.format(reason=reason, without=" without the callback" if wants_l2 else "")


def check_config(cfg: DictConfig) -> None:
    """Refuse unknown top-level keys and malformed top-level values before anything is built."""
    unknown = [str(k) for k in cfg if k not in TOP_LEVEL_KEYS and k != "hydra"]
    if unknown:
        raise ConfigError(
            f"unknown top-level key `{unknown[0]}`"
            + (f" (and {', '.join(unknown[1:])})" if len(unknown) > 1 else "")
            + f"; accepted: {', '.join(TOP_LEVEL_KEYS)}"
        )
    for key in ("model", "data", "trainer"):
        if not isinstance(cfg.get(key), DictConfig):
            raise ConfigError(f"`{key}` must be a config with a `_target_`, got {cfg.get(key)!r}")
    steps = cfg.get("eager_baseline_steps", 0)
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 0:
        raise ConfigError(f"`eager_baseline_steps` must be an int >= 0, got {steps!r}")


def check_ckpt_path(value: Any) -> str | None:
    """The absolute path of `ckpt_path`, or None; a missing, unreadable or non-checkpoint file is a ConfigError."""
    if value is None:
        return None
    if not isinstance(value, str) or not value.strip():
        raise ConfigError(f"ckpt_path must be the path of a checkpoint file, got {value!r}")
    path = Path(hydra.utils.to_absolute_path(value))
    if not path.exists():
        raise ConfigError(f"ckpt_path: no such file: {path}")
    if not path.is_file():
        raise ConfigError(f"ckpt_path: not a file: {path}")
    try:
        with path.open("rb") as f:
            f.read(1)
    except OSError as exc:
        raise ConfigError(f"ckpt_path: cannot read {path}: {exc.strerror or exc}") from None
    if not zipfile.is_zipfile(path):
        raise ConfigError(
            f"ckpt_path: {path} is not a checkpoint (Lightning's torch.save writes a zip archive; this file is not one)"
        )
    return str(path)
