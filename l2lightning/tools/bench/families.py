"""Model-family cases: the package's LightningModules, timed through Lightning as a user would fit them.

``--families vit,recommender`` (or ``all``; the names of ``l2lightning.app.models.FAMILIES``): for
each family and each ``--batches`` size, a case ``vit b8 [step]`` fits the family's LightningModule
with the Lightning variants only: ``lightning_eager``, ``callback_off``, ``callback_auto``, and
``callback_decoy`` when ``--variants`` names it. The other variants time the harness's own MLP
outside Lightning, so they are skipped for families (one note in the log). Module and data module
come from the package's Hydra configs (``conf/model/<family>``, ``conf/data/<family>``, composed as
``l2lightning-train model=<family> data.batch_size=<batch>`` would compose them), the module
initialised from the config's seed and trained with its own ``configure_optimizers`` (``--dtype``
and ``--optimizer`` apply to MLP cases only). As for the MLP, a few batches are drawn from the data
module once, put on the GPU and cycled through each fit, so the data pipeline is not timed. A
family row has ``family``, ``params``, ``param_bytes`` and ``captured`` / ``capture_reason``
(whether the callback's fits captured the step, and why not), with ``width``/``depth`` None and
``layer_mib`` the largest single parameter tensor. Without ``--models`` (or ``--widths``/``--depths``)
only family cases run.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from l2lightning import floors as floors_module
from l2lightning.tools.bench.settings import family_names

if TYPE_CHECKING:
    from l2lightning.tools.bench.settings import BenchSettings, RunInfo

# Distinct batches drawn from a family's data module and cycled through every fit (as make_batches).
FAMILY_BATCHES = 4
# Hydra overrides that shrink each family to a CPU-sized model (the configs allow them all): the
# CPU tests and the benchmarks' --smoke modes.
TINY_FAMILY_OVERRIDES: dict[str, list[str]] = {
    "mlp_stack": ["model.width=16", "model.depth=2"],
    "rl_policy": ["model.hidden=16", "model.depth=1", "data.env_backend=numpy"],
    "recommender": [
        "model.num_tables=2",
        "model.num_embeddings=50",
        "model.embedding_dim=8",
        "model.bottom_mlp=[16]",
        "model.top_mlp=[16]",
    ],
    "conv_stack": ["model.channels=[4,8]", "data.image_size=16"],
    "vit": ["model.image_size=32", "model.dim=16", "model.depth=1", "model.heads=2"],
    "text_encoder": [
        "model.vocab_size=64",
        "model.seq_len=8",
        "model.d_model=16",
        "model.nhead=2",
        "model.num_layers=1",
        "model.dim_feedforward=32",
    ],
}


@dataclass(frozen=True)
class ModelFacts:
    """What the floors and the rows need to know of a module's parameters."""

    params: int
    param_bytes: dict[str, int]
    # the dtype holding most parameter bytes (AdamW keeps its states in it)
    dtype: str
    # the largest single parameter tensor, the family counterpart of the MLP's d x d layer
    layer_mib: float


def model_facts(module: Any) -> ModelFacts:
    """Parameter count, bytes per dtype, dominant dtype and largest tensor (MiB) of a torch module."""
    params = list(module.parameters())
    if not params:
        raise ValueError(f"{type(module).__name__} has no parameters: nothing to train or time")
    param_bytes = floors_module.param_bytes_by_dtype(module)
    return ModelFacts(
        params=sum(p.numel() for p in params),
        param_bytes=param_bytes,
        dtype=max(param_bytes, key=lambda name: param_bytes[name]),
        layer_mib=max(p.numel() * p.element_size() for p in params) / (1 << 20),
    )


def compose_family(family: str, batch: int, overrides: Sequence[str] = ()) -> Any:
    """train.yaml composed for `family` as ``l2lightning-train model=<family> data.batch_size=<batch>``.

    The configs are found as the training entry point finds them (:func:`l2lightning._resources.config_dir`,
    a checkout or the installed wheel). `overrides` are further Hydra overrides (tests shrink the
    models with them). The data config then asks for only :data:`FAMILY_BATCHES` training batches
    (``train_batches`` or ``steps_per_epoch``, whichever it has) and no validation data: the
    harness draws that many batches and cycles them (see :func:`family_batches`).

    Raises:
        ValueError: an unknown family (the message lists the known ones).
    """
    from hydra import compose, initialize_config_dir
    from omegaconf import open_dict

    from l2lightning._resources import config_dir

    known = family_names()
    if family not in known:
        raise ValueError(f"unknown model family {family!r}; known: {', '.join(known)}")
    with initialize_config_dir(str(config_dir()), version_base="1.3"):
        cfg = compose("train", overrides=[f"model={family}", f"data.batch_size={batch}", *overrides])
    with open_dict(cfg.data):
        for key in ("train_batches", "steps_per_epoch"):
            if key in cfg.data:
                cfg.data[key] = FAMILY_BATCHES
        if "val_batches" in cfg.data:
            cfg.data.val_batches = 0  # the harness's Trainer never validates (limit_val_batches=0)
    return cfg


def build_family(cfg: Any) -> tuple[Any, Any]:
    """The LightningModule and data module `cfg` describes, as :func:`l2lightning.app.train.run` builds them.

    The module is initialised from ``cfg.seed`` (every variant starts from the same weights) and
    float32 matmuls run at the config's precision, as in the training entry point.
    """
    import torch
    from hydra.utils import instantiate

    torch.set_float32_matmul_precision(cfg.get("float32_matmul_precision", "highest"))
    torch.manual_seed(int(cfg.get("seed", 0)))
    module = instantiate(cfg.model, _convert_="all")
    datamodule = instantiate(cfg.data, _convert_="all")
    return module, datamodule


