"""CMA-PPO's policy: separate mean and variance networks over pre-tanh actions, and a critic."""

from __future__ import annotations

import torch
from torch import nn

from flowrl_ray.models.gaussian import diag_gaussian_log_prob
from flowrl_ray.models.mlp import RunningNorm
from flowrl_ray.utils import randn

MIN_LOG_VAR = -12.0    # keeps the Gaussian from collapsing to a point (std >= 2.5e-3)


class TanhReLU(nn.Module):
    """Tanh followed by ReLU: the reference mean network's second activation."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(torch.tanh(x))


def _net(sizes: list[int], hidden_acts: list[nn.Module]) -> nn.Sequential:
    layers: list[nn.Module] = []
    for i in range(len(sizes) - 1):
        layers.append(nn.Linear(sizes[i], sizes[i + 1]))
        if i < len(sizes) - 2:
            layers.append(hidden_acts[i])
    return nn.Sequential(*layers)


class CMAPolicy(nn.Module):
    """pi(a|s) = N(mu(s), diag(var(s))) over pre-tanh actions a; the env receives tanh(a).

    Default sizes (BipedalWalker, obs 24, action 4):
        mean_net  24 -> 100 ReLU -> 100 Tanh,ReLU -> 4
        var_net   24 -> 100 ReLU -> 100 ReLU -> 4        (outputs log-variance)
        vf        24 -> 100 ReLU -> 100 ReLU -> 1
    """

    def __init__(self, obs_dim: int, action_dim: int, hidden_sizes: list[int], init_log_var: float = 0.0,
                 normalize_obs: bool = True):
        super().__init__()
        h = hidden_sizes
        relu_then = [nn.ReLU() for _ in h]
        mean_acts = [nn.ReLU() for _ in h[:-1]] + [TanhReLU()]
        self.obs_norm = RunningNorm(obs_dim, enabled=normalize_obs)
        self.mean_net = _net([obs_dim, *h, action_dim], mean_acts)
        self.var_net = _net([obs_dim, *h, action_dim], relu_then)
        self.vf = _net([obs_dim, *h, 1], [nn.ReLU() for _ in h])
        with torch.no_grad():     # start near N(0, exp(init_log_var)) whatever the observation
            self.mean_net[-1].weight.mul_(0.01)
            self.mean_net[-1].bias.zero_()
            self.var_net[-1].weight.mul_(0.01)
            self.var_net[-1].bias.fill_(init_log_var)

    def get_mean_var(self, obs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """raw obs [B, D] -> (mean [B, A], variance [B, A]) of the pre-tanh action."""
        x = self.obs_norm(obs)
        return self.mean_net(x), self.var_net(x).clamp_min(MIN_LOG_VAR).exp()

    def value(self, obs: torch.Tensor) -> torch.Tensor:
        """raw obs [..., D] -> V(s) [...]."""
        flat = obs.reshape(-1, obs.shape[-1])
        return self.vf(self.obs_norm(flat)).reshape(obs.shape[:-1])

    @staticmethod
    def gaussian_log_prob(actions: torch.Tensor, mean: torch.Tensor, var: torch.Tensor) -> torch.Tensor:
        """log N(a; mean, diag(var)) summed over action dims: [B]."""
        return diag_gaussian_log_prob(actions, mean, 0.5 * var.log())

    def log_prob(self, obs: torch.Tensor, actions: torch.Tensor) -> torch.Tensor:
        mean, var = self.get_mean_var(obs)
        return self.gaussian_log_prob(actions, mean, var)

    def sample(self, obs: torch.Tensor, generator: torch.Generator | None = None,
               deterministic: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (pre-tanh action [B, A], tanh-squashed action [B, A])."""
        squashed, record = self.act(obs, deterministic, generator)
        return record["actions"], squashed

    @torch.no_grad()
    def act(self, obs: torch.Tensor, deterministic: bool = False,
            generator: torch.Generator | None = None,
            record: bool = True) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The rollout interface: (env action in [-1, 1], record {actions: pre-tanh, logp}).
        ``record`` as in FlowPolicy.act; this policy draws only the action noise either way."""
        mean, var = self.get_mean_var(obs)
        pre = mean if deterministic else \
            mean + var.sqrt() * randn(mean.shape, generator, dtype=mean.dtype)
        return torch.tanh(pre), {"actions": pre, "logp": self.gaussian_log_prob(pre, mean, var)}
