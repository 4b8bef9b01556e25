"""Policy-gradient surrogates and value losses, written once and shared.

Surrogates are elementwise and return the objective to *maximise*; callers average them.
"""

from __future__ import annotations

import torch


def ppo_clip_objective(ratio: torch.Tensor, adv: torch.Tensor, clip: float) -> torch.Tensor:
    """PPO's clipped surrogate (Schulman et al., 2017):

        L = min(r * A, clip(r, 1 - eps, 1 + eps) * A)
    """
    return torch.min(ratio * adv, ratio.clamp(1.0 - clip, 1.0 + clip) * adv)


def value_loss(values: torch.Tensor, returns: torch.Tensor, old_values: torch.Tensor | None = None,
               clip: float | None = None) -> torch.Tensor:
    """0.5 * (V - R)^2, or with ``clip`` PPO's clipped form
    0.5 * max((V - R)^2, (V_old + clip(V - V_old, -c, c) - R)^2). Elementwise."""
    unclipped = (values - returns).pow(2)
    if clip is None or old_values is None:
        return 0.5 * unclipped
    clipped = old_values + (values - old_values).clamp(-clip, clip)
    return 0.5 * torch.max(unclipped, (clipped - returns).pow(2))


def k3(log_ratio: torch.Tensor) -> torch.Tensor:
    """Schulman's k3 estimator of KL(p || q), elementwise, from ``log_ratio = log q(x) - log p(x)``
    of samples x ~ p: ``(r - 1) - log r`` with r = q / p (unbiased, >= 0, exactly 0 where the two
    agree). The one KL estimator of the package: PPO's and FPO++'s ``approx_kl`` (p the old
    policy, q the new) and Flow-GRPO's penalty (p the policy, q the reference) both use it."""
    return (log_ratio.exp() - 1.0) - log_ratio


def approx_kl(log_ratio: torch.Tensor) -> torch.Tensor:
    """KL(old || new) estimate from log(pi_new/pi_old) of samples drawn from pi_old: the mean of
    :func:`k3` over elements."""
    return k3(log_ratio).mean()


def spo_objective(ratio: torch.Tensor, adv: torch.Tensor, clip: float) -> torch.Tensor:
    """Simple Policy Optimization's surrogate (FPO++ Eq. 11):

        L = r * A - |A| / (2 eps) * (r - 1)^2

    Unlike PPO's clip, its gradient pulls r back toward 1 outside the trust region."""
    return ratio * adv - adv.abs() / (2.0 * clip) * (ratio - 1.0).pow(2)


def aspo_objective(ratio: torch.Tensor, adv: torch.Tensor, clip: float) -> torch.Tensor:
    """FPO++'s asymmetric trust region (Eq. 12): PPO's clip where A >= 0, SPO where A < 0."""
    return torch.where(adv >= 0, ppo_clip_objective(ratio, adv, clip), spo_objective(ratio, adv, clip))