def family_batches(datamodule: Any, device: Any, count: int = FAMILY_BATCHES) -> list[Any]:
    """The first `count` training batches of `datamodule`, on `device`.

    Cycled through every fit by :func:`_loader`, as the MLP's batches are: the timed steps are the
    training step's, not the data pipeline's (synthetic images are made per sample on the CPU, and
    CartPole rollouts would run the policy on the host between steps).
    """
    from lightning.fabric.utilities.apply_func import move_data_to_device

    datamodule.setup("fit")
    batches = [
        move_data_to_device(batch, device) for batch in itertools.islice(datamodule.train_dataloader(), count)
    ]
    if not batches:
        raise ValueError(f"{type(datamodule).__name__}.train_dataloader() yielded no batch")
    return batches


def module_optimizer(module: Any) -> Any:
    """The (first) optimizer of ``module.configure_optimizers()``, in any of Lightning's return forms."""
    import torch

    conf = module.configure_optimizers()
    while not isinstance(conf, torch.optim.Optimizer):
        if isinstance(conf, Mapping) and "optimizer" in conf:
            conf = conf["optimizer"]
        elif isinstance(conf, (list, tuple)) and conf:
            conf = conf[0]
        else:
            raise TypeError(
                f"{type(module).__name__}.configure_optimizers() returned {type(conf).__name__}; "
                "expected an optimizer, a list of them or a dict with an 'optimizer'"
            )
    return conf


def eager_family_step(module: Any, optimizer: Any, batches: Sequence[Any]) -> Callable[[int], Any]:
    """``step(i)``: zero-grad, ``training_step`` on batch i, backward, optimizer step (outside Lightning)."""
    from l2lightning.graph.capture import loss_of

    source = f"{type(module).__name__}.training_step"

    def step(i: int) -> Any:
        optimizer.zero_grad(set_to_none=True)
        loss = loss_of(module.training_step(batches[i % len(batches)], i), source)
        loss.backward()
        optimizer.step()
        return loss

    return step


def family_step_floors(
    facts: ModelFacts, kernel_count: int | None, copy_bw: float, empty_kernel_us: float | None
) -> floors_module.Floors:
    """Floors of one training step: weights, grads and both AdamW states (6P + 4S bytes, see step_bytes)."""
    return floors_module.floors(
        facts.param_bytes,
        kernel_count,
        copy_bw,
        empty_kernel_us,
        chain="step",
        # PyTorch's AdamW keeps exp_avg / exp_avg_sq in the parameters' dtype.
        state_bytes_per_element=floors_module.dtype_bytes(facts.dtype),
    )


def capture_fields(variant: str, summaries: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """``captured`` / ``capture_reason`` / ``fallback_steps`` of a variant over its fits' callback summaries.

    ``captured`` is True only when every fit captured its step; otherwise ``capture_reason`` gives
    the callback's reason (and in how many fits). None where there is no callback or no fit ran.
    """
    if variant == "lightning_eager" or not summaries:
        return {"captured": None, "capture_reason": None, "fallback_steps": None}
    missed = [s for s in summaries if s.get("captured") is not True]
    reason = None
    if missed:
        reason = next(
            (
                str(s.get("reason") or s.get("summary_error"))
                for s in missed
                if s.get("reason") or s.get("summary_error")
            ),
            "no reason given",
        )
        if len(missed) < len(summaries):
            reason = f"not captured in {len(missed)} of {len(summaries)} fits: {reason}"
    return {
        "captured": not missed,
        "capture_reason": reason,
        "fallback_steps": max(int(s.get("fallback_steps") or 0) for s in summaries),
    }


@dataclass
class FamilyCase:
    """One model family at one batch size: the whole training step, Lightning variants only."""

    family: str
    batch: int
    overrides: tuple[str, ...] = ()
    chain: str = "step"
    cfg: Any = field(default=None, repr=False, compare=False)
    facts: ModelFacts | None = field(default=None, compare=False)

    @property
    def label(self) -> str:
        return f"{self.family} b{self.batch}"

    @property
    def dtype(self) -> str:
        return self.facts.dtype if self.facts is not None else "float32"

    def key(self) -> dict[str, Any]:
        # width/depth are the MLP's; None keeps family rows out of criteria scoped on them.
        return {
            "family": self.family,
            "width": None,
            "depth": None,
            "batch": self.batch,
            "dtype": self.facts.dtype if self.facts is not None else None,
            "chain": self.chain,
        }

    def variants(self, settings: BenchSettings) -> list[str]:
        return settings.family_variants()

    def prepare(self) -> None:
        """Compose the configs and read the module's parameters (built once on the CPU); idempotent."""
        if self.facts is not None:
            return
        cfg = compose_family(self.family, self.batch, self.overrides)
        module, _ = build_family(cfg)
        self.cfg, self.facts = cfg, model_facts(module)

    def row_fields(self) -> dict[str, Any]:
        facts, cfg = self.facts, self.cfg
        return {
            "layer_mib": facts.layer_mib if facts else None,
            "params": facts.params if facts else None,
            "param_bytes": dict(facts.param_bytes) if facts else None,
            "model_target": cfg.model.get("_target_") if cfg is not None else None,
            "data_target": cfg.data.get("_target_") if cfg is not None else None,
        }

    def variant_fields(self, variant: str, runner: RunInfo | None) -> dict[str, Any]:
        return capture_fields(variant, getattr(runner, "callback_summaries", None) or [])
