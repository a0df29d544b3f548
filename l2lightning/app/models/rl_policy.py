"""RL policy family: an FP32 actor-critic MLP trained with one-step advantage actor-critic on CartPole.

Each training batch is one step of `batch_size` CartPole environments run side by side with the
current policy: observation, action, reward, next observation, termination flag. The update (policy
gradient with the critic's TD error as the advantage, value regression, entropy bonus) is pure tensor
math on that fixed-size batch, so the whole step can be captured in a CUDA graph.

CartPole: gymnasium's `CartPole-v1` when gymnasium is importable and `env_backend` allows it,
otherwise `CartPole`, a vectorised NumPy copy of the same classic dynamics (Barto, Sutton & Anderson
1983; gymnasium's equations and constants), so the family needs no extra package.
"""

from __future__ import annotations

import collections
import importlib.util
import math
from collections.abc import Callable, Iterator

import lightning.pytorch as pl
import numpy as np
import torch
import torch.nn.functional as F
import torchmetrics
from torch import nn
from torch.utils.data import DataLoader, IterableDataset

from l2lightning.app.models._common import FamilyModule, check_choice, check_int, mlp

OBS_DIM = 4
NUM_ACTIONS = 2
ENV_BACKENDS = ("auto", "numpy", "gymnasium")

# gymnasium's CartPole-v1 constants
GRAVITY = 9.8
MASS_CART = 1.0
MASS_POLE = 0.1
TOTAL_MASS = MASS_CART + MASS_POLE
HALF_POLE_LENGTH = 0.5
POLE_MASS_LENGTH = MASS_POLE * HALF_POLE_LENGTH
FORCE_MAG = 10.0
TAU = 0.02  # seconds per step
THETA_THRESHOLD = 12 * 2 * math.pi / 360  # radians
X_THRESHOLD = 2.4


