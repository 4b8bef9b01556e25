"""What the env-step actor-critics share: `prepare`'s values on the learner, GAE with termination
vs truncation, flattened to [T*N] training tensors; the critic's values of time-major
observations; PPO's epochs over minibatches with an actor and a critic optimiser."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import torch

from flowrl_ray.algorithms.advantages import gae
from flowrl_ray.batch import Batch, concat_time_major, gather_obs, map_obs
from flowrl_ray.optim import local_part, minibatches, optimizer_step

#: Batch keys the runner writes itself; every other key is the policy's per-step record
ROLLOUT_KEYS = ("obs", "rewards", "terminated", "truncated", "final_obs", "last_obs", "grasped")


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


def critic_values(critic: Callable, obs) -> torch.Tensor:
    """V(o) for obs [T, N, ...] (or [K, ...]; a dict for image policies) -> [T, N] (or [K]):
    the leading dims flattened for the critic and restored."""
    lead = (obs["state"] if isinstance(obs, dict) else obs).shape[:-1]
    flat = map_obs(lambda x: x.reshape(-1, *x.shape[len(lead):]), obs)
    return critic(flat).reshape(lead)


@dataclass
class EpochsResult:
    """What :func:`actor_critic_epochs` did: per-minibatch statistics (each key a list), optimiser
    steps of the actor and the critic, whether the target-KL stop ended the actor's epochs, and
    how many steps were skipped for a non-finite loss or gradient."""
    stats: dict[str, list[float]] = field(default_factory=dict)
    actor_steps: int = 0
    critic_steps: int = 0
    early_stop: bool = False
    skipped: int = 0


def actor_critic_epochs(m: int, losses: Callable[[torch.Tensor, torch.Tensor, bool], tuple[torch.Tensor, dict]],
                        actor_opt: torch.optim.Optimizer, critic_opt: torch.optim.Optimizer, *, epochs: int,
                        minibatch_size: int, generator: torch.Generator, device: torch.device,
                        max_grad_norm: float, train_actor: bool, target_kl: float | None,
                        grad_accumulation: int = 1) -> EpochsResult:
    """PPO's epochs for an actor and a critic with their own optimisers (FPO++, ReinFlow):

        for each epoch: shuffle the M samples; for each minibatch mb of ``minibatch_size``:
            loss = sum over its ``grad_accumulation`` parts of losses(part, mb, actor_active) * |part| / |mb|
            one optimiser step (each optimiser clipped by its own norm; non-finite: skipped)
            target-KL stop: once a minibatch's ``approx_kl`` > target_kl, the actor stops for the
            rest of the iteration and the critic goes on (its targets do not depend on the actor)

    In a learner group each rank takes its share of mb (``local_part``) and cuts that into the
    parts; the step sums the ranks' gradients, the statistics are summed over the ranks too.

    ``losses(part, mb, train_actor) -> (loss, stats)``: the mean loss of the rows ``part``, with
    whole-minibatch statistics (advantage normalisation) taken over the rows ``mb``, so that
    neither accumulation nor a learner group changes the math; with ``train_actor`` False
    (critic warm-up or after the stop) the critic's loss alone. Statistics are averaged over the
    parts; ``grad_norm`` is the norm of both gradients together, ``actor_grad_norm`` /
    ``critic_grad_norm`` each's."""
    out = EpochsResult()
    actor_active = train_actor
    for _ in range(epochs):
        for mb in minibatches(m, minibatch_size, generator, device):
            optimizers = [actor_opt, critic_opt] if actor_active else [critic_opt]
            total_loss, mb_stats = 0.0, {}
            share = mb[local_part(len(mb))]                  # this rank's rows (all of them on one learner)
            for part in share.chunk(grad_accumulation):      # in parts (memory)
                loss, part_stats = losses(part, mb, actor_active)
                total_loss = total_loss + loss * (len(part) / len(mb))
                for k, v in part_stats.items():
                    mb_stats[k] = mb_stats.get(k, 0.0) + float(v) * len(part) / len(mb)
            keys = sorted(mb_stats)                          # the minibatch's statistics: the ranks' summed
            values = torch.tensor([mb_stats[k] for k in keys], dtype=torch.float64)   # (in the step's all-reduce)
            norms, stepped = optimizer_step(total_loss, optimizers, max_grad_norm, also_sum=values)
            mb_stats = dict(zip(keys, values.tolist()))
            out.skipped += int(not stepped)
            out.actor_steps += int(actor_active)
            out.critic_steps += 1
            if actor_active:
                out.stats.setdefault("actor_grad_norm", []).append(norms[0])
            out.stats.setdefault("critic_grad_norm", []).append(norms[-1])
            mb_stats["grad_norm"] = float(np.sqrt(np.sum(np.square(norms))))
            for k, v in mb_stats.items():
                out.stats.setdefault(k, []).append(v)
            if actor_active and target_kl is not None and mb_stats["approx_kl"] > target_kl:
                actor_active, out.early_stop = False, True
    return out
