"""FPO++ (Yi, Choi et al., 2026, "Flow Policy Gradients for Robot Control"): PPO for a
flow-matching action policy, with the likelihood ratio replaced by CFM-loss differences.

    rollout (worker): a ~ pi_old(. | o) by K Euler steps from eps ~ N(0, I); draw N_mc pairs
                      (tau_i, eps_i); the env reports how many rows of the chunk it executed
    prepare:          V(o_t), GAE -> flat [M] advantages, returns; the row mask [M, Ta] of the
                      executed rows (the first act_steps, fewer where the episode ended inside
                      the chunk); image observations get one random shift per sample (DPPO's
                      augmentation, kept for every epoch); then, with the rollout weights,
                      l_old_i = || v_old(x_i, tau_i | o) - (a - eps_i) ||^2 over the executed rows
                      (sync: the learner's weights are the rollout weights, so the learner computes
                      l_old on the same augmented images and in the same precision as l_new: every
                      ratio is exactly 1 before the first step; async: the workers record each
                      row's l_old at sampling time, and augmentation is refused)
    update:           per sample  rho_i = exp(clamp(l_old_i - l_new_i, +-diff_clamp))     (Eq. 10)
                      (ratio_mode "averaged": one rho per action from the mean difference, Eq. 9)
                      maximise mean_i psi(rho_i, A)  psi = PPO clip, or ASPO (Eq. 12-13)
                      + value loss; critic warm-up (actor frozen), target-KL stop, grad clip,
                      separate actor / critic learning rates.

The CFM loss of a sample averages the squared error over the action dims and sums it over the
chunk's rows (the release's scale; ``cfm_reduction: sum`` sums over the action dims too, and
``cfm_huber_delta`` > 0 uses the release's Huber error instead); the same advantage is shared by
an action's N_mc samples. Evaluation integrates from
eps = 0 ("zero-sampling", ``eval.sampling: zero``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, Optional

import torch

from flowrl_ray.algorithms.advantages import normalize
from flowrl_ray.algorithms.flow_actor_critic import FlowActorCritic
from flowrl_ray.algorithms.losses import approx_kl, aspo_objective, ppo_clip_objective, value_loss
from flowrl_ray.algorithms.onpolicy import advantages_from_rollouts
from flowrl_ray.batch import Batch, map_obs
from flowrl_ray.config import Config, ConfigError, check
from flowrl_ray.envs import EnvSpec
from flowrl_ray.models.flow import FlowPolicy, random_shift, sum_rows
from flowrl_ray.models.flow_policy import image_shape, make_flow_policy, records_old_losses

@dataclass
class FPOPPConfig:
    #: earlier or paper names of keys, accepted and mapped to the one name (config/compat.py)
    ALIASES = {"actor_lr": "lr", "actor_lr_warmup_iters": "lr_warmup_iters"}
    base_policy: Optional[str] = None   # a `flowrl-ray pretrain` checkpoint; None: random init
    # the flow policy (must match the base policy's; `flowrl-ray pretrain` reads the same keys)
    hidden_sizes: list = field(default_factory=lambda: [512, 512, 512])
    time_dim: int = field(default=32, metadata=check(gt=0))
    feature_dim: int = field(default=64, metadata=check(gt=0))      # image encoder output
    flow_steps: int = field(default=10, metadata=check(gt=0))       # K Euler steps
    # the velocity network's form (defaults: this package's; a base from `flowrl-ray
    # import-reinflow` needs the ReinFlow FlowMLP's, which that command prints)
    time_embedding: Literal["flowrl", "reinflow"] = "flowrl"
    velocity_mlp: Literal["plain", "residual"] = "plain"
    velocity_activation: Literal["mish", "relu", "tanh", "elu", "gelu", "silu", "softplus"] = "mish"
    # the Euler sampler: tau_k = k / K ("left") or linspace(0, 1, K) (the ReFlow release's), and
    # whether every intermediate x is clipped to [-1, 1] (the release's default)
    flow_time_grid: Literal["left", "linspace"] = "left"
    flow_clip_intermediate: bool = False
    # FPO++
    n_mc: int = field(default=8, metadata=check(gt=0))              # (tau, eps) pairs per action
    clip: float = field(default=0.05, metadata=check(gt=0))
    use_aspo: bool = False              # PPO clip for A >= 0, SPO for A < 0
    ratio_mode: Literal["per_sample", "averaged"] = "per_sample"
    cfm_loss_clamp: float = field(default=0.0, metadata=check(ge=0))   # 0: off
    cfm_diff_clamp: float = field(default=5.0, metadata=check(ge=0))   # 0: off
    # > 0: each element's error is Huber (squared inside delta, linear outside) before the sum,
    # as in the FPO++ release's manipulation runs; 0: the squared error
    cfm_huber_delta: float = field(default=0.0, metadata=check(ge=0))
    # a chunk's CFM loss: "mean_dims" averages the error over the action dims and sums it over the
    # executed rows (the FPO++ paper's and release's scale, which its clip and clamps assume);
    # "sum" sums over the action dims too (Da times larger log-ratios; kept for the ablation)
    cfm_reduction: Literal["mean_dims", "sum"] = "mean_dims"
    # PPO machinery
    gamma: float = field(default=0.99, metadata=check(ge=0, le=1))
    gae_lambda: float = field(default=0.99, metadata=check(ge=0, le=1))
    reward_scale: float = field(default=1.0, metadata=check(gt=0))
    # false: the time limit ends the task (success must come within max_episode_steps), so a
    # timed-out episode bootstraps nothing; true: V(final obs), for limits that only cut episodes
    bootstrap_truncated: bool = True
    epochs: int = field(default=5, metadata=check(gt=0))
    minibatch_size: int = field(default=500, metadata=check(gt=0))
    grad_accumulation: int = field(default=1, metadata=check(gt=0))  # minibatch split in parts
    normalize_advantages: bool = True
    lr: float = field(default=1e-5, metadata=check(gt=0))
    critic_lr: float = field(default=1e-4, metadata=check(gt=0))
    lr_schedule: Literal["constant", "cosine"] = "constant"
    # Linear warm-up of the actor's lr over its first iterations: Adam's first steps are
    # lr * sign(g) on every weight, a large move in function space while its moment
    # estimates are still empty.
    lr_warmup_iters: int = field(default=0, metadata=check(ge=0))
    weight_decay: float = field(default=0.0, metadata=check(ge=0))
    vf_coef: float = field(default=0.5, metadata=check(ge=0))
    max_grad_norm: float = field(default=1.0, metadata=check(gt=0))
    target_kl: Optional[float] = field(default=None, metadata=check(gt=0))
    critic_warmup_iters: int = field(default=2, metadata=check(ge=0))
    critic_hidden_sizes: list = field(default_factory=lambda: [256, 256, 256])
    # image observations: one random shift per sample per iteration, shared by the old and new
    # losses and every epoch (sync mode only: async workers record the old losses un-augmented)
    augment: bool = True


def fpopp_ratios(old_losses: torch.Tensor, new_losses: torch.Tensor, loss_clamp: float,
                 diff_clamp: float, mode: str = "per_sample") -> torch.Tensor:
    """FPO's likelihood-ratio surrogate from CFM losses [B, N] -> ratios [B, N].

        l <- clamp(l, 0, loss_clamp)                     (both losses; off when loss_clamp = 0)
        per_sample (FPO++, Eq. 10): rho_i = exp(clamp(l_old_i - l_new_i, -c, c))
        averaged   (FPO,   Eq. 9):  rho   = exp(clamp(mean_i (l_old_i - l_new_i), -c, c)),
                                    repeated over the N samples
    (c = diff_clamp; off when 0)."""
    if loss_clamp > 0:
        old_losses, new_losses = old_losses.clamp(0, loss_clamp), new_losses.clamp(0, loss_clamp)
    diff = old_losses - new_losses                                       # [B, N]
    if mode == "averaged":
        diff = diff.mean(-1, keepdim=True).expand_as(diff)
    elif mode != "per_sample":
        raise ValueError(f"ratio mode must be 'per_sample' or 'averaged', got {mode!r}")
    if diff_clamp > 0:
        diff = diff.clamp(-diff_clamp, diff_clamp)
    return diff.exp()


def fpopp_objective(ratios: torch.Tensor, advantages: torch.Tensor, clip: float,
                    use_aspo: bool) -> torch.Tensor:
    """Eq. 13 per sample: psi(rho_i, A) with A [B] shared by the N samples of its action.
    ratios [B, N] -> objective [B, N] (to maximise)."""
    adv = advantages[:, None].expand_as(ratios)
    return aspo_objective(ratios, adv, clip) if use_aspo else ppo_clip_objective(ratios, adv, clip)


class FPOPP(FlowActorCritic):
    config_class = FPOPPConfig
    prefix, title = "fpopp", "FPO++"

    @classmethod
    def validate_config(cls, cfg: Config) -> None:
        c: FPOPPConfig = cfg.algo
        cls.check_flow_config(cfg)
        if c.augment and cfg.runtime.mode == "async" and image_shape(cfg) is not None:
            raise ConfigError("config key 'algo.augment': async rollout workers record the old CFM "
                              "losses on un-augmented images (the learner no longer holds their "
                              "weights), so a shift would bias every ratio; set algo.augment: false "
                              "or runtime.mode: sync")
        if c.grad_accumulation > c.minibatch_size:
            raise ConfigError(f"config key 'algo.grad_accumulation': {c.grad_accumulation} parts of a "
                              f"{c.minibatch_size}-sample minibatch")

    @staticmethod
    def make_policy(cfg: Config, spec: EnvSpec) -> FlowPolicy:
        return make_flow_policy(cfg, spec)

    def _grad_accumulation(self) -> int:
        return self.c.grad_accumulation

    # ------------------------------------------------------------------ prepare
    def prepare(self, batches: list[Batch]) -> dict:
        c = self.c
        b = advantages_from_rollouts(batches, self.values, c.gamma, c.gae_lambda, c.reward_scale, self.device,
                                     c.bootstrap_truncated)
        self._add_row_mask(b)                                                             # [M, Ta]
        if isinstance(b["obs"], dict) and c.augment:
            b["obs"]["rgb"] = self._shifted(b["obs"]["rgb"])
        if records_old_losses(self.cfg):              # async: the worker's per-row losses
            b["cfm_old"] = sum_rows(b["cfm_old"], b["row_mask"])                          # [M, N]
        else:                                         # sync: these weights sampled the batch
            b["cfm_old"] = self._old_losses(b)                                            # [M, N]
        return b

    @torch.no_grad()
    def _shifted(self, rgb: torch.Tensor) -> torch.Tensor:
        """One random shift per image [M, C, H, W] uint8 (a pure pixel move, exact in uint8),
        drawn from the algorithm's generator (exact resume)."""
        step = max(1, self.c.minibatch_size // self.c.grad_accumulation)
        return torch.cat([random_shift(rgb[i:i + step].float(), generator=self.generator).to(torch.uint8)
                          for i in range(0, rgb.shape[0], step)])

    @torch.no_grad()
    def _old_losses(self, b: dict) -> torch.Tensor:
        """[M, N] CFM losses of the batch under the current (= rollout) weights, over the executed
        rows, in the update's part size (memory)."""
        step = max(1, self.c.minibatch_size // self.c.grad_accumulation)
        out = []
        for i in range(0, b["actions"].shape[0], step):
            sl = slice(i, i + step)
            obs = map_obs(lambda x: x[sl], b["obs"])
            out.append(self._policy.cfm_losses(obs, b["actions"][sl], b["taus"][sl], b["mc_eps"][sl],
                                               row_mask=b["row_mask"][sl]))
        return torch.cat(out)

    # ------------------------------------------------------------------ update
    def _losses(self, b: dict, idx: torch.Tensor, mb: torch.Tensor, train_actor: bool) -> tuple[torch.Tensor, dict]:
        """Loss of the minibatch rows ``idx`` and its statistics."""
        c = self.c
        obs = map_obs(lambda x: x[idx], b["obs"])
        # image observations were shifted once in prepare: the actor's old and new losses and the
        # critic see the same images in every epoch
        v_loss = value_loss(self.critic(obs), b["returns"][idx]).mean()
        if not train_actor:                           # critic warm-up: the actor is frozen
            return c.vf_coef * v_loss, {"v_loss": v_loss.detach()}
        old = b["cfm_old"][idx]                                                   # [mb, N]
        new = self._policy.cfm_losses(obs, b["actions"][idx], b["taus"][idx], b["mc_eps"][idx],
                                      row_mask=b["row_mask"][idx])                        # [mb, N]
        ratios = fpopp_ratios(old, new, c.cfm_loss_clamp, c.cfm_diff_clamp, c.ratio_mode)   # [mb, N]
        adv = b["advantages"][idx]
        adv = normalize(adv, ref=b["advantages"][mb]) if c.normalize_advantages else adv   # the minibatch's statistics
        pg_loss = -fpopp_objective(ratios, adv, c.clip, c.use_aspo).mean()
        with torch.no_grad():
            log_ratio = ratios.log()
            stats = {"pg_loss": pg_loss.detach(), "v_loss": v_loss.detach(), "ratio_mean": ratios.mean(),
                     "ratio_std": ratios.std(), "ratio_min": ratios.min(), "ratio_max": ratios.max(),
                     "clipfrac": ((ratios - 1.0).abs() > c.clip).float().mean(),
                     "approx_kl": approx_kl(log_ratio),
                     "cfm_loss_new_mean": new.mean(), "cfm_loss_old_mean": old.mean(),
                     # (tau, eps) pairs past the loss clamp: their ratio is constant, no gradient
                     "cfm_clamped_frac": (new > c.cfm_loss_clamp).float().mean() if c.cfm_loss_clamp > 0
                     else torch.zeros(())}
        return pg_loss + c.vf_coef * v_loss, stats
