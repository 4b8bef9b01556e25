"""The part of `prepare` every env-step actor-critic shares: values on the learner, GAE with
termination vs truncation, flattened to [T*N] training tensors."""

from __future__ import annotations

from typing import Callable

import torch

from flowrl_ray.algorithms.advantages import gae
from flowrl_ray.batch import Batch, concat_time_major, gather_obs, map_obs

#: Batch keys the runner writes itself; every other key is the policy's per-step record
ROLLOUT_KEYS = ("obs", "rewards", "terminated", "truncated", "final_obs", "last_obs")


def _is_rollout_key(key: str) -> bool:
    return key.split("/")[0] in ROLLOUT_KEYS


def _as_float(x: torch.Tensor) -> torch.Tensor:
    return x if x.dtype == torch.uint8 else x.float()    # images stay uint8 until encoded


@torch.no_grad()
def advantages_from_rollouts(batches: list[Batch], values_fn: Callable, gamma: float, lam: float,
                             reward_scale: float, device: torch.device,
                             bootstrap_truncated: bool = True) -> dict:
    """Env-step batches -> flat {obs [M, ...], values_old [M], advantages [M], returns [M],
    and every key of the policy's record (actions [M, ...], logp [M], ...)} with M = T * N.
    ``values_fn(obs [T, N, ...] or [K, ...]) -> [T, N] or [K]``; dict observations (an image
    policy's) come back as dicts.

    V of what followed each step is the next obs, the rollout's last obs, or, where the step was
    truncated (time limit), the episode's final obs (same-step autoreset already replaced
    obs[t+1] with a new episode's start); terminated steps bootstrap nothing (see `gae`).
    ``bootstrap_truncated=False`` treats the time limit as the end of the task (a sparse success
    task that must be solved within ``max_episode_steps``): a truncated step then bootstraps
    nothing either, so an episode that ran out of time is worth its rewards, not V(final obs).
    """
    d = {k: torch.as_tensor(v, device=device) for k, v in concat_time_major(batches).items()}
    obs = map_obs(_as_float, gather_obs(d, "obs"))                        # [T, N, ...]
    rewards = d["rewards"].float() * reward_scale                         # [T, N]
    terminated, truncated = d["terminated"].bool(), d["truncated"].bool()
    if not bootstrap_truncated:
        terminated = terminated | truncated
    values = values_fn(obs)                                               # [T, N]
    last_obs = map_obs(lambda x: _as_float(x)[None], gather_obs(d, "last_obs"))
    next_values = torch.cat([values[1:], values_fn(last_obs)], 0)
    if truncated.any():
        final = map_obs(lambda x: _as_float(x)[truncated], gather_obs(d, "final_obs"))
        next_values[truncated] = values_fn(final)
    adv, ret = gae(rewards, values, next_values, terminated, truncated, gamma, lam)
    flat = lambda x: x.reshape(-1, *x.shape[2:])               # [T, N, ...] -> [T*N, ...]
    out = {k: flat(_as_float(v)) for k, v in d.items() if not _is_rollout_key(k)}
    out.update(obs=map_obs(flat, obs), values_old=flat(values), advantages=flat(adv), returns=flat(ret))
    return out
