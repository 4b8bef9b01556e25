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


@torch.no_grad()
def explained_variance(returns: torch.Tensor, values: torch.Tensor) -> float:
    """1 - Var(returns - values) / Var(returns): 1 for a perfect critic, 0 for a constant one,
    negative for a worse one; NaN when the returns do not vary."""
    var_ret = returns.var()
    return float(1.0 - (returns - values).var() / var_ret) if var_ret > 0 else float("nan")


def normalize(x: torch.Tensor, eps: float = 1e-8, ref: torch.Tensor | None = None) -> torch.Tensor:
    """(x - mean) / (std + eps) with the mean and std of all elements of ``ref`` (default ``x``
    itself: a part of a minibatch normalised as the whole minibatch is); a single reference
    element only centres."""
    ref = x if ref is None else ref
    if ref.numel() < 2:
        return x - ref.mean()
    return (x - ref.mean()) / (ref.std() + eps)


def _group_moments(values: torch.Tensor, group_index: torch.Tensor, members: torch.Tensor | None):
    """(values as [B, C], each row's group mean [B, C], its population variance [B, C]) over the
    member rows of each group (all rows of a group without members)."""
    if group_index.ndim != 1 or group_index.shape[0] != values.shape[0]:
        raise ValueError(f"group_index must be [B] with B = values.shape[0]; got {tuple(group_index.shape)} "
                         f"for values {tuple(values.shape)}")
    _, inverse = torch.unique(group_index, return_inverse=True)                  # [B] in 0..G-1
    num_groups = int(inverse.max()) + 1 if inverse.numel() else 0
    flat = values.reshape(values.shape[0], -1)                                     # [B, C]
    weight = torch.ones_like(flat[:, 0])                                           # [B] 1 at the rows counted
    if members is not None:
        members = torch.as_tensor(members, device=flat.device).bool()
        if members.shape != group_index.shape:
            raise ValueError(f"members must be [B] like group_index, got {tuple(members.shape)}")
        has = torch.zeros(num_groups, dtype=flat.dtype, device=flat.device).index_add_(
            0, inverse, members.to(flat.dtype)) > 0                                 # [G]
        weight = torch.where(has[inverse], members.to(flat.dtype), weight)
    counts = torch.zeros(num_groups, dtype=flat.dtype, device=flat.device).index_add_(
        0, inverse, weight)[:, None]                                               # [G, 1]
    mean = torch.zeros(num_groups, flat.shape[1], dtype=flat.dtype, device=flat.device).index_add_(
        0, inverse, flat * weight[:, None]) / counts                                # [G, C]
    centred = flat - mean[inverse]
    var = torch.zeros_like(mean).index_add_(0, inverse, centred.pow(2) * weight[:, None]) / counts
    return flat, mean[inverse], var[inverse]


def group_normalize(values: torch.Tensor, group_index: torch.Tensor, eps: float = 1e-8,
                    members: torch.Tensor | None = None) -> torch.Tensor:
    """Normalise ``values [B, ...]`` within the groups named by ``group_index [B]`` (any integer
    labels, in any order), column by column for trailing dims, with the population std:

        z_i = (v_i - mean_{g(i)}) / (std_{g(i)} + eps)

    ``members [B]`` bool (None: every row): the mean and std of a group are taken over its member
    rows only and applied to all its rows, so a non-member is scored against the members (a group
    without members uses all its rows). A group whose (member) values are all equal, or a group of
    one, gets zeros at its members. Vectorised with scatter-adds over the groups. Returns the
    shape of ``values``."""
    flat, mean, var = _group_moments(values, group_index, members)
    return ((flat - mean) / (var.sqrt() + eps)).reshape(values.shape)


def group_center(values: torch.Tensor, group_index: torch.Tensor,
                 members: torch.Tensor | None = None) -> torch.Tensor:
    """``values [B, ...]`` minus their group's mean (over the ``members`` rows, as in
    :func:`group_normalize`), column by column: every group's members then sum to zero."""
    flat, mean, _ = _group_moments(values, group_index, members)
    return (flat - mean).reshape(values.shape)


def group_advantages(rewards: torch.Tensor, group_size: int, adv_clip_max: float | None = None,
                     eps: float = 1e-8, valid: torch.Tensor | None = None) -> torch.Tensor:
    """Group-relative advantages (GRPO): rewards [N] in consecutive groups of `group_size`
    (the samples of one prompt), each normalised within its group with the population std:

        A_i = (r_i - mean_g) / (std_g + eps),   then clipped to [-adv_clip_max, adv_clip_max]

    ``valid`` [N] bool (None: all valid): mean and std are taken over the valid members of each
    group only, and an invalid member (a crashed or timed-out episode, whose reward says nothing
    about the sample) gets A = 0; the caller also leaves it out of the loss. A group whose valid
    rewards are all equal (or that has fewer than two valid members) gets zeros. Returns [N].

    Rewards [N, C] (several outcomes per sample, e.g. one per scored line of a script) are
    normalised column by column, each within its group: returns [N, C].
    """
    if rewards.ndim not in (1, 2) or rewards.shape[0] % group_size:
        raise ValueError(f"rewards must be [N] or [N, C] with N a multiple of group_size={group_size}, "
                         f"got shape {tuple(rewards.shape)}")
    group_index = torch.arange(rewards.shape[0], device=rewards.device) // group_size
    if valid is None:
        adv = group_normalize(rewards, group_index, eps)
    else:
        valid = torch.as_tensor(valid, device=rewards.device).bool()
        if valid.shape != rewards.shape[:1]:
            raise ValueError(f"valid must be [N] like rewards, got {tuple(valid.shape)} for {tuple(rewards.shape)}")
        adv = torch.zeros_like(rewards)
        if valid.any():
            adv[valid] = group_normalize(rewards[valid], group_index[valid], eps)
    if adv_clip_max is not None:
        adv = adv.clamp(-adv_clip_max, adv_clip_max)
    return adv
