"""CPU tests of conf/: every config composes and instantiates, experiments and l2/trainer options are
deltas, callbacks and loggers are groups of `_target_` entries, targets are public."""

from __future__ import annotations

import importlib
import inspect
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
import yaml
from hydra import compose, initialize_config_dir
from hydra.utils import instantiate
from omegaconf import OmegaConf

from l2lightning import _env
from l2lightning._resources import config_dir
from l2lightning.app.models import FAMILIES
from l2lightning.app.train import (
    ConfigError,
    build_callback,
    build_callbacks,
    build_loggers,
    cpu_fallback,
    group_option,
)

pytestmark = [
    pytest.mark.filterwarnings("ignore:You are trying to .self.log"),
    pytest.mark.usefixtures("one_torch_thread"),
]
CONF = config_dir()
EXPERIMENTS = (
    "mlp_blocks_w768_b4",
    "mlp_blocks_w768_b16",
    "sequential_w512_b4",
    "sequential_w768_b8",
    "small_batch_mlp",
    "rl_policy",
    "recommender",
    "vit",
    "text_encoder",
    "convs",
)


def options(group: str) -> list[str]:
    return sorted(p.stem for p in (CONF / group).glob("*.yaml"))


def compose_train(overrides: list[str] = (), hydra: bool = False, output_dir: Path | None = None):
    with initialize_config_dir(str(CONF), version_base="1.3"):
        cfg = compose("train", overrides=list(overrides), return_hydra_config=hydra)
    if output_dir is not None:  # what train.run does: paths.output_dir is the run directory
        cfg.paths.output_dir = str(output_dir)
    return cfg


def has_module(name: str) -> bool:
    return importlib.util.find_spec(name) is not None


def callback_class():
    from l2lightning import L2GraphCallback

    return L2GraphCallback


def test_config_dir_is_the_checkout_conf():
    assert (CONF / "train.yaml").is_file()
    assert CONF == Path(__file__).resolve().parent.parent / "conf"
    assert options("trainer") == ["cpu", "default", "gpu"]
    # `none` (no callback) is not `prefetch: "off"` (l2=graph): no option name collides with a prefetch mode
    assert options("l2") == ["autotune", "default", "graph", "none", "sized", "verify"]
    assert options("callbacks") == [
        "default",
        "l2",
        "lr_monitor",
        "model_checkpoint",
        "rich_progress_bar",
        "tqdm_progress_bar",
    ]
    assert options("logger") == ["csv", "tensorboard"]
    assert set(options("model")) == set(FAMILIES)
    assert set(options("experiment")) == set(EXPERIMENTS)


def test_default_config():
    cfg = compose_train(hydra=True)
    choices = cfg.hydra.runtime.choices
    assert (choices.model, choices.data, choices.trainer, choices.l2, choices.callbacks, choices.logger) == (
        "mlp_stack",
        "mlp_stack",
        "gpu",
        "sized",
        "default",
        "csv",
    )
    assert choices.experiment is None
    assert cfg.l2._target_ == "l2lightning.L2GraphCallback"
    assert cfg.trainer.accelerator == "gpu"
    assert cfg.ckpt_path is None
    assert [c._target_ for c in cfg.hydra.callbacks.values()] == ["l2lightning.app.train.SweepSummary"]
    assert cfg.hydra.job.name == "train"  # the log file is train.log
    assert cfg.hydra.help.app_name == "l2lightning-train"
    assert "L2GraphCallback" in cfg.hydra.help.header and "$APP_CONFIG_GROUPS" in cfg.hydra.help.template
    # the L2 callback is one entry of the callbacks group: the `l2` node
    assert list(cfg.callbacks) == ["model_checkpoint", "lr_monitor", "progress_bar", "l2"]
    assert OmegaConf.to_container(cfg.callbacks, resolve=False)["l2"] == "${l2}"
    assert cfg.callbacks.l2 == cfg.l2


