"""ReinFlow's noisy flow (Zhang et al., 2025): a flow policy's Euler sampler with learnable
Gaussian noise at every denoising step, a Markov chain with exact log-probabilities. Pure torch.

Time convention as in :mod:`flowrl_ray.models.flow` (tau = 0 noise, tau = 1 data). With K steps,
dt = 1 / K and tau_k = k / K for k = 0 .. K-1 (the same grid when sampling and when scoring;
the reference release samples on linspace(0, 1, K) and scores on k / K, which differ for K > 1):

    x_0 ~ N(0, I)                                                  [B, Ta, Da]
    mu_k = clip(x_k + dt * v(x_k, tau_k | o), -1, 1)               (the reference's denoised clip)
    x_{k+1} = mu_k + sigma_k * z_k,     z_k ~ N(0, I),     sigma_k = sigma_phi(tau_k | o)
    action = clip(x_K, -1, 1)

    log pi(x_1 .. x_K | x_0, o) = sum_k sum_{r in executed rows} sum_d log N(x_{k+1,rd}; mu_{k,rd}, sigma_{k,rd}^2)

x_0 does not depend on the parameters, so its density (which the reference adds) cancels in every
ratio and is left out. The reference also truncates z to +-3 (an inexact density); here z is not
truncated, so the log-probability is the chain's exact one. Noise off (``deterministic``) gives
the mean chain: the clipped Euler sampler, ReinFlow's evaluation.

sigma_phi (:class:`NoiseStdNet`) is bounded as in the reference: an MLP gives u per action entry
of the chunk, and

    log sigma^2 = log min_std^2 + (log max_std^2 - log min_std^2) * (tanh(u) + 1) / 2.

The entropy of the step's Gaussians (:func:`chain_entropy`) depends on sigma only, so an entropy
bonus trains the noise network alone.

Flow-SDE (``sde_level`` = a; πRL, Chen et al., 2025, sec. 4.1, the ODE-to-SDE conversion of
Flow-GRPO, Liu et al., 2025) replaces the learned noise by the SDE whose marginals are the flow's,
discretised by Euler-Maruyama on the same grid. In this convention (their t is 1 - tau, their
velocity -v) the score of the linear path is -(x - tau v) / (1 - tau), and

    sigma_k = a * sqrt((1 - tau_k) / max(tau_k, dt))    (their a sqrt(t / (1 - t)); at the noise end,
                                                         where it is infinite, the next grid time)
    mu_k = x_k + dt * [v - sigma_k^2 / 2 * (x_k - tau_k v) / (1 - tau_k)],   v = v(x_k, tau_k | o)
    x_{k+1} = mu_k + sigma_k sqrt(dt) z_k

with no clip of mu_k (the action is clipped at the end) and nothing learned in the noise: a = 0
is the Euler sampler itself, and every a keeps the marginals (a test samples a Gaussian target).
"""

from __future__ import annotations

import math
from typing import Callable

import torch
from torch import nn

from flowrl_ray.models.flow import VelocityFn, sinusoidal_embedding
from flowrl_ray.models.gaussian import HALF_LOG_2PI, diag_gaussian_log_prob
from flowrl_ray.models.mlp import mlp
from flowrl_ray.utils import randn

#: std_fn(tau [B], cond [B, C]) -> log sigma [B, Ta, Da]
LogStdFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


class NoiseStdNet(nn.Module):
    """log sigma(tau | o) of each entry of the chunk, bounded to [log min_std, log max_std].
    tau [B], cond [B, C] -> [B, Ta, Da]. Its own time embedding (the velocity's is not shared)."""

    def __init__(self, cond_dim: int, horizon_steps: int, action_dim: int, hidden_sizes: list[int],
                 min_std: float, max_std: float, time_dim: int = 16):
        super().__init__()
        if not 0 < min_std <= max_std:
            raise ValueError(f"noise std bounds need 0 < min_std <= max_std, got {min_std}, {max_std}")
        self.horizon_steps, self.action_dim, self.time_dim = horizon_steps, action_dim, time_dim
        self.min_std, self.max_std = min_std, max_std
        self.net = mlp([time_dim + cond_dim, *hidden_sizes, horizon_steps * action_dim], "tanh")

    def forward(self, tau: torch.Tensor, cond: torch.Tensor) -> torch.Tensor:
        u = self.net(torch.cat([sinusoidal_embedding(tau, self.time_dim), cond], dim=-1))
        lo, hi = 2.0 * math.log(self.min_std), 2.0 * math.log(self.max_std)     # log variances
        log_var = lo + (hi - lo) * (torch.tanh(u) + 1.0) / 2.0
        return (0.5 * log_var).view(-1, self.horizon_steps, self.action_dim)


def _taus(x: torch.Tensor, k: int, steps: int) -> torch.Tensor:
    return torch.full((x.shape[0],), k / steps, dtype=x.dtype, device=x.device)


def _mean(velocity_fn: VelocityFn, x: torch.Tensor, tau: torch.Tensor, cond, steps: int) -> torch.Tensor:
    return (x + velocity_fn(x, tau, cond) / steps).clamp(-1.0, 1.0)


