"""CPU tests of the model families: capture-safe training steps, shapes, data, CartPole, learning."""

from __future__ import annotations

import math
import warnings

import lightning.pytorch as pl
import numpy as np
import pytest
import torch
import torchmetrics

from l2lightning.app.models import (
    FAMILIES,
    CartPole,
    CartPoleData,
    ClickData,
    ConvStack,
    DigitsData,
    ImageData,
    MLPStack,
    Recommender,
    RLPolicy,
    TextEncoder,
    TokenData,
    VectorData,
    ViT,
    family_of,
)
from l2lightning.app.models._common import adamw_implementation, cross_entropy
from l2lightning.app.models.recommender import pair_selector
from l2lightning.app.models.rl_policy import CartPoleRollouts
from tests.lightning_models import quiet_trainer

pytestmark = [
    pytest.mark.filterwarnings("ignore:You are trying to .self.log"),
    pytest.mark.usefixtures("one_torch_thread"),
]


def tiny(family: str) -> tuple[pl.LightningModule, pl.LightningDataModule]:
    """A tiny model and a data module that fit each other, for each family."""
    pl.seed_everything(0, verbose=False)
    if family == "mlp_stack":
        return MLPStack(width=32, depth=2), VectorData(
            num_features=32, batch_size=4, train_batches=3, val_batches=1
        )
    if family == "rl_policy":
        return RLPolicy(hidden=32, depth=1), CartPoleData(
            batch_size=4, steps_per_epoch=3, env_backend="numpy"
        )
    if family == "recommender":
        kw = dict(num_tables=3, num_embeddings=40, ids_per_bag=2)
        return (
            Recommender(embedding_dim=8, bottom_mlp=[16], top_mlp=[16], **kw),
            ClickData(batch_size=4, train_batches=3, val_batches=1, **kw),
        )
    if family == "conv_stack":
        return ConvStack(channels=[4, 8]), ImageData(
            image_size=16, batch_size=2, train_batches=3, val_batches=1
        )
    if family == "vit":
        return (
            ViT(image_size=32, dim=32, depth=1, heads=2),
            ImageData(image_size=32, batch_size=2, train_batches=3, val_batches=1),
        )
    if family == "text_encoder":
        kw = dict(vocab_size=64, seq_len=16)
        return (
            TextEncoder(d_model=32, nhead=2, num_layers=2, dim_feedforward=64, **kw),
            TokenData(batch_size=2, train_batches=3, val_batches=1, **kw),
        )
    raise KeyError(family)


def first_batch(dm: pl.LightningDataModule):
    dm.setup("fit")
    return next(iter(dm.train_dataloader()))


class HostSyncError(RuntimeError):
    pass


@pytest.fixture
def forbid_host_syncs(monkeypatch):
    """Inside the block: .item(), bool(tensor), float(tensor), .tolist(), .cpu() and .numpy() raise."""

    def refuse(name):
        def method(*args, **kwargs):
            raise HostSyncError(f"{name} inside training_step: not capturable in a CUDA graph")

        return method

    def arm():
        for name in ("item", "__bool__", "__float__", "__int__", "tolist", "cpu", "numpy"):
            monkeypatch.setattr(torch.Tensor, name, refuse(f"Tensor.{name}"))

    return arm


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_training_step_is_capture_safe(family, forbid_host_syncs, monkeypatch):
    model, dm = tiny(family)
    batch = first_batch(dm)
    model.train()
    forward_calls = []
    model.register_forward_pre_hook(lambda module, args: forward_calls.append(1))
    counts = {
        name: m._update_count for name, m in model.named_modules() if isinstance(m, torchmetrics.Metric)
    }
    forbid_host_syncs()
    out = model.training_step(batch, 0)
    monkeypatch.undo()
    # the training metric updates inside training_step (captured with the step), once, without compute
    assert model.train_metric._update_count == counts["train_metric"] + 1
    assert model.train_metric._computed is None
    # one pass through the module's own forward (the prefetch hooks are scoped to it)
    assert len(forward_calls) == 1
    # the loss alone: a tensor returned besides it would be copied at every replayed step
    assert isinstance(out, torch.Tensor) and out.requires_grad and out.ndim == 0
    out.backward()
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)