def test_top_level_keys_are_the_accepted_ones():
    from l2lightning.app.train import TOP_LEVEL_KEYS

    assert set(compose_train()) == set(TOP_LEVEL_KEYS)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_model_config_instantiates_with_its_data(family):
    # data follows the model (`data: ${model}`), and its shapes fit the model: one real forward pass
    cfg = compose_train([f"model={family}", "data.batch_size=2"], hydra=True)
    assert cfg.hydra.runtime.choices.data == family
    pl.seed_everything(0, verbose=False)
    model = instantiate(cfg.model, _convert_="all")
    model_cls, data_cls = FAMILIES[family]
    assert type(model) is model_cls
    resolved = OmegaConf.to_container(cfg.model, resolve=True)
    for key, value in resolved.items():
        if key != "_target_":
            assert model.hparams[key] == value, key
    dm = instantiate(cfg.data, _convert_="all")
    assert type(dm) is data_cls
    assert dm.batch_size == 2
    dm.setup("fit")
    batch = next(iter(dm.train_dataloader()))
    with torch.no_grad():
        loss = model.training_step(batch, 0)
    assert loss.ndim == 0 and torch.isfinite(loss)
    assert model.train_metric._update_count == 1  # the step updated its training metric once


def test_vit_default_has_197_tokens():
    cfg = compose_train(["model=vit"])
    assert (cfg.model.image_size, cfg.model.patch_size) == (224, 16)
    assert cfg.data.image_size == 224  # the data follows the model's input size
    model = instantiate(cfg.model, _convert_="all")
    assert model.num_tokens == 197


@pytest.mark.parametrize("name", ["digits", "mlp_stack"])
def test_mlp_data_options(name):
    overrides = ["model.in_features=64", "model.task=classification"] if name == "digits" else []
    cfg = compose_train([f"data={name}", "data.batch_size=16", *overrides])
    dm = instantiate(cfg.data, _convert_="all")
    dm.setup("fit")
    x, y = next(iter(dm.train_dataloader()))
    assert x.shape == (16, cfg.model.in_features)
    if name == "digits":
        assert y.dtype == torch.int64 and int(y.max()) < 10


# ids other than "gpu": conftest skips items with a `gpu` keyword on machines without CUDA
@pytest.mark.parametrize("name", ["cpu", "gpu"], ids=["trainer=cpu", "trainer=gpu"])
def test_trainer_options_are_deltas_over_default(name):
    text = (CONF / "trainer" / f"{name}.yaml").read_text()
    delta = yaml.safe_load(text)
    assert delta["defaults"] == ["default", "_self_"] and "_target_" not in delta
    base = yaml.safe_load((CONF / "trainer" / "default.yaml").read_text())
    assert set(delta) - {"defaults"} <= set(base)  # a delta sets keys of the base, no new ones
    cfg = compose_train([f"trainer={name}"])
    assert OmegaConf.to_container(cfg.trainer) == OmegaConf.to_container(group_option("trainer", name))


def test_trainer_cpu_instantiates(tmp_path):
    cfg = compose_train(["trainer=cpu"])
    trainer = instantiate(cfg.trainer, logger=False, default_root_dir=str(tmp_path))
    assert isinstance(trainer, pl.Trainer)
    assert trainer.max_steps == cfg.trainer.max_steps == 20
    assert trainer.strategy.root_device.type == "cpu"
    assert not trainer.checkpoint_callbacks  # off on the CPU; trainer.enable_checkpointing=true turns it on
    assert trainer.progress_bar_callback is not None  # feedback on long CPU runs too


def test_trainer_gpu_instantiates(monkeypatch, tmp_path):
    cfg = compose_train(["trainer=gpu", "trainer.max_steps=7"])
    assert (cfg.trainer.accelerator, cfg.trainer.precision) == ("gpu", "32-true")
    assert cfg.trainer.enable_checkpointing is True and cfg.trainer.enable_progress_bar is True
    if _env.cuda_unavailable_reason():
        # what train.py does without CUDA: cpu.yaml's settings, the command line's max_steps kept
        message = cpu_fallback(cfg, ["trainer.max_steps=7"])
        assert message.startswith("l2lightning: no CUDA device (")
        assert cfg.trainer.accelerator == "cpu"
    trainer = instantiate(cfg.trainer, logger=False, default_root_dir=str(tmp_path))
    assert trainer.max_steps == 7


def test_l2_none_gives_no_callback():
    cfg = compose_train(["l2=none"])
    assert cfg.l2 is None and cfg.callbacks.l2 is None
    assert build_callback(cfg) is None


@pytest.mark.parametrize(
    ("option", "prefetch", "verify"),
    [
        ("default", "auto", "sampled"),
        ("graph", "off", "sampled"),
        ("sized", "default", "sampled"),
        ("autotune", "auto", "sampled"),
        ("verify", "default", "capture"),
    ],
)
def test_l2_configs_instantiate_the_callback(option, prefetch, verify):
    cls = callback_class()
    cfg = compose_train([f"l2={option}"])
    callback = build_callback(cfg)
    assert type(callback) is cls
    assert (callback.prefetch, callback.verify, callback.warmup_steps) == (prefetch, verify, 3)
    if option == "verify":
        assert cfg.trainer.deterministic is True  # cuDNN / SDPA atomics would break the bitwise check


