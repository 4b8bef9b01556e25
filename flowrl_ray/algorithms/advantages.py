"""Advantage estimators shared by every algorithm. Pure torch."""

from __future__ import annotations

import torch


def gae(rewards: torch.Tensor, values: torch.Tensor, next_values: torch.Tensor,
        terminated: torch.Tensor, truncated: torch.Tensor, gamma: float,
        lam: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation (Schulman et al., 2016) over time-major rollouts.

    All inputs are ``[T, N]``. ``next_values[t]`` is V of the observation that followed step t:
    the next step's observation, the rollout's last observation at ``t = T-1``, or the episode's
    final observation when step t was truncated (time limit). Termination means the episode
    really ended, so nothing is bootstrapped; truncation bootstraps from V(final_obs):

        delta_t = r_t + gamma * (1 - terminated_t) * next_values_t - V(s_t)
        A_t     = delta_t + gamma * lam * (1 - done_t) * A_{t+1},   done = terminated | truncated

    Returns (advantages [T, N], returns = advantages + values [T, N]).
    """
    not_terminated = 1.0 - terminated.to(values.dtype)
    not_done = 1.0 - torch.maximum(terminated, truncated).to(values.dtype)
    deltas = rewards + gamma * not_terminated * next_values - values
    advantages = torch.zeros_like(values)
    running = torch.zeros_like(values[0])
    for t in reversed(range(values.shape[0])):
        running = deltas[t] + gamma * lam * not_done[t] * running
        advantages[t] = running
    return advantages, advantages + values


def normalize(x: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """(x - mean) / (std + eps) over all elements; a single element is returned centred."""
    if x.numel() < 2:
        return x - x.mean()
    return (x - x.mean()) / (x.std() + eps)
