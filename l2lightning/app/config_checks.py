"""Checks of the composed training config, run before anything is built.

A typo in a key, a checkpoint path that does not exist or a machine without CUDA should stop (or
redirect) a run in its first second with one line, not after a model was built and a fit started.
These checks read the config only; building its objects is :mod:`l2lightning.app.builders`'s.
"""

from __future__ import annotations

import datetime
import types
import typing
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
# torch.set_float32_matmul_precision's values (torch only warns on another, and keeps "highest")
MATMUL_PRECISIONS = ("highest", "high", "medium")


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


def _type_text(hint: Any) -> str:
    """`hint` in words, as an error message names the expected value: ``Optional[int]`` -> ``an int or null``."""
    if hint is type(None):
        return "null"
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        members = typing.get_args(hint)
        literals = [v for m in members if typing.get_origin(m) is typing.Literal for v in typing.get_args(m)]
        parts = [_type_text(m) for m in members if typing.get_origin(m) is not typing.Literal]
        if literals:
            parts.insert(0, "one of " + ", ".join(repr(v) for v in literals))
        return " or ".join(dict.fromkeys(parts))
    if typing.get_origin(hint) is typing.Literal:
        return "one of " + ", ".join(repr(v) for v in typing.get_args(hint))
    origin = typing.get_origin(hint) or hint
    words = {
        bool: "true or false",
        int: "an int",
        float: "a number",
        str: "a string",
        list: "a list",
        dict: "a mapping",
        datetime.timedelta: "a duration",
    }
    return words.get(origin, f"a {getattr(origin, '__name__', origin)}")


def _matches(value: Any, hint: Any) -> bool:
    """Whether a config value (a plain Python value after OmegaConf) fits the type hint `hint`.

    Only the types a command line can spell are judged (numbers, bools, strings, null, lists,
    mappings, literals); a hint naming a class (an Accelerator, a Logger) accepts anything, since
    such a value is a config that Hydra instantiates.
    """
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        return any(_matches(value, m) for m in typing.get_args(hint))
    if origin is typing.Literal:
        return any(value == v and type(value) is type(v) for v in typing.get_args(hint))
    if hint is type(None):
        return value is None
    if hint is bool:
        return isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if hint is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if hint is str:
        return isinstance(value, str)
    if (origin or hint) is list:
        return isinstance(value, list)
    if (origin or hint) is dict:
        return isinstance(value, dict)
    if hint is datetime.timedelta:
        return False
    return True


def _trainer_hints(node: DictConfig) -> dict[str, Any] | None:
    """The type hints of the ``__init__`` of `node`'s ``_target_`` (Lightning's Trainer), or None if unknown."""
    try:
        cls = hydra.utils.get_class(str(node.get("_target_")))
        hints = typing.get_type_hints(cls.__init__)
    except Exception:  # a _target_ that does not import is reported when the Trainer is built
        return None
    hints.pop("return", None)
    return hints


def check_trainer(node: DictConfig) -> None:
    """Refuse a ``trainer.*`` key the Trainer does not take, or a value of a type it does not take.

    Lightning itself fails on these deep inside the fit with a message that names neither the key nor
    the type (``'<' not supported between instances of 'str' and 'int'`` for ``max_steps=abc``).
    """
    hints = _trainer_hints(node)
    if hints is None:
        return
    values = OmegaConf.to_container(node, resolve=True)
    for key, value in values.items():
        if str(key).startswith("_") or key in ("callbacks", "logger", "plugins", "profiler"):
            continue
        if key not in hints:
            raise ConfigError(f"unknown key `trainer.{key}`; the Trainer accepts: {', '.join(hints)}")
        if not _matches(value, hints[key]):
            raise ConfigError(f"`trainer.{key}` must be {_type_text(hints[key])}, got {value!r}")


def _check_top_level_values(cfg: DictConfig) -> None:
    """The top-level settings of train.yaml: each a value of its own type."""
    seed = cfg.get("seed")
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise ConfigError(f"`seed` must be an int, got {seed!r}")
    validate = cfg.get("validate", True)
    if not isinstance(validate, bool):
        raise ConfigError(f"`validate` must be true or false, got {validate!r}")
    precision = cfg.get("float32_matmul_precision", "highest")
    if precision not in MATMUL_PRECISIONS:
        raise ConfigError(
            f"`float32_matmul_precision` must be one of {', '.join(MATMUL_PRECISIONS)}, got {precision!r}"
        )
    steps = cfg.get("eager_baseline_steps", 0)
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 0:
        raise ConfigError(f"`eager_baseline_steps` must be an int >= 0, got {steps!r}")


def check_config(cfg: DictConfig) -> None:
    """Refuse unknown top-level keys, malformed top-level values and bad ``trainer.*`` values before anything is built."""
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
    _check_top_level_values(cfg)
    check_trainer(cfg.trainer)


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