def test_l2_default_is_the_callbacks_own_defaults_every_argument_commented():
    cls = callback_class()
    parameters = {p: v for p, v in inspect.signature(cls.__init__).parameters.items() if p != "self"}
    lines = (CONF / "l2" / "default.yaml").read_text().splitlines()
    node = yaml.safe_load("\n".join(lines))["l2"]
    assert node["_target_"] == "l2lightning.L2GraphCallback"
    # every key is an argument with the value L2GraphCallback() uses; every argument with a
    # YAML-expressible default (not a None callable) is there, with a comment above it
    assert set(node) - {"_target_"} <= set(parameters)
    for argument, parameter in parameters.items():
        if parameter.default is None and argument not in node:
            continue
        assert node[argument] == parameter.default, argument
        index = next(i for i, line in enumerate(lines) if line.strip().startswith(f"{argument}:"))
        assert lines[index - 1].strip().startswith("#"), (
            f"l2/default.yaml: `{argument}` has no comment above it"
        )


@pytest.mark.parametrize("option", ["graph", "sized", "autotune", "verify"])
def test_l2_options_are_deltas_over_default(option):
    cls = callback_class()
    arguments = set(inspect.signature(cls.__init__).parameters) - {"self"}
    text = (CONF / "l2" / f"{option}.yaml").read_text()
    assert text.startswith("# @package _global_\n")
    delta = yaml.safe_load(text)
    assert delta["defaults"] == ["default", "_self_"]
    assert "_target_" not in delta["l2"] and set(delta["l2"]) <= arguments
    assert set(delta) <= {"defaults", "l2", "trainer"}


def test_bare_off_in_yaml_is_refused_with_advice():
    cfg = compose_train(["l2.prefetch=false"])
    with pytest.raises(ConfigError, match='write prefetch: "off"'):
        build_callback(cfg)


def test_default_callbacks_instantiate(tmp_path):
    cfg = compose_train(["trainer=gpu"], output_dir=tmp_path)
    from lightning.pytorch.callbacks import LearningRateMonitor, ModelCheckpoint, TQDMProgressBar

    callbacks = build_callbacks(cfg, cfg.trainer, None, has_logger=True)
    assert [type(c) for c in callbacks] == [ModelCheckpoint, LearningRateMonitor, TQDMProgressBar]
    assert callbacks[0].dirpath == str(tmp_path / "checkpoints") and callbacks[0].save_last is True
    # the entries that Lightning would refuse follow the trainer switches and the logger
    cfg = compose_train(
        ["trainer=cpu", "trainer.enable_progress_bar=false", "trainer.enable_checkpointing=false"],
        output_dir=tmp_path,
    )
    assert build_callbacks(cfg, cfg.trainer, None, has_logger=False) == []


@pytest.mark.parametrize("name", ["model_checkpoint", "lr_monitor", "tqdm_progress_bar", "rich_progress_bar"])
def test_every_callback_option_instantiates(name, tmp_path):
    cfg = compose_train([f"callbacks={name}"], output_dir=tmp_path)
    (entry,) = cfg.callbacks.values()
    if name == "rich_progress_bar" and not has_module("rich"):
        # a missing optional package: one line of advice, no traceback
        with pytest.raises(ConfigError, match=r"^callbacks.progress_bar: .*pip install -U rich"):
            build_callbacks(cfg, cfg.trainer, None, has_logger=True)
        return
    (callback,) = build_callbacks(cfg, cfg.trainer, None, has_logger=True)
    assert type(callback).__name__ == entry._target_.rsplit(".", 1)[-1]
    if name.endswith("progress_bar"):
        # each refresh reads the prog_bar values back from the GPU: not at every step
        assert callback.refresh_rate == 20


@pytest.mark.parametrize("name", ["csv", "tensorboard"])
def test_every_logger_option_instantiates(name, tmp_path):
    cfg = compose_train([f"logger={name}"], output_dir=tmp_path)
    if name == "tensorboard" and not (has_module("tensorboard") or has_module("tensorboardX")):
        with pytest.raises(ConfigError, match=r"^logger.tensorboard: .*pip install"):
            build_loggers(cfg)
        return
    (logger,) = build_loggers(cfg)
    assert Path(logger.log_dir) == tmp_path / name


