"""The part of `prepare` every env-step actor-critic shares: values on the learner, GAE with
termination vs truncation, flattened to [T*N] training tensors."""

from __future__ import annotations

from typing import Callable

import torch

from flowrl_ray.algorithms.advantages import gae
from flowrl_ray.batch import Batch, concat_time_major


@torch.no_grad()
def advantages_from_rollouts(batches: list[Batch], values_fn: Callable[[torch.Tensor], torch.Tensor],
                             gamma: float, lam: float, reward_scale: float,
                             device: torch.device) -> dict[str, torch.Tensor]:
    """Env-step batches -> flat {obs [M, D], actions [M, A], logp_old [M], values_old [M],
    advantages [M], returns [M]} with M = T * N.

    V of what followed each step is the next obs, the rollout's last obs, or, where the step was
    truncated (time limit), the episode's final obs (same-step autoreset already replaced
    obs[t+1] with a new episode's start); terminated steps bootstrap nothing (see `gae`).
    """
    d = {k: torch.as_tensor(v, device=device) for k, v in concat_time_major(batches).items()}
    obs = d["obs"].float()                                       # [T, N, D]
    rewards = d["rewards"].float() * reward_scale                # [T, N]
    terminated, truncated = d["terminated"].bool(), d["truncated"].bool()
    values = values_fn(obs)                                      # [T, N]
    next_values = torch.cat([values[1:], values_fn(d["last_obs"].float())[None]], 0)
    if truncated.any():
        next_values[truncated] = values_fn(d["final_obs"].float()[truncated])
    adv, ret = gae(rewards, values, next_values, terminated, truncated, gamma, lam)
    flat = lambda x: x.reshape(-1, *x.shape[2:])               # [T, N, ...] -> [T*N, ...]
    return {"obs": flat(obs), "actions": flat(d["actions"].float()), "logp_old": flat(d["logp"].float()),
            "values_old": flat(values), "advantages": flat(adv), "returns": flat(ret)}