def test_the_host_sync_guard_catches_item(forbid_host_syncs, monkeypatch):
    forbid_host_syncs()
    with pytest.raises(HostSyncError):
        torch.ones(1).item()
    with pytest.raises(HostSyncError):
        bool(torch.ones(1) > 0)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_fit_logs_loss_and_metric(family, tmp_path):
    model, dm = tiny(family)
    trainer = quiet_trainer(accelerator="cpu", max_steps=3, default_root_dir=tmp_path)
    before = [p.detach().clone() for p in model.parameters()]
    trainer.fit(model, datamodule=dm)
    metrics = trainer.callback_metrics
    assert math.isfinite(float(metrics["train/loss"]))
    assert f"train/{model.metric_name}" in metrics
    assert math.isfinite(float(metrics[f"train/{model.metric_name}"]))
    assert any(not torch.equal(a, b) for a, b in zip(before, model.parameters())), "no parameter changed"
    assert family_of(model) == family
    if family != "rl_policy":
        val = trainer.validate(model, datamodule=dm, verbose=False)[0]
        assert "val/loss" in val and any(k.startswith("val/") and k != "val/loss" for k in val)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_optimizer_is_adamw_from_config_foreach_on_cpu(family):
    model, _ = tiny(family)
    model.lr, model.weight_decay = 0.123, 0.045
    optimizer = model.configure_optimizers()
    assert type(optimizer) is torch.optim.AdamW
    group = optimizer.param_groups[0]
    assert (group["lr"], group["weight_decay"], group["foreach"], group["fused"]) == (
        0.123,
        0.045,
        True,
        None,
    )
    assert sum(len(g["params"]) for g in optimizer.param_groups) == len(list(model.parameters()))


def test_adamw_is_fused_for_cuda_parameters_and_foreach_elsewhere():
    assert adamw_implementation(torch.device("cuda", 0)) == {"fused": True}
    assert adamw_implementation(torch.device("cpu")) == {"foreach": True}
    assert adamw_implementation(torch.device("meta")) == {"foreach": True}


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_init_is_seedable(family):
    a, _ = tiny(family)
    b, _ = tiny(family)
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))
    pl.seed_everything(1, verbose=False)
    c = type(a)(**a.hparams)
    assert any(not torch.equal(x, y) for x, y in zip(a.parameters(), c.parameters()))


@pytest.mark.parametrize(
    "dm",
    [
        VectorData(num_features=8, batch_size=5, train_batches=4, val_batches=2),
        ClickData(num_tables=2, num_embeddings=30, batch_size=3, train_batches=4, val_batches=2),
        ImageData(image_size=8, batch_size=3, train_batches=4, val_batches=2),
        TokenData(vocab_size=20, seq_len=6, batch_size=3, train_batches=4, val_batches=2),
    ],
    ids=lambda dm: type(dm).__name__,
)
def test_synthetic_data_has_static_shapes(dm):
    dm.setup("fit")
    for loader, batches in ((dm.train_dataloader(), 4), (dm.val_dataloader(), 2)):
        shapes = {tuple(tuple(t.shape) for t in batch) for batch in loader}
        assert len(shapes) == 1, f"batches of different shapes: {shapes}"
        assert next(iter(shapes))[0][0] == dm.batch_size
        assert len(loader) == batches
        assert loader.drop_last is False


def test_synthetic_data_is_seeded():
    a, b, c = (VectorData(num_features=8, seed=s, train_batches=2, batch_size=4) for s in (0, 0, 1))
    for dm in (a, b, c):
        dm.setup("fit")
    assert torch.equal(a.train_set.tensors[0], b.train_set.tensors[0])
    assert not torch.equal(a.train_set.tensors[0], c.train_set.tensors[0])
    # the validation split has other inputs than the training split
    assert not torch.equal(a.train_set.tensors[0][:4], a.val_set.tensors[0][:4])


def test_synthetic_images_are_reproducible_and_labelled():
    dm = ImageData(image_size=16, num_classes=3, batch_size=4, train_batches=5, val_batches=1, noise=0.1)
    dm.setup("fit")
    x1, y1 = dm.train_set[7]
    x2, y2 = dm.train_set[7]
    assert torch.equal(x1, x2) and int(y1) == int(y2)
    # low noise: every image is closest to its own class pattern
    for i in range(len(dm.train_set)):
        x, y = dm.train_set[i]
        distances = ((dm.train_set.patterns - x) ** 2).flatten(1).sum(1)
        assert int(distances.argmin()) == int(y)
    assert {int(dm.train_set[i][1]) for i in range(20)} == {0, 1, 2}