def test_several_loggers_and_none():
    cfg = compose_train(["logger=[csv,tensorboard]"])
    assert list(cfg.logger) == ["csv", "tensorboard"]
    assert "logger" not in compose_train(["~logger"])


@pytest.mark.parametrize("name", EXPERIMENTS)
def test_experiment_is_a_delta_that_composes(name):
    text = (CONF / "experiment" / f"{name}.yaml").read_text()
    assert text.startswith("# @package _global_\n")
    delta = yaml.safe_load(text)
    assert set(delta) <= {"defaults", "model", "data", "trainer", "l2", "callbacks", "logger"}
    overrides = {next(iter(d)).split()[-1]: next(iter(d.values())) for d in delta["defaults"]}
    assert "/model" in overrides
    cfg = compose_train([f"experiment={name}"], hydra=True)
    assert cfg.hydra.runtime.choices.model == overrides["/model"]
    # every key an experiment sets exists in the group config it changes (no typos slip through)
    for group in ("model", "data"):
        base = compose_train([f"{group}={cfg.hydra.runtime.choices[group]}", f"model={overrides['/model']}"])
        for key, value in (delta.get(group) or {}).items():
            assert key in base[group], f"experiment {name}: {group}.{key} is not a key of {group}/"
            assert cfg[group][key] == value
    for key in delta.get("trainer") or {}:
        assert key in compose_train(["trainer=gpu"]).trainer


@pytest.mark.parametrize("name", EXPERIMENTS)
def test_experiment_instantiates(name):
    cfg = compose_train([f"experiment={name}"])
    model = instantiate(cfg.model, _convert_="all")
    dm = instantiate(cfg.data, _convert_="all")
    assert isinstance(model, pl.LightningModule) and isinstance(dm, pl.LightningDataModule)
    assert dm.batch_size == cfg.data.batch_size
    if "dtype" in cfg.model:
        assert next(model.parameters()).dtype == getattr(torch, cfg.model.dtype)


def test_experiment_shapes():
    cfg = compose_train(["experiment=mlp_blocks_w768_b16"])
    assert (cfg.model.width, cfg.model.dtype, cfg.data.batch_size) == (768, "bfloat16", 16)
    cfg = compose_train(["experiment=sequential_w512_b4"])
    assert (cfg.model.width, cfg.model.block, cfg.data.batch_size) == (512, "linear_relu", 4)
    cfg = compose_train(["experiment=small_batch_mlp"], hydra=True)
    assert cfg.hydra.runtime.choices.data == "digits" and cfg.model.task == "classification"
    cfg = compose_train(["experiment=rl_policy"])
    assert cfg.model.hidden == 1024 and cfg.data._target_ == "l2lightning.app.models.CartPoleData"


def _targets(node):
    if isinstance(node, dict):
        for key, value in node.items():
            if key == "_target_":
                yield value
            else:
                yield from _targets(value)
    elif isinstance(node, list):
        for value in node:
            yield from _targets(value)


def test_targets_are_public_names():
    targets = set()
    for path in CONF.rglob("*.yaml"):
        targets.update(_targets(yaml.safe_load(path.read_text()) or {}))
    assert "l2lightning.L2GraphCallback" in targets and "lightning.pytorch.Trainer" in targets
    import l2lightning
    import l2lightning.app.models

    for target in targets:
        module_name, _, name = target.rpartition(".")
        assert not any(part.startswith("_") for part in target.split(".")), target
        if module_name == "l2lightning":
            assert name in l2lightning.__all__, target
        elif module_name == "l2lightning.app.models":
            assert name in l2lightning.app.models.__all__, target
        if target != "l2lightning.L2GraphCallback":  # that one is checked with the callback tests
            assert hasattr(importlib.import_module(module_name), name), target


def test_the_autotuner_is_configured_from_hydra():
    cfg = compose_train(["l2.autotune={budget_s: 1.5, cache: null}"])
    callback = build_callback(cfg)
    from l2lightning.prefetch.hooks import make_autotuner

    tuner = make_autotuner(callback.autotune)
    assert tuner.budget_s == 1.5 and tuner.cache is None
    with pytest.raises(ValueError, match="`autotune` has unknown settings"):
        build_callback(compose_train(["l2.autotune={budget: 1.5}"]))