def sde_sigma(tau: torch.Tensor, steps: int, level: float) -> torch.Tensor:
    """Flow-SDE's sigma_k = a sqrt((1 - tau_k) / max(tau_k, dt)), tau [B] -> [B, 1, 1]."""
    return (level * ((1.0 - tau) / tau.clamp(min=1.0 / steps)).sqrt()).view(-1, 1, 1)


def sde_log_std(tau: torch.Tensor, steps: int, level: float) -> torch.Tensor:
    """log of the step's std sigma_k sqrt(dt), [B, 1, 1]."""
    return (sde_sigma(tau, steps, level) / math.sqrt(steps)).clamp(min=1e-12).log()


def transition(velocity_fn: VelocityFn, log_std_fn: LogStdFn, x: torch.Tensor, k: int, steps: int, cond,
               sde_level: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Step k's Gaussian, x_k [B, Ta, Da] -> (mean, log std), each [B, Ta, Da]: ReinFlow's (the
    clipped Euler mean, the noise net's sigma) or, with ``sde_level``, Flow-SDE's (module docstring)."""
    tau = _taus(x, k, steps)
    if sde_level is None:
        return _mean(velocity_fn, x, tau, cond, steps), log_std_fn(tau, cond)
    v, sigma, t = velocity_fn(x, tau, cond), sde_sigma(tau, steps, sde_level), tau.view(-1, 1, 1)   # sigma [B, 1, 1]
    mean = x + (v - sigma.pow(2) / 2 * (x - t * v) / (1.0 - t)) / steps
    return mean, sde_log_std(tau, steps, sde_level).expand_as(x)


def noisy_flow_sample(velocity_fn: VelocityFn, log_std_fn: LogStdFn, cond: torch.Tensor, x0: torch.Tensor,
                      steps: int, deterministic: bool = False, generator: torch.Generator | None = None,
                      sde_level: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Run the chain from x0 [B, Ta, Da] -> (action [B, Ta, Da] in [-1, 1], chain [B, K + 1, Ta, Da]:
    x_0 .. x_K, what :func:`chain_log_prob` scores). ``deterministic``: no noise (the mean chain).
    ``sde_level``: Flow-SDE's transitions (the noise net unused)."""
    xs = [x0]
    for k in range(steps):
        x = xs[-1]
        if deterministic and sde_level is not None:      # Flow-SDE's mean chain is the Euler sampler
            xs.append(x + velocity_fn(x, _taus(x, k, steps), cond) / steps)
            continue
        mean, log_std = transition(velocity_fn, log_std_fn, x, k, steps, cond, sde_level)
        if deterministic:
            xs.append(mean)
        else:
            z = randn(x.shape, generator).to(x.device, x.dtype)
            xs.append(mean + torch.exp(log_std) * z)
    chain = torch.stack(xs, dim=1)
    return chain[:, -1].clamp(-1.0, 1.0), chain


def chain_log_prob(velocity_fn: VelocityFn, log_std_fn: LogStdFn, cond: torch.Tensor, chain: torch.Tensor,
                   row_mask: torch.Tensor | None = None, per_row: bool = False,
                   sde_level: float | None = None) -> torch.Tensor:
    """log pi(x_1 .. x_K | x_0, o) of chains [B, K + 1, Ta, Da] -> [B]: the Gaussian transitions'
    log-densities summed over the K steps, the action dims and the rows ``row_mask`` [B, Ta]
    keeps (1: the env executed the row; None: every row). ``per_row``: [B, Ta] before the sum
    over rows (for a caller that learns the mask later). With gradients when the nets have them.
    ``sde_level``: Flow-SDE's transitions."""
    steps = chain.shape[1] - 1
    total = chain.new_zeros(chain.shape[0], chain.shape[2])                          # [B, Ta]
    for k in range(steps):
        mean, log_std = transition(velocity_fn, log_std_fn, chain[:, k], k, steps, cond, sde_level)
        total = total + diag_gaussian_log_prob(chain[:, k + 1], mean, log_std)       # [B, Ta]
    if per_row:
        return total
    return (total if row_mask is None else total * row_mask.to(total.dtype)).sum(-1)


def chain_entropy(log_std_fn: LogStdFn, cond: torch.Tensor, chain: torch.Tensor,
                  row_mask: torch.Tensor | None = None) -> torch.Tensor:
    """Entropy of the chain's Gaussian transitions given their means, [B]: the sum over steps,
    kept rows and dims of log sigma + log(2 pi e) / 2 (the chain's states only set the shapes;
    under Flow-SDE, whose ``log_std_fn`` is :func:`sde_log_std`, a constant)."""
    steps = chain.shape[1] - 1
    total = chain.new_zeros(chain.shape[0])
    for k in range(steps):
        tau = _taus(chain[:, k], k, steps)
        log_std = log_std_fn(tau, cond).expand_as(chain[:, k])                       # [B, Ta, Da]
        rows = (log_std + HALF_LOG_2PI + 0.5).sum(-1)                                # [B, Ta]
        total = total + (rows if row_mask is None else rows * row_mask.to(rows.dtype)).sum(-1)
    return total