class CartPole:
    """`num_envs` CartPole-v1 environments stepped together with NumPy (Euler integration, as gymnasium).

    An episode ends when the pole leans more than 12° or the cart leaves ±2.4 (terminated), or after
    `max_episode_steps` (truncated); the reward is 1 per step. Finished environments restart at once.

    Example:
        >>> env = CartPole(num_envs=3, seed=0)
        >>> obs = env.reset()
        >>> next_obs, reward, terminated, truncated, finished_returns = env.step(np.array([0, 1, 1]))
        >>> next_obs.shape, float(reward.sum())
        ((3, 4), 3.0)
    """

    def __init__(self, num_envs: int, seed: int = 0, max_episode_steps: int = 500) -> None:
        self.num_envs = check_int("num_envs", num_envs)
        self.max_episode_steps = check_int("max_episode_steps", max_episode_steps)
        self.rng = np.random.default_rng(seed)
        self.state = np.zeros((num_envs, OBS_DIM))
        self.steps = np.zeros(num_envs, dtype=np.int64)
        self.returns = np.zeros(num_envs)

    def reset(self) -> np.ndarray:
        """Start every environment afresh; returns the observations (num_envs, 4), float32."""
        self.state = self.rng.uniform(-0.05, 0.05, size=(self.num_envs, OBS_DIM))
        self.steps[:] = 0
        self.returns[:] = 0.0
        return self.observation()

    def observation(self) -> np.ndarray:
        return self.state.astype(np.float32)

    def step(self, actions: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """Push each cart left (0) or right (1).

        Returns:
            ``(next_obs, reward, terminated, truncated, finished_returns)``: `next_obs` is the state the
            action led to (before any restart), `finished_returns` the returns of the episodes that
            ended in this step. Afterwards `observation()` holds the restarted environments' states.
        """
        actions = np.asarray(actions)
        if actions.shape != (self.num_envs,) or not np.isin(actions, (0, 1)).all():
            raise ValueError(f"`actions` must be {self.num_envs} values in {{0, 1}}, got {actions!r}")
        x, x_dot, theta, theta_dot = self.state.T
        force = np.where(actions == 1, FORCE_MAG, -FORCE_MAG)
        cos, sin = np.cos(theta), np.sin(theta)
        temp = (force + POLE_MASS_LENGTH * theta_dot**2 * sin) / TOTAL_MASS
        theta_acc = (GRAVITY * sin - cos * temp) / (
            HALF_POLE_LENGTH * (4.0 / 3.0 - MASS_POLE * cos**2 / TOTAL_MASS)
        )
        x_acc = temp - POLE_MASS_LENGTH * theta_acc * cos / TOTAL_MASS
        x, x_dot = x + TAU * x_dot, x_dot + TAU * x_acc
        theta, theta_dot = theta + TAU * theta_dot, theta_dot + TAU * theta_acc
        self.state = np.stack([x, x_dot, theta, theta_dot], axis=1)
        self.steps += 1
        terminated = (np.abs(x) > X_THRESHOLD) | (np.abs(theta) > THETA_THRESHOLD)
        truncated = (self.steps >= self.max_episode_steps) & ~terminated
        reward = np.ones(self.num_envs, dtype=np.float32)
        self.returns += reward
        next_obs = self.observation()
        done = terminated | truncated
        finished = self.returns[done].copy()
        if done.any():
            self.state[done] = self.rng.uniform(-0.05, 0.05, size=(int(done.sum()), OBS_DIM))
            self.steps[done] = 0
            self.returns[done] = 0.0
        return next_obs, reward, terminated, truncated, finished


class GymnasiumCartPole:
    """The same interface as `CartPole` over gymnasium's `CartPole-v1` environments (one per slot)."""

    def __init__(self, num_envs: int, seed: int = 0, max_episode_steps: int = 500) -> None:
        try:
            import gymnasium
        except ImportError as exc:
            raise ImportError(
                "`env_backend='gymnasium'` needs gymnasium: `pip install gymnasium` "
                "(or use env_backend='numpy', the built-in copy of CartPole)"
            ) from exc
        self.num_envs = check_int("num_envs", num_envs)
        self.seed = seed
        self.envs = [
            gymnasium.make("CartPole-v1", max_episode_steps=max_episode_steps) for _ in range(num_envs)
        ]
        self.obs = np.zeros((num_envs, OBS_DIM), dtype=np.float32)
        self.returns = np.zeros(num_envs)

    def reset(self) -> np.ndarray:
        for i, env in enumerate(self.envs):
            self.obs[i], _ = env.reset(seed=self.seed + i)
        self.returns[:] = 0.0
        return self.observation()

    def observation(self) -> np.ndarray:
        return self.obs.copy()

    def step(self, actions: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        next_obs = np.zeros_like(self.obs)
        reward = np.zeros(self.num_envs, dtype=np.float32)
        terminated = np.zeros(self.num_envs, dtype=bool)
        truncated = np.zeros(self.num_envs, dtype=bool)
        finished = []
        for i, (env, action) in enumerate(zip(self.envs, np.asarray(actions))):
            obs, r, term, trunc, _ = env.step(int(action))
            next_obs[i], reward[i], terminated[i], truncated[i] = obs, r, term, trunc
            self.returns[i] += r
            self.obs[i] = obs
            if term or trunc:
                finished.append(self.returns[i])
                self.returns[i] = 0.0
                self.obs[i], _ = env.reset()
        return next_obs, reward, terminated, truncated, np.asarray(finished, dtype=np.float64)


def make_env(backend: str, num_envs: int, seed: int, max_episode_steps: int) -> CartPole | GymnasiumCartPole:
    """CartPole environments from `backend`: ``"auto"`` (gymnasium when importable), ``"numpy"`` or ``"gymnasium"``."""
    check_choice("env_backend", backend, ENV_BACKENDS)
    if backend == "gymnasium" or (backend == "auto" and importlib.util.find_spec("gymnasium") is not None):
        return GymnasiumCartPole(num_envs, seed, max_episode_steps)
    return CartPole(num_envs, seed, max_episode_steps)


ProbsFn = Callable[[np.ndarray], np.ndarray]


class CartPoleRollouts(IterableDataset):
    """Yields `steps_per_epoch` batches per pass; each batch is one step of every environment.

    Args:
        env: the environments (their state carries over from one pass to the next).
        probs_fn: ``probs_fn(obs) -> (num_envs, 2)`` action probabilities (the current policy);
            ``None`` acts uniformly at random.
        steps_per_epoch: batches per pass.
        seed: seeds the action sampling.
        window: how many finished episodes the reported mean return covers.
    """

    def __init__(
        self,
        env: CartPole | GymnasiumCartPole,
        probs_fn: ProbsFn | None,
        steps_per_epoch: int,
        seed: int = 0,
        window: int = 20,
    ) -> None:
        self.env = env
        self.probs_fn = probs_fn
        self.steps_per_epoch = check_int("steps_per_epoch", steps_per_epoch)
        self.rng = np.random.default_rng(seed + 1)
        self.recent = collections.deque(maxlen=window)
        self.obs = env.reset()

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        for _ in range(self.steps_per_epoch):
            yield self.step()

    def step(self) -> dict[str, torch.Tensor]:
        obs = self.obs
        if self.probs_fn is None:
            probs = np.full((len(obs), NUM_ACTIONS), 1.0 / NUM_ACTIONS)
        else:
            probs = self.probs_fn(obs)
        # inverse-CDF sampling with our own generator: torch's RNG (and the CUDA graph's) stays untouched
        actions = (self.rng.random(len(obs))[:, None] > np.cumsum(probs, axis=1)[:, :-1]).sum(axis=1)
        next_obs, reward, terminated, _, finished = self.env.step(actions)
        self.recent.extend(finished.tolist())
        self.obs = self.env.observation()
        # before any episode has ended, the mean length of the running ones is the best lower bound
        recent_return = float(np.mean(self.recent)) if self.recent else float(np.mean(self.env_returns()))
        return {
            "obs": torch.from_numpy(obs),
            "action": torch.from_numpy(actions.astype(np.int64)),
            "reward": torch.from_numpy(reward),
            "next_obs": torch.from_numpy(next_obs),
            "terminated": torch.from_numpy(terminated.astype(np.float32)),
            "recent_return": torch.tensor(recent_return, dtype=torch.float32),
        }

    def env_returns(self) -> np.ndarray:
        return self.env.returns


class CartPoleData(pl.LightningDataModule):
    """CartPole experience for `RLPolicy`: every batch is one step of `batch_size` environments.

    The rollouts act with the LightningModule the Trainer is fitting (its ``action_probs``), so the
    data stays on-policy (Lightning fetches one batch ahead, so the policy lags by one update).

    Args:
        batch_size: environments run side by side = transitions per batch.
        steps_per_epoch: batches per epoch.
        max_episode_steps: episode length limit (CartPole-v1: 500).
        env_backend: ``"auto"`` (gymnasium when importable, else the NumPy copy), ``"numpy"`` or ``"gymnasium"``.
        seed: seeds the environments and the action sampling.
    """

    def __init__(
        self,
        batch_size: int = 16,
        steps_per_epoch: int = 128,
        max_episode_steps: int = 500,
        env_backend: str = "auto",
        seed: int = 0,
    ) -> None:
        super().__init__()
        self.batch_size = check_int("batch_size", batch_size)
        self.steps_per_epoch = check_int("steps_per_epoch", steps_per_epoch)
        self.max_episode_steps = check_int("max_episode_steps", max_episode_steps)
        self.env_backend = check_choice("env_backend", env_backend, ENV_BACKENDS)
        self.seed = check_int("seed", seed, low=0)
        self.rollouts: CartPoleRollouts | None = None

    def setup(self, stage: str | None = None) -> None:
        if self.rollouts is None:
            env = make_env(self.env_backend, self.batch_size, self.seed, self.max_episode_steps)
            self.rollouts = CartPoleRollouts(env, None, self.steps_per_epoch, self.seed)

    def train_dataloader(self) -> DataLoader:
        if self.rollouts is None:
            self.setup("fit")
        trainer = getattr(self, "trainer", None)
        policy = trainer.lightning_module if trainer is not None else None
        self.rollouts.probs_fn = getattr(policy, "action_probs", None)
        # batch_size=None: the dataset yields whole batches; one process, because it calls the policy
        return DataLoader(self.rollouts, batch_size=None, num_workers=0)


class RLPolicy(FamilyModule):
    """Actor-critic MLPs (FP32) for CartPole, trained with one-step advantage actor-critic.

    Loss per batch: ``-log π(a|s) · A + value_coef · (V(s) - y)² - entropy_coef · H(π(·|s))`` with
    TD target ``y = r + γ (1 - terminated) V(s')`` and advantage ``A = y - V(s)`` (both detached).

    Args:
        hidden: width of the actor's and critic's hidden layers.
        depth: hidden layers per network.
        gamma: discount.
        value_coef: weight of the value loss.
        entropy_coef: weight of the entropy bonus.
        lr: AdamW learning rate.
        weight_decay: AdamW weight decay.

    Example:
        >>> policy = RLPolicy(hidden=32, depth=1)
        >>> logits, values = policy(torch.zeros(5, 4))
        >>> logits.shape, values.shape
        (torch.Size([5, 2]), torch.Size([5]))
    """

    metric_name = "value_explained_variance"

    def __init__(
        self,
        hidden: int = 1024,
        depth: int = 2,
        gamma: float = 0.99,
        value_coef: float = 0.5,
        entropy_coef: float = 0.01,
        lr: float = 3e-4,
        weight_decay: float = 0.0,
    ) -> None:
        super().__init__(lr, weight_decay)
        check_int("hidden", hidden)
        check_int("depth", depth)
        if not 0.0 <= gamma <= 1.0:
            raise ValueError(f"`gamma` must be in [0, 1], got {gamma!r}")
        self.save_hyperparameters()
        self.gamma, self.value_coef, self.entropy_coef = float(gamma), float(value_coef), float(entropy_coef)
        sizes = [OBS_DIM] + [hidden] * depth
        self.actor = mlp(sizes + [NUM_ACTIONS], nn.Tanh)
        self.critic = mlp(sizes + [1], nn.Tanh)
        self.register_buffer("action_ids", torch.arange(NUM_ACTIONS), persistent=False)
        self.train_metric = torchmetrics.ExplainedVariance()
        self.episode_return = torchmetrics.MeanMetric(nan_strategy="disable")

    def forward(self, obs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Action logits (B, 2) and state values (B,)."""
        return self.actor(obs), self.critic(obs).squeeze(-1)

    @torch.no_grad()
    def action_probs(self, obs: np.ndarray) -> np.ndarray:
        """π(·|obs) for the rollouts; calls the submodule directly (no prefetch hooks, no autograd)."""
        logits = self.actor(torch.as_tensor(obs, device=self.device))
        return torch.softmax(logits.float(), dim=-1).cpu().numpy()

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        obs, next_obs = batch["obs"], batch["next_obs"]
        n = obs.shape[0]
        # one forward over s and s' together: the prefetch hooks see one pass through each network
        logits, values = self(torch.cat([obs, next_obs]))
        logits, value, next_value = logits[:n], values[:n], values[n:].detach()
        target = batch["reward"] + self.gamma * (1.0 - batch["terminated"]) * next_value
        advantage = (target - value).detach()
        log_probs = F.log_softmax(logits, dim=-1)
        taken = (batch["action"].unsqueeze(-1) == self.action_ids).to(log_probs.dtype)
        policy_loss = -((taken * log_probs).sum(-1) * advantage).mean()
        value_loss = F.mse_loss(value, target)
        entropy = -(log_probs.exp() * log_probs).sum(-1).mean()
        loss = policy_loss + self.value_coef * value_loss - self.entropy_coef * entropy
        self.log("train/loss", loss, batch_size=n)
        self.log("train/entropy", entropy, batch_size=n)
        self.episode_return(batch["recent_return"])
        self.log("train/episode_return", self.episode_return, on_step=True, on_epoch=False, batch_size=1)
        return self.with_train_metric(loss, value.detach(), target.detach())