def test_digits_data():
    dm = DigitsData(batch_size=32, val_batches=4)
    dm.setup("fit")
    x, y = dm.train_set.tensors
    assert len(y) % 32 == 0 and len(y) == 1664  # 1797 - 128 validation digits, cut to whole batches
    assert len(dm.val_set) == 128
    assert x.shape[1] == 64 and set(y.tolist()) == set(range(10))
    assert abs(float(x.mean())) < 1e-4  # standardised with the training split's statistics
    with pytest.raises(ValueError, match="`num_features` must be 64"):
        DigitsData(num_features=32)
    with pytest.raises(ValueError, match="`val_batches`"):
        DigitsData(batch_size=512, val_batches=4).setup("fit")


def test_mlp_learns_the_digits(tmp_path):
    pl.seed_everything(0, verbose=False)
    model = MLPStack(width=64, depth=2, in_features=64, task="classification", lr=3e-3)
    dm = DigitsData(batch_size=32, val_batches=8)
    trainer = quiet_trainer(accelerator="cpu", max_steps=80, default_root_dir=tmp_path)
    trainer.fit(model, datamodule=dm)
    accuracy = trainer.validate(model, datamodule=dm, verbose=False)[0]["val/acc"]
    assert accuracy > 0.85, f"validation accuracy {accuracy:.3f} after 80 steps"


def test_cross_entropy_matches_torch():
    logits = torch.randn(6, 5)
    target = torch.tensor([0, 4, 2, 2, 1, 3])
    ours = cross_entropy(logits, target, torch.arange(5))
    assert torch.allclose(ours, torch.nn.functional.cross_entropy(logits, target), atol=1e-6)
    assert cross_entropy(logits.bfloat16(), target, torch.arange(5)).dtype == torch.float32


def test_mlp_stack_blocks_and_dtype():
    model = MLPStack(width=16, depth=3, dtype="bfloat16")
    assert [type(m).__name__ for m in model.blocks[0]] == ["LayerNorm", "Linear", "GELU"]
    assert len(model.blocks) == 3
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert model.train_metric.dtype == torch.float32  # metric states stay float32
    assert model(torch.randn(2, 16)).dtype == torch.bfloat16  # float32 inputs are cast
    plain = MLPStack(width=16, depth=2, block="linear_relu")
    assert [type(m).__name__ for m in plain.blocks[0]] == ["Linear", "ReLU"]


@pytest.mark.parametrize(
    ("cls", "kwargs", "match"),
    [
        (MLPStack, {"dtype": "float64"}, "`dtype` must be one of"),
        (MLPStack, {"task": "ranking"}, "`task` must be one of"),
        (MLPStack, {"width": 0}, "`width` must be an int >= 1"),
        (
            ViT,
            {"image_size": 100, "patch_size": 16},
            "`image_size` \\(100\\) must be a multiple of `patch_size`",
        ),
        (ViT, {"dim": 30, "heads": 4}, "`heads` \\(4\\) must divide `dim`"),
        (TextEncoder, {"d_model": 30, "nhead": 4}, "`nhead`"),
        (Recommender, {"top_mlp": []}, "`top_mlp` must be a non-empty list"),
        (ConvStack, {"channels": [8, -1]}, "`channels`"),
        (RLPolicy, {"gamma": 1.5}, "`gamma`"),
        (MLPStack, {"lr": 0}, "`lr` must be a positive number"),
        (CartPoleData, {"env_backend": "mujoco"}, "`env_backend` must be one of"),
        (VectorData, {"batch_size": 0}, "`batch_size` must be an int >= 1"),
    ],
)
def test_bad_arguments_are_named(cls, kwargs, match):
    with pytest.raises(ValueError, match=match):
        cls(**kwargs)


