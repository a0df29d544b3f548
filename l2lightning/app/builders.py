"""Build the objects the training config describes: the L2GraphCallback, the loggers, the callbacks.

Hydra's ``instantiate`` wraps a bad value deep in a traceback; the entry point promises one line
naming the config key instead, and must leave out the group's entries that Lightning would refuse
(a ModelCheckpoint with checkpointing off, an LR monitor without a logger). Both are done here, for
the fit with the callback and for the eager baseline fit alike.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Sequence
from typing import Any

import hydra
import lightning.pytorch as pl
from hydra.errors import InstantiationException
from lightning.fabric.utilities.exceptions import MisconfigurationException
from omegaconf import DictConfig, ListConfig, OmegaConf

from l2lightning.app.config_checks import ConfigError, advice_line

# the entry point's one logger: every line of a training run goes by one name, whichever module writes it
log = logging.getLogger("l2lightning.app.train")

# entries of the callbacks group that follow a Trainer switch: Lightning refuses a ModelCheckpoint
# with enable_checkpointing=False and a progress bar with enable_progress_bar=False
SWITCHED_CALLBACKS = {"model_checkpoint": "enable_checkpointing", "progress_bar": "enable_progress_bar"}
# the callbacks entry that holds L2GraphCallback (conf/callbacks/l2.yaml: `l2: ${l2}`)
L2_ENTRY = "l2"
# exceptions raised while building a config's object that mean "this config value is wrong"
_CONFIG_VALUE_ERRORS = (ValueError, TypeError, ImportError, MisconfigurationException)


def instantiate_node(node: Any, where: str, **kwargs: Any) -> Any:
    """``hydra.utils.instantiate``; a bad value or a missing package becomes a one-line ConfigError."""
    try:
        return hydra.utils.instantiate(node, **kwargs)
    except InstantiationException as exc:
        cause = exc.__cause__
        if cause is None or isinstance(cause, _CONFIG_VALUE_ERRORS):
            text = str(cause) if cause is not None else str(exc)
            if isinstance(cause, ImportError) and "pip install" not in text:
                text = " ".join(text.split())  # "Error loading 'x.Y': ... Are you sure ... is installed?"
            else:
                text = advice_line(text)
            raise ConfigError(f"{where}: {text}") from exc
        raise
    except _CONFIG_VALUE_ERRORS as exc:  # raised by a _target_ called without Hydra's wrapping
        raise ConfigError(f"{where}: {advice_line(str(exc))}") from exc


def _l2_class(cfg: DictConfig) -> type | None:
    """The callback class of `cfg.l2` after checking its keys, or None for ``l2: null`` (l2=none)."""
    from l2lightning.callback.graph_callback import L2GraphCallback

    node = cfg.get("l2")
    if node is None:
        return None
    if not isinstance(node, DictConfig):
        raise ConfigError(
            f"`l2` must be a config of L2GraphCallback's arguments or null (l2=none), got {node!r}"
        )
    target = node.get("_target_")
    if target is None:
        raise ConfigError(
            "l2 has no `_target_`; expected l2lightning.L2GraphCallback (pick an option: l2=sized)"
        )
    try:
        cls = hydra.utils.get_class(str(target))
    except Exception as exc:
        raise ConfigError(f"l2._target_: cannot import {target!r} ({advice_line(str(exc))})") from None
    if not issubclass(cls, L2GraphCallback):
        raise ConfigError(f"l2._target_ must be l2lightning.L2GraphCallback (or a subclass), got {target!r}")
    params = inspect.signature(cls.__init__).parameters
    accepted = [
        name
        for name, p in params.items()
        if name != "self" and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
    ]
    if not any(p.kind == p.VAR_KEYWORD for p in params.values()):
        unknown = [str(k) for k in node if not str(k).startswith("_") and k not in accepted]
        if unknown:
            raise ConfigError(f"unknown key `l2.{unknown[0]}`; {cls.__name__} accepts: {', '.join(accepted)}")
    if node.get("prefetch") is False:
        raise ConfigError(
            'l2.prefetch is false: YAML reads a bare `off` as false; write prefetch: "off" (or pick l2=graph)'
        )
    return cls


def build_callback(cfg: DictConfig) -> pl.Callback | None:
    """The `L2GraphCallback` that `cfg.l2` describes, or None for ``l2: null`` (l2=none).

    Built on every machine (construction does not touch CUDA), so that its own argument checks run
    on a laptop too. Unknown keys and bad values raise :class:`ConfigError` naming the argument.
    """
    if _l2_class(cfg) is None:
        return None
    return instantiate_node(cfg.l2, "l2")


def has_l2_entry(cfg: DictConfig) -> bool:
    """Whether the callbacks group holds the L2GraphCallback entry (``callbacks.l2: ${l2}``)."""
    callbacks = cfg.get("callbacks")
    if not isinstance(callbacks, DictConfig) or L2_ENTRY not in callbacks:
        return False
    if OmegaConf.to_container(callbacks, resolve=False).get(L2_ENTRY) != "${l2}":
        raise ConfigError(
            "callbacks.l2 must stay `${l2}`: configure L2GraphCallback under `l2` (l2=..., l2.KEY=...), "
            "or drop it with ~callbacks.l2"
        )
    return True


def _as_list(node: Any) -> list[Any]:
    if node is None:
        return []
    if isinstance(node, (ListConfig, list, tuple)):
        return list(node)
    return [node]


def build_loggers(cfg: DictConfig, trainer_logger: Any = None) -> list[Any]:
    """The loggers of the `logger` group (one per entry; null entries skipped) plus ``trainer.logger``.

    ``trainer.logger=false`` means no logger at all, as in Lightning.
    """
    if trainer_logger is False:
        return []
    loggers = []
    group = cfg.get("logger")
    if group is not None:
        if not isinstance(group, DictConfig):
            raise ConfigError(f"`logger` must be a mapping of name -> logger config, got {group!r}")
        for name, node in group.items():
            if node is None:
                continue
            if not isinstance(node, DictConfig) or "_target_" not in node:
                raise ConfigError(f"logger.{name} must be a config with a `_target_`, got {node!r}")
            loggers.append(instantiate_node(node, f"logger.{name}"))
    if trainer_logger is not None and trainer_logger is not True:
        for i, node in enumerate(_as_list(trainer_logger)):
            loggers.append(instantiate_node(node, f"trainer.logger[{i}]"))
    return loggers


def build_callbacks(
    cfg: DictConfig,
    trainer_node: DictConfig,
    extra: Any,
    has_logger: bool,
    only: Sequence[str] | None = None,
    left_out: dict[str, str] | None = None,
    names: dict[int, str] | None = None,
) -> list[pl.Callback]:
    """The callbacks group's entries (except the l2 one) and ``trainer.callbacks``, built in that order.

    An entry that is null is skipped; ``model_checkpoint`` and ``progress_bar`` are left out when
    ``trainer.enable_checkpointing`` / ``trainer.enable_progress_bar`` is false, and ``lr_monitor``
    when there is no logger (Lightning would refuse each of them). `only`: build just these entries.
    `left_out`, when given, receives each entry left out with the reason (result.json marks them);
    `names` receives each built callback's config key by ``id`` (an error it raises names the key).
    """
    left_out = {} if left_out is None else left_out
    names = {} if names is None else names
    callbacks: list[pl.Callback] = []
    group = cfg.get("callbacks")
    if group is not None and not isinstance(group, DictConfig):
        raise ConfigError(f"`callbacks` must be a mapping of name -> callback config, got {group!r}")
    for name in group or {}:
        if name == L2_ENTRY or (only is not None and name not in only):
            continue
        node = group[name]
        if node is None:
            continue
        switch = SWITCHED_CALLBACKS.get(str(name))
        if switch is not None and trainer_node.get(switch, True) is False:
            left_out[str(name)] = f"trainer.{switch} is false"
            log.debug("callbacks.%s left out: trainer.%s is false", name, switch)
            continue
        if name == "lr_monitor" and not has_logger:
            left_out[str(name)] = "no logger"
            log.debug("callbacks.lr_monitor left out: no logger")
            continue
        if not isinstance(node, DictConfig) or "_target_" not in node:
            raise ConfigError(f"callbacks.{name} must be a config with a `_target_`, got {node!r}")
        callbacks.append(instantiate_node(node, f"callbacks.{name}"))
        names[id(callbacks[-1])] = f"callbacks.{name}"
    for i, node in enumerate(_as_list(extra) if only is None else []):
        callbacks.append(instantiate_node(node, f"trainer.callbacks[{i}]"))
        names[id(callbacks[-1])] = f"trainer.callbacks[{i}]"
    return callbacks


def raising_callback(exc: BaseException, names: dict[int, str]) -> tuple[str, pl.Callback] | None:
    """(config key, callback) of the configured callback in whose code `exc` was raised, or None.

    The innermost frame whose ``self`` is one of the callbacks in `names` decides: an EarlyStopping
    that monitors a metric nobody logged raises from its own hook.
    """
    found = None
    tb = exc.__traceback__
    while tb is not None:
        owner = tb.tb_frame.f_locals.get("self")
        if owner is not None and id(owner) in names:
            found = (names[id(owner)], owner)
        tb = tb.tb_next
    return found


def switches_for(callbacks: Sequence[pl.Callback], trainer_node: DictConfig) -> dict[str, bool]:
    """Trainer switches to turn on for callbacks the user added (a ModelCheckpoint, a progress bar).

    The group's own entries are left out when their switch is off (:func:`build_callbacks`), so a
    checkpoint or progress bar among `callbacks` was added by the user: it runs, rather than making
    Lightning refuse the switch (trainer/cpu.yaml turns checkpointing off).
    """
    from lightning.pytorch.callbacks import Checkpoint, ProgressBar

    switches = {}
    for switch, kind in (("enable_checkpointing", Checkpoint), ("enable_progress_bar", ProgressBar)):
        if trainer_node.get(switch, True) is False and any(isinstance(c, kind) for c in callbacks):
            log.info("l2lightning: trainer.%s turned on for the %s you added", switch, kind.__name__)
            switches[switch] = True
    return switches
