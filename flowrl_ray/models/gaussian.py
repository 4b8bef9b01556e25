"""Diagonal Gaussian policy with a state-independent log-std, and a value network."""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.distributions import Normal

from flowrl_ray.models.mlp import RunningNorm, mlp
from flowrl_ray.utils import randn

HALF_LOG_2PI = 0.5 * math.log(2 * math.pi)


def diag_gaussian_log_prob(actions: torch.Tensor, mean: torch.Tensor, log_std: torch.Tensor) -> torch.Tensor:
    """log N(a; mean, diag(exp(log_std))^2) summed over the last dim: [B, A] -> [B].
        sum_j (-z_j^2 / 2 - log sigma_j - log(2 pi) / 2),   z = (a - mean) / sigma"""
    z = (actions - mean) * torch.exp(-log_std)
    return (-0.5 * z.pow(2) - log_std - HALF_LOG_2PI).sum(-1)


class GaussianPolicy(nn.Module):
    """pi(a|s) = N(mu(s), diag(exp(log_std))^2) over the raw (pre-squash) action.

    The env receives ``tanh(a)`` when ``squash`` is on, else ``a`` clipped to [-1, 1]; log-probs
    are always those of the raw action, which is what is stored (the tanh Jacobian depends on
    the action only, so it cancels in every likelihood ratio).
    """

    def __init__(self, obs_dim: int, action_dim: int, hidden_sizes: list[int],
                 activation: str = "tanh", log_std_init: float = 0.0, squash: bool = False,
                 normalize_obs: bool = True):
        super().__init__()
        self.squash = squash
        self.obs_norm = RunningNorm(obs_dim, enabled=normalize_obs)
        self.mean_net = mlp([obs_dim, *hidden_sizes, action_dim], activation, out_gain=0.01)
        self.log_std = nn.Parameter(torch.full((action_dim,), float(log_std_init)))

    def distribution(self, obs: torch.Tensor) -> Normal:
        """obs [B, D] (raw) -> Normal with loc/scale [B, A]."""
        mean = self.mean_net(self.obs_norm(obs))
        return Normal(mean, self.log_std.exp().expand_as(mean), validate_args=False)

    def log_prob(self, obs: torch.Tensor, actions: torch.Tensor) -> torch.Tensor:
        """log pi(a|s) summed over action dims: [B]."""
        return self.distribution(obs).log_prob(actions).sum(-1)

    def to_env_action(self, actions: torch.Tensor) -> torch.Tensor:
        return torch.tanh(actions) if self.squash else actions.clamp(-1.0, 1.0)

    @torch.no_grad()
    def act(self, obs: torch.Tensor, deterministic: bool = False,
            generator: torch.Generator | None = None,
            record: bool = True) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """obs [N, D] -> (env action [N, A] in [-1, 1], record {actions [N, A], logp [N]}).
        ``record`` is the rollout interface's (see FlowPolicy.act); this policy draws only the
        action noise either way.

        Written out rather than through torch.distributions: this runs once per env step, and
        the distribution objects cost more than the MLP (same numbers, tested against log_prob).
        """
        mean = self.mean_net(self.obs_norm(obs))
        log_std = self.log_std.expand_as(mean)
        if deterministic:
            noise = torch.zeros_like(mean)
        else:
            noise = randn(mean.shape, generator, dtype=mean.dtype)
        actions = mean + log_std.exp() * noise
        logp = diag_gaussian_log_prob(actions, mean, log_std)
        return self.to_env_action(actions), {"actions": actions, "logp": logp}


class ValueNet(nn.Module):
    """V(s): obs [B, D] (already normalised) -> [B]."""

    def __init__(self, obs_dim: int, hidden_sizes: list[int], activation: str = "tanh"):
        super().__init__()
        self.net = mlp([obs_dim, *hidden_sizes, 1], activation, out_gain=1.0)

    def forward(self, obs: torch.Tensor) -> torch.Tensor:
        return self.net(obs).squeeze(-1)