def test_vit_tokens():
    model = ViT(image_size=224, patch_size=16, dim=32, depth=1, heads=2, num_classes=4)
    assert model.num_tokens == 197
    assert model.pos_embed.shape == (1, 197, 32)
    images = torch.randn(2, 3, 224, 224)
    assert model.patch_embed(images).flatten(2).shape[-1] == 196
    assert model(images).shape == (2, 4)
    layer = model.blocks[0]
    assert layer.norm_first and layer.self_attn.batch_first
    # each block has its own weights (not deep copies of one)
    two = ViT(image_size=32, dim=32, depth=2, heads=2)
    assert not torch.equal(two.blocks[0].linear1.weight, two.blocks[1].linear1.weight)


def test_text_encoder_uses_the_fast_path_in_inference(monkeypatch):
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # e.g. "enable_nested_tensor is True, but ..." would fail here
        model = TextEncoder(vocab_size=50, seq_len=8, d_model=32, nhead=2, num_layers=3, dim_feedforward=64)
    assert not torch.equal(model.encoder.layers[0].linear1.weight, model.encoder.layers[1].linear1.weight)
    calls = []
    fused = torch._transformer_encoder_layer_fwd

    def counting(*args, **kwargs):
        calls.append(1)
        return fused(*args, **kwargs)

    monkeypatch.setattr(torch, "_transformer_encoder_layer_fwd", counting)
    tokens = torch.randint(0, 50, (2, 8))
    model.eval()
    with torch.inference_mode():
        fast = model(tokens)
    assert len(calls) == 3, "PyTorch's fused encoder-layer kernel did not run"
    model.train()
    slow = model(tokens)  # training: the regular (SDPA) path, same math
    assert len(calls) == 3
    assert torch.allclose(fast, slow, atol=1e-5)


def test_recommender_pairwise_interaction():
    select = pair_selector(4)
    z = torch.randn(3, 4, 4)
    rows, cols = torch.triu_indices(4, 4, offset=1)
    assert torch.equal(z.flatten(1) @ select, z[:, rows, cols])
    model = Recommender(
        num_dense=5,
        num_tables=3,
        num_embeddings=20,
        embedding_dim=8,
        ids_per_bag=2,
        bottom_mlp=[16],
        top_mlp=[16],
    )
    assert model.top[0].in_features == 8 + 6  # bottom output + C(4, 2) pairs
    assert all(bag.mode == "sum" for bag in model.embeddings)
    logits = model(torch.randn(7, 5), torch.randint(0, 20, (7, 3, 2)))
    assert logits.shape == (7,)


def test_click_data_is_power_law():
    dm = ClickData(
        num_tables=2, num_embeddings=1000, ids_per_bag=4, batch_size=64, train_batches=16, val_batches=1
    )
    dm.setup("fit")
    dense, ids, clicks = dm.train_set.tensors
    assert ids.shape == (1024, 2, 4) and ids.dtype == torch.int64 and int(ids.max()) < 1000
    counts = torch.bincount(ids[:, 0].flatten(), minlength=1000).sort(descending=True).values
    assert counts[0] > 20 * counts[100].clamp_min(1)  # a few IDs are very popular
    assert 0.05 < float(clicks.mean()) < 0.95


def reference_cartpole_step(state, action):
    """gymnasium's CartPoleEnv.step for one environment, written out in scalars."""
    x, x_dot, theta, theta_dot = state
    force = 10.0 if action == 1 else -10.0
    cos, sin = math.cos(theta), math.sin(theta)
    temp = (force + 0.05 * theta_dot**2 * sin) / 1.1
    theta_acc = (9.8 * sin - cos * temp) / (0.5 * (4.0 / 3.0 - 0.1 * cos**2 / 1.1))
    x_acc = temp - 0.05 * theta_acc * cos / 1.1
    return [x + 0.02 * x_dot, x_dot + 0.02 * x_acc, theta + 0.02 * theta_dot, theta_dot + 0.02 * theta_acc]


def test_cartpole_dynamics_match_the_reference():
    env = CartPole(num_envs=2, seed=3)
    obs = env.reset()
    assert obs.shape == (2, 4) and obs.dtype == np.float32 and np.all(np.abs(obs) <= 0.05)
    state = env.state.copy()
    next_obs, reward, terminated, truncated, finished = env.step(np.array([0, 1]))
    for i, action in enumerate((0, 1)):
        np.testing.assert_allclose(
            next_obs[i], reference_cartpole_step(state[i], action), rtol=1e-6, atol=1e-7
        )
    assert (
        reward.tolist() == [1.0, 1.0] and not terminated.any() and not truncated.any() and finished.size == 0
    )


