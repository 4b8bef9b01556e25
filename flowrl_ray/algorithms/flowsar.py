"""FlowSAR ("Your Flow Policy is Its Own Critic"): critic-free credit assignment for a flow
policy trained from a binary episode reward R in {0, 1} (here: task success).

    rollout (worker):  a_i ~ pi_old(. | s_i) by K Euler steps from noise; R per episode
    prepare:           complete episodes (tails carried across batches)
                       self-annotation, no grad, n forwards of the rollout net per step
                       (one t_mid per step, n draws of eps, spec 9.2):
                           x = (1 - t_mid) a + t_mid eps,   a_hat = x - t_mid v_old(x, t_mid | s)
                           e_i = mean over draws of || a_i - a_hat ||^2  (summed over the
                                 chunk's executed rows and the action dims)
                               = t_mid^2 || v_old - u ||^2     (Theorem 1)
                           random t_mid: e_i / t_mid^2, so that steps compare
                       credit weights per episode: z = e standardised within the episode
                           (error_scale: standardized; literal: z = e, the spec's formula),
                           success softmax(z / T), failure softmax(-z / T)  (or the
                           `normalized` / ablation rules), then scaled so that each episode's
                           weights sum to the batch's mean episode length (weight_scale:
                           episode_mean; mean_one: mean 1 per real step; sum_one: the spec's
                           sum to 1)
                       labels R in {0, 1} (label_baseline: batch / group / value, beyond the spec:
                           the batch's, the start group's or a learned baseline; batch: DiffusionNFT's
                           r = 1/2 + clip(A, -c, c) / (2c), A = (R - mean R) / std R over the batch)
                       (label_shuffle, a control: the outcomes R permuted across the batch's
                           episodes before labels and weights, so the update carries no signal)
    update:            weighted mirror loss, t ~ U[t_min, t_max]:
                           v+ = (1 - beta) v_old + beta v,   v- = (1 + beta) v_old - beta v
                           E+- = mean over the executed rows and action dims of (v+- - u)^2
                                 [/ (2t): sde]
                           softplus_kl: w softplus(y (E+ - E-) / 2) + kl_coeff mean (v - v_old)^2,
                                        y = 2R - 1 (every mean over the executed rows)
                           mse_branch:  w (R E+ + (1 - R) E-); with w = 1 (uniform, mean_one)
                                        this is DiffusionNFT's loss (spec 9.1)
                           (+ anchor_coeff mean (v - v_base)^2: the base the run started from)
    sync:              theta_old <- b theta_old + (1 - b) theta,  b = min(eta_rate i, eta_max)

Time convention. The spec writes t = 0 clean, t = 1 noise, x_t = (1 - t) a + t eps and
u = eps - a; the package (models/flow.py) uses tau = 0 noise, tau = 1 data, u = a - eps. The
functions below take the spec's ``t`` and call the package's networks at ``tau = 1 - t``:
the interpolant x is the same point, every velocity changes sign (v_spec(x, t) =
-v(x, 1 - t)), and every squared norm (e, E+-, the KL term) is unchanged. So
``flowsar_loss`` accepts v_cur, v_old and u in either convention, as long as all three agree.

Rollouts use theta_old (published to the workers); theta is what the update trains. A chunk's
rows the env never executed (past ``act_steps``, or past the episode's end) never met the outcome:
as in FPO++, they count in no error, energy or KL.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any, Literal, Optional

import numpy as np
import torch
import torch.nn.functional as F

from flowrl_ray.algorithms.advantages import gae, group_advantages, group_normalize
from flowrl_ray.algorithms.base import EnvStepAlgorithm
from flowrl_ray.optim import ema_update, load_scheduler, local_part, lr_multiplier, minibatches, optimizer_step
from flowrl_ray.algorithms.episodes import EpisodeAssembler, StartGroups, episode_obs
from flowrl_ray.models.flow_policy import (check_base_policy, check_flow_arch, executed_row_mask, image_shape,
                                         load_base_policy, make_flow_policy)
from flowrl_ray.algorithms.losses import value_loss
from flowrl_ray.batch import Batch, map_obs
from flowrl_ray.config import Config, ConfigError, FlowBCPretrainConfig, check, check_layer_sizes, check_minibatch_size
from flowrl_ray.envs import EnvSpec
from flowrl_ray.models.flow import FlowPolicy, ValueMLP, VelocityFn, row_mean, sum_rows

WEIGHT_MODES = ("softmax", "normalized", "uniform", "random", "inverse", "critic_oracle")


@dataclass
class FlowSARConfig:
    FLATTENED = ("flowsar",)            # algo.flowsar.X is the earlier name of algo.X
    base_policy: Optional[str] = None   # a `flowrl-ray pretrain` checkpoint; None: random init
    # the flow policy (must match the base policy's; `flowrl-ray pretrain` reads the same keys)
    hidden_sizes: list = field(default_factory=lambda: [512, 512, 512])
    time_dim: int = field(default=32, metadata=check(gt=0))
    feature_dim: int = field(default=64, metadata=check(gt=0))
    flow_steps: int = field(default=10, metadata=check(gt=0))
    # the velocity network's form and the Euler sampler (as FPO++'s: see FPOPPConfig)
    time_embedding: Literal["flowrl", "reinflow"] = "flowrl"
    velocity_mlp: Literal["plain", "residual"] = "plain"
    velocity_activation: Literal["mish", "relu", "tanh", "elu", "gelu", "silu", "softplus"] = "mish"
    flow_time_grid: Literal["left", "linspace"] = "left"
    flow_clip_intermediate: bool = False
    # "VLA-style": the observation encoder (the pretrained policy's) stays frozen and only the
    # velocity network (the action expert) trains. State policies have no encoder weights.
    freeze_encoder: bool = False
    epochs: int = field(default=1, metadata=check(gt=0))
    minibatch_size: int = field(default=256, metadata=check(gt=0))
    max_grad_norm: float = field(default=1.0, metadata=check(gt=0))
    weight_decay: float = field(default=0.0, metadata=check(ge=0))
    augment: bool = True                # image observations: random shifts in the update
    # weight_mode critic_oracle: a critic trained alongside, GAE advantages as the signal;
    # label_baseline value: the same network regressed on each step's episode outcome
    gamma: float = field(default=0.99, metadata=check(ge=0, le=1))
    gae_lambda: float = field(default=0.95, metadata=check(ge=0, le=1))
    critic_lr: float = field(default=1e-4, metadata=check(gt=0))
    critic_hidden_sizes: list = field(default_factory=lambda: [256, 256, 256])
    # the spec's hyperparameter table, defaults as there (earlier nested under algo.flowsar:, which
    # configs, overrides and old run directories may still use)
    beta: float = field(default=1.0, metadata=check(gt=0))            # mirror trust region
    temperature: float = field(default=0.5, metadata=check(gt=0))     # weight sharpness T
    tau_mid: float = field(default=0.5, metadata=check(gt=0, lt=1))   # t_mid (spec: 1 = noise)
    # uniform: t_mid ~ U[0.3, 0.7] per step, then e / t_mid^2; grid: e / t_mid^2 averaged over every
    # t_mid of tau_mid_grid (the spec's third option, 3.3.4: the most precise, len(grid) times the cost)
    tau_mid_sampling: Literal["fixed", "uniform", "grid"] = "fixed"
    tau_mid_grid: list = field(default_factory=lambda: [0.3, 0.5, 0.7])
    n_annotation_samples: int = field(default=3, metadata=check(gt=0))   # eps draws per step (spec 9.2)
    weight_mode: Literal[WEIGHT_MODES] = "softmax"
    # standardized: the softmax acts on e standardised within each episode, so T is a scale-free
    # sharpness (literal: on e itself, the spec's formula, whose spread grows with the chunk size)
    error_scale: Literal["standardized", "literal"] = "standardized"
    # episode_mean: each episode's weights sum to the batch's mean episode length, so every episode
    # counts the same (with mean_one a 38-step Lift failure counts 2-8 times a short success, and
    # the policy drifted: see docs/algorithms/flowsar.md); mean_one: an episode's weights average 1
    # over its steps (uniform == DiffusionNFT's per-sample loss); sum_one: they sum to 1 (the spec's
    # formula: each step H times weaker than the KL term)
    weight_scale: Literal["mean_one", "sum_one", "episode_mean"] = "episode_mean"
    # beyond the spec: batch centres the labels as DiffusionNFT does (see centred_labels); value: a
    # learned baseline per state, V(s) ~ P(success | s) trained on the outcomes (see value_labels)
    # group: GRPO's baseline, the mean outcome of the K = env.start_group episodes that started from
    # the same seeded state (an episode waits for its group; see group_labels)
    label_baseline: Literal["none", "batch", "value", "group"] = "none"
    # with label_baseline batch: DiffusionNFT's adv_clip_max c, r = 1/2 + clip(A, -c, c) / (2c);
    # the labels of a batch with success rate p average 1/2 while 1 / (1 + c^2) <= p <= c^2 / (1 + c^2)
    label_clip: float = field(default=5.0, metadata=check(gt=0))
    # a control, not a method: the batch's outcomes permuted across its episodes before labels and
    # weights, so the update keeps its size and label mix but carries no information about what
    # each episode did (what the update does to the policy without a signal)
    label_shuffle: bool = False
    shaped_lambda: Optional[float] = field(default=None, metadata=check(ge=0, le=1))  # None: off
    ema_schedule: Literal["fixed", "linear"] = "linear"
    ema_beta: float = field(default=0.995, metadata=check(ge=0, le=1))
    ema_eta_rate: float = field(default=0.001, metadata=check(ge=0))
    ema_eta_max: float = field(default=0.5, metadata=check(ge=0, le=1))
    energy_type: Literal["mse", "sde"] = "mse"
    # simple: spec 8.4 ablation 5; rft: flow matching on the successful episodes only (spec 8.2's RFT)
    loss_variant: Literal["softplus_kl", "mse_branch", "simple", "rft"] = "softplus_kl"
    kl_coeff: float = field(default=1.0, metadata=check(ge=0))
    # an anchor to the base (the policy the run started from, frozen): + anchor_coeff * mean over the
    # executed rows of (v - v_base)^2 at the update's x_t, a CFM distance that theta_old (which
    # follows theta) cannot provide; 0: off
    anchor_coeff: float = field(default=0.0, metadata=check(ge=0))
    lr: float = field(default=1e-6, metadata=check(gt=0))
    lr_warmup_iters: int = field(default=0, metadata=check(ge=0))     # linear warm-up of lr, in iterations
    t_min: float = field(default=0.2, metadata=check(ge=0, le=1))
    t_max: float = field(default=0.8, metadata=check(ge=0, le=1))
    w_min: float = field(default=0.0, metadata=check(ge=0, le=1))
    w_max: float = field(default=1.0, metadata=check(gt=0, le=1))


# --------------------------------------------------------------------------- the math

def self_annotation(velocity_fn: VelocityFn, obs, actions: torch.Tensor, t_mid: float | torch.Tensor,
                    n_draws: int, generator: torch.Generator, per_unit_time: bool = False,
                    row_mask: torch.Tensor | None = None) -> torch.Tensor:
    """e [B] averaged over ``n_draws`` eps ~ N(0, I) at the step's one ``t_mid`` (a float or [B]),
    drawn from ``generator`` (on the CPU) one [B, Ta, Da] block per draw. ``per_unit_time``:
    e / t_mid^2 = || v_old - u ||^2 by Theorem 1, which compares steps annotated at different
    t_mid. ``row_mask`` [B, Ta]: the executed rows (None: all)."""
    total = torch.zeros(actions.shape[0], device=actions.device)
    for _ in range(n_draws):
        eps = torch.randn(actions.shape, generator=generator).to(actions.device)
        total += reconstruction_error(velocity_fn, obs, actions, eps, t_mid, row_mask)
    e = total / n_draws
    return e / torch.as_tensor(t_mid, device=e.device) ** 2 if per_unit_time else e


def reconstruction_error(velocity_fn: VelocityFn, obs, actions: torch.Tensor, eps: torch.Tensor,
                         t_mid: float | torch.Tensor, row_mask: torch.Tensor | None = None) -> torch.Tensor:
    """Self-annotation e = || a - a_hat ||^2 [B], summed over the action dims and the chunk's rows
    ``row_mask`` [B, Ta] keeps (1: executed; None: every row).

    actions, eps [B, Ta, Da]; ``t_mid`` (spec convention, 1 = noise) a float or [B];
    ``velocity_fn(x, tau, obs)`` in the package's convention. With tau = 1 - t_mid:
        x = (1 - t_mid) a + t_mid eps
        a_hat = x - t_mid v_spec = x + t_mid v(x, 1 - t_mid)
    """
    t = torch.as_tensor(t_mid, dtype=actions.dtype, device=actions.device)
    t = t.expand(actions.shape[0])[:, None, None]                         # [B, 1, 1]
    x = (1.0 - t) * actions + t * eps
    a_hat = x + t * velocity_fn(x, 1.0 - t[:, 0, 0], obs)
    return sum_rows((actions - a_hat).pow(2).sum(-1)[:, None], row_mask)[:, 0]      # [B, 1, Ta] -> [B]


def standardize_per_episode(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """x [E, H] standardised within each row over its real steps (``mask``), with the population
    std: z = (x - mean) / (std + 1e-8); padded steps and constant rows get 0."""
    episode = torch.arange(x.shape[0], device=x.device)[:, None].expand_as(x)
    return torch.zeros_like(x).masked_scatter(mask, group_normalize(x[mask], episode[mask]))


def episode_correlation(x: torch.Tensor, y: torch.Tensor, mask: torch.Tensor) -> float:
    """Mean over episodes (rows with >= 2 real steps) of the Pearson correlation of x and y [E, H]
    over the episode's real steps: the mean product of their within-episode standard scores.
    For e and the critic's GAE advantages it says whether the steps self-annotation singles out
    are the ones a critic would (the spec's analysis 4); nan without such an episode."""
    n = mask.sum(1)
    keep = n >= 2
    if not keep.any():
        return float("nan")
    prod = standardize_per_episode(x, mask) * standardize_per_episode(y, mask)
    return float((prod.sum(1)[keep] / n[keep]).mean())


def group_labels(success: torch.Tensor, group_size: int, clip: float = 5.0) -> torch.Tensor:
    """GRPO-style labels (``label_baseline: group``): success [E] bool in consecutive groups of
    ``group_size`` episodes that started from one seeded state -> r [E] in [0, 1],

        A = (R - mean_g R) / std_g R      (population std within the group)
        r = 1/2 + clip(A, -c, c) / (2 c)

    The baseline is the success rate from that start state, so a state the policy always fails
    (or always solves) gives r = 1/2, no push, and only groups with both outcomes carry a contrast."""
    return 0.5 + 0.5 * group_advantages(success.float(), group_size, adv_clip_max=clip) / clip


def centred_labels(success: torch.Tensor, clip: float = 5.0) -> torch.Tensor:
    """DiffusionNFT's optimality probability with the batch's success rate p as the baseline
    (beyond the FlowSAR spec): success [E] bool -> r [E] in [0, 1],

        A = (R - mean R) / std R          (population std over the E episodes)
        r = 1/2 + clip(A, -c, c) / (2 c)  (c = ``clip``, DiffusionNFT's adv_clip_max, 5 there)

    A success has A = sqrt((1 - p) / p), a failure -sqrt(p / (1 - p)), so while neither is clipped
    (1 / (1 + c^2) <= p <= c^2 / (1 + c^2)) the labels y = 2r - 1 average 0 over the batch: the
    successes pull exactly as hard as the failures push. A c small enough to clip one side (c = 1:
    every p but 1/2) weakens the rarer outcome's labels: at p < 1/2 the successes' pull is cut, the
    mean y is negative, and the policy is pushed away from what it did. A batch of one outcome gets
    r = 1/2 (no contrast: the softplus term is flat)."""
    return group_labels(success, success.numel(), clip)


def value_labels(outcome: torch.Tensor, baseline: torch.Tensor, clip: float = 5.0) -> torch.Tensor:
    """Per-step labels with a learned baseline (``label_baseline: value``, beyond the spec):
    outcome [M] the R in {0, 1} of each step's episode, baseline [M] V(s) ~ P(success | s):

        A = (R - V(s)) / std(R - V(s))    (population std over the M steps)
        r = 1/2 + clip(A, -c, c) / (2 c)

    A step from a state the policy usually solves gets little from a success and a large push
    from a failure, and the reverse where it usually fails: the credit is relative to the state,
    not to the batch. All steps at their baseline give r = 1/2 (no push)."""
    d = outcome.float() - baseline
    a = d / (d.std(unbiased=False) + 1e-8) if d.numel() > 1 else torch.zeros_like(d)
    return 0.5 + 0.5 * a.clamp(-clip, clip) / clip


def credit_weights(errors: torch.Tensor, success: torch.Tensor, temperature: float,
                   mode: str = "softmax", mask: torch.Tensor | None = None, *,
                   w_min: float = 0.0, w_max: float = 1.0, shaped_lambda: float | None = None,
                   reward_diff: torch.Tensor | None = None, advantages: torch.Tensor | None = None,
                   generator: torch.Generator | None = None, standardize: bool = False,
                   scale: str = "sum_one") -> torch.Tensor:
    """Step weights [E, H] of E episodes padded to H steps (``mask`` marks real steps); each
    row with a real step sums to 1 (``scale`` sum_one, the spec's), averages 1 over its real
    steps (mean_one: w * H_episode; uniform weights are then exactly 1) or sums to the mean
    episode length of the rows with steps (episode_mean: w * mean H; the total is mean_one's, and
    every episode weighs the same).

        softmax:     success  w = softmax(e / T),        failure  w = softmax(-e / T)
        normalized:  e clipped to the batch's 5th-95th percentiles, then
                     success  w = e / sum e,             failure  w = (1 / e) / sum (1 / e)
        inverse:     softmax with the success and failure rules swapped (ablation)
        uniform:     1 / H;  random: U(0, 1) normalised (ablations)
        critic_oracle: the softmax rule on ``advantages`` [E, H] instead of e
    ``shaped_lambda``: softmax((lambda e~ + (1 - lambda) reward_diff) / T), e~ = +-e by outcome.
    ``standardize``: the softmax rules (softmax, inverse, critic_oracle, shaped) read e (or the
    advantages) standardised within each episode, so T is a sharpness in episode stds.
    Then, when [w_min, w_max] is narrower than [0, 1], w is clipped and renormalised (in the
    sum-to-1 scale), and last scaled by ``scale``.
    """
    if mode not in WEIGHT_MODES:
        raise ValueError(f"weight mode must be one of {WEIGHT_MODES}, got {mode!r}")
    if scale not in ("sum_one", "mean_one", "episode_mean"):
        raise ValueError(f"weight scale must be 'sum_one', 'mean_one' or 'episode_mean', got {scale!r}")
    mask = torch.ones_like(errors, dtype=torch.bool) if mask is None else mask.bool()
    success = success.bool()
    if mode == "uniform":
        w = mask.to(errors.dtype)
    elif mode == "random":
        w = torch.rand(errors.shape, generator=generator, dtype=errors.dtype).to(errors.device) * mask
    elif mode == "normalized":
        valid = errors[mask]
        lo, hi = torch.quantile(valid, 0.05), torch.quantile(valid, 0.95)
        e = errors.clamp(lo, hi).clamp_min(1e-12)
        w = torch.where(success[:, None], e, 1.0 / e) * mask
    else:
        signal = advantages if mode == "critic_oracle" else errors
        if signal is None:
            raise ValueError("weight mode 'critic_oracle' needs the advantages")
        if standardize:
            signal = standardize_per_episode(signal, mask)
        sign = torch.where(success, 1.0, -1.0).to(errors.dtype)[:, None]   # e~: +e success, -e failure
        if mode == "inverse":
            sign = -sign
        logits = sign * signal
        if shaped_lambda is not None:
            if reward_diff is None:
                raise ValueError("shaped_lambda needs reward_diff")
            logits = shaped_lambda * logits + (1.0 - shaped_lambda) * reward_diff
        w = torch.softmax((logits / temperature).masked_fill(~mask, float("-inf")), dim=-1)
        w = torch.nan_to_num(w) * mask                  # a row without steps: all -inf -> 0
    w = w / w.sum(-1, keepdim=True).clamp_min(1e-30)
    if w_min > 0.0 or w_max < 1.0:
        w = w.clamp(w_min, w_max) * mask
        w = w / w.sum(-1, keepdim=True).clamp_min(1e-30)
    if scale == "mean_one":
        w = w * mask.sum(-1, keepdim=True)
    elif scale == "episode_mean":
        lengths = mask.sum(-1)                                                   # H_e [E]
        w = w * lengths[lengths > 0].to(w.dtype).mean()
    return w


def mirror_energies(v_cur: torch.Tensor, v_old: torch.Tensor, u: torch.Tensor, beta: float,
                    energy_type: str = "mse", flow_t: torch.Tensor | None = None,
                    row_mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """E+ and E- [B] of the mirrored velocities (v_old treated as a constant):

        v+ = (1 - beta) v_old + beta v_cur,   v- = (1 + beta) v_old - beta v_cur
        E+- = mean over the executed rows (``row_mask`` [B, Ta]; None: all) and the action dims
              of (v+- - u)^2,   sde: E+- / (2 max(t, 1e-3))
    """
    v_old = v_old.detach()
    v_pos = (1.0 - beta) * v_old + beta * v_cur
    v_neg = (1.0 + beta) * v_old - beta * v_cur
    e_pos = row_mean((v_pos - u).pow(2), row_mask)
    e_neg = row_mean((v_neg - u).pow(2), row_mask)
    if energy_type == "sde":
        if flow_t is None:
            raise ValueError("energy_type 'sde' needs flow_t")
        scale = 1.0 / (2.0 * flow_t.reshape(-1).clamp_min(1e-3))
        e_pos, e_neg = e_pos * scale, e_neg * scale
    elif energy_type != "mse":
        raise ValueError(f"energy type must be 'mse' or 'sde', got {energy_type!r}")
    return e_pos, e_neg


def flowsar_loss(v_cur: torch.Tensor, v_old: torch.Tensor, u: torch.Tensor, weights: torch.Tensor,
                 rewards: torch.Tensor, beta: float, energy_type: str = "mse",
                 loss_variant: str = "softplus_kl", kl_coeff: float = 1.0,
                 flow_t: torch.Tensor | None = None, row_mask: torch.Tensor | None = None) -> torch.Tensor:
    """The weighted mirror loss (to minimise), a scalar. v_cur, v_old, u [B, Ta, Da];
    weights [B]; rewards [B] the labels R in {0, 1} (or centred labels r in [0, 1]);
    flow_t [B] (spec convention) for ``sde``; row_mask [B, Ta] the executed rows, over which
    every ``mean`` below is taken (None: all rows).

        softplus_kl: mean_i [ w_i softplus(y_i (E+ - E-) / 2) + kl_coeff mean (v_cur - v_old)^2 ],
                     y = 2R - 1
        mse_branch:  mean_i   w_i (R_i E+ + (1 - R_i) E-)   (w = 1: DiffusionNFT's loss)
        simple:      mean_i [ w_i y_i mean (v_cur - u)^2 + kl_coeff mean (v_cur - v_old)^2 ]
                     (FlowSAR-simple, spec 8.4 ablation 5: weighted FM on successes, weighted
                     anti-FM on failures, the KL term as trust region; no mirror, beta unused)
        rft:         mean_i [ w_i R_i mean (v_cur - u)^2 + kl_coeff mean (v_cur - v_old)^2 ]
                     (RFT, the spec's supervised baseline: flow matching on the successful
                     episodes' steps only; with uniform weights, kl_coeff 0 and t in [0, 1] it is
                     behaviour cloning of the policy's own successes)
    """
    if loss_variant in ("softplus_kl", "mse_branch"):            # the mirror variants
        e_pos, e_neg = mirror_energies(v_cur, v_old, u, beta, energy_type, flow_t, row_mask)
    if loss_variant == "softplus_kl":
        y = 2.0 * rewards - 1.0
        kl = row_mean((v_cur - v_old.detach()).pow(2), row_mask)
        per_sample = weights * F.softplus(0.5 * y * (e_pos - e_neg)) + kl_coeff * kl
    elif loss_variant == "mse_branch":
        per_sample = weights * (rewards * e_pos + (1.0 - rewards) * e_neg)
    elif loss_variant in ("simple", "rft"):
        label = 2.0 * rewards - 1.0 if loss_variant == "simple" else rewards      # y or R
        fm = row_mean((v_cur - u).pow(2), row_mask)
        kl = row_mean((v_cur - v_old.detach()).pow(2), row_mask)
        per_sample = weights * label * fm + kl_coeff * kl
    else:
        raise ValueError(f"loss variant must be 'softplus_kl', 'mse_branch', 'simple' or 'rft', got {loss_variant!r}")
    return per_sample.mean()


def ema_coefficient(iteration: int, schedule: str, ema_beta: float = 0.995, eta_rate: float = 0.001,
                    eta_max: float = 0.5) -> float:
    """b of theta_old <- b theta_old + (1 - b) theta: ``fixed`` b = ema_beta; ``linear``
    (DiffusionNFT) b_i = min(eta_rate * i, eta_max)."""
    if schedule == "fixed":
        return ema_beta
    if schedule == "linear":
        return min(eta_rate * iteration, eta_max)
    raise ValueError(f"ema schedule must be 'fixed' or 'linear', got {schedule!r}")


# --------------------------------------------------------------------------- the algorithm

class FlowSAR(EnvStepAlgorithm):
    config_class = FlowSARConfig
    data_parallel = True              # runtime.num_learners > 1: each rank a share of each minibatch
    pretrain_config_class = FlowBCPretrainConfig
    extra_plots = (("flowsar/e_within_episode_cv", "flowsar_e_spread.png"),
                   ("flowsar/weight_entropy_ratio", "flowsar_weight_entropy.png"),
                   ("flowsar/kl", "flowsar_kl.png"),
                   ("flowsar/oracle_corr", "flowsar_oracle_corr.png"))

    @staticmethod
    def validate_config(cfg: Config) -> None:
        c: FlowSARConfig = cfg.algo
        h = c
        check_layer_sizes(c.hidden_sizes, "algo.hidden_sizes")
        check_layer_sizes(c.critic_hidden_sizes, "algo.critic_hidden_sizes")
        check_flow_arch(cfg)
        check_minibatch_size(cfg, c.minibatch_size)
        if cfg.env.family == "gym":
            raise ConfigError("config key 'env.family': FlowSAR trains a flow policy on action chunks and "
                              "a binary success per episode (use the robot family)")
        if h.t_min >= h.t_max:
            raise ConfigError(f"config key 'algo.t_min': {h.t_min} must be below algo.t_max ({h.t_max})")
        if h.tau_mid_sampling == "grid" and (not h.tau_mid_grid or not all(
                isinstance(t, (int, float)) and not isinstance(t, bool) and 0 < t < 1 for t in h.tau_mid_grid)):
            raise ConfigError(f"config key 'algo.tau_mid_grid': tau_mid_sampling 'grid' needs one or more t_mid "
                              f"in (0, 1), got {h.tau_mid_grid!r}")
        if h.w_min > h.w_max:
            raise ConfigError(f"config key 'algo.w_min': {h.w_min} is above algo.w_max ({h.w_max})")
        if h.label_baseline == "group" and getattr(cfg.env, "start_group", 1) < 2:
            raise ConfigError("config key 'algo.label_baseline': 'group' needs groups of episodes from one start "
                              "state: set env.start_group to the group size K >= 2 (a divisor of "
                              "runtime.envs_per_worker)")
        if h.label_baseline == "value" and h.weight_mode == "critic_oracle":
            raise ConfigError("config key 'algo.label_baseline': 'value' and weight_mode 'critic_oracle' would "
                              "train one critic on two targets (outcomes and GAE returns); use one of them")
        if h.label_shuffle and (h.weight_mode == "critic_oracle" or h.shaped_lambda is not None):
            raise ConfigError("config key 'algo.label_shuffle': the critic oracle and the shaping term read the "
                              "episodes' own rewards, which the shuffle does not permute; use it with the "
                              "outcome-only rules")

    @staticmethod
    def preflight(cfg: Config, spec: EnvSpec) -> None:
        check_base_policy(cfg)

    def __init__(self, cfg: Config, spec: EnvSpec, device: torch.device):
        super().__init__(cfg, spec, device)
        c: FlowSARConfig = cfg.algo
        self.c = self.h = c                   # h: the spec's hyperparameters (the same section)
        self._policy = make_flow_policy(cfg, spec).to(device)                 # theta
        if c.base_policy is not None:
            self._policy.load_state_dict(load_base_policy(c.base_policy)["policy"])
        if c.freeze_encoder:
            self._policy.encoder.requires_grad_(False)
        self.old = copy.deepcopy(self._policy).requires_grad_(False)          # theta_old (rollouts)
        self.anchor = copy.deepcopy(self._policy).requires_grad_(False) if c.anchor_coeff > 0 else None   # the base
        params = [p for p in self._policy.parameters() if p.requires_grad]
        self.opt = torch.optim.AdamW(params, lr=self.h.lr, weight_decay=c.weight_decay)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.opt, lr_multiplier("constant", cfg.train.iterations, self.h.lr_warmup_iters))
        self.critic = self.critic_opt = None
        if self.h.weight_mode == "critic_oracle" or self.h.label_baseline == "value":
            self.critic = ValueMLP(spec.obs_dim, c.critic_hidden_sizes, image_shape(cfg), c.feature_dim).to(device)
            self.critic_opt = torch.optim.AdamW(self.critic.parameters(), lr=c.critic_lr)
        # executed_rows: how many rows of each chunk the env ran; grasped: the analysis's key step
        # start_seed: the start state's seed, which names an episode's group (label_baseline: group)
        self.assembler = EpisodeAssembler(step_keys=("actions", "executed_rows", "grasped", "start_seed"))
        self.group_size = getattr(cfg.env, "start_group", 1) if c.label_baseline == "group" else 1
        self.groups = StartGroups(self.group_size) if self.group_size > 1 else None
        self.generator = torch.Generator().manual_seed(cfg.seed)    # annotation noise, weights, shuffling
        self.iteration = 0
        self.skipped_updates = 0
        self._analysis: dict | None = None

    @staticmethod
    def make_policy(cfg: Config, spec: EnvSpec) -> FlowPolicy:
        return make_flow_policy(cfg, spec)

    @property
    def policy(self) -> FlowPolicy:
        return self._policy

    def policy_state_dict(self) -> dict[str, torch.Tensor]:
        """The workers roll out theta_old."""
        return {k: v.detach().cpu().clone() for k, v in self.old.state_dict().items()}

    # ------------------------------------------------------------------ prepare
    def _tensor(self, x: np.ndarray) -> torch.Tensor:
        t = torch.as_tensor(x, device=self.device)
        return t if t.dtype == torch.uint8 else t.float()

    @torch.no_grad()
    def _annotate(self, obs, actions: torch.Tensor, row_mask: torch.Tensor) -> torch.Tensor:
        """e [M] under theta_old over each chunk's executed rows (``row_mask`` [M, Ta]): per step
        one t_mid (fixed, or U[0.3, 0.7] then e / t_mid^2; grid: e / t_mid^2 averaged over the
        grid's t_mid) and ``n_annotation_samples`` draws of eps per t_mid, in blocks of 4,096 steps."""
        h, m = self.h, actions.shape[0]
        errors = torch.zeros(m, device=self.device)
        uniform, grid = h.tau_mid_sampling == "uniform", h.tau_mid_sampling == "grid"
        for start in range(0, m, 4096):
            sl = slice(start, start + 4096)
            cond = self.old.encoder(map_obs(lambda x: x[sl], obs))
            a = actions[sl]
            if grid:                                  # e / t_mid^2 averaged over the grid
                errors[sl] = sum(self_annotation(self.old.velocity, cond, a, float(t), h.n_annotation_samples,
                                                 self.generator, per_unit_time=True, row_mask=row_mask[sl])
                                 for t in h.tau_mid_grid) / len(h.tau_mid_grid)
                continue
            t_mid = (torch.rand(a.shape[0], generator=self.generator) * 0.4 + 0.3).to(self.device) \
                if uniform else h.tau_mid
            errors[sl] = self_annotation(self.old.velocity, cond, a, t_mid, h.n_annotation_samples,
                                         self.generator, per_unit_time=uniform, row_mask=row_mask[sl])
        return errors

    @torch.no_grad()
    def _oracle_advantages(self, episodes: list[dict], obs, lengths: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """GAE advantages and returns [M] of each complete episode under the side critic."""
        c = self.c
        values = self.critic(obs)                                                # [M]
        advs, rets, start = [], [], 0
        for ep, n in zip(episodes, lengths):
            v = values[start:start + n, None]                                    # [H, 1]
            nxt = torch.cat([v[1:], torch.zeros(1, 1, device=self.device)])
            if ep["truncated"]:                       # time limit: bootstrap from the final obs
                if "final_obs" in ep:
                    final = self._tensor(ep["final_obs"])[None]
                else:
                    final = {k[len("final_obs/"):]: self._tensor(ep[k])[None]
                             for k in ep if k.startswith("final_obs/")}
                nxt[-1, 0] = self.critic(final)[0]
            done = torch.zeros(n, 1, dtype=torch.bool, device=self.device)
            term, trunc = done.clone(), done.clone()
            term[-1], trunc[-1] = bool(ep["terminated"]), bool(ep["truncated"])
            r = self._tensor(ep["rewards"])[:, None]
            a, ret = gae(r, v, nxt, term, trunc, c.gamma, c.gae_lambda)
            advs.append(a[:, 0])
            rets.append(ret[:, 0])
            start += n
        return torch.cat(advs), torch.cat(rets)

    def prepare(self, batches: list[Batch]) -> dict | None:
        h = self.h
        episodes = self.assembler.add(batches)
        if self.groups is not None:                   # GRPO-style: whole start groups only
            episodes = self.groups.add(episodes)
        if not episodes:                              # no episode (group) ended yet: nothing to learn from
            return None
        lengths = [len(ep["rewards"]) for ep in episodes]
        e_count, h_max = len(episodes), max(lengths)
        obs = map_obs(self._tensor, episode_obs(episodes))                           # [M, ...]
        actions = self._tensor(np.concatenate([ep["actions"] for ep in episodes]))   # [M, Ta, Da]
        success = torch.tensor([ep["return"] > 0 for ep in episodes], device=self.device)   # R [E]
        outcome = success                              # what labels and weights read: R, or R permuted
        if h.label_shuffle:                            # the no-signal control
            outcome = success[torch.randperm(e_count, generator=self.generator).to(self.device)]
        if h.label_baseline == "batch":
            labels = centred_labels(outcome, h.label_clip)                            # [E]
        elif h.label_baseline == "group":
            labels = group_labels(outcome, self.group_size, h.label_clip)             # [E]
        else:
            labels = outcome.float()
        label_mean = float(labels.mean())             # over episodes (value: over steps, below)
        steps = torch.tensor(lengths, device=self.device)
        labels = labels.repeat_interleave(steps)                                    # [M] per step
        act = self.cfg.env.act_steps                  # an episode without the record (an older tail): all ran
        executed = torch.as_tensor(np.concatenate([ep.get("executed_rows", np.full(n, act)) for ep, n in
                                                   zip(episodes, lengths)]), device=self.device)   # [M]
        row_mask = executed_row_mask(executed, actions.shape[0], self.cfg.env.horizon_steps,
                                     self.cfg.env.act_steps, self.device)           # [M, Ta]
        errors = self._annotate(obs, actions, row_mask)                              # e [M]
        # [M] -> padded [E, H]: row i holds episode i's steps
        mask = torch.arange(h_max, device=self.device)[None] < torch.tensor(lengths, device=self.device)[:, None]
        pad = lambda flat: torch.zeros(e_count, h_max, device=self.device).masked_scatter(mask, flat)  # noqa: E731
        advantages = returns = None
        if h.weight_mode == "critic_oracle":
            advantages, returns = self._oracle_advantages(episodes, obs, lengths)
        if h.label_baseline == "value":               # V(s) from the earlier batches; it learns R now
            returns = outcome.float().repeat_interleave(steps)                      # [M]
            with torch.no_grad():
                baseline = self.critic(obs)                                         # [M]
            labels = value_labels(returns, baseline, h.label_clip)
            label_mean = float(labels.mean())
            stats_baseline = {"flowsar/baseline_mean": float(baseline.mean()),
                              "flowsar/baseline_corr": float(torch.corrcoef(torch.stack([baseline, returns]))[0, 1])
                              if returns.std() > 0 and baseline.std() > 0 else float("nan")}
        reward_diff = None
        if h.shaped_lambda is not None:               # r_{i+1} - r_i per episode, r_H := r_{H-1}
            diffs = [np.diff(ep["rewards"], append=ep["rewards"][-1:]) for ep in episodes]
            reward_diff = pad(self._tensor(np.concatenate(diffs)))
        weights = credit_weights(pad(errors), outcome, h.temperature, h.weight_mode, mask,
                                 w_min=h.w_min, w_max=h.w_max, shaped_lambda=h.shaped_lambda,
                                 reward_diff=reward_diff,
                                 advantages=pad(advantages) if advantages is not None else None,
                                 generator=self.generator, standardize=h.error_scale == "standardized",
                                 scale=h.weight_scale)                                 # [E, H]
        grasped = pad(self._tensor(np.concatenate([ep["grasped"] for ep in episodes]))) \
            if "grasped" in episodes[0] else None
        self._analysis = self._analysis_sample(pad(errors), weights, mask, success, grasped)
        stats = self._annotation_stats(pad(errors), weights, mask, success)
        stats["flowsar/label_mean"] = label_mean
        if self.group_size > 1:                       # groups with both outcomes: the ones with a contrast
            mixed = success.float().view(-1, self.group_size).std(1) > 0
            stats.update({"flowsar/groups": float(mixed.numel()), "flowsar/groups_mixed": float(mixed.float().mean()),
                          **{f"flowsar/{k}": v for k, v in self.groups.stats.items()}})
        if h.label_baseline == "value":
            stats.update(stats_baseline)
        if advantages is not None:                    # how well self-annotation stands in for a critic
            stats["flowsar/oracle_corr"] = episode_correlation(pad(errors), pad(advantages), mask)
        out = {"obs": obs, "actions": actions, "row_mask": row_mask, "weights": weights[mask],
               "rewards": labels,
               "stats": stats}
        if returns is not None:
            out["returns"] = returns
        return out

    @staticmethod
    def _annotation_stats(errors: torch.Tensor, weights: torch.Tensor, mask: torch.Tensor,
                          success: torch.Tensor) -> dict[str, float]:
        """How much e varies between the steps of an episode (if it does not, the weights go
        uniform: the spec's main risk) and how far the weights are from uniform (read in the
        sum-to-1 scale, whatever weight_scale)."""
        n = mask.sum(1).float()
        weights = weights / weights.sum(1, keepdim=True).clamp_min(1e-30)
        mean = (errors * mask).sum(1) / n
        var = (((errors - mean[:, None]) * mask) ** 2).sum(1) / n.clamp_min(1)
        entropy = -(weights * weights.clamp_min(1e-30).log() * mask).sum(1)
        uniform = n.clamp_min(2).log()
        valid = errors[mask]
        return {"flowsar/episodes": float(len(n)), "flowsar/episode_success": float(success.float().mean()),
                "flowsar/episode_length_mean": float(n.mean()),
                "flowsar/e_mean": float(valid.mean()), "flowsar/e_std": float(valid.std()) if valid.numel() > 1 else 0.0,
                "flowsar/e_within_episode_std": float(var.sqrt().mean()),
                "flowsar/e_within_episode_cv": float((var.sqrt() / mean.clamp_min(1e-12)).mean()),
                "flowsar/weight_entropy_ratio": float((entropy / uniform).mean()),
                "flowsar/weight_max_mean": float(weights.max(1).values.mean())}

    @staticmethod
    def _analysis_sample(errors, weights, mask, success, grasped=None, per_outcome: int = 8) -> dict:
        """The first few success and failure episodes' e and w (and, for robot tasks, whether
        the object was in the gripper after each step), for the analysis plots."""
        idx = torch.cat([torch.nonzero(success).flatten()[:per_outcome],
                         torch.nonzero(~success).flatten()[:per_outcome]])
        arrays = dict(errors=errors, weights=weights, mask=mask, success=success)
        if grasped is not None:
            arrays["grasped"] = grasped.bool()
        return {k: v[idx].cpu().numpy() for k, v in arrays.items()}

    def analysis(self) -> dict | None:
        return self._analysis

    @staticmethod
    def plot_analysis(data: dict, out_dir, iteration: int) -> list:
        from flowrl_ray.plotting import plot_credit_analysis
        return plot_credit_analysis(data, out_dir, iteration)

    # ------------------------------------------------------------------ update
    def _minibatch_loss(self, b: dict, mb: torch.Tensor, part: slice) -> tuple[torch.Tensor, dict]:
        """The mean loss of the rows ``mb[part]`` (a learner group's share of the minibatch
        ``mb``; all of it on one learner). t and eps are drawn for the whole minibatch, so every
        row gets the noise it gets on one learner."""
        h = self.h
        idx = mb[part]
        obs = map_obs(lambda x: x[idx], b["obs"])
        a = b["actions"][idx]                                                   # [share, Ta, Da]
        augment = self.c.augment and isinstance(obs, dict)
        t = (h.t_min + (h.t_max - h.t_min) * torch.rand(len(mb), generator=self.generator))[part].to(self.device)
        eps = torch.randn((len(mb), *a.shape[1:]), generator=self.generator)[part].to(self.device)
        x = (1.0 - t)[:, None, None] * a + t[:, None, None] * eps               # spec's x_t
        u = a - eps                                                             # package's target
        v_cur = self._policy.velocity(x, 1.0 - t, self._policy.encoder(obs, augment))
        with torch.no_grad():
            v_old = self.old.velocity(x, 1.0 - t, self.old.encoder(obs))
        w, r, rows = b["weights"][idx], b["rewards"][idx], b["row_mask"][idx]           # rows [share, Ta]
        loss = flowsar_loss(v_cur, v_old, u, w, r, h.beta, h.energy_type, h.loss_variant, h.kl_coeff, flow_t=t,
                            row_mask=rows)
        with torch.no_grad():
            e_pos, e_neg = mirror_energies(v_cur, v_old, u, h.beta, h.energy_type, t, rows)
            stats = {"flowsar/loss": loss.detach(), "flowsar/energy_pos": e_pos.mean(),
                     "flowsar/energy_neg": e_neg.mean(),
                     "flowsar/kl": row_mean((v_cur - v_old).pow(2), rows).mean(),
                     "flowsar/cfm_loss": row_mean((v_old - u).pow(2), rows).mean()}
        if self.anchor is not None:                    # the CFM distance to the base
            with torch.no_grad():
                v_base = self.anchor.velocity(x, 1.0 - t, self.anchor.encoder(obs))
            anchor = row_mean((v_cur - v_base).pow(2), rows).mean()
            loss = loss + h.anchor_coeff * anchor
            stats["flowsar/anchor"] = anchor.detach()
        if self.critic is not None:
            v_loss = value_loss(self.critic(obs, augment), b["returns"][idx]).mean()
            loss = loss + v_loss
            stats["flowsar/v_loss"] = v_loss.detach()
        return loss, stats

    def update(self, b: dict | None) -> dict[str, float]:
        c, h = self.c, self.h
        out: dict[str, float] = {"flowsar/pending_steps": float(self.assembler.pending_steps)}
        if b is None:
            if self.groups is not None:
                out.update({f"flowsar/{k}": v for k, v in self.groups.stats.items()})
            return out
        m = b["actions"].shape[0]
        optimizers = [self.opt] + ([self.critic_opt] if self.critic_opt else [])
        stats: dict[str, list[float]] = {}
        steps = 0
        for _ in range(c.epochs):
            for mb in minibatches(m, c.minibatch_size, self.generator, self.device):
                part = local_part(len(mb))                     # a learner group: this rank's share
                share = (part.stop - part.start) / len(mb)
                loss, mb_stats = self._minibatch_loss(b, mb, part)
                # joint=True: the policy and the optional critic are clipped together by one
                # norm, as FlowSAR always did (per-network clipping would change its numbers
                # when the critic is on; FlowSAR's own behaviour is decided separately).
                keys = sorted(mb_stats)                        # the minibatch's means: the shares' summed
                values = torch.stack([mb_stats[k].detach().float() for k in keys]) * share   # (in the step's all-reduce)
                (grad_norm,), stepped = optimizer_step(loss * share, optimizers, c.max_grad_norm, joint=True,
                                                       also_sum=values)
                self.skipped_updates += int(not stepped)
                steps += 1
                mb_stats = dict(zip(keys, values.tolist()), **{"flowsar/grad_norm": grad_norm})
                for k, v in mb_stats.items():
                    stats.setdefault(k, []).append(float(v))
        b_ema = ema_coefficient(self.iteration, h.ema_schedule, h.ema_beta, h.ema_eta_rate, h.ema_eta_max)
        ema_update(self.old, self._policy, b_ema)
        self.iteration += 1
        lr = self.opt.param_groups[0]["lr"]               # the lr this update used
        self.scheduler.step()
        out.update({k: float(np.mean(v)) for k, v in stats.items()})
        out.update(b["stats"])
        out.update({"flowsar/ema_coefficient": b_ema, "flowsar/steps": float(steps),
                    "flowsar/samples": float(m), "flowsar/lr": lr,
                    "flowsar/skipped_updates": float(self.skipped_updates)})
        return out

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        state = {"policy": self._policy.state_dict(), "old": self.old.state_dict(),
                 "opt": self.opt.state_dict(), "scheduler": self.scheduler.state_dict(),
                 "assembler": self.assembler.state_dict(),
                 "generator": self.generator.get_state(), "iteration": self.iteration,
                 "skipped_updates": self.skipped_updates}
        if self.critic is not None:
            state.update(critic=self.critic.state_dict(), critic_opt=self.critic_opt.state_dict())
        if self.anchor is not None:
            state["anchor"] = self.anchor.state_dict()
        if self.groups is not None:
            state["groups"] = self.groups.state_dict()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._policy.load_state_dict(state["policy"])
        self.old.load_state_dict(state["old"])
        self.opt.load_state_dict(state["opt"])
        if "scheduler" in state:                      # checkpoints from before the warm-up have none
            self.resume_notes = tuple(load_scheduler(self.scheduler, state["scheduler"], "flowsar lr"))
        self.assembler.load_state_dict(state["assembler"])
        if self.groups is not None and "groups" in state:       # older checkpoints: none waiting
            self.groups.load_state_dict(state["groups"])
        self.generator.set_state(state["generator"])
        self.iteration, self.skipped_updates = state["iteration"], state["skipped_updates"]
        if self.critic is not None:
            self.critic.load_state_dict(state["critic"])
            self.critic_opt.load_state_dict(state["critic_opt"])
        if self.anchor is not None and "anchor" in state:     # else (turned on at a resume): the base loaded
            self.anchor.load_state_dict(state["anchor"])