def test_cartpole_episodes_end_and_restart():
    env = CartPole(num_envs=1, seed=0)
    env.reset()
    lengths = []
    for _ in range(200):  # always pushing right topples the pole within a few dozen steps
        _, _, terminated, _, finished = env.step(np.array([1]))
        if terminated[0]:
            lengths.append(int(finished[0]))
            assert np.all(np.abs(env.observation()) <= 0.05)  # restarted at once
    assert lengths and all(5 <= n <= 60 for n in lengths)
    short = CartPole(num_envs=1, seed=0, max_episode_steps=3)
    short.reset()
    short.state[:] = 0.0  # balanced and still: only the step limit ends the episode
    short.step(np.array([0]))
    short.state[:] = 0.0
    short.step(np.array([1]))
    short.state[:] = 0.0
    _, _, terminated, truncated, finished = short.step(np.array([0]))
    assert truncated[0] and not terminated[0] and finished.tolist() == [3.0]


def test_random_cartpole_returns_are_classic():
    # a uniformly random policy lasts about 22 steps on CartPole
    rollouts = CartPoleRollouts(CartPole(num_envs=32, seed=0), None, steps_per_epoch=300, seed=0, window=1000)
    batches = list(rollouts)
    assert len(batches) == 300
    batch = batches[-1]
    assert 15 < float(batch["recent_return"]) < 30
    assert set(batch) == {"obs", "action", "reward", "next_obs", "terminated", "recent_return"}
    assert batch["obs"].shape == (32, 4) and batch["action"].dtype == torch.int64


def test_cartpole_data_acts_with_the_policy(tmp_path):
    policy = RLPolicy(hidden=16, depth=1)
    with torch.no_grad():  # a policy that always pushes right
        policy.actor[-1].weight.zero_()
        policy.actor[-1].bias.copy_(torch.tensor([-20.0, 20.0]))
    dm = CartPoleData(batch_size=8, steps_per_epoch=2, env_backend="numpy")
    trainer = quiet_trainer(accelerator="cpu", max_steps=1, default_root_dir=tmp_path)
    trainer.fit(policy, datamodule=dm)
    batch = dm.rollouts.step()
    assert batch["action"].tolist() == [1] * 8


def test_gymnasium_backend_is_used_when_importable(monkeypatch):
    import sys
    import types

    made = []

    class FakeEnv:  # the gymnasium API: reset(seed) -> (obs, info); step(a) -> (obs, r, term, trunc, info)
        def __init__(self):
            self.inner = CartPole(num_envs=1)

        def reset(self, seed=None):
            self.inner.rng = np.random.default_rng(seed)
            return self.inner.reset()[0], {}

        def step(self, action):
            obs, reward, term, trunc, _ = self.inner.step(np.array([action]))
            return obs[0], float(reward[0]), bool(term[0]), bool(trunc[0]), {}

    fake = types.ModuleType("gymnasium")
    fake.make = lambda name, **kw: made.append((name, kw)) or FakeEnv()
    monkeypatch.setitem(sys.modules, "gymnasium", fake)
    monkeypatch.setattr(
        "importlib.util.find_spec", lambda name, *a: object() if name == "gymnasium" else None
    )
    dm = CartPoleData(batch_size=3, steps_per_epoch=2, env_backend="auto")
    dm.setup("fit")
    assert len(made) == 3 and made[0] == ("CartPole-v1", {"max_episode_steps": 500})
    batch = next(iter(dm.train_dataloader()))
    assert batch["obs"].shape == (3, 4) and batch["reward"].tolist() == [1.0, 1.0, 1.0]


def test_rl_policy_learns_cartpole(tmp_path):
    # a random policy lasts ~22 steps; one-step actor-critic gets well past that within 1000 updates
    pl.seed_everything(0, verbose=False)
    policy = RLPolicy(hidden=128, depth=2, lr=1e-3)
    dm = CartPoleData(batch_size=16, steps_per_epoch=500, env_backend="numpy")
    trainer = quiet_trainer(accelerator="cpu", max_steps=1000, default_root_dir=tmp_path)
    trainer.fit(policy, datamodule=dm)
    assert float(dm.rollouts.step()["recent_return"]) > 50
